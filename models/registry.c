/*
 * models/registry.c - the model families by GGUF architecture name.
 */
#include "models.h"

#include <stdio.h>
#include <string.h>

int64_t loom_model_kv_int(const loom_gguf *g, const char *arch, const char *suffix, int64_t fallback)
{
    char key[160];
    int64_t v;
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    return loom_gguf_get_i64(g, key, &v) == 0 ? v : fallback;
}

double loom_model_kv_float(const loom_gguf *g, const char *arch, const char *suffix, double fallback)
{
    char key[160];
    double v;
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    return loom_gguf_get_f64(g, key, &v) == 0 ? v : fallback;
}

static const loom_arch *const all[] = {&loom_arch_llama, &loom_arch_qwen2, &loom_arch_qwen3,
                                       &loom_arch_qwen,  &loom_arch_chatglm, &loom_arch_chatglm1};

const loom_arch *loom_models_find(const char *name)
{
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (strcmp(all[i]->name, name) == 0)
            return all[i];
    return NULL;
}

const char *loom_models_known(void)
{
    static char list[256];
    if (!list[0])
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? ", " : "",
                     all[i]->name);
    return list;
}
