/*
 * tests/test_chat.c - the built-in chat templates render each fixture's conversation exactly as
 * the model's own Jinja template did (the fixtures' rendered_prompt), and models are matched to
 * their templates.
 */
#define _GNU_SOURCE
#include <loom/loom.h>

#include "api/internal.h"
#include "check.h"

#include <cjson/cJSON.h>
#include <string.h>
#include <unistd.h>

int main(void)
{
    const char *f = getenv("LOOM_FIXTURES");
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", f && *f ? f : "");
    if (!dir[0])
        snprintf(dir, sizeof dir, "%s/../shared/fixtures", env_or("top_srcdir", "."));
    static const struct {
        const char *fixture, *template;
    } cases[] = {{"tiny-llama", "llama2"}, {"tiny-qwen2", "chatml"}, {"tiny-chatglm3", "chatglm3"}};
    char err[1024];
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char path[4200];
        snprintf(path, sizeof path, "%s/%s/expected.json", dir, cases[k].fixture);
        char *json = slurp(path, NULL);
        if (!json) {
            const char *ci = getenv("CI");
            if (ci && !strcmp(ci, "true")) {
                CHECK(0, "fixture %s missing (CI=true)", path);
                continue;
            }
            printf("SKIP: %s not found\n", path);
            return 77;
        }
        cJSON *root = cJSON_Parse(json), *cs;
        cJSON_ArrayForEach (cs, cJSON_GetObjectItem(root, "cases")) {
            cJSON *msgs = cJSON_GetObjectItem(cs, "messages");
            if (!msgs)
                continue;
            loom_chat_message m[16];
            int n = 0;
            cJSON *msg;
            cJSON_ArrayForEach (msg, msgs) {
                m[n].role = cJSON_GetObjectItem(msg, "role")->valuestring;
                m[n].content = cJSON_GetObjectItem(msg, "content")->valuestring;
                n++;
            }
            char *out = NULL;
            int rc = loom_chat_render(cases[k].template, m, n, 1, &out, err, sizeof err);
            const char *want = cJSON_GetObjectItem(cs, "rendered_prompt")->valuestring;
            CHECK(rc == 0 && !strcmp(out, want), "%s with %s:\n got  '%s'\n want '%s'",
                  cases[k].fixture, cases[k].template, out ? out : err, want);
            free(out);
        }
        cJSON_Delete(root);
        free(json);
    }
    /* matching by stored template text, by architecture, and saying when it is a guess */
    char *out = NULL;
    loom_chat_message one = {"user", "hi"};
    CHECK(loom_chat_render("jinja9", &one, 1, 1, &out, err, sizeof err) != 0 &&
              strstr(err, "jinja9"),
          "unknown template named: %s", err);
    CHECK(loom_chat_template_valid("chatml") && !loom_chat_template_valid("chatXL"), "valid names");
    /* without a template it knows, a file gets its family's (models/<family>.c); the names are
     * the formats the families' own Jinja templates write */
    static const struct {
        const char *stored, *arch, *pre, *want;
        int recognised;
    } guesses[] = {
        {"{{ '<|im_start|>' + message['role'] }}", "llama", "", "chatml", 1},
        {"{% for m in messages %}{{ m.content }}{% endfor %}", "llama", "", "llama2", 0},
        {NULL, "llama", "", "llama2", 0},
        {NULL, "llama", "llama-bpe", "llama3", 1},
        {NULL, "qwen2", "qwen2", "chatml", 1},
        {NULL, "qwen", "qwen2", "chatml", 1},
        {NULL, "chatglm", "", "chatglm3", 1},
        {NULL, "chatglm", "chatglm-bpe", "glm4", 1},
    };
    for (size_t i = 0; i < sizeof guesses / sizeof guesses[0]; i++) {
        int recognised = -1;
        const char *got = loom_chat_template_guess(guesses[i].stored, guesses[i].arch,
                                                   guesses[i].pre, &recognised);
        CHECK(!strcmp(got, guesses[i].want) && recognised == guesses[i].recognised,
              "%s (pre '%s', %s): %s, recognised %d; want %s, %d", guesses[i].arch, guesses[i].pre,
              guesses[i].stored ? "a stored template" : "none", got, recognised, guesses[i].want,
              guesses[i].recognised);
    }
    /* a chosen format keeps no pointer to the caller's name (Python passed a temporary): the
     * name overwritten and freed, the format still renders as chatml */
    char *name = strdup("chatml"), *want = NULL, *got = NULL;
    loom_chat_format fmt;
    int add_special;
    CHECK(name && loom_chat_format_choose(NULL, name, NULL, &fmt, err, sizeof err) == 0,
          "choose chatml: %s", err);
    memset(name, 'X', strlen(name));
    free(name);
    CHECK(loom_chat_render("chatml", &one, 1, 1, &want, err, sizeof err) == 0, "%s", err);
    CHECK(loom_chat_format_render(&fmt, &one, 1, NULL, 1, &got, NULL, NULL, &add_special, err,
                                  sizeof err) == 0 &&
              want && !strcmp(got, want),
          "a format whose name was freed renders '%s' (%s)", got ? got : "", err);
    free(want), free(got);
    loom_chat_format_free(&fmt);
    return check_finish("test_chat");
}
