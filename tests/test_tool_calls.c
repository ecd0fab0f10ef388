/*
 * tests/test_tool_calls.c - the tool calls in answers written as each family writes them
 * (tests/tool_calls/answers.json, expectations written from the formats the families'
 * templates and model cards describe) are read back as an OpenAI client must get them; and
 * while such an answer streams, no byte of a call is ever let out as text.
 */
#define _GNU_SOURCE
#include <loom/loom.h>

#include "check.h"

#include <cjson/cJSON.h>
#include <string.h>

static loom_tool_syntax syntax_named(const char *name)
{
    for (int s = LOOM_TOOLS_NONE; s <= LOOM_TOOLS_GLM45; s++)
        if (!strcmp(loom_tool_syntax_name((loom_tool_syntax)s), name))
            return (loom_tool_syntax)s;
    return LOOM_TOOLS_NONE;
}

int main(void)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/tests/tool_calls/answers.json", env_or("top_srcdir", "."));
    char *json = slurp(path, NULL);
    CHECK(json != NULL, "%s unreadable", path);
    cJSON *root = cJSON_Parse(json), *cs;
    int n_cases = 0;
    cJSON_ArrayForEach (cs, cJSON_GetObjectItem(root, "cases")) {
        const char *syntax = cJSON_GetObjectItem(cs, "syntax")->valuestring;
        const char *text = cJSON_GetObjectItem(cs, "text")->valuestring;
        const cJSON *want = cJSON_GetObjectItem(cs, "calls");
        const cJSON *want_content = cJSON_GetObjectItem(cs, "content");
        const char *names[] = {"get_weather", "search"};
        loom_tool_syntax s = syntax_named(syntax);
        size_t len = strlen(text);
        loom_tool_calls tc;
        n_cases++;
        CHECK(s != LOOM_TOOLS_NONE, "syntax %s unknown", syntax);
        CHECK(loom_tool_calls_parse(s, text, len, names, 2, &tc) == 0, "parse %s", text);
        int n_want = cJSON_GetArraySize(want);
        CHECK(tc.n_calls == n_want, "%s: '%s': %d calls, want %d", syntax, text, tc.n_calls,
              n_want);
        size_t content = want_content ? strlen(want_content->valuestring) : len;
        CHECK(tc.content_len == content &&
                  (!want_content || !memcmp(text, want_content->valuestring, content)),
              "%s: '%s': content %zu bytes, want %zu", syntax, text, tc.content_len, content);
        int k = 0;
        for (const cJSON *w = want->child; w && k < tc.n_calls; w = w->next, k++) {
            cJSON *args = cJSON_Parse(tc.calls[k].arguments);
            const cJSON *id = cJSON_GetObjectItem(w, "id");
            CHECK(!strcmp(tc.calls[k].name, cJSON_GetObjectItem(w, "name")->valuestring) &&
                      cJSON_Compare(args, cJSON_GetObjectItem(w, "arguments"), 1),
                  "%s: '%s': call %d is %s(%s)", syntax, text, k, tc.calls[k].name,
                  tc.calls[k].arguments);
            CHECK(id ? tc.calls[k].id && !strcmp(tc.calls[k].id, id->valuestring)
                     : tc.calls[k].id == NULL,
                  "%s: call %d's id %s", syntax, k, tc.calls[k].id ? tc.calls[k].id : "(none)");
            cJSON_Delete(args);
        }
        /* streamed a byte at a time, what is let out as text never reaches into a call */
        if (n_want)
            for (size_t l = 0; l <= len; l++) {
                size_t out = loom_tool_calls_text_prefix(s, text, l, names, 2);
                if (out > tc.content_len) {
                    CHECK(0,
                          "%s: '%s': %zu bytes of the first %zu streamed as text; the calls "
                          "start at %zu",
                          syntax, text, out, l, tc.content_len);
                    break;
                }
            }
        else /* and an answer that is text is let out whole once it is over */
            CHECK(tc.content_len == len, "%s: '%s' is text", syntax, text);
        loom_tool_calls_free(&tc);
    }
    CHECK(n_cases >= 20, "%d cases", n_cases);
    /* thoughts: where the thought and the answer lie, finished and while streaming */
    static const struct {
        const char *text;
        int inside, done;
        const char *thought, *answer;
        int open;
    } thoughts[] = {
        {"<think>\nplan\n</think>\n\nThe answer.", 0, 1, "\nplan\n", "The answer.", 0},
        {"\n<think>a</think>b", 0, 1, "a", "b", 0},
        {"plan it</think>\nok", 1, 1, "plan it", "ok", 0},
        {"No thought here.", 0, 1, "", "No thought here.", 0},
        {"<think>cut off by max_tokens", 0, 1, "cut off by max_tokens", "", 1},
        {"<think>half</thi", 0, 0, "half", "", 1}, /* the close may be coming */
        {"<thi", 0, 0, "", "", 1},                 /* so may the open */
        {"  ", 0, 0, "", "", 1},
        {"<think>x</think>", 0, 0, "x", "", 0},
    };
    for (size_t i = 0; i < sizeof thoughts / sizeof *thoughts; i++) {
        loom_reasoning r;
        const char *t = thoughts[i].text;
        size_t len = strlen(t);
        loom_reasoning_find(t, len, thoughts[i].inside, thoughts[i].done, &r);
        int answer_ok = thoughts[i].open && !thoughts[i].done
            ? 1
            : strlen(thoughts[i].answer) == len - r.content &&
                !memcmp(t + r.content, thoughts[i].answer, len - r.content);
        CHECK(r.end - r.start == strlen(thoughts[i].thought) &&
                  !memcmp(t + r.start, thoughts[i].thought, r.end - r.start) && answer_ok &&
                  r.open == thoughts[i].open,
              "thought in '%s': [%zu, %zu), answer from %zu, open %d", t, r.start, r.end, r.content,
              r.open);
    }
    /* a template is read for the syntax of its calls */
    static const struct {
        const char *jinja;
        loom_tool_syntax want;
    } templates[] = {
        {"{{ '<tool_call>' }}{{ tools }}", LOOM_TOOLS_HERMES},
        {"{% if tools %}<tool_call>{{ name }}<arg_key>{% endif %}", LOOM_TOOLS_GLM45},
        {"{% if tools %}[TOOL_CALLS]{% endif %}", LOOM_TOOLS_MISTRAL},
        {"<|start_header_id|>{% if tools %}<|python_tag|>{% endif %}", LOOM_TOOLS_LLAMA3},
        {"{% if tools %}<|observation|>{% endif %}", LOOM_TOOLS_GLM4},
        {"{% for t in tools %}{{ t }}{% endfor %}", LOOM_TOOLS_UNKNOWN},
        {"{% for m in messages %}{{ m.content }}{% endfor %}", LOOM_TOOLS_NONE},
    };
    for (size_t i = 0; i < sizeof templates / sizeof *templates; i++) {
        char err[256];
        loom_chat_format f = {0};
        f.jinja = loom_chat_template_compile(templates[i].jinja, "", "", err, sizeof err);
        CHECK(f.jinja && loom_chat_format_tool_syntax(&f) == templates[i].want, "'%s' reads as %s",
              templates[i].jinja, loom_tool_syntax_name(loom_chat_format_tool_syntax(&f)));
        loom_chat_format_free(&f);
    }
    cJSON_Delete(root);
    free(json);
    return check_finish("test_tool_calls");
}
