/*
 * files/hf_folder.c - reading a Hugging Face folder's JSON files, and the converter's errors.
 */
#define _GNU_SOURCE
#include "files/hf_folder.h"

#include "core/file.h"
#include "core/tokenizer.h"

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
    loom_text_printable(c->err); /* it may quote a folder's tokens or keys */
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

int conv_read_json(conv *c, const char *name, int required, cJSON **out)
{
    char path[4096], why[4200];
    snprintf(path, sizeof path, "%s/%s", c->dir, name);
    *out = NULL;
    char *text = loom_file_read(path, 64u << 20, NULL, why, sizeof why);
    if (!text && errno == ENOENT && !required)
        return 0;
    if (!text)
        /* an optional file that is there but cannot be read (a FIFO, a device, too big) is an
         * error too: the folder is not what it claims to be */
        return conv_fail(c, "%s%s", why,
                         errno == ENOENT ? " (is this a Hugging Face model folder?)" : "");
    *out = cJSON_Parse(text);
    free(text);
    if (!*out)
        return conv_fail(c, "%s: not valid JSON", path);
    return 0;
}
