/*
 * api/internal.h - what the API layer's files share and the public header does not show.
 */
#ifndef LOOM_API_INTERNAL_H
#define LOOM_API_INTERNAL_H

#include <loom/backend.h>
#include <loom/loom.h>

#include "core/sampler.h"

/* A Hugging Face folder converted (keeping its weights' precision) into an anonymous in-memory
 * file; writes that file's path to out and returns its descriptor (close it once the file is
 * open: the mapping keeps it alive), or -1 with err. */
int loom_convert_in_memory(const char *dir, char *out, size_t out_size,
                           loom_convert_progress_fn progress, void *user, char *err,
                           size_t err_size);
/* A GGUF file, or a Hugging Face folder converted in memory, opened as a GGUF. Returns 0, or -1
 * with err. */
struct loom_gguf;
int loom_open_model_file(const char *path, struct loom_gguf *g, loom_convert_progress_fn progress,
                         void *user, char *err, size_t err_size);
/* A weight type by its name (f32, f16, bf16, q8_0, q4_0, q4_1): 0, or -1 when it is none. */
int loom_parse_weight_type(const char *name, loom_dtype *t);

/* files/quant_mix.c: the types and llama.cpp-style mixes loom quantises to. A mix is found by
 * name (-1: none); its type for a tensor depends on the tensor's name and row length, the
 * model's layer count, query heads per KV head and experts (0: dense). */
const char *loom_quant_mix_names(void);
int loom_quant_mix_find(const char *name);
int loom_quant_mix_file_type(int mix);
loom_dtype loom_quant_mix_base(int mix);
/* pure: every matrix the mix's base type (llama-quantize's --pure), still with row fallbacks */
loom_dtype loom_quant_mix_type(int mix, const char *name, int64_t cols, int n_layer, int n_gqa,
                               int n_expert, int pure);
/* A tensor no mix quantises (a MoE router: its logits choose the experts) */
int loom_quant_mix_keeps(const char *name);
/* the mix is one type throughout but for the output tensor (q4_0, q6_k, ...), not a _S/_M/_L
 * or q2_k mix */
int loom_quant_mix_is_plain(int mix);

/* A malloc'd formatted string, or NULL without memory (asprintf leaves its pointer undefined
 * then, which a later free would trip over). */
char *loom_strf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Whether path is a folder (then it is taken as a Hugging Face model). */
int loom_is_model_dir(const char *path);

/* loom.h's sampling options as the core sampler takes them (model.c, the engine). */
loom_sampler_params loom_sampler_params_of(const loom_sampling *s);

/* The template for a stored template text and architecture (either may be NULL). */
/* pre: tokenizer.ggml.pre (GLM-4 shares the chatglm architecture with ChatGLM2/3) */
const char *loom_chat_template_guess(const char *stored, const char *arch, const char *pre,
                                     int *recognised);

/* How the tool calls a Jinja template offers are written (chat/tool_calls.c). */
loom_tool_syntax loom_tool_syntax_of_template(const char *jinja);
/* The Jinja chat template a GGUF carries, with its BOS and EOS text (chat/chat.c). */
struct loom_tokenizer;
loom_chat_template *loom_chat_template_from_gguf(const struct loom_gguf *g,
                                                 const struct loom_tokenizer *tok, char *err,
                                                 size_t err_size);

/* The parts of an open model the engine drives. */
struct loom_runner *loom_model_runner(loom_model *m);
struct loom_tokenizer *loom_model_tokenizer(loom_model *m);
/* ... and those the chat layer reads (its template and special tokens), without changing them:
 * the chat layer calls the model, never the other way round. */
const struct loom_gguf *loom_model_gguf(const loom_model *m);
const struct loom_tokenizer *loom_model_tokenizer_of(const loom_model *m);
/* A prompt the model can run from position 0: 1 to n_ctx ids, each in the vocabulary. 0, or
 * -1 with err naming what is wrong. */
int loom_model_check_ids(const loom_model *m, const int32_t *ids, int32_t n, char *err,
                         size_t err_size);
/* Sets the logits of the ids the model must never produce (placeholder rows: token type
 * UNUSED, or no token at all) to -inf before sampling. */
void loom_model_mask_unsampled(const loom_model *m, float *logits);
/* Prompt lookup: the tokens that followed the latest earlier occurrence of text's last n
 * tokens, for the longest n from n_max down to 2 (1 when n_max is 1) that occurs; at most k of
 * them into out. How many. */
int32_t loom_lookup_draft(const int32_t *text, int32_t n_text, int32_t n_max, int32_t k,
                          int32_t *out);
/* Pooling hidden states into an embedding: sum[0..n_embd) += each of n rows; then the mean of
 * n_pooled rows, scaled to length one when normalize (a zero vector stays zero), into out. */
void loom_pool_add(double *sum, const float *rows, int32_t n, int32_t n_embd);
void loom_pool_result(const double *sum, int32_t n_pooled, int32_t n_embd, int normalize,
                      float *out);
/* The target's final hidden states a multi-token-prediction drafter has yet to take into its
 * cache: n_embd floats for each position of [from, from + n), room for cap. */
typedef struct loom_mtp_states {
    float *rows;
    int32_t from, n, cap, n_embd;
} loom_mtp_states;
/* States at positions pos0..pos0 + n: they replace those kept from pos0 on (a pass after
 * rejected proposals rewrites them); not contiguous with what is kept, they start anew. 0, or
 * -1 out of memory (none kept then). */
int loom_mtp_states_put(loom_mtp_states *s, int32_t pos0, const float *rows, int32_t n);
/* Forgets the states before pos. */
void loom_mtp_states_drop_before(loom_mtp_states *s, int32_t pos);
/* The state at pos, or NULL when it is not kept. */
const float *loom_mtp_states_at(const loom_mtp_states *s, int32_t pos);

/* The ids a model's KV cache holds at positions 0.. while it drafts for another (n_ctx of room),
 * so that a chat's next turn evaluates only what changed; n = 0 whenever the model generates
 * as the target (its cache then holds other things). */
typedef struct loom_draft_cache {
    int32_t *ids;
    int32_t n;
    /* a multi-token-prediction drafter (loom_model_options.mtp): its KV cache holds positions
     * [0, n - 1), each the pair (the target's final hidden state there, the next id), and
     * states holds the target's states it has not taken yet */
    int mtp;
    loom_mtp_states states;
} loom_draft_cache;
loom_draft_cache *loom_model_draft_cache(loom_model *m);
/* Where a generation keeps its prompt's last logits (loom_prompt_logits): n_vocab floats. */
float *loom_model_prompt_logits_buffer(loom_model *m);
/* In a distributed job, on rank 0: on_stop(ctx, why) on another thread when a rank's process
 * ends (NULL: no more calls). Elsewhere, nothing. */
void loom_model_watch_stages(loom_model *m, void (*on_stop)(void *ctx, const char *why), void *ctx);

/* Generated bytes to displayable text: push each token's bytes, then show out[0..n_out).
 * Holds back an unfinished UTF-8 character and any tail that could still become a stop string;
 * push returns 1 when a stop string appeared (out then ends just before it; stop there), 0
 * otherwise, -1 when out of memory. flush releases whatever is held (at the end). */
typedef struct loom_text_stream {
    const char *const *stops;
    int n_stops;
    int stopped_by; /* 1 + the index of the stop string push found; 0 none */
    char *held, *out;
    size_t n_held, held_cap, n_out, out_cap;
} loom_text_stream;
void loom_text_stream_init(loom_text_stream *ts, const char *const *stops, int n_stops);
int loom_text_stream_push(loom_text_stream *ts, const char *bytes, size_t n);
void loom_text_stream_flush(loom_text_stream *ts);
void loom_text_stream_free(loom_text_stream *ts);

/* The model's file, as an xxh3 of its whole GGUF (a second or so for several GB): what a saved
 * prefix cache is checked against. */
uint64_t loom_model_fingerprint(const loom_model *m);

#endif
