/*
 * api/synthetic.c - deterministic synthetic Llama-shaped models, written as GGUF files, so that
 * `loom bench` (the README's main job) needs no download. Every layer shares one set of
 * random matrices in memory, but each is written at its own place in the file, so reading the
 * model streams the full size from memory as a real one does.
 */
#define _GNU_SOURCE
#include <loom/loom.h>

#include "internal.h"
#include "core/gguf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

typedef struct shape {
    const char *name, *about;
    int32_t n_embd, n_layer, n_head, n_head_kv, n_ff, n_vocab, n_ctx;
} shape;

static const shape shapes[] = {
    {"tiny", "2 layers, 64 wide, GQA 2/1, head_dim 32: a q8_0 KV cache fits (tests)", 64, 2, 2, 1,
     192, 512, 512},
    {"160m", "12 layers, 768 wide (GPT-2-small sized)", 768, 12, 12, 12, 3072, 32000, 2048},
    {"1b", "TinyLlama-1.1B: 22 layers, 2048 wide, GQA 32/4", 2048, 22, 32, 4, 5632, 32000, 2048},
    {"8b", "Llama-3-8B: 32 layers, 4096 wide, GQA 32/8", 4096, 32, 32, 8, 14336, 128256, 8192},
};

const char *loom_synthetic_shapes(void)
{
    return "tiny, 160m, 1b, 8b";
}

static uint64_t rng_state = 0x853c49e6748fea9bull;

static float rnd(float amp)
{
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return amp * ((float)(rng_state >> 40) / 8388608.0f - 1.0f);
}

/* rows x cols random values in [-amp, amp), stored as dtype t */
static void *random_matrix(loom_dtype t, int64_t rows, int64_t cols, float amp)
{
    int64_t rb = loom_row_bytes(t, cols);
    unsigned char *out = malloc((size_t)(rb * rows));
    float *row = malloc((size_t)cols * sizeof *row);
    if (!out || !row) {
        free(out), free(row);
        return NULL;
    }
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < cols; c++)
            row[c] = rnd(amp);
        loom_row_from_f32(t, row, out + r * rb, cols);
    }
    free(row);
    return out;
}

static const loom_dtype synthetic_types[] = {LOOM_WEIGHT_DTYPES(LOOM_DTYPE_ITEM)};

const char *loom_synthetic_types(void)
{
    return "f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 iq4_nl q2_K q3_K q4_K q5_K q6_K iq4_xs";
}

/* a type name as loom_dtype_name spells it, or lower case (q4_k) */
static int synthetic_type(const char *name, loom_dtype *t)
{
    for (size_t i = 0; i < sizeof synthetic_types / sizeof synthetic_types[0]; i++)
        if (strcasecmp(name, loom_dtype_name(synthetic_types[i])) == 0) {
            *t = synthetic_types[i];
            return 0;
        }
    return -1;
}

int loom_write_synthetic_model(const char *path, const char *shape_name, const char *type_name,
                               char *err, size_t err_size)
{
    const shape *sh = NULL;
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        if (strcmp(shapes[i].name, shape_name) == 0)
            sh = &shapes[i];
    loom_dtype wt;
    if (!sh) {
        snprintf(err, err_size, "no synthetic shape '%s' (there are: %s)", shape_name,
                 loom_synthetic_shapes());
        return -1;
    }
    if (synthetic_type(type_name, &wt)) {
        snprintf(err, err_size, "weight type '%s' is not one of %s", type_name,
                 loom_synthetic_types());
        return -1;
    }
    if (sh->n_embd % loom_dtype_block_elems(wt) || sh->n_ff % loom_dtype_block_elems(wt)) {
        snprintf(err, err_size,
                 "the %s shape's rows (%d and %d wide) are not whole %s blocks of "
                 "%lld: choose a wider shape",
                 sh->name, sh->n_embd, sh->n_ff, type_name, (long long)loom_dtype_block_elems(wt));
        return -1;
    }
    const int32_t hd = sh->n_embd / sh->n_head, kv = sh->n_head_kv * hd;
    rng_state = 0x853c49e6748fea9bull; /* the same model every time */
    /* one random matrix per distinct shape; every layer points at them */
    float amp = 0.5f / (float)sh->n_embd; /* keeps activations tame through the layers */
    void *embd = random_matrix(wt, sh->n_vocab, sh->n_embd, 1.0f);
    void *wq = random_matrix(wt, sh->n_embd, sh->n_embd, amp * 16);
    void *wk = random_matrix(wt, kv, sh->n_embd, amp * 16);
    void *wv = random_matrix(wt, kv, sh->n_embd, amp * 16);
    void *wo = random_matrix(wt, sh->n_embd, sh->n_embd, amp * 16);
    void *gate = random_matrix(wt, sh->n_ff, sh->n_embd, amp * 16);
    void *up = random_matrix(wt, sh->n_ff, sh->n_embd, amp * 16);
    void *down = random_matrix(wt, sh->n_embd, sh->n_ff, amp * 16);
    void *out = random_matrix(wt, sh->n_vocab, sh->n_embd, amp * 16);
    float *norm = malloc((size_t)sh->n_embd * sizeof *norm);
    char **tokens = calloc((size_t)sh->n_vocab, sizeof *tokens);
    float *scores = calloc((size_t)sh->n_vocab, sizeof *scores);
    int32_t *types = calloc((size_t)sh->n_vocab, sizeof *types);
    loom_gguf_writer *w = loom_gguf_writer_create();
    int rc = -1;
    if (!embd || !wq || !wk || !wv || !wo || !gate || !up || !down || !out || !norm || !tokens ||
        !scores || !types || !w) {
        snprintf(err, err_size, "out of memory building the synthetic model");
        goto done;
    }
    for (int32_t i = 0; i < sh->n_embd; i++)
        norm[i] = 1.0f;
    /* a vocabulary that round-trips text: specials, the 256 bytes, then plain pieces */
    for (int32_t i = 0; i < sh->n_vocab; i++) {
        char buf[32];
        int type = 1;
        if (i < 3) {
            snprintf(buf, sizeof buf, "%s", i == 0 ? "<unk>" : i == 1 ? "<s>" : "</s>");
            type = i == 0 ? 2 : 3;
        } else if (i < 3 + 256) {
            snprintf(buf, sizeof buf, "<0x%02X>", i - 3);
            type = 6;
        } else {
            snprintf(buf, sizeof buf, "\xe2\x96\x81w%d", i);
            scores[i] = -(float)i;
        }
        tokens[i] = strdup(buf);
        types[i] = type;
        if (!tokens[i]) {
            snprintf(err, err_size, "out of memory");
            goto done;
        }
    }
    char name[64];
    snprintf(name, sizeof name, "synthetic-%s-%s", sh->name, type_name);
    loom_gguf_set_str(w, "general.architecture", "llama");
    loom_gguf_set_str(w, "general.name", name);
    loom_gguf_set_u32(w, "llama.context_length", (uint32_t)sh->n_ctx);
    loom_gguf_set_u32(w, "llama.embedding_length", (uint32_t)sh->n_embd);
    loom_gguf_set_u32(w, "llama.block_count", (uint32_t)sh->n_layer);
    loom_gguf_set_u32(w, "llama.feed_forward_length", (uint32_t)sh->n_ff);
    loom_gguf_set_u32(w, "llama.attention.head_count", (uint32_t)sh->n_head);
    loom_gguf_set_u32(w, "llama.attention.head_count_kv", (uint32_t)sh->n_head_kv);
    loom_gguf_set_u32(w, "llama.rope.dimension_count", (uint32_t)hd);
    loom_gguf_set_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    loom_gguf_set_str(w, "tokenizer.ggml.model", "llama");
    loom_gguf_set_str_array(w, "tokenizer.ggml.tokens", (const char *const *)tokens,
                            (uint64_t)sh->n_vocab);
    loom_gguf_set_f32_array(w, "tokenizer.ggml.scores", scores, (uint64_t)sh->n_vocab);
    loom_gguf_set_i32_array(w, "tokenizer.ggml.token_type", types, (uint64_t)sh->n_vocab);
    loom_gguf_set_u32(w, "tokenizer.ggml.bos_token_id", 1);
    loom_gguf_set_u32(w, "tokenizer.ggml.eos_token_id", 2);
    int64_t ne_embd[] = {sh->n_embd, sh->n_vocab}, ne_norm[] = {sh->n_embd};
    int64_t ne_q[] = {sh->n_embd, sh->n_embd}, ne_kv[] = {sh->n_embd, kv};
    int64_t ne_ff[] = {sh->n_embd, sh->n_ff}, ne_down[] = {sh->n_ff, sh->n_embd};
    int bad = loom_gguf_add_tensor(w, "token_embd.weight", wt, 2, ne_embd, embd);
    bad |= loom_gguf_add_tensor(w, "output_norm.weight", LOOM_F32, 1, ne_norm, norm);
    bad |= loom_gguf_add_tensor(w, "output.weight", wt, 2, ne_embd, out);
    for (int l = 0; l < sh->n_layer; l++) {
        char t[64];
#define ADD(suffix, type, nd, ne, data)                                                            \
    (snprintf(t, sizeof t, "blk.%d.%s", l, suffix),                                                \
     bad |= loom_gguf_add_tensor(w, t, type, nd, ne, data))
        ADD("attn_norm.weight", LOOM_F32, 1, ne_norm, norm);
        ADD("attn_q.weight", wt, 2, ne_q, wq);
        ADD("attn_k.weight", wt, 2, ne_kv, wk);
        ADD("attn_v.weight", wt, 2, ne_kv, wv);
        ADD("attn_output.weight", wt, 2, ne_q, wo);
        ADD("ffn_norm.weight", LOOM_F32, 1, ne_norm, norm);
        ADD("ffn_gate.weight", wt, 2, ne_ff, gate);
        ADD("ffn_up.weight", wt, 2, ne_ff, up);
        ADD("ffn_down.weight", wt, 2, ne_down, down);
#undef ADD
    }
    if (bad) {
        snprintf(err, err_size, "synthetic %s: a dimension is not a multiple of %s's block",
                 sh->name, type_name);
        goto done;
    }
    rc = loom_gguf_write(w, path, err, err_size);
done:
    for (int32_t i = 0; tokens && i < sh->n_vocab; i++)
        free(tokens[i]);
    free(tokens), free(scores), free(types), free(norm);
    free(embd), free(wq), free(wk), free(wv), free(wo), free(gate), free(up), free(down), free(out);
    loom_gguf_writer_free(w);
    return rc;
}
