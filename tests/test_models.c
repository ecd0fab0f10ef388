/*
 * tests/test_models.c - model golden tests through the public API (loom.h), on every backend
 * usable on this machine and on ref with opaque buffers:
 *   - stories260K.gguf (a real trained Llama) continues from BOS exactly as llama2.c does
 *     (peers/llama2.c: 200 greedy tokens at temperature 0);
 *   - for each of the fixture's three prompts: our tokenizer's prompt ids, the last prompt
 *     position's logits within 5e-4 of the PyTorch float64 reference, and the 16 greedy tokens.
 */
#define _GNU_SOURCE
#include <loom/loom.h>

#include "backends.h"

#include "check.h"

#include <cjson/cJSON.h>
#include <string.h>
#include <unistd.h>

static char err[4096];
static char dir[4096];

typedef struct collect {
    int32_t ids[512];
    int n;
    char text[8192];
    size_t len;
} collect;

static int on_token(void *user, int32_t id, const char *text, size_t len)
{
    collect *c = user;
    if (id >= 0 && c->n < 512)
        c->ids[c->n++] = id;
    if (c->len + len < sizeof c->text) {
        memcpy(c->text + c->len, text, len);
        c->len += len;
        c->text[c->len] = '\0';
    }
    return 0;
}

static void run_backend(const char *backend, const char *label)
{
    char gguf[4200], path[4200];
    snprintf(gguf, sizeof gguf, "%s/stories260K/original/stories260K.gguf", dir);
    loom_model_options o = {.backend = backend, .kv_type = "f32", .n_ctx = 512};
    loom_model *m = loom_model_open(gguf, &o, err, sizeof err);
    CHECK(m != NULL, "%s: open: %s", label, err);
    if (!m)
        return;
    loom_sampling greedy = loom_sampling_defaults();
    greedy.temperature = 0;

    /* llama2.c's 200 greedy tokens from BOS */
    snprintf(path, sizeof path, "%s/peers/llama2.c/expected_stdout_stories260K_t0_n200.txt", dir);
    size_t want_len = 0;
    char *want = slurp(path, &want_len);
    int32_t bos = 1;
    collect c = {0};
    loom_generation st;
    int rc = loom_generate(m, &bos, 1, 200, &greedy, on_token, &c, &st, err, sizeof err);
    CHECK(rc == 0, "%s: generate: %s", label, err);
    CHECK(want && c.len == want_len && memcmp(c.text, want, want_len) == 0,
          "%s: 200 tokens from BOS differ from llama2.c's (%zu vs %zu bytes)", label, c.len,
          want_len);
    free(want);

    snprintf(path, sizeof path, "%s/stories260K/expected.json", dir);
    char *json = slurp(path, NULL);
    cJSON *root = cJSON_Parse(json), *cs;
    cJSON_ArrayForEach (cs, cJSON_GetObjectItem(root, "cases")) {
        const char *name = cJSON_GetObjectItem(cs, "name")->valuestring;
        cJSON *text = cJSON_GetObjectItem(cs, "text");
        int special = LOOM_SPECIAL_TEXT;
        if (!cJSON_IsString(text))
            text = cJSON_GetObjectItem(cs, "rendered_prompt"), special = LOOM_SPECIAL_ALL;
        cJSON *pids = cJSON_GetObjectItem(cs, "prompt_ids");
        int32_t ids[1024];
        int64_t n = loom_tokenize(m, text->valuestring, 1, special, ids, 1024, err, sizeof err);
        int same = n == cJSON_GetArraySize(pids);
        for (int64_t i = 0; same && i < n; i++)
            same = ids[i] == cJSON_GetArrayItem(pids, (int)i)->valueint;
        CHECK(same, "%s %s: prompt ids differ", label, name);
        collect g = {0};
        rc = loom_generate(m, ids, (int32_t)n, 16, &greedy, on_token, &g, NULL, err, sizeof err);
        CHECK(rc == 0, "%s %s: %s", label, name, err);
        /* logits of the last prompt position against the float64 reference */
        cJSON *ll = cJSON_GetObjectItem(cs, "last_logits");
        snprintf(path, sizeof path, "%s/stories260K/%s", dir,
                 cJSON_GetObjectItem(ll, "file")->valuestring);
        size_t bytes;
        float *ref = (float *)slurp(path, &bytes);
        double worst = 0;
        const float *got = loom_prompt_logits(m);
        for (size_t i = 0; ref && i < bytes / 4; i++)
            worst = fmax(worst, fabs((double)got[i] - ref[i]));
        CHECK(ref && bytes / 4 == (size_t)loom_model_n_vocab(m) && worst <= 5e-4,
              "%s %s: logits differ from the reference by %g (> 5e-4)", label, name, worst);
        free(ref);
        cJSON *gids = cJSON_GetObjectItem(cJSON_GetObjectItem(cs, "greedy"), "ids");
        same = g.n == cJSON_GetArraySize(gids);
        for (int i = 0; same && i < g.n; i++)
            same = g.ids[i] == cJSON_GetArrayItem(gids, i)->valueint;
        CHECK(same, "%s %s: greedy tokens differ (%d generated)", label, name, g.n);
    }
    cJSON_Delete(root);
    free(json);
    loom_model_close(m);
}

static void test_errors(void)
{
    char gguf[4200];
    snprintf(gguf, sizeof gguf, "%s/stories260K/original/stories260K.gguf", dir);
    loom_model_options o = {.n_ctx = 8, .kv_type = "f32"};
    loom_model *m = loom_model_open(gguf, &o, err, sizeof err);
    CHECK(m != NULL, "open: %s", err);
    if (m) {
        int32_t ids[16];
        int64_t n = loom_tokenize(m, "Once upon a time there was a girl", 1, 1, ids, 16, err,
                                  sizeof err);
        loom_sampling s = loom_sampling_defaults();
        CHECK(loom_generate(m, ids, (int32_t)n, 4, &s, NULL, NULL, NULL, err, sizeof err) != 0 &&
                  strstr(err, "context holds 8"),
              "a prompt longer than the context names both numbers: %s", err);
        loom_model_close(m);
    }
    o.kv_type = "f8";
    CHECK(!loom_model_open(gguf, &o, err, sizeof err) && strstr(err, "'f8'"), "bad kv type: %s",
          err);
    o.kv_type = NULL;
    o.backend = "nosuch";
    CHECK(!loom_model_open(gguf, &o, err, sizeof err) && strstr(err, "no backend named 'nosuch'"),
          "bad backend: %s", err);
    o.backend = NULL;
    CHECK(!loom_model_open("/nonexistent.gguf", &o, err, sizeof err) && strstr(err, "No such file"),
          "missing file: %s", err);
}

int main(void)
{
    snprintf(dir, sizeof dir, "%s", fixtures_dir());
    char probe[4200];
    snprintf(probe, sizeof probe, "%s/stories260K/original/stories260K.gguf", dir);
    need_fixture(probe);
    unsetenv("LOOM_BACKEND");
    static char backends[MAX_TEST_BACKENDS][160];
    int n_backends = usable_backends(backends, MAX_TEST_BACKENDS);
    if (n_backends < 0)
        return 1;
    for (int i = 0; i < n_backends; i++) {
        const char *label = backends[i];
        run_backend(label, label);
    }
    setenv("LOOM_REF_OPAQUE", "1", 1);
    run_backend("ref", "ref (opaque buffers)");
    unsetenv("LOOM_REF_OPAQUE");
    test_errors();
    return check_finish("test_models");
}
