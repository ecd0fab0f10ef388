/*
 * tests/test_hostile_files.c - model folders an attacker wrote are refused with a message that
 * names what is wrong, never crash, hang or eat the machine. Each folder is a fixture's files
 * (linked) with one file rewritten; each conversion runs in a child with a deadline, so a
 * crash or a hang is a failure of that case and the rest still run.
 *
 * What each case guards (issue 46): a token id past the vocabulary (once a heap overflow), a
 * config value that is not a whole positive count (once SIGFPE), a vocabulary size that pads
 * without end, a FIFO where a file belongs (once a hang in open), ids from
 * generation_config.json outside the vocabulary; and GGUF files whose hyper-parameters load
 * but answer garbage (a NaN epsilon, a zero RoPE base), whose tensors disagree with them
 * (`loom verify` passed files `loom run` refuses), or whose logits overflow.
 */
#define _GNU_SOURCE
#include "core/gguf.h"
#include "models/models.h"

#include <loom/loom.h>

#include "check.h"
#include "hf_writer.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char fixtures[4096], tmp[] = "/tmp/loom-hostile-XXXXXX";

/* tmp/name: links to every file of the fixture but `except` (a name, or NULL). */
static const char *clone_fixture(const char *fixture, const char *name, const char *except)
{
    static char folder[4200];
    char from[4200], to[8500];
    snprintf(folder, sizeof folder, "%s/%s", tmp, name);
    mkdir(folder, 0700);
    snprintf(from, sizeof from, "%s/%s", fixtures, fixture);
    DIR *d = opendir(from);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        if (e->d_name[0] == '.' || (except && !strcmp(e->d_name, except)))
            continue;
        char target[8500];
        snprintf(target, sizeof target, "%s/%s", from, e->d_name);
        snprintf(to, sizeof to, "%s/%s", folder, e->d_name);
        char abs[4096];
        CHECK(realpath(target, abs) && symlink(abs, to) == 0, "linking %s", to);
    }
    if (d)
        closedir(d);
    return folder;
}

static void write_file(const char *folder, const char *name, const char *text)
{
    char p[4400];
    snprintf(p, sizeof p, "%s/%s", folder, name);
    unlink(p);
    FILE *f = fopen(p, "w");
    CHECK(f && fputs(text, f) >= 0 && fclose(f) == 0, "writing %s", p);
}

/* The fixture's JSON file `name` with key set to value (JSON text) in folder. */
static void edit_json(const char *folder, const char *fixture, const char *name, const char *key,
                      const char *value)
{
    char p[4400];
    snprintf(p, sizeof p, "%s/%s/%s", fixtures, fixture, name);
    char *text = slurp(p, NULL);
    cJSON *j = text ? cJSON_Parse(text) : NULL;
    free(text);
    CHECK(j != NULL, "reading %s", p);
    if (!j)
        return;
    cJSON_DeleteItemFromObjectCaseSensitive(j, key);
    cJSON_AddItemToObject(j, key, cJSON_Parse(value));
    char *out = cJSON_Print(j);
    write_file(folder, name, out);
    free(out);
    cJSON_Delete(j);
}

typedef enum { WHOLE_MODEL, TOKENIZER_ONLY } conversion;

/* Converts folder in a child under a deadline: the conversion must fail with a message
 * holding want (or succeed, want NULL). */
static void expect(const char *what, const char *folder, conversion kind, const char *want)
{
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        alarm(60);
        char err[2048] = "", out[4400];
        snprintf(out, sizeof out, "%s/out.gguf", tmp);
        int rc = kind == WHOLE_MODEL ? loom_convert(folder, out, "f32", NULL, NULL, err, sizeof err)
                                     : loom_convert_tokenizer(folder, out, err, sizeof err);
        unlink(out);
        if (want ? rc == 0 : rc != 0) {
            fprintf(stderr, "  %s: %s\n", what, rc == 0 ? "accepted" : err);
            _exit(2);
        }
        if (want && !strstr(err, want)) {
            fprintf(stderr, "  %s: the message does not say '%s': %s\n", what, want, err);
            _exit(3);
        }
        printf("  %s: %s\n", what, want ? err : "converts");
        fflush(stdout); /* _exit flushes nothing */
        _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "%s: %s %d", what,
          WIFSIGNALED(status) ? "killed by signal" : "exit status",
          WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
}

/* A byte-level tokenizer.json (Qwen2's pre-tokenizer) whose added tokens are given. */
static void write_tokenizer_json(const char *folder, const char *added)
{
    char text[2048];
    snprintf(text, sizeof text,
             "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, "
             "\"merges\": [\"a b\"]}, \"pre_tokenizer\": {\"type\": \"Sequence\", "
             "\"pretokenizers\": [{\"type\": \"Split\", \"pattern\": {\"Regex\": "
             "\"\\\\p{N}| ?[^\\\\s\\\\p{L}\\\\p{N}]+\"}}, {\"type\": \"ByteLevel\"}]}, "
             "\"added_tokens\": %s}",
             added);
    write_file(folder, "tokenizer.json", text);
}

static void test_token_ids(void)
{
    const char *f = clone_fixture("tiny-qwen2", "qwen2-as-is", NULL);
    expect("the fixture itself", f, WHOLE_MODEL, NULL);
    remove_folder(f);

    /* an id that wrapped n_vocab = id + 1 to a negative size, then one written through it */
    f = clone_fixture("tiny-qwen2", "added-id-max", NULL);
    write_tokenizer_json(f,
                         "[{\"id\": 2147483647, \"content\": \"x\"}, {\"id\": 5, "
                         "\"content\": \"y\"}]");
    expect("tokenizer.json added id 2^31-1", f, TOKENIZER_ONLY, "2147483647");
    expect("the same, with the model", f, WHOLE_MODEL, "2147483647");
    remove_folder(f);

    f = clone_fixture("tiny-qwen2", "added-id-frac", NULL);
    write_tokenizer_json(f, "[{\"id\": 3.5, \"content\": \"x\"}]");
    expect("tokenizer.json added id 3.5", f, TOKENIZER_ONLY, "3.5");
    remove_folder(f);

    f = clone_fixture("tiny-qwen2", "added-id-past-rows", NULL);
    write_tokenizer_json(f, "[{\"id\": 151936, \"content\": \"x\"}]");
    expect("an added id just past the embedding's 151936 rows", f, WHOLE_MODEL, "151936");
    remove_folder(f);

    f = clone_fixture("tiny-qwen2", "decoder-key-max", NULL);
    edit_json(f, "tiny-qwen2", "tokenizer_config.json", "added_tokens_decoder",
              "{\"2147483647\": {\"content\": \"x\", \"special\": true}, \"5\": {\"content\": "
              "\"y\"}}");
    expect("added_tokens_decoder key 2^31-1", f, TOKENIZER_ONLY, "2147483647");
    remove_folder(f);

    f = clone_fixture("tiny-qwen2", "decoder-key-text", NULL);
    edit_json(f, "tiny-qwen2", "tokenizer_config.json", "added_tokens_decoder",
              "{\"seven\": {\"content\": \"x\"}}");
    expect("added_tokens_decoder key 'seven'", f, TOKENIZER_ONLY, "added_tokens_decoder");
    remove_folder(f);

    f = clone_fixture("tiny-qwen2", "vocab-huge", NULL);
    edit_json(f, "tiny-qwen2", "config.json", "vocab_size", "2147483647");
    expect("vocab_size 2^31-1 (padded without end, before)", f, TOKENIZER_ONLY, "vocab_size");
    expect("the same, with the model", f, WHOLE_MODEL, "vocab_size");
    remove_folder(f);

    f = clone_fixture("tiny-qwen2", "vocab-not-rows", NULL);
    edit_json(f, "tiny-qwen2", "config.json", "vocab_size", "151000");
    expect("vocab_size other than the embedding's rows", f, WHOLE_MODEL, "151936 rows");
    remove_folder(f);

    f = clone_fixture("tiny-qwen2", "eos-past", NULL);
    edit_json(f, "tiny-qwen2", "config.json", "eos_token_id", "99999999");
    expect("config.json eos_token_id past the vocabulary", f, WHOLE_MODEL, "eos_token_id");
    remove_folder(f);

    f = clone_fixture("tiny-qwen2", "stops-past", NULL);
    edit_json(f, "tiny-qwen2", "generation_config.json", "eos_token_id", "[151645, 4000000000]");
    expect("generation_config.json stop id past the vocabulary", f, WHOLE_MODEL, "4000000000");
    remove_folder(f);
}

static void test_config_values(void)
{
    static const struct {
        const char *fixture, *key, *value, *want;
    } cases[] = {
        {"tiny-qwen2", "num_attention_heads", "0.5", "num_attention_heads is 0.5"}, /* SIGFPE */
        {"tiny-qwen2", "num_attention_heads", "0", "num_attention_heads is 0"},
        {"tiny-qwen2", "num_attention_heads", "1e12", "num_attention_heads is 1000000000000"},
        {"tiny-qwen2", "num_attention_heads", "\"4\"", "num_attention_heads is \"4\""},
        {"tiny-qwen2", "hidden_size", "-32", "hidden_size is -32"},
        {"tiny-qwen2", "num_hidden_layers", "2.5", "num_hidden_layers is 2.5"},
        {"tiny-qwen2", "num_key_value_heads", "3", "not a multiple of num_key_value_heads 3"},
        {"tiny-qwen2", "num_key_value_heads", "0.25", "num_key_value_heads is 0.25"},
        {"tiny-qwen2", "head_dim", "4294967296", "head_dim is 4294967296"},
        {"tiny-qwen2", "rms_norm_eps", "-1", "rms_norm_eps is -1"},
        {"tiny-qwen2", "rope_theta", "0", "rope_theta is 0"},
        {"tiny-qwen2", "rope_scaling", "{\"type\": \"linear\", \"factor\": -2}",
         "rope_scaling.factor is -2"},
        {"tiny-qwen2", "max_position_embeddings", "0", "max_position_embeddings is 0"},
        {"tiny-qwen2", "rope_scaling", "{\"rope_type\": \"yarn\", \"factor\": 0.5}",
         "factor 0.5 must be at least 1"},
        {"tiny-qwen2", "rope_scaling", "{\"rope_type\": \"yarn\", \"factor\": 4, \"mscale\": 0.7}",
         "rope_scaling.mscale"},
        {"tiny-qwen2", "rope_scaling", "{\"rope_type\": \"yarn\", \"factor\": 4, \"beta_fast\": 1}",
         "beta_fast 1 must be above beta_slow 1"},
        {"tiny-qwen2", "rope_scaling", "{\"rope_type\": \"dynamic\", \"factor\": 2}",
         "rope_scaling type 'dynamic' is not supported"},
        /* the ChatGLM hooks' own keys */
        {"tiny-chatglm3", "num_attention_heads", "0.5", "num_attention_heads is 0.5"},
        {"tiny-chatglm3", "multi_query_group_num", "0", "multi_query_group_num is 0"},
        {"tiny-chatglm3", "kv_channels", "1e300", "kv_channels is 1e+300"},
        {"tiny-chatglm3", "rope_ratio", "-1", "rope_ratio is -1"},
        {"tiny-chatglm3", "padded_vocab_size", "2147483647", "padded_vocab_size is 2147483647"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char name[64], what[256];
        snprintf(name, sizeof name, "config-%zu", i);
        snprintf(what, sizeof what, "%s %s: %s", cases[i].fixture, cases[i].key, cases[i].value);
        const char *f = clone_fixture(cases[i].fixture, name, NULL);
        edit_json(f, cases[i].fixture, "config.json", cases[i].key, cases[i].value);
        expect(what, f, WHOLE_MODEL, cases[i].want);
        remove_folder(f);
    }
}

/* A FIFO in a file's place: open() would wait for a writer that never comes. */
static void test_fifos(void)
{
    static const struct {
        const char *fixture, *file, *want;
        conversion kind;
    } cases[] = {
        {"tiny-qwen2", "config.json", "a FIFO", WHOLE_MODEL},
        {"tiny-qwen2", "tokenizer_config.json", "a FIFO", TOKENIZER_ONLY},
        {"tiny-qwen2", "vocab.json", "a FIFO", TOKENIZER_ONLY},
        {"tiny-qwen2", "generation_config.json", "a FIFO", WHOLE_MODEL},
        {"tiny-qwen2", "model.safetensors", "a FIFO", WHOLE_MODEL},
        {"tiny-qwen2", "model.safetensors.index.json", "a FIFO", WHOLE_MODEL},
        {"tiny-llama", "tokenizer.model", "a FIFO", TOKENIZER_ONLY},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char name[64], what[256], p[4400];
        snprintf(name, sizeof name, "fifo-%zu", i);
        snprintf(what, sizeof what, "%s: a FIFO as %s", cases[i].fixture, cases[i].file);
        const char *f = clone_fixture(cases[i].fixture, name, cases[i].file);
        snprintf(p, sizeof p, "%s/%s", f, cases[i].file);
        if (!strcmp(cases[i].file, "model.safetensors.index.json")) {
            /* the index is read when the folder has one instead of the single file */
            char w[4400];
            snprintf(w, sizeof w, "%s/model.safetensors", f);
            unlink(w);
        }
        CHECK(mkfifo(p, 0600) == 0, "mkfifo %s", p);
        expect(what, f, cases[i].kind, cases[i].want);
        remove_folder(f);
    }
}

/* ---- GGUF files ------------------------------------------------------------------------------
 * loom's synthetic tiny model (2 layers, 64 wide, an FFN of 192, 512 tokens) rewritten with
 * one key's value or one tensor changed. */

typedef struct gguf_edit {
    const char *key; /* an f32 key to set (replacing the file's), or NULL */
    float value;
    const char *tensor;  /* a tensor to replace, or NULL */
    int64_t keep;        /* ... by its first `keep` rows (a matrix) or elements (a vector), */
    float fill;          /* ... or, with keep 0, by one of the same shape filled with this */
    int32_t unused_from; /* > 0: the tokens from this id on are placeholders (type UNUSED) */
    const char *str_key, *str_value; /* a string key to set, or NULL */
} gguf_edit;

/* the GGUF the edits start from: loom's synthetic tiny model, written into tmp by main (the
 * fixtures' stories260K, which llama.cpp wrote, is checked as it is when present) */
static char edit_src[4200];

static int write_edited(const char *out, const gguf_edit *e)
{
    char err[1024];
    const char *src = edit_src;
    loom_gguf g;
    if (loom_gguf_open(&g, src, err, sizeof err) != 0)
        return -1;
    loom_gguf_writer *w = loom_gguf_writer_create();
    for (uint64_t i = 0; i < g.n_kv; i++)
        if ((!e->key || strcmp(g.kv[i].key, e->key)) &&
            (!e->str_key || strcmp(g.kv[i].key, e->str_key)) &&
            (!e->unused_from || strcmp(g.kv[i].key, "tokenizer.ggml.token_type")))
            loom_gguf_copy_kv(w, &g, &g.kv[i]);
    if (e->unused_from) {
        int32_t types[512];
        for (int32_t id = 0; id < 512; id++)
            types[id] = id < 3 ? 3 : id < 259 ? 6 : id < e->unused_from ? 1 : 5;
        loom_gguf_set_i32_array(w, "tokenizer.ggml.token_type", types, 512);
    }
    if (e->key)
        loom_gguf_set_f32(w, e->key, e->value);
    if (e->str_key)
        loom_gguf_set_str(w, e->str_key, e->str_value);
    float *filled = NULL;
    for (uint64_t i = 0; i < g.n_tensors; i++) {
        const loom_gguf_tensor *t = &g.tensors[i];
        int64_t ne[2] = {t->ne[0], t->n_dims > 1 ? t->ne[1] : 1};
        const void *data = loom_gguf_tensor_data(&g, t);
        if (e->tensor && !strcmp(t->name, e->tensor)) {
            if (e->keep)
                ne[t->n_dims - 1] = e->keep;
            else {
                filled = malloc((size_t)(ne[0] * ne[1]) * sizeof *filled);
                for (int64_t k = 0; k < ne[0] * ne[1]; k++)
                    filled[k] = e->fill;
                data = filled;
            }
        }
        loom_gguf_add_tensor(w, t->name, t->type, t->n_dims, ne, data);
    }
    int rc = loom_gguf_write(w, out, err, sizeof err);
    loom_gguf_writer_free(w);
    loom_gguf_close(&g);
    free(filled);
    return rc;
}

static void count_problem(void *user, const char *check, loom_check_status st, const char *msg)
{
    if (st == LOOM_CHECK_PROBLEM) {
        ++*(int *)user;
        printf("    verify: %s: %s\n", check, msg);
    }
}

typedef enum { REFUSED_AT_OPEN, VERIFY_FINDS, GENERATE_FAILS, RUNS } gguf_expectation;

static void expect_gguf(const char *what, const gguf_edit *e, gguf_expectation want,
                        const char *message)
{
    char path[4200], err[2048] = "";
    snprintf(path, sizeof path, "%s/edited.gguf", tmp);
    CHECK(write_edited(path, e) == 0, "%s: writing the file", what);
    loom_model_options mo = {.n_ctx = 64};
    loom_model *m = loom_model_open(path, &mo, err, sizeof err);
    if (want == REFUSED_AT_OPEN) {
        CHECK(!m && strstr(err, message), "%s: refused at open, saying '%s': %s", what, message,
              m ? "it opened" : err);
    } else if (want == VERIFY_FINDS) {
        int problems = 0;
        loom_verify(path, count_problem, &problems);
        CHECK(problems > 0, "%s: loom verify finds a problem", what);
    } else {
        int32_t prompt[2] = {1, 400};
        loom_sampling s = {.temperature = 0};
        int rc = m ? loom_generate(m, prompt, 2, 4, &s, NULL, NULL, NULL, err, sizeof err) : -1;
        if (want == GENERATE_FAILS)
            CHECK(rc != 0 && strstr(err, message), "%s: generating stops with '%s': %s", what,
                  message, rc ? err : "it generated");
        else
            CHECK(rc == 0, "%s: generates: %s", what, err);
        if (want == RUNS) {
            int problems = 0;
            loom_verify(path, count_problem, &problems);
            CHECK(problems == 0, "%s: loom verify finds nothing wrong (%d problems)", what,
                  problems);
        }
    }
    printf("  %s: %s\n", what, err[0] ? err : "ok");
    loom_model_close(m);
    unlink(path);
}

static void test_gguf_files(void)
{
    static const gguf_edit none = {0};
    expect_gguf("the synthetic model as it is", &none, RUNS, NULL);
    const char *eps = "llama.attention.layer_norm_rms_epsilon", *base = "llama.rope.freq_base";
    const struct {
        const char *what;
        gguf_edit e;
        const char *message;
    } refused[] = {
        {"epsilon NaN", {.key = eps, .value = NAN}, "norm epsilon"},
        {"epsilon -1", {.key = eps, .value = -1}, "norm epsilon"},
        {"epsilon +Inf", {.key = eps, .value = INFINITY}, "norm epsilon"},
        {"RoPE base 0", {.key = base, .value = 0}, "RoPE base"},
        {"RoPE base NaN", {.key = base, .value = NAN}, "RoPE base"},
        {"RoPE base -5", {.key = base, .value = -5}, "RoPE base"},
        {"RoPE scaling factor -1",
         {.key = "llama.rope.scaling.factor", .value = -1},
         "RoPE scaling"},
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++)
        expect_gguf(refused[i].what, &refused[i].e, REFUSED_AT_OPEN, refused[i].message);
    /* shapes that disagree with the hyper-parameters, and logits that overflow: found by verify
     * (which once said "verified"), and a generation stops instead of printing garbage */
    const struct {
        const char *what;
        gguf_edit e;
    } broken[] = {
        {"an embedding of 256 rows for a 512-token vocabulary",
         {.tensor = "token_embd.weight", .keep = 256}},
        {"an output head of 256 rows for 512 tokens", {.tensor = "output.weight", .keep = 256}},
        {"a half-length output_norm", {.tensor = "output_norm.weight", .keep = 32}},
        {"an FFN narrower than feed_forward_length", {.tensor = "blk.1.ffn_up.weight", .keep = 96}},
        {"output_norm of 3e38 (logits overflow)", {.tensor = "output_norm.weight", .fill = 3e38f}},
    };
    for (size_t i = 0; i < sizeof broken / sizeof broken[0]; i++)
        expect_gguf(broken[i].what, &broken[i].e, VERIFY_FINDS, NULL);
    static const gguf_edit huge_norm = {.tensor = "output_norm.weight", .fill = 3e38f};
    expect_gguf("logits that overflow", &huge_norm, GENERATE_FAILS, "not finite");
}

/* ---- Mixture-of-experts files ---------------------------------------------------------------
 * tiny-qwen2moe with one expert count or width wrong, as a folder's config.json and as a
 * GGUF key: each refused, naming the key, before an expert id can index past the stack. */

static void test_moe_files(void)
{
    static const struct {
        const char *key, *value, *want;
    } configs[] = {
        {"num_experts_per_tok", "9", "num_experts_per_tok 9 exceeds num_experts 8"},
        {"num_experts", "0", "num_experts is 0"},
        {"num_experts", "9", "no tensor 'model.layers.0.mlp.experts.8.gate_proj.weight'"},
        {"num_experts", "4", "blk.0.ffn_gate_inp.weight is {12, 8, 1}"}, /* 8 router rows */
        {"decoder_sparse_step", "2", "decoder_sparse_step is not 1"},
        {"mlp_only_layers", "[1]", "mlp_only_layers is not empty"},
        {"moe_intermediate_size", "17", "blk.0.ffn_gate_exps.weight is {12, 16, 8}"},
    };
    for (size_t i = 0; i < sizeof configs / sizeof configs[0]; i++) {
        char name[64], what[256], p[4400], target[4400], abs[4096];
        snprintf(name, sizeof name, "moe-config-%zu", i);
        snprintf(what, sizeof what, "tiny-qwen2moe %s: %s", configs[i].key, configs[i].value);
        const char *f = clone_fixture("tiny-qwen2moe", name, NULL);
        /* the fixture's tokenizer files are tiny-qwen2's, by links a copy may have flattened */
        static const char *const shared[] = {"vocab.json", "merges.txt"};
        for (int j = 0; j < 2; j++) {
            snprintf(p, sizeof p, "%s/%s", f, shared[j]);
            snprintf(target, sizeof target, "%s/tiny-qwen2/%s", fixtures, shared[j]);
            unlink(p);
            CHECK(realpath(target, abs) && symlink(abs, p) == 0, "linking %s", p);
        }
        edit_json(f, "tiny-qwen2moe", "config.json", configs[i].key, configs[i].value);
        if (strncmp(configs[i].want, "blk.", 4)) {
            expect(what, f, WHOLE_MODEL, configs[i].want);
        } else { /* converts, as the config says; the model then refuses to open */
            char out[4400], err[2048] = "";
            snprintf(out, sizeof out, "%s/moe.gguf", tmp);
            CHECK(loom_convert(f, out, "f32", NULL, NULL, err, sizeof err) == 0, "%s: %s", what,
                  err);
            loom_model *m = loom_model_open(out, NULL, err, sizeof err);
            CHECK(!m && strstr(err, configs[i].want), "%s: refused at open: %s", what,
                  m ? "it opened" : err);
            printf("  %s: %s\n", what, err);
            loom_model_close(m);
            unlink(out);
        }
        remove_folder(f);
    }

    static const struct {
        const char *key;
        uint32_t value;
        const char *want;
    } keys[] = {
        {"qwen2moe.expert_used_count", 9, "expert_used_count"},
        {"qwen2moe.expert_used_count", 0, "missing expert hyper-parameters"},
        {"qwen2moe.expert_count", 100000, "blk.0.ffn_gate_inp.weight is {12, 8, 1}"},
        {"qwen2moe.expert_count", 4, "blk.0.ffn_gate_inp.weight is {12, 8, 1}"},
        {"qwen2moe.expert_feed_forward_length", 17, "blk.0.ffn_gate_exps.weight is {12, 16, 8}"},
        {"qwen2moe.expert_shared_feed_forward_length", 31, "blk.0.ffn_gate_shexp.weight"},
    };
    char src[4200], out[4400], err[2048];
    snprintf(src, sizeof src, "%s/tiny-qwen2moe/model.gguf", fixtures);
    snprintf(out, sizeof out, "%s/moe-edited.gguf", tmp);
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        loom_gguf g;
        CHECK(loom_gguf_open(&g, src, err, sizeof err) == 0, "%s: %s", src, err);
        loom_gguf_writer *w = loom_gguf_writer_create();
        for (uint64_t k = 0; k < g.n_kv; k++)
            if (strcmp(g.kv[k].key, keys[i].key))
                loom_gguf_copy_kv(w, &g, &g.kv[k]);
        loom_gguf_set_u32(w, keys[i].key, keys[i].value);
        for (uint64_t t = 0; t < g.n_tensors; t++)
            loom_gguf_add_tensor(w, g.tensors[t].name, g.tensors[t].type, g.tensors[t].n_dims,
                                 g.tensors[t].ne, loom_gguf_tensor_data(&g, &g.tensors[t]));
        CHECK(loom_gguf_write(w, out, err, sizeof err) == 0, "writing %s: %s", out, err);
        loom_gguf_writer_free(w);
        loom_gguf_close(&g);
        loom_model *m = loom_model_open(out, NULL, err, sizeof err);
        CHECK(!m && strstr(err, keys[i].want),
              "tiny-qwen2moe.gguf with %s = %u: refused, "
              "saying '%s': %s",
              keys[i].key, keys[i].value, keys[i].want, m ? "it opened" : err);
        printf("  tiny-qwen2moe.gguf %s = %u: %s\n", keys[i].key, keys[i].value, err);
        loom_model_close(m);
        unlink(out);
    }
}

static int note_id(void *user, int32_t id, const char *text, size_t len)
{
    (void)text, (void)len;
    int32_t *seen = user;
    seen[id >= 0 && id < 512 ? id : 0]++;
    return 0;
}

typedef struct engine_seen {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int tokens, placeholders, done;
} engine_seen;

static void on_engine_event(void *user, const loom_event *ev)
{
    engine_seen *s = user;
    pthread_mutex_lock(&s->mu);
    if (ev->kind == LOOM_EVENT_TEXT && ev->token >= 0) {
        s->tokens++;
        s->placeholders += ev->token >= 384;
    } else if (ev->kind != LOOM_EVENT_TEXT) {
        s->done = 1;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
}

/* Placeholder ids (a converter's [PADn], token type UNUSED) are never sampled: tiny-qwen2 at
 * temperature 2 once answered "[PAD151770]". Here the model's ids from 384 on are marked so
 * (the model gives them real mass); before, 1000 tokens at temperature 2 held dozens of them. */
/* Bytes a file controls reach terminals and logs printable: an ESC sequence in general.name
 * (loom serve logs it) or in the architecture (an error quotes it) becomes '?'. */
static int printable(const char *s)
{
    for (const unsigned char *p = (const unsigned char *)s; *p; p++)
        if (*p < 0x20 || *p == 0x7f || *p == 0xff)
            return 0;
    return 1;
}

static void test_escapes(void)
{
    char path[4200], err[2048] = "";
    snprintf(path, sizeof path, "%s/escapes.gguf", tmp);
    static const gguf_edit name = {.str_key = "general.name",
                                   .str_value = "\x1b[2J\x1b]0;owned\x07story\xff"};
    CHECK(write_edited(path, &name) == 0, "writing the file");
    loom_model_options mo = {.n_ctx = 64};
    loom_model *m = loom_model_open(path, &mo, err, sizeof err);
    CHECK(m && printable(loom_model_name(m)) && strstr(loom_model_name(m), "story"),
          "general.name with ESC sequences is printable: '%s'", m ? loom_model_name(m) : err);
    loom_model_close(m);
    static const gguf_edit arch = {.str_key = "general.architecture",
                                   .str_value = "ll\x1b[31mama\xfe"};
    CHECK(write_edited(path, &arch) == 0, "writing the file");
    m = loom_model_open(path, &mo, err, sizeof err);
    CHECK(!m && strstr(err, "ll?[31mama?") && printable(err),
          "an architecture with ESC and 0xfe is quoted printable: %s", err);
    loom_model_close(m);
    unlink(path);
}

/* A family whose forward pass stops early (as ChatGLM-6B's does when out of host memory) fails
 * the step in those words; the status was ignored and the step ended "the model produced no
 * logits". The family is llama's load with a forward that returns -1. */
static int stopping_forward(loom_runner *r, void *state, const loom_batch *b)
{
    (void)r, (void)state, (void)b;
    return -1;
}

static void test_forward_status(void)
{
    static loom_arch stopping;
    stopping = loom_arch_llama;
    stopping.name = "stopping";
    stopping.forward = stopping_forward;
    static const loom_family family = {.arch = &stopping};
    CHECK(loom_models_register(&family) == 0, "registering the test family");
    char path[4200], err[2048] = "";
    snprintf(path, sizeof path, "%s/stopping.gguf", tmp);
    static const gguf_edit e = {.str_key = "general.architecture", .str_value = "stopping"};
    CHECK(write_edited(path, &e) == 0, "writing the file");
    loom_model_options mo = {.n_ctx = 64};
    loom_model *m = loom_model_open(path, &mo, err, sizeof err);
    CHECK(m != NULL, "open: %s", err);
    int32_t prompt[2] = {1, 400};
    loom_sampling s = {.temperature = 0};
    int rc = m ? loom_generate(m, prompt, 2, 2, &s, NULL, NULL, NULL, err, sizeof err) : -1;
    CHECK(rc != 0 && strstr(err, "stopping: the forward pass stopped"),
          "a forward pass returning -1 fails the step in its words: %s", rc ? err : "it ran");
    loom_model_close(m);
    unlink(path);
}

static void test_placeholders_unsampled(void)
{
    char path[4200], err[2048] = "";
    snprintf(path, sizeof path, "%s/placeholders.gguf", tmp);
    static const gguf_edit e = {.unused_from = 384};
    CHECK(write_edited(path, &e) == 0, "writing the file");
    loom_model_options mo = {.n_ctx = 256};
    loom_model *m = loom_model_open(path, &mo, err, sizeof err);
    CHECK(m != NULL, "open: %s", err);
    static int32_t seen[512];
    for (int seed = 1; m && seed <= 5; seed++) {
        int32_t prompt[1] = {1};
        loom_sampling s = loom_sampling_defaults();
        s.temperature = 2, s.top_k = 0, s.top_p = 1, s.min_p = 0, s.seed = (uint64_t)seed;
        s.ignore_eos = 1;
        CHECK(loom_generate(m, prompt, 1, 200, &s, note_id, seen, NULL, err, sizeof err) == 0,
              "generate: %s", err);
    }
    int32_t normal = 0, placeholders = 0;
    for (int32_t id = 0; id < 512; id++)
        *(id < 384 ? &normal : &placeholders) += seen[id];
    CHECK(normal >= 900 && placeholders == 0,
          "1000 tokens at temperature 2: %d placeholder ids sampled (%d others)", placeholders,
          normal);
    /* the engine (loom serve's path) samples through the same mask */
    loom_engine_options eo = {0};
    loom_engine *engine = m ? loom_engine_start(m, &eo, err, sizeof err) : NULL;
    CHECK(engine != NULL, "engine: %s", err);
    engine_seen seen_e = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    int32_t prompt[1] = {1};
    loom_request rq = {.prompt = prompt, .n_prompt = 1, .max_tokens = 200};
    rq.sampling = loom_sampling_defaults();
    rq.sampling.temperature = 2, rq.sampling.top_k = 0, rq.sampling.top_p = 1;
    rq.sampling.min_p = 0, rq.sampling.seed = 9, rq.sampling.ignore_eos = 1;
    if (engine && loom_engine_submit(engine, &rq, on_engine_event, &seen_e, err, sizeof err) >= 0) {
        pthread_mutex_lock(&seen_e.mu);
        while (!seen_e.done)
            pthread_cond_wait(&seen_e.cv, &seen_e.mu);
        pthread_mutex_unlock(&seen_e.mu);
    }
    CHECK(seen_e.tokens >= 190 && seen_e.placeholders == 0,
          "the engine, 200 tokens at temperature 2: %d placeholder ids of %d", seen_e.placeholders,
          seen_e.tokens);
    if (engine) {
        loom_engine_stop(engine, 1000);
        loom_engine_free(engine);
    }
    loom_model_close(m);
    unlink(path);
}

int main(void)
{
    snprintf(fixtures, sizeof fixtures, "%s", fixtures_dir());
    unsetenv("LOOM_BACKEND");
    if (!mkdtemp(tmp))
        return 1;
    /* the GGUF files: edits of loom's synthetic model, which needs no fixture */
    char err[512];
    snprintf(edit_src, sizeof edit_src, "%s/synthetic-tiny.gguf", tmp);
    CHECK(loom_write_synthetic_model(edit_src, "tiny", "f32", err, sizeof err) == 0,
          "writing the synthetic tiny model: %s", err);
    test_gguf_files();
    test_placeholders_unsampled();
    test_escapes();
    test_forward_status();
    static const char *const stories[] = {"stories260K/original/stories260K.gguf"};
    if (have_fixtures(fixtures, stories, 1)) { /* a file llama.cpp wrote, as it is */
        snprintf(edit_src, sizeof edit_src, "%s/%s", fixtures, stories[0]);
        static const gguf_edit none = {0};
        expect_gguf("stories260K as it is", &none, RUNS, NULL);
    }
    /* the Hugging Face folders: the fixtures' with one thing wrong */
    static const char *const folders[] = {"tiny-qwen2/model.safetensors",
                                          "tiny-chatglm3/model.safetensors",
                                          "tiny-qwen2moe/model.gguf"};
    if (have_fixtures(fixtures, folders, 3)) {
        test_token_ids();
        test_config_values();
        test_fifos();
        test_moe_files();
    }
    snprintf(edit_src, sizeof edit_src, "%s/synthetic-tiny.gguf", tmp);
    unlink(edit_src);
    rmdir(tmp);
    return check_finish("test_hostile_files");
}
