/*
 * tests/reference_f64.h - the pieces of the tests' double-precision forward passes (written
 * from Hugging Face's modelling code, the expectation loom's logits are held to): a checkpoint's
 * tensor in double, and a linear layer.
 */
#ifndef LOOM_TESTS_REFERENCE_F64_H
#define LOOM_TESTS_REFERENCE_F64_H

#include "core/safetensors.h"

#include "check.h"

#include <stdio.h>
#include <stdlib.h>

/* The float tensor named fmt (with layer l for its "%d"), in double; *count its elements. */
static inline double *load_f64(const loom_safetensors *st, const char *fmt, int l, int64_t *count)
{
    char name[128];
    snprintf(name, sizeof name, fmt, l);
    const loom_st_tensor *t = loom_safetensors_find(st, name);
    if (!t || t->loom_type < 0) {
        CHECK(0, "no float tensor %s", name);
        return NULL;
    }
    int64_t n = 1;
    for (int i = 0; i < t->n_dims; i++)
        n *= t->shape[i];
    float *f = malloc((size_t)n * sizeof *f);
    double *d = malloc((size_t)n * sizeof *d);
    loom_row_to_f32((loom_dtype)t->loom_type, t->data, f, n);
    for (int64_t i = 0; i < n; i++)
        d[i] = f[i];
    free(f);
    if (count)
        *count = n;
    return d;
}

/* y[rows_out] = W[rows_out, n] x[n] (+ b) */
static inline void linear(double *y, const double *w, const double *b, const double *x, int rows,
                          int n)
{
    for (int r = 0; r < rows; r++) {
        double acc = b ? b[r] : 0;
        for (int i = 0; i < n; i++)
            acc += w[(int64_t)r * n + i] * x[i];
        y[r] = acc;
    }
}

#endif
