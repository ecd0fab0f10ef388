/*
 * backends/cpu/kern_bf16.c - BF16 weights with the AVX-512 BF16 dot product (vdpbf16ps), built
 * with -mavx512bf16 into the avx512 variant and used when the CPU has the instruction
 * (LOOM_CPU_DISABLE=bf16 turns it off). Activations are rounded to BF16 once per matmul, as
 * ggml does for BF16 weights; each instruction then does 32 multiply-adds where the F32 path
 * needs a conversion and an FMA per 16. That wins where W's bytes set the pace (decode, a few
 * rows); prefill widens W's blocks to f32 instead (kern_bf16_pairs_widen, below).
 *
 * Weight layout (cpu_prepare_weight, "BF16 pairs"): rows in groups of 16; per group, per pair
 * of columns j (k = 2j, 2j + 1), 16 lanes of 4 bytes: lane r holds row r's elements 2j and
 * 2j + 1. An odd K pads the last pair with zero.
 */
#include "kern.h"

#include <immintrin.h>
#include <string.h>

/* as RI_PREFETCH in kern_template.h: one sequential stream per thread, asked for ahead (1B
 * BF16 decode, Intel Xeon, 2 vCPU: 11.3-11.6 t/s at 8192 bytes, 14.9-15.2 at 1536) */
#define BF16_PREFETCH 1536

void kern_bf16_pack_x(const float *x, int64_t K, uint32_t *pairs)
{
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(x + k));
        _mm512_storeu_si512(pairs + k / 2, (__m512i)v);
    }
    for (; k < K; k += 2) { /* the tail, and a zero partner for an odd K */
        float two[16] = {x[k], k + 1 < K ? x[k + 1] : 0.0f};
        __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(two));
        uint16_t h[16];
        _mm256_storeu_si256((__m256i *)(void *)h, (__m256i)v);
        pairs[k / 2] = (uint32_t)h[0] | (uint32_t)h[1] << 16;
    }
}

INLINE uint32_t load_pair(const uint32_t *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* NG groups x MR activation rows; with one row, four pairs at a time into separate
 * accumulators so that the dot products' latency overlaps */
INLINE void bf16_tile(const unsigned char *w, size_t gstride, int64_t np, const uint32_t *const *x,
                      float *out, const int NG, const int MR)
{
    const int U = MR == 1 ? 4 : 1;
    __m512 acc[KERN_MR][4][4];
    UNROLL
    for (int r = 0; r < MR; r++) {
        UNROLL
        for (int g = 0; g < NG; g++) {
            UNROLL
            for (int u = 0; u < U; u++)
                acc[r][g][u] = _mm512_setzero_ps();
        }
    }
    int64_t j = 0;
    for (; j + U <= np; j += U) {
        UNROLL
        for (int u = 0; u < U; u++) {
            const unsigned char *p = w + (size_t)(j + u) * 64;
            __m512bh wv[4];
            UNROLL
            for (int g = 0; g < NG; g++) {
                __builtin_prefetch(p + (size_t)g * gstride + BF16_PREFETCH);
                wv[g] = (__m512bh)_mm512_loadu_si512(p + (size_t)g * gstride);
            }
            UNROLL
            for (int r = 0; r < MR; r++) {
                __m512bh xb = (__m512bh)_mm512_set1_epi32((int)load_pair(x[r] + j + u));
                UNROLL
                for (int g = 0; g < NG; g++)
                    acc[r][g][u] = _mm512_dpbf16_ps(acc[r][g][u], wv[g], xb);
            }
        }
    }
    for (; j < np; j++) {
        const unsigned char *p = w + (size_t)j * 64;
        UNROLL
        for (int g = 0; g < NG; g++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(p + (size_t)g * gstride);
            UNROLL
            for (int r = 0; r < MR; r++)
                acc[r][g][0] = _mm512_dpbf16_ps(
                    acc[r][g][0], wv, (__m512bh)_mm512_set1_epi32((int)load_pair(x[r] + j)));
        }
    }
    UNROLL
    for (int r = 0; r < MR; r++) {
        UNROLL
        for (int g = 0; g < NG; g++) {
            __m512 s = acc[r][g][0];
            UNROLL
            for (int u = 1; u < U; u++)
                s = _mm512_add_ps(s, acc[r][g][u]);
            _mm512_storeu_ps(out + (r * NG + g) * 16, s);
        }
    }
}

#define BF16_MR(NG)                                                                                \
    switch (mr) {                                                                                  \
    case 1: bf16_tile(w, gstride, np, x, out, NG, 1); break;                                       \
    case 2: bf16_tile(w, gstride, np, x, out, NG, 2); break;                                       \
    case 3: bf16_tile(w, gstride, np, x, out, NG, 3); break;                                       \
    default: bf16_tile(w, gstride, np, x, out, NG, 4); break;                                      \
    }

void kern_bf16_dp(const unsigned char *w, size_t gstride, int ng, int64_t K,
                  const uint32_t *const *x, int mr, float *out)
{
    int64_t np = (K + 1) / 2;
    switch (ng) {
    case 1: BF16_MR(1) break;
    case 2: BF16_MR(2) break;
    case 3: BF16_MR(3) break;
    default: BF16_MR(4) break;
    }
}

/* Prefill widens instead: vdpbf16ps issues at half the rate of the f32 FMA on the Xeons
 * measured (Emerald Rapids: one per 2 cycles against two FMAs per cycle), so a compute-bound
 * matmul does better to widen a block of W once and run the f32 tiles over it. Column k of the
 * block goes to wf + k ng 16, as kern_bf16_ri_widen's. */
void kern_bf16_pairs_widen(const unsigned char *w, size_t gstride, int ng, int64_t k0, int64_t kc,
                           float *wf)
{
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int g = 0; g < ng; g++) {
        const unsigned char *p = w + (size_t)g * gstride + (size_t)(k0 / 2) * 64;
        for (int64_t k = 0; k < kc; k += 2, p += 64) {
            __m512i v = _mm512_loadu_si512(p);
            _mm512_storeu_ps(wf + (k * ng + g) * 16, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
            if (k + 1 < kc)
                _mm512_storeu_ps(wf + ((k + 1) * ng + g) * 16,
                                 _mm512_castsi512_ps(_mm512_and_si512(v, high)));
        }
    }
}
