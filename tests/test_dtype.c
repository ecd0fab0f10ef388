/*
 * tests/test_dtype.c - the scalar conversions in backend.h against independent expectations:
 * f16 both ways against the CPU's own F16C instructions (every f16 value, and 2^24 f32 values
 * spread over the whole range), bf16 against the definition of round-to-nearest-even, and the
 * block quantisers against their error bounds.
 */
#include <loom/backend.h>

#include "check.h"

#include <immintrin.h>
#include <string.h>

__attribute__((target("f16c"))) static float hw_f16_to_f32(uint16_t h)
{
    return _cvtsh_ss(h);
}

__attribute__((target("f16c"))) static uint16_t hw_f32_to_f16(float f)
{
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
}

static int same_float(float a, float b)
{
    return (isnan(a) && isnan(b)) || loom_bits_from_f32(a) == loom_bits_from_f32(b);
}

static void test_f16(void)
{
    if (!__builtin_cpu_supports("f16c")) {
        printf("f16 checks against F16C skipped: this CPU has no F16C\n");
        return;
    }
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++)
        bad += !same_float(loom_f16_to_f32((uint16_t)h), hw_f16_to_f32((uint16_t)h));
    CHECK(bad == 0, "%d of 65536 f16 values decode differently from F16C", bad);

    bad = 0;
    uint32_t first_bad = 0;
    for (uint64_t i = 0; i < (1ull << 32); i += 251) { /* ~17M f32 bit patterns, all exponents */
        float f = loom_f32_from_bits((uint32_t)i);
        uint16_t a = loom_f32_to_f16(f), b = hw_f32_to_f16(f);
        int nan_both = isnan(f) && (a & 0x7c00) == 0x7c00 && (a & 0x3ff);
        if (a != b && !nan_both && !bad++)
            first_bad = (uint32_t)i;
    }
    CHECK(bad == 0, "%d f32 values encode differently from F16C (first: bits 0x%08x)", bad,
          first_bad);
    /* the rounding boundaries, exactly */
    static const float edges[] = {65504.0f,      65519.99f,      65520.0f,       5.9604645e-8f,
                                  2.9802322e-8f, 2.9802326e-8f,  6.1035156e-5f,  6.1035152e-5f,
                                  1.0009766f,    1.00048828125f, 1.00146484375f, -0.0f};
    for (size_t i = 0; i < sizeof edges / sizeof edges[0]; i++)
        CHECK(loom_f32_to_f16(edges[i]) == hw_f32_to_f16(edges[i]), "edge %.10g: 0x%04x vs 0x%04x",
              edges[i], loom_f32_to_f16(edges[i]), hw_f32_to_f16(edges[i]));
}

/* A bf16 bit pattern as a number, reading the all-ones exponent as an ordinary one, so the
 * value just past the largest finite bf16 has a distance and rounding to it means overflow. */
static double bf16_value_unbounded(uint16_t b)
{
    int e = (b >> 7) & 0xff, m = b & 0x7f;
    double v = e ? ldexp(1.0 + m / 128.0, e - 127) : ldexp(m / 128.0, -126);
    return b & 0x8000 ? -v : v;
}

static void test_bf16(void)
{
    int bad = 0;
    for (uint64_t i = 0; i < (1ull << 32); i += 997) {
        float f = loom_f32_from_bits((uint32_t)i);
        uint16_t b = loom_f32_to_bf16(f);
        uint16_t lo = (uint16_t)(loom_bits_from_f32(f) >> 16); /* truncation */
        if (isnan(f)) {
            bad += !isnan(loom_bf16_to_f32(b));
            continue;
        }
        if (isinf(f)) {
            bad += b != lo;
            continue;
        }
        /* the nearer of the two neighbours; on a tie, the one with an even last bit */
        uint16_t hi = (uint16_t)(lo + 1);
        double dlo = fabs((double)f - bf16_value_unbounded(lo));
        double dhi = fabs((double)f - bf16_value_unbounded(hi));
        uint16_t want = dlo < dhi ? lo : dhi < dlo ? hi : (lo & 1 ? hi : lo);
        bad += b != want;
    }
    CHECK(bad == 0, "%d f32 values round to the wrong bf16", bad);
}

/* The most that rounding v to f16 can move it: half an ulp, which is absolute (2^-25) in the
 * subnormal range that tiny block scales fall into. */
static float f16_error(float v)
{
    return fmaxf(fabsf(v) * 4.8829e-4f, 2.9802322e-8f);
}

static void test_quantisers(void)
{
    float x[4 * LOOM_QK], y[4 * LOOM_QK];
    uint32_t s = 12345;
    for (int i = 0; i < 4 * LOOM_QK; i++) {
        s = s * 1664525u + 1013904223u;
        x[i] = ((float)(s >> 8) / 16777216.0f - 0.5f) * (i < LOOM_QK ? 1e-3f : 7.0f);
    }
    x[LOOM_QK] = 0; /* a block may be mostly anything; make one all zero below */
    for (int i = 2 * LOOM_QK; i < 3 * LOOM_QK; i++)
        x[i] = 0.0f;

    loom_block_q8_0 q8[4];
    loom_quantize_row_q8_0(x, q8, 4 * LOOM_QK);
    loom_dequantize_row_q8_0(q8, y, 4 * LOOM_QK);
    for (int b = 0; b < 4; b++) {
        float d = loom_f16_to_f32(q8[b].d);
        for (int j = 0; j < LOOM_QK; j++) {
            int i = b * LOOM_QK + j;
            /* half a step, plus what rounding d to f16 can add over 127 steps */
            CHECK(fabsf(y[i] - x[i]) <= 0.5f * d + 127.0f * f16_error(d),
                  "q8_0 element %d: %g -> %g (d %g)", i, x[i], y[i], d);
            CHECK(isfinite(y[i]), "q8_0 produced a non-finite value");
        }
    }
    loom_block_q4_0 q40[4];
    loom_quantize_row_q4_0(x, q40, 4 * LOOM_QK);
    loom_dequantize_row_q4_0(q40, y, 4 * LOOM_QK);
    for (int b = 0; b < 4; b++) {
        float d = fabsf(loom_f16_to_f32(q40[b].d));
        for (int j = 0; j < LOOM_QK; j++) {
            int i = b * LOOM_QK + j;
            /* a whole step: the side opposite the largest magnitude reaches only 7d and clamps */
            CHECK(fabsf(y[i] - x[i]) <= d + 8.0f * f16_error(d), "q4_0 element %d: %g -> %g (d %g)",
                  i, x[i], y[i], d);
        }
    }
    loom_block_q4_1 q41[4];
    loom_quantize_row_q4_1(x, q41, 4 * LOOM_QK);
    loom_dequantize_row_q4_1(q41, y, 4 * LOOM_QK);
    for (int b = 0; b < 4; b++) {
        float d = loom_f16_to_f32(q41[b].d), m = loom_f16_to_f32(q41[b].m);
        for (int j = 0; j < LOOM_QK; j++) {
            int i = b * LOOM_QK + j;
            CHECK(fabsf(y[i] - x[i]) <= 0.5f * d + 15.0f * f16_error(d) + f16_error(m),
                  "q4_1 element %d: %g -> %g", i, x[i], y[i]);
        }
    }
    /* the all-zero block decodes to exact zeros in every format */
    CHECK(y[2 * LOOM_QK] == 0.0f, "q4_1 of zeros is not zero");

    /* nibble order: element j in the low nibble of byte j, element j+16 in the high one */
    float ramp[LOOM_QK];
    for (int j = 0; j < LOOM_QK; j++)
        ramp[j] = j < 16 ? -8.0f : 7.0f; /* max magnitude -8: d = 1, q = x + 8 */
    loom_block_q4_0 r;
    loom_quantize_row_q4_0(ramp, &r, LOOM_QK);
    CHECK(loom_f16_to_f32(r.d) == 1.0f && r.qs[0] == 0xf0 && r.qs[15] == 0xf0,
          "q4_0 layout: d %g, qs[0] 0x%02x", loom_f16_to_f32(r.d), r.qs[0]);
    CHECK(sizeof(loom_block_q8_0) == 34 && sizeof(loom_block_q4_0) == 18 &&
              sizeof(loom_block_q4_1) == 20,
          "block sizes must match GGUF's");
    CHECK(loom_row_bytes(LOOM_Q4_0, 33) == -1 && loom_row_bytes(LOOM_Q4_0, 64) == 36,
          "row bytes of block types");
}

int main(void)
{
    test_f16();
    test_bf16();
    test_quantisers();
    return check_finish("test_dtype");
}
