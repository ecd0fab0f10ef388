/*
 * core/runner_internal.h - what core/runner.c (the executor), core/verbs.c and
 * core/recurrent.c (the verbs models call) and core/stage.c (a runner as one stage of a
 * pipeline) share: the runner's state. Nothing outside core/ includes it.
 */
#ifndef LOOM_CORE_RUNNER_INTERNAL_H
#define LOOM_CORE_RUNNER_INTERNAL_H

#include "fallback.h"
#include "runner.h"

#define MAX_SCRATCH 64
#define MAX_CONSTANTS 8

typedef struct scratch_slot {
    loom_buffer *buf;
    uint64_t size;
} scratch_slot;

/* a weight's matmul layout: not offered to prepare_weight yet, prepared, or kept as stored */
enum { PREP_UNTRIED, PREP_DONE, PREP_NONE };

/* A dense tensor [n0, n1, n2, n3] of dt at offset in b. */
static inline loom_tensor loom_runner_dense(loom_buffer *b, uint64_t offset, loom_dtype dt,
                                            int64_t n0, int64_t n1, int64_t n2, int64_t n3)
{
    loom_tensor t = {.buf = b, .offset = offset, .dtype = dt, .n_dims = 4};
    t.ne[0] = n0, t.ne[1] = n1, t.ne[2] = n2, t.ne[3] = n3;
    t.nb[0] = (uint64_t)loom_dtype_block_bytes(dt);
    t.nb[1] = (uint64_t)loom_row_bytes(dt, n0);
    t.nb[2] = t.nb[1] * (uint64_t)n1;
    t.nb[3] = t.nb[2] * (uint64_t)n2;
    return t;
}

struct loom_runner {
    loom_device *dev;
    const loom_gguf *gguf;
    const loom_arch *arch;
    void *state;
    loom_hparams hp;
    loom_runner_options opt;
    int32_t n_blocks;

    loom_buffer *weights_map;  /* the whole file, wrapped (zero copy), or NULL */
    loom_buffer *experts_map;  /* the same on opt.experts, for the expert stacks placed there */
    loom_buffer **weight_bufs; /* per GGUF tensor, when uploaded */
    loom_tensor *weights;      /* per GGUF tensor, once looked up */
    unsigned char *weight_ready;
    loom_tensor *prepared; /* per GGUF tensor: its matmul layout, when prep is PREP_DONE */
    unsigned char *prep;
    int repack; /* offer weights to prepare_weight (LOOM_REPACK != 0) */

    loom_buffer *kv;
    loom_tensor *kc, *vc; /* per layer; only the stage's attention layers have a buffer */
    int32_t n_kv_layers;  /* layers with a KV cache */
    uint64_t kv_block;    /* bytes of one block of one layer's K (or V) */

    /* recurrent layers (core/recurrent.c) */
    loom_buffer *states;
    loom_tensor *conv_state, *delta_state; /* per layer; the held recurrent layers' only */
    int32_t n_state_slots;
    uint64_t state_bytes;      /* of one slot, over the held layers */
    int32_t *state_next;       /* per slot: the position its state has reached; -1: none */
    int32_t *token_slots;      /* the step's tokens' slots */
    int32_t layer0, layer_end; /* the layers this runner holds (a pipeline stage's, or all) */
    float *handoff;            /* host copy of the hidden states a stage receives or sends */
    uint64_t handoff_cap;      /* its size in floats */

    /* ids | pos | slots | seq | block table | logit rows | prefix lengths | hidden rows | state
     * slots, I32; then an MTP runner's hidden_in, F32 */
    loom_buffer *in_buf;
    uint64_t in_cap; /* its size in int32s */
    int32_t *in_host;
    loom_rt_inputs in;
    int has_prefix;         /* this step has in.prefix_len */
    int32_t seq_prefix_len; /* loom_runner_eval's one sequence */
    int32_t *eval_host;     /* loom_runner_eval's positions, slots and block table */

    scratch_slot scratch[MAX_SCRATCH];
    int n_scratch_used;

    loom_tensor logits_src;
    int has_logits;
    float *logits;          /* [n_logits][n_vocab] */
    int32_t logits_cap;     /* rows */
    loom_tensor hidden_src; /* the step's wanted final hidden states, on the device */
    int has_hidden;
    float *hidden;          /* [n_hidden][n_embd] */
    int32_t hidden_cap;     /* rows */
    loom_rows_at_fn follow; /* loom_runner_follow's: every eval's hidden states go to it */
    void *follow_user;

    loom_fallback *fallback;    /* for ops the device lacks; opened on first need */
    loom_fallback *experts_run; /* matmul_id on opt.experts, when the experts are placed there */

    loom_tensor constants[MAX_CONSTANTS]; /* what the family computed at load (loom_rt_constant) */
    int n_constants;

    int status;
    char err[512];

    /* LOOM_STRICT=1's check at load: one token through the graph, noting (not running) every
     * op x dtype the device lacks */
    int census;
    unsigned char lacking[LOOM_OP_COUNT][32];
};

/* Runs op on the model's device; one the device lacks (for dtype dt) runs on the CPU through
 * core/fallback, unless in strict mode. A failure is in r->status. */
void loom_runner_exec_op(loom_runner *r, loom_op op, loom_dtype dt, const char *what, void *params);
/* Whether weight w is held here (a weight of another pipeline stage is not: a failure). */
int loom_runner_held(loom_runner *r, const loom_tensor *w, const char *what);

/* Records the step's first failure (later ones are its consequences); returns -1. */
int loom_runner_fail(loom_runner *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* core/recurrent.c: the recurrent layers' state. alloc after the KV cache (0, or -1 with err);
 * begin before a step's inputs are uploaded: each sequence's slot checked against its first
 * position (zeroed at 0) and r->token_slots filled (0, or -1 with r->status set); end after it,
 * recording where each slot's state now is, or (failed) that it is unusable. */
int loom_recurrent_alloc(loom_runner *r, char *err, size_t err_size);
void loom_recurrent_free(loom_runner *r);
int loom_recurrent_begin(loom_runner *r, const loom_step *s);
void loom_recurrent_end(loom_runner *r, const loom_step *s, int ok);

/* Runs a checked step's tokens through this runner's layers: its inputs uploaded, the model
 * run, and where this runner has the head, the logits read back and checked. A failure is in
 * r->status. */
void loom_runner_execute(loom_runner *r, const loom_step *s);

/* core/stage.c: the step on a pipeline stage (r->opt.link set), announced to the other stages
 * and its logits passed along; the hidden states a stage receives instead of embedding ids, and
 * those it hands on instead of computing logits. */
void loom_stage_step(loom_runner *r, const loom_step *s);
void loom_stage_receive(loom_runner *r, const loom_tensor *x);
void loom_stage_hand_on(loom_runner *r, const loom_tensor *x);

/* core/weights.c: whether GGUF tensor gt lives on opt.experts rather than the model's device,
 * and the device weight i lives on */
int loom_runner_on_experts(const loom_runner *r, const loom_gguf_tensor *gt);
loom_device *loom_runner_weight_device(const loom_runner *r, uint64_t i);

/* The tensor to pass as matmul's W for weight w: its prepared copy (made on first use) when
 * the backend has a layout of its own for it; else w (views and non-weights too). */
const loom_tensor *loom_runner_matmul_weight(loom_runner *r, const loom_tensor *w);

#endif
