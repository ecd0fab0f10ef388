/*
 * tools/conformance_contract.c - loom-conformance's checks of the ABI contract itself: copies
 * each way, allocation failure reported as such, and a module loaded, used and unloaded 20
 * times.
 */
#define _GNU_SOURCE
#include "conformance.h"
#include "conformance_cases.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- Contract checks -------------------------------------------------------------------- */

/* Copies, each call judged on its own: host -> device -> host first (copy_from_host and
 * copy_to_host), then copy_buffer and buffer_memset read back only once that round trip is
 * known good, so a copy bug is reported as one and not blamed on memset. */
void check_copies(loom_device *d, report *r)
{
    static const uint64_t sizes[] = {0, 1, 7, 4096, (1u << 20) + 3};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        uint64_t n = sizes[i];
        unsigned char *src = malloc(n + 16), *back = malloc(n + 16);
        for (uint64_t k = 0; k < n + 16; k++)
            src[k] = (unsigned char)rng_u32();
        loom_buffer *a = NULL, *b = NULL;
        char name[96];
        snprintf(name, sizeof name, "copy round trip %llu bytes", (unsigned long long)n);
        loom_status st = d->ops.buffer_alloc(d->be, n + 16, &a);
        if (st == LOOM_OK)
            st = d->ops.buffer_alloc(d->be, n + 16, &b);
        /* host -> a at offset 3 -> host */
        if (st == LOOM_OK)
            st = d->ops.copy_from_host(d->be, a, 3, src, n);
        if (st == LOOM_OK)
            st = d->ops.synchronize(d->be);
        if (st == LOOM_OK)
            st = d->ops.copy_to_host(d->be, back, a, 3, n);
        int round_trip = st == LOOM_OK && memcmp(src, back, n) == 0;
        if (st != LOOM_OK)
            record(r, name, 0, "status %d: %s", st, d->ops.last_error(d->be));
        else
            record(r, name, round_trip,
                   round_trip ? NULL
                              : "copy_from_host then copy_to_host "
                                "at offset 3 gives other bytes back");
        if (round_trip && d->ops.copy_buffer) { /* a at 3 -> b at 5 -> host */
            snprintf(name, sizeof name, "copy_buffer %llu bytes", (unsigned long long)n);
            st = d->ops.copy_buffer(d->be, b, 5, a, 3, n);
            if (st == LOOM_OK)
                st = d->ops.synchronize(d->be);
            if (st == LOOM_OK)
                st = d->ops.copy_to_host(d->be, back, b, 5, n);
            int ok = st == LOOM_OK && memcmp(src, back, n) == 0;
            record(r, name, ok,
                   ok                  ? NULL
                       : st != LOOM_OK ? "status %d: %s"
                                       : "other bytes arrive",
                   st, d->ops.last_error(d->be));
        }
        if (d->ops.buffer_memset && n > 2) {
            snprintf(name, sizeof name, "memset %llu bytes", (unsigned long long)n - 2);
            if (!round_trip) {
                if (!r->quiet)
                    printf("  (%s not checked: copies, which it is read back with, are wrong)\n",
                           name);
            } else {
                st = d->ops.copy_from_host(d->be, a, 3, src, n);
                if (st == LOOM_OK)
                    st = d->ops.buffer_memset(d->be, a, 4, 0x5a, n - 2);
                if (st == LOOM_OK)
                    st = d->ops.synchronize(d->be);
                if (st == LOOM_OK)
                    st = d->ops.copy_to_host(d->be, back, a, 3, n);
                int ok = st == LOOM_OK && back[0] == src[0] && back[n - 1] == src[n - 1];
                for (uint64_t k = 1; ok && k < n - 1; k++)
                    ok = back[k] == 0x5a;
                record(r, name, ok, ok ? NULL : "wrong bytes after memset");
            }
        }
        if (a)
            d->ops.buffer_free(d->be, a);
        if (b)
            d->ops.buffer_free(d->be, b);
        free(src), free(back);
    }
    /* buffer_alloc(0) gives a buffer (of nothing) that buffer_free takes */
    loom_buffer *empty = NULL;
    loom_status st = d->ops.buffer_alloc(d->be, 0, &empty);
    record(r, "buffer_alloc(0) succeeds", st == LOOM_OK && empty,
           st != LOOM_OK ? "status %d: %s"
               : empty   ? NULL
                         : "LOOM_OK but no buffer",
           st, d->ops.last_error(d->be));
    if (st == LOOM_OK && empty)
        d->ops.buffer_free(d->be, empty);
    /* out-of-range copies are refused with LOOM_ERR_INVALID, and write nothing */
    loom_buffer *small = NULL;
    unsigned char tmp[64], pattern[16], after[16];
    for (int i = 0; i < 16; i++)
        pattern[i] = (unsigned char)(0xa0 + i);
    if (d->ops.buffer_alloc(d->be, 16, &small) == LOOM_OK &&
        d->ops.copy_from_host(d->be, small, 0, pattern, 16) == LOOM_OK) {
        static const char *const what[3] = {"copy_from_host", "copy_to_host", "copy_buffer"};
        for (int c = 0; c < 3; c++) {
            memset(tmp, 0x11, sizeof tmp);
            if (c == 2 && !d->ops.copy_buffer)
                continue;
            st = c == 0  ? d->ops.copy_from_host(d->be, small, 8, tmp, 64)
                : c == 1 ? d->ops.copy_to_host(d->be, tmp, small, 8, 64)
                         : d->ops.copy_buffer(d->be, small, 12, small, 0, 8);
            d->ops.synchronize(d->be);
            int intact = d->ops.copy_to_host(d->be, after, small, 0, 16) == LOOM_OK &&
                memcmp(after, pattern, 16) == 0;
            for (int k = 0; c == 1 && k < 64; k++)
                intact &= tmp[k] == 0x11;
            char name[96];
            snprintf(name, sizeof name, "%s past the end of a buffer is refused", what[c]);
            record(r, name, st == LOOM_ERR_INVALID && intact,
                   st == LOOM_OK                ? "it returned LOOM_OK"
                       : st != LOOM_ERR_INVALID ? "status %d, not LOOM_ERR_INVALID"
                       : !intact                ? "refused, but bytes were written anyway"
                                                : NULL,
                   st);
        }
    }
    if (small)
        d->ops.buffer_free(d->be, small);
    if (d->ops.buffer_host_ptr) {
        loom_buffer *b = NULL;
        if (d->ops.buffer_alloc(d->be, 64, &b) == LOOM_OK) {
            unsigned char bytes[64];
            for (int i = 0; i < 64; i++)
                bytes[i] = (unsigned char)(i * 7);
            d->ops.copy_from_host(d->be, b, 0, bytes, 64);
            d->ops.synchronize(d->be);
            unsigned char *p = d->ops.buffer_host_ptr(d->be, b);
            record(r, "host-visible buffer shows copied bytes", !p || memcmp(p, bytes, 64) == 0,
                   p && memcmp(p, bytes, 64) ? "buffer_host_ptr disagrees with the copy" : NULL);
            d->ops.buffer_free(d->be, b);
        }
    }
}

void check_oom(loom_device *d, report *r)
{
    loom_buffer *b = NULL;
    loom_status st = d->ops.buffer_alloc(d->be, 1ull << 60, &b);
    const char *msg = d->ops.last_error(d->be);
    int ok = st != LOOM_OK && msg && msg[0];
    record(r, "allocating 2^60 bytes fails with an error", ok,
           st == LOOM_OK ? "it returned OK"
               : !ok     ? "no message from last_error"
                         : "status %d: %s",
           st, msg);
    if (st == LOOM_OK && b)
        d->ops.buffer_free(d->be, b);
}

/* Opens the module under test: a backend as it is, a decorator (ABI 1.3) around a fresh ref,
 * with no config (a decorator's quietest setting), so that every check sees what passes
 * through it. */
int open_target(loom_device *d, const char *path, uint32_t kind, const char *ref_path, char *err,
                size_t err_size)
{
    if (kind != LOOM_MODULE_DECORATOR)
        return loom_device_open(d, path, 0, 0, err, err_size);
    return loom_device_open(d, ref_path, 0, 0, err, err_size) != 0
        ? -1
        : loom_device_decorate(d, path, NULL, err, err_size);
}

void check_reload(const char *path, uint32_t kind, const char *ref_path, report *r)
{
    const int rounds = 20;
    char err[1024] = "";
    int i;
    for (i = 0; i < rounds; i++) {
        loom_device d;
        if (open_target(&d, path, kind, ref_path, err, sizeof err) != 0)
            break;
        loom_buffer *b = NULL;
        float v[64] = {0};
        int ok = d.ops.buffer_alloc(d.be, sizeof v, &b) == LOOM_OK &&
            d.ops.copy_from_host(d.be, b, 0, v, sizeof v) == LOOM_OK &&
            d.ops.synchronize(d.be) == LOOM_OK;
        if (b)
            d.ops.buffer_free(d.be, b);
        loom_device_close(&d);
        if (!ok) {
            snprintf(err, sizeof err, "buffer use failed in round %d", i);
            break;
        }
    }
    record(r, "load, use and unload 20 times", i == rounds, i == rounds ? NULL : "%s", err);
}
