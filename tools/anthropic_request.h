/*
 * tools/anthropic_request.h - an Anthropic Messages request (POST /v1/messages, and
 * /v1/messages/count_tokens) checked by Anthropic's rules and rewritten as the OpenAI chat
 * request that asks loom the same, so one parser, one template path and one engine serve both
 * APIs. tools/serve/messages.c shapes the answers.
 */
#ifndef LOOM_TOOLS_ANTHROPIC_REQUEST_H
#define LOOM_TOOLS_ANTHROPIC_REQUEST_H

#include "openai_request.h"

#include <cjson/cJSON.h>

/* body as a /v1/messages request (counting: a count_tokens body, which has no max_tokens and
 * no sampling) rewritten as a chat completions request: a new tree, or NULL with b filled, its
 * param naming Anthropic's field ("messages.2.content.0.type", "tool_choice"). */
cJSON *anthropic_chat_request(const cJSON *body, int counting, bad *b);

#endif
