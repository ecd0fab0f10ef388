/*
 * tests/test_sampler.c - the sampler on small vectors whose answers follow from the
 * definitions: penalties change logits exactly as specified, temperature 0 and top-k 1 are
 * greedy, a seed reproduces its draws, and the truncations never let through what they cut.
 */
#include "core/sampler.h"

#include "check.h"

#include <unistd.h>

#include <stdlib.h>
#include <string.h>

static loom_sampler_params plain(void)
{
    loom_sampler_params p = loom_sampler_defaults();
    p.top_k = 0, p.top_p = 1.0f, p.min_p = 0.0f, p.temperature = 1.0f;
    return p;
}

/* The definition, the slow way: sort every candidate, softmax over the top k, cut the
 * top-p prefix, then the min-p prefix, draw (walking the sorted order, or the ids in order
 * when nothing was cut). The sampler must pick the same token. */
typedef struct cand {
    float p;
    int32_t id;
} cand;

static int desc(const void *a, const void *b)
{
    float x = ((const cand *)a)->p, y = ((const cand *)b)->p;
    return x < y ? 1 : x > y ? -1 : ((const cand *)a)->id - ((const cand *)b)->id;
}

static int by_id(const void *a, const void *b)
{
    return ((const cand *)a)->id - ((const cand *)b)->id;
}

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int32_t reference_sample(const float *logits, int32_t n, const loom_sampler_params *p,
                                uint64_t *rng)
{
    cand *c = malloc((size_t)n * sizeof *c);
    for (int32_t i = 0; i < n; i++)
        c[i] = (cand){logits[i] / p->temperature, i};
    qsort(c, (size_t)n, sizeof *c, desc);
    int32_t k = p->top_k > 0 && p->top_k < n ? p->top_k : n;
    double max = c[0].p, sum = 0;
    for (int32_t i = 0; i < k; i++)
        sum += exp((double)c[i].p - max);
    for (int32_t i = 0; i < k; i++)
        c[i].p = (float)(exp((double)c[i].p - max) / sum);
    if (p->top_p > 0.0f && p->top_p < 1.0f) {
        double cum = 0;
        for (int32_t i = 0; i < k; i++)
            if ((cum += c[i].p) >= p->top_p) {
                k = i + 1;
                break;
            }
    }
    if (p->min_p > 0.0f) {
        int32_t keep = 1;
        while (keep < k && c[keep].p >= c[0].p * p->min_p)
            keep++;
        k = keep;
    }
    if (k == n && !(p->top_p > 0.0f && p->top_p < 1.0f) && !(p->min_p > 0.0f))
        qsort(c, (size_t)n, sizeof *c, by_id); /* the whole distribution: walked in id order */
    double total = 0, acc = 0;
    for (int32_t i = 0; i < k; i++)
        total += c[i].p;
    double u = (double)(splitmix(rng) >> 11) / 9007199254740992.0 * total;
    int32_t pick = c[k - 1].id;
    for (int32_t i = 0; i < k; i++)
        if (u < (acc += c[i].p)) {
            pick = c[i].id;
            break;
        }
    free(c);
    return pick;
}

static void test_against_reference(void)
{
    enum { N = 5000 };
    static float logits[N], work[N];
    uint64_t s = 99;
    int differ = 0, draws = 0;
    for (int trial = 0; trial < 300; trial++) {
        float spread = 1.0f + (float)(trial % 7) * 2.0f;
        for (int i = 0; i < N; i++)
            logits[i] = (float)((double)(splitmix(&s) >> 11) / 9007199254740992.0 - 0.5) * spread;
        if (trial % 5 == 0)
            logits[trial % N] = logits[(trial * 7) % N]; /* ties */
        loom_sampler_params p = plain();
        p.temperature = 0.3f + (float)(trial % 4) * 0.4f;
        p.top_k = trial % 3 == 0 ? 0 : trial % 3 == 1 ? 40 : 1000;
        p.top_p = trial % 4 == 0 ? 1.0f : 0.5f + (float)(trial % 5) * 0.1f;
        p.min_p = trial % 6 < 3 ? 0.0f : 0.01f * (float)(trial % 6);
        uint64_t r1 = (uint64_t)trial, r2 = (uint64_t)trial;
        memcpy(work, logits, sizeof work);
        int32_t got = loom_sampler_sample(work, N, &p, NULL, 0, &r1);
        int32_t want = reference_sample(logits, N, &p, &r2);
        differ += got != want;
        draws++;
    }
    CHECK(differ == 0, "%d of %d draws differ from the sort-everything definition", differ, draws);
}

int main(void)
{
    test_against_reference();
    /* repetition penalty: positive logits divided, negative multiplied, each token once */
    loom_sampler_params p = plain();
    p.repeat_penalty = 2.0f;
    float l[4] = {2.0f, -2.0f, 1.0f, 3.0f};
    int32_t hist[] = {0, 1, 0};
    loom_sampler_penalize(l, 4, &p, hist, 3);
    CHECK(l[0] == 1.0f && l[1] == -4.0f && l[2] == 1.0f && l[3] == 3.0f,
          "repeat penalty: %g %g %g %g", l[0], l[1], l[2], l[3]);

    /* presence once per token, frequency per occurrence, only in the last N */
    p = plain();
    p.presence_penalty = 0.5f;
    p.frequency_penalty = 0.25f;
    p.repeat_last_n = 3;
    float m[3] = {0.0f, 0.0f, 0.0f};
    int32_t h2[] = {1, 2, 2, 0};
    loom_sampler_penalize(m, 3, &p, h2, 4); /* window: 2, 2, 0 */
    CHECK(m[0] == -0.75f && m[1] == 0.0f && m[2] == -1.0f, "presence/frequency: %g %g %g", m[0],
          m[1], m[2]);

    /* a server's window is the whole context: 300000 distinct tokens of history must not cost
     * 300000^2 / 2 comparisons (a minute before; the default action of SIGALRM fails the
     * test). The ids are distinct, so looking back for an earlier occurrence scans it all. */
    enum { LONG = 300000 };
    int32_t *long_hist = malloc(LONG * sizeof *long_hist);
    float *lv = calloc(LONG, sizeof *lv);
    for (int32_t i = 0; i < LONG; i++)
        long_hist[i] = (int32_t)((i * 7919u) % LONG); /* a permutation: 7919 is prime */
    p = plain();
    p.presence_penalty = 1.0f;
    p.frequency_penalty = 0.25f;
    p.repeat_last_n = LONG;
    alarm(20);
    loom_sampler_penalize(lv, LONG, &p, long_hist, LONG);
    alarm(0);
    int off = 0;
    for (int32_t i = 0; i < LONG; i++)
        off += lv[i] != -1.25f;
    CHECK(off == 0, "long window: %d of %d logits are not -1.25 (first %g)", off, LONG, lv[0]);
    free(long_hist), free(lv);

    /* greedy: temperature at or below 1e-5 (no division by zero), or top-k 1 */
    float g[5] = {0.1f, 3.0f, 2.9f, -1.0f, 0.0f};
    uint64_t rng = 1;
    p = plain();
    p.temperature = 1e-9f;
    float copy[5];
    memcpy(copy, g, sizeof g);
    CHECK(loom_sampler_sample(copy, 5, &p, NULL, 0, &rng) == 1, "tiny temperature is greedy");
    p.temperature = 0.0f;
    memcpy(copy, g, sizeof g);
    CHECK(loom_sampler_sample(copy, 5, &p, NULL, 0, &rng) == 1, "temperature 0 is greedy");
    p.temperature = 5.0f;
    p.top_k = 1;
    int always = 1;
    for (int i = 0; i < 200; i++) {
        memcpy(copy, g, sizeof g);
        always &= loom_sampler_sample(copy, 5, &p, NULL, 0, &rng) == 1;
    }
    CHECK(always, "top-k 1 is greedy at any temperature");

    /* a seed reproduces its draws */
    p = plain();
    int32_t a[64], b[64];
    uint64_t r1 = 42, r2 = 42;
    for (int i = 0; i < 64; i++) {
        memcpy(copy, g, sizeof g);
        a[i] = loom_sampler_sample(copy, 5, &p, NULL, 0, &r1);
        memcpy(copy, g, sizeof g);
        b[i] = loom_sampler_sample(copy, 5, &p, NULL, 0, &r2);
    }
    CHECK(memcmp(a, b, sizeof a) == 0, "same seed, same draws");

    /* top-p and min-p never let through what they cut; softmax shares follow the logits */
    float t[3] = {4.0f, 1.0f, 0.0f}; /* p = 0.936, 0.047, 0.017 */
    p = plain();
    p.top_p = 0.9f;
    int only0 = 1;
    for (int i = 0; i < 500; i++) {
        memcpy(copy, t, sizeof t);
        only0 &= loom_sampler_sample(copy, 3, &p, NULL, 0, &rng) == 0;
    }
    CHECK(only0, "top-p 0.9 keeps only the first token here");
    p = plain();
    p.min_p = 0.03f; /* 0.03 x 0.936 = 0.028: token 2 (0.017) is out, token 1 (0.047) in */
    int saw1 = 0, saw2 = 0;
    for (int i = 0; i < 4000; i++) {
        memcpy(copy, t, sizeof t);
        int32_t s = loom_sampler_sample(copy, 3, &p, NULL, 0, &rng);
        saw1 += s == 1;
        saw2 += s == 2;
    }
    CHECK(saw2 == 0 && saw1 > 100 && saw1 < 300, "min-p: token 1 drawn %d times, token 2 %d", saw1,
          saw2);
    float even[2] = {1.0f, 1.0f};
    int ones = 0;
    p = plain();
    for (int i = 0; i < 10000; i++) {
        memcpy(copy, even, sizeof even);
        ones += loom_sampler_sample(copy, 2, &p, NULL, 0, &rng) == 1;
    }
    CHECK(ones > 4700 && ones < 5300, "equal logits split evenly: %d of 10000", ones);
    return check_finish("test_sampler");
}
