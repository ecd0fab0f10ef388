/*
 * tools/serve/serve.c - `loom serve`: an OpenAI-compatible HTTP server on libmicrohttpd; this
 * room holds the generation endpoints (completions, chat, Anthropic's messages, responses) and
 * main (tools/serve/server.h lists
 * the others).
 *
 * HTTP threads (one per connection) parse, validate and tokenize requests, submit them to the
 * engine (engine/engine.c) and turn its events into responses; they never run the model. Each
 * request's state (a job) is shared by its connection thread and the engine thread: a mutex
 * and condition variable guard it, and a reference count frees it once both are done with it.
 * Request and response shapes follow the OpenAI API as the official Python client sends and
 * reads them; tools/openai_request.c checks and reads request bodies.
 */
#define _GNU_SOURCE
#include "tools/serve/server.h"

#include "tools/anthropic_request.h"
#include "tools/responses_request.h"

#include <arpa/inet.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum MHD_Result generate_handle(server *srv, struct MHD_Connection *con, const char *body,
                                size_t len, serve_api api, int who)
{
    int chat = api != API_COMPLETIONS, anthropic = api == API_MESSAGES || api == API_COUNT_TOKENS;
    tenant *tn = who > 0 ? &srv->tenants[who - 1] : NULL;
    parsed p = {0};
    bad b = {0};
    served *sv;
    cJSON *req = served_parse_and_acquire(srv, body, len, openai_max_values(srv->api.n_ctx), &sv,
                                          &b);
    if (!req)
        return http_error(srv, con, b.status, b.param, b.code, "%s", b.msg);
    /* a Responses request: kept unless it says store false, and maybe continuing one kept */
    int keep = api == API_RESPONSES && srv->stored_max > 0 &&
        !cJSON_IsFalse(cJSON_GetObjectItemCaseSensitive(req, "store"));
    const cJSON *prev_v = api == API_RESPONSES
        ? cJSON_GetObjectItemCaseSensitive(req, "previous_response_id")
        : NULL;
    char previous[48] = "";
    if (cJSON_IsString(prev_v))
        snprintf(previous, sizeof previous, "%.47s", prev_v->valuestring);
    while (sem_wait(&srv->parsing) != 0 && errno == EINTR) {
    }
    if (anthropic || api == API_RESPONSES) { /* asked as a chat from here on */
        cJSON *as_chat = anthropic ? anthropic_chat_request(req, api == API_COUNT_TOKENS, &b)
                                   : responses_chat_request(req, &b);
        cJSON_Delete(req);
        req = as_chat;
    }
    if (req && previous[0] && responses_continue(srv, req, previous, &b) != 0) {
        cJSON_Delete(req);
        req = NULL;
    }
    int parsed_ok = req && openai_parse_request(&sv->api, req, chat, &p, &b) == 0;
    sem_post(&srv->parsing);
    if (!parsed_ok) {
        openai_parsed_free(&p);
        cJSON_Delete(req);
        served_release(srv, sv);
        return http_error(srv, con, b.status, b.param, b.code, "%s", b.msg);
    }
    if (api == API_COUNT_TOKENS) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "input_tokens", p.n_ids);
        openai_parsed_free(&p);
        cJSON_Delete(req);
        served_release(srv, sv);
        return http_send_json(con, 200, o);
    }
    if (srv->shutting_down) {
        openai_parsed_free(&p);
        cJSON_Delete(req);
        served_release(srv, sv);
        return http_error(srv, con, 503, NULL, NULL, "the server is shutting down");
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
        served_release(srv, sv);
        return http_error(srv, con, 500, NULL, NULL, "out of memory");
    }
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    j->srv = srv, j->sv = sv; /* the job holds the model's reference from here */
    j->version = http_version;
    if (keep) /* the conversation through this input, to keep with its answer */
        j->conversation = cJSON_Duplicate(cJSON_GetObjectItemCaseSensitive(req, "messages"), 1);
    snprintf(j->previous_id, sizeof j->previous_id, "%s", previous);
    j->tenant = who;
    j->api = api, j->chat = chat, j->stream = p.stream, j->include_usage = p.include_usage;
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
    snprintf(j->id, sizeof j->id, "%s%016llx",
             anthropic                  ? "msg_"
                 : api == API_RESPONSES ? "resp_"
                 : chat                 ? "chatcmpl-"
                                        : "cmpl-",
             (unsigned long long)(__atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED) ^
                                  ((uint64_t)j->created << 20)));
    char err[512] = "";
    int submitted = 0, busy = 0;
    for (int i = 0; i < p.n_stops; i++) /* the request's JSON goes before the answer */
        if (!(j->stops[i] = strdup(p.stops[i])))
            snprintf(err, sizeof err, "out of memory");
    for (int i = 0; i < p.n && !err[0]; i++) {
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
                          .reasoning = p.reasoning,
                          .reasoning_budget = p.reasoning_budget,
                          .lookup = p.lookup,
                          .draft_max = p.draft_max,
                          .draft = p.draft};
        tenants_admit(&r, srv, who, p.user, p.priority, p.priority_given, p.timeout_s);
        r.sampling.seed = p.s.seed + (uint64_t)i; /* n choices: n different samples */
        pthread_mutex_lock(&j->mu);
        j->refs++;
        pthread_mutex_unlock(&j->mu);
        int64_t id = loom_engine_submit(sv->engine, &r, job_on_event, t, err, sizeof err);
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
        job_cancel(j);
        job_unref(j);
        if (busy)
            metrics_count_refused(srv, who);
        if (busy)
            return http_error(srv, con, 429, NULL, "rate_limit_exceeded", "%s", err);
        return http_error(srv, con, srv->shutting_down ? 503 : 400, NULL, NULL, "%s", err);
    }
    if (!j->stream)
        return job_finish_blocking(con, j);
    /* the status waits for the first event: a request whose deadline comes while it is queued
     * is a 504, not a 200 stream that says so */
    pthread_mutex_lock(&j->mu);
    int started = 0;
    while (!started) {
        for (int i = 0; i < j->n && !started; i++)
            started = j->ch[i].len > 0 || j->ch[i].done;
        if (!started)
            job_wait_briefly(j);
        if (!started && http_client_gone(con)) {
            pthread_mutex_unlock(&j->mu);
            pthread_mutex_lock(&srv->count_lock);
            srv->disconnects++;
            pthread_mutex_unlock(&srv->count_lock);
            job_cancel(j);
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
            job_cancel(j);
            job_unref(j);
            return job_send_ended_early(srv, con, deadline, busy, bad, msg);
        }
    pthread_mutex_unlock(&j->mu);
    j->con = con;
    struct MHD_Response *resp = MHD_create_response_from_callback(
        MHD_SIZE_UNKNOWN, 16 * 1024, job_stream_read, j, job_stream_free);
    if (!resp) {
        job_cancel(j);
        job_unref(j);
        return MHD_NO;
    }
    MHD_add_response_header(resp, "Content-Type", "text/event-stream");
    MHD_add_response_header(resp, "Cache-Control", "no-cache");
    if (j->version)
        MHD_add_response_header(resp, "X-Loom-Model-Version",
                                j->version->canary ? "canary" : "stable");
    enum MHD_Result ok = MHD_queue_response(con, 200, resp);
    MHD_destroy_response(resp);
    return ok;
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

int loom_serve_main(int argc, char **argv)
{
    const char *host = "127.0.0.1", *api_key = NULL, *name = NULL, *tmpl = NULL, *tmpl_file = NULL,
               *key_file = NULL, *prefix_cache = "shared", *api_keys = NULL, *admin_key_file = NULL,
               *allow_host = NULL;
    long port = 8080, max_batch = 16, max_step = 256, kv_blocks = 0, max_queue = 0,
         block = loom_default_block_size(), max_body = 1 << 20, drain_s = 10, max_conn = 512,
         max_per_client = 64, idle_s = 30, header_s = 10, body_s = 60, lookup = 0, draft_max = 0,
         draft_layers = 0, reasoning_budget = 0, models_max = 2;
    float canary_max_failures = 0.05f;
    const char *prompt_cache_dir = NULL;
    long responses_max = 100, models_max_bytes = 0;
    const char *added_items[SERVE_MAX_MODELS], *models_dir = NULL;
    loom_flag_list added = {added_items, 0, SERVE_MAX_MODELS};
    const char *draft = NULL;
    float draft_p_min = 0.75f;
    int metrics_auth = 0, parse_special = 0, no_webui = 0, draft_mtp = 0;
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
        {"--add-model", NULL, LOOM_FLAG_REPEAT, &added, 0, 0, "NAME=PATH",
         "another model, which requests name by NAME: loaded on its first\n"
         "request with the first one's options (repeat for more)"},
        {"--models-dir", NULL, LOOM_FLAG_TEXT, &models_dir, 0, 0, "DIR",
         "... every *.gguf file (named by its stem) and Hugging Face folder\n"
         "in DIR as another model"},
        {"--responses-max", NULL, LOOM_FLAG_LONG, &responses_max, 0, 1 << 20, "N",
         "Responses API answers kept for previous_response_id and GET\n"
         "/v1/responses/ID; past it the oldest is dropped (default 100; 0 keeps none)"},
        {"--prompt-cache-dir", NULL, LOOM_FLAG_TEXT, &prompt_cache_dir, 0, 0, "DIR",
         "keep each model's prefix cache there across restarts: saved when\n"
         "the server stops, read back when it starts (the same model file only)"},
        {"--canary-max-failures", NULL, LOOM_FLAG_FLOAT, &canary_max_failures, 0, 1, "F",
         "a canary (POST /admin/models/canary) that fails more than this share\n"
         "of at least 20 requests is rolled back (default 0.05)"},
        {"--models-max", NULL, LOOM_FLAG_LONG, &models_max, 1, 64, "N",
         "other models loaded at once; past it the least recently used one\n"
         "no request holds is unloaded (default 2)"},
        {"--models-max-bytes", NULL, LOOM_FLAG_LONG, &models_max_bytes, 0, 1e15, "BYTES",
         "... and at most this many bytes of them (weights and KV pool), the\n"
         "least recently used idle ones unloaded past it (default 0: no limit)"},
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
        {"--draft-mtp", NULL, LOOM_FLAG_SWITCH, &draft_mtp, 0, 0, NULL,
         "... or with the model's own multi-token-prediction block\n"
         "(Qwen3.5, Qwen3-Next files that carry one)"},
        {"--draft-p-min", NULL, LOOM_FLAG_FLOAT, &draft_p_min, 0, 1, "P",
         "the drafter stops at a token it gives less than P (default 0.75)"},
        {"--draft-max", NULL, LOOM_FLAG_LONG, &draft_max, 1, 64, "N",
         "most proposals a request checks a step (default 8)"},
        {"--reasoning-budget", NULL, LOOM_FLAG_LONG, &reasoning_budget, 0, 1 << 20, "N",
         "a thinking model's thought ends after N tokens (its end-of-thought\n"
         "marker is forced) unless a request says otherwise (default 0: none)"},
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
    if (!!draft + !!draft_layers + !!lookup + draft_mtp > 1) {
        fprintf(stderr,
                "loom serve: give one drafter: --draft, --draft-layers, --draft-mtp or --lookup\n");
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
    if (key_file && keys_read_file("--api-key-file", key_file, key_buf, sizeof key_buf) != 0)
        return 2;
    char admin_buf[4096] = "";
    if (admin_key_file &&
        (keys_read_file("--admin-key-file", admin_key_file, admin_buf, sizeof admin_buf) != 0 ||
         !keys_valid(admin_buf))) {
        if (admin_buf[0])
            fprintf(stderr,
                    "loom serve: --admin-key-file: the key must be 1 to 1024 visible "
                    "ASCII characters (no spaces or controls)\n");
        return 2;
    }
    atexit(keys_free);
    if (api_keys && keys_read_tenants(api_keys, &keyring) != 0)
        return 2;
    if (key_file)
        api_key = key_buf;
    else if (env_key && *env_key)
        api_key = env_key;
    if (api_key && !keys_valid(api_key)) {
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
                          .draft = draft || draft_layers || draft_mtp,
                          .reasoning_budget = (int32_t)reasoning_budget},
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
    if (draft || draft_layers || draft_mtp) { /* the drafter's cache: room for as many */
        srv.draft_path = draft ? draft : of.model;
        srv.dmo = mo;
        srv.dmo.distributed = 0;
        srv.dmo.n_ctx = ctx;
        srv.dmo.first_layers = (int32_t)draft_layers;
        srv.dmo.mtp = draft_mtp;
        fprintf(stderr, "loom serve: speculative decoding with %s%s\n",
                draft           ? "the draft model "
                    : draft_mtp ? "the model's multi-token-prediction block"
                                : "the model's first layers",
                draft ? draft : "");
    }
    loom_model *drafter;
    srv.prompt_cache_dir = prompt_cache_dir;
    loom_engine *engine = served_start_engine(&srv, m, 1, srv.api.model_name, &drafter, err,
                                              sizeof err);
    if (!engine) {
        fprintf(stderr, "loom serve: %s\n", err);
        loom_chat_format_free(&chat);
        loom_model_close(m);
        return 2;
    }
    pthread_mutex_init(&srv.live_lock, NULL);
    pthread_mutex_init(&srv.reload_lock, NULL);
    pthread_cond_init(&srv.slots_cv, NULL);
    srv.models_max = (int)models_max;
    srv.models_max_bytes = (uint64_t)models_max_bytes;
    srv.canary_max_failures = canary_max_failures;
    srv.stored_max = (int)responses_max;
    pthread_mutex_init(&srv.stored_lock, NULL);
    int bad_models = models_dir && served_add_dir(&srv, models_dir, err, sizeof err);
    for (int i = 0; i < added.n && !bad_models; i++) {
        const char *eq = strchr(added.items[i], '=');
        char model_name[160];
        if (!eq || eq == added.items[i] || !eq[1] ||
            eq - added.items[i] >= (int)sizeof model_name) {
            snprintf(err, sizeof err, "--add-model wants NAME=PATH, not '%.200s'", added.items[i]);
            bad_models = 1;
            break;
        }
        snprintf(model_name, sizeof model_name, "%.*s", (int)(eq - added.items[i]), added.items[i]);
        bad_models = served_add(&srv, model_name, eq + 1, err, sizeof err) != 0;
    }
    for (int i = 0; i < srv.n_slots && !bad_models; i++)
        if (!strcmp(srv.slots[i].name, srv.api.model_name)) {
            snprintf(err, sizeof err,
                     "'%s' names the first model already; give another name (or --model-name)",
                     srv.api.model_name);
            bad_models = 1;
        }
    if (bad_models) {
        fprintf(stderr, "loom serve: %s\n", err);
        loom_engine_stop(engine, 0);
        loom_engine_free(engine);
        loom_model_close(drafter);
        loom_chat_format_free(&chat);
        loom_model_close(m);
        return 2;
    }
    if (srv.n_slots)
        fprintf(stderr,
                "loom serve: %d more model%s by name, loaded on first use (at most %d at once)\n",
                srv.n_slots, srv.n_slots == 1 ? "" : "s", srv.models_max);
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
    if (prompt_cache_dir)
        fprintf(stderr, "loom serve: prefix cache %s\n", loom_engine_prefix_status(engine));
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
    loom_engine_stats st = loom_engine_get_stats(engine);
    fprintf(stderr,
            "loom serve: %s on %s; %d-token context, %d KV blocks of %d tokens, batch %ld\n",
            srv.api.model_name, loom_model_backend(m), ctx, st.kv_blocks, st.block_size, max_batch);
    uint64_t state = loom_model_state_bytes(m);
    if (state)
        fprintf(stderr,
                "loom serve: recurrent layers: %.1f %s of state per running sequence, twice "
                "that allocated per --batch slot (a checkpoint for speculation)\n",
                (double)state / (state < 1048576 ? 1024.0 : 1048576.0),
                state < 1048576 ? "KiB" : "MiB");
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
            served_reload(&srv, why, sizeof why);
        }
        served_reap(&srv);
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
    for (int i = 0; i < srv.n_slots; i++)
        if (srv.slots[i].live)
            loom_engine_stop(srv.slots[i].live->engine, (int)drain_s * 1000);
    for (int i = 0; i < srv.n_canaries; i++)
        loom_engine_stop(srv.canaries[i].sv->engine, (int)drain_s * 1000);
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
    /* every engine has stopped: their prefix caches are kept for the next start */
    for (int i = -1; prompt_cache_dir && i < srv.n_slots; i++) {
        served *sv = i < 0 ? srv.live : srv.slots[i].live;
        if (!sv)
            continue;
        if (loom_engine_save_prefixes(sv->engine, err, sizeof err) != 0)
            fprintf(stderr, "loom serve: keeping %s's prefix cache failed: %s\n",
                    sv->api.model_name, err);
        else
            fprintf(stderr, "loom serve: prefix cache %s\n", loom_engine_prefix_status(sv->engine));
    }
    srv.live->refs--;
    srv.live->next = srv.retired;
    srv.retired = srv.live;
    for (served *r = srv.retired, *next; r; r = next) {
        next = r->next;
        served_free(r);
    }
    for (int i = 0; i < srv.n_slots; i++) {
        if (srv.slots[i].live)
            served_free(srv.slots[i].live);
        free(srv.slots[i].name), free(srv.slots[i].path), free(srv.slots[i].options);
        free(srv.slots[i].owned[0]), free(srv.slots[i].owned[1]);
    }
    free(srv.slots);
    for (int i = 0; i < srv.n_canaries; i++) {
        served_free(srv.canaries[i].sv);
        free(srv.canaries[i].model), free(srv.canaries[i].path);
    }
    free(srv.promoted_path), free(srv.promoted_name);
    stored_clear(&srv);
    pthread_mutex_unlock(&srv.reload_lock);
    pthread_mutex_destroy(&srv.count_lock);
    sem_destroy(&srv.parsing);
    fprintf(stderr, "loom serve: stopped\n");
    return 0;
}
