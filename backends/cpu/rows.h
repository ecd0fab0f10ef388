/*
 * backends/cpu/rows.h - converting rows between a tensor dtype and f32, with the widest SIMD
 * the variant was built for (F16C and AVX-512 conversions in registers), falling back to the
 * reference scalar conversions of backend.h. Included by the variant translation units only.
 */
#ifndef LOOM_CPU_ROWS_H
#define LOOM_CPU_ROWS_H

#include <loom/backend.h>

#include <math.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if !defined(__F16C__)
/* Without F16C every half is looked up: 64 Ki floats, filled once when a backend opens
 * (cpu_f16_table_init); the branchy scalar conversion ran at a tenth of the speed. */
extern float cpu_f16_table[65536];
void cpu_f16_table_init(void);
#define CPU_F16(h) cpu_f16_table[(uint16_t)(h)]
#else
#define CPU_F16(h) _cvtsh_ss(h)
#endif

static inline void cpu_f16_to_f32(const uint16_t *src, float *dst, int64_t n)
{
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++)
        dst[i] = CPU_F16(src[i]);
}

static inline void cpu_f32_to_f16(const float *src, uint16_t *dst, int64_t n)
{
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++)
        dst[i] = loom_f32_to_f16(src[i]);
}

static inline void cpu_bf16_to_f32(const uint16_t *src, float *dst, int64_t n)
{
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i)));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
    }
#elif defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
#endif
    for (; i < n; i++)
        dst[i] = loom_bf16_to_f32(src[i]);
}

/* sum of a[i] * b[i]: the compiler may not reorder a float reduction, so vectorise by hand */
static inline float cpu_dot(const float *a, const float *b, int64_t n)
{
    int64_t i = 0;
    float sum = 0.0f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    sum = _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
#else
    float part[4] = {0, 0, 0, 0}; /* four independent sums the compiler can keep in a vector */
    for (; i + 4 <= n; i += 4)
        for (int k = 0; k < 4; k++)
            part[k] += a[i + k] * b[i + k];
    sum = (part[0] + part[1]) + (part[2] + part[3]);
#endif
    for (; i < n; i++)
        sum += a[i] * b[i];
    return sum;
}

/* y[i] += a * x[i] */
static inline void cpu_axpy(float a, const float *x, float *y, int64_t n)
{
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 av = _mm512_set1_ps(a);
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i,
                         _mm512_fmadd_ps(av, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#elif defined(__AVX2__)
    __m256 av = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i,
                         _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++)
        y[i] += a * x[i];
}

/* cpu_dot and cpu_axpy with an f16 x, converted in registers (one query head per K/V row) */
static inline float cpu_dot_f16(const float *a, const uint16_t *b, int64_t n)
{
    int64_t i = 0;
    float sum = 0.0f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i),
                              _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + i))), acc);
    sum = _mm512_reduce_add_ps(acc);
#elif defined(__F16C__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i),
                              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i))), acc);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    sum = _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
#endif
    for (; i < n; i++)
        sum += a[i] * CPU_F16(b[i]);
    return sum;
}

static inline void cpu_axpy_f16(float a, const uint16_t *x, float *y, int64_t n)
{
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 av = _mm512_set1_ps(a);
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(
            y + i,
            _mm512_fmadd_ps(av, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(x + i))),
                            _mm512_loadu_ps(y + i)));
#elif defined(__F16C__)
    __m256 av = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i,
                         _mm256_fmadd_ps(av,
                                         _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))),
                                         _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++)
        y[i] += a * CPU_F16(x[i]);
}

/* Row of n elements of dtype t at src -> f32. */
/* exp(x) for the softmax and SiLU: Cephes' expf polynomial on x - n ln2, scaled by 2^n;
 * within 2 ulp of expf. Below -87.3 it gives about 1e-38 instead of 0; above 88.72, inf or
 * FLT_MAX. */
static const float cpu_exp_poly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                      4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#if defined(__AVX512F__)
static inline __m512 cpu_exp512(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.33654f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(cpu_exp_poly[0]);
    for (int k = 1; k < 6; k++)
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(cpu_exp_poly[k]));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}
#elif defined(__AVX2__)
static inline __m256 cpu_exp256(__m256 x)
{
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.7228f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(cpu_exp_poly[0]);
    for (int k = 1; k < 6; k++)
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(cpu_exp_poly[k]));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* 2^n in two halves, so n = 128 (x near 88.72) still gives finite factors */
    __m256i ni = _mm256_cvtps_epi32(n), h = _mm256_srai_epi32(ni, 1);
    __m256 s1 = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(h, _mm256_set1_epi32(127)), 23));
    __m256 s2 = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, h), _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(y, s1), s2);
}
#endif

/* x[i] = exp(x[i] - shift) for i < n; returns their sum */
static inline float cpu_exp_shifted(float *x, int64_t n, float shift)
{
    int64_t i = 0;
    float sum = 0.0f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps(), sh = _mm512_set1_ps(shift);
    for (; i + 16 <= n; i += 16) {
        __m512 e = cpu_exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), sh));
        _mm512_storeu_ps(x + i, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (i < n) {
        __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
        __m512 e = cpu_exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), sh));
        _mm512_mask_storeu_ps(x + i, k, e);
        acc = _mm512_mask_add_ps(acc, k, acc, e);
        i = n;
    }
    sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__)
    __m256 acc = _mm256_setzero_ps(), sh = _mm256_set1_ps(shift);
    for (; i + 8 <= n; i += 8) {
        __m256 e = cpu_exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), sh));
        _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int l = 0; l < 8; l++)
        sum += lanes[l];
#endif
    for (; i < n; i++) {
        x[i] = expf(x[i] - shift);
        sum += x[i];
    }
    return sum;
}

/* y[i] = silu(a[i]) * b[i] = a[i] / (1 + exp(-a[i])) * b[i] */
static inline void cpu_silu_mul_row(const float *a, const float *b, float *y, int64_t n)
{
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_loadu_ps(a + i);
        __m512 e = cpu_exp512(_mm512_sub_ps(_mm512_setzero_ps(), x));
        _mm512_storeu_ps(
            y + i, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, e)), _mm512_loadu_ps(b + i)));
    }
#elif defined(__AVX2__)
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(a + i);
        __m256 e = cpu_exp256(_mm256_sub_ps(_mm256_setzero_ps(), x));
        _mm256_storeu_ps(
            y + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(b + i)));
    }
#endif
    for (; i < n; i++)
        y[i] = a[i] / (1.0f + expf(-a[i])) * b[i];
}

/* GELU (tanh form) as x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): the same function as
 * 0.5 x (1 + tanh(u)) without its cancellation where tanh(u) nears -1 (x below about -3) */
static inline void cpu_gelu_row(const float *a, float *y, int64_t n)
{
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.0f), c = _mm512_set1_ps(-2.0f * 0.7978845608f),
                 k = _mm512_set1_ps(0.044715f);
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_loadu_ps(a + i);
        __m512 u = _mm512_mul_ps(c, _mm512_fmadd_ps(_mm512_mul_ps(k, x), _mm512_mul_ps(x, x), x));
        _mm512_storeu_ps(y + i, _mm512_div_ps(x, _mm512_add_ps(one, cpu_exp512(u))));
    }
#elif defined(__AVX2__)
    const __m256 one = _mm256_set1_ps(1.0f), c = _mm256_set1_ps(-2.0f * 0.7978845608f),
                 k = _mm256_set1_ps(0.044715f);
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(a + i);
        __m256 u = _mm256_mul_ps(c, _mm256_fmadd_ps(_mm256_mul_ps(k, x), _mm256_mul_ps(x, x), x));
        _mm256_storeu_ps(y + i, _mm256_div_ps(x, _mm256_add_ps(one, cpu_exp256(u))));
    }
#endif
    for (; i < n; i++) {
        float x = a[i];
        y[i] = x / (1.0f + expf(-2.0f * 0.7978845608f * (x + 0.044715f * x * x * x)));
    }
}

/* Q8_0 blocks to floats (a q8_0 KV cache's rows): the scale through F16C or the table */
static inline void cpu_q8_0_to_f32(const loom_block_q8_0 *x, float *y, int64_t n)
{
    for (int64_t b = 0; b < n / LOOM_QK; b++, y += LOOM_QK) {
        float d = CPU_F16(x[b].d);
#if defined(__AVX512F__)
        __m512 dv = _mm512_set1_ps(d);
        for (int h = 0; h < 2; h++)
            _mm512_storeu_ps(y + 16 * h,
                             _mm512_mul_ps(dv,
                                           _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                               (const __m128i *)(x[b].qs + 16 * h))))));
#else
        for (int j = 0; j < LOOM_QK; j++)
            y[j] = x[b].qs[j] * d;
#endif
    }
}

static inline void cpu_load_row(loom_dtype t, const void *src, float *dst, int64_t n)
{
    switch (t) {
    case LOOM_F32: memcpy(dst, src, (size_t)n * sizeof(float)); break;
    case LOOM_F16: cpu_f16_to_f32(src, dst, n); break;
    case LOOM_BF16: cpu_bf16_to_f32(src, dst, n); break;
    case LOOM_Q8_0: cpu_q8_0_to_f32(src, dst, n); break;
    case LOOM_Q4_0: loom_dequantize_row_q4_0(src, dst, n); break;
    case LOOM_Q4_1: loom_dequantize_row_q4_1(src, dst, n); break;
    case LOOM_I32:
        for (int64_t i = 0; i < n; i++) {
            int32_t v;
            memcpy(&v, (const char *)src + 4 * i, 4);
            dst[i] = (float)v;
        }
        break;
    default: loom_row_to_f32(t, src, dst, n); break; /* the ABI 1.2 types, by reference */
    }
}

/* f32 row -> dtype t at dst (i32 is not a storage target). */
static inline void cpu_store_row(loom_dtype t, const float *src, void *dst, int64_t n)
{
    switch (t) {
    case LOOM_F32: memmove(dst, src, (size_t)n * sizeof(float)); break;
    case LOOM_F16: cpu_f32_to_f16(src, dst, n); break;
    case LOOM_BF16:
        for (int64_t i = 0; i < n; i++)
            ((uint16_t *)dst)[i] = loom_f32_to_bf16(src[i]);
        break;
    case LOOM_Q8_0: loom_quantize_row_q8_0(src, dst, n); break;
    case LOOM_Q4_0: loom_quantize_row_q4_0(src, dst, n); break;
    case LOOM_Q4_1: loom_quantize_row_q4_1(src, dst, n); break;
    default: break; /* i32, and the types only read */
    }
}

/* Address of row r (counting over dims 1..3) of t, given its buffer's base address. */
static inline unsigned char *cpu_row(const loom_tensor *t, unsigned char *base, int64_t r)
{
    /* matrices, the common case, without the three 64-bit divisions (a matmul asks for a row
     * every tile: they were 18% of a baseline decode step) */
    if (t->ne[2] == 1 && t->ne[3] == 1)
        return base + t->offset + (uint64_t)r * t->nb[1];
    int64_t i1 = r % t->ne[1], i2 = r / t->ne[1] % t->ne[2], i3 = r / t->ne[1] / t->ne[2];
    return base + t->offset + (uint64_t)i1 * t->nb[1] + (uint64_t)i2 * t->nb[2] +
        (uint64_t)i3 * t->nb[3];
}

#endif
