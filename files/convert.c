/*
 * files/convert.c - Hugging Face folder -> GGUF: `loom convert`, and the in-memory conversion
 * that lets `loom run -m FOLDER` and `loom inspect FOLDER` take a folder directly.
 *
 * One writer for every family: config.json's model_type picks the family (models/), whose
 * tables say which config keys become which hyper-parameters and which tensor becomes which,
 * with what reordering of rows; this file only carries them out. Norms and other 1-D tensors
 * stay f32; a matrix whose rows are not whole blocks stays f32 (with a note) when a block
 * type is asked for. Tokenizer files are read by convert_tokenizer.c.
 */
#define _GNU_SOURCE
#include "files/convert_tokenizer.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

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
    static const loom_dtype all[] = {LOOM_F32,  LOOM_F16,  LOOM_BF16,
                                     LOOM_Q8_0, LOOM_Q4_0, LOOM_Q4_1};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (strcmp(s, loom_dtype_name(all[i])) == 0) {
            *t = all[i];
            return 0;
        }
    return -1;
}

/* How a tensor's rows (a vector's elements) are reordered on the way. */
typedef enum { ROWS_AS_STORED, ROWS_ROPE_PAIRS, ROWS_QKV_PER_HEAD } row_order_kind;
typedef struct row_order {
    row_order_kind kind;
    int heads;
    int k_heads, v_heads, d_v; /* LOOM_HF_V_TILED's shape: ssm.group_count, time_step_rank */
    int d_k;                   /* LOOM_HF_QKVZ_*'s: ssm.state_size */
} row_order;

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

/* Value heads from grouped to tiled (LOOM_HF_V_TILED): the last v_heads units of `unit` rows of
 * f (rows x cols), or with by_columns the columns' units, move so that unit i * k_heads + g
 * holds what unit g * (v_heads / k_heads) + i held. */
static int tile_value_heads(float *f, int64_t rows, int64_t cols, int by_columns, int64_t k_heads,
                            int64_t v_heads, int64_t unit)
{
    const int64_t per = v_heads / k_heads, lines = by_columns ? rows : 1;
    const int64_t width = by_columns ? unit : unit * (rows == 1 ? 1 : cols);
    const int64_t span = (by_columns || rows == 1 ? cols : rows) - v_heads * unit;
    float *tmp = malloc((size_t)(v_heads * width) * sizeof *tmp);
    if (!tmp)
        return -1;
    for (int64_t line = 0; line < lines; line++) {
        float *part = f + line * (by_columns ? cols : 0) + span * (width / unit);
        for (int64_t u = 0; u < v_heads; u++) {
            int64_t from = (u % k_heads) * per + u / k_heads;
            memcpy(tmp + u * width, part + from * width, (size_t)width * sizeof *tmp);
        }
        memcpy(part, tmp, (size_t)(v_heads * width) * sizeof *tmp);
    }
    free(tmp);
    return 0;
}

/* The rows of a fused per-key-head [q; k; v; z] (LOOM_HF_QKVZ_QKV / _Z) that the part keeps,
 * gathered at f's start (f has cols columns): every group's q, then k, then v; or every
 * group's z. */
static int split_qkvz(float *f, int64_t cols, int z_part, const row_order *o)
{
    const int64_t dk = o->d_k, rv = (int64_t)o->v_heads / o->k_heads * o->d_v;
    const int64_t group = 2 * dk + 2 * rv;
    float *tmp = malloc((size_t)(o->k_heads * group * cols) * sizeof *tmp);
    if (!tmp)
        return -1;
    memcpy(tmp, f, (size_t)(o->k_heads * group * cols) * sizeof *tmp);
    int64_t at = 0;
    const int64_t starts[4] = {0, dk, 2 * dk, 2 * dk + rv}, widths[4] = {dk, dk, rv, rv};
    for (int part = z_part ? 3 : 0; part < (z_part ? 4 : 3); part++)
        for (int64_t g = 0; g < o->k_heads; g++, at += widths[part])
            memcpy(f + at * cols, tmp + (g * group + starts[part]) * cols,
                   (size_t)(widths[part] * cols) * sizeof *f);
    free(tmp);
    return 0;
}

/* Adds Hugging Face tensor parts[0] (named src) as GGUF dst; with n_parts > 1, the stack of
 * parts[0..n_parts) (an expert each, of one shape and type) as one [n_parts, rows, cols]. */
static int add(conv *c, const loom_st_tensor *const *parts, int n_parts, const char *src,
               const char *dst, row_order order, unsigned flags)
{
    const loom_st_tensor *t = parts[0];
    int squeeze = (flags & LOOM_HF_SQUEEZE) && t->n_dims == 3 && t->shape[1] == 1;
    if ((flags & LOOM_HF_SQUEEZE) && !squeeze)
        return conv_fail(c,
                         "%s: tensor '%s' has %d dimensions; a [rows, 1, kernel] conv1d "
                         "weight was expected",
                         c->dir, src, t->n_dims);
    if (t->loom_type < 0 || t->n_dims < 1 || (t->n_dims > 2 && !squeeze))
        return conv_fail(c,
                         "%s: tensor '%s' is %s with %d dimensions; loom converts f32/f16/bf16 "
                         "vectors and matrices",
                         c->dir, src, t->dtype, t->n_dims);
    for (int i = 1; i < n_parts; i++)
        if (parts[i]->loom_type != t->loom_type || parts[i]->n_dims != t->n_dims ||
            memcmp(parts[i]->shape, t->shape, (size_t)t->n_dims * sizeof t->shape[0]) != 0)
            return conv_fail(c, "%s: the experts of '%s' differ in shape or type (expert %d)",
                             c->dir, src, i);
    int n_dims = squeeze ? 2 : t->n_dims;
    int64_t rows = n_dims == 2 ? t->shape[0] : 1, cols = t->shape[t->n_dims - 1];
    int64_t units = rows == 1 ? cols : rows;
    if ((order.kind == ROWS_ROPE_PAIRS && (units % order.heads || (units / order.heads) % 2)) ||
        (order.kind == ROWS_QKV_PER_HEAD && units % (3 * order.heads)))
        return conv_fail(c, "%s: '%s' has %lld rows, not a whole number of heads", c->dir, src,
                         (long long)units);
    loom_dtype out_type = LOOM_F32;
    if (n_dims == 2 && !squeeze) {
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
    const int qkvz = flags & (LOOM_HF_QKVZ_QKV | LOOM_HF_QKVZ_Z);
    const int64_t qkvz_rows = order.k_heads > 0 && order.v_heads % order.k_heads == 0
        ? 2 * (int64_t)order.k_heads * order.d_k + 2 * (int64_t)order.v_heads * order.d_v
        : -1;
    if (qkvz && (n_dims != 2 || rows != qkvz_rows))
        return conv_fail(c,
                         "%s: '%s' has %lld rows; in_proj_qkvz of these heads has %lld "
                         "(per key head 2 linear_key_head_dim + 2 linear_value_head_dim x the "
                         "value heads per key head)",
                         c->dir, src, (long long)rows, (long long)qkvz_rows);
    const int64_t src_rows = rows;
    if (qkvz) /* the part kept */
        rows = flags & LOOM_HF_QKVZ_Z
            ? (int64_t)order.v_heads * order.d_v
            : 2 * (int64_t)order.k_heads * order.d_k + (int64_t)order.v_heads * order.d_v;
    const int tiled = (flags & (LOOM_HF_V_TILED | LOOM_HF_V_TILED_COLUMNS)) &&
        order.v_heads != order.k_heads;
    const int64_t tiled_units = flags & LOOM_HF_V_TILED_COLUMNS ? cols : units;
    const int64_t v_unit = tiled_units >= (int64_t)order.v_heads * order.d_v ? order.d_v : 1;
    if (tiled &&
        (order.k_heads <= 0 || order.v_heads % order.k_heads ||
         tiled_units < (int64_t)order.v_heads * v_unit))
        return conv_fail(c, "%s: '%s' has %lld rows or columns, fewer than the %d value heads",
                         c->dir, src, (long long)tiled_units, order.v_heads);
    int64_t rb = loom_row_bytes(out_type, cols);
    unsigned char *data = own(c, (size_t)(rb * rows * n_parts));
    if (!data)
        return conv_fail(c, "out of memory converting '%s'", src);
    for (int i = 0; i < n_parts; i++) {
        float *f = load_f32(parts[i], src_rows, cols, order);
        if (!f || (qkvz && split_qkvz(f, cols, flags & LOOM_HF_QKVZ_Z, &order) != 0) ||
            (tiled &&
             tile_value_heads(f, rows, cols, flags & LOOM_HF_V_TILED_COLUMNS, order.k_heads,
                              order.v_heads, v_unit) != 0)) {
            free(f);
            return conv_fail(c, "out of memory converting '%s'", src);
        }
        for (int64_t k = 0; k < rows * cols && (flags & (LOOM_HF_PLUS_ONE | LOOM_HF_NEG_EXP)); k++)
            f[k] = flags & LOOM_HF_PLUS_ONE ? f[k] + 1.0f : -expf(f[k]);
        for (int64_t r = 0; r < rows; r++)
            loom_row_from_f32(out_type, f + r * cols, data + (i * rows + r) * rb, cols);
        free(f);
    }
    int64_t ne[3] = {cols, rows, n_parts};
    uint32_t dims = n_parts > 1 ? 3 : (uint32_t)n_dims;
    if (loom_gguf_add_tensor(c->w, dst, out_type, dims, ne, data) != 0)
        return conv_fail(c, "cannot add '%s'", dst);
    c->done++;
    if (c->progress)
        c->progress(c->user, c->done, c->total, dst);
    return 0;
}

/* kv_b_proj t as attn_k_b or attn_v_b (LOOM_HF_KV_B_K / _V): heads of nope key and v value
 * rows over kv_lora_rank columns, each head's part a matrix of its own in a [heads, rows, cols]
 * stack. */
static int add_kv_b(conv *c, const loom_st_tensor *t, const char *src, const char *dst,
                    int64_t heads, int64_t nope, int64_t v, unsigned flags)
{
    if (t->n_dims != 2 || t->loom_type < 0 || heads <= 0 || nope <= 0 || v <= 0 ||
        t->shape[0] != heads * (nope + v))
        return conv_fail(c,
                         "%s: '%s' is not kv_b_proj's [heads x (qk_nope_head_dim + v_head_dim), "
                         "kv_lora_rank]: %d dimensions, %lld rows, for %lld heads of %lld + %lld",
                         c->dir, src, t->n_dims, (long long)t->shape[0], (long long)heads,
                         (long long)nope, (long long)v);
    const int64_t C = t->shape[1], per = nope + v;
    const int k_part = (flags & LOOM_HF_KV_B_K) != 0;
    const int64_t rows = k_part ? C : v, cols = k_part ? nope : C; /* of each head's matrix */
    loom_dtype out_type = (loom_dtype)t->loom_type;
    if (strcmp(c->type, "auto") != 0)
        loom_parse_weight_type(c->type, &out_type);
    if (loom_dtype_block_elems(out_type) > 1 && cols % LOOM_QK) {
        fprintf(stderr, "note: %s stays f32: its rows of %lld are not whole blocks of %d\n", dst,
                (long long)cols, LOOM_QK);
        out_type = LOOM_F32;
    }
    const int64_t rb = loom_row_bytes(out_type, cols);
    unsigned char *data = own(c, (size_t)(rb * rows * heads));
    float *f = load_f32(t, t->shape[0], C, (row_order){.kind = ROWS_AS_STORED});
    float *row = malloc((size_t)cols * sizeof *row);
    if (!data || !f || !row) {
        free(f), free(row);
        return conv_fail(c, "out of memory converting '%s'", src);
    }
    for (int64_t h = 0; h < heads; h++)
        for (int64_t r = 0; r < rows; r++) {
            if (k_part) /* column r of K_h */
                for (int64_t i = 0; i < nope; i++)
                    row[i] = f[(h * per + i) * C + r];
            else
                memcpy(row, f + (h * per + nope + r) * C, (size_t)C * sizeof *row);
            loom_row_from_f32(out_type, row, data + (h * rows + r) * rb, cols);
        }
    free(f), free(row);
    int64_t ne[3] = {cols, rows, heads};
    if (loom_gguf_add_tensor(c->w, dst, out_type, 3, ne, data) != 0)
        return conv_fail(c, "cannot add '%s'", dst);
    c->done++;
    if (c->progress)
        c->progress(c->user, c->done, c->total, dst);
    return 0;
}

/* config.json -> the family's hyper-parameters: its table, then its hook. */
static int hyper_parameters(conv *c, loom_hf_values *v)
{
    const loom_family *f = c->family;
    char why[512] = "";
    for (const loom_hf_param *p = f->hf_params; p && p->gguf; p++) {
        int required = p->fallback == LOOM_HF_REQUIRED;
        int64_t n = 0;
        double x = 0;
        int rc = p->kind == LOOM_HF_U32
            ? loom_hf_int(c->config, p->config, required ? 0 : (int64_t)p->fallback, 1, INT32_MAX,
                          &n, why, sizeof why)
            : loom_hf_real(c->config, p->config, p->fallback, 0, HUGE_VAL, &x, why, sizeof why);
        if (rc != 0)
            return conv_fail(c, "%s/config.json: %s (the %s family's %s)", c->dir, why,
                             f->hf_model_type, p->gguf);
        if (p->kind == LOOM_HF_U32)
            x = (double)n;
        if (required && x == 0)
            return conv_fail(c, "%s/config.json: it has no %s (the %s family's %s)", c->dir,
                             p->config, f->hf_model_type, p->gguf);
        loom_hf_set(v, p->gguf, p->kind, x);
    }
    if (f->hf_derive && f->hf_derive(c->config, v, why, sizeof why) != 0)
        return conv_fail(c, "%s/config.json: %s", c->dir, why);
    /* the multi-token-prediction block, where the config has one and the weights hold it (a
     * checkpoint may be published without) */
    c->main_layers = (int)loom_hf_get(v, "block_count");
    int64_t n_mtp = 0; /* -1: the config does not say (Qwen3-Next's): one where it is there */
    if (f->hf_mtp_layers &&
        loom_hf_int(c->config, f->hf_mtp_layers, -1, -1, 64, &n_mtp, why, sizeof why) != 0)
        return conv_fail(c, "%s/config.json: %s", c->dir, why);
    const loom_hf_tensor *mtp = f->hf_tensors;
    while (mtp->hf && !(mtp->flags & LOOM_HF_MTP))
        mtp++;
    const int weights_have = mtp->hf && loom_safetensors_find(&c->st, mtp->hf);
    if (n_mtp < 0)
        n_mtp = weights_have;
    if (n_mtp > 0 && !weights_have) {
        fprintf(stderr,
                "note: config.json has a multi-token-prediction block, the weights do not "
                "(no %s): the file has none, and --draft-mtp will not run on it\n",
                mtp->hf ? mtp->hf : "table entry");
        n_mtp = 0;
    }
    if (n_mtp > 1)
        return conv_fail(c, "%s/config.json: %lld multi-token-prediction blocks; loom converts one",
                         c->dir, (long long)n_mtp);
    if (n_mtp > 0) {
        loom_hf_set(v, "nextn_predict_layers", LOOM_HF_U32, (double)n_mtp);
        loom_hf_set(v, "block_count", LOOM_HF_U32, (double)(c->main_layers + n_mtp));
    }
    /* what the hooks derived is held to the same rule: counts are whole and positive, reals
     * finite and positive (every hyper-parameter loom writes is one of these) */
    for (int i = 0; i < v->n; i++) {
        double x = v->v[i].num;
        if ((v->v[i].kind == LOOM_HF_U32 && !(x >= 1 && x <= INT32_MAX && x == floor(x))) ||
            (v->v[i].kind == LOOM_HF_F32 && !(x > 0 && isfinite(x))))
            return conv_fail(c, "%s/config.json: its keys give %s = %g, which cannot be right",
                             c->dir, v->v[i].key, x);
    }
    /* multimodal RoPE (Qwen3.5's): the pairs of each section, as llama.cpp's 4 i32, 0-padded */
    const cJSON *sections = loom_hf_array(c->config,
                                          "text_config.rope_parameters.mrope_section|"
                                          "rope_parameters.mrope_section|"
                                          "rope_scaling.mrope_section");
    if (sections) {
        int32_t sec[4] = {0};
        int n = cJSON_GetArraySize(sections);
        for (int i = 0; i < n; i++) {
            const cJSON *x = cJSON_GetArrayItem(sections, i);
            if (i >= 4 || !cJSON_IsNumber(x) || x->valuedouble < 0 || x->valuedouble > 65536 ||
                x->valuedouble != floor(x->valuedouble))
                return conv_fail(c,
                                 "%s/config.json: mrope_section must be up to 4 whole numbers "
                                 "of pairs",
                                 c->dir);
            sec[i] = (int32_t)x->valuedouble;
        }
        char *key = loom_strf("%s.rope.dimension_sections", f->arch->name);
        if (!key || loom_gguf_set_i32_array(c->w, key, sec, 4) != 0) {
            free(key);
            return conv_fail(c, "out of memory");
        }
        free(key);
    }
    double n_layer = loom_hf_get(v, "block_count");
    if (n_layer < 1 || n_layer > LOOM_MAX_LAYERS)
        return conv_fail(c, "%s/config.json: %.0f layers; loom runs 1 to %d", c->dir, n_layer,
                         LOOM_MAX_LAYERS);
    const char *arch = f->arch->name;
    loom_gguf_set_str(c->w, "general.architecture", arch);
    const char *slash = strrchr(c->dir, '/');
    loom_gguf_set_str(c->w, "general.name", slash && slash[1] ? slash + 1 : c->dir);
    for (int i = 0; i < v->n; i++) {
        char *key = loom_strf("%s.%s", arch, v->v[i].key);
        if (!key)
            return conv_fail(c, "out of memory");
        if (v->v[i].kind == LOOM_HF_STR)
            loom_gguf_set_str(c->w, key, v->v[i].str);
        else if (v->v[i].kind == LOOM_HF_BOOL)
            loom_gguf_set_bool(c->w, key, v->v[i].num != 0);
        else if (v->v[i].kind == LOOM_HF_F32)
            loom_gguf_set_f32(c->w, key, (float)v->v[i].num);
        else
            loom_gguf_set_u32(c->w, key, (uint32_t)v->v[i].num);
        free(key);
    }
    return 0;
}

/* Entry e of the family's tensor table for layer l (-1: a tensor outside the layers) and
 * expert x (LOOM_HF_EXPERTS entries): the Hugging Face tensor it takes (NULL when absent),
 * its source name, and its GGUF name. */
static const loom_st_tensor *source(conv *c, const loom_hf_tensor *e, int l, int x, char *src,
                                    size_t src_size, char *dst, size_t dst_size)
{
    /* the names are the family's table: a format string only where it says "%d" */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-nonliteral"
    const int hl = e->flags & LOOM_HF_MTP ? l - c->main_layers : l; /* mtp.layers.<hl> */
    snprintf(src, src_size, e->hf, hl, x);
    snprintf(dst, dst_size, e->gguf, l);
    const loom_st_tensor *t = loom_safetensors_find(&c->st, src);
    if (!t && e->instead) {
        snprintf(src, src_size, e->instead, hl);
        t = loom_safetensors_find(&c->st, src);
        if (!t) /* neither: a message names the first */
            snprintf(src, src_size, e->hf, hl, x);
    }
#pragma GCC diagnostic pop
    return t;
}

static int is_per_layer(const loom_hf_tensor *e)
{
    return strstr(e->hf, "%d") != NULL || (e->flags & LOOM_HF_MTP);
}

/* The n experts of entry e in layer l, stacked. */
static int experts(conv *c, const loom_hf_tensor *e, int l, int n, row_order order)
{
    char src[256], dst[256], first[256];
    const loom_st_tensor **parts = n > 0 ? malloc((size_t)n * sizeof *parts) : NULL;
    if (!parts)
        return conv_fail(c, "%s: out of memory (%d experts)", c->dir, n);
    int rc = 0;
    for (int x = 0; x < n && rc == 0; x++) {
        parts[x] = source(c, e, l, x, src, sizeof src, dst, sizeof dst);
        if (x == 0)
            snprintf(first, sizeof first, "%s", src);
        if (!parts[x])
            rc = conv_fail(c, "%s: the weights have no tensor '%s' (num_experts is %d)", c->dir,
                           src, n);
    }
    if (rc == 0)
        rc = add(c, parts, n, first, dst, order, e->flags);
    free(parts);
    return rc;
}

/* The experts of entry e as one stacked tensor t [experts, rows, cols] (its `instead`), or
 * each expert's half of its rows (LOOM_HF_GATE_HALF / LOOM_HF_UP_HALF of a gate_up_proj). */
static int stacked_experts(conv *c, const loom_hf_tensor *e, const loom_st_tensor *t,
                           const char *src, const char *dst, int n, row_order order)
{
    const int half = (e->flags & (LOOM_HF_GATE_HALF | LOOM_HF_UP_HALF)) != 0;
    if (t->n_dims != 3 || t->shape[0] != n || t->loom_type < 0 || (half && t->shape[1] % 2))
        return conv_fail(c,
                         "%s: tensor '%s' is %s [%lld, %lld, %lld] (%d dimensions); a stack of "
                         "num_experts (%d) f32/f16/bf16 matrices%s was expected",
                         c->dir, src, t->dtype, (long long)t->shape[0],
                         (long long)(t->n_dims > 1 ? t->shape[1] : 0),
                         (long long)(t->n_dims > 2 ? t->shape[2] : 0), t->n_dims, n,
                         half ? " of an even number of rows (gate; up)" : "");
    const int64_t rows = half ? t->shape[1] / 2 : t->shape[1], cols = t->shape[2];
    const int64_t first = e->flags & LOOM_HF_UP_HALF ? rows : 0;
    const size_t elem = (size_t)loom_row_bytes((loom_dtype)t->loom_type, 1);
    loom_st_tensor *parts = malloc((size_t)n * sizeof *parts);
    const loom_st_tensor **ptrs = malloc((size_t)n * sizeof *ptrs);
    int rc = parts && ptrs ? 0 : conv_fail(c, "%s: out of memory (%d experts)", c->dir, n);
    for (int x = 0; x < n && rc == 0; x++) { /* each expert's matrix, a view of the stack */
        parts[x] = *t;
        parts[x].n_dims = 2;
        parts[x].shape[0] = rows;
        parts[x].shape[1] = cols;
        parts[x].data = (const unsigned char *)t->data +
            ((size_t)x * (size_t)t->shape[1] + (size_t)first) * (size_t)cols * elem;
        parts[x].size = (uint64_t)(rows * cols) * elem;
        ptrs[x] = &parts[x];
    }
    if (rc == 0)
        rc = add(c, ptrs, n, src, dst, order, e->flags);
    free(parts);
    free(ptrs);
    return rc;
}

/* what the family's config says about entry e, or NULL */
static const loom_hf_condition *condition_of(const loom_family *f, const loom_hf_tensor *e)
{
    for (const loom_hf_condition *k = f->hf_conditions; k && k->hf; k++)
        if (!strcmp(k->hf, e->hf))
            return k;
    return NULL;
}

/* Every tensor of the family's table, outside the layers first, then layer by layer. */
static int tensors(conv *c, const loom_hf_values *v)
{
    const loom_hf_tensor *table = c->family->hf_tensors;
    int n_layer = (int)loom_hf_get(v, "block_count");
    int n_dense = (int)loom_hf_get(v, "leading_dense_block_count");
    int interval = (int)loom_hf_get(v, "full_attention_interval");
    char src[256], dst[256];
    for (int pass = 0; pass < 2; pass++) { /* counting, for the progress, then adding */
        for (int l = -1; l < n_layer; l++)
            for (const loom_hf_tensor *e = table; e->hf; e++) {
                if (is_per_layer(e) != (l >= 0) ||
                    (l >= 0 && !!(e->flags & LOOM_HF_MTP) != (l >= c->main_layers)) ||
                    ((e->flags & LOOM_HF_DENSE_LAYERS) && l >= n_dense) ||
                    ((e->flags & LOOM_HF_SPARSE_LAYERS) && l < n_dense))
                    continue;
                int full_attention = interval > 0 && (l + 1) % interval == 0;
                if (((e->flags & LOOM_HF_LINEAR_LAYERS) && full_attention) ||
                    ((e->flags & LOOM_HF_ATTENTION_LAYERS) && !full_attention))
                    continue;
                const loom_st_tensor *t = source(c, e, l, 0, src, sizeof src, dst, sizeof dst);
                if (e->flags & LOOM_HF_UNSUPPORTED) {
                    if (t)
                        return conv_fail(c, "%s: the weights have '%s': %s", c->dir, src, e->gguf);
                    continue;
                }
                const loom_hf_condition *cond = condition_of(c->family, e);
                if (cond) {
                    int said = loom_hf_get(v, cond->when) != 0 ||
                        loom_hf_true(c->config, cond->when);
                    if (t && !said)
                        return conv_fail(c,
                                         "%s: the weights have '%s', which config.json does not "
                                         "explain (its %s says there is none): refused rather "
                                         "than ignored",
                                         c->dir, src, cond->key);
                    if (!t && said)
                        return conv_fail(c,
                                         "%s: config.json's %s says there is '%s', but the "
                                         "weights have none",
                                         c->dir, cond->key, src);
                    if (!t)
                        continue;
                }
                if (!t && (e->flags & LOOM_HF_OPTIONAL))
                    continue;
                if (!t)
                    return conv_fail(c,
                                     "%s: the weights have no tensor '%s' (the %s family "
                                     "needs it)",
                                     c->dir, src, c->family->hf_model_type);
                if (pass == 0) {
                    c->total++;
                    continue;
                }
                row_order order = {.kind = ROWS_AS_STORED};
                if (e->flags & (LOOM_HF_ROPE_Q | LOOM_HF_QKV_PER_HEAD))
                    order.heads = (int)loom_hf_get(v, "attention.head_count");
                else if (e->flags & LOOM_HF_ROPE_K)
                    order.heads = (int)loom_hf_get(v, "attention.head_count_kv");
                if (e->flags & (LOOM_HF_ROPE_Q | LOOM_HF_ROPE_K))
                    order.kind = ROWS_ROPE_PAIRS;
                else if (e->flags & LOOM_HF_QKV_PER_HEAD)
                    order.kind = ROWS_QKV_PER_HEAD;
                order.k_heads = (int)loom_hf_get(v, "ssm.group_count");
                order.v_heads = (int)loom_hf_get(v, "ssm.time_step_rank");
                order.d_v = order.v_heads ? (int)(loom_hf_get(v, "ssm.inner_size") / order.v_heads)
                                          : 0;
                order.d_k = (int)loom_hf_get(v, "ssm.state_size");
                if (order.kind != ROWS_AS_STORED && order.heads <= 0)
                    return conv_fail(c, "%s: reordering '%s' needs the head count", c->dir, src);
                const int n_experts = (int)loom_hf_get(v, "expert_count");
                if (e->flags & (LOOM_HF_KV_B_K | LOOM_HF_KV_B_V)) {
                    const int64_t heads = (int64_t)loom_hf_get(v, "attention.head_count");
                    const int64_t nope = (int64_t)loom_hf_get(v, "attention.key_length_mla") -
                        (int64_t)loom_hf_get(v, "rope.dimension_count");
                    if (add_kv_b(c, t, src, dst, heads, nope,
                                 (int64_t)loom_hf_get(v, "attention.value_length_mla"),
                                 e->flags) != 0)
                        return -1;
                } else if ((e->flags & LOOM_HF_EXPERTS) && t->n_dims == 3) { /* the stack */
                    if (stacked_experts(c, e, t, src, dst, n_experts, order) != 0)
                        return -1;
                } else if (e->flags & LOOM_HF_EXPERTS) {
                    if (experts(c, e, l, n_experts, order) != 0)
                        return -1;
                } else if (add(c, &t, 1, src, dst, order, e->flags) != 0) {
                    return -1;
                }
            }
    }
    return 0;
}

/* The RoPE frequency divisors the family computes from config.json, as rope_freqs.weight. */
static int rope_freqs(conv *c, const loom_hf_values *v)
{
    int n = (int)loom_hf_get(v, "rope.dimension_count") / 2;
    if (!c->family->hf_rope_freqs || n <= 0)
        return 0;
    float *factors = own(c, (size_t)n * sizeof *factors);
    char why[512] = "";
    int rc = factors ? c->family->hf_rope_freqs(c->config, v, factors, n, why, sizeof why) : -1;
    if (rc < 0)
        return conv_fail(c, "%s/config.json: %s", c->dir, factors ? why : "out of memory");
    int64_t ne[1] = {n};
    if (rc > 0 && loom_gguf_add_tensor(c->w, "rope_freqs.weight", LOOM_F32, 1, ne, factors) != 0)
        return conv_fail(c, "cannot add rope_freqs.weight");
    return 0;
}

/* The folder as its family declares it: hyper-parameters, tokenizer, tensors. */
static int convert_family(conv *c)
{
    loom_hf_values v = {0};
    if (hyper_parameters(c, &v) != 0)
        return -1;
    /* the tokenizer's ids are bounded by the embedding's rows */
    char src[256], dst[256];
    for (const loom_hf_tensor *e = c->family->hf_tensors; e->hf; e++) {
        const loom_st_tensor *t = strcmp(e->gguf, "token_embd.weight")
            ? NULL
            : source(c, e, -1, 0, src, sizeof src, dst, sizeof dst);
        if (t && t->n_dims == 2)
            c->vocab_rows = t->shape[0];
    }
    if (conv_tokenizer(c) != 0 || conv_stop_tokens(c) != 0)
        return -1;
    return rope_freqs(c, &v) != 0 ? -1 : tensors(c, &v);
}

int loom_convert(const char *dir, const char *out, const char *type,
                 loom_convert_progress_fn progress, void *user, char *err, size_t err_size)
{
    conv c = {.dir = dir,
              .type = type ? type : "auto",
              .progress = progress,
              .user = user,
              .err = err,
              .err_size = err_size};
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
                                    loom_quant_mix_is_plain(mix) ? LOOM_QUANTIZE_PURE : 0, progress,
                                    user, err, err_size);
        unlink(tmp);
        free(tmp);
        return rc;
    }
    int rc = -1;
    if (conv_read_json(&c, "config.json", 1, &c.config) ||
        conv_read_json(&c, "tokenizer_config.json", 0, &c.tok_config))
        goto done;
    if (loom_safetensors_open(&c.st, dir, err, err_size) != 0)
        goto done;
    if (!(c.w = loom_gguf_writer_create())) {
        conv_fail(&c, "out of memory");
        goto done;
    }
    const char *model_type = cJSON_GetStringValue(cJSON_GetObjectItem(c.config, "model_type"));
    if ((c.family = loom_family_for_hf(c.config)))
        rc = convert_family(&c);
    else
        conv_fail(&c, "%s: model_type '%s' cannot be converted yet (loom converts: %s)", dir,
                  model_type ? model_type : "(none)", loom_models_known_hf());
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
    int rc = -1;
    if (conv_read_json(&c, "config.json", 0, &c.config) ||
        conv_read_json(&c, "tokenizer_config.json", 0, &c.tok_config))
        goto done;
    c.family = c.config ? loom_family_for_hf(c.config) : NULL;
    if (!(c.w = loom_gguf_writer_create())) {
        conv_fail(&c, "out of memory");
        goto done;
    }
    loom_gguf_set_str(c.w, "general.architecture", "tokenizer");
    rc = conv_tokenizer(&c);
    if (rc == 0)
        rc = loom_gguf_write(c.w, out, err, err_size);
done:
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
