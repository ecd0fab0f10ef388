/*
 * tests/gpuemu/emulated_cublas.cc - cuBLAS's GemmEx for the HIP-CPU build, from its documented
 * semantics: column-major C (m x n, leading dimension ldc) = alpha op(A) op(B) + beta C, op(X)
 * = X or X^T, A/B of type f32, f16 or bf16, C f32. Device memory is host memory under HIP-CPU,
 * so it reads the operands directly, after waiting for the stream's earlier work.
 */
#include <hip/hip_runtime.h>
#include <loom/backend.h>

#include "emulated_cublas.h"

#include <stdint.h>
#include <stdlib.h>

struct emu_cublas_context {
    hipStream_t stream;
};

extern "C" cublasStatus_t cublasCreate_v2(cublasHandle_t *handle)
{
    *handle = (cublasHandle_t)calloc(1, sizeof(emu_cublas_context));
    return *handle ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
}

extern "C" cublasStatus_t cublasDestroy_v2(cublasHandle_t handle)
{
    free(handle);
    return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, hipStream_t stream)
{
    handle->stream = stream;
    return CUBLAS_STATUS_SUCCESS;
}

static double element(const void *p, cudaDataType t, int64_t i)
{
    switch (t) {
    case CUDA_R_16F: return loom_f16_to_f32(((const uint16_t *)p)[i]);
    case CUDA_R_16BF: return loom_bf16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

extern "C" cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                                       cublasOperation_t transb, int m, int n, int k,
                                       const void *alpha, const void *A, cudaDataType Atype,
                                       int lda, const void *B, cudaDataType Btype, int ldb,
                                       const void *beta, void *C, cudaDataType Ctype, int ldc,
                                       cublasComputeType_t computeType, cublasGemmAlgo_t algo)
{
    (void)algo;
    if (Ctype != CUDA_R_32F || computeType != CUBLAS_COMPUTE_32F || m < 0 || n < 0 || k < 0 ||
        lda < (transa == CUBLAS_OP_N ? m : k) || ldb < (transb == CUBLAS_OP_N ? k : n) || ldc < m)
        return CUBLAS_STATUS_INVALID_VALUE;
    if (hipStreamSynchronize(handle->stream) != hipSuccess)
        return CUBLAS_STATUS_INVALID_VALUE;
    float a = *(const float *)alpha, b = *(const float *)beta;
    float *c = (float *)C;
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            double acc = 0;
            for (int l = 0; l < k; l++) {
                /* op(A)[i, l] and op(B)[l, j], column-major */
                int64_t ai = transa == CUBLAS_OP_N ? (int64_t)l * lda + i : (int64_t)i * lda + l;
                int64_t bi = transb == CUBLAS_OP_N ? (int64_t)j * ldb + l : (int64_t)l * ldb + j;
                acc += element(A, Atype, ai) * element(B, Btype, bi);
            }
            float *out = c + (int64_t)j * ldc + i;
            *out = (float)(a * acc + (b != 0.0f ? b * *out : 0.0));
        }
    return CUBLAS_STATUS_SUCCESS;
}
