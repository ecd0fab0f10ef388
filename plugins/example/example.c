/*
 * example.c - a complete loom backend module to start yours from. It runs on the host, plainly:
 * buffers in malloc'd memory, matmul and get_rows for every weight type (each row decoded to
 * f32 with the header's helpers), rms_norm, add, mul and silu_mul. What it leaves out (rope,
 * attention, the KV cache...) loom runs on its CPU backend, so a model runs from the first
 * build; replace these loops with your device's kernels one op at a time, and check each step
 * with `loom-conformance ./loom-example.so` and `loom-conformance --model M.gguf ./loom-example.so`.
 *
 * It includes loom/backend.h and nothing else of loom's: that header is the whole contract
 * (plugins/README.md walks through it in the order you meet it).
 */
#include <loom/backend.h>

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- State ------------------------------------------------------------------------------- */

struct loom_buffer { /* opaque to loom: yours to define */
    unsigned char *data;
    uint64_t size;
};

typedef struct example_backend {
    loom_backend base; /* first: loom sees a loom_backend */
    char error[512];
} example_backend;

static loom_status fail(loom_backend *be, loom_status st, const char *fmt, ...)
{
    example_backend *eb = (example_backend *)be;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(eb->error, sizeof eb->error, fmt, ap);
    va_end(ap);
    return st;
}

static const char *example_last_error(loom_backend *be)
{
    return ((example_backend *)be)->error; /* empty until something fails */
}

/* ---- Buffers and copies ------------------------------------------------------------------ */

static loom_status example_buffer_alloc(loom_backend *be, uint64_t size, loom_buffer **out)
{
    loom_buffer *b = calloc(1, sizeof *b);
    if (b && size <= SIZE_MAX / 2)
        b->data = malloc(size ? (size_t)size : 1); /* size 0: a buffer of nothing, still real */
    if (!b || !b->data) {
        free(b);
        return fail(be, LOOM_ERR_OUT_OF_MEMORY, "cannot allocate %llu bytes",
                    (unsigned long long)size);
    }
    b->size = size;
    *out = b;
    return LOOM_OK;
}

static void example_buffer_free(loom_backend *be, loom_buffer *b)
{
    (void)be;
    if (b)
        free(b->data);
    free(b);
}

static void *example_buffer_host_ptr(loom_backend *be, loom_buffer *b)
{
    (void)be;
    return b->data;
}

/* Every copy checks its range first: a range outside the buffer is LOOM_ERR_INVALID and
 * touches nothing. */
static loom_status in_range(loom_backend *be, const loom_buffer *b, uint64_t off, uint64_t n,
                            const char *what)
{
    if (!b || off > b->size || n > b->size - off)
        return fail(be, LOOM_ERR_INVALID, "%s: bytes [%llu, +%llu) outside the buffer", what,
                    (unsigned long long)off, (unsigned long long)n);
    return LOOM_OK;
}

static loom_status example_memset(loom_backend *be, loom_buffer *b, uint64_t off, int value,
                                  uint64_t n)
{
    loom_status st = in_range(be, b, off, n, "buffer_memset");
    if (st == LOOM_OK && n)
        memset(b->data + off, value, (size_t)n);
    return st;
}

static loom_status example_copy_from_host(loom_backend *be, loom_buffer *dst, uint64_t off,
                                          const void *src, uint64_t n)
{
    loom_status st = in_range(be, dst, off, n, "copy_from_host");
    if (st == LOOM_OK && n)
        memcpy(dst->data + off, src, (size_t)n);
    return st;
}

static loom_status example_copy_to_host(loom_backend *be, void *dst, loom_buffer *src, uint64_t off,
                                        uint64_t n)
{
    loom_status st = in_range(be, src, off, n, "copy_to_host");
    if (st == LOOM_OK && n)
        memcpy(dst, src->data + off, (size_t)n);
    return st;
}

static loom_status example_copy_buffer(loom_backend *be, loom_buffer *dst, uint64_t doff,
                                       loom_buffer *src, uint64_t soff, uint64_t n)
{
    loom_status st = in_range(be, dst, doff, n, "copy_buffer");
    if (st == LOOM_OK)
        st = in_range(be, src, soff, n, "copy_buffer");
    if (st == LOOM_OK && n)
        memmove(dst->data + doff, src->data + soff, (size_t)n);
    return st;
}

static loom_status example_synchronize(loom_backend *be)
{
    (void)be; /* every op here finishes before it returns */
    return LOOM_OK;
}

/* ---- Ops --------------------------------------------------------------------------------- */

/* Row r (0 .. ne1*ne2*ne3 - 1) of a tensor, through all three outer strides. */
static unsigned char *row(const loom_tensor *t, int64_t r)
{
    int64_t i1 = r % t->ne[1], i2 = r / t->ne[1] % t->ne[2], i3 = r / t->ne[1] / t->ne[2];
    return t->buf->data + t->offset + (uint64_t)i1 * t->nb[1] + (uint64_t)i2 * t->nb[2] +
        (uint64_t)i3 * t->nb[3];
}

/* The header's argument checks state each op's contract; a malformed call is LOOM_ERR_INVALID. */
#define CHECK_ARGS(be, what, message)                                                              \
    do {                                                                                           \
        const char *m_ = (message);                                                                \
        if (m_)                                                                                    \
            return fail((be), LOOM_ERR_INVALID, "%s: %s", (what), m_);                             \
    } while (0)

/* a block type's rows are whole blocks (a file may still claim otherwise) */
static const char *whole_blocks(const loom_tensor *w)
{
    return w->ne[0] % loom_dtype_block_elems(w->dtype) ? "rows are not whole blocks" : NULL;
}

static loom_status example_matmul(loom_backend *be, const loom_matmul_params *p)
{
    CHECK_ARGS(be, "matmul", loom_check_matmul(p));
    CHECK_ARGS(be, "matmul", whole_blocks(p->w));
    int64_t M = loom_tensor_rows(p->x), N = loom_tensor_rows(p->w), K = p->x->ne[0];
    float *w = malloc((size_t)K * sizeof *w);
    if (!w)
        return fail(be, LOOM_ERR_OUT_OF_MEMORY, "matmul: out of memory");
    const float *bias = p->bias ? (const float *)row(p->bias, 0) : NULL;
    for (int64_t n = 0; n < N; n++) { /* one weight row decoded, used for every x row */
        loom_row_to_f32(p->w->dtype, row(p->w, n), w, K);
        for (int64_t m = 0; m < M; m++) {
            const float *x = (const float *)row(p->x, m);
            double sum = bias ? bias[n] : 0;
            for (int64_t k = 0; k < K; k++)
                sum += (double)x[k] * w[k];
            ((float *)row(p->y, m))[n] = (float)sum;
        }
    }
    free(w);
    return LOOM_OK;
}

static loom_status example_get_rows(loom_backend *be, const loom_get_rows_params *p)
{
    CHECK_ARGS(be, "get_rows", loom_check_get_rows(p));
    CHECK_ARGS(be, "get_rows", whole_blocks(p->src));
    int64_t n = p->ids->ne[0], rows = loom_tensor_rows(p->src);
    const unsigned char *ids = p->ids->buf->data + p->ids->offset; /* a vector: along dim 0 */
    for (int64_t i = 0; i < n; i++) {
        int32_t id;
        memcpy(&id, ids + (uint64_t)i * p->ids->nb[0], sizeof id);
        if (id < 0 || id >= rows)
            return fail(be, LOOM_ERR_INVALID, "get_rows: id %d outside [0, %lld)", id,
                        (long long)rows);
        loom_row_to_f32(p->src->dtype, row(p->src, id), (float *)row(p->dst, i), p->src->ne[0]);
    }
    return LOOM_OK;
}

static loom_status example_rms_norm(loom_backend *be, const loom_norm_params *p)
{
    CHECK_ARGS(be, "rms_norm", loom_check_norm(p));
    int64_t n = p->x->ne[0], rows = loom_tensor_rows(p->x);
    const float *weight = p->weight ? (const float *)row(p->weight, 0) : NULL;
    for (int64_t r = 0; r < rows; r++) {
        const float *x = (const float *)row(p->x, r);
        float *y = (float *)row(p->dst, r);
        double ms = 0;
        for (int64_t i = 0; i < n; i++)
            ms += (double)x[i] * x[i];
        float inv = (float)(1.0 / sqrt(ms / (double)n + p->eps)); /* eps inside the root */
        for (int64_t i = 0; i < n; i++)
            y[i] = x[i] * inv * (weight ? weight[i] : 1.0f);
    }
    return LOOM_OK;
}

/* add, mul and silu_mul: b is the same shape as a, or one row broadcast over a's rows */
static loom_status binary(loom_backend *be, const loom_elementwise_params *p, loom_op op)
{
    CHECK_ARGS(be, loom_op_name(op), loom_check_elementwise(p, 1, op != LOOM_OP_SILU_MUL));
    int64_t n = p->a->ne[0], rows = loom_tensor_rows(p->a), b_rows = loom_tensor_rows(p->b);
    for (int64_t r = 0; r < rows; r++) {
        const float *a = (const float *)row(p->a, r),
                    *b = (const float *)row(p->b, b_rows == 1 ? 0 : r);
        float *y = (float *)row(p->dst, r);
        for (int64_t i = 0; i < n; i++)
            y[i] = op == LOOM_OP_ADD ? a[i] + b[i]
                : op == LOOM_OP_MUL  ? a[i] * b[i]
                                     : a[i] / (1.0f + expf(-a[i])) * b[i];
    }
    return LOOM_OK;
}

static loom_status example_add(loom_backend *be, const loom_elementwise_params *p)
{
    return binary(be, p, LOOM_OP_ADD);
}

static loom_status example_mul(loom_backend *be, const loom_elementwise_params *p)
{
    return binary(be, p, LOOM_OP_MUL);
}

static loom_status example_silu_mul(loom_backend *be, const loom_elementwise_params *p)
{
    return binary(be, p, LOOM_OP_SILU_MUL);
}

/* Exactly what the table below implements: claiming more fails conformance. */
static int example_supports(loom_backend *be, loom_op op, loom_dtype dt)
{
    (void)be;
    switch (op) {
    case LOOM_OP_MATMUL:
    case LOOM_OP_GET_ROWS: return loom_dtype_is_float(dt) || loom_dtype_is_quantized(dt);
    case LOOM_OP_RMS_NORM:
    case LOOM_OP_ADD:
    case LOOM_OP_MUL:
    case LOOM_OP_SILU_MUL: return dt == LOOM_F32;
    default: return 0;
    }
}

/* ---- Lifetime, probe and entry ----------------------------------------------------------- */

static void example_close(loom_backend *be)
{
    free(be);
}

static const loom_backend_ops example_ops = {
    .struct_size = sizeof(loom_backend_ops),
    .close = example_close,
    .last_error = example_last_error,
    .supports = example_supports,
    .buffer_alloc = example_buffer_alloc,
    .buffer_free = example_buffer_free,
    .buffer_host_ptr = example_buffer_host_ptr,
    .buffer_memset = example_memset,
    .copy_from_host = example_copy_from_host,
    .copy_to_host = example_copy_to_host,
    .copy_buffer = example_copy_buffer,
    .synchronize = example_synchronize,
    .matmul = example_matmul,
    .get_rows = example_get_rows,
    .rms_norm = example_rms_norm,
    .add = example_add,
    .mul = example_mul,
    .silu_mul = example_silu_mul,
};

/* Cheap, no side effects: a real backend asks its driver here how many devices there are, and
 * says why it cannot run (score 0 and a reason) when there are none. */
static void example_probe(loom_probe_result *out)
{
    out->score = 1; /* below loom's own backends: chosen only with LOOM_BACKEND=example */
    out->n_devices = 1;
    snprintf(out->devices[0].name, sizeof out->devices[0].name, "host (example backend)");
    snprintf(out->devices[0].detail, sizeof out->devices[0].detail, "plain C loops");
}

static loom_status example_open(const loom_backend_options *opts, loom_backend **out, char *err,
                                size_t err_size)
{
    if (opts->device != 0) {
        snprintf(err, err_size, "the example backend has one device, not %d", opts->device);
        return LOOM_ERR_INVALID;
    }
    example_backend *eb = calloc(1, sizeof *eb);
    if (!eb) {
        snprintf(err, err_size, "out of memory");
        return LOOM_ERR_OUT_OF_MEMORY;
    }
    eb->base.ops = &example_ops;
    *out = &eb->base;
    return LOOM_OK;
}

static const loom_backend_module example_module = {
    .struct_size = sizeof(loom_backend_module),
    .abi_major = LOOM_BACKEND_ABI_MAJOR,
    .abi_minor = LOOM_BACKEND_ABI_MINOR,
    .name = "example",
    .variant = "",
    .description = "loom's backend template: plain C on the host",
    .probe = example_probe,
    .open = example_open,
};

LOOM_BACKEND_DEFINE_ENTRY(example_module)
