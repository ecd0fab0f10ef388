/*
 * backends/cpu/cpu_matmul.c - Y[M,N] = X[M,K] W[N,K]^T (+ bias) on the CPU.
 *
 * Quantised W: X is quantised to int8 blocks once per call (cpu_act), then every thread takes
 * a contiguous range of W's rows, so it streams its own part of the weights from memory once.
 * Within the range, a chunk of rows small enough to stay in L2 is run against all of X in
 * tiles of KERN_MR rows (and KERN_NR weight rows at a time), so prefill reuses each weight row from cache rather than memory.
 * Float W works the same way without the quantisation step.
 */
#include "cpu.h"
#include "kern.h"
#include "rows.h"

#include <stdlib.h>
#include <string.h>

#if defined(CPU_USE_BLAS)
#include <cblas.h>
#endif

/* W rows per cache-resident chunk: 16 rows of 4096 f32 are 256 KiB */
#define CHUNK_ROWS 16

typedef struct mm_job {
    const loom_matmul_params *p;
    int64_t M, N, K;
    cpu_act act;              /* prepared X (quantised W only) */
    act_group *groups;        /* its storage */
    kern_layout layout;       /* how X is prepared for the kernel */
    const float **xrows;      /* X's rows (float W only) */
    kern_quant_fn kq;
    kern_float_fn kf;
    const float *bias;
    int split_m;              /* too few W rows to share: split X's rows instead */
    int nr_max;               /* weight rows per tile */
} mm_job;

static unsigned char *data(const loom_tensor *t)
{
    return t->buf->data;
}

static void prepare_x(void *ctx, int ith, int nth)
{
    mm_job *j = ctx;
    long m0, m1;
    pool_split((long)j->M, ith, nth, &m0, &m1);
    for (long m = m0; m < m1; m++)
        kern_prep((const float *)cpu_row(j->p->x, data(j->p->x), m), j->K,
                  j->groups + m * j->act.groups, j->layout);
}

static void mm_rows(void *ctx, int ith, int nth)
{
    mm_job *j = ctx;
    const loom_tensor *w = j->p->w, *y = j->p->y;
    long n0 = 0, n1 = (long)j->N, ma = 0, mb = (long)j->M;
    if (j->split_m)
        pool_split((long)j->M, ith, nth, &ma, &mb);
    else
        pool_split((long)j->N, ith, nth, &n0, &n1);
    float out[KERN_NR * KERN_MR];
    for (long c0 = n0; c0 < n1; c0 += CHUNK_ROWS) {
        long c1 = c0 + CHUNK_ROWS < n1 ? c0 + CHUNK_ROWS : n1;
        for (long m0 = ma; m0 < mb; m0 += KERN_MR) {
            int mr = mb - m0 < KERN_MR ? (int)(mb - m0) : KERN_MR;
            int nr;
            for (long n = c0; n < c1; n += nr) {
                nr = c1 - n < j->nr_max ? (int)(c1 - n) : j->nr_max;
                const unsigned char *wrow = cpu_row(w, data(w), n);
                if (j->kq)
                    j->kq(wrow, w->nb[1], nr, &j->act, m0, mr, out);
                else
                    j->kf(w->dtype, wrow, w->nb[1], nr, j->xrows + m0, mr, j->K, out);
                for (int r = 0; r < mr; r++) {
                    float *yr = (float *)cpu_row(y, data(y), m0 + r) + n;
                    const float *o = out + r * KERN_NR;
                    if (j->bias)
                        for (int i = 0; i < nr; i++)
                            yr[i] = o[i] + j->bias[n + i];
                    else
                        memcpy(yr, o, (size_t)nr * sizeof *yr);
                }
            }
        }
    }
}

/* OpenBLAS's sgemm for f32 weights at prefill sizes, in the variants whose own kernels it beats
 * (measured: avx2 and baseline lose to it from M = 64; the avx512 kernels win). Returns 1 when
 * it did the work. */
/* Rows evenly spaced in one plane, as BLAS wants: the leading dimension in elements, or 0. */
#if defined(CPU_USE_BLAS)
static int64_t leading_dim(const loom_tensor *t)
{
    int uniform = t->ne[2] * t->ne[3] == 1 || (t->nb[2] == t->nb[1] * (uint64_t)t->ne[1] &&
                                                t->nb[3] == t->nb[2] * (uint64_t)t->ne[2]);
    return uniform && t->nb[1] % sizeof(float) == 0 ? (int64_t)(t->nb[1] / sizeof(float)) : 0;
}
#endif

static int try_blas(cpu_backend *cb, const loom_matmul_params *p, int64_t M, int64_t N, int64_t K)
{
#if defined(CPU_USE_BLAS)
    int64_t lx = leading_dim(p->x), lw = leading_dim(p->w), ly = leading_dim(p->y);
    if (p->w->dtype != LOOM_F32 || M < 64 || !lx || !lw || !ly)
        return 0;
    float *y = (float *)(p->y->buf->data + p->y->offset);
    if (p->bias) {
        const float *b = (const float *)(p->bias->buf->data + p->bias->offset);
        for (int64_t m = 0; m < M; m++)
            memcpy(y + m * ly, b, (size_t)N * sizeof(float));
    }
    (void)cb;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (blasint)M, (blasint)N, (blasint)K, 1.0f,
                (const float *)(p->x->buf->data + p->x->offset), (blasint)lx,
                (const float *)(p->w->buf->data + p->w->offset), (blasint)lw,
                p->bias ? 1.0f : 0.0f, y, (blasint)ly);
    return 1;
#else
    (void)cb, (void)p, (void)M, (void)N, (void)K;
    return 0;
#endif
}

loom_status cpu_matmul(loom_backend *be, const loom_matmul_params *p)
{
    cpu_backend *cb = (cpu_backend *)be;
    const char *msg = loom_check_matmul(p);
    if (msg)
        return cpu_fail(cb, LOOM_ERR_INVALID, "%s", msg);
    loom_status st;
    if ((st = cpu_check_bounds(cb, p->x, "matmul x")) || (st = cpu_check_bounds(cb, p->w, "matmul w")) ||
        (st = cpu_check_bounds(cb, p->y, "matmul y")) ||
        (p->bias && (st = cpu_check_bounds(cb, p->bias, "matmul bias"))))
        return st;
    mm_job j = {.p = p, .M = loom_tensor_rows(p->x), .N = loom_tensor_rows(p->w), .K = p->x->ne[0]};
    if (j.M == 0 || j.N == 0)
        return LOOM_OK;
    if (try_blas(cb, p, j.M, j.N, j.K))
        return LOOM_OK;
    j.bias = p->bias ? (const float *)cpu_row(p->bias, data(p->bias), 0) : NULL;
    int nth = pool_size(cb->pool);
    j.split_m = j.N < (int64_t)nth * CHUNK_ROWS && j.M >= (int64_t)nth * KERN_MR;
    /* Tiles span several weight rows only when those rows are evenly spaced. For quantised
     * weights at decode sizes, one row at a time is twice as fast here (measured, 1B Q4_0
     * decode: 35 vs 18 tokens/s): memory streams one sequential row far better than four
     * interleaved ones. Float weights keep four rows: their kernel then has four independent
     * accumulator chains, and one row alone is FMA-latency bound (f16: 41 vs 25 GB/s). */
    int uniform_w = p->w->ne[2] * p->w->ne[3] == 1 ||
                    (p->w->nb[2] == p->w->nb[1] * (uint64_t)p->w->ne[1] &&
                     p->w->nb[3] == p->w->nb[2] * (uint64_t)p->w->ne[2]);
    int decode_quant = loom_dtype_is_block(p->w->dtype) && j.M < KERN_MR;
    j.nr_max = uniform_w && !decode_quant ? KERN_NR : 1;

    void *scratch = NULL;
    loom_dtype wt = p->w->dtype;
    if (loom_dtype_is_block(wt)) {
        int vnni = 0;
#if defined(LOOM_CPU_VARIANT_AVX512)
        vnni = cb->feat.avx512vnni;
#endif
        j.kq = wt == LOOM_Q8_0 ? (vnni ? kern_q8_0_vnni : kern_q8_0)
               : wt == LOOM_Q4_0 ? (vnni ? kern_q4_0_vnni : kern_q4_0)
                                 : (vnni ? kern_q4_1_vnni : kern_q4_1);
        j.layout = kern_layout_for(wt, vnni);
        j.act.nb = j.K / LOOM_QK;
        j.act.groups = (j.act.nb + KERN_G - 1) / KERN_G;
        size_t bytes = (size_t)(j.M * j.act.groups) * sizeof(act_group);
        scratch = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
        if (!scratch)
            return cpu_fail(cb, LOOM_ERR_OUT_OF_MEMORY, "matmul: no memory to quantise X");
        j.groups = scratch;
        j.act.g = j.groups;
        if (j.M * j.K >= 16384)
            pool_run(cb->pool, prepare_x, &j);
        else
            prepare_x(&j, 0, 1);
    } else {
        j.kf = kern_float;
        scratch = malloc((size_t)j.M * sizeof(float *));
        if (!scratch)
            return cpu_fail(cb, LOOM_ERR_OUT_OF_MEMORY, "matmul: out of memory");
        j.xrows = scratch;
        for (int64_t m = 0; m < j.M; m++)
            j.xrows[m] = (const float *)cpu_row(p->x, data(p->x), m);
    }
    if (j.M * j.N * j.K >= 65536)
        pool_run(cb->pool, mm_rows, &j);
    else
        mm_rows(&j, 0, 1);
    free(scratch);
    return LOOM_OK;
}
