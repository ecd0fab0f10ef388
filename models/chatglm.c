/*
 * models/chatglm.c - ChatGLM2 / ChatGLM3 / GLM-4 (GGUF architecture "chatglm") and ChatGLM-6B,
 * the first version (GGUF architecture "chatglm1", loom's own convention: docs/gguf.md).
 *
 * A pre-norm decoder like Llama's, with three differences the Hugging Face code has:
 *   - Q, K and V come from one fused projection with a bias: rows [Q (heads); K (groups);
 *     V (groups)], multi-query groups for K and V;
 *   - RoPE covers only the first half of each head, on adjacent pairs (the original ChatGLM
 *     rotary embedding), with base 10000 x rope_ratio; the second half passes unchanged;
 *   - the MLP's first projection is fused too: [gate; up], and silu applies to the gate half.
 */
#include "blocks.h"
#include "models.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct glm_layer {
    const loom_tensor *attn_norm; /* [n_embd] */
    const loom_tensor *wqkv;      /* [(n_head + 2 * n_head_kv) * head_dim, n_embd] */
    const loom_tensor *bqkv;      /* [(n_head + 2 * n_head_kv) * head_dim] or NULL */
    const loom_tensor *wo;        /* [n_embd, n_head * head_dim] */
    const loom_tensor *ffn_norm;  /* [n_embd] */
    const loom_tensor *w_up;      /* [2 * n_ff, n_embd]: gate rows, then up rows */
    const loom_tensor *w_down;    /* [n_embd, n_ff] */
} glm_layer;

typedef struct glm_model {
    const loom_tensor *tok_embd, *out_norm, *output;
    glm_layer *layers;
} glm_model;

static void glm_free(void *state)
{
    glm_model *m = state;
    if (m)
        free(m->layers);
    free(m);
}

static int glm_load(loom_runner *r, loom_hparams *hp, void **state, char *err, size_t err_size)
{
    const loom_gguf *g = loom_rt_gguf(r);
    snprintf(hp->arch, sizeof hp->arch, "chatglm");
    hp->n_embd = (int32_t)loom_model_kv_int(g, "chatglm", "embedding_length", 0);
    hp->n_layer = (int32_t)loom_model_kv_int(g, "chatglm", "block_count", 0);
    hp->n_head = (int32_t)loom_model_kv_int(g, "chatglm", "attention.head_count", 0);
    hp->n_head_kv = (int32_t)loom_model_kv_int(g, "chatglm", "attention.head_count_kv", hp->n_head);
    hp->n_ff = (int32_t)loom_model_kv_int(g, "chatglm", "feed_forward_length", 0);
    hp->n_ctx_train = (int32_t)loom_model_kv_int(g, "chatglm", "context_length", 8192);
    hp->norm_eps = (float)loom_model_kv_float(g, "chatglm", "attention.layer_norm_rms_epsilon",
                                              1e-5);
    hp->rope_base = (float)loom_model_kv_float(g, "chatglm", "rope.freq_base", 10000.0);
    hp->rope_scale = 1.0f;
    if (hp->n_embd <= 0 || hp->n_layer <= 0 || hp->n_layer > LOOM_MAX_LAYERS || hp->n_head <= 0 ||
        hp->n_head_kv <= 0 || hp->n_head % hp->n_head_kv || hp->n_ff <= 0) {
        snprintf(err, err_size, "chatglm: missing or inconsistent hyper-parameters");
        return -1;
    }
    hp->head_dim = (int32_t)loom_model_kv_int(g, "chatglm", "attention.key_length",
                                              hp->n_embd / hp->n_head);
    hp->n_rot = (int32_t)loom_model_kv_int(g, "chatglm", "rope.dimension_count", hp->head_dim / 2);
    hp->rope_mode = LOOM_ROPE_ADJACENT;
    glm_model *m = calloc(1, sizeof *m);
    if (!m || !(m->layers = calloc((size_t)hp->n_layer, sizeof *m->layers))) {
        glm_free(m);
        snprintf(err, err_size, "out of memory");
        return -1;
    }
    m->tok_embd = loom_rt_weight(r, "token_embd.weight", 1);
    m->out_norm = loom_rt_weight(r, "output_norm.weight", 1);
    m->output = loom_rt_weight(r, "output.weight", 1);
    char name[96];
#define W(field, fmt, req)                                                                         \
    (snprintf(name, sizeof name, fmt, l), m->layers[l].field = loom_rt_weight(r, name, req))
    for (int l = 0; l < hp->n_layer; l++) {
        W(attn_norm, "blk.%d.attn_norm.weight", 1);
        W(wqkv, "blk.%d.attn_qkv.weight", 1);
        W(bqkv, "blk.%d.attn_qkv.bias", 0);
        W(wo, "blk.%d.attn_output.weight", 1);
        W(ffn_norm, "blk.%d.ffn_norm.weight", 1);
        W(w_up, "blk.%d.ffn_up.weight", 1);
        W(w_down, "blk.%d.ffn_down.weight", 1);
    }
#undef W
    if (loom_rt_status(r)) {
        glm_free(m);
        return -1;
    }
    hp->n_vocab = (int32_t)m->output->ne[1];
    if (m->layers[0].wqkv->ne[1] != (int64_t)(hp->n_head + 2 * hp->n_head_kv) * hp->head_dim ||
        m->layers[0].w_up->ne[1] != 2 * (int64_t)hp->n_ff) {
        glm_free(m);
        snprintf(err, err_size, "chatglm: fused tensor shapes disagree with the hyper-parameters");
        return -1;
    }
    *state = m;
    return 0;
}

static int glm_forward(loom_runner *r, void *state, const loom_batch *b)
{
    const glm_model *m = state;
    const loom_hparams *hp = loom_runner_hparams(r);
    const int64_t n = b->n;
    loom_tensor x = loom_rt_scratch(r, LOOM_F32, hp->n_embd, n, 1);
    loom_attn_buffers ab = loom_attn_buffers_new(r, hp, n);
    /* dense_h_to_4h is [gate; up] in one matrix */
    loom_ffn_buffers fb = {.h = ab.h, .fused = loom_rt_scratch(r, LOOM_F32, 2 * hp->n_ff, n, 1)};
    fb.gate = loom_rt_cols(&fb.fused, 0, hp->n_ff);
    fb.up = loom_rt_cols(&fb.fused, hp->n_ff, hp->n_ff);
    fb.act = loom_rt_scratch(r, LOOM_F32, hp->n_ff, n, 1);

    int first, end; /* a pipeline stage runs some of the layers */
    loom_rt_layers(r, &first, &end);
    loom_rt_embed(r, m->tok_embd, &x);
    for (int l = first; l < end; l++) {
        const glm_layer *L = &m->layers[l];
        loom_attn_weights w = {.norm = L->attn_norm, .wqkv = L->wqkv, .bqkv = L->bqkv, .wo = L->wo};
        loom_attn_block(r, hp, l, &x, &w, &ab);
        loom_ffn_weights f = {.norm = L->ffn_norm, .gate = L->w_up, .down = L->w_down};
        loom_ffn_swiglu(r, hp, &x, &f, &fb);
    }
    loom_rt_logits(r, b, &x, m->out_norm, NULL, hp->norm_eps, m->output);
    return loom_rt_status(r);
}

const loom_arch loom_arch_chatglm = {
    .name = "chatglm", .load = glm_load, .forward = glm_forward, .free_state = glm_free};

/* ---- ChatGLM-6B (v1) -------------------------------------------------------------------------
 *
 * What the Hugging Face modeling_chatglm.py of THUDM/chatglm-6b does, and loom with it:
 *   - LayerNorm (with bias) rather than RMSNorm, biases on every projection, GELU (tanh form);
 *   - "post-LN-ish" residuals: a = LN1(x) * alpha + attn(LN1(x)); out = LN2(a) * alpha +
 *     mlp(LN2(a)), alpha = sqrt(2 * 28): GLMBlock's default num_layers is 28 and ChatGLMModel
 *     never passes the real count, so alpha is 28-layer's for every model (chatglm.cpp agrees);
 *   - 2-D RoPE: the first half of each head is rotated by the position id, the second half by
 *     the block position id, each as rotate-half over head_dim / 2 dims;
 *   - the prompt ends "... [gMASK] <sop>": tokens up to [gMASK] attend to each other both
 *     ways; from <sop> on the model is causal. Position ids stop at [gMASK]'s index, block
 *     positions count 1, 2, 3 ... from <sop>.
 * The converter stores the fused QKV rows de-interleaved ([Q; K; V], each head's dims in
 * order; Hugging Face interleaves q, k, v per head), so the projection splits like ChatGLM2's.
 */
typedef struct glm1_layer {
    const loom_tensor *attn_norm, *attn_norm_b, *wqkv, *bqkv, *wo, *bo;
    const loom_tensor *ffn_norm, *ffn_norm_b, *w_up, *b_up, *w_down, *b_down;
} glm1_layer;

typedef struct glm1_model {
    const loom_tensor *tok_embd, *out_norm, *out_norm_b, *output;
    glm1_layer *layers;
    float alpha;
    int32_t gmask; /* the [gMASK] token id, -1 when the vocabulary has none */
} glm1_model;

static void glm1_free(void *state)
{
    glm1_model *m = state;
    if (m)
        free(m->layers);
    free(m);
}

/* The id of [gMASK]: the explicit key, else found by name in the vocabulary. */
static int32_t find_gmask(const loom_gguf *g)
{
    int64_t id;
    if (loom_gguf_get_i64(g, "tokenizer.ggml.gmask_token_id", &id) == 0)
        return (int32_t)id;
    const loom_gguf_kv *tokens = loom_gguf_find(g, "tokenizer.ggml.tokens");
    for (uint64_t i = 0; tokens && tokens->type == LOOM_GGUF_ARRAY && i < tokens->count; i++) {
        const char *t;
        uint64_t len;
        if (loom_gguf_array_str(g, tokens, i, &t, &len) == 0 && len == 7 &&
            memcmp(t, "[gMASK]", 7) == 0)
            return (int32_t)i;
    }
    return -1;
}

static int glm1_load(loom_runner *r, loom_hparams *hp, void **state, char *err, size_t err_size)
{
    const loom_gguf *g = loom_rt_gguf(r);
    snprintf(hp->arch, sizeof hp->arch, "chatglm1");
    hp->n_embd = (int32_t)loom_model_kv_int(g, "chatglm1", "embedding_length", 0);
    hp->n_layer = (int32_t)loom_model_kv_int(g, "chatglm1", "block_count", 0);
    hp->n_head = (int32_t)loom_model_kv_int(g, "chatglm1", "attention.head_count", 0);
    hp->n_head_kv = hp->n_head;
    hp->n_ff = (int32_t)loom_model_kv_int(g, "chatglm1", "feed_forward_length", 0);
    hp->n_ctx_train = (int32_t)loom_model_kv_int(g, "chatglm1", "context_length", 2048);
    hp->norm_eps = (float)loom_model_kv_float(g, "chatglm1", "attention.layer_norm_epsilon", 1e-5);
    hp->rope_base = (float)loom_model_kv_float(g, "chatglm1", "rope.freq_base", 10000.0);
    hp->rope_scale = 1.0f;
    if (hp->n_embd <= 0 || hp->n_layer <= 0 || hp->n_layer > LOOM_MAX_LAYERS || hp->n_head <= 0 ||
        hp->n_embd % hp->n_head || hp->n_ff <= 0 || (hp->n_embd / hp->n_head) % 4) {
        snprintf(err, err_size, "chatglm1: missing or inconsistent hyper-parameters");
        return -1;
    }
    hp->head_dim = hp->n_embd / hp->n_head;
    hp->n_rot = hp->head_dim;
    hp->rope_mode = LOOM_ROPE_GLM_2D;
    glm1_model *m = calloc(1, sizeof *m);
    if (!m || !(m->layers = calloc((size_t)hp->n_layer, sizeof *m->layers))) {
        glm1_free(m);
        snprintf(err, err_size, "out of memory");
        return -1;
    }
    m->alpha = (float)loom_model_kv_float(g, "chatglm1", "residual_scale", sqrt(2.0 * 28));
    m->gmask = find_gmask(g);
    m->tok_embd = loom_rt_weight(r, "token_embd.weight", 1);
    m->out_norm = loom_rt_weight(r, "output_norm.weight", 1);
    m->out_norm_b = loom_rt_weight(r, "output_norm.bias", 1);
    m->output = loom_rt_weight(r, "output.weight", 1);
    char name[96];
#define W(field, fmt)                                                                              \
    (snprintf(name, sizeof name, fmt, l), m->layers[l].field = loom_rt_weight(r, name, 1))
    for (int l = 0; l < hp->n_layer; l++) {
        W(attn_norm, "blk.%d.attn_norm.weight");
        W(attn_norm_b, "blk.%d.attn_norm.bias");
        W(wqkv, "blk.%d.attn_qkv.weight");
        W(bqkv, "blk.%d.attn_qkv.bias");
        W(wo, "blk.%d.attn_output.weight");
        W(bo, "blk.%d.attn_output.bias");
        W(ffn_norm, "blk.%d.ffn_norm.weight");
        W(ffn_norm_b, "blk.%d.ffn_norm.bias");
        W(w_up, "blk.%d.ffn_up.weight");
        W(b_up, "blk.%d.ffn_up.bias");
        W(w_down, "blk.%d.ffn_down.weight");
        W(b_down, "blk.%d.ffn_down.bias");
    }
#undef W
    if (loom_rt_status(r)) {
        glm1_free(m);
        return -1;
    }
    hp->n_vocab = (int32_t)m->output->ne[1];
    if (m->layers[0].wqkv->ne[1] != 3 * (int64_t)hp->n_embd ||
        m->layers[0].w_up->ne[1] != hp->n_ff) {
        glm1_free(m);
        snprintf(err, err_size, "chatglm1: tensor shapes disagree with the hyper-parameters");
        return -1;
    }
    *state = m;
    return 0;
}

/* Everything up to and including the last [gMASK] attends both ways. */
static int32_t glm1_prefix_len(void *state, const int32_t *ids, int32_t n)
{
    const glm1_model *m = state;
    for (int32_t i = n - 1; m->gmask >= 0 && i >= 0; i--)
        if (ids[i] == m->gmask)
            return i + 1;
    return 0;
}

static int glm1_forward(loom_runner *r, void *state, const loom_batch *b)
{
    const glm1_model *m = state;
    const loom_hparams *hp = loom_runner_hparams(r);
    const int64_t n = b->n, d = hp->n_embd, hd = hp->head_dim, H = hp->n_head;

    /* position ids stop at [gMASK]; block positions count from <sop> */
    int32_t *p1 = malloc((size_t)n * 2 * sizeof *p1), *p2 = p1 ? p1 + n : NULL;
    if (!p1)
        return -1;
    for (int64_t t = 0; t < n; t++) {
        int32_t pl = b->prefix_len ? b->prefix_len[b->seq[t]] : 0, pos = b->pos[t];
        p1[t] = pl > 0 && pos >= pl ? pl - 1 : pos;
        p2[t] = pl > 0 && pos >= pl ? pos - pl + 1 : 0;
    }
    loom_tensor pos1 = loom_rt_upload_i32(r, p1, n), pos2 = loom_rt_upload_i32(r, p2, n);
    free(p1);

    loom_tensor x = loom_rt_scratch(r, LOOM_F32, d, n, 1);
    loom_tensor h = loom_rt_scratch(r, LOOM_F32, d, n, 1);
    loom_tensor o = loom_rt_scratch(r, LOOM_F32, d, n, 1);
    loom_tensor qkv = loom_rt_scratch(r, LOOM_F32, 3 * d, n, 1);
    loom_tensor att = loom_rt_scratch(r, LOOM_F32, d, n, 1);
    loom_tensor up = loom_rt_scratch(r, LOOM_F32, hp->n_ff, n, 1);
    loom_tensor q3 = loom_rt_heads(&qkv, 0, hd, H);
    loom_tensor k3 = loom_rt_heads(&qkv, H * hd, hd, H);
    loom_tensor v3 = loom_rt_heads(&qkv, 2 * H * hd, hd, H);
    loom_tensor att3 = loom_rt_reshape(&att, hd, H, n);
    const float scale = 1.0f / sqrtf((float)hd);

    int first, end; /* a pipeline stage runs some of the layers */
    loom_rt_layers(r, &first, &end);
    loom_rt_embed(r, m->tok_embd, &x);
    for (int l = first; l < end; l++) {
        const glm1_layer *L = &m->layers[l];
        loom_rt_layer_norm(r, &x, L->attn_norm, L->attn_norm_b, hp->norm_eps, &h);
        loom_rt_matmul(r, &h, L->wqkv, L->bqkv, &qkv);
        loom_rt_rope_at(r, &q3, hp, &pos1, &pos2);
        loom_rt_rope_at(r, &k3, hp, &pos1, &pos2);
        loom_rt_kv_store(r, &k3, loom_rt_kcache(r, l));
        loom_rt_kv_store(r, &v3, loom_rt_vcache(r, l));
        loom_rt_attention(r, &q3, l, scale, &att3);
        loom_rt_matmul(r, &att, L->wo, L->bo, &o);
        loom_rt_scale(r, &h, m->alpha, &x); /* the residual is the normed input, scaled */
        loom_rt_add(r, &x, &o, &x);
        loom_rt_layer_norm(r, &x, L->ffn_norm, L->ffn_norm_b, hp->norm_eps, &h);
        loom_rt_matmul(r, &h, L->w_up, L->b_up, &up);
        loom_rt_gelu(r, &up, &up);
        loom_rt_matmul(r, &up, L->w_down, L->b_down, &o);
        loom_rt_scale(r, &h, m->alpha, &x);
        loom_rt_add(r, &x, &o, &x);
    }
    loom_rt_logits(r, b, &x, m->out_norm, m->out_norm_b, hp->norm_eps, m->output);
    return loom_rt_status(r);
}

const loom_arch loom_arch_chatglm1 = {.name = "chatglm1",
                                      .load = glm1_load,
                                      .forward = glm1_forward,
                                      .free_state = glm1_free,
                                      .prefix_len = glm1_prefix_len};

/* ---- Hugging Face forms ----------------------------------------------------------------------
 *
 * ChatGLM2/3 and GLM-4 (model_type "chatglm"): llama.cpp's "chatglm" names. ChatGLM2/3 ship a
 * SentencePiece model, and their tokenizer appends nine specials after its pieces, "[gMASK]
 * sop" starting every prompt; GLM-4 ships tiktoken ranks as tokenizer.model. */
static const loom_hf_param glm_params[] = {
    {"context_length", "seq_length", LOOM_HF_U32, 8192},
    {"embedding_length", "hidden_size", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"block_count", "num_layers", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"feed_forward_length", "ffn_hidden_size", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"attention.head_count", "num_attention_heads", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"attention.layer_norm_rms_epsilon", "layernorm_epsilon", LOOM_HF_F32, 1e-5},
    {0}};

static int glm_derive(const cJSON *cf, loom_hf_values *v, char *err, size_t err_size)
{
    if (!loom_hf_true(cf, "rmsnorm")) {
        snprintf(err, err_size,
                 "a ChatGLM with LayerNorm but without ChatGLM-6B's config keys "
                 "(position_encoding_2d, inner_hidden_size): loom does not know it");
        return -1;
    }
    int32_t n_head = (int32_t)loom_hf_get(v, "attention.head_count");
    int32_t n_embd = (int32_t)loom_hf_get(v, "embedding_length");
    int64_t n_kv = n_head, hd;
    double rope_ratio;
    if ((loom_hf_true(cf, "multi_query_attention") &&
         loom_hf_int(cf, "multi_query_group_num", 1, 1, n_head, &n_kv, err, err_size)) ||
        loom_hf_int(cf, "kv_channels", n_embd / n_head, 2, 65536, &hd, err, err_size) ||
        loom_hf_real(cf, "rope_ratio", 1.0, 0, 1e6, &rope_ratio, err, err_size))
        return -1;
    if (n_head % n_kv) {
        snprintf(err, err_size,
                 "num_attention_heads %d is not a multiple of multi_query_group_num %lld", n_head,
                 (long long)n_kv);
        return -1;
    }
    loom_hf_set(v, "attention.head_count_kv", LOOM_HF_U32, n_kv);
    loom_hf_set(v, "attention.key_length", LOOM_HF_U32, hd);
    loom_hf_set(v, "rope.dimension_count", LOOM_HF_U32, hd / 2); /* the first half rotates */
    loom_hf_set(v, "rope.freq_base", LOOM_HF_F32, 10000.0 * rope_ratio);
    return 0;
}

static const loom_hf_tensor glm_tensors[] = {
    {"transformer.embedding.word_embeddings.weight", "token_embd.weight", 0, NULL},
    {"transformer.encoder.final_layernorm.weight", "output_norm.weight", 0, NULL},
    {"transformer.output_layer.weight", "output.weight", 0, NULL},
    {"transformer.encoder.layers.%d.input_layernorm.weight", "blk.%d.attn_norm.weight", 0, NULL},
    {"transformer.encoder.layers.%d.self_attention.query_key_value.weight",
     "blk.%d.attn_qkv.weight", 0, NULL},
    {"transformer.encoder.layers.%d.self_attention.query_key_value.bias", "blk.%d.attn_qkv.bias",
     LOOM_HF_OPTIONAL, NULL},
    {"transformer.encoder.layers.%d.self_attention.dense.weight", "blk.%d.attn_output.weight", 0,
     NULL},
    {"transformer.encoder.layers.%d.post_attention_layernorm.weight", "blk.%d.ffn_norm.weight", 0,
     NULL},
    {"transformer.encoder.layers.%d.mlp.dense_h_to_4h.weight", "blk.%d.ffn_up.weight", 0, NULL},
    {"transformer.encoder.layers.%d.mlp.dense_4h_to_h.weight", "blk.%d.ffn_down.weight", 0, NULL},
    {0}};

/* ChatGLM2/3's appended specials; in a user's text its tokenizer reads the four role tokens,
 * and only when tokenizer_config.json says encode_special_tokens (ChatGLM3's does). */
static const char *const glm3_named[] = {"[MASK]",   "[gMASK]",       "[sMASK]",
                                         "sop",      "eop",           "<|system|>",
                                         "<|user|>", "<|assistant|>", "<|observation|>"};
static const loom_hf_specials glm3_specials = {.named = glm3_named,
                                               .n_named = 9,
                                               .total = 9,
                                               .bos = -1,
                                               .eos = -1,
                                               .prefix = {1, 3},
                                               .n_prefix = 2,
                                               .text_specials = {5, 6, 7, 8},
                                               .n_text_specials = 4,
                                               .text_specials_when = "encode_special_tokens"};
/* GLM-4's, after its ranks; stops <|endoftext|>, <|user|>, <|observation|>, as its
 * generation_config.json lists them */
/* clang-format off */
static const char *const glm4_named[] = {
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
    "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>",
    "<|begin_of_video|>", "<|end_of_video|>"};
/* clang-format on */
static const loom_hf_specials glm4_specials = {.pre = "chatglm-bpe",
                                               .named = glm4_named,
                                               .n_named = 14,
                                               .total = 14,
                                               .bos = -1,
                                               .eos = 0,
                                               .stops = {0, 7, 9},
                                               .n_stops = 3,
                                               .prefix = {2, 4},
                                               .n_prefix = 2};

const loom_family loom_family_chatglm = {.arch = &loom_arch_chatglm,
                                         .chat_template = "chatglm3",
                                         .chat_template_tiktoken = "glm4",
                                         .hf_model_type = "chatglm",
                                         .hf_params = glm_params,
                                         .hf_derive = glm_derive,
                                         .hf_tensors = glm_tensors,
                                         .tiktoken = &glm4_specials,
                                         .spm_specials = &glm3_specials};

/* ChatGLM-6B (model_type "chatglm" with position_encoding_2d): loom's "chatglm1" convention
 * (docs/gguf.md), its tokenizer from ice_text.model; Q, K, V interleaved per head in the fused
 * projection are reordered to [Q; K; V]. */
static const loom_hf_param glm1_params[] = {
    {"context_length", "max_sequence_length", LOOM_HF_U32, 2048},
    {"embedding_length", "hidden_size", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"block_count", "num_layers", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"attention.head_count", "num_attention_heads", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"attention.layer_norm_epsilon", "layernorm_epsilon", LOOM_HF_F32, 1e-5},
    {"rope.freq_base", NULL, LOOM_HF_F32, 10000.0},
    {0}};

static int glm1_derive(const cJSON *cf, loom_hf_values *v, char *err, size_t err_size)
{
    int32_t n_embd = (int32_t)loom_hf_get(v, "embedding_length");
    int64_t n_ff;
    if (loom_hf_int(cf, "inner_hidden_size", 4 * (int64_t)n_embd, 1, INT32_MAX, &n_ff, err,
                    err_size))
        return -1;
    if (n_embd % (int32_t)loom_hf_get(v, "attention.head_count")) {
        snprintf(err, err_size, "hidden_size must be a multiple of num_attention_heads");
        return -1;
    }
    loom_hf_set(v, "feed_forward_length", LOOM_HF_U32, n_ff);
    /* Hugging Face's GLMBlock never receives the real layer count: alpha is 28 layers' */
    loom_hf_set(v, "residual_scale", LOOM_HF_F32, sqrt(2.0 * 28));
    return 0;
}

#define GLM1_LAYER(hf, gg, flags)                                                                  \
    {"transformer.layers.%d." hf ".weight", "blk.%d." gg ".weight", flags, NULL},                  \
    {                                                                                              \
        "transformer.layers.%d." hf ".bias", "blk.%d." gg ".bias", flags, NULL                     \
    }
static const loom_hf_tensor glm1_tensors[] = {
    {"transformer.word_embeddings.weight", "token_embd.weight", 0, NULL},
    {"transformer.final_layernorm.weight", "output_norm.weight", 0, NULL},
    {"transformer.final_layernorm.bias", "output_norm.bias", 0, NULL},
    {"lm_head.weight", "output.weight", 0, "transformer.word_embeddings.weight"},
    GLM1_LAYER("input_layernorm", "attn_norm", 0),
    GLM1_LAYER("attention.query_key_value", "attn_qkv", LOOM_HF_QKV_PER_HEAD),
    GLM1_LAYER("attention.dense", "attn_output", 0),
    GLM1_LAYER("post_attention_layernorm", "ffn_norm", 0),
    GLM1_LAYER("mlp.dense_h_to_4h", "ffn_up", 0),
    GLM1_LAYER("mlp.dense_4h_to_h", "ffn_down", 0),
    {0}};

const loom_family loom_family_chatglm1 = {.arch = &loom_arch_chatglm1,
                                          .hf_model_type = "chatglm",
                                          .hf_when = "position_encoding_2d|inner_hidden_size",
                                          .hf_params = glm1_params,
                                          .hf_derive = glm1_derive,
                                          .hf_tensors = glm1_tensors};
