/*
 * tools/anthropic_request.c - see anthropic_request.h. What maps where:
 *   system (a string or text blocks)           a system message, first
 *   a message's text blocks                     its content (text parts)
 *   an assistant's tool_use blocks              its tool_calls (the input as JSON text)
 *   an assistant's thinking blocks              its reasoning_content (a template may show it)
 *   a user's tool_result blocks                 tool messages, before the user's text
 *   tools[]: name, description, input_schema    function tools
 *   tool_choice auto / any / tool / none        auto / required / the function / none;
 *     disable_parallel_tool_use                 parallel_tool_calls: false
 *   stop_sequences, metadata.user_id            stop, user
 *   thinking enabled / disabled, budget_tokens  chat_template_kwargs.enable_thinking,
 *                                               reasoning_budget
 *   max_tokens, temperature (0 to 1), top_p, top_k, stream, and loom's priority and timeout,
 *   as they are.
 * Image and document blocks are refused by name until loom reads images; cache_control is
 * accepted and needs nothing (loom's prefix cache is automatic).
 */
#define _GNU_SOURCE
#include "anthropic_request.h"

#include "chat_body.h"
#include "openai_fields.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A text block's text appended to parts (a chat content array); -1 with b filled. */
static int add_text_part(cJSON *parts, const cJSON *block, const char *where, bad *b)
{
    static const char *const fields[] = {"type", "text", "cache_control", "citations", NULL};
    const char *text = field_string(block, "text", 1, where, b);
    if (!text || fields_only(block, fields, where, b))
        return -1;
    chat_text_part(parts, text);
    return 0;
}

/* "text", or text blocks (a system prompt, a tool result's content) as chat content parts */
static cJSON *text_or_blocks(const cJSON *v, const char *where, bad *b)
{
    char at[96];
    cJSON *parts = cJSON_CreateArray();
    if (cJSON_IsString(v)) {
        chat_text_part(parts, v->valuestring);
        return parts;
    }
    if (!cJSON_IsArray(v)) {
        cJSON_Delete(parts);
        request_fail(b, 400, where, "%s: must be a string or a list of text blocks, not %s", where,
                     json_type_name(v));
        return NULL;
    }
    int k = 0;
    for (const cJSON *block = v->child; block; block = block->next, k++) {
        snprintf(at, sizeof at, "%s.%d", where, k);
        const char *type = cJSON_IsObject(block) ? field_string(block, "type", 1, at, b) : NULL;
        if (!cJSON_IsObject(block))
            request_fail(b, 400, at, "%s: must be a block (an object), not %s", at,
                         json_type_name(block));
        else if (type && strcmp(type, "text"))
            request_fail(b, 400, at, "%s: a '%s' block cannot be here: only text blocks", at, type);
        if (!type || strcmp(type, "text") || add_text_part(parts, block, at, b)) {
            cJSON_Delete(parts);
            return NULL;
        }
    }
    return parts;
}

/* An assistant's tool_use block as an OpenAI tool call, added to calls. */
static int add_tool_use(cJSON *calls, const cJSON *block, const char *where, bad *b)
{
    static const char *const fields[] = {"type", "id", "name", "input", "cache_control", NULL};
    const char *id = field_string(block, "id", 1, where, b);
    const char *name = id ? field_string(block, "name", 1, where, b) : NULL;
    const cJSON *input = cJSON_GetObjectItemCaseSensitive(block, "input");
    if (!name || fields_only(block, fields, where, b))
        return -1;
    if (!cJSON_IsObject(input))
        return request_fail(b, 400, where, "%s.input: must be an object (the tool's arguments)",
                            where);
    char *args = cJSON_PrintUnformatted(input);
    if (!args)
        return request_fail(b, 500, NULL, "out of memory");
    chat_tool_call(calls, id, name, args);
    cJSON_free(args);
    return 0;
}

/* A user's tool_result block as a tool message, added to out. */
static int add_tool_result(cJSON *out, const cJSON *block, const char *where, bad *b)
{
    static const char *const fields[] = {"type",     "tool_use_id",   "content",
                                         "is_error", "cache_control", NULL};
    const char *id = field_string(block, "tool_use_id", 1, where, b);
    if (!id || fields_only(block, fields, where, b))
        return -1;
    const cJSON *content = cJSON_GetObjectItemCaseSensitive(block, "content");
    char at[128];
    snprintf(at, sizeof at, "%s.content", where);
    cJSON *parts = content ? text_or_blocks(content, at, b) : cJSON_CreateArray();
    if (!parts)
        return -1;
    chat_tool_result(out, id, parts);
    return 0;
}

/* messages[i] as chat messages appended to out: a user's tool results first (each its own
 * tool message), then its text; an assistant's text, thought and calls in one message. */
static int add_message(cJSON *out, const cJSON *msg, int i, bad *b)
{
    static const char *const fields[] = {"role", "content", NULL};
    char where[64], at[96];
    snprintf(where, sizeof where, "messages.%d", i);
    if (!cJSON_IsObject(msg))
        return request_fail(b, 400, where, "%s: must be an object with role and content", where);
    const char *role = field_string(msg, "role", 1, where, b);
    if (!role || fields_only(msg, fields, where, b))
        return -1;
    int assistant = !strcmp(role, "assistant");
    if (!assistant && strcmp(role, "user"))
        return request_fail(b, 400, where,
                            "%s.role: '%s' is not 'user' or 'assistant' (the system prompt is the "
                            "top-level 'system' field)",
                            where, role);
    const cJSON *content = cJSON_GetObjectItemCaseSensitive(msg, "content");
    snprintf(at, sizeof at, "%s.content", where);
    if (!content)
        return request_fail(b, 400, at, "%s: Field required", at);
    cJSON *parts = cJSON_CreateArray(), *calls = cJSON_CreateArray();
    char *thought = NULL;
    size_t thought_len = 0, thought_cap = 0;
    int rc = 0, k = 0;
    if (cJSON_IsString(content)) {
        chat_text_part(parts, content->valuestring);
    } else if (!cJSON_IsArray(content)) {
        rc = request_fail(b, 400, at, "%s: must be a string or a list of content blocks, not %s",
                          at, json_type_name(content));
    }
    for (const cJSON *block = cJSON_IsArray(content) ? content->child : NULL; block && !rc;
         block = block->next, k++) {
        snprintf(at, sizeof at, "%s.content.%d", where, k);
        const char *type = cJSON_IsObject(block) ? field_string(block, "type", 1, at, b) : NULL;
        if (!cJSON_IsObject(block))
            rc = request_fail(b, 400, at, "%s: must be a content block (an object), not %s", at,
                              json_type_name(block));
        else if (!type)
            rc = -1;
        else if (!strcmp(type, "text"))
            rc = add_text_part(parts, block, at, b);
        else if (!strcmp(type, "tool_use") && assistant)
            rc = add_tool_use(calls, block, at, b);
        else if (!strcmp(type, "tool_result") && !assistant)
            rc = add_tool_result(out, block, at, b);
        else if (!strcmp(type, "thinking") && assistant) {
            static const char *const thinking_fields[] = {"type", "thinking", "signature", NULL};
            const char *t = field_string(block, "thinking", 1, at, b);
            rc = !t || fields_only(block, thinking_fields, at, b) ? -1
                : buf_append(&thought, &thought_len, &thought_cap, t, strlen(t))
                ? request_fail(b, 500, NULL, "out of memory")
                : 0;
        } else if (!strcmp(type, "redacted_thinking") && assistant) {
            /* another server's encrypted thought: nothing loom's model can read */
        } else if (!strcmp(type, "image") || !strcmp(type, "document"))
            rc = request_fail(b, 400, at,
                              "%s: '%s' blocks are not supported: loom serve reads text only "
                              "for now",
                              at, type);
        else
            rc = request_fail(b, 400, at,
                              "%s: a '%s' block cannot be in %s message (a user's blocks: text, "
                              "tool_result; an assistant's: text, tool_use, thinking)",
                              at, type, assistant ? "an assistant" : "a user");
    }
    /* a user message of tool results alone adds no empty user turn */
    if (!rc && (cJSON_GetArraySize(parts) || cJSON_GetArraySize(calls) || assistant)) {
        int text = cJSON_GetArraySize(parts) || !cJSON_GetArraySize(calls);
        cJSON *m = chat_message(out, role, text ? parts : NULL);
        parts = text ? NULL : parts;
        if (thought)
            cJSON_AddStringToObject(m, "reasoning_content", thought);
        if (cJSON_GetArraySize(calls))
            cJSON_AddItemToObject(m, "tool_calls", calls), calls = NULL;
    }
    cJSON_Delete(parts);
    cJSON_Delete(calls);
    free(thought);
    return rc;
}

/* tools[] as function tools: custom tools only (Anthropic's server and client tools, a "type"
 * such as "web_search_20250305" or "bash_20250124", run on Anthropic's side or need its own
 * harness). */
static cJSON *function_tools(const cJSON *tools, bad *b)
{
    static const char *const fields[] = {"type",         "name",          "description",
                                         "input_schema", "cache_control", NULL};
    if (field_objects(tools, "tools", "tool", b))
        return NULL;
    cJSON *out = cJSON_CreateArray();
    int k = 0;
    for (const cJSON *t = tools->child; t; t = t->next, k++) {
        char at[48];
        snprintf(at, sizeof at, "tools.%d", k);
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(t, "type");
        if (type && (!cJSON_IsString(type) || strcmp(type->valuestring, "custom"))) {
            request_fail(b, 400, at,
                         "%s.type: '%s' is not a custom tool; Anthropic's own tools (web search, "
                         "bash, text editor, ...) are not run by loom: describe it as a custom "
                         "tool (name, description, input_schema)",
                         at, cJSON_IsString(type) ? type->valuestring : "?");
            goto bad;
        }
        const char *name = field_string(t, "name", 1, at, b);
        if (!name || fields_only(t, fields, at, b))
            goto bad;
        const cJSON *desc = cJSON_GetObjectItemCaseSensitive(t, "description");
        const cJSON *schema = cJSON_GetObjectItemCaseSensitive(t, "input_schema");
        if (desc && !cJSON_IsString(desc)) {
            request_fail(b, 400, at, "%s.description: must be a string", at);
            goto bad;
        }
        if (!cJSON_IsObject(schema)) {
            request_fail(b, 400, at, "%s.input_schema: %s", at,
                         schema ? "must be a JSON Schema object" : "Field required");
            goto bad;
        }
        chat_function_tool(out, name, desc, schema);
    }
    return out;
bad:
    cJSON_Delete(out);
    return NULL;
}

/* tool_choice into out's tool_choice (and parallel_tool_calls) */
static int tool_choice(cJSON *out, const cJSON *choice, bad *b)
{
    static const char *const fields[] = {"type", "name", "disable_parallel_tool_use", NULL};
    if (!cJSON_IsObject(choice))
        return request_fail(b, 400, "tool_choice",
                            "tool_choice: must be an object such as {\"type\": \"auto\"}, not %s",
                            json_type_name(choice));
    const char *type = field_string(choice, "type", 1, "tool_choice", b);
    if (!type || fields_only(choice, fields, "tool_choice", b))
        return -1;
    int serial = 0;
    if (field_bool(choice, "disable_parallel_tool_use", &serial, b) < 0)
        return -1;
    const char *name = cJSON_GetObjectItemCaseSensitive(choice, "name")
        ? field_string(choice, "name", 1, "tool_choice", b)
        : NULL;
    if (!strcmp(type, "tool") && !name)
        return request_fail(b, 400, "tool_choice",
                            "tool_choice: {\"type\": \"tool\"} needs the tool's 'name'");
    if (strcmp(type, "tool") && name)
        return request_fail(b, 400, "tool_choice",
                            "tool_choice.name: only {\"type\": \"tool\"} names a tool");
    if (!strcmp(type, "auto") || !strcmp(type, "none"))
        cJSON_AddStringToObject(out, "tool_choice", type);
    else if (!strcmp(type, "any"))
        cJSON_AddStringToObject(out, "tool_choice", "required");
    else if (!strcmp(type, "tool")) {
        cJSON *c = cJSON_AddObjectToObject(out, "tool_choice");
        cJSON_AddStringToObject(c, "type", "function");
        cJSON_AddStringToObject(cJSON_AddObjectToObject(c, "function"), "name", name);
    } else
        return request_fail(b, 400, "tool_choice",
                            "tool_choice.type: '%s' is not one of auto, any, tool, none", type);
    if (serial)
        cJSON_AddFalseToObject(out, "parallel_tool_calls");
    return 0;
}

/* thinking: {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}, for templates
 * that switch thinking with enable_thinking (Qwen3's, GLM's); the budget (at least 1024, less
 * than max_tokens, as Anthropic checks it) is loom's reasoning_budget. */
static int thinking(cJSON *out, const cJSON *t, double max_tokens, bad *b)
{
    static const char *const fields[] = {"type", "budget_tokens", NULL};
    if (!cJSON_IsObject(t))
        return request_fail(b, 400, "thinking", "thinking: must be an object, not %s",
                            json_type_name(t));
    const char *type = field_string(t, "type", 1, "thinking", b);
    if (!type || fields_only(t, fields, "thinking", b))
        return -1;
    int on = !strcmp(type, "enabled");
    if (!on && strcmp(type, "disabled"))
        return request_fail(b, 400, "thinking",
                            "thinking.type: '%s' is not 'enabled' or 'disabled'", type);
    const cJSON *budget = cJSON_GetObjectItemCaseSensitive(t, "budget_tokens");
    if (on && !budget)
        return request_fail(b, 400, "thinking", "thinking.budget_tokens: Field required");
    if (budget &&
        (!cJSON_IsNumber(budget) || budget->valuedouble < 1024 ||
         budget->valuedouble >= max_tokens ||
         budget->valuedouble != (double)(int64_t)budget->valuedouble))
        return request_fail(b, 400, "thinking",
                            "thinking.budget_tokens: must be a whole number of at least 1024 and "
                            "less than max_tokens (%.0f)",
                            max_tokens);
    cJSON *kw = cJSON_AddObjectToObject(out, "chat_template_kwargs");
    cJSON_AddBoolToObject(kw, "enable_thinking", on);
    if (on)
        cJSON_AddNumberToObject(out, "reasoning_budget", budget->valuedouble);
    return 0;
}

cJSON *anthropic_chat_request(const cJSON *body, int counting, bad *b)
{
    /* clang-format off */
    static const char *const fields[] = {
        "model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature",
        "top_p", "top_k", "tools", "tool_choice", "metadata", "thinking", "service_tier",
        "priority", "timeout", NULL};
    static const char *const counting_fields[] = {
        "model", "messages", "system", "tools", "tool_choice", "thinking", NULL};
    /* clang-format on */
    if (!cJSON_IsObject(body)) {
        request_fail(b, 400, NULL, "the request body must be a JSON object");
        return NULL;
    }
    if (fields_only(body, counting ? counting_fields : fields, NULL, b))
        return NULL;
    cJSON *out = cJSON_CreateObject();
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(body, "model");
    const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(body, "messages");
    const cJSON *system = cJSON_GetObjectItemCaseSensitive(body, "system");
    double max_tokens = 1, x;
    int r = 0, rc = -1;
    if (!cJSON_IsString(model)) {
        request_fail(b, 400, "model", "model: %s", model ? "must be a string" : "Field required");
        goto done;
    }
    cJSON_AddStringToObject(out, "model", model->valuestring);
    if (!counting) {
        if ((r = field_number(body, "max_tokens", 1, INT32_MAX, 1, &max_tokens, b)) < 0)
            goto done;
        if (!r) {
            request_fail(b, 400, "max_tokens", "max_tokens: Field required");
            goto done;
        }
        /* Anthropic's ranges: temperature 0 to 1 (OpenAI's goes to 2) */
        static const struct {
            const char *key;
            double lo, hi;
            int integer;
        } numbers[] = {{"temperature", 0, 1, 0}, {"top_p", 0, 1, 0}, {"top_k", 0, INT32_MAX, 1}};
        for (size_t i = 0; i < sizeof numbers / sizeof *numbers; i++) {
            if ((r = field_number(body, numbers[i].key, numbers[i].lo, numbers[i].hi,
                                  numbers[i].integer, &x, b)) < 0)
                goto done;
            if (r)
                cJSON_AddNumberToObject(out, numbers[i].key, x);
        }
        int stream = 0;
        if (field_bool(body, "stream", &stream, b) < 0)
            goto done;
        cJSON_AddBoolToObject(out, "stream", stream);
        const cJSON *stops = cJSON_GetObjectItemCaseSensitive(body, "stop_sequences");
        if (stops && !cJSON_IsNull(stops)) {
            int ok = cJSON_IsArray(stops) && cJSON_GetArraySize(stops) <= OPENAI_MAX_STOPS;
            for (const cJSON *s = ok ? stops->child : NULL; s; s = s->next)
                ok = ok && cJSON_IsString(s) && s->valuestring[0];
            if (!ok) {
                request_fail(b, 400, "stop_sequences",
                             "stop_sequences: must be a list of at most %d non-empty strings",
                             OPENAI_MAX_STOPS);
                goto done;
            }
            cJSON_AddItemToObject(out, "stop", cJSON_Duplicate(stops, 1));
        }
        const cJSON *meta = cJSON_GetObjectItemCaseSensitive(body, "metadata");
        if (meta && !cJSON_IsNull(meta)) {
            static const char *const meta_fields[] = {"user_id", NULL};
            if (!cJSON_IsObject(meta)) {
                request_fail(b, 400, "metadata", "metadata: must be an object");
                goto done;
            }
            if (fields_only(meta, meta_fields, "metadata", b))
                goto done;
            const cJSON *user = cJSON_GetObjectItemCaseSensitive(meta, "user_id");
            if (user && !cJSON_IsNull(user) && !cJSON_IsString(user)) {
                request_fail(b, 400, "metadata", "metadata.user_id: must be a string");
                goto done;
            }
            if (cJSON_IsString(user))
                cJSON_AddStringToObject(out, "user", user->valuestring);
        }
        const cJSON *tier = cJSON_GetObjectItemCaseSensitive(body, "service_tier");
        if (tier && !cJSON_IsString(tier)) {
            request_fail(b, 400, "service_tier", "service_tier: must be a string");
            goto done;
        }
        for (const char *const *k = (const char *const[]){"priority", "timeout", NULL}; *k; k++) {
            const cJSON *v = cJSON_GetObjectItemCaseSensitive(body, *k);
            if (v)
                cJSON_AddItemToObject(out, *k, cJSON_Duplicate(v, 1));
        }
    }
    cJSON_AddNumberToObject(out, "max_tokens", max_tokens);
    cJSON *chat = cJSON_AddArrayToObject(out, "messages");
    if (system && !cJSON_IsNull(system)) {
        cJSON *parts = text_or_blocks(system, "system", b);
        if (!parts)
            goto done;
        chat_message(chat, "system", parts);
    }
    if (!cJSON_IsArray(msgs) || !msgs->child) {
        request_fail(b, 400, "messages", "messages: %s",
                     !msgs                     ? "Field required"
                         : cJSON_IsArray(msgs) ? "at least one message is required"
                                               : "must be a list of messages");
        goto done;
    }
    int i = 0;
    for (const cJSON *m = msgs->child; m; m = m->next, i++)
        if (add_message(chat, m, i, b))
            goto done;
    const cJSON *tools = cJSON_GetObjectItemCaseSensitive(body, "tools");
    if (tools && !cJSON_IsNull(tools) && cJSON_GetArraySize(tools) > 0) {
        cJSON *t = function_tools(tools, b);
        if (!t)
            goto done;
        cJSON_AddItemToObject(out, "tools", t);
    } else if (tools && !cJSON_IsNull(tools) && !cJSON_IsArray(tools)) {
        request_fail(b, 400, "tools", "tools: must be a list");
        goto done;
    }
    const cJSON *choice = cJSON_GetObjectItemCaseSensitive(body, "tool_choice");
    if (choice && !cJSON_IsNull(choice) && tool_choice(out, choice, b))
        goto done;
    const cJSON *think = cJSON_GetObjectItemCaseSensitive(body, "thinking");
    if (think && !cJSON_IsNull(think) && thinking(out, think, counting ? 1e9 : max_tokens, b))
        goto done;
    rc = 0;
done:
    if (rc) {
        cJSON_Delete(out);
        return NULL;
    }
    return out;
}
