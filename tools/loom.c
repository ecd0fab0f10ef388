#define _GNU_SOURCE
/*
 * tools/loom.c - the `loom` command line: one binary, one subcommand per job.
 */
#include <loom/loom.h>

#include "api/loader_env.h"

#include "args.h"
#include "bench_ops.h"
#include "json_text.h"

int loom_bench_main(int argc, char **argv, const char *self);      /* tools/bench.c */
int loom_perplexity_main(int argc, char **argv, const char *self); /* tools/perplexity.c */
int loom_chat_main(int argc, char **argv);                         /* tools/chat.c */
int loom_serve_main(int argc, char **argv);                        /* tools/serve/ */
int loom_bench_serve_main(int argc, char **argv);                  /* tools/bench_serve.c */

#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void usage(FILE *out)
{
    fprintf(
        out,
        "usage: loom COMMAND [ARGS]\n"
        "\n"
        "commands:\n"
        "  backends [--json]   list every backend module found, and which one a run would use\n"
        "  bench [-m MODEL | --synthetic 1b --type q4_0] [--backends LIST] [-p 128] [-n 32]\n"
        "                      prefill and decode tokens/s per backend (loom bench --help)\n"
        "  bench ops [--backends LIST] [--json]\n"
        "                      time each op on each backend (and CPU variant) side by side\n"
        "  bench serve [--clients 16] [-m MODEL]\n"
        "                      continuous batching: N concurrent clients against one at a time\n"
        "  run -m MODEL -p PROMPT [-n N] [sampling options] [--json]\n"
        "                      generate text (loom run --help for the options)\n"
        "  convert HF_DIR -o OUT.gguf [--type TYPE] [--quiet]\n"
        "                      a Hugging Face folder (Llama 1-3.3, Mistral, Qwen v1/2/3,\n"
        "                      ChatGLM-6B/2/3, GLM-4) to GGUF (loom convert --help for the types)\n"
        "  chat -m MODEL [--system TEXT] [--chat-template NAME]   talk to a model\n"
        "  serve -m MODEL [--port 8080] [--api-key-file FILE] [--max-batch N]\n"
        "                      an OpenAI-compatible HTTP server (loom serve --help)\n"
        "  tokenize -m MODEL [--json] [--no-special | --all-special] [--count] (TEXT | -f FILE)\n"
        "                      text to token ids (--count: how many, and how long it took;\n"
        "                      --all-special: the text is a rendered chat prompt)\n"
        "  detokenize -m MODEL IDS                          token ids to text\n"
        "  quantize IN.gguf OUT.gguf --type TYPE [--pure] [--quiet]\n"
        "                      requantise a GGUF file's float matrices to a type or a\n"
        "                      llama.cpp mix (q4_k_m, q5_k_m, q6_k, ...)\n"
        "  perplexity -m MODEL -f TEXT [-c 512] [--kl-base FILE] [--backends LIST]\n"
        "                      how well the model predicts a text, as llama.cpp measures it;\n"
        "                      KL divergence against a base run; backends side by side\n"
        "  template (-m MODEL | --template FILE) --messages FILE [--tools FILE] [--kwargs JSON]\n"
        "                      the prompt a model's own (Jinja) chat template makes of a\n"
        "                      conversation, as transformers renders it\n"
        "  inspect MODEL [--json]\n"
        "                      what a GGUF file (or a Hugging Face folder) holds: architecture,\n"
        "                      hyper-parameters, tokenizer, chat template, tensors and their\n"
        "                      types; checks the data is all there\n"
        "  verify MODEL [--json]\n"
        "                      read every byte: structure, loom's checksums, NaN/Inf weights,\n"
        "                      layer shapes, hyper-parameters, tokenizer against vocabulary\n"
        "  version             loom's version, git commit, backend ABI and module directories\n"
        "  help                this text\n"
        "\n"
        "environment:\n"
        "  LOOM_BACKEND=LIST        preference list, e.g. cuda:1,cpu (NAME or NAME:DEVICE)\n"
        "  LOOM_BACKEND_PATH=DIRS   colon-separated directories searched first for modules\n"
        "  LOOM_CPU_VARIANT=NAME    force a CPU variant (baseline, avx2, avx512)\n"
        "  LOOM_CPU_MAX_ISA=NAME    never pick a CPU variant above this ISA\n"
        "  LOOM_CPU_MASK=LIST       act as a CPU without these features (avx512,avx2,...)\n"
        "  LOOM_THREADS=N           CPU backend threads\n"
        "  LOOM_EXPLAIN=1           print the backend report to stderr for any command\n"
        "  (README.md lists the rest)\n");
}

/* ---- loom run ------------------------------------------------------------------------------ */

typedef struct run_output {
    int json;
    cJSON *ids;
    char *text;
    size_t len, cap;
} run_output;

static int on_token(void *user, int32_t id, const char *text, size_t len)
{
    run_output *o = user;
    if (id >= 0 && o->ids)
        cJSON_AddItemToArray(o->ids, cJSON_CreateNumber(id));
    if (o->json) {
        if (o->len + len + 1 > o->cap) {
            size_t cap = (o->len + len + 1) * 2;
            char *t = realloc(o->text, cap);
            if (!t)
                return 1;
            o->text = t;
            o->cap = cap;
        }
        memcpy(o->text + o->len, text, len);
        o->len += len;
        o->text[o->len] = '\0';
    } else {
        loom_print_text(stdout, text, len);
    }
    return 0;
}

static int cmd_run(int argc, char **argv)
{
    const char *prompt = NULL, *prompt_ids = NULL, *dump = NULL;
    long n_predict = 128;
    int json = 0;
    loom_open_flags of = {0};
    loom_spec_flags sf;
    loom_flag spec_flags[LOOM_SPEC_FLAGS];
    loom_spec_flag_table(&sf, spec_flags);
    loom_sampling s = loom_sampling_defaults();
    const loom_flag flags[] = {
        LOOM_FLAG_MODEL(&of.model),
        {"-p", "--prompt", LOOM_FLAG_TEXT, &prompt, 0, 0, "TEXT", "the prompt"},
        {"--prompt-ids", NULL, LOOM_FLAG_TEXT, &prompt_ids, 0, 0, "1,2,3",
         "the prompt as token ids instead"},
        {"-n", NULL, LOOM_FLAG_LONG, &n_predict, 0, 1 << 20, "N",
         "tokens to generate (default 128; stops early at EOS)"},
        {"-c", NULL, LOOM_FLAG_LONG, &of.n_ctx, 1, 1 << 20, "N",
         "context length (default: the model's, up to 4096)"},
        LOOM_FLAG_KV_TYPE(&of.kv_type),
        LOOM_FLAG_THREADS(&of.threads),
        LOOM_FLAG_EXPERTS_ON(&of.experts_on),
        LOOM_FLAG_DISTRIBUTED(&of.distributed),
        LOOM_FLAG_LAYERS(&of.layers),
        {"--json", NULL, LOOM_FLAG_SWITCH, &json, 0, 0, NULL,
         "print one JSON object: ids, text, timings"},
        {"--dump-logits", NULL, LOOM_FLAG_TEXT, &dump, 0, 0, "FILE",
         "write the last prompt position's logits (float32 LE)"},
    };
    const loom_command cmd = {.name = "loom run",
                              .synopsis = "-m MODEL (-p PROMPT | --prompt-ids 1,2,3) [options]",
                              .flags = flags,
                              .n_flags = LOOM_N_FLAGS(flags),
                              .sampling = &s,
                              .more_flags = spec_flags,
                              .n_more_flags = LOOM_SPEC_FLAGS,
                              .more_title = "speculative decoding:"};
    int parsed = loom_args_parse(&cmd, argc, argv);
    if (parsed)
        return parsed == 1 ? 0 : parsed;
    if (!of.model || (!prompt && !prompt_ids) || (prompt && prompt_ids)) {
        fprintf(stderr, "loom run: give -m MODEL and one of -p PROMPT or --prompt-ids LIST\n");
        loom_args_usage(&cmd, stderr);
        return 2;
    }
    char err[4096], drafter_about[600];
    loom_model *m, *drafter;
    loom_speculation spec_room;
    const loom_speculation *spec;
    int opened = loom_open_generating("loom run", &of, &sf, &m, &spec_room, &spec, &drafter,
                                      drafter_about, sizeof drafter_about);
    if (opened >= 0)
        return opened;
    int64_t cap = 4096, n = 0;
    int32_t *ids = malloc((size_t)cap * sizeof *ids);
    if (prompt_ids) {
        for (const char *p = prompt_ids; ids && *p;) {
            char *end;
            long id = strtol(p, &end, 10);
            if (end == p || id < 0 || id >= loom_model_n_vocab(m) || (*end && *end != ',') ||
                n == cap) {
                fprintf(stderr,
                        "loom run: --prompt-ids wants comma-separated ids below %d; "
                        "'%s' is not\n",
                        loom_model_n_vocab(m), p);
                free(ids);
                loom_model_close(drafter);
                loom_model_close(m);
                return 2;
            }
            ids[n++] = (int32_t)id;
            p = *end ? end + 1 : end;
        }
    } else {
        n = loom_tokenize(m, prompt, 1, LOOM_SPECIAL_TEXT, ids, cap, err, sizeof err);
        if (n > cap) {
            int32_t *more = realloc(ids, (size_t)n * sizeof *ids);
            if (more) {
                ids = more;
                cap = n;
                n = loom_tokenize(m, prompt, 1, LOOM_SPECIAL_TEXT, ids, cap, err, sizeof err);
            }
        }
    }
    if (!ids || n <= 0) {
        fprintf(stderr, "loom run: the prompt gives no tokens\n");
        free(ids);
        loom_model_close(drafter);
        loom_model_close(m);
        return 2;
    }
    if (!json)
        fprintf(stderr, "loom: %s on %s, %lld prompt tokens%s%s\n", of.model, loom_model_backend(m),
                (long long)n, spec ? "; speculative: " : "", spec ? drafter_about : "");
    run_output out = {json, json ? cJSON_CreateArray() : NULL, NULL, 0, 0};
    loom_generation st;
    int rc = loom_generate_speculative(m, spec, ids, (int32_t)n, 0, (int32_t)n_predict, &s,
                                       on_token, &out, &st, err, sizeof err);
    if (rc != 0) {
        fprintf(stderr, "%sloom run: %s\n", json ? "" : "\n", err);
    } else {
        if (dump) {
            FILE *f = fopen(dump, "wb");
            size_t nv = (size_t)loom_model_n_vocab(m);
            if (!f || fwrite(loom_prompt_logits(m), sizeof(float), nv, f) != nv) {
                fprintf(stderr, "loom run: cannot write %s: %s\n", dump, strerror(errno));
                rc = -1;
            }
            if (f)
                fclose(f);
        }
        if (json) {
            cJSON *o = cJSON_CreateObject(), *p = cJSON_AddArrayToObject(o, "prompt_ids");
            for (int64_t i = 0; i < n; i++)
                cJSON_AddItemToArray(p, cJSON_CreateNumber(ids[i]));
            cJSON_AddItemToObject(o, "generated_ids", out.ids);
            out.ids = NULL;
            json_add_text(o, "text", out.text, out.len); /* by length, valid UTF-8 */
            cJSON_AddStringToObject(o, "backend", loom_model_backend(m));
            cJSON_AddBoolToObject(o, "stopped_at_eos", st.stopped_at_eos);
            cJSON *t = cJSON_AddObjectToObject(o, "timings");
            cJSON_AddNumberToObject(t, "time_to_first_token_ms", st.ttft_ms);
            cJSON_AddNumberToObject(t, "prefill_tokens_per_s", st.prefill_tok_s);
            cJSON_AddNumberToObject(t, "decode_tokens_per_s", st.decode_tok_s);
            if (spec) {
                cJSON *sp = cJSON_AddObjectToObject(t, "speculative");
                cJSON_AddStringToObject(sp, "drafter", drafter_about);
                cJSON_AddNumberToObject(sp, "drafted", st.n_drafted);
                cJSON_AddNumberToObject(sp, "accepted", st.n_accepted);
                cJSON_AddNumberToObject(sp, "acceptance",
                                        st.n_drafted ? (double)st.n_accepted / st.n_drafted : 0);
                cJSON_AddNumberToObject(sp, "verify_steps", st.n_verify);
                /* each check yields its accepted proposals plus one token of the model's */
                cJSON_AddNumberToObject(
                    sp, "tokens_per_verify",
                    st.n_verify ? (double)(st.n_accepted + st.n_verify) / st.n_verify : 0);
            }
            char *js = cJSON_Print(o);
            printf("%s\n", js);
            free(js);
            cJSON_Delete(o);
        } else {
            fprintf(stderr,
                    "\nloom: %d tokens; time to first token %.1f ms, prefill %.1f tok/s, "
                    "decode %.1f tok/s\n",
                    st.n_generated, st.ttft_ms, st.prefill_tok_s, st.decode_tok_s);
            if (spec)
                fprintf(stderr,
                        "loom: speculative: %d proposed, %d accepted (%.0f%%) in %d checks\n",
                        st.n_drafted, st.n_accepted,
                        st.n_drafted ? 100.0 * st.n_accepted / st.n_drafted : 0.0, st.n_verify);
        }
    }
    cJSON_Delete(out.ids);
    free(out.text);
    free(ids);
    loom_model_close(drafter);
    loom_model_close(m);
    return rc == 0 ? 0 : 1;
}

static int cmd_convert(int argc, char **argv)
{
    const char *dir = NULL, *out = NULL, *type = "auto";
    int quiet = 0;
    const loom_flag flags[] = {
        {"-o", NULL, LOOM_FLAG_TEXT, &out, 0, 0, "OUT.gguf", "the GGUF file to write"},
        {"--type", NULL, LOOM_FLAG_TEXT, &type, 0, 0, "TYPE",
         "auto (each matrix as stored), or every matrix one type: f32, f16,\n"
         "bf16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, iq4_xs, q6_k; or a\n"
         "llama.cpp mix: q2_k, q3_k_s, q3_k_m, q3_k_l, q4_k_s, q4_k_m,\n"
         "q5_k_s, q5_k_m"},
        {"--quiet", NULL, LOOM_FLAG_SWITCH, &quiet, 0, 0, NULL,
         "no progress (a bar on a terminal, one line in a log)"},
    };
    const loom_command cmd = {
        .name = "loom convert",
        .synopsis = "HF_DIR -o OUT.gguf [--type TYPE] [--quiet]\n"
                    "  HF_DIR: a Hugging Face folder of Llama (1-3), Qwen (v1, 2, 3), ChatGLM\n"
                    "          (6B, 2, 3) or GLM-4",
        .flags = flags,
        .n_flags = LOOM_N_FLAGS(flags),
        .positional = &dir,
        .max_positional = 1};
    int parsed = loom_args_parse(&cmd, argc, argv);
    if (parsed)
        return parsed == 1 ? 0 : parsed;
    if (!dir || !out) {
        fprintf(stderr, "loom convert: give the folder and -o OUT.gguf\n");
        loom_args_usage(&cmd, stderr);
        return 2;
    }
    char err[4096];
    if (loom_convert(dir, out, type, quiet ? NULL : loom_progress_stderr, "converting", err,
                     sizeof err) != 0) {
        fprintf(stderr, "\nloom convert: %s\n", err);
        return 2;
    }
    fprintf(stderr, "wrote %s\n", out);
    return 0;
}

/* ---- loom tokenize / detokenize -------------------------------------------------------------- */

static int cmd_tokenize(int argc, char **argv)
{
    const char *model = NULL, *text = NULL, *file = NULL;
    int json = 0, count = 0, no_special = 0, all_special = 0;
    const loom_flag flags[] = {
        {"-m", "--model", LOOM_FLAG_TEXT, &model, 0, 0, "MODEL",
         "a GGUF file, a Hugging Face folder or a tokenizer file"},
        {"-f", NULL, LOOM_FLAG_TEXT, &file, 0, 0, "FILE", "the text from a file (- : stdin)"},
        {"--json", NULL, LOOM_FLAG_SWITCH, &json, 0, 0, NULL, "the ids as a JSON array"},
        {"--no-special", NULL, LOOM_FLAG_SWITCH, &no_special, 0, 0, NULL,
         "no BOS, and \"<s>\" and the like read as plain characters"},
        {"--all-special", NULL, LOOM_FLAG_SWITCH, &all_special, 0, 0, NULL,
         "a rendered chat prompt: every special token's text is the token"},
        {"--count", NULL, LOOM_FLAG_SWITCH, &count, 0, 0, NULL,
         "only the number of bytes and tokens, and the time taken"},
    };
    const loom_command cmd = {.name = "loom tokenize",
                              .synopsis = "-m MODEL [options] (TEXT | -f FILE)",
                              .flags = flags,
                              .n_flags = LOOM_N_FLAGS(flags),
                              .positional = &text,
                              .max_positional = 1};
    int parsed = loom_args_parse(&cmd, argc, argv);
    if (parsed)
        return parsed == 1 ? 0 : parsed;
    if (!model || !text == !file || (no_special && all_special)) {
        fprintf(stderr,
                "loom tokenize: give -m MODEL, one of TEXT and -f FILE, and at most one "
                "of --no-special and --all-special\n");
        loom_args_usage(&cmd, stderr);
        return 2;
    }
    int special = no_special ? LOOM_SPECIAL_NONE
        : all_special        ? LOOM_SPECIAL_ALL
                             : LOOM_SPECIAL_TEXT;
    char *owned = NULL;
    size_t len;
    if (file && !(text = owned = loom_arg_text_file("loom tokenize", "-f", file, &len)))
        return 2;
    char err[4096];
    loom_vocab *v = loom_vocab_open(model, err, sizeof err);
    if (!v) {
        fprintf(stderr, "loom tokenize: %s\n", err);
        free(owned);
        return 2;
    }
    /* --no-special: the text alone, with "<s>" and the like taken as plain characters;
     * --all-special: a rendered chat prompt, every special token's text read as the token */
    double t0 = loom_now_ms();
    int64_t n = loom_vocab_encode(v, text, special != LOOM_SPECIAL_NONE, special, NULL, 0);
    double took = loom_now_ms() - t0;
    int32_t *ids = n > 0 && !count ? malloc((size_t)n * sizeof *ids) : NULL;
    if (ids)
        loom_vocab_encode(v, text, special != LOOM_SPECIAL_NONE, special, ids, n);
    if (n < 0)
        fprintf(stderr, "loom tokenize: out of memory, or a piece of text too long to tokenize\n");
    else if (count)
        printf(json ? "{\"bytes\": %zu, \"tokens\": %lld, \"ms\": %.1f}\n"
                    : "%zu bytes, %lld tokens, %.1f ms\n",
               strlen(text), (long long)n, took);
    else {
        printf("%s", json ? "[" : "");
        for (int64_t i = 0; ids && i < n; i++)
            printf("%s%d", i ? (json ? ", " : " ") : "", ids[i]);
        printf("%s\n", json ? "]" : "");
    }
    free(ids);
    free(owned);
    loom_vocab_close(v);
    return n < 0 ? 1 : 0;
}

static int cmd_detokenize(int argc, char **argv)
{
    const char *model = NULL;
    const char **ids = calloc((size_t)argc + 1, sizeof *ids);
    int n_ids = 0;
    const loom_flag flags[] = {
        {"-m", "--model", LOOM_FLAG_TEXT, &model, 0, 0, "MODEL",
         "a GGUF file, a Hugging Face folder or a tokenizer file"},
    };
    const loom_command cmd = {.name = "loom detokenize",
                              .synopsis = "-m MODEL ID [ID ...] (or one comma-separated list)",
                              .flags = flags,
                              .n_flags = LOOM_N_FLAGS(flags),
                              .positional = ids,
                              .max_positional = argc,
                              .n_positional = &n_ids};
    int parsed = ids ? loom_args_parse(&cmd, argc, argv) : 2;
    if (parsed) {
        free(ids);
        return parsed == 1 ? 0 : parsed;
    }
    if (!model || n_ids == 0) {
        fprintf(stderr, "loom detokenize: give -m MODEL and the ids\n");
        loom_args_usage(&cmd, stderr);
        free(ids);
        return 2;
    }
    char err[4096];
    loom_vocab *v = loom_vocab_open(model, err, sizeof err);
    if (!v) {
        fprintf(stderr, "loom detokenize: %s\n", err);
        free(ids);
        return 2;
    }
    int32_t prev = -1;
    int rc = 0;
    for (int i = 0; i < n_ids && !rc; i++)
        for (const char *p = ids[i]; *p && !rc;) {
            char *end;
            long id = strtol(p, &end, 10);
            char piece[512];
            int k = end == p ? -1 : loom_vocab_piece(v, prev, (int32_t)id, piece, sizeof piece);
            if (k < 0 || (*end && *end != ',')) {
                fprintf(stderr, "\nloom detokenize: '%s' is not a token id below %d\n", p,
                        loom_vocab_size(v));
                rc = 2;
                break;
            }
            fwrite(piece, 1, (size_t)k, stdout);
            prev = (int32_t)id;
            p = *end ? end + 1 : end;
        }
    if (!rc)
        printf("\n");
    loom_vocab_close(v);
    free(ids);
    return rc;
}

static int cmd_quantize(int argc, char **argv)
{
    const char *files[3] = {NULL, NULL, NULL}, *type = NULL;
    int n_files = 0, pure = 0, quiet = 0;
    char type_help[1024];
    snprintf(type_help, sizeof type_help,
             "%s\neach as llama.cpp's quantizer mixes it (the output tensor q6_K, and\n"
             "more bits for some attn_v / ffn_down layers in the _m and _l mixes)",
             loom_quantize_types());
    const loom_flag flags[] = {
        {"--type", NULL, LOOM_FLAG_TEXT, &type, 0, 0, "TYPE", type_help},
        {"--pure", NULL, LOOM_FLAG_SWITCH, &pure, 0, 0, NULL, "every matrix TYPE's base type"},
        {"--quiet", NULL, LOOM_FLAG_SWITCH, &quiet, 0, 0, NULL, "no progress"},
    };
    /* a third positional is the older form's type: IN OUT TYPE */
    const loom_command cmd = {.name = "loom quantize",
                              .synopsis = "IN.gguf OUT.gguf --type TYPE [--pure] [--quiet]",
                              .flags = flags,
                              .n_flags = LOOM_N_FLAGS(flags),
                              .positional = files,
                              .max_positional = 3,
                              .n_positional = &n_files};
    int parsed = loom_args_parse(&cmd, argc, argv);
    if (parsed)
        return parsed == 1 ? 0 : parsed;
    if (n_files == 3 && !type)
        type = files[2];
    if (n_files < 2 || (n_files == 3 && type != files[2]) || !type) {
        fprintf(stderr, "loom quantize: give IN.gguf, OUT.gguf and --type TYPE\n");
        loom_args_usage(&cmd, stderr);
        return 2;
    }
    int how = pure ? LOOM_QUANTIZE_PURE : 0;
    if (strcmp(files[0], files[1]) == 0) {
        fprintf(stderr,
                "loom quantize: the output would overwrite the input; choose another name\n");
        return 2;
    }
    char err[4096];
    if (loom_quantize_opts(files[0], files[1], type, how, quiet ? NULL : loom_progress_stderr,
                           "quantizing", err, sizeof err) != 0) {
        fprintf(stderr, "\nloom quantize: %s\n", err);
        return 2;
    }
    fprintf(stderr, "wrote %s\n", files[1]);
    return 0;
}

/* loom template: a chat template rendered, to see (and test) the prompt a model is given */
static int cmd_template(int argc, char **argv)
{
    const char *model = NULL, *tmpl_file = NULL, *messages_file = NULL, *tools_file = NULL,
               *kwargs = NULL, *bos = NULL, *eos = NULL;
    int no_gen = 0, json = 0;
    const loom_flag flags[] = {
        LOOM_FLAG_MODEL(&model),
        {"--template", NULL, LOOM_FLAG_TEXT, &tmpl_file, 0, 0, "FILE",
         "a Jinja template instead of the model's (with -m: its BOS/EOS)"},
        {"--messages", NULL, LOOM_FLAG_TEXT, &messages_file, 0, 0, "FILE",
         "the conversation: an OpenAI messages array (-: standard input)"},
        {"--tools", NULL, LOOM_FLAG_TEXT, &tools_file, 0, 0, "FILE", "an OpenAI tools array"},
        {"--kwargs", NULL, LOOM_FLAG_TEXT, &kwargs, 0, 0, "JSON",
         "more variables, e.g. '{\"enable_thinking\": false}'"},
        {"--no-generation-prompt", NULL, LOOM_FLAG_SWITCH, &no_gen, 0, 0, NULL,
         "do not open the assistant's turn at the end"},
        {"--bos", NULL, LOOM_FLAG_TEXT, &bos, 0, 0, "TEXT", "bos_token, with --template alone"},
        {"--eos", NULL, LOOM_FLAG_TEXT, &eos, 0, 0, "TEXT", "eos_token, with --template alone"},
        {"--json", NULL, LOOM_FLAG_SWITCH, &json, 0, 0, NULL,
         "the prompt and where the messages' own text lies in it (spans)"},
    };
    const loom_command cmd = {
        .name = "loom template",
        .synopsis = "(-m MODEL | --template FILE) --messages FILE [--tools FILE] [--kwargs JSON]\n"
                    "  prints the prompt the chat template makes of the conversation, byte for\n"
                    "  byte as transformers' apply_chat_template does (loom's Jinja subset)",
        .flags = flags,
        .n_flags = LOOM_N_FLAGS(flags)};
    int parsed = loom_args_parse(&cmd, argc, argv);
    if (parsed)
        return parsed == 1 ? 0 : parsed;
    if ((!model && !tmpl_file) || !messages_file) {
        fprintf(stderr, "loom template: %s\n",
                !messages_file ? "which conversation? give --messages FILE"
                               : "which template? give -m MODEL or --template FILE");
        return 2;
    }
    char err[1024];
    size_t len;
    char *messages = loom_arg_text_file("loom template", "--messages", messages_file, &len);
    char *tools = tools_file ? loom_arg_text_file("loom template", "--tools", tools_file, &len)
                             : NULL;
    char *src = tmpl_file ? loom_arg_text_file("loom template", "--template", tmpl_file, &len)
                          : NULL;
    loom_chat_template *t = NULL;
    int rc = 2;
    if (!messages || (tools_file && !tools) || (tmpl_file && !src))
        goto done;
    if (model && !tmpl_file) {
        t = loom_chat_template_from_file(model, err, sizeof err);
    } else {
        loom_chat_template *from_model = NULL; /* its BOS and EOS text */
        if (model && !(from_model = loom_chat_template_from_file(model, err, sizeof err)) &&
            !strstr(err, "no chat template")) {
            fprintf(stderr, "loom template: %s\n", err);
            goto done;
        }
        if (from_model) {
            bos = bos ? bos : loom_chat_template_token(from_model, "bos_token");
            eos = eos ? eos : loom_chat_template_token(from_model, "eos_token");
        }
        t = loom_chat_template_compile(src, bos, eos, err, sizeof err);
        loom_chat_template_free(from_model);
    }
    if (!t) {
        fprintf(stderr, "loom template: %s\n", err);
        goto done;
    }
    loom_chat_vars vars = {.messages_json = messages,
                           .tools_json = tools,
                           .kwargs_json = kwargs,
                           .add_generation_prompt = !no_gen};
    char *prompt;
    loom_text_span *spans = NULL;
    int n_spans = 0;
    if (loom_chat_template_render(t, &vars, &prompt, &spans, &n_spans, err, sizeof err) != 0) {
        fprintf(stderr, "loom template: %s\n", err);
        rc = 1;
        goto done;
    }
    if (json) {
        cJSON *root = cJSON_CreateObject(), *sp = cJSON_AddArrayToObject(root, "spans");
        cJSON_AddStringToObject(root, "prompt", prompt);
        for (int i = 0; i < n_spans; i++) {
            cJSON *pair = cJSON_CreateArray();
            cJSON_AddItemToArray(pair, cJSON_CreateNumber((double)spans[i].start));
            cJSON_AddItemToArray(pair, cJSON_CreateNumber((double)spans[i].end));
            cJSON_AddItemToArray(sp, pair);
        }
        char *text = cJSON_Print(root);
        printf("%s\n", text ? text : "{}");
        free(text);
        cJSON_Delete(root);
    } else {
        fwrite(prompt, 1, strlen(prompt), stdout);
    }
    free(prompt);
    free(spans);
    rc = 0;
done:
    loom_chat_template_free(t);
    free(messages);
    free(tools);
    free(src);
    return rc;
}

static int cmd_inspect(int argc, char **argv)
{
    int json;
    const char *path;
    int rc = loom_arg_file_json("inspect", "FILE", argc, argv, &path, &json);
    if (rc)
        return rc < 0 ? 0 : rc;
    char err[1024];
    if (loom_inspect(path, stdout, json, err, sizeof err) != 0) {
        fprintf(stderr, "loom inspect: %s\n", err);
        return 2;
    }
    return 0;
}

typedef struct verify_out {
    int json;
    cJSON *checks;
} verify_out;

static void verify_line(void *user, const char *check, loom_check_status st, const char *message)
{
    verify_out *o = user;
    static const char *const names[] = {"ok", "PROBLEM", "skipped"};
    if (!o->json) {
        printf("%-8s %-10s %s\n", names[st], check, message);
        fflush(stdout);
        return;
    }
    cJSON *c = cJSON_CreateObject();
    cJSON_AddStringToObject(c, "check", check);
    cJSON_AddStringToObject(c, "status", st == LOOM_CHECK_PROBLEM ? "problem" : names[st]);
    cJSON_AddStringToObject(c, "message", message);
    cJSON_AddItemToArray(o->checks, c);
}

static int cmd_verify(int argc, char **argv)
{
    verify_out o = {0};
    const char *path;
    int rc = loom_arg_file_json("verify", "MODEL", argc, argv, &path, &o.json);
    if (rc)
        return rc < 0 ? 0 : rc;
    o.checks = cJSON_CreateArray();
    int problems = loom_verify(path, verify_line, &o);
    if (o.json) {
        cJSON *root = cJSON_CreateObject();
        cJSON_AddStringToObject(root, "file", path);
        cJSON_AddBoolToObject(root, "ok", problems == 0);
        cJSON_AddNumberToObject(root, "problems", problems);
        cJSON_AddItemToObject(root, "checks", o.checks);
        char *s = cJSON_Print(root);
        printf("%s\n", s ? s : "{}");
        free(s);
        cJSON_Delete(root);
    } else {
        cJSON_Delete(o.checks);
        printf("%s: %s\n", path, problems ? "DAMAGED (see PROBLEM above)" : "verified");
    }
    return problems ? 1 : 0;
}

static int cmd_backends(int argc, char **argv)
{
    int json = 0;
    const loom_flag flags[] = {
        {"--json", NULL, LOOM_FLAG_SWITCH, &json, 0, 0, NULL, "the report as JSON"},
    };
    const loom_command cmd = {
        .name = "loom backends",
        .synopsis = "[--json]\n"
                    "  every backend module found, whether it is usable here, and which one a run\n"
                    "  would choose and why (LOOM_BACKEND, LOOM_CPU_VARIANT, the probes' scores)",
        .flags = flags,
        .n_flags = LOOM_N_FLAGS(flags)};
    int parsed = loom_args_parse(&cmd, argc, argv);
    if (parsed)
        return parsed == 1 ? 0 : parsed;
    char err[4096];
    if (loom_backends_report(stdout, json, err, sizeof err) != 0) {
        fprintf(stderr, "loom: %s\n", err);
        return 1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "backends") == 0)
        return cmd_backends(argc - 2, argv + 2);
    if (strcmp(cmd, "run") == 0)
        return cmd_run(argc - 2, argv + 2);
    if (strcmp(cmd, "chat") == 0)
        return loom_chat_main(argc - 2, argv + 2);
    if (strcmp(cmd, "serve") == 0)
        return loom_serve_main(argc - 2, argv + 2);
    if (strcmp(cmd, "tokenize") == 0)
        return cmd_tokenize(argc - 2, argv + 2);
    if (strcmp(cmd, "detokenize") == 0)
        return cmd_detokenize(argc - 2, argv + 2);
    if (strcmp(cmd, "quantize") == 0)
        return cmd_quantize(argc - 2, argv + 2);
    if (strcmp(cmd, "convert") == 0)
        return cmd_convert(argc - 2, argv + 2);
    if (strcmp(cmd, "template") == 0)
        return cmd_template(argc - 2, argv + 2);
    if (strcmp(cmd, "inspect") == 0)
        return cmd_inspect(argc - 2, argv + 2);
    if (strcmp(cmd, "verify") == 0)
        return cmd_verify(argc - 2, argv + 2);
    /* commands that run themselves again in child processes, one per backend */
    char self[PATH_MAX];
    ssize_t self_len = readlink("/proc/self/exe", self, sizeof self - 1);
    self[self_len > 0 ? self_len : 0] = '\0';
    const char *me = self_len > 0 ? self : argv[0];
    if (strcmp(cmd, "bench") == 0) {
        if (argc >= 3 && strcmp(argv[2], "serve") == 0)
            return loom_bench_serve_main(argc - 3, argv + 3);
        if (argc >= 3 && strcmp(argv[2], "ops") == 0)
            return loom_bench_ops_main(argc - 3, argv + 3, me);
        return loom_bench_main(argc - 2, argv + 2, me);
    }
    if (strcmp(cmd, "perplexity") == 0)
        return loom_perplexity_main(argc - 2, argv + 2, me);
    if (strcmp(cmd, "version") == 0 || strcmp(cmd, "--version") == 0) {
        loom_registry reg;
        char err[512];
        loom_loader_options lo = loom_loader_options_from_env();
        int scanned = loom_registry_scan(&reg, &lo, err, sizeof err) == 0;
        printf("loom %s\ngit commit %s\nbackend ABI %d.%d\nbackend modules: %s\n", loom_version(),
               loom_git_commit(), LOOM_BACKEND_ABI_MAJOR, LOOM_BACKEND_ABI_MINOR,
               scanned ? reg.search_path : err);
        if (scanned)
            loom_registry_free(&reg);
        return 0;
    }
    if (strcmp(cmd, "help") == 0 || strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0) {
        usage(stdout);
        return 0;
    }
    fprintf(stderr, "loom: unknown command '%s'\n\n", cmd);
    usage(stderr);
    return 2;
}
