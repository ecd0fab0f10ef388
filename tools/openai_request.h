/*
 * tools/openai_request.h - an OpenAI completions / chat completions request body, checked and
 * turned into token ids and sampling settings for loom's engine (tools/serve/ answers it).
 */
#ifndef LOOM_TOOLS_OPENAI_REQUEST_H
#define LOOM_TOOLS_OPENAI_REQUEST_H

#include <loom/loom.h>

#include <cjson/cJSON.h>
#include <stddef.h>

#define OPENAI_MAX_CHOICES 8
#define OPENAI_MAX_STOPS 4
#define OPENAI_MAX_TOOLS 128

/* The served model as requests see it. */
typedef struct openai_model {
    loom_model *model;
    const char *model_name;
    const loom_chat_format *chat; /* how conversations become prompts */
    int32_t n_ctx;
    size_t max_prompt_bytes; /* longer prompt text cannot fit n_ctx: refused untokenized */
    /* special tokens ("<|im_start|>") written in message text or a prompt string are parsed
     * as such; off (the default), only the chat template's own are, so a user cannot forge
     * another role's turn */
    int parse_special;
    /* where a request's sampling starts: OpenAI's defaults (openai_default_sampling), or
     * what loom serve's sampling flags made of them */
    loom_sampling defaults;
    /* speculative decoding unless a request says otherwise: by prompt lookup (loom serve
     * --lookup: n-gram size, 0 off) or the engine's drafter model (draft: --draft), at most
     * draft_max proposals a step */
    int32_t lookup, draft_max;
    int draft;
    int32_t reasoning_budget; /* --reasoning-budget: a thought's tokens at most, 0 no limit */
} openai_model;

/* OpenAI's defaults on loom's: temperature 1, top_p 1, no top_k, no min_p. */
loom_sampling openai_default_sampling(void);

/* A valid request (ids malloc'd; stops point into the request's JSON). */
typedef struct parsed {
    int32_t *ids;
    int32_t n_ids;
    int32_t max_tokens; /* -1: to the end of the context */
    int max_tokens_given;
    int n, stream, include_usage;
    loom_sampling s;
    int seed_given;
    const char *stops[OPENAI_MAX_STOPS];
    int n_stops;
    const char *user; /* the request's "user" field, or NULL */
    int32_t priority; /* "priority": lower runs first (vLLM's field); 0 when absent */
    int priority_given;
    double timeout_s; /* "timeout": seconds the request may take; 0 when absent */
    /* chat with tools: their function names, the tools array the template was given (NULL:
     * none), and how the answer is read for calls (LOOM_TOOLS_NONE: it is all text) */
    char **tool_names;
    int n_tools;
    char *tools_json;
    loom_tool_syntax tool_syntax;
    int parallel_tool_calls; /* false: at most one call is returned */
    int logprobs;            /* each token's log-probability, and top_logprobs alternatives */
    int32_t top_logprobs;
    int reasoning;             /* 0: answers are all content; 1: they may open with a thought
                                (<think>...</think>); 2: the prompt opened it already */
    int32_t reasoning_budget;  /* the thought's tokens at most (loom_request's): the server's,
                                reasoning_effort's or reasoning_budget's; 0: no limit */
    loom_grammar *grammar;     /* what the answer must match (response_format, grammar, a
                                required call), or NULL */
    const char *grammar_param; /* the field it came from */
    int32_t lookup, draft_max; /* "speculative" (loom's): the server's unless given */
    int draft;
} parsed;

/* Why a request is refused, in OpenAI's terms. */
typedef struct bad {
    char msg[512];
    char param_buf[64]; /* a copy: the request's JSON is gone when the error is sent */
    const char *param;
    const char *code;
    unsigned status;
} bad;

/* Parses a request body as JSON, strictly: UTF-8 throughout, no NUL byte raw or escaped as
 * \u0000 in a string (loom's text is C strings), nothing but whitespace after the object,
 * at most max_values values (counted before the tree is built). NULL with b filled when it
 * is not. */
cJSON *openai_parse_body(const char *body, size_t len, size_t max_values, bad *b);
/* The JSON values a request may hold: a prompt of ids holds at most a context's worth, the rest
 * of a request is small. Tool calls' arguments (JSON inside a string) count against it too. */
size_t openai_max_values(int32_t n_ctx);

/* Checks and reads body (chat: /v1/chat/completions). 0, or -1 with b filled. */
int openai_parse_request(const openai_model *srv, const cJSON *body, int chat, parsed *p, bad *b);

/* Frees what a parse allocated (ids, tool names, tools). */
void openai_parsed_free(parsed *p);

/* A valid /v1/embeddings request: its inputs' token ids (malloc'd) and how to answer. */
#define OPENAI_MAX_INPUTS 2048
/* numbers in one /v1/embeddings answer, all inputs together (16 MB as float32, about 48 MB as
 * JSON): 1024 inputs of a 4096-wide model */
#define OPENAI_MAX_EMBEDDING_VALUES (1 << 22)
typedef struct embed_input {
    int32_t *ids;
    int32_t n_ids;
} embed_input;
typedef struct embed_parsed {
    embed_input *inputs;
    int n_inputs;
    int64_t n_tokens;     /* over all inputs */
    loom_pooling pooling; /* "pooling": last (default) or mean, a loom extension */
    int normalize;        /* "normalize" (default true): scaled to length one */
    int base64;           /* "encoding_format": base64 (little-endian float32s) */
    const char *user;
    int32_t priority;
    int priority_given;
    double timeout_s;
} embed_parsed;

/* Checks and reads a /v1/embeddings body. 0, or -1 with b filled. */
int openai_parse_embeddings(const openai_model *srv, const cJSON *body, embed_parsed *p, bad *b);
void openai_embed_parsed_free(embed_parsed *p);

/* Appends n bytes to a growing NUL-terminated buffer; -1 when out of memory. */
int buf_append(char **buf, size_t *len, size_t *cap, const char *s, size_t n);

#endif
