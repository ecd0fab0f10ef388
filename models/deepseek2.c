/*
 * models/deepseek2.c - GGUF "deepseek2": multi-head latent attention (MLA) with DeepSeek's
 * mixture of experts: GLM-4.7-Flash (Glm4MoeLiteForCausalLM, which llama.cpp converts to this
 * architecture), DeepSeek-V2-Lite/V2, DeepSeek-V3.
 *
 * Attention keeps one small latent per token instead of per-head keys and values:
 *   q      = q_b(rms_norm(q_a x)) (q_lora_rank) or q x, per head [nope; rope]
 *   kv_a x = [c (kv_lora_rank); k_rope (one rotary key shared by every head)], c = rms_norm(c)
 *   per head h: k_nope = K_h c, v = V_h c (Hugging Face's kv_b_proj, which llama.cpp's
 *   converter stores split: attn_k_b holds K_h transposed, attn_v_b holds V_h)
 * The forward pass runs it in the latent space, as llama.cpp does with these tensors: the
 * query's nope part is absorbed into the latent (q_h K_h, a per-head matmul: matmul_id with the
 * head as the "expert"), so every head attends to one cached key [c; rope(k_rope)] of
 * kv_lora_rank + rope dims, with scale 1/sqrt(nope + rope) (key_length_mla); the value read is
 * c itself: the key cache serves as the value cache too (hp kv_values_in_keys: the heads'
 * outputs past kv_lora_rank, the rope part's weighted sum, are dropped), so a token costs
 * kv_lora_rank + rope numbers per layer, and each head's output is taken back out by V_h. RoPE
 * rotates adjacent pairs (DeepSeek's interleaved layout, Hugging Face's rope_interleave). The q_a
 * and kv_a norms use 1e-6, their modules' default, whatever rms_norm_eps says.
 *
 * The feed-forward is llama.cpp's deepseek2: leading_dense_block_count dense SwiGLU layers, then
 * experts (the router's sigmoid scores with exp_probs_b steering the choice, renormalised,
 * scaled by expert_weights_scale, within the best of expert_group_count groups) beside
 * expert_shared_count ungated shared experts. A file without expert_gating_func gates by
 * sigmoid when it has exp_probs_b (the noaux_tc router of DeepSeek-V3 and GLM-4.7-Flash, whose
 * converter writes no key) and by softmax otherwise (DeepSeek-V2). The last
 * nextn_predict_layers blocks are the multi-token-prediction head, which a plain run skips.
 */
#include "blocks.h"
#include "models.h"

#include <assert.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Hugging Face's RMSNorm default: the q_a and kv_a norms' epsilon */
#define LATENT_NORM_EPS 1e-6f

typedef struct ds2_layer {
    const loom_tensor *attn_norm, *ffn_norm;
    const loom_tensor *wq;                /* [n_head (nope + rope), d], without q_lora */
    const loom_tensor *wq_a, *q_a_norm;   /* [q_lora, d], [q_lora] */
    const loom_tensor *wq_b;              /* [n_head (nope + rope), q_lora] */
    const loom_tensor *wkv_a, *kv_a_norm; /* [kv_lora + rope, d], [kv_lora] */
    const loom_tensor *wk_b;              /* [n_head, kv_lora, nope]: K_h transposed */
    const loom_tensor *wv_b;              /* [n_head, v_head, kv_lora]: V_h */
    const loom_tensor *wo;                /* [d, n_head v_head] */
    const loom_tensor *gate, *up, *down;  /* a dense layer's */
    loom_moe_weights moe;
} ds2_layer;

typedef struct ds2_model {
    const loom_tensor *tok_embd, *out_norm, *output;
    int32_t n_dense;
    int32_t q_lora, kv_lora, nope, rope, v_head;
    float scale; /* 1/sqrt(nope + rope) */
    ds2_layer *layers;
} ds2_model;

static void ds2_free(void *state)
{
    ds2_model *m = state;
    if (m)
        free(m->layers);
    free(m);
}

static int read_hparams(const loom_gguf *g, loom_hparams *hp, ds2_model *m, char *err,
                        size_t err_size)
{
    const char *arch = "deepseek2";
    snprintf(hp->arch, sizeof hp->arch, "%s", arch);
    hp->n_embd = (int32_t)loom_model_kv_int(g, arch, "embedding_length", 0);
    int64_t blocks = loom_model_kv_int(g, arch, "block_count", 0);
    int64_t nextn = loom_model_kv_int(g, arch, "nextn_predict_layers", 0);
    hp->n_layer = (int32_t)(blocks - nextn);
    hp->n_head = (int32_t)loom_model_kv_int(g, arch, "attention.head_count", 0);
    hp->n_ff = (int32_t)loom_model_kv_int(g, arch, "feed_forward_length", 0);
    hp->n_ctx_train = (int32_t)loom_model_kv_int(g, arch, "context_length", 2048);
    hp->norm_eps = (float)loom_model_kv_float(g, arch, "attention.layer_norm_rms_epsilon", 1e-6);
    hp->rope_base = (float)loom_model_kv_float(g, arch, "rope.freq_base", 10000.0);
    hp->rope_scale = 1.0f;
    hp->rope_mode = LOOM_ROPE_ADJACENT;
    m->q_lora = (int32_t)loom_model_kv_int(g, arch, "attention.q_lora_rank", 0);
    m->kv_lora = (int32_t)loom_model_kv_int(g, arch, "attention.kv_lora_rank", 0);
    m->rope = (int32_t)loom_model_kv_int(g, arch, "rope.dimension_count", 0);
    /* key_length_mla / value_length_mla: a head's query-key and value widths (nope + rope, and
     * v_head); files before those keys kept them in key_length / value_length */
    int64_t k_mla = loom_model_kv_int(g, arch, "attention.key_length_mla",
                                      loom_model_kv_int(g, arch, "attention.key_length", 0));
    m->v_head = (int32_t)loom_model_kv_int(g, arch, "attention.value_length_mla",
                                           loom_model_kv_int(g, arch, "attention.value_length", 0));
    m->nope = (int32_t)(k_mla - m->rope);
    m->n_dense = (int32_t)loom_model_kv_int(g, arch, "leading_dense_block_count", 0);
    if (hp->n_embd <= 0 || blocks <= 0 || nextn < 0 || hp->n_layer <= 0 ||
        hp->n_layer > LOOM_MAX_LAYERS || hp->n_head <= 0 || m->kv_lora <= 0 || m->rope <= 0 ||
        m->rope % 2 || m->nope <= 0 || m->v_head <= 0 || m->q_lora < 0 || m->n_dense < 0 ||
        m->n_dense > hp->n_layer || (m->n_dense > 0 && hp->n_ff <= 0)) {
        snprintf(err, err_size,
                 "%s: embedding_length %d, block_count %lld (nextn_predict_layers %lld), "
                 "head_count %d, attention.kv_lora_rank %d, rope.dimension_count %d, "
                 "key_length_mla %lld, value_length_mla %d, leading_dense_block_count %d: each "
                 "must be above 0 (the rotary dims even, fewer than key_length_mla), the dense "
                 "layers at most the layers",
                 arch, hp->n_embd, (long long)blocks, (long long)nextn, hp->n_head, m->kv_lora,
                 m->rope, (long long)k_mla, m->v_head, m->n_dense);
        return -1;
    }
    char key[96];
    snprintf(key, sizeof key, "%s.rope.scaling.type", arch);
    const char *scaling = NULL;
    uint64_t scaling_len = 0;
    if (loom_gguf_find(g, key) &&
        (loom_gguf_get_str(g, key, &scaling, &scaling_len) != 0 || scaling_len != 4 ||
         memcmp(scaling, "none", 4) != 0)) {
        snprintf(err, err_size,
                 "%s: rope.scaling.type is set (DeepSeek-V2/V3's YaRN); loom runs %s files "
                 "without RoPE scaling so far (GLM-4.7-Flash)",
                 arch, arch);
        return -1;
    }
    /* the cache holds one key per token, [c; rope(k_rope)], whose first kv_lora_rank columns
     * are the value every head reads */
    hp->n_head_kv = 1;
    hp->kv_values_in_keys = 1;
    hp->head_dim = m->kv_lora + m->rope;
    hp->n_rot = m->rope;
    m->scale = 1.0f / sqrtf((float)(m->nope + m->rope));
    /* sigmoid where the file has exp_probs_b (noaux_tc), unless the file says otherwise */
    snprintf(key, sizeof key, "blk.%d.exp_probs_b.bias", m->n_dense);
    const int noaux = loom_gguf_find_tensor(g, key) != NULL;
    if (loom_moe_read_hparams(g, arch, noaux ? 2 : 1, 0, hp, err, err_size) != 0)
        return -1;
    return 0;
}

static int ds2_load(loom_runner *r, loom_hparams *hp, void **state, char *err, size_t err_size)
{
    const loom_gguf *g = loom_rt_gguf(r);
    ds2_model *m = calloc(1, sizeof *m);
    if (!m || read_hparams(g, hp, m, err, err_size) != 0 ||
        !(m->layers = calloc((size_t)hp->n_layer, sizeof *m->layers))) {
        if (m && !err[0])
            snprintf(err, err_size, "out of memory");
        ds2_free(m);
        return -1;
    }
    m->tok_embd = loom_rt_weight(r, "token_embd.weight", 1);
    m->out_norm = loom_rt_weight(r, "output_norm.weight", 1);
    m->output = loom_rt_weight(r, "output.weight", 0);
    if (!m->output)
        m->output = m->tok_embd; /* tied */
    char name[96];
#define W(field, fmt, required)                                                                    \
    (snprintf(name, sizeof name, fmt, l), L->field = loom_rt_weight(r, name, required))
    for (int l = 0; l < hp->n_layer; l++) {
        ds2_layer *L = &m->layers[l];
        W(attn_norm, "blk.%d.attn_norm.weight", 1);
        W(ffn_norm, "blk.%d.ffn_norm.weight", 1);
        if (m->q_lora) {
            W(wq_a, "blk.%d.attn_q_a.weight", 1);
            W(q_a_norm, "blk.%d.attn_q_a_norm.weight", 1);
            W(wq_b, "blk.%d.attn_q_b.weight", 1);
        } else {
            W(wq, "blk.%d.attn_q.weight", 1);
        }
        W(wkv_a, "blk.%d.attn_kv_a_mqa.weight", 1);
        W(kv_a_norm, "blk.%d.attn_kv_a_norm.weight", 1);
        W(wk_b, "blk.%d.attn_k_b.weight", 0);
        if (!L->wk_b) {
            snprintf(name, sizeof name, "blk.%d.attn_kv_b.weight", l);
            snprintf(err, err_size,
                     "deepseek2: %s has no attn_k_b / attn_v_b but %s: the older converters' "
                     "MLA layout, which loom does not run; convert the checkpoint again with a "
                     "2025 or later llama.cpp",
                     name, loom_gguf_find_tensor(g, name) ? name : "neither");
            ds2_free(m);
            return -1;
        }
        W(wv_b, "blk.%d.attn_v_b.weight", 1);
        W(wo, "blk.%d.attn_output.weight", 1);
        if (l < m->n_dense) {
            W(gate, "blk.%d.ffn_gate.weight", 1);
            W(up, "blk.%d.ffn_up.weight", 1);
            W(down, "blk.%d.ffn_down.weight", 1);
        } else {
            loom_moe_load(r, l, L->ffn_norm, 0, &L->moe);
        }
    }
#undef W
    if (loom_rt_status(r)) {
        ds2_free(m);
        return -1;
    }
    hp->n_vocab = (int32_t)m->output->ne[1];
    const int64_t d = hp->n_embd, H = hp->n_head, qk = m->nope + m->rope;
    int ok = m->tok_embd->ne[0] == d && m->output->ne[0] == d && m->out_norm->ne[0] == d;
    for (int l = 0; ok && l < hp->n_layer; l++) {
        const ds2_layer *L = &m->layers[l];
        ok = L->attn_norm->ne[0] == d && L->ffn_norm->ne[0] == d &&
            (m->q_lora ? L->wq_a->ne[0] == d && L->wq_a->ne[1] == m->q_lora &&
                     L->q_a_norm->ne[0] == m->q_lora && L->wq_b->ne[0] == m->q_lora &&
                     L->wq_b->ne[1] == H * qk
                       : L->wq->ne[0] == d && L->wq->ne[1] == H * qk) &&
            L->wkv_a->ne[0] == d && L->wkv_a->ne[1] == m->kv_lora + m->rope &&
            L->kv_a_norm->ne[0] == m->kv_lora && L->wk_b->ne[0] == m->nope &&
            L->wk_b->ne[1] == m->kv_lora && L->wk_b->ne[2] == H && L->wv_b->ne[0] == m->kv_lora &&
            L->wv_b->ne[1] == m->v_head && L->wv_b->ne[2] == H && L->wo->ne[0] == H * m->v_head &&
            L->wo->ne[1] == d &&
            (l < m->n_dense ? L->gate->ne[0] == d && L->gate->ne[1] == hp->n_ff &&
                     L->up->ne[1] == hp->n_ff && L->down->ne[0] == hp->n_ff
                            : loom_moe_shapes_ok(hp, l, &L->moe, err, err_size));
        if (!ok && !err[0])
            snprintf(err, err_size,
                     "deepseek2: the tensors of block %d disagree with the hyper-parameters "
                     "('loom inspect FILE' lists them)",
                     l);
    }
    if (!ok) {
        if (!err[0])
            snprintf(err, err_size,
                     "deepseek2: the embeddings or the output disagree with embedding_length");
        ds2_free(m);
        return -1;
    }
    *state = m;
    return 0;
}

/* The step's scratch for n tokens. */
typedef struct ds2_buffers {
    loom_tensor h, qa, q, q_nope, q_rope, q_lat, query, kv, c, k_rope, key, att;
    loom_tensor o_lat, o;
    loom_tensor ff_gate, ff_up;
} ds2_buffers;

/* Columns [c0, c0 + width) of each head of t ([n, heads, head_width] as a 2-D tensor) */
static loom_tensor head_part(const loom_tensor *t, int64_t heads, int64_t head_width, int64_t c0,
                             int64_t width)
{
    assert(c0 >= 0 && width > 0 && c0 + width <= head_width);
    loom_tensor v = loom_rt_heads(t, 0, head_width, heads);
    v.offset += (uint64_t)c0 * t->nb[0];
    v.ne[0] = width;
    return v;
}

static ds2_buffers buffers(loom_runner *r, const loom_hparams *hp, const ds2_model *m, int64_t n)
{
    const int64_t H = hp->n_head, qk = m->nope + m->rope, kv = m->kv_lora, width = kv + m->rope;
    ds2_buffers b = {0};
    b.h = loom_rt_scratch(r, LOOM_F32, hp->n_embd, n, 1);
    if (m->q_lora)
        b.qa = loom_rt_scratch(r, LOOM_F32, m->q_lora, n, 1);
    b.q = loom_rt_scratch(r, LOOM_F32, H * qk, n, 1);
    b.q_nope = loom_rt_scratch(r, LOOM_F32, m->nope, H, n);
    b.q_rope = loom_rt_scratch(r, LOOM_F32, m->rope, H, n);
    b.q_lat = loom_rt_scratch(r, LOOM_F32, kv, H, n);
    b.query = loom_rt_scratch(r, LOOM_F32, width, H, n);
    b.kv = loom_rt_scratch(r, LOOM_F32, width, n, 1);
    b.c = loom_rt_scratch(r, LOOM_F32, kv, n, 1);
    b.k_rope = loom_rt_scratch(r, LOOM_F32, m->rope, 1, n);
    b.key = loom_rt_scratch(r, LOOM_F32, width, 1, n);
    b.att = loom_rt_scratch(r, LOOM_F32, width, H, n);
    b.o_lat = loom_rt_scratch(r, LOOM_F32, kv, H, n);
    b.o = loom_rt_scratch(r, LOOM_F32, m->v_head, H, n);
    if (m->n_dense) {
        b.ff_gate = loom_rt_scratch(r, LOOM_F32, hp->n_ff, n, 1);
        b.ff_up = loom_rt_scratch(r, LOOM_F32, hp->n_ff, n, 1);
    }
    return b;
}

/* copies src into dst (a view of another shape's part): scale by 1 */
static void copy(loom_runner *r, const loom_tensor *src, const loom_tensor *dst)
{
    loom_rt_scale(r, src, 1.0f, dst);
}

static void latent_attention(loom_runner *r, const loom_hparams *hp, const ds2_model *m, int l,
                             const ds2_layer *L, const loom_tensor *x, const ds2_buffers *b,
                             const loom_tensor *head_ids)
{
    const int64_t H = hp->n_head, n = x->ne[1], qk = m->nope + m->rope, kv = m->kv_lora;
    const int64_t width = kv + m->rope;
    loom_rt_rms_norm(r, x, L->attn_norm, hp->norm_eps, &b->h);
    if (m->q_lora) {
        loom_rt_matmul(r, &b->h, L->wq_a, NULL, &b->qa);
        loom_rt_rms_norm(r, &b->qa, L->q_a_norm, LATENT_NORM_EPS, &b->qa);
        loom_rt_matmul(r, &b->qa, L->wq_b, NULL, &b->q);
    } else {
        loom_rt_matmul(r, &b->h, L->wq, NULL, &b->q);
    }
    /* the query: its nope part into the latent (per head, K_h^T q), its rope part rotated */
    const loom_tensor q_nope = head_part(&b->q, H, qk, 0, m->nope);
    const loom_tensor q_rope = head_part(&b->q, H, qk, m->nope, m->rope);
    copy(r, &q_nope, &b->q_nope);
    copy(r, &q_rope, &b->q_rope);
    loom_rt_rope(r, &b->q_rope, hp, NULL);
    loom_rt_matmul_id(r, &b->q_nope, L->wk_b, head_ids, &b->q_lat);
    const loom_tensor query2 = loom_rt_reshape(&b->query, width * H, n, 1);
    const loom_tensor q_to_lat = head_part(&query2, H, width, 0, kv);
    const loom_tensor q_to_rope = head_part(&query2, H, width, kv, m->rope);
    copy(r, &b->q_lat, &q_to_lat);
    copy(r, &b->q_rope, &q_to_rope);
    /* the one key, [rms_norm(c); rope(k_rope)], the value as well */
    loom_rt_matmul(r, &b->h, L->wkv_a, NULL, &b->kv);
    const loom_tensor c_part = loom_rt_cols(&b->kv, 0, kv);
    const loom_tensor k_part = loom_rt_cols(&b->kv, kv, m->rope);
    copy(r, &c_part, &b->c);
    loom_rt_rms_norm(r, &b->c, L->kv_a_norm, LATENT_NORM_EPS, &b->c);
    const loom_tensor k_rope2 = loom_rt_reshape(&b->k_rope, m->rope, n, 1);
    copy(r, &k_part, &k_rope2);
    loom_rt_rope(r, &b->k_rope, hp, NULL);
    const loom_tensor key2 = loom_rt_reshape(&b->key, width, n, 1);
    const loom_tensor key_c = loom_rt_cols(&key2, 0, kv), key_r = loom_rt_cols(&key2, kv, m->rope);
    copy(r, &b->c, &key_c);
    copy(r, &k_rope2, &key_r);
    assert(loom_rt_vcache(r, l)->offset == loom_rt_kcache(r, l)->offset);
    loom_rt_kv_store(r, &b->key, loom_rt_kcache(r, l));
    loom_rt_attention(r, &b->query, l, m->scale, &b->att);
    /* each head's latent output back out through V_h, then the output projection */
    const loom_tensor att2 = loom_rt_reshape(&b->att, width * H, n, 1);
    const loom_tensor att_lat = head_part(&att2, H, width, 0, kv);
    copy(r, &att_lat, &b->o_lat);
    loom_rt_matmul_id(r, &b->o_lat, L->wv_b, head_ids, &b->o);
    const loom_tensor o2 = loom_rt_reshape(&b->o, m->v_head * H, n, 1);
    loom_rt_matmul(r, &o2, L->wo, NULL, &b->h);
    loom_rt_add(r, x, &b->h, x);
}

static int ds2_forward(loom_runner *r, void *state, const loom_batch *batch)
{
    const ds2_model *m = state;
    const loom_hparams *hp = loom_runner_hparams(r);
    const int64_t n = batch->n, H = hp->n_head;
    loom_tensor x = loom_rt_scratch(r, LOOM_F32, hp->n_embd, n, 1); /* the residual stream */
    ds2_buffers b = buffers(r, hp, m, n);
    loom_ffn_buffers fb = {.h = b.h, .gate = b.ff_gate, .up = b.ff_up, .act = b.ff_gate};
    loom_moe_buffers mb = {0};
    if (m->n_dense < hp->n_layer)
        mb = loom_moe_buffers_new(r, hp, n, hp->n_ff_shexp > 0);
    /* every token's heads 0..H-1: matmul_id's "experts" are the heads */
    int32_t *ids = malloc((size_t)(n * H) * sizeof *ids);
    if (!ids)
        return -1;
    for (int64_t i = 0; i < n * H; i++)
        ids[i] = (int32_t)(i % H);
    loom_tensor head_ids = loom_rt_upload_i32(r, ids, n * H);
    free(ids);
    head_ids = loom_rt_reshape(&head_ids, H, n, 1);
    int first, end;
    loom_rt_layers(r, &first, &end);
    loom_rt_embed(r, m->tok_embd, &x);
    for (int l = first; l < end; l++) {
        const ds2_layer *L = &m->layers[l];
        latent_attention(r, hp, m, l, L, &x, &b, &head_ids);
        loom_ffn_weights f = {.norm = L->ffn_norm, .gate = L->gate, .up = L->up, .down = L->down};
        if (l < m->n_dense)
            loom_ffn_swiglu(r, hp, &x, &f, &fb);
        else
            loom_ffn_moe(r, hp, &x, &L->moe, &mb);
    }
    loom_rt_logits(r, batch, &x, m->out_norm, NULL, hp->norm_eps, m->output);
    return loom_rt_status(r);
}

const loom_arch loom_arch_deepseek2 = {
    .name = "deepseek2", .load = ds2_load, .forward = ds2_forward, .free_state = ds2_free};

/* ---- The Hugging Face form: Glm4MoeLiteForCausalLM (model_type glm4_moe_lite) -------------
 * As llama.cpp's converter writes it: kv_b_proj split into attn_k_b and attn_v_b, the MTP layer
 * (model.layers.<num_hidden_layers>) left out, and (unlike it) expert_gating_func written, so
 * that any reader gates by sigmoid. RoPE on interleaved pairs (rope_interleave, the default);
 * no rope_scaling. DeepSeek-V2/V3 folders are not converted yet. */
static const loom_hf_param glm47_params[] = {
    {"context_length", "max_position_embeddings", LOOM_HF_U32, 4096},
    {"embedding_length", "hidden_size", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"block_count", "num_hidden_layers", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"feed_forward_length", "intermediate_size", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"attention.head_count", "num_attention_heads", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"attention.layer_norm_rms_epsilon", "rms_norm_eps", LOOM_HF_F32, 1e-6},
    {"rope.freq_base", "rope_theta", LOOM_HF_F32, 10000.0},
    {"attention.kv_lora_rank", "kv_lora_rank", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"rope.dimension_count", "qk_rope_head_dim", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"attention.value_length_mla", "v_head_dim", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"expert_count", "n_routed_experts", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"expert_used_count", "num_experts_per_tok", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"expert_feed_forward_length", "moe_intermediate_size", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"expert_weights_scale", "routed_scaling_factor", LOOM_HF_F32, 1.0},
    {"expert_group_count", "n_group", LOOM_HF_U32, 1},
    {"expert_group_used_count", "topk_group", LOOM_HF_U32, 1},
    {0}};

/* The widths llama.cpp's keys spell out, the optional counts (written only when above 0), and
 * the checks that the config is the model this file runs. */
static int glm47_derive(const cJSON *cf, loom_hf_values *v, char *err, size_t err_size)
{
    int64_t nope, q_lora, dense, shared;
    if (loom_hf_int(cf, "qk_nope_head_dim", 0, 1, 65536, &nope, err, err_size) ||
        loom_hf_int(cf, "q_lora_rank", 0, 0, 1 << 20, &q_lora, err, err_size) ||
        loom_hf_int(cf, "first_k_dense_replace", 0, 0, LOOM_MAX_LAYERS, &dense, err, err_size) ||
        loom_hf_int(cf, "n_shared_experts", 0, 0, 64, &shared, err, err_size))
        return -1;
    if (nope == 0) {
        snprintf(err, err_size, "config.json has no qk_nope_head_dim");
        return -1;
    }
    const cJSON *scaling = cJSON_GetObjectItem(cf, "rope_scaling");
    const cJSON *interleave = cJSON_GetObjectItem(cf, "rope_interleave");
    if ((scaling && !cJSON_IsNull(scaling)) || (interleave && !cJSON_IsTrue(interleave))) {
        snprintf(err, err_size,
                 "%s: loom runs GLM-4.7-Flash's RoPE on interleaved pairs without scaling",
                 scaling && !cJSON_IsNull(scaling) ? "rope_scaling is set"
                                                   : "rope_interleave is false");
        return -1;
    }
    const double rope = loom_hf_get(v, "rope.dimension_count");
    const double kv_lora = loom_hf_get(v, "attention.kv_lora_rank");
    loom_hf_set(v, "attention.head_count_kv", LOOM_HF_U32, 1);
    loom_hf_set(v, "attention.key_length_mla", LOOM_HF_U32, (double)nope + rope);
    loom_hf_set(v, "attention.key_length", LOOM_HF_U32, kv_lora + rope);
    loom_hf_set(v, "attention.value_length", LOOM_HF_U32, kv_lora);
    if (q_lora > 0)
        loom_hf_set(v, "attention.q_lora_rank", LOOM_HF_U32, (double)q_lora);
    if (dense > 0)
        loom_hf_set(v, "leading_dense_block_count", LOOM_HF_U32, (double)dense);
    if (shared > 0)
        loom_hf_set(v, "expert_shared_count", LOOM_HF_U32, (double)shared);
    const cJSON *norm = cJSON_GetObjectItem(cf, "norm_topk_prob");
    loom_hf_set(v, "expert_weights_norm", LOOM_HF_BOOL, !norm || cJSON_IsTrue(norm));
    loom_hf_set(v, "expert_gating_func", LOOM_HF_U32, 2); /* sigmoid (noaux_tc) */
    return 0;
}

/* clang-format off */
static const loom_hf_tensor glm47_tensors[] = {
    {"model.embed_tokens.weight", "token_embd.weight", 0, NULL},
    {"model.norm.weight", "output_norm.weight", 0, NULL},
    {"lm_head.weight", "output.weight", LOOM_HF_OPTIONAL, NULL},
    {"model.layers.%d.input_layernorm.weight", "blk.%d.attn_norm.weight", 0, NULL},
    {"model.layers.%d.post_attention_layernorm.weight", "blk.%d.ffn_norm.weight", 0, NULL},
    {"model.layers.%d.self_attn.q_a_proj.weight", "blk.%d.attn_q_a.weight", 0, NULL},
    {"model.layers.%d.self_attn.q_a_layernorm.weight", "blk.%d.attn_q_a_norm.weight", 0, NULL},
    {"model.layers.%d.self_attn.q_b_proj.weight", "blk.%d.attn_q_b.weight", 0, NULL},
    {"model.layers.%d.self_attn.q_proj.weight", "blk.%d.attn_q.weight", LOOM_HF_OPTIONAL, NULL},
    {"model.layers.%d.self_attn.kv_a_proj_with_mqa.weight", "blk.%d.attn_kv_a_mqa.weight", 0,
        NULL},
    {"model.layers.%d.self_attn.kv_a_layernorm.weight", "blk.%d.attn_kv_a_norm.weight", 0, NULL},
    {"model.layers.%d.self_attn.kv_b_proj.weight", "blk.%d.attn_k_b.weight", LOOM_HF_KV_B_K, NULL},
    {"model.layers.%d.self_attn.kv_b_proj.weight", "blk.%d.attn_v_b.weight", LOOM_HF_KV_B_V, NULL},
    {"model.layers.%d.self_attn.o_proj.weight", "blk.%d.attn_output.weight", 0, NULL},
    LOOM_HF_DEEPSEEK_FFN("model."),
    {0}};
/* clang-format on */

/* q_lora_rank decides between q_a/q_b and one q_proj; n_shared_experts the shared experts */
static const loom_hf_condition glm47_conditions[] = {
    {"model.layers.%d.self_attn.q_a_proj.weight", "attention.q_lora_rank", "q_lora_rank"},
    {"model.layers.%d.self_attn.q_a_layernorm.weight", "attention.q_lora_rank", "q_lora_rank"},
    {"model.layers.%d.self_attn.q_b_proj.weight", "attention.q_lora_rank", "q_lora_rank"},
    LOOM_HF_SHARED_EXPERTS_SAID("model."),
    {0}};

const loom_family loom_family_deepseek2 = {.arch = &loom_arch_deepseek2,
                                           .chat_template = "glm4",
                                           .hf_model_type = "glm4_moe_lite",
                                           .hf_params = glm47_params,
                                           .hf_derive = glm47_derive,
                                           .hf_tensors = glm47_tensors,
                                           .hf_conditions = glm47_conditions};
