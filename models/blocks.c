/*
 * models/blocks.c - see blocks.h.
 */
#include "blocks.h"

#include <math.h>

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
