/*
 * tools/openai_fields.h - reading an OpenAI request body's fields by the server's rules: a
 * refusal names the field and says what was wrong (the HTTP status and OpenAI's "param"), a
 * number must be in range, a field loom does not support is accepted only at its "off" value,
 * and an unknown field is refused.
 */
#ifndef LOOM_TOOLS_OPENAI_FIELDS_H
#define LOOM_TOOLS_OPENAI_FIELDS_H

#include "openai_request.h"

/* Fills b (status, param, message) and returns -1. */
int request_fail(bad *b, unsigned status, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* "a string", "a number", ... "null": what v is, for messages */
const char *json_type_name(const cJSON *v);
/* o's number `key` in [lo, hi] (whole when integer) into *out: 1; absent or null: 0; else -1
 * with b filled. */
int field_number(const cJSON *o, const char *key, double lo, double hi, int integer, double *out,
                 bad *b);
/* the same for a boolean */
int field_bool(const cJSON *o, const char *key, int *out, bad *b);
/* 0 when body's `key` (a field loom does not support) is absent or at its "off" value; else -1 */
int field_unsupported(const cJSON *body, const char *key, bad *b);
/* 0 when every field of body is in known (NULL-terminated) or, with sampling, one of the
 * sampling list's; else -1 naming the first other one */
int fields_known(const cJSON *body, const char *const *known, int sampling, bad *b);
/* 0 when every field of o (where: its place, "tools.0", or NULL for a body) is in known
 * (NULL-terminated); else -1 naming the first other one */
int fields_only(const cJSON *o, const char *const *known, const char *where, bad *b);
/* 0 when v (at where) is a list of objects; else -1 naming it, or its first other element (what:
 * "tool", "block": what an element is) */
int field_objects(const cJSON *v, const char *where, const char *what, bad *b);
/* o's string `key`: the string; NULL when absent (an error when required) or not a string (an
 * error), b filled then; where names o in the message */
const char *field_string(const cJSON *o, const char *key, int required, const char *where, bad *b);
/* The values in JSON text s (commas and containers outside strings, a count that cJSON's
 * nodes follow), counted up to past limit. */
size_t json_values(const char *s, size_t len, size_t limit);

#endif
