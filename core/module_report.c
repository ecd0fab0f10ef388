/*
 * core/module_report.c - the registry as `loom backends` prints it, in text and JSON. See
 * loader.h.
 */
#include "loader_internal.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

void loader_label(const loom_candidate *c, char *out, size_t n)
{
    if (!c->name[0]) {
        const char *base = strrchr(c->path, '/');
        snprintf(out, n, "%.100s", base ? base + 1 : c->path);
    } else if (c->variant[0])
        snprintf(out, n, "%s-%s", c->name, c->variant);
    else
        snprintf(out, n, "%s", c->name);
}

static void format_bytes(uint64_t b, char *out, size_t n)
{
    if (b >= (1ull << 30))
        snprintf(out, n, "%.1f GiB", (double)b / (double)(1ull << 30));
    else
        snprintf(out, n, "%.1f MiB", (double)b / (double)(1ull << 20));
}

void loom_registry_print(const loom_registry *reg, FILE *out)
{
    fprintf(out, "loom backend modules (ABI %d.%d), searched: %s\n", LOOM_BACKEND_ABI_MAJOR,
            LOOM_BACKEND_ABI_MINOR, reg->search_path[0] ? reg->search_path : "(nothing)");
    if (reg->count == 0)
        fprintf(out,
                "  none found. Build loom's backends, or point LOOM_BACKEND_PATH at a "
                "directory holding backend .so files.\n");
    for (int i = 0; i < reg->count; i++) {
        const loom_candidate *c = &reg->items[i];
        char l[160];
        loader_label(c, l, sizeof l);
        fprintf(out, "\n%s %s\n", c->state == LOOM_CAND_CHOSEN ? "*" : "-", l);
        fprintf(out, "    path:    %s\n", c->path);
        if (c->name[0]) {
            fprintf(out, "    about:   %s\n", c->description);
            fprintf(out, "    abi:     %u.%u\n", c->abi_major, c->abi_minor);
            if (c->kind == LOOM_MODULE_DECORATOR)
                fprintf(out, "    kind:    decorator (LOOM_TRACE=FILE wraps the chosen backend)\n");
            fprintf(out, "    score:   %d\n", c->probe.score);
        }
        fprintf(out, "    status:  %s%s%s\n", loom_candidate_state_name(c->state),
                c->reason[0] ? ": " : "", c->reason);
        for (uint32_t d = 0; d < c->probe.n_devices; d++) {
            char mem[40] = "";
            if (c->probe.devices[d].memory_bytes) {
                strcpy(mem, ", ");
                format_bytes(c->probe.devices[d].memory_bytes, mem + 2, sizeof mem - 2);
            }
            fprintf(out, "    device %u: %s%s%s%s%s\n", d, c->probe.devices[d].name, mem,
                    c->probe.devices[d].detail[0] ? " (" : "", c->probe.devices[d].detail,
                    c->probe.devices[d].detail[0] ? ")" : "");
        }
    }
    if (reg->chosen >= 0) {
        char l[160];
        loader_label(&reg->items[reg->chosen], l, sizeof l);
        fprintf(out, "\nchosen: %s, device %d\n", l, reg->chosen_device);
    }
}

char *loom_registry_json(const loom_registry *reg)
{
    cJSON *root = cJSON_CreateObject();
    cJSON *abi = cJSON_AddObjectToObject(root, "abi");
    cJSON_AddNumberToObject(abi, "major", LOOM_BACKEND_ABI_MAJOR);
    cJSON_AddNumberToObject(abi, "minor", LOOM_BACKEND_ABI_MINOR);
    cJSON_AddStringToObject(root, "search_path", reg->search_path);
    cJSON *list = cJSON_AddArrayToObject(root, "candidates");
    for (int i = 0; i < reg->count; i++) {
        const loom_candidate *c = &reg->items[i];
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "path", c->path);
        cJSON_AddStringToObject(o, "name", c->name);
        cJSON_AddStringToObject(o, "variant", c->variant);
        cJSON_AddStringToObject(o, "description", c->description);
        char v[32];
        snprintf(v, sizeof v, "%u.%u", c->abi_major, c->abi_minor);
        cJSON_AddStringToObject(o, "abi_version", c->name[0] ? v : "");
        cJSON_AddStringToObject(o, "kind",
                                c->kind == LOOM_MODULE_DECORATOR ? "decorator" : "backend");
        cJSON_AddStringToObject(o, "status", loom_candidate_state_name(c->state));
        cJSON_AddBoolToObject(o, "usable", c->state >= LOOM_CAND_EXCLUDED);
        cJSON_AddBoolToObject(o, "chosen", c->state == LOOM_CAND_CHOSEN);
        cJSON_AddNumberToObject(o, "score", c->probe.score);
        cJSON_AddStringToObject(o, "reason", c->reason);
        cJSON *devs = cJSON_AddArrayToObject(o, "devices");
        for (uint32_t d = 0; d < c->probe.n_devices; d++) {
            cJSON *dj = cJSON_CreateObject();
            cJSON_AddNumberToObject(dj, "index", d);
            cJSON_AddStringToObject(dj, "name", c->probe.devices[d].name);
            cJSON_AddNumberToObject(dj, "memory_bytes", (double)c->probe.devices[d].memory_bytes);
            cJSON_AddStringToObject(dj, "detail", c->probe.devices[d].detail);
            cJSON_AddItemToArray(devs, dj);
        }
        cJSON_AddItemToArray(list, o);
    }
    if (reg->chosen >= 0) {
        cJSON_AddStringToObject(root, "chosen", reg->items[reg->chosen].path);
        cJSON_AddNumberToObject(root, "chosen_device", reg->chosen_device);
    } else {
        cJSON_AddNullToObject(root, "chosen");
    }
    char *s = cJSON_Print(root);
    cJSON_Delete(root);
    return s;
}
