/*
 * core/sampler.h - choosing the next token from logits, on the host.
 */
#ifndef LOOM_CORE_SAMPLER_H
#define LOOM_CORE_SAMPLER_H

#include <loom/sampling_fields.h>

#include <stdint.h>

/* A member per row of the list (loom/sampling_fields.h); core/sampler.c says what each does. */
typedef struct loom_sampler_params {
    LOOM_SAMPLING_FIELDS(LOOM_SAMPLING_MEMBER)
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

/* The distribution loom_sampler_sample draws from, over all n ids (zero where top_k, top_p or
 * min_p cut; greedy: all on the most likely id), into probs; logits are penalised in place
 * first. What speculative sampling compares the target's and the drafter's choices by. 0, or -1
 * when out of memory. */
int loom_sampler_probs(float *logits, int32_t n, const loom_sampler_params *p,
                       const int32_t *history, int32_t n_history, float *probs);

/* A uniform draw from [0, 1), advancing rng (splitmix64: reproducible on every platform). */
double loom_sampler_uniform(uint64_t *rng);

/* A draw from n weights (not necessarily summing to one; zeros never drawn): -1 when all are
 * zero. */
int32_t loom_sampler_draw(const float *probs, int32_t n, uint64_t *rng);

/* Speculative sampling's check of a drafter's proposal d against the model's distribution p
 * (n ids, loom_sampler_probs): d is kept with probability min(1, p(d) / q(d)), else a token is
 * drawn from max(0, p - q) normalised (p is overwritten with it), which makes the result
 * distributed as p whatever q is. q: the drafter's distribution, or NULL for a proposal made
 * without one (prompt lookup: all of q on d). accept_rng draws the keep-or-not, rng the
 * replacement. */
int32_t loom_sampler_verify(float *p, const float *q, int32_t d, int32_t n, uint64_t *accept_rng,
                            uint64_t *rng);

#endif
