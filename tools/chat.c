/*
 * tools/chat.c - `loom chat`: an interactive conversation in the terminal.
 *
 * Each turn renders the whole conversation with the model's chat template and evaluates only
 * what it adds to the tokens already in the KV cache (their longest common prefix is reused).
 * Commands: /reset (forget the conversation), /system TEXT (set the system message and
 * restart), /quit. Ctrl-C stops the answer being generated and keeps the conversation; at the
 * prompt it ends the chat.
 */
#define _GNU_SOURCE
#include <loom/loom.h>

#include "args.h"

#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static volatile sig_atomic_t interrupted;

static void on_sigint(int sig)
{
    (void)sig;
    interrupted = 1;
}

typedef struct answer {
    char *text;
    size_t len, cap;
    int32_t *ids;
    int n_ids, cap_ids;
} answer;

static int on_token(void *user, int32_t id, const char *text, size_t len)
{
    answer *a = user;
    if (interrupted)
        return 1;
    loom_print_text(stdout, text, len);
    if (a->len + len + 1 > a->cap) {
        size_t cap = (a->len + len + 1) * 2;
        char *t = realloc(a->text, cap);
        if (!t)
            return 1;
        a->text = t;
        a->cap = cap;
    }
    memcpy(a->text + a->len, text, len);
    a->len += len;
    a->text[a->len] = '\0';
    if (id >= 0) {
        if (a->n_ids == a->cap_ids) {
            int cap = a->cap_ids ? a->cap_ids * 2 : 256;
            int32_t *ids = realloc(a->ids, (size_t)cap * sizeof *ids);
            if (!ids)
                return 1;
            a->ids = ids;
            a->cap_ids = cap;
        }
        a->ids[a->n_ids++] = id;
    }
    return 0;
}

typedef struct convo {
    loom_chat_message *msgs;
    int n, cap;
} convo;

static int add_msg(convo *c, const char *role, const char *content)
{
    if (c->n == c->cap) {
        int cap = c->cap ? c->cap * 2 : 16;
        loom_chat_message *m = realloc(c->msgs, (size_t)cap * sizeof *m);
        if (!m)
            return -1;
        c->msgs = m;
        c->cap = cap;
    }
    char *copy = strdup(content);
    if (!copy)
        return -1;
    c->msgs[c->n].role = role;
    c->msgs[c->n].content = copy;
    c->n++;
    return 0;
}

static void clear(convo *c, const char *system)
{
    for (int i = 0; i < c->n; i++)
        free((char *)c->msgs[i].content);
    c->n = 0;
    if (system && *system)
        add_msg(c, "system", system);
}

int loom_chat_main(int argc, char **argv);
int loom_chat_main(int argc, char **argv)
{
    const char *tmpl = NULL, *tmpl_file = NULL, *system = NULL;
    loom_sampling s = loom_sampling_defaults();
    long n_predict = 512;
    loom_open_flags of = {0};
    loom_spec_flags sf;
    loom_flag spec_flags[LOOM_SPEC_FLAGS];
    loom_spec_flag_table(&sf, spec_flags);
    char template_help[512];
    snprintf(template_help, sizeof template_help,
             "a built-in format instead of the model's template: %s", loom_chat_templates());
    const loom_flag flags[] = {
        LOOM_FLAG_MODEL(&of.model),
        {"--system", NULL, LOOM_FLAG_TEXT, &system, 0, 0, "TEXT", "the system prompt"},
        {"--chat-template", NULL, LOOM_FLAG_TEXT, &tmpl, 0, 0, "NAME", template_help},
        {"--chat-template-file", NULL, LOOM_FLAG_TEXT, &tmpl_file, 0, 0, "FILE",
         "a Jinja chat template instead of the model's"},
        {"-n", NULL, LOOM_FLAG_LONG, &n_predict, 1, 1 << 20, "N",
         "longest answer in tokens (default 512)"},
        {"-c", NULL, LOOM_FLAG_LONG, &of.n_ctx, 2, 1 << 20, "N",
         "context length (default: the model's, up to 4096)"},
        LOOM_FLAG_KV_TYPE(&of.kv_type),
        LOOM_FLAG_THREADS(&of.threads),
        LOOM_FLAG_EXPERTS_ON(&of.experts_on),
        LOOM_FLAG_DISTRIBUTED(&of.distributed),
        LOOM_FLAG_LAYERS(&of.layers),
    };
    const loom_command cmd = {.name = "loom chat",
                              .synopsis = "-m MODEL [options]",
                              .flags = flags,
                              .n_flags = LOOM_N_FLAGS(flags),
                              .sampling = &s,
                              .more_flags = spec_flags,
                              .n_more_flags = LOOM_SPEC_FLAGS,
                              .more_title = "speculative decoding:"};
    int parsed = loom_args_parse(&cmd, argc, argv);
    if (parsed)
        return parsed == 1 ? 0 : parsed;
    if (!of.model) {
        fprintf(stderr, "loom chat: give the model with -m MODEL\n");
        loom_args_usage(&cmd, stderr);
        return 2;
    }
    if (tmpl && !loom_chat_template_valid(tmpl)) {
        fprintf(stderr, "loom chat: no chat template named '%s' (there are: %s)\n", tmpl,
                loom_chat_templates());
        return 2;
    }
    if (tmpl && tmpl_file) {
        fprintf(stderr, "loom chat: give --chat-template or --chat-template-file, not both\n");
        return 2;
    }
    char err[4096], drafter_about[600];
    loom_model *m, *drafter;
    loom_speculation spec_room;
    const loom_speculation *spec;
    int opened = loom_open_generating("loom chat", &of, &sf, &m, &spec_room, &spec, &drafter,
                                      drafter_about, sizeof drafter_about);
    if (opened >= 0)
        return opened;
    loom_chat_format chat;
    if (loom_chat_format_choose(m, tmpl, tmpl_file, &chat, err, sizeof err) != 0) {
        fprintf(stderr, "loom chat: %s\n", err);
        loom_model_close(drafter);
        loom_model_close(m);
        return 2;
    }
    struct sigaction sa = {0};
    sa.sa_handler = on_sigint; /* no SA_RESTART: Ctrl-C at the prompt interrupts the read */
    sigaction(SIGINT, &sa, NULL);
    fprintf(stderr,
            "loom chat: %s on %s; chat template: %s%s%s. /reset, /system TEXT, /quit; Ctrl-C "
            "stops an answer.\n",
            of.model, loom_model_backend(m), chat.about, spec ? "; speculative: " : "",
            spec ? drafter_about : "");

    convo c = {0};
    clear(&c, system);
    int32_t n_ctx_max = loom_model_n_ctx(m);
    int extends = loom_model_extends_cache(m); /* else every turn is evaluated whole */
    int32_t *cache = malloc((size_t)n_ctx_max * sizeof *cache),
            *ids = malloc((size_t)n_ctx_max * sizeof *ids);
    int32_t n_cache = 0;
    char line[8192];
    int interactive = isatty(STDIN_FILENO);
    while (cache && ids) {
        if (interactive)
            fprintf(stderr, "\n> ");
        interrupted = 0;
        if (!fgets(line, sizeof line, stdin))
            break; /* end of input, or Ctrl-C at the prompt */
        line[strcspn(line, "\r\n")] = '\0';
        if (!line[0])
            continue;
        if (!strcmp(line, "/quit"))
            break;
        if (!strcmp(line, "/reset") || !strncmp(line, "/system", 7)) {
            if (!strncmp(line, "/system", 7))
                system = line[7] == ' ' ? strdup(line + 8) : NULL;
            clear(&c, system);
            n_cache = 0;
            fprintf(stderr, "(conversation cleared%s)\n", system ? ", system message set" : "");
            continue;
        }
        add_msg(&c, "user", line);
        char *prompt = NULL;
        loom_text_span *spans = NULL;
        int n_spans = 0, add_special;
        if (loom_chat_format_render(&chat, c.msgs, c.n, NULL, 1, &prompt, &spans, &n_spans,
                                    &add_special, err, sizeof err) != 0) {
            fprintf(stderr, "loom chat: %s\n", err);
            free((char *)c.msgs[--c.n].content);
            continue;
        }
        /* the template's special tokens; what was typed is text, "<|user|>" included */
        int64_t n = loom_tokenize_spans(m, prompt, strlen(prompt), add_special, LOOM_SPECIAL_ALL,
                                        spans, n_spans, ids, n_ctx_max, err, sizeof err);
        free(prompt);
        free(spans);
        if (n < 0) {
            fprintf(stderr, "loom chat: %s\n", err);
            free((char *)c.msgs[--c.n].content);
            continue;
        }
        if (n >= n_ctx_max) {
            fprintf(stderr,
                    "loom chat: the conversation no longer fits the context of %d tokens; "
                    "/reset to start over\n",
                    n_ctx_max);
            free((char *)c.msgs[--c.n].content);
            continue;
        }
        /* reuse the cached tokens the new rendering starts with (at least one token is new) */
        int32_t keep = 0;
        while (extends && keep < n_cache && keep < n - 1 && cache[keep] == ids[keep])
            keep++;
        /* a model with recurrent layers holds the conversation in a state that has seen every
         * cached token: less than all of them cannot be reused (loom_generate_speculative
         * would start over anyway; the line below then says so) */
        if (loom_model_state_bytes(m) && keep < n_cache)
            keep = 0;
        answer a = {0};
        loom_generation st;
        int rc = loom_generate_speculative(m, spec, ids, (int32_t)n, keep, (int32_t)n_predict, &s,
                                           on_token, &a, &st, err, sizeof err);
        printf("\n");
        if (rc != 0) {
            fprintf(stderr, "loom chat: %s\n", err);
            free((char *)c.msgs[--c.n].content);
            n_cache = 0;
        } else {
            char accepted[96] = "";
            if (st.n_drafted)
                snprintf(accepted, sizeof accepted, "; %d of %d proposed tokens accepted",
                         st.n_accepted, st.n_drafted);
            fprintf(stderr, "(%d tokens, %.1f tok/s; reused %d of %lld prompt tokens%s%s)\n",
                    st.n_generated, st.decode_tok_s, keep, (long long)n, accepted,
                    interrupted ? "; stopped" : "");
            /* what the KV cache holds: the prompt and every generated token but the last,
             * which was sampled and never run (its slot was never written: a turn that
             * reused it attended to stale memory, NaN once it held some) */
            memcpy(cache, ids, (size_t)n * sizeof *cache);
            n_cache = (int32_t)n;
            for (int i = 0; i + 1 < a.n_ids && n_cache < n_ctx_max; i++)
                cache[n_cache++] = a.ids[i];
            add_msg(&c, "assistant", a.text ? a.text : "");
        }
        free(a.text);
        free(a.ids);
    }
    if (interrupted)
        printf("\n");
    clear(&c, NULL);
    free(c.msgs), free(cache), free(ids);
    loom_chat_format_free(&chat);
    loom_model_close(drafter);
    loom_model_close(m);
    return 0;
}
