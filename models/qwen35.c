/*
 * models/qwen35.c - Qwen3.5 and Qwen3.6 (GGUF "qwen35", and "qwen35moe" for their mixture-of-
 * experts members) and their forerunner Qwen3-Next (GGUF "qwen3next"): a hybrid of linear-
 * attention layers (Gated DeltaNet) and gated full attention, three of the first to one of the
 * second.
 *
 * Every layer is pre-norm: x += mixer(rms_norm(x)); x += ffn(rms_norm(x)), the ffn a SwiGLU MLP
 * or (qwen35moe) the top k of a softmax over the experts, their weights renormalised, beside a
 * shared expert gated by sigmoid(ffn_gate_inp_shexp h) (models/blocks.c's loom_ffn_moe). The
 * mixer is
 *   - in a recurrent layer (every one but each full_attention_interval-th): the projections
 *     qkv (q and k: group_count heads of state_size; v: time_step_rank heads of
 *     inner_size / time_step_rank), z (the output gate), alpha (the decay's input) and beta
 *     (the write strength); a causal depthwise conv1d + SiLU over qkv, whose window is part
 *     of the sequence's state; the gated delta rule over the other part (backend.h's
 *     gated_delta: the l2 norms, the decay and the sigmoid are inside it); per head
 *     rms_norm(o) * ssm_norm * silu(z); the output projection;
 *   - in an attention layer: Q projected twice as wide, per head [query; gate]; per-head
 *     RMSNorm of Q and K; RoPE on the first rope.dimension_count dims (rotate half) of each
 *     head; attention; the result times sigmoid(gate); the output projection.
 * The model's multimodal RoPE (rope.dimension_sections) gives each section of a head's pairs
 * the position of one axis; for text every axis has the token's position, so it is plain RoPE.
 * llama.cpp's converter stores the (1 + w) RMSNorm weights of Hugging Face's checkpoint with
 * the 1 added (every norm but ssm_norm), and A_log as ssm_a = -exp(A_log); with more value heads
 * than key heads it stores the value heads tiled (value head h reads key head h % group_count),
 * not grouped by key head as Hugging Face does, and so does `loom convert`. The file's last
 * nextn_predict_layers blocks are the multi-token-prediction head, which a plain run skips and
 * an MTP runner (loom_rt_mtp) runs alone: eh_proj over [enorm(embedding); hnorm(the main
 * model's final hidden state)], a full-attention layer with its own KV cache, shared_head_norm,
 * the model's head (vLLM's Qwen3NextMultiTokenPredictor: Hugging Face's code has none).
 *
 * Qwen3-Next differs only in its linear layers' projections, which its checkpoint fuses per key
 * head: in_proj_qkvz ([q, k, v, z] of each key head's group) and in_proj_ba ([beta, alpha] of
 * each). llama.cpp's files split the first into attn_qkv and attn_gate (older ones keep it whole
 * as ssm_in) and keep the second whole as ssm_ba; the value heads stay grouped by key head. The
 * forward pass gathers the groups' parts with strided copies (scale by 1). Its RoPE is plain
 * NEOX over rope.dimension_count dims (no sections), every layer's MLP experts.
 */
#include "blocks.h"
#include "models.h"

#include <assert.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct q35_layer {
    const loom_tensor *attn_norm, *ffn_norm;
    /* recurrent layers */
    const loom_tensor *wqkv;     /* [2 k_heads d_k + v_heads d_v, n_embd] */
    const loom_tensor *wz;       /* attn_gate: [v_heads d_v, n_embd] */
    const loom_tensor *walpha;   /* ssm_alpha: [v_heads, n_embd] */
    const loom_tensor *wbeta;    /* ssm_beta: [v_heads, n_embd] */
    const loom_tensor *wqkvz;    /* Qwen3-Next's older files, ssm_in: [k_heads (2 d_k + 2 r d_v),
                                  * n_embd], each key head's [q; k; v; z] (r = v_heads / k_heads) */
    const loom_tensor *wba;      /* Qwen3-Next, ssm_ba: [2 v_heads, n_embd], per key head [b; a] */
    const loom_tensor *conv;     /* ssm_conv1d: [channels, kernel] */
    const loom_tensor *a;        /* ssm_a: [v_heads], -exp(A_log) */
    const loom_tensor *dt_bias;  /* ssm_dt.bias: [v_heads] */
    const loom_tensor *ssm_norm; /* [d_v] */
    const loom_tensor *ssm_out;  /* [n_embd, v_heads d_v] */
    /* attention layers */
    const loom_tensor *wq; /* [n_head 2 head_dim, n_embd]: per head [query; gate] */
    const loom_tensor *wk, *wv, *wo, *q_norm, *k_norm;
    /* every layer: a SwiGLU MLP, or (qwen35moe) experts */
    const loom_tensor *gate, *up, *down;
    loom_moe_weights moe;
} q35_layer;

typedef struct q35_model {
    const loom_tensor *tok_embd, *out_norm, *output;
    /* the multi-token-prediction block's own (an MTP runner's): nextn.eh_proj [2 n_embd,
     * n_embd] over [enorm(embedding); hnorm(hidden)], and its final norm */
    const loom_tensor *eh_proj, *enorm, *hnorm, *head_norm;
    int32_t k_heads; /* the linear layers' q and k heads */
    int next;        /* Qwen3-Next: fused projections, value heads grouped by key head */
    q35_layer *layers;
} q35_model;

static void q35_free(void *state)
{
    q35_model *m = state;
    if (m)
        free(m->layers);
    free(m);
}

/* The hyper-parameters, checked against each other (names as in the file). */
static int read_hparams(const loom_gguf *g, const char *arch, loom_hparams *hp, q35_model *m,
                        char *err, size_t err_size)
{
    snprintf(hp->arch, sizeof hp->arch, "%s", arch);
    m->next = strcmp(arch, "qwen3next") == 0;
    const int moe = strcmp(arch, "qwen35moe") == 0 || m->next;
    hp->n_embd = (int32_t)loom_model_kv_int(g, arch, "embedding_length", 0);
    int64_t blocks = loom_model_kv_int(g, arch, "block_count", 0);
    int64_t nextn = loom_model_kv_int(g, arch, "nextn_predict_layers", 0);
    hp->n_layer = (int32_t)(blocks - nextn);
    hp->n_nextn = (int32_t)nextn;
    hp->n_head = (int32_t)loom_model_kv_int(g, arch, "attention.head_count", 0);
    hp->n_head_kv = (int32_t)loom_model_kv_int(g, arch, "attention.head_count_kv", hp->n_head);
    hp->head_dim = (int32_t)loom_model_kv_int(g, arch, "attention.key_length", 0);
    int64_t value_length = loom_model_kv_int(g, arch, "attention.value_length", hp->head_dim);
    hp->n_ff = (int32_t)loom_model_kv_int(g, arch, "feed_forward_length", 0);
    hp->n_ctx_train = (int32_t)loom_model_kv_int(g, arch, "context_length", 2048);
    hp->norm_eps = (float)loom_model_kv_float(g, arch, "attention.layer_norm_rms_epsilon", 1e-6);
    hp->rope_base = (float)loom_model_kv_float(g, arch, "rope.freq_base", 10000000.0);
    hp->rope_scale = 1.0f;
    hp->rope_mode = LOOM_ROPE_NEOX;
    hp->n_rot = (int32_t)loom_model_kv_int(g, arch, "rope.dimension_count", hp->head_dim);
    hp->ssm_conv_kernel = (int32_t)loom_model_kv_int(g, arch, "ssm.conv_kernel", 0);
    hp->ssm_d_k = (int32_t)loom_model_kv_int(g, arch, "ssm.state_size", 0);
    m->k_heads = (int32_t)loom_model_kv_int(g, arch, "ssm.group_count", 0);
    hp->ssm_v_heads = (int32_t)loom_model_kv_int(g, arch, "ssm.time_step_rank", 0);
    int64_t inner = loom_model_kv_int(g, arch, "ssm.inner_size", 0);
    int64_t interval = loom_model_kv_int(g, arch, "full_attention_interval", 4);
    if (hp->n_embd <= 0 || blocks <= 0 || nextn < 0 || hp->n_layer <= 0 ||
        hp->n_layer > LOOM_MAX_LAYERS || hp->n_head <= 0 || hp->n_head_kv <= 0 ||
        hp->n_head % hp->n_head_kv || hp->head_dim <= 0 || value_length != hp->head_dim ||
        (hp->n_ff <= 0 && !moe)) {
        snprintf(err, err_size,
                 "%s: embedding_length %d, block_count %lld (nextn_predict_layers %lld), "
                 "head_count %d, head_count_kv %d, key_length %d, value_length %lld, "
                 "feed_forward_length %d: each must be above 0, the layers at most %d, the "
                 "heads a multiple of the KV heads and value_length equal to key_length",
                 arch, hp->n_embd, (long long)blocks, (long long)nextn, hp->n_head, hp->n_head_kv,
                 hp->head_dim, (long long)value_length, hp->n_ff, LOOM_MAX_LAYERS);
        return -1;
    }
    if (m->k_heads <= 0 || hp->ssm_v_heads <= 0 || hp->ssm_v_heads % m->k_heads ||
        hp->ssm_d_k <= 0 || inner <= 0 || inner % hp->ssm_v_heads || interval < 1 ||
        interval > hp->n_layer) {
        snprintf(err, err_size,
                 "%s: ssm.group_count %d, ssm.time_step_rank %d, ssm.state_size %d, "
                 "ssm.inner_size %lld, full_attention_interval %lld: the value heads "
                 "(time_step_rank) must be a multiple of the key heads (group_count), the inner "
                 "size a multiple of the value heads, and the interval 1 to the layer count",
                 arch, m->k_heads, hp->ssm_v_heads, hp->ssm_d_k, (long long)inner,
                 (long long)interval);
        return -1;
    }
    if (moe && loom_moe_read_hparams(g, arch, 1, 1, hp, err, err_size) != 0)
        return -1;
    hp->ssm_d_v = (int32_t)(inner / hp->ssm_v_heads);
    hp->ssm_conv_channels = 2 * m->k_heads * hp->ssm_d_k + (int32_t)inner;
    /* text positions are the same on every axis of the multimodal RoPE, whatever the sections;
     * they must still cover the rotated pairs, or the file means something else */
    char key[96];
    snprintf(key, sizeof key, "%s.rope.dimension_sections", arch);
    const loom_gguf_kv *sections = loom_gguf_find(g, key);
    if (sections) {
        double sum = 0, v;
        for (uint64_t i = 0; i < sections->count && i < 8; i++)
            if (loom_gguf_array_f64(g, sections, i, &v) == 0 && v >= 0 && v <= 65536)
                sum += v;
        if (sum * 2 != hp->n_rot) {
            snprintf(err, err_size,
                     "%s: rope.dimension_sections cover %lld pairs, but rope.dimension_count "
                     "rotates %d dims: not a layout loom knows",
                     arch, (long long)sum, hp->n_rot);
            return -1;
        }
    }
    /* llama.cpp reads the layers' kinds from attention.recurrent_layers (a flag per block) when
     * a file has it, else from the interval */
    snprintf(key, sizeof key, "%s.attention.recurrent_layers", arch);
    const loom_gguf_kv *flags = loom_gguf_find(g, key);
    if (flags && (flags->type != LOOM_GGUF_ARRAY || flags->count != (uint64_t)blocks)) {
        snprintf(err, err_size,
                 "%s: attention.recurrent_layers must be an array of a flag per block (%lld)", arch,
                 (long long)blocks);
        return -1;
    }
    for (int l = 0; l < hp->n_layer; l++) {
        double flag = (l + 1) % interval != 0;
        if (flags &&
            (loom_gguf_array_f64(g, flags, (uint64_t)l, &flag) != 0 || (flag != 0 && flag != 1))) {
            snprintf(err, err_size, "%s: attention.recurrent_layers[%d] is not 0 or 1", arch, l);
            return -1;
        }
        if (flag == 1)
            loom_layer_set_recurrent(hp, l);
    }
    return 0;
}

static int load(loom_runner *r, loom_hparams *hp, void **state, const char *arch, char *err,
                size_t err_size)
{
    const loom_gguf *g = loom_rt_gguf(r);
    q35_model *m = calloc(1, sizeof *m);
    if (!m || read_hparams(g, arch, hp, m, err, err_size) != 0 ||
        !(m->layers = calloc((size_t)(hp->n_layer + hp->n_nextn), sizeof *m->layers))) {
        if (m && !err[0])
            snprintf(err, err_size, "out of memory");
        q35_free(m);
        return -1;
    }
    m->tok_embd = loom_rt_weight(r, "token_embd.weight", 1);
    m->out_norm = loom_rt_weight(r, "output_norm.weight", 1);
    m->output = loom_rt_weight(r, "output.weight", 0);
    if (!m->output)
        m->output = m->tok_embd; /* tied */
    char name[96];
#define W(field, fmt, required)                                                                    \
    (snprintf(name, sizeof name, fmt, l), L->field = loom_rt_weight(r, name, required))
    /* an MTP runner reads the first MTP block as well: a full-attention layer and its own */
    const int mtp = loom_rt_mtp(r) && hp->n_nextn > 0;
    for (int l = 0; l < hp->n_layer + mtp; l++) {
        q35_layer *L = &m->layers[l];
        W(attn_norm, "blk.%d.attn_norm.weight", 1);
        W(ffn_norm, "blk.%d.post_attention_norm.weight", 1);
        if (hp->n_expert) {
            loom_moe_load(r, l, L->ffn_norm, 1, &L->moe);
        } else {
            W(gate, "blk.%d.ffn_gate.weight", 1);
            W(up, "blk.%d.ffn_up.weight", 1);
            W(down, "blk.%d.ffn_down.weight", 1);
        }
        if (l == hp->n_layer) { /* the MTP block's own */
            static const char *const own[4] = {"eh_proj", "enorm", "hnorm", "shared_head_norm"};
            const loom_tensor **to[4] = {&m->eh_proj, &m->enorm, &m->hnorm, &m->head_norm};
            for (int i = 0; i < 4; i++) {
                snprintf(name, sizeof name, "blk.%d.nextn.%s.weight", l, own[i]);
                *to[i] = loom_rt_weight(r, name, 1);
            }
        }
        if (loom_layer_recurrent(hp, l)) {
            if (m->next)
                W(wqkvz, "blk.%d.ssm_in.weight", 0);
            if (!L->wqkvz) {
                W(wqkv, "blk.%d.attn_qkv.weight", 1);
                W(wz, "blk.%d.attn_gate.weight", 1);
            }
            if (m->next) {
                W(wba, "blk.%d.ssm_ba.weight", 1);
            } else {
                W(walpha, "blk.%d.ssm_alpha.weight", 1);
                W(wbeta, "blk.%d.ssm_beta.weight", 1);
            }
            W(conv, "blk.%d.ssm_conv1d.weight", 1);
            W(a, "blk.%d.ssm_a", 1);
            W(dt_bias, "blk.%d.ssm_dt.bias", 1);
            W(ssm_norm, "blk.%d.ssm_norm.weight", 1);
            W(ssm_out, "blk.%d.ssm_out.weight", 1);
        } else {
            W(wq, "blk.%d.attn_q.weight", 1);
            W(wk, "blk.%d.attn_k.weight", 1);
            W(wv, "blk.%d.attn_v.weight", 1);
            W(wo, "blk.%d.attn_output.weight", 1);
            W(q_norm, "blk.%d.attn_q_norm.weight", 1);
            W(k_norm, "blk.%d.attn_k_norm.weight", 1);
        }
    }
#undef W
    if (loom_rt_status(r)) {
        q35_free(m);
        return -1;
    }
    hp->n_vocab = (int32_t)m->output->ne[1];
    const int64_t d = hp->n_embd, hd = hp->head_dim, hv = hp->ssm_v_heads;
    const int64_t inner = hv * hp->ssm_d_v, C = hp->ssm_conv_channels;
    int ok = m->tok_embd->ne[0] == d && m->output->ne[0] == d && m->out_norm->ne[0] == d;
    if (mtp &&
        !(m->eh_proj->ne[0] == 2 * d && m->eh_proj->ne[1] == d && m->enorm->ne[0] == d &&
          m->hnorm->ne[0] == d && m->head_norm->ne[0] == d)) {
        snprintf(err, err_size,
                 "qwen35: the multi-token-prediction block's nextn tensors (block %d) disagree "
                 "with embedding_length %lld",
                 hp->n_layer, (long long)d);
        ok = 0;
    }
    for (int l = 0; ok && l < hp->n_layer + mtp; l++) {
        const q35_layer *L = &m->layers[l];
        ok = L->attn_norm->ne[0] == d && L->ffn_norm->ne[0] == d &&
            (hp->n_expert ? loom_moe_shapes_ok(hp, l, &L->moe, err, err_size)
                          : L->gate->ne[0] == d && L->gate->ne[1] == hp->n_ff &&
                     L->up->ne[1] == hp->n_ff && L->down->ne[0] == hp->n_ff);
        const int recurrent = loom_layer_recurrent(hp, l);
        if (ok && recurrent)
            ok = (L->wqkvz ? L->wqkvz->ne[0] == d && L->wqkvz->ne[1] == C + inner
                           : L->wqkv->ne[0] == d && L->wqkv->ne[1] == C && L->wz->ne[1] == inner) &&
                (L->wba ? L->wba->ne[0] == d && L->wba->ne[1] == 2 * hv
                        : L->walpha->ne[1] == hv && L->wbeta->ne[1] == hv) &&
                L->conv->ne[0] == hp->ssm_conv_kernel && L->conv->ne[1] == C && L->a->ne[0] == hv &&
                L->a->dtype == LOOM_F32 && L->dt_bias->ne[0] == hv &&
                L->dt_bias->dtype == LOOM_F32 && L->ssm_norm->ne[0] == hp->ssm_d_v &&
                L->ssm_out->ne[0] == inner && L->ssm_out->ne[1] == d;
        else if (ok)
            ok = L->wq->ne[0] == d && L->wq->ne[1] == 2 * hp->n_head * hd &&
                L->wk->ne[1] == hp->n_head_kv * hd && L->wv->ne[1] == hp->n_head_kv * hd &&
                L->wo->ne[0] == hp->n_head * hd && L->q_norm->ne[0] == hd && L->k_norm->ne[0] == hd;
        if (!ok && !err[0])
            snprintf(err, err_size,
                     "qwen35: the tensors of block %d (a %s layer) disagree with the "
                     "hyper-parameters ('loom inspect FILE' lists them)",
                     l, recurrent ? "linear-attention" : "full-attention");
    }
    if (!ok) {
        if (!err[0])
            snprintf(err, err_size,
                     "qwen35: the embeddings or the output disagree with "
                     "embedding_length");
        q35_free(m);
        return -1;
    }
    *state = m;
    return 0;
}

/* The step's scratch for n tokens. */
typedef struct q35_buffers {
    loom_tensor h, ff_gate, ff_up;
    /* recurrent */
    loom_tensor qkv, conv, z, z3, alpha, beta, q3, k3, v3, o, o3;
    loom_tensor qkvz, ba; /* Qwen3-Next's fused projections' outputs */
    /* attention */
    loom_tensor qg, q3a, gate3, qn3, k, k3a, v, v3a, att, att3;
} q35_buffers;

static q35_buffers buffers(loom_runner *r, const loom_hparams *hp, const q35_model *m, int64_t n)
{
    const int64_t hd = hp->head_dim, dk = hp->ssm_d_k, dv = hp->ssm_d_v, hv = hp->ssm_v_heads;
    const int64_t hk = m->k_heads, C = hp->ssm_conv_channels, inner = hv * dv;
    q35_buffers b = {0};
    b.h = loom_rt_scratch(r, LOOM_F32, hp->n_embd, n, 1);
    if (!hp->n_expert) {
        b.ff_gate = loom_rt_scratch(r, LOOM_F32, hp->n_ff, n, 1);
        b.ff_up = loom_rt_scratch(r, LOOM_F32, hp->n_ff, n, 1);
    }
    b.qkv = loom_rt_scratch(r, LOOM_F32, C, n, 1);
    b.conv = loom_rt_scratch(r, LOOM_F32, C, n, 1);
    b.q3 = loom_rt_heads(&b.conv, 0, dk, hk);
    b.k3 = loom_rt_heads(&b.conv, hk * dk, dk, hk);
    b.v3 = loom_rt_heads(&b.conv, 2 * hk * dk, dv, hv);
    b.z = loom_rt_scratch(r, LOOM_F32, inner, n, 1);
    b.z3 = loom_rt_reshape(&b.z, dv, hv, n);
    b.alpha = loom_rt_scratch(r, LOOM_F32, hv, n, 1);
    b.beta = loom_rt_scratch(r, LOOM_F32, hv, n, 1);
    if (m->next) {
        b.qkvz = loom_rt_scratch(r, LOOM_F32, C + inner, n, 1);
        b.ba = loom_rt_scratch(r, LOOM_F32, 2 * hv, n, 1);
    }
    b.o = loom_rt_scratch(r, LOOM_F32, inner, n, 1);
    b.o3 = loom_rt_reshape(&b.o, dv, hv, n);
    /* Q and its gate interleaved per head: views of every other head_dim columns */
    b.qg = loom_rt_scratch(r, LOOM_F32, 2 * hp->n_head * hd, n, 1);
    b.q3a = loom_rt_heads(&b.qg, 0, 2 * hd, hp->n_head);
    b.q3a.ne[0] = hd;
    b.gate3 = b.q3a;
    b.gate3.offset += (uint64_t)hd * 4;
    b.att = loom_rt_scratch(r, LOOM_F32, hp->n_head * hd, n, 1);
    b.att3 = loom_rt_reshape(&b.att, hd, hp->n_head, n);
    b.qn3 = loom_rt_scratch(r, LOOM_F32, hd, hp->n_head, n);
    b.k = loom_rt_scratch(r, LOOM_F32, hp->n_head_kv * hd, n, 1);
    b.k3a = loom_rt_reshape(&b.k, hd, hp->n_head_kv, n);
    b.v = loom_rt_scratch(r, LOOM_F32, hp->n_head_kv * hd, n, 1);
    b.v3a = loom_rt_reshape(&b.v, hd, hp->n_head_kv, n);
    return b;
}

/* Columns [c0, c0 + width) of each of t's `groups` groups of group_width: [width, groups, n] */
static loom_tensor group_part(const loom_tensor *t, int64_t groups, int64_t group_width, int64_t c0,
                              int64_t width)
{
    assert(c0 >= 0 && width >= 0 && c0 + width <= group_width);
    loom_tensor v = loom_rt_heads(t, 0, group_width, groups);
    v.offset += (uint64_t)c0 * t->nb[0];
    v.ne[0] = width;
    return v;
}

/* Qwen3-Next's fused outputs into the layout of Qwen3.5's: qkvz's groups [q; k; v; z] (one per
 * key head) into qkv [Q; K; V] and z, ba's [b; a] into beta and alpha. */
static void ungroup(loom_runner *r, const loom_hparams *hp, int64_t hk, const q35_buffers *b,
                    int qkvz)
{
    const int64_t dk = hp->ssm_d_k, rv = hp->ssm_v_heads / hk * hp->ssm_d_v;
    const int64_t per = hp->ssm_v_heads / hk, n = b->qkv.ne[1];
    if (qkvz) {
        const int64_t g = 2 * dk + 2 * rv;
        const loom_tensor parts[4][2] = {
            {group_part(&b->qkvz, hk, g, 0, dk), loom_rt_heads(&b->qkv, 0, dk, hk)},
            {group_part(&b->qkvz, hk, g, dk, dk), loom_rt_heads(&b->qkv, hk * dk, dk, hk)},
            {group_part(&b->qkvz, hk, g, 2 * dk, rv), loom_rt_heads(&b->qkv, 2 * hk * dk, rv, hk)},
            {group_part(&b->qkvz, hk, g, 2 * dk + rv, rv), loom_rt_reshape(&b->z, rv, hk, n)}};
        for (int i = 0; i < 4; i++)
            loom_rt_scale(r, &parts[i][0], 1.0f, &parts[i][1]);
    }
    const loom_tensor beta = group_part(&b->ba, hk, 2 * per, 0, per);
    const loom_tensor alpha = group_part(&b->ba, hk, 2 * per, per, per);
    const loom_tensor beta_to = loom_rt_reshape(&b->beta, per, hk, n);
    const loom_tensor alpha_to = loom_rt_reshape(&b->alpha, per, hk, n);
    loom_rt_scale(r, &beta, 1.0f, &beta_to);
    loom_rt_scale(r, &alpha, 1.0f, &alpha_to);
}

static void linear_attention(loom_runner *r, const loom_hparams *hp, const q35_model *m, int l,
                             const q35_layer *L, const loom_tensor *x, const q35_buffers *b)
{
    loom_rt_rms_norm(r, x, L->attn_norm, hp->norm_eps, &b->h);
    if (L->wqkvz) {
        loom_rt_matmul(r, &b->h, L->wqkvz, NULL, &b->qkvz);
    } else {
        loom_rt_matmul(r, &b->h, L->wqkv, NULL, &b->qkv);
        loom_rt_matmul(r, &b->h, L->wz, NULL, &b->z);
    }
    if (L->wba) {
        loom_rt_matmul(r, &b->h, L->wba, NULL, &b->ba);
        ungroup(r, hp, m->k_heads, b, L->wqkvz != NULL);
    } else {
        loom_rt_matmul(r, &b->h, L->walpha, NULL, &b->alpha);
        loom_rt_matmul(r, &b->h, L->wbeta, NULL, &b->beta);
    }
    loom_rt_ssm_conv(r, l, &b->qkv, L->conv, &b->conv);
    loom_rt_gated_delta(r, l, &b->q3, &b->k3, &b->v3, &b->alpha, &b->beta, L->a, L->dt_bias,
                        !m->next, &b->o3);
    loom_rt_rms_norm(r, &b->o3, L->ssm_norm, hp->norm_eps, &b->o3);
    loom_rt_silu_mul(r, &b->z3, &b->o3, &b->o3);
    loom_rt_matmul(r, &b->o, L->ssm_out, NULL, &b->h);
    loom_rt_add(r, x, &b->h, x);
}

static void gated_attention(loom_runner *r, const loom_hparams *hp, int l, const q35_layer *L,
                            const loom_tensor *x, const q35_buffers *b)
{
    loom_rt_rms_norm(r, x, L->attn_norm, hp->norm_eps, &b->h);
    loom_rt_matmul(r, &b->h, L->wq, NULL, &b->qg);
    loom_rt_matmul(r, &b->h, L->wk, NULL, &b->k);
    loom_rt_matmul(r, &b->h, L->wv, NULL, &b->v);
    loom_rt_rms_norm(r, &b->q3a, L->q_norm, hp->norm_eps, &b->qn3);
    loom_rt_rms_norm(r, &b->k3a, L->k_norm, hp->norm_eps, &b->k3a);
    loom_rt_rope(r, &b->qn3, hp, NULL);
    loom_rt_rope(r, &b->k3a, hp, NULL);
    loom_rt_kv_store(r, &b->k3a, loom_rt_kcache(r, l));
    loom_rt_kv_store(r, &b->v3a, loom_rt_vcache(r, l));
    loom_rt_attention(r, &b->qn3, l, 1.0f / sqrtf((float)hp->head_dim), &b->att3);
    loom_rt_sigmoid_mul(r, &b->gate3, &b->att3, &b->att3);
    loom_rt_matmul(r, &b->att, L->wo, NULL, &b->h);
    loom_rt_add(r, x, &b->h, x);
}

/* The multi-token-prediction block's input (as Qwen3NextMultiTokenPredictor): the projection
 * eh_proj of [enorm(embedding of the token); hnorm(the model's final hidden state at the
 * position before)] into x. */
static void mtp_input(loom_runner *r, const loom_hparams *hp, const q35_model *m,
                      const loom_tensor *x)
{
    const int64_t d = hp->n_embd, n = x->ne[1];
    const loom_rt_inputs *in = loom_rt_inputs_of(r);
    loom_tensor part = loom_rt_scratch(r, LOOM_F32, d, n, 1);
    loom_tensor both = loom_rt_scratch(r, LOOM_F32, 2 * d, n, 1);
    const loom_tensor left = loom_rt_cols(&both, 0, d), right = loom_rt_cols(&both, d, d);
    loom_rt_get_rows(r, m->tok_embd, &in->ids, &part);
    loom_rt_rms_norm(r, &part, m->enorm, hp->norm_eps, &part);
    loom_rt_scale(r, &part, 1.0f, &left);
    loom_rt_rms_norm(r, &in->hidden_in, m->hnorm, hp->norm_eps, &part);
    loom_rt_scale(r, &part, 1.0f, &right);
    loom_rt_matmul(r, &both, m->eh_proj, NULL, x);
}

static int q35_forward(loom_runner *r, void *state, const loom_batch *batch)
{
    const q35_model *m = state;
    const loom_hparams *hp = loom_runner_hparams(r);
    loom_tensor x = loom_rt_scratch(r, LOOM_F32, hp->n_embd, batch->n, 1); /* residual stream */
    q35_buffers b = buffers(r, hp, m, batch->n);
    loom_ffn_buffers fb = {.h = b.h, .gate = b.ff_gate, .up = b.ff_up, .act = b.ff_gate};
    loom_moe_buffers mb = {0};
    if (hp->n_expert)
        mb = loom_moe_buffers_new(r, hp, batch->n, hp->n_ff_shexp > 0);
    int first, end;
    loom_rt_layers(r, &first, &end);
    const int mtp = loom_rt_mtp(r);
    assert(!mtp || (first == hp->n_layer && end == first + 1 && m->eh_proj));
    if (mtp)
        mtp_input(r, hp, m, &x);
    else
        loom_rt_embed(r, m->tok_embd, &x);
    for (int l = first; l < end; l++) {
        const q35_layer *L = &m->layers[l];
        if (loom_layer_recurrent(hp, l))
            linear_attention(r, hp, m, l, L, &x, &b);
        else
            gated_attention(r, hp, l, L, &x, &b);
        loom_ffn_weights f = {.norm = L->ffn_norm, .gate = L->gate, .up = L->up, .down = L->down};
        if (hp->n_expert)
            loom_ffn_moe(r, hp, &x, &L->moe, &mb);
        else
            loom_ffn_swiglu(r, hp, &x, &f, &fb);
    }
    loom_rt_logits(r, batch, &x, mtp ? m->head_norm : m->out_norm, NULL, hp->norm_eps, m->output);
    return loom_rt_status(r);
}

static int q35_load(loom_runner *r, loom_hparams *hp, void **state, char *err, size_t err_size)
{
    return load(r, hp, state, "qwen35", err, err_size);
}

static int q35moe_load(loom_runner *r, loom_hparams *hp, void **state, char *err, size_t err_size)
{
    return load(r, hp, state, "qwen35moe", err, err_size);
}

const loom_arch loom_arch_qwen35 = {
    .name = "qwen35", .load = q35_load, .forward = q35_forward, .free_state = q35_free};
static int q3next_load(loom_runner *r, loom_hparams *hp, void **state, char *err, size_t err_size)
{
    return load(r, hp, state, "qwen3next", err, err_size);
}

const loom_arch loom_arch_qwen35moe = {
    .name = "qwen35moe", .load = q35moe_load, .forward = q35_forward, .free_state = q35_free};
const loom_arch loom_arch_qwen3next = {
    .name = "qwen3next", .load = q3next_load, .forward = q35_forward, .free_state = q35_free};

/* ---- The Hugging Face form: Qwen3_5ForCausalLM (model_type qwen3_5_text) -------------------
 * As llama.cpp's converter writes it: the (1 + w) norms with the 1 added (not linear_attn.norm,
 * which is applied as it is), A_log as -exp(A_log), the conv1d weight [channels, 1, kernel] as
 * [channels, kernel] in f32, q_proj kept with each head's [query; gate]. The multi-token-
 * prediction block (mtp.*) becomes the file's last block, as llama.cpp writes it (nextn.*). */
/* The hyper-parameters every Qwen3.5 has, at the top of config.json or in its text_config */
/* clang-format off */
#define Q35_PARAMS                                                                                 \
    {"context_length", "text_config.max_position_embeddings|max_position_embeddings",              \
        LOOM_HF_U32, 262144},                                                                      \
    {"embedding_length", "text_config.hidden_size|hidden_size", LOOM_HF_U32, LOOM_HF_REQUIRED},    \
    {"block_count", "text_config.num_hidden_layers|num_hidden_layers", LOOM_HF_U32,                \
        LOOM_HF_REQUIRED},                                                                         \
    {"attention.head_count", "text_config.num_attention_heads|num_attention_heads",                \
        LOOM_HF_U32, LOOM_HF_REQUIRED},                                                            \
    {"attention.head_count_kv", "text_config.num_key_value_heads|num_key_value_heads",             \
        LOOM_HF_U32, LOOM_HF_REQUIRED},                                                            \
    {"attention.key_length", "text_config.head_dim|head_dim", LOOM_HF_U32, LOOM_HF_REQUIRED},      \
    {"attention.value_length", "text_config.head_dim|head_dim", LOOM_HF_U32, LOOM_HF_REQUIRED},    \
    {"attention.layer_norm_rms_epsilon", "text_config.rms_norm_eps|rms_norm_eps", LOOM_HF_F32,     \
        1e-6},                                                                                     \
    {"rope.freq_base",                                                                             \
        "text_config.rope_parameters.rope_theta|text_config.rope_theta|"                           \
        "rope_parameters.rope_theta|rope_theta", LOOM_HF_F32, 10000000.0},                         \
    {"ssm.conv_kernel", "text_config.linear_conv_kernel_dim|linear_conv_kernel_dim",               \
        LOOM_HF_U32, LOOM_HF_REQUIRED},                                                            \
    {"ssm.state_size", "text_config.linear_key_head_dim|linear_key_head_dim", LOOM_HF_U32,         \
        LOOM_HF_REQUIRED},                                                                         \
    {"ssm.group_count", "text_config.linear_num_key_heads|linear_num_key_heads", LOOM_HF_U32,      \
        LOOM_HF_REQUIRED},                                                                         \
    {"ssm.time_step_rank", "text_config.linear_num_value_heads|linear_num_value_heads",            \
        LOOM_HF_U32, LOOM_HF_REQUIRED},                                                            \
    {"full_attention_interval", "text_config.full_attention_interval|full_attention_interval",     \
        LOOM_HF_U32, 4}
/* clang-format on */
static const loom_hf_param q35_params[] = {Q35_PARAMS,
                                           {"feed_forward_length",
                                            "text_config.intermediate_size|intermediate_size",
                                            LOOM_HF_U32, LOOM_HF_REQUIRED},
                                           {0}};
/* Qwen3.5-MoE: every layer's MLP is experts (moe_intermediate_size wide) beside a shared one */
static const loom_hf_param q35moe_params[] = {
    Q35_PARAMS,
    {"expert_count", "text_config.num_experts|num_experts", LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"expert_used_count", "text_config.num_experts_per_tok|num_experts_per_tok", LOOM_HF_U32,
     LOOM_HF_REQUIRED},
    {"expert_feed_forward_length", "text_config.moe_intermediate_size|moe_intermediate_size",
     LOOM_HF_U32, LOOM_HF_REQUIRED},
    {"expert_shared_feed_forward_length",
     "text_config.shared_expert_intermediate_size|shared_expert_intermediate_size", LOOM_HF_U32,
     LOOM_HF_REQUIRED},
    {0}};

/* The rotated share of a head (transformers' default for these configs: 0.25), the value heads'
 * total width, and the checks that the config is the Qwen3.5 this file runs (its layer_types
 * follow the interval, the output gate is on). */
static int q35_derive(const cJSON *cf, loom_hf_values *v, char *err, size_t err_size)
{
    double share;
    int64_t d_v;
    if (loom_hf_real(cf,
                     "text_config.rope_parameters.partial_rotary_factor|"
                     "rope_parameters.partial_rotary_factor|partial_rotary_factor",
                     0.25, 0, 1.0, &share, err, err_size) ||
        loom_hf_int(cf, "text_config.linear_value_head_dim|linear_value_head_dim", 0, 1, 65536,
                    &d_v, err, err_size))
        return -1;
    if (d_v == 0) {
        snprintf(err, err_size, "config.json has no linear_value_head_dim");
        return -1;
    }
    const int64_t hd = (int64_t)loom_hf_get(v, "attention.key_length");
    const int64_t rot = (int64_t)(hd * share + 0.5);
    if (rot < 2 || rot % 2) {
        snprintf(err, err_size,
                 "partial_rotary_factor %g of head_dim %lld rotates %lld dims, "
                 "not an even number of at least 2",
                 share, (long long)hd, (long long)rot);
        return -1;
    }
    loom_hf_set(v, "rope.dimension_count", LOOM_HF_U32, (double)rot);
    loom_hf_set(v, "ssm.inner_size", LOOM_HF_U32,
                (double)d_v * loom_hf_get(v, "ssm.time_step_rank"));
    /* the multimodal checkpoints nest the language model's config in text_config */
    const cJSON *text = cJSON_GetObjectItem(cf, "text_config");
    if (cJSON_IsObject(text))
        cf = text;
    const cJSON *gate = cJSON_GetObjectItem(cf, "attn_output_gate");
    if (gate && !cJSON_IsTrue(gate)) {
        snprintf(err, err_size,
                 "attn_output_gate is false: the Qwen3.5 loom runs gates every "
                 "full-attention output");
        return -1;
    }
    const cJSON *types = cJSON_GetObjectItem(cf, "layer_types"), *t;
    const int interval = (int)loom_hf_get(v, "full_attention_interval");
    int l = 0;
    cJSON_ArrayForEach (t, types) {
        const char *want = (l + 1) % interval == 0 ? "full_attention" : "linear_attention";
        if (!cJSON_IsString(t) || strcmp(t->valuestring, want) != 0) {
            snprintf(err, err_size,
                     "layer_types[%d] is not \"%s\" as full_attention_interval %d "
                     "places it: a layout loom does not run",
                     l, want, interval);
            return -1;
        }
        l++;
    }
    if (types && l != (int)loom_hf_get(v, "block_count")) {
        snprintf(err, err_size, "layer_types lists %d layers, num_hidden_layers %.0f", l,
                 loom_hf_get(v, "block_count"));
        return -1;
    }
    return 0;
}

/* The tensors under the language model's prefix P ("model." in a text-only checkpoint,
 * "model.language_model." in a multimodal one): the mixers and norms, the linear layers'
 * projections (Qwen3.5's four, or Qwen3-Next's two fused ones, the first split in two), then the
 * dense MLP or the experts, one matrix per expert or (transformers 5) a stack per layer. VT and
 * VT_COLUMNS: LOOM_HF_V_TILED's flags where the file tiles the value heads (qwen35, qwen35moe). */
/* clang-format off */
#define LIN LOOM_HF_LINEAR_LAYERS
#define ATT LOOM_HF_ATTENTION_LAYERS
#define Q35_MIXERS(P, VT, VT_COLUMNS)                                                              \
    {P "embed_tokens.weight", "token_embd.weight", 0, NULL},                                       \
    {P "norm.weight", "output_norm.weight", LOOM_HF_PLUS_ONE, NULL},                               \
    {"lm_head.weight", "output.weight", LOOM_HF_OPTIONAL, NULL},                                   \
    {P "layers.%d.input_layernorm.weight", "blk.%d.attn_norm.weight", LOOM_HF_PLUS_ONE, NULL},     \
    {P "layers.%d.post_attention_layernorm.weight", "blk.%d.post_attention_norm.weight",           \
        LOOM_HF_PLUS_ONE, NULL},                                                                   \
    {P "layers.%d.linear_attn.conv1d.weight", "blk.%d.ssm_conv1d.weight",                          \
        LIN | VT | LOOM_HF_SQUEEZE, NULL},                                                         \
    {P "layers.%d.linear_attn.A_log", "blk.%d.ssm_a", LIN | VT | LOOM_HF_NEG_EXP, NULL},           \
    {P "layers.%d.linear_attn.dt_bias", "blk.%d.ssm_dt.bias", LIN | VT, NULL},                     \
    {P "layers.%d.linear_attn.norm.weight", "blk.%d.ssm_norm.weight", LIN, NULL},                  \
    {P "layers.%d.linear_attn.out_proj.weight", "blk.%d.ssm_out.weight", LIN | VT_COLUMNS, NULL},  \
    {P "layers.%d.self_attn.q_proj.weight", "blk.%d.attn_q.weight", ATT, NULL},                    \
    {P "layers.%d.self_attn.k_proj.weight", "blk.%d.attn_k.weight", ATT, NULL},                    \
    {P "layers.%d.self_attn.v_proj.weight", "blk.%d.attn_v.weight", ATT, NULL},                    \
    {P "layers.%d.self_attn.o_proj.weight", "blk.%d.attn_output.weight", ATT, NULL},               \
    {P "layers.%d.self_attn.q_norm.weight", "blk.%d.attn_q_norm.weight", ATT | LOOM_HF_PLUS_ONE,   \
        NULL},                                                                                     \
    {P "layers.%d.self_attn.k_norm.weight", "blk.%d.attn_k_norm.weight", ATT | LOOM_HF_PLUS_ONE,   \
        NULL}
#define Q35_PROJECTIONS(P, VT)                                                                     \
    {P "layers.%d.linear_attn.in_proj_qkv.weight", "blk.%d.attn_qkv.weight", LIN | VT, NULL},      \
    {P "layers.%d.linear_attn.in_proj_z.weight", "blk.%d.attn_gate.weight", LIN | VT, NULL},       \
    {P "layers.%d.linear_attn.in_proj_a.weight", "blk.%d.ssm_alpha.weight", LIN | VT, NULL},       \
    {P "layers.%d.linear_attn.in_proj_b.weight", "blk.%d.ssm_beta.weight", LIN | VT, NULL}
#define NEXT_PROJECTIONS(P)                                                                        \
    {P "layers.%d.linear_attn.in_proj_qkvz.weight", "blk.%d.attn_qkv.weight",                      \
        LIN | LOOM_HF_QKVZ_QKV, NULL},                                                             \
    {P "layers.%d.linear_attn.in_proj_qkvz.weight", "blk.%d.attn_gate.weight",                     \
        LIN | LOOM_HF_QKVZ_Z, NULL},                                                               \
    {P "layers.%d.linear_attn.in_proj_ba.weight", "blk.%d.ssm_ba.weight", LIN, NULL}
#define Q35_MLP(P, F)                                                                              \
    {P "layers.%d.mlp.gate_proj.weight", "blk.%d.ffn_gate.weight", F, NULL},                       \
    {P "layers.%d.mlp.up_proj.weight", "blk.%d.ffn_up.weight", F, NULL},                           \
    {P "layers.%d.mlp.down_proj.weight", "blk.%d.ffn_down.weight", F, NULL}
#define Q35_EXPERTS(P, F)                                                                          \
    {P "layers.%d.mlp.gate.weight", "blk.%d.ffn_gate_inp.weight", F, NULL},                        \
    LOOM_HF_EXPERT_STACKS(P, F),                                                                   \
    {P "layers.%d.mlp.shared_expert.gate_proj.weight", "blk.%d.ffn_gate_shexp.weight", F, NULL},   \
    {P "layers.%d.mlp.shared_expert.up_proj.weight", "blk.%d.ffn_up_shexp.weight", F, NULL},       \
    {P "layers.%d.mlp.shared_expert.down_proj.weight", "blk.%d.ffn_down_shexp.weight", F, NULL},   \
    {P "layers.%d.mlp.shared_expert_gate.weight", "blk.%d.ffn_gate_inp_shexp.weight", F, NULL}
/* The multi-token-prediction block (mtp.*, beside the language model in every checkpoint) as
 * llama.cpp writes it: the block after the layers, its input projection and norms as nextn.*, a
 * full-attention decoder layer; the layer's MLP (Q35_MLP or Q35_EXPERTS with "mtp.", MTP) after */
#define MTP LOOM_HF_MTP
#define Q35_MTP_BLOCK                                                                              \
    {"mtp.fc.weight", "blk.%d.nextn.eh_proj.weight", MTP, NULL},                                   \
    {"mtp.pre_fc_norm_embedding.weight", "blk.%d.nextn.enorm.weight", MTP | LOOM_HF_PLUS_ONE,      \
        NULL},                                                                                     \
    {"mtp.pre_fc_norm_hidden.weight", "blk.%d.nextn.hnorm.weight", MTP | LOOM_HF_PLUS_ONE, NULL},  \
    {"mtp.norm.weight", "blk.%d.nextn.shared_head_norm.weight", MTP | LOOM_HF_PLUS_ONE, NULL},     \
    {"mtp.layers.%d.input_layernorm.weight", "blk.%d.attn_norm.weight", MTP | LOOM_HF_PLUS_ONE,    \
        NULL},                                                                                     \
    {"mtp.layers.%d.post_attention_layernorm.weight", "blk.%d.post_attention_norm.weight",         \
        MTP | LOOM_HF_PLUS_ONE, NULL},                                                             \
    {"mtp.layers.%d.self_attn.q_proj.weight", "blk.%d.attn_q.weight", MTP, NULL},                  \
    {"mtp.layers.%d.self_attn.k_proj.weight", "blk.%d.attn_k.weight", MTP, NULL},                  \
    {"mtp.layers.%d.self_attn.v_proj.weight", "blk.%d.attn_v.weight", MTP, NULL},                  \
    {"mtp.layers.%d.self_attn.o_proj.weight", "blk.%d.attn_output.weight", MTP, NULL},             \
    {"mtp.layers.%d.self_attn.q_norm.weight", "blk.%d.attn_q_norm.weight",                         \
        MTP | LOOM_HF_PLUS_ONE, NULL},                                                             \
    {"mtp.layers.%d.self_attn.k_norm.weight", "blk.%d.attn_k_norm.weight",                         \
        MTP | LOOM_HF_PLUS_ONE, NULL}
#define TILED(P)                                                                                   \
    Q35_MIXERS(P, LOOM_HF_V_TILED, LOOM_HF_V_TILED_COLUMNS), Q35_PROJECTIONS(P, LOOM_HF_V_TILED)
static const loom_hf_tensor q35_tensors[] = {
    TILED("model."), Q35_MLP("model.", 0), Q35_MTP_BLOCK, Q35_MLP("mtp.", MTP), {0}};
static const loom_hf_tensor q35_vl_tensors[] = {
    TILED("model.language_model."), Q35_MLP("model.language_model.", 0), Q35_MTP_BLOCK,
    Q35_MLP("mtp.", MTP), {0}};
static const loom_hf_tensor q35moe_tensors[] = {
    TILED("model."), Q35_EXPERTS("model.", 0), Q35_MTP_BLOCK, Q35_EXPERTS("mtp.", MTP), {0}};
static const loom_hf_tensor q35moe_vl_tensors[] = {
    TILED("model.language_model."), Q35_EXPERTS("model.language_model.", 0), Q35_MTP_BLOCK,
    Q35_EXPERTS("mtp.", MTP), {0}};
/* Qwen3-Next: the value heads stay grouped, as llama.cpp's qwen3next files keep them */
static const loom_hf_tensor next_tensors[] = {
    Q35_MIXERS("model.", 0, 0), NEXT_PROJECTIONS("model."), Q35_EXPERTS("model.", 0),
    Q35_MTP_BLOCK, Q35_EXPERTS("mtp.", MTP), {0}};
#undef TILED
#undef MTP
#undef LIN
#undef ATT
/* clang-format on */

/* config.json's count of multi-token-prediction blocks (Qwen3.5's key; Qwen3-Next's, as vLLM
 * reads it) */
#define Q35_MTP_LAYERS                                                                             \
    "text_config.mtp_num_hidden_layers|mtp_num_hidden_layers|num_nextn_predict_layers"

/* The multimodal checkpoints (Qwen3_5ForConditionalGeneration, model_type qwen3_5: every
 * Qwen3.5 and 3.6 release): the same language model under model.language_model, its config in
 * text_config, beside a vision tower (model.visual.*) that loom does not run yet and leaves out;
 * the conversion says so. */
static int q35_vl_derive(const cJSON *config, loom_hf_values *v, char *err, size_t err_size)
{
    if (cJSON_GetObjectItem(config, "vision_config"))
        fprintf(stderr,
                "note: the vision tower (model.visual.*) is left out: loom runs the "
                "language model alone, text in and out\n");
    return q35_derive(config, v, err, err_size);
}

/* Qwen3.5-MoE (Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text; the multimodal
 * Qwen3_5MoeForConditionalGeneration, qwen3_5_moe): Qwen3.5's layers with every MLP replaced by
 * experts. Its router (transformers' Qwen3VLMoeTextTopKRouter) always renormalises the chosen
 * experts' weights, as llama.cpp's qwen35moe does; a config that makes some layers dense
 * (mlp_only_layers, decoder_sparse_step, which Qwen3.5-MoE's config class drops) is refused. */
static int q35moe_derive(const cJSON *config, loom_hf_values *v, char *err, size_t err_size)
{
    if (q35_derive(config, v, err, err_size) != 0)
        return -1;
    const cJSON *text = cJSON_GetObjectItem(config, "text_config");
    const cJSON *cf = cJSON_IsObject(text) ? text : config;
    const cJSON *dense = cJSON_GetObjectItem(cf, "mlp_only_layers");
    int64_t step;
    if (loom_hf_int(cf, "decoder_sparse_step", 1, 1, INT32_MAX, &step, err, err_size))
        return -1;
    if (step != 1 || (dense && !(cJSON_IsArray(dense) && cJSON_GetArraySize(dense) == 0))) {
        snprintf(err, err_size,
                 "%s: some layers would be dense; Qwen3.5-MoE's every layer has experts",
                 step != 1 ? "decoder_sparse_step is not 1" : "mlp_only_layers is not empty");
        return -1;
    }
    if (loom_hf_get(v, "expert_used_count") > loom_hf_get(v, "expert_count")) {
        snprintf(err, err_size, "num_experts_per_tok %.0f exceeds num_experts %.0f",
                 loom_hf_get(v, "expert_used_count"), loom_hf_get(v, "expert_count"));
        return -1;
    }
    return 0;
}

static int q35moe_vl_derive(const cJSON *config, loom_hf_values *v, char *err, size_t err_size)
{
    if (cJSON_GetObjectItem(config, "vision_config"))
        fprintf(stderr,
                "note: the vision tower (model.visual.*) is left out: loom runs the "
                "language model alone, text in and out\n");
    return q35moe_derive(config, v, err, err_size);
}

const loom_family loom_family_qwen35_vl = {.arch = &loom_arch_qwen35,
                                           .chat_template = "chatml",
                                           .hf_model_type = "qwen3_5",
                                           .hf_params = q35_params,
                                           .hf_derive = q35_vl_derive,
                                           .hf_tensors = q35_vl_tensors,
                                           .hf_mtp_layers = Q35_MTP_LAYERS};

const loom_family loom_family_qwen35 = {.arch = &loom_arch_qwen35,
                                        .chat_template = "chatml",
                                        .hf_model_type = "qwen3_5_text",
                                        .hf_params = q35_params,
                                        .hf_derive = q35_derive,
                                        .hf_tensors = q35_tensors,
                                        .hf_mtp_layers = Q35_MTP_LAYERS};

const loom_family loom_family_qwen35moe = {.arch = &loom_arch_qwen35moe,
                                           .chat_template = "chatml",
                                           .hf_model_type = "qwen3_5_moe_text",
                                           .hf_params = q35moe_params,
                                           .hf_derive = q35moe_derive,
                                           .hf_tensors = q35moe_tensors,
                                           .hf_mtp_layers = Q35_MTP_LAYERS};

const loom_family loom_family_qwen35moe_vl = {.arch = &loom_arch_qwen35moe,
                                              .chat_template = "chatml",
                                              .hf_model_type = "qwen3_5_moe",
                                              .hf_params = q35moe_params,
                                              .hf_derive = q35moe_vl_derive,
                                              .hf_tensors = q35moe_vl_tensors,
                                              .hf_mtp_layers = Q35_MTP_LAYERS};

/* Qwen3-Next (Qwen3NextForCausalLM, model_type qwen3_next): Qwen3.5-MoE's layers with the fused
 * projections, plain RoPE, and the experts' weights renormalised as norm_topk_prob says
 * (transformers' default: yes; llama.cpp always renormalises). */
static int next_derive(const cJSON *config, loom_hf_values *v, char *err, size_t err_size)
{
    if (q35moe_derive(config, v, err, err_size) != 0)
        return -1;
    const cJSON *norm = cJSON_GetObjectItem(config, "norm_topk_prob");
    loom_hf_set(v, "expert_weights_norm", LOOM_HF_BOOL, !norm || cJSON_IsTrue(norm));
    return 0;
}

const loom_family loom_family_qwen3next = {.arch = &loom_arch_qwen3next,
                                           .chat_template = "chatml",
                                           .hf_model_type = "qwen3_next",
                                           .hf_params = q35moe_params,
                                           .hf_derive = next_derive,
                                           .hf_tensors = next_tensors,
                                           .hf_mtp_layers = Q35_MTP_LAYERS};
