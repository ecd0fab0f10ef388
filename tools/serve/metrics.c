/*
 * tools/serve/metrics.c - what `loom serve` counts and shows at /metrics (Prometheus text):
 * the engine's figures, the server's, latency histograms, and per tenant (to an admin key).
 */
#define _GNU_SOURCE
#include "tools/serve/server.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A Prometheus histogram's bounds in seconds, those of Prometheus' client libraries */
static const double latency_buckets[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
_Static_assert(sizeof latency_buckets / sizeof *latency_buckets == N_LATENCY_BUCKETS,
               "server.h's N_LATENCY_BUCKETS");

static void observe(histogram *h, double seconds)
{
    size_t b = 0;
    while (b < N_LATENCY_BUCKETS && seconds > latency_buckets[b])
        b++;
    h->in[b]++;
    h->sum += seconds;
}

/* Counts a request's waiting and first token (who: its tenant, 0 none) from the engine's last
 * event: the queue of one that started, the first token of one that generated. */
void metrics_observe(server *srv, int who, version_stats *version, const loom_event *ev)
{
    latencies *seen[3] = {&srv->seen, who > 0 ? &srv->tenants[who - 1].seen : NULL,
                          version ? &version->seen : NULL};
    pthread_mutex_lock(&srv->count_lock);
    for (int i = 0; i < 3; i++) {
        latencies *l = seen[i];
        if (l && ev->queue_ms > 0)
            observe(&l->queue, ev->queue_ms / 1e3);
        if (l && ev->ttft_ms > 0 && ev->n_generated > 0)
            observe(&l->ttft, ev->ttft_ms / 1e3);
    }
    if (version)
        version->generated += (uint64_t)(ev->n_generated > 0 ? ev->n_generated : 0);
    pthread_mutex_unlock(&srv->count_lock);
}

/* A 429 for a request of tenant who (0: none): refused at once, or displaced while waiting. */
void metrics_count_refused(server *srv, int who)
{
    if (who <= 0)
        return;
    pthread_mutex_lock(&srv->count_lock);
    srv->tenants[who - 1].refused++;
    pthread_mutex_unlock(&srv->count_lock);
}

/* A histogram's lines (its buckets made cumulative, _sum, _count) for metric, with a label
 * before le (key="name") or none (""). */
static void append_histogram(char **out, size_t *len, size_t *cap, const char *metric,
                             const char *label, const histogram *h)
{
    char line[256];
    uint64_t below = 0;
    const char *comma = *label ? "," : "";
    for (size_t b = 0; b <= N_LATENCY_BUCKETS; b++) {
        below += h->in[b];
        char le[16] = "+Inf";
        if (b < N_LATENCY_BUCKETS)
            snprintf(le, sizeof le, "%g", latency_buckets[b]);
        int k = snprintf(line, sizeof line, "%s_bucket{%s%sle=\"%s\"} %llu\n", metric, label, comma,
                         le, (unsigned long long)below);
        buf_append(out, len, cap, line, (size_t)k);
    }
    const char *open = *label ? "{" : "", *close = *label ? "}" : "";
    int k = snprintf(line, sizeof line, "%s_sum%s%s%s %.6f\n%s_count%s%s%s %llu\n", metric, open,
                     label, close, h->sum, metric, open, label, close, (unsigned long long)below);
    buf_append(out, len, cap, line, (size_t)k);
}

/* The histograms of time in the queue and to the first token: the server's, then per key. */
static void append_latencies(server *srv, int per_key, char **out, size_t *len, size_t *cap)
{
    static const struct {
        const char *name, *help;
    } kinds[2] = {
        {"queue_seconds", "Time from a request's arrival to its admission (requests that started)"},
        {"time_to_first_token_seconds",
         "Time from a request's arrival to its first generated token"},
    };
    char metric[96], label[96], line[512];
    pthread_mutex_lock(&srv->count_lock);
    for (int i = 0; i < 2; i++) {
        snprintf(metric, sizeof metric, "loom_%s", kinds[i].name);
        int k = snprintf(line, sizeof line, "# HELP %s %s.\n# TYPE %s histogram\n", metric,
                         kinds[i].help, metric);
        buf_append(out, len, cap, line, (size_t)k);
        append_histogram(out, len, cap, metric, "", i ? &srv->seen.ttft : &srv->seen.queue);
    }
    for (int i = 0; i < 2 && per_key; i++) {
        snprintf(metric, sizeof metric, "loom_key_%s", kinds[i].name);
        int k = snprintf(line, sizeof line,
                         "# HELP %s %s, by API key name (--api-keys).\n# TYPE %s histogram\n",
                         metric, kinds[i].help, metric);
        buf_append(out, len, cap, line, (size_t)k);
        for (int t = 0; t < srv->n_tenants; t++) {
            snprintf(label, sizeof label, "key=\"%s\"", srv->tenants[t].name);
            const latencies *l = &srv->tenants[t].seen;
            append_histogram(out, len, cap, metric, label, i ? &l->ttft : &l->queue);
        }
    }
    pthread_mutex_unlock(&srv->count_lock);
}

/* The server's figures; per_key: also each tenant's, by name (for an admin key only: a
 * tenant's name and traffic are no other tenant's business). */
enum MHD_Result metrics_send(server *srv, struct MHD_Connection *con, int per_key)
{
    served *sv = served_acquire(srv);
    loom_engine_stats s = loom_engine_get_stats(sv->engine);
    int32_t window = loom_model_sliding_window(sv->api.model);
    unsigned long long state_bytes = loom_model_state_bytes(sv->api.model);
    served_release(srv, sv);
    pthread_mutex_lock(&srv->count_lock);
    uint64_t http = srv->http_requests, errors = srv->http_errors, gone = srv->disconnects;
    pthread_mutex_unlock(&srv->count_lock);
    char *out = NULL;
    size_t len = 0, cap = 0;
    char line[512];
#define METRIC(name, type, help, fmt, ...)                                                         \
    do {                                                                                           \
        int k = snprintf(line, sizeof line,                                                        \
                         "# HELP " name " " help "\n# TYPE " name " " type "\n" name fmt "\n",     \
                         __VA_ARGS__);                                                             \
        buf_append(&out, &len, &cap, line, (size_t)k);                                             \
    } while (0)
    METRIC("loom_requests_running", "gauge", "Requests being generated.", " %d", s.running);
    METRIC("loom_requests_waiting", "gauge", "Requests queued for admission.", " %d", s.waiting);
    METRIC("loom_queue_limit", "gauge", "Requests the queue holds (--max-queue).", " %d",
           s.max_queue);
    {
        int k = snprintf(line, sizeof line,
                         "# HELP loom_requests_waiting_by_priority Requests queued, by their own "
                         "priority (the last, \">=N\", takes in every worse one past %d "
                         "priorities).\n# TYPE loom_requests_waiting_by_priority gauge\n",
                         LOOM_STATS_PRIORITIES);
        buf_append(&out, &len, &cap, line, (size_t)k);
        for (int i = 0; i < s.n_waiting_priorities; i++) {
            int rest = i == LOOM_STATS_PRIORITIES - 1;
            k = snprintf(line, sizeof line,
                         "loom_requests_waiting_by_priority{priority=\"%s%d\"} %d\n",
                         rest ? ">=" : "", s.waiting_priority[i], s.waiting_count[i]);
            buf_append(&out, &len, &cap, line, (size_t)k);
        }
    }
    for (int which = 0; which < 2 && per_key; which++) {
        const char *metric = which ? "loom_key_refused_busy_total" : "loom_key_requests_total";
        int k = snprintf(line, sizeof line,
                         "# HELP %s %s by API key name (--api-keys).\n# TYPE %s counter\n", metric,
                         which ? "Requests answered 429" : "Requests", metric);
        buf_append(&out, &len, &cap, line, (size_t)k);
        for (int i = 0; i < srv->n_tenants; i++) {
            pthread_mutex_lock(&srv->count_lock);
            uint64_t n = which ? srv->tenants[i].refused : srv->tenants[i].requests;
            pthread_mutex_unlock(&srv->count_lock);
            k = snprintf(line, sizeof line, "%s{key=\"%s\"} %llu\n", metric, srv->tenants[i].name,
                         (unsigned long long)n);
            buf_append(&out, &len, &cap, line, (size_t)k);
        }
    }
    append_latencies(srv, per_key, &out, &len, &cap);
    METRIC("loom_requests_refused_busy_total", "counter",
           "Requests answered 429 because the queue was full (at once, or displaced before they "
           "started by one of better priority).",
           " %llu", (unsigned long long)s.refused_busy);
    METRIC("loom_requests_displaced_total", "counter",
           "Of them, those a request of better priority took the place of.", " %llu",
           (unsigned long long)s.displaced);
    METRIC("loom_requests_deadline_total", "counter",
           "Requests whose deadline came: while waiting (504) or generating (cut short).",
           "{while=\"waiting\"} %llu\nloom_requests_deadline_total{while=\"generating\"} %llu",
           (unsigned long long)s.deadline_waiting, (unsigned long long)s.deadline_running);
    METRIC("loom_speculative_proposed_total", "counter",
           "Proposals checked (speculative decoding: lookup or a drafter).", " %llu",
           (unsigned long long)s.drafted);
    METRIC("loom_speculative_accepted_total", "counter",
           "Of them, those kept: tokens that cost no pass of their own.", " %llu",
           (unsigned long long)s.accepted);
    METRIC("loom_requests_finished_total", "counter", "Generations finished (any reason).", " %llu",
           (unsigned long long)s.requests_done);
    METRIC("loom_generated_tokens_total", "counter", "Tokens generated.", " %llu",
           (unsigned long long)s.generated_tokens);
    METRIC("loom_prompt_tokens_total", "counter", "Prompt tokens admitted.", " %llu",
           (unsigned long long)s.prompt_tokens);
    METRIC("loom_prefix_cache_hit_tokens_total", "counter",
           "Prompt tokens whose KV came from the prefix cache.", " %llu",
           (unsigned long long)s.cached_prompt_tokens);
    METRIC("loom_prefix_cache_hit_rate", "gauge", "Share of prompt tokens served from the cache.",
           " %.6f",
           s.prompt_tokens ? (double)s.cached_prompt_tokens / (double)s.prompt_tokens : 0.0);
    METRIC("loom_prefix_cache_restored_blocks", "gauge",
           "KV blocks of the prefix cache read back at start (--prompt-cache-dir).", " %d",
           s.prefix_blocks_restored);
    METRIC("loom_prefix_cache_restored_hit_tokens_total", "counter",
           "Prompt tokens found in those restored blocks.", " %llu",
           (unsigned long long)s.restored_hit_tokens);
    METRIC("loom_generation_tokens_per_second", "gauge", "Generated tokens per second, recently.",
           " %.3f", s.tokens_per_s);
    int k = snprintf(line, sizeof line,
                     "# HELP loom_kv_blocks KV cache blocks by state (block size %d tokens).\n"
                     "# TYPE loom_kv_blocks gauge\nloom_kv_blocks{state=\"used\"} %d\n"
                     "loom_kv_blocks{state=\"cached\"} %d\nloom_kv_blocks{state=\"free\"} %d\n",
                     s.block_size, s.kv_used, s.kv_cached, s.kv_free);
    buf_append(&out, &len, &cap, line, (size_t)k);
    METRIC("loom_kv_sliding_window_tokens", "gauge",
           "The model's attention window (0: none). KV blocks wholly outside a running "
           "sequence's window are not released early: they stay used until it ends.",
           " %d", window);
    METRIC("loom_recurrent_state_bytes_per_sequence", "gauge",
           "A model with recurrent layers: the state a running sequence holds beside its KV "
           "blocks (0: none).",
           " %llu", state_bytes);
    METRIC("loom_preemptions_total", "counter", "Running requests preempted for KV blocks.",
           " %llu", (unsigned long long)s.preemptions);
    METRIC("loom_engine_steps_total", "counter", "Forward passes run.", " %llu",
           (unsigned long long)s.steps);
    METRIC("loom_http_requests_total", "counter", "HTTP requests received.", " %llu",
           (unsigned long long)http);
    METRIC("loom_http_errors_total", "counter", "HTTP requests answered with an error.", " %llu",
           (unsigned long long)errors);
    METRIC("loom_client_disconnects_total", "counter", "Clients gone before their answer ended.",
           " %llu", (unsigned long long)gone);
    METRIC("loom_connections_timed_out_total", "counter",
           "Connections closed for sending headers, a body or the next request too slowly.",
           " %llu", (unsigned long long)conn_guard_timed_out(srv->guard));
    METRIC("loom_connections_evicted_total", "counter",
           "Connections closed to make room for a new one when every slot was taken.", " %llu",
           (unsigned long long)conn_guard_evicted(srv->guard));
#undef METRIC
    /* each loaded model's engine (the figures above are the first model's) */
    pthread_mutex_lock(&srv->live_lock);
    static const struct {
        const char *name, *type, *help;
    } per_model[] = {
        {"loom_model_requests_running", "gauge", "Requests being generated, by model"},
        {"loom_model_requests_waiting", "gauge", "Requests waiting to run, by model"},
        {"loom_model_generated_tokens_total", "counter", "Tokens generated, by model"},
        {"loom_model_kv_blocks_used", "gauge", "KV cache blocks in use, by model"},
    };
    for (size_t f = 0; f < sizeof per_model / sizeof *per_model; f++) {
        int n = snprintf(line, sizeof line, "# HELP %s %s.\n# TYPE %s %s\n", per_model[f].name,
                         per_model[f].help, per_model[f].name, per_model[f].type);
        buf_append(&out, &len, &cap, line, (size_t)n);
        for (int i = -1; i < srv->n_slots; i++) {
            const served *m = i < 0 ? srv->live : srv->slots[i].live;
            if (!m)
                continue;
            loom_engine_stats ms = loom_engine_get_stats(m->engine);
            unsigned long long v = f == 0 ? (unsigned long long)ms.running
                : f == 1                  ? (unsigned long long)ms.waiting
                : f == 2                  ? (unsigned long long)ms.generated_tokens
                                          : (unsigned long long)ms.kv_used;
            n = snprintf(line, sizeof line, "%s{model=\"%s\"} %llu\n", per_model[f].name,
                         m->api.model_name, v);
            buf_append(&out, &len, &cap, line, (size_t)n);
        }
    }
    /* each model version requests were routed to (a canary beside the stable one) */
    for (int m = 0; m < 2; m++) {
        static const char *const names[] = {"loom_model_version_requests_total",
                                            "loom_model_version_failures_total"};
        static const char *const helps[] = {
            "Requests routed to a model's version (since it became that version)",
            "Of them, answered with an error (429 and 504, the server's load, not counted)"};
        int k = snprintf(line, sizeof line, "# HELP %s %s.\n# TYPE %s counter\n", names[m],
                         helps[m], names[m]);
        buf_append(&out, &len, &cap, line, (size_t)k);
        for (int i = 0; i < srv->n_versions; i++) {
            const version_stats *v = &srv->versions[i];
            k = snprintf(line, sizeof line, "%s{model=\"%s\",version=\"%s\"} %llu\n", names[m],
                         v->model, v->canary ? "canary" : "stable",
                         (unsigned long long)__atomic_load_n(m ? &v->failures : &v->routed,
                                                             __ATOMIC_RELAXED));
            buf_append(&out, &len, &cap, line, (size_t)k);
        }
    }
    /* and each version's generated tokens and time to the first one (the canary's speed beside
     * the stable one's) */
    k = snprintf(line, sizeof line,
                 "# HELP loom_model_version_generated_tokens_total Tokens a model's version "
                 "generated.\n# TYPE loom_model_version_generated_tokens_total counter\n");
    buf_append(&out, &len, &cap, line, (size_t)k);
    pthread_mutex_lock(&srv->count_lock);
    for (int i = 0; i < srv->n_versions; i++) {
        const version_stats *v = &srv->versions[i];
        k = snprintf(line, sizeof line,
                     "loom_model_version_generated_tokens_total{model=\"%s\",version=\"%s\"} "
                     "%llu\n",
                     v->model, v->canary ? "canary" : "stable", (unsigned long long)v->generated);
        buf_append(&out, &len, &cap, line, (size_t)k);
    }
    for (int i = 0; i < srv->n_versions; i++) {
        char label[220];
        snprintf(label, sizeof label, "model=\"%s\",version=\"%s\"", srv->versions[i].model,
                 srv->versions[i].canary ? "canary" : "stable");
        if (i == 0) {
            k = snprintf(line, sizeof line,
                         "# HELP loom_model_version_time_to_first_token_seconds A model "
                         "version's requests' time to their first token.\n# TYPE "
                         "loom_model_version_time_to_first_token_seconds histogram\n");
            buf_append(&out, &len, &cap, line, (size_t)k);
        }
        append_histogram(&out, &len, &cap, "loom_model_version_time_to_first_token_seconds", label,
                         &srv->versions[i].seen.ttft);
    }
    pthread_mutex_unlock(&srv->count_lock);
    pthread_mutex_unlock(&srv->live_lock);
    enum MHD_Result ok = http_send_text(con, 200, "text/plain; version=0.0.4", out ? out : "");
    free(out);
    return ok;
}
