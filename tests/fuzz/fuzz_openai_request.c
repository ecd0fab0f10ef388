/*
 * tests/fuzz/fuzz_openai_request.c - libFuzzer harness for what `loom serve` does with a
 * request body before the engine sees it: openai_parse_body (UTF-8, NUL, trailing data), then
 * openai_parse_request for completions and for chat, which renders the chat template and
 * tokenizes, and the body read as Anthropic's Messages API (anthropic_chat_request, as a
 * message and as count_tokens) and as OpenAI's Responses API (responses_chat_request), then as
 * the chat each becomes. Any bytes must give a request or an error with a 4xx/5xx status, never a crash.
 * The model is LOOM_FUZZ_MODEL (stories260K), opened once on the reference backend.
 */
#include "tools/anthropic_request.h"
#include "tools/openai_request.h"
#include "tools/responses_request.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static openai_model srv;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc, (void)argv;
    const char *path = getenv("LOOM_FUZZ_MODEL");
    char err[1024];
    loom_model_options o = {.n_ctx = 256};
    if (!path || !(srv.model = loom_model_open(path, &o, err, sizeof err))) {
        fprintf(stderr, "fuzz_openai_request: LOOM_FUZZ_MODEL: %s\n", path ? err : "not set");
        exit(1);
    }
    srv.defaults = openai_default_sampling();
    static loom_chat_format chat; /* the model's own Jinja template, as loom serve chooses */
    srv.model_name = "m";
    if (loom_chat_format_choose(srv.model, NULL, NULL, &chat, err, sizeof err) != 0) {
        fprintf(stderr, "fuzz_openai_request: %s\n", err);
        exit(1);
    }
    srv.chat = &chat;
    srv.n_ctx = loom_model_n_ctx(srv.model);
    srv.max_prompt_bytes = loom_model_max_prompt_bytes(srv.model);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    bad b = {0};
    /* the value cap loom serve gives a 2048-token context */
    cJSON *root = openai_parse_body((const char *)data, size, 2 * 2048 + 4096, &b);
    if (!root) {
        if (b.status < 400 || b.status > 599 || !b.msg[0])
            __builtin_trap(); /* a refusal must say why, with an error status */
        return 0;
    }
    /* completions, chat, Anthropic's messages and count_tokens, and responses (as the chat
     * they become) */
    for (int form = 0; form < 5; form++) {
        int chat = form > 0;
        srv.parse_special = size > 0 && (data[0] & 1);
        parsed p = {0};
        bad pb = {0};
        cJSON *as_chat = form == 4 ? responses_chat_request(root, &pb)
            : form >= 2            ? anthropic_chat_request(root, form == 3, &pb)
                                   : NULL;
        if (form >= 2 && !as_chat) {
            if (pb.status < 400 || pb.status > 599 || !pb.msg[0])
                __builtin_trap();
            continue;
        }
        int rc = openai_parse_request(&srv, as_chat ? as_chat : root, chat, &p, &pb);
        cJSON_Delete(as_chat);
        if (rc != 0) {
            if (pb.status < 400 || pb.status > 599 || !pb.msg[0])
                __builtin_trap();
        } else if (p.n_ids <= 0 || p.n_ids >= srv.n_ctx || !p.ids) {
            __builtin_trap(); /* an accepted request has a prompt that fits */
        }
        openai_parsed_free(&p);
    }
    cJSON_Delete(root);
    return 0;
}
