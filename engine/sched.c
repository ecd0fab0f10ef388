/*
 * engine/sched.c - see sched.h.
 */
#include "engine/sched.h"

#include <math.h>
#include <stddef.h>

double sched_effective_priority(const sched_policy *p, const sched_req *q, double now)
{
    return q->priority - (now - q->t_submit) / p->aging_ms;
}

int sched_runs_before(const sched_policy *p, const sched_req *a, const sched_req *b, double now)
{
    double pa = floor(sched_effective_priority(p, a, now));
    double pb = floor(sched_effective_priority(p, b, now));
    if (pa != pb)
        return pa < pb;
    if (a->tenant != b->tenant) {
        int32_t ra = p->tenant_running[a->tenant], rb = p->tenant_running[b->tenant];
        if (ra != rb)
            return ra < rb;
    }
    return a->id < b->id;
}

int sched_tenant_full(const sched_policy *p, const sched_req *q)
{
    return q->tenant_max_running && p->tenant_running[q->tenant] >= q->tenant_max_running;
}

int sched_preempts(const sched_policy *p, const sched_req *waiting, const sched_req *worst,
                   double now)
{
    return floor(sched_effective_priority(p, waiting, now)) <
        floor(sched_effective_priority(p, worst, now));
}

int sched_displaceable(const sched_req *w, int32_t newcomer)
{
    return !w->started && !w->displaced && !w->cancelled && w->priority > newcomer;
}

int sched_displace_before(const sched_req *a, const sched_req *b)
{
    return a->priority > b->priority || (a->priority == b->priority && a->id > b->id);
}

void sched_note_arrival(sched_policy *p, double t, int32_t priority, int32_t n_prompt)
{
    p->recent[p->next_arrival] = (sched_arrival){t, priority, n_prompt};
    p->next_arrival = (p->next_arrival + 1) % SCHED_RECENT_ARRIVALS;
}

int32_t sched_worse_prefill_share(const sched_policy *p, int32_t priority, double now)
{
    double sum = 0;
    int n = 0;
    for (int i = 0; i < SCHED_RECENT_ARRIVALS; i++) {
        const sched_arrival *a = &p->recent[i];
        if (a->n_prompt > 0 && a->priority < priority && now - a->t <= SCHED_RECENT_MS)
            sum += a->n_prompt, n++;
    }
    if (!n)
        return INT32_MAX;
    int32_t share = (int32_t)(sum / n / 2);
    return share > 8 ? share : 8;
}

int32_t sched_clip_prefill(const sched_policy *p, int32_t priority, int32_t k, double now,
                           int32_t *used)
{
    int32_t share = k > 1 ? sched_worse_prefill_share(p, priority, now) : INT32_MAX;
    if (share == INT32_MAX)
        return k;
    int32_t left = share > *used ? share - *used : 0;
    k = k < left ? k : left;
    *used += k;
    return k;
}

int sched_sits_out(int32_t priority, int32_t k, int32_t arriving)
{
    return k > 1 && priority > arriving;
}

int sched_expired(const sched_req *q, double now)
{
    return q->deadline > 0 && now >= q->deadline;
}
