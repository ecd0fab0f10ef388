/*
 * tools/serve.c - `loom serve`: an OpenAI-compatible HTTP server on libmicrohttpd.
 *
 * HTTP threads (one per connection) parse, validate and tokenize requests, submit them to the
 * engine (api/engine.c) and turn its events into responses; they never run the model. Each
 * request's state (a job) is shared by its connection thread and the engine thread: a mutex
 * and condition variable guard it, and a reference count frees it once both are done with it.
 * Request and response shapes follow the OpenAI API as the official Python client sends and
 * reads them.
 */
#define _GNU_SOURCE
#include <loom/loom.h>

#include "args.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <microhttpd.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_CHOICES 8
#define MAX_STOPS 4

typedef struct server {
    loom_model *model;
    loom_engine *engine;
    const char *model_name;
    const char *api_key;
    const char *chat_template;
    size_t max_body;
    int32_t n_ctx;
    volatile int shutting_down;
    time_t started;
    pthread_mutex_t count_lock;
    uint64_t http_requests, http_errors, disconnects;
} server;

/* ---- jobs: one HTTP request's generations ------------------------------------------------- */

typedef struct choice {
    char *text;
    size_t len, cap, sent; /* sent: bytes already streamed */
    int done, final_sent;
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
    int chat, stream, include_usage, n;
    choice ch[MAX_CHOICES];
    int32_t n_prompt, n_cached;
    char id[40];
    time_t created;
    /* streaming */
    char *out;
    size_t out_len, out_cap, out_pos;
    int role_sent, finished;
} job;

typedef struct event_target {
    job *j;
    int index;
} event_target;

static void job_unref(job *j)
{
    pthread_mutex_lock(&j->mu);
    int left = --j->refs;
    pthread_mutex_unlock(&j->mu);
    if (left)
        return;
    for (int i = 0; i < MAX_CHOICES; i++)
        free(j->ch[i].text);
    free(j->out);
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    free(j);
}

static int append(char **buf, size_t *len, size_t *cap, const char *s, size_t n)
{
    if (*len + n + 1 > *cap) {
        size_t c = (*len + n + 1) * 2;
        char *nb = realloc(*buf, c);
        if (!nb)
            return -1;
        *buf = nb, *cap = c;
    }
    memcpy(*buf + *len, s, n);
    *len += n;
    (*buf)[*len] = 0;
    return 0;
}

static void on_event(void *user, const loom_event *ev)
{
    event_target *t = user;
    job *j = t->j;
    choice *c = &j->ch[t->index];
    pthread_mutex_lock(&j->mu);
    if (ev->kind == LOOM_EVENT_TEXT) {
        append(&c->text, &c->len, &c->cap, ev->text, ev->len);
    } else {
        c->done = 1;
        c->n_generated = ev->n_generated;
        if (t->index == 0)
            j->n_cached = ev->n_cached;
        snprintf(c->finish, sizeof c->finish, "%s", ev->finish_reason ? ev->finish_reason : "stop");
        if (ev->kind == LOOM_EVENT_ERROR)
            snprintf(c->error, sizeof c->error, "%s", ev->error ? ev->error : "generation failed");
    }
    pthread_cond_broadcast(&j->cv);
    int last = ev->kind != LOOM_EVENT_TEXT;
    pthread_mutex_unlock(&j->mu);
    if (last) {
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
            loom_engine_cancel(j->srv->engine, j->ch[i].id);
}

/* ---- responses ---------------------------------------------------------------------------- */

static enum MHD_Result send_text(struct MHD_Connection *con, unsigned status, const char *type,
                                 const char *body)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(body), (void *)body,
                                                             MHD_RESPMEM_MUST_COPY);
    if (!r)
        return MHD_NO;
    MHD_add_response_header(r, "Content-Type", type);
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
    cJSON_AddStringToObject(e, "message", msg);
    cJSON_AddStringToObject(e, "type", status == 401   ? "authentication_error"
                                       : status >= 500 ? "server_error"
                                       : status == 404 ? "not_found_error"
                                                       : "invalid_request_error");
    if (param)
        cJSON_AddStringToObject(e, "param", param);
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
    cJSON_AddStringToObject(o, "model", j->srv->model_name);
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
    char *t = strndup(text ? text : "", text ? len : 0);
    if (j->chat) {
        cJSON *m = cJSON_AddObjectToObject(c, chunk ? "delta" : "message");
        if (with_role || !chunk)
            cJSON_AddStringToObject(m, "role", "assistant");
        if (text || !chunk)
            cJSON_AddStringToObject(m, "content", t ? t : "");
    } else {
        cJSON_AddStringToObject(c, "text", t ? t : "");
    }
    free(t);
    cJSON_AddNullToObject(c, "logprobs");
    add_finish(c, finish);
    return c;
}

static void sse(job *j, cJSON *o)
{
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!s)
        return;
    append(&j->out, &j->out_len, &j->out_cap, "data: ", 6);
    append(&j->out, &j->out_len, &j->out_cap, s, strlen(s));
    append(&j->out, &j->out_len, &j->out_cap, "\n\n", 2);
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
        if (c->sent < c->len) {
            cJSON *o = response_head(j, object), *a = cJSON_AddArrayToObject(o, "choices");
            cJSON_AddItemToArray(a, choice_json(j, i, c->text + c->sent, c->len - c->sent, NULL, 1, 0));
            sse(j, o);
            c->sent = c->len;
        }
        if (c->done && !c->final_sent) {
            cJSON *o;
            if (c->error[0]) {
                o = cJSON_CreateObject();
                cJSON *e = cJSON_AddObjectToObject(o, "error");
                cJSON_AddStringToObject(e, "message", c->error);
                cJSON_AddStringToObject(e, "type", "server_error");
            } else {
                o = response_head(j, object);
                cJSON *a = cJSON_AddArrayToObject(o, "choices");
                cJSON_AddItemToArray(a, choice_json(j, i, NULL, 0, c->finish, 1, 0));
            }
            sse(j, o);
            c->final_sent = 1;
        }
    }
    if (all_done(j) && !j->finished) {
        if (j->include_usage) {
            cJSON *o = response_head(j, object);
            cJSON_AddArrayToObject(o, "choices");
            cJSON_AddItemToObject(o, "usage", usage_json(j));
            sse(j, o);
        }
        append(&j->out, &j->out_len, &j->out_cap, "data: [DONE]\n\n", 14);
        j->finished = 1;
    }
}

/* libmicrohttpd pulls the stream from here; with a thread per connection it may block. */
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
        if (j->out_len == 0)
            pthread_cond_wait(&j->cv, &j->mu);
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

/* Whether the client closed its end while we wait to answer. */
static int client_gone(struct MHD_Connection *con)
{
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(con, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci)
        return 0;
    char c;
    ssize_t n = recv(ci->connect_fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

static enum MHD_Result finish_blocking(struct MHD_Connection *con, job *j)
{
    pthread_mutex_lock(&j->mu);
    while (!all_done(j)) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += 200 * 1000000L;
        if (until.tv_nsec >= 1000000000L)
            until.tv_sec++, until.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&j->cv, &j->mu, &until);
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
            pthread_mutex_unlock(&j->mu);
            job_unref(j);
            return send_error(j->srv, con, 500, NULL, NULL, "%s", msg);
        }
    cJSON *o = response_head(j, j->chat ? "chat.completion" : "text_completion");
    cJSON *a = cJSON_AddArrayToObject(o, "choices");
    for (int i = 0; i < j->n; i++)
        cJSON_AddItemToArray(a, choice_json(j, i, j->ch[i].text ? j->ch[i].text : "", j->ch[i].len,
                                            j->ch[i].finish, 0, 1));
    cJSON_AddItemToObject(o, "usage", usage_json(j));
    pthread_mutex_unlock(&j->mu);
    job_unref(j);
    return send_json(con, 200, o);
}

/* ---- request parsing ---------------------------------------------------------------------- */

typedef struct parsed {
    int32_t *ids;
    int32_t n_ids;
    int32_t max_tokens; /* -1: to the end of the context */
    int max_tokens_given;
    int n, stream, include_usage;
    loom_sampling s;
    int seed_given;
    const char *stops[MAX_STOPS];
    int n_stops;
} parsed;

typedef struct bad {
    char msg[512];
    char param_buf[64];  /* a copy: the request's JSON is gone when the error is sent */
    const char *param;
    const char *code;
    unsigned status;
} bad;

static int fail(bad *b, unsigned status, const char *param, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b->msg, sizeof b->msg, fmt, ap);
    va_end(ap);
    b->param = NULL;
    if (param) {
        snprintf(b->param_buf, sizeof b->param_buf, "%s", param);
        b->param = b->param_buf;
    }
    b->status = status;
    return -1;
}

static const char *json_type(const cJSON *v)
{
    return cJSON_IsString(v) ? "a string" : cJSON_IsNumber(v) ? "a number" : cJSON_IsBool(v) ? "a boolean"
           : cJSON_IsArray(v) ? "an array" : cJSON_IsObject(v) ? "an object" : "null";
}

static int get_number(const cJSON *o, const char *key, double lo, double hi, int integer, double *out,
                      bad *b)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!v || cJSON_IsNull(v))
        return 0;
    if (!cJSON_IsNumber(v))
        return fail(b, 400, key, "'%s' must be a number, not %s", key, json_type(v));
    double x = v->valuedouble;
    if (!isfinite(x) || x < lo || x > hi || (integer && x != floor(x)))
        return fail(b, 400, key, "'%s' must be %s from %g to %g; got %g", key,
                    integer ? "a whole number" : "a number", lo, hi, x);
    *out = x;
    return 1;
}

static int get_bool(const cJSON *o, const char *key, int *out, bad *b)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!v || cJSON_IsNull(v))
        return 0;
    if (!cJSON_IsBool(v))
        return fail(b, 400, key, "'%s' must be a boolean, not %s", key, json_type(v));
    *out = cJSON_IsTrue(v);
    return 1;
}

/* Fields the OpenAI API defines that loom accepts only at their "off" value. */
static int unsupported(const cJSON *body, const char *key, bad *b)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(body, key);
    if (!v || cJSON_IsNull(v) || cJSON_IsFalse(v) ||
        ((cJSON_IsObject(v) || cJSON_IsArray(v)) && !v->child))
        return 0;
    if (!strcmp(key, "response_format") && cJSON_IsObject(v)) {
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(v, "type");
        if (cJSON_IsString(t) && !strcmp(t->valuestring, "text"))
            return 0;
    }
    if (!strcmp(key, "best_of") && cJSON_IsNumber(v) && v->valuedouble == 1)
        return 0;
    return fail(b, 400, key, "'%s' is not supported by this server (loom)", key);
}

static int check_known(const cJSON *body, const char *const *known, bad *b)
{
    for (const cJSON *f = body->child; f; f = f->next) {
        int ok = 0;
        for (int i = 0; known[i] && !ok; i++)
            ok = !strcmp(f->string, known[i]);
        if (!ok)
            return fail(b, 400, f->string, "Unrecognized request argument supplied: %s", f->string);
    }
    return 0;
}

static int tokenize_text(server *srv, const char *text, int parse_special, parsed *p, bad *b)
{
    char err[512];
    int64_t n = loom_tokenize(srv->model, text, 1, parse_special, NULL, 0, err, sizeof err);
    if (n < 0)
        return fail(b, 500, NULL, "%s", err);
    p->ids = malloc((size_t)(n > 0 ? n : 1) * sizeof *p->ids);
    if (!p->ids)
        return fail(b, 500, NULL, "out of memory");
    p->n_ids = (int32_t)loom_tokenize(srv->model, text, 1, parse_special, p->ids, n, err, sizeof err);
    return 0;
}

/* A chat message's content: a string, or an array of {"type": "text", "text": ...} parts. */
static char *message_text(const cJSON *content, int index, bad *b)
{
    if (cJSON_IsString(content))
        return strdup(content->valuestring);
    if (!cJSON_IsArray(content)) {
        fail(b, 400, "messages", "messages[%d].content must be a string or an array of text parts", index);
        return NULL;
    }
    size_t len = 0, cap = 0;
    char *s = NULL;
    append(&s, &len, &cap, "", 0);
    for (const cJSON *part = content->child; part; part = part->next) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(part, "text");
        if (!cJSON_IsString(type) || strcmp(type->valuestring, "text") || !cJSON_IsString(text)) {
            free(s);
            fail(b, 400, "messages", "messages[%d].content: only text parts are supported", index);
            return NULL;
        }
        append(&s, &len, &cap, text->valuestring, strlen(text->valuestring));
    }
    return s;
}

static int parse_messages(server *srv, const cJSON *body, parsed *p, bad *b)
{
    const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(body, "messages");
    if (!msgs)
        return fail(b, 400, "messages", "Missing required parameter: 'messages'");
    if (!cJSON_IsArray(msgs) || !msgs->child)
        return fail(b, 400, "messages", "'messages' must be a non-empty array");
    int n = cJSON_GetArraySize(msgs);
    loom_chat_message *m = calloc((size_t)n, sizeof *m);
    if (!m)
        return fail(b, 500, NULL, "out of memory");
    int i = 0, rc = 0;
    for (const cJSON *x = msgs->child; x && rc == 0; x = x->next, i++) {
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(x, "role");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(x, "content");
        if (!cJSON_IsObject(x) || !cJSON_IsString(role)) {
            rc = fail(b, 400, "messages", "messages[%d] must be an object with a string 'role'", i);
            break;
        }
        const char *r = role->valuestring;
        if (!strcmp(r, "developer"))
            r = "system";
        if (strcmp(r, "system") && strcmp(r, "user") && strcmp(r, "assistant")) {
            rc = fail(b, 400, "messages", "messages[%d].role '%s' is not one of system, developer, "
                      "user, assistant", i, role->valuestring);
            break;
        }
        m[i].role = r;
        if (!(m[i].content = message_text(content, i, b)))
            rc = -1;
    }
    char *prompt = NULL, err[512];
    if (rc == 0 && loom_chat_render(srv->chat_template, m, n, 1, &prompt, err, sizeof err) != 0)
        rc = fail(b, 400, "messages", "%s", err);
    if (rc == 0)
        rc = tokenize_text(srv, prompt, 1, p, b);
    free(prompt);
    for (int k = 0; k < n; k++)
        free((char *)m[k].content);
    free(m);
    return rc;
}

static int parse_prompt(server *srv, const cJSON *body, parsed *p, bad *b)
{
    const cJSON *pr = cJSON_GetObjectItemCaseSensitive(body, "prompt");
    if (!pr)
        return fail(b, 400, "prompt", "Missing required parameter: 'prompt'");
    if (cJSON_IsArray(pr) && cJSON_GetArraySize(pr) == 1 && cJSON_IsString(pr->child))
        pr = pr->child; /* ["text"] */
    if (cJSON_IsString(pr))
        return tokenize_text(srv, pr->valuestring, 0, p, b);
    if (cJSON_IsArray(pr) && cJSON_IsArray(pr->child) && cJSON_GetArraySize(pr) == 1)
        pr = pr->child; /* [[ids]] */
    if (cJSON_IsArray(pr) && pr->child && cJSON_IsNumber(pr->child)) {
        int n = cJSON_GetArraySize(pr);
        int32_t nv = loom_model_n_vocab(srv->model);
        p->ids = malloc((size_t)n * sizeof *p->ids);
        if (!p->ids)
            return fail(b, 500, NULL, "out of memory");
        for (const cJSON *x = pr->child; x; x = x->next) {
            if (!cJSON_IsNumber(x) || x->valuedouble != floor(x->valuedouble) || x->valuedouble < 0 ||
                x->valuedouble >= nv)
                return fail(b, 400, "prompt", "prompt token ids must be whole numbers from 0 to %d", nv - 1);
            p->ids[p->n_ids++] = (int32_t)x->valuedouble;
        }
        return 0;
    }
    if (cJSON_IsArray(pr) && cJSON_GetArraySize(pr) > 1)
        return fail(b, 400, "prompt", "loom serves one prompt per request; send the %d prompts as "
                    "separate requests (they run concurrently)", cJSON_GetArraySize(pr));
    return fail(b, 400, "prompt", "'prompt' must be a string, an array of token ids, or a one-element "
                "array of either; got %s", json_type(pr));
}

static int parse_request(server *srv, const cJSON *body, int chat, parsed *p, bad *b)
{
    static const char *const completion_fields[] = {
        "model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options",
        "stop", "seed", "presence_penalty", "frequency_penalty", "user", "echo", "logprobs",
        "best_of", "logit_bias", "suffix", "top_k", "min_p", "repetition_penalty", "ignore_eos",
        NULL};
    static const char *const chat_fields[] = {
        "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
        "stream", "stream_options", "stop", "seed", "presence_penalty", "frequency_penalty", "user",
        "logprobs", "top_logprobs", "logit_bias", "response_format", "tools", "tool_choice",
        "parallel_tool_calls", "functions", "function_call", "store", "metadata",
        "service_tier", "top_k", "min_p", "repetition_penalty", "ignore_eos", NULL};
    static const char *const completion_unsupported[] = {"echo", "logprobs", "best_of", "logit_bias",
                                                         "suffix", NULL};
    static const char *const chat_unsupported[] = {"logprobs", "top_logprobs", "logit_bias",
                                                   "response_format", "tools", "tool_choice",
                                                   "functions", "function_call", NULL};
    if (!cJSON_IsObject(body))
        return fail(b, 400, NULL, "the request body must be a JSON object");
    if (check_known(body, chat ? chat_fields : completion_fields, b))
        return -1;
    for (const char *const *u = chat ? chat_unsupported : completion_unsupported; *u; u++)
        if (unsupported(body, *u, b))
            return -1;
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(body, "model");
    if (!model)
        return fail(b, 400, "model", "Missing required parameter: 'model' (this server has '%s')",
                    srv->model_name);
    if (!cJSON_IsString(model))
        return fail(b, 400, "model", "'model' must be a string, not %s", json_type(model));
    if (strcmp(model->valuestring, srv->model_name)) {
        b->code = "model_not_found";
        return fail(b, 404, "model", "The model '%s' does not exist; this server has '%s'",
                    model->valuestring, srv->model_name);
    }
    p->s = loom_sampling_defaults();
    p->s.temperature = 1, p->s.top_p = 1, p->s.top_k = 0, p->s.min_p = 0; /* OpenAI's defaults */
    p->max_tokens = chat ? -1 : 16;
    p->n = 1;
    double x;
    int r;
    const char *mt = chat && cJSON_GetObjectItemCaseSensitive(body, "max_completion_tokens")
                         ? "max_completion_tokens" : "max_tokens";
    if ((r = get_number(body, mt, 1, INT_MAX, 1, &x, b)) < 0) return -1;
    if (r) p->max_tokens = (int32_t)x, p->max_tokens_given = 1;
    if ((r = get_number(body, "temperature", 0, 2, 0, &x, b)) < 0) return -1;
    if (r) p->s.temperature = (float)x;
    if ((r = get_number(body, "top_p", 0, 1, 0, &x, b)) < 0) return -1;
    if (r) p->s.top_p = (float)x;
    if ((r = get_number(body, "top_k", -1, 1 << 24, 1, &x, b)) < 0) return -1;
    if (r) p->s.top_k = x < 0 ? 0 : (int32_t)x;
    if ((r = get_number(body, "min_p", 0, 1, 0, &x, b)) < 0) return -1;
    if (r) p->s.min_p = (float)x;
    if ((r = get_number(body, "repetition_penalty", 0.01, 100, 0, &x, b)) < 0) return -1;
    if (r) p->s.repeat_penalty = (float)x;
    if ((r = get_number(body, "presence_penalty", -2, 2, 0, &x, b)) < 0) return -1;
    if (r) p->s.presence_penalty = (float)x;
    if ((r = get_number(body, "frequency_penalty", -2, 2, 0, &x, b)) < 0) return -1;
    if (r) p->s.frequency_penalty = (float)x;
    if ((r = get_number(body, "n", 1, MAX_CHOICES, 1, &x, b)) < 0) return -1;
    if (r) p->n = (int)x;
    if ((r = get_number(body, "seed", -9.2e18, 9.2e18, 1, &x, b)) < 0) return -1;
    if (r) p->s.seed = (uint64_t)(int64_t)x, p->seed_given = 1;
    if (get_bool(body, "stream", &p->stream, b) < 0) return -1;
    if (get_bool(body, "ignore_eos", &p->s.ignore_eos, b) < 0) return -1;
    if (p->s.repeat_penalty != 1 || p->s.presence_penalty != 0 || p->s.frequency_penalty != 0)
        p->s.repeat_last_n = INT32_MAX; /* OpenAI's penalties look at everything generated */
    const cJSON *so = cJSON_GetObjectItemCaseSensitive(body, "stream_options");
    if (so && !cJSON_IsNull(so)) {
        if (!cJSON_IsObject(so))
            return fail(b, 400, "stream_options", "'stream_options' must be an object");
        if (get_bool(so, "include_usage", &p->include_usage, b) < 0)
            return -1;
    }
    const cJSON *stop = cJSON_GetObjectItemCaseSensitive(body, "stop");
    if (cJSON_IsString(stop)) {
        p->stops[p->n_stops++] = stop->valuestring;
    } else if (cJSON_IsArray(stop)) {
        if (cJSON_GetArraySize(stop) > MAX_STOPS)
            return fail(b, 400, "stop", "'stop' takes at most %d strings", MAX_STOPS);
        for (const cJSON *s = stop->child; s; s = s->next) {
            if (!cJSON_IsString(s))
                return fail(b, 400, "stop", "'stop' must be a string or an array of strings");
            p->stops[p->n_stops++] = s->valuestring;
        }
    } else if (stop && !cJSON_IsNull(stop)) {
        return fail(b, 400, "stop", "'stop' must be a string or an array of strings, not %s",
                    json_type(stop));
    }
    for (int i = 0; i < p->n_stops; i++)
        if (!p->stops[i][0])
            return fail(b, 400, "stop", "stop strings must not be empty");
    if ((chat ? parse_messages(srv, body, p, b) : parse_prompt(srv, body, p, b)) != 0)
        return -1;
    if (p->n_ids <= 0)
        return fail(b, 400, "prompt", "the prompt gives no tokens");
    int32_t want = p->n_ids + (p->max_tokens_given ? p->max_tokens : 1);
    if (want > srv->n_ctx) {
        b->code = "context_length_exceeded";
        if (p->max_tokens_given)
            return fail(b, 400, chat ? "messages" : "prompt",
                        "This model's maximum context length is %d tokens. However, you requested "
                        "%d tokens (%d in the prompt, %d for the completion). Please reduce the "
                        "prompt or the completion length.",
                        srv->n_ctx, want, p->n_ids, p->max_tokens);
        return fail(b, 400, chat ? "messages" : "prompt",
                    "This model's maximum context length is %d tokens, and the prompt has %d "
                    "(at least one more is needed for the completion).", srv->n_ctx, p->n_ids);
    }
    if (!p->stream && p->include_usage)
        return fail(b, 400, "stream_options", "'stream_options' is only allowed with stream: true");
    if (!p->seed_given) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        p->s.seed = (uint64_t)ts.tv_nsec * 0x9e3779b97f4a7c15ull ^ (uint64_t)ts.tv_sec;
    }
    return 0;
}

/* ---- endpoints ---------------------------------------------------------------------------- */

static enum MHD_Result handle_generate(server *srv, struct MHD_Connection *con, const char *body,
                                       size_t len, int chat)
{
    cJSON *req = cJSON_ParseWithLength(body, len);
    if (!req) {
        const char *at = cJSON_GetErrorPtr();
        return send_error(srv, con, 400, NULL, NULL,
                          "the request body is not valid JSON (near byte %ld)",
                          at && at >= body && at <= body + len ? (long)(at - body) : 0L);
    }
    parsed p = {0};
    bad b = {0};
    if (parse_request(srv, req, chat, &p, &b) != 0) {
        free(p.ids);
        cJSON_Delete(req);
        return send_error(srv, con, b.status, b.param, b.code, "%s", b.msg);
    }
    if (srv->shutting_down) {
        free(p.ids);
        cJSON_Delete(req);
        return send_error(srv, con, 503, NULL, NULL, "the server is shutting down");
    }
    job *j = calloc(1, sizeof *j);
    if (!j) {
        free(p.ids);
        cJSON_Delete(req);
        return send_error(srv, con, 500, NULL, NULL, "out of memory");
    }
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    j->srv = srv, j->chat = chat, j->stream = p.stream, j->include_usage = p.include_usage;
    j->n = p.n, j->n_prompt = p.n_ids, j->created = time(NULL);
    j->refs = 1;
    static uint64_t counter;
    snprintf(j->id, sizeof j->id, "%s-%016llx", chat ? "chatcmpl" : "cmpl",
             (unsigned long long)(__atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED) ^
                                  ((uint64_t)j->created << 20)));
    char err[512] = "";
    int submitted = 0;
    for (int i = 0; i < p.n; i++) {
        event_target *t = malloc(sizeof *t);
        if (!t) {
            snprintf(err, sizeof err, "out of memory");
            break;
        }
        *t = (event_target){j, i};
        loom_request r = {p.ids, p.n_ids, p.max_tokens, p.s, p.stops, p.n_stops};
        r.sampling.seed = p.s.seed + (uint64_t)i; /* n choices: n different samples */
        pthread_mutex_lock(&j->mu);
        j->refs++;
        pthread_mutex_unlock(&j->mu);
        int64_t id = loom_engine_submit(srv->engine, &r, on_event, t, err, sizeof err);
        if (id < 0) {
            free(t);
            j->refs--;
            break;
        }
        j->ch[i].id = id;
        submitted++;
    }
    free(p.ids);
    cJSON_Delete(req);
    if (submitted < p.n) {
        /* the ones already queued finish as cancelled; the job goes with them */
        pthread_mutex_lock(&j->mu);
        for (int i = submitted; i < p.n; i++)
            j->ch[i].done = 1;
        pthread_mutex_unlock(&j->mu);
        cancel_job(j);
        job_unref(j);
        return send_error(srv, con, srv->shutting_down ? 503 : 400, NULL, NULL, "%s", err);
    }
    if (!p.stream)
        return finish_blocking(con, j);
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

static enum MHD_Result handle_metrics(server *srv, struct MHD_Connection *con)
{
    loom_engine_stats s = loom_engine_get_stats(srv->engine);
    pthread_mutex_lock(&srv->count_lock);
    uint64_t http = srv->http_requests, errors = srv->http_errors, gone = srv->disconnects;
    pthread_mutex_unlock(&srv->count_lock);
    char *out = NULL;
    size_t len = 0, cap = 0;
    char line[512];
#define METRIC(name, type, help, fmt, ...)                                                     \
    do {                                                                                       \
        int k = snprintf(line, sizeof line, "# HELP " name " " help "\n# TYPE " name " " type  \
                         "\n" name fmt "\n", __VA_ARGS__);                                     \
        append(&out, &len, &cap, line, (size_t)k);                                             \
    } while (0)
    METRIC("loom_requests_running", "gauge", "Requests being generated.", " %d", s.running);
    METRIC("loom_requests_waiting", "gauge", "Requests queued for admission.", " %d", s.waiting);
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
           " %.6f", s.prompt_tokens ? (double)s.cached_prompt_tokens / (double)s.prompt_tokens : 0.0);
    METRIC("loom_generation_tokens_per_second", "gauge", "Generated tokens per second, recently.",
           " %.3f", s.tokens_per_s);
    int k = snprintf(line, sizeof line,
                     "# HELP loom_kv_blocks KV cache blocks by state (block size %d tokens).\n"
                     "# TYPE loom_kv_blocks gauge\nloom_kv_blocks{state=\"used\"} %d\n"
                     "loom_kv_blocks{state=\"cached\"} %d\nloom_kv_blocks{state=\"free\"} %d\n",
                     s.block_size, s.kv_used, s.kv_cached, s.kv_free);
    append(&out, &len, &cap, line, (size_t)k);
    METRIC("loom_preemptions_total", "counter", "Running requests preempted for KV blocks.", " %llu",
           (unsigned long long)s.preemptions);
    METRIC("loom_engine_steps_total", "counter", "Forward passes run.", " %llu",
           (unsigned long long)s.steps);
    METRIC("loom_http_requests_total", "counter", "HTTP requests received.", " %llu",
           (unsigned long long)http);
    METRIC("loom_http_errors_total", "counter", "HTTP requests answered with an error.", " %llu",
           (unsigned long long)errors);
    METRIC("loom_client_disconnects_total", "counter", "Clients gone before their answer ended.",
           " %llu", (unsigned long long)gone);
#undef METRIC
    enum MHD_Result ok = send_text(con, 200, "text/plain; version=0.0.4", out ? out : "");
    free(out);
    return ok;
}

static enum MHD_Result handle_models(server *srv, struct MHD_Connection *con)
{
    cJSON *o = cJSON_CreateObject(), *d;
    cJSON_AddStringToObject(o, "object", "list");
    d = cJSON_AddArrayToObject(o, "data");
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "id", srv->model_name);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", (double)srv->started);
    cJSON_AddStringToObject(m, "owned_by", "loom");
    cJSON_AddNumberToObject(m, "max_model_len", srv->n_ctx);
    cJSON_AddItemToArray(d, m);
    return send_json(con, 200, o);
}

typedef struct conn_state {
    char *body;
    size_t len, cap;
    int too_big;
} conn_state;

static void request_completed(void *cls, struct MHD_Connection *con, void **con_cls,
                              enum MHD_RequestTerminationCode toe)
{
    (void)cls, (void)con, (void)toe;
    conn_state *cs = *con_cls;
    if (cs) {
        free(cs->body);
        free(cs);
    }
    *con_cls = NULL;
}

static int authorised(server *srv, struct MHD_Connection *con)
{
    if (!srv->api_key)
        return 1;
    const char *h = MHD_lookup_connection_value(con, MHD_HEADER_KIND, "Authorization");
    return h && !strncmp(h, "Bearer ", 7) && !strcmp(h + 7, srv->api_key);
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
        return MHD_YES;
    }
    if (*upload_size) {
        if (cs->len + *upload_size > srv->max_body)
            cs->too_big = 1; /* keep reading, to answer with an error rather than a reset */
        else if (append(&cs->body, &cs->len, &cs->cap, upload, *upload_size) != 0)
            cs->too_big = 1;
        *upload_size = 0;
        return MHD_YES;
    }
    int post = !strcmp(method, "POST"), get = !strcmp(method, "GET");
    if (!strcmp(url, "/health")) {
        if (!get)
            return send_error(srv, con, 405, NULL, NULL, "use GET for %s", url);
        return srv->shutting_down ? send_text(con, 503, "application/json", "{\"status\":\"shutting down\"}")
                                  : send_text(con, 200, "application/json", "{\"status\":\"ok\"}");
    }
    if (!strcmp(url, "/metrics")) {
        if (!get)
            return send_error(srv, con, 405, NULL, NULL, "use GET for %s", url);
        return handle_metrics(srv, con);
    }
    int is_models = !strcmp(url, "/v1/models"), is_compl = !strcmp(url, "/v1/completions"),
        is_chat = !strcmp(url, "/v1/chat/completions");
    if (!is_models && !is_compl && !is_chat)
        return send_error(srv, con, 404, NULL, NULL, "no such endpoint: %s %s (loom serves "
                          "/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)",
                          method, url);
    if (!authorised(srv, con))
        return send_error(srv, con, 401, NULL, "invalid_api_key",
                          "Incorrect or missing API key: send 'Authorization: Bearer KEY' with the "
                          "key the server was started with (--api-key)");
    if (is_models)
        return get ? handle_models(srv, con)
                   : send_error(srv, con, 405, NULL, NULL, "use GET for %s", url);
    if (!post)
        return send_error(srv, con, 405, NULL, NULL, "use POST for %s", url);
    if (cs->too_big)
        return send_error(srv, con, 413, NULL, NULL, "the request body is larger than the "
                          "server's limit of %zu bytes (--max-body)", srv->max_body);
    if (!cs->len)
        return send_error(srv, con, 400, NULL, NULL, "the request has no body; send a JSON object");
    return handle_generate(srv, con, cs->body, cs->len, is_chat);
}

/* ---- main --------------------------------------------------------------------------------- */

static void serve_usage(FILE *out)
{
    fprintf(out,
            "usage: loom serve -m MODEL [options]\n"
            "  --host ADDR             address to listen on (default 127.0.0.1)\n"
            "  --port N                port (default 8080; 0 picks a free one)\n"
            "  --api-key KEY           require 'Authorization: Bearer KEY' on /v1/*\n"
            "  --model-name NAME       the model id clients send (default: the file's name)\n"
            "  --max-batch N           sequences run together (default 16)\n"
            "  --max-tokens-per-step N tokens in one forward pass (default 256)\n"
            "  -c N                    context length per request (default: the model's, up to 4096)\n"
            "  --kv-blocks N           KV cache blocks shared by all requests (default: enough for\n"
            "                          max-batch sequences of 1024 tokens, at least one context)\n"
            "  --block-size N          tokens per KV block (default 16)\n"
            "  --kv-type f16|q8_0|f32  KV cache precision (default f16)\n"
            "  --chat-template NAME    override the model's chat template\n"
            "  --threads N             CPU backend threads\n"
            "  --max-body BYTES        largest request body accepted (default 1048576)\n"
            "  --shutdown-timeout S    on SIGTERM, let running requests finish this long (default 10)\n");
}

static int parse_int(const char *flag, const char *v, long lo, long hi, long *out)
{
    return loom_arg_long("loom serve", flag, v, lo, hi, out);
}

int loom_serve_main(int argc, char **argv)
{
    const char *model = NULL, *host = "127.0.0.1", *api_key = NULL, *name = NULL, *kv = NULL,
               *tmpl = NULL;
    long port = 8080, max_batch = 16, max_step = 256, n_ctx = 0, kv_blocks = 0, block = 16,
         threads = 0, max_body = 1 << 20, drain_s = 10;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            serve_usage(stdout);
            return 0;
        }
        if (!v) {
            fprintf(stderr, "loom serve: %s needs a value (or is unknown)\n", a);
            serve_usage(stderr);
            return 2;
        }
        if (!strcmp(a, "-m") || !strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--host")) host = v;
        else if (!strcmp(a, "--api-key")) api_key = v;
        else if (!strcmp(a, "--model-name")) name = v;
        else if (!strcmp(a, "--kv-type")) kv = v;
        else if (!strcmp(a, "--chat-template")) tmpl = v;
        else if (!strcmp(a, "--port")) bad = parse_int(a, v, 0, 65535, &port);
        else if (!strcmp(a, "--max-batch")) bad = parse_int(a, v, 1, 4096, &max_batch);
        else if (!strcmp(a, "--max-tokens-per-step")) bad = parse_int(a, v, 1, 1 << 20, &max_step);
        else if (!strcmp(a, "-c")) bad = parse_int(a, v, 2, 1 << 20, &n_ctx);
        else if (!strcmp(a, "--kv-blocks")) bad = parse_int(a, v, 1, 1 << 26, &kv_blocks);
        else if (!strcmp(a, "--block-size")) bad = parse_int(a, v, 1, 4096, &block);
        else if (!strcmp(a, "--threads")) bad = parse_int(a, v, 1, 1024, &threads);
        else if (!strcmp(a, "--max-body")) bad = parse_int(a, v, 1024, 1L << 30, &max_body);
        else if (!strcmp(a, "--shutdown-timeout")) bad = parse_int(a, v, 0, 3600, &drain_s);
        else {
            fprintf(stderr, "loom serve: unknown option '%s'\n", a);
            serve_usage(stderr);
            return 2;
        }
        if (bad)
            return 2;
        i++;
    }
    if (!model) {
        fprintf(stderr, "loom serve: give the model with -m MODEL (a GGUF file or a Hugging Face folder)\n");
        return 2;
    }
    if (tmpl && !loom_chat_template_valid(tmpl)) {
        fprintf(stderr, "loom serve: unknown chat template '%s' (known: %s)\n", tmpl, loom_chat_templates());
        return 2;
    }
    if (max_step < max_batch) {
        fprintf(stderr, "loom serve: --max-tokens-per-step (%ld) must be at least --max-batch (%ld)\n",
                max_step, max_batch);
        return 2;
    }
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, host, &addr.sin_addr) != 1) {
        fprintf(stderr, "loom serve: --host wants an IPv4 address like 127.0.0.1 or 0.0.0.0, not '%s'\n", host);
        return 2;
    }

    /* every thread started from here on leaves SIGTERM/SIGINT to sigwait below */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    char err[4096];
    /* the KV pool: --kv-blocks, or room for max-batch sequences of up to 1024 tokens */
    loom_model_options mo = {.n_ctx = (int32_t)n_ctx, .kv_type = kv, .n_threads = (int32_t)threads,
                             .block_size = (int32_t)block, .kv_blocks = (int32_t)kv_blocks,
                             .kv_sequences = (int32_t)max_batch};
    loom_model *m = loom_model_open(model, &mo, err, sizeof err);
    if (!m) {
        fprintf(stderr, "loom serve: %s\n", err);
        return 2;
    }
    int32_t ctx = loom_model_n_ctx(m);
    if (kv_blocks && kv_blocks * block < ctx) {
        fprintf(stderr, "loom serve: --kv-blocks %ld holds %ld tokens, less than one %d-token "
                "context; give at least %ld (or lower -c)\n", kv_blocks, kv_blocks * block, ctx,
                (ctx + block - 1) / block);
        loom_model_close(m);
        return 2;
    }
    server srv = {.model = m, .api_key = api_key, .max_body = (size_t)max_body, .n_ctx = ctx,
                  .started = time(NULL)};
    pthread_mutex_init(&srv.count_lock, NULL);
    srv.model_name = name ? name : loom_model_name(m);
    int recognised = 1;
    srv.chat_template = tmpl ? tmpl : loom_model_chat_template(m, &recognised);
    if (!recognised)
        fprintf(stderr, "loom serve: warning: the model's chat template is missing or not one loom "
                "knows; using '%s' (choose with --chat-template)\n", srv.chat_template);
    loom_engine_options eo = {(int32_t)max_batch, (int32_t)max_step};
    srv.engine = loom_engine_start(m, &eo, err, sizeof err);
    if (!srv.engine) {
        fprintf(stderr, "loom serve: %s\n", err);
        loom_model_close(m);
        return 2;
    }
    struct MHD_Daemon *d = MHD_start_daemon(
        MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ITC |
            MHD_USE_ERROR_LOG,
        0, NULL, NULL, on_request, &srv, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&addr,
        MHD_OPTION_NOTIFY_COMPLETED, request_completed, NULL, MHD_OPTION_CONNECTION_TIMEOUT,
        (unsigned)300, MHD_OPTION_END);
    if (!d) {
        fprintf(stderr, "loom serve: cannot listen on %s:%ld: %s (is the port in use? try --port)\n",
                host, port, strerror(errno));
        loom_engine_stop(srv.engine, 0);
        loom_engine_free(srv.engine);
        loom_model_close(m);
        return 1;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
    loom_engine_stats st = loom_engine_get_stats(srv.engine);
    fprintf(stderr, "loom serve: %s on %s; %d-token context, %d KV blocks of %d tokens, batch %ld\n",
            srv.model_name, loom_model_backend(m), ctx, st.kv_blocks, st.block_size, max_batch);
    fprintf(stderr, "loom serve: listening on http://%s:%u\n", host, di ? di->port : (unsigned)port);

    int sig = 0;
    sigwait(&sigs, &sig);
    fprintf(stderr, "loom serve: %s: no new requests; finishing running ones (up to %ld s)\n",
            sig == SIGTERM ? "SIGTERM" : "SIGINT", drain_s);
    srv.shutting_down = 1;
    MHD_socket listen_fd = MHD_quiesce_daemon(d);
    loom_engine_stop(srv.engine, (int)drain_s * 1000);
    /* every job is done now; give the connections a moment to send their last bytes (an idle
     * keep-alive connection just waits out the moment) before the daemon closes them */
    for (int waited = 0; waited < 3000; waited += 20) {
        const union MHD_DaemonInfo *ci = MHD_get_daemon_info(d, MHD_DAEMON_INFO_CURRENT_CONNECTIONS);
        if (!ci || ci->num_connections == 0)
            break;
        usleep(20 * 1000);
    }
    MHD_stop_daemon(d);
    loom_engine_free(srv.engine);
    if (listen_fd != MHD_INVALID_SOCKET)
        close(listen_fd);
    loom_model_close(m);
    pthread_mutex_destroy(&srv.count_lock);
    fprintf(stderr, "loom serve: stopped\n");
    return 0;
}
