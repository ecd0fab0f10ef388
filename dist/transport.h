/*
 * dist/transport.h - what a process of a distributed job needs from its message-passing library,
 * and all that dist/distributed.c uses of it. dist/mpi/ implements it over MPI as a module loaded
 * only inside an MPI job (docs/DISTRIBUTED.md), so neither libloom nor the tools link MPI.
 *
 * Every call returns 0, or -1 with a message in err. Buffers of any size; messages between two
 * ranks arrive in the order they were sent.
 */
#ifndef LOOM_DIST_TRANSPORT_H
#define LOOM_DIST_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

#define LOOM_TRANSPORT_ABI 2

typedef struct loom_transport {
    int abi; /* LOOM_TRANSPORT_ABI */
    const char *name;
    /* Joins the job (once a process): this process's rank, the job's size, and the host name. */
    int (*join)(int *rank, int *size, char *host, size_t host_size, char *err, size_t err_size);
    /* Collective: rank 0's buf to every rank's buf. */
    int (*bcast)(void *buf, uint64_t bytes, char *err, size_t err_size);
    /* Collective: each rank's `bytes` at mine, to rank 0's all[rank * bytes] (all: rank 0's). */
    int (*gather)(const void *mine, uint64_t bytes, void *all, char *err, size_t err_size);
    /* returns once buf may be reused, without waiting for the receiver */
    int (*send)(int to, const void *buf, uint64_t bytes, char *err, size_t err_size);
    int (*recv)(int from, void *buf, uint64_t bytes, char *err, size_t err_size);
    /* Rank 0: from now on, on_stop(ctx, why) is called, on a thread of the transport's own,
     * as soon as another rank's process ends; a call blocked in the transport meanwhile may
     * never return. NULL on_stop: no more calls (returns once none is under way). */
    void (*watch)(void (*on_stop)(void *ctx, const char *why), void *ctx);
    /* Ends every process of the job with status (for a rank that cannot go on alone). */
    void (*abort)(int status);
    /* Leaves the job (once a process, after the last call). */
    void (*leave)(void);
} loom_transport;

/* What a transport module exports. */
typedef const loom_transport *(*loom_transport_entry_fn)(void);
#define LOOM_TRANSPORT_ENTRY "loom_transport_entry"

#endif
