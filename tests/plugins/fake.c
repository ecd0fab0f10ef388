/*
 * tests/plugins/fake.c - one source, built as several small modules that each misbehave (or
 * behave) in one way the loader must handle: a newer ABI minor, another major, no entry
 * symbol, no device, an op table from an older header, a missing library dependency, a probe
 * that aborts, crashes, hangs or exits, one that writes into the probe's pipe or leaves a
 * process behind, one whose device does not open, and three "cpu" variants for the selection rules. The macros set by tests/Makefile.inc pick the
 * behaviour. Buffers are plain malloc; no op is implemented.
 */
#define _GNU_SOURCE
#include <loom/backend.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#ifndef FAKE_NAME
#define FAKE_NAME "fake"
#endif
#ifndef FAKE_VARIANT
#define FAKE_VARIANT ""
#endif
#ifndef FAKE_SCORE
#define FAKE_SCORE 50
#endif
#ifndef FAKE_ABI_MAJOR
#define FAKE_ABI_MAJOR LOOM_BACKEND_ABI_MAJOR
#endif
#ifndef FAKE_ABI_MINOR
#define FAKE_ABI_MINOR LOOM_BACKEND_ABI_MINOR
#endif

struct loom_buffer {
    unsigned char *data;
    uint64_t size;
};

static loom_status fake_alloc(loom_backend *be, uint64_t size, loom_buffer **out)
{
    (void)be;
    loom_buffer *b = calloc(1, sizeof *b);
    if (!b || size > (1ull << 40) || !(b->data = malloc(size ? size : 1))) {
        free(b);
        return LOOM_ERR_OUT_OF_MEMORY;
    }
    b->size = size;
    *out = b;
    return LOOM_OK;
}

static void fake_free(loom_backend *be, loom_buffer *b)
{
    (void)be;
    if (b)
        free(b->data);
    free(b);
}

static loom_status fake_from_host(loom_backend *be, loom_buffer *dst, uint64_t off, const void *src,
                                  uint64_t n)
{
    (void)be;
    if (off > dst->size || n > dst->size - off)
        return LOOM_ERR_INVALID;
    memcpy(dst->data + off, src, n);
    return LOOM_OK;
}

static loom_status fake_to_host(loom_backend *be, void *dst, loom_buffer *src, uint64_t off,
                                uint64_t n)
{
    (void)be;
    if (off > src->size || n > src->size - off)
        return LOOM_ERR_INVALID;
    memcpy(dst, src->data + off, n);
    return LOOM_OK;
}

static loom_status fake_sync(loom_backend *be)
{
    (void)be;
    return LOOM_OK;
}

static int fake_supports(loom_backend *be, loom_op op, loom_dtype dt)
{
    (void)be, (void)op, (void)dt;
    return 1; /* claims everything: the host must still not call what the table lacks */
}

static const char *fake_last_error(loom_backend *be)
{
    (void)be;
    return "fake backend: nothing implemented";
}

static void fake_close(loom_backend *be)
{
    free(be);
}

#ifdef FAKE_OLD_OPS
/* Placed in the table past the declared size by FAKE_OLD_OPS: calling it is a host bug. */
static loom_status fake_trap(loom_backend *be, const loom_matmul_params *p)
{
    (void)be, (void)p;
    fprintf(stderr, "fake backend: the host called an op beyond the declared table size\n");
    abort();
}
#endif

#ifdef FAKE_ABI_1_0_OPS
/* The table as ABI 1.0 had it, ending after convert; prepare_weight (1.1) holds a trap past
 * the declared size. */
static loom_status fake_prepare_trap(loom_backend *be, const loom_tensor *w, loom_tensor *out)
{
    (void)be, (void)w, (void)out;
    fprintf(stderr, "fake backend: the host called prepare_weight beyond the declared table\n");
    abort();
}
#endif

static const loom_backend_ops fake_ops = {
#ifdef FAKE_OLD_OPS
    .struct_size = offsetof(loom_backend_ops, matmul),
    .matmul = fake_trap,
#elif defined(FAKE_ABI_1_0_OPS)
    .struct_size = offsetof(loom_backend_ops, prepare_weight),
    .prepare_weight = fake_prepare_trap,
#else
    .struct_size = sizeof(loom_backend_ops),
#endif
    .close = fake_close,
    .last_error = fake_last_error,
    .supports = fake_supports,
    .buffer_alloc = fake_alloc,
    .buffer_free = fake_free,
    .copy_from_host = fake_from_host,
    .copy_to_host = fake_to_host,
    .synchronize = fake_sync,
};

#ifdef FAKE_NEEDS_GONE
int loom_test_gone_function(void); /* in a library that is not on the loader's path */
#endif

static void fake_probe(loom_probe_result *out)
{
    /* the probes that must not take loom down: FAKE_PROBE_FAULT abort, segv, hang or exit */
#if defined(FAKE_PROBE_FAULT)
    const char *fault = FAKE_PROBE_FAULT;
    if (!strcmp(fault, "abort"))
        abort();
    if (!strcmp(fault, "segv")) {
        volatile int *volatile bad = (volatile int *)(uintptr_t)8; /* opaque to the compiler */
        *bad = 1;
    }
    if (!strcmp(fault, "hang"))
        for (;;)
            sleep(1);
    if (!strcmp(fault, "exit"))
        exit(3);
    if (!strcmp(fault, "flood")) {
        /* 8 KiB of 'A' into every descriptor that may be the probe's pipe */
        static char junk[8192];
        memset(junk, 'A', sizeof junk);
        for (int fd = 3; fd < 256; fd++)
            if (write(fd, junk, sizeof junk) < 0) {
            }
    }
    if (!strcmp(fault, "orphan")) {
        /* a process that outlives the probe, holding its pipe, and writes its pid where
         * FAKE_PIDFILE says; the probe itself exits without answering */
        pid_t child = fork();
        if (child == 0) {
            const char *pidfile = getenv("FAKE_PIDFILE");
            FILE *f = pidfile ? fopen(pidfile, "w") : NULL;
            if (f)
                fprintf(f, "%d\n", (int)getpid()), fclose(f);
            for (;;)
                sleep(1);
        }
        sleep(1); /* let it write the file */
        _exit(4);
    }
#endif
#ifdef FAKE_NEEDS_GONE
    out->score = loom_test_gone_function();
#else
    out->score = FAKE_SCORE;
#endif
    if (out->score <= 0) {
        snprintf(out->reason, sizeof out->reason, "no device: the fake probe found none");
        return;
    }
    out->n_devices = 2;
    for (int i = 0; i < 2; i++) {
        snprintf(out->devices[i].name, sizeof out->devices[i].name, "fake device %d", i);
        out->devices[i].memory_bytes = (uint64_t)(i + 1) << 30;
    }
}

static loom_status fake_open(const loom_backend_options *opts, loom_backend **out, char *err,
                             size_t err_size)
{
#ifdef FAKE_OPEN_FAILS
    (void)out;
    snprintf(err, err_size, "the fake device %d would not open", opts->device);
    return LOOM_ERR_DEVICE;
#endif
    if (opts->device < 0 || opts->device > 1) {
        snprintf(err, err_size, "no device %d", opts->device);
        return LOOM_ERR_INVALID;
    }
    loom_backend *be = calloc(1, sizeof *be);
    if (!be)
        return LOOM_ERR_OUT_OF_MEMORY;
    be->ops = &fake_ops;
    *out = be;
    return LOOM_OK;
}

static const loom_backend_module fake_module = {
    .struct_size = sizeof(loom_backend_module),
    .abi_major = FAKE_ABI_MAJOR,
    .abi_minor = FAKE_ABI_MINOR,
    .name = FAKE_NAME,
    .variant = FAKE_VARIANT,
    .description = "a test module",
    .probe = fake_probe,
    .open = fake_open,
};

#ifdef FAKE_NO_ENTRY
LOOM_BACKEND_EXPORT const loom_backend_module *not_the_entry(void)
#else
LOOM_BACKEND_EXPORT const loom_backend_module *loom_backend_entry(uint32_t host_major,
                                                                  uint32_t host_minor)
#endif
{
#ifndef FAKE_NO_ENTRY
    (void)host_major, (void)host_minor;
#endif
    return &fake_module;
}
