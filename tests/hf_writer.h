/*
 * tests/hf_writer.h - writing Hugging Face folders in tests: a safetensors writer (tensors
 * appended in order, offsets 8-aligned), text files, and links to fixture files. Used to
 * rewrite a fixture's weights into another family's form.
 */
#ifndef LOOM_TESTS_HF_WRITER_H
#define LOOM_TESTS_HF_WRITER_H

#include "core/safetensors.h"

#include "check.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <sys/stat.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>


typedef struct st_out {
    cJSON *header;
    unsigned char *data;
    size_t n, cap;
} st_out;

static inline void st_add(st_out *o, const char *name, const char *dtype, int n_dims,
                          const int64_t *shape, const void *bytes, size_t size)
{
    size_t at = (o->n + 7) & ~(size_t)7;
    if (at + size > o->cap) {
        o->cap = (at + size) * 2;
        o->data = realloc(o->data, o->cap);
    }
    memset(o->data + o->n, 0, at - o->n);
    memcpy(o->data + at, bytes, size);
    o->n = at + size;
    cJSON *t = cJSON_AddObjectToObject(o->header, name);
    cJSON_AddStringToObject(t, "dtype", dtype);
    cJSON *s = cJSON_AddArrayToObject(t, "shape");
    for (int i = 0; i < n_dims; i++)
        cJSON_AddItemToArray(s, cJSON_CreateNumber((double)shape[i]));
    cJSON *off = cJSON_AddArrayToObject(t, "data_offsets");
    cJSON_AddItemToArray(off, cJSON_CreateNumber((double)at));
    cJSON_AddItemToArray(off, cJSON_CreateNumber((double)(at + size)));
}

/* Copies a source tensor under a new name. */
static inline void st_copy(st_out *o, const loom_safetensors *src, const char *from, const char *to)
{
    const loom_st_tensor *t = loom_safetensors_find(src, from);
    CHECK(t != NULL, "the source weights have no %s", from);
    if (t)
        st_add(o, to, t->dtype, t->n_dims, t->shape, t->data, t->size);
}

static inline int st_write(st_out *o, const char *path)
{
    char *json = cJSON_PrintUnformatted(o->header);
    size_t len = strlen(json), padded = (len + 7) & ~(size_t)7;
    FILE *f = fopen(path, "wb");
    int ok = f != NULL;
    if (f) {
        unsigned char le[8];
        for (int i = 0; i < 8; i++)
            le[i] = (unsigned char)((uint64_t)padded >> (8 * i));
        ok = fwrite(le, 1, 8, f) == 8 && fwrite(json, 1, len, f) == len;
        for (size_t i = len; ok && i < padded; i++)
            ok = fputc(' ', f) != EOF;
        ok = ok && fwrite(o->data, 1, o->n, f) == o->n;
        ok = fclose(f) == 0 && ok;
    }
    free(json);
    cJSON_Delete(o->header);
    free(o->data);
    memset(o, 0, sizeof *o);
    return ok ? 0 : -1;
}

static inline void write_text(const char *folder, const char *name, const char *text)
{
    char p[4400];
    snprintf(p, sizeof p, "%s/%s", folder, name);
    FILE *f = fopen(p, "w");
    CHECK(f && fputs(text, f) >= 0 && fclose(f) == 0, "writing %s", p);
}

/* A link to target (made absolute: the fixtures may be named relative to here) */
static inline void link_file(const char *folder, const char *name, const char *target)
{
    char p[4400], abs[4096];
    snprintf(p, sizeof p, "%s/%s", folder, name);
    CHECK(realpath(target, abs) && symlink(abs, p) == 0, "symlink %s to %s", p, target);
}

/* A folder a test wrote, with the files (or links) in it */
/* A folder of the given files of fixture (in fixtures folder dir), linked, the last n_shared of them linked to the
 * shared tokenizer files `shared` instead (the fixture names them by relative links, which a
 * copy of the fixtures may hold as files of their paths). */
static inline int fixture_folder(const char *dir, const char *folder, const char *fixture,
                                 const char *const *files, int n_files, const char *const *shared,
                                 int n_shared)
{
    if (mkdir(folder, 0700) != 0)
        return -1;
    char from[4300], to[4300], abs[4096];
    for (int i = 0; i < n_files; i++) {
        if (i >= n_files - n_shared)
            snprintf(from, sizeof from, "%s/%s", dir, shared[i - (n_files - n_shared)]);
        else
            snprintf(from, sizeof from, "%s/%s/%s", dir, fixture, files[i]);
        snprintf(to, sizeof to, "%s/%s", folder, files[i]);
        if (!realpath(from, abs) || symlink(abs, to) != 0)
            return -1;
    }
    return 0;
}

static inline void remove_folder(const char *folder)
{
    DIR *d = opendir(folder);
    struct dirent *e;
    char p[4096 + 512]; /* a folder path and a file name (NAME_MAX 255) */
    while (d && (e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
            snprintf(p, sizeof p, "%s/%s", folder, e->d_name);
            unlink(p);
        }
    if (d)
        closedir(d);
    rmdir(folder);
}

#endif
