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

/* The small helpers below that decode packed scales and bits are also GPU device code: a
 * CUDA or HIP backend calls the same ones, so that its kernels decode exactly as these do. */
#if defined(__CUDACC__) || defined(__HIPCC__)
#define LOOM_QUANT_HD __host__ __device__
#else
#define LOOM_QUANT_HD
#endif

#define LOOM_QK 32    /* elements per block of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL */
#define LOOM_QK_K 256 /* elements per super-block of the K types and IQ4_XS */

/* ---- Block layouts ------------------------------------------------------------------------
 * Nibble order in the 32-element types: byte j holds element j in its low nibble and element
 * j + 16 in its high nibble. */

typedef struct loom_block_q4_0 {
    uint16_t d; /* f16 scale */
    uint8_t qs[LOOM_QK / 2];
} loom_block_q4_0; /* x = (q - 8) * d */

typedef struct loom_block_q4_1 {
    uint16_t d; /* f16 scale */
    uint16_t m; /* f16 minimum */
    uint8_t qs[LOOM_QK / 2];
} loom_block_q4_1; /* x = q * d + m */

typedef struct loom_block_q5_0 {
    uint16_t d;
    uint8_t qh[4]; /* bit j: the fifth bit of element j */
    uint8_t qs[LOOM_QK / 2];
} loom_block_q5_0; /* x = (q - 16) * d */

typedef struct loom_block_q5_1 {
    uint16_t d, m;
    uint8_t qh[4];
    uint8_t qs[LOOM_QK / 2];
} loom_block_q5_1; /* x = q * d + m */

typedef struct loom_block_q8_0 {
    uint16_t d; /* f16 scale */
    int8_t qs[LOOM_QK];
} loom_block_q8_0; /* x = q * d */

typedef struct loom_block_iq4_nl {
    uint16_t d;
    uint8_t qs[LOOM_QK / 2];
} loom_block_iq4_nl; /* x = loom_iq4_values[q] * d */

/* Q2_K: 16 sub-blocks of 16; a scale byte each (low nibble: scale, high: min, both times the
 * super-block's d and dmin); 2-bit quants, four sub-blocks' worth per 32 bytes of qs. */
typedef struct loom_block_q2_k {
    uint8_t scales[LOOM_QK_K / 16];
    uint8_t qs[LOOM_QK_K / 4];
    uint16_t d, dmin;
} loom_block_q2_k; /* x = d * sc * q - dmin * m */

/* Q3_K: 16 sub-blocks of 16 with 6-bit signed scales (12 bytes); 2 low bits in qs, the third
 * bit in hmask (set: +0, clear: -4). */
typedef struct loom_block_q3_k {
    uint8_t hmask[LOOM_QK_K / 8];
    uint8_t qs[LOOM_QK_K / 4];
    uint8_t scales[12];
    uint16_t d;
} loom_block_q3_k; /* x = d * (sc - 32) * (q - 4 * !hbit) */

/* Q4_K and Q5_K: 8 sub-blocks of 32 with a 6-bit scale and a 6-bit min each (12 bytes). */
typedef struct loom_block_q4_k {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qs[LOOM_QK_K / 2];
} loom_block_q4_k; /* x = d * sc * q - dmin * m */

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
} loom_block_q6_k; /* x = d * sc * (q - 32) */

/* IQ4_XS: 8 sub-blocks of 32 with 6-bit scales (low 4 bits in scales_l, high 2 in scales_h). */
typedef struct loom_block_iq4_xs {
    uint16_t d;
    uint16_t scales_h;
    uint8_t scales_l[LOOM_QK_K / 64];
    uint8_t qs[LOOM_QK_K / 2];
} loom_block_iq4_xs; /* x = d * (sc - 32) * loom_iq4_values[q] */

/* IQ4's 16 non-linear levels (the published table of the IQ4_NL / IQ4_XS formats). */
#define LOOM_IQ4_VALUES                                                                            \
    {                                                                                              \
        -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113                   \
    }
static const int8_t loom_iq4_values[16] = LOOM_IQ4_VALUES;

/* ---- Reference quantisers -------------------------------------------------------------------
 * A backend may quantise differently inside a kernel, but what it stores must decode with the
 * dequantisers below. n is a multiple of the type's block. Q8_0, Q4_0 and Q4_1 are written the
 * way ABI 1.0 defined (absmax scales: a backend's quantize op must match them); the others
 * (further below) search for their scales, as llama.cpp's quantizer does, for a smaller error. */

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

/* ---- Quantisers for the ABI 1.2 types -----------------------------------------------------
 * Round to nearest with a search for the scale, as these formats were designed to be written:
 * a group's quants are tried against a few candidate scales, each refitted by weighted least
 * squares, and the fit with the smallest weighted error is kept. Weights favour the larger
 * values (|x| plus the mean |x|), which carry more of a dot product. Sub-block scales are
 * then quantised against their super-block's, and the values requantised with the scales as
 * stored, so that what decodes is what was fitted. */

static inline float loom_q_abs(float v)
{
    return v < 0 ? -v : v;
}

/* Symmetric quants l in [-nmax, nmax - 1] for x[0..n) and the scale s with x ~ s * l; the
 * quants go to L. Returns s (0 for an all-zero group). */
static inline float loom_fit_signed(int n, int nmax, const float *x, const float *w, int8_t *L)
{
    float max = loom_signed_absmax(x, n);
    if (max == 0.0f) {
        for (int i = 0; i < n; i++)
            L[i] = 0;
        return 0.0f;
    }
    float best_scale = 0.0f, best = -1.0f;
    for (int step = -9; step <= 9; step++) {
        float iscale = -((float)nmax + 0.1f * (float)step) / max;
        double sumlx = 0, sumll = 0;
        for (int i = 0; i < n; i++) {
            int l = loom_round_nearest(iscale * x[i]);
            l = l < -nmax ? -nmax : l > nmax - 1 ? nmax - 1 : l;
            sumlx += (double)w[i] * x[i] * l;
            sumll += (double)w[i] * l * l;
        }
        /* for the best s = sumlx / sumll the weighted error falls by sumlx^2 / sumll */
        if (sumll > 0 && sumlx * sumlx / sumll > best) {
            best = (float)(sumlx * sumlx / sumll);
            best_scale = (float)(sumlx / sumll);
        }
    }
    for (int i = 0; i < n; i++) {
        int l = best_scale != 0.0f ? loom_round_nearest(x[i] / best_scale) : 0;
        L[i] = (int8_t)(l < -nmax ? -nmax : l > nmax - 1 ? nmax - 1 : l);
    }
    return best_scale;
}

/* Unsigned quants l in [0, nmax] with x ~ s * l + b; b <= 0 when non_positive (the K types
 * store -b as a min that is subtracted). Returns s, with b in *offset. */
static inline float loom_fit_offset(int n, int nmax, const float *x, const float *w, uint8_t *L,
                                    float *offset, int non_positive)
{
    float lo = x[0], hi = x[0];
    for (int i = 1; i < n; i++) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
    }
    if (non_positive && lo > 0)
        lo = 0;
    if (hi <= lo) {
        for (int i = 0; i < n; i++)
            L[i] = 0;
        *offset = lo;
        return 0.0f;
    }
    float best_s = (hi - lo) / (float)nmax, best_b = lo;
    double best_err = 0;
    int found = 0;
    for (int step = -5; step <= 10; step++) {
        float iscale = ((float)nmax + 0.1f * (float)step) / (hi - lo);
        double sw = 0, sl = 0, sll = 0, sx = 0, slx = 0;
        for (int i = 0; i < n; i++) {
            int l = loom_round_nearest(iscale * (x[i] - lo));
            l = l < 0 ? 0 : l > nmax ? nmax : l;
            sw += w[i], sl += (double)w[i] * l, sll += (double)w[i] * l * l;
            sx += (double)w[i] * x[i], slx += (double)w[i] * l * x[i];
        }
        double det = sw * sll - sl * sl;
        if (det <= 0)
            continue;
        double s = (sw * slx - sx * sl) / det, b = (sll * sx - sl * slx) / det;
        if (non_positive && b > 0) {
            b = 0;
            s = sll > 0 ? slx / sll : 0;
        }
        if (s <= 0)
            continue;
        /* sum w (s l + b - x)^2 from the sums, less the constant sum w x^2 */
        double err = s * s * sll + 2 * s * b * sl + b * b * sw - 2 * s * slx - 2 * b * sx;
        if (!found || err < best_err)
            best_err = err, best_s = (float)s, best_b = (float)b, found = 1;
    }
    for (int i = 0; i < n; i++) {
        int l = loom_round_nearest((x[i] - best_b) / best_s);
        L[i] = (uint8_t)(l < 0 ? 0 : l > nmax ? nmax : l);
    }
    *offset = best_b;
    return best_s;
}

/* Weights for a group: |x| plus the mean |x| of the whole super-block (or block) it belongs
 * to, so that no value counts for nothing. */
static inline void loom_fit_weights(const float *x, int n, float *w)
{
    double sa = 0;
    for (int i = 0; i < n; i++)
        sa += loom_q_abs(x[i]);
    float mean = (float)(sa / n);
    for (int i = 0; i < n; i++)
        w[i] = loom_q_abs(x[i]) + mean;
}

static inline int loom_clamp_int(int v, int lo, int hi)
{
    return v < lo ? lo : v > hi ? hi : v;
}

static inline void loom_set_q5_high(uint8_t qh[4], int j, int bit)
{
    qh[j / 8] = (uint8_t)(qh[j / 8] | bit << (j % 8));
}

static inline void loom_quantize_row_q5_0(const float *x, loom_block_q5_0 *y, int64_t n)
{
    for (int64_t b = 0; b < n / LOOM_QK; b++, x += LOOM_QK) {
        float w[LOOM_QK];
        int8_t L[LOOM_QK];
        loom_fit_weights(x, LOOM_QK, w);
        float s = loom_fit_signed(LOOM_QK, 16, x, w, L);
        y[b].d = loom_f32_to_f16(s);
        float d = loom_f16_to_f32(y[b].d);
        for (int k = 0; k < 4; k++)
            y[b].qh[k] = 0;
        for (int j = 0; j < LOOM_QK / 2; j++) {
            int l0 = d != 0.0f ? loom_clamp_int(loom_round_nearest(x[j] / d), -16, 15) + 16 : 16;
            int l1 = d != 0.0f ? loom_clamp_int(loom_round_nearest(x[j + 16] / d), -16, 15) + 16
                               : 16;
            y[b].qs[j] = (uint8_t)((l0 & 15) | (l1 & 15) << 4);
            loom_set_q5_high(y[b].qh, j, l0 >> 4);
            loom_set_q5_high(y[b].qh, j + 16, l1 >> 4);
        }
    }
}

static inline void loom_quantize_row_q5_1(const float *x, loom_block_q5_1 *y, int64_t n)
{
    for (int64_t b = 0; b < n / LOOM_QK; b++, x += LOOM_QK) {
        float w[LOOM_QK], m;
        uint8_t L[LOOM_QK];
        loom_fit_weights(x, LOOM_QK, w);
        float s = loom_fit_offset(LOOM_QK, 31, x, w, L, &m, 0);
        y[b].d = loom_f32_to_f16(s);
        y[b].m = loom_f32_to_f16(m);
        float d = loom_f16_to_f32(y[b].d), mm = loom_f16_to_f32(y[b].m);
        for (int k = 0; k < 4; k++)
            y[b].qh[k] = 0;
        for (int j = 0; j < LOOM_QK / 2; j++) {
            int l0 = d != 0.0f ? loom_clamp_int(loom_round_nearest((x[j] - mm) / d), 0, 31) : 0;
            int l1 = d != 0.0f ? loom_clamp_int(loom_round_nearest((x[j + 16] - mm) / d), 0, 31)
                               : 0;
            y[b].qs[j] = (uint8_t)((l0 & 15) | (l1 & 15) << 4);
            loom_set_q5_high(y[b].qh, j, l0 >> 4);
            loom_set_q5_high(y[b].qh, j + 16, l1 >> 4);
        }
    }
}

/* The index of the IQ4 level nearest to v. */
static inline int loom_iq4_nearest(float v)
{
    int best = 0;
    for (int k = 1; k < 16; k++)
        if (loom_q_abs(v - loom_iq4_values[k]) < loom_q_abs(v - loom_iq4_values[best]))
            best = k;
    return best;
}

/* A scale d with x ~ d * loom_iq4_values[idx] for a group of n: candidates around the one that
 * maps the extreme value onto an extreme level, each refitted. Returns d, indices in idx. */
static inline float loom_fit_iq4(int n, const float *x, const float *w, uint8_t *idx)
{
    float max = loom_signed_absmax(x, n);
    if (max == 0.0f) {
        for (int i = 0; i < n; i++)
            idx[i] = 8; /* level 1: the one nearest zero, times 0 */
        return 0.0f;
    }
    float best_d = max / loom_iq4_values[0], best = -1.0f;
    for (int step = -9; step <= 9; step++) {
        float id = (loom_iq4_values[0] + 0.1f * (float)step) / max;
        double sumvx = 0, sumvv = 0;
        for (int i = 0; i < n; i++) {
            float v = loom_iq4_values[loom_iq4_nearest(id * x[i])];
            sumvx += (double)w[i] * v * x[i];
            sumvv += (double)w[i] * v * v;
        }
        if (sumvv > 0 && sumvx * sumvx / sumvv > best) {
            best = (float)(sumvx * sumvx / sumvv);
            best_d = (float)(sumvx / sumvv);
        }
    }
    for (int i = 0; i < n; i++)
        idx[i] = (uint8_t)(best_d != 0.0f ? loom_iq4_nearest(x[i] / best_d) : 8);
    return best_d;
}

static inline void loom_quantize_row_iq4_nl(const float *x, loom_block_iq4_nl *y, int64_t n)
{
    for (int64_t b = 0; b < n / LOOM_QK; b++, x += LOOM_QK) {
        float w[LOOM_QK];
        uint8_t idx[LOOM_QK];
        loom_fit_weights(x, LOOM_QK, w);
        y[b].d = loom_f32_to_f16(loom_fit_iq4(LOOM_QK, x, w, idx));
        float d = loom_f16_to_f32(y[b].d);
        for (int j = 0; j < LOOM_QK; j++)
            idx[j] = (uint8_t)(d != 0.0f ? loom_iq4_nearest(x[j] / d) : 8);
        for (int j = 0; j < LOOM_QK / 2; j++)
            y[b].qs[j] = (uint8_t)(idx[j] | idx[j + 16] << 4);
    }
}

/* Sub-block scales quantised against their largest: q = round(s / d) within [lo, hi], d chosen
 * so that the largest magnitude lands on `extreme` (hi for unsigned, lo for signed). */
static inline float loom_scale_of_scales(const float *s, int n, float extreme)
{
    float max = loom_signed_absmax(s, n);
    return max != 0.0f ? max / extreme : 0.0f;
}

static inline void loom_quantize_row_q2_k(const float *x, loom_block_q2_k *y, int64_t n)
{
    for (int64_t b = 0; b < n / LOOM_QK_K; b++, x += LOOM_QK_K) {
        float w[LOOM_QK_K], sc[16], mn[16];
        uint8_t L[LOOM_QK_K];
        loom_fit_weights(x, LOOM_QK_K, w);
        for (int j = 0; j < 16; j++) {
            float off;
            sc[j] = loom_fit_offset(16, 3, x + 16 * j, w + 16 * j, L + 16 * j, &off, 1);
            mn[j] = -off;
        }
        y[b].d = loom_f32_to_f16(loom_scale_of_scales(sc, 16, 15.0f));
        y[b].dmin = loom_f32_to_f16(loom_scale_of_scales(mn, 16, 15.0f));
        float d = loom_f16_to_f32(y[b].d), dmin = loom_f16_to_f32(y[b].dmin);
        for (int j = 0; j < 16; j++) {
            int qs = d != 0.0f ? loom_clamp_int(loom_round_nearest(sc[j] / d), 0, 15) : 0;
            int qm = dmin != 0.0f ? loom_clamp_int(loom_round_nearest(mn[j] / dmin), 0, 15) : 0;
            y[b].scales[j] = (uint8_t)(qs | qm << 4);
            float dl = d * qs, ml = dmin * qm;
            for (int i = 0; i < 16; i++)
                L[16 * j + i] =
                    (uint8_t)(dl != 0.0f ? loom_clamp_int(
                                               loom_round_nearest((x[16 * j + i] + ml) / dl), 0, 3)
                                         : 0);
        }
        /* element l of sub-block 2s + part of half h sits at bits 2s of qs[32 h + 16 part + l] */
        for (int k = 0; k < LOOM_QK_K / 4; k++)
            y[b].qs[k] = 0;
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int part = 0; part < 2; part++)
                    for (int l = 0; l < 16; l++)
                        y[b].qs[32 * h + 16 * part + l] |=
                            (uint8_t)(L[128 * h + 32 * s + 16 * part + l] << (2 * s));
    }
}

static inline void loom_quantize_row_q3_k(const float *x, loom_block_q3_k *y, int64_t n)
{
    for (int64_t b = 0; b < n / LOOM_QK_K; b++, x += LOOM_QK_K) {
        float w[LOOM_QK_K], sc[16];
        int8_t L[LOOM_QK_K];
        loom_fit_weights(x, LOOM_QK_K, w);
        for (int j = 0; j < 16; j++)
            sc[j] = loom_fit_signed(16, 4, x + 16 * j, w + 16 * j, L + 16 * j);
        y[b].d = loom_f32_to_f16(loom_scale_of_scales(sc, 16, -32.0f));
        float d = loom_f16_to_f32(y[b].d);
        for (int k = 0; k < 12; k++)
            y[b].scales[k] = 0;
        for (int j = 0; j < 16; j++) {
            int q = d != 0.0f ? loom_clamp_int(loom_round_nearest(sc[j] / d), -32, 31) : 0;
            int u = q + 32; /* the inverse of loom_q3_k_scale */
            y[b].scales[j % 8] |= (uint8_t)((u & 15) << (4 * (j / 8)));
            y[b].scales[8 + j % 4] |= (uint8_t)((u >> 4) << (2 * (j / 4)));
            float dl = d * q;
            for (int i = 0; i < 16; i++)
                L[16 * j + i] = (int8_t)(dl != 0.0f
                                             ? loom_clamp_int(
                                                   loom_round_nearest(x[16 * j + i] / dl), -4, 3)
                                             : 0);
        }
        for (int k = 0; k < LOOM_QK_K / 4; k++)
            y[b].qs[k] = 0;
        for (int k = 0; k < LOOM_QK_K / 8; k++)
            y[b].hmask[k] = 0;
        /* stored l = q + 4: two low bits in qs as for Q2_K, the third in hmask bit (h, s) */
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int part = 0; part < 2; part++)
                    for (int l = 0; l < 16; l++) {
                        int v = L[128 * h + 32 * s + 16 * part + l] + 4;
                        y[b].qs[32 * h + 16 * part + l] |= (uint8_t)((v & 3) << (2 * s));
                        y[b].hmask[16 * part + l] |= (uint8_t)((v >> 2) << (4 * h + s));
                    }
    }
}

/* Q4_K / Q5_K: 8 sub-blocks of 32 with unsigned quants (nmax 15 or 31), 6-bit scales and
 * mins packed as loom_k_scale_min reads them. L gets the final quants. */
static inline void loom_quantize_k_subblocks(const float *x, int nmax, uint16_t *d16,
                                             uint16_t *dmin16, uint8_t scales[12], uint8_t *L)
{
    float w[LOOM_QK_K], sc[8], mn[8];
    loom_fit_weights(x, LOOM_QK_K, w);
    for (int j = 0; j < 8; j++) {
        float off;
        sc[j] = loom_fit_offset(32, nmax, x + 32 * j, w + 32 * j, L + 32 * j, &off, 1);
        mn[j] = -off;
    }
    *d16 = loom_f32_to_f16(loom_scale_of_scales(sc, 8, 63.0f));
    *dmin16 = loom_f32_to_f16(loom_scale_of_scales(mn, 8, 63.0f));
    float d = loom_f16_to_f32(*d16), dmin = loom_f16_to_f32(*dmin16);
    for (int k = 0; k < 12; k++)
        scales[k] = 0;
    for (int j = 0; j < 8; j++) {
        int qs = d != 0.0f ? loom_clamp_int(loom_round_nearest(sc[j] / d), 0, 63) : 0;
        int qm = dmin != 0.0f ? loom_clamp_int(loom_round_nearest(mn[j] / dmin), 0, 63) : 0;
        if (j < 4) {
            scales[j] |= (uint8_t)qs;
            scales[j + 4] |= (uint8_t)qm;
        } else {
            scales[j + 4] |= (uint8_t)((qs & 15) | (qm & 15) << 4);
            scales[j - 4] |= (uint8_t)((qs >> 4) << 6);
            scales[j] |= (uint8_t)((qm >> 4) << 6);
        }
        float dl = d * qs, ml = dmin * qm;
        for (int i = 0; i < 32; i++)
            L[32 * j + i] =
                (uint8_t)(dl != 0.0f ? loom_clamp_int(loom_round_nearest((x[32 * j + i] + ml) / dl),
                                                      0, nmax)
                                     : 0);
    }
}

static inline void loom_quantize_row_q4_k(const float *x, loom_block_q4_k *y, int64_t n)
{
    for (int64_t b = 0; b < n / LOOM_QK_K; b++, x += LOOM_QK_K) {
        uint8_t L[LOOM_QK_K];
        loom_quantize_k_subblocks(x, 15, &y[b].d, &y[b].dmin, y[b].scales, L);
        for (int pair = 0; pair < 4; pair++)
            for (int l = 0; l < 32; l++)
                y[b].qs[32 * pair + l] = (uint8_t)(L[64 * pair + l] | L[64 * pair + 32 + l] << 4);
    }
}

static inline void loom_quantize_row_q5_k(const float *x, loom_block_q5_k *y, int64_t n)
{
    for (int64_t b = 0; b < n / LOOM_QK_K; b++, x += LOOM_QK_K) {
        uint8_t L[LOOM_QK_K];
        loom_quantize_k_subblocks(x, 31, &y[b].d, &y[b].dmin, y[b].scales, L);
        for (int l = 0; l < 32; l++)
            y[b].qh[l] = 0;
        for (int pair = 0; pair < 4; pair++)
            for (int l = 0; l < 32; l++) {
                int a = L[64 * pair + l], c = L[64 * pair + 32 + l];
                y[b].qs[32 * pair + l] = (uint8_t)((a & 15) | (c & 15) << 4);
                y[b].qh[l] |= (uint8_t)((a >> 4) << (2 * pair) | (c >> 4) << (2 * pair + 1));
            }
    }
}

static inline void loom_quantize_row_q6_k(const float *x, loom_block_q6_k *y, int64_t n)
{
    for (int64_t b = 0; b < n / LOOM_QK_K; b++, x += LOOM_QK_K) {
        float w[LOOM_QK_K], sc[16];
        int8_t L[LOOM_QK_K];
        loom_fit_weights(x, LOOM_QK_K, w);
        for (int j = 0; j < 16; j++)
            sc[j] = loom_fit_signed(16, 32, x + 16 * j, w + 16 * j, L + 16 * j);
        y[b].d = loom_f32_to_f16(loom_scale_of_scales(sc, 16, -128.0f));
        float d = loom_f16_to_f32(y[b].d);
        for (int j = 0; j < 16; j++) {
            int q = d != 0.0f ? loom_clamp_int(loom_round_nearest(sc[j] / d), -128, 127) : 0;
            y[b].scales[j] = (int8_t)q;
            float dl = d * q;
            for (int i = 0; i < 16; i++)
                L[16 * j + i] = (int8_t)(dl != 0.0f
                                             ? loom_clamp_int(
                                                   loom_round_nearest(x[16 * j + i] / dl), -32, 31)
                                             : 0);
        }
        /* element l + 32 k of half h: nibble of ql[64 h + l + 32 (k & 1)], low for k < 2; its
         * high bits are pair k of qh[32 h + l] (the inverse of the dequantiser) */
        for (int k = 0; k < LOOM_QK_K / 4; k++)
            y[b].qh[k] = 0;
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                int q[4];
                for (int k = 0; k < 4; k++)
                    q[k] = L[128 * h + l + 32 * k] + 32;
                y[b].ql[64 * h + l] = (uint8_t)((q[0] & 15) | (q[2] & 15) << 4);
                y[b].ql[64 * h + l + 32] = (uint8_t)((q[1] & 15) | (q[3] & 15) << 4);
                y[b].qh[32 * h + l] = (uint8_t)((q[0] >> 4) | (q[1] >> 4) << 2 | (q[2] >> 4) << 4 |
                                                (q[3] >> 4) << 6);
            }
    }
}

static inline void loom_quantize_row_iq4_xs(const float *x, loom_block_iq4_xs *y, int64_t n)
{
    for (int64_t b = 0; b < n / LOOM_QK_K; b++, x += LOOM_QK_K) {
        float w[LOOM_QK_K], sc[8];
        uint8_t idx[LOOM_QK_K];
        loom_fit_weights(x, LOOM_QK_K, w);
        for (int j = 0; j < 8; j++)
            sc[j] = loom_fit_iq4(32, x + 32 * j, w + 32 * j, idx + 32 * j);
        y[b].d = loom_f32_to_f16(loom_scale_of_scales(sc, 8, -32.0f));
        float d = loom_f16_to_f32(y[b].d);
        y[b].scales_h = 0;
        for (int k = 0; k < 4; k++)
            y[b].scales_l[k] = 0;
        for (int j = 0; j < 8; j++) {
            int q = d != 0.0f ? loom_clamp_int(loom_round_nearest(sc[j] / d), -32, 31) : 0;
            int u = q + 32;
            y[b].scales_l[j / 2] |= (uint8_t)((u & 15) << (4 * (j % 2)));
            y[b].scales_h = (uint16_t)(y[b].scales_h | (u >> 4) << (2 * j));
            float dl = d * q;
            for (int i = 0; i < 32; i++)
                idx[32 * j + i] = (uint8_t)(dl != 0.0f ? loom_iq4_nearest(x[32 * j + i] / dl) : 8);
            for (int i = 0; i < 16; i++)
                y[b].qs[16 * j + i] = (uint8_t)(idx[32 * j + i] | idx[32 * j + i + 16] << 4);
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
LOOM_QUANT_HD static inline int loom_q5_high(const uint8_t qh[4], int j)
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
LOOM_QUANT_HD static inline int loom_q3_k_scale(const uint8_t scales[12], int s)
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
LOOM_QUANT_HD static inline void loom_k_scale_min(const uint8_t q[12], int j, int *sc, int *m)
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
