/*
 * backends/cuda/gpu.h - the one portability header between CUDA and HIP.
 *
 * The GPU backend's source is written once, in CUDA's spelling, and compiled twice: by nvcc for
 * the cuda module and by hipcc for the hip modules. Under hipcc this header maps each CUDA name
 * the backend uses to its HIP twin, so no kernel exists twice. Add a mapping here when the
 * backend starts using a new runtime call; nothing else should test the platform.
 *
 * Warps stay 32 threads wide on both: kernels use width-32 shuffles, which AMD's 64-wide
 * wavefronts run as two halves.
 */
#ifndef LOOM_GPU_H
#define LOOM_GPU_H

#if defined(__HIPCC__)
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>

#define LOOM_GPU_PLATFORM "HIP"
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
/* HIP 5.2 has no *_sync shuffles; its wavefront runs all lanes together anyway */
#define __shfl_xor_sync(mask, v, lane_mask) __shfl_xor((v), (lane_mask), 32)

#else
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#define LOOM_GPU_PLATFORM "CUDA"
#endif

#endif
