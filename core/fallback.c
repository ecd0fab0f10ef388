/*
 * core/fallback.c - see fallback.h.
 */
#include "fallback.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_OP_TENSORS 12

typedef struct kept_copy {
    const loom_buffer *buf;
    uint64_t offset, extent;
    loom_buffer *copy;
} kept_copy;

struct loom_fallback {
    loom_device *main;
    loom_loader_options loader;
    loom_device dev; /* opened on first use */
    int opened;
    loom_device *placed;                /* loom_fallback_on's device, instead of dev */
    loom_fallback_constant_fn resident; /* loom_fallback_on's buffers of placed */
    loom_fallback_constant_fn constant;
    void *ctx;
    kept_copy *kept;
    int n_kept, cap_kept;
    unsigned char warned[LOOM_OP_COUNT][32];
};

loom_fallback *loom_fallback_new(loom_device *main, const loom_loader_options *loader,
                                 loom_fallback_constant_fn constant, void *ctx)
{
    loom_fallback *fb = calloc(1, sizeof *fb);
    if (fb) {
        fb->main = main;
        if (loader)
            fb->loader = *loader;
        fb->constant = constant;
        fb->ctx = ctx;
    }
    return fb;
}

loom_fallback *loom_fallback_on(loom_device *main, loom_device *dev,
                                loom_fallback_constant_fn resident, void *ctx)
{
    loom_fallback *fb = calloc(1, sizeof *fb);
    if (fb) {
        fb->main = main;
        fb->placed = dev;
        fb->resident = resident;
        fb->ctx = ctx;
    }
    return fb;
}

/* The device ops run on. */
static loom_device *target(loom_fallback *fb)
{
    return fb->placed ? fb->placed : &fb->dev;
}

void loom_fallback_free(loom_fallback *fb)
{
    if (!fb)
        return;
    loom_device *f = target(fb);
    for (int i = 0; i < fb->n_kept; i++)
        f->ops.buffer_free(f->be, fb->kept[i].copy);
    free(fb->kept);
    if (fb->opened)
        loom_device_close(&fb->dev);
    free(fb);
}

/* The best usable CPU variant, or ref when the main device is a CPU variant already. */
static int open_device(loom_fallback *fb, char *err, size_t err_size)
{
    loom_registry reg;
    if (loom_registry_scan(&reg, &fb->loader, err, err_size) != 0) {
        loom_registry_free(&reg);
        return -1;
    }
    const char *want = strcmp(fb->main->name, "cpu") == 0 ? "ref" : "cpu";
    int best = -1;
    for (int i = 0; i < reg.count; i++) {
        const loom_candidate *c = &reg.items[i];
        if (c->probe.score > 0 && c->probe.n_devices > 0 && strcmp(c->name, want) == 0 &&
            (best < 0 || c->probe.score > reg.items[best].probe.score))
            best = i;
    }
    int rc = -1;
    if (best < 0)
        snprintf(err, err_size, "no usable '%s' backend to fall back to", want);
    else
        rc = loom_device_open(&fb->dev, reg.items[best].path, 0, 0, err, err_size);
    loom_registry_free(&reg);
    fb->opened = rc == 0;
    return rc;
}

/* The tensor pointers of an op's parameter struct, and which of them the op writes. */
static int op_tensors(loom_op op, void *parameters, const loom_tensor **slots[], int written[])
{
    int n = 0;
    switch (op) {
#define IN(field) written[n] = 0, slots[n++] = &p->field;
#define OUT(field) written[n] = 1, slots[n++] = &p->field;
#define TENSORS(id, name, params)                                                                  \
    case LOOM_OP_##id: {                                                                           \
        params *p = parameters;                                                                    \
        LOOM_TENSORS_##params(IN, OUT) break;                                                      \
    }
        LOOM_OPS(TENSORS)
#undef TENSORS
#undef IN
#undef OUT
    default: return -1;
    }
    return n;
}

/* Copies bytes [offset, offset + extent) of a main-device buffer into a new fallback buffer. */
static loom_buffer *copy_over(loom_fallback *fb, const loom_tensor *t, uint64_t extent, char *err,
                              size_t err_size)
{
    loom_device *m = fb->main, *f = target(fb);
    void *host = malloc(extent);
    loom_buffer *copy = NULL;
    if (!host) {
        snprintf(err, err_size, "fallback: out of host memory for %llu bytes",
                 (unsigned long long)extent);
        return NULL;
    }
    if (m->ops.copy_to_host(m->be, host, t->buf, t->offset, extent) != LOOM_OK)
        snprintf(err, err_size, "fallback: reading from %s: %s", m->name, m->ops.last_error(m->be));
    else if (f->ops.buffer_alloc(f->be, extent, &copy) != LOOM_OK ||
             f->ops.copy_from_host(f->be, copy, 0, host, extent) != LOOM_OK) {
        snprintf(err, err_size, "fallback: %s: %s", f->name, f->ops.last_error(f->be));
        if (copy)
            f->ops.buffer_free(f->be, copy);
        copy = NULL;
    }
    free(host);
    return copy;
}

static loom_buffer *kept_or_copy(loom_fallback *fb, const loom_tensor *t, uint64_t extent,
                                 int *temporary, char *err, size_t err_size)
{
    *temporary = !fb->constant || !fb->constant(fb->ctx, t->buf);
    if (*temporary)
        return copy_over(fb, t, extent, err, err_size);
    for (int i = 0; i < fb->n_kept; i++)
        if (fb->kept[i].buf == t->buf && fb->kept[i].offset == t->offset &&
            fb->kept[i].extent == extent)
            return fb->kept[i].copy;
    if (fb->n_kept == fb->cap_kept) {
        int cap = fb->cap_kept ? 2 * fb->cap_kept : 16;
        kept_copy *grown = realloc(fb->kept, (size_t)cap * sizeof *grown);
        if (!grown) {
            snprintf(err, err_size, "fallback: out of memory");
            return NULL;
        }
        fb->kept = grown;
        fb->cap_kept = cap;
    }
    loom_buffer *copy = copy_over(fb, t, extent, err, err_size);
    if (copy)
        fb->kept[fb->n_kept++] = (kept_copy){t->buf, t->offset, extent, copy};
    return copy;
}

int loom_fallback_run(loom_fallback *fb, loom_op op, loom_dtype dtype, void *params,
                      const char *what, char *err, size_t err_size)
{
    const loom_tensor **slots[MAX_OP_TENSORS];
    int written[MAX_OP_TENSORS], n = op_tensors(op, params, slots, written);
    if (n < 0) {
        snprintf(err, err_size, "fallback: op %d unknown", (int)op);
        return -1;
    }
    if (!fb->placed && !fb->opened && open_device(fb, err, err_size) != 0)
        return -1;
    loom_device *m = fb->main, *f = target(fb);
    if (!fb->placed && !fb->warned[op][dtype & 31]) {
        fb->warned[op][dtype & 31] = 1;
        fprintf(stderr,
                "loom: %s%s%s does not support %s with %s; running it on %s%s%s instead "
                "(its tensors are copied there and back each time; LOOM_STRICT=1 refuses)\n",
                m->name, m->variant[0] ? "-" : "", m->variant, what, loom_dtype_name(dtype),
                f->name, f->variant[0] ? "-" : "", f->variant);
    }
    loom_tensor copies[MAX_OP_TENSORS];
    int temporary[MAX_OP_TENSORS] = {0};
    const loom_tensor *original[MAX_OP_TENSORS];
    for (int i = 0; i < n; i++)
        original[i] = *slots[i];
    int rc = 0;
    for (int i = 0; i < n; i++) {
        const loom_tensor *t = *slots[i];
        uint64_t extent = t ? loom_tensor_extent(t) : 0;
        if (!t || extent == 0)
            continue;
        if (extent == UINT64_MAX) {
            snprintf(err, err_size, "fallback: %s: malformed tensor", what);
            rc = -1;
            break;
        }
        copies[i] = *t;
        if (fb->resident && fb->resident(fb->ctx, t->buf)) { /* already f's */
            *slots[i] = &copies[i];
            continue;
        }
        copies[i].offset = 0;
        copies[i].buf = kept_or_copy(fb, t, extent, &temporary[i], err, err_size);
        if (!copies[i].buf) {
            rc = -1;
            break;
        }
        *slots[i] = &copies[i];
    }
    if (rc == 0 && loom_device_run(f, op, params) != LOOM_OK) {
        snprintf(err, err_size, "%s on %s%s%s (fallback) failed: %s", what, f->name,
                 f->variant[0] ? "-" : "", f->variant, f->ops.last_error(f->be));
        rc = -1;
    }
    for (int i = 0; i < n && rc == 0; i++) {
        const loom_tensor *out = original[i];
        uint64_t out_extent = written[i] && out ? loom_tensor_extent(out) : 0;
        if (out_extent == 0)
            continue;
        void *host = malloc(out_extent);
        if (!host ||
            f->ops.copy_to_host(f->be, host, copies[i].buf, copies[i].offset, out_extent) !=
                LOOM_OK ||
            m->ops.copy_from_host(m->be, out->buf, out->offset, host, out_extent) != LOOM_OK) {
            snprintf(err, err_size, "fallback: copying %s's result back to %s failed", what,
                     m->name);
            rc = -1;
        }
        free(host);
    }
    for (int i = 0; i < n; i++) {
        if (temporary[i] && *slots[i] == &copies[i] && copies[i].buf)
            f->ops.buffer_free(f->be, copies[i].buf);
        *slots[i] = original[i];
    }
    return rc;
}
