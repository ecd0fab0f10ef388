/*
 * files/quant_mix.c - which type each tensor of a model gets when it is quantised to a "mix"
 * (q4_k_m and the like): the per-tensor choices llama.cpp's quantizer documents and makes, so
 * that loom's files match the ones people download and compare with their published quality.
 *
 * A mix has a base type for most matrices; output.weight gets q6_K (q8_0 and the float
 * types keep theirs); the _M/_L mixes give some attn_v, ffn_down, attn_output and attn_qkv
 * tensors more bits, by layer:
 *   q2_k    attn_v q3_K (q4_K with 4+ query heads per KV head), ffn_down and attn_output q3_K
 *   q3_k_m  attn_v q5_K in the first two layers, q4_K after; ffn_down q5_K in the first
 *           sixteenth of the layers, q4_K after; attn_output q4_K; attn_qkv q4_K
 *   q3_k_l  attn_v, ffn_down and attn_output q5_K; attn_qkv q4_K
 *   q4_k_s  attn_v q5_K in the first four layers, ffn_down q5_K in the first eighth
 *   q4_k_m  attn_v and ffn_down q6_K in "more bits" layers (the first and last eighth, and
 *           every third between); attn_qkv q5_K
 *   q5_k_m  the same with q6_K; attn_qkv q6_K
 *   iq4_nl, iq4_xs: attn_v q5_K with 4+ query heads per KV head
 * Mixture-of-experts models (llama.cpp's rules for them): every tensor whose name holds
 * "ffn_down" (the experts' ffn_down_exps and the shared ffn_down_shexp too) follows ffn_down's
 * rule by the layer its name gives; with exactly 8 experts (Mixtral's count) attn_v and attn_k
 * are q8_0 and attn_output q5_K in the q2_k, q3_k_s/m, q4_k_s/m and iq4 mixes; the router
 * (ffn_gate_inp) and a recurrent layer's conv1d (ssm_conv1d) are never quantised
 * (loom_quant_mix_keeps).
 * A row length the base type's blocks do not divide falls back to a 32-element type (q2_K,
 * q3_K, iq4_xs: iq4_nl; q4_K: q5_0; q5_K: q5_1; q6_K: q8_0), and to f16 when 32 does not
 * divide it either. 1-D tensors (norms, biases) are never quantised.
 */
#define _GNU_SOURCE
#include "api/internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum {
    MIX_PLAIN,
    MIX_Q2_K,
    MIX_Q3_K_S,
    MIX_Q3_K_M,
    MIX_Q3_K_L,
    MIX_Q4_K_S,
    MIX_Q4_K_M,
    MIX_Q5_K_S,
    MIX_Q5_K_M
} mix_kind;

static const struct {
    const char *name;
    loom_dtype base;
    mix_kind kind;
    int file_type; /* llama.cpp's general.file_type for the mix */
} mixes[] = {
    {"f32", LOOM_F32, MIX_PLAIN, 0},        {"f16", LOOM_F16, MIX_PLAIN, 1},
    {"bf16", LOOM_BF16, MIX_PLAIN, 32},     {"q8_0", LOOM_Q8_0, MIX_PLAIN, 7},
    {"q4_0", LOOM_Q4_0, MIX_PLAIN, 2},      {"q4_1", LOOM_Q4_1, MIX_PLAIN, 3},
    {"q5_0", LOOM_Q5_0, MIX_PLAIN, 8},      {"q5_1", LOOM_Q5_1, MIX_PLAIN, 9},
    {"iq4_nl", LOOM_IQ4_NL, MIX_PLAIN, 25}, {"iq4_xs", LOOM_IQ4_XS, MIX_PLAIN, 30},
    {"q2_k", LOOM_Q2_K, MIX_Q2_K, 10},      {"q3_k_s", LOOM_Q3_K, MIX_Q3_K_S, 11},
    {"q3_k_m", LOOM_Q3_K, MIX_Q3_K_M, 12},  {"q3_k_l", LOOM_Q3_K, MIX_Q3_K_L, 13},
    {"q4_k_s", LOOM_Q4_K, MIX_Q4_K_S, 14},  {"q4_k_m", LOOM_Q4_K, MIX_Q4_K_M, 15},
    {"q5_k_s", LOOM_Q5_K, MIX_Q5_K_S, 16},  {"q5_k_m", LOOM_Q5_K, MIX_Q5_K_M, 17},
    {"q6_k", LOOM_Q6_K, MIX_PLAIN, 18},
};
#define N_MIXES (sizeof mixes / sizeof mixes[0])

const char *loom_quantize_types(void)
{
    return loom_quant_mix_names();
}

const char *loom_quant_mix_names(void)
{
    return "f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, iq4_xs, q2_k, q3_k_s, q3_k_m, "
           "q3_k_l, q4_k_s, q4_k_m, q5_k_s, q5_k_m, q6_k";
}

int loom_quant_mix_find(const char *name)
{
    for (size_t i = 0; i < N_MIXES; i++)
        if (!strcasecmp(name, mixes[i].name))
            return (int)i;
    return -1;
}

int loom_quant_mix_file_type(int mix)
{
    return mixes[mix].file_type;
}

loom_dtype loom_quant_mix_base(int mix)
{
    return mixes[mix].base;
}

/* llama.cpp's "more bits" layers: the first and last eighth, and every third in between. */
static int more_bits(int i, int n)
{
    return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;
}

/* The layer of "blk.N.rest", or -1. */
static int layer_of(const char *name)
{
    int layer, used = 0;
    if (sscanf(name, "blk.%d.%n", &layer, &used) == 1 && used > 0)
        return layer;
    return -1;
}

static int ends_with(const char *s, const char *tail)
{
    size_t n = strlen(s), k = strlen(tail);
    return n >= k && !strcmp(s + n - k, tail);
}

/* A type whose blocks fit rows of cols elements, falling back as llama.cpp does. */
static loom_dtype fitting(loom_dtype t, int64_t cols)
{
    if (cols % loom_dtype_block_elems(t) == 0)
        return t;
    switch (t) {
    case LOOM_Q2_K:
    case LOOM_Q3_K:
    case LOOM_IQ4_XS: t = LOOM_IQ4_NL; break;
    case LOOM_Q4_K: t = LOOM_Q5_0; break;
    case LOOM_Q5_K: t = LOOM_Q5_1; break;
    case LOOM_Q6_K: t = LOOM_Q8_0; break;
    default: break;
    }
    return cols % loom_dtype_block_elems(t) == 0 ? t : LOOM_F16;
}

int loom_quant_mix_is_plain(int mix)
{
    return mixes[mix].kind == MIX_PLAIN;
}

int loom_quant_mix_keeps(const char *name)
{
    /* routers, and the recurrent layers' conv1d (kernel-wide rows, as llama.cpp keeps it) */
    return strstr(name, "ffn_gate_inp.weight") != NULL || strstr(name, "ssm_conv1d.weight") != NULL;
}

loom_dtype loom_quant_mix_type(int mix, const char *name, int64_t cols, int n_layer, int n_gqa,
                               int n_expert, int pure)
{
    loom_dtype base = mixes[mix].base, t = base;
    mix_kind k = mixes[mix].kind;
    if (pure)
        return loom_dtype_is_quantized(base) ? fitting(base, cols) : base;
    int layer = layer_of(name);
    int quantised = loom_dtype_is_quantized(base);
    if (!strcmp(name, "output.weight")) {
        if (quantised && base != LOOM_Q8_0)
            t = LOOM_Q6_K;
    } else if (ends_with(name, "attn_v.weight") && layer >= 0) {
        if (k == MIX_Q2_K)
            t = n_gqa >= 4 ? LOOM_Q4_K : LOOM_Q3_K;
        else if (k == MIX_Q3_K_M)
            t = layer < 2 ? LOOM_Q5_K : LOOM_Q4_K;
        else if (k == MIX_Q3_K_L)
            t = LOOM_Q5_K;
        else if ((k == MIX_Q4_K_M || k == MIX_Q5_K_M) && more_bits(layer, n_layer))
            t = LOOM_Q6_K;
        else if (k == MIX_Q4_K_S && layer < 4)
            t = LOOM_Q5_K;
        else if ((base == LOOM_IQ4_NL || base == LOOM_IQ4_XS) && n_gqa >= 4)
            t = LOOM_Q5_K;
        if (n_expert == 8)
            t = LOOM_Q8_0;
    } else if (ends_with(name, "attn_k.weight") && layer >= 0) {
        if (n_expert == 8)
            t = LOOM_Q8_0;
    } else if (strstr(name, "ffn_down") && layer >= 0) {
        if (k == MIX_Q2_K)
            t = LOOM_Q3_K;
        else if (k == MIX_Q3_K_M)
            t = layer < n_layer / 16 ? LOOM_Q5_K : LOOM_Q4_K;
        else if (k == MIX_Q3_K_L)
            t = LOOM_Q5_K;
        else if ((k == MIX_Q4_K_M || k == MIX_Q5_K_M) && more_bits(layer, n_layer))
            t = LOOM_Q6_K;
        else if (k == MIX_Q4_K_S && layer < n_layer / 8)
            t = LOOM_Q5_K;
    } else if (ends_with(name, "attn_output.weight") && layer >= 0 && n_expert == 8) {
        if (k == MIX_Q2_K || k == MIX_Q3_K_S || k == MIX_Q3_K_M || k == MIX_Q4_K_S ||
            k == MIX_Q4_K_M || base == LOOM_IQ4_NL || base == LOOM_IQ4_XS)
            t = LOOM_Q5_K;
    } else if (ends_with(name, "attn_output.weight") && layer >= 0) {
        if (k == MIX_Q2_K)
            t = LOOM_Q3_K;
        else if (k == MIX_Q3_K_M)
            t = LOOM_Q4_K;
        else if (k == MIX_Q3_K_L)
            t = LOOM_Q5_K;
    } else if (ends_with(name, "attn_qkv.weight") && layer >= 0) {
        if (k == MIX_Q3_K_M || k == MIX_Q3_K_L)
            t = LOOM_Q4_K;
        else if (k == MIX_Q4_K_M)
            t = LOOM_Q5_K;
        else if (k == MIX_Q5_K_M)
            t = LOOM_Q6_K;
    }
    return quantised ? fitting(t, cols) : t;
}
