/*
 * core/weights.c - a runner's weights: where each tensor lives (the device, or the experts'
 * device with loom_runner_options.experts_on), expert stacks offered whole to a backend that
 * takes them, a weight's first use uploading or wrapping it (loom_rt_weight), and its prepared
 * form for matmuls (a backend's own layout, made on first use; runner.c's header says how the
 * memory goes).
 */
#define _GNU_SOURCE
#include "runner_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- Weights ------------------------------------------------------------------------------ */

/* r->prep[i]: weight i not yet offered to prepare_weight, in r->prepared[i], or kept as it is */

const loom_gguf *loom_rt_gguf(const loom_runner *r)
{
    return r->gguf;
}

/* an expert stack ([experts, rows, cols], llama.cpp's ffn_{gate,up,down}_exps) */
int loom_runner_on_experts(const loom_runner *r, const loom_gguf_tensor *gt)
{
    return r->opt.experts && gt->n_dims == 3 && strstr(gt->name, "_exps.") != NULL;
}

loom_device *loom_runner_weight_device(const loom_runner *r, uint64_t i)
{
    return loom_runner_on_experts(r, &r->gguf->tensors[i]) ? r->opt.experts : r->dev;
}

/* Whether expert stack i is offered to dev's prepare_weight: a module of ABI 1.6 or later (an
 * older one knows matmul weights only) that runs matmul_id on its type. */
static int offers_stacks(const loom_runner *r, loom_device *dev, const loom_gguf_tensor *gt)
{
    return r->repack && dev->ops.prepare_weight && dev->module.abi_minor >= 6 &&
        loom_device_supports(dev, LOOM_OP_MATMUL_ID, (loom_dtype)gt->type);
}

/* Expert stack i (mapped, in r->weights[i]) in dev's own layout, at load: 1 when prepared (the
 * mapped pages let go), 0 when dev keeps stacks of its type as they are, 2 when memory ran
 * short (it stays mapped), -1 on a failure. */
static int prepare_stack(loom_runner *r, uint64_t i, loom_device *dev)
{
    const loom_gguf_tensor *gt = &r->gguf->tensors[i];
    loom_status st = dev->ops.prepare_weight(dev->be, &r->weights[i], &r->prepared[i]);
    if (st == LOOM_OK) {
        r->prep[i] = PREP_DONE;
        loom_gguf_release_pages(r->gguf, gt->offset, gt->size);
        return 1;
    }
    r->prep[i] = PREP_NONE;
    if (st == LOOM_ERR_UNSUPPORTED)
        return 0;
    if (st == LOOM_ERR_OUT_OF_MEMORY) {
        fprintf(stderr, "loom: no memory to prepare '%s' for %s (%s); it runs from the file\n",
                gt->name, dev->name, dev->ops.last_error(dev->be));
        return 2;
    }
    loom_runner_fail(r, "preparing expert stack '%s' on %s%s%s failed: %s", gt->name, dev->name,
                     dev->variant[0] ? "-" : "", dev->variant, dev->ops.last_error(dev->be));
    return -1;
}

const loom_tensor *loom_rt_weight(loom_runner *r, const char *name, int required)
{
    const loom_gguf_tensor *gt = loom_gguf_find_tensor(r->gguf, name);
    if (!gt) {
        if (required)
            loom_runner_fail(r, "the model file has no tensor '%s'", name);
        return NULL;
    }
    uint64_t i = (uint64_t)(gt - r->gguf->tensors);
    if (r->weight_ready[i])
        return &r->weights[i];
    const loom_stage_link *ln = r->opt.link;
    if ((ln &&
         !loom_runner_stage_holds(r->gguf, r->opt.first_layer, r->opt.end_layer, !!ln->recv,
                                  !!ln->send, name)) ||
        (!ln && r->opt.first_layers > 0 &&
         !loom_runner_stage_holds(r->gguf, 0, r->opt.first_layers, 0, 0, name)) ||
        (r->opt.mtp &&
         !loom_runner_stage_holds(r->gguf, r->hp.n_layer, r->hp.n_layer + r->hp.n_nextn, 0, 0,
                                  name))) {
        /* another stage's, or a layer a drafter skips (an MTP drafter: every one but its own
         * block): its shape, for the model's checks, and no data */
        r->weights[i] = loom_runner_dense(NULL, 0, (loom_dtype)gt->type, gt->ne[0], gt->ne[1],
                                          gt->ne[2], gt->ne[3]);
        r->weights[i].n_dims = (int32_t)gt->n_dims;
        r->weight_ready[i] = 1;
        return &r->weights[i];
    }
    if (loom_dtype_block_elems((loom_dtype)gt->type) == 0 || gt->type == LOOM_I32) {
        loom_runner_fail(r, "tensor '%s' has type %s, which loom's backends do not run", name,
                         loom_ggml_type_name(gt->type));
        return NULL;
    }
    loom_device *dev = loom_runner_weight_device(r, i);
    if (dev != r->dev && !loom_device_supports(dev, LOOM_OP_MATMUL_ID, (loom_dtype)gt->type)) {
        loom_runner_fail(r,
                         "the experts are to go to %s%s%s, which does not run matmul_id with %s "
                         "('%s')",
                         dev->name, dev->variant[0] ? "-" : "", dev->variant,
                         loom_dtype_name((loom_dtype)gt->type), name);
        return NULL;
    }
    const loom_backend_ops *ops = &dev->ops;
    loom_buffer *buf, **map = dev == r->dev ? &r->weights_map : &r->experts_map;
    uint64_t offset;
    /* An expert stack goes into the device's own memory even where the file could be mapped:
     * prepared in its layout at load where the device has one (ABI 1.6), else copied. A decode
     * step reads a few MB of it at scattered places, and through the file's 4 KiB pages each
     * read walks page tables that no cache holds any more, where the device's buffers have
     * huge pages (moe-a2.7b, q8_0, cpu-avx512, measured: matmul_id 410 us a call against
     * 830-1050 mapped, decode 50 against 29-39 tokens/s). Its mapped pages are let go after. */
    int stack = gt->n_dims == 3;
    if (ops->buffer_wrap_host && !*map &&
        ops->buffer_wrap_host(dev->be, (void *)r->gguf->map, r->gguf->size, map) != LOOM_OK)
        *map = NULL;
    if (*map && stack && offers_stacks(r, dev, gt)) {
        r->weights[i] = loom_runner_dense(*map, gt->offset, (loom_dtype)gt->type, gt->ne[0],
                                          gt->ne[1], gt->ne[2], gt->ne[3]);
        r->weights[i].n_dims = (int32_t)gt->n_dims;
        int got = prepare_stack(r, i, dev);
        if (got < 0)
            return NULL;
        if (got > 0) {
            r->weight_ready[i] = 1;
            return &r->weights[i];
        }
    }
    if (*map && !stack) {
        buf = *map;
        offset = gt->offset;
    } else {
        if (ops->buffer_alloc(dev->be, gt->size, &r->weight_bufs[i]) != LOOM_OK ||
            ops->copy_from_host(dev->be, r->weight_bufs[i], 0, loom_gguf_tensor_data(r->gguf, gt),
                                gt->size) != LOOM_OK) {
            loom_runner_fail(r, "uploading '%s' (%llu bytes) to %s: %s", name,
                             (unsigned long long)gt->size, dev->name, ops->last_error(dev->be));
            return NULL;
        }
        buf = r->weight_bufs[i];
        offset = 0;
        loom_gguf_release_pages(r->gguf, gt->offset, gt->size);
    }
    r->weights[i] = loom_runner_dense(buf, offset, (loom_dtype)gt->type, gt->ne[0], gt->ne[1],
                                      gt->ne[2], gt->ne[3]);
    r->weights[i].n_dims = (int32_t)gt->n_dims;
    r->weight_ready[i] = 1;
    return &r->weights[i];
}

/* A weight of another pipeline stage has no data here: using it is the model's mistake. */
int loom_runner_held(loom_runner *r, const loom_tensor *w, const char *what)
{
    if (!w || w->buf || r->status)
        return 1;
    loom_runner_fail(r, "%s: a weight of layers [%d, %d) belongs to another pipeline stage", what,
                     r->layer0, r->layer_end);
    return 0;
}


/* The tensor to pass as matmul's W for weight w: its prepared copy, made on first use, when the
 * backend has a layout of its own for it; else w. Views and non-weights pass through. */
const loom_tensor *loom_runner_matmul_weight(loom_runner *r, const loom_tensor *w)
{
    if (!r->repack || !r->dev->ops.prepare_weight || w < r->weights ||
        w >= r->weights + r->gguf->n_tensors)
        return w;
    uint64_t i = (uint64_t)(w - r->weights);
    if (r->prep[i] == PREP_UNTRIED) {
        r->prep[i] = PREP_NONE;
        if (!loom_device_supports(r->dev, LOOM_OP_MATMUL, w->dtype))
            return w;
        const loom_gguf_tensor *gt = &r->gguf->tensors[i];
        loom_status st = r->dev->ops.prepare_weight(r->dev->be, w, &r->prepared[i]);
        if (st == LOOM_OK) {
            r->prep[i] = PREP_DONE;
            if (w->buf == r->weights_map) /* matmuls no longer read the file's copy */
                loom_gguf_release_pages(r->gguf, gt->offset, gt->size);
        } else if (st == LOOM_ERR_OUT_OF_MEMORY) { /* the rest stay as they are too */
            fprintf(stderr,
                    "loom: no memory to prepare '%s' and later weights for %s (%s); they "
                    "run in the file's layout\n",
                    gt->name, r->dev->name, r->dev->ops.last_error(r->dev->be));
            r->repack = 0;
        } else if (st != LOOM_ERR_UNSUPPORTED) {
            loom_runner_fail(r, "preparing weight '%s' on %s%s%s failed: %s", gt->name,
                             r->dev->name, r->dev->variant[0] ? "-" : "", r->dev->variant,
                             r->dev->ops.last_error(r->dev->be));
        }
    }
    return r->prep[i] == PREP_DONE ? &r->prepared[i] : w;
}

int64_t loom_runner_prepared_weights(const loom_runner *r)
{
    int64_t n = 0;
    for (uint64_t i = 0; i < r->gguf->n_tensors; i++)
        n += r->prep[i] == PREP_DONE;
    return n;
}
