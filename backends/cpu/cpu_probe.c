/*
 * backends/cpu/cpu_probe.c - the module entry, probe and open of every CPU variant.
 *
 * Compiled for the baseline x86-64 ISA (no -m flags) in every variant, and run before anything
 * else: it must not execute an instruction the CPU may lack. It reads CPUID for what the CPU
 * has and XGETBV for what the OS saves on a context switch; a feature counts only with both
 * (a VM may show AVX-512 in CPUID while the OS leaves ZMM state off).
 */
#include "cpu.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

static uint64_t xgetbv0(void)
{
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

void cpu_detect(cpu_features *f)
{
    memset(f, 0, sizeof *f);
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return;
    int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1;
    int fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    uint64_t xcr0 = osxsave ? xgetbv0() : 0;
    int os_ymm = (xcr0 & 0x6) == 0x6;          /* SSE and AVX state */
    int os_zmm = os_ymm && (xcr0 & 0xe0) == 0xe0; /* opmask, ZMM_Hi256, Hi16_ZMM */
    unsigned b7 = 0, c7 = 0, a71 = 0, dummy;
    __get_cpuid_count(7, 0, &dummy, &b7, &c7, &dummy);
    __get_cpuid_count(7, 1, &a71, &dummy, &dummy, &dummy);
    if (avx && os_ymm) {
        f->avx2 = (b7 >> 5) & 1;
        f->fma = fma;
        f->f16c = f16c;
    }
    if (os_zmm) {
        f->avx512f = (b7 >> 16) & 1;
        f->avx512dq = (b7 >> 17) & 1;
        f->avx512bw = (b7 >> 30) & 1;
        f->avx512vl = (b7 >> 31) & 1;
        f->avx512vnni = (c7 >> 11) & 1;
        f->avx512bf16 = (a71 >> 5) & 1;
    }
    unsigned brand[12];
    if (__get_cpuid(0x80000000, &a, &b, &c, &d) && a >= 0x80000004) {
        for (unsigned i = 0; i < 3; i++)
            __get_cpuid(0x80000002 + i, &brand[4 * i], &brand[4 * i + 1], &brand[4 * i + 2],
                        &brand[4 * i + 3]);
        memcpy(f->brand, brand, 48);
        f->brand[48] = '\0';
        for (int i = 47; i >= 0 && (f->brand[i] == ' ' || f->brand[i] == '\0'); i--)
            f->brand[i] = '\0'; /* brand strings are padded with spaces */
    }
}
#else
void cpu_detect(cpu_features *f)
{
    memset(f, 0, sizeof *f);
}
#endif

int cpu_level_supported(const cpu_features *f, int level, char *why, size_t why_size)
{
    const char *missing = NULL;
    if (level >= CPU_LEVEL_AVX2 && !(f->avx2 && f->fma && f->f16c))
        missing = "AVX2, FMA and F16C (with OS support for YMM registers)";
    else if (level >= CPU_LEVEL_AVX512 &&
             !(f->avx512f && f->avx512bw && f->avx512vl && f->avx512dq))
        missing = "AVX-512 F/BW/VL/DQ (with OS support for ZMM registers)";
#if !defined(__x86_64__)
    if (level > CPU_LEVEL_BASELINE)
        missing = "an x86-64 CPU";
#endif
    if (missing && why)
        snprintf(why, why_size, "this CPU lacks %s", missing);
    return missing == NULL;
}

static void describe(const cpu_features *f, char *out, size_t n)
{
    snprintf(out, n, "%s%s%s%s", f->avx512f ? "avx512" : f->avx2 ? "avx2" : "baseline",
             f->avx512vnni ? " vnni" : "", f->avx512bf16 ? " bf16" : "",
             f->f16c && !f->avx512f ? " f16c" : "");
}

static void cpu_probe(loom_probe_result *out)
{
    cpu_features f;
    cpu_detect(&f);
    if (!cpu_level_supported(&f, loom_cpu_variant.level, out->reason, sizeof out->reason)) {
        out->score = 0;
        return;
    }
    out->score = 100 * (loom_cpu_variant.level + 1);
    out->n_devices = 1;
    loom_device_info *d = &out->devices[0];
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    snprintf(d->name, sizeof d->name, "%s (%ld logical CPUs)", f.brand[0] ? f.brand : "CPU",
             online);
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    d->memory_bytes = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
    describe(&f, d->detail, sizeof d->detail);
}

static loom_status cpu_open(const loom_backend_options *opts, loom_backend **out, char *err,
                            size_t err_size)
{
    cpu_features f;
    cpu_detect(&f);
    if (!cpu_level_supported(&f, loom_cpu_variant.level, err, err_size))
        return LOOM_ERR_DEVICE; /* never enter code built for an ISA this CPU lacks */
    if (opts->device != 0) {
        snprintf(err, err_size, "the CPU backend has one device (0), not %d", opts->device);
        return LOOM_ERR_INVALID;
    }
    return cpu_backend_create(opts, &f, out, err, err_size);
}

static loom_backend_module cpu_module = {
    .struct_size = sizeof(loom_backend_module),
    .abi_major = LOOM_BACKEND_ABI_MAJOR,
    .abi_minor = LOOM_BACKEND_ABI_MINOR,
    .name = "cpu",
    .description = "CPU: SIMD kernels, int8 dot products for quantised weights, thread pool",
    .probe = cpu_probe,
    .open = cpu_open,
};

LOOM_BACKEND_EXPORT const loom_backend_module *loom_backend_entry(uint32_t host_major,
                                                                  uint32_t host_minor)
{
    (void)host_major, (void)host_minor;
    cpu_module.variant = loom_cpu_variant.name; /* data from the variant file, no code */
    return &cpu_module;
}
