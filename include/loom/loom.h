/*
 * loom/loom.h - loom's embedding API: what the loom tools use, and what a program embedding
 * loom links against (-lloom, pkg-config loom).
 *
 * Errors are returned as a status (0 = success) plus a message in a caller-owned buffer.
 */
#ifndef LOOM_LOOM_H
#define LOOM_LOOM_H

#include <stddef.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The library's version, "MAJOR.MINOR.PATCH". */
const char *loom_version(void);

/* Finds every backend module, chooses one as a run would (LOOM_BACKEND, LOOM_CPU_VARIANT,
 * LOOM_CPU_MAX_ISA, scores), and writes the report to out: human-readable, or JSON when json
 * is nonzero. Returns 0 when a backend could be chosen; otherwise -1 with the reason in err
 * (the report is still written). */
int loom_backends_report(FILE *out, int json, char *err, size_t err_size);

/* Describes a model file: architecture, hyper-parameters, tokenizer, chat template and every
 * tensor, after checking that all tensor data lies inside the file. Writes text, or JSON when
 * json is nonzero. Returns 0, or -1 with err saying what is wrong with the file (nothing is
 * written then). */
int loom_inspect(const char *path, FILE *out, int json, char *err, size_t err_size);

#ifdef __cplusplus
}
#endif

#endif
