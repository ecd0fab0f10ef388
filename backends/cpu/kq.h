/*
 * backends/cpu/kq.h - what the two halves of the ABI 1.2 weight types' kernels share: kern_kq.c
 * (rows unpacked into one shape) and kern_kq_direct.c (rows dotted in the file's layout).
 */
#ifndef LOOM_CPU_KQ_H
#define LOOM_CPU_KQ_H

#include "kern.h"

#include <loom/quants.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* Super-block b of a Q4_K or Q5_K row (the same but for Q5_K's fifth bits, qh) */
typedef struct k_block {
    const uint8_t *scales, *qs, *qh; /* qh: NULL for Q4_K */
    uint16_t d, dmin;
    size_t bytes;
} k_block;

static inline k_block q4_k_like_block(const unsigned char *w, int64_t b, int five)
{
    if (five) {
        const loom_block_q5_k *x = (const loom_block_q5_k *)(const void *)w + b;
        return (k_block){x->scales, x->qs, x->qh, x->d, x->dmin, sizeof *x};
    }
    const loom_block_q4_k *x = (const loom_block_q4_k *)(const void *)w + b;
    return (k_block){x->scales, x->qs, NULL, x->d, x->dmin, sizeof *x};
}

#if defined(__AVX2__)
static inline float hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 128 values of a Q6_K half-block as four runs of 32, 0..63 (the offset of 32 not taken):
 * run k is nibble k / 2 of ql[l + 32 (k % 2)] with bit pair k of qh[l] above it */
static inline void q6_k_runs(const uint8_t *ql, const uint8_t *qh, __m256i v[4])
{
    const __m256i low = _mm256_set1_epi8(15), high2 = _mm256_set1_epi8(0x30);
    __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
    __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
    __m256i h = _mm256_loadu_si256((const __m256i *)qh);
    /* bit pair k moved to bits 4-5: one shift (none for k = 2) and one mask each */
    v[0] = _mm256_or_si256(_mm256_and_si256(l0, low),
                           _mm256_and_si256(_mm256_slli_epi16(h, 4), high2));
    v[1] = _mm256_or_si256(_mm256_and_si256(l1, low),
                           _mm256_and_si256(_mm256_slli_epi16(h, 2), high2));
    v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                           _mm256_and_si256(h, high2));
    v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                           _mm256_and_si256(_mm256_srli_epi16(h, 2), high2));
}
#endif

#endif
