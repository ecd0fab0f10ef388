/*
 * tools/conformance.h - what the rooms of `loom-conformance` share: the report (every check's
 * outcome, the op x dtype matrix) and the checks main runs. conformance.c: op cases against ref,
 * the matrix, main; conformance_contract.c: copies, allocation failure, reloading;
 * conformance_model.c: a model's logits step by step against ref's.
 */
#ifndef LOOM_TOOLS_CONFORMANCE_H
#define LOOM_TOOLS_CONFORMANCE_H

#include "api/loader_env.h"
#include "loom/loom.h"

#include <cjson/cJSON.h>

typedef enum { RES_NONE = 0, RES_PASS, RES_FAIL, RES_UNSUPPORTED } result;

/* every dtype; the matrix shows all but the index types, which come last */
#define N_DTYPES                                                                                   \
    ((int)(sizeof(loom_dtype[]){LOOM_WEIGHT_DTYPES(LOOM_DTYPE_ITEM)                                \
                                    LOOM_INDEX_DTYPES(LOOM_DTYPE_ITEM)} /                          \
           sizeof(loom_dtype)))
extern const loom_dtype all_dtypes[N_DTYPES];

typedef struct report {
    cJSON *checks; /* array of {check, status, detail} */
    result matrix[LOOM_OP_COUNT][N_DTYPES];
    int failures;
    int quiet;
} report;

/* Records a check's outcome (printed unless quiet and passed; failures counted). */
void record(report *r, const char *check, int ok, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* conformance_contract.c */
void check_copies(loom_device *d, report *r);
void check_oom(loom_device *d, report *r);
/* Opens module path into d (a decorator around ref_path's module). 0, or -1 with err. */
int open_target(loom_device *d, const char *path, uint32_t kind, const char *ref_path, char *err,
                size_t err_size);
void check_reload(const char *path, uint32_t kind, const char *ref_path, report *r);

/* conformance_model.c: a short prefill, then MODEL_STEPS greedy steps */
#define MODEL_STEPS 12
void check_model(const char *module, const char *ref_path, const char *model, const char *kv_type,
                 report *r);

#endif
