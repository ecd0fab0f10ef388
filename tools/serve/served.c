/*
 * tools/serve/served.c - the model a server runs on, and reloading it: new requests go to the
 * live one; a retired one is freed once no request holds it.
 */
#define _GNU_SOURCE
#include "tools/serve/server.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The model new requests run on, held until release. */
served *served_acquire(server *srv)
{
    pthread_mutex_lock(&srv->live_lock);
    served *sv = srv->live;
    sv->refs++;
    pthread_mutex_unlock(&srv->live_lock);
    return sv;
}

/* A retired model whose last request ends is freed by the main thread (reap), never here: this
 * may run on that model's own engine thread. */
void served_release(server *srv, served *sv)
{
    pthread_mutex_lock(&srv->live_lock);
    sv->refs--;
    pthread_mutex_unlock(&srv->live_lock);
}

/* ---- reload --------------------------------------------------------------------------------- */

/* The engine for m and its drafter (opened here from srv's drafter settings, if any: each
 * engine needs its own), or NULL with err. */
loom_engine *served_start_engine(const server *srv, loom_model *m, loom_model **drafter, char *err,
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
        !(sv->engine = served_start_engine(srv, m, &sv->drafter, err, err_size))) {
        loom_chat_format_free(&sv->chat);
        free(sv);
        loom_model_close(m);
        return NULL;
    }
    sv->api.chat = &sv->chat;
    sv->refs = 1; /* the server's */
    return sv;
}

void served_free(served *sv)
{
    loom_engine_stop(sv->engine, 0);
    loom_engine_free(sv->engine);
    loom_model_close(sv->drafter);
    loom_model_close(sv->api.model);
    loom_chat_format_free(&sv->chat);
    free(sv);
}

void served_reap(server *srv);

/* SIGHUP or POST /admin/reload: new requests go to the file as it is now once it has loaded
 * and generated; the old model finishes what it runs. On failure the old one keeps serving, and
 * the error stays in /health until a reload succeeds. While the model before the last reload
 * still finishes requests, another reload is refused: retired models (each with its KV pool)
 * never pile up behind a client that holds a stream open. Returns 0, -1 with err when the new
 * model failed, 1 with err when it was not tried for that reason. */
int served_reload(server *srv, char *err, size_t err_size)
{
    if (!srv->can_reload) {
        snprintf(err, err_size, "a pipeline over an MPI job cannot reload its model");
        return -1;
    }
    pthread_mutex_lock(&srv->reload_lock);
    served_reap(srv);
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
void served_reap(server *srv)
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
