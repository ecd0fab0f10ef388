/*
 * tests/fixture_model.h - one model judged against a Hugging Face fixture's expected.json: for
 * every case, loom's tokenizer must give the fixture's prompt ids, the last prompt position's
 * logits must lie within a tolerance of the reference's (PyTorch's, or its quantised-weights
 * reference), the top token must agree (unless the reference's own margin is below the error),
 * and optionally the greedy tokens must be the fixture's.
 */
#ifndef LOOM_TESTS_FIXTURE_MODEL_H
#define LOOM_TESTS_FIXTURE_MODEL_H

#include <loom/loom.h>

#include "check.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

/* loom verify's problems with the file at path, each printed (0: it passes), or -1 when it
 * could not be read at all. */
static int verify_problem_count;
static inline void count_verify_problem(void *user, const char *check, loom_check_status status,
                                        const char *msg)
{
    (void)user;
    if (status == LOOM_CHECK_PROBLEM) {
        verify_problem_count++;
        fprintf(stderr, "verify: %s: %s\n", check, msg);
    }
}
static inline int verify_problems(const char *path)
{
    verify_problem_count = 0;
    int rc = loom_verify(path, count_verify_problem, NULL);
    return rc != 0 && !verify_problem_count ? -1 : verify_problem_count + (rc != 0);
}

typedef struct collect {
    int32_t ids[64];
    int n;
} collect;

static inline int on_token(void *user, int32_t id, const char *text, size_t len)
{
    (void)text, (void)len;
    collect *c = user;
    if (id >= 0 && c->n < 64)
        c->ids[c->n++] = id;
    return 0;
}

/* Runs every case of fixtures/fixture on model path with backend, checking logits within tol of
 * logits_file_key ("last_logits" or a quantized reference) and, when greedy, the tokens. */
static inline void check_model(const char *fixtures, const char *fixture, const char *path,
                               const char *backend, const char *logits_of, double tol,
                               int greedy_too, const char *what)
{
    char err[4096];
    loom_model_options o = {.backend = backend, .kv_type = "f32", .n_ctx = 256};
    loom_model *m = loom_model_open(path, &o, err, sizeof err);
    CHECK(m != NULL, "%s on %s: %s", what, backend, err);
    if (!m)
        return;
    char p[4200];
    snprintf(p, sizeof p, "%s/%s/expected.json", fixtures, fixture);
    char *json = slurp(p, NULL);
    cJSON *root = cJSON_Parse(json), *cs;
    loom_sampling g = loom_sampling_defaults();
    g.temperature = 0;
    g.ignore_eos = 1;
    cJSON_ArrayForEach (cs, cJSON_GetObjectItem(root, "cases")) {
        const char *name = cJSON_GetObjectItem(cs, "name")->valuestring;
        cJSON *ref_logits = strcmp(logits_of, "last_logits") == 0
            ? cJSON_GetObjectItem(cs, "last_logits")
            : cJSON_GetObjectItem(
                  cJSON_GetObjectItem(cJSON_GetObjectItem(cs, "quantized_weights_reference"),
                                      logits_of),
                  "last_logits");
        if (!ref_logits)
            continue; /* quantised references exist for the plain case only */
        /* the prompt as loom's tokenizer encodes the text, which must give the fixture's ids */
        cJSON *pids = cJSON_GetObjectItem(cs, "prompt_ids");
        cJSON *text = cJSON_GetObjectItem(cs, "text");
        int special = LOOM_SPECIAL_TEXT; /* a user's text, or a chat template's output */
        if (!cJSON_IsString(text))
            text = cJSON_GetObjectItem(cs, "rendered_prompt"), special = LOOM_SPECIAL_ALL;
        int32_t ids[512];
        int n = (int)loom_tokenize(m, text->valuestring, 1, special, ids, 512, err, sizeof err);
        int same_ids = n == cJSON_GetArraySize(pids);
        for (int i = 0; same_ids && i < n; i++)
            same_ids = ids[i] == cJSON_GetArrayItem(pids, i)->valueint;
        CHECK(same_ids, "%s, %s: prompt ids differ from the fixture's", what, name);
        collect c = {{0}, 0};
        int rc = loom_generate(m, ids, n, 16, &g, on_token, &c, NULL, err, sizeof err);
        CHECK(rc == 0, "%s %s: %s", what, name, err);
        snprintf(p, sizeof p, "%s/%s/%s", fixtures, fixture,
                 cJSON_GetObjectItem(ref_logits, "file")->valuestring);
        size_t bytes;
        float *ref = (float *)slurp(p, &bytes);
        const float *got = loom_prompt_logits(m);
        double worst = 0;
        for (size_t i = 0; ref && i < bytes / 4; i++)
            worst = fmax(worst, fabs((double)got[i] - ref[i]));
        CHECK(ref && worst <= tol, "%s on %s, %s: logits off by %g (> %g)", what, backend, name,
              worst, tol);
        cJSON *top5 = strcmp(logits_of, "last_logits") == 0
            ? cJSON_GetObjectItem(cs, "top5")
            : cJSON_GetObjectItem(
                  cJSON_GetObjectItem(cJSON_GetObjectItem(cs, "quantized_weights_reference"),
                                      logits_of),
                  "top5");
        int best = 0;
        for (int i = 1; i < loom_model_n_vocab(m); i++)
            if (got[i] > got[best])
                best = i;
        /* the top token must agree, unless the reference's own margin between its first two
         * is smaller than this run's logit error (then either may legitimately win) */
        double margin = top5
            ? cJSON_GetObjectItem(cJSON_GetArrayItem(top5, 0), "logit")->valuedouble -
                cJSON_GetObjectItem(cJSON_GetArrayItem(top5, 1), "logit")->valuedouble
            : 0;
        CHECK(top5 &&
                  (best == cJSON_GetObjectItem(cJSON_GetArrayItem(top5, 0), "id")->valueint ||
                   margin < worst),
              "%s on %s, %s: top-1 token %d differs from the reference's (margin %g, error %g)",
              what, backend, name, best, margin, worst);
        free(ref);
        if (greedy_too) {
            /* up to the reference's first placeholder id (a random model's padding rows win
             * now and then in PyTorch): loom never generates those, and differs from there */
            cJSON *gids = cJSON_GetObjectItem(cJSON_GetObjectItem(cs, "greedy"), "ids");
            int n_ref = cJSON_GetArraySize(gids), cut = n_ref;
            for (int i = 0; i < n_ref && cut == n_ref; i++)
                if (loom_model_token_unused(m, cJSON_GetArrayItem(gids, i)->valueint))
                    cut = i;
            int same = cut < n_ref ? c.n >= cut : c.n == n_ref;
            for (int i = 0; same && i < cut; i++)
                same = c.ids[i] == cJSON_GetArrayItem(gids, i)->valueint;
            if (cut < n_ref && same && c.n > cut)
                same = !loom_model_token_unused(m, c.ids[cut]);
            CHECK(same, "%s on %s, %s: greedy tokens differ%s", what, backend, name,
                  cut < n_ref ? " (before the reference's first placeholder id)" : "");
        }
    }
    cJSON_Delete(root);
    free(json);
    loom_model_close(m);
}

#endif
