/*
 * tests/gguf_conventions.h - the GGUF conventions a file loom writes must follow, per
 * architecture, as another reader (llama.cpp) expects them: the hyper-parameter keys it
 * requires, and every tensor's shape in terms of them. Written from llama.cpp's model loader
 * (src/llama-model.cpp at c392e50: the create_tensor shapes) and its converter's keys; the same
 * table is in docs/gguf.md. Shapes are GGUF's, innermost first: {n_embd, n_vocab} is n_vocab
 * rows of n_embd.
 *
 * `chatglm1` (ChatGLM-6B) is loom's own architecture (llama.cpp has none) and is not checked.
 */
#ifndef LOOM_TESTS_GGUF_CONVENTIONS_H
#define LOOM_TESTS_GGUF_CONVENTIONS_H

#include "core/gguf.h"

#include "check.h"

#include <stdio.h>
#include <string.h>

static int64_t convention_key(const loom_gguf *g, const char *arch, const char *key,
                              int64_t fallback, int required, const char *label)
{
    char full[160];
    int64_t v;
    snprintf(full, sizeof full, "%s.%s", arch, key);
    if (loom_gguf_get_i64(g, full, &v) == 0)
        return v;
    CHECK(!required, "%s: the file has no %s, which GGUF readers require", label, full);
    return fallback;
}

/* Tensor name (printf-style with the layer) has shape {ne0, ne1} (ne1 0: one dimension). */
static void convention_shape(const loom_gguf *g, const char *label, int required, int64_t ne0,
                             int64_t ne1, const char *fmt, int layer)
{
    char name[160];
    snprintf(name, sizeof name, fmt, layer);
    const loom_gguf_tensor *t = loom_gguf_find_tensor(g, name);
    if (!t) {
        CHECK(!required, "%s: no tensor %s", label, name);
        return;
    }
    int64_t want_dims = ne1 ? 2 : 1;
    CHECK((int64_t)t->n_dims == want_dims && t->ne[0] == ne0 && (!ne1 || t->ne[1] == ne1),
          "%s: %s is {%lld, %lld}, the convention says {%lld, %lld}", label, name,
          (long long)t->ne[0], (long long)(t->n_dims > 1 ? t->ne[1] : 0), (long long)ne0,
          (long long)ne1);
}

/* The same for a stack of matrices {ne0, ne1, ne2} (the experts' ffn_*_exps). */
static void convention_shape3(const loom_gguf *g, const char *label, int64_t ne0, int64_t ne1,
                              int64_t ne2, const char *fmt, int layer)
{
    char name[160];
    snprintf(name, sizeof name, fmt, layer);
    const loom_gguf_tensor *t = loom_gguf_find_tensor(g, name);
    CHECK(t && t->n_dims == 3 && t->ne[0] == ne0 && t->ne[1] == ne1 && t->ne[2] == ne2,
          "%s: %s is not {%lld, %lld, %lld}", label, name, (long long)ne0, (long long)ne1,
          (long long)ne2);
}

/* The hybrid families (qwen35, qwen35moe, qwen3next), from llama.cpp's src/models/qwen35*.cpp
 * and qwen3next.cpp (d32676d): the ssm keys, then per layer the linear-attention or gated
 * attention tensors, and the MLP or the experts. */
static void check_hybrid_conventions(const loom_gguf *g, const char *arch, const char *label)
{
    const int moe = strcmp(arch, "qwen35"), next = !strcmp(arch, "qwen3next");
    int64_t E = convention_key(g, arch, "embedding_length", 0, 1, label);
    /* the last nextn_predict_layers blocks are the multi-token-prediction head */
    int64_t L = convention_key(g, arch, "block_count", 0, 1, label) -
        convention_key(g, arch, "nextn_predict_layers", 0, 0, label);
    int64_t H = convention_key(g, arch, "attention.head_count", 1, 1, label);
    int64_t Hkv = convention_key(g, arch, "attention.head_count_kv", H, 0, label);
    int64_t hd = convention_key(g, arch, "attention.key_length", 0, 1, label);
    int64_t K = convention_key(g, arch, "ssm.conv_kernel", 0, 1, label);
    int64_t dk = convention_key(g, arch, "ssm.state_size", 0, 1, label);
    int64_t Gk = convention_key(g, arch, "ssm.group_count", 0, 1, label);
    int64_t Hv = convention_key(g, arch, "ssm.time_step_rank", 1, 1, label);
    int64_t inner = convention_key(g, arch, "ssm.inner_size", 0, 1, label);
    int64_t interval = convention_key(g, arch, "full_attention_interval", 4, 0, label);
    int64_t F = convention_key(g, arch, "feed_forward_length", 0, !moe, label);
    int64_t X = moe ? convention_key(g, arch, "expert_count", 0, 1, label) : 0;
    int64_t Fx = moe ? convention_key(g, arch, "expert_feed_forward_length", 0, 1, label) : 0;
    int64_t Fs = moe ? convention_key(g, arch, "expert_shared_feed_forward_length", 0, 1, label)
                     : 0;
    char key[96];
    snprintf(key, sizeof key, "%s.rope.dimension_sections", arch);
    CHECK(next || loom_gguf_find(g, key), "%s: no %s, which llama.cpp's %s loader requires", label,
          key, arch);
    const int64_t conv = 2 * Gk * dk + inner;
    for (int l = 0; l < (int)L; l++) {
        convention_shape(g, label, 1, E, 0, "blk.%d.attn_norm.weight", l);
        convention_shape(g, label, 1, E, 0, "blk.%d.post_attention_norm.weight", l);
        if ((l + 1) % interval) {
            convention_shape(g, label, 1, E, conv, "blk.%d.attn_qkv.weight", l);
            convention_shape(g, label, 1, E, inner, "blk.%d.attn_gate.weight", l);
            convention_shape(g, label, 1, K, conv, "blk.%d.ssm_conv1d.weight", l);
            convention_shape(g, label, 1, Hv, 0, "blk.%d.ssm_dt.bias", l);
            convention_shape(g, label, 1, Hv, 0, "blk.%d.ssm_a", l);
            convention_shape(g, label, 1, inner / Hv, 0, "blk.%d.ssm_norm.weight", l);
            convention_shape(g, label, 1, inner, E, "blk.%d.ssm_out.weight", l);
            if (next) {
                convention_shape(g, label, 1, E, 2 * Hv, "blk.%d.ssm_ba.weight", l);
            } else {
                convention_shape(g, label, 1, E, Hv, "blk.%d.ssm_beta.weight", l);
                convention_shape(g, label, 1, E, Hv, "blk.%d.ssm_alpha.weight", l);
            }
        } else {
            convention_shape(g, label, 1, E, 2 * hd * H, "blk.%d.attn_q.weight", l);
            convention_shape(g, label, 1, E, hd * Hkv, "blk.%d.attn_k.weight", l);
            convention_shape(g, label, 1, E, hd * Hkv, "blk.%d.attn_v.weight", l);
            convention_shape(g, label, 1, hd * H, E, "blk.%d.attn_output.weight", l);
            convention_shape(g, label, 1, hd, 0, "blk.%d.attn_q_norm.weight", l);
            convention_shape(g, label, 1, hd, 0, "blk.%d.attn_k_norm.weight", l);
        }
        if (!moe) {
            convention_shape(g, label, 1, E, F, "blk.%d.ffn_gate.weight", l);
            convention_shape(g, label, 1, E, F, "blk.%d.ffn_up.weight", l);
            convention_shape(g, label, 1, F, E, "blk.%d.ffn_down.weight", l);
            continue;
        }
        convention_shape(g, label, 1, E, X, "blk.%d.ffn_gate_inp.weight", l);
        convention_shape3(g, label, E, Fx, X, "blk.%d.ffn_gate_exps.weight", l);
        convention_shape3(g, label, E, Fx, X, "blk.%d.ffn_up_exps.weight", l);
        convention_shape3(g, label, Fx, E, X, "blk.%d.ffn_down_exps.weight", l);
        convention_shape(g, label, 1, E, Fs, "blk.%d.ffn_gate_shexp.weight", l);
        convention_shape(g, label, 1, E, Fs, "blk.%d.ffn_up_shexp.weight", l);
        convention_shape(g, label, 1, Fs, E, "blk.%d.ffn_down_shexp.weight", l);
        convention_shape(g, label, 1, E, 1, "blk.%d.ffn_gate_inp_shexp.weight", l);
    }
}

static void check_gguf_conventions(const char *path, const char *label)
{
    loom_gguf g;
    char err[512];
    if (loom_gguf_open(&g, path, err, sizeof err) != 0) {
        CHECK(0, "%s: %s", label, err);
        return;
    }
    const char *s;
    uint64_t len;
    char arch[32] = "";
    if (loom_gguf_get_str(&g, "general.architecture", &s, &len) == 0 && len < sizeof arch)
        memcpy(arch, s, len), arch[len] = '\0';
    int moe = !strcmp(arch, "qwen2moe") || !strcmp(arch, "qwen3moe");
    int glm4 = !strcmp(arch, "glm4"); /* GLM-4-0414: fused ffn_up, two post-norms */
    int llama_like = !strcmp(arch, "llama") || !strcmp(arch, "qwen2") || !strcmp(arch, "qwen3") ||
        moe || glm4;
    int qwen1 = !strcmp(arch, "qwen"), glm = !strcmp(arch, "chatglm");
    if (!strcmp(arch, "qwen35") || !strcmp(arch, "qwen35moe") || !strcmp(arch, "qwen3next")) {
        check_hybrid_conventions(&g, arch, label);
        loom_gguf_close(&g);
        return;
    }
    CHECK(llama_like || qwen1 || glm || !strcmp(arch, "chatglm1"), "%s: architecture '%s'", label,
          arch);
    if (!llama_like && !qwen1 && !glm) {
        loom_gguf_close(&g);
        return;
    }
    int64_t E = convention_key(&g, arch, "embedding_length", 0, 1, label);
    int64_t L = convention_key(&g, arch, "block_count", 0, 1, label);
    int64_t F = convention_key(&g, arch, "feed_forward_length", 0, !moe, label);
    int64_t X = moe ? convention_key(&g, arch, "expert_count", 0, 1, label) : 0;
    int64_t Fx = moe ? convention_key(&g, arch, "expert_feed_forward_length", 0, 1, label) : 0;
    int64_t Fs = convention_key(&g, arch, "expert_shared_feed_forward_length", 0, 0, label);
    if (moe)
        convention_key(&g, arch, "expert_used_count", 0, 1, label);
    int64_t H = convention_key(&g, arch, "attention.head_count", 1, 1, label);
    int64_t Hkv = convention_key(&g, arch, "attention.head_count_kv", H, 0, label);
    int64_t hd = convention_key(&g, arch, "attention.key_length", H ? E / H : 0, 0, label);
    convention_key(&g, arch, "context_length", 0, 1, label);
    double eps;
    char key[160];
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", arch);
    CHECK(loom_gguf_get_f64(&g, key, &eps) == 0 && eps > 0, "%s: %s is required", label, key);
    const loom_gguf_kv *tokens = loom_gguf_find(&g, "tokenizer.ggml.tokens");
    int64_t V = tokens ? (int64_t)tokens->count : 0;
    CHECK(V > 0, "%s: no tokenizer.ggml.tokens", label);

    convention_shape(&g, label, 1, E, V, "token_embd.weight", 0);
    convention_shape(&g, label, 1, E, 0, "output_norm.weight", 0);
    convention_shape(&g, label, 0, E, V, "output.weight", 0); /* absent when tied */
    for (int l = 0; l < (int)L; l++) {
        convention_shape(&g, label, 1, E, 0, "blk.%d.attn_norm.weight", l);
        convention_shape(&g, label, 1, E, 0, "blk.%d.ffn_norm.weight", l);
        if (llama_like) {
            convention_shape(&g, label, 1, E, hd * H, "blk.%d.attn_q.weight", l);
            convention_shape(&g, label, 1, E, hd * Hkv, "blk.%d.attn_k.weight", l);
            convention_shape(&g, label, 1, E, hd * Hkv, "blk.%d.attn_v.weight", l);
            convention_shape(&g, label, 1, hd * H, E, "blk.%d.attn_output.weight", l);
            if (moe) {
                convention_shape(&g, label, 1, E, X, "blk.%d.ffn_gate_inp.weight", l);
                convention_shape3(&g, label, E, Fx, X, "blk.%d.ffn_gate_exps.weight", l);
                convention_shape3(&g, label, E, Fx, X, "blk.%d.ffn_up_exps.weight", l);
                convention_shape3(&g, label, Fx, E, X, "blk.%d.ffn_down_exps.weight", l);
                int shared = !strcmp(arch, "qwen2moe");
                convention_shape(&g, label, shared, E, Fs, "blk.%d.ffn_gate_shexp.weight", l);
                convention_shape(&g, label, shared, E, Fs, "blk.%d.ffn_up_shexp.weight", l);
                convention_shape(&g, label, shared, Fs, E, "blk.%d.ffn_down_shexp.weight", l);
                convention_shape(&g, label, shared, E, 1, "blk.%d.ffn_gate_inp_shexp.weight", l);
            } else if (glm4) {
                convention_shape(&g, label, 1, E, 2 * F, "blk.%d.ffn_up.weight", l);
                convention_shape(&g, label, 1, F, E, "blk.%d.ffn_down.weight", l);
                convention_shape(&g, label, 1, E, 0, "blk.%d.post_attention_norm.weight", l);
                convention_shape(&g, label, 1, E, 0, "blk.%d.post_ffw_norm.weight", l);
            } else {
                convention_shape(&g, label, 1, E, F, "blk.%d.ffn_gate.weight", l);
                convention_shape(&g, label, 1, E, F, "blk.%d.ffn_up.weight", l);
                convention_shape(&g, label, 1, F, E, "blk.%d.ffn_down.weight", l);
            }
            int qwen2 = !strcmp(arch, "qwen2") || !strcmp(arch, "qwen2moe");
            convention_shape(&g, label, qwen2, hd * H, 0, "blk.%d.attn_q.bias", l);
            convention_shape(&g, label, qwen2, hd * Hkv, 0, "blk.%d.attn_k.bias", l);
            convention_shape(&g, label, qwen2, hd * Hkv, 0, "blk.%d.attn_v.bias", l);
            if (!strncmp(arch, "qwen3", 5)) {
                convention_shape(&g, label, 1, hd, 0, "blk.%d.attn_q_norm.weight", l);
                convention_shape(&g, label, 1, hd, 0, "blk.%d.attn_k_norm.weight", l);
            }
        } else if (qwen1) { /* feed_forward_length counts both halves: each matrix is F / 2 */
            convention_shape(&g, label, 1, E, 3 * E, "blk.%d.attn_qkv.weight", l);
            convention_shape(&g, label, 1, 3 * E, 0, "blk.%d.attn_qkv.bias", l);
            convention_shape(&g, label, 1, E, E, "blk.%d.attn_output.weight", l);
            convention_shape(&g, label, 1, E, F / 2, "blk.%d.ffn_gate.weight", l);
            convention_shape(&g, label, 1, E, F / 2, "blk.%d.ffn_up.weight", l);
            convention_shape(&g, label, 1, F / 2, E, "blk.%d.ffn_down.weight", l);
        } else { /* chatglm: fused QKV (Q heads, then K and V groups) and [gate; up] */
            convention_shape(&g, label, 1, E, E + 2 * hd * Hkv, "blk.%d.attn_qkv.weight", l);
            convention_shape(&g, label, 0, E + 2 * hd * Hkv, 0, "blk.%d.attn_qkv.bias", l);
            convention_shape(&g, label, 1, E, E, "blk.%d.attn_output.weight", l);
            convention_shape(&g, label, 1, E, 2 * F, "blk.%d.ffn_up.weight", l);
            convention_shape(&g, label, 1, F, E, "blk.%d.ffn_down.weight", l);
        }
    }
    loom_gguf_close(&g);
}

#endif
