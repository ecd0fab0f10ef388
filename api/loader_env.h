/*
 * api/loader_env.h - the loader's options (core/loader.h) from the LOOM_* environment: what
 * loom_model_open and the tools that work at the ABI level pass to the core, which reads no
 * environment itself.
 */
#ifndef LOOM_API_LOADER_ENV_H
#define LOOM_API_LOADER_ENV_H

#include "core/loader.h"

/* LOOM_BACKEND_PATH, LOOM_CPU_VARIANT, LOOM_CPU_MAX_ISA, LOOM_EXPLAIN (set and not "0"),
 * LOOM_PROBE_TIMEOUT (seconds, 1 to 3600; another value: the default) and
 * LOOM_PROBE_ISOLATION=0. The strings point into the environment. */
loom_loader_options loom_loader_options_from_env(void);

/* LOOM_BACKEND, or NULL when unset or empty. */
const char *loom_backend_preference_from_env(void);

#endif
