/*
 * core/recurrent.c - the state of recurrent layers (Gated DeltaNet), beside the paged KV cache.
 *
 * A recurrent layer remembers a sequence in a fixed-size state instead of keys and values that
 * grow with it: a conv window and a delta-rule matrix per value head. The runner keeps one per
 * held recurrent layer for each of opt.state_slots sequences ([slots, ...] tensors, the ops'
 * `seq` picking the slot). A state cannot be rewound or shared the way KV blocks can, so its
 * use is checked: a sequence whose first token in a step is at position 0 starts from a zeroed
 * slot; at any other position its slot must have reached exactly that position in an earlier
 * step. Anything else (a cached prefix reused, a rejected draft not rolled back, a step that
 * failed halfway) would run on a wrong state and return plausible garbage, so it is an error.
 * The verbs of those layers (ssm_conv and gated_delta over a layer's state) are here too.
 */
#include "runner_internal.h"

#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static loom_tensor dense4(loom_buffer *b, uint64_t offset, int64_t n0, int64_t n1, int64_t n2,
                          int64_t n3)
{
    loom_tensor t = {.buf = b, .offset = offset, .dtype = LOOM_F32, .n_dims = 4};
    int64_t ne[4] = {n0, n1, n2, n3};
    memcpy(t.ne, ne, sizeof ne);
    t.nb[0] = 4;
    for (int i = 1; i < 4; i++)
        t.nb[i] = t.nb[i - 1] * (uint64_t)t.ne[i - 1];
    return t;
}

int loom_recurrent_alloc(loom_runner *r, char *err, size_t err_size)
{
    const loom_hparams *hp = &r->hp;
    int held = 0;
    for (int l = r->layer0; l < r->layer_end; l++)
        held += loom_layer_recurrent(hp, l);
    int any = 0;
    for (int l = 0; l < hp->n_layer; l++)
        any |= loom_layer_recurrent(hp, l);
    if (!any || (!held && !r->opt.link)) /* a drafter of attention layers alone keeps none */
        return 0;
    if (hp->ssm_conv_kernel < 2 || hp->ssm_conv_kernel > 64 || hp->ssm_conv_channels <= 0 ||
        hp->ssm_v_heads <= 0 || hp->ssm_d_k <= 0 || hp->ssm_d_v <= 0 ||
        (int64_t)hp->ssm_v_heads * hp->ssm_d_k * hp->ssm_d_v > ((int64_t)1 << 30)) {
        snprintf(err, err_size,
                 "%s: recurrent layers with conv kernel %d over %d channels and %d heads of "
                 "%d x %d: the kernel must be 2 to 64 and the rest above 0 (ssm.conv_kernel, "
                 "ssm.state_size, ssm.time_step_rank, ssm.inner_size)",
                 hp->arch, hp->ssm_conv_kernel, hp->ssm_conv_channels, hp->ssm_v_heads, hp->ssm_d_k,
                 hp->ssm_d_v);
        return -1;
    }
    if (r->opt.link) {
        snprintf(err, err_size,
                 "%s has recurrent layers, whose state loom does not yet carry across a pipeline "
                 "of processes; run it in one process",
                 hp->arch);
        return -1;
    }
    r->n_state_slots = r->opt.state_slots > 0 ? r->opt.state_slots
        : r->opt.kv_sequences > 0             ? 3 * r->opt.kv_sequences
                                              : 2;
    const uint64_t conv = (uint64_t)(hp->ssm_conv_kernel - 1) * (uint64_t)hp->ssm_conv_channels * 4;
    const uint64_t delta = (uint64_t)hp->ssm_v_heads * (uint64_t)hp->ssm_d_k *
        (uint64_t)hp->ssm_d_v * 4;
    r->state_bytes = (conv + delta) * (uint64_t)held;
    uint64_t total = r->state_bytes * (uint64_t)r->n_state_slots;
    r->conv_state = calloc((size_t)hp->n_layer, sizeof *r->conv_state);
    r->delta_state = calloc((size_t)hp->n_layer, sizeof *r->delta_state);
    r->state_next = malloc((size_t)r->n_state_slots * sizeof *r->state_next);
    if (!r->conv_state || !r->delta_state || !r->state_next) {
        snprintf(err, err_size, "out of memory");
        return -1;
    }
    for (int32_t i = 0; i < r->n_state_slots; i++)
        r->state_next[i] = -1;
    if (held && r->dev->ops.buffer_alloc(r->dev->be, total, &r->states) != LOOM_OK) {
        snprintf(err, err_size,
                 "out of memory on %s for the recurrent state of %d sequences (%llu bytes, %llu "
                 "each): %s",
                 r->dev->name, r->n_state_slots, (unsigned long long)total,
                 (unsigned long long)r->state_bytes, r->dev->ops.last_error(r->dev->be));
        return -1;
    }
    /* layer by layer, all slots of one layer's conv state, then its delta state */
    uint64_t at = 0, slots = (uint64_t)r->n_state_slots;
    for (int l = r->layer0; l < r->layer_end; l++) {
        if (!loom_layer_recurrent(hp, l))
            continue;
        r->conv_state[l] = dense4(r->states, at, hp->ssm_conv_channels, hp->ssm_conv_kernel - 1,
                                  r->n_state_slots, 1);
        at += conv * slots;
        r->delta_state[l] = dense4(r->states, at, hp->ssm_d_k, hp->ssm_d_v, hp->ssm_v_heads,
                                   r->n_state_slots);
        at += delta * slots;
    }
    assert(at == total);
    return 0;
}

void loom_recurrent_free(loom_runner *r)
{
    if (r->states)
        r->dev->ops.buffer_free(r->dev->be, r->states);
    free(r->conv_state), free(r->delta_state), free(r->state_next), free(r->token_slots);
}

/* Where slot's part of layer l's state lies in r->states: its conv window (part 0) or its
 * delta-rule state (part 1). */
static void slot_part(const loom_runner *r, int l, int part, int32_t slot, uint64_t *off,
                      uint64_t *size)
{
    const loom_tensor *t = part ? &r->delta_state[l] : &r->conv_state[l];
    *size = t->nb[part ? 3 : 2]; /* the slot dimension's stride: one slot */
    *off = t->offset + *size * (uint64_t)slot;
}

/* Zeroes slot's part of every held layer's state. */
static int zero_slot(loom_runner *r, int32_t slot)
{
    const loom_backend_ops *ops = &r->dev->ops;
    for (int l = r->layer0; l < r->layer_end; l++) {
        if (!loom_layer_recurrent(&r->hp, l))
            continue;
        for (int part = 0; part < 2; part++) {
            uint64_t off, size;
            slot_part(r, l, part, slot, &off, &size);
            loom_status st;
            if (ops->buffer_memset) {
                st = ops->buffer_memset(r->dev->be, r->states, off, 0, size);
            } else {
                void *zeros = calloc(1, (size_t)size);
                st = zeros ? ops->copy_from_host(r->dev->be, r->states, off, zeros, size)
                           : LOOM_ERR_OUT_OF_MEMORY;
                free(zeros);
            }
            if (st != LOOM_OK)
                return loom_runner_fail(r, "clearing a sequence's recurrent state on %s: %s",
                                        r->dev->name, ops->last_error(r->dev->be));
        }
    }
    return 0;
}

int loom_recurrent_begin(loom_runner *r, const loom_step *s)
{
    if (!r->n_state_slots)
        return 0;
    if (!s->state_slots && s->n_seqs > 1)
        return loom_runner_fail(r,
                                "a step of %d sequences of a model with recurrent layers "
                                "needs each sequence's state slot",
                                s->n_seqs);
    /* the tokens' slots, then per sequence its last position seen in the step (-1: none) */
    int32_t *slots = realloc(r->token_slots, (size_t)(s->n_tokens + s->n_seqs) * sizeof *slots);
    if (!slots)
        return loom_runner_fail(r, "out of memory");
    r->token_slots = slots;
    int32_t *last = slots + s->n_tokens;
    for (int32_t q = 0; q < s->n_seqs; q++)
        last[q] = -1;
    /* each sequence's first token in the step decides its slot's fate; the rest follow it */
    for (int32_t t = 0; t < s->n_tokens; t++) {
        int32_t q = s->seq[t], slot = s->state_slots ? s->state_slots[q] : 0;
        if (slot < 0 || slot >= r->n_state_slots)
            return loom_runner_fail(r,
                                    "sequence %d's recurrent-state slot %d is outside the %d "
                                    "the runner holds",
                                    q, slot, r->n_state_slots);
        slots[t] = slot;
        if (last[q] >= 0) {
            if (s->pos[t] != last[q] + 1)
                return loom_runner_fail(r,
                                        "sequence %d's tokens in a step must follow each "
                                        "other (position %d after %d)",
                                        q, s->pos[t], last[q]);
            last[q] = s->pos[t];
            continue;
        }
        last[q] = s->pos[t];
        if (s->pos[t] == 0) {
            if (zero_slot(r, slot) != 0)
                return -1;
        } else if (s->pos[t] != r->state_next[slot]) {
            return loom_runner_fail(
                r,
                "sequence %d continues at position %d, but its recurrent state (slot %d) is "
                "%s: a model with recurrent layers cannot reuse a cached prefix or rewind "
                "(start it again from position 0)",
                q, s->pos[t], slot, r->state_next[slot] < 0 ? "empty" : "at another position");
        }
    }
    return 0;
}

void loom_recurrent_end(loom_runner *r, const loom_step *s, int ok)
{
    if (!r->n_state_slots || !r->token_slots)
        return;
    /* a failed step may have run some layers: its sequences' states are unusable */
    for (int32_t t = 0; t < s->n_tokens; t++)
        r->state_next[r->token_slots[t]] = ok ? s->pos[t] + 1 : -1;
}

int32_t loom_runner_state_slots(const loom_runner *r)
{
    return r->n_state_slots;
}

uint64_t loom_runner_state_bytes(const loom_runner *r)
{
    return r->state_bytes;
}

int32_t loom_runner_state_position(const loom_runner *r, int32_t slot)
{
    return slot >= 0 && slot < r->n_state_slots ? r->state_next[slot] : -1;
}

int loom_runner_state_copy(loom_runner *r, int32_t from, int32_t to, char *err, size_t err_size)
{
    if (from < 0 || from >= r->n_state_slots || to < 0 || to >= r->n_state_slots) {
        snprintf(err, err_size, "copying recurrent state slot %d to %d: the runner holds %d", from,
                 to, r->n_state_slots);
        return -1;
    }
    if (from == to)
        return 0;
    const loom_backend_ops *ops = &r->dev->ops;
    for (int l = r->layer0; l < r->layer_end; l++) {
        if (!loom_layer_recurrent(&r->hp, l))
            continue;
        for (int part = 0; part < 2; part++) {
            uint64_t src, dst, size;
            slot_part(r, l, part, from, &src, &size);
            slot_part(r, l, part, to, &dst, &size);
            loom_status st;
            if (ops->copy_buffer) {
                st = ops->copy_buffer(r->dev->be, r->states, dst, r->states, src, size);
            } else {
                void *staging = malloc((size_t)size);
                st = staging ? ops->copy_to_host(r->dev->be, staging, r->states, src, size)
                             : LOOM_ERR_OUT_OF_MEMORY;
                if (st == LOOM_OK)
                    st = ops->copy_from_host(r->dev->be, r->states, dst, staging, size);
                free(staging);
            }
            if (st != LOOM_OK) {
                snprintf(err, err_size, "copying recurrent state slot %d to %d on %s: %s", from, to,
                         r->dev->name, ops->last_error(r->dev->be));
                r->state_next[to] = -1;
                return -1;
            }
        }
    }
    r->state_next[to] = r->state_next[from];
    return 0;
}

/* ---- The verbs of recurrent layers ----------------------------------------------------- */

/* Whether layer is a recurrent one this runner holds (its state is here). */
static int holds_state(loom_runner *r, int layer, const char *what)
{
    if (layer >= r->layer0 && layer < r->layer_end && loom_layer_recurrent(&r->hp, layer) &&
        r->n_state_slots)
        return 1;
    loom_runner_fail(r, "%s over layer %d, which is not a recurrent layer this runner holds", what,
                     layer);
    return 0;
}

void loom_rt_ssm_conv(loom_runner *r, int layer, const loom_tensor *x, const loom_tensor *weight,
                      const loom_tensor *dst)
{
    if (r->status || !holds_state(r, layer, "ssm_conv") || !loom_runner_held(r, weight, "ssm_conv"))
        return;
    loom_ssm_conv_params p = {sizeof p, x, weight, &r->in.state_slots, &r->conv_state[layer], dst};
    loom_runner_exec_op(r, LOOM_OP_SSM_CONV, weight->dtype, "ssm_conv", &p);
}

void loom_rt_gated_delta(loom_runner *r, int layer, const loom_tensor *q, const loom_tensor *k,
                         const loom_tensor *v, const loom_tensor *alpha, const loom_tensor *beta,
                         const loom_tensor *a, const loom_tensor *dt_bias, int v_heads_tiled,
                         const loom_tensor *dst)
{
    if (r->status || !holds_state(r, layer, "gated_delta"))
        return;
    loom_gated_delta_params p = {.struct_size = sizeof p,
                                 .q = q,
                                 .k = k,
                                 .v = v,
                                 .alpha = alpha,
                                 .beta = beta,
                                 .a = a,
                                 .dt_bias = dt_bias,
                                 .seq = &r->in.state_slots,
                                 .state = &r->delta_state[layer],
                                 .dst = dst,
                                 .v_heads_tiled = v_heads_tiled != 0};
    loom_runner_exec_op(r, LOOM_OP_GATED_DELTA, LOOM_F32, "gated_delta", &p);
}
