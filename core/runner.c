/*
 * core/runner.c - see runner.h.
 *
 * Memory: weights are used in place from the file mapping when the backend can wrap host
 * memory (buffer_wrap_host), else each is uploaded once. A weight's first use as a matmul's W
 * offers it to the backend's prepare_weight (a layout of its own, such as interleaved rows);
 * a prepared copy replaces it for matmuls from then on, and the mapped original's pages are
 * let go (LOOM_REPACK=0 keeps every weight in the file's layout); core/weights.c does this. The
 * KV cache is one buffer of
 * [layer][k|v][blocks][block_size][kv_heads][head_dim]; which blocks a sequence uses is the
 * caller's business (loom_runner_eval: one sequence over blocks 0, 1, ... in order; a server:
 * core/kvblocks). Scratch activations and the per-step inputs come from buffers that only grow,
 * so a pass with the same shapes as the last allocates nothing.
 */
#define _GNU_SOURCE
#include "runner_internal.h"

#include <assert.h>
#include <stdarg.h>
#include <stdint.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int loom_runner_fail(loom_runner *r, const char *fmt, ...)
{
    if (r->status)
        return -1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->err, sizeof r->err, fmt, ap);
    va_end(ap);
    r->status = -1;
    return -1;
}

/* ---- Scratch (the views are core/verbs.c's) ------------------------------------------------ */

loom_tensor loom_rt_scratch(loom_runner *r, loom_dtype dt, int64_t n0, int64_t n1, int64_t n2)
{
    loom_tensor t = loom_runner_dense(NULL, 0, dt, n0, n1, n2, 1);
    uint64_t size = t.nb[3];
    if (r->status)
        return t;
    if (r->n_scratch_used >= MAX_SCRATCH) {
        loom_runner_fail(r, "the model asked for more than %d scratch tensors in one pass",
                         MAX_SCRATCH);
        return t;
    }
    scratch_slot *s = &r->scratch[r->n_scratch_used++];
    if (s->size < size) {
        if (s->buf)
            r->dev->ops.buffer_free(r->dev->be, s->buf);
        s->buf = NULL;
        s->size = 0;
        if (r->dev->ops.buffer_alloc(r->dev->be, size, &s->buf) != LOOM_OK) {
            loom_runner_fail(r, "out of memory on %s: %llu bytes of activations: %s", r->dev->name,
                             (unsigned long long)size, r->dev->ops.last_error(r->dev->be));
            return t;
        }
        s->size = size;
    }
    t.buf = s->buf;
    return t;
}

loom_tensor loom_rt_upload_i32(loom_runner *r, const int32_t *host, int64_t n)
{
    loom_tensor t = loom_rt_scratch(r, LOOM_I32, n, 1, 1);
    if (!r->status &&
        r->dev->ops.copy_from_host(r->dev->be, t.buf, t.offset, host, (uint64_t)n * 4) != LOOM_OK)
        loom_runner_fail(r, "uploading %lld ints to %s: %s", (long long)n, r->dev->name,
                         r->dev->ops.last_error(r->dev->be));
    return t;
}

const loom_tensor *loom_rt_constant(loom_runner *r, const float *host, int64_t n)
{
    if (r->status)
        return NULL;
    if (r->n_constants == MAX_CONSTANTS) {
        loom_runner_fail(r, "the model asked for more than %d constants", MAX_CONSTANTS);
        return NULL;
    }
    loom_tensor *t = &r->constants[r->n_constants];
    *t = loom_runner_dense(NULL, 0, LOOM_F32, n, 1, 1, 1);
    t->n_dims = 1;
    const loom_backend_ops *ops = &r->dev->ops;
    if (ops->buffer_alloc(r->dev->be, (uint64_t)n * 4, &t->buf) != LOOM_OK ||
        ops->copy_from_host(r->dev->be, t->buf, 0, host, (uint64_t)n * 4) != LOOM_OK) {
        loom_runner_fail(r, "uploading %lld constants to %s: %s", (long long)n, r->dev->name,
                         ops->last_error(r->dev->be));
        if (t->buf)
            ops->buffer_free(r->dev->be, t->buf);
        return NULL;
    }
    r->n_constants++;
    return t;
}

const loom_rt_inputs *loom_rt_inputs_of(const loom_runner *r)
{
    return &r->in;
}

const loom_tensor *loom_rt_kcache(const loom_runner *r, int layer)
{
    return &r->kc[layer];
}

const loom_tensor *loom_rt_vcache(const loom_runner *r, int layer)
{
    return &r->vc[layer];
}

void loom_rt_layers(const loom_runner *r, int *first, int *end)
{
    *first = r->layer0;
    *end = r->layer_end;
}


void loom_rt_embed(loom_runner *r, const loom_tensor *tok_embd, const loom_tensor *x)
{
    if (r->opt.link && r->opt.link->recv)
        loom_stage_receive(r, x);
    else
        loom_rt_get_rows(r, tok_embd, &r->in.ids, x);
}

void loom_rt_set_logits(loom_runner *r, const loom_tensor *logits)
{
    r->logits_src = *logits;
    r->has_logits = 1;
}

/* rows `which` of the residual stream x, through the final norm: a new [n_embd, n] tensor */
static loom_tensor final_rows(loom_runner *r, const loom_tensor *x, const loom_tensor *which,
                              int32_t n, const loom_tensor *norm, const loom_tensor *norm_bias,
                              float eps)
{
    loom_tensor rows = loom_rt_scratch(r, LOOM_F32, x->ne[0], n, 1);
    loom_rt_get_rows(r, x, which, &rows);
    if (norm_bias)
        loom_rt_layer_norm(r, &rows, norm, norm_bias, eps, &rows);
    else
        loom_rt_rms_norm(r, &rows, norm, eps, &rows);
    return rows;
}

void loom_rt_logits(loom_runner *r, const loom_batch *b, const loom_tensor *x,
                    const loom_tensor *norm, const loom_tensor *norm_bias, float eps,
                    const loom_tensor *output)
{
    if (!loom_runner_is_last_stage(r)) {
        loom_stage_hand_on(r, x);
        return;
    }
    if (b->n_hidden > 0) {
        r->hidden_src = final_rows(r, x, &r->in.hidden_rows, b->n_hidden, norm, norm_bias, eps);
        r->has_hidden = 1;
    }
    if (b->n_logits <= 0)
        return;
    loom_tensor rows = final_rows(r, x, &r->in.logit_rows, b->n_logits, norm, norm_bias, eps);
    loom_tensor logits = loom_rt_scratch(r, LOOM_F32, output->ne[1], b->n_logits, 1);
    loom_rt_matmul(r, &rows, output, NULL, &logits);
    loom_rt_set_logits(r, &logits);
}

int loom_rt_status(const loom_runner *r)
{
    return r->status;
}

/* ---- Running an op (the verbs that call this are core/verbs.c's) ---------------------------- */

#define OP_NAME_FAIL(r, what)                                                                      \
    loom_runner_fail(r, "%s on %s%s%s failed: %s", what, r->dev->name,                             \
                     r->dev->variant[0] ? "-" : "", r->dev->variant,                               \
                     r->dev->ops.last_error(r->dev->be))

static int is_weight_buffer(void *ctx, const loom_buffer *buf)
{
    const loom_runner *r = ctx;
    if (buf == r->weights_map || buf == r->experts_map)
        return 1;
    for (int i = 0; i < r->n_constants; i++)
        if (r->constants[i].buf == buf)
            return 1;
    for (uint64_t i = 0; i < r->gguf->n_tensors; i++)
        if (r->weight_bufs[i] == buf)
            return 1;
    return 0;
}

/* The ABI minor a call's parameters need: a member a later minor added, when set, is one an
 * older module would not read (it would run the op without it, wrongly). */
static uint32_t minor_needed(loom_op op, const void *params)
{
    if (op == LOOM_OP_ROPE && ((const loom_rope_params *)params)->freq_factors)
        return 4;
    if (op == LOOM_OP_ATTENTION && ((const loom_attention_params *)params)->window)
        return 4;
    if (op == LOOM_OP_MOE_ROUTE && ((const loom_moe_route_params *)params)->n_group > 1)
        return 7;
    if (op == LOOM_OP_GATED_DELTA && ((const loom_gated_delta_params *)params)->v_heads_tiled)
        return 9;
    return 0;
}

/* Whether buf is one of opt.experts's own: the expert stacks placed there. */
static int on_experts_device(void *ctx, const loom_buffer *buf)
{
    const loom_runner *r = ctx;
    if (buf == r->experts_map)
        return 1;
    for (uint64_t i = 0; i < r->gguf->n_tensors; i++)
        if ((r->weight_bufs[i] == buf || (r->prep[i] == PREP_DONE && r->prepared[i].buf == buf)) &&
            loom_runner_on_experts(r, &r->gguf->tensors[i]))
            return 1;
    return 0;
}

void loom_runner_exec_op(loom_runner *r, loom_op op, loom_dtype dt, const char *what, void *params)
{
    if (r->status)
        return;
    if (op == LOOM_OP_MATMUL_ID && r->opt.experts) {
        loom_device *e = r->opt.experts;
        char err[512];
        if (r->census) /* not the model's device's to run */
            return;
        if (!loom_device_supports(e, op, dt)) {
            loom_runner_fail(r, "the experts are on %s%s%s, which does not run %s with %s", e->name,
                             e->variant[0] ? "-" : "", e->variant, what, loom_dtype_name(dt));
            return;
        }
        if (!r->experts_run)
            r->experts_run = loom_fallback_on(r->dev, r->opt.experts, on_experts_device, r);
        if (!r->experts_run)
            loom_runner_fail(r, "out of memory");
        else if (loom_fallback_run(r->experts_run, op, dt, params, what, err, sizeof err) != 0)
            loom_runner_fail(r, "the experts on %s%s%s: %s", e->name, e->variant[0] ? "-" : "",
                             e->variant, err);
        return;
    }
    if (loom_device_supports(r->dev, op, dt) &&
        r->dev->module.abi_minor >= minor_needed(op, params)) {
        if (loom_device_run(r->dev, op, params) != LOOM_OK)
            OP_NAME_FAIL(r, what);
    } else if (r->census) {
        r->lacking[op][dt & 31] = 1;
        return;
    } else if (r->opt.strict) {
        loom_runner_fail(
            r,
            "backend %s%s%s does not support %s with %s, and strict mode (LOOM_STRICT=1) "
            "forbids running it on the CPU instead",
            r->dev->name, r->dev->variant[0] ? "-" : "", r->dev->variant, what,
            loom_dtype_name(dt));
        return;
    } else {
        char err[512];
        if (!r->fallback)
            r->fallback = loom_fallback_new(r->dev, r->opt.loader, is_weight_buffer, r);
        if (!r->fallback)
            loom_runner_fail(r, "out of memory");
        else if (loom_fallback_run(r->fallback, op, dt, params, what, err, sizeof err) != 0)
            loom_runner_fail(r, "%s", err);
    }
}

/* ---- Lifetime ----------------------------------------------------------------------------- */

/* LOOM_STRICT=1: refuse a model at load when the device lacks any op it needs, naming them
 * all, rather than the first one met mid-generation. The graph's ops do not depend on the
 * values, so one token with the lacking ops skipped meets every op a decode step runs. */
static int strict_census(loom_runner *r, char *err, size_t err_size)
{
    int32_t token = 0;
    r->census = 1;
    int rc = loom_runner_eval(r, &token, 1, 0, err, err_size);
    r->census = 0;
    if (rc != 0)
        return rc;
    char list[1024] = "";
    size_t used = 0;
    int n = 0;
    for (int op = 0; op < LOOM_OP_COUNT; op++)
        for (int dt = 0; dt < 32; dt++)
            if (r->lacking[op][dt] && used < sizeof list) {
                used += (size_t)snprintf(list + used, sizeof list - used, "%s%s with %s",
                                         n++ ? ", " : "", loom_op_name((loom_op)op),
                                         loom_dtype_name((loom_dtype)dt));
            }
    if (!n)
        return 0;
    snprintf(err, err_size,
             "strict mode (LOOM_STRICT=1): backend %s%s%s lacks %d op(s) this "
             "model needs: %s (without it they run on the CPU)",
             r->dev->name, r->dev->variant[0] ? "-" : "", r->dev->variant, n, list);
    return -1;
}

/* What every family's forward pass assumes of the hyper-parameters its load read: a value
 * outside these (a NaN epsilon, a zero RoPE base) would not fail, it would answer garbage. */
static int check_hparams(const loom_hparams *hp, char *err, size_t err_size)
{
    _Static_assert(LOOM_MAX_EXPERTS == 1024, "the message below names the limit");
    const char *bad = !(hp->norm_eps > 0 && hp->norm_eps < 1)
        ? "the norm epsilon (attention.layer_norm_rms_epsilon or layer_norm_epsilon) must be "
          "above 0 and below 1"
        : !(hp->rope_base > 0 && isfinite(hp->rope_base))
        ? "the RoPE base (rope.freq_base) must be finite and above 0"
        : !(hp->rope_scale > 0 && isfinite(hp->rope_scale))
        ? "the RoPE scaling (rope.scaling.factor) must be finite and above 0"
        : !(hp->attn_factor > 0 && hp->attn_factor < 100)
        ? "the attention factor (YaRN's, from rope.scaling.factor) must be above 0 and below 100"
        : hp->head_dim <= 0 || hp->head_dim > 65536
        ? "the head width (attention.key_length) must be from 1 to 65536"
        : hp->n_rot < 0 || hp->n_rot > hp->head_dim || hp->n_rot % 2
        ? "the rotated dimensions (rope.dimension_count) must be even and at most the head width"
        : hp->n_swa < 0 ? "the sliding window (attention.sliding_window) must not be negative"
                        : NULL;
    if (bad) {
        snprintf(err, err_size, "%s: %s (epsilon %g, base %g, scale %g, head %d, rotated %d)",
                 hp->arch, bad, (double)hp->norm_eps, (double)hp->rope_base, (double)hp->rope_scale,
                 hp->head_dim, hp->n_rot);
        return -1;
    }
    bad = hp->n_expert < 0 || hp->n_expert > LOOM_MAX_EXPERTS
        ? "the expert count (expert_count) must be from 0 to 1024 (LOOM_MAX_EXPERTS)"
        : hp->n_expert &&
            (hp->n_expert_used < 1 || hp->n_expert_used > hp->n_expert || hp->n_ff_exp <= 0)
        ? "the experts chosen per token (expert_used_count) must be from 1 to the expert count, "
          "and an expert's width (expert_feed_forward_length) above 0"
        : hp->n_expert && !(hp->moe_scale > 0 && isfinite(hp->moe_scale))
        ? "the experts' weight scale (expert_weights_scale) must be finite and above 0"
        : hp->moe_groups > 1 &&
            (hp->n_expert % hp->moe_groups || hp->moe_groups_kept < 1 ||
             hp->moe_groups_kept > hp->moe_groups ||
             hp->n_expert_used > hp->moe_groups_kept * (hp->n_expert / hp->moe_groups))
        ? "the expert groups (expert_group_count) must divide the experts, the groups kept "
          "(expert_group_used_count) be 1 to their count and hold at least the experts chosen"
        : NULL;
    if (bad)
        snprintf(err, err_size,
                 "%s: %s (experts %d, chosen %d, width %d, weight scale %g, groups %d, kept %d)",
                 hp->arch, bad, hp->n_expert, hp->n_expert_used, hp->n_ff_exp,
                 (double)hp->moe_scale, hp->moe_groups, hp->moe_groups_kept);
    return bad ? -1 : 0;
}

loom_runner *loom_runner_create(loom_device *dev, const loom_gguf *gguf, const loom_arch *arch,
                                const loom_runner_options *opts, char *err, size_t err_size)
{
    loom_runner *r = calloc(1, sizeof *r);
    if (!r) {
        snprintf(err, err_size, "out of memory");
        return NULL;
    }
    r->dev = dev;
    r->gguf = gguf;
    r->arch = arch;
    r->opt = *opts;
    if (r->opt.block_size <= 0)
        r->opt.block_size = LOOM_RUNNER_BLOCK_SIZE;
    if (r->opt.n_batch <= 0)
        r->opt.n_batch = 256;
    if (r->opt.kv_type != LOOM_F32 && r->opt.kv_type != LOOM_Q8_0)
        r->opt.kv_type = LOOM_F16;
    r->weights = calloc(gguf->n_tensors + 1, sizeof *r->weights);
    r->weight_bufs = calloc(gguf->n_tensors + 1, sizeof *r->weight_bufs);
    r->weight_ready = calloc(gguf->n_tensors + 1, 1);
    r->prepared = calloc(gguf->n_tensors + 1, sizeof *r->prepared);
    r->prep = calloc(gguf->n_tensors + 1, 1);
    r->repack = opts->repack >= 0;
    if (!r->weights || !r->weight_bufs || !r->weight_ready || !r->prepared || !r->prep) {
        snprintf(err, err_size, "out of memory");
        loom_runner_free(r);
        return NULL;
    }
    r->hp.attn_factor = 1.0f; /* what a family without YaRN leaves it */
    if (arch->load(r, &r->hp, &r->state, err, err_size) != 0 || r->status ||
        check_hparams(&r->hp, err, err_size) != 0) {
        if (r->status)
            snprintf(err, err_size, "%s", r->err);
        loom_runner_free(r);
        return NULL;
    }
    const loom_hparams *hp = &r->hp;
    if (r->opt.experts && !hp->n_expert) {
        snprintf(err, err_size,
                 "the experts are to go to %s%s%s, but this %s model has none (placing them "
                 "applies to mixture-of-experts models)",
                 r->opt.experts->name, r->opt.experts->variant[0] ? "-" : "",
                 r->opt.experts->variant, hp->arch);
        loom_runner_free(r);
        return NULL;
    }
    r->layer0 = 0, r->layer_end = hp->n_layer;
    if (r->opt.mtp) {
        if (hp->n_nextn <= 0 || r->opt.link || r->opt.first_layers > 0) {
            snprintf(err, err_size,
                     hp->n_nextn <= 0
                         ? "%s: this file has no multi-token-prediction block "
                           "(nextn_predict_layers is 0), so it cannot draft for itself; "
                           "use --draft-layers or --lookup"
                         : "%s: the multi-token-prediction drafter runs alone, not as a "
                           "pipeline stage or beside first_layers",
                     hp->arch);
            loom_runner_free(r);
            return NULL;
        }
        /* the first MTP block drafts every token (later ones, where a file has them, would
         * draft the tokens after) */
        r->layer0 = hp->n_layer, r->layer_end = hp->n_layer + 1;
    }
    if (!r->opt.link && r->opt.first_layers > 0) {
        if (r->opt.first_layers >= hp->n_layer) {
            snprintf(err, err_size,
                     "a drafter of the first %d layers of a %d-layer model: it must have fewer "
                     "layers than the model",
                     r->opt.first_layers, hp->n_layer);
            loom_runner_free(r);
            return NULL;
        }
        r->layer_end = r->opt.first_layers;
    }
    if (r->opt.link) {
        const loom_stage_link *ln = r->opt.link;
        if (r->opt.first_layer < 0 || r->opt.first_layer > r->opt.end_layer ||
            r->opt.end_layer > hp->n_layer) {
            snprintf(err, err_size, "pipeline stage of layers [%d, %d): the model has %d layers",
                     r->opt.first_layer, r->opt.end_layer, hp->n_layer);
            loom_runner_free(r);
            return NULL;
        }
        r->layer0 = r->opt.first_layer, r->layer_end = r->opt.end_layer;
        /* the first stage embeds, so it starts at layer 0; the last has the head, so it ends
         * with the last layer */
        if ((r->layer0 > 0 && !ln->recv) || (r->layer_end < hp->n_layer && !ln->send)) {
            snprintf(err, err_size, "pipeline stage of layers [%d, %d) of %d: no link to its %s",
                     r->layer0, r->layer_end, hp->n_layer,
                     r->layer0 > 0 && !ln->recv ? "previous stage" : "next stage");
            loom_runner_free(r);
            return NULL;
        }
    }
    const int32_t n_held = r->layer_end - r->layer0;
    int32_t n_ctx = r->opt.n_ctx > 0 ? r->opt.n_ctx : hp->n_ctx_train > 0 ? hp->n_ctx_train : 2048;
    if (r->opt.n_ctx <= 0 && n_ctx > 4096)
        n_ctx = 4096;
    r->opt.n_ctx = n_ctx;
    int32_t seq_blocks = (n_ctx + r->opt.block_size - 1) / r->opt.block_size;
    r->n_blocks = seq_blocks;
    if (r->opt.kv_blocks > 0) {
        r->n_blocks = r->opt.kv_blocks;
    } else if (r->opt.kv_sequences > 0) {
        int64_t each = ((n_ctx < 1024 ? n_ctx : 1024) + r->opt.block_size - 1) / r->opt.block_size;
        int64_t total = each * r->opt.kv_sequences;
        r->n_blocks = total > seq_blocks ? (total < INT32_MAX ? (int32_t)total : INT32_MAX)
                                         : seq_blocks;
    }
    if (r->opt.kv_type == LOOM_Q8_0 && hp->head_dim % LOOM_QK) {
        snprintf(err, err_size, "a q8_0 KV cache needs head_dim to be a multiple of 32 (it is %d)",
                 hp->head_dim);
        loom_runner_free(r);
        return NULL;
    }
    uint64_t row = (uint64_t)loom_row_bytes(r->opt.kv_type, hp->head_dim);
    r->kv_block = row * (uint64_t)hp->n_head_kv * (uint64_t)r->opt.block_size;
    uint64_t per_cache = r->kv_block * (uint64_t)r->n_blocks;
    const uint64_t caches = hp->kv_values_in_keys ? 1 : 2; /* per layer */
    for (int l = r->layer0; l < r->layer_end; l++) /* recurrent layers keep a state instead */
        r->n_kv_layers += !loom_layer_recurrent(hp, l);
    r->kc = calloc((size_t)r->layer_end, sizeof *r->kc);
    r->vc = calloc((size_t)r->layer_end, sizeof *r->vc);
    if (!r->kc || !r->vc ||
        (r->n_kv_layers &&
         dev->ops.buffer_alloc(dev->be, per_cache * caches * (uint64_t)r->n_kv_layers, &r->kv) !=
             LOOM_OK)) {
        snprintf(err, err_size,
                 "out of memory on %s for a KV cache of %d blocks of %d tokens "
                 "(%llu bytes): %s",
                 dev->name, r->n_blocks, r->opt.block_size,
                 (unsigned long long)(per_cache * caches * (uint64_t)r->n_kv_layers),
                 dev->ops.last_error(dev->be));
        loom_runner_free(r);
        return NULL;
    }
    (void)n_held;
    for (int l = r->layer0, i = 0; l < r->layer_end; l++) {
        if (loom_layer_recurrent(hp, l))
            continue;
        r->kc[l] = loom_runner_dense(r->kv, per_cache * caches * (uint64_t)i++, r->opt.kv_type,
                                     hp->head_dim, hp->n_head_kv, r->opt.block_size, r->n_blocks);
        /* head-major inside a block: attention walks one head's keys in order, and these then
         * lie together (measured: 16-sequence decode steps spent 17% waiting on strided K/V
         * loads with the slot-major layout). A block stays one contiguous piece. */
        r->kc[l].nb[2] = r->kc[l].nb[1];
        r->kc[l].nb[1] = r->kc[l].nb[2] * (uint64_t)r->opt.block_size;
        r->vc[l] = r->kc[l];
        r->vc[l].offset += (caches - 1) * per_cache;
    }
    if (loom_recurrent_alloc(r, err, err_size) != 0) {
        loom_runner_free(r);
        return NULL;
    }
    if (r->opt.strict && strict_census(r, err, err_size) != 0) {
        loom_runner_free(r);
        return NULL;
    }
    return r;
}

void loom_runner_free(loom_runner *r)
{
    if (!r)
        return;
    loom_fallback_free(r->fallback);
    loom_fallback_free(r->experts_run);
    loom_recurrent_free(r);
    if (r->arch && r->state)
        r->arch->free_state(r->state);
    const loom_backend_ops *ops = &r->dev->ops;
    for (int i = 0; i < MAX_SCRATCH; i++)
        if (r->scratch[i].buf)
            ops->buffer_free(r->dev->be, r->scratch[i].buf);
    for (uint64_t i = 0; r->weight_bufs && i < r->gguf->n_tensors; i++)
        if (r->weight_bufs[i]) {
            loom_device *d = loom_runner_weight_device(r, i);
            d->ops.buffer_free(d->be, r->weight_bufs[i]);
        }
    for (uint64_t i = 0; r->prep && i < r->gguf->n_tensors; i++)
        if (r->prep[i] == PREP_DONE) {
            loom_device *d = loom_runner_weight_device(r, i);
            d->ops.buffer_free(d->be, r->prepared[i].buf);
        }
    if (r->weights_map)
        ops->buffer_free(r->dev->be, r->weights_map);
    if (r->experts_map)
        r->opt.experts->ops.buffer_free(r->opt.experts->be, r->experts_map);
    if (r->kv)
        ops->buffer_free(r->dev->be, r->kv);
    if (r->in_buf)
        ops->buffer_free(r->dev->be, r->in_buf);
    for (int i = 0; i < r->n_constants; i++)
        ops->buffer_free(r->dev->be, r->constants[i].buf);
    free(r->weights), free(r->weight_bufs), free(r->weight_ready), free(r->prepared), free(r->prep);
    free(r->kc), free(r->vc), free(r->logits), free(r->hidden), free(r->in_host),
        free(r->eval_host);
    free(r->handoff);
    free(r);
}

const loom_hparams *loom_runner_hparams(const loom_runner *r)
{
    return &r->hp;
}

int32_t loom_runner_n_ctx(const loom_runner *r)
{
    return r->opt.n_ctx;
}

const float *loom_runner_logits(const loom_runner *r)
{
    return r->logits;
}

const float *loom_runner_hidden(const loom_runner *r)
{
    return r->hidden;
}

int32_t loom_runner_prefix_len(const loom_runner *r, const int32_t *ids, int32_t n)
{
    return r->arch->prefix_len ? r->arch->prefix_len(r->state, ids, n) : 0;
}

int loom_runner_has_prefix(const loom_runner *r)
{
    return r->arch->prefix_len != NULL;
}

int32_t loom_runner_kv_blocks(const loom_runner *r)
{
    return r->n_blocks;
}

int32_t loom_runner_block_size(const loom_runner *r)
{
    return r->opt.block_size;
}

loom_dtype loom_runner_kv_type(const loom_runner *r)
{
    return r->opt.kv_type;
}

int loom_runner_is_stage(const loom_runner *r)
{
    return r->opt.link != NULL;
}

uint64_t loom_runner_block_bytes(const loom_runner *r)
{
    return r->kv_block * (r->hp.kv_values_in_keys ? 1 : 2) * (uint64_t)r->n_kv_layers;
}

int loom_runner_copy_blocks(loom_runner *r, const loom_kvcopy *copies, int n, char *err,
                            size_t err_size)
{
    const loom_backend_ops *ops = &r->dev->ops;
    const loom_stage_link *ln = r->opt.link;
    if (ln && ln->announce_copy && n && ln->announce_copy(ln->ctx, copies, n, err, err_size) != 0)
        return -1;
    if (!r->n_kv_layers) /* a stage of the head alone has no cache */
        return 0;
    uint64_t block = r->kv_block;
    /* copy_buffer is optional: without it, through host memory */
    unsigned char *staging = ops->copy_buffer || !n ? NULL : malloc((size_t)block);
    if (!ops->copy_buffer && n && !staging) {
        snprintf(err, err_size, "out of memory");
        return -1;
    }
    for (int i = 0; i < n; i++)
        for (int l = r->layer0; l < r->layer_end; l++)
            for (int kv = 0; kv < (r->hp.kv_values_in_keys ? 1 : 2); kv++) {
                const loom_tensor *c = kv ? &r->vc[l] : &r->kc[l];
                if (!c->buf) /* a recurrent layer */
                    continue;
                assert(c->nb[3] == block);
                uint64_t src = c->offset + (uint64_t)copies[i].src * block;
                uint64_t dst = c->offset + (uint64_t)copies[i].dst * block;
                loom_status st = ops->copy_buffer
                    ? ops->copy_buffer(r->dev->be, r->kv, dst, r->kv, src, block)
                    : ops->copy_to_host(r->dev->be, staging, r->kv, src, block);
                if (st == LOOM_OK && !ops->copy_buffer)
                    st = ops->copy_from_host(r->dev->be, r->kv, dst, staging, block);
                if (st != LOOM_OK) {
                    snprintf(err, err_size, "copying KV block %d to %d on %s: %s", copies[i].src,
                             copies[i].dst, r->dev->name, ops->last_error(r->dev->be));
                    free(staging);
                    return -1;
                }
            }
    free(staging);
    return 0;
}

int loom_runner_block_io(loom_runner *r, int32_t block, void *host, int to_host, char *err,
                         size_t err_size)
{
    const loom_backend_ops *ops = &r->dev->ops;
    uint64_t size = r->kv_block;
    unsigned char *at = host;
    for (int l = r->layer0; l < r->layer_end; l++)
        for (int kv = 0; kv < (r->hp.kv_values_in_keys ? 1 : 2); kv++) {
            const loom_tensor *c = kv ? &r->vc[l] : &r->kc[l];
            if (!c->buf) /* a recurrent layer */
                continue;
            assert(c->nb[3] == size);
            uint64_t off = c->offset + (uint64_t)block * size;
            loom_status st = to_host ? ops->copy_to_host(r->dev->be, at, r->kv, off, size)
                                     : ops->copy_from_host(r->dev->be, r->kv, off, at, size);
            if (st != LOOM_OK) {
                snprintf(err, err_size, "%s KV block %d on %s: %s", to_host ? "reading" : "writing",
                         block, r->dev->name, ops->last_error(r->dev->be));
                return -1;
            }
            at += size;
        }
    return 0;
}

/* Makes the input buffer (device) and its host staging area hold n int32s. */
static int inputs_reserve(loom_runner *r, uint64_t n)
{
    if (n <= r->in_cap)
        return 0;
    uint64_t cap = n < 1024 ? 1024 : n + n / 2;
    int32_t *host = realloc(r->in_host, cap * sizeof *host);
    if (!host)
        return loom_runner_fail(r, "out of memory");
    r->in_host = host;
    if (r->in_buf)
        r->dev->ops.buffer_free(r->dev->be, r->in_buf);
    r->in_buf = NULL;
    r->in_cap = 0;
    if (r->dev->ops.buffer_alloc(r->dev->be, cap * 4, &r->in_buf) != LOOM_OK)
        return loom_runner_fail(r, "out of memory on %s for the step's inputs: %s", r->dev->name,
                                r->dev->ops.last_error(r->dev->be));
    r->in_cap = cap;
    return 0;
}

static int check_step(const loom_runner *r, const loom_step *s, char *err, size_t err_size)
{
    const int32_t n = s->n_tokens;
    if (n <= 0 || s->n_seqs <= 0 || s->max_blocks <= 0 || s->n_logits < 0 || s->n_logits > n) {
        snprintf(err, err_size, "an empty or malformed step (%d tokens, %d sequences, %d logits)",
                 n, s->n_seqs, s->n_logits);
        return -1;
    }
    for (int32_t t = 0; t < n; t++) {
        const char *bad = NULL;
        if (s->ids[t] < 0 || s->ids[t] >= r->hp.n_vocab)
            bad = "token id outside the vocabulary";
        else if (s->seq[t] < 0 || s->seq[t] >= s->n_seqs)
            bad = "sequence index outside the block table";
        else if (s->pos[t] < 0 || s->pos[t] >= s->max_blocks * r->opt.block_size)
            bad = "position beyond the block table";
        else if (s->slots[t] < 0 || s->slots[t] >= r->n_blocks * r->opt.block_size)
            bad = "KV slot outside the cache";
        if (bad) {
            snprintf(err, err_size, "step token %d: %s (id %d, seq %d, pos %d, slot %d)", t, bad,
                     s->ids[t], s->seq[t], s->pos[t], s->slots[t]);
            return -1;
        }
    }
    for (int32_t i = 0; i < s->n_logits; i++)
        if (s->logit_rows[i] < 0 || s->logit_rows[i] >= n) {
            snprintf(err, err_size, "logit row %d is not a token of the step", s->logit_rows[i]);
            return -1;
        }
    if (s->n_hidden < 0 || s->n_hidden > n) {
        snprintf(err, err_size, "a malformed step (%d hidden rows of %d tokens)", s->n_hidden, n);
        return -1;
    }
    if (s->n_hidden && r->opt.link) {
        snprintf(err, err_size,
                 "hidden states (embeddings) are not available from a pipeline "
                 "of stages; run the model in one process");
        return -1;
    }
    for (int32_t i = 0; i < s->n_hidden; i++)
        if (s->hidden_rows[i] < 0 || s->hidden_rows[i] >= n) {
            snprintf(err, err_size, "hidden row %d is not a token of the step", s->hidden_rows[i]);
            return -1;
        }
    if (!s->hidden_in != !r->opt.mtp) {
        snprintf(err, err_size,
                 r->opt.mtp ? "a multi-token-prediction step needs the model's hidden states "
                              "beside its tokens"
                            : "hidden states given to a runner that is not a multi-token-"
                              "prediction drafter");
        return -1;
    }
    return 0;
}

/* see runner_internal.h */
void loom_runner_execute(loom_runner *r, const loom_step *s)
{
    const loom_backend_ops *ops = &r->dev->ops;
    const int32_t n = s->n_tokens;
    uint64_t table = (uint64_t)s->n_seqs * (uint64_t)s->max_blocks;
    uint64_t n_prefix = s->prefix_len ? (uint64_t)s->n_seqs : 0;
    uint64_t n_hidden = (uint64_t)s->n_hidden;
    uint64_t n_slots = r->n_state_slots ? (uint64_t)n : 0;
    uint64_t total = 4 * (uint64_t)n + table + (uint64_t)s->n_logits + n_prefix + n_hidden +
        n_slots;
    /* an MTP runner's hidden states follow the integers, 4 bytes each as well */
    const uint64_t n_hidden_in = s->hidden_in ? (uint64_t)n * (uint64_t)r->hp.n_embd : 0;
    if (loom_recurrent_begin(r, s) == 0 && inputs_reserve(r, total + n_hidden_in) == 0) {
        int32_t *h = r->in_host;
        memcpy(h, s->ids, (size_t)n * 4);
        memcpy(h + n, s->pos, (size_t)n * 4);
        memcpy(h + 2 * n, s->slots, (size_t)n * 4);
        memcpy(h + 3 * n, s->seq, (size_t)n * 4);
        memcpy(h + 4 * n, s->block_table, (size_t)table * 4);
        if (s->n_logits)
            memcpy(h + 4 * n + table, s->logit_rows, (size_t)s->n_logits * 4);
        if (n_prefix)
            memcpy(h + 4 * n + table + s->n_logits, s->prefix_len, (size_t)n_prefix * 4);
        if (n_hidden)
            memcpy(h + 4 * n + table + s->n_logits + n_prefix, s->hidden_rows,
                   (size_t)n_hidden * 4);
        if (n_slots)
            memcpy(h + total - n_slots, r->token_slots, (size_t)n_slots * 4);
        if (n_hidden_in)
            memcpy(h + total, s->hidden_in, (size_t)n_hidden_in * 4);
        if (ops->copy_from_host(r->dev->be, r->in_buf, 0, h, (total + n_hidden_in) * 4) != LOOM_OK)
            loom_runner_fail(r, "uploading the step's inputs: %s", ops->last_error(r->dev->be));
    }
    r->in.ids = loom_runner_dense(r->in_buf, 0, LOOM_I32, n, 1, 1, 1);
    r->in.pos = loom_runner_dense(r->in_buf, (uint64_t)n * 4, LOOM_I32, n, 1, 1, 1);
    r->in.slots = loom_runner_dense(r->in_buf, (uint64_t)(2 * n) * 4, LOOM_I32, n, 1, 1, 1);
    r->in.seq = loom_runner_dense(r->in_buf, (uint64_t)(3 * n) * 4, LOOM_I32, n, 1, 1, 1);
    r->in.block_table = loom_runner_dense(r->in_buf, (uint64_t)(4 * n) * 4, LOOM_I32, s->max_blocks,
                                          s->n_seqs, 1, 1);
    r->in.logit_rows = loom_runner_dense(r->in_buf, (uint64_t)(4 * n + table) * 4, LOOM_I32,
                                         s->n_logits ? s->n_logits : 1, 1, 1, 1);
    r->has_prefix = n_prefix > 0;
    if (n_prefix)
        r->in.prefix_len = loom_runner_dense(r->in_buf,
                                             (uint64_t)(4 * n + table + (uint64_t)s->n_logits) * 4,
                                             LOOM_I32, s->n_seqs, 1, 1, 1);
    if (n_hidden)
        r->in.hidden_rows = loom_runner_dense(
            r->in_buf, (uint64_t)(4 * n + table + (uint64_t)s->n_logits + n_prefix) * 4, LOOM_I32,
            s->n_hidden, 1, 1, 1);
    if (n_slots)
        r->in.state_slots = loom_runner_dense(r->in_buf, (total - n_slots) * 4, LOOM_I32, n, 1, 1,
                                              1);
    if (n_hidden_in)
        r->in.hidden_in = loom_runner_dense(r->in_buf, total * 4, LOOM_F32, r->hp.n_embd, n, 1, 1);
    r->n_scratch_used = 0;
    r->has_logits = r->has_hidden = 0;
    loom_batch b = {n, s->n_logits, s->pos, s->seq, s->prefix_len, s->n_hidden};
    /* a forward pass that stops early without saying why (out of host memory) still fails
     * the step, in its own words rather than as "no logits" */
    if (!r->status && r->arch->forward(r, r->state, &b) != 0 && !r->status)
        loom_runner_fail(r, "%s: the forward pass stopped (out of host memory?)", r->arch->name);
    loom_recurrent_end(r, s, !r->status);
    if (!r->status && s->n_logits && loom_runner_is_last_stage(r)) {
        if (!r->has_logits)
            loom_runner_fail(r, "the model produced no logits");
        else if (ops->synchronize(r->dev->be) != LOOM_OK ||
                 ops->copy_to_host(r->dev->be, r->logits, r->logits_src.buf, r->logits_src.offset,
                                   (uint64_t)s->n_logits * (uint64_t)r->hp.n_vocab * 4) != LOOM_OK)
            loom_runner_fail(r, "reading the logits back: %s", ops->last_error(r->dev->be));
        for (uint64_t i = 0, n_out = (uint64_t)s->n_logits * (uint64_t)r->hp.n_vocab;
             !r->status && !r->census && i < n_out; i++)
            if (!isfinite(r->logits[i]))
                loom_runner_fail(
                    r,
                    "the model's logits are not finite (%g for token %llu of position %d): its "
                    "weights or hyper-parameters are broken ('loom verify FILE' checks them)",
                    (double)r->logits[i], (unsigned long long)(i % (uint64_t)r->hp.n_vocab),
                    s->pos[s->logit_rows[i / (uint64_t)r->hp.n_vocab]]);
    }
    if (!r->status && s->n_hidden) {
        uint64_t n_out = (uint64_t)s->n_hidden * (uint64_t)r->hp.n_embd;
        if (!r->has_hidden)
            loom_runner_fail(r, "the model produced no hidden states");
        else if (ops->synchronize(r->dev->be) != LOOM_OK ||
                 ops->copy_to_host(r->dev->be, r->hidden, r->hidden_src.buf, r->hidden_src.offset,
                                   n_out * 4) != LOOM_OK)
            loom_runner_fail(r, "reading the hidden states back: %s", ops->last_error(r->dev->be));
        for (uint64_t i = 0; !r->status && !r->census && i < n_out; i++)
            if (!isfinite(r->hidden[i]))
                loom_runner_fail(r,
                                 "the model's final hidden state is not finite (%g at position "
                                 "%d): its weights or hyper-parameters are broken ('loom verify "
                                 "FILE' checks them)",
                                 (double)r->hidden[i],
                                 s->pos[s->hidden_rows[i / (uint64_t)r->hp.n_embd]]);
    }
}


int loom_runner_step(loom_runner *r, const loom_step *s, char *err, size_t err_size)
{
    r->status = 0;
    if (check_step(r, s, err, err_size) != 0)
        return -1;
    if (s->n_logits > r->logits_cap) {
        float *lg = realloc(r->logits, (size_t)s->n_logits * (size_t)r->hp.n_vocab * sizeof *lg);
        if (!lg) {
            snprintf(err, err_size, "out of memory");
            return -1;
        }
        r->logits = lg, r->logits_cap = s->n_logits;
    }
    if (s->n_hidden > r->hidden_cap) {
        float *h = realloc(r->hidden, (size_t)s->n_hidden * (size_t)r->hp.n_embd * sizeof *h);
        if (!h) {
            snprintf(err, err_size, "out of memory");
            return -1;
        }
        r->hidden = h, r->hidden_cap = s->n_hidden;
    }
    if (r->opt.link)
        loom_stage_step(r, s);
    else
        loom_runner_execute(r, s);
    if (r->status) {
        snprintf(err, err_size, "%s", r->err);
        return -1;
    }
    return 0;
}

/* loom_runner_eval, loom_runner_eval_all, loom_runner_eval_hidden and loom_runner_eval_mtp: out
 * NULL keeps the last token's logits only; with rows, hidden states instead of logits (every
 * token's, or the last's); hidden_in: an MTP runner's second input. A runner followed
 * (loom_runner_follow) hands on every token's hidden state as well. */
static int eval(loom_runner *r, const int32_t *ids, const float *hidden_in, int32_t n, int32_t pos0,
                float *out, loom_rows_fn rows, void *user, int every_row, char *err,
                size_t err_size)
{
    if (n <= 0) {
        snprintf(err, err_size, "nothing to evaluate");
        return -1;
    }
    if ((int64_t)pos0 + n > r->opt.n_ctx) {
        snprintf(err, err_size, "%d tokens at position %d do not fit the context of %d tokens", n,
                 pos0, r->opt.n_ctx);
        return -1;
    }
    int32_t bs = r->opt.block_size, n_table = (r->opt.n_ctx + bs - 1) / bs;
    if (n_table > r->n_blocks) {
        snprintf(err, err_size,
                 "the KV cache has %d blocks, fewer than one %d-token sequence needs", r->n_blocks,
                 r->opt.n_ctx);
        return -1;
    }
    int32_t nb = r->opt.n_batch;
    if (!r->eval_host) { /* once per runner: decoding calls this for every token */
        if (!(r->eval_host = malloc((size_t)(4 * nb + n_table) * sizeof *r->eval_host))) {
            snprintf(err, err_size, "out of memory");
            return -1;
        }
        for (int32_t i = 0; i < n_table; i++)
            r->eval_host[4 * nb + i] = i; /* one sequence over blocks 0, 1, 2... */
        for (int32_t i = 0; i < nb; i++)
            r->eval_host[3 * nb + i] = i; /* every row's logits, for eval_all */
    }
    int32_t *pos = r->eval_host, *seq = pos + nb, *slots = seq + nb, *every = slots + nb,
            *table = every + nb;
    /* every position's logits cost n_vocab floats each on the host: smaller batches then */
    if (out && nb > 64)
        nb = 64;
    if (pos0 == 0)
        r->seq_prefix_len = loom_runner_prefix_len(r, ids, n);
    int rc = 0;
    for (int32_t c0 = 0; c0 < n && rc == 0; c0 += nb) {
        int32_t m = n - c0 < nb ? n - c0 : nb;
        for (int32_t i = 0; i < m; i++) {
            pos[i] = slots[i] = pos0 + c0 + i;
            seq[i] = 0;
        }
        int32_t last = m - 1, ends = c0 + m == n;
        const int follow = r->follow && !rows;
        int32_t n_hidden = follow ? m : !rows ? 0 : every_row ? m : ends;
        loom_step st = {m,
                        ids + c0,
                        pos,
                        seq,
                        slots,
                        1,
                        n_table,
                        table,
                        out        ? m
                            : rows ? 0
                            : ends ? 1
                                   : 0,
                        out ? every : &last,
                        r->seq_prefix_len ? &r->seq_prefix_len : NULL,
                        n_hidden,
                        every_row || follow ? every : &last,
                        NULL,
                        hidden_in ? hidden_in + (size_t)c0 * (size_t)r->hp.n_embd : NULL};
        rc = loom_runner_step(r, &st, err, err_size);
        if (rc == 0 && follow)
            r->follow(r->follow_user, pos0 + c0, loom_runner_hidden(r), m);
        else if (rc == 0 && n_hidden)
            rows(user, loom_runner_hidden(r), n_hidden);
        if (rc == 0 && out && (loom_runner_is_last_stage(r) || r->opt.link->recv_logits))
            memcpy(out + (size_t)c0 * (size_t)r->hp.n_vocab, r->logits,
                   (size_t)m * (size_t)r->hp.n_vocab * sizeof *out);
    }
    return rc;
}

int loom_runner_eval(loom_runner *r, const int32_t *ids, int32_t n, int32_t pos0, char *err,
                     size_t err_size)
{
    return eval(r, ids, NULL, n, pos0, NULL, NULL, NULL, 0, err, err_size);
}

int loom_runner_eval_mtp(loom_runner *r, const int32_t *ids, const float *hidden, int32_t n,
                         int32_t pos0, char *err, size_t err_size)
{
    return eval(r, ids, hidden, n, pos0, NULL, NULL, NULL, 0, err, err_size);
}

void loom_runner_follow(loom_runner *r, loom_rows_at_fn fn, void *user)
{
    assert(!fn || !r->opt.link);
    r->follow = fn, r->follow_user = user;
}

int loom_rt_mtp(const loom_runner *r)
{
    return r->opt.mtp;
}

int loom_runner_eval_all(loom_runner *r, const int32_t *ids, int32_t n, int32_t pos0, float *out,
                         char *err, size_t err_size)
{
    return eval(r, ids, NULL, n, pos0, out, NULL, NULL, 0, err, err_size);
}

int loom_runner_eval_hidden(loom_runner *r, const int32_t *ids, int32_t n, int every_row,
                            loom_rows_fn rows, void *user, char *err, size_t err_size)
{
    if (r->opt.link) {
        snprintf(err, err_size, "hidden states are not kept on a pipeline of stages");
        return -1;
    }
    return eval(r, ids, NULL, n, 0, NULL, rows, user, every_row, err, err_size);
}
