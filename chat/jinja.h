/*
 * chat/jinja.h - the Jinja subset models' chat templates are written in, run as Hugging Face's
 * apply_chat_template runs them (chat/jinja.c says which subset and what limits hold).
 */
#ifndef LOOM_CHAT_JINJA_H
#define LOOM_CHAT_JINJA_H

#include <loom/loom.h>

#include <cjson/cJSON.h>
#include <stddef.h>

typedef struct jinja_template jinja_template;

/* What one render may use: past any of these it stops with an error naming the limit, so a
 * hostile template in a model file cannot hang or exhaust a server. 0: the default. */
typedef struct jinja_limits {
    size_t max_output; /* bytes rendered (default 16 MiB) */
    size_t max_memory; /* bytes of values the render makes (default 256 MiB) */
    long max_steps;    /* units of work: expressions evaluated, loop turns, items a filter
                        * compares, 64-byte runs of a string searched (default 20 million) */
    long max_ms;       /* a render's time (default 10000 ms) */
    int max_depth;     /* nested macro calls and expressions (default 200) */
} jinja_limits;

/* Parses a template. NULL with err ("line N: what is wrong") when it is not Jinja loom runs. */
jinja_template *jinja_compile(const char *src, char *err, size_t err_size);
void jinja_free(jinja_template *t);

/* Renders t with the variables of vars (a JSON object). Every string found under the top-level
 * names listed in untrusted (NULL-terminated; e.g. "messages", "tools") is a user's text: where
 * it lands in *out is recorded in *spans (malloc'd, in order; spans may be NULL), so tokenizing
 * the prompt never reads control tokens out of it. The template's own text, and what it derives
 * from trusted values, is not. Returns 0, or -1 with err (raise_exception's message, or
 * "line N: ..."). */
int jinja_render(const jinja_template *t, const cJSON *vars, const char *const *untrusted,
                 const jinja_limits *limits, char **out, size_t *out_len, loom_text_span **spans,
                 int *n_spans, char *err, size_t err_size);

#endif
