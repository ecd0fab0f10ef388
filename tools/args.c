/*
 * tools/args.c - see args.h.
 */
#define _POSIX_C_SOURCE 200809L
#include "args.h"

#include <loom/loom.h>

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int loom_arg_long(const char *cmd, const char *flag, const char *v, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long x = v ? strtol(v, &end, 10) : 0;
    if (!v || !*v || *end || errno || x < lo || x > hi) {
        fprintf(stderr, "%s: %s wants a whole number from %ld to %ld, not '%s'\n", cmd, flag, lo,
                hi, v ? v : "(nothing)");
        return -1;
    }
    *out = x;
    return 0;
}

int loom_arg_float(const char *cmd, const char *flag, const char *v, double lo, double hi,
                   float *out)
{
    char *end;
    double x = v ? strtod(v, &end) : 0;
    if (!v || !*v || *end || !isfinite(x) || x < lo || x > hi) {
        fprintf(stderr, "%s: %s wants a number from %g to %g, not '%s'\n", cmd, flag, lo, hi,
                v ? v : "(nothing)");
        return -1;
    }
    *out = (float)x;
    return 0;
}

char *loom_arg_text_file(const char *cmd, const char *flag, const char *path, size_t *len)
{
    FILE *f = strcmp(path, "-") == 0 ? stdin : fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "%s: %s %s: %s\n", cmd, flag, path, strerror(errno));
        return NULL;
    }
    char *text = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (cap - n < 65536) {
            char *grown = cap < ((size_t)1 << 34) ? realloc(text, cap * 2 + 65536) : NULL;
            if (!grown) {
                fprintf(stderr, "%s: %s %s: too large to read into memory\n", cmd, flag, path);
                free(text);
                text = NULL;
                break;
            }
            text = grown, cap = cap * 2 + 65536;
        }
        size_t got = fread(text + n, 1, cap - n - 1, f);
        n += got;
        if (got == 0)
            break;
    }
    if (text && ferror(f)) {
        fprintf(stderr, "%s: %s %s: %s\n", cmd, flag, path, strerror(errno));
        free(text);
        text = NULL;
    }
    if (f != stdin)
        fclose(f);
    const char *nul = text ? memchr(text, '\0', n) : NULL;
    if (nul) {
        fprintf(stderr, "%s: %s %s: a NUL byte at offset %zu; the text must not contain any\n",
                cmd, flag, path, (size_t)(nul - text));
        free(text);
        return NULL;
    }
    if (text)
        text[n] = '\0', *len = n;
    return text;
}

double loom_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

void loom_print_text(FILE *out, const char *text, size_t len)
{
    size_t n;
    char *valid = loom_utf8_sanitize(text, len, &n);
    fwrite(valid ? valid : text, 1, valid ? n : len, out);
    free(valid);
    fflush(out);
}

int loom_arg_file_json(const char *cmd, const char *what, int argc, char **argv,
                       const char **path, int *json)
{
    *path = NULL;
    *json = 0;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0)
            *json = 1;
        else if (argv[i][0] == '-' || *path) {
            fprintf(stderr, "loom %s: unexpected argument '%s' (usage: loom %s %s [--json])\n",
                    cmd, argv[i], cmd, what);
            return 2;
        } else
            *path = argv[i];
    }
    if (!*path) {
        fprintf(stderr, "loom %s: which %s? (usage: loom %s %s [--json])\n", cmd,
                strcmp(what, "MODEL") == 0 ? "model" : "file", cmd, what);
        return 2;
    }
    return 0;
}
