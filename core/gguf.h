/*
 * core/gguf.h - reading and writing GGUF files (versions 2 and 3, little-endian).
 *
 * The reader maps the file and validates every count, length, type, offset, alignment and
 * tensor size against the file before anything uses it; a bad file gives an error naming the
 * field and its byte offset, never a crash. Tensor data is not copied: loom_gguf_tensor_data
 * points into the mapping, so weights can be used in place.
 */
#ifndef LOOM_CORE_GGUF_H
#define LOOM_CORE_GGUF_H

#include "name_index.h"

#include <loom/backend.h>
#include <stddef.h>
#include <stdint.h>

/* Metadata value types, as GGUF numbers them. */
typedef enum loom_gguf_type {
    LOOM_GGUF_UINT8 = 0,
    LOOM_GGUF_INT8 = 1,
    LOOM_GGUF_UINT16 = 2,
    LOOM_GGUF_INT16 = 3,
    LOOM_GGUF_UINT32 = 4,
    LOOM_GGUF_INT32 = 5,
    LOOM_GGUF_FLOAT32 = 6,
    LOOM_GGUF_BOOL = 7,
    LOOM_GGUF_STRING = 8,
    LOOM_GGUF_ARRAY = 9,
    LOOM_GGUF_UINT64 = 10,
    LOOM_GGUF_INT64 = 11,
    LOOM_GGUF_FLOAT64 = 12,
} loom_gguf_type;

typedef struct loom_gguf_kv {
    char *key;
    loom_gguf_type type;
    loom_gguf_type array_type; /* arrays only */
    uint64_t count;            /* arrays: elements; otherwise 1 */
    uint64_t offset;           /* file offset of the value (arrays: of the first element) */
    uint64_t *str_offsets;     /* string arrays: file offset of each element's length field */
} loom_gguf_kv;

typedef struct loom_gguf_tensor {
    char *name;
    uint32_t n_dims;
    int64_t ne[4];   /* innermost first; unused dims are 1 */
    uint32_t type;   /* GGML type id; a loom_dtype when loom supports it */
    uint64_t offset; /* absolute file offset of the data */
    uint64_t size;   /* bytes */
} loom_gguf_tensor;

typedef struct loom_gguf {
    const unsigned char *map;
    uint64_t size;
    uint32_t version;
    uint64_t n_kv, n_tensors;
    loom_gguf_kv *kv;
    loom_gguf_tensor *tensors;
    uint32_t alignment;
    uint64_t data_offset;
    int mapped;                             /* map is ours to unmap (loom_gguf_open) */
    loom_name_index kv_index, tensor_index; /* key / name -> position */
} loom_gguf;

/* Opens and validates path. Returns 0, or -1 with err naming what is wrong and where. A file
 * whose tensor data runs past its end is an error that says the file looks truncated. */
int loom_gguf_open(loom_gguf *g, const char *path, char *err, size_t err_size);
/* The same on bytes in memory (for tests and fuzzing); the bytes must outlive g. Call
 * loom_gguf_close afterwards whether it succeeded or not. */
int loom_gguf_parse(loom_gguf *g, const void *data, uint64_t size, const char *name, char *err,
                    size_t err_size);
/* Lets the mapped file's pages in [offset, offset + size) go from memory (whole pages inside
 * it; they are read again if touched). Nothing for a file not mapped by loom_gguf_open. */
void loom_gguf_release_pages(const loom_gguf *g, uint64_t offset, uint64_t size);
/* Frees what open or parse made (and unmaps a file open mapped). */
void loom_gguf_close(loom_gguf *g);

const loom_gguf_kv *loom_gguf_find(const loom_gguf *g, const char *key);
const loom_gguf_tensor *loom_gguf_find_tensor(const loom_gguf *g, const char *name);
const void *loom_gguf_tensor_data(const loom_gguf *g, const loom_gguf_tensor *t);

/* Typed reads; integer types convert to each other when the value fits. Return 0 when the key
 * exists with a compatible type, -1 otherwise (out untouched). */
int loom_gguf_get_i64(const loom_gguf *g, const char *key, int64_t *out);
int loom_gguf_get_f64(const loom_gguf *g, const char *key, double *out);
int loom_gguf_get_bool(const loom_gguf *g, const char *key, int *out);
/* A string value: pointer into the file (not NUL-terminated) and its length. */
int loom_gguf_get_str(const loom_gguf *g, const char *key, const char **s, uint64_t *len);
/* Element i of an array: strings and numbers. */
int loom_gguf_array_str(const loom_gguf *g, const loom_gguf_kv *kv, uint64_t i, const char **s,
                        uint64_t *len);
int loom_gguf_array_f64(const loom_gguf *g, const loom_gguf_kv *kv, uint64_t i, double *out);

const char *loom_gguf_type_name(loom_gguf_type t);
/* GGML tensor types: name, elements per block and bytes per block (0 when unknown). */
const char *loom_ggml_type_name(uint32_t type);
int loom_ggml_type_size(uint32_t type, int64_t *block_elems, int64_t *block_bytes);

/* ---- Checksums ------------------------------------------------------------------------- */

/* Every file loom_gguf_write writes carries one XXH3-64 per tensor, of its data bytes, in tensor
 * order (other readers ignore `loom.` keys), so that `loom verify` can say which tensor a
 * damaged file lost. */
#define LOOM_GGUF_CHECKSUM_ALGORITHM_KEY "loom.checksum.algorithm"
#define LOOM_GGUF_CHECKSUM_ALGORITHM "xxh3-64"
#define LOOM_GGUF_CHECKSUM_KEY "loom.checksum.tensors"
uint64_t loom_gguf_checksum(const void *data, uint64_t size);
/* Recomputes every tensor's checksum: the number that differ from the stored ones (*first: the
 * first of them), -2 when the file stores none, -1 when they are malformed (another algorithm,
 * or a count that is not the tensors'). */
int64_t loom_gguf_check_checksums(const loom_gguf *g, uint64_t *first);

/* ---- Writing --------------------------------------------------------------------------- */

typedef struct loom_gguf_writer loom_gguf_writer;

loom_gguf_writer *loom_gguf_writer_create(void);
void loom_gguf_writer_free(loom_gguf_writer *w);
/* Metadata, in the order added. Strings and arrays are copied. */
int loom_gguf_set_u32(loom_gguf_writer *w, const char *key, uint32_t v);
int loom_gguf_set_i32(loom_gguf_writer *w, const char *key, int32_t v);
int loom_gguf_set_f32(loom_gguf_writer *w, const char *key, float v);
int loom_gguf_set_bool(loom_gguf_writer *w, const char *key, int v);
int loom_gguf_set_str(loom_gguf_writer *w, const char *key, const char *v);
int loom_gguf_set_str_array(loom_gguf_writer *w, const char *key, const char *const *v, uint64_t n);
int loom_gguf_set_f32_array(loom_gguf_writer *w, const char *key, const float *v, uint64_t n);
int loom_gguf_set_i32_array(loom_gguf_writer *w, const char *key, const int32_t *v, uint64_t n);
int loom_gguf_set_u8_array(loom_gguf_writer *w, const char *key, const uint8_t *v, uint64_t n);
/* Copies a metadata entry of an open file, whatever its type. */
int loom_gguf_copy_kv(loom_gguf_writer *w, const loom_gguf *g, const loom_gguf_kv *kv);
/* A tensor; data (size bytes for its type and shape) must stay valid until write. */
int loom_gguf_add_tensor(loom_gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                         const int64_t *ne, const void *data);
/* Writes the file (version 3, alignment 32) with fresh tensor checksums (replacing any the
 * metadata copied from another file). Returns 0, or -1 with err. */
int loom_gguf_write(loom_gguf_writer *w, const char *path, char *err, size_t err_size);

#endif
