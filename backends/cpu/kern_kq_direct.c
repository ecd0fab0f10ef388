/*
 * backends/cpu/kern_kq_direct.c - Q2_K..Q6_K and IQ4_XS matmul kernels that read the file's
 * layout, for the avx2 and avx512 variants (interface in kern.h; the unpacking path every
 * variant has is kern_kq.c).
 */
#include "kq.h"
#include "rows.h"

#include <math.h>
#include <string.h>

/* Q2_K..Q6_K and IQ4_XS rows are dotted without unpacking, against activations quantised per
 * super-block of 256 (act_k). Per super-block: the quants (plus Q5_K's fifth bit, Q6_K's two
 * high bits, Q3_K's third; IQ4_XS's through its table, signed) meet the activations as unsigned
 * x signed bytes, are summed to int32 by the sub-block scales, and take one FMA by d x the
 * activations' scale. Minimums (Q2_K, Q4_K, Q5_K) and the offsets of Q6_K (32) and Q3_K (4)
 * come from the activations' sums, once per super-block: per 16 (act_k.bsums), or for the
 * AVX-512 Q4_K/Q5_K minimums d x the sums per 32 (act_k.dsums).
 *
 * The AVX-512 kernels take 64 values an instruction. A 64-byte load of Q4_K/Q5_K's nibbles
 * holds two sub-block pairs, whose low nibbles are sub-blocks 0 and 2 of those 128 values and
 * whose high nibbles are 1 and 3; their activations are stored in that order (kern_kq_swapped)
 * so that each meets its weights in one load. Q6_K's low nibbles are already in value order. */

/* Decode streams the rows once, and the hardware prefetcher alone left these kernels waiting on
 * memory (as it did the interleaved Q4_0 kernel, kern_template.h): each super-block asks for the
 * bytes this far ahead of it (RI_PREFETCH's distance: 1B Q4_K decode 72-77% of the roofline at
 * 4096, 77-83% at 1536, Intel Xeon, 2 vCPU). */
#ifndef KQ_PREFETCH
#define KQ_PREFETCH 1536
#endif
static inline void prefetch_ahead(const void *block, size_t bytes)
{
    for (size_t l = 0; l < bytes; l += 64)
        __builtin_prefetch((const char *)block + KQ_PREFETCH + l);
}

#if defined(__AVX512BW__)
#define SWAPPED_ORDER 1
#else
#define SWAPPED_ORDER 0
#endif

int kern_kq_swapped(loom_dtype wt)
{
    return SWAPPED_ORDER && (wt == LOOM_Q4_K || wt == LOOM_Q5_K);
}

/* where 32-value run s of a super-block goes: swapped, the second and third 32 of each 128
 * trade places */
static inline int run_slot(int s, int swapped)
{
    return swapped && s % 4 == 1 ? s + 1 : swapped && s % 4 == 2 ? s - 1 : s;
}

#if defined(__AVX2__)
/* the sums of a, b, c and d's 8 lanes each */
static inline __m128i hsum4_epi32(__m256i a, __m256i b, __m256i c, __m256i d)
{
    __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* one super-block of activations; the scalar prep_k_block below is the definition, this does it
 * in vectors and rounds exactly as it does (the scalar one took a tenth of Q4_K prefill) */
static void prep_k_block(const float *xb, int swapped, act_k *y)
{
    const __m256 sign = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f);
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < LOOM_QK_K; i += 8)
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float d = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))) / 127.0f;
    const __m256 id = _mm256_set1_ps(d > 0 ? 1.0f / d : 0.0f);
    y->d = d;
    __m256i sums16[16]; /* per 16 values, 8 partial sums */
    for (int s = 0; s < 8; s++) {
        __m256i q32[4];
        for (int k = 0; k < 4; k++) {
            __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xb + 32 * s + 8 * k), id);
            q32[k] = _mm256_cvttps_epi32(
                _mm256_add_ps(v, _mm256_or_ps(_mm256_and_ps(v, sign), half)));
        }
        sums16[2 * s] = _mm256_add_epi32(q32[0], q32[1]);
        sums16[2 * s + 1] = _mm256_add_epi32(q32[2], q32[3]);
        /* the packs interleave 128-bit lanes: 4-value runs in order 0 2 4 6 1 3 5 7 */
        __m256i q8 = _mm256_packs_epi16(_mm256_packs_epi32(q32[0], q32[1]),
                                        _mm256_packs_epi32(q32[2], q32[3]));
        q8 = _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(y->qs + 32 * run_slot(s, swapped)), q8);
    }
    __m128i g[4];
    for (int i = 0; i < 4; i++)
        g[i] = hsum4_epi32(sums16[4 * i], sums16[4 * i + 1], sums16[4 * i + 2], sums16[4 * i + 3]);
    _mm_storeu_si128((__m128i *)y->bsums, _mm_packs_epi32(g[0], g[1]));
    _mm_storeu_si128((__m128i *)(y->bsums + 8), _mm_packs_epi32(g[2], g[3]));
    __m256i pairs = _mm256_set_m128i(_mm_hadd_epi32(g[2], g[3]), _mm_hadd_epi32(g[0], g[1]));
    _mm256_storeu_ps(y->dsums, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(pairs)));
}
#else
static void prep_k_block(const float *xb, int swapped, act_k *y)
{
    float amax = 0;
    for (int i = 0; i < LOOM_QK_K; i++)
        amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
    float d = amax / 127.0f, id = d > 0 ? 1.0f / d : 0.0f;
    y->d = d;
    int8_t q[LOOM_QK_K];
    for (int i = 0; i < LOOM_QK_K; i++)
        q[i] = (int8_t)loom_round_nearest(xb[i] * id);
    for (int g = 0; g < 16; g++) {
        int sum = 0;
        for (int i = 0; i < 16; i++)
            sum += q[16 * g + i];
        y->bsums[g] = (int16_t)sum;
    }
    for (int s = 0; s < 8; s++)
        y->dsums[s] = d * (float)(y->bsums[2 * s] + y->bsums[2 * s + 1]);
    for (int s = 0; s < 8; s++)
        memcpy(y->qs + 32 * run_slot(s, swapped), q + 32 * s, 32);
}
#endif

void kern_prep_k(const float *x, int64_t K, int swapped, act_k *out)
{
    for (int64_t b = 0; b < K / LOOM_QK_K; b++)
        prep_k_block(x + b * LOOM_QK_K, swapped, &out[b]);
}

#if defined(__AVX2__)
/* Q4_K/Q5_K's 12 bytes of 6-bit scales and minimums as 16 bytes: scales in 0-7, minimums in
 * 8-15. Sub-blocks 0-3 hold theirs in the low 6 bits of bytes 0-3 (scales) and 4-7
 * (minimums); 4-7 take their low 4 bits from bytes 8-11 (low nibble: scale, high: minimum)
 * and their top 2 bits from the top of bytes 0-3 (scales) and 4-7 (minimums). In vector
 * registers: built in scalar ones and stored, they stalled each super-block on a failed
 * store-to-load forward. Reads 4 bytes past the 12 (the block goes on). */
static inline __m128i k_scales_mins(const uint8_t *scales)
{
    __m128i q = _mm_loadu_si128((const __m128i *)scales);      /* dwords q0 q1 q2 */
    __m128i a = _mm_shuffle_epi32(q, _MM_SHUFFLE(2, 1, 2, 0)); /* q0 q2 q1 q2 */
    __m128i b = _mm_shuffle_epi32(q, _MM_SHUFFLE(1, 1, 0, 0)); /* q0 q0 q1 q1 */
    __m128i low = _mm_and_si128(_mm_srlv_epi32(a, _mm_setr_epi32(0, 0, 0, 4)),
                                _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    __m128i top = _mm_and_si128(_mm_srli_epi32(b, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm_or_si128(low, top);
}

/* Q3_K's 16 6-bit scales (12 bytes), less 32, as int8 in sub-block order: scale s takes its low
 * 4 bits from byte s % 8 (low nibble for s < 8, high for the rest) and its top 2 bits from
 * bit pair s / 4 of byte 8 + s % 4 */
static inline __m128i q3_k_scales(const uint8_t *scales)
{
    uint64_t low;
    uint32_t top;
    memcpy(&low, scales, 8);
    memcpy(&top, scales + 8, 4);
    const __m128i nibble = _mm_set1_epi8(15);
    __m128i x = _mm_cvtsi64_si128((long long)low);
    __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(x, nibble),
                                    _mm_and_si128(_mm_srli_epi16(x, 4), nibble));
    /* dword j: the 4 top bytes shifted by 2 j, so byte 4 j + k holds scale 4 j + k's pair */
    __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int)top), _mm_setr_epi32(0, 2, 4, 6)),
                               _mm_set1_epi8(3));
    return _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
}

/* IQ4_XS's 8 6-bit scales, less 32, as int16: low 4 bits from scales_l's nibbles (sub-block
 * 2 i + 1 in byte i's high one), top 2 from bit pair s of scales_h */
static inline __m128i iq4_xs_scales(const loom_block_iq4_xs *x)
{
    uint32_t low;
    memcpy(&low, x->scales_l, 4);
    const __m128i nibble = _mm_set1_epi8(15);
    __m128i b = _mm_cvtsi32_si128((int)low);
    __m128i l8 = _mm_unpacklo_epi8(_mm_and_si128(b, nibble),
                                   _mm_and_si128(_mm_srli_epi16(b, 4), nibble));
    __m256i top = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(x->scales_h),
                                                     _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                   _mm256_set1_epi32(3));
    __m128i top16 = _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
    return _mm_sub_epi16(_mm_or_si128(_mm_cvtepu8_epi16(l8), _mm_slli_epi16(top16, 4)),
                         _mm_set1_epi16(32));
}

/* the 16-bit word w of each 128-bit lane, in all 8 places */
#define PICK_WORD(w) (0x01000100 * (2 * (w) + 1) + 0x00020002 * (w))
#endif

#if defined(__AVX512BW__)
/* 128-bit lane j of the result: word wj of w8 (which holds the same 8 words in every lane),
 * in all 8 places */
static inline __m512i lane_words(__m512i w8, int w0, int w1, int w2, int w3)
{
#define PICK PICK_WORD
    return _mm512_shuffle_epi8(w8,
                               _mm512_set_epi32(PICK(w3), PICK(w3), PICK(w3), PICK(w3), PICK(w2),
                                                PICK(w2), PICK(w2), PICK(w2), PICK(w1), PICK(w1),
                                                PICK(w1), PICK(w1), PICK(w0), PICK(w0), PICK(w0),
                                                PICK(w0)));
#undef PICK
}

/* a 256-bit vector as the low half of a 512-bit one, the high half zero */
static inline __m512i widen(__m256i v)
{
    return _mm512_inserti64x4(_mm512_setzero_si512(), v, 0);
}

/* sum + 128 values' products summed by their 16-bit scales: unsigned weights w0 against the
 * activations y[0..63] scaled by s0, w1 against y[64..127] by s1; sign: the activations of
 * weights whose sign moved onto them (IQ4_XS), in two masks, or NULL */
INLINE __m512i dot128(__m512i sum, __m512i w0, __m512i w1, const int8_t *y, __m512i s0, __m512i s1,
                      const __mmask64 *sign)
{
    __m512i y0 = _mm512_loadu_si512((const void *)y),
            y1 = _mm512_loadu_si512((const void *)(y + 64));
    if (sign) {
        y0 = _mm512_mask_sub_epi8(y0, sign[0], _mm512_setzero_si512(), y0);
        y1 = _mm512_mask_sub_epi8(y1, sign[1], _mm512_setzero_si512(), y1);
    }
    __m512i p0 = _mm512_madd_epi16(_mm512_maddubs_epi16(w0, y0), s0);
    __m512i p1 = _mm512_madd_epi16(_mm512_maddubs_epi16(w1, y1), s1);
    return _mm512_add_epi32(sum, _mm512_add_epi32(p0, p1));
}

/* mr activation rows (a constant after inlining, so the accumulators stay in registers); the
 * super-block's nibbles and scales are unpacked once for all of them */
INLINE void dot_q4_k_like(const unsigned char *w, int64_t K, const act_k *a, int mr, int five,
                          float *out)
{
    const __m512i low = _mm512_set1_epi8(15), sixteen = _mm512_set1_epi8(16);
    const int64_t nb = K / LOOM_QK_K;
    __m512 acc[KERN_MR];
    __m256 accmin[KERN_MR];
    UNROLL
    for (int r = 0; r < mr; r++)
        acc[r] = _mm512_setzero_ps(), accmin[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        k_block x = q4_k_like_block(w, b, five);
        const uint8_t *scales = x.scales, *qs = x.qs, *qh = x.qh;
        uint16_t hd = x.d, hdmin = x.dmin;
        prefetch_ahead(w + (size_t)b * x.bytes, x.bytes);
        /* d and dmin, broadcast */
        __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128((int)(hd | (uint32_t)hdmin << 16)));
        __m512 d = _mm512_broadcastss_ps(dd), dmin = _mm512_broadcastss_ps(_mm_movehdup_ps(dd));
        __m128i sm16 = k_scales_mins(scales);
        __m512i scw = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(sm16));
        /* dmin x the minimums, against the activations' dsums in one FMA a row */
        __m256 wmin = _mm256_mul_ps(
            _mm512_castps512_ps256(dmin),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm16, 8))));
        __m512i hz = _mm512_setzero_si512();
        if (five) { /* qh bit 2 p (2 p + 1) is sub-block 2 p's (2 p + 1's) fifth; the high half
                     * shifted by 2 so that both halves test the same bits */
            __m256i h = _mm256_loadu_si256((const __m256i *)qh);
            hz = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
        }
        __m512i sumi[KERN_MR];
        UNROLL
        for (int r = 0; r < mr; r++)
            sumi[r] = _mm512_setzero_si512();
        for (int i = 0; i < 2; i++) {
            __m512i bytes = _mm512_loadu_si512((const void *)(qs + 64 * i));
            __m512i lo = _mm512_and_si512(bytes, low);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
            if (five) {
                lo = _mm512_mask_add_epi8(
                    lo, _mm512_test_epi8_mask(hz, _mm512_set1_epi8((char)(1 << 4 * i))), lo,
                    sixteen);
                hi = _mm512_mask_add_epi8(
                    hi, _mm512_test_epi8_mask(hz, _mm512_set1_epi8((char)(2 << 4 * i))), hi,
                    sixteen);
            }
            int j = 4 * i; /* low nibbles: sub-blocks j, j + 2; high: j + 1, j + 3 */
            __m512i s_lo = lane_words(scw, j, j, j + 2, j + 2);
            __m512i s_hi = lane_words(scw, j + 1, j + 1, j + 3, j + 3);
            UNROLL
            for (int r = 0; r < mr; r++) {
                sumi[r] = dot128(sumi[r], lo, hi, a[r * nb + b].qs + 128 * i, s_lo, s_hi, NULL);
            }
        }
        UNROLL
        for (int r = 0; r < mr; r++) {
            const act_k *y = &a[r * nb + b];
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[r]),
                                     _mm512_mul_ps(d, _mm512_set1_ps(y->d)), acc[r]);
            accmin[r] = _mm256_fmadd_ps(wmin, _mm256_loadu_ps(y->dsums), accmin[r]);
        }
    }
    UNROLL
    for (int r = 0; r < mr; r++)
        out[r * KERN_NR] = _mm512_reduce_add_ps(acc[r]) - hsum(accmin[r]);
}

INLINE void dot_q6_k(const unsigned char *w, int64_t K, const act_k *a, int mr, float *out)
{
    const __m512i low = _mm512_set1_epi8(15), three = _mm512_set1_epi8(3);
    const int64_t nb = K / LOOM_QK_K;
    __m512 acc[KERN_MR];
    UNROLL
    for (int r = 0; r < mr; r++)
        acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const loom_block_q6_k *x = (const loom_block_q6_k *)(const void *)w + b;
        prefetch_ahead(x, sizeof *x);
        __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x->scales));
        __m512i scw[2] = {_mm512_broadcast_i32x4(_mm256_castsi256_si128(sc16)),
                          _mm512_broadcast_i32x4(_mm256_extracti128_si256(sc16, 1))};
        __m512i sumi[KERN_MR];
        UNROLL
        for (int r = 0; r < mr; r++) { /* the offset of 32: -32 sum_16 scale x activations' sum */
            __m256i bs = _mm256_loadu_si256((const __m256i *)a[r * nb + b].bsums);
            sumi[r] = _mm512_sub_epi32(_mm512_setzero_si512(),
                                       widen(_mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5)));
        }
        for (int half = 0; half < 2; half++) {
            /* ql's low nibbles are values 0-63 of the half, high nibbles 64-127; qh's bit pairs
             * 0-3 are their high bits, 32 values each */
            __m512i l = _mm512_loadu_si512((const void *)(x->ql + 64 * half));
            __m256i h = _mm256_loadu_si256((const __m256i *)(x->qh + 32 * half));
            __m512i hz = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
            __m512i v0 = _mm512_or_si512(_mm512_and_si512(l, low),
                                         _mm512_slli_epi16(_mm512_and_si512(hz, three), 4));
            __m512i v1 = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16(l, 4), low),
                _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hz, 4), three), 4));
            __m512i s0 = lane_words(scw[half], 0, 1, 2, 3), s1 = lane_words(scw[half], 4, 5, 6, 7);
            UNROLL
            for (int r = 0; r < mr; r++) {
                sumi[r] = dot128(sumi[r], v0, v1, a[r * nb + b].qs + 128 * half, s0, s1, NULL);
            }
        }
        float d = CPU_F16(x->d);
        UNROLL
        for (int r = 0; r < mr; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[r]),
                                     _mm512_set1_ps(d * a[r * nb + b].d), acc[r]);
    }
    UNROLL
    for (int r = 0; r < mr; r++)
        out[r * KERN_NR] = _mm512_reduce_add_ps(acc[r]);
}

/* Q3_K and Q2_K: per half of 128 values, 32 bytes of qs hold four runs of 32 as bit pairs
 * 0-3 (Q3_K's third bit in hmask, bit 4 half + run). Broadcast to both halves of a register
 * and shifted by two amounts at once, they give runs 0-1 and 2-3 in value order, as the
 * activations are stored. Q3_K's values are kept as q + 4 (0..7, unsigned): the -4 comes from
 * the activations' sums per 16, as Q6_K's -32 does. */
static inline __m512i shifts16(int a, int b)
{
    return _mm512_inserti64x4(_mm512_set1_epi16((short)a), _mm256_set1_epi16((short)b), 1);
}

INLINE void dot_q2_3_k(const unsigned char *w, int64_t K, const act_k *a, int mr, int three_bit,
                       float *out)
{
    const __m512i mask3 = _mm512_set1_epi8(3), one = _mm512_set1_epi8(1);
    const int64_t nb = K / LOOM_QK_K;
    __m512 acc[KERN_MR];
    __m256 accmin[KERN_MR];
    UNROLL
    for (int r = 0; r < mr; r++)
        acc[r] = _mm512_setzero_ps(), accmin[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const loom_block_q3_k *x3 = (const loom_block_q3_k *)(const void *)w + b;
        const loom_block_q2_k *x2 = (const loom_block_q2_k *)(const void *)w + b;
        const uint8_t *qs = three_bit ? x3->qs : x2->qs;
        prefetch_ahead(qs, three_bit ? sizeof *x3 : sizeof *x2);
        __m256i sc16, mn16 = _mm256_setzero_si256();
        if (three_bit) {
            sc16 = _mm256_cvtepi8_epi16(q3_k_scales(x3->scales));
        } else { /* low nibble the scale, high the minimum */
            __m128i sb = _mm_loadu_si128((const __m128i *)x2->scales);
            sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(sb, _mm_set1_epi8(15)));
            mn16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sb, 4), _mm_set1_epi8(15)));
        }
        __m512i scw[2] = {_mm512_broadcast_i32x4(_mm256_castsi256_si128(sc16)),
                          _mm512_broadcast_i32x4(_mm256_extracti128_si256(sc16, 1))};
        __m512i sumi[KERN_MR];
        UNROLL
        for (int r = 0; r < mr; r++) { /* Q3_K's -4: -4 sum_16 scale x the activations' sum */
            __m256i bs = _mm256_loadu_si256((const __m256i *)a[r * nb + b].bsums);
            sumi[r] = three_bit
                ? _mm512_sub_epi32(_mm512_setzero_si512(),
                                   widen(_mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 2)))
                : _mm512_setzero_si512();
        }
        __m512i hm = three_bit
            ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)x3->hmask))
            : _mm512_setzero_si512();
        for (int half = 0; half < 2; half++) {
            __m512i q = _mm512_broadcast_i64x4(
                _mm256_loadu_si256((const __m256i *)(qs + 32 * half)));
            __m512i v01 = _mm512_and_si512(_mm512_srlv_epi16(q, shifts16(0, 2)), mask3);
            __m512i v23 = _mm512_and_si512(_mm512_srlv_epi16(q, shifts16(4, 6)), mask3);
            if (three_bit) {
                int bit = 4 * half;
                v01 = _mm512_or_si512(
                    v01,
                    _mm512_slli_epi16(
                        _mm512_and_si512(_mm512_srlv_epi16(hm, shifts16(bit, bit + 1)), one), 2));
                v23 = _mm512_or_si512(
                    v23,
                    _mm512_slli_epi16(
                        _mm512_and_si512(_mm512_srlv_epi16(hm, shifts16(bit + 2, bit + 3)), one),
                        2));
            }
            __m512i s0 = lane_words(scw[half], 0, 1, 2, 3), s1 = lane_words(scw[half], 4, 5, 6, 7);
            UNROLL
            for (int r = 0; r < mr; r++) {
                sumi[r] = dot128(sumi[r], v01, v23, a[r * nb + b].qs + 128 * half, s0, s1, NULL);
            }
        }
        float d = CPU_F16(three_bit ? x3->d : x2->d), dmin = three_bit ? 0 : CPU_F16(x2->dmin);
        UNROLL
        for (int r = 0; r < mr; r++) {
            const act_k *y = &a[r * nb + b];
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[r]), _mm512_set1_ps(d * y->d), acc[r]);
            if (!three_bit) /* dmin sum_16 minimum x the activations' sum */
                accmin[r] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(
                        _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)y->bsums), mn16)),
                    _mm256_set1_ps(dmin * y->d), accmin[r]);
        }
    }
    UNROLL
    for (int r = 0; r < mr; r++)
        out[r * KERN_NR] = _mm512_reduce_add_ps(acc[r]) - hsum(accmin[r]);
}

/* Q2_K with VNNI: a scale (4 bits) times a value (2) fits in a byte, so each 128-bit lane,
 * one sub-block of 16 values, looks its values up in a table of 0, s, 2s, 3s (vpshufb) and
 * one vpdpbusd per 64 takes the place of vpmaddubsw, vpmaddwd and vpaddd. The integer sums
 * are dot_q2_3_k's exactly; the tables are built once per super-block for all mr rows. */
#define TARGET_VNNI __attribute__((target("avx512vnni")))
TARGET_VNNI INLINE void dot_q2_k_vnni(const unsigned char *w, int64_t K, const act_k *a, int mr,
                                      float *out)
{
    const __m512i mask3 = _mm512_set1_epi8(3), low4 = _mm512_set1_epi8(15);
    /* per lane: bytes 1 and 3 take s, bytes 2 and 3 take 2s */
    const __m512i at13 = _mm512_broadcast_i32x4(
                      _mm_setr_epi8(0, -1, 0, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
                  at23 = _mm512_broadcast_i32x4(
                      _mm_setr_epi8(0, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0));
    const int64_t nb = K / LOOM_QK_K;
    __m512 acc[KERN_MR];
    __m256 accmin[KERN_MR];
    UNROLL
    for (int r = 0; r < mr; r++)
        acc[r] = _mm512_setzero_ps(), accmin[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const loom_block_q2_k *x = (const loom_block_q2_k *)(const void *)w + b;
        prefetch_ahead(x->qs, sizeof *x);
        __m128i sb = _mm_loadu_si128((const __m128i *)x->scales);
        __m256i mn16 = _mm256_cvtepu8_epi16(
            _mm_and_si128(_mm_srli_epi16(sb, 4), _mm_set1_epi8(15)));
        __m512i sc = _mm512_and_si512(_mm512_broadcast_i32x4(sb), low4);
        __m512i sumi[KERN_MR][2];
        UNROLL
        for (int r = 0; r < mr; r++)
            sumi[r][0] = sumi[r][1] = _mm512_setzero_si512();
        for (int half = 0; half < 2; half++) {
            __m512i q = _mm512_broadcast_i64x4(
                _mm256_loadu_si256((const __m256i *)(x->qs + 32 * half)));
            __m512i v[2] = {_mm512_and_si512(_mm512_srlv_epi16(q, shifts16(0, 2)), mask3),
                            _mm512_and_si512(_mm512_srlv_epi16(q, shifts16(4, 6)), mask3)};
            UNROLL
            for (int i = 0; i < 2; i++) { /* lanes: sub-blocks 8 half + 4 i .. + 3 */
                int s0 = 8 * half + 4 * i;
                const int b0 = s0 * 0x01010101, b1 = b0 + 0x01010101, b2 = b1 + 0x01010101,
                          b3 = b2 + 0x01010101; /* lane l: every byte s0 + l */
                __m512i s = _mm512_shuffle_epi8(sc,
                                                _mm512_set_epi32(b3, b3, b3, b3, b2, b2, b2, b2, b1,
                                                                 b1, b1, b1, b0, b0, b0, b0));
                __m512i table = _mm512_add_epi8(_mm512_and_si512(s, at13),
                                                _mm512_and_si512(_mm512_add_epi8(s, s), at23));
                __m512i wv = _mm512_shuffle_epi8(table, v[i]);
                UNROLL
                for (int r = 0; r < mr; r++)
                    sumi[r][i] = _mm512_dpbusd_epi32(
                        sumi[r][i], wv,
                        _mm512_loadu_si512((const void *)(a[r * nb + b].qs + 128 * half + 64 * i)));
            }
        }
        float d = CPU_F16(x->d), dmin = CPU_F16(x->dmin);
        UNROLL
        for (int r = 0; r < mr; r++) {
            const act_k *y = &a[r * nb + b];
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(sumi[r][0], sumi[r][1])),
                                     _mm512_set1_ps(d * y->d), acc[r]);
            accmin[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(
                                            _mm256_loadu_si256((const __m256i *)y->bsums), mn16)),
                                        _mm256_set1_ps(dmin * y->d), accmin[r]);
        }
    }
    UNROLL
    for (int r = 0; r < mr; r++)
        out[r * KERN_NR] = _mm512_reduce_add_ps(acc[r]) - hsum(accmin[r]);
}

/* IQ4_XS: sub-block s's 16 bytes hold its values 0-15 in the low nibbles and 16-31 in the high
 * ones. A 64-byte load is four sub-blocks; looked up in IQ4's table, the low and high halves
 * are interleaved per 128 bits back into value order. The values are signed, so |w| is the
 * unsigned operand and w's sign moves onto the activations. */
INLINE void dot_iq4_xs(const unsigned char *w, int64_t K, const act_k *a, int mr, float *out)
{
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)loom_iq4_values));
    const __m512i nibble = _mm512_set1_epi8(15);
    const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
    const __m512i second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    const int64_t nb = K / LOOM_QK_K;
    __m512 acc[KERN_MR];
    UNROLL
    for (int r = 0; r < mr; r++)
        acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const loom_block_iq4_xs *x = (const loom_block_iq4_xs *)(const void *)w + b;
        prefetch_ahead(x, sizeof *x);
        __m512i scw = _mm512_broadcast_i32x4(iq4_xs_scales(x));
        __m512i sumi[KERN_MR];
        UNROLL
        for (int r = 0; r < mr; r++)
            sumi[r] = _mm512_setzero_si512();
        for (int i = 0; i < 2; i++) {
            __m512i bytes = _mm512_loadu_si512((const void *)(x->qs + 64 * i));
            __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(bytes, nibble));
            __m512i hi = _mm512_shuffle_epi8(table,
                                             _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble));
            __m512i v0 = _mm512_permutex2var_epi64(lo, first, hi); /* sub-blocks 4i, 4i+1 */
            __m512i v1 = _mm512_permutex2var_epi64(lo, second, hi);
            __m512i u0 = _mm512_abs_epi8(v0), u1 = _mm512_abs_epi8(v1);
            const __mmask64 sign[2] = {_mm512_movepi8_mask(v0), _mm512_movepi8_mask(v1)};
            int j = 4 * i;
            __m512i s0 = lane_words(scw, j, j, j + 1, j + 1);
            __m512i s1 = lane_words(scw, j + 2, j + 2, j + 3, j + 3);
            UNROLL
            for (int r = 0; r < mr; r++) {
                sumi[r] = dot128(sumi[r], u0, u1, a[r * nb + b].qs + 128 * i, s0, s1, sign);
            }
        }
        float d = CPU_F16(x->d);
        UNROLL
        for (int r = 0; r < mr; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[r]),
                                     _mm512_set1_ps(d * a[r * nb + b].d), acc[r]);
    }
    UNROLL
    for (int r = 0; r < mr; r++)
        out[r * KERN_NR] = _mm512_reduce_add_ps(acc[r]);
}
#elif defined(__AVX2__)
/* mr activation rows (a constant after inlining, so the accumulators stay in registers), each
 * super-block's bits unpacked once for all of them */
INLINE void dot_q4_k_like(const unsigned char *w, int64_t K, const act_k *a, int mr, int five,
                          float *out)
{
    const __m256i low = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    const int64_t nb = K / LOOM_QK_K;
    __m256 acc[KERN_MR];
    UNROLL
    for (int r = 0; r < mr; r++)
        acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        k_block x = q4_k_like_block(w, b, five);
        const uint8_t *scales = x.scales, *qs = x.qs, *qh = x.qh;
        prefetch_ahead(w + (size_t)b * x.bytes, x.bytes);
        float d = CPU_F16(x.d);
        __m128i sm16 = k_scales_mins(scales);
        const __m256i scw = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm16));
        /* dmin x the minimums meet the activations' dsums in one FMA a row, into the same
         * accumulator (a minimum per register would not leave room for 4 rows) */
        const __m256 wmin = _mm256_mul_ps(
            _mm256_set1_ps(CPU_F16(x.dmin)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm16, 8))));
        __m256i h = five ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
        __m256i sumi[KERN_MR];
        UNROLL
        for (int r = 0; r < mr; r++)
            sumi[r] = _mm256_setzero_si256();
        UNROLL
        for (int pair = 0; pair < 4; pair++) {
            __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * pair));
            __m256i lo = _mm256_and_si256(bytes, low);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
            if (five) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(h, one), 4));
                hi = _mm256_or_si256(
                    hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 1), one), 4));
                h = _mm256_srli_epi16(h, 2);
            }
            const __m256i s0 = _mm256_shuffle_epi8(scw, _mm256_set1_epi32(PICK_WORD(2 * pair)));
            const __m256i s1 = _mm256_shuffle_epi8(scw, _mm256_set1_epi32(PICK_WORD(2 * pair + 1)));
            UNROLL
            for (int r = 0; r < mr; r++) {
                const int8_t *yq = a[r * nb + b].qs + 64 * pair;
                __m256i p0 = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)yq));
                __m256i p1 = _mm256_maddubs_epi16(hi,
                                                  _mm256_loadu_si256((const __m256i *)(yq + 32)));
                sumi[r] = _mm256_add_epi32(
                    sumi[r],
                    _mm256_add_epi32(_mm256_madd_epi16(p0, s0), _mm256_madd_epi16(p1, s1)));
            }
        }
        UNROLL
        for (int r = 0; r < mr; r++) {
            const act_k *y = &a[r * nb + b];
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_set1_ps(d * y->d), acc[r]);
            acc[r] = _mm256_fnmadd_ps(wmin, _mm256_loadu_ps(y->dsums), acc[r]);
        }
    }
    UNROLL
    for (int r = 0; r < mr; r++)
        out[r * KERN_NR] = hsum(acc[r]);
}

INLINE void dot_q6_k(const unsigned char *w, int64_t K, const act_k *a, int mr, float *out)
{
    const int64_t nb = K / LOOM_QK_K;
    __m256 acc[KERN_MR];
    UNROLL
    for (int r = 0; r < mr; r++)
        acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const loom_block_q6_k *x = (const loom_block_q6_k *)(const void *)w + b;
        prefetch_ahead(x, sizeof *x);
        /* the offset of 32: -32 x the sum over 16-groups of scale x the activations' sum */
        __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x->scales));
        __m256i sumi[KERN_MR];
        UNROLL
        for (int r = 0; r < mr; r++) {
            __m256i bs = _mm256_loadu_si256((const __m256i *)a[r * nb + b].bsums);
            sumi[r] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                       _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5));
        }
        UNROLL
        for (int half = 0; half < 2; half++) {
            __m256i v[4];
            q6_k_runs(x->ql + 64 * half, x->qh + 32 * half, v);
            /* both lanes: scales 8 half .. 8 half + 7; run k takes 2 k (low lane), 2 k + 1 */
            __m256i sch = half ? _mm256_permute4x64_epi64(sc16, 0xee)
                               : _mm256_permute4x64_epi64(sc16, 0x44);
            UNROLL
            for (int k = 0; k < 4; k++) {
                __m256i scv = _mm256_shuffle_epi8(
                    sch,
                    _mm256_set_m128i(_mm_set1_epi32(PICK_WORD(2 * k + 1)),
                                     _mm_set1_epi32(PICK_WORD(2 * k))));
                UNROLL
                for (int r = 0; r < mr; r++) {
                    __m256i q = _mm256_loadu_si256(
                        (const __m256i *)(a[r * nb + b].qs + 128 * half + 32 * k));
                    sumi[r] = _mm256_add_epi32(
                        sumi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(v[k], q), scv));
                }
            }
        }
        float d = CPU_F16(x->d);
        UNROLL
        for (int r = 0; r < mr; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]),
                                     _mm256_set1_ps(d * a[r * nb + b].d), acc[r]);
    }
    UNROLL
    for (int r = 0; r < mr; r++)
        out[r * KERN_NR] = hsum(acc[r]);
}
/* Q3_K and Q2_K (see the AVX-512 kernel): run s of half h is bit pair s of the half's 32 bytes
 * of qs; its two 16-value groups take scales 8 h + 2 s and 8 h + 2 s + 1 */
INLINE void dot_q2_3_k(const unsigned char *w, int64_t K, const act_k *a, int mr, int three_bit,
                       float *out)
{
    const __m256i mask3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    const int64_t nb = K / LOOM_QK_K;
    __m256 acc[KERN_MR];
    UNROLL
    for (int r = 0; r < mr; r++)
        acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const loom_block_q3_k *x3 = (const loom_block_q3_k *)(const void *)w + b;
        const loom_block_q2_k *x2 = (const loom_block_q2_k *)(const void *)w + b;
        const uint8_t *qs = three_bit ? x3->qs : x2->qs;
        prefetch_ahead(qs, three_bit ? sizeof *x3 : sizeof *x2);
        __m256i sc16, mn16 = _mm256_setzero_si256();
        if (three_bit) {
            sc16 = _mm256_cvtepi8_epi16(q3_k_scales(x3->scales));
        } else {
            __m128i sb = _mm_loadu_si128((const __m128i *)x2->scales);
            sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(sb, _mm_set1_epi8(15)));
            mn16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sb, 4), _mm_set1_epi8(15)));
        }
        __m256i sumi[KERN_MR];
        UNROLL
        for (int r = 0; r < mr; r++) {
            __m256i bs = _mm256_loadu_si256((const __m256i *)a[r * nb + b].bsums);
            sumi[r] = three_bit
                ? _mm256_sub_epi32(_mm256_setzero_si256(),
                                   _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 2))
                : _mm256_setzero_si256();
        }
        __m256i hm = three_bit ? _mm256_loadu_si256((const __m256i *)x3->hmask)
                               : _mm256_setzero_si256();
        UNROLL
        for (int half = 0; half < 2; half++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * half));
            /* both lanes: scales 8 half .. 8 half + 7 */
            __m256i sch = half ? _mm256_permute4x64_epi64(sc16, 0xee)
                               : _mm256_permute4x64_epi64(sc16, 0x44);
            UNROLL
            for (int run = 0; run < 4; run++) {
                __m256i v = _mm256_and_si256(_mm256_srli_epi16(q, 2 * run), mask3);
                if (three_bit)
                    v = _mm256_or_si256(
                        v,
                        _mm256_slli_epi16(
                            _mm256_and_si256(_mm256_srli_epi16(hm, 4 * half + run), one), 2));
                __m256i scv = _mm256_shuffle_epi8(
                    sch,
                    _mm256_set_m128i(_mm_set1_epi32(PICK_WORD(2 * run + 1)),
                                     _mm_set1_epi32(PICK_WORD(2 * run))));
                UNROLL
                for (int r = 0; r < mr; r++) {
                    __m256i y = _mm256_loadu_si256(
                        (const __m256i *)(a[r * nb + b].qs + 128 * half + 32 * run));
                    sumi[r] = _mm256_add_epi32(sumi[r],
                                               _mm256_madd_epi16(_mm256_maddubs_epi16(v, y), scv));
                }
            }
        }
        float d = CPU_F16(three_bit ? x3->d : x2->d), dmin = three_bit ? 0 : CPU_F16(x2->dmin);
        UNROLL
        for (int r = 0; r < mr; r++) {
            const act_k *y = &a[r * nb + b];
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_set1_ps(d * y->d), acc[r]);
            if (!three_bit) /* into the same accumulator: registers for 4 rows' minimums
                             * would spill */
                acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(
                                              _mm256_loadu_si256((const __m256i *)y->bsums), mn16)),
                                          _mm256_set1_ps(dmin * y->d), acc[r]);
        }
    }
    UNROLL
    for (int r = 0; r < mr; r++)
        out[r * KERN_NR] = hsum(acc[r]);
}

/* Q2_K with AVX-VNNI: as the AVX-512 kernel, a table of 0, s, 2s, 3s per 16-value lane and
 * one vpdpbusd per 32 values where dot_q2_3_k takes three instructions */
#define TARGET_VNNI __attribute__((target("avxvnni")))
TARGET_VNNI INLINE void dot_q2_k_vnni(const unsigned char *w, int64_t K, const act_k *a, int mr,
                                      float *out)
{
    const __m256i mask3 = _mm256_set1_epi8(3), low4 = _mm256_set1_epi8(15);
    const __m256i at13 = _mm256_broadcastsi128_si256(
                      _mm_setr_epi8(0, -1, 0, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
                  at23 = _mm256_broadcastsi128_si256(
                      _mm_setr_epi8(0, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0));
    const int64_t nb = K / LOOM_QK_K;
    __m256 acc[KERN_MR];
    UNROLL
    for (int r = 0; r < mr; r++)
        acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const loom_block_q2_k *x = (const loom_block_q2_k *)(const void *)w + b;
        prefetch_ahead(x->qs, sizeof *x);
        __m128i sb = _mm_loadu_si128((const __m128i *)x->scales);
        __m256i mn16 = _mm256_cvtepu8_epi16(
            _mm_and_si128(_mm_srli_epi16(sb, 4), _mm_set1_epi8(15)));
        __m256i sc = _mm256_and_si256(_mm256_broadcastsi128_si256(sb), low4);
        __m256i sumi[KERN_MR];
        UNROLL
        for (int r = 0; r < mr; r++)
            sumi[r] = _mm256_setzero_si256();
        UNROLL
        for (int half = 0; half < 2; half++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * half));
            UNROLL
            for (int run = 0; run < 4; run++) { /* lanes: sub-blocks 8 half + 2 run, + 1 */
                int s0 = 8 * half + 2 * run;
                __m256i v = _mm256_and_si256(_mm256_srli_epi16(q, 2 * run), mask3);
                __m256i s = _mm256_shuffle_epi8(
                    sc, _mm256_set_m128i(_mm_set1_epi8((char)(s0 + 1)), _mm_set1_epi8((char)s0)));
                __m256i table = _mm256_add_epi8(_mm256_and_si256(s, at13),
                                                _mm256_and_si256(_mm256_add_epi8(s, s), at23));
                __m256i wv = _mm256_shuffle_epi8(table, v);
                UNROLL
                for (int r = 0; r < mr; r++)
                    sumi[r] = _mm256_dpbusd_avx_epi32(
                        sumi[r], wv,
                        _mm256_loadu_si256(
                            (const __m256i *)(a[r * nb + b].qs + 128 * half + 32 * run)));
            }
        }
        float d = CPU_F16(x->d), dmin = CPU_F16(x->dmin);
        UNROLL
        for (int r = 0; r < mr; r++) {
            const act_k *y = &a[r * nb + b];
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_set1_ps(d * y->d), acc[r]);
            acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(
                                          _mm256_loadu_si256((const __m256i *)y->bsums), mn16)),
                                      _mm256_set1_ps(dmin * y->d), acc[r]);
        }
    }
    UNROLL
    for (int r = 0; r < mr; r++)
        out[r * KERN_NR] = hsum(acc[r]);
}

/* IQ4_XS: a sub-block's 16 bytes, low nibbles in the low lane and high in the high one, are its
 * 32 values in order once looked up; |w| x (x with w's sign), as for Q8_0 */
INLINE void dot_iq4_xs(const unsigned char *w, int64_t K, const act_k *a, int mr, float *out)
{
    const __m256i table = _mm256_broadcastsi128_si256(
        _mm_loadu_si128((const __m128i *)loom_iq4_values));
    const __m128i nibble = _mm_set1_epi8(15);
    const int64_t nb = K / LOOM_QK_K;
    __m256 acc[KERN_MR];
    UNROLL
    for (int r = 0; r < mr; r++)
        acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const loom_block_iq4_xs *x = (const loom_block_iq4_xs *)(const void *)w + b;
        prefetch_ahead(x, sizeof *x);
        __m256i scw = _mm256_broadcastsi128_si256(iq4_xs_scales(x));
        __m256i sumi[KERN_MR];
        UNROLL
        for (int r = 0; r < mr; r++)
            sumi[r] = _mm256_setzero_si256();
        UNROLL8
        for (int sb = 0; sb < 8; sb++) {
            __m128i q = _mm_loadu_si128((const __m128i *)(x->qs + 16 * sb));
            __m256i v = _mm256_shuffle_epi8(
                table,
                _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), nibble),
                                 _mm_and_si128(q, nibble)));
            __m256i u = _mm256_abs_epi8(v);
            __m256i scv = _mm256_shuffle_epi8(scw, _mm256_set1_epi32(PICK_WORD(sb)));
            UNROLL
            for (int r = 0; r < mr; r++) {
                __m256i y = _mm256_loadu_si256((const __m256i *)(a[r * nb + b].qs + 32 * sb));
                sumi[r] = _mm256_add_epi32(
                    sumi[r],
                    _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(y, v)), scv));
            }
        }
        float d = CPU_F16(x->d);
        UNROLL
        for (int r = 0; r < mr; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]),
                                     _mm256_set1_ps(d * a[r * nb + b].d), acc[r]);
    }
    UNROLL
    for (int r = 0; r < mr; r++)
        out[r * KERN_NR] = hsum(acc[r]);
}
#endif

#if defined(__AVX2__)
/* one row, mr made a constant (inlining needs a caller built for the VNNI
 * of the variant, avx512vnni or avxvnni, too) */
TARGET_VNNI static void q2_k_vnni_row(const unsigned char *w, int64_t K, const act_k *a, int mr,
                                      float *out)
{
    switch (mr) {
    case 1: dot_q2_k_vnni(w, K, a, 1, out); break;
    case 2: dot_q2_k_vnni(w, K, a, 2, out); break;
    case 3: dot_q2_k_vnni(w, K, a, 3, out); break;
    default: dot_q2_k_vnni(w, K, a, 4, out); break;
    }
}
#endif

int kern_kq_direct_has(loom_dtype wt)
{
#if defined(__AVX2__)
    return wt == LOOM_Q4_K || wt == LOOM_Q5_K || wt == LOOM_Q6_K || wt == LOOM_Q2_K ||
        wt == LOOM_Q3_K || wt == LOOM_IQ4_XS;
#else
    (void)wt;
    return 0;
#endif
}

_Static_assert(KERN_MR == 4, "kern_kq_direct's cases go up to 4 activation rows");

#if defined(__AVX2__)
/* one row; mr is made a constant for the kernels (see dot_q4_k_like) */
static void direct_row(loom_dtype wt, const unsigned char *w, int64_t K, const act_k *a, int mr,
                       int vnni, float *out)
{
    if (wt == LOOM_Q2_K && vnni && mr > 1) { /* one row: the tables cost more than they save */
        q2_k_vnni_row(w, K, a, mr, out);
        return;
    }
#define BY_MR(call_with)                                                                           \
    switch (mr) {                                                                                  \
    case 1: call_with(1); break;                                                                   \
    case 2: call_with(2); break;                                                                   \
    case 3: call_with(3); break;                                                                   \
    default: call_with(4); break;                                                                  \
    }
#define Q4_K(n) dot_q4_k_like(w, K, a, n, 0, out)
#define Q5_K(n) dot_q4_k_like(w, K, a, n, 1, out)
#define Q6_K(n) dot_q6_k(w, K, a, n, out)
#define Q2_K(n) dot_q2_3_k(w, K, a, n, 0, out)
#define Q3_K(n) dot_q2_3_k(w, K, a, n, 1, out)
#define IQ4_XS(n) dot_iq4_xs(w, K, a, n, out)
    switch (wt) {
    case LOOM_Q4_K: BY_MR(Q4_K) break;
    case LOOM_Q5_K: BY_MR(Q5_K) break;
    case LOOM_Q2_K: BY_MR(Q2_K) break;
    case LOOM_Q3_K: BY_MR(Q3_K) break;
    case LOOM_IQ4_XS: BY_MR(IQ4_XS) break;
    default: BY_MR(Q6_K) break;
    }
#undef Q4_K
#undef Q5_K
#undef Q6_K
#undef Q2_K
#undef Q3_K
#undef IQ4_XS
#undef BY_MR
}
#endif

void kern_kq_direct(loom_dtype wt, const unsigned char *w, size_t row_bytes, int nr, int64_t K,
                    const act_k *a, int mr, int vnni, float *out)
{
#if defined(__AVX2__)
    for (int i = 0; i < nr; i++)
        direct_row(wt, w + (size_t)i * row_bytes, K, a, mr, vnni, out + i);
#else
    (void)wt, (void)w, (void)row_bytes, (void)nr, (void)K, (void)a, (void)mr, (void)vnni, (void)out;
#endif
}
