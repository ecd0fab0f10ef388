/*
 * backends/cpu/ops.h - what the CPU backend's op files (cpu_backend.c, cpu_attention.c,
 * cpu_moe.c) share: argument and bounds checks that return the failure, tensor access, and
 * running a job over the pool only when it is big enough to pay for waking it.
 */
#ifndef LOOM_CPU_OPS_H
#define LOOM_CPU_OPS_H

#include "cpu.h"

#include <string.h>

/* below this many elements an op runs on the calling thread: waking the pool costs more */
#define PARALLEL_MIN_ELEMS 16384

#define CB(be) ((cpu_backend *)(be))
#define TRY(expr)                                                                                  \
    do {                                                                                           \
        loom_status st_ = (expr);                                                                  \
        if (st_ != LOOM_OK)                                                                        \
            return st_;                                                                            \
    } while (0)
/* a failed argument check is the caller's error, reported with the helper's message */
#define CHECK_ARGS(be, msg)                                                                        \
    do {                                                                                           \
        const char *m_ = (msg);                                                                    \
        if (m_)                                                                                    \
            return cpu_fail(CB(be), LOOM_ERR_INVALID, "%s", m_);                                   \
    } while (0)
#define BOUNDS(be, t, what)                                                                        \
    do {                                                                                           \
        if (t)                                                                                     \
            TRY(cpu_check_bounds(CB(be), (t), (what)));                                            \
    } while (0)

static inline unsigned char *base(const loom_tensor *t)
{
    return t->buf->data;
}

static inline int32_t i32_at(const loom_tensor *t, int64_t i)
{
    int32_t v;
    memcpy(&v, base(t) + t->offset + (uint64_t)i * t->nb[0], 4);
    return v;
}

/* Runs fn over the pool when the op is big enough to pay for it. */
static inline void run(cpu_backend *cb, pool_fn fn, void *ctx, int64_t elems)
{
    if (elems < PARALLEL_MIN_ELEMS)
        fn(ctx, 0, 1);
    else
        pool_run(cb->pool, fn, ctx);
}

#endif
