/*
 * backends/cpu/pool.c - see pool.h.
 *
 * Protocol: pool_run publishes (fn, ctx), bumps `generation` under the mutex and broadcasts;
 * workers that are spinning see the new generation at once, sleeping ones wake on the
 * condition variable. Each worker decrements `pending` when done; the caller spins (then
 * yields) until it reaches zero. Bumping under the mutex is what makes a worker that checked
 * the generation and is about to sleep unable to miss the wake-up.
 */
#define _GNU_SOURCE
#include "pool.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

/* how long an idle worker spins before it sleeps: long enough to bridge the gap between two
 * ops of a forward pass, short enough not to burn a core between tokens */
#define SPIN_NS 200000L

struct pool {
    int n;
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t wake;
    atomic_uint generation;
    atomic_int pending;
    atomic_int stop;
    pool_fn fn;
    void *ctx;
};

typedef struct worker_arg {
    pool *p;
    int ith;
} worker_arg;

static long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void *worker(void *arg)
{
    worker_arg *w = arg;
    pool *p = w->p;
    int ith = w->ith;
    free(w);
    unsigned seen =
        0; /* generation starts at 0; a job posted before this thread ran is not missed */
    for (;;) {
        long start = now_ns();
        int spins = 0;
        while (atomic_load_explicit(&p->generation, memory_order_acquire) == seen &&
               !atomic_load(&p->stop)) {
            CPU_RELAX();
            if (++spins % 1024 == 0 && now_ns() - start > SPIN_NS) {
                pthread_mutex_lock(&p->mu);
                while (atomic_load(&p->generation) == seen && !atomic_load(&p->stop))
                    pthread_cond_wait(&p->wake, &p->mu);
                pthread_mutex_unlock(&p->mu);
            }
        }
        if (atomic_load(&p->stop))
            return NULL;
        seen = atomic_load(&p->generation);
        p->fn(p->ctx, ith, p->n);
        atomic_fetch_sub_explicit(&p->pending, 1, memory_order_release);
    }
}

pool *pool_create(int n)
{
    pool *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    p->n = n < 1 ? 1 : n;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    p->threads = calloc((size_t)p->n, sizeof *p->threads);
    if (!p->threads) {
        pool_free(p);
        return NULL;
    }
    for (int i = 1; i < p->n; i++) {
        worker_arg *w = malloc(sizeof *w);
        if (!w || (w->p = p, w->ith = i, pthread_create(&p->threads[i], NULL, worker, w)) != 0) {
            free(w);
            p->n = i; /* join only what started */
            pool_free(p);
            return NULL;
        }
    }
    return p;
}

int pool_bind_worker(pool *p, int ith, const void *cpu_set, size_t set_size)
{
    if (ith < 1 || ith >= p->n)
        return EINVAL;
    return pthread_setaffinity_np(p->threads[ith], set_size, (const cpu_set_t *)cpu_set);
}

int pool_size(const pool *p)
{
    return p->n;
}

void pool_run(pool *p, pool_fn fn, void *ctx)
{
    if (p->n == 1) {
        fn(ctx, 0, 1);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    atomic_store(&p->pending, p->n - 1);
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add_explicit(&p->generation, 1, memory_order_release);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    fn(ctx, 0, p->n);
    for (long spins = 0; atomic_load_explicit(&p->pending, memory_order_acquire) > 0; spins++) {
        if (spins < 100000)
            CPU_RELAX();
        else
            sched_yield();
    }
}

void pool_free(pool *p)
{
    if (!p)
        return;
    if (p->threads) {
        pthread_mutex_lock(&p->mu);
        atomic_store(&p->stop, 1);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->mu);
        for (int i = 1; i < p->n; i++)
            pthread_join(p->threads[i], NULL);
        free(p->threads);
    }
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->wake);
    free(p);
}
