/*
 * core/tokenizer_internal.h - what the tokenizer's files share: the tokenizer's state, the
 * vocabulary hash, and the merge engine both BPE kinds run. tokenizer.c sets a tokenizer up
 * from GGUF, runs the engine, and encodes and decodes; tokenizer_spm.c is SentencePiece (BPE,
 * unigram, its normaliser, ChatGLM-6B's text rewriting); tokenizer_bpe.c is byte-level BPE
 * (GPT-2, Qwen2, Llama-3: the pre-tokenizer and the merges); utf8.c the UTF-8 helpers.
 */
#ifndef LOOM_CORE_TOKENIZER_INTERNAL_H
#define LOOM_CORE_TOKENIZER_INTERNAL_H

#include "tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stddef.h>
#include <stdint.h>

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
static inline uint32_t hash_more(uint32_t h, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * 16777619u;
    return h;
}

static inline uint32_t hash_bytes(const char *s, size_t n)
{
    return hash_more(HASH_SEED, s, n);
}

/* tok_lookup() with the text's hash_bytes() already known */

/* The id of the vocabulary entry s[0..n), or -1 (hash: hash_bytes(s, n), when known). */
int32_t tok_lookup(const loom_tokenizer *t, const char *s, size_t n);
int32_t tok_lookup_hashed(const loom_tokenizer *t, const char *s, size_t n, uint32_t hash);
int64_t tok_get_int(const loom_gguf *g, const char *key, int64_t fallback);
int tok_get_flag(const loom_gguf *g, const char *key, int fallback);

/* symbols are indexed by int; no pre-token or text run is allowed near that */
#define MAX_FRAGMENT ((size_t)INT_MAX / 4)

typedef struct symbol {
    int prev, next;    /* neighbours in the list, -1 at the ends */
    uint32_t start, n; /* bytes in the escaped text; n == 0 once merged into the left one */
} symbol;

typedef struct out_ids {
    int32_t *ids;
    int64_t n, cap;
} out_ids;

/* How a BPE family scores merging two adjacent symbols (higher merges first): 0 and *score
 * when the pair merges, -1 when it does not. */
typedef struct pair_scorer {
    int (*score)(const struct pair_scorer *ps, const symbol *a, const symbol *b, float *score);
    const loom_tokenizer *t;
    const char *text; /* the symbols' bytes, contiguous */
    char *key;        /* scratch, for families whose merge key is not the concatenation */
} pair_scorer;

void tok_emit(out_ids *o, int32_t id);
void tok_emit_bytes(const loom_tokenizer *t, const char *p, size_t n, out_ids *o);
size_t tok_utf8_len(unsigned char c);
int tok_merge_symbols(const pair_scorer *ps, symbol *sym, int count);
/* the bytes at s (n left) that begin a UTF-8 character; *whole when they are all of one */
size_t tok_utf8_char(const unsigned char *s, size_t n, int *whole);

/* tokenizer_bpe.c */
int tok_default_add_bos(const loom_gguf *g, int bpe);
/* Whether tokenizer.ggml.pre names GLM-4's vocabulary (chatglm-bpe, or glm4 as llama.cpp's
 * converter writes for GLM-4-0414 and GLM-4.5): prompts start [gMASK] <sop>, no BOS. */
int tok_pre_is_glm(const char *pre, uint64_t len);
int tok_bpe_setup(loom_tokenizer *t, const loom_gguf *g, char *err, size_t err_size);
int tok_bpe_fragment(const loom_tokenizer *t, const char *raw, size_t len, out_ids *o);

/* tokenizer_spm.c */
int tok_charsmap_load(loom_tokenizer *t, const loom_gguf *g, char *err, size_t err_size);
int tok_spm_text(const loom_tokenizer *t, const char *raw, size_t len, int prefix, int first,
                 int last, out_ids *o);
/* SentencePiece BPE on a run of text that needs no normalising */
int tok_spm_fragment(const loom_tokenizer *t, const char *raw, size_t len, int prefix, out_ids *o);
int tok_glm_text(const loom_tokenizer *t, const char *raw, size_t len, int prefix, out_ids *o);

#endif
