/*
 * backends/cpu/kern_kq.c - matmul kernels for the ABI 1.2 weight types: Q2_K..Q6_K, IQ4_XS,
 * Q5_0, Q5_1 and IQ4_NL (interface in kern.h).
 *
 * Each of these formats packs its values differently, but all come down to small integers times
 * a scale per 16 or 32 values, sometimes less a minimum. So a weight row is first unpacked,
 * SIMD where it is hot, into one shape (kq_row): per 32 values, the values as int8 with any
 * offset folded in (Q6_K's -32, Q3_K's -4, IQ4's table), their integer scales and minimums per
 * 16 (both halves alike where the format has one per 32), and the float factors d and dmin. One
 * integer kernel then takes every type: against activations quantised to int8 per 32 (act_block,
 * as the interleaved Q4_0 kernel uses), each 32 values cost one u8 x s8 multiply-add (|v| times
 * x with v's sign), one 16-bit multiply-add by the scales, and one FMA into a float accumulator:
 *   dot = sum over chunks c of  d_x(c) [ d(c) sum_16 sc (v . x) - dmin(c) sum_16 mn (sum x) ].
 * A chunk of weight rows is unpacked once and then met by every tile of activation rows, so
 * prefill pays for the unpacking once per row, not once per activation row. The avx2 and
 * avx512 variants dot Q2_K..Q6_K and IQ4_XS in the file's layout instead (kern_kq_direct.c).
 */
#include "kq.h"
#include "rows.h"


#include <math.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

int kern_kq_handles(loom_dtype wt)
{
    switch (wt) {
    case LOOM_Q2_K:
    case LOOM_Q3_K:
    case LOOM_Q4_K:
    case LOOM_Q5_K:
    case LOOM_Q6_K:
    case LOOM_IQ4_XS:
    case LOOM_Q5_0:
    case LOOM_Q5_1:
    case LOOM_IQ4_NL: return 1;
    default: return 0;
    }
}

int kern_kq_has_min(loom_dtype wt)
{
    return wt == LOOM_Q2_K || wt == LOOM_Q4_K || wt == LOOM_Q5_K || wt == LOOM_Q5_1;
}

/* ---- Unpacking ------------------------------------------------------------------------------ */

/* chunk c's two 16-value scales (and minimums, when the type has them) */
static inline void set_scales(kq_row *r, int64_t c, int s0, int s1, int m0, int m1, int has_min)
{
#if defined(__AVX2__)
    _mm256_storeu_si256((__m256i *)r->c[c].sc,
                        _mm256_set_m128i(_mm_set1_epi16((short)s1), _mm_set1_epi16((short)s0)));
    if (has_min)
        _mm256_storeu_si256((__m256i *)r->c[c].mn,
                            _mm256_set_m128i(_mm_set1_epi16((short)m1), _mm_set1_epi16((short)m0)));
#elif defined(KERN_SSE2)
    _mm_storeu_si128((__m128i *)r->c[c].sc, _mm_set1_epi16((short)s0));
    _mm_storeu_si128((__m128i *)(r->c[c].sc + 8), _mm_set1_epi16((short)s1));
    if (has_min) {
        _mm_storeu_si128((__m128i *)r->c[c].mn, _mm_set1_epi16((short)m0));
        _mm_storeu_si128((__m128i *)(r->c[c].mn + 8), _mm_set1_epi16((short)m1));
    }
#else
    for (int i = 0; i < 8; i++) {
        r->c[c].sc[i] = (int16_t)s0, r->c[c].sc[8 + i] = (int16_t)s1;
        if (has_min)
            r->c[c].mn[i] = (int16_t)m0, r->c[c].mn[8 + i] = (int16_t)m1;
    }
#endif
}

/* 32 nibbles, low then high, of 16 bytes (the 32-element types' order), through IQ4's table */
static void iq4_nibbles(const uint8_t *q, int8_t *v)
{
#if defined(__AVX2__)
    const __m256i table = _mm256_broadcastsi128_si256(
        _mm_loadu_si128((const __m128i *)loom_iq4_values));
    __m128i b = _mm_loadu_si128((const __m128i *)q), low = _mm_set1_epi8(15);
    __m256i idx = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
    _mm256_storeu_si256((__m256i *)v, _mm256_shuffle_epi8(table, idx));
#else
    for (int j = 0; j < 16; j++) {
        v[j] = loom_iq4_values[q[j] & 15];
        v[j + 16] = loom_iq4_values[q[j] >> 4];
    }
#endif
}

/* Q5_0 / Q5_1: nibbles plus the fifth bit of each element from the 32-bit qh, plus offset */
static void q5_values(const uint8_t *q, const uint8_t qh[4], int offset, int8_t *v)
{
#if defined(__AVX2__)
    __m128i b = _mm_loadu_si128((const __m128i *)q), low = _mm_set1_epi8(15);
    __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
    uint32_t bits;
    memcpy(&bits, qh, 4);
    /* byte j takes qh's byte j / 8, keeps bit j % 8 */
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2,
                                          2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201ll);
    __m256i h = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), pick);
    h = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit), _mm256_set1_epi8(16));
    __m256i val = _mm256_add_epi8(_mm256_or_si256(nib, h), _mm256_set1_epi8((char)offset));
    _mm256_storeu_si256((__m256i *)v, val);
#elif defined(KERN_SSE2)
    /* element j's fifth bit is bit j of qh: each byte of a half takes the qh byte its eight
     * elements' bits are in (a multiply spreads it), and keeps its own bit */
    __m128i b = _mm_loadu_si128((const __m128i *)q), low = _mm_set1_epi8(15);
    const __m128i bit = _mm_set1_epi64x(0x8040201008040201ll), sixteen = _mm_set1_epi8(16);
    const uint64_t spread = 0x0101010101010101ull;
    __m128i nib[2] = {_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low)};
    for (int half = 0; half < 2; half++) {
        __m128i h = _mm_set_epi64x((long long)(qh[2 * half + 1] * spread),
                                   (long long)(qh[2 * half] * spread));
        h = _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(h, bit), bit), sixteen);
        __m128i val = _mm_add_epi8(_mm_or_si128(nib[half], h), _mm_set1_epi8((char)offset));
        _mm_storeu_si128((__m128i *)(v + 16 * half), val);
    }
#else
    for (int j = 0; j < 16; j++) {
        v[j] = (int8_t)(((q[j] & 15) | loom_q5_high(qh, j) << 4) + offset);
        v[j + 16] = (int8_t)(((q[j] >> 4) | loom_q5_high(qh, j + 16) << 4) + offset);
    }
#endif
}

static void unpack_q4_k_like(const unsigned char *w, int64_t K, kq_row *r, int five)
{
    for (int64_t b = 0; b < K / LOOM_QK_K; b++) {
        k_block x = q4_k_like_block(w, b, five);
        const uint8_t *scales = x.scales, *qs = x.qs, *qh = x.qh;
        float fd = CPU_F16(x.d), fmin = CPU_F16(x.dmin);
        for (int pair = 0; pair < 4; pair++) {
            int64_t c = b * 8 + 2 * pair;
            const uint8_t *q = qs + 32 * pair;
#if defined(__AVX2__)
            const __m256i low = _mm256_set1_epi8(15);
            __m256i bytes = _mm256_loadu_si256((const __m256i *)q);
            __m256i lo = _mm256_and_si256(bytes, low);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
            if (five) { /* bit 2 pair (and 2 pair + 1) of qh[l] is element l's fifth */
                __m256i h = _mm256_loadu_si256((const __m256i *)qh), one = _mm256_set1_epi8(1);
                __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(h, 2 * pair), one);
                __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(h, 2 * pair + 1), one);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(h0, 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(h1, 4));
            }
            _mm256_storeu_si256((__m256i *)r->c[c].v, lo);
            _mm256_storeu_si256((__m256i *)r->c[c + 1].v, hi);
#elif defined(KERN_SSE2)
            const __m128i low = _mm_set1_epi8(15), one = _mm_set1_epi8(1);
            for (int part = 0; part < 2; part++) {
                __m128i bytes = _mm_loadu_si128((const __m128i *)(q + 16 * part));
                __m128i lo = _mm_and_si128(bytes, low);
                __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
                if (five) { /* as above */
                    __m128i h = _mm_loadu_si128((const __m128i *)(qh + 16 * part));
                    __m128i h0 = _mm_and_si128(_mm_srli_epi16(h, 2 * pair), one);
                    __m128i h1 = _mm_and_si128(_mm_srli_epi16(h, 2 * pair + 1), one);
                    lo = _mm_or_si128(lo, _mm_slli_epi16(h0, 4));
                    hi = _mm_or_si128(hi, _mm_slli_epi16(h1, 4));
                }
                _mm_storeu_si128((__m128i *)(r->c[c].v + 16 * part), lo);
                _mm_storeu_si128((__m128i *)(r->c[c + 1].v + 16 * part), hi);
            }
#else
            for (int l = 0; l < 32; l++) {
                int h0 = five ? ((qh[l] >> (2 * pair)) & 1) << 4 : 0;
                int h1 = five ? ((qh[l] >> (2 * pair + 1)) & 1) << 4 : 0;
                r->c[c].v[l] = (int8_t)((q[l] & 15) | h0);
                r->c[c + 1].v[l] = (int8_t)((q[l] >> 4) | h1);
            }
#endif
            for (int h = 0; h < 2; h++) {
                int sc, m;
                loom_k_scale_min(scales, 2 * pair + h, &sc, &m);
                set_scales(r, c + h, sc, sc, m, m, 1);
                r->d[c + h] = fd, r->dmin[c + h] = fmin;
            }
        }
    }
}

static void unpack_q6_k(const unsigned char *w, int64_t K, kq_row *r)
{
    for (int64_t b = 0; b < K / LOOM_QK_K; b++) {
        const loom_block_q6_k *x = (const loom_block_q6_k *)(const void *)w + b;
        float d = CPU_F16(x->d);
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = x->ql + 64 * half, *qh = x->qh + 32 * half;
            const int8_t *sc = x->scales + 8 * half;
            int64_t c = b * 8 + 4 * half;
            /* chunk k of the half: nibble k / 2 of ql[l + 32 (k % 2)], bit pair k of qh[l] */
#if defined(__AVX2__)
            __m256i v[4];
            q6_k_runs(ql, qh, v);
            for (int k = 0; k < 4; k++)
                _mm256_storeu_si256((__m256i *)r->c[c + k].v,
                                    _mm256_sub_epi8(v[k], _mm256_set1_epi8(32)));
#elif defined(KERN_SSE2)
            const __m128i low = _mm_set1_epi8(15), three = _mm_set1_epi8(3);
            for (int part = 0; part < 2; part++) {
                __m128i l0 = _mm_loadu_si128((const __m128i *)(ql + 16 * part));
                __m128i l1 = _mm_loadu_si128((const __m128i *)(ql + 32 + 16 * part));
                __m128i h = _mm_loadu_si128((const __m128i *)(qh + 16 * part));
                __m128i nib[4] = {_mm_and_si128(l0, low), _mm_and_si128(l1, low),
                                  _mm_and_si128(_mm_srli_epi16(l0, 4), low),
                                  _mm_and_si128(_mm_srli_epi16(l1, 4), low)};
                for (int k = 0; k < 4; k++) {
                    __m128i hk = _mm_and_si128(_mm_srli_epi16(h, 2 * k), three);
                    __m128i val = _mm_or_si128(nib[k], _mm_slli_epi16(hk, 4));
                    _mm_storeu_si128((__m128i *)(r->c[c + k].v + 16 * part),
                                     _mm_sub_epi8(val, _mm_set1_epi8(32)));
                }
            }
#else
            for (int l = 0; l < 32; l++)
                for (int k = 0; k < 4; k++) {
                    int nibble = k < 2 ? ql[l + 32 * k] & 15 : ql[l + 32 * (k - 2)] >> 4;
                    r->c[c + k].v[l] = (int8_t)((nibble | ((qh[l] >> (2 * k)) & 3) << 4) - 32);
                }
#endif
            for (int k = 0; k < 4; k++) {
                set_scales(r, c + k, sc[2 * k], sc[2 * k + 1], 0, 0, 0);
                r->d[c + k] = d;
            }
        }
    }
}

static void unpack_q3_k(const unsigned char *w, int64_t K, kq_row *r)
{
    for (int64_t b = 0; b < K / LOOM_QK_K; b++) {
        const loom_block_q3_k *x = (const loom_block_q3_k *)(const void *)w + b;
        float d = CPU_F16(x->d);
        int bit = 0;
        for (int half = 0; half < 2; half++) {
            const uint8_t *q = x->qs + 32 * half;
            for (int s = 0; s < 4; s++, bit++) {
                int64_t c = b * 8 + 4 * half + s;
#if defined(__AVX2__)
                const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
                __m256i lo = _mm256_and_si256(
                    _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)q), 2 * s), three);
                __m256i hb = _mm256_and_si256(
                    _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)x->hmask), bit), one);
                /* a clear high bit subtracts 4 */
                __m256i minus = _mm256_slli_epi16(_mm256_xor_si256(hb, one), 2);
                _mm256_storeu_si256((__m256i *)r->c[c].v, _mm256_sub_epi8(lo, minus));
#elif defined(KERN_SSE2)
                const __m128i three = _mm_set1_epi8(3), one = _mm_set1_epi8(1);
                for (int part = 0; part < 2; part++) { /* as above, 16 at a time */
                    __m128i lo = _mm_and_si128(
                        _mm_srli_epi16(_mm_loadu_si128((const __m128i *)(q + 16 * part)), 2 * s),
                        three);
                    __m128i hb = _mm_and_si128(
                        _mm_srli_epi16(_mm_loadu_si128((const __m128i *)(x->hmask + 16 * part)),
                                       bit),
                        one);
                    __m128i minus = _mm_slli_epi16(_mm_xor_si128(hb, one), 2);
                    _mm_storeu_si128((__m128i *)(r->c[c].v + 16 * part), _mm_sub_epi8(lo, minus));
                }
#else
                for (int k = 0; k < 32; k++)
                    r->c[c].v[k] = (int8_t)(((q[k] >> (2 * s)) & 3) -
                                            (((x->hmask[k] >> bit) & 1) ? 0 : 4));
#endif
                set_scales(r, c, loom_q3_k_scale(x->scales, 8 * half + 2 * s),
                           loom_q3_k_scale(x->scales, 8 * half + 2 * s + 1), 0, 0, 0);
                r->d[c] = d;
            }
        }
    }
}

static void unpack_q2_k(const unsigned char *w, int64_t K, kq_row *r)
{
    for (int64_t b = 0; b < K / LOOM_QK_K; b++) {
        const loom_block_q2_k *x = (const loom_block_q2_k *)(const void *)w + b;
        float d = CPU_F16(x->d), dmin = CPU_F16(x->dmin);
        for (int half = 0; half < 2; half++) {
            const uint8_t *q = x->qs + 32 * half;
            for (int s = 0; s < 4; s++) {
                int64_t c = b * 8 + 4 * half + s;
#if defined(__AVX2__)
                __m256i v = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)q), 2 * s);
                _mm256_storeu_si256((__m256i *)r->c[c].v, _mm256_and_si256(v, _mm256_set1_epi8(3)));
#elif defined(KERN_SSE2)
                for (int part = 0; part < 2; part++) {
                    __m128i v = _mm_srli_epi16(_mm_loadu_si128((const __m128i *)(q + 16 * part)),
                                               2 * s);
                    _mm_storeu_si128((__m128i *)(r->c[c].v + 16 * part),
                                     _mm_and_si128(v, _mm_set1_epi8(3)));
                }
#else
                for (int k = 0; k < 32; k++)
                    r->c[c].v[k] = (int8_t)((q[k] >> (2 * s)) & 3);
#endif
                uint8_t s0 = x->scales[8 * half + 2 * s], s1 = x->scales[8 * half + 2 * s + 1];
                set_scales(r, c, s0 & 15, s1 & 15, s0 >> 4, s1 >> 4, 1);
                r->d[c] = d, r->dmin[c] = dmin;
            }
        }
    }
}

static void unpack_iq4_xs(const unsigned char *w, int64_t K, kq_row *r)
{
    for (int64_t b = 0; b < K / LOOM_QK_K; b++) {
        const loom_block_iq4_xs *x = (const loom_block_iq4_xs *)(const void *)w + b;
        float d = CPU_F16(x->d);
        for (int s = 0; s < 8; s++) {
            int64_t c = b * 8 + s;
            iq4_nibbles(x->qs + 16 * s, r->c[c].v);
            int ls = ((x->scales_l[s / 2] >> (4 * (s % 2))) & 15) |
                ((x->scales_h >> (2 * s)) & 3) << 4;
            set_scales(r, c, ls - 32, ls - 32, 0, 0, 0);
            r->d[c] = d;
        }
    }
}

static void unpack_32(loom_dtype wt, const unsigned char *w, int64_t K, kq_row *r)
{
    for (int64_t c = 0; c < K / LOOM_QK; c++) {
        if (wt == LOOM_IQ4_NL) {
            const loom_block_iq4_nl *x = (const loom_block_iq4_nl *)(const void *)w + c;
            iq4_nibbles(x->qs, r->c[c].v);
            r->d[c] = CPU_F16(x->d);
        } else { /* Q5_0 (q - 16) d, Q5_1 q d + m */
            const uint8_t *qs, *qh;
            if (wt == LOOM_Q5_0) {
                const loom_block_q5_0 *x = (const loom_block_q5_0 *)(const void *)w + c;
                qs = x->qs, qh = x->qh, r->d[c] = CPU_F16(x->d);
            } else {
                const loom_block_q5_1 *x = (const loom_block_q5_1 *)(const void *)w + c;
                qs = x->qs, qh = x->qh, r->d[c] = CPU_F16(x->d);
                r->dmin[c] = -CPU_F16(x->m); /* + m sum(x): a minimum of -m */
            }
            q5_values(qs, qh, wt == LOOM_Q5_0 ? -16 : 0, r->c[c].v);
        }
        set_scales(r, c, 1, 1, 1, 1, wt == LOOM_Q5_1);
    }
}

void kern_kq_unpack(loom_dtype wt, const unsigned char *w, int64_t K, kq_row *r)
{
    switch (wt) {
    case LOOM_Q4_K: unpack_q4_k_like(w, K, r, 0); break;
    case LOOM_Q5_K: unpack_q4_k_like(w, K, r, 1); break;
    case LOOM_Q6_K: unpack_q6_k(w, K, r); break;
    case LOOM_Q3_K: unpack_q3_k(w, K, r); break;
    case LOOM_Q2_K: unpack_q2_k(w, K, r); break;
    case LOOM_IQ4_XS: unpack_iq4_xs(w, K, r); break;
    default: unpack_32(wt, w, K, r); break;
    }
}

/* ---- The dot products ----------------------------------------------------------------------- */

#if defined(__AVX2__)
/* one weight row against mr <= KERN_MR activation rows, nb chunks each. Inlined with a constant
 * mr (dot_row_n below), so that the accumulators stay in registers: with mr known only at run
 * time GCC kept them on the stack, and each chunk waited on a store and a reload (measured: a
 * third of q4_K decode's time). */
INLINE void dot_row(const kq_row *w, int has_min, const act_block *a, int64_t nb, int mr,
                    float *out)
{
    __m256 acc[KERN_MR] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                           _mm256_setzero_ps()};
    const __m256i ones = _mm256_set1_epi8(1);
    for (int64_t c = 0; c < nb; c++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)w->c[c].v);
        __m256i av = _mm256_abs_epi8(v), sc = _mm256_loadu_si256((const __m256i *)w->c[c].sc);
        __m256i mn = has_min ? _mm256_loadu_si256((const __m256i *)w->c[c].mn) : sc;
        UNROLL
        for (int r = 0; r < mr; r++) {
            const act_block *x = &a[r * nb + c];
            __m256i q = _mm256_loadu_si256((const __m256i *)x->qs);
            __m256i p = _mm256_maddubs_epi16(av, _mm256_sign_epi8(q, v));
            __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, sc));
            acc[r] = _mm256_fmadd_ps(s, _mm256_set1_ps(w->d[c] * x->d), acc[r]);
            if (has_min) {
                __m256i qsum = _mm256_madd_epi16(_mm256_maddubs_epi16(ones, q), mn);
                acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(qsum),
                                          _mm256_set1_ps(w->dmin[c] * x->d), acc[r]);
            }
        }
    }
    UNROLL
    for (int r = 0; r < mr; r++)
        out[r * KERN_NR] = hsum(acc[r]);
}
#elif defined(KERN_SSE2)
/* int8 lanes as int16: each byte doubled, then shifted down with its sign */
static inline __m128i widen_lo(__m128i v)
{
    return _mm_srai_epi16(_mm_unpacklo_epi8(v, v), 8);
}

static inline __m128i widen_hi(__m128i v)
{
    return _mm_srai_epi16(_mm_unpackhi_epi8(v, v), 8);
}

/* SSE2 has no u8 x s8 multiply-add (SSSE3's), so both sides go to int16 for pmaddwd; the
 * scales fold into the weights' int16 values first (|v sc| <= 4096 for every type here),
 * which leaves one pmaddwd per 8 values. Accumulators as in the AVX2 form, a constant mr. */
INLINE void dot_row(const kq_row *w, int has_min, const act_block *a, int64_t nb, int mr,
                    float *out)
{
    __m128 acc[KERN_MR] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
    for (int64_t c = 0; c < nb; c++) {
        const kq_chunk *k = &w->c[c];
        __m128i v0 = _mm_loadu_si128((const __m128i *)k->v);
        __m128i v1 = _mm_loadu_si128((const __m128i *)(k->v + 16));
        __m128i sc0 = _mm_loadu_si128((const __m128i *)k->sc);
        __m128i sc1 = _mm_loadu_si128((const __m128i *)(k->sc + 8));
        __m128i w0 = _mm_mullo_epi16(widen_lo(v0), sc0), w1 = _mm_mullo_epi16(widen_hi(v0), sc0);
        __m128i w2 = _mm_mullo_epi16(widen_lo(v1), sc1), w3 = _mm_mullo_epi16(widen_hi(v1), sc1);
        __m128i mn0 = has_min ? _mm_loadu_si128((const __m128i *)k->mn) : sc0;
        __m128i mn1 = has_min ? _mm_loadu_si128((const __m128i *)(k->mn + 8)) : sc1;
        UNROLL
        for (int r = 0; r < mr; r++) {
            const act_block *x = &a[r * nb + c];
            __m128i q0 = _mm_loadu_si128((const __m128i *)x->qs);
            __m128i q1 = _mm_loadu_si128((const __m128i *)(x->qs + 16));
            __m128i x0 = widen_lo(q0), x1 = widen_hi(q0), x2 = widen_lo(q1), x3 = widen_hi(q1);
            __m128i dot = _mm_add_epi32(
                _mm_add_epi32(_mm_madd_epi16(w0, x0), _mm_madd_epi16(w1, x1)),
                _mm_add_epi32(_mm_madd_epi16(w2, x2), _mm_madd_epi16(w3, x3)));
            acc[r] = _mm_add_ps(acc[r],
                                _mm_mul_ps(_mm_cvtepi32_ps(dot), _mm_set1_ps(w->d[c] * x->d)));
            if (has_min) { /* the minimums by the sums of x per 16 */
                __m128i m = _mm_add_epi32(_mm_madd_epi16(_mm_add_epi16(x0, x1), mn0),
                                          _mm_madd_epi16(_mm_add_epi16(x2, x3), mn1));
                acc[r] = _mm_sub_ps(acc[r],
                                    _mm_mul_ps(_mm_cvtepi32_ps(m), _mm_set1_ps(w->dmin[c] * x->d)));
            }
        }
    }
    UNROLL
    for (int r = 0; r < mr; r++)
        out[r * KERN_NR] = hsum128(acc[r]);
}
#else
static void dot_row(const kq_row *w, int has_min, const act_block *a, int64_t nb, int mr,
                    float *out)
{
    for (int r = 0; r < mr; r++) {
        float sum = 0.0f;
        for (int64_t c = 0; c < nb; c++) {
            const act_block *x = &a[r * nb + c];
            int dot[2] = {0, 0}, xs[2] = {0, 0};
            for (int k = 0; k < 32; k++) {
                dot[k / 16] += w->c[c].v[k] * x->qs[k];
                xs[k / 16] += x->qs[k];
            }
            int isum = dot[0] * w->c[c].sc[0] + dot[1] * w->c[c].sc[8];
            sum += w->d[c] * x->d * (float)isum;
            if (has_min)
                sum -= w->dmin[c] * x->d * (float)(xs[0] * w->c[c].mn[0] + xs[1] * w->c[c].mn[8]);
        }
        out[r * KERN_NR] = sum;
    }
}
#endif

#if defined(__AVX2__)
/* decode: nr rows against one activation row, the rows' chunks interleaved so that their
 * independent accumulations overlap */
INLINE void dot_rows_1(const kq_row *w, int nr, int has_min, const act_block *a, int64_t nb,
                       float *out)
{
    enum { R = 4 };
    __m256 acc[R] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    const __m256i ones = _mm256_set1_epi8(1);
    for (int64_t c = 0; c < nb; c++) {
        const act_block *x = &a[c];
        __m256i q = _mm256_loadu_si256((const __m256i *)x->qs);
        __m256i qsum = has_min ? _mm256_maddubs_epi16(ones, q) : ones;
        UNROLL
        for (int i = 0; i < R; i++) {
            if (i >= nr)
                break;
            const kq_chunk *k = &w[i].c[c];
            __m256i v = _mm256_loadu_si256((const __m256i *)k->v);
            __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(q, v));
            __m256 s = _mm256_cvtepi32_ps(
                _mm256_madd_epi16(p, _mm256_loadu_si256((const __m256i *)k->sc)));
            acc[i] = _mm256_fmadd_ps(s, _mm256_set1_ps(w[i].d[c] * x->d), acc[i]);
            if (has_min) {
                __m256i m = _mm256_madd_epi16(qsum, _mm256_loadu_si256((const __m256i *)k->mn));
                acc[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(m),
                                          _mm256_set1_ps(w[i].dmin[c] * x->d), acc[i]);
            }
        }
    }
    for (int i = 0; i < nr && i < R; i++)
        out[i] = hsum(acc[i]);
}
#endif

/* mr as a constant: see dot_row */
static void dot_row_n(const kq_row *w, int has_min, const act_block *a, int64_t nb, int mr,
                      float *out)
{
    switch (mr) {
    case 1: dot_row(w, has_min, a, nb, 1, out); break;
    case 2: dot_row(w, has_min, a, nb, 2, out); break;
    case 3: dot_row(w, has_min, a, nb, 3, out); break;
    default: dot_row(w, has_min, a, nb, KERN_MR, out); break;
    }
}

void kern_kq(const kq_row *w, int nr, int has_min, const act_block *a, int64_t nb, int mr,
             float *out)
{
#if defined(__AVX2__)
    if (mr == 1) {
        for (int i = 0; i < nr; i += 4) {
            if (has_min)
                dot_rows_1(w + i, nr - i, 1, a, nb, out + i);
            else
                dot_rows_1(w + i, nr - i, 0, a, nb, out + i);
        }
        return;
    }
#endif
    for (int i = 0; i < nr; i++)
        dot_row_n(&w[i], has_min, a, nb, mr, out + i);
}
