/*
 * tests/test_qwen.c - Qwen v1 and Qwen3, for which the fixtures hold no PyTorch run, judged
 * against expectations built independently from the tiny-qwen2 fixture:
 *   - Qwen v1: tiny-qwen2's weights rewritten as a QWenLMHeadModel folder (q/k/v fused into
 *     c_attn with each kv head repeated for the query heads of its group, gate/up as w2/w1,
 *     an untied lm_head, and the qwen.tiktoken tokenizer, whose ranks are tiny-qwen2's
 *     vocabulary) computes the same function, so it must reproduce tiny-qwen2's PyTorch logits
 *     and greedy tokens, opened as a folder and converted to GGUF, on every usable backend.
 *   - Qwen3: the same weights plus per-head q/k RMSNorm weights. The expectation is a plain
 *     double-precision forward pass written here from the Hugging Face modelling code; that
 *     pass is first checked against tiny-qwen2's PyTorch logits with the norms left out.
 *   - Qwen3-MoE: Qwen3's folder with each MLP replaced by experts and a router, against the
 *     same pass with transformers' Qwen3MoeSparseMoeBlock routing (softmax, top k,
 *     renormalised by norm_topk_prob); the fixtures' tiny-qwen2moe checks the experts' ops
 *     against PyTorch itself (test_modern).
 */
#define _GNU_SOURCE
#include <loom/loom.h>

#include "core/gguf.h"
#include "core/safetensors.h"
#include "backends.h"
#include "fixture_model.h"
#include "gguf_conventions.h"

#include "check.h"
#include "hf_writer.h"
#include "reference_f64.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char err[4096], fixtures[4096], tmp[] = "/tmp/loom-qwen-XXXXXX";

/* general.architecture of a GGUF file, or "" */
static const char *gguf_arch(const char *path)
{
    static char arch[64];
    loom_gguf g;
    const char *a = NULL;
    arch[0] = '\0';
    uint64_t len = 0;
    if (loom_gguf_open(&g, path, err, sizeof err) == 0) {
        if (loom_gguf_get_str(&g, "general.architecture", &a, &len) == 0)
            snprintf(arch, sizeof arch, "%.*s", (int)len, a);
        loom_gguf_close(&g);
    }
    return arch;
}

/* ---- tiny-qwen2's shape ------------------------------------------------------------------- */

typedef struct shape {
    int d, heads, kv, hd, ff, layers, vocab;
    double eps, theta;
    /* GLM-4-0414 (Glm4DecoderLayer): gate and up in one gate_up_proj, and each block's output
     * normalised (post_self_attn_layernorm, post_mlp_layernorm) before the residual add */
    int fused_gate_up, post_norms;
} shape;

static shape read_shape(const char *folder)
{
    char p[4400];
    snprintf(p, sizeof p, "%s/config.json", folder);
    char *text = slurp(p, NULL);
    cJSON *c = cJSON_Parse(text);
    shape s = {0};
#define NUM(key) cJSON_GetObjectItem(c, key)->valuedouble
    s.d = (int)NUM("hidden_size"), s.heads = (int)NUM("num_attention_heads");
    s.kv = (int)NUM("num_key_value_heads"), s.ff = (int)NUM("intermediate_size");
    s.layers = (int)NUM("num_hidden_layers"), s.vocab = (int)NUM("vocab_size");
    s.eps = NUM("rms_norm_eps"), s.theta = NUM("rope_theta");
#undef NUM
    s.hd = s.d / s.heads;
    cJSON_Delete(c);
    free(text);
    return s;
}

/* ---- Qwen v1 from tiny-qwen2 -------------------------------------------------------------- */

/* q, then k and v with kv head h / group repeated as head h: [3 * heads * hd] rows (or elements
 * of a bias) in c_attn's order. */
static void fused_qkv(st_out *o, const loom_safetensors *st, const shape *s, int l,
                      const char *what)
{
    char q[128], k[128], v[128], name[128];
    snprintf(q, sizeof q, "model.layers.%d.self_attn.q_proj.%s", l, what);
    snprintf(k, sizeof k, "model.layers.%d.self_attn.k_proj.%s", l, what);
    snprintf(v, sizeof v, "model.layers.%d.self_attn.v_proj.%s", l, what);
    const loom_st_tensor *tq = loom_safetensors_find(st, q), *tk = loom_safetensors_find(st, k),
                         *tv = loom_safetensors_find(st, v);
    if (!tq || !tk || !tv) {
        CHECK(0, "tiny-qwen2 lacks q/k/v %s of layer %d", what, l);
        return;
    }
    size_t unit = tq->size / (size_t)(s->heads * s->hd); /* bytes per row (or element) */
    size_t head = unit * (size_t)s->hd, group = (size_t)(s->heads / s->kv);
    unsigned char *buf = malloc(3 * tq->size);
    memcpy(buf, tq->data, tq->size);
    for (int part = 0; part < 2; part++) {
        const unsigned char *src = part ? tv->data : tk->data;
        for (int h = 0; h < s->heads; h++)
            memcpy(buf + tq->size * (1 + part) + (size_t)h * head, src + (h / group) * head, head);
    }
    int64_t shp[2] = {3 * (int64_t)s->heads * s->hd, tq->n_dims == 2 ? tq->shape[1] : 0};
    snprintf(name, sizeof name, "transformer.h.%d.attn.c_attn.%s", l, what);
    st_add(o, name, tq->dtype, tq->n_dims, shp, buf, 3 * tq->size);
    free(buf);
}

static int make_qwen1(const loom_safetensors *st, const shape *s, const char *folder)
{
    mkdir(folder, 0755);
    st_out o = {cJSON_CreateObject(), NULL, 0, 0};
    st_copy(&o, st, "model.embed_tokens.weight", "transformer.wte.weight");
    st_copy(&o, st, "model.embed_tokens.weight", "lm_head.weight"); /* v1 does not tie */
    st_copy(&o, st, "model.norm.weight", "transformer.ln_f.weight");
    static const char *const same[][2] = {{"input_layernorm.weight", "ln_1.weight"},
                                          {"self_attn.o_proj.weight", "attn.c_proj.weight"},
                                          {"post_attention_layernorm.weight", "ln_2.weight"},
                                          {"mlp.up_proj.weight", "mlp.w1.weight"},
                                          {"mlp.gate_proj.weight", "mlp.w2.weight"},
                                          {"mlp.down_proj.weight", "mlp.c_proj.weight"}};
    for (int l = 0; l < s->layers; l++) {
        for (size_t i = 0; i < sizeof same / sizeof same[0]; i++) {
            char from[128], to[128];
            snprintf(from, sizeof from, "model.layers.%d.%s", l, same[i][0]);
            snprintf(to, sizeof to, "transformer.h.%d.%s", l, same[i][1]);
            st_copy(&o, st, from, to);
        }
        fused_qkv(&o, st, s, l, "weight");
        fused_qkv(&o, st, s, l, "bias");
    }
    char p[4400], cfg[1024];
    snprintf(p, sizeof p, "%s/model.safetensors", folder);
    if (st_write(&o, p) != 0)
        return -1;
    /* Qwen-7B's config keys, with tiny-qwen2's numbers; intermediate_size counts w1 and w2 */
    snprintf(cfg, sizeof cfg,
             "{\"architectures\": [\"QWenLMHeadModel\"], \"model_type\": \"qwen\", "
             "\"hidden_size\": %d, \"num_attention_heads\": %d, \"num_hidden_layers\": %d, "
             "\"intermediate_size\": %d, \"kv_channels\": %d, \"rotary_emb_base\": %.1f, "
             "\"rotary_pct\": 1.0, \"layer_norm_epsilon\": %g, \"seq_length\": 8192, "
             "\"max_position_embeddings\": 8192, \"vocab_size\": %d, \"no_bias\": true, "
             "\"use_dynamic_ntk\": true, \"use_logn_attn\": true, \"bf16\": false, \"fp16\": true}",
             s->d, s->heads, s->layers, 2 * s->ff, s->hd, s->theta, s->eps, s->vocab);
    write_text(folder, "config.json", cfg);
    write_text(folder, "generation_config.json",
               "{\"chat_format\": \"chatml\", \"eos_token_id\": 151643, \"pad_token_id\": 151643}");
    write_text(folder, "tokenizer_config.json",
               "{\"model_max_length\": 8192, \"tokenizer_class\": \"QWenTokenizer\"}");
    snprintf(p, sizeof p, "%s/tokenizers/qwen1/qwen.tiktoken", fixtures);
    link_file(folder, "qwen.tiktoken", p);
    return 0;
}

static void test_qwen1(const loom_safetensors *st, const shape *s)
{
    char folder[4200], gguf[4200];
    snprintf(folder, sizeof folder, "%s/qwen1", tmp);
    snprintf(gguf, sizeof gguf, "%s/qwen1-f32.gguf", tmp);
    CHECK(make_qwen1(st, s, folder) == 0, "writing the Qwen v1 folder");
    CHECK(loom_convert(folder, gguf, "f32", NULL, NULL, err, sizeof err) == 0, "convert: %s", err);
    CHECK(!strcmp(gguf_arch(gguf), "qwen"), "the converted file is GGUF 'qwen', not '%s'",
          gguf_arch(gguf));
    check_gguf_conventions(gguf, "Qwen v1 (converted)");
    /* a file of the older convention (feed_forward_length = one FFN half) still loads */
    char legacy[4300];
    snprintf(legacy, sizeof legacy, "%s/qwen1-legacy.gguf", tmp);
    loom_gguf g;
    if (loom_gguf_open(&g, gguf, err, sizeof err) == 0) {
        loom_gguf_writer *w = loom_gguf_writer_create();
        for (uint64_t i = 0; i < g.n_kv; i++)
            if (strcmp(g.kv[i].key, "general.alignment") &&
                strcmp(g.kv[i].key, "qwen.feed_forward_length"))
                loom_gguf_copy_kv(w, &g, &g.kv[i]);
        int64_t ff = 0;
        loom_gguf_get_i64(&g, "qwen.feed_forward_length", &ff);
        loom_gguf_set_u32(w, "qwen.feed_forward_length", (uint32_t)(ff / 2));
        for (uint64_t i = 0; i < g.n_tensors; i++)
            loom_gguf_add_tensor(w, g.tensors[i].name, g.tensors[i].type, g.tensors[i].n_dims,
                                 g.tensors[i].ne, loom_gguf_tensor_data(&g, &g.tensors[i]));
        CHECK(loom_gguf_write(w, legacy, err, sizeof err) == 0, "legacy file: %s", err);
        loom_gguf_writer_free(w);
        loom_gguf_close(&g);
    }
    static char backends[MAX_TEST_BACKENDS][160];
    int n = usable_backends(backends, MAX_TEST_BACKENDS);
    for (int i = 0; i < n; i++) {
        check_model(fixtures, "tiny-qwen2", gguf, backends[i], "last_logits", 1e-4, 1,
                    "Qwen v1 (converted, f32)");
        check_model(fixtures, "tiny-qwen2", folder, backends[i], "last_logits", 1e-3, 1,
                    "Qwen v1 (folder, f16)");
    }
    if (n > 0)
        check_model(fixtures, "tiny-qwen2", legacy, backends[0], "last_logits", 1e-4, 1,
                    "Qwen v1 (a file of loom's older feed_forward_length convention)");
    unlink(legacy);
    unlink(gguf);
}

/* ---- Qwen3: tiny-qwen2 plus q/k norms, against a forward pass written here ---------------- */

static void rms_norm(double *x, int n, const double *w, double eps)
{
    double ss = 0;
    for (int i = 0; i < n; i++)
        ss += x[i] * x[i];
    double inv = 1.0 / sqrt(ss / n + eps);
    for (int i = 0; i < n; i++)
        x[i] = x[i] * inv * w[i];
}

/* A Qwen3-MoE layer's experts (Qwen3MoeSparseMoeBlock), and what the reference saw of its
 * routing: the least gap between the k-th and the (k+1)-th expert's router logit, over every
 * token and layer (a gap within rounding would make the choice a coin toss for loom). */
typedef struct moe_shape {
    int experts, k, ff, normalize;
    double least_gap;
    /* GLM-4.5 (Glm4MoeTopkRouter): sigmoid scores, chosen by score + e_score_correction_bias,
     * weights scaled by routed_scaling_factor; shared experts of shared_ff; the first n_dense
     * layers dense */
    int sigmoid, shared_ff, n_dense;
    double scale;
    /* group-limited routing (Glm4MoeTopkRouter's, DeepSeek-V3's): the choice only among the
     * experts of the topk_group groups (of n_group) whose two best choice scores sum highest */
    int n_group, topk_group;
} moe_shape;

static double *load_expert(const loom_safetensors *st, int l, int e, const char *proj)
{
    char name[128];
    snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s.weight", l, e, proj);
    return load_f64(st, name, 0, NULL);
}

/* x += the experts' mixture of h (h is rms_norm(x) * ln2), as transformers computes it:
 * softmax over the router's logits, the top k, renormalised when normalize says so. */
static void reference_moe(const loom_safetensors *st, moe_shape *m, int l, int D, const double *h,
                          double *x)
{
    double *router = load_f64(st, "model.layers.%d.mlp.gate.weight", l, NULL);
    double *bias = m->sigmoid
        ? load_f64(st, "model.layers.%d.mlp.gate.e_score_correction_bias", l, NULL)
        : NULL;
    double prob[64], choice[64], sum = 0, mx = -INFINITY, chosen_sum = 0;
    int chosen[64] = {0}, order[64];
    linear(prob, router, NULL, h, m->experts, D);
    for (int e = 0; e < m->experts; e++)
        mx = fmax(mx, prob[e]);
    for (int e = 0; e < m->experts; e++)
        sum += m->sigmoid ? 0 : (prob[e] = exp(prob[e] - mx));
    for (int e = 0; e < m->experts; e++) {
        prob[e] = m->sigmoid ? 1 / (1 + exp(-prob[e])) : prob[e] / sum;
        choice[e] = m->sigmoid ? prob[e] + bias[e] : log(prob[e]);
    }
    if (m->n_group > 1) { /* transformers masks the other groups' experts out of the top k */
        int per = m->experts / m->n_group, kept[64] = {0};
        double group[64];
        for (int g = 0; g < m->n_group; g++) {
            double a = -INFINITY, b = -INFINITY;
            for (int e = g * per; e < (g + 1) * per; e++)
                if (choice[e] > a)
                    b = a, a = choice[e];
                else if (choice[e] > b)
                    b = choice[e];
            group[g] = a + b;
        }
        for (int j = 0; j < m->topk_group; j++) {
            int best = -1;
            for (int g = 0; g < m->n_group; g++)
                if (!kept[g] && (best < 0 || group[g] > group[best]))
                    best = g;
            kept[best] = 1;
        }
        for (int e = 0; e < m->experts; e++)
            if (!kept[e / per])
                choice[e] = -INFINITY;
    }
    for (int j = 0; j <= m->k && j < m->experts; j++) { /* the k best, and the next one */
        int best = -1;
        for (int e = 0; e < m->experts; e++)
            if (!chosen[e] && (best < 0 || choice[e] > choice[best]))
                best = e;
        chosen[best] = j < m->k;
        order[j] = best;
        if (j < m->k)
            chosen_sum += prob[best];
    }
    if (m->k < m->experts)
        m->least_gap = fmin(m->least_gap, choice[order[m->k - 1]] - choice[order[m->k]]);
    free(bias);
    double *g = malloc((size_t)m->ff * sizeof *g), *u = malloc((size_t)m->ff * sizeof *u);
    double *o = malloc((size_t)D * sizeof *o);
    for (int j = 0; j < m->k; j++) {
        int e = order[j];
        double *wg = load_expert(st, l, e, "gate_proj"), *wu = load_expert(st, l, e, "up_proj"),
               *wd = load_expert(st, l, e, "down_proj");
        linear(g, wg, NULL, h, m->ff, D);
        linear(u, wu, NULL, h, m->ff, D);
        for (int i = 0; i < m->ff; i++)
            g[i] = g[i] / (1 + exp(-g[i])) * u[i];
        linear(o, wd, NULL, g, D, m->ff);
        double weight = prob[e] / (m->normalize ? chosen_sum : 1.0) * (m->sigmoid ? m->scale : 1);
        for (int i = 0; i < D; i++)
            x[i] += weight * o[i];
        free(wg), free(wu), free(wd);
    }
    if (m->shared_ff) { /* GLM-4.5's shared experts, one MLP of their width, ungated */
        double *sg = load_f64(st, "model.layers.%d.mlp.shared_experts.gate_proj.weight", l, NULL);
        double *su = load_f64(st, "model.layers.%d.mlp.shared_experts.up_proj.weight", l, NULL);
        double *sd = load_f64(st, "model.layers.%d.mlp.shared_experts.down_proj.weight", l, NULL);
        double *a = malloc((size_t)m->shared_ff * sizeof *a),
               *b = malloc((size_t)m->shared_ff * sizeof *b);
        linear(a, sg, NULL, h, m->shared_ff, D);
        linear(b, su, NULL, h, m->shared_ff, D);
        for (int i = 0; i < m->shared_ff; i++)
            a[i] = a[i] / (1 + exp(-a[i])) * b[i];
        linear(o, sd, NULL, a, D, m->shared_ff);
        for (int i = 0; i < D; i++)
            x[i] += o[i];
        free(sg), free(su), free(sd), free(a), free(b);
    }
    free(g), free(u), free(o), free(router);
}

/* Hugging Face Qwen2/Qwen3 decoding of ids, in double: the last position's logits. norms:
 * per layer q_norm then k_norm weights ([hd] each), or NULL for Qwen2; moe: Qwen3-MoE's
 * experts in place of the MLP, or NULL. */
/* A RoPE other than the plain one: each pair's inverse frequency, and the factor that
 * transformers multiplies cos and sin by (its attention_scaling). */
typedef struct rope_shape {
    double inv_freq[128];
    double attention;
    int n_rot;    /* the rotated dimensions, at the head's start (0: all) */
    int adjacent; /* pairs (2i, 2i + 1), as GLM's interleaved rotate_half; else NeoX halves */
} rope_shape;

/* transformers' _compute_yarn_parameters (rope_type "yarn", truncate on, no attention_factor
 * or mscale given): the inverse frequencies blend extrapolation (the plain ones) and
 * interpolation (divided by factor) by a linear ramp between the correction dimensions of
 * beta_fast and beta_slow; attention_scaling is 0.1 ln(factor) + 1. */
static rope_shape yarn_rope(const shape *s, double factor, double original_ctx)
{
    rope_shape r = {0};
    const int dim = s->hd;
    const double beta_fast = 32, beta_slow = 1;
#define CORRECTION_DIM(rot) (dim * log(original_ctx / ((rot)*2 * M_PI)) / (2 * log(s->theta)))
    double low = fmax(floor(CORRECTION_DIM(beta_fast)), 0);
    double high = fmin(ceil(CORRECTION_DIM(beta_slow)), dim - 1);
#undef CORRECTION_DIM
    if (low == high)
        high += 0.001;
    for (int i = 0; i < dim / 2; i++) {
        double pos_freq = pow(s->theta, 2.0 * i / dim);
        double extrapolation = 1 / pos_freq, interpolation = 1 / (factor * pos_freq);
        double extrapolation_factor = 1 - fmin(fmax((i - low) / (high - low), 0), 1);
        r.inv_freq[i] = interpolation * (1 - extrapolation_factor) +
            extrapolation * extrapolation_factor;
    }
    r.attention = factor > 1 ? 0.1 * log(factor) + 1 : 1;
    return r;
}

static double *reference_logits(const loom_safetensors *st, const shape *s, double **norms,
                                moe_shape *moe, const rope_shape *rope, const int32_t *ids, int T)
{
    int D = s->d, H = s->heads, KV = s->kv, hd = s->hd, F = s->ff, group = H / KV;
    double *x = calloc((size_t)T * D, sizeof *x), *h = malloc((size_t)D * sizeof *h);
    double *q = malloc((size_t)T * H * hd * sizeof *q),
           *k = malloc((size_t)T * KV * hd * sizeof *k);
    double *v = malloc((size_t)T * KV * hd * sizeof *v),
           *att = malloc((size_t)H * hd * sizeof *att);
    double *o = malloc((size_t)D * sizeof *o), *g = malloc((size_t)F * sizeof *g);
    double *u = malloc((size_t)F * sizeof *u), *p = malloc((size_t)T * sizeof *p);
    double *emb = load_f64(st, "model.embed_tokens.weight", 0, NULL);
    for (int t = 0; t < T; t++)
        memcpy(x + (size_t)t * D, emb + (int64_t)ids[t] * D, (size_t)D * sizeof *x);
    for (int l = 0; l < s->layers; l++) {
        double *ln1 = load_f64(st, "model.layers.%d.input_layernorm.weight", l, NULL);
        double *wq = load_f64(st, "model.layers.%d.self_attn.q_proj.weight", l, NULL);
        double *bq = load_f64(st, "model.layers.%d.self_attn.q_proj.bias", l, NULL);
        double *wk = load_f64(st, "model.layers.%d.self_attn.k_proj.weight", l, NULL);
        double *bk = load_f64(st, "model.layers.%d.self_attn.k_proj.bias", l, NULL);
        double *wv = load_f64(st, "model.layers.%d.self_attn.v_proj.weight", l, NULL);
        double *bv = load_f64(st, "model.layers.%d.self_attn.v_proj.bias", l, NULL);
        double *wo = load_f64(st, "model.layers.%d.self_attn.o_proj.weight", l, NULL);
        double *ln2 = load_f64(st, "model.layers.%d.post_attention_layernorm.weight", l, NULL);
        int sparse = moe && l >= moe->n_dense;
        double *wg = NULL, *wu = NULL, *wd = NULL, *post_attn = NULL, *post_mlp = NULL;
        if (!sparse && s->fused_gate_up) { /* [gate; up] rows */
            wg = load_f64(st, "model.layers.%d.mlp.gate_up_proj.weight", l, NULL);
            wu = malloc((size_t)F * D * sizeof *wu);
            memcpy(wu, wg + (size_t)F * D, (size_t)F * D * sizeof *wu);
        } else if (!sparse) {
            wg = load_f64(st, "model.layers.%d.mlp.gate_proj.weight", l, NULL);
            wu = load_f64(st, "model.layers.%d.mlp.up_proj.weight", l, NULL);
        }
        if (!sparse)
            wd = load_f64(st, "model.layers.%d.mlp.down_proj.weight", l, NULL);
        if (s->post_norms) {
            post_attn = load_f64(st, "model.layers.%d.post_self_attn_layernorm.weight", l, NULL);
            post_mlp = load_f64(st, "model.layers.%d.post_mlp_layernorm.weight", l, NULL);
        }
        for (int t = 0; t < T; t++) {
            memcpy(h, x + (size_t)t * D, (size_t)D * sizeof *h);
            rms_norm(h, D, ln1, s->eps);
            double *qt = q + (size_t)t * H * hd, *kt = k + (size_t)t * KV * hd;
            linear(qt, wq, bq, h, H * hd, D);
            linear(kt, wk, bk, h, KV * hd, D);
            linear(v + (size_t)t * KV * hd, wv, bv, h, KV * hd, D);
            for (int hh = 0; hh < H + KV; hh++) {
                double *vec = hh < H ? qt + hh * hd : kt + (hh - H) * hd;
                if (norms) /* Qwen3: each head normalised before RoPE */
                    rms_norm(vec, hd, norms[2 * l + (hh >= H)], s->eps);
                int nr = rope && rope->n_rot ? rope->n_rot : hd;
                for (int i = 0; i < nr / 2; i++) { /* rotate_half over the first nr */
                    double inv = rope ? rope->inv_freq[i] : pow(s->theta, -2.0 * i / hd);
                    double scale = rope ? rope->attention : 1;
                    double ang = t * inv, c = cos(ang) * scale, sn = sin(ang) * scale;
                    int i0 = rope && rope->adjacent ? 2 * i : i;
                    int i1 = rope && rope->adjacent ? 2 * i + 1 : i + nr / 2;
                    double a = vec[i0], b = vec[i1];
                    vec[i0] = a * c - b * sn;
                    vec[i1] = b * c + a * sn;
                }
            }
        }
        for (int t = 0; t < T; t++) {
            for (int hh = 0; hh < H; hh++) {
                const double *qh = q + ((size_t)t * H + hh) * hd;
                int kh = hh / group;
                double mx = -INFINITY, sum = 0;
                for (int j = 0; j <= t; j++) {
                    double sc = 0;
                    for (int i = 0; i < hd; i++)
                        sc += qh[i] * k[((size_t)j * KV + kh) * hd + i];
                    p[j] = sc / sqrt((double)hd);
                    mx = fmax(mx, p[j]);
                }
                for (int j = 0; j <= t; j++)
                    sum += (p[j] = exp(p[j] - mx));
                for (int i = 0; i < hd; i++) {
                    double acc = 0;
                    for (int j = 0; j <= t; j++)
                        acc += p[j] / sum * v[((size_t)j * KV + kh) * hd + i];
                    att[hh * hd + i] = acc;
                }
            }
            double *xt = x + (size_t)t * D;
            linear(o, wo, NULL, att, D, H * hd);
            if (post_attn)
                rms_norm(o, D, post_attn, s->eps);
            for (int i = 0; i < D; i++)
                xt[i] += o[i];
            memcpy(h, xt, (size_t)D * sizeof *h);
            rms_norm(h, D, ln2, s->eps);
            if (sparse) {
                reference_moe(st, moe, l, D, h, xt);
                continue;
            }
            linear(g, wg, NULL, h, F, D);
            linear(u, wu, NULL, h, F, D);
            for (int i = 0; i < F; i++)
                g[i] = g[i] / (1 + exp(-g[i])) * u[i];
            linear(o, wd, NULL, g, D, F);
            if (post_mlp)
                rms_norm(o, D, post_mlp, s->eps);
            for (int i = 0; i < D; i++)
                xt[i] += o[i];
        }
        free(ln1), free(wq), free(bq), free(wk), free(bk), free(wv), free(bv), free(wo);
        free(ln2), free(wg), free(wu), free(wd), free(post_attn), free(post_mlp);
    }
    double *fn = load_f64(st, "model.norm.weight", 0, NULL);
    double *last = x + (size_t)(T - 1) * D, *logits = malloc((size_t)s->vocab * sizeof *logits);
    rms_norm(last, D, fn, s->eps);
    linear(logits, emb, NULL, last, s->vocab, D); /* tied */
    free(fn), free(emb), free(x), free(h), free(q), free(k), free(v), free(att), free(o);
    free(g), free(u), free(p);
    return logits;
}

/* An f32 matrix [rows, cols] of smooth pseudo-random values of amplitude amp, seeded by salt. */
static void add_matrix(st_out *o, const char *name, int64_t rows, int64_t cols, double amp,
                       double salt)
{
    float *w = malloc((size_t)(rows * cols) * sizeof *w);
    for (int64_t i = 0; i < rows * cols; i++)
        w[i] = (float)(amp * sin(salt * 1.618 + (double)i * (0.37 + salt * 0.013)));
    int64_t shp[2] = {rows, cols};
    st_add(o, name, "F32", 2, shp, w, (size_t)(rows * cols) * sizeof *w);
    free(w);
}

/* tiny-qwen2 plus q/k norms (Qwen3); with moe, its MLPs replaced by moe->experts experts and
 * a router (Qwen3-MoE). */
static int make_qwen3(const loom_safetensors *st, const shape *s, double **norms,
                      const moe_shape *moe, const char *folder, const char *qwen2_dir)
{
    mkdir(folder, 0755);
    st_out o = {cJSON_CreateObject(), NULL, 0, 0};
    for (int i = 0; i < st->n_tensors; i++)
        if (!moe || !strstr(st->tensors[i].name, ".mlp."))
            st_add(&o, st->tensors[i].name, st->tensors[i].dtype, st->tensors[i].n_dims,
                   st->tensors[i].shape, st->tensors[i].data, st->tensors[i].size);
    for (int l = 0; moe && l < s->layers; l++) {
        char name[128];
        /* a router of wide logits, so that the top k stand apart */
        snprintf(name, sizeof name, "model.layers.%d.mlp.gate.weight", l);
        add_matrix(&o, name, moe->experts, s->d, 1.5, 1.0 + l);
        for (int e = 0; e < moe->experts; e++) {
            static const char *const proj[] = {"gate_proj", "up_proj", "down_proj"};
            for (int j = 0; j < 3; j++) {
                snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s.weight", l, e,
                         proj[j]);
                add_matrix(&o, name, j == 2 ? s->d : moe->ff, j == 2 ? moe->ff : s->d, 0.4,
                           3.0 + l * 11 + e * 3 + j);
            }
        }
    }
    for (int l = 0; l < s->layers; l++)
        for (int which = 0; which < 2; which++) {
            float w[256];
            for (int i = 0; i < s->hd; i++) /* stored f32; the reference reads back the same */
                norms[2 * l + which][i] = w[i] = (float)(1.0 +
                                                         0.5 * sin(7.0 * l + 3.0 * which + i));
            char name[128];
            int64_t shp[1] = {s->hd};
            snprintf(name, sizeof name, "model.layers.%d.self_attn.%s_norm.weight", l,
                     which ? "k" : "q");
            st_add(&o, name, "F32", 1, shp, w, (size_t)s->hd * sizeof(float));
        }
    char p[4400], cfg[2048], experts[512] = "";
    snprintf(p, sizeof p, "%s/model.safetensors", folder);
    if (st_write(&o, p) != 0)
        return -1;
    if (moe) /* Qwen3-30B-A3B's keys */
        snprintf(experts, sizeof experts,
                 ", \"num_experts\": %d, \"num_experts_per_tok\": %d, "
                 "\"moe_intermediate_size\": %d, \"norm_topk_prob\": %s, "
                 "\"decoder_sparse_step\": 1, \"mlp_only_layers\": [], "
                 "\"output_router_logits\": false, \"router_aux_loss_coef\": 0.001",
                 moe->experts, moe->k, moe->ff, moe->normalize ? "true" : "false");
    snprintf(cfg, sizeof cfg,
             "{\"architectures\": [\"%s\"], \"model_type\": \"%s\", "
             "\"hidden_size\": %d, \"num_attention_heads\": %d, \"num_key_value_heads\": %d, "
             "\"head_dim\": %d, \"num_hidden_layers\": %d, \"intermediate_size\": %d, "
             "\"rms_norm_eps\": %g, \"rope_theta\": %.1f, \"max_position_embeddings\": 40960, "
             "\"vocab_size\": %d, \"attention_bias\": true, \"tie_word_embeddings\": true, "
             "\"hidden_act\": \"silu\", \"torch_dtype\": \"float16\"%s}",
             moe ? "Qwen3MoeForCausalLM" : "Qwen3ForCausalLM", moe ? "qwen3_moe" : "qwen3", s->d,
             s->heads, s->kv, s->hd, s->layers, s->ff, s->eps, s->theta, s->vocab, experts);
    write_text(folder, "config.json", cfg);
    static const char *const copied[] = {"vocab.json", "merges.txt", "tokenizer_config.json",
                                         "generation_config.json"};
    for (size_t i = 0; i < sizeof copied / sizeof copied[0]; i++) {
        snprintf(p, sizeof p, "%s/%s", qwen2_dir, copied[i]);
        link_file(folder, copied[i], p);
    }
    return 0;
}

/* The fixture's plain prompt ids (which loom's Qwen2 tokenizer reproduces, test_convert). */
static int plain_prompt(int32_t *ids, int max)
{
    char p[4400];
    snprintf(p, sizeof p, "%s/tiny-qwen2/expected.json", fixtures);
    char *text = slurp(p, NULL);
    cJSON *root = cJSON_Parse(text), *id;
    int n = 0;
    cJSON_ArrayForEach (
        id,
        cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(root, "cases"), 0),
                            "prompt_ids"))
        if (n < max)
            ids[n++] = id->valueint;
    cJSON_Delete(root);
    free(text);
    return n;
}

static double max_diff(const double *ref, const float *got, int n)
{
    double worst = 0;
    for (int i = 0; i < n; i++)
        worst = fmax(worst, fabs(ref[i] - got[i]));
    return worst;
}

static int on_nothing(void *user, int32_t id, const char *text, size_t len)
{
    (void)user, (void)id, (void)text, (void)len;
    return 0;
}

static void test_qwen3(const loom_safetensors *st, const shape *s, const char *qwen2_dir)
{
    int32_t ids[64];
    int T = plain_prompt(ids, 64);
    CHECK(T > 1, "the fixture's prompt ids");

    /* the reference pass itself, without norms, against PyTorch's tiny-qwen2 logits */
    double *ref2 = reference_logits(st, s, NULL, NULL, NULL, ids, T);
    char p[4400];
    snprintf(p, sizeof p, "%s/logits_plain.f32", qwen2_dir);
    size_t bytes = 0;
    float *torch = (float *)slurp(p, &bytes);
    CHECK(torch && bytes == (size_t)s->vocab * 4, "logits_plain.f32");
    double d2 = torch ? max_diff(ref2, torch, s->vocab) : 1e9;
    CHECK(d2 < 1e-4, "the test's reference forward disagrees with PyTorch on tiny-qwen2 by %g", d2);
    free(torch), free(ref2);

    double *norms[2 * 8];
    for (int i = 0; i < 2 * s->layers; i++)
        norms[i] = malloc((size_t)s->hd * sizeof(double));
    char folder[4200], gguf[4200];
    snprintf(folder, sizeof folder, "%s/qwen3", tmp);
    snprintf(gguf, sizeof gguf, "%s/qwen3-f32.gguf", tmp);
    CHECK(make_qwen3(st, s, norms, NULL, folder, qwen2_dir) == 0, "writing the Qwen3 folder");
    double *ref3 = reference_logits(st, s, norms, NULL, NULL, ids, T);
    CHECK(loom_convert(folder, gguf, "f32", NULL, NULL, err, sizeof err) == 0, "convert: %s", err);
    CHECK(!strcmp(gguf_arch(gguf), "qwen3"), "the converted file is GGUF 'qwen3', not '%s'",
          gguf_arch(gguf));
    check_gguf_conventions(gguf, "Qwen3 (converted)");
    int best = 0;
    for (int i = 1; i < s->vocab; i++)
        best = ref3[i] > ref3[best] ? i : best;

    static char backends[MAX_TEST_BACKENDS][160];
    int nb = usable_backends(backends, MAX_TEST_BACKENDS);
    for (int b = 0; b < nb; b++)
        for (int which = 0; which < 2; which++) {
            const char *path = which ? folder : gguf;
            double tol = which ? 1e-3 : 1e-4; /* the folder keeps f16 weights */
            loom_model_options o = {.backend = backends[b], .kv_type = "f32"};
            loom_model *m = loom_model_open(path, &o, err, sizeof err);
            CHECK(m != NULL, "Qwen3 %s on %s: %s", which ? "folder" : "gguf", backends[b], err);
            if (!m)
                continue;
            int32_t enc[64];
            int64_t ne = loom_tokenize(m,
                                       "Hello! My name is Loom and I can count: 1, 2, 3, 1234567.",
                                       1, 1, enc, 64, err, sizeof err);
            CHECK(ne == T && !memcmp(enc, ids, (size_t)T * sizeof *ids),
                  "Qwen3's tokenizer (tiny-qwen2's files) gives the fixture's ids");
            loom_sampling g = loom_sampling_defaults();
            g.temperature = 0;
            int rc = loom_generate(m, ids, T, 1, &g, on_nothing, NULL, NULL, err, sizeof err);
            CHECK(rc == 0, "Qwen3 generate: %s", err);
            const float *got = loom_prompt_logits(m);
            double d = got ? max_diff(ref3, got, s->vocab) : 1e9;
            CHECK(d <= tol, "Qwen3 %s on %s: logits off the reference by %g (> %g)",
                  which ? "folder" : "gguf", backends[b], d, tol);
            int top = 0;
            for (int i = 1; got && i < s->vocab; i++)
                top = got[i] > got[top] ? i : top;
            CHECK(top == best, "Qwen3 on %s: top token %d, reference %d", backends[b], top, best);
            loom_model_close(m);
        }
    /* the norms matter: without them the logits are Qwen2's, far from these */
    loom_model_options o = {.backend = "ref"};
    loom_model *m = loom_model_open(qwen2_dir, &o, err, sizeof err);
    if (m) {
        loom_sampling g = loom_sampling_defaults();
        g.temperature = 0;
        loom_generate(m, ids, T, 1, &g, on_nothing, NULL, NULL, err, sizeof err);
        CHECK(max_diff(ref3, loom_prompt_logits(m), s->vocab) > 0.01,
              "the q/k norms change nothing: the Qwen3 check could not fail");
        loom_model_close(m);
    }
    free(ref3);
    for (int i = 0; i < 2 * s->layers; i++)
        free(norms[i]);
    unlink(gguf);
}

/* The converted GGUF (f32, within 1e-4) and the folder (f16 weights, 1e-3) on every usable
 * backend against the reference's last logits for ids. */
static void check_forms(const char *what, const char *gguf, const char *folder, const double *ref,
                        int vocab, const int32_t *ids, int T)
{
    static char backends[MAX_TEST_BACKENDS][160];
    int nb = usable_backends(backends, MAX_TEST_BACKENDS);
    for (int b = 0; b < nb; b++)
        for (int which = 0; which < 2; which++) {
            const char *path = which ? folder : gguf;
            double tol = which ? 1e-3 : 1e-4;
            loom_model_options o = {.backend = backends[b], .kv_type = "f32"};
            loom_model *m = loom_model_open(path, &o, err, sizeof err);
            CHECK(m != NULL, "%s %s on %s: %s", what, which ? "folder" : "gguf", backends[b], err);
            if (!m)
                continue;
            loom_sampling g = loom_sampling_defaults();
            g.temperature = 0;
            int rc = loom_generate(m, ids, T, 1, &g, on_nothing, NULL, NULL, err, sizeof err);
            CHECK(rc == 0, "%s generate: %s", what, err);
            const float *got = loom_prompt_logits(m);
            double d = got ? max_diff(ref, got, vocab) : 1e9;
            CHECK(d <= tol, "%s %s on %s: logits off the reference by %g (> %g)", what,
                  which ? "folder" : "gguf", backends[b], d, tol);
            loom_model_close(m);
        }
}

/* Qwen3-MoE: Qwen3 above with every MLP replaced by 6 experts of width 16, top 3, renormalised
 * (Qwen3-30B-A3B's norm_topk_prob), against the reference with transformers' routing. */
/* The MoE folder `from` with each layer's experts as transformers 5 saves them
 * (mlp.experts.gate_up_proj [experts, 2 ff, d], mlp.experts.down_proj [experts, d, ff]), as
 * folder `to` (its other files linked). */
static int stack_experts(const char *from, const char *to, const shape *s, const moe_shape *m)
{
    loom_safetensors st;
    char p[4400];
    snprintf(p, sizeof p, "%s/model.safetensors", from);
    if (mkdir(to, 0700) != 0 || loom_safetensors_open(&st, p, err, sizeof err) != 0)
        return -1;
    st_out o = {cJSON_CreateObject(), NULL, 0, 0};
    for (int i = 0; i < st.n_tensors; i++)
        if (!strstr(st.tensors[i].name, ".mlp.experts."))
            st_copy(&o, &st, st.tensors[i].name, st.tensors[i].name);
    const int64_t E = m->experts, F = m->ff, D = s->d;
    float *gu = malloc((size_t)(E * 2 * F * D) * sizeof *gu);
    float *dn = malloc((size_t)(E * D * F) * sizeof *dn);
    for (int l = 0; l < s->layers; l++) {
        for (int64_t e = 0; e < E; e++) {
            char name[128];
            const char *const proj[] = {"gate_proj", "up_proj", "down_proj"};
            float *to_rows[] = {gu + e * 2 * F * D, gu + e * 2 * F * D + F * D, dn + e * D * F};
            for (int j = 0; j < 3; j++) {
                snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%lld.%s.weight", l,
                         (long long)e, proj[j]);
                const loom_st_tensor *t = loom_safetensors_find(&st, name);
                CHECK(t != NULL, "no %s", name);
                if (t)
                    loom_row_to_f32((loom_dtype)t->loom_type, t->data, to_rows[j], F * D);
            }
        }
        char name[128];
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.gate_up_proj", l);
        st_add(&o, name, "F32", 3, (int64_t[]){E, 2 * F, D}, gu, (size_t)(E * 2 * F * D) * 4);
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.down_proj", l);
        st_add(&o, name, "F32", 3, (int64_t[]){E, D, F}, dn, (size_t)(E * D * F) * 4);
    }
    free(gu), free(dn);
    loom_safetensors_close(&st);
    snprintf(p, sizeof p, "%s/model.safetensors", to);
    if (st_write(&o, p) != 0)
        return -1;
    static const char *const linked[] = {"config.json", "vocab.json", "merges.txt",
                                         "tokenizer_config.json", "generation_config.json"};
    for (size_t i = 0; i < sizeof linked / sizeof linked[0]; i++) {
        snprintf(p, sizeof p, "%s/%s", from, linked[i]);
        link_file(to, linked[i], p);
    }
    return 0;
}

static void test_qwen3moe(const loom_safetensors *st, const shape *s, const char *qwen2_dir)
{
    int32_t ids[64];
    int T = plain_prompt(ids, 64);
    double *norms[2 * 8];
    for (int i = 0; i < 2 * s->layers; i++)
        norms[i] = malloc((size_t)s->hd * sizeof(double));
    moe_shape moe = {.experts = 6, .k = 3, .ff = 16, .normalize = 1, .least_gap = INFINITY};
    char folder[4200], gguf[4200];
    snprintf(folder, sizeof folder, "%s/qwen3moe", tmp);
    snprintf(gguf, sizeof gguf, "%s/qwen3moe-f32.gguf", tmp);
    CHECK(make_qwen3(st, s, norms, &moe, folder, qwen2_dir) == 0, "writing the Qwen3-MoE folder");
    loom_safetensors mst;
    if (loom_safetensors_open(&mst, folder, err, sizeof err) != 0) {
        CHECK(0, "the Qwen3-MoE folder: %s", err);
        return;
    }
    double *ref = reference_logits(&mst, s, norms, &moe, NULL, ids, T);
    CHECK(moe.least_gap > 1e-3, "the routing is clear-cut (least gap %g)", moe.least_gap);
    /* the check could fail: without the renormalisation the logits move */
    moe_shape plain = moe;
    plain.normalize = 0;
    double *unnormalised = reference_logits(&mst, s, norms, &plain, NULL, ids, T);
    double moved = 0;
    for (int i = 0; i < s->vocab; i++)
        moved = fmax(moved, fabs(ref[i] - unnormalised[i]));
    CHECK(moved > 0.01, "norm_topk_prob changes the logits by %g only", moved);
    free(unnormalised);
    loom_safetensors_close(&mst);

    CHECK(loom_convert(folder, gguf, "f32", NULL, NULL, err, sizeof err) == 0, "convert: %s", err);
    CHECK(!strcmp(gguf_arch(gguf), "qwen3moe"), "the converted file is GGUF 'qwen3moe', not '%s'",
          gguf_arch(gguf));
    check_gguf_conventions(gguf, "Qwen3-MoE (converted)");
    check_forms("Qwen3-MoE", gguf, folder, ref, s->vocab, ids, T);
    /* the same experts as transformers 5 saves them: a stack per layer */
    char stacked[4200];
    snprintf(stacked, sizeof stacked, "%s/qwen3moe-stacked", tmp);
    CHECK(stack_experts(folder, stacked, s, &moe) == 0, "writing %s", stacked);
    CHECK(loom_convert(stacked, gguf, "f32", NULL, NULL, err, sizeof err) == 0,
          "convert the stacked experts: %s", err);
    check_forms("Qwen3-MoE, stacked experts", gguf, stacked, ref, s->vocab, ids, T);
    remove_folder(stacked);
    free(ref);
    for (int i = 0; i < 2 * s->layers; i++)
        free(norms[i]);
    unlink(gguf);
}

/* Qwen2 with YaRN (rope_scaling {"rope_type": "yarn", "factor": 4, ...}: Qwen2.5's long-context
 * setting, shrunk so that tiny-qwen2's head of 8 has pairs on both sides of the ramp): its
 * weights and tokenizer, against the reference with transformers' YaRN frequencies and
 * attention scaling, as a converted GGUF and as a folder. */
static void test_yarn(const loom_safetensors *st, const shape *s, const char *qwen2_dir)
{
    int32_t ids[64];
    int T = plain_prompt(ids, 64);
    char folder[4200], gguf[4200], p[4400];
    snprintf(folder, sizeof folder, "%s/qwen2-yarn", tmp);
    snprintf(gguf, sizeof gguf, "%s/qwen2-yarn-f32.gguf", tmp);
    mkdir(folder, 0755);
    static const char *const linked[] = {"model.safetensors", "vocab.json", "merges.txt",
                                         "tokenizer_config.json", "generation_config.json"};
    for (size_t i = 0; i < sizeof linked / sizeof linked[0]; i++) {
        snprintf(p, sizeof p, "%s/%s", qwen2_dir, linked[i]);
        link_file(folder, linked[i], p);
    }
    snprintf(p, sizeof p, "%s/config.json", qwen2_dir);
    char *text = slurp(p, NULL);
    cJSON *cfg = text ? cJSON_Parse(text) : NULL;
    free(text);
    CHECK(cfg != NULL, "reading %s", p);
    if (!cfg)
        return;
    const double factor = 4, original_ctx = 64;
    cJSON_AddItemToObject(cfg, "rope_scaling",
                          cJSON_Parse("{\"rope_type\": \"yarn\", \"factor\": 4.0, "
                                      "\"original_max_position_embeddings\": 64}"));
    char *out = cJSON_Print(cfg);
    write_text(folder, "config.json", out);
    free(out);
    cJSON_Delete(cfg);

    rope_shape yarn = yarn_rope(s, factor, original_ctx);
    double *ref = reference_logits(st, s, NULL, NULL, &yarn, ids, T);
    double *plain = reference_logits(st, s, NULL, NULL, NULL, ids, T);
    double moved = 0;
    for (int i = 0; i < s->vocab; i++)
        moved = fmax(moved, fabs(ref[i] - plain[i]));
    CHECK(moved > 0.01, "YaRN changes the reference's logits by %g only", moved);
    free(plain);
    CHECK(loom_convert(folder, gguf, "f32", NULL, NULL, err, sizeof err) == 0, "convert: %s", err);
    check_forms("Qwen2 YaRN", gguf, folder, ref, s->vocab, ids, T);
    free(ref);
    unlink(gguf);
}

/* GLM-4.5 (Glm4MoeForCausalLM) from tiny-qwen2: its attention (q/k/v biases) with NeoX RoPE over
 * half of each head, layer 0 dense (tiny-qwen2's MLP), layer 1 four experts routed by sigmoid
 * scores chosen with e_score_correction_bias, top 2, renormalised and scaled by 2.5, and one
 * shared expert; against the reference with transformers' Glm4MoeTopkRouter rules. */
static void test_glm45(const loom_safetensors *st, const shape *s, const char *qwen2_dir,
                       int grouped)
{
    int32_t ids[64];
    int T = plain_prompt(ids, 64);
    /* grouped: eight experts in four groups, the best two groups kept (DeepSeek-V3's rule) */
    moe_shape moe = {.experts = grouped ? 8 : 4,
                     .k = 2,
                     .ff = 16,
                     .normalize = 1,
                     .least_gap = INFINITY,
                     .sigmoid = 1,
                     .shared_ff = 16,
                     .n_dense = 1,
                     .scale = 2.5,
                     .n_group = grouped ? 4 : 1,
                     .topk_group = grouped ? 2 : 1};
    const char *what = grouped ? "GLM-4.5, grouped routing" : "GLM-4.5";
    char folder[4200], gguf[4200], p[4400];
    snprintf(folder, sizeof folder, "%s/glm45%s", tmp, grouped ? "-grouped" : "");
    snprintf(gguf, sizeof gguf, "%s/glm45%s-f32.gguf", tmp, grouped ? "-grouped" : "");
    mkdir(folder, 0755);
    st_out o = {cJSON_CreateObject(), NULL, 0, 0};
    for (int i = 0; i < st->n_tensors; i++) {
        int layer = -1;
        sscanf(st->tensors[i].name, "model.layers.%d.", &layer);
        if (!(layer >= moe.n_dense && strstr(st->tensors[i].name, ".mlp.")))
            st_add(&o, st->tensors[i].name, st->tensors[i].dtype, st->tensors[i].n_dims,
                   st->tensors[i].shape, st->tensors[i].data, st->tensors[i].size);
    }
    for (int l = moe.n_dense; l < s->layers; l++) {
        char name[128];
        snprintf(name, sizeof name, "model.layers.%d.mlp.gate.weight", l);
        add_matrix(&o, name, moe.experts, s->d, 1.5, 7.0 + l);
        /* reorders the choice, as DeepSeek's does */
        float bias[8] = {0.05f, -0.2f, 0.3f, -0.1f, 0.15f, -0.05f, 0.1f, 0.2f};
        int64_t bshape[1] = {moe.experts};
        snprintf(name, sizeof name, "model.layers.%d.mlp.gate.e_score_correction_bias", l);
        st_add(&o, name, "F32", 1, bshape, bias, (size_t)moe.experts * sizeof *bias);
        static const char *const proj[] = {"gate_proj", "up_proj", "down_proj"};
        for (int e = 0; e <= moe.experts; e++) /* the last: the shared expert */
            for (int j = 0; j < 3; j++) {
                if (e < moe.experts)
                    snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s.weight", l, e,
                             proj[j]);
                else
                    snprintf(name, sizeof name, "model.layers.%d.mlp.shared_experts.%s.weight", l,
                             proj[j]);
                add_matrix(&o, name, j == 2 ? s->d : moe.ff, j == 2 ? moe.ff : s->d, 0.4,
                           5.0 + l * 13 + e * 3 + j);
            }
    }
    snprintf(p, sizeof p, "%s/model.safetensors", folder);
    CHECK(st_write(&o, p) == 0, "writing %s", p);
    char cfg[2048];
    /* GLM-4.5-Air's config keys, with tiny-qwen2's numbers */
    snprintf(cfg, sizeof cfg,
             "{\"architectures\": [\"Glm4MoeForCausalLM\"], \"model_type\": \"glm4_moe\", "
             "\"hidden_size\": %d, \"num_attention_heads\": %d, \"num_key_value_heads\": %d, "
             "\"head_dim\": %d, \"num_hidden_layers\": %d, \"intermediate_size\": %d, "
             "\"rms_norm_eps\": %g, \"rope_theta\": %.1f, \"max_position_embeddings\": 131072, "
             "\"vocab_size\": %d, \"attention_bias\": true, \"tie_word_embeddings\": true, "
             "\"partial_rotary_factor\": 0.5, \"first_k_dense_replace\": %d, "
             "\"n_routed_experts\": %d, \"num_experts_per_tok\": %d, \"moe_intermediate_size\": "
             "%d, \"n_shared_experts\": 1, \"routed_scaling_factor\": 2.5, \"norm_topk_prob\": "
             "true, \"n_group\": %d, \"topk_group\": %d, \"use_qk_norm\": false, "
             "\"num_nextn_predict_layers\": 1, \"hidden_act\": \"silu\", \"torch_dtype\": "
             "\"float16\"}",
             s->d, s->heads, s->kv, s->hd, s->layers, s->ff, s->eps, s->theta, s->vocab,
             moe.n_dense, moe.experts, moe.k, moe.ff, moe.n_group, moe.topk_group);
    write_text(folder, "config.json", cfg);
    static const char *const copied[] = {"vocab.json", "merges.txt", "tokenizer_config.json",
                                         "generation_config.json"};
    for (size_t i = 0; i < sizeof copied / sizeof copied[0]; i++) {
        snprintf(p, sizeof p, "%s/%s", qwen2_dir, copied[i]);
        link_file(folder, copied[i], p);
    }
    loom_safetensors gst;
    if (loom_safetensors_open(&gst, folder, err, sizeof err) != 0) {
        CHECK(0, "the GLM-4.5 folder: %s", err);
        return;
    }
    rope_shape half = {.attention = 1, .n_rot = s->hd / 2};
    for (int i = 0; i < s->hd / 4; i++)
        half.inv_freq[i] = pow(s->theta, -2.0 * i / (s->hd / 2));
    double *ref = reference_logits(&gst, s, NULL, &moe, &half, ids, T);
    CHECK(moe.least_gap > 1e-3, "the routing is clear-cut (least gap %g)", moe.least_gap);
    /* the check could fail: softmax routing, or the choice bias ignored, moves the logits */
    moe_shape softmax = moe;
    softmax.sigmoid = 0;
    double *other = reference_logits(&gst, s, NULL, &softmax, &half, ids, T);
    double moved = 0;
    for (int i = 0; i < s->vocab; i++)
        moved = fmax(moved, fabs(ref[i] - other[i]));
    CHECK(moved > 0.01, "sigmoid routing changes the logits by %g only", moved);
    free(other);
    if (grouped) { /* and so could leaving the group limit out */
        moe_shape ungrouped = moe;
        ungrouped.n_group = ungrouped.topk_group = 1;
        other = reference_logits(&gst, s, NULL, &ungrouped, &half, ids, T);
        moved = 0;
        for (int i = 0; i < s->vocab; i++)
            moved = fmax(moved, fabs(ref[i] - other[i]));
        CHECK(moved > 0.01, "the group limit changes the logits by %g only", moved);
        free(other);
    }
    loom_safetensors_close(&gst);

    CHECK(loom_convert(folder, gguf, "f32", NULL, NULL, err, sizeof err) == 0, "convert: %s", err);
    CHECK(!strcmp(gguf_arch(gguf), "glm4moe"), "the converted file is GGUF 'glm4moe', not '%s'",
          gguf_arch(gguf));
    check_forms(what, gguf, folder, ref, s->vocab, ids, T);
    /* llama.cpp's glm4moe (src/models/glm4-moe.cpp) reads the norm before the MLP as
     * post_attention_norm and has no ffn_norm; files loom wrote before said ffn_norm, which
     * still load */
    char older[4300];
    snprintf(older, sizeof older, "%s/glm45-older.gguf", tmp);
    loom_gguf g;
    if (loom_gguf_open(&g, gguf, err, sizeof err) == 0) {
        loom_gguf_writer *w = loom_gguf_writer_create();
        for (uint64_t i = 0; i < g.n_kv; i++)
            if (strcmp(g.kv[i].key, "general.alignment"))
                loom_gguf_copy_kv(w, &g, &g.kv[i]);
        int named = 0, old_named = 0;
        for (uint64_t i = 0; i < g.n_tensors; i++) {
            const loom_gguf_tensor *t = &g.tensors[i];
            char name[96];
            const char *at = strstr(t->name, ".post_attention_norm.");
            named += at != NULL;
            old_named += strstr(t->name, ".ffn_norm.") != NULL;
            if (at)
                snprintf(name, sizeof name, "%.*s.ffn_norm.weight", (int)(at - t->name), t->name);
            loom_gguf_add_tensor(w, at ? name : t->name, t->type, t->n_dims, t->ne,
                                 loom_gguf_tensor_data(&g, t));
        }
        CHECK(named == s->layers && old_named == 0,
              "%s: %d layers' post_attention_norm and %d ffn_norm in loom's file; llama.cpp's "
              "names say %d and 0",
              what, named, old_named, s->layers);
        CHECK(loom_gguf_write(w, older, err, sizeof err) == 0, "older file: %s", err);
        loom_gguf_writer_free(w);
        loom_gguf_close(&g);
        check_forms("GLM-4.5 (ffn_norm, as loom wrote it before)", older, folder, ref, s->vocab,
                    ids, T);
        unlink(older);
    }
    free(ref);
    unlink(gguf);
    /* a config the weights contradict is refused by name: no shared experts said, but there;
     * q/k norms said, but absent */
    static const struct {
        const char *from, *to, *want;
    } lies[] = {{"\"n_shared_experts\": 1", "\"n_shared_experts\": 0",
                 "mlp.shared_experts.gate_proj.weight', which config.json does not explain (its "
                 "n_shared_experts"},
                {"\"use_qk_norm\": false", "\"use_qk_norm\": true",
                 "use_qk_norm says there is 'model.layers.0.self_attn.q_norm.weight'"}};
    for (size_t k = 0; k < sizeof lies / sizeof *lies && !grouped; k++) {
        char lie[2048], *at = strstr(cfg, lies[k].from);
        CHECK(at != NULL, "the config has %s", lies[k].from);
        if (!at)
            continue;
        snprintf(lie, sizeof lie, "%.*s%s%s", (int)(at - cfg), cfg, lies[k].to,
                 at + strlen(lies[k].from));
        write_text(folder, "config.json", lie);
        err[0] = 0;
        CHECK(loom_convert(folder, gguf, "f32", NULL, NULL, err, sizeof err) != 0 &&
                  strstr(err, lies[k].want),
              "%s: want '%s', got '%s'", lies[k].to, lies[k].want, err);
        unlink(gguf);
    }
    write_text(folder, "config.json", cfg);
}

/* GLM-4-0414 (Glm4ForCausalLM) from tiny-qwen2: its attention (q/k/v biases) with GLM's
 * interleaved RoPE over half of each head, gate and up fused into gate_up_proj, and the two
 * post-norms (post_self_attn_layernorm, post_mlp_layernorm) that Glm4DecoderLayer applies to
 * each block's output before the residual add; against the reference with those rules. */
static void test_glm4(const loom_safetensors *st, const shape *s, const char *qwen2_dir)
{
    int32_t ids[64];
    int T = plain_prompt(ids, 64);
    char folder[4200], gguf[4200], p[4400], name[128], from[128];
    snprintf(folder, sizeof folder, "%s/glm4", tmp);
    snprintf(gguf, sizeof gguf, "%s/glm4-f32.gguf", tmp);
    mkdir(folder, 0755);
    st_out o = {cJSON_CreateObject(), NULL, 0, 0};
    for (int i = 0; i < st->n_tensors; i++) {
        /* every tensor as it is (post_attention_layernorm is GLM's pre-MLP norm too), but
         * gate and up, which gate_up_proj holds */
        const loom_st_tensor *t = &st->tensors[i];
        if (!strstr(t->name, ".mlp.gate_proj.") && !strstr(t->name, ".mlp.up_proj."))
            st_add(&o, t->name, t->dtype, t->n_dims, t->shape, t->data, t->size);
    }
    for (int l = 0; l < s->layers; l++) {
        snprintf(from, sizeof from, "model.layers.%d.mlp.gate_proj.weight", l);
        const loom_st_tensor *gate = loom_safetensors_find(st, from);
        snprintf(from, sizeof from, "model.layers.%d.mlp.up_proj.weight", l);
        const loom_st_tensor *up = loom_safetensors_find(st, from);
        CHECK(gate && up && !strcmp(gate->dtype, up->dtype) && gate->size == up->size,
              "tiny-qwen2's layer %d has gate and up of one type", l);
        if (!gate || !up)
            return;
        unsigned char *both = malloc(gate->size * 2);
        memcpy(both, gate->data, gate->size);
        memcpy(both + gate->size, up->data, up->size);
        int64_t shp[2] = {2 * gate->shape[0], gate->shape[1]};
        snprintf(name, sizeof name, "model.layers.%d.mlp.gate_up_proj.weight", l);
        st_add(&o, name, gate->dtype, 2, shp, both, gate->size * 2);
        free(both);
        static const char *const post[] = {"post_self_attn_layernorm", "post_mlp_layernorm"};
        for (int j = 0; j < 2; j++) {
            float w[512];
            for (int i = 0; i < s->d; i++) /* away from 1, so that leaving them out shows */
                w[i] = (float)(0.6 + 0.5 * sin(3.0 * l + 5.0 * j + 0.7 * i));
            int64_t dshape[1] = {s->d};
            snprintf(name, sizeof name, "model.layers.%d.%s.weight", l, post[j]);
            st_add(&o, name, "F32", 1, dshape, w, (size_t)s->d * sizeof *w);
        }
    }
    snprintf(p, sizeof p, "%s/model.safetensors", folder);
    CHECK(st_write(&o, p) == 0, "writing %s", p);
    char cfg[2048];
    /* GLM-4-9B-0414's config keys, with tiny-qwen2's numbers */
    snprintf(cfg, sizeof cfg,
             "{\"architectures\": [\"Glm4ForCausalLM\"], \"model_type\": \"glm4\", "
             "\"hidden_size\": %d, \"num_attention_heads\": %d, \"num_key_value_heads\": %d, "
             "\"head_dim\": %d, \"num_hidden_layers\": %d, \"intermediate_size\": %d, "
             "\"rms_norm_eps\": %g, \"rope_theta\": %.1f, \"max_position_embeddings\": 32768, "
             "\"vocab_size\": %d, \"attention_bias\": true, \"tie_word_embeddings\": true, "
             "\"partial_rotary_factor\": 0.5, \"hidden_act\": \"silu\", \"attention_dropout\": "
             "0.0, \"torch_dtype\": \"float16\"}",
             s->d, s->heads, s->kv, s->hd, s->layers, s->ff, s->eps, s->theta, s->vocab);
    write_text(folder, "config.json", cfg);
    static const char *const copied[] = {"vocab.json", "merges.txt", "tokenizer_config.json",
                                         "generation_config.json"};
    for (size_t i = 0; i < sizeof copied / sizeof copied[0]; i++) {
        snprintf(p, sizeof p, "%s/%s", qwen2_dir, copied[i]);
        link_file(folder, copied[i], p);
    }
    loom_safetensors gst;
    if (loom_safetensors_open(&gst, folder, err, sizeof err) != 0) {
        CHECK(0, "the GLM-4-0414 folder: %s", err);
        return;
    }
    shape glm = *s;
    glm.fused_gate_up = glm.post_norms = 1;
    rope_shape half = {.attention = 1, .n_rot = s->hd / 2, .adjacent = 1};
    for (int i = 0; i < s->hd / 4; i++)
        half.inv_freq[i] = pow(s->theta, -2.0 * i / (s->hd / 2));
    double *ref = reference_logits(&gst, &glm, NULL, NULL, &half, ids, T);
    /* the checks could fail: without the post-norms, or with NeoX pairs, the logits move */
    shape no_post = glm;
    no_post.post_norms = 0;
    rope_shape neox = half;
    neox.adjacent = 0;
    double *other[2] = {reference_logits(&gst, &no_post, NULL, NULL, &half, ids, T),
                        reference_logits(&gst, &glm, NULL, NULL, &neox, ids, T)};
    for (int k = 0; k < 2; k++) {
        double moved = 0;
        for (int i = 0; i < s->vocab; i++)
            moved = fmax(moved, fabs(ref[i] - other[k][i]));
        CHECK(moved > 0.01, "%s changes the logits by %g only",
              k ? "GLM's interleaved RoPE" : "the post-norms", moved);
        free(other[k]);
    }
    loom_safetensors_close(&gst);

    CHECK(loom_convert(folder, gguf, "f32", NULL, NULL, err, sizeof err) == 0, "convert: %s", err);
    CHECK(!strcmp(gguf_arch(gguf), "glm4"), "the converted file is GGUF 'glm4', not '%s'",
          gguf_arch(gguf));
    check_gguf_conventions(gguf, "GLM-4-0414 (converted)");
    check_forms("GLM-4-0414", gguf, folder, ref, s->vocab, ids, T);
    free(ref);
    unlink(gguf);
}

int main(void)
{
    snprintf(fixtures, sizeof fixtures, "%s", fixtures_dir());
    char qwen2_dir[4200];
    snprintf(qwen2_dir, sizeof qwen2_dir, "%s/tiny-qwen2", fixtures);
    char probe[4400];
    snprintf(probe, sizeof probe, "%s/model.safetensors", qwen2_dir);
    need_fixture(probe);
    snprintf(probe, sizeof probe, "%s/tokenizers/qwen1/qwen.tiktoken", fixtures);
    need_fixture(probe);
    unsetenv("LOOM_BACKEND");
    if (!mkdtemp(tmp))
        return 1;
    loom_safetensors st;
    if (loom_safetensors_open(&st, qwen2_dir, err, sizeof err) != 0) {
        CHECK(0, "tiny-qwen2: %s", err);
        return check_finish("test_qwen");
    }
    shape s = read_shape(qwen2_dir);
    CHECK(s.layers <= 8 && s.hd <= 256, "tiny-qwen2 is tiny");
    test_qwen1(&st, &s);
    test_qwen3(&st, &s, qwen2_dir);
    test_qwen3moe(&st, &s, qwen2_dir);
    test_yarn(&st, &s, qwen2_dir);
    test_glm45(&st, &s, qwen2_dir, 0);
    test_glm45(&st, &s, qwen2_dir, 1);
    test_glm4(&st, &s, qwen2_dir);
    loom_safetensors_close(&st);
    char cmd[4400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    CHECK(system(cmd) == 0, "cleaning %s", tmp);
    return check_finish("test_qwen");
}
