/*
 * api/convert.h - what the Hugging Face converter's two files share: the conversion state and
 * its helpers (convert.c: models, weights; convert_tokenizer.c: tokenizer files -> GGUF keys).
 */
#ifndef LOOM_API_CONVERT_H
#define LOOM_API_CONVERT_H

#include "internal.h"

#include "core/gguf.h"
#include "core/safetensors.h"
#include "core/spm_model.h"

#include <cjson/cJSON.h>

typedef struct conv {
    const char *dir;
    cJSON *config, *tok_config;
    loom_safetensors st;
    loom_spm_model spm;
    loom_gguf_writer *w;
    void **owned;
    int n_owned, cap_owned;
    const char *type; /* requested: auto, f32, f16, bf16, q8_0, q4_0, q4_1 */
    loom_convert_progress_fn progress;
    void *user;
    int done, total;
    char *err;
    size_t err_size;
} conv;

/* Records an error in c->err; returns -1. */
int conv_fail(conv *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* dir/name as JSON; NULL when absent or invalid (an error only when required). */
cJSON *conv_read_json(const char *dir, const char *name, int required, conv *c);
/* A number in a JSON object, or fallback. */
double conv_num(cJSON *o, const char *key, double fallback);
/* The folder's tokenizer, whichever form it ships, into c->w. */
int conv_tokenizer(conv *c);
/* Writes the keys of a SentencePiece model's normaliser (c->spm): its character map, whether
 * it collapses whitespace, whether it escapes spaces. */
void conv_spm_normalizer(conv *c);
/* generation_config.json's list of end tokens, as tokenizer.loom.stop_token_ids. */
void conv_stop_tokens(conv *c);
/* whether the folder's tokenizer.model is a tiktoken rank file (Llama-3, GLM-4) */
int conv_is_tiktoken_dir(const conv *c);

#endif
