/*
 * tests/test_numa.c - the CPU backend's NUMA logic on a machine of any shape: cpulist parsing,
 * the topology read from a fake sysfs (LOOM_TEST_SYSROOT) and restricted to the affinity mask,
 * LOOM_NUMA, the threads-to-nodes plan (in proportion to each node's CPUs, node by node, as
 * pool_split hands out rows), and that the pool really binds a worker where it is told.
 */
#define _GNU_SOURCE
#include "backends/cpu/cpu.h"
#include "check.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    CHECK(f != NULL, "cannot write %s", path);
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

static void bound_cpu(void *ctx, int ith, int nth)
{
    (void)nth;
    cpu_set_t *seen = ctx;
    if (ith == 1)
        sched_getaffinity(0, sizeof seen[0], &seen[0]);
}

int main(void)
{
    cpu_set_t s;
    CHECK(cpu_parse_cpulist("0-3,8-11\n", &s) == 0 && CPU_COUNT(&s) == 8 && CPU_ISSET(9, &s) &&
              !CPU_ISSET(4, &s),
          "0-3,8-11");
    CHECK(cpu_parse_cpulist("5", &s) == 0 && CPU_COUNT(&s) == 1 && CPU_ISSET(5, &s), "5");
    CHECK(cpu_parse_cpulist("3-1", &s) != 0, "a backwards range is malformed");
    CHECK(cpu_parse_cpulist("x", &s) != 0, "not a number");

    /* plans on made-up topologies */
    cpu_numa t = {0};
    t.n_nodes = 2;
    CPU_ZERO(&t.cpus[0]);
    CPU_ZERO(&t.cpus[1]);
    for (int c = 0; c < 8; c++) {
        CPU_SET(c, &t.cpus[0]);
        CPU_SET(8 + c, &t.cpus[1]);
    }
    int node[64];
    cpu_numa_plan(&t, 12, node);
    int on0 = 0;
    for (int i = 0; i < 12; i++)
        on0 += node[i] == 0;
    CHECK(on0 == 6 && node[0] == 0 && node[5] == 0 && node[6] == 1 && node[11] == 1,
          "2 x 8 CPUs, 12 threads: 6 per node, node 0 first (got %d on node 0)", on0);
    CPU_ZERO(&t.cpus[1]);
    for (int c = 0; c < 4; c++)
        CPU_SET(8 + c, &t.cpus[1]);
    cpu_numa_plan(&t, 3, node);
    CHECK(node[0] == 0 && node[1] == 0 && node[2] == 1, "8 + 4 CPUs, 3 threads: 2 + 1 (%d %d %d)",
          node[0], node[1], node[2]);
    cpu_numa_plan(&t, 1, node);
    CHECK(node[0] == 0, "one thread: node 0");

    /* a fake two-node machine over the CPUs this process may use */
    cpu_set_t mine;
    CHECK(sched_getaffinity(0, sizeof mine, &mine) == 0, "sched_getaffinity");
    int first = -1, last = -1;
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &mine)) {
            last = c;
            first = first < 0 ? c : first;
        }
    char root[] = "/tmp/loom-numa.XXXXXX", path[256], text[64];
    CHECK(mkdtemp(root) != NULL, "mkdtemp");
    const char *dirs[] = {"/sys",
                          "/sys/devices",
                          "/sys/devices/system",
                          "/sys/devices/system/node",
                          "/sys/devices/system/node/node0",
                          "/sys/devices/system/node/node2",
                          "/sys/devices/system/node/node3"};
    for (size_t i = 0; i < sizeof dirs / sizeof dirs[0]; i++) {
        snprintf(path, sizeof path, "%s%s", root, dirs[i]);
        mkdir(path, 0700);
    }
    snprintf(path, sizeof path, "%s/sys/devices/system/node/node0/cpulist", root);
    snprintf(text, sizeof text, "%d\n", first);
    write_file(path, text);
    snprintf(path, sizeof path, "%s/sys/devices/system/node/node2/cpulist", root); /* a hole at 1 */
    snprintf(text, sizeof text, "%d-%d\n", first + 1, last > first ? last : first + 1);
    write_file(path, text);
    snprintf(path, sizeof path, "%s/sys/devices/system/node/node3/cpulist", root);
    write_file(path, "\n"); /* a memory-only node */
    setenv("LOOM_TEST_SYSROOT", root, 1);
    cpu_numa_read(&t);
    if (last > first) {
        CHECK(t.n_nodes == 2 && t.node_id[0] == 0 && t.node_id[1] == 2 && t.simulated,
              "two nodes with CPUs (0 and 2), got %d", t.n_nodes);
        CHECK(t.n_nodes == 2 && CPU_COUNT(&t.cpus[0]) == 1 &&
                  CPU_COUNT(&t.cpus[1]) == CPU_COUNT(&mine) - 1,
              "the nodes' CPUs, within the affinity mask");
        char err[128];
        unsetenv("LOOM_NUMA");
        CHECK(cpu_numa_mode(&t, err, sizeof err) == CPU_NUMA_INTERLEAVE,
              "default with 2 nodes: interleave");
        setenv("LOOM_NUMA", "local", 1);
        CHECK(cpu_numa_mode(&t, err, sizeof err) == CPU_NUMA_LOCAL, "LOOM_NUMA=local");
        setenv("LOOM_NUMA", "nearby", 1);
        CHECK(cpu_numa_mode(&t, err, sizeof err) < 0 && strstr(err, "LOOM_NUMA=nearby"),
              "a bad LOOM_NUMA is named");
        unsetenv("LOOM_NUMA");
        cpu_numa_describe(&t, CPU_NUMA_LOCAL, text, sizeof text);
        CHECK(strstr(text, "2 NUMA nodes") && strstr(text, "local (simulated)"), "describe: %s",
              text);
        CHECK(cpu_numa_interleave(&t, text, sizeof text) == 0,
              "no memory policy on a simulated topology");

        /* the pool binds worker 1 to the second node's CPUs, as LOOM_NUMA=local does */
        pool *p = pool_create(2);
        CHECK(p != NULL, "pool_create");
        if (p) {
            CHECK(pool_bind_worker(p, 1, &t.cpus[1], sizeof(cpu_set_t)) == 0, "pool_bind_worker");
            cpu_set_t seen[1];
            CPU_ZERO(&seen[0]);
            pool_run(p, bound_cpu, seen);
            CHECK(CPU_EQUAL(&seen[0], &t.cpus[1]), "worker 1 runs only on node 2's CPUs");
            pool_free(p);
        }
    } else {
        printf("one CPU in the affinity mask: the two-node checks need two\n");
        CHECK(t.n_nodes == 1, "one CPU: one node with it");
    }
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    CHECK(system(cmd) == 0, "cleanup");
    return check_finish("test_numa");
}
