/*
 * backends/cpu/cpu_threads.c - how many threads the CPU backend starts when not told: the
 * physical cores in the process's affinity mask, capped by the CPU quota of its control group.
 *
 * Inside a container limited to a few CPUs (Docker's --cpus, a Kubernetes CPU limit) the
 * affinity mask still holds every host core; the limit is a quota of CPU time per period that
 * the kernel enforces by stalling the whole group once it is spent. Threads beyond the quota
 * then only wait for each other at every op's barrier, so the default is
 * min(cores, quota rounded up). The quota is the smallest along the group's path (a parent
 * group's limit binds its children), read from cgroup v2's cpu.max or v1's
 * cpu.cfs_quota_us / cpu.cfs_period_us.
 *
 * LOOM_TEST_SYSROOT (for the test suite only) is put in front of every /proc and /sys path read
 * here, so that fake cgroup files can stand in for a container on any machine.
 *
 * Compiled for the baseline ISA with the probe: the probe's device line says which limit
 * applied.
 */
#define _GNU_SOURCE
#include "cpu.h"

#include <math.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static FILE *open_sys(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static FILE *open_sys(const char *fmt, ...)
{
    const char *root = getenv("LOOM_TEST_SYSROOT");
    char path[1024];
    int n = snprintf(path, sizeof path, "%s", root ? root : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(path + n, sizeof path - (size_t)n, fmt, ap);
    va_end(ap);
    return fopen(path, "r");
}

static long read_long(const char *fmt, int cpu, long fallback)
{
    FILE *f = open_sys(fmt, cpu);
    long v;
    if (!f)
        return fallback;
    if (fscanf(f, "%ld", &v) != 1)
        v = fallback;
    fclose(f);
    return v;
}

/* Distinct (package, core) pairs in the affinity mask, so SMT siblings, which share the core's
 * SIMD units, do not count twice. */
static int physical_cores(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0)
        return 1;
    static long seen[CPU_SETSIZE];
    int n = 0;
    for (int c = 0; c < CPU_SETSIZE; c++) {
        if (!CPU_ISSET(c, &set))
            continue;
        long core = read_long("/sys/devices/system/cpu/cpu%d/topology/core_id", c, c);
        long pkg = read_long("/sys/devices/system/cpu/cpu%d/topology/physical_package_id", c, 0);
        long key = pkg * 100000 + core;
        int dup = 0;
        for (int i = 0; i < n && !dup; i++)
            dup = seen[i] == key;
        if (!dup)
            seen[n++] = key;
    }
    return n > 0 ? n : 1;
}

/* The quota (CPUs) in one group directory; 0 when it sets none. */
static double group_quota(const char *dir, int v2)
{
    char line[128];
    if (v2) {
        FILE *f = open_sys("%s/cpu.max", dir);
        if (!f)
            return 0;
        double quota, period;
        char first[32];
        int ok = fgets(line, sizeof line, f) && sscanf(line, "%31s %lf", first, &period) == 2;
        fclose(f);
        if (!ok || !strcmp(first, "max") || sscanf(first, "%lf", &quota) != 1 || period <= 0)
            return 0;
        return quota > 0 ? quota / period : 0;
    }
    FILE *q = open_sys("%s/cpu.cfs_quota_us", dir), *p = open_sys("%s/cpu.cfs_period_us", dir);
    double quota = -1, period = 0;
    if (q && fscanf(q, "%lf", &quota) != 1)
        quota = -1;
    if (p && fscanf(p, "%lf", &period) != 1)
        period = 0;
    if (q)
        fclose(q);
    if (p)
        fclose(p);
    return quota > 0 && period > 0 ? quota / period : 0; /* -1: unlimited */
}

/* The smallest quota from mount + path up to mount; 0 when none. */
static double path_quota(const char *mount, const char *path, int v2, char *src, size_t src_size)
{
    char dir[1024];
    snprintf(dir, sizeof dir, "%s%s", mount, strcmp(path, "/") ? path : "");
    double best = 0;
    size_t floor_len = strlen(mount);
    for (;;) {
        double q = group_quota(dir, v2);
        if (q > 0 && (best == 0 || q < best)) {
            best = q;
            snprintf(src, src_size, "%s", v2 ? "cgroup cpu.max" : "cgroup v1 cpu.cfs_quota_us");
        }
        char *slash = strrchr(dir, '/');
        if (strlen(dir) <= floor_len || !slash || (size_t)(slash - dir) < floor_len)
            break;
        *slash = '\0';
    }
    return best;
}

/* The CPU quota of this process's control group (v2, else v1); 0 when there is none. */
static double cgroup_quota(char *src, size_t src_size)
{
    FILE *f = open_sys("/proc/self/cgroup");
    if (!f)
        return 0;
    char line[1024], v2_path[1024] = "", v1_path[1024] = "";
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2)
            continue;
        *c1 = *c2 = '\0';
        if (!strcmp(line, "0") && c1 + 1 == c2) {
            snprintf(v2_path, sizeof v2_path, "%s", c2 + 1);
            continue;
        }
        /* v1: the hierarchy whose controllers include "cpu" */
        char *save = NULL;
        for (char *ctl = strtok_r(c1 + 1, ",", &save); ctl; ctl = strtok_r(NULL, ",", &save))
            if (!strcmp(ctl, "cpu"))
                snprintf(v1_path, sizeof v1_path, "%s", c2 + 1);
    }
    fclose(f);
    double q = 0;
    if (*v2_path)
        q = path_quota("/sys/fs/cgroup", v2_path, 1, src, src_size);
    /* v1 mounts the cpu controller under either name; inside a container the path listed may
     * be the host's, which the walk up to the mount's root then passes over */
    if (q == 0 && *v1_path)
        q = path_quota("/sys/fs/cgroup/cpu,cpuacct", v1_path, 0, src, src_size);
    if (q == 0 && *v1_path)
        q = path_quota("/sys/fs/cgroup/cpu", v1_path, 0, src, src_size);
    return q;
}

void cpu_default_threads(cpu_thread_default *out)
{
    memset(out, 0, sizeof *out);
    out->cores = physical_cores();
    out->threads = out->cores;
    out->quota = cgroup_quota(out->quota_source, sizeof out->quota_source);
    if (out->quota > 0) {
        int cap = (int)ceil(out->quota - 1e-9);
        cap = cap < 1 ? 1 : cap;
        if (cap < out->threads)
            out->threads = cap;
    }
}

void cpu_describe_threads(const cpu_thread_default *t, char *out, size_t n)
{
    if (t->quota > 0 && t->threads < t->cores)
        snprintf(out, n, "%d thread%s: %s quota %.2f CPUs, %d cores", t->threads,
                 t->threads == 1 ? "" : "s", t->quota_source, t->quota, t->cores);
    else if (t->quota > 0)
        snprintf(out, n, "%d thread%s: %d cores (%s quota %.2f CPUs)", t->threads,
                 t->threads == 1 ? "" : "s", t->cores, t->quota_source, t->quota);
    else
        snprintf(out, n, "%d thread%s: cores in the affinity mask", t->threads,
                 t->threads == 1 ? "" : "s");
}
