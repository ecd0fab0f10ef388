/*
 * tools/conformance_model.c - loom-conformance --model: a model's logits on the module, step
 * by step, against ref's.
 */
#define _GNU_SOURCE
#include "conformance.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- Model-level conformance ------------------------------------------------------------- */

/* What op cases can miss shows in a model: a short prefill and greedy decode on the module
 * (ops it lacks fall back to the CPU, as in a run) and on ref, compared step by step. Each
 * step's logits are taken from the same tokens on both (ref's greedy choice fed to both), so
 * one early difference cannot hide the later ones. */
#define MODEL_PROMPT "Once upon a time, there was a little robot who"
/* the worst logit difference allowed, relative to the spread of ref's logits at that step:
 * float accumulation and a backend's int8 activations stay far below it, wrong attention or
 * a lost stride far above */
#define MODEL_TOLERANCE 2e-2

typedef struct model_run {
    loom_model *m;
    int32_t n_vocab;
    float *logits; /* (MODEL_STEPS + 1) x n_vocab: the prompt's last position, then each step */
    int32_t greedy[MODEL_STEPS];
    int n_greedy;
} model_run;

static int collect_greedy(void *user, int32_t id, const char *text, size_t len)
{
    (void)text, (void)len;
    model_run *run = user;
    if (run->n_greedy < MODEL_STEPS)
        run->greedy[run->n_greedy++] = id;
    return 0;
}

static void model_run_free(model_run *run)
{
    if (run->m)
        loom_model_close(run->m);
    free(run->logits);
}

/* Opens the model on one module and runs it: its own greedy tokens, then the logits of the
 * prompt and of each step fed `feed` (NULL: its own greedy tokens). */
static int model_run_open(model_run *run, const char *model, const char *module,
                          const char *kv_type, char *err, size_t err_size)
{
    memset(run, 0, sizeof *run);
    loom_model_options o = {.n_ctx = 256, .backend_module = module, .kv_type = kv_type};
    if (!(run->m = loom_model_open(model, &o, err, err_size)))
        return -1;
    run->n_vocab = loom_model_n_vocab(run->m);
    if (!(run->logits = malloc((size_t)(MODEL_STEPS + 1) * (size_t)run->n_vocab * sizeof(float)))) {
        snprintf(err, err_size, "out of memory");
        return -1;
    }
    return 0;
}

static int model_run_steps(model_run *run, const int32_t *prompt, int n_prompt, const int32_t *feed,
                           int n_feed, char *err, size_t err_size)
{
    loom_sampling greedy = loom_sampling_defaults();
    greedy.temperature = 0, greedy.ignore_eos = 1;
    run->n_greedy = 0;
    if (loom_generate(run->m, prompt, n_prompt, MODEL_STEPS, &greedy, collect_greedy, run, NULL,
                      err, err_size) != 0 ||
        loom_generate(run->m, prompt, n_prompt, 0, &greedy, NULL, NULL, NULL, err, err_size) != 0)
        return -1;
    size_t nv = (size_t)run->n_vocab;
    memcpy(run->logits, loom_prompt_logits(run->m), nv * sizeof(float));
    if (!feed)
        feed = run->greedy, n_feed = run->n_greedy;
    if (!loom_model_extends_cache(run->m))
        return 0; /* ChatGLM-6B: only the prompt's logits and the greedy tokens */
    for (int k = 0; k < n_feed; k++) {
        if (loom_generate_from(run->m, &feed[k], 1, n_prompt + k, 0, &greedy, NULL, NULL, NULL, err,
                               err_size) != 0)
            return -1;
        memcpy(run->logits + (size_t)(k + 1) * nv, loom_prompt_logits(run->m), nv * sizeof(float));
    }
    return 0;
}

static int argmax(const float *x, int32_t n, float *margin)
{
    int best = 0;
    float second = -INFINITY;
    for (int32_t i = 1; i < n; i++) {
        if (x[i] > x[best])
            second = x[best], best = (int)i;
        else if (x[i] > second)
            second = x[i];
    }
    *margin = x[best] - second;
    return best;
}

/* kv_type: the cache the module keeps itself (its own kv_store and attention run) */
void check_model(const char *module, const char *ref_path, const char *model, const char *kv_type,
                 report *r)
{
    char what[512], err[4096] = "";
    const char *base = strrchr(model, '/') && strrchr(model, '/')[1] ? strrchr(model, '/') + 1
                                                                     : model;
    snprintf(what, sizeof what, "model %s", base);
    model_run ref, mod;
    int ok = model_run_open(&ref, model, ref_path, kv_type, err, sizeof err) == 0;
    if (!ok) {
        record(r, what, 0, "on the reference backend: %s", err);
        model_run_free(&ref);
        return;
    }
    if (model_run_open(&mod, model, module, kv_type, err, sizeof err) != 0) {
        record(r, what, 0, "opening it on this module: %s", err);
        model_run_free(&mod), model_run_free(&ref);
        return;
    }
    int32_t prompt[256];
    int64_t n_prompt = loom_tokenize(ref.m, MODEL_PROMPT, 1, LOOM_SPECIAL_TEXT, prompt, 256, err,
                                     sizeof err);
    if (n_prompt <= 0 || n_prompt > 256 ||
        model_run_steps(&ref, prompt, (int)n_prompt, NULL, 0, err, sizeof err) != 0) {
        record(r, what, 0, "running it on the reference backend: %s", err);
        model_run_free(&mod), model_run_free(&ref);
        return;
    }
    if (model_run_steps(&mod, prompt, (int)n_prompt, ref.greedy, ref.n_greedy - 1, err,
                        sizeof err) != 0) {
        record(r, what, 0, "running it on this module: %s", err);
        model_run_free(&mod), model_run_free(&ref);
        return;
    }
    /* logits, step by step, relative to the spread of ref's */
    int steps = loom_model_extends_cache(ref.m) ? ref.n_greedy : 1;
    double worst = 0;
    int worst_step = 0, choices_differ = 0, first_differ = -1;
    size_t nv = (size_t)ref.n_vocab;
    for (int k = 0; k < steps; k++) {
        const float *a = ref.logits + (size_t)k * nv, *b = mod.logits + (size_t)k * nv;
        float lo = a[0], hi = a[0];
        double d = 0;
        for (size_t i = 0; i < nv; i++) {
            lo = fminf(lo, a[i]), hi = fmaxf(hi, a[i]);
            double e = fabs((double)a[i] - b[i]);
            d = e > d || isnan(e) ? e : d;
        }
        d /= hi > lo ? hi - lo : 1;
        if (!(d <= worst))
            worst = d, worst_step = k;
        /* the same greedy choice wherever ref's is clear of the tolerance */
        float ma, mb;
        int ca = argmax(a, (int32_t)nv, &ma), cb = argmax(b, (int32_t)nv, &mb);
        if (ca != cb && ma > 2 * MODEL_TOLERANCE * (hi - lo)) {
            choices_differ++;
            if (first_differ < 0)
                first_differ = k;
        }
    }
    int same_tokens = 0;
    while (same_tokens < ref.n_greedy && same_tokens < mod.n_greedy &&
           ref.greedy[same_tokens] == mod.greedy[same_tokens])
        same_tokens++;
    snprintf(what, sizeof what, "model %s (%s cache): %d steps' logits against ref", base, kv_type,
             steps);
    char where[64] = "the prompt";
    if (worst_step)
        snprintf(where, sizeof where, "decode step %d", worst_step);
    record(r, what, worst <= MODEL_TOLERANCE,
           "worst difference %.2g of the logits' spread, at %s (limit %.0e)%s", worst, where,
           MODEL_TOLERANCE, worst <= MODEL_TOLERANCE ? "" : ": the module computes something else");
    snprintf(what, sizeof what, "model %s: greedy choices as ref's", base);
    if (first_differ >= 0)
        snprintf(where, sizeof where, "; the first clear difference at step %d", first_differ);
    else
        where[0] = '\0';
    record(r, what, choices_differ == 0,
           "%d of %d steps; its own greedy run shares %d of %d tokens "
           "with ref's%s",
           steps - choices_differ, steps, same_tokens, ref.n_greedy, where);
    model_run_free(&mod), model_run_free(&ref);
}
