#define _GNU_SOURCE
/*
 * tools/loom.c - the `loom` command line: one binary, one subcommand per job.
 */
#include <loom/loom.h>

#include "bench_ops.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void usage(FILE *out)
{
    fprintf(out,
            "usage: loom COMMAND [ARGS]\n"
            "\n"
            "commands:\n"
            "  backends [--json]   list every backend module found, and which one a run would use\n"
            "  bench ops [--backends LIST] [--json]\n"
            "                      time each op on each backend (and CPU variant) side by side\n"
            "  inspect FILE [--json]\n"
            "                      what a GGUF model file holds: architecture, hyper-parameters,\n"
            "                      tokenizer, chat template, tensors; checks the data is all there\n"
            "  version             print loom's version\n"
            "  help                this text\n"
            "\n"
            "environment:\n"
            "  LOOM_BACKEND=LIST        preference list, e.g. cuda:1,cpu (NAME or NAME:DEVICE)\n"
            "  LOOM_BACKEND_PATH=DIRS   colon-separated directories searched first for modules\n"
            "  LOOM_CPU_VARIANT=NAME    force a CPU variant (baseline, avx2, avx512)\n"
            "  LOOM_CPU_MAX_ISA=NAME    never pick a CPU variant above this ISA\n"
            "  LOOM_EXPLAIN=1           print the backend report to stderr for any command\n");
}

static int cmd_inspect(int argc, char **argv)
{
    int json = 0;
    const char *path = NULL;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0)
            json = 1;
        else if (argv[i][0] == '-' || path) {
            fprintf(stderr, "loom inspect: unexpected argument '%s' (usage: loom inspect FILE "
                            "[--json])\n", argv[i]);
            return 2;
        } else
            path = argv[i];
    }
    if (!path) {
        fprintf(stderr, "loom inspect: which file? (usage: loom inspect FILE [--json])\n");
        return 2;
    }
    char err[1024];
    if (loom_inspect(path, stdout, json, err, sizeof err) != 0) {
        fprintf(stderr, "loom inspect: %s\n", err);
        return 2;
    }
    return 0;
}

static int cmd_backends(int argc, char **argv)
{
    int json = 0;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0) {
            json = 1;
        } else {
            fprintf(stderr, "loom backends: unknown argument '%s' (the only option is --json)\n",
                    argv[i]);
            return 2;
        }
    }
    char err[4096];
    if (loom_backends_report(stdout, json, err, sizeof err) != 0) {
        fprintf(stderr, "loom: %s\n", err);
        return 1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "backends") == 0)
        return cmd_backends(argc - 2, argv + 2);
    if (strcmp(cmd, "inspect") == 0)
        return cmd_inspect(argc - 2, argv + 2);
    if (strcmp(cmd, "bench") == 0) {
        if (argc >= 3 && strcmp(argv[2], "ops") == 0) {
            char self[PATH_MAX];
            ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
            self[n > 0 ? n : 0] = '\0';
            return loom_bench_ops_main(argc - 3, argv + 3, n > 0 ? self : argv[0]);
        }
        fprintf(stderr, "loom bench: model benchmarks are not written yet; `loom bench ops` times "
                        "the backend ops\n");
        return 2;
    }
    if (strcmp(cmd, "version") == 0 || strcmp(cmd, "--version") == 0) {
        printf("loom %s\n", loom_version());
        return 0;
    }
    if (strcmp(cmd, "help") == 0 || strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0) {
        usage(stdout);
        return 0;
    }
    fprintf(stderr, "loom: unknown command '%s'\n\n", cmd);
    usage(stderr);
    return 2;
}
