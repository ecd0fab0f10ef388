/*
 * models/models.h - the model families loom runs, as architecture tables for the core runner.
 */
#ifndef LOOM_MODELS_H
#define LOOM_MODELS_H

#include "core/runner.h"

extern const loom_arch loom_arch_llama; /* GGUF "llama": Llama-2/3, TinyLlama, stories260K */
extern const loom_arch loom_arch_qwen2; /* GGUF "qwen2": Qwen2/2.5 */
extern const loom_arch loom_arch_qwen3; /* GGUF "qwen3": Qwen3 (dense) */
extern const loom_arch loom_arch_qwen;  /* GGUF "qwen": Qwen v1 (Qwen-7B/14B and chat) */
extern const loom_arch loom_arch_chatglm; /* GGUF "chatglm": ChatGLM2/3, GLM-4 */
extern const loom_arch loom_arch_chatglm1; /* GGUF "chatglm1" (loom's own): ChatGLM-6B */

/* Hyper-parameter ARCH.SUFFIX of a model file, or fallback when absent. */
int64_t loom_model_kv_int(const loom_gguf *g, const char *arch, const char *suffix, int64_t fallback);
double loom_model_kv_float(const loom_gguf *g, const char *arch, const char *suffix, double fallback);

/* The architecture for general.architecture, or NULL. */
const loom_arch *loom_models_find(const char *name);
/* "llama, qwen2": for messages that list what loom knows. */
const char *loom_models_known(void);

#endif
