/*
 * models/llama.c - the Llama family's forward pass (GGUF architectures "llama", "qwen2",
 * "qwen3" and "qwen", the last being Qwen v1).
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
 *     what the names suggest, so w2 is stored as ffn_gate and w1 as ffn_up (llama.cpp's names).
 *
 * RoPE: GGUF "llama" files store Q and K with their rows permuted so that rotation pairs are
 * adjacent (the convert tools' permutation of the Hugging Face weights), so they rotate
 * adjacent pairs; the Qwen files keep the Hugging Face order and rotate halves (NeoX style).
 */
#include "models.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct llama_layer {
    const loom_tensor *attn_norm;  /* [n_embd] */
    const loom_tensor *wq, *wk, *wv; /* [n_head * head_dim, n_embd], [n_head_kv * head_dim, n_embd] */
    const loom_tensor *bq, *bk, *bv; /* Qwen2 only, else NULL */
    const loom_tensor *wqkv, *bqkv;  /* Qwen v1: fused instead of wq, wk, wv */
    const loom_tensor *q_norm, *k_norm; /* Qwen3: [head_dim], else NULL */
    const loom_tensor *wo;         /* [n_embd, n_head * head_dim] */
    const loom_tensor *ffn_norm;   /* [n_embd] */
    const loom_tensor *w_gate, *w_up; /* [n_ff, n_embd] */
    const loom_tensor *w_down;     /* [n_embd, n_ff] */
} llama_layer;

typedef struct llama_model {
    const loom_tensor *tok_embd;   /* [n_vocab, n_embd] */
    const loom_tensor *out_norm;   /* [n_embd] */
    const loom_tensor *output;     /* [n_vocab, n_embd]; the embedding when tied */
    llama_layer *layers;
} llama_model;

static void llama_free(void *state)
{
    llama_model *m = state;
    if (m)
        free(m->layers);
    free(m);
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
    hp->norm_eps = (float)loom_model_kv_float(g, arch, "attention.layer_norm_rms_epsilon", 1e-5);
    hp->rope_base = (float)loom_model_kv_float(g, arch, "rope.freq_base", 10000.0);
    double factor = loom_model_kv_float(g, arch, "rope.scaling.factor", 1.0);
    hp->rope_scale = factor > 0 ? (float)(1.0 / factor) : 1.0f;
    if (hp->n_embd <= 0 || hp->n_layer <= 0 || hp->n_layer > LOOM_MAX_LAYERS || hp->n_head <= 0 ||
        hp->n_head_kv <= 0 || hp->n_head % hp->n_head_kv || hp->n_ff <= 0) {
        snprintf(err, err_size, "%s: missing or inconsistent hyper-parameters (embedding_length "
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
    hp->head_dim = (int32_t)loom_model_kv_int(g, arch, "attention.key_length", hp->n_embd / hp->n_head);
    hp->n_rot = (int32_t)loom_model_kv_int(g, arch, "rope.dimension_count", hp->head_dim);
    int fused = strcmp(arch, "qwen") == 0, head_norms = strcmp(arch, "qwen3") == 0;
    hp->rope_mode = strcmp(arch, "llama") == 0 ? LOOM_ROPE_ADJACENT : LOOM_ROPE_NEOX;

    llama_model *m = calloc(1, sizeof *m);
    if (!m || !(m->layers = calloc((size_t)hp->n_layer, sizeof *m->layers))) {
        llama_free(m);
        snprintf(err, err_size, "out of memory");
        return -1;
    }
    m->tok_embd = loom_rt_weight(r, "token_embd.weight", 1);
    m->out_norm = loom_rt_weight(r, "output_norm.weight", 1);
    m->output = loom_rt_weight(r, "output.weight", 0);
    if (!m->output)
        m->output = m->tok_embd;
    char name[96];
#define W(field, fmt, req)                                                                     \
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
        if (head_norms) {
            W(q_norm, "blk.%d.attn_q_norm.weight", 1);
            W(k_norm, "blk.%d.attn_k_norm.weight", 1);
        }
        W(wo, "blk.%d.attn_output.weight", 1);
        W(ffn_norm, "blk.%d.ffn_norm.weight", 1);
        W(w_gate, "blk.%d.ffn_gate.weight", 1);
        W(w_up, "blk.%d.ffn_up.weight", 1);
        W(w_down, "blk.%d.ffn_down.weight", 1);
    }
#undef W
    if (loom_rt_status(r)) {
        llama_free(m);
        return -1;
    }
    hp->n_vocab = (int32_t)m->output->ne[1];
    const llama_layer *L0 = &m->layers[0];
    int64_t q_dim = (int64_t)hp->n_head * hp->head_dim, kv_dim = (int64_t)hp->n_head_kv * hp->head_dim;
    int shapes_ok = m->tok_embd->ne[0] == hp->n_embd &&
                    (fused ? L0->wqkv->ne[1] == q_dim + 2 * kv_dim
                           : L0->wq->ne[1] == q_dim && L0->wk->ne[1] == kv_dim) &&
                    (!head_norms || (L0->q_norm->ne[0] == hp->head_dim &&
                                     L0->k_norm->ne[0] == hp->head_dim));
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

static int llama_forward(loom_runner *r, void *state, const loom_batch *b)
{
    const llama_model *m = state;
    const loom_hparams *hp = loom_runner_hparams(r);
    const loom_rt_inputs *in = loom_rt_inputs_of(r);
    const int64_t n = b->n, d = hp->n_embd, hd = hp->head_dim;
    const int64_t q_dim = hp->n_head * hd, kv_dim = hp->n_head_kv * hd;

    loom_tensor x = loom_rt_scratch(r, LOOM_F32, d, n, 1);        /* the residual stream */
    loom_tensor h = loom_rt_scratch(r, LOOM_F32, d, n, 1);        /* normed input of a block */
    /* Q, K and V side by side in one row per token: the fused projection writes it whole, the
     * separate ones write their column ranges */
    loom_tensor qkv = loom_rt_scratch(r, LOOM_F32, q_dim + 2 * kv_dim, n, 1);
    loom_tensor q = loom_rt_cols(&qkv, 0, q_dim), k = loom_rt_cols(&qkv, q_dim, kv_dim);
    loom_tensor v = loom_rt_cols(&qkv, q_dim + kv_dim, kv_dim);
    loom_tensor att = loom_rt_scratch(r, LOOM_F32, q_dim, n, 1);
    loom_tensor gate = loom_rt_scratch(r, LOOM_F32, hp->n_ff, n, 1);
    loom_tensor up = loom_rt_scratch(r, LOOM_F32, hp->n_ff, n, 1);
    loom_tensor q3 = loom_rt_heads(&qkv, 0, hd, hp->n_head);
    loom_tensor k3 = loom_rt_heads(&qkv, q_dim, hd, hp->n_head_kv);
    loom_tensor v3 = loom_rt_heads(&qkv, q_dim + kv_dim, hd, hp->n_head_kv);
    loom_tensor att3 = loom_rt_reshape(&att, hd, hp->n_head, n);
    const float scale = 1.0f / sqrtf((float)hd);

    loom_rt_get_rows(r, m->tok_embd, &in->ids, &x);
    for (int l = 0; l < hp->n_layer; l++) {
        const llama_layer *L = &m->layers[l];
        /* attention */
        loom_rt_rms_norm(r, &x, L->attn_norm, hp->norm_eps, &h);
        if (L->wqkv) {
            loom_rt_matmul(r, &h, L->wqkv, L->bqkv, &qkv);
        } else {
            loom_rt_matmul(r, &h, L->wq, L->bq, &q);
            loom_rt_matmul(r, &h, L->wk, L->bk, &k);
            loom_rt_matmul(r, &h, L->wv, L->bv, &v);
        }
        if (L->q_norm) {
            loom_rt_rms_norm(r, &q3, L->q_norm, hp->norm_eps, &q3);
            loom_rt_rms_norm(r, &k3, L->k_norm, hp->norm_eps, &k3);
        }
        loom_rt_rope(r, &q3, hp);
        loom_rt_rope(r, &k3, hp);
        loom_rt_kv_store(r, &k3, loom_rt_kcache(r, l));
        loom_rt_kv_store(r, &v3, loom_rt_vcache(r, l));
        loom_rt_attention(r, &q3, l, scale, &att3);
        loom_rt_matmul(r, &att, L->wo, NULL, &h);
        loom_rt_add(r, &x, &h, &x);
        /* feed-forward */
        loom_rt_rms_norm(r, &x, L->ffn_norm, hp->norm_eps, &h);
        loom_rt_matmul(r, &h, L->w_gate, NULL, &gate);
        loom_rt_matmul(r, &h, L->w_up, NULL, &up);
        loom_rt_silu_mul(r, &gate, &up, &gate);
        loom_rt_matmul(r, &gate, L->w_down, NULL, &h);
        loom_rt_add(r, &x, &h, &x);
    }
    loom_rt_logits(r, b, &x, m->out_norm, NULL, hp->norm_eps, m->output);
    return loom_rt_status(r);
}

const loom_arch loom_arch_llama = {.name = "llama", .load = llama_load, .forward = llama_forward,
                                   .free_state = llama_free};
const loom_arch loom_arch_qwen2 = {.name = "qwen2", .load = qwen2_load, .forward = llama_forward,
                                   .free_state = llama_free};
const loom_arch loom_arch_qwen3 = {.name = "qwen3", .load = qwen3_load, .forward = llama_forward,
                                   .free_state = llama_free};
const loom_arch loom_arch_qwen = {.name = "qwen", .load = qwen_load, .forward = llama_forward,
                                  .free_state = llama_free};
