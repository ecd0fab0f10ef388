/*
 * tools/openai_fields.c - see openai_fields.h; and openai_parse_body, the JSON body within its
 * value budget.
 */
#define _GNU_SOURCE
#include "openai_fields.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

int request_fail(bad *b, unsigned status, const char *param, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b->msg, sizeof b->msg, fmt, ap);
    va_end(ap);
    b->param = NULL;
    if (param) {
        snprintf(b->param_buf, sizeof b->param_buf, "%s", param);
        b->param = b->param_buf;
    }
    b->status = status;
    return -1;
}

const char *json_type_name(const cJSON *v)
{
    return cJSON_IsString(v) ? "a string"
        : cJSON_IsNumber(v)  ? "a number"
        : cJSON_IsBool(v)    ? "a boolean"
        : cJSON_IsArray(v)   ? "an array"
        : cJSON_IsObject(v)  ? "an object"
                             : "null";
}

int field_number(const cJSON *o, const char *key, double lo, double hi, int integer, double *out,
                 bad *b)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!v || cJSON_IsNull(v))
        return 0;
    if (!cJSON_IsNumber(v))
        return request_fail(b, 400, key, "'%s' must be a number, not %s", key, json_type_name(v));
    double x = v->valuedouble;
    if (!isfinite(x) || x < lo || x > hi || (integer && x != floor(x)))
        return request_fail(b, 400, key, "'%s' must be %s from %g to %g; got %g", key,
                            integer ? "a whole number" : "a number", lo, hi, x);
    *out = x;
    return 1;
}

int field_bool(const cJSON *o, const char *key, int *out, bad *b)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!v || cJSON_IsNull(v))
        return 0;
    if (!cJSON_IsBool(v))
        return request_fail(b, 400, key, "'%s' must be a boolean, not %s", key, json_type_name(v));
    *out = cJSON_IsTrue(v);
    return 1;
}

/* Fields the OpenAI API defines that loom accepts only at their "off" value. */
int field_unsupported(const cJSON *body, const char *key, bad *b)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(body, key);
    if (!v || cJSON_IsNull(v) || cJSON_IsFalse(v) ||
        ((cJSON_IsObject(v) || cJSON_IsArray(v)) && !v->child))
        return 0;
    if (!strcmp(key, "response_format") && cJSON_IsObject(v)) {
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(v, "type");
        if (cJSON_IsString(t) && !strcmp(t->valuestring, "text"))
            return 0;
    }
    if (!strcmp(key, "best_of") && cJSON_IsNumber(v) && v->valuedouble == 1)
        return 0;
    return request_fail(b, 400, key, "'%s' is not supported by this server (loom)%s", key,
                        strncmp(key, "function", 8) ? ""
                                                    : "; send 'tools' (it replaced 'functions')");
}

/* the request fields of the sampling list (loom/sampling_fields.h), NULL-terminated */
#define JSON_KEY(kind, name, def, api_def, flag, alias, lo, hi, json, ...) json,
static const char *const sampling_keys[] = {LOOM_SAMPLING_FIELDS(JSON_KEY) NULL};
#undef JSON_KEY

/* Refuses a field that is neither in known (NULL-terminated) nor, with sampling, one of the
 * sampling list's. */
int fields_known(const cJSON *body, const char *const *known, int sampling, bad *b)
{
    for (const cJSON *f = body->child; f; f = f->next) {
        int ok = 0;
        for (int i = 0; known[i] && !ok; i++)
            ok = !strcmp(f->string, known[i]);
        for (size_t i = 0; sampling && i < sizeof sampling_keys / sizeof *sampling_keys && !ok; i++)
            ok = sampling_keys[i] && !strcmp(f->string, sampling_keys[i]);
        if (!ok)
            return request_fail(b, 400, f->string, "Unrecognized request argument supplied: %s",
                                f->string);
    }
    return 0;
}

int fields_only(const cJSON *o, const char *const *known, const char *where, bad *b)
{
    for (const cJSON *f = o->child; f; f = f->next) {
        int ok = 0;
        for (int i = 0; known[i] && !ok; i++)
            ok = !strcmp(f->string, known[i]);
        if (!ok)
            return request_fail(b, 400, where ? where : f->string,
                                "%s%s%s: unknown field (loom does not take it here)",
                                where ? where : "", where ? "." : "", f->string);
    }
    return 0;
}

int field_objects(const cJSON *v, const char *where, const char *what, bad *b)
{
    if (!cJSON_IsArray(v))
        return request_fail(b, 400, where, "%s: must be a list of %ss, not %s", where, what,
                            json_type_name(v));
    int k = 0;
    for (const cJSON *e = v->child; e; e = e->next, k++)
        if (!cJSON_IsObject(e)) {
            char at[96];
            snprintf(at, sizeof at, "%s.%d", where, k);
            return request_fail(b, 400, at, "%s: must be a %s (an object), not %s", at, what,
                                json_type_name(e));
        }
    return 0;
}

const char *field_string(const cJSON *o, const char *key, int required, const char *where, bad *b)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (cJSON_IsString(v))
        return v->valuestring;
    if (v || required)
        request_fail(b, 400, where, "%s.%s: %s", where, key,
                     v ? "must be a string" : "Field required");
    return NULL;
}

/* The values in JSON text s (commas and containers outside strings, a count that cJSON's
 * nodes follow), counted up to past limit. */
size_t json_values(const char *s, size_t len, size_t limit)
{
    size_t values = 0;
    for (size_t i = 0, in_string = 0; i < len && values <= limit; i++) {
        if (s[i] == '"')
            in_string = !in_string;
        else if (!in_string && (s[i] == ',' || s[i] == '[' || s[i] == '{'))
            values++;
        else if (in_string && s[i] == '\\')
            i++; /* the escaped character, which may be a quote */
    }
    return values;
}

cJSON *openai_parse_body(const char *body, size_t len, size_t max_values, bad *b)
{
    const char *nul = memchr(body, '\0', len);
    if (nul) {
        request_fail(b, 400, NULL, "the request body contains a NUL byte (at byte %zu)",
                     (size_t)(nul - body));
        return NULL;
    }
    size_t valid = loom_utf8_valid_prefix(body, len);
    if (valid < len) {
        request_fail(b, 400, NULL,
                     "the request body is not valid UTF-8 (at byte %zu); JSON text must be "
                     "UTF-8",
                     valid);
        return NULL;
    }
    /* cJSON spends a node of ~64 bytes on each value, so a 1 MB "prompt": [1, 1, ...] would
     * cost 30 MB before any check could look at it: they are counted first */
    if (json_values(body, len, max_values) > max_values) {
        request_fail(b, 400, NULL,
                     "the request holds more than %zu JSON values (a prompt of token ids "
                     "longer than the context cannot run anyway)",
                     max_values);
        return NULL;
    }
    /* \u0000 in a string would end loom's copy of it early: the prompt "\u0000hello" would
     * silently become empty */
    for (size_t i = 0, in_string = 0; i < len; i++) {
        if (body[i] == '"') {
            in_string = !in_string;
        } else if (in_string && body[i] == '\\' && i + 1 < len) {
            if (body[i + 1] == 'u' && i + 5 < len && !memcmp(body + i + 2, "0000", 4)) {
                request_fail(b, 400, NULL,
                             "a string in the request holds U+0000 (\\u0000, at byte %zu); "
                             "loom does not accept NUL characters in text",
                             i);
                return NULL;
            }
            i++; /* the escaped character, which may be a quote */
        }
    }
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(body, len, &end, 0);
    if (!root) {
        const char *at = cJSON_GetErrorPtr();
        request_fail(b, 400, NULL, "the request body is not valid JSON (near byte %ld)",
                     at && at >= body && at <= body + len ? (long)(at - body) : 0L);
        return NULL;
    }
    for (const char *q = end; q && q < body + len; q++)
        if (*q != ' ' && *q != '\t' && *q != '\n' && *q != '\r') {
            cJSON_Delete(root);
            request_fail(b, 400, NULL,
                         "unexpected data after the JSON value (at byte %ld); send one object",
                         (long)(q - body));
            return NULL;
        }
    return root;
}
