/*
 * tests/test_tokenizer.c - the SentencePiece tokenizer against other tokenizers' output:
 * llama.cpp's test vectors for the Llama-2 vocabulary (ggml-vocab-llama-spm.gguf, every case
 * id for id, and decoding back to the same text), and the stories260K fixture's prompt ids
 * (with BOS and special tokens, as its expected.json describes).
 */
#define _GNU_SOURCE
#include "core/tokenizer.h"

#include "check.h"

#include <cjson/cJSON.h>
#include <string.h>
#include <unistd.h>

static char err[1024];

/* Decodes ids back into text. */
static void decode(const loom_tokenizer *t, const int32_t *ids, int64_t n, char *out, size_t cap)
{
    size_t used = 0;
    for (int64_t i = 0; i < n; i++) {
        char piece[256];
        int k = loom_tokenizer_piece(t, i ? ids[i - 1] : -1, ids[i], piece, sizeof piece);
        if (k > 0 && used + (size_t)k < cap) {
            memcpy(out + used, piece, (size_t)k);
            used += (size_t)k;
        }
    }
    out[used] = '\0';
}

static int missing(const char *path)
{
    if (access(path, R_OK) == 0)
        return 0;
    const char *ci = getenv("CI");
    CHECK(!(ci && strcmp(ci, "true") == 0), "fixture missing under CI=true: %s", path);
    printf("SKIP: %s not found\n", path);
    return 1;
}

static void test_llama_spm_vectors(void)
{
    char gpath[4000], inp[4096], outp[4096];
    snprintf(gpath, sizeof gpath, "%s/peers/llama.cpp/ggml-vocab-llama-spm.gguf", fixtures_dir());
    snprintf(inp, sizeof inp, "%s.inp", gpath);
    snprintf(outp, sizeof outp, "%s.out", gpath);
    if (missing(gpath))
        return;
    loom_gguf g;
    CHECK(loom_gguf_open(&g, gpath, err, sizeof err) == 0, "open vocab: %s", err);
    loom_tokenizer *t = loom_tokenizer_from_gguf(&g, err, sizeof err);
    CHECK(t != NULL, "tokenizer: %s", err);
    char *in = slurp(inp, NULL), *out = slurp(outp, NULL);
    CHECK(in && out, "read the vectors");
    if (!t || !in || !out)
        goto done;
    const char *sep = "\n__ggml_vocab_test__\n";
    char *case_start = in, *line = out;
    int cases = 0, wrong = 0, not_round_trip = 0;
    for (char *end; (end = strstr(case_start, sep)); case_start = end + strlen(sep)) {
        size_t len = (size_t)(end - case_start);
        char *eol = strchr(line, '\n');
        if (!eol)
            break;
        *eol = '\0';
        int32_t want[512], got[512];
        int64_t nw = 0;
        for (char *p = line, *q; nw < 512; p = q) {
            long v = strtol(p, &q, 10);
            if (q == p)
                break;
            want[nw++] = (int32_t)v;
        }
        int64_t ng = loom_tokenizer_encode(t, case_start, len, 0, 0, got, 512);
        int same = ng == nw && memcmp(got, want, (size_t)nw * sizeof *got) == 0;
        if (!same && wrong++ < 5) {
            fprintf(stderr, "case %d '%.*s': want", cases, (int)len, case_start);
            for (int64_t i = 0; i < nw; i++)
                fprintf(stderr, " %d", want[i]);
            fprintf(stderr, "\n  got");
            for (int64_t i = 0; i < ng && i < 512; i++)
                fprintf(stderr, " %d", got[i]);
            fprintf(stderr, "\n");
        }
        char text[4096];
        decode(t, got, ng < 512 ? ng : 512, text, sizeof text);
        if ((strlen(text) != len || memcmp(text, case_start, len) != 0) && not_round_trip++ < 5)
            fprintf(stderr, "case %d does not decode back: '%.*s' -> '%s'\n", cases, (int)len,
                    case_start, text);
        line = eol + 1;
        cases++;
    }
    CHECK(cases == 46, "all 46 cases read, got %d", cases);
    CHECK(wrong == 0, "%d of %d cases encode differently from llama.cpp", wrong, cases);
    CHECK(not_round_trip == 0, "%d cases do not decode to their text", not_round_trip);
done:
    free(in), free(out);
    loom_tokenizer_free(t);
    loom_gguf_close(&g);
}

static void test_stories_prompts(void)
{
    char gpath[4096], epath[4096];
    snprintf(gpath, sizeof gpath, "%s/stories260K/original/stories260K.gguf", fixtures_dir());
    snprintf(epath, sizeof epath, "%s/stories260K/expected.json", fixtures_dir());
    if (missing(gpath) || missing(epath))
        return;
    loom_gguf g;
    CHECK(loom_gguf_open(&g, gpath, err, sizeof err) == 0, "open: %s", err);
    loom_tokenizer *t = loom_tokenizer_from_gguf(&g, err, sizeof err);
    char *json = slurp(epath, NULL);
    cJSON *root = cJSON_Parse(json);
    cJSON *c;
    cJSON_ArrayForEach (c, cJSON_GetObjectItem(root, "cases")) {
        cJSON *text = cJSON_GetObjectItem(c, "text");
        if (!cJSON_IsString(text))
            text = cJSON_GetObjectItem(c, "rendered_prompt");
        cJSON *ids = cJSON_GetObjectItem(c, "prompt_ids");
        if (!t || !cJSON_IsString(text) || !ids)
            continue;
        int32_t got[1024];
        int64_t n = loom_tokenizer_encode(t, text->valuestring, strlen(text->valuestring), 1, 1,
                                          got, 1024);
        int same = n == cJSON_GetArraySize(ids);
        for (int64_t i = 0; same && i < n; i++)
            same = got[i] == cJSON_GetArrayItem(ids, (int)i)->valueint;
        CHECK(same, "stories260K case %s: %lld ids, want %d",
              cJSON_GetObjectItem(c, "name")->valuestring, (long long)n, cJSON_GetArraySize(ids));
    }
    cJSON_Delete(root);
    free(json);
    loom_tokenizer_free(t);
    loom_gguf_close(&g);
}

static void test_utf8(void)
{
    CHECK(loom_utf8_complete("ab", 2) == 2, "ascii");
    CHECK(loom_utf8_complete("a\xc3", 2) == 1, "half of a 2-byte character held back");
    CHECK(loom_utf8_complete("a\xe2\x96", 3) == 1, "two thirds of a 3-byte character");
    CHECK(loom_utf8_complete("a\xe2\x96\x81", 4) == 4, "a whole 3-byte character");
    CHECK(loom_utf8_complete("\xf0\x9f\xa6", 3) == 0, "three quarters of an emoji");
}

int main(void)
{
    test_llama_spm_vectors();
    test_stories_prompts();
    test_utf8();
    return check_finish("test_tokenizer");
}
