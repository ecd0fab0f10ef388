/*
 * engine/engine_internal.h - what the engine's rooms share: a request as the engine holds it
 * (ereq), the engine itself, a step's plan, and the functions one room calls in another.
 * engine.c: admission, planning, the step and the thread; state.c: a hybrid model's state
 * slots, snapshots and rollback; draft.c: the drafter model and proposals; sample.c: choosing
 * the next token and pooling embeddings. Only the engine thread calls these.
 */
#ifndef LOOM_ENGINE_INTERNAL_H
#define LOOM_ENGINE_INTERNAL_H

#include "api/internal.h"

#include "core/kvblocks.h"
#include "core/runner.h"
#include "core/sampler.h"
#include "core/tokenizer.h"
#include "chat/grammar.h"
#include "engine/sched.h"

#include <pthread.h>

typedef struct ereq {
    sched_req s;       /* what the policy knows: id, priority, times, tenant, state */
    struct ereq *next; /* in incoming / waiting */
    int32_t *toks;
    int32_t n_toks, cap;
    int32_t n_prompt, max_tokens, n_generated, n_cached;
    int32_t prefix_len; /* bidirectional prefix (ChatGLM-6B), 0: causal */
    int admitted;       /* has been admitted once (n_cached is known) */
    int invalid;        /* ended by its own grammar's limits (loom_event.invalid) */
    /* s.cancelled, s.displaced and s.started are set under the lock */
    int abandoned; /* answered by abandon(): no more events (under deliver_lock) */
    loom_sampler_params sp;
    uint64_t rng;
    int ignore_eos;
    int control_text; /* control tokens shown as text (loom_request's) */
    int logprobs;     /* loom_request's */
    int32_t top_logprobs;
    loom_grammar *grammar; /* what the answer must match (a reference), and where it stands */
    grammar_matcher *gm;
    char **stops;
    int n_stops;
    loom_text_stream ts;
    loom_kvseq kv;
    loom_event_fn fn;
    void *user;
    double ttft_ms, queue_ms; /* queue_ms: submitted to first admitted */
    /* an embedding request: the hidden states pooled so far (the sum of n_pooled rows) */
    loom_pooling pooling;
    int embed_unnormalized;
    int32_t n_pooled;
    double *pooled;
    int embedded; /* e->embedding holds its answer: its DONE carries it */
    /* speculative decoding by prompt lookup: n-gram size, most proposals a step, this step's
     * proposals (checked after the pending token), and decayed counts of kept and rejected
     * ones */
    int32_t lookup, draft_max, n_draft;
    int32_t state_slot; /* its recurrent state's slot while running (hybrid models), else -1;
                         * its checkpoint's is state_slot + the engine's n_state_slots */
    int32_t spec_from;  /* the position the checkpoint is at (a step that checks proposals) */
    int32_t snapshot;   /* the snapshot its matched prefix resumes from, once running; -1 */
    int32_t *draft;
    double spec_ok, spec_miss;
    int32_t spec_idle; /* steps without proposals while they did not pay */
    /* or proposals from the engine's drafter model: how many it is asked for this step, and
     * its sequence in the drafter's cache (private blocks: rejected proposals are forgotten) */
    int use_draft;
    int32_t want;
    loom_kvseq dkv;
    /* with the model's MTP block as the drafter (the engine's mtp): the model's states it has
     * yet to take, its own state after its last proposal, and the position its sequence's 0
     * stands for (the first it had a state for: a prefix from the cache it never saw) */
    loom_mtp_states mtp;
    float *mtp_own;
    int32_t mtp_base;
    /* the answer's thought (loom_request.reasoning): its text while the thought may still be
     * open, its tokens, and with a budget the closing tokens being forced (forcing: the next
     * one's index in the engine's think_close, -1 none; forced: they have been) */
    int32_t n_cached_restored; /* of n_cached, in blocks restored from the saved cache */
    int reasoning, thought_closed, forced;
    int32_t reasoning_budget, thought_tokens, forcing;
    char *answer;
    size_t answer_len, answer_cap;
} ereq;

struct loom_engine {
    loom_model *model;
    loom_runner *runner;
    loom_tokenizer *tok;
    int32_t *think_close; /* "\n</think>\n\n" as this vocabulary writes it (the first budget
                             tokenizes it) */
    /* the prefix cache kept across restarts (prefixes.c): its file, what became of it, and per
     * block the generation it was restored at (~0: not restored), so that a hit on it counts as
     * restored until the block is handed out anew */
    char *prefix_file;
    char prefix_status[600];
    uint32_t *restored_gen;
    int32_t n_blocks, prefix_blocks_restored;
    uint64_t restored_hit_tokens;
    int32_t n_think_close;
    loom_kvblocks *kv;
    grammar_vocab *gvocab[2]; /* the vocabulary as bytes (with control tokens' text), made for
                                 the first grammar */
    float *logits_copy;       /* a constrained step's unmasked logits */
    float *raw_logits;        /* a step's logits before sampling changes them (logprobs) */
    float *embedding;         /* an embedding request's answer, as its DONE event carries it */
    int32_t n_embd;
    int32_t n_ctx, n_vocab, bs, max_batch, max_step, max_queue, spec_rows;
    double batch_wait_ms;
    /* a model with recurrent layers: which of the runner's state slots a running request holds
     * (a slot per running request; max_batch is at most their count) */
    int32_t n_state_slots;
    unsigned char *slot_taken;
    /* snapshots of states at block boundaries of prompts (prefix sharing): snapshot i in the
     * runner's slot 2 n_state_slots + i, valid while the block that ends its prefix still holds
     * that content (its generation); 0 of them: hybrid requests share no prefix */
    struct state_snapshot {
        int32_t block, pos; /* -1: empty */
        uint32_t gen;
        uint64_t used; /* e->n_steps when last taken or used: the least recent goes first */
    } * snapshots;
    int32_t n_snapshots;

    pthread_t thread;
    pthread_mutex_t lock;
    /* held around every event, so that abandon() can answer requests that the engine thread
     * still holds; taken before lock, never while holding it */
    pthread_mutex_t deliver_lock;
    char stop_reason[192]; /* why submit refuses, once abandoned (under lock) */
    pthread_cond_t wake;   /* work arrived / stop */
    pthread_cond_t idle;   /* nothing left (for the drain) */
    ereq *incoming, *incoming_tail;
    ereq **live; /* every unretired request, for cancel by id (under the lock) */
    int n_live, cap_live;
    int n_running_now; /* of them running (under the lock): the rest are queued */
    /* per tenant (loom_request.tenant): live requests (under the lock) and running ones
     * (under the lock, written where n_running_now is) */
    int32_t tenant_live[LOOM_MAX_TENANTS + 1], tenant_running[LOOM_MAX_TENANTS + 1];
    int64_t next_id;
    int stopping; /* no new requests */
    int joined;   /* the thread has been joined */
    int cancel_all;
    int has_cancels;
    int n_displaced; /* displaced requests not yet retired: no longer queued (under the lock) */

    /* engine thread only */
    ereq *waiting;
    ereq **running;
    int n_running;
    float *logits;        /* one row, for the sampler to modify */
    ereq **replay;        /* a step's requests whose recurrent state goes back (replay_kept) */
    struct planned *plan; /* a step's work: allocated at start, so that a failure there is
                           * the caller's error, not a thread that quits quietly */
    loom_kvcopy *copies;
    int32_t *step_buf;
    uint64_t n_prompt, n_hit, n_generated, n_preempted, n_steps;
    uint64_t n_deadline_waiting, n_deadline_running;
    uint64_t n_drafted, n_accepted;
    sched_policy policy; /* its tenant_running points at tenant_running above */
    double rate_t0;
    uint64_t rate_n0;

    loom_engine_stats stats; /* under the lock: published after each step */

    /* the drafter model (loom_engine_options.draft), its runner and block manager, a step's
     * buffer for it, one row of its logits, and who drafts in a step */
    loom_model *draft;
    loom_runner *drunner;
    loom_kvblocks *dkv;
    float draft_p_min;
    int32_t *dstep_buf, dmax_blocks;
    float *dlogits;
    ereq **dwho;
    /* the drafter is the model's multi-token-prediction block (loom_model_options.mtp): a
     * drafter step's hidden-state inputs, [max_step][n_embd] */
    int mtp;
    float *dstates;
};

typedef struct planned {
    ereq *q;
    int32_t k; /* tokens computed this step */
} planned;

/* engine.c */
double engine_now_ms(void);
void engine_deliver(loom_engine *e, ereq *q, const loom_event *ev);
void engine_retire(loom_engine *e, ereq *q, const char *finish, const char *error);
void engine_remove_running(loom_engine *e, ereq *q);

/* state.c: a hybrid model's recurrent state. A running request's slot (resuming from the
 * snapshot its prefix matched); of the hit tokens of a prefix match, those a valid snapshot
 * covers; a snapshot at q's prompt's block boundary after a step; a prefill's tokens cut at
 * that boundary; the states of `who` put back to their checkpoints and their kept tokens run
 * again (buf: a step's token buffer). */
void engine_take_state_slot(loom_engine *e, ereq *q);
int32_t engine_snapshot_hit(loom_engine *e, ereq *q, int32_t hit);
void engine_take_snapshot(loom_engine *e, ereq *q);
int32_t engine_to_boundary(const loom_engine *e, const ereq *q, int32_t k);
void engine_replay_kept(loom_engine *e, ereq **who, int n, int32_t *buf);

/* draft.c: proposals. How many q may propose in room rows; the drafter model's proposals for
 * a step's plan; the drafter's start (loom_engine_options.draft). */
int32_t engine_proposals_wanted(loom_engine *e, ereq *q, int32_t room);
void engine_run_drafter(loom_engine *e, planned *plan, int n_plan);
int engine_start_drafter(loom_engine *e, const loom_engine_options *o, char *err, size_t err_size);

/* sample.c: q's next token from its logits row (0, or -1 when q ended); an embedding request's
 * n hidden-state rows added to its pool; its answer. */
int engine_sample_next(loom_engine *e, ereq *q, float *logits);
/* prefixes.c: restoring the saved prefix cache at start (0, or -1 out of memory), and of a
 * request's hit, the tokens in restored blocks */
int engine_restore_prefixes(loom_engine *e, const char *path);
int32_t engine_restored_tokens(const loom_engine *e, const ereq *q, int32_t hit);
/* frees a request the engine holds (its copies, grammar reference, buffers) */
void engine_req_free(ereq *q);
/* the closing tokens a thought budget forces, tokenized once; -1 with err */
int engine_think_close(loom_engine *e, char *err, size_t err_size);
void engine_pool(loom_engine *e, ereq *q, const float *rows, int32_t n);
void engine_finish_embedding(loom_engine *e, ereq *q);

#endif
