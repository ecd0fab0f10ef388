/*
 * tests/backends.h - the backends a test runs on: every module usable on this machine, by the
 * label LOOM_BACKEND selects it with ("cpu-avx2", "ref", ...). LOOM_TEST_BACKENDS=LIST (labels,
 * comma-separated) narrows that to the listed ones, so a short GPU session tests only the GPU.
 */
#ifndef LOOM_TESTS_BACKENDS_H
#define LOOM_TESTS_BACKENDS_H

#include "api/loader_env.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_TEST_BACKENDS 16

/* Fills labels with the usable backends' names, saying on stdout which modules are unusable
 * here and why; returns how many (-1 when the scan failed). */
static inline int usable_backends(char labels[][160], int max)
{
    char err[512];
    loom_registry reg;
    loom_loader_options loader = loom_loader_options_from_env();
    if (loom_registry_scan(&reg, &loader, err, sizeof err) != 0) {
        fprintf(stderr, "scanning for backends: %s\n", err);
        loom_registry_free(&reg);
        return -1;
    }
    const char *only = getenv("LOOM_TEST_BACKENDS");
    int n = 0;
    for (int i = 0; i < reg.count && n < max; i++) {
        const loom_candidate *c = &reg.items[i];
        snprintf(labels[n], 160, "%s%s%s", c->name, c->variant[0] ? "-" : "", c->variant);
        if (c->state == LOOM_CAND_UNUSABLE) /* a machine of another kind runs these */
            printf("skipped on this machine: %s (%s)\n", labels[n], c->reason);
        if (c->state != LOOM_CAND_USABLE || c->kind != LOOM_MODULE_BACKEND)
            continue; /* a decorator (the trace plugin) runs around a backend, not alone */
        if (only && *only) {
            size_t len = strlen(labels[n]);
            const char *p = only;
            int listed = 0;
            for (; *p && !listed; p += strcspn(p, ","), p += *p == ',')
                listed = strncmp(p, labels[n], len) == 0 && (p[len] == ',' || p[len] == '\0');
            if (!listed)
                continue;
        }
        n++;
    }
    loom_registry_free(&reg);
    if (only && *only && n == 0) {
        fprintf(stderr, "LOOM_TEST_BACKENDS=%s names no backend usable here\n", only);
        return -1;
    }
    return n;
}

#endif
