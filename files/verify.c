/*
 * files/verify.c - `loom verify`: is this model file whole? For files damaged on the way (a disk
 * that filled up during conversion, a download cut short, a flipped bit), which load and then
 * answer strangely. Loading keeps to the cheap checks (the GGUF reader's bounds, the family's
 * shapes for layer 0); this reads every byte:
 *   file        the GGUF structure: every count, offset and tensor inside the file
 *   checksum    the per-tensor XXH3-64 that loom stores when it writes a file
 *   values      no NaN or Inf in any weight (after dequantisation: a block's scale counts)
 *   shapes      every layer's tensors shaped as layer 0's, the layer count as the metadata says
 *   model       the family's own load: hyper-parameters against the tensors
 *   tokenizer   its size and special ids against the model's vocabulary
 *   forward     two tokens through the whole model: every tensor's shape against the
 *               hyper-parameters (what the family's load checks lazily), finite logits (a NaN
 *               epsilon or a zero RoPE base loads and answers garbage)
 * Each check reports once, with the first problem's location and how many more there are.
 */
#define _GNU_SOURCE
#include "api/internal.h"

#include "core/gguf.h"
#include "core/tokenizer.h"
#include "models/models.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct verifier {
    loom_verify_fn report;
    void *user;
    int problems;
} verifier;

static void say(verifier *v, const char *check, loom_check_status st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void say(verifier *v, const char *check, loom_check_status st, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    loom_text_printable(msg); /* it may quote the file's strings */
    v->problems += st == LOOM_CHECK_PROBLEM;
    v->report(v->user, check, st, msg);
}

static void check_checksums(verifier *v, const loom_gguf *g)
{
    uint64_t first = 0;
    int64_t bad = loom_gguf_check_checksums(g, &first);
    if (bad == -2) {
        say(v, "checksum", LOOM_CHECK_SKIPPED,
            "none stored (files loom convert and loom quantize "
            "write carry one per tensor; this one was written elsewhere)");
    } else if (bad < 0) {
        say(v, "checksum", LOOM_CHECK_PROBLEM, "%s is not %llu %s sums: the metadata is damaged",
            LOOM_GGUF_CHECKSUM_KEY, (unsigned long long)g->n_tensors, LOOM_GGUF_CHECKSUM_ALGORITHM);
    } else if (bad == 0) {
        say(v, "checksum", LOOM_CHECK_OK, "all %llu tensors match their %s sums",
            (unsigned long long)g->n_tensors, LOOM_GGUF_CHECKSUM_ALGORITHM);
    } else {
        const loom_gguf_tensor *t = &g->tensors[first];
        char more[64] = "";
        if (bad > 1)
            snprintf(more, sizeof more, ", and %lld more tensor%s", (long long)(bad - 1),
                     bad == 2 ? "" : "s");
        say(v, "checksum", LOOM_CHECK_PROBLEM,
            "tensor '%s' (file bytes %llu..%llu)%s differs from the checksum stored when the "
            "file was written: the file was damaged since; convert or download it again",
            t->name, (unsigned long long)t->offset, (unsigned long long)(t->offset + t->size - 1),
            more);
    }
}

static void check_values(verifier *v, const loom_gguf *g)
{
    enum { CHUNK = 1 << 16 }; /* elements converted at once: a multiple of every block size */
    float *buf = malloc(CHUNK * sizeof *buf);
    if (!buf) {
        say(v, "values", LOOM_CHECK_PROBLEM, "out of memory");
        return;
    }
    uint64_t bad = 0, checked = 0, elems_checked = 0;
    char first[512] = "";
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const loom_gguf_tensor *t = &g->tensors[i];
        loom_dtype dt = (loom_dtype)t->type;
        int64_t be = loom_dtype_block_elems(dt), bb = loom_dtype_block_bytes(dt);
        if (!be || dt == LOOM_I32)
            continue; /* integers, or a type loom does not read (the model check says so) */
        int64_t n = t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3], at = -1;
        const unsigned char *data = g->map + t->offset;
        for (int64_t e = 0; e < n && at < 0; e += CHUNK) {
            int64_t k = n - e < CHUNK ? n - e : CHUNK;
            loom_row_to_f32(dt, data + e / be * bb, buf, k);
            for (int64_t j = 0; j < k; j++)
                if (!isfinite(buf[j])) {
                    at = e + j;
                    break;
                }
        }
        checked++, elems_checked += (uint64_t)n;
        if (at >= 0 && !bad++) {
            int64_t b = at / be;
            snprintf(first, sizeof first,
                     "tensor '%s' holds %s at element %lld (row %lld, column "
                     "%lld; file bytes %llu..%llu hold its block)",
                     t->name, isnan(buf[at % CHUNK]) ? "NaN" : "Inf", (long long)at,
                     (long long)(at / t->ne[0]), (long long)(at % t->ne[0]),
                     (unsigned long long)(t->offset + (uint64_t)(b * bb)),
                     (unsigned long long)(t->offset + (uint64_t)((b + 1) * bb) - 1));
        }
    }
    free(buf);
    if (bad)
        say(v, "values", LOOM_CHECK_PROBLEM, "%s%s", first,
            bad > 1 ? " (and more tensors after it)" : "");
    else
        say(v, "values", LOOM_CHECK_OK, "%llu weights in %llu tensors, every one finite",
            (unsigned long long)elems_checked, (unsigned long long)checked);
}

/* "blk.N.rest" -> N and rest; -1 for other names */
static long layer_of(const char *name, const char **rest)
{
    if (strncmp(name, "blk.", 4) != 0)
        return -1;
    char *end;
    long l = strtol(name + 4, &end, 10);
    if (end == name + 4 || *end != '.')
        return -1;
    *rest = end + 1;
    return l;
}

static void check_shapes(verifier *v, const loom_gguf *g, const char *arch)
{
    char key[128];
    int64_t n_layer = -1;
    snprintf(key, sizeof key, "%s.block_count", arch);
    loom_gguf_get_i64(g, key, &n_layer);
    long max_layer = -1;
    uint64_t per_layer0 = 0;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const char *rest;
        long l = layer_of(g->tensors[i].name, &rest);
        max_layer = l > max_layer ? l : max_layer;
        per_layer0 += l == 0;
    }
    if (n_layer >= 0 && max_layer + 1 != n_layer) {
        say(v, "shapes", LOOM_CHECK_PROBLEM,
            "%s says %lld layers, the tensors hold %ld (blk.0 .. "
            "blk.%ld)",
            key, (long long)n_layer, max_layer + 1, max_layer);
        return;
    }
    /* Layers come in kinds: a hybrid model's linear-attention and full-attention layers (every
     * full_attention_interval-th), a mixture of experts' leading dense layers
     * (leading_dense_block_count: GLM-4.5, DeepSeek, GLM-4.7-Flash) and the rest, and the
     * multi-token-prediction blocks after the trunk (nextn_predict_layers). Every layer has
     * the tensors of the first layer of its kind, shaped alike (the type may differ: mixes give
     * some layers more bits). */
    int64_t interval = 0, nextn = 0, dense = 0;
    snprintf(key, sizeof key, "%s.leading_dense_block_count", arch);
    loom_gguf_get_i64(g, key, &dense);
    snprintf(key, sizeof key, "%s.full_attention_interval", arch);
    loom_gguf_get_i64(g, key, &interval);
    snprintf(key, sizeof key, "%s.nextn_predict_layers", arch);
    loom_gguf_get_i64(g, key, &nextn);
    const long trunk = nextn > 0 && nextn <= max_layer + 1 ? max_layer + 1 - (long)nextn : -1;
#define FIRST_OF_KIND(l)                                                                           \
    (trunk >= 0 && (l) >= trunk                      ? trunk                                       \
         : interval > 1 && ((l) + 1) % interval == 0 ? (long)interval - 1                          \
         : dense > 0 && (l) >= dense                 ? (long)dense                                 \
                                                     : 0L)
    static long counts[4096];
    memset(counts, 0, sizeof counts);
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const loom_gguf_tensor *t = &g->tensors[i];
        const char *rest;
        long l = layer_of(t->name, &rest);
        if (l < 0)
            continue;
        if (l < 4096)
            counts[l]++;
        long first = FIRST_OF_KIND(l);
        char name0[256];
        snprintf(name0, sizeof name0, "blk.%ld.%s", first, rest);
        const loom_gguf_tensor *t0 = loom_gguf_find_tensor(g, name0);
        if (!t0) {
            say(v, "shapes", LOOM_CHECK_PROBLEM,
                "tensor '%s' has no counterpart in layer %ld, the first of its kind (%s)", t->name,
                first, name0);
            return;
        }
        if (memcmp(t->ne, t0->ne, sizeof t->ne) != 0) {
            say(v, "shapes", LOOM_CHECK_PROBLEM,
                "tensor '%s' is %lld x %lld x %lld where layer "
                "%ld's is %lld x %lld x %lld",
                t->name, (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2], first,
                (long long)t0->ne[0], (long long)t0->ne[1], (long long)t0->ne[2]);
            return;
        }
    }
    for (long l = 0; l <= max_layer && l < 4096; l++)
        if (counts[l] != counts[FIRST_OF_KIND(l)]) {
            say(v, "shapes", LOOM_CHECK_PROBLEM, "layer %ld has %ld tensors, layer %ld has %ld", l,
                counts[l], FIRST_OF_KIND(l), counts[FIRST_OF_KIND(l)]);
            return;
        }
#undef FIRST_OF_KIND
    if (interval > 1)
        say(v, "shapes", LOOM_CHECK_OK,
            "%ld layers, each shaped as the first of its kind (full attention every %lld%s)",
            max_layer + 1, (long long)interval, trunk >= 0 ? ", then the prediction head" : "");
    else if (dense > 0 || trunk >= 0)
        say(v, "shapes", LOOM_CHECK_OK,
            "%ld layers, each shaped as the first of its kind (%lld dense, then experts%s)",
            max_layer + 1, (long long)dense, trunk >= 0 ? ", then the prediction head" : "");
    else
        say(v, "shapes", LOOM_CHECK_OK, "%ld layers of %llu tensors each, shaped alike",
            max_layer + 1, (unsigned long long)per_layer0);
}

/* A special id the tokenizer names must be one of its tokens. */
static int special_id_ok(verifier *v, const loom_gguf *g, const char *key, int64_t n_tokens)
{
    int64_t id;
    if (loom_gguf_get_i64(g, key, &id) != 0 || id == -1 || id == 0xffffffffLL)
        return 1; /* absent, or "none" as some writers say it */
    if (id >= 0 && id < n_tokens)
        return 1;
    say(v, "tokenizer", LOOM_CHECK_PROBLEM, "%s is %lld, but the vocabulary has %lld tokens", key,
        (long long)id, (long long)n_tokens);
    return 0;
}

static void check_tokenizer(verifier *v, const loom_gguf *g, int32_t n_vocab)
{
    const loom_gguf_kv *tokens = loom_gguf_find(g, "tokenizer.ggml.tokens");
    if (!tokens) {
        say(v, "tokenizer", LOOM_CHECK_PROBLEM,
            "no tokenizer.ggml.tokens: the file has no "
            "vocabulary");
        return;
    }
    int64_t n = (int64_t)tokens->count;
    if (n > n_vocab) {
        say(v, "tokenizer", LOOM_CHECK_PROBLEM,
            "the tokenizer has %lld tokens, the model's "
            "output only %d rows: ids %d..%lld have no logits",
            (long long)n, n_vocab, n_vocab, (long long)(n - 1));
        return;
    }
    static const char *const keys[] = {"tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                                       "tokenizer.ggml.unknown_token_id",
                                       "tokenizer.ggml.padding_token_id",
                                       "tokenizer.ggml.eot_token_id"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (!special_id_ok(v, g, keys[i], n))
            return;
    static const char *const arrays[] = {"tokenizer.loom.stop_token_ids",
                                         "tokenizer.loom.prefix_tokens"};
    for (size_t a = 0; a < 2; a++) {
        const loom_gguf_kv *kv = loom_gguf_find(g, arrays[a]);
        for (uint64_t i = 0; kv && i < kv->count; i++) {
            double id;
            if (loom_gguf_array_f64(g, kv, i, &id) != 0 || id < 0 || id >= (double)n) {
                say(v, "tokenizer", LOOM_CHECK_PROBLEM, "%s[%llu] is not one of the %lld tokens",
                    arrays[a], (unsigned long long)i, (long long)n);
                return;
            }
        }
    }
    if (n < n_vocab)
        say(v, "tokenizer", LOOM_CHECK_OK,
            "%lld tokens and special ids within them; the output's "
            "%d rows include %lld of padding",
            (long long)n, n_vocab, (long long)(n_vocab - n));
    else
        say(v, "tokenizer", LOOM_CHECK_OK,
            "%lld tokens, as many as the output's rows, and special "
            "ids within them",
            (long long)n);
}

static void check_forward(verifier *v, loom_model *m)
{
    int32_t n_vocab = loom_model_n_vocab(m), ids[2] = {0, n_vocab > 1 ? 1 : 0};
    float *logits = malloc(2 * (size_t)n_vocab * sizeof *logits);
    char err[1024] = "out of memory";
    if (logits && loom_eval_logits(m, ids, 2, logits, err, sizeof err) == 0)
        say(v, "forward", LOOM_CHECK_OK,
            "two tokens run through every layer on %s; the logits are finite",
            loom_model_backend(m));
    else
        say(v, "forward", LOOM_CHECK_PROBLEM, "%s", err);
    free(logits);
}

int loom_verify(const char *path, loom_verify_fn report, void *user)
{
    verifier v = {report, user, 0};
    loom_gguf g;
    char err[1024];
    if (loom_open_model_file(path, &g, NULL, NULL, err, sizeof err) != 0) {
        say(&v, "file", LOOM_CHECK_PROBLEM, "%s", err);
        return v.problems;
    }
    uint64_t bytes = 0;
    for (uint64_t i = 0; i < g.n_tensors; i++)
        bytes += g.tensors[i].size;
    say(&v, "file", LOOM_CHECK_OK,
        "GGUF v%u, %llu metadata keys, %llu tensors (%llu bytes), all "
        "inside the file's %llu bytes",
        g.version, (unsigned long long)g.n_kv, (unsigned long long)g.n_tensors,
        (unsigned long long)bytes, (unsigned long long)g.size);
    if (loom_is_model_dir(path)) /* the GGUF was written just now, from the folder */
        say(&v, "checksum", LOOM_CHECK_SKIPPED,
            "a Hugging Face folder: its safetensors files "
            "carry no checksums; every value is checked below");
    else
        check_checksums(&v, &g);
    check_values(&v, &g);
    const char *a;
    uint64_t alen;
    char arch[64] = "";
    if (loom_gguf_get_str(&g, "general.architecture", &a, &alen) == 0)
        snprintf(arch, sizeof arch, "%.*s", (int)(alen < 63 ? alen : 63), a);
    check_shapes(&v, &g, arch);
    /* the family's own load: hyper-parameters against the tensors (a tiny context: only the
     * weights matter) */
    loom_model_options mo = {.n_ctx = 16};
    loom_model *m = loom_model_open(path, &mo, err, sizeof err);
    if (!m) {
        say(&v, "model", LOOM_CHECK_PROBLEM, "%s", err);
    } else {
        say(&v, "model", LOOM_CHECK_OK, "%s loads as '%s': %d-token vocabulary", path, arch,
            loom_model_n_vocab(m));
        check_tokenizer(&v, &g, loom_model_n_vocab(m));
        check_forward(&v, m);
        loom_model_close(m);
    }
    loom_gguf_close(&g);
    return v.problems;
}
