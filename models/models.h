/*
 * models/models.h - the model families loom runs, as architecture tables for the core runner.
 */
#ifndef LOOM_MODELS_H
#define LOOM_MODELS_H

#include "family.h"

extern const loom_arch loom_arch_llama;     /* GGUF "llama": Llama-2/3, TinyLlama, stories260K */
extern const loom_arch loom_arch_qwen2;     /* GGUF "qwen2": Qwen2/2.5 */
extern const loom_arch loom_arch_qwen3;     /* GGUF "qwen3": Qwen3 (dense) */
extern const loom_arch loom_arch_qwen;      /* GGUF "qwen": Qwen v1 (Qwen-7B/14B and chat) */
extern const loom_arch loom_arch_qwen2moe;  /* GGUF "qwen2moe": Qwen1.5-MoE, Qwen2-57B-A14B */
extern const loom_arch loom_arch_qwen3moe;  /* GGUF "qwen3moe": Qwen3-30B-A3B, -235B-A22B */
extern const loom_arch loom_arch_glm4;      /* GGUF "glm4": GLM-4-9B/32B-0414, GLM-Z1 */
extern const loom_arch loom_arch_glm4moe;   /* GGUF "glm4moe": GLM-4.5, GLM-4.5-Air, GLM-4.6 */
extern const loom_arch loom_arch_chatglm;   /* GGUF "chatglm": ChatGLM2/3, GLM-4 */
extern const loom_arch loom_arch_qwen35;    /* GGUF "qwen35": Qwen3.5, Qwen3.6 (dense) */
extern const loom_arch loom_arch_qwen35moe; /* GGUF "qwen35moe": their mixture-of-experts */
extern const loom_arch loom_arch_qwen3next; /* GGUF "qwen3next": Qwen3-Next-80B-A3B */
extern const loom_arch loom_arch_chatglm1;  /* GGUF "chatglm1" (loom's own): ChatGLM-6B */
extern const loom_arch loom_arch_deepseek2; /* GGUF "deepseek2": GLM-4.7-Flash (MLA) */

/* Hyper-parameter ARCH.SUFFIX of a model file, or fallback when absent. */
int64_t loom_model_kv_int(const loom_gguf *g, const char *arch, const char *suffix,
                          int64_t fallback);
double loom_model_kv_float(const loom_gguf *g, const char *arch, const char *suffix,
                           double fallback);

/* Each family's whole declaration (models/family.h), in the file of its forward pass. */
extern const loom_family loom_family_llama, loom_family_mistral, loom_family_qwen2,
    loom_family_qwen3, loom_family_qwen, loom_family_chatglm, loom_family_chatglm1,
    loom_family_qwen2moe, loom_family_qwen3moe, loom_family_glm4, loom_family_glm4moe,
    loom_family_qwen35, loom_family_qwen35_vl, loom_family_qwen35moe, loom_family_qwen35moe_vl,
    loom_family_qwen3next, loom_family_deepseek2;

/* The architecture for general.architecture, or NULL. */
const loom_arch *loom_models_find(const char *name);
/* The family of GGUF architecture name, or NULL. */
const loom_family *loom_family_find(const char *name);
/* The family a Hugging Face config.json describes (model_type, then hf_when), or NULL. */
const loom_family *loom_family_for_hf(const cJSON *config);
/* "llama, qwen2": for messages that list what loom knows: GGUF architectures, or (hf) the
 * Hugging Face model types loom converts. */
const char *loom_models_known(void);
const char *loom_models_known_hf(void);
/* Adds a family beside the built-in ones (a program's own, or a test's): 0, or -1 when the
 * table is full or another family claims its Hugging Face model_type (converting none: its
 * architecture). An architecture may serve several Hugging Face forms; loom_family_find gives
 * the first. Not thread-safe: call before loading a model. */
int loom_models_register(const loom_family *family);

#endif
