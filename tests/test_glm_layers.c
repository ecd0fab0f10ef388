/*
 * tests/test_glm_layers.c - ChatGLM-6B, ChatGLM2, ChatGLM3 and GLM-4 against chatglm.cpp's per-layer
 * fixtures (peers/chatglm.cpp/tests_data, produced with the official Hugging Face modeling
 * code; layout in its FORMAT.md): a one-layer model with random weights, whose final hidden
 * states after a 3-token prefill and two decode steps must match within 5e-4, chatglm.cpp's own
 * tolerance.
 *
 * The .data file's tensors are written into a GGUF file with loom's "chatglm" convention and
 * an identity output matrix, so the logits loom returns are the hidden states. Each prefill row
 * is checked by running that prefix (the model is causal), and the decode steps continue the
 * cached sequence with loom_generate_from, so they go through the KV cache as real decoding does.
 * Every usable backend runs it, and ref with opaque buffers.
 */
#define _GNU_SOURCE
#include "check.h"
#include "core/gguf.h"
#include "backends.h"
#include "core/runner.h"
#include "models/models.h"

#include <loom/loom.h>

#include <stddef.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

enum { VOCAB = 5, HIDDEN = 32, HEADS = 8, GROUPS = 2, HEAD_DIM = 4, FFN = 48 };

typedef struct glm_file {
    float embd[VOCAB][HIDDEN], norm1[HIDDEN], qkv_w[48][HIDDEN], qkv_b[48], dense[HIDDEN][HIDDEN];
    float norm2[HIDDEN], up[2 * FFN][HIDDEN], down[HIDDEN][FFN], final_norm[HIDDEN];
    int32_t x1[3];
    float y1[3][HIDDEN];
    int32_t x2[1];
    float y2[HIDDEN];
    int32_t x3[1];
    float y3[HIDDEN];
} glm_file;

/* Reads the file's arrays in order; it must be consumed exactly. */
static int read_fixture(const char *path, glm_file *f)
{
    size_t len;
    char *bytes = slurp(path, &len);
    if (!bytes)
        return -1;
    int ok = len == sizeof *f;
    if (ok)
        memcpy(f, bytes, sizeof *f);
    free(bytes);
    return ok ? 0 : -1;
}

/* A placeholder vocabulary as wide as the identity "output" matrix; ids gmask and sop (or -1)
 * get ChatGLM's names, as control tokens. */
static void placeholder_vocab(loom_gguf_writer *w, int gmask, int sop)
{
    char names[HIDDEN][8];
    const char *tokens[HIDDEN];
    float scores[HIDDEN] = {0};
    int32_t types[HIDDEN];
    for (int i = 0; i < HIDDEN; i++) {
        snprintf(names[i], sizeof names[i], "t%d", i);
        tokens[i] = i == gmask ? "[gMASK]" : i == sop ? "<sop>" : names[i];
        types[i] = i == gmask || i == sop ? 3 : 1;
    }
    loom_gguf_set_str(w, "tokenizer.ggml.model", "llama");
    loom_gguf_set_str_array(w, "tokenizer.ggml.tokens", tokens, HIDDEN);
    loom_gguf_set_f32_array(w, "tokenizer.ggml.scores", scores, HIDDEN);
    loom_gguf_set_i32_array(w, "tokenizer.ggml.token_type", types, HIDDEN);
}

/* An f32 tensor of n1 rows of n0 (a vector when n1 is 1). */
static void add_f32(loom_gguf_writer *w, const char *name, const void *data, int64_t n0, int64_t n1)
{
    int64_t ne[2] = {n0, n1};
    loom_gguf_add_tensor(w, name, LOOM_F32, n1 > 1 ? 2 : 1, ne, data);
}

/* The data's VOCAB embedding rows, padded with zero rows to the placeholder vocabulary's
 * HIDDEN tokens (every token must have a row). */
static void add_embedding(loom_gguf_writer *w, const float (*embd)[HIDDEN])
{
    static float padded[HIDDEN][HIDDEN];
    memcpy(padded, embd, VOCAB * sizeof *padded);
    add_f32(w, "token_embd.weight", padded, HIDDEN, HIDDEN);
}

/* The output matrix that makes logits equal the final hidden states. */
static const float *identity_matrix(void)
{
    static float identity[HIDDEN][HIDDEN];
    for (int i = 0; i < HIDDEN; i++)
        identity[i][i] = 1.0f;
    return &identity[0][0];
}

static int finish_gguf(loom_gguf_writer *w, const char *out)
{
    char err[512];
    int rc = loom_gguf_write(w, out, err, sizeof err);
    if (rc)
        fprintf(stderr, "writing %s: %s\n", out, err);
    loom_gguf_writer_free(w);
    return rc;
}

static int write_gguf(const glm_file *f, float eps, const char *out)
{
    loom_gguf_writer *w = loom_gguf_writer_create();
    loom_gguf_set_str(w, "general.architecture", "chatglm");
    loom_gguf_set_str(w, "general.name", "chatglm.cpp per-layer fixture");
    loom_gguf_set_u32(w, "chatglm.context_length", 64);
    loom_gguf_set_u32(w, "chatglm.embedding_length", HIDDEN);
    loom_gguf_set_u32(w, "chatglm.block_count", 1);
    loom_gguf_set_u32(w, "chatglm.feed_forward_length", FFN);
    loom_gguf_set_u32(w, "chatglm.attention.head_count", HEADS);
    loom_gguf_set_u32(w, "chatglm.attention.head_count_kv", GROUPS);
    loom_gguf_set_u32(w, "chatglm.attention.key_length", HEAD_DIM);
    loom_gguf_set_u32(w, "chatglm.rope.dimension_count", HEAD_DIM / 2);
    loom_gguf_set_f32(w, "chatglm.rope.freq_base", 10000.0f);
    loom_gguf_set_f32(w, "chatglm.attention.layer_norm_rms_epsilon", eps);
    placeholder_vocab(w, -1, -1);
    loom_gguf_set_u32(w, "tokenizer.ggml.eos_token_id", HIDDEN - 1);
    add_embedding(w, f->embd);
    add_f32(w, "blk.0.attn_norm.weight", f->norm1, HIDDEN, 1);
    add_f32(w, "blk.0.attn_qkv.weight", f->qkv_w, HIDDEN, 48);
    add_f32(w, "blk.0.attn_qkv.bias", f->qkv_b, 48, 1);
    add_f32(w, "blk.0.attn_output.weight", f->dense, HIDDEN, HIDDEN);
    add_f32(w, "blk.0.ffn_norm.weight", f->norm2, HIDDEN, 1);
    add_f32(w, "blk.0.ffn_up.weight", f->up, HIDDEN, 2 * FFN);
    add_f32(w, "blk.0.ffn_down.weight", f->down, FFN, HIDDEN);
    add_f32(w, "output_norm.weight", f->final_norm, HIDDEN, 1);
    add_f32(w, "output.weight", identity_matrix(), HIDDEN, HIDDEN);
    return finish_gguf(w, out);
}

/* ChatGLM-6B (v1): glm_model.data, 52372 bytes (FORMAT.md) */
enum { FFN1 = 128 };
typedef struct glm1_file {
    float embd[VOCAB][HIDDEN], n1w[HIDDEN], n1b[HIDDEN], qkv_w[96][HIDDEN], qkv_b[96];
    float dense_w[HIDDEN][HIDDEN], dense_b[HIDDEN], n2w[HIDDEN], n2b[HIDDEN];
    float up_w[FFN1][HIDDEN], up_b[FFN1], down_w[HIDDEN][FFN1], down_b[HIDDEN], fw[HIDDEN],
        fb[HIDDEN];
    int32_t x1[3];
    float y1[3][HIDDEN];
    int32_t x2[1];
    float y2[HIDDEN];
    int32_t x3[1];
    float y3[HIDDEN];
} glm1_file;

/* The converter's job, done here: Hugging Face interleaves q, k, v per head (head h owns rows
 * 12h..12h+11); loom's chatglm1 convention stores [Q; K; V]. */
static void deinterleave(const glm1_file *f, float w[96][HIDDEN], float b[96])
{
    for (int h = 0; h < HEADS; h++)
        for (int part = 0; part < 3; part++)
            for (int i = 0; i < HEAD_DIM; i++) {
                int from = h * 3 * HEAD_DIM + part * HEAD_DIM + i,
                    to = part * HIDDEN + h * HEAD_DIM + i;
                memcpy(w[to], f->qkv_w[from], sizeof w[to]);
                b[to] = f->qkv_b[from];
            }
}

static int write_glm1_gguf(const glm1_file *f, const char *out)
{
    static float qkv_w[96][HIDDEN], qkv_b[96];
    deinterleave(f, qkv_w, qkv_b);
    loom_gguf_writer *w = loom_gguf_writer_create();
    loom_gguf_set_str(w, "general.architecture", "chatglm1");
    loom_gguf_set_u32(w, "chatglm1.context_length", 64);
    loom_gguf_set_u32(w, "chatglm1.embedding_length", HIDDEN);
    loom_gguf_set_u32(w, "chatglm1.block_count", 1);
    loom_gguf_set_u32(w, "chatglm1.feed_forward_length", FFN1);
    loom_gguf_set_u32(w, "chatglm1.attention.head_count", HEADS);
    loom_gguf_set_f32(w, "chatglm1.attention.layer_norm_epsilon", 1e-5f);
    loom_gguf_set_f32(w, "chatglm1.rope.freq_base", 10000.0f);
    placeholder_vocab(w, 1, 2); /* the fixture's ids 1 and 2 stand for [gMASK] and <sop> */
    add_embedding(w, f->embd);
    add_f32(w, "blk.0.attn_norm.weight", f->n1w, HIDDEN, 1);
    add_f32(w, "blk.0.attn_norm.bias", f->n1b, HIDDEN, 1);
    add_f32(w, "blk.0.attn_qkv.weight", qkv_w, HIDDEN, 96);
    add_f32(w, "blk.0.attn_qkv.bias", qkv_b, 96, 1);
    add_f32(w, "blk.0.attn_output.weight", f->dense_w, HIDDEN, HIDDEN);
    add_f32(w, "blk.0.attn_output.bias", f->dense_b, HIDDEN, 1);
    add_f32(w, "blk.0.ffn_norm.weight", f->n2w, HIDDEN, 1);
    add_f32(w, "blk.0.ffn_norm.bias", f->n2b, HIDDEN, 1);
    add_f32(w, "blk.0.ffn_up.weight", f->up_w, HIDDEN, FFN1);
    add_f32(w, "blk.0.ffn_up.bias", f->up_b, FFN1, 1);
    add_f32(w, "blk.0.ffn_down.weight", f->down_w, FFN1, HIDDEN);
    add_f32(w, "blk.0.ffn_down.bias", f->down_b, HIDDEN, 1);
    add_f32(w, "output_norm.weight", f->fw, HIDDEN, 1);
    add_f32(w, "output_norm.bias", f->fb, HIDDEN, 1);
    add_f32(w, "output.weight", identity_matrix(), HIDDEN, HIDDEN);
    return finish_gguf(w, out);
}

static double max_err(const float *got, const float *want);

/* ChatGLM-6B's vocab_size: the embedding's rows, as many as ice_text.model's pieces or more */
enum { GLM1_ROWS = 130528 };

/* The fixture as the Hugging Face folder it came from (config.json, model.safetensors with
 * the per-head interleaved QKV, ice_text.model), for loom convert to turn into chatglm1. The
 * embedding has the data's VOCAB rows, then zero rows up to GLM1_ROWS. */
static int write_glm1_folder(const glm1_file *f, const char *dir, const char *ice_text)
{
    static const struct {
        const char *name;
        int r, c;
        size_t off;
    } t[] = {
#define AT(field) offsetof(glm1_file, field)
        {"transformer.word_embeddings.weight", GLM1_ROWS, HIDDEN, AT(embd)},
        {"transformer.layers.0.input_layernorm.weight", 0, HIDDEN, AT(n1w)},
        {"transformer.layers.0.input_layernorm.bias", 0, HIDDEN, AT(n1b)},
        {"transformer.layers.0.attention.query_key_value.weight", 96, HIDDEN, AT(qkv_w)},
        {"transformer.layers.0.attention.query_key_value.bias", 0, 96, AT(qkv_b)},
        {"transformer.layers.0.attention.dense.weight", HIDDEN, HIDDEN, AT(dense_w)},
        {"transformer.layers.0.attention.dense.bias", 0, HIDDEN, AT(dense_b)},
        {"transformer.layers.0.post_attention_layernorm.weight", 0, HIDDEN, AT(n2w)},
        {"transformer.layers.0.post_attention_layernorm.bias", 0, HIDDEN, AT(n2b)},
        {"transformer.layers.0.mlp.dense_h_to_4h.weight", FFN1, HIDDEN, AT(up_w)},
        {"transformer.layers.0.mlp.dense_h_to_4h.bias", 0, FFN1, AT(up_b)},
        {"transformer.layers.0.mlp.dense_4h_to_h.weight", HIDDEN, FFN1, AT(down_w)},
        {"transformer.layers.0.mlp.dense_4h_to_h.bias", 0, HIDDEN, AT(down_b)},
        {"transformer.final_layernorm.weight", 0, HIDDEN, AT(fw)},
        {"transformer.final_layernorm.bias", 0, HIDDEN, AT(fb)},
        {"lm_head.weight", HIDDEN, HIDDEN, (size_t)-1},
#undef AT
    };
    enum { N = sizeof t / sizeof t[0] };
    char header[8192];
    int k = snprintf(header, sizeof header, "{");
    uint64_t at = 0;
    for (int i = 0; i < N; i++) {
        uint64_t bytes = (uint64_t)(t[i].r ? t[i].r : 1) * (uint64_t)t[i].c * 4;
        if (t[i].r)
            k += snprintf(
                header + k, sizeof header - (size_t)k,
                "%s\"%s\":{\"dtype\":\"F32\",\"shape\":[%d,%d],\"data_offsets\":[%llu,%llu]}",
                i ? "," : "", t[i].name, t[i].r, t[i].c, (unsigned long long)at,
                (unsigned long long)(at + bytes));
        else
            k += snprintf(
                header + k, sizeof header - (size_t)k,
                "%s\"%s\":{\"dtype\":\"F32\",\"shape\":[%d],\"data_offsets\":[%llu,%llu]}",
                i ? "," : "", t[i].name, t[i].c, (unsigned long long)at,
                (unsigned long long)(at + bytes));
        at += bytes;
    }
    k += snprintf(header + k, sizeof header - (size_t)k, "}");
    while (k % 8)
        header[k++] = ' ';
    char path[4600];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    FILE *out = fopen(path, "wb");
    if (!out)
        return -1;
    uint64_t hlen = (uint64_t)k;
    fwrite(&hlen, 8, 1, out);
    fwrite(header, 1, (size_t)k, out);
    for (int i = 0; i < N; i++) {
        size_t bytes = (size_t)(t[i].r ? t[i].r : 1) * (size_t)t[i].c * 4;
        if (t[i].off == offsetof(glm1_file, embd)) {
            fwrite(f->embd, 1, sizeof f->embd, out);
            for (size_t z = sizeof f->embd; z < bytes; z++)
                fputc(0, out);
            continue;
        }
        fwrite(t[i].off == (size_t)-1 ? (const void *)identity_matrix()
                                      : (const char *)f + t[i].off,
               1, bytes, out);
    }
    fclose(out);
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (!(out = fopen(path, "w")))
        return -1;
    fprintf(out,
            "{\"model_type\": \"chatglm\", \"hidden_size\": %d, \"num_layers\": 1, "
            "\"num_attention_heads\": %d, \"inner_hidden_size\": %d, \"vocab_size\": %d, "
            "\"max_sequence_length\": 64, \"layernorm_epsilon\": 1e-05, "
            "\"position_encoding_2d\": true}\n",
            HIDDEN, HEADS, FFN1, GLM1_ROWS);
    fclose(out);
    snprintf(path, sizeof path, "%s/ice_text.model", dir);
    char *target = realpath(ice_text, NULL); /* the link must not depend on our directory */
    int rc = target ? symlink(target, path) : -1;
    free(target);
    return rc;
}

/* ChatGLM-6B needs every prefill row at once (tokens 0 and 1 see each other), so this drives
 * the runner directly: one step of the three prompt tokens wanting all their logits, then two
 * decode steps, all with the bidirectional prefix the model derives from [gMASK]. */
static void check_glm1(const char *gguf_path, const glm1_file *f, const char *backend,
                       const char *label, int32_t forced_prefix)
{
    char err[512];
    loom_gguf g;
    loom_registry reg;
    loom_device dev;
    if (loom_gguf_open(&g, gguf_path, err, sizeof err) != 0) {
        CHECK(0, "%s", err);
        return;
    }
    loom_loader_options loader = loom_loader_options_from_env();
    int ok = loom_registry_scan(&reg, &loader, err, sizeof err) == 0 &&
        loom_registry_select(&reg, backend, err, sizeof err) == 0 &&
        loom_device_open_chosen(&dev, &reg, 0, err, sizeof err) == 0;
    loom_registry_free(&reg);
    CHECK(ok, "ChatGLM-6B on %s: %s", label, err);
    if (!ok) {
        loom_gguf_close(&g);
        return;
    }
    loom_runner_options ro = {.n_ctx = 16, .kv_type = LOOM_F32};
    loom_runner *r = loom_runner_create(&dev, &g, loom_models_find("chatglm1"), &ro, err,
                                        sizeof err);
    CHECK(r != NULL, "ChatGLM-6B runner on %s: %s", label, err);
    if (r) {
        int32_t prefix = forced_prefix ? forced_prefix : loom_runner_prefix_len(r, f->x1, 3);
        CHECK(prefix == 2, "the prefix ends after [gMASK]: got %d", prefix);
        int32_t pos[3] = {0, 1, 2}, seq[3] = {0, 0, 0}, table[1] = {0}, rows[3] = {0, 1, 2};
        loom_step st = {3, f->x1, pos, seq, pos, 1, 1, table, 3, rows, &prefix};
        double worst = 0;
        CHECK(loom_runner_step(r, &st, err, sizeof err) == 0, "prefill: %s", err);
        for (int i = 0; i < 3; i++) {
            double e = max_err(loom_runner_logits(r) + i * HIDDEN, f->y1[i]);
            CHECK(e < 5e-4, "ChatGLM-6B on %s: prefill row %d differs by %g", label, i, e);
            worst = e > worst ? e : worst;
        }
        const int32_t *next[2] = {f->x2, f->x3};
        const float *want[2] = {f->y2, f->y3};
        for (int k = 0; k < 2; k++) {
            int32_t p = 3 + k, zero = 0;
            loom_step d = {1, next[k], &p, &zero, &p, 1, 1, table, 1, &zero, &prefix};
            CHECK(loom_runner_step(r, &d, err, sizeof err) == 0, "decode %d: %s", k, err);
            double e = max_err(loom_runner_logits(r), want[k]);
            CHECK(e < 5e-4, "ChatGLM-6B on %s: decode step %d differs by %g", label, k + 1, e);
            worst = e > worst ? e : worst;
        }
        printf("ChatGLM-6B on %s: max error %.2g over prefill and two decode steps\n", label,
               worst);
        loom_runner_free(r);
    }
    loom_device_close(&dev);
    loom_gguf_close(&g);
}

static double max_err(const float *got, const float *want)
{
    double e = 0;
    for (int i = 0; i < HIDDEN; i++)
        e = fabs((double)got[i] - want[i]) > e ? fabs((double)got[i] - want[i]) : e;
    return e;
}

static void check_model(const char *what, const char *gguf, const glm_file *f, const char *backend,
                        const char *label)
{
    char err[512];
    loom_model_options o = {.backend = backend, .kv_type = "f32"};
    loom_model *m = loom_model_open(gguf, &o, err, sizeof err);
    CHECK(m != NULL, "%s on %s: %s", what, label, err);
    if (!m)
        return;
    loom_sampling greedy = loom_sampling_defaults();
    greedy.temperature = 0;
    double worst = 0;
    for (int n = 1; n <= 3; n++) {
        int rc = loom_generate(m, f->x1, n, 0, &greedy, NULL, NULL, NULL, err, sizeof err);
        CHECK(rc == 0, "%s prefill of %d: %s", what, n, err);
        double e = max_err(loom_prompt_logits(m), f->y1[n - 1]);
        CHECK(e < 5e-4, "%s on %s: prefill row %d differs by %g", what, label, n - 1, e);
        worst = e > worst ? e : worst;
    }
    /* the cache holds positions 0..2 from the last prefill: decode 3, then 4 */
    CHECK(loom_generate_from(m, f->x2, 1, 3, 0, &greedy, NULL, NULL, NULL, err, sizeof err) == 0,
          "%s decode 1: %s", what, err);
    double e2 = max_err(loom_prompt_logits(m), f->y2);
    CHECK(loom_generate_from(m, f->x3, 1, 4, 0, &greedy, NULL, NULL, NULL, err, sizeof err) == 0,
          "%s decode 2: %s", what, err);
    double e3 = max_err(loom_prompt_logits(m), f->y3);
    CHECK(e2 < 5e-4 && e3 < 5e-4, "%s on %s: decode steps differ by %g and %g", what, label, e2,
          e3);
    worst = e2 > worst ? e2 : worst;
    worst = e3 > worst ? e3 : worst;
    printf("%s on %s: max error %.2g over prefill and two decode steps\n", what, label, worst);
    loom_model_close(m);
}

int main(void)
{
    static const struct {
        const char *file, *name;
        float eps;
    } cases[] = {
        {"glm2_model.data", "ChatGLM2", 1e-5f},
        {"glm3_model.data", "ChatGLM3", 1e-5f},
        {"glm4_model.data", "GLM-4", 1.5625e-07f}, /* glm-4-9b-chat's layernorm_epsilon */
    };
    char dir[4200], path[4400], tmp[] = "/tmp/loom-glm-XXXXXX";
    snprintf(dir, sizeof dir, "%s/peers/chatglm.cpp/tests_data", fixtures_dir());
    snprintf(path, sizeof path, "%s/glm2_model.data", dir);
    need_fixture(path);
    if (!mkdtemp(tmp))
        return 1;
    unsetenv("LOOM_BACKEND");
    static char backends[MAX_TEST_BACKENDS][160];
    int n_backends = usable_backends(backends, MAX_TEST_BACKENDS);
    if (n_backends < 0)
        return 1;
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        static glm_file f;
        snprintf(path, sizeof path, "%s/%s", dir, cases[k].file);
        int readable = read_fixture(path, &f) == 0;
        CHECK(readable, "%s: not the documented 30548-byte layout", path);
        char gguf[4400];
        snprintf(gguf, sizeof gguf, "%s/%s.gguf", tmp, cases[k].file);
        if (!readable || write_gguf(&f, cases[k].eps, gguf) != 0)
            break;
        CHECK(f.x1[0] == 0 && f.x1[1] == 1 && f.x1[2] == 2 && f.x2[0] == 3 && f.x3[0] == 4,
              "%s: unexpected token ids", path);
        for (int i = 0; i < n_backends; i++) {
            const char *label = backends[i];
            check_model(cases[k].name, gguf, &f, label, label);
        }
        setenv("LOOM_REF_OPAQUE", "1", 1);
        check_model(cases[k].name, gguf, &f, "ref", "ref (opaque buffers)");
        unsetenv("LOOM_REF_OPAQUE");
        unlink(gguf);
    }
    /* ChatGLM-6B (v1) */
    static glm1_file f1;
    snprintf(path, sizeof path, "%s/glm_model.data", dir);
    size_t len;
    char *bytes = slurp(path, &len);
    CHECK(bytes && len == sizeof f1, "%s: not the documented 52372-byte layout", path);
    if (bytes && len == sizeof f1) {
        memcpy(&f1, bytes, sizeof f1);
        char gguf[4400];
        snprintf(gguf, sizeof gguf, "%s/glm1.gguf", tmp);
        if (write_glm1_gguf(&f1, gguf) == 0) {
            for (int i = 0; i < n_backends; i++) {
                const char *label = backends[i];
                check_glm1(gguf, &f1, label, label, 0);
            }
            setenv("LOOM_REF_OPAQUE", "1", 1);
            check_glm1(gguf, &f1, "ref", "ref (opaque buffers)", 0);
            unsetenv("LOOM_REF_OPAQUE");
            unlink(gguf);
        }
        /* the same through loom convert of the Hugging Face folder: config keys, names, the
         * QKV de-interleaving (ice_text's [gMASK] is 130001, not the fixture's 1: the prefix
         * is given) */
        char hf[4400], ice[4400], conv[4400], cerr[512];
        snprintf(hf, sizeof hf, "%s/hf-glm1", tmp);
        snprintf(ice, sizeof ice, "%s/tokenizers/chatglm1/ice_text.model", fixtures_dir());
        snprintf(conv, sizeof conv, "%s/glm1-converted.gguf", tmp);
        need_fixture(ice);
        CHECK(mkdir(hf, 0700) == 0 && write_glm1_folder(&f1, hf, ice) == 0, "writing %s", hf);
        int converted = loom_convert(hf, conv, "f32", NULL, NULL, cerr, sizeof cerr) == 0;
        CHECK(converted, "loom convert of the ChatGLM-6B folder: %s", cerr);
        if (converted)
            check_glm1(conv, &f1, "cpu", "cpu (converted from the folder)", 2);
        unlink(conv);
        char p2[4500];
        snprintf(p2, sizeof p2, "%s/model.safetensors", hf), unlink(p2);
        snprintf(p2, sizeof p2, "%s/config.json", hf), unlink(p2);
        snprintf(p2, sizeof p2, "%s/ice_text.model", hf), unlink(p2);
        rmdir(hf);
    }
    free(bytes);
    rmdir(tmp);
    return check_finish("test_glm_layers");
}
