/*
 * models/registry.c - the model families by GGUF architecture name.
 */
#include "models.h"

#include <string.h>

static const loom_arch *const all[] = {&loom_arch_llama, &loom_arch_qwen2, &loom_arch_chatglm,
                                       &loom_arch_chatglm1};

const loom_arch *loom_models_find(const char *name)
{
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (strcmp(all[i]->name, name) == 0)
            return all[i];
    return NULL;
}

const char *loom_models_known(void)
{
    return "llama, qwen2, chatglm, chatglm1";
}
