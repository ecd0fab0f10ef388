/*
 * engine/submit.c - a request into the engine: loom_engine_submit checks what the caller gave
 * (prompt, pooling, speculation, reasoning, tenant), copies it into the engine's own request
 * (ereq), applies the queue's admission rules (a tenant's share, a full queue that displaces
 * its worst waiting request for a better one) and hands it to the engine thread; and
 * loom_engine_cancel marks one for the thread to end.
 */
#define _GNU_SOURCE
#include "engine/engine_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
        q->mtp.n_embd = e->n_embd;
        if (r->draft && e->mtp && !(q->mtp_own = malloc((size_t)e->n_embd * sizeof(float))))
            goto oom;
    }
    const loom_sampling *s = &r->sampling;
    q->sp = loom_sampler_params_of(s);
    q->rng = s->seed;
    q->ignore_eos = s->ignore_eos;
    q->control_text = r->control_text;
    q->grammar = loom_grammar_ref(r->grammar);
    q->reasoning = r->pooling ? 0 : r->reasoning;
    q->forcing = -1;
    if (r->reasoning_budget < 0) {
        engine_req_free(q);
        snprintf(err, err_size, "reasoning_budget %d is below 0", r->reasoning_budget);
        return -1;
    }
    if (q->reasoning && !q->grammar && r->reasoning_budget > 0) {
        if (engine_think_close(e, err, err_size) != 0) {
            engine_req_free(q);
            return -1;
        }
        q->reasoning_budget = r->reasoning_budget;
    }
    q->logprobs = r->logprobs;
    q->top_logprobs = r->top_logprobs < 0         ? 0
        : r->top_logprobs > LOOM_MAX_TOP_LOGPROBS ? LOOM_MAX_TOP_LOGPROBS
                                                  : r->top_logprobs;
    loom_text_stream_init(&q->ts, (const char *const *)q->stops, q->n_stops);
    q->fn = fn, q->user = user;
    q->s.t_submit = engine_now_ms();
    q->s.priority = r->priority;
    if (r->timeout_ms > 0)
        q->s.deadline = q->s.t_submit + r->timeout_ms;
    if (r->tenant < 0 || r->tenant > LOOM_MAX_TENANTS) {
        engine_req_free(q);
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
        engine_req_free(q);
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
        engine_req_free(q);
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
            engine_req_free(q);
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
        engine_req_free(q);
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
