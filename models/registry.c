/*
 * models/registry.c - the model families by GGUF architecture name.
 */
#include "models.h"

#include <stdio.h>
#include <string.h>

int64_t loom_model_kv_int(const loom_gguf *g, const char *arch, const char *suffix,
                          int64_t fallback)
{
    char key[160];
    int64_t v;
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    return loom_gguf_get_i64(g, key, &v) == 0 ? v : fallback;
}

double loom_model_kv_float(const loom_gguf *g, const char *arch, const char *suffix,
                           double fallback)
{
    char key[160];
    double v;
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    return loom_gguf_get_f64(g, key, &v) == 0 ? v : fallback;
}

/* the built-in families, then those loom_models_register adds (a test's, an embedder's) */
#define BUILT_IN_FAMILIES                                                                          \
    &loom_family_llama, &loom_family_qwen2, &loom_family_qwen3, &loom_family_qwen,                 \
        &loom_family_chatglm1, &loom_family_chatglm, &loom_family_mistral, &loom_family_qwen2moe,  \
        &loom_family_qwen3moe, &loom_family_glm4, &loom_family_glm4moe, &loom_family_qwen35,       \
        &loom_family_qwen35_vl, &loom_family_qwen35moe, &loom_family_qwen35moe_vl,                 \
        &loom_family_qwen3next, &loom_family_deepseek2
static const loom_family *families[24] = {BUILT_IN_FAMILIES};
static int n_families = (int)(sizeof(const loom_family *[]){BUILT_IN_FAMILIES} /
                              sizeof(const loom_family *));

const loom_family *loom_family_find(const char *name)
{
    for (int i = 0; i < n_families; i++)
        if (strcmp(families[i]->arch->name, name) == 0)
            return families[i];
    return NULL;
}

const loom_arch *loom_models_find(const char *name)
{
    const loom_family *f = loom_family_find(name);
    return f ? f->arch : NULL;
}

/* ChatGLM-6B and ChatGLM2 share model_type "chatglm": a family with hf_when is asked first */
const loom_family *loom_family_for_hf(const cJSON *config)
{
    const char *type = cJSON_GetStringValue(cJSON_GetObjectItem(config, "model_type"));
    const loom_family *plain = NULL;
    for (int i = 0; type && i < n_families; i++) {
        const loom_family *f = families[i];
        if (!f->hf_model_type || strcmp(f->hf_model_type, type) != 0)
            continue;
        if (!f->hf_when && !plain)
            plain = f;
        for (const char *k = f->hf_when; k && *k;) {
            size_t len = strcspn(k, "|");
            char key[64];
            snprintf(key, sizeof key, "%.*s", (int)len, k);
            if (cJSON_GetObjectItem(config, key))
                return f;
            k += len + (k[len] == '|');
        }
    }
    return plain;
}

static const char *family_name(int i, int hf)
{
    return hf ? families[i]->hf_model_type : families[i]->arch->name;
}

/* the families' names, each once, ", " between */
static const char *list(char *out, size_t size, int hf)
{
    size_t n = 0;
    out[0] = '\0';
    for (int i = 0; i < n_families; i++) {
        const char *name = family_name(i, hf);
        int seen = !name;
        for (int j = 0; j < i && !seen; j++)
            seen = family_name(j, hf) && !strcmp(family_name(j, hf), name);
        if (!seen && n < size)
            n += (size_t)snprintf(out + n, size - n, "%s%s", n ? ", " : "", name);
    }
    return out;
}

const char *loom_models_known(void)
{
    static char names[512];
    return list(names, sizeof names, 0);
}

const char *loom_models_known_hf(void)
{
    static char names[512];
    return list(names, sizeof names, 1);
}

int loom_models_register(const loom_family *family)
{
    if (n_families == (int)(sizeof families / sizeof families[0]))
        return -1;
    for (int i = 0; i < n_families; i++) {
        const loom_family *f = families[i];
        int same = family->hf_model_type ? f->hf_model_type &&
                !strcmp(f->hf_model_type, family->hf_model_type) && !f->hf_when && !family->hf_when
                                         : !strcmp(f->arch->name, family->arch->name);
        if (f == family || same)
            return -1;
    }
    families[n_families++] = family;
    return 0;
}
