/*
 * files/convert_tokenizer.c - a Hugging Face folder's tokenizer files as GGUF tokenizer keys:
 * SentencePiece models (tokenizer.model, ChatGLM-6B's ice_text.model), byte-level BPE
 * (vocab.json + merges.txt, tokenizer.json) and tiktoken rank files (qwen.tiktoken; Llama-3's
 * and GLM-4's tokenizer.model). docs/gguf.md lists the keys.
 */
#define _GNU_SOURCE
#include "files/convert_tokenizer.h"

#include "core/file.h"
#include "core/tokenizer.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

/* ---- ids ------------------------------------------------------------------------------------
 * Every id a tokenizer file names is checked before it indexes anything: a whole number below
 * the token embedding's rows (LOOM_MAX_VOCAB converting a tokenizer alone). */

static int64_t id_limit(const conv *c)
{
    return c->vocab_rows ? c->vocab_rows : LOOM_MAX_VOCAB;
}

/* x, read from file (what: where in it), as an id in *id. */
static int file_token_id(conv *c, const char *file, const char *what, double x, int32_t *id)
{
    if (!(x >= 0 && x < (double)id_limit(c) && x == floor(x)))
        return conv_fail(c, "%s/%s: %s is %.17g, not a token id from 0 to %lld (%s)", c->dir, file,
                         what, x, (long long)id_limit(c) - 1,
                         c->vocab_rows ? "the token embedding's rows" : "loom's vocabulary limit");
    *id = (int32_t)x;
    return 0;
}

/* config.json's single id under key (a list there is generation_config.json's business):
 * fallback when absent. */
static int config_token_id(conv *c, const char *key, int32_t fallback, int32_t *id)
{
    int64_t x = fallback;
    char why[256];
    if (!cJSON_IsArray(cJSON_GetObjectItem(c->config, key)) &&
        loom_hf_int(c->config, key, fallback, 0, id_limit(c) - 1, &x, why, sizeof why))
        return conv_fail(c, "%s/config.json: %s (a token id)", c->dir, why);
    *id = (int32_t)x;
    return 0;
}

/* How many ids the tokenizer gets: at least `needed` (one past the highest id its files
 * name), and the vocabulary config.json declares (vocab_size; ChatGLM's padded_vocab_size) or
 * the embedding's rows, filled with placeholders: llama.cpp wants a token per row. */
static int vocab_size(conv *c, int64_t needed, int32_t *n)
{
    int64_t declared;
    char why[256];
    if (loom_hf_int(c->config, "vocab_size|padded_vocab_size", c->vocab_rows, 1, LOOM_MAX_VOCAB,
                    &declared, why, sizeof why))
        return conv_fail(c, "%s/config.json: %s", c->dir, why);
    if (c->vocab_rows && declared != c->vocab_rows)
        return conv_fail(c,
                         "%s/config.json: vocab_size %lld, but the token embedding has %lld rows",
                         c->dir, (long long)declared, (long long)c->vocab_rows);
    if (needed > id_limit(c))
        return conv_fail(c, "%s: the tokenizer has %lld ids, more than the %lld %s", c->dir,
                         (long long)needed, (long long)id_limit(c),
                         c->vocab_rows ? "rows of the token embedding" : "loom allows");
    *n = (int32_t)(declared > needed ? declared : needed);
    return 0;
}

static void conv_spm_normalizer(conv *c)
{
    /* what SentencePiece's normaliser does before the model sees the text: its precompiled
     * character map (llama.cpp's key, as for T5), whitespace collapsing and trimming (which
     * sentencepiece applies whatever the map, identity included), and the spaces' escape */
    if (c->spm.charsmap)
        loom_gguf_set_u8_array(c->w, "tokenizer.ggml.precompiled_charsmap", c->spm.charsmap,
                               c->spm.charsmap_size);
    loom_gguf_set_bool(c->w, "tokenizer.loom.remove_extra_whitespaces",
                       c->spm.remove_extra_whitespaces);
    if (!c->spm.escape_whitespaces)
        loom_gguf_set_bool(c->w, "tokenizer.loom.escape_whitespaces", 0);
}

/* A SentencePiece model's pieces, then the specials the family appends after them (ChatGLM2/3),
 * then placeholders up to the embedding's rows. */
static int tokenizer(conv *c)
{
    const loom_hf_specials *sp = c->family ? c->family->spm_specials : NULL;
    char path[4096];
    int ice = is_ice_text(c);
    snprintf(path, sizeof path, "%s/%s", c->dir, ice ? "ice_text.model" : "tokenizer.model");
    if (access(path, R_OK) != 0)
        return conv_fail(c,
                         "%s: no tokenizer.model (loom reads the SentencePiece model of the Llama "
                         "family; tokenizer.json-only folders are not supported yet)",
                         c->dir);
    if (loom_spm_model_read(&c->spm, path, c->err, c->err_size) != 0)
        return -1;
    if (c->spm.model_type != 1 && c->spm.model_type != 2)
        return conv_fail(c, "%s: a SentencePiece model of type %d; loom runs BPE and unigram ones",
                         path, c->spm.model_type);
    int32_t n_sp = c->spm.n, n_special = sp ? sp->total : 0, n_vocab;
    if (vocab_size(c, (int64_t)n_sp + n_special, &n_vocab) != 0)
        return -1;
    /* llama.cpp wants one token per embedding row: pad with unused placeholders */
    const char **tokens = calloc((size_t)n_vocab, sizeof *tokens);
    float *scores = calloc((size_t)n_vocab, sizeof *scores);
    int32_t *types = calloc((size_t)n_vocab, sizeof *types);
    char **pads = calloc((size_t)n_vocab, sizeof *pads);
    int rc = tokens && scores && types && pads ? 0 : conv_fail(c, "out of memory");
    for (int32_t i = 0; rc == 0 && i < n_vocab; i++) {
        if (i < n_sp) {
            tokens[i] = c->spm.pieces[i];
            scores[i] = c->spm.scores[i];
            types[i] = c->spm.types[i];
        } else if (i < n_sp + n_special && i - n_sp < sp->n_named) {
            tokens[i] = sp->named[i - n_sp];
            types[i] = 3;
        } else {
            if (!(pads[i] = loom_strf("[PAD%d]", i)))
                rc = conv_fail(c, "out of memory");
            tokens[i] = pads[i];
            scores[i] = -1000.0f;
            types[i] = 5;
        }
    }
    if (rc == 0) {
        /* llama.cpp's names: "llama" for SentencePiece BPE, "t5" for unigram */
        loom_gguf_set_str(c->w, "tokenizer.ggml.model", c->spm.model_type == 1 ? "t5" : "llama");
        conv_spm_normalizer(c);
        if (ice) {
            /* ChatGLM-6B: text rewriting, and [gMASK] <sop> after the prompt; <eop> ends */
            int32_t gmask = piece_id(&c->spm, "[gMASK]"), sop = piece_id(&c->spm, "<sop>");
            int32_t eop = piece_id(&c->spm, "<eop>");
            if (gmask < 0 || sop < 0 || eop < 0)
                rc = conv_fail(
                    c, "%s: no [gMASK], <sop> or <eop> piece: not ChatGLM-6B's tokenizer", path);
            int32_t suffix[2] = {gmask, sop};
            loom_gguf_set_bool(c->w, "tokenizer.loom.glm_text", 1);
            /* chatglm.cpp reads no special token from text: [gMASK] typed is characters */
            loom_gguf_set_i32_array(c->w, "tokenizer.loom.text_specials", NULL, 0);
            loom_gguf_set_i32_array(c->w, "tokenizer.loom.suffix_tokens", suffix, 2);
            loom_gguf_set_u32(c->w, "tokenizer.ggml.gmask_token_id",
                              (uint32_t)(gmask < 0 ? 0 : gmask));
            c->spm.bos_id = sop, c->spm.eos_id = eop;
        }
        if (sp) {
            /* the family's specials start and end text: no BOS; EOS as config.json says */
            int32_t ids[4];
            for (int i = 0; i < sp->n_prefix; i++)
                ids[i] = n_sp + sp->prefix[i];
            loom_gguf_set_i32_array(c->w, "tokenizer.loom.prefix_tokens", ids,
                                    (uint64_t)sp->n_prefix);
            int by_text = sp->text_specials_when &&
                loom_hf_true(c->tok_config, sp->text_specials_when);
            for (int i = 0; i < sp->n_text_specials; i++)
                ids[i] = n_sp + sp->text_specials[i];
            loom_gguf_set_i32_array(c->w, "tokenizer.loom.text_specials", ids,
                                    by_text ? (uint64_t)sp->n_text_specials : 0);
            c->spm.bos_id = -1;
            rc = config_token_id(c, "eos_token_id", c->spm.eos_id, &c->spm.eos_id);
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
        loom_gguf_set_bool(c->w, "tokenizer.ggml.add_bos_token",
                           ice || sp ? 0
                               : ab  ? cJSON_IsTrue(ab)
                                     : 1);
        loom_gguf_set_bool(c->w, "tokenizer.ggml.add_space_prefix", c->spm.add_dummy_prefix);
        /* special tokens declared with lstrip/rstrip false keep the whitespace beside them;
         * undeclared ones lose it (see core/tokenizer.c); ChatGLM's keep it always */
        int strip = !sp;
        cJSON *added = cJSON_GetObjectItem(c->tok_config, "added_tokens_decoder"), *a;
        cJSON_ArrayForEach (a, added)
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
int conv_stop_tokens(conv *c)
{
    cJSON *gen;
    if (conv_read_json(c, "generation_config.json", 0, &gen))
        return -1;
    cJSON *eos = cJSON_GetObjectItem(gen, "eos_token_id");
    int rc = 0;
    if (cJSON_IsArray(eos) && cJSON_GetArraySize(eos) > 0 && cJSON_GetArraySize(eos) <= 16) {
        int32_t ids[16];
        int n = 0;
        cJSON *e;
        cJSON_ArrayForEach (e, eos)
            if (rc == 0)
                rc = file_token_id(c, "generation_config.json", "an eos_token_id",
                                   cJSON_IsNumber(e) ? e->valuedouble : NAN, &ids[n++]);
        if (rc == 0)
            loom_gguf_set_i32_array(c->w, "tokenizer.loom.stop_token_ids", ids, (uint64_t)n);
    }
    cJSON_Delete(gen);
    return rc;
}

/* A byte-level BPE vocabulary being assembled, whatever the folder ships it as: tokens by id
 * (borrowed strings, or ones it owns), their types, the merges. */
typedef struct bpe_vocab {
    int32_t n;
    const char **tokens;
    int32_t *types;
    char **owned;  /* per id: a string this vocabulary allocated */
    char **merges; /* "left right", owned */
    size_t n_merges, cap;
    int32_t bos, eos, pad;
} bpe_vocab;

static int bpe_vocab_init(conv *c, bpe_vocab *v, int32_t n)
{
    *v = (bpe_vocab){.n = n, .bos = -1, .eos = -1, .pad = -1};
    v->tokens = calloc((size_t)n, sizeof *v->tokens);
    v->types = calloc((size_t)n, sizeof *v->types);
    v->owned = calloc((size_t)n, sizeof *v->owned);
    return v->tokens && v->types && v->owned ? 0 : conv_fail(c, "out of memory");
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
        return conv_fail(c, "out of memory");
    v->merges[v->n_merges++] = text;
    return 0;
}

/* Pads the ids nothing named, and writes the tokenizer keys. */
static int bpe_vocab_write(conv *c, bpe_vocab *v, const char *pre, int add_bos)
{
    for (int32_t i = 0; i < v->n; i++)
        if (!v->tokens[i]) {
            if (!(v->owned[i] = loom_strf("[PAD%d]", i)))
                return conv_fail(c, "out of memory");
            v->tokens[i] = v->owned[i], v->types[i] = 5;
        }
    loom_gguf_set_str(c->w, "tokenizer.ggml.model", "gpt2");
    loom_gguf_set_str(c->w, "tokenizer.ggml.pre", pre);
    loom_gguf_set_str_array(c->w, "tokenizer.ggml.tokens", v->tokens, (uint64_t)v->n);
    loom_gguf_set_i32_array(c->w, "tokenizer.ggml.token_type", v->types, (uint64_t)v->n);
    loom_gguf_set_str_array(c->w, "tokenizer.ggml.merges", (const char *const *)v->merges,
                            v->n_merges);
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
    cJSON *vocab;
    if (conv_read_json(c, "vocab.json", 1, &vocab))
        return -1;
    char path[4096];
    snprintf(path, sizeof path, "%s/merges.txt", c->dir);
    char why[4200];
    FILE *mf = loom_file_fopen(path, why, sizeof why);
    if (!mf) {
        cJSON_Delete(vocab);
        return conv_fail(c, "%s (a byte-level BPE tokenizer needs its merges)", why);
    }
    /* ids are checked once, on the walk that sizes the table */
    int64_t needed = 0;
    int32_t id, n_vocab = 0;
    int rc = 0;
    cJSON *e;
    cJSON_ArrayForEach (e, vocab) {
        if (rc == 0 && !cJSON_IsNumber(e))
            rc = conv_fail(c, "%s/vocab.json: token '%.80s' has no numeric id", c->dir, e->string);
        if (rc == 0 && (rc = file_token_id(c, "vocab.json", "an id", e->valuedouble, &id)) == 0)
            needed = id >= needed ? id + 1 : needed;
    }
    cJSON *added = cJSON_GetObjectItem(c->tok_config, "added_tokens_decoder");
    cJSON_ArrayForEach (e, added) {
        char *end;
        double x = strtod(e->string, &end);
        if (rc == 0 && (end == e->string || *end))
            x = NAN;
        if (rc == 0 &&
            (rc = file_token_id(c, "tokenizer_config.json", "an added_tokens_decoder key", x,
                                &id)) == 0)
            needed = id >= needed ? id + 1 : needed;
    }
    bpe_vocab v = {0};
    if (rc == 0 && (rc = vocab_size(c, needed, &n_vocab)) == 0)
        rc = bpe_vocab_init(c, &v, n_vocab);
    cJSON_ArrayForEach (e, vocab)
        if (rc == 0)
            v.tokens[(int32_t)e->valuedouble] = e->string, v.types[(int32_t)e->valuedouble] = 1;
    if (rc == 0)
        rc = config_token_id(c, "eos_token_id", -1, &v.eos);
    cJSON *eos_name = cJSON_GetObjectItem(c->tok_config, "eos_token");
    cJSON *pad_name = cJSON_GetObjectItem(c->tok_config, "pad_token");
    cJSON_ArrayForEach (e, added) {
        cJSON *content = cJSON_GetObjectItem(e, "content");
        if (rc || !cJSON_IsString(content))
            continue;
        id = (int32_t)strtod(e->string, NULL);
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
    if (rc == 0)
        rc = config_token_id(c, "bos_token_id", -1, &v.bos);
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
    cJSON *vocab = cJSON_GetObjectItem(model, "vocab"),
          *merges = cJSON_GetObjectItem(model, "merges");
    if (!cJSON_IsString(type) || strcmp(type->valuestring, "BPE") || !cJSON_IsObject(vocab) ||
        !cJSON_IsArray(merges))
        return conv_fail(c, "%s/tokenizer.json: not a BPE tokenizer with a vocab and merges",
                         c->dir);
    char *pre_json = cJSON_PrintUnformatted(cJSON_GetObjectItem(tj, "pre_tokenizer"));
    const char *pre = !pre_json             ? NULL
        : strstr(pre_json, "\\\\p{N}{1,3}") ? "llama-bpe"
        : strstr(pre_json, "\\\\p{N}|")     ? "qwen2"
                                            : NULL;
    int byte_level = pre_json && strstr(pre_json, "ByteLevel");
    free(pre_json);
    if (!pre || !byte_level)
        return conv_fail(c,
                         "%s/tokenizer.json: a pre-tokenizer loom does not know (it knows the "
                         "byte-level ones of Llama-3 and Qwen2)",
                         c->dir);
    int64_t needed = 0;
    int32_t id, n_vocab = 0;
    int rc = 0;
    cJSON *e, *added = cJSON_GetObjectItem(tj, "added_tokens");
    cJSON_ArrayForEach (e, vocab) {
        if (rc == 0 && !cJSON_IsNumber(e))
            rc = conv_fail(c, "%s/tokenizer.json: token '%.80s' has no numeric id", c->dir,
                           e->string);
        if (rc == 0 &&
            (rc = file_token_id(c, "tokenizer.json", "a vocab id", e->valuedouble, &id)) == 0)
            needed = id >= needed ? id + 1 : needed;
    }
    cJSON_ArrayForEach (e, added) {
        cJSON *num = cJSON_GetObjectItem(e, "id");
        if (rc == 0 &&
            (rc = file_token_id(c, "tokenizer.json", "an added token's id",
                                cJSON_IsNumber(num) ? num->valuedouble : NAN, &id)) == 0)
            needed = id >= needed ? id + 1 : needed;
    }
    bpe_vocab v = {0};
    if (rc == 0 && (rc = vocab_size(c, needed, &n_vocab)) == 0)
        rc = bpe_vocab_init(c, &v, n_vocab);
    cJSON_ArrayForEach (e, vocab)
        if (rc == 0)
            v.tokens[(int32_t)e->valuedouble] = e->string, v.types[(int32_t)e->valuedouble] = 1;
    cJSON *bos_name = cJSON_GetObjectItem(c->tok_config, "bos_token");
    cJSON *eos_name = cJSON_GetObjectItem(c->tok_config, "eos_token");
    int glm_marks = 0; /* GLM-4-0414 and GLM-4.5 share Llama-3's pattern; their prompts start
                        * [gMASK] <sop>, which llama.cpp's converter records as pre "glm4" */
    cJSON_ArrayForEach (e, added) {
        cJSON *content = cJSON_GetObjectItem(e, "content");
        if (rc || !cJSON_IsString(content))
            continue;
        glm_marks += !strcmp(content->valuestring, "[gMASK]") +
            !strcmp(content->valuestring, "<sop>");
        id = (int32_t)cJSON_GetObjectItem(e, "id")->valuedouble;
        v.tokens[id] = content->valuestring;
        v.types[id] = cJSON_IsTrue(cJSON_GetObjectItem(e, "special")) ? 3 : 4;
        if (cJSON_IsString(bos_name) && !strcmp(bos_name->valuestring, content->valuestring))
            v.bos = id;
        if (cJSON_IsString(eos_name) && !strcmp(eos_name->valuestring, content->valuestring))
            v.eos = id;
    }
    int i = 0;
    cJSON *m;
    cJSON_ArrayForEach (m, merges) /* a linked list: walking it by index would be quadratic */
    {
        if (rc)
            break;
        char *text = NULL;
        const cJSON *l = cJSON_GetArrayItem(m, 0), *r = cJSON_GetArrayItem(m, 1);
        int pair = cJSON_IsArray(m) && cJSON_GetArraySize(m) == 2 && cJSON_IsString(l) &&
            cJSON_IsString(r); /* newer files: [left, right] */
        if (cJSON_IsString(m))
            text = strdup(m->valuestring);
        else if (pair)
            text = loom_strf("%s %s", l->valuestring, r->valuestring);
        if (!cJSON_IsString(m) && !pair)
            rc = conv_fail(c, "%s/tokenizer.json: merge %d is not a pair of strings", c->dir, i);
        else
            rc = bpe_vocab_merge(c, &v, text);
        i++;
    }
    cJSON *ab = cJSON_GetObjectItem(c->tok_config, "add_bos_token");
    if (glm_marks == 2 && !strcmp(pre, "llama-bpe"))
        pre = "glm4";
    if (rc == 0)
        rc = bpe_vocab_write(c, &v, pre, ab ? cJSON_IsTrue(ab) : v.bos >= 0);
    bpe_vocab_free(&v);
    return rc;
}

/* ---- tiktoken rank files -------------------------------------------------------------------
 * One "base64(bytes) rank" line per token: Llama-3's and GLM-4's tokenizer.model, Qwen v1's
 * qwen.tiktoken.
 * Stored as byte-level BPE, as llama.cpp and transformers do: each token spelled with GPT-2's
 * byte map, and as merges every split of a token into two tokens, ordered by the merged token's
 * rank, then by the left part's rank and the right part's. */

static int is_tiktoken(const char *path)
{
    char why[4200];
    FILE *f = loom_file_fopen(path, why, sizeof why);
    char line[512];
    int yes = f && fgets(line, sizeof line, f) &&
        strspn(line, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=") > 0;
    if (yes) {
        size_t b = strspn(line,
                          "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=");
        yes = line[b] == ' ' && line[b + 1] >= '0' && line[b + 1] <= '9';
    }
    if (f)
        fclose(f);
    return yes;
}

static int base64_decode(const char *in, size_t n, unsigned char *out)
{
    static const char alphabet[] =
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
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
    char why[4200];
    FILE *f = loom_file_fopen(path, why, sizeof why);
    if (!f)
        return conv_fail(c, "%s", why);
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
            rc = conv_fail(c, "%s:%d: not a tiktoken 'base64 rank' line", path, lineno);
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
                rc = conv_fail(c, "out of memory");
                break;
            }
            t->len = nl;
            memset(t->bytes + cap, 0, (size_t)(ncap - cap) * sizeof *nb);
            memset(t->len + cap, 0, (size_t)(ncap - cap) * sizeof *nl);
            cap = ncap;
        }
        if (t->bytes[rank] || !(t->bytes[rank] = malloc((size_t)n))) {
            rc = conv_fail(c, "%s:%d: rank %ld given twice (or out of memory)", path, lineno, rank);
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
            rc = conv_fail(c, "%s: rank %d is missing", path, i);
    uint32_t size = 1;
    while (rc == 0 && size < 2u * (uint32_t)t->n)
        size <<= 1;
    if (rc == 0 && !(t->slot = malloc(size * sizeof *t->slot)))
        rc = conv_fail(c, "out of memory");
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

/* The family's specials after the ranks (first = their count), and the ids it starts and ends
 * text with. */
static int tiktoken_specials(conv *c, bpe_vocab *v, int32_t first, const loom_hf_specials *f)
{
    for (int i = 0; i < f->total && first + i < v->n; i++) {
        int32_t id = first + i;
        if (i < f->n_named)
            v->tokens[id] = f->named[i];
        else if (!(v->owned[id] = loom_strf(f->filler_fmt, f->filler_base + i)))
            return conv_fail(c, "out of memory");
        else
            v->tokens[id] = v->owned[id];
        v->types[id] = 3;
    }
    int32_t ids[3];
    for (int i = 0; i < f->n_stops; i++)
        ids[i] = first + f->stops[i];
    loom_gguf_set_i32_array(c->w, "tokenizer.loom.stop_token_ids", ids, (uint64_t)f->n_stops);
    for (int i = 0; i < f->n_prefix; i++)
        ids[i] = first + f->prefix[i];
    if (f->n_prefix)
        loom_gguf_set_i32_array(c->w, "tokenizer.loom.prefix_tokens", ids, (uint64_t)f->n_prefix);
    v->bos = f->bos >= 0 ? first + f->bos : -1;
    v->eos = f->eos >= 0 ? first + f->eos : -1;
    return 0;
}

static int tokenizer_tiktoken(conv *c, const char *path, const loom_hf_specials *f)
{
    rank_table t;
    if (read_ranks(c, path, &t) != 0) {
        rank_table_free(&t);
        return -1;
    }
    int32_t n_vocab = 0;
    bpe_vocab v = {0};
    int rc = vocab_size(c, (int64_t)t.n + f->total, &n_vocab);
    if (rc == 0)
        rc = bpe_vocab_init(c, &v, n_vocab);
    char *spelled = malloc(2 * 768 + 1);
    int32_t *pairs = malloc(2 * 768 * sizeof *pairs);
    if (rc == 0 && (!spelled || !pairs))
        rc = conv_fail(c, "out of memory");
    for (int32_t r = 0; rc == 0 && r < t.n; r++) {
        size_t k = loom_byte_level_spell(t.bytes[r], (size_t)t.len[r], spelled);
        if (!(v.owned[r] = strndup(spelled, k)))
            rc = conv_fail(c, "out of memory");
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
        rc = tiktoken_specials(c, &v, t.n, f);
    if (rc == 0)
        rc = bpe_vocab_write(c, &v, f->pre, f->bos >= 0);
    free(spelled), free(pairs);
    bpe_vocab_free(&v);
    rank_table_free(&t);
    return rc;
}

/* What a tiktoken vocabulary appends: the family's list, or (a folder of a family that
 * declares none, or a tokenizer without its model) the named family's. */
static const loom_hf_specials *tiktoken_specials_of(const conv *c, const char *fallback)
{
    if (c->family && c->family->tiktoken)
        return c->family->tiktoken;
    return loom_family_find(fallback)->tiktoken;
}

/* The folder's tokenizer, whichever form it ships: tokenizer.json (byte-level BPE), a
 * tiktoken rank file (qwen.tiktoken, or tokenizer.model in that format), a SentencePiece
 * model (tokenizer.model, ice_text.model), or vocab.json + merges.txt. */
int conv_tokenizer(conv *c)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.model", c->dir);
    /* ChatGLM2/3: their SentencePiece model and the specials the family appends, whatever
     * else the folder carries */
    if (c->family && c->family->spm_specials && !is_tiktoken(path))
        return tokenizer(c);
    /* a byte-level tokenizer.json wins (Llama-3 folders also carry a tokenizer.model, in
     * tiktoken's format); a SentencePiece-style one defers to tokenizer.model */
    cJSON *tj;
    if (conv_read_json(c, "tokenizer.json", 0, &tj))
        return -1;
    char *pre = tj ? cJSON_PrintUnformatted(cJSON_GetObjectItem(tj, "pre_tokenizer")) : NULL;
    int byte_level = pre && strstr(pre, "ByteLevel");
    free(pre);
    if (byte_level) {
        int rc = tokenizer_json(c, tj);
        cJSON_Delete(tj);
        return rc;
    }
    cJSON_Delete(tj);
    snprintf(path, sizeof path, "%s/qwen.tiktoken", c->dir);
    if (access(path, R_OK) == 0)
        return tokenizer_tiktoken(c, path, tiktoken_specials_of(c, "qwen"));
    snprintf(path, sizeof path, "%s/tokenizer.model", c->dir);
    if (is_tiktoken(path)) /* Llama-3's and GLM-4's tokenizer.model */
        return tokenizer_tiktoken(c, path, tiktoken_specials_of(c, "llama"));
    int has_model = access(path, R_OK) == 0 || is_ice_text(c);
    snprintf(path, sizeof path, "%s/vocab.json", c->dir);
    if (!has_model && access(path, R_OK) == 0)
        return tokenizer_bpe(c);
    return tokenizer(c);
}
