/*
 * tests/fakedriver/fakecuda.c - a stand-in for the NVIDIA driver library (libcuda.so.1), so the
 * CUDA module's probe can be driven through each way a machine can fail to run it. Only the
 * entry points the probe calls exist. FAKE_CUDA selects the machine:
 *   nodevice   the driver is installed but sees no GPU
 *   olddriver  one GPU, but the driver only supports CUDA 11.8
 *   oldgpu     one sm_75 GPU (older than the module's lowest architecture)
 * The ABI types are spelled out here (int for CUresult and CUdevice) so the test needs no CUDA
 * headers.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CUDA_SUCCESS 0
#define CUDA_ERROR_NO_DEVICE 100

static const char *mode(void)
{
    const char *m = getenv("FAKE_CUDA");
    return m ? m : "nodevice";
}

int cuInit(unsigned flags)
{
    (void)flags;
    return strcmp(mode(), "nodevice") == 0 ? CUDA_ERROR_NO_DEVICE : CUDA_SUCCESS;
}

int cuDriverGetVersion(int *v)
{
    *v = strcmp(mode(), "olddriver") == 0 ? 11080 : 99000;
    return CUDA_SUCCESS;
}

int cuDeviceGetCount(int *n)
{
    *n = 1;
    return CUDA_SUCCESS;
}

int cuDeviceGet(int *dev, int i)
{
    *dev = i;
    return CUDA_SUCCESS;
}

int cuDeviceGetName(char *name, int len, int dev)
{
    (void)dev;
    snprintf(name, (size_t)len, "Fake Tesla T4");
    return CUDA_SUCCESS;
}

int cuDeviceTotalMem_v2(size_t *bytes, int dev)
{
    (void)dev;
    *bytes = (size_t)16 << 30;
    return CUDA_SUCCESS;
}

/* 75/76: compute capability major/minor; 16: multiprocessor count */
int cuDeviceGetAttribute(int *value, int attribute, int dev)
{
    (void)dev;
    *value = attribute == 75 ? 7 : attribute == 76 ? 5 : attribute == 16 ? 40 : 0;
    return CUDA_SUCCESS;
}

int cuGetErrorString(int error, const char **s)
{
    *s = error == CUDA_ERROR_NO_DEVICE ? "no CUDA-capable device is detected" : "fake error";
    return CUDA_SUCCESS;
}
