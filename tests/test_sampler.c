/*
 * tests/test_sampler.c - the sampler on small vectors whose answers follow from the
 * definitions: penalties change logits exactly as specified, temperature 0 and top-k 1 are
 * greedy, a seed reproduces its draws, and the truncations never let through what they cut.
 */
#include "core/sampler.h"

#include "check.h"

#include <string.h>

static loom_sampler_params plain(void)
{
    loom_sampler_params p = loom_sampler_defaults();
    p.top_k = 0, p.top_p = 1.0f, p.min_p = 0.0f, p.temperature = 1.0f;
    return p;
}

int main(void)
{
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
    CHECK(saw2 == 0 && saw1 > 100 && saw1 < 300, "min-p: token 1 drawn %d times, token 2 %d",
          saw1, saw2);
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
