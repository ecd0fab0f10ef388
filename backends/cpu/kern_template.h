/*
 * backends/cpu/kern_template.h - the matmul kernels as a template, compiled once per ISA
 * (interface in kern.h): included by kern.c, and also by kern_vnni.c with KERN_VNNI defined:
 * with -mavx512vnni in the avx512 variant, with -mavxvnni in the avx2 one. So one source becomes
 * the baseline, AVX2, AVX2 with AVX-VNNI, AVX-512 and AVX-512 VNNI kernels.
 *
 * Quantised weights meet activations quantised once per matmul to int8 blocks (act_group):
 * each block's dot product is an integer sum, scaled once by the product of the two scales.
 *   Q4_0: x = (q - 8) d. The nibbles q (0..15) are the unsigned operand of the u8 x s8 dot
 *         product; the -8 is folded in by starting each lane's sum at -8 x (sum of its 4 x).
 *   Q4_1: x = q d + m. Unsigned nibbles again; m contributes m x d_x x sum(x), one FMA per
 *         block, spread over the lanes (msum) so it joins the same accumulator.
 *   Q8_0: signed x signed. With VNNI the activations are stored biased (x + 128, unsigned) and
 *         each lane starts at -128 x (sum of its 4 weights), computed once per weight block;
 *         without VNNI the sign of w moves onto x and |w| becomes the unsigned operand.
 * Tiles of KERN_NR weight rows x KERN_MR activation rows are instantiated for every size up to
 * those, so the accumulators live in registers.
 */
#include "kern.h"
#include "rows.h"

#include <loom/quants.h>

#include <math.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#elif defined(KERN_SSE2)
#include <emmintrin.h>
#endif

#ifdef KERN_VNNI
#define KERN(name) name##_vnni
#else
#define KERN(name) name
#endif

INLINE float f16(uint16_t h)
{
    return CPU_F16(h);
}

/* ---- Activation preparation (not part of the VNNI build: its layout is the same) ------------ */

#ifndef KERN_VNNI
kern_layout kern_layout_for(loom_dtype wt, int vnni)
{
    if (wt == LOOM_Q8_0)
        return vnni ? KERN_NATURAL_BIASED : KERN_NATURAL;
    return KERN_G == 2 ? KERN_NIBBLE_PAIRS : KERN_NATURAL;
}

#if defined(__AVX512F__)
/* One block of 32 floats -> 32 int8 in two halves of 16 (as int32 lanes before narrowing),
 * rounding half away from zero exactly as the scalar code does; returns the scale. */
INLINE float quantize_block512(const float *xb, __m512i *i0, __m512i *i1)
{
    const __m512 sign = _mm512_set1_ps(-0.0f), half = _mm512_set1_ps(0.5f);
    __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    float amax = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
    float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    __m512 v0 = _mm512_mul_ps(x0, _mm512_set1_ps(id)), v1 = _mm512_mul_ps(x1, _mm512_set1_ps(id));
    *i0 = _mm512_cvttps_epi32(_mm512_add_ps(v0, _mm512_or_ps(_mm512_and_ps(v0, sign), half)));
    *i1 = _mm512_cvttps_epi32(_mm512_add_ps(v1, _mm512_or_ps(_mm512_and_ps(v1, sign), half)));
    return d;
}

/* A full group of two blocks, vectorised (the scalar loop below is the definition). */
INLINE void prep_pair512(const float *x, act_group *gr, kern_layout layout)
{
    __m512i a0, a1, b0, b1;
    float da = quantize_block512(x, &a0, &a1), db = quantize_block512(x + 32, &b0, &b1);
    int ta = _mm512_reduce_add_epi32(_mm512_add_epi32(a0, a1));
    int tb = _mm512_reduce_add_epi32(_mm512_add_epi32(b0, b1));
    __m128i A0 = _mm512_cvtepi32_epi8(a0), A1 = _mm512_cvtepi32_epi8(a1);
    __m128i B0 = _mm512_cvtepi32_epi8(b0), B1 = _mm512_cvtepi32_epi8(b1);
    int nib = layout == KERN_NIBBLE_PAIRS;
    /* 16-byte chunks in order: natural A0 A1 B0 B1, nibble pairs A0 B0 A1 B1 */
    __m512i q = _mm512_inserti32x4(_mm512_castsi128_si512(A0), nib ? B0 : A1, 1);
    q = _mm512_inserti32x4(q, nib ? A1 : B0, 2);
    q = _mm512_inserti32x4(q, B1, 3);
    /* each lane's sum of its 4 signed quants */
    __m512i lane = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_set1_epi8(1), q),
                                     _mm512_set1_epi16(1));
    _mm512_storeu_si512(gr->neg8sum, _mm512_mullo_epi32(lane, _mm512_set1_epi32(-8)));
    if (layout == KERN_NATURAL_BIASED)
        q = _mm512_xor_si512(q, _mm512_set1_epi8((char)0x80));
    _mm512_storeu_si512(gr->qs, q);
    /* which block each lane's quants come from: natural AAAA AAAA BBBB BBBB (in lanes of 4),
     * nibble pairs AAAA BBBB AAAA BBBB */
    __mmask16 is_b = nib ? (__mmask16)0xf0f0 : (__mmask16)0xff00;
    __m512 d = _mm512_mask_blend_ps(is_b, _mm512_set1_ps(da), _mm512_set1_ps(db));
    __m512 ms = _mm512_mask_blend_ps(is_b, _mm512_set1_ps(da * (float)ta / 8.0f),
                                     _mm512_set1_ps(db * (float)tb / 8.0f));
    _mm512_storeu_ps(gr->d, d);
    _mm512_storeu_ps(gr->msum, ms);
}
#endif

void kern_prep(const float *x, int64_t K, act_group *g, kern_layout layout)
{
    int64_t nb = K / LOOM_QK;
    for (int64_t b0 = 0; b0 < nb; b0 += KERN_G) {
        act_group *gr = &g[b0 / KERN_G];
        int n = nb - b0 < KERN_G ? (int)(nb - b0) : KERN_G; /* blocks in this group */
#if defined(__AVX512F__)
        if (n == 2) {
            prep_pair512(x + b0 * LOOM_QK, gr, layout);
            continue;
        }
#endif
        int8_t q[KERN_G][LOOM_QK];
        float d[KERN_G];
        int total[KERN_G];
        memset(gr, 0, sizeof *gr); /* an absent second block adds nothing */
        for (int h = 0; h < n; h++) {
            const float *xb = x + (b0 + h) * LOOM_QK;
            float amax = 0.0f; /* plain compares: fmaxf and lrintf are library calls here */
            for (int i = 0; i < LOOM_QK; i++) {
                float a = xb[i] < 0 ? -xb[i] : xb[i];
                amax = a > amax ? a : amax;
            }
            d[h] = amax / 127.0f;
            float id = d[h] != 0.0f ? 1.0f / d[h] : 0.0f;
            total[h] = 0;
            for (int i = 0; i < LOOM_QK; i++) {
                float v = xb[i] * id;
                q[h][i] = (int8_t)(int)(v + (v < 0 ? -0.5f : 0.5f));
                total[h] += q[h][i];
            }
        }
        /* place element e of block h; remember which block each position holds */
        int8_t owner[32 * KERN_G];
        for (int h = 0; h < n; h++)
            for (int e = 0; e < LOOM_QK; e++) {
                int pos = 32 * h + e;
                if (layout == KERN_NIBBLE_PAIRS && n == 2)
                    pos = (e < 16 ? 0 : 32) + 16 * h + e % 16;
                gr->qs[pos] = (int8_t)(layout == KERN_NATURAL_BIASED ? (uint8_t)(q[h][e] + 128)
                                                                     : (uint8_t)q[h][e]);
                owner[pos] = (int8_t)h;
#ifdef KERN_SSE2
                gr->qw[e / 16 * 16 + e % 2 * 8 + e % 16 / 2] = q[h][e];
#endif
            }
#ifdef KERN_SSE2
        gr->neg8 = -8 * total[0];
#endif
        for (int l = 0; l < 8 * n; l++) {
            int h = owner[4 * l], lane = 0;
            for (int k = 0; k < 4; k++)
                lane += layout == KERN_NATURAL_BIASED ? (uint8_t)gr->qs[4 * l + k] - 128
                                                      : gr->qs[4 * l + k];
            gr->neg8sum[l] = -8 * lane;
            gr->d[l] = d[h];
            gr->msum[l] = d[h] * (float)total[h] / 8.0f;
        }
    }
}

void kern_prep_blocks(const float *x, int64_t K, act_block *out)
{
    for (int64_t b = 0; b < K / LOOM_QK; b++) {
        const float *xb = x + b * LOOM_QK;
        act_block *o = &out[b];
#if defined(__AVX512F__)
        __m512i q0, q1;
        o->d = quantize_block512(xb, &q0, &q1);
        _mm_storeu_si128((__m128i *)o->qs, _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(o->qs + 16), _mm512_cvtepi32_epi8(q1));
        o->neg8sum = -8 * _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
        float amax = 0.0f; /* as kern_prep: the same rounding, so both paths agree */
        for (int i = 0; i < LOOM_QK; i++) {
            float a = xb[i] < 0 ? -xb[i] : xb[i];
            amax = a > amax ? a : amax;
        }
        o->d = amax / 127.0f;
        float id = o->d != 0.0f ? 1.0f / o->d : 0.0f;
        int total = 0;
        for (int i = 0; i < LOOM_QK; i++) {
            float v = xb[i] * id;
            o->qs[i] = (int8_t)(int)(v + (v < 0 ? -0.5f : 0.5f));
            total += o->qs[i];
        }
        o->neg8sum = -8 * total;
#endif
    }
}
#endif

/* ---- Integer dot products ------------------------------------------------------------------ */

#if defined(__AVX2__)
INLINE float hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 16 bytes of nibbles -> 32 unsigned bytes: low nibbles are elements 0..15, high 16..31 */
INLINE __m256i nibbles256(const uint8_t *qs)
{
    __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0f));
}

/* acc + per 4-byte lane sum of u8 a x s8 b */
INLINE __m256i dot256(__m256i acc, __m256i a, __m256i b)
{
#if defined(KERN_VNNI) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, a, b);
#elif defined(KERN_VNNI)
    return _mm256_dpbusd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc,
                            _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
#endif
}
#endif

#if defined(__AVX512F__)
INLINE __m512i dot512(__m512i acc, __m512i a, __m512i b)
{
#ifdef KERN_VNNI
    return _mm512_dpbusd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc,
                            _mm512_madd_epi16(_mm512_maddubs_epi16(a, b), _mm512_set1_epi16(1)));
#endif
}

INLINE __m512i join256(__m256i lo, __m256i hi)
{
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* two f16 scales, spread over the 16 lanes as the blocks' quants are: natural order
 * [a x 8, b x 8], or nibble-pair order [a x 4, b x 4, a x 4, b x 4] */
INLINE __m512 scales2(uint16_t a, uint16_t b, int nibble_order)
{
    __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128((int)((uint32_t)a | ((uint32_t)b << 16))));
    const __m512i nat = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i nib = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(nibble_order ? nib : nat, _mm512_castps128_ps512(f));
}

/* the nibbles of two Q4 blocks in nibble-pair order: A lo, B lo, A hi, B hi */
INLINE __m512i nibbles_pair(const uint8_t *qa, const uint8_t *qb)
{
    __m256i v = _mm256_loadu2_m128i((const __m128i *)qb, (const __m128i *)qa);
    return _mm512_and_si512(join256(v, _mm256_srli_epi16(v, 4)), _mm512_set1_epi8(0x0f));
}
#endif

#if defined(KERN_SSE2)
/* A block's 32 weights as int16 in qw's order (kern.h): Q4 nibbles, byte j holding elements j
 * and j + 16, or Q8_0 bytes sign-extended by an arithmetic shift from the high half of a word. */
INLINE void widen_q4(const uint8_t *qs, __m128i v[4])
{
    const __m128i low4 = _mm_set1_epi16(0x000f);
    __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    v[0] = _mm_and_si128(raw, low4);
    v[1] = _mm_and_si128(_mm_srli_epi16(raw, 8), low4);
    v[2] = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
    v[3] = _mm_srli_epi16(raw, 12);
}

INLINE void widen_q8(const int8_t *qs, __m128i v[4])
{
    __m128i a = _mm_loadu_si128((const __m128i *)qs),
            b = _mm_loadu_si128((const __m128i *)(qs + 16));
    v[0] = _mm_srai_epi16(_mm_slli_epi16(a, 8), 8);
    v[1] = _mm_srai_epi16(a, 8);
    v[2] = _mm_srai_epi16(_mm_slli_epi16(b, 8), 8);
    v[3] = _mm_srai_epi16(b, 8);
}

/* one block's w . x in four int32 lanes */
INLINE __m128i dot_i16(__m128i acc, const __m128i w[4], const int16_t *x)
{
    const __m128i *xv = (const __m128i *)x;
    __m128i s01 = _mm_add_epi32(_mm_madd_epi16(w[0], _mm_loadu_si128(xv)),
                                _mm_madd_epi16(w[1], _mm_loadu_si128(xv + 1)));
    __m128i s23 = _mm_add_epi32(_mm_madd_epi16(w[2], _mm_loadu_si128(xv + 2)),
                                _mm_madd_epi16(w[3], _mm_loadu_si128(xv + 3)));
    return _mm_add_epi32(_mm_add_epi32(acc, s01), s23);
}

/* The baseline variant's tile for all three block types (wt is a constant at each call, so
 * only one type's code remains): sums[i][r] over blocks b..nb-1. */
INLINE void quant_tile_sse2(loom_dtype wt, const unsigned char *w, size_t wstride, const cpu_act *a,
                            int64_t m0, int64_t b, int64_t nb, float sums[KERN_NR][KERN_MR],
                            const int NR, const int MR)
{
    const size_t bsize = wt == LOOM_Q4_0 ? sizeof(loom_block_q4_0)
        : wt == LOOM_Q4_1                ? sizeof(loom_block_q4_1)
                                         : sizeof(loom_block_q8_0);
    __m128 acc[KERN_NR][KERN_MR];
    UNROLL
    for (int i = 0; i < NR; i++) {
        UNROLL
        for (int r = 0; r < MR; r++)
            acc[i][r] = _mm_setzero_ps();
    }
    for (; b < nb; b++) {
        UNROLL
        for (int i = 0; i < NR; i++) {
            const unsigned char *blk = w + (size_t)i * wstride + (size_t)b * bsize;
            /* the same block of the next tile's rows: the hardware's prefetcher misses
             * four interleaved streams (1B Q4_0 decode 14.5 -> 26 t/s; a fixed distance of
             * 512-16384 bytes gave 18-25) */
            __builtin_prefetch(blk + KERN_NR * wstride);
            __m128i wv[4];
            float wd, wm = 0.0f;
            if (wt == LOOM_Q4_0) {
                widen_q4(((const loom_block_q4_0 *)blk)->qs, wv);
                wd = f16(((const loom_block_q4_0 *)blk)->d);
            } else if (wt == LOOM_Q4_1) {
                widen_q4(((const loom_block_q4_1 *)blk)->qs, wv);
                wd = f16(((const loom_block_q4_1 *)blk)->d);
                wm = f16(((const loom_block_q4_1 *)blk)->m);
            } else {
                widen_q8(((const loom_block_q8_0 *)blk)->qs, wv);
                wd = f16(((const loom_block_q8_0 *)blk)->d);
            }
            UNROLL
            for (int r = 0; r < MR; r++) {
                const act_group *g = a->g + (m0 + r) * a->groups + b;
                __m128i start = wt == LOOM_Q4_0 ? _mm_cvtsi32_si128(g->neg8) : _mm_setzero_si128();
                __m128 t = _mm_mul_ps(_mm_cvtepi32_ps(dot_i16(start, wv, g->qw)),
                                      _mm_set1_ps(wd * g->d[0]));
                if (wt == LOOM_Q4_1) /* m x d_x x (sum of x), a quarter in each lane */
                    t = _mm_add_ps(t, _mm_set1_ps(wm * g->msum[0] * 2.0f));
                acc[i][r] = _mm_add_ps(acc[i][r], t);
            }
        }
    }
    UNROLL
    for (int i = 0; i < NR; i++) {
        UNROLL
        for (int r = 0; r < MR; r++)
            sums[i][r] = hsum128(acc[i][r]);
    }
}
#endif

/* One tile for one block type. W_T: the block struct; the body macros differ by type. */
#define BLK(T, w, i, b) ((const T *)((w) + (size_t)(i)*wstride) + (b))

/* Each tile function below: sums[i][r] over all blocks, then the same scalar tail. */

/* ---- Q4_0 ---------------------------------------------------------------------------------- */

INLINE void q4_0_tile(const unsigned char *w, size_t wstride, const cpu_act *a, int64_t m0,
                      float *out, const int NR, const int MR)
{
    const int64_t nb = a->nb;
    float sums[KERN_NR][KERN_MR] = {{0}};
    int64_t b = 0;
#if defined(__AVX512F__)
    __m512 acc[KERN_NR][KERN_MR];
    UNROLL
    for (int i = 0; i < NR; i++) {
        UNROLL
        for (int r = 0; r < MR; r++)
            acc[i][r] = _mm512_setzero_ps();
    }
    for (; b + 2 <= nb; b += 2) {
        __m512i wv[KERN_NR];
        __m512 wd[KERN_NR];
        UNROLL
        for (int i = 0; i < NR; i++) {
            const loom_block_q4_0 *blk = BLK(loom_block_q4_0, w, i, b);
            wv[i] = nibbles_pair(blk[0].qs, blk[1].qs);
            wd[i] = scales2(blk[0].d, blk[1].d, 1);
        }
        UNROLL
        for (int r = 0; r < MR; r++) {
            const act_group *g = a->g + (m0 + r) * a->groups + b / 2;
            __m512i xq = _mm512_loadu_si512(g->qs);
            __m512i off = _mm512_loadu_si512(g->neg8sum);
            __m512 xd = _mm512_loadu_ps(g->d);
            UNROLL
            for (int i = 0; i < NR; i++)
                acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot512(off, wv[i], xq)),
                                            _mm512_mul_ps(wd[i], xd), acc[i][r]);
        }
    }
    UNROLL
    for (int i = 0; i < NR; i++) {
        UNROLL
        for (int r = 0; r < MR; r++)
            sums[i][r] = _mm512_reduce_add_ps(acc[i][r]);
    }
#endif
#if defined(__AVX2__)
    __m256 acc2[KERN_NR][KERN_MR];
    UNROLL
    for (int i = 0; i < NR; i++) {
        UNROLL
        for (int r = 0; r < MR; r++)
            acc2[i][r] = _mm256_setzero_ps();
    }
    for (; b < nb; b++) { /* every block with AVX2; with AVX-512, only an odd last one */
        UNROLL
        for (int i = 0; i < NR; i++) {
            const loom_block_q4_0 *blk = BLK(loom_block_q4_0, w, i, b);
            __m256i wv = nibbles256(blk->qs);
            __m256 wd = _mm256_set1_ps(f16(blk->d));
            UNROLL
            for (int r = 0; r < MR; r++) {
                const act_group *g = a->g + (m0 + r) * a->groups + b / KERN_G;
                int h = (int)(b % KERN_G);
                __m256i dot = dot256(_mm256_loadu_si256((const __m256i *)(g->neg8sum + 8 * h)), wv,
                                     _mm256_loadu_si256((const __m256i *)(g->qs + 32 * h)));
                acc2[i][r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), wd),
                                             _mm256_loadu_ps(g->d + 8 * h), acc2[i][r]);
            }
        }
    }
    UNROLL
    for (int i = 0; i < NR; i++) {
        UNROLL
        for (int r = 0; r < MR; r++)
            sums[i][r] += hsum256(acc2[i][r]);
    }
#elif defined(KERN_SSE2)
    quant_tile_sse2(LOOM_Q4_0, w, wstride, a, m0, b, nb, sums, NR, MR);
#else
    for (; b < nb; b++) {
        UNROLL
        for (int i = 0; i < NR; i++) {
            const loom_block_q4_0 *blk = BLK(loom_block_q4_0, w, i, b);
            float wd = f16(blk->d);
            UNROLL
            for (int r = 0; r < MR; r++) {
                const act_group *g = a->g + (m0 + r) * a->groups + b;
                int isum = 0;
                for (int j = 0; j < 16; j++)
                    isum += (blk->qs[j] & 0x0f) * g->qs[j] + (blk->qs[j] >> 4) * g->qs[j + 16];
                for (int l = 0; l < 8; l++)
                    isum += g->neg8sum[l];
                sums[i][r] += (float)isum * wd * g->d[0];
            }
        }
    }
#endif
    UNROLL
    for (int i = 0; i < NR; i++) {
        UNROLL
        for (int r = 0; r < MR; r++)
            out[r * KERN_NR + i] = sums[i][r];
    }
}

/* ---- Q4_1 ---------------------------------------------------------------------------------- */

INLINE void q4_1_tile(const unsigned char *w, size_t wstride, const cpu_act *a, int64_t m0,
                      float *out, const int NR, const int MR)
{
    const int64_t nb = a->nb;
    float sums[KERN_NR][KERN_MR] = {{0}};
    int64_t b = 0;
#if defined(__AVX512F__)
    __m512 acc[KERN_NR][KERN_MR];
    UNROLL
    for (int i = 0; i < NR; i++) {
        UNROLL
        for (int r = 0; r < MR; r++)
            acc[i][r] = _mm512_setzero_ps();
    }
    for (; b + 2 <= nb; b += 2) {
        __m512i wv[KERN_NR];
        __m512 wd[KERN_NR], wm[KERN_NR];
        UNROLL
        for (int i = 0; i < NR; i++) {
            const loom_block_q4_1 *blk = BLK(loom_block_q4_1, w, i, b);
            wv[i] = nibbles_pair(blk[0].qs, blk[1].qs);
            wd[i] = scales2(blk[0].d, blk[1].d, 1);
            wm[i] = scales2(blk[0].m, blk[1].m, 1);
        }
        UNROLL
        for (int r = 0; r < MR; r++) {
            const act_group *g = a->g + (m0 + r) * a->groups + b / 2;
            __m512i xq = _mm512_loadu_si512(g->qs);
            __m512 xd = _mm512_loadu_ps(g->d), xm = _mm512_loadu_ps(g->msum);
            UNROLL
            for (int i = 0; i < NR; i++) {
                __m512 t = _mm512_cvtepi32_ps(dot512(_mm512_setzero_si512(), wv[i], xq));
                acc[i][r] = _mm512_fmadd_ps(t, _mm512_mul_ps(wd[i], xd), acc[i][r]);
                acc[i][r] = _mm512_fmadd_ps(wm[i], xm, acc[i][r]);
            }
        }
    }
    UNROLL
    for (int i = 0; i < NR; i++) {
        UNROLL
        for (int r = 0; r < MR; r++)
            sums[i][r] = _mm512_reduce_add_ps(acc[i][r]);
    }
#endif
#if defined(__AVX2__)
    __m256 acc2[KERN_NR][KERN_MR];
    UNROLL
    for (int i = 0; i < NR; i++) {
        UNROLL
        for (int r = 0; r < MR; r++)
            acc2[i][r] = _mm256_setzero_ps();
    }
    for (; b < nb; b++) {
        UNROLL
        for (int i = 0; i < NR; i++) {
            const loom_block_q4_1 *blk = BLK(loom_block_q4_1, w, i, b);
            __m256i wv = nibbles256(blk->qs);
            __m256 wd = _mm256_set1_ps(f16(blk->d)), wm = _mm256_set1_ps(f16(blk->m));
            UNROLL
            for (int r = 0; r < MR; r++) {
                const act_group *g = a->g + (m0 + r) * a->groups + b / KERN_G;
                int h = (int)(b % KERN_G);
                __m256i dot = dot256(_mm256_setzero_si256(), wv,
                                     _mm256_loadu_si256((const __m256i *)(g->qs + 32 * h)));
                __m256 t = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), wd),
                                           _mm256_loadu_ps(g->d + 8 * h), acc2[i][r]);
                acc2[i][r] = _mm256_fmadd_ps(wm, _mm256_loadu_ps(g->msum + 8 * h), t);
            }
        }
    }
    UNROLL
    for (int i = 0; i < NR; i++) {
        UNROLL
        for (int r = 0; r < MR; r++)
            sums[i][r] += hsum256(acc2[i][r]);
    }
#elif defined(KERN_SSE2)
    quant_tile_sse2(LOOM_Q4_1, w, wstride, a, m0, b, nb, sums, NR, MR);
#else
    for (; b < nb; b++) {
        UNROLL
        for (int i = 0; i < NR; i++) {
            const loom_block_q4_1 *blk = BLK(loom_block_q4_1, w, i, b);
            float wd = f16(blk->d), wm = f16(blk->m);
            UNROLL
            for (int r = 0; r < MR; r++) {
                const act_group *g = a->g + (m0 + r) * a->groups + b;
                int isum = 0;
                for (int j = 0; j < 16; j++)
                    isum += (blk->qs[j] & 0x0f) * g->qs[j] + (blk->qs[j] >> 4) * g->qs[j + 16];
                sums[i][r] += (float)isum * wd * g->d[0] + wm * g->msum[0] * 8.0f;
            }
        }
    }
#endif
    UNROLL
    for (int i = 0; i < NR; i++) {
        UNROLL
        for (int r = 0; r < MR; r++)
            out[r * KERN_NR + i] = sums[i][r];
    }
}

/* ---- Q8_0 ---------------------------------------------------------------------------------- */

INLINE void q8_0_tile(const unsigned char *w, size_t wstride, const cpu_act *a, int64_t m0,
                      float *out, const int NR, const int MR)
{
    const int64_t nb = a->nb;
    float sums[KERN_NR][KERN_MR] = {{0}};
    int64_t b = 0;
#if defined(__AVX512F__)
    __m512 acc[KERN_NR][KERN_MR];
    UNROLL
    for (int i = 0; i < NR; i++) {
        UNROLL
        for (int r = 0; r < MR; r++)
            acc[i][r] = _mm512_setzero_ps();
    }
    for (; b + 2 <= nb; b += 2) {
        __m512i wv[KERN_NR], wc[KERN_NR];
        __m512 wd[KERN_NR];
        UNROLL
        for (int i = 0; i < NR; i++) {
            const loom_block_q8_0 *blk = BLK(loom_block_q8_0, w, i, b);
            __m512i raw = join256(_mm256_loadu_si256((const __m256i *)blk[0].qs),
                                  _mm256_loadu_si256((const __m256i *)blk[1].qs));
            wd[i] = scales2(blk[0].d, blk[1].d, 0);
#ifdef KERN_VNNI
            /* x is stored as x + 128: start each lane at -128 x (sum of its 4 weights) */
            wv[i] = raw;
            wc[i] = _mm512_sub_epi32(
                _mm512_setzero_si512(),
                _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)0x80), raw));
#else
            wv[i] = _mm512_abs_epi8(raw);
            wc[i] = raw; /* keeps the signs */
#endif
        }
        UNROLL
        for (int r = 0; r < MR; r++) {
            const act_group *g = a->g + (m0 + r) * a->groups + b / 2;
            __m512i xq = _mm512_loadu_si512(g->qs);
            __m512 xd = _mm512_loadu_ps(g->d);
            UNROLL
            for (int i = 0; i < NR; i++) {
#ifdef KERN_VNNI
                __m512i dot = _mm512_dpbusd_epi32(wc[i], xq, wv[i]);
#else
                __m512i sx = _mm512_mask_sub_epi8(xq, _mm512_movepi8_mask(wc[i]),
                                                  _mm512_setzero_si512(), xq);
                __m512i dot = dot512(_mm512_setzero_si512(), wv[i], sx);
#endif
                acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(wd[i], xd),
                                            acc[i][r]);
            }
        }
    }
    UNROLL
    for (int i = 0; i < NR; i++) {
        UNROLL
        for (int r = 0; r < MR; r++)
            sums[i][r] = _mm512_reduce_add_ps(acc[i][r]);
    }
#endif
#if defined(__AVX2__)
    __m256 acc2[KERN_NR][KERN_MR];
    UNROLL
    for (int i = 0; i < NR; i++) {
        UNROLL
        for (int r = 0; r < MR; r++)
            acc2[i][r] = _mm256_setzero_ps();
    }
    for (; b < nb; b++) {
        UNROLL
        for (int i = 0; i < NR; i++) {
            const loom_block_q8_0 *blk = BLK(loom_block_q8_0, w, i, b);
            __m256i wv = _mm256_loadu_si256((const __m256i *)blk->qs);
            __m256 wd = _mm256_set1_ps(f16(blk->d));
            UNROLL
            for (int r = 0; r < MR; r++) {
                const act_group *g = a->g + (m0 + r) * a->groups + b / KERN_G;
                int h = (int)(b % KERN_G);
                __m256i xq = _mm256_loadu_si256((const __m256i *)(g->qs + 32 * h));
#ifdef KERN_VNNI
                xq = _mm256_xor_si256(xq, _mm256_set1_epi8((char)0x80)); /* un-bias */
#endif
                __m256i dot = dot256(_mm256_setzero_si256(), _mm256_sign_epi8(wv, wv),
                                     _mm256_sign_epi8(xq, wv));
                acc2[i][r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), wd),
                                             _mm256_loadu_ps(g->d + 8 * h), acc2[i][r]);
            }
        }
    }
    UNROLL
    for (int i = 0; i < NR; i++) {
        UNROLL
        for (int r = 0; r < MR; r++)
            sums[i][r] += hsum256(acc2[i][r]);
    }
#elif defined(KERN_SSE2)
    quant_tile_sse2(LOOM_Q8_0, w, wstride, a, m0, b, nb, sums, NR, MR);
#else
    for (; b < nb; b++) {
        UNROLL
        for (int i = 0; i < NR; i++) {
            const loom_block_q8_0 *blk = BLK(loom_block_q8_0, w, i, b);
            float wd = f16(blk->d);
            UNROLL
            for (int r = 0; r < MR; r++) {
                const act_group *g = a->g + (m0 + r) * a->groups + b;
                int isum = 0;
                for (int j = 0; j < 32; j++)
                    isum += blk->qs[j] * g->qs[j];
                sums[i][r] += (float)isum * wd * g->d[0];
            }
        }
    }
#endif
    UNROLL
    for (int i = 0; i < NR; i++) {
        UNROLL
        for (int r = 0; r < MR; r++)
            out[r * KERN_NR + i] = sums[i][r];
    }
}

/* ---- Float weights ------------------------------------------------------------------------- */

#ifndef KERN_VNNI
#if defined(__AVX512F__)
INLINE __m512 load_w16(loom_dtype wt, const unsigned char *p, int64_t k)
{
    if (wt == LOOM_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + k)));
    if (wt == LOOM_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + k))),
            16));
    return _mm512_loadu_ps((const float *)p + k);
}
#elif defined(__AVX2__)
INLINE __m256 load_w8(loom_dtype wt, const unsigned char *p, int64_t k)
{
    if (wt == LOOM_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + k)));
    if (wt == LOOM_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + k))),
            16));
    return _mm256_loadu_ps((const float *)p + k);
}
#endif

INLINE float w_at(loom_dtype wt, const unsigned char *p, int64_t k)
{
    return wt == LOOM_F16 ? f16(((const uint16_t *)p)[k])
        : wt == LOOM_BF16 ? loom_bf16_to_f32(((const uint16_t *)p)[k])
                          : ((const float *)p)[k];
}

INLINE void float_tile(loom_dtype wt, const unsigned char *w, size_t wstride, const float *const *x,
                       int64_t K, float *out, const int NR, const int MR)
{
    float sums[KERN_NR][KERN_MR] = {{0}};
    int64_t k = 0;
#if defined(__AVX512F__)
    __m512 acc[KERN_NR][KERN_MR];
    UNROLL
    for (int i = 0; i < NR; i++) {
        UNROLL
        for (int r = 0; r < MR; r++)
            acc[i][r] = _mm512_setzero_ps();
    }
    for (; k + 16 <= K; k += 16) {
        __m512 wv[KERN_NR];
        UNROLL
        for (int i = 0; i < NR; i++)
            wv[i] = load_w16(wt, w + (size_t)i * wstride, k);
        UNROLL
        for (int r = 0; r < MR; r++) {
            __m512 xv = _mm512_loadu_ps(x[r] + k);
            UNROLL
            for (int i = 0; i < NR; i++)
                acc[i][r] = _mm512_fmadd_ps(wv[i], xv, acc[i][r]);
        }
    }
    UNROLL
    for (int i = 0; i < NR; i++) {
        UNROLL
        for (int r = 0; r < MR; r++)
            sums[i][r] = _mm512_reduce_add_ps(acc[i][r]);
    }
#elif defined(__AVX2__)
    __m256 acc[KERN_NR][KERN_MR];
    UNROLL
    for (int i = 0; i < NR; i++) {
        UNROLL
        for (int r = 0; r < MR; r++)
            acc[i][r] = _mm256_setzero_ps();
    }
    for (; k + 8 <= K; k += 8) {
        __m256 wv[KERN_NR];
        UNROLL
        for (int i = 0; i < NR; i++)
            wv[i] = load_w8(wt, w + (size_t)i * wstride, k);
        UNROLL
        for (int r = 0; r < MR; r++) {
            __m256 xv = _mm256_loadu_ps(x[r] + k);
            UNROLL
            for (int i = 0; i < NR; i++)
                acc[i][r] = _mm256_fmadd_ps(wv[i], xv, acc[i][r]);
        }
    }
    UNROLL
    for (int i = 0; i < NR; i++) {
        UNROLL
        for (int r = 0; r < MR; r++)
            sums[i][r] = hsum256(acc[i][r]);
    }
#else
    /* no SIMD of our own: convert a stretch of each weight row, then the compiler's vectorised
     * four-way dot product */
    float wbuf[256];
    size_t es = wt == LOOM_F32 ? 4 : 2;
    for (; k < K; k += 256) {
        int64_t len = K - k < 256 ? K - k : 256;
        UNROLL
        for (int i = 0; i < NR; i++) {
            cpu_load_row(wt, w + (size_t)i * wstride + (size_t)k * es, wbuf, len);
            UNROLL
            for (int r = 0; r < MR; r++)
                sums[i][r] += cpu_dot(wbuf, x[r] + k, len);
        }
    }
#endif
    for (; k < K; k++) {
        UNROLL
        for (int i = 0; i < NR; i++) {
            float wv = w_at(wt, w + (size_t)i * wstride, k);
            UNROLL
            for (int r = 0; r < MR; r++)
                sums[i][r] += wv * x[r][k];
        }
    }
    UNROLL
    for (int i = 0; i < NR; i++) {
        UNROLL
        for (int r = 0; r < MR; r++)
            out[r * KERN_NR + i] = sums[i][r];
    }
}
#endif

/* ---- Q4_0, interleaved rows (layout in kern.h) ---------------------------------------------- */

#if KERN_RI
INLINE int32_t load4(const void *p)
{
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

#if defined(__AVX512F__)
typedef __m512i vint;
typedef __m512 vflt;
#define V_ZERO_I() _mm512_setzero_si512()
#define V_ZERO_F() _mm512_setzero_ps()
#define V_LOAD_I(p) _mm512_loadu_si512(p)
#define V_NIB_LO(v) _mm512_and_si512((v), _mm512_set1_epi8(0x0f))
#define V_NIB_HI(v) _mm512_and_si512(_mm512_srli_epi16((v), 4), _mm512_set1_epi8(0x0f))
#define V_BCAST4(p) _mm512_set1_epi32(load4(p))
#define V_DOT(acc, u, s) dot512((acc), (u), (s))
#define V_ADD_I(a, b) _mm512_add_epi32((a), (b))
#define V_SET1_I(x) _mm512_set1_epi32(x)
#define V_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(p)))
#define V_CVT(v) _mm512_cvtepi32_ps(v)
#define V_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define V_MUL(a, b) _mm512_mul_ps((a), (b))
#define V_SET1_F(x) _mm512_set1_ps(x)
#define V_STORE_F(p, v) _mm512_storeu_ps((p), (v))
#define V_LOAD_W(wt, p) load_w16((wt), (p), 0)
#define V_ADD_F(a, b) _mm512_add_ps((a), (b))
#define V_LOAD_F(p) _mm512_loadu_ps(p)
#define V_AND_I(a, b) _mm512_and_si512((a), (b))
#define V_SRAI(v, n) _mm512_srai_epi32((v), (n))
#define V_MADDUBS(u, s) _mm512_maddubs_epi16((u), (s))
#define V_ADD16(a, b) _mm512_add_epi16((a), (b))
#define V_PAIRS32(v) _mm512_madd_epi16((v), _mm512_set1_epi16(1))
#else
typedef __m256i vint;
typedef __m256 vflt;
#define V_ZERO_I() _mm256_setzero_si256()
#define V_ZERO_F() _mm256_setzero_ps()
#define V_LOAD_I(p) _mm256_loadu_si256((const __m256i *)(const void *)(p))
#define V_NIB_LO(v) _mm256_and_si256((v), _mm256_set1_epi8(0x0f))
#define V_NIB_HI(v) _mm256_and_si256(_mm256_srli_epi16((v), 4), _mm256_set1_epi8(0x0f))
#define V_BCAST4(p) _mm256_set1_epi32(load4(p))
#define V_DOT(acc, u, s) dot256((acc), (u), (s))
#define V_ADD_I(a, b) _mm256_add_epi32((a), (b))
#define V_SET1_I(x) _mm256_set1_epi32(x)
#define V_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p)))
#define V_CVT(v) _mm256_cvtepi32_ps(v)
#define V_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define V_MUL(a, b) _mm256_mul_ps((a), (b))
#define V_SET1_F(x) _mm256_set1_ps(x)
#define V_STORE_F(p, v) _mm256_storeu_ps((p), (v))
#define V_LOAD_W(wt, p) load_w8((wt), (p), 0)
#define V_ADD_F(a, b) _mm256_add_ps((a), (b))
#define V_LOAD_F(p) _mm256_loadu_ps(p)
#define V_AND_I(a, b) _mm256_and_si256((a), (b))
#define V_SRAI(v, n) _mm256_srai_epi32((v), (n))
#define V_MADDUBS(u, s) _mm256_maddubs_epi16((u), (s))
#define V_ADD16(a, b) _mm256_add_epi16((a), (b))
#define V_PAIRS32(v) _mm256_madd_epi16((v), _mm256_set1_epi16(1))
#endif

/* How far ahead of the block being summed the group's bytes are asked for. A decode matmul
 * streams each weight once, and the kernel is quick enough that waiting on memory is what is
 * left: without it a thread's one sequential stream reached 68% of the machine's read
 * bandwidth, with 8192 bytes 79% (Q4_0 4096 x 4096 from DRAM, 2 threads, avx512, AMD EPYC).
 * On an Intel Xeon (Sapphire Rapids class, 2 vCPU) 8192 was far too far: 1B Q8_0 decode at 50%
 * of the read roofline, at 1536 bytes 88-95% (Q4_0 51% -> 70-81%); 4096 and above lost. There
 * the avx2 block kernels do best at 1024 (Q4_0 without VNNI 55-58% of the roofline at 1536,
 * 79-89% at 1024, the others the same), avx512 and the F16/BF16 columns at 1536 (avx2 F16
 * decode 12.8-12.9 t/s at 1024, 13.3-13.4 at 1536); docs/benchmarks.md. */
#ifndef RI_PREFETCH
#if defined(__AVX512F__)
#define RI_PREFETCH 1536
#else
#define RI_PREFETCH 1024
#endif
#endif
#ifndef RI_PREFETCH_HALF
#define RI_PREFETCH_HALF 1536
#endif

/* one instantiation of an interleaved tile per count of activation rows */
#define RI_MR_CASES(tile)                                                                          \
    switch (mr) {                                                                                  \
    case 1: tile(w, nb, a, out, 1); break;                                                         \
    case 2: tile(w, nb, a, out, 2); break;                                                         \
    case 3: tile(w, nb, a, out, 3); break;                                                         \
    default: tile(w, nb, a, out, 4); break;                                                        \
    }

/* Q4_0, Q4_1 (HAS_MIN), Q5_0 (FIVE) and Q5_1 (both) records (kern.h): the scales, the
 * minimums, the fifth bits, then the nibbles */
#if defined(__AVX512F__)
/* 16 in each byte of v that has its bit of pattern set: a fifth bit, as a value to add */
#define V_FIFTH(v, pattern)                                                                        \
    _mm512_maskz_mov_epi8(_mm512_test_epi8_mask((v), (pattern)), _mm512_set1_epi8(16))
#define V_OR_I(a, b) _mm512_or_si512((a), (b))
#define V_SHUF8(v, idx) _mm512_shuffle_epi8((v), (idx))
#define V_LANE_BYTE(c)                                                                             \
    _mm512_add_epi8(_mm512_set4_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0), _mm512_set1_epi8(c))
#else
#define V_FIFTH(v, pattern)                                                                        \
    _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256((v), (pattern)), (pattern)),               \
                     _mm256_set1_epi8(16))
#define V_OR_I(a, b) _mm256_or_si256((a), (b))
#define V_SHUF8(v, idx) _mm256_shuffle_epi8((v), (idx))
#define V_LANE_BYTE(c)                                                                             \
    _mm256_add_epi8(_mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c, 0, 0x04040404,        \
                                      0x08080808, 0x0c0c0c0c),                                     \
                    _mm256_set1_epi8(c))
#endif

INLINE void q4_ri_tile(const unsigned char *w, int64_t nb, const act_block *a, float *out,
                       const int MR, const int HAS_MIN, const int FIVE)
{
    const size_t record = FIVE ? (HAS_MIN ? sizeof(q5_1_ri_record) : sizeof(q5_0_ri_record))
                               : (HAS_MIN ? sizeof(q4_1_ri_record) : sizeof(q4_0_ri_record));
    const size_t qh_at = HAS_MIN ? offsetof(q5_1_ri_record, qh) : offsetof(q5_0_ri_record, qh);
    const size_t q_at = FIVE
        ? (HAS_MIN ? offsetof(q5_1_ri_record, q) : offsetof(q5_0_ri_record, q))
        : (HAS_MIN ? offsetof(q4_1_ri_record, q) : offsetof(q4_0_ri_record, q));
    /* Q4_0's -8 and Q5_0's -16 as lanes' starting sums: -8 (-16) x the sum of their 4 x */
    const int offset_times = FIVE ? 2 : 1;
#if defined(KERN_VNNI) && !defined(__AVX512F__)
    /* a fifth bit would carry the byte past 255; the avx512 kernel measured slower with it
     * (1B Q4_0 decode 44 -> 41 t/s, Intel Xeon) where the avx2 one gained (34-37 -> 42) */
    const int HI_IN_PLACE = !FIVE;
#else
    const int HI_IN_PLACE = 0;
#endif
    vflt acc[KERN_MR];
    UNROLL
    for (int r = 0; r < MR; r++)
        acc[r] = V_ZERO_F();
    for (int64_t b = 0; b < nb; b++) {
        const unsigned char *o = w + (size_t)(b / 2) * record;
        int h = (int)(b & 1);
        if (!h)
            for (size_t l = 0; l < record; l += 64)
                __builtin_prefetch(o + RI_PREFETCH + l);
        const unsigned char *q = o + q_at + (size_t)h * 4 * KERN_RI * 4;
        vint qh = FIVE ? V_LOAD_I(o + qh_at + (size_t)h * KERN_RI * 4) : V_ZERO_I();
        vint lo[4], hi[4];
        UNROLL
        for (int c = 0; c < 4; c++) {
            vint v = V_LOAD_I(q + (size_t)c * KERN_RI * 4);
            lo[c] = V_NIB_LO(v);
            /* With VNNI the high nibbles stay in place (16 q, up to 240: the 4-way dot product
             * has no 16-bit intermediate to saturate) and the sum is shifted down once a block,
             * one instruction in place of four shifts. */
            hi[c] = HI_IN_PLACE ? V_AND_I(v, V_SET1_I((int)0xf0f0f0f0)) : V_NIB_HI(v);
            if (FIVE) { /* each byte of a lane takes byte c of the lane's fifth bits (chunk c's,
                         * kern.h): bit k is byte k's low nibble's, bit 4+k its high one's */
                vint hb = V_SHUF8(qh, V_LANE_BYTE(c));
                lo[c] = V_OR_I(lo[c], V_FIFTH(hb, V_SET1_I(0x08040201)));
                hi[c] = V_OR_I(hi[c], V_FIFTH(hb, V_SET1_I((int)0x80402010)));
            }
        }
        const uint16_t *d = (const uint16_t *)(const void *)o;
        vflt wd = V_F16(d + h * KERN_RI);
        vflt wm = HAS_MIN ? V_F16(d + (2 + h) * KERN_RI) : V_ZERO_F();
        UNROLL
        for (int r = 0; r < MR; r++) {
            const act_block *x = a + r * nb + b;
            /* two chains, so the dot products of a block overlap */
            vint s0 = HAS_MIN ? V_ZERO_I() : V_SET1_I(offset_times * x->neg8sum), s1 = V_ZERO_I();
#ifdef KERN_VNNI
            UNROLL
            for (int c = 0; c < 4; c++) {
                s0 = V_DOT(s0, lo[c], V_BCAST4(x->qs + 4 * c));
                s1 = V_DOT(s1, hi[c], V_BCAST4(x->qs + 16 + 4 * c));
            }
            if (HI_IN_PLACE)
                s1 = V_SRAI(s1, 4);
#else
            /* Without VNNI, pmaddubsw's int16 pair sums are added as int16 across the block
             * and widened once (a pair is at most 2 x 15 x 128 = 3840, so eight fit; with a
             * fifth bit, 7936, four), not widened and added per chunk: half the multiplies. */
            vint p0 = V_MADDUBS(lo[0], V_BCAST4(x->qs)),
                 p1 = V_MADDUBS(hi[0], V_BCAST4(x->qs + 16));
            UNROLL
            for (int c = 1; c < 4; c++) {
                p0 = V_ADD16(p0, V_MADDUBS(lo[c], V_BCAST4(x->qs + 4 * c)));
                p1 = V_ADD16(p1, V_MADDUBS(hi[c], V_BCAST4(x->qs + 16 + 4 * c)));
            }
            if (FIVE)
                s1 = V_PAIRS32(p1);
            else
                p0 = V_ADD16(p0, p1);
            s0 = V_ADD_I(s0, V_PAIRS32(p0));
#endif
            acc[r] = V_FMA(V_CVT(V_ADD_I(s0, s1)), V_MUL(wd, V_SET1_F(x->d)), acc[r]);
            if (HAS_MIN) /* m x d_x x the sum of x's quants (neg8sum is -8 x that sum) */
                acc[r] = V_FMA(wm, V_SET1_F(x->d * (float)x->neg8sum * -0.125f), acc[r]);
        }
    }
    UNROLL
    for (int r = 0; r < MR; r++)
        V_STORE_F(out + r * KERN_RI, acc[r]);
}

INLINE void q4_0_ri_tile(const unsigned char *w, int64_t nb, const act_block *a, float *out,
                         const int MR)
{
    q4_ri_tile(w, nb, a, out, MR, 0, 0);
}

INLINE void q4_1_ri_tile(const unsigned char *w, int64_t nb, const act_block *a, float *out,
                         const int MR)
{
    q4_ri_tile(w, nb, a, out, MR, 1, 0);
}

INLINE void q5_0_ri_tile(const unsigned char *w, int64_t nb, const act_block *a, float *out,
                         const int MR)
{
    q4_ri_tile(w, nb, a, out, MR, 0, 1);
}

INLINE void q5_1_ri_tile(const unsigned char *w, int64_t nb, const act_block *a, float *out,
                         const int MR)
{
    q4_ri_tile(w, nb, a, out, MR, 1, 1);
}

void KERN(kern_q4_0_ri)(const unsigned char *w, int64_t nb, const act_block *a, int mr, float *out)
{
    RI_MR_CASES(q4_0_ri_tile)
}

void KERN(kern_q4_1_ri)(const unsigned char *w, int64_t nb, const act_block *a, int mr, float *out)
{
    RI_MR_CASES(q4_1_ri_tile)
}

void KERN(kern_q5_0_ri)(const unsigned char *w, int64_t nb, const act_block *a, int mr, float *out)
{
    RI_MR_CASES(q5_0_ri_tile)
}

void KERN(kern_q5_1_ri)(const unsigned char *w, int64_t nb, const act_block *a, int mr, float *out)
{
    RI_MR_CASES(q5_1_ri_tile)
}

/* ---- Q8_0, interleaved rows (layout in kern.h) ---------------------------------------------- */

/* A block's starting lane sum against weights stored biased by +128 for VNNI's unsigned
 * operand (Q8_0's, IQ4_NL's table): -128 x the activation block's sum, 16 x neg8sum; none
 * without VNNI, where the weights stay signed. */
#ifdef KERN_VNNI
#define V_BIASED_START(x) V_SET1_I(16 * (x)->neg8sum)
#else
#define V_BIASED_START(x) V_ZERO_I()
#endif

#if defined(__AVX512F__)
typedef __mmask64 vsign;
#define V_SIGNS(w) _mm512_movepi8_mask(w)
#define V_ABS8(w) _mm512_abs_epi8(w)
#define V_APPLY_SIGN(x, k) _mm512_mask_sub_epi8((x), (k), _mm512_setzero_si512(), (x))
#else
typedef __m256i vsign;
#define V_SIGNS(w) (w)
#define V_ABS8(w) _mm256_abs_epi8(w)
#define V_APPLY_SIGN(x, w) _mm256_sign_epi8((x), (w)) /* zeroes x where w is 0: |w| is 0 too */
#endif

/* Without VNNI |w| is the unsigned operand and w's sign moves onto the broadcast x, as in
 * q8_0_tile: exact for every int8 w, -128 included (|-128| is 128 unsigned). Both are worked out
 * once per weight vector and shared by the activation rows. With VNNI the weights were stored
 * as w + 128 (CPU_LAYOUT_ROWS_BIASED), the unsigned operand as they are, and each lane starts
 * at V_BIASED_START: exact for every int8 w, and no sign work beside each dot product (a masked
 * subtract per weight vector and activation row). Q8_X is the broadcast x as the dot product
 * takes it, given the weight vector's signs k. */
#ifdef KERN_VNNI
#define Q8_X(x, k) (x)
#else
#define Q8_X(x, k) V_APPLY_SIGN((x), (k))
#endif

INLINE void q8_0_ri_tile(const unsigned char *w, int64_t nb, const act_block *a, float *out,
                         const int MR)
{
    vflt acc[KERN_MR];
    UNROLL
    for (int r = 0; r < MR; r++)
        acc[r] = V_ZERO_F();
    /* two chains per row, so the dot products of a block overlap, where the registers hold
     * them: not AVX2's 16 with more than two rows */
    const int CHAINS = KERN_RI == 8 && MR > 2 ? 1 : 2;
    const q8_0_ri_record *rec = (const q8_0_ri_record *)(const void *)w;
    for (int64_t b = 0; b < nb; b++) {
        const q8_0_ri_record *o = rec + b / 2;
        int h = (int)(b & 1);
        if (!h)
            for (size_t l = 0; l < sizeof *o; l += 64)
                __builtin_prefetch((const char *)o + RI_PREFETCH + l);
        vflt wd = V_F16(o->d[h]);
        vint s0[KERN_MR], s1[KERN_MR];
        UNROLL
        for (int r = 0; r < MR; r++)
            s0[r] = V_BIASED_START(a + r * nb + b), s1[r] = V_ZERO_I();
        UNROLL
        for (int c = 0; c < 8; c += 2) {
            vint w0 = V_LOAD_I(o->q[h][c]), w1 = V_LOAD_I(o->q[h][c + 1]);
#ifdef KERN_VNNI
            vint u0 = w0, u1 = w1;
#else
            vint u0 = V_ABS8(w0), u1 = V_ABS8(w1);
            vsign k0 = V_SIGNS(w0), k1 = V_SIGNS(w1);
#endif
            UNROLL
            for (int r = 0; r < MR; r++) {
                const act_block *x = a + r * nb + b;
                s0[r] = V_DOT(s0[r], u0, Q8_X(V_BCAST4(x->qs + 4 * c), k0));
                if (CHAINS == 2)
                    s1[r] = V_DOT(s1[r], u1, Q8_X(V_BCAST4(x->qs + 4 * c + 4), k1));
                else
                    s0[r] = V_DOT(s0[r], u1, Q8_X(V_BCAST4(x->qs + 4 * c + 4), k1));
            }
        }
        UNROLL
        for (int r = 0; r < MR; r++)
            acc[r] = V_FMA(V_CVT(V_ADD_I(s0[r], s1[r])), V_MUL(wd, V_SET1_F(a[r * nb + b].d)),
                           acc[r]);
    }
    UNROLL
    for (int r = 0; r < MR; r++)
        V_STORE_F(out + r * KERN_RI, acc[r]);
}

void KERN(kern_q8_0_ri)(const unsigned char *w, int64_t nb, const act_block *a, int mr,
                        float *out){RI_MR_CASES(q8_0_ri_tile)}

/* ---- IQ4_NL, interleaved rows: Q4_0's records, each nibble an index into IQ4's table ---------
 * The table lookup is one byte shuffle per 4 bytes of nibbles, giving signed weights, which
 * then meet the activations as Q8_0's do. With VNNI the table is stored biased by +128, so the
 * weights are the unsigned operand as they are, and each lane starts at -128 x the sum of its
 * 4 activations (16 x neg8sum); u8 x s8 pairs summed to int16 (no VNNI) would overflow with
 * weights up to 241, so there |w| is the unsigned operand and w's sign moves onto x. */
#if defined(__AVX512F__)
#define V_TABLE16(t) _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(const void *)(t)))
#define V_LOOKUP(t, idx) _mm512_shuffle_epi8((t), (idx))
#else
#define V_TABLE16(t)                                                                               \
    _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)(t)))
#define V_LOOKUP(t, idx) _mm256_shuffle_epi8((t), (idx))
#endif

INLINE void iq4_nl_ri_tile(const unsigned char *w, int64_t nb, const act_block *a, float *out,
                           const int MR)
{
#ifdef KERN_VNNI
    int8_t biased[16];
    for (int i = 0; i < 16; i++)
        biased[i] = (int8_t)(loom_iq4_values[i] + 128);
    const vint table = V_TABLE16(biased);
#else
    const vint table = V_TABLE16(loom_iq4_values);
#endif
    vflt acc[KERN_MR];
    UNROLL
    for (int r = 0; r < MR; r++)
        acc[r] = V_ZERO_F();
    const q4_0_ri_record *rec = (const q4_0_ri_record *)(const void *)w;
    for (int64_t b = 0; b < nb; b++) {
        const q4_0_ri_record *o = rec + b / 2;
        int h = (int)(b & 1);
        if (!h)
            for (size_t l = 0; l < sizeof *o; l += 64)
                __builtin_prefetch((const char *)o + RI_PREFETCH + l);
        vflt wd = V_F16(o->d[h]);
        vint s0[KERN_MR], s1[KERN_MR];
        UNROLL
        for (int r = 0; r < MR; r++)
            s0[r] = V_BIASED_START(a + r * nb + b), s1[r] = V_ZERO_I();
        UNROLL
        for (int c = 0; c < 4; c++) {
            vint v = V_LOAD_I(o->q[h][c]);
            /* chunk c: elements 4c..4c+3 in the low nibbles, 16+4c.. in the high ones */
            vint lo = V_LOOKUP(table, V_NIB_LO(v)), hi = V_LOOKUP(table, V_NIB_HI(v));
#ifdef KERN_VNNI
            UNROLL
            for (int r = 0; r < MR; r++) {
                const act_block *x = a + r * nb + b;
                s0[r] = V_DOT(s0[r], lo, V_BCAST4(x->qs + 4 * c));
                s1[r] = V_DOT(s1[r], hi, V_BCAST4(x->qs + 16 + 4 * c));
            }
#else
            vint ulo = V_ABS8(lo), uhi = V_ABS8(hi);
            vsign klo = V_SIGNS(lo), khi = V_SIGNS(hi);
            UNROLL
            for (int r = 0; r < MR; r++) {
                const act_block *x = a + r * nb + b;
                s0[r] = V_DOT(s0[r], ulo, V_APPLY_SIGN(V_BCAST4(x->qs + 4 * c), klo));
                s1[r] = V_DOT(s1[r], uhi, V_APPLY_SIGN(V_BCAST4(x->qs + 16 + 4 * c), khi));
            }
#endif
        }
        UNROLL
        for (int r = 0; r < MR; r++)
            acc[r] = V_FMA(V_CVT(V_ADD_I(s0[r], s1[r])), V_MUL(wd, V_SET1_F(a[r * nb + b].d)),
                           acc[r]);
    }
    UNROLL
    for (int r = 0; r < MR; r++)
        V_STORE_F(out + r * KERN_RI, acc[r]);
}

void KERN(kern_iq4_nl_ri)(const unsigned char *w, int64_t nb, const act_block *a, int mr,
                          float *out)
{
    RI_MR_CASES(iq4_nl_ri_tile)
}

#ifndef KERN_VNNI
/* F16/BF16 with rows interleaved: column k of the group's KERN_RI rows is one vector; four
 * columns at a time, into U accumulators per activation row so that enough FMA chains overlap
 * (AVX2's 16 registers hold two per row when there are several rows). */
INLINE void half_ri_tile(loom_dtype wt, const unsigned char *w, int64_t K, const float *const *x,
                         float *out, const int MR)
{
    const size_t col = KERN_RI * 2; /* bytes of one column */
    const int U = KERN_RI == 8 && MR > 1 ? 2 : 4;
    vflt acc[KERN_MR][4];
    UNROLL
    for (int r = 0; r < MR; r++) {
        UNROLL
        for (int u = 0; u < 4; u++)
            acc[r][u] = V_ZERO_F();
    }
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
        const unsigned char *p = w + (size_t)k * col;
        for (size_t l = 0; l < 4 * col; l += 64)
            __builtin_prefetch(p + RI_PREFETCH_HALF + l);
        vflt wv[4];
        UNROLL
        for (int u = 0; u < 4; u++)
            wv[u] = V_LOAD_W(wt, p + u * col);
        UNROLL
        for (int r = 0; r < MR; r++) {
            UNROLL
            for (int u = 0; u < 4; u++)
                acc[r][u % U] = V_FMA(wv[u], V_SET1_F(x[r][k + u]), acc[r][u % U]);
        }
    }
    for (; k < K; k++) {
        vflt wv = V_LOAD_W(wt, w + (size_t)k * col);
        UNROLL
        for (int r = 0; r < MR; r++)
            acc[r][0] = V_FMA(wv, V_SET1_F(x[r][k]), acc[r][0]);
    }
    UNROLL
    for (int r = 0; r < MR; r++)
        V_STORE_F(out + r * KERN_RI,
                  V_ADD_F(V_ADD_F(acc[r][0], acc[r][1]), V_ADD_F(acc[r][2], acc[r][3])));
}

/* column k (at p) of NG groups against MR activation rows */
INLINE void half_ri_column_n(loom_dtype wt, const unsigned char *p, size_t gstride,
                             const float *const *x, int64_t k, vflt acc[][KERN_RI_GROUPS],
                             const int NG, const int MR)
{
    vflt wv[KERN_RI_GROUPS];
    UNROLL
    for (int g = 0; g < NG; g++)
        wv[g] = V_LOAD_W(wt, p + (size_t)g * gstride);
    UNROLL
    for (int r = 0; r < MR; r++) {
        vflt xb = V_SET1_F(x[r][k]);
        UNROLL
        for (int g = 0; g < NG; g++)
            acc[r][g] = V_FMA(wv[g], xb, acc[r][g]);
    }
}

/* NG adjacent groups (gstride bytes apart) against two or more activation rows: each broadcast
 * activation then feeds NG FMAs, which takes the load ports out of the way (prefill, and
 * serving steps of many sequences). Results: row r's NG x KERN_RI columns at
 * out + r NG KERN_RI. */
INLINE void half_ri_tile_n(loom_dtype wt, const unsigned char *w, size_t gstride, int64_t K,
                           const float *const *x, float *out, const int NG, const int MR)
{
    const size_t col = KERN_RI * 2;
    vflt acc[KERN_MR][KERN_RI_GROUPS];
    UNROLL
    for (int r = 0; r < MR; r++) {
        UNROLL
        for (int g = 0; g < NG; g++)
            acc[r][g] = V_ZERO_F();
    }
    /* four columns a step, so a step's prefetches are whole lines and no branch asks, column
     * by column, whether one is due (that loop ran at a third of the FMA peak) */
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
        const unsigned char *p = w + (size_t)k * col;
        UNROLL
        for (int g = 0; g < NG; g++)
            for (size_t l = 0; l < 4 * col; l += 64)
                __builtin_prefetch(p + (size_t)g * gstride + RI_PREFETCH_HALF + l);
        UNROLL
        for (int u = 0; u < 4; u++)
            half_ri_column_n(wt, p + u * col, gstride, x, k + u, acc, NG, MR);
    }
    for (; k < K; k++)
        half_ri_column_n(wt, w + (size_t)k * col, gstride, x, k, acc, NG, MR);
    UNROLL
    for (int r = 0; r < MR; r++) {
        UNROLL
        for (int g = 0; g < NG; g++)
            V_STORE_F(out + (r * NG + g) * KERN_RI, acc[r][g]);
    }
}

#ifdef KERN_WIDEN_MR
/* Prefill: a block of columns of several groups widened to f32 once (kern_half_ri_widen),
 * then every tile of X's rows against it (kern_f32_ri_n_acc). Widening in the tile kernels
 * above costs two uops per vector per 4 activation rows on the ports the FMAs use; here it is
 * paid once per block for all of a thread's rows, and the registers it freed hold 6 rows'
 * sums instead of 4. */
INLINE void half_ri_widen(loom_dtype wt, const unsigned char *w, size_t gstride, int ng, int64_t k0,
                          int64_t kc, float *out)
{
    const size_t col = KERN_RI * 2;
    for (int g = 0; g < ng; g++) {
        const unsigned char *p = w + (size_t)g * gstride + (size_t)k0 * col;
        for (int64_t k = 0; k < kc; k++)
            V_STORE_F(out + (k * ng + g) * KERN_RI, V_LOAD_W(wt, p + (size_t)k * col));
    }
}

void kern_f16_ri_widen(const unsigned char *w, size_t gstride, int ng, int64_t k0, int64_t kc,
                       float *out)
{
    half_ri_widen(LOOM_F16, w, gstride, ng, k0, kc, out);
}

void kern_bf16_ri_widen(const unsigned char *w, size_t gstride, int ng, int64_t k0, int64_t kc,
                        float *out)
{
    half_ri_widen(LOOM_BF16, w, gstride, ng, k0, kc, out);
}

/* (every loop over rows or groups unrolled whole, or the sums leave the registers) */
INLINE void f32_ri_tile_acc(const float *wf, int64_t kc, const float *const *x, int64_t k0,
                            float *acc, const int NG, const int MR)
{
    vflt a[KERN_WIDEN_MR][KERN_RI_GROUPS];
    UNROLL8
    for (int r = 0; r < MR; r++) {
        UNROLL8
        for (int g = 0; g < NG; g++)
            a[r][g] = V_LOAD_F(acc + (r * NG + g) * KERN_RI);
    }
    UNROLL
    for (int64_t k = 0; k < kc; k++) {
        vflt wv[KERN_RI_GROUPS];
        UNROLL8
        for (int g = 0; g < NG; g++)
            wv[g] = V_LOAD_F(wf + (k * NG + g) * KERN_RI);
        UNROLL8
        for (int r = 0; r < MR; r++) {
            vflt xb = V_SET1_F(x[r][k0 + k]);
            UNROLL8
            for (int g = 0; g < NG; g++)
                a[r][g] = V_FMA(wv[g], xb, a[r][g]);
        }
    }
    UNROLL8
    for (int r = 0; r < MR; r++) {
        UNROLL8
        for (int g = 0; g < NG; g++)
            V_STORE_F(acc + (r * NG + g) * KERN_RI, a[r][g]);
    }
}

#define F32_RI_MR(NG)                                                                              \
    switch (mr) {                                                                                  \
    case 1: f32_ri_tile_acc(wf, kc, x, k0, acc, NG, 1); break;                                     \
    case 2: f32_ri_tile_acc(wf, kc, x, k0, acc, NG, 2); break;                                     \
    case 3: f32_ri_tile_acc(wf, kc, x, k0, acc, NG, 3); break;                                     \
    case 4: f32_ri_tile_acc(wf, kc, x, k0, acc, NG, 4); break;                                     \
    case 5: f32_ri_tile_acc(wf, kc, x, k0, acc, NG, 5); break;                                     \
    default: f32_ri_tile_acc(wf, kc, x, k0, acc, NG, 6); break;                                    \
    }

void kern_f32_ri_n_acc(const float *wf, int ng, int64_t kc, const float *const *x, int64_t k0,
                       int mr, float *acc)
{
    switch (ng) {
    case 1: F32_RI_MR(1) break;
#if KERN_RI_GROUPS > 2
    case 2: F32_RI_MR(2) break;
    case 3: F32_RI_MR(3) break;
    default: F32_RI_MR(4) break;
#else
    default: F32_RI_MR(2) break;
#endif
    }
}
#endif

#define HALF_RI_CASES(WT)                                                                          \
    switch (mr) {                                                                                  \
    case 1: half_ri_tile(WT, w, K, x, out, 1); break;                                              \
    case 2: half_ri_tile(WT, w, K, x, out, 2); break;                                              \
    case 3: half_ri_tile(WT, w, K, x, out, 3); break;                                              \
    default: half_ri_tile(WT, w, K, x, out, 4); break;                                             \
    }

void kern_f16_ri(const unsigned char *w, int64_t K, const float *const *x, int mr, float *out)
{
    HALF_RI_CASES(LOOM_F16)
}

void kern_bf16_ri(const unsigned char *w, int64_t K, const float *const *x, int mr, float *out)
{
    HALF_RI_CASES(LOOM_BF16)
}

#define HALF_RI_N_MR(WT, NG)                                                                       \
    switch (mr) {                                                                                  \
    case 2: half_ri_tile_n(WT, w, gstride, K, x, out, NG, 2); break;                               \
    case 3: half_ri_tile_n(WT, w, gstride, K, x, out, NG, 3); break;                               \
    default: half_ri_tile_n(WT, w, gstride, K, x, out, NG, 4); break;                              \
    }
#if KERN_RI_GROUPS > 2
#define HALF_RI_N_CASES(WT)                                                                        \
    switch (ng) {                                                                                  \
    case 2: HALF_RI_N_MR(WT, 2) break;                                                             \
    case 3: HALF_RI_N_MR(WT, 3) break;                                                             \
    default: HALF_RI_N_MR(WT, 4) break;                                                            \
    }
#else
#define HALF_RI_N_CASES(WT)                                                                        \
    (void)ng;                                                                                      \
    HALF_RI_N_MR(WT, 2)
#endif

void kern_f16_ri_n(const unsigned char *w, size_t gstride, int ng, int64_t K, const float *const *x,
                   int mr, float *out)
{
    HALF_RI_N_CASES(LOOM_F16)
}

void kern_bf16_ri_n(const unsigned char *w, size_t gstride, int ng, int64_t K,
                    const float *const *x, int mr, float *out)
{
    HALF_RI_N_CASES(LOOM_BF16)
}
#endif
#endif

/* ---- Dispatch: one instantiation per tile size --------------------------------------------- */

#define TILE_CASES(CALL)                                                                           \
    switch ((nr - 1) * KERN_MR + (mr - 1)) {                                                       \
    case 0: CALL(1, 1); break;                                                                     \
    case 1: CALL(1, 2); break;                                                                     \
    case 2: CALL(1, 3); break;                                                                     \
    case 3: CALL(1, 4); break;                                                                     \
    case 4: CALL(2, 1); break;                                                                     \
    case 5: CALL(2, 2); break;                                                                     \
    case 6: CALL(2, 3); break;                                                                     \
    case 7: CALL(2, 4); break;                                                                     \
    case 8: CALL(3, 1); break;                                                                     \
    case 9: CALL(3, 2); break;                                                                     \
    case 10: CALL(3, 3); break;                                                                    \
    case 11: CALL(3, 4); break;                                                                    \
    case 12: CALL(4, 1); break;                                                                    \
    case 13: CALL(4, 2); break;                                                                    \
    case 14: CALL(4, 3); break;                                                                    \
    default: CALL(4, 4); break;                                                                    \
    }

#define Q4_0_CALL(N, M) q4_0_tile(w, wstride, a, m0, out, N, M)
#define Q4_1_CALL(N, M) q4_1_tile(w, wstride, a, m0, out, N, M)
#define Q8_0_CALL(N, M) q8_0_tile(w, wstride, a, m0, out, N, M)
#define FLOAT_CALL(N, M) float_tile(wt, w, wstride, x, K, out, N, M)

void KERN(kern_q4_0)(const unsigned char *w, size_t wstride, int nr, const cpu_act *a, int64_t m0,
                     int mr, float *out)
{
    TILE_CASES(Q4_0_CALL)
}

void KERN(kern_q4_1)(const unsigned char *w, size_t wstride, int nr, const cpu_act *a, int64_t m0,
                     int mr, float *out)
{
    TILE_CASES(Q4_1_CALL)
}

void KERN(kern_q8_0)(const unsigned char *w, size_t wstride, int nr, const cpu_act *a, int64_t m0,
                     int mr, float *out)
{
    TILE_CASES(Q8_0_CALL)
}

#ifndef KERN_VNNI
void kern_float(loom_dtype wt, const unsigned char *w, size_t wstride, int nr,
                const float *const *x, int mr, int64_t K, float *out)
{
    TILE_CASES(FLOAT_CALL)
}
#endif
