/*
 * chat/jinja.c - a Jinja interpreter for chat templates, one room: lexer, parser, evaluator.
 *
 * Why here: a model's own chat template (GGUF tokenizer.chat_template, tokenizer_config.json)
 * is a Jinja program, and no C library runs Jinja (Debian has none). It runs as Hugging Face's
 * apply_chat_template runs it, so a prompt is byte for byte what transformers builds: the
 * sandboxed, immutable environment with trim_blocks, lstrip_blocks and loop controls; tojson as
 * transformers defines it (json.dumps, ensure_ascii off, keys unsorted); raise_exception and
 * strftime_now as globals. tests/jinja.sh compares renders with Debian's python3-jinja2.
 *
 * The subset: {{ }}, {% %}, {# #} with '-' and '+' whitespace control; if/elif/else, for (with
 * unpacking, an if filter, else, loop.*, break, continue), set (names, namespace attributes,
 * blocks), macro with defaults, call/caller, filter blocks, generation (as a plain block);
 * Python's literals and operators, attribute and item access, slices; the tests, filters,
 * globals and str/dict methods templates use (tables below). Anything else is an error at
 * parse or render time naming it; the caller then falls back to a built-in format.
 *
 * Invariants: every value of one render lives in its arena, freed at once at the end (errors
 * unwind by longjmp to jinja_render); the arena, the output, the steps and the nesting depth
 * are bounded (jinja_limits). Strings carry the byte ranges that came from untrusted values
 * ("taint"), kept exactly through concatenation, slicing and strip, and widened to the whole
 * string by any other transformation; the output records them as spans.
 */
#define _GNU_SOURCE
#include "chat/jinja.h"

#include <ctype.h>
#include <limits.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <utf8proc.h>

/* ---- arena -------------------------------------------------------------------------------- */

typedef struct ablock {
    struct ablock *next;
    size_t used, cap;
    _Alignas(16) unsigned char data[];
} ablock;

typedef struct arena {
    ablock *head;
    size_t total, limit;
    jmp_buf *fail; /* where an exhausted arena jumps (render); NULL: return NULL (parse) */
    int exhausted; /* an allocation returned NULL: a parse that saw one has failed */
    char *err;
    size_t err_size;
} arena;

static void *aalloc(arena *a, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    if (!a->head || a->head->cap - a->head->used < n) {
        size_t cap = n > 65536 ? n : 65536;
        if (a->limit && a->total + cap > a->limit) {
            if (a->fail) {
                snprintf(a->err, a->err_size,
                         "the template used more than %zu MiB of memory (a loop or string that "
                         "never ends?)",
                         a->limit >> 20);
                longjmp(*a->fail, 1);
            }
            a->exhausted = 1;
            return NULL;
        }
        ablock *b = malloc(sizeof *b + cap);
        if (!b) {
            if (a->fail) {
                snprintf(a->err, a->err_size, "out of memory rendering the template");
                longjmp(*a->fail, 1);
            }
            a->exhausted = 1;
            return NULL;
        }
        b->next = a->head, b->used = 0, b->cap = cap;
        a->head = b;
        a->total += cap;
    }
    void *p = a->head->data + a->head->used;
    a->head->used += n;
    return p;
}

static void arena_free(arena *a)
{
    for (ablock *b = a->head, *next; b; b = next) {
        next = b->next;
        free(b);
    }
    a->head = NULL;
    a->total = 0;
}

/* ---- values ------------------------------------------------------------------------------- */

typedef struct taint {
    size_t start, end;
} taint;

typedef struct jstr {
    size_t len;
    int n_taint;
    taint *taint; /* sorted, disjoint, within [0, len) */
    int markup;   /* a Markup (|safe, |escape): '+' escapes a plain operand, as Python does */
    char s[];     /* NUL-terminated */
} jstr;

enum { V_UNDEF, V_NONE, V_BOOL, V_INT, V_FLOAT, V_STR, V_LIST, V_DICT, V_MACRO, V_FUNC };

struct jlist;
struct jdict;
struct node;

typedef struct jv {
    int t;
    union {
        int b;
        int64_t i;
        double f;
        jstr *s;
        struct jlist *l;
        struct jdict *d;
        struct jmacro *m;
        const char *fn; /* V_FUNC: a global function's name */
    };
} jv;

/* a macro, or a call block's caller, with the scope it was defined in */
typedef struct jmacro {
    const struct node *def;
    struct frame *scope;
} jmacro;

typedef struct jlist {
    int n, cap;
    int tuple; /* repr as (a, b) */
    int gen;   /* what map, select, reject and reverse return: a Python generator, always true,
                * without length or JSON (|list makes it a list) */
    jv *v;
} jlist;

typedef struct jdict {
    int n, cap;
    int ns; /* a namespace(): its attributes may be set */
    jstr **k;
    jv *v;
    int *slots; /* past DICT_LINEAR keys: an index k -> i + 1 (0 empty), 2 x cap slots */
} jdict;

/* keys looked up by a walk up to this many, by a hash index past it (a client's JSON object
 * of 78,000 keys cost seconds of quadratic lookups) */
#define DICT_LINEAR 8

static const jv undef = {.t = V_UNDEF};
static const jv none_v = {.t = V_NONE};

/* ---- the render's state ------------------------------------------------------------------- */

typedef struct frame {
    struct frame *up;
    int n, cap;
    const char **names;
    jv *vals;
} frame;

typedef struct obuf { /* a text being rendered, with its tainted ranges */
    char *s;
    size_t n, cap;
    taint *t;
    int nt, capt;
} obuf;

typedef struct render {
    arena a;
    jmp_buf fail;
    char *err;
    size_t err_size;
    jinja_limits lim;
    long steps;    /* units of work: an expression, a loop turn, an item compared, 64 bytes read */
    long clock_at; /* steps at which the clock is read next */
    double deadline; /* CLOCK_MONOTONIC seconds the render must end by */
    int depth;
    obuf *out;
    frame *root;
    int loop_ctl; /* 1: break, 2: continue */
    int line;     /* of the node being run, for errors */
} render;

static _Noreturn void rfail(render *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static _Noreturn void rfail(render *r, const char *fmt, ...)
{
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (r->line > 0)
        snprintf(r->err, r->err_size, "template line %d: %s", r->line, msg);
    else
        snprintf(r->err, r->err_size, "%s", msg);
    longjmp(r->fail, 1);
}

/* ---- strings ------------------------------------------------------------------------------ */

static jstr *str_new(render *r, const char *s, size_t n)
{
    jstr *j = aalloc(&r->a, sizeof *j + n + 1);
    j->len = n, j->n_taint = 0, j->taint = NULL, j->markup = 0;
    if (n)
        memcpy(j->s, s, n);
    j->s[n] = 0;
    return j;
}

static jstr *str_c(render *r, const char *s)
{
    return str_new(r, s, strlen(s));
}

static jv vstr(jstr *s)
{
    return (jv){.t = V_STR, .s = s};
}
static jv vint(int64_t i)
{
    return (jv){.t = V_INT, .i = i};
}
static jv vfloat(double f)
{
    return (jv){.t = V_FLOAT, .f = f};
}
static jv vbool(int b)
{
    return (jv){.t = V_BOOL, .b = !!b};
}

static void str_taint_all(render *r, jstr *s)
{
    if (!s->len)
        return;
    s->taint = aalloc(&r->a, sizeof *s->taint);
    s->taint[0] = (taint){0, s->len};
    s->n_taint = 1;
}

/* bytes [start, start+n) of s, with exactly the taint that lay there */
static jstr *str_sub(render *r, const jstr *s, size_t start, size_t n)
{
    jstr *o = str_new(r, s->s + start, n);
    int k = 0;
    for (int i = 0; i < s->n_taint; i++)
        if (s->taint[i].end > start && s->taint[i].start < start + n)
            k++;
    if (k) {
        o->taint = aalloc(&r->a, (size_t)k * sizeof *o->taint);
        for (int i = 0; i < s->n_taint; i++) {
            size_t a = s->taint[i].start, b = s->taint[i].end;
            if (b <= start || a >= start + n)
                continue;
            o->taint[o->n_taint++] = (taint){(a > start ? a : start) - start,
                                             (b < start + n ? b : start + n) - start};
        }
    }
    return o;
}

/* ---- output buffers ----------------------------------------------------------------------- */

static void ob_reserve(render *r, obuf *b, size_t more)
{
    if (b->n + more + 1 <= b->cap)
        return;
    if (b->n + more > r->lim.max_output)
        rfail(r, "the template's output passed %zu bytes (a loop that never ends?)",
              r->lim.max_output);
    size_t cap = (b->n + more + 1) * 2;
    char *s = aalloc(&r->a, cap);
    if (b->n)
        memcpy(s, b->s, b->n);
    b->s = s, b->cap = cap;
}

static void ob_taint(render *r, obuf *b, size_t start, size_t end)
{
    if (start >= end)
        return;
    if (b->nt && b->t[b->nt - 1].end == start) { /* adjacent: one span */
        b->t[b->nt - 1].end = end;
        return;
    }
    if (b->nt == b->capt) {
        int cap = b->capt ? 2 * b->capt : 8;
        taint *t = aalloc(&r->a, (size_t)cap * sizeof *t);
        if (b->nt)
            memcpy(t, b->t, (size_t)b->nt * sizeof *t);
        b->t = t, b->capt = cap;
    }
    b->t[b->nt++] = (taint){start, end};
}

static void ob_put(render *r, obuf *b, const char *s, size_t n)
{
    ob_reserve(r, b, n);
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = 0;
}

static void ob_puts(render *r, obuf *b, const char *s)
{
    ob_put(r, b, s, strlen(s));
}

static void ob_str(render *r, obuf *b, const jstr *s)
{
    size_t at = b->n;
    ob_put(r, b, s->s, s->len);
    for (int i = 0; i < s->n_taint; i++)
        ob_taint(r, b, at + s->taint[i].start, at + s->taint[i].end);
}

static jstr *ob_done(render *r, obuf *b)
{
    jstr *s = str_new(r, b->s ? b->s : "", b->n);
    if (b->nt) {
        s->taint = b->t;
        s->n_taint = b->nt;
    }
    return s;
}

static jstr *str_cat(render *r, const jstr *x, const jstr *y)
{
    obuf b = {0};
    ob_str(r, &b, x);
    ob_str(r, &b, y);
    return ob_done(r, &b);
}

/* ---- lists and dicts ---------------------------------------------------------------------- */

static jlist *list_new(render *r, int cap)
{
    jlist *l = aalloc(&r->a, sizeof *l);
    l->n = 0, l->cap = cap > 0 ? cap : 4, l->tuple = 0, l->gen = 0;
    l->v = aalloc(&r->a, (size_t)l->cap * sizeof *l->v);
    return l;
}

static void list_push(render *r, jlist *l, jv v)
{
    if (l->n == l->cap) {
        jv *grown = aalloc(&r->a, (size_t)l->cap * 2 * sizeof *grown);
        memcpy(grown, l->v, (size_t)l->n * sizeof *grown);
        l->v = grown, l->cap *= 2;
    }
    l->v[l->n++] = v;
}

static jdict *dict_new(render *r)
{
    jdict *d = aalloc(&r->a, sizeof *d);
    memset(d, 0, sizeof *d);
    return d;
}

static uint64_t key_hash(const char *k, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)k[i]) * 1099511628211ull;
    return h;
}

/* the index's slot for key k: where it is, or the empty one where it would go */
static size_t dict_slot(const jdict *d, const char *k, size_t n)
{
    size_t mask = 2 * (size_t)d->cap - 1, at = key_hash(k, n) & mask;
    for (int i; (i = d->slots[at]) != 0; at = (at + 1) & mask)
        if (d->k[i - 1]->len == n && !memcmp(d->k[i - 1]->s, k, n))
            break;
    return at;
}

static int dict_find(const jdict *d, const char *k, size_t n)
{
    if (d->slots)
        return d->slots[dict_slot(d, k, n)] - 1;
    for (int i = 0; i < d->n; i++)
        if (d->k[i]->len == n && !memcmp(d->k[i]->s, k, n))
            return i;
    return -1;
}

static void dict_set(render *r, jdict *d, jstr *k, jv v)
{
    int i = dict_find(d, k->s, k->len);
    if (i >= 0) {
        d->v[i] = v;
        return;
    }
    if (d->n == d->cap) {
        int cap = d->cap ? 2 * d->cap : DICT_LINEAR;
        jstr **ks = aalloc(&r->a, (size_t)cap * sizeof *ks);
        jv *vs = aalloc(&r->a, (size_t)cap * sizeof *vs);
        if (d->n) {
            memcpy(ks, d->k, (size_t)d->n * sizeof *ks);
            memcpy(vs, d->v, (size_t)d->n * sizeof *vs);
        }
        d->k = ks, d->v = vs, d->cap = cap;
        if (cap > DICT_LINEAR) { /* the index anew, for the new capacity (a power of two) */
            d->slots = aalloc(&r->a, 2 * (size_t)cap * sizeof *d->slots);
            memset(d->slots, 0, 2 * (size_t)cap * sizeof *d->slots);
            for (int j = 0; j < d->n; j++)
                d->slots[dict_slot(d, d->k[j]->s, d->k[j]->len)] = j + 1;
        }
    }
    if (d->slots)
        d->slots[dict_slot(d, k->s, k->len)] = d->n + 1;
    d->k[d->n] = k;
    d->v[d->n++] = v;
}


/* ---- Python's spelling of values ---------------------------------------------------------- */

/* repr(float): the shortest digits that read back, fixed between 1e-4 and 1e16 */
static void float_repr(double f, char *buf, size_t size)
{
    if (isnan(f)) {
        snprintf(buf, size, "nan");
        return;
    }
    if (isinf(f)) {
        snprintf(buf, size, f < 0 ? "-inf" : "inf");
        return;
    }
    char e[40];
    int p;
    for (p = 1; p <= 17; p++) {
        snprintf(e, sizeof e, "%.*e", p - 1, f);
        if (strtod(e, NULL) == f)
            break;
    }
    /* e is [-]d[.ddd]e[+-]XX: take its digits and exponent */
    int neg = e[0] == '-';
    char digits[24];
    int nd = 0;
    const char *c = e + neg;
    for (; *c && *c != 'e'; c++)
        if (isdigit((unsigned char)*c))
            digits[nd++] = *c;
    int exp10 = atoi(c + 1);
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    digits[nd] = 0;
    char *o = buf;
    size_t left = size;
#define PUT(...)                                                                                   \
    do {                                                                                           \
        int k_ = snprintf(o, left, __VA_ARGS__);                                                   \
        if (k_ > 0 && (size_t)k_ < left)                                                           \
            o += k_, left -= (size_t)k_;                                                           \
    } while (0)
    if (neg)
        PUT("-");
    if (exp10 >= -5 && exp10 < 16) {
        if (exp10 < 0) {
            PUT("0.");
            for (int i = 0; i < -exp10 - 1; i++)
                PUT("0");
            PUT("%s", digits);
        } else {
            for (int i = 0; i <= exp10; i++)
                PUT("%c", i < nd ? digits[i] : '0');
            PUT(".");
            if (nd > exp10 + 1)
                PUT("%s", digits + exp10 + 1);
            else
                PUT("0");
        }
    } else {
        PUT("%c", digits[0]);
        if (nd > 1)
            PUT(".%s", digits + 1);
        PUT("e%c%02d", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
    }
#undef PUT
}

static int any_taint(const jv v);

static void repr_into(render *r, obuf *b, jv v, int depth);

static void str_repr(render *r, obuf *b, const jstr *s)
{
    int q = memchr(s->s, '\'', s->len) && !memchr(s->s, '"', s->len) ? '"' : '\'';
    char c1[2] = {(char)q, 0};
    ob_puts(r, b, c1);
    for (size_t i = 0; i < s->len; i++) {
        unsigned char c = (unsigned char)s->s[i];
        char esc[8];
        if (c == '\\')
            ob_puts(r, b, "\\\\");
        else if (c == q)
            ob_puts(r, b, q == '\'' ? "\\'" : "\\\"");
        else if (c == '\n')
            ob_puts(r, b, "\\n");
        else if (c == '\r')
            ob_puts(r, b, "\\r");
        else if (c == '\t')
            ob_puts(r, b, "\\t");
        else if (c < 0x20 || c == 0x7f) {
            snprintf(esc, sizeof esc, "\\x%02x", c);
            ob_puts(r, b, esc);
        } else
            ob_put(r, b, (const char *)&c, 1);
    }
    ob_puts(r, b, c1);
}

static void repr_into(render *r, obuf *b, jv v, int depth)
{
    char num[40];
    if (depth > r->lim.max_depth)
        rfail(r, "a value nested more than %d deep", r->lim.max_depth);
    switch (v.t) {
    case V_UNDEF: break;
    case V_NONE: ob_puts(r, b, "None"); break;
    case V_BOOL: ob_puts(r, b, v.b ? "True" : "False"); break;
    case V_INT:
        snprintf(num, sizeof num, "%lld", (long long)v.i);
        ob_puts(r, b, num);
        break;
    case V_FLOAT:
        float_repr(v.f, num, sizeof num);
        ob_puts(r, b, num);
        break;
    case V_STR: str_repr(r, b, v.s); break;
    case V_LIST:
        if (v.l->gen)
            rfail(r,
                  "a generator (what map, select, reject and reverse return) printed: add |list");
        ob_puts(r, b, v.l->tuple ? "(" : "[");
        for (int i = 0; i < v.l->n; i++) {
            if (i)
                ob_puts(r, b, ", ");
            repr_into(r, b, v.l->v[i], depth + 1);
        }
        if (v.l->tuple && v.l->n == 1)
            ob_puts(r, b, ",");
        ob_puts(r, b, v.l->tuple ? ")" : "]");
        break;
    case V_DICT:
        ob_puts(r, b, "{");
        for (int i = 0; i < v.d->n; i++) {
            if (i)
                ob_puts(r, b, ", ");
            str_repr(r, b, v.d->k[i]);
            ob_puts(r, b, ": ");
            repr_into(r, b, v.d->v[i], depth + 1);
        }
        ob_puts(r, b, "}");
        break;
    case V_MACRO: ob_puts(r, b, "<macro>"); break;
    case V_FUNC:
        ob_puts(r, b, "<function ");
        ob_puts(r, b, v.fn);
        ob_puts(r, b, ">");
        break;
    }
}

/* str(v), as {{ v }} prints it */
static jstr *to_str(render *r, jv v)
{
    if (v.t == V_STR)
        return v.s;
    if (v.t == V_UNDEF)
        return str_new(r, "", 0);
    obuf b = {0};
    repr_into(r, &b, v, 0);
    jstr *s = ob_done(r, &b);
    s->n_taint = 0, s->taint = NULL;
    if (any_taint(v))
        str_taint_all(r, s);
    return s;
}

static int any_taint(const jv v)
{
    switch (v.t) {
    case V_STR: return v.s->n_taint > 0;
    case V_LIST:
        for (int i = 0; i < v.l->n; i++)
            if (any_taint(v.l->v[i]))
                return 1;
        return 0;
    case V_DICT:
        for (int i = 0; i < v.d->n; i++)
            if (v.d->k[i]->n_taint || any_taint(v.d->v[i]))
                return 1;
        return 0;
    default: return 0;
    }
}

/* json.dumps as transformers' tojson calls it */
typedef struct json_opts {
    int ensure_ascii, indent, sort_keys;
    const char *item_sep, *key_sep;
} json_opts;

static void json_str(render *r, obuf *b, const jstr *s, int ascii)
{
    ob_puts(r, b, "\"");
    for (size_t i = 0; i < s->len; i++) {
        unsigned char c = (unsigned char)s->s[i];
        char esc[16];
        switch (c) {
        case '"': ob_puts(r, b, "\\\""); continue;
        case '\\': ob_puts(r, b, "\\\\"); continue;
        case '\n': ob_puts(r, b, "\\n"); continue;
        case '\r': ob_puts(r, b, "\\r"); continue;
        case '\t': ob_puts(r, b, "\\t"); continue;
        case '\b': ob_puts(r, b, "\\b"); continue;
        case '\f': ob_puts(r, b, "\\f"); continue;
        }
        if (c < 0x20 || (ascii && c == 0x7f)) {
            snprintf(esc, sizeof esc, "\\u%04x", c);
            ob_puts(r, b, esc);
        } else if (ascii && c >= 0x80) {
            /* decode one UTF-8 character; escape it as Python does (surrogate pairs) */
            int n = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 1;
            uint32_t cp = n == 4 ? c & 7 : n == 3 ? c & 15 : n == 2 ? c & 31 : c;
            for (int k = 1; k < n && i + 1 < s->len; k++)
                cp = (cp << 6) | ((unsigned char)s->s[++i] & 63);
            if (cp >= 0x10000) {
                cp -= 0x10000;
                snprintf(esc, sizeof esc, "\\u%04x\\u%04x", 0xd800 + (cp >> 10),
                         0xdc00 + (cp & 0x3ff));
            } else {
                snprintf(esc, sizeof esc, "\\u%04x", cp);
            }
            ob_puts(r, b, esc);
        } else {
            ob_put(r, b, (const char *)&c, 1);
        }
    }
    ob_puts(r, b, "\"");
}

static void json_newline(render *r, obuf *b, const json_opts *o, int level)
{
    ob_puts(r, b, "\n");
    for (int i = 0; i < o->indent * level; i++)
        ob_puts(r, b, " ");
}

static int key_cmp(const void *x, const void *y)
{
    const jstr *a = *(jstr *const *)x, *b = *(jstr *const *)y;
    size_t n = a->len < b->len ? a->len : b->len;
    int c = memcmp(a->s, b->s, n);
    return c ? c : (a->len > b->len) - (a->len < b->len);
}

static void json_into(render *r, obuf *b, jv v, const json_opts *o, int level)
{
    char num[40];
    if (level > r->lim.max_depth)
        rfail(r, "a value nested more than %d deep", r->lim.max_depth);
    switch (v.t) {
    case V_NONE: ob_puts(r, b, "null"); break;
    case V_BOOL: ob_puts(r, b, v.b ? "true" : "false"); break;
    case V_INT:
        snprintf(num, sizeof num, "%lld", (long long)v.i);
        ob_puts(r, b, num);
        break;
    case V_FLOAT:
        if (isnan(v.f) || isinf(v.f))
            ob_puts(r, b, isnan(v.f) ? "NaN" : v.f < 0 ? "-Infinity" : "Infinity");
        else {
            float_repr(v.f, num, sizeof num);
            ob_puts(r, b, num);
        }
        break;
    case V_STR: json_str(r, b, v.s, o->ensure_ascii); break;
    case V_LIST:
        if (v.l->gen)
            rfail(r,
                  "tojson: a generator (what map, select, reject and reverse return) is not "
                  "JSON: add |list");
        if (!v.l->n) {
            ob_puts(r, b, "[]");
            break;
        }
        ob_puts(r, b, "[");
        for (int i = 0; i < v.l->n; i++) {
            if (i)
                ob_puts(r, b, o->item_sep);
            if (o->indent >= 0)
                json_newline(r, b, o, level + 1);
            json_into(r, b, v.l->v[i], o, level + 1);
        }
        if (o->indent >= 0)
            json_newline(r, b, o, level);
        ob_puts(r, b, "]");
        break;
    case V_DICT: {
        if (!v.d->n) {
            ob_puts(r, b, "{}");
            break;
        }
        int *order = aalloc(&r->a, (size_t)v.d->n * sizeof *order);
        for (int i = 0; i < v.d->n; i++)
            order[i] = i;
        if (o->sort_keys) { /* insertion sort by key: dicts in templates are small */
            for (int i = 1; i < v.d->n; i++)
                for (int j = i; j > 0 && key_cmp(&v.d->k[order[j - 1]], &v.d->k[order[j]]) > 0;
                     j--) {
                    int t = order[j];
                    order[j] = order[j - 1], order[j - 1] = t;
                }
        }
        ob_puts(r, b, "{");
        for (int i = 0; i < v.d->n; i++) {
            if (i)
                ob_puts(r, b, o->item_sep);
            if (o->indent >= 0)
                json_newline(r, b, o, level + 1);
            json_str(r, b, v.d->k[order[i]], o->ensure_ascii);
            ob_puts(r, b, o->key_sep);
            json_into(r, b, v.d->v[order[i]], o, level + 1);
        }
        if (o->indent >= 0)
            json_newline(r, b, o, level);
        ob_puts(r, b, "}");
        break;
    }
    case V_UNDEF: rfail(r, "tojson: the value is undefined");
    default: rfail(r, "tojson: a macro is not JSON");
    }
}

/* ---- lexer: the template's text and tags -------------------------------------------------- */

enum { P_TEXT, P_VAR, P_BLOCK };

typedef struct piece {
    int kind, line;
    const char *s; /* text, or the tag's inside */
    size_t n;
} piece;

enum { T_END, T_NAME, T_INT, T_FLOAT, T_STR, T_OP };

typedef struct token {
    int kind, line;
    const char *s; /* NAME, OP: the source; STR: the decoded string */
    size_t n;
    int64_t i;
    double f;
} token;

typedef struct parser {
    arena *a;
    char *err;
    size_t err_size;
    int failed, depth;
    piece *pieces;
    int n_pieces, at; /* at: the next piece */
    token *toks;      /* the current tag's tokens */
    int n_toks, tk;
} parser;

static void perr(parser *p, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void perr(parser *p, int line, const char *fmt, ...)
{
    if (p->failed)
        return;
    p->failed = 1;
    char msg[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(p->err, p->err_size, "template line %d: %s", line, msg);
}

static int count_lines(const char *from, const char *to)
{
    int n = 0;
    for (; from < to; from++)
        n += *from == '\n';
    return n;
}

/* Where a tag that opened at s (just past its '{{' or '{%') closes: at the first close outside
 * string literals and brackets ("{{ {'a': {}} }}" closes at the last); NULL if it never does. */
static const char *tag_close(const char *s, const char *close)
{
    char q = 0;
    int depth = 0;
    for (; *s; s++) {
        if (q) {
            if (*s == '\\' && s[1])
                s++;
            else if (*s == q)
                q = 0;
        } else if (*s == '\'' || *s == '"') {
            q = *s;
        } else if (depth == 0 && s[0] == close[0] && s[1] == close[1]) {
            return s;
        } else if (*s == '(' || *s == '[' || *s == '{') {
            depth++;
        } else if ((*s == ')' || *s == ']' || *s == '}') && depth > 0) {
            depth--;
        }
    }
    return NULL;
}

/* Splits src into pieces with Jinja's whitespace rules applied (trim_blocks, lstrip_blocks,
 * '-' and '+'); one trailing newline at the end is dropped. */
static int lex_pieces(parser *p, const char *src)
{
    size_t len = strlen(src);
    int cap = 64;
    p->pieces = aalloc(p->a, (size_t)cap * sizeof *p->pieces);
    if (!p->pieces)
        return -1;
    const char *s = src;
    int line = 1, strip_next = 0, trim_next = 0;
    while (*s) {
        const char *t = s;
        while ((t = strchr(t, '{')) && t[1] != '{' && t[1] != '%' && t[1] != '#')
            t++;
        const char *text_end = t ? t : src + len;
        const char *text = s;
        if (strip_next)
            while (text < text_end && isspace((unsigned char)*text))
                text++;
        else if (trim_next && text < text_end && *text == '\n')
            text++;
        strip_next = trim_next = 0;
        const char *te = text_end;
        if (t) {
            if (t[2] == '-') {
                while (te > text && isspace((unsigned char)te[-1]))
                    te--;
            } else if (t[1] != '{' && t[2] != '+') { /* lstrip_blocks: a block or comment tag */
                const char *ls = te;                 /* alone on its line after spaces and tabs? */
                while (ls > s && (ls[-1] == ' ' || ls[-1] == '\t'))
                    ls--;
                if (ls == src || ls[-1] == '\n')
                    te = ls > text ? ls : text;
            }
        }
        if (te > text) {
            if (p->n_pieces + 2 > cap) {
                piece *grown = aalloc(p->a, (size_t)cap * 2 * sizeof *grown);
                if (!grown)
                    return -1;
                memcpy(grown, p->pieces, (size_t)p->n_pieces * sizeof *grown);
                p->pieces = grown, cap *= 2;
            }
            p->pieces[p->n_pieces++] = (piece){P_TEXT, line + count_lines(s, text), text,
                                               (size_t)(te - text)};
        }
        line += count_lines(s, text_end);
        if (!t)
            break;
        int kind = t[1] == '{' ? P_VAR : t[1] == '%' ? P_BLOCK : -1;
        const char *inner = t + 2 + (t[2] == '-' || t[2] == '+');
        const char *close = kind == P_VAR ? tag_close(inner, "}}")
            : kind == P_BLOCK             ? tag_close(inner, "%}")
                                          : strstr(inner, "#}");
        if (!close) {
            perr(p, line, "a '%.2s' is never closed", t);
            return -1;
        }
        const char *inner_end = close;
        if (close > inner && close[-1] == '-') {
            inner_end--;
            strip_next = 1;
        } else if (kind != P_VAR) {
            trim_next = 1; /* trim_blocks */
        }
        if (kind >= 0) {
            if (p->n_pieces + 2 > cap) {
                piece *grown = aalloc(p->a, (size_t)cap * 2 * sizeof *grown);
                if (!grown)
                    return -1;
                memcpy(grown, p->pieces, (size_t)p->n_pieces * sizeof *grown);
                p->pieces = grown, cap *= 2;
            }
            p->pieces[p->n_pieces++] = (piece){kind, line, inner, (size_t)(inner_end - inner)};
        }
        line += count_lines(t, close + 2);
        s = close + 2;
    }
    /* keep_trailing_newline off: the template's last newline is not output */
    if (p->n_pieces && p->pieces[p->n_pieces - 1].kind == P_TEXT) {
        piece *last = &p->pieces[p->n_pieces - 1];
        if (len && src[len - 1] == '\n' && last->n && last->s[last->n - 1] == '\n')
            last->n--;
    }
    return 0;
}

/* Tokens of one tag's inside. */
static int lex_tag(parser *p, const piece *pc)
{
    int cap = 16, n = 0, line = pc->line;
    token *t = aalloc(p->a, (size_t)cap * sizeof *t);
    const char *s = pc->s, *end = pc->s + pc->n;
    while (t) {
        while (s < end && isspace((unsigned char)*s)) {
            line += *s == '\n';
            s++;
        }
        if (n + 1 >= cap) {
            token *grown = aalloc(p->a, (size_t)cap * 2 * sizeof *grown);
            if (!grown)
                return -1;
            memcpy(grown, t, (size_t)n * sizeof *t);
            t = grown, cap *= 2;
        }
        token *k = &t[n];
        memset(k, 0, sizeof *k);
        k->line = line;
        if (s >= end) {
            k->kind = T_END;
            n++;
            break;
        }
        if (isalpha((unsigned char)*s) || *s == '_') {
            const char *b = s;
            while (s < end && (isalnum((unsigned char)*s) || *s == '_'))
                s++;
            k->kind = T_NAME, k->s = b, k->n = (size_t)(s - b);
        } else if (isdigit((unsigned char)*s)) {
            const char *b = s;
            int is_float = 0;
            while (s < end && (isdigit((unsigned char)*s) || *s == '_'))
                s++;
            if (s + 1 < end && *s == '.' && isdigit((unsigned char)s[1])) {
                is_float = 1;
                for (s++; s < end && isdigit((unsigned char)*s); s++)
                    ;
            }
            if (s < end && (*s == 'e' || *s == 'E')) {
                const char *e = s + 1;
                if (e < end && (*e == '+' || *e == '-'))
                    e++;
                if (e < end && isdigit((unsigned char)*e)) {
                    is_float = 1;
                    for (s = e; s < end && isdigit((unsigned char)*s); s++)
                        ;
                }
            }
            char num[64];
            size_t k2 = 0;
            for (const char *c = b; c < s && k2 + 1 < sizeof num; c++)
                if (*c != '_')
                    num[k2++] = *c;
            num[k2] = 0;
            if (is_float)
                k->kind = T_FLOAT, k->f = strtod(num, NULL);
            else {
                char *e;
                long long v = strtoll(num, &e, 10);
                if (v == LLONG_MAX) {
                    perr(p, line, "the number %s is too large", num);
                    return -1;
                }
                k->kind = T_INT, k->i = v;
            }
        } else if (*s == '\'' || *s == '"') {
            char q = *s++;
            const char *close = s; /* the literal's own bytes bound its decoded length */
            while (close < end && *close != q)
                close += *close == '\\' && close + 1 < end ? 2 : 1;
            char *o = aalloc(p->a, (size_t)(close - s) + 1);
            if (!o)
                return -1;
            size_t m = 0;
            while (s < end && *s != q) {
                if (*s == '\\' && s + 1 < end && strchr("xuU", s[1])) {
                    /* Python's \xHH, \uHHHH, \UHHHHHHHH: a code point, written as UTF-8 */
                    int digits = s[1] == 'x' ? 2 : s[1] == 'u' ? 4 : 8;
                    uint32_t cp = 0;
                    int i = 0;
                    for (; i < digits && s + 2 + i < end && isxdigit((unsigned char)s[2 + i]); i++)
                        cp = cp << 4 |
                            (uint32_t)(isdigit((unsigned char)s[2 + i])
                                           ? s[2 + i] - '0'
                                           : (tolower((unsigned char)s[2 + i]) - 'a' + 10));
                    if (i < digits) {
                        perr(p, line, "a \\%c escape wants %d hex digits", s[1], digits);
                        return -1;
                    }
                    if (cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff) || cp == 0) {
                        perr(p, line, "the escape \\%c%.*s is no character loom can write", s[1],
                             digits, s + 2);
                        return -1;
                    }
                    m += (size_t)utf8proc_encode_char((utf8proc_int32_t)cp,
                                                      (utf8proc_uint8_t *)o + m);
                    s += 2 + digits;
                    continue;
                }
                if (*s == '\\' && s + 1 < end) {
                    s++;
                    switch (*s) {
                    case 'n': o[m++] = '\n'; break;
                    case 'a': o[m++] = '\a'; break;
                    case 'b': o[m++] = '\b'; break;
                    case 'f': o[m++] = '\f'; break;
                    case 'v': o[m++] = '\v'; break;
                    case 't': o[m++] = '\t'; break;
                    case 'r': o[m++] = '\r'; break;
                    case '\\': o[m++] = '\\'; break;
                    case '\'': o[m++] = '\''; break;
                    case '"': o[m++] = '"'; break;
                    case '\n': break;
                    default: o[m++] = '\\', o[m++] = *s; break;
                    }
                    s++;
                } else {
                    line += *s == '\n';
                    o[m++] = *s++;
                }
            }
            if (s >= end) {
                perr(p, line, "a string literal is never closed");
                return -1;
            }
            s++;
            o[m] = 0;
            k->kind = T_STR, k->s = o, k->n = m;
        } else {
            static const char *const two[] = {"==", "!=", "<=", ">=", "//", "**"};
            k->kind = T_OP, k->s = s, k->n = 1;
            for (size_t i = 0; i < sizeof two / sizeof two[0]; i++)
                if (s + 1 < end && s[0] == two[i][0] && s[1] == two[i][1])
                    k->n = 2;
            if (k->n == 1 && !strchr("+-*/%~<>=()[]{}.,:|", *s)) {
                perr(p, line, "unexpected character '%c'", *s);
                return -1;
            }
            s += k->n;
        }
        n++;
    }
    if (!t)
        return -1;
    p->toks = t, p->n_toks = n, p->tk = 0;
    return 0;
}

/* ---- the syntax tree ---------------------------------------------------------------------- */

enum {
    /* expressions */
    N_LIT,
    N_NAME,
    N_ATTR,
    N_INDEX,
    N_SLICE,
    N_CALL,
    N_FILTER,
    N_TEST,
    N_BIN,
    N_CONCAT,
    N_NEG,
    N_POS,
    N_NOT,
    N_AND,
    N_OR,
    N_COND,
    N_LIST,
    N_TUPLE,
    N_DICT,
    /* statements */
    N_BODY,
    N_TEXT,
    N_OUT,
    N_IF,
    N_FOR,
    N_SET,
    N_SET_ATTR,
    N_SET_BLOCK,
    N_MACRO,
    N_CALL_BLOCK,
    N_FILTER_BLOCK,
    N_BREAK,
    N_CONTINUE,
};

typedef struct node {
    int kind, line;
    int op;           /* N_BIN: the operator's first two characters packed; N_TEST: negated */
    const char *name; /* N_NAME, N_ATTR, N_FILTER, N_TEST, N_SET*, N_MACRO */
    const char *text; /* N_TEXT, N_LIT strings */
    size_t text_len;
    struct node *a, *b, *c, *d;
    struct node **items; /* arguments, list items, a body's statements, a slice's parts */
    int n_items;
    const char **kw; /* keyword arguments' names (their values follow the items), or the
                      * names a for, set or macro binds */
    struct node **kw_vals;
    int n_kw;
    jv lit; /* N_LIT: a number, bool or none (strings are text) */
} node;

static node *mk(parser *p, int kind, int line)
{
    node *n = aalloc(p->a, sizeof *n);
    if (!n) {
        perr(p, line, "out of memory");
        return NULL;
    }
    memset(n, 0, sizeof *n);
    n->kind = kind, n->line = line;
    return n;
}

typedef struct nvec {
    node **v;
    int n, cap;
} nvec;

static void nv_push(parser *p, nvec *v, node *x)
{
    if (v->n == v->cap) {
        int cap = v->cap ? 2 * v->cap : 8;
        node **grown = aalloc(p->a, (size_t)cap * sizeof *grown);
        if (!grown) {
            perr(p, 0, "out of memory");
            return;
        }
        if (v->n)
            memcpy(grown, v->v, (size_t)v->n * sizeof *grown);
        v->v = grown, v->cap = cap;
    }
    v->v[v->n++] = x;
}

static char *pstrdup(parser *p, const char *s, size_t n)
{
    char *o = aalloc(p->a, n + 1);
    if (!o) {
        perr(p, 0, "out of memory");
        return NULL;
    }
    memcpy(o, s, n);
    o[n] = 0;
    return o;
}

static token *cur(parser *p)
{
    return &p->toks[p->tk];
}
static int is_op(parser *p, const char *op)
{
    token *t = cur(p);
    return t->kind == T_OP && t->n == strlen(op) && !memcmp(t->s, op, t->n);
}
static int is_name(parser *p, const char *name)
{
    token *t = cur(p);
    return t->kind == T_NAME && t->n == strlen(name) && !memcmp(t->s, name, t->n);
}
static int accept_op(parser *p, const char *op)
{
    if (!is_op(p, op))
        return 0;
    p->tk++;
    return 1;
}
static int accept_name(parser *p, const char *name)
{
    if (!is_name(p, name))
        return 0;
    p->tk++;
    return 1;
}
static void describe(token *t, char *buf, size_t n)
{
    if (t->kind == T_END)
        snprintf(buf, n, "the end of the tag");
    else if (t->kind == T_STR)
        snprintf(buf, n, "a string");
    else if (t->kind == T_INT || t->kind == T_FLOAT)
        snprintf(buf, n, "a number");
    else
        snprintf(buf, n, "'%.*s'", (int)t->n, t->s);
}
static void expect_op(parser *p, const char *op)
{
    if (accept_op(p, op))
        return;
    char what[64];
    describe(cur(p), what, sizeof what);
    perr(p, cur(p)->line, "expected '%s', found %s", op, what);
}
static const char *expect_ident(parser *p)
{
    token *t = cur(p);
    if (t->kind != T_NAME) {
        char what[64];
        describe(t, what, sizeof what);
        perr(p, t->line, "expected a name, found %s", what);
        return NULL;
    }
    p->tk++;
    return pstrdup(p, t->s, t->n);
}

static node *parse_expr(parser *p);
static node *parse_or(parser *p);
static node *parse_unary(parser *p);
static node *parse_primary(parser *p);

/* (args, key=value): into n->items and n->kw / kw_vals */
static void parse_args(parser *p, node *n)
{
    nvec args = {0}, vals = {0};
    const char **kw = NULL;
    int n_kw = 0;
    while (!p->failed && !is_op(p, ")")) {
        if (cur(p)->kind == T_NAME && p->toks[p->tk + 1].kind == T_OP &&
            p->toks[p->tk + 1].n == 1 && p->toks[p->tk + 1].s[0] == '=') {
            const char **grown = aalloc(p->a, (size_t)(n_kw + 1) * sizeof *grown);
            if (!grown)
                return perr(p, 0, "out of memory");
            if (n_kw)
                memcpy(grown, kw, (size_t)n_kw * sizeof *kw);
            kw = grown;
            kw[n_kw++] = expect_ident(p);
            p->tk++;
            nv_push(p, &vals, parse_expr(p));
        } else {
            if (n_kw)
                return perr(p, cur(p)->line, "a positional argument after a keyword argument");
            nv_push(p, &args, parse_expr(p));
        }
        if (!accept_op(p, ","))
            break;
    }
    expect_op(p, ")");
    n->items = args.v, n->n_items = args.n;
    n->kw = kw, n->kw_vals = vals.v, n->n_kw = n_kw;
}

static node *parse_postfix(parser *p, node *n)
{
    while (n && !p->failed) {
        int line = cur(p)->line;
        if (accept_op(p, ".")) {
            node *x = mk(p, N_ATTR, line);
            if (!x)
                return NULL;
            x->a = n;
            token *t = cur(p);
            if (t->kind == T_INT) { /* items.0 */
                x->kind = N_INDEX;
                x->b = mk(p, N_LIT, line);
                if (!x->b)
                    return NULL;
                x->b->lit = vint(t->i);
                p->tk++;
            } else {
                x->name = expect_ident(p);
            }
            n = x;
        } else if (accept_op(p, "[")) {
            node *parts[3] = {0};
            int colons = 0;
            for (;;) {
                if (!is_op(p, ":") && !is_op(p, "]"))
                    parts[colons] = parse_expr(p);
                if (colons < 2 && accept_op(p, ":"))
                    colons++;
                else
                    break;
            }
            expect_op(p, "]");
            node *x = mk(p, colons ? N_SLICE : N_INDEX, line);
            if (!x)
                return NULL;
            x->a = n;
            if (colons) {
                x->items = aalloc(p->a, 3 * sizeof *x->items);
                if (!x->items)
                    return NULL;
                memcpy(x->items, parts, sizeof parts);
                x->n_items = 3;
            } else {
                x->b = parts[0];
            }
            n = x;
        } else if (accept_op(p, "(")) {
            node *x = mk(p, N_CALL, line);
            if (!x)
                return NULL;
            x->a = n;
            parse_args(p, x);
            n = x;
        } else {
            break;
        }
    }
    return n;
}

/* value | filter(args) | ... and value is [not] test [arg] */
static node *parse_filters(parser *p, node *n)
{
    while (n && !p->failed) {
        int line = cur(p)->line;
        if (accept_op(p, "|")) {
            node *x = mk(p, N_FILTER, line);
            if (!x)
                return NULL;
            x->a = n;
            x->name = expect_ident(p);
            if (accept_op(p, "("))
                parse_args(p, x);
            n = x;
        } else if (accept_name(p, "is")) {
            node *x = mk(p, N_TEST, line);
            if (!x)
                return NULL;
            x->a = n;
            x->op = accept_name(p, "not");
            x->name = expect_ident(p);
            if (accept_op(p, "(")) {
                parse_args(p, x);
            } else {
                token *t = cur(p);
                if ((t->kind == T_NAME || t->kind == T_STR || t->kind == T_INT ||
                     t->kind == T_FLOAT || is_op(p, "[") || is_op(p, "{")) &&
                    !is_name(p, "else") && !is_name(p, "or") && !is_name(p, "and")) {
                    nvec one = {0};
                    nv_push(p, &one, parse_postfix(p, parse_primary(p)));
                    x->items = one.v, x->n_items = one.n;
                }
            }
            n = x;
        } else {
            break;
        }
    }
    return n;
}

static node *parse_primary(parser *p)
{
    token *t = cur(p);
    node *n = NULL;
    if (++p->depth > 200) {
        perr(p, t->line, "expressions nested more than 200 deep");
        return NULL;
    }
    switch (t->kind) {
    case T_NAME:
        p->tk++;
        n = mk(p, N_LIT, t->line);
        if (!n)
            break;
        if ((t->n == 4 && (!memcmp(t->s, "true", 4) || !memcmp(t->s, "True", 4))))
            n->lit = vbool(1);
        else if (t->n == 5 && (!memcmp(t->s, "false", 5) || !memcmp(t->s, "False", 5)))
            n->lit = vbool(0);
        else if (t->n == 4 && (!memcmp(t->s, "none", 4) || !memcmp(t->s, "None", 4)))
            n->lit = none_v;
        else {
            n->kind = N_NAME;
            n->name = pstrdup(p, t->s, t->n);
        }
        break;
    case T_INT:
    case T_FLOAT:
        p->tk++;
        n = mk(p, N_LIT, t->line);
        if (n)
            n->lit = t->kind == T_INT ? vint(t->i) : vfloat(t->f);
        break;
    case T_STR: {
        /* adjacent literals join, as in Python */
        size_t total = 0;
        int k = p->tk;
        for (; p->toks[k].kind == T_STR; k++)
            total += p->toks[k].n;
        char *s = aalloc(p->a, total + 1);
        if (!s)
            return NULL;
        size_t at = 0;
        for (; p->tk < k; p->tk++) {
            memcpy(s + at, p->toks[p->tk].s, p->toks[p->tk].n);
            at += p->toks[p->tk].n;
        }
        s[at] = 0;
        n = mk(p, N_LIT, t->line);
        if (n)
            n->lit.t = V_STR, n->text = s, n->text_len = at;
        break;
    }
    case T_OP:
        if (accept_op(p, "(")) {
            if (accept_op(p, ")")) { /* () */
                n = mk(p, N_TUPLE, t->line);
                break;
            }
            node *first = parse_expr(p);
            if (accept_op(p, ",")) {
                nvec items = {0};
                nv_push(p, &items, first);
                while (!p->failed && !is_op(p, ")")) {
                    nv_push(p, &items, parse_expr(p));
                    if (!accept_op(p, ","))
                        break;
                }
                n = mk(p, N_TUPLE, t->line);
                if (n)
                    n->items = items.v, n->n_items = items.n;
            } else {
                n = first;
            }
            expect_op(p, ")");
        } else if (accept_op(p, "[")) {
            nvec items = {0};
            while (!p->failed && !is_op(p, "]")) {
                nv_push(p, &items, parse_expr(p));
                if (!accept_op(p, ","))
                    break;
            }
            expect_op(p, "]");
            n = mk(p, N_LIST, t->line);
            if (n)
                n->items = items.v, n->n_items = items.n;
        } else if (accept_op(p, "{")) {
            nvec keys = {0}, vals = {0};
            while (!p->failed && !is_op(p, "}")) {
                nv_push(p, &keys, parse_expr(p));
                expect_op(p, ":");
                nv_push(p, &vals, parse_expr(p));
                if (!accept_op(p, ","))
                    break;
            }
            expect_op(p, "}");
            n = mk(p, N_DICT, t->line);
            if (n)
                n->items = keys.v, n->kw_vals = vals.v, n->n_items = keys.n;
        }
        break;
    }
    if (!n && !p->failed) {
        char what[64];
        describe(t, what, sizeof what);
        perr(p, t->line, "expected a value, found %s", what);
    }
    p->depth--;
    return n;
}

/* -x, +x or a value, without filters (they apply to the negation, not its operand) */
static node *parse_unary_operand(parser *p)
{
    int line = cur(p)->line;
    if (is_op(p, "-") || is_op(p, "+")) {
        int neg = cur(p)->s[0] == '-';
        p->tk++;
        node *x = mk(p, neg ? N_NEG : N_POS, line);
        if (++p->depth > 200) {
            perr(p, line, "expressions nested more than 200 deep");
            return NULL;
        }
        if (x)
            x->a = parse_unary_operand(p);
        p->depth--;
        return x;
    }
    return parse_postfix(p, parse_primary(p));
}

/* -x, +x, or a value, then its filters and tests: -4|abs is (-4)|abs, as Jinja reads it */
static node *parse_unary(parser *p)
{
    return parse_filters(p, parse_unary_operand(p));
}

static node *bin(parser *p, int line, const char *op, node *a, node *b)
{
    node *x = mk(p, N_BIN, line);
    if (x)
        x->op = op[0] | (op[1] << 8), x->a = a, x->b = b;
    return x;
}

static node *parse_pow(parser *p)
{
    node *n = parse_unary(p);
    while (n && !p->failed && is_op(p, "**")) {
        int line = cur(p)->line;
        p->tk++;
        n = bin(p, line, "**", n, parse_unary(p));
    }
    return n;
}

static node *parse_mul(parser *p)
{
    node *n = parse_pow(p);
    while (n && !p->failed && (is_op(p, "*") || is_op(p, "/") || is_op(p, "//") || is_op(p, "%"))) {
        token *t = cur(p);
        p->tk++;
        char op[3] = {t->s[0], t->n > 1 ? t->s[1] : 0, 0};
        n = bin(p, t->line, op, n, parse_pow(p));
    }
    return n;
}

static node *parse_add(parser *p)
{
    node *n = parse_mul(p);
    while (n && !p->failed && (is_op(p, "+") || is_op(p, "-"))) {
        token *t = cur(p);
        p->tk++;
        n = bin(p, t->line, t->s[0] == '+' ? "+" : "-", n, parse_mul(p));
    }
    return n;
}

/* a ~ b ~ c ... is one node over its operands, as in Jinja: a tag that joins 12000 strings
 * must not nest 12000 deep */
static node *parse_concat(parser *p)
{
    node *n = parse_add(p);
    if (!n || p->failed || !is_op(p, "~"))
        return n;
    node *cat = mk(p, N_CONCAT, cur(p)->line);
    nvec parts = {0};
    nv_push(p, &parts, n);
    while (!p->failed && is_op(p, "~")) {
        p->tk++;
        nv_push(p, &parts, parse_add(p));
    }
    if (cat)
        cat->items = parts.v, cat->n_items = parts.n;
    return cat;
}

static node *parse_compare(parser *p)
{
    node *n = parse_concat(p);
    while (n && !p->failed) {
        int line = cur(p)->line;
        const char *op = NULL;
        static const char *const ops[] = {"==", "!=", "<=", ">=", "<", ">"};
        for (size_t i = 0; i < sizeof ops / sizeof ops[0] && !op; i++)
            if (is_op(p, ops[i]))
                op = ops[i];
        if (op) {
            p->tk++;
        } else if (is_name(p, "in")) {
            p->tk++;
            op = "in";
        } else if (is_name(p, "not") && p->toks[p->tk + 1].kind == T_NAME &&
                   p->toks[p->tk + 1].n == 2 && !memcmp(p->toks[p->tk + 1].s, "in", 2)) {
            p->tk += 2;
            op = "ni"; /* not in */
        } else {
            break;
        }
        n = bin(p, line, op, n, parse_concat(p));
    }
    return n;
}

static node *parse_not(parser *p)
{
    int line = cur(p)->line;
    if (accept_name(p, "not")) {
        node *x = mk(p, N_NOT, line);
        if (++p->depth > 200) {
            perr(p, line, "expressions nested more than 200 deep");
            return NULL;
        }
        if (x)
            x->a = parse_not(p);
        p->depth--;
        return x;
    }
    return parse_compare(p);
}

static node *parse_and(parser *p)
{
    node *n = parse_not(p);
    while (n && !p->failed && is_name(p, "and")) {
        node *x = mk(p, N_AND, cur(p)->line);
        p->tk++;
        if (x)
            x->a = n, x->b = parse_not(p);
        n = x;
    }
    return n;
}

static node *parse_or(parser *p)
{
    node *n = parse_and(p);
    while (n && !p->failed && is_name(p, "or")) {
        node *x = mk(p, N_OR, cur(p)->line);
        p->tk++;
        if (x)
            x->a = n, x->b = parse_and(p);
        n = x;
    }
    return n;
}

/* a if cond else b */
static node *parse_expr(parser *p)
{
    if (++p->depth > 200) {
        perr(p, cur(p)->line, "expressions nested more than 200 deep");
        return NULL;
    }
    node *n = parse_or(p);
    while (n && !p->failed && is_name(p, "if")) {
        node *x = mk(p, N_COND, cur(p)->line);
        p->tk++;
        if (!x)
            break;
        x->a = n;
        x->b = parse_or(p);
        if (accept_name(p, "else"))
            x->c = parse_expr(p);
        n = x;
    }
    p->depth--;
    return n;
}

/* ---- statements --------------------------------------------------------------------------- */

static node *parse_body(parser *p, const char *const *ends, const char **ended);

/* the name a filter block's chain reads its text from (no template can spell it) */
#define FILTER_BLOCK_SLOT "\x01filter-block"

static void expect_tag_end(parser *p)
{
    if (cur(p)->kind != T_END && !p->failed) {
        char what[64];
        describe(cur(p), what, sizeof what);
        perr(p, cur(p)->line, "unexpected %s", what);
    }
}

/* the names a for or set binds: a or a, b */
static void parse_targets(parser *p, node *n)
{
    const char *names[8];
    int k = 0;
    do {
        if (k == 8)
            return perr(p, cur(p)->line, "more than 8 names to unpack");
        names[k++] = expect_ident(p);
    } while (!p->failed && accept_op(p, ","));
    n->kw = aalloc(p->a, (size_t)k * sizeof *n->kw);
    if (!n->kw)
        return perr(p, 0, "out of memory");
    memcpy(n->kw, names, (size_t)k * sizeof *names);
    n->n_kw = k;
}

static node *parse_statement(parser *p, const char *kw, int line)
{
    node *n = NULL;
    const char *ended = NULL;
    if (!strcmp(kw, "if")) {
        n = mk(p, N_IF, line);
        if (!n)
            return NULL;
        n->a = parse_expr(p);
        expect_tag_end(p);
        static const char *const ends[] = {"elif", "else", "endif", NULL};
        n->b = parse_body(p, ends, &ended);
        node *tail = n;
        while (!p->failed && ended && !strcmp(ended, "elif")) {
            node *e = mk(p, N_IF, cur(p)->line);
            if (!e)
                return NULL;
            e->a = parse_expr(p);
            expect_tag_end(p);
            e->b = parse_body(p, ends, &ended);
            node *wrap = mk(p, N_BODY, e->line);
            if (!wrap)
                return NULL;
            wrap->items = aalloc(p->a, sizeof *wrap->items);
            if (!wrap->items)
                return NULL;
            wrap->items[0] = e, wrap->n_items = 1;
            tail->c = wrap;
            tail = e;
        }
        if (!p->failed && ended && !strcmp(ended, "else")) {
            expect_tag_end(p);
            static const char *const end[] = {"endif", NULL};
            tail->c = parse_body(p, end, &ended);
        }
    } else if (!strcmp(kw, "for")) {
        n = mk(p, N_FOR, line);
        if (!n)
            return NULL;
        parse_targets(p, n);
        if (!accept_name(p, "in"))
            perr(p, cur(p)->line, "expected 'in' in the for");
        n->a = parse_or(p); /* not parse_expr: a trailing 'if' filters */
        if (accept_name(p, "if"))
            n->b = parse_expr(p);
        if (is_name(p, "recursive"))
            perr(p, line, "recursive for loops are not supported");
        expect_tag_end(p);
        static const char *const ends[] = {"else", "endfor", NULL};
        n->c = parse_body(p, ends, &ended);
        if (!p->failed && ended && !strcmp(ended, "else")) {
            expect_tag_end(p);
            static const char *const end[] = {"endfor", NULL};
            n->d = parse_body(p, end, &ended);
        }
    } else if (!strcmp(kw, "set")) {
        const char *name = expect_ident(p);
        if (accept_op(p, ".")) {
            n = mk(p, N_SET_ATTR, line);
            if (!n)
                return NULL;
            n->name = name;
            n->text = expect_ident(p);
            expect_op(p, "=");
            n->a = parse_expr(p);
        } else if (is_op(p, ",") || is_op(p, "=")) {
            n = mk(p, N_SET, line);
            if (!n)
                return NULL;
            p->tk--;
            parse_targets(p, n);
            expect_op(p, "=");
            n->a = parse_expr(p);
            if (!p->failed && is_op(p, ",")) { /* set a, b = 1, 2 */
                nvec items = {0};
                nv_push(p, &items, n->a);
                while (accept_op(p, ","))
                    nv_push(p, &items, parse_expr(p));
                node *t = mk(p, N_TUPLE, line);
                if (!t)
                    return NULL;
                t->items = items.v, t->n_items = items.n;
                n->a = t;
            }
        } else {
            n = mk(p, N_SET_BLOCK, line);
            if (!n)
                return NULL;
            n->name = name;
            expect_tag_end(p);
            static const char *const end[] = {"endset", NULL};
            n->b = parse_body(p, end, &ended);
            return n;
        }
    } else if (!strcmp(kw, "macro")) {
        n = mk(p, N_MACRO, line);
        if (!n)
            return NULL;
        n->name = expect_ident(p);
        expect_op(p, "(");
        nvec defaults = {0};
        const char *names[32];
        int k = 0;
        while (!p->failed && !is_op(p, ")")) {
            if (k == 32)
                return perr(p, line, "a macro with more than 32 parameters"), NULL;
            names[k] = expect_ident(p);
            nv_push(p, &defaults, accept_op(p, "=") ? parse_expr(p) : NULL);
            k++;
            if (!accept_op(p, ","))
                break;
        }
        expect_op(p, ")");
        expect_tag_end(p);
        n->kw = aalloc(p->a, (size_t)(k ? k : 1) * sizeof *n->kw);
        if (!n->kw)
            return NULL;
        memcpy(n->kw, names, (size_t)k * sizeof *names);
        n->n_kw = k;
        n->kw_vals = defaults.v;
        static const char *const end[] = {"endmacro", NULL};
        n->b = parse_body(p, end, &ended);
        return n;
    } else if (!strcmp(kw, "call")) {
        n = mk(p, N_CALL_BLOCK, line);
        if (!n)
            return NULL;
        if (accept_op(p, "(")) { /* the caller's parameters */
            node tmp = {0};
            parse_args(p, &tmp);
            if (tmp.n_kw)
                perr(p, line, "defaults for caller's parameters are not supported");
            const char **names = aalloc(p->a, (size_t)(tmp.n_items + 1) * sizeof *names);
            if (!names)
                return NULL;
            for (int i = 0; i < tmp.n_items; i++) {
                if (tmp.items[i]->kind != N_NAME)
                    return perr(p, line, "caller's parameters must be names"), NULL;
                names[i] = tmp.items[i]->name;
            }
            n->kw = names, n->n_kw = tmp.n_items;
        }
        n->a = parse_expr(p);
        if (n->a && n->a->kind != N_CALL)
            perr(p, line, "call needs a macro call");
        expect_tag_end(p);
        static const char *const end[] = {"endcall", NULL};
        n->b = parse_body(p, end, &ended);
        return n;
    } else if (!strcmp(kw, "filter")) {
        n = mk(p, N_FILTER_BLOCK, line);
        if (!n)
            return NULL;
        /* the filters apply to a placeholder standing for the block's output */
        node *hole = mk(p, N_NAME, line);
        if (!hole)
            return NULL;
        hole->name = FILTER_BLOCK_SLOT;
        p->tk--;
        p->toks[p->tk].kind = T_OP, p->toks[p->tk].s = "|", p->toks[p->tk].n = 1;
        n->a = parse_filters(p, hole);
        n->d = hole;
        expect_tag_end(p);
        static const char *const end[] = {"endfilter", NULL};
        n->b = parse_body(p, end, &ended);
        return n;
    } else if (!strcmp(kw, "generation")) { /* transformers' assistant-mask marker */
        expect_tag_end(p);
        static const char *const end[] = {"endgeneration", NULL};
        return parse_body(p, end, &ended);
    } else if (!strcmp(kw, "break") || !strcmp(kw, "continue")) {
        n = mk(p, kw[0] == 'b' ? N_BREAK : N_CONTINUE, line);
    } else {
        perr(p, line, "'%s' is not a statement loom's Jinja knows", kw);
        return NULL;
    }
    expect_tag_end(p);
    return n;
}

/* Statements up to one of the end keywords (NULL: the end of the template), consumed. */
static node *parse_body(parser *p, const char *const *ends, const char **ended)
{
    nvec items = {0};
    int start_line = p->at < p->n_pieces ? p->pieces[p->at].line : 0;
    *ended = NULL;
    if (++p->depth > 200) {
        perr(p, start_line, "blocks nested more than 200 deep");
        return NULL;
    }
    while (!p->failed && p->at < p->n_pieces) {
        piece *pc = &p->pieces[p->at++];
        if (pc->kind == P_TEXT) {
            node *t = mk(p, N_TEXT, pc->line);
            if (t)
                t->text = pc->s, t->text_len = pc->n;
            nv_push(p, &items, t);
            continue;
        }
        if (lex_tag(p, pc)) {
            perr(p, pc->line, "the tag needs more than %zu MiB to parse", p->a->limit >> 20);
            break;
        }
        if (pc->kind == P_VAR) {
            node *o = mk(p, N_OUT, pc->line);
            if (o)
                o->a = parse_expr(p);
            expect_tag_end(p);
            nv_push(p, &items, o);
            continue;
        }
        token *t = cur(p);
        if (t->kind != T_NAME) {
            perr(p, t->line, "a statement tag without a statement");
            break;
        }
        char kw[32];
        snprintf(kw, sizeof kw, "%.*s", (int)(t->n < 31 ? t->n : 31), t->s);
        p->tk++;
        for (int i = 0; ends && ends[i]; i++)
            if (!strcmp(kw, ends[i])) {
                *ended = ends[i];
                if (!strncmp(kw, "end", 3))
                    expect_tag_end(p);
                goto done;
            }
        if (!strncmp(kw, "end", 3) || !strcmp(kw, "elif") || !strcmp(kw, "else")) {
            perr(p, t->line, "'%s' without its opening block", kw);
            break;
        }
        nv_push(p, &items, parse_statement(p, kw, t->line));
    }
    if (ends && !p->failed) {
        const char *closing = ends[0];
        for (int i = 0; ends[i]; i++)
            closing = ends[i];
        perr(p, p->n_pieces ? p->pieces[p->n_pieces - 1].line : 1,
             "the template ends inside a block: '%s' is missing", closing);
    }
done:
    p->depth--;
    node *b = mk(p, N_BODY, start_line);
    if (b)
        b->items = items.v, b->n_items = items.n;
    return b;
}

struct jinja_template {
    arena a;
    node *body;
};

jinja_template *jinja_compile(const char *src, char *err, size_t err_size)
{
    jinja_template *t = calloc(1, sizeof *t);
    if (!t) {
        snprintf(err, err_size, "out of memory");
        return NULL;
    }
    t->a.limit = (size_t)256 << 20;
    parser p = {.a = &t->a, .err = err, .err_size = err_size};
    /* Jinja reads "\r\n" and a lone "\r" as "\n", in text and string literals alike */
    size_t len = strlen(src), k = 0;
    char *norm = aalloc(&t->a, len + 1);
    if (!norm) {
        snprintf(err, err_size, "out of memory parsing the template");
        jinja_free(t);
        return NULL;
    }
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            norm[k++] = '\n';
            i += src[i + 1] == '\n';
        } else {
            norm[k++] = src[i];
        }
    }
    norm[k] = 0;
    src = norm;
    if (lex_pieces(&p, src) == 0)
        t->body = parse_body(&p, NULL, &(const char *){NULL});
    if (p.failed || !t->body || t->a.exhausted) {
        if (!p.failed) /* a part dropped for want of memory must not render as if it were not */
            snprintf(err, err_size, "the template needs more than %zu MiB to parse",
                     t->a.limit >> 20);
        jinja_free(t);
        return NULL;
    }
    return t;
}

void jinja_free(jinja_template *t)
{
    if (!t)
        return;
    arena_free(&t->a);
    free(t);
}

/* ---- evaluation: scopes, truth, comparison ------------------------------------------------ */

static frame *frame_new(render *r, frame *up)
{
    frame *f = aalloc(&r->a, sizeof *f);
    memset(f, 0, sizeof *f);
    f->up = up;
    return f;
}

static void frame_set(render *r, frame *f, const char *name, jv v)
{
    for (int i = 0; i < f->n; i++)
        if (!strcmp(f->names[i], name)) {
            f->vals[i] = v;
            return;
        }
    if (f->n == f->cap) {
        int cap = f->cap ? 2 * f->cap : 8;
        const char **names = aalloc(&r->a, (size_t)cap * sizeof *names);
        jv *vals = aalloc(&r->a, (size_t)cap * sizeof *vals);
        if (f->n) {
            memcpy(names, f->names, (size_t)f->n * sizeof *names);
            memcpy(vals, f->vals, (size_t)f->n * sizeof *vals);
        }
        f->names = names, f->vals = vals, f->cap = cap;
    }
    f->names[f->n] = name;
    f->vals[f->n++] = v;
}

static int frame_get(const frame *f, const char *name, jv *out)
{
    for (; f; f = f->up)
        for (int i = f->n - 1; i >= 0; i--)
            if (!strcmp(f->names[i], name)) {
                *out = f->vals[i];
                return 1;
            }
    return 0;
}

static double monotonic_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Work done: units steps (a filter that compares n items charges n, one that reads a string
 * its length / 64), so a one-step expression cannot hide quadratic work; every 4096 units the
 * clock is read too, against max_ms. */
static void charge(render *r, size_t units)
{
    r->steps += units > (size_t)LONG_MAX / 2 ? LONG_MAX / 2 : (long)units;
    if (r->steps > r->lim.max_steps)
        rfail(r,
              "the template ran more than %ld steps (a loop that never ends, or filters "
              "over huge lists or strings?)",
              r->lim.max_steps);
    if (r->steps >= r->clock_at) {
        r->clock_at = r->steps + 4096;
        if (monotonic_s() > r->deadline)
            rfail(r, "the template ran longer than %ld ms", r->lim.max_ms);
    }
}

static void step(render *r)
{
    charge(r, 1);
}

/* the work of reading n bytes */
static void charge_bytes(render *r, size_t n)
{
    charge(r, n / 64 + 1);
}

static const char *type_name(jv v)
{
    static const char *const names[] = {"undefined", "none", "bool", "int",   "float",
                                        "string",    "list", "dict", "macro", "function"};
    return v.t == V_LIST && v.l->tuple ? "tuple" : names[v.t];
}

static int truthy(jv v)
{
    if (v.t == V_LIST && v.l->gen)
        return 1;
    switch (v.t) {
    case V_BOOL: return v.b;
    case V_INT: return v.i != 0;
    case V_FLOAT: return v.f != 0;
    case V_STR: return v.s->len > 0;
    case V_LIST: return v.l->n > 0;
    case V_DICT: return v.d->n > 0;
    case V_MACRO:
    case V_FUNC: return 1;
    default: return 0;
    }
}

static int is_num(jv v)
{
    return v.t == V_INT || v.t == V_FLOAT || v.t == V_BOOL;
}
static double num(jv v)
{
    return v.t == V_FLOAT ? v.f : v.t == V_INT ? (double)v.i : v.b;
}
static int is_intlike(jv v)
{
    return v.t == V_INT || v.t == V_BOOL;
}
static int64_t ival(jv v)
{
    return v.t == V_INT ? v.i : v.b;
}

static int str_eq(const jstr *a, const jstr *b)
{
    return a->len == b->len && !memcmp(a->s, b->s, a->len);
}

static int equal(jv a, jv b)
{
    if (is_num(a) && is_num(b))
        return is_intlike(a) && is_intlike(b) ? ival(a) == ival(b) : num(a) == num(b);
    if (a.t != b.t)
        return 0;
    switch (a.t) {
    case V_UNDEF:
    case V_NONE: return 1;
    case V_STR: return str_eq(a.s, b.s);
    case V_LIST:
        if (a.l->n != b.l->n)
            return 0;
        for (int i = 0; i < a.l->n; i++)
            if (!equal(a.l->v[i], b.l->v[i]))
                return 0;
        return 1;
    case V_DICT:
        if (a.d->n != b.d->n)
            return 0;
        for (int i = 0; i < a.d->n; i++) {
            int j = dict_find(b.d, a.d->k[i]->s, a.d->k[i]->len);
            if (j < 0 || !equal(a.d->v[i], b.d->v[j]))
                return 0;
        }
        return 1;
    case V_MACRO: return a.m == b.m;
    case V_FUNC: return !strcmp(a.fn, b.fn);
    }
    return 0;
}

/* <0, 0, >0 as Python orders them; an error where Python raises */
static int compare(render *r, jv a, jv b, const char *op)
{
    if (is_num(a) && is_num(b)) {
        if (is_intlike(a) && is_intlike(b))
            return (ival(a) > ival(b)) - (ival(a) < ival(b));
        return (num(a) > num(b)) - (num(a) < num(b));
    }
    if (a.t == V_STR && b.t == V_STR)
        return key_cmp(&a.s, &b.s);
    if (a.t == V_LIST && b.t == V_LIST) {
        for (int i = 0; i < a.l->n && i < b.l->n; i++)
            if (!equal(a.l->v[i], b.l->v[i]))
                return compare(r, a.l->v[i], b.l->v[i], op);
        return (a.l->n > b.l->n) - (a.l->n < b.l->n);
    }
    rfail(r, "'%s' is not supported between %s and %s", op, type_name(a), type_name(b));
}

/* ---- strings as Python counts them: code points ------------------------------------------- */

static size_t utf8_count(const jstr *s)
{
    size_t n = 0;
    for (size_t i = 0; i < s->len; i++)
        n += ((unsigned char)s->s[i] & 0xc0) != 0x80;
    return n;
}

/* the byte offset of code point k (k may be the count: the end) */
static size_t utf8_offset(const jstr *s, size_t k)
{
    size_t i = 0;
    for (; i < s->len && k; k--)
        for (i++; i < s->len && ((unsigned char)s->s[i] & 0xc0) == 0x80; i++)
            ;
    return i;
}

/* s as a list of its characters */
static jlist *str_chars(render *r, const jstr *s)
{
    jlist *l = list_new(r, (int)utf8_count(s) + 1);
    for (size_t i = 0; i < s->len;) {
        size_t j = i + 1;
        while (j < s->len && ((unsigned char)s->s[j] & 0xc0) == 0x80)
            j++;
        list_push(r, l, vstr(str_sub(r, s, i, j - i)));
        i = j;
    }
    return l;
}

/* what a for loop, list or join walks over */
static jlist *iterate(render *r, jv v)
{
    switch (v.t) {
    case V_LIST: return v.l;
    case V_DICT: {
        jlist *l = list_new(r, v.d->n);
        for (int i = 0; i < v.d->n; i++)
            list_push(r, l, vstr(v.d->k[i]));
        return l;
    }
    case V_STR: return str_chars(r, v.s);
    case V_UNDEF: return list_new(r, 1); /* Jinja's Undefined iterates as empty */
    default: rfail(r, "a %s cannot be iterated over", type_name(v));
    }
}

/* ---- case, as Python's str methods see it: Unicode's simple mappings (utf8proc) --------------- */

enum { CASE_UPPER, CASE_LOWER, CASE_TITLE, CASE_CAPITALIZE };

/* one code point at s[*i] (advancing *i); an ill-formed byte stands for itself */
static utf8proc_int32_t next_cp(const jstr *s, size_t *i)
{
    utf8proc_int32_t cp;
    utf8proc_ssize_t n = utf8proc_iterate((const utf8proc_uint8_t *)s->s + *i,
                                          (utf8proc_ssize_t)(s->len - *i), &cp);
    if (n <= 0) {
        cp = (unsigned char)s->s[*i];
        n = 1;
    }
    *i += (size_t)n;
    return cp;
}

static int cp_cased_letter(utf8proc_int32_t cp)
{
    utf8proc_category_t c = utf8proc_category(cp);
    return c == UTF8PROC_CATEGORY_LU || c == UTF8PROC_CATEGORY_LL || c == UTF8PROC_CATEGORY_LT;
}

/* Python's \w: letters, numbers and '_' */
static int cp_word(utf8proc_int32_t cp)
{
    utf8proc_category_t c = utf8proc_category(cp);
    return cp == '_' || (c >= UTF8PROC_CATEGORY_LU && c <= UTF8PROC_CATEGORY_LO) ||
        (c >= UTF8PROC_CATEGORY_ND && c <= UTF8PROC_CATEGORY_NO);
}

static jstr *str_case(render *r, const jstr *s, int how)
{
    obuf b = {0};
    ob_put(r, &b, "", 0);
    int start = 1; /* title: after a character that is not a letter */
    for (size_t i = 0; i < s->len;) {
        utf8proc_int32_t cp = next_cp(s, &i), out;
        switch (how) {
        case CASE_UPPER:
            if (cp == 0xdf) { /* the one full mapping templates meet: "ß".upper() is "SS" */
                ob_puts(r, &b, "SS");
                continue;
            }
            out = utf8proc_toupper(cp);
            break;
        case CASE_LOWER: out = utf8proc_tolower(cp); break;
        case CASE_CAPITALIZE:
            out = start ? utf8proc_totitle(cp) : utf8proc_tolower(cp);
            start = 0;
            break;
        default:
            out = start ? utf8proc_totitle(cp) : utf8proc_tolower(cp);
            start = !cp_cased_letter(cp);
        }
        utf8proc_uint8_t enc[4];
        ob_put(r, &b, (const char *)enc, (size_t)utf8proc_encode_char(out, enc));
    }
    jstr *o = ob_done(r, &b);
    o->n_taint = 0, o->taint = NULL;
    if (s->n_taint)
        str_taint_all(r, o);
    return o;
}

static int64_t word_count(const jstr *s)
{
    int64_t n = 0;
    int in_word = 0;
    for (size_t i = 0; i < s->len;) {
        int w = cp_word(next_cp(s, &i));
        n += w && !in_word;
        in_word = w;
    }
    return n;
}

static int in_set(char c, const jstr *chars)
{
    return chars ? memchr(chars->s, c, chars->len) != NULL : isspace((unsigned char)c);
}

/* Python's strip, lstrip, rstrip (chars: NULL for whitespace) */
static jstr *str_strip(render *r, const jstr *s, int left, int right, const jstr *chars)
{
    size_t a = 0, b = s->len;
    while (left && a < b && in_set(s->s[a], chars))
        a++;
    while (right && b > a && in_set(s->s[b - 1], chars))
        b--;
    return str_sub(r, s, a, b - a);
}

static jstr *str_replace(render *r, const jstr *s, const jstr *from, const jstr *to, int64_t count)
{
    obuf b = {0};
    ob_put(r, &b, "", 0);
    size_t i = 0;
    int64_t done = 0;
    if (!from->len) { /* Python inserts 'to' between every character */
        jlist *chars = str_chars(r, s);
        for (int k = 0; k <= chars->n; k++) {
            if (count < 0 || done < count) {
                ob_put(r, &b, to->s, to->len);
                done++;
            }
            if (k < chars->n)
                ob_put(r, &b, chars->v[k].s->s, chars->v[k].s->len);
        }
    } else {
        while (i < s->len) {
            const char *hit = (count < 0 || done < count)
                ? memmem(s->s + i, s->len - i, from->s, from->len)
                : NULL;
            if (!hit) {
                ob_put(r, &b, s->s + i, s->len - i);
                break;
            }
            ob_put(r, &b, s->s + i, (size_t)(hit - (s->s + i)));
            ob_put(r, &b, to->s, to->len);
            i = (size_t)(hit - s->s) + from->len;
            done++;
        }
    }
    jstr *o = ob_done(r, &b);
    if (s->n_taint || to->n_taint)
        str_taint_all(r, o);
    return o;
}

/* Python's split: by whitespace runs (sep NULL) or by sep */
static jlist *str_split(render *r, const jstr *s, const jstr *sep, int64_t maxsplit)
{
    jlist *l = list_new(r, 4);
    size_t i = 0;
    if (!sep) {
        while (i < s->len) {
            while (i < s->len && isspace((unsigned char)s->s[i]))
                i++;
            if (i >= s->len)
                break;
            size_t j = i;
            if (maxsplit >= 0 && l->n >= maxsplit) {
                size_t e = s->len;
                while (e > i && isspace((unsigned char)s->s[e - 1]))
                    e--;
                list_push(r, l, vstr(str_sub(r, s, i, e - i)));
                break;
            }
            while (j < s->len && !isspace((unsigned char)s->s[j]))
                j++;
            list_push(r, l, vstr(str_sub(r, s, i, j - i)));
            i = j;
        }
        return l;
    }
    if (!sep->len)
        rfail(r, "split: an empty separator");
    for (;;) {
        const char *hit = (maxsplit < 0 || l->n < maxsplit)
            ? memmem(s->s + i, s->len - i, sep->s, sep->len)
            : NULL;
        if (!hit) {
            list_push(r, l, vstr(str_sub(r, s, i, s->len - i)));
            return l;
        }
        list_push(r, l, vstr(str_sub(r, s, i, (size_t)(hit - s->s) - i)));
        i = (size_t)(hit - s->s) + sep->len;
    }
}

static int starts_with(const jstr *s, const jstr *p, int at_end)
{
    if (p->len > s->len)
        return 0;
    return !memcmp(s->s + (at_end ? s->len - p->len : 0), p->s, p->len);
}

/* ---- slices --------------------------------------------------------------------------------- */

static int64_t slice_index(int64_t i, int64_t n, int step_neg)
{
    if (i < 0)
        i += n;
    if (i < 0)
        return step_neg ? -1 : 0;
    if (i >= n)
        return step_neg ? n - 1 : n;
    return i;
}

static jv do_slice(render *r, jv v, jv start, jv stop, jv stepv)
{
    int64_t stp = stepv.t == V_UNDEF || stepv.t == V_NONE ? 1 : ival(stepv);
    if (stepv.t != V_UNDEF && stepv.t != V_NONE && !is_intlike(stepv))
        rfail(r, "a slice's step must be an integer");
    if (stp == 0)
        rfail(r, "a slice's step cannot be zero");
    jlist *items;
    if (v.t == V_STR)
        items = str_chars(r, v.s);
    else if (v.t == V_LIST)
        items = v.l;
    else
        rfail(r, "a %s cannot be sliced", type_name(v));
    int64_t n = items->n;
    int64_t a = start.t == V_UNDEF || start.t == V_NONE ? (stp > 0 ? 0 : n - 1)
                                                        : slice_index(ival(start), n, stp < 0);
    int64_t b = stop.t == V_UNDEF || stop.t == V_NONE ? (stp > 0 ? n : -1)
                                                      : slice_index(ival(stop), n, stp < 0);
    if ((start.t > V_NONE && !is_intlike(start)) || (stop.t > V_NONE && !is_intlike(stop)))
        rfail(r, "slice indices must be integers");
    if (v.t == V_STR && stp == 1) { /* the common case keeps taint exactly */
        if (b < a)
            b = a;
        size_t from = utf8_offset(v.s, (size_t)a), to = utf8_offset(v.s, (size_t)b);
        return vstr(str_sub(r, v.s, from, to - from));
    }
    jlist *o = list_new(r, 4);
    for (int64_t i = a; stp > 0 ? i < b : i > b; i += stp)
        list_push(r, o, items->v[i]);
    if (v.t == V_LIST)
        return (jv){.t = V_LIST, .l = o};
    obuf buf = {0};
    ob_put(r, &buf, "", 0);
    for (int i = 0; i < o->n; i++)
        ob_str(r, &buf, o->v[i].s);
    return vstr(ob_done(r, &buf));
}

/* ---- arithmetic ----------------------------------------------------------------------------- */

static jstr *html_escape(render *r, const jstr *s);

static jv arith(render *r, int op, jv a, jv b)
{
    char o0 = (char)(op & 0xff), o1 = (char)(op >> 8);
    if (o0 == '~') {
        return vstr(str_cat(r, to_str(r, a), to_str(r, b)));
    }
    if (o0 == '+' && a.t == V_STR && b.t == V_STR) {
        if (!a.s->markup && !b.s->markup)
            return vstr(str_cat(r, a.s, b.s));
        /* Markup + str escapes the str (a template's "..."|safe + name) */
        jstr *o = str_cat(r, a.s->markup ? a.s : html_escape(r, a.s),
                          b.s->markup ? b.s : html_escape(r, b.s));
        o->markup = 1;
        return vstr(o);
    }
    if (o0 == '+' && a.t == V_LIST && b.t == V_LIST) {
        jlist *l = list_new(r, a.l->n + b.l->n + 1);
        for (int i = 0; i < a.l->n; i++)
            list_push(r, l, a.l->v[i]);
        for (int i = 0; i < b.l->n; i++)
            list_push(r, l, b.l->v[i]);
        return (jv){.t = V_LIST, .l = l};
    }
    if (o0 == '*' && !o1 && ((a.t == V_STR || a.t == V_LIST) && is_intlike(b))) {
        int64_t times = ival(b) < 0 ? 0 : ival(b);
        size_t unit = a.t == V_STR ? a.s->len : (size_t)a.l->n * sizeof(jv);
        if (unit && (uint64_t)times > r->lim.max_output / unit)
            rfail(r, "a repetition of %lld would pass the output limit", (long long)times);
        if (a.t == V_STR) {
            obuf buf = {0};
            ob_put(r, &buf, "", 0);
            for (int64_t i = 0; i < times; i++)
                ob_str(r, &buf, a.s);
            return vstr(ob_done(r, &buf));
        }
        jlist *l = list_new(r, (int)(a.l->n * times) + 1);
        for (int64_t i = 0; i < times; i++)
            for (int k = 0; k < a.l->n; k++)
                list_push(r, l, a.l->v[k]);
        return (jv){.t = V_LIST, .l = l};
    }
    if (o0 == '*' && !o1 && is_intlike(a) && (b.t == V_STR || b.t == V_LIST))
        return arith(r, op, b, a);
    if (!is_num(a) || !is_num(b))
        rfail(r, "'%c%s' is not supported between %s and %s", o0, o1 ? (char[]){o1, 0} : "",
              type_name(a), type_name(b));
    int ints = is_intlike(a) && is_intlike(b);
    int64_t x = ival(a), y = ival(b), z;
    double fx = num(a), fy = num(b);
    switch (o0) {
    case '+':
        if (ints) {
            if (__builtin_add_overflow(x, y, &z))
                rfail(r, "an integer overflowed");
            return vint(z);
        }
        return vfloat(fx + fy);
    case '-':
        if (ints) {
            if (__builtin_sub_overflow(x, y, &z))
                rfail(r, "an integer overflowed");
            return vint(z);
        }
        return vfloat(fx - fy);
    case '*':
        if (o1 == '*') { /* ** */
            if (ints && y >= 0) {
                int64_t acc = 1;
                for (int64_t i = 0; i < y; i++) {
                    if (__builtin_mul_overflow(acc, x, &acc))
                        rfail(r, "an integer overflowed");
                    if (acc == 0 || acc == 1)
                        break;
                }
                return vint(acc);
            }
            return vfloat(pow(fx, fy));
        }
        if (ints) {
            if (__builtin_mul_overflow(x, y, &z))
                rfail(r, "an integer overflowed");
            return vint(z);
        }
        return vfloat(fx * fy);
    case '/':
        if (o1 == '/') { /* // floors */
            if (ints) {
                if (y == 0)
                    rfail(r, "integer division by zero");
                if (x == INT64_MIN && y == -1)
                    rfail(r, "an integer overflowed");
                int64_t q = x / y;
                if ((x % y != 0) && ((x < 0) != (y < 0)))
                    q--;
                return vint(q);
            }
            if (fy == 0)
                rfail(r, "float division by zero");
            return vfloat(floor(fx / fy));
        }
        if (fy == 0)
            rfail(r, "division by zero");
        return vfloat(fx / fy);
    case '%':
        if (ints) {
            if (y == 0)
                rfail(r, "integer modulo by zero");
            if (y == -1)
                return vint(0);
            int64_t m = x % y;
            if (m != 0 && ((m < 0) != (y < 0)))
                m += y;
            return vint(m);
        }
        if (fy == 0)
            rfail(r, "float modulo by zero");
        {
            double m = fmod(fx, fy);
            if (m != 0 && ((m < 0) != (fy < 0)))
                m += fy;
            return vfloat(m);
        }
    }
    rfail(r, "unknown operator");
}

static int contains(render *r, jv hay, jv needle)
{
    switch (hay.t) {
    case V_STR:
        if (needle.t != V_STR)
            rfail(r, "'in <string>' needs a string on the left, not a %s", type_name(needle));
        charge_bytes(r, hay.s->len);
        return memmem(hay.s->s, hay.s->len, needle.s->s, needle.s->len) != NULL ||
            needle.s->len == 0;
    case V_LIST:
        charge(r, (size_t)hay.l->n);
        for (int i = 0; i < hay.l->n; i++)
            if (equal(hay.l->v[i], needle))
                return 1;
        return 0;
    case V_DICT: return needle.t == V_STR && dict_find(hay.d, needle.s->s, needle.s->len) >= 0;
    case V_UNDEF: return 0;
    default: rfail(r, "'in' needs a string, list or dict on the right, not a %s", type_name(hay));
    }
}

/* markupsafe's escape: the result is Markup */
static jstr *html_escape(render *r, const jstr *s)
{
    obuf b = {0};
    ob_put(r, &b, "", 0);
    for (size_t i = 0; i < s->len; i++) {
        const char *rep = s->s[i] == '&' ? "&amp;"
            : s->s[i] == '<'             ? "&lt;"
            : s->s[i] == '>'             ? "&gt;"
            : s->s[i] == '"'             ? "&#34;"
            : s->s[i] == '\''            ? "&#39;"
                                         : NULL;
        if (rep)
            ob_puts(r, &b, rep);
        else
            ob_put(r, &b, s->s + i, 1);
    }
    jstr *o = ob_done(r, &b);
    if (s->n_taint)
        str_taint_all(r, o);
    o->markup = 1;
    return o;
}

/* ---- calls: arguments, macros ------------------------------------------------------------- */

typedef struct args {
    jv *pos;
    int n;
    const char **kw;
    jv *kwv;
    int n_kw;
} args;

static jv eval(render *r, frame *f, const node *n);
static void exec_body(render *r, frame *f, const node *body);

static args eval_args(render *r, frame *f, const node *n)
{
    args a = {.n = n->n_items, .kw = n->kw, .n_kw = n->n_kw};
    a.pos = aalloc(&r->a, (size_t)(a.n + 1) * sizeof *a.pos);
    a.kwv = aalloc(&r->a, (size_t)(a.n_kw + 1) * sizeof *a.kwv);
    for (int i = 0; i < a.n; i++)
        a.pos[i] = eval(r, f, n->items[i]);
    for (int i = 0; i < a.n_kw; i++)
        a.kwv[i] = eval(r, f, n->kw_vals[i]);
    return a;
}

/* argument i, or the keyword name; undefined when neither was given */
static jv arg(const args *a, int i, const char *name)
{
    if (i >= 0 && i < a->n)
        return a->pos[i];
    for (int k = 0; name && k < a->n_kw; k++)
        if (!strcmp(a->kw[k], name))
            return a->kwv[k];
    return undef;
}

static void check_args(render *r, const args *a, int max_pos, const char *const *names,
                       const char *what)
{
    if (a->n > max_pos)
        rfail(r, "%s takes at most %d positional arguments, got %d", what, max_pos, a->n);
    for (int k = 0; k < a->n_kw; k++) {
        int ok = 0;
        for (int i = 0; names && names[i]; i++)
            ok |= !strcmp(a->kw[k], names[i]);
        if (!ok)
            rfail(r, "%s has no argument '%s'", what, a->kw[k]);
    }
}

static jstr *want_str(render *r, jv v, const char *what)
{
    if (v.t != V_STR)
        rfail(r, "%s needs a string, not a %s", what, type_name(v));
    return v.s;
}

/* output goes into `into` until the caller puts back what this returns */
static obuf *capture_begin(render *r, obuf *into)
{
    memset(into, 0, sizeof *into);
    ob_put(r, into, "", 0);
    obuf *old = r->out;
    r->out = into;
    return old;
}

static jv call_macro(render *r, const jmacro *m, const args *a, jmacro *caller)
{
    const node *def = m->def;
    if (++r->depth > r->lim.max_depth)
        rfail(r, "macros called more than %d deep (a macro that calls itself forever?)",
              r->lim.max_depth);
    frame *f = frame_new(r, m->scope);
    const char *what = def->kind == N_MACRO ? def->name : "caller";
    if (a->n > def->n_kw)
        rfail(r, "macro '%s' takes %d arguments, got %d", what, def->n_kw, a->n);
    for (int k = 0; k < a->n_kw; k++) {
        int ok = 0;
        for (int i = 0; i < def->n_kw; i++)
            ok |= !strcmp(a->kw[k], def->kw[i]);
        if (!ok)
            rfail(r, "macro '%s' has no parameter '%s'", what, a->kw[k]);
    }
    for (int i = 0; i < def->n_kw; i++) {
        jv v = arg(a, i, def->kw[i]);
        if (v.t == V_UNDEF && def->kind == N_MACRO && def->kw_vals && def->kw_vals[i])
            v = eval(r, f, def->kw_vals[i]);
        frame_set(r, f, def->kw[i], v);
    }
    if (caller)
        frame_set(r, f, "caller", (jv){.t = V_MACRO, .m = caller});
    obuf body, *old = capture_begin(r, &body);
    int saved_ctl = r->loop_ctl;
    exec_body(r, f, def->b);
    r->loop_ctl = saved_ctl;
    r->out = old;
    r->depth--;
    return vstr(ob_done(r, &body));
}

/* ---- tests: x is NAME ----------------------------------------------------------------------- */

static int apply_test(render *r, const char *name, jv v, const args *a)
{
    jv x = arg(a, 0, NULL);
    if (!strcmp(name, "defined"))
        return v.t != V_UNDEF;
    if (!strcmp(name, "undefined"))
        return v.t == V_UNDEF;
    if (!strcmp(name, "none"))
        return v.t == V_NONE;
    if (!strcmp(name, "boolean"))
        return v.t == V_BOOL;
    if (!strcmp(name, "true"))
        return v.t == V_BOOL && v.b;
    if (!strcmp(name, "false"))
        return v.t == V_BOOL && !v.b;
    if (!strcmp(name, "integer"))
        return v.t == V_INT;
    if (!strcmp(name, "float"))
        return v.t == V_FLOAT;
    if (!strcmp(name, "number"))
        return is_num(v);
    if (!strcmp(name, "string"))
        return v.t == V_STR;
    if (!strcmp(name, "mapping"))
        return v.t == V_DICT;
    if (!strcmp(name, "iterable"))
        return v.t == V_LIST || v.t == V_DICT || v.t == V_STR || v.t == V_UNDEF;
    if (!strcmp(name, "sequence"))
        return v.t == V_LIST || v.t == V_DICT || v.t == V_STR;
    if (!strcmp(name, "callable"))
        return v.t == V_MACRO || v.t == V_FUNC;
    if (!strcmp(name, "odd") || !strcmp(name, "even")) {
        if (!is_intlike(v))
            rfail(r, "'%s' needs an integer, not a %s", name, type_name(v));
        return (ival(v) % 2 != 0) == (name[0] == 'o');
    }
    if (!strcmp(name, "divisibleby")) {
        if (!is_intlike(v) || !is_intlike(x) || ival(x) == 0)
            rfail(r, "'divisibleby' needs integers");
        return ival(v) % ival(x) == 0;
    }
    if (!strcmp(name, "eq") || !strcmp(name, "equalto") || !strcmp(name, "=="))
        return equal(v, x);
    if (!strcmp(name, "ne") || !strcmp(name, "!="))
        return !equal(v, x);
    if (!strcmp(name, "sameas"))
        return v.t == x.t && (v.t <= V_NONE || (v.t == V_BOOL && v.b == x.b) || equal(v, x));
    if (!strcmp(name, "lt") || !strcmp(name, "lessthan"))
        return compare(r, v, x, "<") < 0;
    if (!strcmp(name, "le"))
        return compare(r, v, x, "<=") <= 0;
    if (!strcmp(name, "gt") || !strcmp(name, "greaterthan"))
        return compare(r, v, x, ">") > 0;
    if (!strcmp(name, "ge"))
        return compare(r, v, x, ">=") >= 0;
    if (!strcmp(name, "in"))
        return contains(r, x, v);
    if (!strcmp(name, "lower") || !strcmp(name, "upper")) { /* str.islower(), str.isupper() */
        if (v.t != V_STR)
            return 0;
        int cased = 0;
        for (size_t i = 0; i < v.s->len;) {
            utf8proc_int32_t cp = next_cp(v.s, &i);
            utf8proc_category_t c = utf8proc_category(cp);
            if (c == UTF8PROC_CATEGORY_LT ||
                c == (name[0] == 'l' ? UTF8PROC_CATEGORY_LU : UTF8PROC_CATEGORY_LL))
                return 0;
            cased |= c == UTF8PROC_CATEGORY_LU || c == UTF8PROC_CATEGORY_LL;
        }
        return cased;
    }
    rfail(r, "'%s' is not a test loom's Jinja knows", name);
}

/* ---- filters -------------------------------------------------------------------------------- */

static jv apply_filter(render *r, const char *name, jv v, const args *a);

/* obj.attr or obj[attr] as map, selectattr and sort's attribute= find it ("a.b": nested) */
static jv attr_path(render *r, jv v, jv path)
{
    jstr *p = want_str(r, path, "attribute");
    size_t i = 0;
    while (i <= p->len) {
        const char *dot = memchr(p->s + i, '.', p->len - i);
        size_t e = dot ? (size_t)(dot - p->s) : p->len;
        if (v.t != V_DICT)
            return undef;
        int k = dict_find(v.d, p->s + i, e - i);
        v = k >= 0 ? v.d->v[k] : undef;
        i = e + 1;
    }
    return v;
}

static jv sort_key(render *r, jv v, jv attribute, int case_sensitive)
{
    if (attribute.t != V_UNDEF && attribute.t != V_NONE)
        v = attr_path(r, v, attribute);
    if (v.t == V_STR && !case_sensitive)
        return vstr(str_case(r, v.s, CASE_LOWER));
    return v;
}

static jv filter_sort(render *r, jv v, const args *a)
{
    static const char *const names[] = {"reverse", "case_sensitive", "attribute", NULL};
    check_args(r, a, 3, names, "sort");
    int rev = truthy(arg(a, 0, "reverse")), cs = truthy(arg(a, 1, "case_sensitive"));
    jv attribute = arg(a, 2, "attribute");
    jlist *in = iterate(r, v), *out = list_new(r, in->n + 1);
    jv *keys = aalloc(&r->a, (size_t)(in->n + 1) * sizeof *keys);
    for (int i = 0; i < in->n; i++) { /* stable insertion sort, as Python's sort is stable */
        jv k = sort_key(r, in->v[i], attribute, cs);
        int j = out->n;
        list_push(r, out, in->v[i]);
        while (j > 0) {
            step(r);
            int c = compare(r, keys[j - 1], k, "<");
            if (rev ? c >= 0 : c <= 0)
                break;
            out->v[j] = out->v[j - 1], keys[j] = keys[j - 1];
            j--;
        }
        out->v[j] = in->v[i], keys[j] = k;
    }
    return (jv){.t = V_LIST, .l = out};
}

static jv filter_indent(render *r, jv v, const args *a)
{
    static const char *const names[] = {"width", "first", "blank", NULL};
    check_args(r, a, 3, names, "indent");
    jstr *s = to_str(r, v);
    jv w = arg(a, 0, "width");
    jstr *ind;
    if (w.t == V_STR)
        ind = w.s;
    else {
        int64_t n = w.t == V_UNDEF ? 4 : ival(w);
        if (n < 0 || n > 1000)
            rfail(r, "indent: a width of %lld", (long long)n);
        char sp[1001];
        memset(sp, ' ', (size_t)n);
        ind = str_new(r, sp, (size_t)n);
    }
    int first = truthy(arg(a, 1, "first")), blank = truthy(arg(a, 2, "blank"));
    obuf b = {0};
    ob_put(r, &b, "", 0);
    if (first)
        ob_str(r, &b, ind);
    size_t i = 0;
    int line_no = 0;
    while (i < s->len) {
        const char *nl = memchr(s->s + i, '\n', s->len - i);
        size_t e = nl ? (size_t)(nl - s->s) : s->len;
        if (line_no > 0) {
            ob_puts(r, &b, "\n");
            if (blank || e > i)
                ob_str(r, &b, ind);
        }
        ob_str(r, &b, str_sub(r, s, i, e - i));
        line_no++;
        i = e + 1;
    }
    return vstr(ob_done(r, &b));
}

static jv filter_tojson(render *r, jv v, const args *a)
{
    static const char *const names[] = {"ensure_ascii", "indent", "separators", "sort_keys", NULL};
    check_args(r, a, 0, names, "tojson");
    json_opts o = {.indent = -1, .item_sep = ", ", .key_sep = ": "};
    o.ensure_ascii = truthy(arg(a, -1, "ensure_ascii"));
    o.sort_keys = truthy(arg(a, -1, "sort_keys"));
    jv ind = arg(a, -1, "indent");
    if (ind.t != V_UNDEF && ind.t != V_NONE) {
        if (!is_intlike(ind) || ival(ind) < 0 || ival(ind) > 64)
            rfail(r, "tojson: indent must be a whole number up to 64");
        o.indent = (int)ival(ind);
        o.item_sep = ",";
    }
    jv sep = arg(a, -1, "separators");
    if (sep.t == V_LIST && sep.l->n == 2 && sep.l->v[0].t == V_STR && sep.l->v[1].t == V_STR)
        o.item_sep = sep.l->v[0].s->s, o.key_sep = sep.l->v[1].s->s;
    else if (sep.t != V_UNDEF && sep.t != V_NONE)
        rfail(r, "tojson: separators must be two strings");
    obuf b = {0};
    ob_put(r, &b, "", 0);
    json_into(r, &b, v, &o, 0);
    jstr *s = ob_done(r, &b);
    if (any_taint(v))
        str_taint_all(r, s);
    return vstr(s);
}

static jv to_int(render *r, jv v, jv dflt)
{
    if (is_intlike(v))
        return vint(ival(v));
    if (v.t == V_FLOAT && isfinite(v.f) && fabs(v.f) < 9.2e18)
        return vint((int64_t)v.f);
    if (v.t == V_STR) {
        char *e;
        long long i = strtoll(v.s->s, &e, 10);
        while (isspace((unsigned char)*e))
            e++;
        if (!*e && e != v.s->s)
            return vint(i);
        double f = strtod(v.s->s, &e);
        while (isspace((unsigned char)*e))
            e++;
        if (!*e && e != v.s->s && isfinite(f) && fabs(f) < 9.2e18)
            return vint((int64_t)f);
    }
    (void)r;
    return dflt.t == V_UNDEF ? vint(0) : dflt;
}

static jv filter_select(render *r, jv v, const args *a, int by_attr, int keep)
{
    /* Jinja walks nothing when the value is false (none, an empty list) */
    jlist *in = truthy(v) ? iterate(r, v) : list_new(r, 1), *out = list_new(r, in->n + 1);
    out->gen = 1;
    int first_test = by_attr ? 1 : 0;
    jv tname = arg(a, first_test, NULL);
    args rest = {.pos = a->pos + first_test + 1,
                 .n = a->n > first_test + 1 ? a->n - first_test - 1 : 0};
    for (int i = 0; i < in->n; i++) {
        jv x = by_attr ? attr_path(r, in->v[i], arg(a, 0, NULL)) : in->v[i];
        int ok = tname.t == V_UNDEF
            ? truthy(x)
            : apply_test(r, want_str(r, tname, "a test's name")->s, x, &rest);
        if (ok == keep)
            list_push(r, out, in->v[i]);
    }
    return (jv){.t = V_LIST, .l = out};
}

static jv apply_filter(render *r, const char *name, jv v, const args *a)
{
    jv a0 = arg(a, 0, NULL);
    if (!strcmp(name, "trim") || !strcmp(name, "strip")) {
        jv chars = arg(a, 0, "chars");
        return vstr(str_strip(r, to_str(r, v), 1, 1, chars.t == V_STR ? chars.s : NULL));
    }
    if (!strcmp(name, "tojson"))
        return filter_tojson(r, v, a);
    if (!strcmp(name, "length") || !strcmp(name, "count")) {
        if (v.t == V_STR)
            return vint((int64_t)utf8_count(v.s));
        if (v.t == V_LIST && v.l->gen)
            rfail(r,
                  "a generator (what map, select, reject and reverse return) has no length: "
                  "add |list");
        if (v.t == V_LIST)
            return vint(v.l->n);
        if (v.t == V_DICT)
            return vint(v.d->n);
        if (v.t == V_UNDEF)
            return vint(0);
        rfail(r, "a %s has no length", type_name(v));
    }
    if (!strcmp(name, "join")) {
        jlist *l = iterate(r, v);
        jv sep = arg(a, 0, "d"), attribute = arg(a, 1, "attribute");
        obuf b = {0};
        ob_put(r, &b, "", 0);
        for (int i = 0; i < l->n; i++) {
            if (i && sep.t != V_UNDEF)
                ob_str(r, &b, to_str(r, sep));
            jv x = attribute.t == V_UNDEF ? l->v[i] : attr_path(r, l->v[i], attribute);
            ob_str(r, &b, to_str(r, x));
        }
        return vstr(ob_done(r, &b));
    }
    if (!strcmp(name, "items") || !strcmp(name, "dictsort")) {
        if (v.t == V_UNDEF)
            return (jv){.t = V_LIST, .l = list_new(r, 1)};
        if (v.t != V_DICT)
            rfail(r, "'%s' needs a dict, not a %s", name, type_name(v));
        jlist *l = list_new(r, v.d->n + 1);
        for (int i = 0; i < v.d->n; i++) {
            jlist *pair = list_new(r, 2);
            pair->tuple = 1;
            list_push(r, pair, vstr(v.d->k[i]));
            list_push(r, pair, v.d->v[i]);
            list_push(r, l, (jv){.t = V_LIST, .l = pair});
        }
        jv out = {.t = V_LIST, .l = l};
        if (name[0] == 'd') { /* by key, case-insensitively */
            jlist *sorted = list_new(r, l->n + 1);
            jv *keys = aalloc(&r->a, (size_t)(l->n + 1) * sizeof *keys);
            for (int i = 0; i < l->n; i++) {
                jv k = sort_key(r, l->v[i].l->v[0], undef, truthy(arg(a, 0, "case_sensitive")));
                int j = sorted->n;
                list_push(r, sorted, l->v[i]);
                while (j > 0 && (step(r), compare(r, keys[j - 1], k, "<") > 0)) {
                    sorted->v[j] = sorted->v[j - 1], keys[j] = keys[j - 1];
                    j--;
                }
                sorted->v[j] = l->v[i], keys[j] = k;
            }
            out.l = sorted;
        }
        return out;
    }
    if (!strcmp(name, "list")) {
        jlist *l = iterate(r, v), *o = list_new(r, l->n + 1);
        for (int i = 0; i < l->n; i++)
            list_push(r, o, l->v[i]);
        return (jv){.t = V_LIST, .l = o};
    }
    if (!strcmp(name, "string"))
        return vstr(to_str(r, v));
    if (!strcmp(name, "upper"))
        return vstr(str_case(r, to_str(r, v), CASE_UPPER));
    if (!strcmp(name, "lower"))
        return vstr(str_case(r, to_str(r, v), CASE_LOWER));
    if (!strcmp(name, "capitalize"))
        return vstr(str_case(r, to_str(r, v), CASE_CAPITALIZE));
    if (!strcmp(name, "title"))
        return vstr(str_case(r, to_str(r, v), CASE_TITLE));
    if (!strcmp(name, "replace")) {
        jv cnt = arg(a, 2, "count");
        return vstr(str_replace(r, to_str(r, v), to_str(r, a0), to_str(r, arg(a, 1, "new")),
                                cnt.t == V_UNDEF || cnt.t == V_NONE ? -1 : ival(cnt)));
    }
    if (!strcmp(name, "default") || !strcmp(name, "d")) {
        int boolean = truthy(arg(a, 1, "boolean"));
        jv dv = arg(a, 0, "default_value");
        if (v.t == V_UNDEF || (boolean && !truthy(v)))
            return dv.t == V_UNDEF ? vstr(str_new(r, "", 0)) : dv;
        return v;
    }
    if (!strcmp(name, "first") || !strcmp(name, "last")) {
        jlist *l = iterate(r, v);
        if (l->gen && name[0] == 'l')
            rfail(r,
                  "last: a generator (what map, select, reject and reverse return) cannot be "
                  "reversed: add |list");
        if (!l->n)
            return undef;
        return name[0] == 'f' ? l->v[0] : l->v[l->n - 1];
    }
    if (!strcmp(name, "reverse")) {
        if (v.t == V_STR)
            return do_slice(r, v, undef, undef, vint(-1));
        jlist *l = iterate(r, v), *o = list_new(r, l->n + 1);
        for (int i = l->n - 1; i >= 0; i--)
            list_push(r, o, l->v[i]);
        o->gen = 1;
        return (jv){.t = V_LIST, .l = o};
    }
    if (!strcmp(name, "int"))
        return to_int(r, v, arg(a, 0, "default"));
    if (!strcmp(name, "float")) {
        if (is_num(v))
            return vfloat(num(v));
        if (v.t == V_STR) {
            char *e;
            double f = strtod(v.s->s, &e);
            if (e != v.s->s && !*e)
                return vfloat(f);
        }
        jv d = arg(a, 0, "default");
        return d.t == V_UNDEF ? vfloat(0) : d;
    }
    if (!strcmp(name, "abs")) {
        if (v.t == V_FLOAT)
            return vfloat(fabs(v.f));
        if (is_intlike(v))
            return vint(ival(v) < 0 ? -ival(v) : ival(v));
        rfail(r, "abs needs a number, not a %s", type_name(v));
    }
    if (!strcmp(name, "round")) {
        if (!is_num(v))
            rfail(r, "round needs a number, not a %s", type_name(v));
        jv prec = arg(a, 0, "precision"), method = arg(a, 1, "method");
        double scale = pow(10, prec.t == V_UNDEF ? 0 : (double)ival(prec)), x = num(v) * scale;
        const char *m = method.t == V_STR ? method.s->s : "common";
        x = !strcmp(m, "ceil") ? ceil(x) : !strcmp(m, "floor") ? floor(x) : nearbyint(x);
        return vfloat(x / scale);
    }
    if (!strcmp(name, "sum")) {
        jlist *l = iterate(r, v);
        jv acc = arg(a, 1, "start");
        if (acc.t == V_UNDEF)
            acc = vint(0);
        jv attribute = arg(a, 0, "attribute");
        for (int i = 0; i < l->n; i++)
            acc = arith(r, '+', acc,
                        attribute.t == V_UNDEF ? l->v[i] : attr_path(r, l->v[i], attribute));
        return acc;
    }
    if (!strcmp(name, "min") || !strcmp(name, "max")) {
        jlist *l = iterate(r, v);
        if (!l->n)
            return undef;
        jv best = l->v[0];
        for (int i = 1; i < l->n; i++) {
            int c = compare(r, l->v[i], best, "<");
            if (name[1] == 'i' ? c < 0 : c > 0)
                best = l->v[i];
        }
        return best;
    }
    if (!strcmp(name, "unique")) {
        jlist *l = iterate(r, v), *o = list_new(r, l->n + 1);
        for (int i = 0; i < l->n; i++) {
            int seen = 0;
            charge(r, (size_t)o->n + 1);
            for (int j = 0; j < o->n && !seen; j++)
                seen = equal(o->v[j], l->v[i]);
            if (!seen)
                list_push(r, o, l->v[i]);
        }
        return (jv){.t = V_LIST, .l = o};
    }
    if (!strcmp(name, "sort"))
        return filter_sort(r, v, a);
    if (!strcmp(name, "indent"))
        return filter_indent(r, v, a);
    if (!strcmp(name, "safe")) {
        jstr *s = to_str(r, v), *o = str_sub(r, s, 0, s->len);
        o->markup = 1;
        return vstr(o);
    }
    if (!strcmp(name, "e") || !strcmp(name, "escape")) {
        jstr *s = to_str(r, v);
        if (s->markup)
            return vstr(s);
        return vstr(html_escape(r, s));
    }
    if (!strcmp(name, "map")) {
        jlist *l = truthy(v) ? iterate(r, v) : list_new(r, 1), *o = list_new(r, l->n + 1);
        o->gen = 1;
        jv attribute = arg(a, -1, "attribute");
        if (attribute.t != V_UNDEF) {
            jv dflt = arg(a, -1, "default");
            for (int i = 0; i < l->n; i++) {
                jv x = attr_path(r, l->v[i], attribute);
                list_push(r, o, x.t == V_UNDEF && dflt.t != V_UNDEF ? dflt : x);
            }
        } else {
            jstr *fname = want_str(r, a0, "map's filter name");
            args rest = {
                .pos = a->pos + 1, .n = a->n - 1, .kw = a->kw, .kwv = a->kwv, .n_kw = a->n_kw};
            for (int i = 0; i < l->n; i++)
                list_push(r, o, apply_filter(r, fname->s, l->v[i], &rest));
        }
        return (jv){.t = V_LIST, .l = o};
    }
    if (!strcmp(name, "select") || !strcmp(name, "reject"))
        return filter_select(r, v, a, 0, name[0] == 's');
    if (!strcmp(name, "selectattr") || !strcmp(name, "rejectattr"))
        return filter_select(r, v, a, 1, name[0] == 's');
    if (!strcmp(name, "wordcount")) {
        return vint(word_count(to_str(r, v)));
    }
    rfail(r, "'%s' is not a filter loom's Jinja knows", name);
}

/* ---- methods of strings and dicts, and the globals ----------------------------------------- */

static jv call_method(render *r, jv obj, const char *m, const args *a)
{
    jv a0 = arg(a, 0, NULL), a1 = arg(a, 1, NULL);
    if (obj.t == V_STR) {
        jstr *s = obj.s;
        charge_bytes(r, s->len); /* every method reads the string */
        if (!strcmp(m, "strip") || !strcmp(m, "lstrip") || !strcmp(m, "rstrip")) {
            const jstr *chars = a0.t == V_STR ? a0.s : NULL;
            return vstr(str_strip(r, s, m[0] != 'r', m[0] != 'l', chars));
        }
        if (!strcmp(m, "split") || !strcmp(m, "rsplit")) {
            jv sep = arg(a, 0, "sep"), maxs = arg(a, 1, "maxsplit");
            if (m[0] == 'r' && maxs.t != V_UNDEF && ival(maxs) >= 0)
                rfail(r, "rsplit with maxsplit is not supported");
            return (jv){.t = V_LIST,
                        .l = str_split(r, s, sep.t == V_STR ? sep.s : NULL,
                                       maxs.t == V_UNDEF ? -1 : ival(maxs))};
        }
        if (!strcmp(m, "startswith") || !strcmp(m, "endswith")) {
            int end = m[0] == 'e';
            if (a0.t == V_LIST) {
                for (int i = 0; i < a0.l->n; i++)
                    if (starts_with(s, want_str(r, a0.l->v[i], m), end))
                        return vbool(1);
                return vbool(0);
            }
            return vbool(starts_with(s, want_str(r, a0, m), end));
        }
        if (!strcmp(m, "upper"))
            return vstr(str_case(r, s, CASE_UPPER));
        if (!strcmp(m, "lower"))
            return vstr(str_case(r, s, CASE_LOWER));
        if (!strcmp(m, "title"))
            return vstr(str_case(r, s, CASE_TITLE));
        if (!strcmp(m, "capitalize"))
            return vstr(str_case(r, s, CASE_CAPITALIZE));
        if (!strcmp(m, "replace"))
            return vstr(str_replace(r, s, want_str(r, a0, m), want_str(r, a1, m),
                                    a->n > 2 ? ival(a->pos[2]) : -1));
        if (!strcmp(m, "find") || !strcmp(m, "count") || !strcmp(m, "index")) {
            /* s[start:end] as Python reads it: negatives from the end, end clipped; a start
             * past the end finds nothing, not even "" */
            jstr *n = want_str(r, a0, m);
            jv from = arg(a, 1, NULL), to = arg(a, 2, NULL);
            int64_t len = (int64_t)utf8_count(s), lo = 0, hi = len;
            if (from.t != V_UNDEF && from.t != V_NONE)
                lo = ival(from) < 0 ? (ival(from) + len < 0 ? 0 : ival(from) + len) : ival(from);
            if (to.t != V_UNDEF && to.t != V_NONE)
                hi = ival(to) < 0    ? (ival(to) + len < 0 ? 0 : ival(to) + len)
                    : ival(to) > len ? len
                                     : ival(to);
            int found = hi - lo >= (int64_t)utf8_count(n) && hi >= lo;
            size_t b0 = found ? utf8_offset(s, (size_t)lo) : 0,
                   b1 = found ? utf8_offset(s, (size_t)hi) : 0;
            if (m[0] == 'c') {
                int64_t c = 0;
                if (found && !n->len)
                    return vint(hi - lo + 1);
                for (const char *h = s->s + b0;
                     found && (h = memmem(h, b1 - (size_t)(h - s->s), n->s, n->len)); h += n->len)
                    c++;
                return vint(c);
            }
            const char *h = found ? memmem(s->s + b0, b1 - b0, n->s, n->len) : NULL;
            if (found && !n->len)
                h = s->s + b0;
            if (!h && m[0] == 'i')
                rfail(r, "index: substring not found");
            if (!h)
                return vint(-1);
            size_t cps = 0;
            for (const char *c = s->s + b0; c < h; c++)
                cps += ((unsigned char)*c & 0xc0) != 0x80;
            return vint(lo + (int64_t)cps);
        }
        if (!strcmp(m, "join")) {
            jlist *l = iterate(r, a0);
            obuf b = {0};
            ob_put(r, &b, "", 0);
            for (int i = 0; i < l->n; i++) {
                if (i)
                    ob_str(r, &b, s);
                ob_str(r, &b, want_str(r, l->v[i], "join"));
            }
            return vstr(ob_done(r, &b));
        }
        if (!strcmp(m, "splitlines")) {
            jlist *parts = str_split(r, s, str_c(r, "\n"), -1);
            if (parts->n && parts->v[parts->n - 1].s->len == 0)
                parts->n--;
            return (jv){.t = V_LIST, .l = parts};
        }
        if (!strncmp(m, "is", 2)) {
            int (*cls)(int) = !strcmp(m, "isdigit") ? isdigit
                : !strcmp(m, "isalpha")             ? isalpha
                : !strcmp(m, "isalnum")             ? isalnum
                : !strcmp(m, "isspace")             ? isspace
                                                    : NULL;
            if (cls) {
                if (!s->len)
                    return vbool(0);
                for (size_t i = 0; i < s->len; i++)
                    if (!cls((unsigned char)s->s[i]))
                        return vbool(0);
                return vbool(1);
            }
        }
    } else if (obj.t == V_DICT) {
        if (!strcmp(m, "items"))
            return apply_filter(r, "items", obj, &(args){0});
        if (!strcmp(m, "keys"))
            return (jv){.t = V_LIST, .l = iterate(r, obj)};
        if (!strcmp(m, "values")) {
            jlist *l = list_new(r, obj.d->n + 1);
            for (int i = 0; i < obj.d->n; i++)
                list_push(r, l, obj.d->v[i]);
            return (jv){.t = V_LIST, .l = l};
        }
        if (!strcmp(m, "get")) {
            jstr *k = want_str(r, a0, "get");
            int i = dict_find(obj.d, k->s, k->len);
            return i >= 0 ? obj.d->v[i] : a->n > 1 ? a1 : none_v;
        }
        int i = dict_find(obj.d, m, strlen(m)); /* a macro stored in a dict */
        if (i >= 0 && obj.d->v[i].t == V_MACRO)
            return call_macro(r, obj.d->v[i].m, a, NULL);
    } else if (obj.t == V_UNDEF) {
        rfail(r, "'%s' called on an undefined value", m);
    }
    if (obj.t == V_LIST &&
        (!strcmp(m, "append") || !strcmp(m, "pop") || !strcmp(m, "extend") ||
         !strcmp(m, "insert") || !strcmp(m, "remove")))
        rfail(r, "%s.%s(): templates cannot change a list (as in transformers' sandbox)",
              type_name(obj), m);
    rfail(r, "a %s has no method '%s' in loom's Jinja", type_name(obj), m);
}

/* the functions templates see as globals (transformers adds raise_exception, strftime_now) */
static const char *const global_names[] = {"range",           "namespace",    "dict",
                                           "raise_exception", "strftime_now", NULL};

static jv global_named(const char *name)
{
    for (int i = 0; global_names[i]; i++)
        if (!strcmp(name, global_names[i]))
            return (jv){.t = V_FUNC, .fn = global_names[i]};
    return undef;
}

static jv call_global(render *r, const char *name, const args *a)
{
    if (!strcmp(name, "range")) {
        int64_t start = 0, stop, stp = 1;
        for (int i = 0; i < a->n; i++)
            if (!is_intlike(a->pos[i]))
                rfail(r, "range needs integers");
        if (a->n == 1)
            stop = ival(a->pos[0]);
        else if (a->n == 2 || a->n == 3) {
            start = ival(a->pos[0]), stop = ival(a->pos[1]);
            if (a->n == 3)
                stp = ival(a->pos[2]);
        } else
            rfail(r, "range takes 1 to 3 arguments");
        if (stp == 0)
            rfail(r, "range's step cannot be zero");
        int64_t n = stp > 0 ? (stop > start ? (stop - start + stp - 1) / stp : 0)
                            : (start > stop ? (start - stop - stp - 1) / -stp : 0);
        if (n > r->lim.max_steps - r->steps || n > INT_MAX / 2)
            rfail(r, "range(%lld) is longer than the template may loop", (long long)n);
        jlist *l = list_new(r, (int)n + 1);
        for (int64_t i = 0; i < n; i++)
            list_push(r, l, vint(start + i * stp));
        return (jv){.t = V_LIST, .l = l};
    }
    if (!strcmp(name, "namespace") || !strcmp(name, "dict")) {
        jdict *d = dict_new(r);
        d->ns = name[0] == 'n';
        for (int i = 0; i < a->n; i++) {
            if (a->pos[i].t != V_DICT)
                rfail(r, "%s() takes a dict or keyword arguments", name);
            for (int k = 0; k < a->pos[i].d->n; k++)
                dict_set(r, d, a->pos[i].d->k[k], a->pos[i].d->v[k]);
        }
        for (int i = 0; i < a->n_kw; i++)
            dict_set(r, d, str_c(r, a->kw[i]), a->kwv[i]);
        return (jv){.t = V_DICT, .d = d};
    }
    if (!strcmp(name, "raise_exception")) {
        jstr *msg = to_str(r, arg(a, 0, NULL));
        r->line = 0;
        rfail(r, "the template refused: %s", msg->s);
    }
    if (!strcmp(name, "strftime_now")) {
        jstr *fmt = want_str(r, arg(a, 0, NULL), "strftime_now");
        time_t now = time(NULL);
        struct tm tm;
        localtime_r(&now, &tm);
        /* strftime says 0 both for a text that does not fit and for an empty one: a larger
         * buffer tells them apart (no conversion writes more than 128 bytes) */
        charge_bytes(r, fmt->len);
        size_t cap = 256, n = 0;
        char *buf = NULL;
        for (; cap <= 128 * fmt->len + 256; cap *= 2)
            if ((n = strftime(buf = aalloc(&r->a, cap), cap, fmt->s, &tm)) > 0)
                break;
        return vstr(str_new(r, buf, n));
    }
    rfail(r, "'%s' is undefined (not a function loom's Jinja knows)", name);
}

/* ---- evaluation ----------------------------------------------------------------------------- */

static const char *node_label(const node *n)
{
    return n->kind == N_NAME ? n->name : n->kind == N_ATTR ? n->name : "a value";
}

static jv get_attr(render *r, jv obj, const char *name, const node *of)
{
    switch (obj.t) {
    case V_UNDEF: rfail(r, "'%s' is undefined, so it has no '%s'", node_label(of), name);
    case V_DICT: {
        int i = dict_find(obj.d, name, strlen(name));
        if (i >= 0 && !obj.d->ns) {
            static const char *const methods[] = {"items",  "keys",       "values", "get",   "pop",
                                                  "update", "setdefault", "copy",   "clear", NULL};
            for (int k = 0; methods[k]; k++)
                if (!strcmp(name, methods[k]))
                    rfail(r, "'.%s' names the dict method here, not the key: write ['%s']", name,
                          name);
        }
        return i >= 0 ? obj.d->v[i] : undef;
    }
    default: return undef;
    }
}

static jv get_item(render *r, jv obj, jv key, const node *of)
{
    switch (obj.t) {
    case V_UNDEF: rfail(r, "'%s' is undefined, so it cannot be indexed", node_label(of));
    case V_DICT:
        if (key.t != V_STR)
            return undef;
        {
            int i = dict_find(obj.d, key.s->s, key.s->len);
            return i >= 0 ? obj.d->v[i] : undef;
        }
    case V_LIST:
        if (obj.l->gen)
            rfail(r,
                  "a generator (what map, select, reject and reverse return) cannot be "
                  "indexed: add |list");
        if (!is_intlike(key))
            return undef;
        {
            int64_t i = ival(key);
            if (i < 0)
                i += obj.l->n;
            return i >= 0 && i < obj.l->n ? obj.l->v[i] : undef;
        }
    case V_STR:
        if (!is_intlike(key))
            return undef;
        {
            int64_t n = (int64_t)utf8_count(obj.s), i = ival(key);
            if (i < 0)
                i += n;
            if (i < 0 || i >= n)
                return undef;
            size_t a = utf8_offset(obj.s, (size_t)i), b = utf8_offset(obj.s, (size_t)i + 1);
            return vstr(str_sub(r, obj.s, a, b - a));
        }
    default: return undef;
    }
}

static jv eval_call(render *r, frame *f, const node *n, jmacro *caller)
{
    const node *callee = n->a;
    if (callee->kind == N_ATTR) {
        jv obj = eval(r, f, callee->a);
        args a = eval_args(r, f, n);
        if (obj.t == V_DICT) { /* a macro stored under that key is called, not a method */
            int i = dict_find(obj.d, callee->name, strlen(callee->name));
            if (i >= 0 && obj.d->v[i].t == V_MACRO)
                return call_macro(r, obj.d->v[i].m, &a, caller);
        }
        return call_method(r, obj, callee->name, &a);
    }
    if (callee->kind == N_NAME) {
        jv v;
        args a = eval_args(r, f, n);
        if (frame_get(f, callee->name, &v)) {
            if (v.t == V_MACRO)
                return call_macro(r, v.m, &a, caller);
            if (v.t == V_FUNC)
                return call_global(r, v.fn, &a);
            rfail(r, "'%s' is a %s, not something to call", callee->name, type_name(v));
        }
        return call_global(r, callee->name, &a);
    }
    jv v = eval(r, f, callee);
    if (v.t != V_MACRO && v.t != V_FUNC)
        rfail(r, "a %s is not something to call", type_name(v));
    args a = eval_args(r, f, n);
    return v.t == V_FUNC ? call_global(r, v.fn, &a) : call_macro(r, v.m, &a, caller);
}

static jv eval(render *r, frame *f, const node *n)
{
    if (!n)
        return undef;
    step(r);
    if (++r->depth > r->lim.max_depth + 64)
        rfail(r, "expressions nested more than %d deep", r->lim.max_depth);
    int saved_line = r->line;
    r->line = n->line;
    jv v = undef;
    switch (n->kind) {
    case N_LIT: v = n->lit.t == V_STR ? vstr(str_new(r, n->text, n->text_len)) : n->lit; break;
    case N_NAME:
        if (!frame_get(f, n->name, &v))
            v = global_named(n->name);
        break;
    case N_ATTR: v = get_attr(r, eval(r, f, n->a), n->name, n->a); break;
    case N_INDEX: v = get_item(r, eval(r, f, n->a), eval(r, f, n->b), n->a); break;
    case N_SLICE: {
        jv obj = eval(r, f, n->a);
        if (obj.t == V_UNDEF)
            rfail(r, "'%s' is undefined, so it cannot be sliced", node_label(n->a));
        v = do_slice(r, obj, eval(r, f, n->items[0]), eval(r, f, n->items[1]),
                     eval(r, f, n->items[2]));
        break;
    }
    case N_CALL: v = eval_call(r, f, n, NULL); break;
    case N_FILTER: {
        jv x = eval(r, f, n->a);
        args a = eval_args(r, f, n);
        v = apply_filter(r, n->name, x, &a);
        break;
    }
    case N_TEST: {
        jv x = eval(r, f, n->a);
        args a = eval_args(r, f, n);
        v = vbool(apply_test(r, n->name, x, &a) != n->op);
        break;
    }
    case N_BIN: {
        jv a = eval(r, f, n->a), b = eval(r, f, n->b);
        char o0 = (char)(n->op & 0xff), o1 = (char)(n->op >> 8);
        if ((o0 == '=' || o0 == '!') && o1 == '=' && a.t == V_STR && b.t == V_STR)
            charge_bytes(r, a.s->len < b.s->len ? a.s->len : b.s->len);
        if (o0 == '=' && o1 == '=')
            v = vbool(equal(a, b));
        else if (o0 == '!' && o1 == '=')
            v = vbool(!equal(a, b));
        else if (o0 == 'i' && o1 == 'n')
            v = vbool(contains(r, b, a));
        else if (o0 == 'n' && o1 == 'i')
            v = vbool(!contains(r, b, a));
        else if (o0 == '<' || o0 == '>') {
            char op[3] = {o0, o1, 0};
            int c = compare(r, a, b, op);
            v = vbool(o0 == '<' ? (o1 ? c <= 0 : c < 0) : (o1 ? c >= 0 : c > 0));
        } else
            v = arith(r, n->op, a, b);
        break;
    }
    case N_NEG:
    case N_POS: {
        jv x = eval(r, f, n->a);
        if (!is_num(x))
            rfail(r, "unary '%c' needs a number, not a %s", n->kind == N_NEG ? '-' : '+',
                  type_name(x));
        v = n->kind == N_POS ? (x.t == V_BOOL ? vint(x.b) : x)
            : x.t == V_FLOAT ? vfloat(-x.f)
                             : arith(r, '-', vint(0), x);
        break;
    }
    case N_NOT: v = vbool(!truthy(eval(r, f, n->a))); break;
    case N_AND:
        v = eval(r, f, n->a);
        if (truthy(v))
            v = eval(r, f, n->b);
        break;
    case N_OR:
        v = eval(r, f, n->a);
        if (!truthy(v))
            v = eval(r, f, n->b);
        break;
    case N_COND:
        v = truthy(eval(r, f, n->b)) ? eval(r, f, n->a) : n->c ? eval(r, f, n->c) : undef;
        break;
    case N_CONCAT: {
        obuf b = {0};
        ob_put(r, &b, "", 0);
        for (int i = 0; i < n->n_items; i++)
            ob_str(r, &b, to_str(r, eval(r, f, n->items[i])));
        v = vstr(ob_done(r, &b));
        break;
    }
    case N_LIST:
    case N_TUPLE: {
        jlist *l = list_new(r, n->n_items + 1);
        l->tuple = n->kind == N_TUPLE;
        for (int i = 0; i < n->n_items; i++)
            list_push(r, l, eval(r, f, n->items[i]));
        v = (jv){.t = V_LIST, .l = l};
        break;
    }
    case N_DICT: {
        jdict *d = dict_new(r);
        for (int i = 0; i < n->n_items; i++) {
            jv k = eval(r, f, n->items[i]);
            if (k.t != V_STR)
                rfail(r, "dict keys must be strings here, not %s", type_name(k));
            dict_set(r, d, k.s, eval(r, f, n->kw_vals[i]));
        }
        v = (jv){.t = V_DICT, .d = d};
        break;
    }
    default: rfail(r, "a statement where a value belongs");
    }
    r->line = saved_line;
    r->depth--;
    return v;
}

/* ---- statements ----------------------------------------------------------------------------- */

static void bind_targets(render *r, frame *f, const node *n, jv v)
{
    if (n->n_kw == 1) {
        frame_set(r, f, n->kw[0], v);
        return;
    }
    jlist *l = v.t == V_LIST ? v.l : NULL;
    if (!l || l->n != n->n_kw)
        rfail(r, "cannot unpack a %s into %d names", type_name(v), n->n_kw);
    for (int i = 0; i < n->n_kw; i++)
        frame_set(r, f, n->kw[i], l->v[i]);
}

static jv loop_info(render *r, const jlist *items, int i)
{
    jdict *d = dict_new(r);
    int n = items->n;
    dict_set(r, d, str_c(r, "index"), vint(i + 1));
    dict_set(r, d, str_c(r, "index0"), vint(i));
    dict_set(r, d, str_c(r, "revindex"), vint(n - i));
    dict_set(r, d, str_c(r, "revindex0"), vint(n - i - 1));
    dict_set(r, d, str_c(r, "first"), vbool(i == 0));
    dict_set(r, d, str_c(r, "last"), vbool(i == n - 1));
    dict_set(r, d, str_c(r, "length"), vint(n));
    dict_set(r, d, str_c(r, "previtem"), i > 0 ? items->v[i - 1] : undef);
    dict_set(r, d, str_c(r, "nextitem"), i < n - 1 ? items->v[i + 1] : undef);
    return (jv){.t = V_DICT, .d = d};
}

static void exec_for(render *r, frame *f, const node *n)
{
    jlist *items = iterate(r, eval(r, f, n->a));
    if (n->b) { /* for x in xs if cond: loop.* counts the kept items */
        jlist *kept = list_new(r, items->n + 1);
        for (int i = 0; i < items->n; i++) {
            frame *t = frame_new(r, f);
            bind_targets(r, t, n, items->v[i]);
            if (truthy(eval(r, t, n->b)))
                list_push(r, kept, items->v[i]);
        }
        items = kept;
    }
    for (int i = 0; i < items->n; i++) {
        step(r);
        frame *it = frame_new(r, f);
        bind_targets(r, it, n, items->v[i]);
        frame_set(r, it, "loop", loop_info(r, items, i));
        exec_body(r, it, n->c);
        if (r->loop_ctl == 1) {
            r->loop_ctl = 0;
            break;
        }
        r->loop_ctl = 0;
    }
    if (!items->n && n->d)
        exec_body(r, frame_new(r, f), n->d);
}

static void exec_stmt(render *r, frame *f, const node *n)
{
    step(r);
    r->line = n->line;
    switch (n->kind) {
    case N_TEXT: ob_put(r, r->out, n->text, n->text_len); break;
    case N_OUT: ob_str(r, r->out, to_str(r, eval(r, f, n->a))); break;
    case N_BODY: exec_body(r, f, n); break;
    case N_IF:
        if (truthy(eval(r, f, n->a)))
            exec_body(r, f, n->b);
        else if (n->c)
            exec_body(r, f, n->c);
        break;
    case N_FOR: exec_for(r, f, n); break;
    case N_SET: bind_targets(r, f, n, eval(r, f, n->a)); break;
    case N_SET_ATTR: {
        jv ns;
        if (!frame_get(f, n->name, &ns) || ns.t != V_DICT || !ns.d->ns)
            rfail(r, "'%s' is not a namespace: only namespace() attributes can be set", n->name);
        dict_set(r, ns.d, str_c(r, n->text), eval(r, f, n->a));
        break;
    }
    case N_SET_BLOCK: {
        obuf b, *old = capture_begin(r, &b);
        exec_body(r, f, n->b);
        r->out = old;
        frame_set(r, f, n->name, vstr(ob_done(r, &b)));
        break;
    }
    case N_MACRO: {
        jmacro *m = aalloc(&r->a, sizeof *m);
        m->def = n, m->scope = f;
        frame_set(r, f, n->name, (jv){.t = V_MACRO, .m = m});
        break;
    }
    case N_CALL_BLOCK: {
        jmacro *caller = aalloc(&r->a, sizeof *caller);
        caller->def = n, caller->scope = f;
        ob_str(r, r->out, to_str(r, eval_call(r, f, n->a, caller)));
        break;
    }
    case N_FILTER_BLOCK: {
        obuf b, *old = capture_begin(r, &b);
        exec_body(r, f, n->b);
        r->out = old;
        /* the filter chain reads the captured text from its placeholder's name */
        frame *t = frame_new(r, f);
        frame_set(r, t, FILTER_BLOCK_SLOT, vstr(ob_done(r, &b)));
        ob_str(r, r->out, to_str(r, eval(r, t, n->a)));
        break;
    }
    case N_BREAK: r->loop_ctl = 1; break;
    case N_CONTINUE: r->loop_ctl = 2; break;
    default: ob_str(r, r->out, to_str(r, eval(r, f, n)));
    }
}

static void exec_body(render *r, frame *f, const node *body)
{
    if (!body)
        return;
    if (++r->depth > r->lim.max_depth + 64)
        rfail(r, "blocks nested more than %d deep", r->lim.max_depth);
    for (int i = 0; i < body->n_items && !r->loop_ctl; i++)
        exec_stmt(r, f, body->items[i]);
    r->depth--;
}

/* ---- the entry: JSON in, text and spans out ------------------------------------------------- */

static jv from_json(render *r, const cJSON *j, int untrusted, int depth)
{
    if (depth > r->lim.max_depth)
        rfail(r, "the variables are nested more than %d deep", r->lim.max_depth);
    if (cJSON_IsNull(j))
        return none_v;
    if (cJSON_IsBool(j))
        return vbool(cJSON_IsTrue(j));
    if (cJSON_IsNumber(j)) {
        double d = j->valuedouble;
        if (d == floor(d) && fabs(d) < 9007199254740992.0)
            return vint((int64_t)d);
        return vfloat(d);
    }
    if (cJSON_IsString(j)) {
        jstr *s = str_c(r, j->valuestring);
        if (untrusted)
            str_taint_all(r, s);
        return vstr(s);
    }
    if (cJSON_IsArray(j)) {
        jlist *l = list_new(r, cJSON_GetArraySize(j) + 1);
        for (const cJSON *c = j->child; c; c = c->next)
            list_push(r, l, from_json(r, c, untrusted, depth + 1));
        return (jv){.t = V_LIST, .l = l};
    }
    if (cJSON_IsObject(j)) {
        jdict *d = dict_new(r);
        for (const cJSON *c = j->child; c; c = c->next) {
            jstr *k = str_c(r, c->string ? c->string : "");
            if (untrusted)
                str_taint_all(r, k);
            dict_set(r, d, k, from_json(r, c, untrusted, depth + 1));
        }
        return (jv){.t = V_DICT, .d = d};
    }
    return undef;
}

int jinja_render(const jinja_template *t, const cJSON *vars, const char *const *untrusted,
                 const jinja_limits *limits, char **out, size_t *out_len, loom_text_span **spans,
                 int *n_spans, char *err, size_t err_size)
{
    render *r = calloc(1, sizeof *r);
    if (!r) {
        snprintf(err, err_size, "out of memory");
        return -1;
    }
    r->err = err, r->err_size = err_size;
    r->lim = limits ? *limits : (jinja_limits){0};
    if (!r->lim.max_output)
        r->lim.max_output = (size_t)16 << 20;
    if (!r->lim.max_memory)
        r->lim.max_memory = (size_t)256 << 20;
    if (!r->lim.max_steps)
        r->lim.max_steps = 20000000;
    if (!r->lim.max_depth)
        r->lim.max_depth = 200;
    if (!r->lim.max_ms)
        r->lim.max_ms = 10000;
    r->deadline = monotonic_s() + r->lim.max_ms / 1e3;
    r->a.limit = r->lim.max_memory;
    r->a.fail = &r->fail, r->a.err = err, r->a.err_size = err_size;
    int rc = -1;
    if (setjmp(r->fail) == 0) {
        r->root = frame_new(r, NULL);
        for (const cJSON *c = vars ? vars->child : NULL; c; c = c->next) {
            int u = 0;
            for (int i = 0; untrusted && untrusted[i]; i++)
                u |= c->string && !strcmp(c->string, untrusted[i]);
            frame_set(r, r->root, c->string ? c->string : "", from_json(r, c, u, 0));
        }
        obuf o = {0};
        ob_put(r, &o, "", 0);
        r->out = &o;
        exec_body(r, r->root, t->body);
        char *text = malloc(o.n + 1);
        loom_text_span *sp = spans && o.nt ? malloc((size_t)o.nt * sizeof *sp) : NULL;
        if (!text || (spans && o.nt && !sp)) {
            free(text);
            free(sp);
            snprintf(err, err_size, "out of memory");
        } else {
            memcpy(text, o.s, o.n + 1);
            for (int i = 0; sp && i < o.nt; i++)
                sp[i] = (loom_text_span){o.t[i].start, o.t[i].end};
            *out = text;
            if (out_len)
                *out_len = o.n;
            if (spans)
                *spans = sp, *n_spans = o.nt;
            rc = 0;
        }
    }
    arena_free(&r->a);
    free(r);
    return rc;
}
