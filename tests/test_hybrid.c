#define _GNU_SOURCE
/*
 * tests/test_hybrid.c - Qwen3.5's hybrid layers (Gated DeltaNet beside gated attention) against
 * PyTorch, through the fixture tiny-qwen35 (expected.json, from Hugging Face's modelling code in
 * float64), on every usable backend:
 *   - llama.cpp's own GGUF of it: each case's last prompt logits within 1e-3, and the 16 greedy
 *     tokens (the fixture's feature_off table: with the recurrent state reset per token the
 *     logits move by 6.9, without the conv by 3.4, without the output gate by 0.63);
 *   - the same with each prompt's first 7 tokens run first and the rest after, so the state
 *     crosses steps;
 *   - the serving engine: the four cases at once and again through two state slots (queued,
 *     each slot reused by the next request, one cancelled mid-answer) give each case's greedy
 *     tokens, as alone; the longest case once more resumes from the snapshot of its state at
 *     its prompt's last block boundary (its cached tokens say so) with the same answer;
 *   - speculative decoding with tiny-qwen2 (same vocabulary, other weights) as the drafter, in
 *     loom_generate and in the engine: its proposals are nearly all rejected, and each time the
 *     state goes back to its checkpoint, so the answers are the plain greedy ones (without the
 *     rollback the runner refuses the next step; tested by switching it off);
 *   - a cached prefix the state has not seen (a chat turn that re-rendered its history) is
 *     recomputed from the start rather than run on the wrong state;
 *   - with no fixtures at all, loom's synthetic hybrid-tiny (f32): every backend's prompt
 *     logits within 1e-4 of ref's and its greedy tokens, and the engine's 6 requests over 2
 *     state slots each equal to its lone run;
 *   - the Hugging Face folder (Qwen3_5ForCausalLM, bf16), opened as it is and converted by
 *     `loom convert` (f32: the same logits within 1e-3 and the greedy tokens; without the +1 of
 *     the zero-centred norms or the -exp of A_log they move by 7.0 and more): loom's file has
 *     every tensor of llama.cpp's but the prediction head, shaped alike, the same hyper-
 *     parameters, verifies as whole, and `loom quantize` keeps its conv1d in f32; the same
 *     weights as a multimodal checkpoint (Qwen3_5ForConditionalGeneration: model.language_model,
 *     text_config, a vision tower left out) convert to the same model.
 */
#include "core/gguf.h"

#include "backends.h"
#include "fixture_model.h"
#include "hf_writer.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char dir[4096], model[4300], err[4096];

typedef struct fixture_case {
    int32_t prompt[256], greedy[16];
    int n_prompt;
} fixture_case;
static fixture_case cases[8];
static int n_cases;

static void read_cases(void)
{
    char path[4300];
    snprintf(path, sizeof path, "%s/tiny-qwen35/expected.json", dir);
    char *json = slurp(path, NULL);
    cJSON *root = cJSON_Parse(json), *cs;
    cJSON_ArrayForEach (cs, cJSON_GetObjectItem(root, "cases")) {
        fixture_case *c = &cases[n_cases++];
        cJSON *ids = cJSON_GetObjectItem(cs, "prompt_ids"), *id;
        cJSON_ArrayForEach (id, ids)
            if (c->n_prompt < 256)
                c->prompt[c->n_prompt++] = id->valueint;
        int i = 0;
        cJSON_ArrayForEach (id, cJSON_GetObjectItem(cJSON_GetObjectItem(cs, "greedy"), "ids"))
            if (i < 16)
                c->greedy[i++] = id->valueint;
        if (n_cases == 8)
            break;
    }
    cJSON_Delete(root);
    free(json);
    CHECK(n_cases == 4, "the fixture has %d cases, not 4", n_cases);
}

static int same_greedy(const collect *c, const fixture_case *fc)
{
    if (c->n != 16)
        return 0;
    for (int i = 0; i < 16; i++)
        if (c->ids[i] != fc->greedy[i])
            return 0;
    return 1;
}

/* Each case in two calls: its first 7 tokens, then the rest with those 7 cached, so the state
 * carries over from one step to the next. */
static void test_chunked(const char *backend)
{
    loom_model_options o = {.backend = backend, .n_ctx = 256};
    loom_model *m = loom_model_open(model, &o, err, sizeof err);
    CHECK(m != NULL, "chunked prefill on %s: %s", backend, err);
    if (!m)
        return;
    loom_sampling g = loom_sampling_defaults();
    g.temperature = 0, g.ignore_eos = 1;
    for (int i = 0; i < n_cases; i++) {
        collect first = {{0}, 0}, c = {{0}, 0};
        loom_generation st = {0};
        int rc = loom_generate(m, cases[i].prompt, 7, 1, &g, on_token, &first, NULL, err,
                               sizeof err);
        rc = rc ? rc
                : loom_generate_speculative(m, NULL, cases[i].prompt, cases[i].n_prompt, 7, 16, &g,
                                            on_token, &c, &st, err, sizeof err);
        CHECK(rc == 0 && same_greedy(&c, &cases[i]),
              "case %d, its first 7 tokens run before the rest, on %s: %s", i, backend,
              rc ? err : "other greedy tokens");
    }
    /* a cached prefix the state has not reached (as a chat turn that re-rendered its history
     * would pass): recomputed from the start, the same answer */
    collect c = {{0}, 0};
    int rc = loom_generate_speculative(m, NULL, cases[0].prompt, cases[0].n_prompt, 5, 16, &g,
                                       on_token, &c, NULL, err, sizeof err);
    CHECK(rc == 0 && same_greedy(&c, &cases[0]),
          "a cached prefix of 5 the state never saw, on %s: %s", backend,
          rc ? err : "other greedy tokens");
    loom_model_close(m);
}

/* ---- the Hugging Face form ------------------------------------------------------------ */

static char tmp[] = "/tmp/loom-hybrid-XXXXXX";

/* loom's conversion has llama.cpp's tensors (the MTP block's too) and hyper-parameters. */
static void same_as_peer(const char *ours_path)
{
    loom_gguf peer, ours;
    if (loom_gguf_open(&peer, model, err, sizeof err) != 0 ||
        loom_gguf_open(&ours, ours_path, err, sizeof err) != 0) {
        CHECK(0, "opening the files: %s", err);
        return;
    }
    int compared = 0;
    for (uint64_t i = 0; i < peer.n_tensors; i++) {
        const loom_gguf_tensor *p = &peer.tensors[i], *o = loom_gguf_find_tensor(&ours, p->name);
        compared++;
        CHECK(o && o->n_dims == p->n_dims && !memcmp(o->ne, p->ne, sizeof o->ne),
              "llama.cpp's %s is missing or shaped otherwise in loom's conversion", p->name);
    }
    CHECK(compared == (int)ours.n_tensors, "loom's file has %llu tensors, llama.cpp's %d",
          (unsigned long long)ours.n_tensors, compared);
    static const char *const keys[] = {
        "embedding_length",        "feed_forward_length",  "attention.head_count",
        "attention.head_count_kv", "attention.key_length", "attention.value_length",
        "rope.dimension_count",    "ssm.conv_kernel",      "ssm.state_size",
        "ssm.group_count",         "ssm.time_step_rank",   "ssm.inner_size",
        "full_attention_interval", "block_count",          "nextn_predict_layers"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        char key[128];
        int64_t a = -1, b = -2;
        snprintf(key, sizeof key, "qwen35.%s", keys[i]);
        loom_gguf_get_i64(&peer, key, &a);
        loom_gguf_get_i64(&ours, key, &b);
        CHECK(a == b, "%s is %lld in llama.cpp's file, %lld in loom's", key, (long long)a,
              (long long)b);
    }
    /* the multimodal RoPE's sections, an array */
    const loom_gguf_kv *ps = loom_gguf_find(&peer, "qwen35.rope.dimension_sections"),
                       *os = loom_gguf_find(&ours, "qwen35.rope.dimension_sections");
    int same = ps && os && ps->count == os->count;
    for (uint64_t i = 0; same && i < ps->count; i++) {
        double a = -1, b = -2;
        loom_gguf_array_f64(&peer, ps, i, &a);
        loom_gguf_array_f64(&ours, os, i, &b);
        same = a == b;
    }
    CHECK(same, "rope.dimension_sections differ between llama.cpp's file and loom's");
    loom_gguf_close(&peer);
    loom_gguf_close(&ours);
}

static void test_folder(void)
{
    static const char *const files[] = {"config.json",       "generation_config.json",
                                        "model.safetensors", "tokenizer_config.json",
                                        "merges.txt",        "vocab.json"};
    static const char *const shared[] = {"tiny-qwen2/merges.txt", "tiny-qwen2/vocab.json"};
    char folder[4200], f32[4200], q8[4200];
    snprintf(folder, sizeof folder, "%s/tiny-qwen35", tmp);
    snprintf(f32, sizeof f32, "%s/tiny-qwen35-f32.gguf", tmp);
    snprintf(q8, sizeof q8, "%s/tiny-qwen35-q8_0.gguf", tmp);
    CHECK(fixture_folder(dir, folder, "tiny-qwen35", files, 6, shared, 2) == 0,
          "making the folder");
    CHECK(loom_convert(folder, f32, "f32", NULL, NULL, err, sizeof err) == 0, "convert: %s", err);
    same_as_peer(f32);
    CHECK(verify_problems(f32) == 0, "loom verify finds a problem in loom's conversion");
    CHECK(verify_problems(model) == 0,
          "loom verify finds a problem in llama.cpp's file (hybrid layers, the MTP block)");
    static char backends[MAX_TEST_BACKENDS][160];
    int n_backends = usable_backends(backends, MAX_TEST_BACKENDS);
    for (int i = 0; i < n_backends; i++) {
        check_model(dir, "tiny-qwen35", f32, backends[i], "last_logits", 1e-3, 1,
                    "tiny-qwen35 (loom convert, f32)");
        /* bf16 weights: the AVX-512 BF16 kernels round the activations to bf16 too */
        check_model(dir, "tiny-qwen35", folder, backends[i], "last_logits", 0.1, 0,
                    "tiny-qwen35 folder (bf16)");
    }
    CHECK(loom_quantize(f32, q8, "q8_0", NULL, NULL, err, sizeof err) == 0, "quantize: %s", err);
    loom_gguf g;
    if (loom_gguf_open(&g, q8, err, sizeof err) == 0) {
        const loom_gguf_tensor *conv = loom_gguf_find_tensor(&g, "blk.0.ssm_conv1d.weight");
        const loom_gguf_tensor *qkv = loom_gguf_find_tensor(&g, "blk.0.attn_qkv.weight");
        CHECK(conv && conv->type == LOOM_F32 && qkv && qkv->type == LOOM_Q8_0,
              "quantised: the conv1d stays f32 (is %s), the projections are q8_0 (are %s)",
              conv ? loom_ggml_type_name(conv->type) : "absent",
              qkv ? loom_ggml_type_name(qkv->type) : "absent");
        loom_gguf_close(&g);
    }
    unlink(f32), unlink(q8);
    remove_folder(folder);
}

/* tiny-qwen2 as a folder: a drafter of the same vocabulary whose proposals are mostly wrong */
static loom_model *open_drafter(const char *folder, const char *backend)
{
    static const char *const files[] = {"config.json",       "generation_config.json",
                                        "model.safetensors", "tokenizer_config.json",
                                        "merges.txt",        "vocab.json"};
    if (access(folder, F_OK) != 0 && fixture_folder(dir, folder, "tiny-qwen2", files, 6, NULL, 0))
        return NULL;
    loom_model_options o = {.backend = backend, .n_ctx = 256};
    return loom_model_open(folder, &o, err, sizeof err);
}

static void test_speculative(const char *backend_or_null, const char *drafter_folder)
{
    const char *backend = backend_or_null ? backend_or_null : "the default backend";
    loom_model_options o = {.backend = backend_or_null, .n_ctx = 256};
    loom_model *m = loom_model_open(model, &o, err, sizeof err);
    loom_model *d = open_drafter(drafter_folder, backend_or_null);
    CHECK(m && d, "speculative on %s: %s", backend, err);
    if (m && d) {
        loom_sampling g = loom_sampling_defaults();
        g.temperature = 0, g.ignore_eos = 1;
        loom_speculation spec = {.draft = d, .draft_max = 3, .p_min = 0, .fixed = 1};
        for (int i = 0; i < n_cases; i++) {
            collect c = {{0}, 0};
            loom_generation st = {0};
            int rc = loom_generate_speculative(m, &spec, cases[i].prompt, cases[i].n_prompt, 0, 16,
                                               &g, on_token, &c, &st, err, sizeof err);
            CHECK(rc == 0 && same_greedy(&c, &cases[i]) && st.n_drafted > st.n_accepted,
                  "case %d with rejected proposals (%d of %d kept) on %s: %s", i, st.n_accepted,
                  st.n_drafted, backend, rc ? err : "other greedy tokens, or none rejected");
        }
    }
    loom_model_close(d);
    loom_model_close(m);
}

/* The multimodal form every Qwen3.5 release takes (Qwen3_5ForConditionalGeneration): the
 * fixture's weights under model.language_model, its config as text_config, and a vision tower
 * loom leaves out. Converted, it is the same model. */
static void test_multimodal_folder(void)
{
    char folder[4200], f32[4200], path[4300];
    snprintf(folder, sizeof folder, "%s/tiny-qwen35-vl", tmp);
    snprintf(f32, sizeof f32, "%s/tiny-qwen35-vl-f32.gguf", tmp);
    CHECK(mkdir(folder, 0700) == 0, "making %s", folder);
    loom_safetensors st;
    snprintf(path, sizeof path, "%s/tiny-qwen35/model.safetensors", dir);
    if (loom_safetensors_open(&st, path, err, sizeof err) != 0) {
        CHECK(0, "%s", err);
        return;
    }
    st_out o = {cJSON_CreateObject(), NULL, 0, 0};
    for (int i = 0; i < st.n_tensors; i++) {
        const char *name = st.tensors[i].name;
        char to[512];
        if (!strncmp(name, "model.", 6))
            snprintf(to, sizeof to, "model.language_model.%s", name + 6);
        else
            snprintf(to, sizeof to, "%s", name);
        st_copy(&o, &st, name, to);
    }
    static const float patch[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    st_add(&o, "model.visual.patch_embed.proj.weight", "F32", 2, (int64_t[]){2, 4}, patch,
           sizeof patch);
    snprintf(path, sizeof path, "%s/model.safetensors", folder);
    CHECK(st_write(&o, path) == 0, "writing %s", path);
    loom_safetensors_close(&st);
    snprintf(path, sizeof path, "%s/tiny-qwen35/config.json", dir);
    char *text = slurp(path, NULL);
    cJSON *inner = cJSON_Parse(text), *outer = cJSON_CreateObject();
    free(text);
    cJSON_AddItemToObject(
        outer, "architectures",
        cJSON_CreateStringArray((const char *[]){"Qwen3_5ForConditionalGeneration"}, 1));
    cJSON_AddStringToObject(outer, "model_type", "qwen3_5");
    cJSON_AddItemToObject(outer, "text_config", inner);
    cJSON *vision = cJSON_AddObjectToObject(outer, "vision_config");
    cJSON_AddNumberToObject(vision, "depth", 1);
    char *json = cJSON_Print(outer);
    write_text(folder, "config.json", json);
    free(json);
    cJSON_Delete(outer);
    static const char *const copied[] = {"generation_config.json", "tokenizer_config.json"};
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/tiny-qwen35/%s", dir, copied[i]);
        link_file(folder, copied[i], path);
    }
    snprintf(path, sizeof path, "%s/tiny-qwen2/vocab.json", dir);
    link_file(folder, "vocab.json", path);
    snprintf(path, sizeof path, "%s/tiny-qwen2/merges.txt", dir);
    link_file(folder, "merges.txt", path);
    CHECK(loom_convert(folder, f32, "f32", NULL, NULL, err, sizeof err) == 0,
          "convert the multimodal folder: %s", err);
    same_as_peer(f32);
    check_model(dir, "tiny-qwen35", f32, "ref", "last_logits", 1e-3, 1,
                "tiny-qwen35 as Qwen3_5ForConditionalGeneration (loom convert, f32)");
    unlink(f32);
    remove_folder(folder);
}

/* ---- the engine ------------------------------------------------------------------------- */

typedef struct answer {
    collect c;
    int done, errored, cancel_after;
    int32_t n_cached;
    int64_t id;
} answer;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static loom_engine *engine;

static void on_event(void *user, const loom_event *ev)
{
    answer *a = user;
    pthread_mutex_lock(&mu);
    if (ev->kind == LOOM_EVENT_TEXT && ev->token >= 0 && a->c.n < 64)
        a->c.ids[a->c.n++] = ev->token;
    int cancel = ev->kind == LOOM_EVENT_TEXT && a->cancel_after && a->c.n == a->cancel_after;
    if (ev->kind != LOOM_EVENT_TEXT) {
        a->done = 1, a->errored = ev->kind == LOOM_EVENT_ERROR, a->n_cached = ev->n_cached;
        pthread_cond_broadcast(&cv);
    }
    int64_t id = a->id;
    pthread_mutex_unlock(&mu);
    if (cancel)
        loom_engine_cancel(engine, id);
}

/* test_engine's drafter_folder that means the model's own multi-token-prediction block */
static const char MTP_BLOCK[] = "the model's MTP block";

static void test_engine(const char *backend_or_null, int32_t slots, const char *drafter_folder)
{
    const char *backend = backend_or_null ? backend_or_null : "the default backend";
    loom_model_options o = {.backend = backend_or_null, .n_ctx = 256, .kv_sequences = slots};
    loom_model *m = loom_model_open(model, &o, err, sizeof err);
    CHECK(m != NULL, "engine on %s: %s", backend, err);
    if (!m)
        return;
    loom_model_options mtp = o;
    mtp.mtp = 1;
    loom_model *d = drafter_folder == MTP_BLOCK ? loom_model_open(model, &mtp, err, sizeof err)
        : drafter_folder                        ? open_drafter(drafter_folder, backend_or_null)
                                                : NULL;
    CHECK(!drafter_folder || d, "the drafter on %s: %s", backend, err);
    loom_engine_options eo = {.max_batch = 16, .draft = d, .draft_p_min = 0};
    engine = loom_engine_start(m, &eo, err, sizeof err);
    CHECK(engine != NULL, "engine on %s: %s", backend, err);
    if (!engine) {
        loom_model_close(d);
        loom_model_close(m);
        return;
    }
    /* every case, then every case again, the first of those cancelled after 3 tokens */
    answer a[8] = {0};
    a[4].cancel_after = 3;
    for (int i = 0; i < 2 * n_cases; i++) {
        loom_request r = {.prompt = cases[i % n_cases].prompt,
                          .n_prompt = cases[i % n_cases].n_prompt,
                          .max_tokens = 16,
                          .sampling = loom_sampling_defaults()};
        r.sampling.temperature = 0, r.sampling.ignore_eos = 1;
        r.draft = d != NULL, r.draft_max = 3;
        pthread_mutex_lock(&mu);
        int64_t id = loom_engine_submit(engine, &r, on_event, &a[i], err, sizeof err);
        a[i].id = id;
        pthread_mutex_unlock(&mu);
        CHECK(id > 0, "submit %d on %s: %s", i, backend, err);
        /* the drafter proposes for a request running alone: one at a time */
        pthread_mutex_lock(&mu);
        while (d && id > 0 && !a[i].done)
            pthread_cond_wait(&cv, &mu);
        pthread_mutex_unlock(&mu);
    }
    pthread_mutex_lock(&mu);
    for (int i = 0; i < 2 * n_cases; i++)
        while (a[i].id > 0 && !a[i].done)
            pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
    for (int i = 0; i < 2 * n_cases; i++) {
        if (i == 4) {
            CHECK(a[i].c.n >= 3 && a[i].c.n < 16, "the cancelled request ran %d tokens", a[i].c.n);
            continue;
        }
        CHECK(!a[i].errored && same_greedy(&a[i].c, &cases[i % n_cases]),
              "request %d (case %d) of %d at once over %d state slots on %s: %s", i, i % n_cases,
              2 * n_cases, slots, backend, a[i].errored ? "failed" : "other greedy tokens");
    }
    /* the longest case again, alone: its prompt's blocks up to the last boundary are cached,
     * with a snapshot of the state there, and the answer is the same */
    if (!d) {
        int longest = 0;
        for (int i = 1; i < n_cases; i++)
            longest = cases[i].n_prompt > cases[longest].n_prompt ? i : longest;
        loom_request r = {.prompt = cases[longest].prompt,
                          .n_prompt = cases[longest].n_prompt,
                          .max_tokens = 16,
                          .sampling = loom_sampling_defaults()};
        r.sampling.temperature = 0, r.sampling.ignore_eos = 1;
        answer again = {0};
        pthread_mutex_lock(&mu);
        again.id = loom_engine_submit(engine, &r, on_event, &again, err, sizeof err);
        while (again.id > 0 && !again.done)
            pthread_cond_wait(&cv, &mu);
        pthread_mutex_unlock(&mu);
        int32_t want = cases[longest].n_prompt / 16 * 16; /* the runner's 16-token blocks */
        CHECK(!again.errored && same_greedy(&again.c, &cases[longest]) && again.n_cached == want,
              "case %d again on %s: %d tokens cached (want %d, resumed from a state snapshot), "
              "%s",
              longest, backend, again.n_cached, want,
              again.errored ? "failed" : "the greedy tokens as alone?");
    }
    if (d) {
        loom_engine_stats es = loom_engine_get_stats(engine);
        CHECK(es.drafted > es.accepted,
              "the engine's drafter (%s) had proposals rejected (%llu of "
              "%llu kept)",
              drafter_folder, (unsigned long long)es.accepted, (unsigned long long)es.drafted);
    }
    loom_engine_stop(engine, 1000);
    loom_engine_free(engine);
    engine = NULL;
    loom_model_close(d);
    loom_model_close(m);
}

/* ---- without fixtures: loom's synthetic hybrid, ref as the oracle ------------------------ */

static void lone_greedy(loom_model *m, const int32_t *ids, int n, collect *c)
{
    loom_sampling g = loom_sampling_defaults();
    g.temperature = 0, g.ignore_eos = 1;
    int rc = loom_generate(m, ids, n, 16, &g, on_token, c, NULL, err, sizeof err);
    CHECK(rc == 0 && c->n == 16, "synthetic hybrid: generate: %s", rc ? err : "too few tokens");
}

static void test_synthetic(const char *dir_tmp)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/hybrid-tiny.gguf", dir_tmp);
    CHECK(loom_write_synthetic_model(path, "hybrid-tiny", "f32", err, sizeof err) == 0,
          "writing the synthetic hybrid: %s", err);
    static const int32_t prompts[3][12] = {
        {1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310},
        {1, 400, 401, 402, 403, 404, 405},
        {1, 500, 300, 500, 300, 500}};
    static const int lens[3] = {12, 7, 6};
    loom_model_options ro = {.backend = "ref", .n_ctx = 128};
    loom_model *ref = loom_model_open(path, &ro, err, sizeof err);
    CHECK(ref != NULL, "synthetic hybrid on ref: %s", err);
    if (!ref)
        return;
    collect want[3] = {0};
    float *want_logits[3];
    int n_vocab = loom_model_n_vocab(ref);
    for (int p = 0; p < 3; p++) {
        lone_greedy(ref, prompts[p], lens[p], &want[p]);
        want_logits[p] = malloc((size_t)n_vocab * sizeof(float));
        memcpy(want_logits[p], loom_prompt_logits(ref), (size_t)n_vocab * sizeof(float));
    }
    loom_model_close(ref);
    static char backends[MAX_TEST_BACKENDS][160];
    int n_backends = usable_backends(backends, MAX_TEST_BACKENDS);
    for (int i = 0; i < n_backends; i++) {
        loom_model_options o = {.backend = backends[i], .n_ctx = 128};
        loom_model *m = loom_model_open(path, &o, err, sizeof err);
        CHECK(m != NULL, "synthetic hybrid on %s: %s", backends[i], err);
        for (int p = 0; m && p < 3; p++) {
            collect c = {{0}, 0};
            lone_greedy(m, prompts[p], lens[p], &c);
            double worst = 0;
            for (int v = 0; v < n_vocab; v++)
                worst = fmax(worst, fabs((double)loom_prompt_logits(m)[v] - want_logits[p][v]));
            CHECK(worst < 1e-4 && !memcmp(c.ids, want[p].ids, sizeof c.ids),
                  "synthetic hybrid prompt %d on %s: logits off ref's by %g, or other tokens", p,
                  backends[i], worst);
        }
        loom_model_close(m);
    }
    /* the engine: 6 requests at once over 2 state slots, each its lone answer */
    loom_model_options eo_m = {.n_ctx = 128, .kv_sequences = 2};
    loom_model *m = loom_model_open(path, &eo_m, err, sizeof err);
    loom_engine_options eo = {.max_batch = 8};
    engine = m ? loom_engine_start(m, &eo, err, sizeof err) : NULL;
    CHECK(engine != NULL, "synthetic hybrid engine: %s", err);
    answer a[6] = {0};
    for (int i = 0; engine && i < 6; i++) {
        loom_request r = {.prompt = prompts[i % 3],
                          .n_prompt = lens[i % 3],
                          .max_tokens = 16,
                          .sampling = loom_sampling_defaults()};
        r.sampling.temperature = 0, r.sampling.ignore_eos = 1;
        pthread_mutex_lock(&mu);
        a[i].id = loom_engine_submit(engine, &r, on_event, &a[i], err, sizeof err);
        pthread_mutex_unlock(&mu);
        CHECK(a[i].id > 0, "synthetic hybrid: submit %d: %s", i, err);
    }
    pthread_mutex_lock(&mu);
    for (int i = 0; engine && i < 6; i++)
        while (a[i].id > 0 && !a[i].done)
            pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
    for (int i = 0; engine && i < 6; i++)
        CHECK(!a[i].errored && a[i].c.n == 16 && !memcmp(a[i].c.ids, want[i % 3].ids, 16 * 4),
              "synthetic hybrid: request %d of 6 over 2 state slots differs from its lone run", i);
    if (engine) {
        loom_engine_stop(engine, 1000);
        loom_engine_free(engine);
        engine = NULL;
    }
    loom_model_close(m);
    for (int p = 0; p < 3; p++)
        free(want_logits[p]);
    unlink(path);
}

/* The model's own MTP block as the drafter, where it agrees with its model: loom's synthetic
 * hybrid-tiny-next, whose next token is the current one's successor and whose MTP block passes
 * the next token's embedding to the shared head (so it names the token after next). Proposals
 * are kept only where the block is fed the right id at the right position, chained on its own
 * state, in loom_generate_speculative and in the engine: nearly all of them here, none when
 * the id beside a state is off by one. The answers are greedy decoding's. */
static void test_mtp_agreeing(const char *dir_tmp)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/hybrid-tiny-next.gguf", dir_tmp);
    CHECK(loom_write_synthetic_model(path, "hybrid-tiny-next", "f32", err, sizeof err) == 0,
          "writing hybrid-tiny-next: %s", err);
    static const int32_t prompt[6] = {1, 300, 301, 302, 303, 304};
    loom_model_options o = {.n_ctx = 128, .kv_sequences = 2};
    loom_model *m = loom_model_open(path, &o, err, sizeof err);
    o.mtp = 1;
    loom_model *d = loom_model_open(path, &o, err, sizeof err);
    CHECK(m && d, "hybrid-tiny-next and its MTP block: %s", err);
    if (!m || !d) {
        loom_model_close(d), loom_model_close(m);
        return;
    }
    loom_sampling g = loom_sampling_defaults();
    g.temperature = 0, g.ignore_eos = 1;
    collect plain = {{0}, 0}, drafted = {{0}, 0};
    loom_speculation spec = {.draft = d, .draft_max = 4, .fixed = 1};
    loom_generation st = {0};
    CHECK(loom_generate(m, prompt, 6, 24, &g, on_token, &plain, NULL, err, sizeof err) == 0 &&
              loom_generate_speculative(m, &spec, prompt, 6, 0, 24, &g, on_token, &drafted, &st,
                                        err, sizeof err) == 0,
          "hybrid-tiny-next: %s", err);
    CHECK(plain.n == 24 && drafted.n == 24 && !memcmp(plain.ids, drafted.ids, sizeof plain.ids),
          "hybrid-tiny-next: drafting with the MTP block changed the greedy tokens");
    CHECK(st.n_drafted >= 16 && st.n_accepted * 10 >= st.n_drafted * 9,
          "hybrid-tiny-next: the MTP block's proposals kept %d of %d (it agrees with its model)",
          st.n_accepted, st.n_drafted);
    printf("hybrid-tiny-next: the MTP block's proposals kept %d of %d in %d checks\n",
           st.n_accepted, st.n_drafted, st.n_verify);
    /* the engine, a request alone: the same tokens, its proposals kept */
    loom_engine_options eo = {.max_batch = 2, .draft = d, .draft_p_min = 0};
    engine = loom_engine_start(m, &eo, err, sizeof err);
    CHECK(engine != NULL, "hybrid-tiny-next engine: %s", err);
    answer a = {0};
    if (engine) {
        loom_request r = {.prompt = prompt, .n_prompt = 6, .max_tokens = 24, .sampling = g};
        r.draft = 1, r.draft_max = 4;
        pthread_mutex_lock(&mu);
        a.id = loom_engine_submit(engine, &r, on_event, &a, err, sizeof err);
        while (a.id > 0 && !a.done)
            pthread_cond_wait(&cv, &mu);
        pthread_mutex_unlock(&mu);
        loom_engine_stats es = loom_engine_get_stats(engine);
        CHECK(!a.errored && a.c.n == 24 && !memcmp(a.c.ids, plain.ids, sizeof plain.ids),
              "hybrid-tiny-next in the engine with its MTP block: other tokens");
        CHECK(es.drafted >= 8 && es.accepted * 10 >= es.drafted * 9,
              "hybrid-tiny-next in the engine: the MTP block's proposals kept %llu of %llu",
              (unsigned long long)es.accepted, (unsigned long long)es.drafted);
        printf("hybrid-tiny-next in the engine: %llu of %llu proposals kept\n",
               (unsigned long long)es.accepted, (unsigned long long)es.drafted);
        loom_engine_stop(engine, 1000);
        loom_engine_free(engine);
        engine = NULL;
    }
    loom_model_close(d);
    loom_model_close(m);
    unlink(path);
}

int main(void)
{
    snprintf(dir, sizeof dir, "%s", fixtures_dir());
    static const char *const needed[] = {
        "tiny-qwen35/model.gguf", "tiny-qwen35/expected.json", "tiny-qwen35/model.safetensors",
        "tiny-qwen2/vocab.json",  "tiny-qwen2/merges.txt",     "tiny-qwen2/model.safetensors"};
    unsetenv("LOOM_BACKEND");
    if (!mkdtemp(tmp))
        return 1;
    test_synthetic(tmp);
    test_mtp_agreeing(tmp);
    if (!have_fixtures(dir, needed, sizeof needed / sizeof needed[0])) {
        rmdir(tmp);
        return check_finish("test_hybrid");
    }
    snprintf(model, sizeof model, "%s/tiny-qwen35/model.gguf", dir);
    read_cases();
    static char backends[MAX_TEST_BACKENDS][160];
    int n_backends = usable_backends(backends, MAX_TEST_BACKENDS);
    for (int i = 0; i < n_backends; i++) {
        check_model(dir, "tiny-qwen35", model, backends[i], "last_logits", 1e-3, 1,
                    "tiny-qwen35 (llama.cpp's GGUF, f16)");
        test_chunked(backends[i]);
    }
    test_engine("ref", 16, NULL);
    test_engine(NULL, 2, NULL);
    char drafter[4200];
    snprintf(drafter, sizeof drafter, "%s/tiny-qwen2", tmp);
    test_speculative(NULL, drafter);
    test_engine(NULL, 2, drafter);
    test_engine("ref", 2, MTP_BLOCK);
    test_engine(NULL, 2, MTP_BLOCK);
    test_folder();
    test_multimodal_folder();
    remove_folder(drafter);
    rmdir(tmp);
    return check_finish("test_hybrid");
}
