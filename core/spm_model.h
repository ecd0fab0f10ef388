/*
 * core/spm_model.h - reading a SentencePiece tokenizer.model (a protobuf ModelProto) directly:
 * the pieces with their scores and types, the special ids, and the normaliser's flags.
 */
#ifndef LOOM_CORE_SPM_MODEL_H
#define LOOM_CORE_SPM_MODEL_H

#include <stddef.h>
#include <stdint.h>

typedef struct loom_spm_model {
    int32_t n;
    char **pieces; /* NUL-terminated UTF-8 */
    float *scores;
    int32_t *types;     /* 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte */
    int32_t model_type; /* 1 unigram, 2 BPE */
    int32_t unk_id, bos_id, eos_id, pad_id;
    int add_dummy_prefix, remove_extra_whitespaces, escape_whitespaces, byte_fallback;
    char normalizer[32]; /* the normaliser's name: "identity", "nmt_nfkc", ... ("" if unnamed) */
    /* the normaliser's precompiled_charsmap, as stored (NULL, 0 when it has none) */
    unsigned char *charsmap;
    size_t charsmap_size;
} loom_spm_model;

/* Reads path. Returns 0, or -1 with err naming the file and what is wrong. */
int loom_spm_model_read(loom_spm_model *m, const char *path, char *err, size_t err_size);
void loom_spm_model_free(loom_spm_model *m);

#endif
