/*
 * tests/test_speculative.c - speculative decoding (loom_generate_speculative, issue 43):
 *   - the acceptance rule alone (loom_sampler_verify): for random distributions p and q, a
 *     proposal drawn from q (or fixed, as prompt lookup's) and checked by the rule comes out
 *     distributed as p (a chi-square test over 200,000 draws); two wrong rules, "keep every
 *     proposal p allows" and "on rejection draw from p", must fail the same test;
 *   - greedy exactness: on every usable backend, loom's synthetic tiny model and (fixtures)
 *     those of each family (a real trained Llama, Llama, Qwen2, ChatGLM3, Llama 3.1 as
 *     llama.cpp converted it, Qwen2-MoE, Mistral's sliding window), the ids with each drafter (the model's first layer, prompt
 *     lookup, a second copy of the model) are the ids without one, and proposals were made and
 *     some accepted;
 *   - sampling: on stories260K at temperature 1, the distribution of the second and third
 *     tokens over 1,500 seeds with a drafter equals the one without (a two-sample chi-square).
 */
#define _GNU_SOURCE
#include "core/sampler.h"

#include "backends.h"
#include "check.h"
#include "hf_writer.h"

#include <loom/loom.h>

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char dir[4096], tmp[] = "/tmp/loom-speculative-XXXXXX", err[4096];

/* The chi-square bound a statistic of df degrees of freedom passes with probability 1 - 1e-4
 * (Wilson-Hilferty's cube-root normal approximation, z = 3.719). */
static double chi2_bound(int df)
{
    double a = 2.0 / (9.0 * df);
    return df * pow(1 - a + 3.719 * sqrt(a), 3);
}

/* ---- The rule alone -------------------------------------------------------------------- */

typedef int32_t (*rule_fn)(float *p, const float *q, int32_t d, int32_t n, uint64_t *a,
                           uint64_t *r);

/* wrong: keeps any proposal the model allows at all */
static int32_t keep_allowed(float *p, const float *q, int32_t d, int32_t n, uint64_t *a,
                            uint64_t *r)
{
    (void)q, (void)a;
    return p[d] > 0 ? d : loom_sampler_draw(p, n, r);
}

/* wrong: the right test, but a rejected proposal is replaced by a draw from p itself */
static int32_t redraw_from_p(float *p, const float *q, int32_t d, int32_t n, uint64_t *a,
                             uint64_t *r)
{
    double qd = q ? q[d] : 1.0;
    if (qd > 0 && loom_sampler_uniform(a) < p[d] / qd)
        return d;
    return loom_sampler_draw(p, n, r);
}

/* The chi-square statistic of rule's output against p, over draws proposals from q (NULL:
 * always the id fixed) */
static double rule_statistic(rule_fn rule, const float *p, const float *q, int32_t fixed, int n,
                             int draws, uint64_t seed)
{
    double count[16] = {0};
    float work[16];
    uint64_t qr = seed, ar = seed ^ 1, rr = seed ^ 2;
    for (int i = 0; i < draws; i++) {
        int32_t d = q ? loom_sampler_draw(q, n, &qr) : fixed;
        memcpy(work, p, (size_t)n * sizeof *work);
        int32_t t = rule(work, q, d, n, &ar, &rr);
        if (t >= 0 && t < n)
            count[t]++;
    }
    double x2 = 0;
    for (int i = 0; i < n; i++) {
        double want = draws * (double)p[i];
        if (want > 0)
            x2 += (count[i] - want) * (count[i] - want) / want;
        else if (count[i] > 0)
            x2 += 1e9; /* drew an id p does not allow */
    }
    return x2;
}

static void test_rule(void)
{
    enum { N = 8, DRAWS = 200000 };
    uint64_t g = 42;
    for (int trial = 0; trial < 6; trial++) {
        float p[N], q[N];
        double sp = 0, sq = 0;
        for (int i = 0; i < N; i++) {
            p[i] = (float)loom_sampler_uniform(&g), q[i] = (float)loom_sampler_uniform(&g);
            /* truncation leaves zeros on both sides, not always at the same ids */
            if (i == trial % N)
                p[i] = 0;
            if (i == (trial + 3) % N)
                q[i] = 0;
            sp += p[i], sq += q[i];
        }
        for (int i = 0; i < N; i++)
            p[i] = (float)(p[i] / sp), q[i] = (float)(q[i] / sq);
        const float *qs[2] = {q, NULL}; /* a drafter model's proposals, and lookup's */
        for (int k = 0; k < 2; k++) {
            const char *how = k ? "a fixed proposal" : "proposals drawn from q";
            int32_t fixed = (trial + 5) % N; /* an id p allows */
            double right = rule_statistic(loom_sampler_verify, p, qs[k], fixed, N, DRAWS,
                                          7 + trial);
            double allowed = rule_statistic(keep_allowed, p, qs[k], fixed, N, DRAWS, 7 + trial);
            double redraw = rule_statistic(redraw_from_p, p, qs[k], fixed, N, DRAWS, 7 + trial);
            double bound = chi2_bound(N - 2); /* one id of p is zero */
            CHECK(right < bound, "trial %d, %s: the rule's output is not p: chi2 %.1f >= %.1f",
                  trial, how, right, bound);
            CHECK(allowed > bound, "trial %d, %s: 'keep what p allows' passed: chi2 %.1f", trial,
                  how, allowed);
            CHECK(redraw > bound, "trial %d, %s: 'redraw from p' passed: chi2 %.1f", trial, how,
                  redraw);
        }
    }
}

/* ---- Greedy exactness ------------------------------------------------------------------ */

/* The generated ids (a loom_token_fn's user) */
typedef struct ids {
    int32_t v[64];
    int n;
} ids;

static int collect(void *user, int32_t id, const char *text, size_t len)
{
    (void)text, (void)len;
    ids *c = user;
    if (id >= 0 && c->n < 64)
        c->v[c->n++] = id;
    return 0;
}

/* A prompt from a fixture's expected.json (its shortest case of 8 ids or more: the prompt is run four times a
 * backend), with its first 12 ids again at the end, so that prompt lookup finds something to
 * propose. */
static int fixture_prompt(const char *fixture, int32_t *out, int cap)
{
    char path[4300];
    snprintf(path, sizeof path, "%s/%s/expected.json", dir, fixture);
    char *text = slurp(path, NULL);
    cJSON *root = text ? cJSON_Parse(text) : NULL, *cs, *best = NULL;
    cJSON_ArrayForEach (cs, cJSON_GetObjectItem(root, "cases"))
        if (cJSON_GetArraySize(cJSON_GetObjectItem(cs, "prompt_ids")) >= 8 &&
            (!best ||
             cJSON_GetArraySize(cJSON_GetObjectItem(cs, "prompt_ids")) <
                 cJSON_GetArraySize(cJSON_GetObjectItem(best, "prompt_ids"))))
            best = cs;
    int n = 0;
    cJSON *id;
    cJSON_ArrayForEach (id, cJSON_GetObjectItem(best, "prompt_ids"))
        if (n < cap - 12)
            out[n++] = (int32_t)id->valuedouble;
    for (int i = 0; i < 12 && i < n; i++)
        out[n + i] = out[i];
    n = n >= 12 ? n + 12 : n;
    cJSON_Delete(root);
    free(text);
    return n;
}

static void greedy_case(const char *what, const char *path, const char *backend,
                        const int32_t *prompt, int n_prompt, int64_t *drafted, int64_t *accepted)
{
    loom_model_options o = {.backend = backend, .n_ctx = 256};
    loom_model *m = loom_model_open(path, &o, err, sizeof err);
    CHECK(m != NULL, "%s on %s: %s", what, backend, err);
    if (!m)
        return;
    loom_sampling s = loom_sampling_defaults();
    s.temperature = 0;
    s.ignore_eos = 1;
    /* ref, the slowest, runs fewer (still several rounds of proposals) */
    int n_gen = strcmp(backend, "ref") == 0 ? 16 : 32;
    ids plain = {0};
    loom_generation st;
    CHECK(loom_generate_speculative(m, NULL, prompt, n_prompt, 0, n_gen, &s, collect, &plain, &st,
                                    err, sizeof err) == 0,
          "%s on %s: %s", what, backend, err);
    /* the drafters: the model's first layer, prompt lookup, the same model opened again */
    loom_model_options first = o, again = o;
    first.first_layers = 1;
    loom_model *shallow = loom_model_open(path, &first, err, sizeof err);
    CHECK(shallow != NULL, "%s's first layer on %s: %s", what, backend, err);
    loom_model *copy = loom_model_open(path, &again, err, sizeof err);
    CHECK(copy != NULL, "%s again on %s: %s", what, backend, err);
    const loom_speculation specs[] = {
        {.draft = shallow, .draft_max = 4, .fixed = 1},
        {.lookup = 3, .draft_max = 6, .fixed = 1},
        {.draft = copy, .draft_max = 5, .fixed = 1},
    };
    const char *names[] = {"first layer", "lookup", "the model itself"};
    for (int k = 0; k < 3; k++) {
        if (k != 1 && !specs[k].draft)
            continue;
        ids got = {0};
        int rc = loom_generate_speculative(m, &specs[k], prompt, n_prompt, 0, n_gen, &s, collect,
                                           &got, &st, err, sizeof err);
        CHECK(rc == 0, "%s on %s, drafter %s: %s", what, backend, names[k], err);
        int same = got.n == plain.n && memcmp(got.v, plain.v, sizeof(int32_t) * plain.n) == 0;
        int at = 0;
        while (at < got.n && at < plain.n && got.v[at] == plain.v[at])
            at++;
        CHECK(rc != 0 || same,
              "%s on %s, drafter %s: greedy ids differ from plain decoding at %d (of %d): %d vs "
              "%d",
              what, backend, names[k], at, plain.n, at < got.n ? got.v[at] : -1,
              at < plain.n ? plain.v[at] : -1);
        /* lookup proposes only where the text repeats itself: counted over all below */
        CHECK(rc != 0 || k == 1 || st.n_drafted > 0, "%s on %s, drafter %s proposed nothing", what,
              backend, names[k]);
        /* the model is its own perfect drafter */
        CHECK(k != 2 || st.n_accepted * 10 >= st.n_drafted * 9,
              "%s on %s: drafting for itself, only %d of %d accepted", what, backend, st.n_accepted,
              st.n_drafted);
        drafted[k] += st.n_drafted, accepted[k] += st.n_accepted;
    }
    loom_model_close(copy);
    loom_model_close(shallow);
    loom_model_close(m);
}

/* the families' fixtures test_greedy runs besides loom's synthetic model */
static const char *const fixture_models[] = {"stories260K/original/stories260K.gguf",
                                             "tiny-llama/model.safetensors",
                                             "tiny-qwen2/model.safetensors",
                                             "tiny-chatglm3/model.safetensors",
                                             "tiny-llama31/model.gguf",
                                             "tiny-qwen2moe/model.gguf",
                                             "tiny-mistral/model.safetensors"};

static void test_greedy(void)
{
    static char backends[MAX_TEST_BACKENDS][160];
    int n_backends = usable_backends(backends, MAX_TEST_BACKENDS);
    CHECK(n_backends > 0, "no usable backend");
    int64_t drafted[3] = {0}, accepted[3] = {0};
    /* loom's synthetic tiny-next model, which needs no fixture: its greedy next token is the
     * current one's successor (piece t -> t + 1). The prompt ends on 300, and holds 300 301 ...
     * 306 then 7 earlier: prompt lookup proposes 302 ... 306 (kept) and 7 (refused). */
    char tiny[4300];
    snprintf(tiny, sizeof tiny, "%s/tiny-next.gguf", tmp);
    CHECK(loom_write_synthetic_model(tiny, "tiny-next", "f32", err, sizeof err) == 0,
          "writing the synthetic tiny-next model: %s", err);
    const int32_t chain[] = {1, 420, 421, 300, 301, 302, 303, 304, 305, 306, 7, 450, 451, 452, 300};
    for (int b = 0; b < n_backends; b++)
        greedy_case("loom's synthetic tiny-next", tiny, backends[b], chain,
                    (int)(sizeof chain / sizeof *chain), drafted, accepted);
    unlink(tiny);
    if (!have_fixtures(dir, fixture_models, sizeof fixture_models / sizeof *fixture_models))
        goto counted;
    /* Mistral's folder, with the tokenizer its fixture links to */
    static const char *const files[] = {"config.json", "generation_config.json",
                                        "model.safetensors", "tokenizer_config.json",
                                        "tokenizer.model"};
    static const char *const shared[] = {"tiny-llama/tokenizer.model"};
    char mistral[4200];
    snprintf(mistral, sizeof mistral, "%s/tiny-mistral", tmp);
    CHECK(fixture_folder(dir, mistral, "tiny-mistral", files, 5, shared, 1) == 0,
          "making the Mistral folder");
    struct {
        const char *what, *fixture, *file; /* file: in the fixture's folder; NULL: the folder */
    } models[] = {
        {"stories260K (GGUF)", "stories260K", "original/stories260K.gguf"},
        {"tiny-llama", "tiny-llama", NULL},
        {"tiny-qwen2", "tiny-qwen2", NULL},
        {"tiny-chatglm3", "tiny-chatglm3", NULL},
        {"tiny-llama31 (llama.cpp's GGUF)", "tiny-llama31", "model.gguf"},
        {"tiny-qwen2moe (llama.cpp's GGUF)", "tiny-qwen2moe", "model.gguf"},
        {"tiny-mistral (window 8)", "tiny-mistral", ""},
    };
    for (size_t i = 0; i < sizeof models / sizeof models[0]; i++) {
        char path[4300];
        if (models[i].file && !*models[i].file)
            snprintf(path, sizeof path, "%s", mistral);
        else if (models[i].file)
            snprintf(path, sizeof path, "%s/%s/%s", dir, models[i].fixture, models[i].file);
        else
            snprintf(path, sizeof path, "%s/%s", dir, models[i].fixture);
        /* a folder converted once: opening it converts it again each time */
        char gguf[4300];
        snprintf(gguf, sizeof gguf, "%s/%s.gguf", tmp, models[i].fixture);
        if (!models[i].file || !*models[i].file) {
            CHECK(loom_convert(path, gguf, "auto", NULL, NULL, err, sizeof err) == 0,
                  "converting %s: %s", path, err);
            snprintf(path, sizeof path, "%s", gguf);
        }
        int32_t prompt[160];
        int n = fixture_prompt(models[i].fixture, prompt, 160);
        CHECK(n > 12, "%s: no prompt in expected.json", models[i].what);
        for (int b = 0; b < n_backends && n > 12; b++)
            greedy_case(models[i].what, path, backends[b], prompt, n, drafted, accepted);
        unlink(gguf);
    }
    remove_folder(mistral);
counted:
    /* the tiny random models' first layers rarely agree with the whole; lookup and the copy
     * must have had proposals accepted, so both branches of the check ran */
    printf("greedy: first layer %lld of %lld accepted, lookup %lld of %lld, the copy %lld of "
           "%lld\n",
           (long long)accepted[0], (long long)drafted[0], (long long)accepted[1],
           (long long)drafted[1], (long long)accepted[2], (long long)drafted[2]);
    CHECK(accepted[1] > 0 && accepted[1] < drafted[1],
          "lookup: %lld of %lld accepted: both accepting and rejecting should have happened",
          (long long)accepted[1], (long long)drafted[1]);
}

/* ---- Sampling keeps the model's distribution ------------------------------------------- */

/* Counts of the tokens at positions 1 and 2 (the second and third: the first comes from the
 * prompt's pass, before any proposal) of generations with seeds 1..runs into count[0] and
 * count[1] (n_vocab each). */
static void sample_counts(loom_model *m, const loom_speculation *spec, const int32_t *prompt,
                          int n_prompt, int runs, double *count[2], int32_t *drafted,
                          int32_t *accepted)
{
    loom_sampling s = loom_sampling_defaults();
    s.temperature = 1.0f, s.top_k = 0, s.top_p = 1.0f, s.min_p = 0.0f;
    s.ignore_eos = 1;
    for (int r = 0; r < runs; r++) {
        s.seed = (uint64_t)r + 1;
        ids got = {0};
        loom_generation st;
        if (loom_generate_speculative(m, spec, prompt, n_prompt, 0, 5, &s, collect, &got, &st, err,
                                      sizeof err) != 0) {
            CHECK(0, "sampling with seed %d: %s", r + 1, err);
            return;
        }
        for (int at = 1; at <= 2 && at < got.n; at++)
            count[at - 1][got.v[at]]++;
        *drafted += st.n_drafted, *accepted += st.n_accepted;
    }
}

/* Two samples' chi-square over the ids both saw at least 10 times together (the rest pooled). */
static double two_sample_chi2(const double *a, const double *b, int n, int *df)
{
    double ta = 0, tb = 0, x2 = 0, pool_a = 0, pool_b = 0;
    for (int i = 0; i < n; i++)
        ta += a[i], tb += b[i];
    int bins = 0;
    for (int i = 0; i <= n; i++) {
        double x = i < n ? a[i] : pool_a, y = i < n ? b[i] : pool_b;
        if (i < n && x + y < 10) {
            pool_a += x, pool_b += y;
            continue;
        }
        if (x + y == 0)
            continue;
        double ka = sqrt(tb / ta), kb = sqrt(ta / tb);
        x2 += (ka * x - kb * y) * (ka * x - kb * y) / (x + y);
        bins++;
    }
    *df = bins - 1;
    return x2;
}

static void test_sampling(void)
{
    char path[4300];
    snprintf(path, sizeof path, "%s/stories260K/original/stories260K.gguf", dir);
    loom_model_options o = {.n_ctx = 128}; /* the best backend: the distribution is the rule's */
    loom_model *m = loom_model_open(path, &o, err, sizeof err);
    loom_model_options first = o;
    first.first_layers = 2;
    loom_model *shallow = m ? loom_model_open(path, &first, err, sizeof err) : NULL;
    CHECK(m && shallow, "stories260K: %s", err);
    if (!m || !shallow) {
        loom_model_close(m);
        return;
    }
    int32_t prompt[64];
    int64_t n = loom_tokenize(m, "Once upon a time, there was a little girl named Lily. She", 1,
                              LOOM_SPECIAL_TEXT, prompt, 64, err, sizeof err);
    CHECK(n > 4 && n <= 64, "tokenizing: %s", err);
    int nv = loom_model_n_vocab(m);
    double *plain[2], *spec[2];
    for (int i = 0; i < 2; i++)
        plain[i] = calloc((size_t)nv, sizeof(double)), spec[i] = calloc((size_t)nv, sizeof(double));
    const int runs = 1500;
    /* the first layers propose with their own distribution, q != p: both the kept and the
     * redrawn branch run */
    loom_speculation sp = {.draft = shallow, .draft_max = 3, .fixed = 1};
    int32_t drafted = 0, accepted = 0, none = 0;
    sample_counts(m, NULL, prompt, (int)n, runs, plain, &none, &none);
    sample_counts(m, &sp, prompt, (int)n, runs, spec, &drafted, &accepted);
    printf("sampling: %d of %d proposals kept\n", accepted, drafted);
    CHECK(accepted > 0 && accepted < drafted, "%d of %d proposals kept: both branches should run",
          accepted, drafted);
    for (int at = 0; at < 2; at++) {
        int df;
        double x2 = two_sample_chi2(plain[at], spec[at], nv, &df);
        printf("sampling: token %d over %d seeds: chi2 %.1f with %d degrees of freedom (bound "
               "%.1f)\n",
               at + 2, runs, x2, df, chi2_bound(df));
        CHECK(df >= 5, "token %d: too few distinct tokens (%d bins) to judge", at + 2, df + 1);
        CHECK(x2 < chi2_bound(df),
              "token %d: sampled with a drafter it is not distributed as without: chi2 %.1f, "
              "df %d",
              at + 2, x2, df);
    }
    for (int i = 0; i < 2; i++)
        free(plain[i]), free(spec[i]);
    loom_model_close(shallow);
    loom_model_close(m);
}

int main(void)
{
    test_rule();
    snprintf(dir, sizeof dir, "%s", fixtures_dir());
    unsetenv("LOOM_BACKEND");
    if (!mkdtemp(tmp))
        return 1;
    test_greedy();
    static const char *const stories[] = {"stories260K/original/stories260K.gguf"};
    if (have_fixtures(dir, stories, 1))
        test_sampling();
    rmdir(tmp);
    return check_finish("test_speculative");
}
