/*
 * tests/test_family.c - a model family added the way docs/ARCHITECTURE.md says: one
 * declaration (models/family.h) naming its Hugging Face config keys and tensors, registered,
 * and nothing else touched. "toylm" is a made-up Hugging Face form of the Llama architecture
 * with config keys and tensor names of its own; tiny-llama's weights, rewritten into that
 * form, must convert through the generic writer and reproduce tiny-llama's PyTorch logits and
 * greedy tokens (converted to GGUF, and opened as a folder), on every usable backend. The
 * table's rules are checked too: a required key missing is named, a tensor the family
 * declares unsupported is refused, a layer count no model has is refused before any tensor is
 * looked for, and a second claim to a model_type is refused.
 */
#define _GNU_SOURCE
#include <loom/loom.h>

#include "models/models.h"
#include "backends.h"
#include "fixture_model.h"

#include "check.h"
#include "hf_writer.h"

#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char err[4096], fixtures[4096], tmp[] = "/tmp/loom-family-XXXXXX";

/* ---- the family: this is all a new Hugging Face form of a known architecture needs ------- */

static const loom_hf_param toylm_params[] = {
    {"context_length", "max_seq_len", LOOM_HF_U32, 2048},
    {"embedding_length", "d_model", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"block_count", "n_layers", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"feed_forward_length", "d_ff", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"attention.head_count", "n_heads", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"attention.head_count_kv", "n_kv_heads|n_heads", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"attention.layer_norm_rms_epsilon", "norm_eps", LOOM_HF_F32, 1e-5},
    {"rope.freq_base", "rope.theta", LOOM_HF_F32, 10000.0},
    {0}};

static const loom_hf_tensor toylm_tensors[] = {
    {"tok.weight", "token_embd.weight", 0, NULL},
    {"final_norm.weight", "output_norm.weight", 0, NULL},
    {"unembed.weight", "output.weight", 0, "tok.weight"},
    {"blocks.%d.pre_attn.weight", "blk.%d.attn_norm.weight", 0, NULL},
    {"blocks.%d.attn.wq.weight", "blk.%d.attn_q.weight", LOOM_HF_ROPE_Q, NULL},
    {"blocks.%d.attn.wk.weight", "blk.%d.attn_k.weight", LOOM_HF_ROPE_K, NULL},
    {"blocks.%d.attn.wv.weight", "blk.%d.attn_v.weight", 0, NULL},
    {"blocks.%d.attn.wq.bias", "toylm's attention has no biases", LOOM_HF_UNSUPPORTED, NULL},
    {"blocks.%d.attn.wo.weight", "blk.%d.attn_output.weight", 0, NULL},
    {"blocks.%d.pre_mlp.weight", "blk.%d.ffn_norm.weight", 0, NULL},
    {"blocks.%d.mlp.gate.weight", "blk.%d.ffn_gate.weight", 0, NULL},
    {"blocks.%d.mlp.up.weight", "blk.%d.ffn_up.weight", 0, NULL},
    {"blocks.%d.mlp.down.weight", "blk.%d.ffn_down.weight", 0, NULL},
    {0}};

static const loom_family toylm = {.arch = &loom_arch_llama,
                                  .hf_model_type = "toylm",
                                  .hf_params = toylm_params,
                                  .hf_tensors = toylm_tensors};

/* ---- tiny-llama rewritten as a toylm folder ---------------------------------------------- */

/* with_bias: one tensor the family refuses, to see it refused */
static int make_toylm(const char *folder, int with_bias, const char *config)
{
    char p[4400];
    snprintf(p, sizeof p, "%s/tiny-llama", fixtures);
    loom_safetensors st;
    if (loom_safetensors_open(&st, p, err, sizeof err) != 0) {
        CHECK(0, "tiny-llama: %s", err);
        return -1;
    }
    mkdir(folder, 0755);
    st_out o = {cJSON_CreateObject(), NULL, 0, 0};
    st_copy(&o, &st, "model.embed_tokens.weight", "tok.weight");
    st_copy(&o, &st, "model.norm.weight", "final_norm.weight");
    st_copy(&o, &st, "lm_head.weight", "unembed.weight");
    static const char *const names[][2] = {
        {"input_layernorm", "pre_attn"}, {"self_attn.q_proj", "attn.wq"},
        {"self_attn.k_proj", "attn.wk"}, {"self_attn.v_proj", "attn.wv"},
        {"self_attn.o_proj", "attn.wo"}, {"post_attention_layernorm", "pre_mlp"},
        {"mlp.gate_proj", "mlp.gate"},   {"mlp.up_proj", "mlp.up"},
        {"mlp.down_proj", "mlp.down"}};
    for (int l = 0; l < 2; l++)
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
            char from[128], to[128];
            snprintf(from, sizeof from, "model.layers.%d.%s.weight", l, names[i][0]);
            snprintf(to, sizeof to, "blocks.%d.%s.weight", l, names[i][1]);
            st_copy(&o, &st, from, to);
        }
    if (with_bias)
        st_copy(&o, &st, "model.norm.weight", "blocks.1.attn.wq.bias");
    snprintf(p, sizeof p, "%s/model.safetensors", folder);
    int rc = st_write(&o, p);
    loom_safetensors_close(&st);
    write_text(folder, "config.json", config);
    static const char *const tokenizer_files[] = {"tokenizer.model", "tokenizer_config.json",
                                                  "generation_config.json"};
    for (size_t i = 0; i < sizeof tokenizer_files / sizeof tokenizer_files[0]; i++) {
        snprintf(p, sizeof p, "%s/tiny-llama/%s", fixtures, tokenizer_files[i]);
        link_file(folder, tokenizer_files[i], p);
    }
    return rc;
}

/* tiny-llama's numbers under toylm's keys */
static const char toylm_config[] =
    "{\"model_type\": \"toylm\", \"d_model\": 64, \"n_layers\": 2, \"n_heads\": 4, "
    "\"n_kv_heads\": 2, \"d_ff\": 192, \"norm_eps\": 1e-05, \"rope\": {\"theta\": 10000.0}, "
    "\"max_seq_len\": 4096, \"vocab_size\": 32000}";

static void test_registration(void)
{
    CHECK(loom_models_register(&toylm) == 0, "toylm registers");
    CHECK(loom_models_register(&toylm) != 0, "the same family twice is refused");
    loom_family llama_again = toylm;
    llama_again.hf_model_type = "llama";
    CHECK(loom_models_register(&llama_again) != 0, "a second claim to model_type llama is refused");
    CHECK(strstr(loom_models_known_hf(), "toylm") != NULL,
          "toylm is listed among the converted "
          "types: %s",
          loom_models_known_hf());
}

static void test_toylm_runs(void)
{
    char folder[4200], out[4200];
    snprintf(folder, sizeof folder, "%s/toylm", tmp);
    snprintf(out, sizeof out, "%s/toylm.gguf", tmp);
    if (make_toylm(folder, 0, toylm_config) != 0)
        return;
    CHECK(loom_convert(folder, out, "f32", NULL, NULL, err, sizeof err) == 0, "convert: %s", err);
    static char backends[MAX_TEST_BACKENDS][160];
    int n_backends = usable_backends(backends, MAX_TEST_BACKENDS);
    for (int i = 0; i < n_backends; i++) {
        check_model(fixtures, "tiny-llama", out, backends[i], "last_logits", 1e-4, 1,
                    "toylm converted (f32)");
        check_model(fixtures, "tiny-llama", folder, backends[i], "last_logits", 0.05, 1,
                    "toylm folder (bf16)");
    }
    unlink(out);
    remove_folder(folder);
}

static void test_toylm_errors(void)
{
    char folder[4200], out[4200];
    snprintf(folder, sizeof folder, "%s/toylm-bias", tmp);
    snprintf(out, sizeof out, "%s/toylm-bias.gguf", tmp);
    if (make_toylm(folder, 1, toylm_config) != 0)
        return;
    CHECK(loom_convert(folder, out, "f32", NULL, NULL, err, sizeof err) != 0 &&
              strstr(err, "blocks.1.attn.wq.bias") && strstr(err, "no biases"),
          "a tensor the family refuses is named, with the family's reason: %s", err);
    remove_folder(folder);

    snprintf(folder, sizeof folder, "%s/toylm-no-d_model", tmp);
    if (make_toylm(folder, 0,
                   "{\"model_type\": \"toylm\", \"n_layers\": 2, \"n_heads\": 4, "
                   "\"d_ff\": 192}") != 0)
        return;
    CHECK(loom_convert(folder, out, "f32", NULL, NULL, err, sizeof err) != 0 &&
              strstr(err, "config.json") && strstr(err, "d_model"),
          "a required config key missing is named: %s", err);
    remove_folder(folder);

    snprintf(folder, sizeof folder, "%s/toylm-huge", tmp);
    if (make_toylm(folder, 0,
                   "{\"model_type\": \"toylm\", \"d_model\": 64, \"n_layers\": 4000000000, "
                   "\"n_heads\": 4, \"d_ff\": 192}") != 0)
        return;
    CHECK(loom_convert(folder, out, "f32", NULL, NULL, err, sizeof err) != 0 &&
              strstr(err, "n_layers is 4000000000"),
          "a layer count past what loom runs is refused at once: %s", err);
    remove_folder(folder);
    unlink(out);
}

int main(void)
{
    snprintf(fixtures, sizeof fixtures, "%s", fixtures_dir());
    char probe[4200];
    snprintf(probe, sizeof probe, "%s/tiny-llama/model.safetensors", fixtures);
    need_fixture(probe);
    unsetenv("LOOM_BACKEND");
    if (!mkdtemp(tmp))
        return 1;
    test_registration();
    test_toylm_runs();
    test_toylm_errors();
    rmdir(tmp);
    return check_finish("test_family");
}
