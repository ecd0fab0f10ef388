/* api/embed.c - embeddings: a prompt's final hidden states (after the model's final norm,
 * before its head) pooled into one vector, for one prompt here (loom_embed) and for the
 * engine's embedding requests, which share the pooling arithmetic below. */
#include "api/internal.h"

#include "../core/runner.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void loom_pool_add(double *sum, const float *rows, int32_t n, int32_t n_embd)
{
    for (int32_t r = 0; r < n; r++)
        for (int32_t d = 0; d < n_embd; d++)
            sum[d] += rows[(size_t)r * (size_t)n_embd + (size_t)d];
}

void loom_pool_result(const double *sum, int32_t n_pooled, int32_t n_embd, int normalize,
                      float *out)
{
    double norm = 0;
    for (int32_t d = 0; d < n_embd; d++) {
        double v = sum[d] / n_pooled;
        norm += v * v;
    }
    double scale = (normalize && norm > 0 ? 1 / sqrt(norm) : 1) / n_pooled;
    for (int32_t d = 0; d < n_embd; d++)
        out[d] = (float)(sum[d] * scale);
}

typedef struct pooling {
    double *sum;
    int32_t n_embd, n_pooled;
} pooling;

static void add_rows(void *user, const float *rows, int32_t n)
{
    pooling *p = user;
    loom_pool_add(p->sum, rows, n, p->n_embd);
    p->n_pooled += n;
}

int loom_embed(loom_model *m, const int32_t *ids, int32_t n, loom_pooling how, int normalize,
               float *out, char *err, size_t err_size)
{
    if (how != LOOM_POOL_LAST && how != LOOM_POOL_MEAN) {
        snprintf(err, err_size, "pooling %d is not LOOM_POOL_LAST or LOOM_POOL_MEAN", (int)how);
        return -1;
    }
    if (loom_model_check_ids(m, ids, n, err, err_size) != 0)
        return -1;
    pooling p = {calloc((size_t)loom_model_n_embd(m), sizeof *p.sum), loom_model_n_embd(m), 0};
    if (!p.sum) {
        snprintf(err, err_size, "out of memory");
        return -1;
    }
    loom_model_draft_cache(m)->n = 0; /* the sequence's cache holds this prompt now */
    int rc = loom_runner_eval_hidden(loom_model_runner(m), ids, n, how == LOOM_POOL_MEAN, add_rows,
                                     &p, err, err_size);
    if (rc == 0)
        loom_pool_result(p.sum, p.n_pooled, p.n_embd, normalize, out);
    free(p.sum);
    return rc;
}
