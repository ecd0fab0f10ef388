/*
 * tests/test_mla.c - multi-head latent attention (GGUF "deepseek2", models/deepseek2.c) on
 * loom's synthetic mla-tiny and mla-tiny-noq (without the query's low rank, as
 * DeepSeek-V2-Lite) (no fixtures needed: every backend against ref, f32 and q8_0, the
 * latent projections among the quantised matrices), and on
 * tiny-glm47-flash: the model.gguf llama.cpp's 2026 converter wrote from a GLM-4.7-Flash-shaped
 * checkpoint (Glm4MoeLiteForCausalLM), held on every usable backend to the reference's
 * (PyTorch, float64) last-prompt logits and greedy tokens for every case. The fixture's README
 * says what each part is worth: interleaved RoPE (0.32 if rotate-half), the choice bias (0.84),
 * sigmoid gating (1.08; llama.cpp's own loader gates this file by softmax: see the README), so a
 * tolerance of 1e-4 sees each (measured: 5e-7 with an f32 KV cache). The serving engine runs
 * every case at once (batched steps over one latent cache, the cases sharing their first token's
 * block) and gives each the tokens it gets alone. Also: `loom verify`
 * passes the file (its leading dense layer and its MTP block are layers of their own kinds),
 * and a file in the older MLA layout (attn_kv_b whole) is refused by name. The Hugging Face
 * folder, as it is and as loom converts it (f32): the same logits and tokens, the file's trunk
 * the tensors and shapes of llama.cpp's (its MTP block aside), with expert_gating_func written.
 */
#define _GNU_SOURCE
#include <loom/loom.h>

#include "core/gguf.h"
#include "backends.h"
#include "check.h"
#include "fixture_model.h"
#include "hf_writer.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>

static char dir[4096], err[4096];
static char tmp[] = "/tmp/loom-mla-XXXXXX";

/* Whether loom's conversion has llama.cpp's trunk tensors, shaped alike, and no others. */
static void same_trunk(const char *ours_path, const char *peer_path)
{
    loom_gguf ours, peer;
    if (loom_gguf_open(&ours, ours_path, err, sizeof err) != 0 ||
        loom_gguf_open(&peer, peer_path, err, sizeof err) != 0) {
        CHECK(0, "%s", err);
        return;
    }
    int64_t blocks = 0, nextn = 0;
    loom_gguf_get_i64(&peer, "deepseek2.block_count", &blocks);
    loom_gguf_get_i64(&peer, "deepseek2.nextn_predict_layers", &nextn);
    char mtp[32];
    snprintf(mtp, sizeof mtp, "blk.%lld.", (long long)(blocks - nextn));
    int compared = 0;
    for (uint64_t i = 0; i < peer.n_tensors; i++) {
        const loom_gguf_tensor *p = &peer.tensors[i], *o = loom_gguf_find_tensor(&ours, p->name);
        if (!strncmp(p->name, mtp, strlen(mtp)))
            continue;
        compared++;
        CHECK(o && o->n_dims == p->n_dims && !memcmp(o->ne, p->ne, sizeof o->ne),
              "llama.cpp's %s is missing or shaped otherwise in loom's conversion", p->name);
    }
    CHECK(compared == (int)ours.n_tensors, "loom's file has %llu tensors, llama.cpp's trunk %d",
          (unsigned long long)ours.n_tensors, compared);
    int64_t gating = 0;
    CHECK(loom_gguf_get_i64(&ours, "deepseek2.expert_gating_func", &gating) == 0 && gating == 2,
          "loom's conversion says expert_gating_func %lld, not 2 (sigmoid)", (long long)gating);
    loom_gguf_close(&ours), loom_gguf_close(&peer);
}

/* model.gguf with blk.0's attn_k_b renamed attn_kv_b: what an older converter's file names */
static int older_layout(const char *from, const char *to)
{
    loom_gguf g;
    if (loom_gguf_open(&g, from, err, sizeof err) != 0)
        return -1;
    loom_gguf_writer *w = loom_gguf_writer_create();
    for (uint64_t i = 0; i < g.n_kv; i++)
        if (strcmp(g.kv[i].key, "general.alignment"))
            loom_gguf_copy_kv(w, &g, &g.kv[i]);
    for (uint64_t i = 0; i < g.n_tensors; i++) {
        const loom_gguf_tensor *t = &g.tensors[i];
        if (!strcmp(t->name, "blk.0.attn_v_b.weight"))
            continue;
        loom_gguf_add_tensor(
            w, strcmp(t->name, "blk.0.attn_k_b.weight") ? t->name : "blk.0.attn_kv_b.weight",
            t->type, t->n_dims, t->ne, loom_gguf_tensor_data(&g, t));
    }
    int rc = loom_gguf_write(w, to, err, sizeof err);
    loom_gguf_writer_free(w);
    loom_gguf_close(&g);
    return rc;
}

typedef struct answer {
    collect c;
    int done, errored;
} answer;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;

static void on_event(void *user, const loom_event *ev)
{
    answer *a = user;
    pthread_mutex_lock(&mu);
    if (ev->kind == LOOM_EVENT_TEXT && ev->token >= 0 && a->c.n < 64)
        a->c.ids[a->c.n++] = ev->token;
    if (ev->kind != LOOM_EVENT_TEXT) {
        a->done = 1, a->errored = ev->kind == LOOM_EVENT_ERROR;
        pthread_cond_broadcast(&cv);
    }
    pthread_mutex_unlock(&mu);
}

/* every case's prompt from expected.json alone, then all at once in the engine (which owns the
 * model while it runs): each answer as alone */
static void check_engine(const char *model)
{
    char p[4400];
    snprintf(p, sizeof p, "%s/tiny-glm47-flash/expected.json", dir);
    char *json = slurp(p, NULL);
    cJSON *root = cJSON_Parse(json), *cs;
    loom_model_options o = {.n_ctx = 256, .kv_sequences = 4};
    loom_model *m = loom_model_open(model, &o, err, sizeof err);
    CHECK(m != NULL, "%s", err);
    static int32_t prompts[8][512];
    int n_prompt[8], n = 0;
    answer a[8] = {0};
    collect alone[8];
    loom_sampling g = loom_sampling_defaults();
    g.temperature = 0, g.ignore_eos = 1;
    cJSON_ArrayForEach (cs, cJSON_GetObjectItem(root, "cases")) {
        if (!m || n == 8)
            break;
        const cJSON *ids = cJSON_GetObjectItem(cs, "prompt_ids"), *id;
        int k = 0;
        cJSON_ArrayForEach (id, ids)
            if (k < 512)
                prompts[n][k++] = id->valueint;
        n_prompt[n] = k;
        alone[n] = (collect){{0}, 0};
        CHECK(loom_generate(m, prompts[n], k, 12, &g, on_token, &alone[n], NULL, err, sizeof err) ==
                  0,
              "alone: %s", err);
        n++;
    }
    loom_engine_options eo = {.max_batch = 4};
    loom_engine *e = m ? loom_engine_start(m, &eo, err, sizeof err) : NULL;
    CHECK(e != NULL, "the engine: %s", err);
    for (int i = 0; i < n; i++) {
        loom_request r = {
            .prompt = prompts[i], .n_prompt = n_prompt[i], .max_tokens = 12, .sampling = g};
        if (!e || loom_engine_submit(e, &r, on_event, &a[i], err, sizeof err) <= 0) {
            CHECK(0, "submit: %s", err);
            a[i].done = a[i].errored = 1;
        }
    }
    pthread_mutex_lock(&mu);
    for (int i = 0; i < n; i++)
        while (!a[i].done)
            pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
    for (int i = 0; i < n; i++)
        CHECK(!a[i].errored && a[i].c.n == alone[i].n &&
                  !memcmp(a[i].c.ids, alone[i].ids, sizeof a[i].c.ids),
              "case %d batched with the others: %s", i,
              a[i].errored ? "failed" : "not the tokens it gets alone");
    CHECK(n == 4, "%d cases", n);
    if (e) {
        loom_engine_stop(e, 1000);
        loom_engine_free(e);
    }
    loom_model_close(m);
    cJSON_Delete(root);
    free(json);
}

/* loom's synthetic latent-attention model `shape` in type on every backend: ref's logits and
 * tokens */
static void check_synthetic(const char *shape, const char *type)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/%s-%s.gguf", tmp, shape, type);
    CHECK(loom_write_synthetic_model(path, shape, type, err, sizeof err) == 0, "writing %s: %s",
          shape, err);
    static const int32_t prompt[12] = {1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310};
    loom_sampling g = loom_sampling_defaults();
    g.temperature = 0, g.ignore_eos = 1;
    loom_model_options ro = {.backend = "ref", .n_ctx = 128, .kv_type = "f32"};
    loom_model *ref = loom_model_open(path, &ro, err, sizeof err);
    CHECK(ref != NULL, "%s on ref: %s", shape, err);
    if (!ref)
        return;
    collect want = {{0}, 0};
    CHECK(loom_generate(ref, prompt, 12, 8, &g, on_token, &want, NULL, err, sizeof err) == 0,
          "%s on ref: %s", shape, err);
    const int n_vocab = loom_model_n_vocab(ref);
    float *want_logits = malloc((size_t)n_vocab * sizeof *want_logits);
    memcpy(want_logits, loom_prompt_logits(ref), (size_t)n_vocab * sizeof *want_logits);
    loom_model_close(ref);
    static char backends[MAX_TEST_BACKENDS][160];
    int nb = usable_backends(backends, MAX_TEST_BACKENDS);
    for (int b = 0; b < nb; b++) {
        loom_model_options o = {.backend = backends[b], .n_ctx = 128, .kv_type = "f32"};
        loom_model *m = loom_model_open(path, &o, err, sizeof err);
        CHECK(m != NULL, "%s (%s) on %s: %s", shape, type, backends[b], err);
        collect c = {{0}, 0};
        int rc = m ? loom_generate(m, prompt, 12, 8, &g, on_token, &c, NULL, err, sizeof err) : -1;
        double worst = 0;
        for (int v = 0; rc == 0 && v < n_vocab; v++)
            worst = fmax(worst, fabs((double)loom_prompt_logits(m)[v] - want_logits[v]));
        /* q8_0 weights: the CPU variants quantise the activations too, ref does not, so the
         * logits differ by that (0.016 measured) and a near tie may pick another token */
        const int exact = !strcmp(type, "f32");
        const double tol = exact ? 1e-4 : 5e-2;
        CHECK(rc == 0 && worst < tol &&
                  (!exact || (c.n == want.n && !memcmp(c.ids, want.ids, sizeof c.ids))),
              "%s (%s) on %s: logits off ref's by %g, or other tokens %s", shape, type, backends[b],
              worst, rc ? err : "");
        loom_model_close(m);
        /* the latent cache in q8_0 (--kv-type): 64 numbers a token, whole blocks */
        o.kv_type = "q8_0";
        m = loom_model_open(path, &o, err, sizeof err);
        c = (collect){{0}, 0};
        rc = m ? loom_generate(m, prompt, 12, 8, &g, on_token, &c, NULL, err, sizeof err) : -1;
        worst = 0;
        for (int v = 0; rc == 0 && v < n_vocab; v++)
            worst = fmax(worst, fabs((double)loom_prompt_logits(m)[v] - want_logits[v]));
        CHECK(rc == 0 && worst < tol + 5e-2,
              "%s (%s) with a q8_0 latent cache on %s: logits off ref's by %g %s", shape, type,
              backends[b], worst, rc ? err : "");
        printf("%s (%s), q8_0 latent cache on %s: logits within %.2g of ref's f32 cache\n", shape,
               type, backends[b], worst);
        loom_model_close(m);
    }
    free(want_logits);
    unlink(path);
}

int main(void)
{
    snprintf(dir, sizeof dir, "%s", fixtures_dir());
    static const char *const needed[] = {
        "tiny-glm47-flash/model.gguf", "tiny-glm47-flash/expected.json",
        "tiny-glm47-flash/model.safetensors", "tiny-qwen2/vocab.json", "tiny-qwen2/merges.txt"};
    unsetenv("LOOM_BACKEND");
    if (!mkdtemp(tmp))
        return 1;
    check_synthetic("mla-tiny", "f32");
    check_synthetic("mla-tiny", "q8_0");
    check_synthetic("mla-tiny-noq", "f32"); /* DeepSeek-V2-Lite's one attn_q */
    if (!have_fixtures(dir, needed, sizeof needed / sizeof needed[0])) {
        rmdir(tmp);
        return check_finish("test_mla");
    }
    char model[4400];
    snprintf(model, sizeof model, "%s/tiny-glm47-flash/model.gguf", dir);
    static char backends[MAX_TEST_BACKENDS][160];
    int nb = usable_backends(backends, MAX_TEST_BACKENDS);
    for (int b = 0; b < nb; b++)
        check_model(dir, "tiny-glm47-flash", model, backends[b], "last_logits", 1e-4, 1,
                    "tiny-glm47-flash (llama.cpp's GGUF, f16)");
    check_engine(model);
    /* the folder, as it is and converted */
    char folder[4200], f32[4200];
    snprintf(folder, sizeof folder, "%s/tiny-glm47-flash", tmp);
    snprintf(f32, sizeof f32, "%s/tiny-glm47-flash-f32.gguf", tmp);
    static const char *const files[] = {"config.json",       "generation_config.json",
                                        "model.safetensors", "tokenizer_config.json",
                                        "merges.txt",        "vocab.json"};
    static const char *const shared[] = {"tiny-qwen2/merges.txt", "tiny-qwen2/vocab.json"};
    CHECK(fixture_folder(dir, folder, "tiny-glm47-flash", files, 6, shared, 2) == 0 &&
              loom_convert(folder, f32, "f32", NULL, NULL, err, sizeof err) == 0,
          "converting the folder: %s", err);
    same_trunk(f32, model);
    for (int b = 0; b < nb; b++) {
        check_model(dir, "tiny-glm47-flash", f32, backends[b], "last_logits", 1e-4, 1,
                    "tiny-glm47-flash (loom's f32 conversion)");
        if (!strcmp(backends[b], "ref"))
            check_model(dir, "tiny-glm47-flash", folder, backends[b], "last_logits", 1e-4, 1,
                        "tiny-glm47-flash (the folder)");
    }
    unlink(f32);
    remove_folder(folder);
    rmdir(tmp);
    CHECK(verify_problems(model) == 0, "loom verify finds a problem in llama.cpp's deepseek2 file");
    char older[] = "/tmp/loom-mla-older-XXXXXX";
    int fd = mkstemp(older);
    CHECK(fd >= 0 && older_layout(model, older) == 0, "writing the older layout: %s", err);
    if (fd >= 0)
        close(fd);
    loom_model_options o = {.backend = "ref"};
    loom_model *m = loom_model_open(older, &o, err, sizeof err);
    CHECK(!m && strstr(err, "attn_kv_b") && strstr(err, "older converters' MLA layout"),
          "the older MLA layout: %s", m ? "opened" : err);
    loom_model_close(m);
    unlink(older);
    return check_finish("test_mla");
}
