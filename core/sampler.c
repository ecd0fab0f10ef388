/*
 * core/sampler.c - see sampler.h. The order is the usual one: penalties, then temperature,
 * top-k, softmax, top-p, min-p, and a draw from what is left: in order of probability (then
 * id) when something was cut, in id order from the whole distribution when nothing was.
 * temperature <= 1e-5 is greedy; top_k 0, top_p 1, min_p 0 are off; repeat_penalty divides
 * positive logits and multiplies negative ones (1: off); presence_penalty is subtracted once
 * from every token in the last repeat_last_n, frequency_penalty once per occurrence there.
 */
#include "sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

loom_sampler_params loom_sampler_defaults(void)
{
#define DEFAULT(kind, name, value, ...) .name = (LOOM_SAMPLING_CTYPE_##kind)(value),
    loom_sampler_params p = {LOOM_SAMPLING_FIELDS(DEFAULT)};
#undef DEFAULT
    return p;
}

static int by_id(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

void loom_sampler_penalize(float *logits, int32_t n, const loom_sampler_params *p,
                           const int32_t *history, int32_t n_history)
{
    if (p->repeat_penalty == 1.0f && p->presence_penalty == 0.0f && p->frequency_penalty == 0.0f)
        return;
    int32_t from = p->repeat_last_n > 0 && n_history > p->repeat_last_n
        ? n_history - p->repeat_last_n
        : 0;
    int32_t w = n_history - from;
    /* The window sorted, so each token's occurrences lie together: O(w log w) per step where
     * looking back for each occurrence was O(w^2), and a server's window is the whole
     * context. Without memory for the copy, no penalty is better than a wrong one. */
    int32_t *ids = w > 0 ? malloc((size_t)w * sizeof *ids) : NULL;
    if (!ids)
        return;
    memcpy(ids, history + from, (size_t)w * sizeof *ids);
    qsort(ids, (size_t)w, sizeof *ids, by_id);
    for (int32_t i = 0; i < w;) {
        int32_t id = ids[i], count = 0;
        while (i < w && ids[i] == id)
            i++, count++;
        if (id < 0 || id >= n)
            continue;
        /* once per token: the repeat and presence penalties; per occurrence: frequency */
        if (p->repeat_penalty != 1.0f && p->repeat_penalty > 0.0f)
            logits[id] = logits[id] > 0 ? logits[id] / p->repeat_penalty
                                        : logits[id] * p->repeat_penalty;
        logits[id] -= p->presence_penalty;
        while (count--)
            logits[id] -= p->frequency_penalty; /* one at a time, as each occurrence did */
    }
    free(ids);
}

static int32_t argmax(const float *x, int32_t n)
{
    int32_t best = 0;
    float v = x[0];
    for (int32_t i = 1; i < n; i++)
        if (x[i] > v)
            v = x[i], best = i;
    return best;
}

typedef struct cand {
    float p;
    int32_t id;
} cand;

static int by_prob_desc(const void *a, const void *b)
{
    float x = ((const cand *)a)->p, y = ((const cand *)b)->p;
    return x < y ? 1 : x > y ? -1 : ((const cand *)a)->id - ((const cand *)b)->id;
}

/* A key whose unsigned order is descending probability: the float's bits made monotonic
 * (-0 taken as +0, as the comparison above takes them), then inverted. */
static uint32_t desc_key(float p)
{
    uint32_t u;
    if (p == 0.0f)
        p = 0.0f;
    memcpy(&u, &p, 4);
    u = u >> 31 ? ~u : u | 0x80000000u;
    return ~u;
}

/* Sorts c by probability descending, then id ascending, as by_prob_desc does. When c is in id
 * order, a stable radix sort on the probability alone gives that order in O(n): a 150k
 * vocabulary sampled without top-k (OpenAI's defaults) took ~45 ms a token to qsort. */
static void sort_candidates(cand *c, int32_t m, int in_id_order)
{
    cand *tmp = in_id_order && m >= 4096 ? malloc((size_t)m * sizeof *tmp) : NULL;
    if (!tmp) {
        qsort(c, (size_t)m, sizeof *c, by_prob_desc);
        return;
    }
    cand *from = c, *to = tmp;
    for (int shift = 0; shift < 32; shift += 8) {
        int32_t count[257] = {0};
        for (int32_t i = 0; i < m; i++)
            count[(desc_key(from[i].p) >> shift & 0xff) + 1]++;
        for (int b = 0; b < 256; b++)
            count[b + 1] += count[b];
        for (int32_t i = 0; i < m; i++)
            to[count[desc_key(from[i].p) >> shift & 0xff]++] = from[i];
        cand *t = from;
        from = to, to = t;
    }
    /* four passes: the result is back in c */
    free(tmp);
}

/* The order candidates are drawn in: probability descending, then id ascending. */
static int before(const cand *a, const cand *b)
{
    return a->p > b->p || (a->p == b->p && a->id < b->id);
}

/* Moves the first m candidates of the sorted order to c[0..m) (in no order): quickselect. */
static void select_top(cand *c, int32_t n, int32_t m)
{
    int32_t lo = 0, hi = n - 1;
    uint32_t x = 2463534242u;
    while (lo < hi) {
        x ^= x << 13, x ^= x >> 17, x ^= x << 5;
        cand pivot = c[lo + (int32_t)(x % (uint32_t)(hi - lo + 1))];
        int32_t i = lo, j = hi;
        while (i <= j) {
            while (before(&c[i], &pivot))
                i++;
            while (before(&pivot, &c[j]))
                j--;
            if (i <= j) {
                cand t = c[i];
                c[i++] = c[j], c[j--] = t;
            }
        }
        if (m - 1 <= j)
            hi = j;
        else if (m - 1 >= i)
            lo = i;
        else
            break;
    }
}

double loom_sampler_uniform(uint64_t *s)
{
    /* splitmix64: small, good enough for sampling, reproducible across platforms */
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (double)(z >> 11) / 9007199254740992.0;
}

/* A draw from the whole softmax(logits / temperature), walking the ids in order: two passes
 * over the logits (the weights' sum, then the walk to the draw), no sort. */
static int32_t sample_all(const float *logits, int32_t n, float temperature, uint64_t *rng)
{
    float max = logits[0];
    for (int32_t i = 1; i < n; i++)
        max = logits[i] > max ? logits[i] : max;
    if (max == -INFINITY)
        return 0;
    float scale = 1.0f / temperature;
    double sum = 0;
    for (int32_t i = 0; i < n; i++)
        sum += expf((logits[i] - max) * scale);
    double u = loom_sampler_uniform(rng) * sum, acc = 0;
    int32_t last = 0;
    for (int32_t i = 0; i < n; i++) {
        float w = expf((logits[i] - max) * scale);
        if (w > 0)
            last = i;
        if (u < (acc += w))
            return i;
    }
    return last; /* u at the very top of a sum rounded up */
}

/* The candidates top_k, top_p and min_p keep (p over 0 at temperature > 0), most likely first,
 * each with its probability; *k of them, *total their sum (the draw normalises by it). NULL when
 * out of memory. */
static cand *truncated(const float *logits, int32_t n, const loom_sampler_params *p, int32_t *k_out,
                       double *total_out)
{
    cand *c = malloc((size_t)n * sizeof *c);
    if (!c)
        return NULL;
    float max = -INFINITY;
    for (int32_t i = 0; i < n; i++) {
        c[i] = (cand){logits[i] / p->temperature, i};
        max = c[i].p > max ? c[i].p : max;
    }
    /* Only the head of the sorted order is ever needed: select it rather than sort all n
     * (a 150k vocabulary took milliseconds a token to qsort). */
    int32_t k = p->top_k > 0 && p->top_k < n ? p->top_k : n;
    int in_id_order = k == n; /* select_top permutes */
    if (k < n)
        select_top(c, n, k);
    double sum = 0; /* softmax over the k candidates */
    for (int32_t i = 0; i < k; i++)
        sum += exp((double)c[i].p - max);
    int32_t m = k; /* how many of the sorted head to sort */
    if (p->min_p > 0.0f) {
        /* min_p keeps p_i >= min_p * p_max, a prefix of the sorted order: filter first */
        float cut = max + logf(p->min_p) - 1e-3f; /* a superset: the exact cut is below */
        int32_t keep = 0;
        for (int32_t i = 0; i < k; i++)
            if (c[i].p >= cut || c[i].p == max)
                c[keep++] = c[i];
        m = keep;
    }
    if (p->top_p > 0.0f && p->top_p < 1.0f) {
        /* grow the selected head until it holds top_p of the mass */
        for (int32_t want = 64; want < m; want *= 4) {
            select_top(c, m, want);
            in_id_order = 0;
            double head = 0;
            for (int32_t i = 0; i < want; i++)
                head += exp((double)c[i].p - max);
            if (head / sum >= p->top_p + 1e-4) { /* a margin over the float sums below */
                m = want;
                break;
            }
        }
    }
    sort_candidates(c, m, in_id_order);
    for (int32_t i = 0; i < m; i++)
        c[i].p = (float)(exp((double)c[i].p - max) / sum);
    k = m;
    if (p->top_p > 0.0f && p->top_p < 1.0f) {
        double cum = 0;
        for (int32_t i = 0; i < k; i++) {
            cum += c[i].p;
            if (cum >= p->top_p) {
                k = i + 1;
                break;
            }
        }
    }
    if (p->min_p > 0.0f) {
        float floor = c[0].p * p->min_p;
        int32_t keep = 1;
        while (keep < k && c[keep].p >= floor)
            keep++;
        k = keep;
    }
    double total = 0;
    for (int32_t i = 0; i < k; i++)
        total += c[i].p;
    *k_out = k, *total_out = total;
    return c;
}

static int greedy(const loom_sampler_params *p)
{
    return !(p->temperature > 1e-5f) || p->top_k == 1;
}

/* Nothing truncated (OpenAI's defaults): the order of a walk does not change the distribution,
 * so none is sorted. A 152k vocabulary took 4-10 ms a token to sort. */
static int untruncated(const loom_sampler_params *p, int32_t n)
{
    return (p->top_k <= 0 || p->top_k >= n) && !(p->top_p > 0.0f && p->top_p < 1.0f) &&
        !(p->min_p > 0.0f);
}

int32_t loom_sampler_sample(float *logits, int32_t n, const loom_sampler_params *p,
                            const int32_t *history, int32_t n_history, uint64_t *rng)
{
    loom_sampler_penalize(logits, n, p, history, n_history);
    if (greedy(p))
        return argmax(logits, n);
    if (untruncated(p, n))
        return sample_all(logits, n, p->temperature, rng);
    int32_t k;
    double total;
    cand *c = truncated(logits, n, p, &k, &total);
    if (!c)
        return argmax(logits, n);
    double u = loom_sampler_uniform(rng) * total, acc = 0;
    int32_t pick = c[k - 1].id;
    for (int32_t i = 0; i < k; i++) {
        acc += c[i].p;
        if (u < acc) {
            pick = c[i].id;
            break;
        }
    }
    free(c);
    return pick;
}

int loom_sampler_probs(float *logits, int32_t n, const loom_sampler_params *p,
                       const int32_t *history, int32_t n_history, float *probs)
{
    loom_sampler_penalize(logits, n, p, history, n_history);
    memset(probs, 0, (size_t)n * sizeof *probs);
    if (greedy(p)) {
        probs[argmax(logits, n)] = 1.0f;
        return 0;
    }
    if (untruncated(p, n)) {
        float max = logits[0];
        for (int32_t i = 1; i < n; i++)
            max = logits[i] > max ? logits[i] : max;
        if (max == -INFINITY) {
            probs[0] = 1.0f;
            return 0;
        }
        double sum = 0;
        for (int32_t i = 0; i < n; i++)
            sum += probs[i] = expf((logits[i] - max) / p->temperature);
        for (int32_t i = 0; i < n; i++)
            probs[i] = (float)(probs[i] / sum);
        return 0;
    }
    int32_t k;
    double total;
    cand *c = truncated(logits, n, p, &k, &total);
    if (!c)
        return -1;
    for (int32_t i = 0; i < k; i++)
        probs[c[i].id] = (float)(c[i].p / total);
    free(c);
    return 0;
}

int32_t loom_sampler_draw(const float *probs, int32_t n, uint64_t *rng)
{
    double total = 0;
    int32_t last = -1;
    for (int32_t i = 0; i < n; i++)
        if (probs[i] > 0)
            total += probs[i], last = i;
    if (last < 0)
        return -1;
    double u = loom_sampler_uniform(rng) * total, acc = 0;
    for (int32_t i = 0; i < n; i++)
        if (u < (acc += probs[i]))
            return i;
    return last; /* u at the very top of a sum rounded up */
}

int32_t loom_sampler_verify(float *p, const float *q, int32_t d, int32_t n, uint64_t *accept_rng,
                            uint64_t *rng)
{
    double qd = q ? q[d] : 1.0;
    if (qd > 0 && loom_sampler_uniform(accept_rng) < p[d] / qd)
        return d;
    if (q) {
        for (int32_t i = 0; i < n; i++)
            p[i] = p[i] > q[i] ? p[i] - q[i] : 0;
    } else {
        p[d] = 0;
    }
    int32_t t = loom_sampler_draw(p, n, rng);
    return t >= 0 ? t : d; /* p = q to the last bit: nothing left over, and d was as good */
}
