/*
 * core/stage.c - a runner as one stage of a pipeline over processes (docs/DISTRIBUTED.md): which
 * weights a stage holds, how a model is cut into stages, and the plumbing around the executor
 * (core/runner.c): a step announced down the pipeline before it runs, a stage's hidden states
 * received from the one before and handed to the one after, and the logits sent back from the
 * last stage to the first, in parts of a step when the first stage splits it.
 */
#define _GNU_SOURCE
#include "runner_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>


/* The output head's tensors (GGUF names): the last stage's */
static int is_head(const char *name)
{
    return strncmp(name, "output.", 7) == 0 || strncmp(name, "output_norm.", 12) == 0;
}

int loom_runner_stage_holds(const loom_gguf *g, int32_t first, int32_t end, int has_prev,
                            int has_next, const char *name)
{
    int layer, used = 0;
    if (sscanf(name, "blk.%d.%n", &layer, &used) == 1 && used > 0)
        return layer >= first && layer < end;
    if (strcmp(name, "token_embd.weight") == 0)
        return !has_prev || (!has_next && !loom_gguf_find_tensor(g, "output.weight"));
    if (is_head(name))
        return !has_next;
    return 1;
}

int loom_runner_plan_stages(const loom_gguf *g, int32_t n_layer, int n_stages, int32_t *cut)
{
    uint64_t *layer = calloc((size_t)n_layer + 1, sizeof *layer), embd = 0, head = 0;
    if (!layer || n_stages < 1) {
        free(layer);
        return -1;
    }
    int tied = !loom_gguf_find_tensor(g, "output.weight");
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const loom_gguf_tensor *t = &g->tensors[i];
        int l, used = 0;
        if (sscanf(t->name, "blk.%d.%n", &l, &used) == 1 && used > 0 && l >= 0 && l < n_layer)
            layer[l] += t->size;
        else if (strcmp(t->name, "token_embd.weight") == 0)
            embd += t->size, head += tied ? t->size : 0;
        else if (is_head(t->name))
            head += t->size;
    }
    uint64_t total = embd + head;
    for (int32_t l = 0; l < n_layer; l++)
        total += layer[l];
    /* stage s + 1 starts at the first layer whose middle lies past (s + 1) / n_stages of the
     * bytes, counting the embeddings first and the head last */
    int s = 0;
    uint64_t before = embd;
    cut[0] = 0;
    for (int32_t l = 0; l < n_layer; l++) {
        while (s + 1 < n_stages &&
               (before + layer[l] / 2) * (uint64_t)n_stages > (uint64_t)(s + 1) * total)
            cut[++s] = l;
        before += layer[l];
    }
    while (s < n_stages)
        cut[++s] = n_layer;
    free(layer);
    return 0;
}

int loom_runner_is_last_stage(const loom_runner *r)
{
    return !r->opt.link || !r->opt.link->send;
}

/* The host copy of hidden states x, *count floats; NULL when the pass has failed already, or
 * is the census (which runs one token alone: no neighbour takes part). */
static float *handoff_space(loom_runner *r, const loom_tensor *x, uint64_t *count)
{
    if (r->status || r->census)
        return NULL;
    *count = (uint64_t)x->ne[0] * (uint64_t)x->ne[1];
    if (*count > r->handoff_cap) {
        float *h = realloc(r->handoff, (size_t)*count * sizeof *h);
        if (!h) {
            loom_runner_fail(r, "out of memory");
            return NULL;
        }
        r->handoff = h, r->handoff_cap = *count;
    }
    return r->handoff;
}

void loom_stage_receive(loom_runner *r, const loom_tensor *x)
{
    uint64_t count;
    float *h = handoff_space(r, x, &count);
    char err[400];
    const loom_backend_ops *ops = &r->dev->ops;
    if (!h)
        return;
    if (r->opt.link->recv(r->opt.link->ctx, h, count, err, sizeof err) != 0)
        loom_runner_fail(r, "receiving the hidden states for layer %d: %s", r->layer0, err);
    else if (ops->copy_from_host(r->dev->be, x->buf, x->offset, h, count * sizeof *h) != LOOM_OK)
        loom_runner_fail(r, "uploading the hidden states: %s", ops->last_error(r->dev->be));
}

/* A stage before the last: x goes to the next stage. */
void loom_stage_hand_on(loom_runner *r, const loom_tensor *x)
{
    uint64_t count;
    float *h = handoff_space(r, x, &count);
    char err[400];
    const loom_backend_ops *ops = &r->dev->ops;
    if (!h)
        return;
    if (ops->synchronize(r->dev->be) != LOOM_OK ||
        ops->copy_to_host(r->dev->be, h, x->buf, x->offset, count * sizeof *h) != LOOM_OK)
        loom_runner_fail(r, "reading the hidden states back: %s", ops->last_error(r->dev->be));
    else if (r->opt.link->send(r->opt.link->ctx, h, count, err, sizeof err) != 0)
        loom_runner_fail(r, "sending the hidden states after layer %d: %s", r->layer_end - 1, err);
}

/* The step on this stage: announced to the other stages first (a pipeline's first stage), run,
 * and on the last stage its logits sent to the first; a failure is passed on. Returns whether
 * the step was announced, so that its result will come back. */
static int announced_step(loom_runner *r, const loom_step *s)
{
    const loom_stage_link *ln = r->opt.link;
    char link_err[400];
    if (ln->announce_step && ln->announce_step(ln->ctx, s, link_err, sizeof link_err) != 0) {
        loom_runner_fail(r, "%s", link_err);
        return 0;
    }
    loom_runner_execute(r, s);
    uint64_t n_out = (uint64_t)s->n_logits * (uint64_t)r->hp.n_vocab;
    if (!r->status && ln->send_logits && loom_runner_is_last_stage(r) &&
        ln->send_logits(ln->ctx, r->logits, n_out, link_err, sizeof link_err) != 0)
        loom_runner_fail(r, "sending the logits: %s", link_err);
    if (r->status && ln->fail)
        ln->fail(ln->ctx, r->err);
    return ln->announce_step != NULL;
}

/* A pipeline's first stage: an announced step's logits, count floats, from the last stage, into
 * dst (NULL: the step failed here; its result is taken and dropped). */
static void take_result(loom_runner *r, float *dst, uint64_t count)
{
    char link_err[400];
    const loom_stage_link *ln = r->opt.link;
    if (ln->recv_logits(ln->ctx, dst, count, link_err, sizeof link_err) != 0 && !r->status)
        loom_runner_fail(r, "%s", link_err);
}

/* A pipeline's first stage with a step of several tokens: it goes down the pipeline in k parts
 * of consecutive tokens, each announced and sent on before the next is run here, so that stage
 * r + 1 works on part p while stage r runs part p + 1; then the parts' logits come back in
 * order. A part's keys may be a later part's context: every stage runs the parts in order, so
 * they are in its cache first. */
static void step_in_parts(loom_runner *r, const loom_step *s, int k)
{
    const int32_t n = s->n_tokens, nv = r->hp.n_vocab;
    k = k < n ? k : n;
    /* part p's logit rows (rebased to it) at rows[first[p]..first[p + 1]), and where each row's
     * logits go in the step's order at idx[] */
    int32_t *rows = malloc(((size_t)s->n_logits * 2 + (size_t)k + 2) * sizeof *rows);
    int32_t *idx = rows ? rows + s->n_logits : NULL, *first = idx ? idx + s->n_logits : NULL;
    float *part_logits = malloc((size_t)(s->n_logits ? s->n_logits : 1) * (size_t)nv *
                                sizeof(float));
    if (!rows || !part_logits) {
        free(rows), free(part_logits);
        loom_runner_fail(r, "out of memory");
        return;
    }
    int sent = 0;
    first[0] = 0;
    for (int p = 0; p < k && !r->status; p++) {
        int32_t t0 = (int32_t)((int64_t)n * p / k), t1 = (int32_t)((int64_t)n * (p + 1) / k);
        int32_t m = first[p];
        for (int32_t i = 0; i < s->n_logits; i++)
            if (s->logit_rows[i] >= t0 && s->logit_rows[i] < t1)
                rows[m] = s->logit_rows[i] - t0, idx[m++] = i;
        first[p + 1] = m;
        loom_step part = {
            t1 - t0,       s->ids + t0,    s->pos + t0,  s->seq + t0,     s->slots + t0, s->n_seqs,
            s->max_blocks, s->block_table, m - first[p], rows + first[p], NULL,          0,
            NULL,          NULL,           NULL};
        if (!announced_step(r, &part))
            break;
        sent++;
    }
    for (int p = 0; p < sent; p++) {
        int32_t m = first[p + 1] - first[p];
        take_result(r, r->status ? NULL : part_logits, (uint64_t)m * (uint64_t)nv);
        for (int32_t i = 0; !r->status && i < m; i++)
            memcpy(r->logits + (size_t)idx[first[p] + i] * (size_t)nv,
                   part_logits + (size_t)i * (size_t)nv, (size_t)nv * sizeof(float));
    }
    free(rows), free(part_logits);
}

void loom_stage_step(loom_runner *r, const loom_step *s)
{
    /* the first stage of a pipeline across processes: the logits come from the last stage */
    int first_of_many = r->opt.link->recv_logits && !loom_runner_is_last_stage(r);
    if (first_of_many && r->opt.micro_batches > 1 && s->n_tokens > 1 && !s->prefix_len)
        step_in_parts(r, s, r->opt.micro_batches);
    else if (announced_step(r, s) && first_of_many)
        take_result(r, r->status ? NULL : r->logits,
                    (uint64_t)s->n_logits * (uint64_t)r->hp.n_vocab);
}
