/*
 * tests/fuzz/fuzz_grammar.c - libFuzzer harness for constrained decoding's grammars: the input
 * is a GBNF grammar (first byte even) or a JSON Schema (odd; with bit 1 set too, a string
 * schema's "pattern": a regular expression), as a request's "grammar" or response_format
 * carries it. It must compile or be refused with a message; a schema loom
 * accepts must give a grammar that compiles (anything else is loom's own bug); a compiled
 * grammar is run over the input's bytes and some JSON within its limits.
 */
#include "chat/grammar.h"

#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > 20000)
        return 0;
    char *text = malloc(size);
    if (!text)
        return 0;
    memcpy(text, data + 1, size - 1);
    text[size - 1] = 0;
    char err[512] = "";
    loom_grammar *g;
    if ((data[0] & 3) == 3) {
        cJSON *s = cJSON_CreateObject();
        cJSON_AddStringToObject(s, "type", "string");
        cJSON_AddStringToObject(s, "pattern", text);
        char *schema = cJSON_PrintUnformatted(s);
        cJSON_Delete(s);
        if (!schema) {
            free(text);
            return 0;
        }
        g = loom_grammar_from_json_schema(schema, err, sizeof err);
        free(schema);
        if (!g && !strncmp(err, "internal:", 9))
            __builtin_trap();
    } else if (data[0] & 1) {
        g = loom_grammar_from_json_schema(text, err, sizeof err);
        if (!g && !strncmp(err, "internal:", 9))
            __builtin_trap(); /* a schema loom accepted gave a grammar it cannot compile */
    } else {
        g = loom_grammar_compile(text, err, sizeof err);
    }
    if (!g && !err[0])
        __builtin_trap(); /* refused without a word */
    if (g) {
        static const char *const docs[] = {"{}", "{\"a\": [1, -2.5e3, \"x\\u00e9\", null]}", "a",
                                           ""};
        for (size_t i = 0; i < sizeof docs / sizeof *docs; i++)
            (void)grammar_matches(g, docs[i], strlen(docs[i]));
        (void)grammar_matches(g, text, strlen(text));
        loom_grammar_free(g);
    }
    free(text);
    return 0;
}
