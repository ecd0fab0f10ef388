/*
 * backends/cpu/cpu_moe.c - the mixture-of-experts ops (ABI 1.5): routing, the per-expert
 * matmul and the weighted combination.
 *
 * matmul_id groups the (token, slot) rows by expert and runs each expert's rows as one matmul
 * (cpu_matmul, so every weight type and kernel applies): the rows of an expert are gathered
 * into a dense block and the results scattered back, except where an expert has one row, the
 * decode step's case, which runs on views without a copy. A stack cpu_prepare_weight prepared
 * (ABI 1.6) gives each expert as a prepared weight of its own (cpu_prepared_expert), so the
 * interleaved kernels run the experts as they run dense weights. A call that busies at least
 * two experts per thread (a prefill chunk, a decode step's k experts) gives each thread whole
 * experts instead of splitting every expert's matmul between them, and x's rows are quantised
 * once a call for the kernels that take blocks, not once for every expert a token goes to.
 */
#define _GNU_SOURCE
#include "cpu.h"
#include "ops.h"
#include "kern.h"
#include "rows.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define NO_MEMORY(be) cpu_fail(CB(be), LOOM_ERR_OUT_OF_MEMORY, "out of host memory")

static int32_t id_at(const loom_tensor *ids, int64_t t, int64_t j)
{
    int32_t v;
    memcpy(&v, cpu_row(ids, base(ids), t) + (uint64_t)j * ids->nb[0], 4);
    return v;
}

/* ---- moe_route ------------------------------------------------------------------------- */

loom_status cpu_moe_route(loom_backend *be, const loom_moe_route_params *p)
{
    CHECK_ARGS(be, loom_check_moe_route(p));
    TRY(cpu_check_bounds(CB(be), p->logits, "moe_route logits"));
    TRY(cpu_check_bounds(CB(be), p->ids, "moe_route ids"));
    TRY(cpu_check_bounds(CB(be), p->weights, "moe_route weights"));
    if (p->bias)
        TRY(cpu_check_bounds(CB(be), p->bias, "moe_route bias"));
    int64_t E = p->logits->ne[0], k = p->ids->ne[0], T = loom_tensor_rows(p->logits);
    int32_t groups, kept;
    loom_moe_route_groups(p, &groups, &kept);
    float *score = malloc((size_t)E * 2 * sizeof *score), *choice = score + E;
    char *taken = malloc((size_t)E);
    unsigned char *keep = malloc((size_t)groups);
    if (!score || !taken || !keep) {
        free(score), free(taken), free(keep);
        return NO_MEMORY(be);
    }
    const float *bias = p->bias ? (const float *)cpu_row(p->bias, base(p->bias), 0) : NULL;
    for (int64_t t = 0; t < T; t++) {
        const float *logit = (const float *)cpu_row(p->logits, base(p->logits), t);
        float max = logit[0];
        for (int64_t e = 1; e < E; e++)
            max = logit[e] > max ? logit[e] : max;
        double sum = 0;
        for (int64_t e = 0; e < E; e++) {
            score[e] = p->gating == LOOM_MOE_SOFTMAX ? expf(logit[e] - max)
                                                     : 1.0f / (1.0f + expf(-logit[e]));
            sum += score[e];
        }
        for (int64_t e = 0; e < E; e++) {
            if (p->gating == LOOM_MOE_SOFTMAX)
                score[e] = (float)(score[e] / sum);
            choice[e] = bias ? score[e] + bias[e] : logit[e];
        }
        memset(taken, 0, (size_t)E);
        if (groups > 1) { /* the experts outside the best groups count as taken */
            loom_moe_groups_kept(choice, E, groups, kept, keep);
            for (int64_t e = 0; e < E; e++)
                taken[e] = !keep[e / (E / groups)];
        }
        int32_t *ids = (int32_t *)cpu_row(p->ids, base(p->ids), t);
        float *w = (float *)cpu_row(p->weights, base(p->weights), t);
        double chosen = 0;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) /* the first of equals wins: the lower index */
                if (!taken[e] && (best < 0 || choice[e] > choice[best]))
                    best = e;
            taken[best] = 1;
            int32_t id = (int32_t)best;
            memcpy((unsigned char *)ids + (uint64_t)j * p->ids->nb[0], &id, 4);
            chosen += score[best];
        }
        for (int64_t j = 0; j < k; j++) {
            double s = score[id_at(p->ids, t, j)];
            *(float *)((unsigned char *)w + (uint64_t)j * p->weights->nb[0]) =
                (float)(s / (p->normalize ? chosen : 1.0) * p->scale);
        }
    }
    free(score), free(taken), free(keep);
    return LOOM_OK;
}

/* ---- matmul_id ------------------------------------------------------------------------- */

/* A dense [rows, n] f32 block in a buffer of its own (the gathered rows of one expert). */
static loom_tensor dense_f32(struct loom_buffer *b, int64_t n, int64_t rows)
{
    loom_tensor t = {.buf = b, .dtype = LOOM_F32, .n_dims = 2, .ne = {n, rows, 1, 1}};
    t.nb[0] = sizeof(float);
    t.nb[1] = (uint64_t)n * sizeof(float);
    t.nb[2] = t.nb[3] = t.nb[1] * (uint64_t)rows;
    return t;
}

/* Row r of a 3-D activation [tokens, slots, n] as a one-row matrix. */
static loom_tensor one_row(const loom_tensor *t, int64_t token, int64_t slot)
{
    loom_tensor v = *t;
    v.offset += (uint64_t)token * t->nb[2] + (uint64_t)slot * t->nb[1];
    v.ne[1] = v.ne[2] = v.ne[3] = 1;
    v.n_dims = 2;
    return v;
}

/* What every expert's matmul of one matmul_id call shares. */
typedef struct id_job {
    cpu_backend *cb;
    const loom_matmul_id_params *p;
    int64_t K, N, k, most;  /* most: the rows of the busiest expert */
    int per_slot;           /* x has a row per (token, slot), not one per token */
    const int64_t *start;   /* expert e's rows are order[start[e] .. start[e + 1]) */
    const int64_t *order;   /* (token, slot) pairs as t * k + j, by expert */
    const int64_t *by_size; /* the experts with rows, the busiest first */
    int64_t n_busy;
    act_block *xq;     /* x's rows quantised once (cpu_matmul_takes_blocks), or NULL */
    atomic_long next;  /* the next index into by_size a thread takes */
    atomic_int failed; /* a thread's matmul failed (out of memory) */
} id_job;

/* x's row of pair r (token r / k, slot r % k) */
static int64_t x_row(const id_job *j, int64_t r)
{
    return j->per_slot ? r : r / j->k;
}

/* x's rows quantised once, rather than once for each expert a token goes to */
static void quantise_rows(void *ctx, int ith, int nth)
{
    const id_job *j = ctx;
    const int64_t slots = j->per_slot ? j->k : 1, nb = j->K / LOOM_QK;
    long r0, r1;
    pool_split((long)(loom_tensor_rows(j->p->ids) * slots), ith, nth, &r0, &r1);
    for (long r = r0; r < r1; r++) {
        loom_tensor src = one_row(j->p->x, r / slots, r % slots);
        kern_prep_blocks((const float *)(base(&src) + src.offset), j->K, j->xq + r * nb);
    }
}

/* Expert e's rows: a one-row view where it has one (decode), else gathered into xs and the
 * results scattered back; on the pool's threads (shared) or on the calling one. With x's rows
 * quantised (j->xq), their blocks are what is gathered, and x gives the matmul only its shape. */
static loom_status run_expert(const id_job *j, int64_t e, float *xs, int shared)
{
    const loom_matmul_id_params *p = j->p;
    const int64_t K = j->K, N = j->N, k = j->k, n_rows = j->start[e + 1] - j->start[e];
    const int64_t *rows = j->order + j->start[e];
    loom_tensor w = *p->w; /* expert e's [N, K] matrix */
    struct loom_buffer expert;
    w.ne[2] = 1;
    w.n_dims = 2;
    if (p->w->buf->prepared) { /* its own prepared weight */
        cpu_prepared_expert(p->w, e, &expert);
        w.buf = &expert;
        w.offset = 0;
        w.nb[2] = w.nb[3] = w.nb[1] * (uint64_t)N;
    } else {
        w.offset += (uint64_t)e * p->w->nb[2];
    }
    loom_backend *be = &j->cb->base;
    if (j->xq && !shared) {
        const int64_t nb = K / LOOM_QK;
        const act_block *xq = j->xq + x_row(j, rows[0]) * nb;
        if (n_rows > 1) {
            act_block *gathered = (act_block *)(void *)xs;
            for (int64_t i = 0; i < n_rows; i++)
                memcpy(gathered + i * nb, j->xq + x_row(j, rows[i]) * nb,
                       (size_t)nb * sizeof *gathered);
            xq = gathered;
        }
        /* one row (decode) goes straight to its place in y; several are scattered after */
        float *ys = n_rows > 1 ? xs + n_rows * K : NULL;
        struct loom_buffer shape_only = {.size = (uint64_t)(n_rows * K) * 4};
        struct loom_buffer yb = {.data = (unsigned char *)ys, .size = (uint64_t)(n_rows * N) * 4};
        loom_tensor x = dense_f32(&shape_only, K, n_rows),
                    y = ys ? dense_f32(&yb, N, n_rows) : one_row(p->y, rows[0] / k, rows[0] % k);
        loom_matmul_params mp = {sizeof mp, &x, &w, NULL, &y};
        loom_status st = cpu_matmul_alone(j->cb, &mp, xq);
        for (int64_t i = 0; ys && i < n_rows && st == LOOM_OK; i++) {
            loom_tensor dst = one_row(p->y, rows[i] / k, rows[i] % k);
            memcpy(base(&dst) + dst.offset, ys + i * N, (size_t)N * sizeof *ys);
        }
        return st;
    }
    if (n_rows == 1) {
        loom_tensor x = one_row(p->x, rows[0] / k, j->per_slot ? rows[0] % k : 0),
                    y = one_row(p->y, rows[0] / k, rows[0] % k);
        loom_matmul_params mp = {sizeof mp, &x, &w, NULL, &y};
        return shared ? cpu_matmul(be, &mp) : cpu_matmul_alone(j->cb, &mp, NULL);
    }
    struct loom_buffer xb = {.data = (unsigned char *)xs, .size = (uint64_t)(n_rows * K) * 4};
    struct loom_buffer yb = {.data = (unsigned char *)(xs + n_rows * K),
                             .size = (uint64_t)(n_rows * N) * 4};
    for (int64_t i = 0; i < n_rows; i++) {
        loom_tensor src = one_row(p->x, rows[i] / k, j->per_slot ? rows[i] % k : 0);
        memcpy(xs + i * K, base(&src) + src.offset, (size_t)K * sizeof *xs);
    }
    loom_tensor x = dense_f32(&xb, K, n_rows), y = dense_f32(&yb, N, n_rows);
    loom_matmul_params mp = {sizeof mp, &x, &w, NULL, &y};
    loom_status st = shared ? cpu_matmul(be, &mp) : cpu_matmul_alone(j->cb, &mp, NULL);
    for (int64_t i = 0; i < n_rows && st == LOOM_OK; i++) {
        loom_tensor dst = one_row(p->y, rows[i] / k, rows[i] % k);
        memcpy(base(&dst) + dst.offset, xs + n_rows * K + i * N, (size_t)N * sizeof *xs);
    }
    return st;
}

/* A pool thread takes whole experts, the busiest first, until none is left: no expert's
 * matmul is split between threads, so none waits at a barrier for the other's half. */
static void experts_on_threads(void *ctx, int ith, int nth)
{
    id_job *j = ctx;
    (void)ith, (void)nth;
    float *xs = j->most > 1 ? malloc((size_t)(j->most * (j->K + j->N)) * sizeof *xs) : NULL;
    if (j->most > 1 && !xs) {
        atomic_store(&j->failed, 1);
        return;
    }
    for (long i; (i = atomic_fetch_add(&j->next, 1)) < j->n_busy && !atomic_load(&j->failed);)
        if (run_expert(j, j->by_size[i], xs, 0) != LOOM_OK)
            atomic_store(&j->failed, 1);
    free(xs);
}

/* descending: the busiest expert first (keys are rows << 32 | ~e: the lower e first on ties) */
static int descending(const void *a, const void *b)
{
    uint64_t ka = *(const uint64_t *)a, kb = *(const uint64_t *)b;
    return (ka < kb) - (ka > kb);
}

loom_status cpu_matmul_id(loom_backend *be, const loom_matmul_id_params *p)
{
    CHECK_ARGS(be, loom_check_matmul_id(p));
    TRY(cpu_check_bounds(CB(be), p->x, "matmul_id x"));
    struct loom_buffer expert;
    if (p->w->buf && p->w->buf->prepared) {
        if (cpu_prepared_expert(p->w, 0, &expert) != 0)
            return cpu_fail(CB(be), LOOM_ERR_INVALID,
                            "matmul_id: w is a prepared stack seen otherwise than "
                            "prepare_weight returned it; pass it whole");
    } else {
        TRY(cpu_check_bounds(CB(be), p->w, "matmul_id w"));
    }
    TRY(cpu_check_bounds(CB(be), p->ids, "matmul_id ids"));
    TRY(cpu_check_bounds(CB(be), p->y, "matmul_id y"));
    const int64_t K = p->x->ne[0], N = p->w->ne[1], E = p->w->ne[2], k = p->ids->ne[0];
    const int64_t T = loom_tensor_rows(p->ids), rows = T * k;
    if (rows == 0 || N == 0)
        return LOOM_OK;
    /* the rows by expert: a counting sort of (token, slot) pairs */
    int64_t *start = calloc((size_t)E + 1, sizeof *start), *order = malloc((size_t)rows * 8);
    int64_t *fill = malloc((size_t)E * sizeof *fill);
    int64_t *by_size = malloc((size_t)E * sizeof *by_size);
    float *xs = NULL;
    loom_status st = LOOM_OK;
    if (!start || !order || !fill || !by_size) {
        st = NO_MEMORY(be);
        goto done;
    }
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < k; j++) {
            int32_t e = id_at(p->ids, t, j);
            if (e < 0 || e >= E) {
                st = cpu_fail(CB(be), LOOM_ERR_INVALID,
                              "matmul_id: expert id %d of token %lld is outside [0, %lld)", e,
                              (long long)t, (long long)E);
                goto done;
            }
            start[e + 1]++;
        }
    id_job j = {.cb = CB(be),
                .p = p,
                .K = K,
                .N = N,
                .k = k,
                .per_slot = p->x->ne[1] > 1,
                .start = start,
                .order = order,
                .by_size = by_size};
    for (int64_t e = 0; e < E; e++) {
        j.most = start[e + 1] > j.most ? start[e + 1] : j.most;
        if (start[e + 1] > 0)
            by_size[j.n_busy++] = (int64_t)((uint64_t)start[e + 1] << 32 | (uint32_t)~e);
        start[e + 1] += start[e];
    }
    memcpy(fill, start, (size_t)E * sizeof *fill);
    for (int64_t r = 0; r < rows; r++)
        order[fill[id_at(p->ids, r / k, r % k)]++] = r;

    int nth = pool_size(CB(be)->pool);
    int whole_experts = nth > 1 && j.n_busy >= 2 * (int64_t)nth;
    if (whole_experts)
        qsort(by_size, (size_t)j.n_busy, sizeof *by_size, descending);
    for (int64_t i = 0; i < j.n_busy; i++)
        by_size[i] = (int64_t)(uint32_t) ~(uint32_t)by_size[i];

    /* Whole experts per thread where there are enough of them to keep every thread busy;
     * else (one or two experts with many rows) each expert's matmul on all threads. */
    if (whole_experts) {
        if (cpu_matmul_takes_blocks(p->w)) {
            int64_t n_x = T * (j.per_slot ? k : 1);
            j.xq = aligned_alloc(64,
                                 ((size_t)(n_x * (K / LOOM_QK)) * sizeof *j.xq + 63) & ~(size_t)63);
            if (!j.xq) {
                st = NO_MEMORY(be);
                goto done;
            }
            if (n_x * K >= 16384)
                pool_run(CB(be)->pool, quantise_rows, &j);
            else
                quantise_rows(&j, 0, 1);
        }
        atomic_init(&j.next, 0);
        atomic_init(&j.failed, 0);
        pool_run(CB(be)->pool, experts_on_threads, &j);
        free(j.xq);
        if (atomic_load(&j.failed))
            st = NO_MEMORY(be);
        goto done;
    }
    xs = j.most > 1 ? malloc((size_t)(j.most * (K + N)) * sizeof *xs) : NULL;
    if (j.most > 1 && !xs) {
        st = NO_MEMORY(be);
        goto done;
    }
    for (int64_t i = 0; i < j.n_busy && st == LOOM_OK; i++)
        st = run_expert(&j, by_size[i], xs, 1);
done:
    free(start), free(order), free(fill), free(by_size), free(xs);
    return st;
}

/* ---- moe_combine ----------------------------------------------------------------------- */

typedef struct combine_job {
    const loom_moe_combine_params *p;
} combine_job;

static void combine_rows(void *ctx, int ith, int nth)
{
    const loom_moe_combine_params *p = ((const combine_job *)ctx)->p;
    const int64_t n = p->src->ne[0], k = p->src->ne[1];
    long t0, t1;
    pool_split((long)loom_tensor_rows(p->dst), ith, nth, &t0, &t1);
    for (long t = t0; t < t1; t++) {
        float *dst = (float *)cpu_row(p->dst, base(p->dst), t);
        const unsigned char *w = cpu_row(p->weights, base(p->weights), t);
        if (!p->accumulate)
            memset(dst, 0, (size_t)n * sizeof *dst);
        for (int64_t j = 0; j < k; j++) {
            float wj = *(const float *)(w + (uint64_t)j * p->weights->nb[0]);
            const float *src = (const float *)cpu_row(p->src, base(p->src), t * k + j);
            for (int64_t i = 0; i < n; i++)
                dst[i] += wj * src[i];
        }
    }
}

loom_status cpu_moe_combine(loom_backend *be, const loom_moe_combine_params *p)
{
    CHECK_ARGS(be, loom_check_moe_combine(p));
    TRY(cpu_check_bounds(CB(be), p->src, "moe_combine src"));
    TRY(cpu_check_bounds(CB(be), p->weights, "moe_combine weights"));
    TRY(cpu_check_bounds(CB(be), p->dst, "moe_combine dst"));
    combine_job j = {p};
    if (loom_tensor_rows(p->src) * p->src->ne[0] < 16384)
        combine_rows(&j, 0, 1);
    else
        pool_run(CB(be)->pool, combine_rows, &j);
    return LOOM_OK;
}
