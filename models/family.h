/*
 * models/family.h - what a model family declares in its one file (models/<family>.c): its GGUF
 * architecture (the runner's function table), the chat template it falls back on, and its
 * Hugging Face form as data: which config.json selects it, which config keys become which
 * GGUF hyper-parameters, which tensor becomes which and how its rows are reordered, and the
 * special tokens its tokenizer appends. files/convert.c is the one writer that reads the tables;
 * docs/ARCHITECTURE.md ("Adding a model family") walks through a new one.
 */
#ifndef LOOM_MODELS_FAMILY_H
#define LOOM_MODELS_FAMILY_H

#include "core/runner.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdint.h>

typedef enum { LOOM_HF_U32, LOOM_HF_F32, LOOM_HF_STR, LOOM_HF_BOOL } loom_hf_kind;

/* A hyper-parameter "<arch>.<gguf>" read from config.json. */
typedef struct loom_hf_param {
    const char *gguf;
    const char *config; /* keys tried in turn, '|' between ("a.b" reads b in object a); NULL:
                         * the fallback alone */
    loom_hf_kind kind;  /* LOOM_HF_U32 or LOOM_HF_F32 */
    double fallback;    /* when config.json has none; LOOM_HF_REQUIRED: it must be there, > 0 */
} loom_hf_param;
#define LOOM_HF_REQUIRED (-HUGE_VAL)

/* The hyper-parameters about to be written, by their key after "<arch>.". */
#define LOOM_HF_MAX_VALUES 32
typedef struct loom_hf_values {
    struct {
        const char *key; /* a string literal */
        loom_hf_kind kind;
        double num;
        const char *str; /* LOOM_HF_STR: a string literal */
    } v[LOOM_HF_MAX_VALUES];
    int n;
} loom_hf_values;

/* Sets (or replaces) key's value. */
void loom_hf_set(loom_hf_values *v, const char *key, loom_hf_kind kind, double num);
void loom_hf_set_str(loom_hf_values *v, const char *key, const char *str);
/* key's number; 0 when unset */
double loom_hf_get(const loom_hf_values *v, const char *key);

/* config.json lookups: keys as in loom_hf_param.config. */
double loom_hf_num(const cJSON *config, const char *keys, double fallback);
const char *loom_hf_str(const cJSON *config, const char *keys);    /* NULL when none is a string */
const cJSON *loom_hf_array(const cJSON *config, const char *keys); /* NULL when none is an array */
/* Validated numbers: the first of keys present (and not null) in *out, or fallback when none
 * is; -1 with err naming the key when its value is not a whole number from lo to hi
 * (loom_hf_int), or not a number above `above` and at most hi (loom_hf_real). */
int loom_hf_int(const cJSON *config, const char *keys, int64_t fallback, int64_t lo, int64_t hi,
                int64_t *out, char *err, size_t err_size);
int loom_hf_real(const cJSON *config, const char *keys, double fallback, double above, double hi,
                 double *out, char *err, size_t err_size);
int loom_hf_true(const cJSON *config, const char *key);

/* How a tensor is carried over. */
enum {
    LOOM_HF_OPTIONAL = 1 << 0,     /* some checkpoints lack it: skipped when absent */
    LOOM_HF_ROPE_Q = 1 << 1,       /* rows from rotate-half to adjacent-pair order, per query
                                    * head (attention.head_count): the llama convention's Q */
    LOOM_HF_ROPE_K = 1 << 2,       /* the same per KV head (attention.head_count_kv) */
    LOOM_HF_QKV_PER_HEAD = 1 << 3, /* fused [q k v] per head -> [Q; K; V] (rows, or a bias) */
    LOOM_HF_UNSUPPORTED = 1 << 4,  /* present: an error, and .gguf says why */
    LOOM_HF_EXPERTS = 1 << 5,      /* hf has a second "%d", the expert's index: the
                                    * expert_count matrices stack into one [experts, rows, cols];
                                    * or, where they are absent, `instead` names that stack as
                                    * one tensor (transformers 5's fused experts) */
    /* only in the layers before leading_dense_block_count (GLM-4.5's dense MLPs), or only in
     * those from it on (its experts) */
    LOOM_HF_DENSE_LAYERS = 1 << 6,
    LOOM_HF_SPARSE_LAYERS = 1 << 7,
    /* hybrid models (full_attention_interval): only in the linear-attention layers, or only in
     * the full-attention ones (every full_attention_interval-th) */
    LOOM_HF_LINEAR_LAYERS = 1 << 8,
    LOOM_HF_ATTENTION_LAYERS = 1 << 9,
    /* values changed on the way, as llama.cpp's converter changes them: a zero-centred RMSNorm
     * weight (applied as 1 + w) stored with the 1 added; A_log stored as -exp(A_log) */
    LOOM_HF_PLUS_ONE = 1 << 10,
    LOOM_HF_NEG_EXP = 1 << 11,
    /* a [rows, 1, cols] tensor (a depthwise conv1d's weight) stored as [rows, cols], in f32 */
    LOOM_HF_SQUEEZE = 1 << 12,
    /* Gated DeltaNet's value heads (ssm.time_step_rank of them, ssm.group_count key heads),
     * from grouped by key head (Hugging Face's order) to tiled (llama.cpp's qwen35 files: value
     * head i * k_heads + g is the i-th of key head g's): the last v_heads units of the rows (a
     * vector's elements), a unit being ssm.inner_size / v_heads rows where there are that many,
     * else one; or the columns (out_proj) */
    LOOM_HF_V_TILED = 1 << 13,
    LOOM_HF_V_TILED_COLUMNS = 1 << 14,
    /* from a fused [experts, 2 rows, cols] stack (gate_up_proj), each expert's first half of
     * the rows (the gate) or its second (up) */
    LOOM_HF_GATE_HALF = 1 << 15,
    LOOM_HF_UP_HALF = 1 << 16,
    /* Qwen3-Next's in_proj_qkvz, per key head (ssm.group_count) [q; k; v; z] (d_k, d_k and
     * twice ssm.inner_size / group_count rows): every head's q, k and v in turn ([Q; K; V],
     * attn_qkv), or every head's z (attn_gate) */
    LOOM_HF_QKVZ_QKV = 1 << 17,
    LOOM_HF_QKVZ_Z = 1 << 18,
    /* the multi-token-prediction block's (loom_family.hf_mtp_layers): written as the block after
     * the layers, blk.<block_count>.*, the hf "%d" (if any) its own layer's index from 0 */
    LOOM_HF_MTP = 1 << 19,
    /* multi-head latent attention's kv_b_proj [H (nope + v), C], per head [K_h; V_h], split as
     * llama.cpp's deepseek2 files hold it: attn_k_b, each head's K_h transposed ({nope, C, H}),
     * or attn_v_b, each head's V_h ({C, v, H}); H attention.head_count, nope key_length_mla -
     * rope.dimension_count, v value_length_mla */
    LOOM_HF_KV_B_K = 1 << 20,
    LOOM_HF_KV_B_V = 1 << 21,
};

typedef struct loom_hf_tensor {
    const char *hf;   /* the Hugging Face name; "%d" where a layer's index goes */
    const char *gguf; /* the GGUF name, "%d" likewise (per layer when hf has one) */
    unsigned flags;
    const char *instead; /* when hf is absent, this tensor (a tied output head) */
} loom_hf_tensor;

/* A MoE layer's experts under prefix P ("model." or "model.language_model."), one matrix each
 * (mlp.experts.N.gate_proj ...) or, where those are absent, transformers 5's stacks per layer
 * (mlp.experts.gate_up_proj [experts, 2 ff, d], mlp.experts.down_proj [experts, d, ff]), with
 * the entries' further flags. */
/* clang-format off */
#define LOOM_HF_EXPERT_STACKS(P, flags)                                                            \
    {P "layers.%d.mlp.experts.%d.gate_proj.weight", "blk.%d.ffn_gate_exps.weight",                 \
        LOOM_HF_EXPERTS | LOOM_HF_GATE_HALF | (flags), P "layers.%d.mlp.experts.gate_up_proj"},    \
    {P "layers.%d.mlp.experts.%d.up_proj.weight", "blk.%d.ffn_up_exps.weight",                     \
        LOOM_HF_EXPERTS | LOOM_HF_UP_HALF | (flags), P "layers.%d.mlp.experts.gate_up_proj"},      \
    {P "layers.%d.mlp.experts.%d.down_proj.weight", "blk.%d.ffn_down_exps.weight",                 \
        LOOM_HF_EXPERTS | (flags), P "layers.%d.mlp.experts.down_proj"}
/* clang-format on */

/* DeepSeek's feed-forward under P (GLM-4.5, GLM-4.7-Flash): first_k_dense_replace dense
 * SwiGLU layers, then a router with e_score_correction_bias, the experts (LOOM_HF_EXPERT_STACKS)
 * and ungated shared experts, whose presence n_shared_experts decides
 * (LOOM_HF_SHARED_EXPERTS_SAID, for the family's hf_conditions). */
/* clang-format off */
#define LOOM_HF_DEEPSEEK_FFN(P)                                                                    \
    {P "layers.%d.mlp.gate_proj.weight", "blk.%d.ffn_gate.weight", LOOM_HF_DENSE_LAYERS, NULL},   \
    {P "layers.%d.mlp.up_proj.weight", "blk.%d.ffn_up.weight", LOOM_HF_DENSE_LAYERS, NULL},       \
    {P "layers.%d.mlp.down_proj.weight", "blk.%d.ffn_down.weight", LOOM_HF_DENSE_LAYERS, NULL},   \
    {P "layers.%d.mlp.gate.weight", "blk.%d.ffn_gate_inp.weight", LOOM_HF_SPARSE_LAYERS, NULL},   \
    {P "layers.%d.mlp.gate.e_score_correction_bias", "blk.%d.exp_probs_b.bias",                   \
        LOOM_HF_SPARSE_LAYERS, NULL},                                                              \
    LOOM_HF_EXPERT_STACKS(P, LOOM_HF_SPARSE_LAYERS),                                               \
    {P "layers.%d.mlp.shared_experts.gate_proj.weight", "blk.%d.ffn_gate_shexp.weight",           \
        LOOM_HF_SPARSE_LAYERS, NULL},                                                              \
    {P "layers.%d.mlp.shared_experts.up_proj.weight", "blk.%d.ffn_up_shexp.weight",               \
        LOOM_HF_SPARSE_LAYERS, NULL},                                                              \
    {P "layers.%d.mlp.shared_experts.down_proj.weight", "blk.%d.ffn_down_shexp.weight",           \
        LOOM_HF_SPARSE_LAYERS, NULL}
#define LOOM_HF_SHARED_EXPERTS_SAID(P)                                                             \
    {P "layers.%d.mlp.shared_experts.gate_proj.weight", "expert_shared_count",                    \
        "n_shared_experts"},                                                                       \
    {P "layers.%d.mlp.shared_experts.up_proj.weight", "expert_shared_count", "n_shared_experts"}, \
    {P "layers.%d.mlp.shared_experts.down_proj.weight", "expert_shared_count", "n_shared_experts"}
/* clang-format on */

/* What a config says about a tensor it may or may not have (GLM-4.5's q/k norms with
 * use_qk_norm, its shared experts with n_shared_experts > 0). Said, the tensor must be there;
 * not said, it must not: weights the config does not explain, or a config the weights cannot
 * satisfy, are refused by name rather than run half-understood. */
typedef struct loom_hf_condition {
    const char *hf;   /* an entry of the family's hf_tensors, by its Hugging Face name */
    const char *when; /* a hyper-parameter that is set (not 0), or a config.json key that is
                       * true */
    const char *key;  /* the config.json key that decides it, for messages */
} loom_hf_condition;

/* The special tokens a family's tokenizer appends after its ordinary vocabulary (tiktoken
 * ranks, or SentencePiece pieces). Indexes count from the first id after that vocabulary. */
typedef struct loom_hf_specials {
    const char *pre;          /* tokenizer.ggml.pre, for tiktoken ranks */
    const char *const *named; /* the first specials, by name */
    int n_named, total;       /* the rest are filler_fmt with filler_base + their index */
    const char *filler_fmt;
    int filler_base;
    int bos, eos;            /* -1: none (eos then from config.json's eos_token_id) */
    int stops[3], n_stops;   /* 0: generation_config.json's list */
    int prefix[2], n_prefix; /* what every prompt starts with (ChatGLM: [gMASK] sop) */
    int text_specials[4], n_text_specials; /* read from a user's text, when ... */
    const char *text_specials_when;        /* ... tokenizer_config.json has this key true */
} loom_hf_specials;

typedef struct loom_family {
    const loom_arch *arch; /* the GGUF side: general.architecture, hyper-parameters, weights,
                            * forward pass */
    /* the built-in chat template (chat/chat.c) for a file whose own template loom does not
     * recognise or that has none; with a tiktoken vocabulary (its pre as .tiktoken's) the
     * second; NULL: llama2, and a note that it is a guess */
    const char *chat_template, *chat_template_tiktoken;

    /* The Hugging Face form; hf_model_type NULL: loom does not convert this family. */
    const char *hf_model_type; /* config.json's model_type */
    const char *hf_when;       /* NULL, or: only when config.json has one of these keys ('|') */
    const loom_hf_param *hf_params; /* ends with {0} */
    /* Hyper-parameters that are not one key each (defaults computed from others, checks
     * across keys); NULL when none. Messages name the config.json keys. */
    int (*hf_derive)(const cJSON *config, loom_hf_values *v, char *err, size_t err_size);
    const loom_hf_tensor *hf_tensors; /* ends with {0}; the layers' count is block_count */
    /* config.json's keys ('|') counting the multi-token-prediction blocks its LOOM_HF_MTP
     * entries describe: where the weights have them, the file gets one more block and
     * nextn_predict_layers, as llama.cpp's converter writes them. NULL: none. */
    const char *hf_mtp_layers;
    const loom_hf_condition *hf_conditions; /* ends with {0}; NULL: none */
    /* RoPE frequency divisors the config implies (Llama 3.1's rope_scaling "llama3"), written
     * as rope_freqs.weight the way llama.cpp's converter does: fills factors[0..n) and returns
     * 1, or 0 when the config implies none, -1 with err. NULL: never. */
    int (*hf_rope_freqs)(const cJSON *config, const loom_hf_values *v, float *factors, int n,
                         char *err, size_t err_size);
    const loom_hf_specials *tiktoken;     /* after tiktoken ranks; NULL: Llama-3's */
    const loom_hf_specials *spm_specials; /* after SentencePiece pieces (ChatGLM2/3) */
} loom_family;

#endif
