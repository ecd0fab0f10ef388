/*
 * tools/serve/server.h - what the rooms of `loom serve` share: the server, the model it runs on
 * (served), tenants, jobs, and each room's entry points. The rooms: http.c (sending, keys,
 * refusals from the headers, routes), job.c (a request's generations and their OpenAI
 * responses), messages.c and responses.c (their Anthropic and Responses API ones), serve.c
 * (generation requests and main), embeddings.c, metrics.c, served.c (the model and
 * reloading it), tenants.c (keys and a request's place in the engine).
 */
#ifndef LOOM_TOOLS_SERVE_SERVER_H
#define LOOM_TOOLS_SERVE_SERVER_H

#include <loom/loom.h>

#include "tools/args.h"
#include "tools/conn_guard.h"
#include "tools/json_text.h"
#include "tools/openai_request.h"
#include "tools/webui.h"

#include <cjson/cJSON.h>
#include <microhttpd.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

/* A Prometheus histogram of seconds, in the buckets of Prometheus' client libraries: counts
 * per bucket (made cumulative when shown), the +Inf one last. */
#define N_LATENCY_BUCKETS 11 /* metrics.c's latency_buckets */
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
    uint64_t bytes;      /* its weights and KV pool (--models-max-bytes) */
} served;

/* A model besides the first (--add-model NAME=PATH, --models-dir): loaded on its first request,
 * unloaded least recently used when more than --models-max would be loaded. */
typedef struct model_slot {
    char *name, *path;
    /* its own options (models.json: context, KV pool, backend, KV type), else NULL: the
     * first's; backend and kv_type point into owned */
    loom_model_options *options;
    char *owned[2];
    served *live;  /* NULL: not loaded (under live_lock) */
    int loading;   /* a thread is opening it; others wait on slots_cv */
    uint64_t used; /* its last request, by srv->use_clock */
} model_slot;

#define SERVE_MAX_MODELS 64
#define SERVE_MAX_CANARIES 8

/* A version of a model, as requests were routed to it (for /metrics and the canary's
 * automatic rollback): counted since it became that model's stable or canary version. */
typedef struct version_stats {
    char model[160];
    int canary;                /* 1: the canary, 0: the stable version */
    uint64_t routed, failures; /* atomics: requests sent to it; of them, answered with an
                                  error (429 and 504, the server's load, are not its failures) */
    latencies seen;            /* its requests' times (under the server's count_lock) */
    uint64_t generated;        /* tokens it generated (under count_lock) */
} version_stats;

/* A new version of a model beside its current one (POST /admin/models/canary): share of the
 * requests that name the model go to it (by their seed's hash, so a seed goes the same way each
 * time); promoted, it becomes the model; rolled back, by hand or when its failures pass
 * --canary-max-failures of at least 20 requests, it is unloaded. */
typedef struct canary {
    char *model, *path;
    served *sv;
    double share;
} canary;

typedef struct server {
    openai_model api;  /* the first model's settings, which a reload keeps (its model: live's) */
    model_slot *slots; /* the other models by name (under live_lock), n_slots of them */
    int n_slots, models_max;
    uint64_t models_max_bytes; /* the other models' bytes loaded at once; 0: no limit */
    pthread_cond_t slots_cv;
    uint64_t use_clock;
    canary canaries[SERVE_MAX_CANARIES]; /* under live_lock */
    int n_canaries;
    double canary_max_failures;
    version_stats versions[2 * (SERVE_MAX_MODELS + 1)]; /* found or added under live_lock */
    int n_versions;
    /* the Responses API's stored responses, oldest first (stored.c), under stored_lock */
    pthread_mutex_t stored_lock;
    struct stored_response *stored_head, *stored_tail;
    int n_stored, stored_max;
    served *live, *retired; /* under live_lock */
    pthread_mutex_t live_lock;
    pthread_mutex_t reload_lock; /* one reload at a time */
    const char *model_path;
    char *promoted_path, *promoted_name; /* the first model's file and name since a canary
                                            was promoted (owned) */
    const char *prompt_cache_dir; /* --prompt-cache-dir: each model's prefix cache kept there */
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

/* ---- jobs: one HTTP request's generations (job.c) -------------------------------------------- */

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
    int stop_string;          /* finish "stop" at the request's stop string 1, 2, ...; 0: none */
    int32_t reasoning_tokens; /* of n_generated, the thought's (the engine's count) */
    char error[256];
    int32_t n_generated;
    int64_t id;
} choice;

/* The API a generation request came in by: it shapes the answers and the errors. Anthropic's
 * Messages API runs as a chat underneath (tools/anthropic_request.c). */
typedef enum serve_api {
    API_COMPLETIONS,  /* POST /v1/completions */
    API_CHAT,         /* POST /v1/chat/completions */
    API_MESSAGES,     /* POST /v1/messages */
    API_COUNT_TOKENS, /* POST /v1/messages/count_tokens: the prompt's tokens, no generation */
    API_RESPONSES,    /* POST /v1/responses (OpenAI's; tools/responses_request.c) */
} serve_api;

typedef struct job {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    server *srv;
    struct served *sv; /* the model it runs on (a reference) */
    serve_api api;
    int chat, stream, include_usage, n; /* chat: the API's answers are messages */
    choice ch[OPENAI_MAX_CHOICES];
    char *stops[OPENAI_MAX_STOPS]; /* the request's stop strings (Anthropic's stop_sequence) */
    /* Anthropic's and the Responses stream: content blocks (output items) begun, the open
     * one's kind (messages.c's, responses.c's), events sent (sequence_number) */
    int blocks_sent, open_block, events_sent;
    int32_t n_prompt, n_cached, n_cached_restored;
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
    version_stats *version;    /* the version of the model it was routed to */
    /* a Responses request that is kept (store): the conversation it continues with its own
     * input, as chat messages (owned), and the response it continued, or NULL */
    cJSON *conversation;
    char previous_id[48];
} job;

typedef struct event_target {
    job *j;
    int index;
} event_target;

/* seconds a client told 503 (the server is draining) should wait before it tries again, and
 * one told 429 (the queue is full) */
#define RETRY_AFTER "5"
#define RETRY_BUSY "1"

/* http.c */
/* the error shape of the route this thread answers: Anthropic's for its API, OpenAI's
 * otherwise (set by http.c around each handler; libmicrohttpd runs one call at a time a thread) */
extern _Thread_local int http_anthropic_errors;
/* the model version the request this thread answers was routed to (served_parse_and_acquire):
 * its answers carry X-Loom-Model-Version, and its errors count as the version's failures */
extern _Thread_local version_stats *http_version;
enum MHD_Result http_send_text(struct MHD_Connection *con, unsigned status, const char *type,
                               const char *body);
enum MHD_Result http_send_json(struct MHD_Connection *con, unsigned status, cJSON *o);
/* OpenAI's error shape, counted in /metrics */
enum MHD_Result http_error(server *srv, struct MHD_Connection *con, unsigned status,
                           const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));
int http_client_gone(struct MHD_Connection *con);
enum MHD_Result on_request(void *cls, struct MHD_Connection *con, const char *url,
                           const char *method, const char *version, const char *upload,
                           size_t *upload_size, void **con_cls);
void request_completed(void *cls, struct MHD_Connection *con, void **con_cls,
                       enum MHD_RequestTerminationCode toe);

/* job.c */
void job_unref(job *j);
void job_on_event(void *user, const loom_event *ev); /* user: an event_target */
int job_all_done(const job *j);
void job_cancel(job *j);
void serve_wait_briefly(pthread_cond_t *cv, pthread_mutex_t *mu);
void job_wait_briefly(job *j);
ssize_t job_stream_read(void *cls, uint64_t pos, char *buf, size_t max);
void job_stream_free(void *cls);
enum MHD_Result job_send_ended_early(server *srv, struct MHD_Connection *con, int deadline,
                                     int busy, const char *invalid, const char *msg);
enum MHD_Result job_finish_blocking(struct MHD_Connection *con, job *j);
/* what choice c has ready to send since the last call (under j->mu): a thought's new bytes,
 * the answer's new text, and, once it is done and nothing more is held back, its calls */
typedef struct ready_parts {
    const char *thought, *text;
    size_t thought_len, text_len;
    int final; /* the choice is done: what is here is its last, calls included */
    loom_tool_calls calls;
} ready_parts;
void job_take_ready(job *j, choice *c, ready_parts *rp);
/* the calls in choice c's finished answer past its first base bytes (a thought) */
void job_read_tool_calls(const job *j, const choice *c, size_t base, loom_tool_calls *tc);
/* a finished choice's thought (r) and calls (tc, with the text's length before them) */
void job_answer_parts(const job *j, const choice *c, loom_reasoning *r, loom_tool_calls *tc);
/* an id for a call: the model's own, else prefix and fresh letters (Mistral's: 9 alone) */
void job_call_id(const job *j, const loom_tool_call *call, const char *prefix, char *id,
                 size_t cap);
void job_sse(job *j, const char *event, cJSON *o); /* event: NULL for OpenAI's data-only */

/* messages.c: Anthropic's shapes of a job's answer */
cJSON *messages_response(job *j);    /* the whole message (under j->mu, all done) */
void messages_stream_format(job *j); /* its events since the last call (under j->mu) */
/* an Anthropic stop_reason for choice c (calls: the answer has tool calls) */
const char *messages_stop_reason(const choice *c, int calls);

/* stored.c: the responses kept (store): put (both trees given away), a copy of one's
 * conversation or of its response object (NULL: none so), delete (0, or -1: none), clear */
typedef struct stored_response stored_response;
void stored_put(server *srv, const char *id, cJSON *conversation, cJSON *response);
cJSON *stored_get(server *srv, const char *id, int conversation);
int stored_delete(server *srv, const char *id);
void stored_clear(server *srv);

/* responses.c: the Responses API's shapes of a job's answer */
cJSON *responses_response(job *j); /* the whole response (under j->mu, all done) */
/* keeps j's conversation with its answer (response) when the request is kept (store) */
void responses_keep(job *j, const cJSON *response);
/* chat (a rewritten Responses request) continuing the kept response previous: its messages
 * after that conversation; 0, or -1 with b filled (404: none kept so) */
int responses_continue(server *srv, cJSON *chat, const char *previous, bad *b);
void responses_stream_format(job *j); /* its events since the last call (under j->mu) */

/* serve.c, embeddings.c: the endpoints that run the model (who: the caller's tenant) */
enum MHD_Result generate_handle(server *srv, struct MHD_Connection *con, const char *body,
                                size_t len, serve_api api, int who);
enum MHD_Result embeddings_handle(server *srv, struct MHD_Connection *con, const char *body,
                                  size_t len, int who);

/* metrics.c */
/* a request's last event, for its tenant (who) and the model version it ran on (or NULL) */
void metrics_observe(server *srv, int who, version_stats *version, const loom_event *ev);
void metrics_count_refused(server *srv, int who);
enum MHD_Result metrics_send(server *srv, struct MHD_Connection *con, int per_key);

/* served.c */
served *served_acquire(server *srv);
/* The model a request names (NULL: the first), loaded if it is not, or its canary for the
 * requests whose route_key (a uniform 64-bit number) falls in its share; held until release: 0,
 * or an HTTP status (404: no such model, 503: it failed to load or no room) with err. */
unsigned served_acquire_named(server *srv, const char *name, uint64_t route_key, served **out,
                              char *err, size_t err_size);
/* A request's body parsed as JSON (strictly, max_values values at most: the caller's budget
 * for the first model's context) and the model its "model" names acquired into *sv (the first
 * when it names none: the request's parser then says what is missing): the JSON, or NULL with
 * b filled (an unknown model 404, one that cannot load 503). */
cJSON *served_parse_and_acquire(server *srv, const char *body, size_t len, size_t max_values,
                                served **sv, bad *b);
/* POST /admin/models/load or unload (unload): one of the other models loaded now, or unloaded
 * (not while it answers requests): 0, or an HTTP status with err */
unsigned served_load(server *srv, const char *name, int unload, char *err, size_t err_size);
/* POST /admin/models/canary, /promote, /rollback: the version changes, 0, or an HTTP status
 * with err */
unsigned served_canary(server *srv, const char *model, const char *path, double share, char *err,
                       size_t err_size);
unsigned served_promote(server *srv, const char *model, char *err, size_t err_size);
unsigned served_rollback(server *srv, const char *model, char *err, size_t err_size);
/* adds the model at path as name (a slot, loaded on first use): 0, or -1 with err */
int served_add(server *srv, const char *name, const char *path, char *err, size_t err_size);
/* dir's models.json ({"NAME": {"path": FILE, "context": N, "kv_blocks": N, "backend": B,
 * "kv_type": T}, ...}, paths relative to dir), or without one every *.gguf file (named by its
 * stem) and Hugging Face folder (by its name) in dir */
int served_add_dir(server *srv, const char *dir, char *err, size_t err_size);
void served_release(server *srv, served *sv);
loom_engine *served_start_engine(const server *srv, loom_model *m, int first, const char *name,
                                 loom_model **drafter, char *err, size_t err_size);
void served_free(served *sv);
int served_reload(server *srv, char *err, size_t err_size);
void served_reap(server *srv);

/* tenants.c */
void tenants_admit(loom_request *r, const server *srv, int who, const char *user, int32_t priority,
                   int priority_given, double timeout_s);
int keys_read_file(const char *flag, const char *path, char *key, size_t cap);
int keys_valid(const char *key);
int keys_read_tenants(const char *path, server *srv);
extern server keyring; /* the keys of --api-keys, for the server's life */
void keys_free(void);

#endif
