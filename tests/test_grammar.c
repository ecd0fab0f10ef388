/*
 * tests/test_grammar.c - constrained decoding's grammar engine (chat/grammar.c) and JSON Schema
 * converter (chat/json_schema.c): GBNF grammars accept exactly the texts they describe; broken
 * ones are refused naming the line; schemas' grammars accept documents that validate and
 * refuse ones that do not (hand-checked against the schemas); an unsupported keyword is named;
 * and the mask of allowed tokens, found through the vocabulary's trie, equals token-by-token
 * checking over whole real vocabularies (SentencePiece 32k, Llama 3's BPE 128k: fixtures).
 */
#define _GNU_SOURCE
#include <loom/loom.h>

#include "chat/grammar.h"
#include "check.h"
#include "core/gguf.h"
#include "core/tokenizer.h"

#include <string.h>
#include <time.h>

static void expect(const char *gbnf, const char *const *yes, const char *const *no)
{
    char err[400];
    loom_grammar *g = loom_grammar_compile(gbnf, err, sizeof err);
    CHECK(g != NULL, "compile '%s': %s", gbnf, err);
    if (!g)
        return;
    for (; yes && *yes; yes++)
        CHECK(grammar_matches(g, *yes, strlen(*yes)), "'%s' should match '%s'", gbnf, *yes);
    for (; no && *no; no++)
        CHECK(!grammar_matches(g, *no, strlen(*no)), "'%s' should not match '%s'", gbnf, *no);
    loom_grammar_free(g);
}

static void expect_schema(const char *schema, const char *const *yes, const char *const *no)
{
    char err[400];
    loom_grammar *g = loom_grammar_from_json_schema(schema, err, sizeof err);
    CHECK(g != NULL, "schema %s: %s", schema, err);
    if (!g)
        return;
    for (; yes && *yes; yes++)
        CHECK(grammar_matches(g, *yes, strlen(*yes)), "%s should allow %s", schema, *yes);
    for (; no && *no; no++)
        CHECK(!grammar_matches(g, *no, strlen(*no)), "%s should refuse %s", schema, *no);
    loom_grammar_free(g);
}

static void refused(const char *gbnf, int schema, const char *why)
{
    char err[400] = "";
    loom_grammar *g = schema ? loom_grammar_from_json_schema(gbnf, err, sizeof err)
                             : loom_grammar_compile(gbnf, err, sizeof err);
    CHECK(!g && strstr(err, why), "'%s' refused with '%s': got '%s'", gbnf, why,
          g ? "(compiled)" : err);
    loom_grammar_free(g);
}

#define L(...) ((const char *const[]){__VA_ARGS__, NULL})

/* every token's allowance by its own bytes, against the trie walk's mask, along a path of
 * states reached by a document */
static void mask_equals_brute_force(const char *fixture, const char *schema, const char *doc)
{
    loom_gguf gg;
    char err[400], gguf[4200];
    if (!have_fixtures(fixtures_dir(), &fixture, 1))
        return;
    snprintf(gguf, sizeof gguf, "%s/%s", fixtures_dir(), fixture);
    if (loom_gguf_open(&gg, gguf, err, sizeof err) != 0) {
        CHECK(0, "%s: %s", gguf, err);
        return;
    }
    loom_tokenizer *tok = loom_tokenizer_from_gguf(&gg, err, sizeof err);
    CHECK(tok != NULL, "%s: %s", gguf, err);
    loom_grammar *g = loom_grammar_from_json_schema(schema, err, sizeof err);
    grammar_vocab *v = tok ? grammar_vocab_new(tok, 0, err, sizeof err) : NULL;
    CHECK(g && v, "%s", err);
    grammar_matcher *m = g && v ? grammar_matcher_new(g, v, err, sizeof err) : NULL;
    int32_t n = tok ? loom_tokenizer_vocab_size(tok) : 0;
    int32_t ids[4096];
    int64_t n_ids = tok ? loom_tokenizer_encode(tok, doc, strlen(doc), 0, 0, ids, 4096) : 0;
    double ms = 0;
    int masks = 0, diffs = 0;
    for (int64_t t = 0; m && t <= n_ids && !diffs; t++) {
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        const uint32_t *mask = grammar_mask(m, err, sizeof err);
        clock_gettime(CLOCK_MONOTONIC, &b);
        ms += (b.tv_sec - a.tv_sec) * 1e3 + (b.tv_nsec - a.tv_nsec) / 1e6;
        masks++;
        CHECK(mask != NULL, "mask: %s", err);
        int allowed = 0;
        for (int32_t id = 0; mask && id < n; id++) {
            int bit = mask[id >> 5] >> (id & 31) & 1;
            allowed += bit;
            if (bit != grammar_allows(m, id) && diffs++ < 3)
                CHECK(0, "%s after %lld tokens: token %d is %s by the mask, %s by its bytes", gguf,
                      (long long)t, id, bit ? "allowed" : "refused", bit ? "refused" : "allowed");
        }
        CHECK(allowed > 0, "some token is allowed after %lld tokens", (long long)t);
        if (t < n_ids)
            CHECK(grammar_accept(m, ids[t]) == 0, "the document's token %lld (%d) is taken",
                  (long long)t, ids[t]);
    }
    CHECK(m && grammar_may_end(m), "the whole document completes the grammar");
    printf("  %s: %d masks over %d tokens, %.2f ms each (first ones build the states)\n",
           strrchr(gguf, '/') + 1, masks, n, masks ? ms / masks : 0);
    grammar_matcher_free(m);
    grammar_vocab_free(v);
    loom_grammar_free(g);
    loom_tokenizer_free(tok);
    loom_gguf_close(&gg);
}

int main(void)
{
    /* GBNF */
    expect("root ::= \"a\" | \"bc\"", L("a", "bc"), L("", "b", "abc", "ca"));
    expect("root ::= [a-c]+ \"!\"?", L("a", "cab", "abc!"), L("", "!", "d", "a!!"));
    expect("root ::= x{2,3}\nx ::= \"ab\"", L("abab", "ababab"), L("ab", "abababab"));
    expect("root ::= \"(\" root \")\" | \"\"", L("", "()", "((()))"), L("(", "())", ")("));
    expect("# a comment\nroot ::= [^\"\\\\]*  # another\n", L("", "abc", "\xc3\xa9t\xc3\xa9"),
           L("\"", "a\\"));
    expect("root ::= [\\u4e00-\\u9fff]{1,2}", L("\xe4\xb8\xad", "\xe4\xb8\xad\xe6\x96\x87"),
           L("a", "\xe4\xb8\xad\xe6\x96\x87\xe5\xad\x97", "\xe4\xb8"));
    expect("root ::= . .", L("ab", "a\xf0\x9f\x98\x80", "\xc3\xa9\xc3\xa9"), L("a", "\xc3", "abc"));
    expect("root ::= \"\\x41\\n\" [\\x30-\\x39]{3,}", L("A\n123", "A\n12345"), L("A\n12", "A123"));
    expect("root ::=\n  item (\n    \",\" item\n  )*\nitem ::= [0-9]", L("1", "1,2,3"),
           L("1,", ",1"));
    refused("root ::= root \"a\" | \"b\"", 0, "left-recursive");
    refused("root ::= x\nx ::= y? x \"a\"\ny ::= \"b\"", 0, "left-recursive");
    refused("root ::= missing", 0, "'missing' is used but not defined");
    refused("start ::= \"a\"", 0, "no rule named 'root'");
    refused("root ::= \"a\"\nroot ::= \"b\"", 0, "defined twice");
    refused("root ::= (\"a\"", 0, "line 1: expected ')'");
    refused("root ::= \"a\"\n\nx ::= [z-a]", 0, "line 3: a character range runs backwards");
    refused("root ::= \"a\"{3,1}", 0, "below the count");
    refused("root ::= \"a\\q\"", 0, "unknown escape");

    /* JSON Schema */
    const char *person =
        "{\"type\": \"object\", \"properties\": {\"name\": {\"type\": \"string\"}, "
        "\"age\": {\"type\": \"integer\", \"minimum\": 0, \"maximum\": 150}, "
        "\"email\": {\"type\": \"string\"}}, \"required\": [\"name\", \"age\"]}";
    expect_schema(
        person,
        L("{\"name\": \"Ada\", \"age\": 36}", "{\"name\":\"\",\"age\":0,\"email\":\"a@b\"}",
          "{\n  \"name\": \"\\u00e9\\n\", \"age\": 150\n}"),
        L("{\"name\": \"Ada\"}", "{\"age\": 36, \"name\": \"Ada\"}",
          "{\"name\": \"Ada\", \"age\": 151}", "{\"name\": \"Ada\", \"age\": -1}",
          "{\"name\": \"Ada\", \"age\": 36, \"x\": 1}", "{\"name\": \"A\nB\", \"age\": 1}",
          "{\"name\": \"Ada\", \"age\": 36.5}", "{\"name\": \"Ada\", \"age\": 036}"));
    expect_schema("{\"type\": \"integer\", \"minimum\": -20, \"maximum\": 1234}",
                  L("-20", "-9", "0", "7", "99", "1000", "1234"), L("-21", "1235", "9999", "-0x"));
    expect_schema("{\"type\": \"integer\", \"exclusiveMinimum\": 99}", L("100", "123456789"),
                  L("99", "0", "-5"));
    expect_schema("{\"type\": \"integer\", \"maximum\": -10}", L("-10", "-11", "-123456"),
                  L("-9", "0", "5"));
    expect_schema(
        "{\"type\": \"array\", \"items\": {\"type\": \"boolean\"}, \"minItems\": 1, \"maxItems\": 3}",
        L("[true]", "[ true , false,true ]"), L("[]", "[true,true,true,true]", "[1]"));
    expect_schema(
        "{\"type\": \"array\", \"prefixItems\": [{\"type\": \"string\"}, {\"type\": \"number\"}], \"items\": false}",
        L("[\"a\", 1.5e3]"), L("[\"a\"]", "[\"a\", 1, 2]", "[1, \"a\"]"));
    expect_schema("{\"enum\": [\"red\", 3, null, {\"a\": [1]}]}",
                  L("\"red\"", "3", "null", "{\"a\":[1]}"), L("\"blue\"", "4", "{\"a\": [1]}"));
    expect_schema("{\"const\": \"x\\\"y\"}", L("\"x\\\"y\""), L("\"xy\"", "x\"y"));
    expect_schema("{\"anyOf\": [{\"type\": \"string\", \"maxLength\": 2}, {\"type\": \"null\"}]}",
                  L("\"\"", "\"ab\"", "\"\\u00e9\\n\"", "null"), L("\"abc\"", "1"));
    expect_schema("{\"type\": [\"number\", \"boolean\"]}", L("-1.25E+10", "false", "0"),
                  L("\"1\"", ".5", "1."));
    expect_schema("{\"type\": \"string\", \"format\": \"date-time\"}",
                  L("\"2026-12-05T17:30:00Z\"", "\"1999-01-31T23:59:59.123+05:30\""),
                  L("\"2026-13-05T17:30:00Z\"", "\"2026-12-05 17:30:00Z\"", "\"2026-12-05\"",
                    "\"2026-11-31T00:00:00Z\"", "\"2026-02-29T00:00:00Z\"",
                    "\"0000-01-01T00:00:00Z\""));
    expect_schema("{\"type\": \"string\", \"format\": \"uuid\"}",
                  L("\"123e4567-e89b-12d3-a456-426614174000\""),
                  L("\"123e4567e89b12d3a456426614174000\""));
    expect_schema(
        "{\"$defs\": {\"node\": {\"type\": \"object\", \"properties\": {\"v\": {\"type\": \"integer\"}, "
        "\"next\": {\"anyOf\": [{\"$ref\": \"#/$defs/node\"}, {\"type\": \"null\"}]}}, "
        "\"required\": [\"v\", \"next\"], \"additionalProperties\": false}}, \"$ref\": \"#/$defs/node\"}",
        L("{\"v\": 1, \"next\": {\"v\": 2, \"next\": null}}"),
        L("{\"v\": 1}", "{\"v\": 1, \"next\": {}}"));
    expect_schema("{\"type\": \"object\", \"additionalProperties\": {\"type\": \"integer\"}}",
                  L("{}", "{\"a\": 1, \"b\": -2}"), L("{\"a\": \"1\"}", "[]"));
    expect_schema("{\"type\": \"object\"}", L("{}", "{\"a\": [1, {\"b\": null}]}"),
                  L("[]", "{a: 1}"));
    expect_schema("{\"type\": \"object\", \"properties\": {\"a\": {}, \"b\": {}, \"c\": {}}}",
                  L("{}", "{\"b\": 1}", "{\"a\": 1, \"c\": 3}", "{\"a\":1,\"b\":2,\"c\":3}"),
                  L("{\"b\": 1, \"a\": 2}", "{,\"a\": 1}", "{\"a\": 1,}"));
    /* patterns: anchored, unanchored (a match anywhere), JSON's escapes in the answer */
    expect_schema("{\"type\": \"string\", \"pattern\": \"^[A-Z]{2}-\\\\d{3,4}$\"}",
                  L("\"AB-123\"", "\"ZZ-0000\""),
                  L("\"ab-123\"", "\"AB-12\"", "\"AB-12345\"", "\"xAB-123\""));
    expect_schema("{\"type\": \"string\", \"pattern\": \"ab+\"}",
                  L("\"ab\"", "\"xxabbby\"", "\"\\u00e9ab\""), L("\"a\"", "\"ba\""));
    expect_schema("{\"type\": \"string\", \"pattern\": \"^(?:yes|no)!?$\"}",
                  L("\"yes\"", "\"no!\""), L("\"yesno\"", "\"\"", "\"maybe\""));
    expect_schema("{\"type\": \"string\", \"pattern\": \"^\\\"[^\\\"]*\\\"\\\\.\\\\s$\"}",
                  L("\"\\\"hi \\\\\\\".\\n\"", "\"\\\"\\\".\\t\""),
                  L("\"\\\"hi\\\"x \"", "\"\\\"a\\\"b\\\".\\n\""));
    expect_schema("{\"type\": \"string\", \"pattern\": \"^.$\"}",
                  L("\"a\"", "\"\xc3\xa9\"", "\"\\t\"", "\"\\\"\""),
                  L("\"\\n\"", "\"ab\"", "\"\""));
    expect_schema("{\"type\": \"string\", \"pattern\": \"^[^\\\\d]+$\"}", L("\"abc\"", "\"a b\""),
                  L("\"a1\"", "\"\xc3\xa9\""));
    refused("{\"type\": \"string\", \"pattern\": \"^(?=a)\"}", 1, "lookaround");
    refused("{\"type\": \"string\", \"pattern\": \"(a)\\\\1\"}", 1, "backreferences");
    refused("{\"type\": \"string\", \"pattern\": \"\\\\bword\"}", 1, "word boundaries");
    refused("{\"type\": \"string\", \"pattern\": \"^a|b$\"}", 1, "group them");
    refused("{\"type\": \"string\", \"pattern\": \"a{5,2}\"}", 1, "counts down");
    refused("{\"type\": \"string\", \"pattern\": \"(ab\"}", 1, "without its ')'");
    refused("{\"type\": \"string\", \"pattern\": \"\\\\p{L}\"}", 1, "property escapes");
    /* a character past U+FFFF written as ECMA-262 writes it, a UTF-16 pair; half of one is none */
    expect_schema("{\"type\": \"string\", \"pattern\": \"^a\\\\ud834\\\\udd1e$\"}",
                  L("\"a\xf0\x9d\x84\x9e\""), L("\"a\"", "\"a\xed\xa0\xb4\""));
    refused("{\"type\": \"string\", \"pattern\": \"a\\\\udecc\"}", 1, "half of a surrogate pair");
    refused("{\"type\": \"string\", \"pattern\": \"[\\\\ud834-x]\"}", 1,
            "half of a surrogate pair");
    refused("{\"type\": \"string\", \"pattern\": \"a\", \"maxLength\": 3}", 1,
            "beside format, minLength");
    refused("{\"type\": \"object\", \"patternProperties\": {}}", 1,
            "keyword 'patternProperties' is not supported");
    refused("{\"type\": \"number\", \"minimum\": 0.5}", 1, "'minimum' on a number");
    refused("{\"type\": \"string\", \"format\": \"email\"}", 1, "format 'email' is not supported");
    refused("{\"$ref\": \"#/$defs/nope\"}", 1, "points to nothing");
    refused("{\"type\": \"object\", \"properties\": {}, \"required\": [\"x\"]}", 1,
            "'x' is not among");
    refused("{\"type\": ", 1, "not valid JSON");
    refused("{\"anyOf\": [{\"$ref\": \"#\"}, {\"type\": \"null\"}]}", 1, "refers back to itself");

    /* schemas whose grammars multiply: a type named eight times on each of five nested objects
     * (8^5 copies of the innermost before types were deduplicated) is one grammar; distinct
     * types nested in alternatives that really do multiply are refused by the budget, quickly */
    char nested[4096] = "{\"type\": \"string\"}", deeper[4096];
    for (int level = 0; level < 5; level++) {
        snprintf(deeper, sizeof deeper,
                 "{\"type\": [\"object\", \"object\", \"object\", \"object\", \"object\", "
                 "\"object\", \"object\", \"object\"], \"properties\": {\"a\": %s}, "
                 "\"required\": [\"a\"]}",
                 nested);
        snprintf(nested, sizeof nested, "%s", deeper);
    }
    expect_schema(nested, L("{\"a\": {\"a\": {\"a\": {\"a\": {\"a\": \"x\"}}}}}"),
                  L("{\"a\": {\"a\": {\"a\": {\"a\": {\"a\": 1}}}}}"));
    /* additional properties beside declared ones never repeat a declared name, in any
     * spelling (Python's json keeps the last of two, whose schema was not checked) */
    expect_schema("{\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"integer\"}, "
                  "\"ab\": {\"type\": \"string\"}, \"q\\\"\": {\"type\": \"null\"}}, "
                  "\"additionalProperties\": true}",
                  L("{\"a\": 1}", "{\"a\": 1, \"b\": \"x\"}", "{\"a\": 1, \"abc\": 2}",
                    "{\"a\": 1, \"\": 2}", "{\"ab\": \"s\", \"q\\\"x\": 1}",
                    "{\"a\": 1, \"x\\ty\": 0}"),
                  L("{\"a\": 1, \"a\": \"x\"}", "{\"ab\": \"z\", \"ab\": 3}",
                    "{\"q\\\"\": null, \"q\\\"\": 1}", "{\"a\": 1, \"\\u0061\": 2}"));
    expect_schema("{\"type\": \"object\", \"properties\": {\"n\": {\"type\": \"integer\"}}, "
                  "\"additionalProperties\": {\"type\": \"string\"}}",
                  L("{\"n\": 1, \"m\": \"x\"}"), L("{\"n\": 1, \"n\": \"x\"}"));
    /* a keyword beside anyOf / $ref / allOf would be dropped: refused; "type" beside enum
     * narrows it, as Pydantic writes it */
    refused("{\"type\": \"integer\", \"anyOf\": [{\"minimum\": 1}]}", 1,
            "'type' beside 'anyOf' is not supported");
    refused("{\"$ref\": \"#/$defs/a\", \"maxLength\": 2, \"$defs\": {\"a\": {\"type\": "
            "\"string\"}}}",
            1, "'maxLength' beside '$ref'");
    refused("{\"enum\": [\"a\", \"b\"], \"maxLength\": 1}", 1, "'maxLength' beside 'enum'");
    expect_schema("{\"enum\": [\"a\", 1, null], \"type\": \"string\", \"title\": \"T\"}",
                  L("\"a\""), L("1", "null"));
    /* oneOf: only where no text can match two branches */
    refused("{\"oneOf\": [{\"type\": \"string\"}, {\"type\": \"string\", \"maxLength\": 3}]}", 1,
            "'oneOf' whose branches may both match");
    refused("{\"oneOf\": [{\"type\": \"number\"}, {\"type\": \"integer\"}]}", 1,
            "'oneOf' whose branches may both match");
    expect_schema("{\"oneOf\": [{\"type\": \"string\"}, {\"type\": \"integer\"}]}", L("\"x\"", "3"),
                  L("null"));
    expect_schema("{\"$defs\": {\"A\": {\"type\": \"object\", \"properties\": {\"kind\": "
                  "{\"const\": \"a\"}, \"x\": {\"type\": \"integer\"}}, \"required\": [\"kind\", "
                  "\"x\"]}, \"B\": {\"type\": \"object\", \"properties\": {\"kind\": {\"enum\": "
                  "[\"b\"]}}, \"required\": [\"kind\"]}}, \"oneOf\": [{\"$ref\": \"#/$defs/A\"}, "
                  "{\"$ref\": \"#/$defs/B\"}]}",
                  L("{\"kind\": \"a\", \"x\": 1}", "{\"kind\": \"b\"}"),
                  L("{\"kind\": \"b\", \"x\": 1}"));
    /* a surrogate pair is one character, as Python counts it; a lone surrogate none */
    expect_schema("{\"type\": \"string\", \"maxLength\": 1}", L("\"\\ud83d\\ude00\"", "\"a\""),
                  L("\"\\ud83d\"", "\"ab\"", "\"\\ude00\""));
    expect_schema("{\"type\": \"string\", \"minLength\": 2}", L("\"ab\"", "\"\\u00e9\\u00e9\""),
                  L("\"\\ud83d\\ude00\""));
    /* patterns that read two ways, or repeat what can match nothing, are refused by name */
    refused("{\"type\": \"string\", \"pattern\": \"^[^]]$\"}", 1, "opens a class in Python");
    refused("{\"type\": \"string\", \"pattern\": \"^(a*)*$\"}", 1,
            "a part that can match nothing is repeated");
    refused("{\"type\": \"string\", \"pattern\": \"^(a|b?)+$\"}", 1,
            "a part that can match nothing is repeated");
    expect_schema("{\"type\": \"string\", \"pattern\": \"^(a?b)*$\"}", L("\"\"", "\"bab\""),
                  L("\"a\""));

    /* past the budgets: a 1.1 MB enum string, 10000 properties */
    size_t big = 1100000;
    char *schema_text = malloc(big + 64), *o;
    CHECK(schema_text != NULL, "out of memory");
    if (schema_text) {
        o = schema_text + sprintf(schema_text, "{\"enum\": [\"");
        memset(o, 'a', big), o += big;
        strcpy(o, "\"]}");
        refused(schema_text, 1, "would pass 1048576 bytes");
        free(schema_text);
    }
    schema_text = malloc(10000 * 32 + 64);
    if (schema_text) {
        o = schema_text + sprintf(schema_text, "{\"type\": \"object\", \"properties\": {");
        for (int i = 0; i < 10000; i++)
            o += sprintf(o, "%s\"p%d\": {\"type\": \"null\"}", i ? ", " : "", i);
        strcpy(o, "}}");
        refused(schema_text, 1, "would pass 16384 rules");
        free(schema_text);
    }

    /* the trie's mask against each token's own bytes, on real vocabularies */
    const char *schema =
        "{\"type\": \"object\", \"properties\": {\"name\": {\"type\": \"string\"}, "
        "\"tags\": {\"type\": \"array\", \"items\": {\"enum\": [\"a b\", \"c\"]}}, "
        "\"n\": {\"type\": \"integer\", \"minimum\": 10, \"maximum\": 99}}, "
        "\"required\": [\"name\", \"tags\", \"n\"]}";
    const char *doc =
        "{\"name\": \"Zo\\u00eb \xe4\xb8\xad\", \"tags\": [\"a b\", \"c\"], \"n\": 42}";
    mask_equals_brute_force("peers/llama.cpp/ggml-vocab-llama-spm.gguf", schema, doc);
    mask_equals_brute_force("tiny-llama31/model.gguf", schema, doc);
    if (getenv("LOOM_GRAMMAR_PROBE"))
        mask_equals_brute_force("tiny-llama31/model.gguf", "{\"type\": \"object\"}",
                                "{\"a\": [1, {\"b\": \"x y\"}], \"c\": null}");
    return check_finish("test_grammar");
}
