/*
 * tools/serve/embeddings.c - /v1/embeddings: every input runs as its own engine request, and
 * the answer comes when all are done.
 */
#define _GNU_SOURCE
#include "tools/serve/server.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    metrics_observe(j->srv, j->tenant, NULL, ev);
    if (ev->busy)
        metrics_count_refused(j->srv, j->tenant);
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
enum MHD_Result embeddings_handle(server *srv, struct MHD_Connection *con, const char *body,
                                  size_t len, int who)
{
    tenant *tn = who > 0 ? &srv->tenants[who - 1] : NULL;
    embed_parsed p = {0};
    bad b = {0};
    served *sv;
    cJSON *req = served_parse_and_acquire(srv, body, len,
                                          (size_t)OPENAI_MAX_INPUTS * 4 + 64 +
                                              (size_t)OPENAI_MAX_INPUTS * (size_t)srv->api.n_ctx,
                                          &sv, &b);
    if (!req)
        return http_error(srv, con, b.status, b.param, b.code, "%s", b.msg);
    while (sem_wait(&srv->parsing) != 0 && errno == EINTR) {
    }
    int parsed_ok = openai_parse_embeddings(&sv->api, req, &p, &b) == 0;
    sem_post(&srv->parsing);
    cJSON_Delete(req);
    if (!parsed_ok) {
        openai_embed_parsed_free(&p);
        served_release(srv, sv);
        return http_error(srv, con, b.status, b.param, b.code, "%s", b.msg);
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
            tenants_admit(&r, srv, who, p.user, p.priority, p.priority_given, p.timeout_s);
            pthread_mutex_unlock(&j.mu); /* the engine may answer at once */
            int64_t id = loom_engine_submit(sv->engine, &r, on_embedding, t, err, sizeof err);
            pthread_mutex_lock(&j.mu);
            if (id == LOOM_ENGINE_BUSY && j.submitted > j.ended) {
                free(t); /* a full queue with some of ours in it: wait for one of them */
                err[0] = '\0';
                serve_wait_briefly(&j.cv, &j.mu);
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
        serve_wait_briefly(&j.cv, &j.mu);
        gone = j.ended < p.n_inputs && http_client_gone(con);
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
        metrics_count_refused(srv, who);
        res = http_error(srv, con, 429, NULL, "rate_limit_exceeded", "%s", err);
    } else if (err[0]) {
        res = http_error(srv, con, srv->shutting_down ? 503 : 500, NULL, NULL, "%s", err);
    } else if (j.error[0]) {
        res = job_send_ended_early(srv, con, j.deadline, j.busy, NULL, j.error);
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
            res = http_send_json(con, 200, o);
        else {
            cJSON_Delete(o);
            res = http_error(srv, con, 500, NULL, NULL, "out of memory");
        }
    }
    free(j.out), free(j.ids);
    pthread_mutex_destroy(&j.mu);
    pthread_cond_destroy(&j.cv);
    openai_embed_parsed_free(&p);
    served_release(srv, sv);
    return res;
}
