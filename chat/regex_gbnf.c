/*
 * chat/regex_gbnf.c - a JSON Schema "pattern" (a regular expression) as GBNF over the text of a
 * JSON string between its quotes, for constrained decoding (chat/json_schema.c).
 *
 * The text is the string as JSON writes it, so a quote in the pattern becomes \" in the answer
 * and a newline \n. The grammar allows only strings the pattern matches, under both
 * ECMA-262's reading (JSON Schema's) and Python's (what most validators run): where the two
 * differ it allows less. \d, \w and \s are their ASCII sets; a negated class or \D, \W, \S
 * that names one of those keeps to ASCII; "." is any character but a line break; control
 * characters come only as \t, \n, \r, \f and \b. The subset: literals, ".", classes with
 * ranges and escapes, groups (capturing or "(?:"), "|", the quantifiers * + ? {n} {n,} {n,m}
 * (lazy or not: the same strings), and "^" / "$" at the very start and end; a pattern without
 * them matches anywhere in the string, as JSON Schema says. Lookaround, backreferences, word
 * boundaries and Unicode property escapes are refused with their name.
 */
#define _GNU_SOURCE
#include "api/internal.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_RANGES 512 /* in one character class */
#define MAX_COUNT 1000 /* in {n,m} */
#define MAX_DEPTH 40   /* nested groups */

typedef struct cpset {
    uint32_t r[MAX_RANGES][2];
    int n;
} cpset;

typedef struct rx {
    const char *p, *end;
    FILE *out;
    char *err;
    size_t err_size;
    int failed, depth;
    int empty; /* what was just parsed (an atom, a sequence, alternatives) can match "" */
} rx;

static int rfail(rx *x, const char *fmt, ...)
{
    if (!x->failed) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(x->err, x->err_size, fmt, ap);
        va_end(ap);
    }
    x->failed = 1;
    return -1;
}

/* ---- code point sets ------------------------------------------------------------------------ */

static int set_add(rx *x, cpset *s, uint32_t lo, uint32_t hi)
{
    if (s->n == MAX_RANGES)
        return rfail(x, "pattern: a character class of more than %d ranges", MAX_RANGES);
    s->r[s->n][0] = lo, s->r[s->n][1] = hi, s->n++;
    return 0;
}

static int cmp_range(const void *a, const void *b)
{
    const uint32_t *p = a, *q = b;
    return p[0] < q[0] ? -1 : p[0] > q[0];
}

static void set_normalize(cpset *s)
{
    qsort(s->r, (size_t)s->n, sizeof s->r[0], cmp_range);
    int m = 0;
    for (int i = 0; i < s->n; i++)
        if (m && s->r[i][0] <= s->r[m - 1][1] + 1) {
            if (s->r[i][1] > s->r[m - 1][1])
                s->r[m - 1][1] = s->r[i][1];
        } else {
            s->r[m][0] = s->r[i][0], s->r[m][1] = s->r[i][1], m++;
        }
    s->n = m;
}

/* the code points of [lo, hi] not in s */
static void set_complement(cpset *s, uint32_t lo, uint32_t hi)
{
    set_normalize(s);
    cpset c = {.n = 0};
    uint32_t next = lo;
    for (int i = 0; i < s->n && next <= hi; i++) {
        if (s->r[i][1] < next)
            continue;
        if (s->r[i][0] > next)
            c.r[c.n][0] = next, c.r[c.n][1] = s->r[i][0] - 1 < hi ? s->r[i][0] - 1 : hi, c.n++;
        next = s->r[i][1] + 1;
    }
    if (next <= hi)
        c.r[c.n][0] = next, c.r[c.n][1] = hi, c.n++;
    *s = c;
}

static int set_has(const cpset *s, uint32_t cp)
{
    for (int i = 0; i < s->n; i++)
        if (cp >= s->r[i][0] && cp <= s->r[i][1])
            return 1;
    return 0;
}

/* \d \w \s and their negations, added to s; shorthand tells the caller a Unicode-sensitive set
 * was named */
static int add_shorthand(rx *x, cpset *s, char c)
{
    cpset t = {.n = 0};
    char lower = (char)(c | 0x20);
    if (lower == 'd')
        set_add(x, &t, '0', '9');
    else if (lower == 'w')
        set_add(x, &t, '0', '9'), set_add(x, &t, 'A', 'Z'), set_add(x, &t, 'a', 'z'),
            set_add(x, &t, '_', '_');
    else
        set_add(x, &t, ' ', ' '), set_add(x, &t, '\t', '\r');
    if (c != lower) /* \D \W \S: their complement, within ASCII */
        set_complement(&t, 0, 0x7f);
    for (int i = 0; i < t.n; i++)
        if (set_add(x, s, t.r[i][0], t.r[i][1]))
            return -1;
    return 0;
}

/* ---- output --------------------------------------------------------------------------------- */

/* one code point as JSON writes it inside a string, as a GBNF literal; 0 when JSON text
 * cannot carry it here (a control character without a short escape) */
static int put_char(rx *x, uint32_t cp)
{
    static const char short_escape[][2] = {
        {'\b', 'b'}, {'\t', 't'}, {'\n', 'n'}, {'\f', 'f'}, {'\r', 'r'}};
    if (cp == '"' || cp == '\\')
        return fprintf(x->out, "\"\\\\\\%c\"", (char)cp), 1;
    if (cp < 0x20) {
        for (size_t i = 0; i < sizeof short_escape / sizeof *short_escape; i++)
            if (cp == (uint32_t)short_escape[i][0])
                return fprintf(x->out, "\"\\\\%c\"", short_escape[i][1]), 1;
        return 0;
    }
    if (cp < 0x7f)
        fprintf(x->out, "\"%c\"", (char)cp);
    else
        fprintf(x->out, "\"\\U%08X\"", cp);
    return 1;
}

/* a set of code points, each as JSON writes it: the plain ones as one class, the escaped ones
 * as literals beside it */
static int put_set(rx *x, cpset *s)
{
    set_normalize(s);
    cpset plain = *s, other = {.n = 0};
    set_add(x, &other, 0, 0x1f), set_add(x, &other, '"', '"'), set_add(x, &other, '\\', '\\'),
        set_add(x, &other, 0xd800, 0xdfff);
    set_complement(&other, 0, 0x10ffff); /* where plain text may stand for itself */
    cpset keep = {.n = 0};
    for (int i = 0; i < plain.n; i++)
        for (int j = 0; j < other.n; j++) {
            uint32_t lo = plain.r[i][0] > other.r[j][0] ? plain.r[i][0] : other.r[j][0];
            uint32_t hi = plain.r[i][1] < other.r[j][1] ? plain.r[i][1] : other.r[j][1];
            if (lo <= hi)
                set_add(x, &keep, lo, hi);
        }
    int n = 0;
    fputs("(", x->out);
    if (keep.n) {
        fputs("[", x->out);
        for (int i = 0; i < keep.n; i++) {
            fprintf(x->out, "\\U%08X", keep.r[i][0]);
            if (keep.r[i][1] != keep.r[i][0])
                fprintf(x->out, "-\\U%08X", keep.r[i][1]);
        }
        fputs("]", x->out);
        n++;
    }
    static const uint32_t escaped[] = {'"', '\\', '\b', '\t', '\n', '\f', '\r'};
    for (size_t i = 0; i < sizeof escaped / sizeof *escaped; i++)
        if (set_has(s, escaped[i])) {
            fputs(n++ ? " | " : "", x->out);
            put_char(x, escaped[i]);
        }
    fputs(")", x->out);
    return n ? 0 : rfail(x, "pattern: a character class that matches no character JSON can write");
}

/* ---- the parser ----------------------------------------------------------------------------- */

static int at_end(const rx *x)
{
    return x->p >= x->end;
}

/* one UTF-8 character of the pattern */
static uint32_t next_char(rx *x)
{
    const unsigned char *s = (const unsigned char *)x->p;
    int n = s[0] < 0x80 ? 1 : s[0] >= 0xf0 ? 4 : s[0] >= 0xe0 ? 3 : 2;
    if (x->end - x->p < n || loom_utf8_valid_prefix(x->p, (size_t)n) < (size_t)n) {
        rfail(x, "pattern: not valid UTF-8");
        x->p = x->end;
        return 0;
    }
    uint32_t cp = n == 1 ? s[0] : n == 2 ? s[0] & 0x1fu : n == 3 ? s[0] & 0x0fu : s[0] & 7u;
    for (int i = 1; i < n; i++)
        cp = cp << 6 | (s[i] & 0x3fu);
    x->p += n;
    return cp;
}

static int hex(rx *x, int digits, uint32_t *out)
{
    uint32_t v = 0;
    for (int i = 0; i < digits; i++, x->p++) {
        char c = at_end(x) ? 0 : *x->p;
        int d = c >= '0' && c <= '9' ? c - '0'
            : c >= 'a' && c <= 'f'   ? c - 'a' + 10
            : c >= 'A' && c <= 'F'   ? c - 'A' + 10
                                     : -1;
        if (d < 0)
            return rfail(x, "pattern: expected %d hex digits after \\%c", digits,
                         digits == 2 ? 'x' : 'u');
        v = v * 16 + (uint32_t)d;
    }
    *out = v;
    return 0;
}

/* After a backslash: a single character (*cp), or a shorthand class added to s (returns 1;
 * s NULL: refused). in_class: inside [...], where \b is a backspace. */
static int escape(rx *x, uint32_t *cp, cpset *s, int in_class)
{
    if (at_end(x))
        return rfail(x, "pattern: it ends with a lone backslash");
    char c = *x->p++;
    switch (c) {
    case 'd':
    case 'D':
    case 'w':
    case 'W':
    case 's':
    case 'S':
        if (!s)
            return rfail(x, "pattern: a range cannot end in \\%c", c);
        return add_shorthand(x, s, c) ? -1 : 1;
    case 'n': *cp = '\n'; return 0;
    case 't': *cp = '\t'; return 0;
    case 'r': *cp = '\r'; return 0;
    case 'f': *cp = '\f'; return 0;
    case 'v': *cp = '\v'; return 0;
    case '0': *cp = 0; return 0;
    case 'x': return hex(x, 2, cp);
    case 'u':
        if (!at_end(x) && *x->p == '{')
            return rfail(x, "pattern: \\u{...} is not supported; write \\uXXXX");
        if (hex(x, 4, cp))
            return -1;
        /* JSON Schema's patterns are ECMA-262's, over UTF-16: a character past U+FFFF is a
         * \uD8xx\uDCxx pair; half of one stands for no character */
        if (*cp >= 0xd800 && *cp <= 0xdbff && x->end - x->p >= 6 && x->p[0] == '\\' &&
            x->p[1] == 'u') {
            uint32_t low = 0;
            x->p += 2;
            if (hex(x, 4, &low))
                return -1;
            if (low >= 0xdc00 && low <= 0xdfff) {
                *cp = 0x10000 + ((*cp - 0xd800) << 10) + (low - 0xdc00);
                return 0;
            }
        }
        if (*cp >= 0xd800 && *cp <= 0xdfff)
            return rfail(x,
                         "pattern: \\u%04X is half of a surrogate pair, no character; write "
                         "the character itself or its \\uD8xx\\uDCxx pair",
                         (unsigned)*cp);
        return 0;
    case 'b':
        if (in_class) {
            *cp = '\b';
            return 0;
        }
        return rfail(x, "pattern: word boundaries (\\b) are not supported");
    case 'B': return rfail(x, "pattern: word boundaries (\\B) are not supported");
    case 'p':
    case 'P': return rfail(x, "pattern: Unicode property escapes (\\%c{...}) are not supported", c);
    case 'k': return rfail(x, "pattern: backreferences (\\k) are not supported");
    case 'c': return rfail(x, "pattern: control escapes (\\c) are not supported");
    default:
        if (c >= '1' && c <= '9')
            return rfail(x, "pattern: backreferences (\\%c) are not supported", c);
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))
            return rfail(x, "pattern: unknown escape \\%c", c);
        x->p--;
        *cp = next_char(x); /* an escaped punctuation character stands for itself */
        return 0;
    }
}

/* [...] after its '[' */
static int parse_class(rx *x)
{
    cpset s = {.n = 0};
    int negated = !at_end(x) && *x->p == '^', shorthand = 0;
    x->p += negated;
    if (!at_end(x) && *x->p == ']') /* [^] is any character to ECMA-262, to Python "not ]" */
        return rfail(x,
                     "pattern: '[%s]' reads as %s in ECMA-262 but opens a class in Python; "
                     "write '\\]' for a ']' in a class%s",
                     negated ? "^" : "", negated ? "any character" : "no character",
                     negated ? " (and [\\s\\S] for any character)" : "");
    while (!at_end(x) && *x->p != ']' && !x->failed) {
        uint32_t lo, hi;
        int k = 0;
        if (*x->p == '\\') {
            x->p++;
            if ((k = escape(x, &lo, &s, 1)) < 0)
                return -1;
        } else {
            lo = next_char(x);
        }
        if (k == 1) {
            shorthand = 1;
            continue;
        }
        hi = lo;
        if (x->end - x->p >= 2 && x->p[0] == '-' && x->p[1] != ']') {
            x->p++;
            int k2 = 0;
            if (*x->p == '\\') {
                x->p++;
                if ((k2 = escape(x, &hi, NULL, 1)) != 0)
                    return -1;
            } else {
                hi = next_char(x);
            }
            if (hi < lo)
                return rfail(x, "pattern: the range in a class runs backwards");
        }
        if (set_add(x, &s, lo, hi))
            return -1;
    }
    if (at_end(x))
        return rfail(x, "pattern: a '[' without its ']'");
    x->p++;
    if (x->failed)
        return -1;
    if (negated) /* with \d, \w or \s in it, what Python and ECMA agree on: ASCII */
        set_complement(&s, 0, shorthand ? 0x7f : 0x10ffff);
    return put_set(x, &s);
}

static int parse_alternatives(rx *x);

/* one atom: a group, a class, ".", an escape or a character */
static int parse_atom(rx *x)
{
    char c = *x->p;
    if (c == '(') {
        x->p++;
        if (!at_end(x) && *x->p == '?') {
            if (x->end - x->p >= 2 && x->p[1] == ':')
                x->p += 2;
            else
                return rfail(x,
                             "pattern: lookaround and named groups ('(?') are not supported; "
                             "'(?:' is");
        }
        if (++x->depth > MAX_DEPTH)
            return rfail(x, "pattern: groups nested more than %d deep", MAX_DEPTH);
        fputs("(", x->out);
        if (parse_alternatives(x))
            return -1;
        if (at_end(x) || *x->p != ')')
            return rfail(x, "pattern: a '(' without its ')'");
        x->p++, x->depth--;
        fputs(")", x->out); /* x->empty: the alternatives' */
        return 0;
    }
    x->empty = 0;
    if (c == '[') {
        x->p++;
        return parse_class(x);
    }
    cpset s = {.n = 0};
    if (c == '.') { /* any character but a line break (ECMA's four, Python's one) */
        x->p++;
        cpset breaks = {.n = 0};
        set_add(x, &breaks, '\n', '\n'), set_add(x, &breaks, '\r', '\r');
        set_add(x, &breaks, 0x2028, 0x2029);
        set_complement(&breaks, 0, 0x10ffff);
        return put_set(x, &breaks);
    }
    if (c == '^' || c == '$')
        return rfail(x, "pattern: '%c' is supported only at the very %s of the pattern", c,
                     c == '^' ? "start" : "end");
    if (c == ')' || c == '*' || c == '+' || c == '?' || c == '{')
        return rfail(x, "pattern: '%c' with nothing before it to apply to", c);
    uint32_t cp;
    if (c == '\\') {
        x->p++;
        int k = escape(x, &cp, &s, 0);
        if (k < 0)
            return -1;
        if (k == 1)
            return put_set(x, &s);
    } else {
        cp = next_char(x);
    }
    if (!put_char(x, cp))
        return rfail(x, "pattern: control character U+%04X cannot be in a JSON string here", cp);
    return 0;
}

static int read_count(rx *x, int *out)
{
    long v = 0;
    const char *start = x->p;
    while (!at_end(x) && *x->p >= '0' && *x->p <= '9' && v <= MAX_COUNT)
        v = v * 10 + (*x->p++ - '0');
    if (x->p == start)
        return rfail(x, "pattern: expected a number in {...}");
    if (v > MAX_COUNT)
        return rfail(x, "pattern: a count above %d in {...}", MAX_COUNT);
    *out = (int)v;
    return 0;
}

/* a sequence of atoms, each maybe quantified, up to '|', ')' or the end */
static int parse_sequence(rx *x)
{
    int n = 0, all_empty = 1;
    while (!at_end(x) && *x->p != '|' && *x->p != ')' && !x->failed) {
        fputs(n++ ? " (" : "(", x->out);
        if (parse_atom(x))
            return -1;
        fputs(")", x->out);
        int atom_empty = x->empty;
        for (int quantified = 0; !at_end(x);) {
            char q = *x->p;
            int lo = q == '+', hi = q == '?' ? 1 : -1; /* the repetition's bounds */
            if (q == '*' || q == '+' || q == '?') {
                x->p++;
                fputc(q, x->out);
            } else if (q == '{') {
                x->p++;
                if (read_count(x, &lo))
                    return -1;
                hi = lo;
                if (!at_end(x) && *x->p == ',') {
                    x->p++;
                    hi = -1;
                    if (!at_end(x) && *x->p != '}' && read_count(x, &hi))
                        return -1;
                }
                if (at_end(x) || *x->p != '}')
                    return rfail(x, "pattern: a '{' without its '}'");
                x->p++;
                if (hi >= 0 && hi < lo)
                    return rfail(x, "pattern: {%d,%d} counts down", lo, hi);
                if (hi < 0)
                    fprintf(x->out, "{%d,}", lo);
                else
                    fprintf(x->out, "{%d,%d}", lo, hi);
            } else {
                break;
            }
            if (quantified++) /* "a**" is an error in ECMA too */
                return rfail(x, "pattern: a quantifier after a quantifier");
            /* a part that can match nothing, repeated without bound ("(a*)*"), has endless
             * ways to match the same text: a grammar cannot follow that */
            if (atom_empty && hi < 0)
                return rfail(x,
                             "pattern: a part that can match nothing is repeated without "
                             "bound (as in '(a*)*'); repeat a part that matches something");
            atom_empty |= lo == 0;
            if (!at_end(x) && *x->p == '?') /* lazy: the same strings */
                x->p++;
        }
        all_empty &= atom_empty;
    }
    if (!n)
        fputs("\"\"", x->out);
    x->empty = all_empty;
    return x->failed ? -1 : 0;
}

static int parse_alternatives(rx *x)
{
    int any_empty = 0;
    for (int n = 0;; n++) {
        if (n)
            fputs(" | ", x->out);
        if (parse_sequence(x))
            return -1;
        any_empty |= x->empty;
        if (at_end(x) || *x->p != '|') {
            x->empty = any_empty;
            return 0;
        }
        x->p++;
    }
}

int loom_regex_to_gbnf(const char *pattern, const char *any_char, char **gbnf, char *err,
                       size_t err_size)
{
    size_t len = 0, n = strlen(pattern);
    *gbnf = NULL;
    rx x = {.p = pattern, .end = pattern + n, .err = err, .err_size = err_size};
    /* "^" and "$" at the ends anchor the whole; a '$' escaped by an odd run of backslashes is
     * a dollar sign */
    int head = n && pattern[0] == '^', tail = 0;
    if (n > (size_t)head && pattern[n - 1] == '$') {
        size_t k = 0;
        while (k + 1 < n && pattern[n - 2 - k] == '\\')
            k++;
        tail = k % 2 == 0;
    }
    x.p += head, x.end -= tail;
    if (!(x.out = open_memstream(gbnf, &len))) {
        snprintf(err, err_size, "out of memory");
        return -1;
    }
    if (!head)
        fprintf(x.out, "%s* ", any_char);
    fputs("(", x.out);
    const char *body = x.p;
    int rc = parse_alternatives(&x);
    if (!rc && !at_end(&x))
        rc = rfail(&x, "pattern: a ')' without its '('");
    fputs(")", x.out);
    if (!tail)
        fprintf(x.out, " %s*", any_char);
    /* "^a|b$" is (^a)|(b$): anchors beside a top-level "|" mean something else */
    if (!rc && (head || tail)) {
        int depth = 0, top_alt = 0;
        for (const char *p = body; p < x.end; p++) {
            if (*p == '\\' && p + 1 < x.end)
                p++;
            else if (*p == '[')
                while (p + 1 < x.end && *++p != ']')
                    p += *p == '\\';
            else
                depth += *p == '(' ? 1 : *p == ')' ? -1 : 0, top_alt |= *p == '|' && !depth;
        }
        if (top_alt)
            rc = rfail(&x,
                       "pattern: '^' or '$' beside a top-level '|' anchors one alternative "
                       "only; group them: ^(a|b)$");
    }
    if (fclose(x.out) != 0 && !rc)
        rc = rfail(&x, "out of memory");
    if (rc) {
        free(*gbnf);
        *gbnf = NULL;
    }
    return rc;
}
