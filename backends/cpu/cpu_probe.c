/*
 * backends/cpu/cpu_probe.c - the module entry, probe and open of every CPU variant.
 *
 * Compiled for the baseline x86-64 ISA (no -m flags) in every variant, and run before anything
 * else: it must not execute an instruction the CPU may lack. It reads CPUID for what the CPU
 * has and XGETBV for what the OS saves on a context switch; a feature counts only with both
 * (a VM may show AVX-512 in CPUID while the OS leaves ZMM state off).
 *
 * LOOM_CPU_MASK hides features from both, so that one machine can act as another kind: with
 * LOOM_CPU_MASK=avx512 the AVX-512 variant reports itself unusable exactly as it does on a CPU
 * without AVX-512, and the suite can be run as on that machine.
 */
#include "cpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const struct {
    const char *name;
    unsigned bits;
} mask_names[] = {
    {"avx",
     CPU_MASK_AVX2 | CPU_MASK_FMA | CPU_MASK_F16C | CPU_MASK_AVX512 | CPU_MASK_VNNI |
         CPU_MASK_BF16},
    {"avx2", CPU_MASK_AVX2},
    {"fma", CPU_MASK_FMA},
    {"f16c", CPU_MASK_F16C},
    {"avx512", CPU_MASK_AVX512 | CPU_MASK_VNNI | CPU_MASK_BF16},
    {"vnni", CPU_MASK_VNNI},
    {"bf16", CPU_MASK_BF16},
};

/* Reads LOOM_CPU_MASK (comma-separated names) into f->masked, or an error into f->mask_error. */
static void read_mask(cpu_features *f)
{
    const char *env = getenv("LOOM_CPU_MASK");
    if (!env || !*env)
        return;
    const char *p = env;
    while (*p) {
        size_t len = strcspn(p, ",");
        unsigned bits = 0;
        for (size_t i = 0; i < sizeof mask_names / sizeof mask_names[0]; i++)
            if (len == strlen(mask_names[i].name) && !strncmp(p, mask_names[i].name, len))
                bits = mask_names[i].bits;
        if (!bits) {
            snprintf(f->mask_error, sizeof f->mask_error,
                     "LOOM_CPU_MASK=%s: '%.*s' is not a CPU feature; use a comma-separated list "
                     "of avx, avx2, fma, f16c, avx512, vnni, bf16",
                     env, (int)len, p);
            return;
        }
        f->masked |= bits;
        p += len + (p[len] == ',');
    }
}

static void apply_mask(cpu_features *f)
{
    read_mask(f);
    unsigned m = f->masked;
    if (m & CPU_MASK_AVX2)
        f->avx2 = 0;
    if (m & CPU_MASK_FMA)
        f->fma = 0;
    if (m & CPU_MASK_F16C)
        f->f16c = 0;
    if (m & CPU_MASK_AVX512)
        f->avx512f = f->avx512bw = f->avx512vl = f->avx512dq = 0;
    if (m & CPU_MASK_VNNI)
        f->avx512vnni = f->avxvnni = 0;
    if (m & CPU_MASK_BF16)
        f->avx512bf16 = 0;
}

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
    int os_ymm = (xcr0 & 0x6) == 0x6;             /* SSE and AVX state */
    int os_zmm = os_ymm && (xcr0 & 0xe0) == 0xe0; /* opmask, ZMM_Hi256, Hi16_ZMM */
    unsigned b7 = 0, c7 = 0, a71 = 0, dummy;
    __get_cpuid_count(7, 0, &dummy, &b7, &c7, &dummy);
    __get_cpuid_count(7, 1, &a71, &dummy, &dummy, &dummy);
    if (avx && os_ymm) {
        f->avx2 = (b7 >> 5) & 1;
        f->fma = fma;
        f->f16c = f16c;
        f->avxvnni = (a71 >> 4) & 1;
    }
    if (os_zmm) {
        f->avx512f = (b7 >> 16) & 1;
        f->avx512dq = (b7 >> 17) & 1;
        f->avx512bw = (b7 >> 30) & 1;
        f->avx512vl = (b7 >> 31) & 1;
        f->avx512vnni = (c7 >> 11) & 1;
        f->avx512bf16 = (a71 >> 5) & 1;
    }
    unsigned vendor[3];
    __get_cpuid(0, &a, &vendor[0], &vendor[2], &vendor[1]);
    f->bf16_dp_full_rate = memcmp(vendor, "AuthenticAMD", 12) == 0;
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
    apply_mask(f);
}
#else
void cpu_detect(cpu_features *f)
{
    memset(f, 0, sizeof *f);
    apply_mask(f);
}
#endif

int cpu_level_supported(const cpu_features *f, int level, char *why, size_t why_size)
{
    if (f->mask_error[0]) {
        if (why)
            snprintf(why, why_size, "%s", f->mask_error);
        return 0;
    }
    const char *missing = NULL;
    int hidden = 0; /* LOOM_CPU_MASK took it away, not the CPU */
    if (level >= CPU_LEVEL_AVX2 && !(f->avx2 && f->fma && f->f16c)) {
        missing = "AVX2, FMA and F16C (with OS support for YMM registers)";
        hidden = f->masked & (CPU_MASK_AVX2 | CPU_MASK_FMA | CPU_MASK_F16C);
    } else if (level >= CPU_LEVEL_AVX512 &&
               !(f->avx512f && f->avx512bw && f->avx512vl && f->avx512dq)) {
        missing = "AVX-512 F/BW/VL/DQ (with OS support for ZMM registers)";
        hidden = f->masked & CPU_MASK_AVX512;
    }
#if !defined(__x86_64__)
    if (level > CPU_LEVEL_BASELINE)
        missing = "an x86-64 CPU", hidden = 0;
#endif
    if (!missing)
        return 1;
    if (why && hidden)
        snprintf(why, why_size, "this CPU lacks %s (hidden by LOOM_CPU_MASK=%s)", missing,
                 getenv("LOOM_CPU_MASK"));
    else if (why)
        snprintf(why, why_size, "this CPU lacks %s", missing);
    return 0;
}

static void describe(const cpu_features *f, char *out, size_t n)
{
    char threads[96];
    const char *env = getenv("LOOM_THREADS");
    if (env && *env) {
        snprintf(threads, sizeof threads, "LOOM_THREADS=%s", env);
    } else {
        cpu_thread_default t;
        cpu_default_threads(&t);
        cpu_describe_threads(&t, threads, sizeof threads);
    }
    int used = snprintf(out, n, "%s%s%s%s%s%s",
                        f->avx512f    ? "avx512"
                            : f->avx2 ? "avx2"
                                      : "baseline",
                        f->avx512vnni || (f->avx2 && f->avxvnni) ? " vnni" : "",
                        f->avx512bf16 ? " bf16" : "", f->f16c && !f->avx512f ? " f16c" : "",
                        f->masked ? ", LOOM_CPU_MASK=" : "",
                        f->masked ? getenv("LOOM_CPU_MASK") : "");
    cpu_numa numa;
    cpu_numa_read(&numa);
    char numa_text[96], unused[8];
    int mode = cpu_numa_mode(&numa, unused, sizeof unused);
    cpu_numa_describe(&numa, mode, numa_text, sizeof numa_text);
    /* a long mask may leave no room for the rest: it matters more */
    if (used >= 0 && (size_t)used + 3 < n)
        used += snprintf(out + used, n - (size_t)used, "; %.*s", (int)(n - (size_t)used - 3),
                         threads);
    if (used >= 0 && (size_t)used + 3 < n)
        snprintf(out + used, n - (size_t)used, "; %.*s", (int)(n - (size_t)used - 3), numa_text);
}

static void cpu_probe(loom_probe_result *out)
{
    cpu_features f;
    cpu_detect(&f);
    if (!cpu_level_supported(&f, loom_cpu_variant.level, out->reason, sizeof out->reason)) {
        out->score = 0;
        return;
    }
    cpu_numa numa;
    cpu_numa_read(&numa);
    if (cpu_numa_mode(&numa, out->reason, sizeof out->reason) < 0) {
        out->score = 0; /* cpu_open would refuse it */
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
