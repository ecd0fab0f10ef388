/* tools/bench_ops.h - `loom bench ops` (see bench_ops.c). */
#ifndef LOOM_TOOLS_BENCH_OPS_H
#define LOOM_TOOLS_BENCH_OPS_H

#include <stdint.h>

/* argv: the arguments after "bench ops"; self: this executable, to run children with */
int loom_bench_ops_main(int argc, char **argv, const char *self);

/* Shared with `loom bench`: the bytes a working set needs to stream from DRAM (4x the
 * last-level cache), the thread count benchmarks assume (LOOM_THREADS or the online CPUs),
 * and the machine's streaming read bandwidth in GB/s over such a working set. */
uint64_t loom_bench_working_set(void);
int loom_bench_threads(void);
double loom_bench_read_bandwidth(uint64_t bytes, int n_threads);

#endif
