/*
 * tests/test_hostile_files.c - model folders an attacker wrote are refused with a message that
 * names what is wrong, never crash, hang or eat the machine. Each folder is a fixture's files
 * (linked) with one file rewritten; each conversion runs in a child with a deadline, so a
 * crash or a hang is a failure of that case and the rest still run.
 *
 * What each case guards (issue 46): a token id past the vocabulary (once a heap overflow), a
 * config value that is not a whole positive count (once SIGFPE), a vocabulary size that pads
 * without end, a FIFO where a file belongs (once a hang in open), ids from
 * generation_config.json outside the vocabulary.
 */
#define _GNU_SOURCE
#include <loom/loom.h>

#include "check.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <signal.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char fixtures[4096], tmp[] = "/tmp/loom-hostile-XXXXXX";

static void remove_folder(const char *folder)
{
    DIR *d = opendir(folder);
    struct dirent *e;
    char p[4400];
    while (d && (e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
            snprintf(p, sizeof p, "%s/%s", folder, e->d_name);
            unlink(p);
        }
    if (d)
        closedir(d);
    rmdir(folder);
}

/* tmp/name: links to every file of the fixture but `except` (a name, or NULL). */
static const char *clone(const char *fixture, const char *name, const char *except)
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
    const char *f = clone("tiny-qwen2", "qwen2-as-is", NULL);
    expect("the fixture itself", f, WHOLE_MODEL, NULL);
    remove_folder(f);

    /* an id that wrapped n_vocab = id + 1 to a negative size, then one written through it */
    f = clone("tiny-qwen2", "added-id-max", NULL);
    write_tokenizer_json(f,
                         "[{\"id\": 2147483647, \"content\": \"x\"}, {\"id\": 5, "
                         "\"content\": \"y\"}]");
    expect("tokenizer.json added id 2^31-1", f, TOKENIZER_ONLY, "2147483647");
    expect("the same, with the model", f, WHOLE_MODEL, "2147483647");
    remove_folder(f);

    f = clone("tiny-qwen2", "added-id-frac", NULL);
    write_tokenizer_json(f, "[{\"id\": 3.5, \"content\": \"x\"}]");
    expect("tokenizer.json added id 3.5", f, TOKENIZER_ONLY, "3.5");
    remove_folder(f);

    f = clone("tiny-qwen2", "added-id-past-rows", NULL);
    write_tokenizer_json(f, "[{\"id\": 151936, \"content\": \"x\"}]");
    expect("an added id just past the embedding's 151936 rows", f, WHOLE_MODEL, "151936");
    remove_folder(f);

    f = clone("tiny-qwen2", "decoder-key-max", NULL);
    edit_json(f, "tiny-qwen2", "tokenizer_config.json", "added_tokens_decoder",
              "{\"2147483647\": {\"content\": \"x\", \"special\": true}, \"5\": {\"content\": "
              "\"y\"}}");
    expect("added_tokens_decoder key 2^31-1", f, TOKENIZER_ONLY, "2147483647");
    remove_folder(f);

    f = clone("tiny-qwen2", "decoder-key-text", NULL);
    edit_json(f, "tiny-qwen2", "tokenizer_config.json", "added_tokens_decoder",
              "{\"seven\": {\"content\": \"x\"}}");
    expect("added_tokens_decoder key 'seven'", f, TOKENIZER_ONLY, "added_tokens_decoder");
    remove_folder(f);

    f = clone("tiny-qwen2", "vocab-huge", NULL);
    edit_json(f, "tiny-qwen2", "config.json", "vocab_size", "2147483647");
    expect("vocab_size 2^31-1 (padded without end, before)", f, TOKENIZER_ONLY, "vocab_size");
    expect("the same, with the model", f, WHOLE_MODEL, "vocab_size");
    remove_folder(f);

    f = clone("tiny-qwen2", "vocab-not-rows", NULL);
    edit_json(f, "tiny-qwen2", "config.json", "vocab_size", "151000");
    expect("vocab_size other than the embedding's rows", f, WHOLE_MODEL, "151936 rows");
    remove_folder(f);

    f = clone("tiny-qwen2", "eos-past", NULL);
    edit_json(f, "tiny-qwen2", "config.json", "eos_token_id", "99999999");
    expect("config.json eos_token_id past the vocabulary", f, WHOLE_MODEL, "eos_token_id");
    remove_folder(f);

    f = clone("tiny-qwen2", "stops-past", NULL);
    edit_json(f, "tiny-qwen2", "generation_config.json", "eos_token_id", "[151645, 4000000000]");
    expect("generation_config.json stop id past the vocabulary", f, WHOLE_MODEL, "4000000000");
    remove_folder(f);
}

static void test_config_values(void)
{
    static const struct {
        const char *key, *value, *want;
    } cases[] = {
        {"num_attention_heads", "0.5", "num_attention_heads is 0.5"}, /* once SIGFPE */
        {"num_attention_heads", "0", "num_attention_heads is 0"},
        {"num_attention_heads", "1e12", "num_attention_heads is 1000000000000"},
        {"num_attention_heads", "\"4\"", "num_attention_heads is \"4\""},
        {"hidden_size", "-32", "hidden_size is -32"},
        {"num_hidden_layers", "2.5", "num_hidden_layers is 2.5"},
        {"num_key_value_heads", "3", "not a multiple of num_key_value_heads 3"},
        {"num_key_value_heads", "0.25", "num_key_value_heads is 0.25"},
        {"head_dim", "4294967296", "head_dim is 4294967296"},
        {"rms_norm_eps", "-1", "rms_norm_eps is -1"},
        {"rope_theta", "0", "rope_theta is 0"},
        {"rope_scaling", "{\"type\": \"linear\", \"factor\": -2}", "rope_scaling.factor is -2"},
        {"max_position_embeddings", "0", "max_position_embeddings is 0"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char name[64], what[256];
        snprintf(name, sizeof name, "qwen2-config-%zu", i);
        snprintf(what, sizeof what, "qwen2 %s: %s", cases[i].key, cases[i].value);
        const char *f = clone("tiny-qwen2", name, NULL);
        edit_json(f, "tiny-qwen2", "config.json", cases[i].key, cases[i].value);
        expect(what, f, WHOLE_MODEL, cases[i].want);
        remove_folder(f);
    }
    /* the ChatGLM hooks' own keys */
    static const struct {
        const char *key, *value, *want;
    } glm[] = {
        {"num_attention_heads", "0.5", "num_attention_heads is 0.5"},
        {"multi_query_group_num", "0", "multi_query_group_num is 0"},
        {"kv_channels", "1e300", "kv_channels is 1e+300"},
        {"rope_ratio", "-1", "rope_ratio is -1"},
        {"padded_vocab_size", "2147483647", "padded_vocab_size is 2147483647"},
    };
    for (size_t i = 0; i < sizeof glm / sizeof glm[0]; i++) {
        char name[64], what[256];
        snprintf(name, sizeof name, "glm-config-%zu", i);
        snprintf(what, sizeof what, "chatglm3 %s: %s", glm[i].key, glm[i].value);
        const char *f = clone("tiny-chatglm3", name, NULL);
        edit_json(f, "tiny-chatglm3", "config.json", glm[i].key, glm[i].value);
        expect(what, f, WHOLE_MODEL, glm[i].want);
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
        const char *f = clone(cases[i].fixture, name, cases[i].file);
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

int main(void)
{
    snprintf(fixtures, sizeof fixtures, "%s", fixtures_dir());
    char probe[4200];
    snprintf(probe, sizeof probe, "%s/tiny-qwen2/model.safetensors", fixtures);
    need_fixture(probe);
    snprintf(probe, sizeof probe, "%s/tiny-chatglm3/model.safetensors", fixtures);
    need_fixture(probe);
    unsetenv("LOOM_BACKEND");
    if (!mkdtemp(tmp))
        return 1;
    test_token_ids();
    test_config_values();
    test_fifos();
    rmdir(tmp);
    return check_finish("test_hostile_files");
}
