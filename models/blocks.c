/*
 * models/blocks.c - see blocks.h.
 */
#include "blocks.h"
#include "models.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

loom_attn_buffers loom_attn_buffers_new(loom_runner *r, const loom_hparams *hp, int64_t n)
{
    const int64_t hd = hp->head_dim, q_dim = hp->n_head * hd, kv_dim = hp->n_head_kv * hd;
    loom_attn_buffers b;
    b.h = loom_rt_scratch(r, LOOM_F32, hp->n_embd, n, 1);
    /* Q, K and V side by side in one row per token: a fused projection writes it whole, the
     * separate ones write their column ranges */
    b.qkv = loom_rt_scratch(r, LOOM_F32, q_dim + 2 * kv_dim, n, 1);
    b.q = loom_rt_cols(&b.qkv, 0, q_dim);
    b.k = loom_rt_cols(&b.qkv, q_dim, kv_dim);
    b.v = loom_rt_cols(&b.qkv, q_dim + kv_dim, kv_dim);
    b.q3 = loom_rt_heads(&b.qkv, 0, hd, hp->n_head);
    b.k3 = loom_rt_heads(&b.qkv, q_dim, hd, hp->n_head_kv);
    b.v3 = loom_rt_heads(&b.qkv, q_dim + kv_dim, hd, hp->n_head_kv);
    b.att = loom_rt_scratch(r, LOOM_F32, q_dim, n, 1);
    b.att3 = loom_rt_reshape(&b.att, hd, hp->n_head, n);
    return b;
}

void loom_attn_block(loom_runner *r, const loom_hparams *hp, int layer, const loom_tensor *x,
                     const loom_attn_weights *w, const loom_attn_buffers *b)
{
    loom_rt_rms_norm(r, x, w->norm, hp->norm_eps, &b->h);
    if (w->wqkv) {
        loom_rt_matmul(r, &b->h, w->wqkv, w->bqkv, &b->qkv);
    } else {
        loom_rt_matmul(r, &b->h, w->wq, w->bq, &b->q);
        loom_rt_matmul(r, &b->h, w->wk, w->bk, &b->k);
        loom_rt_matmul(r, &b->h, w->wv, w->bv, &b->v);
    }
    if (w->q_norm) {
        loom_rt_rms_norm(r, &b->q3, w->q_norm, hp->norm_eps, &b->q3);
        loom_rt_rms_norm(r, &b->k3, w->k_norm, hp->norm_eps, &b->k3);
    }
    loom_rt_rope(r, &b->q3, hp, w->rope_freqs);
    loom_rt_rope(r, &b->k3, hp, w->rope_freqs);
    loom_rt_kv_store(r, &b->k3, loom_rt_kcache(r, layer));
    loom_rt_kv_store(r, &b->v3, loom_rt_vcache(r, layer));
    /* YaRN scales the rotated q and k by attn_factor: their dot products by its square */
    loom_rt_attention(r, &b->q3, layer,
                      hp->attn_factor * hp->attn_factor / sqrtf((float)hp->head_dim), &b->att3);
    loom_rt_matmul(r, &b->att, w->wo, NULL, &b->h);
    if (w->post_norm)
        loom_rt_rms_norm(r, &b->h, w->post_norm, hp->norm_eps, &b->h);
    loom_rt_add(r, x, &b->h, x);
}

void loom_ffn_swiglu(loom_runner *r, const loom_hparams *hp, const loom_tensor *x,
                     const loom_ffn_weights *w, const loom_ffn_buffers *b)
{
    loom_rt_rms_norm(r, x, w->norm, hp->norm_eps, &b->h);
    if (w->up) {
        loom_rt_matmul(r, &b->h, w->gate, NULL, &b->gate);
        loom_rt_matmul(r, &b->h, w->up, NULL, &b->up);
    } else {
        loom_rt_matmul(r, &b->h, w->gate, NULL, &b->fused);
    }
    loom_rt_silu_mul(r, &b->gate, &b->up, &b->act);
    loom_rt_matmul(r, &b->act, w->down, NULL, &b->h);
    if (w->post_norm)
        loom_rt_rms_norm(r, &b->h, w->post_norm, hp->norm_eps, &b->h);
    loom_rt_add(r, x, &b->h, x);
}

loom_moe_buffers loom_moe_buffers_new(loom_runner *r, const loom_hparams *hp, int64_t n, int shared)
{
    const int64_t d = hp->n_embd, k = hp->n_expert_used, ff = hp->n_ff_exp;
    loom_moe_buffers b = {0};
    b.h = loom_rt_scratch(r, LOOM_F32, d, n, 1);
    b.h3 = loom_rt_reshape(&b.h, d, 1, n); /* one row per token that every slot reads */
    b.logits = loom_rt_scratch(r, LOOM_F32, hp->n_expert, n, 1);
    b.ids = loom_rt_scratch(r, LOOM_I32, k, n, 1);
    b.weights = loom_rt_scratch(r, LOOM_F32, k, n, 1);
    b.gate = loom_rt_scratch(r, LOOM_F32, ff, k, n);
    b.up = loom_rt_scratch(r, LOOM_F32, ff, k, n);
    b.out = loom_rt_scratch(r, LOOM_F32, d, k, n);
    if (shared) {
        b.sh_gate = loom_rt_scratch(r, LOOM_F32, hp->n_ff_shexp, n, 1);
        b.sh_up = loom_rt_scratch(r, LOOM_F32, hp->n_ff_shexp, n, 1);
        b.sh_out = loom_rt_scratch(r, LOOM_F32, d, n, 1);
        b.sh_out3 = loom_rt_reshape(&b.sh_out, d, 1, n);
        b.sh_logit = loom_rt_scratch(r, LOOM_F32, 1, n, 1);
        b.sh_ids = loom_rt_scratch(r, LOOM_I32, 1, n, 1);
        b.sh_weight = loom_rt_scratch(r, LOOM_F32, 1, n, 1);
    }
    return b;
}

void loom_ffn_moe(loom_runner *r, const loom_hparams *hp, const loom_tensor *x,
                  const loom_moe_weights *w, const loom_moe_buffers *b)
{
    loom_rt_rms_norm(r, x, w->norm, hp->norm_eps, &b->h);
    loom_rt_matmul(r, &b->h, w->router, NULL, &b->logits);
    loom_rt_moe_route(r, hp, &b->logits, w->choice_bias, &b->ids, &b->weights);
    loom_rt_matmul_id(r, &b->h3, w->gate_exps, &b->ids, &b->gate);
    loom_rt_matmul_id(r, &b->h3, w->up_exps, &b->ids, &b->up);
    loom_rt_silu_mul(r, &b->gate, &b->up, &b->gate);
    loom_rt_matmul_id(r, &b->gate, w->down_exps, &b->ids, &b->out);
    loom_rt_moe_combine(r, &b->out, &b->weights, 1, x);
    if (!w->shexp_gate)
        return;
    loom_rt_matmul(r, &b->h, w->shexp_gate, NULL, &b->sh_gate);
    loom_rt_matmul(r, &b->h, w->shexp_up, NULL, &b->sh_up);
    loom_rt_silu_mul(r, &b->sh_gate, &b->sh_up, &b->sh_gate);
    loom_rt_matmul(r, &b->sh_gate, w->shexp_down, NULL, &b->sh_out);
    if (w->shexp_router) {
        loom_rt_matmul(r, &b->h, w->shexp_router, NULL, &b->sh_logit);
        loom_rt_sigmoid_gate(r, &b->sh_logit, &b->sh_ids, &b->sh_weight);
        loom_rt_moe_combine(r, &b->sh_out3, &b->sh_weight, 1, x);
    } else {
        loom_rt_add(r, x, &b->sh_out, x);
    }
}

/* ---- The experts' hyper-parameters and shapes, as llama.cpp's files state them ---------- */

void loom_moe_load(loom_runner *r, int l, const loom_tensor *norm, int gated_shared,
                   loom_moe_weights *w)
{
    char name[96];
#define W(field, fmt, required)                                                                    \
    (snprintf(name, sizeof name, fmt, l), w->field = loom_rt_weight(r, name, required))
    W(router, "blk.%d.ffn_gate_inp.weight", 1);
    W(choice_bias, "blk.%d.exp_probs_b.bias", 0);
    if (!w->choice_bias) /* the name without a suffix, as some write it */
        W(choice_bias, "blk.%d.exp_probs_b", 0);
    W(gate_exps, "blk.%d.ffn_gate_exps.weight", 1);
    W(up_exps, "blk.%d.ffn_up_exps.weight", 1);
    W(down_exps, "blk.%d.ffn_down_exps.weight", 1);
    W(shexp_gate, "blk.%d.ffn_gate_shexp.weight", 0);
    W(shexp_up, "blk.%d.ffn_up_shexp.weight", !!w->shexp_gate);
    W(shexp_down, "blk.%d.ffn_down_shexp.weight", !!w->shexp_gate);
    W(shexp_router, "blk.%d.ffn_gate_inp_shexp.weight", gated_shared && w->shexp_gate);
#undef W
    w->norm = norm;
}

int loom_moe_read_hparams(const loom_gguf *g, const char *arch, int gating_default,
                          int normalize_default, loom_hparams *hp, char *err, size_t err_size)
{
    hp->n_expert = (int32_t)loom_model_kv_int(g, arch, "expert_count", 0);
    hp->n_expert_used = (int32_t)loom_model_kv_int(g, arch, "expert_used_count", 0);
    hp->n_ff_exp = (int32_t)loom_model_kv_int(g, arch, "expert_feed_forward_length", 0);
    hp->n_ff_shexp = (int32_t)loom_model_kv_int(g, arch, "expert_shared_feed_forward_length", 0);
    /* llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid (GLM-4.5's default) */
    int64_t gating = loom_model_kv_int(g, arch, "expert_gating_func", gating_default);
    if (gating != 1 && gating != 2) {
        snprintf(err, err_size,
                 "%s.expert_gating_func is %lld; loom routes by softmax (1) and sigmoid (2)", arch,
                 (long long)gating);
        return -1;
    }
    hp->moe_gating = gating == 2 ? LOOM_MOE_SIGMOID : LOOM_MOE_SOFTMAX;
    char key[96];
    int norm = normalize_default;
    snprintf(key, sizeof key, "%s.expert_weights_norm", arch);
    loom_gguf_get_bool(g, key, &norm);
    hp->moe_normalize = norm;
    hp->moe_scale = (float)loom_model_kv_float(g, arch, "expert_weights_scale", 1.0);
    /* group-limited routing (checked with the rest in the runner); 0 and 1 mean none */
    hp->moe_groups = (int32_t)loom_model_kv_int(g, arch, "expert_group_count", 0);
    hp->moe_groups_kept = (int32_t)loom_model_kv_int(g, arch, "expert_group_used_count", 0);
    /* GLM-4.5's shared experts: expert_shared_count of an expert's width each */
    int64_t shared = loom_model_kv_int(g, arch, "expert_shared_count", 0);
    if (!hp->n_ff_shexp && shared > 0 && shared < 1024)
        hp->n_ff_shexp = (int32_t)(shared * hp->n_ff_exp);
    if (hp->n_expert <= 0 || hp->n_expert_used <= 0 || hp->n_ff_exp <= 0) {
        snprintf(err, err_size,
                 "%s: missing expert hyper-parameters (expert_count %d, expert_used_count %d, "
                 "expert_feed_forward_length %d)",
                 arch, hp->n_expert, hp->n_expert_used, hp->n_ff_exp);
        return -1;
    }
    return 0; /* the runner checks the ranges */
}

/* Whether t is {n0, n1, n2}; if not, a message naming it and both shapes. */
static int shaped(const loom_tensor *t, const char *name, int l, int64_t n0, int64_t n1, int64_t n2,
                  const char *why, char *err, size_t err_size)
{
    if (t->ne[0] == n0 && t->ne[1] == n1 && t->ne[2] == n2 && t->ne[3] == 1)
        return 1;
    snprintf(err, err_size, "blk.%d.%s.weight is {%lld, %lld, %lld}; %s want {%lld, %lld, %lld}", l,
             name, (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2], why,
             (long long)n0, (long long)n1, (long long)n2);
    return 0;
}

int loom_moe_shapes_ok(loom_hparams *hp, int l, const loom_moe_weights *w, char *err,
                       size_t err_size)
{
    const int64_t d = hp->n_embd, E = hp->n_expert, ff = hp->n_ff_exp;
    if (w->shexp_gate && !hp->n_ff_shexp) /* older files state it by the tensor alone */
        hp->n_ff_shexp = (int32_t)w->shexp_gate->ne[1];
    const int64_t fs = hp->n_ff_shexp;
    const char *experts = "embedding_length, expert_feed_forward_length and expert_count",
               *shared = "embedding_length and expert_shared_feed_forward_length";
#define SHAPED(t, name, n0, n1, n2, why) shaped(t, name, l, n0, n1, n2, why, err, err_size)
    return SHAPED(w->router, "ffn_gate_inp", d, E, 1, "embedding_length and expert_count") &&
        SHAPED(w->gate_exps, "ffn_gate_exps", d, ff, E, experts) &&
        SHAPED(w->up_exps, "ffn_up_exps", d, ff, E, experts) &&
        SHAPED(w->down_exps, "ffn_down_exps", ff, d, E, experts) &&
        (!w->shexp_gate ||
         (SHAPED(w->shexp_gate, "ffn_gate_shexp", d, fs, 1, shared) &&
          SHAPED(w->shexp_up, "ffn_up_shexp", d, fs, 1, shared) &&
          SHAPED(w->shexp_down, "ffn_down_shexp", fs, d, 1, shared))) &&
        (!w->shexp_router ||
         SHAPED(w->shexp_router, "ffn_gate_inp_shexp", d, 1, 1, "embedding_length and one gate")) &&
        (!w->choice_bias || SHAPED(w->choice_bias, "exp_probs_b", E, 1, 1, "expert_count"));
#undef SHAPED
}
