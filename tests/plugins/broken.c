/*
 * tests/plugins/broken.c - backends that are well-formed but wrong in one way each, so the
 * suite can assert that loom-conformance catches every kind of bug a model would suffer from.
 * BROKEN_KIND (set by tests/Makefile.inc) picks the bug:
 *   bias     (the default) matmul forgets the bias, rms_norm the weight
 *   eps      rms_norm adds eps outside the square root: 1 / (sqrt(ms) + eps)
 *   strides  rms_norm numbers rows as r * nb[1], ignoring the strides of dims 2 and 3
 *   kvdense  kv_store writes the cache as if it were dense [slot][head], not by its strides
 *   nullop   supports() claims gelu, whose pointer is NULL
 *   copyout  copy_to_host reads one byte late (memset, right, must not be blamed for it)
 *   overclaim supports() claims quantize for every quantised type, as the CPU and ref
 *            modules once did, though the ABI defines it for q8_0, q4_0 and q4_1 only
 * Everything else is honestly unsupported (or, for the single-bug kinds, right).
 */
#include <loom/backend.h>

#ifndef BROKEN_KIND
#define BROKEN_KIND "bias"
#endif
#define KIND(k) (strcmp(BROKEN_KIND, k) == 0)

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
    if (KIND("copyout") && n > 1 && n < src->size - off)
        off++;
    memcpy(dst, src->data + off, n);
    return LOOM_OK;
}

static loom_status b_memset(loom_backend *be, loom_buffer *b, uint64_t off, int value, uint64_t n)
{
    (void)be;
    if (off > b->size || n > b->size - off)
        return LOOM_ERR_INVALID;
    memset(b->data + off, value, n);
    return LOOM_OK;
}

static loom_status b_sync(loom_backend *be)
{
    (void)be;
    return LOOM_OK;
}

/* Row r, counting over dims 1..3: the dense numbering (r * nb[1]) is the strides bug. */
static const float *row_f32(const loom_tensor *t, int64_t r)
{
    if (KIND("bias") || KIND("strides"))
        return (const float *)(t->buf->data + t->offset + (uint64_t)r * t->nb[1]);
    int64_t i1 = r % t->ne[1], i2 = r / t->ne[1] % t->ne[2], i3 = r / t->ne[1] / t->ne[2];
    return (const float *)(t->buf->data + t->offset + (uint64_t)i1 * t->nb[1] +
                           (uint64_t)i2 * t->nb[2] + (uint64_t)i3 * t->nb[3]);
}

static loom_status b_matmul(loom_backend *be, const loom_matmul_params *p)
{
    (void)be;
    int64_t M = p->x->ne[1], K = p->x->ne[0], N = p->w->ne[1];
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            float acc = 0; /* BUG (deliberate, kind bias): p->bias is ignored */
            for (int64_t k = 0; k < K; k++)
                acc += row_f32(p->x, m)[k] * row_f32(p->w, n)[k];
            if (p->bias && !KIND("bias"))
                acc += row_f32(p->bias, 0)[n];
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
        float inv = KIND("eps") ? (float)(1.0 / (sqrt(sq / (double)n) + p->eps)) /* BUG */
                                : (float)(1.0 / sqrt(sq / (double)n + p->eps));
        for (int64_t i = 0; i < n; i++) /* BUG (kind bias): p->weight is ignored */
            y[i] = x[i] * inv * (p->weight && !KIND("bias") ? row_f32(p->weight, 0)[i] : 1.0f);
    }
    return LOOM_OK;
}

/* kv_store into an f32 cache: slot s of head h is row (s % bs) of head h in block s / bs,
 * wherever the cache's strides put it. BUG (kind kvdense): rows as if [slot][head] dense. */
static loom_status b_kv_store(loom_backend *be, const loom_kv_store_params *p)
{
    (void)be;
    const loom_tensor *c = p->cache;
    int64_t hd = p->src->ne[0], kvh = p->src->ne[1], tokens = p->src->ne[2];
    for (int64_t t = 0; t < tokens; t++) {
        int32_t slot;
        memcpy(&slot, p->slots->buf->data + p->slots->offset + 4 * (uint64_t)t, 4);
        if (slot < 0)
            continue;
        for (int64_t h = 0; h < kvh; h++) {
            uint64_t at = KIND("kvdense") /* rows of hd floats, [slot][head], no padding */
                ? c->offset +
                    ((uint64_t)slot * (uint64_t)kvh + (uint64_t)h) * (uint64_t)hd * sizeof(float)
                : c->offset + (uint64_t)h * c->nb[1] + (uint64_t)(slot % c->ne[2]) * c->nb[2] +
                    (uint64_t)(slot / c->ne[2]) * c->nb[3];
            memcpy(c->buf->data + at, row_f32(p->src, t * kvh + h), (size_t)hd * sizeof(float));
        }
    }
    return LOOM_OK;
}

static int b_supports(loom_backend *be, loom_op op, loom_dtype dt)
{
    (void)be;
    if (KIND("overclaim") && op == LOOM_OP_QUANTIZE)
        return loom_dtype_is_quantized(dt);
    if (dt != LOOM_F32)
        return 0;
    if (KIND("kvdense"))
        return op == LOOM_OP_KV_STORE;
    if (KIND("nullop"))
        return op == LOOM_OP_GELU || op == LOOM_OP_RMS_NORM;
    return op == LOOM_OP_MATMUL || op == LOOM_OP_RMS_NORM;
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
    .buffer_memset = b_memset,
    .copy_from_host = b_from_host,
    .copy_to_host = b_to_host,
    .synchronize = b_sync,
    .matmul = b_matmul,
    .rms_norm = b_rms_norm,
    .kv_store = b_kv_store,
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
    .variant = BROKEN_KIND,
    .description = "deliberately wrong test backend",
    .probe = b_probe,
    .open = b_open,
};

LOOM_BACKEND_DEFINE_ENTRY(broken_module)
