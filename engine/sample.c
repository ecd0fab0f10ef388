/*
 * engine/sample.c - a request's next token from its logits (its sampler, grammar, stops and
 * log-probabilities), and the pooling of an embedding request's hidden states.
 */
#define _GNU_SOURCE
#include "engine/engine_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

int engine_think_close(loom_engine *e, char *err, size_t err_size)
{
    static const char close[] = "\n</think>\n\n";
    if (e->think_close)
        return 0;
    int64_t n = loom_tokenizer_encode_continuation(e->tok, close, sizeof close - 1, 2, NULL, 0);
    if (n > 0 && (e->think_close = malloc((size_t)n * sizeof *e->think_close)))
        e->n_think_close = (int32_t)loom_tokenizer_encode_continuation(
            e->tok, close, sizeof close - 1, 2, e->think_close, n);
    if (!e->think_close || e->n_think_close <= 0) {
        snprintf(err, err_size, "cannot write the end of a thought in this vocabulary");
        return -1;
    }
    return 0;
}

/* Follows q's thought past the token whose bytes are piece: counts the thought's tokens while
 * it is open, and once a budget is spent starts forcing its closing tokens. */
static void thought_follow(ereq *q, const char *piece, int k)
{
    if (!q->reasoning || q->thought_closed)
        return;
    if (q->answer_len + (size_t)(k > 0 ? k : 0) + 1 > q->answer_cap) {
        size_t cap = 2 * (q->answer_len + (size_t)(k > 0 ? k : 0)) + 64;
        char *a = realloc(q->answer, cap);
        if (!a) {
            q->thought_closed = 1; /* out of memory: the thought is no longer followed */
            return;
        }
        q->answer = a, q->answer_cap = cap;
    }
    if (k > 0)
        memcpy(q->answer + q->answer_len, piece, (size_t)k), q->answer_len += (size_t)k;
    q->answer[q->answer_len] = 0;
    loom_reasoning r;
    loom_reasoning_find(q->answer, q->answer_len, q->reasoning == 2, 0, &r);
    if (!r.open) {
        q->thought_closed = 1;
        free(q->answer), q->answer = NULL, q->answer_len = q->answer_cap = 0;
        return;
    }
    if (q->forced)
        return; /* the closing tokens are not the model's thought */
    q->thought_tokens++;
    if (q->reasoning_budget > 0 && q->thought_tokens >= q->reasoning_budget)
        q->forcing = 0, q->forced = 1;
}

int engine_sample_next(loom_engine *e, ereq *q, float *logits)
{
    loom_model_mask_unsampled(e->model, logits);
    int32_t top_ids[LOOM_MAX_TOP_LOGPROBS];
    float top_lps[LOOM_MAX_TOP_LOGPROBS], log_z = 0;
    int32_t n_top = 0;
    if (q->logprobs) { /* the model's distribution, before penalties, grammar or sampling */
        if (!e->raw_logits && !(e->raw_logits = malloc((size_t)e->n_vocab * sizeof *logits))) {
            engine_remove_running(e, q);
            engine_retire(e, q, NULL, "out of memory");
            return 1;
        }
        memcpy(e->raw_logits, logits, (size_t)e->n_vocab * sizeof *logits);
        log_z = log_partition(logits, e->n_vocab, q->top_logprobs, top_ids, top_lps, &n_top);
    }
    int32_t next;
    if (q->forcing >= 0) { /* a spent thought budget: its closing tokens, whatever the model says */
        next = e->think_close[q->forcing++];
        if (q->forcing == e->n_think_close)
            q->forcing = -1;
    } else if (q->grammar) {
        char err[300];
        next = sample_constrained(e, q, logits, err, sizeof err);
        if (next < 0) { /* -1: the grammar is complete, so the answer is */
            engine_remove_running(e, q);
            q->invalid = next == -2 && !strstr(err, "out of memory");
            engine_retire(e, q, next == -1 ? "stop" : NULL, next == -1 ? NULL : err);
            return 1;
        }
    } else {
        next = loom_sampler_sample(logits, e->n_vocab, &q->sp, q->toks, q->n_toks, &q->rng);
    }
    if (q->n_generated == 0)
        q->ttft_ms = engine_now_ms() - q->s.t_submit;
    if ((!q->ignore_eos || q->grammar) && loom_tokenizer_is_stop(e->tok, next)) {
        engine_remove_running(e, q);
        engine_retire(e, q, "stop", NULL);
        return 1;
    }
    if (q->gm && grammar_accept(q->gm, next) != 0) { /* the sampler keeps to the mask */
        engine_remove_running(e, q);
        engine_retire(e, q, NULL, "internal: a token outside the grammar was sampled");
        return 1;
    }
    q->toks[q->n_toks++] = next;
    q->n_generated++;
    e->n_generated++;
    char piece[512];
    int k = (q->control_text ? loom_tokenizer_piece_control : loom_tokenizer_piece)(
        e->tok, q->toks[q->n_toks - 2], next, piece, sizeof piece);
    thought_follow(q, piece, k);
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
    engine_deliver(e, q, &ev);
    q->ts.n_out = 0;
    if (stop || q->n_generated >= q->max_tokens || q->n_toks >= e->n_ctx) {
        engine_remove_running(e, q);
        engine_retire(e, q, stop ? "stop" : "length", NULL);
        return 1;
    }
    return 0;
}

/* Adds n rows of final hidden states to an embedding request's pool. */
void engine_pool(loom_engine *e, ereq *q, const float *rows, int32_t n)
{
    if (q->n_pooled == 0)
        memset(q->pooled, 0, (size_t)e->n_embd * sizeof *q->pooled);
    loom_pool_add(q->pooled, rows, n, e->n_embd);
    q->n_pooled += n;
}

/* Ends an embedding request (its prompt computed): the mean of what it pooled (for "last",
 * one row), scaled to length one unless it asked otherwise. */
void engine_finish_embedding(loom_engine *e, ereq *q)
{
    loom_pool_result(q->pooled, q->n_pooled, e->n_embd, !q->embed_unnormalized, e->embedding);
    q->embedded = 1;
    engine_retire(e, q, "stop", NULL);
}
