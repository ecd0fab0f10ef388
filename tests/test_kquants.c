/*
 * tests/test_kquants.c - community GGUF files: the kquants fixture's 16 files, written by
 * llama.cpp's own quantizer in its default mixes (q6_K output beside q4_0 layers, q3_K/q4_K/
 * q5_K mixes, IQ4), on every usable backend.
 *
 * Two independent expectations:
 *   - the fixture's dequant_ref_logits: a float64 forward over the file's weights dequantised
 *     by gguf-py (llama.cpp's Python package). Per case, max |loom - ref| <= 0.04 max |ref|, and
 *     the same top-1 token wherever the reference's top-1 leads the second by >= 0.15 (the
 *     fixture README's bounds: llama.cpp itself lands 1-2.3% away, as it quantises activations);
 *   - base-f32.gguf, the weights before quantisation: every tensor of every file, decoded with
 *     the header's reference dequantisers, lies within a relative RMS error typical of its type
 *     of the original. A wrong bit layout gives errors near 1 (or far above), not a few percent.
 * And round trips: `loom_quantize` of base-f32 to each type chooses every tensor's type as
 * llama.cpp's file of that type has it, stays within the same per-type error bounds (so its
 * quantisers are as good as llama.cpp's), and its file runs on every backend with logits close
 * to those of the same file decoded to f32 (with the header's dequantisers) run on ref.
 * Mixture-of-experts tensors have no llama.cpp-quantised fixture; their q4_k_m types are checked
 * against the rules of llama.cpp c392e50's llama_tensor_get_type, written out below.
 */
#define _GNU_SOURCE
#include "core/gguf.h"

#include <loom/loom.h>

#include "backends.h"
#include "check.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <string.h>
#include <unistd.h>

static char err[4096];
static char dir[4096];

static float *read_floats(const char *name, size_t n)
{
    char path[8300];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    size_t len = 0;
    float *v = (float *)slurp(path, &len);
    if (v && len != n * sizeof(float)) {
        free(v);
        return NULL;
    }
    return v;
}

/* The largest relative RMS error a correct decoding of each type shows against the original
 * weights, with a third to spare: on this fixture the worst tensors measure q8_0 0.0054,
 * q6_K 0.0179, q5_0 0.0429, q5_1 0.0380, q5_K 0.0363, q4_0 0.0864, q4_1 0.0785, q4_K 0.0717,
 * iq4_nl 0.0764, iq4_xs 0.0770, q3_K 0.152, q2_K 0.297. A wrong layout lands near 1 or far
 * above: a Q4_K min whose top bits come from the wrong byte gives 0.36. */
static double rms_bound(loom_dtype t)
{
    switch (t) {
    case LOOM_Q8_0: return 0.0075;
    case LOOM_Q6_K: return 0.024;
    case LOOM_Q5_0:
    case LOOM_Q5_1:
    case LOOM_Q5_K: return 0.057;
    case LOOM_Q4_0:
    case LOOM_Q4_1:
    case LOOM_Q4_K:
    case LOOM_IQ4_NL:
    case LOOM_IQ4_XS: return 0.115;
    case LOOM_Q3_K: return 0.2;
    case LOOM_Q2_K: return 0.4;
    default: return 1e-6; /* f32 kept as it was */
    }
}

/* Every tensor of the file against base-f32's, decoded with loom_row_to_f32. */
static void check_weights(const loom_gguf *base, const char *path, const char *type)
{
    const char *file = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    loom_gguf g;
    if (loom_gguf_open(&g, path, err, sizeof err) != 0) {
        CHECK(0, "open %s: %s", file, err);
        return;
    }
    int checked = 0;
    for (uint64_t i = 0; i < g.n_tensors; i++) {
        const loom_gguf_tensor *t = &g.tensors[i];
        const loom_gguf_tensor *o = loom_gguf_find_tensor(base, t->name);
        loom_dtype dt = (loom_dtype)t->type;
        int64_t n = t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
        if (!o || o->type != LOOM_F32 || loom_dtype_block_elems(dt) == 0) {
            CHECK(0, "%s: tensor %s (type %u) has no f32 original or an unknown type", file,
                  t->name, t->type);
            continue;
        }
        float *dec = malloc((size_t)n * sizeof *dec);
        int64_t rows = n / t->ne[0], rb = loom_row_bytes(dt, t->ne[0]);
        const unsigned char *src = loom_gguf_tensor_data(&g, t);
        for (int64_t r = 0; r < rows; r++)
            loom_row_to_f32(dt, src + r * rb, dec + r * t->ne[0], t->ne[0]);
        const float *ref = loom_gguf_tensor_data(base, o);
        double se = 0, ss = 0;
        for (int64_t k = 0; k < n; k++) {
            se += ((double)dec[k] - ref[k]) * ((double)dec[k] - ref[k]);
            ss += (double)ref[k] * ref[k];
        }
        double rel = sqrt(se / (ss > 0 ? ss : 1));
        CHECK(rel <= rms_bound(dt),
              "%s: %s (%s) decodes %.4f (relative RMS) from the original, "
              "over %.3f for its type",
              type, t->name, loom_dtype_name(dt), rel, rms_bound(dt));
        free(dec);
        checked++;
    }
    CHECK(checked > 0, "%s: no tensors", file);
    loom_gguf_close(&g);
}

/* Last-position logits of one prompt (n_vocab floats, malloc'd), or NULL with err. */
static float *logits_of(const char *path, const char *backend, const int32_t *prompt, int n,
                        int32_t *nv)
{
    setenv("LOOM_BACKEND", backend, 1);
    loom_model_options o = {.n_ctx = 128};
    loom_model *m = loom_model_open(path, &o, err, sizeof err);
    if (!m)
        return NULL;
    *nv = loom_model_n_vocab(m);
    loom_sampling greedy = loom_sampling_defaults();
    greedy.temperature = 0;
    float *out = NULL;
    if (loom_generate(m, prompt, n, 1, &greedy, NULL, NULL, NULL, err, sizeof err) == 0 &&
        (out = malloc((size_t)*nv * sizeof *out)))
        memcpy(out, loom_prompt_logits(m), (size_t)*nv * sizeof *out);
    loom_model_close(m);
    return out;
}

/* max |got - want| <= 0.04 max |want|, and the same top-1 where want's leads by >= 0.15 */
static void compare_logits(const float *got, const float *want, int32_t nv, const char *what)
{
    double amax = 0, worst = 0;
    int top = 0, top_got = 0, second = -1;
    for (int32_t i = 0; i < nv; i++) {
        amax = fabs(want[i]) > amax ? fabs(want[i]) : amax;
        worst = fabs(got[i] - want[i]) > worst ? fabs(got[i] - want[i]) : worst;
        top = want[i] > want[top] ? i : top;
        top_got = got[i] > got[top_got] ? i : top_got;
    }
    for (int32_t i = 0; i < nv; i++)
        if (i != top && (second < 0 || want[i] > want[second]))
            second = i;
    CHECK(worst <= 0.04 * amax, "%s: logits %.4f from the reference (bound %.4f)", what, worst,
          0.04 * amax);
    CHECK(want[top] - want[second] < 0.15 || top_got == top,
          "%s: top token %d, the reference's %d (margin %.3f)", what, top_got, top,
          want[top] - want[second]);
}

/* Last-position logits of every case, on one backend, against the dequantised reference. */
static void check_logits(const char *backend, const char *type, const cJSON *entry)
{
    char path[8300];
    snprintf(path, sizeof path, "%s/%s", dir, cJSON_GetObjectItem(entry, "file")->valuestring);
    setenv("LOOM_BACKEND", backend, 1);
    loom_model_options o = {.n_ctx = 128};
    loom_model *m = loom_model_open(path, &o, err, sizeof err);
    if (!m) {
        CHECK(0, "%s on %s: %s", type, backend, err);
        return;
    }
    int32_t nv = loom_model_n_vocab(m);
    const cJSON *c;
    cJSON_ArrayForEach (c, cJSON_GetObjectItem(entry, "cases")) {
        const cJSON *ids = cJSON_GetObjectItem(c, "prompt_ids");
        int32_t prompt[64], n = 0;
        const cJSON *x;
        cJSON_ArrayForEach (x, ids)
            prompt[n++] = x->valueint;
        float *want = read_floats(cJSON_GetObjectItem(c, "dequant_ref_logits")->valuestring,
                                  (size_t)nv);
        loom_sampling greedy = loom_sampling_defaults();
        greedy.temperature = 0;
        if (!want || loom_generate(m, prompt, n, 1, &greedy, NULL, NULL, NULL, err, sizeof err)) {
            CHECK(0, "%s on %s, case %s: %s", type, backend,
                  cJSON_GetObjectItem(c, "name")->valuestring, want ? err : "reference missing");
            free(want);
            continue;
        }
        char what[256]; /* a label, cut short if the names are long */
        if (snprintf(what, sizeof what, "%s on %s, case %s", type, backend,
                     cJSON_GetObjectItem(c, "name")->valuestring) < 0)
            what[0] = '\0';
        compare_logits(loom_prompt_logits(m), want, nv, what);
        free(want);
    }
    loom_model_close(m);
}

static int by_string(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The per-tensor types of a file, "name type;..." sorted by name (malloc'd). */
static char *type_list(const char *path)
{
    loom_gguf g;
    if (loom_gguf_open(&g, path, err, sizeof err) != 0)
        return NULL;
    char **items = calloc(g.n_tensors + 1, sizeof *items);
    size_t cap = 1, used = 0;
    for (uint64_t i = 0; i < g.n_tensors; i++) {
        if (asprintf(&items[i], "%s %s;", g.tensors[i].name,
                     loom_ggml_type_name(g.tensors[i].type)) < 0)
            items[i] = NULL;
        cap += items[i] ? strlen(items[i]) : 0;
    }
    qsort(items, g.n_tensors, sizeof *items, by_string);
    char *out = malloc(cap);
    for (uint64_t i = 0; out && i < g.n_tensors; i++)
        used += (size_t)snprintf(out + used, cap - used, "%s", items[i] ? items[i] : "");
    for (uint64_t i = 0; i < g.n_tensors; i++)
        free(items[i]);
    free(items);
    loom_gguf_close(&g);
    return out;
}

/* base-f32 quantised by loom to `type`: the mix llama.cpp chose, errors within bounds, and
 * the file's logits against its own weights decoded to f32 and run on ref. */
static void check_round_trip(const loom_gguf *base, const char *type, const cJSON *entry,
                             char backends[][160], int n_backends)
{
    char src[8300], ours[] = "/tmp/loom-kq-XXXXXX", plain[] = "/tmp/loom-kq-f32-XXXXXX";
    close(mkstemp(ours));
    close(mkstemp(plain));
    snprintf(src, sizeof src, "%s/%s", dir, cJSON_GetObjectItem(entry, "file")->valuestring);
    char *bpath = NULL;
    if (asprintf(&bpath, "%s/base-f32.gguf", dir) < 0 ||
        loom_quantize(bpath, ours, type, NULL, NULL, err, sizeof err) != 0) {
        CHECK(0, "loom quantize to %s: %s", type, err);
        free(bpath);
        unlink(ours), unlink(plain);
        return;
    }
    char *want = type_list(src), *got = type_list(ours);
    CHECK(want && got && !strcmp(want, got),
          "loom's %s mix differs from llama.cpp's:\n  loom  %s"
          "\n  llama %s",
          type, got ? got : "?", want ? want : "?");
    free(want), free(got);
    check_weights(base, ours, type);
    /* the expected forward: loom's file decoded to f32 by the header's dequantisers */
    loom_gguf q;
    if (loom_gguf_open(&q, ours, err, sizeof err) == 0) {
        loom_gguf_writer *w = loom_gguf_writer_create();
        float **rows = calloc(q.n_tensors + 1, sizeof *rows);
        for (uint64_t i = 0; i < q.n_kv; i++)
            if (strcmp(q.kv[i].key, "general.alignment"))
                loom_gguf_copy_kv(w, &q, &q.kv[i]);
        for (uint64_t i = 0; i < q.n_tensors; i++) {
            const loom_gguf_tensor *t = &q.tensors[i];
            int64_t n = t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3],
                    rb = loom_row_bytes(t->type, t->ne[0]);
            rows[i] = malloc((size_t)n * sizeof(float));
            const unsigned char *p = loom_gguf_tensor_data(&q, t);
            for (int64_t r = 0; r < n / t->ne[0]; r++)
                loom_row_to_f32((loom_dtype)t->type, p + r * rb, rows[i] + r * t->ne[0], t->ne[0]);
            loom_gguf_add_tensor(w, t->name, LOOM_F32, t->n_dims, t->ne, rows[i]);
        }
        CHECK(loom_gguf_write(w, plain, err, sizeof err) == 0, "write %s: %s", plain, err);
        for (uint64_t i = 0; i < q.n_tensors; i++)
            free(rows[i]);
        free(rows);
        loom_gguf_writer_free(w);
        loom_gguf_close(&q);
    }
    const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(entry, "cases"), 2); /* "long" */
    int32_t prompt[64], n = 0, nv = 0;
    const cJSON *x;
    cJSON_ArrayForEach (x, cJSON_GetObjectItem(c, "prompt_ids"))
        prompt[n++] = x->valueint;
    float *ref = logits_of(plain, "ref", prompt, n, &nv);
    CHECK(ref != NULL, "%s round trip: the decoded file on ref: %s", type, err);
    for (int b = 0; ref && b < n_backends; b++) {
        float *out = logits_of(ours, backends[b], prompt, n, &nv);
        char what[256]; /* a label, cut short if the names are long */
        if (snprintf(what, sizeof what, "loom's %s file on %s", type, backends[b]) < 0)
            what[0] = '\0';
        CHECK(out != NULL, "%s: %s", what, err);
        if (out)
            compare_logits(out, ref, nv, what);
        free(out);
    }
    free(ref);
    free(bpath);
    unlink(ours), unlink(plain);
}

/* The type of tensor `name` in a GGUF file, or -1. */
static int type_in(const loom_gguf *g, const char *name)
{
    const loom_gguf_tensor *t = loom_gguf_find_tensor(g, name);
    return t ? (int)t->type : -1;
}

/* An 8-layer qwen2moe-named file of f16 weights with `experts` experts quantised to q4_k_m, its
 * tensors' types against llama.cpp's rules: ffn_down's (q6_K in the "more bits" layers 0, 3, 6
 * and 7 of 8) for every tensor named ffn_down*, the experts' and the shared expert's too; the
 * router kept as it is; and with exactly 8 experts, attn_v and attn_k q8_0 and attn_output
 * q5_K (else attn_v follows the more-bits layers, attn_k and attn_output the base q4_K). */
static void check_moe_mix(int experts)
{
    const int L = 8, d = 256;
    char in[256], out[256];
    snprintf(in, sizeof in, "/tmp/loom-kq-moe-%d-%d.gguf", (int)getpid(), experts);
    snprintf(out, sizeof out, "/tmp/loom-kq-moe-%d-%d-q4_k_m.gguf", (int)getpid(), experts);
    loom_gguf_writer *w = loom_gguf_writer_create();
    uint16_t *h = calloc((size_t)d * d * (size_t)experts, sizeof *h);
    float *router = calloc((size_t)d * (size_t)experts, sizeof *router);
    for (size_t i = 0; h && i < (size_t)d * d * (size_t)experts; i++)
        h[i] = (uint16_t)(0x3000 + (i * 2654435761u >> 20) % 0x800); /* f16 in [0.125, 0.25) */
    loom_gguf_set_str(w, "general.architecture", "qwen2moe");
    loom_gguf_set_u32(w, "qwen2moe.block_count", (uint32_t)L);
    loom_gguf_set_u32(w, "qwen2moe.attention.head_count", 4);
    loom_gguf_set_u32(w, "qwen2moe.attention.head_count_kv", 4);
    loom_gguf_set_u32(w, "qwen2moe.expert_count", (uint32_t)experts);
    int bad = 0;
    for (int l = 0; l < L; l++) {
        char name[96];
        static const char *const square[] = {"attn_q",        "attn_k",         "attn_v",
                                             "attn_output",   "ffn_gate_shexp", "ffn_up_shexp",
                                             "ffn_down_shexp"};
        for (size_t i = 0; i < sizeof square / sizeof square[0]; i++) {
            int64_t ne[2] = {d, d};
            snprintf(name, sizeof name, "blk.%d.%s.weight", l, square[i]);
            bad |= loom_gguf_add_tensor(w, name, LOOM_F16, 2, ne, h);
        }
        static const char *const stacks[] = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};
        for (size_t i = 0; i < 3; i++) {
            int64_t ne[3] = {d, d, experts};
            snprintf(name, sizeof name, "blk.%d.%s.weight", l, stacks[i]);
            bad |= loom_gguf_add_tensor(w, name, LOOM_F16, 3, ne, h);
        }
        int64_t ne_r[2] = {d, experts};
        snprintf(name, sizeof name, "blk.%d.ffn_gate_inp.weight", l);
        bad |= loom_gguf_add_tensor(w, name, LOOM_F32, 2, ne_r, router);
    }
    CHECK(!bad && h && router && loom_gguf_write(w, in, err, sizeof err) == 0,
          "writing the MoE file: %s", err);
    loom_gguf_writer_free(w);
    free(h), free(router);
    CHECK(loom_quantize(in, out, "q4_k_m", NULL, NULL, err, sizeof err) == 0, "q4_k_m: %s", err);
    loom_gguf g;
    if (loom_gguf_open(&g, out, err, sizeof err) != 0) {
        CHECK(0, "open the quantised MoE file: %s", err);
        unlink(in);
        return;
    }
    for (int l = 0; l < L; l++) {
        int more = l < L / 8 || l >= 7 * L / 8 || (l - L / 8) % 3 == 2;
        int down = more ? LOOM_Q6_K : LOOM_Q4_K;
        struct {
            const char *tensor;
            int want;
        } rules[] = {{"attn_q", LOOM_Q4_K},
                     {"attn_k", experts == 8 ? LOOM_Q8_0 : LOOM_Q4_K},
                     {"attn_v", experts == 8 ? LOOM_Q8_0 : down},
                     {"attn_output", experts == 8 ? LOOM_Q5_K : LOOM_Q4_K},
                     {"ffn_gate_exps", LOOM_Q4_K},
                     {"ffn_up_exps", LOOM_Q4_K},
                     {"ffn_down_exps", down},
                     {"ffn_gate_shexp", LOOM_Q4_K},
                     {"ffn_down_shexp", down},
                     {"ffn_gate_inp", LOOM_F32}};
        for (size_t i = 0; i < sizeof rules / sizeof rules[0]; i++) {
            char name[96];
            snprintf(name, sizeof name, "blk.%d.%s.weight", l, rules[i].tensor);
            int got = type_in(&g, name);
            CHECK(got == rules[i].want, "%d experts, q4_k_m: %s is %s, llama.cpp's rule says %s",
                  experts, name, got >= 0 ? loom_dtype_name((loom_dtype)got) : "missing",
                  loom_dtype_name((loom_dtype)rules[i].want));
        }
    }
    loom_gguf_close(&g);
    unlink(in);
    unlink(out);
}

int main(void)
{
    if (snprintf(dir, sizeof dir, "%s/kquants/kq-llama", fixtures_dir()) >= (int)sizeof dir) {
        fprintf(stderr, "test_kquants: the fixtures path is too long: %s\n", fixtures_dir());
        return 1;
    }
    char epath[8300], bpath[8300];
    snprintf(epath, sizeof epath, "%s/expected.json", dir);
    snprintf(bpath, sizeof bpath, "%s/base-f32.gguf", dir);
    check_moe_mix(8);
    check_moe_mix(4);
    if (access(epath, R_OK) != 0) {
        const char *ci = getenv("CI");
        CHECK(!(ci && !strcmp(ci, "true")), "fixture missing under CI=true: %s", epath);
        printf("SKIP: %s not found\n", epath);
        return check_failures ? 1 : 77;
    }
    char *json = slurp(epath, NULL);
    cJSON *root = cJSON_Parse(json);
    loom_gguf base;
    CHECK(root && loom_gguf_open(&base, bpath, err, sizeof err) == 0, "open the fixture: %s", err);
    if (!root)
        return check_finish("test_kquants");
    char backends[MAX_TEST_BACKENDS][160];
    int n_backends = usable_backends(backends, MAX_TEST_BACKENDS);
    const cJSON *f;
    int files = 0;
    cJSON_ArrayForEach (f, cJSON_GetObjectItem(root, "files")) {
        char path[8300];
        snprintf(path, sizeof path, "%s/%s", dir, cJSON_GetObjectItem(f, "file")->valuestring);
        if (strcmp(f->string, "f32") != 0) {
            check_weights(&base, path, f->string);
            check_round_trip(&base, f->string, f, backends, n_backends);
        }
        for (int b = 0; b < n_backends; b++)
            check_logits(backends[b], f->string, f);
        files++;
    }
    printf("%d files on %d backends\n", files, n_backends);
    CHECK(files == 17, "the fixture lists 17 files, read %d", files);
    loom_gguf_close(&base);
    cJSON_Delete(root);
    free(json);
    return check_finish("test_kquants");
}
