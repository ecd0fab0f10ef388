/*
 * tools/serve/messages.c - a job's answer in the shapes of Anthropic's Messages API: the whole
 * message, or its stream of events (message_start; per content block a start, deltas and a
 * stop; message_delta with the stop reason and usage; message_stop). The request came in
 * through tools/anthropic_request.c and ran as a chat; its thought is a thinking block, its
 * text a text block, its calls tool_use blocks.
 */
#define _GNU_SOURCE
#include "tools/serve/server.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* the kinds of content block a stream has open (job.open_block) */
enum { BLOCK_NONE, BLOCK_THINKING, BLOCK_TEXT, BLOCK_TOOL_USE };

const char *messages_stop_reason(const choice *c, int calls)
{
    if (!strcmp(c->finish, "length"))
        return "max_tokens";
    if (calls)
        return "tool_use";
    return c->stop_string ? "stop_sequence" : "end_turn";
}

static void add_stop_sequence(cJSON *o, const job *j, const choice *c)
{
    const char *s = c->stop_string > 0 && c->stop_string <= OPENAI_MAX_STOPS &&
            strcmp(c->finish, "length")
        ? j->stops[c->stop_string - 1]
        : NULL;
    if (s)
        json_add_text(o, "stop_sequence", s, strlen(s));
    else
        cJSON_AddNullToObject(o, "stop_sequence");
}

/* Anthropic counts the prompt's tokens read from its cache apart from the rest */
static cJSON *usage_json(const job *j, int with_output)
{
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "input_tokens", j->n_prompt - j->n_cached);
    cJSON_AddNumberToObject(u, "cache_creation_input_tokens", 0);
    cJSON_AddNumberToObject(u, "cache_read_input_tokens", j->n_cached);
    cJSON_AddNumberToObject(u, "output_tokens", with_output ? j->ch[0].n_generated : 0);
    return u;
}

/* the message object without its stop reason (stream: "message_start"'s) */
static cJSON *message_head(const job *j)
{
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "id", j->id);
    cJSON_AddStringToObject(m, "type", "message");
    cJSON_AddStringToObject(m, "role", "assistant");
    json_add_text(m, "model", j->sv->api.model_name, strlen(j->sv->api.model_name));
    cJSON_AddArrayToObject(m, "content");
    return m;
}

/* a tool_use block for call (input: its arguments, a JSON object's text, or {} when streamed:
 * the arguments follow as input_json_delta) */
static cJSON *tool_use_block(const job *j, const loom_tool_call *call, int with_input)
{
    char id[64];
    job_call_id(j, call, "toolu_", id, sizeof id);
    cJSON *b = cJSON_CreateObject();
    cJSON_AddStringToObject(b, "type", "tool_use");
    cJSON_AddStringToObject(b, "id", id);
    json_add_text(b, "name", call->name, strlen(call->name));
    cJSON *input = with_input ? cJSON_Parse(call->arguments) : NULL;
    cJSON_AddItemToObject(b, "input", cJSON_IsObject(input) ? input : cJSON_CreateObject());
    if (input && !cJSON_IsObject(input))
        cJSON_Delete(input);
    return b;
}

cJSON *messages_response(job *j)
{
    const choice *c = &j->ch[0];
    loom_reasoning r;
    loom_tool_calls tc;
    job_answer_parts(j, c, &r, &tc);
    cJSON *m = message_head(j), *content = cJSON_GetObjectItem(m, "content");
    if (r.end > r.start) {
        cJSON *b = cJSON_CreateObject();
        cJSON_AddStringToObject(b, "type", "thinking");
        json_add_text(b, "thinking", c->text + r.start, r.end - r.start);
        cJSON_AddStringToObject(b, "signature", "");
        cJSON_AddItemToArray(content, b);
    }
    if (tc.content_len) {
        cJSON *b = cJSON_CreateObject();
        cJSON_AddStringToObject(b, "type", "text");
        json_add_text(b, "text", c->text + r.content, tc.content_len);
        cJSON_AddItemToArray(content, b);
    }
    for (int k = 0; k < tc.n_calls; k++)
        cJSON_AddItemToArray(content, tool_use_block(j, &tc.calls[k], 1));
    cJSON_AddStringToObject(m, "stop_reason", messages_stop_reason(c, tc.n_calls > 0));
    add_stop_sequence(m, j, c);
    cJSON_AddItemToObject(m, "usage", usage_json(j, 1));
    loom_tool_calls_free(&tc);
    return m;
}

/* an event {"type": type, ...}: the object to fill, sent by event_send */
static cJSON *event_new(const char *type)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", type);
    return o;
}

static void event_send(job *j, cJSON *o)
{
    char type[32];
    snprintf(type, sizeof type, "%s", cJSON_GetObjectItem(o, "type")->valuestring);
    job_sse(j, type, o);
}

static void block_stop(job *j)
{
    if (j->open_block == BLOCK_NONE)
        return;
    cJSON *o = event_new("content_block_stop");
    cJSON_AddNumberToObject(o, "index", j->blocks_sent - 1);
    event_send(j, o);
    j->open_block = BLOCK_NONE;
}

/* begins content block `block` (its object, given away) as the next index */
static void block_start(job *j, cJSON *block, int kind)
{
    block_stop(j);
    cJSON *o = event_new("content_block_start");
    cJSON_AddNumberToObject(o, "index", j->blocks_sent++);
    cJSON_AddItemToObject(o, "content_block", block);
    event_send(j, o);
    j->open_block = kind;
}

/* a delta of the open block: {"type": type, field: text} */
static void block_delta(job *j, const char *type, const char *field, const char *text, size_t len)
{
    cJSON *o = event_new("content_block_delta"), *d;
    cJSON_AddNumberToObject(o, "index", j->blocks_sent - 1);
    d = cJSON_AddObjectToObject(o, "delta");
    cJSON_AddStringToObject(d, "type", type);
    json_add_text(d, field, text, len);
    event_send(j, o);
}

void messages_stream_format(job *j)
{
    choice *c = &j->ch[0];
    if (!j->role_sent) {
        cJSON *o = event_new("message_start"), *m = message_head(j);
        cJSON_AddNullToObject(m, "stop_reason");
        cJSON_AddNullToObject(m, "stop_sequence");
        cJSON_AddItemToObject(m, "usage", usage_json(j, 0));
        cJSON_AddItemToObject(o, "message", m);
        event_send(j, o);
        j->role_sent = 1;
    }
    ready_parts rp;
    job_take_ready(j, c, &rp);
    if (rp.thought_len) {
        if (j->open_block != BLOCK_THINKING) {
            cJSON *b = cJSON_CreateObject();
            cJSON_AddStringToObject(b, "type", "thinking");
            cJSON_AddStringToObject(b, "thinking", "");
            cJSON_AddStringToObject(b, "signature", "");
            block_start(j, b, BLOCK_THINKING);
        }
        block_delta(j, "thinking_delta", "thinking", rp.thought, rp.thought_len);
    }
    if (rp.text_len) {
        if (j->open_block != BLOCK_TEXT) {
            cJSON *b = cJSON_CreateObject();
            cJSON_AddStringToObject(b, "type", "text");
            cJSON_AddStringToObject(b, "text", "");
            block_start(j, b, BLOCK_TEXT);
        }
        block_delta(j, "text_delta", "text", rp.text, rp.text_len);
    }
    if (rp.final) {
        block_stop(j);
        if (c->error[0]) {
            cJSON *o = event_new("error"), *e = cJSON_AddObjectToObject(o, "error");
            cJSON_AddStringToObject(e, "type", "api_error");
            json_add_text(e, "message", c->error, strlen(c->error));
            event_send(j, o);
        } else {
            for (int k = 0; k < rp.calls.n_calls; k++) {
                const loom_tool_call *call = &rp.calls.calls[k];
                block_start(j, tool_use_block(j, call, 0), BLOCK_TOOL_USE);
                block_delta(j, "input_json_delta", "partial_json", call->arguments,
                            strlen(call->arguments));
                block_stop(j);
            }
            cJSON *o = event_new("message_delta"), *d = cJSON_AddObjectToObject(o, "delta");
            cJSON_AddStringToObject(d, "stop_reason",
                                    messages_stop_reason(c, rp.calls.n_calls > 0));
            add_stop_sequence(d, j, c);
            cJSON_AddItemToObject(o, "usage",
                                  usage_json(j, 1)); /* the cache's share is known now */
            event_send(j, o);
            event_send(j, event_new("message_stop"));
        }
        j->finished = 1;
    }
    loom_tool_calls_free(&rp.calls);
}
