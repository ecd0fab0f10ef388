/*
 * backends/cpu/attn_block.h - attention over one cache block at a time, for the avx2 and avx512
 * builds (cpu_backend.c's attn_pairs uses it when ATTN_FAST_HD(head_dim)): a block's K and V
 * rows arrive converted to f32; a query head's 16 (or 8) scores are reduced together by one
 * shuffle tree instead of a horizontal sum each, and its output stays in registers while the
 * block's values are added. Without AVX2, ATTN_FAST_HD is 0 and attn_pairs goes row by row.
 */
#ifndef LOOM_CPU_ATTN_BLOCK_H
#define LOOM_CPU_ATTN_BLOCK_H

#include <stdint.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* the loops below run a compile-time number of times: unrolled, their arrays are registers */
#define UNROLL16 _Pragma("GCC unroll 16")

#if defined(__AVX512F__)

/* out lane k = the sum of a[k]'s lanes: a transposing tree of shuffles and adds, 46
 * instructions where 16 separate reductions take about 130 */
static inline __m512 reduce16(const __m512 *a)
{
    __m512 b[8], c[4], d[2];
    for (int k = 0; k < 8; k++) /* 256-bit halves: a[2k]'s in the low half, a[2k+1]'s high */
        b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int k = 0; k < 4; k++) /* 128-bit lane j: a[4k + j] */
        c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int k = 0; k < 2; k++)
        d[k] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* position 4j + i now holds a[4i + j]'s sum */
    __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), e);
}

/* out[jj] = scale * q . kf[jj] for jj < nk; kf: nk rows of NC x 16 floats */
static inline __attribute__((always_inline)) void block_scores(const float *q, const float *kf,
                                                               int64_t nk, float scale, float *out,
                                                               const int NC)
{
    __m512 qv[16];
    UNROLL16
    for (int c = 0; c < NC; c++)
        qv[c] = _mm512_loadu_ps(q + 16 * c);
    for (int64_t j0 = 0; j0 < nk; j0 += 16) {
        __m512 a[16];
        UNROLL16
        for (int t = 0; t < 16; t++) {
            __m512 x = _mm512_setzero_ps();
            if (j0 + t < nk)
                UNROLL16
            for (int c = 0; c < NC; c++)
                x = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kf + (j0 + t) * 16 * NC + 16 * c), x);
            a[t] = x;
        }
        int64_t n = nk - j0 < 16 ? nk - j0 : 16;
        _mm512_mask_storeu_ps(out + j0, (__mmask16)((1u << n) - 1),
                              _mm512_mul_ps(reduce16(a), _mm512_set1_ps(scale)));
    }
}

/* acc += sum over jj < nk of w[jj] vf[jj]; rows of NC x 16 floats, acc kept in registers */
static inline __attribute__((always_inline)) void block_values(const float *w, const float *vf,
                                                               int64_t nk, float *acc, const int NC)
{
    const int CH = NC < 8 ? NC : 8; /* registers of acc held at once */
    for (int c0 = 0; c0 < NC; c0 += CH) {
        __m512 r[8];
        UNROLL16
        for (int c = 0; c < CH; c++)
            r[c] = _mm512_loadu_ps(acc + 16 * (c0 + c));
        for (int64_t jj = 0; jj < nk; jj++) {
            __m512 x = _mm512_set1_ps(w[jj]);
            const float *vr = vf + jj * 16 * NC + 16 * c0;
            UNROLL16
            for (int c = 0; c < CH; c++)
                r[c] = _mm512_fmadd_ps(x, _mm512_loadu_ps(vr + 16 * c), r[c]);
        }
        UNROLL16
        for (int c = 0; c < CH; c++)
            _mm512_storeu_ps(acc + 16 * (c0 + c), r[c]);
    }
}

#define ATTN_LANES 16
#elif defined(__AVX2__)

/* out lane k = the sum of a[k]'s lanes, for eight vectors */
static inline __m256 reduce8(const __m256 *a)
{
    __m256 g0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    /* g0 holds a[0..3]'s sums of lanes 0-3 low, of lanes 4-7 high; g1 the same for a[4..7] */
    return _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20),
                         _mm256_permute2f128_ps(g0, g1, 0x31));
}

/* block_scores with eight keys at a time; q is read from L1 (16 registers hold no
 * 128-wide row beside the sums) */
static inline __attribute__((always_inline)) void block_scores(const float *q, const float *kf,
                                                               int64_t nk, float scale, float *out,
                                                               const int NC)
{
    for (int64_t j0 = 0; j0 < nk; j0 += 8) {
        __m256 a[8];
        UNROLL16
        for (int t = 0; t < 8; t++) {
            __m256 x = _mm256_setzero_ps();
            if (j0 + t < nk)
                UNROLL16
            for (int c = 0; c < NC; c++)
                x = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c),
                                    _mm256_loadu_ps(kf + (j0 + t) * 8 * NC + 8 * c), x);
            a[t] = x;
        }
        int64_t n = nk - j0 < 8 ? nk - j0 : 8;
        __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        _mm256_maskstore_ps(out + j0, keep, _mm256_mul_ps(reduce8(a), _mm256_set1_ps(scale)));
    }
}

/* block_values, eight floats a register */
static inline __attribute__((always_inline)) void block_values(const float *w, const float *vf,
                                                               int64_t nk, float *acc, const int NC)
{
    const int CH = NC < 8 ? NC : 8;
    for (int c0 = 0; c0 < NC; c0 += CH) {
        __m256 r[8];
        UNROLL16
        for (int c = 0; c < CH; c++)
            r[c] = _mm256_loadu_ps(acc + 8 * (c0 + c));
        for (int64_t jj = 0; jj < nk; jj++) {
            __m256 x = _mm256_set1_ps(w[jj]);
            const float *vr = vf + jj * 8 * NC + 8 * c0;
            UNROLL16
            for (int c = 0; c < CH; c++)
                r[c] = _mm256_fmadd_ps(x, _mm256_loadu_ps(vr + 8 * c), r[c]);
        }
        UNROLL16
        for (int c = 0; c < CH; c++)
            _mm256_storeu_ps(acc + 8 * (c0 + c), r[c]);
    }
}

#define ATTN_LANES 8
#endif

#if defined(ATTN_LANES)
#define ATTN_FAST_HD(hd) ((hd) == 64 || (hd) == 128 || (hd) == 256)

/* one query head; NC (head_dim / ATTN_LANES) a constant, so the kernels' loops unroll */
static inline __attribute__((always_inline)) void attn_head(const float *q, const float *kf,
                                                            const float *vf, int64_t nk,
                                                            float scale, float *scores, float *acc,
                                                            int values, const int NC)
{
    if (values)
        block_values(scores, vf, nk, acc, NC);
    else
        block_scores(q, kf, nk, scale, scores, NC);
}

/* One block for the group's heads, K and V converted to f32 once (head_dim 64, 128 or 256):
 * the scores of each head (values 0), or the weighted values added to its output (1). */
static void attn_block_simd(const float *const *q, int64_t group, const float *kf, const float *vf,
                            int64_t nk, int64_t hd, float scale, float *scores, int64_t bs,
                            float *acc, int values)
{
    for (int64_t h = 0; h < group; h++) {
        float *sc = scores + h * bs, *out = acc ? acc + h * hd : NULL;
        switch (hd) {
        case 64: attn_head(q[h], kf, vf, nk, scale, sc, out, values, 64 / ATTN_LANES); break;
        case 128: attn_head(q[h], kf, vf, nk, scale, sc, out, values, 128 / ATTN_LANES); break;
        default: attn_head(q[h], kf, vf, nk, scale, sc, out, values, 256 / ATTN_LANES); break;
        }
    }
}
#else
#define ATTN_FAST_HD(hd) 0
#endif

#endif
