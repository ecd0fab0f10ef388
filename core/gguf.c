/*
 * core/gguf.c - GGUF reading and writing; see gguf.h.
 *
 * Layout (little-endian): "GGUF", version u32, tensor count u64, metadata count u64; metadata
 * as (key string, type u32, value); tensor infos as (name string, n_dims u32, dims u64[n_dims],
 * type u32, offset u64 relative to the data section); padding to general.alignment (default
 * 32); the data section. Strings are a u64 length and that many bytes, not NUL-terminated.
 *
 * Invariant of the reader: every read goes through `cursor`, which checks it against the end
 * of the file first; every size is computed with overflow checks before it is compared.
 */
#define _GNU_SOURCE
#include "gguf.h"

#include "file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#define GGUF_MAGIC 0x46554747u /* "GGUF" */
#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_DIMS 4
/* no sane file has more; they keep a corrupt count from turning into a huge allocation */
#define GGUF_MAX_KV (1u << 20)
#define GGUF_MAX_TENSORS (1u << 24)
#define GGUF_MAX_KEY 65535

/* ---- Types ------------------------------------------------------------------------------- */

const char *loom_gguf_type_name(loom_gguf_type t)
{
    static const char *names[] = {"u8",   "i8",     "u16",   "i16", "u32", "i32", "f32",
                                  "bool", "string", "array", "u64", "i64", "f64"};
    return (unsigned)t < sizeof names / sizeof names[0] ? names[t] : "unknown";
}

static uint64_t scalar_size(loom_gguf_type t)
{
    switch (t) {
    case LOOM_GGUF_UINT8:
    case LOOM_GGUF_INT8:
    case LOOM_GGUF_BOOL: return 1;
    case LOOM_GGUF_UINT16:
    case LOOM_GGUF_INT16: return 2;
    case LOOM_GGUF_UINT32:
    case LOOM_GGUF_INT32:
    case LOOM_GGUF_FLOAT32: return 4;
    case LOOM_GGUF_UINT64:
    case LOOM_GGUF_INT64:
    case LOOM_GGUF_FLOAT64: return 8;
    default: return 0;
    }
}

/* GGML's tensor types (the ids GGUF files use): name, block elements, block bytes. */
static const struct {
    uint32_t id;
    const char *name;
    int64_t elems, bytes;
} ggml_types[] = {
    {0, "f32", 1, 4},       {1, "f16", 1, 2},       {2, "q4_0", 32, 18},
    {3, "q4_1", 32, 20},    {6, "q5_0", 32, 22},    {7, "q5_1", 32, 24},
    {8, "q8_0", 32, 34},    {9, "q8_1", 32, 36},    {10, "q2_K", 256, 84},
    {11, "q3_K", 256, 110}, {12, "q4_K", 256, 144}, {13, "q5_K", 256, 176},
    {14, "q6_K", 256, 210}, {15, "q8_K", 256, 292}, {24, "i8", 1, 1},
    {25, "i16", 1, 2},      {20, "iq4_nl", 32, 18}, {23, "iq4_xs", 256, 136},
    {26, "i32", 1, 4},      {27, "i64", 1, 8},      {28, "f64", 1, 8},
    {30, "bf16", 1, 2},
};

int loom_ggml_type_size(uint32_t type, int64_t *block_elems, int64_t *block_bytes)
{
    for (size_t i = 0; i < sizeof ggml_types / sizeof ggml_types[0]; i++)
        if (ggml_types[i].id == type) {
            *block_elems = ggml_types[i].elems;
            *block_bytes = ggml_types[i].bytes;
            return 0;
        }
    return -1;
}

const char *loom_ggml_type_name(uint32_t type)
{
    for (size_t i = 0; i < sizeof ggml_types / sizeof ggml_types[0]; i++)
        if (ggml_types[i].id == type)
            return ggml_types[i].name;
    return "unknown";
}

/* ---- Reading ----------------------------------------------------------------------------- */

typedef struct cursor {
    const unsigned char *p;
    uint64_t size, pos;
    const char *name; /* the file, for messages */
    char *err;
    size_t err_size;
} cursor;

static int fail_at(cursor *c, uint64_t at, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(c->err, c->err_size, "%s: at byte %llu: %s", c->name, (unsigned long long)at, msg);
    return -1;
}

static int need(cursor *c, uint64_t n, const char *what)
{
    if (n > c->size - c->pos)
        return fail_at(c, c->pos,
                       "%s needs %llu bytes but the file ends %llu bytes later "
                       "(truncated or corrupt)",
                       what, (unsigned long long)n, (unsigned long long)(c->size - c->pos));
    return 0;
}

static int rd(cursor *c, void *out, uint64_t n, const char *what)
{
    if (need(c, n, what))
        return -1;
    memcpy(out, c->p + c->pos, n);
    c->pos += n;
    return 0;
}

static int rd_u32(cursor *c, uint32_t *v, const char *what)
{
    return rd(c, v, 4, what);
}

static int rd_u64(cursor *c, uint64_t *v, const char *what)
{
    return rd(c, v, 8, what);
}

/* A string: returns its bytes' offset and length, checked to lie inside the file. */
static int rd_str(cursor *c, uint64_t *off, uint64_t *len, const char *what)
{
    uint64_t at = c->pos;
    if (rd_u64(c, len, what))
        return -1;
    if (*len > c->size - c->pos)
        return fail_at(c, at, "%s claims %llu bytes, more than the %llu left in the file", what,
                       (unsigned long long)*len, (unsigned long long)(c->size - c->pos));
    *off = c->pos;
    c->pos += *len;
    return 0;
}

static char *dup_str(cursor *c, uint64_t off, uint64_t len)
{
    char *s = malloc(len + 1);
    if (s) {
        memcpy(s, c->p + off, len);
        s[len] = '\0';
    }
    return s;
}

/* Walks one value of type t (scalar, string or array) and records it in kv. */
static int rd_value(cursor *c, loom_gguf_kv *kv, const char *key)
{
    char what[128];
    snprintf(what, sizeof what, "value of '%.80s'", key);
    kv->count = 1;
    kv->offset = c->pos;
    if (kv->type == LOOM_GGUF_STRING) {
        uint64_t off, len;
        return rd_str(c, &off, &len, what);
    }
    if (kv->type != LOOM_GGUF_ARRAY) {
        uint64_t n = scalar_size(kv->type);
        if (!n)
            return fail_at(c, c->pos - 4, "'%.80s' has value type %u, which GGUF does not define",
                           key, (unsigned)kv->type);
        return need(c, n, what) ? -1 : (c->pos += n, 0);
    }
    uint32_t at;
    uint64_t type_pos = c->pos;
    if (rd_u32(c, &at, what) || rd_u64(c, &kv->count, what))
        return -1;
    kv->array_type = (loom_gguf_type)at;
    kv->offset = c->pos;
    if (at == LOOM_GGUF_STRING) {
        /* each element at least 8 bytes: bound the count before allocating for it */
        if (kv->count > (c->size - c->pos) / 8)
            return fail_at(c, type_pos,
                           "array '%.80s' claims %llu strings, more than the file "
                           "can hold",
                           key, (unsigned long long)kv->count);
        kv->str_offsets = malloc((kv->count ? kv->count : 1) * sizeof *kv->str_offsets);
        if (!kv->str_offsets)
            return fail_at(c, type_pos, "out of memory for array '%.80s'", key);
        for (uint64_t i = 0; i < kv->count; i++) {
            uint64_t off, len;
            kv->str_offsets[i] = c->pos;
            if (rd_str(c, &off, &len, what))
                return -1;
        }
        return 0;
    }
    uint64_t es = scalar_size((loom_gguf_type)at);
    if (!es)
        return fail_at(c, type_pos,
                       "array '%.80s' has element type %u; GGUF allows no nested "
                       "arrays or unknown types",
                       key, at);
    if (kv->count > (c->size - c->pos) / es)
        return fail_at(c, type_pos,
                       "array '%.80s' claims %llu elements of %llu bytes, more than "
                       "the file holds",
                       key, (unsigned long long)kv->count, (unsigned long long)es);
    c->pos += kv->count * es;
    return 0;
}

void loom_gguf_close(loom_gguf *g)
{
    if (g->mapped && g->map)
        munmap((void *)g->map, (size_t)g->size);
    for (uint64_t i = 0; g->kv && i < g->n_kv; i++) {
        free(g->kv[i].key);
        free(g->kv[i].str_offsets);
    }
    for (uint64_t i = 0; g->tensors && i < g->n_tensors; i++)
        free(g->tensors[i].name);
    free(g->kv);
    free(g->tensors);
    loom_name_index_free(&g->kv_index);
    loom_name_index_free(&g->tensor_index);
    memset(g, 0, sizeof *g);
}

int loom_gguf_parse(loom_gguf *g, const void *data, uint64_t size, const char *name, char *err,
                    size_t err_size)
{
    memset(g, 0, sizeof *g);
    g->map = data;
    g->size = size;
    cursor c = {data, size, 0, name, err, err_size};
    uint32_t magic;
    if (rd_u32(&c, &magic, "the magic number"))
        return -1;
    if (magic != GGUF_MAGIC)
        return fail_at(&c, 0, "not a GGUF file (magic 0x%08x, want \"GGUF\")", magic);
    if (rd_u32(&c, &g->version, "the version"))
        return -1;
    if (g->version != 2 && g->version != 3)
        return fail_at(&c, 4, "GGUF version %u; loom reads versions 2 and 3%s", g->version,
                       g->version == 1 ? " (convert version 1 files with a newer tool)" : "");
    uint64_t n_tensors, n_kv;
    if (rd_u64(&c, &n_tensors, "the tensor count") || rd_u64(&c, &n_kv, "the metadata count"))
        return -1;
    if (n_tensors > GGUF_MAX_TENSORS)
        return fail_at(&c, 8, "tensor count %llu is absurd", (unsigned long long)n_tensors);
    if (n_kv > GGUF_MAX_KV)
        return fail_at(&c, 16, "metadata count %llu is absurd", (unsigned long long)n_kv);

    g->kv = calloc(n_kv ? n_kv : 1, sizeof *g->kv);
    g->tensors = calloc(n_tensors ? n_tensors : 1, sizeof *g->tensors);
    if (!g->kv || !g->tensors)
        return fail_at(&c, c.pos, "out of memory");
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    for (uint64_t i = 0; i < n_kv; i++) {
        loom_gguf_kv *kv = &g->kv[i];
        g->n_kv = i + 1; /* so close frees what was made so far */
        uint64_t key_at = c.pos, off, len;
        char what[64];
        snprintf(what, sizeof what, "metadata key %llu", (unsigned long long)i);
        if (rd_str(&c, &off, &len, what))
            return -1;
        if (len == 0 || len > GGUF_MAX_KEY || memchr(c.p + off, 0, len))
            return fail_at(&c, key_at, "%s is empty, too long or contains NUL", what);
        if (!(kv->key = dup_str(&c, off, len)))
            return fail_at(&c, key_at, "out of memory");
        int added = loom_name_index_add(&g->kv_index, kv->key, (int64_t)i);
        if (added < 0)
            return fail_at(&c, key_at, "out of memory");
        if (added > 0)
            return fail_at(&c, key_at, "metadata key '%.80s' appears twice", kv->key);
        uint32_t type;
        if (rd_u32(&c, &type, "a metadata value type"))
            return -1;
        kv->type = (loom_gguf_type)type;
        if (rd_value(&c, kv, kv->key))
            return -1;
    }
    const loom_gguf_kv *al = loom_gguf_find(g, "general.alignment");
    if (al) {
        int64_t a;
        /* the format asks for a multiple of 8: less would place f32 (and block) data at
         * addresses the backends may not load from */
        if (loom_gguf_get_i64(g, "general.alignment", &a) || a < 8 || a > 65536 || (a & (a - 1)))
            return fail_at(&c, al->offset,
                           "general.alignment must be a power of two from 8 to 65536");
        g->alignment = (uint32_t)a;
    }

    for (uint64_t i = 0; i < n_tensors; i++) {
        loom_gguf_tensor *t = &g->tensors[i];
        g->n_tensors = i + 1;
        uint64_t at = c.pos, off, len;
        char what[64];
        snprintf(what, sizeof what, "tensor %llu's name", (unsigned long long)i);
        if (rd_str(&c, &off, &len, what))
            return -1;
        if (len == 0 || len > 4096 || memchr(c.p + off, 0, len))
            return fail_at(&c, at, "%s is empty, too long or contains NUL", what);
        if (!(t->name = dup_str(&c, off, len)))
            return fail_at(&c, at, "out of memory");
        uint64_t dims_at = c.pos;
        if (rd_u32(&c, &t->n_dims, "a tensor's dimension count"))
            return -1;
        if (t->n_dims == 0 || t->n_dims > GGUF_MAX_DIMS)
            return fail_at(&c, dims_at, "tensor '%.80s' has %u dimensions (1 to 4 allowed)",
                           t->name, t->n_dims);
        uint64_t elems = 1;
        for (int d = 0; d < 4; d++)
            t->ne[d] = 1;
        for (uint32_t d = 0; d < t->n_dims; d++) {
            uint64_t ne;
            if (rd_u64(&c, &ne, "a tensor dimension"))
                return -1;
            if (ne == 0 || ne > (1ull << 40) || elems > UINT64_MAX / ne)
                return fail_at(&c, c.pos - 8, "tensor '%.80s' dimension %u is %llu", t->name, d,
                               (unsigned long long)ne);
            t->ne[d] = (int64_t)ne;
            elems *= ne;
        }
        uint64_t type_at = c.pos, rel;
        if (rd_u32(&c, &t->type, "a tensor type") || rd_u64(&c, &rel, "a tensor offset"))
            return -1;
        int64_t be, bb;
        if (loom_ggml_type_size(t->type, &be, &bb))
            return fail_at(&c, type_at, "tensor '%.80s' has type %u, which loom does not know",
                           t->name, t->type);
        if (t->ne[0] % be)
            return fail_at(&c, dims_at,
                           "tensor '%.80s': rows of %lld elements are not whole "
                           "%s blocks of %lld",
                           t->name, (long long)t->ne[0], loom_ggml_type_name(t->type),
                           (long long)be);
        if (elems / (uint64_t)be > UINT64_MAX / (uint64_t)bb)
            return fail_at(&c, dims_at, "tensor '%.80s' is larger than any file can hold", t->name);
        t->size = elems / (uint64_t)be * (uint64_t)bb;
        if (rel % g->alignment)
            return fail_at(&c, type_at + 4,
                           "tensor '%.80s' offset %llu is not a multiple of the "
                           "alignment %u",
                           t->name, (unsigned long long)rel, g->alignment);
        t->offset = rel; /* made absolute below, once the data section is known */
        int added = loom_name_index_add(&g->tensor_index, t->name, (int64_t)i);
        if (added < 0)
            return fail_at(&c, at, "out of memory");
        if (added > 0)
            return fail_at(&c, at, "tensor '%.80s' appears twice", t->name);
    }
    g->data_offset = (c.pos + g->alignment - 1) / g->alignment * g->alignment;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        loom_gguf_tensor *t = &g->tensors[i];
        uint64_t rel = t->offset;
        if (rel > UINT64_MAX - g->data_offset || t->size > UINT64_MAX - g->data_offset - rel ||
            g->data_offset + rel + t->size > size)
            return fail_at(&c, g->data_offset,
                           "tensor '%.80s' needs bytes up to %llu but the file has %llu: the file "
                           "is truncated (an incomplete download?)",
                           t->name, (unsigned long long)(g->data_offset + rel + t->size),
                           (unsigned long long)size);
        t->offset = g->data_offset + rel;
    }
    return 0;
}

int loom_gguf_open(loom_gguf *g, const char *path, char *err, size_t err_size)
{
    memset(g, 0, sizeof *g);
    struct stat st;
    int fd = loom_file_open(path, &st, err, err_size);
    if (fd < 0)
        return -1;
    if (st.st_size == 0) {
        snprintf(err, err_size, "%s: the file is empty", path);
        close(fd);
        return -1;
    }
    void *map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED) {
        snprintf(err, err_size, "%s: cannot map it: %s", path, strerror(errno));
        return -1;
    }
    int rc = loom_gguf_parse(g, map, (uint64_t)st.st_size, path, err, err_size);
    g->mapped = 1;
    if (rc != 0)
        loom_gguf_close(g);
    return rc;
}

void loom_gguf_release_pages(const loom_gguf *g, uint64_t offset, uint64_t size)
{
    long page = sysconf(_SC_PAGESIZE);
    if (!g->mapped || page <= 0 || offset > g->size || size > g->size - offset)
        return;
    uintptr_t start = (uintptr_t)(g->map + offset), end = start + size;
    start = (start + (uintptr_t)page - 1) & ~(uintptr_t)(page - 1);
    end &= ~(uintptr_t)(page - 1);
    if (end > start) /* a private read-only mapping: the pages are re-read from the file if used */
        madvise((void *)start, end - start, MADV_DONTNEED);
}

const loom_gguf_kv *loom_gguf_find(const loom_gguf *g, const char *key)
{
    int64_t i = loom_name_index_find(&g->kv_index, key);
    return i >= 0 ? &g->kv[i] : NULL;
}

const loom_gguf_tensor *loom_gguf_find_tensor(const loom_gguf *g, const char *name)
{
    int64_t i = loom_name_index_find(&g->tensor_index, name);
    return i >= 0 ? &g->tensors[i] : NULL;
}

const void *loom_gguf_tensor_data(const loom_gguf *g, const loom_gguf_tensor *t)
{
    return g->map + t->offset;
}

/* A number of type t at p, widened; returns 0 for numeric types. */
static int read_number(loom_gguf_type t, const unsigned char *p, int64_t *i, double *f)
{
    union {
        uint8_t u8;
        int8_t i8;
        uint16_t u16;
        int16_t i16;
        uint32_t u32;
        int32_t i32;
        float f32;
        uint64_t u64;
        int64_t i64;
        double f64;
    } v;
    uint64_t n = scalar_size(t);
    if (!n || t == LOOM_GGUF_STRING || t == LOOM_GGUF_ARRAY)
        return -1;
    memcpy(&v, p, n);
    switch (t) {
    case LOOM_GGUF_UINT8:
    case LOOM_GGUF_BOOL:
        *i = v.u8;
        *f = v.u8;
        break;
    case LOOM_GGUF_INT8:
        *i = v.i8;
        *f = v.i8;
        break;
    case LOOM_GGUF_UINT16:
        *i = v.u16;
        *f = v.u16;
        break;
    case LOOM_GGUF_INT16:
        *i = v.i16;
        *f = v.i16;
        break;
    case LOOM_GGUF_UINT32:
        *i = v.u32;
        *f = v.u32;
        break;
    case LOOM_GGUF_INT32:
        *i = v.i32;
        *f = v.i32;
        break;
    case LOOM_GGUF_UINT64:
        if (v.u64 > INT64_MAX)
            return -1;
        *i = (int64_t)v.u64;
        *f = (double)v.u64;
        break;
    case LOOM_GGUF_INT64:
        *i = v.i64;
        *f = (double)v.i64;
        break;
    /* 1: not an integer (and no conversion: a float past INT64_MAX has no int64 value) */
    case LOOM_GGUF_FLOAT32:
        *f = v.f32;
        *i = 0;
        return 1;
    case LOOM_GGUF_FLOAT64:
        *f = v.f64;
        *i = 0;
        return 1;
    default: return -1;
    }
    return 0;
}

int loom_gguf_get_i64(const loom_gguf *g, const char *key, int64_t *out)
{
    const loom_gguf_kv *kv = loom_gguf_find(g, key);
    int64_t i;
    double f;
    if (!kv || kv->type == LOOM_GGUF_BOOL ||
        read_number(kv->type, g->map + kv->offset, &i, &f) != 0)
        return -1;
    *out = i;
    return 0;
}

int loom_gguf_get_f64(const loom_gguf *g, const char *key, double *out)
{
    const loom_gguf_kv *kv = loom_gguf_find(g, key);
    int64_t i;
    double f;
    if (!kv || kv->type == LOOM_GGUF_BOOL || read_number(kv->type, g->map + kv->offset, &i, &f) < 0)
        return -1;
    *out = f;
    return 0;
}

int loom_gguf_get_bool(const loom_gguf *g, const char *key, int *out)
{
    const loom_gguf_kv *kv = loom_gguf_find(g, key);
    if (!kv || kv->type != LOOM_GGUF_BOOL)
        return -1;
    *out = g->map[kv->offset] != 0;
    return 0;
}

static void str_at(const loom_gguf *g, uint64_t at, const char **s, uint64_t *len)
{
    memcpy(len, g->map + at, 8);
    *s = (const char *)g->map + at + 8;
}

int loom_gguf_get_str(const loom_gguf *g, const char *key, const char **s, uint64_t *len)
{
    const loom_gguf_kv *kv = loom_gguf_find(g, key);
    if (!kv || kv->type != LOOM_GGUF_STRING)
        return -1;
    str_at(g, kv->offset, s, len);
    return 0;
}

int loom_gguf_array_str(const loom_gguf *g, const loom_gguf_kv *kv, uint64_t i, const char **s,
                        uint64_t *len)
{
    if (kv->type != LOOM_GGUF_ARRAY || kv->array_type != LOOM_GGUF_STRING || i >= kv->count)
        return -1;
    str_at(g, kv->str_offsets[i], s, len);
    return 0;
}

int loom_gguf_array_f64(const loom_gguf *g, const loom_gguf_kv *kv, uint64_t i, double *out)
{
    int64_t iv;
    if (kv->type != LOOM_GGUF_ARRAY || i >= kv->count)
        return -1;
    uint64_t es = scalar_size(kv->array_type);
    if (!es || read_number(kv->array_type, g->map + kv->offset + i * es, &iv, out) < 0)
        return -1;
    return 0;
}

/* ---- Checksums ---------------------------------------------------------------------------- */

uint64_t loom_gguf_checksum(const void *data, uint64_t size)
{
    return XXH3_64bits(data, (size_t)size);
}


/* 1 with *kv the stored sums, 0 when there are none, -1 when malformed */
static int stored_checksums(const loom_gguf *g, const loom_gguf_kv **kv)
{
    *kv = loom_gguf_find(g, LOOM_GGUF_CHECKSUM_KEY);
    if (!*kv)
        return 0;
    const char *algo;
    uint64_t len;
    if (loom_gguf_get_str(g, LOOM_GGUF_CHECKSUM_ALGORITHM_KEY, &algo, &len) != 0 ||
        len != strlen(LOOM_GGUF_CHECKSUM_ALGORITHM) ||
        memcmp(algo, LOOM_GGUF_CHECKSUM_ALGORITHM, len) != 0 || (*kv)->type != LOOM_GGUF_ARRAY ||
        (*kv)->array_type != LOOM_GGUF_UINT64 || (*kv)->count != g->n_tensors)
        return -1;
    return 1;
}

int64_t loom_gguf_check_checksums(const loom_gguf *g, uint64_t *first)
{
    const loom_gguf_kv *kv;
    int has = stored_checksums(g, &kv);
    if (has <= 0)
        return has == 0 ? -2 : -1;
    int64_t bad = 0;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const loom_gguf_tensor *t = &g->tensors[i];
        uint64_t stored;
        memcpy(&stored, g->map + kv->offset + 8 * i, 8);
        if (loom_gguf_checksum(g->map + t->offset, t->size) != stored && !bad++)
            *first = i;
    }
    return bad;
}

/* ---- Writing ------------------------------------------------------------------------------ */

typedef struct wkv {
    char *key;
    loom_gguf_type type, array_type;
    uint64_t count;
    unsigned char *bytes; /* the value as written after the type (for arrays: after type+count) */
    uint64_t n_bytes;
} wkv;

typedef struct wtensor {
    char *name;
    uint32_t type, n_dims;
    int64_t ne[4];
    const void *data;
    uint64_t size;
} wtensor;

struct loom_gguf_writer {
    wkv *kv;
    uint64_t n_kv;
    wtensor *t;
    uint64_t n_t;
};

loom_gguf_writer *loom_gguf_writer_create(void)
{
    return calloc(1, sizeof(loom_gguf_writer));
}

void loom_gguf_writer_free(loom_gguf_writer *w)
{
    if (!w)
        return;
    for (uint64_t i = 0; i < w->n_kv; i++)
        free(w->kv[i].key), free(w->kv[i].bytes);
    for (uint64_t i = 0; i < w->n_t; i++)
        free(w->t[i].name);
    free(w->kv);
    free(w->t);
    free(w);
}

static int add_kv(loom_gguf_writer *w, const char *key, loom_gguf_type type,
                  loom_gguf_type array_type, uint64_t count, const void *bytes, uint64_t n)
{
    wkv *grown = realloc(w->kv, (w->n_kv + 1) * sizeof *grown);
    if (!grown)
        return -1;
    w->kv = grown;
    wkv *kv = &w->kv[w->n_kv];
    memset(kv, 0, sizeof *kv);
    kv->key = strdup(key);
    kv->bytes = malloc(n ? n : 1);
    if (!kv->key || !kv->bytes) {
        free(kv->key), free(kv->bytes);
        return -1;
    }
    if (n)
        memcpy(kv->bytes, bytes, n);
    kv->n_bytes = n;
    kv->type = type;
    kv->array_type = array_type;
    kv->count = count;
    w->n_kv++;
    return 0;
}

int loom_gguf_set_u32(loom_gguf_writer *w, const char *key, uint32_t v)
{
    return add_kv(w, key, LOOM_GGUF_UINT32, 0, 1, &v, 4);
}

int loom_gguf_set_i32(loom_gguf_writer *w, const char *key, int32_t v)
{
    return add_kv(w, key, LOOM_GGUF_INT32, 0, 1, &v, 4);
}

int loom_gguf_set_f32(loom_gguf_writer *w, const char *key, float v)
{
    return add_kv(w, key, LOOM_GGUF_FLOAT32, 0, 1, &v, 4);
}

int loom_gguf_set_bool(loom_gguf_writer *w, const char *key, int v)
{
    uint8_t b = v != 0;
    return add_kv(w, key, LOOM_GGUF_BOOL, 0, 1, &b, 1);
}

/* u64 length + bytes, appended to buf */
static unsigned char *put_str(unsigned char *buf, const char *s)
{
    uint64_t len = strlen(s);
    memcpy(buf, &len, 8);
    memcpy(buf + 8, s, len);
    return buf + 8 + len;
}

int loom_gguf_set_str(loom_gguf_writer *w, const char *key, const char *v)
{
    uint64_t n = 8 + strlen(v);
    unsigned char *b = malloc(n);
    if (!b)
        return -1;
    put_str(b, v);
    int rc = add_kv(w, key, LOOM_GGUF_STRING, 0, 1, b, n);
    free(b);
    return rc;
}

int loom_gguf_set_str_array(loom_gguf_writer *w, const char *key, const char *const *v, uint64_t n)
{
    uint64_t total = 0;
    for (uint64_t i = 0; i < n; i++)
        total += 8 + strlen(v[i]);
    unsigned char *b = malloc(total ? total : 1), *p = b;
    if (!b)
        return -1;
    for (uint64_t i = 0; i < n; i++)
        p = put_str(p, v[i]);
    int rc = add_kv(w, key, LOOM_GGUF_ARRAY, LOOM_GGUF_STRING, n, b, total);
    free(b);
    return rc;
}

int loom_gguf_set_f32_array(loom_gguf_writer *w, const char *key, const float *v, uint64_t n)
{
    return add_kv(w, key, LOOM_GGUF_ARRAY, LOOM_GGUF_FLOAT32, n, v, n * 4);
}

int loom_gguf_set_i32_array(loom_gguf_writer *w, const char *key, const int32_t *v, uint64_t n)
{
    return add_kv(w, key, LOOM_GGUF_ARRAY, LOOM_GGUF_INT32, n, v, n * 4);
}

int loom_gguf_set_u8_array(loom_gguf_writer *w, const char *key, const uint8_t *v, uint64_t n)
{
    return add_kv(w, key, LOOM_GGUF_ARRAY, LOOM_GGUF_UINT8, n, v, n);
}

int loom_gguf_add_tensor(loom_gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                         const int64_t *ne, const void *data)
{
    int64_t be, bb;
    if (n_dims == 0 || n_dims > 4 || loom_ggml_type_size(type, &be, &bb) || ne[0] % be)
        return -1;
    uint64_t elems = 1;
    for (uint32_t d = 0; d < n_dims; d++)
        elems *= (uint64_t)ne[d];
    wtensor *grown = realloc(w->t, (w->n_t + 1) * sizeof *grown);
    if (!grown)
        return -1;
    w->t = grown;
    wtensor *t = &w->t[w->n_t];
    memset(t, 0, sizeof *t);
    if (!(t->name = strdup(name)))
        return -1;
    t->type = type;
    t->n_dims = n_dims;
    for (int d = 0; d < 4; d++)
        t->ne[d] = d < (int)n_dims ? ne[d] : 1;
    t->data = data;
    t->size = elems / (uint64_t)be * (uint64_t)bb;
    w->n_t++;
    return 0;
}

static int put(FILE *f, const void *p, uint64_t n)
{
    return n == 0 || fwrite(p, 1, n, f) == n ? 0 : -1;
}

static int pad(FILE *f, uint64_t *pos, uint32_t alignment)
{
    static const unsigned char zeros[64];
    uint64_t want = (*pos + alignment - 1) / alignment * alignment;
    while (*pos < want) {
        uint64_t n = want - *pos < sizeof zeros ? want - *pos : sizeof zeros;
        if (put(f, zeros, n))
            return -1;
        *pos += n;
    }
    return 0;
}

/* Drops the checksum keys a copied header brought and adds this file's. */
static int add_checksums(loom_gguf_writer *w)
{
    uint64_t kept = 0;
    for (uint64_t i = 0; i < w->n_kv; i++) {
        if (!strcmp(w->kv[i].key, LOOM_GGUF_CHECKSUM_KEY) ||
            !strcmp(w->kv[i].key, LOOM_GGUF_CHECKSUM_ALGORITHM_KEY)) {
            free(w->kv[i].key), free(w->kv[i].bytes);
            continue;
        }
        w->kv[kept++] = w->kv[i];
    }
    w->n_kv = kept;
    uint64_t *sums = malloc((w->n_t ? w->n_t : 1) * sizeof *sums);
    if (!sums)
        return -1;
    for (uint64_t i = 0; i < w->n_t; i++)
        sums[i] = loom_gguf_checksum(w->t[i].data, w->t[i].size);
    int rc = loom_gguf_set_str(w, LOOM_GGUF_CHECKSUM_ALGORITHM_KEY, LOOM_GGUF_CHECKSUM_ALGORITHM) |
        add_kv(w, LOOM_GGUF_CHECKSUM_KEY, LOOM_GGUF_ARRAY, LOOM_GGUF_UINT64, w->n_t, sums,
               w->n_t * 8);
    free(sums);
    return rc;
}

int loom_gguf_write(loom_gguf_writer *w, const char *path, char *err, size_t err_size)
{
    const uint32_t alignment = GGUF_DEFAULT_ALIGNMENT;
    if (add_checksums(w) != 0) {
        snprintf(err, err_size, "out of memory");
        return -1;
    }
    FILE *f = fopen(path, "wb");
    if (!f) {
        snprintf(err, err_size, "%s: %s", path, strerror(errno));
        return -1;
    }
    uint32_t magic = GGUF_MAGIC, version = 3;
    uint64_t pos = 24, n_t = w->n_t, n_kv = w->n_kv;
    int rc = put(f, &magic, 4) | put(f, &version, 4) | put(f, &n_t, 8) | put(f, &n_kv, 8);
    for (uint64_t i = 0; i < w->n_kv && !rc; i++) {
        wkv *kv = &w->kv[i];
        uint64_t klen = strlen(kv->key);
        uint32_t type = kv->type, at = kv->array_type;
        rc |= put(f, &klen, 8) | put(f, kv->key, klen) | put(f, &type, 4);
        pos += 8 + klen + 4;
        if (kv->type == LOOM_GGUF_ARRAY) {
            rc |= put(f, &at, 4) | put(f, &kv->count, 8);
            pos += 12;
        }
        rc |= put(f, kv->bytes, kv->n_bytes);
        pos += kv->n_bytes;
    }
    uint64_t data_pos = 0;
    for (uint64_t i = 0; i < w->n_t && !rc; i++) {
        wtensor *t = &w->t[i];
        uint64_t nlen = strlen(t->name);
        rc |= put(f, &nlen, 8) | put(f, t->name, nlen) | put(f, &t->n_dims, 4);
        for (uint32_t d = 0; d < t->n_dims; d++) {
            uint64_t ne = (uint64_t)t->ne[d];
            rc |= put(f, &ne, 8);
        }
        rc |= put(f, &t->type, 4) | put(f, &data_pos, 8);
        pos += 8 + nlen + 4 + 8 * (uint64_t)t->n_dims + 12;
        data_pos = (data_pos + t->size + alignment - 1) / alignment * alignment;
    }
    rc |= pad(f, &pos, alignment);
    for (uint64_t i = 0; i < w->n_t && !rc; i++) {
        rc |= put(f, w->t[i].data, w->t[i].size);
        pos += w->t[i].size;
        if (i + 1 < w->n_t)
            rc |= pad(f, &pos, alignment);
    }
    rc |= fclose(f);
    if (rc) {
        snprintf(err, err_size, "%s: write failed: %s", path, strerror(errno));
        unlink(path);
        return -1;
    }
    return 0;
}

int loom_gguf_copy_kv(loom_gguf_writer *w, const loom_gguf *g, const loom_gguf_kv *kv)
{
    const unsigned char *p = g->map + kv->offset;
    uint64_t n;
    if (kv->type == LOOM_GGUF_STRING) {
        memcpy(&n, p, 8);
        n += 8;
    } else if (kv->type != LOOM_GGUF_ARRAY) {
        n = scalar_size(kv->type);
    } else if (kv->array_type == LOOM_GGUF_STRING) {
        if (kv->count == 0) {
            n = 0;
        } else {
            uint64_t last = kv->str_offsets[kv->count - 1], len;
            memcpy(&len, g->map + last, 8);
            n = last + 8 + len - kv->offset;
        }
    } else {
        n = kv->count * scalar_size(kv->array_type);
    }
    return add_kv(w, kv->key, kv->type, kv->array_type, kv->count, p, n);
}
