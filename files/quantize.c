/*
 * files/quantize.c - loom_quantize: a GGUF file's float matrices requantised to a type or a
 * llama.cpp-style mix (files/quant_mix.c chooses each tensor's type), rows quantised on every
 * core, metadata copied, general.file_type set to the mix's number as llama.cpp numbers it.
 */
#define _GNU_SOURCE
#include "api/internal.h"

#include "core/gguf.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct quant_job {
    const unsigned char *src;
    unsigned char *dst;
    loom_dtype from, to;
    int64_t rows, cols, src_row, dst_row;
    int n_threads, index;
    int failed;
} quant_job;

static void *quantise_rows(void *arg)
{
    quant_job *j = arg;
    int64_t r0 = j->rows * j->index / j->n_threads, r1 = j->rows * (j->index + 1) / j->n_threads;
    float *row = malloc((size_t)j->cols * sizeof *row);
    if (!row) {
        j->failed = 1;
        return NULL;
    }
    for (int64_t r = r0; r < r1; r++) {
        loom_row_to_f32(j->from, j->src + r * j->src_row, row, j->cols);
        loom_row_from_f32(j->to, row, j->dst + r * j->dst_row, j->cols);
    }
    free(row);
    return NULL;
}

/* Quantises a whole tensor on up to n threads; 0, or -1 without memory. */
static int quantise_tensor(quant_job base, int n)
{
    quant_job jobs[64];
    pthread_t th[64];
    int created[64] = {0}, failed = 0;
    n = n < 1 ? 1 : n > 64 ? 64 : n;
    if (base.rows < n)
        n = (int)(base.rows > 0 ? base.rows : 1);
    for (int i = 0; i < n; i++) {
        jobs[i] = base;
        jobs[i].n_threads = n, jobs[i].index = i;
    }
    for (int i = 1; i < n; i++)
        created[i] = pthread_create(&th[i], NULL, quantise_rows, &jobs[i]) == 0;
    quantise_rows(&jobs[0]);
    for (int i = 1; i < n; i++) {
        if (created[i])
            pthread_join(th[i], NULL);
        else
            quantise_rows(&jobs[i]); /* no thread for it: its rows here */
    }
    for (int i = 0; i < n; i++)
        failed |= jobs[i].failed;
    return failed ? -1 : 0;
}

static int64_t gguf_int(const loom_gguf *g, const char *arch, const char *suffix, int64_t fallback)
{
    char key[160];
    int64_t v;
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    return loom_gguf_get_i64(g, key, &v) == 0 ? v : fallback;
}

int loom_quantize(const char *in, const char *out, const char *type,
                  loom_convert_progress_fn progress, void *user, char *err, size_t err_size)
{
    return loom_quantize_opts(in, out, type, 0, progress, user, err, err_size);
}

int loom_quantize_opts(const char *in, const char *out, const char *type, int flags,
                       loom_convert_progress_fn progress, void *user, char *err, size_t err_size)
{
    int mix = type ? loom_quant_mix_find(type) : -1;
    if (mix < 0) {
        snprintf(err, err_size, "type '%s' is not one loom writes; use one of %s",
                 type ? type : "(none)", loom_quant_mix_names());
        return -1;
    }
    loom_gguf g;
    if (loom_gguf_open(&g, in, err, err_size) != 0)
        return -1;
    char arch[64] = "llama";
    const char *s;
    uint64_t len;
    if (loom_gguf_get_str(&g, "general.architecture", &s, &len) == 0 && len < sizeof arch)
        memcpy(arch, s, len), arch[len] = '\0';
    int n_layer = (int)gguf_int(&g, arch, "block_count", 0);
    int64_t heads = gguf_int(&g, arch, "attention.head_count", 1);
    int64_t kv_heads = gguf_int(&g, arch, "attention.head_count_kv", heads);
    int n_gqa = kv_heads > 0 ? (int)(heads / kv_heads) : 1;
    int n_expert = (int)gguf_int(&g, arch, "expert_count", 0);
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);

    loom_gguf_writer *w = loom_gguf_writer_create();
    void **owned = calloc(g.n_tensors + 1, sizeof *owned);
    int counts[32] = {0}, kept_quantised = 0;
    int rc = w && owned ? 0 : -1;
    if (rc)
        snprintf(err, err_size, "out of memory");
    for (uint64_t i = 0; rc == 0 && i < g.n_kv; i++) {
        const char *key = g.kv[i].key;
        if (!strcmp(key, "general.alignment") || !strcmp(key, "general.file_type") ||
            !strcmp(key, "general.quantization_version"))
            continue; /* written below for the new file */
        if (loom_gguf_copy_kv(w, &g, &g.kv[i]))
            rc = -1, snprintf(err, err_size, "out of memory copying metadata");
    }
    if (rc == 0 &&
        (loom_gguf_set_u32(w, "general.file_type", (uint32_t)loom_quant_mix_file_type(mix)) ||
         loom_gguf_set_u32(w, "general.quantization_version", 2)))
        rc = -1, snprintf(err, err_size, "out of memory");
    for (uint64_t i = 0; rc == 0 && i < g.n_tensors; i++) {
        const loom_gguf_tensor *t = &g.tensors[i];
        const void *src = loom_gguf_tensor_data(&g, t);
        loom_dtype from = (loom_dtype)t->type, to = from;
        int is_float = from == LOOM_F32 || from == LOOM_F16 || from == LOOM_BF16;
        int64_t rows = t->ne[1] * t->ne[2] * t->ne[3], cols = t->ne[0];
        if (t->n_dims >= 2 && is_float && !loom_quant_mix_keeps(t->name))
            to = loom_quant_mix_type(mix, t->name, cols, n_layer, n_gqa, n_expert,
                                     (flags & LOOM_QUANTIZE_PURE) != 0);
        else if (t->n_dims >= 2 && !is_float)
            kept_quantised++;
        const void *data = src;
        if (to != from) {
            int64_t rb = loom_row_bytes(to, cols);
            unsigned char *dst = rb > 0 ? malloc((size_t)(rb * rows)) : NULL;
            quant_job job = {src, dst, from, to, rows, cols, loom_row_bytes(from, cols),
                             rb,  1,   0,    0};
            if (!dst || quantise_tensor(job, (int)(cpus > 0 ? cpus : 1)) != 0) {
                free(dst);
                rc = -1;
                snprintf(err, err_size, "out of memory quantising %s", t->name);
                break;
            }
            owned[i] = dst;
            data = dst;
        }
        counts[to & 31]++;
        if (loom_gguf_add_tensor(w, t->name, to, t->n_dims, t->ne, data) != 0) {
            rc = -1;
            snprintf(err, err_size, "cannot add %s", t->name);
        }
        if (progress) {
            char what[300];
            snprintf(what, sizeof what, "%s -> %s", t->name, loom_ggml_type_name(to));
            progress(user, (int)i + 1, (int)g.n_tensors, what);
        }
    }
    if (rc == 0)
        rc = loom_gguf_write(w, out, err, err_size);
    if (rc == 0) { /* what the mix chose, as llama.cpp's quantizer reports it */
        fprintf(stderr, "%s: %s%s:", out, type, flags & LOOM_QUANTIZE_PURE ? " (pure)" : "");
        for (int t = 0; t < 32; t++)
            if (counts[t])
                fprintf(stderr, " %d %s", counts[t], loom_ggml_type_name((uint32_t)t));
        fprintf(stderr, " tensors\n");
        if (kept_quantised)
            fprintf(stderr,
                    "note: %d matrices were quantised already and are copied as they are "
                    "(loom does not requantise)\n",
                    kept_quantised);
    }
    for (uint64_t i = 0; owned && i < g.n_tensors; i++)
        free(owned[i]);
    free(owned);
    loom_gguf_writer_free(w);
    loom_gguf_close(&g);
    return rc;
}
