/*
 * engine/draft.c - speculative proposals: how many a request may make, and the drafter
 * model's (loom_engine_options.draft), run over its own KV blocks. A drafter that is the
 * model's multi-token-prediction block (the engine's mtp) takes at position p the model's final
 * state there beside the id at p + 1 (run_step keeps each request's states for it), so its
 * sequence runs one position behind the text, from the first position it had a state for.
 */
#define _GNU_SOURCE
#include "engine/engine_internal.h"

#include <assert.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* How many proposals q checks this step, at most room: the j-th is worth a token row when it
 * is kept with probability a^j >= tau, a from q's recent proposals; tau grows with the batch,
 * from 0.25 alone to 0.8 at 8 running and more, as extra rows stop being nearly free once a
 * step computes rather than streams weights. After 16 steps without proposals it tries one
 * again, so text that became predictable is noticed. */
int32_t engine_proposals_wanted(loom_engine *e, ereq *q, int32_t room)
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

/* One batched step of the drafter model over the requests who[0..n), counts[i] tokens each
 * from the end of their drafter cache: from their text (from_text), else their last proposal;
 * a logit row after the last of each where want_row[i]. An MTP drafter's token at p of its
 * sequence is the text's at mtp_base + p + 1 beside the model's state at mtp_base + p, or its
 * last proposal beside its own last state. 0, or -1 with err. */
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
            int32_t p = q->dkv.n_tokens + j, at = e->mtp ? q->mtp_base + p + 1 : p;
            ids[t] = from_text ? q->toks[at] : q->draft[q->n_draft - 1];
            pos[t] = p, seq[t] = i;
            slots[t] = loom_kvblocks_slot(e->dkv, &q->dkv, p);
            if (e->mtp) {
                const float *state = from_text ? loom_mtp_states_at(&q->mtp, at - 1) : q->mtp_own;
                assert(state);
                memcpy(e->dstates + (size_t)t * (size_t)e->n_embd, state,
                       (size_t)e->n_embd * sizeof *state);
            }
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
                    .logit_rows = rows,
                    /* an MTP drafter's own states after its rows chain its next proposals */
                    .n_hidden = e->mtp ? n_rows : 0,
                    .hidden_rows = rows,
                    .hidden_in = e->mtp ? e->dstates : NULL};
    if (loom_runner_step(e->drunner, &st, err, err_size) != 0)
        return -1;
    for (int i = 0, r = 0; e->mtp && i < n; i++)
        if (want_row[i])
            memcpy(who[i]->mtp_own,
                   loom_runner_hidden(e->drunner) + (size_t)r++ * (size_t)e->n_embd,
                   (size_t)e->n_embd * sizeof(float));
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
void engine_run_drafter(loom_engine *e, planned *plan, int n_plan)
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
        /* an MTP block takes the states as they come, prompts too, so that few wait */
        if (!q->want && !(e->mtp && q->use_draft))
            continue;
        int32_t missing = q->n_toks - q->dkv.n_tokens;
        if (e->mtp) { /* the pairs up to the pending token's position, whose states it has */
            if (q->dkv.n_tokens == 0)
                q->mtp_base = q->mtp.from;
            const int32_t have = q->mtp.from + q->mtp.n; /* pairs end before the last state */
            missing = (q->n_toks - 1 < have ? q->n_toks - 1 : have) - q->mtp_base - q->dkv.n_tokens;
            if (!loom_mtp_states_at(&q->mtp, q->mtp_base + q->dkv.n_tokens))
                missing = 0; /* states lost (out of memory): none until it has them again */
        }
        int32_t feed = missing < budget ? missing : budget;
        loom_kvcopy none[1];
        if (feed <= 0 ||
            loom_kvblocks_reserve(e->dkv, &q->dkv, feed + q->want - (q->want > 0), none) < 0)
            continue; /* (its plan shrinks below, to the pending token) */
        budget -= feed;
        who[n] = q, counts[n] = feed;
        rows[n] = q->want && feed == missing &&
            q->mtp_base + q->dkv.n_tokens + feed == (e->mtp ? q->n_toks - 1 : q->n_toks);
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
        /* what an MTP block ran on its own states does not stand: the model's replace them */
        if (e->mtp && q->use_draft && q->dkv.n_tokens > q->n_toks - 1 - q->mtp_base)
            loom_kvblocks_truncate(&q->dkv, q->n_toks - 1 - q->mtp_base);
        if (e->mtp && q->use_draft) /* the states taken go, but the last pair's */
            loom_mtp_states_drop_before(&q->mtp, q->mtp_base + q->dkv.n_tokens - 1);
    }
}

/* The drafter model of o, checked against the engine's model; 0, or -1 with err. */
int engine_start_drafter(loom_engine *e, const loom_engine_options *o, char *err, size_t err_size)
{
    loom_speculation check = {.draft = o->draft};
    if (loom_speculation_check(e->model, &check, err, err_size) != 0)
        return -1;
    e->mtp = loom_model_draft_cache(o->draft)->mtp; /* the model's own, checked above */
    if (e->mtp && !(e->dstates = malloc((size_t)e->max_step * (size_t)e->n_embd * sizeof(float)))) {
        snprintf(err, err_size, "out of memory");
        return -1;
    }
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
