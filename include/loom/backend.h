/*
 * loom/backend.h - the compute backend plugin ABI.
 *
 * A backend is a shared object that exports one C function, LOOM_BACKEND_ENTRY_SYMBOL.
 * loom dlopens every candidate file, calls the entry, checks the ABI version the module
 * declares, asks it to probe the machine, and opens the best usable one. This header is
 * the whole contract: a backend author needs nothing else from loom (and may include
 * nothing else), and checks the result with `loom-conformance path/to/module.so`.
 *
 * Objects, from the outside in:
 *   loom_backend_module  what a file offers: name, variant, probe, open       (static)
 *   loom_probe_result    what the probe found: score, devices, reason         (filled by probe)
 *   loom_backend         one opened device: its function table + private state
 *   loom_buffer          opaque device memory, only touched through the table
 *   loom_tensor          a descriptor: dtype, shape, strides, buffer + offset
 *
 * Versioning (see docs/ARCHITECTURE.md):
 *   - The module declares the ABI major.minor it was built against. loom accepts a module whose
 *     major equals LOOM_BACKEND_ABI_MAJOR and whose minor is <= loom's own minor.
 *   - Every struct that crosses the boundary and may grow starts with `uint32_t struct_size`.
 *     Structs only ever grow by appending members. The side that reads a struct reads no member
 *     past the struct_size the other side declared; a missing member reads as zero / NULL,
 *     and a NULL or missing op means "not supported".
 *   - Op parameter structs may grow by appending members whose zero value keeps the old meaning.
 *   - loom_tensor is frozen for a major version (it is passed in arrays and by value).
 *   - Removing or reordering anything, or changing a meaning, is a major bump.
 *
 * Execution model: ops are enqueued in call order on the backend's single stream and may run
 * asynchronously; `synchronize` waits for all of them. Copies to the host block until the data
 * is there; copies from the host return once the source may be reused. All sizes and offsets
 * are in bytes unless a name says elements.
 */
#ifndef LOOM_BACKEND_H
#define LOOM_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LOOM_BACKEND_ABI_MAJOR 1
#define LOOM_BACKEND_ABI_MINOR 9

/* The one symbol a module exports; its type is loom_backend_entry_fn. */
#define LOOM_BACKEND_ENTRY_SYMBOL "loom_backend_entry"

#if defined(_WIN32)
#define LOOM_BACKEND_EXPORT __declspec(dllexport)
#else
#define LOOM_BACKEND_EXPORT __attribute__((visibility("default")))
#endif

/* ---- Status codes ------------------------------------------------------------------------ */

typedef enum loom_status {
    LOOM_OK = 0,
    LOOM_ERR_UNSUPPORTED = 1, /* op, dtype or shape not implemented by this backend */
    LOOM_ERR_INVALID = 2,     /* bad argument: shapes disagree, NULL where required, ... */
    LOOM_ERR_OUT_OF_MEMORY = 3,
    LOOM_ERR_DEVICE = 4, /* the device or its driver failed */
    LOOM_ERR_INTERNAL = 5,
} loom_status;

/* ---- Data types --------------------------------------------------------------------------
 * The numeric values are GGUF's tensor type ids, so a type read from a file needs no mapping,
 * and the block types use GGUF's byte layouts, so weights are used in place. */

/* Every dtype once. Plain types: X(ID, GGUF id, name, bytes per element), the float ones
 * (weights and activations) and the index type. Quantised types: X(ID, GGUF id, name, elements
 * per block, layout), the layout naming the block struct loom_block_<layout> and its reference
 * converters loom_quantize_row_<layout> and loom_dequantize_row_<layout> in <loom/quants.h>.
 * The enum, names, sizes, row conversions and the lists of every type that reports walk are
 * generated from these, in this order (docs/ARCHITECTURE.md, "Adding a dtype"). */
#define LOOM_FLOAT_DTYPES(X)                                                                       \
    X(F32, 0, "f32", 4)                                                                            \
    X(F16, 1, "f16", 2)    /* IEEE binary16 */                                                     \
    X(BF16, 30, "bf16", 2) /* the upper half of an IEEE binary32 */
#define LOOM_INDEX_DTYPES(X) X(I32, 26, "i32", 4)
#define LOOM_PLAIN_DTYPES(X) LOOM_FLOAT_DTYPES(X) LOOM_INDEX_DTYPES(X)
/* Q8_0: blocks of 32, f16 scale d and 32 int8, x = q d; Q4_0: f16 d and 16 bytes of nibbles,
 * x = (q - 8) d; Q4_1: f16 d and min m, x = q d + m. The rest (ABI 1.2 on) are laid out in
 * <loom/quants.h>. */
#define LOOM_QUANT_DTYPES(X)                                                                       \
    X(Q8_0, 8, "q8_0", LOOM_QK, q8_0)                                                              \
    X(Q4_0, 2, "q4_0", LOOM_QK, q4_0)                                                              \
    X(Q4_1, 3, "q4_1", LOOM_QK, q4_1)                                                              \
    X(Q5_0, 6, "q5_0", LOOM_QK, q5_0)                                                              \
    X(Q5_1, 7, "q5_1", LOOM_QK, q5_1)                                                              \
    X(IQ4_NL, 20, "iq4_nl", LOOM_QK, iq4_nl)                                                       \
    X(Q2_K, 10, "q2_K", LOOM_QK_K, q2_k)                                                           \
    X(Q3_K, 11, "q3_K", LOOM_QK_K, q3_k)                                                           \
    X(Q4_K, 12, "q4_K", LOOM_QK_K, q4_k)                                                           \
    X(Q5_K, 13, "q5_K", LOOM_QK_K, q5_k)                                                           \
    X(Q6_K, 14, "q6_K", LOOM_QK_K, q6_k)                                                           \
    X(IQ4_XS, 23, "iq4_xs", LOOM_QK_K, iq4_xs)
/* The types a weight may have, for lists: {LOOM_WEIGHT_DTYPES(LOOM_DTYPE_ITEM)} */
#define LOOM_WEIGHT_DTYPES(X) LOOM_FLOAT_DTYPES(X) LOOM_QUANT_DTYPES(X)
#define LOOM_DTYPE_ITEM(id, ...) LOOM_##id,

/* clang-format off */
typedef enum loom_dtype {
#define LOOM_DTYPE_ID_(id, gguf, ...) LOOM_##id = gguf,
    LOOM_PLAIN_DTYPES(LOOM_DTYPE_ID_)
    LOOM_QUANT_DTYPES(LOOM_DTYPE_ID_)
#undef LOOM_DTYPE_ID_
} loom_dtype;
/* clang-format on */

/* Reference scalar conversions, exact and round-to-nearest-even, shared so that every backend
 * and loom itself agree bit for bit on what a half-precision value means. */
static inline float loom_f32_from_bits(uint32_t u)
{
    union {
        uint32_t u;
        float f;
    } v;
    v.u = u;
    return v.f;
}

static inline uint32_t loom_bits_from_f32(float f)
{
    union {
        float f;
        uint32_t u;
    } v;
    v.f = f;
    return v.u;
}

static inline float loom_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    if (exp == 0x1f) /* inf / nan */
        return loom_f32_from_bits(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        /* zero or subnormal: man * 2^-24 is exact in f32 */
        float f = (float)man * (1.0f / 16777216.0f);
        return sign ? -f : f;
    }
    return loom_f32_from_bits(sign | ((exp + 112) << 23) | (man << 13));
}

static inline uint16_t loom_f32_to_f16(float f)
{
    uint32_t x = loom_bits_from_f32(f);
    uint32_t sign = (x >> 16) & 0x8000;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) /* inf stays inf, nan stays a quiet nan */
        return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0));
    if (ax >= 0x477ff000u) /* rounds to >= 65520: overflow to inf */
        return (uint16_t)(sign | 0x7c00);
    if (ax < 0x38800000u) {
        /* result is subnormal or zero: round ax * 2^24 to an integer, nearest even */
        if (ax < 0x33000000u) /* < 2^-25: rounds to zero */
            return (uint16_t)sign;
        uint32_t man = (ax & 0x7fffff) | 0x800000;
        int shift = 126 - (int)(ax >> 23); /* 14..24 */
        uint32_t q = man >> shift;
        uint32_t rem = man & ((1u << shift) - 1);
        uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1)))
            q++;
        return (uint16_t)(sign | q);
    }
    /* normal: rebias, then round the 13 dropped bits to nearest even (a carry may bump the
     * exponent, which is still the right answer) */
    uint32_t h = ((ax - 0x38000000u) >> 13);
    uint32_t rem = ax & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1)))
        h++;
    return (uint16_t)(sign | h);
}

static inline float loom_bf16_to_f32(uint16_t b)
{
    return loom_f32_from_bits((uint32_t)b << 16);
}

static inline uint16_t loom_f32_to_bf16(float f)
{
    uint32_t x = loom_bits_from_f32(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) /* nan: keep it a quiet nan */
        return (uint16_t)((x >> 16) | 0x40);
    x += 0x7fff + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
}

#include "quants.h"

/* Elements per storage unit (1, LOOM_QK or LOOM_QK_K) and bytes per unit; 0 for an unknown
 * dtype. */
/* clang-format off */
#define LOOM_PLAIN_ELEMS_(id, gguf, name, bytes) case LOOM_##id: return 1;
#define LOOM_QUANT_ELEMS_(id, gguf, name, elems, layout) case LOOM_##id: return elems;
#define LOOM_PLAIN_BYTES_(id, gguf, name, bytes) case LOOM_##id: return bytes;
#define LOOM_QUANT_BYTES_(id, gguf, name, elems, layout) \
    case LOOM_##id: return (int64_t)sizeof(loom_block_##layout);
#define LOOM_DTYPE_NAME_(id, gguf, name, ...) case LOOM_##id: return name;
/* clang-format on */

static inline int64_t loom_dtype_block_elems(loom_dtype t)
{
    switch (t) {
        LOOM_PLAIN_DTYPES(LOOM_PLAIN_ELEMS_)
        LOOM_QUANT_DTYPES(LOOM_QUANT_ELEMS_)
    }
    return 0;
}

static inline int64_t loom_dtype_block_bytes(loom_dtype t)
{
    switch (t) {
        LOOM_PLAIN_DTYPES(LOOM_PLAIN_BYTES_)
        LOOM_QUANT_DTYPES(LOOM_QUANT_BYTES_)
    }
    return 0;
}

static inline const char *loom_dtype_name(loom_dtype t)
{
    switch (t) {
        LOOM_PLAIN_DTYPES(LOOM_DTYPE_NAME_)
        LOOM_QUANT_DTYPES(LOOM_DTYPE_NAME_)
    }
    return "unknown";
}
#undef LOOM_PLAIN_ELEMS_
#undef LOOM_QUANT_ELEMS_
#undef LOOM_PLAIN_BYTES_
#undef LOOM_QUANT_BYTES_
#undef LOOM_DTYPE_NAME_

/* Bytes of one row of n elements, or -1 when n is not a whole number of blocks. */
static inline int64_t loom_row_bytes(loom_dtype t, int64_t n)
{
    int64_t be = loom_dtype_block_elems(t), bb = loom_dtype_block_bytes(t);
    if (be <= 0 || bb <= 0 || n < 0 || n % be != 0 || n / be > INT64_MAX / bb)
        return -1;
    return n / be * bb;
}

/* clang-format off */
#define LOOM_DEQUANTIZE_ROW_(id, gguf, name, elems, layout) \
    case LOOM_##id: loom_dequantize_row_##layout((const loom_block_##layout *)src, dst, n); return;
#define LOOM_QUANTIZE_ROW_(id, gguf, name, elems, layout) \
    case LOOM_##id: loom_quantize_row_##layout(src, (loom_block_##layout *)dst, n); return;
/* clang-format on */

/* A row of n elements of dtype t to and from f32, little-endian as GGUF stores them, with the
 * reference conversions of <loom/quants.h> (i32 converts by value). For block types n is a
 * multiple of the block. */
static inline void loom_row_to_f32(loom_dtype t, const void *src, float *dst, int64_t n)
{
    const unsigned char *p = (const unsigned char *)src;
    switch (t) {
        LOOM_QUANT_DTYPES(LOOM_DEQUANTIZE_ROW_)
    default: break;
    }
    for (int64_t i = 0; i < n; i++) {
        if (t == LOOM_F16 || t == LOOM_BF16) {
            uint16_t h = (uint16_t)(p[2 * i] | p[2 * i + 1] << 8);
            dst[i] = t == LOOM_F16 ? loom_f16_to_f32(h) : loom_bf16_to_f32(h);
        } else {
            uint32_t u = (uint32_t)p[4 * i] | (uint32_t)p[4 * i + 1] << 8 |
                (uint32_t)p[4 * i + 2] << 16 | (uint32_t)p[4 * i + 3] << 24;
            dst[i] = t == LOOM_I32 ? (float)(int32_t)u : loom_f32_from_bits(u);
        }
    }
}

static inline void loom_row_from_f32(loom_dtype t, const float *src, void *dst, int64_t n)
{
    unsigned char *p = (unsigned char *)dst;
    switch (t) {
        LOOM_QUANT_DTYPES(LOOM_QUANTIZE_ROW_)
    default: break;
    }
    for (int64_t i = 0; i < n; i++) {
        if (t == LOOM_F16 || t == LOOM_BF16) {
            uint16_t h = t == LOOM_F16 ? loom_f32_to_f16(src[i]) : loom_f32_to_bf16(src[i]);
            p[2 * i] = (unsigned char)h;
            p[2 * i + 1] = (unsigned char)(h >> 8);
        } else {
            uint32_t u = t == LOOM_I32 ? (uint32_t)(int32_t)src[i] : loom_bits_from_f32(src[i]);
            p[4 * i] = (unsigned char)u;
            p[4 * i + 1] = (unsigned char)(u >> 8);
            p[4 * i + 2] = (unsigned char)(u >> 16);
            p[4 * i + 3] = (unsigned char)(u >> 24);
        }
    }
}
#undef LOOM_DEQUANTIZE_ROW_
#undef LOOM_QUANTIZE_ROW_

/* ---- Tensors ------------------------------------------------------------------------------
 * Dimension 0 is the innermost (fastest varying), as in GGUF: a matrix X[M,K] of M rows of K
 * elements has ne = {K, M, 1, 1}. Rows are contiguous: nb[0] is the element size, or the block
 * size for block types (ne[0] must then be a multiple of the type's block). nb[1..3] are byte strides and
 * may be larger than dense, so a tensor can view every other row or one half of each row of a
 * wider matrix. Unused dimensions have ne = 1.
 *
 * Row ops (norms, elementwise, get_rows' dst, quantize/dequantize/convert) see a 3-D or 4-D
 * tensor as ne[1] * ne[2] * ne[3] rows of ne[0]: row (i1, i2, i3) starts at byte
 * offset + i1*nb[1] + i2*nb[2] + i3*nb[3], and two tensors' rows pair up by the same
 * (i1, i2, i3) (x with dst, a with b). Read every row through all three strides: loom passes
 * padded and non-dense ones (loom-conformance has cases with each dimension padded). */

typedef struct loom_buffer loom_buffer; /* opaque, owned by the backend */

typedef struct loom_tensor {
    loom_buffer *buf; /* the buffer holding the data */
    uint64_t offset;  /* byte offset of element (0,0,0,0) in buf */
    loom_dtype dtype;
    int32_t n_dims; /* 1..4, for messages; the math uses ne[] */
    int64_t ne[4];  /* elements per dimension, innermost first */
    uint64_t nb[4]; /* byte strides per dimension */
} loom_tensor;

/* ---- Ops ----------------------------------------------------------------------------------
 * Each op has a parameter struct starting with struct_size (set by the caller to sizeof the
 * struct it was compiled with). Shapes below are written outermost first, in brackets, as the
 * math is usually written: X[M,K] means M rows of K. Unless a line says otherwise, activations
 * are F32, outputs are F32, and a dst may not overlap its inputs. */

/* Every op once: X(ID, name, parameter struct). The enum, the names, the op table's slots, the
 * host's dispatch, its CPU fallback and the trace decorator are generated from this list. Its
 * order is the ABI's: the 1.0 ops fill the table's first op slots in this order; an op a later
 * minor adds goes in LOOM_OPS_APPENDED, whose slots follow prepare_weight (docs/ARCHITECTURE.md,
 * "Adding an op"). */
#define LOOM_OPS_1_0(X)                                                                            \
    X(MATMUL, matmul, loom_matmul_params)                                                          \
    X(GET_ROWS, get_rows, loom_get_rows_params)                                                    \
    X(RMS_NORM, rms_norm, loom_norm_params)                                                        \
    X(LAYER_NORM, layer_norm, loom_norm_params)                                                    \
    X(ROPE, rope, loom_rope_params)                                                                \
    X(ADD, add, loom_elementwise_params)                                                           \
    X(MUL, mul, loom_elementwise_params)                                                           \
    X(SCALE, scale, loom_elementwise_params)                                                       \
    X(SILU_MUL, silu_mul, loom_elementwise_params)                                                 \
    X(GELU, gelu, loom_elementwise_params)                                                         \
    X(KV_STORE, kv_store, loom_kv_store_params)                                                    \
    X(ATTENTION, attention, loom_attention_params)                                                 \
    X(QUANTIZE, quantize, loom_convert_params)                                                     \
    X(DEQUANTIZE, dequantize, loom_convert_params)                                                 \
    X(CONVERT, convert, loom_convert_params)
/* ABI 1.5: mixture-of-experts */
#define LOOM_OPS_APPENDED(X)                                                                       \
    X(MOE_ROUTE, moe_route, loom_moe_route_params)                                                 \
    X(MATMUL_ID, matmul_id, loom_matmul_id_params)                                                 \
    X(MOE_COMBINE, moe_combine, loom_moe_combine_params)                                           \
    X(SIGMOID_MUL, sigmoid_mul, loom_elementwise_params)                                           \
    X(SSM_CONV, ssm_conv, loom_ssm_conv_params)                                                    \
    X(GATED_DELTA, gated_delta, loom_gated_delta_params)
#define LOOM_OPS(X) LOOM_OPS_1_0(X) LOOM_OPS_APPENDED(X)

/* clang-format off */
typedef enum loom_op {
#define LOOM_OP_ID_(id, name, params) LOOM_OP_##id,
    LOOM_OPS(LOOM_OP_ID_)
#undef LOOM_OP_ID_
    LOOM_OP_COUNT /* the ops this header knows: an array bound, never an op */
} loom_op;
/* clang-format on */
/* The ops of ABI 1.0 (those whose slots come before prepare_weight). */
#define LOOM_OP_COUNT_V1_0 (LOOM_OP_CONVERT + 1)

/* "matmul", "kv_store"...: the names reports and LOOM_REF_DENY use; "?" past the known ops. */
static inline const char *loom_op_name(loom_op op)
{
#define LOOM_OP_NAME_(id, name, params) #name,
    static const char *const names[LOOM_OP_COUNT] = {LOOM_OPS(LOOM_OP_NAME_)};
#undef LOOM_OP_NAME_
    return (unsigned)op < LOOM_OP_COUNT ? names[op] : "?";
}

/* Y[M,N] = X[M,K] * W[N,K]^T (+ bias[N]). W: any float or quantised dtype (K a multiple of the
 * type's block: 32, or 256 for the K-quants and IQ4_XS), as `supports` says. M may be 0
 * (nothing to do). */
typedef struct loom_matmul_params {
    uint32_t struct_size;
    const loom_tensor *x;    /* [M, K] F32 */
    const loom_tensor *w;    /* [N, K] any weight dtype */
    const loom_tensor *bias; /* [N] F32, or NULL */
    const loom_tensor *y;    /* [M, N] F32 */
} loom_matmul_params;

/* dst[i,:] = src[ids[i],:] converted to F32. An id outside [0, rows) is LOOM_ERR_INVALID. */
typedef struct loom_get_rows_params {
    uint32_t struct_size;
    const loom_tensor *src; /* [rows, K] any weight dtype */
    const loom_tensor *ids; /* [n] I32 */
    const loom_tensor *dst; /* [n, K] F32 */
} loom_get_rows_params;

/* Per row of n: rms_norm  y = x / sqrt(mean(x^2) + eps) * weight
 *               layer_norm y = (x - mean) / sqrt(var + eps) * weight + bias
 * weight and bias are [n] F32 and optional (NULL = 1 and 0). dst may equal x. */
typedef struct loom_norm_params {
    uint32_t struct_size;
    const loom_tensor *x;      /* [rows, n] */
    const loom_tensor *weight; /* [n] or NULL */
    const loom_tensor *bias;   /* [n] or NULL; layer_norm only */
    const loom_tensor *dst;    /* [rows, n] */
    float eps;
} loom_norm_params;

typedef enum loom_rope_mode {
    /* Rotate pairs (i, i + n_rot/2) for i < n_rot/2: "rotate half", GPT-NeoX, HF Llama/Qwen. */
    LOOM_ROPE_NEOX = 0,
    /* Rotate pairs (2i, 2i+1) for i < n_rot/2: GPT-J, GGUF llama layout, ChatGLM2/3/4. */
    LOOM_ROPE_ADJACENT = 1,
    /* ChatGLM-6B: the first half of each head is NEOX-rotated over head_dim/2 dims by pos, the
     * second half likewise by pos2 (the block position). n_rot must equal head_dim. */
    LOOM_ROPE_GLM_2D = 2,
} loom_rope_mode;

/* Rotary position embedding. The angle of pair i at position p is
 *   p * freq_scale * freq_base^(-2i / n) / freq_factors[i]
 * (n = n_rot, or head_dim/2 for LOOM_ROPE_GLM_2D; no freq_factors: / 1). Dims at and beyond
 * n_rot are copied unchanged (partial rotary). dst may equal x. */
typedef struct loom_rope_params {
    uint32_t struct_size;
    const loom_tensor *x;    /* [tokens, heads, head_dim] */
    const loom_tensor *pos;  /* [tokens] I32 */
    const loom_tensor *pos2; /* [tokens] I32, LOOM_ROPE_GLM_2D only, else NULL */
    const loom_tensor *dst;  /* [tokens, heads, head_dim] */
    int32_t mode;            /* loom_rope_mode */
    int32_t n_rot;           /* even, <= head_dim */
    float freq_base;         /* 10000 for most models */
    float freq_scale;        /* 1 = none; linear position scaling otherwise */
    /* ABI 1.4: [n_rot / 2] F32 divisors of each pair's frequency (Llama 3.1's rope_freqs), or
     * NULL. loom passes it only to a module of minor 4 or later; NEOX and ADJACENT modes. */
    const loom_tensor *freq_factors;
} loom_rope_params;

/* Elementwise, by op:
 *   add       dst = a + b          b: same shape as a, or one row [n] broadcast over rows
 *   mul       dst = a * b          as add
 *   scale     dst = a * scale      b unused
 *   silu_mul  dst = silu(a) * b    (SwiGLU; a and b may be views of one [M, 2F] matrix)
 *   gelu      dst = gelu_tanh(a)   b unused
 *   sigmoid_mul  dst = sigmoid(a) * b   (ABI 1.8; an output gate: a the gate, b what it gates)
 * dst may equal a. */
typedef struct loom_elementwise_params {
    uint32_t struct_size;
    const loom_tensor *a;
    const loom_tensor *b;
    const loom_tensor *dst;
    float scale;
} loom_elementwise_params;

/* Paged KV cache: cache[blocks, block_size, kv_heads, head_dim] in F32, F16 or Q8_0 (head_dim
 * a multiple of 32 for Q8_0, each (slot, head) row quantised on its own). The cache's strides
 * need not be dense and are not in this order in memory: loom's runner keeps one head's slots
 * of a block together (nb[2] = one row, nb[1] = block_size rows, nb[3] = a whole block), so
 * address (block, slot, head) as block*nb[3] + slot*nb[2] + head*nb[1] from cache's offset.
 * kv_store writes src row t into cache slot slots[t] = block * block_size + offset. A negative
 * slot skips the row (padding). */
typedef struct loom_kv_store_params {
    uint32_t struct_size;
    const loom_tensor *src;   /* [tokens, kv_heads, head_dim] F32 */
    const loom_tensor *slots; /* [tokens] I32 */
    const loom_tensor *cache; /* [blocks, block_size, kv_heads, head_dim] */
} loom_kv_store_params;

/* Fused attention over the paged cache, for a batch of tokens from any number of sequences.
 * Token t belongs to sequence seq[t] and sits at position pos[t]; it attends to the keys of its
 * sequence at positions j with j <= pos[t], or j < prefix_len[seq[t]] (ChatGLM-6B's
 * bidirectional prefix; NULL prefix_len = purely causal). Key j of sequence s lives in cache
 * block block_table[s, j / block_size] at offset j % block_size. Query head h reads kv head
 * h / (heads / kv_heads) (GQA / MQA). out = softmax(q k^T * scale) v, without materialising the
 * score matrix. Every key a token attends to must already be stored. */
typedef struct loom_attention_params {
    uint32_t struct_size;
    const loom_tensor *q;           /* [tokens, heads, head_dim] F32 */
    const loom_tensor *k_cache;     /* [blocks, block_size, kv_heads, head_dim] */
    const loom_tensor *v_cache;     /* same shape and dtype as k_cache */
    const loom_tensor *block_table; /* [seqs, max_blocks_per_seq] I32 */
    const loom_tensor *seq;         /* [tokens] I32 */
    const loom_tensor *pos;         /* [tokens] I32 */
    const loom_tensor *prefix_len;  /* [seqs] I32, or NULL */
    const loom_tensor *dst;         /* [tokens, heads, head_dim] F32 */
    float scale;                    /* usually 1/sqrt(head_dim) */
    /* ABI 1.4: a sliding window (Mistral's sliding_window): token t attends only to keys j >
     * pos[t] - window; 0 = no window. Not combined with prefix_len. loom passes it only to a
     * module of minor 4 or later. */
    int32_t window;
} loom_attention_params;

/* quantize:   dst (Q8_0, Q4_0 or Q4_1) from src F32, row by row (row length a multiple of 32)
 * dequantize: dst F32 from src of any block type
 * convert:    between F32, F16 and BF16 (round to nearest even)
 * Same element shape on both sides. `supports` is asked about the quantised type for quantize
 * and dequantize, and about the target type for convert (saying yes means from every one of
 * F32, F16 and BF16). */
typedef struct loom_convert_params {
    uint32_t struct_size;
    const loom_tensor *src;
    const loom_tensor *dst;
} loom_convert_params;

/* ---- Mixture of experts (ABI 1.5) ---------------------------------------------------------
 * A sparse feed-forward layer in three ops: the router's logits (a matmul) -> moe_route picks
 * k experts per token and their weights -> matmul_id runs each token's rows through its chosen
 * experts' matrices (gate and up, silu_mul, down) -> moe_combine adds the weighted results to
 * the residual stream. A gated shared expert (Qwen2-MoE) is moe_route over one "expert" with
 * sigmoid gating, then moe_combine. */

typedef enum loom_moe_gating {
    LOOM_MOE_SOFTMAX = 0, /* scores = softmax of the logits over every expert (Qwen, Mixtral) */
    LOOM_MOE_SIGMOID = 1, /* scores = sigmoid of each logit (GLM-4.5, DeepSeek-V3) */
} loom_moe_gating;

/* Per token t: the k = ids->ne[0] experts of highest choice score, best first, where the
 * choice score is the logit itself when bias is NULL, else score + bias (GLM-4.5's
 * e_score_correction_bias steers the choice only); ties go to the lower expert index. The
 * weights are the chosen experts' scores, divided by their sum when normalize is set
 * (norm_topk_prob), then multiplied by scale (GLM-4.5's routed_scaling_factor; 1 for none).
 * Group-limited routing (ABI 1.7; DeepSeek-V3's and GLM-4.5's n_group / topk_group): with
 * n_group > 1 the experts form n_group equal groups of consecutive indices, a group's score is
 * the sum of its two best choice scores (its one, in groups of one), and the k experts are
 * chosen only among those of the topk_group best groups (the lower group first among equals);
 * loom_moe_route_groups reads the two members, loom_moe_groups_kept picks the groups. */
typedef struct loom_moe_route_params {
    uint32_t struct_size;
    const loom_tensor *logits;  /* [tokens, experts] F32 */
    const loom_tensor *bias;    /* [experts] F32, or NULL */
    const loom_tensor *ids;     /* [tokens, k] I32, k <= experts */
    const loom_tensor *weights; /* [tokens, k] F32 */
    int32_t gating;             /* loom_moe_gating */
    int32_t normalize;          /* nonzero: weights divided by their sum */
    float scale;                /* finite and positive */
    /* ABI 1.7: 0 or 1, no groups; else experts % n_group == 0, 1 <= topk_group <= n_group
     * and k <= topk_group * experts / n_group */
    int32_t n_group, topk_group;
} loom_moe_route_params;

/* The group limit of a call, 1 and 1 for none (a caller of minor 6 or older sent neither). */
static inline void loom_moe_route_groups(const loom_moe_route_params *p, int32_t *n_group,
                                         int32_t *topk_group)
{
    int has = p->struct_size >=
        (uint32_t)(offsetof(loom_moe_route_params, topk_group) + sizeof p->topk_group);
    *n_group = has && p->n_group > 1 ? p->n_group : 1;
    *topk_group = has && p->n_group > 1 ? p->topk_group : 1;
}

/* Which of n_group groups of experts (experts / n_group each) a token may choose from, by its
 * choice scores: keep[g] = 1 for the topk_group groups of highest score (the sum of a group's
 * two best choice scores), 0 for the rest. */
static inline void loom_moe_groups_kept(const float *choice, int64_t experts, int32_t n_group,
                                        int32_t topk_group, unsigned char *keep)
{
    int64_t per = experts / n_group;
    for (int32_t g = 0; g < n_group; g++)
        keep[g] = 0;
    for (int32_t j = 0; j < topk_group; j++) {
        int32_t best = -1;
        double best_score = 0;
        for (int32_t g = 0; g < n_group; g++) {
            if (keep[g])
                continue;
            double first = -1e300, second = -1e300; /* below any finite float */
            for (int64_t e = g * per; e < (g + 1) * per; e++) {
                if (choice[e] > first)
                    second = first, first = choice[e];
                else if (choice[e] > second)
                    second = choice[e];
            }
            double score = first + (per > 1 ? second : 0);
            if (best < 0 || score > best_score)
                best = g, best_score = score;
        }
        keep[best] = 1;
    }
}

/* y[t, j, :] = x[t, j or 0, :] W[ids[t, j]]^T for every token t and slot j < k: matmul with
 * each row's own weight matrix out of a stack of experts. W is [experts, N, K] (ne {K, N,
 * experts}), of any dtype `supports` claims for matmul_id; x has one row per token that every
 * slot reads (the gate and up projections) or one per slot (the down projection). An id
 * outside [0, experts) is LOOM_ERR_INVALID. */
typedef struct loom_matmul_id_params {
    uint32_t struct_size;
    const loom_tensor *x;   /* [tokens, 1 or k, K] F32 */
    const loom_tensor *w;   /* [experts, N, K] */
    const loom_tensor *ids; /* [tokens, k] I32 */
    const loom_tensor *y;   /* [tokens, k, N] F32 */
} loom_matmul_id_params;

/* dst[t, :] = sum over j of weights[t, j] * src[t, j, :], added to what dst holds when
 * accumulate is nonzero (the residual stream), else written over it. */
typedef struct loom_moe_combine_params {
    uint32_t struct_size;
    const loom_tensor *src;     /* [tokens, k, n] F32 */
    const loom_tensor *weights; /* [tokens, k] F32 */
    const loom_tensor *dst;     /* [tokens, n] F32 */
    int32_t accumulate;
} loom_moe_combine_params;

/* ---- Recurrent layers (ABI 1.8) ------------------------------------------------------------
 * Linear attention keeps, per sequence, a fixed-size state instead of a growing KV cache (Gated
 * DeltaNet: Qwen3-Next, Qwen3.5). A state tensor is [slots, ...]: one slot per sequence the
 * caller runs at once; token t reads and writes slot seq[t]. A batch may mix sequences, but the
 * tokens of one sequence appear in it in order, and each op runs a sequence's tokens one after
 * another (a backend may compute a long run of them in chunks, as long as the result is that
 * of the recurrence). The caller zeroes a slot before a sequence's first token. */

/* Causal depthwise convolution with SiLU (the conv1d before Gated DeltaNet and Mamba): for
 * token t of slot s = seq[t], with the window w = [state[s] (kernel - 1 earlier inputs, oldest
 * first); x[t]],
 *   dst[t, c] = silu(sum over j < kernel of weight[c, j] * w[j, c])
 * after which state[s] holds the window's last kernel - 1 inputs. `supports` is asked about
 * weight's dtype. */
typedef struct loom_ssm_conv_params {
    uint32_t struct_size;
    const loom_tensor *x;      /* [tokens, channels] F32 */
    const loom_tensor *weight; /* [channels, kernel] F32, F16 or BF16, kernel >= 2 */
    const loom_tensor *seq;    /* [tokens] I32, slots of state */
    const loom_tensor *state;  /* [slots, kernel - 1, channels] F32, read and written */
    const loom_tensor *dst;    /* [tokens, channels] F32 */
} loom_ssm_conv_params;

/* The gated delta rule (Gated DeltaNet's recurrence, as Hugging Face's qwen3_next and qwen3_5
 * compute it), per token t of slot s = seq[t] and value head h, which reads key head
 * hk = h / (v_heads / k_heads), the value heads grouped by key head as Hugging Face orders them,
 * or (ABI 1.9, v_heads_tiled) hk = h % k_heads, the order llama.cpp's qwen35 files store them in
 * (loom_gated_delta_key_head says which):
 *   q' = q[t, hk] / sqrt(sum q^2 + 1e-6) / sqrt(d_k),  k' = k[t, hk] / sqrt(sum k^2 + 1e-6)
 *   decay = exp(a[h] * softplus(alpha[t, h] + dt_bias[h])),  b = sigmoid(beta[t, h])
 *   S = S * decay;  S = S + k' (b (v[t, h] - k' S))^T;  dst[t, h] = q' S
 * with S = state[s, h], a [d_k, d_v] matrix stored by columns: state[s, h, j, i] = S[i, j]. */
typedef struct loom_gated_delta_params {
    uint32_t struct_size;
    const loom_tensor *q;       /* [tokens, k_heads, d_k] F32 */
    const loom_tensor *k;       /* [tokens, k_heads, d_k] F32 */
    const loom_tensor *v;       /* [tokens, v_heads, d_v] F32; v_heads a multiple of k_heads */
    const loom_tensor *alpha;   /* [tokens, v_heads] F32 */
    const loom_tensor *beta;    /* [tokens, v_heads] F32 */
    const loom_tensor *a;       /* [v_heads] F32, negative: -exp(A_log) */
    const loom_tensor *dt_bias; /* [v_heads] F32 */
    const loom_tensor *seq;     /* [tokens] I32, slots of state */
    const loom_tensor *state;   /* [slots, v_heads, d_v, d_k] F32, read and written */
    const loom_tensor *dst;     /* [tokens, v_heads, d_v] F32 */
    int32_t v_heads_tiled;      /* ABI 1.9: 1 = value head h reads key head h % k_heads */
} loom_gated_delta_params;

/* The key head value head h of v_heads reads (a member past the caller's struct_size is 0). */
static inline int64_t loom_gated_delta_key_head(const loom_gated_delta_params *p, int64_t h,
                                                int64_t k_heads, int64_t v_heads)
{
    int tiled = p->struct_size >=
            offsetof(loom_gated_delta_params, v_heads_tiled) + sizeof p->v_heads_tiled &&
        p->v_heads_tiled;
    return tiled ? h % k_heads : h / (v_heads / k_heads);
}

/* Each parameter struct's tensors in turn, I(field) those the op only reads and O(field) those
 * it writes, last: what the CPU fallback copies over (and the outputs back) and what the trace
 * decorator records. A new struct gets its line here. */
#define LOOM_TENSORS_loom_matmul_params(I, O) I(x) I(w) I(bias) O(y)
#define LOOM_TENSORS_loom_get_rows_params(I, O) I(src) I(ids) O(dst)
#define LOOM_TENSORS_loom_norm_params(I, O) I(x) I(weight) I(bias) O(dst)
#define LOOM_TENSORS_loom_rope_params(I, O) I(x) I(pos) I(pos2) I(freq_factors) O(dst)
#define LOOM_TENSORS_loom_elementwise_params(I, O) I(a) I(b) O(dst)
#define LOOM_TENSORS_loom_kv_store_params(I, O) I(src) I(slots) O(cache)
#define LOOM_TENSORS_loom_attention_params(I, O)                                                   \
    I(q) I(k_cache) I(v_cache) I(block_table) I(seq) I(pos) I(prefix_len) O(dst)
#define LOOM_TENSORS_loom_convert_params(I, O) I(src) O(dst)
#define LOOM_TENSORS_loom_moe_route_params(I, O) I(logits) I(bias) O(ids) O(weights)
#define LOOM_TENSORS_loom_matmul_id_params(I, O) I(x) I(w) I(ids) O(y)
#define LOOM_TENSORS_loom_moe_combine_params(I, O) I(src) I(weights) O(dst)
#define LOOM_TENSORS_loom_ssm_conv_params(I, O) I(x) I(weight) I(seq) O(state) O(dst)
#define LOOM_TENSORS_loom_gated_delta_params(I, O)                                                 \
    I(q) I(k) I(v) I(alpha) I(beta) I(a) I(dt_bias) I(seq) O(state) O(dst)

/* ---- Argument checks ---------------------------------------------------------------------
 * Optional helpers that state each op's shape and dtype contract in code. Each returns NULL
 * when the arguments are well formed, else a static message naming what is wrong. They do not
 * know buffer sizes: check those with loom_tensor_extent. */

static inline int64_t loom_tensor_rows(const loom_tensor *t)
{
    return t->ne[1] * t->ne[2] * t->ne[3];
}

/* Bytes from t->offset to one past t's last byte; 0 for an empty tensor, UINT64_MAX for one
 * that is malformed (negative dims, rows of partial blocks, unknown dtype) or whose extent
 * does not fit 64 bits (no buffer is that large, so a bounds check against it fails). */
static inline uint64_t loom_tensor_extent(const loom_tensor *t)
{
    int64_t rb = loom_row_bytes(t->dtype, t->ne[0]);
    if (rb < 0 || t->ne[1] < 0 || t->ne[2] < 0 || t->ne[3] < 0)
        return UINT64_MAX;
    if (t->ne[0] == 0 || t->ne[1] == 0 || t->ne[2] == 0 || t->ne[3] == 0)
        return 0;
    uint64_t extent = (uint64_t)rb;
    for (int i = 1; i < 4; i++) {
        uint64_t span = (uint64_t)(t->ne[i] - 1);
        if (span && t->nb[i] > (UINT64_MAX - extent) / span)
            return UINT64_MAX;
        extent += span * t->nb[i];
    }
    return extent;
}

static inline int loom_same_rows(const loom_tensor *a, const loom_tensor *b)
{
    return a->ne[0] == b->ne[0] && loom_tensor_rows(a) == loom_tensor_rows(b);
}

static inline int loom_dtype_is_float(loom_dtype t)
{
    return t == LOOM_F32 || t == LOOM_F16 || t == LOOM_BF16;
}

/* The block types of ABI 1.0 (Q8_0, Q4_0, Q4_1): what every block-type op accepts. */
static inline int loom_dtype_is_block(loom_dtype t)
{
    return t == LOOM_Q8_0 || t == LOOM_Q4_0 || t == LOOM_Q4_1;
}

/* Any quantised weight type (ABI 1.2): the 1.0 block types and Q5_0, Q5_1, IQ4_NL, the K
 * types and IQ4_XS. A module's `supports` claims the newer ones one by one, as it implements
 * them; this helper keeps its 1.0 meaning above so that a recompiled module claims nothing
 * new by accident. */
static inline int loom_dtype_is_quantized(loom_dtype t)
{
    return loom_dtype_block_elems(t) > 1;
}

static inline int loom_dtype_is_cache(loom_dtype t)
{
    return t == LOOM_F32 || t == LOOM_F16 || t == LOOM_Q8_0;
}

static inline const char *loom_check_matmul(const loom_matmul_params *p)
{
    if (!p->x || !p->w || !p->y)
        return "matmul: x, w and y are required";
    if (p->x->dtype != LOOM_F32 || p->y->dtype != LOOM_F32)
        return "matmul: x and y must be f32";
    if (!loom_dtype_is_float(p->w->dtype) && !loom_dtype_is_quantized(p->w->dtype))
        return "matmul: w must be f32, f16, bf16 or a quantised type";
    if (p->w->ne[0] != p->x->ne[0] || p->y->ne[0] != loom_tensor_rows(p->w) ||
        loom_tensor_rows(p->y) != loom_tensor_rows(p->x))
        return "matmul: shapes disagree (want x [M,K], w [N,K], y [M,N])";
    if (p->bias && (p->bias->dtype != LOOM_F32 || p->bias->ne[0] != p->y->ne[0]))
        return "matmul: bias must be f32 [N]";
    return NULL;
}

static inline const char *loom_check_get_rows(const loom_get_rows_params *p)
{
    if (!p->src || !p->ids || !p->dst)
        return "get_rows: src, ids and dst are required";
    if (p->ids->dtype != LOOM_I32 || p->dst->dtype != LOOM_F32)
        return "get_rows: ids must be i32 and dst f32";
    if (p->dst->ne[0] != p->src->ne[0] || loom_tensor_rows(p->dst) != p->ids->ne[0])
        return "get_rows: dst must be [n_ids, row length of src]";
    return NULL;
}

static inline const char *loom_check_norm(const loom_norm_params *p)
{
    if (!p->x || !p->dst || p->x->dtype != LOOM_F32 || p->dst->dtype != LOOM_F32)
        return "norm: x and dst are required and must be f32";
    if (!loom_same_rows(p->x, p->dst))
        return "norm: dst shape differs from x";
    if ((p->weight && (p->weight->dtype != LOOM_F32 || p->weight->ne[0] != p->x->ne[0])) ||
        (p->bias && (p->bias->dtype != LOOM_F32 || p->bias->ne[0] != p->x->ne[0])))
        return "norm: weight and bias must be f32 vectors as long as a row";
    return NULL;
}

static inline const char *loom_check_rope(const loom_rope_params *p)
{
    if (!p->x || !p->pos || !p->dst || p->x->dtype != LOOM_F32 || p->dst->dtype != LOOM_F32 ||
        p->pos->dtype != LOOM_I32)
        return "rope: x, pos (i32) and dst (f32) are required";
    if (!loom_same_rows(p->x, p->dst) || p->pos->ne[0] != p->x->ne[2] * p->x->ne[3])
        return "rope: dst must match x, and pos have one entry per token";
    if (p->n_rot <= 0 || p->n_rot % 2 || p->n_rot > p->x->ne[0])
        return "rope: n_rot must be even and in (0, head_dim]";
    if (p->mode == LOOM_ROPE_GLM_2D) {
        if (!p->pos2 || p->pos2->dtype != LOOM_I32 || p->pos2->ne[0] != p->pos->ne[0] ||
            p->n_rot != p->x->ne[0] || p->x->ne[0] % 4)
            return "rope glm_2d: needs pos2, n_rot == head_dim and head_dim a multiple of 4";
    } else if (p->mode != LOOM_ROPE_NEOX && p->mode != LOOM_ROPE_ADJACENT) {
        return "rope: unknown mode";
    }
    if (p->struct_size >= offsetof(loom_rope_params, freq_factors) + sizeof p->freq_factors &&
        p->freq_factors &&
        (p->freq_factors->dtype != LOOM_F32 || p->freq_factors->ne[0] != p->n_rot / 2 ||
         p->mode == LOOM_ROPE_GLM_2D))
        return "rope: freq_factors must be f32 [n_rot / 2], and glm_2d takes none";
    return NULL;
}

/* binary: add, mul, silu_mul (silu_mul never broadcasts) */
static inline const char *loom_check_elementwise(const loom_elementwise_params *p, int binary,
                                                 int may_broadcast)
{
    if (!p->a || !p->dst || p->a->dtype != LOOM_F32 || p->dst->dtype != LOOM_F32)
        return "elementwise: a and dst are required and must be f32";
    if (!loom_same_rows(p->a, p->dst))
        return "elementwise: dst shape differs from a";
    if (binary) {
        if (!p->b || p->b->dtype != LOOM_F32 || p->b->ne[0] != p->a->ne[0])
            return "elementwise: b must be f32 with rows as long as a's";
        int64_t rb = loom_tensor_rows(p->b);
        if (rb != loom_tensor_rows(p->a) && !(may_broadcast && rb == 1))
            return "elementwise: b must match a, or be one row to broadcast";
    }
    return NULL;
}

static inline const char *loom_check_kv_store(const loom_kv_store_params *p)
{
    if (!p->src || !p->slots || !p->cache || p->src->dtype != LOOM_F32 ||
        p->slots->dtype != LOOM_I32)
        return "kv_store: src (f32), slots (i32) and cache are required";
    if (!loom_dtype_is_cache(p->cache->dtype))
        return "kv_store: the cache must be f32, f16 or q8_0";
    if (p->cache->ne[0] != p->src->ne[0] || p->cache->ne[1] != p->src->ne[1] ||
        p->slots->ne[0] != p->src->ne[2] * p->src->ne[3])
        return "kv_store: src [tokens, kv_heads, head_dim] does not fit the cache";
    return NULL;
}

static inline const char *loom_check_attention(const loom_attention_params *p)
{
    if (!p->q || !p->k_cache || !p->v_cache || !p->block_table || !p->seq || !p->pos || !p->dst)
        return "attention: q, caches, block_table, seq, pos and dst are required";
    if (p->q->dtype != LOOM_F32 || p->dst->dtype != LOOM_F32 || p->block_table->dtype != LOOM_I32 ||
        p->seq->dtype != LOOM_I32 || p->pos->dtype != LOOM_I32 ||
        (p->prefix_len && p->prefix_len->dtype != LOOM_I32))
        return "attention: q and dst must be f32; block_table, seq, pos, prefix_len i32";
    const loom_tensor *k = p->k_cache, *v = p->v_cache;
    if (!loom_dtype_is_cache(k->dtype) || v->dtype != k->dtype)
        return "attention: caches must both be f32, f16 or q8_0";
    for (int i = 0; i < 4; i++)
        if (k->ne[i] != v->ne[i])
            return "attention: k and v caches differ in shape";
    int64_t tokens = p->q->ne[2] * p->q->ne[3];
    if (k->ne[0] != p->q->ne[0] || k->ne[1] <= 0 || p->q->ne[1] % k->ne[1] ||
        !loom_same_rows(p->q, p->dst) || p->seq->ne[0] != tokens || p->pos->ne[0] != tokens)
        return "attention: q [tokens, heads, head_dim] disagrees with the cache, seq or pos";
    if (p->prefix_len && p->prefix_len->ne[0] != loom_tensor_rows(p->block_table))
        return "attention: prefix_len needs one entry per sequence";
    if (p->struct_size >= offsetof(loom_attention_params, window) + sizeof p->window &&
        (p->window < 0 || (p->window > 0 && p->prefix_len)))
        return "attention: window must be 0 or positive, and not combined with prefix_len";
    return NULL;
}

/* The first key token t of an attention call sees: past its window, or 0. */
static inline int64_t loom_attention_first_key(const loom_attention_params *p, int64_t pos)
{
    int window = p->struct_size >= offsetof(loom_attention_params, window) + sizeof p->window
        ? p->window
        : 0;
    return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

/* which: LOOM_OP_QUANTIZE, LOOM_OP_DEQUANTIZE or LOOM_OP_CONVERT */
static inline const char *loom_check_convert(const loom_convert_params *p, loom_op which)
{
    if (!p->src || !p->dst)
        return "convert: src and dst are required";
    if (which == LOOM_OP_QUANTIZE &&
        (p->src->dtype != LOOM_F32 || !loom_dtype_is_block(p->dst->dtype)))
        return "quantize: src must be f32 and dst q8_0, q4_0 or q4_1";
    if (which == LOOM_OP_DEQUANTIZE &&
        (!loom_dtype_is_quantized(p->src->dtype) || p->dst->dtype != LOOM_F32))
        return "dequantize: src must be a quantised type and dst f32";
    if (which == LOOM_OP_CONVERT &&
        (!loom_dtype_is_float(p->src->dtype) || !loom_dtype_is_float(p->dst->dtype)))
        return "convert: src and dst must be f32, f16 or bf16";
    if (!loom_same_rows(p->src, p->dst))
        return "convert: src and dst shapes differ";
    return NULL;
}

static inline const char *loom_check_moe_route(const loom_moe_route_params *p)
{
    if (!p->logits || !p->ids || !p->weights || p->logits->dtype != LOOM_F32 ||
        p->ids->dtype != LOOM_I32 || p->weights->dtype != LOOM_F32)
        return "moe_route: logits (f32), ids (i32) and weights (f32) are required";
    int64_t tokens = loom_tensor_rows(p->logits), experts = p->logits->ne[0], k = p->ids->ne[0];
    if (k < 1 || k > experts || loom_tensor_rows(p->ids) != tokens ||
        !loom_same_rows(p->ids, p->weights))
        return "moe_route: ids and weights must be [tokens, k] with 1 <= k <= experts";
    if (p->bias && (p->bias->dtype != LOOM_F32 || p->bias->ne[0] != experts))
        return "moe_route: bias must be f32 [experts]";
    if (p->gating != LOOM_MOE_SOFTMAX && p->gating != LOOM_MOE_SIGMOID)
        return "moe_route: unknown gating";
    if (!(p->scale > 0 && p->scale < 1e30f))
        return "moe_route: scale must be finite and positive";
    int32_t groups, kept;
    loom_moe_route_groups(p, &groups, &kept);
    if (groups > 1 &&
        (experts % groups || kept < 1 || kept > groups || k > (int64_t)kept * (experts / groups) ||
         groups > 1024))
        return "moe_route: n_group must divide the experts (up to 1024 groups), topk_group be "
               "1 to n_group, and k at most the experts of topk_group groups";
    return NULL;
}

static inline const char *loom_check_matmul_id(const loom_matmul_id_params *p)
{
    if (!p->x || !p->w || !p->ids || !p->y)
        return "matmul_id: x, w, ids and y are required";
    if (p->x->dtype != LOOM_F32 || p->y->dtype != LOOM_F32 || p->ids->dtype != LOOM_I32)
        return "matmul_id: x and y must be f32, ids i32";
    if (!loom_dtype_is_float(p->w->dtype) && !loom_dtype_is_quantized(p->w->dtype))
        return "matmul_id: w must be f32, f16, bf16 or a quantised type";
    int64_t tokens = loom_tensor_rows(p->ids), k = p->ids->ne[0];
    if (p->w->ne[3] != 1 || p->w->ne[0] != p->x->ne[0] || p->y->ne[0] != p->w->ne[1])
        return "matmul_id: shapes disagree (want x [.., K], w [experts, N, K], y [.., N])";
    if (p->x->ne[3] != 1 || p->x->ne[2] != tokens || (p->x->ne[1] != 1 && p->x->ne[1] != k) ||
        p->y->ne[3] != 1 || p->y->ne[2] != tokens || p->y->ne[1] != k)
        return "matmul_id: want ids [tokens, k], x [tokens, 1 or k, K], y [tokens, k, N]";
    return NULL;
}

static inline const char *loom_check_moe_combine(const loom_moe_combine_params *p)
{
    if (!p->src || !p->weights || !p->dst || p->src->dtype != LOOM_F32 ||
        p->weights->dtype != LOOM_F32 || p->dst->dtype != LOOM_F32)
        return "moe_combine: src, weights and dst are required and must be f32";
    int64_t tokens = loom_tensor_rows(p->weights), k = p->weights->ne[0];
    if (p->src->ne[3] != 1 || p->src->ne[2] != tokens || p->src->ne[1] != k ||
        p->dst->ne[0] != p->src->ne[0] || loom_tensor_rows(p->dst) != tokens)
        return "moe_combine: want src [tokens, k, n], weights [tokens, k], dst [tokens, n]";
    return NULL;
}

static inline const char *loom_check_ssm_conv(const loom_ssm_conv_params *p)
{
    if (!p->x || !p->weight || !p->seq || !p->state || !p->dst)
        return "ssm_conv: x, weight, seq, state and dst are required";
    if (p->x->dtype != LOOM_F32 || p->state->dtype != LOOM_F32 || p->dst->dtype != LOOM_F32 ||
        p->seq->dtype != LOOM_I32 || !loom_dtype_is_float(p->weight->dtype))
        return "ssm_conv: x, state and dst must be f32, seq i32 and weight a float type";
    int64_t channels = p->x->ne[0], kernel = p->weight->ne[0], tokens = loom_tensor_rows(p->x);
    if (kernel < 2 || loom_tensor_rows(p->weight) != channels || p->state->ne[0] != channels ||
        p->state->ne[1] != kernel - 1 || p->state->ne[3] != 1 || !loom_same_rows(p->x, p->dst) ||
        p->seq->ne[0] != tokens)
        return "ssm_conv: want x and dst [tokens, channels], weight [channels, kernel >= 2], "
               "seq [tokens], state [slots, kernel - 1, channels]";
    return NULL;
}

static inline const char *loom_check_gated_delta(const loom_gated_delta_params *p)
{
    if (!p->q || !p->k || !p->v || !p->alpha || !p->beta || !p->a || !p->dt_bias || !p->seq ||
        !p->state || !p->dst)
        return "gated_delta: every tensor is required";
    const loom_tensor *f32s[] = {p->q, p->k,       p->v,     p->alpha, p->beta,
                                 p->a, p->dt_bias, p->state, p->dst};
    for (size_t i = 0; i < sizeof f32s / sizeof f32s[0]; i++)
        if (f32s[i]->dtype != LOOM_F32)
            return "gated_delta: every tensor but seq must be f32";
    if (p->seq->dtype != LOOM_I32)
        return "gated_delta: seq must be i32";
    int64_t dk = p->q->ne[0], hk = p->q->ne[1], tokens = p->q->ne[2];
    int64_t dv = p->v->ne[0], hv = p->v->ne[1];
    if (p->q->ne[3] != 1 || p->k->ne[0] != dk || p->k->ne[1] != hk || p->k->ne[2] != tokens ||
        p->v->ne[2] != tokens || hk < 1 || hv % hk != 0 || p->alpha->ne[0] != hv ||
        loom_tensor_rows(p->alpha) != tokens || p->beta->ne[0] != hv ||
        loom_tensor_rows(p->beta) != tokens || p->a->ne[0] != hv || p->dt_bias->ne[0] != hv ||
        p->seq->ne[0] != tokens || p->state->ne[0] != dk || p->state->ne[1] != dv ||
        p->state->ne[2] != hv || p->dst->ne[0] != dv || p->dst->ne[1] != hv ||
        p->dst->ne[2] != tokens)
        return "gated_delta: want q and k [tokens, k_heads, d_k], v and dst [tokens, v_heads, "
               "d_v] (v_heads a multiple of k_heads), alpha and beta [tokens, v_heads], a and "
               "dt_bias [v_heads], seq [tokens], state [slots, v_heads, d_v, d_k]";
    return NULL;
}

/* ---- Devices and probing ----------------------------------------------------------------- */

#define LOOM_MAX_DEVICES 16

typedef struct loom_device_info {
    char name[128];        /* "NVIDIA H200", "Intel Xeon ... (2 threads)" */
    uint64_t memory_bytes; /* total device memory, or host memory for CPU backends */
    char detail[128];      /* free text: "sm_90", "avx512 vnni bf16", ... */
} loom_device_info;

/* Filled by probe. The caller zeroes it and sets struct_size; the module writes no byte past
 * that size. */
typedef struct loom_probe_result {
    uint32_t struct_size;
    int32_t score;    /* 0: unusable here; otherwise higher is better (see ARCHITECTURE.md) */
    char reason[256]; /* when score is 0: why ("no device", "CPU lacks AVX2", ...) */
    uint32_t n_devices;
    loom_device_info devices[LOOM_MAX_DEVICES];
} loom_probe_result;

typedef struct loom_backend loom_backend;

/* Options for open. The caller zeroes it and sets struct_size. */
typedef struct loom_backend_options {
    uint32_t struct_size;
    int32_t device;    /* device index, 0-based */
    int32_t n_threads; /* host threads to use; 0 = the backend's default */
    /* ABI 1.3, for decorator modules only (NULL for a backend): */
    loom_backend *inner; /* the opened backend to wrap. The decorator owns it once its open
                          * returns LOOM_OK (its close closes inner), and not before. */
    const char *config;  /* the decorator's setting (a trace file's path), or NULL */
} loom_backend_options;

/* ---- The opened backend ------------------------------------------------------------------
 * Every function takes the loom_backend it belongs to.
 *
 * Required: close, last_error, supports, buffer_alloc, buffer_free, copy_from_host,
 * copy_to_host and synchronize. loom refuses a module whose table lacks one (and
 * loom-conformance says which). Everything else may be NULL: members marked (optional) then
 * take the default given, and a NULL op is an unsupported op, which loom runs on the CPU. An op
 * that `supports` claims must have its pointer (conformance fails the module otherwise). Ops
 * return LOOM_ERR_UNSUPPORTED for what `supports` denies.
 *
 * last_error never returns NULL (an empty string before any failure); it describes the most
 * recent call that failed, and successful calls need not clear it. */

typedef struct loom_backend_ops {
    uint32_t struct_size;

    /* lifetime */
    void (*close)(loom_backend *be);             /* stop every thread, free everything */
    const char *(*last_error)(loom_backend *be); /* message of the last failure */

    /* capabilities */
    /* nonzero if the op runs with that dtype (W of matmul/get_rows, the cache of
     * kv_store/attention, the block or target type of quantize/convert, F32 otherwise) */
    int (*supports)(loom_backend *be, loom_op op, loom_dtype weight_or_cache_dtype);
    loom_status (*set_threads)(loom_backend *be, int32_t n); /* (optional) default: ignored */

    /* buffers. buffer_alloc(0) succeeds with a buffer of no bytes that buffer_free takes. A
     * copy or memset whose range does not lie inside its buffer(s) returns LOOM_ERR_INVALID and
     * changes nothing (buffers and host memory alike). */
    loom_status (*buffer_alloc)(loom_backend *be, uint64_t size, loom_buffer **out);
    void (*buffer_free)(loom_backend *be, loom_buffer *buf);
    /* (optional) host address of a host-visible buffer, else NULL */
    void *(*buffer_host_ptr)(loom_backend *be, loom_buffer *buf);
    /* (optional) use caller memory (an mmap'd weight file) in place; freed with buffer_free,
     * which leaves ptr alone */
    loom_status (*buffer_wrap_host)(loom_backend *be, void *ptr, uint64_t size, loom_buffer **out);
    loom_status (*buffer_memset)(loom_backend *be, loom_buffer *buf, uint64_t offset, int value,
                                 uint64_t size); /* (optional) */
    loom_status (*copy_from_host)(loom_backend *be, loom_buffer *dst, uint64_t offset,
                                  const void *src, uint64_t size);
    loom_status (*copy_to_host)(loom_backend *be, void *dst, loom_buffer *src, uint64_t offset,
                                uint64_t size);
    /* (optional) default: through host memory, copy_to_host then copy_from_host */
    loom_status (*copy_buffer)(loom_backend *be, loom_buffer *dst, uint64_t dst_offset,
                               loom_buffer *src, uint64_t src_offset, uint64_t size);
    loom_status (*synchronize)(loom_backend *be); /* wait for every enqueued op */

    /* ops, in loom_op order: matmul, get_rows, ..., convert (LOOM_OPS_1_0), each
     *   loom_status (*name)(loom_backend *be, const <its params> *p); */
#define LOOM_OP_SLOT_(id, name, params) loom_status (*name)(loom_backend * be, const params *p);
    LOOM_OPS_1_0(LOOM_OP_SLOT_)

    /* ABI 1.1 */
    loom_status (*prepare_weight)(loom_backend *be, const loom_tensor *w, loom_tensor *out);
    /* (optional) A copy of matmul weight w (2-D, dense) in a layout of the backend's own
         * that its matmul runs faster: rows interleaved to fill vector lanes, say. On LOOM_OK,
         * *out has w's dtype and ne and lives in a new buffer (out->buf, freed with buffer_free);
         * w is untouched and stays usable. A prepared tensor may only be passed whole as
         * matmul's w: no views, no other op, and its bytes are the backend's business.
         * LOOM_ERR_UNSUPPORTED: no better layout for this weight; use w as it is.
         * ABI 1.6: w may also be matmul_id's expert stack (3-D, [experts, N, K]); the prepared
         * stack is then passed whole as matmul_id's w, never to matmul. loom offers stacks only
         * to modules of minor 6 or later; one that has no layout for them says UNSUPPORTED. */
    /* ABI 1.2 and later append here: the slots of LOOM_OPS_APPENDED */
    LOOM_OPS_APPENDED(LOOM_OP_SLOT_)
#undef LOOM_OP_SLOT_
} loom_backend_ops;

/* A backend's first member; the rest of its state follows in the module's own struct. */
struct loom_backend {
    const loom_backend_ops *ops;
};

/* ---- The module ---------------------------------------------------------------------------
 * Returned by the entry point; static, valid until the module is unloaded. */

typedef enum loom_module_kind {
    LOOM_MODULE_BACKEND = 0, /* runs ops on a device: what selection chooses among */
    /* ABI 1.3: wraps another opened backend (loom_backend_options.inner) and forwards every
     * call to it, doing something on the way (plugins/trace records each call). Never chosen on
     * its own: loom opens one around the chosen backend when asked to (LOOM_TRACE). Its probe
     * says whether it can run here, like a backend's. */
    LOOM_MODULE_DECORATOR = 1,
} loom_module_kind;

typedef struct loom_backend_module {
    uint32_t struct_size;
    uint32_t abi_major;      /* LOOM_BACKEND_ABI_MAJOR the module was built with */
    uint32_t abi_minor;      /* LOOM_BACKEND_ABI_MINOR the module was built with */
    const char *name;        /* "cpu", "cuda", "ref": what LOOM_BACKEND matches */
    const char *variant;     /* "avx2", "" when there is only one build */
    const char *description; /* one line for humans */

    /* Cheap and free of side effects: no device context, no threads, nothing that outlives the
     * call. Must not execute instructions the probed machine may lack. */
    void (*probe)(loom_probe_result *out);

    /* Open device opts->device. On failure return non-OK and write a message to err. */
    loom_status (*open)(const loom_backend_options *opts, loom_backend **out, char *err,
                        size_t err_size);

    /* ABI 1.3 */
    uint32_t kind; /* loom_module_kind; a module of an older minor reads as a backend */
} loom_backend_module;

/* The entry point. host_major/host_minor are loom's ABI version, for a module that wants to
 * adapt; most ignore them. Must not run foreign-ISA code, start threads or allocate. */
typedef const loom_backend_module *(*loom_backend_entry_fn)(uint32_t host_major,
                                                            uint32_t host_minor);

/* Defines the entry point returning &module (a static loom_backend_module), exported under
 * LOOM_BACKEND_ENTRY_SYMBOL: write LOOM_BACKEND_DEFINE_ENTRY(my_module) once in the module
 * and build it with -fvisibility=hidden, so that is all it exports. */
#define LOOM_BACKEND_DEFINE_ENTRY(module)                                                          \
    LOOM_BACKEND_EXPORT const loom_backend_module *loom_backend_entry(uint32_t host_major,         \
                                                                      uint32_t host_minor)         \
    {                                                                                              \
        (void)host_major, (void)host_minor;                                                        \
        return &(module);                                                                          \
    }

#ifdef __cplusplus
}
#endif

#endif /* LOOM_BACKEND_H */
