/*
 * dist/distributed.h - one model across the processes of an MPI job: a pipeline, rank r running
 * stage r (docs/DISTRIBUTED.md). Rank 0 drives: its runner announces every step to the others
 * through the stage link made here; every other rank follows (loom_dist_follow).
 */
#ifndef LOOM_DIST_DISTRIBUTED_H
#define LOOM_DIST_DISTRIBUTED_H

#include "core/gguf.h"
#include "core/runner.h"

#include <stddef.h>
#include <stdint.h>

typedef struct loom_dist loom_dist;

/* Joins the MPI job this process belongs to as loom_model_options.distributed says (0: never;
 * 1: when in a job, unless LOOM_DISTRIBUTED=0; 2: must). *out: NULL when not distributed (no
 * job, or a job of one process). -1 with err when the job cannot be joined. */
int loom_dist_join(int wanted, loom_dist **out, char *err, size_t err_size);
int loom_dist_rank(const loom_dist *d);
int loom_dist_size(const loom_dist *d);

/* Every rank, after opening its file: rank 0 cuts the model (stage_layers "N0,N1,...", or by
 * weight bytes) and tells each rank its layers and the model's shape, which each rank's own
 * file must have. Fills *link for this rank's stage and the layer range. -1 with err (on every
 * rank) when any rank's file or the plan is wrong. */
int loom_dist_plan(loom_dist *d, const loom_gguf *g, int32_t n_layer, const char *stage_layers,
                   loom_stage_link *link, int32_t *first, int32_t *end, char *err, size_t err_size);

/* Every rank, with its outcome of opening its stage (ok, or the message in err; its backend's
 * name in what): -1 with the first failing rank's message, on every rank, when any failed. On
 * rank 0, summary gets one line naming every rank's layers, host and backend. */
int loom_dist_agree(loom_dist *d, int ok, const char *what, char *err, size_t err_size,
                    char *summary, size_t summary_size);

/* Every rank but 0: runs the steps rank 0 announces on r until it is done (0), or the job
 * cannot go on (-1 with err). */
int loom_dist_follow(loom_dist *d, loom_runner *r, char *err, size_t err_size);

/* Rank 0 (elsewhere, nothing): on_stop(ctx, why) runs on a thread of its own as soon as
 * another rank's process ends, even while a step is blocked waiting for that rank; NULL
 * on_stop ends the watch, once no call is under way. */
void loom_dist_watch(loom_dist *d, void (*on_stop)(void *ctx, const char *why), void *ctx);

/* Bytes this rank sent and received over the job's links so far. */
void loom_dist_traffic(const loom_dist *d, uint64_t *sent, uint64_t *received);

/* Leaves the job, on rank 0 with tell_others after telling the others (following) to stop.
 * Once a process: a later loom_dist_join says the job is over. */
void loom_dist_leave(loom_dist *d, int tell_others);

#endif
