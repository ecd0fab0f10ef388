/*
 * tests/gpuemu/emulated_probe.c - the entry point of the GPU backend built for HIP-CPU
 * (scripts/gpu-emulate): the CUDA backend's own source, its kernels run on the host. A
 * developer's check of the kernels where no GPU is lent; never built by make or installed.
 */
#include "gpu_module.h"

#include <stdio.h>

static void emulated_probe(loom_probe_result *out)
{
    out->score = 2; /* above ref, below every CPU variant: chosen only by name */
    out->n_devices = 1;
    snprintf(out->devices[0].name, sizeof out->devices[0].name,
             "HIP-CPU (GPU kernels on the host)");
    snprintf(out->devices[0].detail, sizeof out->devices[0].detail, "emulated, for testing");
}

static const loom_backend_module emulated_module = {
    .struct_size = sizeof(loom_backend_module),
    .abi_major = LOOM_BACKEND_ABI_MAJOR,
    .abi_minor = LOOM_BACKEND_ABI_MINOR,
    .name = "gpuemu",
    .variant = "",
    .description = "the CUDA/HIP backend's kernels on the CPU through HIP-CPU (testing only)",
    .probe = emulated_probe,
    .open = loom_gpu_open,
};

LOOM_BACKEND_DEFINE_ENTRY(emulated_module)
