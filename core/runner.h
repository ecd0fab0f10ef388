/*
 * core/runner.h - running a model's forward pass on a backend: weights, the paged KV cache,
 * scratch activations, and the op helpers model code is written with.
 *
 * The core knows no model. A model family supplies a loom_arch (models/): how to read its
 * hyper-parameters and weights, and its forward pass written with loom_rt_* verbs, which
 * call the backend through the ABI. Errors stick: after the first failed op the rest of the
 * pass is skipped and loom_rt_status returns the first message.
 */
#ifndef LOOM_CORE_RUNNER_H
#define LOOM_CORE_RUNNER_H

#include "gguf.h"
#include "kvblocks.h"
#include "loader.h"

#define LOOM_MAX_LAYERS 512
/* tokens per KV cache block unless a caller says (loom_runner_options.block_size 0) */
#define LOOM_RUNNER_BLOCK_SIZE 16
/* experts per layer loom runs: today's largest have 256 (DeepSeek-V3) and 512 (Qwen3-Next) */
#define LOOM_MAX_EXPERTS 1024

/* Hyper-parameters every family fills in (others go in its own state). */
typedef struct loom_hparams {
    char arch[32];
    int32_t n_vocab;
    int32_t n_embd;
    int32_t n_layer;
    int32_t n_head;
    int32_t n_head_kv;
    int32_t head_dim;
    int32_t n_ff;
    int32_t n_ctx_train;
    float norm_eps;
    float rope_base;
    float rope_scale;  /* linear position scaling, 1 = none */
    float attn_factor; /* YaRN's scale of the rotated q and k (so attention's by its square);
                        * 1 = none */
    int32_t n_rot;
    int32_t rope_mode; /* loom_rope_mode */
    int32_t n_swa;     /* sliding-window attention: keys within this many positions; 0 = all */
    /* mixture of experts (0 experts: a dense model) */
    int32_t n_expert, n_expert_used; /* experts per layer, and chosen per token */
    int32_t n_ff_exp, n_ff_shexp;    /* an expert's and the shared expert's width */
    int32_t moe_gating;              /* loom_moe_gating */
    int32_t moe_normalize;           /* the chosen experts' weights sum to one */
    float moe_scale;                 /* the weights' factor (routed_scaling_factor), 1 = none */
    /* group-limited routing (n_group, topk_group): experts chosen only within the best
     * moe_groups_kept of moe_groups groups; 0 or 1 groups: none */
    int32_t moe_groups, moe_groups_kept;
    /* Recurrent layers (Gated DeltaNet: Qwen3.5, Qwen3-Next), marked in `recurrent`: they keep
     * a state per sequence instead of a KV cache (core/recurrent.c): a conv window of
     * ssm_conv_kernel - 1 inputs of ssm_conv_channels, and per each of ssm_v_heads value heads a
     * ssm_d_k x ssm_d_v delta-rule matrix. No layer marked: none (every other field 0). */
    uint64_t recurrent[LOOM_MAX_LAYERS / 64];
    int32_t ssm_conv_kernel, ssm_conv_channels, ssm_v_heads, ssm_d_k, ssm_d_v;
    /* Multi-token-prediction blocks past the n_layer layers (GGUF nextn_predict_layers): run
     * only by a runner opened with loom_runner_options.mtp, as the model's own drafter. */
    int32_t n_nextn;
    /* The values are the keys (multi-head latent attention: every head reads the cached latent
     * as its value and takes what it needs): one cache per layer, loom_rt_vcache the key
     * cache's tensor, nothing stored as values. */
    int kv_values_in_keys;
} loom_hparams;

static inline int loom_layer_recurrent(const loom_hparams *hp, int layer)
{
    return layer >= 0 && layer < LOOM_MAX_LAYERS && (hp->recurrent[layer / 64] >> (layer % 64)) & 1;
}
static inline void loom_layer_set_recurrent(loom_hparams *hp, int layer)
{
    if (layer >= 0 && layer < LOOM_MAX_LAYERS)
        hp->recurrent[layer / 64] |= (uint64_t)1 << (layer % 64);
}

typedef struct loom_runner loom_runner;

/* One step's tokens (prefill chunks and decode tokens of any number of sequences), as the model
 * sees it; the per-token inputs are on the device (loom_rt_inputs_of). */
typedef struct loom_batch {
    int32_t n;        /* tokens */
    int32_t n_logits; /* rows of in.logit_rows whose logits are wanted (0: none) */
    /* the same inputs on the host, for models that derive more from them */
    const int32_t *pos, *seq;
    const int32_t *prefix_len; /* per sequence, or NULL (purely causal) */
    int32_t n_hidden;          /* rows of in.hidden_rows whose final hidden states are wanted */
} loom_batch;

typedef struct loom_arch {
    const char *name; /* general.architecture */
    /* Reads hyper-parameters and looks up weights (loom_rt_weight) into *state. */
    int (*load)(loom_runner *r, loom_hparams *hp, void **state, char *err, size_t err_size);
    /* Runs the batch; returns loom_rt_status (nonzero fails the step, with the runner's error
     * when an op set one). */
    int (*forward)(loom_runner *r, void *state, const loom_batch *b);
    void (*free_state)(void *state);
    /* Optional: for a prompt ids[0..n), how many leading tokens attend to each other both
     * ways (ChatGLM-6B's prefix up to [gMASK]); NULL or 0 = purely causal. A family with such
     * a prefix cannot reuse a cached prefix for a different prompt. */
    int32_t (*prefix_len)(void *state, const int32_t *ids, int32_t n);
} loom_arch;

/* A pipeline stage's connection to the others (docs/DISTRIBUTED.md). recv and send carry a
 * step's hidden states, [n_tokens][n_embd] f32, from the previous stage and on to the next;
 * each call is NULL where there is no such neighbour. The rest are for stages in different
 * processes, NULL when one caller drives every stage (tests): the first stage announces each
 * step and block copy before running it (the others run what is announced) and receives the
 * last stage's logits, n_logits x n_vocab floats, maybe none, after every step; the last stage
 * sends them; a stage whose step failed calls fail with the message, so that the error travels
 * on to the first stage instead of leaving the others waiting. All return 0 or -1 with err. */
struct loom_step;
typedef struct loom_stage_link {
    void *ctx;
    int (*recv)(void *ctx, float *x, uint64_t count, char *err, size_t err_size);
    int (*send)(void *ctx, const float *x, uint64_t count, char *err, size_t err_size);
    int (*announce_step)(void *ctx, const struct loom_step *s, char *err, size_t err_size);
    int (*announce_copy)(void *ctx, const loom_kvcopy *c, int n, char *err, size_t err_size);
    int (*recv_logits)(void *ctx, float *logits, uint64_t count, char *err, size_t err_size);
    int (*send_logits)(void *ctx, const float *logits, uint64_t count, char *err, size_t err_size);
    void (*fail)(void *ctx, const char *message);
} loom_stage_link;

typedef struct loom_runner_options {
    int32_t n_ctx;        /* 0: the model's training context, capped at 4096 */
    int32_t block_size;   /* KV block size; 0: LOOM_RUNNER_BLOCK_SIZE */
    loom_dtype kv_type;   /* LOOM_F16 (default) or LOOM_F32 */
    int32_t n_batch;      /* prefill chunk, default 256 */
    int32_t kv_blocks;    /* KV cache blocks; 0: see kv_sequences */
    int32_t kv_sequences; /* with kv_blocks 0: blocks for this many sequences of up to 1024
                          * tokens (n_ctx if shorter), at least one of n_ctx; 0: one of n_ctx */
    /* Behaviours the API layer takes from loom.h's options or the environment (the core reads
     * no environment variables); zero is the default of each. */
    int repack; /* offer weights to the backend's prepare_weight: 0 or 1 yes, -1 no */
    int strict; /* an op the backend lacks is an error, not a run on the CPU */
    /* where the CPU fallback finds its module (NULL: the loader's defaults) */
    const struct loom_loader_options *loader;
    /* A pipeline stage (link non-NULL): layers [first_layer, end_layer) only, maybe none (a
     * stage of the head alone). Only the stage's weights are loaded (loom_runner_stage_holds)
     * and only its layers' KV cache allocated. A stage after the first takes its input from
     * link->recv instead of embedding the ids; one before the last hands its output to
     * link->send instead of computing logits. */
    const loom_stage_link *link;
    int32_t first_layer, end_layer;
    /* A pipeline's first stage: a step of several tokens goes down in up to this many parts,
     * so that the stages work at the same time (0 or 1: whole). */
    int32_t micro_batches;
    /* Experts on a second device (the caller's, open for the runner's life): the expert stacks
     * (GGUF's 3-D ffn_*_exps) are loaded there instead, mapped from the file where it can,
     * and matmul_id, the op that reads them, runs there with its activations copied over and
     * back; everything else stays on dev. NULL: all on dev. A model without experts is refused
     * with it. */
    loom_device *experts;
    /* Not a pipeline stage: only layers [0, first_layers), then the final norm and the head (the
     * model's own shallow layers as a speculative drafter); only their weights are loaded and
     * only their KV cache allocated. 0: every layer. */
    int32_t first_layers;
    /* Models with recurrent layers: state slots (loom_step's state_slots); 0: three per
     * kv_sequences (a sequence's own, its checkpoint for speculation, and one for a snapshot
     * a later prompt resumes from), or 2 without kv_sequences. */
    int32_t state_slots;
    /* The model's multi-token-prediction block instead of its layers (hp n_nextn above 0): the
     * runner holds layer n_layer alone (only its weights, the embeddings and the head are
     * loaded), and token t's input is its id's embedding beside hidden_in[t], the model's final
     * hidden state at the position before (loom_step.hidden_in, loom_runner_eval_mtp). */
    int mtp;
} loom_runner_options;

/* Opens the model in gguf on dev (which stays the caller's) with arch. */
loom_runner *loom_runner_create(loom_device *dev, const loom_gguf *gguf, const loom_arch *arch,
                                const loom_runner_options *opts, char *err, size_t err_size);
void loom_runner_free(loom_runner *r);
const loom_hparams *loom_runner_hparams(const loom_runner *r);
int32_t loom_runner_n_ctx(const loom_runner *r);

/* Runs ids[0..n) at positions pos0.. (prefill in chunks of n_batch). On success, with
 * want_logits, the last token's logits are in loom_runner_logits. Returns 0 or -1 with err. */
int loom_runner_eval(loom_runner *r, const int32_t *ids, int32_t n, int32_t pos0, char *err,
                     size_t err_size);
/* As loom_runner_eval, writing every token's logits to out (n rows of n_vocab floats):
 * perplexity. */
int loom_runner_eval_all(loom_runner *r, const int32_t *ids, int32_t n, int32_t pos0, float *out,
                         char *err, size_t err_size);
/* As loom_runner_eval from position 0, handing the final hidden states (after the model's final
 * norm, before its head) to rows chunk by chunk: every token's, or (every_row 0) the last's.
 * Not on a pipeline of stages. */
typedef void (*loom_rows_fn)(void *user, const float *rows, int32_t n);
int loom_runner_eval_hidden(loom_runner *r, const int32_t *ids, int32_t n, int every_row,
                            loom_rows_fn rows, void *user, char *err, size_t err_size);
/* From now on every loom_runner_eval, _eval_all and _eval_mtp also hands each token's final
 * hidden state (after the final norm) to fn, chunk by chunk with the chunk's first position:
 * what a multi-token-prediction drafter reads. fn NULL: no more. Not on a pipeline of stages. */
typedef void (*loom_rows_at_fn)(void *user, int32_t pos0, const float *rows, int32_t n);
void loom_runner_follow(loom_runner *r, loom_rows_at_fn fn, void *user);
/* An MTP runner's (loom_runner_options.mtp) loom_runner_eval: token t's input is ids[t] beside
 * hidden[t * n_embd ..], the model's final hidden state at position pos0 + t. */
int loom_runner_eval_mtp(loom_runner *r, const int32_t *ids, const float *hidden, int32_t n,
                         int32_t pos0, char *err, size_t err_size);
/* The logits of the last eval or step: n_logits rows of n_vocab floats. */
const float *loom_runner_logits(const loom_runner *r);
/* The final hidden states of the last step's hidden_rows: n_hidden rows of n_embd floats. */
const float *loom_runner_hidden(const loom_runner *r);

/* One step over many sequences. Token t has id ids[t] at position pos[t] of sequence seq[t]
 * (a row of block_table, [n_seqs][max_blocks]) and its K/V go to cache slot slots[t]. The logits
 * of tokens logit_rows[0..n_logits) are copied to the host. The caller (a block manager) owns
 * the block table; loom_runner_eval is this with one sequence over blocks 0, 1, 2... */
typedef struct loom_step {
    int32_t n_tokens;
    const int32_t *ids, *pos, *seq, *slots;
    int32_t n_seqs, max_blocks;
    const int32_t *block_table;
    int32_t n_logits;
    const int32_t *logit_rows;
    const int32_t *prefix_len; /* [n_seqs] bidirectional prefix per sequence, or NULL */
    /* tokens whose final hidden states (after the model's final norm, before the head) are
     * copied to the host (embeddings); not on a pipeline of stages */
    int32_t n_hidden;
    const int32_t *hidden_rows;
    /* [n_seqs]: each sequence's recurrent-state slot, below loom_runner_state_slots (models
     * with recurrent layers); NULL: slot 0, for a step of one sequence. A sequence's state
     * continues from the last step that ran it, or starts empty at position 0. */
    const int32_t *state_slots;
    /* An MTP runner's (loom_runner_options.mtp) second input, [n_tokens][n_embd]: the model's
     * final hidden state beside each token; NULL on any other runner. */
    const float *hidden_in;
} loom_step;
int loom_runner_step(loom_runner *r, const loom_step *s, char *err, size_t err_size);

/* The bidirectional prefix length of a prompt for this model (0: causal), from its family;
 * has_prefix: whether the family has such prefixes at all. */
int32_t loom_runner_prefix_len(const loom_runner *r, const int32_t *ids, int32_t n);
int loom_runner_has_prefix(const loom_runner *r);

/* Whether this runner is the pipeline's last stage (no next stage: it has the logits); always
 * true without a pipeline. */
int loom_runner_is_last_stage(const loom_runner *r);
/* Whether a pipeline stage of layers [first, end), with or without a previous and a next
 * stage, holds the GGUF tensor `name`: blk.N.* belongs to layer N's stage; token_embd to the
 * first stage, and to the last as well when the file has no output.weight (a tied head);
 * output and output_norm to the last; any other tensor to every stage. */
int loom_runner_stage_holds(const loom_gguf *g, int32_t first, int32_t end, int has_prev,
                            int has_next, const char *name);

/* Cuts a model of n_layer layers into n_stages pipeline stages of about equal weight bytes
 * (the embeddings count with the first, the head with the last): stage s gets layers
 * [cut[s], cut[s + 1]), cut[0] = 0, cut[n_stages] = n_layer; a stage may get none. 0, or -1
 * when out of memory. */
int loom_runner_plan_stages(const loom_gguf *g, int32_t n_layer, int n_stages, int32_t *cut);

/* Weights now used in a layout the backend prepared for them (prepare_weight). */
int64_t loom_runner_prepared_weights(const loom_runner *r);
int32_t loom_runner_kv_blocks(const loom_runner *r);
int32_t loom_runner_block_size(const loom_runner *r);
/* Bytes of cache one block holds over all layers, K and V. */
uint64_t loom_runner_block_bytes(const loom_runner *r);
/* the KV cache's type (loom_runner_options.kv_type as the runner settled it) */
loom_dtype loom_runner_kv_type(const loom_runner *r);
/* whether it is one stage of a pipeline (its other layers' caches are elsewhere) */
int loom_runner_is_stage(const loom_runner *r);
/* Recurrent layers: state slots (0 for a model without such layers) and the bytes of one. */
int32_t loom_runner_state_slots(const loom_runner *r);
uint64_t loom_runner_state_bytes(const loom_runner *r);
/* The position slot's state has reached (the tokens it has seen), or -1 when it holds none. */
int32_t loom_runner_state_position(const loom_runner *r, int32_t slot);
/* Copies slot from's state (every layer, and its position) over slot to: a checkpoint before
 * a speculative pass, and its restoring when a proposal is rejected. 0, or -1 with err. */
int loom_runner_state_copy(loom_runner *r, int32_t from, int32_t to, char *err, size_t err_size);
/* Copies whole blocks (every layer, K and V): copy on write for shared blocks. */
/* Block `block`'s K/V, every layer the runner holds, copied to host (to_host) or from it:
 * loom_runner_block_bytes bytes. 0, or -1 with err. */
int loom_runner_block_io(loom_runner *r, int32_t block, void *host, int to_host, char *err,
                         size_t err_size);
int loom_runner_copy_blocks(loom_runner *r, const loom_kvcopy *copies, int n, char *err,
                            size_t err_size);

/* ---- For model code ----------------------------------------------------------------------- */

const loom_gguf *loom_rt_gguf(const loom_runner *r);
/* A weight by GGUF name, on the device; NULL when absent (required: an error names it). On a
 * pipeline stage, a weight of another stage has its shape but no data: a verb given it fails. */
const loom_tensor *loom_rt_weight(loom_runner *r, const char *name, int required);
/* A scratch activation tensor for this pass, dims innermost first (n1, n2 may be 1). */
loom_tensor loom_rt_scratch(loom_runner *r, loom_dtype dt, int64_t n0, int64_t n1, int64_t n2);
/* Views: rows [r0, r0 + n) of a 2-D tensor; and a reshape of a dense tensor. */
loom_tensor loom_rt_rows(const loom_tensor *t, int64_t r0, int64_t n);
loom_tensor loom_rt_reshape(const loom_tensor *t, int64_t n0, int64_t n1, int64_t n2);
/* Columns [c0, c0 + n) of a 2-D f32 tensor (a fused projection's part). */
loom_tensor loom_rt_cols(const loom_tensor *t, int64_t c0, int64_t n);
/* Columns [c0, c0 + n_heads * head_dim) of a 2-D f32 tensor as [rows, n_heads, head_dim]. */
loom_tensor loom_rt_heads(const loom_tensor *t, int64_t c0, int64_t head_dim, int64_t n_heads);

/* The batch's per-token inputs on the device: ids, positions, KV slots, sequence ids, the block
 * table, and which tokens' logits are wanted. */
typedef struct loom_rt_inputs {
    loom_tensor ids, pos, slots, seq, block_table, logit_rows, prefix_len, hidden_rows;
    loom_tensor state_slots; /* [tokens]: each token's recurrent-state slot (hybrid models) */
    loom_tensor hidden_in;   /* [n_embd, tokens]: an MTP runner's loom_step.hidden_in */
} loom_rt_inputs;
/* Whether this runner runs the model's multi-token-prediction block (loom_runner_options.mtp):
 * the family's load and forward then build that block instead of the layers. */
int loom_rt_mtp(const loom_runner *r);
const loom_rt_inputs *loom_rt_inputs_of(const loom_runner *r);
/* Layer l's K and V caches. */
const loom_tensor *loom_rt_kcache(const loom_runner *r, int layer);
const loom_tensor *loom_rt_vcache(const loom_runner *r, int layer);
/* n int32 values from the host in a scratch tensor [n] on the device. */
loom_tensor loom_rt_upload_i32(loom_runner *r, const int32_t *host, int64_t n);
/* n floats the family computed at load (YaRN's frequency divisors), on the device for the
 * runner's life; a failure is in loom_rt_status. */
const loom_tensor *loom_rt_constant(loom_runner *r, const float *host, int64_t n);

/* Where the wanted logits go: a [n_logits, n_vocab] f32 scratch tensor the runner copies out. */
void loom_rt_set_logits(loom_runner *r, const loom_tensor *logits);
/* The usual tail: gathers the wanted rows of the residual stream x, normalises them (RMSNorm
 * with weight norm, or LayerNorm when norm_bias is given) and projects them with output into
 * the logits (a no-op when none are wanted); the rows whose hidden states are wanted are
 * normalised the same way and kept as they are. On a pipeline stage before the last, it
 * hands x to the next stage instead. */
void loom_rt_logits(loom_runner *r, const loom_batch *b, const loom_tensor *x,
                    const loom_tensor *norm, const loom_tensor *norm_bias, float eps,
                    const loom_tensor *output);

/* The layers this runner holds, [*first, *end): every layer, or a pipeline stage's. */
void loom_rt_layers(const loom_runner *r, int *first, int *end);
/* The residual stream's input x [n_embd, n_tokens]: the embedding rows of the step's ids, or on
 * a pipeline stage after the first, the previous stage's output. */
void loom_rt_embed(loom_runner *r, const loom_tensor *tok_embd, const loom_tensor *x);

/* The verbs; each records the first failure. */
void loom_rt_get_rows(loom_runner *r, const loom_tensor *w, const loom_tensor *ids,
                      const loom_tensor *dst);
void loom_rt_matmul(loom_runner *r, const loom_tensor *x, const loom_tensor *w,
                    const loom_tensor *bias, const loom_tensor *y);
void loom_rt_rms_norm(loom_runner *r, const loom_tensor *x, const loom_tensor *w, float eps,
                      const loom_tensor *dst);
void loom_rt_layer_norm(loom_runner *r, const loom_tensor *x, const loom_tensor *w,
                        const loom_tensor *b, float eps, const loom_tensor *dst);
/* RoPE at the step's positions; freq_factors: [n_rot / 2] divisors of the pairs' frequencies
 * (Llama 3.1's rope_freqs.weight), or NULL. */
void loom_rt_rope(loom_runner *r, const loom_tensor *x, const loom_hparams *hp,
                  const loom_tensor *freq_factors);
/* RoPE at explicit positions (pos2: LOOM_ROPE_GLM_2D's block positions, else NULL). */
void loom_rt_rope_at(loom_runner *r, const loom_tensor *x, const loom_hparams *hp,
                     const loom_tensor *pos, const loom_tensor *pos2);
void loom_rt_kv_store(loom_runner *r, const loom_tensor *src, const loom_tensor *cache);
void loom_rt_attention(loom_runner *r, const loom_tensor *q, int layer, float scale,
                       const loom_tensor *dst);
void loom_rt_add(loom_runner *r, const loom_tensor *a, const loom_tensor *b,
                 const loom_tensor *dst);
void loom_rt_silu_mul(loom_runner *r, const loom_tensor *a, const loom_tensor *b,
                      const loom_tensor *dst);
void loom_rt_gelu(loom_runner *r, const loom_tensor *a, const loom_tensor *dst);
/* Mixture of experts (backend.h's ops of those names): hp's gating, normalisation and scale;
 * bias, the choice bias, may be NULL. */
void loom_rt_moe_route(loom_runner *r, const loom_hparams *hp, const loom_tensor *logits,
                       const loom_tensor *bias, const loom_tensor *ids, const loom_tensor *weights);
/* one sigmoid-gated "expert": weights[t] = sigmoid(logits[t]) (a shared expert's gate) */
void loom_rt_sigmoid_gate(loom_runner *r, const loom_tensor *logits, const loom_tensor *ids,
                          const loom_tensor *weights);
void loom_rt_matmul_id(loom_runner *r, const loom_tensor *x, const loom_tensor *w,
                       const loom_tensor *ids, const loom_tensor *y);
void loom_rt_moe_combine(loom_runner *r, const loom_tensor *src, const loom_tensor *weights,
                         int accumulate, const loom_tensor *dst);
void loom_rt_scale(loom_runner *r, const loom_tensor *a, float s, const loom_tensor *dst);
/* dst = sigmoid(a) * b: an output gate */
void loom_rt_sigmoid_mul(loom_runner *r, const loom_tensor *a, const loom_tensor *b,
                         const loom_tensor *dst);
/* Recurrent layer `layer`'s ops over its state (backend.h's ssm_conv and gated_delta): the
 * conv1d + SiLU of x [tokens, ssm_conv_channels] with weight [channels, kernel]; the gated delta
 * rule of q, k [tokens, k_heads, d_k], v [tokens, ssm_v_heads, d_v], alpha and beta
 * [tokens, v_heads], a and dt_bias [v_heads] into dst [tokens, v_heads, d_v], the value heads
 * tiled (v_heads_tiled: llama.cpp's qwen35 order) or grouped by key head. */
void loom_rt_ssm_conv(loom_runner *r, int layer, const loom_tensor *x, const loom_tensor *weight,
                      const loom_tensor *dst);
void loom_rt_gated_delta(loom_runner *r, int layer, const loom_tensor *q, const loom_tensor *k,
                         const loom_tensor *v, const loom_tensor *alpha, const loom_tensor *beta,
                         const loom_tensor *a, const loom_tensor *dt_bias, int v_heads_tiled,
                         const loom_tensor *dst);
int loom_rt_status(const loom_runner *r);

#endif
