/*
 * models/llama.c - the Llama family's forward pass (GGUF architectures "llama", "qwen2",
 * "qwen3" and "qwen", the last being Qwen v1, GLM-4-0414's "glm4", and the mixture-of-experts
 * "qwen2moe", "qwen3moe" and "glm4moe").
 *
 * One pre-norm decoder block, repeated: RMSNorm -> Q, K, V projections (Qwen2 adds biases) ->
 * RoPE -> store K, V in the cache -> attention over the cache -> output projection ->
 * residual -> RMSNorm -> SwiGLU MLP (silu(gate) * up, down) -> residual; then the final norm
 * and the vocabulary projection (the embedding itself when output.weight is absent: tied).
 * The variations are data, not copies:
 *   - Qwen3 normalises each head of Q and K with its own RMSNorm (q_norm, k_norm, weights
 *     [head_dim]) after the projection and before RoPE, and states head_dim explicitly;
 *   - Qwen v1 projects Q, K and V with one fused matrix and bias (attn_qkv, [q | k | v] along
 *     the output), and its MLP is silu(w2 x) * w1 x: SiLU goes on w2's output, the reverse of
 *     what the names suggest, so w2 is stored as ffn_gate and w1 as ffn_up (llama.cpp's names);
 *   - Qwen2-MoE and Qwen3-MoE replace the MLP with a mixture of experts (models/blocks.c,
 *     loom_ffn_moe): Qwen2-MoE with a sigmoid-gated shared expert, Qwen3-MoE with Qwen3's
 *     attention and none;
 *   - GLM-4-0414 normalises each block's output again before the residual add
 *     (post_attention_norm, post_ffw_norm), projects gate and up with one matrix (ffn_up, [gate;
 *     up] rows), and rotates adjacent pairs of the first half of each head.
 *
 * RoPE: GGUF "llama" files store Q and K with their rows permuted so that rotation pairs are
 * adjacent (the convert tools' permutation of the Hugging Face weights), so they rotate
 * adjacent pairs; the Qwen files keep the Hugging Face order and rotate halves (NeoX style).
 */
#include "blocks.h"
#include "models.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct llama_layer {
    const loom_tensor *attn_norm; /* [n_embd] */
    const loom_tensor *wq, *wk,
        *wv; /* [n_head * head_dim, n_embd], [n_head_kv * head_dim, n_embd] */
    const loom_tensor *bq, *bk, *bv;    /* Qwen2 only, else NULL */
    const loom_tensor *wqkv, *bqkv;     /* Qwen v1: fused instead of wq, wk, wv */
    const loom_tensor *q_norm, *k_norm; /* Qwen3: [head_dim], else NULL */
    const loom_tensor *wo;              /* [n_embd, n_head * head_dim] */
    const loom_tensor *ffn_norm;        /* [n_embd] */
    const loom_tensor *w_gate, *w_up;   /* [n_ff, n_embd]; GLM-4-0414: w_gate [2 n_ff, n_embd]
                                         * is gate and up fused, w_up NULL */
    const loom_tensor *w_down;          /* [n_embd, n_ff] */
    const loom_tensor *attn_post_norm, *ffn_post_norm; /* GLM-4-0414: [n_embd], else NULL */
    loom_moe_weights moe; /* Qwen2/3-MoE: when moe.router is set, instead */
} llama_layer;

typedef struct llama_model {
    const loom_tensor *rope_freqs; /* [n_rot / 2] divisors (Llama 3.1's rope_freqs), or NULL */
    const loom_tensor *tok_embd;   /* [n_vocab, n_embd] */
    const loom_tensor *out_norm;   /* [n_embd] */
    const loom_tensor *output;     /* [n_vocab, n_embd]; the embedding when tied */
    int32_t n_dense;               /* GLM-4.5: the first layers' MLPs are dense */
    llama_layer *layers;
} llama_model;

static void llama_free(void *state)
{
    llama_model *m = state;
    if (m)
        free(m->layers);
    free(m);
}

/* YaRN (rope.scaling.type "yarn": Qwen2.5 and Qwen3 past their trained context), as
 * transformers' _compute_yarn_parameters and ggml's rope_yarn have it: pair i's frequency
 * blends its own (extrapolation) with it divided by factor (interpolation) by a ramp between
 * the pairs that turn beta_fast and beta_slow times over original_context_length, and q and k
 * are scaled by 0.1 ln(factor) + 1. As rope_freqs divisors: 1 / ((1 - e_i) / factor + e_i),
 * e_i the extrapolated share. */
static int yarn_divisors(const loom_gguf *g, const char *arch, loom_hparams *hp, double factor,
                         float *out, char *err, size_t err_size)
{
    const int dim = hp->n_rot;
    double ctx = loom_model_kv_float(g, arch, "rope.scaling.original_context_length",
                                     hp->n_ctx_train);
    double fast = loom_model_kv_float(g, arch, "rope.scaling.yarn_beta_fast", 32.0);
    double slow = loom_model_kv_float(g, arch, "rope.scaling.yarn_beta_slow", 1.0);
    char key[96];
    snprintf(key, sizeof key, "%s.rope.scaling.attn_factor", arch);
    if (loom_gguf_find(g, key) || !(factor >= 1 && factor < 1e6) || !(ctx >= 1) ||
        !(fast > 0 && slow > 0 && fast > slow)) {
        snprintf(
            err, err_size,
            "%s: YaRN with factor %g, original_context_length %g, beta_fast %g, beta_slow %g%s "
            "is not one loom runs",
            arch, factor, ctx, fast, slow, loom_gguf_find(g, key) ? " and an attn_factor" : "");
        return -1;
    }
    const double base = hp->rope_base, two_pi = 2 * 3.14159265358979323846;
    double low = floor(dim * log(ctx / (fast * two_pi)) / (2 * log(base)));
    double high = ceil(dim * log(ctx / (slow * two_pi)) / (2 * log(base)));
    low = low > 0 ? low : 0;
    high = high < dim - 1 ? high : dim - 1;
    if (high == low)
        high += 0.001;
    for (int i = 0; i < dim / 2; i++) {
        double ramp = (i - low) / (high - low);
        ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
        double extrapolated = 1 - ramp;
        out[i] = (float)(1.0 / ((1 - extrapolated) / factor + extrapolated));
    }
    hp->attn_factor = factor > 1 ? (float)(0.1 * log(factor) + 1.0) : 1.0f;
    return 0;
}

static int load(loom_runner *r, loom_hparams *hp, void **state, const char *arch, char *err,
                size_t err_size)
{
    const loom_gguf *g = loom_rt_gguf(r);
    snprintf(hp->arch, sizeof hp->arch, "%s", arch);
    hp->n_embd = (int32_t)loom_model_kv_int(g, arch, "embedding_length", 0);
    hp->n_layer = (int32_t)loom_model_kv_int(g, arch, "block_count", 0);
    hp->n_head = (int32_t)loom_model_kv_int(g, arch, "attention.head_count", 0);
    hp->n_head_kv = (int32_t)loom_model_kv_int(g, arch, "attention.head_count_kv", hp->n_head);
    hp->n_ff = (int32_t)loom_model_kv_int(g, arch, "feed_forward_length", 0);
    hp->n_ctx_train = (int32_t)loom_model_kv_int(g, arch, "context_length", 2048);
    /* Mistral's sliding window, under the key llama.cpp uses for its sliding-window families
     * (its converter writes none for Mistral, whose files then run without a window there) */
    hp->n_swa = (int32_t)loom_model_kv_int(g, arch, "attention.sliding_window", 0);
    hp->norm_eps = (float)loom_model_kv_float(g, arch, "attention.layer_norm_rms_epsilon", 1e-5);
    hp->rope_base = (float)loom_model_kv_float(g, arch, "rope.freq_base", 10000.0);
    /* rope.scaling.type says how rope.scaling.factor applies: linear divides positions;
     * llama.cpp's files without the type carry no factor either (Llama 3.1's scaling is its
     * rope_freqs tensor); one loom does not run is refused rather than run as linear */
    char scaling[32] = "";
    const char *st;
    uint64_t st_len;
    char key[96];
    snprintf(key, sizeof key, "%s.rope.scaling.type", arch);
    if (loom_gguf_get_str(g, key, &st, &st_len) == 0)
        snprintf(scaling, sizeof scaling, "%.*s", (int)(st_len < 31 ? st_len : 31), st);
    double factor = loom_model_kv_float(g, arch, "rope.scaling.factor", 1.0);
    int yarn = !strcmp(scaling, "yarn");
    if (scaling[0] && strcmp(scaling, "linear") && strcmp(scaling, "none") && !yarn) {
        snprintf(err, err_size,
                 "%s.rope.scaling.type is '%s'; loom runs linear scaling, YaRN and Llama 3.1's "
                 "rope_freqs",
                 arch, scaling);
        return -1;
    }
    if (!strcmp(scaling, "none"))
        factor = 1.0;
    /* the runner refuses a factor of 0 or less; YaRN's goes into per-pair divisors instead */
    hp->rope_scale = yarn ? 1.0f : (float)(1.0 / factor);
    int moe = strstr(arch, "moe") != NULL;
    if (moe &&
        loom_moe_read_hparams(g, arch, strcmp(arch, "glm4moe") == 0 ? 2 : 1,
                              strcmp(arch, "qwen3moe") == 0 || strcmp(arch, "glm4moe") == 0, hp,
                              err, err_size) != 0)
        return -1;
    /* GLM-4.5: the first layers keep a dense MLP; the checkpoint's multi-token-prediction
     * layers follow the others in block_count and are not run */
    int64_t n_dense = loom_model_kv_int(g, arch, "leading_dense_block_count", 0);
    int64_t n_nextn = loom_model_kv_int(g, arch, "nextn_predict_layers", 0);
    if (n_nextn < 0 || n_nextn >= hp->n_layer || n_dense < 0 || n_dense > hp->n_layer) {
        snprintf(err, err_size,
                 "%s: nextn_predict_layers %lld or leading_dense_block_count %lld does not fit "
                 "block_count %d",
                 arch, (long long)n_nextn, (long long)n_dense, hp->n_layer);
        return -1;
    }
    hp->n_layer -= (int32_t)n_nextn;
    if (hp->n_embd <= 0 || hp->n_layer <= 0 || hp->n_layer > LOOM_MAX_LAYERS || hp->n_head <= 0 ||
        hp->n_head_kv <= 0 || hp->n_head % hp->n_head_kv ||
        (hp->n_ff <= 0 && (!moe || n_dense > 0))) {
        snprintf(err, err_size,
                 "%s: missing or inconsistent hyper-parameters (embedding_length "
                 "%d, block_count %d, head_count %d, head_count_kv %d, "
                 "feed_forward_length %d)",
                 arch, hp->n_embd, hp->n_layer, hp->n_head, hp->n_head_kv, hp->n_ff);
        return -1;
    }
    if (!strcmp(arch, "qwen")) {
        /* GGUF's qwen.feed_forward_length counts the two FFN halves together (the config's
         * intermediate_size); files loom wrote before it followed that store one half. The
         * FFN's shape says which. */
        const loom_gguf_tensor *up = loom_gguf_find_tensor(g, "blk.0.ffn_up.weight");
        if (!up || up->ne[1] * 2 == hp->n_ff)
            hp->n_ff /= 2;
    }
    hp->head_dim = (int32_t)loom_model_kv_int(g, arch, "attention.key_length",
                                              hp->n_embd / hp->n_head);
    hp->n_rot = (int32_t)loom_model_kv_int(g, arch, "rope.dimension_count", hp->head_dim);
    int glm4 = strcmp(arch, "glm4") == 0;
    if (glm4) /* partial_rotary_factor: Hugging Face's default is half of each head */
        hp->n_rot = (int32_t)loom_model_kv_int(g, arch, "rope.dimension_count", hp->head_dim / 2);
    /* Qwen v1 always fuses Q, K and V; GLM-4-0414 files may (llama.cpp reads either) */
    int fused = strcmp(arch, "qwen") == 0 ||
        (glm4 && loom_gguf_find_tensor(g, "blk.0.attn_qkv.weight") != NULL);
    int head_norms = strncmp(arch, "qwen3", 5) == 0;
    int glm4moe = strcmp(arch, "glm4moe") == 0;
    int optional_norms = glm4moe; /* GLM-4.5's use_qk_norm */
    hp->rope_mode = strcmp(arch, "llama") == 0 || glm4 ? LOOM_ROPE_ADJACENT : LOOM_ROPE_NEOX;

    llama_model *m = calloc(1, sizeof *m);
    if (!m || !(m->layers = calloc((size_t)hp->n_layer, sizeof *m->layers))) {
        llama_free(m);
        snprintf(err, err_size, "out of memory");
        return -1;
    }
    m->n_dense = moe ? (int32_t)n_dense : 0;
    m->rope_freqs = loom_rt_weight(r, "rope_freqs.weight", 0);
    if (yarn) {
        float divisors[512];
        if (m->rope_freqs || hp->n_rot != hp->head_dim || hp->n_rot / 2 > 512) {
            snprintf(err, err_size, "%s: YaRN with %s is not supported", arch,
                     m->rope_freqs ? "rope_freqs.weight as well" : "partial rotary dimensions");
            llama_free(m);
            return -1;
        }
        if (yarn_divisors(g, arch, hp, factor, divisors, err, err_size) != 0) {
            llama_free(m);
            return -1;
        }
        m->rope_freqs = loom_rt_constant(r, divisors, hp->n_rot / 2);
    }
    m->tok_embd = loom_rt_weight(r, "token_embd.weight", 1);
    m->out_norm = loom_rt_weight(r, "output_norm.weight", 1);
    m->output = loom_rt_weight(r, "output.weight", 0);
    if (!m->output)
        m->output = m->tok_embd;
    char name[96];
#define W(field, fmt, req)                                                                         \
    (snprintf(name, sizeof name, fmt, l), m->layers[l].field = loom_rt_weight(r, name, req))
    for (int l = 0; l < hp->n_layer; l++) {
        W(attn_norm, "blk.%d.attn_norm.weight", 1);
        if (fused) {
            W(wqkv, "blk.%d.attn_qkv.weight", 1);
            W(bqkv, "blk.%d.attn_qkv.bias", 0);
        } else {
            W(wq, "blk.%d.attn_q.weight", 1);
            W(wk, "blk.%d.attn_k.weight", 1);
            W(wv, "blk.%d.attn_v.weight", 1);
            W(bq, "blk.%d.attn_q.bias", 0);
            W(bk, "blk.%d.attn_k.bias", 0);
            W(bv, "blk.%d.attn_v.bias", 0);
        }
        if (head_norms || optional_norms) {
            W(q_norm, "blk.%d.attn_q_norm.weight", head_norms);
            W(k_norm, "blk.%d.attn_k_norm.weight", head_norms || m->layers[l].q_norm);
        }
        W(wo, "blk.%d.attn_output.weight", 1);
        /* llama.cpp's glm4moe names the norm before the MLP post_attention_norm (its converter's
         * name for post_attention_layernorm there); loom wrote ffn_norm before 2026-12-07 */
        if (glm4moe)
            W(ffn_norm, "blk.%d.post_attention_norm.weight", 0);
        if (!m->layers[l].ffn_norm)
            W(ffn_norm, "blk.%d.ffn_norm.weight", 1);
        if (moe && l >= n_dense) {
            loom_moe_load(r, l, m->layers[l].ffn_norm, 0, &m->layers[l].moe);
        } else if (glm4) {
            W(w_gate, "blk.%d.ffn_up.weight", 1); /* [gate; up] */
            W(w_down, "blk.%d.ffn_down.weight", 1);
            W(attn_post_norm, "blk.%d.post_attention_norm.weight", 1);
            W(ffn_post_norm, "blk.%d.post_ffw_norm.weight", 1);
        } else {
            W(w_gate, "blk.%d.ffn_gate.weight", 1);
            W(w_up, "blk.%d.ffn_up.weight", 1);
            W(w_down, "blk.%d.ffn_down.weight", 1);
        }
    }
#undef W
    if (loom_rt_status(r)) {
        llama_free(m);
        return -1;
    }
    hp->n_vocab = (int32_t)m->output->ne[1];
    const llama_layer *L0 = &m->layers[0];
    int64_t q_dim = (int64_t)hp->n_head * hp->head_dim,
            kv_dim = (int64_t)hp->n_head_kv * hp->head_dim;
    int shapes_ok = m->tok_embd->ne[0] == hp->n_embd &&
        (fused ? L0->wqkv->ne[1] == q_dim + 2 * kv_dim
               : L0->wq->ne[1] == q_dim && L0->wk->ne[1] == kv_dim) &&
        (!L0->q_norm || (L0->q_norm->ne[0] == hp->head_dim && L0->k_norm->ne[0] == hp->head_dim)) &&
        (!glm4 ||
         (L0->w_gate->ne[1] == 2 * (int64_t)hp->n_ff && L0->attn_post_norm->ne[0] == hp->n_embd &&
          L0->ffn_post_norm->ne[0] == hp->n_embd)) &&
        (!m->rope_freqs ||
         (m->rope_freqs->ne[0] == hp->n_rot / 2 && m->rope_freqs->dtype == LOOM_F32));
    for (int l = 0; moe && shapes_ok && l < hp->n_layer; l++)
        if (m->layers[l].moe.router &&
            !loom_moe_shapes_ok(hp, l, &m->layers[l].moe, err, err_size)) {
            llama_free(m);
            return -1;
        }
    if (!shapes_ok) {
        llama_free(m);
        snprintf(err, err_size, "%s: tensor shapes disagree with the hyper-parameters", arch);
        return -1;
    }
    *state = m;
    return 0;
}

static int llama_load(loom_runner *r, loom_hparams *hp, void **state, char *err, size_t n)
{
    return load(r, hp, state, "llama", err, n);
}

static int qwen2_load(loom_runner *r, loom_hparams *hp, void **state, char *err, size_t n)
{
    return load(r, hp, state, "qwen2", err, n);
}

static int qwen3_load(loom_runner *r, loom_hparams *hp, void **state, char *err, size_t n)
{
    return load(r, hp, state, "qwen3", err, n);
}

static int qwen_load(loom_runner *r, loom_hparams *hp, void **state, char *err, size_t n)
{
    return load(r, hp, state, "qwen", err, n);
}

static int glm4_load(loom_runner *r, loom_hparams *hp, void **state, char *err, size_t n)
{
    return load(r, hp, state, "glm4", err, n);
}

static int qwen2moe_load(loom_runner *r, loom_hparams *hp, void **state, char *err, size_t n)
{
    return load(r, hp, state, "qwen2moe", err, n);
}

static int qwen3moe_load(loom_runner *r, loom_hparams *hp, void **state, char *err, size_t n)
{
    return load(r, hp, state, "qwen3moe", err, n);
}

static int glm4moe_load(loom_runner *r, loom_hparams *hp, void **state, char *err, size_t n)
{
    return load(r, hp, state, "glm4moe", err, n);
}

static int llama_forward(loom_runner *r, void *state, const loom_batch *b)
{
    const llama_model *m = state;
    const loom_hparams *hp = loom_runner_hparams(r);
    const int64_t n = b->n;
    loom_tensor x = loom_rt_scratch(r, LOOM_F32, hp->n_embd, n, 1); /* the residual stream */
    loom_attn_buffers ab = loom_attn_buffers_new(r, hp, n);
    loom_ffn_buffers fb = {.h = ab.h};
    loom_moe_buffers mb = {0};
    if (hp->n_expert)
        mb = loom_moe_buffers_new(r, hp, n, hp->n_ff_shexp > 0);
    if (m->layers[0].w_gate && !m->layers[0].w_up) { /* GLM-4-0414's [gate; up] */
        fb.fused = loom_rt_scratch(r, LOOM_F32, 2 * hp->n_ff, n, 1);
        fb.gate = loom_rt_cols(&fb.fused, 0, hp->n_ff);
        fb.up = loom_rt_cols(&fb.fused, hp->n_ff, hp->n_ff);
        fb.act = loom_rt_scratch(r, LOOM_F32, hp->n_ff, n, 1);
    } else if (!hp->n_expert || m->n_dense) { /* dense layers, all or GLM-4.5's first */
        fb.gate = loom_rt_scratch(r, LOOM_F32, hp->n_ff, n, 1);
        fb.up = loom_rt_scratch(r, LOOM_F32, hp->n_ff, n, 1);
        fb.act = fb.gate;
    }

    int first, end; /* a pipeline stage runs some of the layers */
    loom_rt_layers(r, &first, &end);
    loom_rt_embed(r, m->tok_embd, &x);
    for (int l = first; l < end; l++) {
        const llama_layer *L = &m->layers[l];
        loom_attn_weights w = {.norm = L->attn_norm,
                               .wqkv = L->wqkv,
                               .bqkv = L->bqkv,
                               .wq = L->wq,
                               .wk = L->wk,
                               .wv = L->wv,
                               .bq = L->bq,
                               .bk = L->bk,
                               .bv = L->bv,
                               .q_norm = L->q_norm,
                               .k_norm = L->k_norm,
                               .wo = L->wo,
                               .post_norm = L->attn_post_norm,
                               .rope_freqs = m->rope_freqs};
        loom_attn_block(r, hp, l, &x, &w, &ab);
        loom_ffn_weights f = {.norm = L->ffn_norm,
                              .gate = L->w_gate,
                              .up = L->w_up,
                              .down = L->w_down,
                              .post_norm = L->ffn_post_norm};
        if (L->moe.router)
            loom_ffn_moe(r, hp, &x, &L->moe, &mb);
        else
            loom_ffn_swiglu(r, hp, &x, &f, &fb);
    }
    loom_rt_logits(r, b, &x, m->out_norm, NULL, hp->norm_eps, m->output);
    return loom_rt_status(r);
}

const loom_arch loom_arch_llama = {
    .name = "llama", .load = llama_load, .forward = llama_forward, .free_state = llama_free};
const loom_arch loom_arch_qwen2 = {
    .name = "qwen2", .load = qwen2_load, .forward = llama_forward, .free_state = llama_free};
const loom_arch loom_arch_qwen3 = {
    .name = "qwen3", .load = qwen3_load, .forward = llama_forward, .free_state = llama_free};
const loom_arch loom_arch_qwen = {
    .name = "qwen", .load = qwen_load, .forward = llama_forward, .free_state = llama_free};
const loom_arch loom_arch_glm4 = {
    .name = "glm4", .load = glm4_load, .forward = llama_forward, .free_state = llama_free};
const loom_arch loom_arch_qwen2moe = {
    .name = "qwen2moe", .load = qwen2moe_load, .forward = llama_forward, .free_state = llama_free};
const loom_arch loom_arch_qwen3moe = {
    .name = "qwen3moe", .load = qwen3moe_load, .forward = llama_forward, .free_state = llama_free};
const loom_arch loom_arch_glm4moe = {
    .name = "glm4moe", .load = glm4moe_load, .forward = llama_forward, .free_state = llama_free};

/* ---- Hugging Face forms ----------------------------------------------------------------------
 *
 * LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM share a config and a layout; names
 * and keys follow the convention llama.cpp uses for these GGUF architectures, so the files
 * load there too. Only "llama" permutes Q and K into adjacent-pair order; Qwen2/3 keep rotate
 * half. Qwen2 always has q/k/v biases, Qwen3 only with attention_bias, and adds a per-head
 * RMSNorm of Q and K (q_norm, k_norm). */
#define DECODER_PARAMS                                                                             \
    {"context_length", "max_position_embeddings", LOOM_HF_U32, 2048},                              \
        {"embedding_length", "hidden_size", LOOM_HF_U32, LOOM_HF_REQUIRED},                        \
        {"block_count", "num_hidden_layers", LOOM_HF_U32, LOOM_HF_REQUIRED},                       \
        {"feed_forward_length", "intermediate_size", LOOM_HF_U32, LOOM_HF_REQUIRED},               \
        {"attention.head_count", "num_attention_heads", LOOM_HF_U32, LOOM_HF_REQUIRED},            \
        {"attention.layer_norm_rms_epsilon", "rms_norm_eps", LOOM_HF_F32, 1e-5},                   \
    {                                                                                              \
        "rope.freq_base", "rope_theta", LOOM_HF_F32, 10000.0                                       \
    }
static const loom_hf_param decoder_params[] = {DECODER_PARAMS, {0}};
/* Qwen2-MoE and Qwen3-MoE add the experts' counts and width */
static const loom_hf_param moe_params[] = {
    DECODER_PARAMS,
    {"expert_count", "num_experts", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"expert_used_count", "num_experts_per_tok", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"expert_feed_forward_length", "moe_intermediate_size", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {0}};

/* The heads' width where it is not the embedding's share (Qwen3 states head_dim). */
static void head_width(loom_hf_values *v, int32_t hd)
{
    int32_t n_embd = (int32_t)loom_hf_get(v, "embedding_length");
    int32_t n_head = (int32_t)loom_hf_get(v, "attention.head_count");
    if (hd != n_embd / n_head) {
        loom_hf_set(v, "attention.key_length", LOOM_HF_U32, hd);
        loom_hf_set(v, "attention.value_length", LOOM_HF_U32, hd);
    }
}

/* rope_scaling of rope_type "yarn" as llama.cpp's keys (the loader computes the divisors,
 * yarn_divisors): factor, original_max_position_embeddings (else max_position_embeddings),
 * beta_fast and beta_slow. transformers' other knobs change the attention factor or the ramp
 * in ways loom does not compute, so they are refused rather than ignored. */
static int yarn_keys(const cJSON *cf, loom_hf_values *v, char *err, size_t err_size)
{
    static const char *const refused[] = {"attention_factor", "mscale", "mscale_all_dim"};
    const cJSON *rs = cJSON_GetObjectItem(cf, "rope_scaling");
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        const cJSON *k = cJSON_GetObjectItem(rs, refused[i]);
        if (k && !cJSON_IsNull(k)) {
            snprintf(err, err_size, "rope_scaling.%s (YaRN's attention scaling) is not supported",
                     refused[i]);
            return -1;
        }
    }
    if (cJSON_IsFalse(cJSON_GetObjectItem(rs, "truncate"))) {
        snprintf(err, err_size, "rope_scaling.truncate false (YaRN's ramp) is not supported");
        return -1;
    }
    double factor, fast, slow;
    int64_t ctx, trained = (int64_t)loom_hf_get(v, "context_length");
    if (loom_hf_real(cf, "rope_scaling.factor", 1.0, 0, 1e6, &factor, err, err_size) ||
        loom_hf_int(cf, "rope_scaling.original_max_position_embeddings", trained, 1, INT32_MAX,
                    &ctx, err, err_size) ||
        loom_hf_real(cf, "rope_scaling.beta_fast", 32, 0, 1e6, &fast, err, err_size) ||
        loom_hf_real(cf, "rope_scaling.beta_slow", 1, 0, 1e6, &slow, err, err_size))
        return -1;
    if (factor < 1 || fast <= slow) {
        if (factor < 1)
            snprintf(err, err_size, "rope_scaling (yarn): factor %g must be at least 1", factor);
        else
            snprintf(err, err_size, "rope_scaling (yarn): beta_fast %g must be above beta_slow %g",
                     fast, slow);
        return -1;
    }
    loom_hf_set_str(v, "rope.scaling.type", "yarn");
    loom_hf_set(v, "rope.scaling.factor", LOOM_HF_F32, factor);
    loom_hf_set(v, "rope.scaling.original_context_length", LOOM_HF_U32, (double)ctx);
    if (fast != 32)
        loom_hf_set(v, "rope.scaling.yarn_beta_fast", LOOM_HF_F32, fast);
    if (slow != 1)
        loom_hf_set(v, "rope.scaling.yarn_beta_slow", LOOM_HF_F32, slow);
    return 0;
}

static int decoder_derive(const cJSON *cf, loom_hf_values *v, char *err, size_t err_size)
{
    if (loom_hf_true(cf, "use_sliding_window")) {
        /* Qwen2's windows apply from layer max_window_layers on: not one window for all */
        snprintf(err, err_size, "use_sliding_window (per-layer sliding windows) is not supported");
        return -1;
    }
    int32_t n_embd = (int32_t)loom_hf_get(v, "embedding_length");
    int32_t n_head = (int32_t)loom_hf_get(v, "attention.head_count");
    int64_t n_kv, hd;
    if (loom_hf_int(cf, "num_key_value_heads", n_head, 1, n_head, &n_kv, err, err_size) ||
        loom_hf_int(cf, "head_dim", n_embd / n_head, 1, 65536, &hd, err, err_size))
        return -1;
    if (n_head % n_kv) {
        snprintf(err, err_size,
                 "num_attention_heads %d is not a multiple of num_key_value_heads %lld", n_head,
                 (long long)n_kv);
        return -1;
    }
    loom_hf_set(v, "attention.head_count_kv", LOOM_HF_U32, n_kv);
    loom_hf_set(v, "rope.dimension_count", LOOM_HF_U32, hd);
    head_width(v, (int32_t)hd);
    if (cJSON_IsObject(cJSON_GetObjectItem(cf, "rope_scaling"))) {
        const char *type = loom_hf_str(cf, "rope_scaling.rope_type|rope_scaling.type");
        if (type && !strcmp(type, "llama3"))
            return 0; /* rope_freqs.weight (llama3_rope_freqs) */
        if (type && !strcmp(type, "yarn"))
            return yarn_keys(cf, v, err, err_size);
        if (!type || strcmp(type, "linear") != 0) {
            snprintf(err, err_size,
                     "rope_scaling type '%s' is not supported (linear, yarn and llama3 are)",
                     type ? type : "?");
            return -1;
        }
        double factor;
        if (loom_hf_real(cf, "rope_scaling.factor", 1.0, 0, 1e6, &factor, err, err_size))
            return -1;
        loom_hf_set_str(v, "rope.scaling.type", "linear");
        loom_hf_set(v, "rope.scaling.factor", LOOM_HF_F32, factor);
    }
    return 0;
}

/* Llama 3.1's rope_scaling (rope_type "llama3"), as transformers computes it: a pair whose
 * wavelength is shorter than original_max_position_embeddings / high_freq_factor keeps its
 * frequency, one longer than it / low_freq_factor is divided by factor, and those between
 * blend the two. The divisor of each pair's frequency is what llama.cpp's rope_freqs holds. */
static int llama3_rope_freqs(const cJSON *cf, const loom_hf_values *v, float *factors, int n,
                             char *err, size_t err_size)
{
    const char *type = loom_hf_str(cf, "rope_scaling.rope_type|rope_scaling.type");
    if (!type || strcmp(type, "llama3"))
        return 0;
    double factor, low, high, old_ctx;
    if (loom_hf_real(cf, "rope_scaling.factor", 8.0, 0, 1e6, &factor, err, err_size) ||
        loom_hf_real(cf, "rope_scaling.low_freq_factor", 1.0, 0, 1e6, &low, err, err_size) ||
        loom_hf_real(cf, "rope_scaling.high_freq_factor", 4.0, 0, 1e6, &high, err, err_size) ||
        loom_hf_real(cf, "rope_scaling.original_max_position_embeddings", 8192, 0, 1e9, &old_ctx,
                     err, err_size))
        return -1;
    if (!(high > low)) {
        snprintf(err, err_size, "rope_scaling.high_freq_factor %g must exceed low_freq_factor %g",
                 high, low);
        return -1;
    }
    double base = loom_hf_get(v, "rope.freq_base");
    double low_wavelen = old_ctx / low, high_wavelen = old_ctx / high;
    for (int i = 0; i < n; i++) {
        double freq = pow(base, -2.0 * i / (2.0 * n)), wavelen = 2 * 3.14159265358979323846 / freq;
        if (wavelen < high_wavelen) {
            factors[i] = 1.0f;
        } else if (wavelen > low_wavelen) {
            factors[i] = (float)factor;
        } else {
            double smooth = (old_ctx / wavelen - low) / (high - low);
            factors[i] = (float)(1.0 / ((1.0 - smooth) / factor + smooth));
        }
    }
    return 1;
}

#define DECODER_HEAD                                                                               \
    {"model.embed_tokens.weight", "token_embd.weight", 0, NULL},                                   \
        {"model.norm.weight", "output_norm.weight", 0, NULL},                                      \
        {"lm_head.weight", "output.weight", LOOM_HF_OPTIONAL, NULL},                               \
    {                                                                                              \
        "model.layers.%d.input_layernorm.weight", "blk.%d.attn_norm.weight", 0, NULL               \
    }
#define ATTN_OUT_AND_FFN_NORM                                                                      \
    {"model.layers.%d.self_attn.o_proj.weight", "blk.%d.attn_output.weight", 0, NULL},             \
    {                                                                                              \
        "model.layers.%d.post_attention_layernorm.weight", "blk.%d.ffn_norm.weight", 0, NULL       \
    }
#define DECODER_TAIL                                                                               \
    ATTN_OUT_AND_FFN_NORM,                                                                         \
        {"model.layers.%d.mlp.gate_proj.weight", "blk.%d.ffn_gate.weight", 0, NULL},               \
        {"model.layers.%d.mlp.up_proj.weight", "blk.%d.ffn_up.weight", 0, NULL},                   \
    {                                                                                              \
        "model.layers.%d.mlp.down_proj.weight", "blk.%d.ffn_down.weight", 0, NULL                  \
    }
/* Qwen's separate projections, in Hugging Face's row order (no RoPE permutation) */
#define QKV_WEIGHTS                                                                                \
    {"model.layers.%d.self_attn.q_proj.weight", "blk.%d.attn_q.weight", 0, NULL},                  \
        {"model.layers.%d.self_attn.k_proj.weight", "blk.%d.attn_k.weight", 0, NULL},              \
    {                                                                                              \
        "model.layers.%d.self_attn.v_proj.weight", "blk.%d.attn_v.weight", 0, NULL                 \
    }
/* Qwen3's per-head RMSNorms of Q and K */
#define QK_NORMS                                                                                   \
    {"model.layers.%d.self_attn.q_norm.weight", "blk.%d.attn_q_norm.weight", 0, NULL},             \
    {                                                                                              \
        "model.layers.%d.self_attn.k_norm.weight", "blk.%d.attn_k_norm.weight", 0, NULL            \
    }
#define QKV_BIASES                                                                                 \
    {"model.layers.%d.self_attn.q_proj.bias", "blk.%d.attn_q.bias", LOOM_HF_OPTIONAL, NULL},       \
        {"model.layers.%d.self_attn.k_proj.bias", "blk.%d.attn_k.bias", LOOM_HF_OPTIONAL, NULL},   \
    {                                                                                              \
        "model.layers.%d.self_attn.v_proj.bias", "blk.%d.attn_v.bias", LOOM_HF_OPTIONAL, NULL      \
    }

static const loom_hf_tensor llama_tensors[] = {
    DECODER_HEAD,
    {"model.layers.%d.self_attn.q_proj.weight", "blk.%d.attn_q.weight", LOOM_HF_ROPE_Q, NULL},
    {"model.layers.%d.self_attn.k_proj.weight", "blk.%d.attn_k.weight", LOOM_HF_ROPE_K, NULL},
    {"model.layers.%d.self_attn.v_proj.weight", "blk.%d.attn_v.weight", 0, NULL},
    {"model.layers.%d.self_attn.q_proj.bias", "Llama q/k/v biases are not supported",
     LOOM_HF_UNSUPPORTED, NULL},
    DECODER_TAIL,
    {0}};

/* MistralForCausalLM: Llama's layout and RoPE convention, and sliding_window (null in
 * Mistral v0.2 on: no window). */
static int mistral_derive(const cJSON *cf, loom_hf_values *v, char *err, size_t err_size)
{
    if (decoder_derive(cf, v, err, err_size) != 0)
        return -1;
    int64_t window;
    if (loom_hf_int(cf, "sliding_window", 0, 1, INT32_MAX, &window, err, err_size) != 0)
        return -1;
    if (window)
        loom_hf_set(v, "attention.sliding_window", LOOM_HF_U32, (double)window);
    return 0;
}

/* Qwen2MoeForCausalLM / Qwen3MoeForCausalLM: every layer sparse (decoder_sparse_step 1, no
 * mlp_only_layers, as every released checkpoint), top num_experts_per_tok of a softmax,
 * renormalised when norm_topk_prob says so (transformers' default: not); Qwen2-MoE adds a
 * shared expert of shared_expert_intermediate_size gated by sigmoid(shared_expert_gate x). */
static int moe_derive(const cJSON *cf, loom_hf_values *v, char *err, size_t err_size)
{
    if (decoder_derive(cf, v, err, err_size) != 0)
        return -1;
    int64_t step, shared;
    const cJSON *dense = cJSON_GetObjectItem(cf, "mlp_only_layers");
    if (loom_hf_int(cf, "decoder_sparse_step", 1, 1, INT32_MAX, &step, err, err_size) ||
        loom_hf_int(cf, "shared_expert_intermediate_size", 0, 0, INT32_MAX, &shared, err, err_size))
        return -1;
    const char *why = step != 1 ? "decoder_sparse_step is not 1"
        : dense && !(cJSON_IsArray(dense) && cJSON_GetArraySize(dense) == 0)
        ? "mlp_only_layers is not empty"
        : NULL;
    if (why) {
        snprintf(err, err_size,
                 "%s: some layers would be dense; loom runs mixture-of-experts models whose every "
                 "layer is sparse (as every released Qwen-MoE)",
                 why);
        return -1;
    }
    if (loom_hf_get(v, "expert_used_count") > loom_hf_get(v, "expert_count")) {
        snprintf(err, err_size, "num_experts_per_tok %.0f exceeds num_experts %.0f",
                 loom_hf_get(v, "expert_used_count"), loom_hf_get(v, "expert_count"));
        return -1;
    }
    if (shared)
        loom_hf_set(v, "expert_shared_feed_forward_length", LOOM_HF_U32, (double)shared);
    loom_hf_set(v, "expert_weights_norm", LOOM_HF_BOOL, loom_hf_true(cf, "norm_topk_prob"));
    return 0;
}

#define ROUTED_EXPERTS                                                                             \
    {"model.layers.%d.mlp.gate.weight", "blk.%d.ffn_gate_inp.weight", 0, NULL},                    \
        LOOM_HF_EXPERT_STACKS("model.", 0)
static const loom_hf_tensor qwen2moe_tensors[] = {
    DECODER_HEAD,
    QKV_WEIGHTS,
    QKV_BIASES,
    ATTN_OUT_AND_FFN_NORM,
    ROUTED_EXPERTS,
    {"model.layers.%d.mlp.shared_expert.gate_proj.weight", "blk.%d.ffn_gate_shexp.weight", 0, NULL},
    {"model.layers.%d.mlp.shared_expert.up_proj.weight", "blk.%d.ffn_up_shexp.weight", 0, NULL},
    {"model.layers.%d.mlp.shared_expert.down_proj.weight", "blk.%d.ffn_down_shexp.weight", 0, NULL},
    {"model.layers.%d.mlp.shared_expert_gate.weight", "blk.%d.ffn_gate_inp_shexp.weight", 0, NULL},
    {0}};

/* clang-format off */
static const loom_hf_tensor qwen3moe_tensors[] = {
    DECODER_HEAD, QKV_WEIGHTS, QK_NORMS, QKV_BIASES, ATTN_OUT_AND_FFN_NORM, ROUTED_EXPERTS, {0}};
/* Glm4MoeForCausalLM (GLM-4.5, GLM-4.5-Air, GLM-4.6): Qwen2-like attention with q/k/v biases
 * and NeoX RoPE over partial_rotary_factor of each head (optional Q/K norms, use_qk_norm);
 * first_k_dense_replace dense MLPs, then experts routed by sigmoid scores, chosen with
 * e_score_correction_bias added, renormalised (norm_topk_prob) and scaled by
 * routed_scaling_factor, beside n_shared_experts ungated shared ones, and the choice limited
 * to the best topk_group of n_group groups of experts (GLM-4.5 has one group; DeepSeek-V3's
 * rule); the multi-token-prediction layers a checkpoint carries past num_hidden_layers are not
 * converted. */
static const loom_hf_param glm4moe_params[] = {
    DECODER_PARAMS,
    {"expert_count", "n_routed_experts|num_experts", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"expert_used_count", "num_experts_per_tok", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"expert_feed_forward_length", "moe_intermediate_size", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {0}};

/* GLM's partial_rotary_factor (0.5 when absent, as transformers' Glm4Config): the rotated
 * share of each head, as rope.dimension_count. After decoder_derive. */
static int glm_rotary(const cJSON *cf, loom_hf_values *v, char *err, size_t err_size)
{
    double partial;
    if (loom_hf_real(cf, "partial_rotary_factor", 0.5, 0, 1, &partial, err, err_size))
        return -1;
    int32_t hd = (int32_t)loom_hf_get(v, "rope.dimension_count");
    int32_t n_rot = (int32_t)(hd * partial);
    if (n_rot < 2 || n_rot % 2) {
        snprintf(err, err_size,
                 "partial_rotary_factor %g of head_dim %d is not an even number of dimensions",
                 partial, hd);
        return -1;
    }
    const char *scaling = loom_hf_str(cf, "rope_scaling.rope_type|rope_scaling.type");
    if (scaling && strcmp(scaling, "linear") && n_rot != hd) {
        /* YaRN's and Llama 3.1's per-pair divisors are computed over the whole head */
        snprintf(err, err_size,
                 "rope_scaling '%s' with partial_rotary_factor %g is not supported (linear is)",
                 scaling, partial);
        return -1;
    }
    loom_hf_set(v, "rope.dimension_count", LOOM_HF_U32, n_rot);
    return 0;
}

/* Glm4ForCausalLM (GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1): Llama's decoder with q/k/v biases
 * (attention_bias), adjacent-pair RoPE over partial_rotary_factor of each head, gate and up in
 * one gate_up_proj, and each block's output normalised again before the residual add
 * (post_self_attn_layernorm, post_mlp_layernorm); llama.cpp's GGUF "glm4" names. */
static int glm4_derive(const cJSON *cf, loom_hf_values *v, char *err, size_t err_size)
{
    return decoder_derive(cf, v, err, err_size) || glm_rotary(cf, v, err, err_size) ? -1 : 0;
}

static int glm4moe_derive(const cJSON *cf, loom_hf_values *v, char *err, size_t err_size)
{
    if (decoder_derive(cf, v, err, err_size) != 0 || glm_rotary(cf, v, err, err_size) != 0)
        return -1;
    double scale;
    int64_t dense, shared, groups, topk_groups;
    if (loom_hf_real(cf, "routed_scaling_factor", 1.0, 0, 1e6, &scale, err, err_size) ||
        loom_hf_int(cf, "first_k_dense_replace", 1, 0, INT32_MAX, &dense, err, err_size) ||
        loom_hf_int(cf, "n_shared_experts", 1, 0, 1024, &shared, err, err_size) ||
        loom_hf_int(cf, "n_group", 1, 1, 1024, &groups, err, err_size) ||
        loom_hf_int(cf, "topk_group", 1, 1, 1024, &topk_groups, err, err_size))
        return -1;
    double experts = loom_hf_get(v, "expert_count");
    if (topk_groups > groups || fmod(experts, (double)groups) != 0 ||
        loom_hf_get(v, "expert_used_count") > topk_groups * (experts / (double)groups)) {
        snprintf(err, err_size,
                 "n_group %lld, topk_group %lld: the groups must divide n_routed_experts (%.0f), "
                 "topk_group be at most n_group, and the kept groups hold num_experts_per_tok",
                 (long long)groups, (long long)topk_groups, experts);
        return -1;
    }
    if (groups > 1) {
        loom_hf_set(v, "expert_group_count", LOOM_HF_U32, (double)groups);
        loom_hf_set(v, "expert_group_used_count", LOOM_HF_U32, (double)topk_groups);
    }
    if (dense > loom_hf_get(v, "block_count")) {
        snprintf(err, err_size, "first_k_dense_replace %lld exceeds num_hidden_layers %.0f",
                 (long long)dense, loom_hf_get(v, "block_count"));
        return -1;
    }
    if (loom_hf_get(v, "expert_used_count") > loom_hf_get(v, "expert_count")) {
        snprintf(err, err_size, "num_experts_per_tok %.0f exceeds n_routed_experts %.0f",
                 loom_hf_get(v, "expert_used_count"), loom_hf_get(v, "expert_count"));
        return -1;
    }
    if (dense)
        loom_hf_set(v, "leading_dense_block_count", LOOM_HF_U32, (double)dense);
    if (shared) {
        loom_hf_set(v, "expert_shared_count", LOOM_HF_U32, (double)shared);
        loom_hf_set(v, "expert_shared_feed_forward_length", LOOM_HF_U32,
                    (double)shared * loom_hf_get(v, "expert_feed_forward_length"));
    }
    loom_hf_set(v, "expert_weights_scale", LOOM_HF_F32, scale);
    const cJSON *norm = cJSON_GetObjectItem(cf, "norm_topk_prob");
    loom_hf_set(v, "expert_weights_norm", LOOM_HF_BOOL, !norm || cJSON_IsTrue(norm));
    loom_hf_set(v, "expert_gating_func", LOOM_HF_U32, 2); /* sigmoid */
    return 0;
}

static const loom_hf_tensor glm4moe_tensors[] = {
    DECODER_HEAD,
    QKV_WEIGHTS,
    QKV_BIASES,
    {"model.layers.%d.self_attn.q_norm.weight", "blk.%d.attn_q_norm.weight", 0, NULL},
    {"model.layers.%d.self_attn.k_norm.weight", "blk.%d.attn_k_norm.weight", 0, NULL},
    {"model.layers.%d.self_attn.o_proj.weight", "blk.%d.attn_output.weight", 0, NULL},
    /* llama.cpp's glm4moe name for the norm before the MLP */
    {"model.layers.%d.post_attention_layernorm.weight", "blk.%d.post_attention_norm.weight", 0,
     NULL},
    LOOM_HF_DEEPSEEK_FFN("model."),
    {0}};

static const loom_hf_condition glm4moe_conditions[] = {
    {"model.layers.%d.self_attn.q_norm.weight", "use_qk_norm", "use_qk_norm"},
    {"model.layers.%d.self_attn.k_norm.weight", "use_qk_norm", "use_qk_norm"},
    LOOM_HF_SHARED_EXPERTS_SAID("model."),
    {0}};

static const loom_hf_tensor glm4_tensors[] = {
    DECODER_HEAD,
    QKV_WEIGHTS,
    QKV_BIASES,
    {"model.layers.%d.self_attn.o_proj.weight", "blk.%d.attn_output.weight", 0, NULL},
    {"model.layers.%d.post_self_attn_layernorm.weight", "blk.%d.post_attention_norm.weight", 0,
     NULL},
    {"model.layers.%d.post_attention_layernorm.weight", "blk.%d.ffn_norm.weight", 0, NULL},
    {"model.layers.%d.mlp.gate_up_proj.weight", "blk.%d.ffn_up.weight", 0, NULL},
    {"model.layers.%d.mlp.down_proj.weight", "blk.%d.ffn_down.weight", 0, NULL},
    {"model.layers.%d.post_mlp_layernorm.weight", "blk.%d.post_ffw_norm.weight", 0, NULL},
    {0}};

static const loom_hf_tensor qwen2_tensors[] = {
    DECODER_HEAD, QKV_WEIGHTS, QKV_BIASES, DECODER_TAIL, {0}};
static const loom_hf_tensor qwen3_tensors[] = {
    DECODER_HEAD, QKV_WEIGHTS, QK_NORMS, QKV_BIASES, DECODER_TAIL, {0}};
/* clang-format on */

/* Qwen v1 (QWenLMHeadModel): llama.cpp's "qwen" names. The config counts intermediate_size
 * over w1 and w2 together (22016 for Qwen-7B's two halves of 11008), as GGUF's qwen
 * convention does; the MLP is c_proj(w1(x) * silu(w2(x))), so w2 is the gate. use_dynamic_ntk
 * and use_logn_attn change nothing until a sequence passes seq_length, which loom's context
 * length is capped at. */
static const loom_hf_param qwen_params[] = {
    {"context_length", "seq_length|max_position_embeddings", LOOM_HF_U32, 2048},
    {"embedding_length", "hidden_size", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"block_count", "num_hidden_layers", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"feed_forward_length", "intermediate_size", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"attention.head_count", "num_attention_heads", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"rope.freq_base", "rotary_emb_base", LOOM_HF_F32, 10000.0},
    {"attention.layer_norm_rms_epsilon", "layer_norm_epsilon", LOOM_HF_F32, 1e-6},
    {0}};

static int qwen_derive(const cJSON *cf, loom_hf_values *v, char *err, size_t err_size)
{
    int32_t n_embd = (int32_t)loom_hf_get(v, "embedding_length");
    int32_t n_head = (int32_t)loom_hf_get(v, "attention.head_count");
    int64_t hd;
    double pct;
    if (loom_hf_int(cf, "kv_channels", n_embd / n_head, 1, 65536, &hd, err, err_size) ||
        loom_hf_real(cf, "rotary_pct", 1.0, 0, 1, &pct, err, err_size))
        return -1;
    int32_t n_rot = (int32_t)((double)hd * pct);
    if ((int64_t)loom_hf_get(v, "feed_forward_length") % 2) {
        snprintf(err, err_size, "intermediate_size must be even");
        return -1;
    }
    if (n_rot <= 0 || n_rot % 2 || n_rot > hd) {
        snprintf(err, err_size,
                 "rotary_pct %g of kv_channels %lld is not an even number of "
                 "dimensions",
                 pct, (long long)hd);
        return -1;
    }
    loom_hf_set(v, "attention.head_count_kv", LOOM_HF_U32, n_head);
    loom_hf_set(v, "rope.dimension_count", LOOM_HF_U32, n_rot);
    head_width(v, hd);
    return 0;
}

static const loom_hf_tensor qwen_tensors[] = {
    {"transformer.wte.weight", "token_embd.weight", 0, NULL},
    {"transformer.ln_f.weight", "output_norm.weight", 0, NULL},
    {"lm_head.weight", "output.weight", LOOM_HF_OPTIONAL, NULL},
    {"transformer.h.%d.ln_1.weight", "blk.%d.attn_norm.weight", 0, NULL},
    {"transformer.h.%d.attn.c_attn.weight", "blk.%d.attn_qkv.weight", 0, NULL},
    {"transformer.h.%d.attn.c_attn.bias", "blk.%d.attn_qkv.bias", 0, NULL},
    {"transformer.h.%d.attn.c_proj.weight", "blk.%d.attn_output.weight", 0, NULL},
    {"transformer.h.%d.ln_2.weight", "blk.%d.ffn_norm.weight", 0, NULL},
    {"transformer.h.%d.mlp.w1.weight", "blk.%d.ffn_up.weight", 0, NULL},
    {"transformer.h.%d.mlp.w2.weight", "blk.%d.ffn_gate.weight", 0, NULL},
    {"transformer.h.%d.mlp.c_proj.weight", "blk.%d.ffn_down.weight", 0, NULL},
    {0}};

/* What the tiktoken-ranked vocabularies append. Llama-3.1: Meta's tokenizer.py order, stops
 * <|eom_id|> and <|eot_id|>; Qwen v1: stop <|im_end|>. */
/* clang-format off */
static const char *const llama3_named[] = {
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
    "<|image|>"};
/* clang-format on */
static const loom_hf_specials llama3_specials = {.pre = "llama-bpe",
                                                 .named = llama3_named,
                                                 .n_named = 12,
                                                 .total = 256,
                                                 .filler_fmt = "<|reserved_special_token_%d|>",
                                                 .filler_base = 2 - 12,
                                                 .bos = 0,
                                                 .eos = 1,
                                                 .stops = {8, 9},
                                                 .n_stops = 2};
static const char *const qwen_named[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
static const loom_hf_specials qwen_specials = {.pre = "qwen2",
                                               .named = qwen_named,
                                               .n_named = 3,
                                               .total = 3 + 205,
                                               .filler_fmt = "<|extra_%d|>",
                                               .filler_base = -3,
                                               .bos = -1,
                                               .eos = 0,
                                               .stops = {2},
                                               .n_stops = 1};

const loom_family loom_family_llama = {.arch = &loom_arch_llama,
                                       .chat_template_tiktoken = "llama3",
                                       .hf_model_type = "llama",
                                       .hf_params = decoder_params,
                                       .hf_derive = decoder_derive,
                                       .hf_tensors = llama_tensors,
                                       .hf_rope_freqs = llama3_rope_freqs,
                                       .tiktoken = &llama3_specials};
const loom_family loom_family_mistral = {.arch = &loom_arch_llama,
                                         .hf_model_type = "mistral",
                                         .hf_params = decoder_params,
                                         .hf_derive = mistral_derive,
                                         .hf_tensors = llama_tensors};
const loom_family loom_family_qwen2 = {.arch = &loom_arch_qwen2,
                                       .chat_template = "chatml",
                                       .hf_model_type = "qwen2",
                                       .hf_params = decoder_params,
                                       .hf_derive = decoder_derive,
                                       .hf_tensors = qwen2_tensors};
const loom_family loom_family_qwen3 = {.arch = &loom_arch_qwen3,
                                       .chat_template = "chatml",
                                       .hf_model_type = "qwen3",
                                       .hf_params = decoder_params,
                                       .hf_derive = decoder_derive,
                                       .hf_tensors = qwen3_tensors};
const loom_family loom_family_qwen2moe = {.arch = &loom_arch_qwen2moe,
                                          .chat_template = "chatml",
                                          .hf_model_type = "qwen2_moe",
                                          .hf_params = moe_params,
                                          .hf_derive = moe_derive,
                                          .hf_tensors = qwen2moe_tensors};
const loom_family loom_family_qwen3moe = {.arch = &loom_arch_qwen3moe,
                                          .chat_template = "chatml",
                                          .hf_model_type = "qwen3_moe",
                                          .hf_params = moe_params,
                                          .hf_derive = moe_derive,
                                          .hf_tensors = qwen3moe_tensors};
const loom_family loom_family_glm4 = {.arch = &loom_arch_glm4,
                                      .chat_template = "glm4",
                                      .hf_model_type = "glm4",
                                      .hf_params = decoder_params,
                                      .hf_derive = glm4_derive,
                                      .hf_tensors = glm4_tensors};
const loom_family loom_family_glm4moe = {.arch = &loom_arch_glm4moe,
                                         .chat_template = "glm4",
                                         .hf_model_type = "glm4_moe",
                                         .hf_params = glm4moe_params,
                                         .hf_derive = glm4moe_derive,
                                         .hf_tensors = glm4moe_tensors,
                                         .hf_conditions = glm4moe_conditions};
const loom_family loom_family_qwen = {.arch = &loom_arch_qwen,
                                      .chat_template = "chatml",
                                      .hf_model_type = "qwen",
                                      .hf_params = qwen_params,
                                      .hf_derive = qwen_derive,
                                      .hf_tensors = qwen_tensors,
                                      .tiktoken = &qwen_specials};
