/*
 * tests/test_sched.c - the serving engine's policy (engine/sched.c) alone: no model, no
 * threads, no clock. Each rule is checked where switching it off changes the answer: priority
 * order and its whole steps, aging, tenants' turns, a tenant's running limit, preemption for a
 * better waiting request, displacement from a full queue, the worse prefill's share while
 * better requests arrive, a prefill sitting out a better newcomer's step, deadlines.
 */
#include "check.h"
#include "engine/sched.h"

#include <stdint.h>
#include <string.h>

static int32_t running[8]; /* per tenant */
static sched_policy policy = {.aging_ms = 10000, .tenant_running = running};

static sched_req req(int64_t id, int32_t priority, double t_submit, int32_t tenant)
{
    return (sched_req){.id = id, .priority = priority, .t_submit = t_submit, .tenant = tenant};
}

/* the one of reqs[0..n) that runs first (the engine's next_waiting, without tenants' limits) */
static int first_of(const sched_req *reqs, int n, double now)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (sched_runs_before(&policy, &reqs[i], &reqs[best], now))
            best = i;
    return best;
}

static void test_order(void)
{
    double now = 100000;
    /* a better priority first, whatever the age; among equals the older */
    sched_req a = req(2, 0, now, 0), b = req(1, 5, now, 0), c = req(3, 0, now, 0);
    CHECK(sched_runs_before(&policy, &a, &b, now), "priority 0 before 5, though newer");
    CHECK(sched_runs_before(&policy, &a, &c, now) && !sched_runs_before(&policy, &c, &a, now),
          "equal priorities: the older first");
    /* aging: priority 5 that has waited 60 s (6 steps of 10 s) runs before a fresh 0 */
    sched_req old = req(9, 5, now - 60000, 0), fresh = req(1, 0, now, 0);
    CHECK(sched_effective_priority(&policy, &old, now) == -1,
          "60 s of waiting is 6 steps better: %g", sched_effective_priority(&policy, &old, now));
    CHECK(sched_runs_before(&policy, &old, &fresh, now), "an aged request passes a fresh one");
    /* whole steps: half a step of aging does not reorder; the older of a tie goes first */
    sched_req half = req(1, 1, now - 5000, 0), zero = req(2, 0, now, 0);
    CHECK(sched_runs_before(&policy, &half, &zero, now),
          "priority 1 aged half a step ties with 0 (whole steps), and is older");
    sched_req set[] = {req(4, 3, now, 0), req(5, 1, now, 0), req(6, 1, now, 0), req(7, 2, now, 0)};
    CHECK(first_of(set, 4, now) == 1, "of 3, 1, 1, 2 the older 1 runs first: %d",
          first_of(set, 4, now));
}

static void test_tenants(void)
{
    double now = 5000;
    memset(running, 0, sizeof running);
    running[1] = 3;
    /* equal priority: the tenant running fewer goes first, though its request is newer */
    sched_req busy = req(1, 0, now, 1), idle = req(2, 0, now, 2);
    CHECK(sched_runs_before(&policy, &idle, &busy, now),
          "tenant 2 (0 running) before tenant 1 (3 running)");
    running[2] = 3;
    CHECK(sched_runs_before(&policy, &busy, &idle, now), "equal turns: the older again");
    /* a better priority still comes before turns */
    sched_req better = req(3, -1, now, 1);
    CHECK(sched_runs_before(&policy, &better, &idle, now), "priority before turns");
    /* a tenant at its running limit waits */
    sched_req limited = req(4, 0, now, 1);
    limited.tenant_max_running = 3;
    CHECK(sched_tenant_full(&policy, &limited), "3 running of 3 allowed: full");
    limited.tenant_max_running = 4;
    CHECK(!sched_tenant_full(&policy, &limited), "3 of 4: not full");
    limited.tenant_max_running = 0;
    CHECK(!sched_tenant_full(&policy, &limited), "no limit of its own: never full");
    memset(running, 0, sizeof running);
}

static void test_preemption_and_displacement(void)
{
    double now = 1000;
    sched_req waiting = req(9, 0, now, 0), worst = req(1, 1, now, 0);
    CHECK(sched_preempts(&policy, &waiting, &worst, now), "a full batch gives 1 up for 0");
    worst.priority = 0;
    CHECK(!sched_preempts(&policy, &waiting, &worst, now), "not for an equal priority");
    sched_req aged = req(9, 1, now - 5000, 0); /* 0.5 now: a tie with 0 in whole steps */
    CHECK(!sched_preempts(&policy, &aged, &worst, now), "nor for half a step of aging");
    worst.priority = 1;
    CHECK(sched_preempts(&policy, &aged, &worst, now), "which does pass a fresh 1");
    /* a full queue: the worst not-started request goes for a better newcomer, the newest of
     * equals; never one that started, nor for a newcomer that is not better */
    sched_req live[] = {req(1, 5, now, 0), req(2, 7, now, 0), req(3, 7, now, 0), req(4, 9, now, 0)};
    live[3].started = 1;
    int victim = -1;
    for (int i = 0; i < 4; i++)
        if (sched_displaceable(&live[i], 0) &&
            (victim < 0 || sched_displace_before(&live[i], &live[victim])))
            victim = i;
    CHECK(victim == 2, "priority 7, the newer of two (9 has started): %d", victim);
    CHECK(!sched_displaceable(&live[0], 5) && sched_displaceable(&live[0], 4),
          "only for a better newcomer");
    live[2].cancelled = 1, live[1].displaced = 1;
    CHECK(!sched_displaceable(&live[2], 0) && !sched_displaceable(&live[1], 0),
          "not a cancelled or already displaced one");
}

static void test_worse_prefills(void)
{
    sched_policy p = {.aging_ms = 10000, .tenant_running = running};
    double now = 50000;
    CHECK(sched_worse_prefill_share(&p, 5, now) == INT32_MAX, "no arrivals: no limit");
    sched_note_arrival(&p, now - 100, 0, 20);
    sched_note_arrival(&p, now - 500, 1, 40);
    sched_note_arrival(&p, now - 3000, 0, 1000); /* past SCHED_RECENT_MS */
    sched_note_arrival(&p, now - 50, 5, 1000);   /* not better than 5 */
    int32_t share = sched_worse_prefill_share(&p, 5, now);
    CHECK(share == 15, "half the mean of the better recent prompts (20, 40): %d", share);
    CHECK(sched_worse_prefill_share(&p, 0, now) == INT32_MAX, "the best priority: no limit");
    sched_note_arrival(&p, now - 10, 0, 2);
    CHECK(sched_worse_prefill_share(&p, 5, now) == 10, "(20, 40, 2): 10");
    sched_policy q = {.aging_ms = 10000, .tenant_running = running};
    sched_note_arrival(&q, now, 0, 4);
    CHECK(sched_worse_prefill_share(&q, 1, now) == 8, "8 at least");
    /* the step's worse prefills share one allowance; a decode is never cut */
    int32_t used = 0;
    CHECK(sched_clip_prefill(&p, 5, 100, now, &used) == 10, "the first prefill gets the share");
    CHECK(sched_clip_prefill(&p, 5, 100, now, &used) == 0, "the second nothing this step");
    CHECK(sched_clip_prefill(&p, 5, 1, now, &used) == 1, "a decode is never cut");
    used = 0;
    CHECK(sched_clip_prefill(&p, 0, 100, now, &used) == 100,
          "a prompt of the best priority: whole");
    /* a prompt under way sits out the step that admits a better request */
    CHECK(sched_sits_out(3, 64, 1), "priority 3's prefill sits out priority 1's arrival");
    CHECK(!sched_sits_out(3, 1, 1), "its decode does not");
    CHECK(!sched_sits_out(1, 64, 1), "nor an equal priority's prefill");
    CHECK(!sched_sits_out(3, 64, INT32_MAX), "nor with nobody arriving");
}

static void test_deadlines(void)
{
    sched_req q = req(1, 0, 0, 0);
    CHECK(!sched_expired(&q, 1e12), "no deadline: never");
    q.deadline = 500;
    CHECK(!sched_expired(&q, 499.9) && sched_expired(&q, 500), "at its deadline, not before");
}

int main(void)
{
    test_order();
    test_tenants();
    test_preemption_and_displacement();
    test_worse_prefills();
    test_deadlines();
    return check_finish("test_sched");
}
