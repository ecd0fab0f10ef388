/*
 * tests/test_mla.c - multi-head latent attention (GGUF "deepseek2", models/deepseek2.c) on
 * tiny-glm47-flash: the model.gguf llama.cpp's 2026 converter wrote from a GLM-4.7-Flash-shaped
 * checkpoint (Glm4MoeLiteForCausalLM), held on every usable backend to the reference's
 * (PyTorch, float64) last-prompt logits and greedy tokens for every case. The fixture's README
 * says what each part is worth: interleaved RoPE (0.32 if rotate-half), the choice bias (0.84),
 * sigmoid gating (1.08; llama.cpp's own loader gates this file by softmax: see the README), so a
 * tolerance of 1e-4 sees each (measured: 5e-7 with an f32 KV cache). Also: `loom verify`
 * passes the file (its leading dense layer and its MTP block are layers of their own kinds),
 * and a file in the older MLA layout (attn_kv_b whole) is refused by name.
 */
#define _GNU_SOURCE
#include <loom/loom.h>

#include "core/gguf.h"
#include "backends.h"
#include "check.h"
#include "fixture_model.h"

#include <string.h>
#include <unistd.h>

static char dir[4096], err[4096];

static int verify_problems;
static void on_check(void *user, const char *check, loom_check_status status, const char *msg)
{
    (void)user;
    if (status == LOOM_CHECK_PROBLEM) {
        verify_problems++;
        fprintf(stderr, "verify: %s: %s\n", check, msg);
    }
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

int main(void)
{
    snprintf(dir, sizeof dir, "%s", fixtures_dir());
    static const char *const needed[] = {"tiny-glm47-flash/model.gguf",
                                         "tiny-glm47-flash/expected.json"};
    need_fixtures(dir, needed, sizeof needed / sizeof needed[0]);
    unsetenv("LOOM_BACKEND");
    char model[4400];
    snprintf(model, sizeof model, "%s/tiny-glm47-flash/model.gguf", dir);
    static char backends[MAX_TEST_BACKENDS][160];
    int nb = usable_backends(backends, MAX_TEST_BACKENDS);
    for (int b = 0; b < nb; b++)
        check_model(dir, "tiny-glm47-flash", model, backends[b], "last_logits", 1e-4, 1,
                    "tiny-glm47-flash (llama.cpp's GGUF, f16)");
    CHECK(loom_verify(model, on_check, NULL) == 0 && verify_problems == 0,
          "loom verify finds a problem in llama.cpp's deepseek2 file");
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
