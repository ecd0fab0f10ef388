/*
 * tests/plugins/broken.c - a backend that is well-formed but computes wrong answers, so the
 * suite can assert that loom-conformance catches it: its matmul forgets the bias and
 * its rms_norm forgets the weight. Everything else is honestly unsupported.
 */
#include <loom/backend.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct loom_buffer {
    unsigned char *data;
    uint64_t size;
};

typedef struct broken_backend {
    loom_backend base;
    char error[256];
} broken_backend;

static loom_status b_alloc(loom_backend *be, uint64_t size, loom_buffer **out)
{
    loom_buffer *b = calloc(1, sizeof *b);
    if (!b || size > (1ull << 40) || !(b->data = malloc(size ? size : 1))) {
        free(b);
        snprintf(((broken_backend *)be)->error, 256, "cannot allocate %llu bytes",
                 (unsigned long long)size);
        return LOOM_ERR_OUT_OF_MEMORY;
    }
    b->size = size;
    *out = b;
    return LOOM_OK;
}

static void b_free(loom_backend *be, loom_buffer *b)
{
    (void)be;
    if (b)
        free(b->data);
    free(b);
}

static loom_status b_from_host(loom_backend *be, loom_buffer *dst, uint64_t off, const void *src,
                               uint64_t n)
{
    (void)be;
    if (off > dst->size || n > dst->size - off)
        return LOOM_ERR_INVALID;
    memcpy(dst->data + off, src, n);
    return LOOM_OK;
}

static loom_status b_to_host(loom_backend *be, void *dst, loom_buffer *src, uint64_t off,
                             uint64_t n)
{
    (void)be;
    if (off > src->size || n > src->size - off)
        return LOOM_ERR_INVALID;
    memcpy(dst, src->data + off, n);
    return LOOM_OK;
}

static loom_status b_sync(loom_backend *be)
{
    (void)be;
    return LOOM_OK;
}

static const float *row_f32(const loom_tensor *t, int64_t r)
{
    return (const float *)(t->buf->data + t->offset + (uint64_t)r * t->nb[1]);
}

static loom_status b_matmul(loom_backend *be, const loom_matmul_params *p)
{
    (void)be;
    int64_t M = p->x->ne[1], K = p->x->ne[0], N = p->w->ne[1];
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            float acc = 0; /* BUG (deliberate): p->bias is ignored */
            for (int64_t k = 0; k < K; k++)
                acc += row_f32(p->x, m)[k] * row_f32(p->w, n)[k];
            ((float *)row_f32(p->y, m))[n] = acc;
        }
    return LOOM_OK;
}

static loom_status b_rms_norm(loom_backend *be, const loom_norm_params *p)
{
    (void)be;
    int64_t n = p->x->ne[0], rows = p->x->ne[1] * p->x->ne[2] * p->x->ne[3];
    for (int64_t r = 0; r < rows; r++) {
        const float *x = row_f32(p->x, r);
        float *y = (float *)row_f32(p->dst, r);
        double sq = 0;
        for (int64_t i = 0; i < n; i++)
            sq += (double)x[i] * x[i];
        float inv = (float)(1.0 / sqrt(sq / (double)n + p->eps));
        for (int64_t i = 0; i < n; i++)
            y[i] = x[i] * inv; /* BUG (deliberate): p->weight is ignored */
    }
    return LOOM_OK;
}

static int b_supports(loom_backend *be, loom_op op, loom_dtype dt)
{
    (void)be;
    return (op == LOOM_OP_MATMUL || op == LOOM_OP_RMS_NORM) && dt == LOOM_F32;
}

static const char *b_last_error(loom_backend *be)
{
    return ((broken_backend *)be)->error;
}

static void b_close(loom_backend *be)
{
    free(be);
}

static const loom_backend_ops broken_ops = {
    .struct_size = sizeof(loom_backend_ops),
    .close = b_close,
    .last_error = b_last_error,
    .supports = b_supports,
    .buffer_alloc = b_alloc,
    .buffer_free = b_free,
    .copy_from_host = b_from_host,
    .copy_to_host = b_to_host,
    .synchronize = b_sync,
    .matmul = b_matmul,
    .rms_norm = b_rms_norm,
};

static void b_probe(loom_probe_result *out)
{
    out->score = 1;
    out->n_devices = 1;
    snprintf(out->devices[0].name, sizeof out->devices[0].name, "host (deliberately broken)");
}

static loom_status b_open(const loom_backend_options *opts, loom_backend **out, char *err,
                          size_t err_size)
{
    (void)opts, (void)err, (void)err_size;
    broken_backend *b = calloc(1, sizeof *b);
    if (!b)
        return LOOM_ERR_OUT_OF_MEMORY;
    b->base.ops = &broken_ops;
    *out = &b->base;
    return LOOM_OK;
}

static const loom_backend_module broken_module = {
    .struct_size = sizeof(loom_backend_module),
    .abi_major = LOOM_BACKEND_ABI_MAJOR,
    .abi_minor = LOOM_BACKEND_ABI_MINOR,
    .name = "broken",
    .variant = "",
    .description = "deliberately wrong test backend",
    .probe = b_probe,
    .open = b_open,
};

LOOM_BACKEND_EXPORT const loom_backend_module *loom_backend_entry(uint32_t host_major,
                                                                  uint32_t host_minor)
{
    (void)host_major, (void)host_minor;
    return &broken_module;
}
