#define _GNU_SOURCE
/*
 * tests/test_hybrid_variants.c - the Qwen3.5 shapes the fixtures do not hold, against a double-
 * precision forward pass written here from Hugging Face's modelling code (qwen3_5 and
 * qwen3_5_moe: Qwen3_5GatedDeltaNet's torch_recurrent_gated_delta_rule, Qwen3_5Attention,
 * Qwen3NextSparseMoeBlock with Qwen3VLMoeTextTopKRouter):
 *   - the pass itself first reproduces tiny-qwen35's PyTorch logits (float64 there too);
 *   - a qwen35 file whose layers' kinds are attention.recurrent_layers' flags (an interval
 *     saying otherwise), and one whose flags are too few, which is refused;
 *   - twice as many value heads as key heads (as Qwen3.5-9B and every larger member have):
 *     Hugging Face groups the value heads by key head, llama.cpp's qwen35 files and loom's
 *     conversion tile them (ABI 1.9's v_heads_tiled); the folder as it is and converted, on every
 *     usable backend (the weights are such that reading the heads in the wrong order moves the
 *     logits by far more than the tolerance);
 *   - Qwen3-Next (Qwen3NextForCausalLM: in_proj_qkvz and in_proj_ba fused per key head, which
 *     loom's file splits as llama.cpp's does; the value heads stay grouped; an untied head);
 *   - Qwen3.5-MoE (Qwen3_5MoeForCausalLM: experts, top k of a softmax always renormalised, a
 *     shared expert gated by sigmoid(shared_expert_gate h)) with one matrix per expert, and the
 *     multimodal Qwen3_5MoeForConditionalGeneration with transformers 5's stacked experts
 *     (gate_up_proj, down_proj): logits and greedy tokens, GGUF "qwen35moe" with llama.cpp's
 *     tensor names (without the renormalisation the logits move by more than the tolerance).
 */
#include <loom/loom.h>

#include "api/internal.h"
#include "core/gguf.h"
#include "core/runner.h"
#include "core/safetensors.h"
#include "backends.h"
#include "check.h"
#include "fixture_model.h"
#include "gguf_conventions.h"
#include "hf_writer.h"
#include "reference_f64.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <string.h>
#include <unistd.h>

static char err[4096], dir[4096], tmp[] = "/tmp/loom-hybrid-variants-XXXXXX";

/* tiny-qwen35's shape (its config.json), and what a variant changes */
typedef struct shape {
    int d, layers, heads, kv, hd, rot, ff, vocab, interval;
    int hk, hv, dk, dv, kernel;
    double eps, theta;
    int experts, k, moe_ff, shared_ff; /* experts 0: a dense MLP */
    int stacked;                       /* transformers 5's [experts, ...] stacks */
    int next;                          /* Qwen3-Next: in_proj_qkvz and in_proj_ba, lm_head */
} shape;

static shape base_shape(void)
{
    return (shape){.d = 32,
                   .layers = 4,
                   .heads = 4,
                   .kv = 2,
                   .hd = 32,
                   .rot = 8,
                   .ff = 64,
                   .vocab = 151936,
                   .interval = 4,
                   .hk = 2,
                   .hv = 2,
                   .dk = 16,
                   .dv = 16,
                   .kernel = 4,
                   .eps = 1e-6,
                   .theta = 1e7};
}

/* ---- the reference ------------------------------------------------------------------------ */

/* The tensor P + fmt of layer l */
static double *load(const loom_safetensors *st, const char *P, const char *fmt, int l)
{
    char part[160], name[256];
    snprintf(part, sizeof part, fmt, l);
    snprintf(name, sizeof name, "%s%s", P, part);
    double *t = load_f64(st, name, 0, NULL);
    return t ? t : calloc(1 << 20, sizeof(double)); /* (a failed check already) */
}

/* Qwen3_5RMSNorm: x / rms * (1 + w); plain: x / rms * w (the gated norm's) */
static void rms_norm(double *x, int n, const double *w, double eps, int plain)
{
    double ss = 0;
    for (int i = 0; i < n; i++)
        ss += x[i] * x[i];
    const double inv = 1.0 / sqrt(ss / n + eps);
    for (int i = 0; i < n; i++)
        x[i] = x[i] * inv * (plain ? w[i] : 1.0 + w[i]);
}

static double silu(double x)
{
    return x / (1.0 + exp(-x));
}

static double sigmoid(double x)
{
    return 1.0 / (1.0 + exp(-x));
}

/* What the reference may be told to get wrong, to show the checks would see it. */
typedef struct mistakes {
    int heads_tiled;    /* value head h reads key head h % hk, not h / (hv / hk) */
    int no_renormalise; /* the chosen experts' weights as the softmax gave them */
} mistakes;

/* x += the MoE block's output for h (Qwen3NextSparseMoeBlock); *least_gap: the least margin
 * between the k-th and the next expert's probability seen */
static void moe_block(const loom_safetensors *st, const char *P, const shape *s, int l,
                      const double *h, double *x, const mistakes *wrong, double *least_gap)
{
    const int D = s->d, E = s->experts, F = s->moe_ff, SF = s->shared_ff;
    double *router = load(st, P, "layers.%d.mlp.gate.weight", l);
    double prob[64], mx = -INFINITY, sum = 0, chosen_sum = 0;
    int chosen[64] = {0}, order[64];
    linear(prob, router, NULL, h, E, D);
    for (int e = 0; e < E; e++)
        mx = fmax(mx, prob[e]);
    for (int e = 0; e < E; e++)
        sum += prob[e] = exp(prob[e] - mx);
    for (int e = 0; e < E; e++)
        prob[e] /= sum;
    for (int j = 0; j <= s->k && j < E; j++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (!chosen[e] && (best < 0 || prob[e] > prob[best]))
                best = e;
        chosen[best] = 1;
        order[j] = best;
        if (j < s->k)
            chosen_sum += prob[best];
    }
    if (s->k < E)
        *least_gap = fmin(*least_gap, prob[order[s->k - 1]] - prob[order[s->k]]);
    double *gu = NULL, *dn = NULL; /* the stacks, or each expert's own */
    if (s->stacked) {
        gu = load(st, P, "layers.%d.mlp.experts.gate_up_proj", l);
        dn = load(st, P, "layers.%d.mlp.experts.down_proj", l);
    }
    double *g = malloc((size_t)(F > SF ? F : SF) * sizeof *g);
    double *u = malloc((size_t)(F > SF ? F : SF) * sizeof *u), *o = malloc((size_t)D * sizeof *o);
    for (int j = 0; j < s->k; j++) {
        const int e = order[j];
        char name[96];
        double *wg, *wu, *wd;
        if (s->stacked) {
            wg = gu + (size_t)e * 2 * F * D, wu = wg + (size_t)F * D, wd = dn + (size_t)e * D * F;
        } else {
            snprintf(name, sizeof name, "layers.%%d.mlp.experts.%d.gate_proj.weight", e);
            wg = load(st, P, name, l);
            snprintf(name, sizeof name, "layers.%%d.mlp.experts.%d.up_proj.weight", e);
            wu = load(st, P, name, l);
            snprintf(name, sizeof name, "layers.%%d.mlp.experts.%d.down_proj.weight", e);
            wd = load(st, P, name, l);
        }
        linear(g, wg, NULL, h, F, D);
        linear(u, wu, NULL, h, F, D);
        for (int i = 0; i < F; i++)
            g[i] = silu(g[i]) * u[i];
        linear(o, wd, NULL, g, D, F);
        const double weight = prob[e] / (wrong->no_renormalise ? 1.0 : chosen_sum);
        for (int i = 0; i < D; i++)
            x[i] += weight * o[i];
        if (!s->stacked)
            free(wg), free(wu), free(wd);
    }
    double *sg = load(st, P, "layers.%d.mlp.shared_expert.gate_proj.weight", l);
    double *su = load(st, P, "layers.%d.mlp.shared_expert.up_proj.weight", l);
    double *sd = load(st, P, "layers.%d.mlp.shared_expert.down_proj.weight", l);
    double *sgate = load(st, P, "layers.%d.mlp.shared_expert_gate.weight", l), gate;
    linear(g, sg, NULL, h, SF, D);
    linear(u, su, NULL, h, SF, D);
    for (int i = 0; i < SF; i++)
        g[i] = silu(g[i]) * u[i];
    linear(o, sd, NULL, g, D, SF);
    linear(&gate, sgate, NULL, h, 1, D);
    for (int i = 0; i < D; i++)
        x[i] += sigmoid(gate) * o[i];
    free(sg), free(su), free(sd), free(sgate), free(router), free(gu), free(dn);
    free(g), free(u), free(o);
}

/* The last position's logits for ids, the weights under prefix P ("model." or
 * "model.language_model."); states: every position's final hidden state (after the norm), or
 * NULL. With x0 instead of ids (T rows of the residual stream's input), the decoder layer and
 * final norm under P = "mtp." (the multi-token-prediction block: one full-attention layer),
 * the embeddings and head the model's. */
static double *forward(const loom_safetensors *st, const char *P, const shape *s,
                       const int32_t *ids, const double *x0, int T, const mistakes *wrong,
                       double *least_gap, double *states)
{
    const int D = s->d, H = s->heads, KV = s->kv, hd = s->hd, K = s->kernel;
    const int hk = s->hk, hv = s->hv, dk = s->dk, dv = s->dv, C = 2 * hk * dk + hv * dv;
    double *x = malloc((size_t)T * D * sizeof *x), *h = malloc((size_t)T * D * sizeof *h);
    double *emb = load(st, x0 ? "model." : P, "embed_tokens.weight", 0);
    for (int t = 0; t < T; t++)
        memcpy(x + (size_t)t * D, x0 ? x0 + (size_t)t * D : emb + (size_t)ids[t] * D,
               (size_t)D * sizeof *x);
    double *mixed = malloc((size_t)T * C * sizeof *mixed),
           *conv = malloc((size_t)T * C * sizeof *conv);
    double *z = malloc((size_t)T * hv * dv * sizeof *z), *o = malloc((size_t)hv * dv * sizeof *o);
    double *a = malloc((size_t)T * hv * sizeof *a), *b = malloc((size_t)T * hv * sizeof *b);
    double *S = malloc((size_t)hv * dk * dv * sizeof *S), *y = malloc((size_t)D * sizeof *y);
    double *q = malloc((size_t)T * H * 2 * hd * sizeof *q),
           *k = malloc((size_t)T * KV * hd * sizeof *k);
    double *v = malloc((size_t)T * KV * hd * sizeof *v),
           *att = malloc((size_t)H * hd * sizeof *att);
    double *p = malloc((size_t)T * sizeof *p), *f1 = malloc((size_t)s->ff * sizeof *f1);
    double *f2 = malloc((size_t)s->ff * sizeof *f2);
    for (int l = 0; l < (x0 ? 1 : s->layers); l++) {
        double *ln1 = load(st, P, "layers.%d.input_layernorm.weight", l);
        for (int t = 0; t < T; t++) {
            memcpy(h + (size_t)t * D, x + (size_t)t * D, (size_t)D * sizeof *h);
            rms_norm(h + (size_t)t * D, D, ln1, s->eps, 0);
        }
        free(ln1);
        if (!x0 && (l + 1) % s->interval) { /* Qwen3_5GatedDeltaNet */
            double *wqkv = NULL, *wz = NULL, *wa = NULL, *wb = NULL, *wqkvz = NULL, *wba = NULL;
            if (s->next) {
                wqkvz = load(st, P, "layers.%d.linear_attn.in_proj_qkvz.weight", l);
                wba = load(st, P, "layers.%d.linear_attn.in_proj_ba.weight", l);
            } else {
                wqkv = load(st, P, "layers.%d.linear_attn.in_proj_qkv.weight", l);
                wz = load(st, P, "layers.%d.linear_attn.in_proj_z.weight", l);
                wa = load(st, P, "layers.%d.linear_attn.in_proj_a.weight", l);
                wb = load(st, P, "layers.%d.linear_attn.in_proj_b.weight", l);
            }
            double *cw = load(st, P, "layers.%d.linear_attn.conv1d.weight", l);
            double *alog = load(st, P, "layers.%d.linear_attn.A_log", l);
            double *dt = load(st, P, "layers.%d.linear_attn.dt_bias", l);
            double *nw = load(st, P, "layers.%d.linear_attn.norm.weight", l);
            double *wo = load(st, P, "layers.%d.linear_attn.out_proj.weight", l);
            for (int t = 0; t < T; t++) {
                const double *ht = h + (size_t)t * D;
                if (s->next) { /* fix_query_key_value_ordering: per key head [q k v z], [b a] */
                    const int per = hv / hk, rv = per * dv, g = 2 * dk + 2 * rv;
                    double qkvz[4096], ba[256];
                    linear(qkvz, wqkvz, NULL, ht, hk * g, D);
                    linear(ba, wba, NULL, ht, 2 * hv, D);
                    double *mt = mixed + (size_t)t * C;
                    for (int kh = 0; kh < hk; kh++) {
                        const double *grp = qkvz + (size_t)kh * g;
                        memcpy(mt + kh * dk, grp, (size_t)dk * sizeof *mt);
                        memcpy(mt + (hk + kh) * dk, grp + dk, (size_t)dk * sizeof *mt);
                        memcpy(mt + 2 * hk * dk + kh * rv, grp + 2 * dk, (size_t)rv * sizeof *mt);
                        memcpy(z + (size_t)t * hv * dv + kh * rv, grp + 2 * dk + rv,
                               (size_t)rv * sizeof *z);
                        for (int i = 0; i < per; i++) {
                            b[(size_t)t * hv + kh * per + i] = ba[kh * 2 * per + i];
                            a[(size_t)t * hv + kh * per + i] = ba[kh * 2 * per + per + i];
                        }
                    }
                    continue;
                }
                linear(mixed + (size_t)t * C, wqkv, NULL, ht, C, D);
                linear(z + (size_t)t * hv * dv, wz, NULL, ht, hv * dv, D);
                linear(a + (size_t)t * hv, wa, NULL, ht, hv, D);
                linear(b + (size_t)t * hv, wb, NULL, ht, hv, D);
            }
            for (int t = 0; t < T; t++) /* the causal depthwise conv1d (padding K - 1), SiLU */
                for (int c = 0; c < C; c++) {
                    double acc = 0;
                    for (int j = 0; j < K; j++) {
                        int from = t - (K - 1) + j;
                        if (from >= 0)
                            acc += cw[(size_t)c * K + j] * mixed[(size_t)from * C + c];
                    }
                    conv[(size_t)t * C + c] = silu(acc);
                }
            memset(S, 0, (size_t)hv * dk * dv * sizeof *S);
            for (int t = 0; t < T; t++) {
                double *ct = conv + (size_t)t * C;
                for (int j = 0; j < 2 * hk; j++) { /* l2norm of each q and k head (1e-6) */
                    double ss = 0, *vec = ct + (size_t)j * dk;
                    for (int i = 0; i < dk; i++)
                        ss += vec[i] * vec[i];
                    for (int i = 0; i < dk; i++)
                        vec[i] /= sqrt(ss + 1e-6);
                }
                for (int hh = 0; hh < hv; hh++) {
                    const int kh = wrong->heads_tiled ? hh % hk : hh / (hv / hk);
                    const double *qh = ct + (size_t)kh * dk, *kk = ct + (size_t)(hk + kh) * dk;
                    const double *vh = ct + (size_t)2 * hk * dk + (size_t)hh * dv;
                    double *Sh = S + (size_t)hh * dk * dv; /* [dk][dv] */
                    double sp = a[(size_t)t * hv + hh] + dt[hh];
                    sp = sp > 20 ? sp : log1p(exp(sp));
                    const double decay = exp(-exp(alog[hh]) * sp);
                    const double beta = sigmoid(b[(size_t)t * hv + hh]);
                    for (int i = 0; i < dk * dv; i++)
                        Sh[i] *= decay;
                    for (int j = 0; j < dv; j++) {
                        double mem = 0;
                        for (int i = 0; i < dk; i++)
                            mem += Sh[i * dv + j] * kk[i];
                        const double delta = (vh[j] - mem) * beta;
                        for (int i = 0; i < dk; i++)
                            Sh[i * dv + j] += kk[i] * delta;
                    }
                    double *oh = o + (size_t)hh * dv;
                    for (int j = 0; j < dv; j++) {
                        double acc = 0;
                        for (int i = 0; i < dk; i++)
                            acc += Sh[i * dv + j] * qh[i] / sqrt((double)dk);
                        oh[j] = acc;
                    }
                    rms_norm(oh, dv, nw, s->eps, 1); /* Qwen3_5RMSNormGated */
                    for (int j = 0; j < dv; j++)
                        oh[j] *= silu(z[((size_t)t * hv + hh) * dv + j]);
                }
                linear(y, wo, NULL, o, D, hv * dv);
                for (int i = 0; i < D; i++)
                    x[(size_t)t * D + i] += y[i];
            }
            free(wqkv), free(wz), free(wa), free(wb), free(cw), free(alog), free(dt), free(nw);
            free(wo), free(wqkvz), free(wba);
        } else { /* Qwen3_5Attention: q and its gate per head, q/k norms, partial RoPE */
            double *wq = load(st, P, "layers.%d.self_attn.q_proj.weight", l);
            double *wk = load(st, P, "layers.%d.self_attn.k_proj.weight", l);
            double *wv = load(st, P, "layers.%d.self_attn.v_proj.weight", l);
            double *wo = load(st, P, "layers.%d.self_attn.o_proj.weight", l);
            double *qn = load(st, P, "layers.%d.self_attn.q_norm.weight", l);
            double *kn = load(st, P, "layers.%d.self_attn.k_norm.weight", l);
            for (int t = 0; t < T; t++) {
                const double *ht = h + (size_t)t * D;
                double *qt = q + (size_t)t * H * 2 * hd, *kt = k + (size_t)t * KV * hd;
                linear(qt, wq, NULL, ht, H * 2 * hd, D);
                linear(kt, wk, NULL, ht, KV * hd, D);
                linear(v + (size_t)t * KV * hd, wv, NULL, ht, KV * hd, D);
                for (int j = 0; j < H + KV; j++) {
                    double *vec = j < H ? qt + (size_t)j * 2 * hd : kt + (size_t)(j - H) * hd;
                    rms_norm(vec, hd, j < H ? qn : kn, s->eps, 0);
                    for (int i = 0; i < s->rot / 2; i++) {
                        double ang = t * pow(s->theta, -2.0 * i / s->rot);
                        double c = cos(ang), sn = sin(ang), x0 = vec[i], x1 = vec[i + s->rot / 2];
                        vec[i] = x0 * c - x1 * sn;
                        vec[i + s->rot / 2] = x1 * c + x0 * sn;
                    }
                }
            }
            for (int t = 0; t < T; t++) {
                for (int hh = 0; hh < H; hh++) {
                    const double *qh = q + ((size_t)t * H + hh) * 2 * hd, *gate = qh + hd;
                    const int kh = hh / (H / KV);
                    double mx = -INFINITY, sum = 0;
                    for (int j = 0; j <= t; j++) {
                        double sc = 0;
                        for (int i = 0; i < hd; i++)
                            sc += qh[i] * k[((size_t)j * KV + kh) * hd + i];
                        p[j] = sc / sqrt((double)hd);
                        mx = fmax(mx, p[j]);
                    }
                    for (int j = 0; j <= t; j++)
                        sum += p[j] = exp(p[j] - mx);
                    for (int i = 0; i < hd; i++) {
                        double acc = 0;
                        for (int j = 0; j <= t; j++)
                            acc += p[j] / sum * v[((size_t)j * KV + kh) * hd + i];
                        att[hh * hd + i] = acc * sigmoid(gate[i]);
                    }
                }
                linear(y, wo, NULL, att, D, H * hd);
                for (int i = 0; i < D; i++)
                    x[(size_t)t * D + i] += y[i];
            }
            free(wq), free(wk), free(wv), free(wo), free(qn), free(kn);
        }
        double *ln2 = load(st, P, "layers.%d.post_attention_layernorm.weight", l);
        double *wg = NULL, *wu = NULL, *wd = NULL;
        if (!s->experts) {
            wg = load(st, P, "layers.%d.mlp.gate_proj.weight", l);
            wu = load(st, P, "layers.%d.mlp.up_proj.weight", l);
            wd = load(st, P, "layers.%d.mlp.down_proj.weight", l);
        }
        for (int t = 0; t < T; t++) {
            double *xt = x + (size_t)t * D, *ht = h + (size_t)t * D;
            memcpy(ht, xt, (size_t)D * sizeof *ht);
            rms_norm(ht, D, ln2, s->eps, 0);
            if (s->experts) {
                moe_block(st, P, s, l, ht, xt, wrong, least_gap);
                continue;
            }
            linear(f1, wg, NULL, ht, s->ff, D);
            linear(f2, wu, NULL, ht, s->ff, D);
            for (int i = 0; i < s->ff; i++)
                f1[i] = silu(f1[i]) * f2[i];
            linear(y, wd, NULL, f1, D, s->ff);
            for (int i = 0; i < D; i++)
                xt[i] += y[i];
        }
        free(ln2), free(wg), free(wu), free(wd);
    }
    double *fn = load(st, P, "norm.weight", 0), *last = x + (size_t)(T - 1) * D;
    double *logits = malloc((size_t)s->vocab * sizeof *logits);
    double *head = s->next ? load(st, "", "lm_head.weight", 0) : NULL; /* else tied */
    for (int t = states ? 0 : T - 1; t < T; t++)
        rms_norm(x + (size_t)t * D, D, fn, s->eps, 0);
    if (states)
        memcpy(states, x, (size_t)T * D * sizeof *states);
    linear(logits, head ? head : emb, NULL, last, s->vocab, D);
    free(head), free(fn), free(emb), free(x), free(h), free(mixed), free(conv), free(z), free(o),
        free(a);
    free(b), free(S), free(y), free(q), free(k), free(v), free(att), free(p), free(f1), free(f2);
    return logits;
}

static double *reference(const loom_safetensors *st, const char *P, const shape *s,
                         const int32_t *ids, int T, const mistakes *wrong, double *least_gap)
{
    return forward(st, P, s, ids, NULL, T, wrong, least_gap, NULL);
}

/* The multi-token-prediction block (vLLM's Qwen3NextMultiTokenPredictor: transformers' code
 * leaves mtp.* out) over the pairs (the model's final hidden state at t, ids[t + 1]) at
 * positions t < T - 1: fc of [pre_fc_norm_embedding(embedding); pre_fc_norm_hidden(state)]
 * (both (1 + w) norms), a full-attention decoder layer, mtp.norm, the tied head. Every pair's
 * logits, [T - 1][vocab]. */
static double *mtp_reference(const loom_safetensors *st, const shape *s, const int32_t *ids, int T,
                             const double *states)
{
    const int D = s->d, n = T - 1;
    double *emb = load(st, "model.", "embed_tokens.weight", 0);
    double *fc = load(st, "mtp.", "fc.weight", 0);
    double *en = load(st, "mtp.", "pre_fc_norm_embedding.weight", 0);
    double *hn = load(st, "mtp.", "pre_fc_norm_hidden.weight", 0);
    double *x0 = malloc((size_t)n * D * sizeof *x0), *both = malloc((size_t)2 * D * sizeof *both);
    double *out = malloc((size_t)n * D * sizeof *out);
    double *logits = malloc((size_t)n * s->vocab * sizeof *logits);
    for (int t = 0; t < n; t++) {
        memcpy(both, emb + (size_t)ids[t + 1] * D, (size_t)D * sizeof *both);
        memcpy(both + D, states + (size_t)t * D, (size_t)D * sizeof *both);
        rms_norm(both, D, en, s->eps, 0);
        rms_norm(both + D, D, hn, s->eps, 0);
        linear(x0 + (size_t)t * D, fc, NULL, both, D, 2 * D);
    }
    mistakes none = {0};
    double gap = INFINITY;
    free(forward(st, "mtp.", s, NULL, x0, n, &none, &gap, out));
    for (int t = 0; t < n; t++)
        linear(logits + (size_t)t * s->vocab, emb, NULL, out + (size_t)t * D, s->vocab, D);
    free(emb), free(fc), free(en), free(hn), free(x0), free(both), free(out);
    return logits;
}

static int argmax_d(const double *x, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        best = x[i] > x[best] ? i : best;
    return best;
}

static double max_diff(const double *want, const float *got, int n)
{
    double worst = 0;
    for (int i = 0; i < n; i++)
        worst = fmax(worst, fabs(want[i] - got[i]));
    return worst;
}

static double max_diff_d(const double *a, const double *b, int n)
{
    double worst = 0;
    for (int i = 0; i < n; i++)
        worst = fmax(worst, fabs(a[i] - b[i]));
    return worst;
}

/* ---- the variants' folders ---------------------------------------------------------------- */

static uint64_t rng = 0x9e3779b97f4a7c15u;

/* uniform in [-1, 1) (xorshift64*) */
static double uniform(void)
{
    rng ^= rng >> 12, rng ^= rng << 25, rng ^= rng >> 27;
    return (double)((rng * 2685821657736338717u) >> 11) / 4503599627370496.0 - 1.0;
}

/* An f32 tensor of values center + amp * uniform */
static void add_random(st_out *o, const char *name, int n_dims, const int64_t *shape, double center,
                       double amp)
{
    int64_t n = 1;
    for (int i = 0; i < n_dims; i++)
        n *= shape[i];
    float *w = malloc((size_t)n * sizeof *w);
    for (int64_t i = 0; i < n; i++)
        w[i] = (float)(center + amp * uniform());
    st_add(o, name, "F32", n_dims, shape, w, (size_t)n * sizeof *w);
    free(w);
}

#define SHAPE(...)                                                                                 \
    (sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[])                              \
    {                                                                                              \
        __VA_ARGS__                                                                                \
    }

/* The folder of shape s, in f32: tiny-qwen35's embeddings, norms and attention layers, new linear-
 * attention weights of s's heads, and the MLPs or experts s says; prefix P. The tokenizer is
 * tiny-qwen2's (tiny-qwen35's vocabulary). */
static int make_folder(const loom_safetensors *base, const shape *s, const char *P,
                       const char *folder, int multimodal)
{
    if (mkdir(folder, 0700) != 0)
        return -1;
    st_out o = {cJSON_CreateObject(), NULL, 0, 0};
    const double amp = 0.17; /* the fixture's weights' spread (sd 0.1) */
    char name[256];
    for (int i = 0; i < base->n_tensors; i++) {
        const char *n = base->tensors[i].name;
        if (strncmp(n, "model.", 6) != 0 || strstr(n, "linear_attn.") || strstr(n, ".mlp."))
            continue;
        snprintf(name, sizeof name, "%s%s", P, n + 6);
        const loom_st_tensor *t = &base->tensors[i]; /* in f32: the folder is then exact too */
        int64_t count = 1;
        for (int j = 0; j < t->n_dims; j++)
            count *= t->shape[j];
        float *f = malloc((size_t)count * sizeof *f);
        loom_row_to_f32((loom_dtype)t->loom_type, t->data, f, count);
        st_add(&o, name, "F32", t->n_dims, t->shape, f, (size_t)count * sizeof *f);
        free(f);
    }
    const int64_t D = s->d, C = 2 * s->hk * s->dk + s->hv * s->dv, inner = s->hv * s->dv;
    for (int l = 0; l < s->layers; l++) {
#define NAME(fmt) (snprintf(name, sizeof name, "%slayers.%d." fmt, P, l), name)
        if ((l + 1) % s->interval && s->next) {
            add_random(&o, NAME("linear_attn.in_proj_qkvz.weight"), SHAPE(C + inner, D), 0, amp);
            add_random(&o, NAME("linear_attn.in_proj_ba.weight"), SHAPE(2 * s->hv, D), 0, amp);
        } else if ((l + 1) % s->interval) {
            add_random(&o, NAME("linear_attn.in_proj_qkv.weight"), SHAPE(C, D), 0, amp);
            add_random(&o, NAME("linear_attn.in_proj_z.weight"), SHAPE(inner, D), 0, amp);
            add_random(&o, NAME("linear_attn.in_proj_a.weight"), SHAPE(s->hv, D), 0, amp);
            add_random(&o, NAME("linear_attn.in_proj_b.weight"), SHAPE(s->hv, D), 0, amp);
        }
        if ((l + 1) % s->interval) {
            add_random(&o, NAME("linear_attn.conv1d.weight"), SHAPE(C, 1, s->kernel), 0, 0.9);
            add_random(&o, NAME("linear_attn.A_log"), SHAPE(s->hv), -1.4, 0.9);
            add_random(&o, NAME("linear_attn.dt_bias"), SHAPE(s->hv), 1.0, 0.3);
            add_random(&o, NAME("linear_attn.norm.weight"), SHAPE(s->dv), 1.0, 0.2);
            add_random(&o, NAME("linear_attn.out_proj.weight"), SHAPE(D, inner), 0, amp);
        }
        if (!s->experts) {
            add_random(&o, NAME("mlp.gate_proj.weight"), SHAPE(s->ff, D), 0, amp);
            add_random(&o, NAME("mlp.up_proj.weight"), SHAPE(s->ff, D), 0, amp);
            add_random(&o, NAME("mlp.down_proj.weight"), SHAPE(D, s->ff), 0, amp);
            continue;
        }
        const int64_t E = s->experts, F = s->moe_ff;
        add_random(&o, NAME("mlp.gate.weight"), SHAPE(E, D), 0, 0.6); /* decisive routing */
        if (s->stacked) {
            add_random(&o, NAME("mlp.experts.gate_up_proj"), SHAPE(E, 2 * F, D), 0, amp);
            add_random(&o, NAME("mlp.experts.down_proj"), SHAPE(E, D, F), 0, amp);
        } else {
            for (int e = 0; e < E; e++) {
                char fmt[96];
                const char *const proj[] = {"gate_proj", "up_proj", "down_proj"};
                for (int j = 0; j < 3; j++) {
                    snprintf(fmt, sizeof fmt, "%slayers.%d.mlp.experts.%d.%s.weight", P, l, e,
                             proj[j]);
                    add_random(&o, fmt, 2, j < 2 ? (int64_t[]){F, D} : (int64_t[]){D, F}, 0, amp);
                }
            }
        }
        add_random(&o, NAME("mlp.shared_expert.gate_proj.weight"), SHAPE(s->shared_ff, D), 0, amp);
        add_random(&o, NAME("mlp.shared_expert.up_proj.weight"), SHAPE(s->shared_ff, D), 0, amp);
        add_random(&o, NAME("mlp.shared_expert.down_proj.weight"), SHAPE(D, s->shared_ff), 0, amp);
        add_random(&o, NAME("mlp.shared_expert_gate.weight"), SHAPE(1, D), 0, amp);
#undef NAME
    }
    if (s->next) /* Qwen3-Next's head is its own */
        add_random(&o, "lm_head.weight", SHAPE(s->vocab, D), 0, amp);
    char path[4400];
    snprintf(path, sizeof path, "%s/model.safetensors", folder);
    CHECK(st_write(&o, path) == 0, "writing %s", path);

    snprintf(path, sizeof path, "%s/tiny-qwen35/config.json", dir);
    char *text = slurp(path, NULL);
    cJSON *cf = cJSON_Parse(text);
    free(text);
    cJSON_ReplaceItemInObject(cf, "linear_num_value_heads", cJSON_CreateNumber(s->hv));
    cJSON_DeleteItemFromObject(cf, "mtp_num_hidden_layers");
    if (s->experts) {
        cJSON_DeleteItemFromObject(cf, "intermediate_size");
        cJSON_DeleteItemFromObject(cf, "mlp_only_layers");
        cJSON_ReplaceItemInObject(cf, "model_type", cJSON_CreateString("qwen3_5_moe_text"));
        cJSON_ReplaceItemInObject(
            cf, "architectures",
            cJSON_CreateStringArray((const char *[]){"Qwen3_5MoeForCausalLM"}, 1));
        cJSON_AddNumberToObject(cf, "num_experts", s->experts);
        cJSON_AddNumberToObject(cf, "num_experts_per_tok", s->k);
        cJSON_AddNumberToObject(cf, "moe_intermediate_size", s->moe_ff);
        cJSON_AddNumberToObject(cf, "shared_expert_intermediate_size", s->shared_ff);
    }
    if (s->next) { /* Qwen3NextForCausalLM: plain RoPE, its own head */
        cJSON_ReplaceItemInObject(cf, "model_type", cJSON_CreateString("qwen3_next"));
        cJSON_ReplaceItemInObject(
            cf, "architectures",
            cJSON_CreateStringArray((const char *[]){"Qwen3NextForCausalLM"}, 1));
        cJSON *rope = cJSON_GetObjectItem(cf, "rope_parameters");
        cJSON_DeleteItemFromObject(rope, "mrope_section");
        cJSON_DeleteItemFromObject(rope, "mrope_interleaved");
        cJSON_ReplaceItemInObject(cf, "tie_word_embeddings", cJSON_CreateFalse());
        cJSON_AddTrueToObject(cf, "norm_topk_prob");
        cJSON_AddNumberToObject(cf, "decoder_sparse_step", 1);
        cJSON_AddItemToObject(cf, "mlp_only_layers", cJSON_CreateArray());
    }
    if (multimodal) { /* Qwen3_5MoeForConditionalGeneration: the text model's config nested */
        cJSON *outer = cJSON_CreateObject();
        cJSON_AddItemToObject(outer, "architectures",
                              cJSON_CreateStringArray(
                                  (const char *[]){s->experts ? "Qwen3_5MoeForConditionalGeneration"
                                                              : "Qwen3_5ForConditionalGeneration"},
                                  1));
        cJSON_AddStringToObject(outer, "model_type", s->experts ? "qwen3_5_moe" : "qwen3_5");
        cJSON_AddItemToObject(outer, "text_config", cf);
        cJSON_AddNumberToObject(cJSON_AddObjectToObject(outer, "vision_config"), "depth", 1);
        cf = outer;
    }
    char *json = cJSON_Print(cf);
    write_text(folder, "config.json", json);
    free(json);
    cJSON_Delete(cf);
    static const char *const linked[][2] = {{"tiny-qwen35", "generation_config.json"},
                                            {"tiny-qwen35", "tokenizer_config.json"},
                                            {"tiny-qwen2", "vocab.json"},
                                            {"tiny-qwen2", "merges.txt"}};
    for (int i = 0; i < 4; i++) {
        snprintf(path, sizeof path, "%s/%s/%s", dir, linked[i][0], linked[i][1]);
        link_file(folder, linked[i][1], path);
    }
    return 0;
}

/* ---- the checks --------------------------------------------------------------------------- */

static int on_nothing(void *user, int32_t id, const char *text, size_t len)
{
    (void)user, (void)id, (void)text, (void)len;
    return 0;
}

/* general.architecture of a GGUF file, and whether it has tensor `name` */
static int gguf_is(const char *path, const char *arch, const char *name)
{
    loom_gguf g;
    const char *a = NULL;
    uint64_t len = 0;
    if (loom_gguf_open(&g, path, err, sizeof err) != 0)
        return 0;
    int ok = loom_gguf_get_str(&g, "general.architecture", &a, &len) == 0 && len == strlen(arch) &&
        !memcmp(a, arch, len) && loom_gguf_find_tensor(&g, name);
    loom_gguf_close(&g);
    return ok;
}

/* Qwen3-Next's older GGUFs (llama.cpp before it split the projection): attn_qkv and attn_gate
 * of `from` merged back into ssm_in, each key head's rows [q; k; v; z], as `to`. */
static int older_qwen3next(const char *from, const char *to, const shape *s)
{
    loom_gguf g;
    if (loom_gguf_open(&g, from, err, sizeof err) != 0)
        return -1;
    loom_gguf_writer *w = loom_gguf_writer_create();
    for (uint64_t i = 0; i < g.n_kv; i++)
        if (strcmp(g.kv[i].key, "general.alignment"))
            loom_gguf_copy_kv(w, &g, &g.kv[i]);
    const int64_t D = s->d, dk = s->dk, rv = (int64_t)s->hv / s->hk * s->dv;
    const int64_t group = 2 * dk + 2 * rv, rows = s->hk * group;
    float *fused[8] = {0};
    for (uint64_t i = 0; i < g.n_tensors; i++) {
        const loom_gguf_tensor *t = &g.tensors[i];
        int l;
        char rest[64];
        if (sscanf(t->name, "blk.%d.%63s", &l, rest) == 2 && !strcmp(rest, "attn_gate.weight"))
            continue;
        if (sscanf(t->name, "blk.%d.%63s", &l, rest) == 2 && !strcmp(rest, "attn_qkv.weight") &&
            l < 8) {
            char gate_name[64], name[64];
            snprintf(gate_name, sizeof gate_name, "blk.%d.attn_gate.weight", l);
            const float *qkv = loom_gguf_tensor_data(&g, t);
            const float *z = loom_gguf_tensor_data(&g, loom_gguf_find_tensor(&g, gate_name));
            float *out = fused[l] = malloc((size_t)(rows * D) * sizeof *out);
            for (int64_t kh = 0; kh < s->hk; kh++) {
                float *grp = out + kh * group * D;
                memcpy(grp, qkv + kh * dk * D, (size_t)(dk * D) * sizeof *out);
                memcpy(grp + dk * D, qkv + (s->hk + kh) * dk * D, (size_t)(dk * D) * sizeof *out);
                memcpy(grp + 2 * dk * D, qkv + (2 * s->hk * dk + kh * rv) * D,
                       (size_t)(rv * D) * sizeof *out);
                memcpy(grp + (2 * dk + rv) * D, z + kh * rv * D, (size_t)(rv * D) * sizeof *out);
            }
            snprintf(name, sizeof name, "blk.%d.ssm_in.weight", l);
            loom_gguf_add_tensor(w, name, LOOM_F32, 2, (int64_t[]){D, rows}, out);
            continue;
        }
        loom_gguf_add_tensor(w, t->name, t->type, t->n_dims, t->ne, loom_gguf_tensor_data(&g, t));
    }
    int rc = loom_gguf_write(w, to, err, sizeof err);
    loom_gguf_writer_free(w);
    loom_gguf_close(&g);
    for (int l = 0; l < 8; l++)
        free(fused[l]);
    return rc;
}

/* A qwen35 file whose layers' kinds come from attention.recurrent_layers (a flag per block, as
 * llama.cpp reads it before full_attention_interval), with an interval that would say
 * otherwise; and one whose flags are one short, which is refused. */
static int recurrent_flags_file(const char *from, const char *to, const shape *s, int short_by)
{
    loom_gguf g;
    if (loom_gguf_open(&g, from, err, sizeof err) != 0)
        return -1;
    loom_gguf_writer *w = loom_gguf_writer_create();
    for (uint64_t i = 0; i < g.n_kv; i++)
        if (strcmp(g.kv[i].key, "general.alignment") &&
            strcmp(g.kv[i].key, "qwen35.full_attention_interval"))
            loom_gguf_copy_kv(w, &g, &g.kv[i]);
    int32_t flags[16];
    for (int l = 0; l < s->layers; l++)
        flags[l] = (l + 1) % s->interval != 0;
    loom_gguf_set_u32(w, "qwen35.full_attention_interval", 2);
    loom_gguf_set_i32_array(w, "qwen35.attention.recurrent_layers", flags,
                            (uint64_t)(s->layers - short_by));
    for (uint64_t i = 0; i < g.n_tensors; i++)
        loom_gguf_add_tensor(w, g.tensors[i].name, g.tensors[i].type, g.tensors[i].n_dims,
                             g.tensors[i].ne, loom_gguf_tensor_data(&g, &g.tensors[i]));
    int rc = loom_gguf_write(w, to, err, sizeof err);
    loom_gguf_writer_free(w);
    loom_gguf_close(&g);
    return rc;
}

/* path (`form` says what it is) on backend: the last prompt logits within tol of want, and the
 * greedy tokens those of the reference, `greedy`, when given. */
static void check_path(const char *what, const char *form, const char *path, const char *backend,
                       const double *want, const shape *s, const int32_t *ids, int T,
                       const collect *greedy, double tol)
{
    loom_model_options o = {.backend = backend, .kv_type = "f32", .n_ctx = 256};
    loom_model *m = loom_model_open(path, &o, err, sizeof err);
    CHECK(m != NULL, "%s (%s) on %s: %s", what, form, backend, err);
    if (!m)
        return;
    loom_sampling g = loom_sampling_defaults();
    g.temperature = 0, g.ignore_eos = 1;
    int rc = loom_generate(m, ids, T, 1, &g, on_nothing, NULL, NULL, err, sizeof err);
    const float *got = rc == 0 ? loom_prompt_logits(m) : NULL;
    double d = got ? max_diff(want, got, s->vocab) : 1e9;
    CHECK(d <= tol, "%s (%s) on %s: logits off the reference by %g (> %g) %s", what, form, backend,
          d, tol, rc ? err : "");
    if (greedy) {
        collect t = {{0}, 0};
        rc = loom_generate(m, ids, T, greedy->n, &g, on_token, &t, NULL, err, sizeof err);
        CHECK(rc == 0 && t.n == greedy->n &&
                  !memcmp(t.ids, greedy->ids, (size_t)t.n * sizeof t.ids[0]),
              "%s (%s) on %s: greedy tokens not the reference's (%s)", what, form, backend,
              rc ? err : "other ids");
    }
    loom_model_close(m);
}

/* `what` (a folder, and that folder converted to f32 GGUF of architecture arch; for Qwen3-Next
 * also that file as older converters wrote it) on every usable backend: the last prompt logits
 * within tol of want, and on ref the greedy tokens, those of the reference. */
static void check_variant(const char *what, const char *folder, const char *arch,
                          const double *want, const shape *s, const int32_t *ids, int T,
                          const collect *greedy, double tol)
{
    char gguf[4400], older[4400];
    snprintf(gguf, sizeof gguf, "%s.gguf", folder);
    snprintf(older, sizeof older, "%s-ssm_in.gguf", folder);
    CHECK(loom_convert(folder, gguf, "f32", NULL, NULL, err, sizeof err) == 0, "%s convert: %s",
          what, err);
    CHECK(gguf_is(gguf, arch, "blk.0.ssm_a"), "%s: the converted file is not GGUF '%s'", what,
          arch);
    CHECK(!s->next || older_qwen3next(gguf, older, s) == 0, "%s: writing %s: %s", what, older, err);
    check_gguf_conventions(gguf, what);
    CHECK(verify_problems(gguf) == 0, "%s: loom verify finds a problem in loom's conversion", what);
    char flagged[4400], bad_flags[4400];
    snprintf(flagged, sizeof flagged, "%s-flags.gguf", folder);
    snprintf(bad_flags, sizeof bad_flags, "%s-short-flags.gguf", folder);
    const int dense35 = !strcmp(arch, "qwen35");
    if (dense35) {
        CHECK(recurrent_flags_file(gguf, flagged, s, 0) == 0 &&
                  recurrent_flags_file(gguf, bad_flags, s, 1) == 0,
              "%s: writing the files with attention.recurrent_layers: %s", what, err);
        loom_model_options o = {.backend = "ref"};
        loom_model *m = loom_model_open(bad_flags, &o, err, sizeof err);
        CHECK(!m && strstr(err, "attention.recurrent_layers must be an array of a flag per block"),
              "%s: flags one short: %s", what, m ? "opened" : err);
        loom_model_close(m);
    }
    static char backends[MAX_TEST_BACKENDS][160];
    int nb = usable_backends(backends, MAX_TEST_BACKENDS);
    for (int b = 0; b < nb; b++) {
        const collect *on_ref = strcmp(backends[b], "ref") == 0 ? greedy : NULL;
        check_path(what, "gguf", gguf, backends[b], want, s, ids, T, on_ref, tol);
        check_path(what, "folder", folder, backends[b], want, s, ids, T, on_ref, tol);
        if (s->next)
            check_path(what, "gguf with ssm_in", older, backends[b], want, s, ids, T, on_ref, tol);
        if (dense35)
            check_path(what, "gguf with attention.recurrent_layers", flagged, backends[b], want, s,
                       ids, T, NULL, tol);
    }
    unlink(gguf);
    unlink(older);
    unlink(flagged);
    unlink(bad_flags);
}

/* The reference's greedy continuation of ids (each step a whole pass: slow, but plain). */
static collect reference_greedy(const loom_safetensors *st, const char *P, const shape *s,
                                const int32_t *ids, int T, int n)
{
    collect out = {{0}, 0};
    int32_t seq[64];
    memcpy(seq, ids, (size_t)T * sizeof *seq);
    mistakes none = {0};
    double gap = INFINITY;
    for (int i = 0; i < n && T + i < 64; i++) {
        double *logits = reference(st, P, s, seq, T + i, &none, &gap);
        seq[T + i] = out.ids[out.n++] = argmax_d(logits, s->vocab);
        free(logits);
    }
    return out;
}

static void test_variant(const loom_safetensors *base, const shape *s, const char *name,
                         const char *P, int multimodal, const char *arch, const int32_t *ids, int T)
{
    char folder[4200], path[4300];
    snprintf(folder, sizeof folder, "%s/%s", tmp, name);
    CHECK(make_folder(base, s, P, folder, multimodal) == 0, "making %s", folder);
    loom_safetensors st;
    snprintf(path, sizeof path, "%s/model.safetensors", folder);
    if (loom_safetensors_open(&st, path, err, sizeof err) != 0) {
        CHECK(0, "%s: %s", name, err);
        return;
    }
    mistakes none = {0}, tiled = {.heads_tiled = 1}, plain = {.no_renormalise = 1};
    double gap = INFINITY, ignored = INFINITY;
    double *want = reference(&st, P, s, ids, T, &none, &gap);
    /* the checks can fail: each mistake moves the logits past the tolerance */
    double *off = reference(&st, P, s, ids, T, &tiled, &ignored);
    CHECK(max_diff_d(want, off, s->vocab) > 0.05,
          "%s: value heads read in the wrong order move the logits by only %g", name,
          max_diff_d(want, off, s->vocab));
    free(off);
    if (s->experts) {
        off = reference(&st, P, s, ids, T, &plain, &ignored);
        CHECK(max_diff_d(want, off, s->vocab) > 0.05,
              "%s: the experts' weights unrenormalised move the logits by only %g", name,
              max_diff_d(want, off, s->vocab));
        free(off);
        CHECK(gap > 1e-4, "%s: the routing has a near tie (%g): a coin toss for loom", name, gap);
    }
    collect greedy = reference_greedy(&st, P, s, ids, T, 6);
    check_variant(name, folder, arch, want, s, ids, T, &greedy, 1e-3);
    free(want);
    loom_safetensors_close(&st);
    remove_folder(folder);
}

/* ---- the model's own multi-token-prediction block as a drafter ----------------------------- */

typedef struct kept_states {
    float *rows; /* [positions][d] */
    int d, n;
} kept_states;

static void keep_states(void *user, int32_t pos0, const float *rows, int32_t n)
{
    kept_states *k = user;
    memcpy(k->rows + (size_t)pos0 * k->d, rows, (size_t)n * k->d * sizeof *rows);
    k->n = pos0 + n;
}

/* llama.cpp's tiny-qwen35 file (its MTP block is blk.4: nextn.eh_proj, enorm, hnorm,
 * shared_head_norm beside a full-attention layer) on backend: the model's final hidden states
 * and every pair's MTP logits against the reference's; the drafter is refused where it cannot
 * be; speculation with it gives greedy decoding's tokens. */
static void check_mtp(const char *what, const char *path, const char *backend, const shape *s,
                      const int32_t *ids, int T, const double *states, const double *want)
{
    loom_model_options o = {.backend = backend, .kv_type = "f32", .n_ctx = 256};
    loom_model *m = loom_model_open(path, &o, err, sizeof err);
    o.mtp = 1;
    loom_model *d = loom_model_open(path, &o, err, sizeof err);
    CHECK(m && d, "MTP (%s) on %s: %s", what, backend, err);
    if (!m || !d) {
        loom_model_close(m), loom_model_close(d);
        return;
    }
    struct loom_runner *tr = loom_model_runner(m), *dr = loom_model_runner(d);
    kept_states k = {malloc((size_t)T * s->d * sizeof(float)), s->d, 0};
    loom_runner_follow(tr, keep_states, &k);
    CHECK(loom_runner_eval(tr, ids, T, 0, err, sizeof err) == 0 && k.n == T,
          "MTP (%s) on %s: the model's states: %s", what, backend, err);
    loom_runner_follow(tr, NULL, NULL);
    double worst = 0;
    for (int i = 0; i < T * s->d; i++)
        worst = fmax(worst, fabs(states[i] - k.rows[i]));
    CHECK(worst < 1e-3, "MTP (%s) on %s: the final hidden states off the reference by %g", what,
          backend, worst);
    /* pair by pair, each attending to the ones before in the block's own cache */
    worst = 0;
    for (int t = 0; t + 1 < T; t++) {
        if (loom_runner_eval_mtp(dr, ids + t + 1, k.rows + (size_t)t * s->d, 1, t, err,
                                 sizeof err) != 0) {
            CHECK(0, "MTP (%s) on %s: pair %d: %s", what, backend, t, err);
            break;
        }
        worst = fmax(worst,
                     max_diff(want + (size_t)t * s->vocab, loom_runner_logits(dr), s->vocab));
    }
    CHECK(worst < 2e-3, "MTP (%s) on %s: the block's logits off the reference by %g", what, backend,
          worst);
    printf("MTP (%s) on %s: %d pairs' logits within %.2g of the reference\n", what, backend, T - 1,
           worst);
    /* the check can fail: without the model's states (zeros instead) they move far */
    float *zeros = calloc((size_t)s->d, sizeof *zeros);
    CHECK(loom_runner_eval_mtp(dr, ids + 1, zeros, 1, 0, err, sizeof err) == 0 &&
              max_diff(want, loom_runner_logits(dr), s->vocab) > 0.05,
          "MTP (%s) on %s: the block's logits do not depend on the model's state", what, backend);
    /* a runner that is not the MTP block takes no states, and the block needs them */
    CHECK(loom_runner_eval_mtp(tr, ids, zeros, 1, 0, err, sizeof err) != 0 &&
              strstr(err, "not a multi-token-prediction drafter"),
          "MTP (%s) on %s: states given to the model itself: %s", what, backend, err);
    CHECK(loom_runner_eval(dr, ids, 1, 0, err, sizeof err) != 0 &&
              strstr(err, "needs the model's hidden states"),
          "MTP (%s) on %s: the block without states: %s", what, backend, err);
    free(zeros), free(k.rows);
    /* speculation: every proposal checked (p_min 0, fixed length), greedy's tokens */
    loom_sampling g = loom_sampling_defaults();
    g.temperature = 0, g.ignore_eos = 1;
    collect plain = {{0}, 0}, drafted = {{0}, 0};
    loom_speculation spec = {.draft = d, .draft_max = 3, .fixed = 1};
    loom_generation st = {0};
    CHECK(loom_generate(m, ids, T, 20, &g, on_token, &plain, NULL, err, sizeof err) == 0 &&
              loom_generate_speculative(m, &spec, ids, T, 0, 20, &g, on_token, &drafted, &st, err,
                                        sizeof err) == 0,
          "MTP (%s) on %s: generating: %s", what, backend, err);
    CHECK(plain.n == 20 && drafted.n == 20 && !memcmp(plain.ids, drafted.ids, sizeof plain.ids),
          "MTP (%s) on %s: speculation with the block changed greedy's tokens", what, backend);
    CHECK(st.n_drafted >= 20 && st.n_verify >= 6,
          "MTP (%s) on %s: the block proposed %d tokens in %d checks", what, backend, st.n_drafted,
          st.n_verify);
    loom_model_close(d);
    /* a file without the block: a clear refusal */
    loom_model_close(m);
}

static void test_mtp(const loom_safetensors *base, const shape *s, const int32_t *ids, int T)
{
    char path[4400], converted[4400], folder[4200];
    snprintf(path, sizeof path, "%s/tiny-qwen35/model.gguf", dir);
    snprintf(folder, sizeof folder, "%s/tiny-qwen35", tmp);
    snprintf(converted, sizeof converted, "%s/tiny-qwen35-mtp.gguf", tmp);
    static const char *const files[] = {"config.json",       "generation_config.json",
                                        "model.safetensors", "tokenizer_config.json",
                                        "merges.txt",        "vocab.json"};
    static const char *const shared[] = {"tiny-qwen2/merges.txt", "tiny-qwen2/vocab.json"};
    /* (test_hybrid holds the conversion's tensors to llama.cpp's, the block's among them) */
    CHECK(fixture_folder(dir, folder, "tiny-qwen35", files, 6, shared, 2) == 0 &&
              loom_convert(folder, converted, "f32", NULL, NULL, err, sizeof err) == 0,
          "converting tiny-qwen35: %s", err);
    remove_folder(folder);
    double *states = malloc((size_t)T * s->d * sizeof *states);
    mistakes none = {0};
    double gap = INFINITY;
    free(forward(base, "model.", s, ids, NULL, T, &none, &gap, states));
    double *want = mtp_reference(base, s, ids, T, states);
    static char backends[MAX_TEST_BACKENDS][160];
    int nb = usable_backends(backends, MAX_TEST_BACKENDS);
    for (int b = 0; b < nb; b++) {
        check_mtp("llama.cpp's file", path, backends[b], s, ids, T, states, want);
        check_mtp("loom's conversion", converted, backends[b], s, ids, T, states, want);
    }
    unlink(converted);
    free(states), free(want);
}

int main(void)
{
    snprintf(dir, sizeof dir, "%s", fixtures_dir());
    static const char *const needed[] = {
        "tiny-qwen35/model.safetensors", "tiny-qwen35/config.json", "tiny-qwen35/expected.json",
        "tiny-qwen35/logits_plain.f32",  "tiny-qwen2/vocab.json",   "tiny-qwen2/merges.txt",
        "tiny-qwen35/model.gguf"};
    need_fixtures(dir, needed, sizeof needed / sizeof needed[0]);
    unsetenv("LOOM_BACKEND");
    if (!mkdtemp(tmp))
        return 1;
    char path[4400];
    snprintf(path, sizeof path, "%s/tiny-qwen35/expected.json", dir);
    char *json = slurp(path, NULL);
    cJSON *root = cJSON_Parse(json), *id;
    int32_t ids[64];
    int T = 0;
    cJSON_ArrayForEach (
        id,
        cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(root, "cases"), 0),
                            "prompt_ids"))
        if (T < 40)
            ids[T++] = id->valueint;
    cJSON_Delete(root);
    free(json);

    loom_safetensors base;
    snprintf(path, sizeof path, "%s/tiny-qwen35/model.safetensors", dir);
    if (loom_safetensors_open(&base, path, err, sizeof err) != 0) {
        CHECK(0, "%s", err);
        return check_finish("test_hybrid_variants");
    }
    /* the reference pass against PyTorch's own logits of tiny-qwen35 */
    shape s = base_shape();
    mistakes none = {0};
    double gap = INFINITY;
    double *mine = reference(&base, "model.", &s, ids, T, &none, &gap);
    snprintf(path, sizeof path, "%s/tiny-qwen35/logits_plain.f32", dir);
    size_t bytes = 0;
    float *torch = (float *)slurp(path, &bytes);
    CHECK(torch && bytes == (size_t)s.vocab * 4, "%s", path);
    double d = torch ? max_diff(mine, torch, s.vocab) : 1e9;
    CHECK(d < 1e-4, "the test's reference pass disagrees with PyTorch on tiny-qwen35 by %g", d);
    free(torch), free(mine);
    /* the conventions the variants' files are held to, first on llama.cpp's own file */
    snprintf(path, sizeof path, "%s/tiny-qwen35/model.gguf", dir);
    check_gguf_conventions(path, "llama.cpp's tiny-qwen35 model.gguf");
    test_mtp(&base, &s, ids, T);

    shape wide = s;
    wide.hv = 4; /* two value heads per key head */
    test_variant(&base, &wide, "qwen35-wide", "model.", 0, "qwen35", ids, T);
    shape moe = wide;
    moe.experts = 8, moe.k = 2, moe.moe_ff = 16, moe.shared_ff = 48;
    test_variant(&base, &moe, "qwen35moe", "model.", 0, "qwen35moe", ids, T);
    moe.stacked = 1;
    test_variant(&base, &moe, "qwen35moe-vl-stacked", "model.language_model.", 1, "qwen35moe", ids,
                 T);
    shape next = moe;
    next.stacked = 0, next.next = 1;
    test_variant(&base, &next, "qwen3next", "model.", 0, "qwen3next", ids, T);
    loom_safetensors_close(&base);
    rmdir(tmp);
    return check_finish("test_hybrid_variants");
}
