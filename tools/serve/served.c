/*
 * tools/serve/served.c - the models a server runs on: the first, and reloading it (new requests
 * go to the live one; a retired one is freed once no request holds it), and the others by name
 * (--add-model, --models-dir), each loaded on its first request and unloaded, least recently
 * used, past --models-max.
 */
#define _GNU_SOURCE
#include "tools/serve/server.h"

#include "tools/openai_fields.h"

#include <assert.h>
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

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

/* The engine for m and, for the first model (first), its drafter (opened here from srv's
 * drafter settings, if any: each engine needs its own; the other models have none), its prefix
 * cache kept in --prompt-cache-dir as name (NULL: none), or NULL with err. */
loom_engine *served_start_engine(const server *srv, loom_model *m, int first, const char *name,
                                 loom_model **drafter, char *err, size_t err_size)
{
    loom_engine_options eo = srv->eo;
    *drafter = NULL;
    char cache_file[4096];
    if (srv->prompt_cache_dir && name) { /* DIR/NAME.loomkv, NAME's odd bytes as '_' */
        size_t at = (size_t)snprintf(cache_file, sizeof cache_file, "%s/", srv->prompt_cache_dir);
        for (const char *c = name; *c && at + 8 < sizeof cache_file; c++)
            cache_file[at++] = (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') ||
                    (*c >= '0' && *c <= '9') || *c == '-' || *c == '.'
                ? *c
                : '_';
        snprintf(cache_file + at, sizeof cache_file - at, ".loomkv");
        eo.prefix_file = cache_file;
    }
    if (srv->draft_path && first) {
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

/* The model file at path opened with the first one's options, checked with a two-token
 * generation, and its engine started: a model ready to take requests as name (NULL: the
 * first's name, or the file's), or NULL with err. */
static served *served_open(server *srv, const char *path, const char *name, int keeps_cache,
                           const loom_model_options *mo, char *err, size_t err_size)
{
    loom_model *m = loom_model_open(path, mo ? mo : &srv->mo, err, err_size);
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
    sv->api.model_name = name ? name : srv->name_flag ? srv->name_flag : loom_model_name(m);
    if (loom_chat_format_choose(m, srv->tmpl_flag, srv->tmpl_file_flag, &sv->chat, err, err_size) !=
            0 ||
        !(sv->engine = served_start_engine(srv, m, path == srv->model_path,
                                           keeps_cache ? sv->api.model_name : NULL, &sv->drafter,
                                           err, err_size))) {
        loom_chat_format_free(&sv->chat);
        free(sv);
        loom_model_close(m);
        return NULL;
    }
    sv->api.chat = &sv->chat;
    sv->refs = 1; /* the server's */
    loom_engine_stats st = loom_engine_get_stats(sv->engine);
    sv->bytes = loom_model_weight_bytes(m) +
        (uint64_t)st.kv_blocks * (uint64_t)st.block_size * loom_model_kv_bytes_per_token(m);
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
    served *sv = served_open(srv, srv->model_path, NULL, 1, NULL, err, err_size);
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

/* ---- several models by name ------------------------------------------------------------------ */

int served_add(server *srv, const char *name, const char *path, char *err, size_t err_size)
{
    if (!name[0] || strlen(name) > 128) {
        snprintf(err, err_size, "a model's name must be 1 to 128 bytes: '%.140s'", name);
        return -1;
    }
    for (int i = 0; i < srv->n_slots; i++)
        if (!strcmp(srv->slots[i].name, name)) {
            snprintf(err, err_size, "two models are named '%s' (%s and %s)", name,
                     srv->slots[i].path, path);
            return -1;
        }
    if (srv->n_slots == SERVE_MAX_MODELS) {
        snprintf(err, err_size, "at most %d models beside the first", SERVE_MAX_MODELS);
        return -1;
    }
    model_slot *grown = realloc(srv->slots, (size_t)(srv->n_slots + 1) * sizeof *grown);
    if (!grown) {
        snprintf(err, err_size, "out of memory");
        return -1;
    }
    srv->slots = grown;
    model_slot *s = &srv->slots[srv->n_slots];
    *s = (model_slot){.name = strdup(name), .path = strdup(path)};
    if (!s->name || !s->path) {
        free(s->name), free(s->path);
        snprintf(err, err_size, "out of memory");
        return -1;
    }
    srv->n_slots++;
    return 0;
}

static int by_name(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* dir/models.json's models (see served_add_dir): 0, or -1 with err */
static int add_listed(server *srv, const char *dir, const char *json, char *err, size_t err_size)
{
    static const char *const fields[] = {"path",    "context", "kv_blocks",
                                         "backend", "kv_type", NULL};
    cJSON *root = cJSON_Parse(json);
    bad b = {0};
    int rc = 0;
    if (!cJSON_IsObject(root)) {
        snprintf(err, err_size, "%s/models.json is not a JSON object of models by name", dir);
        rc = -1;
    }
    for (const cJSON *m = root ? root->child : NULL; m && !rc; m = m->next) {
        char where[200], path[4096];
        snprintf(where, sizeof where, "%s/models.json: %.100s", dir, m->string);
        const char *file = cJSON_IsObject(m) ? field_string(m, "path", 1, where, &b) : NULL;
        double ctx = 0, blocks = 0;
        if (!cJSON_IsObject(m) || !file || fields_only(m, fields, where, &b) ||
            field_number(m, "context", 2, 1 << 20, 1, &ctx, &b) < 0 ||
            field_number(m, "kv_blocks", 1, 1 << 24, 1, &blocks, &b) < 0) {
            snprintf(err, err_size, "%s", b.msg[0] ? b.msg : "each model is an object with a path");
            if (!b.msg[0])
                snprintf(err, err_size, "%s: must be an object with a \"path\"", where);
            rc = -1;
            break;
        }
        const char *backend = cJSON_IsString(cJSON_GetObjectItem(m, "backend"))
            ? cJSON_GetObjectItem(m, "backend")->valuestring
            : NULL;
        const char *kv_type = cJSON_IsString(cJSON_GetObjectItem(m, "kv_type"))
            ? cJSON_GetObjectItem(m, "kv_type")->valuestring
            : NULL;
        if (kv_type && strcmp(kv_type, "f16") && strcmp(kv_type, "f32") &&
            strcmp(kv_type, "q8_0")) {
            snprintf(err, err_size, "%s: kv_type is one of f16, f32, q8_0, not '%.40s'", where,
                     kv_type);
            rc = -1;
            break;
        }
        snprintf(path, sizeof path, "%s%s%s", file[0] == '/' ? "" : dir, file[0] == '/' ? "" : "/",
                 file);
        if (served_add(srv, m->string, path, err, err_size)) {
            rc = -1;
            break;
        }
        model_slot *s = &srv->slots[srv->n_slots - 1];
        if (ctx || blocks || backend || kv_type) {
            s->options = malloc(sizeof *s->options);
            s->owned[0] = backend ? strdup(backend) : NULL;
            s->owned[1] = kv_type ? strdup(kv_type) : NULL;
            if (!s->options) {
                snprintf(err, err_size, "out of memory");
                rc = -1;
                break;
            }
            *s->options = srv->mo;
            if (ctx)
                s->options->n_ctx = (int32_t)ctx;
            if (blocks)
                s->options->kv_blocks = (int32_t)blocks;
            if (backend)
                s->options->backend = s->owned[0];
            if (kv_type)
                s->options->kv_type = s->owned[1];
        }
    }
    if (!rc && root && !root->child) {
        snprintf(err, err_size, "%s/models.json lists no model", dir);
        rc = -1;
    }
    cJSON_Delete(root);
    return rc;
}

int served_add_dir(server *srv, const char *dir, char *err, size_t err_size)
{
    char listing[4200];
    snprintf(listing, sizeof listing, "%s/models.json", dir);
    size_t len = 0;
    FILE *lf = fopen(listing, "rb");
    if (lf) { /* the list says which models, named so, with their options */
        char *json = malloc(1 << 20);
        len = json ? fread(json, 1, (1 << 20) - 1, lf) : 0;
        fclose(lf);
        if (!json) {
            snprintf(err, err_size, "out of memory");
            return -1;
        }
        json[len] = 0;
        int rc = add_listed(srv, dir, json, err, err_size);
        free(json);
        return rc;
    }
    DIR *d = opendir(dir);
    if (!d) {
        snprintf(err, err_size, "--models-dir %s: %s", dir, strerror(errno));
        return -1;
    }
    char *names[SERVE_MAX_MODELS + 1];
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) && n <= SERVE_MAX_MODELS;) {
        char path[4096], probe[4200];
        size_t len = strlen(e->d_name);
        if (e->d_name[0] == '.')
            continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        snprintf(probe, sizeof probe, "%s/config.json", path);
        struct stat st;
        int gguf = len > 5 && !strcmp(e->d_name + len - 5, ".gguf") && !stat(path, &st) &&
            S_ISREG(st.st_mode);
        int folder = !gguf && !stat(probe, &st) && S_ISREG(st.st_mode);
        if ((gguf || folder) && !(names[n++] = strdup(e->d_name)))
            n--;
    }
    closedir(d);
    qsort(names, (size_t)n, sizeof *names, by_name); /* the same order on every machine */
    int rc = 0;
    if (n > SERVE_MAX_MODELS) {
        snprintf(err, err_size, "--models-dir %s holds more than %d models", dir, SERVE_MAX_MODELS);
        rc = -1;
    }
    for (int i = 0; i < n; i++) {
        char path[4096], name[256];
        size_t len = strlen(names[i]);
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        int gguf = len > 5 && !strcmp(names[i] + len - 5, ".gguf");
        snprintf(name, sizeof name, "%.*s", (int)(gguf ? len - 5 : len), names[i]);
        if (!rc && served_add(srv, name, path, err, err_size))
            rc = -1;
        free(names[i]);
    }
    if (!rc && n == 0) {
        snprintf(err, err_size,
                 "--models-dir %s holds no model (*.gguf files, or folders with a "
                 "config.json)",
                 dir);
        rc = -1;
    }
    return rc;
}

/* Unloads the least recently used loaded model no request holds (live_lock held): 1 if one
 * was, 0 if every loaded one is busy. */
static int unload_one(server *srv)
{
    model_slot *lru = NULL;
    for (int i = 0; i < srv->n_slots; i++) {
        model_slot *s = &srv->slots[i];
        if (s->live && s->live->refs == 1 && (!lru || s->used < lru->used))
            lru = s;
    }
    if (!lru)
        return 0;
    served *old = lru->live;
    lru->live = NULL;
    old->refs--; /* the server's: the main thread frees it (served_reap) */
    old->next = srv->retired;
    srv->retired = old;
    fprintf(stderr, "loom serve: unloaded %s (least recently used, to stay within --models-max)\n",
            lru->name);
    return 1;
}

/* The other models' bytes loaded now (live_lock held). */
static uint64_t loaded_bytes(const server *srv)
{
    uint64_t n = 0;
    for (int i = 0; i < srv->n_slots; i++)
        n += srv->slots[i].live ? srv->slots[i].live->bytes : 0;
    return n;
}

/* Slot s loaded, if it is not (live_lock held; released while it loads): room is made first
 * by unloading the least recently used idle ones past --models-max or --models-max-bytes (its
 * bytes guessed from its file's size until it has loaded). 0, or 503 with err. */
static unsigned slot_load(server *srv, model_slot *s, char *err, size_t err_size)
{
    while (s->loading)
        pthread_cond_wait(&srv->slots_cv, &srv->live_lock);
    if (s->live)
        return 0;
    struct stat st;
    uint64_t guess = stat(s->path, &st) == 0 ? (uint64_t)st.st_size : 0;
    for (;;) {
        int loaded = 0;
        for (int i = 0; i < srv->n_slots; i++)
            loaded += srv->slots[i].live != NULL;
        int over = loaded >= srv->models_max ||
            (srv->models_max_bytes && loaded && loaded_bytes(srv) + guess > srv->models_max_bytes);
        if (!over)
            break;
        if (!unload_one(srv)) {
            snprintf(err, err_size,
                     "'%s' is not loaded, and the models loaded (--models-max %d, "
                     "--models-max-bytes %llu) are all answering requests; try again shortly",
                     s->name, srv->models_max, (unsigned long long)srv->models_max_bytes);
            return 503;
        }
    }
    s->loading = 1;
    pthread_mutex_unlock(&srv->live_lock);
    fprintf(stderr, "loom serve: loading %s (%s)\n", s->name, s->path);
    char why[1024];
    served *sv = served_open(srv, s->path, s->name, 1, s->options, why, sizeof why);
    pthread_mutex_lock(&srv->live_lock);
    s->loading = 0, s->live = sv;
    pthread_cond_broadcast(&srv->slots_cv);
    if (!sv) {
        snprintf(err, err_size, "loading the model '%s' (%s) failed: %s", s->name, s->path, why);
        fprintf(stderr, "loom serve: %s\n", err);
        return 503;
    }
    return 0;
}

static model_slot *slot_named(server *srv, const char *name)
{
    for (int i = 0; i < srv->n_slots; i++)
        if (!strcmp(srv->slots[i].name, name))
            return &srv->slots[i];
    return NULL;
}

unsigned served_load(server *srv, const char *name, int unload, char *err, size_t err_size)
{
    pthread_mutex_lock(&srv->live_lock);
    model_slot *s = slot_named(srv, name);
    unsigned st = 0;
    if (!s)
        st = 404,
        snprintf(err, err_size,
                 !strcmp(name, srv->live->api.model_name)
                     ? "'%s' is the first model, which is always loaded"
                     : "no model '%s' besides the first",
                 name);
    else if (!unload)
        st = slot_load(srv, s, err, err_size);
    else if (s->live && s->live->refs > 1)
        st = 409,
        snprintf(err, err_size, "'%s' is answering requests; unload it when it is done", name);
    else if (s->live) {
        served *old = s->live;
        s->live = NULL;
        old->refs--; /* the server's: the main thread frees it */
        old->next = srv->retired;
        srv->retired = old;
    }
    if (!st && !unload)
        s->used = ++srv->use_clock;
    pthread_mutex_unlock(&srv->live_lock);
    if (!st)
        fprintf(stderr, "loom serve: %s %s (POST /admin/models/%s)\n",
                unload ? "unloaded" : "loaded", name, unload ? "unload" : "load");
    return st;
}

/* The counts of model's stable or canary version, added on first use (live_lock held). */
static version_stats *version_of(server *srv, const char *model, int is_canary)
{
    for (int i = 0; i < srv->n_versions; i++)
        if (srv->versions[i].canary == is_canary && !strcmp(srv->versions[i].model, model))
            return &srv->versions[i];
    assert(srv->n_versions < (int)(sizeof srv->versions / sizeof *srv->versions));
    version_stats *v = &srv->versions[srv->n_versions++];
    snprintf(v->model, sizeof v->model, "%s", model);
    v->canary = is_canary;
    return v;
}

static canary *canary_of(server *srv, const char *model)
{
    for (int i = 0; i < srv->n_canaries; i++)
        if (!strcmp(srv->canaries[i].model, model))
            return &srv->canaries[i];
    return NULL;
}

/* Ends canary c (live_lock held): its model retired (the main thread frees it), its slot
 * emptied; its counts start again for the next one. */
static void canary_end(server *srv, canary *c)
{
    version_stats *v = version_of(srv, c->model, 1);
    __atomic_store_n(&v->routed, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&v->failures, 0, __ATOMIC_RELAXED);
    if (c->sv) {
        c->sv->refs--; /* the server's */
        c->sv->next = srv->retired;
        srv->retired = c->sv;
    }
    free(c->model), free(c->path);
    *c = srv->canaries[--srv->n_canaries];
}

unsigned served_acquire_named(server *srv, const char *name, uint64_t route_key, served **out,
                              char *err, size_t err_size)
{
    pthread_mutex_lock(&srv->live_lock);
    served *stable;
    const char *model;
    if (!name || !strcmp(name, srv->live->api.model_name)) {
        stable = srv->live;
        model = stable->api.model_name;
    } else {
        model_slot *s = NULL;
        for (int i = 0; i < srv->n_slots && !s; i++)
            if (!strcmp(srv->slots[i].name, name))
                s = &srv->slots[i];
        if (!s) {
            size_t at = (size_t)snprintf(err, err_size,
                                         "The model '%.200s' does not exist; this server has '%s'",
                                         name, srv->live->api.model_name);
            for (int i = 0; i < srv->n_slots && at < err_size; i++)
                at += (size_t)snprintf(err + at, err_size - at, ", '%s'", srv->slots[i].name);
            pthread_mutex_unlock(&srv->live_lock);
            return 404;
        }
        unsigned st = slot_load(srv, s, err, err_size);
        if (st) {
            pthread_mutex_unlock(&srv->live_lock);
            return st;
        }
        s->used = ++srv->use_clock;
        stable = s->live;
        model = s->name;
    }
    /* a canary takes its share, unless it has failed too often */
    served *sv = stable;
    canary *c = canary_of(srv, model);
    int to_canary = c && (double)(route_key >> 11) * 0x1p-53 < c->share;
    version_stats *v = version_of(srv, model, to_canary);
    uint64_t routed = __atomic_load_n(&v->routed, __ATOMIC_RELAXED);
    uint64_t failures = __atomic_load_n(&v->failures, __ATOMIC_RELAXED);
    if (to_canary && routed >= 20 && (double)failures > srv->canary_max_failures * (double)routed) {
        fprintf(stderr,
                "loom serve: the canary of %s (%s) failed %llu of %llu requests, past "
                "--canary-max-failures %g: rolled back\n",
                model, c->path, (unsigned long long)failures, (unsigned long long)routed,
                srv->canary_max_failures);
        canary_end(srv, c);
        to_canary = 0;
        v = version_of(srv, model, 0);
    } else if (to_canary) {
        sv = c->sv;
    }
    sv->refs++;
    __atomic_add_fetch(&v->routed, 1, __ATOMIC_RELAXED);
    http_version = v;
    *out = sv;
    pthread_mutex_unlock(&srv->live_lock);
    return 0;
}

/* the model name a request's name stands for (live_lock held): the first's, a slot's, or NULL */
static const char *model_named(server *srv, const char *name)
{
    if (!strcmp(name, srv->live->api.model_name))
        return srv->live->api.model_name;
    for (int i = 0; i < srv->n_slots; i++)
        if (!strcmp(srv->slots[i].name, name))
            return srv->slots[i].name;
    return NULL;
}

unsigned served_canary(server *srv, const char *model, const char *path, double share, char *err,
                       size_t err_size)
{
    pthread_mutex_lock(&srv->live_lock);
    const char *name = model_named(srv, model);
    canary *c = name ? canary_of(srv, name) : NULL;
    unsigned st = !name                               ? 404
        : c && path                                   ? 409
        : !c && !path                                 ? 400
        : !c && srv->n_canaries == SERVE_MAX_CANARIES ? 409
                                                      : 0;
    if (st)
        snprintf(err, err_size, "%s",
                 st == 404       ? "no model of that name"
                     : st == 400 ? "no canary of that model to change: give 'path' to start one"
                     : c         ? "that model has a canary already: promote or roll it back first"
                                 : "too many canaries at once");
    if (!st && c) /* its share changes */
        c->share = share;
    char *owned_name = !st && !c ? strdup(name) : NULL;
    pthread_mutex_unlock(&srv->live_lock);
    if (st || c)
        return st;
    char why[1024];
    /* (a canary keeps no prefix cache of its own: the file is its model name's) */
    served *sv = owned_name ? served_open(srv, path, owned_name, 0, NULL, why, sizeof why) : NULL;
    if (!sv) {
        snprintf(err, err_size, "loading the canary %s failed: %s", path,
                 owned_name ? why : "out of memory");
        free(owned_name);
        return 422;
    }
    pthread_mutex_lock(&srv->live_lock);
    canary *n = &srv->canaries[srv->n_canaries++];
    *n = (canary){.model = owned_name, .path = strdup(path), .sv = sv, .share = share};
    sv->api.model_name = n->model; /* the served name outlives the request that named it */
    version_stats *v = version_of(srv, owned_name, 1);
    __atomic_store_n(&v->routed, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&v->failures, 0, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&srv->live_lock);
    fprintf(stderr, "loom serve: %s has a canary, %s, taking %.0f%% of its requests\n", model, path,
            100 * share);
    return 0;
}

unsigned served_rollback(server *srv, const char *model, char *err, size_t err_size)
{
    pthread_mutex_lock(&srv->live_lock);
    const char *name = model_named(srv, model);
    canary *c = name ? canary_of(srv, name) : NULL;
    if (c)
        canary_end(srv, c);
    pthread_mutex_unlock(&srv->live_lock);
    if (!c)
        snprintf(err, err_size, "%s has no canary", name ? name : "no model of that name:");
    else
        fprintf(stderr, "loom serve: the canary of %s was rolled back\n", model);
    return c ? 0 : 404;
}

unsigned served_promote(server *srv, const char *model, char *err, size_t err_size)
{
    pthread_mutex_lock(&srv->live_lock);
    const char *name = model_named(srv, model);
    canary *c = name ? canary_of(srv, name) : NULL;
    if (!c) {
        pthread_mutex_unlock(&srv->live_lock);
        snprintf(err, err_size, "%s has no canary", name ? name : "no model of that name:");
        return 404;
    }
    version_stats *v = version_of(srv, name, 0); /* (name is the old version's until below) */
    __atomic_store_n(&v->routed, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&v->failures, 0, __ATOMIC_RELAXED);
    served *old;
    if (name == srv->live->api.model_name) { /* the first model: later reloads read its file */
        char *kept = strdup(c->model);
        if (!kept) {
            pthread_mutex_unlock(&srv->live_lock);
            snprintf(err, err_size, "out of memory");
            return 500;
        }
        old = srv->live;
        srv->live = c->sv;
        free(srv->promoted_path), free(srv->promoted_name);
        srv->model_path = srv->promoted_path = c->path;
        c->sv->api.model_name = srv->name_flag = srv->promoted_name = kept;
    } else {
        model_slot *s = NULL;
        for (int i = 0; i < srv->n_slots && !s; i++)
            if (srv->slots[i].name == name)
                s = &srv->slots[i];
        old = s->live;
        s->live = c->sv;
        free(s->path);
        s->path = c->path;
        c->sv->api.model_name = s->name;
    }
    c->path = NULL, c->sv = NULL;
    if (old) {
        old->refs--; /* the server's */
        old->next = srv->retired;
        srv->retired = old;
    }
    canary_end(srv, c);
    pthread_mutex_unlock(&srv->live_lock);
    fprintf(stderr, "loom serve: the canary of %s was promoted: it is the model now\n", model);
    return 0;
}

cJSON *served_parse_and_acquire(server *srv, const char *body, size_t len, size_t max_values,
                                served **sv, bad *b)
{
    *sv = NULL;
    while (sem_wait(&srv->parsing) != 0 && errno == EINTR) {
    }
    cJSON *req = openai_parse_body(body, len, max_values, b);
    sem_post(&srv->parsing);
    if (!req)
        return NULL;
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(req, "model");
    const cJSON *seed = cJSON_GetObjectItemCaseSensitive(req, "seed");
    /* between a model's versions: a seed goes the same way each time, the rest at random */
    static uint64_t counter;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    uint64_t key = cJSON_IsNumber(seed)
        ? (uint64_t)seed->valuedouble
        : (uint64_t)now.tv_nsec ^ __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED) << 32;
    key = (key + 0x9e3779b97f4a7c15ull) * 0xbf58476d1ce4e5b9ull; /* splitmix64's mixing */
    key = (key ^ (key >> 27)) * 0x94d049bb133111ebull;
    key ^= key >> 31;
    char why[1024];
    unsigned st = served_acquire_named(srv, cJSON_IsString(model) ? model->valuestring : NULL, key,
                                       sv, why, sizeof why);
    if (st) {
        request_fail(b, st, "model", "%s", why);
        b->code = st == 404 ? "model_not_found" : NULL;
        cJSON_Delete(req);
        return NULL;
    }
    return req;
}
