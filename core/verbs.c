/*
 * core/verbs.c - the verbs a model's forward pass is written in (runner.h's loom_rt_*): views
 * of tensors, and one function per op that fills the op's parameters and hands them to
 * loom_runner_exec_op (core/runner.c), which picks the backend or the CPU fallback. The
 * recurrent layers' verbs are core/recurrent.c's.
 */
#include "runner_internal.h"

#include <assert.h>
#include <math.h>

/* The views below stay inside the tensor they look into: a view past its end would read another
 * tensor's bytes, or past the buffer's end, without any backend noticing. */
loom_tensor loom_rt_rows(const loom_tensor *t, int64_t r0, int64_t n)
{
    assert(r0 >= 0 && n >= 0 && r0 + n <= t->ne[1]);
    loom_tensor v = *t;
    v.offset += (uint64_t)r0 * t->nb[1];
    v.ne[1] = n;
    return v;
}

loom_tensor loom_rt_reshape(const loom_tensor *t, int64_t n0, int64_t n1, int64_t n2)
{
    assert(n0 >= 0 && n1 >= 0 && n2 >= 0 &&
           n0 * n1 * n2 <= t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3]);
    return loom_runner_dense(t->buf, t->offset, t->dtype, n0, n1, n2, 1);
}

loom_tensor loom_rt_cols(const loom_tensor *t, int64_t c0, int64_t n)
{
    assert(c0 >= 0 && n >= 0 && c0 + n <= t->ne[0]);
    loom_tensor v = *t;
    v.offset += (uint64_t)c0 * t->nb[0];
    v.ne[0] = n;
    return v;
}

loom_tensor loom_rt_heads(const loom_tensor *t, int64_t c0, int64_t head_dim, int64_t n_heads)
{
    assert(c0 >= 0 && head_dim >= 0 && n_heads >= 0 && c0 + head_dim * n_heads <= t->ne[0]);
    loom_tensor v = *t;
    v.offset += (uint64_t)c0 * t->nb[0];
    v.ne[0] = head_dim, v.ne[1] = n_heads, v.ne[2] = t->ne[1], v.ne[3] = 1;
    v.nb[1] = (uint64_t)head_dim * t->nb[0];
    v.nb[2] = t->nb[1];
    v.nb[3] = t->nb[1] * (uint64_t)t->ne[1];
    return v;
}

void loom_rt_get_rows(loom_runner *r, const loom_tensor *w, const loom_tensor *ids,
                      const loom_tensor *dst)
{
    if (!loom_runner_held(r, w, "get_rows"))
        return;
    loom_get_rows_params p = {sizeof p, w, ids, dst};
    loom_runner_exec_op(r, LOOM_OP_GET_ROWS, w->dtype, "get_rows", &p);
}

void loom_rt_matmul(loom_runner *r, const loom_tensor *x, const loom_tensor *w,
                    const loom_tensor *bias, const loom_tensor *y)
{
    if (r->status || !loom_runner_held(r, w, "matmul") || !loom_runner_held(r, bias, "matmul"))
        return;
    loom_matmul_params p = {sizeof p, x, loom_runner_matmul_weight(r, w), bias, y};
    loom_runner_exec_op(r, LOOM_OP_MATMUL, w->dtype, "matmul", &p);
}

void loom_rt_rms_norm(loom_runner *r, const loom_tensor *x, const loom_tensor *w, float eps,
                      const loom_tensor *dst)
{
    if (!loom_runner_held(r, w, "rms_norm"))
        return;
    loom_norm_params p = {sizeof p, x, w, NULL, dst, eps};
    loom_runner_exec_op(r, LOOM_OP_RMS_NORM, LOOM_F32, "rms_norm", &p);
}

void loom_rt_layer_norm(loom_runner *r, const loom_tensor *x, const loom_tensor *w,
                        const loom_tensor *b, float eps, const loom_tensor *dst)
{
    if (!loom_runner_held(r, w, "layer_norm") || !loom_runner_held(r, b, "layer_norm"))
        return;
    loom_norm_params p = {sizeof p, x, w, b, dst, eps};
    loom_runner_exec_op(r, LOOM_OP_LAYER_NORM, LOOM_F32, "layer_norm", &p);
}

void loom_rt_rope(loom_runner *r, const loom_tensor *x, const loom_hparams *hp,
                  const loom_tensor *freq_factors)
{
    loom_rope_params p = {.struct_size = sizeof p,
                          .x = x,
                          .pos = &r->in.pos,
                          .dst = x,
                          .mode = hp->rope_mode,
                          .n_rot = hp->n_rot,
                          .freq_base = hp->rope_base,
                          .freq_scale = hp->rope_scale,
                          .freq_factors = freq_factors};
    loom_runner_exec_op(r, LOOM_OP_ROPE, LOOM_F32, "rope", &p);
}

void loom_rt_rope_at(loom_runner *r, const loom_tensor *x, const loom_hparams *hp,
                     const loom_tensor *pos, const loom_tensor *pos2)
{
    loom_rope_params p = {.struct_size = sizeof p,
                          .x = x,
                          .pos = pos,
                          .pos2 = pos2,
                          .dst = x,
                          .mode = hp->rope_mode,
                          .n_rot = hp->n_rot,
                          .freq_base = hp->rope_base,
                          .freq_scale = hp->rope_scale};
    loom_runner_exec_op(r, LOOM_OP_ROPE, LOOM_F32, "rope", &p);
}

void loom_rt_kv_store(loom_runner *r, const loom_tensor *src, const loom_tensor *cache)
{
    if (!loom_runner_held(r, cache, "kv_store"))
        return;
    loom_kv_store_params p = {sizeof p, src, &r->in.slots, cache};
    loom_runner_exec_op(r, LOOM_OP_KV_STORE, cache->dtype, "kv_store", &p);
}

void loom_rt_attention(loom_runner *r, const loom_tensor *q, int layer, float scale,
                       const loom_tensor *dst)
{
    if (layer < r->layer0 || layer >= r->layer_end) {
        loom_runner_fail(
            r, "attention over layer %d, which this runner does not hold (it holds [%d, %d))",
            layer, r->layer0, r->layer_end);
        return;
    }
    loom_attention_params p = {.struct_size = sizeof p,
                               .q = q,
                               .k_cache = &r->kc[layer],
                               .v_cache = &r->vc[layer],
                               .block_table = &r->in.block_table,
                               .seq = &r->in.seq,
                               .pos = &r->in.pos,
                               .prefix_len = r->has_prefix ? &r->in.prefix_len : NULL,
                               .dst = dst,
                               .scale = scale,
                               .window = r->hp.n_swa};
    loom_runner_exec_op(r, LOOM_OP_ATTENTION, r->kc[layer].dtype, "attention", &p);
}

void loom_rt_add(loom_runner *r, const loom_tensor *a, const loom_tensor *b, const loom_tensor *dst)
{
    loom_elementwise_params p = {sizeof p, a, b, dst, 0};
    loom_runner_exec_op(r, LOOM_OP_ADD, LOOM_F32, "add", &p);
}

void loom_rt_gelu(loom_runner *r, const loom_tensor *a, const loom_tensor *dst)
{
    loom_elementwise_params p = {sizeof p, a, NULL, dst, 0};
    loom_runner_exec_op(r, LOOM_OP_GELU, LOOM_F32, "gelu", &p);
}

void loom_rt_scale(loom_runner *r, const loom_tensor *a, float s, const loom_tensor *dst)
{
    loom_elementwise_params p = {sizeof p, a, NULL, dst, s};
    loom_runner_exec_op(r, LOOM_OP_SCALE, LOOM_F32, "scale", &p);
}

void loom_rt_silu_mul(loom_runner *r, const loom_tensor *a, const loom_tensor *b,
                      const loom_tensor *dst)
{
    loom_elementwise_params p = {sizeof p, a, b, dst, 0};
    loom_runner_exec_op(r, LOOM_OP_SILU_MUL, LOOM_F32, "silu_mul", &p);
}

void loom_rt_sigmoid_mul(loom_runner *r, const loom_tensor *a, const loom_tensor *b,
                         const loom_tensor *dst)
{
    loom_elementwise_params p = {sizeof p, a, b, dst, 0};
    loom_runner_exec_op(r, LOOM_OP_SIGMOID_MUL, LOOM_F32, "sigmoid_mul", &p);
}

void loom_rt_moe_route(loom_runner *r, const loom_hparams *hp, const loom_tensor *logits,
                       const loom_tensor *bias, const loom_tensor *ids, const loom_tensor *weights)
{
    if (!loom_runner_held(r, bias, "moe_route"))
        return;
    loom_moe_route_params p = {.struct_size = sizeof p,
                               .logits = logits,
                               .bias = bias,
                               .ids = ids,
                               .weights = weights,
                               .gating = hp->moe_gating,
                               .normalize = hp->moe_normalize,
                               .scale = hp->moe_scale,
                               .n_group = hp->moe_groups > 1 ? hp->moe_groups : 0,
                               .topk_group = hp->moe_groups > 1 ? hp->moe_groups_kept : 0};
    loom_runner_exec_op(r, LOOM_OP_MOE_ROUTE, LOOM_F32, "moe_route", &p);
}

void loom_rt_sigmoid_gate(loom_runner *r, const loom_tensor *logits, const loom_tensor *ids,
                          const loom_tensor *weights)
{
    loom_moe_route_params p = {.struct_size = sizeof p,
                               .logits = logits,
                               .ids = ids,
                               .weights = weights,
                               .gating = LOOM_MOE_SIGMOID,
                               .scale = 1.0f};
    loom_runner_exec_op(r, LOOM_OP_MOE_ROUTE, LOOM_F32, "moe_route", &p);
}

void loom_rt_matmul_id(loom_runner *r, const loom_tensor *x, const loom_tensor *w,
                       const loom_tensor *ids, const loom_tensor *y)
{
    if (r->status || !loom_runner_held(r, w, "matmul_id"))
        return;
    /* a stack prepared at load (prepare_stack) runs in its prepared form */
    if (w >= r->weights && w < r->weights + r->gguf->n_tensors &&
        r->prep[w - r->weights] == PREP_DONE)
        w = &r->prepared[w - r->weights];
    loom_matmul_id_params p = {sizeof p, x, w, ids, y};
    loom_runner_exec_op(r, LOOM_OP_MATMUL_ID, w->dtype, "matmul_id", &p);
}

void loom_rt_moe_combine(loom_runner *r, const loom_tensor *src, const loom_tensor *weights,
                         int accumulate, const loom_tensor *dst)
{
    loom_moe_combine_params p = {sizeof p, src, weights, dst, accumulate};
    loom_runner_exec_op(r, LOOM_OP_MOE_COMBINE, LOOM_F32, "moe_combine", &p);
}
