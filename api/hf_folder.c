/*
 * api/hf_folder.c - reading a Hugging Face folder's JSON files, and the converter's errors.
 */
#define _GNU_SOURCE
#include "hf_folder.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int conv_fail(conv *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, c->err_size, fmt, ap);
    va_end(ap);
    return -1;
}

char *loom_strf(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char *s = NULL;
    if (vasprintf(&s, fmt, ap) < 0)
        s = NULL;
    va_end(ap);
    return s;
}

cJSON *conv_read_json(const char *dir, const char *name, int required, conv *c)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f) {
        if (required)
            conv_fail(c, "%s: %s (is this a Hugging Face model folder?)", path, strerror(errno));
        return NULL;
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = n >= 0 && n < (64L << 20) ? malloc((size_t)n + 1) : NULL;
    cJSON *j = NULL;
    if (text && fread(text, 1, (size_t)n, f) == (size_t)n) {
        text[n] = '\0';
        j = cJSON_Parse(text);
    }
    free(text);
    fclose(f);
    if (!j && required)
        conv_fail(c, "%s: not valid JSON", path);
    return j;
}
