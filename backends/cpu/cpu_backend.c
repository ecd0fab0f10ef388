/*
 * backends/cpu/cpu_backend.c - the CPU backend's buffers, thread pool and the row ops (norms,
 * RoPE, elementwise, conversions); matmul is cpu_matmul.c, the KV cache and attention
 * cpu_attention.c, the experts' ops cpu_moe.c. Compiled once per ISA variant with that
 * variant's flags; the loops are written so the compiler vectorises them, with intrinsics only
 * where it cannot (rows.h).
 *
 * Work is split over the pool by rows (or by token x kv-head for attention), each thread
 * taking one contiguous range, so no two threads write the same cache line.
 */
#define _GNU_SOURCE
#include "cpu.h"
#include "ops.h"
#include "rows.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#if defined(CPU_USE_BLAS)
#include <cblas.h>
#endif

#if defined(LOOM_CPU_VARIANT_AVX512)
const cpu_variant_desc loom_cpu_variant = {"avx512", CPU_LEVEL_AVX512};
#elif defined(LOOM_CPU_VARIANT_AVX2)
const cpu_variant_desc loom_cpu_variant = {"avx2", CPU_LEVEL_AVX2};
#else
const cpu_variant_desc loom_cpu_variant = {"baseline", CPU_LEVEL_BASELINE};
#endif


#if !defined(__F16C__)
float cpu_f16_table[65536];

void cpu_f16_table_init(void)
{
    static int done; /* backends open one at a time; the table is the same every time */
    if (done)
        return;
    for (uint32_t h = 0; h < 65536; h++)
        cpu_f16_table[h] = loom_f16_to_f32((uint16_t)h);
    done = 1;
}
#endif

loom_status cpu_fail(cpu_backend *cb, loom_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cb->error, sizeof cb->error, fmt, ap);
    va_end(ap);
    return st;
}

loom_status cpu_check_bounds(cpu_backend *cb, const loom_tensor *t, const char *what)
{
    if (!t->buf)
        return cpu_fail(cb, LOOM_ERR_INVALID, "%s: tensor without a buffer", what);
    if (t->buf->prepared)
        return cpu_fail(cb, LOOM_ERR_INVALID,
                        "%s: a weight from prepare_weight, which only "
                        "matmul's w may be",
                        what);
    uint64_t extent = loom_tensor_extent(t);
    if (extent == UINT64_MAX)
        return cpu_fail(cb, LOOM_ERR_INVALID, "%s: malformed tensor (%s, ne0 %lld)", what,
                        loom_dtype_name(t->dtype), (long long)t->ne[0]);
    if (t->offset > t->buf->size || extent > t->buf->size - t->offset)
        return cpu_fail(cb, LOOM_ERR_INVALID, "%s: tensor spans [%llu, %llu) of a %llu-byte buffer",
                        what, (unsigned long long)t->offset,
                        (unsigned long long)(t->offset + extent), (unsigned long long)t->buf->size);
    return LOOM_OK;
}

/* ---- get_rows --------------------------------------------------------------------------- */

static loom_status cpu_get_rows(loom_backend *be, const loom_get_rows_params *p)
{
    CHECK_ARGS(be, loom_check_get_rows(p));
    BOUNDS(be, p->src, "get_rows src");
    BOUNDS(be, p->ids, "get_rows ids");
    BOUNDS(be, p->dst, "get_rows dst");
    int64_t rows = loom_tensor_rows(p->src), n = p->ids->ne[0];
    for (int64_t i = 0; i < n; i++) {
        int32_t id = i32_at(p->ids, i);
        if (id < 0 || id >= rows)
            return cpu_fail(CB(be), LOOM_ERR_INVALID, "get_rows: id %d at %lld outside [0, %lld)",
                            id, (long long)i, (long long)rows);
        cpu_load_row(p->src->dtype, cpu_row(p->src, base(p->src), id),
                     (float *)cpu_row(p->dst, base(p->dst), i), p->src->ne[0]);
    }
    return LOOM_OK;
}

/* ---- Norms ------------------------------------------------------------------------------ */

typedef struct norm_job {
    const loom_norm_params *p;
    int layer;
} norm_job;

static void norm_rows(void *ctx, int ith, int nth)
{
    const norm_job *j = ctx;
    const loom_norm_params *p = j->p;
    int64_t n = p->x->ne[0];
    const float *w = p->weight ? (const float *)cpu_row(p->weight, base(p->weight), 0) : NULL;
    const float *b = p->bias && j->layer ? (const float *)cpu_row(p->bias, base(p->bias), 0) : NULL;
    long r0, r1;
    pool_split((long)loom_tensor_rows(p->x), ith, nth, &r0, &r1);
    for (long r = r0; r < r1; r++) {
        const float *x = (const float *)cpu_row(p->x, base(p->x), r);
        float *y = (float *)cpu_row(p->dst, base(p->dst), r);
        float mean = 0.0f;
        if (j->layer) {
            double sum = 0.0;
            for (int64_t i = 0; i < n; i++)
                sum += x[i];
            mean = (float)(sum / (double)n);
        }
        double sq = 0.0;
        for (int64_t i = 0; i < n; i++)
            sq += (double)(x[i] - mean) * (x[i] - mean);
        float inv = (float)(1.0 / sqrt(sq / (double)n + p->eps));
        /* one loop per case: with `w ? w[i] : 1` inside, GCC emits masked loads from the NULL
         * pointer, and every such load took a microcode assist here (rms_norm of 16 x 768:
         * 88 us, 3 us without) */
        if (w && b)
            for (int64_t i = 0; i < n; i++)
                y[i] = (x[i] - mean) * inv * w[i] + b[i];
        else if (w)
            for (int64_t i = 0; i < n; i++)
                y[i] = (x[i] - mean) * inv * w[i];
        else
            for (int64_t i = 0; i < n; i++)
                y[i] = (x[i] - mean) * inv;
    }
}

static loom_status norm(loom_backend *be, const loom_norm_params *p, int layer)
{
    CHECK_ARGS(be, loom_check_norm(p));
    BOUNDS(be, p->x, "norm x");
    BOUNDS(be, p->weight, "norm weight");
    BOUNDS(be, layer ? p->bias : NULL, "norm bias");
    BOUNDS(be, p->dst, "norm dst");
    norm_job j = {p, layer};
    run(CB(be), norm_rows, &j, loom_tensor_rows(p->x) * p->x->ne[0]);
    return LOOM_OK;
}

static loom_status cpu_rms_norm(loom_backend *be, const loom_norm_params *p)
{
    return norm(be, p, 0);
}

static loom_status cpu_layer_norm(loom_backend *be, const loom_norm_params *p)
{
    return norm(be, p, 1);
}

/* ---- RoPE ------------------------------------------------------------------------------- */

/* Rotates n dims of v in pairs (adjacent, or i with i + n/2) by pos * base^(-2i/n). cs holds
 * the n/2 (cos, sin) pairs for this position. */
static void rotate(const float *x, float *y, int n, int adjacent, const float *cs)
{
    for (int i = 0; i < n / 2; i++) {
        int a = adjacent ? 2 * i : i, b = adjacent ? 2 * i + 1 : i + n / 2;
        float c = cs[2 * i], s = cs[2 * i + 1], x0 = x[a], x1 = x[b];
        y[a] = x0 * c - x1 * s;
        y[b] = x0 * s + x1 * c;
    }
}

/* inv[i] = base^(-2i/n): the same for every token of a call */
static void inverse_frequencies(double *inv, int n, double base)
{
    for (int i = 0; i < n / 2; i++)
        inv[i] = pow(base, -2.0 * i / n);
}

static void angles(float *cs, int n, double pos, const double *inv)
{
    for (int i = 0; i < n / 2; i++) {
        double theta = pos * inv[i];
        cs[2 * i] = (float)cos(theta);
        cs[2 * i + 1] = (float)sin(theta);
    }
}

static void rope_tokens(void *ctx, int ith, int nth)
{
    const loom_rope_params *p = ctx;
    int64_t hd = p->x->ne[0], heads = p->x->ne[1];
    float cs[1024], cs2[1024]; /* n_rot <= head_dim; checked against 1024 by the caller */
    double inv[512];
    long t0, t1;
    pool_split((long)(p->x->ne[2] * p->x->ne[3]), ith, nth, &t0, &t1);
    int glm = p->mode == LOOM_ROPE_GLM_2D;
    int n = glm ? (int)hd / 2 : p->n_rot;
    if (t0 < t1)
        inverse_frequencies(inv, n, p->freq_base);
    if (t0 < t1 && p->freq_factors) {
        const float *f = (const float *)cpu_row(p->freq_factors, base(p->freq_factors), 0);
        for (int i = 0; i < n / 2; i++)
            inv[i] /= (double)f[i];
    }
    for (long t = t0; t < t1; t++) {
        double pos = (double)i32_at(p->pos, t) * p->freq_scale;
        angles(cs, n, pos, inv);
        if (glm)
            angles(cs2, n, (double)i32_at(p->pos2, t) * p->freq_scale, inv);
        for (int64_t h = 0; h < heads; h++) {
            const float *x = (const float *)cpu_row(p->x, base(p->x), t * heads + h);
            float *y = (float *)cpu_row(p->dst, base(p->dst), t * heads + h);
            if (glm) {
                rotate(x, y, n, 0, cs);
                rotate(x + n, y + n, n, 0, cs2);
            } else {
                rotate(x, y, n, p->mode == LOOM_ROPE_ADJACENT, cs);
                if (x != y)
                    memcpy(y + n, x + n, (size_t)(hd - n) * sizeof(float));
            }
        }
    }
}

static loom_status cpu_rope(loom_backend *be, const loom_rope_params *p)
{
    CHECK_ARGS(be, loom_check_rope(p));
    BOUNDS(be, p->x, "rope x");
    BOUNDS(be, p->pos, "rope pos");
    BOUNDS(be, p->pos2, "rope pos2");
    BOUNDS(be, p->freq_factors, "rope freq_factors");
    BOUNDS(be, p->dst, "rope dst");
    if (p->x->ne[0] > 1024)
        return cpu_fail(CB(be), LOOM_ERR_UNSUPPORTED, "rope: head_dim %lld > 1024",
                        (long long)p->x->ne[0]);
    run(CB(be), rope_tokens, (void *)p, loom_tensor_rows(p->x) * p->x->ne[0]);
    return LOOM_OK;
}

/* ---- Elementwise ------------------------------------------------------------------------ */

typedef enum { EW_ADD, EW_MUL, EW_SCALE, EW_SILU_MUL, EW_GELU, EW_SIGMOID_MUL } ew_kind;

typedef struct ew_job {
    const loom_elementwise_params *p;
    ew_kind kind;
    int broadcast;
} ew_job;

static void ew_rows(void *ctx, int ith, int nth)
{
    const ew_job *j = ctx;
    const loom_elementwise_params *p = j->p;
    int64_t n = p->a->ne[0];
    long r0, r1;
    pool_split((long)loom_tensor_rows(p->a), ith, nth, &r0, &r1);
    for (long r = r0; r < r1; r++) {
        const float *a = (const float *)cpu_row(p->a, base(p->a), r);
        const float *b = p->b && j->kind != EW_SCALE && j->kind != EW_GELU
            ? (const float *)cpu_row(p->b, base(p->b), j->broadcast ? 0 : r)
            : NULL;
        float *y = (float *)cpu_row(p->dst, base(p->dst), r);
        switch (j->kind) {
        case EW_ADD:
            for (int64_t i = 0; i < n; i++)
                y[i] = a[i] + b[i];
            break;
        case EW_MUL:
            for (int64_t i = 0; i < n; i++)
                y[i] = a[i] * b[i];
            break;
        case EW_SCALE:
            for (int64_t i = 0; i < n; i++)
                y[i] = a[i] * p->scale;
            break;
        case EW_SILU_MUL: cpu_silu_mul_row(a, b, y, n); break;
        case EW_GELU: cpu_gelu_row(a, y, n); break;
        case EW_SIGMOID_MUL:
            for (int64_t i = 0; i < n; i++)
                y[i] = b[i] / (1.0f + expf(-a[i]));
            break;
        }
    }
}

static loom_status elementwise(loom_backend *be, const loom_elementwise_params *p, ew_kind kind)
{
    int binary = kind == EW_ADD || kind == EW_MUL || kind == EW_SILU_MUL || kind == EW_SIGMOID_MUL;
    CHECK_ARGS(be, loom_check_elementwise(p, binary, kind == EW_ADD || kind == EW_MUL));
    BOUNDS(be, p->a, "elementwise a");
    BOUNDS(be, binary ? p->b : NULL, "elementwise b");
    BOUNDS(be, p->dst, "elementwise dst");
    ew_job j = {p, kind, binary && loom_tensor_rows(p->b) == 1 && loom_tensor_rows(p->a) != 1};
    run(CB(be), ew_rows, &j, loom_tensor_rows(p->a) * p->a->ne[0]);
    return LOOM_OK;
}

static loom_status cpu_add(loom_backend *be, const loom_elementwise_params *p)
{
    return elementwise(be, p, EW_ADD);
}
static loom_status cpu_mul(loom_backend *be, const loom_elementwise_params *p)
{
    return elementwise(be, p, EW_MUL);
}
static loom_status cpu_scale(loom_backend *be, const loom_elementwise_params *p)
{
    return elementwise(be, p, EW_SCALE);
}
static loom_status cpu_silu_mul(loom_backend *be, const loom_elementwise_params *p)
{
    return elementwise(be, p, EW_SILU_MUL);
}
static loom_status cpu_gelu(loom_backend *be, const loom_elementwise_params *p)
{
    return elementwise(be, p, EW_GELU);
}
static loom_status cpu_sigmoid_mul(loom_backend *be, const loom_elementwise_params *p)
{
    return elementwise(be, p, EW_SIGMOID_MUL);
}

/* ---- Quantize, dequantize, convert ------------------------------------------------------ */

typedef struct convert_job {
    const loom_convert_params *p;
} convert_job;

static void convert_rows(void *ctx, int ith, int nth)
{
    const loom_convert_params *p = ((convert_job *)ctx)->p;
    int64_t n = p->src->ne[0];
    float *tmp = p->src->dtype == LOOM_F32 ? NULL : malloc((size_t)n * sizeof(float));
    long r0, r1;
    pool_split((long)loom_tensor_rows(p->src), ith, nth, &r0, &r1);
    for (long r = r0; r < r1 && (tmp || p->src->dtype == LOOM_F32); r++) {
        const unsigned char *s = cpu_row(p->src, base(p->src), r);
        unsigned char *d = cpu_row(p->dst, base(p->dst), r);
        if (p->dst->dtype == LOOM_F32) {
            cpu_load_row(p->src->dtype, s, (float *)d, n);
        } else if (p->src->dtype == LOOM_F32) {
            cpu_store_row(p->dst->dtype, (const float *)s, d, n);
        } else {
            cpu_load_row(p->src->dtype, s, tmp, n);
            cpu_store_row(p->dst->dtype, tmp, d, n);
        }
    }
    free(tmp);
}

static loom_status convert(loom_backend *be, const loom_convert_params *p, loom_op which)
{
    CHECK_ARGS(be, loom_check_convert(p, which));
    BOUNDS(be, p->src, "convert src");
    BOUNDS(be, p->dst, "convert dst");
    convert_job j = {p};
    run(CB(be), convert_rows, &j, loom_tensor_rows(p->src) * p->src->ne[0]);
    return LOOM_OK;
}

static loom_status cpu_quantize(loom_backend *be, const loom_convert_params *p)
{
    return convert(be, p, LOOM_OP_QUANTIZE);
}
static loom_status cpu_dequantize(loom_backend *be, const loom_convert_params *p)
{
    return convert(be, p, LOOM_OP_DEQUANTIZE);
}
static loom_status cpu_convert(loom_backend *be, const loom_convert_params *p)
{
    return convert(be, p, LOOM_OP_CONVERT);
}

/* ---- Buffers ---------------------------------------------------------------------------- */

#define HUGE_PAGE ((uint64_t)2 << 20)
#define HUGE_BUFFER ((uint64_t)8 << 20)

loom_status cpu_alloc(cpu_backend *cb, uint64_t size, int thread_local, loom_buffer **out)
{
    loom_buffer *b = calloc(1, sizeof *b);
    /* 64-byte aligned, rounded up so a vector load at the end stays inside. Large buffers (the
     * KV pool, weights uploaded from a file that could not be mapped) ask for transparent huge
     * pages: the KV pool is touched a block at a time while sequences grow, and a first-touch
     * fault per 4 KiB page cost 8% of a 16-sequence decode step on a VM (measured). */
    uint64_t align = size >= HUGE_BUFFER ? HUGE_PAGE : 64;
    uint64_t rounded = (size + align - 1) & ~(align - 1);
    if (b && size <= (uint64_t)SIZE_MAX / 2)
        b->data = aligned_alloc((size_t)align, rounded ? (size_t)rounded : 64);
#if defined(MADV_HUGEPAGE)
    if (b && b->data && align == HUGE_PAGE)
        madvise(b->data, (size_t)rounded, MADV_HUGEPAGE); /* advice: failure changes nothing */
#endif
    if (!b || !b->data) {
        free(b);
        return cpu_fail(cb, LOOM_ERR_OUT_OF_MEMORY, "cannot allocate %llu bytes of host memory",
                        (unsigned long long)size);
    }
    /* before the first touch, which is what places a page */
    if (align == HUGE_PAGE && cb->numa_mode != CPU_NUMA_OFF &&
        !(thread_local && cb->numa_mode == CPU_NUMA_LOCAL))
        cpu_numa_interleave(&cb->numa, b->data, (size_t)rounded);
    b->size = size;
    *out = b;
    return LOOM_OK;
}

/* Small prepared weights share chunks of huge pages. A decode matmul streams its weight once,
 * and in 4 KiB pages every page is a TLB miss and a stop for the hardware prefetcher: on an
 * Intel Xeon (2 vCPU) a 2048 x 2048 Q4_0 weight streamed at 59% of the read rate in its own
 * 4 KiB pages and at 81-94% in huge ones, and 1B Q4_0 decode went from 58-68% to 67-82% of its
 * roofline. Rounding each weight up to whole huge pages would cost a model a quarter more
 * memory; weights carved one after another from a shared chunk cost at most the chunk's last
 * partly used huge page. */
#define WEIGHT_CHUNK ((uint64_t)64 << 20)

/* Under AddressSanitizer a chunk is poisoned but for the buffers carved from it, with a gap
 * between them, so a kernel that reads past its weight is still caught as it would be past a
 * buffer of its own. */
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define CHUNK_GAP 64
#else
#define ASAN_POISON_MEMORY_REGION(p, n) ((void)(p), (void)(n))
#define ASAN_UNPOISON_MEMORY_REGION(p, n) ((void)(p), (void)(n))
#define CHUNK_GAP 0
#endif

/* a carved buffer's bytes: rounded as cpu_alloc's, so a vector load at the end stays inside */
static uint64_t carved_bytes(uint64_t size)
{
    return size ? (size + 63) & ~(uint64_t)63 : 64;
}

static void free_chunk(cpu_chunk *c)
{
    ASAN_UNPOISON_MEMORY_REGION(c->data, c->size);
    free(c->data);
    free(c);
}

loom_status cpu_alloc_weight(cpu_backend *cb, uint64_t size, int thread_local, loom_buffer **out)
{
    /* large weights have huge pages of their own; under LOOM_NUMA=local a weight's pages go
     * where the threads that read its rows run, which a shared chunk cannot promise */
    if (size >= HUGE_BUFFER || (thread_local && cb->numa_mode == CPU_NUMA_LOCAL))
        return cpu_alloc(cb, size, thread_local, out);
    uint64_t rounded = carved_bytes(size);
    loom_buffer *b = calloc(1, sizeof *b);
    if (!b)
        return cpu_fail(cb, LOOM_ERR_OUT_OF_MEMORY, "out of host memory");
    pthread_mutex_lock(&cb->chunk_mu);
    cpu_chunk *c = cb->chunk;
    if (c && c->live == 0)
        c->used = 0;
    if (!c || c->size - c->used < rounded + CHUNK_GAP) {
        cpu_chunk *fresh = calloc(1, sizeof *fresh);
        loom_buffer *pages = NULL;
        if (!fresh || cpu_alloc(cb, WEIGHT_CHUNK, 0, &pages) != LOOM_OK) {
            pthread_mutex_unlock(&cb->chunk_mu);
            free(fresh);
            free(b);
            return cpu_alloc(cb, size, thread_local, out); /* its own pages, then */
        }
        fresh->data = pages->data;
        fresh->size = WEIGHT_CHUNK;
        free(pages);
        ASAN_POISON_MEMORY_REGION(fresh->data, fresh->size);
        /* the chunk replaced lives on until its last buffer is freed */
        cb->chunk = c = fresh;
    }
    b->data = c->data + c->used;
    b->size = size;
    b->chunk = c;
    ASAN_UNPOISON_MEMORY_REGION(b->data, rounded);
    c->used += rounded + CHUNK_GAP;
    c->live++;
    pthread_mutex_unlock(&cb->chunk_mu);
    *out = b;
    return LOOM_OK;
}

static loom_status cpu_buffer_alloc(loom_backend *be, uint64_t size, loom_buffer **out)
{
    return cpu_alloc(CB(be), size, 0, out);
}

static void cpu_buffer_free(loom_backend *be, loom_buffer *b)
{
    if (!b)
        return;
    if (b->chunk) {
        cpu_backend *cb = CB(be);
        pthread_mutex_lock(&cb->chunk_mu);
        ASAN_POISON_MEMORY_REGION(b->data, carved_bytes(b->size));
        if (--b->chunk->live == 0 && b->chunk != cb->chunk)
            free_chunk(b->chunk);
        pthread_mutex_unlock(&cb->chunk_mu);
    } else if (!b->wrapped) {
        free(b->data);
    }
    free(b);
}

static void *cpu_buffer_host_ptr(loom_backend *be, loom_buffer *b)
{
    (void)be;
    return b->data;
}

static loom_status cpu_buffer_wrap_host(loom_backend *be, void *ptr, uint64_t size,
                                        loom_buffer **out)
{
    if (!ptr)
        return cpu_fail(CB(be), LOOM_ERR_INVALID, "buffer_wrap_host: NULL pointer");
    loom_buffer *b = calloc(1, sizeof *b);
    if (!b)
        return cpu_fail(CB(be), LOOM_ERR_OUT_OF_MEMORY, "out of host memory");
    b->data = ptr;
    b->size = size;
    b->wrapped = 1;
    *out = b;
    return LOOM_OK;
}

static loom_status range(loom_backend *be, const loom_buffer *b, uint64_t off, uint64_t n,
                         const char *what)
{
    if (!b)
        return cpu_fail(CB(be), LOOM_ERR_INVALID, "%s: NULL buffer", what);
    if (off > b->size || n > b->size - off)
        return cpu_fail(
            CB(be), LOOM_ERR_INVALID, "%s: bytes [%llu, +%llu) outside a %llu-byte buffer", what,
            (unsigned long long)off, (unsigned long long)n, (unsigned long long)b->size);
    return LOOM_OK;
}

static loom_status cpu_buffer_memset(loom_backend *be, loom_buffer *b, uint64_t off, int value,
                                     uint64_t n)
{
    TRY(range(be, b, off, n, "buffer_memset"));
    memset(b->data + off, value, (size_t)n);
    return LOOM_OK;
}

static loom_status cpu_copy_from_host(loom_backend *be, loom_buffer *dst, uint64_t off,
                                      const void *src, uint64_t n)
{
    TRY(range(be, dst, off, n, "copy_from_host"));
    if (n)
        memcpy(dst->data + off, src, (size_t)n);
    return LOOM_OK;
}

static loom_status cpu_copy_to_host(loom_backend *be, void *dst, loom_buffer *src, uint64_t off,
                                    uint64_t n)
{
    TRY(range(be, src, off, n, "copy_to_host"));
    if (n)
        memcpy(dst, src->data + off, (size_t)n);
    return LOOM_OK;
}

static loom_status cpu_copy_buffer(loom_backend *be, loom_buffer *dst, uint64_t doff,
                                   loom_buffer *src, uint64_t soff, uint64_t n)
{
    TRY(range(be, dst, doff, n, "copy_buffer dst"));
    TRY(range(be, src, soff, n, "copy_buffer src"));
    if (n)
        memmove(dst->data + doff, src->data + soff, (size_t)n);
    return LOOM_OK;
}

static loom_status cpu_synchronize(loom_backend *be)
{
    (void)be; /* every op has finished when it returns */
    return LOOM_OK;
}

/* ---- Lifetime --------------------------------------------------------------------------- */

static int cpu_supports(loom_backend *be, loom_op op, loom_dtype dt)
{
    (void)be;
    switch (op) {
    case LOOM_OP_MATMUL:
    case LOOM_OP_MATMUL_ID:
    case LOOM_OP_GET_ROWS: return loom_dtype_is_float(dt) || loom_dtype_is_quantized(dt);
    case LOOM_OP_KV_STORE:
    case LOOM_OP_ATTENTION: return loom_dtype_is_cache(dt);
    case LOOM_OP_QUANTIZE: return loom_dtype_is_block(dt); /* the types with a quantiser */
    case LOOM_OP_DEQUANTIZE: return loom_dtype_is_quantized(dt);
    case LOOM_OP_CONVERT:
    case LOOM_OP_SSM_CONV: return loom_dtype_is_float(dt);
    case LOOM_OP_COUNT: return 0;
    default: return dt == LOOM_F32;
    }
}

static const char *cpu_last_error(loom_backend *be)
{
    return CB(be)->error;
}

static void cpu_close(loom_backend *be)
{
    cpu_backend *cb = CB(be);
    pool_free(cb->pool);
    if (cb->chunk && cb->chunk->live == 0) /* live ones: buffers the caller never freed */
        free_chunk(cb->chunk);
    pthread_mutex_destroy(&cb->chunk_mu);
    free(be);
}

static const loom_backend_ops cpu_ops = {
    .struct_size = sizeof(loom_backend_ops),
    .close = cpu_close,
    .last_error = cpu_last_error,
    .supports = cpu_supports,
    .buffer_alloc = cpu_buffer_alloc,
    .buffer_free = cpu_buffer_free,
    .buffer_host_ptr = cpu_buffer_host_ptr,
    .buffer_wrap_host = cpu_buffer_wrap_host,
    .buffer_memset = cpu_buffer_memset,
    .copy_from_host = cpu_copy_from_host,
    .copy_to_host = cpu_copy_to_host,
    .copy_buffer = cpu_copy_buffer,
    .synchronize = cpu_synchronize,
    .matmul = cpu_matmul,
    .get_rows = cpu_get_rows,
    .rms_norm = cpu_rms_norm,
    .layer_norm = cpu_layer_norm,
    .rope = cpu_rope,
    .add = cpu_add,
    .mul = cpu_mul,
    .scale = cpu_scale,
    .silu_mul = cpu_silu_mul,
    .gelu = cpu_gelu,
    .kv_store = cpu_kv_store,
    .attention = cpu_attention,
    .quantize = cpu_quantize,
    .dequantize = cpu_dequantize,
    .convert = cpu_convert,
    .prepare_weight = cpu_prepare_weight,
    .moe_route = cpu_moe_route,
    .matmul_id = cpu_matmul_id,
    .moe_combine = cpu_moe_combine,
    .sigmoid_mul = cpu_sigmoid_mul,
    .ssm_conv = cpu_ssm_conv,
    .gated_delta = cpu_gated_delta,
};

loom_status cpu_backend_create(const loom_backend_options *opts, const cpu_features *f,
                               loom_backend **out, char *err, size_t err_size)
{
#if !defined(__F16C__)
    cpu_f16_table_init();
#endif
    int n = opts->n_threads;
    const char *env = getenv("LOOM_THREADS");
    if (n <= 0 && env && *env) {
        char *end;
        long v = strtol(env, &end, 10);
        if (*end || v < 1 || v > 1024) {
            snprintf(err, err_size, "LOOM_THREADS=%s is not a thread count (1..1024)", env);
            return LOOM_ERR_INVALID;
        }
        n = (int)v;
    }
    if (n <= 0) {
        cpu_thread_default t;
        cpu_default_threads(&t);
        n = t.threads;
    }
    cpu_backend *cb = calloc(1, sizeof *cb);
    if (!cb) {
        snprintf(err, err_size, "out of host memory");
        return LOOM_ERR_OUT_OF_MEMORY;
    }
    cb->feat = *f;
    pthread_mutex_init(&cb->chunk_mu, NULL);
    /* LOOM_CPU_DISABLE=vnni: use the plain AVX-512 or AVX2 kernels even where VNNI exists, so
     * both can be checked (and compared) on one machine */
    const char *off = getenv("LOOM_CPU_DISABLE");
    if (off && strstr(off, "vnni"))
        cb->feat.avx512vnni = cb->feat.avxvnni = 0;
    if (off && strstr(off, "bf16")) /* likewise the BF16 dot product */
        cb->feat.avx512bf16 = 0;
    cpu_numa_read(&cb->numa);
    if ((cb->numa_mode = cpu_numa_mode(&cb->numa, err, err_size)) < 0) {
        free(cb);
        return LOOM_ERR_INVALID;
    }
    cb->pool = pool_create(n);
    if (!cb->pool) {
        snprintf(err, err_size, "cannot start %d threads: %s", n, strerror(errno));
        free(cb);
        return LOOM_ERR_INTERNAL;
    }
    if (cb->numa_mode == CPU_NUMA_LOCAL && cb->numa.n_nodes > 1) {
        /* pool_split gives thread i the i-th contiguous share of every op's rows, so threads
         * bound node by node read node-local rows of each prepared weight */
        int *node = malloc((size_t)n * sizeof *node);
        if (node) {
            cpu_numa_plan(&cb->numa, n, node);
            for (int i = 1; i < n; i++)
                pool_bind_worker(cb->pool, i, &cb->numa.cpus[node[i]], sizeof(cpu_set_t));
            free(node);
        }
    }
#if defined(CPU_USE_BLAS)
    openblas_set_num_threads(n); /* its own pool, used for prefill-sized f32 matmuls */
#endif
    cb->base.ops = &cpu_ops;
    *out = &cb->base;
    return LOOM_OK;
}
