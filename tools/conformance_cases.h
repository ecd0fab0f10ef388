/*
 * tools/conformance_cases.h - loom-conformance's test cases: host images of a case's tensors
 * (shapes, padding, odd offsets, the bytes), and the catalogue of case families, one per op,
 * each making the variants of shapes and parameters that op is judged on against ref
 * (tools/conformance_cases.c). tools/conformance.c runs and judges them.
 */
#ifndef LOOM_TOOLS_CONFORMANCE_CASES_H
#define LOOM_TOOLS_CONFORMANCE_CASES_H

#include <loom/backend.h>

#define MAX_TENSORS 12

/* One tensor of a test case: its shape, where it sits in its buffer, and its host bytes. */
typedef struct spec {
    int used;
    int output; /* compared after the op */
    loom_dtype dtype;
    int64_t ne[4];
    uint64_t offset;                /* leading bytes in the buffer */
    uint64_t row_pad;               /* extra bytes between rows */
    uint64_t plane_pad, volume_pad; /* and between planes (dim 2) and volumes (dim 3) */
    int head_major; /* dims 1 and 2 swapped in memory: a KV cache laid out as the runner
                     * lays it ([block][head][slot], a head's slots of a block together) */
    unsigned char *host;
    uint64_t bytes; /* buffer size: offset + extent */
} spec;

typedef struct test_case {
    loom_op op;
    loom_dtype dtype; /* the dtype `supports` is asked about */
    char label[160];
    spec t[MAX_TENSORS];
    double tol;           /* normalised-error threshold */
    double *magnitude;    /* per element of the output, a cancellation-free scale for the
                             error (matmul: sum |x||w|), or NULL to use the output itself */
    int quality_vs_input; /* quantize: judge by round-trip error against the input */
    int prepare_w;        /* matmul: offer W to prepare_weight first (where the module has it) */
    int prepared;         /* set by run_case: prepare_weight returned a tensor, and it was used */
    /* scalar parameters */
    float eps, scale, freq_base, freq_scale;
    int32_t rope_mode, n_rot;
    uint32_t abi_minor; /* the ABI minor the case's parameters need (a module below skips it) */
    int32_t window;     /* attention's sliding window (ABI 1.4) */
    int32_t gating, normalize, accumulate; /* moe_route's and moe_combine's (ABI 1.5) */
    int32_t n_group, topk_group;           /* moe_route's group limit (ABI 1.7) */
    int32_t v_heads_tiled;                 /* gated_delta's head order (ABI 1.9) */
} test_case;

uint32_t rng_u32(void);
int64_t spec_rows(const spec *s);
/* t: s laid out in buf */
void spec_tensor(const spec *s, loom_buffer *buf, loom_tensor *t);
uint64_t spec_row_at(const spec *s, int64_t r);
/* row r of image (a host copy of s's buffer) as floats */
void get_row(const spec *s, const unsigned char *image, int64_t r, float *out);
void free_case(test_case *tc);
/* A matmul case: X [M, K] f32, W [N, K] of dtype dt, a bias when asked, Y [M, N]. */
void make_matmul_shape(test_case *tc, loom_dtype dt, int64_t M, int64_t K, int64_t N, int bias);
/* matmul_id over a stack of `experts` [N, K] matrices, k chosen per token; x per slot (the
 * down projection) or one row per token; padded: the matrices lie apart in the buffer */
typedef struct matmul_id_shape {
    int tokens, experts, k, K, N, per_slot, padded;
} matmul_id_shape;
void make_matmul_id_shape(test_case *tc, loom_dtype dt, const matmul_id_shape *s);

/* An op's cases: make(tc, dtype, v) fills variant v < n_variants for the dtype, or sets tc->op
 * to LOOM_OP_COUNT when that variant does not apply to it. */
typedef struct case_family {
    loom_op op;
    int n_variants;
    void (*make)(test_case *tc, loom_dtype dt, int variant);
} case_family;
extern const case_family conformance_families[];
extern const int conformance_n_families;
/* The dtypes each op is asked about (what `supports` takes for it). */
int conformance_op_dtype_applies(loom_op op, loom_dtype dt);

#endif
