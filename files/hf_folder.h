/*
 * files/hf_folder.h - a Hugging Face folder being converted: the state the converter's files
 * share, and reading the folder's JSON files (hf_folder.c). convert_tokenizer.c writes the
 * tokenizer keys, convert.c the rest; both build on this, neither on the other's internals.
 */
#ifndef LOOM_FILES_HF_FOLDER_H
#define LOOM_FILES_HF_FOLDER_H

#include "api/internal.h"

#include "models/models.h"

#include "core/gguf.h"
#include "core/safetensors.h"
#include "core/spm_model.h"

#include <cjson/cJSON.h>

typedef struct conv {
    const char *dir;
    const loom_family *family; /* what config.json describes; NULL converting a tokenizer alone */
    cJSON *config, *tok_config;
    int64_t vocab_rows; /* the token embedding's rows; 0 converting a tokenizer alone */
    int main_layers;    /* the layers before the multi-token-prediction block (LOOM_HF_MTP) */
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
/* The folder's file name as JSON in *out: 0 (*out NULL when it is absent and not required),
 * or -1 with the error (missing when required, not a regular file, not JSON). */
int conv_read_json(conv *c, const char *name, int required, cJSON **out);

#endif
