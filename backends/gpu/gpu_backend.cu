/*
 * backends/gpu/gpu_backend.cu - the GPU backend's host half: device state, buffers, copies,
 * and one checked launcher per ABI op. Device code lives in kernels.cuh.
 *
 * One stream per opened device; every op is enqueued on it, so ordering needs no events.
 * Buffers freed by the caller go to a cache and are handed out again (the stream orders the
 * reuse), so steady-state serving never calls cudaMalloc. Host copies go through two pinned
 * staging slots, so copy_from_host returns as soon as the caller's memory is no longer needed.
 *
 * cuBLAS is opened with dlopen, not linked, so a machine without it gets a probe reason rather
 * than a module that fails to load. Matmuls with more than GEMV_MAX_M activation rows go to
 * cuBLAS (activations converted to the weights' f16/bf16, block weights dequantised to f16 in
 * slices); smaller ones, the decode case, use loom's GEMV kernels.
 */
#include "gpu_module.h"
#include "kernels.cuh"

#if LOOM_GPU_BLAS && defined(LOOM_GPU_EMULATED)
#include "emulated_cublas.h" /* scripts/gpu-emulate: a host GemmEx linked into the module */
#elif LOOM_GPU_BLAS
#include <cublas_v2.h>
#endif
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GEMV_MAX_M 8
#define STAGING_BYTES (8u << 20)
#define DEQUANT_SLICE_BYTES (64u << 20) /* f16 weights dequantised per cuBLAS call */
#define ATTN_THREADS 128
#define ATTN_SHARED_MAX 48000

struct loom_buffer {
    char *dev;
    uint64_t size, cap;
    loom_buffer *next; /* in the cache of freed buffers */
};

struct scratch {
    char *p;
    size_t cap;
};

#if LOOM_GPU_BLAS
/* spelled out: C++ sees two overloads of cublasGemmEx (compute type as enum or data type) */
typedef cublasStatus_t (*gemm_ex_fn)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int,
                                     int, const void *, const void *, cudaDataType, int,
                                     const void *, cudaDataType, int, const void *, void *,
                                     cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);

struct blas_api {
    void *lib;
    decltype(&cublasCreate_v2) create;
    decltype(&cublasDestroy_v2) destroy;
    decltype(&cublasSetStream_v2) set_stream;
    gemm_ex_fn gemm;
    cublasHandle_t handle;
};
#endif

struct cuda_backend {
    loom_backend base;
    loom_backend_ops ops;
    int device, sm_count;
    char device_name[256];
    cudaStream_t stream;
#if LOOM_GPU_BLAS
    blas_api blas;
#endif
    char *staging[2];
    cudaEvent_t staging_done[2];
    int staging_busy[2]; /* its event was recorded and not yet waited for */
    int next_staging;
    dev_error *err_host, *err_dev;
    scratch act, weights, out, part;
    loom_buffer *cached;
    char error[512];
};

static cuda_backend *cb_of(loom_backend *be)
{
    return (cuda_backend *)be;
}

static loom_status fail(cuda_backend *cb, loom_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cb->error, sizeof cb->error, fmt, ap);
    va_end(ap);
    return st;
}

static loom_status cuda_fail(cuda_backend *cb, cudaError_t e, const char *what)
{
    if (e == cudaErrorMemoryAllocation) {
        size_t free_b = 0, total = 0;
        (void)cudaGetLastError();
        (void)cudaMemGetInfo(&free_b, &total);
        return fail(cb, LOOM_ERR_OUT_OF_MEMORY,
                    "%s: " LOOM_GPU_PLATFORM " device %d (%s) is out of memory "
                    "(%zu MiB free of %zu MiB)",
                    what, cb->device, cb->device_name, free_b >> 20, total >> 20);
    }
    return fail(cb, LOOM_ERR_DEVICE, "%s: " LOOM_GPU_PLATFORM " device %d: %s (%s)", what,
                cb->device, cudaGetErrorString(e), cudaGetErrorName(e));
}

#define CUDA_TRY(cb, call, what)                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            return cuda_fail(cb, e_, what);                                                        \
    } while (0)

#define TRY(expr)                                                                                  \
    do {                                                                                           \
        loom_status st_ = (expr);                                                                  \
        if (st_ != LOOM_OK)                                                                        \
            return st_;                                                                            \
    } while (0)

/* The runtime's current device is per host thread, and the engine may call from a thread other
 * than the one that opened the backend. */
static loom_status enter(cuda_backend *cb)
{
    CUDA_TRY(cb, cudaSetDevice(cb->device), "cudaSetDevice");
    return LOOM_OK;
}

static loom_status launched(cuda_backend *cb, const char *what)
{
    CUDA_TRY(cb, cudaGetLastError(), what);
    return LOOM_OK;
}

/* Device-side argument errors, reported once the work that found them has run. */
static loom_status collect_device_error(cuda_backend *cb)
{
    volatile dev_error *e = cb->err_host;
    if (!e->code)
        return LOOM_OK;
    int op = e->code - 1;
    long long value = e->value, limit = e->limit, where = e->where;
    e->code = 0;
    switch (op) {
    case LOOM_OP_GET_ROWS:
        return fail(cb, LOOM_ERR_INVALID, "get_rows: id %lld at %lld is outside [0, %lld)", value,
                    where, limit);
    case LOOM_OP_KV_STORE:
        return fail(cb, LOOM_ERR_INVALID,
                    "kv_store: slot %lld (token %lld) is outside the "
                    "cache's %lld slots",
                    value, where, limit);
    default:
        if (where < 0)
            return fail(cb, LOOM_ERR_INVALID,
                        "attention: block id %lld in the block table is "
                        "outside the cache's %lld blocks",
                        value, limit);
        return fail(cb, LOOM_ERR_INVALID,
                    "attention: token %lld has a sequence or position "
                    "(%lld) outside the block table (limit %lld)",
                    where, value, limit);
    }
}

static loom_status grow(cuda_backend *cb, scratch *s, size_t bytes, const char *what)
{
    if (s->cap >= bytes)
        return LOOM_OK;
    size_t cap = bytes + bytes / 2;
    if (s->p) {
        CUDA_TRY(cb, cudaStreamSynchronize(cb->stream), what);
        (void)cudaFree(s->p);
        s->p = NULL, s->cap = 0;
    }
    CUDA_TRY(cb, cudaMalloc((void **)&s->p, cap), what);
    s->cap = cap;
    return LOOM_OK;
}

/* ---- Tensors ----------------------------------------------------------------------------- */

static int64_t n_rows(const loom_tensor *t)
{
    return t->ne[1] * t->ne[2] * t->ne[3];
}

/* Well formed, inside its buffer, and aligned for its dtype's loads (a GPU faults on an
 * unaligned access where a CPU would only slow down). */
static loom_status check_tensor(cuda_backend *cb, const loom_tensor *t, const char *what)
{
    if (!t || !t->buf)
        return fail(cb, LOOM_ERR_INVALID, "%s: missing tensor or buffer", what);
    uint64_t extent = loom_tensor_extent(t);
    if (extent == UINT64_MAX)
        return fail(cb, LOOM_ERR_INVALID,
                    "%s: malformed %s tensor (negative dims or rows of "
                    "partial blocks)",
                    what, loom_dtype_name(t->dtype));
    if (t->offset > t->buf->size || extent > t->buf->size - t->offset)
        return fail(cb, LOOM_ERR_INVALID,
                    "%s: tensor spans bytes [%llu, %llu) but its buffer "
                    "holds %llu",
                    what, (unsigned long long)t->offset, (unsigned long long)(t->offset + extent),
                    (unsigned long long)t->buf->size);
    uint64_t align = loom_dtype_block_elems(t->dtype) > 1
        ? 2
        : (uint64_t)loom_dtype_block_bytes(t->dtype);
    if (t->offset % align || t->nb[1] % align || t->nb[2] % align || t->nb[3] % align)
        return fail(cb, LOOM_ERR_INVALID,
                    "%s: offset and strides must be multiples of %llu bytes "
                    "for %s",
                    what, (unsigned long long)align, loom_dtype_name(t->dtype));
    return LOOM_OK;
}

static tview view_of(const loom_tensor *t)
{
    tview v;
    v.p = t->buf->dev + t->offset;
    v.ne0 = t->ne[0];
    v.ne1 = t->ne[1] > 0 ? t->ne[1] : 1;
    v.ne2 = t->ne[2] > 0 ? t->ne[2] : 1;
    v.nb1 = (int64_t)t->nb[1];
    v.nb2 = (int64_t)t->nb[2];
    v.nb3 = (int64_t)t->nb[3];
    return v;
}

static int aligned16(const loom_tensor *t)
{
    return ((uintptr_t)(t->buf->dev + t->offset)) % 16 == 0 && t->nb[1] % 16 == 0 &&
        t->nb[2] % 16 == 0 && t->nb[3] % 16 == 0;
}

/* A grid for kernels that loop over (rows, elements of a row). */
static void row_grid(int64_t n, int64_t rows, dim3 *grid, dim3 *block)
{
    *block = dim3(256);
    int64_t gx = (n + 255) / 256;
    *grid = dim3((unsigned)(gx < 1          ? 1
                                : gx > 1024 ? 1024
                                            : gx),
                 (unsigned)(rows < 1           ? 1
                                : rows > 65535 ? 65535
                                               : rows));
}

static const float *f32_ptr(const loom_tensor *t)
{
    return t ? (const float *)(t->buf->dev + t->offset) : NULL;
}

/* ---- Matmul ------------------------------------------------------------------------------ */

template <int WT>
static void launch_gemv(cuda_backend *cb, bool vec, const loom_matmul_params *p, int64_t M,
                        int64_t K, int64_t N)
{
    dim3 grid(
        (unsigned)((N + GEMV_WARPS - 1) / GEMV_WARPS),
        (unsigned)(((M + GEMV_MR - 1) / GEMV_MR) > 65535 ? 65535 : (M + GEMV_MR - 1) / GEMV_MR));
    void (*kernel)(tview, tview, const float *, tview, int64_t, int64_t,
                   int64_t) = vec ? k_gemv<WT, true> : k_gemv<WT, false>;
    LOOM_LAUNCH(kernel, grid, GEMV_WARPS * WARP, 0, cb->stream, view_of(p->x), view_of(p->w),
                f32_ptr(p->bias), view_of(p->y), M, K, N);
}

static loom_status gemv(cuda_backend *cb, const loom_matmul_params *p, int64_t M, int64_t K,
                        int64_t N)
{
    loom_dtype wt = p->w->dtype;
    int64_t elem = loom_dtype_block_bytes(wt);
    /* 16-byte loads need aligned rows of whole 16-byte groups, for weights and activations */
    bool vec = aligned16(p->x) && K % 4 == 0 &&
        (loom_dtype_is_block(wt) || (aligned16(p->w) && (K * elem) % 16 == 0));
    switch (wt) {
    case LOOM_F32: launch_gemv<LOOM_F32>(cb, vec, p, M, K, N); break;
    case LOOM_F16: launch_gemv<LOOM_F16>(cb, vec, p, M, K, N); break;
    case LOOM_BF16: launch_gemv<LOOM_BF16>(cb, vec, p, M, K, N); break;
    case LOOM_Q8_0: launch_gemv<LOOM_Q8_0>(cb, vec, p, M, K, N); break;
    case LOOM_Q4_0: launch_gemv<LOOM_Q4_0>(cb, vec, p, M, K, N); break;
    case LOOM_Q4_1: launch_gemv<LOOM_Q4_1>(cb, vec, p, M, K, N); break;
#define GEMV(T)                                                                                    \
    case T: launch_gemv<T>(cb, vec, p, M, K, N); break;
        LOOM_GPU_NEW_QUANTS(GEMV)
#undef GEMV
    default: return fail(cb, LOOM_ERR_UNSUPPORTED, "matmul: %s weights", loom_dtype_name(wt));
    }
    return launched(cb, "matmul (gemv)");
}

static loom_status convert_rows(cuda_backend *cb, tview src, int sdt, tview dst, int ddt, int64_t n,
                                int64_t rows)
{
    dim3 grid, block;
    row_grid(n, rows, &grid, &block);
    LOOM_LAUNCH(k_convert, grid, block, 0, cb->stream, src, sdt, dst, ddt, n, rows);
    return launched(cb, "convert");
}

#if LOOM_GPU_BLAS
static tview dense_view(void *p, int64_t row_bytes, int64_t n, int64_t rows)
{
    tview v;
    v.p = (char *)p;
    v.ne0 = n;
    v.ne1 = rows > 0 ? rows : 1;
    v.ne2 = 1;
    v.nb1 = row_bytes;
    v.nb2 = v.nb3 = row_bytes * v.ne1;
    return v;
}

/* Rows evenly spaced by nb[1], so a BLAS leading dimension can describe them. */
static int uniform_rows(const loom_tensor *t)
{
    return (t->ne[2] <= 1 || t->nb[2] == t->nb[1] * (uint64_t)t->ne[1]) &&
        (t->ne[3] <= 1 || t->nb[3] == t->nb[2] * (uint64_t)t->ne[2]);
}

/* Y = X W^T through cuBLAS. Column-major view: Y^T (N x M) = W (K x N)^T . X^T (K x M). */
static loom_status gemm(cuda_backend *cb, const loom_matmul_params *p, int64_t M, int64_t K,
                        int64_t N)
{
    loom_dtype wt = p->w->dtype;
    bool float_w = loom_dtype_is_float(wt);
    cudaDataType ab_type = wt == LOOM_F32 ? CUDA_R_32F : wt == LOOM_BF16 ? CUDA_R_16BF : CUDA_R_16F;
    int ab_size = wt == LOOM_F32 ? 4 : 2;
    int ab_dtype = wt == LOOM_F32 ? LOOM_F32 : wt == LOOM_BF16 ? LOOM_BF16 : LOOM_F16;

    /* activations: used in place when they already are what cuBLAS wants, else made dense */
    const void *x_ptr;
    int64_t ldx;
    if (wt == LOOM_F32 && uniform_rows(p->x)) {
        x_ptr = p->x->buf->dev + p->x->offset;
        ldx = (int64_t)p->x->nb[1] / 4;
    } else {
        TRY(grow(cb, &cb->act, (size_t)(M * K * ab_size), "matmul activations"));
        TRY(convert_rows(cb, view_of(p->x), LOOM_F32, dense_view(cb->act.p, K * ab_size, K, M),
                         ab_dtype, K, M));
        x_ptr = cb->act.p;
        ldx = K;
    }
    /* output: in place when its rows are evenly spaced, else dense, then scattered */
    bool y_direct = uniform_rows(p->y);
    float *y_ptr;
    int64_t ldy;
    if (y_direct) {
        y_ptr = (float *)(p->y->buf->dev + p->y->offset);
        ldy = (int64_t)p->y->nb[1] / 4;
    } else {
        TRY(grow(cb, &cb->out, (size_t)(M * N * 4), "matmul output"));
        y_ptr = (float *)cb->out.p;
        ldy = N;
    }
    /* weights: in place for float types, dequantised to f16 slices for block types */
    int64_t slice = float_w ? N : DEQUANT_SLICE_BYTES / (K * 2);
    if (slice < 1)
        slice = 1;
    if (!float_w)
        TRY(grow(cb, &cb->weights, (size_t)((slice < N ? slice : N) * K * 2), "matmul weights"));
    const float one = 1.0f, zero = 0.0f;
    for (int64_t n0 = 0; n0 < N; n0 += slice) {
        int64_t nc = N - n0 < slice ? N - n0 : slice;
        const void *w_ptr;
        int64_t ldw;
        if (float_w) {
            w_ptr = p->w->buf->dev + p->w->offset;
            ldw = (int64_t)p->w->nb[1] / ab_size;
        } else {
            tview w = view_of(p->w);
            w.p += n0 * (int64_t)p->w->nb[1]; /* rows n0.. of a uniform-row tensor */
            TRY(convert_rows(cb, w, wt, dense_view(cb->weights.p, K * 2, K, nc), LOOM_F16, K, nc));
            w_ptr = cb->weights.p;
            ldw = K;
        }
        cublasStatus_t bs = cb->blas.gemm(cb->blas.handle, CUBLAS_OP_T, CUBLAS_OP_N, (int)nc,
                                          (int)M, (int)K, &one, w_ptr, ab_type, (int)ldw, x_ptr,
                                          ab_type, (int)ldx, &zero, y_ptr + n0, CUDA_R_32F,
                                          (int)ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        if (bs != CUBLAS_STATUS_SUCCESS)
            return fail(cb, LOOM_ERR_DEVICE,
                        "matmul: cublasGemmEx failed with status %d "
                        "(M=%lld N=%lld K=%lld, %s weights)",
                        (int)bs, (long long)M, (long long)nc, (long long)K, loom_dtype_name(wt));
    }
    if (!y_direct || p->bias) {
        dim3 grid, block;
        row_grid(N, M, &grid, &block);
        tview dense = y_direct ? view_of(p->y) : dense_view(y_ptr, N * 4, N, M);
        if (y_direct) /* bias only: y += bias in place */
            LOOM_LAUNCH(k_elementwise, grid, block, 0, cb->stream, EW_ADD, dense, view_of(p->bias),
                        dense, N, M, 1, 0.0f);
        else
            LOOM_LAUNCH(k_store_rows, grid, block, 0, cb->stream, y_ptr, view_of(p->y),
                        f32_ptr(p->bias), N, M);
        TRY(launched(cb, "matmul (epilogue)"));
    }
    return LOOM_OK;
}
#endif

template <int WT>
static void launch_tiled(cuda_backend *cb, const loom_matmul_params *p, int64_t M, int64_t K,
                         int64_t N)
{
    dim3 grid((unsigned)((N + GEMM_TILE - 1) / GEMM_TILE),
              (unsigned)((M + GEMM_TILE - 1) / GEMM_TILE));
    void (*kernel)(tview, tview, const float *, tview, int64_t, int64_t,
                   int64_t) = k_gemm_tiled<WT>;
    LOOM_LAUNCH(kernel, grid, 256, 0, cb->stream, view_of(p->x), view_of(p->w), f32_ptr(p->bias),
                view_of(p->y), M, K, N);
}

static loom_status tiled_gemm(cuda_backend *cb, const loom_matmul_params *p, int64_t M, int64_t K,
                              int64_t N)
{
    switch (p->w->dtype) {
    case LOOM_F32: launch_tiled<LOOM_F32>(cb, p, M, K, N); break;
    case LOOM_F16: launch_tiled<LOOM_F16>(cb, p, M, K, N); break;
    case LOOM_BF16: launch_tiled<LOOM_BF16>(cb, p, M, K, N); break;
    case LOOM_Q8_0: launch_tiled<LOOM_Q8_0>(cb, p, M, K, N); break;
    case LOOM_Q4_0: launch_tiled<LOOM_Q4_0>(cb, p, M, K, N); break;
    case LOOM_Q4_1: launch_tiled<LOOM_Q4_1>(cb, p, M, K, N); break;
#define TILED(T)                                                                                   \
    case T: launch_tiled<T>(cb, p, M, K, N); break;
        LOOM_GPU_NEW_QUANTS(TILED)
#undef TILED
    default:
        return fail(cb, LOOM_ERR_UNSUPPORTED, "matmul: %s weights", loom_dtype_name(p->w->dtype));
    }
    return launched(cb, "matmul (tiled)");
}

static loom_status cuda_matmul(loom_backend *be, const loom_matmul_params *p)
{
    cuda_backend *cb = cb_of(be);
    const char *bad = loom_check_matmul(p);
    if (bad)
        return fail(cb, LOOM_ERR_INVALID, "%s", bad);
    TRY(check_tensor(cb, p->x, "matmul x"));
    TRY(check_tensor(cb, p->w, "matmul w"));
    TRY(check_tensor(cb, p->y, "matmul y"));
    if (p->bias)
        TRY(check_tensor(cb, p->bias, "matmul bias"));
    int64_t M = n_rows(p->x), K = p->x->ne[0], N = n_rows(p->w);
    if (M == 0 || N == 0)
        return LOOM_OK;
    TRY(enter(cb));
    if (M <= GEMV_MAX_M)
        return gemv(cb, p, M, K, N);
#if LOOM_GPU_BLAS
    bool fits_blas = M <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX &&
        (int64_t)p->x->nb[1] / 4 <= INT32_MAX && (int64_t)p->y->nb[1] / 4 <= INT32_MAX;
    if (fits_blas && uniform_rows(p->w))
        return gemm(cb, p, M, K, N);
#endif
    if ((M + GEMM_TILE - 1) / GEMM_TILE > 65535)
        return gemv(cb, p, M, K, N);
    return tiled_gemm(cb, p, M, K, N);
}

/* ---- Mixture of experts (ABI 1.5) --------------------------------------------------------- */

static loom_status cuda_copy_to_host(loom_backend *be, void *dst, loom_buffer *src, uint64_t off,
                                     uint64_t size);

static loom_status cuda_moe_route(loom_backend *be, const loom_moe_route_params *p)
{
    cuda_backend *cb = cb_of(be);
    const char *bad = loom_check_moe_route(p);
    if (bad)
        return fail(cb, LOOM_ERR_INVALID, "%s", bad);
    TRY(check_tensor(cb, p->logits, "moe_route logits"));
    TRY(check_tensor(cb, p->ids, "moe_route ids"));
    TRY(check_tensor(cb, p->weights, "moe_route weights"));
    if (p->bias)
        TRY(check_tensor(cb, p->bias, "moe_route bias"));
    int64_t T = n_rows(p->logits), E = p->logits->ne[0], k = p->ids->ne[0];
    int32_t groups, kept;
    loom_moe_route_groups(p, &groups, &kept);
    if (T == 0)
        return LOOM_OK;
    TRY(enter(cb));
    LOOM_LAUNCH(k_moe_route, dim3((unsigned)((T + 127) / 128)), dim3(128), 0, cb->stream,
                view_of(p->logits), f32_ptr(p->bias), view_of(p->ids), view_of(p->weights), E, k, T,
                p->gating == LOOM_MOE_SIGMOID, p->normalize, p->scale, groups, kept);
    return launched(cb, "moe_route");
}

/* The rows by their ids, read back to the host, each (token, slot) a one-row matmul through
 * the expert's matrix: correct for every weight type the gemv runs, one launch a row. A kernel
 * that takes the ids on the device (and groups a prefill's rows by expert) is the GPU issue's. */
static loom_status cuda_matmul_id(loom_backend *be, const loom_matmul_id_params *p)
{
    cuda_backend *cb = cb_of(be);
    const char *bad = loom_check_matmul_id(p);
    if (bad)
        return fail(cb, LOOM_ERR_INVALID, "%s", bad);
    TRY(check_tensor(cb, p->x, "matmul_id x"));
    TRY(check_tensor(cb, p->w, "matmul_id w"));
    TRY(check_tensor(cb, p->ids, "matmul_id ids"));
    TRY(check_tensor(cb, p->y, "matmul_id y"));
    const int64_t K = p->x->ne[0], N = p->w->ne[1], E = p->w->ne[2], k = p->ids->ne[0];
    const int64_t T = n_rows(p->ids);
    if (T == 0 || N == 0)
        return LOOM_OK;
    uint64_t extent = loom_tensor_extent(p->ids);
    unsigned char *host = (unsigned char *)malloc(extent ? extent : 1);
    if (!host)
        return fail(cb, LOOM_ERR_OUT_OF_MEMORY, "matmul_id: no host memory for the ids");
    loom_status st = cuda_copy_to_host(be, host, p->ids->buf, p->ids->offset, extent);
    for (int64_t t = 0; t < T && st == LOOM_OK; t++)
        for (int64_t j = 0; j < k && st == LOOM_OK; j++) {
            int32_t e;
            memcpy(&e, host + (uint64_t)t * p->ids->nb[1] + (uint64_t)j * p->ids->nb[0], 4);
            if (e < 0 || e >= E) {
                st = fail(cb, LOOM_ERR_INVALID,
                          "matmul_id: expert id %d of token %lld is outside [0, %lld)", e,
                          (long long)t, (long long)E);
                break;
            }
            loom_tensor x = *p->x, w = *p->w, y = *p->y;
            x.offset += (uint64_t)t * p->x->nb[2] + (uint64_t)(p->x->ne[1] > 1 ? j : 0) * x.nb[1];
            y.offset += (uint64_t)t * p->y->nb[2] + (uint64_t)j * y.nb[1];
            w.offset += (uint64_t)e * p->w->nb[2];
            x.ne[1] = x.ne[2] = y.ne[1] = y.ne[2] = w.ne[2] = 1;
            loom_matmul_params mp = {sizeof mp, &x, &w, NULL, &y};
            st = gemv(cb, &mp, 1, K, N);
        }
    free(host);
    return st;
}

static loom_status cuda_moe_combine(loom_backend *be, const loom_moe_combine_params *p)
{
    cuda_backend *cb = cb_of(be);
    const char *bad = loom_check_moe_combine(p);
    if (bad)
        return fail(cb, LOOM_ERR_INVALID, "%s", bad);
    TRY(check_tensor(cb, p->src, "moe_combine src"));
    TRY(check_tensor(cb, p->weights, "moe_combine weights"));
    TRY(check_tensor(cb, p->dst, "moe_combine dst"));
    int64_t n = p->src->ne[0], k = p->src->ne[1], T = n_rows(p->weights);
    if (T == 0 || n == 0)
        return LOOM_OK;
    TRY(enter(cb));
    dim3 grid, block;
    row_grid(n, T, &grid, &block);
    LOOM_LAUNCH(k_moe_combine, grid, block, 0, cb->stream, view_of(p->src), view_of(p->weights),
                view_of(p->dst), n, k, T, p->accumulate);
    return launched(cb, "moe_combine");
}

/* ---- The other ops ----------------------------------------------------------------------- */

static loom_status cuda_get_rows(loom_backend *be, const loom_get_rows_params *p)
{
    cuda_backend *cb = cb_of(be);
    const char *bad = loom_check_get_rows(p);
    if (bad)
        return fail(cb, LOOM_ERR_INVALID, "%s", bad);
    if (!loom_dtype_is_float(p->src->dtype) && !loom_dtype_is_quantized(p->src->dtype))
        return fail(cb, LOOM_ERR_UNSUPPORTED, "get_rows: %s rows", loom_dtype_name(p->src->dtype));
    TRY(check_tensor(cb, p->src, "get_rows src"));
    TRY(check_tensor(cb, p->ids, "get_rows ids"));
    TRY(check_tensor(cb, p->dst, "get_rows dst"));
    int64_t n = p->src->ne[0], n_ids = p->ids->ne[0];
    if (n == 0 || n_ids == 0)
        return LOOM_OK;
    TRY(enter(cb));
    dim3 grid, block;
    row_grid(n, n_ids, &grid, &block);
    LOOM_LAUNCH(k_get_rows, grid, block, 0, cb->stream, view_of(p->src), p->src->dtype,
                n_rows(p->src), view_of(p->ids), view_of(p->dst), n, n_ids, cb->err_dev);
    return launched(cb, "get_rows");
}

static loom_status norm(cuda_backend *cb, const loom_norm_params *p, int layer)
{
    const char *bad = loom_check_norm(p);
    if (bad)
        return fail(cb, LOOM_ERR_INVALID, "%s", bad);
    TRY(check_tensor(cb, p->x, "norm x"));
    TRY(check_tensor(cb, p->dst, "norm dst"));
    if (p->weight)
        TRY(check_tensor(cb, p->weight, "norm weight"));
    if (layer && p->bias)
        TRY(check_tensor(cb, p->bias, "norm bias"));
    int64_t n = p->x->ne[0], rows = n_rows(p->x);
    if (n == 0 || rows == 0)
        return LOOM_OK;
    TRY(enter(cb));
    unsigned grid = (unsigned)(rows > 65535 ? 65535 : rows);
    LOOM_LAUNCH(k_norm, grid, n >= 1024 ? 512 : 128, 0, cb->stream, view_of(p->x),
                f32_ptr(p->weight), layer ? f32_ptr(p->bias) : NULL, view_of(p->dst), n, rows,
                p->eps, layer);
    return launched(cb, "norm");
}

static loom_status cuda_rms_norm(loom_backend *be, const loom_norm_params *p)
{
    return norm(cb_of(be), p, 0);
}

static loom_status cuda_layer_norm(loom_backend *be, const loom_norm_params *p)
{
    return norm(cb_of(be), p, 1);
}

static loom_status cuda_rope(loom_backend *be, const loom_rope_params *p)
{
    cuda_backend *cb = cb_of(be);
    const char *bad = loom_check_rope(p);
    if (bad)
        return fail(cb, LOOM_ERR_INVALID, "%s", bad);
    TRY(check_tensor(cb, p->x, "rope x"));
    TRY(check_tensor(cb, p->pos, "rope pos"));
    TRY(check_tensor(cb, p->dst, "rope dst"));
    if (p->mode == LOOM_ROPE_GLM_2D)
        TRY(check_tensor(cb, p->pos2, "rope pos2"));
    if (p->freq_factors)
        TRY(check_tensor(cb, p->freq_factors, "rope freq_factors"));
    int64_t hd = p->x->ne[0], heads = p->x->ne[1], rows = n_rows(p->x);
    if (rows == 0 || hd == 0)
        return LOOM_OK;
    TRY(enter(cb));
    int64_t pairs = rows * (hd / 2), blocks = (pairs + 255) / 256;
    tview pos2 = p->mode == LOOM_ROPE_GLM_2D ? view_of(p->pos2) : view_of(p->pos);
    tview factors = view_of(p->freq_factors ? p->freq_factors : p->pos);
    LOOM_LAUNCH(k_rope, (unsigned)(blocks > 65535 ? 65535 : blocks), 256, 0, cb->stream,
                view_of(p->x), view_of(p->dst), view_of(p->pos), pos2, factors,
                p->freq_factors != NULL, p->mode, p->n_rot, hd, heads, rows, (double)p->freq_base,
                (double)p->freq_scale);
    return launched(cb, "rope");
}

static loom_status elementwise(cuda_backend *cb, const loom_elementwise_params *p, int kind)
{
    int binary = kind == EW_ADD || kind == EW_MUL || kind == EW_SILU_MUL;
    const char *bad = loom_check_elementwise(p, binary, kind != EW_SILU_MUL);
    if (bad)
        return fail(cb, LOOM_ERR_INVALID, "%s", bad);
    TRY(check_tensor(cb, p->a, "elementwise a"));
    TRY(check_tensor(cb, p->dst, "elementwise dst"));
    if (binary)
        TRY(check_tensor(cb, p->b, "elementwise b"));
    int64_t n = p->a->ne[0], rows = n_rows(p->a);
    if (n == 0 || rows == 0)
        return LOOM_OK;
    TRY(enter(cb));
    int broadcast = binary && n_rows(p->b) == 1 && rows != 1;
    dim3 grid, block;
    row_grid(n, rows, &grid, &block);
    LOOM_LAUNCH(k_elementwise, grid, block, 0, cb->stream, kind, view_of(p->a),
                binary ? view_of(p->b) : view_of(p->a), view_of(p->dst), n, rows, broadcast,
                p->scale);
    return launched(cb, "elementwise");
}

static loom_status cuda_add(loom_backend *be, const loom_elementwise_params *p)
{
    return elementwise(cb_of(be), p, EW_ADD);
}
static loom_status cuda_mul(loom_backend *be, const loom_elementwise_params *p)
{
    return elementwise(cb_of(be), p, EW_MUL);
}
static loom_status cuda_scale(loom_backend *be, const loom_elementwise_params *p)
{
    return elementwise(cb_of(be), p, EW_SCALE);
}
static loom_status cuda_silu_mul(loom_backend *be, const loom_elementwise_params *p)
{
    return elementwise(cb_of(be), p, EW_SILU_MUL);
}
static loom_status cuda_gelu(loom_backend *be, const loom_elementwise_params *p)
{
    return elementwise(cb_of(be), p, EW_GELU);
}

static loom_status cuda_kv_store(loom_backend *be, const loom_kv_store_params *p)
{
    cuda_backend *cb = cb_of(be);
    const char *bad = loom_check_kv_store(p);
    if (bad)
        return fail(cb, LOOM_ERR_INVALID, "%s", bad);
    TRY(check_tensor(cb, p->src, "kv_store src"));
    TRY(check_tensor(cb, p->slots, "kv_store slots"));
    TRY(check_tensor(cb, p->cache, "kv_store cache"));
    const loom_tensor *c = p->cache;
    int64_t hd = c->ne[0], kvh = c->ne[1], n_slots = c->ne[2] * c->ne[3];
    int64_t tokens = p->slots->ne[0];
    if (tokens == 0 || hd == 0 || kvh == 0)
        return LOOM_OK;
    TRY(enter(cb));
    if (c->dtype == LOOM_Q8_0) {
        int64_t warps = tokens * kvh * (hd / LOOM_QK), blocks = (warps + 7) / 8;
        LOOM_LAUNCH(k_kv_store_q8, (unsigned)(blocks > 65535 ? 65535 : blocks), 8 * WARP, 0,
                    cb->stream, view_of(p->src), view_of(p->slots), view_of(c), hd, kvh, tokens,
                    n_slots, cb->err_dev);
    } else {
        dim3 grid, block;
        row_grid(hd, tokens * kvh, &grid, &block);
        LOOM_LAUNCH(k_kv_store, grid, block, 0, cb->stream, view_of(p->src), view_of(p->slots),
                    view_of(c), c->dtype, hd, kvh, tokens, n_slots, cb->err_dev);
    }
    return launched(cb, "kv_store");
}

static size_t attention_shared(int64_t hd, int gb, int tile)
{
    return sizeof(float) * (size_t)(2 * gb * hd + tile * (hd + 1) + tile * hd + gb * tile + 3 * gb);
}

static loom_status cuda_attention(loom_backend *be, const loom_attention_params *p)
{
    cuda_backend *cb = cb_of(be);
    const char *bad = loom_check_attention(p);
    if (bad)
        return fail(cb, LOOM_ERR_INVALID, "%s", bad);
    const loom_tensor *const parts[] = {p->q,   p->k_cache, p->v_cache, p->block_table,
                                        p->seq, p->pos,     p->dst};
    static const char *const names[] = {
        "attention q",   "attention k_cache", "attention v_cache", "attention block_table",
        "attention seq", "attention pos",     "attention dst"};
    for (int i = 0; i < 7; i++)
        TRY(check_tensor(cb, parts[i], names[i]));
    if (p->prefix_len)
        TRY(check_tensor(cb, p->prefix_len, "attention prefix_len"));
    attn_args a;
    memset(&a, 0, sizeof a);
    a.hd = p->q->ne[0];
    a.heads = p->q->ne[1];
    a.kvh = p->k_cache->ne[1];
    a.group = a.heads / a.kvh;
    a.bs = p->k_cache->ne[2];
    a.n_blocks = p->k_cache->ne[3];
    a.n_seqs = n_rows(p->block_table);
    a.max_blocks = p->block_table->ne[0];
    int64_t tokens = p->q->ne[2] * p->q->ne[3];
    if (tokens == 0 || a.hd == 0)
        return LOOM_OK;
    if (a.bs <= 0 || a.n_seqs <= 0 || a.max_blocks <= 0)
        return fail(cb, LOOM_ERR_INVALID, "attention: empty cache or block table");
    /* the largest head group and key tile whose working set fits in shared memory */
    int gb = (int)(a.group < 8 ? a.group : 8), tile = 64;
    while (attention_shared(a.hd, gb, tile) > ATTN_SHARED_MAX && tile > 8)
        tile /= 2;
    while (attention_shared(a.hd, gb, tile) > ATTN_SHARED_MAX && gb > 1)
        gb /= 2;
    if (attention_shared(a.hd, gb, tile) > ATTN_SHARED_MAX)
        return fail(cb, LOOM_ERR_UNSUPPORTED,
                    "attention: head_dim %lld is too large for the "
                    "CUDA kernel",
                    (long long)a.hd);
    a.gb = gb;
    a.tile = tile;
    a.chunks = (int)((a.group + gb - 1) / gb);
    /* split the keys when the grid would not fill the GPU (decode); an empty split is cheap */
    int64_t max_keys = a.max_blocks * a.bs, base = tokens * a.kvh * a.chunks;
    int64_t splits = 1;
    if (base < 2 * (int64_t)cb->sm_count) {
        int64_t want = (2 * cb->sm_count + base - 1) / base, most = (max_keys + tile - 1) / tile;
        splits = want < most ? want : most;
        splits = splits > 64 ? 64 : splits < 1 ? 1 : splits;
    }
    a.split_len = ((max_keys + splits - 1) / splits + tile - 1) / tile * tile;
    a.splits = (int)((max_keys + a.split_len - 1) / a.split_len);
    if (tokens > INT32_MAX || a.kvh * a.chunks > 65535)
        return fail(cb, LOOM_ERR_UNSUPPORTED,
                    "attention: %lld tokens x %lld kv heads is too "
                    "large a grid",
                    (long long)tokens, (long long)a.kvh);
    TRY(enter(cb));
    if (a.splits > 1)
        TRY(grow(cb, &cb->part, (size_t)(tokens * a.heads * a.splits * (a.hd + 2)) * sizeof(float),
                 "attention partials"));
    a.q = view_of(p->q);
    a.k = view_of(p->k_cache);
    a.v = view_of(p->v_cache);
    a.table = view_of(p->block_table);
    a.seq = view_of(p->seq);
    a.pos = view_of(p->pos);
    a.has_prefix = p->prefix_len != NULL;
    a.window = p->window; /* loom_check_attention above: 0 or positive */
    a.prefix = p->prefix_len ? view_of(p->prefix_len) : a.pos;
    a.dst = view_of(p->dst);
    a.cdt = p->k_cache->dtype;
    a.scale = p->scale;
    a.part = (float *)cb->part.p;
    a.err = cb->err_dev;
    dim3 grid((unsigned)tokens, (unsigned)(a.kvh * a.chunks), (unsigned)a.splits);
    LOOM_LAUNCH(k_attention, grid, ATTN_THREADS, attention_shared(a.hd, gb, tile), cb->stream, a);
    TRY(launched(cb, "attention"));
    if (a.splits > 1) {
        int64_t rows = tokens * a.heads;
        unsigned threads = a.hd >= 256 ? 256 : (unsigned)((a.hd + WARP - 1) / WARP * WARP);
        LOOM_LAUNCH(k_attn_combine, (unsigned)(rows > 65535 ? 65535 : rows), threads, 0, cb->stream,
                    a, tokens);
        TRY(launched(cb, "attention (combine)"));
    }
    return LOOM_OK;
}

static loom_status cuda_quantize(loom_backend *be, const loom_convert_params *p)
{
    cuda_backend *cb = cb_of(be);
    const char *bad = loom_check_convert(p, LOOM_OP_QUANTIZE);
    if (bad)
        return fail(cb, LOOM_ERR_INVALID, "%s", bad);
    TRY(check_tensor(cb, p->src, "quantize src"));
    TRY(check_tensor(cb, p->dst, "quantize dst"));
    int64_t n_blocks = p->src->ne[0] / LOOM_QK, rows = n_rows(p->src);
    if (n_blocks == 0 || rows == 0)
        return LOOM_OK;
    TRY(enter(cb));
    dim3 grid, block;
    row_grid(n_blocks, rows, &grid, &block);
    LOOM_LAUNCH(k_quantize, grid, block, 0, cb->stream, view_of(p->src), view_of(p->dst),
                p->dst->dtype, n_blocks, rows);
    return launched(cb, "quantize");
}

static loom_status convert_op(cuda_backend *cb, const loom_convert_params *p, loom_op which)
{
    const char *bad = loom_check_convert(p, which);
    if (bad)
        return fail(cb, LOOM_ERR_INVALID, "%s", bad);
    TRY(check_tensor(cb, p->src, "convert src"));
    TRY(check_tensor(cb, p->dst, "convert dst"));
    int64_t n = p->src->ne[0], rows = n_rows(p->src);
    if (n == 0 || rows == 0)
        return LOOM_OK;
    TRY(enter(cb));
    return convert_rows(cb, view_of(p->src), p->src->dtype, view_of(p->dst), p->dst->dtype, n,
                        rows);
}

static loom_status cuda_dequantize(loom_backend *be, const loom_convert_params *p)
{
    return convert_op(cb_of(be), p, LOOM_OP_DEQUANTIZE);
}

static loom_status cuda_convert(loom_backend *be, const loom_convert_params *p)
{
    return convert_op(cb_of(be), p, LOOM_OP_CONVERT);
}

/* ---- Buffers and copies ------------------------------------------------------------------ */

/* The next pinned staging slot, once the copy that last used it has finished. */
static loom_status take_staging(cuda_backend *cb, int *slot, const char *what)
{
    *slot = cb->next_staging;
    cb->next_staging ^= 1;
    if (cb->staging_busy[*slot]) {
        CUDA_TRY(cb, cudaEventSynchronize(cb->staging_done[*slot]), what);
        cb->staging_busy[*slot] = 0;
    }
    return LOOM_OK;
}

static void release_cache(cuda_backend *cb)
{
    while (cb->cached) {
        loom_buffer *b = cb->cached;
        cb->cached = b->next;
        (void)cudaFree(b->dev);
        free(b);
    }
}

static loom_status cuda_buffer_alloc(loom_backend *be, uint64_t size, loom_buffer **out)
{
    cuda_backend *cb = cb_of(be);
    TRY(enter(cb));
    /* best fit among cached buffers no more than twice the request (plus slack for small) */
    loom_buffer **best = NULL;
    for (loom_buffer **it = &cb->cached; *it; it = &(*it)->next)
        if ((*it)->cap >= size && (*it)->cap <= 2 * size + (1u << 20) &&
            (!best || (*it)->cap < (*best)->cap))
            best = it;
    if (best) {
        loom_buffer *b = *best;
        *best = b->next;
        b->next = NULL;
        b->size = size;
        *out = b;
        return LOOM_OK;
    }
    loom_buffer *b = (loom_buffer *)calloc(1, sizeof *b);
    if (!b)
        return fail(cb, LOOM_ERR_OUT_OF_MEMORY, "out of host memory");
    uint64_t cap = size ? (size + 255) / 256 * 256 : 256;
    cudaError_t e = size > (1ull << 50) ? cudaErrorMemoryAllocation
                                        : cudaMalloc((void **)&b->dev, (size_t)cap);
    if (e == cudaErrorMemoryAllocation && cb->cached && size <= (1ull << 50)) {
        (void)cudaGetLastError();
        release_cache(cb); /* cudaFree waits for the device, so nothing cached is in use */
        e = cudaMalloc((void **)&b->dev, (size_t)cap);
    }
    if (e != cudaSuccess) {
        free(b);
        char what[96];
        snprintf(what, sizeof what, "allocating %llu bytes", (unsigned long long)size);
        return cuda_fail(cb, e, what);
    }
    b->size = size;
    b->cap = cap;
    *out = b;
    return LOOM_OK;
}

static void cuda_buffer_free(loom_backend *be, loom_buffer *b)
{
    if (!b)
        return;
    cuda_backend *cb = cb_of(be);
    /* work already enqueued may still use it; the stream orders any later reuse after it */
    b->next = cb->cached;
    cb->cached = b;
}

static loom_status check_range(cuda_backend *cb, const loom_buffer *b, uint64_t off, uint64_t n,
                               const char *what)
{
    if (!b)
        return fail(cb, LOOM_ERR_INVALID, "%s: NULL buffer", what);
    if (off > b->size || n > b->size - off)
        return fail(cb, LOOM_ERR_INVALID, "%s: bytes [%llu, +%llu) outside a buffer of %llu", what,
                    (unsigned long long)off, (unsigned long long)n, (unsigned long long)b->size);
    return LOOM_OK;
}

static loom_status cuda_buffer_memset(loom_backend *be, loom_buffer *b, uint64_t off, int value,
                                      uint64_t size)
{
    cuda_backend *cb = cb_of(be);
    TRY(check_range(cb, b, off, size, "buffer_memset"));
    if (!size)
        return LOOM_OK;
    TRY(enter(cb));
    CUDA_TRY(cb, cudaMemsetAsync(b->dev + off, value, (size_t)size, cb->stream), "buffer_memset");
    return LOOM_OK;
}

static loom_status cuda_copy_from_host(loom_backend *be, loom_buffer *dst, uint64_t off,
                                       const void *src, uint64_t size)
{
    cuda_backend *cb = cb_of(be);
    TRY(check_range(cb, dst, off, size, "copy_from_host"));
    TRY(enter(cb));
    for (uint64_t done = 0; done < size;) {
        uint64_t n = size - done < STAGING_BYTES ? size - done : STAGING_BYTES;
        int slot;
        TRY(take_staging(cb, &slot, "copy_from_host"));
        memcpy(cb->staging[slot], (const char *)src + done, (size_t)n);
        CUDA_TRY(cb,
                 cudaMemcpyAsync(dst->dev + off + done, cb->staging[slot], (size_t)n,
                                 cudaMemcpyHostToDevice, cb->stream),
                 "copy_from_host");
        CUDA_TRY(cb, cudaEventRecord(cb->staging_done[slot], cb->stream), "copy_from_host");
        cb->staging_busy[slot] = 1;
        done += n;
    }
    return LOOM_OK;
}

static loom_status cuda_copy_to_host(loom_backend *be, void *dst, loom_buffer *src, uint64_t off,
                                     uint64_t size)
{
    cuda_backend *cb = cb_of(be);
    TRY(check_range(cb, src, off, size, "copy_to_host"));
    TRY(enter(cb));
    for (uint64_t done = 0; done < size;) {
        uint64_t n = size - done < STAGING_BYTES ? size - done : STAGING_BYTES;
        int slot;
        TRY(take_staging(cb, &slot, "copy_to_host"));
        CUDA_TRY(cb,
                 cudaMemcpyAsync(cb->staging[slot], src->dev + off + done, (size_t)n,
                                 cudaMemcpyDeviceToHost, cb->stream),
                 "copy_to_host");
        CUDA_TRY(cb, cudaStreamSynchronize(cb->stream), "copy_to_host");
        memcpy((char *)dst + done, cb->staging[slot], (size_t)n);
        done += n;
    }
    if (!size)
        CUDA_TRY(cb, cudaStreamSynchronize(cb->stream), "copy_to_host");
    return collect_device_error(cb);
}

static loom_status cuda_copy_buffer(loom_backend *be, loom_buffer *dst, uint64_t doff,
                                    loom_buffer *src, uint64_t soff, uint64_t size)
{
    cuda_backend *cb = cb_of(be);
    TRY(check_range(cb, dst, doff, size, "copy_buffer dst"));
    TRY(check_range(cb, src, soff, size, "copy_buffer src"));
    if (!size || (dst == src && doff == soff))
        return LOOM_OK;
    TRY(enter(cb));
    char *from = src->dev + soff;
    if (dst == src && doff < soff + size && soff < doff + size) {
        /* overlapping ranges: memmove semantics through scratch */
        TRY(grow(cb, &cb->out, (size_t)size, "copy_buffer"));
        CUDA_TRY(
            cb,
            cudaMemcpyAsync(cb->out.p, from, (size_t)size, cudaMemcpyDeviceToDevice, cb->stream),
            "copy_buffer");
        from = cb->out.p;
    }
    CUDA_TRY(
        cb,
        cudaMemcpyAsync(dst->dev + doff, from, (size_t)size, cudaMemcpyDeviceToDevice, cb->stream),
        "copy_buffer");
    return LOOM_OK;
}

static loom_status cuda_synchronize(loom_backend *be)
{
    cuda_backend *cb = cb_of(be);
    TRY(enter(cb));
    CUDA_TRY(cb, cudaStreamSynchronize(cb->stream), "synchronize");
    return collect_device_error(cb);
}

/* ---- Capabilities and lifetime ----------------------------------------------------------- */

static int cuda_supports(loom_backend *be, loom_op op, loom_dtype dt)
{
    (void)be;
    switch (op) {
    case LOOM_OP_MATMUL:
    case LOOM_OP_MATMUL_ID:
    case LOOM_OP_GET_ROWS: return loom_dtype_is_float(dt) || loom_dtype_is_quantized(dt);
    case LOOM_OP_MOE_ROUTE:
    case LOOM_OP_MOE_COMBINE: return dt == LOOM_F32;
    case LOOM_OP_KV_STORE:
    case LOOM_OP_ATTENTION: return loom_dtype_is_cache(dt);
    case LOOM_OP_QUANTIZE: return loom_dtype_is_block(dt);
    case LOOM_OP_DEQUANTIZE: return loom_dtype_is_quantized(dt);
    case LOOM_OP_CONVERT: return loom_dtype_is_float(dt);
    case LOOM_OP_RMS_NORM:
    case LOOM_OP_LAYER_NORM:
    case LOOM_OP_ROPE:
    case LOOM_OP_ADD:
    case LOOM_OP_MUL:
    case LOOM_OP_SCALE:
    case LOOM_OP_SILU_MUL:
    case LOOM_OP_GELU: return dt == LOOM_F32;
    default: return 0;
    }
}

static const char *cuda_last_error(loom_backend *be)
{
    return cb_of(be)->error;
}

static void cuda_close(loom_backend *be)
{
    cuda_backend *cb = cb_of(be);
    (void)cudaSetDevice(cb->device);
    if (cb->stream)
        (void)cudaStreamSynchronize(cb->stream);
    release_cache(cb);
    scratch *s[] = {&cb->act, &cb->weights, &cb->out, &cb->part};
    for (int i = 0; i < 4; i++)
        (void)cudaFree(s[i]->p);
    for (int i = 0; i < 2; i++) {
        if (cb->staging[i])
            (void)cudaFreeHost(cb->staging[i]);
        if (cb->staging_done[i])
            (void)cudaEventDestroy(cb->staging_done[i]);
    }
    if (cb->err_host)
        (void)cudaFreeHost(cb->err_host);
#if LOOM_GPU_BLAS
    if (cb->blas.handle)
        cb->blas.destroy(cb->blas.handle);
    if (cb->blas.lib)
        dlclose(cb->blas.lib);
#endif
    if (cb->stream)
        (void)cudaStreamDestroy(cb->stream);
    free(cb);
}

#if LOOM_GPU_BLAS
static int open_blas(cuda_backend *cb, char *err, size_t err_size)
{
    blas_api *b = &cb->blas;
#if defined(LOOM_GPU_EMULATED)
    b->create = cublasCreate_v2, b->destroy = cublasDestroy_v2;
    b->set_stream = cublasSetStream_v2, b->gemm = cublasGemmEx;
#else
    b->lib = dlopen(LOOM_CUBLAS_SONAME, RTLD_NOW | RTLD_LOCAL);
    if (!b->lib) {
        snprintf(err, err_size, "cannot load %s: %s", LOOM_CUBLAS_SONAME, dlerror());
        return -1;
    }
    b->create = (decltype(b->create))dlsym(b->lib, "cublasCreate_v2");
    b->destroy = (decltype(b->destroy))dlsym(b->lib, "cublasDestroy_v2");
    b->set_stream = (decltype(b->set_stream))dlsym(b->lib, "cublasSetStream_v2");
    b->gemm = (decltype(b->gemm))dlsym(b->lib, "cublasGemmEx");
    if (!b->create || !b->destroy || !b->set_stream || !b->gemm) {
        snprintf(err, err_size, "%s lacks cublasCreate_v2/cublasGemmEx", LOOM_CUBLAS_SONAME);
        return -1;
    }
#endif
    cublasStatus_t st = b->create(&b->handle);
    if (st != CUBLAS_STATUS_SUCCESS) {
        b->handle = NULL;
        snprintf(err, err_size, "cublasCreate failed with status %d", (int)st);
        return -1;
    }
    if (b->set_stream(b->handle, cb->stream) != CUBLAS_STATUS_SUCCESS) {
        snprintf(err, err_size, "cublasSetStream failed");
        return -1;
    }
    return 0;
}
#else
static int open_blas(cuda_backend *cb, char *err, size_t err_size)
{
    (void)cb, (void)err, (void)err_size;
    return 0; /* matmuls of many rows use k_gemm_tiled */
}
#endif

static int open_device(cuda_backend *cb, char *err, size_t err_size)
{
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        snprintf(err, err_size, "no usable " LOOM_GPU_PLATFORM " device: %s",
                 cudaGetErrorString(e));
        return -1;
    }
    if (cb->device < 0 || cb->device >= count) {
        snprintf(err, err_size, "there %s %d " LOOM_GPU_PLATFORM " device%s (0..%d), not %d",
                 count == 1 ? "is" : "are", count, count == 1 ? "" : "s", count - 1, cb->device);
        return -1;
    }
    cudaDeviceProp prop;
    if ((e = cudaSetDevice(cb->device)) != cudaSuccess ||
        (e = cudaGetDeviceProperties(&prop, cb->device)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&cb->stream, cudaStreamNonBlocking)) != cudaSuccess ||
        (e = cudaHostAlloc((void **)&cb->err_host, sizeof(dev_error), cudaHostAllocMapped)) !=
            cudaSuccess ||
        (e = cudaHostGetDevicePointer((void **)&cb->err_dev, cb->err_host, 0)) != cudaSuccess) {
        snprintf(err, err_size, LOOM_GPU_PLATFORM " device %d: %s", cb->device,
                 cudaGetErrorString(e));
        return -1;
    }
    snprintf(cb->device_name, sizeof cb->device_name, "%s", prop.name);
    cb->sm_count = prop.multiProcessorCount;
    memset(cb->err_host, 0, sizeof(dev_error));
    for (int i = 0; i < 2; i++)
        if ((e = cudaHostAlloc((void **)&cb->staging[i], STAGING_BYTES, cudaHostAllocDefault)) !=
                cudaSuccess ||
            (e = cudaEventCreateWithFlags(&cb->staging_done[i], cudaEventDisableTiming)) !=
                cudaSuccess) {
            snprintf(err, err_size, LOOM_GPU_PLATFORM " device %d: pinned staging: %s", cb->device,
                     cudaGetErrorString(e));
            return -1;
        }
    return 0;
}

extern "C" loom_status loom_gpu_open(const loom_backend_options *opts, loom_backend **out,
                                     char *err, size_t err_size)
{
    cuda_backend *cb = (cuda_backend *)calloc(1, sizeof *cb);
    if (!cb) {
        snprintf(err, err_size, "out of memory");
        return LOOM_ERR_OUT_OF_MEMORY;
    }
    cb->device = opts->device;
    if (open_device(cb, err, err_size) != 0 || open_blas(cb, err, err_size) != 0) {
        cuda_close(&cb->base);
        return LOOM_ERR_DEVICE;
    }
    loom_backend_ops *o = &cb->ops;
    o->struct_size = sizeof *o;
    o->close = cuda_close;
    o->last_error = cuda_last_error;
    o->supports = cuda_supports;
    o->buffer_alloc = cuda_buffer_alloc;
    o->buffer_free = cuda_buffer_free;
    o->buffer_memset = cuda_buffer_memset;
    o->copy_from_host = cuda_copy_from_host;
    o->copy_to_host = cuda_copy_to_host;
    o->copy_buffer = cuda_copy_buffer;
    o->synchronize = cuda_synchronize;
    o->matmul = cuda_matmul;
    o->get_rows = cuda_get_rows;
    o->rms_norm = cuda_rms_norm;
    o->layer_norm = cuda_layer_norm;
    o->rope = cuda_rope;
    o->add = cuda_add;
    o->mul = cuda_mul;
    o->scale = cuda_scale;
    o->silu_mul = cuda_silu_mul;
    o->gelu = cuda_gelu;
    o->kv_store = cuda_kv_store;
    o->attention = cuda_attention;
    o->quantize = cuda_quantize;
    o->dequantize = cuda_dequantize;
    o->convert = cuda_convert;
    o->moe_route = cuda_moe_route;
    o->matmul_id = cuda_matmul_id;
    o->moe_combine = cuda_moe_combine;
    cb->base.ops = o;
    *out = &cb->base;
    return LOOM_OK;
}
