/*
 * core/tokenizer_bpe.c - byte-level BPE ("gpt2" in GGUF: GPT-2, Qwen2, Llama-3): its set-up
 * (the pre-tokenizer regex by tokenizer.ggml.pre, the merges, GPT-2's byte-to-character map)
 * and its encoding of a run of text (tokenizer_internal.h).
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

/* ---- Byte-level BPE: setup --------------------------------------------------------------- */

/* Whether text starts with BOS when the file has no tokenizer.ggml.add_bos_token: SentencePiece
 * vocabularies do; byte-level ones do not, but for Llama 3's pre-tokenizer, whose files
 * llama.cpp's converter writes without the key and which llama.cpp then starts with
 * <|begin_of_text|>. */
int tok_default_add_bos(const loom_gguf *g, int bpe)
{
    const char *pre = "";
    uint64_t len = 0;
    loom_gguf_get_str(g, "tokenizer.ggml.pre", &pre, &len);
    static const char *const llama3[] = {"llama-bpe", "llama3", "llama-v3"};
    for (size_t i = 0; bpe && i < sizeof llama3 / sizeof llama3[0]; i++)
        if (len == strlen(llama3[i]) && !memcmp(pre, llama3[i], len))
            return 1;
    return !bpe;
}

int tok_pre_is_glm(const char *pre, uint64_t len)
{
    return (len == 11 && !memcmp(pre, "chatglm-bpe", 11)) || (len == 4 && !memcmp(pre, "glm4", 4));
}

/* Pre-tokenizer patterns, by tokenizer.ggml.pre (the regexes the models were trained with). */
static const struct {
    const char *name, *pattern;
} pretokenizers[] = {
    {"qwen2",
     "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
    {"llama-bpe",
     "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
    /* GLM-4: Llama-3's pattern (both come from tiktoken's cl100k); llama.cpp's converter
     * names it chatglm-bpe for glm-4-9b-chat and glm4 for GLM-4-0414 and GLM-4.5 */
    {"chatglm-bpe",
     "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
    {"glm4",
     "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
    {"gpt2", "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"},
};

static int32_t merge_lookup(const loom_tokenizer *t, const char *s, size_t n)
{
    for (uint32_t i = hash_bytes(s, n) & t->merge_mask;; i = (i + 1) & t->merge_mask) {
        int32_t r = t->merge_table[i];
        if (r < 0)
            return -1;
        if (t->merge_len[r] == n && memcmp(t->merge_text[r], s, n) == 0)
            return r;
    }
}

/* GPT-2's map: printable bytes stand for themselves, the others for 256, 257, ... */
static int byte_codepoint(int b)
{
    if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174)
        return b;
    int extra = 0; /* how many unprintable bytes come before b */
    for (int x = 0; x < b; x++)
        extra += !((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || x >= 174);
    return 256 + extra;
}

size_t loom_byte_level_spell(const unsigned char *bytes, size_t n, char *out)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += (size_t)utf8proc_encode_char(byte_codepoint(bytes[i]), (utf8proc_uint8_t *)out + k);
    return k;
}

int tok_bpe_setup(loom_tokenizer *t, const loom_gguf *g, char *err, size_t err_size)
{
    memset(t->char_byte, 0xff, sizeof t->char_byte);
    for (int b = 0; b < 256; b++) {
        int cp = byte_codepoint(b);
        t->byte_chars_len[b] = (unsigned char)utf8proc_encode_char(
            cp, (utf8proc_uint8_t *)t->byte_chars[b]);
        t->char_byte[cp] = (int16_t)b;
    }
    const loom_gguf_kv *merges = loom_gguf_find(g, "tokenizer.ggml.merges");
    if (!merges || merges->type != LOOM_GGUF_ARRAY || merges->array_type != LOOM_GGUF_STRING) {
        snprintf(err, err_size, "a gpt2 tokenizer needs tokenizer.ggml.merges (a list of strings)");
        return -1;
    }
    if (merges->count >= (1u << 24)) { /* ranks are compared as floats, exact below 2^24 */
        snprintf(err, err_size, "tokenizer.ggml.merges has %llu entries; loom reads at most 2^24",
                 (unsigned long long)merges->count);
        return -1;
    }
    t->n_merges = (int32_t)merges->count;
    uint64_t total = 0;
    for (int32_t i = 0; i < t->n_merges; i++) {
        const char *s;
        uint64_t len;
        loom_gguf_array_str(g, merges, (uint64_t)i, &s, &len);
        total += len + 1;
    }
    uint32_t cap = 1;
    while (cap < (uint32_t)t->n_merges * 2 + 2)
        cap <<= 1;
    t->merge_arena = malloc(total + 1);
    t->merge_text = malloc(((size_t)t->n_merges + 1) * sizeof *t->merge_text);
    t->merge_len = malloc(((size_t)t->n_merges + 1) * sizeof *t->merge_len);
    t->merge_table = malloc(cap * sizeof *t->merge_table);
    if (!t->merge_arena || !t->merge_text || !t->merge_len || !t->merge_table) {
        snprintf(err, err_size, "out of memory for the merges");
        return -1;
    }
    t->merge_mask = cap - 1;
    memset(t->merge_table, 0xff, cap * sizeof *t->merge_table);
    char *p = t->merge_arena;
    for (int32_t i = 0; i < t->n_merges; i++) {
        const char *s;
        uint64_t len;
        loom_gguf_array_str(g, merges, (uint64_t)i, &s, &len);
        memcpy(p, s, len);
        p[len] = '\0';
        t->merge_text[i] = p;
        t->merge_len[i] = (uint32_t)len;
        p += len + 1;
        if (merge_lookup(t, t->merge_text[i], len) < 0) { /* the first (lowest) rank wins */
            uint32_t h = hash_bytes(t->merge_text[i], len) & t->merge_mask;
            while (t->merge_table[h] >= 0)
                h = (h + 1) & t->merge_mask;
            t->merge_table[h] = i;
        }
    }
    const char *pre = "gpt2";
    uint64_t pre_len = 4;
    loom_gguf_get_str(g, "tokenizer.ggml.pre", &pre, &pre_len);
    const char *pattern = NULL;
    for (size_t i = 0; i < sizeof pretokenizers / sizeof pretokenizers[0]; i++)
        if (strlen(pretokenizers[i].name) == pre_len &&
            memcmp(pre, pretokenizers[i].name, pre_len) == 0)
            pattern = pretokenizers[i].pattern;
    if (!pattern) {
        snprintf(err, err_size,
                 "pre-tokenizer '%.*s' is not supported yet (loom knows: qwen2, "
                 "llama-bpe, chatglm-bpe, glm4, gpt2)",
                 (int)(pre_len < 40 ? pre_len : 40), pre);
        return -1;
    }
    t->nfc = pre_len == 5 && memcmp(pre, "qwen2", 5) == 0;
    /* tiktoken-trained vocabularies: a pre-token that is a token is emitted whole */
    t->ignore_merges = (pre_len == 9 && memcmp(pre, "llama-bpe", 9) == 0) ||
        tok_pre_is_glm(pre, pre_len);
    int code;
    PCRE2_SIZE off;
    t->re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &code,
                          &off, NULL);
    if (!t->re) {
        snprintf(err, err_size, "internal: the %s pre-tokenizer pattern does not compile", pattern);
        return -1;
    }
    /* compiled to machine code where PCRE2 can (several times faster on long prompts);
     * where it cannot, pcre2_match interprets the pattern as before */
    pcre2_jit_compile(t->re, PCRE2_JIT_COMPLETE);
    return 0;
}

/* ---- Byte-level BPE: encoding ------------------------------------------------------------ */

/* byte-level BPE: a pair merges when "left right" is a listed merge, lowest rank first */
static int bpe_pair_score(const pair_scorer *ps, const symbol *a, const symbol *b, float *score)
{
    memcpy(ps->key, ps->text + a->start, a->n);
    ps->key[a->n] = ' ';
    memcpy(ps->key + a->n + 1, ps->text + b->start, b->n);
    int32_t rank = merge_lookup(ps->t, ps->key, a->n + 1 + b->n);
    if (rank < 0)
        return -1;
    *score = -(float)rank; /* exact: ranks stay below 2^24 (bpe_setup) */
    return 0;
}

/* One pre-token: its bytes spelled with the byte map, then merged by rank. */
static int bpe_word(const loom_tokenizer *t, const unsigned char *w, size_t n, out_ids *o)
{
    if (n == 0)
        return 0;
    if (n > MAX_FRAGMENT)
        return -1;
    char *buf = malloc(2 * n + 1), *key = malloc(4 * n + 2);
    symbol *sym = malloc((n + 1) * sizeof *sym);
    if (!buf || !key || !sym) {
        free(buf), free(key), free(sym);
        return -1;
    }
    size_t used = 0;
    for (size_t i = 0; i < n; i++) {
        sym[i] = (symbol){(int)i - 1, i + 1 < n ? (int)i + 1 : -1, (uint32_t)used,
                          t->byte_chars_len[w[i]]};
        memcpy(buf + used, t->byte_chars[w[i]], sym[i].n);
        used += sym[i].n;
    }
    int rc = 0;
    int32_t whole = t->ignore_merges ? tok_lookup(t, buf, used) : -1;
    if (whole >= 0) {
        tok_emit(o, whole);
    } else {
        pair_scorer ps = {bpe_pair_score, t, buf, key};
        rc = tok_merge_symbols(&ps, sym, (int)n);
    }
    for (int i = 0; whole < 0 && i >= 0 && rc == 0; i = sym[i].next) {
        int32_t id = tok_lookup(t, buf + sym[i].start, sym[i].n);
        if (id >= 0) {
            tok_emit(o, id);
            continue;
        }
        /* not in the vocabulary as a whole: its characters one by one */
        for (size_t k = 0; k < sym[i].n;) {
            size_t cl = tok_utf8_len((unsigned char)buf[sym[i].start + k]);
            int32_t cid = tok_lookup(t, buf + sym[i].start + k, cl);
            tok_emit(o, cid >= 0 ? cid : t->unk);
            k += cl;
        }
    }
    free(buf), free(key), free(sym);
    return rc;
}

int tok_bpe_fragment(const loom_tokenizer *t, const char *raw, size_t len, out_ids *o)
{
    utf8proc_uint8_t *norm = NULL;
    const unsigned char *text = (const unsigned char *)raw;
    if (t->nfc) {
        utf8proc_ssize_t n = utf8proc_map((const utf8proc_uint8_t *)raw, (utf8proc_ssize_t)len,
                                          &norm, UTF8PROC_STABLE | UTF8PROC_COMPOSE);
        if (n >= 0) {
            text = norm;
            len = (size_t)n;
        } /* not valid UTF-8: tokenize the bytes as they are */
    }
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(t->re, NULL);
    int rc = md ? 0 : -1;
    size_t at = 0;
    while (rc == 0 && at < len) {
        int m = pcre2_match(t->re, text, len, at, PCRE2_NO_UTF_CHECK, md, NULL);
        size_t s = len, e = len;
        if (m >= 0) {
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
            s = ov[0];
            e = ov[1] > ov[0] ? ov[1] : ov[0] + tok_utf8_len(text[ov[0]]);
        }
        if (s > at)
            rc = bpe_word(t, text + at, s - at, o); /* bytes no pattern matched */
        if (rc == 0 && e > s)
            rc = bpe_word(t, text + s, (e < len ? e : len) - s, o);
        at = e;
    }
    pcre2_match_data_free(md);
    free(norm);
    return rc;
}
