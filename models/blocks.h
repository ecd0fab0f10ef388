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
    const loom_tensor *post_norm;  /* RMSNorm of the block's output before the residual add
                                    * (GLM-4-0414's post_self_attn_layernorm), or NULL */
    const loom_tensor *rope_freqs; /* RoPE frequency divisors (Llama 3.1), for every layer */
} loom_attn_weights;

/* The step's attention scratch: h [d, n]; qkv [q_dim + 2 kv_dim, n] and its column views q, k,
 * v and head views q3, k3, v3; att [q_dim, n] and att3, its head view. */
typedef struct loom_attn_buffers {
    loom_tensor h, qkv, q, k, v, q3, k3, v3, att, att3;
} loom_attn_buffers;

/* The buffers for n tokens of hp's shape (a step's scratch). */
loom_attn_buffers loom_attn_buffers_new(loom_runner *r, const loom_hparams *hp, int64_t n);

/* x += wo attention(rope(q), rope(k), v), q, k, v projected from rms_norm(x) * norm (and the
 * sum normalised by post_norm first, where there is one). */
void loom_attn_block(loom_runner *r, const loom_hparams *hp, int layer, const loom_tensor *x,
                     const loom_attn_weights *w, const loom_attn_buffers *b);

/* The step's feed-forward scratch: gate and up [n_ff, n] (column views of fused [2 n_ff, n]
 * when the family's projection is fused), act [n_ff, n] (may be gate itself), h [d, n]. */
typedef struct loom_ffn_buffers {
    loom_tensor h, fused, gate, up, act;
} loom_ffn_buffers;

/* One layer's SwiGLU feed-forward weights. up NULL: gate is the fused [gate; up] projection
 * (ChatGLM's dense_h_to_4h, GLM-4-0414's gate_up_proj). */
typedef struct loom_ffn_weights {
    const loom_tensor *norm; /* RMSNorm before the block */
    const loom_tensor *gate, *up, *down;
    const loom_tensor *post_norm; /* RMSNorm of the block's output (GLM-4-0414), or NULL */
} loom_ffn_weights;

/* x += down (silu(gate h) * up h), h = rms_norm(x) * norm; with post_norm the sum is
 * rms_norm(...) * post_norm. A fused projection writes b->fused. */
void loom_ffn_swiglu(loom_runner *r, const loom_hparams *hp, const loom_tensor *x,
                     const loom_ffn_weights *w, const loom_ffn_buffers *b);

/* A mixture-of-experts feed-forward layer's weights (GGUF's names): the router, the experts
 * stacked [experts, ...], and a shared expert every token runs, NULL where the family has
 * none (Qwen3-MoE), gated by sigmoid(shexp_router h) where it has that (Qwen2-MoE). */
typedef struct loom_moe_weights {
    const loom_tensor *norm;                  /* ffn_norm */
    const loom_tensor *router;                /* ffn_gate_inp [experts, d] */
    const loom_tensor *choice_bias;           /* exp_probs_b [experts] (GLM-4.5), or NULL */
    const loom_tensor *gate_exps, *up_exps;   /* [experts, n_ff_exp, d] */
    const loom_tensor *down_exps;             /* [experts, d, n_ff_exp] */
    const loom_tensor *shexp_gate, *shexp_up; /* [n_ff_shexp, d], or NULL */
    const loom_tensor *shexp_down;            /* [d, n_ff_shexp] */
    const loom_tensor *shexp_router;          /* ffn_gate_inp_shexp [1, d], or NULL */
} loom_moe_weights;

/* The step's scratch for n tokens of hp's shape. */
typedef struct loom_moe_buffers {
    loom_tensor h, h3, logits, ids, weights, gate, up, out;
    loom_tensor sh_gate, sh_up, sh_out, sh_out3, sh_logit, sh_ids, sh_weight;
} loom_moe_buffers;

loom_moe_buffers loom_moe_buffers_new(loom_runner *r, const loom_hparams *hp, int64_t n,
                                      int shared);

/* x += sum over the k chosen experts e of weight_e * down_e(silu(gate_e h) * up_e h)
 *      (+ the shared expert, times its gate), h = rms_norm(x) * norm. */
void loom_ffn_moe(loom_runner *r, const loom_hparams *hp, const loom_tensor *x,
                  const loom_moe_weights *w, const loom_moe_buffers *b);

/* Layer l's experts under llama.cpp's names into w: the router ffn_gate_inp, its choice bias
 * exp_probs_b.bias (or exp_probs_b) where the file has one, the ffn_{gate,up,down}_exps stacks,
 * and a shared expert ffn_*_shexp where there is one, with its gate ffn_gate_inp_shexp
 * (required beside it when gated_shared: Qwen2-MoE's and Qwen3.5's are, GLM's are not);
 * norm, the layer's ffn_norm. A required tensor that is missing fails the runner. */
void loom_moe_load(loom_runner *r, int l, const loom_tensor *norm, int gated_shared,
                   loom_moe_weights *w);

/* The experts' hyper-parameters under llama.cpp's keys (expert_count, expert_used_count,
 * expert_feed_forward_length, expert_shared_feed_forward_length, ...): routed by softmax (1) or
 * sigmoid (2) as expert_gating_func says (gating_default when absent: Qwen's softmax, GLM-4.5's
 * sigmoid), the chosen experts' weights renormalised as expert_weights_norm says
 * (normalize_default when absent: Qwen3-MoE's norm_topk_prob, Qwen2-MoE's none). */
int loom_moe_read_hparams(const loom_gguf *g, const char *arch, int gating_default,
                          int normalize_default, loom_hparams *hp, char *err, size_t err_size);
/* Whether layer l's expert weights have the shapes hp says (an older file's shared expert width
 * is read from its tensor); if not, err names the tensor and both shapes. */
int loom_moe_shapes_ok(loom_hparams *hp, int l, const loom_moe_weights *w, char *err,
                       size_t err_size);

#endif
