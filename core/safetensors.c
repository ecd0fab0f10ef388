/*
 * core/safetensors.c - see safetensors.h.
 *
 * A file is an 8-byte little-endian header length N, N bytes of JSON mapping each tensor name
 * to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the byte after the
 * header), an optional "__metadata__" object, then the data.
 */
#define _GNU_SOURCE
#include "safetensors.h"

#include "file.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static int fail(char *err, size_t n, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, n, fmt, ap);
    va_end(ap);
    return -1;
}

static int element_size(const char *dtype, int *loom_type)
{
    static const struct {
        const char *name;
        int size, loom;
    } types[] = {
        {"F32", 4, LOOM_F32}, {"F16", 2, LOOM_F16}, {"BF16", 2, LOOM_BF16}, {"F64", 8, -1},
        {"I64", 8, -1},       {"I32", 4, -1},       {"I16", 2, -1},         {"I8", 1, -1},
        {"U8", 1, -1},        {"BOOL", 1, -1},
    };
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (strcmp(dtype, types[i].name) == 0) {
            *loom_type = types[i].loom;
            return types[i].size;
        }
    return 0;
}

static int map_file(const char *path, loom_st_file *f, char *err, size_t n)
{
    struct stat st;
    int fd = loom_file_open(path, &st, err, n);
    if (fd < 0)
        return -1;
    if (st.st_size < 8) {
        close(fd);
        return fail(err, n, "%s: not a safetensors file (too short)", path);
    }
    void *map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED)
        return fail(err, n, "%s: cannot map it: %s", path, strerror(errno));
    f->path = strdup(path);
    f->map = map;
    f->size = (uint64_t)st.st_size;
    return f->path ? 0 : fail(err, n, "out of memory");
}

typedef struct span_of {
    const unsigned char *start;
    int tensor;
} span_of;

static int by_start(const void *x, const void *y)
{
    const span_of *a = x, *b = y;
    return a->start < b->start ? -1 : a->start > b->start;
}

/* Two tensors of one file sharing bytes (every one at offset 0, say) would each read the
 * other's weights: refused, as Hugging Face's reader refuses them. Tensors first.. are one
 * file's. */
static int check_overlap(loom_safetensors *st, int first, char *err, size_t n)
{
    int count = st->n_tensors - first, rc = 0;
    span_of *order = malloc((size_t)(count ? count : 1) * sizeof *order);
    if (!order)
        return fail(err, n, "out of memory");
    for (int i = 0; i < count; i++)
        order[i] = (span_of){st->tensors[first + i].data, first + i};
    qsort(order, (size_t)count, sizeof *order, by_start);
    const loom_st_tensor *prev = NULL;
    for (int i = 0; i < count && rc == 0; i++) {
        const loom_st_tensor *t = &st->tensors[order[i].tensor];
        if (!t->size)
            continue;
        if (prev && t->data < prev->data + prev->size)
            rc = fail(err, n,
                      "%s: tensors '%s' and '%s' share bytes of the data section (their "
                      "data_offsets overlap): the file is corrupt",
                      st->files[t->file].path, prev->name, t->name);
        prev = t;
    }
    free(order);
    return rc;
}

/* Adds the tensors of file index fi (only `only`, when not NULL, with the names the index
 * assigns to this file). */
static int read_header(loom_safetensors *st, int fi, char *err, size_t n)
{
    loom_st_file *f = &st->files[fi];
    uint64_t hlen;
    memcpy(&hlen, f->map, 8);
    if (hlen > f->size - 8 || hlen > (100u << 20))
        return fail(err, n,
                    "%s: header length %llu does not fit a %llu-byte file (truncated or "
                    "not safetensors)",
                    f->path, (unsigned long long)hlen, (unsigned long long)f->size);
    cJSON *root = cJSON_ParseWithLength((const char *)f->map + 8, (size_t)hlen);
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return fail(err, n, "%s: the header is not a JSON object", f->path);
    }
    uint64_t data_size = f->size - 8 - hlen;
    const unsigned char *data = f->map + 8 + hlen;
    int rc = 0, first = st->n_tensors;
    for (cJSON *e = root->child; e && rc == 0; e = e->next) {
        if (strcmp(e->string, "__metadata__") == 0)
            continue;
        cJSON *dt = cJSON_GetObjectItem(e, "dtype"), *shape = cJSON_GetObjectItem(e, "shape");
        cJSON *offs = cJSON_GetObjectItem(e, "data_offsets");
        if (!cJSON_IsString(dt) || !cJSON_IsArray(shape) || !cJSON_IsArray(offs) ||
            cJSON_GetArraySize(offs) != 2) {
            rc = fail(err, n, "%s: tensor '%s' lacks dtype, shape or data_offsets", f->path,
                      e->string);
            break;
        }
        loom_st_tensor t = {0};
        int es = element_size(dt->valuestring, &t.loom_type);
        if (!es) {
            rc = fail(err, n, "%s: tensor '%s' has unknown dtype '%s'", f->path, e->string,
                      dt->valuestring);
            break;
        }
        snprintf(t.dtype, sizeof t.dtype, "%s", dt->valuestring);
        t.n_dims = cJSON_GetArraySize(shape);
        if (t.n_dims > LOOM_ST_MAX_DIMS) {
            rc = fail(err, n, "%s: tensor '%s' has %d dimensions", f->path, e->string, t.n_dims);
            break;
        }
        uint64_t elems = 1;
        for (int d = 0; d < t.n_dims && rc == 0; d++) {
            cJSON *v = cJSON_GetArrayItem(shape, d);
            double x = cJSON_IsNumber(v) ? v->valuedouble : -1;
            if (x < 0 || x > 9.0e15 || x != (double)(int64_t)x ||
                (x > 0 && elems > UINT64_MAX / (uint64_t)x))
                rc = fail(err, n, "%s: tensor '%s' has a bad shape entry", f->path, e->string);
            else {
                t.shape[d] = (int64_t)x;
                elems *= (uint64_t)x;
            }
        }
        double b = cJSON_GetArrayItem(offs, 0)->valuedouble;
        double end = cJSON_GetArrayItem(offs, 1)->valuedouble;
        if (rc == 0 && (b < 0 || end < b || end > (double)data_size))
            rc = fail(err, n,
                      "%s: tensor '%s' spans bytes [%.0f, %.0f) but the data section has "
                      "%llu: the file is truncated or corrupt",
                      f->path, e->string, b, end, (unsigned long long)data_size);
        if (rc == 0 && elems > UINT64_MAX / (uint64_t)es)
            rc = fail(err, n, "%s: tensor '%s' is larger than any file can hold", f->path,
                      e->string);
        if (rc == 0 && (uint64_t)(end - b) != elems * (uint64_t)es)
            rc = fail(err, n, "%s: tensor '%s' has %.0f bytes, but its shape and dtype need %llu",
                      f->path, e->string, end - b, (unsigned long long)(elems * (uint64_t)es));
        if (rc)
            break;
        t.data = data + (uint64_t)b;
        t.size = (uint64_t)(end - b);
        t.file = fi;
        if (loom_safetensors_find(st, e->string)) {
            rc = fail(err, n, "%s: tensor '%s' appears twice", f->path, e->string);
            break;
        }
        if (st->n_tensors == st->cap_tensors) {
            int cap = st->cap_tensors ? 2 * st->cap_tensors : 256;
            loom_st_tensor *grown = cap > st->cap_tensors
                ? realloc(st->tensors, (size_t)cap * sizeof *grown)
                : NULL;
            if (!grown) {
                rc = fail(err, n, "out of memory");
                break;
            }
            st->tensors = grown, st->cap_tensors = cap;
        }
        if (!(t.name = strdup(e->string)) ||
            loom_name_index_add(&st->index, t.name, st->n_tensors) < 0) {
            free(t.name);
            rc = fail(err, n, "out of memory");
            break;
        }
        st->tensors[st->n_tensors++] = t;
    }
    cJSON_Delete(root);
    return rc ? rc : check_overlap(st, first, err, n);
}

static int add_file(loom_safetensors *st, const char *path, char *err, size_t n)
{
    for (int i = 0; i < st->n_files; i++)
        if (strcmp(st->files[i].path, path) == 0)
            return 0;
    loom_st_file *grown = realloc(st->files, (size_t)(st->n_files + 1) * sizeof *grown);
    if (!grown)
        return fail(err, n, "out of memory");
    st->files = grown;
    memset(&st->files[st->n_files], 0, sizeof *grown);
    if (map_file(path, &st->files[st->n_files], err, n))
        return -1;
    st->n_files++;
    return read_header(st, st->n_files - 1, err, n);
}

/* The shards an index names, each opened once. */
static int open_index(loom_safetensors *st, const char *index, char *err, size_t n)
{
    char *text = loom_file_read(index, 64u << 20, NULL, err, n);
    if (!text)
        return -1;
    cJSON *root = cJSON_Parse(text);
    free(text);
    cJSON *map = cJSON_GetObjectItem(root, "weight_map");
    if (!cJSON_IsObject(map)) {
        cJSON_Delete(root);
        return fail(err, n, "%s: no \"weight_map\" object", index);
    }
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", index);
    char *slash = strrchr(dir, '/');
    if (slash)
        *slash = '\0';
    else
        strcpy(dir, ".");
    int rc = 0;
    for (cJSON *e = map->child; e && rc == 0; e = e->next) {
        if (!cJSON_IsString(e) || strchr(e->valuestring, '/')) {
            rc = fail(err, n, "%s: weight_map entry '%s' is not a file name in the folder", index,
                      e->string);
            break;
        }
        char path[8192];
        snprintf(path, sizeof path, "%s/%s", dir, e->valuestring);
        rc = add_file(st, path, err, n);
    }
    /* every tensor the index names must be in the shard it names */
    for (cJSON *e = map->child; e && rc == 0; e = e->next) {
        const loom_st_tensor *t = loom_safetensors_find(st, e->string);
        if (!t)
            rc = fail(err, n, "%s: names tensor '%s', which no shard holds", index, e->string);
    }
    cJSON_Delete(root);
    return rc;
}

int loom_safetensors_open(loom_safetensors *st, const char *path, char *err, size_t n)
{
    memset(st, 0, sizeof *st);
    struct stat s;
    if (stat(path, &s) != 0)
        return fail(err, n, "%s: %s", path, strerror(errno));
    int rc;
    size_t len = strlen(path);
    if (S_ISDIR(s.st_mode)) {
        char p[4096];
        snprintf(p, sizeof p, "%s/model.safetensors.index.json", path);
        if (access(p, R_OK) == 0) {
            rc = open_index(st, p, err, n);
        } else {
            snprintf(p, sizeof p, "%s/model.safetensors", path);
            if (access(p, R_OK) != 0) {
                rc = fail(err, n,
                          "%s: no model.safetensors or model.safetensors.index.json in "
                          "this folder (loom reads safetensors weights, not .bin or .pt)",
                          path);
            } else {
                rc = add_file(st, p, err, n);
            }
        }
    } else if (len > 5 && strcmp(path + len - 5, ".json") == 0) {
        rc = open_index(st, path, err, n);
    } else {
        rc = add_file(st, path, err, n);
    }
    if (rc)
        loom_safetensors_close(st);
    return rc;
}

void loom_safetensors_close(loom_safetensors *st)
{
    for (int i = 0; i < st->n_tensors; i++)
        free(st->tensors[i].name);
    for (int i = 0; i < st->n_files; i++) {
        if (st->files[i].map)
            munmap((void *)st->files[i].map, (size_t)st->files[i].size);
        free(st->files[i].path);
    }
    free(st->tensors);
    free(st->files);
    loom_name_index_free(&st->index);
    memset(st, 0, sizeof *st);
}

const loom_st_tensor *loom_safetensors_find(const loom_safetensors *st, const char *name)
{
    int64_t i = loom_name_index_find(&st->index, name);
    return i >= 0 ? &st->tensors[i] : NULL;
}
