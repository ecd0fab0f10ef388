/*
 * backends/cpu/kernels.h - the matmul inner kernels: one weight row against up to
 * KERN_MAX_M activation rows. Included by kern.c (and, in the avx512 variant, by kern_vnni.c
 * with KERN_VNNI defined and -mavx512vnni), so the same source becomes the baseline, AVX2,
 * AVX-512 and AVX-512 VNNI kernels, chosen by the flags each file is compiled with.
 *
 * Quantised weights meet activations quantised once per matmul to int8 blocks (cpu_act): the
 * dot product of a block is an integer sum, scaled once by both blocks' scales. For Q4_0 the
 * weight nibbles are used unsigned (0..15) and the -8 offset is folded in afterwards through
 * the activation block's precomputed sum, so VNNI's unsigned x signed dot applies directly.
 */
#include "kern.h"

#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifdef KERN_VNNI
#define KERN(name) name##_vnni
#else
#define KERN(name) name
#endif

/* ---- helpers ------------------------------------------------------------------------------ */

static inline float f16(uint16_t h)
{
    return loom_f16_to_f32(h);
}

#if defined(__AVX2__)
static inline float hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 16 bytes of nibbles -> 32 unsigned bytes: low nibbles are elements 0..15, high 16..31 */
static inline __m256i unpack_nibbles256(const uint8_t *qs)
{
    __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

/* sum of u8 a[i] * s8 b[i] in 8 int32 lanes */
static inline __m256i dot_u8s8_256(__m256i a, __m256i b)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
}
#endif

#if defined(__AVX512F__)
/* acc + sum of u8 a[i] * s8 b[i] in 16 int32 lanes (each lane: 4 adjacent bytes) */
static inline __m512i dpbusd512(__m512i acc, __m512i a, __m512i b)
{
#ifdef KERN_VNNI
    return _mm512_dpbusd_epi32(acc, a, b);
#else
    __m512i p16 = _mm512_maddubs_epi16(a, b);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p16, _mm512_set1_epi16(1)));
#endif
}

/* two blocks' worth of weights in one register: block b in the low half, b+1 in the high */
static inline __m512i join256(__m256i lo, __m256i hi)
{
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* per-lane scale: sa in lanes 0..7 (block b), sb in lanes 8..15 (block b+1) */
static inline __m512 scale_pair(float sa, float sb)
{
    return _mm512_insertf32x8(_mm512_set1_ps(sa), _mm256_set1_ps(sb), 1);
}
#endif

/* ---- Q8_0 ------------------------------------------------------------------------------- */

void KERN(kern_q8_0)(const void *wrow, const cpu_act *a, int64_t m0, int mc, float *out)
{
    const loom_block_q8_0 *w = wrow;
    int64_t nb = a->K / LOOM_QK;
    for (int r = 0; r < mc; r++) {
        const int8_t *xq = a->qs + (m0 + r) * a->K;
        const float *xd = a->d + (m0 + r) * nb;
        int64_t b = 0;
        float sum = 0.0f;
#if defined(__AVX512F__)
        __m512 acc = _mm512_setzero_ps();
        for (; b + 2 <= nb; b += 2) {
            __m512i wv = join256(_mm256_loadu_si256((const __m256i *)w[b].qs),
                                 _mm256_loadu_si256((const __m256i *)w[b + 1].qs));
            __m512i xv = _mm512_loadu_si512(xq + b * LOOM_QK);
            /* |w| as the unsigned operand, w's sign moved onto x */
            __mmask64 neg = _mm512_movepi8_mask(wv);
            __m512i sx = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
            __m512i dot = dpbusd512(_mm512_setzero_si512(), _mm512_abs_epi8(wv), sx);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                  scale_pair(f16(w[b].d) * xd[b], f16(w[b + 1].d) * xd[b + 1]), acc);
        }
        sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__)
        __m256 acc = _mm256_setzero_ps();
        for (; b < nb; b++) {
            __m256i wv = _mm256_loadu_si256((const __m256i *)w[b].qs);
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * LOOM_QK));
            __m256i dot = dot_u8s8_256(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(f16(w[b].d) * xd[b]), acc);
        }
        sum = hsum256(acc);
#endif
        for (; b < nb; b++) {
            int isum = 0;
            for (int j = 0; j < LOOM_QK; j++)
                isum += w[b].qs[j] * xq[b * LOOM_QK + j];
            sum += (float)isum * f16(w[b].d) * xd[b];
        }
        out[r] = sum;
    }
}

/* ---- Q4_0 ------------------------------------------------------------------------------- */

void KERN(kern_q4_0)(const void *wrow, const cpu_act *a, int64_t m0, int mc, float *out)
{
    const loom_block_q4_0 *w = wrow;
    int64_t nb = a->K / LOOM_QK;
    for (int r = 0; r < mc; r++) {
        const int8_t *xq = a->qs + (m0 + r) * a->K;
        const float *xd = a->d + (m0 + r) * nb, *xs = a->s + (m0 + r) * nb;
        int64_t b = 0;
        float sum = 0.0f, offset = 0.0f; /* offset: sum of d_w * 8 * d_x * sum(x) */
#if defined(__AVX512F__)
        __m512 acc = _mm512_setzero_ps();
        for (; b + 2 <= nb; b += 2) {
            __m512i wv = join256(unpack_nibbles256(w[b].qs), unpack_nibbles256(w[b + 1].qs));
            __m512i xv = _mm512_loadu_si512(xq + b * LOOM_QK);
            __m512i dot = dpbusd512(_mm512_setzero_si512(), wv, xv);
            float da = f16(w[b].d), db = f16(w[b + 1].d);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale_pair(da * xd[b], db * xd[b + 1]),
                                  acc);
            offset += da * xs[b] + db * xs[b + 1];
        }
        sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__)
        __m256 acc = _mm256_setzero_ps();
        for (; b < nb; b++) {
            __m256i wv = unpack_nibbles256(w[b].qs);
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * LOOM_QK));
            __m256i dot = dot_u8s8_256(wv, xv);
            float d = f16(w[b].d);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * xd[b]), acc);
            offset += d * xs[b];
        }
        sum = hsum256(acc);
#endif
        for (; b < nb; b++) {
            int isum = 0;
            for (int j = 0; j < LOOM_QK / 2; j++)
                isum += (w[b].qs[j] & 0x0f) * xq[b * LOOM_QK + j] +
                        (w[b].qs[j] >> 4) * xq[b * LOOM_QK + j + LOOM_QK / 2];
            float d = f16(w[b].d);
            sum += (float)isum * d * xd[b];
            offset += d * xs[b];
        }
        out[r] = sum - 8.0f * offset;
    }
}

/* ---- Q4_1 ------------------------------------------------------------------------------- */

void KERN(kern_q4_1)(const void *wrow, const cpu_act *a, int64_t m0, int mc, float *out)
{
    const loom_block_q4_1 *w = wrow;
    int64_t nb = a->K / LOOM_QK;
    for (int r = 0; r < mc; r++) {
        const int8_t *xq = a->qs + (m0 + r) * a->K;
        const float *xd = a->d + (m0 + r) * nb, *xs = a->s + (m0 + r) * nb;
        int64_t b = 0;
        float sum = 0.0f, mins = 0.0f; /* mins: sum of m_w * d_x * sum(x) */
#if defined(__AVX512F__)
        __m512 acc = _mm512_setzero_ps();
        for (; b + 2 <= nb; b += 2) {
            __m512i wv = join256(unpack_nibbles256(w[b].qs), unpack_nibbles256(w[b + 1].qs));
            __m512i xv = _mm512_loadu_si512(xq + b * LOOM_QK);
            __m512i dot = dpbusd512(_mm512_setzero_si512(), wv, xv);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                  scale_pair(f16(w[b].d) * xd[b], f16(w[b + 1].d) * xd[b + 1]), acc);
            mins += f16(w[b].m) * xs[b] + f16(w[b + 1].m) * xs[b + 1];
        }
        sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__)
        __m256 acc = _mm256_setzero_ps();
        for (; b < nb; b++) {
            __m256i wv = unpack_nibbles256(w[b].qs);
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * LOOM_QK));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8_256(wv, xv)),
                                  _mm256_set1_ps(f16(w[b].d) * xd[b]), acc);
            mins += f16(w[b].m) * xs[b];
        }
        sum = hsum256(acc);
#endif
        for (; b < nb; b++) {
            int isum = 0;
            for (int j = 0; j < LOOM_QK / 2; j++)
                isum += (w[b].qs[j] & 0x0f) * xq[b * LOOM_QK + j] +
                        (w[b].qs[j] >> 4) * xq[b * LOOM_QK + j + LOOM_QK / 2];
            sum += (float)isum * f16(w[b].d) * xd[b];
            mins += f16(w[b].m) * xs[b];
        }
        out[r] = sum + mins;
    }
}

/* ---- Float weights ---------------------------------------------------------------------- */

/* One weight row (f32, f16 or bf16) against mc f32 rows; the weight is converted in registers
 * once and used for every activation row. */
void KERN(kern_float)(loom_dtype wt, const void *wrow, const float *const *x, int mc, int64_t K,
                      float *out)
{
    int64_t k = 0;
    float sums[KERN_MAX_M] = {0};
#if defined(__AVX512F__)
    __m512 acc[KERN_MAX_M];
    for (int r = 0; r < mc; r++)
        acc[r] = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) {
        __m512 wv;
        if (wt == LOOM_F16)
            wv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)wrow + k)));
        else if (wt == LOOM_BF16)
            wv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)wrow + k))),
                16));
        else
            wv = _mm512_loadu_ps((const float *)wrow + k);
        for (int r = 0; r < mc; r++)
            acc[r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x[r] + k), acc[r]);
    }
    for (int r = 0; r < mc; r++)
        sums[r] = _mm512_reduce_add_ps(acc[r]);
#elif defined(__AVX2__)
    __m256 acc[KERN_MAX_M];
    for (int r = 0; r < mc; r++)
        acc[r] = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) {
        __m256 wv;
        if (wt == LOOM_F16)
            wv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)wrow + k)));
        else if (wt == LOOM_BF16)
            wv = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)wrow + k))),
                16));
        else
            wv = _mm256_loadu_ps((const float *)wrow + k);
        for (int r = 0; r < mc; r++)
            acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x[r] + k), acc[r]);
    }
    for (int r = 0; r < mc; r++)
        sums[r] = hsum256(acc[r]);
#endif
    for (; k < K; k++) {
        float wv = wt == LOOM_F16    ? f16(((const uint16_t *)wrow)[k])
                   : wt == LOOM_BF16 ? loom_bf16_to_f32(((const uint16_t *)wrow)[k])
                                     : ((const float *)wrow)[k];
        for (int r = 0; r < mc; r++)
            sums[r] += wv * x[r][k];
    }
    for (int r = 0; r < mc; r++)
        out[r] = sums[r];
}
