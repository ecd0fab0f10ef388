#define _GNU_SOURCE
/*
 * files/inspect.c - `loom inspect`: what a model file holds, for a person or (--json) a program.
 */
#include "api/internal.h"

#include "core/gguf.h"
#include "core/tokenizer.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* A metadata value as JSON (arrays: their length and type, and the elements when short). */
static cJSON *kv_json(const loom_gguf *g, const loom_gguf_kv *kv)
{
    if (kv->type == LOOM_GGUF_STRING) {
        const char *s;
        uint64_t len;
        loom_gguf_get_str(g, kv->key, &s, &len);
        size_t n; /* a file's strings need not be UTF-8; JSON's must */
        char *copy = loom_utf8_sanitize(s, (size_t)len, &n);
        cJSON *j = cJSON_CreateString(copy ? copy : "");
        free(copy);
        return j;
    }
    if (kv->type == LOOM_GGUF_BOOL) {
        int b = 0;
        loom_gguf_get_bool(g, kv->key, &b);
        return cJSON_CreateBool(b);
    }
    if (kv->type == LOOM_GGUF_ARRAY) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "array_of", loom_gguf_type_name(kv->array_type));
        cJSON_AddNumberToObject(o, "length", (double)kv->count);
        return o;
    }
    double f = 0;
    loom_gguf_get_f64(g, kv->key, &f);
    return cJSON_CreateNumber(f);
}

/* The value as one line of text, shortened to n bytes. */
static void kv_text(const loom_gguf *g, const loom_gguf_kv *kv, char *out, size_t n)
{
    if (kv->type == LOOM_GGUF_ARRAY) {
        snprintf(out, n, "[%llu x %s]", (unsigned long long)kv->count,
                 loom_gguf_type_name(kv->array_type));
        return;
    }
    cJSON *j = kv_json(g, kv);
    char *s = cJSON_PrintUnformatted(j);
    snprintf(out, n, "%s", s ? s : "?");
    if (s && strlen(s) >= n && n > 4)
        memcpy(out + n - 4, "...", 4);
    free(s);
    cJSON_Delete(j);
}

static void shape_text(const loom_gguf_tensor *t, char *out, size_t n)
{
    size_t used = 0;
    out[0] = '\0';
    for (uint32_t d = t->n_dims; d-- > 0 && used < n;)
        used += (size_t)snprintf(out + used, n - used, "%s%lld", used ? " x " : "",
                                 (long long)t->ne[d]);
}

int loom_inspect(const char *path, FILE *out, int json, char *err, size_t err_size)
{
    loom_gguf g;
    if (loom_open_model_file(path, &g, NULL, NULL, err, err_size) != 0) {
        loom_text_printable(err);
        return -1;
    }
    const char *arch = "unknown";
    uint64_t arch_len = 7;
    loom_gguf_get_str(&g, "general.architecture", &arch, &arch_len);
    uint64_t total = 0;
    for (uint64_t i = 0; i < g.n_tensors; i++)
        total += g.tensors[i].size;
    uint64_t first_bad = 0;
    int64_t bad = loom_gguf_check_checksums(&g, &first_bad);

    if (json) {
        cJSON *root = cJSON_CreateObject();
        cJSON_AddStringToObject(root, "file", path);
        cJSON_AddStringToObject(root, "format", "gguf");
        cJSON_AddNumberToObject(root, "version", g.version);
        cJSON_AddNumberToObject(root, "file_bytes", (double)g.size);
        cJSON_AddNumberToObject(root, "alignment", g.alignment);
        char *a = strndup(arch, (size_t)arch_len);
        cJSON_AddStringToObject(root, "architecture", a ? a : "");
        free(a);
        cJSON *meta = cJSON_AddObjectToObject(root, "metadata");
        for (uint64_t i = 0; i < g.n_kv; i++)
            cJSON_AddItemToObject(meta, g.kv[i].key, kv_json(&g, &g.kv[i]));
        cJSON *ts = cJSON_AddArrayToObject(root, "tensors");
        for (uint64_t i = 0; i < g.n_tensors; i++) {
            const loom_gguf_tensor *t = &g.tensors[i];
            cJSON *o = cJSON_CreateObject();
            cJSON_AddStringToObject(o, "name", t->name);
            cJSON *shape = cJSON_AddArrayToObject(o, "shape"); /* outermost first */
            for (uint32_t d = t->n_dims; d-- > 0;)
                cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)t->ne[d]));
            cJSON_AddStringToObject(o, "type", loom_ggml_type_name(t->type));
            cJSON_AddNumberToObject(o, "bytes", (double)t->size);
            cJSON_AddNumberToObject(o, "offset", (double)t->offset);
            cJSON_AddItemToArray(ts, o);
        }
        cJSON_AddNumberToObject(root, "tensor_bytes", (double)total);
        cJSON_AddBoolToObject(root, "data_inside_file", 1);
        cJSON *sum = cJSON_AddObjectToObject(root, "checksum");
        cJSON_AddBoolToObject(sum, "stored", bad != -2);
        if (bad != -2) {
            cJSON_AddStringToObject(sum, "algorithm", LOOM_GGUF_CHECKSUM_ALGORITHM);
            cJSON_AddBoolToObject(sum, "matches", bad == 0);
            if (bad > 0)
                cJSON_AddStringToObject(sum, "first_mismatch", g.tensors[first_bad].name);
        }
        char *s = cJSON_Print(root);
        fprintf(out, "%s\n", s ? s : "{}");
        free(s);
        cJSON_Delete(root);
        loom_gguf_close(&g);
        return 0;
    }

    fprintf(out, "%s: GGUF v%u, %llu bytes, %llu tensors, %llu metadata keys\n", path, g.version,
            (unsigned long long)g.size, (unsigned long long)g.n_tensors,
            (unsigned long long)g.n_kv);
    fprintf(out, "architecture: %.*s\n", (int)arch_len, arch);
    /* hyper-parameters (<arch>.*), then general.*, then the tokenizer, then anything else */
    static const char *const sections[] = {"hyper-parameters", "general", "tokenizer", "other"};
    for (int sec = 0; sec < 4; sec++) {
        int printed = 0;
        for (uint64_t i = 0; i < g.n_kv; i++) {
            const char *k = g.kv[i].key;
            int is_arch = strncmp(k, arch, (size_t)arch_len) == 0 && k[arch_len] == '.';
            int which = is_arch                     ? 0
                : strncmp(k, "general.", 8) == 0    ? 1
                : strncmp(k, "tokenizer.", 10) == 0 ? 2
                                                    : 3;
            if (which != sec || strcmp(k, "tokenizer.chat_template") == 0)
                continue;
            if (!printed++)
                fprintf(out, "\n%s:\n", sections[sec]);
            char v[120];
            kv_text(&g, &g.kv[i], v, sizeof v);
            fprintf(out, "  %-44s %s\n", k, v);
        }
    }
    const char *tmpl;
    uint64_t tlen;
    if (loom_gguf_get_str(&g, "tokenizer.chat_template", &tmpl, &tlen) == 0)
        fprintf(out, "\nchat template (%llu bytes):\n%.*s\n", (unsigned long long)tlen, (int)tlen,
                tmpl);
    else
        fprintf(out, "\nchat template: none in the file\n");
    fprintf(out, "\ntensors:\n  %-40s %-22s %-6s %12s\n", "name", "shape", "type", "bytes");
    for (uint64_t i = 0; i < g.n_tensors; i++) {
        const loom_gguf_tensor *t = &g.tensors[i];
        char shape[64];
        shape_text(t, shape, sizeof shape);
        fprintf(out, "  %-40s %-22s %-6s %12llu\n", t->name, shape, loom_ggml_type_name(t->type),
                (unsigned long long)t->size);
    }
    /* the mix: how many tensors of each type, as llama.cpp's quantizer summarises a file */
    unsigned counts[32] = {0};
    for (uint64_t i = 0; i < g.n_tensors; i++)
        counts[g.tensors[i].type & 31]++;
    fprintf(out, "\ntypes:");
    for (int t = 0; t < 32; t++)
        if (counts[t])
            fprintf(out, " %u %s", counts[t], loom_ggml_type_name((uint32_t)t));
    fprintf(out, "\n%llu bytes of tensor data, all inside the file\n", (unsigned long long)total);
    if (bad == -2)
        fprintf(out, "checksums: none stored (loom stores them in the files it writes)\n");
    else if (bad == -1)
        fprintf(out, "checksums: %s is damaged\n", LOOM_GGUF_CHECKSUM_KEY);
    else if (bad == 0)
        fprintf(out, "checksums: %s per tensor, all %llu match\n", LOOM_GGUF_CHECKSUM_ALGORITHM,
                (unsigned long long)g.n_tensors);
    else
        fprintf(out,
                "checksums: %lld of %llu tensors DIFFER from the stored %s sums, the first "
                "'%s': the file was damaged (loom verify says more)\n",
                (long long)bad, (unsigned long long)g.n_tensors, LOOM_GGUF_CHECKSUM_ALGORITHM,
                g.tensors[first_bad].name);
    loom_gguf_close(&g);
    return 0;
}
