/*
 * chat/chat.c - chat templates: the conversation formats of the model families, built in
 * (loom runs no Jinja), chosen by recognising the template text a model file carries, or by
 * its architecture, or by name (--chat-template).
 *
 *   llama2   <s>[INST] <<SYS>>\nSYSTEM\n<</SYS>>\n\nUSER [/INST] ANSWER </s><s>[INST] ...
 *   llama3   <|begin_of_text|><|start_header_id|>ROLE<|end_header_id|>\n\nTEXT<|eot_id|>...
 *   chatml   <|im_start|>ROLE\nTEXT<|im_end|>\n ... (Qwen; a default system turn when none)
 *   chatglm3 [gMASK]sop<|ROLE|>\n TEXT ...
 *   glm4     [gMASK]<sop><|ROLE|>\nTEXT ...
 * Each ends, with add_generation_prompt, with the opening of the assistant's turn.
 */
#define _GNU_SOURCE
#include "api/internal.h"
#include "chat/jinja.h"

#include "core/file.h"
#include "core/gguf.h"
#include "core/tokenizer.h"
#include "models/models.h"

#include <stdarg.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct sbuf {
    char *s;
    size_t n, cap;
    int oom;
    loom_text_span *spans; /* where messages' own text went (NULL: not recorded) */
    int n_spans, cap_spans, record;
} sbuf;

static void put(sbuf *b, const char *fmt, ...)
{
    va_list ap, ap2;
    va_start(ap, fmt);
    va_copy(ap2, ap);
    int k = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (k < 0 || b->oom) {
        va_end(ap2);
        b->oom = 1;
        return;
    }
    if (b->n + (size_t)k + 1 > b->cap) {
        size_t cap = (b->n + (size_t)k + 1) * 2;
        char *s = realloc(b->s, cap);
        if (!s) {
            va_end(ap2);
            b->oom = 1;
            return;
        }
        b->s = s;
        b->cap = cap;
    }
    vsnprintf(b->s + b->n, (size_t)k + 1, fmt, ap2);
    va_end(ap2);
    b->n += (size_t)k;
}

/* A message's own text (or what a template made of it), recorded as a span: the caller
 * tokenizes it without parsing special tokens. */
static void put_text(sbuf *b, const char *t, size_t n)
{
    size_t start = b->n;
    put(b, "%.*s", (int)n, t);
    if (!b->record || b->oom || b->n == start)
        return;
    if (b->n_spans == b->cap_spans) {
        int cap = b->cap_spans ? 2 * b->cap_spans : 16;
        loom_text_span *grown = realloc(b->spans, (size_t)cap * sizeof *grown);
        if (!grown) {
            b->oom = 1;
            return;
        }
        b->spans = grown, b->cap_spans = cap;
    }
    b->spans[b->n_spans++] = (loom_text_span){start, b->n};
}

/* text without leading and trailing whitespace, as Python's str.strip() */
static void put_stripped(sbuf *b, const char *t)
{
    while (*t == ' ' || *t == '\n' || *t == '\t' || *t == '\r')
        t++;
    size_t n = strlen(t);
    while (n && (t[n - 1] == ' ' || t[n - 1] == '\n' || t[n - 1] == '\t' || t[n - 1] == '\r'))
        n--;
    put_text(b, t, n);
}

static const char *const template_names[] = {"llama2", "llama3", "chatml", "chatglm3", "glm4"};

static char template_list[128];

static void list_templates(void)
{
    size_t at = 0;
    for (size_t i = 0; i < sizeof template_names / sizeof *template_names; i++)
        at += (size_t)snprintf(template_list + at, sizeof template_list - at, "%s%s", i ? ", " : "",
                               template_names[i]);
}

/* the names, from the table (a string kept beside it had lost glm4) */
const char *loom_chat_templates(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, list_templates);
    return template_list;
}

int loom_chat_render(const char *name, const loom_chat_message *msgs, int n,
                     int add_generation_prompt, char **out, char *err, size_t err_size)
{
    return loom_chat_render_spans(name, msgs, n, add_generation_prompt, out, NULL, NULL, err,
                                  err_size);
}

int loom_chat_render_spans(const char *name, const loom_chat_message *msgs, int n,
                           int add_generation_prompt, char **out, loom_text_span **spans,
                           int *n_spans, char *err, size_t err_size)
{
    sbuf b = {.record = spans != NULL};
    put(&b, "%s", "");
    if (!strcmp(name, "llama2")) {
        int i = 0;
        const char *system = NULL;
        if (n > 0 && !strcmp(msgs[0].role, "system"))
            system = msgs[i++].content;
        for (int turn = 0; i < n; i++, turn++) {
            if (!strcmp(msgs[i].role, "user")) {
                put(&b, "<s>[INST] ");
                if (system && turn == 0) {
                    sbuf c = {0};
                    put(&c, "<<SYS>>\n%s\n<</SYS>>\n\n%s", system, msgs[i].content);
                    if (!c.oom)
                        put_stripped(&b, c.s);
                    b.oom |= c.oom;
                    free(c.s);
                } else {
                    put_stripped(&b, msgs[i].content);
                }
                put(&b, " [/INST]");
            } else if (!strcmp(msgs[i].role, "assistant")) {
                put(&b, " ");
                put_stripped(&b, msgs[i].content);
                put(&b, " </s>");
            } else {
                free(b.s);
                free(b.spans);
                snprintf(err, err_size,
                         "the llama2 template has no role '%s' (system comes first, "
                         "then user and assistant in turn)",
                         msgs[i].role);
                return -1;
            }
        }
    } else if (!strcmp(name, "llama3")) {
        put(&b, "<|begin_of_text|>");
        for (int i = 0; i < n; i++) {
            put(&b, "<|start_header_id|>%s<|end_header_id|>\n\n", msgs[i].role);
            put_text(&b, msgs[i].content, strlen(msgs[i].content));
            put(&b, "<|eot_id|>");
        }
        if (add_generation_prompt)
            put(&b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
    } else if (!strcmp(name, "chatml")) {
        if (n == 0 || strcmp(msgs[0].role, "system") != 0)
            put(&b, "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n");
        for (int i = 0; i < n; i++) {
            put(&b, "<|im_start|>%s\n", msgs[i].role);
            put_text(&b, msgs[i].content, strlen(msgs[i].content));
            put(&b, "<|im_end|>\n");
        }
        if (add_generation_prompt)
            put(&b, "<|im_start|>assistant\n");
    } else if (!strcmp(name, "chatglm3") || !strcmp(name, "glm4")) {
        /* the same roles; GLM-4 spells sop as a special token and drops the space */
        int glm4 = !strcmp(name, "glm4");
        put(&b, glm4 ? "[gMASK]<sop>" : "[gMASK]sop");
        for (int i = 0; i < n; i++) {
            put(&b, "<|%s|>\n%s", msgs[i].role, glm4 ? "" : " ");
            put_text(&b, msgs[i].content, strlen(msgs[i].content));
        }
        if (add_generation_prompt)
            put(&b, "<|assistant|>");
    } else {
        free(b.s);
        free(b.spans);
        snprintf(err, err_size, "no chat template named '%s' (there are: %s)", name,
                 loom_chat_templates());
        return -1;
    }
    if (b.oom) {
        free(b.s);
        free(b.spans);
        snprintf(err, err_size, "out of memory");
        return -1;
    }
    *out = b.s;
    if (spans)
        *spans = b.spans, *n_spans = b.n_spans;
    return 0;
}

const char *loom_chat_template_guess(const char *stored, const char *arch, const char *pre,
                                     int *recognised)
{
    *recognised = 1;
    if (stored) {
        if (strstr(stored, "[gMASK]<sop>"))
            return "glm4";
        if (strstr(stored, "<|im_start|>"))
            return "chatml";
        if (strstr(stored, "<|start_header_id|>"))
            return "llama3";
        if (strstr(stored, "[INST]"))
            return "llama2";
        if (strstr(stored, "<|assistant|>") || strstr(stored, "[gMASK]"))
            return "chatglm3";
        *recognised = 0; /* a template loom cannot run: fall back, and say so */
    }
    /* the family's own: models/<family>.c declares it */
    const loom_family *f = arch ? loom_family_find(arch) : NULL;
    if (f && f->chat_template_tiktoken && f->tiktoken && pre && !strcmp(pre, f->tiktoken->pre))
        return f->chat_template_tiktoken;
    if (f && f->chat_template)
        return f->chat_template;
    if (!stored)
        *recognised = 0;
    return "llama2";
}

/* the table's own copy of a built-in format's name, or NULL */
static const char *template_name(const char *name)
{
    for (size_t i = 0; i < sizeof template_names / sizeof template_names[0]; i++)
        if (!strcmp(name, template_names[i]))
            return template_names[i];
    return NULL;
}

int loom_chat_template_valid(const char *name)
{
    return template_name(name) != NULL;
}

/* ---- the model's own template, in Jinja --------------------------------------------------- */

struct loom_chat_template {
    jinja_template *jinja;
    char *bos, *eos;
    loom_tool_syntax tools; /* how the model writes the calls this template offers it */
    int reasons;            /* it knows <think>: answers may open with a thought */
};

void loom_chat_template_free(loom_chat_template *t)
{
    if (!t)
        return;
    jinja_free(t->jinja);
    free(t->bos);
    free(t->eos);
    free(t);
}

loom_chat_template *loom_chat_template_compile(const char *jinja, const char *bos_token,
                                               const char *eos_token, char *err, size_t err_size)
{
    loom_chat_template *t = calloc(1, sizeof *t);
    if (!t || !(t->bos = strdup(bos_token ? bos_token : "")) ||
        !(t->eos = strdup(eos_token ? eos_token : ""))) {
        loom_chat_template_free(t);
        snprintf(err, err_size, "out of memory");
        return NULL;
    }
    if (!(t->jinja = jinja_compile(jinja, err, err_size))) {
        loom_chat_template_free(t);
        return NULL;
    }
    t->tools = loom_tool_syntax_of_template(jinja);
    t->reasons = strstr(jinja, "<think>") != NULL;
    return t;
}

const char *loom_chat_template_token(const loom_chat_template *t, const char *name)
{
    return !strcmp(name, "bos_token") ? t->bos : !strcmp(name, "eos_token") ? t->eos : "";
}

/* the text of token tokenizer.ggml.<which>_token_id, malloc'd ("" when none) */
static char *special_text(const loom_gguf *g, const char *which, int is_used)
{
    char key[64];
    int64_t id;
    const char *s = "";
    uint64_t len = 0;
    snprintf(key, sizeof key, "tokenizer.ggml.%s_token_id", which);
    const loom_gguf_kv *tokens = loom_gguf_find(g, "tokenizer.ggml.tokens");
    if (is_used && tokens && loom_gguf_get_i64(g, key, &id) == 0 && id >= 0 &&
        loom_gguf_array_str(g, tokens, (uint64_t)id, &s, &len) != 0)
        s = "", len = 0;
    return strndup(s, (size_t)len);
}

loom_chat_template *loom_chat_template_from_gguf(const loom_gguf *g, const loom_tokenizer *tok,
                                                 char *err, size_t err_size)
{
    const char *text;
    uint64_t len;
    if (loom_gguf_get_str(g, "tokenizer.chat_template", &text, &len) != 0) {
        snprintf(err, err_size,
                 "the model file carries no chat template "
                 "(tokenizer.chat_template)");
        return NULL;
    }
    /* bos_token is the BOS the tokenizer puts first, "" where it puts none: transformers' is
     * null for Qwen, whose files still name <|endoftext|> as BOS */
    char *src = strndup(text, (size_t)len),
         *bos = special_text(g, "bos", !tok || loom_tokenizer_adds_bos(tok)),
         *eos = special_text(g, "eos", 1);
    loom_chat_template *t = NULL;
    if (!src || !bos || !eos)
        snprintf(err, err_size, "out of memory");
    else
        t = loom_chat_template_compile(src, bos, eos, err, err_size);
    free(src);
    free(bos);
    free(eos);
    return t;
}

loom_chat_template *loom_chat_template_from_file(const char *model_path, char *err, size_t err_size)
{
    loom_gguf g;
    if (loom_open_model_file(model_path, &g, NULL, NULL, err, err_size) != 0)
        return NULL;
    loom_tokenizer *tok = loom_tokenizer_from_gguf(&g, err, err_size);
    loom_chat_template *t = tok ? loom_chat_template_from_gguf(&g, tok, err, err_size) : NULL;
    loom_tokenizer_free(tok);
    loom_gguf_close(&g);
    return t;
}

/* a JSON text argument parsed, or NULL with err naming it */
static cJSON *parse_json_arg(const char *text, const char *what, int want_array, char *err,
                             size_t err_size)
{
    cJSON *j = cJSON_Parse(text);
    if (!j || (want_array ? !cJSON_IsArray(j) : !cJSON_IsObject(j))) {
        snprintf(err, err_size, "%s must be a JSON %s", what, want_array ? "array" : "object");
        cJSON_Delete(j);
        return NULL;
    }
    return j;
}

int loom_chat_template_render(const loom_chat_template *t, const loom_chat_vars *v, char **out,
                              loom_text_span **spans, int *n_spans, char *err, size_t err_size)
{
    cJSON *vars = cJSON_CreateObject(), *messages = NULL, *tools = NULL, *kwargs = NULL;
    int rc = -1;
    if (!vars) {
        snprintf(err, err_size, "out of memory");
        return -1;
    }
    if (!(messages = parse_json_arg(v->messages_json ? v->messages_json : "[]", "messages", 1, err,
                                    err_size)))
        goto done;
    if (v->tools_json && !(tools = parse_json_arg(v->tools_json, "tools", 1, err, err_size)))
        goto done;
    if (v->kwargs_json &&
        !(kwargs = parse_json_arg(v->kwargs_json, "the template's kwargs", 0, err, err_size)))
        goto done;
    /* what transformers passes: the special tokens, tools (None when absent), documents, the
     * generation prompt flag, then the caller's kwargs. Those are a client's text, as messages
     * are: they may not replace the variables above (a forged bos_token or message list), and
     * what they print is marked as text, so no special token can be read out of it. */
    static const char *const reserved[] = {"messages",  "tools",     "documents",
                                           "bos_token", "eos_token", "add_generation_prompt"};
    const char *untrusted[64] = {"messages", "tools", "documents"};
    int n_untrusted = 3;
    for (cJSON *k = kwargs ? kwargs->child : NULL; k; k = k->next) {
        for (size_t i = 0; i < sizeof reserved / sizeof *reserved; i++)
            if (!strcmp(k->string, reserved[i])) {
                snprintf(err, err_size,
                         "the template's kwargs may not set '%s': loom sets it (from the "
                         "request's messages and tools, and the model's file)",
                         k->string);
                goto done;
            }
        if (n_untrusted == (int)(sizeof untrusted / sizeof *untrusted) - 1) {
            snprintf(err, err_size, "the template's kwargs name more than %d variables",
                     n_untrusted - 3);
            goto done;
        }
        untrusted[n_untrusted++] = k->string;
    }
    untrusted[n_untrusted] = NULL;
    cJSON_AddItemToObject(vars, "messages", messages);
    messages = NULL;
    cJSON_AddItemToObject(vars, "tools", tools ? tools : cJSON_CreateNull());
    tools = NULL;
    cJSON_AddItemToObject(vars, "documents", cJSON_CreateNull());
    cJSON_AddBoolToObject(vars, "add_generation_prompt", v->add_generation_prompt);
    cJSON_AddStringToObject(vars, "bos_token", t->bos);
    cJSON_AddStringToObject(vars, "eos_token", t->eos);
    for (cJSON *k = kwargs ? kwargs->child : NULL; k; k = k->next)
        cJSON_AddItemToObject(vars, k->string, cJSON_Duplicate(k, 1));
    rc = jinja_render(t->jinja, vars, untrusted, NULL, out, NULL, spans, n_spans, err, err_size);
done:
    cJSON_Delete(vars);
    cJSON_Delete(messages);
    cJSON_Delete(tools);
    cJSON_Delete(kwargs);
    return rc;
}

/* ---- a model's own ------------------------------------------------------------------------ */

loom_chat_template *loom_model_chat_jinja(const loom_model *m, char *err, size_t err_size)
{
    return loom_chat_template_from_gguf(loom_model_gguf(m), loom_model_tokenizer_of(m), err,
                                        err_size);
}

const char *loom_model_chat_template(const loom_model *m, int *recognised)
{
    const char *stored, *arch, *pre;
    uint64_t len, alen, plen;
    char *tmpl = NULL, archname[64] = "", prename[64] = "";
    if (loom_gguf_get_str(loom_model_gguf(m), "tokenizer.chat_template", &stored, &len) == 0)
        tmpl = strndup(stored, (size_t)len);
    if (loom_gguf_get_str(loom_model_gguf(m), "general.architecture", &arch, &alen) == 0)
        snprintf(archname, sizeof archname, "%.*s", (int)(alen < 63 ? alen : 63), arch);
    if (loom_gguf_get_str(loom_model_gguf(m), "tokenizer.ggml.pre", &pre, &plen) == 0)
        snprintf(prename, sizeof prename, "%.*s", (int)(plen < 63 ? plen : 63), pre);
    const char *name = loom_chat_template_guess(tmpl, archname, prename, recognised);
    free(tmpl);
    return name;
}

/* ---- choosing between them ---------------------------------------------------------------- */

/* a template file whole, NUL-terminated, or NULL with err */
static char *read_template_file(const char *path, char *err, size_t err_size)
{
    size_t len;
    char *s = loom_file_read(path, (size_t)16 << 20, &len, err, err_size);
    if (s && strlen(s) != len) {
        snprintf(err, err_size, "%s holds a NUL byte: not a chat template", path);
        free(s);
        return NULL;
    }
    return s;
}

int loom_chat_format_choose(const loom_model *m, const char *builtin_name, const char *jinja_file,
                            loom_chat_format *f, char *err, size_t err_size)
{
    memset(f, 0, sizeof *f);
    int recognised = 1;
    if (builtin_name) {
        if (!loom_chat_template_valid(builtin_name)) {
            snprintf(err, err_size, "no chat template named '%s' (there are: %s)", builtin_name,
                     loom_chat_templates());
            return -1;
        }
        f->builtin = template_name(builtin_name); /* the caller's string may not outlive f */
        snprintf(f->about, sizeof f->about, "the built-in '%s' (--chat-template)", builtin_name);
        return 0;
    }
    /* the model's BOS and EOS text, for a file's template as for its own */
    char why[400];
    loom_chat_template *own = loom_model_chat_jinja(m, why, sizeof why);
    if (jinja_file) {
        char *src = read_template_file(jinja_file, err, err_size);
        if (src)
            f->jinja = loom_chat_template_compile(src, own ? own->bos : "", own ? own->eos : "",
                                                  err, err_size);
        free(src);
        loom_chat_template_free(own);
        if (!f->jinja) {
            if (src)
                snprintf(err + strlen(err), err_size - strlen(err), " (in %s)", jinja_file);
            return -1;
        }
        snprintf(f->about, sizeof f->about, "%s (Jinja, --chat-template-file)", jinja_file);
        return 0;
    }
    if (own) {
        f->jinja = own;
        snprintf(f->about, sizeof f->about, "the model's own (Jinja)");
        return 0;
    }
    f->builtin = loom_model_chat_template(m, &recognised);
    int none = strstr(why, "carries no chat template") != NULL;
    snprintf(f->about, sizeof f->about, "the built-in '%s'%s (%s%s)", f->builtin,
             recognised ? "" : ", a guess",
             none ? "the file has no template"
                  : "loom's Jinja "
                    "cannot run the model's: ",
             none ? "" : why);
    return 0;
}

void loom_chat_format_free(loom_chat_format *f)
{
    loom_chat_template_free(f->jinja);
    memset(f, 0, sizeof *f);
}

int loom_chat_format_reasons(const loom_chat_format *f)
{
    return f->jinja && f->jinja->reasons;
}

loom_tool_syntax loom_chat_format_tool_syntax(const loom_chat_format *f)
{
    return f->jinja ? f->jinja->tools : LOOM_TOOLS_NONE;
}

/* A built-in format renders role/content messages: v's messages read back from JSON. */
static int render_builtin_vars(const loom_chat_format *f, const loom_chat_vars *v, char **out,
                               loom_text_span **spans, int *n_spans, char *err, size_t err_size)
{
    if (v->kwargs_json || v->tools_json) {
        snprintf(err, err_size,
                 "%s need%s a Jinja chat template; this one is the built-in '%s' (give one with "
                 "--chat-template-file)",
                 v->tools_json ? "tools" : "template variables", v->tools_json ? "" : "s",
                 f->builtin);
        return -1;
    }
    cJSON *arr = parse_json_arg(v->messages_json ? v->messages_json : "[]", "messages", 1, err,
                                err_size);
    if (!arr)
        return -1;
    int n = cJSON_GetArraySize(arr), i = 0, rc = 0;
    loom_chat_message *m = calloc((size_t)(n ? n : 1), sizeof *m);
    if (!m) {
        snprintf(err, err_size, "out of memory");
        rc = -1;
    }
    for (const cJSON *x = arr->child; x && rc == 0; x = x->next, i++) {
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(x, "role");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(x, "content");
        if (cJSON_GetObjectItemCaseSensitive(x, "tool_calls") || !cJSON_IsString(role) ||
            !strcmp(role->valuestring, "tool")) {
            snprintf(err, err_size,
                     "messages[%d]: tool calls and results need a Jinja chat template; this one "
                     "is the built-in '%s'",
                     i, f->builtin);
            rc = -1;
            break;
        }
        m[i].role = role->valuestring;
        m[i].content = cJSON_IsString(content) ? content->valuestring : "";
    }
    if (rc == 0)
        rc = loom_chat_render_spans(f->builtin, m, n, v->add_generation_prompt, out, spans, n_spans,
                                    err, err_size);
    free(m);
    cJSON_Delete(arr);
    return rc;
}

int loom_chat_format_render_vars(const loom_chat_format *f, const loom_chat_vars *v, char **out,
                                 loom_text_span **spans, int *n_spans, int *add_special, char *err,
                                 size_t err_size)
{
    *add_special = f->jinja == NULL;
    if (!f->jinja)
        return render_builtin_vars(f, v, out, spans, n_spans, err, err_size);
    return loom_chat_template_render(f->jinja, v, out, spans, n_spans, err, err_size);
}

int loom_chat_format_render(const loom_chat_format *f, const loom_chat_message *msgs, int n,
                            const char *kwargs_json, int add_generation_prompt, char **out,
                            loom_text_span **spans, int *n_spans, int *add_special, char *err,
                            size_t err_size)
{
    cJSON *arr = cJSON_CreateArray();
    for (int i = 0; arr && i < n; i++) {
        cJSON *o = cJSON_CreateObject();
        if (!o || !cJSON_AddStringToObject(o, "role", msgs[i].role) ||
            !cJSON_AddStringToObject(o, "content", msgs[i].content)) {
            cJSON_Delete(o);
            cJSON_Delete(arr);
            arr = NULL;
            break;
        }
        cJSON_AddItemToArray(arr, o);
    }
    char *json = arr ? cJSON_PrintUnformatted(arr) : NULL;
    cJSON_Delete(arr);
    if (!json) {
        snprintf(err, err_size, "out of memory");
        return -1;
    }
    loom_chat_vars v = {.messages_json = json,
                        .kwargs_json = kwargs_json,
                        .add_generation_prompt = add_generation_prompt};
    int rc = loom_chat_format_render_vars(f, &v, out, spans, n_spans, add_special, err, err_size);
    free(json);
    return rc;
}
