/*
 * backends/cpu/cpu_attention.c - the paged KV cache: kv_store, and fused attention over the
 * cache with an online softmax (the block kernels of attn_block.h on the avx2 and avx512
 * variants).
 */
#define _GNU_SOURCE
#include "attn_block.h"
#include "cpu.h"
#include "ops.h"
#include "rows.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- KV cache --------------------------------------------------------------------------- */

loom_status cpu_kv_store(loom_backend *be, const loom_kv_store_params *p)
{
    CHECK_ARGS(be, loom_check_kv_store(p));
    BOUNDS(be, p->src, "kv_store src");
    BOUNDS(be, p->slots, "kv_store slots");
    BOUNDS(be, p->cache, "kv_store cache");
    const loom_tensor *c = p->cache;
    int64_t hd = p->src->ne[0], kvh = p->src->ne[1], tokens = p->src->ne[2] * p->src->ne[3];
    int64_t n_slots = c->ne[2] * c->ne[3];
    for (int64_t t = 0; t < tokens; t++) {
        int32_t slot = i32_at(p->slots, t);
        if (slot < 0)
            continue;
        if (slot >= n_slots)
            return cpu_fail(CB(be), LOOM_ERR_INVALID, "kv_store: slot %d outside the cache's %lld",
                            slot, (long long)n_slots);
        for (int64_t h = 0; h < kvh; h++)
            cpu_store_row(c->dtype, (const float *)cpu_row(p->src, base(p->src), t * kvh + h),
                          cpu_row(c, base(c), (int64_t)slot * kvh + h), hd);
    }
    return LOOM_OK;
}

/* Fused paged attention with an online softmax: for one (token, kv head), every query head of
 * the group walks the keys block by block; each K and V row is converted once per group and
 * used by all its heads; scores of one block are exponentiated against the running maximum,
 * so no score matrix is ever stored.
 * (token, kv head) pairs are the unit of work. When there are fewer of them than threads (one
 * decode token of a model with 8 kv heads is 8 pairs), each pair's key blocks are cut into
 * parts: a part leaves its heads' running maximum, sum and unnormalised output, and a second
 * pass combines the parts of a pair, each rescaled to the largest maximum. */
typedef struct attn_job {
    const loom_attention_params *p;
    int splits;             /* parts each pair's keys are cut into (1: none) */
    float *partial;         /* splits > 1: per part, per head of its group, m, l, acc[head_dim] */
    volatile int bad_block; /* set by a thread that met an out-of-range block id */
} attn_job;

/* The last key a token attends to: its own position, or the end of its sequence's
 * bidirectional prefix (ChatGLM-6B) */
static int64_t last_key(const loom_attention_params *p, int64_t t)
{
    int64_t last = i32_at(p->pos, t);
    if (p->prefix_len && i32_at(p->prefix_len, i32_at(p->seq, t)) - 1 > last)
        last = i32_at(p->prefix_len, i32_at(p->seq, t)) - 1;
    return last;
}


/* The keys (or values) of kv head g in cache block blk: a cache is [head_dim, kv_heads,
 * block_size, blocks], so they start here and are nb[2] apart. */
static const unsigned char *head_block(const loom_tensor *c, int64_t g, int32_t blk)
{
    return base(c) + c->offset + (uint64_t)g * c->nb[1] + (uint64_t)blk * c->nb[3];
}

#if defined(ATTN_LANES)
/* The first nk rows of one head's block (from head_block) as f32 rows, one after another */
static void block_to_f32(const loom_tensor *c, const unsigned char *rows, int64_t nk, float *out)
{
    for (int64_t jj = 0; jj < nk; jj++)
        cpu_load_row(c->dtype, rows + jj * c->nb[2], out + jj * c->ne[0], c->ne[0]);
}
#endif

static void attn_pairs(void *ctx, int ith, int nth)
{
    attn_job *j = ctx;
    const loom_attention_params *p = j->p;
    const loom_tensor *kc = p->k_cache, *vc = p->v_cache;
    int64_t hd = p->q->ne[0], heads = p->q->ne[1], kvh = kc->ne[1], bs = kc->ne[2];
    int64_t n_blocks = kc->ne[3], group = heads / kvh;
    int64_t tokens = p->q->ne[2] * p->q->ne[3];
    uint64_t row_bytes = loom_row_bytes(kc->dtype, hd);
    int fast = ATTN_FAST_HD(hd);
    /* k, v: one row each; with the fast path, a whole block of each */
    int64_t rows = fast ? bs : 1;
    float *k = malloc((size_t)(hd * 2 * rows + group * (hd + bs + 2)) * sizeof(float));
    if (!k) {
        j->bad_block = -2;
        return;
    }
    float *v = k + hd * rows, *acc = v + hd * rows, *scores = acc + group * hd;
    float *m = scores + group * bs, *l = m + group;
    long i0, i1;
    pool_split((long)(tokens * kvh * j->splits), ith, nth, &i0, &i1);
    for (long idx = i0; idx < i1; idx++) {
        int64_t pair = idx / j->splits, part = idx % j->splits;
        int64_t t = pair / kvh, g = pair % kvh;
        int32_t s = i32_at(p->seq, t);
        /* keys [first, last]: a sliding window starts past 0 */
        int64_t last = last_key(p, t), first = loom_attention_first_key(p, i32_at(p->pos, t));
        int64_t first_block = first / bs, n_key_blocks = last / bs + 1 - first_block;
        /* this part's key blocks (all of them without a split) */
        int64_t kb0 = first_block + part * n_key_blocks / j->splits,
                kb1 = first_block + (part + 1) * n_key_blocks / j->splits;
        const unsigned char *bt = cpu_row(p->block_table, base(p->block_table), s);
        const float *q[256]; /* the group's query rows (heads / kv_heads <= 256, checked) */
        for (int64_t h = 0; h < group; h++) {
            q[h] = (const float *)cpu_row(p->q, base(p->q), t * heads + g * group + h);
            m[h] = -INFINITY;
            l[h] = 0.0f;
            memset(acc + h * hd, 0, (size_t)hd * sizeof(float));
        }
        for (int64_t j0 = kb0 * bs; j0 < kb1 * bs; j0 += bs) {
            int32_t blk;
            memcpy(&blk, bt + (j0 / bs) * p->block_table->nb[0], 4);
            if (blk < 0 || blk >= n_blocks) {
                j->bad_block = blk < 0 ? -1 : blk;
                goto out;
            }
            int64_t nk = last - j0 + 1 < bs ? last - j0 + 1 : bs;
            /* key jj of this block and head lies at kb + jj * nb[2] (cpu_row's divisions per
             * key cost more than the dot product at head_dim 64) */
            const unsigned char *kb = head_block(kc, g, blk), *vb = head_block(vc, g, blk);
            if (j0 + bs < kb1 * bs) {
                /* the next block's rows of this head: fetch them while this one is worked on */
                int32_t nxt;
                memcpy(&nxt, bt + (j0 / bs + 1) * p->block_table->nb[0], 4);
                if (nxt >= 0 && nxt < n_blocks) {
                    const unsigned char *nkb = head_block(kc, g, nxt),
                                        *nvb = head_block(vc, g, nxt);
                    for (int64_t jj = 0; jj < bs; jj++)
                        for (uint64_t off = 0; off < row_bytes && off < 512; off += 64) {
                            __builtin_prefetch(nkb + jj * kc->nb[2] + off);
                            __builtin_prefetch(nvb + jj * vc->nb[2] + off);
                        }
                }
            }
#if defined(ATTN_LANES)
            if (fast) {
                block_to_f32(kc, kb, nk, k);
                attn_block_simd(q, group, k, NULL, nk, hd, p->scale, scores, bs, NULL, 0);
            }
#endif
            for (int64_t jj = 0; !fast && jj < nk; jj++) {
                const unsigned char *kr = kb + jj * kc->nb[2];
                if (group == 1 && kc->dtype == LOOM_F16) {
                    scores[jj] = cpu_dot_f16(q[0], (const uint16_t *)kr, hd) * p->scale;
                    continue;
                }
                cpu_load_row(kc->dtype, kr, k, hd);
                for (int64_t h = 0; h < group; h++)
                    scores[h * bs + jj] = cpu_dot(q[h], k, hd) * p->scale;
            }
            for (int64_t h = 0; j0 < first && h < group; h++) /* keys before the window */
                for (int64_t jj = 0; jj < first - j0 && jj < nk; jj++)
                    scores[h * bs + jj] = -INFINITY;
            for (int64_t h = 0; h < group; h++) {
                float *sc = scores + h * bs;
                float bmax = m[h];
                for (int64_t jj = 0; jj < nk; jj++)
                    bmax = sc[jj] > bmax ? sc[jj] : bmax;
                float rescale = expf(m[h] - bmax); /* 0 on the first block: m is -inf */
                if (rescale != 1.0f) {
                    l[h] *= rescale;
                    for (int64_t i = 0; i < hd; i++)
                        acc[h * hd + i] *= rescale;
                }
                m[h] = bmax;
                l[h] += cpu_exp_shifted(sc, nk, bmax);
            }
#if defined(ATTN_LANES)
            if (fast) {
                block_to_f32(vc, vb, nk, v);
                attn_block_simd(q, group, NULL, v, nk, hd, p->scale, scores, bs, acc, 1);
            }
#endif
            for (int64_t jj = 0; !fast && jj < nk; jj++) {
                const unsigned char *vr = vb + jj * vc->nb[2];
                if (group == 1 && vc->dtype == LOOM_F16) {
                    cpu_axpy_f16(scores[jj], (const uint16_t *)vr, acc, hd);
                    continue;
                }
                cpu_load_row(vc->dtype, vr, v, hd);
                for (int64_t h = 0; h < group; h++)
                    cpu_axpy(scores[h * bs + jj], v, acc + h * hd, hd);
            }
        }
        for (int64_t h = 0; h < group; h++) {
            if (j->splits > 1) { /* this part's state, for attn_combine */
                float *part_h = j->partial + (idx * group + h) * (hd + 2);
                part_h[0] = m[h];
                part_h[1] = l[h];
                memcpy(part_h + 2, acc + h * hd, (size_t)hd * sizeof(float));
                continue;
            }
            float *y = (float *)cpu_row(p->dst, base(p->dst), t * heads + g * group + h);
            float inv = 1.0f / l[h];
            for (int64_t i = 0; i < hd; i++)
                y[i] = acc[h * hd + i] * inv;
        }
    }
out:
    free(k);
}

/* The second pass of a split: each head's parts, rescaled to their largest maximum and summed.
 * A part without keys (a short sequence's, in a batch cut for a longer one) has m = -inf and
 * weighs nothing; every pair's last part holds keys. */
static void attn_combine(void *ctx, int ith, int nth)
{
    attn_job *j = ctx;
    const loom_attention_params *p = j->p;
    int64_t hd = p->q->ne[0], heads = p->q->ne[1], kvh = p->k_cache->ne[1], group = heads / kvh;
    long r0, r1; /* query rows: (token, head) */
    pool_split((long)(p->q->ne[2] * p->q->ne[3] * heads), ith, nth, &r0, &r1);
    for (long row = r0; row < r1; row++) {
        int64_t pair = row / group, h = row % group; /* heads of a pair are adjacent rows */
        const float *first = j->partial + (pair * j->splits * group + h) * (hd + 2);
        size_t part_stride = (size_t)group * (hd + 2);
        float mx = -INFINITY, total = 0.0f;
        for (int s = 0; s < j->splits; s++)
            mx = first[s * part_stride] > mx ? first[s * part_stride] : mx;
        float *y = (float *)cpu_row(p->dst, base(p->dst), row);
        memset(y, 0, (size_t)hd * sizeof(float));
        for (int s = 0; s < j->splits; s++) {
            const float *part = first + s * part_stride;
            if (part[1] == 0.0f)
                continue;
            float w = expf(part[0] - mx);
            total += part[1] * w;
            cpu_axpy(w, part + 2, y, hd);
        }
        for (int64_t i = 0; i < hd; i++)
            y[i] /= total;
    }
}

/* Parts to cut each pair's keys into: enough that every thread has work, none without keys */
static int attn_splits(const loom_attention_params *p, int nth)
{
    int64_t tokens = p->q->ne[2] * p->q->ne[3], pairs = tokens * p->k_cache->ne[1];
    if (pairs >= nth)
        return 1;
    int64_t fewest_blocks = INT64_MAX;
    for (int64_t t = 0; t < tokens; t++) {
        int64_t n = last_key(p, t) / p->k_cache->ne[2] + 1;
        fewest_blocks = n < fewest_blocks ? n : fewest_blocks;
    }
    int64_t splits = (nth + pairs - 1) / pairs;
    return (int)(splits < fewest_blocks ? splits : fewest_blocks);
}

loom_status cpu_attention(loom_backend *be, const loom_attention_params *p)
{
    CHECK_ARGS(be, loom_check_attention(p));
    BOUNDS(be, p->q, "attention q");
    BOUNDS(be, p->k_cache, "attention k_cache");
    BOUNDS(be, p->v_cache, "attention v_cache");
    BOUNDS(be, p->block_table, "attention block_table");
    BOUNDS(be, p->seq, "attention seq");
    BOUNDS(be, p->pos, "attention pos");
    BOUNDS(be, p->prefix_len, "attention prefix_len");
    BOUNDS(be, p->dst, "attention dst");
    /* validate every token's sequence and reach up front, so the workers cannot fail on it */
    int64_t tokens = p->q->ne[2] * p->q->ne[3], n_seqs = loom_tensor_rows(p->block_table);
    int64_t reach = p->block_table->ne[0] * p->k_cache->ne[2];
    for (int64_t t = 0; t < tokens; t++) {
        int32_t s = i32_at(p->seq, t), pos = i32_at(p->pos, t);
        int64_t last = pos;
        if (s >= 0 && s < n_seqs && p->prefix_len && i32_at(p->prefix_len, s) - 1 > last)
            last = i32_at(p->prefix_len, s) - 1;
        if (s < 0 || s >= n_seqs || pos < 0 || last >= reach)
            return cpu_fail(CB(be), LOOM_ERR_INVALID,
                            "attention: token %lld has seq %d, pos %d (sequences: %lld, block "
                            "table reach: %lld keys)",
                            (long long)t, s, pos, (long long)n_seqs, (long long)reach);
    }
    if (p->q->ne[1] / p->k_cache->ne[1] > 256)
        return cpu_fail(CB(be), LOOM_ERR_UNSUPPORTED,
                        "attention: more than 256 query heads per kv head");
    attn_job j = {p, attn_splits(p, pool_size(CB(be)->pool)), NULL, 0};
    if (j.splits > 1) {
        size_t floats = (size_t)(tokens * p->q->ne[1] * j.splits * (p->q->ne[0] + 2));
        if (!(j.partial = malloc(floats * sizeof(float))))
            return cpu_fail(CB(be), LOOM_ERR_OUT_OF_MEMORY,
                            "attention: no memory for %d parts "
                            "of %lld tokens' keys",
                            j.splits, (long long)tokens);
    }
    pool_run(CB(be)->pool, attn_pairs, &j);
    if (j.splits > 1 && !j.bad_block)
        pool_run(CB(be)->pool, attn_combine, &j);
    free(j.partial);
    if (j.bad_block == -2)
        return cpu_fail(CB(be), LOOM_ERR_OUT_OF_MEMORY, "attention: no memory for scratch rows");
    if (j.bad_block)
        return cpu_fail(CB(be), LOOM_ERR_INVALID, "attention: block id %d outside the cache",
                        j.bad_block);
    return LOOM_OK;
}
