/*
 * chat/json_schema.c - a JSON Schema turned into the GBNF grammar of the JSON texts it allows,
 * for constrained decoding (docs/structured-output.md lists the keywords).
 *
 * Every text the grammar allows validates against the schema; not every valid text is allowed:
 * properties come in the schema's order, an object with "properties" takes no others unless
 * "additionalProperties" says so, whitespace between tokens is a space or a newline and up
 * to 20 spaces or tabs (pretty-printing), and
 * numbers have at most 16 digits before the point. A keyword that would constrain the answer
 * in a way loom does not follow is refused with its name, never ignored; annotations (title,
 * description, default, examples, ...) are ignored.
 */
#define _GNU_SOURCE
#include "chat/grammar.h"
#include "api/internal.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A schema's grammar is bounded while it is made: a few hundred bytes of schema (types listed
 * over and over, anyOf within anyOf) can otherwise describe gigabytes of grammar. Every byte
 * written counts against the conversion's budget (so does copying a rule's text into another),
 * and so does every rule. */
#define MAX_SCHEMA_GRAMMAR_BYTES (1 << 20)
#define MAX_SCHEMA_RULES 16384

typedef struct text {
    char *s;
    size_t n, cap;
    int oom;
    size_t *budget; /* bytes the conversion may still write (NULL: no limit) */
} text;

static void put(text *t, const char *fmt, ...)
{
    va_list ap, ap2;
    va_start(ap, fmt);
    va_copy(ap2, ap);
    int k = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (k >= 0 && t->budget) {
        if (*t->budget < (size_t)k)
            t->oom = 1, *t->budget = 0; /* conv's check names it as the budget's */
        else
            *t->budget -= (size_t)k;
    }
    if (k < 0 || t->oom ||
        (t->n + (size_t)k + 1 > t->cap &&
         !(t->s = realloc(t->s, t->cap = (t->n + (size_t)k + 1) * 2)))) {
        t->oom = 1;
        va_end(ap2);
        return;
    }
    vsnprintf(t->s + t->n, (size_t)k + 1, fmt, ap2);
    va_end(ap2);
    t->n += (size_t)k;
}

typedef struct conv {
    const cJSON *root;
    size_t budget; /* of grammar bytes (MAX_SCHEMA_GRAMMAR_BYTES at the start) */
    text rules;    /* the schema's own rules */
    int n_rules;
    struct {
        const cJSON *schema;
        int rule;
    } refs[256]; /* $ref targets already given a rule (recursion goes through them) */
    int n_refs, depth;
    char *err;
    size_t err_size;
    int failed;
} conv;

/* a text whose bytes count against c's budget */
#define TEXT(c)                                                                                    \
    {                                                                                              \
        .budget = &(c)->budget                                                                     \
    }

#define OVER_BUDGET                                                                                \
    "the schema's grammar would pass %d bytes (types listed over and over, or schemas nested "     \
    "in alternatives, multiply it); simplify the schema"

static int fail(conv *c, const char *fmt, ...)
{
    if (!c->failed && !c->budget) /* what ran out first, whatever failed on it */
        snprintf(c->err, c->err_size, OVER_BUDGET, MAX_SCHEMA_GRAMMAR_BYTES);
    else if (!c->failed) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->err, c->err_size, fmt, ap);
        va_end(ap);
    }
    c->failed = 1;
    return -1;
}

/* What every schema's grammar may use. */
static const char json_rules[] =
    "ws ::= (\" \" | \"\\n\" [ \\t]{0,20})?\n"
    /* one character as JSON writes it: a surrogate pair's two escapes are one (as Python and
     * JSON Schema count minLength), a lone surrogate none */
    "json-char ::= [^\"\\\\\\x00-\\x1f] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" json-bmp | \"u\" [dD] "
    "[89abAB] [0-9a-fA-F]{2} \"\\\\u\" [dD] [c-fC-F] [0-9a-fA-F]{2})\n"
    "json-bmp ::= [0-9a-cA-Ce-fE-F] [0-9a-fA-F]{3} | [dD] [0-7] [0-9a-fA-F]{2}\n"
    /* a character of an undeclared key: each one written one way only (no \\u, no \\/), so
     * that a declared name cannot come back spelled otherwise */
    "json-key-char ::= [^\"\\\\\\x00-\\x1f] | \"\\\\\" [\"\\\\bfnrt]\n"
    "json-string ::= \"\\\"\" json-char* \"\\\"\"\n"
    "json-int ::= \"-\"? ([0-9] | [1-9] [0-9]{1,15})\n"
    "json-number ::= json-int (\".\" [0-9]{1,16})? ([eE] [-+]? [0-9]{1,3})?\n"
    "json-bool ::= \"true\" | \"false\"\n"
    "json-null ::= \"null\"\n"
    "json-value ::= json-object | json-array | json-string | json-number | json-bool | json-null\n"
    "json-object ::= \"{\" ws (json-string ws \":\" ws json-value ws (\",\" ws json-string ws \":\" "
    "ws json-value ws)*)? \"}\"\n"
    "json-array ::= \"[\" ws (json-value ws (\",\" ws json-value ws)*)? \"]\"\n"
    /* each month's days (February's 28: a year's leap is not checked) */
    "json-date ::= [1-9] [0-9]{3} \"-\" ((\"0\" [13578] | \"1\" [02]) \"-\" json-day31 | (\"0\" "
    "[469] | \"11\") \"-\" json-day30 | \"02-\" json-day28)\n"
    "json-day28 ::= \"0\" [1-9] | \"1\" [0-9] | \"2\" [0-8]\n"
    "json-day30 ::= json-day28 | \"29\" | \"30\"\n"
    "json-day31 ::= json-day30 | \"31\"\n"
    "json-time ::= ([01] [0-9] | \"2\" [0-3]) \":\" [0-5] [0-9] \":\" [0-5] [0-9] (\".\" [0-9]{1,6})? "
    "(\"Z\" | [+-] ([01] [0-9] | \"2\" [0-3]) \":\" [0-5] [0-9])\n"
    "json-uuid ::= [0-9a-fA-F]{8} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} \"-\" "
    "[0-9a-fA-F]{12}\n";

/* a GBNF literal for bytes s (n of them) */
static void put_literal(text *t, const char *s, size_t n)
{
    put(t, "\"");
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch == '"' || ch == '\\')
            put(t, "\\%c", ch);
        else if (ch == '\n')
            put(t, "\\n");
        else if (ch < 0x20)
            put(t, "\\x%02x", ch);
        else
            put(t, "%c", ch);
    }
    put(t, "\"");
}

/* the literal of a JSON value's compact text */
static int put_json_literal(conv *c, text *t, const cJSON *v)
{
    char *s = cJSON_PrintUnformatted(v);
    if (!s)
        return fail(c, "out of memory");
    put_literal(t, s, strlen(s));
    free(s);
    return 0;
}

static int gen(conv *c, const cJSON *schema, text *out);

/* a new rule holding body; its name written to out */
static int add_rule(conv *c, const text *body, text *out)
{
    int k = c->n_rules++;
    put(&c->rules, "s%d ::= %s\n", k, body->s ? body->s : "\"\"");
    put(out, "s%d", k);
    return 0;
}

/* What ref ("#" or "#/a/b", a JSON Pointer into root) names, or NULL (*oom set when for want
 * of memory). */
static const cJSON *lookup_ref(const cJSON *root, const char *ref, int *oom)
{
    *oom = 0;
    if (!strcmp(ref, "#"))
        return root;
    if (strncmp(ref, "#/", 2))
        return NULL;
    const cJSON *at = root;
    char *path = strdup(ref + 2), *save = NULL;
    if (!path) {
        *oom = 1;
        return NULL;
    }
    for (char *part = strtok_r(path, "/", &save); part && at; part = strtok_r(NULL, "/", &save)) {
        /* JSON Pointer escapes: ~1 is '/', ~0 is '~' */
        char *w = part;
        for (char *r = part; *r; r++, w++)
            *w = r[0] == '~' && r[1] == '1'  ? (r++, '/')
                : r[0] == '~' && r[1] == '0' ? (r++, '~')
                                             : *r;
        *w = 0;
        at = cJSON_GetObjectItemCaseSensitive(at, part);
    }
    free(path);
    return at;
}

static const cJSON *resolve_ref(conv *c, const char *ref)
{
    int oom;
    const cJSON *at = lookup_ref(c->root, ref, &oom);
    if (!at && oom)
        fail(c, "out of memory");
    else if (!at && strcmp(ref, "#") && strncmp(ref, "#/", 2))
        fail(c, "$ref '%s': only references inside the schema (#/...) are supported", ref);
    else if (!at)
        fail(c, "$ref '%s' points to nothing in the schema", ref);
    return at;
}

/* s, or what its $ref leads to (8 hops at most); a bad $ref is reported where it is
 * generated, not here */
static const cJSON *deref(const cJSON *root, const cJSON *s)
{
    int oom;
    for (int hops = 0; hops < 8; hops++) {
        const cJSON *ref = cJSON_GetObjectItemCaseSensitive(s, "$ref");
        const cJSON *target = cJSON_IsString(ref) ? lookup_ref(root, ref->valuestring, &oom) : NULL;
        if (!target)
            return s;
        s = target;
    }
    return s;
}

static int gen_ref(conv *c, const char *ref, text *out)
{
    const cJSON *target = resolve_ref(c, ref);
    if (!target)
        return -1;
    for (int i = 0; i < c->n_refs; i++)
        if (c->refs[i].schema == target) {
            put(out, "s%d", c->refs[i].rule);
            return 0;
        }
    if (c->n_refs == (int)(sizeof c->refs / sizeof *c->refs))
        return fail(c, "more than %d distinct $ref targets", c->n_refs);
    int k = c->n_rules++; /* named before its body: the body may refer to it */
    c->refs[c->n_refs].schema = target, c->refs[c->n_refs++].rule = k;
    text body = TEXT(c);
    int rc = gen(c, target, &body);
    if (rc == 0)
        put(&c->rules, "s%d ::= %s\n", k, body.s);
    free(body.s);
    put(out, "s%d", k);
    return rc;
}

/* ---- keys other than the declared ones ------------------------------------------------------ */

/* A key's characters as JSON writes them (json-key-char): a code point, or 0x110000 + the
 * letter of a two-character escape. */
#define ESCAPED 0x110000u

typedef struct key_node {
    uint32_t unit;   /* the unit that leads here from the parent */
    int first, next; /* first child, next sibling (-1: none) */
    int terminal;    /* a declared name ends here */
} key_node;

typedef struct key_trie {
    key_node *n;
    int count, cap;
} key_trie;

/* the child of node at reached by unit, added when absent (-1: out of memory) */
static int trie_child(key_trie *t, int at, uint32_t unit)
{
    for (int k = t->n[at].first; k >= 0; k = t->n[k].next)
        if (t->n[k].unit == unit)
            return k;
    if (t->count == t->cap) {
        int cap = t->cap ? 2 * t->cap : 64;
        key_node *g = realloc(t->n, (size_t)cap * sizeof *g);
        if (!g)
            return -1;
        t->n = g, t->cap = cap;
    }
    t->n[t->count] = (key_node){unit, -1, t->n[at].first, 0};
    t->n[at].first = t->count;
    return t->count++;
}

/* Adds name as json-key-char units; a name those cannot spell (a control character that
 * only \u writes) needs no excluding. 0, or -1 when out of memory. */
static int trie_add(key_trie *t, const char *name)
{
    int at = 0;
    for (const unsigned char *c = (const unsigned char *)name; *c;) {
        uint32_t unit;
        static const char plain[] = "\"\\\b\f\n\r\t", letter[] = "\"\\bfnrt";
        const char *e = *c < 0x80 ? strchr(plain, *c) : NULL;
        if (e) {
            unit = ESCAPED + (uint32_t)letter[e - plain], c++;
        } else if (*c < 0x20) {
            return 0;
        } else { /* one code point of valid UTF-8 (the schema was checked) */
            int len = *c < 0x80 ? 1 : *c < 0xe0 ? 2 : *c < 0xf0 ? 3 : 4;
            unit = len == 1 ? *c : (uint32_t)(*c & (0x7f >> len));
            for (int i = 1; i < len; i++)
                unit = unit << 6 | (c[i] & 0x3f);
            c += len;
        }
        if ((at = trie_child(t, at, unit)) < 0)
            return -1;
    }
    t->n[at].terminal = 1;
    return 0;
}

/* The rules of keys that are none of the trie's names, from node at: its rule's name written
 * to out. */
static int put_other_keys(conv *c, const key_trie *t, int at, text *out)
{
    text body = TEXT(c), plain = TEXT(c), escapes = TEXT(c);
    const key_node *nd = &t->n[at];
    int rc = 0;
    put(&plain, "[^\"\\\\\\x00-\\x1f");
    for (int k = nd->first; k >= 0; k = t->n[k].next) {
        uint32_t u = t->n[k].unit;
        if (u >= ESCAPED)
            put(&escapes, "%c", (char)(u - ESCAPED));
        else
            put(&plain, u > 0xffff ? "\\U%08X" : "\\u%04X", u);
    }
    put(&plain, "]");
    /* the key ends here (when no name does), or goes off every name, or follows one */
    if (!nd->terminal)
        put(&body, "\"\\\"\" | ");
    put(&body, "%s json-key-char* \"\\\"\"", plain.s);
    static const char letters[] = "\"\\bfnrt";
    text rest = TEXT(c);
    for (const char *l = letters; *l; l++)
        if (!escapes.s || !strchr(escapes.s, *l))
            put(&rest, "%s%c", *l == '"' || *l == '\\' ? "\\" : "", *l);
    if (rest.s)
        put(&body, " | \"\\\\\" [%s] json-key-char* \"\\\"\"", rest.s);
    free(rest.s);
    for (int k = nd->first; k >= 0 && rc == 0; k = t->n[k].next) {
        uint32_t u = t->n[k].unit;
        if (u >= ESCAPED)
            put(&body, " | \"\\\\%s%c\" ", u - ESCAPED == '"' || u - ESCAPED == '\\' ? "\\" : "",
                (char)(u - ESCAPED));
        else
            put(&body, u > 0xffff ? " | [\\U%08X] " : " | [\\u%04X] ", u);
        rc = put_other_keys(c, t, k, &body);
    }
    if (rc == 0)
        rc = body.oom || plain.oom || escapes.oom ? fail(c, "out of memory")
                                                  : add_rule(c, &body, out);
    free(body.s), free(plain.s), free(escapes.s);
    return rc;
}

/* A JSON key that is none of props' names (a rule's name, written to out): what an object's
 * additional properties may use, since a declared name written again would replace the
 * declared value with one its schema never checked. */
static int gen_other_key(conv *c, const cJSON *props, text *out)
{
    key_trie t = {.n = malloc(64 * sizeof *t.n), .count = 1, .cap = 64};
    int rc = t.n ? 0 : -1;
    if (t.n)
        t.n[0] = (key_node){0, -1, -1, 0}; /* the root */
    for (const cJSON *p = props->child; p && rc == 0; p = p->next) {
        if (strlen(p->string) > 1024) {
            free(t.n);
            return fail(c,
                        "property '%.40s...' is longer than 1024 bytes beside "
                        "additionalProperties (not supported)",
                        p->string);
        }
        rc = trie_add(&t, p->string);
    }
    if (rc == 0 && t.count > MAX_SCHEMA_RULES) {
        free(t.n);
        return fail(c, "the schema's grammar would pass %d rules; simplify the schema",
                    MAX_SCHEMA_RULES);
    }
    if (rc)
        rc = fail(c, "out of memory");
    else {
        put(out, "(\"\\\"\" ");
        rc = put_other_keys(c, &t, 0, out);
        put(out, ")");
    }
    free(t.n);
    return rc;
}

/* ---- integers in a range ------------------------------------------------------------------ */

/* the decimal numbers from a to b, both n digits (a <= b) */
static void digits_between(text *t, const char *a, const char *b, size_t n)
{
    if (n == 0)
        return;
    if (a[0] == b[0]) {
        put(t, "\"%c\" ", a[0]);
        digits_between(t, a + 1, b + 1, n - 1);
        return;
    }
    int low_rest = strspn(a + 1, "0") == n - 1, high_rest = strspn(b + 1, "9") == n - 1;
    put(t, "(");
    char lo = a[0], hi = b[0];
    if (!low_rest) { /* a[0] followed by at least a[1..] */
        char nines[32];
        memset(nines, '9', n - 1);
        put(t, "\"%c\" ", a[0]);
        digits_between(t, a + 1, nines, n - 1);
        put(t, "| ");
        lo++;
    }
    char top = high_rest ? hi : (char)(hi - 1);
    if (lo <= top) {
        put(t, "[%c-%c] ", lo, top);
        if (n > 1)
            put(t, "[0-9]{%zu} ", n - 1);
        put(t, "| ");
    }
    if (!high_rest) {
        char zeros[32];
        memset(zeros, '0', n - 1);
        put(t, "\"%c\" ", b[0]);
        digits_between(t, zeros, b + 1, n - 1);
        put(t, "| ");
    }
    t->n -= 2; /* the last "| " */
    put(t, ") ");
}

#define MAX_DIGITS 16

/* the non-negative integers from lo to hi (hi < 0: no bound), in JSON's form */
static void nonneg_range(text *t, long long lo, long long hi)
{
    char a[32], b[32];
    int la = snprintf(a, sizeof a, "%lld", lo);
    int lb = hi < 0 ? MAX_DIGITS : snprintf(b, sizeof b, "%lld", hi);
    put(t, "(");
    for (int len = la; len <= lb; len++) {
        char lower[32], upper[32];
        if (len == la)
            snprintf(lower, sizeof lower, "%s", a);
        else
            memset(lower, '0', (size_t)len), lower[0] = '1', lower[len] = 0;
        if (hi >= 0 && len == lb)
            snprintf(upper, sizeof upper, "%s", b);
        else if (hi < 0 && len > la) { /* every longer number at once */
            put(t, "[1-9] [0-9]{%d,%d} | ", len - 1, MAX_DIGITS - 1);
            break;
        } else
            memset(upper, '9', (size_t)len), upper[len] = 0;
        digits_between(t, lower, upper, (size_t)len);
        put(t, "| ");
    }
    t->n -= 2;
    put(t, ")");
}

static int gen_integer(conv *c, const cJSON *s, text *out)
{
    const cJSON *mn = cJSON_GetObjectItemCaseSensitive(s, "minimum");
    const cJSON *mx = cJSON_GetObjectItemCaseSensitive(s, "maximum");
    const cJSON *emn = cJSON_GetObjectItemCaseSensitive(s, "exclusiveMinimum");
    const cJSON *emx = cJSON_GetObjectItemCaseSensitive(s, "exclusiveMaximum");
    double lo = -INFINITY, hi = INFINITY, limit = 1e15;
    if (cJSON_IsNumber(mn))
        lo = ceil(mn->valuedouble);
    if (cJSON_IsNumber(emn))
        lo = fmax(lo, floor(emn->valuedouble) + 1);
    if (cJSON_IsNumber(mx))
        hi = floor(mx->valuedouble);
    if (cJSON_IsNumber(emx))
        hi = fmin(hi, ceil(emx->valuedouble) - 1);
    for (const cJSON *k = mn ? mn : mx ? mx : emn ? emn : emx; k && !cJSON_IsNumber(k);)
        return fail(c, "'%s' must be a number", k->string);
    if (isinf(lo) && isinf(hi)) {
        put(out, "json-int");
        return 0;
    }
    if (fabs(isinf(lo) ? 0 : lo) > limit || fabs(isinf(hi) ? 0 : hi) > limit)
        return fail(c, "integer bounds beyond 10^15 are not supported");
    if (lo > hi)
        return fail(c, "the integer range [%g, %g] is empty", lo, hi);
    text body = TEXT(c);
    put(&body, "(");
    if (lo < 0) { /* the negatives: "-" and their magnitudes */
        long long mag_lo = hi < 0 ? (long long)-hi : 1, mag_hi = isinf(lo) ? -1 : (long long)-lo;
        put(&body, "\"-\" ");
        nonneg_range(&body, mag_lo, mag_hi);
        if (hi >= 0)
            put(&body, " | ");
    }
    if (hi >= 0)
        nonneg_range(&body, lo < 0 ? 0 : (long long)lo, isinf(hi) ? -1 : (long long)hi);
    put(&body, ")");
    int rc = body.oom ? fail(c, "out of memory") : add_rule(c, &body, out);
    free(body.s);
    return rc;
}

/* ---- the rest ----------------------------------------------------------------------------- */

static int gen_string(conv *c, const cJSON *s, text *out)
{
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(s, "format");
    const cJSON *mn = cJSON_GetObjectItemCaseSensitive(s, "minLength");
    const cJSON *mx = cJSON_GetObjectItemCaseSensitive(s, "maxLength");
    const cJSON *pattern = cJSON_GetObjectItemCaseSensitive(s, "pattern");
    if (pattern) {
        if (!cJSON_IsString(pattern))
            return fail(c, "'pattern' must be a string");
        if (fmt || mn || mx)
            return fail(c, "'pattern' beside format, minLength or maxLength is not supported");
        char *body = NULL, why[300];
        if (loom_regex_to_gbnf(pattern->valuestring, "json-char", &body, why, sizeof why) != 0)
            return fail(c, "%s", why);
        text rule = TEXT(c);
        put(&rule, "\"\\\"\" %s \"\\\"\"", body);
        free(body);
        int rc = rule.oom ? fail(c, "out of memory") : add_rule(c, &rule, out);
        free(rule.s);
        return rc;
    }
    if (fmt) {
        static const char *const known[][2] = {
            {"date", "\"\\\"\" json-date \"\\\"\""},
            {"time", "\"\\\"\" json-time \"\\\"\""},
            {"date-time", "\"\\\"\" json-date \"T\" json-time \"\\\"\""},
            {"uuid", "\"\\\"\" json-uuid \"\\\"\""}};
        for (size_t i = 0; cJSON_IsString(fmt) && i < sizeof known / sizeof *known; i++)
            if (!strcmp(fmt->valuestring, known[i][0])) {
                if (mn || mx)
                    return fail(c, "minLength/maxLength beside a format are not supported");
                put(out, "(%s)", known[i][1]);
                return 0;
            }
        return fail(c,
                    "string format '%s' is not supported (loom knows date, time, date-time, uuid)",
                    cJSON_IsString(fmt) ? fmt->valuestring : "?");
    }
    if (!mn && !mx) {
        put(out, "json-string");
        return 0;
    }
    double lo = cJSON_IsNumber(mn) ? mn->valuedouble : 0,
           hi = cJSON_IsNumber(mx) ? mx->valuedouble : -1;
    if ((mn && !cJSON_IsNumber(mn)) || (mx && !cJSON_IsNumber(mx)) || lo < 0 || lo > 10000 ||
        hi > 10000 || (hi >= 0 && hi < lo))
        return fail(c, "minLength/maxLength must be whole numbers from 0 to 10000, min <= max");
    if (hi < 0)
        put(out, "(\"\\\"\" json-char{%d,} \"\\\"\")", (int)lo);
    else
        put(out, "(\"\\\"\" json-char{%d,%d} \"\\\"\")", (int)lo, (int)hi);
    return 0;
}

static int gen_array(conv *c, const cJSON *s, text *out)
{
    const cJSON *items = cJSON_GetObjectItemCaseSensitive(s, "items");
    const cJSON *prefix = cJSON_GetObjectItemCaseSensitive(s, "prefixItems");
    const cJSON *mn = cJSON_GetObjectItemCaseSensitive(s, "minItems");
    const cJSON *mx = cJSON_GetObjectItemCaseSensitive(s, "maxItems");
    double lo = cJSON_IsNumber(mn) ? mn->valuedouble : 0,
           hi = cJSON_IsNumber(mx) ? mx->valuedouble : -1;
    if ((mn && !cJSON_IsNumber(mn)) || (mx && !cJSON_IsNumber(mx)) || lo < 0 || lo > 1000 ||
        hi > 1000 || (hi >= 0 && hi < lo))
        return fail(c, "minItems/maxItems must be whole numbers from 0 to 1000, min <= max");
    if (prefix && !cJSON_IsArray(prefix))
        return fail(c, "'prefixItems' must be an array of schemas");
    int n_prefix = prefix ? cJSON_GetArraySize(prefix) : 0;
    text item = TEXT(c), body = TEXT(c);
    int rc = 0;
    if (cJSON_IsFalse(items))
        hi = hi < 0 || hi > n_prefix ? n_prefix : hi;
    else
        rc = gen(c, items ? items : NULL, &item);
    if (rc == 0 && n_prefix) {
        /* every prefix item given (loom writes them all), then more per "items" */
        if (hi >= 0 && hi < n_prefix)
            rc = fail(c, "maxItems below the number of prefixItems is not supported");
        put(&body, "\"[\" ws ");
        int k = 0;
        for (const cJSON *p = prefix->child; p && rc == 0; p = p->next, k++) {
            if (k)
                put(&body, "\",\" ws ");
            rc = gen(c, p, &body);
            put(&body, " ws ");
        }
        int more_lo = lo > n_prefix ? (int)lo - n_prefix : 0,
            more_hi = hi < 0 ? -1 : (int)hi - n_prefix;
        if (rc == 0 && more_hi != 0 && item.s) {
            if (more_hi < 0)
                put(&body, "(\",\" ws %s ws){%d,} ", item.s, more_lo);
            else
                put(&body, "(\",\" ws %s ws){%d,%d} ", item.s, more_lo, more_hi);
        } else if (rc == 0 && more_lo > 0) {
            rc = fail(c, "minItems past prefixItems with items: false");
        }
        put(&body, "\"]\"");
    } else if (rc == 0) {
        const char *v = item.s ? item.s : "json-value";
        if (hi == 0)
            put(&body, "\"[\" ws \"]\"");
        else if (lo == 0)
            put(&body,
                hi < 0 ? "\"[\" ws (%s ws (\",\" ws %s ws)*)? \"]\""
                       : "\"[\" ws (%s ws (\",\" ws %s ws){0,%d})? \"]\"",
                v, v, (int)hi - 1);
        else if (hi < 0)
            put(&body, "\"[\" ws %s ws (\",\" ws %s ws){%d,} \"]\"", v, v, (int)lo - 1);
        else
            put(&body, "\"[\" ws %s ws (\",\" ws %s ws){%d,%d} \"]\"", v, v, (int)lo - 1,
                (int)hi - 1);
    }
    if (rc == 0)
        rc = body.oom || item.oom ? fail(c, "out of memory") : add_rule(c, &body, out);
    free(item.s), free(body.s);
    return rc;
}

static int gen_object(conv *c, const cJSON *s, text *out)
{
    const cJSON *props = cJSON_GetObjectItemCaseSensitive(s, "properties");
    const cJSON *req = cJSON_GetObjectItemCaseSensitive(s, "required");
    const cJSON *extra = cJSON_GetObjectItemCaseSensitive(s, "additionalProperties");
    if (props && !cJSON_IsObject(props))
        return fail(c, "'properties' must be an object");
    if (req && !cJSON_IsArray(req))
        return fail(c, "'required' must be an array of names");
    for (const cJSON *r = req ? req->child : NULL; r; r = r->next)
        if (!cJSON_IsString(r) || !cJSON_GetObjectItemCaseSensitive(props, r->valuestring))
            return fail(c, "required property '%s' is not among 'properties' (not supported)",
                        cJSON_IsString(r) ? r->valuestring : "?");
    if (!props || !props->child) { /* a map: any keys, values per additionalProperties */
        if (!extra || cJSON_IsTrue(extra)) {
            put(out, "json-object");
            return 0;
        }
        if (cJSON_IsFalse(extra)) {
            put(out, "(\"{\" ws \"}\")");
            return 0;
        }
        text v = TEXT(c), body = TEXT(c);
        int rc = gen(c, extra, &v);
        if (rc == 0) {
            put(&body,
                "\"{\" ws (json-string ws \":\" ws %s ws (\",\" ws json-string ws \":\" ws %s ws)*)? \"}\"",
                v.s, v.s);
            rc = add_rule(c, &body, out);
        }
        free(v.s), free(body.s);
        return rc;
    }
    /* properties in order, the optional ones each optional: head_i (nothing written yet) and
     * tail_i (something written, so a comma first), for properties i.. */
    int n = cJSON_GetArraySize(props), base = c->n_rules, rc = 0;
    c->n_rules += 2 * (n + 1);
    text extra_kv = TEXT(c);
    if (extra && !cJSON_IsFalse(extra)) {
        text v = TEXT(c), key = TEXT(c);
        rc = cJSON_IsTrue(extra) ? (put(&v, "json-value"), 0) : gen(c, extra, &v);
        if (rc == 0)
            rc = gen_other_key(c, props, &key);
        put(&extra_kv, "(\",\" ws %s ws \":\" ws %s ws)*", key.s ? key.s : "json-string",
            v.s ? v.s : "json-value");
        free(v.s), free(key.s);
    }
    int i = 0;
    for (const cJSON *p = props->child; p && rc == 0; p = p->next, i++) {
        int required = 0;
        for (const cJSON *r = req ? req->child : NULL; r; r = r->next)
            required |= cJSON_IsString(r) && !strcmp(r->valuestring, p->string);
        text kv = TEXT(c), key = TEXT(c);
        cJSON *name = cJSON_CreateString(p->string);
        char *quoted = name ? cJSON_PrintUnformatted(name) : NULL;
        cJSON_Delete(name);
        if (!quoted)
            rc = fail(c, "out of memory");
        else
            put_literal(&key, quoted, strlen(quoted));
        free(quoted);
        if (rc == 0) {
            put(&kv, "%s ws \":\" ws ", key.s);
            rc = gen(c, p, &kv);
            put(&kv, " ws");
        }
        if (rc == 0) {
            int head = base + 2 * i, tail = head + 1, next_head = head + 2, next_tail = head + 3;
            if (required) {
                put(&c->rules, "s%d ::= %s s%d\n", head, kv.s, next_tail);
                put(&c->rules, "s%d ::= \",\" ws %s s%d\n", tail, kv.s, next_tail);
            } else {
                put(&c->rules, "s%d ::= %s s%d | s%d\n", head, kv.s, next_tail, next_head);
                put(&c->rules, "s%d ::= \",\" ws %s s%d | s%d\n", tail, kv.s, next_tail, next_tail);
            }
        }
        free(kv.s), free(key.s);
    }
    if (rc == 0) {
        int head = base + 2 * n, tail = head + 1;
        /* past the last property: nothing, or (if allowed) more keys after a written one */
        put(&c->rules, "s%d ::= \"\"\n", head);
        put(&c->rules, "s%d ::= %s\n", tail, extra_kv.s ? extra_kv.s : "\"\"");
        put(out, "(\"{\" ws s%d \"}\")", base);
    }
    free(extra_kv.s);
    return rc;
}

static int gen_typed(conv *c, const cJSON *s, const char *type, text *out)
{
    if (!strcmp(type, "string"))
        return gen_string(c, s, out);
    if (!strcmp(type, "integer"))
        return gen_integer(c, s, out);
    if (!strcmp(type, "number")) {
        static const char *const bounds[] = {"minimum", "maximum", "exclusiveMinimum",
                                             "exclusiveMaximum", "multipleOf"};
        for (size_t i = 0; i < sizeof bounds / sizeof *bounds; i++)
            if (cJSON_GetObjectItemCaseSensitive(s, bounds[i]))
                return fail(c, "'%s' on a number is not supported (on an integer it is)",
                            bounds[i]);
        put(out, "json-number");
        return 0;
    }
    if (!strcmp(type, "boolean"))
        return put(out, "json-bool"), 0;
    if (!strcmp(type, "null"))
        return put(out, "json-null"), 0;
    if (!strcmp(type, "object"))
        return gen_object(c, s, out);
    if (!strcmp(type, "array"))
        return gen_array(c, s, out);
    return fail(c, "unknown type '%s'", type);
}

/* keywords whose constraint loom follows, and annotations it may ignore */
static const char *const handled[] = {"type",
                                      "properties",
                                      "required",
                                      "additionalProperties",
                                      "items",
                                      "prefixItems",
                                      "minItems",
                                      "maxItems",
                                      "minLength",
                                      "maxLength",
                                      "format",
                                      "enum",
                                      "const",
                                      "anyOf",
                                      "oneOf",
                                      "allOf",
                                      "$ref",
                                      "minimum",
                                      "maximum",
                                      "exclusiveMinimum",
                                      "exclusiveMaximum",
                                      "pattern",
                                      "$defs",
                                      "definitions",
                                      "title",
                                      "description",
                                      "default",
                                      "examples",
                                      "$schema",
                                      "$id",
                                      "$comment",
                                      "deprecated",
                                      "readOnly",
                                      "writeOnly",
                                      "strict",
                                      NULL};

/* keywords that only annotate, or hold schemas for $ref: beside anything */
static const char *const annotations[] = {
    "$defs", "definitions", "title",      "description", "default",   "examples", "$schema",
    "$id",   "$comment",    "deprecated", "readOnly",    "writeOnly", "strict",   NULL};

static int is_annotation(const char *key)
{
    for (int i = 0; annotations[i]; i++)
        if (!strcmp(key, annotations[i]))
            return 1;
    return 0;
}

/* whether value v is of the schema type t (a name, or a list of them) */
static int of_type(const cJSON *v, const cJSON *t)
{
    if (cJSON_IsArray(t)) {
        for (const cJSON *k = t->child; k; k = k->next)
            if (of_type(v, k))
                return 1;
        return 0;
    }
    const char *n = cJSON_IsString(t) ? t->valuestring : "";
    return !strcmp(n, "string") ? cJSON_IsString(v)
        : !strcmp(n, "number")  ? cJSON_IsNumber(v)
        : !strcmp(n, "integer") ? cJSON_IsNumber(v) && v->valuedouble == floor(v->valuedouble)
        : !strcmp(n, "boolean") ? cJSON_IsBool(v)
        : !strcmp(n, "null")    ? cJSON_IsNull(v)
        : !strcmp(n, "object")  ? cJSON_IsObject(v)
        : !strcmp(n, "array")   ? cJSON_IsArray(v)
                                : 0;
}

/* A schema whose value comes from $ref, anyOf, oneOf, allOf, const or enum (by: that keyword)
 * follows that keyword alone: another constraint beside it would be dropped, and what it
 * refuses allowed, so it is refused by name (but "type" beside const or enum narrows them). */
static int refuse_siblings(conv *c, const cJSON *s, const cJSON *by)
{
    if (!by)
        return 0;
    int values = !strcmp(by->string, "const") || !strcmp(by->string, "enum");
    for (const cJSON *k = s->child; k; k = k->next)
        if (k != by && !is_annotation(k->string) && !(values && !strcmp(k->string, "type")))
            return fail(c,
                        "'%s' beside '%s' is not supported: write it inside each of its "
                        "schemas, or the schema without it",
                        k->string, by->string);
    return 0;
}

/* The JSON types a schema's texts can have, as bits (1 << index in type_names); all of them
 * when it does not say. */
static const char *const type_names[] = {"string", "number", "boolean", "null",
                                         "object", "array",  NULL};
static unsigned types_of(const cJSON *s)
{
    /* const or enum (never both: refuse_siblings) say by their values */
    const cJSON *one = cJSON_GetObjectItemCaseSensitive(s, "const");
    const cJSON *values = one ? NULL : cJSON_GetObjectItemCaseSensitive(s, "enum");
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(s, "type");
    unsigned bits = 0;
    for (const cJSON *v = one        ? one
             : cJSON_IsArray(values) ? values->child
                                     : NULL;
         v; v = one ? NULL : v->next)
        for (int i = 0; type_names[i]; i++) {
            cJSON name = {.type = cJSON_String, .valuestring = (char *)type_names[i]};
            bits |= of_type(v, &name) ? 1u << i : 0;
        }
    if (one || values)
        return bits;
    if (cJSON_IsString(t) || cJSON_IsArray(t))
        for (int i = 0; type_names[i]; i++) {
            int named = 0;
            for (const cJSON *k = cJSON_IsArray(t) ? t->child : t; k;
                 k = cJSON_IsArray(t) ? k->next : NULL)
                named |= cJSON_IsString(k) &&
                    (!strcmp(k->valuestring, type_names[i]) ||
                     (i == 1 && !strcmp(k->valuestring, "integer")));
            bits |= named ? 1u << i : 0;
        }
    return bits ? bits : 0x3f;
}

/* the const a branch's object gives property name (required, with const or a one-value enum),
 * or NULL */
static const cJSON *tag_of(const cJSON *branch, const char *name)
{
    const cJSON *props = cJSON_GetObjectItemCaseSensitive(branch, "properties");
    const cJSON *req = cJSON_GetObjectItemCaseSensitive(branch, "required");
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(props, name);
    int required = 0;
    for (const cJSON *r = cJSON_IsArray(req) ? req->child : NULL; r; r = r->next)
        required |= cJSON_IsString(r) && !strcmp(r->valuestring, name);
    if (!p || !required)
        return NULL;
    const cJSON *k = cJSON_GetObjectItemCaseSensitive(p, "const");
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(p, "enum");
    return k ? k : cJSON_IsArray(e) && e->child && !e->child->next ? e->child : NULL;
}

/* Whether two branches of oneOf could match one text: unless their types differ, or each is an
 * object whose required property (the first branch's first) holds a const the others differ
 * from, loom cannot tell, and a text matching both is invalid under oneOf. */
static int one_of_may_overlap(conv *c, const cJSON *branches)
{
    if (!cJSON_IsArray(branches))
        return 0; /* refused where it is generated */
    for (const cJSON *x = branches->child; x; x = x->next)
        for (const cJSON *y = x->next; y; y = y->next) {
            const cJSON *a = deref(c->root, x), *b = deref(c->root, y);
            unsigned ta = types_of(a), tb = types_of(b);
            if (!(ta & tb))
                continue;
            const cJSON *props = cJSON_GetObjectItemCaseSensitive(deref(c->root, branches->child),
                                                                  "properties");
            int told_apart = 0;
            for (const cJSON *p = props ? props->child : NULL; p && !told_apart; p = p->next) {
                const cJSON *x = tag_of(a, p->string), *y = tag_of(b, p->string);
                told_apart = x && y && !cJSON_Compare(x, y, 1) && !((ta | tb) & ~(1u << 4));
            }
            if (!told_apart)
                return 1;
        }
    return 0;
}

static int gen(conv *c, const cJSON *s, text *out)
{
    if (c->failed)
        return -1;
    if (!s || cJSON_IsTrue(s) || (cJSON_IsObject(s) && !s->child)) {
        put(out, "json-value");
        return 0;
    }
    if (cJSON_IsFalse(s))
        return fail(c, "a schema of false allows nothing");
    if (!cJSON_IsObject(s))
        return fail(c, "a schema must be an object or a boolean, not %s",
                    cJSON_IsArray(s) ? "an array" : "a scalar");
    if (++c->depth > 64)
        return fail(c, "the schema nests more than 64 deep");
    if (c->n_rules > MAX_SCHEMA_RULES)
        return fail(c, "the schema's grammar would pass %d rules; simplify the schema",
                    MAX_SCHEMA_RULES);
    if (!c->budget)
        return fail(c, OVER_BUDGET, MAX_SCHEMA_GRAMMAR_BYTES);
    for (const cJSON *k = s->child; k; k = k->next) {
        int known = 0;
        for (int i = 0; handled[i] && !known; i++)
            known = !strcmp(k->string, handled[i]);
        if (!known)
            return fail(c, "JSON Schema keyword '%s' is not supported", k->string);
    }
    const cJSON *ref = cJSON_GetObjectItemCaseSensitive(s, "$ref");
    const cJSON *cnst = cJSON_GetObjectItemCaseSensitive(s, "const");
    const cJSON *en = cJSON_GetObjectItemCaseSensitive(s, "enum");
    const cJSON *any = cJSON_GetObjectItemCaseSensitive(s, "anyOf");
    if (!any)
        any = cJSON_GetObjectItemCaseSensitive(s, "oneOf");
    const cJSON *all = cJSON_GetObjectItemCaseSensitive(s, "allOf");
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(s, "type");
    const cJSON *one = cJSON_GetObjectItemCaseSensitive(s, "oneOf");
    if (one && one == any && one_of_may_overlap(c, one))
        return fail(c,
                    "'oneOf' whose branches may both match a text is not supported (loom "
                    "follows it only where they cannot: different types, or objects told "
                    "apart by a required property's const); use 'anyOf' if either may match");
    if (refuse_siblings(c, s, ref ? ref : any ? any : all ? all : cnst ? cnst : en) != 0)
        return -1;
    int rc = 0;
    if (ref) {
        rc = cJSON_IsString(ref) ? gen_ref(c, ref->valuestring, out)
                                 : fail(c, "'$ref' must be a string");
    } else if (cnst) {
        rc = type && !of_type(cnst, type) ? fail(c, "'const' is not of the schema's 'type'")
                                          : put_json_literal(c, out, cnst);
    } else if (en) {
        /* beside "type", the values of that type (Pydantic writes both) */
        int first = 1;
        if (!cJSON_IsArray(en) || !en->child)
            rc = fail(c, "'enum' must be a non-empty array");
        put(out, "(");
        for (const cJSON *v = en->child; v && rc == 0; v = v->next) {
            if (type && !of_type(v, type))
                continue;
            put(out, first ? "" : " | ");
            rc = put_json_literal(c, out, v);
            first = 0;
        }
        put(out, ")");
        if (rc == 0 && first)
            rc = fail(c, "no value of 'enum' is of the schema's 'type'");
    } else if (any) {
        if (!cJSON_IsArray(any) || !any->child)
            rc = fail(c, "'anyOf'/'oneOf' must be a non-empty array");
        put(out, "(");
        for (const cJSON *v = any->child; v && rc == 0; v = v->next) {
            rc = gen(c, v, out);
            put(out, v->next ? " | " : "");
        }
        put(out, ")");
    } else if (all) {
        if (!cJSON_IsArray(all) || !all->child)
            return fail(c, "'allOf' must be a non-empty array");
        if (all->child->next)
            return fail(c, "'allOf' with more than one schema is not supported");
        rc = gen(c, all->child, out);
    } else if (cJSON_IsString(type)) {
        rc = gen_typed(c, s, type->valuestring, out);
    } else if (cJSON_IsArray(type) && type->child) {
        put(out, "(");
        int first = 1;
        for (const cJSON *t = type->child; t && rc == 0; t = t->next) {
            if (!cJSON_IsString(t)) {
                rc = fail(c, "'type' must name types");
                break;
            }
            int again = 0; /* a type named twice allows nothing more: its grammar once */
            for (const cJSON *u = type->child; u != t && !again; u = u->next)
                again = !strcmp(u->valuestring, t->valuestring);
            if (again)
                continue;
            put(out, first ? "" : " | ");
            rc = gen_typed(c, s, t->valuestring, out);
            first = 0;
        }
        put(out, ")");
    } else if (type) {
        rc = fail(c, "'type' must be a string or an array of strings");
    } else if (cJSON_GetObjectItemCaseSensitive(s, "properties") ||
               cJSON_GetObjectItemCaseSensitive(s, "additionalProperties")) {
        rc = gen_object(c, s, out);
    } else if (cJSON_GetObjectItemCaseSensitive(s, "items") ||
               cJSON_GetObjectItemCaseSensitive(s, "prefixItems")) {
        rc = gen_array(c, s, out);
    } else {
        put(out, "json-value");
    }
    c->depth--;
    return rc;
}

char *loom_json_schema_to_gbnf(const char *schema_json, char *err, size_t err_size)
{
    size_t len = strlen(schema_json);
    if (loom_utf8_valid_prefix(schema_json, len) != len) {
        snprintf(err, err_size, "the schema is not valid UTF-8");
        return NULL;
    }
    cJSON *schema = cJSON_Parse(schema_json);
    if (!schema) {
        snprintf(err, err_size, "the schema is not valid JSON");
        return NULL;
    }
    conv c = {.root = schema, .err = err, .err_size = err_size};
    c.budget = MAX_SCHEMA_GRAMMAR_BYTES;
    c.rules.budget = &c.budget;
    text root = TEXT(&c);
    int rc = gen(&c, schema, &root);
    char *out = NULL;
    if (rc == 0 && !root.oom && !c.rules.oom) {
        text all = {0}; /* the whole, once: what the budget bounded */
        put(&all, "root ::= ws %s\n%s%s", root.s, c.rules.s ? c.rules.s : "", json_rules);
        if (all.oom)
            snprintf(err, err_size, "out of memory");
        out = all.oom ? (free(all.s), NULL) : all.s;
    } else if (rc == 0 && !c.budget) {
        snprintf(err, err_size, OVER_BUDGET, MAX_SCHEMA_GRAMMAR_BYTES);
    } else if (rc == 0) {
        snprintf(err, err_size, "out of memory");
    }
    free(root.s), free(c.rules.s);
    cJSON_Delete(schema);
    return out;
}

loom_grammar *loom_grammar_from_json_schema(const char *schema_json, char *err, size_t err_size)
{
    char *gbnf = loom_json_schema_to_gbnf(schema_json, err, err_size);
    if (!gbnf)
        return NULL;
    char why[400];
    loom_grammar *g = loom_grammar_compile(gbnf, why, sizeof why);
    if (!g && strstr(why, "left-recursive")) /* {"$ref": "#"} and other cycles of $ref alone */
        snprintf(err, err_size,
                 "the schema's $ref refers back to itself before any value begins "
                 "(a cycle that describes nothing)");
    else if (!g) /* loom's own making: say so */
        snprintf(err, err_size, "internal: the schema's grammar does not compile: %s", why);
    free(gbnf);
    return g;
}
