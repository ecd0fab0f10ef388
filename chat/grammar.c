/*
 * chat/grammar.c - grammars for constrained decoding (see grammar.h).
 *
 * GBNF, llama.cpp's grammar syntax: `name ::= alternatives`, sequences of "literals",
 * [character classes] ([^...] negated, `.` any character), rule names, ( groups ), and the
 * postfix operators * + ? {m} {m,} {m,n}; # comments. Characters are Unicode code points; the
 * compiled grammar is over bytes: a literal becomes its UTF-8 bytes and a class the byte
 * sequences that encode its code points, so the matcher takes a token's bytes one at a time
 * and never needs a token to end on a character boundary. Repetitions become right-recursive
 * rules; a left-recursive grammar is refused (it would never advance).
 *
 * Matching is a pushdown automaton with sets of stacks as states, interned: a stack is a
 * chain of frames (a position in a rule, and the frame to return to), each frame hash-consed,
 * so equal stacks are equal frame ids and a state is a sorted set of them. The moves between
 * states are remembered per byte, so the automaton becomes a DFA as it is used, and the tokens
 * a state allows (found by walking a trie of the vocabulary's bytes, pruned where the grammar
 * rejects) are remembered per state: inside a JSON string every step is the same state.
 */
#define _GNU_SOURCE
#include "chat/grammar.h"

#include "core/sampler.h"
#include "core/tokenizer.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { EL_END, EL_BYTES, EL_RULE };

typedef struct gel {
    int32_t kind, arg; /* EL_BYTES: a class (byte set) index; EL_RULE: a rule index */
} gel;

typedef struct gseq {
    gel *v;
    int n, cap;
} gseq;

typedef struct grule {
    char *name; /* NULL: made by the compiler */
    gseq *alts;
    int n_alts, cap_alts;
    int defined, nullable;
} grule;

struct loom_grammar {
    int refs;
    gel *el; /* every alternative's elements, each ended by EL_END */
    int32_t *alt_start, *rule_first_alt, *rule_n_alts;
    int n_rules, root;
    uint8_t (*classes)[32];
    int n_classes;
};

/* ---- building --------------------------------------------------------------------------- */

typedef struct builder {
    const char *src, *p;
    grule *rules;
    int n_rules, cap_rules;
    uint8_t (*classes)[32];
    int n_classes, cap_classes;
    char *err;
    size_t err_size;
    int failed, depth;
} builder;

static int bfail(builder *b, const char *fmt, ...)
{
    if (b->failed)
        return -1;
    int line = 1;
    for (const char *q = b->src; q < b->p && *q; q++)
        line += *q == '\n';
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(b->err, b->err_size, "grammar line %d: %s", line, msg);
    b->failed = 1;
    return -1;
}

static void *grow(void *p, int *cap, int need, size_t size)
{
    if (need <= *cap)
        return p;
    int c = *cap ? *cap * 2 : 8;
    while (c < need)
        c *= 2;
    void *q = realloc(p, (size_t)c * size);
    if (q)
        *cap = c;
    return q;
}

static int push_el(builder *b, gseq *s, int kind, int arg)
{
    gel *v = grow(s->v, &s->cap, s->n + 1, sizeof *v);
    if (!v)
        return bfail(b, "out of memory");
    s->v = v;
    s->v[s->n++] = (gel){kind, arg};
    return 0;
}

#define MAX_GRAMMAR_RULES 200000

static int new_rule(builder *b, const char *name, size_t len)
{
    if (b->n_rules >= MAX_GRAMMAR_RULES)
        return bfail(b, "more than %d rules (counting those repetitions make)", MAX_GRAMMAR_RULES);
    grule *r = grow(b->rules, &b->cap_rules, b->n_rules + 1, sizeof *r);
    if (!r)
        return bfail(b, "out of memory");
    b->rules = r;
    memset(&r[b->n_rules], 0, sizeof *r);
    if (name && !(r[b->n_rules].name = strndup(name, len)))
        return bfail(b, "out of memory");
    return b->n_rules++;
}

static gseq *new_alt(builder *b, int rule)
{
    grule *r = &b->rules[rule];
    gseq *a = grow(r->alts, &r->cap_alts, r->n_alts + 1, sizeof *a);
    if (!a) {
        bfail(b, "out of memory");
        return NULL;
    }
    r->alts = a;
    memset(&a[r->n_alts], 0, sizeof *a);
    return &a[r->n_alts++];
}

static int rule_named(builder *b, const char *name, size_t len)
{
    for (int i = 0; i < b->n_rules; i++)
        if (b->rules[i].name && strlen(b->rules[i].name) == len &&
            !memcmp(b->rules[i].name, name, len))
            return i;
    return new_rule(b, name, len);
}

static int byte_class(builder *b, const uint8_t set[32])
{
    for (int i = 0; i < b->n_classes; i++)
        if (!memcmp(b->classes[i], set, 32))
            return i;
    uint8_t(*c)[32] = grow(b->classes, &b->cap_classes, b->n_classes + 1, sizeof *c);
    if (!c)
        return bfail(b, "out of memory");
    b->classes = c;
    memcpy(c[b->n_classes], set, 32);
    return b->n_classes++;
}

static int push_byte_range(builder *b, gseq *s, unsigned lo, unsigned hi)
{
    uint8_t set[32] = {0};
    for (unsigned c = lo; c <= hi; c++)
        set[c >> 3] |= (uint8_t)(1u << (c & 7));
    int k = byte_class(b, set);
    return k < 0 ? -1 : push_el(b, s, EL_BYTES, k);
}

static int utf8_encode(uint32_t cp, uint8_t *out)
{
    if (cp < 0x80)
        return out[0] = (uint8_t)cp, 1;
    if (cp < 0x800)
        return out[0] = (uint8_t)(0xC0 | cp >> 6), out[1] = (uint8_t)(0x80 | (cp & 0x3F)), 2;
    if (cp < 0x10000)
        return out[0] = (uint8_t)(0xE0 | cp >> 12), out[1] = (uint8_t)(0x80 | (cp >> 6 & 0x3F)),
               out[2] = (uint8_t)(0x80 | (cp & 0x3F)), 3;
    return out[0] = (uint8_t)(0xF0 | cp >> 18), out[1] = (uint8_t)(0x80 | (cp >> 12 & 0x3F)),
           out[2] = (uint8_t)(0x80 | (cp >> 6 & 0x3F)), out[3] = (uint8_t)(0x80 | (cp & 0x3F)), 4;
}

/* Adds to rule the byte sequences that encode the code points lo..hi, each an alternative
 * (the published UTF-8 range splitting: split until every byte ranges independently). */
static int utf8_ranges(builder *b, int rule, uint32_t lo, uint32_t hi)
{
    if (lo > hi || b->failed)
        return b->failed ? -1 : 0;
    static const uint32_t bounds[] = {0x7F, 0x7FF, 0xFFFF};
    for (int i = 0; i < 3; i++)
        if (lo <= bounds[i] && hi > bounds[i])
            return utf8_ranges(b, rule, lo, bounds[i]) || utf8_ranges(b, rule, bounds[i] + 1, hi);
    uint8_t a[4], z[4];
    int n = utf8_encode(lo, a);
    utf8_encode(hi, z);
    for (int i = 1; i < n; i++) {
        uint32_t m = (1u << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if (lo & m)
                return utf8_ranges(b, rule, lo, lo | m) || utf8_ranges(b, rule, (lo | m) + 1, hi);
            if ((hi & m) != m)
                return utf8_ranges(b, rule, lo, (hi & ~m) - 1) || utf8_ranges(b, rule, hi & ~m, hi);
        }
    }
    gseq *s = new_alt(b, rule);
    if (!s)
        return -1;
    for (int i = 0; i < n; i++)
        if (push_byte_range(b, s, a[i], z[i]))
            return -1;
    return 0;
}

/* A set of code-point ranges (sorted, merged) as elements of s: one byte class when all are
 * ASCII, else a rule of their UTF-8 sequences. */
static int push_codepoints(builder *b, gseq *s, const uint32_t (*r)[2], int n)
{
    int ascii = 1;
    for (int i = 0; i < n; i++)
        ascii &= r[i][1] < 0x80;
    if (ascii) {
        uint8_t set[32] = {0};
        for (int i = 0; i < n; i++)
            for (uint32_t c = r[i][0]; c <= r[i][1]; c++)
                set[c >> 3] |= (uint8_t)(1u << (c & 7));
        int k = byte_class(b, set);
        return k < 0 ? -1 : push_el(b, s, EL_BYTES, k);
    }
    int rule = new_rule(b, NULL, 0);
    if (rule < 0)
        return -1;
    b->rules[rule].defined = 1;
    for (int i = 0; i < n; i++) /* surrogates are no characters */
        if (r[i][0] <= 0xDFFF && r[i][1] >= 0xD800) {
            if (utf8_ranges(b, rule, r[i][0], 0xD7FF) || utf8_ranges(b, rule, 0xE000, r[i][1]))
                return -1;
        } else if (utf8_ranges(b, rule, r[i][0], r[i][1])) {
            return -1;
        }
    return push_el(b, s, EL_RULE, rule);
}

static void skip_space(builder *b)
{
    for (;;) {
        while (*b->p == ' ' || *b->p == '\t' || *b->p == '\n' || *b->p == '\r')
            b->p++;
        if (*b->p != '#')
            return;
        while (*b->p && *b->p != '\n')
            b->p++;
    }
}

static int is_name_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
        c == '_';
}

static int hex_value(builder *b, int digits, uint32_t *out)
{
    uint32_t v = 0;
    for (int i = 0; i < digits; i++, b->p++) {
        char c = *b->p;
        int d = c >= '0' && c <= '9' ? c - '0'
            : c >= 'a' && c <= 'f'   ? c - 'a' + 10
            : c >= 'A' && c <= 'F'   ? c - 'A' + 10
                                     : -1;
        if (d < 0)
            return bfail(b, "expected %d hex digits", digits);
        v = v * 16 + (uint32_t)d;
    }
    *out = v;
    return 0;
}

/* One character of a literal or class, escapes decoded. */
static int read_char(builder *b, uint32_t *cp)
{
    const unsigned char *s = (const unsigned char *)b->p;
    if (!*s)
        return bfail(b, "unexpected end of the grammar");
    if (*s == '\\') {
        b->p += 2;
        switch (s[1]) {
        case 'n': return *cp = '\n', 0;
        case 't': return *cp = '\t', 0;
        case 'r': return *cp = '\r', 0;
        case '\\':
        case '"':
        case '[':
        case ']':
        case '-':
        case '^':
        case '/': return *cp = s[1], 0;
        case 'x': return hex_value(b, 2, cp);
        case 'u': return hex_value(b, 4, cp);
        case 'U': return hex_value(b, 8, cp);
        default: b->p--; return bfail(b, "unknown escape '\\%c'", s[1] ? s[1] : ' ');
        }
    }
    size_t k = loom_utf8_valid_prefix(b->p, strnlen(b->p, 4));
    /* the character's UTF-8 bytes (the grammar text is UTF-8) */
    if (s[0] < 0x80) {
        *cp = *s, b->p++;
        return 0;
    }
    int n = s[0] >= 0xF0 ? 4 : s[0] >= 0xE0 ? 3 : 2;
    if (k < (size_t)n)
        return bfail(b, "the grammar is not valid UTF-8");
    *cp = n == 2 ? (uint32_t)(s[0] & 0x1F)
        : n == 3 ? (uint32_t)(s[0] & 0x0F)
                 : (uint32_t)(s[0] & 7);
    for (int i = 1; i < n; i++)
        *cp = *cp << 6 | (s[i] & 0x3F);
    b->p += n;
    return 0;
}

static int cmp_range(const void *x, const void *y)
{
    const uint32_t *a = x, *b = y;
    return a[0] < b[0] ? -1 : a[0] > b[0];
}

/* [...] or [^...] at b->p */
static int parse_class(builder *b, gseq *s)
{
    b->p++;
    int negated = *b->p == '^';
    b->p += negated;
    uint32_t(*r)[2] = NULL;
    int n = 0, cap = 0;
    while (*b->p != ']') {
        uint32_t lo, hi;
        if (read_char(b, &lo))
            return free(r), -1;
        hi = lo;
        if (b->p[0] == '-' && b->p[1] != ']') {
            b->p++;
            if (read_char(b, &hi))
                return free(r), -1;
        }
        if (hi < lo || hi > 0x10FFFF)
            return free(r), bfail(b, "a character range runs backwards or past U+10FFFF");
        uint32_t(*g)[2] = grow(r, &cap, n + 1, sizeof *r);
        if (!g)
            return free(r), bfail(b, "out of memory");
        r = g;
        r[n][0] = lo, r[n][1] = hi, n++;
    }
    b->p++;
    if (n)
        qsort(r, (size_t)n, sizeof *r, cmp_range);
    int m = 0;
    for (int i = 0; i < n; i++) /* merged */
        if (m && r[i][0] <= r[m - 1][1] + 1) {
            if (r[i][1] > r[m - 1][1])
                r[m - 1][1] = r[i][1];
        } else {
            r[m][0] = r[i][0], r[m][1] = r[i][1], m++;
        }
    if (negated) {
        uint32_t(*c)[2] = malloc((size_t)(m + 1) * sizeof *c);
        if (!c)
            return free(r), bfail(b, "out of memory");
        int k = 0;
        uint32_t next = 0;
        for (int i = 0; i < m; i++) {
            if (r[i][0] > next)
                c[k][0] = next, c[k][1] = r[i][0] - 1, k++;
            next = r[i][1] + 1;
        }
        if (next <= 0x10FFFF)
            c[k][0] = next, c[k][1] = 0x10FFFF, k++;
        free(r);
        r = c, m = k;
    }
    if (m == 0)
        return free(r), bfail(b, "a character class that matches nothing");
    int rc = push_codepoints(b, s, (const uint32_t(*)[2])r, m);
    free(r);
    return rc;
}

static int parse_alternatives(builder *b, int rule, int nested);

/* Wraps s->v[from..] into a new rule (one alternative); returns it. */
static int wrap(builder *b, gseq *s, int from)
{
    int rule = new_rule(b, NULL, 0);
    if (rule < 0)
        return -1;
    b->rules[rule].defined = 1;
    gseq *a = new_alt(b, rule);
    if (!a)
        return -1;
    for (int i = from; i < s->n; i++)
        if (push_el(b, a, s->v[i].kind, s->v[i].arg))
            return -1;
    s->n = from;
    return rule;
}

/* x repeated min..max times (max < 0: no bound) in place of s->v[from..]. */
static int repeat(builder *b, gseq *s, int from, int min, int max)
{
    if (s->n == from)
        return bfail(b, "nothing to repeat");
    int x = wrap(b, s, from);
    if (x < 0)
        return -1;
    for (int i = 0; i < min; i++)
        if (push_el(b, s, EL_RULE, x))
            return -1;
    if (max >= 0 && max == min)
        return 0;
    /* unbounded: star ::= x star | ; bounded: opt_k ::= x opt_{k-1} | , opt_0 empty */
    int prev = -1, n_opt = max < 0 ? 1 : max - min;
    for (int k = 0; k < n_opt; k++) {
        int r = new_rule(b, NULL, 0);
        if (r < 0)
            return -1;
        b->rules[r].defined = 1;
        gseq *a = new_alt(b, r);
        if (!a || push_el(b, a, EL_RULE, x) ||
            (max < 0         ? push_el(b, a, EL_RULE, r)
                 : prev >= 0 ? push_el(b, a, EL_RULE, prev)
                             : 0) ||
            !new_alt(b, r))
            return -1;
        prev = r;
    }
    return push_el(b, s, EL_RULE, prev);
}

static int parse_number(builder *b, int *out)
{
    if (*b->p < '0' || *b->p > '9')
        return bfail(b, "expected a number in {m,n}");
    long v = 0;
    while (*b->p >= '0' && *b->p <= '9' && v < 100000)
        v = v * 10 + (*b->p++ - '0');
    if (v > 10000)
        return bfail(b, "a repetition count above 10000");
    *out = (int)v;
    return 0;
}

static int parse_sequence(builder *b, gseq *s, int nested)
{
    for (;;) {
        skip_space(b);
        char c = *b->p;
        int from = s->n;
        if (!c || c == '|' || c == ')')
            return 0;
        if (is_name_char(c)) { /* a reference, unless it starts the next rule */
            const char *e = b->p;
            while (is_name_char(*e))
                e++;
            const char *q = e;
            while (*q == ' ' || *q == '\t' || *q == '\n' || *q == '\r')
                q++;
            if (!strncmp(q, "::=", 3)) {
                if (nested)
                    return bfail(b, "a rule definition inside parentheses");
                return 0;
            }
            int r = rule_named(b, b->p, (size_t)(e - b->p));
            if (r < 0 || push_el(b, s, EL_RULE, r))
                return -1;
            b->p = e;
        } else if (c == '"') {
            b->p++;
            while (*b->p != '"') {
                uint32_t cp;
                uint8_t u[4];
                if (read_char(b, &cp))
                    return -1;
                if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
                    return bfail(b, "U+%04X is no character", (unsigned)cp);
                int n = utf8_encode(cp, u);
                for (int i = 0; i < n; i++)
                    if (push_byte_range(b, s, u[i], u[i]))
                        return -1;
            }
            b->p++;
        } else if (c == '[') {
            if (parse_class(b, s))
                return -1;
        } else if (c == '.') {
            b->p++;
            static const uint32_t any[1][2] = {{0, 0x10FFFF}};
            if (push_codepoints(b, s, any, 1))
                return -1;
        } else if (c == '(') {
            b->p++;
            if (++b->depth > 100)
                return bfail(b, "parentheses nested more than 100 deep");
            int r = new_rule(b, NULL, 0);
            if (r < 0)
                return -1;
            b->rules[r].defined = 1;
            if (parse_alternatives(b, r, 1))
                return -1;
            skip_space(b);
            if (*b->p != ')')
                return bfail(b, "expected ')'");
            b->p++, b->depth--;
            if (push_el(b, s, EL_RULE, r))
                return -1;
        } else {
            return bfail(b, "unexpected '%c'", c);
        }
        /* postfix operators apply to what was just read */
        for (;;) {
            char op = *b->p;
            int rc = 0;
            if (op == '*')
                b->p++, rc = repeat(b, s, from, 0, -1);
            else if (op == '+')
                b->p++, rc = repeat(b, s, from, 1, -1);
            else if (op == '?')
                b->p++, rc = repeat(b, s, from, 0, 1);
            else if (op == '{') {
                int lo, hi;
                b->p++;
                skip_space(b);
                if (parse_number(b, &lo))
                    return -1;
                skip_space(b);
                hi = lo;
                if (*b->p == ',') {
                    b->p++;
                    skip_space(b);
                    hi = -1;
                    if (*b->p != '}' && parse_number(b, &hi))
                        return -1;
                    skip_space(b);
                }
                if (*b->p != '}')
                    return bfail(b, "expected '}'");
                b->p++;
                if (hi >= 0 && hi < lo)
                    return bfail(b, "{%d,%d}: the bound is below the count", lo, hi);
                rc = repeat(b, s, from, lo, hi);
            } else
                break;
            if (rc)
                return -1;
        }
    }
}

static int parse_alternatives(builder *b, int rule, int nested)
{
    for (;;) {
        gseq *s = new_alt(b, rule);
        if (!s)
            return -1;
        /* s may move as rules grow: parse into a local sequence, then store it */
        gseq local = {0};
        int alt = b->rules[rule].n_alts - 1;
        if (parse_sequence(b, &local, nested)) {
            free(local.v);
            return -1;
        }
        b->rules[rule].alts[alt] = local;
        skip_space(b);
        if (*b->p != '|')
            return 0;
        b->p++;
    }
}

static void builder_free(builder *b)
{
    for (int i = 0; i < b->n_rules; i++) {
        for (int k = 0; k < b->rules[i].n_alts; k++)
            free(b->rules[i].alts[k].v);
        free(b->rules[i].alts);
        free(b->rules[i].name);
    }
    free(b->rules);
    free(b->classes);
}

/* Marks nullable rules (a worklist: linear in the grammar's size), then refuses a rule that
 * can reach itself before any byte (a depth-first search for a cycle among the rules each can
 * begin with), both without recursion: the grammar may come from a request. */
static int check_left_recursion(builder *b)
{
    int n = b->n_rules, n_alts = 0, n_refs = 0, rc = 0;
    for (int r = 0; r < n; r++)
        for (int a = 0; a < b->rules[r].n_alts; a++, n_alts++)
            n_refs += b->rules[r].alts[a].n;
    /* per alternative: its rule, and how many of its elements are not (yet) nullable */
    int32_t *alt_rule = malloc(((size_t)n_alts + 1) * sizeof *alt_rule);
    int32_t *pending = malloc(((size_t)n_alts + 1) * sizeof *pending);
    /* per rule: the alternatives it occurs in (once per occurrence), CSR */
    int32_t *first = calloc((size_t)n + 1, sizeof *first);
    int32_t *uses = malloc(((size_t)n_refs + 1) * sizeof *uses);
    int32_t *work = malloc(((size_t)n + 1) * sizeof *work);
    int32_t *edge_first = calloc((size_t)n + 1, sizeof *edge_first);
    int32_t *edges = malloc(((size_t)n_refs + 1) * sizeof *edges);
    int32_t *stack = malloc(((size_t)n + 1) * 2 * sizeof *stack);
    uint8_t *color = calloc((size_t)n + 1, 1);
    if (!alt_rule || !pending || !first || !uses || !work || !edge_first || !edges || !stack ||
        !color) {
        rc = bfail(b, "out of memory");
        goto done;
    }
    int k = 0, n_work = 0;
    for (int r = 0; r < n; r++)
        for (int a = 0; a < b->rules[r].n_alts; a++, k++) {
            gseq *sq = &b->rules[r].alts[a];
            alt_rule[k] = r, pending[k] = sq->n;
            for (int i = 0; i < sq->n; i++)
                if (sq->v[i].kind == EL_RULE)
                    first[sq->v[i].arg + 1]++;
            if (sq->n == 0 && !b->rules[r].nullable)
                b->rules[r].nullable = 1, work[n_work++] = r;
        }
    for (int r = 0; r < n; r++)
        first[r + 1] += first[r];
    k = 0;
    for (int r = 0; r < n; r++)
        for (int a = 0; a < b->rules[r].n_alts; a++, k++) {
            gseq *sq = &b->rules[r].alts[a];
            for (int i = 0; i < sq->n; i++)
                if (sq->v[i].kind == EL_RULE)
                    uses[first[sq->v[i].arg]++] = k;
        }
    for (int r = n; r > 0; r--) /* back to starts */
        first[r] = first[r - 1];
    first[0] = 0;
    while (n_work) {
        int r = work[--n_work];
        for (int32_t u = first[r]; u < first[r + 1]; u++)
            if (--pending[uses[u]] == 0 && !b->rules[alt_rule[uses[u]]].nullable) {
                b->rules[alt_rule[uses[u]]].nullable = 1;
                work[n_work++] = alt_rule[uses[u]];
            }
    }
    /* edges r -> s: s can begin r */
    int e = 0;
    for (int r = 0; r < n; r++) {
        edge_first[r] = e;
        for (int a = 0; a < b->rules[r].n_alts; a++) {
            gseq *sq = &b->rules[r].alts[a];
            for (int i = 0; i < sq->n && sq->v[i].kind == EL_RULE; i++) {
                edges[e++] = sq->v[i].arg;
                if (!b->rules[sq->v[i].arg].nullable)
                    break;
            }
        }
    }
    edge_first[n] = e;
    int bad = -1;
    for (int start = 0; start < n && bad < 0; start++) {
        if (color[start])
            continue;
        int sp = 0;
        stack[sp++] = start, stack[sp++] = edge_first[start];
        color[start] = 1; /* 1: on the path, 2: done */
        while (sp && bad < 0) {
            int r = stack[sp - 2], i = stack[sp - 1];
            if (i == edge_first[r + 1]) {
                color[r] = 2, sp -= 2;
                continue;
            }
            stack[sp - 1]++;
            int s2 = edges[i];
            if (color[s2] == 1)
                bad = s2;
            else if (!color[s2])
                color[s2] = 1, stack[sp++] = s2, stack[sp++] = edge_first[s2];
        }
    }
    if (bad >= 0) {
        int named = bad;
        for (int r = 0; r < n && !b->rules[named].name; r++)
            if (b->rules[r].name)
                named = r;
        rc = bfail(b, "rule '%s' is left-recursive (it can reach itself before any character)",
                   b->rules[named].name ? b->rules[named].name : "?");
    }
done:
    free(alt_rule), free(pending), free(first), free(uses), free(work);
    free(edge_first), free(edges), free(stack), free(color);
    return rc;
}


loom_grammar *loom_grammar_compile(const char *gbnf, char *err, size_t err_size)
{
    builder b = {.src = gbnf, .p = gbnf, .err = err, .err_size = err_size};
    for (;;) {
        skip_space(&b);
        if (!*b.p)
            break;
        const char *name = b.p;
        while (is_name_char(*b.p))
            b.p++;
        size_t len = (size_t)(b.p - name);
        skip_space(&b);
        if (!len || strncmp(b.p, "::=", 3)) {
            bfail(&b, "expected a rule: name ::= ...");
            break;
        }
        b.p += 3;
        int r = rule_named(&b, name, len);
        if (r < 0)
            break;
        if (b.rules[r].defined) {
            bfail(&b, "rule '%s' is defined twice", b.rules[r].name);
            break;
        }
        b.rules[r].defined = 1;
        if (parse_alternatives(&b, r, 0))
            break;
        if (*b.p == ')') {
            bfail(&b, "unexpected ')'");
            break;
        }
    }
    int root = -1;
    for (int i = 0; !b.failed && i < b.n_rules; i++) {
        if (!b.rules[i].defined)
            bfail(&b, "rule '%s' is used but not defined", b.rules[i].name);
        if (b.rules[i].name && !strcmp(b.rules[i].name, "root"))
            root = i;
    }
    if (!b.failed && root < 0)
        bfail(&b, "no rule named 'root' (where the answer starts)");
    if (!b.failed)
        check_left_recursion(&b);
    loom_grammar *g = b.failed ? NULL : calloc(1, sizeof *g);
    if (!b.failed && !g)
        snprintf(err, err_size, "out of memory");
    if (g) {
        int n_el = 0, n_alts = 0;
        for (int i = 0; i < b.n_rules; i++)
            for (int a = 0; a < b.rules[i].n_alts; a++)
                n_el += b.rules[i].alts[a].n + 1, n_alts++;
        g->refs = 1, g->root = root, g->n_rules = b.n_rules;
        g->el = malloc((size_t)n_el * sizeof *g->el);
        g->alt_start = malloc((size_t)(n_alts ? n_alts : 1) * sizeof *g->alt_start);
        g->rule_first_alt = malloc((size_t)b.n_rules * sizeof(int32_t));
        g->rule_n_alts = malloc((size_t)b.n_rules * sizeof(int32_t));
        g->classes = b.classes, g->n_classes = b.n_classes;
        b.classes = NULL;
        if (!g->el || !g->alt_start || !g->rule_first_alt || !g->rule_n_alts) {
            loom_grammar_free(g);
            g = NULL;
            snprintf(err, err_size, "out of memory");
        } else {
            int e = 0, k = 0;
            for (int i = 0; i < b.n_rules; i++) {
                g->rule_first_alt[i] = k, g->rule_n_alts[i] = b.rules[i].n_alts;
                for (int a = 0; a < b.rules[i].n_alts; a++) {
                    g->alt_start[k++] = e;
                    if (b.rules[i].alts[a].n) /* an empty one has no array */
                        memcpy(g->el + e, b.rules[i].alts[a].v,
                               (size_t)b.rules[i].alts[a].n * sizeof *g->el);
                    e += b.rules[i].alts[a].n;
                    g->el[e++] = (gel){EL_END, 0};
                }
            }
        }
    }
    builder_free(&b);
    return g;
}

loom_grammar *loom_grammar_ref(loom_grammar *g)
{
    if (g)
        __atomic_add_fetch(&g->refs, 1, __ATOMIC_RELAXED);
    return g;
}

void loom_grammar_free(loom_grammar *g)
{
    if (!g || __atomic_sub_fetch(&g->refs, 1, __ATOMIC_ACQ_REL) > 0)
        return;
    free(g->el), free(g->alt_start), free(g->rule_first_alt), free(g->rule_n_alts);
    free(g->classes);
    free(g);
}

/* ---- the vocabulary as a trie of bytes --------------------------------------------------- */

typedef struct trie_node {
    uint8_t byte;
    uint16_t depth;           /* 1 for a first byte */
    int32_t subtree_end;      /* the node after this one's subtree, in preorder */
    int32_t tok_first, n_tok; /* tokens spelled by the path to here (in vocab->sorted) */
} trie_node;

struct grammar_vocab {
    int32_t n_vocab;
    char *bytes;      /* every token's text */
    int64_t *offset;  /* token i is bytes[offset[i] .. offset[i + 1]) */
    uint8_t *is_stop; /* stop tokens (end of the answer) */
    trie_node *nodes;
    int32_t n_nodes, max_depth;
    int32_t *sorted; /* token ids in the trie's order */
};

static int cmp_token_bytes(const void *x, const void *y, void *vocab)
{
    const grammar_vocab *v = vocab;
    int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
    int64_t la = v->offset[a + 1] - v->offset[a], lb = v->offset[b + 1] - v->offset[b];
    int c = memcmp(v->bytes + v->offset[a], v->bytes + v->offset[b], (size_t)(la < lb ? la : lb));
    return c ? c : la < lb ? -1 : la > lb ? 1 : a < b ? -1 : 1;
}

void grammar_vocab_free(grammar_vocab *v)
{
    if (!v)
        return;
    free(v->bytes), free(v->offset), free(v->is_stop), free(v->nodes), free(v->sorted);
    free(v);
}

grammar_vocab *grammar_vocab_new(const loom_tokenizer *tok, int control_text, char *err,
                                 size_t err_size)
{
    grammar_vocab *v = calloc(1, sizeof *v);
    int32_t n = loom_tokenizer_vocab_size(tok);
    size_t cap = (size_t)n * 8 + 1024, len = 0;
    if (v) {
        v->n_vocab = n;
        v->bytes = malloc(cap);
        v->offset = malloc(((size_t)n + 1) * sizeof *v->offset);
        v->is_stop = calloc((size_t)n, 1);
        v->sorted = malloc((size_t)n * sizeof *v->sorted);
    }
    if (!v || !v->bytes || !v->offset || !v->is_stop || !v->sorted)
        goto oom;
    int32_t n_sorted = 0;
    for (int32_t id = 0; id < n; id++) {
        char piece[512];
        int k = loom_tokenizer_is_stop(tok, id) ? 0
            : control_text ? loom_tokenizer_piece_control(tok, id, id, piece, sizeof piece)
                           : loom_tokenizer_piece(tok, id, id, piece, sizeof piece);
        v->is_stop[id] = (uint8_t)loom_tokenizer_is_stop(tok, id);
        if (k < 0 || k > (int)sizeof piece)
            k = 0;
        if (len + (size_t)k > cap) {
            char *nb = realloc(v->bytes, cap * 2 + (size_t)k);
            if (!nb)
                goto oom;
            v->bytes = nb, cap = cap * 2 + (size_t)k;
        }
        v->offset[id] = (int64_t)len;
        memcpy(v->bytes + len, piece, (size_t)k);
        len += (size_t)k;
        if (k > 0)
            v->sorted[n_sorted++] = id;
    }
    v->offset[n] = (int64_t)len;
    qsort_r(v->sorted, (size_t)n_sorted, sizeof *v->sorted, cmp_token_bytes, v);
    /* the trie in preorder: each token adds the nodes its bytes need past what it shares with
     * the one before it */
    int cap_nodes = 0;
    int32_t path[512];
    int depth = 0;
    const char *prev = NULL;
    int64_t prev_len = 0;
    for (int32_t i = 0; i < n_sorted; i++) {
        int32_t id = v->sorted[i];
        const char *t = v->bytes + v->offset[id];
        int64_t tl = v->offset[id + 1] - v->offset[id];
        int64_t common = 0;
        while (prev && common < tl && common < prev_len && common < depth &&
               t[common] == prev[common])
            common++;
        if (prev && common == tl && tl == prev_len && depth == tl) { /* the same bytes again */
            v->nodes[path[depth - 1]].n_tok++;
            continue;
        }
        while (depth > common)
            v->nodes[path[--depth]].subtree_end = v->n_nodes;
        for (int64_t d = common; d < tl && d < 512; d++) {
            trie_node *g = grow(v->nodes, &cap_nodes, v->n_nodes + 1, sizeof *g);
            if (!g)
                goto oom;
            v->nodes = g;
            g[v->n_nodes] = (trie_node){
                .byte = (uint8_t)t[d], .depth = (uint16_t)(d + 1), .tok_first = -1};
            path[depth++] = v->n_nodes++;
        }
        trie_node *last = &v->nodes[path[depth - 1]];
        if (last->n_tok == 0)
            last->tok_first = i;
        last->n_tok++;
        if (depth > v->max_depth)
            v->max_depth = depth;
        prev = t, prev_len = tl;
    }
    while (depth > 0)
        v->nodes[path[--depth]].subtree_end = v->n_nodes;
    return v;
oom:
    grammar_vocab_free(v);
    snprintf(err, err_size, "out of memory (the grammar's vocabulary)");
    return NULL;
}

/* ---- matching ----------------------------------------------------------------------------- */

/* frame 0 is the empty stack: the answer may end */
typedef struct frame {
    int32_t pos, parent;
} frame;

typedef struct state {
    int32_t off, n; /* its frames: set_frames[off .. off + n), sorted */
    uint32_t hash;
    int32_t *next;  /* per byte: the state after it, -1 none, -2 not yet known (lazily) */
    uint32_t *mask; /* the tokens allowed here (lazily) */
} state;

#define MAX_FRAMES (1 << 20)
#define MAX_STATES (1 << 15) /* each state's moves take 1 KiB */
/* stacks expanded for one token: a generic JSON grammar's first masks over a 152k vocabulary
 * take up to ~1M; past this (about a second) a grammar is too costly to follow */
#define MAX_WORK 30000000
#define MAX_STACKS 1024 /* stacks in one state: more is a grammar too ambiguous to follow */
#define MAX_MASKS 512   /* masks kept per answer */

struct grammar_matcher {
    const loom_grammar *g;
    const grammar_vocab *v;
    frame *frames;
    int32_t n_frames, cap_frames;
    int32_t *frame_hash; /* open addressing over frames: index + 1, 0 empty */
    int32_t frame_hash_cap;
    state *states;
    int32_t n_states, cap_states;
    int32_t *set_frames;
    int64_t n_set_frames, cap_set_frames;
    int32_t *state_hash;
    int32_t state_hash_cap;
    int32_t current;
    int n_masks;
    int32_t *scratch; /* stacks being built */
    int n_scratch, failed;
    int32_t *walk; /* the trie walk's state per depth */
    long work;     /* stacks expanded since the caller's call began (MAX_WORK) */
    char err[200];
};

static uint32_t mix(uint32_t h, uint32_t x)
{
    h ^= x + 0x9e3779b9u + (h << 6) + (h >> 2);
    return h;
}

static int rehash_frames(grammar_matcher *m)
{
    int32_t cap = m->frame_hash_cap ? m->frame_hash_cap * 2 : 1024;
    int32_t *h = calloc((size_t)cap, sizeof *h);
    if (!h)
        return -1;
    for (int32_t i = 0; i < m->n_frames; i++) {
        uint32_t k = mix((uint32_t)m->frames[i].pos, (uint32_t)m->frames[i].parent) &
            (uint32_t)(cap - 1);
        while (h[k])
            k = (k + 1) & (uint32_t)(cap - 1);
        h[k] = i + 1;
    }
    free(m->frame_hash);
    m->frame_hash = h, m->frame_hash_cap = cap;
    return 0;
}

static int32_t intern_frame(grammar_matcher *m, int32_t pos, int32_t parent)
{
    if (2 * (m->n_frames + 1) > m->frame_hash_cap && rehash_frames(m))
        return -1;
    uint32_t k = mix((uint32_t)pos, (uint32_t)parent) & (uint32_t)(m->frame_hash_cap - 1);
    for (; m->frame_hash[k]; k = (k + 1) & (uint32_t)(m->frame_hash_cap - 1)) {
        frame *f = &m->frames[m->frame_hash[k] - 1];
        if (f->pos == pos && f->parent == parent)
            return m->frame_hash[k] - 1;
    }
    if (m->n_frames >= MAX_FRAMES) {
        snprintf(m->err, sizeof m->err, "the grammar's stacks passed %d frames", MAX_FRAMES);
        return -1;
    }
    frame *f = grow(m->frames, &m->cap_frames, m->n_frames + 1, sizeof *f);
    if (!f)
        return -1;
    m->frames = f;
    f[m->n_frames] = (frame){pos, parent};
    m->frame_hash[k] = m->n_frames + 1;
    return m->n_frames++;
}

static int add_stack(grammar_matcher *m, int32_t f)
{
    if (m->n_scratch >= MAX_STACKS) {
        snprintf(m->err, sizeof m->err,
                 "the grammar is too ambiguous: more than %d ways to read the answer at once",
                 MAX_STACKS);
        return -1;
    }
    m->scratch[m->n_scratch++] = f;
    return 0;
}

/* The stacks that continue at element pos, returning to frame parent (-1: the bottom), each
 * with a byte class on top (or the empty stack). */
static int expand(grammar_matcher *m, int32_t pos, int32_t parent, int depth)
{
    const loom_grammar *g = m->g;
    if (depth > 10000) {
        snprintf(m->err, sizeof m->err, "the grammar nests more than 10000 rules deep");
        return -1;
    }
    if (++m->work > MAX_WORK) {
        snprintf(m->err, sizeof m->err,
                 "the grammar is too costly to follow (more than %d stack steps for one token)",
                 MAX_WORK);
        return -1;
    }
    const gel *e = &g->el[pos];
    if (e->kind == EL_END)
        return parent < 0 ? add_stack(m, 0)
                          : expand(m, m->frames[parent].pos, m->frames[parent].parent, depth + 1);
    if (e->kind == EL_BYTES) {
        int32_t f = intern_frame(m, pos, parent);
        return f < 0 ? -1 : add_stack(m, f);
    }
    /* where the rule returns to; a reference last in its sequence returns where the sequence
     * would (a tail call), so x* and other right recursion keep a stack of constant depth and
     * its states repeat (and their masks are found once) */
    int32_t ret = g->el[pos + 1].kind == EL_END ? parent : intern_frame(m, pos + 1, parent);
    if (ret < 0 && g->el[pos + 1].kind != EL_END)
        return -1;
    for (int a = 0; a < g->rule_n_alts[e->arg]; a++)
        if (expand(m, g->alt_start[g->rule_first_alt[e->arg] + a], ret, depth + 1))
            return -1;
    return 0;
}

static int cmp_i32(const void *x, const void *y)
{
    int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
    return a < b ? -1 : a > b;
}

static int rehash_states(grammar_matcher *m)
{
    int32_t cap = m->state_hash_cap ? m->state_hash_cap * 2 : 256;
    int32_t *h = calloc((size_t)cap, sizeof *h);
    if (!h)
        return -1;
    for (int32_t i = 0; i < m->n_states; i++) {
        uint32_t k = m->states[i].hash & (uint32_t)(cap - 1);
        while (h[k])
            k = (k + 1) & (uint32_t)(cap - 1);
        h[k] = i + 1;
    }
    free(m->state_hash);
    m->state_hash = h, m->state_hash_cap = cap;
    return 0;
}

/* The scratch stacks as a state: its id, -1 when there are none (a dead end), -2 on error. */
static int32_t intern_state(grammar_matcher *m)
{
    if (m->n_scratch == 0)
        return -1;
    qsort(m->scratch, (size_t)m->n_scratch, sizeof *m->scratch, cmp_i32);
    int n = 1;
    for (int i = 1; i < m->n_scratch; i++)
        if (m->scratch[i] != m->scratch[n - 1])
            m->scratch[n++] = m->scratch[i];
    uint32_t h = (uint32_t)n;
    for (int i = 0; i < n; i++)
        h = mix(h, (uint32_t)m->scratch[i]);
    if (2 * (m->n_states + 1) > m->state_hash_cap && rehash_states(m))
        return -2;
    uint32_t k = h & (uint32_t)(m->state_hash_cap - 1);
    for (; m->state_hash[k]; k = (k + 1) & (uint32_t)(m->state_hash_cap - 1)) {
        state *s = &m->states[m->state_hash[k] - 1];
        if (s->hash == h && s->n == n &&
            !memcmp(m->set_frames + s->off, m->scratch, (size_t)n * sizeof *m->scratch))
            return m->state_hash[k] - 1;
    }
    if (m->n_states >= MAX_STATES) {
        snprintf(m->err, sizeof m->err, "the grammar passed %d states", MAX_STATES);
        return -2;
    }
    state *st = grow(m->states, &m->cap_states, m->n_states + 1, sizeof *st);
    if (!st)
        return -2;
    m->states = st;
    if (m->n_set_frames + n > m->cap_set_frames) {
        int64_t c = (m->n_set_frames + n) * 2;
        int32_t *sf = realloc(m->set_frames, (size_t)c * sizeof *sf);
        if (!sf)
            return -2;
        m->set_frames = sf, m->cap_set_frames = c;
    }
    memcpy(m->set_frames + m->n_set_frames, m->scratch, (size_t)n * sizeof *m->scratch);
    st[m->n_states] = (state){.off = (int32_t)m->n_set_frames, .n = n, .hash = h};
    m->n_set_frames += n;
    m->state_hash[k] = m->n_states + 1;
    return m->n_states++;
}

/* The state after byte c from state s: -1 none, -2 on error. */
static int32_t step(grammar_matcher *m, int32_t s, uint8_t c)
{
    state *st = &m->states[s];
    if (!st->next) {
        if (!(st->next = malloc(256 * sizeof *st->next)))
            return -2;
        for (int i = 0; i < 256; i++)
            st->next[i] = -3;
    }
    if (st->next[c] != -3)
        return st->next[c];
    m->n_scratch = 0;
    const loom_grammar *g = m->g;
    for (int32_t i = 0; i < m->states[s].n; i++) {
        int32_t f = m->set_frames[m->states[s].off + i];
        if (f == 0)
            continue;
        const frame *fr = &m->frames[f];
        const uint8_t *cls = g->classes[g->el[fr->pos].arg];
        if (cls[c >> 3] >> (c & 7) & 1) {
            /* copied: expand may move m->frames */
            int32_t pos = fr->pos + 1, parent = fr->parent;
            if (expand(m, pos, parent, 0))
                return -2;
        }
    }
    int32_t r = intern_state(m);
    if (r >= -1)
        m->states[s].next[c] = r; /* m->states may have moved: index again */
    return r;
}

grammar_matcher *grammar_matcher_new(const loom_grammar *g, const grammar_vocab *v, char *err,
                                     size_t err_size)
{
    grammar_matcher *m = calloc(1, sizeof *m);
    if (!m || !(m->scratch = malloc(MAX_STACKS * sizeof *m->scratch)) ||
        !(m->walk = malloc(((size_t)v->max_depth + 1) * sizeof *m->walk))) {
        grammar_matcher_free(m);
        snprintf(err, err_size, "out of memory");
        return NULL;
    }
    m->g = g, m->v = v;
    int32_t bottom = intern_frame(m, -1, -1); /* frame 0: the empty stack */
    int rc = bottom == 0 ? 0 : -1;
    for (int a = 0; rc == 0 && a < g->rule_n_alts[g->root]; a++)
        rc = expand(m, g->alt_start[g->rule_first_alt[g->root] + a], -1, 0);
    m->current = rc == 0 ? intern_state(m) : -2;
    if (m->current < 0) {
        snprintf(err, err_size, "%s", m->err[0] ? m->err : "the grammar matches nothing");
        grammar_matcher_free(m);
        return NULL;
    }
    return m;
}

void grammar_matcher_free(grammar_matcher *m)
{
    if (!m)
        return;
    for (int32_t i = 0; i < m->n_states; i++)
        free(m->states[i].next), free(m->states[i].mask);
    free(m->states), free(m->state_hash), free(m->set_frames);
    free(m->frames), free(m->frame_hash), free(m->scratch), free(m->walk);
    free(m);
}

int grammar_may_end(const grammar_matcher *m)
{
    const state *s = &m->states[m->current];
    return s->n > 0 && m->set_frames[s->off] == 0; /* sorted: frame 0 first */
}

int grammar_must_end(const grammar_matcher *m)
{
    const state *s = &m->states[m->current];
    return s->n == 1 && m->set_frames[s->off] == 0;
}

/* the state after token id's bytes from state s: -1 none, -2 on error */
static int32_t after_token(grammar_matcher *m, int32_t s, int32_t id)
{
    const grammar_vocab *v = m->v;
    int64_t a = v->offset[id], z = v->offset[id + 1];
    if (a == z)
        return -1;
    for (int64_t i = a; i < z && s >= 0; i++)
        s = step(m, s, (uint8_t)v->bytes[i]);
    return s;
}

int grammar_allows(grammar_matcher *m, int32_t id)
{
    m->work = 0;
    if (id < 0 || id >= m->v->n_vocab)
        return 0;
    if (m->v->is_stop[id])
        return grammar_may_end(m);
    return after_token(m, m->current, id) >= 0;
}

int grammar_accept(grammar_matcher *m, int32_t id)
{
    m->work = 0;
    if (id < 0 || id >= m->v->n_vocab || m->v->is_stop[id])
        return -1;
    int32_t s = after_token(m, m->current, id);
    if (s < 0)
        return -1;
    m->current = s;
    return 0;
}

const uint32_t *grammar_mask(grammar_matcher *m, char *err, size_t err_size)
{
    const grammar_vocab *v = m->v;
    int32_t cur = m->current;
    m->work = 0;
    if (m->states[cur].mask)
        return m->states[cur].mask;
    if (m->n_masks >= MAX_MASKS) { /* the oldest are as likely as any to come back: drop all */
        for (int32_t i = 0; i < m->n_states; i++)
            free(m->states[i].mask), m->states[i].mask = NULL;
        m->n_masks = 0;
    }
    size_t words = ((size_t)v->n_vocab + 31) / 32;
    uint32_t *mask = calloc(words, sizeof *mask);
    if (!mask) {
        snprintf(err, err_size, "out of memory");
        return NULL;
    }
    m->walk[0] = cur;
    for (int32_t i = 0; i < v->n_nodes;) {
        const trie_node *nd = &v->nodes[i];
        int32_t s = step(m, m->walk[nd->depth - 1], nd->byte);
        if (s == -2) {
            free(mask);
            snprintf(err, err_size, "%s", m->err[0] ? m->err : "out of memory");
            return NULL;
        }
        if (s < 0) {
            i = nd->subtree_end;
            continue;
        }
        m->walk[nd->depth] = s;
        for (int32_t k = 0; k < nd->n_tok; k++) {
            int32_t id = v->sorted[nd->tok_first + k];
            mask[id >> 5] |= 1u << (id & 31);
        }
        i++;
    }
    if (grammar_may_end(m))
        for (int32_t id = 0; id < v->n_vocab; id++)
            if (v->is_stop[id])
                mask[id >> 5] |= 1u << (id & 31);
    m->states[cur].mask = mask;
    m->n_masks++;
    return mask;
}

int grammar_matches(const loom_grammar *g, const char *bytes, size_t n)
{
    static const grammar_vocab none = {.max_depth = 0};
    char err[200];
    grammar_matcher *m = grammar_matcher_new(g, &none, err, sizeof err);
    if (!m)
        return 0;
    int32_t s = m->current;
    for (size_t i = 0; i < n && s >= 0; i++, m->work = 0)
        s = step(m, s, (uint8_t)bytes[i]);
    int ok = s >= 0 && m->states[s].n > 0 && m->set_frames[m->states[s].off] == 0;
    grammar_matcher_free(m);
    return ok;
}

int32_t grammar_sample(grammar_matcher *m, float *logits, float *scratch, int32_t n_vocab,
                       const struct loom_sampler_params *p, const int32_t *toks, int32_t n_toks,
                       uint64_t *rng, char *err, size_t err_size)
{
    if (grammar_must_end(m))
        return -1;
    int truncates = p->temperature > 1e-5f &&
        ((p->top_k > 0 && p->top_k < n_vocab) || p->top_p < 1 || p->min_p > 0);
    if (!truncates) {
        uint64_t tried = *rng;
        memcpy(scratch, logits, (size_t)n_vocab * sizeof *logits);
        int32_t next = loom_sampler_sample(scratch, n_vocab, p, toks, n_toks, &tried);
        if (grammar_allows(m, next)) {
            *rng = tried;
            return next;
        }
    }
    const uint32_t *mask = grammar_mask(m, err, err_size);
    if (!mask)
        return -2;
    int any = 0;
    for (int32_t i = 0; i < n_vocab; i++)
        if (!(mask[i >> 5] >> (i & 31) & 1))
            logits[i] = -INFINITY;
        else
            any |= logits[i] > -INFINITY;
    if (!any) {
        snprintf(err, err_size, "the grammar allows no token of this vocabulary here");
        return -2;
    }
    return loom_sampler_sample(logits, n_vocab, p, toks, n_toks, rng);
}
