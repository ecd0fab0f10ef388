/*
 * backends/cpu/cpu_recurrent.c - the recurrent layers' ops (ABI 1.8): the causal conv1d over a
 * sequence's window and the gated delta rule over its state.
 *
 * Both are recurrences along each sequence's tokens, but independent across channels (the
 * conv) and value heads (the delta rule), so the threads split those and each runs every token
 * in order for its share, head by head: a thread owns its heads' states for the whole call. The delta rule
 * keeps a head's [d_v][d_k] state in its rows as backend.h lays it out (row j is column j of S),
 * so each step is d_v dot products and axpys of length d_k. This is the recurrent form for
 * prefill as well as decode; the chunked (WY) form that turns a long prompt into matmuls is
 * the next step for speed (issue 62).
 */
#include "cpu.h"
#include "ops.h"
#include "rows.h"

#include <math.h>
#include <stdlib.h>

/* ---- ssm_conv -------------------------------------------------------------------------- */

typedef struct conv_job {
    const loom_ssm_conv_params *p;
    _Atomic int failed; /* a slot outside the state: set by any thread */
} conv_job;

static void conv_channels(void *ctx, int ith, int nth)
{
    conv_job *j = ctx;
    const loom_ssm_conv_params *p = j->p;
    const int64_t C = p->x->ne[0], K = p->weight->ne[0], T = loom_tensor_rows(p->x);
    const int64_t slots = p->state->ne[2];
    long c0, c1;
    pool_split((long)C, ith, nth, &c0, &c1);
    float w[64], win[64]; /* K <= 64: checked by the caller */
    for (long c = c0; c < c1; c++) {
        cpu_load_row(p->weight->dtype, cpu_row(p->weight, base(p->weight), c), w, K);
        for (int64_t t = 0; t < T; t++) {
            int32_t s = i32_at(p->seq, t);
            if (s < 0 || s >= slots) {
                j->failed = 1;
                return;
            }
            /* the slot's window of this channel: K - 1 earlier inputs, then x[t] */
            float *st[64];
            for (int64_t i = 0; i < K - 1; i++) {
                st[i] = (float *)cpu_row(p->state, base(p->state), s * (K - 1) + i) + c;
                win[i] = *st[i];
            }
            win[K - 1] = ((const float *)cpu_row(p->x, base(p->x), t))[c];
            float acc = 0;
            for (int64_t i = 0; i < K; i++)
                acc += w[i] * win[i];
            ((float *)cpu_row(p->dst, base(p->dst), t))[c] = acc / (1.0f + expf(-acc));
            for (int64_t i = 0; i < K - 1; i++)
                *st[i] = win[i + 1];
        }
    }
}

loom_status cpu_ssm_conv(loom_backend *be, const loom_ssm_conv_params *p)
{
    CHECK_ARGS(be, loom_check_ssm_conv(p));
    BOUNDS(be, p->x, "ssm_conv x");
    BOUNDS(be, p->weight, "ssm_conv weight");
    BOUNDS(be, p->seq, "ssm_conv seq");
    BOUNDS(be, p->state, "ssm_conv state");
    BOUNDS(be, p->dst, "ssm_conv dst");
    if (p->weight->ne[0] > 64)
        return cpu_fail(CB(be), LOOM_ERR_UNSUPPORTED, "ssm_conv: kernel %lld > 64",
                        (long long)p->weight->ne[0]);
    conv_job j = {p, 0};
    run(CB(be), conv_channels, &j, loom_tensor_rows(p->x) * p->x->ne[0] * p->weight->ne[0]);
    if (j.failed)
        return cpu_fail(CB(be), LOOM_ERR_INVALID, "ssm_conv: a token's slot is outside the state");
    return LOOM_OK;
}

/* ---- gated_delta ----------------------------------------------------------------------- */

typedef struct delta_job {
    const loom_gated_delta_params *p;
    _Atomic int failed; /* 1: a slot outside the state, 2: out of memory */
} delta_job;

static float row_norm(const float *x, int64_t n)
{
    return 1.0f / sqrtf(cpu_dot(x, x, n) + 1e-6f);
}

static void delta_heads(void *ctx, int ith, int nth)
{
    delta_job *j = ctx;
    const loom_gated_delta_params *p = j->p;
    const int64_t dk = p->q->ne[0], hk = p->q->ne[1], T = p->q->ne[2];
    const int64_t dv = p->v->ne[0], hv = p->v->ne[1], slots = p->state->ne[3];
    const float *a = (const float *)cpu_row(p->a, base(p->a), 0);
    const float *dt = (const float *)cpu_row(p->dt_bias, base(p->dt_bias), 0);
    long h0, h1;
    pool_split((long)hv, ith, nth, &h0, &h1);
    float *q = malloc((size_t)(2 * dk) * sizeof *q), *k = q ? q + dk : NULL;
    if (!q) {
        j->failed = 2;
        return;
    }
    const float q_scale = 1.0f / sqrtf((float)dk);
    /* head by head, every token: a head's state (d_v x d_k floats of a slot) stays in cache
     * across a prefill's tokens instead of being fetched again for each */
    for (long h = h0; h < h1 && !j->failed; h++)
        for (int64_t t = 0; t < T; t++) {
            int32_t s = i32_at(p->seq, t);
            if (s < 0 || s >= slots) {
                j->failed = 1;
                break;
            }
            const float *alpha = (const float *)cpu_row(p->alpha, base(p->alpha), t);
            const float *beta = (const float *)cpu_row(p->beta, base(p->beta), t);
            const int64_t kh = loom_gated_delta_key_head(p, h, hk, hv);
            const float *qr = (const float *)cpu_row(p->q, base(p->q), t * hk + kh);
            const float *kr = (const float *)cpu_row(p->k, base(p->k), t * hk + kh);
            const float *v = (const float *)cpu_row(p->v, base(p->v), t * hv + h);
            float *o = (float *)cpu_row(p->dst, base(p->dst), t * hv + h);
            float qn = row_norm(qr, dk) * q_scale, kn = row_norm(kr, dk);
            for (int64_t i = 0; i < dk; i++)
                q[i] = qr[i] * qn, k[i] = kr[i] * kn;
            float x = alpha[h] + dt[h];
            float softplus = x > 20.0f ? x : log1pf(expf(x));
            float decay = expf(a[h] * softplus), b = 1.0f / (1.0f + expf(-beta[h]));
            /* with S' = decay S + k delta^T: k S' and q S' from S's dot products, so each
             * column is read twice (two dots) and written once, not scaled in a pass of its own */
            const float kq = cpu_dot(k, q, dk);
            for (int64_t jv = 0; jv < dv; jv++) {
                float *col = (float *)cpu_row(p->state, base(p->state), (s * hv + h) * dv + jv);
                float sk = decay * cpu_dot(col, k, dk), sq = decay * cpu_dot(col, q, dk);
                float delta = b * (v[jv] - sk);
                for (int64_t i = 0; i < dk; i++)
                    col[i] = decay * col[i] + delta * k[i];
                o[jv] = sq + delta * kq;
            }
        }
    free(q);
}

loom_status cpu_gated_delta(loom_backend *be, const loom_gated_delta_params *p)
{
    CHECK_ARGS(be, loom_check_gated_delta(p));
    const loom_tensor *all[] = {p->q, p->k,       p->v,   p->alpha, p->beta,
                                p->a, p->dt_bias, p->seq, p->state, p->dst};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        BOUNDS(be, all[i], "gated_delta");
    delta_job j = {p, 0};
    run(CB(be), delta_heads, &j, p->q->ne[2] * p->v->ne[1] * p->v->ne[0] * p->q->ne[0] * 4);
    if (j.failed)
        return cpu_fail(
            CB(be), j.failed == 2 ? LOOM_ERR_OUT_OF_MEMORY : LOOM_ERR_INVALID, "gated_delta: %s",
            j.failed == 2 ? "out of host memory" : "a token's slot is outside the state");
    return LOOM_OK;
}
