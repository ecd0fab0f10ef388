/*
 * backends/cpu/kern.h - the matmul kernels' interface (implemented in kern_template.h).
 *
 * A kernel computes a tile: up to KERN_NR weight rows against up to KERN_MR activation rows,
 * so each weight block is loaded (and unpacked) once for KERN_MR activation rows and each
 * activation block once for KERN_NR weight rows.
 */
#ifndef LOOM_CPU_KERN_H
#define LOOM_CPU_KERN_H

#include <loom/backend.h>

#include <stddef.h>

#define KERN_NR 4
#define KERN_MR 4

#define INLINE static inline __attribute__((always_inline))
/* The tile loops run a compile-time number of times (up to KERN_NR / KERN_MR): unrolled, their
 * arrays of accumulators become registers; GCC left them on the stack otherwise (measured in
 * kern_kq.c: 20 -> 33 cycles per Q4_K super-block and activation row). */
#define UNROLL _Pragma("GCC unroll 4")
#define UNROLL8 _Pragma("GCC unroll 8")

/* Blocks of activations per record: two in the AVX-512 build (one 512-bit register holds two
 * blocks), one otherwise. */
#if defined(__AVX512F__)
#define KERN_G 2
#else
#define KERN_G 1
#endif

/* The baseline variant's kernels use SSE2, which every x86-64 CPU has: its integer dot product
 * multiplies int16 pairs (pmaddwd; the u8 x s8 one is SSSE3), so activations are also kept
 * widened to int16 (act_group.qw), once per matmul rather than once per weight row. A weight
 * byte pair becomes an int16 pair most cheaply as its even and odd bytes (a mask and a shift,
 * no unpacking), so qw holds each half block's even elements, then its odd ones:
 * x0 x2 .. x14, x1 x3 .. x15, x16 x18 .. x30, x17 .. x31. */
#if defined(__SSE2__) && !defined(__AVX2__)
#define KERN_SSE2 1
#include <emmintrin.h>

/* the sum of v's four lanes */
INLINE float hsum128(__m128 v)
{
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_shuffle_ps(v, v, 1));
    return _mm_cvtss_f32(v);
}
#endif

/* KERN_G blocks of 32 activations, quantised to int8 and laid out for the integer kernels.
 * Lane l covers qs[4l..4l+3], as a 4-way integer dot product's lanes do; the per-lane fields
 * hold the values of the block that lane's quants come from. The order of the quants follows
 * the weights' (kern_layout). */
typedef struct act_group {
    int8_t qs[32 * KERN_G]; /* the quants; for Q8_0 weights biased by +128 (see kern_template.h) */
    int32_t neg8sum[8 * KERN_G]; /* -8 x the lane's sum of quants: Q4_0's offset */
    float d[8 * KERN_G];         /* the block's scale, in each of its lanes */
    float msum[8 * KERN_G];      /* d x the block's sum of quants / 8, in each lane: Q4_1 */
#ifdef KERN_SSE2
    int16_t qw[32]; /* qs widened, even elements before odd ones (above) */
    int32_t neg8;   /* Q4_0's offset: -8 x the block's sum of quants */
#endif
} act_group;

/* Activation rows prepared for a quantised-weight kernel. */
typedef struct cpu_act {
    int64_t nb;         /* blocks per row */
    int64_t groups;     /* act_groups per row: nb / KERN_G rounded up */
    const act_group *g; /* [M][groups] */
} cpu_act;

/* out[r * KERN_NR + i] = dot(weight row i, activation row m0 + r), i < nr, r < mr.
 * w: the first weight row; wstride: bytes between weight rows. */
typedef void (*kern_quant_fn)(const unsigned char *w, size_t wstride, int nr, const cpu_act *a,
                              int64_t m0, int mr, float *out);
/* The same for f32/f16/bf16 weights; x[r] is activation row m0 + r. */
typedef void (*kern_float_fn)(loom_dtype wt, const unsigned char *w, size_t wstride, int nr,
                              const float *const *x, int mr, int64_t K, float *out);
/* How kern_prep lays out a pair of blocks A, B (in a group of two; a group of one block is
 * always in natural order). */
typedef enum kern_layout {
    KERN_NATURAL,        /* A0..31, B0..31, signed */
    KERN_NATURAL_BIASED, /* the same, stored as x + 128: Q8_0 weights with VNNI */
    KERN_NIBBLE_PAIRS,   /* A0..15, B0..15, A16..31, B16..31: Q4 weights unpack into this order */
} kern_layout;

/* ---- Interleaved weights (cpu_prepare_weight) ----------------------------------------------
 * Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 and IQ4_NL (in Q4_0's records) weights rearranged at load so
 * that one vector lane holds one weight row:
 * the integer dot product of a lane is then that row's partial sum, and a block's KERN_RI
 * scales are one vector, so no lane has to be summed across or scale broadcast per block. Rows
 * go in groups of KERN_RI (the int32 lanes of a vector); a group is a run of records of two
 * blocks:
 *   d[2][KERN_RI]      the f16 scales of block 2j and 2j + 1 of each row
 *   q[2][4][KERN_RI][4] chunk c of a block, lane r: bytes 4c..4c+3 of row r's nibbles, so its
 *                      low nibbles are elements 4c..4c+3 and its high ones 16+4c..16+4c+3
 *                      (Q8_0: q[2][8][KERN_RI][4], chunk c being quants 4c..4c+3;
 *                      Q4_1: m[2][KERN_RI], the minimums, between d and q)
 * An odd last block leaves its record's second half unused. F16 and BF16 groups are simpler:
 * K columns of KERN_RI values, column k holding element k of each row. Only the SIMD variants
 * interleave. */
#if defined(__AVX512F__)
#define KERN_RI 16
#elif defined(__AVX2__)
#define KERN_RI 8
#else
#define KERN_RI 0
#endif

#if KERN_RI
typedef struct q4_0_ri_record {
    uint16_t d[2][KERN_RI];
    uint8_t q[2][4][KERN_RI][4];
} q4_0_ri_record;
typedef struct q4_1_ri_record {
    uint16_t d[2][KERN_RI];
    uint16_t m[2][KERN_RI];
    uint8_t q[2][4][KERN_RI][4];
} q4_1_ri_record;
typedef struct q8_0_ri_record {
    uint16_t d[2][KERN_RI];
    int8_t q[2][8][KERN_RI][4];
} q8_0_ri_record;
/* Q5_0 and Q5_1: Q4_0's and Q4_1's records with each row's fifth bits between the scales and
 * the nibbles, reordered so that byte c holds those of chunk c's elements: 4c..4c+3 in bits
 * 0-3 (the low nibbles'), 16+4c..16+4c+3 in bits 4-7 (the high nibbles') */
typedef struct q5_0_ri_record {
    uint16_t d[2][KERN_RI];
    uint32_t qh[2][KERN_RI];
    uint8_t q[2][4][KERN_RI][4];
} q5_0_ri_record;
typedef struct q5_1_ri_record {
    uint16_t d[2][KERN_RI];
    uint16_t m[2][KERN_RI];
    uint32_t qh[2][KERN_RI];
    uint8_t q[2][4][KERN_RI][4];
} q5_1_ri_record;
#endif

/* One block of activations, quantised, for the interleaved kernels. */
typedef struct act_block {
    int8_t qs[LOOM_QK];
    float d;
    int32_t neg8sum; /* -8 x the sum of qs: Q4_0's (q - 8) offset, once per block */
} act_block;

/* Prepares activation row x (K floats, K a multiple of 32) as K / 32 act_blocks. */
void kern_prep_blocks(const float *x, int64_t K, act_block *out);
/* out[r * KERN_RI + i] = dot(row i of the group at w, activation row r), r < mr <= KERN_MR;
 * a: the first activation row's blocks, rows nb blocks apart. */
typedef void (*kern_ri_fn)(const unsigned char *w, int64_t nb, const act_block *a, int mr,
                           float *out);
void kern_q4_0_ri(const unsigned char *w, int64_t nb, const act_block *a, int mr, float *out);
void kern_q4_0_ri_vnni(const unsigned char *w, int64_t nb, const act_block *a, int mr, float *out);
void kern_q4_1_ri(const unsigned char *w, int64_t nb, const act_block *a, int mr, float *out);
void kern_q4_1_ri_vnni(const unsigned char *w, int64_t nb, const act_block *a, int mr, float *out);
void kern_q8_0_ri(const unsigned char *w, int64_t nb, const act_block *a, int mr, float *out);
void kern_q8_0_ri_vnni(const unsigned char *w, int64_t nb, const act_block *a, int mr, float *out);
void kern_q5_0_ri(const unsigned char *w, int64_t nb, const act_block *a, int mr, float *out);
void kern_q5_0_ri_vnni(const unsigned char *w, int64_t nb, const act_block *a, int mr, float *out);
void kern_q5_1_ri(const unsigned char *w, int64_t nb, const act_block *a, int mr, float *out);
void kern_q5_1_ri_vnni(const unsigned char *w, int64_t nb, const act_block *a, int mr, float *out);
/* IQ4_NL rows interleaved as Q4_0's are (the same records), the nibbles indexing IQ4's table */
void kern_iq4_nl_ri(const unsigned char *w, int64_t nb, const act_block *a, int mr, float *out);
void kern_iq4_nl_ri_vnni(const unsigned char *w, int64_t nb, const act_block *a, int mr,
                         float *out);
/* The same for F16/BF16 weights interleaved the same way (a group: K columns of KERN_RI values,
 * column k holding element k of each row); x[r] is activation row r. */
typedef void (*kern_float_ri_fn)(const unsigned char *w, int64_t K, const float *const *x, int mr,
                                 float *out);
void kern_f16_ri(const unsigned char *w, int64_t K, const float *const *x, int mr, float *out);
void kern_bf16_ri(const unsigned char *w, int64_t K, const float *const *x, int mr, float *out);
/* 2 <= ng <= KERN_RI_GROUPS adjacent groups (gstride bytes apart) at once, for
 * 2 <= mr <= KERN_MR activation rows: out[r * ng KERN_RI + i], i < ng KERN_RI. As many groups
 * as the registers hold accumulators for: 4 with AVX-512's 32, 2 with AVX2's 16. */
#if defined(__AVX512F__)
#define KERN_RI_GROUPS 4
#else
#define KERN_RI_GROUPS 2
#endif
typedef void (*kern_float_ri_n_fn)(const unsigned char *w, size_t gstride, int ng, int64_t K,
                                   const float *const *x, int mr, float *out);
void kern_f16_ri_n(const unsigned char *w, size_t gstride, int ng, int64_t K, const float *const *x,
                   int mr, float *out);
void kern_bf16_ri_n(const unsigned char *w, size_t gstride, int ng, int64_t K,
                    const float *const *x, int mr, float *out);
/* Prefill's pair, where widening W in the tile kernels costs FMA-port uops (AVX-512, and AVX2,
 * where 6 rows x 2 groups of sums fit the 16 registers: +12-19% F16 pp128 on a Sapphire
 * Rapids-class Xeon; an earlier machine measured the two ways the same): columns k0 .. k0 + kc
 * of 1 <= ng <= KERN_RI_GROUPS groups widened to f32 (column k's ng KERN_RI values at
 * wf + k ng KERN_RI), then 1 <= mr <= KERN_WIDEN_MR activation rows' columns k0 .. k0 + kc
 * against them, added to acc[r * ng KERN_RI + i]. */
#if defined(__AVX512F__) || defined(__AVX2__)
#define KERN_WIDEN_MR 6
typedef void (*kern_half_ri_widen_fn)(const unsigned char *w, size_t gstride, int ng, int64_t k0,
                                      int64_t kc, float *wf);
void kern_f16_ri_widen(const unsigned char *w, size_t gstride, int ng, int64_t k0, int64_t kc,
                       float *wf);
void kern_bf16_ri_widen(const unsigned char *w, size_t gstride, int ng, int64_t k0, int64_t kc,
                        float *wf);
void kern_f32_ri_n_acc(const float *wf, int ng, int64_t kc, const float *const *x, int64_t k0,
                       int mr, float *acc);
#endif

/* BF16 weights in 16-row groups of column pairs, for the AVX-512 BF16 dot product
 * (kern_bf16.c, avx512 variant only): activation rows as BF16 pairs, K / 2 rounded up. */
void kern_bf16_pack_x(const float *x, int64_t K, uint32_t *pairs);
/* 1 <= ng <= 4 groups (gstride bytes apart), 1 <= mr <= KERN_MR rows:
 * out[r * ng 16 + i], i < ng 16. */
void kern_bf16_dp(const unsigned char *w, size_t gstride, int ng, int64_t K,
                  const uint32_t *const *x, int mr, float *out);
/* kern_half_ri_widen for the pairs layout (k0 even), for prefill (kern_bf16.c) */
void kern_bf16_pairs_widen(const unsigned char *w, size_t gstride, int ng, int64_t k0, int64_t kc,
                           float *wf);

/* ---- The ABI 1.2 weight types (kern_kq.c) ---------------------------------------------------
 * Q2_K..Q6_K, IQ4_XS, Q5_0, Q5_1 and IQ4_NL rows are unpacked into one shape, 32 values at a
 * time: the values as int8 (offsets folded in), an integer scale and minimum per 16 of them
 * (vectors of 16, lanes 0-7 for values 0-15, 8-15 for 16-31), and float factors: value =
 * d (sc v) - dmin mn. Then one kernel takes them all, against act_blocks. */
typedef struct kq_chunk {
    int8_t v[32];
    int16_t sc[16];
    int16_t mn[16]; /* only for types with a minimum (kern_kq_has_min) */
} kq_chunk;
typedef struct kq_row {
    kq_chunk *c;     /* [K / 32] */
    float *d, *dmin; /* [K / 32] */
} kq_row;
int kern_kq_handles(loom_dtype wt);
int kern_kq_has_min(loom_dtype wt);
void kern_kq_unpack(loom_dtype wt, const unsigned char *w, int64_t K, kq_row *r);
/* out[r * KERN_NR + i] = dot(row w[i], activation row r), i < nr, r < mr <= KERN_MR; a: the
 * first activation row's nb blocks, rows nb blocks apart. */
void kern_kq(const kq_row *w, int nr, int has_min, const act_block *a, int64_t nb, int mr,
             float *out);
/* Q2_K..Q6_K and IQ4_XS rows dotted straight from the file's layout, no unpacking, against
 * activations quantised per 256 (one scale per super-block, so a super-block's products stay
 * integers until one FMA) with the sums of each 16 for the minimums and offsets. */
typedef struct act_k {
    int8_t qs[LOOM_QK_K]; /* in value order, or swapped (kern_kq_swapped) */
    float d;
    int16_t bsums[16]; /* sum of the values 16 i .. 16 i + 15 (value order) */
    float dsums[8];    /* d x the sum of the values 32 i .. 32 i + 31: a minimum per 32 meets
                        * it in one FMA */
} act_k;
/* 1 when this variant has a direct kernel for wt */
int kern_kq_direct_has(loom_dtype wt);
/* 1 when wt's direct kernel wants each 128 activations' second and third 32 swapped */
int kern_kq_swapped(loom_dtype wt);
void kern_prep_k(const float *x, int64_t K, int swapped, act_k *out);
/* out[r * KERN_NR + i] = dot(weight row i at w + i row_bytes, activation row r), i < nr <=
 * KERN_NR, r < mr <= KERN_MR; a: the first activation row's K / 256 blocks, rows adjacent;
 * vnni: the CPU has the variant's VNNI (AVX512-VNNI, AVX-VNNI; Q2_K then takes it). */
void kern_kq_direct(loom_dtype wt, const unsigned char *w, size_t row_bytes, int nr, int64_t K,
                    const act_k *a, int mr, int vnni, float *out);

/* Prepares activation row x (K floats, K a multiple of 32) into its groups. */
void kern_prep(const float *x, int64_t K, act_group *g, kern_layout layout);
/* The layout the kernels for weight type wt (with VNNI or not) expect. */
kern_layout kern_layout_for(loom_dtype wt, int vnni);
void kern_q8_0(const unsigned char *, size_t, int, const cpu_act *, int64_t, int, float *);
void kern_q4_0(const unsigned char *, size_t, int, const cpu_act *, int64_t, int, float *);
void kern_q4_1(const unsigned char *, size_t, int, const cpu_act *, int64_t, int, float *);
void kern_float(loom_dtype, const unsigned char *, size_t, int, const float *const *, int, int64_t,
                float *);
/* the VNNI builds of the integer kernels (avx512 and avx2 variants) */
void kern_q8_0_vnni(const unsigned char *, size_t, int, const cpu_act *, int64_t, int, float *);
void kern_q4_0_vnni(const unsigned char *, size_t, int, const cpu_act *, int64_t, int, float *);
void kern_q4_1_vnni(const unsigned char *, size_t, int, const cpu_act *, int64_t, int, float *);

#endif
