/*
 * tests/gpuemu/emulated_cublas.h - the part of cuBLAS's API the GPU backend calls, for the
 * HIP-CPU build (scripts/gpu-emulate), where the real cublas_v2.h cannot be included. The
 * functions are a plain host implementation of their documented semantics
 * (emulated_cublas.cc), so the backend's GEMM path (operand order, leading dimensions, weight
 * slices, the epilogue) is checked too. Values match cuBLAS's header.
 */
#ifndef LOOM_EMULATED_CUBLAS_H
#define LOOM_EMULATED_CUBLAS_H

typedef struct emu_cublas_context *cublasHandle_t;
typedef enum { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_INVALID_VALUE = 7 } cublasStatus_t;
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum { CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14 } cudaDataType;
typedef enum { CUBLAS_COMPUTE_32F = 68 } cublasComputeType_t;
typedef enum { CUBLAS_GEMM_DEFAULT = -1 } cublasGemmAlgo_t;

extern "C" {
cublasStatus_t cublasCreate_v2(cublasHandle_t *handle);
cublasStatus_t cublasDestroy_v2(cublasHandle_t handle);
cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, hipStream_t stream);
cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void *alpha,
                            const void *A, cudaDataType Atype, int lda, const void *B,
                            cudaDataType Btype, int ldb, const void *beta, void *C,
                            cudaDataType Ctype, int ldc, cublasComputeType_t computeType,
                            cublasGemmAlgo_t algo);
}

#endif
