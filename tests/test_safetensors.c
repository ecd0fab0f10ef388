/*
 * tests/test_safetensors.c - the safetensors reader on the fixtures (single files in f32, bf16
 * and f16), on a sharded folder made here, and on broken files.
 */
#define _GNU_SOURCE
#include "core/gguf.h"
#include "core/safetensors.h"

#include "check.h"

#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char err[1024];
static char dir[] = "/tmp/loom-st-XXXXXX";

/* Writes a safetensors file holding the given header JSON and data bytes. */
static void write_st(const char *name, const char *header, const void *data, size_t n)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    uint64_t len = strlen(header);
    fwrite(&len, 8, 1, f);
    fwrite(header, 1, len, f);
    fwrite(data, 1, n, f);
    fclose(f);
}

static void write_text(const char *name, const char *text)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    fputs(text, f);
    fclose(f);
}

static void test_fixtures(void)
{
    char path[4096], gpath[4096];
    snprintf(path, sizeof path, "%s/stories260K", fixtures_dir());
    snprintf(gpath, sizeof gpath, "%s/stories260K/original/stories260K.gguf", fixtures_dir());
    if (access(path, R_OK) != 0) {
        const char *ci = getenv("CI");
        CHECK(!(ci && strcmp(ci, "true") == 0), "fixtures missing under CI=true: %s", path);
        printf("SKIP fixture checks: %s not found\n", path);
        return;
    }
    loom_safetensors st;
    int rc = loom_safetensors_open(&st, path, err, sizeof err);
    CHECK(rc == 0, "stories260K folder: %s", err);
    if (rc == 0) {
        const loom_st_tensor *e = loom_safetensors_find(&st, "model.embed_tokens.weight");
        CHECK(e && e->loom_type == LOOM_F32 && e->n_dims == 2 && e->shape[0] == 512 &&
                  e->shape[1] == 64,
              "embedding [512, 64] f32");
        /* the same weights as the GGUF written by another tool: the bytes must agree */
        loom_gguf g;
        if (e && loom_gguf_open(&g, gpath, err, sizeof err) == 0) {
            const loom_gguf_tensor *t = loom_gguf_find_tensor(&g, "token_embd.weight");
            CHECK(t && t->size == e->size &&
                      memcmp(loom_gguf_tensor_data(&g, t), e->data, e->size) == 0,
                  "safetensors and GGUF embeddings agree");
            loom_gguf_close(&g);
        }
        loom_safetensors_close(&st);
    }
    static const struct {
        const char *folder, *tensor, *dtype;
    } typed[] = {
        {"tiny-llama", "lm_head.weight", "BF16"},
        {"tiny-qwen2", "model.embed_tokens.weight", "F16"},
        {"tiny-chatglm3", "transformer.embedding.word_embeddings.weight", "BF16"},
    };
    for (size_t i = 0; i < sizeof typed / sizeof typed[0]; i++) {
        if (snprintf(path, sizeof path, "%s/%s/model.safetensors", fixtures_dir(),
                     typed[i].folder) >= (int)sizeof path)
            continue;
        rc = loom_safetensors_open(&st, path, err, sizeof err);
        CHECK(rc == 0, "%s: %s", path, err);
        if (rc)
            continue;
        const loom_st_tensor *t = loom_safetensors_find(&st, typed[i].tensor);
        CHECK(t && strcmp(t->dtype, typed[i].dtype) == 0, "%s: %s is %s", typed[i].folder,
              typed[i].tensor, typed[i].dtype);
        loom_safetensors_close(&st);
    }
}

static void test_shards_and_errors(void)
{
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    float a[6] = {1, 2, 3, 4, 5, 6};
    uint16_t b[4] = {0x3c00, 0x4000, 0x4200, 0x4400};
    write_st("model-00001-of-00002.safetensors",
             "{\"__metadata__\":{\"format\":\"pt\"},\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],"
             "\"data_offsets\":[0,24]}}",
             a, sizeof a);
    write_st("model-00002-of-00002.safetensors",
             "{\"b\":{\"dtype\":\"F16\",\"shape\":[4],\"data_offsets\":[0,8]}}", b, sizeof b);
    write_text("model.safetensors.index.json",
               "{\"metadata\":{},\"weight_map\":{\"a\":\"model-00001-of-00002.safetensors\","
               "\"b\":\"model-00002-of-00002.safetensors\"}}");
    loom_safetensors st;
    int rc = loom_safetensors_open(&st, dir, err, sizeof err);
    CHECK(rc == 0, "sharded folder: %s", err);
    if (rc == 0) {
        const loom_st_tensor *ta = loom_safetensors_find(&st, "a"),
                             *tb = loom_safetensors_find(&st, "b");
        CHECK(st.n_files == 2 && ta && tb && ta->file != tb->file, "two shards");
        CHECK(ta && memcmp(ta->data, a, sizeof a) == 0 && ta->shape[0] == 2 && ta->shape[1] == 3,
              "shard data");
        CHECK(tb && tb->loom_type == LOOM_F16 && memcmp(tb->data, b, sizeof b) == 0, "f16 shard");
        loom_safetensors_close(&st);
    }

    struct {
        const char *header;
        size_t data;
        const char *want;
    } bad[] = {
        {"{\"x\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]}}", 20, "truncated"},
        {"{\"x\":{\"dtype\":\"F32\",\"shape\":[2,4],\"data_offsets\":[0,24]}}", 24, "need 32"},
        {"{\"x\":{\"dtype\":\"Q9\",\"shape\":[2],\"data_offsets\":[0,2]}}", 2, "unknown dtype"},
        {"{\"x\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8, "bad shape"},
        {"{\"x\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "lacks dtype"},
        /* 2^31 x 2^31 floats are 2^64 bytes, which wraps to 0 and would match [0, 0) */
        {"{\"x\":{\"dtype\":\"F32\",\"shape\":[2147483648,2147483648],\"data_offsets\":[0,0]}}", 0,
         "larger than any file"},
        {"{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
         8, "appears twice"},
        /* every tensor at offset 0: each would read the other's bytes */
        {"{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"y\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
         8, "share bytes"},
        {"[1,2,3]", 0, "not a JSON object"},
        {"{\"x\":", 0, "not a JSON object"},
    };
    char path[512];
    snprintf(path, sizeof path, "%s/bad.safetensors", dir);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_st("bad.safetensors", bad[i].header, a, bad[i].data);
        CHECK(loom_safetensors_open(&st, path, err, sizeof err) != 0 && strstr(err, bad[i].want),
              "case %zu: want '%s', got '%s'", i, bad[i].want, err);
    }
    /* a header length past the end of the file */
    FILE *f = fopen(path, "wb");
    uint64_t huge = 1ull << 50;
    fwrite(&huge, 8, 1, f);
    fwrite("{}", 1, 2, f);
    fclose(f);
    CHECK(loom_safetensors_open(&st, path, err, sizeof err) != 0 && strstr(err, "header length"),
          "absurd header length: %s", err);
    /* an index naming a shard that is not there */
    write_text(
        "model.safetensors.index.json",
        "{\"weight_map\":{\"a\":\"model-00001-of-00002.safetensors\",\"c\":\"gone.safetensors\"}}");
    CHECK(loom_safetensors_open(&st, dir, err, sizeof err) != 0 && strstr(err, "gone.safetensors"),
          "missing shard: %s", err);
    write_text("model.safetensors.index.json",
               "{\"weight_map\":{\"zz\":\"model-00001-of-00002.safetensors\"}}");
    CHECK(loom_safetensors_open(&st, dir, err, sizeof err) != 0 && strstr(err, "'zz'"),
          "index names an absent tensor: %s", err);
    /* a folder with no weights at all */
    char empty[600];
    snprintf(empty, sizeof empty, "%s/empty", dir);
    mkdir(empty, 0700);
    CHECK(loom_safetensors_open(&st, empty, err, sizeof err) != 0 &&
              strstr(err, "no model.safetensors"),
          "empty folder: %s", err);
    rmdir(empty);
    const char *names[] = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                           "model.safetensors.index.json", "bad.safetensors"};
    for (size_t i = 0; i < 4; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        unlink(path);
    }
    rmdir(dir);
}

int main(void)
{
    test_fixtures();
    test_shards_and_errors();
    return check_finish("test_safetensors");
}
