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
 * them to the requests, the KV pool and the model, with the rooms engine_internal.h lists
 * (submit.c: a request in; state.c: a hybrid model's state slots; draft.c: proposals;
 * sample.c: the next token).
 * A request's tokens are its prompt followed by what it generated; each step computes the
 * next chunk of the ones whose K/V are not yet stored, so a prefill, a decode and a
 * recomputation after preemption are the same thing. Only the engine thread touches
 * waiting/running and the model; HTTP threads and the like only submit and cancel.
 */
#define _GNU_SOURCE
#include "engine/engine_internal.h"

#include <assert.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

double engine_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

void engine_req_free(ereq *q)
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
    free(q->mtp.rows), free(q->mtp_own);
    free(q->answer);
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

void engine_remove_running(loom_engine *e, ereq *q)
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

void engine_deliver(loom_engine *e, ereq *q, const loom_event *ev)
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
                     .n_cached_restored = q->n_cached_restored,
                     .ttft_ms = q->ttft_ms,
                     .queue_ms = q->queue_ms};
    if (q->ts.n_out && !error) {
        ev.text = q->ts.out, ev.len = q->ts.n_out;
        engine_deliver(e, q, &ev);
    }
    ev.text = NULL, ev.len = 0;
    ev.kind = error ? LOOM_EVENT_ERROR : LOOM_EVENT_DONE;
    ev.finish_reason = finish;
    ev.stop_string = q->ts.stopped_by;
    ev.reasoning_tokens = q->thought_tokens;
    ev.error = error;
    ev.deadline = deadline;
    ev.busy = q->s.displaced;
    ev.invalid = q->invalid;
    if (q->embedded) /* (not when cancelled: e->embedding is another request's then) */
        ev.embedding = e->embedding, ev.n_embd = e->n_embd;
    forget_live(e, q);
    engine_deliver(e, q, &ev);
    engine_req_free(q);
}

void engine_retire(loom_engine *e, ereq *q, const char *finish, const char *error)
{
    retire_as(e, q, finish, error, 0);
}

/* Ends every request whose deadline has come: one still waiting with an error (it never ran),
 * one generating with what it has ("length"). */
static void expire(loom_engine *e)
{
    double now = engine_now_ms();
    char why[160];
    for (int i = 0; i < e->n_running; i++) {
        ereq *q = e->running[i];
        if (sched_expired(&q->s, now)) {
            engine_remove_running(e, q);
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
    engine_remove_running(e, q);
    loom_kvblocks_release(e->kv, &q->kv);
    if (e->dkv)
        loom_kvblocks_release(e->dkv, &q->dkv);
    q->next = e->waiting;
    e->waiting = q;
    e->n_preempted++;
}

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
    double now = engine_now_ms();
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
        k = engine_to_boundary(e, q,
                               sched_clip_prefill(&e->policy, q->s.priority, k, now, &worse_used));
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
        int32_t want = k == 1 && q->draft && room > 0 ? engine_proposals_wanted(e, q, room) : 0;
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
            hit = engine_snapshot_hit(e, q, hit);
        int32_t rest = q->n_toks - hit;
        /* admit only what can be prefilled to the end without preempting anyone */
        if (loom_kvblocks_needed(e->kv, &q->kv, rest) > loom_kvblocks_available(e->kv)) {
            loom_kvblocks_release(e->kv, &q->kv);
            break;
        }
        int32_t k = sched_clip_prefill(&e->policy, q->s.priority, rest < budget ? rest : budget,
                                       now, &worse_used);
        k = engine_to_boundary(e, q, k);
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
            q->n_cached_restored = engine_restored_tokens(e, q, hit);
            e->restored_hit_tokens += (uint64_t)q->n_cached_restored;
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
        engine_take_state_slot(e, q);
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
            if (q->pooling == LOOM_POOL_MEAN || (q->pooling && ends && j == plan[i].k - 1) ||
                (e->mtp && q->use_draft)) /* an MTP drafter reads every state */
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
                    e->n_state_slots ? state_slots : NULL, NULL};
    /* clang-format on */
    if (rc == 0)
        rc = loom_runner_step(e->runner, &st, err, sizeof err);
    if (rc != 0) {
        /* the step's requests fail; the others, and the engine, go on */
        for (int i = 0; i < n_plan; i++) {
            engine_remove_running(e, plan[i].q);
            engine_retire(e, plan[i].q, NULL, err);
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
        if (e->mtp && q->use_draft) {
            /* (a store that cannot grow empties: no proposals until it has states again) */
            loom_mtp_states_put(&q->mtp, q->kv.n_tokens, hidden + (size_t)hi * (size_t)e->n_embd,
                                plan[i].k);
            hi += plan[i].k;
        }
        /* the proposals' K/V count only once they are kept, below */
        loom_kvblocks_advance(e->kv, &q->kv, q->toks, q->kv.n_tokens + plan[i].k - n_draft);
        if (!n_draft)
            engine_take_snapshot(e, q);
        if (q->pooling) {
            int32_t n_rows = q->pooling == LOOM_POOL_MEAN ? plan[i].k : ends;
            engine_pool(e, q, hidden + (size_t)hi * (size_t)e->n_embd, n_rows);
            hi += n_rows;
            if (ends) {
                engine_remove_running(e, q);
                engine_finish_embedding(e, q);
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
            if (engine_sample_next(e, q, e->logits)) {
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
        engine_replay_kept(e, replay, n_replay, buf);
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
            engine_remove_running(e, q);
            engine_retire(e, q, "cancelled", NULL);
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
            engine_retire(e, q, c ? "cancelled" : NULL, c ? NULL : DISPLACED_WHY);
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
    double t = engine_now_ms();
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
    s->prefix_blocks_restored = e->prefix_blocks_restored;
    s->restored_hit_tokens = e->restored_hit_tokens;
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
        double left = first + e->batch_wait_ms - engine_now_ms();
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
            engine_run_drafter(e, plan, n_plan);
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
    free(e->dstates);
    free(e->slot_taken), free(e->snapshots);
    free(e->restored_gen), free(e->prefix_file);
    free(e);
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
    e->n_blocks = n_blocks;
    e->restored_gen = malloc((size_t)n_blocks * sizeof *e->restored_gen);
    if (e->restored_gen)
        memset(e->restored_gen, 0xff, (size_t)n_blocks * sizeof *e->restored_gen);
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
        !e->embedding || !e->slot_taken || !e->replay || !e->snapshots || !e->restored_gen ||
        engine_restore_prefixes(e, o->prefix_file) != 0) {
        free_parts(e);
        snprintf(err, err_size, "out of memory");
        return NULL;
    }
    if (o->draft && engine_start_drafter(e, o, err, err_size) != 0) {
        free_parts(e);
        return NULL;
    }
    pthread_mutex_init(&e->lock, NULL);
    pthread_mutex_init(&e->deliver_lock, NULL);
    pthread_cond_init(&e->wake, NULL);
    pthread_cond_init(&e->idle, NULL);
    e->rate_t0 = engine_now_ms();
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
    free(e->think_close);
    free_parts(e);
}
