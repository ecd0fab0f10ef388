/*
 * engine/engine.c - continuous batching: one thread owns the model and, every step, runs the
 * tokens of all running requests in one forward (see loom.h for the policy).
 *
 * Requests move incoming (submitted, under the lock) -> waiting (admitted by effective
 * priority: the request's, improved by one per aging_ms waited, then by id) -> running
 * (ordered by admission; preemption takes the worst effective priority, newest first) ->
 * retired. A request past its deadline is retired where it is at the start of each step.
 * Prefills of a worse priority yield to better arrivals (plan_step: yield_to, and the
 * policy's worse prefill share). The rules themselves are engine/sched.c's; this file applies
 * them to the requests, the KV pool and the model.
 * A request's tokens are its prompt followed by what it generated; each step computes the
 * next chunk of the ones whose K/V are not yet stored, so a prefill, a decode and a
 * recomputation after preemption are the same thing. Only the engine thread touches
 * waiting/running and the model; HTTP threads and the like only submit and cancel.
 */
#define _GNU_SOURCE
#include "api/internal.h"

#include "core/kvblocks.h"
#include "core/runner.h"
#include "core/sampler.h"
#include "core/tokenizer.h"
#include "chat/grammar.h"
#include "engine/sched.h"

#include <assert.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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
} ereq;

struct loom_engine {
    loom_model *model;
    loom_runner *runner;
    loom_tokenizer *tok;
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
};

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static void req_free(ereq *q)
{
    for (int i = 0; i < q->n_stops; i++)
        free(q->stops[i]);
    free(q->stops);
    free(q->toks);
    loom_text_stream_free(&q->ts);
    grammar_matcher_free(q->gm);
    loom_grammar_free(q->grammar);
    free(q->pooled);
    free(q->draft);
    free(q);
}

/* ---- retiring ----------------------------------------------------------------------------- */

static void forget_live(loom_engine *e, ereq *q)
{
    pthread_mutex_lock(&e->lock);
    for (int i = 0; i < e->n_live; i++)
        if (e->live[i] == q) {
            e->live[i] = e->live[--e->n_live];
            e->tenant_live[q->s.tenant]--;
            e->n_displaced -= q->s.displaced;
            /* a tenant's live requests, and the displaced ones, are among the live */
            assert(e->tenant_live[q->s.tenant] >= 0 && e->n_displaced >= 0);
            assert(e->n_displaced <= e->n_live);
            break;
        }
    e->stats.requests_done++;
    pthread_mutex_unlock(&e->lock);
}

/* e->n_running, as submit sees it (the queue's length is what is live and not running) */
static void count_running(loom_engine *e)
{
    pthread_mutex_lock(&e->lock);
    e->n_running_now = e->n_running;
    memset(e->tenant_running, 0, sizeof e->tenant_running);
    for (int i = 0; i < e->n_running; i++) {
        e->tenant_running[e->running[i]->s.tenant]++;
        e->running[i]->s.started = 1;
    }
    pthread_mutex_unlock(&e->lock);
}

/* A free state slot for q as it starts running (there is one: max_batch <= the slots), with
 * the snapshot its matched prefix resumes from copied in. A copy that fails leaves the slot
 * empty, which the runner refuses to continue from: the request then fails with that. */
static void take_state_slot(loom_engine *e, ereq *q)
{
    q->state_slot = -1;
    for (int32_t i = 0; i < e->n_state_slots && q->state_slot < 0; i++)
        if (!e->slot_taken[i])
            e->slot_taken[i] = 1, q->state_slot = i;
    assert(!e->n_state_slots || q->state_slot >= 0);
    char err[512]; /* a failed copy leaves the slot empty: the runner's refusal says so */
    if (q->snapshot >= 0)
        loom_runner_state_copy(e->runner, 2 * e->n_state_slots + q->snapshot, q->state_slot, err,
                               sizeof err);
    q->snapshot = -1;
}

/* Hybrid models: of the hit tokens a prefix match gave q, the most for which a snapshot of
 * the state at their end is still valid; q keeps those blocks and gives the rest back. */
static int32_t snapshot_hit(loom_engine *e, ereq *q, int32_t hit)
{
    q->snapshot = -1;
    for (int32_t pos = hit; pos > 0 && q->snapshot < 0; pos -= e->bs) {
        int32_t block = q->kv.blocks[pos / e->bs - 1];
        for (int32_t i = 0; i < e->n_snapshots && q->snapshot < 0; i++) {
            struct state_snapshot *sn = &e->snapshots[i];
            if (sn->block == block && sn->pos == pos &&
                sn->gen == loom_kvblocks_generation(e->kv, block))
                q->snapshot = i, sn->used = e->n_steps, hit = pos;
        }
    }
    if (q->snapshot < 0)
        hit = 0;
    loom_kvblocks_unmatch(e->kv, &q->kv, hit);
    return hit;
}

/* After a step: q's state is at its KV's end; when that is a block boundary of its prompt,
 * keep a snapshot there (replacing the least recently used) for later prompts to resume
 * from. */
static void take_snapshot(loom_engine *e, ereq *q)
{
    int32_t pos = q->kv.n_tokens;
    if (!e->n_snapshots || pos == 0 || pos % e->bs || pos > q->n_prompt ||
        q->kv.n_hashed * e->bs < pos)
        return;
    int32_t block = q->kv.blocks[pos / e->bs - 1];
    uint32_t gen = loom_kvblocks_generation(e->kv, block);
    int32_t victim = 0;
    for (int32_t i = 0; i < e->n_snapshots; i++) {
        struct state_snapshot *sn = &e->snapshots[i];
        if (sn->block == block && sn->pos == pos && sn->gen == gen) {
            sn->used = e->n_steps;
            return;
        }
        /* the slot to fill: an empty one, else the least recently used */
        if (sn->block < 0 ||
            (e->snapshots[victim].block >= 0 && sn->used < e->snapshots[victim].used))
            victim = i;
    }
    char err[512];
    struct state_snapshot *sn = &e->snapshots[victim];
    sn->block = -1;
    if (loom_runner_state_copy(e->runner, q->state_slot, 2 * e->n_state_slots + victim, err,
                               sizeof err) != 0)
        return; /* no snapshot: only a later prompt's reuse is lost */
    *sn = (struct state_snapshot){block, pos, gen, e->n_steps};
}

/* A hybrid request's prefill steps end at its prompt's last block boundary first, so that a
 * snapshot is taken there: k of its tokens at most. */
static int32_t to_boundary(const loom_engine *e, const ereq *q, int32_t k)
{
    int32_t boundary = q->n_prompt / e->bs * e->bs, at = q->kv.n_tokens;
    return e->n_snapshots && at < boundary && at + k > boundary ? boundary - at : k;
}

static void remove_running(loom_engine *e, ereq *q)
{
    assert(e->n_running <= e->max_batch);
    if (e->n_state_slots && q->state_slot >= 0) {
        assert(e->slot_taken[q->state_slot]);
        e->slot_taken[q->state_slot] = 0, q->state_slot = -1;
    }
    for (int i = 0; i < e->n_running; i++)
        if (e->running[i] == q) {
            memmove(e->running + i, e->running + i + 1,
                    (size_t)(e->n_running - i - 1) * sizeof *e->running);
            e->n_running--;
            count_running(e);
            return;
        }
}

static void remove_waiting(loom_engine *e, ereq *q)
{
    for (ereq **p = &e->waiting; *p; p = &(*p)->next)
        if (*p == q) {
            *p = q->next;
            return;
        }
}

static void deliver(loom_engine *e, ereq *q, const loom_event *ev)
{
    pthread_mutex_lock(&e->deliver_lock);
    if (!q->abandoned)
        q->fn(q->user, ev);
    pthread_mutex_unlock(&e->deliver_lock);
}

/* Ends a request (already out of waiting and running): the last text, then DONE or ERROR;
 * an embedding request's DONE carries e->embedding. */
static void retire_as(loom_engine *e, ereq *q, const char *finish, const char *error, int deadline)
{
    loom_kvblocks_release(e->kv, &q->kv);
    if (e->dkv)
        loom_kvblocks_release(e->dkv, &q->dkv);
    loom_text_stream_flush(&q->ts);
    loom_event ev = {.kind = LOOM_EVENT_TEXT,
                     .token = -1,
                     .n_prompt = q->n_prompt,
                     .n_generated = q->n_generated,
                     .n_cached = q->n_cached,
                     .ttft_ms = q->ttft_ms,
                     .queue_ms = q->queue_ms};
    if (q->ts.n_out && !error) {
        ev.text = q->ts.out, ev.len = q->ts.n_out;
        deliver(e, q, &ev);
    }
    ev.text = NULL, ev.len = 0;
    ev.kind = error ? LOOM_EVENT_ERROR : LOOM_EVENT_DONE;
    ev.finish_reason = finish;
    ev.error = error;
    ev.deadline = deadline;
    ev.busy = q->s.displaced;
    ev.invalid = q->invalid;
    if (q->embedded) /* (not when cancelled: e->embedding is another request's then) */
        ev.embedding = e->embedding, ev.n_embd = e->n_embd;
    forget_live(e, q);
    deliver(e, q, &ev);
    req_free(q);
}

static void retire(loom_engine *e, ereq *q, const char *finish, const char *error)
{
    retire_as(e, q, finish, error, 0);
}

/* Ends every request whose deadline has come: one still waiting with an error (it never ran),
 * one generating with what it has ("length"). */
static void expire(loom_engine *e)
{
    double now = now_ms();
    char why[160];
    for (int i = 0; i < e->n_running; i++) {
        ereq *q = e->running[i];
        if (sched_expired(&q->s, now)) {
            remove_running(e, q);
            e->n_deadline_running++;
            if (q->pooling) /* half an embedding is none */
                retire_as(e, q, NULL,
                          "the request reached its deadline before its prompt was computed", 1);
            else
                retire_as(e, q, "length", NULL, 1);
            i--;
        }
    }
    for (ereq *q = e->waiting, *next; q; q = next) {
        next = q->next;
        if (sched_expired(&q->s, now)) {
            remove_waiting(e, q);
            e->n_deadline_waiting++;
            snprintf(why, sizeof why,
                     "the request waited %.0f ms for its turn and reached its deadline before it "
                     "could start",
                     now - q->s.t_submit);
            retire_as(e, q, NULL, why, 1);
        }
    }
}

/* ---- submitting --------------------------------------------------------------------------- */

int64_t loom_engine_submit(loom_engine *e, const loom_request *r, loom_event_fn fn, void *user,
                           char *err, size_t err_size)
{
    if (!r || !fn || !r->prompt || r->n_prompt <= 0) {
        snprintf(err, err_size, "the prompt is empty");
        return -1;
    }
    if (r->pooling != LOOM_POOL_NONE && r->pooling != LOOM_POOL_LAST &&
        r->pooling != LOOM_POOL_MEAN) {
        snprintf(err, err_size, "pooling %d is not one of loom_pooling's", (int)r->pooling);
        return -1;
    }
    if (r->pooling && r->n_prompt > e->n_ctx) {
        snprintf(err, err_size, "the input has %d tokens but the context holds %d", r->n_prompt,
                 e->n_ctx);
        return -1;
    }
    if (!r->pooling && r->n_prompt >= e->n_ctx) {
        snprintf(err, err_size,
                 "the prompt has %d tokens but the context holds %d (including at "
                 "least one generated token)",
                 r->n_prompt, e->n_ctx);
        return -1;
    }
    for (int32_t i = 0; i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || r->prompt[i] >= e->n_vocab) {
            snprintf(err, err_size, "prompt token %d is %d, outside the vocabulary (0..%d)", i,
                     r->prompt[i], e->n_vocab - 1);
            return -1;
        }
    int32_t max_tokens = r->pooling                                   ? 0
        : r->max_tokens < 0 || r->max_tokens > e->n_ctx - r->n_prompt ? e->n_ctx - r->n_prompt
                                                                      : r->max_tokens;
    if (r->lookup < 0 || r->lookup > 64 || r->draft_max < 0 || r->draft_max > 64) {
        snprintf(err, err_size, "lookup %d and draft_max %d must be 0 to 64", r->lookup,
                 r->draft_max);
        return -1;
    }
    if (r->draft && (!e->draft || r->lookup > 0)) {
        snprintf(err, err_size, "%s",
                 r->lookup > 0 ? "one drafter a request: its draft model or prompt lookup"
                               : "this engine has no draft model (loom serve --draft)");
        return -1;
    }
    ereq *q = calloc(1, sizeof *q);
    if (!q)
        goto oom;
    q->pooling = r->pooling;
    q->embed_unnormalized = r->embed_unnormalized;
    if (q->pooling && !(q->pooled = malloc((size_t)e->n_embd * sizeof *q->pooled)))
        goto oom;
    q->cap = r->n_prompt + max_tokens + 1;
    q->toks = malloc((size_t)q->cap * sizeof *q->toks);
    q->stops = r->n_stop > 0 ? calloc((size_t)r->n_stop, sizeof *q->stops) : NULL;
    if (!q->toks || (r->n_stop > 0 && !q->stops))
        goto oom;
    for (int i = 0; i < r->n_stop; i++)
        if (!(q->stops[q->n_stops++] = strdup(r->stop[i])))
            goto oom;
    memcpy(q->toks, r->prompt, (size_t)r->n_prompt * sizeof *q->toks);
    q->n_toks = q->n_prompt = r->n_prompt;
    q->prefix_len = loom_runner_prefix_len(e->runner, r->prompt, r->n_prompt);
    /* a hybrid model's prefix is of use only where a snapshot of its state is (snapshot_hit);
     * without snapshot slots its requests share no blocks */
    q->kv.private_blocks = q->prefix_len > 0 || (e->n_state_slots > 0 && !e->n_snapshots);
    q->state_slot = q->snapshot = -1;
    q->kv.partition = r->cache_partition;
    q->max_tokens = max_tokens;
    q->dkv.private_blocks = 1;
    if ((r->lookup > 0 || r->draft) && !q->pooling) {
        q->lookup = r->lookup, q->use_draft = r->draft;
        q->draft_max = r->draft_max ? r->draft_max : 8;
        if (!(q->draft = malloc((size_t)q->draft_max * sizeof *q->draft)))
            goto oom;
    }
    const loom_sampling *s = &r->sampling;
    q->sp = loom_sampler_params_of(s);
    q->rng = s->seed;
    q->ignore_eos = s->ignore_eos;
    q->control_text = r->control_text;
    q->grammar = loom_grammar_ref(r->grammar);
    q->logprobs = r->logprobs;
    q->top_logprobs = r->top_logprobs < 0         ? 0
        : r->top_logprobs > LOOM_MAX_TOP_LOGPROBS ? LOOM_MAX_TOP_LOGPROBS
                                                  : r->top_logprobs;
    loom_text_stream_init(&q->ts, (const char *const *)q->stops, q->n_stops);
    q->fn = fn, q->user = user;
    q->s.t_submit = now_ms();
    q->s.priority = r->priority;
    if (r->timeout_ms > 0)
        q->s.deadline = q->s.t_submit + r->timeout_ms;
    if (r->tenant < 0 || r->tenant > LOOM_MAX_TENANTS) {
        req_free(q);
        snprintf(err, err_size, "tenant %d is outside 0..%d", r->tenant, LOOM_MAX_TENANTS);
        return -1;
    }
    q->s.tenant = r->tenant;
    q->s.tenant_max_running = r->tenant_max_running > 0 ? r->tenant_max_running : 0;

    pthread_mutex_lock(&e->lock);
    if (e->stopping) {
        snprintf(err, err_size, "%s",
                 e->stop_reason[0] ? e->stop_reason : "the server is shutting down");
        pthread_mutex_unlock(&e->lock);
        req_free(q);
        return -1;
    }
    if (e->n_live == e->cap_live) {
        int cap = e->cap_live ? 2 * e->cap_live : 64;
        ereq **nl = realloc(e->live, (size_t)cap * sizeof *nl);
        if (!nl) {
            pthread_mutex_unlock(&e->lock);
            goto oom;
        }
        e->live = nl, e->cap_live = cap;
    }
    /* the tenant's own share first: a request its share refuses displaces nobody */
    int32_t tenant_waiting = e->tenant_live[q->s.tenant] - e->tenant_running[q->s.tenant];
    if (q->s.tenant && r->tenant_max_queue > 0 && tenant_waiting >= r->tenant_max_queue) {
        e->stats.refused_busy++;
        snprintf(err, err_size,
                 "too many requests of yours are waiting (%d; your share of the queue is %d); "
                 "try again shortly",
                 tenant_waiting, r->tenant_max_queue);
        pthread_mutex_unlock(&e->lock);
        req_free(q);
        return LOOM_ENGINE_BUSY;
    }
    int queued = e->n_live - e->n_running_now - e->n_displaced;
    if (queued >= e->max_queue) {
        /* a full queue takes a request of better priority in place of its worst one that has
         * not started (the newest of those), which is refused now instead */
        ereq *worst = NULL;
        for (int i = 0; i < e->n_live; i++) {
            ereq *w = e->live[i];
            if (sched_displaceable(&w->s, q->s.priority) &&
                (!worst || sched_displace_before(&w->s, &worst->s)))
                worst = w;
        }
        e->stats.refused_busy++;
        if (!worst) {
            snprintf(err, err_size,
                     "the server is busy: %d requests are waiting already (its queue holds %d); "
                     "try again shortly",
                     queued, e->max_queue);
            pthread_mutex_unlock(&e->lock);
            req_free(q);
            return LOOM_ENGINE_BUSY;
        }
        worst->s.displaced = 1;
        e->n_displaced++;
        e->stats.displaced++;
        e->has_cancels = 1; /* the engine thread refuses it at its next step */
    }
    e->live[e->n_live++] = q;
    e->tenant_live[q->s.tenant]++;
    int64_t id = q->s.id = ++e->next_id; /* q is the engine's once the lock is released */
    if (e->incoming_tail)
        e->incoming_tail->next = q;
    else
        e->incoming = q;
    e->incoming_tail = q;
    pthread_cond_signal(&e->wake);
    pthread_mutex_unlock(&e->lock);
    return id;
oom:
    if (q)
        req_free(q);
    snprintf(err, err_size, "out of memory");
    return -1;
}

void loom_engine_cancel(loom_engine *e, int64_t id)
{
    pthread_mutex_lock(&e->lock);
    for (int i = 0; i < e->n_live; i++)
        if (e->live[i]->s.id == id) {
            e->live[i]->s.cancelled = 1;
            e->has_cancels = 1;
            pthread_cond_signal(&e->wake);
            break;
        }
    pthread_mutex_unlock(&e->lock);
}

loom_engine_stats loom_engine_get_stats(loom_engine *e)
{
    pthread_mutex_lock(&e->lock);
    loom_engine_stats s = e->stats;
    pthread_mutex_unlock(&e->lock);
    return s;
}

/* ---- scheduling --------------------------------------------------------------------------- */

/* Frees a running request's blocks and puts it back in the queue (where it keeps its priority
 * and its age); it will be recomputed from its tokens (prompt and what it generated so far). */
static void preempt(loom_engine *e, ereq *q)
{
    remove_running(e, q);
    loom_kvblocks_release(e->kv, &q->kv);
    if (e->dkv)
        loom_kvblocks_release(e->dkv, &q->dkv);
    q->next = e->waiting;
    e->waiting = q;
    e->n_preempted++;
}

typedef struct planned {
    ereq *q;
    int32_t k; /* tokens computed this step */
} planned;

/* Orders the running requests as they would run: the first plans first, the last is the one
 * to preempt. */
static void order_running(loom_engine *e, double now)
{
    for (int i = 1; i < e->n_running; i++)
        for (int j = i;
             j > 0 && sched_runs_before(&e->policy, &e->running[j]->s, &e->running[j - 1]->s, now);
             j--) {
            ereq *t = e->running[j];
            e->running[j] = e->running[j - 1];
            e->running[j - 1] = t;
        }
}

/* Makes room for k more tokens of q, preempting the running requests that would run last (or
 * q itself, when it is that one; the running are in order_running's order, and q is at or
 * before the end). Returns 0, or -1 when q was preempted. Copies on write go to copies. */
static int make_room(loom_engine *e, ereq *q, int32_t k, loom_kvcopy *copies, int *n_copies)
{
    for (;;) {
        int nc = loom_kvblocks_reserve(e->kv, &q->kv, k, copies + *n_copies);
        if (nc >= 0) {
            *n_copies += nc;
            return 0;
        }
        ereq *victim = e->running[e->n_running - 1];
        preempt(e, victim);
        if (victim == q)
            return -1;
    }
}

/* The waiting request to admit next, or NULL. */
static ereq *next_waiting(const loom_engine *e, double now)
{
    ereq *best = NULL;
    for (ereq *q = e->waiting; q; q = q->next)
        if (!sched_tenant_full(&e->policy, &q->s) &&
            (!best || sched_runs_before(&e->policy, &q->s, &best->s, now)))
            best = q;
    return best;
}

/* How many proposals q checks this step, at most room: the j-th is worth a token row when it
 * is kept with probability a^j >= tau, a from q's recent proposals; tau grows with the batch,
 * from 0.25 alone to 0.8 at 8 running and more, as extra rows stop being nearly free once a
 * step computes rather than streams weights. After 16 steps without proposals it tries one
 * again, so text that became predictable is noticed. */
static int32_t proposals_wanted(loom_engine *e, ereq *q, int32_t room)
{
    int32_t most = q->draft_max;
    most = most < room ? most : room;
    most = most < e->n_ctx - q->n_toks ? most : e->n_ctx - q->n_toks;
    most = most < q->max_tokens - q->n_generated - 1 ? most : q->max_tokens - q->n_generated - 1;
    if (most <= 0)
        return 0;
    double a = (q->spec_ok + 1) / (q->spec_ok + q->spec_miss + 2);
    double busy = (e->n_running - 1) / 7.0, tau = 0.25 + 0.55 * (busy < 1 ? busy : 1);
    int32_t k = 0;
    for (double keep = a; k < most && keep >= tau; keep *= a)
        k++;
    if (k == 0 && ++q->spec_idle >= 16)
        k = 1;
    if (k)
        q->spec_idle = 0;
    return k;
}

/* Remembers the requests from first on, which have just joined the queue, as arrivals. */
static void note_arrivals(loom_engine *e, const ereq *first)
{
    for (const ereq *q = first; q; q = q->next)
        sched_note_arrival(&e->policy, q->s.t_submit, q->s.priority, q->n_prompt);
}

/* Plans one step: running requests first (in the order they would run), then newly admitted
 * ones. */
static int plan_step(loom_engine *e, planned *plan, loom_kvcopy *copies, int *n_copies)
{
    int n = 0;
    int32_t budget = e->max_step, worse_used = 0;
    double now = now_ms();
    *n_copies = 0;
    order_running(e, now);
    /* a full batch makes room for a waiting request of a better priority (in whole steps)
     * than its worst: that one is preempted, to be recomputed when its turn comes again */
    while (e->n_running == e->max_batch) {
        ereq *best = next_waiting(e, now), *worst = e->running[e->n_running - 1];
        if (!best || !sched_preempts(&e->policy, &best->s, &worst->s, now))
            break;
        preempt(e, worst);
    }
    /* A prefill under way sits out the step that admits a request of a better priority, so
     * that the newcomer's first step holds its own prompt and the decodes only. Not when the
     * newcomer does not fit the free blocks: it would not be admitted, and what sat out might
     * be what it waits for. */
    int32_t yield_to = INT32_MAX;
    ereq *arrival = e->n_running < e->max_batch ? next_waiting(e, now) : NULL;
    if (arrival &&
        loom_kvblocks_needed(e->kv, &arrival->kv, arrival->n_toks) <=
            loom_kvblocks_available(e->kv))
        yield_to = arrival->s.priority;
    /* Proposals ride in rows a step would stream the weights for anyway: at most spec_rows
     * tokens of decode and proposals together. A batch already that wide computes rather than
     * streams, and each proposal then costs about what it saves. */
    int32_t spec_room = e->spec_rows - e->n_running;
    for (int i = 0; i < e->n_running && budget > 0; i++) {
        ereq *q = e->running[i];
        int32_t k = q->n_toks - q->kv.n_tokens;
        if (k > budget)
            k = budget;
        if (sched_sits_out(q->s.priority, k, yield_to))
            continue;
        k = to_boundary(e, q, sched_clip_prefill(&e->policy, q->s.priority, k, now, &worse_used));
        if (k == 0)
            continue;
        /* a decoding request may check proposals too, where the cache has room for them
         * without preempting anyone: prompt lookup's now, the drafter model's once it ran
         * (run_drafter: q->want of them at most) */
        int32_t room = budget - 1 < spec_room ? budget - 1 : spec_room;
        /* a drafter model's proposals only for a request running alone: its batched drafter
         * steps, one per proposal, cost more than they save beside others (measured: 1.8x at
         * one client, 0.9x at two, 0.7x at four; see docs/benchmarks.md) */
        if (q->use_draft && e->n_running > 1)
            room = 0;
        int32_t want = k == 1 && q->draft && room > 0 ? proposals_wanted(e, q, room) : 0;
        if (want && loom_kvblocks_needed(e->kv, &q->kv, k + want) > loom_kvblocks_available(e->kv))
            want = 0;
        q->n_draft = want && q->lookup
            ? loom_lookup_draft(q->toks, q->n_toks, q->lookup, want, q->draft)
            : 0;
        q->want = q->use_draft ? want : 0;
        int32_t extra = q->n_draft + q->want;
        spec_room -= extra;
        if (make_room(e, q, k + extra, copies, n_copies) != 0) {
            i--; /* q left running; the next one moved into slot i */
            continue;
        }
        plan[n++] = (planned){q, k + extra};
        budget -= k + extra;
    }
    ereq *q;
    /* A step that admits a request admits none of a worse priority beside it: their prefills
     * would lengthen the step that brings its first token (the worse wait a step). The
     * request's own priority, not the aged one: requests of one priority aged apart still
     * share a step. */
    int32_t admitted_priority = INT32_MAX;
    while (e->n_running < e->max_batch && budget > 0 && (q = next_waiting(e, now)) &&
           q->s.priority <= admitted_priority) {
        /* a mean needs every token's hidden state, which the cache does not keep */
        int32_t hit = q->pooling == LOOM_POOL_MEAN
            ? 0
            : loom_kvblocks_match(e->kv, &q->kv, q->toks, q->n_toks);
        if (e->n_state_slots)
            hit = snapshot_hit(e, q, hit);
        int32_t rest = q->n_toks - hit;
        /* admit only what can be prefilled to the end without preempting anyone */
        if (loom_kvblocks_needed(e->kv, &q->kv, rest) > loom_kvblocks_available(e->kv)) {
            loom_kvblocks_release(e->kv, &q->kv);
            break;
        }
        int32_t k = sched_clip_prefill(&e->policy, q->s.priority, rest < budget ? rest : budget,
                                       now, &worse_used);
        k = to_boundary(e, q, k);
        if (k == 0) {
            loom_kvblocks_release(e->kv, &q->kv);
            break;
        }
        int nc = loom_kvblocks_reserve(e->kv, &q->kv, k, copies + *n_copies);
        if (nc < 0) {
            loom_kvblocks_release(e->kv, &q->kv);
            break;
        }
        *n_copies += nc;
        if (!q->admitted) {
            q->admitted = 1;
            q->queue_ms = now - q->s.t_submit;
            q->n_cached = hit;
            e->n_prompt += (uint64_t)q->n_prompt;
            e->n_hit += (uint64_t)hit;
        }
        if (q->s.priority < admitted_priority)
            admitted_priority = q->s.priority;
        q->n_pooled = 0; /* (again, after a preemption) */
        q->n_draft = q->want = 0;
        remove_waiting(e, q);
        q->next = NULL;
        e->running[e->n_running++] = q;
        take_state_slot(e, q);
        count_running(e);
        plan[n++] = (planned){q, k};
        budget -= k;
    }
    /* the step fits what it was given: the batch, the token budget, and each planned request
     * has its KV blocks for the tokens it computes */
    assert(e->n_running <= e->max_batch && budget >= 0 && n <= e->n_running);
    for (int i = 0; i < n; i++)
        assert(plan[i].k > 0 &&
               (int64_t)plan[i].q->kv.n_tokens + plan[i].k <=
                   (int64_t)plan[i].q->kv.n_blocks * e->bs);
    return n;
}

/* Samples the next token of q from logits; retires q when it is finished. Returns 1 if
 * retired. */
/* The next token of q under its grammar (grammar_sample): -1 when the grammar has ended the
 * answer, -2 with err on a failure. */
static int32_t sample_constrained(loom_engine *e, ereq *q, float *logits, char *err,
                                  size_t err_size)
{
    grammar_vocab **v = &e->gvocab[q->control_text != 0];
    if (!*v && !(*v = grammar_vocab_new(e->tok, q->control_text, err, err_size)))
        return -2;
    if (!e->logits_copy && !(e->logits_copy = malloc((size_t)e->n_vocab * sizeof *logits))) {
        snprintf(err, err_size, "out of memory");
        return -2;
    }
    if (!q->gm && !(q->gm = grammar_matcher_new(q->grammar, *v, err, err_size)))
        return -2;
    int32_t next = grammar_sample(q->gm, logits, e->logits_copy, e->n_vocab, &q->sp, q->toks,
                                  q->n_toks, &q->rng, err, err_size);
    if (next == -2) {
        size_t n = strlen(err);
        snprintf(err + n, err_size - n, " (after %d generated)", q->n_generated);
    }
    return next;
}

/* log Z of the logits, and the k likeliest tokens (ids, log-probabilities), most likely first:
 * *found of them (fewer than k only in a vocabulary that small) */
static float log_partition(const float *logits, int32_t n, int32_t k, int32_t *ids, float *lps,
                           int32_t *found)
{
    float mx = -INFINITY;
    for (int32_t i = 0; i < n; i++)
        mx = logits[i] > mx ? logits[i] : mx;
    double sum = 0;
    int32_t have = 0;
    for (int32_t i = 0; i < n; i++) {
        float x = logits[i];
        sum += exp((double)(x - mx));
        if (k && (have < k || x > lps[have - 1])) { /* insert into the sorted few */
            int32_t at = have < k ? have++ : k - 1;
            while (at > 0 && lps[at - 1] < x)
                lps[at] = lps[at - 1], ids[at] = ids[at - 1], at--;
            lps[at] = x, ids[at] = i;
        }
    }
    float log_z = mx + (float)log(sum);
    for (int32_t i = 0; i < have; i++)
        lps[i] -= log_z;
    *found = have;
    return log_z;
}

static int sample_next(loom_engine *e, ereq *q, float *logits)
{
    loom_model_mask_unsampled(e->model, logits);
    int32_t top_ids[LOOM_MAX_TOP_LOGPROBS];
    float top_lps[LOOM_MAX_TOP_LOGPROBS], log_z = 0;
    int32_t n_top = 0;
    if (q->logprobs) { /* the model's distribution, before penalties, grammar or sampling */
        if (!e->raw_logits && !(e->raw_logits = malloc((size_t)e->n_vocab * sizeof *logits))) {
            remove_running(e, q);
            retire(e, q, NULL, "out of memory");
            return 1;
        }
        memcpy(e->raw_logits, logits, (size_t)e->n_vocab * sizeof *logits);
        log_z = log_partition(logits, e->n_vocab, q->top_logprobs, top_ids, top_lps, &n_top);
    }
    int32_t next;
    if (q->grammar) {
        char err[300];
        next = sample_constrained(e, q, logits, err, sizeof err);
        if (next < 0) { /* -1: the grammar is complete, so the answer is */
            remove_running(e, q);
            q->invalid = next == -2 && !strstr(err, "out of memory");
            retire(e, q, next == -1 ? "stop" : NULL, next == -1 ? NULL : err);
            return 1;
        }
    } else {
        next = loom_sampler_sample(logits, e->n_vocab, &q->sp, q->toks, q->n_toks, &q->rng);
    }
    if (q->n_generated == 0)
        q->ttft_ms = now_ms() - q->s.t_submit;
    if ((!q->ignore_eos || q->grammar) && loom_tokenizer_is_stop(e->tok, next)) {
        remove_running(e, q);
        retire(e, q, "stop", NULL);
        return 1;
    }
    if (q->gm && grammar_accept(q->gm, next) != 0) { /* the sampler keeps to the mask */
        remove_running(e, q);
        retire(e, q, NULL, "internal: a token outside the grammar was sampled");
        return 1;
    }
    q->toks[q->n_toks++] = next;
    q->n_generated++;
    e->n_generated++;
    char piece[512];
    int k = (q->control_text ? loom_tokenizer_piece_control : loom_tokenizer_piece)(
        e->tok, q->toks[q->n_toks - 2], next, piece, sizeof piece);
    int stop = loom_text_stream_push(&q->ts, piece, k > 0 ? (size_t)k : 0);
    /* one event per token, even when all its bytes are held back (part of a UTF-8 character
     * or of a possible stop string), so every id reaches the caller */
    loom_event ev = {.kind = LOOM_EVENT_TEXT,
                     .token = next,
                     .text = q->ts.out ? q->ts.out : "",
                     .len = q->ts.n_out,
                     .n_prompt = q->n_prompt,
                     .n_generated = q->n_generated};
    if (q->logprobs) {
        ev.logprob = e->raw_logits[next] - log_z;
        ev.n_top = n_top, ev.top_ids = top_ids, ev.top_logprobs = top_lps;
    }
    deliver(e, q, &ev);
    q->ts.n_out = 0;
    if (stop || q->n_generated >= q->max_tokens || q->n_toks >= e->n_ctx) {
        remove_running(e, q);
        retire(e, q, stop ? "stop" : "length", NULL);
        return 1;
    }
    return 0;
}

/* Adds n rows of final hidden states to an embedding request's pool. */
static void pool(loom_engine *e, ereq *q, const float *rows, int32_t n)
{
    if (q->n_pooled == 0)
        memset(q->pooled, 0, (size_t)e->n_embd * sizeof *q->pooled);
    loom_pool_add(q->pooled, rows, n, e->n_embd);
    q->n_pooled += n;
}

/* Ends an embedding request (its prompt computed): the mean of what it pooled (for "last",
 * one row), scaled to length one unless it asked otherwise. */
static void finish_embedding(loom_engine *e, ereq *q)
{
    loom_pool_result(q->pooled, q->n_pooled, e->n_embd, !q->embed_unnormalized, e->embedding);
    q->embedded = 1;
    retire(e, q, "stop", NULL);
}

/* One batched step of the drafter model over the requests who[0..n), counts[i] tokens each
 * from the end of their drafter cache: from their text (from_text), else their last proposal;
 * a logit row after the last of each where want_row[i]. 0, or -1 with err. */
static int drafter_step(loom_engine *e, ereq **who, int n, const int32_t *counts, int from_text,
                        const int *want_row, char *err, size_t err_size)
{
    int32_t max_blocks = 1;
    for (int i = 0; i < n; i++)
        max_blocks = who[i]->dkv.n_blocks > max_blocks ? who[i]->dkv.n_blocks : max_blocks;
    int32_t *ids = e->dstep_buf, *pos = ids + e->max_step, *seq = pos + e->max_step,
            *slots = seq + e->max_step, *rows = slots + e->max_step, *table = rows + e->max_step;
    int32_t t = 0, n_rows = 0;
    for (int i = 0; i < n; i++) {
        ereq *q = who[i];
        for (int32_t j = 0; j < counts[i]; j++, t++) {
            int32_t p = q->dkv.n_tokens + j;
            ids[t] = from_text ? q->toks[p] : q->draft[q->n_draft - 1];
            pos[t] = p, seq[t] = i;
            slots[t] = loom_kvblocks_slot(e->dkv, &q->dkv, p);
        }
        if (want_row[i])
            rows[n_rows++] = t - 1;
        int32_t *row = table + (size_t)i * (size_t)max_blocks;
        memcpy(row, q->dkv.blocks, (size_t)q->dkv.n_blocks * sizeof *row);
        for (int32_t b = q->dkv.n_blocks; b < max_blocks; b++)
            row[b] = 0;
    }
    loom_step st = {.n_tokens = t,
                    .ids = ids,
                    .pos = pos,
                    .seq = seq,
                    .slots = slots,
                    .n_seqs = n,
                    .max_blocks = max_blocks,
                    .block_table = table,
                    .n_logits = n_rows,
                    .logit_rows = rows};
    if (loom_runner_step(e->drunner, &st, err, err_size) != 0)
        return -1;
    for (int i = 0; i < n; i++)
        loom_kvblocks_advance(e->dkv, &who[i]->dkv, who[i]->toks, who[i]->dkv.n_tokens + counts[i]);
    return 0;
}

/* The drafter's proposal from its logit row: its most likely token, or -1 when it gives that
 * less than draft_p_min. */
static int32_t drafter_choice(loom_engine *e, const float *row)
{
    memcpy(e->dlogits, row, (size_t)e->n_vocab * sizeof *e->dlogits);
    loom_model_mask_unsampled(e->draft, e->dlogits);
    int32_t best = 0;
    for (int32_t i = 1; i < e->n_vocab; i++)
        best = e->dlogits[i] > e->dlogits[best] ? i : best;
    if (e->draft_p_min <= 0)
        return best; /* no threshold: no softmax to sum */
    double sum = 0;
    for (int32_t i = 0; i < e->n_vocab; i++)
        sum += exp((double)(e->dlogits[i] - e->dlogits[best]));
    return 1.0 / sum >= e->draft_p_min ? best : -1;
}

/* The drafter model's proposals for the planned requests that want some (q->want): each one's
 * drafter sequence first takes what of its text it lacks (within a step's budget; one that
 * lags further only catches up this step), then up to q->want proposals, one batched drafter
 * step each. Greedy proposals (tokens without a distribution) keep the engine's rule exact: a
 * proposal is kept when the request's own draw is it. Sets q->n_draft and the plan's token
 * counts. A drafter step that fails leaves the proposals made so far (none: a plain step). */
static void run_drafter(loom_engine *e, planned *plan, int n_plan)
{
    char err[512];
    ereq **who = e->dwho;
    int32_t *counts = e->dstep_buf + 5 * (size_t)e->max_step +
        (size_t)e->max_batch * (size_t)e->dmax_blocks;
    int *rows = (int *)(counts + e->max_batch);
    int32_t budget = e->max_step;
    int n = 0, most = 0;
    for (int i = 0; i < n_plan; i++) {
        ereq *q = plan[i].q;
        if (!q->want)
            continue;
        int32_t missing = q->n_toks - q->dkv.n_tokens;
        int32_t feed = missing < budget ? missing : budget;
        loom_kvcopy none[1];
        if (feed <= 0 || loom_kvblocks_reserve(e->dkv, &q->dkv, feed + q->want - 1, none) < 0)
            continue; /* (its plan shrinks below, to the pending token) */
        budget -= feed;
        who[n] = q, counts[n] = feed, rows[n] = feed == missing;
        most = q->want > most ? q->want : most;
        n++;
    }
    int rc = n ? drafter_step(e, who, n, counts, 1, rows, err, sizeof err) : -1;
    for (int round = 0; rc == 0; round++) {
        /* a proposal from each row, and who goes on */
        const float *logits = loom_runner_logits(e->drunner);
        int li = 0, going = 0;
        for (int i = 0; i < n; i++) {
            ereq *q = who[i];
            if (!rows[i])
                continue; /* caught up only partly: no proposal this step */
            int32_t tok = drafter_choice(e, logits + (size_t)li++ * (size_t)e->n_vocab);
            if (tok < 0)
                continue;
            q->draft[q->n_draft++] = tok;
            if (q->n_draft < q->want)
                who[going++] = q;
        }
        n = going;
        if (n == 0 || round + 1 >= most)
            break;
        for (int i = 0; i < n; i++)
            counts[i] = 1, rows[i] = 1;
        rc = drafter_step(e, who, n, counts, 0, rows, err, sizeof err);
    }
    for (int i = 0; i < n_plan; i++) {
        ereq *q = plan[i].q;
        if (q->use_draft && q->want) /* planned as 1 + want: as many as were proposed */
            plan[i].k = 1 + q->n_draft;
        q->want = 0;
    }
}

/* Recurrent layers ran every proposal of the step just taken, kept or not, and their state
 * cannot be cut back: each of who[0..n) goes back to its checkpoint (taken before the step, at
 * the position of its pending token then) and runs again the tokens it kept from there, whose
 * K/V are rewritten with the same values. A request whose replay fails ends with the error. */
static void replay_kept(loom_engine *e, ereq **who, int n, int32_t *buf)
{
    char err[512];
    int32_t n_tok = 0, max_blocks = 1;
    for (int i = 0; i < n; i++) {
        assert(who[i]->kv.n_tokens > who[i]->spec_from);
        n_tok += who[i]->kv.n_tokens - who[i]->spec_from;
        max_blocks = who[i]->kv.n_blocks > max_blocks ? who[i]->kv.n_blocks : max_blocks;
    }
    /* (buf holds a step of up to max_step tokens and max_batch sequences: this is smaller) */
    int32_t *ids = buf, *pos = ids + n_tok, *seq = pos + n_tok, *slots = seq + n_tok;
    int32_t *table = slots + n_tok, *state = table + (size_t)n * (size_t)max_blocks;
    int rc = 0;
    for (int i = 0, t = 0; i < n; i++) {
        ereq *q = who[i];
        if (rc == 0)
            rc = loom_runner_state_copy(e->runner, q->state_slot + e->n_state_slots, q->state_slot,
                                        err, sizeof err);
        for (int32_t p = q->spec_from; p < q->kv.n_tokens; p++, t++) {
            ids[t] = q->toks[p], pos[t] = p, seq[t] = i;
            slots[t] = loom_kvblocks_slot(e->kv, &q->kv, p);
        }
        int32_t *row = table + (size_t)i * (size_t)max_blocks;
        memcpy(row, q->kv.blocks, (size_t)q->kv.n_blocks * sizeof *row);
        for (int32_t b = q->kv.n_blocks; b < max_blocks; b++)
            row[b] = 0;
        state[i] = q->state_slot;
    }
    loom_step st = {n_tok, ids, pos,  seq,  slots, n,    max_blocks,
                    table, 0,   NULL, NULL, 0,     NULL, state};
    if (rc == 0)
        rc = loom_runner_step(e->runner, &st, err, sizeof err);
    for (int i = 0; rc != 0 && i < n; i++) {
        remove_running(e, who[i]);
        retire(e, who[i], NULL, err);
    }
}

static void run_step(loom_engine *e, planned *plan, int n_plan, const loom_kvcopy *copies,
                     int n_copies, int32_t *buf)
{
    char err[512];
    int32_t n_tok = 0, max_blocks = 1, n_logits = 0;
    for (int i = 0; i < n_plan; i++) {
        n_tok += plan[i].k;
        if (plan[i].q->kv.n_blocks > max_blocks)
            max_blocks = plan[i].q->kv.n_blocks;
    }
    int32_t *ids = buf, *pos = ids + n_tok, *seq = pos + n_tok, *slots = seq + n_tok;
    int32_t *rows = slots + n_tok, *prefix = rows + n_tok, *table = prefix + n_plan;
    int32_t *hidden_rows = table + (size_t)n_plan * (size_t)max_blocks, n_hidden = 0;
    int any_prefix = 0;
    int32_t t = 0;
    for (int i = 0; i < n_plan; i++) {
        ereq *q = plan[i].q;
        int ends = q->kv.n_tokens + plan[i].k == q->n_toks + q->n_draft;
        for (int32_t j = 0; j < plan[i].k; j++, t++) {
            int32_t p = q->kv.n_tokens + j;
            ids[t] = p < q->n_toks ? q->toks[p] : q->draft[p - q->n_toks];
            pos[t] = p, seq[t] = i;
            slots[t] = loom_kvblocks_slot(e->kv, &q->kv, p);
            if (q->pooling == LOOM_POOL_MEAN || (q->pooling && ends && j == plan[i].k - 1))
                hidden_rows[n_hidden++] = t;
        }
        /* its last known token (sample after it), and after each proposal */
        for (int32_t r = q->n_draft; ends && !q->pooling && r >= 0; r--)
            rows[n_logits++] = t - 1 - r;
        prefix[i] = q->prefix_len;
        any_prefix |= q->prefix_len > 0;
        int32_t *row = table + (size_t)i * (size_t)max_blocks;
        memcpy(row, q->kv.blocks, (size_t)q->kv.n_blocks * sizeof *row);
        for (int32_t b = q->kv.n_blocks; b < max_blocks; b++)
            row[b] = 0;
    }
    int rc = 0;
    if (n_copies)
        rc = loom_runner_copy_blocks(e->runner, copies, n_copies, err, sizeof err);
    int32_t *state_slots = hidden_rows + n_tok;
    for (int i = 0; i < n_plan && rc == 0; i++) {
        state_slots[i] = plan[i].q->state_slot;
        /* recurrent layers run every proposal: a checkpoint to go back to (below) */
        if (e->n_state_slots && plan[i].q->n_draft) {
            plan[i].q->spec_from = plan[i].q->kv.n_tokens;
            rc = loom_runner_state_copy(e->runner, state_slots[i],
                                        state_slots[i] + e->n_state_slots, err, sizeof err);
        }
    }
    /* clang-format off */
    loom_step st = {n_tok, ids, pos, seq, slots, n_plan, max_blocks, table, n_logits, rows,
                    any_prefix ? prefix : NULL, n_hidden, hidden_rows,
                    e->n_state_slots ? state_slots : NULL};
    /* clang-format on */
    if (rc == 0)
        rc = loom_runner_step(e->runner, &st, err, sizeof err);
    if (rc != 0) {
        /* the step's requests fail; the others, and the engine, go on */
        for (int i = 0; i < n_plan; i++) {
            remove_running(e, plan[i].q);
            retire(e, plan[i].q, NULL, err);
        }
        return;
    }
    e->n_steps++;
    const float *logits = loom_runner_logits(e->runner);
    const float *hidden = loom_runner_hidden(e->runner);
    int li = 0, hi = 0, n_replay = 0;
    ereq **replay = e->replay; /* requests whose rejected proposals are undone */
    for (int i = 0; i < n_plan; i++) {
        ereq *q = plan[i].q;
        int32_t n_draft = q->n_draft;
        int ends = q->kv.n_tokens + plan[i].k == q->n_toks + n_draft;
        /* the proposals' K/V count only once they are kept, below */
        loom_kvblocks_advance(e->kv, &q->kv, q->toks, q->kv.n_tokens + plan[i].k - n_draft);
        if (!n_draft)
            take_snapshot(e, q);
        if (q->pooling) {
            int32_t n_rows = q->pooling == LOOM_POOL_MEAN ? plan[i].k : ends;
            pool(e, q, hidden + (size_t)hi * (size_t)e->n_embd, n_rows);
            hi += n_rows;
            if (ends) {
                remove_running(e, q);
                finish_embedding(e, q);
            }
            continue;
        }
        if (!ends)
            continue;
        /* Sampled as without proposals, row after row; a proposal is kept when the draw is
         * it. For a proposal without a distribution of its own (lookup's) that is the
         * speculative rule: kept with probability p(d), else a draw from p without d. */
        int32_t row0 = li, kept = 0;
        e->n_drafted += (uint64_t)n_draft;
        for (int32_t j = 0; j <= n_draft; j++) {
            memcpy(e->logits, logits + (size_t)(row0 + j) * (size_t)e->n_vocab,
                   (size_t)e->n_vocab * sizeof *e->logits);
            if (sample_next(e, q, e->logits)) {
                q = NULL; /* retired */
                break;
            }
            if (j == n_draft || q->toks[q->n_toks - 1] != q->draft[j])
                break;
            kept++;
            loom_kvblocks_advance(e->kv, &q->kv, q->toks, q->kv.n_tokens + 1);
        }
        li = row0 + n_draft + 1;
        e->n_accepted += (uint64_t)kept;
        /* a rejected proposal is in the recurrent state: replay_kept takes it back */
        if (q && e->n_state_slots && kept < n_draft)
            replay[n_replay++] = q;
        if (q && n_draft) {
            q->spec_ok = 0.9 * q->spec_ok + kept;
            q->spec_miss = 0.9 * q->spec_miss + (kept < n_draft);
        }
        /* the drafter's cache holds what the text still has: all but the pending token */
        if (q && q->use_draft && q->dkv.n_tokens > q->n_toks - 1)
            loom_kvblocks_truncate(&q->dkv, q->n_toks - 1);
    }
    if (n_replay)
        replay_kept(e, replay, n_replay, buf);
}

#define DISPLACED_WHY                                                                              \
    "the server is busy: its queue was full and a request of better priority took this one's "     \
    "place before it started; try again shortly"

/* Retires cancelled and displaced requests (and, on cancel_all, every request). */
static void reap_cancelled(loom_engine *e, int all)
{
    pthread_mutex_lock(&e->lock);
    e->has_cancels = 0;
    pthread_mutex_unlock(&e->lock);
    for (int i = 0; i < e->n_running; i++) {
        ereq *q = e->running[i];
        pthread_mutex_lock(&e->lock);
        int c = q->s.cancelled || all;
        pthread_mutex_unlock(&e->lock);
        if (c) {
            remove_running(e, q);
            retire(e, q, "cancelled", NULL);
            i--;
        }
    }
    for (ereq *q = e->waiting, *next; q; q = next) {
        next = q->next;
        pthread_mutex_lock(&e->lock);
        int c = q->s.cancelled || all, d = q->s.displaced;
        pthread_mutex_unlock(&e->lock);
        if (c || d) {
            remove_waiting(e, q);
            retire(e, q, c ? "cancelled" : NULL, c ? NULL : DISPLACED_WHY);
        }
    }
}

/* The waiting requests' own priorities, counted into s: the best LOOM_STATS_PRIORITIES - 1
 * each with its count, then the next with every worse one's. (Engine thread, e->lock held:
 * the incoming requests wait too.) */
static void count_waiting_priorities(const loom_engine *e, loom_engine_stats *s)
{
    int n = 0;
    for (; n < LOOM_STATS_PRIORITIES; n++) {
        int last = n == LOOM_STATS_PRIORITIES - 1;
        int32_t best = INT32_MAX, count = 0;
        for (int list = 0; list < 2; list++)
            for (const ereq *q = list ? e->incoming : e->waiting; q; q = q->next) {
                if (n > 0 && q->s.priority <= s->waiting_priority[n - 1])
                    continue;
                if (q->s.priority < best)
                    count = last ? count + 1 : 1, best = q->s.priority;
                else if (q->s.priority == best || last)
                    count++;
            }
        if (!count)
            break;
        s->waiting_priority[n] = best, s->waiting_count[n] = count;
    }
    s->n_waiting_priorities = n;
}

static void publish_stats(loom_engine *e)
{
    loom_kvstats k = loom_kvblocks_stats(e->kv);
    int n_wait = 0;
    for (ereq *q = e->waiting; q; q = q->next)
        n_wait++;
    double t = now_ms();
    pthread_mutex_lock(&e->lock);
    for (ereq *q = e->incoming; q; q = q->next)
        n_wait++;
    loom_engine_stats *s = &e->stats;
    s->running = e->n_running, s->waiting = n_wait;
    s->kv_blocks = k.n_blocks, s->kv_used = k.used, s->kv_cached = k.cached, s->kv_free = k.free;
    s->block_size = k.block_size;
    s->prompt_tokens = e->n_prompt, s->cached_prompt_tokens = e->n_hit;
    s->generated_tokens = e->n_generated, s->preemptions = e->n_preempted, s->steps = e->n_steps;
    s->deadline_waiting = e->n_deadline_waiting, s->deadline_running = e->n_deadline_running;
    s->max_queue = e->max_queue;
    s->drafted = e->n_drafted, s->accepted = e->n_accepted;
    count_waiting_priorities(e, s);
    /* generated tokens per second over the last second or more of work */
    if (t - e->rate_t0 >= 1000) {
        s->tokens_per_s = (double)(e->n_generated - e->rate_n0) / ((t - e->rate_t0) / 1e3);
        e->rate_t0 = t, e->rate_n0 = e->n_generated;
    }
    if (e->n_running == 0 && n_wait == 0) {
        s->tokens_per_s = 0;
        e->rate_t0 = t, e->rate_n0 = e->n_generated;
    }
    if (e->n_running == 0 && n_wait == 0)
        pthread_cond_broadcast(&e->idle);
    pthread_mutex_unlock(&e->lock);
}

/* --batch-wait-ms: with nothing running, a prefill waits (e->lock held) until max_batch
 * requests are there or the first of them has waited batch_wait_ms, whichever is sooner, so
 * that requests arriving close together start together. Running requests are never held. */
static void batch_wait(loom_engine *e)
{
    if (e->batch_wait_ms <= 0 || e->n_running)
        return;
    for (;;) {
        double first = 0;
        int n = 0;
        for (ereq *q = e->waiting; q; q = q->next, n++)
            first = !first || q->s.t_submit < first ? q->s.t_submit : first;
        for (ereq *q = e->incoming; q; q = q->next, n++)
            first = !first || q->s.t_submit < first ? q->s.t_submit : first;
        double left = first + e->batch_wait_ms - now_ms();
        if (!n || n >= e->max_batch || left <= 0 || e->cancel_all || e->has_cancels || e->stopping)
            return;
        /* the requests held here are waiting, and the stats say so while they are held */
        e->stats.waiting = n;
        count_waiting_priorities(e, &e->stats);
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        long ns = until.tv_nsec + (long)(left * 1e6);
        until.tv_sec += ns / 1000000000L;
        until.tv_nsec = ns % 1000000000L;
        pthread_cond_timedwait(&e->wake, &e->lock, &until);
    }
}

static void *engine_main(void *arg)
{
    loom_engine *e = arg;
    planned *plan = e->plan;
    loom_kvcopy *copies = e->copies;
    int32_t *buf = e->step_buf;
    for (;;) {
        pthread_mutex_lock(&e->lock);
        while (!e->incoming && !e->waiting && !e->n_running && !e->cancel_all && !e->has_cancels)
            pthread_cond_wait(&e->wake, &e->lock);
        batch_wait(e);
        int all = e->cancel_all;
        /* newcomers join the back of the queue */
        ereq **tail = &e->waiting;
        while (*tail)
            tail = &(*tail)->next;
        *tail = e->incoming;
        note_arrivals(e, e->incoming);
        e->incoming = e->incoming_tail = NULL;
        int cancels = e->has_cancels;
        pthread_mutex_unlock(&e->lock);
        if (cancels || all)
            reap_cancelled(e, all);
        if (all) {
            publish_stats(e);
            break;
        }
        expire(e);
        int n_copies = 0;
        int n_plan = plan_step(e, plan, copies, &n_copies);
        if (n_plan > 0 && e->draft)
            run_drafter(e, plan, n_plan);
        if (n_plan > 0)
            run_step(e, plan, n_plan, copies, n_copies, buf);
        publish_stats(e);
    }
    return NULL;
}

/* ---- lifetime ----------------------------------------------------------------------------- */

/* A rank of the pipeline stopped (on the transport's thread): every request is answered now,
 * since the engine thread may be blocked for good inside the transport, and gets no event
 * after this one. New requests are refused with the same reason. */
static void abandon(void *ctx, const char *why)
{
    loom_engine *e = ctx;
    loom_event ev = {.kind = LOOM_EVENT_ERROR, .token = -1, .error = why};
    pthread_mutex_lock(&e->deliver_lock);
    pthread_mutex_lock(&e->lock);
    e->stopping = 1;
    snprintf(e->stop_reason, sizeof e->stop_reason, "%s", why);
    pthread_mutex_unlock(&e->lock);
    for (;;) {
        /* one at a time, the lock released around each event (it may submit or cancel); no
         * request is freed meanwhile: that happens only after its last event, which waits */
        ereq *q = NULL;
        pthread_mutex_lock(&e->lock);
        for (int i = 0; i < e->n_live && !q; i++)
            if (!e->live[i]->abandoned)
                q = e->live[i];
        if (q)
            q->abandoned = 1;
        pthread_mutex_unlock(&e->lock);
        if (!q)
            break;
        q->fn(q->user, &ev);
    }
    pthread_mutex_unlock(&e->deliver_lock);
}

/* What loom_engine_start allocates (each may be NULL), and e. */
static void free_parts(loom_engine *e)
{
    if (e->kv)
        loom_kvblocks_free(e->kv);
    if (e->dkv)
        loom_kvblocks_free(e->dkv);
    free(e->running), free(e->live), free(e->logits), free(e->plan), free(e->copies),
        free(e->replay);
    free(e->step_buf), free(e->embedding), free(e->dstep_buf), free(e->dlogits), free(e->dwho);
    free(e->slot_taken), free(e->snapshots);
    free(e);
}

/* The drafter model of o, checked against the engine's model; 0, or -1 with err. */
static int start_drafter(loom_engine *e, const loom_engine_options *o, char *err, size_t err_size)
{
    loom_speculation check = {.draft = o->draft};
    if (loom_speculation_check(e->model, &check, err, err_size) != 0)
        return -1;
    e->draft = o->draft;
    e->drunner = loom_model_runner(o->draft);
    e->draft_p_min = o->draft_p_min;
    int32_t bs = loom_runner_block_size(e->drunner), n_blocks = loom_runner_kv_blocks(e->drunner);
    e->dmax_blocks = (e->n_ctx + bs - 1) / bs + 1;
    if (loom_runner_has_prefix(e->runner) || loom_runner_n_ctx(e->drunner) < e->n_ctx ||
        n_blocks < e->dmax_blocks - 1) {
        snprintf(err, err_size,
                 loom_runner_has_prefix(e->runner)
                     ? "a draft model cannot follow this model (its prompts attend both ways)"
                     : "the draft model's context (%d tokens, %d blocks of %d) is smaller than "
                       "the engine's (%d tokens)",
                 loom_runner_n_ctx(e->drunner), n_blocks, bs, e->n_ctx);
        return -1;
    }
    e->dkv = loom_kvblocks_create(n_blocks, bs);
    /* a drafter step's ids, positions, sequences, slots and rows (max_step each), block table
     * rows, then run_drafter's counts and flags (per sequence) */
    e->dstep_buf = malloc((5 * (size_t)e->max_step + (size_t)e->max_batch * (e->dmax_blocks + 2)) *
                          sizeof *e->dstep_buf);
    e->dlogits = malloc((size_t)e->n_vocab * sizeof *e->dlogits);
    e->dwho = malloc((size_t)e->max_batch * sizeof *e->dwho);
    if (!e->dkv || !e->dstep_buf || !e->dlogits || !e->dwho) {
        snprintf(err, err_size, "out of memory");
        return -1;
    }
    return 0;
}

loom_engine *loom_engine_start(loom_model *m, const loom_engine_options *o, char *err,
                               size_t err_size)
{
    loom_engine_options none = {0};
    if (!o)
        o = &none;
    loom_engine *e = calloc(1, sizeof *e);
    if (!e) {
        snprintf(err, err_size, "out of memory");
        return NULL;
    }
    e->model = m;
    e->runner = loom_model_runner(m);
    e->tok = loom_model_tokenizer(m);
    e->n_ctx = loom_runner_n_ctx(e->runner);
    e->n_vocab = loom_model_n_vocab(m);
    e->n_embd = loom_model_n_embd(m);
    e->bs = loom_runner_block_size(e->runner);
    e->max_batch = o->max_batch > 0 ? o->max_batch : 16;
    e->max_step = o->max_tokens_per_step > 0 ? o->max_tokens_per_step : 256;
    e->max_queue = o->max_queue > 0 ? o->max_queue : 8 * e->max_batch;
    e->policy.aging_ms = o->aging_ms > 0 ? o->aging_ms : 10000;
    e->policy.tenant_running = e->tenant_running;
    e->batch_wait_ms = o->batch_wait_ms > 0 ? o->batch_wait_ms : 0;
    e->spec_rows = o->spec_rows > 0 ? o->spec_rows : 16;
    /* a model with recurrent layers runs as many requests at once as it has pairs of state
     * slots: the lower half theirs, the upper half their checkpoints during a speculative
     * pass (take_state_slot) */
    int32_t slots = loom_runner_state_slots(e->runner);
    e->n_state_slots = slots >= 3 ? slots / 3 : slots / 2;
    if (e->n_state_slots && e->max_batch > e->n_state_slots)
        e->max_batch = e->n_state_slots;
    if (e->n_state_slots && e->n_state_slots > e->max_batch)
        e->n_state_slots = e->max_batch;
    e->n_snapshots = slots - 2 * e->n_state_slots;
    if (e->max_step < e->max_batch) {
        snprintf(err, err_size,
                 "max tokens per step (%d) must be at least the batch size (%d): "
                 "every running sequence needs one token a step",
                 e->max_step, e->max_batch);
        free(e);
        return NULL;
    }
    int32_t n_blocks = loom_runner_kv_blocks(e->runner);
    int32_t per_seq = (e->n_ctx + e->bs - 1) / e->bs;
    if (n_blocks < per_seq) {
        snprintf(err, err_size,
                 "the KV cache has %d blocks of %d tokens, fewer than one %d-token "
                 "context needs (%d)",
                 n_blocks, e->bs, e->n_ctx, per_seq);
        free(e);
        return NULL;
    }
    e->kv = loom_kvblocks_create(n_blocks, e->bs);
    e->running = calloc((size_t)e->max_batch, sizeof *e->running);
    e->logits = malloc((size_t)e->n_vocab * sizeof *e->logits);
    size_t max_blocks = (size_t)(e->n_ctx + e->bs - 1) / (size_t)e->bs + 1;
    e->plan = malloc((size_t)e->max_batch * sizeof *e->plan);
    e->replay = malloc((size_t)e->max_batch * sizeof *e->replay);
    e->copies = malloc((size_t)e->max_batch * sizeof *e->copies);
    /* a step's ids, positions, sequences, slots, logit rows and hidden rows (max_step each);
     * prefixes and block table rows (per sequence) */
    e->step_buf = malloc((6 * (size_t)e->max_step + (size_t)e->max_batch * (max_blocks + 2)) *
                         sizeof *e->step_buf);
    e->embedding = malloc((size_t)e->n_embd * sizeof *e->embedding);
    e->slot_taken = calloc((size_t)e->n_state_slots + 1, 1);
    e->snapshots = malloc(((size_t)e->n_snapshots + 1) * sizeof *e->snapshots);
    for (int32_t i = 0; e->snapshots && i < e->n_snapshots; i++)
        e->snapshots[i] = (struct state_snapshot){-1, -1, 0, 0};
    if (!e->kv || !e->running || !e->logits || !e->plan || !e->copies || !e->step_buf ||
        !e->embedding || !e->slot_taken || !e->replay || !e->snapshots) {
        free_parts(e);
        snprintf(err, err_size, "out of memory");
        return NULL;
    }
    if (o->draft && start_drafter(e, o, err, err_size) != 0) {
        free_parts(e);
        return NULL;
    }
    pthread_mutex_init(&e->lock, NULL);
    pthread_mutex_init(&e->deliver_lock, NULL);
    pthread_cond_init(&e->wake, NULL);
    pthread_cond_init(&e->idle, NULL);
    e->rate_t0 = now_ms();
    publish_stats(e);
    int rc = pthread_create(&e->thread, NULL, engine_main, e);
    if (rc != 0) {
        snprintf(err, err_size, "cannot start the engine thread: %s", strerror(rc));
        free_parts(e);
        return NULL;
    }
    loom_model_watch_stages(m, abandon, e);
    return e;
}

void loom_engine_stop(loom_engine *e, int drain_ms)
{
    if (!e)
        return;
    pthread_mutex_lock(&e->lock);
    e->stopping = 1;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += drain_ms / 1000;
    until.tv_nsec += (long)(drain_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L)
        until.tv_sec++, until.tv_nsec -= 1000000000L;
    while (drain_ms > 0 && e->n_live > 0)
        if (pthread_cond_timedwait(&e->idle, &e->lock, &until) == ETIMEDOUT)
            break;
    e->cancel_all = 1;
    pthread_cond_signal(&e->wake);
    int joined = e->joined;
    e->joined = 1;
    pthread_mutex_unlock(&e->lock);
    if (!joined)
        pthread_join(e->thread, NULL);
}

void loom_engine_free(loom_engine *e)
{
    if (!e)
        return;
    loom_engine_stop(e, 0);
    loom_model_watch_stages(e->model, NULL, NULL);
    pthread_mutex_destroy(&e->lock);
    pthread_mutex_destroy(&e->deliver_lock);
    pthread_cond_destroy(&e->wake);
    pthread_cond_destroy(&e->idle);
    grammar_vocab_free(e->gvocab[0]);
    grammar_vocab_free(e->gvocab[1]);
    free(e->logits_copy);
    free(e->raw_logits);
    free_parts(e);
}
