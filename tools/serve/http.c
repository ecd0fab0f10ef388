/*
 * tools/serve/http.c - the HTTP layer of `loom serve`: sending answers and errors, who a
 * request is from (its key), what a request is refused for from its headers alone (framing,
 * a foreign page, a foreign Host), and the routes.
 */
#define _GNU_SOURCE
#include "tools/serve/server.h"

#include "tools/openai_fields.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>

/* ---- responses ---------------------------------------------------------------------------- */

/* seconds a client told 503 (the server is draining) should wait before it tries again, and
 * one told 429 (the queue is full) */
#define RETRY_AFTER "5"
#define RETRY_BUSY "1"

enum MHD_Result http_send_text(struct MHD_Connection *con, unsigned status, const char *type,
                               const char *body)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(body), (void *)body,
                                                             MHD_RESPMEM_MUST_COPY);
    if (!r)
        return MHD_NO;
    MHD_add_response_header(r, "Content-Type", type);
    if (http_version)
        MHD_add_response_header(r, "X-Loom-Model-Version",
                                http_version->canary ? "canary" : "stable");
    if (status == 503 || status == 429)
        MHD_add_response_header(r, "Retry-After", status == 503 ? RETRY_AFTER : RETRY_BUSY);
    enum MHD_Result ok = MHD_queue_response(con, status, r);
    MHD_destroy_response(r);
    return ok;
}

enum MHD_Result http_send_json(struct MHD_Connection *con, unsigned status, cJSON *o)
{
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!s)
        return MHD_NO;
    enum MHD_Result ok = http_send_text(con, status, "application/json", s);
    free(s);
    return ok;
}

_Thread_local int http_anthropic_errors;
_Thread_local version_stats *http_version;

/* Anthropic's error shape, {"type": "error", "error": {"type", "message"}}, its types by
 * status */
static cJSON *anthropic_error_body(unsigned status, const char *msg)
{
    cJSON *o = cJSON_CreateObject(), *e;
    cJSON_AddStringToObject(o, "type", "error");
    e = cJSON_AddObjectToObject(o, "error");
    cJSON_AddStringToObject(e, "type",
                            status == 401       ? "authentication_error"
                                : status == 403 ? "permission_error"
                                : status == 404 ? "not_found_error"
                                : status == 413 ? "request_too_large"
                                : status == 429 ? "rate_limit_error"
                                : status == 503 ? "overloaded_error"
                                : status >= 500 ? "api_error"
                                                : "invalid_request_error");
    json_add_text(e, "message", msg, strlen(msg));
    return o;
}

/* OpenAI's error shape, {"error": {"message", "type", "param", "code"}} (or Anthropic's, on its
 * routes), counted in /metrics */
static cJSON *error_body(server *srv, unsigned status, const char *param, const char *code,
                         const char *msg)
{
    pthread_mutex_lock(&srv->count_lock);
    srv->http_errors++;
    pthread_mutex_unlock(&srv->count_lock);
    if (http_version && status != 429 && status != 504) /* not the server's load: the version's */
        __atomic_add_fetch(&http_version->failures, 1, __ATOMIC_RELAXED);
    if (http_anthropic_errors)
        return anthropic_error_body(status, msg);
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
    return o;
}

enum MHD_Result http_error(server *srv, struct MHD_Connection *con, unsigned status,
                           const char *param, const char *code, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return http_send_json(con, status, error_body(srv, status, param, code, msg));
}

/* Whether the client closed its end while we wait to answer. */
int http_client_gone(struct MHD_Connection *con)
{
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(con,
                                                                 MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci)
        return 0;
    char c;
    ssize_t n = recv(ci->connect_fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
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
    int count, x_count; /* Authorization headers, x-api-key headers (Anthropic's clients') */
    const char *value, *x_value;
    size_t len, x_len;
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
    if (key_size == 9 && !strncasecmp(key, "x-api-key", 9)) {
        a->x_count++;
        a->x_value = value, a->x_len = value ? value_size : 0;
    }
    return MHD_YES;
}

/* Who sent the request, from its key, read exactly: one Authorization header, the scheme
 * "Bearer" in any case (RFC 7235), one or more spaces, the key, nothing after it but spaces or
 * tabs; or, with no Authorization header, one x-api-key header whose value is the key (as
 * Anthropic's clients send it). Returns the tenant (1, 2, ...) whose key of --api-keys it is, 0 for the one key of
 * --api-key-file (or --admin-key-file's) or when the API wants no key, -1 when the API wants a
 * key and none matches (every key is compared, in constant time each). *admin: the key may
 * reload the model and see every tenant's figures: --admin-key-file's, a tenant line that says
 * "admin", the one API key when no admin key is set, anyone when the server has no key at all. */
static int http_caller(server *srv, struct MHD_Connection *con, int *admin)
{
    int open_api = !srv->api_key && !srv->n_tenants;
    *admin = open_api && !srv->admin_key;
    if (*admin)
        return 0;
    auth_header a = {0};
    MHD_get_connection_values_n(con, MHD_HEADER_KIND, see_auth, &a);
    size_t start = 7, end = a.len;
    if (a.count == 0 && a.x_count == 1 && a.x_value) /* the key alone */
        a.value = a.x_value, end = a.x_len, start = 0;
    else if (a.count != 1 || !a.value || a.len < 8 || strncasecmp(a.value, "Bearer ", 7) != 0)
        return open_api ? 0 : -1;
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

static enum MHD_Result http_refuse_key(server *srv, struct MHD_Connection *con)
{
    return http_error(srv, con, 401, NULL, "invalid_api_key",
                      "Incorrect or missing API key: send 'Authorization: Bearer KEY' (or "
                      "'x-api-key: KEY') with the key the server was started with "
                      "(--api-key-file, LOOM_API_KEY or --api-key)");
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
    /* the name: up to the port's ':', or an IPv6 address in brackets */
    const char *close = host[0] == '[' ? strchr(host, ']') : NULL;
    if (host[0] == '[' && !close)
        return 0;
    size_t n = close ? (size_t)(close - host) + 1 : strcspn(host, ":");
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
        return http_error(srv, con, 421, NULL, "misdirected_request",
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
    return http_error(srv, con, 403, NULL, "cross_origin_request",
                      "a request from a web page of another origin (%.200s) is refused: pages on "
                      "the web must not drive this server from their visitors' browsers; call it "
                      "from a program, or from the chat page it serves at /",
                      origin ? origin : site) == MHD_YES
        ? 1
        : -1;
}

/* ---- routes: one row each ----------------------------------------------------------------- */

/* Who may call a route. */
typedef enum route_access {
    ACCESS_ANYONE,  /* no key needed (a handler may show more to a caller that has one) */
    ACCESS_METRICS, /* the API's key with --metrics-auth, else anyone */
    ACCESS_KEY,     /* the API's key: any tenant's */
    ACCESS_ADMIN,   /* an admin key (http_caller) */
} route_access;

/* What a handler is given: who called (tenant: 1, 2, ... of --api-keys, 0 none; known: the
 * request carried a key the server has, or the API wants none) and, for a route that reads
 * one, the body. */
typedef struct route_call {
    int tenant, admin, known;
    const char *body;
    size_t len;
    char id[128]; /* a route ending in /{id}: what the path has there */
} route_call;

typedef struct route {
    const char *method; /* "GET" (HEAD too: libmicrohttpd sends the headers alone) or "POST" */
    const char *path;
    route_access access;
    int reads_body; /* the handler runs once the body has come (refused while draining) */
    int anthropic;  /* Anthropic's API: its errors in Anthropic's shape */
    enum MHD_Result (*handler)(server *srv, struct MHD_Connection *con, const route_call *rc);
    int (*enabled)(const server *srv); /* NULL: always */
} route;

/* {"status": "ok"}; to a client with the key (or any, when the server wants none) also the
 * model, the reloads and "reload_error" while the last reload failed (the old model serving):
 * a stranger learns nothing but that the server is up. */
static enum MHD_Result route_health(server *srv, struct MHD_Connection *con, const route_call *rc)
{
    if (srv->shutting_down)
        return http_send_text(con, 503, "application/json", "{\"status\":\"shutting down\"}");
    if (!rc->known)
        return http_send_text(con, 200, "application/json", "{\"status\":\"ok\"}");
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "status", "ok");
    served *sv = served_acquire(srv);
    json_add_text(o, "model", sv->api.model_name, strlen(sv->api.model_name));
    served_release(srv, sv);
    pthread_mutex_lock(&srv->live_lock);
    cJSON_AddNumberToObject(o, "reloads", srv->reloads);
    if (srv->reload_error[0])
        json_add_text(o, "reload_error", srv->reload_error, strlen(srv->reload_error));
    pthread_mutex_unlock(&srv->live_lock);
    return http_send_json(con, 200, o);
}

static enum MHD_Result route_models(server *srv, struct MHD_Connection *con, const route_call *rc)
{
    (void)rc;
    cJSON *o = cJSON_CreateObject(), *d;
    cJSON_AddStringToObject(o, "object", "list");
    d = cJSON_AddArrayToObject(o, "data");
    cJSON *m = cJSON_CreateObject();
    served *sv = served_acquire(srv);
    json_add_text(m, "id", sv->api.model_name, strlen(sv->api.model_name));
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", (double)srv->started);
    cJSON_AddStringToObject(m, "owned_by", "loom");
    cJSON_AddNumberToObject(m, "max_model_len", sv->api.n_ctx);
    cJSON_AddStringToObject(m, "backend", loom_model_backend(sv->api.model));
    cJSON_AddBoolToObject(m, "loaded", 1);
    served_release(srv, sv);
    cJSON_AddItemToArray(d, m);
    /* the others, loaded or not (loaded on their first request) */
    pthread_mutex_lock(&srv->live_lock);
    for (int i = 0; i < srv->n_slots; i++) {
        const model_slot *s = &srv->slots[i];
        cJSON *x = cJSON_CreateObject();
        json_add_text(x, "id", s->name, strlen(s->name));
        cJSON_AddStringToObject(x, "object", "model");
        cJSON_AddNumberToObject(x, "created", (double)srv->started);
        cJSON_AddStringToObject(x, "owned_by", "loom");
        if (s->live) {
            cJSON_AddNumberToObject(x, "max_model_len", s->live->api.n_ctx);
            cJSON_AddStringToObject(x, "backend", loom_model_backend(s->live->api.model));
        }
        cJSON_AddBoolToObject(x, "loaded", s->live != NULL);
        cJSON_AddItemToArray(d, x);
    }
    pthread_mutex_unlock(&srv->live_lock);
    return http_send_json(con, 200, o);
}

/* a static page: the key guards the API it calls, not the page */
static enum MHD_Result route_webui(server *srv, struct MHD_Connection *con, const route_call *rc)
{
    (void)srv, (void)rc;
    return webui_send(con);
}

static int webui_on(const server *srv)
{
    return srv->webui;
}

static enum MHD_Result route_metrics(server *srv, struct MHD_Connection *con, const route_call *rc)
{
    return metrics_send(srv, con, srv->n_tenants && rc->known && rc->admin);
}

static enum MHD_Result route_reload(server *srv, struct MHD_Connection *con, const route_call *rc)
{
    char why[1024];
    int failed = served_reload(srv, why, sizeof why);
    if (failed > 0)
        return http_error(srv, con, 409, NULL, "reload_in_progress", "%s", why);
    if (failed)
        return http_error(srv, con, 500, NULL, "reload_failed",
                          "reloading the model failed; the old one keeps serving: %s", why);
    return route_models(srv, con, rc); /* what now serves */
}

/* POST /admin/models/canary {"model", "path", "share"} (path absent: the share changes),
 * /admin/models/promote and /admin/models/rollback {"model"}: the model's versions after */
static enum MHD_Result route_versions(server *srv, struct MHD_Connection *con, const route_call *rc,
                                      int what)
{
    static const char *const fields[][4] = {
        {"model", "path", "share", NULL}, {"model", NULL}, {"model", NULL}};
    bad b = {0};
    cJSON *req = openai_parse_body(rc->body, rc->len, 64, &b);
    const char *model = req ? field_string(req, "model", 1, "body", &b) : NULL;
    const char *path = model ? field_string(req, "path", 0, "body", &b) : NULL;
    double share = 0;
    int r = model && !b.msg[0] && !fields_only(req, fields[what], NULL, &b)
        ? field_number(req, "share", 0, 1, 0, &share, &b)
        : -1;
    if (what == 0 && r == 0 && !b.msg[0])
        r = request_fail(&b, 400, "share", "'share' (0 to 1) is the canary's part of the traffic");
    if (r < 0 || b.msg[0]) {
        cJSON_Delete(req);
        return http_error(srv, con, b.status ? b.status : 400, b.param, NULL, "%s", b.msg);
    }
    char err[1024];
    unsigned st = what == 0 ? served_canary(srv, model, path, share, err, sizeof err)
        : what == 1         ? served_promote(srv, model, err, sizeof err)
                            : served_rollback(srv, model, err, sizeof err);
    cJSON_Delete(req);
    if (st)
        return http_error(srv, con, st, "model", NULL, "%s", err);
    cJSON *o = cJSON_CreateObject(), *a = cJSON_AddArrayToObject(o, "canaries");
    pthread_mutex_lock(&srv->live_lock);
    for (int i = 0; i < srv->n_canaries; i++) {
        cJSON *c = cJSON_CreateObject();
        json_add_text(c, "model", srv->canaries[i].model, strlen(srv->canaries[i].model));
        json_add_text(c, "path", srv->canaries[i].path, strlen(srv->canaries[i].path));
        cJSON_AddNumberToObject(c, "share", srv->canaries[i].share);
        cJSON_AddItemToArray(a, c);
    }
    pthread_mutex_unlock(&srv->live_lock);
    return http_send_json(con, 200, o);
}

/* POST /admin/models/load and /unload {"model"}: the model list after */
static enum MHD_Result route_load(server *srv, struct MHD_Connection *con, const route_call *rc,
                                  int unload)
{
    static const char *const fields[] = {"model", NULL};
    bad b = {0};
    cJSON *req = openai_parse_body(rc->body, rc->len, 16, &b);
    const char *model = req ? field_string(req, "model", 1, "body", &b) : NULL;
    if (!model || fields_only(req, fields, NULL, &b)) {
        cJSON_Delete(req);
        return http_error(srv, con, b.status ? b.status : 400, b.param, NULL, "%s", b.msg);
    }
    char err[1024];
    unsigned st = served_load(srv, model, unload, err, sizeof err);
    cJSON_Delete(req);
    if (st)
        return http_error(srv, con, st, "model", NULL, "%s", err);
    return route_models(srv, con, rc);
}

static enum MHD_Result route_model_load(server *srv, struct MHD_Connection *con,
                                        const route_call *rc)
{
    return route_load(srv, con, rc, 0);
}

static enum MHD_Result route_model_unload(server *srv, struct MHD_Connection *con,
                                          const route_call *rc)
{
    return route_load(srv, con, rc, 1);
}

static enum MHD_Result route_canary(server *srv, struct MHD_Connection *con, const route_call *rc)
{
    return route_versions(srv, con, rc, 0);
}

static enum MHD_Result route_promote(server *srv, struct MHD_Connection *con, const route_call *rc)
{
    return route_versions(srv, con, rc, 1);
}

static enum MHD_Result route_rollback(server *srv, struct MHD_Connection *con, const route_call *rc)
{
    return route_versions(srv, con, rc, 2);
}

/* GET /v1/responses/{id}: a stored response as it was answered */
static enum MHD_Result route_response_get(server *srv, struct MHD_Connection *con,
                                          const route_call *rc)
{
    cJSON *o = stored_get(srv, rc->id, 0);
    if (!o)
        return http_error(srv, con, 404, "response_id", NULL,
                          "no stored response '%s' (never stored, deleted, or dropped past "
                          "--responses-max %d)",
                          rc->id, srv->stored_max);
    return http_send_json(con, 200, o);
}

/* DELETE /v1/responses/{id} */
static enum MHD_Result route_response_delete(server *srv, struct MHD_Connection *con,
                                             const route_call *rc)
{
    if (stored_delete(srv, rc->id) != 0)
        return http_error(srv, con, 404, "response_id", NULL, "no stored response '%s'", rc->id);
    cJSON *o = cJSON_CreateObject();
    json_add_text(o, "id", rc->id, strlen(rc->id));
    cJSON_AddStringToObject(o, "object", "response");
    cJSON_AddBoolToObject(o, "deleted", 1);
    return http_send_json(con, 200, o);
}

static enum MHD_Result route_completions(server *srv, struct MHD_Connection *con,
                                         const route_call *rc)
{
    return generate_handle(srv, con, rc->body, rc->len, API_COMPLETIONS, rc->tenant);
}

static enum MHD_Result route_chat(server *srv, struct MHD_Connection *con, const route_call *rc)
{
    return generate_handle(srv, con, rc->body, rc->len, API_CHAT, rc->tenant);
}

static enum MHD_Result route_messages(server *srv, struct MHD_Connection *con, const route_call *rc)
{
    return generate_handle(srv, con, rc->body, rc->len, API_MESSAGES, rc->tenant);
}

static enum MHD_Result route_responses(server *srv, struct MHD_Connection *con,
                                       const route_call *rc)
{
    return generate_handle(srv, con, rc->body, rc->len, API_RESPONSES, rc->tenant);
}

static enum MHD_Result route_count_tokens(server *srv, struct MHD_Connection *con,
                                          const route_call *rc)
{
    return generate_handle(srv, con, rc->body, rc->len, API_COUNT_TOKENS, rc->tenant);
}

static enum MHD_Result route_embeddings(server *srv, struct MHD_Connection *con,
                                        const route_call *rc)
{
    return embeddings_handle(srv, con, rc->body, rc->len, rc->tenant);
}

/* Every endpoint, a row each: the 404's list and the 405's method come from here. */
static const route routes[] = {
    {"POST", "/v1/chat/completions", ACCESS_KEY, 1, 0, route_chat, NULL},
    {"POST", "/v1/completions", ACCESS_KEY, 1, 0, route_completions, NULL},
    {"POST", "/v1/embeddings", ACCESS_KEY, 1, 0, route_embeddings, NULL},
    {"POST", "/v1/messages", ACCESS_KEY, 1, 1, route_messages, NULL},
    {"POST", "/v1/messages/count_tokens", ACCESS_KEY, 1, 1, route_count_tokens, NULL},
    {"POST", "/v1/responses", ACCESS_KEY, 1, 0, route_responses, NULL},
    {"GET", "/v1/responses/{id}", ACCESS_KEY, 0, 0, route_response_get, NULL},
    {"DELETE", "/v1/responses/{id}", ACCESS_KEY, 0, 0, route_response_delete, NULL},
    {"GET", "/v1/models", ACCESS_KEY, 0, 0, route_models, NULL},
    {"GET", "/health", ACCESS_ANYONE, 0, 0, route_health, NULL},
    {"GET", "/metrics", ACCESS_METRICS, 0, 0, route_metrics, NULL},
    {"POST", "/admin/reload", ACCESS_ADMIN, 0, 0, route_reload, NULL},
    {"POST", "/admin/models/load", ACCESS_ADMIN, 1, 0, route_model_load, NULL},
    {"POST", "/admin/models/unload", ACCESS_ADMIN, 1, 0, route_model_unload, NULL},
    {"POST", "/admin/models/canary", ACCESS_ADMIN, 1, 0, route_canary, NULL},
    {"POST", "/admin/models/promote", ACCESS_ADMIN, 1, 0, route_promote, NULL},
    {"POST", "/admin/models/rollback", ACCESS_ADMIN, 1, 0, route_rollback, NULL},
    {"GET", "/", ACCESS_ANYONE, 0, 0, route_webui, webui_on},
};
#define N_ROUTES (sizeof routes / sizeof *routes)

/* Whether url is r's path: the same, or for a path ending in "/{id}" that prefix and one
 * segment (1 to 127 bytes of letters, digits, '_' and '-'), copied to id. */
static int path_matches(const route *r, const char *url, char *id)
{
    size_t n = strlen(r->path);
    if (n < 5 || strcmp(r->path + n - 5, "/{id}"))
        return !strcmp(url, r->path);
    n -= 4; /* the prefix, its '/' included */
    if (strncmp(url, r->path, n))
        return 0;
    size_t k = strspn(url + n, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-");
    if (k == 0 || k > 127 || url[n + k])
        return 0;
    memcpy(id, url + n, k), id[k] = 0;
    return 1;
}

/* a request's state between libmicrohttpd's calls (the body as it comes) */
typedef struct conn_state {
    const struct route *to; /* a route whose body is still to come */
    route_call call;
    char *body;
    size_t len, cap;
    int too_big;
} conn_state;

static enum MHD_Result no_such_route(server *srv, struct MHD_Connection *con, const char *url,
                                     const char *method)
{
    char list[1024];
    size_t at = 0;
    for (size_t i = 0; i < N_ROUTES && at < sizeof list; i++)
        if (!routes[i].enabled || routes[i].enabled(srv))
            at += (size_t)snprintf(list + at, sizeof list - at, "%s%s %s", i ? ", " : "",
                                   routes[i].method, routes[i].path);
    return http_error(srv, con, 404, NULL, NULL, "no such endpoint: %s %s (loom serves %s)", method,
                      url, list);
}

/* 405, with the Allow header the status requires (RFC 9110): the route's method */
static enum MHD_Result method_not_allowed(server *srv, struct MHD_Connection *con, const route *r)
{
    char msg[300];
    snprintf(msg, sizeof msg, "use %s for %s", r->method, r->path);
    cJSON *o = error_body(srv, 405, NULL, NULL, msg);
    char *body = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    struct MHD_Response *resp = body
        ? MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE)
        : NULL;
    if (!resp) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(resp, "Content-Type", "application/json");
    MHD_add_response_header(resp, "Allow", strcmp(r->method, "GET") ? r->method : "GET, HEAD");
    enum MHD_Result ok = MHD_queue_response(con, 405, resp);
    MHD_destroy_response(resp);
    return ok;
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
    int get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
    if ((refused = refused_foreign(srv, con, get)))
        return refused > 0 ? MHD_YES : MHD_NO;
    /* the route of this path and method, else of this path (for the 405) */
    const route *r = NULL, *by_path = NULL;
    for (size_t i = 0; i < N_ROUTES && !r; i++)
        if (path_matches(&routes[i], url, cs->call.id) &&
            (!routes[i].enabled || routes[i].enabled(srv))) {
            by_path = by_path ? by_path : &routes[i];
            if (!strcmp(method, routes[i].method) || (get && !strcmp(routes[i].method, "GET")))
                r = &routes[i];
        }
    if (!by_path)
        return no_such_route(srv, con, url, method);
    r = r ? r : by_path;
    http_anthropic_errors = r->anthropic; /* until on_request returns */
    if (strcmp(method, r->method) && !(get && !strcmp(r->method, "GET")))
        return method_not_allowed(srv, con, r);
    route_call *rc = &cs->call;
    rc->tenant = http_caller(srv, con, &rc->admin);
    rc->known = rc->tenant >= 0;
    if (!rc->known &&
        (r->access == ACCESS_KEY || r->access == ACCESS_ADMIN ||
         (r->access == ACCESS_METRICS && srv->metrics_auth)))
        return http_refuse_key(srv, con);
    rc->tenant = rc->known ? rc->tenant : 0;
    if (r->access == ACCESS_ADMIN && !rc->admin)
        return http_error(srv, con, 403, NULL, "admin_key_required",
                          "%s %s takes an admin key ('admin' on its --api-keys line, or "
                          "--admin-key-file's); this key may use the API only",
                          r->method, r->path);
    if (!r->reads_body)
        return r->handler(srv, con, rc);
    if (srv->shutting_down)
        return http_error(srv, con, 503, NULL, NULL,
                          "the server is shutting down; retry "
                          "against another instance or after a restart");
    cs->to = r;
    return MHD_YES;
}

void request_completed(void *cls, struct MHD_Connection *con, void **con_cls,
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

enum MHD_Result on_request(void *cls, struct MHD_Connection *con, const char *url,
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
        http_anthropic_errors = 0, http_version = NULL;
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
    http_anthropic_errors = cs->to->anthropic;
    enum MHD_Result r;
    if (cs->too_big)
        r = http_error(srv, con, 413, NULL, NULL,
                       "the request body is larger than the server's limit of %zu bytes "
                       "(--max-body)",
                       srv->max_body);
    else if (!cs->len)
        r = http_error(srv, con, 400, NULL, NULL, "the request has no body; send a JSON object");
    else {
        cs->call.body = cs->body, cs->call.len = cs->len;
        r = cs->to->handler(srv, con, &cs->call);
    }
    http_anthropic_errors = 0, http_version = NULL;
    return r;
}
