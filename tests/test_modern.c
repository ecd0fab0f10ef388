/*
 * tests/test_modern.c - today's members of the families against PyTorch, on every usable
 * backend (issue 40):
 *   - Llama 3.1's RoPE scaling (rope_type "llama3"): the fixture's GGUF as llama.cpp's
 *     converter wrote it (rope_freqs.weight, no add_bos_token key), loom's own conversion of
 *     the folder, and the folder itself. With the scaling ignored the last logits move by up
 *     to 2.0 (the fixture's feature_off), and without <|begin_of_text|> the prompt ids differ;
 *   - Mistral's sliding window (8 keys here): loom's conversion and the folder; without the
 *     window the logits move by up to 5.2;
 *   - Qwen2-MoE's experts (top 2 of 8 by softmax, not renormalised, and a sigmoid-gated shared
 *     expert): llama.cpp's GGUF, loom's conversion and the folder; with top 3 instead of top 2
 *     the logits move by 0.26, with the weights renormalised by 0.63, without the shared
 *     expert's gate by 0.51 (the fixture's feature_off);
 *   - the experts on another backend (loom_model_options.experts_on, --experts-on): the
 *     PyTorch answers with ref running everything but the experts' matmuls, which it is made
 *     unable to run, and a dense model refused.
 */
#define _GNU_SOURCE
#include "core/gguf.h"

#include "backends.h"
#include "fixture_model.h"
#include "gguf_conventions.h"
#include "hf_writer.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char dir[4096], tmp[] = "/tmp/loom-modern-XXXXXX", err[4096];

/* rope_freqs.weight of a GGUF file into out (n floats); the count, or -1. */
static int64_t read_rope_freqs(const char *path, float *out, int64_t cap)
{
    loom_gguf g;
    if (loom_gguf_open(&g, path, err, sizeof err) != 0)
        return -1;
    const loom_gguf_tensor *t = loom_gguf_find_tensor(&g, "rope_freqs.weight");
    int64_t n = t && t->type == LOOM_F32 && (int64_t)t->ne[0] <= cap ? (int64_t)t->ne[0] : -1;
    if (n > 0)
        memcpy(out, loom_gguf_tensor_data(&g, t), (size_t)n * sizeof *out);
    loom_gguf_close(&g);
    return n;
}

/* A fixture on every usable backend in each form against PyTorch's last logits and greedy ids:
 * loom's f32 conversion (1e-4), the folder (bf16 weights: AVX-512 BF16 rounds the activations
 * to bf16 too, tiny-llama's bound 0.05) and llama.cpp's own GGUF where there is one (f16
 * weights: the fixtures' f16-compute evidence is 2e-3). */
static void check_forms(const char *fixture, const char *f32, const char *folder, const char *peer)
{
    static char backends[MAX_TEST_BACKENDS][160];
    int n_backends = usable_backends(backends, MAX_TEST_BACKENDS);
    char what[3][160];
    snprintf(what[0], sizeof what[0], "%s (loom convert, f32)", fixture);
    snprintf(what[1], sizeof what[1], "%s folder (bf16)", fixture);
    snprintf(what[2], sizeof what[2], "%s as llama.cpp converted it (f16)", fixture);
    for (int i = 0; i < n_backends; i++) {
        check_model(dir, fixture, f32, backends[i], "last_logits", 1e-4, 1, what[0]);
        check_model(dir, fixture, folder, backends[i], "last_logits", 0.05, 1, what[1]);
        if (peer)
            check_model(dir, fixture, peer, backends[i], "last_logits", 1e-2, 1, what[2]);
    }
}

static void test_llama31(void)
{
    static const char *const files[] = {"config.json", "generation_config.json",
                                        "model.safetensors", "tokenizer_config.json",
                                        "tokenizer.json"};
    char folder[4200], f32[4200], peer[4200];
    snprintf(folder, sizeof folder, "%s/tiny-llama31", tmp);
    snprintf(f32, sizeof f32, "%s/tiny-llama31-f32.gguf", tmp);
    snprintf(peer, sizeof peer, "%s/tiny-llama31/model.gguf", dir);
    static const char *const shared[] = {"tokenizers/llama3/tokenizer.json"};
    CHECK(fixture_folder(dir, folder, "tiny-llama31", files, 5, shared, 1) == 0,
          "making the folder");
    CHECK(loom_convert(folder, f32, "f32", NULL, NULL, err, sizeof err) == 0, "convert: %s", err);

    /* loom's converter writes the factors llama.cpp's does (from the same formula: transformers'
     * _compute_llama3_parameters) */
    float ours[64], theirs[64];
    int64_t n = read_rope_freqs(f32, ours, 64), m = read_rope_freqs(peer, theirs, 64);
    CHECK(n == 8 && m == 8, "rope_freqs.weight: %lld floats in loom's file, %lld in llama.cpp's",
          (long long)n, (long long)m);
    double worst = 0;
    for (int64_t i = 0; i < n && n == m; i++)
        worst = fabs((double)ours[i] - theirs[i]) > worst ? fabs((double)ours[i] - theirs[i])
                                                          : worst;
    CHECK(n == m && worst < 1e-5, "rope_freqs agree with llama.cpp's within %g", worst);

    check_forms("tiny-llama31", f32, folder, peer);
    unlink(f32);
    remove_folder(folder);
}

static void test_mistral(void)
{
    static const char *const files[] = {"config.json", "generation_config.json",
                                        "model.safetensors", "tokenizer_config.json",
                                        "tokenizer.model"};
    char folder[4200], f32[4200];
    snprintf(folder, sizeof folder, "%s/tiny-mistral", tmp);
    snprintf(f32, sizeof f32, "%s/tiny-mistral-f32.gguf", tmp);
    static const char *const shared[] = {"tiny-llama/tokenizer.model"};
    CHECK(fixture_folder(dir, folder, "tiny-mistral", files, 5, shared, 1) == 0,
          "making the folder");
    CHECK(loom_convert(folder, f32, "f32", NULL, NULL, err, sizeof err) == 0, "convert: %s", err);
    check_forms("tiny-mistral", f32, folder, NULL);
    /* the window the API reports (serve's /metrics shows it) is config.json's sliding_window */
    char cfg_path[4400];
    snprintf(cfg_path, sizeof cfg_path, "%s/config.json", folder);
    char *cfg_text = slurp(cfg_path, NULL);
    cJSON *cfg = cfg_text ? cJSON_Parse(cfg_text) : NULL;
    int want = (int)cJSON_GetNumberValue(cJSON_GetObjectItem(cfg, "sliding_window"));
    cJSON_Delete(cfg);
    free(cfg_text);
    loom_model_options o = {.backend = "ref"};
    loom_model *m = loom_model_open(f32, &o, err, sizeof err);
    CHECK(m && want > 0 && loom_model_sliding_window(m) == want,
          "the reported sliding window is %d, config.json's %d",
          m ? loom_model_sliding_window(m) : -1, want);
    loom_model_close(m);
    unlink(f32);
    remove_folder(folder);
}

/* Every tensor of llama.cpp's file is in loom's, of the same shape, and the experts' keys agree:
 * loom's conversion is the file llama.cpp's converter writes, as far as a reader can tell. */
static void same_layout(const char *peer_path, const char *ours_path, const char *what)
{
    loom_gguf peer, ours;
    if (loom_gguf_open(&peer, peer_path, err, sizeof err) != 0 ||
        loom_gguf_open(&ours, ours_path, err, sizeof err) != 0) {
        CHECK(0, "%s: %s", what, err);
        return;
    }
    for (uint64_t i = 0; i < peer.n_tensors; i++) {
        const loom_gguf_tensor *p = &peer.tensors[i], *o = loom_gguf_find_tensor(&ours, p->name);
        CHECK(o && o->n_dims == p->n_dims && !memcmp(o->ne, p->ne, sizeof o->ne),
              "%s: llama.cpp's %s is missing or shaped otherwise in loom's file", what, p->name);
    }
    static const char *const keys[] = {"expert_count", "expert_used_count",
                                       "expert_feed_forward_length",
                                       "expert_shared_feed_forward_length", "block_count"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        char key[128];
        int64_t a = -1, b = -2;
        snprintf(key, sizeof key, "qwen2moe.%s", keys[i]);
        loom_gguf_get_i64(&peer, key, &a);
        loom_gguf_get_i64(&ours, key, &b);
        CHECK(a == b, "%s: %s is %lld in llama.cpp's file, %lld in loom's", what, key, (long long)a,
              (long long)b);
    }
    loom_gguf_close(&peer);
    loom_gguf_close(&ours);
}

/* The experts on another backend: ref here denies matmul_id, and in strict mode nothing may
 * run an op the chosen backend lacks elsewhere; so the model opens and matches PyTorch only
 * because the experts' matmuls run where they were placed (the CPU module), their stacks
 * loaded there. A dense model is refused with the option, naming it. */
static void test_experts_on(const char *moe)
{
    setenv("LOOM_REF_DENY", "matmul_id", 1);
    setenv("LOOM_STRICT", "1", 1);
    loom_model_options o = {.backend = "ref", .kv_type = "f32"};
    loom_model *m = loom_model_open(moe, &o, err, sizeof err);
    CHECK(!m && strstr(err, "matmul_id"),
          "strict ref without matmul_id and no placement refuses the model (%s)", m ? "" : err);
    loom_model_close(m);
    setenv("LOOM_EXPERTS_ON", "cpu", 1); /* as loom_model_options.experts_on = "cpu" */
    check_model(dir, "tiny-qwen2moe", moe, "ref", "last_logits", 1e-4, 1,
                "tiny-qwen2moe on ref with its experts on the CPU module");
    o.experts_on = "ref"; /* the option over the environment */
    m = loom_model_open(moe, &o, err, sizeof err);
    CHECK(!m && strstr(err, "matmul_id"), "experts_on \"ref\" (which lacks matmul_id) refused: %s",
          m ? "opened" : err);
    loom_model_close(m);
    unsetenv("LOOM_STRICT");
    unsetenv("LOOM_REF_DENY");
    o.experts_on = "no-such-backend";
    m = loom_model_open(moe, &o, err, sizeof err);
    CHECK(!m && strstr(err, "no-such-backend"), "an unknown experts backend named: %s",
          m ? "opened" : err);
    loom_model_close(m);
    char dense[4200];
    snprintf(dense, sizeof dense, "%s/tiny-llama31/model.gguf", dir);
    o.experts_on = "cpu";
    m = loom_model_open(dense, &o, err, sizeof err);
    CHECK(!m && strstr(err, "has none"), "a dense model refused with experts_on: %s",
          m ? "opened" : err);
    loom_model_close(m);
    unsetenv("LOOM_EXPERTS_ON");
}

static void test_qwen2moe(void)
{
    static const char *const files[] = {"config.json",       "generation_config.json",
                                        "model.safetensors", "tokenizer_config.json",
                                        "merges.txt",        "vocab.json"};
    char folder[4200], f32[4200], peer[4200];
    snprintf(folder, sizeof folder, "%s/tiny-qwen2moe", tmp);
    snprintf(f32, sizeof f32, "%s/tiny-qwen2moe-f32.gguf", tmp);
    snprintf(peer, sizeof peer, "%s/tiny-qwen2moe/model.gguf", dir);
    static const char *const shared[] = {"tiny-qwen2/merges.txt", "tiny-qwen2/vocab.json"};
    CHECK(fixture_folder(dir, folder, "tiny-qwen2moe", files, 6, shared, 2) == 0,
          "making the folder");
    CHECK(loom_convert(folder, f32, "f32", NULL, NULL, err, sizeof err) == 0, "convert: %s", err);
    same_layout(peer, f32, "tiny-qwen2moe");
    check_gguf_conventions(f32, "tiny-qwen2moe (loom convert)");
    check_forms("tiny-qwen2moe", f32, folder, peer);
    /* a module without the experts' ops (one of ABI 1.4, or today's GPU modules) has them run
     * on the CPU module, its buffers copied there and back: the same answers */
    setenv("LOOM_REF_DENY", "moe_route,matmul_id,moe_combine", 1);
    setenv("LOOM_REF_OPAQUE", "1", 1);
    check_model(dir, "tiny-qwen2moe", f32, "ref", "last_logits", 1e-4, 1,
                "tiny-qwen2moe on ref without the MoE ops (the CPU fallback)");
    unsetenv("LOOM_REF_DENY");
    unsetenv("LOOM_REF_OPAQUE");
    test_experts_on(f32);
    unlink(f32);
    remove_folder(folder);
}

int main(void)
{
    snprintf(dir, sizeof dir, "%s", fixtures_dir());
    static const char *const needed[] = {
        "tiny-llama31/model.safetensors", "tokenizers/llama3/tokenizer.json",
        "tiny-mistral/model.safetensors", "tiny-llama/tokenizer.model",
        "tiny-qwen2moe/model.gguf",       "tiny-qwen2/vocab.json",
        "tiny-qwen2/merges.txt"};
    need_fixtures(dir, needed, sizeof needed / sizeof needed[0]);
    unsetenv("LOOM_BACKEND");
    if (!mkdtemp(tmp))
        return 1;
    test_llama31();
    test_mistral();
    test_qwen2moe();
    rmdir(tmp);
    return check_finish("test_modern");
}
