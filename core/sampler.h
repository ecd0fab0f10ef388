/*
 * core/sampler.h - choosing the next token from logits, on the host.
 */
#ifndef LOOM_CORE_SAMPLER_H
#define LOOM_CORE_SAMPLER_H

#include <stdint.h>

typedef struct loom_sampler_params {
    float temperature;       /* <= 1e-5: greedy */
    int32_t top_k;           /* 0: off */
    float top_p;             /* 1: off */
    float min_p;             /* 0: off */
    float repeat_penalty;    /* 1: off; positive logits divided, negative multiplied */
    int32_t repeat_last_n;   /* window of recent tokens the penalties look at */
    float presence_penalty;  /* subtracted once from every token in the window */
    float frequency_penalty; /* subtracted per occurrence in the window */
    uint64_t seed;
} loom_sampler_params;

/* Default values: greedy off (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05), no penalties. */
loom_sampler_params loom_sampler_defaults(void);

/* Applies the penalties to logits (n of them) in place, from the last tokens of history. */
void loom_sampler_penalize(float *logits, int32_t n, const loom_sampler_params *p,
                           const int32_t *history, int32_t n_history);

/* The next token. logits are penalised in place first; rng is the caller's state (seeded with
 * p->seed). */
int32_t loom_sampler_sample(float *logits, int32_t n, const loom_sampler_params *p,
                            const int32_t *history, int32_t n_history, uint64_t *rng);

#endif
