/*
 * api/loom.c - the embedding API (include/loom/loom.h): wires the core to its callers.
 */
#include "config.h"

#include <loom/loom.h>

#include "api/loader_env.h"

#include <stdlib.h>
#include <string.h>

static const char *env_text(const char *name)
{
    const char *s = getenv(name);
    return s && *s ? s : NULL;
}

loom_loader_options loom_loader_options_from_env(void)
{
    loom_loader_options o = {.search_path = env_text("LOOM_BACKEND_PATH"),
                             .cpu_variant = env_text("LOOM_CPU_VARIANT"),
                             .cpu_max_isa = env_text("LOOM_CPU_MAX_ISA")};
    const char *explain = env_text("LOOM_EXPLAIN");
    o.explain = explain && strcmp(explain, "0") != 0;
    const char *timeout = env_text("LOOM_PROBE_TIMEOUT");
    char *end;
    long t = timeout ? strtol(timeout, &end, 10) : 0;
    o.probe_timeout_s = timeout && !*end && t >= 1 && t <= 3600 ? t : 0;
    const char *isolation = env_text("LOOM_PROBE_ISOLATION");
    o.probe_in_process = isolation && !strcmp(isolation, "0");
    return o;
}

const char *loom_backend_preference_from_env(void)
{
    return env_text("LOOM_BACKEND");
}

const char *loom_version(void)
{
    return PACKAGE_VERSION;
}

const char *loom_git_commit(void)
{
    return LOOM_GIT_COMMIT;
}

int loom_backends_report(FILE *out, int json, char *err, size_t err_size)
{
    loom_registry reg;
    loom_loader_options lo = loom_loader_options_from_env();
    if (loom_registry_scan(&reg, &lo, err, err_size) != 0) {
        loom_registry_free(&reg);
        return -1;
    }
    int rc = loom_registry_select(&reg, loom_backend_preference_from_env(), err, err_size);
    if (json) {
        char *s = loom_registry_json(&reg);
        if (s)
            fprintf(out, "%s\n", s);
        free(s);
    } else {
        loom_registry_print(&reg, out);
    }
    loom_registry_free(&reg);
    return rc;
}
