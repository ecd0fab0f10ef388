/*
 * engine/sched.h - the serving engine's policy, as functions of plain data: which request runs
 * before which (priority, aging, tenants' turns, age), which one a full batch or a full pool
 * gives up, which waiting one a full queue refuses for a better newcomer, how much of a worse
 * prompt a step takes while better requests arrive, and when a deadline has come. No model, no
 * threads, no blocks: engine/engine.c applies these rules to its requests and its KV pool, and
 * tests/test_sched.c checks each one alone.
 */
#ifndef LOOM_ENGINE_SCHED_H
#define LOOM_ENGINE_SCHED_H

#include <stdint.h>

/* How far back the arrivals go that make a worse prefill yield, and how many are remembered. */
#define SCHED_RECENT_MS 2000.0
#define SCHED_RECENT_ARRIVALS 64

/* What the policy knows of a request. */
typedef struct sched_req {
    int64_t id;                 /* submission order: lower is older */
    int32_t priority;           /* lower runs first */
    double t_submit;            /* ms, the engine's clock */
    double deadline;            /* ms past which it is ended; 0: none */
    int32_t tenant;             /* 0: none */
    int32_t tenant_max_running; /* 0: no limit of its own */
    int started;                /* has run: never displaced */
    int displaced;              /* refused after all, for a better newcomer */
    int cancelled;
} sched_req;

typedef struct sched_arrival {
    double t;
    int32_t priority, n_prompt;
} sched_arrival;

/* The policy's state: its setting, each tenant's running count (the engine's), and the last
 * arrivals (a ring). */
typedef struct sched_policy {
    int32_t aging_ms;              /* a waiting request's priority improves by one per this */
    const int32_t *tenant_running; /* [tenant]: requests running now */
    sched_arrival recent[SCHED_RECENT_ARRIVALS];
    int next_arrival;
} sched_policy;

/* A request's priority now: its own, one better for every aging_ms it has waited (the
 * starvation bound: a flood of better requests delays it, for a while). */
double sched_effective_priority(const sched_policy *p, const sched_req *q, double now);

/* Whether a runs before b: the better effective priority in whole steps, then, between
 * tenants, the one running fewer (a flood of one tenant's requests takes turns with the
 * others'), then the older. */
int sched_runs_before(const sched_policy *p, const sched_req *a, const sched_req *b, double now);

/* Whether q's tenant runs as many as it may already (then q is not admitted). */
int sched_tenant_full(const sched_policy *p, const sched_req *q);

/* Whether a full batch gives up its worst running request for a waiting one: only for a
 * better effective priority in whole steps. */
int sched_preempts(const sched_policy *p, const sched_req *waiting, const sched_req *worst,
                   double now);

/* A full queue refuses, in favour of a newcomer of priority newcomer, the worst waiting
 * request that has not started (the newest among equals), only when it is worse than the
 * newcomer; else the newcomer is refused. Whether w may be so displaced, and whether a goes
 * before b. */
int sched_displaceable(const sched_req *w, int32_t newcomer);
int sched_displace_before(const sched_req *a, const sched_req *b);

/* Records an arrival (its submission time, priority and prompt length). */
void sched_note_arrival(sched_policy *p, double t, int32_t priority, int32_t n_prompt);

/* The prefill tokens a step gives prompts of this priority: no limit (INT32_MAX) unless
 * requests of a better priority arrived in the last SCHED_RECENT_MS, else half those
 * requests' mean prompt, 8 at least. */
int32_t sched_worse_prefill_share(const sched_policy *p, int32_t priority, double now);

/* k prefill tokens of a request of this priority, cut to what is left of its share this step;
 * *used counts the step's cut prefills, which share one allowance. A decode (k = 1) is never
 * cut. */
int32_t sched_clip_prefill(const sched_policy *p, int32_t priority, int32_t k, double now,
                           int32_t *used);

/* Whether a running request's prefill of k tokens sits out a step that admits a request of
 * priority arriving (INT32_MAX: none): a worse prompt under way waits, so that the newcomer's
 * first step holds its own prompt and the decodes only. */
int sched_sits_out(int32_t priority, int32_t k, int32_t arriving);

/* Whether q's deadline has come. */
int sched_expired(const sched_req *q, double now);

#endif
