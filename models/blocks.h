/*
 * models/blocks.h - the layer pieces the families share, written once: the pre-norm attention
 * block (Llama, Qwen, ChatGLM2/3, GLM-4, Mistral) and the pre-norm SwiGLU feed-forward. A family
 * states its differences as data (fused or separate projections, biases, Q/K norms, RoPE
 * factors); a new kind of layer (the mixture-of-experts feed-forward) is one more builder
 * here. The scratch tensors are the family's, allocated once a step.
 */
#ifndef LOOM_MODELS_BLOCKS_H
#define LOOM_MODELS_BLOCKS_H

#include "core/runner.h"

/* One layer's attention weights; NULL where the family has none. Either wqkv (with bqkv: Q, K
 * and V side by side in its output rows) or wq, wk, wv (with bq, bk, bv). */
typedef struct loom_attn_weights {
    const loom_tensor *norm; /* RMSNorm before the block */
    const loom_tensor *wqkv, *bqkv;
    const loom_tensor *wq, *wk, *wv, *bq, *bk, *bv;
    const loom_tensor *q_norm, *k_norm; /* per-head RMSNorm of Q and K (Qwen3) */
    const loom_tensor *wo;
    const loom_tensor *rope_freqs; /* RoPE frequency divisors (Llama 3.1), for every layer */
} loom_attn_weights;

/* The step's attention scratch: h [d, n]; qkv [q_dim + 2 kv_dim, n] and its column views q, k,
 * v and head views q3, k3, v3; att [q_dim, n] and att3, its head view. */
typedef struct loom_attn_buffers {
    loom_tensor h, qkv, q, k, v, q3, k3, v3, att, att3;
} loom_attn_buffers;

/* The buffers for n tokens of hp's shape (a step's scratch). */
loom_attn_buffers loom_attn_buffers_new(loom_runner *r, const loom_hparams *hp, int64_t n);

/* x += wo attention(rope(q), rope(k), v), q, k, v projected from rms_norm(x) * norm. */
void loom_attn_block(loom_runner *r, const loom_hparams *hp, int layer, const loom_tensor *x,
                     const loom_attn_weights *w, const loom_attn_buffers *b);

/* The step's feed-forward scratch: gate and up [n_ff, n] (column views of fused [2 n_ff, n]
 * when the family's projection is fused), act [n_ff, n] (may be gate itself), h [d, n]. */
typedef struct loom_ffn_buffers {
    loom_tensor h, fused, gate, up, act;
} loom_ffn_buffers;

/* x += w_down (silu(w_gate h) * w_up h), h = rms_norm(x) * norm. w_up NULL: w_gate is the
 * fused [gate; up] projection (ChatGLM's dense_h_to_4h), writing b->fused. */
void loom_ffn_swiglu(loom_runner *r, const loom_hparams *hp, const loom_tensor *x,
                     const loom_tensor *norm, const loom_tensor *w_gate, const loom_tensor *w_up,
                     const loom_tensor *w_down, const loom_ffn_buffers *b);

#endif
