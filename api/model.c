/*
 * api/model.c - opening a model and generating text: wires the file readers, the model
 * registry, the backend loader and the runner together (the one layer that knows them all).
 */
#define _GNU_SOURCE
#include "api/internal.h"

#include "dist/distributed.h"

#include "core/gguf.h"
#include "api/loader_env.h"
#include "core/runner.h"
#include "core/sampler.h"
#include "core/tokenizer.h"
#include "models/models.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>
#include <time.h>
#include <unistd.h>

struct loom_model {
    loom_gguf gguf;
    loom_device dev;
    int dev_open;
    loom_device experts_dev; /* loom_model_options.experts_on's, when open */
    int experts_open;
    loom_runner *runner;
    loom_tokenizer *tok;
    char backend[320];
    char name[128];
    float *prompt_logits;
    loom_draft_cache draft_cache; /* as a drafter: what its KV cache holds */
    loom_dist *dist;              /* a pipeline across the ranks of an MPI job, or NULL */
    loom_stage_link link;         /* this rank's stage's, for the runner */
    int pipeline_running;         /* every rank opened its stage */
    char pipeline[1024];          /* rank 0: every rank's layers, host and backend */
    loom_loader_options loader;   /* from the environment, for the registry and the fallback */
    int32_t *unsampled;           /* the ids loom_model_mask_unsampled bans */
    int32_t n_unsampled;
};

/* the API's parameters and the core sampler's: the same list's members */
#define COPY(kind, name, ...) to.name = from->name;

loom_sampler_params loom_sampler_params_of(const loom_sampling *from)
{
    loom_sampler_params to;
    LOOM_SAMPLING_FIELDS(COPY)
    return to;
}

loom_sampling loom_sampling_defaults(void)
{
    loom_sampler_params d = loom_sampler_defaults(), *from = &d;
    loom_sampling to;
    LOOM_SAMPLING_FIELDS(COPY)
    return to;
}
#undef COPY

const loom_sampling_field *loom_sampling_fields(int *n)
{
#define ROW(kind, name, ...) {#name, LOOM_SAMPLING_KIND_##kind, offsetof(loom_sampling, name)},
    static const loom_sampling_field rows[] = {LOOM_SAMPLING_FIELDS(ROW)};
#undef ROW
    *n = (int)(sizeof rows / sizeof *rows);
    return rows;
}

void loom_model_close(loom_model *m)
{
    if (!m)
        return;
    if (m->dist) {
        const char *stats = getenv("LOOM_DIST_STATS");
        uint64_t sent, received;
        loom_dist_traffic(m->dist, &sent, &received);
        if (stats && *stats && strcmp(stats, "0") != 0)
            fprintf(stderr, "loom: rank %d sent %llu bytes and received %llu\n",
                    loom_dist_rank(m->dist), (unsigned long long)sent,
                    (unsigned long long)received);
        /* rank 0 lets the others go; after a failed open every rank leaves on its own */
        loom_dist_leave(m->dist, m->pipeline_running);
    }
    loom_runner_free(m->runner);
    loom_tokenizer_free(m->tok);
    if (m->dev_open)
        loom_device_close(&m->dev);
    if (m->experts_open)
        loom_device_close(&m->experts_dev);
    loom_gguf_close(&m->gguf);
    free(m->prompt_logits);
    free(m->draft_cache.ids);
    free(m->draft_cache.states.rows);
    free(m->unsampled);
    free(m);
}

/* The device a model runs on: opts->backend_module's file, or the module chosen among those
 * found (opts->backend, LOOM_BACKEND, scores). */
static int open_device(loom_model *m, const loom_model_options *opts, const char *trace, char *err,
                       size_t err_size)
{
    loom_registry reg = {.chosen = -1};
    reg.opts = m->loader;
    int rc;
    if (opts->backend_module) {
        rc = loom_registry_add_file(&reg, opts->backend_module, err, err_size);
        const loom_candidate *c = rc == 0 ? &reg.items[0] : NULL;
        if (c && c->state != LOOM_CAND_USABLE) {
            snprintf(err, err_size, "%s: %s%s%s", opts->backend_module,
                     loom_candidate_state_name(c->state), c->reason[0] ? ": " : "", c->reason);
            rc = -1;
        } else if (c && c->kind != LOOM_MODULE_BACKEND) {
            snprintf(err, err_size,
                     "%s: %s is a decorator, not a backend: it wraps one (the "
                     "trace plugin: LOOM_TRACE=FILE)",
                     opts->backend_module, c->name);
            rc = -1;
        }
        reg.chosen = 0, reg.chosen_device = 0;
    } else {
        int scanned = loom_registry_scan(&reg, &m->loader, err, err_size) == 0;
        const char *preference = opts->backend ? opts->backend : loom_backend_preference_from_env();
        rc = -1;
        if (scanned && reg.count == 0)
            snprintf(err, err_size,
                     "no backend modules found (searched %.3000s): install loom's backends, or "
                     "name their directory in LOOM_BACKEND_PATH",
                     reg.search_path);
        /* a module that probes well but cannot open its device gives way to the next choice
         * (at most every candidate once) */
        for (int tries = 0; scanned && tries < reg.count; tries++) {
            if (loom_registry_select(&reg, preference, err, err_size) != 0)
                break;
            char why[512];
            if ((rc = loom_device_open_chosen(&m->dev, &reg, opts->n_threads, why, sizeof why)) ==
                0)
                break;
            snprintf(err, err_size, "%s", why);
            loom_candidate *c = &reg.items[reg.chosen];
            fprintf(stderr, "note: backend %s%s%s could not open its device (%s)\n", c->name,
                    c->variant[0] ? "-" : "", c->variant, why);
            c->state = LOOM_CAND_UNUSABLE;
            snprintf(c->reason, sizeof c->reason, "opening its device failed: %.400s", why);
            reg.chosen = -1;
        }
    }
    if (rc == 0 && opts->backend_module)
        rc = loom_device_open_chosen(&m->dev, &reg, opts->n_threads, err, err_size);
    if (rc == 0) {
        const loom_candidate *c = &reg.items[reg.chosen];
        snprintf(m->backend, sizeof m->backend, "%s%s%s (device %d: %s)", c->name,
                 c->variant[0] ? "-" : "", c->variant, reg.chosen_device,
                 c->probe.devices[reg.chosen_device].name);
        m->dev_open = 1;
    }
    if (rc == 0 && trace) {
        /* the trace plugin is found like a backend; a registry of one file has to look */
        if (opts->backend_module) {
            loom_registry_free(&reg);
            rc = loom_registry_scan(&reg, &m->loader, err, err_size);
        }
        int i = rc == 0 ? loom_registry_find_decorator(&reg, "trace", err, err_size) : -1;
        rc = i < 0 ? -1 : loom_device_decorate(&m->dev, reg.items[i].path, trace, err, err_size);
        if (rc != 0)
            m->dev_open = 0; /* decorating closes the device when it fails */
    }
    loom_registry_free(&reg);
    return rc;
}

/* The backend the experts go to (opts->experts_on, else LOOM_EXPERTS_ON), chosen by name as
 * the model's is, its device in ro->experts; nothing when neither names one. */
static int open_experts_device(loom_model *m, const loom_model_options *opts,
                               loom_runner_options *ro, char *err, size_t err_size)
{
    const char *want = opts->experts_on ? opts->experts_on : getenv("LOOM_EXPERTS_ON");
    if (!want || !*want)
        return 0;
    if (m->dist) {
        snprintf(err, err_size, "experts on '%s': not with a pipeline over MPI ranks", want);
        return -1;
    }
    loom_registry reg = {.chosen = -1};
    reg.opts = m->loader;
    char why[1024] = "";
    int rc = loom_registry_scan(&reg, &m->loader, why, sizeof why);
    if (rc == 0)
        rc = loom_registry_select(&reg, want, why, sizeof why);
    if (rc == 0)
        rc = loom_device_open_chosen(&m->experts_dev, &reg, opts->n_threads, why, sizeof why);
    if (rc == 0) {
        const loom_candidate *c = &reg.items[reg.chosen];
        size_t at = strlen(m->backend);
        snprintf(m->backend + at, sizeof m->backend - at, " + experts on %s%s%s", c->name,
                 c->variant[0] ? "-" : "", c->variant);
        m->experts_open = 1;
        ro->experts = &m->experts_dev;
    } else { /* the selection's words are LOOM_BACKEND's; here the name came from elsewhere */
        const char *said = strncmp(why, "LOOM_BACKEND: ", 14) ? why : why + 14;
        snprintf(err, err_size, "experts on '%s': %s", want, said);
    }
    loom_registry_free(&reg);
    return rc;
}

/* A loom_model_options behaviour: 1 on, -1 off, 0 as env says (unset or empty: fallback; "0":
 * off; anything else: on). The environment is read here, once a model, never by the core. */
static int behaviour(int32_t option, const char *env, int fallback)
{
    if (option)
        return option > 0;
    const char *s = getenv(env);
    return s && *s ? strcmp(s, "0") != 0 : fallback;
}

/* The file at path (GGUF, or a Hugging Face folder converted in memory), its family and its
 * tokenizer. */
static int open_file(loom_model *m, const char *path, const loom_arch **a, char *err,
                     size_t err_size)
{
    if (loom_open_model_file(path, &m->gguf, loom_progress_stderr, NULL, err, err_size) != 0)
        return -1;
    const char *arch;
    uint64_t arch_len;
    char arch_name[64] = "";
    if (loom_gguf_get_str(&m->gguf, "general.architecture", &arch, &arch_len) == 0)
        snprintf(arch_name, sizeof arch_name, "%.*s", (int)(arch_len < 63 ? arch_len : 63), arch);
    const char *gname;
    uint64_t gname_len;
    if (loom_gguf_get_str(&m->gguf, "general.name", &gname, &gname_len) == 0)
        snprintf(m->name, sizeof m->name, "%.*s", (int)(gname_len < 127 ? gname_len : 127), gname);
    else
        snprintf(m->name, sizeof m->name, "%s", strrchr(path, '/') ? strrchr(path, '/') + 1 : path);
    loom_text_printable(m->name); /* it reaches logs and terminals */
    if (!(*a = loom_models_find(arch_name))) {
        snprintf(err, err_size, "%s: architecture '%s' is not one loom knows (it knows: %s)", path,
                 arch_name[0] ? arch_name : "(none given)", loom_models_known());
        return -1;
    }
    return (m->tok = loom_tokenizer_from_gguf(&m->gguf, err, err_size)) ? 0 : -1;
}

/* The device (with the trace plugin when asked for) and the runner of arch a on it. */
static int open_runner(loom_model *m, const loom_model_options *opts, const loom_arch *a,
                       const loom_runner_options *ro, char *err, size_t err_size)
{
    /* the trace plugin: a Chrome trace and a summary table (LOOM_TRACE=FILE), or the table
     * alone (LOOM_PROFILE=1, config "") */
    const char *trace = opts->trace ? opts->trace : getenv("LOOM_TRACE");
    if (trace && !*trace)
        trace = NULL;
    if (!trace && behaviour(opts->profile, "LOOM_PROFILE", 0))
        trace = "";
    loom_runner_options with_experts = *ro;
    if (open_device(m, opts, trace, err, err_size) != 0 ||
        open_experts_device(m, opts, &with_experts, err, err_size) != 0)
        return -1;
    if (!(m->runner = loom_runner_create(&m->dev, &m->gguf, a, &with_experts, err, err_size)))
        return -1;
    int32_t nv = loom_runner_hparams(m->runner)->n_vocab;
    if (!(m->prompt_logits = calloc((size_t)nv, sizeof(float))) ||
        !(m->draft_cache.ids = malloc((size_t)loom_runner_n_ctx(m->runner) * sizeof(int32_t))) ||
        !(m->unsampled = malloc((size_t)nv * sizeof *m->unsampled))) {
        snprintf(err, err_size, "out of memory");
        return -1;
    }
    /* every token the tokenizer makes needs an embedding row (a shorter output head only
     * means those tokens are never generated: loom verify reports it) */
    const loom_gguf_tensor *embd = loom_gguf_find_tensor(&m->gguf, "token_embd.weight");
    int64_t n_tok = m->tok ? loom_tokenizer_vocab_size(m->tok) : 0;
    if (embd && embd->n_dims == 2 && (int64_t)embd->ne[1] < n_tok) {
        snprintf(err, err_size,
                 "the tokenizer has %lld tokens, but token_embd.weight only %lld rows: ids %lld "
                 "to %lld would have no embedding",
                 (long long)n_tok, (long long)embd->ne[1], (long long)embd->ne[1],
                 (long long)n_tok - 1);
        return -1;
    }
    for (int32_t id = 0; id < nv; id++)
        if (m->tok && loom_tokenizer_is_unused(m->tok, id))
            m->unsampled[m->n_unsampled++] = id;
    return 0;
}

int loom_model_token_unused(const loom_model *m, int32_t id)
{
    return !m->tok || loom_tokenizer_is_unused(m->tok, id);
}

void loom_model_mask_unsampled(const loom_model *m, float *logits)
{
    for (int32_t i = 0; i < m->n_unsampled; i++)
        logits[m->unsampled[i]] = -INFINITY;
}

loom_model *loom_model_open(const char *path, const loom_model_options *opts, char *err,
                            size_t err_size)
{
    loom_model_options none = {0};
    if (!opts)
        opts = &none;
    loom_runner_options ro = {.n_ctx = opts->n_ctx,
                              .kv_blocks = opts->kv_blocks,
                              .repack = behaviour(opts->repack, "LOOM_REPACK", 1) ? 1 : -1,
                              .strict = behaviour(opts->strict, "LOOM_STRICT", 0),
                              .kv_sequences = opts->kv_sequences,
                              .block_size = opts->block_size,
                              .first_layers = opts->first_layers,
                              .mtp = !!opts->mtp};
    if (opts->first_layers < 0) {
        snprintf(err, err_size, "first_layers %d: give a count of layers, or 0 for all",
                 opts->first_layers);
        return NULL;
    }
    if (!opts->kv_type || strcmp(opts->kv_type, "f16") == 0)
        ro.kv_type = LOOM_F16;
    else if (strcmp(opts->kv_type, "f32") == 0)
        ro.kv_type = LOOM_F32;
    else if (strcmp(opts->kv_type, "q8_0") == 0)
        ro.kv_type = LOOM_Q8_0;
    else {
        snprintf(err, err_size, "KV cache type '%s' is not one of f16, f32, q8_0", opts->kv_type);
        return NULL;
    }
    loom_model *m = calloc(1, sizeof *m);
    if (!m) {
        snprintf(err, err_size, "out of memory");
        return NULL;
    }
    m->loader = loom_loader_options_from_env();
    ro.loader = &m->loader;
    const loom_arch *a = NULL;
    if (loom_dist_join(opts->distributed, &m->dist, err, err_size) != 0)
        goto fail;
    int ok = open_file(m, path, &a, err, err_size) == 0;
    if (m->dist) {
        /* every rank takes part whatever failed here, so that all of them learn of it */
        int32_t n_layer = ok ? (int32_t)loom_model_kv_int(&m->gguf, a->name, "block_count", 0) : 0;
        if (opts->first_layers > 0 || opts->mtp) {
            snprintf(err, err_size, "a drafter of the %s does not run as a pipeline",
                     opts->mtp ? "multi-token-prediction block" : "first layers");
            goto fail;
        }
        int rc = loom_dist_plan(m->dist, ok ? &m->gguf : NULL, n_layer, opts->stage_layers,
                                &m->link, &ro.first_layer, &ro.end_layer, err, err_size);
        if (rc < 0)
            goto fail;
        ro.link = &m->link;
        /* as many parts as stages keeps each busy; LOOM_MICRO_BATCHES=1 runs steps whole */
        const char *parts = getenv("LOOM_MICRO_BATCHES");
        ro.micro_batches = parts && *parts ? atoi(parts) : loom_dist_size(m->dist);
        ok = rc == 0 && open_runner(m, opts, a, &ro, err, err_size) == 0;
        if (loom_dist_agree(m->dist, ok, ok ? m->backend : "", err, err_size, m->pipeline,
                            sizeof m->pipeline) != 0)
            goto fail;
        m->pipeline_running = 1;
    } else if (!ok || open_runner(m, opts, a, &ro, err, err_size) != 0) {
        goto fail;
    }
    if (opts->first_layers > 0) {
        size_t at = strlen(m->backend);
        snprintf(m->backend + at, sizeof m->backend - at, ", first %d layers", opts->first_layers);
    }
    m->draft_cache.mtp = !!opts->mtp;
    if (opts->mtp) {
        size_t at = strlen(m->backend);
        snprintf(m->backend + at, sizeof m->backend - at, ", multi-token prediction");
    }
    return m;
fail:
    loom_text_printable(err); /* it may quote the file's strings */
    loom_model_close(m);
    return NULL;
}

int loom_model_follow(loom_model *m, char *err, size_t err_size)
{
    if (!m->dist || loom_dist_rank(m->dist) == 0)
        return 0;
    return loom_dist_follow(m->dist, m->runner, err, err_size) == 0 ? 1 : -1;
}

void loom_model_watch_stages(loom_model *m, void (*on_stop)(void *ctx, const char *why), void *ctx)
{
    loom_dist_watch(m->dist, on_stop, ctx);
}

struct loom_runner *loom_model_runner(loom_model *m)
{
    return m->runner;
}

struct loom_tokenizer *loom_model_tokenizer(loom_model *m)
{
    return m->tok;
}

const char *loom_model_backend(const loom_model *m)
{
    if (m->pipeline[0])
        return m->pipeline;
    return m->backend;
}

int32_t loom_model_n_vocab(const loom_model *m)
{
    return loom_runner_hparams(m->runner)->n_vocab;
}

int32_t loom_model_n_embd(const loom_model *m)
{
    return loom_runner_hparams(m->runner)->n_embd;
}

int32_t loom_default_block_size(void)
{
    return LOOM_RUNNER_BLOCK_SIZE;
}

int32_t loom_model_n_ctx(const loom_model *m)
{
    return loom_runner_n_ctx(m->runner);
}

uint64_t loom_model_state_bytes(const loom_model *m)
{
    return loom_runner_state_bytes(m->runner);
}

uint64_t loom_model_kv_bytes_per_token(const loom_model *m)
{
    return loom_runner_block_bytes(m->runner) / (uint64_t)loom_runner_block_size(m->runner);
}

int32_t loom_model_sliding_window(const loom_model *m)
{
    return loom_runner_hparams(m->runner)->n_swa;
}

const float *loom_prompt_logits(const loom_model *m)
{
    return m->prompt_logits;
}

int64_t loom_tokenize(loom_model *m, const char *text, int add_special, int parse_special,
                      int32_t *ids, int64_t cap, char *err, size_t err_size)
{
    return loom_tokenize_spans(m, text, strlen(text), add_special, parse_special, NULL, 0, ids, cap,
                               err, err_size);
}

int64_t loom_tokenize_spans(loom_model *m, const char *text, size_t len, int add_special,
                            int parse_special, const loom_text_span *plain, int n_plain,
                            int32_t *ids, int64_t cap, char *err, size_t err_size)
{
    size_t *bounds = n_plain > 0 ? malloc(2 * (size_t)n_plain * sizeof *bounds) : NULL;
    if (n_plain > 0 && !bounds) {
        snprintf(err, err_size, "out of memory while tokenizing");
        return -1;
    }
    for (int k = 0; k < n_plain; k++)
        bounds[2 * k] = plain[k].start, bounds[2 * k + 1] = plain[k].end;
    int64_t n = loom_tokenizer_encode_spans(m->tok, text, len, add_special, parse_special, bounds,
                                            n_plain, ids, cap);
    free(bounds);
    if (n < 0)
        snprintf(err, err_size,
                 "cannot tokenize the text: out of memory, a piece too long, or "
                 "plain spans out of order");
    return n;
}

size_t loom_model_max_prompt_bytes(const loom_model *m)
{
    return (size_t)loom_model_n_ctx(m) * loom_tokenizer_max_token_bytes(m->tok);
}

int loom_model_check_ids(const loom_model *m, const int32_t *ids, int32_t n, char *err,
                         size_t err_size)
{
    if (n <= 0 || n > loom_runner_n_ctx(m->runner)) {
        snprintf(err, err_size, "%d tokens do not fit the context of %d (raise it with -c)", n,
                 loom_runner_n_ctx(m->runner));
        return -1;
    }
    for (int32_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= loom_model_n_vocab(m)) {
            snprintf(err, err_size, "token id %d is not below the vocabulary's %d", ids[i],
                     loom_model_n_vocab(m));
            return -1;
        }
    return 0;
}

int loom_eval_logits(loom_model *m, const int32_t *ids, int32_t n, float *out, char *err,
                     size_t err_size)
{
    if (loom_model_check_ids(m, ids, n, err, err_size) != 0)
        return -1;
    return loom_runner_eval_all(m->runner, ids, n, 0, out, err, err_size);
}

const struct loom_gguf *loom_model_gguf(const loom_model *m)
{
    return &m->gguf;
}

const struct loom_tokenizer *loom_model_tokenizer_of(const loom_model *m)
{
    return m->tok;
}

float *loom_model_prompt_logits_buffer(loom_model *m)
{
    return m->prompt_logits;
}

loom_draft_cache *loom_model_draft_cache(loom_model *m)
{
    return &m->draft_cache;
}

uint64_t loom_model_weight_bytes(const loom_model *m)
{
    const loom_hparams *hp = loom_runner_hparams(m->runner);
    uint64_t total = 0;
    for (uint64_t i = 0; i < m->gguf.n_tensors; i++) {
        const loom_gguf_tensor *t = &m->gguf.tensors[i];
        if (strcmp(t->name, "token_embd.weight") == 0)
            continue;
        /* an expert stack [experts, rows, cols]: a token reads the k it is routed to */
        if (hp->n_expert > 0 && t->n_dims == 3 && t->ne[2] == hp->n_expert)
            total += t->size / (uint64_t)hp->n_expert * (uint64_t)hp->n_expert_used;
        else
            total += t->size;
    }
    return total;
}

int64_t loom_model_prepared_weights(const loom_model *m)
{
    return loom_runner_prepared_weights(m->runner);
}

const char *loom_model_weight_type(const loom_model *m)
{
    uint64_t bytes[64] = {0};
    uint32_t best = 0;
    for (uint64_t i = 0; i < m->gguf.n_tensors; i++)
        if (m->gguf.tensors[i].type < 64)
            bytes[m->gguf.tensors[i].type] += m->gguf.tensors[i].size;
    for (uint32_t t = 0; t < 64; t++)
        if (bytes[t] > bytes[best])
            best = t;
    return loom_ggml_type_name(best);
}

int loom_model_extends_cache(const loom_model *m)
{
    return !loom_runner_has_prefix(m->runner);
}

uint64_t loom_model_fingerprint(const loom_model *m)
{
    return XXH3_64bits(m->gguf.map, (size_t)m->gguf.size);
}

const char *loom_model_name(const loom_model *m)
{
    return m->name;
}

/* ---- Tokenizers alone ------------------------------------------------------------------- */

struct loom_vocab {
    loom_gguf gguf;
    loom_tokenizer *tok;
};

loom_vocab *loom_vocab_open(const char *path, char *err, size_t err_size)
{
    loom_vocab *v = calloc(1, sizeof *v);
    if (!v) {
        snprintf(err, err_size, "out of memory");
        return NULL;
    }
    int rc = loom_open_model_file(path, &v->gguf, NULL, NULL, err, err_size);
    if (rc != 0 || !(v->tok = loom_tokenizer_from_gguf(&v->gguf, err, err_size))) {
        loom_text_printable(err);
        loom_vocab_close(v);
        return NULL;
    }
    return v;
}

void loom_vocab_close(loom_vocab *v)
{
    if (!v)
        return;
    loom_tokenizer_free(v->tok);
    loom_gguf_close(&v->gguf);
    free(v);
}

int32_t loom_vocab_size(const loom_vocab *v)
{
    return loom_tokenizer_vocab_size(v->tok);
}

int64_t loom_vocab_encode(const loom_vocab *v, const char *text, int add_special, int parse_special,
                          int32_t *ids, int64_t cap)
{
    return loom_tokenizer_encode(v->tok, text, strlen(text), add_special, parse_special, ids, cap);
}

int loom_token_piece(const loom_model *m, int32_t prev, int32_t id, char *out, int cap)
{
    return loom_tokenizer_piece(m->tok, prev, id, out, cap);
}

int loom_vocab_piece(const loom_vocab *v, int32_t prev, int32_t id, char *out, int cap)
{
    return loom_tokenizer_piece(v->tok, prev, id, out, cap);
}
