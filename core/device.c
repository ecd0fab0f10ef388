/*
 * core/device.c - opening a module's device (loading the file again and keeping it loaded) and
 * calling its ops through the host copy of its table. See loader.h.
 */
#include "loader_internal.h"

#include <dlfcn.h>
#include <string.h>

/* Copies be's table into ops, zero past its declared size; -1 when a required member is
 * missing. */
static int copy_table(loom_backend_ops *ops, loom_backend *be, const char *path, char *err,
                      size_t err_size)
{
    loader_copy_declared(ops, sizeof *ops, be->ops, be->ops->struct_size);
    if (ops->close && ops->last_error && ops->supports && ops->buffer_alloc && ops->buffer_free &&
        ops->copy_from_host && ops->copy_to_host && ops->synchronize)
        return 0;
    loader_set_err(err, err_size,
                   "%s: its op table lacks a required member (close, last_error, "
                   "supports, buffers, copies or synchronize)",
                   path);
    return -1;
}

int loom_device_open(loom_device *dev, const char *path, int device, int n_threads, char *err,
                     size_t err_size)
{
    memset(dev, 0, sizeof *dev);
    loom_candidate_state state;
    char reason[512];
    dev->handle = loader_load_module(path, &dev->module, &state, reason, sizeof reason);
    if (!dev->handle) {
        loader_set_err(err, err_size, "%s: %s", path, reason);
        return -1;
    }
    loader_copy_str(dev->name, sizeof dev->name, dev->module.name);
    loader_copy_str(dev->variant, sizeof dev->variant, dev->module.variant);
    dev->device = device;
    loom_backend_options opts = {
        .struct_size = sizeof opts, .device = device, .n_threads = n_threads};
    char msg[512] = "";
    loom_status st = dev->module.open(&opts, &dev->be, msg, sizeof msg);
    if (st != LOOM_OK || !dev->be || !dev->be->ops) {
        loader_set_err(err, err_size, "%s: cannot open device %d: %s", path, device,
                       msg[0] ? msg : "open failed without a message");
        dlclose(dev->handle);
        memset(dev, 0, sizeof *dev);
        return -1;
    }
    if (copy_table(&dev->ops, dev->be, path, err, err_size) != 0) {
        if (dev->ops.close)
            dev->ops.close(dev->be);
        dlclose(dev->handle);
        memset(dev, 0, sizeof *dev);
        return -1;
    }
    return 0;
}

int loom_device_decorate(loom_device *dev, const char *path, const char *config, char *err,
                         size_t err_size)
{
    loom_backend_module mod;
    loom_candidate_state state;
    char reason[512];
    void *h = loader_load_module(path, &mod, &state, reason, sizeof reason);
    if (!h) {
        loader_set_err(err, err_size, "%s: %s", path, reason);
        loom_device_close(dev);
        return -1;
    }
    if (mod.kind != LOOM_MODULE_DECORATOR) {
        loader_set_err(err, err_size, "%s: %s is a backend, not a decorator", path, mod.name);
        dlclose(h);
        loom_device_close(dev);
        return -1;
    }
    loom_backend_options opts = {
        .struct_size = sizeof opts, .device = dev->device, .inner = dev->be, .config = config};
    loom_backend *be = NULL;
    char msg[512] = "";
    loom_status st = mod.open(&opts, &be, msg, sizeof msg);
    if (st != LOOM_OK || !be || !be->ops) {
        loader_set_err(err, err_size, "%s: cannot wrap %s: %s", path, dev->name,
                       msg[0] ? msg : "open failed without a message");
        dlclose(h);
        loom_device_close(dev);
        return -1;
    }
    /* from here the decorator owns the backend: a failure closes both */
    dev->be = be;
    dev->decorator_handle = h;
    loader_copy_str(dev->decorator, sizeof dev->decorator, mod.name);
    if (copy_table(&dev->ops, be, path, err, err_size) != 0) {
        if (!dev->ops.close)
            dev->be = NULL; /* cannot close it: leak it rather than call a hole */
        loom_device_close(dev);
        return -1;
    }
    return 0;
}

int loom_device_open_chosen(loom_device *dev, const loom_registry *reg, int n_threads, char *err,
                            size_t err_size)
{
    if (reg->chosen < 0) {
        loader_set_err(err, err_size, "no backend was chosen");
        return -1;
    }
    return loom_device_open(dev, reg->items[reg->chosen].path, reg->chosen_device, n_threads, err,
                            err_size);
}

void loom_device_close(loom_device *dev)
{
    if (dev->be)
        dev->ops.close(dev->be); /* a decorator's close closes the backend it wraps */
    if (dev->decorator_handle)
        dlclose(dev->decorator_handle);
    if (dev->handle)
        dlclose(dev->handle);
    memset(dev, 0, sizeof *dev);
}

/* Whether the module's table (host copy, zero past its declared size) has the op. */
int loom_device_op_present(const loom_device *dev, loom_op op)
{
    const loom_backend_ops *o = &dev->ops;
    switch (op) {
#define PRESENT(id, name, params)                                                                  \
    case LOOM_OP_##id: return o->name != NULL;
        LOOM_OPS(PRESENT)
#undef PRESENT
    case LOOM_OP_COUNT: break;
    }
    return 0;
}

int loom_device_supports(const loom_device *dev, loom_op op, loom_dtype dtype)
{
    return loom_device_op_present(dev, op) && dev->ops.supports(dev->be, op, dtype);
}

loom_status loom_device_run(const loom_device *d, loom_op op, const void *p)
{
    const loom_backend_ops *o = &d->ops;
    switch (op) {
#define RUN(id, name, params)                                                                      \
    case LOOM_OP_##id: return o->name(d->be, (const params *)p);
        LOOM_OPS(RUN)
#undef RUN
    default: return LOOM_ERR_UNSUPPORTED;
    }
}
