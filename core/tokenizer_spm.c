/*
 * core/tokenizer_spm.c - SentencePiece (BPE and unigram), its precompiled normaliser, and
 * ChatGLM-6B's rewriting of newlines, tabs and blank runs (tokenizer_internal.h).
 */
#define _GNU_SOURCE
#include "tokenizer_internal.h"

#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

/* tokenizer.ggml.precompiled_charsmap: a little-endian uint32 with the trie's size in bytes,
 * the trie (uint32 units), then the replacement strings. Checked here, so that lookups can
 * trust it; a map that does not hold together is an error, not a silent identity. */
int tok_charsmap_load(loom_tokenizer *t, const loom_gguf *g, char *err, size_t err_size)
{
    const loom_gguf_kv *kv = loom_gguf_find(g, "tokenizer.ggml.precompiled_charsmap");
    if (!kv)
        return 0;
    if (kv->type != LOOM_GGUF_ARRAY ||
        (kv->array_type != LOOM_GGUF_UINT8 && kv->array_type != LOOM_GGUF_INT8) || kv->count < 4) {
        snprintf(err, err_size, "tokenizer.ggml.precompiled_charsmap is not a byte array");
        return -1;
    }
    const unsigned char *b = g->map + kv->offset;
    uint32_t trie = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 |
        (uint32_t)b[3] << 24;
    if (trie % 4 || trie == 0 || trie > kv->count - 4) {
        snprintf(err, err_size,
                 "tokenizer.ggml.precompiled_charsmap: a trie of %u bytes does not "
                 "fit its %llu bytes",
                 trie, (unsigned long long)kv->count);
        return -1;
    }
    t->charsmap_n_units = trie / 4;
    t->charsmap_n_strings = (size_t)kv->count - 4 - trie;
    t->charsmap_units = malloc(trie);
    t->charsmap_strings = malloc(t->charsmap_n_strings + 1);
    if (!t->charsmap_units || !t->charsmap_strings) {
        snprintf(err, err_size, "out of memory for the normaliser");
        return -1;
    }
    for (size_t i = 0; i < t->charsmap_n_units; i++) {
        const unsigned char *u = b + 4 + 4 * i;
        t->charsmap_units[i] = (uint32_t)u[0] | (uint32_t)u[1] << 8 | (uint32_t)u[2] << 16 |
            (uint32_t)u[3] << 24;
    }
    memcpy(t->charsmap_strings, b + 4 + trie, t->charsmap_n_strings);
    t->charsmap_strings[t->charsmap_n_strings] = '\0'; /* the last replacement ends */
    return 0;
}

/* The longest prefix of s (n bytes) the normaliser maps, and its replacement in *repl; 0 when
 * none. A unit holds: bit 8 has_leaf, bits 0-7 (with bit 31) the label, bits 10-31 an offset
 * shifted left by 8 when bit 9 is set; a leaf's unit holds its value in bits 0-30. */
static size_t charsmap_match(const loom_tokenizer *t, const unsigned char *s, size_t n,
                             const char **repl)
{
    const uint32_t *u = t->charsmap_units;
    size_t nu = t->charsmap_n_units, best = 0;
#define UNIT_OFFSET(x) (((x) >> 10) << (((x) & (1u << 9)) >> 6))
    uint32_t id = UNIT_OFFSET(u[0]);
    for (size_t i = 0; i < n; i++) {
        id ^= s[i];
        if (id >= nu || (u[id] & (0x80000000u | 0xffu)) != s[i])
            break;
        uint32_t unit = u[id];
        id ^= UNIT_OFFSET(unit);
        if (id >= nu)
            break;
        if ((unit >> 8) & 1) { /* a key ends here: its value is in the unit at the new id */
            uint32_t value = u[id] & 0x7fffffffu;
            if (value < t->charsmap_n_strings)
                best = i + 1, *repl = t->charsmap_strings + value;
        }
    }
#undef UNIT_OFFSET
    return best;
}

/* SentencePiece BPE: a pair merges when its concatenation is a piece, by the piece's score */
static int spm_pair_score(const pair_scorer *ps, const symbol *a, const symbol *b, float *score)
{
    int32_t id = tok_lookup(ps->t, ps->text + a->start, a->n + b->n);
    /* as in sentencepiece, merges make only ordinary and user-defined pieces: ChatGLM3's
     * control token "sop" is not what "s" + "op" becomes */
    if (id < 0 || (ps->t->vocab[id].type != TOK_NORMAL && ps->t->vocab[id].type != TOK_USER))
        return -1;
    *score = ps->t->vocab[id].score;
    return 0;
}

/* SentencePiece's escaping: a leading U+2581 when asked, and every space as U+2581 (a model
 * that does not escape whitespace keeps spaces, and its dummy prefix is one). Returns the
 * malloc'd text (NUL-terminated; NULL when out of memory) and its length in *n. */
static char *escape_spaces(const loom_tokenizer *t, const char *raw, size_t len, int prefix,
                           size_t *n)
{
    size_t spaces = 0;
    for (size_t i = 0; i < len; i++)
        spaces += raw[i] == ' ';
    if (!t->escape_ws) {
        *n = len + (prefix ? 1 : 0);
        char *text = malloc(*n + 1);
        if (text) {
            text[0] = ' ';
            memcpy(text + (prefix ? 1 : 0), raw, len);
            text[*n] = '\0';
        }
        return text;
    }
    *n = len + 2 * spaces + (prefix ? 3 : 0);
    char *text = malloc(*n + 1);
    if (!text)
        return NULL;
    size_t k = 0;
    if (prefix)
        memcpy(text, "\xe2\x96\x81", 3), k = 3;
    for (size_t i = 0; i < len; i++) {
        if (raw[i] == ' ')
            memcpy(text + k, "\xe2\x96\x81", 3), k += 3;
        else
            text[k++] = raw[i];
    }
    text[k] = '\0';
    return text;
}

/* Encodes one run of raw text (no specials inside). */
int tok_spm_fragment(const loom_tokenizer *t, const char *raw, size_t len, int prefix, out_ids *o)
{
    if (len > MAX_FRAGMENT)
        return -1;
    size_t n;
    char *text = escape_spaces(t, raw, len, prefix, &n);
    symbol *sym = malloc((n + 1) * sizeof *sym);
    if (!text || !sym) {
        free(text), free(sym);
        return -1;
    }
    int count = 0;
    for (size_t i = 0; i < n;) {
        size_t cl = tok_utf8_len((unsigned char)text[i]);
        if (cl > n - i)
            cl = n - i;
        sym[count] = (symbol){count - 1, -1, (uint32_t)i, (uint32_t)cl};
        if (count > 0)
            sym[count - 1].next = count;
        count++;
        i += cl;
    }
    pair_scorer ps = {spm_pair_score, t, text, NULL};
    int rc = tok_merge_symbols(&ps, sym, count);
    for (int i = 0; count > 0 && i >= 0 && rc == 0; i = sym[i].next) {
        int32_t id = tok_lookup(t, text + sym[i].start, sym[i].n);
        if (id >= 0) {
            tok_emit(o, id);
            continue;
        }
        tok_emit_bytes(t, text + sym[i].start, sym[i].n, o);
    }
    free(text);
    free(sym);
    return rc;
}

/* The same for a unigram model: the segmentation with the best total score. */
static int unigram_fragment(const loom_tokenizer *t, const char *raw, size_t len, int prefix,
                            out_ids *o)
{
    size_t n;
    char *text = escape_spaces(t, raw, len, prefix, &n);
    /* Scores add up as sentencepiece's Viterbi adds them, so that equal segmentations (three
     * "NN" and an "N", or an "N" and three "NN") tie or not exactly as there: a piece's
     * candidate is the double sum of its float score and the float best so far, compared
     * with the float kept, which is the candidate rounded; an unknown's sum is float. The
     * earliest start wins a tie. from[e] < 0: e not reached yet. */
    float *best = malloc((n + 1) * sizeof *best);
    int32_t *from = malloc((n + 1) * sizeof *from), *piece = malloc((n + 1) * sizeof *piece);
    if (!text || !best || !from || !piece) {
        free(text), free(best), free(from), free(piece);
        return -1;
    }
    /* user-defined pieces get a bonus that makes them win where they match, as there */
    const float unknown = t->min_score - 10.0f;
    best[0] = 0, from[0] = 0;
    for (size_t i = 1; i <= n; i++)
        from[i] = -1;
    for (size_t i = 0; i < n; i++) {
        if (from[i] < 0)
            continue;
        size_t cl = tok_utf8_len((unsigned char)text[i]);
        if (cl > n - i)
            cl = n - i;
        int covered = 0;
        uint32_t hash = HASH_SEED; /* of text[i, i + l), grown with l */
        for (size_t l = cl, hashed = 0; l <= t->max_piece && i + l <= n;
             l += tok_utf8_len((unsigned char)text[i + l])) {
            hash = hash_more(hash, text + i + hashed, l - hashed);
            hashed = l;
            if (!(t->prefix_bits[(hash & t->prefix_mask) / 64] >> (hash & 63) & 1))
                break; /* no piece starts with text[i, i + l) */
            int32_t id = tok_lookup_hashed(t, text + i, l, hash);
            if (id >= 0 && (t->vocab[id].type == TOK_NORMAL || t->vocab[id].type == TOK_USER)) {
                /* the bonus as sentencepiece computes it: length times the best score in
                 * float, then less 0.1 in double */
                double sc = (t->vocab[id].type == TOK_USER ? (double)((float)l * t->max_score) - 0.1
                                                           : (double)t->vocab[id].score) +
                    best[i];
                if (from[i + l] < 0 || sc > best[i + l])
                    best[i + l] = (float)sc, from[i + l] = (int32_t)i, piece[i + l] = id;
                covered |= l == cl;
            }
            if (i + l >= n)
                break;
        }
        if (!covered && (from[i + cl] < 0 || unknown + best[i] > best[i + cl]))
            best[i + cl] = unknown + best[i], from[i + cl] = (int32_t)i, piece[i + cl] = -1;
    }
    /* walk back, then emit in order */
    int32_t *path = malloc((n + 1) * sizeof *path);
    int rc = path ? 0 : -1;
    int np = 0;
    for (size_t e = n; path && e > 0; e = (size_t)from[e])
        path[np++] = (int32_t)e;
    for (int j = np - 1; rc == 0 && j >= 0; j--) {
        size_t e = (size_t)path[j], s = (size_t)from[e];
        if (piece[e] >= 0) {
            tok_emit(o, piece[e]);
            continue;
        }
        tok_emit_bytes(t, text + s, e - s, o); /* an unknown character: its bytes */
    }
    free(path), free(text), free(best), free(from), free(piece);
    return rc;
}

/* The length of the longest user-defined piece text starts with, or 0. */
static size_t user_piece_at(const loom_tokenizer *t, const char *text, size_t len)
{
    if (!t->special_first[(unsigned char)text[0]])
        return 0;
    for (int s = 0; s < t->n_specials; s++) { /* longest first */
        const vocab_entry *e = &t->vocab[t->specials[s]];
        if (e->type == TOK_USER && e->len <= len && memcmp(text, e->text, e->len) == 0)
            return e->len;
    }
    return 0;
}

typedef struct norm_buf {
    char *s;
    size_t n, cap;
    int prev_space, oom;
} norm_buf;

/* Appends one normalised piece as sentencepiece does: with whitespace collapsing, a piece
 * after one that ended in a space loses its leading spaces. */
static void norm_put(norm_buf *o, const char *p, size_t n, int collapse)
{
    if (collapse && o->prev_space)
        while (n && *p == ' ')
            p++, n--;
    if (!n)
        return;
    if (o->n + n + 1 > o->cap) {
        size_t cap = (o->n + n + 1) * 2;
        char *grown = realloc(o->s, cap);
        if (!grown) {
            o->oom = 1;
            return;
        }
        o->s = grown, o->cap = cap;
    }
    memcpy(o->s + o->n, p, n);
    o->n += n;
    o->prev_space = collapse && p[n - 1] == ' ';
}

/* The file's normaliser over a run of text, as SentencePiece's Normalizer does it: each
 * position's longest match in the character map (or, without one, the character itself;
 * files loom wrote before it carried the map ask for NFKC instead), whitespace collapsed
 * between pieces and trimmed at the ends of the whole text (first/last) when the model says
 * so. *out is malloc'd, or NULL when the text stays as it is. */
static size_t normalise(const loom_tokenizer *t, const char *raw, size_t len, int first, int last,
                        char **out)
{
    *out = NULL;
    if (!t->charsmap_units && !t->nfkc && !t->collapse_ws)
        return len;
    utf8proc_uint8_t *nfkc = NULL;
    if (!t->charsmap_units && t->nfkc) {
        utf8proc_ssize_t n = utf8proc_map((const utf8proc_uint8_t *)raw, (utf8proc_ssize_t)len,
                                          &nfkc,
                                          UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
        if (n >= 0)
            raw = (const char *)nfkc, len = (size_t)n;
        else
            nfkc = NULL;
    }
    norm_buf o = {.prev_space = t->collapse_ws && first};
    for (size_t i = 0; i < len && !o.oom;) {
        const char *repl = NULL;
        size_t used = user_piece_at(t, raw + i, len - i);
        if (used) { /* sentencepiece's user-defined symbols bypass the normaliser */
            norm_put(&o, raw + i, used, t->collapse_ws);
            i += used;
            continue;
        }
        used = t->charsmap_units ? charsmap_match(t, (const unsigned char *)raw + i, len - i, &repl)
                                 : 0;
        if (used) {
            norm_put(&o, repl, strlen(repl), t->collapse_ws);
        } else {
            used = tok_utf8_len((unsigned char)raw[i]);
            used = used > len - i ? len - i : used;
            norm_put(&o, raw + i, used, t->collapse_ws);
        }
        i += used;
    }
    free(nfkc);
    if (o.oom) {
        free(o.s);
        return len; /* no memory: the text as it is, rather than none */
    }
    /* sentencepiece trims the end after escaping, so a literal U+2581 there goes too */
    if (t->collapse_ws && last)
        for (;;) {
            if (o.n > 0 && o.s[o.n - 1] == ' ')
                o.n--;
            else if (t->escape_ws && o.n >= 3 && !memcmp(o.s + o.n - 3, "\xe2\x96\x81", 3))
                o.n -= 3;
            else
                break;
        }
    *out = o.s ? o.s : calloc(1, 1);
    return o.n;
}

/* SentencePiece on one run of text without special tokens: normalised, then BPE or unigram.
 * prefix: give it the dummy prefix; first/last: it starts/ends the whole text. */
int tok_spm_text(const loom_tokenizer *t, const char *raw, size_t len, int prefix, int first,
                 int last, out_ids *o)
{
    char *norm;
    size_t n = normalise(t, raw, len, first, last, &norm);
    const char *text = norm ? norm : raw;
    int rc = 0;
    if (n > 0 || (prefix && !t->collapse_ws))
        rc = t->unigram ? unigram_fragment(t, text, n, prefix, o)
                        : tok_spm_fragment(t, text, n, prefix, o);
    else if (prefix && !last) /* the whole text goes on past this run: it has the prefix */
        rc = t->unigram ? unigram_fragment(t, text, 0, 1, o) : tok_spm_fragment(t, text, 0, 1, o);
    free(norm);
    return rc;
}

/* ChatGLM-6B, as its Hugging Face tokenizer does it: newlines, tabs and runs of 80 down to 2
 * spaces are replaced by the user-defined pieces <n>, <|tab|> and <|blank_N|> (a run over 80
 * is cut into 80s; a single space left over stays a space), then the whole text goes through
 * SentencePiece in one pass, those pieces passing the normaliser untouched and winning where
 * they stand. One pass, not one per stretch between markers: the Viterbi's float sums, and so
 * its choice between equally good segmentations, depend on everything before. */
int tok_glm_text(const loom_tokenizer *t, const char *raw, size_t len, int prefix, out_ids *o)
{
    size_t cap = len * 14 + 1; /* a space may become "<|blank_N|>" at worst... per two */
    char *s = len < SIZE_MAX / 14 ? malloc(cap) : NULL;
    if (!s)
        return -1;
    size_t k = 0;
    for (size_t i = 0; i < len;) {
        size_t run = 0;
        while (i + run < len && raw[i + run] == ' ')
            run++;
        if (run >= 2) {
            size_t left = run;
            while (left >= 2) {
                size_t n = left > 80 ? 80 : left;
                k += (size_t)snprintf(s + k, cap - k, "<|blank_%zu|>", n);
                left -= n;
            }
            if (left)
                s[k++] = ' ';
            i += run;
        } else if (raw[i] == '\n') {
            memcpy(s + k, "<n>", 3), k += 3, i++;
        } else if (raw[i] == '\t') {
            memcpy(s + k, "<|tab|>", 7), k += 7, i++;
        } else {
            s[k++] = raw[i++];
        }
    }
    int rc = tok_spm_text(t, s, k, prefix, 1, 1, o);
    free(s);
    return rc;
}
