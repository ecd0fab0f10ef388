/*
 * tools/serve.c - `loom serve`: an OpenAI-compatible HTTP server on libmicrohttpd.
 *
 * HTTP threads (one per connection) parse, validate and tokenize requests, submit them to the
 * engine (api/engine.c) and turn its events into responses; they never run the model. Each
 * request's state (a job) is shared by its connection thread and the engine thread: a mutex
 * and condition variable guard it, and a reference count frees it once both are done with it.
 * Request and response shapes follow the OpenAI API as the official Python client sends and
 * reads them; tools/openai_request.c checks and reads request bodies.
 */
#define _GNU_SOURCE
#include <loom/loom.h>

#include "args.h"
#include "conn_guard.h"
#include "json_text.h"
#include "openai_request.h"
#include "webui.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <microhttpd.h>
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>


/* A Prometheus histogram of seconds, in the buckets of Prometheus' client libraries: counts
 * per bucket (made cumulative when shown), the +Inf one last. */
static const double latency_buckets[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
#define N_LATENCY_BUCKETS (sizeof latency_buckets / sizeof *latency_buckets)
typedef struct histogram {
    uint64_t in[N_LATENCY_BUCKETS + 1];
    double sum;
} histogram;

/* A request's time in the queue and to its first token, as the engine's last event says. */
typedef struct latencies {
    histogram queue, ttft;
} latencies;

/* One API key of --api-keys: a tenant of the engine (its index + 1), with its own defaults
 * and limits, and its counts for /metrics (by name: the key is never shown). */
typedef struct tenant {
    char name[64];
    char *key;
    size_t key_len;
    int admin;                                /* "admin" on its line: may reload, see all keys */
    int32_t priority, max_running, max_queue; /* priority: the best its requests may ask for */
    uint64_t requests, refused;               /* under count_lock */
    latencies seen;                           /* under count_lock */
} tenant;

/* One opened model with its engine: what requests run on. A reload opens another; new
 * requests go to it, and the old one is freed by the main thread once no request holds it. */
typedef struct served {
    openai_model api;      /* the model, its name, chat template and context */
    loom_chat_format chat; /* api.chat points here */
    loom_engine *engine;
    loom_model *drafter; /* the engine's draft model (--draft, --draft-layers), or NULL */
    int refs;            /* under live_lock: the server's while live, and each request's */
    struct served *next; /* on the retired list */
} served;

typedef struct server {
    openai_model api; /* the first model's settings, which a reload keeps (its model: live's) */
    served *live, *retired; /* under live_lock */
    pthread_mutex_t live_lock;
    pthread_mutex_t reload_lock; /* one reload at a time */
    const char *model_path;
    loom_model_options mo;
    loom_engine_options eo;
    const char *draft_path; /* the drafter's file (--draft, or the model's with --draft-layers) */
    loom_model_options dmo; /* and how it opens: NULL path, none */
    const char *name_flag, *tmpl_flag, *tmpl_file_flag;
    int can_reload;         /* not under a distributed job */
    char reload_error[512]; /* the last reload's failure, "" after a success (under live_lock) */
    int reloads;
    const char *api_key;
    size_t api_key_len;
    const char *admin_key; /* --admin-key-file: the one key that may reload (NULL: see caller) */
    size_t admin_key_len;
    int loopback;              /* bound to 127.0.0.0/8: only loopback names in Host */
    const char *allowed_hosts; /* --allow-host: more names Host may give there (commas) */
    int metrics_auth;          /* /metrics wants the key too */
    int webui;                 /* the chat page at GET / (off: --no-webui) */
    int partition_by_user;     /* --prefix-cache per-user */
    size_t max_body;
    volatile int shutting_down;
    time_t started;
    pthread_mutex_t count_lock;
    uint64_t http_requests, http_errors, disconnects;
    conn_guard *guard;
    sem_t parsing;    /* bodies parsed and tokenized at once: each costs memory and a core */
    double timeout_s; /* --request-timeout: a request's deadline unless it gives one; 0 none */
    tenant *tenants;  /* --api-keys; NULL: one key (api_key) or none */
    int n_tenants;
    latencies seen; /* every request's (under count_lock) */
} server;

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
static void observe_request(server *srv, int who, const loom_event *ev)
{
    latencies *all = &srv->seen, *own = who > 0 ? &srv->tenants[who - 1].seen : NULL;
    pthread_mutex_lock(&srv->count_lock);
    for (latencies *l = all; l; l = l == all ? own : NULL) {
        if (ev->queue_ms > 0)
            observe(&l->queue, ev->queue_ms / 1e3);
        if (ev->ttft_ms > 0 && ev->n_generated > 0)
            observe(&l->ttft, ev->ttft_ms / 1e3);
    }
    pthread_mutex_unlock(&srv->count_lock);
}

/* A 429 for a request of tenant who (0: none): refused at once, or displaced while waiting. */
static void count_refused(server *srv, int who)
{
    if (who <= 0)
        return;
    pthread_mutex_lock(&srv->count_lock);
    srv->tenants[who - 1].refused++;
    pthread_mutex_unlock(&srv->count_lock);
}

/* ---- jobs: one HTTP request's generations ------------------------------------------------- */

/* a generated token's log-probability and its likeliest alternatives' (logprobs) */
typedef struct token_logprob {
    int32_t id, n_top;
    float logprob;
    int32_t top_ids[LOOM_MAX_TOP_LOGPROBS];
    float top_logprobs[LOOM_MAX_TOP_LOGPROBS];
} token_logprob;

typedef struct choice {
    token_logprob *lps; /* with logprobs: one per generated token */
    int n_lps, cap_lps, lps_sent;
    size_t lps_offset; /* completions' text_offset of the first token not yet streamed */
    char *text;
    size_t len, cap, sent; /* sent: bytes already streamed */
    size_t thought_sent;   /* the end of the thought already streamed as reasoning_content */
    int done, final_sent;
    int deadline; /* the request's deadline ended it (engine's event) */
    int busy;     /* displaced from a full queue by a better priority (engine's event) */
    int invalid;  /* its grammar could not be followed (engine's event) */
    char finish[16];
    char error[256];
    int32_t n_generated;
    int64_t id;
} choice;

typedef struct job {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    server *srv;
    struct served *sv; /* the model it runs on (a reference) */
    int chat, stream, include_usage, n;
    choice ch[OPENAI_MAX_CHOICES];
    int32_t n_prompt, n_cached;
    char id[40];
    time_t created;
    /* streaming */
    struct MHD_Connection *con; /* to notice a client that leaves while nothing is sent */
    char *out;
    size_t out_len, out_cap, out_pos;
    int role_sent, finished;
    /* tools: how the answers are read for calls (LOOM_TOOLS_NONE: they are text) */
    loom_tool_syntax tool_syntax;
    char **tool_names;
    int n_tools, parallel_tool_calls;
    int reasoning; /* parsed.reasoning: answers may open with a thought (2: they are in one) */
    int logprobs;
    int32_t prompt_last;       /* what the first generated token follows (its text depends on it) */
    const char *grammar_param; /* the request field its grammar came from (a 400 names it) */
    int tenant;                /* whose key (--api-keys), 0: no tenant */
} job;

typedef struct event_target {
    job *j;
    int index;
} event_target;

/* The model new requests run on, held until release. */
static served *acquire(server *srv)
{
    pthread_mutex_lock(&srv->live_lock);
    served *sv = srv->live;
    sv->refs++;
    pthread_mutex_unlock(&srv->live_lock);
    return sv;
}

/* A retired model whose last request ends is freed by the main thread (reap), never here: this
 * may run on that model's own engine thread. */
static void release(server *srv, served *sv)
{
    pthread_mutex_lock(&srv->live_lock);
    sv->refs--;
    pthread_mutex_unlock(&srv->live_lock);
}

static void job_unref(job *j)
{
    pthread_mutex_lock(&j->mu);
    int left = --j->refs;
    pthread_mutex_unlock(&j->mu);
    if (left)
        return;
    if (j->sv)
        release(j->srv, j->sv);
    for (int i = 0; i < OPENAI_MAX_CHOICES; i++)
        free(j->ch[i].text), free(j->ch[i].lps);
    for (int i = 0; i < j->n_tools; i++)
        free(j->tool_names[i]);
    free(j->tool_names);
    free(j->out);
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    free(j);
}

static int grow_logprobs(choice *c)
{
    int cap = c->cap_lps ? 2 * c->cap_lps : 64;
    token_logprob *g = realloc(c->lps, (size_t)cap * sizeof *g);
    if (!g)
        return -1;
    c->lps = g, c->cap_lps = cap;
    return 0;
}

static void on_event(void *user, const loom_event *ev)
{
    event_target *t = user;
    job *j = t->j;
    choice *c = &j->ch[t->index];
    pthread_mutex_lock(&j->mu);
    if (ev->kind == LOOM_EVENT_TEXT) {
        buf_append(&c->text, &c->len, &c->cap, ev->text, ev->len);
        /* token -1 is the engine's flush of held text at the end: no token, no logprob */
        if (j->logprobs && ev->token >= 0 && (c->n_lps < c->cap_lps || !grow_logprobs(c))) {
            token_logprob *t = &c->lps[c->n_lps++];
            t->id = ev->token, t->logprob = ev->logprob, t->n_top = ev->n_top;
            for (int k = 0; k < ev->n_top && k < LOOM_MAX_TOP_LOGPROBS; k++)
                t->top_ids[k] = ev->top_ids[k], t->top_logprobs[k] = ev->top_logprobs[k];
        }
    } else {
        c->done = 1;
        c->deadline = ev->deadline;
        c->busy = ev->busy;
        c->invalid = ev->invalid;
        c->n_generated = ev->n_generated;
        if (t->index == 0)
            j->n_cached = ev->n_cached;
        /* the engine's "cancelled" (cut off by a shutdown past its timeout) is no value OpenAI
         * clients know; "length" is theirs for an answer cut short */
        const char *why = ev->finish_reason ? ev->finish_reason : "stop";
        snprintf(c->finish, sizeof c->finish, "%s", strcmp(why, "cancelled") ? why : "length");
        if (ev->kind == LOOM_EVENT_ERROR)
            snprintf(c->error, sizeof c->error, "%s", ev->error ? ev->error : "generation failed");
    }
    pthread_cond_broadcast(&j->cv);
    int last = ev->kind != LOOM_EVENT_TEXT;
    pthread_mutex_unlock(&j->mu);
    if (last) {
        observe_request(j->srv, j->tenant, ev);
        if (ev->busy)
            count_refused(j->srv, j->tenant);
        free(t);
        job_unref(j); /* the engine's reference */
    }
}

static int all_done(const job *j)
{
    for (int i = 0; i < j->n; i++)
        if (!j->ch[i].done)
            return 0;
    return 1;
}

static void cancel_job(job *j)
{
    for (int i = 0; i < j->n; i++)
        if (j->ch[i].id > 0)
            loom_engine_cancel(j->sv->engine, j->ch[i].id);
}

/* ---- responses ---------------------------------------------------------------------------- */

/* seconds a client told 503 (the server is draining) should wait before it tries again, and
 * one told 429 (the queue is full) */
#define RETRY_AFTER "5"
#define RETRY_BUSY "1"

static enum MHD_Result send_text(struct MHD_Connection *con, unsigned status, const char *type,
                                 const char *body)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(body), (void *)body,
                                                             MHD_RESPMEM_MUST_COPY);
    if (!r)
        return MHD_NO;
    MHD_add_response_header(r, "Content-Type", type);
    if (status == 503 || status == 429)
        MHD_add_response_header(r, "Retry-After", status == 503 ? RETRY_AFTER : RETRY_BUSY);
    enum MHD_Result ok = MHD_queue_response(con, status, r);
    MHD_destroy_response(r);
    return ok;
}

static enum MHD_Result send_json(struct MHD_Connection *con, unsigned status, cJSON *o)
{
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!s)
        return MHD_NO;
    enum MHD_Result ok = send_text(con, status, "application/json", s);
    free(s);
    return ok;
}

/* OpenAI's error shape: {"error": {"message", "type", "param", "code"}}. */
static enum MHD_Result send_error(server *srv, struct MHD_Connection *con, unsigned status,
                                  const char *param, const char *code, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&srv->count_lock);
    srv->http_errors++;
    pthread_mutex_unlock(&srv->count_lock);
    cJSON *o = cJSON_CreateObject(), *e = cJSON_AddObjectToObject(o, "error");
    json_add_text(e, "message", msg, strlen(msg)); /* it may quote a client's invalid bytes */
    cJSON_AddStringToObject(e, "type",
                            status == 401       ? "authentication_error"
                                : status == 403 ? "permission_error"
                                : status == 429 ? "rate_limit_error"
                                : status == 504 ? "timeout_error"
                                : status >= 500 ? "server_error"
                                : status == 404 ? "not_found_error"
                                                : "invalid_request_error");
    if (param)
        json_add_text(e, "param", param, strlen(param));
    else
        cJSON_AddNullToObject(e, "param");
    if (code)
        cJSON_AddStringToObject(e, "code", code);
    else
        cJSON_AddNullToObject(e, "code");
    return send_json(con, status, o);
}

static cJSON *usage_json(const job *j)
{
    int32_t gen = 0;
    for (int i = 0; i < j->n; i++)
        gen += j->ch[i].n_generated;
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "prompt_tokens", j->n_prompt);
    cJSON_AddNumberToObject(u, "completion_tokens", gen);
    cJSON_AddNumberToObject(u, "total_tokens", j->n_prompt + gen);
    cJSON *d = cJSON_AddObjectToObject(u, "prompt_tokens_details");
    cJSON_AddNumberToObject(d, "cached_tokens", j->n_cached);
    return u;
}

static cJSON *response_head(const job *j, const char *object)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", j->id);
    cJSON_AddStringToObject(o, "object", object);
    cJSON_AddNumberToObject(o, "created", (double)j->created);
    json_add_text(o, "model", j->sv->api.model_name, strlen(j->sv->api.model_name));
    cJSON_AddStringToObject(o, "system_fingerprint", "loom");
    return o;
}

static void add_finish(cJSON *c, const char *finish)
{
    if (finish)
        cJSON_AddStringToObject(c, "finish_reason", finish);
    else
        cJSON_AddNullToObject(c, "finish_reason");
}

/* One choice of a chunk or a whole response. text NULL: an empty delta. */
static cJSON *choice_json(const job *j, int index, const char *text, size_t len, const char *finish,
                          int chunk, int with_role)
{
    cJSON *c = cJSON_CreateObject();
    cJSON_AddNumberToObject(c, "index", index);
    if (j->chat) {
        cJSON *m = cJSON_AddObjectToObject(c, chunk ? "delta" : "message");
        if (with_role || !chunk)
            cJSON_AddStringToObject(m, "role", "assistant");
        if (text || !chunk)
            json_add_text(m, "content", text, text ? len : 0);
    } else {
        json_add_text(c, "text", text, text ? len : 0);
    }
    cJSON_AddNullToObject(c, "logprobs");
    add_finish(c, finish);
    return c;
}

/* a log-probability as JSON can hold it (a token the model never chooses is -inf) */
static double finite_logprob(float x)
{
    return isfinite(x) ? x : -9999.0;
}

/* one token as OpenAI's chat logprobs describe it: text, log-probability, bytes */
static cJSON *token_json(const job *j, int32_t prev, int32_t id, float logprob, char *piece, int *n)
{
    *n = loom_token_piece(j->sv->api.model, prev, id, piece, 256);
    *n = *n < 0 ? 0 : *n > 256 ? 256 : *n;
    cJSON *t = cJSON_CreateObject(), *bytes;
    json_add_text(t, "token", piece, (size_t)*n);
    cJSON_AddNumberToObject(t, "logprob", finite_logprob(logprob));
    bytes = cJSON_AddArrayToObject(t, "bytes");
    for (int k = 0; k < *n; k++)
        cJSON_AddItemToArray(bytes, cJSON_CreateNumber((unsigned char)piece[k]));
    return t;
}

/* The logprobs of choice c's tokens [from, to): chat's {"content": [...]} or completions'
 * {"tokens", "token_logprobs", "top_logprobs", "text_offset"}. */
static cJSON *logprobs_json(const job *j, const choice *c, int from, int to, size_t *offset)
{
    char piece[256];
    int n;
    cJSON *o = cJSON_CreateObject();
    cJSON *content = j->chat ? cJSON_AddArrayToObject(o, "content") : NULL;
    cJSON *tokens = j->chat ? NULL : cJSON_AddArrayToObject(o, "tokens");
    cJSON *lps = j->chat ? NULL : cJSON_AddArrayToObject(o, "token_logprobs");
    cJSON *tops = j->chat ? NULL : cJSON_AddArrayToObject(o, "top_logprobs");
    cJSON *offsets = j->chat ? NULL : cJSON_AddArrayToObject(o, "text_offset");
    for (int k = from; k < to; k++) {
        const token_logprob *t = &c->lps[k];
        int32_t prev = k ? c->lps[k - 1].id : j->prompt_last;
        cJSON *tok = token_json(j, prev, t->id, t->logprob, piece, &n);
        if (j->chat) {
            cJSON *alts = cJSON_AddArrayToObject(tok, "top_logprobs");
            for (int a = 0; a < t->n_top; a++) {
                int m;
                cJSON_AddItemToArray(
                    alts, token_json(j, prev, t->top_ids[a], t->top_logprobs[a], piece, &m));
            }
            cJSON_AddItemToArray(content, tok);
            continue;
        }
        cJSON_AddItemToArray(tokens, cJSON_Duplicate(cJSON_GetObjectItem(tok, "token"), 1));
        cJSON_AddItemToArray(lps, cJSON_CreateNumber(finite_logprob(t->logprob)));
        cJSON_AddItemToArray(offsets, cJSON_CreateNumber((double)*offset));
        *offset += (size_t)n;
        cJSON *alts = cJSON_CreateObject();
        for (int a = 0; a < t->n_top; a++) {
            int m;
            cJSON *alt = token_json(j, prev, t->top_ids[a], t->top_logprobs[a], piece, &m);
            /* the token's text as a key: its JSON text (valid UTF-8) read back */
            cJSON *text = cJSON_Parse(cJSON_GetObjectItem(alt, "token")->valuestring);
            if (cJSON_IsString(text) && !cJSON_GetObjectItem(alts, text->valuestring))
                cJSON_AddNumberToObject(alts, text->valuestring,
                                        finite_logprob(t->top_logprobs[a])); /* first of equals */
            cJSON_Delete(text);
            cJSON_Delete(alt);
        }
        cJSON_AddItemToArray(tops, alts);
        cJSON_Delete(tok);
    }
    return o;
}

/* puts choice c's logprobs since the last chunk into choice object ch (streaming) */
static void attach_logprobs(const job *j, choice *c, cJSON *ch)
{
    if (!j->logprobs || c->lps_sent == c->n_lps)
        return;
    cJSON_ReplaceItemInObject(ch, "logprobs",
                              logprobs_json(j, c, c->lps_sent, c->n_lps, &c->lps_offset));
    c->lps_sent = c->n_lps;
}

/* The calls in choice c's finished answer past its first base bytes (a thought), content_len
 * counted from there (n_calls 0: none, or the request has no tools). */
static void read_tool_calls(const job *j, const choice *c, size_t base, loom_tool_calls *tc)
{
    memset(tc, 0, sizeof *tc);
    tc->content_len = c->len - base;
    if (j->tool_syntax == LOOM_TOOLS_NONE || c->error[0] || !c->text)
        return;
    if (loom_tool_calls_parse(j->tool_syntax, c->text + base, c->len - base,
                              (const char *const *)j->tool_names, j->n_tools, tc) != 0)
        return;
    while (!j->parallel_tool_calls && tc->n_calls > 1) { /* at most one, the first */
        loom_tool_call *last = &tc->calls[--tc->n_calls];
        free(last->name), free(last->arguments), free(last->id);
    }
}

/* an id for a call: the model's own where it wrote one, else a fresh one (Mistral's templates
 * want 9 letters and digits) */
static void call_id(const job *j, const loom_tool_call *call, char *id, size_t cap)
{
    static const char alnum[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    static uint64_t counter;
    if (call->id && strlen(call->id) < cap) {
        snprintf(id, cap, "%s", call->id);
        return;
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t x = (uint64_t)ts.tv_nsec * 0x9e3779b97f4a7c15ull ^
        __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED) * 0xbf58476d1ce4e5b9ull;
    int mistral = j->tool_syntax == LOOM_TOOLS_MISTRAL;
    size_t at = mistral ? 0 : (size_t)snprintf(id, cap, "call_");
    for (size_t n = mistral ? 9 : 24; n && at + 1 < cap; n--) {
        x ^= x >> 31, x *= 0x94d049bb133111ebull, x ^= x >> 29;
        id[at++] = alnum[x % (sizeof alnum - 1)];
    }
    id[at] = 0;
}

/* tool call k as OpenAI writes it: whole in a message, or in a stream's delta (then its
 * index, id, type and name come first, in their own chunk, and the arguments after) */
static cJSON *tool_call_json(const job *j, const loom_tool_call *call, int k, int part)
{
    char id[64];
    cJSON *t = cJSON_CreateObject(), *f;
    if (part >= 0)
        cJSON_AddNumberToObject(t, "index", k);
    if (part <= 0) {
        call_id(j, call, id, sizeof id);
        cJSON_AddStringToObject(t, "id", id);
        cJSON_AddStringToObject(t, "type", "function");
    }
    f = cJSON_AddObjectToObject(t, "function");
    if (part <= 0)
        json_add_text(f, "name", call->name, strlen(call->name));
    json_add_text(f, "arguments", part == 0 ? "" : call->arguments,
                  part == 0 ? 0 : strlen(call->arguments));
    return t;
}

/* finish_reason of an answer with calls: "tool_calls" when the model ended it */
static const char *finish_with_calls(const choice *c, const loom_tool_calls *tc)
{
    return tc->n_calls && !strcmp(c->finish, "stop") ? "tool_calls" : c->finish;
}

static void sse(job *j, cJSON *o)
{
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!s)
        return;
    buf_append(&j->out, &j->out_len, &j->out_cap, "data: ", 6);
    buf_append(&j->out, &j->out_len, &j->out_cap, s, strlen(s));
    buf_append(&j->out, &j->out_len, &j->out_cap, "\n\n", 2);
    free(s);
}

/* Formats what the engine produced since the last call as server-sent events (under j->mu). */
static void stream_format(job *j)
{
    const char *object = j->chat ? "chat.completion.chunk" : "text_completion";
    for (int i = 0; i < j->n; i++) {
        choice *c = &j->ch[i];
        if (j->chat && !(j->role_sent & (1 << i))) {
            cJSON *o = response_head(j, object), *a = cJSON_AddArrayToObject(o, "choices");
            cJSON_AddItemToArray(a, choice_json(j, i, "", 0, NULL, 1, 1));
            sse(j, o);
            j->role_sent |= 1 << i;
        }
        /* a thought first, as reasoning_content; the answer proper starts after it (base) */
        size_t base = 0;
        int thinking = 0;
        if (j->reasoning && c->text && !c->final_sent) {
            loom_reasoning r;
            loom_reasoning_find(c->text, c->len, j->reasoning == 2, c->done, &r);
            size_t from = c->thought_sent > r.start ? c->thought_sent : r.start;
            size_t upto = r.end <= from ? from
                : c->done               ? r.end
                                        : from + loom_utf8_complete(c->text + from, r.end - from);
            if (upto > from) {
                cJSON *o = response_head(j, object), *a = cJSON_AddArrayToObject(o, "choices");
                cJSON *ch = choice_json(j, i, NULL, 0, NULL, 1, 0);
                json_add_text(cJSON_GetObjectItem(ch, "delta"), "reasoning_content", c->text + from,
                              upto - from);
                cJSON_AddItemToArray(a, ch);
                sse(j, o);
                c->thought_sent = upto;
            }
            thinking = r.open && !c->done;
            base = r.content;
            c->sent = c->sent < base ? base : c->sent;
        }
        /* a character whose last bytes are still to come waits for them (or for the end,
         * when what is left is sent with U+FFFD for it) */
        size_t ready = c->done ? c->len
                               : c->sent + loom_utf8_complete(c->text + c->sent, c->len - c->sent);
        loom_tool_calls tc = {0};
        if (j->tool_syntax != LOOM_TOOLS_NONE && !c->final_sent && !thinking) {
            /* text that may be the start of a call waits until it is known not to be */
            if (c->done) {
                read_tool_calls(j, c, base, &tc);
                ready = base + tc.content_len;
            } else {
                size_t text = base +
                    loom_tool_calls_text_prefix(j->tool_syntax, c->text + base, c->len - base,
                                                (const char *const *)j->tool_names, j->n_tools);
                ready = text < ready ? text : ready;
            }
        }
        if (thinking)
            ready = c->sent;
        ready = ready < c->sent ? c->sent : ready;
        if (c->sent < ready) {
            cJSON *o = response_head(j, object), *a = cJSON_AddArrayToObject(o, "choices");
            cJSON *ch = choice_json(j, i, c->text + c->sent, ready - c->sent, NULL, 1, 0);
            attach_logprobs(j, c, ch);
            cJSON_AddItemToArray(a, ch);
            sse(j, o);
            c->sent = ready;
        }
        if (c->done && !c->final_sent) {
            cJSON *o;
            if (c->error[0]) {
                o = cJSON_CreateObject();
                cJSON *e = cJSON_AddObjectToObject(o, "error");
                json_add_text(e, "message", c->error, strlen(c->error));
                cJSON_AddStringToObject(e, "type", "server_error");
            } else {
                for (int k = 0; k < tc.n_calls; k++)
                    for (int part = 0; part < 2; part++) {
                        cJSON *e = response_head(j, object),
                              *a = cJSON_AddArrayToObject(e, "choices");
                        cJSON *ch = choice_json(j, i, NULL, 0, NULL, 1, 0);
                        cJSON *calls = cJSON_AddArrayToObject(cJSON_GetObjectItem(ch, "delta"),
                                                              "tool_calls");
                        cJSON_AddItemToArray(calls, tool_call_json(j, &tc.calls[k], k, part));
                        cJSON_AddItemToArray(a, ch);
                        sse(j, e);
                    }
                o = response_head(j, object);
                cJSON *a = cJSON_AddArrayToObject(o, "choices");
                cJSON *ch = choice_json(j, i, NULL, 0, finish_with_calls(c, &tc), 1, 0);
                attach_logprobs(j, c, ch);
                cJSON_AddItemToArray(a, ch);
                if (c->deadline)
                    cJSON_AddBoolToObject(o, "stopped_at_deadline", 1);
            }
            sse(j, o);
            c->final_sent = 1;
        }
        loom_tool_calls_free(&tc);
    }
    if (all_done(j) && !j->finished) {
        if (j->include_usage) {
            cJSON *o = response_head(j, object);
            cJSON_AddArrayToObject(o, "choices");
            cJSON_AddItemToObject(o, "usage", usage_json(j));
            sse(j, o);
        }
        buf_append(&j->out, &j->out_len, &j->out_cap, "data: [DONE]\n\n", 14);
        j->finished = 1;
    }
}

/* Waits (mu held) for the engine's next event, or 200 ms: long enough to cost nothing, short
 * enough to notice a client that left. */
static void wait_briefly_on(pthread_cond_t *cv, pthread_mutex_t *mu)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_nsec += 200 * 1000000L;
    if (until.tv_nsec >= 1000000000L)
        until.tv_sec++, until.tv_nsec -= 1000000000L;
    pthread_cond_timedwait(cv, mu, &until);
}

static void wait_briefly(job *j)
{
    wait_briefly_on(&j->cv, &j->mu);
}

/* Whether the client closed its end while we wait to answer. */
static int client_gone(struct MHD_Connection *con)
{
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(con,
                                                                 MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci)
        return 0;
    char c;
    ssize_t n = recv(ci->connect_fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

/* libmicrohttpd pulls the stream from here; with a thread per connection it may block. While
 * nothing is ready (a long prefill) it looks every 200 ms whether the client is still there, so
 * a disconnect cancels the generation without waiting for the next write to fail. */
static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    job *j = cls;
    pthread_mutex_lock(&j->mu);
    for (;;) {
        if (j->out_pos < j->out_len) {
            size_t n = j->out_len - j->out_pos < max ? j->out_len - j->out_pos : max;
            memcpy(buf, j->out + j->out_pos, n);
            j->out_pos += n;
            if (j->out_pos == j->out_len)
                j->out_pos = j->out_len = 0;
            pthread_mutex_unlock(&j->mu);
            return (ssize_t)n;
        }
        if (j->finished) {
            pthread_mutex_unlock(&j->mu);
            return MHD_CONTENT_READER_END_OF_STREAM;
        }
        stream_format(j);
        if (j->out_len == 0) {
            wait_briefly(j);
            if (j->out_len == 0 && !all_done(j) && j->con && client_gone(j->con)) {
                pthread_mutex_unlock(&j->mu);
                return MHD_CONTENT_READER_END_WITH_ERROR; /* stream_free cancels the job */
            }
        }
    }
}

/* The response is gone: finished, or the client disconnected (then cancel the generation). */
static void stream_free(void *cls)
{
    job *j = cls;
    pthread_mutex_lock(&j->mu);
    int unfinished = !all_done(j);
    pthread_mutex_unlock(&j->mu);
    if (unfinished) {
        pthread_mutex_lock(&j->srv->count_lock);
        j->srv->disconnects++;
        pthread_mutex_unlock(&j->srv->count_lock);
        cancel_job(j);
    }
    job_unref(j);
}

/* A request the engine ended before it answered: its deadline (504), a full queue that took
 * one of better priority in its place (429), a grammar it could not follow (400), or a
 * failure (500). */
static enum MHD_Result send_ended_early(server *srv, struct MHD_Connection *con, int deadline,
                                        int busy, const char *invalid, const char *msg)
{
    if (deadline)
        return send_error(srv, con, 504, "timeout", "deadline_exceeded", "%s", msg);
    if (busy)
        return send_error(srv, con, 429, NULL, "rate_limit_exceeded", "%s", msg);
    if (invalid)
        return send_error(srv, con, 400, invalid, "grammar_too_complex",
                          "the answer's grammar (%s) cannot be followed: %s", invalid, msg);
    return send_error(srv, con, 500, NULL, NULL, "%s", msg);
}

static enum MHD_Result finish_blocking(struct MHD_Connection *con, job *j)
{
    pthread_mutex_lock(&j->mu);
    while (!all_done(j)) {
        wait_briefly(j);
        if (!all_done(j) && client_gone(con)) {
            pthread_mutex_unlock(&j->mu);
            pthread_mutex_lock(&j->srv->count_lock);
            j->srv->disconnects++;
            pthread_mutex_unlock(&j->srv->count_lock);
            cancel_job(j);
            job_unref(j);
            return MHD_NO; /* close the connection */
        }
    }
    for (int i = 0; i < j->n; i++)
        if (j->ch[i].error[0]) {
            char msg[300];
            snprintf(msg, sizeof msg, "%s", j->ch[i].error);
            server *srv = j->srv; /* j may be freed by the unref */
            int deadline = j->ch[i].deadline, busy = j->ch[i].busy;
            const char *bad = j->ch[i].invalid ? j->grammar_param : NULL;
            pthread_mutex_unlock(&j->mu);
            cancel_job(j); /* the other choices end with it */
            job_unref(j);
            return send_ended_early(srv, con, deadline, busy, bad, msg);
        }
    cJSON *o = response_head(j, j->chat ? "chat.completion" : "text_completion");
    for (int i = 0; i < j->n; i++)
        if (j->ch[i].deadline) /* cut at its deadline: finish_reason "length", and this says why */
            cJSON_AddBoolToObject(o, "stopped_at_deadline", 1);
    cJSON *a = cJSON_AddArrayToObject(o, "choices");
    for (int i = 0; i < j->n; i++) {
        const choice *c = &j->ch[i];
        loom_reasoning r = {0};
        if (j->reasoning && c->text)
            loom_reasoning_find(c->text, c->len, j->reasoning == 2, 1, &r);
        loom_tool_calls tc;
        read_tool_calls(j, c, r.content, &tc);
        cJSON *ch = choice_json(j, i, c->text ? c->text + r.content : "", tc.content_len,
                                finish_with_calls(c, &tc), 0, 1);
        if (j->logprobs) {
            size_t offset = 0;
            cJSON_ReplaceItemInObject(ch, "logprobs", logprobs_json(j, c, 0, c->n_lps, &offset));
        }
        if (r.end > r.start) /* the thought beside the answer, as vLLM and DeepSeek's API */
            json_add_text(cJSON_GetObjectItem(ch, "message"), "reasoning_content",
                          c->text + r.start, r.end - r.start);
        if (tc.n_calls) { /* OpenAI's content is null beside calls when there is no text */
            cJSON *m = cJSON_GetObjectItem(ch, "message");
            if (tc.content_len == 0)
                cJSON_ReplaceItemInObject(m, "content", cJSON_CreateNull());
            cJSON *calls = cJSON_AddArrayToObject(m, "tool_calls");
            for (int k = 0; k < tc.n_calls; k++)
                cJSON_AddItemToArray(calls, tool_call_json(j, &tc.calls[k], k, -1));
        }
        loom_tool_calls_free(&tc);
        cJSON_AddItemToArray(a, ch);
    }
    cJSON_AddItemToObject(o, "usage", usage_json(j));
    pthread_mutex_unlock(&j->mu);
    job_unref(j);
    return send_json(con, 200, o);
}

/* ---- endpoints ---------------------------------------------------------------------------- */

/* The prefix-cache partition of a request. Tenants (who: 1, 2, ... of --api-keys) never share
 * one: a cache hit, and the time it saves, would tell one what another's prompts began with.
 * Within a tenant (or without keys) requests share, or with --prefix-cache per-user only those
 * with the same "user" field do (a request without one shares with nobody). */
static uint64_t cache_partition(const server *srv, int who, const char *user)
{
    static uint64_t anonymous;
    if (!srv->partition_by_user)
        return (uint64_t)who << 1; /* 0: the common one */
    if (!user)
        return __atomic_add_fetch(&anonymous, 1, __ATOMIC_RELAXED) << 1 | 1; /* odd: no user */
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < 4; i++) /* the tenant's bytes, then the user's */
        h = (h ^ ((unsigned)who >> (8 * i) & 0xff)) * 1099511628211ull;
    for (const char *c = user; *c; c++)
        h = (h ^ (unsigned char)*c) * 1099511628211ull;
    return h << 1; /* even, and 0 only for the common partition's sake by chance (2^-63) */
}

/* A request's place in the engine: its cache partition, priority (its own, else its key's; a
 * key's priority is the best its requests get: they may ask for worse, not better), deadline
 * (its own, else --request-timeout) and tenant (who: its key, 0 none) with the key's limits. */
static void set_admission(loom_request *r, const server *srv, int who, const char *user,
                          int32_t priority, int priority_given, double timeout_s)
{
    const tenant *tn = who > 0 ? &srv->tenants[who - 1] : NULL;
    r->cache_partition = cache_partition(srv, who, user);
    r->priority = !tn                               ? priority
        : priority_given && priority > tn->priority ? priority
                                                    : tn->priority;
    r->timeout_ms = 1e3 * (timeout_s > 0 ? timeout_s : srv->timeout_s);
    r->tenant = who;
    r->tenant_max_running = tn ? tn->max_running : 0;
    r->tenant_max_queue = tn ? tn->max_queue : 0;
}

static enum MHD_Result handle_generate(server *srv, struct MHD_Connection *con, const char *body,
                                       size_t len, int chat, int who)
{
    tenant *tn = who > 0 ? &srv->tenants[who - 1] : NULL;
    served *sv = acquire(srv);
    parsed p = {0};
    bad b = {0};
    size_t max_values = openai_max_values(sv->api.n_ctx);
    while (sem_wait(&srv->parsing) != 0 && errno == EINTR) {
    }
    cJSON *req = openai_parse_body(body, len, max_values, &b);
    int parsed_ok = req && openai_parse_request(&sv->api, req, chat, &p, &b) == 0;
    sem_post(&srv->parsing);
    if (!parsed_ok) {
        openai_parsed_free(&p);
        cJSON_Delete(req);
        release(srv, sv);
        return send_error(srv, con, b.status, b.param, b.code, "%s", b.msg);
    }
    if (srv->shutting_down) {
        openai_parsed_free(&p);
        cJSON_Delete(req);
        release(srv, sv);
        return send_error(srv, con, 503, NULL, NULL, "the server is shutting down");
    }
    if (tn) {
        pthread_mutex_lock(&srv->count_lock);
        tn->requests++;
        pthread_mutex_unlock(&srv->count_lock);
    }
    job *j = calloc(1, sizeof *j);
    if (!j) {
        openai_parsed_free(&p);
        cJSON_Delete(req);
        release(srv, sv);
        return send_error(srv, con, 500, NULL, NULL, "out of memory");
    }
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    j->srv = srv, j->sv = sv; /* the job holds the model's reference from here */
    j->tenant = who;
    j->chat = chat, j->stream = p.stream, j->include_usage = p.include_usage;
    j->n = p.n, j->n_prompt = p.n_ids, j->created = time(NULL);
    j->refs = 1;
    j->tool_syntax = p.tool_syntax, j->parallel_tool_calls = p.parallel_tool_calls;
    j->reasoning = chat ? p.reasoning : 0;
    j->logprobs = p.logprobs;
    j->prompt_last = p.ids[p.n_ids - 1];
    j->grammar_param = p.grammar_param;                   /* a string constant */
    j->tool_names = p.tool_names, j->n_tools = p.n_tools; /* the job's from here */
    p.tool_names = NULL, p.n_tools = 0;
    static uint64_t counter;
    snprintf(j->id, sizeof j->id, "%s-%016llx", chat ? "chatcmpl" : "cmpl",
             (unsigned long long)(__atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED) ^
                                  ((uint64_t)j->created << 20)));
    char err[512] = "";
    int submitted = 0, busy = 0;
    for (int i = 0; i < p.n; i++) {
        event_target *t = malloc(sizeof *t);
        if (!t) {
            snprintf(err, sizeof err, "out of memory");
            break;
        }
        *t = (event_target){j, i};
        loom_request r = {.prompt = p.ids,
                          .n_prompt = p.n_ids,
                          .max_tokens = p.max_tokens,
                          .sampling = p.s,
                          .stop = p.stops,
                          .n_stop = p.n_stops,
                          .control_text = p.tool_syntax != LOOM_TOOLS_NONE,
                          .grammar = p.grammar,
                          .logprobs = p.logprobs,
                          .top_logprobs = p.top_logprobs,
                          .lookup = p.lookup,
                          .draft_max = p.draft_max,
                          .draft = p.draft};
        set_admission(&r, srv, who, p.user, p.priority, p.priority_given, p.timeout_s);
        r.sampling.seed = p.s.seed + (uint64_t)i; /* n choices: n different samples */
        pthread_mutex_lock(&j->mu);
        j->refs++;
        pthread_mutex_unlock(&j->mu);
        int64_t id = loom_engine_submit(sv->engine, &r, on_event, t, err, sizeof err);
        busy = id == LOOM_ENGINE_BUSY;
        if (id < 0) {
            free(t);
            pthread_mutex_lock(&j->mu); /* earlier choices' events drop references too */
            j->refs--;
            pthread_mutex_unlock(&j->mu);
            break;
        }
        j->ch[i].id = id;
        submitted++;
    }
    openai_parsed_free(&p);
    cJSON_Delete(req);
    if (submitted < j->n) {
        /* the ones already queued finish as cancelled; the job goes with them */
        pthread_mutex_lock(&j->mu);
        for (int i = submitted; i < j->n; i++)
            j->ch[i].done = 1;
        pthread_mutex_unlock(&j->mu);
        cancel_job(j);
        job_unref(j);
        if (busy)
            count_refused(srv, who);
        if (busy)
            return send_error(srv, con, 429, NULL, "rate_limit_exceeded", "%s", err);
        return send_error(srv, con, srv->shutting_down ? 503 : 400, NULL, NULL, "%s", err);
    }
    if (!j->stream)
        return finish_blocking(con, j);
    /* the status waits for the first event: a request whose deadline comes while it is queued
     * is a 504, not a 200 stream that says so */
    pthread_mutex_lock(&j->mu);
    int started = 0;
    while (!started) {
        for (int i = 0; i < j->n && !started; i++)
            started = j->ch[i].len > 0 || j->ch[i].done;
        if (!started)
            wait_briefly(j);
        if (!started && client_gone(con)) {
            pthread_mutex_unlock(&j->mu);
            pthread_mutex_lock(&srv->count_lock);
            srv->disconnects++;
            pthread_mutex_unlock(&srv->count_lock);
            cancel_job(j);
            job_unref(j);
            return MHD_NO;
        }
    }
    for (int i = 0; i < j->n; i++)
        if (j->ch[i].done && (j->ch[i].deadline || j->ch[i].busy || j->ch[i].invalid) &&
            j->ch[i].error[0]) {
            char msg[300];
            snprintf(msg, sizeof msg, "%s", j->ch[i].error);
            int deadline = j->ch[i].deadline, busy = j->ch[i].busy;
            const char *bad = j->ch[i].invalid ? j->grammar_param : NULL;
            pthread_mutex_unlock(&j->mu);
            cancel_job(j);
            job_unref(j);
            return send_ended_early(srv, con, deadline, busy, bad, msg);
        }
    pthread_mutex_unlock(&j->mu);
    j->con = con;
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024,
                                                                  stream_read, j, stream_free);
    if (!resp) {
        cancel_job(j);
        job_unref(j);
        return MHD_NO;
    }
    MHD_add_response_header(resp, "Content-Type", "text/event-stream");
    MHD_add_response_header(resp, "Cache-Control", "no-cache");
    enum MHD_Result ok = MHD_queue_response(con, 200, resp);
    MHD_destroy_response(resp);
    return ok;
}

/* ---- embeddings --------------------------------------------------------------------------- */

/* One /v1/embeddings request's inputs on their way through the engine (the connection thread
 * owns it and frees it after every submitted input's last event). */
typedef struct embed_job {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    float *out; /* [n_inputs][n_embd] */
    int32_t n_embd;
    int64_t *ids;         /* each submitted input's engine id */
    int submitted, ended; /* inputs submitted, and those whose last event came */
    char error[300];      /* the first input that failed, and why */
    int deadline, busy;
    server *srv;
    int tenant; /* whose key, 0: no tenant */
} embed_job;

typedef struct embed_target {
    embed_job *j;
    int index;
} embed_target;

static void on_embedding(void *user, const loom_event *ev)
{
    embed_target *t = user;
    embed_job *j = t->j;
    if (ev->kind == LOOM_EVENT_TEXT)
        return;
    observe_request(j->srv, j->tenant, ev);
    if (ev->busy)
        count_refused(j->srv, j->tenant);
    pthread_mutex_lock(&j->mu);
    if (ev->kind == LOOM_EVENT_DONE && ev->embedding && ev->n_embd == j->n_embd)
        memcpy(j->out + (size_t)t->index * (size_t)j->n_embd, ev->embedding,
               (size_t)j->n_embd * sizeof *j->out);
    else if (!j->error[0]) {
        snprintf(j->error, sizeof j->error, "input %d: %s", t->index,
                 ev->error ? ev->error : "the embedding was cancelled");
        j->deadline = ev->deadline;
        j->busy = ev->busy;
    }
    j->ended++;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    free(t);
}

/* base64 of n bytes (OpenAI's encoding_format "base64": the float32s' bytes), malloc'd */
static char *base64(const unsigned char *in, size_t n)
{
    static const char digit[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    char *out = malloc((n + 2) / 3 * 4 + 1), *o = out;
    if (!out)
        return NULL;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)in[i] << 16 | (i + 1 < n ? (uint32_t)in[i + 1] << 8 : 0) |
            (i + 2 < n ? in[i + 2] : 0);
        *o++ = digit[v >> 18 & 63], *o++ = digit[v >> 12 & 63];
        *o++ = i + 1 < n ? digit[v >> 6 & 63] : '=';
        *o++ = i + 2 < n ? digit[v & 63] : '=';
    }
    *o = '\0';
    return out;
}

/* an embedding as a JSON array, each float with the digits that give it back exactly */
static cJSON *floats_json(const float *v, int32_t n)
{
    char *s = malloc((size_t)n * 18 + 3), *o = s;
    if (!s)
        return NULL;
    *o++ = '[';
    for (int32_t i = 0; i < n; i++)
        o += sprintf(o, "%s%.9g", i ? "," : "", (double)v[i]);
    *o++ = ']', *o = '\0';
    cJSON *a = cJSON_CreateRaw(s);
    free(s);
    return a;
}

/* Every input runs as its own engine request, beside other clients' (at most max_batch of
 * this request's at a time, so that a long list does not fill the queue); the answer comes
 * when all are done. */
static enum MHD_Result handle_embeddings(server *srv, struct MHD_Connection *con, const char *body,
                                         size_t len, int who)
{
    tenant *tn = who > 0 ? &srv->tenants[who - 1] : NULL;
    served *sv = acquire(srv);
    embed_parsed p = {0};
    bad b = {0};
    while (sem_wait(&srv->parsing) != 0 && errno == EINTR) {
    }
    cJSON *req = openai_parse_body(
        body, len,
        (size_t)OPENAI_MAX_INPUTS * 4 + 64 + (size_t)OPENAI_MAX_INPUTS * (size_t)sv->api.n_ctx, &b);
    int parsed_ok = req && openai_parse_embeddings(&sv->api, req, &p, &b) == 0;
    sem_post(&srv->parsing);
    cJSON_Delete(req);
    if (!parsed_ok) {
        openai_embed_parsed_free(&p);
        release(srv, sv);
        return send_error(srv, con, b.status, b.param, b.code, "%s", b.msg);
    }
    if (tn) {
        pthread_mutex_lock(&srv->count_lock);
        tn->requests++;
        pthread_mutex_unlock(&srv->count_lock);
    }
    embed_job j = {.n_embd = loom_model_n_embd(sv->api.model), .srv = srv, .tenant = who};
    pthread_mutex_init(&j.mu, NULL);
    pthread_cond_init(&j.cv, NULL);
    j.out = malloc((size_t)p.n_inputs * (size_t)j.n_embd * sizeof *j.out);
    j.ids = calloc((size_t)p.n_inputs, sizeof *j.ids);
    int window = srv->eo.max_batch > 0 ? srv->eo.max_batch : 16;
    char err[512] = "";
    int busy = 0, gone = 0;
    if (!j.out || !j.ids)
        snprintf(err, sizeof err, "out of memory");
    pthread_mutex_lock(&j.mu);
    while (!err[0] && !j.error[0] && !gone && j.ended < p.n_inputs) {
        if (j.submitted < p.n_inputs && j.submitted - j.ended < window) {
            embed_target *t = malloc(sizeof *t);
            if (!t) {
                snprintf(err, sizeof err, "out of memory");
                break;
            }
            *t = (embed_target){&j, j.submitted};
            const embed_input *in = &p.inputs[j.submitted];
            loom_request r = {.prompt = in->ids,
                              .n_prompt = in->n_ids,
                              .pooling = p.pooling,
                              .embed_unnormalized = !p.normalize};
            set_admission(&r, srv, who, p.user, p.priority, p.priority_given, p.timeout_s);
            pthread_mutex_unlock(&j.mu); /* the engine may answer at once */
            int64_t id = loom_engine_submit(sv->engine, &r, on_embedding, t, err, sizeof err);
            pthread_mutex_lock(&j.mu);
            if (id == LOOM_ENGINE_BUSY && j.submitted > j.ended) {
                free(t); /* a full queue with some of ours in it: wait for one of them */
                err[0] = '\0';
                wait_briefly_on(&j.cv, &j.mu);
                continue;
            }
            if (id < 0) {
                free(t);
                busy = id == LOOM_ENGINE_BUSY;
                break;
            }
            j.ids[j.submitted++] = id;
            continue;
        }
        wait_briefly_on(&j.cv, &j.mu);
        gone = j.ended < p.n_inputs && client_gone(con);
    }
    /* on a failure the rest are cancelled; every submitted one's last event is awaited, as
     * they point at j */
    int failed = err[0] || j.error[0] || gone;
    if (failed)
        for (int i = 0; i < j.submitted; i++)
            loom_engine_cancel(sv->engine, j.ids[i]);
    while (j.ended < j.submitted)
        pthread_cond_wait(&j.cv, &j.mu);
    pthread_mutex_unlock(&j.mu);
    enum MHD_Result res;
    if (gone) {
        pthread_mutex_lock(&srv->count_lock);
        srv->disconnects++;
        pthread_mutex_unlock(&srv->count_lock);
        res = MHD_NO;
    } else if (busy) {
        count_refused(srv, who);
        res = send_error(srv, con, 429, NULL, "rate_limit_exceeded", "%s", err);
    } else if (err[0]) {
        res = send_error(srv, con, srv->shutting_down ? 503 : 500, NULL, NULL, "%s", err);
    } else if (j.error[0]) {
        res = send_ended_early(srv, con, j.deadline, j.busy, NULL, j.error);
    } else {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "object", "list");
        cJSON *d = cJSON_AddArrayToObject(o, "data");
        int ok = o && d;
        for (int i = 0; ok && i < p.n_inputs; i++) {
            cJSON *e = cJSON_CreateObject();
            const float *v = j.out + (size_t)i * (size_t)j.n_embd;
            char *b64 = p.base64 ? base64((const unsigned char *)v, (size_t)j.n_embd * 4) : NULL;
            cJSON *val = p.base64 ? (b64 ? cJSON_CreateString(b64) : NULL)
                                  : floats_json(v, j.n_embd);
            free(b64);
            ok = e && val;
            if (e)
                cJSON_AddItemToArray(d, e);
            cJSON_AddStringToObject(e, "object", "embedding");
            cJSON_AddNumberToObject(e, "index", i);
            if (val)
                cJSON_AddItemToObject(e, "embedding", val);
        }
        json_add_text(o, "model", sv->api.model_name, strlen(sv->api.model_name));
        cJSON *u = cJSON_AddObjectToObject(o, "usage");
        cJSON_AddNumberToObject(u, "prompt_tokens", (double)p.n_tokens);
        cJSON_AddNumberToObject(u, "total_tokens", (double)p.n_tokens);
        if (ok)
            res = send_json(con, 200, o);
        else {
            cJSON_Delete(o);
            res = send_error(srv, con, 500, NULL, NULL, "out of memory");
        }
    }
    free(j.out), free(j.ids);
    pthread_mutex_destroy(&j.mu);
    pthread_cond_destroy(&j.cv);
    openai_embed_parsed_free(&p);
    release(srv, sv);
    return res;
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
static enum MHD_Result handle_metrics(server *srv, struct MHD_Connection *con, int per_key)
{
    served *sv = acquire(srv);
    loom_engine_stats s = loom_engine_get_stats(sv->engine);
    int32_t window = loom_model_sliding_window(sv->api.model);
    release(srv, sv);
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
           "Prompt-lookup proposals checked (speculative decoding).", " %llu",
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
    enum MHD_Result ok = send_text(con, 200, "text/plain; version=0.0.4", out ? out : "");
    free(out);
    return ok;
}

static int reload(server *srv, char *err, size_t err_size);
static int authorised(server *srv, struct MHD_Connection *con, int *admin);

/* {"status": "ok"}; to a client with the key (or any, when the server wants none) also the
 * model, the reloads and "reload_error" while the last reload failed (the old model serving):
 * a stranger learns nothing but that the server is up. */
static enum MHD_Result handle_health(server *srv, struct MHD_Connection *con)
{
    int admin;
    if (authorised(srv, con, &admin) < 0)
        return send_text(con, 200, "application/json", "{\"status\":\"ok\"}");
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "status", "ok");
    served *sv = acquire(srv);
    json_add_text(o, "model", sv->api.model_name, strlen(sv->api.model_name));
    release(srv, sv);
    pthread_mutex_lock(&srv->live_lock);
    cJSON_AddNumberToObject(o, "reloads", srv->reloads);
    if (srv->reload_error[0])
        json_add_text(o, "reload_error", srv->reload_error, strlen(srv->reload_error));
    pthread_mutex_unlock(&srv->live_lock);
    return send_json(con, 200, o);
}

static enum MHD_Result handle_models(server *srv, struct MHD_Connection *con)
{
    cJSON *o = cJSON_CreateObject(), *d;
    cJSON_AddStringToObject(o, "object", "list");
    d = cJSON_AddArrayToObject(o, "data");
    cJSON *m = cJSON_CreateObject();
    served *sv = acquire(srv);
    json_add_text(m, "id", sv->api.model_name, strlen(sv->api.model_name));
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", (double)srv->started);
    cJSON_AddStringToObject(m, "owned_by", "loom");
    cJSON_AddNumberToObject(m, "max_model_len", sv->api.n_ctx);
    cJSON_AddStringToObject(m, "backend", loom_model_backend(sv->api.model));
    release(srv, sv);
    cJSON_AddItemToArray(d, m);
    return send_json(con, 200, o);
}

typedef enum route {
    ROUTE_NONE,
    ROUTE_WEBUI,
    ROUTE_HEALTH,
    ROUTE_METRICS,
    ROUTE_MODELS,
    ROUTE_COMPLETIONS,
    ROUTE_CHAT,
    ROUTE_EMBEDDINGS,
    ROUTE_RELOAD
} route;

typedef struct conn_state {
    route to;
    char *body;
    size_t len, cap;
    int too_big;
    int tenant; /* whose key (--api-keys), 0: no tenant */
} conn_state;

static void request_completed(void *cls, struct MHD_Connection *con, void **con_cls,
                              enum MHD_RequestTerminationCode toe)
{
    (void)cls, (void)toe;
    conn_guard_request_done(con);
    conn_state *cs = *con_cls;
    if (cs) {
        free(cs->body);
        free(cs);
    }
    *con_cls = NULL;
}

/* Equal in time that does not depend on where a guess first differs. */
static int same_secret(const char *given, size_t n, const char *key, size_t key_len)
{
    unsigned diff = n != key_len;
    for (size_t i = 0; i < key_len; i++)
        diff |= (unsigned char)(i < n ? given[i] : 0) ^ (unsigned char)key[i];
    return diff == 0;
}

typedef struct auth_header {
    int count;
    const char *value;
    size_t len;
} auth_header;

static enum MHD_Result see_auth(void *cls, enum MHD_ValueKind kind, const char *key,
                                size_t key_size, const char *value, size_t value_size)
{
    (void)kind;
    auth_header *a = cls;
    if (key_size == 13 && !strncasecmp(key, "Authorization", 13)) {
        a->count++;
        a->value = value, a->len = value ? value_size : 0;
    }
    return MHD_YES;
}

/* Who sent the request, from its key, read exactly: one Authorization header, the scheme
 * "Bearer" in any case (RFC 7235), one or more spaces, the key, nothing after it but spaces or
 * tabs. Returns the tenant (1, 2, ...) whose key of --api-keys it is, 0 for the one key of
 * --api-key-file (or --admin-key-file's) or when the API wants no key, -1 when the API wants a
 * key and none matches (every key is compared, in constant time each). *admin: the key may
 * reload the model and see every tenant's figures: --admin-key-file's, a tenant line that says
 * "admin", the one API key when no admin key is set, anyone when the server has no key at all. */
static int authorised(server *srv, struct MHD_Connection *con, int *admin)
{
    int open_api = !srv->api_key && !srv->n_tenants;
    *admin = open_api && !srv->admin_key;
    if (*admin)
        return 0;
    auth_header a = {0};
    MHD_get_connection_values_n(con, MHD_HEADER_KIND, see_auth, &a);
    if (a.count != 1 || !a.value || a.len < 8 || strncasecmp(a.value, "Bearer ", 7) != 0)
        return open_api ? 0 : -1;
    size_t start = 7, end = a.len;
    while (start < end && a.value[start] == ' ')
        start++;
    while (end > start && (a.value[end - 1] == ' ' || a.value[end - 1] == '\t'))
        end--;
    const char *given = a.value + start;
    size_t n = end - start;
    int found = open_api ? 0 : -1;
    if (srv->admin_key && same_secret(given, n, srv->admin_key, srv->admin_key_len))
        found = 0, *admin = 1;
    if (srv->api_key && same_secret(given, n, srv->api_key, srv->api_key_len))
        found = 0, *admin = !srv->admin_key;
    for (int i = 0; i < srv->n_tenants; i++)
        if (same_secret(given, n, srv->tenants[i].key, srv->tenants[i].key_len))
            found = i + 1, *admin = srv->tenants[i].admin;
    return found;
}

static enum MHD_Result refuse_key(server *srv, struct MHD_Connection *con)
{
    return send_error(srv, con, 401, NULL, "invalid_api_key",
                      "Incorrect or missing API key: send 'Authorization: Bearer KEY' with the key "
                      "the server was started with (--api-key-file, LOOM_API_KEY or --api-key)");
}

typedef struct framing {
    int content_lengths, transfer_encodings;
} framing;

static enum MHD_Result see_framing(void *cls, enum MHD_ValueKind kind, const char *key,
                                   size_t key_size, const char *value, size_t value_size)
{
    (void)kind, (void)value, (void)value_size;
    framing *f = cls;
    f->content_lengths += key_size == 14 && !strncasecmp(key, "Content-Length", 14);
    f->transfer_encodings += key_size == 17 && !strncasecmp(key, "Transfer-Encoding", 17);
    return MHD_YES;
}

/* A body framed two ways (two Content-Length headers, or one with Transfer-Encoding) is how
 * requests are smuggled past a proxy that reads the other framing: refused, and the
 * connection closed, since where this request ends is not known. */
static int refused_ambiguous_framing(server *srv, struct MHD_Connection *con)
{
    framing f = {0};
    MHD_get_connection_values_n(con, MHD_HEADER_KIND, see_framing, &f);
    if (f.content_lengths <= 1 && !(f.content_lengths && f.transfer_encodings))
        return 0;
    pthread_mutex_lock(&srv->count_lock);
    srv->http_errors++;
    pthread_mutex_unlock(&srv->count_lock);
    static const char body[] =
        "{\"error\":{\"message\":\"the request's body length is given twice (two "
        "Content-Length headers, or Content-Length with Transfer-Encoding): send one\","
        "\"type\":\"invalid_request_error\",\"param\":null,\"code\":null}}";
    struct MHD_Response *r = MHD_create_response_from_buffer(sizeof body - 1, (void *)body,
                                                             MHD_RESPMEM_PERSISTENT);
    if (r) {
        MHD_add_response_header(r, "Content-Type", "application/json");
        MHD_add_response_header(r, "Connection", "close");
        MHD_queue_response(con, 400, r);
        MHD_destroy_response(r);
    }
    return r ? 1 : -1;
}

/* Whether host (a Host header: a name or address, maybe a port) names this machine's loopback
 * (localhost, 127.0.0.0/8, [::1]) or one of allowed (--allow-host: names split by commas). */
static int allowed_host(const char *host, const char *allowed)
{
    size_t n = host[0] == '[' ? strcspn(host, "]") + 1 : strcspn(host, ":");
    if (host[n - (n > 0)] == '\0' && host[0] == '[')
        return 0; /* "[" without its "]" */
    char name[256];
    if (n == 0 || n >= sizeof name || (host[n] && (host[n] != ':' || !host[n + 1])))
        return 0;
    memcpy(name, host, n), name[n] = '\0';
    struct in_addr a;
    if (!strcasecmp(name, "localhost") || !strcmp(name, "[::1]") ||
        (inet_pton(AF_INET, name, &a) == 1 && ntohl(a.s_addr) >> 24 == 127))
        return 1;
    for (const char *p = allowed; p && *p; p += strcspn(p, ","), p += *p == ',') {
        size_t k = strcspn(p, ",");
        if (k == n && !strncasecmp(p, name, n))
            return 1;
    }
    return 0;
}

/* A browser runs any web page's requests with its user's reach: to a server on loopback, and
 * (a page whose own name resolves to 127.0.0.1, "DNS rebinding") as if same-origin. Refused,
 * from the headers: on a loopback bind a Host that is not a loopback name (or --allow-host's),
 * 421; a POST (what a page can send without asking: a form, a fetch) whose Origin is not this
 * server's, or that a browser marks as sent from another site, 403. A GET changes nothing and
 * its answer is not the foreign page's to read (no CORS headers), so a link to the chat page
 * still opens it. Returns 0, 1 with the refusal queued, or -1. */
static int refused_foreign(server *srv, struct MHD_Connection *con, int reads_only)
{
    const char *host = MHD_lookup_connection_value(con, MHD_HEADER_KIND, "Host");
    const char *origin = MHD_lookup_connection_value(con, MHD_HEADER_KIND, "Origin");
    const char *site = MHD_lookup_connection_value(con, MHD_HEADER_KIND, "Sec-Fetch-Site");
    if (srv->loopback && host && !allowed_host(host, srv->allowed_hosts))
        return send_error(srv, con, 421, NULL, "misdirected_request",
                          "this server listens on loopback and answers requests for localhost, "
                          "127.0.0.1 or [::1] only, not 'Host: %.200s' (a web page whose name "
                          "points at this machine must not reach it); a proxy in front of it "
                          "should pass the Host it connects to, or start loom serve with "
                          "--allow-host NAME",
                          host) == MHD_YES
            ? 1
            : -1;
    const char *authority = !origin           ? NULL
        : !strncasecmp(origin, "http://", 7)  ? origin + 7
        : !strncasecmp(origin, "https://", 8) ? origin + 8
                                              : "";
    int foreign = origin ? !host || strcasecmp(authority, host) != 0
                         : site && strcmp(site, "same-origin") && strcmp(site, "none");
    if (!foreign || reads_only)
        return 0;
    return send_error(srv, con, 403, NULL, "cross_origin_request",
                      "a request from a web page of another origin (%.200s) is refused: pages on "
                      "the web must not drive this server from their visitors' browsers; call it "
                      "from a program, or from the chat page it serves at /",
                      origin ? origin : site) == MHD_YES
        ? 1
        : -1;
}

/* The first call for a request: its route, method and key (and whether the server is still
 * taking work) are known from the headers, so a request that will be refused is refused now,
 * before its body is read. Returns MHD_YES with cs->to set for a body still to come. */
static enum MHD_Result route_request(server *srv, struct MHD_Connection *con, conn_state *cs,
                                     const char *url, const char *method)
{
    int refused = refused_ambiguous_framing(srv, con);
    if (refused)
        return refused > 0 ? MHD_YES : MHD_NO; /* a 400 is queued; the connection closes */
    /* HEAD wherever GET goes: libmicrohttpd sends the headers alone */
    int post = !strcmp(method, "POST"), get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
    if ((refused = refused_foreign(srv, con, get)))
        return refused > 0 ? MHD_YES : MHD_NO;
    route to = !strcmp(url, "/") && srv->webui ? ROUTE_WEBUI
        : !strcmp(url, "/health")              ? ROUTE_HEALTH
        : !strcmp(url, "/metrics")             ? ROUTE_METRICS
        : !strcmp(url, "/v1/models")           ? ROUTE_MODELS
        : !strcmp(url, "/v1/completions")      ? ROUTE_COMPLETIONS
        : !strcmp(url, "/v1/chat/completions") ? ROUTE_CHAT
        : !strcmp(url, "/v1/embeddings")       ? ROUTE_EMBEDDINGS
        : !strcmp(url, "/admin/reload")        ? ROUTE_RELOAD
                                               : ROUTE_NONE;
    switch (to) {
    case ROUTE_NONE:
        return send_error(srv, con, 404, NULL, NULL,
                          "no such endpoint: %s %s (loom serves "
                          "/v1/completions, /v1/chat/completions, /v1/embeddings, /v1/models, "
                          "/health, /metrics, /admin/reload%s)",
                          method, url, srv->webui ? ", and the chat page at /" : "");
    case ROUTE_WEBUI: /* a static page: the key guards the API it calls, not the page */
        if (!get)
            return send_error(srv, con, 405, NULL, NULL, "use GET for %s", url);
        return webui_send(con);
    case ROUTE_HEALTH:
        if (!get)
            return send_error(srv, con, 405, NULL, NULL, "use GET for %s", url);
        if (srv->shutting_down)
            return send_text(con, 503, "application/json", "{\"status\":\"shutting down\"}");
        return handle_health(srv, con);
    case ROUTE_METRICS: {
        if (!get)
            return send_error(srv, con, 405, NULL, NULL, "use GET for %s", url);
        int admin, known = authorised(srv, con, &admin) >= 0;
        if (srv->metrics_auth && !known)
            return refuse_key(srv, con);
        return handle_metrics(srv, con, srv->n_tenants && known && admin);
    }
    default: break;
    }
    int admin, who = authorised(srv, con, &admin);
    if (who < 0)
        return refuse_key(srv, con);
    cs->tenant = who;
    if (to == ROUTE_MODELS)
        return get ? handle_models(srv, con)
                   : send_error(srv, con, 405, NULL, NULL, "use GET for %s", url);
    if (to == ROUTE_RELOAD) {
        if (!post)
            return send_error(srv, con, 405, NULL, NULL, "use POST for %s", url);
        if (!admin)
            return send_error(srv, con, 403, NULL, "admin_key_required",
                              "reloading the model takes an admin key ('admin' on its "
                              "--api-keys line, or --admin-key-file's); this key may use the API "
                              "only");
        char why[1024];
        int failed = reload(srv, why, sizeof why);
        if (failed > 0)
            return send_error(srv, con, 409, NULL, "reload_in_progress", "%s", why);
        if (failed)
            return send_error(srv, con, 500, NULL, "reload_failed",
                              "reloading the model failed; the old one keeps serving: %s", why);
        return handle_models(srv, con); /* what now serves */
    }
    if (!post)
        return send_error(srv, con, 405, NULL, NULL, "use POST for %s", url);
    if (srv->shutting_down)
        return send_error(srv, con, 503, NULL, NULL,
                          "the server is shutting down; retry "
                          "against another instance or after a restart");
    cs->to = to;
    return MHD_YES;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *con, const char *url,
                                  const char *method, const char *version, const char *upload,
                                  size_t *upload_size, void **con_cls)
{
    (void)version;
    server *srv = cls;
    conn_state *cs = *con_cls;
    if (!cs) {
        if (!(cs = calloc(1, sizeof *cs)))
            return MHD_NO;
        *con_cls = cs;
        pthread_mutex_lock(&srv->count_lock);
        srv->http_requests++;
        pthread_mutex_unlock(&srv->count_lock);
        conn_guard_headers_done(con);
        enum MHD_Result r = route_request(srv, con, cs, url, method);
        if (!cs->to) /* answered from the headers: no body to wait for */
            conn_guard_body_done(con);
        return r;
    }
    if (*upload_size) {
        if (cs->len + *upload_size > srv->max_body)
            cs->too_big = 1; /* keep reading, to answer with an error rather than a reset */
        else if (buf_append(&cs->body, &cs->len, &cs->cap, upload, *upload_size) != 0)
            cs->too_big = 1;
        *upload_size = 0;
        return MHD_YES;
    }
    conn_guard_body_done(con);
    if (cs->too_big)
        return send_error(srv, con, 413, NULL, NULL,
                          "the request body is larger than the "
                          "server's limit of %zu bytes (--max-body)",
                          srv->max_body);
    if (!cs->len)
        return send_error(srv, con, 400, NULL, NULL, "the request has no body; send a JSON object");
    if (cs->to == ROUTE_EMBEDDINGS)
        return handle_embeddings(srv, con, cs->body, cs->len, cs->tenant);
    return handle_generate(srv, con, cs->body, cs->len, cs->to == ROUTE_CHAT, cs->tenant);
}

/* ---- reload --------------------------------------------------------------------------------- */

/* The engine for m and its drafter (opened here from srv's drafter settings, if any: each
 * engine needs its own), or NULL with err. */
static loom_engine *start_engine(const server *srv, loom_model *m, loom_model **drafter, char *err,
                                 size_t err_size)
{
    loom_engine_options eo = srv->eo;
    *drafter = NULL;
    if (srv->draft_path) {
        char why[2048];
        if (!(*drafter = loom_model_open(srv->draft_path, &srv->dmo, why, sizeof why))) {
            snprintf(err, err_size, "the drafter %s: %s", srv->draft_path, why);
            return NULL;
        }
        eo.draft = *drafter;
    }
    loom_engine *e = loom_engine_start(m, &eo, err, err_size);
    if (!e) {
        loom_model_close(*drafter);
        *drafter = NULL;
    }
    return e;
}

/* The model file opened anew with the first one's options, checked with a two-token
 * generation, and its engine started: a model ready to take requests, or NULL with err. */
static served *served_open(server *srv, char *err, size_t err_size)
{
    loom_model *m = loom_model_open(srv->model_path, &srv->mo, err, err_size);
    if (!m)
        return NULL;
    int32_t ids[64];
    int64_t n = loom_tokenize(m, "Hello", 1, 0, ids, 64, err, err_size);
    loom_sampling greedy = loom_sampling_defaults();
    greedy.temperature = 0;
    served *sv = n > 0 ? calloc(1, sizeof *sv) : NULL;
    if (!sv || loom_generate(m, ids, (int32_t)n, 2, &greedy, NULL, NULL, NULL, err, err_size)) {
        if (n > 0 && !sv)
            snprintf(err, err_size, "out of memory");
        free(sv);
        loom_model_close(m);
        return NULL;
    }
    sv->api = srv->api;
    sv->api.model = m;
    sv->api.n_ctx = loom_model_n_ctx(m);
    sv->api.max_prompt_bytes = loom_model_max_prompt_bytes(m);
    sv->api.model_name = srv->name_flag ? srv->name_flag : loom_model_name(m);
    if (loom_chat_format_choose(m, srv->tmpl_flag, srv->tmpl_file_flag, &sv->chat, err, err_size) !=
            0 ||
        !(sv->engine = start_engine(srv, m, &sv->drafter, err, err_size))) {
        loom_chat_format_free(&sv->chat);
        free(sv);
        loom_model_close(m);
        return NULL;
    }
    sv->api.chat = &sv->chat;
    sv->refs = 1; /* the server's */
    return sv;
}

static void served_free(served *sv)
{
    loom_engine_stop(sv->engine, 0);
    loom_engine_free(sv->engine);
    loom_model_close(sv->drafter);
    loom_model_close(sv->api.model);
    loom_chat_format_free(&sv->chat);
    free(sv);
}

static void reap(server *srv);

/* SIGHUP or POST /admin/reload: new requests go to the file as it is now once it has loaded
 * and generated; the old model finishes what it runs. On failure the old one keeps serving, and
 * the error stays in /health until a reload succeeds. While the model before the last reload
 * still finishes requests, another reload is refused: retired models (each with its KV pool)
 * never pile up behind a client that holds a stream open. Returns 0, -1 with err when the new
 * model failed, 1 with err when it was not tried for that reason. */
static int reload(server *srv, char *err, size_t err_size)
{
    if (!srv->can_reload) {
        snprintf(err, err_size, "a pipeline over an MPI job cannot reload its model");
        return -1;
    }
    pthread_mutex_lock(&srv->reload_lock);
    reap(srv);
    pthread_mutex_lock(&srv->live_lock);
    int held = 0;
    for (const served *r = srv->retired; r; r = r->next)
        held += r->refs;
    pthread_mutex_unlock(&srv->live_lock);
    if (held) {
        pthread_mutex_unlock(&srv->reload_lock);
        snprintf(err, err_size,
                 "the model before the last reload still finishes %d request%s; reload again "
                 "once %s done",
                 held, held == 1 ? "" : "s", held == 1 ? "it is" : "they are");
        fprintf(stderr, "loom serve: reload of %s not done: %s\n", srv->model_path, err);
        return 1;
    }
    served *sv = served_open(srv, err, err_size);
    pthread_mutex_lock(&srv->live_lock);
    if (sv) {
        served *old = srv->live;
        srv->live = sv;
        old->refs--; /* the server's */
        old->next = srv->retired;
        srv->retired = old;
        srv->reload_error[0] = '\0';
        srv->reloads++;
    } else {
        snprintf(srv->reload_error, sizeof srv->reload_error, "%.500s", err);
    }
    pthread_mutex_unlock(&srv->live_lock);
    pthread_mutex_unlock(&srv->reload_lock);
    if (sv)
        fprintf(stderr, "loom serve: reloaded %s: new requests go to %s on %s\n", srv->model_path,
                sv->api.model_name, loom_model_backend(sv->api.model));
    else
        fprintf(stderr, "loom serve: reloading %s failed, the old model keeps serving: %s\n",
                srv->model_path, err);
    return sv ? 0 : -1;
}

/* Frees the retired models no request holds any more (the main thread's work). */
static void reap(server *srv)
{
    for (;;) {
        pthread_mutex_lock(&srv->live_lock);
        served **p = &srv->retired;
        while (*p && (*p)->refs > 0)
            p = &(*p)->next;
        served *done = *p;
        if (done)
            *p = done->next;
        pthread_mutex_unlock(&srv->live_lock);
        if (!done)
            return;
        served_free(done);
    }
}

/* ---- main --------------------------------------------------------------------------------- */

/* seconds past --shutdown-timeout that connections get to send their last bytes */
#define SHUTDOWN_GRACE_S 5

static void *shutdown_watchdog(void *seconds)
{
    sleep((unsigned)*(const long *)seconds);
    static const char msg[] = "loom serve: threads still busy past --shutdown-timeout (a "
                              "request being parsed, or a client not reading); exiting now\n";
    if (write(STDERR_FILENO, msg, sizeof msg - 1) < 0) {
    }
    _exit(1);
}

/* The key is the file's first line (a trailing newline, and CR, dropped); flag: the option
 * that named the file. */
static int read_key_file(const char *flag, const char *path, char *key, size_t cap)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "loom serve: %s %s: %s\n", flag, path, strerror(errno));
        return -1;
    }
    int ok = fgets(key, (int)cap, f) != NULL;
    fclose(f);
    key[ok ? strcspn(key, "\r\n") : 0] = '\0';
    if (!key[0]) {
        fprintf(stderr, "loom serve: %s %s: the first line is empty\n", flag, path);
        return -1;
    }
    return 0;
}

static int valid_key(const char *key)
{
    size_t n = strlen(key);
    for (size_t i = 0; i < n; i++)
        if (key[i] <= ' ' || key[i] > '~')
            return 0;
    return n >= 1 && n <= 1024;
}

/* --api-keys FILE: one tenant per line, "NAME KEY [priority=N] [max-running=N] [max-queue=N]
 * [admin]" (blank lines and lines starting with '#' skipped). Every problem is named with its
 * line. */
static int read_api_keys(const char *path, server *srv)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "loom serve: --api-keys %s: %s\n", path, strerror(errno));
        return -1;
    }
    char line[2048];
    int n_line = 0, rc = 0;
    srv->tenants = calloc(LOOM_MAX_TENANTS, sizeof *srv->tenants);
    if (!srv->tenants) {
        fclose(f);
        return -1;
    }
    while (rc == 0 && fgets(line, sizeof line, f)) {
        n_line++;
        if (!strchr(line, '\n') && !feof(f)) {
            fprintf(stderr, "loom serve: --api-keys %s:%d: the line is too long\n", path, n_line);
            rc = -1;
            break;
        }
        char *save = NULL, *name = strtok_r(line, " \t\r\n", &save);
        if (!name || name[0] == '#')
            continue;
        char *key = strtok_r(NULL, " \t\r\n", &save);
        int name_ok = strlen(name) < sizeof srv->tenants[0].name;
        for (const char *c = name; name_ok && *c; c++)
            name_ok = isalnum((unsigned char)*c) || *c == '_' || *c == '-' || *c == '.';
        if (!name_ok || !key || !valid_key(key)) {
            fprintf(stderr,
                    "loom serve: --api-keys %s:%d: want 'NAME KEY [priority=N] [max-running=N] "
                    "[max-queue=N]': NAME of letters, digits, '_', '-' or '.' (up to 63), KEY of "
                    "1 to 1024 visible ASCII characters\n",
                    path, n_line);
            rc = -1;
            break;
        }
        if (srv->n_tenants == LOOM_MAX_TENANTS) {
            fprintf(stderr, "loom serve: --api-keys %s:%d: more than %d keys\n", path, n_line,
                    LOOM_MAX_TENANTS);
            rc = -1;
            break;
        }
        tenant *t = &srv->tenants[srv->n_tenants];
        snprintf(t->name, sizeof t->name, "%s", name);
        for (char *opt; rc == 0 && (opt = strtok_r(NULL, " \t\r\n", &save));) {
            if (!strcmp(opt, "admin")) {
                t->admin = 1;
                continue;
            }
            char *end;
            const char *eq = strchr(opt, '=');
            long v = eq ? strtol(eq + 1, &end, 10) : 0;
            int32_t *dest = !eq                     ? NULL
                : !strncmp(opt, "priority=", 9)     ? &t->priority
                : !strncmp(opt, "max-running=", 12) ? &t->max_running
                : !strncmp(opt, "max-queue=", 10)   ? &t->max_queue
                                                    : NULL;
            long lo = dest == &t->priority ? -1000000 : 1;
            if (!dest || eq[1] == '\0' || *end || v < lo || v > 1000000) {
                fprintf(stderr,
                        "loom serve: --api-keys %s:%d: '%s' is not priority=N (-1000000 to "
                        "1000000), max-running=N, max-queue=N (1 to 1000000) or admin\n",
                        path, n_line, opt);
                rc = -1;
            } else {
                *dest = (int32_t)v;
            }
        }
        for (int i = 0; rc == 0 && i < srv->n_tenants; i++)
            if (!strcmp(srv->tenants[i].name, name) || !strcmp(srv->tenants[i].key, key)) {
                fprintf(stderr, "loom serve: --api-keys %s:%d: %s '%s' is given twice\n", path,
                        n_line, strcmp(srv->tenants[i].name, name) ? "the key of" : "the name",
                        name);
                rc = -1;
            }
        if (rc == 0 && !(t->key = strdup(key)))
            rc = -1;
        if (rc == 0)
            t->key_len = strlen(key), srv->n_tenants++;
    }
    fclose(f);
    if (rc == 0 && !srv->n_tenants) {
        fprintf(stderr, "loom serve: --api-keys %s: no keys in it\n", path);
        rc = -1;
    }
    if (rc != 0) {
        for (int i = 0; i < srv->n_tenants; i++)
            free(srv->tenants[i].key);
        free(srv->tenants);
        srv->tenants = NULL, srv->n_tenants = 0;
    }
    return rc;
}

/* the keys of --api-keys, for the server's life (freed at exit, on any path out) */
static server keyring;

static void free_api_keys(void)
{
    for (int i = 0; i < keyring.n_tenants; i++)
        free(keyring.tenants[i].key);
    free(keyring.tenants);
    keyring.tenants = NULL, keyring.n_tenants = 0;
}

int loom_serve_main(int argc, char **argv)
{
    const char *host = "127.0.0.1", *api_key = NULL, *name = NULL, *tmpl = NULL, *tmpl_file = NULL,
               *key_file = NULL, *prefix_cache = "shared", *api_keys = NULL, *admin_key_file = NULL,
               *allow_host = NULL;
    long port = 8080, max_batch = 16, max_step = 256, kv_blocks = 0, max_queue = 0,
         block = loom_default_block_size(), max_body = 1 << 20, drain_s = 10, max_conn = 512,
         max_per_client = 64, idle_s = 30, header_s = 10, body_s = 60, lookup = 0, draft_max = 0,
         draft_layers = 0;
    const char *draft = NULL;
    float draft_p_min = 0.75f;
    int metrics_auth = 0, parse_special = 0, no_webui = 0;
    loom_open_flags of = {0};
    float request_timeout = 0, batch_wait = 0;
    char block_help[64];
    snprintf(block_help, sizeof block_help, "tokens per KV block (default %ld)", block);
    loom_sampling sampling = openai_default_sampling();
    const loom_flag flags[] = {
        LOOM_FLAG_MODEL(&of.model),
        {"--host", NULL, LOOM_FLAG_TEXT, &host, 0, 0, "ADDR",
         "address to listen on (default 127.0.0.1)"},
        {"--port", NULL, LOOM_FLAG_LONG, &port, 0, 65535, "N",
         "port (default 8080; 0 picks a free one)"},
        {"--api-key-file", NULL, LOOM_FLAG_TEXT, &key_file, 0, 0, "FILE",
         "require 'Authorization: Bearer KEY' on /v1/*, KEY being the\n"
         "file's first line (or set LOOM_API_KEY)"},
        {"--api-keys", NULL, LOOM_FLAG_TEXT, &api_keys, 0, 0, "FILE",
         "several keys, one tenant a line: NAME KEY [priority=N]\n"
         "[max-running=N] [max-queue=N] [admin]; tenants take turns at equal\n"
         "priority; priority=N is the best a key's requests get"},
        {"--api-key", NULL, LOOM_FLAG_TEXT, &api_key, 0, 0, "KEY",
         "the key itself: works, but shows it to anyone who can run ps"},
        {"--admin-key-file", NULL, LOOM_FLAG_TEXT, &admin_key_file, 0, 0, "FILE",
         "the key that may reload the model (POST /admin/reload) and see\n"
         "every tenant's metrics; without it the one API key may, or with\n"
         "--api-keys the lines that say 'admin'"},
        {"--allow-host", NULL, LOOM_FLAG_TEXT, &allow_host, 0, 0, "NAMES",
         "on a loopback --host, Host names accepted besides localhost,\n"
         "127.0.0.1 and [::1] (commas between; a proxy's name)"},
        {"--metrics-auth", NULL, LOOM_FLAG_SWITCH, &metrics_auth, 0, 0, NULL,
         "/metrics wants the key too"},
        {"--no-webui", NULL, LOOM_FLAG_SWITCH, &no_webui, 0, 0, NULL,
         "no chat page at GET / (the API alone)"},
        {"--model-name", NULL, LOOM_FLAG_TEXT, &name, 0, 0, "NAME",
         "the model id clients send (default: the file's name)"},
        {"--max-batch", NULL, LOOM_FLAG_LONG, &max_batch, 1, 4096, "N",
         "sequences run together (default 16)"},
        {"--max-tokens-per-step", NULL, LOOM_FLAG_LONG, &max_step, 1, 1 << 20, "N",
         "tokens in one forward pass (default 256)"},
        {"--max-queue", NULL, LOOM_FLAG_LONG, &max_queue, 1, 1 << 20, "N",
         "requests waiting to run at most; past it 429 with Retry-After\n"
         "(default 8 x max-batch)"},
        {"--lookup", NULL, LOOM_FLAG_LONG, &lookup, 0, 64, "N",
         "speculative decoding by prompt lookup for every request that does\n"
         "not say otherwise (\"speculative\"): its last N..2 tokens found\n"
         "earlier in its text propose what followed (default 0: off)"},
        {"--draft", NULL, LOOM_FLAG_TEXT, &draft, 0, 0, "MODEL",
         "speculative decoding with this drafter model (the same vocabulary)\n"
         "for every request that does not say otherwise"},
        {"--draft-layers", NULL, LOOM_FLAG_LONG, &draft_layers, 1, 4096, "K",
         "... or with the model's own first K layers"},
        {"--draft-p-min", NULL, LOOM_FLAG_FLOAT, &draft_p_min, 0, 1, "P",
         "the drafter stops at a token it gives less than P (default 0.75)"},
        {"--draft-max", NULL, LOOM_FLAG_LONG, &draft_max, 1, 64, "N",
         "most proposals a request checks a step (default 8)"},
        {"--batch-wait-ms", NULL, LOOM_FLAG_FLOAT, &batch_wait, 0, 10000, "MS",
         "with nothing running, wait up to this long for more requests\n"
         "before a prefill, so they start together (default 0)"},
        {"--request-timeout", NULL, LOOM_FLAG_FLOAT, &request_timeout, 0.001, 86400, "S",
         "a request's deadline in seconds unless it sends \"timeout\": waiting\n"
         "past it is a 504, generating past it ends with what it has (default none)"},
        {"-c", NULL, LOOM_FLAG_LONG, &of.n_ctx, 2, 1 << 20, "N",
         "context length per request (default: the model's, up to 4096)"},
        {"--kv-blocks", NULL, LOOM_FLAG_LONG, &kv_blocks, 1, 1 << 26, "N",
         "KV cache blocks shared by all requests (default: enough for\n"
         "max-batch sequences of 1024 tokens, at least one context)"},
        {"--block-size", NULL, LOOM_FLAG_LONG, &block, 1, 4096, "N", block_help},
        LOOM_FLAG_KV_TYPE(&of.kv_type),
        {"--chat-template", NULL, LOOM_FLAG_TEXT, &tmpl, 0, 0, "NAME",
         "a built-in chat format instead of the model's template"},
        {"--chat-template-file", NULL, LOOM_FLAG_TEXT, &tmpl_file, 0, 0, "FILE",
         "a Jinja chat template instead of the model's"},
        LOOM_FLAG_THREADS(&of.threads),
        LOOM_FLAG_EXPERTS_ON(&of.experts_on),
        LOOM_FLAG_DISTRIBUTED(&of.distributed),
        LOOM_FLAG_LAYERS(&of.layers),
        {"--max-body", NULL, LOOM_FLAG_LONG, &max_body, 1024, 1L << 30, "BYTES",
         "largest request body accepted (default 1048576)"},
        {"--shutdown-timeout", NULL, LOOM_FLAG_LONG, &drain_s, 0, 3600, "S",
         "on SIGTERM, let running requests finish this long (default 10);\n"
         "meanwhile new requests get 503 with Retry-After"},
        {"--parse-special", NULL, LOOM_FLAG_SWITCH, &parse_special, 0, 0, NULL,
         "special tokens written in messages or prompts ('<|im_start|>')\n"
         "are parsed as such (default: plain text; only the chat\n"
         "template's own are special). For trusted clients only."},
        {"--prefix-cache", NULL, LOOM_FLAG_CHOICE, &prefix_cache, 0, 0, "shared|per-user",
         "share cached prompt prefixes between all requests (default),\n"
         "or only between requests with the same 'user' field, so that\n"
         "cache hits tell no client about another's prompts"},
        {"--max-connections", NULL, LOOM_FLAG_LONG, &max_conn, 1, 1 << 20, "N",
         "open connections in all (default 512)"},
        {"--max-connections-per-client", NULL, LOOM_FLAG_LONG, &max_per_client, 1, 1 << 20, "N",
         "open connections from one address (default 64)"},
        {"--idle-timeout", NULL, LOOM_FLAG_LONG, &idle_s, 1, 86400, "S",
         "close a connection idle this long, headers or body half sent\n"
         "included (default 30)"},
        {"--header-timeout", NULL, LOOM_FLAG_LONG, &header_s, 1, 86400, "S",
         "a new connection must send its request's headers within this\n"
         "(default 10); slow senders cannot hold connections"},
        {"--body-timeout", NULL, LOOM_FLAG_LONG, &body_s, 1, 86400, "S",
         "a request's body must arrive within this of its headers (default 60)"},
    };
    const loom_command cmd = {
        .name = "loom serve",
        .synopsis = "-m MODEL [options]",
        .flags = flags,
        .n_flags = LOOM_N_FLAGS(flags),
        .sampling = &sampling,
        .sampling_title = "sampling, for the fields a request leaves out (OpenAI's defaults "
                          "unless set here):"};
    int parsed = loom_args_parse(&cmd, argc, argv);
    if (parsed)
        return parsed == 1 ? 0 : parsed;
    if (!of.model) {
        fprintf(
            stderr,
            "loom serve: give the model with -m MODEL (a GGUF file or a Hugging Face folder)\n");
        return 2;
    }
    if (!!draft + !!draft_layers + !!lookup > 1) {
        fprintf(stderr, "loom serve: give one drafter: --draft, --draft-layers or --lookup\n");
        return 2;
    }
    char key_buf[4096];
    const char *env_key = getenv("LOOM_API_KEY");
    if (!!api_key + !!key_file + !!api_keys + !!(env_key && *env_key) > 1) {
        fprintf(stderr,
                "loom serve: give the API key one way: --api-key-file, --api-keys, LOOM_API_KEY "
                "or --api-key\n");
        return 2;
    }
    if (key_file && read_key_file("--api-key-file", key_file, key_buf, sizeof key_buf) != 0)
        return 2;
    char admin_buf[4096] = "";
    if (admin_key_file &&
        (read_key_file("--admin-key-file", admin_key_file, admin_buf, sizeof admin_buf) != 0 ||
         !valid_key(admin_buf))) {
        if (admin_buf[0])
            fprintf(stderr,
                    "loom serve: --admin-key-file: the key must be 1 to 1024 visible "
                    "ASCII characters (no spaces or controls)\n");
        return 2;
    }
    atexit(free_api_keys);
    if (api_keys && read_api_keys(api_keys, &keyring) != 0)
        return 2;
    if (key_file)
        api_key = key_buf;
    else if (env_key && *env_key)
        api_key = env_key;
    if (api_key && !valid_key(api_key)) {
        fprintf(stderr,
                "loom serve: the API key must be 1 to 1024 visible ASCII characters (no "
                "spaces or controls)\n");
        return 2;
    }
    int admin_is_api_key = admin_key_file && api_key && !strcmp(admin_buf, api_key);
    for (int i = 0; admin_key_file && i < keyring.n_tenants; i++)
        admin_is_api_key |= !strcmp(admin_buf, keyring.tenants[i].key);
    if (admin_is_api_key) {
        fprintf(stderr,
                "loom serve: the admin key (--admin-key-file) must differ from the API "
                "keys: a client that only uses the API must not be able to reload\n");
        return 2;
    }
    if (metrics_auth && !api_key && !keyring.n_tenants) {
        fprintf(stderr,
                "loom serve: --metrics-auth needs an API key (--api-key-file or LOOM_API_KEY)\n");
        return 2;
    }
    if (tmpl && !loom_chat_template_valid(tmpl)) {
        fprintf(stderr, "loom serve: unknown chat template '%s' (known: %s)\n", tmpl,
                loom_chat_templates());
        return 2;
    }
    if (tmpl && tmpl_file) {
        fprintf(stderr, "loom serve: give --chat-template or --chat-template-file, not both\n");
        return 2;
    }
    if (max_step < max_batch) {
        fprintf(stderr,
                "loom serve: --max-tokens-per-step (%ld) must be at least --max-batch (%ld)\n",
                max_step, max_batch);
        return 2;
    }
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, host, &addr.sin_addr) != 1) {
        fprintf(stderr,
                "loom serve: --host wants an IPv4 address like 127.0.0.1 or 0.0.0.0, not '%s'\n",
                host);
        return 2;
    }

    /* every thread started from here on leaves SIGTERM/SIGINT to sigwait below */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    char err[4096];
    /* the KV pool: --kv-blocks, or room for max-batch sequences of up to 1024 tokens */
    loom_model_options mo = loom_open_options(&of);
    mo.block_size = (int32_t)block;
    mo.kv_blocks = (int32_t)kv_blocks;
    mo.kv_sequences = (int32_t)max_batch;
    loom_model *m = loom_model_open(of.model, &mo, err, sizeof err);
    if (!m) {
        fprintf(stderr, "loom serve: %s\n", err);
        return 2;
    }
    /* a pipeline's other ranks serve their stage until rank 0 has drained its requests and
     * closes the model: SIGTERM, which mpirun sends every rank, stays blocked there */
    int followed = loom_args_follow("loom serve", m);
    if (followed >= 0)
        return followed;
    int32_t ctx = loom_model_n_ctx(m);
    if (kv_blocks && kv_blocks * block < ctx) {
        fprintf(stderr,
                "loom serve: --kv-blocks %ld holds %ld tokens, less than one %d-token "
                "context; give at least %ld (or lower -c)\n",
                kv_blocks, kv_blocks * block, ctx, (ctx + block - 1) / block);
        loom_model_close(m);
        return 2;
    }
    server srv = {.api = {.model = m,
                          .n_ctx = ctx,
                          .parse_special = parse_special,
                          .max_prompt_bytes = loom_model_max_prompt_bytes(m),
                          .defaults = sampling,
                          .lookup = (int32_t)lookup,
                          .draft_max = (int32_t)draft_max,
                          .draft = draft || draft_layers},
                  .api_key = api_key,
                  .api_key_len = api_key ? strlen(api_key) : 0,
                  .admin_key = admin_key_file ? admin_buf : NULL,
                  .admin_key_len = admin_key_file ? strlen(admin_buf) : 0,
                  .loopback = ntohl(addr.sin_addr.s_addr) >> 24 == 127,
                  .allowed_hosts = allow_host,
                  .metrics_auth = metrics_auth,
                  .webui = !no_webui,
                  .partition_by_user = !strcmp(prefix_cache, "per-user"),
                  .max_body = (size_t)max_body,
                  .started = time(NULL),
                  .timeout_s = request_timeout,
                  .tenants = keyring.tenants,
                  .n_tenants = keyring.n_tenants};
    pthread_mutex_init(&srv.count_lock, NULL);
    sem_init(&srv.parsing, 0, 4);
    srv.api.model_name = name ? name : loom_model_name(m);
    loom_chat_format chat;
    if (loom_chat_format_choose(m, tmpl, tmpl_file, &chat, err, sizeof err) != 0) {
        fprintf(stderr, "loom serve: %s\n", err);
        loom_model_close(m);
        return 2;
    }
    loom_tool_syntax ts = loom_chat_format_tool_syntax(&chat);
    fprintf(stderr, "loom serve: chat template: %s; tool calls: %s\n", chat.about,
            ts == LOOM_TOOLS_NONE          ? "none (the template shows no tools)"
                : ts == LOOM_TOOLS_UNKNOWN ? "unknown (the template's form is not one loom reads)"
                                           : loom_tool_syntax_name(ts));
    loom_engine_options eo = {.max_batch = (int32_t)max_batch,
                              .max_tokens_per_step = (int32_t)max_step,
                              .max_queue = (int32_t)max_queue,
                              .batch_wait_ms = batch_wait,
                              .draft_p_min = draft_p_min};
    srv.eo = eo;
    if (draft || draft_layers) { /* the drafter's cache: room for as many sequences */
        srv.draft_path = draft ? draft : of.model;
        srv.dmo = mo;
        srv.dmo.distributed = 0;
        srv.dmo.n_ctx = ctx;
        srv.dmo.first_layers = (int32_t)draft_layers;
        fprintf(stderr, "loom serve: speculative decoding with %s%s\n",
                draft ? "the draft model " : "the model's first layers", draft ? draft : "");
    }
    loom_model *drafter;
    loom_engine *engine = start_engine(&srv, m, &drafter, err, sizeof err);
    if (!engine) {
        fprintf(stderr, "loom serve: %s\n", err);
        loom_chat_format_free(&chat);
        loom_model_close(m);
        return 2;
    }
    pthread_mutex_init(&srv.live_lock, NULL);
    pthread_mutex_init(&srv.reload_lock, NULL);
    srv.model_path = of.model, srv.mo = mo;
    srv.name_flag = name, srv.tmpl_flag = tmpl, srv.tmpl_file_flag = tmpl_file;
    srv.can_reload = !loom_distributed_job(of.distributed ? 2 : 1);
    served first = {.api = srv.api, .engine = engine, .drafter = drafter, .refs = 1};
    srv.live = malloc(sizeof *srv.live);
    if (!srv.live) {
        loom_engine_stop(engine, 0);
        loom_engine_free(engine);
        loom_model_close(drafter);
        loom_model_close(m);
        return 1;
    }
    *srv.live = first;
    srv.live->chat = chat;
    srv.live->api.chat = &srv.live->chat;
    /* poll(), not select(): select stops at descriptor 1024 and locks every client out once
     * that many sockets are open; limits in total and per address, and a short idle timeout,
     * keep stalled or slow connections from holding the server */
    /* the daemon accepts a few past --max-connections so that the guard can evict a slow
     * connection for a new one rather than the daemon refusing it */
    srv.guard = conn_guard_start(max_conn, header_s, body_s, idle_s);
    struct MHD_Daemon *d = !srv.guard
        ? NULL
        : MHD_start_daemon(
              MHD_USE_THREAD_PER_CONNECTION | MHD_USE_POLL_INTERNAL_THREAD | MHD_USE_ITC |
                  MHD_USE_ERROR_LOG,
              0, NULL, NULL, on_request, &srv, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&addr,
              MHD_OPTION_NOTIFY_COMPLETED, request_completed, NULL, MHD_OPTION_NOTIFY_CONNECTION,
              conn_guard_notify, srv.guard, MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)idle_s,
              MHD_OPTION_CONNECTION_LIMIT, (unsigned)max_conn + 16,
              MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)max_per_client, MHD_OPTION_END);
    if (!d) {
        conn_guard_stop(srv.guard);
        fprintf(stderr,
                "loom serve: cannot listen on %s:%ld: %s (is the port in use? try --port)\n", host,
                port, strerror(errno));
        served_free(srv.live); /* the first model and its engine */
        return 1;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
    loom_engine_stats st = loom_engine_get_stats(engine);
    fprintf(stderr,
            "loom serve: %s on %s; %d-token context, %d KV blocks of %d tokens, batch %ld\n",
            srv.api.model_name, loom_model_backend(m), ctx, st.kv_blocks, st.block_size, max_batch);
    fprintf(stderr, "loom serve: listening on http://%s:%u%s\n", host,
            di ? di->port : (unsigned)port, srv.webui ? " (a chat page at /)" : "");

    /* SIGHUP reloads the model; retired models are freed once their requests are done */
    int sig = 0;
    for (;;) {
        struct timespec tick = {1, 0};
        sig = sigtimedwait(&sigs, NULL, &tick);
        if (sig == SIGTERM || sig == SIGINT)
            break;
        if (sig == SIGHUP) {
            char why[1024];
            reload(&srv, why, sizeof why);
        }
        reap(&srv);
    }
    fprintf(stderr, "loom serve: %s: no new requests; finishing running ones (up to %ld s)\n",
            sig == SIGTERM ? "SIGTERM" : "SIGINT", drain_s);
    /* --shutdown-timeout bounds every thread: one still parsing a request, or sending to a
     * client that does not read, must not hold the process past it (the daemon's stop waits
     * for each connection's thread) */
    static long watchdog_s;
    watchdog_s = drain_s + SHUTDOWN_GRACE_S;
    pthread_t watchdog;
    if (pthread_create(&watchdog, NULL, shutdown_watchdog, &watchdog_s) == 0)
        pthread_detach(watchdog);
    srv.shutting_down = 1;                /* new requests now get 503 with Retry-After */
    pthread_mutex_lock(&srv.reload_lock); /* no reload from here on */
    loom_engine_stop(srv.live->engine, (int)drain_s * 1000);
    for (served *r = srv.retired; r; r = r->next)
        loom_engine_stop(r->engine, (int)drain_s * 1000);
    /* every job is done now; give the connections a moment to send their last bytes (an idle
     * keep-alive connection just waits out the moment) before the daemon closes them */
    for (int waited = 0; waited < 3000; waited += 20) {
        const union MHD_DaemonInfo *ci = MHD_get_daemon_info(d,
                                                             MHD_DAEMON_INFO_CURRENT_CONNECTIONS);
        if (!ci || ci->num_connections == 0)
            break;
        usleep(20 * 1000);
    }
    MHD_stop_daemon(d);
    conn_guard_stop(srv.guard);
    srv.live->refs--;
    srv.live->next = srv.retired;
    srv.retired = srv.live;
    for (served *r = srv.retired, *next; r; r = next) {
        next = r->next;
        served_free(r);
    }
    pthread_mutex_unlock(&srv.reload_lock);
    pthread_mutex_destroy(&srv.count_lock);
    sem_destroy(&srv.parsing);
    fprintf(stderr, "loom serve: stopped\n");
    return 0;
}
