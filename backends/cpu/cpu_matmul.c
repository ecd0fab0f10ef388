/*
 * backends/cpu/cpu_matmul.c - Y[M,N] = X[M,K] W[N,K]^T (+ bias) on the CPU.
 *
 * Quantised W: X is quantised to int8 blocks once per call (cpu_act), then every thread takes
 * a contiguous range of W's rows, so it streams its own part of the weights from memory once.
 * Within the range, a chunk of rows small enough to stay in L2 is run against all of X in
 * tiles of KERN_MR rows (and KERN_NR weight rows at a time), so prefill reuses each weight row from cache rather than memory.
 * Float W works the same way without the quantisation step.
 *
 * Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 and IQ4_NL W that went through cpu_prepare_weight have their rows
 * interleaved
 * (kern.h): threads then take groups of KERN_RI rows, each a contiguous run of bytes, and X is
 * quantised per block.
 *
 * The ABI 1.2 types (K-quants, IQ4, Q5) have X quantised per block the same way; each chunk of
 * W rows is unpacked once into kern_kq.c's common shape and then met by every tile of X (the
 * baseline variant, and the avx2/avx512 ones where a row split leaves too few W rows). Q2_K..Q6_K
 * and IQ4_XS (avx2 and avx512) skip the unpacking: X is quantised per 256 (act_k) and
 * kern_kq_direct reads the file's layout, a chunk of W rows against every tile of X; Q5_0, Q5_1
 * and IQ4_NL are interleaved (above).
 */
#include "cpu.h"
#include "kern.h"
#include "rows.h"

#include <loom/quants.h>

#include <stdio.h>
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
    act_block *blocks;        /* prepared X for an interleaved W: [M][K / 32] */
    kern_ri_fn kri;           /* its kernel (Q4_0), or NULL */
    kern_float_ri_fn kfri;    /* an interleaved F16/BF16 W's kernel, or NULL */
    kern_float_ri_n_fn kfrin; /* its several-group kernel for several X rows */
#ifdef KERN_WIDEN_MR
    kern_half_ri_widen_fn kwiden; /* ... and for many X rows: W widened to f32 a block at a time */
#endif
    uint32_t **xpairs;    /* X as BF16 pairs, for a W in BF16 column pairs */
    uint64_t group_bytes; /* an interleaved W's bytes per group of KERN_RI rows */
    kern_quant_fn kq;
    kern_float_fn kf;
    const float *bias;
    int split_m;             /* too few W rows to share: split X's rows instead */
    int nr_max;              /* weight rows per tile */
    int unpacked;            /* an ABI 1.2 type: chunks of W rows unpacked (kern_kq.c) */
    int direct;              /* ... or, at decode sizes, dotted in the file's layout */
    int vnni;                /* the CPU has this variant's VNNI (kern_kq_direct takes it) */
    act_k *kblocks;          /* X for direct: quantised per 256 */
    int kq_min;              /* its values have minimums */
    unsigned char *kq_space; /* per thread, CHUNK_ROWS unpacked rows */
    size_t kq_thread_bytes;
} mm_job;

static unsigned char *data(const loom_tensor *t)
{
    return t->buf->data;
}

/* the block types whose rows cpu_prepare_weight interleaves into kern.h's records: IQ4_NL's
 * blocks have Q4_0's shape, so its records too */
static int interleaves_blocks(loom_dtype wt)
{
    return loom_dtype_is_block(wt) || wt == LOOM_IQ4_NL || wt == LOOM_Q5_0 || wt == LOOM_Q5_1;
}

/* BF16 pairs: the dot product for a few rows of X, where W's bytes set the pace, and for
 * prefill where it runs at full rate (cpu.h); otherwise widened blocks and f32 tiles
 * (kern_bf16_pairs_widen) when there are enough rows to be compute-bound */
static int bf16_pairs_widened(const cpu_backend *cb, int64_t M)
{
#ifdef KERN_WIDEN_MR
    return !cb->feat.bf16_dp_full_rate && M >= 2 * KERN_WIDEN_MR;
#else
    (void)cb, (void)M;
    return 0;
#endif
}

static void prepare_x(void *ctx, int ith, int nth)
{
    mm_job *j = ctx;
    long m0, m1;
    pool_split((long)j->M, ith, nth, &m0, &m1);
    for (long m = m0; m < m1; m++) {
        const float *x = (const float *)cpu_row(j->p->x, data(j->p->x), m);
        if (j->direct)
            kern_prep_k(x, j->K, kern_kq_swapped(j->p->w->dtype),
                        j->kblocks + m * (j->K / LOOM_QK_K));
        else if (j->kri || j->unpacked)
            kern_prep_blocks(x, j->K, j->blocks + m * (j->K / LOOM_QK));
#if defined(LOOM_CPU_VARIANT_AVX512)
        else if (j->xpairs)
            kern_bf16_pack_x(x, j->K, j->xpairs[m]);
#endif
        else
            kern_prep(x, j->K, j->groups + m * j->act.groups, j->layout);
    }
}

/* Y's rows m0.. m0 + mr, columns n.. n + nr, from a tile of results ld apart (+ bias) */
static void store_tile(const mm_job *j, long m0, int mr, long n, int nr, const float *out, int ld)
{
    for (int r = 0; r < mr; r++) {
        float *yr = (float *)cpu_row(j->p->y, data(j->p->y), m0 + r) + n;
        const float *o = out + r * ld;
        if (j->bias)
            for (int i = 0; i < nr; i++)
                yr[i] = o[i] + j->bias[n + i];
        else
            memcpy(yr, o, (size_t)nr * sizeof *yr);
    }
}

#if KERN_RI
/* Bytes of one group of KERN_RI interleaved rows of K elements (layouts in kern.h). */
static uint64_t group_bytes(loom_dtype wt, cpu_layout layout, int64_t K)
{
    if (layout == CPU_LAYOUT_BF16_PAIRS)
        return (uint64_t)((K + 1) / 2) * KERN_RI * 4;
    if (wt == LOOM_Q4_0 || wt == LOOM_IQ4_NL)
        return (uint64_t)((K / LOOM_QK + 1) / 2) * sizeof(q4_0_ri_record);
    if (wt == LOOM_Q8_0)
        return (uint64_t)((K / LOOM_QK + 1) / 2) * sizeof(q8_0_ri_record);
    if (wt == LOOM_Q4_1)
        return (uint64_t)((K / LOOM_QK + 1) / 2) * sizeof(q4_1_ri_record);
    if (wt == LOOM_Q5_0)
        return (uint64_t)((K / LOOM_QK + 1) / 2) * sizeof(q5_0_ri_record);
    if (wt == LOOM_Q5_1)
        return (uint64_t)((K / LOOM_QK + 1) / 2) * sizeof(q5_1_ri_record);
    return (uint64_t)K * KERN_RI * 2; /* F16, BF16 */
}

#ifdef KERN_WIDEN_MR
/* An F16/BF16 W's columns widened per block, and X's rows per pass over the blocks: the
 * widened block (64 x 4 groups x 16 floats, 16 KiB) and the pass's sums (15 KiB) stay in L1
 * while the rows' tiles go by. */
#define WIDEN_COLS 64
#define WIDEN_ROWS (10 * KERN_WIDEN_MR)

/* ng groups from g (at wg) against X's rows ma .. mb, each block of W's columns widened to f32
 * once for the pass's rows rather than once per tile of them (kern.h) */
static void mm_groups_widened(const mm_job *j, const unsigned char *wg, int ng, long g, long ma,
                              long mb)
{
    _Alignas(64) float wf[WIDEN_COLS * KERN_RI_GROUPS * KERN_RI];
    _Alignas(64) float acc[WIDEN_ROWS * KERN_RI_GROUPS * KERN_RI];
    const int width = ng * KERN_RI;
    for (long mc = ma; mc < mb; mc += WIDEN_ROWS) {
        long me = mb - mc < WIDEN_ROWS ? mb : mc + WIDEN_ROWS;
        memset(acc, 0, (size_t)(me - mc) * (size_t)width * sizeof *acc);
        for (int64_t k0 = 0; k0 < j->K; k0 += WIDEN_COLS) {
            int64_t kc = j->K - k0 < WIDEN_COLS ? j->K - k0 : WIDEN_COLS;
            j->kwiden(wg, j->group_bytes, ng, k0, kc, wf);
            for (long m0 = mc; m0 < me; m0 += KERN_WIDEN_MR) {
                int mr = me - m0 < KERN_WIDEN_MR ? (int)(me - m0) : KERN_WIDEN_MR;
                kern_f32_ri_n_acc(wf, ng, kc, j->xrows + m0, k0, mr, acc + (m0 - mc) * width);
            }
        }
        store_tile(j, mc, (int)(me - mc), g * KERN_RI, width, acc, width);
    }
}
#endif

/* mm_rows for an interleaved W: a group of KERN_RI rows is the unit of work and stays in cache
 * while every tile of X's rows passes it. */
static void mm_groups(void *ctx, int ith, int nth)
{
    mm_job *j = ctx;
    long g0 = 0, g1 = (long)(j->N / KERN_RI), ma = 0, mb = (long)j->M;
    if (j->split_m)
        pool_split((long)j->M, ith, nth, &ma, &mb);
    else
        pool_split(g1, ith, nth, &g0, &g1);
    int64_t nb = j->K / LOOM_QK;
    float out[KERN_RI_GROUPS * KERN_RI * KERN_MR];
    for (long g = g0; g < g1;) {
        const unsigned char *wg = data(j->p->w) + (uint64_t)g * j->group_bytes;
        int most = (int)(g1 - g < KERN_RI_GROUPS ? g1 - g : KERN_RI_GROUPS);
#ifdef KERN_WIDEN_MR
        if (j->kwiden && (mb - ma >= 2 * KERN_WIDEN_MR || !j->kfri)) { /* prefill */
            mm_groups_widened(j, wg, most, g, ma, mb);
            g += most;
            continue;
        }
#endif
        /* float W against several X rows goes several groups at a time */
        int ng = (j->kfrin || j->xpairs) && mb - ma >= 2 ? most : 1;
        for (long m0 = ma; m0 < mb; m0 += KERN_MR) {
            int mr = mb - m0 < KERN_MR ? (int)(mb - m0) : KERN_MR;
#if defined(LOOM_CPU_VARIANT_AVX512)
            if (j->xpairs) {
                kern_bf16_dp(wg, j->group_bytes, ng, j->K, (const uint32_t *const *)j->xpairs + m0,
                             mr, out);
                store_tile(j, m0, mr, g * KERN_RI, ng * KERN_RI, out, ng * KERN_RI);
                continue;
            }
#endif
            if (ng >= 2 && mr >= 2) {
                j->kfrin(wg, j->group_bytes, ng, j->K, j->xrows + m0, mr, out);
                store_tile(j, m0, mr, g * KERN_RI, ng * KERN_RI, out, ng * KERN_RI);
                continue;
            }
            for (int h = 0; h < ng; h++) {
                const unsigned char *w = wg + (uint64_t)h * j->group_bytes;
                if (j->kri)
                    j->kri(w, nb, j->blocks + m0 * nb, mr, out);
                else
                    j->kfri(w, j->K, j->xrows + m0, mr, out);
                store_tile(j, m0, mr, (g + h) * KERN_RI, KERN_RI, out, KERN_RI);
            }
        }
        g += ng;
    }
}
#endif

static void mm_rows(void *ctx, int ith, int nth)
{
    mm_job *j = ctx;
    const loom_tensor *w = j->p->w;
    long n0 = 0, n1 = (long)j->N, ma = 0, mb = (long)j->M;
    if (j->split_m)
        pool_split((long)j->M, ith, nth, &ma, &mb);
    else
        pool_split((long)j->N, ith, nth, &n0, &n1);
    float out[KERN_NR * KERN_MR];
    int64_t nb = j->K / LOOM_QK;
    kq_row rows[CHUNK_ROWS];
    if (j->unpacked) { /* this thread's unpacked rows: chunks, then d, then dmin */
        unsigned char *space = j->kq_space + (size_t)ith * j->kq_thread_bytes;
        for (int r = 0; r < CHUNK_ROWS; r++) {
            rows[r].c = (kq_chunk *)(void *)space + (size_t)(r * nb);
            rows[r].d = (float *)(void *)(space + CHUNK_ROWS * (size_t)nb * sizeof(kq_chunk)) +
                (size_t)(r * nb);
            rows[r].dmin = rows[r].d + CHUNK_ROWS * (size_t)nb;
        }
    }
    for (long c0 = n0; j->direct && c0 < n1; c0 += CHUNK_ROWS) {
        /* a chunk of rows (in L1) against every tile of X, so X streams from L2 once a chunk */
        long c1 = c0 + CHUNK_ROWS < n1 ? c0 + CHUNK_ROWS : n1;
        for (long m0 = ma; m0 < mb; m0 += KERN_MR) {
            int mr = mb - m0 < KERN_MR ? (int)(mb - m0) : KERN_MR, nr;
            for (long n = c0; n < c1; n += nr) {
                nr = c1 - n < j->nr_max ? (int)(c1 - n) : j->nr_max;
                kern_kq_direct(w->dtype, cpu_row(w, data(w), n), w->nb[1], nr, j->K,
                               j->kblocks + m0 * (j->K / LOOM_QK_K), mr, j->vnni, out);
                store_tile(j, m0, mr, n, nr, out, KERN_NR);
            }
        }
    }
    if (j->direct)
        return;
    for (long c0 = n0; c0 < n1; c0 += CHUNK_ROWS) {
        long c1 = c0 + CHUNK_ROWS < n1 ? c0 + CHUNK_ROWS : n1;
        for (long n = c0; j->unpacked && n < c1; n++)
            kern_kq_unpack(w->dtype, cpu_row(w, data(w), n), j->K, &rows[n - c0]);
        for (long m0 = ma; m0 < mb; m0 += KERN_MR) {
            int mr = mb - m0 < KERN_MR ? (int)(mb - m0) : KERN_MR;
            int nr;
            for (long n = c0; n < c1; n += nr) {
                nr = c1 - n < j->nr_max ? (int)(c1 - n) : j->nr_max;
                const unsigned char *wrow = cpu_row(w, data(w), n);
                if (j->unpacked)
                    kern_kq(&rows[n - c0], nr, j->kq_min, j->blocks + m0 * nb, nb, mr, out);
                else if (j->kq)
                    j->kq(wrow, w->nb[1], nr, &j->act, m0, mr, out);
                else
                    j->kf(w->dtype, wrow, w->nb[1], nr, j->xrows + m0, mr, j->K, out);
                store_tile(j, m0, mr, n, nr, out, KERN_NR);
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
    int uniform = t->ne[2] * t->ne[3] == 1 ||
        (t->nb[2] == t->nb[1] * (uint64_t)t->ne[1] && t->nb[3] == t->nb[2] * (uint64_t)t->ne[2]);
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
                (const float *)(p->w->buf->data + p->w->offset), (blasint)lw, p->bias ? 1.0f : 0.0f,
                y, (blasint)ly);
    return 1;
#else
    (void)cb, (void)p, (void)M, (void)N, (void)K;
    return 0;
#endif
}

/* matmul's w: in its buffer's bounds, or a prepared weight passed whole */
static loom_status check_weight(cpu_backend *cb, const loom_tensor *w)
{
    const loom_buffer *b = w->buf;
    if (!b || !b->prepared)
        return cpu_check_bounds(cb, w, "matmul w");
    if (w->offset != 0 || w->dtype != b->prepared_type || w->ne[0] != b->prepared_k ||
        loom_tensor_rows(w) != b->prepared_n)
        return cpu_fail(cb, LOOM_ERR_INVALID,
                        "matmul: w is a prepared %s [%lld, %lld] weight "
                        "seen as %s [%lld, %lld] at offset %llu; pass it whole, as "
                        "prepare_weight returned it",
                        loom_dtype_name(b->prepared_type), (long long)b->prepared_n,
                        (long long)b->prepared_k, loom_dtype_name(w->dtype),
                        (long long)loom_tensor_rows(w), (long long)w->ne[0],
                        (unsigned long long)w->offset);
    return LOOM_OK;
}

/* The VNNI build of a kernel where the CPU has it: AVX512-VNNI for the avx512 variant, AVX-VNNI
 * (the same instructions on ymm) for the avx2 one; the baseline links none. */
#if defined(LOOM_CPU_VARIANT_AVX512)
#define HAS_VNNI(cb) ((cb)->feat.avx512vnni)
#elif defined(LOOM_CPU_VARIANT_AVX2)
#define HAS_VNNI(cb) ((cb)->feat.avxvnni)
#endif
#ifdef HAS_VNNI
#define VNNI_OR(cb, kernel) (HAS_VNNI(cb) ? kernel##_vnni : kernel)
#else
#define HAS_VNNI(cb) 0
#define VNNI_OR(cb, kernel) (kernel)
#endif

/* The matmul on the pool's threads (shared), or on the calling thread alone; xq: X already in
 * act_blocks, for a W that cpu_matmul_takes_blocks (else NULL). */
static loom_status matmul_run(cpu_backend *cb, const loom_matmul_params *p, int shared,
                              const act_block *xq)
{
    const char *msg = loom_check_matmul(p);
    if (msg)
        return cpu_fail(cb, LOOM_ERR_INVALID, "%s", msg);
    loom_status st;
    if ((st = cpu_check_bounds(cb, p->x, "matmul x")) || (st = check_weight(cb, p->w)) ||
        (st = cpu_check_bounds(cb, p->y, "matmul y")) ||
        (p->bias && (st = cpu_check_bounds(cb, p->bias, "matmul bias"))))
        return st;
    mm_job j = {.p = p, .M = loom_tensor_rows(p->x), .N = loom_tensor_rows(p->w), .K = p->x->ne[0]};
    if (j.M == 0 || j.N == 0)
        return LOOM_OK;
    int prepared = p->w->buf->prepared;
    /* OpenBLAS runs its own threads: only for a call that has the pool's */
    if (!prepared && shared && try_blas(cb, p, j.M, j.N, j.K))
        return LOOM_OK;
    j.bias = p->bias ? (const float *)cpu_row(p->bias, data(p->bias), 0) : NULL;
    int nth = shared ? pool_size(cb->pool) : 1;
    j.split_m = j.N < (int64_t)nth * CHUNK_ROWS && j.M >= (int64_t)nth * KERN_MR;
    /* Tiles span several weight rows only when those rows are evenly spaced. Quantised weights
     * in the file's layout at decode sizes once went a row at a time (memory streamed one row
     * better than four, before weights sat in huge pages); four rows now keep four accumulator
     * chains going: 1B Q4_0 decode +50% on cpu-baseline, +63-73% on the SIMD variants' file
     * layout (Intel Xeon, AMX, 2 vCPU). */
    int uniform_w = p->w->ne[2] * p->w->ne[3] == 1 ||
        (p->w->nb[2] == p->w->nb[1] * (uint64_t)p->w->ne[1] &&
         p->w->nb[3] == p->w->nb[2] * (uint64_t)p->w->ne[2]);
    /* unpacked rows sit in cache, where several at a time only help */
    j.unpacked = !prepared && kern_kq_handles(p->w->dtype);
    j.direct = !j.split_m && kern_kq_direct_has(p->w->dtype);
    j.vnni = HAS_VNNI(cb);
    /* the direct kernels take the rows of a call one after another, as memory likes */
    j.nr_max = uniform_w || (j.unpacked && !j.direct) ? KERN_NR : 1;

    void *scratch = NULL;
    loom_dtype wt = p->w->dtype;
    pool_fn body = mm_rows;
    if ((prepared && interleaves_blocks(wt)) || j.unpacked) { /* X as act_blocks */
#if KERN_RI
        if (prepared)
            j.kri = wt == LOOM_Q4_0                  ? VNNI_OR(cb, kern_q4_0_ri)
                : wt == LOOM_Q4_1                    ? VNNI_OR(cb, kern_q4_1_ri)
                : wt == LOOM_IQ4_NL                  ? VNNI_OR(cb, kern_iq4_nl_ri)
                : wt == LOOM_Q5_0                    ? VNNI_OR(cb, kern_q5_0_ri)
                : wt == LOOM_Q5_1                    ? VNNI_OR(cb, kern_q5_1_ri)
                : prepared == CPU_LAYOUT_ROWS_BIASED ? kern_q8_0_ri_vnni
                                                     : kern_q8_0_ri;
#endif
        j.kq_min = kern_kq_has_min(wt);
        size_t bytes = j.direct ? (size_t)(j.M * (j.K / LOOM_QK_K)) * sizeof(act_k)
                                : (size_t)(j.M * (j.K / LOOM_QK)) * sizeof(act_block);
        if (xq && !j.direct)
            j.blocks = (act_block *)xq;
        else
            scratch = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
        if (j.direct)
            j.kblocks = scratch;
        else if (!xq)
            j.blocks = scratch;
    } else if (prepared == CPU_LAYOUT_BF16_PAIRS && !bf16_pairs_widened(cb, j.M)) {
        /* X rounded to BF16 pairs once */
        size_t np = (size_t)(j.K + 1) / 2, rows = (size_t)j.M * sizeof(uint32_t *);
        scratch = aligned_alloc(64, (rows + (size_t)j.M * np * 4 + 63) & ~(size_t)63);
        j.xpairs = scratch;
        for (int64_t m = 0; scratch && m < j.M; m++)
            j.xpairs[m] = (uint32_t *)((unsigned char *)scratch + rows) + (size_t)m * np;
    } else if (loom_dtype_is_block(wt)) {
        j.kq = wt == LOOM_Q8_0 ? VNNI_OR(cb, kern_q8_0)
            : wt == LOOM_Q4_0  ? VNNI_OR(cb, kern_q4_0)
                               : VNNI_OR(cb, kern_q4_1);
        j.layout = kern_layout_for(wt, HAS_VNNI(cb));
        j.act.nb = j.K / LOOM_QK;
        j.act.groups = (j.act.nb + KERN_G - 1) / KERN_G;
        size_t bytes = (size_t)(j.M * j.act.groups) * sizeof(act_group);
        scratch = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
        j.groups = scratch;
        j.act.g = j.groups;
    } else {
        scratch = malloc((size_t)j.M * sizeof(float *));
        if (scratch) {
            j.kf = kern_float;
            j.xrows = scratch;
            for (int64_t m = 0; m < j.M; m++)
                j.xrows[m] = (const float *)cpu_row(p->x, data(p->x), m);
        }
#if KERN_RI
#if defined(LOOM_CPU_VARIANT_AVX512)
        if (prepared == CPU_LAYOUT_BF16_PAIRS) /* prefill: f32 tiles over widened blocks */
            j.kwiden = kern_bf16_pairs_widen;
        else
#endif
            if (prepared) { /* F16 or BF16 rows */
            j.kfri = wt == LOOM_F16 ? kern_f16_ri : kern_bf16_ri;
            j.kfrin = wt == LOOM_F16 ? kern_f16_ri_n : kern_bf16_ri_n;
#ifdef KERN_WIDEN_MR
            j.kwiden = wt == LOOM_F16 ? kern_f16_ri_widen : kern_bf16_ri_widen;
#endif
        }
#endif
    }
#if KERN_RI
    if (prepared) { /* groups of interleaved rows are the unit of work */
        j.group_bytes = group_bytes(wt, (cpu_layout)prepared, j.K);
        j.split_m = j.N / KERN_RI < nth && j.M >= (int64_t)nth * KERN_MR;
        body = mm_groups;
    }
#endif
    if (xq && !j.blocks) {
        free(scratch);
        return cpu_fail(cb, LOOM_ERR_INVALID,
                        "matmul: X given as blocks for a %s W that takes "
                        "none (cpu_matmul_takes_blocks)",
                        loom_dtype_name(wt));
    }
    if (!scratch && !xq)
        return cpu_fail(cb, LOOM_ERR_OUT_OF_MEMORY, "matmul: no memory for X's rows (M = %lld)",
                        (long long)j.M);
    if (j.unpacked && !j.direct) {
        j.kq_thread_bytes = CHUNK_ROWS * (size_t)(j.K / LOOM_QK) *
            (sizeof(kq_chunk) + 2 * sizeof(float));
        j.kq_space = aligned_alloc(64, ((size_t)nth * j.kq_thread_bytes + 63) & ~(size_t)63);
        if (!j.kq_space) {
            free(scratch);
            return cpu_fail(cb, LOOM_ERR_OUT_OF_MEMORY,
                            "matmul: no memory to unpack %s rows "
                            "of %lld",
                            loom_dtype_name(wt), (long long)j.K);
        }
    }
    if (!j.kf && !xq) { /* quantise X, or round it to BF16 */
        if (shared && j.M * j.K >= 16384)
            pool_run(cb->pool, prepare_x, &j);
        else
            prepare_x(&j, 0, 1);
    }
    if (shared && j.M * j.N * j.K >= 65536)
        pool_run(cb->pool, body, &j);
    else
        body(&j, 0, 1);
    free(scratch);
    free(j.kq_space);
    return LOOM_OK;
}

loom_status cpu_matmul(loom_backend *be, const loom_matmul_params *p)
{
    return matmul_run((cpu_backend *)be, p, 1, NULL);
}

loom_status cpu_matmul_alone(cpu_backend *cb, const loom_matmul_params *p, const void *xq)
{
    return matmul_run(cb, p, 0, xq);
}

int cpu_matmul_takes_blocks(const loom_tensor *w)
{
    return KERN_RI && w->buf && w->buf->prepared && interleaves_blocks(w->dtype);
}

/* ---- prepare_weight --------------------------------------------------------------------- */

int cpu_prepared_expert(const loom_tensor *w, int64_t e, struct loom_buffer *view)
{
#if KERN_RI
    const struct loom_buffer *b = w->buf;
    int64_t E = w->ne[2], N = w->ne[1], K = w->ne[0];
    if (!b || !b->prepared || w->offset != 0 || w->dtype != b->prepared_type ||
        K != b->prepared_k || N * E != b->prepared_n || w->ne[3] != 1 || e < 0 || e >= E)
        return -1;
    uint64_t bytes = (uint64_t)(N / KERN_RI) * group_bytes(w->dtype, (cpu_layout)b->prepared, K);
    *view = *b;
    view->data = b->data + (uint64_t)e * bytes;
    view->size = bytes;
    view->wrapped = 1; /* never freed: the stack's buffer owns it */
    view->chunk = NULL;
    view->prepared_n = N;
    return 0;
#else
    (void)w, (void)e, (void)view;
    return -1;
#endif
}

#if KERN_RI
typedef struct repack_job {
    const loom_tensor *w;
    cpu_layout layout;
    unsigned char *dst;
    uint64_t group_bytes;
} repack_job;

/* F16/BF16: column k of the group is element k of each of its rows; in BF16 pairs, lane r of
 * pair j holds row r's elements 2j and 2j + 1 (zero past K) */
static void repack_half(const repack_job *j, long g)
{
    int64_t K = j->w->ne[0];
    uint16_t *dst = (uint16_t *)(void *)(j->dst + (uint64_t)g * j->group_bytes);
    const uint16_t *rows[KERN_RI];
    for (int r = 0; r < KERN_RI; r++)
        rows[r] = (const uint16_t *)(const void *)cpu_row(j->w, data(j->w), g * KERN_RI + r);
    if (j->layout == CPU_LAYOUT_BF16_PAIRS) {
        for (int64_t k = 0; k < K; k += 2)
            for (int r = 0; r < KERN_RI; r++) {
                *dst++ = rows[r][k];
                *dst++ = k + 1 < K ? rows[r][k + 1] : 0;
            }
        return;
    }
    for (int64_t k = 0; k < K; k++)
        for (int r = 0; r < KERN_RI; r++)
            *dst++ = rows[r][k];
}

/* Q5_0/Q5_1's fifth bits as their records hold them (kern.h): byte c those of the elements in
 * chunk c's nibbles, 4c..4c+3 then 16+4c..16+4c+3 */
static uint32_t fifth_bits_by_chunk(const uint8_t qh[4])
{
    uint32_t out = 0;
    for (int c = 0; c < 4; c++)
        for (int k = 0; k < 4; k++)
            out |= (uint32_t)loom_q5_high(qh, 4 * c + k) << (8 * c + k) |
                (uint32_t)loom_q5_high(qh, 16 + 4 * c + k) << (8 * c + 4 + k);
    return out;
}

/* Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 and IQ4_NL (kern.h's records): a block is `scales` f16 values
 * (d, and Q4_1's or Q5_1's m), Q5's 4 bytes of fifth bits when `fifth`, then its quants, which
 * go into the record 4 bytes (a chunk) at a time, so every block type of that shape shares
 * this. */
static void repack_blocks(const repack_job *j, long g, int scales, int fifth, int chunks)
{
    int64_t nb = j->w->ne[0] / LOOM_QK;
    size_t block_bytes = 2 * (size_t)scales + 4 * (size_t)fifth + 4 * (size_t)chunks;
    size_t scale_bytes = 2 * KERN_RI * 2 * (size_t)scales; /* a record's scales, both blocks */
    size_t fifth_bytes = 2 * KERN_RI * 4 * (size_t)fifth;
    size_t record_bytes = scale_bytes + fifth_bytes + 2 * (size_t)chunks * KERN_RI * 4;
    unsigned char *rec = j->dst + (uint64_t)g * j->group_bytes;
    if (nb % 2) /* the unused half of the last record */
        memset(rec + (size_t)(nb / 2) * record_bytes, 0, record_bytes);
    for (int r = 0; r < KERN_RI; r++) {
        const unsigned char *src = cpu_row(j->w, data(j->w), g * KERN_RI + r);
        for (int64_t b = 0; b < nb; b++, src += block_bytes) {
            unsigned char *o = rec + (size_t)(b / 2) * record_bytes;
            int h = (int)(b & 1);
            for (int sc = 0; sc < scales; sc++) /* d[h][r], then m[h][r] */
                memcpy(o + (size_t)((sc * 2 + h) * KERN_RI + r) * 2, src + 2 * sc, 2);
            if (fifth) { /* qh[h][r] */
                uint32_t bits = fifth_bits_by_chunk(src + 2 * scales);
                memcpy(o + scale_bytes + (size_t)(h * KERN_RI + r) * 4, &bits, 4);
            }
            unsigned char *q = o + scale_bytes + fifth_bytes + (size_t)h * chunks * KERN_RI * 4;
            const unsigned char *qs = src + 2 * scales + 4 * fifth;
            for (int c = 0; c < chunks; c++) /* q[h][c][r] */
                memcpy(q + ((size_t)c * KERN_RI + r) * 4, qs + 4 * c, 4);
            /* VNNI's Q8_0: int8 q + 128 as uint8 is q with its sign bit flipped */
            if (j->layout == CPU_LAYOUT_ROWS_BIASED)
                for (int c = 0; c < chunks; c++)
                    for (int k = 0; k < 4; k++)
                        q[((size_t)c * KERN_RI + r) * 4 + (size_t)k] ^= 0x80;
        }
    }
}

_Static_assert(sizeof(q4_0_ri_record) == 2 * (2 * KERN_RI + 4 * KERN_RI * 4) &&
                   sizeof(q4_1_ri_record) == 2 * (4 * KERN_RI + 4 * KERN_RI * 4) &&
                   sizeof(q8_0_ri_record) == 2 * (2 * KERN_RI + 8 * KERN_RI * 4) &&
                   sizeof(q5_0_ri_record) == 2 * (2 * KERN_RI + 4 * KERN_RI + 4 * KERN_RI * 4) &&
                   sizeof(q5_1_ri_record) == 2 * (4 * KERN_RI + 4 * KERN_RI + 4 * KERN_RI * 4),
               "repack_blocks writes the records as kern.h declares them");

static void repack_groups(void *ctx, int ith, int nth)
{
    repack_job *j = ctx;
    long g0, g1;
    pool_split((long)(loom_tensor_rows(j->w) / KERN_RI), ith, nth, &g0, &g1);
    loom_dtype wt = j->w->dtype;
    for (long g = g0; g < g1; g++)
        if (interleaves_blocks(wt))
            repack_blocks(j, g, wt == LOOM_Q4_1 || wt == LOOM_Q5_1 ? 2 : 1,
                          wt == LOOM_Q5_0 || wt == LOOM_Q5_1, wt == LOOM_Q8_0 ? 8 : 4);
        else
            repack_half(j, g);
}

/* A prepared copy is anonymous memory, which the kernel cannot drop and read back from the file
 * as it can the mapping's pages: a model larger than memory still runs from its mapping, but
 * would be killed once its prepared copies filled memory. So copies stop short of the memory
 * the kernel reports available, less a margin for the rest of the process. */
#define PREPARE_MARGIN ((uint64_t)512 << 20)

static uint64_t memory_available(void)
{
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    unsigned long long kb = 0;
    int found = 0;
    while (f && !found && fgets(line, sizeof line, f))
        found = sscanf(line, "MemAvailable: %llu kB", &kb) == 1;
    if (f)
        fclose(f);
    return found ? (uint64_t)kb * 1024 : UINT64_MAX; /* unknown: no limit */
}
#endif

loom_status cpu_prepare_weight(loom_backend *be, const loom_tensor *w, loom_tensor *out)
{
    cpu_backend *cb = (cpu_backend *)be;
    if (!w || !out)
        return cpu_fail(cb, LOOM_ERR_INVALID, "prepare_weight: NULL tensor");
    loom_status st = cpu_check_bounds(cb, w, "prepare_weight w");
    if (st)
        return st;
#if KERN_RI
    int64_t N = loom_tensor_rows(w), K = w->ne[0];
    int interleaves = interleaves_blocks(w->dtype) || w->dtype == LOOM_F16 || w->dtype == LOOM_BF16;
    /* an expert stack (ABI 1.6, for matmul_id) is its experts' rows one after another; each
     * expert's must fill whole groups, so that cpu_prepared_expert finds its own */
    int stack_fits = w->ne[2] * w->ne[3] == 1 || w->ne[1] % KERN_RI == 0;
    if (interleaves && stack_fits && N > 0 && N % KERN_RI == 0 && K > 0) {
        cpu_layout layout = w->dtype == LOOM_Q8_0 && HAS_VNNI(cb) ? CPU_LAYOUT_ROWS_BIASED
                                                                  : CPU_LAYOUT_ROWS;
#if defined(LOOM_CPU_VARIANT_AVX512)
        if (w->dtype == LOOM_BF16 && cb->feat.avx512bf16)
            layout = CPU_LAYOUT_BF16_PAIRS;
#endif
        repack_job j = {w, layout, NULL, group_bytes(w->dtype, layout, K)};
        uint64_t bytes = (uint64_t)(N / KERN_RI) * j.group_bytes, avail = memory_available();
        if (avail != UINT64_MAX && (avail < PREPARE_MARGIN || bytes > avail - PREPARE_MARGIN))
            return cpu_fail(cb, LOOM_ERR_OUT_OF_MEMORY,
                            "prepare_weight: %llu MiB more would "
                            "leave less than %llu MiB of the %llu MiB available",
                            (unsigned long long)(bytes >> 20),
                            (unsigned long long)(PREPARE_MARGIN >> 20),
                            (unsigned long long)(avail >> 20));
        loom_buffer *buf;
        /* thread-local pages under LOOM_NUMA=local: repack_groups splits the groups as the
         * matmul kernels do, so each thread first touches the rows it will read */
        if ((st = cpu_alloc_weight(cb, bytes, 1, &buf)))
            return st;
        j.dst = buf->data;
        pool_run(cb->pool, repack_groups, &j);
        buf->prepared = (int)layout;
        buf->prepared_type = w->dtype;
        buf->prepared_n = N;
        buf->prepared_k = K;
        *out = *w;
        out->buf = buf;
        out->offset = 0;
        out->nb[1] = (uint64_t)loom_row_bytes(w->dtype, K);
        out->nb[2] = out->nb[1] * (uint64_t)w->ne[1];
        out->nb[3] = out->nb[2] * (uint64_t)w->ne[2];
        return LOOM_OK;
    }
#endif
    return cpu_fail(cb, LOOM_ERR_UNSUPPORTED,
                    "prepare_weight: the %s variant keeps %s [%lld, "
                    "%lld] weights as they are",
                    loom_cpu_variant.name, loom_dtype_name(w->dtype),
                    (long long)loom_tensor_rows(w), (long long)w->ne[0]);
}
