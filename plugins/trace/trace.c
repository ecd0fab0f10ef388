/*
 * plugins/trace/trace.c - op tracing as a plugin. A decorator module (ABI 1.3): loom opens it
 * around whichever backend it chose (LOOM_TRACE=FILE, or LOOM_PROFILE=1 for the table alone),
 * and it forwards every call to that backend, timing each one. Ops, weight preparation, copies,
 * allocations and synchronisations each become one Chrome trace event (Perfetto and
 * chrome://tracing open the file); a per-op table goes to stderr when the backend closes.
 *
 * config (loom_backend_options.config): a file to write the trace to and print the table,
 * "" for the table alone, NULL for neither (loom-conformance, checking that it is transparent).
 *
 * Written only against <loom/backend.h>, as a third party's module would be: it knows nothing
 * of the backend it wraps but its table. Each call is followed by the backend's synchronize,
 * so the time of an asynchronous backend's op is its device time, and the trace serialises
 * what would otherwise overlap: tracing costs speed, and when it is off, this file is not
 * loaded at all.
 */
#define _POSIX_C_SOURCE 200809L
#include <loom/backend.h>

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* What the table counts: the ops in loom_op order, then the calls that are not ops. */
enum {
    CALL_PREPARE_WEIGHT = LOOM_OP_COUNT,
    CALL_COPY_FROM_HOST,
    CALL_COPY_TO_HOST,
    CALL_COPY_BUFFER,
    CALL_MEMSET,
    CALL_SYNCHRONIZE,
    CALL_ALLOC,
    CALL_FREE,
    N_CALLS
};

static const char *call_name(int call)
{
    static const char *const extra[] = {"prepare_weight", "copy_from_host", "copy_to_host",
                                        "copy_buffer",    "buffer_memset",  "synchronize",
                                        "buffer_alloc",   "buffer_free"};
    return call < LOOM_OP_COUNT ? loom_op_name((loom_op)call) : extra[call - LOOM_OP_COUNT];
}

static const char *call_category(int call)
{
    if (call < LOOM_OP_COUNT || call == CALL_PREPARE_WEIGHT)
        return "op";
    if (call == CALL_ALLOC || call == CALL_FREE)
        return "memory";
    return call == CALL_SYNCHRONIZE ? "sync" : "copy";
}

#define N_DTYPE_SLOTS 32 /* loom_dtype ids are below 32 */

typedef struct call_stats {
    uint64_t calls, bytes;
    double ms;
} call_stats;

typedef struct tracer {
    loom_backend base;    /* first: loom holds a pointer to this */
    loom_backend_ops ops; /* this instance's table: NULL wherever the inner backend's is */
    loom_backend *inner;
    loom_backend_ops in;  /* the inner table, zero past the size it declared */
    pthread_mutex_t lock; /* one event at a time, should several threads share the backend */
    FILE *out;            /* the trace file, or NULL */
    int summary;          /* print the per-op table at close */
    char path[1024];
    double t0_ms; /* when the trace began */
    uint64_t events;
    call_stats stats[N_CALLS][N_DTYPE_SLOTS];
} tracer;

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* ---- What one call looked like ----------------------------------------------------------- */

/* An event's arguments as it is built: the tensors' "name dtype[shape]" list and their bytes. */
typedef struct call_args {
    char shapes[512];
    size_t used;
    uint64_t bytes;
} call_args;

static void args_printf(call_args *a, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void args_printf(call_args *a, const char *fmt, ...)
{
    if (a->used >= sizeof a->shapes)
        return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(a->shapes + a->used, sizeof a->shapes - a->used, fmt, ap);
    va_end(ap);
    a->used = n < 0 ? sizeof a->shapes : a->used + (size_t)n;
}

/* Adds "name dtype[d3,d2,d1,d0]" (outermost first, as backend.h writes shapes; outer
 * dimensions of 1 left out, a matrix kept a matrix) and, when counted, the bytes the tensor
 * spans. A NULL tensor adds nothing. */
static void arg_tensor(call_args *a, const char *name, const loom_tensor *t, int counted)
{
    if (!t)
        return;
    int declared = t->n_dims >= 1 && t->n_dims <= 4 ? t->n_dims : 4;
    int dims = declared;
    while (dims > 1 && t->ne[dims - 1] == 1 && dims > (declared < 2 ? declared : 2))
        dims--;
    args_printf(a, "%s%s %s[", a->used ? " " : "", name, loom_dtype_name(t->dtype));
    for (int d = dims - 1; d >= 0; d--)
        args_printf(a, "%lld%s", (long long)t->ne[d], d ? "," : "]");
    uint64_t extent = loom_tensor_extent(t);
    if (counted && extent != UINT64_MAX)
        a->bytes += extent;
}

/* Writes s as a JSON string's contents (it only ever holds names, digits and punctuation,
 * but a path may hold anything). */
static void json_escaped(FILE *f, const char *s)
{
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c < 0x20)
            fprintf(f, "\\u%04x", c);
        else
            fputc(c, f);
    }
}

/* Records one finished call: its table row, and its event in the file. */
static void record(tracer *t, int call, loom_dtype dtype, double start_ms, const call_args *a,
                   loom_status st)
{
    double end_ms = now_ms();
    pthread_mutex_lock(&t->lock);
    call_stats *s = &t->stats[call][(unsigned)dtype % N_DTYPE_SLOTS];
    s->calls++;
    s->ms += end_ms - start_ms;
    s->bytes += a ? a->bytes : 0;
    t->events++;
    if (t->out) {
        fprintf(t->out,
                ",\n{\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":1,\"tid\":1,"
                "\"ts\":%.3f,\"dur\":%.3f,\"args\":{",
                call_name(call), call_category(call), (start_ms - t->t0_ms) * 1e3,
                (end_ms - start_ms) * 1e3);
        if (call < LOOM_OP_COUNT || call == CALL_PREPARE_WEIGHT)
            fprintf(t->out, "\"dtype\":\"%s\",", loom_dtype_name(dtype));
        if (a && a->used) {
            fputs("\"tensors\":\"", t->out);
            json_escaped(t->out, a->shapes);
            fputs("\",", t->out);
        }
        fprintf(t->out, "\"bytes\":%llu,\"status\":%d}}", (unsigned long long)(a ? a->bytes : 0),
                (int)st);
    }
    pthread_mutex_unlock(&t->lock);
}

/* Ends a call: waits for the backend (so asynchronous work is in the time), then records. */
static loom_status finish(tracer *t, int call, loom_dtype dtype, double start_ms,
                          const call_args *a, loom_status st)
{
    if (st == LOOM_OK)
        st = t->in.synchronize(t->inner);
    record(t, call, dtype, start_ms, a, st);
    return st;
}

static tracer *as_tracer(loom_backend *be)
{
    return (tracer *)be;
}

/* ---- Calls that are forwarded untimed ---------------------------------------------------- */

static const char *t_last_error(loom_backend *be)
{
    return as_tracer(be)->in.last_error(as_tracer(be)->inner);
}

static int t_supports(loom_backend *be, loom_op op, loom_dtype dtype)
{
    return as_tracer(be)->in.supports(as_tracer(be)->inner, op, dtype);
}

static loom_status t_set_threads(loom_backend *be, int32_t n)
{
    return as_tracer(be)->in.set_threads(as_tracer(be)->inner, n);
}

static void *t_buffer_host_ptr(loom_backend *be, loom_buffer *buf)
{
    return as_tracer(be)->in.buffer_host_ptr(as_tracer(be)->inner, buf);
}

/* ---- Buffers and copies ------------------------------------------------------------------ */

static loom_status t_buffer_alloc(loom_backend *be, uint64_t size, loom_buffer **out)
{
    tracer *t = as_tracer(be);
    double s = now_ms();
    call_args a = {.bytes = size};
    loom_status st = t->in.buffer_alloc(t->inner, size, out);
    record(t, CALL_ALLOC, LOOM_F32, s, &a, st);
    return st;
}

static loom_status t_buffer_wrap_host(loom_backend *be, void *ptr, uint64_t size, loom_buffer **out)
{
    tracer *t = as_tracer(be);
    double s = now_ms();
    call_args a = {.bytes = size};
    args_printf(&a, "wraps host memory");
    loom_status st = t->in.buffer_wrap_host(t->inner, ptr, size, out);
    record(t, CALL_ALLOC, LOOM_F32, s, &a, st);
    return st;
}

static void t_buffer_free(loom_backend *be, loom_buffer *buf)
{
    tracer *t = as_tracer(be);
    double s = now_ms();
    t->in.buffer_free(t->inner, buf);
    record(t, CALL_FREE, LOOM_F32, s, NULL, LOOM_OK);
}

static loom_status t_buffer_memset(loom_backend *be, loom_buffer *buf, uint64_t offset, int value,
                                   uint64_t size)
{
    tracer *t = as_tracer(be);
    double s = now_ms();
    call_args a = {.bytes = size};
    loom_status st = t->in.buffer_memset(t->inner, buf, offset, value, size);
    return finish(t, CALL_MEMSET, LOOM_F32, s, &a, st);
}

static loom_status t_copy_from_host(loom_backend *be, loom_buffer *dst, uint64_t offset,
                                    const void *src, uint64_t size)
{
    tracer *t = as_tracer(be);
    double s = now_ms();
    call_args a = {.bytes = size};
    loom_status st = t->in.copy_from_host(t->inner, dst, offset, src, size);
    return finish(t, CALL_COPY_FROM_HOST, LOOM_F32, s, &a, st);
}

static loom_status t_copy_to_host(loom_backend *be, void *dst, loom_buffer *src, uint64_t offset,
                                  uint64_t size)
{
    tracer *t = as_tracer(be);
    double s = now_ms();
    call_args a = {.bytes = size};
    loom_status st = t->in.copy_to_host(t->inner, dst, src, offset, size);
    record(t, CALL_COPY_TO_HOST, LOOM_F32, s, &a, st); /* blocks until the bytes are there */
    return st;
}

static loom_status t_copy_buffer(loom_backend *be, loom_buffer *dst, uint64_t dst_offset,
                                 loom_buffer *src, uint64_t src_offset, uint64_t size)
{
    tracer *t = as_tracer(be);
    double s = now_ms();
    call_args a = {.bytes = size};
    loom_status st = t->in.copy_buffer(t->inner, dst, dst_offset, src, src_offset, size);
    return finish(t, CALL_COPY_BUFFER, LOOM_F32, s, &a, st);
}

static loom_status t_synchronize(loom_backend *be)
{
    tracer *t = as_tracer(be);
    double s = now_ms();
    loom_status st = t->in.synchronize(t->inner);
    record(t, CALL_SYNCHRONIZE, LOOM_F32, s, NULL, st);
    return st;
}

/* ---- Ops --------------------------------------------------------------------------------- */

/* What an op's record says beyond its tensors (backend.h's LOOM_TENSORS_* lists): the tensor
 * whose dtype supports() is asked about (NULL: f32), and those whose whole extent is not what
 * the op touches (counted by rows below, or not at all), space-separated. */
static const struct op_note {
    const char *typed, *partial;
} op_notes[LOOM_OP_COUNT] = {
    [LOOM_OP_MATMUL] = {"w", NULL},
    [LOOM_OP_GET_ROWS] = {"src", "src"},                  /* as many rows of the table as dst's */
    [LOOM_OP_KV_STORE] = {"cache", "cache"},              /* one row of each token's K or V */
    [LOOM_OP_ATTENTION] = {"k_cache", "k_cache v_cache"}, /* positions live on the device */
    [LOOM_OP_QUANTIZE] = {"dst", NULL},                   /* the block type */
    [LOOM_OP_DEQUANTIZE] = {"src", NULL},
    [LOOM_OP_CONVERT] = {"dst", NULL}, /* the target */
    [LOOM_OP_MATMUL_ID] = {"w", "w"},  /* the experts chosen on the device */
};

/* the op's argument field, recorded (and noted as typed, per op_notes) */
static void op_tensor(call_args *a, loom_op op, const char *field, const loom_tensor *t,
                      const loom_tensor **typed)
{
    const char *partial = op_notes[op].partial;
    size_t n = strlen(field);
    int whole = 1;
    for (const char *w = partial; w && *w; w += strcspn(w, " "), w += *w == ' ')
        whole &= !(strcspn(w, " ") == n && !strncmp(w, field, n));
    arg_tensor(a, field, t, whole);
    if (op_notes[op].typed && !strcmp(op_notes[op].typed, field))
        *typed = t;
}

/* the bytes a partly read or written tensor adds: the rows the op touches */
static uint64_t rows_bytes(const loom_tensor *t, int64_t rows)
{
    int64_t row = t ? loom_row_bytes(t->dtype, t->ne[0]) : 0;
    return row > 0 && rows > 0 ? (uint64_t)row * (uint64_t)rows : 0;
}

static void partial_get_rows(call_args *a, const loom_get_rows_params *p)
{
    if (p->src && p->dst)
        a->bytes += rows_bytes(p->src, loom_tensor_rows(p->dst));
}

static void partial_kv_store(call_args *a, const loom_kv_store_params *p)
{
    /* a token's K or V: a row of each of the cache's [.., .., kv_heads, head_dim] heads */
    if (p->cache && p->slots)
        a->bytes += rows_bytes(p->cache, p->cache->ne[1] * p->slots->ne[0]);
}

static void partial_none(call_args *a, const void *p)
{
    (void)a, (void)p;
}

#define PARTIAL_BYTES(a, p)                                                                        \
    _Generic((p),                                                                                  \
        const loom_get_rows_params *: partial_get_rows,                                            \
        const loom_kv_store_params *: partial_kv_store,                                            \
        default: partial_none)(a, p)

/* Every op's wrapper, from the op list and its parameters' tensor list: the call forwarded,
 * waited for and recorded with its tensors' shapes and bytes. */
#define OP_TENSOR(field) op_tensor(&a, op, #field, p->field, &typed);
#define OP_WRAPPER(ID, name, params)                                                               \
    static loom_status t_##name(loom_backend *be, const params *p)                                 \
    {                                                                                              \
        tracer *t = as_tracer(be);                                                                 \
        const loom_op op = LOOM_OP_##ID;                                                           \
        const loom_tensor *typed = NULL;                                                           \
        call_args a = {0};                                                                         \
        LOOM_TENSORS_##params(OP_TENSOR, OP_TENSOR) PARTIAL_BYTES(&a, p);                          \
        double s = now_ms();                                                                       \
        return finish(t, op, typed ? typed->dtype : LOOM_F32, s, &a, t->in.name(t->inner, p));     \
    }
LOOM_OPS(OP_WRAPPER)
#undef OP_WRAPPER
#undef OP_TENSOR

static loom_status t_prepare_weight(loom_backend *be, const loom_tensor *w, loom_tensor *out)
{
    tracer *t = as_tracer(be);
    call_args a = {0};
    arg_tensor(&a, "w", w, 1);
    double s = now_ms();
    loom_status st = t->in.prepare_weight(t->inner, w, out);
    /* "no better layout" is an answer, not a failure */
    return finish(t, CALL_PREPARE_WEIGHT, w ? w->dtype : LOOM_F32, s, &a, st);
}

/* ---- The table at close ------------------------------------------------------------------ */

typedef struct summary_row {
    int call, dtype;
    const call_stats *s;
} summary_row;

static int by_time_desc(const void *a, const void *b)
{
    double x = ((const summary_row *)a)->s->ms, y = ((const summary_row *)b)->s->ms;
    return (x < y) - (x > y);
}

static void print_summary(const tracer *t)
{
    summary_row rows[N_CALLS * N_DTYPE_SLOTS];
    int n = 0;
    double total = 0;
    uint64_t calls = 0;
    for (int c = 0; c < N_CALLS; c++)
        for (int d = 0; d < N_DTYPE_SLOTS; d++)
            if (t->stats[c][d].calls) {
                rows[n++] = (summary_row){c, d, &t->stats[c][d]};
                total += t->stats[c][d].ms;
                calls += t->stats[c][d].calls;
            }
    if (!n)
        return;
    qsort(rows, (size_t)n, sizeof rows[0], by_time_desc);
    fprintf(stderr, "loom trace: %.1f ms in %llu backend calls%s%s\n", total,
            (unsigned long long)calls, t->path[0] ? ", events in " : "", t->path);
    fprintf(stderr, "  %-15s %-7s %9s %11s %6s %10s %9s\n", "call", "dtype", "calls", "ms", "%",
            "us/call", "GB/s");
    for (int i = 0; i < n; i++) {
        const call_stats *s = rows[i].s;
        int typed = rows[i].call < LOOM_OP_COUNT || rows[i].call == CALL_PREPARE_WEIGHT;
        char gbs[16] = "-";
        if (s->bytes && s->ms > 0)
            snprintf(gbs, sizeof gbs, "%.2f", (double)s->bytes / (s->ms * 1e6));
        fprintf(stderr, "  %-15s %-7s %9llu %11.2f %6.1f %10.1f %9s\n", call_name(rows[i].call),
                typed ? loom_dtype_name((loom_dtype)rows[i].dtype) : "-",
                (unsigned long long)s->calls, s->ms, total > 0 ? 100 * s->ms / total : 0,
                1e3 * s->ms / (double)s->calls, gbs);
    }
}

/* ---- Lifetime ---------------------------------------------------------------------------- */

static void t_close(loom_backend *be)
{
    tracer *t = as_tracer(be);
    t->in.close(t->inner);
    if (t->out) {
        fputs("\n],\"otherData\":{\"producer\":\"loom trace plugin\"}}\n", t->out);
        int failed = ferror(t->out);
        if (fclose(t->out) != 0 || failed)
            fprintf(stderr, "loom trace: writing %s failed: %s; the file is incomplete\n", t->path,
                    strerror(errno));
        t->out = NULL;
    }
    if (t->summary)
        print_summary(t);
    pthread_mutex_destroy(&t->lock);
    free(t);
}

static const loom_backend_ops tracer_ops = {.struct_size = sizeof(loom_backend_ops),
                                            .close = t_close,
                                            .last_error = t_last_error,
                                            .supports = t_supports,
                                            .set_threads = t_set_threads,
                                            .buffer_alloc = t_buffer_alloc,
                                            .buffer_free = t_buffer_free,
                                            .buffer_host_ptr = t_buffer_host_ptr,
                                            .buffer_wrap_host = t_buffer_wrap_host,
                                            .buffer_memset = t_buffer_memset,
                                            .copy_from_host = t_copy_from_host,
                                            .copy_to_host = t_copy_to_host,
                                            .copy_buffer = t_copy_buffer,
                                            .synchronize = t_synchronize,
                                            .prepare_weight = t_prepare_weight,
#define OP_SLOT(ID, name, params) .name = t_##name,
                                            LOOM_OPS(OP_SLOT)
#undef OP_SLOT
};

static void set_err(char *err, size_t n, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void set_err(char *err, size_t n, const char *fmt, ...)
{
    if (!err || !n)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, n, fmt, ap);
    va_end(ap);
}

static loom_status t_open(const loom_backend_options *opts, loom_backend **out, char *err,
                          size_t err_size)
{
    if (opts->struct_size < offsetof(loom_backend_options, config) + sizeof opts->config ||
        !opts->inner || !opts->inner->ops) {
        set_err(err, err_size,
                "the trace plugin wraps a backend and cannot run alone: set "
                "LOOM_TRACE=FILE and loom opens it around the backend it chose");
        return LOOM_ERR_INVALID;
    }
    tracer *t = calloc(1, sizeof *t);
    if (!t) {
        set_err(err, err_size, "out of memory");
        return LOOM_ERR_OUT_OF_MEMORY;
    }
    const loom_backend_ops *in = opts->inner->ops;
    memcpy(&t->in, in, in->struct_size < sizeof t->in ? in->struct_size : sizeof t->in);
    if (!t->in.close || !t->in.last_error || !t->in.supports || !t->in.buffer_alloc ||
        !t->in.buffer_free || !t->in.copy_from_host || !t->in.copy_to_host || !t->in.synchronize) {
        set_err(err, err_size, "the backend to trace lacks a required member of its table");
        free(t);
        return LOOM_ERR_INVALID;
    }
    const char *path = opts->config ? opts->config : "";
    if (strlen(path) >= sizeof t->path) {
        set_err(err, err_size, "trace file name too long (%zu bytes)", strlen(path));
        free(t);
        return LOOM_ERR_INVALID;
    }
    if (path[0] && !(t->out = fopen(path, "w"))) {
        set_err(err, err_size, "cannot create the trace file %s: %s", path, strerror(errno));
        free(t);
        return LOOM_ERR_INVALID;
    }
    snprintf(t->path, sizeof t->path, "%s", path);
    t->summary = opts->config != NULL;
    pthread_mutex_init(&t->lock, NULL);
    t->inner = opts->inner;
    t->ops = tracer_ops;
    /* whatever the inner table lacks, this one lacks too, so loom sees the same capabilities */
#define SAME_AS_INNER(member)                                                                      \
    do {                                                                                           \
        if (!t->in.member)                                                                         \
            t->ops.member = NULL;                                                                  \
    } while (0)
    SAME_AS_INNER(set_threads);
    SAME_AS_INNER(buffer_host_ptr);
    SAME_AS_INNER(buffer_wrap_host);
    SAME_AS_INNER(buffer_memset);
    SAME_AS_INNER(copy_buffer);
#define SAME_OP_AS_INNER(id, name, params) SAME_AS_INNER(name);
    LOOM_OPS(SAME_OP_AS_INNER)
#undef SAME_OP_AS_INNER
    SAME_AS_INNER(prepare_weight);
#undef SAME_AS_INNER
    t->base.ops = &t->ops;
    t->t0_ms = now_ms();
    if (t->out)
        fputs("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n"
              "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":1,\"tid\":1,"
              "\"args\":{\"name\":\"loom backend\"}}",
              t->out);
    *out = &t->base;
    return LOOM_OK;
}

static void t_probe(loom_probe_result *out)
{
    out->score = 1;
    out->n_devices = 1;
    snprintf(out->devices[0].name, sizeof out->devices[0].name, "whichever backend it wraps");
    snprintf(out->devices[0].detail, sizeof out->devices[0].detail,
             "Chrome trace-event JSON and a per-op table");
}

static const loom_backend_module trace_module = {
    .struct_size = sizeof(loom_backend_module),
    .abi_major = LOOM_BACKEND_ABI_MAJOR,
    .abi_minor = LOOM_BACKEND_ABI_MINOR,
    .name = "trace",
    .variant = "",
    .description = "records every backend call: Chrome trace JSON (LOOM_TRACE=FILE) and a "
                   "per-op table",
    .probe = t_probe,
    .open = t_open,
    .kind = LOOM_MODULE_DECORATOR,
};

LOOM_BACKEND_DEFINE_ENTRY(trace_module)
