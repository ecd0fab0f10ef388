/*
 * backends/gpu/gpu_module.h - what a GPU module's C probe and its C++ half (gpu_backend.cu) share.
 */
#ifndef LOOM_GPU_MODULE_H
#define LOOM_GPU_MODULE_H

#include <loom/backend.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Opens device opts->device: the runtime, a stream, the BLAS where there is one. Defined in
 * gpu_backend.cu, which the cuda and hip modules each compile. */
loom_status loom_gpu_open(const loom_backend_options *opts, loom_backend **out, char *err,
                          size_t err_size);

#ifdef __cplusplus
}
#endif

#endif
