/*
 * tools/args.c - see args.h.
 */
#define _POSIX_C_SOURCE 200809L
#include "args.h"

#include <loom/loom.h>

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* 0 with *out set, or -1 after printing the error to stderr (v may be NULL: missing). */
static int arg_long(const char *cmd, const char *flag, const char *v, long lo, long hi, long *out)
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

static int arg_float(const char *cmd, const char *flag, const char *v, double lo, double hi,
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

/* The sampling flags: name, another spelling, what the value is (f: float, i: int32, u: the
 * seed), its range, the field it sets, and its help. */
static const struct sampling_flag {
    const char *flag, *alias;
    char kind;
    double lo, hi;
    size_t field;
    const char *help;
} sampling_flags[] = {
/* the list's rows (a SEED goes up to LONG_MAX, which a double cannot hold); a row without a
 * flag has none here */
#define FLAG_KIND_FLOAT 'f'
#define FLAG_KIND_INT 'i'
#define FLAG_KIND_SEED 'u'
#define FLAG_KIND_BOOL 'b'
#define FLAG(kind, name, def, api_def, flag, alias, lo, hi, json, jlo, jhi, role, help)            \
    {flag, alias, FLAG_KIND_##kind, lo, hi, offsetof(loom_sampling, name), help},
    LOOM_SAMPLING_FIELDS(FLAG)
#undef FLAG
};

/* 1 when flag is a sampling flag (value v parsed into *s), 0 when it is not one, -1 after
 * printing why v is wrong for it. */
static int arg_sampling(const char *cmd, const char *flag, const char *v, loom_sampling *s)
{
    for (size_t i = 0; i < sizeof sampling_flags / sizeof sampling_flags[0]; i++) {
        const struct sampling_flag *f = &sampling_flags[i];
        if (!f->flag || (strcmp(flag, f->flag) != 0 && (!f->alias || strcmp(flag, f->alias) != 0)))
            continue;
        void *field = (char *)s + f->field;
        long x;
        if (f->kind == 'f')
            return arg_float(cmd, flag, v, f->lo, f->hi, field) ? -1 : 1;
        if (arg_long(cmd, flag, v, (long)f->lo, f->kind == 'u' ? LONG_MAX : (long)f->hi, &x))
            return -1;
        if (f->kind == 'i')
            *(int32_t *)field = (int32_t)x;
        else
            *(uint64_t *)field = (uint64_t)x;
        return 1;
    }
    return 0;
}

/* The sampling flags' usage lines, with the defaults in s. */
static void sampling_usage(FILE *out, const loom_sampling *s)
{
    for (size_t i = 0; i < sizeof sampling_flags / sizeof sampling_flags[0]; i++) {
        const struct sampling_flag *f = &sampling_flags[i];
        if (!f->flag)
            continue;
        const void *field = (const char *)s + f->field;
        char flag[64], def[32];
        snprintf(flag, sizeof flag, "%s %s", f->flag, f->kind == 'f' ? "X" : "N");
        if (f->kind == 'f')
            snprintf(def, sizeof def, "%g", *(const float *)field);
        else if (f->kind == 'i')
            snprintf(def, sizeof def, "%d", (int)*(const int32_t *)field);
        else
            snprintf(def, sizeof def, "%llu", (unsigned long long)*(const uint64_t *)field);
        fprintf(out, "  %-23s %s (default %s)\n", flag, f->help, def);
    }
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
        fprintf(stderr, "%s: %s %s: a NUL byte at offset %zu; the text must not contain any\n", cmd,
                flag, path, (size_t)(nul - text));
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

/* "-n N", "-m, --model FILE", "--json" */
static void flag_label(const loom_flag *f, char *buf, size_t n)
{
    snprintf(buf, n, "%s%s%s%s%s", f->name, f->alias ? ", " : "", f->alias ? f->alias : "",
             f->metavar ? " " : "", f->metavar ? f->metavar : "");
}

static void flags_usage(const loom_flag *flags, int n, FILE *out)
{
    for (int i = 0; i < n; i++) {
        if (!flags[i].help)
            continue;
        char label[96];
        flag_label(&flags[i], label, sizeof label);
        if (strlen(label) > 23)
            fprintf(out, "  %s\n  %-23s ", label, "");
        else
            fprintf(out, "  %-23s ", label);
        /* a help of several lines ('\n') continues under the first */
        for (const char *h = flags[i].help; *h;) {
            size_t len = strcspn(h, "\n");
            fprintf(out, "%.*s\n", (int)len, h);
            h += len;
            if (*h == '\n' && *++h)
                fprintf(out, "%26s", "");
        }
    }
}

void loom_args_usage(const loom_command *cmd, FILE *out)
{
    fprintf(out, "usage: %s %s\n", cmd->name, cmd->synopsis);
    flags_usage(cmd->flags, cmd->n_flags, out);
    if (cmd->sampling) {
        if (cmd->sampling_title)
            fprintf(out, "%s\n", cmd->sampling_title);
        sampling_usage(out, cmd->sampling);
    }
    if (cmd->more_flags) {
        if (cmd->more_title)
            fprintf(out, "%s\n", cmd->more_title);
        flags_usage(cmd->more_flags, cmd->n_more_flags, out);
    }
    if (cmd->epilogue)
        fprintf(out, "%s\n", cmd->epilogue);
}

/* Whether v is one of the '|'-separated choices. */
static int is_choice(const char *choices, const char *v)
{
    size_t n = strlen(v);
    for (const char *p = choices; *p; p += strcspn(p, "|"), p += *p == '|')
        if (strncmp(p, v, n) == 0 && (p[n] == '|' || p[n] == '\0') && n > 0)
            return 1;
    return 0;
}

static int usage_error(const loom_command *cmd)
{
    loom_args_usage(cmd, stderr);
    return 2;
}

static const loom_flag *find_flag(const loom_flag *flags, int n, const char *a)
{
    for (int k = 0; k < n; k++)
        if (!strcmp(a, flags[k].name) || (flags[k].alias && !strcmp(a, flags[k].alias)))
            return &flags[k];
    return NULL;
}

int loom_args_parse(const loom_command *cmd, int argc, char **argv)
{
    int given = 0;
    if (cmd->n_positional)
        *cmd->n_positional = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            loom_args_usage(cmd, stdout);
            return 1;
        }
        const loom_flag *f = find_flag(cmd->flags, cmd->n_flags, a);
        if (!f && cmd->more_flags)
            f = find_flag(cmd->more_flags, cmd->n_more_flags, a);
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!f && cmd->sampling && a[0] == '-') {
            int took = arg_sampling(cmd->name, a, v, cmd->sampling);
            if (took < 0)
                return 2;
            if (took > 0) {
                i++;
                continue;
            }
        }
        if (!f) {
            if (cmd->positional && given < cmd->max_positional && (a[0] != '-' || !a[1])) {
                cmd->positional[given++] = a;
                if (cmd->n_positional)
                    *cmd->n_positional = given;
                continue;
            }
            fprintf(stderr, "%s: %s '%s'\n", cmd->name,
                    a[0] == '-' ? "unknown option" : "unexpected argument", a);
            return usage_error(cmd);
        }
        if (f->kind == LOOM_FLAG_SWITCH) {
            *(int *)f->dest = 1;
            continue;
        }
        if (!v) {
            fprintf(stderr, "%s: %s needs a value (%s)\n", cmd->name, a, f->metavar);
            return usage_error(cmd);
        }
        i++;
        switch (f->kind) {
        case LOOM_FLAG_CHOICE:
            if (!is_choice(f->metavar, v)) {
                fprintf(stderr, "%s: %s is one of %s, not '%s'\n", cmd->name, a, f->metavar, v);
                return 2;
            }
            /* fall through */
        case LOOM_FLAG_TEXT: *(const char **)f->dest = v; break;
        case LOOM_FLAG_REPEAT: {
            loom_flag_list *list = f->dest;
            if (list->n == list->max) {
                fprintf(stderr, "%s: at most %d %s\n", cmd->name, list->max, a);
                return 2;
            }
            list->items[list->n++] = v;
            break;
        }
        case LOOM_FLAG_LONG:
            if (arg_long(cmd->name, a, v, (long)f->lo, (long)f->hi, f->dest))
                return 2;
            break;
        case LOOM_FLAG_FLOAT:
            if (arg_float(cmd->name, a, v, f->lo, f->hi, f->dest))
                return 2;
            break;
        case LOOM_FLAG_SWITCH: break;
        }
    }
    return 0;
}

int loom_arg_file_json(const char *cmd, const char *what, int argc, char **argv, const char **path,
                       int *json)
{
    char name[64], synopsis[64];
    snprintf(name, sizeof name, "loom %s", cmd);
    snprintf(synopsis, sizeof synopsis, "%s [--json]", what);
    *path = NULL;
    *json = 0;
    const loom_flag flags[] = {
        {"--json", NULL, LOOM_FLAG_SWITCH, json, 0, 0, NULL, "the report as JSON"},
    };
    const loom_command c = {.name = name,
                            .synopsis = synopsis,
                            .flags = flags,
                            .n_flags = LOOM_N_FLAGS(flags),
                            .positional = path,
                            .max_positional = 1};
    int parsed = loom_args_parse(&c, argc, argv);
    if (parsed)
        return parsed == 1 ? -1 : parsed;
    if (!*path) {
        fprintf(stderr, "%s: which %s? (usage: %s %s)\n", name,
                strcmp(what, "MODEL") == 0 ? "model" : "file", name, synopsis);
        return 2;
    }
    return 0;
}

loom_model_options loom_open_options(const loom_open_flags *f)
{
    loom_model_options o = {.n_ctx = (int32_t)f->n_ctx,
                            .kv_type = f->kv_type,
                            .n_threads = (int32_t)f->threads,
                            .distributed = f->distributed ? 2 : 1,
                            .stage_layers = f->layers,
                            .experts_on = f->experts_on};
    return o;
}

int loom_args_follow(const char *cmd, loom_model *m)
{
    char err[1024];
    int rc = loom_model_follow(m, err, sizeof err);
    if (rc == 0)
        return -1;
    if (rc < 0)
        fprintf(stderr, "%s: %s\n", cmd, err);
    loom_model_close(m);
    return rc < 0 ? 1 : 0;
}

int loom_spec_open(const char *cmd, const loom_spec_flags *f, const loom_open_flags *of,
                   loom_model *target, loom_speculation *spec, const loom_speculation **spec_out,
                   loom_model **drafter, char *what, size_t what_size)
{
    *spec_out = NULL, *drafter = NULL;
    snprintf(what, what_size, "none");
    int asked = !!f->draft + (f->draft_layers > 0) + (f->lookup > 0) + !!f->mtp;
    if (asked == 0) {
        if (f->draft_max || f->draft_min || f->fixed || f->draft_backend) {
            fprintf(stderr,
                    "%s: --draft-max, --draft-min, --draft-fixed and --draft-backend shape a "
                    "drafter: give one with --draft, --draft-layers, --draft-mtp or --lookup\n",
                    cmd);
            return 2;
        }
        return 0;
    }
    if (asked > 1) {
        fprintf(stderr, "%s: give one drafter: --draft, --draft-layers, --draft-mtp or --lookup\n",
                cmd);
        return 2;
    }
    if (f->draft_max && f->draft_min > f->draft_max) {
        fprintf(stderr, "%s: --draft-min %ld is above --draft-max %ld\n", cmd, f->draft_min,
                f->draft_max);
        return 2;
    }
    *spec = (loom_speculation){.lookup = (int32_t)f->lookup,
                               .draft_max = (int32_t)f->draft_max,
                               .draft_min = (int32_t)f->draft_min,
                               .p_min = f->p_min,
                               .fixed = f->fixed};
    if (f->lookup > 0) {
        if (f->draft_backend) {
            fprintf(stderr,
                    "%s: --draft-backend names a drafter model's backend; prompt "
                    "lookup has no model\n",
                    cmd);
            return 2;
        }
        snprintf(what, what_size, "prompt lookup of up to %ld tokens", f->lookup);
        *spec_out = spec;
        return 0;
    }
    loom_model_options o = loom_open_options(of);
    o.distributed = 0;
    o.n_ctx = loom_model_n_ctx(target);
    o.backend = f->draft_backend;
    o.first_layers = (int32_t)f->draft_layers;
    o.mtp = f->mtp;
    const char *path = f->draft ? f->draft : of->model;
    char err[2048];
    loom_model *d = loom_model_open(path, &o, err, sizeof err);
    if (!d) {
        fprintf(stderr, "%s: the drafter %s%s: %s\n", cmd,
                f->draft     ? ""
                    : f->mtp ? "(--draft-mtp) "
                             : "(--draft-layers) ",
                path, err);
        return 2;
    }
    spec->draft = d;
    if (loom_speculation_check(target, spec, err, sizeof err) != 0) {
        fprintf(stderr, "%s: the drafter %s: %s\n", cmd, path, err);
        loom_model_close(d);
        return 2;
    }
    if (f->draft)
        snprintf(what, what_size, "draft model %s on %s", path, loom_model_backend(d));
    else if (f->mtp)
        snprintf(what, what_size, "the model's multi-token-prediction block");
    else
        snprintf(what, what_size, "the model's first %ld layers", f->draft_layers);
    spec->draft = d;
    *drafter = d;
    *spec_out = spec;
    return 0;
}

void loom_spec_flag_table(loom_spec_flags *f, loom_flag *table)
{
    *f = (loom_spec_flags){.p_min = 0.75f};
    const loom_flag rows[LOOM_SPEC_FLAGS] = {
        {"--draft", NULL, LOOM_FLAG_TEXT, &f->draft, 0, 0, "MODEL",
         "a drafter model: the same vocabulary, smaller or more\n"
         "quantised (a model of the same family)"},
        {"--draft-layers", NULL, LOOM_FLAG_LONG, &f->draft_layers, 1, 4096, "K",
         "the drafter is the model's own first K layers"},
        {"--draft-mtp", NULL, LOOM_FLAG_SWITCH, &f->mtp, 0, 0, NULL,
         "the drafter is the model's own multi-token-prediction\n"
         "block (Qwen3.5, Qwen3-Next files that carry one)"},
        {"--lookup", NULL, LOOM_FLAG_LONG, &f->lookup, 1, 64, "N",
         "prompt lookup: the text's last N..2 tokens, found earlier,\n"
         "propose what followed them there"},
        {"--draft-max", NULL, LOOM_FLAG_LONG, &f->draft_max, 1, 64, "N",
         "tokens proposed per check at most (default 8)"},
        {"--draft-min", NULL, LOOM_FLAG_LONG, &f->draft_min, 1, 64, "N",
         "fewer proposed than this are not checked (default 1)"},
        {"--draft-p-min", NULL, LOOM_FLAG_FLOAT, &f->p_min, 0, 1, "P",
         "a drafter model stops at a token it gives less than P\n"
         "(default 0.75)"},
        {"--draft-backend", NULL, LOOM_FLAG_TEXT, &f->draft_backend, 0, 0, "NAME",
         "the drafter model's backend (default: chosen as the model's)"},
        {"--draft-fixed", NULL, LOOM_FLAG_SWITCH, &f->fixed, 0, 0, NULL,
         "always propose --draft-max (measuring; default: as many as\n"
         "the measured acceptance and costs say pay, maybe none)"},
    };
    memcpy(table, rows, sizeof rows);
}

int loom_open_generating(const char *cmd, const loom_open_flags *of, const loom_spec_flags *sf,
                         loom_model **m, loom_speculation *spec, const loom_speculation **spec_out,
                         loom_model **drafter, char *what, size_t what_size)
{
    char err[4096];
    loom_model_options o = loom_open_options(of);
    if (!(*m = loom_model_open(of->model, &o, err, sizeof err))) {
        fprintf(stderr, "%s: %s\n", cmd, err);
        return 2;
    }
    int followed = loom_args_follow(cmd, *m);
    if (followed >= 0)
        return followed;
    if (loom_spec_open(cmd, sf, of, *m, spec, spec_out, drafter, what, what_size) != 0) {
        loom_model_close(*m);
        return 2;
    }
    return -1;
}
