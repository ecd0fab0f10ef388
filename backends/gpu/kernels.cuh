/*
 * backends/gpu/kernels.cuh - the GPU backend's device code (CUDA and HIP).
 *
 * Every kernel takes its tensors as tview (base pointer plus the strides of the ABI's 4-d
 * tensor), so strided views (every other row, half of each row, the head-major KV blocks) work
 * without copies. Arithmetic mirrors the reference backend where the conformance tool wants
 * exact answers (conversions, quantisation) and stays in f32 elsewhere.
 *
 * Errors that only the device can see (an id outside the table, a slot outside the cache, a
 * block id outside the pool) are written to a dev_error in mapped host memory and reported by
 * the next synchronize or copy to the host: checking them on the host would cost a round trip
 * per op.
 */
#ifndef LOOM_CUDA_KERNELS_CUH
#define LOOM_CUDA_KERNELS_CUH

#include "gpu.h"

#include <loom/backend.h>
#include <stdint.h>

#define WARP 32

struct tview {
    char *p;               /* buffer address + tensor offset */
    int64_t ne0, ne1, ne2; /* ne3 is implied by the row count */
    int64_t nb1, nb2, nb3;
};

struct dev_error {
    int code; /* 0: none; else the loom_op that failed */
    long long value, limit, where;
};

__host__ __device__ __forceinline__ int64_t lmin(int64_t a, int64_t b)
{
    return a < b ? a : b;
}

__host__ __device__ __forceinline__ int64_t lmax(int64_t a, int64_t b)
{
    return a > b ? a : b;
}

__device__ __forceinline__ char *row_at(const tview &t, int64_t r)
{
    int64_t i1 = r % t.ne1, q = r / t.ne1;
    return t.p + i1 * t.nb1 + (q % t.ne2) * t.nb2 + (q / t.ne2) * t.nb3;
}

__device__ __forceinline__ int32_t i32_at(const tview &t, int64_t i)
{
    return ((const int32_t *)t.p)[i];
}

__device__ void report_error(dev_error *e, int op, long long value, long long limit,
                             long long where)
{
    if (atomicCAS(&e->code, 0, op + 1) == 0) {
        e->value = value;
        e->limit = limit;
        e->where = where;
        __threadfence_system();
    }
}

__device__ __forceinline__ float f16_bits(uint16_t h)
{
    return __half2float(__ushort_as_half(h));
}

__device__ __forceinline__ uint16_t u16_at(const char *p)
{
    return *(const uint16_t *)p;
}

/* The ABI 1.2 weight types, for the switches that instantiate a kernel per type */
/* clang-format off */
#define LOOM_GPU_NEW_QUANTS(X)                                                                   \
    X(LOOM_Q5_0) X(LOOM_Q5_1) X(LOOM_IQ4_NL) X(LOOM_Q2_K) X(LOOM_Q3_K) X(LOOM_Q4_K) X(LOOM_Q5_K) \
    X(LOOM_Q6_K) X(LOOM_IQ4_XS)
/* clang-format on */

/* Bytes per block of a quantised dtype (the header's helper is host-only). */
__host__ __device__ __forceinline__ int64_t block_bytes(int dt)
{
    switch (dt) {
    case LOOM_Q8_0: return sizeof(loom_block_q8_0);
    case LOOM_Q4_1: return sizeof(loom_block_q4_1);
    case LOOM_Q5_0: return sizeof(loom_block_q5_0);
    case LOOM_Q5_1: return sizeof(loom_block_q5_1);
    case LOOM_IQ4_NL: return sizeof(loom_block_iq4_nl);
    case LOOM_Q2_K: return sizeof(loom_block_q2_k);
    case LOOM_Q3_K: return sizeof(loom_block_q3_k);
    case LOOM_Q4_K: return sizeof(loom_block_q4_k);
    case LOOM_Q5_K: return sizeof(loom_block_q5_k);
    case LOOM_Q6_K: return sizeof(loom_block_q6_k);
    case LOOM_IQ4_XS: return sizeof(loom_block_iq4_xs);
    default: return sizeof(loom_block_q4_0);
    }
}

/* Element i of a row of an ABI 1.2 quantised type: the reference dequantisers of
 * <loom/quants.h> for one element, in their order of operations (the _rn intrinsics keep a
 * multiply and an add from fusing, which would round differently), with the header's own
 * helpers for the packed scales and bits. */
template <typename B>
__device__ __forceinline__ const B *block_of(const char *row, int64_t i, int64_t per)
{
    return (const B *)row + i / per;
}

__device__ __forceinline__ float iq4_value(int k)
{
    const int8_t values[16] = LOOM_IQ4_VALUES;
    return (float)values[k & 15];
}

__device__ float quant_elem(int dt, const char *row, int64_t i)
{
    int j = (int)(i %
                  (dt == LOOM_Q5_0 || dt == LOOM_Q5_1 || dt == LOOM_IQ4_NL ? LOOM_QK : LOOM_QK_K));
    switch (dt) {
    case LOOM_Q5_0:
    case LOOM_Q5_1: { /* byte j % 16: element j % 16 low, j % 16 + 16 high; qh: the fifth bits */
        const uint8_t *qh, *qs;
        uint16_t d, m = 0;
        if (dt == LOOM_Q5_0) {
            const loom_block_q5_0 *b = block_of<loom_block_q5_0>(row, i, LOOM_QK);
            qh = b->qh, qs = b->qs, d = b->d;
        } else {
            const loom_block_q5_1 *b = block_of<loom_block_q5_1>(row, i, LOOM_QK);
            qh = b->qh, qs = b->qs, d = b->d, m = b->m;
        }
        int q = (j < 16 ? qs[j] & 0x0f : qs[j - 16] >> 4) | loom_q5_high(qh, j) << 4;
        return dt == LOOM_Q5_0 ? (float)(q - 16) * f16_bits(d)
                               : __fadd_rn(__fmul_rn((float)q, f16_bits(d)), f16_bits(m));
    }
    case LOOM_IQ4_NL: {
        const loom_block_iq4_nl *b = block_of<loom_block_iq4_nl>(row, i, LOOM_QK);
        return f16_bits(b->d) * iq4_value(j < 16 ? b->qs[j] & 0x0f : b->qs[j - 16] >> 4);
    }
    case LOOM_Q2_K: { /* 128-element halves; bit pair s of byte l: sub-block 2 s (+1) */
        const loom_block_q2_k *b = block_of<loom_block_q2_k>(row, i, LOOM_QK_K);
        int half = j / 128, s = j % 128 / 32, l = j % 32;
        uint8_t sc = b->scales[8 * half + 2 * s + l / 16];
        float dl = f16_bits(b->d) * (float)(sc & 0x0f), ml = f16_bits(b->dmin) * (float)(sc >> 4);
        return __fsub_rn(__fmul_rn(dl, (float)((b->qs[32 * half + l] >> (2 * s)) & 3)), ml);
    }
    case LOOM_Q3_K: {
        const loom_block_q3_k *b = block_of<loom_block_q3_k>(row, i, LOOM_QK_K);
        int half = j / 128, s = j % 128 / 32, l = j % 32;
        float dl = f16_bits(b->d) * (float)loom_q3_k_scale(b->scales, 8 * half + 2 * s + l / 16);
        int low = (b->qs[32 * half + l] >> (2 * s)) & 3, high = (b->hmask[l] >> (4 * half + s)) & 1;
        return dl * (float)(low - (high ? 0 : 4));
    }
    case LOOM_Q4_K:
    case LOOM_Q5_K: { /* 64-element pairs of sub-blocks, one 32-byte run: low then high nibbles */
        const uint8_t *scales, *qs, *qh = NULL;
        uint16_t d, dmin;
        if (dt == LOOM_Q4_K) {
            const loom_block_q4_k *b = block_of<loom_block_q4_k>(row, i, LOOM_QK_K);
            scales = b->scales, qs = b->qs, d = b->d, dmin = b->dmin;
        } else {
            const loom_block_q5_k *b = block_of<loom_block_q5_k>(row, i, LOOM_QK_K);
            scales = b->scales, qs = b->qs, qh = b->qh, d = b->d, dmin = b->dmin;
        }
        int sub = j / 32, l = j % 32, sc, m;
        loom_k_scale_min(scales, sub, &sc, &m);
        int q = sub % 2 ? qs[32 * (sub / 2) + l] >> 4 : qs[32 * (sub / 2) + l] & 0x0f;
        if (qh)
            q += ((qh[l] >> sub) & 1) << 4;
        float dl = f16_bits(d) * (float)sc, ml = f16_bits(dmin) * (float)m;
        return __fsub_rn(__fmul_rn(dl, (float)q), ml);
    }
    case LOOM_Q6_K: { /* element l + 32 k of a half: nibble k / 2 of ql[l + 32 (k % 2)], bit
                       * pair k of qh[l] */
        const loom_block_q6_k *b = block_of<loom_block_q6_k>(row, i, LOOM_QK_K);
        int half = j / 128, k = j % 128 / 32, l = j % 32;
        uint8_t lo = b->ql[64 * half + l + 32 * (k % 2)];
        int q = ((k < 2 ? lo & 0x0f : lo >> 4) | ((b->qh[32 * half + l] >> (2 * k)) & 3) << 4) - 32;
        return f16_bits(b->d) * (float)b->scales[8 * half + l / 16 + 2 * k] * (float)q;
    }
    case LOOM_IQ4_XS: {
        const loom_block_iq4_xs *b = block_of<loom_block_iq4_xs>(row, i, LOOM_QK_K);
        int s = j / 32, l = j % 32;
        int ls = ((b->scales_l[s / 2] >> (4 * (s % 2))) & 0x0f) |
            ((b->scales_h >> (2 * s)) & 3) << 4;
        const uint8_t *q = b->qs + 16 * s;
        return f16_bits(b->d) * (float)(ls - 32) * iq4_value(l < 16 ? q[l] & 0x0f : q[l - 16] >> 4);
    }
    }
    return 0.0f;
}

/* Element i of a row of any dtype, as f32 (the reference dequantisation). */
__device__ __forceinline__ float load_elem(int dt, const char *row, int64_t i)
{
    switch (dt) {
    case LOOM_F32: return ((const float *)row)[i];
    case LOOM_F16: return f16_bits(((const uint16_t *)row)[i]);
    case LOOM_BF16: return __uint_as_float((uint32_t)((const uint16_t *)row)[i] << 16);
    case LOOM_I32: return (float)((const int32_t *)row)[i];
    case LOOM_Q8_0: {
        const char *b = row + (i / LOOM_QK) * sizeof(loom_block_q8_0);
        return (float)(int8_t)b[2 + i % LOOM_QK] * f16_bits(u16_at(b));
    }
    case LOOM_Q4_0: {
        const char *b = row + (i / LOOM_QK) * sizeof(loom_block_q4_0);
        int j = (int)(i % LOOM_QK);
        uint8_t q = (uint8_t)b[2 + (j & 15)];
        return (float)((j < 16 ? q & 15 : q >> 4) - 8) * f16_bits(u16_at(b));
    }
    case LOOM_Q4_1: {
        const char *b = row + (i / LOOM_QK) * sizeof(loom_block_q4_1);
        int j = (int)(i % LOOM_QK);
        uint8_t q = (uint8_t)b[4 + (j & 15)];
        return (float)(j < 16 ? q & 15 : q >> 4) * f16_bits(u16_at(b)) + f16_bits(u16_at(b + 2));
    }
    default: return quant_elem(dt, row, i);
    }
}

/* bf16 rounding exactly as loom_f32_to_bf16 (nearest even; NaN stays a quiet NaN). */
__device__ __forceinline__ uint16_t bf16_from_f32(float f)
{
    uint32_t x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x40);
    x += 0x7fff + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
}

/* Stores to a float dtype; block dtypes are written whole by k_quantize. */
__device__ __forceinline__ void store_elem(int dt, char *row, int64_t i, float v)
{
    switch (dt) {
    case LOOM_F32: ((float *)row)[i] = v; break;
    case LOOM_F16: ((uint16_t *)row)[i] = __half_as_ushort(__float2half_rn(v)); break;
    case LOOM_BF16: ((uint16_t *)row)[i] = bf16_from_f32(v); break;
    default: break;
    }
}

__device__ __forceinline__ float warp_sum(float v)
{
    for (int o = WARP / 2; o > 0; o /= 2)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v)
{
    for (int o = WARP / 2; o > 0; o /= 2)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Sum over the block; every thread gets the result. blockDim.x is a multiple of WARP. */
__device__ float block_sum(float v, float *shared32)
{
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads(); /* shared32 may still be read by a previous call */
    if (lane == 0)
        shared32[warp] = v;
    __syncthreads();
    v = lane < warps ? shared32[lane] : 0.0f;
    return warp_sum(v);
}

/* ---- Conversions ------------------------------------------------------------------------ */

/* dst[r, i] = src[r, i] for any source dtype and a float destination dtype: dequantize,
 * convert, and the staging of activations and weights for cuBLAS. */
__global__ void k_convert(tview src, int sdt, tview dst, int ddt, int64_t n, int64_t rows)
{
    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
        const char *s = row_at(src, r);
        char *d = row_at(dst, r);
        for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
             i += (int64_t)gridDim.x * blockDim.x)
            store_elem(ddt, d, i, load_elem(sdt, s, i));
    }
}

/* One thread per block of 32, with the reference quantisers' arithmetic (no fused multiply-add,
 * so that the stored bytes match loom_quantize_row_*). */
__device__ void quantize_block(int dt, const float *x, char *out)
{
    if (dt == LOOM_Q8_0) {
        float amax = 0.0f;
        for (int j = 0; j < LOOM_QK; j++)
            amax = fmaxf(amax, fabsf(x[j]));
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        *(uint16_t *)out = __half_as_ushort(__float2half_rn(d));
        for (int j = 0; j < LOOM_QK; j++)
            out[2 + j] = (char)(int)roundf(__fmul_rn(x[j], id));
    } else if (dt == LOOM_Q4_0) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < LOOM_QK; j++)
            if (fabsf(x[j]) > amax)
                amax = fabsf(x[j]), max = x[j];
        float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        *(uint16_t *)out = __half_as_ushort(__float2half_rn(d));
        for (int j = 0; j < LOOM_QK / 2; j++) {
            int q0 = (int)__fadd_rn(__fmul_rn(x[j], id), 8.5f);
            int q1 = (int)__fadd_rn(__fmul_rn(x[j + 16], id), 8.5f);
            out[2 + j] = (char)(lmin(q0, 15) | lmin(q1, 15) << 4);
        }
    } else { /* Q4_1 */
        float lo = x[0], hi = x[0];
        for (int j = 1; j < LOOM_QK; j++)
            lo = fminf(lo, x[j]), hi = fmaxf(hi, x[j]);
        float d = (hi - lo) / 15.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        *(uint16_t *)out = __half_as_ushort(__float2half_rn(d));
        *(uint16_t *)(out + 2) = __half_as_ushort(__float2half_rn(lo));
        for (int j = 0; j < LOOM_QK / 2; j++) {
            int q0 = (int)__fadd_rn(__fmul_rn(__fsub_rn(x[j], lo), id), 0.5f);
            int q1 = (int)__fadd_rn(__fmul_rn(__fsub_rn(x[j + 16], lo), id), 0.5f);
            out[4 + j] = (char)(lmin(q0, 15) | lmin(q1, 15) << 4);
        }
    }
}

__global__ void k_quantize(tview src, tview dst, int ddt, int64_t n_blocks, int64_t rows)
{
    int64_t bytes = block_bytes(ddt);
    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
        for (int64_t b = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; b < n_blocks;
             b += (int64_t)gridDim.x * blockDim.x)
            quantize_block(ddt, (const float *)row_at(src, r) + b * LOOM_QK,
                           row_at(dst, r) + b * bytes);
}

__global__ void k_get_rows(tview src, int sdt, int64_t src_rows, tview ids, tview dst, int64_t n,
                           int64_t n_ids, dev_error *err)
{
    for (int64_t r = blockIdx.y; r < n_ids; r += gridDim.y) {
        int32_t id = i32_at(ids, r);
        if (id < 0 || id >= src_rows) {
            if (blockIdx.x == 0 && threadIdx.x == 0)
                report_error(err, LOOM_OP_GET_ROWS, id, src_rows, r);
            continue;
        }
        const char *s = row_at(src, id);
        char *d = row_at(dst, r);
        for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
             i += (int64_t)gridDim.x * blockDim.x)
            ((float *)d)[i] = load_elem(sdt, s, i);
    }
}

/* ---- Norms, RoPE, elementwise ------------------------------------------------------------ */

/* One block per row. The mean of squares is taken around the mean (two passes), as the
 * reference does, so rows with a large offset keep their precision. */
__global__ void k_norm(tview x, const float *w, const float *b, tview dst, int64_t n, int64_t rows,
                       float eps, int layer)
{
    __shared__ float shared32[WARP];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *xr = (const float *)row_at(x, r);
        float mean = 0.0f;
        if (layer) {
            float s = 0.0f;
            for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
                s += xr[i];
            mean = block_sum(s, shared32) / (float)n;
        }
        float sq = 0.0f;
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
            sq += (xr[i] - mean) * (xr[i] - mean);
        float inv = 1.0f / sqrtf(block_sum(sq, shared32) / (float)n + eps);
        float *dr = (float *)row_at(dst, r);
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
            dr[i] = (xr[i] - mean) * inv * (w ? w[i] : 1.0f) + (b ? b[i] : 0.0f);
    }
}

/* One thread per pair; angles in double as in the reference, since positions reach 10^5 and an
 * f32 angle that large has lost most of its fraction. */
/* factors: n_rot / 2 divisors of the pairs' frequencies (has_factors), else unused */
__global__ void k_rope(tview x, tview dst, tview pos, tview pos2, tview factors, int has_factors,
                       int mode, int n_rot, int64_t hd, int64_t heads, int64_t rows, double base,
                       double scale)
{
    int64_t half = hd / 2;
    for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < rows * half;
         idx += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = idx / half, i = idx % half, t = r / heads;
        const float *xr = (const float *)row_at(x, r);
        float *dr = (float *)row_at(dst, r);
        int64_t a, b, n;
        double p;
        if (mode == LOOM_ROPE_GLM_2D) {
            int64_t quarter = hd / 4, second = i / quarter;
            n = half;
            i %= quarter;
            a = second * half + i;
            b = a + quarter;
            p = (double)(second ? i32_at(pos2, t) : i32_at(pos, t)) * scale;
        } else {
            /* pairs past n_rot/2 copy the unrotated tail, two elements each */
            if (i >= n_rot / 2) {
                for (int64_t e = n_rot + 2 * (i - n_rot / 2);
                     e < n_rot + 2 * (i - n_rot / 2) + 2 && e < hd; e++)
                    dr[e] = xr[e];
                continue;
            }
            n = n_rot;
            a = mode == LOOM_ROPE_ADJACENT ? 2 * i : i;
            b = mode == LOOM_ROPE_ADJACENT ? 2 * i + 1 : i + n_rot / 2;
            p = (double)i32_at(pos, t) * scale;
        }
        double theta = p * pow(base, -2.0 * (double)i / (double)n), s, c;
        if (has_factors && mode != LOOM_ROPE_GLM_2D)
            theta /= (double)((const float *)row_at(factors, 0))[i];
        sincos(theta, &s, &c);
        double x0 = xr[a], x1 = xr[b];
        dr[a] = (float)(x0 * c - x1 * s);
        dr[b] = (float)(x0 * s + x1 * c);
    }
}

enum ew_kind { EW_ADD, EW_MUL, EW_SCALE, EW_SILU_MUL, EW_GELU };

__global__ void k_elementwise(int kind, tview a, tview b, tview dst, int64_t n, int64_t rows,
                              int broadcast, float scale)
{
    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
        const float *ar = (const float *)row_at(a, r);
        const float *br = kind == EW_ADD || kind == EW_MUL || kind == EW_SILU_MUL
            ? (const float *)row_at(b, broadcast ? 0 : r)
            : NULL;
        float *dr = (float *)row_at(dst, r);
        for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
             i += (int64_t)gridDim.x * blockDim.x) {
            float v = ar[i];
            switch (kind) {
            case EW_ADD: v += br[i]; break;
            case EW_MUL: v *= br[i]; break;
            case EW_SCALE: v *= scale; break;
            case EW_SILU_MUL: v = v / (1.0f + expf(-v)) * br[i]; break;
            case EW_GELU:
                /* x sigmoid(2u): 0.5 x (1 + tanh u) cancels where tanh(u) nears -1 */
                v = v / (1.0f + expf(-1.5957691216057308f * (v + 0.044715f * v * v * v)));
                break;
            }
            dr[i] = v;
        }
    }
}

/* ---- Matmul: the decode path -------------------------------------------------------------
 * One warp per weight row n, MR activation rows per block along y. Each lane walks the row
 * with a stride of 32 elements (float weights) or 32 blocks (block weights), dequantising in
 * registers; partial sums meet in a shuffle reduction. */

template <int WT> __device__ __forceinline__ void dequant_block(const char *blk, float *v)
{
    if (WT == LOOM_Q8_0) {
        float d = f16_bits(u16_at(blk));
        for (int j = 0; j < LOOM_QK; j += 2) {
            uint16_t q = u16_at(blk + 2 + j);
            v[j] = (float)(int8_t)(q & 0xff) * d;
            v[j + 1] = (float)(int8_t)(q >> 8) * d;
        }
    } else {
        const int qoff = WT == LOOM_Q4_1 ? 4 : 2;
        float d = f16_bits(u16_at(blk)), m = WT == LOOM_Q4_1 ? f16_bits(u16_at(blk + 2)) : 0.0f;
        for (int j = 0; j < LOOM_QK / 2; j += 2) {
            uint16_t q = u16_at(blk + qoff + j);
            uint8_t q0 = q & 0xff, q1 = q >> 8;
            if (WT == LOOM_Q4_0) {
                v[j] = (float)((q0 & 15) - 8) * d;
                v[j + 1] = (float)((q1 & 15) - 8) * d;
                v[j + 16] = (float)((q0 >> 4) - 8) * d;
                v[j + 17] = (float)((q1 >> 4) - 8) * d;
            } else {
                v[j] = (float)(q0 & 15) * d + m;
                v[j + 1] = (float)(q1 & 15) * d + m;
                v[j + 16] = (float)(q0 >> 4) * d + m;
                v[j + 17] = (float)(q1 >> 4) * d + m;
            }
        }
    }
}

#define GEMV_MR 4
#define GEMV_WARPS 4

/* VEC: rows are 16-byte aligned and K a multiple of 16 bytes' worth, so a lane loads 16 bytes
 * of weights (and the matching activations as float4) at a time. */
template <int WT, bool VEC>
__global__ void __launch_bounds__(GEMV_WARPS *WARP)
    k_gemv(tview x, tview w, const float *bias, tview y, int64_t M, int64_t K, int64_t N)
{
    int lane = threadIdx.x % WARP;
    int64_t n = (int64_t)blockIdx.x * GEMV_WARPS + threadIdx.x / WARP;
    if (n >= N)
        return;
    const char *wr = row_at(w, n);
    for (int64_t m0 = (int64_t)blockIdx.y * GEMV_MR; m0 < M; m0 += (int64_t)gridDim.y * GEMV_MR) {
        int mr = (int)lmin((int64_t)GEMV_MR, M - m0);
        const float *xr[GEMV_MR];
        for (int j = 0; j < GEMV_MR; j++)
            xr[j] = (const float *)row_at(x, m0 + lmin(j, mr - 1));
        float acc[GEMV_MR] = {0.0f};
        if (WT == LOOM_Q8_0 || WT == LOOM_Q4_0 || WT == LOOM_Q4_1) {
            const int64_t bytes = block_bytes(WT);
            for (int64_t b = lane; b < K / LOOM_QK; b += WARP) {
                float v[LOOM_QK];
                dequant_block<WT>(wr + b * bytes, v);
                for (int j = 0; j < GEMV_MR; j++) {
                    const float4 *xv = (const float4 *)(xr[j] + b * LOOM_QK);
                    float s = 0.0f;
                    if (VEC) {
                        for (int e = 0; e < LOOM_QK / 4; e++) {
                            float4 q = xv[e];
                            s += v[4 * e] * q.x + v[4 * e + 1] * q.y + v[4 * e + 2] * q.z +
                                v[4 * e + 3] * q.w;
                        }
                    } else {
                        for (int e = 0; e < LOOM_QK; e++)
                            s += v[e] * xr[j][b * LOOM_QK + e];
                    }
                    acc[j] += s;
                }
            }
        } else if (VEC && (WT == LOOM_F32 || WT == LOOM_F16 || WT == LOOM_BF16)) {
            const int per = WT == LOOM_F32 ? 4 : 8; /* elements in 16 bytes */
            for (int64_t k = (int64_t)lane * per; k < K; k += WARP * per) {
                uint4 raw = *(const uint4 *)(wr + k * (WT == LOOM_F32 ? 4 : 2));
                float v[8];
                if (WT == LOOM_F32) {
                    v[0] = __uint_as_float(raw.x), v[1] = __uint_as_float(raw.y);
                    v[2] = __uint_as_float(raw.z), v[3] = __uint_as_float(raw.w);
                } else {
                    uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
                    for (int e = 0; e < 4; e++) {
                        uint16_t lo = words[e] & 0xffff, hi = words[e] >> 16;
                        v[2 * e] = WT == LOOM_F16 ? f16_bits(lo)
                                                  : __uint_as_float((uint32_t)lo << 16);
                        v[2 * e + 1] = WT == LOOM_F16 ? f16_bits(hi)
                                                      : __uint_as_float((uint32_t)hi << 16);
                    }
                }
                for (int j = 0; j < GEMV_MR; j++) {
                    const float4 *xv = (const float4 *)(xr[j] + k);
                    for (int e = 0; e < per / 4; e++) {
                        float4 q = xv[e];
                        acc[j] += v[4 * e] * q.x + v[4 * e + 1] * q.y + v[4 * e + 2] * q.z +
                            v[4 * e + 3] * q.w;
                    }
                }
            }
        } else { /* and the ABI 1.2 types, element by element for now (issue: tune on a GPU) */
            for (int64_t k = lane; k < K; k += WARP) {
                float v = load_elem(WT, wr, k);
                for (int j = 0; j < GEMV_MR; j++)
                    acc[j] += v * xr[j][k];
            }
        }
        for (int j = 0; j < GEMV_MR; j++)
            acc[j] = warp_sum(acc[j]);
        if (lane == 0)
            for (int j = 0; j < mr; j++)
                ((float *)row_at(y, m0 + j))[n] = acc[j] + (bias ? bias[n] : 0.0f);
    }
}

/* ---- Matmul: loom's own tiled GEMM, for builds without a BLAS (Debian's HIP has none) ------
 * A 64x64 tile of Y per block of 256 threads, each thread a 4x4 patch; X and W stream through
 * shared memory 32 columns at a time, W dequantised to f32 as it is staged. */

#define GEMM_TILE 64
#define GEMM_TK 32

template <int WT>
__global__ void __launch_bounds__(256)
    k_gemm_tiled(tview x, tview w, const float *bias, tview y, int64_t M, int64_t K, int64_t N)
{
    __shared__ float xs[GEMM_TK][GEMM_TILE + 4]; /* transposed: [k][m] */
    __shared__ float ws[GEMM_TK][GEMM_TILE + 4]; /* [k][n] */
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    int64_t m0 = (int64_t)blockIdx.y * GEMM_TILE, n0 = (int64_t)blockIdx.x * GEMM_TILE;
    float acc[4][4] = {{0.0f}};
    for (int64_t k0 = 0; k0 < K; k0 += GEMM_TK) {
        for (int i = threadIdx.x; i < GEMM_TILE * GEMM_TK; i += blockDim.x) {
            int r = i / GEMM_TK, c = i % GEMM_TK;
            int64_t m = m0 + r, n = n0 + r, k = k0 + c;
            xs[c][r] = m < M && k < K ? ((const float *)row_at(x, m))[k] : 0.0f;
            ws[c][r] = n < N && k < K ? load_elem(WT, row_at(w, n), k) : 0.0f;
        }
        __syncthreads();
        for (int c = 0; c < GEMM_TK; c++) {
            float a[4], b[4];
            for (int i = 0; i < 4; i++)
                a[i] = xs[c][ty * 4 + i], b[i] = ws[c][tx * 4 + i];
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++)
                    acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
    for (int i = 0; i < 4; i++) {
        int64_t m = m0 + ty * 4 + i;
        if (m >= M)
            continue;
        float *yr = (float *)row_at(y, m);
        for (int j = 0; j < 4; j++) {
            int64_t n = n0 + tx * 4 + j;
            if (n < N)
                yr[n] = acc[i][j] + (bias ? bias[n] : 0.0f);
        }
    }
}

/* ---- Mixture of experts (ABI 1.5) --------------------------------------------------------- */

/* moe_route, one thread a token, in the reference's arithmetic: scores by softmax (over the
 * token's logits, summed in double) or sigmoid; the k best by score + bias (by logit without a
 * bias), the lower index first among equals; weights the chosen scores, divided by their sum
 * when normalize, times scale. */
__device__ __forceinline__ float moe_score(const float *logit, int64_t e, float max, double sum,
                                           int sigmoid)
{
    return sigmoid ? 1.0f / (1.0f + expf(-logit[e])) : (float)(expf(logit[e] - max) / sum);
}

__device__ __forceinline__ float moe_choice(const float *logit, const float *bias, int64_t e,
                                            float max, double sum, int sigmoid)
{
    return bias ? moe_score(logit, e, max, sum, sigmoid) + bias[e] : logit[e];
}

/* A group's score for group-limited routing: the sum of its two best choice scores */
__device__ double moe_group_score(const float *logit, const float *bias, int64_t g, int64_t per,
                                  float max, double sum, int sigmoid)
{
    double first = -1e300, second = -1e300;
    for (int64_t e = g * per; e < (g + 1) * per; e++) {
        double c = moe_choice(logit, bias, e, max, sum, sigmoid);
        if (c > first)
            second = first, first = c;
        else if (c > second)
            second = c;
    }
    return first + (per > 1 ? second : 0);
}

__global__ void k_moe_route(tview logits, const float *bias, tview ids, tview weights, int64_t E,
                            int64_t k, int64_t T, int sigmoid, int normalize, float scale,
                            int32_t groups, int32_t kept)
{
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T)
        return;
    const float *logit = (const float *)row_at(logits, t);
    int32_t *id = (int32_t *)row_at(ids, t);
    float *w = (float *)row_at(weights, t);
    float max = logit[0];
    for (int64_t e = 1; e < E; e++)
        max = logit[e] > max ? logit[e] : max;
    double sum = 0;
    for (int64_t e = 0; e < E && !sigmoid; e++)
        sum += expf(logit[e] - max);
    /* group-limited: a group is kept when fewer than `kept` groups beat it (a higher score, or
     * an equal one and a lower index) */
    unsigned long long keep[1024 / 64] = {0};
    int64_t per = E / groups;
    for (int32_t g = 0; g < groups && groups > 1; g++) {
        double mine = moe_group_score(logit, bias, g, per, max, sum, sigmoid);
        int32_t better = 0;
        for (int32_t h = 0; h < groups && better < kept; h++) {
            double other = h == g ? mine : moe_group_score(logit, bias, h, per, max, sum, sigmoid);
            better += other > mine || (other == mine && h < g);
        }
        if (better < kept)
            keep[g / 64] |= 1ull << (g % 64);
    }
    double chosen = 0;
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        float best_choice = 0.0f;
        for (int64_t e = 0; e < E; e++) {
            int taken = groups > 1 && !(keep[e / per / 64] >> (e / per % 64) & 1);
            for (int64_t q = 0; q < j; q++)
                taken |= id[q] == e;
            if (taken)
                continue;
            float c = moe_choice(logit, bias, e, max, sum, sigmoid);
            if (best < 0 || c > best_choice)
                best = e, best_choice = c;
        }
        id[j] = (int32_t)best;
        chosen += moe_score(logit, best, max, sum, sigmoid);
    }
    for (int64_t j = 0; j < k; j++) {
        double s = moe_score(logit, id[j], max, sum, sigmoid);
        w[j] = (float)(s / (normalize ? chosen : 1.0) * scale);
    }
}

/* moe_combine: dst[t] (+)= sum over j of weights[t, j] src[t, j], j in order, as the reference */
__global__ void k_moe_combine(tview src, tview weights, tview dst, int64_t n, int64_t k, int64_t T,
                              int accumulate)
{
    for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
        float *d = (float *)row_at(dst, t);
        const float *w = (const float *)row_at(weights, t);
        for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
             i += (int64_t)gridDim.x * blockDim.x) {
            float acc = accumulate ? d[i] : 0.0f;
            for (int64_t j = 0; j < k; j++)
                acc += w[j] * ((const float *)row_at(src, t * k + j))[i];
            d[i] = acc;
        }
    }
}

/* After a cuBLAS GEMM into a dense [M, N] scratch: y[m, :] = scratch[m, :] + bias. */
__global__ void k_store_rows(const float *dense, tview y, const float *bias, int64_t N, int64_t M)
{
    for (int64_t m = blockIdx.y; m < M; m += gridDim.y) {
        float *yr = (float *)row_at(y, m);
        for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < N;
             i += (int64_t)gridDim.x * blockDim.x)
            yr[i] = dense[m * N + i] + (bias ? bias[i] : 0.0f);
    }
}

/* ---- KV cache ---------------------------------------------------------------------------- */

/* Float caches: one thread per element. Row (slot, head) of the cache is tensor row
 * slot * kv_heads + head, whatever the strides put where. */
__global__ void k_kv_store(tview src, tview slots, tview cache, int cdt, int64_t hd, int64_t kvh,
                           int64_t tokens, int64_t n_slots, dev_error *err)
{
    for (int64_t r = blockIdx.y; r < tokens * kvh; r += gridDim.y) {
        int64_t t = r / kvh, h = r % kvh;
        int32_t slot = i32_at(slots, t);
        if (slot < 0)
            continue;
        if (slot >= n_slots) {
            if (h == 0 && blockIdx.x == 0 && threadIdx.x == 0)
                report_error(err, LOOM_OP_KV_STORE, slot, n_slots, t);
            continue;
        }
        const float *s = (const float *)row_at(src, r);
        char *d = row_at(cache, (int64_t)slot * kvh + h);
        for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < hd;
             i += (int64_t)gridDim.x * blockDim.x)
            store_elem(cdt, d, i, s[i]);
    }
}

/* Q8_0 caches: one warp per block of 32 elements, quantised as loom_quantize_row_q8_0 does. */
__global__ void k_kv_store_q8(tview src, tview slots, tview cache, int64_t hd, int64_t kvh,
                              int64_t tokens, int64_t n_slots, dev_error *err)
{
    int lane = threadIdx.x % WARP;
    int64_t per_row = hd / LOOM_QK, total = tokens * kvh * per_row;
    for (int64_t item = (int64_t)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
         item < total; item += (int64_t)gridDim.x * (blockDim.x / WARP)) {
        int64_t r = item / per_row, blk = item % per_row, t = r / kvh, h = r % kvh;
        int32_t slot = i32_at(slots, t);
        if (slot < 0)
            continue;
        if (slot >= n_slots) {
            if (lane == 0 && h == 0 && blk == 0)
                report_error(err, LOOM_OP_KV_STORE, slot, n_slots, t);
            continue;
        }
        float v = ((const float *)row_at(src, r))[blk * LOOM_QK + lane];
        float d = warp_max(fabsf(v)) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        char *out = row_at(cache, (int64_t)slot * kvh + h) + blk * sizeof(loom_block_q8_0);
        out[2 + lane] = (char)(int)roundf(__fmul_rn(v, id));
        if (lane == 0)
            *(uint16_t *)out = __half_as_ushort(__float2half_rn(d));
    }
}

/* ---- Attention ----------------------------------------------------------------------------
 * Flash-decoding over the paged cache. Block (token t, kv head, head chunk, split z) handles
 * up to `gb` query heads that share one kv head, over keys [z * split_len, (z+1) * split_len)
 * of t's visible range [0, last], in tiles of `tile` keys staged in shared memory (each K/V row
 * read once for the whole group). Softmax is online: a running max m, sum l and unnormalised
 * accumulator per head. With one split the block writes dst itself; otherwise it writes
 * (m, l, acc) and k_attn_combine merges the splits. */

struct attn_args {
    tview q, k, v, table, seq, pos, prefix, dst;
    int has_prefix;
    int window; /* keys j > pos - window only; 0: all */
    int cdt;
    int64_t hd, heads, kvh, group, bs, n_blocks, n_seqs, max_blocks;
    int gb, chunks, tile, splits;
    int64_t split_len;
    float scale;
    float *part; /* [tokens, heads, splits, hd + 2] when splits > 1 */
    dev_error *err;
};

__global__ void k_attention(attn_args a)
{
    LOOM_DYNAMIC_SHARED(float, sm);
    const int64_t hd = a.hd, T = a.tile, G = a.gb;
    float *q_s = sm;                 /* [G][hd] */
    float *k_s = q_s + G * hd;       /* [T][hd + 1], padded against bank conflicts */
    float *v_s = k_s + T * (hd + 1); /* [T][hd] */
    float *p_s = v_s + T * hd;       /* [G][T] */
    float *acc_s = p_s + G * T;      /* [G][hd] */
    float *m_s = acc_s + G * hd, *l_s = m_s + G, *corr_s = l_s + G;

    int64_t t = blockIdx.x;
    int64_t kv = blockIdx.y / a.chunks, h0 = kv * a.group + (blockIdx.y % a.chunks) * G;
    int64_t ng = lmin((int64_t)G, kv * a.group + a.group - h0);
    int z = blockIdx.z;
    int32_t s = i32_at(a.seq, t), pos = i32_at(a.pos, t);
    if (s < 0 || s >= a.n_seqs || pos < 0) {
        if (threadIdx.x == 0 && blockIdx.y == 0 && z == 0)
            report_error(a.err, LOOM_OP_ATTENTION, s < 0 || s >= a.n_seqs ? s : pos, a.n_seqs, t);
        return;
    }
    int64_t last = pos;
    if (a.has_prefix)
        last = lmax(last, (int64_t)i32_at(a.prefix, s) - 1);
    if (last / a.bs >= a.max_blocks) {
        if (threadIdx.x == 0 && blockIdx.y == 0 && z == 0)
            report_error(a.err, LOOM_OP_ATTENTION, last, a.max_blocks * a.bs, t);
        return;
    }
    int64_t first = a.window > 0 ? lmax(0, (int64_t)pos - a.window + 1) : 0;
    int64_t j_begin = lmax(z * a.split_len, first),
            j_end = lmin(z * a.split_len + a.split_len, last + 1);
    const int32_t *table = (const int32_t *)row_at(a.table, s);

    for (int64_t i = threadIdx.x; i < G * hd; i += blockDim.x) {
        int64_t g = i / hd;
        q_s[i] = g < ng ? ((const float *)row_at(a.q, t * a.heads + h0 + g))[i % hd] * a.scale
                        : 0.0f;
        acc_s[i] = 0.0f;
    }
    if (threadIdx.x < G)
        m_s[threadIdx.x] = -INFINITY, l_s[threadIdx.x] = 0.0f;
    __syncthreads();

    for (int64_t j0 = j_begin; j0 < j_end; j0 += T) {
        int64_t nt = lmin(T, j_end - j0);
        for (int64_t i = threadIdx.x; i < nt * hd; i += blockDim.x) {
            int64_t tt = i / hd, d = i % hd, j = j0 + tt;
            int32_t blk = table[j / a.bs];
            float kx = 0.0f, vx = 0.0f;
            if (blk >= 0 && blk < a.n_blocks) {
                int64_t row = ((int64_t)blk * a.bs + j % a.bs) * a.kvh + kv;
                kx = load_elem(a.cdt, row_at(a.k, row), d);
                vx = load_elem(a.cdt, row_at(a.v, row), d);
            } else if (d == 0) {
                report_error(a.err, LOOM_OP_ATTENTION, blk, a.n_blocks, -1);
            }
            k_s[tt * (hd + 1) + d] = kx;
            v_s[tt * hd + d] = vx;
        }
        __syncthreads();
        for (int64_t i = threadIdx.x; i < G * T; i += blockDim.x) {
            int64_t g = i / T, tt = i % T;
            float sc = -INFINITY;
            if (tt < nt && g < ng) {
                sc = 0.0f;
                for (int64_t d = 0; d < hd; d++)
                    sc += q_s[g * hd + d] * k_s[tt * (hd + 1) + d];
            }
            p_s[i] = sc;
        }
        __syncthreads();
        /* one warp per head: the tile's max, the rescale of what came before, p = exp(s - m).
         * Every warp runs every round (idle ones on no head) so no shuffle is divergent. */
        for (int64_t g0 = 0; g0 < G; g0 += blockDim.x / WARP) {
            int64_t g = g0 + threadIdx.x / WARP;
            int lane = threadIdx.x % WARP, valid = g < G;
            float mx = -INFINITY;
            for (int64_t tt = lane; valid && tt < T; tt += WARP)
                mx = fmaxf(mx, p_s[g * T + tt]);
            mx = warp_max(mx);
            float m_old = valid ? m_s[g] : 0.0f, m_new = fmaxf(m_old, mx), sum = 0.0f;
            for (int64_t tt = lane; valid && tt < T; tt += WARP) {
                float p = m_new == -INFINITY ? 0.0f : expf(p_s[g * T + tt] - m_new);
                p_s[g * T + tt] = p;
                sum += p;
            }
            sum = warp_sum(sum);
            if (valid && lane == 0) {
                float corr = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
                corr_s[g] = corr;
                l_s[g] = l_s[g] * corr + sum;
                m_s[g] = m_new;
            }
        }
        __syncthreads();
        for (int64_t i = threadIdx.x; i < G * hd; i += blockDim.x) {
            int64_t g = i / hd, d = i % hd;
            float acc = acc_s[i] * corr_s[g];
            for (int64_t tt = 0; tt < nt; tt++)
                acc += p_s[g * T + tt] * v_s[tt * hd + d];
            acc_s[i] = acc;
        }
        __syncthreads();
    }

    for (int64_t i = threadIdx.x; i < ng * hd; i += blockDim.x) {
        int64_t g = i / hd, d = i % hd, h = h0 + g;
        if (a.splits == 1) {
            float l = l_s[g];
            ((float *)row_at(a.dst, t * a.heads + h))[d] = l > 0.0f ? acc_s[i] / l : 0.0f;
        } else {
            float *part = a.part + ((t * a.heads + h) * a.splits + z) * (hd + 2);
            part[d] = acc_s[i];
            if (d == 0)
                part[hd] = m_s[g], part[hd + 1] = l_s[g];
        }
    }
}

/* Merges the splits of one (token, head): out = sum_z acc_z e^(m_z - M) / sum_z l_z e^(m_z - M). */
__global__ void k_attn_combine(attn_args a, int64_t tokens)
{
    for (int64_t r = blockIdx.x; r < tokens * a.heads; r += gridDim.x) {
        const float *part = a.part + r * a.splits * (a.hd + 2);
        float M = -INFINITY, L = 0.0f;
        for (int z = 0; z < a.splits; z++)
            if (part[z * (a.hd + 2) + a.hd + 1] > 0.0f)
                M = fmaxf(M, part[z * (a.hd + 2) + a.hd]);
        for (int z = 0; z < a.splits; z++) {
            const float *pz = part + z * (a.hd + 2);
            if (pz[a.hd + 1] > 0.0f)
                L += pz[a.hd + 1] * expf(pz[a.hd] - M);
        }
        float *out = (float *)row_at(a.dst, r);
        for (int64_t d = threadIdx.x; d < a.hd; d += blockDim.x) {
            float acc = 0.0f;
            for (int z = 0; z < a.splits; z++) {
                const float *pz = part + z * (a.hd + 2);
                if (pz[a.hd + 1] > 0.0f)
                    acc += pz[d] * expf(pz[a.hd] - M);
            }
            out[d] = L > 0.0f ? acc / L : 0.0f;
        }
    }
}

#endif
