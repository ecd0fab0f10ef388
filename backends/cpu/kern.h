/*
 * backends/cpu/kern.h - the matmul kernels' interface (implemented in kernels.h).
 */
#ifndef LOOM_CPU_KERN_H
#define LOOM_CPU_KERN_H

#include <loom/backend.h>

/* activation rows a kernel handles at once: each weight row loaded is used this many times */
#define KERN_MAX_M 4

/* M activation rows of K, quantised to int8 blocks of 32 for the quantised-weight kernels. */
typedef struct cpu_act {
    int64_t K;
    const int8_t *qs; /* [M, K] */
    const float *d;   /* [M, K/32] block scales */
    const float *s;   /* [M, K/32] d * sum of the block's qs */
} cpu_act;

/* out[r] = dot(weight row, activation row m0 + r) for r < mc (mc <= KERN_MAX_M) */
typedef void (*kern_quant_fn)(const void *wrow, const cpu_act *a, int64_t m0, int mc, float *out);
/* the same for f32/f16/bf16 weights and f32 activation rows x[0..mc) */
typedef void (*kern_float_fn)(loom_dtype wt, const void *wrow, const float *const *x, int mc,
                              int64_t K, float *out);

void kern_q8_0(const void *, const cpu_act *, int64_t, int, float *);
void kern_q4_0(const void *, const cpu_act *, int64_t, int, float *);
void kern_q4_1(const void *, const cpu_act *, int64_t, int, float *);
void kern_float(loom_dtype, const void *, const float *const *, int, int64_t, float *);
/* the avx512 variant's VNNI builds of the same kernels */
void kern_q8_0_vnni(const void *, const cpu_act *, int64_t, int, float *);
void kern_q4_0_vnni(const void *, const cpu_act *, int64_t, int, float *);
void kern_q4_1_vnni(const void *, const cpu_act *, int64_t, int, float *);
void kern_float_vnni(loom_dtype, const void *, const float *const *, int, int64_t, float *);

#endif
