/*
 * core/tokenizer.c - see tokenizer.h: a tokenizer set up from GGUF, the merge engine, encoding
 * (special tokens, then each run of text by its kind) and decoding. The kinds:
 *
 * SentencePiece BPE ("llama" in GGUF): spaces become U+2581 and the text gets a leading one
 * (the "dummy prefix"); the text starts as one symbol per UTF-8 character, and the adjacent
 * pair whose concatenation is a vocabulary entry with the highest score is merged, leftmost
 * first on ties, until no pair is in the vocabulary. A symbol left that is not an entry is
 * spelled with byte tokens <0xXX> ("byte fallback").
 *
 * SentencePiece unigram ("t5" in GGUF, as llama.cpp names it; ChatGLM-6B's ice_text.model):
 * the same escaping, then the segmentation with the highest total score (Viterbi over the
 * pieces); a character no piece covers is an unknown, spelled with byte tokens. Normalisation
 * is NFKC (utf8proc, standing in for the model's precompiled nmt_nfkc map) with whitespace
 * runs collapsed and the ends trimmed, when the file asks for it (tokenizer.loom.* keys).
 * ChatGLM-6B's tokenizer also rewrites newlines, tabs and runs of 2..80 spaces into its
 * <n>, <|tab|> and <|blank_N|> tokens before SentencePiece, and back when decoding.
 *
 * Byte-level BPE ("gpt2" in GGUF: GPT-2, Qwen2, Llama-3): the text (NFC-normalised for Qwen2)
 * is split by the model's pre-tokenizer regex (PCRE2, Unicode classes); each piece's bytes are
 * spelled with GPT-2's byte-to-character map, and the adjacent pair with the lowest merge rank
 * is merged until no listed merge applies.
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

int32_t tok_lookup_hashed(const loom_tokenizer *t, const char *s, size_t n, uint32_t hash)
{
    for (uint32_t i = hash & t->table_mask;; i = (i + 1) & t->table_mask) {
        int32_t id = t->table[i];
        if (id < 0)
            return -1;
        if (t->vocab[id].len == n && memcmp(t->vocab[id].text, s, n) == 0)
            return id;
    }
}

int32_t tok_lookup(const loom_tokenizer *t, const char *s, size_t n)
{
    return tok_lookup_hashed(t, s, n, hash_bytes(s, n));
}

void loom_tokenizer_free(loom_tokenizer *t)
{
    if (!t)
        return;
    free(t->merge_arena);
    free(t->merge_text);
    free(t->merge_len);
    free(t->merge_table);
    pcre2_code_free(t->re);
    free(t->vocab);
    free(t->arena);
    free(t->table);
    free(t->specials);
    free(t->text_specials);
    free(t->prefix_bits);
    free(t->charsmap_units);
    free(t->charsmap_strings);
    free(t);
}

int64_t tok_get_int(const loom_gguf *g, const char *key, int64_t fallback)
{
    int64_t v;
    return loom_gguf_get_i64(g, key, &v) == 0 ? v : fallback;
}

int tok_get_flag(const loom_gguf *g, const char *key, int fallback)
{
    int b;
    return loom_gguf_get_bool(g, key, &b) == 0 ? b : fallback;
}

static int cmp_special_len(const void *a, const void *b, void *ctx)
{
    const loom_tokenizer *t = ctx;
    return (int)t->vocab[*(const int32_t *)b].len - (int)t->vocab[*(const int32_t *)a].len;
}

/* tokenizer.loom.text_specials: which special tokens a user's text may name, as the family's
 * reference tokenizer parses them (ChatGLM3: its four role tokens; ChatGLM-6B: none). Kept
 * in the specials' longest-first order. Absent: every control and user-defined token. */
static int text_specials_load(loom_tokenizer *t, const loom_gguf *g)
{
    const loom_gguf_kv *kv = loom_gguf_find(g, "tokenizer.loom.text_specials");
    if (!kv)
        return 0;
    unsigned char *named = calloc((size_t)t->n_vocab, 1);
    if (!named ||
        !(t->text_specials = malloc(((size_t)t->n_specials + 1) * sizeof *t->text_specials))) {
        free(named);
        return -1;
    }
    for (uint64_t i = 0; i < kv->count; i++) {
        double v;
        if (loom_gguf_array_f64(g, kv, i, &v) == 0 && v >= 0 && v < t->n_vocab)
            named[(int32_t)v] = 1;
    }
    for (int s = 0; s < t->n_specials; s++)
        if (named[t->specials[s]])
            t->text_specials[t->n_text_specials++] = t->specials[s];
    free(named);
    return 0;
}

loom_tokenizer *loom_tokenizer_from_gguf(const loom_gguf *g, char *err, size_t err_size)
{
    const char *model;
    uint64_t model_len;
    if (loom_gguf_get_str(g, "tokenizer.ggml.model", &model, &model_len) != 0) {
        snprintf(err, err_size, "the file has no tokenizer (no tokenizer.ggml.model key)");
        return NULL;
    }
    int bpe = model_len == 4 && memcmp(model, "gpt2", 4) == 0;
    int unigram = model_len == 2 && memcmp(model, "t5", 2) == 0;
    if (!bpe && !unigram && (model_len != 5 || memcmp(model, "llama", 5) != 0)) {
        snprintf(err, err_size,
                 "tokenizer model '%.*s' is not supported yet (loom runs: llama, "
                 "t5, gpt2)",
                 (int)(model_len < 32 ? model_len : 32), model);
        return NULL;
    }
    const loom_gguf_kv *tokens = loom_gguf_find(g, "tokenizer.ggml.tokens");
    const loom_gguf_kv *scores = loom_gguf_find(g, "tokenizer.ggml.scores");
    const loom_gguf_kv *types = loom_gguf_find(g, "tokenizer.ggml.token_type");
    if (!tokens || tokens->type != LOOM_GGUF_ARRAY || tokens->array_type != LOOM_GGUF_STRING ||
        tokens->count == 0 || tokens->count > (1u << 24)) {
        snprintf(err, err_size, "tokenizer.ggml.tokens is missing or not a list of strings");
        return NULL;
    }
    if ((scores && scores->count != tokens->count) || (types && types->count != tokens->count)) {
        snprintf(err, err_size, "tokenizer.ggml.scores/token_type do not have one entry per token");
        return NULL;
    }
    loom_tokenizer *t = calloc(1, sizeof *t);
    if (!t)
        goto oom;
    snprintf(t->model, sizeof t->model, "%s", bpe ? "gpt2" : unigram ? "t5" : "llama");
    t->bpe = bpe;
    t->unigram = unigram;
    t->n_vocab = (int32_t)tokens->count;
    uint64_t total = 0;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        const char *s;
        uint64_t len;
        loom_gguf_array_str(g, tokens, (uint64_t)i, &s, &len);
        total += len + 1;
    }
    t->vocab = calloc((size_t)t->n_vocab, sizeof *t->vocab);
    t->arena = malloc(total);
    uint32_t cap = 1;
    while (cap < (uint32_t)t->n_vocab * 2)
        cap <<= 1;
    t->table = malloc(cap * sizeof *t->table);
    if (!t->vocab || !t->arena || !t->table)
        goto oom;
    t->table_mask = cap - 1;
    memset(t->table, 0xff, cap * sizeof *t->table);
    memset(t->byte_ids, 0xff, sizeof t->byte_ids);
    char *p = t->arena;
    int seen_normal = 0;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        const char *s;
        uint64_t len;
        double v;
        loom_gguf_array_str(g, tokens, (uint64_t)i, &s, &len);
        memcpy(p, s, len);
        p[len] = '\0';
        vocab_entry *e = &t->vocab[i];
        e->text = p;
        e->len = (uint32_t)len;
        p += len + 1;
        e->score = scores && loom_gguf_array_f64(g, scores, (uint64_t)i, &v) == 0 ? (float)v : 0.0f;
        if (!isfinite(e->score)) { /* the merge order and Viterbi's sums need real numbers */
            snprintf(err, err_size,
                     "tokenizer.ggml.scores[%d] (token '%.40s') is not a finite "
                     "number",
                     i, e->text);
            loom_tokenizer_free(t);
            return NULL;
        }
        /* a type outside GGUF's 1..6 (or not a number at all) is a normal token */
        e->type = types && loom_gguf_array_f64(g, types, (uint64_t)i, &v) == 0 && v >= 1 && v <= 6
            ? (int)v
            : TOK_NORMAL;
        if (tok_lookup(t, e->text, e->len) < 0) { /* first entry of a text wins */
            uint32_t h = hash_bytes(e->text, e->len) & t->table_mask;
            while (t->table[h] >= 0)
                h = (h + 1) & t->table_mask;
            t->table[h] = i;
        }
        unsigned byte;
        if (e->type == TOK_BYTE && len == 6 && sscanf(e->text, "<0x%02X>", &byte) == 1)
            t->byte_ids[byte] = i;
        if (e->type == TOK_NORMAL || e->type == TOK_USER)
            t->max_piece = e->len > t->max_piece ? e->len : t->max_piece;
        if (e->type == TOK_NORMAL) {
            t->min_score = !seen_normal || e->score < t->min_score ? e->score : t->min_score;
            /* sentencepiece starts its maximum at FLT_MIN, the smallest positive float, so
             * with the usual negative scores the "maximum" stays that (and a user-defined
             * piece's bonus is about -0.1) */
            t->max_score = !seen_normal ? FLT_MIN : t->max_score;
            t->max_score = e->score > t->max_score ? e->score : t->max_score;
            seen_normal = 1;
        }
    }
    t->bos = (int32_t)tok_get_int(g, "tokenizer.ggml.bos_token_id", -1);
    t->eos = (int32_t)tok_get_int(g, "tokenizer.ggml.eos_token_id", -1);
    t->unk = (int32_t)tok_get_int(g, "tokenizer.ggml.unknown_token_id", 0);
    if (t->bos >= t->n_vocab)
        t->bos = -1;
    if (t->eos >= t->n_vocab)
        t->eos = -1;
    if (t->unk < 0 || t->unk >= t->n_vocab)
        t->unk = 0;
    t->add_bos = tok_get_flag(g, "tokenizer.ggml.add_bos_token", tok_default_add_bos(g, bpe)) &&
        t->bos >= 0;
    t->add_space_prefix = tok_get_flag(g, "tokenizer.ggml.add_space_prefix", !bpe);
    /* Hugging Face's SentencePiece (slow) tokenizer strips the whitespace around special tokens
     * unless they are declared with lstrip/rstrip false, as tokenizer.json-era configs do;
     * llama.cpp never strips. loom's converter records which (tokenizer.loom.strip_special);
     * a file without the key is taken as the classic SentencePiece behaviour. */
    t->strip_special = !bpe && tok_get_flag(g, "tokenizer.loom.strip_special", 1);
    const loom_gguf_kv *stops = loom_gguf_find(g, "tokenizer.loom.stop_token_ids");
    for (uint64_t i = 0; stops && i < stops->count && i < 16; i++) {
        double v;
        if (loom_gguf_array_f64(g, stops, i, &v) == 0 && v >= 0 && v < t->n_vocab)
            t->stops[t->n_stops++] = (int32_t)v;
    }
    const loom_gguf_kv *prefix = loom_gguf_find(g, "tokenizer.loom.prefix_tokens");
    for (uint64_t i = 0; prefix && i < prefix->count && i < 4; i++) {
        double v;
        if (loom_gguf_array_f64(g, prefix, i, &v) == 0 && v >= 0 && v < t->n_vocab)
            t->prefix[t->n_prefix++] = (int32_t)v;
    }
    const char *pre;
    uint64_t pre_len;
    if (!t->n_prefix && loom_gguf_get_str(g, "tokenizer.ggml.pre", &pre, &pre_len) == 0 &&
        tok_pre_is_glm(pre, pre_len)) {
        /* a GLM-4 file from another converter: its prompts start [gMASK] <sop> all the same */
        int32_t gmask = tok_lookup(t, "[gMASK]", 7), sop = tok_lookup(t, "<sop>", 5);
        if (gmask >= 0 && sop >= 0)
            t->prefix[0] = gmask, t->prefix[1] = sop, t->n_prefix = 2;
    }
    const loom_gguf_kv *suffix = loom_gguf_find(g, "tokenizer.loom.suffix_tokens");
    for (uint64_t i = 0; suffix && i < suffix->count && i < 4; i++) {
        double v;
        if (loom_gguf_array_f64(g, suffix, i, &v) == 0 && v >= 0 && v < t->n_vocab)
            t->suffix[t->n_suffix++] = (int32_t)v;
    }
    const char *norm;
    uint64_t norm_len;
    t->nfkc = loom_gguf_get_str(g, "tokenizer.loom.normalizer", &norm, &norm_len) == 0 &&
        norm_len == 4 && memcmp(norm, "nfkc", 4) == 0;
    if (tok_charsmap_load(t, g, err, err_size) != 0) {
        loom_tokenizer_free(t);
        return NULL;
    }
    t->collapse_ws = tok_get_flag(g, "tokenizer.loom.remove_extra_whitespaces", 0);
    t->escape_ws = tok_get_flag(g, "tokenizer.loom.escape_whitespaces", 1);
    t->glm_text = tok_get_flag(g, "tokenizer.loom.glm_text", 0);
    if (bpe && tok_bpe_setup(t, g, err, err_size) != 0) {
        loom_tokenizer_free(t);
        return NULL;
    }
    t->specials = malloc((size_t)t->n_vocab * sizeof *t->specials);
    if (!t->specials)
        goto oom;
    for (int32_t i = 0; i < t->n_vocab; i++)
        if ((t->vocab[i].type == TOK_CONTROL || t->vocab[i].type == TOK_USER) && t->vocab[i].len) {
            t->specials[t->n_specials++] = i;
            t->special_first[(unsigned char)t->vocab[i].text[0]] = 1;
        }
    if (unigram) {
        t->prefix_mask = (1u << 24) - 1; /* 2 MiB: a few percent of false hits for 10^6 prefixes */
        if (!(t->prefix_bits = calloc(((size_t)t->prefix_mask + 1) / 64, sizeof *t->prefix_bits)))
            goto oom;
        for (int32_t i = 0; i < t->n_vocab; i++) {
            uint32_t h = HASH_SEED;
            for (uint32_t l = 0; l < t->vocab[i].len; l++) {
                h = hash_more(h, t->vocab[i].text + l, 1);
                t->prefix_bits[(h & t->prefix_mask) / 64] |= 1ull << (h & 63);
            }
        }
    }
    qsort_r(t->specials, (size_t)t->n_specials, sizeof *t->specials, cmp_special_len, t);
    if (text_specials_load(t, g) != 0)
        goto oom;
    return t;
oom:
    loom_tokenizer_free(t);
    snprintf(err, err_size, "out of memory building the tokenizer");
    return NULL;
}

/* ---- The merge engine both BPE kinds run ------------------------------------------------ */

typedef struct bigram {
    float score;
    int left;
    uint32_t size; /* the merged length (< MAX_FRAGMENT), to detect a stale entry */
} bigram;

/* a 4-ary heap: half the levels of a binary one, and a node's children share a cache line or
 * two, which is what a long pre-token's million pairs cost */
#define HEAP_ARITY 4

typedef struct heap {
    bigram *items;
    size_t n, cap;
} heap;

/* higher score first; on equal scores the leftmost pair */
static int before(const bigram *a, const bigram *b)
{
    return a->score > b->score || (a->score == b->score && a->left < b->left);
}

static int heap_push(heap *h, bigram b)
{
    if (h->n == h->cap) {
        size_t cap = h->cap ? h->cap * 2 : 64;
        bigram *items = realloc(h->items, cap * sizeof *items);
        if (!items)
            return -1;
        h->items = items;
        h->cap = cap;
    }
    size_t i = h->n++;
    h->items[i] = b;
    while (i > 0 && before(&h->items[i], &h->items[(i - 1) / HEAP_ARITY])) {
        bigram tmp = h->items[i];
        h->items[i] = h->items[(i - 1) / HEAP_ARITY];
        h->items[(i - 1) / HEAP_ARITY] = tmp;
        i = (i - 1) / HEAP_ARITY;
    }
    return 0;
}

static void heap_sift_down(heap *h, size_t i)
{
    for (;;) {
        size_t first = HEAP_ARITY * i + 1, m = i;
        for (size_t c = first; c < first + HEAP_ARITY && c < h->n; c++)
            if (before(&h->items[c], &h->items[m]))
                m = c;
        if (m == i)
            break;
        bigram tmp = h->items[i];
        h->items[i] = h->items[m];
        h->items[m] = tmp;
        i = m;
    }
}

static bigram heap_pop(heap *h)
{
    bigram top = h->items[0];
    h->items[0] = h->items[--h->n];
    heap_sift_down(h, 0);
    return top;
}

size_t tok_utf8_len(unsigned char c)
{
    return c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
}


void tok_emit(out_ids *o, int32_t id)
{
    if (o->n < o->cap)
        o->ids[o->n] = id;
    o->n++;
}

/* Text no piece covers, spelled with <0xXX> byte tokens (unknown when the vocabulary has none). */
void tok_emit_bytes(const loom_tokenizer *t, const char *p, size_t n, out_ids *o)
{
    for (size_t j = 0; j < n; j++) {
        int32_t bid = t->byte_ids[(unsigned char)p[j]];
        tok_emit(o, bid >= 0 ? bid : t->unk);
    }
}


static int try_pair(const pair_scorer *ps, const symbol *sym, int left, heap *h)
{
    if (left < 0 || sym[left].next < 0)
        return 0;
    const symbol *a = &sym[left], *b = &sym[a->next];
    float score;
    if (ps->score(ps, a, b, &score) != 0)
        return 0;
    return heap_push(h, (bigram){score, left, a->n + b->n});
}

/* Merges the list of count symbols (prev/next links, contiguous bytes) pair by pair, the
 * best-scoring adjacent pair first and the leftmost among equals, until no pair merges. Each
 * merge queues only the two pairs it creates, so the whole is O(n log n) in the symbols;
 * queued pairs a merge made stale are recognised when they come out (a symbol only grows, so
 * a pair whose merged length changed is no longer there). Returns 0, or -1 without memory. */
int tok_merge_symbols(const pair_scorer *ps, symbol *sym, int count)
{
    heap h = {0};
    if (count > 1 && !(h.items = malloc((size_t)count * sizeof *h.items)))
        return -1;
    h.cap = count > 1 ? (size_t)count : 0;
    /* the first pairs go in unordered and are made a heap at once: O(n), not O(n log n) */
    for (int i = 0; i + 1 < count; i++) {
        float score;
        if (ps->score(ps, &sym[i], &sym[i + 1], &score) == 0)
            h.items[h.n++] = (bigram){score, i, sym[i].n + sym[i + 1].n};
    }
    for (size_t i = h.n / HEAP_ARITY + 1; i-- > 0;)
        heap_sift_down(&h, i);
    int rc = 0;
    while (h.n > 0 && rc == 0) {
        bigram b = heap_pop(&h);
        symbol *a = &sym[b.left];
        if (a->n == 0 || a->next < 0 || a->n + sym[a->next].n != b.size)
            continue; /* stale: one side changed since it was queued */
        symbol *r = &sym[a->next];
        a->n += r->n;
        r->n = 0;
        a->next = r->next;
        if (r->next >= 0)
            sym[r->next].prev = b.left;
        rc = try_pair(ps, sym, a->prev, &h);
        if (rc == 0)
            rc = try_pair(ps, sym, b.left, &h);
    }
    free(h.items);
    return rc;
}

static int is_space(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

static int64_t encode_valid(const loom_tokenizer *t, const char *text, size_t len, int add_special,
                            int parse_special, const size_t *plain, int n_plain, int32_t *ids,
                            int64_t cap);

int64_t loom_tokenizer_encode(const loom_tokenizer *t, const char *text, size_t len,
                              int add_special, int parse_special, int32_t *ids, int64_t cap)
{
    return loom_tokenizer_encode_spans(t, text, len, add_special, parse_special, NULL, 0, ids, cap);
}

int64_t loom_tokenizer_encode_continuation(const loom_tokenizer *t, const char *text, size_t len,
                                           int parse_special, int32_t *ids, int64_t cap)
{
    loom_tokenizer mid = *t; /* (encoding reads the tokenizer, never writes it) */
    mid.add_space_prefix = 0;
    return loom_tokenizer_encode(&mid, text, len, 0, parse_special, ids, cap);
}

int64_t loom_tokenizer_encode_spans(const loom_tokenizer *t, const char *text, size_t len,
                                    int add_special, int parse_special, const size_t *plain,
                                    int n_plain, int32_t *ids, int64_t cap)
{
    for (int k = 0; k < n_plain; k++)
        if (plain[2 * k] > plain[2 * k + 1] || plain[2 * k + 1] > len ||
            (k > 0 && plain[2 * k] < plain[2 * k - 1]))
            return -1; /* spans out of order or outside the text */
    /* bytes that are not UTF-8 become U+FFFD first, as the reference tokenizers see them (they
     * take decoded strings); from here on the text is valid, and PCRE2 need not check it.
     * Each piece between span bounds is replaced on its own, so the spans move with it. */
    char *valid = NULL;
    size_t *moved = NULL;
    if (loom_utf8_valid_prefix(text, len) < len) {
        size_t n_bounds = 2 * (size_t)n_plain, at = 0, k = 0;
        if (!(valid = malloc(3 * len + 1)) ||
            (n_bounds && !(moved = malloc(n_bounds * sizeof *moved)))) {
            free(valid);
            return -1;
        }
        for (size_t b = 0; b <= n_bounds; b++) {
            size_t end = b < n_bounds ? plain[b] : len, n;
            char *piece = loom_utf8_sanitize(text + at, end - at, &n);
            if (!piece) {
                free(valid), free(moved);
                return -1;
            }
            memcpy(valid + k, piece, n);
            free(piece);
            k += n, at = end;
            if (b < n_bounds)
                moved[b] = k;
        }
        valid[k] = '\0';
        text = valid, len = k, plain = moved ? moved : plain;
    }
    int64_t n = encode_valid(t, text, len, add_special, parse_special, plain, n_plain, ids, cap);
    free(valid);
    free(moved);
    return n;
}

static int64_t encode_valid(const loom_tokenizer *t, const char *text, size_t len, int add_special,
                            int parse_special, const size_t *plain, int n_plain, int32_t *ids,
                            int64_t cap)
{
    out_ids o = {ids, 0, cap};
    /* a text that already starts with what the family prepends (a rendered chat prompt) does
     * not get it twice */
    /* parse_special 1: the specials the family's reference parses in a user's text; 2: all
     * (a chat template's own text) */
    const int32_t *specials = t->specials;
    int n_specials = parse_special ? t->n_specials : 0;
    if (parse_special == 1 && t->text_specials)
        specials = t->text_specials, n_specials = t->n_text_specials;
    int32_t first = t->n_prefix ? t->prefix[0] : t->add_bos ? t->bos : -1;
    const vocab_entry *lead = NULL;
    for (int s = 0; first >= 0 && s < n_specials && !lead; s++)
        if (specials[s] == first)
            lead = &t->vocab[first];
    int starts_with_it = lead && lead->len && lead->len <= len &&
        !(n_plain > 0 && plain[0] < lead->len) && memcmp(text, lead->text, lead->len) == 0;
    if (add_special && !starts_with_it) {
        for (int i = 0; i < t->n_prefix; i++)
            tok_emit(&o, t->prefix[i]);
        if (!t->n_prefix && t->add_bos)
            tok_emit(&o, t->bos);
    }
    int prev_special = 1; /* the dummy prefix goes at the start and after each special token */
    size_t start = 0;
    int span = 0; /* the first plain span that ends after i */
    for (size_t i = 0; i <= len;) {
        int32_t found = -1;
        while (span < n_plain && plain[2 * span + 1] <= i)
            span++;
        /* a special token may not start inside a plain span, nor run into the next one */
        size_t room = span < n_plain ? (plain[2 * span] > i ? plain[2 * span] - i : 0) : len - i;
        if (n_specials && i < len && room && t->special_first[(unsigned char)text[i]])
            for (int s = 0; s < n_specials && found < 0; s++) {
                const vocab_entry *e = &t->vocab[specials[s]];
                if (e->len <= room && memcmp(text + i, e->text, e->len) == 0)
                    found = specials[s];
            }
        if (found < 0 && i < len) {
            i++;
            continue;
        }
        /* like the reference (Hugging Face's Llama tokenizer), whitespace next to a special
         * token belongs to neither side: "girl. </s>" ends in ".", then </s> */
        size_t end = i;
        if (parse_special && t->strip_special) {
            while (start < end && prev_special && start > 0 && is_space(text[start]))
                start++;
            while (end > start && found >= 0 && is_space(text[end - 1]))
                end--;
        }
        if (end > start) {
            int prefix = t->add_space_prefix && prev_special, rc;
            if (t->bpe)
                rc = tok_bpe_fragment(t, text + start, end - start, &o);
            else if (t->glm_text)
                rc = tok_glm_text(t, text + start, end - start, prefix, &o);
            else if (t->unigram || t->nfkc || t->collapse_ws || t->charsmap_units)
                rc = tok_spm_text(t, text + start, end - start, prefix, start == 0, found < 0, &o);
            else
                rc = tok_spm_fragment(t, text + start, end - start, prefix, &o);
            if (rc)
                return -1;
            prev_special = 0;
        }
        if (found < 0)
            break;
        tok_emit(&o, found);
        prev_special = 1;
        i += t->vocab[found].len;
        start = i;
    }
    if (add_special)
        for (int i = 0; i < t->n_suffix; i++)
            tok_emit(&o, t->suffix[i]);
    return o.n;
}

static int piece(const loom_tokenizer *t, int32_t prev, int32_t id, int show_control, char *out,
                 int cap)
{
    if (id < 0 || id >= t->n_vocab)
        return -1;
    const vocab_entry *e = &t->vocab[id];
    char buf[512];
    int n = 0;
    unsigned blanks;
    if (e->type == TOK_CONTROL && !show_control) {
        n = 0;
    } else if (t->glm_text && e->type == TOK_USER &&
               (!strcmp(e->text, "<n>") || !strcmp(e->text, "<|tab|>"))) {
        buf[n++] = e->text[1] == 'n' ? '\n' : '\t';
    } else if (t->glm_text && e->type == TOK_USER &&
               sscanf(e->text, "<|blank_%u|>", &blanks) == 1 && blanks <= 80) {
        memset(buf, ' ', blanks);
        n = (int)blanks;
    } else if (t->bpe) {
        for (uint32_t i = 0; i < e->len && n < (int)sizeof buf;) {
            utf8proc_int32_t cp;
            utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)e->text + i,
                                                  (utf8proc_ssize_t)(e->len - i), &cp);
            if (k <= 0) {
                buf[n++] = e->text[i++];
                continue;
            }
            if (cp >= 0 && cp < 324 && t->char_byte[cp] >= 0) {
                buf[n++] = (char)t->char_byte[cp];
            } else { /* an added token's own text */
                for (utf8proc_ssize_t j = 0; j < k && n < (int)sizeof buf; j++)
                    buf[n++] = e->text[i + (uint32_t)j];
            }
            i += (uint32_t)k;
        }
    } else if (e->type == TOK_BYTE) {
        unsigned byte;
        if (sscanf(e->text, "<0x%02X>", &byte) == 1)
            buf[n++] = (char)byte;
    } else {
        for (uint32_t i = 0; i < e->len && n < (int)sizeof buf; i++) {
            if (i + 2 < e->len && memcmp(e->text + i, "\xe2\x96\x81", 3) == 0) {
                buf[n++] = ' ';
                i += 2;
            } else {
                buf[n++] = e->text[i];
            }
        }
        /* the dummy prefix is not part of the text: drop it from the first piece */
        if (t->add_space_prefix && (prev < 0 || prev == t->bos) && n > 0 && buf[0] == ' ')
            memmove(buf, buf + 1, (size_t)--n);
    }
    memcpy(out, buf, (size_t)(n < cap ? n : cap));
    return n;
}

int loom_tokenizer_piece(const loom_tokenizer *t, int32_t prev, int32_t id, char *out, int cap)
{
    return piece(t, prev, id, 0, out, cap);
}

int loom_tokenizer_piece_control(const loom_tokenizer *t, int32_t prev, int32_t id, char *out,
                                 int cap)
{
    return piece(t, prev, id, 1, out, cap);
}

size_t loom_tokenizer_max_token_bytes(const loom_tokenizer *t)
{
    size_t longest = 1;
    char buf[512];
    for (int32_t id = 0; id < t->n_vocab; id++) {
        int n = loom_tokenizer_piece(t, id, id, buf, sizeof buf); /* not after BOS: no trim */
        longest = n > 0 && (size_t)n > longest ? (size_t)n : longest;
    }
    return longest;
}

int32_t loom_tokenizer_vocab_size(const loom_tokenizer *t)
{
    return t->n_vocab;
}

int loom_tokenizer_is_unused(const loom_tokenizer *t, int32_t id)
{
    return id < 0 || id >= t->n_vocab || t->vocab[id].type == TOK_UNUSED;
}

int32_t loom_tokenizer_bos(const loom_tokenizer *t)
{
    return t->bos;
}

int loom_tokenizer_adds_bos(const loom_tokenizer *t)
{
    return t->add_bos && t->bos >= 0;
}

int32_t loom_tokenizer_eos(const loom_tokenizer *t)
{
    return t->eos;
}

int loom_tokenizer_is_stop(const loom_tokenizer *t, int32_t id)
{
    if (id == t->eos)
        return 1;
    for (int i = 0; i < t->n_stops; i++)
        if (t->stops[i] == id)
            return 1;
    return 0;
}

const char *loom_tokenizer_model(const loom_tokenizer *t)
{
    return t->model;
}
