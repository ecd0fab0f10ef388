/*
 * tools/bench.c - `loom bench`: prefill and decode speed of a model on each backend (and CPU
 * variant), side by side. Without -m it writes a deterministic synthetic Llama-shaped model
 * (`--synthetic 1b`, `--type q4_0`) to a temporary file, so it needs no download.
 *
 * Each backend runs in its own process (`loom bench --child ...`) on the same file and the same
 * token ids, and reports one JSON line per test; the parent tabulates them with the decode
 * roofline: the bytes a token reads (its weights, a hybrid model's recurrent state, read and
 * written, and at a depth the KV cache of that context) divided by the decode time, as a share
 * of the streaming read bandwidth measured in the same run.
 *
 * Under mpirun (`mpirun -np N loom bench -m MODEL.gguf`) it measures the one model the job's
 * ranks run as a pipeline, each rank on its own best backend, in the ranks' own processes.
 */
#define _GNU_SOURCE
#include <loom/loom.h>

#include "args.h"
#include "bench_ops.h"
#include "api/loader_env.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

typedef struct bench_args {
    const char *model, *synthetic, *type, *backends;
    const char *vocab_from; /* the synthetic model's tokenizer: another model's */
    const char *experts_on; /* --experts-on: each backend measured with the experts there */
    long pp, tg, reps;
    long depth; /* -d: decode after this many tokens of context */
    int json, csv, no_roofline;
    int distributed;      /* --distributed */
    const char *layers;   /* --layers */
    loom_spec_flags spec; /* a drafter: decode is measured with it too, alternating */
} bench_args;

/* ---- child: one backend ----------------------------------------------------------------- */

static double mean_of(const double *x, int n, double *sd)
{
    double m = 0, v = 0;
    for (int i = 0; i < n; i++)
        m += x[i] / n;
    for (int i = 0; i < n; i++)
        v += (x[i] - m) * (x[i] - m) / (n > 1 ? n - 1 : 1);
    *sd = sqrt(v);
    return m;
}

/* One test's result, as a JSON object added to `results`. */
static void emit(cJSON *results, const loom_model *m, const char *test, double mean, double sd,
                 const char *error)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "test", test);
    if (error)
        cJSON_AddStringToObject(o, "error", error);
    if (m) {
        cJSON_AddStringToObject(o, "backend", loom_model_backend(m));
        cJSON_AddStringToObject(o, "model", loom_model_name(m));
        cJSON_AddStringToObject(o, "weight_type", loom_model_weight_type(m));
        cJSON_AddNumberToObject(o, "weight_bytes", (double)loom_model_weight_bytes(m));
        /* a recurrent layer's state is read and written once a token */
        cJSON_AddNumberToObject(o, "state_bytes", 2.0 * (double)loom_model_state_bytes(m));
    }
    cJSON_AddNumberToObject(o, "tokens_per_s", mean);
    cJSON_AddNumberToObject(o, "sd", sd);
    cJSON_AddNumberToObject(o, "peak_rss_bytes", (double)ru.ru_maxrss * 1024.0);
    cJSON_AddItemToArray(results, o);
}

/* The model on `backend` (NULL: as under mpirun, each rank its own), its tests' results added
 * to `results`. Returns 1 when the model did not open, -1 when this rank of a pipeline is done
 * (it has nothing to report), 0 otherwise. */
static int measure(const char *backend, const bench_args *a, cJSON *results)
{
    char err[4096];
    loom_model_options o = {.backend = backend,
                            .distributed = backend ? 0
                                : a->distributed   ? 2
                                                   : 1,
                            .stage_layers = a->layers,
                            .experts_on = a->experts_on,
                            /* room for the depth's context, past the default 4096 too */
                            .n_ctx = a->depth ? (int32_t)(a->depth + a->tg + 8) : 0};
    loom_model *m = loom_model_open(a->model, &o, err, sizeof err);
    if (!m) {
        emit(results, NULL, "open", 0, 0, err);
        return 1;
    }
    if (!backend && loom_args_follow("loom bench", m) >= 0)
        return -1;
    int32_t n_vocab = loom_model_n_vocab(m), n_ctx = loom_model_n_ctx(m);
    long pp = a->pp < n_ctx ? a->pp : n_ctx - 1, tg = a->tg < n_ctx - 1 ? a->tg : n_ctx - 2;
    const long depth = a->depth, n_ids = pp > depth ? pp : depth;
    int32_t *ids = malloc((size_t)(n_ids > 1 ? n_ids : 1) * sizeof *ids);
    uint64_t x = 12345; /* the same ids in every child */
    for (long i = 0; i < n_ids; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = 3 + (int32_t)((x >> 33) % (uint64_t)(n_vocab - 3));
    }
    loom_sampling greedy = loom_sampling_defaults();
    greedy.temperature = 0;
    greedy.ignore_eos = 1;
    double t[64], sd;
    int reps = (int)(a->reps < 64 ? a->reps : 64);
    char name[32];
    if (pp > 0) {
        loom_generation st;
        int ok = loom_generate(m, ids, (int32_t)pp, 0, &greedy, NULL, NULL, &st, err, sizeof err) ==
            0;
        for (int r = 0; r < reps && ok; r++) {
            ok = loom_generate(m, ids, (int32_t)pp, 0, &greedy, NULL, NULL, &st, err, sizeof err) ==
                0;
            t[r] = st.prefill_tok_s;
        }
        snprintf(name, sizeof name, "pp%ld", pp);
        double mean = ok ? mean_of(t, reps, &sd) : (sd = 0);
        emit(results, m, name, mean, sd, ok ? NULL : err);
    }
    /* with a drafter, decoding with it alternates with decoding without, rep by rep */
    loom_speculation spec_room;
    const loom_speculation *spec = NULL;
    loom_model *drafter = NULL;
    char about[600];
    loom_spec_flags sf = a->spec;
    loom_open_flags of = {.model = a->model};
    if (!sf.draft_backend && (sf.draft || sf.draft_layers || sf.mtp))
        sf.draft_backend = backend; /* the drafter beside the model, unless told */
    if (tg > 1 &&
        loom_spec_open("loom bench", &sf, &of, m, &spec_room, &spec, &drafter, about,
                       sizeof about) != 0)
        emit(results, m, "open drafter", 0, 0, "the drafter did not open (see above)");
    if (tg > 1) {
        /* decode after one token, or after depth tokens of context (-d) */
        int32_t bos = 1;
        const int32_t *context = depth ? ids : &bos, n_context = depth ? (int32_t)depth : 1;
        loom_generation st;
        double ts[64];
        int32_t drafted = 0, accepted = 0, verify = 0;
        int ok = loom_generate(m, &bos, 1, 4, &greedy, NULL, NULL, &st, err, sizeof err) == 0;
        for (int r = 0; r < reps && ok; r++) {
            ok = loom_generate(m, context, n_context, (int32_t)tg, &greedy, NULL, NULL, &st, err,
                               sizeof err) == 0;
            t[r] = st.decode_tok_s;
            if (ok && spec) {
                ok = loom_generate_speculative(m, spec, context, n_context, 0, (int32_t)tg, &greedy,
                                               NULL, NULL, &st, err, sizeof err) == 0;
                ts[r] = st.decode_tok_s;
                drafted += st.n_drafted, accepted += st.n_accepted, verify += st.n_verify;
            }
        }
        if (depth)
            snprintf(name, sizeof name, "tg%ld@d%ld", tg, depth);
        else
            snprintf(name, sizeof name, "tg%ld", tg);
        double mean = ok ? mean_of(t, reps, &sd) : (sd = 0);
        emit(results, m, name, mean, sd, ok ? NULL : err);
        if (depth) { /* the context's KV cache, read once a token (the roofline counts it) */
            cJSON *o = cJSON_GetArrayItem(results, cJSON_GetArraySize(results) - 1);
            cJSON_AddNumberToObject(o, "kv_bytes",
                                    (double)depth * (double)loom_model_kv_bytes_per_token(m));
        }
        if (spec) {
            snprintf(name, sizeof name, "spec tg%ld", tg);
            double mean_spec = ok ? mean_of(ts, reps, &sd) : (sd = 0);
            emit(results, m, name, mean_spec, sd, ok ? NULL : err);
            cJSON *o = cJSON_GetArrayItem(results, cJSON_GetArraySize(results) - 1);
            cJSON_AddStringToObject(o, "drafter", about);
            cJSON_AddNumberToObject(o, "acceptance", drafted ? (double)accepted / drafted : 0);
            cJSON_AddNumberToObject(o, "tokens_per_verify",
                                    verify ? (double)(accepted + verify) / verify : 0);
            cJSON_AddNumberToObject(o, "speedup", mean > 0 ? mean_spec / mean : 0);
        }
    }
    free(ids);
    loom_model_close(drafter);
    loom_model_close(m);
    return 0;
}

/* `loom bench --child BACKEND`: measure, one JSON line per test on stdout */
static int child(const char *backend, const bench_args *a)
{
    cJSON *results = cJSON_CreateArray(), *o;
    int rc = measure(backend, a, results);
    cJSON_ArrayForEach (o, results) {
        char *s = cJSON_PrintUnformatted(o);
        printf("%s\n", s);
        free(s);
    }
    fflush(stdout);
    cJSON_Delete(results);
    return rc > 0;
}

/* ---- parent ------------------------------------------------------------------------------ */

/* Each chosen backend in a process of its own (`--child`), their results added to `results`,
 * after the streaming read bandwidth (*bw) when the roofline is wanted. Returns 0, or the exit
 * status of a failure before any measurement. */
static int run_each_backend(const char *self, bench_args *a, cJSON *results, int threads,
                            double *bw, int *failures)
{
    /* which backends */
    loom_registry reg;
    char err[4096];
    loom_loader_options lo = loom_loader_options_from_env();
    if (loom_registry_scan(&reg, &lo, err, sizeof err) != 0) {
        fprintf(stderr, "loom bench: %s\n", err);
        return 1;
    }
    char labels[32][160];
    int n = 0;
    int all = a->backends && !strcmp(a->backends, "all");
    for (int i = 0; i < reg.count && n < 32; i++) {
        const loom_candidate *c = &reg.items[i];
        if (c->kind != LOOM_MODULE_BACKEND)
            continue; /* the trace plugin wraps what is measured (LOOM_TRACE) */
        char l[160];
        snprintf(l, sizeof l, "%s%s%s", c->name, c->variant[0] ? "-" : "", c->variant);
        int wanted = all || (!a->backends && strcmp(c->name, "ref") != 0);
        if (a->backends && !all) {
            char *copy = strdup(a->backends), *save = NULL;
            for (char *e = strtok_r(copy, ",", &save); e; e = strtok_r(NULL, ",", &save))
                wanted |= !strcmp(e, c->name) || !strcmp(e, l);
            free(copy);
        }
        if (!wanted)
            continue;
        if (c->state != LOOM_CAND_USABLE) {
            /* said also by default: on a GPU box, why its module is not in the table */
            fprintf(stderr, "loom bench: skipping %s: %s\n", l, c->reason);
            continue;
        }
        snprintf(labels[n++], sizeof labels[0], "%s", l);
    }
    loom_registry_free(&reg);
    if (n == 0) {
        fprintf(stderr, "loom bench: no usable backend matches '%s' (see `loom backends`)\n",
                a->backends ? a->backends : "");
        return 1;
    }

    char tmp[4096] = "";
    if (!a->model) {
        const char *dir = getenv("TMPDIR");
        snprintf(tmp, sizeof tmp, "%s/loom-bench-%d-%s-%s.gguf", dir && *dir ? dir : "/tmp",
                 (int)getpid(), a->synthetic, a->type);
        fprintf(stderr, "writing the synthetic %s model (%s) to %s...\n", a->synthetic, a->type,
                tmp);
        if (loom_write_synthetic_model_vocab(tmp, a->synthetic, a->type, a->vocab_from, err,
                                             sizeof err) != 0) {
            fprintf(stderr, "loom bench: %s\n", err);
            return 2;
        }
        a->model = tmp;
    } else if (access(a->model, R_OK) != 0) {
        fprintf(stderr, "loom bench: cannot read %s\n", a->model);
        return 2;
    }
    uint64_t ws = loom_bench_working_set();
    if (!a->no_roofline) {
        fprintf(stderr, "measuring streaming read bandwidth (%d threads)...\n", threads);
        *bw = loom_bench_read_bandwidth(ws, threads);
    }

    for (int b = 0; b < n; b++) {
        fprintf(stderr, "running %s...\n", labels[b]);
        char cmd[8192];
        char experts[256] = "", spec_args[4600] = "";
        const loom_spec_flags *sf = &a->spec;
        if (sf->draft || sf->draft_layers || sf->lookup || sf->mtp) { /* paths: no quote */
            size_t at = 0;
            if (sf->mtp)
                at += (size_t)snprintf(spec_args + at, sizeof spec_args - at, " --draft-mtp");
            if (sf->draft)
                at += (size_t)snprintf(spec_args + at, sizeof spec_args - at, " --draft '%s'",
                                       sf->draft);
            if (sf->draft_layers)
                at += (size_t)snprintf(spec_args + at, sizeof spec_args - at, " --draft-layers %ld",
                                       sf->draft_layers);
            if (sf->lookup)
                at += (size_t)snprintf(spec_args + at, sizeof spec_args - at, " --lookup %ld",
                                       sf->lookup);
            if (sf->draft_backend)
                at += (size_t)snprintf(spec_args + at, sizeof spec_args - at,
                                       " --draft-backend '%s'", sf->draft_backend);
            snprintf(spec_args + at, sizeof spec_args - at,
                     " --draft-max %ld --draft-min %ld --draft-p-min %g%s",
                     sf->draft_max ? sf->draft_max : 8, sf->draft_min ? sf->draft_min : 1,
                     (double)sf->p_min, sf->fixed ? " --draft-fixed" : "");
        }
        if (a->experts_on) /* checked to be a plain name: nothing to escape */
            snprintf(experts, sizeof experts, " --experts-on '%s'", a->experts_on);
        snprintf(cmd, sizeof cmd, "'%s' bench --child '%s' -m '%s' -p %ld -n %ld -r %ld -d %ld%s%s",
                 self, labels[b], a->model, a->pp, a->tg, a->reps, a->depth, experts, spec_args);
        FILE *f = popen(cmd, "r");
        char line[8192];
        while (f && fgets(line, sizeof line, f)) {
            cJSON *o = cJSON_Parse(line);
            if (!o)
                continue;
            cJSON_AddStringToObject(o, "variant", labels[b]);
            const char *test = cJSON_GetStringValue(cJSON_GetObjectItem(o, "test"));
            double tps = cJSON_GetNumberValue(cJSON_GetObjectItem(o, "tokens_per_s"));
            double wb = cJSON_GetNumberValue(cJSON_GetObjectItem(o, "weight_bytes"));
            const cJSON *sb = cJSON_GetObjectItem(o, "state_bytes");
            const cJSON *kvb = cJSON_GetObjectItem(o, "kv_bytes");
            wb += cJSON_IsNumber(sb) ? sb->valuedouble : 0;
            wb += cJSON_IsNumber(kvb) ? kvb->valuedouble : 0;
            if (test && test[0] == 't' && *bw > 0 && tps > 0)
                cJSON_AddNumberToObject(o, "roofline_share", tps * wb / 1e9 / *bw);
            *failures += cJSON_GetObjectItem(o, "error") != NULL;
            cJSON_AddItemToArray(results, o);
        }
        if (!f || pclose(f) != 0)
            (*failures)++;
    }
    if (tmp[0])
        unlink(tmp);
    return 0;
}

/* Under mpirun: one model over the job's ranks, each on its own best backend; rank 0 measures
 * it. Returns 0 on rank 0, -1 on the other ranks once the pipeline is done, or an exit status. */
static int run_pipeline(const bench_args *a, cJSON *results, int *failures)
{
    if (!a->model) {
        fprintf(stderr,
                "loom bench: under mpirun, give -m MODEL.gguf: every rank reads the "
                "same file (`loom bench --synthetic 1b --write FILE` writes one)\n");
        return 2;
    }
    if (a->backends) {
        fprintf(stderr,
                "loom bench: --backends runs each backend in a process of its own, "
                "which cannot join this MPI job; each rank picks its own backend "
                "(LOOM_BACKEND per rank), so drop --backends\n");
        return 2;
    }
    int rc = measure(NULL, a, results);
    if (rc < 0)
        return -1;
    cJSON *o;
    cJSON_ArrayForEach (o, results) {
        cJSON_AddStringToObject(o, "variant", "pipeline");
        *failures += cJSON_GetObjectItem(o, "error") != NULL;
    }
    return 0;
}


int loom_bench_main(int argc, char **argv, const char *self);
int loom_bench_main(int argc, char **argv, const char *self)
{
    bench_args a = {.synthetic = "1b", .type = "q4_0", .pp = 128, .tg = 32, .reps = 5};
    loom_flag spec_flags[LOOM_SPEC_FLAGS];
    loom_spec_flag_table(&a.spec, spec_flags);
    const char *child_backend = NULL, *write_to = NULL;
    char shape_help[512], type_help[512];
    snprintf(shape_help, sizeof shape_help, "%s (default 1b, the TinyLlama-1.1B shape)",
             loom_synthetic_shapes());
    snprintf(type_help, sizeof type_help, "weights of the synthetic model (q4_0): %s",
             loom_synthetic_types());
    const loom_flag flags[] = {
        {"-m", "--model", LOOM_FLAG_TEXT, &a.model, 0, 0, "MODEL.gguf", "the model to run"},
        {"--synthetic", NULL, LOOM_FLAG_TEXT, &a.synthetic, 0, 0, "SHAPE", shape_help},
        {"--type", NULL, LOOM_FLAG_TEXT, &a.type, 0, 0, "TYPE", type_help},
        {"--backends", NULL, LOOM_FLAG_TEXT, &a.backends, 0, 0, "LIST",
         "all, or comma-separated names / name-variants (default: all but ref)"},
        {"-p", NULL, LOOM_FLAG_LONG, &a.pp, 0, 1 << 16, "N",
         "prompt tokens for the prefill test (default 128; 0 skips it)"},
        {"-n", NULL, LOOM_FLAG_LONG, &a.tg, 0, 1 << 16, "N", "tokens to generate (default 32)"},
        {"-d", "--depth", LOOM_FLAG_LONG, &a.depth, 0, 1 << 20, "N",
         "decode after N tokens of context (test tg<n>@d<N>; the roofline\n"
         "counts that context's KV cache; default 0)"},
        {"-r", NULL, LOOM_FLAG_LONG, &a.reps, 1, 64, "N",
         "repetitions; tokens/s is their mean +- sd (default 5)"},
        {"--json", NULL, LOOM_FLAG_SWITCH, &a.json, 0, 0, NULL, "one JSON document"},
        {"--csv", NULL, LOOM_FLAG_SWITCH, &a.csv, 0, 0, NULL, "CSV rows"},
        {"--no-roofline", NULL, LOOM_FLAG_SWITCH, &a.no_roofline, 0, 0, NULL,
         "skip measuring memory bandwidth (no roofline column)"},
        {"--write", NULL, LOOM_FLAG_TEXT, &write_to, 0, 0, "FILE",
         "only write the synthetic model to FILE (to bench it elsewhere)"},
        {"--vocab-from", NULL, LOOM_FLAG_TEXT, &a.vocab_from, 0, 0, "MODEL",
         "the synthetic model takes MODEL's tokenizer and vocabulary size"},
        LOOM_FLAG_EXPERTS_ON(&a.experts_on),
        LOOM_FLAG_DISTRIBUTED(&a.distributed),
        LOOM_FLAG_LAYERS(&a.layers),
        {"--child", NULL, LOOM_FLAG_TEXT, &child_backend, 0, 0, "BACKEND", NULL},
    };
    const loom_command cmd = {
        .name = "loom bench",
        .synopsis = "[-m MODEL.gguf | --synthetic SHAPE [--type TYPE]] [--backends LIST]\n"
                    "                  [-p 128] [-n 32] [-r 5] [--json | --csv]\n"
                    "also: loom bench ops (per-op timings), loom bench serve (a server under load)",
        .flags = flags,
        .n_flags = LOOM_N_FLAGS(flags),
        .more_flags = spec_flags,
        .n_more_flags = LOOM_SPEC_FLAGS,
        .more_title = "speculative decoding (decode measured with and without, alternating):"};
    int parsed = loom_args_parse(&cmd, argc, argv);
    if (parsed)
        return parsed == 1 ? 0 : parsed;
    if (child_backend)
        return child(child_backend, &a);
    const char *name_chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-,.";
    if (a.experts_on &&
        (!*a.experts_on || strlen(a.experts_on) > 128 ||
         a.experts_on[strspn(a.experts_on, name_chars)])) {
        fprintf(stderr,
                "loom bench: --experts-on '%.40s' is not a backend name (letters, digits, '-', "
                "'_', '.' and ',' as `loom backends` lists them)\n",
                a.experts_on);
        return 2;
    }
    if (write_to) { /* the synthetic model alone, to run elsewhere (llama.cpp) or again */
        char err[1024];
        if (a.model ||
            loom_write_synthetic_model_vocab(write_to, a.synthetic, a.type, a.vocab_from, err,
                                             sizeof err)) {
            fprintf(stderr, "loom bench: %s\n",
                    a.model ? "--write writes a synthetic model; "
                              "-m has one already"
                            : err);
            return 2;
        }
        fprintf(stderr, "wrote the synthetic %s model (%s) to %s\n", a.synthetic, a.type, write_to);
        return 0;
    }
    const char *paths[] = {a.spec.draft, a.spec.draft_backend};
    for (int i = 0; i < 2; i++)
        if (paths[i] && strchr(paths[i], '\'')) {
            fprintf(stderr,
                    "loom bench: %s '%s' has a quote in it, which the bench's child "
                    "processes cannot be given\n",
                    i ? "--draft-backend" : "--draft", paths[i]);
            return 2;
        }
    if (a.json && a.csv) {
        fprintf(stderr, "loom bench: choose one of --json and --csv\n");
        return 2;
    }

    cJSON *results = cJSON_CreateArray();
    int failures = 0, threads = loom_bench_threads();
    double bw = 0;
    int rc = a.distributed || loom_distributed_job(1)
        ? run_pipeline(&a, results, &failures)
        : run_each_backend(self, &a, results, threads, &bw, &failures);
    if (rc != 0) {
        cJSON_Delete(results);
        return rc < 0 ? 0 : rc;
    }
    if (a.json) {
        cJSON *root = cJSON_CreateObject();
        cJSON_AddNumberToObject(root, "read_bandwidth_gbps", bw);
        cJSON_AddItemToObject(root, "results", results);
        char *s = cJSON_Print(root);
        printf("%s\n", s);
        free(s);
        cJSON_Delete(root);
        return failures ? 1 : 0;
    }
    if (a.csv)
        printf(
            "backend,device,model,weight_type,test,tokens_per_s,sd,peak_rss_mib,roofline_share\n");
    else
        printf("streaming read bandwidth: %.1f GB/s (%d threads)\n\n"
               "| backend | device | model | weights | test | tokens/s | peak RSS | roofline |\n"
               "|---|---|---|---|---|---|---|---|\n",
               bw, threads);
    cJSON *o;
    cJSON_ArrayForEach (o, results) {
        const char *variant = cJSON_GetStringValue(cJSON_GetObjectItem(o, "variant"));
        const char *be = cJSON_GetStringValue(cJSON_GetObjectItem(o, "backend"));
        const char *e = cJSON_GetStringValue(cJSON_GetObjectItem(o, "error"));
        /* one backend's device after its name; a pipeline's every rank, as it is */
        int pipeline = variant && !strcmp(variant, "pipeline");
        const char *dev = pipeline && be ? be : be && strchr(be, ':') ? strchr(be, ':') + 2 : "";
        char device[1024];
        snprintf(device, sizeof device, "%s", dev);
        if (!pipeline && strlen(device) && device[strlen(device) - 1] == ')')
            device[strlen(device) - 1] = '\0';
        const char *model = cJSON_GetStringValue(cJSON_GetObjectItem(o, "model"));
        const char *wt = cJSON_GetStringValue(cJSON_GetObjectItem(o, "weight_type"));
        const char *test = cJSON_GetStringValue(cJSON_GetObjectItem(o, "test"));
        char labelled[128];
        const cJSON *speedup = cJSON_GetObjectItem(o, "speedup");
        if (test && speedup && !a.csv) { /* a speculative row says how it went */
            snprintf(labelled, sizeof labelled, "%s: %.2fx, %.0f%% kept, %.1f a pass", test,
                     speedup->valuedouble,
                     100 * cJSON_GetNumberValue(cJSON_GetObjectItem(o, "acceptance")),
                     cJSON_GetNumberValue(cJSON_GetObjectItem(o, "tokens_per_verify")));
            test = labelled;
        }
        double tps = cJSON_GetNumberValue(cJSON_GetObjectItem(o, "tokens_per_s"));
        double sd = cJSON_GetNumberValue(cJSON_GetObjectItem(o, "sd"));
        double rss = cJSON_GetNumberValue(cJSON_GetObjectItem(o, "peak_rss_bytes")) / 1048576.0;
        cJSON *share = cJSON_GetObjectItem(o, "roofline_share");
        char roof[32] = "";
        if (share)
            snprintf(roof, sizeof roof, "%.0f%%", 100 * share->valuedouble);
        if (e && !a.csv)
            printf("| %s | | | | %s | error: %s | | |\n", variant, test ? test : "", e);
        else if (a.csv)
            printf("%s,\"%s\",%s,%s,%s,%.2f,%.2f,%.0f,%s\n", variant, device, model ? model : "",
                   wt ? wt : "", test ? test : "", tps, sd, rss, share ? roof : "");
        else
            printf("| %s | %s | %s | %s | %s | %.1f +- %.1f | %.0f MiB | %s |\n", variant, device,
                   model ? model : "", wt ? wt : "", test ? test : "", tps, sd, rss, roof);
    }
    cJSON_Delete(results);
    return failures ? 1 : 0;
}
