/*
 * tools/chat_body.h - the pieces of an OpenAI chat completions request body, as the rewriters of
 * other APIs' requests (tools/anthropic_request.c, tools/responses_request.c) write them: a
 * message, a text part, a tool call, a tool message, a function tool. Each is appended to the
 * array given and returned; the values are copied.
 */
#ifndef LOOM_TOOLS_CHAT_BODY_H
#define LOOM_TOOLS_CHAT_BODY_H

#include <cjson/cJSON.h>

/* {"role": role, "content": content}; content NULL: null (an assistant's beside calls) */
static inline cJSON *chat_message(cJSON *messages, const char *role, cJSON *content)
{
    cJSON *m = cJSON_CreateObject();
    cJSON_AddItemToArray(messages, m);
    cJSON_AddStringToObject(m, "role", role);
    cJSON_AddItemToObject(m, "content", content ? content : cJSON_CreateNull());
    return m;
}

/* {"type": "text", "text": text} */
static inline cJSON *chat_text_part(cJSON *parts, const char *text)
{
    cJSON *p = cJSON_CreateObject();
    cJSON_AddItemToArray(parts, p);
    cJSON_AddStringToObject(p, "type", "text");
    cJSON_AddStringToObject(p, "text", text);
    return p;
}

/* {"id", "type": "function", "function": {"name", "arguments": JSON text}} */
static inline cJSON *chat_tool_call(cJSON *calls, const char *id, const char *name,
                                    const char *arguments)
{
    cJSON *t = cJSON_CreateObject(), *f;
    cJSON_AddItemToArray(calls, t);
    cJSON_AddStringToObject(t, "id", id);
    cJSON_AddStringToObject(t, "type", "function");
    f = cJSON_AddObjectToObject(t, "function");
    cJSON_AddStringToObject(f, "name", name);
    cJSON_AddStringToObject(f, "arguments", arguments);
    return t;
}

/* {"role": "tool", "tool_call_id": id, "content": content} */
static inline cJSON *chat_tool_result(cJSON *messages, const char *id, cJSON *content)
{
    cJSON *m = chat_message(messages, "tool", content);
    cJSON_AddStringToObject(m, "tool_call_id", id);
    return m;
}

/* {"type": "function", "function": {"name", "description", "parameters"}} (description and
 * parameters copied when given) */
static inline cJSON *chat_function_tool(cJSON *tools, const char *name, const cJSON *description,
                                        const cJSON *parameters)
{
    cJSON *o = cJSON_CreateObject(), *f;
    cJSON_AddItemToArray(tools, o);
    cJSON_AddStringToObject(o, "type", "function");
    f = cJSON_AddObjectToObject(o, "function");
    cJSON_AddStringToObject(f, "name", name);
    if (description && !cJSON_IsNull(description))
        cJSON_AddItemToObject(f, "description", cJSON_Duplicate(description, 1));
    if (parameters && !cJSON_IsNull(parameters))
        cJSON_AddItemToObject(f, "parameters", cJSON_Duplicate(parameters, 1));
    return o;
}

#endif
