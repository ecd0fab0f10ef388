/*
 * core/loader_internal.h - what the loader's files share (loader.h is its interface): the
 * loader is split by idea, module_scan.c (finding and vetting files), module_policy.c
 * (choosing one), module_report.c (the text and JSON report) and device.c (opening a module's
 * device and calling its ops).
 */
#ifndef LOOM_CORE_LOADER_INTERNAL_H
#define LOOM_CORE_LOADER_INTERNAL_H

#include "loader.h"

#include <stddef.h>
#include <stdint.h>

/* snprintf into err (when not NULL) */
void loader_set_err(char *err, size_t n, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* copies src ("" when NULL), cut to fit */
void loader_copy_str(char *dst, size_t n, const char *src);
/* Copies what a module declared into a zeroed host struct, never reading past its size. */
void loader_copy_declared(void *dst, size_t dst_size, const void *src, uint32_t src_size);
/* dlopens path and checks its entry and ABI. On success returns the handle and the module
 * table copied into *mod; on failure sets state and reason and returns NULL. */
void *loader_load_module(const char *path, loom_backend_module *mod, loom_candidate_state *state,
                         char *reason, size_t reason_size);
/* "name-variant", or the file's name for a module that never said its name */
void loader_label(const loom_candidate *c, char *out, size_t n);
/* Marks usable candidates found again later in the search (same name and variant) excluded. */
void loader_exclude_shadowed(loom_registry *reg);
/* Appends "  name: state (reason)" lines for every candidate to buf. */
void loader_list_candidates(const loom_registry *reg, char *buf, size_t n);

#endif
