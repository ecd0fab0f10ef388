/*
 * backends/gpu/gpu.h - the one portability header between CUDA and HIP.
 *
 * The GPU backend's source is written once, in CUDA's spelling, and compiled by nvcc for the
 * cuda module and by hipcc for the hip module. Under HIP this header maps each CUDA name the
 * backend uses to its HIP twin, so no kernel exists twice. Add a mapping here when the backend
 * starts using a new runtime call; nothing else should test the platform.
 *
 * A third build, LOOM_GPU_EMULATED, compiles the same source with a host C++ compiler against
 * AMD's HIP-CPU headers (kernels run as host fibers): a developer's check of the kernels on a
 * machine without a GPU (scripts/gpu-emulate). It is never installed.
 *
 * Warps stay 32 threads wide everywhere: kernels use width-32 shuffles, which AMD's 64-wide
 * wavefronts run as two halves.
 */
#ifndef LOOM_GPU_H
#define LOOM_GPU_H

#if defined(__HIPCC__) || defined(LOOM_GPU_EMULATED)
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>

#define cudaDeviceProp hipDeviceProp_t
#define cudaError_t hipError_t
#define cudaErrorMemoryAllocation hipErrorOutOfMemory
#define cudaEventCreateWithFlags hipEventCreateWithFlags
#define cudaEventDestroy hipEventDestroy
#define cudaEventDisableTiming hipEventDisableTiming
#define cudaEventRecord hipEventRecord
#define cudaEventSynchronize hipEventSynchronize
#define cudaEvent_t hipEvent_t
#define cudaFree hipFree
#define cudaFreeHost hipHostFree
#define cudaGetDeviceCount hipGetDeviceCount
#define cudaGetDeviceProperties hipGetDeviceProperties
#define cudaGetErrorName hipGetErrorName
#define cudaGetErrorString hipGetErrorString
#define cudaGetLastError hipGetLastError
#define cudaHostAlloc hipHostMalloc
#define cudaHostAllocDefault hipHostMallocDefault
#define cudaHostAllocMapped hipHostMallocMapped
#define cudaHostGetDevicePointer hipHostGetDevicePointer
#define cudaMalloc hipMalloc
#define cudaMemGetInfo hipMemGetInfo
#define cudaMemcpyAsync hipMemcpyAsync
#define cudaMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#define cudaMemcpyDeviceToHost hipMemcpyDeviceToHost
#define cudaMemcpyHostToDevice hipMemcpyHostToDevice
#define cudaMemsetAsync hipMemsetAsync
#define cudaSetDevice hipSetDevice
#define cudaStreamCreateWithFlags hipStreamCreateWithFlags
#define cudaStreamDestroy hipStreamDestroy
#define cudaStreamNonBlocking hipStreamNonBlocking
#define cudaStreamSynchronize hipStreamSynchronize
#define cudaStream_t hipStream_t
#define cudaSuccess hipSuccess
/* HIP has no *_sync shuffles; its wavefront runs all lanes together anyway */
#define __shfl_xor_sync(mask, v, lane_mask) __shfl_xor((v), (lane_mask), 32)
#define LOOM_LAUNCH(kernel, grid, block, shared, stream, ...)                                      \
    hipLaunchKernelGGL(kernel, grid, block, shared, stream, __VA_ARGS__)
#define LOOM_DYNAMIC_SHARED(type, name) HIP_DYNAMIC_SHARED(type, name)

#if defined(LOOM_GPU_EMULATED)
#include <string.h>
#define LOOM_GPU_PLATFORM "HIP-CPU"
/* What HIP-CPU lacks: round-to-nearest arithmetic (the emulated build is compiled with
 * -ffp-contract=off, so these are exact) and bit casts. */
static inline float __fmul_rn(float a, float b)
{
    return a * b;
}
static inline float __fadd_rn(float a, float b)
{
    return a + b;
}
static inline float __fsub_rn(float a, float b)
{
    return a - b;
}
static inline float __uint_as_float(unsigned u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline unsigned __float_as_uint(float f)
{
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
#else
#define LOOM_GPU_PLATFORM "HIP"
#endif

#else
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#define LOOM_GPU_PLATFORM "CUDA"
#define LOOM_LAUNCH(kernel, grid, block, shared, stream, ...)                                      \
    kernel<<<grid, block, shared, stream>>>(__VA_ARGS__)
#define LOOM_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

#endif
