/*
 * files/synthetic.c - deterministic synthetic Llama-shaped models, written as GGUF files, so that
 * `loom bench` (the README's main job) needs no download. Every layer shares one set of
 * random matrices in memory, but each is written at its own place in the file, so reading the
 * model streams the full size from memory as a real one does.
 */
#define _GNU_SOURCE
#include <loom/loom.h>

#include "api/internal.h"
#include "core/gguf.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

typedef struct shape {
    const char *name, *about;
    const char *arch; /* "llama"; the mixture-of-experts ones "qwen2moe", "qwen3moe" */
    int32_t n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, n_vocab, n_ctx;
    /* experts (0: a dense MLP): count, used per token, width, and a shared expert's width
     * (Qwen2-MoE's, sigmoid-gated) */
    int32_t n_expert, n_expert_used, n_ff_exp, n_ff_shexp;
    /* the next token is a fixed function of the current one (speculative decoding's ceiling);
     * 2: a hybrid also carries a multi-token-prediction block that proposes the token after
     * next from the next one's embedding (eh_proj passes it and drops the hidden state), so
     * that the model's own drafter agrees with it */
    int predictable;
    /* a hybrid ("qwen35"): Gated DeltaNet layers with k_heads q/k heads of d_k, v_heads value
     * heads of d_v and a conv kernel, full attention every interval-th layer (its q projected
     * twice as wide, for the gate), rotating n_rot of each head's dims; 0: none */
    struct {
        int32_t k_heads, v_heads, d_k, d_v, kernel, interval, n_rot;
    } hy;
    /* latent attention ("deepseek2"): the q and kv ranks, a head's nope, rope and value
     * widths, the leading dense layers (n_ff wide); the shared expert is ungated, n_ff_shexp
     * wide; 0: none */
    struct {
        int32_t q_lora, kv_lora, nope, rope, v, n_dense;
    } mla;
    /* a chat model: ChatML's two special tokens end the vocabulary, <|im_end|> ends a turn,
     * and the file carries a ChatML template (the suite's stand-in for an instruct model) */
    int chat;
} shape;

/* The MoE shapes keep their models' layers but not their depth (the files stay a few GB); each
 * has a dense twin whose one MLP is as wide as the experts a token runs, the "same active
 * size" model their prefill is compared with. */
/* clang-format off */
static const shape shapes[] = {
    {"tiny", "2 layers, 64 wide, GQA 2/1, head_dim 32: a q8_0 KV cache fits (tests)",
     "llama", 64, 2, 2, 1, 32, 192, 512, 512, 0, 0, 0, 0, 0, {0}, {0}, 0},
    {"tiny-chat", "tiny with ChatML's special tokens and template: a chat model (tests)",
     "llama", 64, 2, 2, 1, 32, 192, 512, 512, 0, 0, 0, 0, 0, {0}, {0}, 1},
    {"tiny-next", "tiny whose next token follows from the current one (tests)",
     "llama", 64, 2, 2, 1, 32, 192, 512, 512, 0, 0, 0, 0, 1, {0}, {0}, 0},
    {"160m", "12 layers, 768 wide (GPT-2-small sized)",
     "llama", 768, 12, 12, 12, 64, 3072, 32000, 2048, 0, 0, 0, 0, 0, {0}, {0}, 0},
    {"1b", "TinyLlama-1.1B: 22 layers, 2048 wide, GQA 32/4",
     "llama", 2048, 22, 32, 4, 64, 5632, 32000, 2048, 0, 0, 0, 0, 0, {0}, {0}, 0},
    {"8b", "Llama-3-8B: 32 layers, 4096 wide, GQA 32/8",
     "llama", 4096, 32, 32, 8, 128, 14336, 128256, 8192, 0, 0, 0, 0, 0, {0}, {0}, 0},
    {"160m-next", "160m whose next token follows from the current one (speculative decoding)",
     "llama", 768, 12, 12, 12, 64, 3072, 32000, 2048, 0, 0, 0, 0, 1, {0}, {0}, 0},
    {"1b-next", "1b whose next token follows from the current one (speculative decoding)",
     "llama", 2048, 22, 32, 4, 64, 5632, 32000, 2048, 0, 0, 0, 0, 1, {0}, {0}, 0},
    {"wide", "1 layer, 4160 wide, one head of 32: a hidden state past 4096 in 9 MB (tests)",
     "llama", 4160, 1, 1, 1, 32, 64, 512, 256, 0, 0, 0, 0, 0, {0}, {0}, 0},
    {"moe-tiny", "2 layers, 64 wide, 8 experts of 64, top 2, a shared expert (tests)",
     "qwen2moe", 64, 2, 2, 1, 32, 0, 512, 512, 8, 2, 64, 128, 0, {0}, {0}, 0},
    {"moe-a2.7b", "Qwen1.5-MoE-A2.7B's layers, 4 of its 24: 2048 wide, 60 experts of 1408, "
                  "top 4, a shared expert of 5632",
     "qwen2moe", 2048, 4, 16, 16, 128, 0, 151936, 4096, 60, 4, 1408, 5632, 0, {0}, {0}, 0},
    {"dense-a2.7b", "moe-a2.7b with one MLP of its active width (4 x 1408 + 5632)",
     "qwen2", 2048, 4, 16, 16, 128, 11264, 151936, 4096, 0, 0, 0, 0, 0, {0}, {0}, 0},
    {"moe-a3b", "Qwen3-30B-A3B's layers, 4 of its 48: 2048 wide, 32/4 heads of 128, 128 "
                "experts of 768, top 8",
     "qwen3moe", 2048, 4, 32, 4, 128, 0, 151936, 4096, 128, 8, 768, 0, 0, {0}, {0}, 0},
    {"dense-a3b", "moe-a3b with one MLP of its active width (8 x 768)",
     "qwen3", 2048, 4, 32, 4, 128, 6144, 151936, 4096, 0, 0, 0, 0, 0, {0}, {0}, 0},
    {"hybrid-tiny-next", "hybrid-tiny whose next token follows from the current one, with an "
                         "MTP block that knows it (the model's own drafter: tests)",
     "qwen35", 64, 4, 2, 1, 32, 192, 512, 512, 0, 0, 0, 0, 2, {2, 4, 16, 16, 4, 4, 8}, {0}, 0},
    {"hybrid-tiny", "4 layers, 64 wide: 3 Gated DeltaNet (2/4 heads of 16) then gated "
                    "attention (tests)",
     "qwen35", 64, 4, 2, 1, 32, 192, 512, 512, 0, 0, 0, 0, 0, {2, 4, 16, 16, 4, 4, 8}, {0}, 0},
    {"qwen35-9b", "Qwen3.5-9B's layers, 4 of its 32: 3 Gated DeltaNet (16/32 heads of 128) "
                  "and 1 gated attention (16/4 heads of 256), 4096 wide, FFN 12288, its "
                  "248320-token vocabulary",
     "qwen35", 4096, 4, 16, 4, 256, 12288, 248320, 4096, 0, 0, 0, 0, 0, {16, 32, 128, 128, 4, 4, 64}, {0}, 0},
    {"dense-qwen35-9b", "qwen35-9b with gated attention in all 4 layers: its twin without "
                        "recurrent layers",
     "qwen35", 4096, 4, 16, 4, 256, 12288, 248320, 4096, 0, 0, 0, 0, 0, {16, 32, 128, 128, 4, 1, 64}, {0}, 0},
    {"qwen35moe-a3b", "Qwen3.5-35B-A3B's layers, 4 of its 40: 3 Gated DeltaNet (16/32 heads of "
                      "128) and 1 gated attention (16/2 heads of 256), 2048 wide, 256 experts of "
                      "512, top 8, a shared expert of 512",
     "qwen35moe", 2048, 4, 16, 2, 256, 0, 248320, 4096, 256, 8, 512, 512, 0,
     {16, 32, 128, 128, 4, 4, 64}, {0}, 0},
    {"dense-qwen35moe-a3b", "qwen35moe-a3b with gated attention in all 4 layers: its twin "
                            "without recurrent layers",
     "qwen35moe", 2048, 4, 16, 2, 256, 0, 248320, 4096, 256, 8, 512, 512, 0,
     {16, 32, 128, 128, 4, 1, 64}, {0}, 0},
    {"mla-tiny", "2 layers, 64 wide: latent attention (4 heads, q rank 32, latent 32 + rope "
                 "32, heads of 32 + 32, values of 32: a q8_0 KV cache fits), a dense first "
                 "layer, then 8 experts of 64, top 2, a shared expert (tests)",
     "deepseek2", 64, 2, 4, 1, 64, 192, 512, 512, 8, 2, 64, 64, 0, {0}, {32, 32, 32, 32, 32, 1}, 0},
    {"mla-tiny-noq", "mla-tiny without the query's low rank: one attn_q, as DeepSeek-V2-Lite "
                     "(tests)",
     "deepseek2", 64, 2, 4, 1, 64, 192, 512, 512, 8, 2, 64, 64, 0, {0}, {0, 32, 32, 32, 32, 1}, 0},
    {"glm47-flash", "GLM-4.7-Flash's layers, 4 of its 47: latent attention (20 heads, q rank "
                    "768, latent 512 + rope 64, heads of 192 + 64 and values of 256), 2048 "
                    "wide, a dense first layer of 10240, then 64 experts of 1536, top 4, a "
                    "shared expert",
     "deepseek2", 2048, 4, 20, 1, 576, 10240, 154880, 4096, 64, 4, 1536, 1536, 0, {0},
     {768, 512, 192, 64, 256, 1}, 0},
};
/* clang-format on */

/* ChatML as Qwen's instruct models write it: a default system turn when the conversation has
 * none, each turn between <|im_start|>ROLE and <|im_end|> */
static const char chatml_template[] =
    "{%- if not messages or messages[0].role != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

static char shape_names[512];

static void list_shapes(void)
{
    size_t at = 0;
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes && at < sizeof shape_names; i++)
        at += (size_t)snprintf(shape_names + at, sizeof shape_names - at, "%s%s", i ? ", " : "",
                               shapes[i].name);
}

const char *loom_synthetic_shapes(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, list_shapes);
    return shape_names;
}

static uint64_t rng_state = 0x853c49e6748fea9bull;

static float rnd(float amp)
{
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return amp * ((float)(rng_state >> 40) / 8388608.0f - 1.0f);
}

/* rows x cols random values in [-amp, amp), stored as dtype t */
static void *random_matrix(loom_dtype t, int64_t rows, int64_t cols, float amp)
{
    int64_t rb = loom_row_bytes(t, cols);
    unsigned char *out = malloc((size_t)(rb * rows));
    float *row = malloc((size_t)cols * sizeof *row);
    if (!out || !row) {
        free(out), free(row);
        return NULL;
    }
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < cols; c++)
            row[c] = rnd(amp);
        loom_row_from_f32(t, row, out + r * rb, cols);
    }
    free(row);
    return out;
}

static const loom_dtype synthetic_types[] = {LOOM_WEIGHT_DTYPES(LOOM_DTYPE_ITEM)};

const char *loom_synthetic_types(void)
{
    return "f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 iq4_nl q2_K q3_K q4_K q5_K q6_K iq4_xs";
}

/* a type name as loom_dtype_name spells it, or lower case (q4_k) */
static int synthetic_type(const char *name, loom_dtype *t)
{
    for (size_t i = 0; i < sizeof synthetic_types / sizeof synthetic_types[0]; i++)
        if (strcasecmp(name, loom_dtype_name(synthetic_types[i])) == 0) {
            *t = synthetic_types[i];
            return 0;
        }
    return -1;
}

/* count copies of one random matrix, back to back: an expert stack whose experts read as
 * much memory as distinct ones would (only their values repeat) */
static void *repeated(const void *one, size_t bytes, int count)
{
    unsigned char *out = one ? malloc(bytes * (size_t)count) : NULL;
    for (int i = 0; out && i < count; i++)
        memcpy(out + bytes * (size_t)i, one, bytes);
    return out;
}

/* The weights one layer's tensors point at (every layer shares them in memory). */
typedef struct synthetic_weights {
    void *embd, *out, *wq, *wk, *wv, *wo, *gate, *up, *down;
    void *router, *gate_exps, *up_exps, *down_exps, *sh_gate, *sh_up, *sh_down, *sh_router;
    float *norm, *head_norm, *bias;
    /* a hybrid's Gated DeltaNet layers: projections, the conv1d (f32), A and dt_bias, the
     * gated norm */
    void *ssm_qkv, *ssm_z, *ssm_alpha, *ssm_beta, *ssm_out;
    float *ssm_conv, *ssm_a, *ssm_dt, *ssm_norm;
    void *eh_proj; /* an MTP block's [2 d, d]: [I 0] */
    /* latent attention's projections and norms (ones), and the experts' choice bias (zeros) */
    void *q_a, *q_b, *kv_a, *k_b, *v_b, *mla_o;
    float *q_a_norm, *kv_a_norm, *choice_bias;
} synthetic_weights;

/* The first token of the plain pieces (after <unk>, <s>, </s> and the 256 bytes). */
#define FIRST_PIECE 259

/* A predictable model's head: the row of token t + 1 (the pieces in a ring) is the embedding
 * of t. The residual stream stays near the current token's embedding (the layers' weights are
 * small, yet read in full every token), so the head scores t + 1 far above any other token:
 * every drafter of the model, however quantised or shallow, agrees with it. Must run right
 * after the embeddings are drawn, with the generator where it was then. */
static void *successor_head(loom_dtype wt, int64_t n_vocab, int64_t d)
{
    uint64_t saved = rng_state;
    rng_state = 0x853c49e6748fea9bull; /* the embeddings' draw, again */
    unsigned char *embd = random_matrix(wt, n_vocab, d, 1.0f);
    rng_state = saved;
    unsigned char *out = embd ? malloc((size_t)(loom_row_bytes(wt, d) * n_vocab)) : NULL;
    int64_t rb = loom_row_bytes(wt, d), pieces = n_vocab - FIRST_PIECE;
    for (int64_t j = 0; out && j < n_vocab; j++) {
        /* the specials and bytes are never next: their rows are a piece's, negated */
        int64_t from = j < FIRST_PIECE ? FIRST_PIECE + j % pieces
                                       : FIRST_PIECE + (j - FIRST_PIECE + pieces - 1) % pieces;
        memcpy(out + j * rb, embd + from * rb, (size_t)rb);
        if (j < FIRST_PIECE) {
            float *row = malloc((size_t)d * sizeof *row);
            if (row) {
                loom_row_to_f32(wt, out + j * rb, row, d);
                for (int64_t c = 0; c < d; c++)
                    row[c] = -row[c];
                loom_row_from_f32(wt, row, out + j * rb, d);
            }
            free(row);
        }
    }
    free(embd);
    return out;
}

static int synthetic_weights_new(synthetic_weights *sw, const shape *sh, loom_dtype wt)
{
    const int64_t d = sh->n_embd, q = (int64_t)sh->n_head * sh->head_dim,
                  kv = (int64_t)sh->n_head_kv * sh->head_dim;
    float amp = 0.5f / (float)sh->n_embd; /* keeps activations tame through the layers */
    memset(sw, 0, sizeof *sw);
    sw->embd = random_matrix(wt, sh->n_vocab, d, 1.0f);
    /* a hybrid's attention projects Q and its gate together */
    sw->wq = random_matrix(wt, sh->hy.interval ? 2 * q : q, d, amp * 16);
    sw->wk = random_matrix(wt, kv, d, amp * 16);
    sw->wv = random_matrix(wt, kv, d, amp * 16);
    sw->wo = random_matrix(wt, d, q, amp * 16);
    int ok = sw->embd && sw->wq && sw->wk && sw->wv && sw->wo;
    if (sh->n_ff) {
        sw->gate = random_matrix(wt, sh->n_ff, d, amp * 16);
        sw->up = random_matrix(wt, sh->n_ff, d, amp * 16);
        sw->down = random_matrix(wt, d, sh->n_ff, amp * 16);
        ok = ok && sw->gate && sw->up && sw->down;
    }
    if (sh->n_expert) {
        const int64_t ff = sh->n_ff_exp, E = sh->n_expert;
        /* the router's rows differ, so tokens spread over the experts as in a real model */
        sw->router = random_matrix(LOOM_F32, E, d, 4.0f / sqrtf((float)d));
        void *g = random_matrix(wt, ff, d, amp * 16), *u = random_matrix(wt, ff, d, amp * 16);
        void *dn = random_matrix(wt, d, ff, amp * 16);
        sw->gate_exps = repeated(g, (size_t)(loom_row_bytes(wt, d) * ff), (int)E);
        sw->up_exps = repeated(u, (size_t)(loom_row_bytes(wt, d) * ff), (int)E);
        sw->down_exps = repeated(dn, (size_t)(loom_row_bytes(wt, ff) * d), (int)E);
        free(g), free(u), free(dn);
        ok = ok && sw->router && sw->gate_exps && sw->up_exps && sw->down_exps;
    }
    if (sh->n_ff_shexp) {
        sw->sh_gate = random_matrix(wt, sh->n_ff_shexp, d, amp * 16);
        sw->sh_up = random_matrix(wt, sh->n_ff_shexp, d, amp * 16);
        sw->sh_down = random_matrix(wt, d, sh->n_ff_shexp, amp * 16);
        sw->sh_router = random_matrix(LOOM_F32, 1, d, 1.0f / sqrtf((float)d));
        ok = ok && sw->sh_gate && sw->sh_up && sw->sh_down && sw->sh_router;
    }
    if (sh->hy.interval) {
        const int64_t hv = sh->hy.v_heads, inner = hv * sh->hy.d_v,
                      C = 2 * (int64_t)sh->hy.k_heads * sh->hy.d_k + inner;
        sw->ssm_qkv = random_matrix(wt, C, d, amp * 16);
        sw->ssm_z = random_matrix(wt, inner, d, amp * 16);
        sw->ssm_alpha = random_matrix(wt, hv, d, amp * 16);
        sw->ssm_beta = random_matrix(wt, hv, d, amp * 16);
        sw->ssm_out = random_matrix(wt, d, inner, amp * 16);
        sw->ssm_conv = random_matrix(LOOM_F32, C, sh->hy.kernel, 0.5f);
        sw->ssm_a = malloc((size_t)hv * sizeof *sw->ssm_a);
        sw->ssm_dt = calloc((size_t)hv, sizeof *sw->ssm_dt);
        sw->ssm_norm = malloc((size_t)sh->hy.d_v * sizeof *sw->ssm_norm);
        ok = ok && sw->ssm_qkv && sw->ssm_z && sw->ssm_alpha && sw->ssm_beta && sw->ssm_out &&
            sw->ssm_conv && sw->ssm_a && sw->ssm_dt && sw->ssm_norm;
        for (int64_t i = 0; ok && i < hv; i++)
            sw->ssm_a[i] = -0.5f; /* a decay of exp(-0.5 softplus(alpha)) a token */
        for (int32_t i = 0; ok && i < sh->hy.d_v; i++)
            sw->ssm_norm[i] = 1.0f;
    }
    if (sh->mla.kv_lora) {
        const int64_t H = sh->n_head, qk = sh->mla.nope + sh->mla.rope;
        const int64_t kvl = sh->mla.kv_lora, ql = sh->mla.q_lora;
        sw->q_a = ql ? random_matrix(wt, ql, d, amp * 16) : NULL;
        /* without a q rank, q_b is the one attn_q [H qk, d] */
        sw->q_b = ql ? random_matrix(wt, H * qk, ql, 0.5f / (float)ql * 16)
                     : random_matrix(wt, H * qk, d, amp * 16);
        sw->kv_a = random_matrix(wt, kvl + sh->mla.rope, d, amp * 16);
        sw->k_b = random_matrix(wt, H * kvl, sh->mla.nope, 0.5f / (float)sh->mla.nope * 16);
        sw->v_b = random_matrix(wt, H * sh->mla.v, kvl, 0.5f / (float)kvl * 16);
        sw->mla_o = random_matrix(wt, d, H * sh->mla.v, amp * 16);
        sw->q_a_norm = malloc((size_t)(ql ? ql : 1) * sizeof *sw->q_a_norm);
        sw->kv_a_norm = malloc((size_t)kvl * sizeof *sw->kv_a_norm);
        sw->choice_bias = calloc((size_t)(sh->n_expert ? sh->n_expert : 1), sizeof(float));
        ok = ok && (sw->q_a || !ql) && sw->q_b && sw->kv_a && sw->k_b && sw->v_b && sw->mla_o &&
            sw->q_a_norm && sw->kv_a_norm && sw->choice_bias;
        for (int64_t i = 0; ok && i < ql; i++)
            sw->q_a_norm[i] = 1.0f;
        for (int64_t i = 0; ok && i < kvl; i++)
            sw->kv_a_norm[i] = 1.0f;
    }
    if (sh->predictable == 2) { /* eh_proj: the embedding's half passed as it is */
        float *eh = calloc((size_t)(2 * d), sizeof *eh);
        const int64_t rb = loom_row_bytes(wt, 2 * d);
        unsigned char *m = malloc((size_t)(rb * d));
        for (int64_t r = 0; eh && m && r < d; r++) {
            eh[r] = 1.0f;
            loom_row_from_f32(wt, eh, m + r * rb, 2 * d);
            eh[r] = 0.0f;
        }
        free(eh);
        sw->eh_proj = m;
        ok = ok && m;
    }
    sw->out = sh->predictable ? successor_head(wt, sh->n_vocab, d)
                              : random_matrix(wt, sh->n_vocab, d, amp * 16);
    sw->norm = malloc((size_t)d * sizeof *sw->norm);
    sw->head_norm = malloc((size_t)sh->head_dim * sizeof *sw->head_norm);
    sw->bias = calloc((size_t)(q > kv ? q : kv), sizeof *sw->bias);
    if (!ok || !sw->out || !sw->norm || !sw->head_norm || !sw->bias)
        return -1;
    for (int64_t i = 0; i < d; i++)
        sw->norm[i] = 1.0f;
    for (int32_t i = 0; i < sh->head_dim; i++)
        sw->head_norm[i] = 1.0f;
    return 0;
}

static void synthetic_weights_free(synthetic_weights *sw)
{
    void *all[] = {sw->embd,      sw->out,       sw->wq,          sw->wk,        sw->wv,
                   sw->wo,        sw->gate,      sw->up,          sw->down,      sw->router,
                   sw->gate_exps, sw->up_exps,   sw->down_exps,   sw->sh_gate,   sw->sh_up,
                   sw->sh_down,   sw->sh_router, sw->norm,        sw->head_norm, sw->bias,
                   sw->ssm_qkv,   sw->ssm_z,     sw->ssm_alpha,   sw->ssm_beta,  sw->ssm_out,
                   sw->ssm_conv,  sw->ssm_a,     sw->ssm_dt,      sw->ssm_norm,  sw->q_a,
                   sw->q_b,       sw->kv_a,      sw->k_b,         sw->v_b,       sw->mla_o,
                   sw->q_a_norm,  sw->kv_a_norm, sw->choice_bias, sw->eh_proj};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        free(all[i]);
}

/* Layer l's tensors, llama.cpp's names and shapes for sh->arch. Returns nonzero when one was
 * refused (a row not a whole number of wt's blocks). */
static int add_layer(loom_gguf_writer *w, const shape *sh, loom_dtype wt,
                     const synthetic_weights *sw, int l)
{
    const int64_t d = sh->n_embd, q = (int64_t)sh->n_head * sh->head_dim,
                  kv = (int64_t)sh->n_head_kv * sh->head_dim, E = sh->n_expert, ff = sh->n_ff_exp,
                  fs = sh->n_ff_shexp;
    const int qwen2 = !strncmp(sh->arch, "qwen2", 5), qwen3 = !strncmp(sh->arch, "qwen3", 5);
    int bad = 0;
    char t[64];
#define ADD(suffix, type, nd, data, ...)                                                           \
    do {                                                                                           \
        int64_t ne[] = {__VA_ARGS__};                                                              \
        snprintf(t, sizeof t, "blk.%d.%s", l, suffix);                                             \
        bad |= loom_gguf_add_tensor(w, t, type, nd, ne, data);                                     \
    } while (0)
    ADD("attn_norm.weight", LOOM_F32, 1, sw->norm, d);
    if (sh->mla.kv_lora) { /* llama.cpp's deepseek2 names */
        const int64_t H = sh->n_head, qk = sh->mla.nope + sh->mla.rope, kvl = sh->mla.kv_lora;
        if (sh->mla.q_lora) {
            ADD("attn_q_a.weight", wt, 2, sw->q_a, d, sh->mla.q_lora);
            ADD("attn_q_a_norm.weight", LOOM_F32, 1, sw->q_a_norm, sh->mla.q_lora);
            ADD("attn_q_b.weight", wt, 2, sw->q_b, sh->mla.q_lora, H * qk);
        } else {
            ADD("attn_q.weight", wt, 2, sw->q_b, d, H * qk);
        }
        ADD("attn_kv_a_mqa.weight", wt, 2, sw->kv_a, d, kvl + sh->mla.rope);
        ADD("attn_kv_a_norm.weight", LOOM_F32, 1, sw->kv_a_norm, kvl);
        ADD("attn_k_b.weight", wt, 3, sw->k_b, sh->mla.nope, kvl, H);
        ADD("attn_v_b.weight", wt, 3, sw->v_b, kvl, sh->mla.v, H);
        ADD("attn_output.weight", wt, 2, sw->mla_o, H * sh->mla.v, d);
        ADD("ffn_norm.weight", LOOM_F32, 1, sw->norm, d);
        if (l < sh->mla.n_dense) {
            ADD("ffn_gate.weight", wt, 2, sw->gate, d, sh->n_ff);
            ADD("ffn_up.weight", wt, 2, sw->up, d, sh->n_ff);
            ADD("ffn_down.weight", wt, 2, sw->down, sh->n_ff, d);
            return bad;
        }
        ADD("ffn_gate_inp.weight", LOOM_F32, 2, sw->router, d, E);
        ADD("exp_probs_b.bias", LOOM_F32, 1, sw->choice_bias, E);
        ADD("ffn_gate_exps.weight", wt, 3, sw->gate_exps, d, ff, E);
        ADD("ffn_up_exps.weight", wt, 3, sw->up_exps, d, ff, E);
        ADD("ffn_down_exps.weight", wt, 3, sw->down_exps, ff, d, E);
        ADD("ffn_gate_shexp.weight", wt, 2, sw->sh_gate, d, fs);
        ADD("ffn_up_shexp.weight", wt, 2, sw->sh_up, d, fs);
        ADD("ffn_down_shexp.weight", wt, 2, sw->sh_down, fs, d);
        return bad;
    }
    if (sh->hy.interval) { /* llama.cpp's qwen35 / qwen35moe names */
        const int64_t hv = sh->hy.v_heads, inner = hv * sh->hy.d_v,
                      C = 2 * (int64_t)sh->hy.k_heads * sh->hy.d_k + inner;
        if ((l + 1) % sh->hy.interval && l < sh->n_layer) {
            ADD("attn_qkv.weight", wt, 2, sw->ssm_qkv, d, C);
            ADD("attn_gate.weight", wt, 2, sw->ssm_z, d, inner);
            ADD("ssm_alpha.weight", wt, 2, sw->ssm_alpha, d, hv);
            ADD("ssm_beta.weight", wt, 2, sw->ssm_beta, d, hv);
            ADD("ssm_conv1d.weight", LOOM_F32, 2, sw->ssm_conv, sh->hy.kernel, C);
            ADD("ssm_a", LOOM_F32, 1, sw->ssm_a, hv);
            ADD("ssm_dt.bias", LOOM_F32, 1, sw->ssm_dt, hv);
            ADD("ssm_norm.weight", LOOM_F32, 1, sw->ssm_norm, sh->hy.d_v);
            ADD("ssm_out.weight", wt, 2, sw->ssm_out, inner, d);
        } else {
            ADD("attn_q.weight", wt, 2, sw->wq, d, 2 * q);
            ADD("attn_k.weight", wt, 2, sw->wk, d, kv);
            ADD("attn_v.weight", wt, 2, sw->wv, d, kv);
            ADD("attn_q_norm.weight", LOOM_F32, 1, sw->head_norm, sh->head_dim);
            ADD("attn_k_norm.weight", LOOM_F32, 1, sw->head_norm, sh->head_dim);
            ADD("attn_output.weight", wt, 2, sw->wo, q, d);
        }
        ADD("post_attention_norm.weight", LOOM_F32, 1, sw->norm, d);
        if (l == sh->n_layer) { /* the MTP block after the trunk */
            ADD("nextn.eh_proj.weight", wt, 2, sw->eh_proj, 2 * d, d);
            ADD("nextn.enorm.weight", LOOM_F32, 1, sw->norm, d);
            ADD("nextn.hnorm.weight", LOOM_F32, 1, sw->norm, d);
            ADD("nextn.shared_head_norm.weight", LOOM_F32, 1, sw->norm, d);
        }
    } else {
        ADD("attn_q.weight", wt, 2, sw->wq, d, q);
        ADD("attn_k.weight", wt, 2, sw->wk, d, kv);
        ADD("attn_v.weight", wt, 2, sw->wv, d, kv);
        if (qwen2) { /* Qwen2's q/k/v biases */
            ADD("attn_q.bias", LOOM_F32, 1, sw->bias, q);
            ADD("attn_k.bias", LOOM_F32, 1, sw->bias, kv);
            ADD("attn_v.bias", LOOM_F32, 1, sw->bias, kv);
        }
        if (qwen3) { /* Qwen3's per-head norms */
            ADD("attn_q_norm.weight", LOOM_F32, 1, sw->head_norm, sh->head_dim);
            ADD("attn_k_norm.weight", LOOM_F32, 1, sw->head_norm, sh->head_dim);
        }
        ADD("attn_output.weight", wt, 2, sw->wo, q, d);
        ADD("ffn_norm.weight", LOOM_F32, 1, sw->norm, d);
    }
    if (!E) {
        ADD("ffn_gate.weight", wt, 2, sw->gate, d, sh->n_ff);
        ADD("ffn_up.weight", wt, 2, sw->up, d, sh->n_ff);
        ADD("ffn_down.weight", wt, 2, sw->down, sh->n_ff, d);
        return bad;
    }
    ADD("ffn_gate_inp.weight", LOOM_F32, 2, sw->router, d, E);
    ADD("ffn_gate_exps.weight", wt, 3, sw->gate_exps, d, ff, E);
    ADD("ffn_up_exps.weight", wt, 3, sw->up_exps, d, ff, E);
    ADD("ffn_down_exps.weight", wt, 3, sw->down_exps, ff, d, E);
    if (fs) {
        ADD("ffn_gate_shexp.weight", wt, 2, sw->sh_gate, d, fs);
        ADD("ffn_up_shexp.weight", wt, 2, sw->sh_up, d, fs);
        ADD("ffn_down_shexp.weight", wt, 2, sw->sh_down, fs, d);
        ADD("ffn_gate_inp_shexp.weight", LOOM_F32, 2, sw->sh_router, d, 1);
    }
#undef ADD
    return bad;
}

int loom_write_synthetic_model(const char *path, const char *shape_name, const char *type_name,
                               char *err, size_t err_size)
{
    return loom_write_synthetic_model_vocab(path, shape_name, type_name, NULL, err, err_size);
}

int loom_write_synthetic_model_vocab(const char *path, const char *shape_name,
                                     const char *type_name, const char *vocab_from, char *err,
                                     size_t err_size)
{
    const shape *sh = NULL;
    shape with_vocab;
    loom_gguf src;
    int have_src = 0;
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        if (strcmp(shapes[i].name, shape_name) == 0)
            sh = &shapes[i];
    if (sh && vocab_from) { /* another model's tokenizer: its vocabulary sizes the model */
        if (loom_open_model_file(vocab_from, &src, NULL, NULL, err, err_size) != 0)
            return -1;
        have_src = 1;
        const loom_gguf_kv *toks = loom_gguf_find(&src, "tokenizer.ggml.tokens");
        if (!toks || toks->count == 0 || toks->count > (1u << 20)) {
            snprintf(err, err_size, "%s has no vocabulary (tokenizer.ggml.tokens)", vocab_from);
            loom_gguf_close(&src);
            return -1;
        }
        with_vocab = *sh;
        with_vocab.n_vocab = (int32_t)toks->count;
        sh = &with_vocab;
    }
    loom_dtype wt;
    if (!sh) {
        snprintf(err, err_size, "no synthetic shape '%s' (there are: %s)", shape_name,
                 loom_synthetic_shapes());
        return -1;
    }
    if (synthetic_type(type_name, &wt)) {
        snprintf(err, err_size, "weight type '%s' is not one of %s", type_name,
                 loom_synthetic_types());
        return -1;
    }
    const int64_t block = loom_dtype_block_elems(wt);
    const int32_t widths[] = {sh->n_embd,
                              sh->n_ff,
                              (int32_t)sh->n_head * sh->head_dim,
                              sh->n_ff_exp,
                              sh->n_ff_shexp,
                              sh->hy.v_heads * sh->hy.d_v,
                              sh->mla.q_lora,
                              sh->mla.kv_lora,
                              sh->mla.nope,
                              sh->n_head * sh->mla.v};
    for (size_t i = 0; i < sizeof widths / sizeof widths[0]; i++)
        if (widths[i] % block) {
            snprintf(err, err_size,
                     "the %s shape's rows of %d are not whole %s blocks of %lld: choose another "
                     "type (q8_0 and q4_0 fit every shape) or shape",
                     sh->name, widths[i], type_name, (long long)block);
            return -1;
        }
    rng_state = 0x853c49e6748fea9bull; /* the same model every time */
    synthetic_weights sw;
    char **tokens = calloc((size_t)sh->n_vocab, sizeof *tokens);
    float *scores = calloc((size_t)sh->n_vocab, sizeof *scores);
    int32_t *types = calloc((size_t)sh->n_vocab, sizeof *types);
    loom_gguf_writer *w = loom_gguf_writer_create();
    int rc = -1;
    if (synthetic_weights_new(&sw, sh, wt) != 0 || !tokens || !scores || !types || !w) {
        snprintf(err, err_size, "out of memory building the synthetic model");
        goto done;
    }
    /* a vocabulary that round-trips text: specials, the 256 bytes, then plain pieces */
    for (int32_t i = 0; i < sh->n_vocab; i++) {
        char buf[32];
        int type = 1;
        if (i < 3) {
            snprintf(buf, sizeof buf, "%s", i == 0 ? "<unk>" : i == 1 ? "<s>" : "</s>");
            type = i == 0 ? 2 : 3;
        } else if (sh->chat && i >= sh->n_vocab - 2) {
            snprintf(buf, sizeof buf, "%s", i == sh->n_vocab - 2 ? "<|im_start|>" : "<|im_end|>");
            type = 3;
        } else if (i < 3 + 256) {
            snprintf(buf, sizeof buf, "<0x%02X>", i - 3);
            type = 6;
        } else {
            snprintf(buf, sizeof buf, "\xe2\x96\x81w%d", i);
            scores[i] = -(float)i;
        }
        tokens[i] = strdup(buf);
        types[i] = type;
        if (!tokens[i]) {
            snprintf(err, err_size, "out of memory");
            goto done;
        }
    }
    char name[64], key[96];
    snprintf(name, sizeof name, "synthetic-%s-%s", sh->name, type_name);
    loom_gguf_set_str(w, "general.architecture", sh->arch);
    loom_gguf_set_str(w, "general.name", name);
#define ARCH_U32(suffix, value)                                                                    \
    (snprintf(key, sizeof key, "%s.%s", sh->arch, suffix),                                         \
     loom_gguf_set_u32(w, key, (uint32_t)(value)))
    ARCH_U32("context_length", sh->n_ctx);
    ARCH_U32("embedding_length", sh->n_embd);
    ARCH_U32("block_count", sh->n_layer + (sh->predictable == 2));
    if (sh->predictable == 2)
        ARCH_U32("nextn_predict_layers", 1);
    if (sh->n_ff)
        ARCH_U32("feed_forward_length", sh->n_ff);
    ARCH_U32("attention.head_count", sh->n_head);
    ARCH_U32("attention.head_count_kv", sh->n_head_kv);
    ARCH_U32("rope.dimension_count",
             sh->mla.rope       ? sh->mla.rope
                 : sh->hy.n_rot ? sh->hy.n_rot
                                : sh->head_dim);
    if (sh->hy.interval) {
        ARCH_U32("ssm.conv_kernel", sh->hy.kernel);
        ARCH_U32("ssm.state_size", sh->hy.d_k);
        ARCH_U32("ssm.group_count", sh->hy.k_heads);
        ARCH_U32("ssm.time_step_rank", sh->hy.v_heads);
        ARCH_U32("ssm.inner_size", sh->hy.v_heads * sh->hy.d_v);
        ARCH_U32("full_attention_interval", sh->hy.interval);
        /* the multimodal RoPE sections llama.cpp's qwen35 loaders require: Qwen's [11, 11, 10]
         * for 32 rotated pairs, in proportion for others */
        const int32_t pairs = sh->hy.n_rot / 2;
        const int32_t sections[4] = {(pairs + 2) / 3, (pairs + 1) / 3, pairs / 3, 0};
        snprintf(key, sizeof key, "%s.rope.dimension_sections", sh->arch);
        loom_gguf_set_i32_array(w, key, sections, 4);
    }
    if (sh->mla.kv_lora) {
        if (sh->mla.q_lora)
            ARCH_U32("attention.q_lora_rank", sh->mla.q_lora);
        ARCH_U32("attention.kv_lora_rank", sh->mla.kv_lora);
        ARCH_U32("attention.key_length_mla", sh->mla.nope + sh->mla.rope);
        ARCH_U32("attention.value_length_mla", sh->mla.v);
        ARCH_U32("leading_dense_block_count", sh->mla.n_dense);
        ARCH_U32("expert_shared_count", 1);
        ARCH_U32("expert_gating_func", 2);
        ARCH_U32("expert_weights_norm", 1);
    }
    if (sh->head_dim != sh->n_embd / sh->n_head || sh->hy.interval) {
        ARCH_U32("attention.key_length", sh->head_dim);
        ARCH_U32("attention.value_length", sh->head_dim);
    }
    if (sh->n_expert) {
        ARCH_U32("expert_count", sh->n_expert);
        ARCH_U32("expert_used_count", sh->n_expert_used);
        ARCH_U32("expert_feed_forward_length", sh->n_ff_exp);
        if (sh->n_ff_shexp && !sh->mla.kv_lora)
            ARCH_U32("expert_shared_feed_forward_length", sh->n_ff_shexp);
    }
#undef ARCH_U32
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", sh->arch);
    loom_gguf_set_f32(w, key, 1e-5f);
    if (have_src) {
        for (uint64_t i = 0; i < src.n_kv; i++)
            if (!strncmp(src.kv[i].key, "tokenizer.", 10) &&
                loom_gguf_copy_kv(w, &src, &src.kv[i]) != 0) {
                snprintf(err, err_size, "out of memory copying %s's tokenizer", vocab_from);
                goto done;
            }
    } else {
        loom_gguf_set_str(w, "tokenizer.ggml.model", "llama");
        loom_gguf_set_str_array(w, "tokenizer.ggml.tokens", (const char *const *)tokens,
                                (uint64_t)sh->n_vocab);
        loom_gguf_set_f32_array(w, "tokenizer.ggml.scores", scores, (uint64_t)sh->n_vocab);
        loom_gguf_set_i32_array(w, "tokenizer.ggml.token_type", types, (uint64_t)sh->n_vocab);
        loom_gguf_set_u32(w, "tokenizer.ggml.bos_token_id", 1);
        loom_gguf_set_u32(w, "tokenizer.ggml.eos_token_id", sh->chat ? sh->n_vocab - 1 : 2);
        if (sh->chat) { /* as Qwen's: the template opens every prompt, no BOS before it */
            loom_gguf_set_str(w, "tokenizer.chat_template", chatml_template);
            loom_gguf_set_bool(w, "tokenizer.ggml.add_bos_token", 0);
        }
    }
    int64_t ne_embd[] = {sh->n_embd, sh->n_vocab}, ne_norm[] = {sh->n_embd};
    int bad = loom_gguf_add_tensor(w, "token_embd.weight", wt, 2, ne_embd, sw.embd);
    bad |= loom_gguf_add_tensor(w, "output_norm.weight", LOOM_F32, 1, ne_norm, sw.norm);
    bad |= loom_gguf_add_tensor(w, "output.weight", wt, 2, ne_embd, sw.out);
    for (int l = 0; l < sh->n_layer + (sh->predictable == 2); l++)
        bad |= add_layer(w, sh, wt, &sw, l);
    if (bad) {
        snprintf(err, err_size, "synthetic %s: a dimension is not a multiple of %s's block",
                 sh->name, type_name);
        goto done;
    }
    rc = loom_gguf_write(w, path, err, err_size);
done:
    for (int32_t i = 0; tokens && i < sh->n_vocab; i++)
        free(tokens[i]);
    free(tokens), free(scores), free(types);
    synthetic_weights_free(&sw);
    loom_gguf_writer_free(w);
    if (have_src)
        loom_gguf_close(&src);
    return rc;
}
