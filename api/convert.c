/*
 * api/convert.c - Hugging Face folder -> GGUF: `loom convert`, and the in-memory conversion
 * that lets `loom run -m FOLDER` and `loom inspect FOLDER` take a folder directly.
 *
 * Llama family (model_type "llama"): names and keys follow the convention llama.cpp uses for
 * GGUF "llama" files, so the result loads there too; Q and K rows are permuted from Hugging
 * Face's rotate-half order into the adjacent-pair order that convention expects. Norms and
 * other 1-D tensors stay f32; a matrix whose rows are not whole blocks stays f32 (with a
 * note) when a block type is asked for. The tokenizer comes from tokenizer.model.
 */
#define _GNU_SOURCE
#include "internal.h"

#include "core/gguf.h"
#include "core/safetensors.h"
#include "core/spm_model.h"
#include "core/tokenizer.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdarg.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct conv {
    const char *dir;
    cJSON *config, *tok_config;
    loom_safetensors st;
    loom_spm_model spm;
    loom_gguf_writer *w;
    void **owned;
    int n_owned, cap_owned;
    const char *type; /* requested: auto, f32, f16, bf16, q8_0, q4_0, q4_1 */
    loom_convert_progress_fn progress;
    void *user;
    int done, total;
    char *err;
    size_t err_size;
} conv;

static int fail(conv *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, c->err_size, fmt, ap);
    va_end(ap);
    return -1;
}

static cJSON *read_json(const char *dir, const char *name, int required, conv *c)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f) {
        if (required)
            fail(c, "%s: %s (is this a Hugging Face model folder?)", path, strerror(errno));
        return NULL;
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = n >= 0 && n < (64L << 20) ? malloc((size_t)n + 1) : NULL;
    cJSON *j = NULL;
    if (text && fread(text, 1, (size_t)n, f) == (size_t)n) {
        text[n] = '\0';
        j = cJSON_Parse(text);
    }
    free(text);
    fclose(f);
    if (!j && required)
        fail(c, "%s: not valid JSON", path);
    return j;
}

static double num(cJSON *o, const char *key, double fallback)
{
    cJSON *v = cJSON_GetObjectItem(o, key);
    return cJSON_IsNumber(v) ? v->valuedouble : fallback;
}

static void *own(conv *c, size_t bytes)
{
    if (c->n_owned == c->cap_owned) {
        int cap = c->cap_owned ? c->cap_owned * 2 : 64;
        void **grown = realloc(c->owned, (size_t)cap * sizeof *grown);
        if (!grown)
            return NULL;
        c->owned = grown;
        c->cap_owned = cap;
    }
    void *p = malloc(bytes ? bytes : 1);
    if (p)
        c->owned[c->n_owned++] = p;
    return p;
}

int loom_parse_weight_type(const char *s, loom_dtype *t)
{
    static const loom_dtype all[] = {LOOM_F32, LOOM_F16, LOOM_BF16, LOOM_Q8_0, LOOM_Q4_0, LOOM_Q4_1};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (strcmp(s, loom_dtype_name(all[i])) == 0) {
            *t = all[i];
            return 0;
        }
    return -1;
}

/* How add() reorders a tensor's rows (a vector's elements). */
typedef enum { ROWS_AS_STORED, ROWS_ROPE_PAIRS, ROWS_QKV_PER_HEAD } row_order_kind;
typedef struct row_order {
    row_order_kind kind;
    int heads;
} row_order;
#define AS_STORED ((row_order){ROWS_AS_STORED, 0})

/* The llama convention's Q/K permutation (none for 0 heads). */
static row_order rope_pairs(int heads)
{
    return (row_order){heads > 0 ? ROWS_ROPE_PAIRS : ROWS_AS_STORED, heads};
}

/* The source tensor as f32 rows (rows x cols), reordered:
 *   ROWS_ROPE_PAIRS: rotate-half order -> adjacent pairs: within each head, new row 2i + j is
 *     old row j * head_dim / 2 + i (the llama convention's Q/K);
 *   ROWS_QKV_PER_HEAD: [q k v] per head -> [Q; K; V] (ChatGLM-6B's fused projection and its
 *     bias): old unit 3 hd h + part hd + i -> new unit part H hd + h hd + i.
 * A vector (rows == 1) is reordered element by element. */
static float *load_f32(const loom_st_tensor *t, int64_t rows, int64_t cols, row_order order)
{
    float *out = malloc((size_t)(rows * cols) * sizeof *out);
    if (!out)
        return NULL;
    loom_row_to_f32((loom_dtype)t->loom_type, t->data, out, rows * cols);
    if (order.kind == ROWS_AS_STORED)
        return out;
    int64_t units = rows == 1 ? cols : rows, width = rows == 1 ? 1 : cols;
    int64_t hd = order.kind == ROWS_ROPE_PAIRS ? units / order.heads : units / (3 * order.heads);
    float *tmp = malloc((size_t)(rows * cols) * sizeof *tmp);
    if (!tmp) {
        free(out);
        return NULL;
    }
    for (int64_t u = 0; u < units; u++) {
        int64_t from;
        if (order.kind == ROWS_ROPE_PAIRS) {
            int64_t h = u / hd, i = (u % hd) / 2, j = u % 2;
            from = h * hd + j * hd / 2 + i;
        } else {
            int64_t part = u / (order.heads * hd), h = u % (order.heads * hd) / hd, i = u % hd;
            from = h * 3 * hd + part * hd + i;
        }
        memcpy(tmp + u * width, out + from * width, (size_t)width * sizeof *tmp);
    }
    free(out);
    return tmp;
}

/* Adds HF tensor `src` as GGUF `dst`; required unless optional. */
static int add(conv *c, const char *src, const char *dst, int optional, row_order order)
{
    const loom_st_tensor *t = loom_safetensors_find(&c->st, src);
    if (!t) {
        if (optional)
            return 0;
        return fail(c, "%s: the weights have no tensor '%s'", c->dir, src);
    }
    if (t->loom_type < 0 || t->n_dims < 1 || t->n_dims > 2)
        return fail(c, "%s: tensor '%s' is %s with %d dimensions; loom converts f32/f16/bf16 "
                       "vectors and matrices", c->dir, src, t->dtype, t->n_dims);
    int64_t rows = t->n_dims == 2 ? t->shape[0] : 1, cols = t->shape[t->n_dims - 1];
    int64_t units = rows == 1 ? cols : rows;
    if ((order.kind == ROWS_ROPE_PAIRS && (units % order.heads || (units / order.heads) % 2)) ||
        (order.kind == ROWS_QKV_PER_HEAD && units % (3 * order.heads)))
        return fail(c, "%s: '%s' has %lld rows, not a whole number of heads", c->dir, src,
                    (long long)units);
    loom_dtype out_type = LOOM_F32;
    if (t->n_dims == 2) {
        if (strcmp(c->type, "auto") == 0)
            out_type = (loom_dtype)t->loom_type;
        else
            loom_parse_weight_type(c->type, &out_type);
        if (loom_dtype_block_elems(out_type) > 1 && cols % LOOM_QK) {
            fprintf(stderr, "note: %s stays f32: its rows of %lld are not whole blocks of %d\n",
                    dst, (long long)cols, LOOM_QK);
            out_type = LOOM_F32;
        }
    }
    float *f = load_f32(t, rows, cols, order);
    int64_t rb = loom_row_bytes(out_type, cols);
    unsigned char *data = f ? own(c, (size_t)(rb * rows)) : NULL;
    if (!data) {
        free(f);
        return fail(c, "out of memory converting '%s'", src);
    }
    for (int64_t r = 0; r < rows; r++)
        loom_row_from_f32(out_type, f + r * cols, data + r * rb, cols);
    free(f);
    int64_t ne[2] = {cols, rows};
    if (loom_gguf_add_tensor(c->w, dst, out_type, (uint32_t)t->n_dims, ne, data) != 0)
        return fail(c, "cannot add '%s'", dst);
    c->done++;
    if (c->progress)
        c->progress(c->user, c->done, c->total, dst);
    return 0;
}

/* Layer l's tensor: Hugging Face name LAYERS.l.hf (LAYERS as the family prefixes its layers)
 * as GGUF blk.l.gg. */
static int add_layer(conv *c, const char *layers, int l, const char *hf, const char *gg,
                     int optional, row_order order)
{
    char src[256], dst[128];
    snprintf(src, sizeof src, "%s.%d.%s", layers, l, hf);
    snprintf(dst, sizeof dst, "blk.%d.%s", l, gg);
    return add(c, src, dst, optional, order);
}

/* ChatGLM-6B's SentencePiece model, under its own name */
static int is_ice_text(const conv *c)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.model", c->dir);
    if (access(path, R_OK) == 0)
        return 0;
    snprintf(path, sizeof path, "%s/ice_text.model", c->dir);
    return access(path, R_OK) == 0;
}

static int32_t piece_id(const loom_spm_model *m, const char *piece)
{
    for (int32_t i = 0; i < m->n; i++)
        if (!strcmp(m->pieces[i], piece))
            return i;
    return -1;
}

static int tokenizer(conv *c)
{
    char path[4096];
    int ice = is_ice_text(c);
    snprintf(path, sizeof path, "%s/%s", c->dir, ice ? "ice_text.model" : "tokenizer.model");
    if (access(path, R_OK) != 0)
        return fail(c, "%s: no tokenizer.model (loom reads the SentencePiece model of the Llama "
                       "family; tokenizer.json-only folders are not supported yet)", c->dir);
    if (loom_spm_model_read(&c->spm, path, c->err, c->err_size) != 0)
        return -1;
    if (c->spm.model_type != 1 && c->spm.model_type != 2)
        return fail(c, "%s: a SentencePiece model of type %d; loom runs BPE and unigram ones",
                    path, c->spm.model_type);
    int32_t n_vocab = (int32_t)num(c->config, "vocab_size", c->spm.n);
    if (n_vocab < c->spm.n)
        n_vocab = c->spm.n;
    /* llama.cpp wants one token per embedding row: pad with unused placeholders */
    const char **tokens = calloc((size_t)n_vocab, sizeof *tokens);
    float *scores = calloc((size_t)n_vocab, sizeof *scores);
    int32_t *types = calloc((size_t)n_vocab, sizeof *types);
    char **pads = calloc((size_t)n_vocab, sizeof *pads);
    int rc = tokens && scores && types && pads ? 0 : fail(c, "out of memory");
    for (int32_t i = 0; rc == 0 && i < n_vocab; i++) {
        if (i < c->spm.n) {
            tokens[i] = c->spm.pieces[i];
            scores[i] = c->spm.scores[i];
            types[i] = c->spm.types[i];
        } else {
            if (asprintf(&pads[i], "[PAD%d]", i) < 0)
                rc = fail(c, "out of memory");
            tokens[i] = pads[i];
            scores[i] = -1000.0f;
            types[i] = 5;
        }
    }
    if (rc == 0) {
        /* llama.cpp's names: "llama" for SentencePiece BPE, "t5" for unigram */
        loom_gguf_set_str(c->w, "tokenizer.ggml.model", c->spm.model_type == 1 ? "t5" : "llama");
        if (c->spm.normalizer[0] && strcmp(c->spm.normalizer, "identity") != 0) {
            /* nmt_nfkc and the like: loom normalises with NFKC; identity-normalised models are
             * tokenized as llama.cpp does, which ignores remove_extra_whitespaces */
            if (strstr(c->spm.normalizer, "nfkc"))
                loom_gguf_set_str(c->w, "tokenizer.loom.normalizer", "nfkc");
            loom_gguf_set_bool(c->w, "tokenizer.loom.remove_extra_whitespaces",
                               c->spm.remove_extra_whitespaces);
        }
        if (ice) {
            /* ChatGLM-6B: text rewriting, and [gMASK] <sop> after the prompt; <eop> ends */
            int32_t gmask = piece_id(&c->spm, "[gMASK]"), sop = piece_id(&c->spm, "<sop>");
            int32_t eop = piece_id(&c->spm, "<eop>");
            if (gmask < 0 || sop < 0 || eop < 0)
                rc = fail(c, "%s: no [gMASK], <sop> or <eop> piece: not ChatGLM-6B's tokenizer", path);
            int32_t suffix[2] = {gmask, sop};
            loom_gguf_set_bool(c->w, "tokenizer.loom.glm_text", 1);
            loom_gguf_set_i32_array(c->w, "tokenizer.loom.suffix_tokens", suffix, 2);
            loom_gguf_set_u32(c->w, "tokenizer.ggml.gmask_token_id", (uint32_t)(gmask < 0 ? 0 : gmask));
            c->spm.bos_id = sop, c->spm.eos_id = eop;
        }
        loom_gguf_set_str_array(c->w, "tokenizer.ggml.tokens", tokens, (uint64_t)n_vocab);
        loom_gguf_set_f32_array(c->w, "tokenizer.ggml.scores", scores, (uint64_t)n_vocab);
        loom_gguf_set_i32_array(c->w, "tokenizer.ggml.token_type", types, (uint64_t)n_vocab);
        loom_gguf_set_u32(c->w, "tokenizer.ggml.unknown_token_id", (uint32_t)c->spm.unk_id);
        if (c->spm.bos_id >= 0)
            loom_gguf_set_u32(c->w, "tokenizer.ggml.bos_token_id", (uint32_t)c->spm.bos_id);
        if (c->spm.eos_id >= 0)
            loom_gguf_set_u32(c->w, "tokenizer.ggml.eos_token_id", (uint32_t)c->spm.eos_id);
        cJSON *ab = cJSON_GetObjectItem(c->tok_config, "add_bos_token");
        loom_gguf_set_bool(c->w, "tokenizer.ggml.add_bos_token", ice ? 0 : ab ? cJSON_IsTrue(ab) : 1);
        loom_gguf_set_bool(c->w, "tokenizer.ggml.add_space_prefix", c->spm.add_dummy_prefix);
        /* special tokens declared with lstrip/rstrip false keep the whitespace beside them;
         * undeclared ones lose it (see core/tokenizer.c) */
        int strip = 1;
        cJSON *added = cJSON_GetObjectItem(c->tok_config, "added_tokens_decoder"), *a;
        cJSON_ArrayForEach(a, added)
            if (cJSON_IsFalse(cJSON_GetObjectItem(a, "lstrip")) &&
                cJSON_IsFalse(cJSON_GetObjectItem(a, "rstrip")))
                strip = 0;
        loom_gguf_set_bool(c->w, "tokenizer.loom.strip_special", strip);
        cJSON *tmpl = cJSON_GetObjectItem(c->tok_config, "chat_template");
        if (cJSON_IsString(tmpl))
            loom_gguf_set_str(c->w, "tokenizer.chat_template", tmpl->valuestring);
    }
    for (int32_t i = 0; pads && i < n_vocab; i++)
        free(pads[i]);
    free(pads), free(tokens), free(scores), free(types);
    return rc;
}

/* generation_config.json's eos_token_id, when it lists several (Qwen2: <|im_end|> and
 * <|endoftext|>; ChatGLM3: </s>, <|user|>, <|observation|>): every one ends a generation. */
static void stop_tokens(conv *c)
{
    cJSON *gen = read_json(c->dir, "generation_config.json", 0, c);
    cJSON *eos = cJSON_GetObjectItem(gen, "eos_token_id");
    if (cJSON_IsArray(eos) && cJSON_GetArraySize(eos) > 0 && cJSON_GetArraySize(eos) <= 16) {
        int32_t ids[16];
        int n = 0;
        cJSON *e;
        cJSON_ArrayForEach(e, eos)
            if (cJSON_IsNumber(e) && n < 16)
                ids[n++] = e->valueint;
        loom_gguf_set_i32_array(c->w, "tokenizer.loom.stop_token_ids", ids, (uint64_t)n);
    }
    cJSON_Delete(gen);
}

/* A byte-level BPE vocabulary being assembled, whatever the folder ships it as: tokens by id
 * (borrowed strings, or ones it owns), their types, the merges. */
typedef struct bpe_vocab {
    int32_t n;
    const char **tokens;
    int32_t *types;
    char **owned;        /* per id: a string this vocabulary allocated */
    char **merges;       /* "left right", owned */
    size_t n_merges, cap;
    int32_t bos, eos, pad;
} bpe_vocab;

static int bpe_vocab_init(conv *c, bpe_vocab *v, int32_t n)
{
    *v = (bpe_vocab){.n = n, .bos = -1, .eos = -1, .pad = -1};
    v->tokens = calloc((size_t)n, sizeof *v->tokens);
    v->types = calloc((size_t)n, sizeof *v->types);
    v->owned = calloc((size_t)n, sizeof *v->owned);
    return v->tokens && v->types && v->owned ? 0 : fail(c, "out of memory");
}

static void bpe_vocab_free(bpe_vocab *v)
{
    for (int32_t i = 0; v->owned && i < v->n; i++)
        free(v->owned[i]);
    for (size_t i = 0; i < v->n_merges; i++)
        free(v->merges[i]);
    free(v->owned), free(v->tokens), free(v->types), free(v->merges);
}

/* Takes ownership of text (NULL: out of memory). */
static int bpe_vocab_merge(conv *c, bpe_vocab *v, char *text)
{
    if (text && v->n_merges == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 65536;
        char **grown = realloc(v->merges, cap * sizeof *grown);
        if (!grown) {
            free(text);
            text = NULL;
        } else {
            v->merges = grown, v->cap = cap;
        }
    }
    if (!text)
        return fail(c, "out of memory");
    v->merges[v->n_merges++] = text;
    return 0;
}

/* Pads the ids nothing named, and writes the tokenizer keys. */
static int bpe_vocab_write(conv *c, bpe_vocab *v, const char *pre, int add_bos)
{
    for (int32_t i = 0; i < v->n; i++)
        if (!v->tokens[i]) {
            if (asprintf(&v->owned[i], "[PAD%d]", i) < 0)
                return fail(c, "out of memory");
            v->tokens[i] = v->owned[i], v->types[i] = 5;
        }
    loom_gguf_set_str(c->w, "tokenizer.ggml.model", "gpt2");
    loom_gguf_set_str(c->w, "tokenizer.ggml.pre", pre);
    loom_gguf_set_str_array(c->w, "tokenizer.ggml.tokens", v->tokens, (uint64_t)v->n);
    loom_gguf_set_i32_array(c->w, "tokenizer.ggml.token_type", v->types, (uint64_t)v->n);
    loom_gguf_set_str_array(c->w, "tokenizer.ggml.merges", (const char *const *)v->merges, v->n_merges);
    if (v->bos >= 0)
        loom_gguf_set_u32(c->w, "tokenizer.ggml.bos_token_id", (uint32_t)v->bos);
    if (v->eos >= 0)
        loom_gguf_set_u32(c->w, "tokenizer.ggml.eos_token_id", (uint32_t)v->eos);
    if (v->pad >= 0)
        loom_gguf_set_u32(c->w, "tokenizer.ggml.padding_token_id", (uint32_t)v->pad);
    loom_gguf_set_bool(c->w, "tokenizer.ggml.add_bos_token", add_bos);
    cJSON *tmpl = cJSON_GetObjectItem(c->tok_config, "chat_template");
    if (cJSON_IsString(tmpl))
        loom_gguf_set_str(c->w, "tokenizer.chat_template", tmpl->valuestring);
    return 0;
}

/* Qwen2-style byte-level BPE: vocab.json, merges.txt and the added tokens the tokenizer
 * config declares. */
static int tokenizer_bpe(conv *c)
{
    cJSON *vocab = read_json(c->dir, "vocab.json", 1, c);
    if (!vocab)
        return -1;
    char path[4096];
    snprintf(path, sizeof path, "%s/merges.txt", c->dir);
    FILE *mf = fopen(path, "r");
    if (!mf) {
        cJSON_Delete(vocab);
        return fail(c, "%s: %s (a byte-level BPE tokenizer needs its merges)", path, strerror(errno));
    }
    int32_t n_vocab = (int32_t)num(c->config, "vocab_size", 0);
    cJSON *e;
    cJSON_ArrayForEach(e, vocab)
        if (cJSON_IsNumber(e) && e->valueint >= n_vocab)
            n_vocab = e->valueint + 1;
    cJSON *added = cJSON_GetObjectItem(c->tok_config, "added_tokens_decoder");
    cJSON_ArrayForEach(e, added)
        if (atoi(e->string) >= n_vocab)
            n_vocab = atoi(e->string) + 1;
    bpe_vocab v;
    int rc = bpe_vocab_init(c, &v, n_vocab);
    cJSON_ArrayForEach(e, vocab)
        if (rc == 0 && cJSON_IsNumber(e) && e->valueint >= 0)
            v.tokens[e->valueint] = e->string, v.types[e->valueint] = 1;
    v.eos = (int32_t)num(c->config, "eos_token_id", -1);
    cJSON *eos_name = cJSON_GetObjectItem(c->tok_config, "eos_token");
    cJSON *pad_name = cJSON_GetObjectItem(c->tok_config, "pad_token");
    cJSON_ArrayForEach(e, added)
    {
        int id = atoi(e->string);
        cJSON *content = cJSON_GetObjectItem(e, "content");
        if (rc || id < 0 || !cJSON_IsString(content))
            continue;
        v.tokens[id] = content->valuestring;
        v.types[id] = cJSON_IsTrue(cJSON_GetObjectItem(e, "special")) ? 3 : 4;
        if (cJSON_IsString(eos_name) && !strcmp(eos_name->valuestring, content->valuestring))
            v.eos = id;
        if (cJSON_IsString(pad_name) && !strcmp(pad_name->valuestring, content->valuestring))
            v.pad = id;
    }
    char line[4096];
    while (rc == 0 && fgets(line, sizeof line, mf)) {
        size_t len = strcspn(line, "\r\n");
        line[len] = '\0';
        if (len && strncmp(line, "#version", 8))
            rc = bpe_vocab_merge(c, &v, strdup(line));
    }
    fclose(mf);
    v.bos = (int32_t)num(c->config, "bos_token_id", -1);
    cJSON *ab = cJSON_GetObjectItem(c->tok_config, "add_bos_token");
    if (rc == 0)
        rc = bpe_vocab_write(c, &v, "qwen2", ab && cJSON_IsTrue(ab));
    bpe_vocab_free(&v);
    cJSON_Delete(vocab);
    return rc;
}

/* A Hugging Face tokenizer.json of the byte-level BPE kind (Llama-3, and Qwen2 when it ships
 * one): vocabulary, merges, added tokens, and the pre-tokenizer, recognised by its regex. */
static int tokenizer_json(conv *c, cJSON *tj)
{
    cJSON *model = cJSON_GetObjectItem(tj, "model");
    cJSON *type = cJSON_GetObjectItem(model, "type");
    cJSON *vocab = cJSON_GetObjectItem(model, "vocab"), *merges = cJSON_GetObjectItem(model, "merges");
    if (!cJSON_IsString(type) || strcmp(type->valuestring, "BPE") || !cJSON_IsObject(vocab) ||
        !cJSON_IsArray(merges))
        return fail(c, "%s/tokenizer.json: not a BPE tokenizer with a vocab and merges", c->dir);
    char *pre_json = cJSON_PrintUnformatted(cJSON_GetObjectItem(tj, "pre_tokenizer"));
    const char *pre = !pre_json ? NULL
                      : strstr(pre_json, "\\\\p{N}{1,3}") ? "llama-bpe"
                      : strstr(pre_json, "\\\\p{N}|") ? "qwen2"
                                                      : NULL;
    int byte_level = pre_json && strstr(pre_json, "ByteLevel");
    free(pre_json);
    if (!pre || !byte_level)
        return fail(c, "%s/tokenizer.json: a pre-tokenizer loom does not know (it knows the "
                       "byte-level ones of Llama-3 and Qwen2)", c->dir);
    int32_t n_vocab = (int32_t)num(c->config, "vocab_size", 0);
    cJSON *e, *added = cJSON_GetObjectItem(tj, "added_tokens");
    cJSON_ArrayForEach(e, vocab)
        if (cJSON_IsNumber(e) && e->valueint >= n_vocab)
            n_vocab = e->valueint + 1;
    cJSON_ArrayForEach(e, added)
        if ((int)num(e, "id", -1) >= n_vocab)
            n_vocab = (int)num(e, "id", -1) + 1;
    bpe_vocab v;
    int rc = bpe_vocab_init(c, &v, n_vocab);
    cJSON_ArrayForEach(e, vocab)
        if (rc == 0 && cJSON_IsNumber(e) && e->valueint >= 0)
            v.tokens[e->valueint] = e->string, v.types[e->valueint] = 1;
    cJSON *bos_name = cJSON_GetObjectItem(c->tok_config, "bos_token");
    cJSON *eos_name = cJSON_GetObjectItem(c->tok_config, "eos_token");
    cJSON_ArrayForEach(e, added)
    {
        int id = (int)num(e, "id", -1);
        cJSON *content = cJSON_GetObjectItem(e, "content");
        if (rc || id < 0 || !cJSON_IsString(content))
            continue;
        v.tokens[id] = content->valuestring;
        v.types[id] = cJSON_IsTrue(cJSON_GetObjectItem(e, "special")) ? 3 : 4;
        if (cJSON_IsString(bos_name) && !strcmp(bos_name->valuestring, content->valuestring))
            v.bos = id;
        if (cJSON_IsString(eos_name) && !strcmp(eos_name->valuestring, content->valuestring))
            v.eos = id;
    }
    int i = 0;
    cJSON *m;
    cJSON_ArrayForEach(m, merges) /* a linked list: walking it by index would be quadratic */
    {
        if (rc)
            break;
        char *text = NULL;
        if (cJSON_IsString(m))
            text = strdup(m->valuestring);
        else if (cJSON_IsArray(m) && cJSON_GetArraySize(m) == 2) /* newer files: [left, right] */
            if (asprintf(&text, "%s %s", cJSON_GetArrayItem(m, 0)->valuestring,
                         cJSON_GetArrayItem(m, 1)->valuestring) < 0)
                text = NULL;
        if (!cJSON_IsString(m) && !cJSON_IsArray(m))
            rc = fail(c, "%s/tokenizer.json: merge %d is not a pair", c->dir, i);
        else
            rc = bpe_vocab_merge(c, &v, text);
        i++;
    }
    cJSON *ab = cJSON_GetObjectItem(c->tok_config, "add_bos_token");
    if (rc == 0)
        rc = bpe_vocab_write(c, &v, pre, ab ? cJSON_IsTrue(ab) : v.bos >= 0);
    bpe_vocab_free(&v);
    return rc;
}

/* ---- tiktoken rank files -------------------------------------------------------------------
 * One "base64(bytes) rank" line per token: Llama-3's tokenizer.model, Qwen v1's qwen.tiktoken.
 * Stored as byte-level BPE, as llama.cpp and transformers do: each token spelled with GPT-2's
 * byte map, and as merges every split of a token into two tokens, ordered by the merged token's
 * rank, then by the left part's rank and the right part's. */

static int is_tiktoken(const char *path)
{
    FILE *f = fopen(path, "r");
    char line[512];
    int yes = f && fgets(line, sizeof line, f) && strspn(line, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=") > 0;
    if (yes) {
        size_t b = strspn(line, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=");
        yes = line[b] == ' ' && line[b + 1] >= '0' && line[b + 1] <= '9';
    }
    if (f)
        fclose(f);
    return yes;
}

static int base64_decode(const char *in, size_t n, unsigned char *out)
{
    static const char alphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    uint32_t acc = 0;
    int bits = 0, k = 0;
    for (size_t i = 0; i < n && in[i] != '='; i++) {
        const char *p = strchr(alphabet, in[i]);
        if (!p || !in[i])
            return -1;
        acc = acc << 6 | (uint32_t)(p - alphabet);
        if ((bits += 6) >= 8)
            out[k++] = (unsigned char)(acc >> (bits -= 8));
    }
    return k;
}

typedef struct rank_table {
    unsigned char **bytes;
    int *len;
    int32_t n;
    int32_t *slot; /* open addressing: bytes -> rank */
    uint32_t mask;
} rank_table;

static uint32_t hash_mem(const unsigned char *p, int n)
{
    uint32_t h = 2166136261u;
    for (int i = 0; i < n; i++)
        h = (h ^ p[i]) * 16777619u;
    return h;
}

static int32_t rank_of(const rank_table *t, const unsigned char *p, int n)
{
    for (uint32_t h = hash_mem(p, n) & t->mask; t->slot[h] >= 0; h = (h + 1) & t->mask)
        if (t->len[t->slot[h]] == n && memcmp(t->bytes[t->slot[h]], p, (size_t)n) == 0)
            return t->slot[h];
    return -1;
}

static void rank_table_free(rank_table *t)
{
    for (int32_t i = 0; t->bytes && i < t->n; i++)
        free(t->bytes[i]);
    free(t->bytes), free(t->len), free(t->slot);
}

static int read_ranks(conv *c, const char *path, rank_table *t)
{
    *t = (rank_table){0};
    FILE *f = fopen(path, "r");
    if (!f)
        return fail(c, "%s: %s", path, strerror(errno));
    int32_t cap = 0;
    char line[1024];
    int rc = 0, lineno = 0;
    while (rc == 0 && fgets(line, sizeof line, f)) {
        lineno++;
        char *sp = strchr(line, ' ');
        long rank = sp ? strtol(sp + 1, NULL, 10) : -1;
        unsigned char buf[768];
        int n = sp ? base64_decode(line, (size_t)(sp - line), buf) : -1;
        if (n <= 0 || rank < 0 || rank > (1 << 22)) {
            rc = fail(c, "%s:%d: not a tiktoken 'base64 rank' line", path, lineno);
            break;
        }
        if (rank >= cap) {
            int32_t ncap = cap ? cap * 2 : 1 << 17;
            while (ncap <= rank)
                ncap *= 2;
            unsigned char **nb = realloc(t->bytes, (size_t)ncap * sizeof *nb);
            int *nl = nb ? realloc(t->len, (size_t)ncap * sizeof *nl) : NULL;
            if (nb)
                t->bytes = nb;
            if (!nb || !nl) {
                rc = fail(c, "out of memory");
                break;
            }
            t->len = nl;
            memset(t->bytes + cap, 0, (size_t)(ncap - cap) * sizeof *nb);
            memset(t->len + cap, 0, (size_t)(ncap - cap) * sizeof *nl);
            cap = ncap;
        }
        if (t->bytes[rank] || !(t->bytes[rank] = malloc((size_t)n))) {
            rc = fail(c, "%s:%d: rank %ld given twice (or out of memory)", path, lineno, rank);
            break;
        }
        memcpy(t->bytes[rank], buf, (size_t)n);
        t->len[rank] = n;
        if (rank >= t->n)
            t->n = (int32_t)rank + 1;
    }
    fclose(f);
    for (int32_t i = 0; rc == 0 && i < t->n; i++)
        if (!t->bytes[i])
            rc = fail(c, "%s: rank %d is missing", path, i);
    uint32_t size = 1;
    while (rc == 0 && size < 2u * (uint32_t)t->n)
        size <<= 1;
    if (rc == 0 && !(t->slot = malloc(size * sizeof *t->slot)))
        rc = fail(c, "out of memory");
    if (rc == 0) {
        t->mask = size - 1;
        memset(t->slot, 0xff, size * sizeof *t->slot);
        for (int32_t r = 0; r < t->n; r++) {
            uint32_t h = hash_mem(t->bytes[r], t->len[r]) & t->mask;
            while (t->slot[h] >= 0)
                h = (h + 1) & t->mask;
            t->slot[h] = r;
        }
    }
    return rc;
}

static int cmp_pair(const void *a, const void *b)
{
    const int32_t *x = a, *y = b;
    return x[0] != y[0] ? (x[0] > y[0]) - (x[0] < y[0]) : (x[1] > y[1]) - (x[1] < y[1]);
}

/* The specials that follow the ranks: Llama-3.1's (Meta's tokenizer.py order) or Qwen v1's. */
static int tiktoken_specials(conv *c, bpe_vocab *v, int32_t first, int llama3)
{
    static const char *const llama3_named[] = {
        "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
        "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
        "<|image|>"};
    static const char *const qwen_named[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
    int n_named = llama3 ? 12 : 3, total = llama3 ? 256 : 3 + 205;
    for (int i = 0; i < total && first + i < v->n; i++) {
        int32_t id = first + i;
        if (i < n_named)
            v->tokens[id] = llama3 ? llama3_named[i] : qwen_named[i];
        else if (asprintf(&v->owned[id], llama3 ? "<|reserved_special_token_%d|>" : "<|extra_%d|>",
                          llama3 ? i - n_named + 2 : i - n_named) < 0)
            return fail(c, "out of memory");
        else
            v->tokens[id] = v->owned[id];
        v->types[id] = 3;
    }
    if (llama3) {
        int32_t stops[2] = {first + 8, first + 9}; /* <|eom_id|>, <|eot_id|> */
        v->bos = first, v->eos = first + 1;
        loom_gguf_set_i32_array(c->w, "tokenizer.loom.stop_token_ids", stops, 2);
    } else {
        int32_t stops[1] = {first + 2}; /* <|im_end|> */
        v->eos = first;
        loom_gguf_set_i32_array(c->w, "tokenizer.loom.stop_token_ids", stops, 1);
    }
    return 0;
}

/* pre: the pre-tokenizer, "llama-bpe" (Llama-3) or "qwen2" (Qwen v1: the same regex as Qwen2). */
static int tokenizer_tiktoken(conv *c, const char *path, const char *pre)
{
    rank_table t;
    if (read_ranks(c, path, &t) != 0) {
        rank_table_free(&t);
        return -1;
    }
    int llama3 = !strcmp(pre, "llama-bpe");
    int32_t n_vocab = (int32_t)num(c->config, "vocab_size", 0);
    int32_t want = t.n + (llama3 ? 256 : 208);
    if (n_vocab < want)
        n_vocab = want;
    bpe_vocab v;
    int rc = bpe_vocab_init(c, &v, n_vocab);
    char *spelled = malloc(2 * 768 + 1);
    int32_t *pairs = malloc(2 * 768 * sizeof *pairs);
    if (rc == 0 && (!spelled || !pairs))
        rc = fail(c, "out of memory");
    for (int32_t r = 0; rc == 0 && r < t.n; r++) {
        size_t k = loom_byte_level_spell(t.bytes[r], (size_t)t.len[r], spelled);
        if (!(v.owned[r] = strndup(spelled, k)))
            rc = fail(c, "out of memory");
        v.tokens[r] = v.owned[r], v.types[r] = 1;
    }
    for (int32_t r = 0; rc == 0 && r < t.n; r++) {
        int np = 0;
        for (int k = 1; k < t.len[r]; k++) {
            int32_t l = rank_of(&t, t.bytes[r], k), rr = rank_of(&t, t.bytes[r] + k, t.len[r] - k);
            if (l >= 0 && rr >= 0)
                pairs[2 * np] = l, pairs[2 * np + 1] = rr, np++;
        }
        qsort(pairs, (size_t)np, 2 * sizeof *pairs, cmp_pair);
        for (int i = 0; rc == 0 && i < np; i++) {
            char *m = NULL;
            if (asprintf(&m, "%s %s", v.tokens[pairs[2 * i]], v.tokens[pairs[2 * i + 1]]) < 0)
                m = NULL;
            rc = bpe_vocab_merge(c, &v, m);
        }
    }
    if (rc == 0)
        rc = tiktoken_specials(c, &v, t.n, llama3);
    if (rc == 0)
        rc = bpe_vocab_write(c, &v, pre, llama3);
    free(spelled), free(pairs);
    bpe_vocab_free(&v);
    rank_table_free(&t);
    return rc;
}

/* The folder's tokenizer, whichever form it ships: tokenizer.json (byte-level BPE), a
 * tiktoken rank file (qwen.tiktoken, or tokenizer.model in that format), a SentencePiece
 * model (tokenizer.model, ice_text.model), or vocab.json + merges.txt. */
static int any_tokenizer(conv *c)
{
    /* a byte-level tokenizer.json wins (Llama-3 folders also carry a tokenizer.model, in
     * tiktoken's format); a SentencePiece-style one defers to tokenizer.model */
    cJSON *tj = read_json(c->dir, "tokenizer.json", 0, c);
    char *pre = tj ? cJSON_PrintUnformatted(cJSON_GetObjectItem(tj, "pre_tokenizer")) : NULL;
    int byte_level = pre && strstr(pre, "ByteLevel");
    free(pre);
    if (byte_level) {
        int rc = tokenizer_json(c, tj);
        cJSON_Delete(tj);
        return rc;
    }
    cJSON_Delete(tj);
    char path[4096];
    snprintf(path, sizeof path, "%s/qwen.tiktoken", c->dir);
    if (access(path, R_OK) == 0)
        return tokenizer_tiktoken(c, path, "qwen2");
    snprintf(path, sizeof path, "%s/tokenizer.model", c->dir);
    if (is_tiktoken(path))
        return tokenizer_tiktoken(c, path, "llama-bpe"); /* Llama-3's original tokenizer */
    int has_model = access(path, R_OK) == 0 || is_ice_text(c);
    snprintf(path, sizeof path, "%s/vocab.json", c->dir);
    if (!has_model && access(path, R_OK) == 0)
        return tokenizer_bpe(c);
    return tokenizer(c);
}

/* The Llama-shaped decoders: llama (SentencePiece, Q/K permuted) and qwen2 (byte-level BPE,
 * q/k/v biases, rotate-half order kept). */
static int decoder(conv *c, const char *arch)
{
    cJSON *cf = c->config;
    int32_t n_embd = (int32_t)num(cf, "hidden_size", 0), n_layer = (int32_t)num(cf, "num_hidden_layers", 0);
    int32_t n_head = (int32_t)num(cf, "num_attention_heads", 0);
    int32_t n_kv = (int32_t)num(cf, "num_key_value_heads", n_head);
    int32_t n_ff = (int32_t)num(cf, "intermediate_size", 0);
    if (n_embd <= 0 || n_layer <= 0 || n_head <= 0 || n_kv <= 0 || n_ff <= 0)
        return fail(c, "%s/config.json: hidden_size, num_hidden_layers, num_attention_heads and "
                       "intermediate_size must be positive", c->dir);
    int32_t hd = (int32_t)num(cf, "head_dim", n_embd / n_head);
    int qwen2 = !strcmp(arch, "qwen2");
    char key[128];
#define KEY(suffix) (snprintf(key, sizeof key, "%s.%s", arch, suffix), key)
    loom_gguf_set_str(c->w, "general.architecture", arch);
    const char *slash = strrchr(c->dir, '/');
    loom_gguf_set_str(c->w, "general.name", slash && slash[1] ? slash + 1 : c->dir);
    loom_gguf_set_u32(c->w, KEY("context_length"), (uint32_t)num(cf, "max_position_embeddings", 2048));
    loom_gguf_set_u32(c->w, KEY("embedding_length"), (uint32_t)n_embd);
    loom_gguf_set_u32(c->w, KEY("block_count"), (uint32_t)n_layer);
    loom_gguf_set_u32(c->w, KEY("feed_forward_length"), (uint32_t)n_ff);
    loom_gguf_set_u32(c->w, KEY("attention.head_count"), (uint32_t)n_head);
    loom_gguf_set_u32(c->w, KEY("attention.head_count_kv"), (uint32_t)n_kv);
    loom_gguf_set_u32(c->w, KEY("rope.dimension_count"), (uint32_t)hd);
    if (hd != n_embd / n_head) {
        loom_gguf_set_u32(c->w, KEY("attention.key_length"), (uint32_t)hd);
        loom_gguf_set_u32(c->w, KEY("attention.value_length"), (uint32_t)hd);
    }
    loom_gguf_set_f32(c->w, KEY("attention.layer_norm_rms_epsilon"), (float)num(cf, "rms_norm_eps", 1e-5));
    loom_gguf_set_f32(c->w, KEY("rope.freq_base"), (float)num(cf, "rope_theta", 10000.0));
    cJSON *rs = cJSON_GetObjectItem(cf, "rope_scaling");
    if (cJSON_IsObject(rs)) {
        cJSON *type = cJSON_GetObjectItem(rs, "type");
        if (!type)
            type = cJSON_GetObjectItem(rs, "rope_type");
        if (!cJSON_IsString(type) || strcmp(type->valuestring, "linear") != 0)
            return fail(c, "%s/config.json: rope_scaling type '%s' is not supported (linear is)",
                        c->dir, cJSON_IsString(type) ? type->valuestring : "?");
        loom_gguf_set_str(c->w, KEY("rope.scaling.type"), "linear");
        loom_gguf_set_f32(c->w, KEY("rope.scaling.factor"), (float)num(rs, "factor", 1.0));
    }
#undef KEY
    if (any_tokenizer(c))
        return -1;
    stop_tokens(c);
    int has_bias = loom_safetensors_find(&c->st, "model.layers.0.self_attn.q_proj.bias") != NULL;
    c->total = 2 + (loom_safetensors_find(&c->st, "lm_head.weight") != NULL) +
               (9 + 3 * has_bias) * n_layer;
    if (add(c, "model.embed_tokens.weight", "token_embd.weight", 0, AS_STORED) ||
        add(c, "model.norm.weight", "output_norm.weight", 0, AS_STORED) ||
        add(c, "lm_head.weight", "output.weight", 1, AS_STORED))
        return -1;
    for (int l = 0; l < n_layer; l++) {
#define ADD(hf, gg, perm)                                                                      \
    if (add_layer(c, "model.layers", l, hf, gg, 0, rope_pairs(perm)))                         \
        return -1
        ADD("input_layernorm.weight", "attn_norm.weight", 0);
        ADD("self_attn.q_proj.weight", "attn_q.weight", qwen2 ? 0 : n_head);
        ADD("self_attn.k_proj.weight", "attn_k.weight", qwen2 ? 0 : n_kv);
        ADD("self_attn.v_proj.weight", "attn_v.weight", 0);
        if (has_bias) {
            if (!qwen2)
                return fail(c, "%s: Llama q/k/v biases are not supported", c->dir);
            ADD("self_attn.q_proj.bias", "attn_q.bias", 0);
            ADD("self_attn.k_proj.bias", "attn_k.bias", 0);
            ADD("self_attn.v_proj.bias", "attn_v.bias", 0);
        }
        ADD("self_attn.o_proj.weight", "attn_output.weight", 0);
        ADD("post_attention_layernorm.weight", "ffn_norm.weight", 0);
        ADD("mlp.gate_proj.weight", "ffn_gate.weight", 0);
        ADD("mlp.up_proj.weight", "ffn_up.weight", 0);
        ADD("mlp.down_proj.weight", "ffn_down.weight", 0);
#undef ADD
    }
    return 0;
}

/* ChatGLM2/3 (model_type "chatglm"): llama.cpp's "chatglm" names; the SentencePiece model plus
 * the nine special tokens the ChatGLM tokenizer appends after its pieces; "[gMASK] sop" as
 * the prefix every prompt starts with (tokenizer.loom.prefix_tokens). */
static int chatglm(conv *c)
{
    cJSON *cf = c->config;
    int32_t n_embd = (int32_t)num(cf, "hidden_size", 0), n_layer = (int32_t)num(cf, "num_layers", 0);
    int32_t n_head = (int32_t)num(cf, "num_attention_heads", 0);
    int32_t n_kv = cJSON_IsTrue(cJSON_GetObjectItem(cf, "multi_query_attention"))
                       ? (int32_t)num(cf, "multi_query_group_num", 1)
                       : n_head;
    int32_t n_ff = (int32_t)num(cf, "ffn_hidden_size", 0);
    int32_t hd = (int32_t)num(cf, "kv_channels", n_head > 0 ? n_embd / n_head : 0);
    if (n_embd <= 0 || n_layer <= 0 || n_head <= 0 || n_kv <= 0 || n_ff <= 0 || hd <= 0)
        return fail(c, "%s/config.json: hidden_size, num_layers, num_attention_heads, "
                       "kv_channels and ffn_hidden_size must be positive", c->dir);
    if (!cJSON_IsTrue(cJSON_GetObjectItem(cf, "rmsnorm")))
        return fail(c, "%s: a ChatGLM with LayerNorm but without ChatGLM-6B's config keys "
                       "(position_encoding_2d, inner_hidden_size): loom does not know it", c->dir);
    loom_gguf_set_str(c->w, "general.architecture", "chatglm");
    const char *slash = strrchr(c->dir, '/');
    loom_gguf_set_str(c->w, "general.name", slash && slash[1] ? slash + 1 : c->dir);
    loom_gguf_set_u32(c->w, "chatglm.context_length", (uint32_t)num(cf, "seq_length", 8192));
    loom_gguf_set_u32(c->w, "chatglm.embedding_length", (uint32_t)n_embd);
    loom_gguf_set_u32(c->w, "chatglm.block_count", (uint32_t)n_layer);
    loom_gguf_set_u32(c->w, "chatglm.feed_forward_length", (uint32_t)n_ff);
    loom_gguf_set_u32(c->w, "chatglm.attention.head_count", (uint32_t)n_head);
    loom_gguf_set_u32(c->w, "chatglm.attention.head_count_kv", (uint32_t)n_kv);
    loom_gguf_set_u32(c->w, "chatglm.attention.key_length", (uint32_t)hd);
    loom_gguf_set_u32(c->w, "chatglm.rope.dimension_count", (uint32_t)(hd / 2));
    loom_gguf_set_f32(c->w, "chatglm.rope.freq_base", (float)(10000.0 * num(cf, "rope_ratio", 1.0)));
    loom_gguf_set_f32(c->w, "chatglm.attention.layer_norm_rms_epsilon",
                      (float)num(cf, "layernorm_epsilon", 1e-5));

    /* the tokenizer: the pieces, then the specials ChatGLM's tokenizer appends */
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.model", c->dir);
    if (loom_spm_model_read(&c->spm, path, c->err, c->err_size) != 0)
        return -1;
    static const char *const specials[] = {"[MASK]", "[gMASK]", "[sMASK]", "sop", "eop",
                                           "<|system|>", "<|user|>", "<|assistant|>",
                                           "<|observation|>"};
    int32_t n_sp = c->spm.n, n_vocab = (int32_t)num(cf, "padded_vocab_size", n_sp + 9);
    if (n_vocab < n_sp + 9)
        n_vocab = n_sp + 9;
    const char **tokens = calloc((size_t)n_vocab, sizeof *tokens);
    float *scores = calloc((size_t)n_vocab, sizeof *scores);
    int32_t *types = calloc((size_t)n_vocab, sizeof *types);
    char **pads = calloc((size_t)n_vocab, sizeof *pads);
    int rc = tokens && scores && types && pads ? 0 : fail(c, "out of memory");
    for (int32_t i = 0; rc == 0 && i < n_vocab; i++) {
        if (i < n_sp) {
            tokens[i] = c->spm.pieces[i], scores[i] = c->spm.scores[i], types[i] = c->spm.types[i];
        } else if (i < n_sp + 9) {
            tokens[i] = specials[i - n_sp], types[i] = 3;
        } else {
            if (asprintf(&pads[i], "[PAD%d]", i) < 0)
                rc = fail(c, "out of memory");
            tokens[i] = pads[i], types[i] = 5, scores[i] = -1000.0f;
        }
    }
    if (rc == 0) {
        int32_t prefix[2] = {n_sp + 1, n_sp + 3}; /* [gMASK], sop */
        loom_gguf_set_str(c->w, "tokenizer.ggml.model", "llama");
        loom_gguf_set_str_array(c->w, "tokenizer.ggml.tokens", tokens, (uint64_t)n_vocab);
        loom_gguf_set_f32_array(c->w, "tokenizer.ggml.scores", scores, (uint64_t)n_vocab);
        loom_gguf_set_i32_array(c->w, "tokenizer.ggml.token_type", types, (uint64_t)n_vocab);
        loom_gguf_set_u32(c->w, "tokenizer.ggml.unknown_token_id", (uint32_t)c->spm.unk_id);
        loom_gguf_set_u32(c->w, "tokenizer.ggml.eos_token_id", (uint32_t)num(cf, "eos_token_id", 2));
        loom_gguf_set_bool(c->w, "tokenizer.ggml.add_bos_token", 0);
        loom_gguf_set_bool(c->w, "tokenizer.ggml.add_space_prefix", c->spm.add_dummy_prefix);
        loom_gguf_set_bool(c->w, "tokenizer.loom.strip_special", 0); /* encode_special_tokens */
        loom_gguf_set_i32_array(c->w, "tokenizer.loom.prefix_tokens", prefix, 2);
        cJSON *tmpl = cJSON_GetObjectItem(c->tok_config, "chat_template");
        if (cJSON_IsString(tmpl))
            loom_gguf_set_str(c->w, "tokenizer.chat_template", tmpl->valuestring);
    }
    for (int32_t i = 0; pads && i < n_vocab; i++)
        free(pads[i]);
    free(pads), free(tokens), free(scores), free(types);
    if (rc)
        return rc;
    stop_tokens(c);
    c->total = 3 + 7 * n_layer;
    if (add(c, "transformer.embedding.word_embeddings.weight", "token_embd.weight", 0, AS_STORED) ||
        add(c, "transformer.encoder.final_layernorm.weight", "output_norm.weight", 0, AS_STORED) ||
        add(c, "transformer.output_layer.weight", "output.weight", 0, AS_STORED))
        return -1;
    for (int l = 0; l < n_layer; l++) {
#define ADD(hf, gg, opt)                                                                       \
    if (add_layer(c, "transformer.encoder.layers", l, hf, gg, opt, AS_STORED))                \
        return -1
        ADD("input_layernorm.weight", "attn_norm.weight", 0);
        ADD("self_attention.query_key_value.weight", "attn_qkv.weight", 0);
        ADD("self_attention.query_key_value.bias", "attn_qkv.bias", 1);
        ADD("self_attention.dense.weight", "attn_output.weight", 0);
        ADD("post_attention_layernorm.weight", "ffn_norm.weight", 0);
        ADD("mlp.dense_h_to_4h.weight", "ffn_up.weight", 0);
        ADD("mlp.dense_4h_to_h.weight", "ffn_down.weight", 0);
#undef ADD
    }
    return 0;
}

/* ChatGLM-6B, the first version (model_type "chatglm" with position_encoding_2d): loom's
 * "chatglm1" convention (docs/gguf.md), the tokenizer from ice_text.model. */
static int chatglm1(conv *c)
{
    cJSON *cf = c->config;
    int32_t n_embd = (int32_t)num(cf, "hidden_size", 0), n_layer = (int32_t)num(cf, "num_layers", 0);
    int32_t n_head = (int32_t)num(cf, "num_attention_heads", 0);
    int32_t n_ff = (int32_t)num(cf, "inner_hidden_size", 4 * n_embd);
    if (n_embd <= 0 || n_layer <= 0 || n_head <= 0 || n_ff <= 0 || n_embd % n_head)
        return fail(c, "%s/config.json: hidden_size, num_layers and num_attention_heads must be "
                       "positive, and hidden_size a multiple of the heads", c->dir);
    loom_gguf_set_str(c->w, "general.architecture", "chatglm1");
    const char *slash = strrchr(c->dir, '/');
    loom_gguf_set_str(c->w, "general.name", slash && slash[1] ? slash + 1 : c->dir);
    loom_gguf_set_u32(c->w, "chatglm1.context_length", (uint32_t)num(cf, "max_sequence_length", 2048));
    loom_gguf_set_u32(c->w, "chatglm1.embedding_length", (uint32_t)n_embd);
    loom_gguf_set_u32(c->w, "chatglm1.block_count", (uint32_t)n_layer);
    loom_gguf_set_u32(c->w, "chatglm1.feed_forward_length", (uint32_t)n_ff);
    loom_gguf_set_u32(c->w, "chatglm1.attention.head_count", (uint32_t)n_head);
    loom_gguf_set_f32(c->w, "chatglm1.attention.layer_norm_epsilon", (float)num(cf, "layernorm_epsilon", 1e-5));
    loom_gguf_set_f32(c->w, "chatglm1.rope.freq_base", 10000.0f);
    /* Hugging Face's GLMBlock never receives the real layer count: alpha is 28 layers' */
    loom_gguf_set_f32(c->w, "chatglm1.residual_scale", (float)sqrt(2.0 * 28));
    if (any_tokenizer(c) != 0)
        return -1;
    stop_tokens(c);
    int tied = !loom_safetensors_find(&c->st, "lm_head.weight");
    c->total = 4 + 12 * n_layer;
    if (add(c, "transformer.word_embeddings.weight", "token_embd.weight", 0, AS_STORED) ||
        add(c, "transformer.final_layernorm.weight", "output_norm.weight", 0, AS_STORED) ||
        add(c, "transformer.final_layernorm.bias", "output_norm.bias", 0, AS_STORED) ||
        add(c, tied ? "transformer.word_embeddings.weight" : "lm_head.weight", "output.weight", 0,
            AS_STORED))
        return -1;
    row_order qkv = {ROWS_QKV_PER_HEAD, n_head};
    for (int l = 0; l < n_layer; l++) {
#define ADD(hf, gg, order)                                                                     \
    if (add_layer(c, "transformer.layers", l, hf, gg, 0, order))                              \
        return -1
        ADD("input_layernorm.weight", "attn_norm.weight", AS_STORED);
        ADD("input_layernorm.bias", "attn_norm.bias", AS_STORED);
        ADD("attention.query_key_value.weight", "attn_qkv.weight", qkv);
        ADD("attention.query_key_value.bias", "attn_qkv.bias", qkv);
        ADD("attention.dense.weight", "attn_output.weight", AS_STORED);
        ADD("attention.dense.bias", "attn_output.bias", AS_STORED);
        ADD("post_attention_layernorm.weight", "ffn_norm.weight", AS_STORED);
        ADD("post_attention_layernorm.bias", "ffn_norm.bias", AS_STORED);
        ADD("mlp.dense_h_to_4h.weight", "ffn_up.weight", AS_STORED);
        ADD("mlp.dense_h_to_4h.bias", "ffn_up.bias", AS_STORED);
        ADD("mlp.dense_4h_to_h.weight", "ffn_down.weight", AS_STORED);
        ADD("mlp.dense_4h_to_h.bias", "ffn_down.bias", AS_STORED);
#undef ADD
    }
    return 0;
}

int loom_convert(const char *dir, const char *out, const char *type,
                 loom_convert_progress_fn progress, void *user, char *err, size_t err_size)
{
    conv c = {.dir = dir, .type = type ? type : "auto", .progress = progress, .user = user,
              .err = err, .err_size = err_size};
    loom_dtype dummy;
    if (strcmp(c.type, "auto") != 0 && loom_parse_weight_type(c.type, &dummy) != 0) {
        snprintf(err, err_size, "--type %s is not one of f32, f16, bf16, q8_0, q4_0, q4_1", c.type);
        return -1;
    }
    int rc = -1;
    if (!(c.config = read_json(dir, "config.json", 1, &c)))
        goto done;
    c.tok_config = read_json(dir, "tokenizer_config.json", 0, &c);
    if (loom_safetensors_open(&c.st, dir, err, err_size) != 0)
        goto done;
    if (!(c.w = loom_gguf_writer_create())) {
        fail(&c, "out of memory");
        goto done;
    }
    cJSON *mt = cJSON_GetObjectItem(c.config, "model_type");
    const char *model_type = cJSON_IsString(mt) ? mt->valuestring : "";
    if (strcmp(model_type, "llama") == 0 || strcmp(model_type, "qwen2") == 0)
        rc = decoder(&c, model_type);
    else if (strcmp(model_type, "chatglm") == 0 &&
             (cJSON_GetObjectItem(c.config, "position_encoding_2d") ||
              cJSON_GetObjectItem(c.config, "inner_hidden_size")))
        rc = chatglm1(&c);
    else if (strcmp(model_type, "chatglm") == 0)
        rc = chatglm(&c);
    else
        fail(&c, "%s: model_type '%s' cannot be converted yet (loom converts: llama, qwen2, "
                 "chatglm)", dir, model_type[0] ? model_type : "(none)");
    if (rc == 0)
        rc = loom_gguf_write(c.w, out, err, err_size);
done:
    for (int i = 0; i < c.n_owned; i++)
        free(c.owned[i]);
    free(c.owned);
    loom_gguf_writer_free(c.w);
    loom_spm_model_free(&c.spm);
    loom_safetensors_close(&c.st);
    cJSON_Delete(c.config);
    cJSON_Delete(c.tok_config);
    return rc;
}

int loom_convert_tokenizer(const char *dir, const char *out, char *err, size_t err_size)
{
    conv c = {.dir = dir, .type = "auto", .err = err, .err_size = err_size};
    c.config = read_json(dir, "config.json", 0, &c);
    c.tok_config = read_json(dir, "tokenizer_config.json", 0, &c);
    int rc = -1;
    if ((c.w = loom_gguf_writer_create())) {
        loom_gguf_set_str(c.w, "general.architecture", "tokenizer");
        rc = any_tokenizer(&c);
        if (rc == 0)
            rc = loom_gguf_write(c.w, out, err, err_size);
    } else {
        fail(&c, "out of memory");
    }
    loom_gguf_writer_free(c.w);
    loom_spm_model_free(&c.spm);
    cJSON_Delete(c.config);
    cJSON_Delete(c.tok_config);
    return rc;
}

int loom_is_model_dir(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

/* A folder converted into an anonymous in-memory file; returns its /proc path in out. */
int loom_convert_in_memory(const char *dir, char *out, size_t out_size,
                           loom_convert_progress_fn progress, void *user, char *err,
                           size_t err_size)
{
    int fd = memfd_create("loom-model.gguf", 0);
    if (fd < 0) {
        snprintf(err, err_size, "cannot make an in-memory file: %s", strerror(errno));
        return -1;
    }
    snprintf(out, out_size, "/proc/self/fd/%d", fd);
    if (loom_convert(dir, out, "auto", progress, user, err, err_size) != 0) {
        close(fd);
        return -1;
    }
    return fd; /* the caller keeps it open while the model is mapped, then closes it */
}

void loom_progress_bar(void *user, int done, int total, const char *what)
{
    (void)user;
    int width = 30, filled = total > 0 ? done * width / total : width;
    fprintf(stderr, "\rconverting [%.*s%*s] %d/%d %-40.40s", filled,
            "##############################", width - filled, "", done, total, what);
    if (done == total)
        fprintf(stderr, "\n");
}

int loom_quantize(const char *in, const char *out, const char *type,
                  loom_convert_progress_fn progress, void *user, char *err, size_t err_size)
{
    loom_dtype target;
    if (!type || loom_parse_weight_type(type, &target) != 0) {
        snprintf(err, err_size, "type %s is not one of f32, f16, bf16, q8_0, q4_0, q4_1",
                 type ? type : "(none)");
        return -1;
    }
    loom_gguf g;
    if (loom_gguf_open(&g, in, err, err_size) != 0)
        return -1;
    loom_gguf_writer *w = loom_gguf_writer_create();
    void **owned = calloc(g.n_tensors + 1, sizeof *owned);
    int rc = w && owned ? 0 : -1;
    if (rc)
        snprintf(err, err_size, "out of memory");
    for (uint64_t i = 0; rc == 0 && i < g.n_kv; i++)
        if (strcmp(g.kv[i].key, "general.alignment") != 0 && loom_gguf_copy_kv(w, &g, &g.kv[i]))
            rc = -1, snprintf(err, err_size, "out of memory copying metadata");
    for (uint64_t i = 0; rc == 0 && i < g.n_tensors; i++) {
        const loom_gguf_tensor *t = &g.tensors[i];
        const void *src = loom_gguf_tensor_data(&g, t);
        loom_dtype from = (loom_dtype)t->type;
        int is_float = t->type == LOOM_F32 || t->type == LOOM_F16 || t->type == LOOM_BF16;
        int64_t rows = t->ne[1] * t->ne[2] * t->ne[3], cols = t->ne[0];
        int convert = is_float && t->n_dims >= 2 && (int)from != (int)target &&
                      !(loom_dtype_block_elems(target) > 1 && cols % LOOM_QK);
        if (t->n_dims >= 2 && !convert && (int)from != (int)target)
            fprintf(stderr, "note: %s stays %s (%s)\n", t->name, loom_ggml_type_name(t->type),
                    !is_float ? "already quantised; loom does not requantise"
                              : "rows are not whole blocks");
        const void *data = src;
        uint32_t out_type = t->type;
        if (convert) {
            int64_t rb = loom_row_bytes(target, cols);
            unsigned char *dst = malloc((size_t)(rb * rows));
            float *row = malloc((size_t)cols * sizeof *row);
            if (!dst || !row) {
                free(dst), free(row);
                rc = -1;
                snprintf(err, err_size, "out of memory quantising %s", t->name);
                break;
            }
            int64_t sb = loom_row_bytes(from, cols);
            for (int64_t r = 0; r < rows; r++) {
                loom_row_to_f32(from, (const unsigned char *)src + r * sb, row, cols);
                loom_row_from_f32(target, row, dst + r * rb, cols);
            }
            free(row);
            owned[i] = dst;
            data = dst;
            out_type = target;
        }
        if (loom_gguf_add_tensor(w, t->name, out_type, t->n_dims, t->ne, data) != 0) {
            rc = -1;
            snprintf(err, err_size, "cannot add %s", t->name);
        }
        if (progress)
            progress(user, (int)i + 1, (int)g.n_tensors, t->name);
    }
    if (rc == 0)
        rc = loom_gguf_write(w, out, err, err_size);
    for (uint64_t i = 0; owned && i < g.n_tensors; i++)
        free(owned[i]);
    free(owned);
    loom_gguf_writer_free(w);
    loom_gguf_close(&g);
    return rc;
}
