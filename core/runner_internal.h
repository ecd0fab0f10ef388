/*
 * core/runner_internal.h - what core/runner.c (the executor) and core/stage.c (a runner as one
 * stage of a pipeline) share: the runner's state. Nothing outside core/ includes it.
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
    loom_tensor *kc, *vc;      /* per layer; only the stage's layers have a buffer */
    int32_t layer0, layer_end; /* the layers this runner holds (a pipeline stage's, or all) */
    float *handoff;            /* host copy of the hidden states a stage receives or sends */
    uint64_t handoff_cap;      /* its size in floats */

    loom_buffer *in_buf; /* ids | pos | slots | seq | block table | logit rows, I32 */
    uint64_t in_cap;     /* its size in int32s */
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
    float *hidden;      /* [n_hidden][n_embd] */
    int32_t hidden_cap; /* rows */

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

/* Records the step's first failure (later ones are its consequences); returns -1. */
int loom_runner_fail(loom_runner *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

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

#endif
