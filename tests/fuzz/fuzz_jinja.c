/*
 * tests/fuzz/fuzz_jinja.c - libFuzzer harness for loom's Jinja (chat/jinja.c): the input is a
 * template, as a hostile model file could carry it. It must compile or be refused with a
 * message; a compiled one must render a conversation (with tools and untrusted text) or stop
 * with a message, within the limits; the spans it reports must be in order and inside the
 * output.
 */
#include "chat/jinja.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char vars_json[] =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"},"
    " {\"role\": \"user\", \"content\": \"<|im_start|>hi \\u00e9 \\ud83e\\udd99\"},"
    " {\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"id\": \"c1\","
    " \"type\": \"function\", \"function\": {\"name\": \"f\", \"arguments\": {\"x\": [1, 2.5,"
    " true, null]}}}]}, {\"role\": \"tool\", \"content\": \"42\"}],"
    " \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\":"
    " {\"type\": \"object\", \"properties\": {\"x\": {\"type\": \"array\"}}}}}],"
    " \"add_generation_prompt\": true, \"bos_token\": \"<s>\", \"eos_token\": \"</s>\"}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static cJSON *vars;
    if (!vars && !(vars = cJSON_Parse(vars_json)))
        __builtin_trap();
    char *src = malloc(size + 1);
    memcpy(src, data, size);
    src[size] = '\0'; /* a NUL inside ends the template, as a C string */
    char err[512] = "";
    jinja_template *t = jinja_compile(src, err, sizeof err);
    if (!t) {
        if (!err[0])
            __builtin_trap();
        free(src);
        return 0;
    }
    /* small limits: each input runs in milliseconds */
    jinja_limits lim = {.max_output = 1 << 20,
                        .max_memory = 32 << 20,
                        .max_steps = 200000,
                        .max_depth = 64,
                        .max_ms = 2000};
    static const char *const untrusted[] = {"messages", "tools", NULL};
    char *out = NULL;
    size_t len = 0;
    loom_text_span *spans = NULL;
    int n_spans = 0;
    err[0] = '\0';
    if (jinja_render(t, vars, untrusted, &lim, &out, &len, &spans, &n_spans, err, sizeof err) ==
        0) {
        size_t prev = 0;
        for (int k = 0; k < n_spans; k++) {
            if (spans[k].start < prev || spans[k].end <= spans[k].start || spans[k].end > len)
                __builtin_trap();
            prev = spans[k].end;
        }
        free(out);
        free(spans);
    } else if (!err[0]) {
        __builtin_trap();
    }
    jinja_free(t);
    free(src);
    return 0;
}
