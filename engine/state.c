/*
 * engine/state.c - a hybrid model's recurrent state in the engine: each running request's
 * slot, the snapshots at prompts' block boundaries that let a later prompt resume from a
 * shared prefix, and the rollback of a checked step's rejected proposals.
 */
#define _GNU_SOURCE
#include "engine/engine_internal.h"

#include <assert.h>
#include <string.h>

/* A free state slot for q as it starts running (there is one: max_batch <= the slots), with
 * the snapshot its matched prefix resumes from copied in. A copy that fails leaves the slot
 * empty, which the runner refuses to continue from: the request then fails with that. */
void engine_take_state_slot(loom_engine *e, ereq *q)
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
int32_t engine_snapshot_hit(loom_engine *e, ereq *q, int32_t hit)
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
void engine_take_snapshot(loom_engine *e, ereq *q)
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
int32_t engine_to_boundary(const loom_engine *e, const ereq *q, int32_t k)
{
    int32_t boundary = q->n_prompt / e->bs * e->bs, at = q->kv.n_tokens;
    return e->n_snapshots && at < boundary && at + k > boundary ? boundary - at : k;
}

/* Recurrent layers ran every proposal of the step just taken, kept or not, and their state
 * cannot be cut back: each of who[0..n) goes back to its checkpoint (taken before the step, at
 * the position of its pending token then) and runs again the tokens it kept from there, whose
 * K/V are rewritten with the same values. A request whose replay fails ends with the error. */
void engine_replay_kept(loom_engine *e, ereq **who, int n, int32_t *buf)
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
    loom_step st = {n_tok, ids,  pos,  seq, slots, n,     max_blocks, table,
                    0,     NULL, NULL, 0,   NULL,  state, NULL};
    if (rc == 0)
        rc = loom_runner_step(e->runner, &st, err, sizeof err);
    for (int i = 0; rc != 0 && i < n; i++) {
        engine_remove_running(e, who[i]);
        engine_retire(e, who[i], NULL, err);
    }
}
