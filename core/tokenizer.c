/*
 * core/tokenizer.c - see tokenizer.h.
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
#include "tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <float.h>
#include <limits.h>
#include <math.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

enum {
    TOK_NORMAL = 1,
    TOK_UNKNOWN = 2,
    TOK_CONTROL = 3,
    TOK_USER = 4,
    TOK_UNUSED = 5,
    TOK_BYTE = 6
};

typedef struct vocab_entry {
    const char *text; /* NUL-terminated, in the tokenizer's arena */
    uint32_t len;
    float score;
    int type;
} vocab_entry;

struct loom_tokenizer {
    char model[32];
    vocab_entry *vocab;
    int32_t n_vocab;
    char *arena;
    int32_t *table; /* open-addressing hash of text -> id, -1 empty */
    uint32_t table_mask;
    int32_t bos, eos, unk;
    int add_bos, add_space_prefix;
    int strip_special; /* whitespace next to a special token belongs to neither side */
    int32_t prefix[4]; /* what add_special prepends instead of BOS (ChatGLM: [gMASK] sop) */
    int n_prefix;
    int32_t suffix[4]; /* what add_special appends (ChatGLM-6B: [gMASK] <sop>) */
    int n_suffix;
    int unigram;           /* SentencePiece unigram: Viterbi instead of merges */
    int nfkc, collapse_ws; /* normalise: NFKC; collapse whitespace runs and trim the ends */
    int escape_ws;         /* spaces become U+2581 (every SentencePiece model loom has met) */
    /* SentencePiece's precompiled normaliser: a double-array trie over UTF-8 (darts-clone's
     * unit format) whose values index NUL-terminated replacements in charsmap_strings */
    uint32_t *charsmap_units;
    size_t charsmap_n_units;
    char *charsmap_strings;
    size_t charsmap_n_strings;
    int glm_text;       /* ChatGLM-6B's <n> / <|tab|> / <|blank_N|> rewriting */
    uint32_t max_piece; /* longest piece, bytes (unigram) */
    /* unigram: a bit per hash of every prefix of every piece, so that the search for pieces
     * at a position stops as soon as no piece can start with what it has read */
    uint64_t *prefix_bits;
    uint32_t prefix_mask;
    unsigned char special_first[256]; /* some special token's text starts with this byte */
    float min_score, max_score;       /* lowest and highest normal piece's score (unigram: an
                                       * unknown costs 10 less than the lowest) */
    int32_t stops[16];                /* further tokens that end a generation */
    int n_stops;
    int32_t byte_ids[256]; /* <0xXX> tokens, -1 when absent */
    int32_t *specials;     /* control and user-defined ids, longest text first */
    int n_specials;
    /* those of them a user's text may name (parse_special 1; tokenizer.loom.text_specials),
     * longest first; NULL: all of them */
    int32_t *text_specials;
    int n_text_specials;
    /* byte-level BPE */
    int bpe;
    char *merge_arena;       /* "left right" strings */
    const char **merge_text; /* by rank */
    uint32_t *merge_len;
    int32_t n_merges;
    int32_t *merge_table; /* hash of merge text -> rank, -1 empty */
    uint32_t merge_mask;
    pcre2_code *re; /* the pre-tokenizer */
    int nfc;
    int ignore_merges;       /* Llama-3: a pre-token that is a whole vocabulary entry stays one */
    char byte_chars[256][3]; /* GPT-2's byte -> character map, UTF-8 */
    unsigned char byte_chars_len[256];
    int16_t char_byte[324]; /* and back: code point (< 324) -> byte, -1 none */
};

#define HASH_SEED 2166136261u

/* FNV-1a, which runs a byte at a time: a prefix's hash extends to the next prefix's */
static uint32_t hash_more(uint32_t h, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * 16777619u;
    return h;
}

static uint32_t hash_bytes(const char *s, size_t n)
{
    return hash_more(HASH_SEED, s, n);
}

/* lookup() with the text's hash_bytes() already known */
static int32_t lookup_hashed(const loom_tokenizer *t, const char *s, size_t n, uint32_t hash)
{
    for (uint32_t i = hash & t->table_mask;; i = (i + 1) & t->table_mask) {
        int32_t id = t->table[i];
        if (id < 0)
            return -1;
        if (t->vocab[id].len == n && memcmp(t->vocab[id].text, s, n) == 0)
            return id;
    }
}

static int32_t lookup(const loom_tokenizer *t, const char *s, size_t n)
{
    return lookup_hashed(t, s, n, hash_bytes(s, n));
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

static int64_t get_int(const loom_gguf *g, const char *key, int64_t fallback)
{
    int64_t v;
    return loom_gguf_get_i64(g, key, &v) == 0 ? v : fallback;
}

static int get_flag(const loom_gguf *g, const char *key, int fallback)
{
    int b;
    return loom_gguf_get_bool(g, key, &b) == 0 ? b : fallback;
}

/* ---- Byte-level BPE: setup --------------------------------------------------------------- */

/* Whether text starts with BOS when the file has no tokenizer.ggml.add_bos_token: SentencePiece
 * vocabularies do; byte-level ones do not, but for Llama 3's pre-tokenizer, whose files
 * llama.cpp's converter writes without the key and which llama.cpp then starts with
 * <|begin_of_text|>. */
static int default_add_bos(const loom_gguf *g, int bpe)
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

/* Pre-tokenizer patterns, by tokenizer.ggml.pre (the regexes the models were trained with). */
static const struct {
    const char *name, *pattern;
} pretokenizers[] = {
    {"qwen2",
     "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
    {"llama-bpe",
     "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
    /* GLM-4: Llama-3's pattern (both come from tiktoken's cl100k) */
    {"chatglm-bpe",
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

static int bpe_setup(loom_tokenizer *t, const loom_gguf *g, char *err, size_t err_size)
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
                 "llama-bpe, chatglm-bpe, gpt2)",
                 (int)(pre_len < 40 ? pre_len : 40), pre);
        return -1;
    }
    t->nfc = pre_len == 5 && memcmp(pre, "qwen2", 5) == 0;
    /* tiktoken-trained vocabularies: a pre-token that is a token is emitted whole */
    t->ignore_merges = (pre_len == 9 && memcmp(pre, "llama-bpe", 9) == 0) ||
        (pre_len == 11 && memcmp(pre, "chatglm-bpe", 11) == 0);
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

/* tokenizer.ggml.precompiled_charsmap: a little-endian uint32 with the trie's size in bytes,
 * the trie (uint32 units), then the replacement strings. Checked here, so that lookups can
 * trust it; a map that does not hold together is an error, not a silent identity. */
static int charsmap_load(loom_tokenizer *t, const loom_gguf *g, char *err, size_t err_size)
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
        if (lookup(t, e->text, e->len) < 0) { /* first entry of a text wins */
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
    t->bos = (int32_t)get_int(g, "tokenizer.ggml.bos_token_id", -1);
    t->eos = (int32_t)get_int(g, "tokenizer.ggml.eos_token_id", -1);
    t->unk = (int32_t)get_int(g, "tokenizer.ggml.unknown_token_id", 0);
    if (t->bos >= t->n_vocab)
        t->bos = -1;
    if (t->eos >= t->n_vocab)
        t->eos = -1;
    if (t->unk < 0 || t->unk >= t->n_vocab)
        t->unk = 0;
    t->add_bos = get_flag(g, "tokenizer.ggml.add_bos_token", default_add_bos(g, bpe)) &&
        t->bos >= 0;
    t->add_space_prefix = get_flag(g, "tokenizer.ggml.add_space_prefix", !bpe);
    /* Hugging Face's SentencePiece (slow) tokenizer strips the whitespace around special tokens
     * unless they are declared with lstrip/rstrip false, as tokenizer.json-era configs do;
     * llama.cpp never strips. loom's converter records which (tokenizer.loom.strip_special);
     * a file without the key is taken as the classic SentencePiece behaviour. */
    t->strip_special = !bpe && get_flag(g, "tokenizer.loom.strip_special", 1);
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
        pre_len == 11 && memcmp(pre, "chatglm-bpe", 11) == 0) {
        /* a GLM-4 file from another converter: its prompts start [gMASK] <sop> all the same */
        int32_t gmask = lookup(t, "[gMASK]", 7), sop = lookup(t, "<sop>", 5);
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
    if (charsmap_load(t, g, err, err_size) != 0) {
        loom_tokenizer_free(t);
        return NULL;
    }
    t->collapse_ws = get_flag(g, "tokenizer.loom.remove_extra_whitespaces", 0);
    t->escape_ws = get_flag(g, "tokenizer.loom.escape_whitespaces", 1);
    t->glm_text = get_flag(g, "tokenizer.loom.glm_text", 0);
    if (bpe && bpe_setup(t, g, err, err_size) != 0) {
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

/* ---- SentencePiece BPE ------------------------------------------------------------------ */

/* symbols are indexed by int; no pre-token or text run is allowed near that */
#define MAX_FRAGMENT ((size_t)INT_MAX / 4)

typedef struct symbol {
    int prev, next;    /* neighbours in the list, -1 at the ends */
    uint32_t start, n; /* bytes in the escaped text; n == 0 once merged into the left one */
} symbol;

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

static size_t utf8_len(unsigned char c)
{
    return c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
}

typedef struct out_ids {
    int32_t *ids;
    int64_t n, cap;
} out_ids;

static void emit(out_ids *o, int32_t id)
{
    if (o->n < o->cap)
        o->ids[o->n] = id;
    o->n++;
}

/* Text no piece covers, spelled with <0xXX> byte tokens (unknown when the vocabulary has none). */
static void emit_bytes(const loom_tokenizer *t, const char *p, size_t n, out_ids *o)
{
    for (size_t j = 0; j < n; j++) {
        int32_t bid = t->byte_ids[(unsigned char)p[j]];
        emit(o, bid >= 0 ? bid : t->unk);
    }
}

/* How a BPE family scores merging two adjacent symbols (higher merges first): 0 and *score
 * when the pair merges, -1 when it does not. */
typedef struct pair_scorer {
    int (*score)(const struct pair_scorer *ps, const symbol *a, const symbol *b, float *score);
    const loom_tokenizer *t;
    const char *text; /* the symbols' bytes, contiguous */
    char *key;        /* scratch, for families whose merge key is not the concatenation */
} pair_scorer;

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
static int merge_symbols(const pair_scorer *ps, symbol *sym, int count)
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

/* SentencePiece BPE: a pair merges when its concatenation is a piece, by the piece's score */
static int spm_pair_score(const pair_scorer *ps, const symbol *a, const symbol *b, float *score)
{
    int32_t id = lookup(ps->t, ps->text + a->start, a->n + b->n);
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
static int spm_fragment(const loom_tokenizer *t, const char *raw, size_t len, int prefix,
                        out_ids *o)
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
        size_t cl = utf8_len((unsigned char)text[i]);
        if (cl > n - i)
            cl = n - i;
        sym[count] = (symbol){count - 1, -1, (uint32_t)i, (uint32_t)cl};
        if (count > 0)
            sym[count - 1].next = count;
        count++;
        i += cl;
    }
    pair_scorer ps = {spm_pair_score, t, text, NULL};
    int rc = merge_symbols(&ps, sym, count);
    for (int i = 0; count > 0 && i >= 0 && rc == 0; i = sym[i].next) {
        int32_t id = lookup(t, text + sym[i].start, sym[i].n);
        if (id >= 0) {
            emit(o, id);
            continue;
        }
        emit_bytes(t, text + sym[i].start, sym[i].n, o);
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
        size_t cl = utf8_len((unsigned char)text[i]);
        if (cl > n - i)
            cl = n - i;
        int covered = 0;
        uint32_t hash = HASH_SEED; /* of text[i, i + l), grown with l */
        for (size_t l = cl, hashed = 0; l <= t->max_piece && i + l <= n;
             l += utf8_len((unsigned char)text[i + l])) {
            hash = hash_more(hash, text + i + hashed, l - hashed);
            hashed = l;
            if (!(t->prefix_bits[(hash & t->prefix_mask) / 64] >> (hash & 63) & 1))
                break; /* no piece starts with text[i, i + l) */
            int32_t id = lookup_hashed(t, text + i, l, hash);
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
            emit(o, piece[e]);
            continue;
        }
        emit_bytes(t, text + s, e - s, o); /* an unknown character: its bytes */
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
            used = utf8_len((unsigned char)raw[i]);
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
static int spm_text(const loom_tokenizer *t, const char *raw, size_t len, int prefix, int first,
                    int last, out_ids *o)
{
    char *norm;
    size_t n = normalise(t, raw, len, first, last, &norm);
    const char *text = norm ? norm : raw;
    int rc = 0;
    if (n > 0 || (prefix && !t->collapse_ws))
        rc = t->unigram ? unigram_fragment(t, text, n, prefix, o)
                        : spm_fragment(t, text, n, prefix, o);
    else if (prefix && !last) /* the whole text goes on past this run: it has the prefix */
        rc = t->unigram ? unigram_fragment(t, text, 0, 1, o) : spm_fragment(t, text, 0, 1, o);
    free(norm);
    return rc;
}

/* ChatGLM-6B, as its Hugging Face tokenizer does it: newlines, tabs and runs of 80 down to 2
 * spaces are replaced by the user-defined pieces <n>, <|tab|> and <|blank_N|> (a run over 80
 * is cut into 80s; a single space left over stays a space), then the whole text goes through
 * SentencePiece in one pass, those pieces passing the normaliser untouched and winning where
 * they stand. One pass, not one per stretch between markers: the Viterbi's float sums, and so
 * its choice between equally good segmentations, depend on everything before. */
static int glm_text(const loom_tokenizer *t, const char *raw, size_t len, int prefix, out_ids *o)
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
    int rc = spm_text(t, s, k, prefix, 1, 1, o);
    free(s);
    return rc;
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
    int32_t whole = t->ignore_merges ? lookup(t, buf, used) : -1;
    if (whole >= 0) {
        emit(o, whole);
    } else {
        pair_scorer ps = {bpe_pair_score, t, buf, key};
        rc = merge_symbols(&ps, sym, (int)n);
    }
    for (int i = 0; whole < 0 && i >= 0 && rc == 0; i = sym[i].next) {
        int32_t id = lookup(t, buf + sym[i].start, sym[i].n);
        if (id >= 0) {
            emit(o, id);
            continue;
        }
        /* not in the vocabulary as a whole: its characters one by one */
        for (size_t k = 0; k < sym[i].n;) {
            size_t cl = utf8_len((unsigned char)buf[sym[i].start + k]);
            int32_t cid = lookup(t, buf + sym[i].start + k, cl);
            emit(o, cid >= 0 ? cid : t->unk);
            k += cl;
        }
    }
    free(buf), free(key), free(sym);
    return rc;
}

static int bpe_fragment(const loom_tokenizer *t, const char *raw, size_t len, out_ids *o)
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
            e = ov[1] > ov[0] ? ov[1] : ov[0] + utf8_len(text[ov[0]]);
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

/* The bytes at s (n left) that begin a UTF-8 character: *whole is set when they are all of
 * one (Unicode's table of well-formed sequences: no overlong forms, surrogates or code points
 * above U+10FFFF), and the count is otherwise the "maximal subpart" that a decoder replaces
 * with one U+FFFD, as Python's and ICU's do. */
static size_t utf8_char(const unsigned char *s, size_t n, int *whole)
{
    unsigned c = s[0], lo = 0x80, hi = 0xbf;
    size_t need;
    *whole = c < 0x80;
    if (c < 0x80)
        return 1;
    if (c >= 0xc2 && c <= 0xdf)
        need = 2;
    else if (c >= 0xe0 && c <= 0xef)
        need = 3, lo = c == 0xe0 ? 0xa0 : lo, hi = c == 0xed ? 0x9f : hi;
    else if (c >= 0xf0 && c <= 0xf4)
        need = 4, lo = c == 0xf0 ? 0x90 : lo, hi = c == 0xf4 ? 0x8f : hi;
    else
        return 1;
    size_t k = 1;
    for (; k < need && k < n && s[k] >= lo && s[k] <= hi; k++)
        lo = 0x80, hi = 0xbf;
    *whole = k == need;
    return k;
}

void loom_text_printable(char *s)
{
    size_t len = strlen(s);
    for (size_t i = 0; i < len;) {
        size_t ok = loom_utf8_valid_prefix(s + i, len - i);
        for (size_t k = i; k < i + ok; k++)
            if (((unsigned char)s[k] < 0x20 && s[k] != '\n' && s[k] != '\t') || s[k] == 0x7f)
                s[k] = '?';
        i += ok;
        if (i < len)
            s[i++] = '?'; /* one byte of an ill-formed sequence; the walk resumes after it */
    }
}

size_t loom_utf8_valid_prefix(const char *text, size_t len)
{
    const unsigned char *s = (const unsigned char *)text;
    size_t i = 0;
    int whole = 1;
    while (i < len) {
        size_t k = utf8_char(s + i, len - i, &whole);
        if (!whole)
            break;
        i += k;
    }
    return i;
}

char *loom_utf8_sanitize(const char *text, size_t len, size_t *out_len)
{
    const unsigned char *s = (const unsigned char *)text;
    if (len > SIZE_MAX / 3 - 1)
        return NULL;
    char *out = malloc(3 * len + 1); /* one replacement (3 bytes) per bad byte at most */
    if (!out)
        return NULL;
    size_t k = 0;
    for (size_t i = 0; i < len;) {
        int whole;
        size_t c = utf8_char(s + i, len - i, &whole);
        if (whole)
            memcpy(out + k, s + i, c), k += c;
        else
            memcpy(out + k, "\xef\xbf\xbd", 3), k += 3;
        i += c;
    }
    out[k] = '\0';
    *out_len = k;
    return out;
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
            emit(&o, t->prefix[i]);
        if (!t->n_prefix && t->add_bos)
            emit(&o, t->bos);
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
                rc = bpe_fragment(t, text + start, end - start, &o);
            else if (t->glm_text)
                rc = glm_text(t, text + start, end - start, prefix, &o);
            else if (t->unigram || t->nfkc || t->collapse_ws || t->charsmap_units)
                rc = spm_text(t, text + start, end - start, prefix, start == 0, found < 0, &o);
            else
                rc = spm_fragment(t, text + start, end - start, prefix, &o);
            if (rc)
                return -1;
            prev_special = 0;
        }
        if (found < 0)
            break;
        emit(&o, found);
        prev_special = 1;
        i += t->vocab[found].len;
        start = i;
    }
    if (add_special)
        for (int i = 0; i < t->n_suffix; i++)
            emit(&o, t->suffix[i]);
    return o.n;
}

int loom_tokenizer_piece(const loom_tokenizer *t, int32_t prev, int32_t id, char *out, int cap)
{
    if (id < 0 || id >= t->n_vocab)
        return -1;
    const vocab_entry *e = &t->vocab[id];
    char buf[512];
    int n = 0;
    unsigned blanks;
    if (e->type == TOK_CONTROL) {
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

size_t loom_utf8_complete(const char *s, size_t n)
{
    /* look back at most 3 bytes for the start of a character that runs past the end */
    for (size_t back = 1; back <= 4 && back <= n; back++) {
        unsigned char c = (unsigned char)s[n - back];
        if ((c & 0xc0) == 0x80)
            continue; /* a continuation byte: keep looking for the lead */
        size_t need = c < 0x80 ? 1
            : (c >> 5) == 6    ? 2
            : (c >> 4) == 14   ? 3
            : (c >> 3) == 30   ? 4
                               : 1;
        return need > back ? n - back : n;
    }
    return n;
}
