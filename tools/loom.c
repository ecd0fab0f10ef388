#define _GNU_SOURCE
/*
 * tools/loom.c - the `loom` command line: one binary, one subcommand per job.
 */
#include <loom/loom.h>

#include "core/loader.h"

#include "args.h"
#include "bench_ops.h"
#include "json_text.h"

int loom_bench_main(int argc, char **argv, const char *self); /* tools/bench.c */
int loom_perplexity_main(int argc, char **argv, const char *self); /* tools/perplexity.c */
int loom_chat_main(int argc, char **argv);                     /* tools/chat.c */
int loom_serve_main(int argc, char **argv);                    /* tools/serve.c */
int loom_bench_serve_main(int argc, char **argv);              /* tools/bench_serve.c */

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
    fprintf(out,
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
            "                      a Hugging Face folder (Llama 1-3, Qwen v1/2/3, ChatGLM-6B/2/3,\n"
            "                      GLM-4) to GGUF (loom convert --help for the types)\n"
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

static int parse_long(const char *flag, const char *v, long lo, long hi, long *out)
{
    return loom_arg_long("loom", flag, v, lo, hi, out);
}

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

static void run_usage(FILE *out)
{
    loom_sampling defaults = loom_sampling_defaults();
    fprintf(out,
            "usage: loom run -m MODEL.gguf (-p PROMPT | --prompt-ids 1,2,3) [options]\n"
            "  -n N                    tokens to generate (default 128; stops early at EOS)\n");
    loom_arg_sampling_usage(out, &defaults);
    fprintf(out,
            "  -c N                    context length (default: the model's, up to 4096)\n"
            "  --kv-type f16|f32|q8_0  KV cache precision (default f16)\n"
            "  --threads N             CPU backend threads\n"
            "  --json                  print one JSON object: ids, text, timings\n"
            "  --dump-logits FILE      write the last prompt position's logits (float32 LE)\n");
}

static int cmd_run(int argc, char **argv)
{
    const char *model = NULL, *prompt = NULL, *prompt_ids = NULL, *dump = NULL, *kv = NULL;
    long n_predict = 128, n_ctx = 0, threads = 0;
    int sampling;
    int json = 0;
    loom_sampling s = loom_sampling_defaults();
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        int takes = 1;
        if (!strcmp(a, "-m") || !strcmp(a, "--model")) model = val;
        else if (!strcmp(a, "-p") || !strcmp(a, "--prompt")) prompt = val;
        else if (!strcmp(a, "--prompt-ids")) prompt_ids = val;
        else if (!strcmp(a, "--dump-logits")) dump = val;
        else if (!strcmp(a, "--kv-type")) kv = val;
        else if (!strcmp(a, "-n")) { if (parse_long(a, val, 0, 1 << 20, &n_predict)) return 2; }
        else if (!strcmp(a, "-c")) { if (parse_long(a, val, 1, 1 << 20, &n_ctx)) return 2; }
        else if (!strcmp(a, "--threads")) { if (parse_long(a, val, 1, 1024, &threads)) return 2; }
        else if ((sampling = loom_arg_sampling("loom run", a, val, &s)) != 0) { if (sampling < 0) return 2; }
        else if (!strcmp(a, "--json")) { json = 1; takes = 0; }
        else if (!strcmp(a, "--help") || !strcmp(a, "-h")) { run_usage(stdout); return 0; }
        else {
            fprintf(stderr, "loom run: unknown option '%s'\n", a);
            run_usage(stderr);
            return 2;
        }
        if (takes && !val) {
            fprintf(stderr, "loom run: %s needs a value\n", a);
            return 2;
        }
        i += takes;
    }
    if (!model || (!prompt && !prompt_ids) || (prompt && prompt_ids)) {
        fprintf(stderr, "loom run: give -m MODEL and one of -p PROMPT or --prompt-ids LIST\n");
        run_usage(stderr);
        return 2;
    }
    char err[4096];
    loom_model_options mo = {.n_ctx = (int32_t)n_ctx, .kv_type = kv, .n_threads = (int32_t)threads};
    loom_model *m = loom_model_open(model, &mo, err, sizeof err);
    if (!m) {
        fprintf(stderr, "loom run: %s\n", err);
        return 2;
    }
    int64_t cap = 4096, n = 0;
    int32_t *ids = malloc((size_t)cap * sizeof *ids);
    if (prompt_ids) {
        for (const char *p = prompt_ids; ids && *p;) {
            char *end;
            long id = strtol(p, &end, 10);
            if (end == p || id < 0 || id >= loom_model_n_vocab(m) || (*end && *end != ',') || n == cap) {
                fprintf(stderr, "loom run: --prompt-ids wants comma-separated ids below %d; "
                                "'%s' is not\n", loom_model_n_vocab(m), p);
                free(ids);
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
        loom_model_close(m);
        return 2;
    }
    if (!json)
        fprintf(stderr, "loom: %s on %s, %lld prompt tokens\n", model, loom_model_backend(m),
                (long long)n);
    run_output out = {json, json ? cJSON_CreateArray() : NULL, NULL, 0, 0};
    loom_generation st;
    int rc = loom_generate(m, ids, (int32_t)n, (int32_t)n_predict, &s, on_token, &out, &st, err,
                           sizeof err);
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
            char *js = cJSON_Print(o);
            printf("%s\n", js);
            free(js);
            cJSON_Delete(o);
        } else {
            fprintf(stderr, "\nloom: %d tokens; time to first token %.1f ms, prefill %.1f tok/s, "
                            "decode %.1f tok/s\n",
                    st.n_generated, st.ttft_ms, st.prefill_tok_s, st.decode_tok_s);
        }
    }
    cJSON_Delete(out.ids);
    free(out.text);
    free(ids);
    loom_model_close(m);
    return rc == 0 ? 0 : 1;
}

static void convert_usage(FILE *f)
{
    fprintf(f, "usage: loom convert HF_DIR -o OUT.gguf [--type TYPE] [--quiet]\n"
               "  HF_DIR: a Hugging Face folder of Llama (1-3), Qwen (v1, 2, 3), ChatGLM\n"
               "          (6B, 2, 3) or GLM-4\n"
               "  TYPE: auto (each matrix as stored), or every matrix one type: f32, f16,\n"
               "        bf16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, iq4_xs, q6_k; or a\n"
               "        llama.cpp mix: q2_k, q3_k_s, q3_k_m, q3_k_l, q4_k_s, q4_k_m,\n"
               "        q5_k_s, q5_k_m\n"
               "  --quiet: no progress (a bar on a terminal, one line in a log)\n");
}

static int cmd_convert(int argc, char **argv)
{
    const char *dir = NULL, *out = NULL, *type = "auto";
    int quiet = 0;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            convert_usage(stdout);
            return 0;
        }
        if ((!strcmp(argv[i], "-o") || !strcmp(argv[i], "--type")) && i + 1 >= argc) {
            fprintf(stderr, "loom convert: %s needs a value\n", argv[i]);
            return 2;
        }
        if (!strcmp(argv[i], "--quiet"))
            quiet = 1;
        else if (!strcmp(argv[i], "-o"))
            out = argv[++i];
        else if (!strcmp(argv[i], "--type"))
            type = argv[++i];
        else if (argv[i][0] == '-' || dir) {
            fprintf(stderr, "loom convert: unexpected argument '%s'\n", argv[i]);
            dir = NULL;
            break;
        } else
            dir = argv[i];
    }
    if (!dir || !out) {
        convert_usage(stderr);
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

static void tokenize_usage(FILE *f)
{
    fprintf(f, "usage: loom tokenize -m MODEL [--json] [--no-special | --all-special] [--count] "
               "(TEXT | -f FILE)\n");
}

static int cmd_tokenize(int argc, char **argv)
{
    const char *model = NULL, *text = NULL, *file = NULL;
    int json = 0, special = LOOM_SPECIAL_TEXT, count = 0;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            tokenize_usage(stdout);
            return 0;
        }
        if (!strcmp(argv[i], "-m") && i + 1 < argc)
            model = argv[++i];
        else if (!strcmp(argv[i], "-f") && i + 1 < argc)
            file = argv[++i];
        else if (!strcmp(argv[i], "--json"))
            json = 1;
        else if (!strcmp(argv[i], "--no-special"))
            special = LOOM_SPECIAL_NONE;
        else if (!strcmp(argv[i], "--all-special"))
            special = LOOM_SPECIAL_ALL;
        else if (!strcmp(argv[i], "--count"))
            count = 1;
        else if ((argv[i][0] == '-' && argv[i][1]) || text) {
            fprintf(stderr, "loom tokenize: unexpected argument '%s'\n", argv[i]);
            return 2;
        } else
            text = argv[i];
    }
    if (!model || !text == !file) {
        tokenize_usage(stderr);
        return 2;
    }
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
        printf(json ? "{\"bytes\": %zu, \"tokens\": %lld, \"ms\": %.1f}\n" : "%zu bytes, %lld tokens, %.1f ms\n",
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
    int first = argc;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: loom detokenize -m MODEL ID [ID ...] (or one comma-separated list)\n");
            return 0;
        }
        if (!strcmp(argv[i], "-m") && i + 1 < argc) {
            model = argv[++i];
        } else {
            first = i;
            break;
        }
    }
    if (!model || first >= argc) {
        fprintf(stderr, "usage: loom detokenize -m MODEL ID [ID ...] (or one comma-separated list)\n");
        return 2;
    }
    char err[4096];
    loom_vocab *v = loom_vocab_open(model, err, sizeof err);
    if (!v) {
        fprintf(stderr, "loom detokenize: %s\n", err);
        return 2;
    }
    int32_t prev = -1;
    int rc = 0;
    for (int i = first; i < argc && !rc; i++)
        for (const char *p = argv[i]; *p && !rc;) {
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
    return rc;
}

static void quantize_usage(FILE *f)
{
    fprintf(f, "usage: loom quantize IN.gguf OUT.gguf --type TYPE [--pure] [--quiet]\n"
               "  TYPE: %s\n"
               "  each as llama.cpp's quantizer mixes it (the output tensor q6_K, and\n"
               "  more bits for some attn_v / ffn_down layers in the _m and _l mixes);\n"
               "  --pure: every matrix TYPE's base type\n", loom_quantize_types());
}

static int cmd_quantize(int argc, char **argv)
{
    const char *files[2] = {NULL, NULL}, *type = NULL;
    int n_files = 0, bad = 0, flags = 0, quiet = 0;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            quantize_usage(stdout);
            return 0;
        }
        if (!strcmp(argv[i], "--type") && i + 1 < argc)
            type = argv[++i];
        else if (!strcmp(argv[i], "--pure"))
            flags |= LOOM_QUANTIZE_PURE;
        else if (!strcmp(argv[i], "--quiet"))
            quiet = 1;
        else if (argv[i][0] == '-' && argv[i][1])
            bad = 1;
        else if (n_files < 2)
            files[n_files++] = argv[i];
        else if (!type)
            type = argv[i]; /* the older form: IN OUT TYPE */
        else
            bad = 1;
    }
    if (bad || n_files != 2 || !type) {
        quantize_usage(stderr);
        return 2;
    }
    if (strcmp(files[0], files[1]) == 0) {
        fprintf(stderr, "loom quantize: the output would overwrite the input; choose another name\n");
        return 2;
    }
    char err[4096];
    if (loom_quantize_opts(files[0], files[1], type, flags, quiet ? NULL : loom_progress_stderr,
                           "quantizing", err, sizeof err) != 0) {
        fprintf(stderr, "\nloom quantize: %s\n", err);
        return 2;
    }
    fprintf(stderr, "wrote %s\n", files[1]);
    return 0;
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
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0) {
            json = 1;
        } else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            printf("usage: loom backends [--json]\n"
                   "  every backend module found, whether it is usable here, and which one a run\n"
                   "  would choose and why (LOOM_BACKEND, LOOM_CPU_VARIANT, the probes' scores)\n");
            return 0;
        } else {
            fprintf(stderr, "loom backends: unknown argument '%s' (the only option is --json)\n",
                    argv[i]);
            return 2;
        }
    }
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
        int scanned = loom_registry_scan(&reg, err, sizeof err) == 0;
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
