/*
 * tools/serve/responses.c - a job's answer in the shapes of OpenAI's Responses API: the whole
 * response (its output items: a reasoning item for a thought, a message with output_text, a
 * function_call per call), or its stream of events (response.created, per item an
 * output_item.added, its deltas and its done events, then response.completed or
 * response.incomplete), each with its sequence_number. The request came in through
 * tools/responses_request.c and ran as a chat.
 */
#define _GNU_SOURCE
#include "tools/serve/server.h"

#include "tools/openai_fields.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* the kinds of output item a stream has open (job.open_block) */
enum { ITEM_NONE, ITEM_REASONING, ITEM_MESSAGE };

/* an item's id: its kind's prefix and the response's own hex digits (k: a call's index) */
static void item_id(const job *j, const char *prefix, int k, char *id, size_t cap)
{
    const char *hex = strchr(j->id, '_') ? strchr(j->id, '_') + 1 : j->id;
    if (k >= 0)
        snprintf(id, cap, "%s%s_%d", prefix, hex, k);
    else
        snprintf(id, cap, "%s%s", prefix, hex);
}

static cJSON *usage_json(const job *j)
{
    const choice *c = &j->ch[0];
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "input_tokens", j->n_prompt);
    cJSON_AddNumberToObject(cJSON_AddObjectToObject(u, "input_tokens_details"), "cached_tokens",
                            j->n_cached);
    cJSON_AddNumberToObject(u, "output_tokens", c->n_generated);
    cJSON_AddNumberToObject(cJSON_AddObjectToObject(u, "output_tokens_details"), "reasoning_tokens",
                            c->reasoning_tokens);
    cJSON_AddNumberToObject(u, "total_tokens", j->n_prompt + c->n_generated);
    return u;
}

/* the response object: status "in_progress" (the stream's first events, no output yet),
 * else the answer's */
static cJSON *response_object(const job *j, const char *status)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", j->id);
    cJSON_AddStringToObject(o, "object", "response");
    cJSON_AddNumberToObject(o, "created_at", (double)j->created);
    cJSON_AddStringToObject(o, "status", status);
    cJSON_AddNullToObject(o, "error");
    cJSON_AddNullToObject(o, "incomplete_details");
    json_add_text(o, "model", j->sv->api.model_name, strlen(j->sv->api.model_name));
    cJSON_AddArrayToObject(o, "output");
    cJSON_AddBoolToObject(o, "parallel_tool_calls", j->parallel_tool_calls);
    if (j->previous_id[0])
        cJSON_AddStringToObject(o, "previous_response_id", j->previous_id);
    else
        cJSON_AddNullToObject(o, "previous_response_id");
    cJSON_AddBoolToObject(o, "store", j->conversation != NULL);
    cJSON_AddObjectToObject(o, "metadata");
    if (strcmp(status, "in_progress"))
        cJSON_AddItemToObject(o, "usage", usage_json(j));
    else
        cJSON_AddNullToObject(o, "usage");
    return o;
}

static cJSON *text_item(const char *type, const char *field, const char *text, size_t len)
{
    cJSON *p = cJSON_CreateObject();
    cJSON_AddStringToObject(p, "type", type);
    json_add_text(p, field, text, len);
    if (!strcmp(type, "output_text"))
        cJSON_AddArrayToObject(p, "annotations");
    return p;
}

static cJSON *reasoning_item(const job *j, const char *text, size_t len, int done)
{
    char id[64];
    item_id(j, "rs_", -1, id, sizeof id);
    cJSON *it = cJSON_CreateObject();
    cJSON_AddStringToObject(it, "type", "reasoning");
    cJSON_AddStringToObject(it, "id", id);
    cJSON_AddArrayToObject(it, "summary");
    cJSON *content = cJSON_AddArrayToObject(it, "content");
    if (done)
        cJSON_AddItemToArray(content, text_item("reasoning_text", "text", text, len));
    return it;
}

static cJSON *message_item(const job *j, const char *text, size_t len, int done)
{
    char id[64];
    item_id(j, "msg_", -1, id, sizeof id);
    cJSON *it = cJSON_CreateObject();
    cJSON_AddStringToObject(it, "type", "message");
    cJSON_AddStringToObject(it, "id", id);
    cJSON_AddStringToObject(it, "status", done ? "completed" : "in_progress");
    cJSON_AddStringToObject(it, "role", "assistant");
    cJSON *content = cJSON_AddArrayToObject(it, "content");
    if (done)
        cJSON_AddItemToArray(content, text_item("output_text", "text", text, len));
    return it;
}

static cJSON *call_item(const job *j, const loom_tool_call *call, int k, int done)
{
    char id[64], call_id[64];
    item_id(j, "fc_", k, id, sizeof id);
    job_call_id(j, call, "call_", call_id, sizeof call_id);
    cJSON *it = cJSON_CreateObject();
    cJSON_AddStringToObject(it, "type", "function_call");
    cJSON_AddStringToObject(it, "id", id);
    cJSON_AddStringToObject(it, "call_id", call_id);
    json_add_text(it, "name", call->name, strlen(call->name));
    json_add_text(it, "arguments", done ? call->arguments : "", done ? strlen(call->arguments) : 0);
    cJSON_AddStringToObject(it, "status", done ? "completed" : "in_progress");
    return it;
}

cJSON *responses_response(job *j)
{
    const choice *c = &j->ch[0];
    loom_reasoning r;
    loom_tool_calls tc;
    job_answer_parts(j, c, &r, &tc);
    int cut = !strcmp(c->finish, "length");
    cJSON *o = response_object(j, cut ? "incomplete" : "completed");
    cJSON *out = cJSON_GetObjectItem(o, "output");
    if (cut) {
        cJSON *why = cJSON_CreateObject();
        cJSON_AddStringToObject(why, "reason", "max_output_tokens");
        cJSON_ReplaceItemInObject(o, "incomplete_details", why);
    }
    if (r.end > r.start)
        cJSON_AddItemToArray(out, reasoning_item(j, c->text + r.start, r.end - r.start, 1));
    if (tc.content_len || !tc.n_calls)
        cJSON_AddItemToArray(
            out, message_item(j, c->text ? c->text + r.content : "", tc.content_len, 1));
    for (int k = 0; k < tc.n_calls; k++)
        cJSON_AddItemToArray(out, call_item(j, &tc.calls[k], k, 1));
    loom_tool_calls_free(&tc);
    return o;
}

/* The answer as the chat assistant message a later request's history holds: its text, its
 * thought as reasoning_content, its calls as tool_calls. (The response's texts are json_text's
 * raw JSON: read back as strings.) */
static cJSON *assistant_message(const cJSON *response)
{
    cJSON *m = cJSON_CreateObject(), *calls = cJSON_CreateArray();
    cJSON_AddStringToObject(m, "role", "assistant");
    int text = 0;
    const cJSON *item;
    cJSON_ArrayForEach (item, cJSON_GetObjectItem(response, "output")) {
        const char *type = cJSON_GetObjectItem(item, "type")->valuestring;
        const cJSON *part = cJSON_GetArrayItem(cJSON_GetObjectItem(item, "content"), 0);
        cJSON *t = part ? cJSON_Parse(cJSON_GetObjectItem(part, "text")->valuestring) : NULL;
        if (!strcmp(type, "message") && cJSON_IsString(t)) {
            cJSON_AddStringToObject(m, "content", t->valuestring);
            text = 1;
        } else if (!strcmp(type, "reasoning") && cJSON_IsString(t)) {
            cJSON_AddStringToObject(m, "reasoning_content", t->valuestring);
        } else if (!strcmp(type, "function_call")) {
            cJSON *name = cJSON_Parse(cJSON_GetObjectItem(item, "name")->valuestring);
            cJSON *args = cJSON_Parse(cJSON_GetObjectItem(item, "arguments")->valuestring);
            cJSON *c = cJSON_CreateObject(), *f;
            cJSON_AddStringToObject(c, "id", cJSON_GetObjectItem(item, "call_id")->valuestring);
            cJSON_AddStringToObject(c, "type", "function");
            f = cJSON_AddObjectToObject(c, "function");
            cJSON_AddStringToObject(f, "name", cJSON_IsString(name) ? name->valuestring : "");
            cJSON_AddStringToObject(f, "arguments",
                                    cJSON_IsString(args) ? args->valuestring : "{}");
            cJSON_AddItemToArray(calls, c);
            cJSON_Delete(name), cJSON_Delete(args);
        }
        cJSON_Delete(t);
    }
    if (!text)
        cJSON_AddNullToObject(m, "content");
    if (cJSON_GetArraySize(calls))
        cJSON_AddItemToObject(m, "tool_calls", calls);
    else
        cJSON_Delete(calls);
    return m;
}

void responses_keep(job *j, const cJSON *response)
{
    if (!j->conversation)
        return;
    cJSON *conversation = j->conversation;
    j->conversation = NULL;
    cJSON_AddItemToArray(conversation, assistant_message(response));
    stored_put(j->srv, j->id, conversation, cJSON_Duplicate(response, 1));
}

int responses_continue(server *srv, cJSON *chat, const char *previous, bad *b)
{
    cJSON *history = stored_get(srv, previous, 1);
    if (!history)
        return request_fail(b, 404, "previous_response_id",
                            "previous_response_id '%s': no such stored response (never stored, "
                            "deleted, or dropped past --responses-max %d)",
                            previous, srv->stored_max);
    /* this request's instructions (its leading system messages) first, the history without
     * its own, then this input */
    cJSON *msgs = cJSON_DetachItemFromObjectCaseSensitive(chat, "messages");
    cJSON *merged = cJSON_CreateArray(), *m;
    while ((m = cJSON_GetArrayItem(msgs, 0)) &&
           !strcmp(cJSON_GetObjectItem(m, "role")->valuestring, "system"))
        cJSON_AddItemToArray(merged, cJSON_DetachItemFromArray(msgs, 0));
    while ((m = cJSON_DetachItemFromArray(history, 0))) {
        const cJSON *role = cJSON_GetObjectItem(m, "role");
        if (cJSON_IsString(role) && !strcmp(role->valuestring, "system"))
            cJSON_Delete(m);
        else
            cJSON_AddItemToArray(merged, m);
    }
    while ((m = cJSON_DetachItemFromArray(msgs, 0)))
        cJSON_AddItemToArray(merged, m);
    cJSON_Delete(msgs), cJSON_Delete(history);
    cJSON_AddItemToObject(chat, "messages", merged);
    return 0;
}

/* an event {"type": type, "sequence_number": n, ...}: the object to fill, sent by event_send */
static cJSON *event_new(job *j, const char *type)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", type);
    cJSON_AddNumberToObject(o, "sequence_number", j->events_sent++);
    return o;
}

static void event_send(job *j, cJSON *o)
{
    char type[64];
    snprintf(type, sizeof type, "%s", cJSON_GetObjectItem(o, "type")->valuestring);
    job_sse(j, type, o);
}

/* an event about output item `index` (its id too, when given) */
static cJSON *item_event(job *j, const char *type, int index, const char *id)
{
    cJSON *o = event_new(j, type);
    if (id)
        cJSON_AddStringToObject(o, "item_id", id);
    cJSON_AddNumberToObject(o, "output_index", index);
    return o;
}

static void item_added(job *j, cJSON *item, int kind)
{
    cJSON *o = item_event(j, "response.output_item.added", j->blocks_sent++, NULL);
    cJSON_AddItemToObject(o, "item", item);
    event_send(j, o);
    j->open_block = kind;
    if (kind == ITEM_MESSAGE) {
        char id[64];
        item_id(j, "msg_", -1, id, sizeof id);
        o = item_event(j, "response.content_part.added", j->blocks_sent - 1, id);
        cJSON_AddNumberToObject(o, "content_index", 0);
        cJSON_AddItemToObject(o, "part", text_item("output_text", "text", "", 0));
        event_send(j, o);
    }
}

/* the open item's done events: its text is what the stream sent of it (c's thought, or its
 * answer from the thought's end to what was sent) */
static void item_done(job *j, const choice *c)
{
    if (j->open_block == ITEM_NONE)
        return;
    loom_reasoning r = {0};
    if (j->reasoning && c->text)
        loom_reasoning_find(c->text, c->len, j->reasoning == 2, c->done, &r);
    int message = j->open_block == ITEM_MESSAGE, index = j->blocks_sent - 1;
    const char *text = c->text ? c->text + (message ? r.content : r.start) : "";
    size_t len = message ? c->sent - r.content : r.end - r.start;
    cJSON *item = message ? message_item(j, text, len, 1) : reasoning_item(j, text, len, 1);
    const char *id = cJSON_GetObjectItem(item, "id")->valuestring;
    cJSON *o = item_event(j, message ? "response.output_text.done" : "response.reasoning_text.done",
                          index, id);
    cJSON_AddNumberToObject(o, "content_index", 0);
    json_add_text(o, "text", text, len);
    event_send(j, o);
    if (message) {
        o = item_event(j, "response.content_part.done", index, id);
        cJSON_AddNumberToObject(o, "content_index", 0);
        cJSON_AddItemToObject(o, "part", text_item("output_text", "text", text, len));
        event_send(j, o);
    }
    o = item_event(j, "response.output_item.done", index, NULL);
    cJSON_AddItemToObject(o, "item", item);
    event_send(j, o);
    j->open_block = ITEM_NONE;
}

static void delta(job *j, const char *type, const char *text, size_t len)
{
    char id[64];
    item_id(j, j->open_block == ITEM_MESSAGE ? "msg_" : "rs_", -1, id, sizeof id);
    cJSON *o = item_event(j, type, j->blocks_sent - 1, id);
    cJSON_AddNumberToObject(o, "content_index", 0);
    json_add_text(o, "delta", text, len);
    event_send(j, o);
}

void responses_stream_format(job *j)
{
    choice *c = &j->ch[0];
    if (!j->role_sent) {
        for (int k = 0; k < 2; k++) {
            cJSON *o = event_new(j, k ? "response.in_progress" : "response.created");
            cJSON_AddItemToObject(o, "response", response_object(j, "in_progress"));
            event_send(j, o);
        }
        j->role_sent = 1;
    }
    ready_parts rp;
    job_take_ready(j, c, &rp);
    /* the whole response, once done: what the done events and the last one carry */
    cJSON *whole = rp.final && !c->error[0] ? responses_response(j) : NULL;
    const cJSON *final_output = cJSON_GetObjectItem(whole, "output");
    if (rp.thought_len) {
        if (j->open_block != ITEM_REASONING)
            item_added(j, reasoning_item(j, "", 0, 0), ITEM_REASONING);
        delta(j, "response.reasoning_text.delta", rp.thought, rp.thought_len);
    }
    if (rp.text_len) {
        if (j->open_block != ITEM_MESSAGE) {
            item_done(j, c);
            item_added(j, message_item(j, "", 0, 0), ITEM_MESSAGE);
        }
        delta(j, "response.output_text.delta", rp.text, rp.text_len);
    }
    if (rp.final) {
        if (!whole) {
            cJSON *o = event_new(j, "error");
            cJSON_AddStringToObject(o, "code", "server_error");
            json_add_text(o, "message", c->error, strlen(c->error));
            event_send(j, o);
        } else {
            item_done(j, c);
            /* items the stream has not begun: an empty message, the calls */
            for (int index = j->blocks_sent; index < cJSON_GetArraySize(final_output); index++) {
                cJSON *item = cJSON_Duplicate(cJSON_GetArrayItem(final_output, index), 1);
                const char *type = cJSON_GetObjectItem(item, "type")->valuestring;
                if (!strcmp(type, "function_call")) {
                    cJSON *begun = cJSON_Duplicate(item, 1);
                    cJSON_ReplaceItemInObject(begun, "arguments", cJSON_CreateString(""));
                    cJSON_ReplaceItemInObject(begun, "status", cJSON_CreateString("in_progress"));
                    item_added(j, begun, ITEM_NONE);
                    const char *id = cJSON_GetObjectItem(item, "id")->valuestring;
                    const cJSON *args = cJSON_GetObjectItem(item, "arguments");
                    /* (the arguments are json_text's: copied as JSON, not as C text) */
                    cJSON *o = item_event(j, "response.function_call_arguments.delta", index, id);
                    cJSON_AddItemToObject(o, "delta", cJSON_Duplicate(args, 1));
                    event_send(j, o);
                    o = item_event(j, "response.function_call_arguments.done", index, id);
                    cJSON_AddItemToObject(o, "arguments", cJSON_Duplicate(args, 1));
                    event_send(j, o);
                    o = item_event(j, "response.output_item.done", index, NULL);
                    cJSON_AddItemToObject(o, "item", item);
                    event_send(j, o);
                } else {
                    cJSON_Delete(item);
                    item_added(j, message_item(j, "", 0, 0), ITEM_MESSAGE);
                    item_done(j, c);
                }
            }
            const char *status = cJSON_GetObjectItem(whole, "status")->valuestring;
            responses_keep(j, whole);
            cJSON *o = event_new(
                j, strcmp(status, "completed") ? "response.incomplete" : "response.completed");
            cJSON_AddItemToObject(o, "response", whole);
            whole = NULL;
            event_send(j, o);
        }
        j->finished = 1;
    }
    cJSON_Delete(whole);
    loom_tool_calls_free(&rp.calls);
}
