/*
 * backends/gpu/cuda_probe.c - the CUDA module's entry point and probe, in plain C.
 *
 * The probe must work on every machine the package is installed on, most of which have no
 * NVIDIA driver. So it links nothing from CUDA: it dlopens the driver library, asks it for
 * devices, and turns each way of failing into a reason a user can act on ("no driver", a
 * driver too old for this build, a GPU older than the architectures compiled in, no cuBLAS).
 * Only open() reaches the CUDA runtime, which is linked statically into the module.
 */
#include "gpu_module.h"

#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef CUresult (*cu_init_fn)(unsigned);
typedef CUresult (*cu_int_fn)(int *);
typedef CUresult (*cu_device_get_fn)(CUdevice *, int);
typedef CUresult (*cu_name_fn)(char *, int, CUdevice);
typedef CUresult (*cu_mem_fn)(size_t *, CUdevice);
typedef CUresult (*cu_attr_fn)(int *, CUdevice_attribute, CUdevice);
typedef CUresult (*cu_err_fn)(CUresult, const char **);

typedef struct driver_api {
    void *lib;
    cu_init_fn init;
    cu_int_fn driver_version, device_count;
    cu_device_get_fn device_get;
    cu_name_fn device_name;
    cu_mem_fn total_mem;
    cu_attr_fn attribute;
    cu_err_fn error_string;
} driver_api;

/* RTLD_NODELETE: the driver keeps thread-local state and exit handlers once initialised, so it
 * must never be unmapped under them. The runtime linked into this module opens it anyway. */
static int load_driver(driver_api *d, char *why, size_t why_size)
{
    memset(d, 0, sizeof *d);
    d->lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
    if (!d->lib) {
        snprintf(why, why_size,
                 "no driver: libcuda.so.1 cannot be loaded (no NVIDIA driver "
                 "installed on this machine)");
        return -1;
    }
    d->init = (cu_init_fn)dlsym(d->lib, "cuInit");
    d->driver_version = (cu_int_fn)dlsym(d->lib, "cuDriverGetVersion");
    d->device_count = (cu_int_fn)dlsym(d->lib, "cuDeviceGetCount");
    d->device_get = (cu_device_get_fn)dlsym(d->lib, "cuDeviceGet");
    d->device_name = (cu_name_fn)dlsym(d->lib, "cuDeviceGetName");
    d->total_mem = (cu_mem_fn)dlsym(d->lib, "cuDeviceTotalMem_v2");
    d->attribute = (cu_attr_fn)dlsym(d->lib, "cuDeviceGetAttribute");
    d->error_string = (cu_err_fn)dlsym(d->lib, "cuGetErrorString");
    if (!d->init || !d->driver_version || !d->device_count || !d->device_get || !d->device_name ||
        !d->total_mem || !d->attribute) {
        snprintf(why, why_size, "no driver: libcuda.so.1 lacks the driver API this module needs");
        dlclose(d->lib);
        return -1;
    }
    return 0;
}

static const char *cu_error(const driver_api *d, CUresult r)
{
    const char *s = NULL;
    if (d->error_string && d->error_string(r, &s) == CUDA_SUCCESS && s)
        return s;
    return "unknown error";
}

static void probe_devices(const driver_api *d, loom_probe_result *out)
{
    int version = 0;
    CUresult r = d->init(0);
    if (r == CUDA_ERROR_NO_DEVICE) {
        snprintf(out->reason, sizeof out->reason, "no device: the NVIDIA driver sees no GPU");
        return;
    }
    if (r != CUDA_SUCCESS) {
        snprintf(out->reason, sizeof out->reason, "no device: cuInit failed (%s)", cu_error(d, r));
        return;
    }
    d->driver_version(&version);
    /* The static runtime needs a driver of the same CUDA major version or newer. */
    if (version / 1000 < CUDA_VERSION / 1000) {
        snprintf(out->reason, sizeof out->reason,
                 "driver too old: it supports CUDA %d.%d, this module was built with CUDA %d.%d "
                 "(update the NVIDIA driver or build loom with an older toolkit)",
                 version / 1000, version % 1000 / 10, CUDA_VERSION / 1000,
                 CUDA_VERSION % 1000 / 10);
        return;
    }
    int count = 0;
    if (d->device_count(&count) != CUDA_SUCCESS || count <= 0) {
        snprintf(out->reason, sizeof out->reason, "no device: the NVIDIA driver sees no GPU");
        return;
    }
    int usable = 0;
    char too_old[160] = "";
    for (int i = 0; i < count && out->n_devices < LOOM_MAX_DEVICES; i++) {
        CUdevice dev;
        int major = 0, minor = 0, sms = 0;
        size_t mem = 0;
        if (d->device_get(&dev, i) != CUDA_SUCCESS)
            continue;
        loom_device_info *info = &out->devices[out->n_devices++];
        if (d->device_name(info->name, (int)sizeof info->name, dev) != CUDA_SUCCESS)
            snprintf(info->name, sizeof info->name, "CUDA device %d", i);
        d->total_mem(&mem, dev);
        info->memory_bytes = mem;
        d->attribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev);
        d->attribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev);
        d->attribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
        int sm = major * 10 + minor;
        snprintf(info->detail, sizeof info->detail, "sm_%d, %d SMs, driver CUDA %d.%d%s", sm, sms,
                 version / 1000, version % 1000 / 10,
                 sm < LOOM_CUDA_MIN_SM ? ", too old for this build" : "");
        if (sm >= LOOM_CUDA_MIN_SM)
            usable++;
        else if (!too_old[0])
            snprintf(too_old, sizeof too_old,
                     "%s is sm_%d; this module was built for sm_%d and newer "
                     "(configure --with-cuda-arch)",
                     info->name, sm, LOOM_CUDA_MIN_SM);
    }
    if (!usable) {
        snprintf(out->reason, sizeof out->reason, "no usable device: %s", too_old);
        return;
    }
    /* cuBLAS is opened at run time, not linked, so that its absence is a reason, not a failed
     * dlopen of the whole module. */
    void *blas = dlopen(LOOM_CUBLAS_SONAME, RTLD_LAZY | RTLD_LOCAL);
    if (!blas) {
        snprintf(out->reason, sizeof out->reason,
                 "no cuBLAS: %s cannot be loaded (install the CUDA %d runtime libraries or add "
                 "their directory to LD_LIBRARY_PATH)",
                 LOOM_CUBLAS_SONAME, CUDA_VERSION / 1000);
        return;
    }
    dlclose(blas);
    /* Above every CPU variant (those score a few hundred): a usable GPU wins. */
    out->score = 1000;
}

static void cuda_probe(loom_probe_result *out)
{
    driver_api d;
    if (load_driver(&d, out->reason, sizeof out->reason) != 0)
        return;
    probe_devices(&d, out);
    dlclose(d.lib); /* RTLD_NODELETE keeps it mapped */
}

static const loom_backend_module cuda_module = {
    .struct_size = sizeof(loom_backend_module),
    .abi_major = LOOM_BACKEND_ABI_MAJOR,
    .abi_minor = LOOM_BACKEND_ABI_MINOR,
    .name = "cuda",
    .variant = "",
    .description = "NVIDIA GPUs: cuBLAS for float GEMMs, loom's kernels for the rest",
    .probe = cuda_probe,
    .open = loom_gpu_open,
};

LOOM_BACKEND_DEFINE_ENTRY(cuda_module)
