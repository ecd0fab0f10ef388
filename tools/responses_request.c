/*
 * tools/responses_request.c - see responses_request.h. What maps where:
 *   instructions                                a system message, first
 *   input: a string                             a user message
 *   input items: messages (role and content:    chat messages (developer is system); text
 *     a string or input_text / output_text)     parts
 *   function_call items (call_id, name,         an assistant message's tool_calls (calls in a
 *     arguments)                                row join one message)
 *   function_call_output items (call_id,        tool messages
 *     output)
 *   reasoning items                             dropped: a template shows only the last turn's
 *                                               thought, and loom's own answers carry theirs
 *   tools: function tools (name, description,   chat function tools
 *     parameters, strict)
 *   tool_choice, parallel_tool_calls            as they are ({"type": "function", "name"} as
 *                                               chat's {"function": {"name"}})
 *   text.format text / json_object /            response_format
 *     json_schema (name, schema, strict)
 *   reasoning.effort                            reasoning_effort (a thought's budget); "none"
 *                                               and "minimal" also switch the template's
 *                                               enable_thinking off
 *   max_output_tokens, temperature, top_p,      max_tokens, and the rest as they are
 *     stream, user, and loom's priority and timeout
 * store and previous_response_id are the server's (tools/serve/stored.c keeps responses and
 * puts a previous one's conversation before this input). Hosted tools (web search, file
 * search, computer use, ...), image and file inputs are refused by name.
 */
#define _GNU_SOURCE
#include "responses_request.h"

#include "chat_body.h"
#include "openai_fields.h"

#include <stdio.h>
#include <string.h>

/* content: a string, or parts of input_text / output_text, as chat text parts */
static cJSON *text_parts(const cJSON *content, const char *where, bad *b)
{
    cJSON *parts = cJSON_CreateArray();
    if (cJSON_IsString(content)) {
        chat_text_part(parts, content->valuestring);
        return parts;
    }
    if (!cJSON_IsArray(content)) {
        request_fail(b, 400, where, "%s: must be a string or a list of content parts, not %s",
                     where, json_type_name(content));
        goto bad;
    }
    int k = 0;
    for (const cJSON *part = content->child; part; part = part->next, k++) {
        static const char *const fields[] = {"type", "text", "annotations", "logprobs", NULL};
        char at[96];
        snprintf(at, sizeof at, "%s.%d", where, k);
        const char *type = cJSON_IsObject(part) ? field_string(part, "type", 1, at, b) : NULL;
        if (!cJSON_IsObject(part)) {
            request_fail(b, 400, at, "%s: must be a content part (an object), not %s", at,
                         json_type_name(part));
            goto bad;
        }
        if (!type)
            goto bad;
        if (strcmp(type, "input_text") && strcmp(type, "output_text") && strcmp(type, "text")) {
            request_fail(b, 400, at,
                         "%s: '%s' content is not supported: loom serve reads text only for now "
                         "(input_text, output_text)",
                         at, type);
            goto bad;
        }
        const char *text = field_string(part, "text", 1, at, b);
        if (!text || fields_only(part, fields, at, b))
            goto bad;
        chat_text_part(parts, text);
    }
    return parts;
bad:
    cJSON_Delete(parts);
    return NULL;
}

/* the assistant message the next function call joins: the last message when it is an
 * assistant's with nothing after it, else a new one */
static cJSON *caller(cJSON *chat)
{
    cJSON *last = cJSON_GetArrayItem(chat, cJSON_GetArraySize(chat) - 1);
    const cJSON *role = cJSON_GetObjectItemCaseSensitive(last, "role");
    if (cJSON_IsString(role) && !strcmp(role->valuestring, "assistant"))
        return last;
    return chat_message(chat, "assistant", NULL);
}

/* input item i appended to chat */
static int add_item(cJSON *chat, const cJSON *item, int i, bad *b)
{
    char where[48];
    snprintf(where, sizeof where, "input.%d", i);
    if (!cJSON_IsObject(item))
        return request_fail(b, 400, where, "%s: must be an item (an object), not %s", where,
                            json_type_name(item));
    const cJSON *type_v = cJSON_GetObjectItemCaseSensitive(item, "type");
    const char *type = cJSON_IsString(type_v) ? type_v->valuestring : "message";
    if (type_v && !cJSON_IsString(type_v))
        return request_fail(b, 400, where, "%s.type: must be a string", where);
    if (!strcmp(type, "message")) {
        static const char *const fields[] = {"type", "role", "content", "id", "status", NULL};
        const char *role = field_string(item, "role", 1, where, b);
        if (!role || fields_only(item, fields, where, b))
            return -1;
        if (strcmp(role, "user") && strcmp(role, "assistant") && strcmp(role, "system") &&
            strcmp(role, "developer"))
            return request_fail(b, 400, where,
                                "%s.role: '%s' is not one of user, assistant, system, developer",
                                where, role);
        char at[64];
        snprintf(at, sizeof at, "%s.content", where);
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(item, "content");
        if (!content)
            return request_fail(b, 400, at, "%s: Field required", at);
        cJSON *parts = text_parts(content, at, b);
        if (!parts)
            return -1;
        chat_message(chat, role, parts);
        return 0;
    }
    if (!strcmp(type, "function_call")) {
        static const char *const fields[] = {"type", "call_id", "name", "arguments",
                                             "id",   "status",  NULL};
        const char *id = field_string(item, "call_id", 1, where, b);
        const char *name = id ? field_string(item, "name", 1, where, b) : NULL;
        const char *args = name ? field_string(item, "arguments", 1, where, b) : NULL;
        if (!args || fields_only(item, fields, where, b))
            return -1;
        cJSON *m = caller(chat), *calls = cJSON_GetObjectItemCaseSensitive(m, "tool_calls");
        if (!calls)
            calls = cJSON_AddArrayToObject(m, "tool_calls");
        chat_tool_call(calls, id, name, args);
        return 0;
    }
    if (!strcmp(type, "function_call_output")) {
        static const char *const fields[] = {"type", "call_id", "output", "id", "status", NULL};
        const char *id = field_string(item, "call_id", 1, where, b);
        const char *output = id ? field_string(item, "output", 1, where, b) : NULL;
        if (!output || fields_only(item, fields, where, b))
            return -1;
        chat_tool_result(chat, id, cJSON_CreateString(output));
        return 0;
    }
    if (!strcmp(type, "reasoning"))
        return 0;
    if (!strcmp(type, "item_reference"))
        return request_fail(b, 400, where,
                            "%s: item references are not supported: send the items themselves, "
                            "or continue a stored response with previous_response_id",
                            where);
    return request_fail(b, 400, where,
                        "%s.type: '%s' is not an item loom takes (message, function_call, "
                        "function_call_output, reasoning)",
                        where, type);
}

/* tools: function tools only */
static cJSON *function_tools(const cJSON *tools, bad *b)
{
    static const char *const fields[] = {"type",       "name",   "description",
                                         "parameters", "strict", NULL};
    if (field_objects(tools, "tools", "tool", b))
        return NULL;
    cJSON *out = cJSON_CreateArray();
    int k = 0;
    for (const cJSON *t = tools->child; t; t = t->next, k++) {
        char at[48];
        snprintf(at, sizeof at, "tools.%d", k);
        const char *type = field_string(t, "type", 1, at, b);
        if (type && strcmp(type, "function"))
            request_fail(b, 400, at,
                         "%s.type: '%s' is a hosted tool, which loom does not run; describe it "
                         "as a function tool",
                         at, type);
        if (!type || strcmp(type, "function"))
            goto bad;
        const char *name = field_string(t, "name", 1, at, b);
        if (!name || fields_only(t, fields, at, b))
            goto bad;
        const cJSON *desc = cJSON_GetObjectItemCaseSensitive(t, "description");
        const cJSON *params = cJSON_GetObjectItemCaseSensitive(t, "parameters");
        chat_function_tool(out, name, desc, params);
    }
    return out;
bad:
    cJSON_Delete(out);
    return NULL;
}

/* text.format as chat's response_format */
static int text_format(cJSON *out, const cJSON *text, bad *b)
{
    static const char *const fields[] = {"format", "verbosity", NULL};
    static const char *const schema_fields[] = {"type",   "name",        "schema",
                                                "strict", "description", NULL};
    if (!cJSON_IsObject(text))
        return request_fail(b, 400, "text", "text: must be an object");
    if (fields_only(text, fields, "text", b))
        return -1;
    const cJSON *format = cJSON_GetObjectItemCaseSensitive(text, "format");
    if (!format || cJSON_IsNull(format))
        return 0;
    const char *type = cJSON_IsObject(format) ? field_string(format, "type", 1, "text.format", b)
                                              : NULL;
    if (!cJSON_IsObject(format))
        return request_fail(b, 400, "text.format", "text.format: must be an object");
    if (!type)
        return -1;
    if (!strcmp(type, "text"))
        return 0;
    cJSON *rf = cJSON_AddObjectToObject(out, "response_format");
    if (!strcmp(type, "json_object")) {
        cJSON_AddStringToObject(rf, "type", "json_object");
        return 0;
    }
    if (strcmp(type, "json_schema"))
        return request_fail(b, 400, "text.format",
                            "text.format.type: '%s' is not one of text, json_object, json_schema",
                            type);
    if (fields_only(format, schema_fields, "text.format", b))
        return -1;
    const char *name = field_string(format, "name", 1, "text.format", b);
    const cJSON *schema = cJSON_GetObjectItemCaseSensitive(format, "schema");
    if (!name)
        return -1;
    if (!cJSON_IsObject(schema))
        return request_fail(b, 400, "text.format", "text.format.schema: %s",
                            schema ? "must be a JSON Schema object" : "Field required");
    cJSON_AddStringToObject(rf, "type", "json_schema");
    cJSON *js = cJSON_AddObjectToObject(rf, "json_schema");
    cJSON_AddStringToObject(js, "name", name);
    cJSON_AddItemToObject(js, "schema", cJSON_Duplicate(schema, 1));
    return 0;
}

cJSON *responses_chat_request(const cJSON *body, bad *b)
{
    /* clang-format off */
    static const char *const fields[] = {
        "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
        "tool_choice", "parallel_tool_calls", "text", "reasoning", "stream", "store",
        "previous_response_id", "metadata", "user", "safety_identifier", "prompt_cache_key",
        "truncation", "include", "service_tier", "background", "priority", "timeout", NULL};
    /* clang-format on */
    if (!cJSON_IsObject(body)) {
        request_fail(b, 400, NULL, "the request body must be a JSON object");
        return NULL;
    }
    if (fields_only(body, fields, NULL, b))
        return NULL;
    cJSON *out = cJSON_CreateObject();
    const cJSON *prev = cJSON_GetObjectItemCaseSensitive(body, "previous_response_id");
    if (prev && !cJSON_IsNull(prev) && !cJSON_IsString(prev)) {
        request_fail(b, 400, "previous_response_id", "previous_response_id: must be a string");
        goto bad;
    }
    const cJSON *bg = cJSON_GetObjectItemCaseSensitive(body, "background");
    if (cJSON_IsTrue(bg)) {
        request_fail(b, 400, "background",
                     "background: loom answers every request in its connection");
        goto bad;
    }
    /* copied as they are: the chat parser checks them (model, ranges, types) */
    static const char *const same[] = {
        "model",  "temperature", "top_p",    "tool_choice", "parallel_tool_calls",
        "stream", "user",        "priority", "timeout",     NULL};
    for (const char *const *k = same; *k; k++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(body, *k);
        if (v && !cJSON_IsNull(v))
            cJSON_AddItemToObject(out, *k, cJSON_Duplicate(v, 1));
    }
    const cJSON *choice = cJSON_GetObjectItemCaseSensitive(out, "tool_choice");
    if (cJSON_IsObject(choice)) { /* {"type": "function", "name": N} -> chat's form */
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(choice, "type");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(choice, "name");
        if (!cJSON_IsString(type) || strcmp(type->valuestring, "function") ||
            !cJSON_IsString(name)) {
            request_fail(b, 400, "tool_choice",
                         "tool_choice: one of \"auto\", \"none\", \"required\" or "
                         "{\"type\": \"function\", \"name\": ...}");
            goto bad;
        }
        cJSON *c = cJSON_CreateObject();
        cJSON_AddStringToObject(c, "type", "function");
        cJSON_AddStringToObject(cJSON_AddObjectToObject(c, "function"), "name", name->valuestring);
        cJSON_ReplaceItemInObject(out, "tool_choice", c);
    }
    const cJSON *ident = cJSON_GetObjectItemCaseSensitive(body, "safety_identifier");
    if (cJSON_IsString(ident) && !cJSON_GetObjectItemCaseSensitive(out, "user"))
        cJSON_AddStringToObject(out, "user", ident->valuestring);
    double x;
    int r = field_number(body, "max_output_tokens", 1, INT32_MAX, 1, &x, b);
    if (r < 0)
        goto bad;
    if (r)
        cJSON_AddNumberToObject(out, "max_tokens", x);
    cJSON *chat = cJSON_AddArrayToObject(out, "messages");
    const cJSON *instructions = cJSON_GetObjectItemCaseSensitive(body, "instructions");
    if (cJSON_IsString(instructions)) {
        chat_message(chat, "system", cJSON_CreateString(instructions->valuestring));
    } else if (instructions && !cJSON_IsNull(instructions)) {
        request_fail(b, 400, "instructions", "instructions: must be a string");
        goto bad;
    }
    const cJSON *input = cJSON_GetObjectItemCaseSensitive(body, "input");
    if (cJSON_IsString(input)) {
        chat_message(chat, "user", cJSON_CreateString(input->valuestring));
    } else if (cJSON_IsArray(input) && input->child) {
        int i = 0;
        for (const cJSON *item = input->child; item; item = item->next, i++)
            if (add_item(chat, item, i, b))
                goto bad;
    } else {
        request_fail(b, 400, "input", "input: %s",
                     !input                     ? "Field required"
                         : cJSON_IsArray(input) ? "at least one item is required"
                                                : "must be a string or a list of items");
        goto bad;
    }
    const cJSON *tools = cJSON_GetObjectItemCaseSensitive(body, "tools");
    if (tools && !cJSON_IsNull(tools) && (!cJSON_IsArray(tools) || tools->child)) {
        cJSON *t = function_tools(tools, b);
        if (!t)
            goto bad;
        cJSON_AddItemToObject(out, "tools", t);
    }
    const cJSON *text = cJSON_GetObjectItemCaseSensitive(body, "text");
    if (text && !cJSON_IsNull(text) && text_format(out, text, b))
        goto bad;
    const cJSON *reasoning = cJSON_GetObjectItemCaseSensitive(body, "reasoning");
    if (reasoning && !cJSON_IsNull(reasoning)) {
        static const char *const rfields[] = {"effort", "summary", "generate_summary", NULL};
        if (!cJSON_IsObject(reasoning) || fields_only(reasoning, rfields, "reasoning", b)) {
            if (!cJSON_IsObject(reasoning))
                request_fail(b, 400, "reasoning", "reasoning: must be an object");
            goto bad;
        }
        const cJSON *effort = cJSON_GetObjectItemCaseSensitive(reasoning, "effort");
        static const char *const efforts[] = {"none", "minimal", "low", "medium", "high", NULL};
        int known = 0;
        for (const char *const *e = efforts; cJSON_IsString(effort) && *e && !known; e++)
            known = !strcmp(effort->valuestring, *e);
        if (effort && !cJSON_IsNull(effort) && !known) {
            request_fail(b, 400, "reasoning",
                         "reasoning.effort: one of none, minimal, low, medium, high");
            goto bad;
        }
        if (known &&
            (!strcmp(effort->valuestring, "none") || !strcmp(effort->valuestring, "minimal")))
            cJSON_AddFalseToObject(cJSON_AddObjectToObject(out, "chat_template_kwargs"),
                                   "enable_thinking");
        if (known) /* and its budget, as chat's reasoning_effort */
            cJSON_AddStringToObject(out, "reasoning_effort", effort->valuestring);
    }
    /* read by the server (store), or accepted needing nothing: loom caches prefixes by
     * itself and refuses what does not fit the context */
    static const struct {
        const char *key;
        int type; /* cJSON's */
    } inert[] = {{"store", cJSON_True | cJSON_False},
                 {"metadata", cJSON_Object},
                 {"prompt_cache_key", cJSON_String},
                 {"truncation", cJSON_String},
                 {"include", cJSON_Array},
                 {"service_tier", cJSON_String}};
    for (size_t i = 0; i < sizeof inert / sizeof *inert; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(body, inert[i].key);
        if (v && !cJSON_IsNull(v) && !(v->type & inert[i].type)) {
            request_fail(b, 400, inert[i].key, "%s: must be %s, not %s", inert[i].key,
                         inert[i].type == cJSON_Object       ? "an object"
                             : inert[i].type == cJSON_Array  ? "a list"
                             : inert[i].type == cJSON_String ? "a string"
                                                             : "a boolean",
                         json_type_name(v));
            goto bad;
        }
    }
    return out;
bad:
    cJSON_Delete(out);
    return NULL;
}
