/*
 * api/loom.c - the embedding API (include/loom/loom.h): wires the core to its callers.
 */
#include "config.h"

#include <loom/loom.h>

#include "core/loader.h"

#include <stdlib.h>

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
    if (loom_registry_scan(&reg, err, err_size) != 0) {
        loom_registry_free(&reg);
        return -1;
    }
    int rc = loom_registry_select(&reg, NULL, err, err_size);
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
