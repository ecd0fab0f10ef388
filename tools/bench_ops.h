/* tools/bench_ops.h - `loom bench ops` (see bench_ops.c). */
#ifndef LOOM_TOOLS_BENCH_OPS_H
#define LOOM_TOOLS_BENCH_OPS_H

/* argv: the arguments after "bench ops"; self: this executable, to run children with */
int loom_bench_ops_main(int argc, char **argv, const char *self);

#endif
