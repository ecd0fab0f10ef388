/*
 * backends/cpu/cpu.h - what the CPU backend's translation units share.
 *
 * The module is built once per ISA variant from the same sources. cpu_probe.c is compiled for
 * the baseline ISA in every variant (it runs before anyone knows what the CPU can do); every
 * other file is compiled with the variant's -m flags and runs only after the probe passed.
 */
#ifndef LOOM_CPU_H
#define LOOM_CPU_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* cpu_set_t; every file of the module includes this header first */
#endif
#include <loom/backend.h>
#include <pthread.h>
#include <sched.h>

/* OpenBLAS takes prefill-sized f32 matmuls where it beats loom's own kernels: measured, that
 * is every variant but avx512 (see cpu_matmul.c) */
#if defined(LOOM_HAVE_OPENBLAS) && !defined(LOOM_CPU_VARIANT_AVX512)
#define CPU_USE_BLAS 1
#endif

/* ISA levels, in the order LOOM_CPU_MAX_ISA uses */
enum { CPU_LEVEL_BASELINE = 0, CPU_LEVEL_AVX2 = 1, CPU_LEVEL_AVX512 = 2 };

typedef struct cpu_features {
    int avx2, fma, f16c;                       /* with OS support for YMM state */
    int avx512f, avx512bw, avx512vl, avx512dq; /* with OS support for ZMM and opmask state */
    int avx512vnni, avx512bf16;
    /* with avx512bf16: vdpbf16ps at least at the f32 FMA's multiply-add rate, so BF16 prefill
     * takes it too: AMD
     * (Zen 5 measured pp128 195 t/s with it against 144 for F16 widened to f32); the Intel Xeon
     * measured (Emerald Rapids) issues it once per 2 cycles, a quarter of two FMAs' rate */
    int bf16_dp_full_rate;
    int avxvnni; /* AVX-VNNI: vpdpbusd on ymm, VEX-encoded (Alder Lake, Zen 5), for the avx2 variant */
    char brand[64];
    /* LOOM_CPU_MASK: the features hidden from this process (CPU_MASK_* bits), and the reason
     * the variable could not be read (then no variant is usable) */
    unsigned masked;
    char mask_error[200];
} cpu_features;

/* LOOM_CPU_MASK names: what a machine of another kind lacks */
enum {
    CPU_MASK_AVX2 = 1u << 0,
    CPU_MASK_FMA = 1u << 1,
    CPU_MASK_F16C = 1u << 2,
    CPU_MASK_AVX512 = 1u << 3,
    CPU_MASK_VNNI = 1u << 4,
    CPU_MASK_BF16 = 1u << 5,
};

/* What a variant's build is: defined (as data only) in cpu_backend.c. */
typedef struct cpu_variant_desc {
    const char *name; /* "baseline", "avx2", "avx512" */
    int level;        /* CPU_LEVEL_* */
} cpu_variant_desc;

extern const cpu_variant_desc loom_cpu_variant;

/* cpu_numa.c (baseline code): the NUMA nodes this process may run on, and LOOM_NUMA */
#define CPU_NUMA_MAX_NODES 64
enum { CPU_NUMA_OFF = 0, CPU_NUMA_INTERLEAVE, CPU_NUMA_LOCAL };
typedef struct cpu_numa {
    int n_nodes;
    int simulated; /* read under LOOM_TEST_SYSROOT: memory policy is not applied */
    int node_id[CPU_NUMA_MAX_NODES];
    cpu_set_t cpus[CPU_NUMA_MAX_NODES]; /* of the affinity mask */
} cpu_numa;
int cpu_parse_cpulist(const char *s, cpu_set_t *set);
void cpu_numa_read(cpu_numa *t);
/* LOOM_NUMA, or the default for t (interleave with several nodes); -1 with err when invalid */
int cpu_numa_mode(const cpu_numa *t, char *err, size_t err_size);
const char *cpu_numa_mode_name(int mode);
/* which node (index into t) each of n_threads threads works on: in proportion to the nodes'
 * CPUs, in node order */
void cpu_numa_plan(const cpu_numa *t, int n_threads, int *node_of_thread);
void cpu_numa_describe(const cpu_numa *t, int mode, char *out, size_t n);
/* Spreads [p, p + size) over the nodes before it is touched; 1 when applied. */
int cpu_numa_interleave(const cpu_numa *t, void *p, size_t size);

/* ---- The opened backend (variant code only below this line) ---------------------------- */

#include "pool.h"

/* How a prepared weight is laid out (kern.h): rows interleaved a vector's lanes at a time; so
 * with each Q8_0 quant + 128, the unsigned operand of VNNI's u8 x s8 dot product
 * (kern_q8_0_ri_vnni); or BF16 in column pairs for the BF16 dot product (kern_bf16.c) */
typedef enum cpu_layout {
    CPU_LAYOUT_FILE = 0,
    CPU_LAYOUT_ROWS,
    CPU_LAYOUT_ROWS_BIASED,
    CPU_LAYOUT_BF16_PAIRS
} cpu_layout;

/* A run of huge pages that small prepared weights share (cpu_alloc_weight) */
typedef struct cpu_chunk {
    unsigned char *data;
    uint64_t size, used;
    int live; /* buffers carved from it and not yet freed */
} cpu_chunk;

struct loom_buffer {
    unsigned char *data;
    uint64_t size;
    int wrapped;      /* data belongs to the caller (buffer_wrap_host) */
    cpu_chunk *chunk; /* data lies in this shared chunk (cpu_alloc_weight), or NULL */
    /* set on a weight prepared by cpu_prepare_weight: what it holds, in the layout of kern.h;
     * only matmul reads such a buffer */
    int prepared; /* a cpu_layout */
    loom_dtype prepared_type;
    int64_t prepared_n, prepared_k;
};

typedef struct cpu_backend {
    loom_backend base;
    pool *pool;
    cpu_features feat;
    cpu_numa numa;
    int numa_mode; /* CPU_NUMA_* */
    pthread_mutex_t chunk_mu;
    cpu_chunk *chunk; /* the one small weights are carved from now, or NULL */
    char error[512];
} cpu_backend;

/* Records a formatted error for last_error and returns st. */
loom_status cpu_fail(cpu_backend *cb, loom_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* OK when t lies inside its buffer; names it `what` otherwise. */
loom_status cpu_check_bounds(cpu_backend *cb, const loom_tensor *t, const char *what);
/* A host buffer of size bytes. Large ones ask for huge pages and, with several NUMA nodes, are
 * interleaved over them, except a weight prepared under LOOM_NUMA=local (thread_local: its
 * rows' pages go where the thread that writes them first runs). */
loom_status cpu_alloc(cpu_backend *cb, uint64_t size, int thread_local, loom_buffer **out);
/* The same for a prepared weight: one too small for huge pages of its own is carved from a
 * shared chunk that has them (freed with its last buffer). */
loom_status cpu_alloc_weight(cpu_backend *cb, uint64_t size, int thread_local, loom_buffer **out);
/* cpu_matmul.c */
loom_status cpu_matmul(loom_backend *be, const loom_matmul_params *p);
/* The same on the calling thread only, for a caller that shares its work out itself (matmul_id
 * gives each thread whole experts). Only the error message is shared state: callers on
 * several threads validate their arguments first, so only running out of memory can fail.
 * xq: NULL, or X's rows already quantised as kern.h's act_blocks ([M][K / 32], as
 * kern_prep_blocks writes them) for a W that cpu_matmul_takes_blocks; p->x then gives only the
 * shape and its bytes are not read. */
loom_status cpu_matmul_alone(cpu_backend *cb, const loom_matmul_params *p, const void *xq);
/* 1 when matmul takes X as act_blocks for this W (an interleaved block layout) */
int cpu_matmul_takes_blocks(const loom_tensor *w);
loom_status cpu_prepare_weight(loom_backend *be, const loom_tensor *w, loom_tensor *out);
/* Expert e of a stack that cpu_prepare_weight prepared whole (ABI 1.6): a buffer of its rows'
 * groups that matmul takes as a prepared [N, K] weight. 0, or -1 when w is not such a stack. */
int cpu_prepared_expert(const loom_tensor *w, int64_t e, struct loom_buffer *view);
/* cpu_attention.c */
loom_status cpu_kv_store(loom_backend *be, const loom_kv_store_params *p);
loom_status cpu_attention(loom_backend *be, const loom_attention_params *p);
/* cpu_moe.c */
loom_status cpu_moe_route(loom_backend *be, const loom_moe_route_params *p);
loom_status cpu_matmul_id(loom_backend *be, const loom_matmul_id_params *p);
loom_status cpu_moe_combine(loom_backend *be, const loom_moe_combine_params *p);
/* cpu_recurrent.c: the recurrent layers' ops (ABI 1.8) */
loom_status cpu_ssm_conv(loom_backend *be, const loom_ssm_conv_params *p);
loom_status cpu_gated_delta(loom_backend *be, const loom_gated_delta_params *p);

/* cpu_probe.c (baseline code) */
void cpu_detect(cpu_features *f);
int cpu_level_supported(const cpu_features *f, int level, char *why, size_t why_size);

/* cpu_threads.c (baseline code): the thread count when neither the caller nor LOOM_THREADS
 * says: physical cores in the affinity mask, capped by the cgroup CPU quota rounded up */
typedef struct cpu_thread_default {
    int threads, cores;
    double quota;          /* CPUs the cgroup quota allows; 0 when unlimited */
    char quota_source[40]; /* which file set it: "cgroup cpu.max", ... */
} cpu_thread_default;
void cpu_default_threads(cpu_thread_default *out);
void cpu_describe_threads(const cpu_thread_default *t, char *out, size_t n);

/* cpu_backend.c (variant code): called only when the level is supported */
loom_status cpu_backend_create(const loom_backend_options *opts, const cpu_features *f,
                               loom_backend **out, char *err, size_t err_size);

#endif
