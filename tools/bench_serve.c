/*
 * tools/bench_serve.c - `loom bench serve`: what continuous batching buys. The same requests
 * (distinct random prompts, a fixed number of generated tokens each) run one at a time, then
 * from N concurrent clients, through the serving engine; reported: generated tokens/s, time to
 * first token and request latency percentiles. Without -m a synthetic model is written first.
 */
#define _GNU_SOURCE
#include <loom/loom.h>

#include "args.h"

#include <cjson/cJSON.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct sample {
    double ttft_ms, latency_ms;
    int32_t generated;
    int failed;
} sample;

typedef struct shared {
    loom_engine *engine;
    int32_t **prompts;
    int32_t n_prompt, n_gen, lookup;
    int draft;
    int next, n_requests;
    sample *samples;
    pthread_mutex_t mu;
} shared;

typedef struct waiter {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done;
    loom_event last;
} waiter;


static void on_event(void *user, const loom_event *ev)
{
    waiter *w = user;
    if (ev->kind == LOOM_EVENT_TEXT)
        return;
    pthread_mutex_lock(&w->mu);
    w->last = *ev;
    w->last.text = NULL, w->last.error = NULL, w->last.finish_reason = NULL;
    w->done = ev->kind == LOOM_EVENT_DONE ? 1 : 2;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

/* A client: takes the next request, waits for its answer, repeats. */
static void *client(void *arg)
{
    shared *s = arg;
    waiter w;
    pthread_mutex_init(&w.mu, NULL);
    pthread_cond_init(&w.cv, NULL);
    for (;;) {
        pthread_mutex_lock(&s->mu);
        int i = s->next < s->n_requests ? s->next++ : -1;
        pthread_mutex_unlock(&s->mu);
        if (i < 0)
            break;
        loom_sampling greedy = loom_sampling_defaults();
        greedy.temperature = 0;
        greedy.ignore_eos = 1; /* every request generates exactly n_gen tokens */
        loom_request r = {.prompt = s->prompts[i],
                          .n_prompt = s->n_prompt,
                          .max_tokens = s->n_gen,
                          .sampling = greedy,
                          .lookup = s->lookup,
                          .draft = s->draft};
        char err[512];
        w.done = 0;
        double t0 = loom_now_ms();
        if (loom_engine_submit(s->engine, &r, on_event, &w, err, sizeof err) < 0) {
            fprintf(stderr, "loom bench serve: %s\n", err);
            s->samples[i].failed = 1;
            continue;
        }
        pthread_mutex_lock(&w.mu);
        while (!w.done)
            pthread_cond_wait(&w.cv, &w.mu);
        pthread_mutex_unlock(&w.mu);
        s->samples[i] = (sample){w.last.ttft_ms, loom_now_ms() - t0, w.last.n_generated,
                                 w.done != 1};
    }
    pthread_mutex_destroy(&w.mu);
    pthread_cond_destroy(&w.cv);
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(double *v, int n, double p)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    int k = (int)(p / 100.0 * (n - 1) + 0.5);
    return n ? v[k < n ? k : n - 1] : 0;
}

typedef struct result {
    int clients, requests, failed;
    double seconds, tok_s, req_s, ttft50, ttft90, lat50, lat90, lat99;
    uint64_t preemptions;
} result;

static result run_phase(loom_engine *e, int32_t **prompts, int n_requests, int32_t n_prompt,
                        int32_t n_gen, int clients, int32_t lookup, int draft)
{
    shared s = {.engine = e,
                .prompts = prompts,
                .n_prompt = n_prompt,
                .n_gen = n_gen,
                .lookup = lookup,
                .draft = draft,
                .n_requests = n_requests,
                .samples = calloc((size_t)n_requests, sizeof(sample))};
    pthread_mutex_init(&s.mu, NULL);
    pthread_t *th = calloc((size_t)clients, sizeof *th);
    uint64_t pre0 = loom_engine_get_stats(e).preemptions;
    double t0 = loom_now_ms();
    for (int c = 0; c < clients; c++)
        pthread_create(&th[c], NULL, client, &s);
    for (int c = 0; c < clients; c++)
        pthread_join(th[c], NULL);
    double dt = (loom_now_ms() - t0) / 1e3;
    result r = {clients, n_requests, 0, dt, 0, 0, 0, 0, 0, 0, 0, 0};
    double *ttft = calloc((size_t)n_requests, sizeof *ttft),
           *lat = calloc((size_t)n_requests, sizeof *lat);
    uint64_t gen = 0;
    int n = 0;
    for (int i = 0; i < n_requests; i++) {
        if (s.samples[i].failed) {
            r.failed++;
            continue;
        }
        gen += (uint64_t)s.samples[i].generated;
        ttft[n] = s.samples[i].ttft_ms;
        lat[n++] = s.samples[i].latency_ms;
    }
    r.tok_s = (double)gen / dt;
    r.req_s = n / dt;
    r.ttft50 = pct(ttft, n, 50), r.ttft90 = pct(ttft, n, 90);
    r.lat50 = pct(lat, n, 50), r.lat90 = pct(lat, n, 90), r.lat99 = pct(lat, n, 99);
    r.preemptions = loom_engine_get_stats(e).preemptions - pre0;
    free(ttft), free(lat), free(th), free(s.samples);
    pthread_mutex_destroy(&s.mu);
    return r;
}

/* ---- --overload X: an open-loop load at X times the measured capacity --------------------- */

typedef struct offered {
    double t_submit, t_first, t_done;
    int high;    /* priority -1 (one request in ten) */
    int outcome; /* 0 in flight, 1 answered, 2 error, 3 refused at once (busy), 4 displaced
                  * before it started by one of better priority (busy) */
    int32_t generated;
} offered;

typedef struct overload_state {
    pthread_mutex_t mu;
    int outstanding;
} overload_state;

static overload_state ostate = {PTHREAD_MUTEX_INITIALIZER, 0};

static void on_offered(void *user, const loom_event *ev)
{
    offered *o = user;
    if (ev->kind == LOOM_EVENT_TEXT) {
        if (ev->token >= 0 && !o->t_first)
            o->t_first = loom_now_ms();
        return;
    }
    pthread_mutex_lock(&ostate.mu);
    o->t_done = loom_now_ms();
    o->generated = ev->n_generated;
    o->outcome = ev->kind == LOOM_EVENT_DONE ? 1 : ev->busy ? 4 : 2;
    ostate.outstanding--;
    pthread_mutex_unlock(&ostate.mu);
}

static double rss_mb(void)
{
    long pages = 0, resident = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (f && fscanf(f, "%ld %ld", &pages, &resident) != 2)
        resident = 0;
    if (f)
        fclose(f);
    return (double)resident * (double)sysconf(_SC_PAGESIZE) / 1048576.0;
}

typedef struct overload_result {
    double rate, seconds, busy_share, high_ttft50, high_ttft99, low_ttft50, rss_warm, rss_max;
    int offered, answered, errors, busy, displaced, lost, high, high_busy;
} overload_result;

/* Offers requests at rate per second for seconds, one in ten at priority -1, each with a fresh
 * random prompt; then waits for every one to end (or 60 s more: what is left is lost). */
static overload_result run_overload(loom_engine *e, int32_t n_vocab, int32_t n_prompt,
                                    int32_t n_gen, double rate, double seconds)
{
    overload_result r = {.rate = rate, .seconds = seconds};
    int cap = (int)(rate * seconds * 1.1) + 16;
    offered *o = calloc((size_t)cap, sizeof *o);
    int32_t *prompt = malloc((size_t)n_prompt * sizeof *prompt);
    loom_sampling greedy = loom_sampling_defaults();
    greedy.temperature = 0;
    greedy.ignore_eos = 1;
    uint64_t x = 7;
    double t0 = loom_now_ms(), next = t0, last_rss = t0;
    int n = 0;
    r.rss_warm = 0;
    while (n < cap && loom_now_ms() - t0 < seconds * 1e3) {
        double now = loom_now_ms();
        if (now < next) {
            usleep((useconds_t)((next - now) * 1e3));
            continue;
        }
        next += 1e3 / rate;
        for (int32_t j = 0; j < n_prompt; j++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            prompt[j] = 3 + (int32_t)((x >> 33) % (uint64_t)(n_vocab - 3));
        }
        offered *q = &o[n++];
        q->high = n % 10 == 0;
        q->t_submit = loom_now_ms();
        loom_request req = {.prompt = prompt,
                            .n_prompt = n_prompt,
                            .max_tokens = n_gen,
                            .sampling = greedy,
                            .priority = q->high ? -1 : 0};
        char err[512];
        pthread_mutex_lock(&ostate.mu);
        ostate.outstanding++;
        pthread_mutex_unlock(&ostate.mu);
        int64_t id = loom_engine_submit(e, &req, on_offered, q, err, sizeof err);
        if (id < 0) {
            pthread_mutex_lock(&ostate.mu);
            ostate.outstanding--;
            q->outcome = id == LOOM_ENGINE_BUSY ? 3 : 2;
            pthread_mutex_unlock(&ostate.mu);
        }
        if (now - last_rss >= 1000) { /* the footprint, once warm (a fifth of the way in) */
            double mb = rss_mb();
            if (!r.rss_warm && now - t0 >= seconds * 200)
                r.rss_warm = mb;
            r.rss_max = mb > r.rss_max ? mb : r.rss_max;
            last_rss = now;
        }
    }
    for (int waited = 0; waited < 60000; waited += 10) {
        pthread_mutex_lock(&ostate.mu);
        int left = ostate.outstanding;
        pthread_mutex_unlock(&ostate.mu);
        if (!left)
            break;
        usleep(10000);
    }
    double *high = calloc((size_t)n + 1, sizeof *high), *low = calloc((size_t)n + 1, sizeof *low);
    int n_high = 0, n_low = 0;
    pthread_mutex_lock(&ostate.mu);
    for (int i = 0; i < n; i++) {
        r.offered++;
        r.answered += o[i].outcome == 1;
        r.errors += o[i].outcome == 2;
        r.busy += o[i].outcome == 3;
        r.displaced += o[i].outcome == 4;
        r.lost += o[i].outcome == 0;
        r.high += o[i].high;
        r.high_busy += o[i].high && o[i].outcome >= 3;
        if (o[i].outcome == 1 && o[i].t_first) {
            double ttft = o[i].t_first - o[i].t_submit;
            if (o[i].high)
                high[n_high++] = ttft;
            else
                low[n_low++] = ttft;
        }
    }
    pthread_mutex_unlock(&ostate.mu);
    r.busy_share = r.offered ? (double)r.busy / r.offered : 0;
    r.high_ttft50 = pct(high, n_high, 50), r.high_ttft99 = pct(high, n_high, 99);
    r.low_ttft50 = pct(low, n_low, 50);
    if (!r.rss_warm)
        r.rss_warm = rss_mb();
    free(high), free(low), free(prompt);
    if (r.lost == 0)
        free(o); /* what is lost may still be written by the engine: kept */
    return r;
}

int loom_bench_serve_main(int argc, char **argv)
{
    const char *model = NULL, *shape = "160m", *type = "f16"; /* unquantised, as servers run */
    const char *layers = NULL, *draft = NULL;
    long clients = 16, requests = 0, n_prompt = 64, n_gen = 64, max_batch = 0, max_step = 0,
         lookup = 0;
    int json = 0, concurrent_only = 0, distributed = 0;
    float overload = 0, duration = 60;
    char shape_help[512];
    snprintf(shape_help, sizeof shape_help, "%s (default 160m)", loom_synthetic_shapes());
    const loom_flag flags[] = {
        LOOM_FLAG_MODEL(&model),
        {"--synthetic", NULL, LOOM_FLAG_TEXT, &shape, 0, 0, "SHAPE", shape_help},
        {"--type", NULL, LOOM_FLAG_TEXT, &type, 0, 0, "TYPE",
         "weights of the synthetic model (default f16)"},
        {"--clients", NULL, LOOM_FLAG_LONG, &clients, 1, 1024, "N",
         "concurrent clients (default 16)"},
        {"--requests", NULL, LOOM_FLAG_LONG, &requests, 1, 1 << 20, "N",
         "requests in all (default: as many as clients)"},
        {"--prompt-tokens", NULL, LOOM_FLAG_LONG, &n_prompt, 1, 1 << 16, "N",
         "prompt tokens a request (default 64)"},
        {"--gen-tokens", NULL, LOOM_FLAG_LONG, &n_gen, 1, 1 << 16, "N",
         "tokens generated a request (default 64)"},
        {"--max-batch", NULL, LOOM_FLAG_LONG, &max_batch, 1, 4096, "N",
         "sequences run together (default: as many as clients)"},
        {"--max-tokens-per-step", NULL, LOOM_FLAG_LONG, &max_step, 1, 1 << 20, "N",
         "tokens one engine step computes, prefill chunks and decodes together (default 256, "
         "or --max-batch if more)"},
        {"--lookup", NULL, LOOM_FLAG_LONG, &lookup, 0, 64, "N",
         "every request speculates by prompt lookup (n-grams up to N)"},
        {"--draft", NULL, LOOM_FLAG_TEXT, &draft, 0, 0, "MODEL",
         "... or with this drafter model (greedy proposals, p-min 0.75)"},
        {"--json", NULL, LOOM_FLAG_SWITCH, &json, 0, 0, NULL, "one JSON object"},
        LOOM_FLAG_DISTRIBUTED(&distributed),
        LOOM_FLAG_LAYERS(&layers),
        {"--concurrent-only", NULL, LOOM_FLAG_SWITCH, &concurrent_only, 0, 0, NULL,
         "skip the serial run"},
        {"--overload", NULL, LOOM_FLAG_FLOAT, &overload, 0.1, 100, "X",
         "then offer X times the measured capacity (requests/s), one in ten\n"
         "at high priority, for --duration: 429s, high-priority TTFT, RSS, lost"},
        {"--duration", NULL, LOOM_FLAG_FLOAT, &duration, 1, 3600, "S",
         "seconds of --overload (default 60)"},
    };
    const loom_command cmd = {
        .name = "loom bench serve",
        .synopsis = "[-m MODEL | --synthetic SHAPE [--type TYPE]] [--clients 16] [options]\n"
                    "  runs the requests one at a time, then from --clients concurrent clients, "
                    "through the\n  serving engine (continuous batching)",
        .flags = flags,
        .n_flags = LOOM_N_FLAGS(flags)};
    int parsed = loom_args_parse(&cmd, argc, argv);
    if (parsed)
        return parsed == 1 ? 0 : parsed;
    if (!requests)
        requests = clients;
    if (!max_batch)
        max_batch = clients;
    char err[4096], tmp[4096] = "";
    if (!model) {
        const char *dir = getenv("TMPDIR");
        snprintf(tmp, sizeof tmp, "%s/loom-bench-serve-%d-%s-%s.gguf", dir && *dir ? dir : "/tmp",
                 (int)getpid(), shape, type);
        fprintf(stderr, "writing the synthetic %s model (%s) to %s...\n", shape, type, tmp);
        if (loom_write_synthetic_model(tmp, shape, type, err, sizeof err) != 0) {
            fprintf(stderr, "loom bench serve: %s\n", err);
            return 2;
        }
        model = tmp;
    }
    int rc = 1;
    int32_t ctx = (int32_t)(n_prompt + n_gen + 1);
    int32_t per_seq = (ctx + 15) / 16;
    loom_model_options mo = {.n_ctx = ctx,
                             .kv_blocks = (int32_t)(max_batch * per_seq + per_seq),
                             /* a hybrid model's state slots, one set per batch place */
                             .kv_sequences = (int32_t)max_batch,
                             .distributed = distributed ? 2 : 1,
                             .stage_layers = layers};
    loom_model *m = loom_model_open(model, &mo, err, sizeof err);
    if (!m) {
        fprintf(stderr, "loom bench serve: %s\n", err);
        goto out;
    }
    int followed = loom_args_follow("loom bench serve", m);
    if (followed >= 0) {
        rc = followed;
        goto out;
    }
    /* every client's request waits its turn: the queue holds them all */
    loom_engine_options eo = {.max_batch = (int32_t)max_batch,
                              .max_tokens_per_step = (int32_t)(max_step              ? max_step
                                                                   : max_batch > 256 ? max_batch
                                                                                     : 256),
                              .max_queue = (int32_t)(clients > max_batch ? clients : max_batch),
                              .draft_p_min = 0.75f};
    loom_model_options dmo = mo;
    dmo.distributed = 0;
    loom_model *drafter = draft ? loom_model_open(draft, &dmo, err, sizeof err) : NULL;
    eo.draft = drafter;
    loom_engine *e = !draft || drafter ? loom_engine_start(m, &eo, err, sizeof err) : NULL;
    if (!e) {
        fprintf(stderr, "loom bench serve: %s%s\n", draft ? "with the drafter: " : "", err);
        loom_model_close(drafter);
        loom_model_close(m);
        goto out;
    }
    /* distinct random prompts, so nothing is served from the prefix cache */
    int32_t n_vocab = loom_model_n_vocab(m);
    int32_t **prompts = calloc((size_t)requests, sizeof *prompts);
    uint64_t x = 42;
    for (long i = 0; i < requests; i++) {
        prompts[i] = malloc((size_t)n_prompt * sizeof **prompts);
        for (long j = 0; j < n_prompt; j++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            prompts[i][j] = 3 + (int32_t)((x >> 33) % (uint64_t)(n_vocab - 3));
        }
    }
    fprintf(stderr, "%s on %s: %ld requests of %ld prompt + %ld generated tokens\n",
            loom_model_name(m), loom_model_backend(m), requests, n_prompt, n_gen);
    result one = {0};
    if (!concurrent_only)
        one = run_phase(e, prompts, (int)requests, (int32_t)n_prompt, (int32_t)n_gen, 1,
                        (int32_t)lookup, draft != NULL);
    /* new first tokens: the concurrent run must not reuse the first run's cached blocks */
    for (long i = 0; i < requests; i++)
        prompts[i][0] = 3 + (prompts[i][0] - 2) % (n_vocab - 3);
    result many = run_phase(e, prompts, (int)requests, (int32_t)n_prompt, (int32_t)n_gen,
                            (int)clients, (int32_t)lookup, draft != NULL);
    loom_engine_stats st = loom_engine_get_stats(e);
    result *rs[2] = {&one, &many};
    int first = concurrent_only;
    if (json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "model", loom_model_name(m));
        cJSON_AddStringToObject(o, "backend", loom_model_backend(m));
        cJSON_AddNumberToObject(o, "prompt_tokens", (double)n_prompt);
        cJSON_AddNumberToObject(o, "gen_tokens", (double)n_gen);
        cJSON *arr = cJSON_AddArrayToObject(o, "runs");
        for (int k = first; k < 2; k++) {
            cJSON *r = cJSON_CreateObject();
            cJSON_AddNumberToObject(r, "clients", rs[k]->clients);
            cJSON_AddNumberToObject(r, "requests", rs[k]->requests);
            cJSON_AddNumberToObject(r, "failed", rs[k]->failed);
            cJSON_AddNumberToObject(r, "seconds", rs[k]->seconds);
            cJSON_AddNumberToObject(r, "generated_tokens_per_s", rs[k]->tok_s);
            cJSON_AddNumberToObject(r, "ttft_p50_ms", rs[k]->ttft50);
            cJSON_AddNumberToObject(r, "ttft_p90_ms", rs[k]->ttft90);
            cJSON_AddNumberToObject(r, "latency_p50_ms", rs[k]->lat50);
            cJSON_AddNumberToObject(r, "latency_p90_ms", rs[k]->lat90);
            cJSON_AddNumberToObject(r, "latency_p99_ms", rs[k]->lat99);
            cJSON_AddNumberToObject(r, "preemptions", (double)rs[k]->preemptions);
            cJSON_AddItemToArray(arr, r);
        }
        cJSON_AddNumberToObject(o, "speedup", one.tok_s > 0 ? many.tok_s / one.tok_s : 0);
        cJSON_AddNumberToObject(o, "speculative_proposed", (double)st.drafted);
        cJSON_AddNumberToObject(o, "speculative_accepted", (double)st.accepted);
        char *s = cJSON_Print(o);
        printf("%s\n", s);
        free(s);
        cJSON_Delete(o);
    } else {
        printf(
            "| clients | requests | seconds | generated tok/s | TTFT p50 / p90 ms | latency p50 / p90 / p99 ms | preemptions |\n");
        printf(
            "|--------:|---------:|--------:|----------------:|------------------:|---------------------------:|------------:|\n");
        for (int k = first; k < 2; k++)
            printf(
                "| %7d | %8d | %7.2f | %15.1f | %8.0f / %-6.0f | %8.0f / %6.0f / %-7.0f | %11llu |\n",
                rs[k]->clients, rs[k]->requests, rs[k]->seconds, rs[k]->tok_s, rs[k]->ttft50,
                rs[k]->ttft90, rs[k]->lat50, rs[k]->lat90, rs[k]->lat99,
                (unsigned long long)rs[k]->preemptions);
        if (!concurrent_only)
            printf("\n%ld concurrent clients: %.2fx the generated tokens/s of one at a time "
                   "(%llu engine steps in all)\n",
                   clients, one.tok_s > 0 ? many.tok_s / one.tok_s : 0,
                   (unsigned long long)st.steps);
        if (lookup || draft)
            printf("speculative: %llu proposals checked, %llu kept\n",
                   (unsigned long long)st.drafted, (unsigned long long)st.accepted);
    }
    rc = one.failed || many.failed ? 1 : 0;
    if (overload > 0 && many.req_s > 0) {
        /* the unloaded figure: the serial run's time to first token */
        overload_result ov = run_overload(e, n_vocab, (int32_t)n_prompt, (int32_t)n_gen,
                                          overload * many.req_s, duration);
        printf("\noverload: %.1f requests/s offered (%.1fx the %.1f measured) for %.0f s, one in "
               "ten at priority -1:\n",
               ov.rate, (double)overload, many.req_s, ov.seconds);
        printf("  %d offered: %d answered, %d refused at once (429, %.0f%%), %d displaced before "
               "they started by a better priority (429); of the %d at high priority %d refused; "
               "%d errors, %d lost\n",
               ov.offered, ov.answered, ov.busy, 100 * ov.busy_share, ov.displaced, ov.high,
               ov.high_busy, ov.errors, ov.lost);
        printf("  time to first token: high priority p50 %.0f / p99 %.0f ms (unloaded p50 %.0f / "
               "p90 %.0f ms), the others p50 %.0f ms\n",
               ov.high_ttft50, ov.high_ttft99, one.ttft50, one.ttft90, ov.low_ttft50);
        if (one.ttft50 > 0 && one.ttft90 > 0) /* (not run with --concurrent-only) */
            printf("  high priority p99: %.1fx the unloaded p90, %.1fx the unloaded p50\n",
                   ov.high_ttft99 / one.ttft90, ov.high_ttft99 / one.ttft50);
        printf("  RSS: %.0f MB once warm, at most %.0f MB (%+.1f%%)\n", ov.rss_warm, ov.rss_max,
               ov.rss_warm > 0 ? 100 * (ov.rss_max - ov.rss_warm) / ov.rss_warm : 0);
        if (ov.lost || ov.errors)
            rc = 1;
    }
    loom_engine_stop(e, 0);
    loom_engine_free(e);
    for (long i = 0; i < requests; i++)
        free(prompts[i]);
    free(prompts);
    loom_model_close(drafter);
    loom_model_close(m);
out:
    if (tmp[0])
        unlink(tmp);
    return rc;
}
