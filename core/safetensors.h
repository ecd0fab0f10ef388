/*
 * core/safetensors.h - reading Hugging Face safetensors weights: one file, or the shards that
 * model.safetensors.index.json lists. Files are mapped and tensor data is used in place.
 * Like the GGUF reader, every length, shape and offset is checked against the file first.
 */
#ifndef LOOM_CORE_SAFETENSORS_H
#define LOOM_CORE_SAFETENSORS_H

#include "name_index.h"

#include <loom/backend.h>
#include <stddef.h>
#include <stdint.h>

#define LOOM_ST_MAX_DIMS 8

typedef struct loom_st_tensor {
    char *name;
    char dtype[8]; /* as the file says: "F32", "F16", "BF16", "I64", ... */
    int loom_type; /* the loom_dtype for F32/F16/BF16, else -1 */
    int n_dims;
    int64_t shape[LOOM_ST_MAX_DIMS]; /* outermost first, as PyTorch writes it */
    const void *data;
    uint64_t size;
    int file; /* index of the shard holding it */
} loom_st_tensor;

typedef struct loom_st_file {
    char *path;
    const unsigned char *map;
    uint64_t size;
} loom_st_file;

typedef struct loom_safetensors {
    loom_st_file *files;
    int n_files;
    loom_st_tensor *tensors;
    int n_tensors, cap_tensors;
    loom_name_index index; /* name -> position in tensors */
} loom_safetensors;

/* path: a .safetensors file, a model.safetensors.index.json, or a folder holding either.
 * Returns 0, or -1 with err naming the file, the tensor and what is wrong. */
int loom_safetensors_open(loom_safetensors *st, const char *path, char *err, size_t err_size);
void loom_safetensors_close(loom_safetensors *st);
const loom_st_tensor *loom_safetensors_find(const loom_safetensors *st, const char *name);

#endif
