/*
 * api/convert.c - Hugging Face folder -> GGUF: `loom convert`, and the in-memory conversion
 * that lets `loom run -m FOLDER` and `loom inspect FOLDER` take a folder directly.
 *
 * Llama family (model_type "llama"): names and keys follow the convention llama.cpp uses for
 * GGUF "llama" files, so the result loads there too; Q and K rows are permuted from Hugging
 * Face's rotate-half order into the adjacent-pair order that convention expects. Norms and
 * other 1-D tensors stay f32; a matrix whose rows are not whole blocks stays f32 (with a
 * note) when a block type is asked for. Tokenizer files are read by convert_tokenizer.c.
 */
#define _GNU_SOURCE
#include "convert.h"

#include <errno.h>
#include <stdarg.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>


int conv_fail(conv *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, c->err_size, fmt, ap);
    va_end(ap);
    return -1;
}

char *loom_strf(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char *s = NULL;
    if (vasprintf(&s, fmt, ap) < 0)
        s = NULL;
    va_end(ap);
    return s;
}

cJSON *conv_read_json(const char *dir, const char *name, int required, conv *c)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f) {
        if (required)
            conv_fail(c, "%s: %s (is this a Hugging Face model folder?)", path, strerror(errno));
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
        conv_fail(c, "%s: not valid JSON", path);
    return j;
}

double conv_num(cJSON *o, const char *key, double fallback)
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
        return conv_fail(c, "%s: the weights have no tensor '%s'", c->dir, src);
    }
    if (t->loom_type < 0 || t->n_dims < 1 || t->n_dims > 2)
        return conv_fail(c, "%s: tensor '%s' is %s with %d dimensions; loom converts f32/f16/bf16 "
                       "vectors and matrices", c->dir, src, t->dtype, t->n_dims);
    int64_t rows = t->n_dims == 2 ? t->shape[0] : 1, cols = t->shape[t->n_dims - 1];
    int64_t units = rows == 1 ? cols : rows;
    if ((order.kind == ROWS_ROPE_PAIRS && (units % order.heads || (units / order.heads) % 2)) ||
        (order.kind == ROWS_QKV_PER_HEAD && units % (3 * order.heads)))
        return conv_fail(c, "%s: '%s' has %lld rows, not a whole number of heads", c->dir, src,
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
        return conv_fail(c, "out of memory converting '%s'", src);
    }
    for (int64_t r = 0; r < rows; r++)
        loom_row_from_f32(out_type, f + r * cols, data + r * rb, cols);
    free(f);
    int64_t ne[2] = {cols, rows};
    if (loom_gguf_add_tensor(c->w, dst, out_type, (uint32_t)t->n_dims, ne, data) != 0)
        return conv_fail(c, "cannot add '%s'", dst);
    c->done++;
    if (c->progress)
        c->progress(c->user, c->done, c->total, dst);
    return 0;
}

/* general.architecture, and general.name from the folder's name. */
static void set_identity(conv *c, const char *arch)
{
    loom_gguf_set_str(c->w, "general.architecture", arch);
    const char *slash = strrchr(c->dir, '/');
    loom_gguf_set_str(c->w, "general.name", slash && slash[1] ? slash + 1 : c->dir);
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

/* The Llama-shaped decoders: llama (SentencePiece, Q/K permuted), qwen2 (byte-level BPE, q/k/v
 * biases, rotate-half order kept) and qwen3 (as qwen2, biases only with attention_bias, plus a
 * per-head RMSNorm of Q and K: q_norm / k_norm). */
static int decoder(conv *c, const char *arch)
{
    cJSON *cf = c->config;
    int32_t n_embd = (int32_t)conv_num(cf, "hidden_size", 0), n_layer = (int32_t)conv_num(cf, "num_hidden_layers", 0);
    int32_t n_head = (int32_t)conv_num(cf, "num_attention_heads", 0);
    int32_t n_kv = (int32_t)conv_num(cf, "num_key_value_heads", n_head);
    int32_t n_ff = (int32_t)conv_num(cf, "intermediate_size", 0);
    if (n_embd <= 0 || n_layer <= 0 || n_head <= 0 || n_kv <= 0 || n_ff <= 0)
        return conv_fail(c, "%s/config.json: hidden_size, num_hidden_layers, num_attention_heads and "
                       "intermediate_size must be positive", c->dir);
    int32_t hd = (int32_t)conv_num(cf, "head_dim", n_embd / n_head);
    int qwen = !strcmp(arch, "qwen2") || !strcmp(arch, "qwen3"), qwen3 = !strcmp(arch, "qwen3");
    char key[128];
#define KEY(suffix) (snprintf(key, sizeof key, "%s.%s", arch, suffix), key)
    set_identity(c, arch);
    loom_gguf_set_u32(c->w, KEY("context_length"), (uint32_t)conv_num(cf, "max_position_embeddings", 2048));
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
    loom_gguf_set_f32(c->w, KEY("attention.layer_norm_rms_epsilon"), (float)conv_num(cf, "rms_norm_eps", 1e-5));
    loom_gguf_set_f32(c->w, KEY("rope.freq_base"), (float)conv_num(cf, "rope_theta", 10000.0));
    cJSON *rs = cJSON_GetObjectItem(cf, "rope_scaling");
    if (cJSON_IsObject(rs)) {
        cJSON *type = cJSON_GetObjectItem(rs, "type");
        if (!type)
            type = cJSON_GetObjectItem(rs, "rope_type");
        if (!cJSON_IsString(type) || strcmp(type->valuestring, "linear") != 0)
            return conv_fail(c, "%s/config.json: rope_scaling type '%s' is not supported (linear is)",
                        c->dir, cJSON_IsString(type) ? type->valuestring : "?");
        loom_gguf_set_str(c->w, KEY("rope.scaling.type"), "linear");
        loom_gguf_set_f32(c->w, KEY("rope.scaling.factor"), (float)conv_num(rs, "factor", 1.0));
    }
#undef KEY
    if (conv_tokenizer(c))
        return -1;
    conv_stop_tokens(c);
    int has_bias = loom_safetensors_find(&c->st, "model.layers.0.self_attn.q_proj.bias") != NULL;
    c->total = 2 + (loom_safetensors_find(&c->st, "lm_head.weight") != NULL) +
               (9 + 3 * has_bias + 2 * qwen3) * n_layer;
    if (add(c, "model.embed_tokens.weight", "token_embd.weight", 0, AS_STORED) ||
        add(c, "model.norm.weight", "output_norm.weight", 0, AS_STORED) ||
        add(c, "lm_head.weight", "output.weight", 1, AS_STORED))
        return -1;
    for (int l = 0; l < n_layer; l++) {
#define ADD(hf, gg, perm)                                                                      \
    if (add_layer(c, "model.layers", l, hf, gg, 0, rope_pairs(perm)))                         \
        return -1
        ADD("input_layernorm.weight", "attn_norm.weight", 0);
        ADD("self_attn.q_proj.weight", "attn_q.weight", qwen ? 0 : n_head);
        ADD("self_attn.k_proj.weight", "attn_k.weight", qwen ? 0 : n_kv);
        ADD("self_attn.v_proj.weight", "attn_v.weight", 0);
        if (qwen3) {
            ADD("self_attn.q_norm.weight", "attn_q_norm.weight", 0);
            ADD("self_attn.k_norm.weight", "attn_k_norm.weight", 0);
        }
        if (has_bias) {
            if (!qwen)
                return conv_fail(c, "%s: Llama q/k/v biases are not supported", c->dir);
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

/* Qwen v1 (model_type "qwen", QWenLMHeadModel): llama.cpp's "qwen" names. The config counts
 * intermediate_size over w1 and w2 together (22016 for Qwen-7B's two halves of 11008); the MLP
 * is c_proj(w1(x) * silu(w2(x))), so w2 is the gate. use_dynamic_ntk and use_logn_attn change
 * nothing until a sequence passes seq_length, which loom's context length is capped at. */
static int qwen1(conv *c)
{
    cJSON *cf = c->config;
    int32_t n_embd = (int32_t)conv_num(cf, "hidden_size", 0), n_layer = (int32_t)conv_num(cf, "num_hidden_layers", 0);
    int32_t n_head = (int32_t)conv_num(cf, "num_attention_heads", 0);
    int32_t n_ff2 = (int32_t)conv_num(cf, "intermediate_size", 0);
    int32_t hd = (int32_t)conv_num(cf, "kv_channels", n_head > 0 ? n_embd / n_head : 0);
    double pct = conv_num(cf, "rotary_pct", 1.0);
    int32_t n_rot = (int32_t)(hd * pct);
    if (n_embd <= 0 || n_layer <= 0 || n_head <= 0 || hd <= 0 || n_ff2 <= 0 || n_ff2 % 2)
        return conv_fail(c, "%s/config.json: hidden_size, num_hidden_layers, num_attention_heads, "
                       "kv_channels and an even intermediate_size must be positive", c->dir);
    if (n_rot <= 0 || n_rot % 2 || n_rot > hd)
        return conv_fail(c, "%s/config.json: rotary_pct %g of kv_channels %d is not an even "
                       "number of dimensions", c->dir, pct, hd);
    set_identity(c, "qwen");
    loom_gguf_set_u32(c->w, "qwen.context_length",
                      (uint32_t)conv_num(cf, "seq_length", conv_num(cf, "max_position_embeddings", 2048)));
    loom_gguf_set_u32(c->w, "qwen.embedding_length", (uint32_t)n_embd);
    loom_gguf_set_u32(c->w, "qwen.block_count", (uint32_t)n_layer);
    /* GGUF's qwen convention (llama.cpp's converter and loader): both halves counted */
    loom_gguf_set_u32(c->w, "qwen.feed_forward_length", (uint32_t)n_ff2);
    loom_gguf_set_u32(c->w, "qwen.attention.head_count", (uint32_t)n_head);
    loom_gguf_set_u32(c->w, "qwen.attention.head_count_kv", (uint32_t)n_head);
    if (hd != n_embd / n_head) {
        loom_gguf_set_u32(c->w, "qwen.attention.key_length", (uint32_t)hd);
        loom_gguf_set_u32(c->w, "qwen.attention.value_length", (uint32_t)hd);
    }
    loom_gguf_set_u32(c->w, "qwen.rope.dimension_count", (uint32_t)n_rot);
    loom_gguf_set_f32(c->w, "qwen.rope.freq_base", (float)conv_num(cf, "rotary_emb_base", 10000.0));
    loom_gguf_set_f32(c->w, "qwen.attention.layer_norm_rms_epsilon",
                      (float)conv_num(cf, "layer_norm_epsilon", 1e-6));
    if (conv_tokenizer(c))
        return -1;
    conv_stop_tokens(c);
    c->total = 3 + 8 * n_layer;
    if (add(c, "transformer.wte.weight", "token_embd.weight", 0, AS_STORED) ||
        add(c, "transformer.ln_f.weight", "output_norm.weight", 0, AS_STORED) ||
        add(c, "lm_head.weight", "output.weight", 1, AS_STORED))
        return -1;
    for (int l = 0; l < n_layer; l++) {
        static const char *const names[][2] = {
            {"ln_1.weight", "attn_norm.weight"},       {"attn.c_attn.weight", "attn_qkv.weight"},
            {"attn.c_attn.bias", "attn_qkv.bias"},     {"attn.c_proj.weight", "attn_output.weight"},
            {"ln_2.weight", "ffn_norm.weight"},        {"mlp.w1.weight", "ffn_up.weight"},
            {"mlp.w2.weight", "ffn_gate.weight"},      {"mlp.c_proj.weight", "ffn_down.weight"}};
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
            if (add_layer(c, "transformer.h", l, names[i][0], names[i][1], 0, AS_STORED))
                return -1;
    }
    return 0;
}

static int chatglm_tensors(conv *c, int32_t n_layer);

/* ChatGLM2/3 and GLM-4 (model_type "chatglm"): llama.cpp's "chatglm" names. ChatGLM2/3: the
 * SentencePiece model plus the nine special tokens the ChatGLM tokenizer appends after its
 * pieces, "[gMASK] sop" as the prefix every prompt starts with (tokenizer.loom.prefix_tokens);
 * GLM-4: tiktoken ranks (convert_tokenizer.c). */
static int chatglm(conv *c)
{
    cJSON *cf = c->config;
    int32_t n_embd = (int32_t)conv_num(cf, "hidden_size", 0), n_layer = (int32_t)conv_num(cf, "num_layers", 0);
    int32_t n_head = (int32_t)conv_num(cf, "num_attention_heads", 0);
    int32_t n_kv = cJSON_IsTrue(cJSON_GetObjectItem(cf, "multi_query_attention"))
                       ? (int32_t)conv_num(cf, "multi_query_group_num", 1)
                       : n_head;
    int32_t n_ff = (int32_t)conv_num(cf, "ffn_hidden_size", 0);
    int32_t hd = (int32_t)conv_num(cf, "kv_channels", n_head > 0 ? n_embd / n_head : 0);
    if (n_embd <= 0 || n_layer <= 0 || n_head <= 0 || n_kv <= 0 || n_ff <= 0 || hd <= 0)
        return conv_fail(c, "%s/config.json: hidden_size, num_layers, num_attention_heads, "
                       "kv_channels and ffn_hidden_size must be positive", c->dir);
    if (!cJSON_IsTrue(cJSON_GetObjectItem(cf, "rmsnorm")))
        return conv_fail(c, "%s: a ChatGLM with LayerNorm but without ChatGLM-6B's config keys "
                       "(position_encoding_2d, inner_hidden_size): loom does not know it", c->dir);
    set_identity(c, "chatglm");
    loom_gguf_set_u32(c->w, "chatglm.context_length", (uint32_t)conv_num(cf, "seq_length", 8192));
    loom_gguf_set_u32(c->w, "chatglm.embedding_length", (uint32_t)n_embd);
    loom_gguf_set_u32(c->w, "chatglm.block_count", (uint32_t)n_layer);
    loom_gguf_set_u32(c->w, "chatglm.feed_forward_length", (uint32_t)n_ff);
    loom_gguf_set_u32(c->w, "chatglm.attention.head_count", (uint32_t)n_head);
    loom_gguf_set_u32(c->w, "chatglm.attention.head_count_kv", (uint32_t)n_kv);
    loom_gguf_set_u32(c->w, "chatglm.attention.key_length", (uint32_t)hd);
    loom_gguf_set_u32(c->w, "chatglm.rope.dimension_count", (uint32_t)(hd / 2));
    loom_gguf_set_f32(c->w, "chatglm.rope.freq_base", (float)(10000.0 * conv_num(cf, "rope_ratio", 1.0)));
    loom_gguf_set_f32(c->w, "chatglm.attention.layer_norm_rms_epsilon",
                      (float)conv_num(cf, "layernorm_epsilon", 1e-5));

    if (conv_is_tiktoken_dir(c)) { /* GLM-4: tiktoken ranks and its own specials */
        if (conv_tokenizer(c) != 0)
            return -1;
        conv_stop_tokens(c);
        return chatglm_tensors(c, n_layer);
    }
    /* ChatGLM2/3's tokenizer: the pieces, then the specials ChatGLM's tokenizer appends */
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.model", c->dir);
    if (loom_spm_model_read(&c->spm, path, c->err, c->err_size) != 0)
        return -1;
    static const char *const specials[] = {"[MASK]", "[gMASK]", "[sMASK]", "sop", "eop",
                                           "<|system|>", "<|user|>", "<|assistant|>",
                                           "<|observation|>"};
    int32_t n_sp = c->spm.n, n_vocab = (int32_t)conv_num(cf, "padded_vocab_size", n_sp + 9);
    if (n_vocab < n_sp + 9)
        n_vocab = n_sp + 9;
    const char **tokens = calloc((size_t)n_vocab, sizeof *tokens);
    float *scores = calloc((size_t)n_vocab, sizeof *scores);
    int32_t *types = calloc((size_t)n_vocab, sizeof *types);
    char **pads = calloc((size_t)n_vocab, sizeof *pads);
    int rc = tokens && scores && types && pads ? 0 : conv_fail(c, "out of memory");
    for (int32_t i = 0; rc == 0 && i < n_vocab; i++) {
        if (i < n_sp) {
            tokens[i] = c->spm.pieces[i], scores[i] = c->spm.scores[i], types[i] = c->spm.types[i];
        } else if (i < n_sp + 9) {
            tokens[i] = specials[i - n_sp], types[i] = 3;
        } else {
            if (!(pads[i] = loom_strf("[PAD%d]", i)))
                rc = conv_fail(c, "out of memory");
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
        loom_gguf_set_u32(c->w, "tokenizer.ggml.eos_token_id", (uint32_t)conv_num(cf, "eos_token_id", 2));
        loom_gguf_set_bool(c->w, "tokenizer.ggml.add_bos_token", 0);
        loom_gguf_set_bool(c->w, "tokenizer.ggml.add_space_prefix", c->spm.add_dummy_prefix);
        conv_spm_normalizer(c);
        loom_gguf_set_bool(c->w, "tokenizer.loom.strip_special", 0); /* encode_special_tokens */
        loom_gguf_set_i32_array(c->w, "tokenizer.loom.prefix_tokens", prefix, 2);
        /* in a user's text ChatGLM's tokenizer reads its role tokens, and only when
         * tokenizer_config.json says encode_special_tokens (ChatGLM3's does); [gMASK], sop and
         * the like never come from text */
        int32_t roles[4] = {n_sp + 5, n_sp + 6, n_sp + 7, n_sp + 8};
        int by_text = cJSON_IsTrue(cJSON_GetObjectItem(c->tok_config, "encode_special_tokens"));
        loom_gguf_set_i32_array(c->w, "tokenizer.loom.text_specials", roles, by_text ? 4 : 0);
        cJSON *tmpl = cJSON_GetObjectItem(c->tok_config, "chat_template");
        if (cJSON_IsString(tmpl))
            loom_gguf_set_str(c->w, "tokenizer.chat_template", tmpl->valuestring);
    }
    for (int32_t i = 0; pads && i < n_vocab; i++)
        free(pads[i]);
    free(pads), free(tokens), free(scores), free(types);
    if (rc)
        return rc;
    conv_stop_tokens(c);
    return chatglm_tensors(c, n_layer);
}

/* ChatGLM2/3 and GLM-4 name their tensors alike */
static int chatglm_tensors(conv *c, int32_t n_layer)
{
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
    int32_t n_embd = (int32_t)conv_num(cf, "hidden_size", 0), n_layer = (int32_t)conv_num(cf, "num_layers", 0);
    int32_t n_head = (int32_t)conv_num(cf, "num_attention_heads", 0);
    int32_t n_ff = (int32_t)conv_num(cf, "inner_hidden_size", 4 * n_embd);
    if (n_embd <= 0 || n_layer <= 0 || n_head <= 0 || n_ff <= 0 || n_embd % n_head)
        return conv_fail(c, "%s/config.json: hidden_size, num_layers and num_attention_heads must be "
                       "positive, and hidden_size a multiple of the heads", c->dir);
    set_identity(c, "chatglm1");
    loom_gguf_set_u32(c->w, "chatglm1.context_length", (uint32_t)conv_num(cf, "max_sequence_length", 2048));
    loom_gguf_set_u32(c->w, "chatglm1.embedding_length", (uint32_t)n_embd);
    loom_gguf_set_u32(c->w, "chatglm1.block_count", (uint32_t)n_layer);
    loom_gguf_set_u32(c->w, "chatglm1.feed_forward_length", (uint32_t)n_ff);
    loom_gguf_set_u32(c->w, "chatglm1.attention.head_count", (uint32_t)n_head);
    loom_gguf_set_f32(c->w, "chatglm1.attention.layer_norm_epsilon", (float)conv_num(cf, "layernorm_epsilon", 1e-5));
    loom_gguf_set_f32(c->w, "chatglm1.rope.freq_base", 10000.0f);
    /* Hugging Face's GLMBlock never receives the real layer count: alpha is 28 layers' */
    loom_gguf_set_f32(c->w, "chatglm1.residual_scale", (float)sqrt(2.0 * 28));
    if (conv_tokenizer(c) != 0)
        return -1;
    conv_stop_tokens(c);
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
        if (loom_quant_mix_find(c.type) < 0) {
            snprintf(err, err_size, "--type %s is not auto or one of %s", c.type,
                     loom_quant_mix_names());
            return -1;
        }
        /* a type convert does not write itself (the ABI 1.2 types, the mixes): convert as
         * stored into a file beside out, then quantise that, as `loom quantize` would */
        char *tmp = loom_strf("%s.converting-XXXXXX", out);
        int fd = tmp ? mkstemp(tmp) : -1;
        if (fd < 0) {
            snprintf(err, err_size, "%s: cannot create a file beside it: %s", out,
                     tmp ? strerror(errno) : "out of memory");
            free(tmp);
            return -1;
        }
        close(fd);
        /* a type (q5_0, q6_k, ...) is every matrix that type, as --type q4_0 always was; a
         * _S/_M/_L or q2_k mix is llama.cpp's mix */
        int mix = loom_quant_mix_find(c.type);
        int rc = loom_convert(dir, tmp, "auto", progress, user, err, err_size);
        if (rc == 0)
            rc = loom_quantize_opts(tmp, out, c.type,
                                    loom_quant_mix_is_plain(mix) ? LOOM_QUANTIZE_PURE : 0,
                                    progress, user, err, err_size);
        unlink(tmp);
        free(tmp);
        return rc;
    }
    int rc = -1;
    if (!(c.config = conv_read_json(dir, "config.json", 1, &c)))
        goto done;
    c.tok_config = conv_read_json(dir, "tokenizer_config.json", 0, &c);
    if (loom_safetensors_open(&c.st, dir, err, err_size) != 0)
        goto done;
    if (!(c.w = loom_gguf_writer_create())) {
        conv_fail(&c, "out of memory");
        goto done;
    }
    cJSON *mt = cJSON_GetObjectItem(c.config, "model_type");
    const char *model_type = cJSON_IsString(mt) ? mt->valuestring : "";
    if (strcmp(model_type, "llama") == 0 || strcmp(model_type, "qwen2") == 0 ||
        strcmp(model_type, "qwen3") == 0)
        rc = decoder(&c, model_type);
    else if (strcmp(model_type, "qwen") == 0)
        rc = qwen1(&c);
    else if (strcmp(model_type, "chatglm") == 0 &&
             (cJSON_GetObjectItem(c.config, "position_encoding_2d") ||
              cJSON_GetObjectItem(c.config, "inner_hidden_size")))
        rc = chatglm1(&c);
    else if (strcmp(model_type, "chatglm") == 0)
        rc = chatglm(&c);
    else
        conv_fail(&c, "%s: model_type '%s' cannot be converted yet (loom converts: llama, qwen, "
                 "qwen2, qwen3, chatglm)", dir, model_type[0] ? model_type : "(none)");
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
    c.config = conv_read_json(dir, "config.json", 0, &c);
    c.tok_config = conv_read_json(dir, "tokenizer_config.json", 0, &c);
    int rc = -1;
    if ((c.w = loom_gguf_writer_create())) {
        loom_gguf_set_str(c.w, "general.architecture", "tokenizer");
        rc = conv_tokenizer(&c);
        if (rc == 0)
            rc = loom_gguf_write(c.w, out, err, err_size);
    } else {
        conv_fail(&c, "out of memory");
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

int loom_open_model_file(const char *path, loom_gguf *g, loom_convert_progress_fn progress,
                         void *user, char *err, size_t err_size)
{
    if (!loom_is_model_dir(path))
        return loom_gguf_open(g, path, err, err_size);
    char mem[64];
    int fd = loom_convert_in_memory(path, mem, sizeof mem, progress, user, err, err_size);
    if (fd < 0)
        return -1;
    int rc = loom_gguf_open(g, mem, err, err_size);
    close(fd); /* the mapping keeps the in-memory file alive */
    return rc;
}

void loom_progress_stderr(void *user, int done, int total, const char *what)
{
    const char *label = user ? (const char *)user : "converting";
    if (!isatty(STDERR_FILENO)) { /* a log: one line per stage, not hundreds of frames */
        if (done == total)
            fprintf(stderr, "%s: %d of %d done\n", label, done, total);
        return;
    }
    int width = 30, filled = total > 0 ? done * width / total : width;
    fprintf(stderr, "\r%s [%.*s%*s] %d/%d %-40.40s", label, filled,
            "##############################", width - filled, "", done, total, what);
    if (done == total)
        fprintf(stderr, "\n");
}
