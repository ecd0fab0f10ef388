/*
 * loom/quants.h - the block formats of GGUF's quantised types, and their reference
 * dequantisers (and quantisers where loom writes the type). Included by <loom/backend.h>,
 * which is the one header a backend includes; it is a file of its own only for length.
 *
 * Written from the published formats (ggml's block layouts, which GGUF files store as they
 * are). Every backend must decode a type to exactly what these functions give, bit for bit
 * before any arithmetic of its own; conformance compares against them through `ref`.
 *
 * Two families:
 *   32-element blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL      (LOOM_QK)
 *   256-element super-blocks: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS (LOOM_QK_K), each split
 *   into 16 or 8 sub-blocks with their own 4-, 6- or 8-bit scales (and mins) packed together.
 */
#ifndef LOOM_QUANTS_H
#define LOOM_QUANTS_H

#ifndef LOOM_BACKEND_H
#error "include <loom/backend.h>, not <loom/quants.h>"
#endif

#define LOOM_QK 32    /* elements per block of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL */
#define LOOM_QK_K 256 /* elements per super-block of the K types and IQ4_XS */

/* ---- Block layouts ------------------------------------------------------------------------
 * Nibble order in the 32-element types: byte j holds element j in its low nibble and element
 * j + 16 in its high nibble. */

typedef struct loom_block_q4_0 {
    uint16_t d;               /* f16 scale */
    uint8_t qs[LOOM_QK / 2];
} loom_block_q4_0;            /* x = (q - 8) * d */

typedef struct loom_block_q4_1 {
    uint16_t d;               /* f16 scale */
    uint16_t m;               /* f16 minimum */
    uint8_t qs[LOOM_QK / 2];
} loom_block_q4_1;            /* x = q * d + m */

typedef struct loom_block_q5_0 {
    uint16_t d;
    uint8_t qh[4];            /* bit j: the fifth bit of element j */
    uint8_t qs[LOOM_QK / 2];
} loom_block_q5_0;            /* x = (q - 16) * d */

typedef struct loom_block_q5_1 {
    uint16_t d, m;
    uint8_t qh[4];
    uint8_t qs[LOOM_QK / 2];
} loom_block_q5_1;            /* x = q * d + m */

typedef struct loom_block_q8_0 {
    uint16_t d;               /* f16 scale */
    int8_t qs[LOOM_QK];
} loom_block_q8_0;            /* x = q * d */

typedef struct loom_block_iq4_nl {
    uint16_t d;
    uint8_t qs[LOOM_QK / 2];
} loom_block_iq4_nl;          /* x = loom_iq4_values[q] * d */

/* Q2_K: 16 sub-blocks of 16; a scale byte each (low nibble: scale, high: min, both times the
 * super-block's d and dmin); 2-bit quants, four sub-blocks' worth per 32 bytes of qs. */
typedef struct loom_block_q2_k {
    uint8_t scales[LOOM_QK_K / 16];
    uint8_t qs[LOOM_QK_K / 4];
    uint16_t d, dmin;
} loom_block_q2_k;            /* x = d * sc * q - dmin * m */

/* Q3_K: 16 sub-blocks of 16 with 6-bit signed scales (12 bytes); 2 low bits in qs, the third
 * bit in hmask (set: +0, clear: -4). */
typedef struct loom_block_q3_k {
    uint8_t hmask[LOOM_QK_K / 8];
    uint8_t qs[LOOM_QK_K / 4];
    uint8_t scales[12];
    uint16_t d;
} loom_block_q3_k;            /* x = d * (sc - 32) * (q - 4 * !hbit) */

/* Q4_K and Q5_K: 8 sub-blocks of 32 with a 6-bit scale and a 6-bit min each (12 bytes). */
typedef struct loom_block_q4_k {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qs[LOOM_QK_K / 2];
} loom_block_q4_k;            /* x = d * sc * q - dmin * m */

typedef struct loom_block_q5_k {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[LOOM_QK_K / 8];
    uint8_t qs[LOOM_QK_K / 2];
} loom_block_q5_k;

/* Q6_K: 16 sub-blocks of 16 with int8 scales; 4 low bits in ql, 2 high bits in qh. */
typedef struct loom_block_q6_k {
    uint8_t ql[LOOM_QK_K / 2];
    uint8_t qh[LOOM_QK_K / 4];
    int8_t scales[LOOM_QK_K / 16];
    uint16_t d;
} loom_block_q6_k;            /* x = d * sc * (q - 32) */

/* IQ4_XS: 8 sub-blocks of 32 with 6-bit scales (low 4 bits in scales_l, high 2 in scales_h). */
typedef struct loom_block_iq4_xs {
    uint16_t d;
    uint16_t scales_h;
    uint8_t scales_l[LOOM_QK_K / 64];
    uint8_t qs[LOOM_QK_K / 2];
} loom_block_iq4_xs;          /* x = d * (sc - 32) * loom_iq4_values[q] */

/* IQ4's 16 non-linear levels (the published table of the IQ4_NL / IQ4_XS formats). */
static const int8_t loom_iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                           1,    13,   25,  38,  53,  69,  89,  113};

/* ---- Reference quantisers (the 32-element types loom writes) ------------------------------
 * A backend may quantise differently inside a kernel, but what it stores must decode with the
 * dequantisers below. n is a multiple of the type's block. */

/* round half away from zero, as C's roundf, without libm */
static inline int loom_round_nearest(float v)
{
    return v < 0 ? (int)(v - 0.5f) : (int)(v + 0.5f);
}

static inline void loom_quantize_row_q8_0(const float *x, loom_block_q8_0 *y, int64_t n)
{
    for (int64_t b = 0; b < n / LOOM_QK; b++, x += LOOM_QK) {
        float amax = 0.0f;
        for (int j = 0; j < LOOM_QK; j++) {
            float a = x[j] < 0 ? -x[j] : x[j];
            if (a > amax)
                amax = a;
        }
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = loom_f32_to_f16(d);
        for (int j = 0; j < LOOM_QK; j++) {
            double v = (double)(x[j] * id); /* round half away from zero, like roundf */
            y[b].qs[j] = (int8_t)(v < 0 ? (int)(v - 0.5) : (int)(v + 0.5));
        }
    }
}

/* The value of largest magnitude in x[0..n), with its sign. */
static inline float loom_signed_absmax(const float *x, int n)
{
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < n; j++) {
        float a = x[j] < 0 ? -x[j] : x[j];
        if (a > amax) {
            amax = a;
            max = x[j];
        }
    }
    return max;
}

static inline void loom_quantize_row_q4_0(const float *x, loom_block_q4_0 *y, int64_t n)
{
    for (int64_t b = 0; b < n / LOOM_QK; b++, x += LOOM_QK) {
        float d = loom_signed_absmax(x, LOOM_QK) / -8.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = loom_f32_to_f16(d);
        for (int j = 0; j < LOOM_QK / 2; j++) {
            int q0 = (int)(x[j] * id + 8.5f), q1 = (int)(x[j + LOOM_QK / 2] * id + 8.5f);
            q0 = q0 > 15 ? 15 : q0;
            q1 = q1 > 15 ? 15 : q1;
            y[b].qs[j] = (uint8_t)(q0 | (q1 << 4));
        }
    }
}

static inline void loom_quantize_row_q4_1(const float *x, loom_block_q4_1 *y, int64_t n)
{
    for (int64_t b = 0; b < n / LOOM_QK; b++, x += LOOM_QK) {
        float min = x[0], max = x[0];
        for (int j = 1; j < LOOM_QK; j++) {
            min = x[j] < min ? x[j] : min;
            max = x[j] > max ? x[j] : max;
        }
        float d = (max - min) / 15.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = loom_f32_to_f16(d);
        y[b].m = loom_f32_to_f16(min);
        for (int j = 0; j < LOOM_QK / 2; j++) {
            int q0 = (int)((x[j] - min) * id + 0.5f);
            int q1 = (int)((x[j + LOOM_QK / 2] - min) * id + 0.5f);
            q0 = q0 > 15 ? 15 : q0;
            q1 = q1 > 15 ? 15 : q1;
            y[b].qs[j] = (uint8_t)(q0 | (q1 << 4));
        }
    }
}

/* ---- Reference dequantisers --------------------------------------------------------------- */

static inline void loom_dequantize_row_q8_0(const loom_block_q8_0 *x, float *y, int64_t n)
{
    for (int64_t b = 0; b < n / LOOM_QK; b++, y += LOOM_QK) {
        float d = loom_f16_to_f32(x[b].d);
        for (int j = 0; j < LOOM_QK; j++)
            y[j] = x[b].qs[j] * d;
    }
}

static inline void loom_dequantize_row_q4_0(const loom_block_q4_0 *x, float *y, int64_t n)
{
    for (int64_t b = 0; b < n / LOOM_QK; b++, y += LOOM_QK) {
        float d = loom_f16_to_f32(x[b].d);
        for (int j = 0; j < LOOM_QK / 2; j++) {
            y[j] = ((x[b].qs[j] & 0x0f) - 8) * d;
            y[j + LOOM_QK / 2] = ((x[b].qs[j] >> 4) - 8) * d;
        }
    }
}

static inline void loom_dequantize_row_q4_1(const loom_block_q4_1 *x, float *y, int64_t n)
{
    for (int64_t b = 0; b < n / LOOM_QK; b++, y += LOOM_QK) {
        float d = loom_f16_to_f32(x[b].d), m = loom_f16_to_f32(x[b].m);
        for (int j = 0; j < LOOM_QK / 2; j++) {
            y[j] = (x[b].qs[j] & 0x0f) * d + m;
            y[j + LOOM_QK / 2] = (x[b].qs[j] >> 4) * d + m;
        }
    }
}

/* The fifth bit of element j of a Q5 block, from its 32-bit qh field (little-endian). */
static inline int loom_q5_high(const uint8_t qh[4], int j)
{
    return (qh[j / 8] >> (j % 8)) & 1;
}

static inline void loom_dequantize_row_q5_0(const loom_block_q5_0 *x, float *y, int64_t n)
{
    for (int64_t b = 0; b < n / LOOM_QK; b++, y += LOOM_QK) {
        float d = loom_f16_to_f32(x[b].d);
        for (int j = 0; j < LOOM_QK / 2; j++) {
            int lo = (x[b].qs[j] & 0x0f) | loom_q5_high(x[b].qh, j) << 4;
            int hi = (x[b].qs[j] >> 4) | loom_q5_high(x[b].qh, j + 16) << 4;
            y[j] = (lo - 16) * d;
            y[j + LOOM_QK / 2] = (hi - 16) * d;
        }
    }
}

static inline void loom_dequantize_row_q5_1(const loom_block_q5_1 *x, float *y, int64_t n)
{
    for (int64_t b = 0; b < n / LOOM_QK; b++, y += LOOM_QK) {
        float d = loom_f16_to_f32(x[b].d), m = loom_f16_to_f32(x[b].m);
        for (int j = 0; j < LOOM_QK / 2; j++) {
            int lo = (x[b].qs[j] & 0x0f) | loom_q5_high(x[b].qh, j) << 4;
            int hi = (x[b].qs[j] >> 4) | loom_q5_high(x[b].qh, j + 16) << 4;
            y[j] = lo * d + m;
            y[j + LOOM_QK / 2] = hi * d + m;
        }
    }
}

static inline void loom_dequantize_row_iq4_nl(const loom_block_iq4_nl *x, float *y, int64_t n)
{
    for (int64_t b = 0; b < n / LOOM_QK; b++, y += LOOM_QK) {
        float d = loom_f16_to_f32(x[b].d);
        for (int j = 0; j < LOOM_QK / 2; j++) {
            y[j] = d * loom_iq4_values[x[b].qs[j] & 0x0f];
            y[j + LOOM_QK / 2] = d * loom_iq4_values[x[b].qs[j] >> 4];
        }
    }
}

static inline void loom_dequantize_row_q2_k(const loom_block_q2_k *x, float *y, int64_t n)
{
    for (int64_t b = 0; b < n / LOOM_QK_K; b++) {
        float d = loom_f16_to_f32(x[b].d), dmin = loom_f16_to_f32(x[b].dmin);
        /* each 32 bytes of qs hold four sub-blocks pairs: bit pair s of byte l is element l
         * of the (2s)th and (2s+1)th sub-block of that 128-element half */
        for (int half = 0; half < 2; half++) {
            const uint8_t *q = x[b].qs + 32 * half;
            for (int s = 0; s < 4; s++)
                for (int part = 0; part < 2; part++) {
                    uint8_t sc = x[b].scales[8 * half + 2 * s + part];
                    float dl = d * (sc & 0x0f), ml = dmin * (sc >> 4);
                    for (int l = 0; l < 16; l++)
                        *y++ = dl * ((q[16 * part + l] >> (2 * s)) & 3) - ml;
                }
        }
    }
}

/* Q3_K's 16 six-bit scales: the low 4 bits of scale s in nibble s/8 of byte s%8, the high 2
 * bits in bit pair s/4 of byte 8 + s%4. */
static inline int loom_q3_k_scale(const uint8_t scales[12], int s)
{
    int lo = (scales[s % 8] >> (4 * (s / 8))) & 0x0f;
    int hi = (scales[8 + s % 4] >> (2 * (s / 4))) & 3;
    return (lo | hi << 4) - 32;
}

static inline void loom_dequantize_row_q3_k(const loom_block_q3_k *x, float *y, int64_t n)
{
    for (int64_t b = 0; b < n / LOOM_QK_K; b++) {
        float d = loom_f16_to_f32(x[b].d);
        int bit = 0; /* the hmask bit of the current 32-element slice */
        for (int half = 0; half < 2; half++) {
            const uint8_t *q = x[b].qs + 32 * half;
            for (int s = 0; s < 4; s++, bit++)
                for (int part = 0; part < 2; part++) {
                    float dl = d * loom_q3_k_scale(x[b].scales, 8 * half + 2 * s + part);
                    for (int l = 0; l < 16; l++) {
                        int k = 16 * part + l;
                        int low = (q[k] >> (2 * s)) & 3;
                        int high = (x[b].hmask[k] >> bit) & 1;
                        *y++ = dl * (low - (high ? 0 : 4));
                    }
                }
        }
    }
}

/* Q4_K / Q5_K: sub-block j's 6-bit scale and min from the 12 packed bytes. j < 4: the low 6
 * bits of bytes j and j + 4; j >= 4: a nibble of byte j + 4 with the top 2 bits of bytes j - 4
 * and j. */
static inline void loom_k_scale_min(const uint8_t q[12], int j, int *sc, int *m)
{
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

static inline void loom_dequantize_row_q4_k(const loom_block_q4_k *x, float *y, int64_t n)
{
    for (int64_t b = 0; b < n / LOOM_QK_K; b++) {
        float d = loom_f16_to_f32(x[b].d), dmin = loom_f16_to_f32(x[b].dmin);
        for (int pair = 0; pair < 4; pair++) { /* 64 elements: two sub-blocks, one 32-byte run */
            const uint8_t *q = x[b].qs + 32 * pair;
            int sc, m;
            loom_k_scale_min(x[b].scales, 2 * pair, &sc, &m);
            float d1 = d * sc, m1 = dmin * m;
            loom_k_scale_min(x[b].scales, 2 * pair + 1, &sc, &m);
            float d2 = d * sc, m2 = dmin * m;
            for (int l = 0; l < 32; l++)
                *y++ = d1 * (q[l] & 0x0f) - m1;
            for (int l = 0; l < 32; l++)
                *y++ = d2 * (q[l] >> 4) - m2;
        }
    }
}

static inline void loom_dequantize_row_q5_k(const loom_block_q5_k *x, float *y, int64_t n)
{
    for (int64_t b = 0; b < n / LOOM_QK_K; b++) {
        float d = loom_f16_to_f32(x[b].d), dmin = loom_f16_to_f32(x[b].dmin);
        for (int pair = 0; pair < 4; pair++) {
            const uint8_t *q = x[b].qs + 32 * pair;
            int sc, m;
            loom_k_scale_min(x[b].scales, 2 * pair, &sc, &m);
            float d1 = d * sc, m1 = dmin * m;
            loom_k_scale_min(x[b].scales, 2 * pair + 1, &sc, &m);
            float d2 = d * sc, m2 = dmin * m;
            /* the fifth bits: bit 2*pair of qh[l] for the first sub-block, 2*pair+1 for the
             * second */
            for (int l = 0; l < 32; l++)
                *y++ = d1 * ((q[l] & 0x0f) + (((x[b].qh[l] >> (2 * pair)) & 1) << 4)) - m1;
            for (int l = 0; l < 32; l++)
                *y++ = d2 * ((q[l] >> 4) + (((x[b].qh[l] >> (2 * pair + 1)) & 1) << 4)) - m2;
        }
    }
}

static inline void loom_dequantize_row_q6_k(const loom_block_q6_k *x, float *y, int64_t n)
{
    for (int64_t b = 0; b < n / LOOM_QK_K; b++) {
        float d = loom_f16_to_f32(x[b].d);
        for (int half = 0; half < 2; half++, y += 128) {
            const uint8_t *ql = x[b].ql + 64 * half, *qh = x[b].qh + 32 * half;
            const int8_t *sc = x[b].scales + 8 * half;
            /* element l + 32 k of the half: low nibble of ql[l] (k 0) or ql[l + 32] (k 1),
             * high nibbles for k 2 and 3; its two high bits are bit pair k of qh[l] */
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                int q1 = ((ql[l] & 0x0f) | ((qh[l] >> 0) & 3) << 4) - 32;
                int q2 = ((ql[l + 32] & 0x0f) | ((qh[l] >> 2) & 3) << 4) - 32;
                int q3 = ((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32;
                int q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32;
                y[l] = d * sc[is] * q1;
                y[l + 32] = d * sc[is + 2] * q2;
                y[l + 64] = d * sc[is + 4] * q3;
                y[l + 96] = d * sc[is + 6] * q4;
            }
        }
    }
}

static inline void loom_dequantize_row_iq4_xs(const loom_block_iq4_xs *x, float *y, int64_t n)
{
    for (int64_t b = 0; b < n / LOOM_QK_K; b++) {
        float d = loom_f16_to_f32(x[b].d);
        for (int s = 0; s < 8; s++, y += 32) {
            int ls = ((x[b].scales_l[s / 2] >> (4 * (s % 2))) & 0x0f) |
                     ((x[b].scales_h >> (2 * s)) & 3) << 4;
            float dl = d * (ls - 32);
            const uint8_t *q = x[b].qs + 16 * s;
            for (int j = 0; j < 16; j++) {
                y[j] = dl * loom_iq4_values[q[j] & 0x0f];
                y[j + 16] = dl * loom_iq4_values[q[j] >> 4];
            }
        }
    }
}

#endif
