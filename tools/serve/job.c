/*
 * tools/serve/job.c - one HTTP request's generations (a job): the engine's events gathered
 * under the job's lock, and the OpenAI responses made of them, whole or as server-sent events.
 */
#define _GNU_SOURCE
#include "tools/serve/server.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

void job_unref(job *j)
{
    pthread_mutex_lock(&j->mu);
    int left = --j->refs;
    pthread_mutex_unlock(&j->mu);
    if (left)
        return;
    if (j->sv)
        served_release(j->srv, j->sv);
    for (int i = 0; i < OPENAI_MAX_CHOICES; i++)
        free(j->ch[i].text), free(j->ch[i].lps);
    for (int i = 0; i < j->n_tools; i++)
        free(j->tool_names[i]);
    free(j->tool_names);
    for (int i = 0; i < OPENAI_MAX_STOPS; i++)
        free(j->stops[i]);
    cJSON_Delete(j->conversation);
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

void job_on_event(void *user, const loom_event *ev)
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
            j->n_cached = ev->n_cached, j->n_cached_restored = ev->n_cached_restored;
        /* the engine's "cancelled" (cut off by a shutdown past its timeout) is no value OpenAI
         * clients know; "length" is theirs for an answer cut short */
        const char *why = ev->finish_reason ? ev->finish_reason : "stop";
        snprintf(c->finish, sizeof c->finish, "%s", strcmp(why, "cancelled") ? why : "length");
        c->stop_string = ev->stop_string;
        c->reasoning_tokens = ev->reasoning_tokens;
        if (ev->kind == LOOM_EVENT_ERROR)
            snprintf(c->error, sizeof c->error, "%s", ev->error ? ev->error : "generation failed");
        /* a failure of the version it ran on, unless the server's load ended it */
        if (ev->kind == LOOM_EVENT_ERROR && j->version && !ev->busy && !ev->deadline)
            __atomic_add_fetch(&j->version->failures, 1, __ATOMIC_RELAXED);
    }
    pthread_cond_broadcast(&j->cv);
    int last = ev->kind != LOOM_EVENT_TEXT;
    pthread_mutex_unlock(&j->mu);
    if (last) {
        metrics_observe(j->srv, j->tenant, j->version, ev);
        if (ev->busy)
            metrics_count_refused(j->srv, j->tenant);
        free(t);
        job_unref(j); /* the engine's reference */
    }
}

int job_all_done(const job *j)
{
    for (int i = 0; i < j->n; i++)
        if (!j->ch[i].done)
            return 0;
    return 1;
}

void job_cancel(job *j)
{
    for (int i = 0; i < j->n; i++)
        if (j->ch[i].id > 0)
            loom_engine_cancel(j->sv->engine, j->ch[i].id);
}

static cJSON *usage_json(const job *j)
{
    int32_t gen = 0, thought = 0;
    for (int i = 0; i < j->n; i++)
        gen += j->ch[i].n_generated, thought += j->ch[i].reasoning_tokens;
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "prompt_tokens", j->n_prompt);
    cJSON_AddNumberToObject(u, "completion_tokens", gen);
    cJSON_AddNumberToObject(u, "total_tokens", j->n_prompt + gen);
    cJSON *d = cJSON_AddObjectToObject(u, "prompt_tokens_details");
    cJSON_AddNumberToObject(d, "cached_tokens", j->n_cached);
    if (j->srv->prompt_cache_dir) /* of them, from the cache kept across a restart */
        cJSON_AddNumberToObject(d, "cached_tokens_restored", j->n_cached_restored);
    if (j->reasoning)
        cJSON_AddNumberToObject(cJSON_AddObjectToObject(u, "completion_tokens_details"),
                                "reasoning_tokens", thought);
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

/* content_len is counted from base; n_calls 0: none, or the request has no tools */
void job_read_tool_calls(const job *j, const choice *c, size_t base, loom_tool_calls *tc)
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

void job_answer_parts(const job *j, const choice *c, loom_reasoning *r, loom_tool_calls *tc)
{
    memset(r, 0, sizeof *r);
    if (j->reasoning && c->text)
        loom_reasoning_find(c->text, c->len, j->reasoning == 2, 1, r);
    job_read_tool_calls(j, c, r->content, tc);
}

/* Mistral's templates want 9 letters and digits */
void job_call_id(const job *j, const loom_tool_call *call, const char *prefix, char *id, size_t cap)
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
    size_t at = mistral ? 0 : (size_t)snprintf(id, cap, "%s", prefix);
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
        job_call_id(j, call, "call_", id, sizeof id);
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

void job_sse(job *j, const char *event, cJSON *o)
{
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!s)
        return;
    if (event) {
        buf_append(&j->out, &j->out_len, &j->out_cap, "event: ", 7);
        buf_append(&j->out, &j->out_len, &j->out_cap, event, strlen(event));
        buf_append(&j->out, &j->out_len, &j->out_cap, "\n", 1);
    }
    buf_append(&j->out, &j->out_len, &j->out_cap, "data: ", 6);
    buf_append(&j->out, &j->out_len, &j->out_cap, s, strlen(s));
    buf_append(&j->out, &j->out_len, &j->out_cap, "\n\n", 2);
    free(s);
}

void job_take_ready(job *j, choice *c, ready_parts *rp)
{
    memset(rp, 0, sizeof *rp);
    if (c->final_sent)
        return;
    /* a thought first; the answer proper starts after it (base) */
    size_t base = 0;
    int thinking = 0;
    if (j->reasoning && c->text) {
        loom_reasoning r;
        loom_reasoning_find(c->text, c->len, j->reasoning == 2, c->done, &r);
        size_t from = c->thought_sent > r.start ? c->thought_sent : r.start;
        size_t upto = r.end <= from ? from
            : c->done               ? r.end
                                    : from + loom_utf8_complete(c->text + from, r.end - from);
        if (upto > from)
            rp->thought = c->text + from, rp->thought_len = upto - from, c->thought_sent = upto;
        thinking = r.open && !c->done;
        base = r.content;
        c->sent = c->sent < base ? base : c->sent;
    }
    /* a character whose last bytes are still to come waits for them (or for the end, when
     * what is left is sent with U+FFFD for it) */
    size_t ready = c->done ? c->len
                           : c->sent + loom_utf8_complete(c->text + c->sent, c->len - c->sent);
    if (j->tool_syntax != LOOM_TOOLS_NONE && !thinking) {
        /* text that may be the start of a call waits until it is known not to be */
        if (c->done) {
            job_read_tool_calls(j, c, base, &rp->calls);
            ready = base + rp->calls.content_len;
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
    if (c->sent < ready)
        rp->text = c->text + c->sent, rp->text_len = ready - c->sent, c->sent = ready;
    if (c->done)
        rp->final = 1, c->final_sent = 1;
}

/* Formats what the engine produced since the last call as OpenAI's server-sent events (under
 * j->mu). */
static void stream_format(job *j)
{
    const char *object = j->chat ? "chat.completion.chunk" : "text_completion";
    for (int i = 0; i < j->n; i++) {
        choice *c = &j->ch[i];
        if (j->chat && !(j->role_sent & (1 << i))) {
            cJSON *o = response_head(j, object), *a = cJSON_AddArrayToObject(o, "choices");
            cJSON_AddItemToArray(a, choice_json(j, i, "", 0, NULL, 1, 1));
            job_sse(j, NULL, o);
            j->role_sent |= 1 << i;
        }
        ready_parts rp;
        job_take_ready(j, c, &rp);
        if (rp.thought_len) { /* as reasoning_content */
            cJSON *o = response_head(j, object), *a = cJSON_AddArrayToObject(o, "choices");
            cJSON *ch = choice_json(j, i, NULL, 0, NULL, 1, 0);
            json_add_text(cJSON_GetObjectItem(ch, "delta"), "reasoning_content", rp.thought,
                          rp.thought_len);
            cJSON_AddItemToArray(a, ch);
            job_sse(j, NULL, o);
        }
        if (rp.text_len) {
            cJSON *o = response_head(j, object), *a = cJSON_AddArrayToObject(o, "choices");
            cJSON *ch = choice_json(j, i, rp.text, rp.text_len, NULL, 1, 0);
            attach_logprobs(j, c, ch);
            cJSON_AddItemToArray(a, ch);
            job_sse(j, NULL, o);
        }
        if (rp.final) {
            cJSON *o;
            if (c->error[0]) {
                o = cJSON_CreateObject();
                cJSON *e = cJSON_AddObjectToObject(o, "error");
                json_add_text(e, "message", c->error, strlen(c->error));
                cJSON_AddStringToObject(e, "type", "server_error");
            } else {
                for (int k = 0; k < rp.calls.n_calls; k++)
                    for (int part = 0; part < 2; part++) {
                        cJSON *e = response_head(j, object),
                              *a = cJSON_AddArrayToObject(e, "choices");
                        cJSON *ch = choice_json(j, i, NULL, 0, NULL, 1, 0);
                        cJSON *calls = cJSON_AddArrayToObject(cJSON_GetObjectItem(ch, "delta"),
                                                              "tool_calls");
                        cJSON_AddItemToArray(calls, tool_call_json(j, &rp.calls.calls[k], k, part));
                        cJSON_AddItemToArray(a, ch);
                        job_sse(j, NULL, e);
                    }
                o = response_head(j, object);
                cJSON *a = cJSON_AddArrayToObject(o, "choices");
                cJSON *ch = choice_json(j, i, NULL, 0, finish_with_calls(c, &rp.calls), 1, 0);
                attach_logprobs(j, c, ch);
                cJSON_AddItemToArray(a, ch);
                if (c->deadline)
                    cJSON_AddBoolToObject(o, "stopped_at_deadline", 1);
            }
            job_sse(j, NULL, o);
        }
        loom_tool_calls_free(&rp.calls);
    }
    if (job_all_done(j) && !j->finished) {
        if (j->include_usage) {
            cJSON *o = response_head(j, object);
            cJSON_AddArrayToObject(o, "choices");
            cJSON_AddItemToObject(o, "usage", usage_json(j));
            job_sse(j, NULL, o);
        }
        buf_append(&j->out, &j->out_len, &j->out_cap, "data: [DONE]\n\n", 14);
        j->finished = 1;
    }
}

/* Waits (mu held) for the engine's next event, or 200 ms: long enough to cost nothing, short
 * enough to notice a client that left. */
void serve_wait_briefly(pthread_cond_t *cv, pthread_mutex_t *mu)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_nsec += 200 * 1000000L;
    if (until.tv_nsec >= 1000000000L)
        until.tv_sec++, until.tv_nsec -= 1000000000L;
    pthread_cond_timedwait(cv, mu, &until);
}

void job_wait_briefly(job *j)
{
    serve_wait_briefly(&j->cv, &j->mu);
}

/* libmicrohttpd pulls the stream from here; with a thread per connection it may block. While
 * nothing is ready (a long prefill) it looks every 200 ms whether the client is still there, so
 * a disconnect cancels the generation without waiting for the next write to fail. */
ssize_t job_stream_read(void *cls, uint64_t pos, char *buf, size_t max)
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
        (j->api == API_MESSAGES        ? messages_stream_format
             : j->api == API_RESPONSES ? responses_stream_format
                                       : stream_format)(j);
        if (j->out_len == 0) {
            job_wait_briefly(j);
            if (j->out_len == 0 && !job_all_done(j) && j->con && http_client_gone(j->con)) {
                pthread_mutex_unlock(&j->mu);
                return MHD_CONTENT_READER_END_WITH_ERROR; /* stream_free cancels the job */
            }
        }
    }
}

/* The response is gone: finished, or the client disconnected (then cancel the generation). */
void job_stream_free(void *cls)
{
    job *j = cls;
    pthread_mutex_lock(&j->mu);
    int unfinished = !job_all_done(j);
    pthread_mutex_unlock(&j->mu);
    if (unfinished) {
        pthread_mutex_lock(&j->srv->count_lock);
        j->srv->disconnects++;
        pthread_mutex_unlock(&j->srv->count_lock);
        job_cancel(j);
    }
    job_unref(j);
}

/* A request the engine ended before it answered: its deadline (504), a full queue that took
 * one of better priority in its place (429), a grammar it could not follow (400), or a
 * failure (500). */
enum MHD_Result job_send_ended_early(server *srv, struct MHD_Connection *con, int deadline,
                                     int busy, const char *invalid, const char *msg)
{
    if (deadline)
        return http_error(srv, con, 504, "timeout", "deadline_exceeded", "%s", msg);
    if (busy)
        return http_error(srv, con, 429, NULL, "rate_limit_exceeded", "%s", msg);
    if (invalid)
        return http_error(srv, con, 400, invalid, "grammar_too_complex",
                          "the answer's grammar (%s) cannot be followed: %s", invalid, msg);
    return http_error(srv, con, 500, NULL, NULL, "%s", msg);
}

enum MHD_Result job_finish_blocking(struct MHD_Connection *con, job *j)
{
    pthread_mutex_lock(&j->mu);
    while (!job_all_done(j)) {
        job_wait_briefly(j);
        if (!job_all_done(j) && http_client_gone(con)) {
            pthread_mutex_unlock(&j->mu);
            pthread_mutex_lock(&j->srv->count_lock);
            j->srv->disconnects++;
            pthread_mutex_unlock(&j->srv->count_lock);
            job_cancel(j);
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
            job_cancel(j); /* the other choices end with it */
            job_unref(j);
            return job_send_ended_early(srv, con, deadline, busy, bad, msg);
        }
    if (j->api == API_MESSAGES || j->api == API_RESPONSES) {
        cJSON *m = j->api == API_MESSAGES ? messages_response(j) : responses_response(j);
        if (j->api == API_RESPONSES)
            responses_keep(j, m);
        pthread_mutex_unlock(&j->mu);
        job_unref(j);
        return http_send_json(con, 200, m);
    }
    cJSON *o = response_head(j, j->chat ? "chat.completion" : "text_completion");
    for (int i = 0; i < j->n; i++)
        if (j->ch[i].deadline) /* cut at its deadline: finish_reason "length", and this says why */
            cJSON_AddBoolToObject(o, "stopped_at_deadline", 1);
    cJSON *a = cJSON_AddArrayToObject(o, "choices");
    for (int i = 0; i < j->n; i++) {
        const choice *c = &j->ch[i];
        loom_reasoning r;
        loom_tool_calls tc;
        job_answer_parts(j, c, &r, &tc);
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
    return http_send_json(con, 200, o);
}
