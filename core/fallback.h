/*
 * core/fallback.h - running an op the chosen backend lacks on a CPU backend instead.
 *
 * A third-party backend may leave ops or dtypes out (`supports` says which). Rather than
 * refuse the model, the runner sends those ops here: the op's tensors are copied from the main
 * device into buffers of a CPU backend (the best CPU variant, or ref when the main device is
 * itself a CPU), the op runs there, and its output is copied back. Slow, and said so once per
 * op and dtype on stderr; LOOM_STRICT=1 makes the runner refuse instead. Tensors the caller
 * marks constant (weights) are copied once and kept.
 */
#ifndef LOOM_CORE_FALLBACK_H
#define LOOM_CORE_FALLBACK_H

#include "loader.h"

typedef struct loom_fallback loom_fallback;

/* Whether buf holds data that never changes (weights), so its copies may be kept. */
typedef int (*loom_fallback_constant_fn)(void *ctx, const loom_buffer *buf);

/* loader: where the fallback module is found (NULL: the defaults). */
loom_fallback *loom_fallback_new(loom_device *main, const loom_loader_options *loader,
                                 loom_fallback_constant_fn constant, void *ctx);
/* The same machinery for ops placed on a second device on purpose (the experts' matmuls on
 * loom_runner_options.experts): it runs them on dev (the caller's: never closed here), the
 * tensors whose buffers resident(ctx, buf) names are dev's own and pass as they are, and it
 * says nothing on stderr. */
loom_fallback *loom_fallback_on(loom_device *main, loom_device *dev,
                                loom_fallback_constant_fn resident, void *ctx);
void loom_fallback_free(loom_fallback *fb);

/* Runs op with the ABI parameter struct params (whose tensors live on the main device) on the
 * fallback device; what and dtype (as given to `supports`) name it in the one-time warning.
 * Returns 0, or -1 with a message in err. */
int loom_fallback_run(loom_fallback *fb, loom_op op, loom_dtype dtype, void *params,
                      const char *what, char *err, size_t err_size);

#endif
