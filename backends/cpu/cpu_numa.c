/*
 * backends/cpu/cpu_numa.c - NUMA placement for the CPU backend's threads and memory.
 *
 * On a server with several NUMA nodes (one per socket, or more), a thread reading memory
 * attached to another node pays the interconnect's latency and shares its bandwidth: 20% or more
 * of a memory-bound decode step. LOOM_NUMA chooses what to do about it:
 *   interleave  (the default with more than one node) big buffers (prepared weights, the KV
 *               cache) are spread page by page over the nodes, so every thread sees the same
 *               mix of local and remote memory and all nodes' bandwidth is used;
 *   local       worker threads are bound to nodes in proportion to the nodes' CPUs, and each
 *               prepared weight's rows are first touched (written) by the thread that will read
 *               them, so the kernel places them on that thread's node; buffers every thread
 *               reads (the KV cache) are interleaved;
 *   off         neither.
 * Weights used from the file's mapping (not prepared) stay where the page cache put them.
 *
 * The topology comes from sysfs (nodeN/cpulist, restricted to the affinity mask), read under
 * LOOM_TEST_SYSROOT when that is set (tests fake a two-node machine that way; memory policy is
 * then not applied, since the nodes do not exist). Memory policy uses libnuma when configure
 * found it.
 *
 * Compiled for the baseline ISA with the probe, which reports the nodes.
 */
#define _GNU_SOURCE
#include "cpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(LOOM_HAVE_NUMA)
#include <numa.h>
#endif

/* "0-3,8-11" -> set; 0, or -1 when malformed */
int cpu_parse_cpulist(const char *s, cpu_set_t *set)
{
    CPU_ZERO(set);
    while (*s && *s != '\n') {
        char *end;
        long a = strtol(s, &end, 10), b = a;
        if (end == s || a < 0)
            return -1;
        s = end;
        if (*s == '-') {
            b = strtol(s + 1, &end, 10);
            if (end == s + 1 || b < a)
                return -1;
            s = end;
        }
        for (long c = a; c <= b && c < CPU_SETSIZE; c++)
            CPU_SET((int)c, set);
        if (*s == ',')
            s++;
        else if (*s && *s != '\n')
            return -1;
    }
    return 0;
}

void cpu_numa_read(cpu_numa *t)
{
    memset(t, 0, sizeof *t);
    const char *root = getenv("LOOM_TEST_SYSROOT");
    t->simulated = root && *root;
    cpu_set_t mine;
    if (sched_getaffinity(0, sizeof mine, &mine) != 0)
        CPU_ZERO(&mine);
    for (int node = 0; node < 1024 && t->n_nodes < CPU_NUMA_MAX_NODES; node++) {
        char path[1024], line[4096];
        snprintf(path, sizeof path, "%s/sys/devices/system/node/node%d/cpulist", root ? root : "",
                 node);
        FILE *f = fopen(path, "r");
        if (!f)
            continue; /* node numbers may have holes */
        cpu_set_t set;
        int ok = fgets(line, sizeof line, f) && cpu_parse_cpulist(line, &set) == 0;
        fclose(f);
        if (!ok)
            continue;
        CPU_AND(&set, &set, &mine);
        if (CPU_COUNT(&set) == 0)
            continue; /* a memory-only node, or none of ours */
        t->node_id[t->n_nodes] = node;
        t->cpus[t->n_nodes++] = set;
    }
}

int cpu_numa_mode(const cpu_numa *t, char *err, size_t err_size)
{
    const char *env = getenv("LOOM_NUMA");
    if (!env || !*env)
        return t->n_nodes > 1 ? CPU_NUMA_INTERLEAVE : CPU_NUMA_OFF;
    if (!strcmp(env, "off"))
        return CPU_NUMA_OFF;
    if (!strcmp(env, "interleave"))
        return CPU_NUMA_INTERLEAVE;
    if (!strcmp(env, "local"))
        return CPU_NUMA_LOCAL;
    snprintf(err, err_size, "LOOM_NUMA=%s is not one of off, interleave, local", env);
    return -1;
}

const char *cpu_numa_mode_name(int mode)
{
    return mode == CPU_NUMA_LOCAL ? "local" : mode == CPU_NUMA_INTERLEAVE ? "interleave" : "off";
}

void cpu_numa_plan(const cpu_numa *t, int n_threads, int *node_of_thread)
{
    /* threads in proportion to each node's CPUs, in node order (largest remainders first), so
     * that pool_split's contiguous row ranges land node by node */
    int total = 0, given = 0, share[CPU_NUMA_MAX_NODES];
    double rest[CPU_NUMA_MAX_NODES];
    for (int n = 0; n < t->n_nodes; n++)
        total += CPU_COUNT(&t->cpus[n]);
    for (int n = 0; n < t->n_nodes; n++) {
        double exact = total ? (double)n_threads * CPU_COUNT(&t->cpus[n]) / total : 0;
        share[n] = (int)exact;
        rest[n] = exact - share[n];
        given += share[n];
    }
    while (given < n_threads && t->n_nodes > 0) {
        int best = 0;
        for (int n = 1; n < t->n_nodes; n++)
            best = rest[n] > rest[best] ? n : best;
        share[best]++, rest[best] = -1, given++;
    }
    int th = 0;
    for (int n = 0; n < t->n_nodes; n++)
        for (int k = 0; k < share[n] && th < n_threads; k++)
            node_of_thread[th++] = n;
    while (th < n_threads)
        node_of_thread[th++] = 0;
}

void cpu_numa_describe(const cpu_numa *t, int mode, char *out, size_t n)
{
    if (t->n_nodes <= 1) {
        snprintf(out, n, "1 NUMA node");
        return;
    }
    int used = snprintf(out, n, "%d NUMA nodes (", t->n_nodes);
    for (int i = 0; i < t->n_nodes && used > 0 && (size_t)used < n; i++)
        used += snprintf(out + used, n - (size_t)used, "%s%d", i ? "+" : "",
                         CPU_COUNT(&t->cpus[i]));
    if (used > 0 && (size_t)used < n)
        snprintf(out + used, n - (size_t)used, " cpus), %s%s", cpu_numa_mode_name(mode),
                 t->simulated ? " (simulated)" : "");
}

int cpu_numa_interleave(const cpu_numa *t, void *p, size_t size)
{
#if defined(LOOM_HAVE_NUMA)
    if (t->n_nodes > 1 && !t->simulated && numa_available() >= 0) {
        numa_interleave_memory(p, size, numa_all_nodes_ptr);
        return 1;
    }
#else
    (void)p, (void)size;
#endif
    (void)t;
    return 0;
}
