/*
 * tools/responses_request.h - an OpenAI Responses API request (POST /v1/responses) checked and
 * rewritten as the chat completions request that asks loom the same, as
 * tools/anthropic_request.h does for Anthropic's; tools/serve/responses.c shapes the answers.
 */
#ifndef LOOM_TOOLS_RESPONSES_REQUEST_H
#define LOOM_TOOLS_RESPONSES_REQUEST_H

#include "openai_request.h"

#include <cjson/cJSON.h>

/* body as a /v1/responses request rewritten as a chat completions request: a new tree, or
 * NULL with b filled, its param naming the Responses field ("input.2.content.0.type"). */
cJSON *responses_chat_request(const cJSON *body, bad *b);

#endif
