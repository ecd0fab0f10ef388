/*
 * tests/test_hostile.c - text an attacker controls cannot stall or derail the tokenizers:
 * long pre-tokens (a megabyte of one letter is one "word" to byte-level BPE) finish in
 * O(n log n), invalid UTF-8 is read as U+FFFD the way Python's decoder (and so the reference
 * tokenizers) read it, and a vocabulary with non-finite scores is refused at load.
 *
 * Every tokenizer family runs: SentencePiece BPE (llama.cpp's Llama-2 vocabulary), byte-level
 * BPE (Qwen2, Llama-3) and SentencePiece unigram (ChatGLM-6B).
 */
#define _GNU_SOURCE
#include "core/tokenizer.h"

#include <loom/loom.h>

#include "check.h"

#include <signal.h>
#include <string.h>
#include <unistd.h>

static char err[1024];

/* Python's bytes.decode("utf-8", "replace"), re-encoded: one U+FFFD per maximal subpart. */
static void test_sanitize(void)
{
    static const struct {
        const char *in, *want;
    } cases[] = {
        {"a\xff"
         "b",
         "a\xef\xbf\xbd"
         "b"},
        {"\xe0\x80", "\xef\xbf\xbd\xef\xbf\xbd"},                 /* E0 needs A0..BF next */
        {"\xf0\x9f\xa6", "\xef\xbf\xbd"},                         /* a cut 4-byte character */
        {"\xed\xa0\x80", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"}, /* a surrogate */
        {"\xc0\xaf", "\xef\xbf\xbd\xef\xbf\xbd"},                 /* overlong */
        {"\xf4\x90\x80\x80", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"}, /* > U+10FFFF */
        {"\xe2\x82", "\xef\xbf\xbd"},
        {"\xf0\x9f\xa6\xe2\x82\xac", "\xef\xbf\xbd\xe2\x82\xac"},
        {"h\xc3\xa9llo \xf0\x9f\xa6\x80", "h\xc3\xa9llo \xf0\x9f\xa6\x80"}, /* valid: unchanged */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t n, len = strlen(cases[i].in);
        char *got = loom_utf8_sanitize(cases[i].in, len, &n);
        CHECK(got && n == strlen(cases[i].want) && memcmp(got, cases[i].want, n) == 0,
              "sanitize case %zu: %zu bytes, want %zu", i, got ? n : 0, strlen(cases[i].want));
        int valid = strcmp(cases[i].in, cases[i].want) == 0;
        CHECK((loom_utf8_valid_prefix(cases[i].in, len) == len) == valid, "case %zu is %s UTF-8", i,
              valid ? "valid" : "not");
        free(got);
    }
}

typedef struct vocab_under_test {
    const char *name, *path; /* relative to the fixtures */
} vocab_under_test;

static int64_t encode(loom_vocab *v, const char *text, int32_t **ids)
{
    int64_t n = loom_vocab_encode(v, text, 1, 1, NULL, 0);
    *ids = n > 0 ? malloc((size_t)n * sizeof **ids) : NULL;
    if (*ids)
        loom_vocab_encode(v, text, 1, 1, *ids, n);
    return n;
}

static void on_alarm(int sig)
{
    (void)sig;
    static const char msg[] = "FAIL: tokenizing 256 KiB took over 120 s: quadratic again?\n";
    if (write(2, msg, sizeof msg - 1) < 0) {
    }
    _exit(1);
}

/* 256 KiB of one letter (one pre-token), of random CJK (one pre-token too: all \p{L}), of
 * random bytes (mostly invalid UTF-8). Before the heap BPE, 100 kB of one word took minutes. */
static void test_long_inputs(loom_vocab *v, const char *name)
{
    enum { N = 256 * 1024 };
    char *text = malloc(N + 1);
    uint32_t seed = 12345;
    for (int kind = 0; kind < 3; kind++) {
        size_t k = 0;
        while (k + 4 <= N) {
            seed = seed * 1664525u + 1013904223u;
            if (kind == 0) {
                text[k++] = 'a';
            } else if (kind == 1) { /* U+4E00..U+9FFF, three bytes each */
                uint32_t cp = 0x4e00 + (seed >> 8) % 0x5200;
                text[k++] = (char)(0xe0 | cp >> 12);
                text[k++] = (char)(0x80 | ((cp >> 6) & 0x3f));
                text[k++] = (char)(0x80 | (cp & 0x3f));
            } else {
                text[k++] = (char)(1 + (seed >> 24) % 255); /* no NUL */
            }
        }
        text[k] = '\0';
        int32_t *ids;
        int64_t n = encode(v, text, &ids);
        CHECK(n > 0 && ids, "%s: %s input of %zu bytes gives tokens (%lld)", name,
              kind == 0       ? "one-letter"
                  : kind == 1 ? "CJK"
                              : "random-byte",
              k, (long long)n);
        free(ids);
    }
    free(text);
}

/* An invalid byte is U+FFFD: the same ids as the text with U+FFFD written out, and the text
 * after it is tokenized as usual (not swallowed into one word). */
static void test_invalid_bytes(loom_vocab *v, const char *name)
{
    int32_t *a, *b, *c, *d;
    int64_t na = encode(v, "Hello \xff world, how are you?", &a);
    int64_t nb = encode(v, "Hello \xef\xbf\xbd world, how are you?", &b);
    int same = na == nb && na > 0;
    for (int64_t i = 0; same && i < na; i++)
        same = a[i] == b[i];
    CHECK(same, "%s: an invalid byte tokenizes as U+FFFD (%lld vs %lld ids)", name, (long long)na,
          (long long)nb);
    /* the tail after a bad byte splits into its usual pieces */
    int64_t nc = encode(v, " world, how are you?", &c), nd = encode(v, "\xff", &d);
    CHECK(nc > 0 && nd > 0 && na >= nc, "%s: tail tokens", name);
    free(a), free(b), free(c), free(d);
}

static void test_vocab(const vocab_under_test *u)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", fixtures_dir(), u->path);
    if (access(path, R_OK) != 0) {
        const char *ci = getenv("CI");
        CHECK(!(ci && strcmp(ci, "true") == 0), "fixture missing under CI=true: %s", path);
        printf("SKIP %s: %s not found\n", u->name, path);
        return;
    }
    char gguf[] = "/tmp/loom-hostile-XXXXXX";
    int fd = -1;
    loom_vocab *v = NULL;
    if (strstr(u->path, "tokenizers/")) { /* a tokenizer folder without a model: convert it */
        fd = mkstemp(gguf);
        close(fd);
        CHECK(loom_convert_tokenizer(path, gguf, err, sizeof err) == 0, "%s: %s", u->name, err);
        v = loom_vocab_open(gguf, err, sizeof err);
    } else {
        v = loom_vocab_open(path, err, sizeof err);
    }
    CHECK(v != NULL, "%s: %s", u->name, err);
    if (v) {
        test_long_inputs(v, u->name);
        test_invalid_bytes(v, u->name);
        loom_vocab_close(v);
    }
    if (fd >= 0)
        unlink(gguf);
}

/* A score that is NaN or infinite would make BPE's merge order and Viterbi's sums meaningless
 * (and left the unigram back-walk following uninitialised links). */
static void test_nonfinite_scores(void)
{
    char path[] = "/tmp/loom-hostile-nan-XXXXXX";
    close(mkstemp(path));
    const char *tokens[] = {"<unk>", "a", "b", "ab"};
    float scores[] = {0.0f, -1.0f, -1.0f, NAN};
    loom_gguf_writer *w = loom_gguf_writer_create();
    loom_gguf_set_str(w, "tokenizer.ggml.model", "t5");
    loom_gguf_set_str_array(w, "tokenizer.ggml.tokens", tokens, 4);
    loom_gguf_set_f32_array(w, "tokenizer.ggml.scores", scores, 4);
    CHECK(loom_gguf_write(w, path, err, sizeof err) == 0, "write: %s", err);
    loom_gguf_writer_free(w);
    loom_gguf g;
    CHECK(loom_gguf_open(&g, path, err, sizeof err) == 0, "open: %s", err);
    loom_tokenizer *t = loom_tokenizer_from_gguf(&g, err, sizeof err);
    CHECK(!t && strstr(err, "scores[3]") && strstr(err, "not a finite number"),
          "a NaN score is refused by name: %s", t ? "(accepted)" : err);
    loom_tokenizer_free(t);
    loom_gguf_close(&g);
    unlink(path);
}

int main(void)
{
    test_sanitize();
    test_nonfinite_scores();
    signal(SIGALRM, on_alarm);
    alarm(120);
    static const vocab_under_test vocabs[] = {
        {"Llama-2 (SentencePiece BPE)", "peers/llama.cpp/ggml-vocab-llama-spm.gguf"},
        {"Qwen2 (byte-level BPE)", "tiny-qwen2"},
        {"Llama-3 (byte-level BPE)", "tokenizers/llama3"},
        {"ChatGLM-6B (SentencePiece unigram)", "tokenizers/chatglm1"},
    };
    for (size_t i = 0; i < sizeof vocabs / sizeof vocabs[0]; i++)
        test_vocab(&vocabs[i]);
    alarm(0);
    return check_finish("test_hostile");
}
