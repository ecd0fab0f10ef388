/*
 * tests/test_modern.c - today's members of the families against PyTorch, on every usable
 * backend (issue 40):
 *   - Llama 3.1's RoPE scaling (rope_type "llama3"): the fixture's GGUF as llama.cpp's
 *     converter wrote it (rope_freqs.weight, no add_bos_token key), loom's own conversion of
 *     the folder, and the folder itself. With the scaling ignored the last logits move by up
 *     to 2.0 (the fixture's feature_off), and without <|begin_of_text|> the prompt ids differ;
 *   - Mistral's sliding window (8 keys here): loom's conversion and the folder; without the
 *     window the logits move by up to 5.2.
 */
#define _GNU_SOURCE
#include "core/gguf.h"

#include "backends.h"
#include "fixture_model.h"
#include "hf_writer.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char dir[4096], tmp[] = "/tmp/loom-modern-XXXXXX", err[4096];

/* A fixture's folder of the given files (linked), the last of them linked to the shared
 * tokenizer file `shared` instead (the fixture names it by a relative link, which a copy of
 * the fixtures may hold as a file of its path). */
static int make_folder(const char *folder, const char *fixture, const char *const *files,
                       int n_files, const char *shared)
{
    if (mkdir(folder, 0700) != 0)
        return -1;
    char from[4300], to[4300], abs[4096];
    for (int i = 0; i < n_files; i++) {
        if (i == n_files - 1)
            snprintf(from, sizeof from, "%s/%s", dir, shared);
        else
            snprintf(from, sizeof from, "%s/%s/%s", dir, fixture, files[i]);
        snprintf(to, sizeof to, "%s/%s", folder, files[i]);
        if (!realpath(from, abs) || symlink(abs, to) != 0)
            return -1;
    }
    return 0;
}

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

static void test_llama31(void)
{
    static const char *const files[] = {"config.json", "generation_config.json",
                                        "model.safetensors", "tokenizer_config.json",
                                        "tokenizer.json"};
    char folder[4200], f32[4200], peer[4200];
    snprintf(folder, sizeof folder, "%s/tiny-llama31", tmp);
    snprintf(f32, sizeof f32, "%s/tiny-llama31-f32.gguf", tmp);
    snprintf(peer, sizeof peer, "%s/tiny-llama31/model.gguf", dir);
    CHECK(make_folder(folder, "tiny-llama31", files, 5, "tokenizers/llama3/tokenizer.json") == 0,
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

    static char backends[MAX_TEST_BACKENDS][160];
    int n_backends = usable_backends(backends, MAX_TEST_BACKENDS);
    for (int i = 0; i < n_backends; i++) {
        check_model(dir, "tiny-llama31", f32, backends[i], "last_logits", 1e-4, 1,
                    "tiny-llama31 (loom convert, f32)");
        /* bf16 weights: AVX-512 BF16 rounds the activations to bf16 too (tiny-llama's bound) */
        check_model(dir, "tiny-llama31", folder, backends[i], "last_logits", 0.05, 1,
                    "tiny-llama31 folder (bf16)");
        /* f16 weights: the fixture's f16-compute evidence is 2e-3 */
        check_model(dir, "tiny-llama31", peer, backends[i], "last_logits", 1e-2, 1,
                    "tiny-llama31 as llama.cpp converted it (f16)");
    }
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
    CHECK(make_folder(folder, "tiny-mistral", files, 5, "tiny-llama/tokenizer.model") == 0,
          "making the folder");
    CHECK(loom_convert(folder, f32, "f32", NULL, NULL, err, sizeof err) == 0, "convert: %s", err);
    static char backends[MAX_TEST_BACKENDS][160];
    int n_backends = usable_backends(backends, MAX_TEST_BACKENDS);
    for (int i = 0; i < n_backends; i++) {
        check_model(dir, "tiny-mistral", f32, backends[i], "last_logits", 1e-4, 1,
                    "tiny-mistral (loom convert, f32)");
        check_model(dir, "tiny-mistral", folder, backends[i], "last_logits", 0.05, 1,
                    "tiny-mistral folder (bf16)");
    }
    unlink(f32);
    remove_folder(folder);
}

int main(void)
{
    snprintf(dir, sizeof dir, "%s", fixtures_dir());
    static const char *const needed[] = {
        "tiny-llama31/model.safetensors", "tokenizers/llama3/tokenizer.json",
        "tiny-mistral/model.safetensors", "tiny-llama/tokenizer.model"};
    char probe[4200];
    for (size_t i = 0; i < sizeof needed / sizeof needed[0]; i++) {
        snprintf(probe, sizeof probe, "%s/%s", dir, needed[i]);
        need_fixture(probe);
    }
    unsetenv("LOOM_BACKEND");
    if (!mkdtemp(tmp))
        return 1;
    test_llama31();
    test_mistral();
    rmdir(tmp);
    return check_finish("test_modern");
}
