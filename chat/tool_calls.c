/*
 * chat/tool_calls.c - reading the tool calls a model wrote in its answer, in its family's own
 * syntax (see loom_tool_syntax in loom.h), and telling a stream how much of an unfinished
 * answer is surely text.
 *
 * A call is taken only when it is whole: its JSON parses, its arguments are an object, and
 * (when the request named its functions) its name is one of them. Anything else stays text, so
 * a model that writes "<tool_call>" in prose, or stops in the middle of a call, is answered
 * with what it wrote rather than with a broken call.
 */
#define _GNU_SOURCE
#include "api/internal.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

static const char *const syntax_names[] = {
    [LOOM_TOOLS_NONE] = "none",       [LOOM_TOOLS_UNKNOWN] = "unknown",
    [LOOM_TOOLS_HERMES] = "hermes",   [LOOM_TOOLS_LLAMA3] = "llama3",
    [LOOM_TOOLS_MISTRAL] = "mistral", [LOOM_TOOLS_GLM4] = "glm4",
    [LOOM_TOOLS_GLM45] = "glm4.5",
};

const char *loom_tool_syntax_name(loom_tool_syntax s)
{
    return (unsigned)s < sizeof syntax_names / sizeof *syntax_names ? syntax_names[s] : "?";
}

loom_tool_syntax loom_tool_syntax_of_template(const char *jinja)
{
    if (strstr(jinja, "<arg_key>"))
        return LOOM_TOOLS_GLM45;
    if (strstr(jinja, "<tool_call>"))
        return LOOM_TOOLS_HERMES;
    if (strstr(jinja, "[TOOL_CALLS]"))
        return LOOM_TOOLS_MISTRAL;
    if (strstr(jinja, "<|python_tag|>") ||
        (strstr(jinja, "<|start_header_id|>") && strstr(jinja, "tools")))
        return LOOM_TOOLS_LLAMA3;
    if (strstr(jinja, "<|observation|>") && strstr(jinja, "tools"))
        return LOOM_TOOLS_GLM4;
    return strstr(jinja, "tools") ? LOOM_TOOLS_UNKNOWN : LOOM_TOOLS_NONE;
}

void loom_tool_calls_free(loom_tool_calls *c)
{
    for (int i = 0; i < c->n_calls; i++)
        free(c->calls[i].name), free(c->calls[i].arguments), free(c->calls[i].id);
    free(c->calls);
    memset(c, 0, sizeof *c);
}

static const char *skip_space(const char *p, const char *end)
{
    while (p < end && (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r'))
        p++;
    return p;
}

static int starts(const char *p, const char *end, const char *word)
{
    size_t n = strlen(word);
    return (size_t)(end - p) >= n && !memcmp(p, word, n);
}

static const char *find(const char *p, const char *end, const char *word)
{
    return memmem(p, (size_t)(end - p), word, strlen(word));
}

static int known_name(const char *name, size_t len, const char *const *names, int n_names)
{
    if (len == 0)
        return 0;
    if (n_names == 0)
        return 1;
    for (int i = 0; i < n_names; i++)
        if (strlen(names[i]) == len && !memcmp(names[i], name, len))
            return 1;
    return 0;
}

/* Adds a call; args (taken) is an object, or a string holding one. 0, or -1 when it is not a
 * call (the name unknown, the arguments not an object) or out of memory. */
static int add_call(loom_tool_calls *out, const char *name, size_t name_len, cJSON *args,
                    const char *id, const char *const *names, int n_names)
{
    if (args && cJSON_IsString(args)) { /* some write the arguments as a JSON string */
        cJSON *inner = cJSON_Parse(args->valuestring);
        cJSON_Delete(args);
        args = inner;
    }
    if (!args)
        args = cJSON_CreateObject();
    int ok = args && cJSON_IsObject(args) && known_name(name, name_len, names, n_names) &&
        !memchr(name, 0, name_len);
    loom_tool_call *grown = ok ? realloc(out->calls, (size_t)(out->n_calls + 1) * sizeof *grown)
                               : NULL;
    if (grown) {
        out->calls = grown;
        loom_tool_call *c = &out->calls[out->n_calls];
        c->name = strndup(name, name_len);
        c->arguments = cJSON_PrintUnformatted(args);
        c->id = id ? strdup(id) : NULL;
        out->n_calls++;
        ok = c->name && c->arguments && (!id || c->id);
    }
    cJSON_Delete(args);
    return ok && grown ? 0 : -1;
}

/* One JSON value at p (before end); *next after it. NULL when none parses. */
static cJSON *json_at(const char *p, const char *end, const char **next)
{
    const char *after = NULL;
    cJSON *v = cJSON_ParseWithLengthOpts(p, (size_t)(end - p), &after, 0);
    if (v)
        *next = after;
    return v;
}

/* {"name": ..., "arguments" (or "parameters"): {...}, "id"?}: a call. */
static int add_json_call(loom_tool_calls *out, cJSON *o, const char *const *names, int n_names)
{
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(o, "name");
    cJSON *fn = cJSON_GetObjectItemCaseSensitive(o, "function");
    if (!cJSON_IsString(name) && cJSON_IsObject(fn)) /* {"type": "function", "function": {..}} */
        o = fn, name = cJSON_GetObjectItemCaseSensitive(o, "name");
    if (!cJSON_IsString(name))
        return -1;
    cJSON *args = cJSON_DetachItemFromObjectCaseSensitive(o, "arguments");
    if (!args)
        args = cJSON_DetachItemFromObjectCaseSensitive(o, "parameters");
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(o, "id");
    return add_call(out, name->valuestring, strlen(name->valuestring), args,
                    cJSON_IsString(id) ? id->valuestring : NULL, names, n_names);
}

/* <tool_call>{json}</tool_call> ... from p on. */
static int parse_hermes(const char *p, const char *end, const char *const *names, int n_names,
                        loom_tool_calls *out)
{
    while ((p = skip_space(p, end)) < end) {
        if (!starts(p, end, "<tool_call>"))
            return out->n_calls ? 0 : -1; /* text after the calls: left out */
        p = skip_space(p + strlen("<tool_call>"), end);
        const char *close = find(p, end, "</tool_call>");
        const char *stop = close ? close : end; /* a model may end at EOS before closing */
        const char *next = NULL;
        cJSON *o = json_at(p, stop, &next);
        int rc = o && skip_space(next, stop) == stop ? add_json_call(out, o, names, n_names) : -1;
        cJSON_Delete(o);
        if (rc && !o && !close && out->n_calls)
            return 0; /* the answer was cut inside a later call: the whole ones stand */
        if (rc)
            return -1;
        p = close ? close + strlen("</tool_call>") : end;
    }
    return 0;
}

/* {"name": ..., "parameters": {...}} objects, separated by ';' (Llama 3.x). */
static int parse_llama3(const char *p, const char *end, const char *const *names, int n_names,
                        loom_tool_calls *out)
{
    for (;;) {
        p = skip_space(p, end);
        const char *next = NULL;
        cJSON *o = p < end && *p == '{' ? json_at(p, end, &next) : NULL;
        int rc = o ? add_json_call(out, o, names, n_names) : -1;
        cJSON_Delete(o);
        if (rc && !o && p < end && *p == '{' && out->n_calls)
            return 0; /* cut inside a later call (its JSON unfinished): the whole ones stand */
        if (rc)
            return -1;
        p = skip_space(next, end);
        if (p == end)
            return 0;
        if (*p != ';')
            return -1;
        p++;
    }
}

/* [TOOL_CALLS][{...}, ...] (v3) or [TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]... (v11 and later). */
static int parse_mistral(const char *p, const char *end, const char *const *names, int n_names,
                         loom_tool_calls *out)
{
    while ((p = skip_space(p, end)) < end) {
        if (!starts(p, end, "[TOOL_CALLS]"))
            return out->n_calls ? 0 : -1;
        p = skip_space(p + strlen("[TOOL_CALLS]"), end);
        const char *next = NULL;
        if (p < end && *p == '[') {
            cJSON *a = json_at(p, end, &next);
            int rc = cJSON_IsArray(a) && a->child ? 0 : -1;
            for (cJSON *o = a ? a->child : NULL; o && !rc; o = o->next)
                rc = cJSON_IsObject(o) ? add_json_call(out, o, names, n_names) : -1;
            cJSON_Delete(a);
            if (rc)
                return -1;
            p = next;
            continue;
        }
        const char *args = find(p, end, "[ARGS]");
        const char *name_end = args;
        const char *call_id = find(p, args ? args : end, "[CALL_ID]");
        if (!args)
            return -1;
        if (call_id)
            name_end = call_id;
        cJSON *o = json_at(args + strlen("[ARGS]"), end, &next);
        if (!o || add_call(out, p, (size_t)(name_end - p), o, NULL, names, n_names))
            return -1;
        p = next;
    }
    return 0;
}

/* name\n{...} at the start of the answer (GLM-4's own form). */
static int parse_glm4(const char *p, const char *end, const char *const *names, int n_names,
                      loom_tool_calls *out)
{
    const char *nl = memchr(p, '\n', (size_t)(end - p));
    if (!nl || n_names == 0 || !known_name(p, (size_t)(nl - p), names, n_names))
        return -1;
    const char *next = NULL;
    cJSON *o = json_at(nl + 1, end, &next);
    if (!o || skip_space(next, end) != end)
        return cJSON_Delete(o), -1;
    return add_call(out, p, (size_t)(nl - p), o, NULL, names, n_names);
}

/* the text between open and close (or the end), trimmed, into *s, *n */
static const char *tagged(const char *p, const char *end, const char *open, const char *close,
                          const char **s, size_t *n)
{
    if (!starts(p, end, open))
        return NULL;
    p += strlen(open);
    const char *c = find(p, end, close);
    if (!c)
        return NULL;
    *s = p, *n = (size_t)(c - p);
    return c + strlen(close);
}

/* <tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call> (GLM-4.5): a value
 * that parses as JSON is that value, any other is a string. */
static int parse_glm45(const char *p, const char *end, const char *const *names, int n_names,
                       loom_tool_calls *out)
{
    while ((p = skip_space(p, end)) < end) {
        if (!starts(p, end, "<tool_call>"))
            return out->n_calls ? 0 : -1;
        p += strlen("<tool_call>");
        const char *close = find(p, end, "</tool_call>");
        const char *stop = close ? close : end;
        const char *key = find(p, stop, "<arg_key>");
        const char *name_end = key ? key : stop;
        const char *name = skip_space(p, name_end);
        while (name_end > name && (name_end[-1] == ' ' || name_end[-1] == '\n'))
            name_end--;
        cJSON *args = cJSON_CreateObject();
        for (p = key ? key : stop; args && (p = skip_space(p, stop)) < stop;) {
            const char *k, *v;
            size_t kn, vn;
            p = tagged(p, stop, "<arg_key>", "</arg_key>", &k, &kn);
            p = p ? tagged(skip_space(p, stop), stop, "<arg_value>", "</arg_value>", &v, &vn)
                  : NULL;
            char *kz = p ? strndup(k, kn) : NULL, *vz = p ? strndup(v, vn) : NULL;
            cJSON *val = vz ? cJSON_Parse(vz) : NULL;
            if (vz && !val)
                val = cJSON_CreateString(vz);
            if (!kz || !val || cJSON_GetObjectItemCaseSensitive(args, kz)) {
                cJSON_Delete(val);
                cJSON_Delete(args);
                args = NULL;
                p = stop;
            } else {
                cJSON_AddItemToObject(args, kz, val);
            }
            free(kz), free(vz);
        }
        if (!args || add_call(out, name, (size_t)(name_end - name), args, NULL, names, n_names))
            return -1;
        p = close ? close + strlen("</tool_call>") : end;
    }
    return 0;
}

/* Where the calls of an answer begin (len: none), for the syntaxes a marker opens. */
static const char *marker_of(loom_tool_syntax s)
{
    switch (s) {
    case LOOM_TOOLS_HERMES:
    case LOOM_TOOLS_GLM45: return "<tool_call>";
    case LOOM_TOOLS_MISTRAL: return "[TOOL_CALLS]";
    case LOOM_TOOLS_LLAMA3: return "<|python_tag|>";
    default: return NULL;
    }
}

int loom_tool_calls_parse(loom_tool_syntax s, const char *text, size_t len,
                          const char *const *names, int n_names, loom_tool_calls *out)
{
    memset(out, 0, sizeof *out);
    out->content_len = len;
    const char *end = text + len, *start = NULL;
    const char *marker = marker_of(s);
    const char *lead = skip_space(text, end);
    if (s == LOOM_TOOLS_LLAMA3 && lead < end && *lead == '{')
        start = lead; /* Llama 3.x answers with a bare JSON call */
    else if (s == LOOM_TOOLS_GLM4)
        start = lead;
    else if (marker)
        start = find(text, end, marker);
    if (!start)
        return 0;
    int rc;
    switch (s) {
    case LOOM_TOOLS_HERMES: rc = parse_hermes(start, end, names, n_names, out); break;
    case LOOM_TOOLS_LLAMA3:
        rc = parse_llama3(starts(start, end, marker) ? start + strlen(marker) : start, end, names,
                          n_names, out);
        break;
    case LOOM_TOOLS_MISTRAL: rc = parse_mistral(start, end, names, n_names, out); break;
    case LOOM_TOOLS_GLM4: rc = parse_glm4(start, end, names, n_names, out); break;
    case LOOM_TOOLS_GLM45: rc = parse_glm45(start, end, names, n_names, out); break;
    default: rc = -1;
    }
    if (rc || out->n_calls == 0) { /* not calls after all: the answer is text */
        loom_tool_calls_free(out);
        out->content_len = len;
        return 0;
    }
    /* the text before the calls, without the whitespace that led up to them */
    while (start > text &&
           (start[-1] == ' ' || start[-1] == '\n' || start[-1] == '\t' || start[-1] == '\r'))
        start--;
    out->content_len = (size_t)(start - text);
    return 0;
}

/* how many bytes at the end of text could be the start of word */
static size_t partial_suffix(const char *text, size_t len, const char *word)
{
    size_t w = strlen(word);
    for (size_t k = w - 1 < len ? w - 1 : len; k > 0; k--)
        if (!memcmp(text + len - k, word, k))
            return k;
    return 0;
}

static size_t text_before_calls(loom_tool_syntax s, const char *text, size_t len,
                                const char *const *names, int n_names)
{
    const char *end = text + len, *lead = skip_space(text, end);
    if (s == LOOM_TOOLS_LLAMA3 || s == LOOM_TOOLS_GLM4) {
        if (lead == end)
            return 0; /* only whitespace yet: a call may follow */
        if (s == LOOM_TOOLS_LLAMA3 && *lead == '{')
            return 0;
    }
    if (s == LOOM_TOOLS_GLM4) { /* a first line that is (or may become) a function's name */
        const char *nl = memchr(lead, '\n', (size_t)(end - lead));
        size_t n = (size_t)((nl ? nl : end) - lead);
        for (int i = 0; i < n_names; i++)
            if (nl ? strlen(names[i]) == n && !memcmp(names[i], lead, n)
                   : strlen(names[i]) >= n && !memcmp(names[i], lead, n))
                return 0;
        return len;
    }
    const char *marker = marker_of(s);
    if (!marker)
        return len;
    const char *at = find(text, end, marker);
    if (at)
        return (size_t)(at - text);
    return len - partial_suffix(text, len, marker);
}

size_t loom_tool_calls_text_prefix(loom_tool_syntax s, const char *text, size_t len,
                                   const char *const *names, int n_names)
{
    /* whitespace that may lead up to a call waits too: a parsed answer's text ends without it */
    size_t n = text_before_calls(s, text, len, names, n_names);
    while (
        n &&
        (text[n - 1] == ' ' || text[n - 1] == '\n' || text[n - 1] == '\t' || text[n - 1] == '\r'))
        n--;
    return n;
}

/* ---- calls the model must make (tool_choice "required" or a named function) --------------- */

/* the JSON Schema of one call object: {"name": NAME, KEY: its parameters} */
static cJSON *call_schema(const cJSON *fn, const char *args_key)
{
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(fn, "name");
    const cJSON *params = cJSON_GetObjectItemCaseSensitive(fn, "parameters");
    cJSON *s = cJSON_CreateObject(), *props = cJSON_AddObjectToObject(s, "properties");
    cJSON_AddStringToObject(s, "type", "object");
    cJSON_AddStringToObject(cJSON_AddObjectToObject(props, "name"), "const", name->valuestring);
    if (cJSON_IsObject(params) && params->child)
        cJSON_AddItemToObject(props, args_key, cJSON_Duplicate(params, 1));
    else
        cJSON_AddStringToObject(cJSON_AddObjectToObject(props, args_key), "type", "object");
    cJSON *req = cJSON_AddArrayToObject(s, "required");
    cJSON_AddItemToArray(req, cJSON_CreateString("name"));
    cJSON_AddItemToArray(req, cJSON_CreateString(args_key));
    cJSON_AddFalseToObject(s, "additionalProperties");
    return s;
}

char *loom_tool_calls_gbnf(loom_tool_syntax s, const char *tools_json, const char *only,
                           int parallel, char *err, size_t err_size)
{
    const char *root, *args_key = "arguments";
    switch (s) { /* %d: how many more calls may follow the first */
    case LOOM_TOOLS_HERMES:
        root = "root ::= one (\"\\n\" one){0,%d}\none ::= \"<tool_call>\\n\" call "
               "\"\\n</tool_call>\"\n";
        break;
    case LOOM_TOOLS_LLAMA3:
        root = "root ::= call (\"; \" call){0,%d}\n", args_key = "parameters";
        break;
    case LOOM_TOOLS_MISTRAL:
        root = "root ::= \"[TOOL_CALLS][\" call (\", \" call){0,%d} \"]\"\n";
        break;
    default:
        snprintf(err, err_size,
                 "a call the model must make is not supported for the %s syntax yet (hermes, "
                 "llama3 and mistral are)",
                 loom_tool_syntax_name(s));
        return NULL;
    }
    cJSON *tools = cJSON_Parse(tools_json), *any = cJSON_CreateObject();
    cJSON *alts = cJSON_AddArrayToObject(any, "anyOf");
    for (const cJSON *t = tools ? tools->child : NULL; t; t = t->next) {
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(t, "function");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(fn, "name");
        if (cJSON_IsString(name) && (!only || !strcmp(name->valuestring, only)))
            cJSON_AddItemToArray(alts, call_schema(fn, args_key));
    }
    char *schema = alts->child ? cJSON_PrintUnformatted(any) : NULL;
    cJSON_Delete(tools);
    cJSON_Delete(any);
    if (!schema) {
        snprintf(err, err_size, "no function to call");
        return NULL;
    }
    char why[400];
    char *call = loom_json_schema_to_gbnf(schema, why, sizeof why);
    free(schema);
    if (!call) {
        snprintf(err, err_size, "a function's parameters: %s", why);
        return NULL;
    }
    /* the schema's grammar becomes rule "call"; root writes one call, or up to 8 */
    size_t n = strlen(call) + 512;
    char *out = malloc(n);
    if (out) {
        int k = snprintf(out, n, root, parallel ? 7 : 0);
        snprintf(out + k, n - (size_t)k, "call%s", call + strlen("root"));
    }
    free(call);
    if (!out)
        snprintf(err, err_size, "out of memory");
    return out;
}

/* ---- reasoning ---------------------------------------------------------------------------- */

void loom_reasoning_find(const char *text, size_t len, int starts_inside, int done,
                         loom_reasoning *r)
{
    const char *end = text + len, *p = text;
    memset(r, 0, sizeof *r);
    if (!starts_inside) {
        p = skip_space(text, end);
        if (p == end && !done) { /* only whitespace yet: a thought may open */
            r->open = 1;
            return;
        }
        if (!starts(p, end, "<think>")) {
            if (!done && (size_t)(end - p) < strlen("<think>") &&
                !memcmp(p, "<think>", (size_t)(end - p))) { /* "<thi" may become "<think>" */
                r->open = 1;
                return;
            }
            return; /* no reasoning: all of it is the answer */
        }
        p += strlen("<think>");
    }
    r->start = (size_t)(p - text);
    const char *close = find(p, end, "</think>");
    if (!close) {
        r->open = 1;
        r->end = done ? len : len - partial_suffix(text, len, "</think>");
        r->content = len;
        if (r->end < r->start)
            r->end = r->start;
        return;
    }
    r->end = (size_t)(close - text);
    r->content = (size_t)(skip_space(close + strlen("</think>"), end) - text);
}
