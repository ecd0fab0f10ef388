/*
 * backends/gpu/hip_probe.c - the HIP module's entry point and probe, in plain C.
 *
 * The module's kernels and host code are the GPU backend's source (backends/gpu/),
 * compiled by hipcc through gpu.h; only this probe is HIP's. The module links
 * libamdhip64, so on a machine without ROCm's runtime the loader already reports that missing
 * library as the reason; here the runtime is present and is asked what it sees.
 */
#include "gpu_module.h"

#include <hip/hip_runtime_api.h>
#include <stdio.h>
#include <string.h>

/* The architectures compiled in (--with-hip-arch), space-separated, e.g. "gfx90a gfx1030". */
static int arch_built(const char *arch)
{
    size_t n = strcspn(arch, ":"); /* "gfx90a:sramecc+:xnack-": the target features follow */
    for (const char *p = LOOM_HIP_ARCHS; *p;) {
        size_t len = strcspn(p, " ");
        if (len == n && strncmp(p, arch, n) == 0)
            return 1;
        p += len;
        p += strspn(p, " ");
    }
    return 0;
}

static void hip_probe(loom_probe_result *out)
{
    int count = 0;
    hipError_t e = hipGetDeviceCount(&count);
    if (e != hipSuccess || count <= 0) {
        snprintf(out->reason, sizeof out->reason, "no device: the HIP runtime sees no AMD GPU (%s)",
                 e != hipSuccess ? hipGetErrorString(e) : "0 devices");
        return;
    }
    int usable = 0;
    char unbuilt[200] = "";
    for (int i = 0; i < count && out->n_devices < LOOM_MAX_DEVICES; i++) {
        hipDeviceProp_t prop;
        if (hipGetDeviceProperties(&prop, i) != hipSuccess)
            continue;
        loom_device_info *info = &out->devices[out->n_devices++];
        snprintf(info->name, sizeof info->name, "%.127s", prop.name);
        info->memory_bytes = prop.totalGlobalMem;
        int ok = arch_built(prop.gcnArchName);
        snprintf(info->detail, sizeof info->detail, "%.64s, %d CUs%s", prop.gcnArchName,
                 prop.multiProcessorCount, ok ? "" : ", not built for");
        if (ok)
            usable++;
        else if (!unbuilt[0])
            snprintf(unbuilt, sizeof unbuilt,
                     "%.64s is %.40s; this module was built for %.60s "
                     "(configure --with-hip-arch)",
                     prop.name, prop.gcnArchName, LOOM_HIP_ARCHS);
    }
    if (!usable) {
        snprintf(out->reason, sizeof out->reason, "no usable device: %s", unbuilt);
        return;
    }
    out->score = 1000;
}

static const loom_backend_module hip_module = {
    .struct_size = sizeof(loom_backend_module),
    .abi_major = LOOM_BACKEND_ABI_MAJOR,
    .abi_minor = LOOM_BACKEND_ABI_MINOR,
    .name = "hip",
    .variant = "",
    .description = "AMD GPUs: the CUDA backend's kernels built by hipcc, loom's own GEMM",
    .probe = hip_probe,
    .open = loom_gpu_open,
};

LOOM_BACKEND_DEFINE_ENTRY(hip_module)
