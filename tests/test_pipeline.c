/*
 * tests/test_pipeline.c - a model cut into pipeline stages (core/runner.h: first_layer,
 * end_layer and a stage link) computes what the whole model computes. For every fixture family
 * (stories260K as llama.cpp wrote it; tiny-llama, tiny-qwen2 and tiny-chatglm3 converted to
 * f32), cut into two stages and into three (a two-layer model's third stage holds the head
 * alone), with neighbouring stages on different backends, the last stage's logits after the
 * fixture's prompt must match PyTorch's within the f32 tolerance of the other model tests, and
 * 16 greedy steps must give the fixture's tokens. The stages run one after the other in this
 * process, joined by in-memory queues; the MPI module joins them across processes the same way.
 * Each stage must also hold only its own weights (loom_runner_stage_holds). loom's synthetic
 * models (dense, MoE, latent attention), which need no fixture, are checked the same way
 * against themselves run whole on ref.
 */
#define _GNU_SOURCE
#include "check.h"
#include "core/gguf.h"
#include "backends.h"
#include "core/runner.h"
#include "models/models.h"

#include <loom/loom.h>

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_STAGES 3

/* One direction between two stages: what send appended, recv takes from the front. */
typedef struct queue {
    float *data;
    uint64_t len, head, cap;
} queue;

static int queue_send(void *ctx, const float *x, uint64_t count, char *err, size_t err_size)
{
    queue *q = ctx;
    if (q->len + count > q->cap) {
        uint64_t cap = (q->len + count) * 2;
        float *d = realloc(q->data, (size_t)cap * sizeof *d);
        if (!d) {
            snprintf(err, err_size, "out of memory");
            return -1;
        }
        q->data = d, q->cap = cap;
    }
    memcpy(q->data + q->len, x, (size_t)count * sizeof *x);
    q->len += count;
    return 0;
}

static int queue_recv(void *ctx, float *x, uint64_t count, char *err, size_t err_size)
{
    queue *q = ctx;
    if (q->len - q->head < count) {
        snprintf(err, err_size, "the previous stage sent %llu floats, not %llu",
                 (unsigned long long)(q->len - q->head), (unsigned long long)count);
        return -1;
    }
    memcpy(x, q->data + q->head, (size_t)count * sizeof *x);
    q->head += count;
    if (q->head == q->len)
        q->head = q->len = 0;
    return 0;
}

/* Stage s receives from queue s - 1 and sends to queue s. */
typedef struct duplex {
    queue *in, *out;
} duplex;

static int duplex_recv(void *ctx, float *x, uint64_t count, char *err, size_t err_size)
{
    return queue_recv(((duplex *)ctx)->in, x, count, err, err_size);
}

static int duplex_send(void *ctx, const float *x, uint64_t count, char *err, size_t err_size)
{
    return queue_send(((duplex *)ctx)->out, x, count, err, err_size);
}

typedef struct fixture_case {
    int32_t prompt[64], greedy[16];
    int n_prompt, n_greedy;
    float *logits; /* PyTorch's (or the whole model's on ref), after the prompt */
    int64_t n_vocab;
    const char *source; /* whose they are */
} fixture_case;

static int read_case(const char *fixture_dir, fixture_case *c)
{
    char path[4300];
    snprintf(path, sizeof path, "%s/expected.json", fixture_dir);
    char *text = slurp(path, NULL);
    cJSON *doc = text ? cJSON_Parse(text) : NULL;
    free(text);
    cJSON *cs = cJSON_GetArrayItem(cJSON_GetObjectItem(doc, "cases"), 0);
    cJSON *ids = cJSON_GetObjectItem(cs, "prompt_ids");
    cJSON *greedy = cJSON_GetObjectItem(cJSON_GetObjectItem(cs, "greedy"), "ids");
    cJSON *file = cJSON_GetObjectItem(cJSON_GetObjectItem(cs, "last_logits"), "file");
    int ok = cJSON_IsArray(ids) && cJSON_GetArraySize(ids) <= 64 && cJSON_IsArray(greedy) &&
        cJSON_IsString(file);
    if (ok) {
        c->source = "PyTorch's";
        c->n_prompt = cJSON_GetArraySize(ids);
        for (int i = 0; i < c->n_prompt; i++)
            c->prompt[i] = (int32_t)cJSON_GetArrayItem(ids, i)->valuedouble;
        c->n_greedy = cJSON_GetArraySize(greedy) < 16 ? cJSON_GetArraySize(greedy) : 16;
        for (int i = 0; i < c->n_greedy; i++)
            c->greedy[i] = (int32_t)cJSON_GetArrayItem(greedy, i)->valuedouble;
        size_t len = 0;
        snprintf(path, sizeof path, "%s/%s", fixture_dir, file->valuestring);
        c->logits = (float *)slurp(path, &len);
        c->n_vocab = (int64_t)(len / sizeof(float));
        ok = c->logits != NULL;
    }
    cJSON_Delete(doc);
    return ok ? 0 : -1;
}

/* general.architecture, NUL-terminated */
static const char *arch_of(const loom_gguf *g, char *buf, size_t size)
{
    const char *s;
    uint64_t len;
    buf[0] = 0;
    if (loom_gguf_get_str(g, "general.architecture", &s, &len) == 0 && len < size) {
        memcpy(buf, s, (size_t)len);
        buf[len] = 0;
    }
    return buf;
}

static int argmax(const float *x, int64_t n)
{
    int best = 0;
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[best])
            best = (int)i;
    return best;
}

/* Runs ids[0..n) at pos0 through every stage in order; the last one's logits are the result. */
static int run_stages(loom_runner **st, int n_st, const int32_t *ids, int32_t n, int32_t pos0,
                      char *err, size_t err_size)
{
    for (int s = 0; s < n_st; s++)
        if (loom_runner_eval(st[s], ids, n, pos0, err, err_size) != 0)
            return -1;
    return 0;
}

/* A runner for layers [first, end) of the model in g on the backend named, stage-linked by
 * link (NULL: the whole model alone); dev is opened for it. NULL, with err, when it fails. */
static loom_runner *open_stage(const loom_gguf *g, const char *backend, loom_stage_link *link,
                               int32_t first, int32_t end, loom_device *dev, int *dev_opened,
                               char *err, size_t err_size)
{
    char arch[64];
    loom_registry reg;
    loom_loader_options loader = loom_loader_options_from_env();
    *dev_opened = loom_registry_scan(&reg, &loader, err, err_size) == 0 &&
        loom_registry_select(&reg, backend, err, err_size) == 0 &&
        loom_device_open_chosen(dev, &reg, 0, err, err_size) == 0;
    loom_registry_free(&reg);
    if (!*dev_opened)
        return NULL;
    loom_runner_options ro = {
        .n_ctx = 64, .kv_type = LOOM_F32, .link = link, .first_layer = first, .end_layer = end};
    return loom_runner_create(dev, g, loom_models_find(arch_of(g, arch, sizeof arch)), &ro, err,
                              err_size);
}

/* The expectation for a model without a PyTorch reference (loom's synthetic ones): the whole
 * model on ref, the oracle: its logits after the prompt and 16 greedy tokens. */
static int whole_model_case(const char *gguf_path, const int32_t *prompt, int n, fixture_case *c)
{
    char err[512];
    loom_gguf g;
    if (loom_gguf_open(&g, gguf_path, err, sizeof err) != 0) {
        CHECK(0, "%s: %s", gguf_path, err);
        return -1;
    }
    loom_device dev;
    int opened = 0;
    loom_runner *r = open_stage(&g, "ref", NULL, 0, 0, &dev, &opened, err, sizeof err);
    int ok = r && run_stages(&r, 1, prompt, n, 0, err, sizeof err) == 0;
    if (ok) {
        c->n_vocab = loom_runner_hparams(r)->n_vocab;
        c->logits = malloc((size_t)c->n_vocab * sizeof *c->logits);
        ok = c->logits != NULL;
    }
    if (ok) {
        memcpy(c->logits, loom_runner_logits(r), (size_t)c->n_vocab * sizeof *c->logits);
        c->source = "the whole model's on ref";
        memcpy(c->prompt, prompt, (size_t)n * sizeof *prompt);
        c->n_prompt = n, c->n_greedy = 16;
        for (int k = 0; ok && k < c->n_greedy; k++) {
            c->greedy[k] = argmax(loom_runner_logits(r), c->n_vocab);
            ok = k + 1 == c->n_greedy ||
                run_stages(&r, 1, &c->greedy[k], 1, n + k, err, sizeof err) == 0;
        }
    }
    CHECK(ok, "%s, whole on ref: %s", gguf_path, err);
    loom_runner_free(r);
    if (opened)
        loom_device_close(&dev);
    loom_gguf_close(&g);
    return ok ? 0 : -1;
}

/* The model at gguf_path cut at the given layers ([cut[s], cut[s + 1]) for stage s), stage s
 * on backend labels[s % n_labels]. */
static void check_split(const char *label, const char *gguf_path, const fixture_case *c,
                        const int32_t *cut, int n_st, char labels[][160], int n_labels)
{
    char err[512], stages_text[256] = "";
    loom_gguf g;
    if (loom_gguf_open(&g, gguf_path, err, sizeof err) != 0) {
        CHECK(0, "%s: %s", label, err);
        return;
    }
    loom_device dev[MAX_STAGES];
    loom_runner *st[MAX_STAGES] = {0};
    queue q[MAX_STAGES] = {{0}};
    duplex dx[MAX_STAGES];
    loom_stage_link link[MAX_STAGES];
    int opened = 0, ok = 1;
    for (int s = 0; s < n_st && ok; s++) {
        const char *backend = labels[s % n_labels];
        dx[s] = (duplex){s > 0 ? &q[s - 1] : NULL, s + 1 < n_st ? &q[s] : NULL};
        link[s] = (loom_stage_link){.ctx = &dx[s],
                                    .recv = s > 0 ? duplex_recv : NULL,
                                    .send = s + 1 < n_st ? duplex_send : NULL};
        int dev_opened = 0;
        st[s] = open_stage(&g, backend, &link[s], cut[s], cut[s + 1], &dev[s], &dev_opened, err,
                           sizeof err);
        opened += dev_opened;
        ok = st[s] != NULL;
        size_t used = strlen(stages_text);
        snprintf(stages_text + used, sizeof stages_text - used, "%s[%d,%d) on %s", s ? ", " : "",
                 cut[s], cut[s + 1], backend);
    }
    CHECK(ok, "%s, stages %s: %s", label, stages_text, err);
    if (ok) {
        int64_t n_vocab = loom_runner_hparams(st[n_st - 1])->n_vocab;
        double worst = 0;
        ok = n_vocab == c->n_vocab &&
            run_stages(st, n_st, c->prompt, c->n_prompt, 0, err, sizeof err) == 0;
        CHECK(ok, "%s, stages %s: prompt: %s (vocabulary %lld, fixture %lld)", label, stages_text,
              err, (long long)n_vocab, (long long)c->n_vocab);
        for (int64_t i = 0; ok && i < n_vocab; i++) {
            double e = fabs((double)loom_runner_logits(st[n_st - 1])[i] - c->logits[i]);
            worst = e > worst ? e : worst;
        }
        CHECK(!ok || worst < 1e-3, "%s, stages %s: logits differ from %s by %g", label, c->source,
              stages_text, worst);
        int32_t tok[16];
        int n_tok = 0;
        for (int k = 0; ok && k < c->n_greedy; k++) {
            tok[n_tok++] = argmax(loom_runner_logits(st[n_st - 1]), n_vocab);
            if (k + 1 < c->n_greedy)
                ok = run_stages(st, n_st, &tok[k], 1, c->n_prompt + k, err, sizeof err) == 0;
        }
        CHECK(ok, "%s, stages %s: decoding: %s", label, stages_text, err);
        CHECK(!ok || memcmp(tok, c->greedy, (size_t)c->n_greedy * sizeof *tok) == 0,
              "%s, stages %s: greedy tokens differ from %s", label, stages_text, c->source);
        if (ok)
            printf("%s, stages %s: logits within %.2g of %s, %d greedy tokens as its\n", label,
                   stages_text, worst, c->source, c->n_greedy);
    }
    for (int s = 0; s < n_st; s++) {
        loom_runner_free(st[s]);
        free(q[s].data);
    }
    for (int s = 0; s < opened; s++)
        loom_device_close(&dev[s]);
    loom_gguf_close(&g);
}

/* Each stage's share of the tensors: every layer's in exactly one stage, the head in the last,
 * the embeddings in the first (and in the last when the head is tied to them). */
static void check_ownership(const char *label, const char *gguf_path, const int32_t *cut, int n_st)
{
    char err[512];
    loom_gguf g;
    if (loom_gguf_open(&g, gguf_path, err, sizeof err) != 0)
        return;
    int tied = !loom_gguf_find_tensor(&g, "output.weight"), bad = 0;
    for (uint64_t i = 0; i < g.n_tensors; i++) {
        const char *name = g.tensors[i].name;
        int holders = 0, in_first = 0, in_last = 0, layer;
        for (int s = 0; s < n_st; s++)
            if (loom_runner_stage_holds(&g, cut[s], cut[s + 1], s > 0, s + 1 < n_st, name)) {
                holders++;
                in_first |= s == 0, in_last |= s == n_st - 1;
            }
        if (sscanf(name, "blk.%d.", &layer) == 1)
            bad += holders != 1;
        else if (strcmp(name, "token_embd.weight") == 0)
            bad += !in_first || in_last != tied || holders != 1 + (tied && n_st > 1);
        else if (strncmp(name, "output", 6) == 0)
            bad += !in_last || holders != 1;
        if (bad == 1 && holders >= 0) {
            CHECK(0, "%s: tensor %s is held by %d of %d stages", label, name, holders, n_st);
            bad++;
        }
    }
    loom_gguf_close(&g);
}

/* The model cut in two and in three; c: what the cut model must compute (its logits are
 * freed). */
static void check_model(const char *label, const char *gguf_path, fixture_case *c,
                        char labels[][160], int n_labels)
{
    char err[512];
    loom_gguf g;
    int32_t n_layer = 0;
    if (loom_gguf_open(&g, gguf_path, err, sizeof err) == 0) {
        char arch[64];
        n_layer = (int32_t)loom_model_kv_int(&g, arch_of(&g, arch, sizeof arch), "block_count", 0);
        loom_gguf_close(&g);
    }
    CHECK(n_layer >= 2, "%s: %d layers (%s)", label, n_layer, err);
    if (n_layer >= 2) {
        int32_t two[3] = {0, n_layer / 2, n_layer};
        int32_t three[4] = {0, n_layer / 3 ? n_layer / 3 : 1, n_layer >= 3 ? 2 * n_layer / 3 : 2,
                            n_layer};
        check_ownership(label, gguf_path, two, 2);
        check_ownership(label, gguf_path, three, 3);
        check_split(label, gguf_path, c, two, 2, labels, n_labels);
        check_split(label, gguf_path, c, three, 3, labels, n_labels);
    }
    free(c->logits);
}

/* A fixture's case, or a failed check naming it. */
static int fixture_case_of(const char *fixture_dir, fixture_case *c)
{
    *c = (fixture_case){0};
    if (read_case(fixture_dir, c) == 0)
        return 0;
    CHECK(0, "cannot read the fixture in %s", fixture_dir);
    return -1;
}

int main(void)
{
    char dir[4096], tmp[] = "/tmp/loom-pipeline-XXXXXX", path[4300], gguf[4300], err[512];
    snprintf(dir, sizeof dir, "%s", fixtures_dir());
    if (!mkdtemp(tmp)) {
        CHECK(0, "mkdtemp: %s", strerror(errno));
        return check_finish("test_pipeline");
    }

    /* neighbouring stages on different backends: the best usable one next to ref */
    char usable[MAX_TEST_BACKENDS][160], labels[2][160];
    int n_usable = usable_backends(usable, MAX_TEST_BACKENDS), n_labels = 0;
    for (int i = 0; i < n_usable && n_labels < 1; i++)
        if (strcmp(usable[i], "ref") != 0)
            snprintf(labels[n_labels++], 160, "%.159s", usable[i]);
    snprintf(labels[n_labels++], 160, "ref");

    /* loom's synthetic models, which need no fixture: dense, mixture-of-experts and latent
     * attention, against themselves whole on ref */
    const char *synthetic[] = {"tiny", "moe-tiny", "mla-tiny"};
    const int32_t prompt[] = {1, 300, 301, 17, 42, 300, 400, 401, 255, 260, 261, 99};
    for (int i = 0; i < 3; i++) {
        fixture_case c = {0};
        snprintf(gguf, sizeof gguf, "%s/%s.gguf", tmp, synthetic[i]);
        CHECK(loom_write_synthetic_model(gguf, synthetic[i], "f32", err, sizeof err) == 0,
              "writing %s: %s", synthetic[i], err);
        if (whole_model_case(gguf, prompt, (int)(sizeof prompt / sizeof *prompt), &c) == 0)
            check_model(synthetic[i], gguf, &c, labels, n_labels);
        unlink(gguf);
    }

    static const char *const fixtures[] = {"stories260K/original/stories260K.gguf",
                                           "stories260K/expected.json", "tiny-llama/config.json",
                                           "tiny-qwen2/config.json", "tiny-chatglm3/config.json"};
    if (!have_fixtures(dir, fixtures, sizeof fixtures / sizeof *fixtures)) {
        rmdir(tmp);
        return check_finish("test_pipeline");
    }
    fixture_case c;
    snprintf(path, sizeof path, "%s/stories260K/original/stories260K.gguf", dir);
    snprintf(gguf, sizeof gguf, "%s/stories260K", dir);
    if (fixture_case_of(gguf, &c) == 0)
        check_model("stories260K", path, &c, labels, n_labels);
    const char *tiny[] = {"tiny-llama", "tiny-qwen2", "tiny-chatglm3"};
    for (int i = 0; i < 3; i++) {
        char hf[4200];
        snprintf(hf, sizeof hf, "%s/%s", dir, tiny[i]);
        snprintf(gguf, sizeof gguf, "%s/%s.gguf", tmp, tiny[i]);
        int ok = loom_convert(hf, gguf, "f32", NULL, NULL, err, sizeof err) == 0;
        CHECK(ok, "converting %s: %s", tiny[i], err);
        if (ok && fixture_case_of(hf, &c) == 0)
            check_model(tiny[i], gguf, &c, labels, n_labels);
        unlink(gguf);
    }
    rmdir(tmp);
    return check_finish("test_pipeline");
}
