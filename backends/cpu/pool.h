/*
 * backends/cpu/pool.h - a persistent thread pool: threads are created once per backend, spin
 * briefly waiting for the next job (ops come back to back during a forward pass), then sleep.
 * The calling thread takes part as thread 0, so a pool of n runs jobs on n threads.
 */
#ifndef LOOM_CPU_POOL_H
#define LOOM_CPU_POOL_H

#include <stddef.h>

typedef void (*pool_fn)(void *ctx, int ith, int nth);

typedef struct pool pool;

/* Returns NULL when threads cannot be created. n >= 1. */
pool *pool_create(int n);
/* Runs fn(ctx, i, n) for i in [0, n) and returns when all have finished. */
void pool_run(pool *p, pool_fn fn, void *ctx);
int pool_size(const pool *p);
/* Binds worker ith (>= 1; thread 0 is the caller, left alone) to a cpu_set_t of set_size
 * bytes. Returns 0, or an errno value. */
int pool_bind_worker(pool *p, int ith, const void *cpu_set, size_t set_size);
/* Joins every thread. */
void pool_free(pool *p);

/* The range [*begin, *end) of n items that thread ith of nth takes: contiguous, balanced. */
static inline void pool_split(long n, int ith, int nth, long *begin, long *end)
{
    long per = n / nth, extra = n % nth;
    *begin = ith * per + (ith < extra ? ith : extra);
    *end = *begin + per + (ith < extra);
}

#endif
