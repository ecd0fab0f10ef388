/*
 * tools/openai_request.c - see openai_request.h. Field rules follow the OpenAI API as the
 * official clients send it: unknown fields are refused, fields loom does not support are
 * accepted only at their "off" value, numbers are range-checked, and OpenAI's defaults apply.
 */
#define _GNU_SOURCE
#include "openai_fields.h"

#include <ctype.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int buf_append(char **buf, size_t *len, size_t *cap, const char *s, size_t n)
{
    if (*len + n + 1 > *cap) {
        size_t c = (*len + n + 1) * 2;
        char *nb = realloc(*buf, c);
        if (!nb)
            return -1;
        *buf = nb, *cap = c;
    }
    memcpy(*buf + *len, s, n);
    *len += n;
    (*buf)[*len] = 0;
    return 0;
}

size_t openai_max_values(int32_t n_ctx)
{
    return 2 * (size_t)n_ctx + 4096;
}

/* Tokenizes text into p->ids. rendered: a chat template's output, whose special tokens are
 * parsed except inside the messages' own text (the plain spans); otherwise the client's own
 * text, plain throughout. --parse-special parses special tokens everywhere. add_special: the
 * family's BOS goes first (not for a Jinja template's output, which writes its own). */
static int tokenize_text(const openai_model *srv, const char *text, int rendered, int add_special,
                         const loom_text_span *plain, int n_plain, parsed *p, bad *b,
                         const char *param)
{
    size_t len = strlen(text);
    if (len > srv->max_prompt_bytes) {
        b->code = "context_length_exceeded";
        return request_fail(
            b, 400, param,
            "This model's maximum context length is %d tokens, and the "
            "prompt has %zu bytes: more than any %d tokens of this vocabulary spell "
            "(%zu bytes at most). Please reduce the prompt.",
            srv->n_ctx, len, srv->n_ctx, srv->max_prompt_bytes);
    }
    char err[512];
    int special = srv->parse_special || rendered ? LOOM_SPECIAL_ALL : LOOM_SPECIAL_NONE;
    int64_t n = loom_tokenize_spans(srv->model, text, len, add_special, special,
                                    srv->parse_special ? NULL : plain,
                                    srv->parse_special ? 0 : n_plain, NULL, 0, err, sizeof err);
    if (n < 0)
        return request_fail(b, 500, NULL, "%s", err);
    p->ids = malloc((size_t)(n > 0 ? n : 1) * sizeof *p->ids);
    if (!p->ids)
        return request_fail(b, 500, NULL, "out of memory");
    p->n_ids = (int32_t)loom_tokenize_spans(
        srv->model, text, len, add_special, special, srv->parse_special ? NULL : plain,
        srv->parse_special ? 0 : n_plain, p->ids, n, err, sizeof err);
    return 0;
}

/* A chat message's content: a string, or an array of {"type": "text", "text": ...} parts. */
static char *message_text(const cJSON *content, int index, bad *b)
{
    if (cJSON_IsString(content)) {
        char *s = strdup(content->valuestring);
        if (!s)
            request_fail(b, 500, NULL, "out of memory");
        return s;
    }
    if (!cJSON_IsArray(content)) {
        request_fail(b, 400, "messages",
                     "messages[%d].content must be a string or an array of text parts", index);
        return NULL;
    }
    size_t len = 0, cap = 0;
    char *s = NULL;
    if (buf_append(&s, &len, &cap, "", 0) != 0) {
        request_fail(b, 500, NULL, "out of memory");
        return NULL;
    }
    for (const cJSON *part = content->child; part; part = part->next) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(part, "text");
        if (!cJSON_IsString(type) || strcmp(type->valuestring, "text") || !cJSON_IsString(text)) {
            free(s);
            request_fail(b, 400, "messages", "messages[%d].content: only text parts are supported",
                         index);
            return NULL;
        }
        if (buf_append(&s, &len, &cap, text->valuestring, strlen(text->valuestring)) != 0) {
            free(s);
            request_fail(b, 500, NULL, "out of memory");
            return NULL;
        }
    }
    return s;
}

/* An assistant message's tool_calls as a template reads them: arguments as the object their
 * JSON text holds (what transformers' templates expect), not as a string. */
static cJSON *template_tool_calls(const cJSON *calls, int index, size_t *values_left, bad *b)
{
    if (!cJSON_IsArray(calls) || !calls->child) {
        request_fail(b, 400, "messages", "messages[%d].tool_calls must be a non-empty array",
                     index);
        return NULL;
    }
    cJSON *out = cJSON_CreateArray();
    int k = 0;
    for (const cJSON *c = calls->child; c && out; c = c->next, k++) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(c, "id");
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(c, "function");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(fn, "name");
        const cJSON *args = cJSON_GetObjectItemCaseSensitive(fn, "arguments");
        /* the arguments' values count against the request's, as if they were in the body */
        size_t n_values = cJSON_IsString(args)
            ? json_values(args->valuestring, strlen(args->valuestring), *values_left)
            : 0;
        if (n_values > *values_left) {
            cJSON_Delete(out);
            request_fail(
                b, 400, "messages",
                "messages[%d].tool_calls[%d].function.arguments: the request's tool calls' "
                "arguments hold more JSON values than a request may (2 x the context + 4096)",
                index, k);
            return NULL;
        }
        *values_left -= n_values;
        cJSON *obj = cJSON_IsString(args) ? cJSON_Parse(args->valuestring) : NULL;
        const char *why = !cJSON_IsObject(c)                 ? "must be an object"
            : id && !cJSON_IsString(id)                      ? "id must be a string"
            : !cJSON_IsObject(fn)                            ? "needs a 'function' object"
            : !cJSON_IsString(name) || !name->valuestring[0] ? "function.name must be a string"
            : !cJSON_IsString(args)                          ? "function.arguments must be a string"
            : !cJSON_IsObject(obj) ? "function.arguments must be a JSON object's text"
                                   : NULL;
        if (why) {
            cJSON_Delete(obj);
            cJSON_Delete(out);
            request_fail(b, 400, "messages", "messages[%d].tool_calls[%d].%s", index, k, why);
            return NULL;
        }
        cJSON *t = cJSON_CreateObject(), *f = cJSON_AddObjectToObject(t, "function");
        if (id)
            cJSON_AddStringToObject(t, "id", id->valuestring);
        cJSON_AddStringToObject(t, "type", "function");
        cJSON_AddStringToObject(f, "name", name->valuestring);
        cJSON_AddItemToObject(f, "arguments", obj);
        cJSON_AddItemToArray(out, t);
    }
    if (!out)
        request_fail(b, 500, NULL, "out of memory");
    return out;
}

/* messages as the chat template sees them: roles checked (developer is system), content as a
 * string (null beside tool calls), an assistant's tool_calls, a tool result's tool_call_id */
static cJSON *template_messages(const cJSON *msgs, size_t max_values, bad *b)
{
    size_t values_left = max_values;
    cJSON *out = cJSON_CreateArray();
    int i = 0;
    for (const cJSON *x = msgs->child; x && out; x = x->next, i++) {
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(x, "role");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(x, "content");
        const cJSON *calls = cJSON_GetObjectItemCaseSensitive(x, "tool_calls");
        const cJSON *call_id = cJSON_GetObjectItemCaseSensitive(x, "tool_call_id");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(x, "name");
        if (!cJSON_IsObject(x) || !cJSON_IsString(role)) {
            request_fail(b, 400, "messages", "messages[%d] must be an object with a string 'role'",
                         i);
            cJSON_Delete(out);
            return NULL;
        }
        const char *r = role->valuestring;
        if (!strcmp(r, "developer"))
            r = "system";
        int assistant = !strcmp(r, "assistant"), tool = !strcmp(r, "tool");
        if (strcmp(r, "system") && strcmp(r, "user") && !assistant && !tool) {
            request_fail(
                b, 400, "messages",
                "messages[%d].role '%s' is not one of system, developer, user, assistant, tool", i,
                role->valuestring);
            cJSON_Delete(out);
            return NULL;
        }
        if (calls && !cJSON_IsNull(calls) && !assistant) {
            request_fail(b, 400, "messages",
                         "messages[%d]: only an assistant message has tool_calls", i);
            cJSON_Delete(out);
            return NULL;
        }
        if (tool && (!cJSON_IsString(call_id) || !call_id->valuestring[0])) {
            request_fail(b, 400, "messages",
                         "messages[%d]: a tool message needs 'tool_call_id', the id of the call it "
                         "answers",
                         i);
            cJSON_Delete(out);
            return NULL;
        }
        if (name && !cJSON_IsNull(name) && !cJSON_IsString(name)) {
            request_fail(b, 400, "messages", "messages[%d].name must be a string", i);
            cJSON_Delete(out);
            return NULL;
        }
        cJSON *m = cJSON_CreateObject();
        cJSON_AddItemToArray(out, m);
        cJSON_AddStringToObject(m, "role", r);
        int has_calls = calls && !cJSON_IsNull(calls);
        if ((!content || cJSON_IsNull(content)) && assistant && has_calls) {
            cJSON_AddNullToObject(m, "content");
        } else {
            char *text = message_text(content, i, b);
            if (!text) {
                cJSON_Delete(out);
                return NULL;
            }
            cJSON_AddStringToObject(m, "content", text);
            free(text);
        }
        if (cJSON_IsString(name))
            cJSON_AddStringToObject(m, "name", name->valuestring);
        const cJSON *thought = cJSON_GetObjectItemCaseSensitive(x, "reasoning_content");
        if (assistant && cJSON_IsString(thought)) /* a thought given back, for the template */
            cJSON_AddStringToObject(m, "reasoning_content", thought->valuestring);
        if (tool)
            cJSON_AddStringToObject(m, "tool_call_id", call_id->valuestring);
        if (has_calls) {
            cJSON *tc = template_tool_calls(calls, i, &values_left, b);
            if (!tc) {
                cJSON_Delete(out);
                return NULL;
            }
            cJSON_AddItemToObject(m, "tool_calls", tc);
        }
    }
    if (!out)
        request_fail(b, 500, NULL, "out of memory");
    return out;
}

/* OpenAI's rule for a function's name */
static int valid_function_name(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > 64)
        return 0;
    for (; *s; s++)
        if (!isalnum((unsigned char)*s) && *s != '_' && *s != '-' && *s != '.')
            return 0;
    return 1;
}

/* tools, tool_choice and parallel_tool_calls: what the template is given and how the answer is
 * read. A tool_choice that needs constrained decoding is refused until loom has it. */
static int parse_tools(const openai_model *srv, const cJSON *body, parsed *p, bad *b)
{
    const cJSON *tools = cJSON_GetObjectItemCaseSensitive(body, "tools");
    const cJSON *choice = cJSON_GetObjectItemCaseSensitive(body, "tool_choice");
    p->parallel_tool_calls = 1;
    if (field_bool(body, "parallel_tool_calls", &p->parallel_tool_calls, b) < 0)
        return -1;
    if (!tools || cJSON_IsNull(tools)) {
        if (choice && !cJSON_IsNull(choice) &&
            !(cJSON_IsString(choice) && !strcmp(choice->valuestring, "none")))
            return request_fail(b, 400, "tool_choice",
                                "'tool_choice' is only allowed when 'tools' are given");
        return 0;
    }
    if (!cJSON_IsArray(tools))
        return request_fail(b, 400, "tools", "'tools' must be an array, not %s",
                            json_type_name(tools));
    int n = cJSON_GetArraySize(tools);
    if (n > OPENAI_MAX_TOOLS)
        return request_fail(b, 400, "tools", "'tools' takes at most %d functions",
                            OPENAI_MAX_TOOLS);
    if (n == 0)
        return 0;
    p->tool_names = calloc((size_t)n, sizeof *p->tool_names);
    if (!p->tool_names)
        return request_fail(b, 500, NULL, "out of memory");
    int i = 0;
    for (const cJSON *t = tools->child; t; t = t->next, i++) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(t, "type");
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(t, "function");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(fn, "name");
        const cJSON *desc = cJSON_GetObjectItemCaseSensitive(fn, "description");
        const cJSON *params = cJSON_GetObjectItemCaseSensitive(fn, "parameters");
        const char *why = !cJSON_IsObject(t) ? "must be an object"
            : !cJSON_IsString(type) || strcmp(type->valuestring, "function")
            ? "type must be \"function\" (the only kind of tool loom calls)"
            : !cJSON_IsObject(fn) ? "needs a 'function' object"
            : !cJSON_IsString(name) || !valid_function_name(name->valuestring)
            ? "function.name must be 1 to 64 letters, digits, '_', '-' or '.'"
            : desc && !cJSON_IsNull(desc) && !cJSON_IsString(desc) ? "function.description must "
                                                                     "be a string"
            : params && !cJSON_IsNull(params) && !cJSON_IsObject(params)
            ? "function.parameters must be a JSON Schema object"
            : NULL;
        if (why)
            return request_fail(b, 400, "tools", "tools[%d].%s", i, why);
        for (int k = 0; k < p->n_tools; k++)
            if (!strcmp(p->tool_names[k], name->valuestring))
                return request_fail(b, 400, "tools", "tools[%d]: a second function named '%s'", i,
                                    name->valuestring);
        if (!(p->tool_names[p->n_tools++] = strdup(name->valuestring)))
            return request_fail(b, 500, NULL, "out of memory");
    }
    const char *mode = "auto";
    if (cJSON_IsString(choice)) {
        mode = choice->valuestring;
        if (strcmp(mode, "auto") && strcmp(mode, "none") && strcmp(mode, "required"))
            return request_fail(
                b, 400, "tool_choice",
                "'tool_choice' must be \"auto\", \"none\", \"required\" or "
                "{\"type\": \"function\", \"function\": {\"name\": ...}}; got \"%s\"",
                mode);
    } else if (cJSON_IsObject(choice)) {
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(
            cJSON_GetObjectItemCaseSensitive(choice, "function"), "name");
        if (!cJSON_IsString(name))
            return request_fail(b, 400, "tool_choice",
                                "'tool_choice' names a function as "
                                "{\"type\": \"function\", \"function\": {\"name\": ...}}");
        int found = 0;
        for (int k = 0; k < p->n_tools && !found; k++)
            found = !strcmp(p->tool_names[k], name->valuestring);
        if (!found)
            return request_fail(b, 400, "tool_choice",
                                "'tool_choice' names '%s', which is not in 'tools'",
                                name->valuestring);
        mode = "a named function";
    } else if (choice && !cJSON_IsNull(choice)) {
        return request_fail(b, 400, "tool_choice",
                            "'tool_choice' must be a string or an object, not %s",
                            json_type_name(choice));
    }
    if (!strcmp(mode, "none"))
        return 0; /* the model is not told of the tools, and its answer is text */
    p->tool_syntax = loom_chat_format_tool_syntax(srv->chat);
    if (p->tool_syntax == LOOM_TOOLS_NONE)
        return request_fail(
            b, 400, "tools",
            "this server's chat template (%s) does not show tools to the model; give one "
            "that does with --chat-template-file",
            srv->chat->about);
    if (p->tool_syntax == LOOM_TOOLS_UNKNOWN)
        return request_fail(
            b, 400, "tools",
            "this server's chat template (%s) offers tools in a form loom cannot read back "
            "(it reads the hermes/Qwen, Llama 3, Mistral, GLM-4 and GLM-4.5 forms)",
            srv->chat->about);
    if (!(p->tools_json = cJSON_PrintUnformatted(tools)))
        return request_fail(b, 500, NULL, "out of memory");
    if (!strcmp(mode, "auto"))
        return 0;
    /* "required" or a named function: the answer is made to be calls whose arguments match
     * the parameters' schemas */
    char err[512];
    const cJSON *only = cJSON_GetObjectItemCaseSensitive(
        cJSON_GetObjectItemCaseSensitive(choice, "function"), "name");
    const char *name = cJSON_IsObject(choice) ? only->valuestring : NULL;
    char *gbnf = loom_tool_calls_gbnf(p->tool_syntax, p->tools_json, name, p->parallel_tool_calls,
                                      err, sizeof err);
    if (gbnf)
        p->grammar = loom_grammar_compile(gbnf, err, sizeof err);
    p->grammar_param = "tool_choice";
    free(gbnf);
    if (!p->grammar)
        return request_fail(b, 400, "tool_choice", "tool_choice %s: %s", name ? name : "required",
                            err);
    return 0;
}

/* response_format (json_object, json_schema) and llama.cpp's grammar: what the answer must
 * match, as p->grammar */
static int parse_format(const cJSON *body, parsed *p, bad *b)
{
    const cJSON *rf = cJSON_GetObjectItemCaseSensitive(body, "response_format");
    const cJSON *gr = cJSON_GetObjectItemCaseSensitive(body, "grammar");
    char err[512];
    if (gr && !cJSON_IsNull(gr)) {
        if (!cJSON_IsString(gr))
            return request_fail(b, 400, "grammar", "'grammar' must be a string of GBNF, not %s",
                                json_type_name(gr));
        if (p->grammar || (rf && !cJSON_IsNull(rf)))
            return request_fail(b, 400, "grammar",
                                "'grammar' cannot go with response_format or a tool_choice that "
                                "requires a call");
        if (!(p->grammar = loom_grammar_compile(gr->valuestring, err, sizeof err)))
            return request_fail(b, 400, "grammar", "%s", err);
        p->grammar_param = "grammar";
        return 0;
    }
    if (!rf || cJSON_IsNull(rf))
        return 0;
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(rf, "type");
    if (!cJSON_IsObject(rf) || !cJSON_IsString(type))
        return request_fail(
            b, 400, "response_format",
            "'response_format' must be an object with a 'type': text, json_object or "
            "json_schema");
    const char *t = type->valuestring;
    if (!strcmp(t, "text"))
        return 0;
    if (p->grammar)
        return request_fail(b, 400, "response_format",
                            "'response_format' cannot go with a tool_choice that requires a call");
    char *schema = NULL;
    if (!strcmp(t, "json_object")) {
        schema = strdup("{\"type\": \"object\"}");
    } else if (!strcmp(t, "json_schema")) {
        const cJSON *js = cJSON_GetObjectItemCaseSensitive(rf, "json_schema");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(js, "name");
        const cJSON *sc = cJSON_GetObjectItemCaseSensitive(js, "schema");
        if (!cJSON_IsObject(js) || !cJSON_IsString(name))
            return request_fail(b, 400, "response_format",
                                "response_format json_schema needs 'json_schema': {\"name\": ..., "
                                "\"schema\": {...}}");
        if (sc && !cJSON_IsObject(sc) && !cJSON_IsBool(sc))
            return request_fail(b, 400, "response_format",
                                "json_schema.schema must be a JSON Schema object");
        schema = sc ? cJSON_PrintUnformatted(sc) : strdup("{}");
    } else {
        return request_fail(
            b, 400, "response_format",
            "response_format type '%s' is not one of text, json_object, json_schema", t);
    }
    if (!schema)
        return request_fail(b, 500, NULL, "out of memory");
    p->grammar = loom_grammar_from_json_schema(schema, err, sizeof err);
    p->grammar_param = "response_format";
    free(schema);
    if (!p->grammar)
        return request_fail(b, 400, "response_format", "json_schema: %s", err);
    return 0;
}


static int parse_messages(const openai_model *srv, const cJSON *body, parsed *p, bad *b)
{
    const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(body, "messages");
    if (!msgs)
        return request_fail(b, 400, "messages", "Missing required parameter: 'messages'");
    if (!cJSON_IsArray(msgs) || !msgs->child)
        return request_fail(b, 400, "messages", "'messages' must be a non-empty array");
    if (parse_tools(srv, body, p, b) != 0)
        return -1;
    cJSON *tm = template_messages(msgs, openai_max_values(srv->n_ctx), b);
    if (!tm)
        return -1;
    char *messages = cJSON_PrintUnformatted(tm), *prompt = NULL, *kwargs = NULL, err[512];
    cJSON_Delete(tm);
    int rc = messages ? 0 : request_fail(b, 500, NULL, "out of memory");
    loom_text_span *spans = NULL;
    int n_spans = 0, add_special = 1;
    /* chat_template_kwargs (vLLM's and llama.cpp's field): the template's own variables, such
     * as enable_thinking */
    const cJSON *kw = cJSON_GetObjectItemCaseSensitive(body, "chat_template_kwargs");
    if (rc == 0 && kw && !cJSON_IsNull(kw)) {
        if (!cJSON_IsObject(kw))
            rc = request_fail(b, 400, "chat_template_kwargs",
                              "'chat_template_kwargs' must be an object");
        else if (!(kwargs = cJSON_PrintUnformatted(kw)))
            rc = request_fail(b, 500, NULL, "out of memory");
    }
    loom_chat_vars v = {.messages_json = messages,
                        .tools_json = p->tools_json,
                        .kwargs_json = kwargs,
                        .add_generation_prompt = 1};
    if (rc == 0 &&
        loom_chat_format_render_vars(srv->chat, &v, &prompt, &spans, &n_spans, &add_special, err,
                                     sizeof err) != 0)
        rc = request_fail(b, 400,
                          kwargs && (!srv->chat->jinja || strstr(err, "kwargs"))
                              ? "chat_template_kwargs"
                              : "messages",
                          "%s", err);
    free(kwargs);
    free(messages);
    if (rc == 0 && loom_chat_format_reasons(srv->chat)) {
        size_t n = strlen(prompt);
        while (n && (prompt[n - 1] == '\n' || prompt[n - 1] == ' '))
            n--;
        p->reasoning = n >= 7 && !memcmp(prompt + n - 7, "<think>", 7) ? 2 : 1;
    }
    if (rc == 0) /* the template's special tokens, and (unless --parse-special) no others */
        rc = tokenize_text(srv, prompt, 1, add_special, spans, n_spans, p, b, "messages");
    free(prompt);
    free(spans);
    return rc;
}

static int parse_prompt(const openai_model *srv, const cJSON *body, parsed *p, bad *b)
{
    const cJSON *pr = cJSON_GetObjectItemCaseSensitive(body, "prompt");
    if (!pr)
        return request_fail(b, 400, "prompt", "Missing required parameter: 'prompt'");
    if (cJSON_IsArray(pr) && cJSON_GetArraySize(pr) == 1 && cJSON_IsString(pr->child))
        pr = pr->child;     /* ["text"] */
    if (cJSON_IsString(pr)) /* plain text, unless --parse-special */
        return tokenize_text(srv, pr->valuestring, 0, 1, NULL, 0, p, b, "prompt");
    if (cJSON_IsArray(pr) && cJSON_IsArray(pr->child) && cJSON_GetArraySize(pr) == 1)
        pr = pr->child; /* [[ids]] */
    if (cJSON_IsArray(pr) && pr->child && cJSON_IsNumber(pr->child)) {
        int n = cJSON_GetArraySize(pr);
        int32_t nv = loom_model_n_vocab(srv->model);
        p->ids = malloc((size_t)n * sizeof *p->ids);
        if (!p->ids)
            return request_fail(b, 500, NULL, "out of memory");
        for (const cJSON *x = pr->child; x; x = x->next) {
            if (!cJSON_IsNumber(x) || x->valuedouble != floor(x->valuedouble) ||
                x->valuedouble < 0 || x->valuedouble >= nv)
                return request_fail(b, 400, "prompt",
                                    "prompt token ids must be whole numbers from 0 to %d", nv - 1);
            p->ids[p->n_ids++] = (int32_t)x->valuedouble;
        }
        return 0;
    }
    if (cJSON_IsArray(pr) && cJSON_GetArraySize(pr) > 1)
        return request_fail(b, 400, "prompt",
                            "loom serves one prompt per request; send the %d prompts as "
                            "separate requests (they run concurrently)",
                            cJSON_GetArraySize(pr));
    return request_fail(b, 400, "prompt",
                        "'prompt' must be a string, an array of token ids, or a one-element "
                        "array of either; got %s",
                        json_type_name(pr));
}

/* "model" names the served one */
static int check_model(const openai_model *srv, const cJSON *body, bad *b)
{
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(body, "model");
    if (!model)
        return request_fail(b, 400, "model",
                            "Missing required parameter: 'model' (this server has '%s')",
                            srv->model_name);
    if (!cJSON_IsString(model))
        return request_fail(b, 400, "model", "'model' must be a string, not %s",
                            json_type_name(model));
    if (strcmp(model->valuestring, srv->model_name)) {
        b->code = "model_not_found";
        return request_fail(b, 404, "model", "The model '%s' does not exist; this server has '%s'",
                            model->valuestring, srv->model_name);
    }
    return 0;
}

/* "priority", "timeout" and "user", as every endpoint takes them */
static int parse_admission(const cJSON *body, int32_t *priority, int *priority_given,
                           double *timeout_s, const char **user, bad *b)
{
    double x;
    int r;
    if ((r = field_number(body, "priority", -1000000, 1000000, 1, &x, b)) < 0)
        return -1;
    if (r)
        *priority = (int32_t)x, *priority_given = 1;
    if ((r = field_number(body, "timeout", 0.001, 86400, 0, &x, b)) < 0)
        return -1;
    if (r)
        *timeout_s = x;
    const cJSON *u = cJSON_GetObjectItemCaseSensitive(body, "user");
    if (u && !cJSON_IsNull(u) && !cJSON_IsString(u))
        return request_fail(b, 400, "user", "'user' must be a string, not %s", json_type_name(u));
    *user = cJSON_IsString(u) ? u->valuestring : NULL;
    return 0;
}

/* One embeddings input: text (tokenized as a completion's prompt) or token ids. */
static int embedding_input(const openai_model *srv, const cJSON *in, int index, int many,
                           embed_input *out, bad *b)
{
    char param[32];
    if (many)
        snprintf(param, sizeof param, "input[%d]", index);
    else
        snprintf(param, sizeof param, "input");
    parsed t = {0};
    if (cJSON_IsString(in) && !in->valuestring[0])
        return request_fail(b, 400, param, "%s is an empty string: an embedding needs some text",
                            param);
    if (cJSON_IsString(in)) {
        if (tokenize_text(srv, in->valuestring, 0, 1, NULL, 0, &t, b, param) != 0) {
            free(t.ids);
            return -1;
        }
    } else if (cJSON_IsArray(in) && (!in->child || cJSON_IsNumber(in->child))) {
        int32_t nv = loom_model_n_vocab(srv->model);
        if (!(t.ids = malloc((size_t)cJSON_GetArraySize(in) * sizeof *t.ids + 1)))
            return request_fail(b, 500, NULL, "out of memory");
        for (const cJSON *x = in->child; x; x = x->next) {
            if (!cJSON_IsNumber(x) || x->valuedouble != floor(x->valuedouble) ||
                x->valuedouble < 0 || x->valuedouble >= nv) {
                free(t.ids);
                return request_fail(b, 400, param, "token ids must be whole numbers from 0 to %d",
                                    nv - 1);
            }
            t.ids[t.n_ids++] = (int32_t)x->valuedouble;
        }
    } else {
        return request_fail(
            b, 400, param,
            "'input' must be a string, an array of strings, an array of token ids or an "
            "array of such arrays; %s is %s",
            param, json_type_name(in));
    }
    out->ids = t.ids, out->n_ids = t.n_ids;
    if (t.n_ids <= 0)
        return request_fail(b, 400, param, "%s gives no tokens: an embedding needs at least one",
                            param);
    if (t.n_ids > srv->n_ctx) {
        b->code = "context_length_exceeded";
        return request_fail(
            b, 400, param,
            "This model's maximum context length is %d tokens, and %s has %d; please "
            "shorten it",
            srv->n_ctx, param, t.n_ids);
    }
    return 0;
}

int openai_parse_embeddings(const openai_model *srv, const cJSON *body, embed_parsed *p, bad *b)
{
    static const char *const fields[] = {"model",   "input",   "encoding_format", "dimensions",
                                         "user",    "pooling", "normalize",       "priority",
                                         "timeout", NULL};
    if (!cJSON_IsObject(body))
        return request_fail(b, 400, NULL, "the request body must be a JSON object");
    if (fields_known(body, fields, 0, b) || check_model(srv, body, b) != 0)
        return -1;
    p->pooling = LOOM_POOL_LAST, p->normalize = 1;
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(body, "encoding_format");
    if (v && !cJSON_IsNull(v)) {
        if (!cJSON_IsString(v) ||
            (strcmp(v->valuestring, "float") && strcmp(v->valuestring, "base64")))
            return request_fail(b, 400, "encoding_format",
                                "'encoding_format' must be 'float' or 'base64'");
        p->base64 = !strcmp(v->valuestring, "base64");
    }
    v = cJSON_GetObjectItemCaseSensitive(body, "pooling");
    if (v && !cJSON_IsNull(v)) {
        if (!cJSON_IsString(v) ||
            (strcmp(v->valuestring, "last") && strcmp(v->valuestring, "mean")))
            return request_fail(
                b, 400, "pooling",
                "'pooling' must be 'last' (the last token's hidden state, the default) "
                "or 'mean' (their average over the input)");
        p->pooling = strcmp(v->valuestring, "mean") ? LOOM_POOL_LAST : LOOM_POOL_MEAN;
    }
    if (field_bool(body, "normalize", &p->normalize, b) < 0)
        return -1;
    double x;
    int r;
    int32_t n_embd = loom_model_n_embd(srv->model);
    if ((r = field_number(body, "dimensions", 1, 1 << 24, 1, &x, b)) < 0)
        return -1;
    if (r && (int32_t)x != n_embd) /* shortening is for models trained for it (Matryoshka) */
        return request_fail(
            b, 400, "dimensions",
            "this model's embeddings have %d dimensions; 'dimensions' cannot change that "
            "(leave it out)",
            n_embd);
    if (parse_admission(body, &p->priority, &p->priority_given, &p->timeout_s, &p->user, b) != 0)
        return -1;
    const cJSON *in = cJSON_GetObjectItemCaseSensitive(body, "input");
    if (!in)
        return request_fail(b, 400, "input", "Missing required parameter: 'input'");
    /* a list of inputs: strings or arrays of ids; anything else is one input */
    int many = cJSON_IsArray(in) && in->child &&
        (cJSON_IsString(in->child) || cJSON_IsArray(in->child));
    int n = many ? cJSON_GetArraySize(in) : 1;
    if (cJSON_IsArray(in) && !in->child)
        return request_fail(b, 400, "input", "'input' is an empty array: give at least one input");
    if (n > OPENAI_MAX_INPUTS)
        return request_fail(b, 400, "input", "'input' has %d inputs; at most %d go in one request",
                            n, OPENAI_MAX_INPUTS);
    /* the answer holds n x n_embd numbers: a few bytes of request must not ask for a hundred
     * megabytes of response */
    if ((int64_t)n * n_embd > OPENAI_MAX_EMBEDDING_VALUES)
        return request_fail(
            b, 400, "input",
            "'input' has %d inputs of %d dimensions each: %lld numbers, more than the %d "
            "one answer holds; send at most %d inputs a request to this model",
            n, n_embd, (long long)n * n_embd, OPENAI_MAX_EMBEDDING_VALUES,
            OPENAI_MAX_EMBEDDING_VALUES / n_embd);
    if (!(p->inputs = calloc((size_t)n, sizeof *p->inputs)))
        return request_fail(b, 500, NULL, "out of memory");
    const cJSON *item = many ? in->child : in;
    for (int i = 0; i < n; i++, item = item->next) {
        if (embedding_input(srv, item, i, many, &p->inputs[i], b) != 0) {
            p->n_inputs = i + 1; /* (its ids, if any, are freed with the rest) */
            return -1;
        }
        p->n_inputs = i + 1;
        p->n_tokens += p->inputs[i].n_ids;
    }
    return 0;
}

void openai_embed_parsed_free(embed_parsed *p)
{
    for (int i = 0; i < p->n_inputs; i++)
        free(p->inputs[i].ids);
    free(p->inputs);
    memset(p, 0, sizeof *p);
}

/* "speculative" (loom's): false (off), or {"draft": bool, "lookup": N, "draft_max": K}: the
 * server's drafter model (on by default where it has one), or prompt lookup's n-gram size (0
 * to 64, 0 off; above 0 instead of the drafter), and the most proposals a step (1 to 64);
 * what it leaves out is the server's. Speculation never changes an answer, only how fast it
 * comes. */
/* A thought's budget in tokens: loom's "reasoning_budget" (0: none), or OpenAI's
 * "reasoning_effort" as one of these, or the server's (--reasoning-budget). */
static const struct {
    const char *effort;
    int32_t budget;
} effort_budgets[] = {
    {"none", 1}, {"minimal", 128}, {"low", 1024}, {"medium", 4096}, {"high", 16384}};

static int parse_reasoning_budget(const openai_model *srv, const cJSON *body, parsed *p, bad *b)
{
    p->reasoning_budget = srv->reasoning_budget;
    const cJSON *effort = cJSON_GetObjectItemCaseSensitive(body, "reasoning_effort");
    if (effort && !cJSON_IsNull(effort)) {
        size_t i = 0, n = sizeof effort_budgets / sizeof *effort_budgets;
        while (i < n &&
               !(cJSON_IsString(effort) && !strcmp(effort->valuestring, effort_budgets[i].effort)))
            i++;
        if (i == n)
            return request_fail(b, 400, "reasoning_effort",
                                "'reasoning_effort' must be one of none, minimal, low, medium, "
                                "high");
        p->reasoning_budget = effort_budgets[i].budget;
    }
    double x;
    int r = field_number(body, "reasoning_budget", 0, INT32_MAX, 1, &x, b);
    if (r < 0)
        return -1;
    if (r && effort && !cJSON_IsNull(effort))
        return request_fail(b, 400, "reasoning_budget",
                            "give 'reasoning_effort' or 'reasoning_budget', not both");
    if (r)
        p->reasoning_budget = (int32_t)x;
    return 0;
}

static int parse_speculative(const openai_model *srv, const cJSON *body, parsed *p, bad *b)
{
    p->lookup = srv->lookup, p->draft_max = srv->draft_max, p->draft = srv->draft;
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(body, "speculative");
    if (!v || cJSON_IsNull(v))
        return 0;
    if (cJSON_IsFalse(v)) {
        p->lookup = 0, p->draft = 0;
        return 0;
    }
    if (!cJSON_IsObject(v))
        return request_fail(
            b, 400, "speculative",
            "'speculative' must be false or an object {\"draft\": true, \"lookup\": N, "
            "\"draft_max\": K}, not %s",
            json_type_name(v));
    for (const cJSON *f = v->child; f; f = f->next)
        if (strcmp(f->string, "lookup") && strcmp(f->string, "draft_max") &&
            strcmp(f->string, "draft"))
            return request_fail(b, 400, "speculative",
                                "'speculative' takes 'draft', 'lookup' and 'draft_max', not '%s'",
                                f->string);
    double x;
    int r;
    if (field_bool(v, "draft", &p->draft, b) < 0)
        return -1;
    if (p->draft && !srv->draft)
        return request_fail(
            b, 400, "speculative",
            "this server has no draft model (loom serve --draft or --draft-layers); "
            "'lookup' needs none");
    if ((r = field_number(v, "lookup", 0, 64, 1, &x, b)) < 0)
        return -1;
    if (r) {
        p->lookup = (int32_t)x;
        if (x > 0 && cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(v, "draft")))
            return request_fail(b, 400, "speculative",
                                "one drafter a request: 'draft': true or 'lookup', not both");
        if (x > 0)
            p->draft = 0;
    }
    if (p->draft)
        p->lookup = 0;
    if ((r = field_number(v, "draft_max", 1, 64, 1, &x, b)) < 0)
        return -1;
    if (r)
        p->draft_max = (int32_t)x;
    return 0;
}

loom_sampling openai_default_sampling(void)
{
    loom_sampling s;
#define API_DEFAULT(kind, name, def, api_def, ...) s.name = (LOOM_SAMPLING_CTYPE_##kind)(api_def);
    LOOM_SAMPLING_FIELDS(API_DEFAULT)
#undef API_DEFAULT
    return s;
}

/* The sampling list's request fields into p->s, each checked against its range (an INT below
 * 0 is off: 0). A penalty given makes every generated token count, as OpenAI's do. */
static int parse_sampling(const cJSON *body, parsed *p, bad *b)
{
    double x;
    int r, penalty = 0;
#define KIND_IS_INT_FLOAT 0
#define KIND_IS_INT_INT 1
#define KIND_IS_INT_SEED 1
#define KIND_IS_INT_BOOL 0
#define ROLE_PENALTY_PENALTY 1
#define ROLE_PENALTY_PLAIN 0
#define STORE_FLOAT(field, x) field = (float)(x)
#define STORE_INT(field, x) field = (x) < 0 ? 0 : (int32_t)(x)
#define STORE_SEED(field, x) field = (uint64_t)(int64_t)(x), p->seed_given = 1
#define STORE_BOOL(field, x) field = (x) != 0
#define PARSE(kind, name, def, api_def, flag, alias, flo, fhi, json, lo, hi, role, help)           \
    if (json) {                                                                                    \
        int yes = 0;                                                                               \
        if (LOOM_SAMPLING_KIND_##kind == LOOM_SAMPLING_KIND_BOOL)                                  \
            r = field_bool(body, json, &yes, b), x = yes;                                          \
        else                                                                                       \
            r = field_number(body, json, lo, hi, KIND_IS_INT_##kind, &x, b);                       \
        if (r < 0)                                                                                 \
            return -1;                                                                             \
        if (r)                                                                                     \
            STORE_##kind(p->s.name, x);                                                            \
    }
    LOOM_SAMPLING_FIELDS(PARSE)
#undef PARSE
#define PENALIZES(kind, name, def, api_def, flag, alias, flo, fhi, json, lo, hi, role, help)       \
    penalty |= ROLE_PENALTY_##role && p->s.name != (LOOM_SAMPLING_CTYPE_##kind)(api_def);
    LOOM_SAMPLING_FIELDS(PENALIZES)
#undef PENALIZES
    if (penalty)
        p->s.repeat_last_n = INT32_MAX; /* OpenAI's penalties look at everything generated */
    return 0;
}

int openai_parse_request(const openai_model *srv, const cJSON *body, int chat, parsed *p, bad *b)
{
    /* clang-format off */
    static const char *const completion_fields[] = {
        "model", "prompt", "max_tokens", "n", "stream", "stream_options", "stop", "user", "echo",
        "logprobs", "best_of", "logit_bias", "suffix", "priority", "timeout", "response_format",
        "grammar", "speculative", NULL};
    /* clang-format on */
    /* clang-format off */
    static const char *const chat_fields[] = {
        "model", "messages", "max_tokens", "max_completion_tokens", "n", "stream",
        "stream_options", "stop", "user", "logprobs", "top_logprobs", "logit_bias",
        "response_format", "tools", "tool_choice", "parallel_tool_calls", "functions",
        "function_call", "store", "metadata", "service_tier", "priority", "timeout",
        "chat_template_kwargs", "grammar", "speculative", "reasoning_effort", "reasoning_budget",
        NULL};
    /* clang-format on */
    static const char *const completion_unsupported[] = {"echo", "best_of", "logit_bias", "suffix",
                                                         NULL};
    static const char *const chat_unsupported[] = {"logit_bias", "functions", "function_call",
                                                   NULL};
    if (!cJSON_IsObject(body))
        return request_fail(b, 400, NULL, "the request body must be a JSON object");
    if (fields_known(body, chat ? chat_fields : completion_fields, 1, b))
        return -1;
    for (const char *const *u = chat ? chat_unsupported : completion_unsupported; *u; u++)
        if (field_unsupported(body, *u, b))
            return -1;
    if (check_model(srv, body, b) != 0)
        return -1;
    p->s = srv->defaults;
    p->max_tokens = chat ? -1 : 16;
    p->n = 1;
    double x;
    int r;
    const char *mt = chat && cJSON_GetObjectItemCaseSensitive(body, "max_completion_tokens")
        ? "max_completion_tokens"
        : "max_tokens";
    if ((r = field_number(body, mt, 1, INT_MAX, 1, &x, b)) < 0)
        return -1;
    if (r)
        p->max_tokens = (int32_t)x, p->max_tokens_given = 1;
    if (parse_sampling(body, p, b) != 0)
        return -1;
    if ((r = field_number(body, "n", 1, OPENAI_MAX_CHOICES, 1, &x, b)) < 0)
        return -1;
    if (r)
        p->n = (int)x;
    if (field_bool(body, "stream", &p->stream, b) < 0)
        return -1;
    if (parse_admission(body, &p->priority, &p->priority_given, &p->timeout_s, &p->user, b) != 0)
        return -1;
    if (parse_speculative(srv, body, p, b) != 0)
        return -1;
    if (chat && parse_reasoning_budget(srv, body, p, b) != 0)
        return -1;
    /* logprobs: chat's a boolean with top_logprobs beside it, completions' the count */
    if (chat) {
        if (field_bool(body, "logprobs", &p->logprobs, b) < 0)
            return -1;
        if ((r = field_number(body, "top_logprobs", 0, LOOM_MAX_TOP_LOGPROBS, 1, &x, b)) < 0)
            return -1;
        if (r && !p->logprobs)
            return request_fail(b, 400, "top_logprobs", "'top_logprobs' needs 'logprobs': true");
        p->top_logprobs = r ? (int32_t)x : 0;
    } else {
        if ((r = field_number(body, "logprobs", 0, LOOM_MAX_TOP_LOGPROBS, 1, &x, b)) < 0)
            return -1;
        p->logprobs = r, p->top_logprobs = r ? (int32_t)x : 0;
    }
    const cJSON *so = cJSON_GetObjectItemCaseSensitive(body, "stream_options");
    if (so && !cJSON_IsNull(so)) {
        if (!cJSON_IsObject(so))
            return request_fail(b, 400, "stream_options", "'stream_options' must be an object");
        if (field_bool(so, "include_usage", &p->include_usage, b) < 0)
            return -1;
    }
    const cJSON *stop = cJSON_GetObjectItemCaseSensitive(body, "stop");
    if (cJSON_IsString(stop)) {
        p->stops[p->n_stops++] = stop->valuestring;
    } else if (cJSON_IsArray(stop)) {
        if (cJSON_GetArraySize(stop) > OPENAI_MAX_STOPS)
            return request_fail(b, 400, "stop", "'stop' takes at most %d strings",
                                OPENAI_MAX_STOPS);
        for (const cJSON *s = stop->child; s; s = s->next) {
            if (!cJSON_IsString(s))
                return request_fail(b, 400, "stop",
                                    "'stop' must be a string or an array of strings");
            p->stops[p->n_stops++] = s->valuestring;
        }
    } else if (stop && !cJSON_IsNull(stop)) {
        return request_fail(b, 400, "stop",
                            "'stop' must be a string or an array of strings, not %s",
                            json_type_name(stop));
    }
    for (int i = 0; i < p->n_stops; i++)
        if (!p->stops[i][0])
            return request_fail(b, 400, "stop", "stop strings must not be empty");
    if ((chat ? parse_messages(srv, body, p, b) : parse_prompt(srv, body, p, b)) != 0)
        return -1;
    if (parse_format(body, p, b) != 0)
        return -1;
    if (p->n_ids <= 0)
        return request_fail(b, 400, "prompt", "the prompt gives no tokens");
    /* 64 bits: max_tokens may be up to INT_MAX */
    int64_t want = (int64_t)p->n_ids + (p->max_tokens_given ? p->max_tokens : 1);
    if (want > srv->n_ctx) {
        b->code = "context_length_exceeded";
        if (p->max_tokens_given)
            return request_fail(
                b, 400, chat ? "messages" : "prompt",
                "This model's maximum context length is %d tokens. However, you requested "
                "%lld tokens (%d in the prompt, %d for the completion). Please reduce the "
                "prompt or the completion length.",
                srv->n_ctx, (long long)want, p->n_ids, p->max_tokens);
        return request_fail(
            b, 400, chat ? "messages" : "prompt",
            "This model's maximum context length is %d tokens, and the prompt has %d "
            "(at least one more is needed for the completion).",
            srv->n_ctx, p->n_ids);
    }
    if (!p->stream && p->include_usage)
        return request_fail(b, 400, "stream_options",
                            "'stream_options' is only allowed with stream: true");
    if (!p->seed_given) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        p->s.seed = (uint64_t)ts.tv_nsec * 0x9e3779b97f4a7c15ull ^ (uint64_t)ts.tv_sec;
    }
    return 0;
}

void openai_parsed_free(parsed *p)
{
    free(p->ids);
    for (int i = 0; i < p->n_tools; i++)
        free(p->tool_names[i]);
    free(p->tool_names);
    free(p->tools_json);
    loom_grammar_free(p->grammar);
    memset(p, 0, sizeof *p);
}
