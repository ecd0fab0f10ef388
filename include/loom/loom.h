/*
 * loom/loom.h - loom's embedding API: what the loom tools use, and what a program embedding
 * loom links against (-lloom, pkg-config loom).
 *
 * Errors are returned as a status (0 = success) plus a message in a caller-owned buffer.
 */
#ifndef LOOM_LOOM_H
#define LOOM_LOOM_H

#include <stddef.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The library's version, "MAJOR.MINOR.PATCH". */
const char *loom_version(void);
/* The git commit loom was configured from ("not a git checkout" for a release tarball). */
const char *loom_git_commit(void);

/* Finds every backend module, chooses one as a run would (LOOM_BACKEND, LOOM_CPU_VARIANT,
 * LOOM_CPU_MAX_ISA, scores), and writes the report to out: human-readable, or JSON when json
 * is nonzero. Returns 0 when a backend could be chosen; otherwise -1 with the reason in err
 * (the report is still written). */
int loom_backends_report(FILE *out, int json, char *err, size_t err_size);

/* Describes a model file (or a Hugging Face folder, converted in memory first): architecture, hyper-parameters, tokenizer, chat template and every
 * tensor, after checking that all tensor data lies inside the file. Writes text, or JSON when
 * json is nonzero. Returns 0, or -1 with err saying what is wrong with the file (nothing is
 * written then). */
int loom_inspect(const char *path, FILE *out, int json, char *err, size_t err_size);

/* Checks that a model file (or a Hugging Face folder) is whole, reading every byte: the GGUF
 * structure, the per-tensor checksums loom stores when it writes a file, that no weight is NaN
 * or Inf, that every layer is shaped as layer 0 and the family's hyper-parameters agree, and
 * that the tokenizer's size and special ids fit the vocabulary. Each check is reported through
 * report once, with the first problem's location. Returns the number of problems (0: whole). */
typedef enum loom_check_status {
    LOOM_CHECK_OK,
    LOOM_CHECK_PROBLEM,
    LOOM_CHECK_SKIPPED, /* does not apply to this file (the message says why) */
} loom_check_status;
typedef void (*loom_verify_fn)(void *user, const char *check, loom_check_status status,
                               const char *message);
int loom_verify(const char *path, loom_verify_fn report, void *user);

/* ---- Running a model ------------------------------------------------------------------- */

#include <loom/sampling_fields.h>

#include <stdint.h>

typedef struct loom_model loom_model;

typedef struct loom_model_options {
    int32_t n_ctx;        /* context length; 0: the model's, capped at 4096 */
    const char *kv_type;  /* "f16" (default), "f32" or "q8_0" */
    const char *backend;  /* a LOOM_BACKEND-style preference list; NULL: LOOM_BACKEND or best */
    int32_t n_threads;    /* 0: the backend's default */
    int32_t kv_blocks;    /* KV cache blocks for all sequences; 0: see kv_sequences */
    int32_t kv_sequences; /* with kv_blocks 0: room for this many sequences of up to 1024
                           * tokens (or n_ctx if shorter), never less than one whole context;
                           * 0: one sequence of n_ctx */
    int32_t block_size;   /* tokens per KV block; 0: loom_default_block_size() */
    const char *backend_module; /* a backend module file to run on, found or not (conformance,
                                 * a module under development); NULL: choose as above */
    /* Three behaviours, each 1 (on), -1 (off) or 0: as its environment variable says. */
    int32_t profile;   /* time every backend call (the trace plugin, no file), print a per-op
                        * table when the model closes (LOOM_PROFILE=1) */
    int32_t repack;    /* offer weights to the backend's own layout, prepare_weight (LOOM_REPACK,
                        * default on) */
    int32_t strict;    /* an op the backend lacks is an error, not run on the CPU (LOOM_STRICT=1) */
    const char *trace; /* record every backend call into this Chrome trace-event JSON file
                        * (Perfetto, chrome://tracing) and print the per-op table at close,
                        * through the trace plugin; NULL: LOOM_TRACE, if set */
    /* Run as a pipeline over the ranks of an MPI job (mpirun -np N, docs/DISTRIBUTED.md), rank
     * r holding stage r's layers on its own best backend; every caller then calls
     * loom_model_follow. 0: never (each process alone); 1: when in a job of two or more
     * processes, unless LOOM_DISTRIBUTED=0; 2: always (outside a job, an error). */
    int32_t distributed;
    const char *stage_layers; /* "N0,N1,...": layers per rank; NULL: balanced by weight bytes */
    /* A mixture-of-experts model's experts on another backend (a LOOM_BACKEND-style name, such
     * as "cpu" beside a GPU): their matrices are mapped or loaded there, and their matmuls run
     * there, while the rest of the model runs on the chosen backend. NULL: LOOM_EXPERTS_ON, if
     * set; else everything on the chosen backend. A dense model is refused with it. */
    const char *experts_on;
    /* Run only the model's first this many layers, then its final norm and head: the model's
     * own shallow layers as a speculative drafter (loom_speculation.draft), loading only their
     * weights; 0: every layer. Fewer than the model has; not with a pipeline. */
    int32_t first_layers;
    /* 1: open the model's own multi-token-prediction block (Qwen3.5's, Qwen3-Next's: GGUF
     * nextn_predict_layers) as a speculative drafter (loom_speculation.draft) for the model
     * opened from the same file: it proposes from the model's final hidden states, loading only
     * that block, the embeddings and the head. A file without one is refused. */
    int32_t mtp;
} loom_model_options;

/* How the next token is chosen: a member per row of <loom/sampling_fields.h>, whose rows say
 * each one's default, range and meaning. */
typedef struct loom_sampling {
    LOOM_SAMPLING_FIELDS(LOOM_SAMPLING_MEMBER)
} loom_sampling;

/* The defaults, the list's: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, no penalties,
 * seed 0. */
loom_sampling loom_sampling_defaults(void);

/* The layout of loom_sampling, for a binding that reads it rather than keep a copy (the Python
 * package): a row per parameter, in order; *n set to their count. */
typedef enum loom_sampling_kind {
    LOOM_SAMPLING_KIND_FLOAT, /* float */
    LOOM_SAMPLING_KIND_INT,   /* int32_t */
    LOOM_SAMPLING_KIND_SEED,  /* uint64_t */
    LOOM_SAMPLING_KIND_BOOL   /* int */
} loom_sampling_kind;
typedef struct loom_sampling_field {
    const char *name;
    loom_sampling_kind kind;
    size_t offset;
} loom_sampling_field;
const loom_sampling_field *loom_sampling_fields(int *n);

typedef struct loom_generation {
    int32_t n_prompt, n_generated;
    double ttft_ms; /* time to first token: the prefill plus one sample */
    double prefill_tok_s, decode_tok_s;
    int stopped_at_eos;
    /* speculative decoding (loom_generate_speculative): tokens proposed, those the model
     * accepted, and its passes that checked proposals (verify steps) */
    int32_t n_drafted, n_accepted, n_verify;
} loom_generation;

/* Called with each generated token and its text (possibly empty, possibly holding bytes held
 * back from earlier tokens so UTF-8 characters are never split). Return nonzero to stop. */
typedef int (*loom_token_fn)(void *user, int32_t id, const char *text, size_t len);

/* Opens a model on the chosen backend: a GGUF file, or a Hugging Face folder (converted in
 * memory, keeping its weights' precision, with a progress bar on stderr). NULL with err on
 * failure. */
loom_model *loom_model_open(const char *path, const loom_model_options *opts, char *err,
                            size_t err_size);
void loom_model_close(loom_model *m);
/* 1 when loom_model_open with this `distributed` would run a pipeline: the process is one of two
 * or more that mpirun (or another PMI launcher) started, and LOOM_DISTRIBUTED is not 0 (for
 * 1). A tool asks before it spawns processes of its own, which could not join the job. */
int loom_distributed_job(int32_t distributed);
/* In a distributed job, every rank but 0 runs no command of its own: this serves its pipeline
 * stage until rank 0 closes its model, then returns 1 (close the model and exit). Returns 0 on
 * rank 0 and without a job (run the command), -1 with err when the job broke. */
int loom_model_follow(loom_model *m, char *err, size_t err_size);
/* "cpu-avx512 (device 0)" and the like; for a pipeline, every rank's layers, host and backend. */
const char *loom_model_backend(const loom_model *m);
int32_t loom_model_n_vocab(const loom_model *m);
/* The width of the model's hidden state: an embedding's length. */
int32_t loom_model_n_embd(const loom_model *m);
/* 1 when loom never generates id: outside the tokenizer's vocabulary, or a placeholder row
 * (token type UNUSED: the padding that gives every embedding row a token). */
int loom_model_token_unused(const loom_model *m, int32_t id);
int32_t loom_model_n_ctx(const loom_model *m);
/* A model with recurrent layers (Qwen3.5): the bytes of state each running sequence holds
 * beside its KV blocks (twice that is allocated: a checkpoint for speculative decoding); 0 for
 * a model without them. */
uint64_t loom_model_state_bytes(const loom_model *m);
/* The KV cache's bytes per token of a sequence, over every layer that keeps one (keys and
 * values; one latent per layer under latent attention); what decode reads per token of
 * context. */
uint64_t loom_model_kv_bytes_per_token(const loom_model *m);
/* The attention window of a sliding-window model (Mistral's sliding_window): a token sees the
 * keys of at most this many positions, its own included; 0 when it sees them all. */
int32_t loom_model_sliding_window(const loom_model *m);
/* Tokens per KV cache block when loom_model_options.block_size is 0 (16). */
int32_t loom_default_block_size(void);

/* How special-token strings in text ("<s>", "<|user|>") are read: parse_special. */
enum {
    LOOM_SPECIAL_NONE = 0, /* as plain characters */
    LOOM_SPECIAL_TEXT = 1, /* those the family's reference tokenizer recognises in a user's text
                            * (docs/tokenizers.md: ChatGLM3 its role tokens, ChatGLM-6B none,
                            * Llama and Qwen all of them) */
    LOOM_SPECIAL_ALL = 2,  /* every control and user-defined token: a chat template's output */
};

/* Text to ids; add_special: BOS and the like. Returns the count (may exceed cap: call again),
 * or -1 with err. */
int64_t loom_tokenize(loom_model *m, const char *text, int add_special, int parse_special,
                      int32_t *ids, int64_t cap, char *err, size_t err_size);
/* As loom_tokenize, for len bytes of text (NUL is a character like any other), with special
 * tokens parsed only outside the n_plain spans (sorted, not overlapping; NULL: none): a
 * rendered chat, LOOM_SPECIAL_ALL, with the messages' own text as the spans. */
struct loom_text_span;
int64_t loom_tokenize_spans(loom_model *m, const char *text, size_t len, int add_special,
                            int parse_special, const struct loom_text_span *plain, int n_plain,
                            int32_t *ids, int64_t cap, char *err, size_t err_size);
/* The longest prompt in bytes that could still fit the context: n_ctx times the longest
 * token's text. A longer one is refused without tokenizing it. */
size_t loom_model_max_prompt_bytes(const loom_model *m);

/* Runs the prompt from position 0 (a fresh sequence) and generates up to n_predict tokens,
 * stopping at the model's EOS. Returns 0, or -1 with err. */
int loom_generate(loom_model *m, const int32_t *prompt, int32_t n_prompt, int32_t n_predict,
                  const loom_sampling *s, loom_token_fn on_token, void *user,
                  loom_generation *stats, char *err, size_t err_size);
/* The logits of the last prompt position of the last loom_generate (n_vocab floats). */
const float *loom_prompt_logits(const loom_model *m);
/* Evaluates ids from position 0 of a fresh sequence and writes every position's logits to out
 * (n rows of loom_model_n_vocab floats): what perplexity needs. Returns 0, or -1 with err. */
int loom_eval_logits(loom_model *m, const int32_t *ids, int32_t n, float *out, char *err,
                     size_t err_size);

/* Bytes of weights one decode step reads (all tensors but the embedding table, of which it
 * reads a row; of a mixture-of-experts stack, the share of the experts a token is routed to):
 * what a memory-bandwidth roofline divides by. */
uint64_t loom_model_weight_bytes(const loom_model *m);
/* "q4_0" and the like: the type of most of the model's weight bytes. */
const char *loom_model_weight_type(const loom_model *m);
/* How many weights run in a layout the backend made for them (its prepare_weight, such as the
 * CPU's interleaved Q4_0 rows); a weight is prepared on its first matmul, so this counts those
 * used so far. 0 with LOOM_REPACK=0 or a backend that keeps the file's layout. */
int64_t loom_model_prepared_weights(const loom_model *m);
const char *loom_model_name(const loom_model *m);
/* 1 when a sequence's cached keys and values stay valid as it grows, so a longer prompt may
 * reuse them: every family but ChatGLM-6B, whose prompt prefix attends both ways. */
int loom_model_extends_cache(const loom_model *m);

/* Like loom_generate, but the prompt continues a sequence already evaluated up to pos0 (its
 * KV cache is reused: a chat turn evaluates only what the conversation added). Needs
 * loom_model_extends_cache (an error otherwise). */
int loom_generate_from(loom_model *m, const int32_t *prompt, int32_t n_prompt, int32_t pos0,
                       int32_t n_predict, const loom_sampling *s, loom_token_fn on_token,
                       void *user, loom_generation *stats, char *err, size_t err_size);

/* ---- Speculative decoding ------------------------------------------------------------------
 * A cheap drafter proposes the next few tokens; the model checks them all in one pass and keeps
 * the longest prefix it agrees with, plus one token of its own. Greedy output is the model's own
 * token for token; sampled output keeps the model's distribution (speculative sampling: a draft
 * token d is kept with probability min(1, p(d) / q(d)), else one is drawn from the normalised
 * max(0, p - q), p and q after the same temperature, truncation and penalties). How many tokens
 * to propose is chosen per step from the measured acceptance and costs, down to none, so a
 * drafter that rarely agrees costs little. */
typedef struct loom_speculation {
    /* a drafter model: another model with the same vocabulary (a smaller or more quantised one
     * of the family), this model's own first layers (opened with
     * loom_model_options.first_layers), or its multi-token-prediction block (opened from the
     * same file with loom_model_options.mtp); NULL: none */
    loom_model *draft;
    /* or prompt lookup, no model: the continuation of the latest earlier occurrence of the
     * text's last n tokens, n from this down to 2 (1 when this is 1); 0: off */
    int32_t lookup;
    int32_t draft_max; /* tokens proposed per check at most; 0: 8 */
    int32_t draft_min; /* fewer proposed than this are not checked; 0: 1 */
    /* a drafter model stops proposing at a token it gives less than this probability (its
     * softmax; greedy: at temperature 1); 0: never */
    float p_min;
    /* 1: propose draft_max tokens whenever the drafter can, whatever they cost (measuring);
     * 0: choose the length by the measured acceptance and costs */
    int fixed;
} loom_speculation;

/* Whether spec can draft for m: its numbers in range, one drafter, and a drafter model that
 * spells every id as m does (else err names the first id that differs). 0, or -1 with err. */
int loom_speculation_check(loom_model *m, const loom_speculation *spec, char *err, size_t err_size);
/* loom_generate_from with a drafter (spec NULL, or neither draft nor lookup: none). A drafter
 * model with another vocabulary is refused, naming the first id whose text differs. */
int loom_generate_speculative(loom_model *m, const loom_speculation *spec, const int32_t *prompt,
                              int32_t n_prompt, int32_t pos0, int32_t n_predict,
                              const loom_sampling *s, loom_token_fn on_token, void *user,
                              loom_generation *stats, char *err, size_t err_size);

/* ---- Serving many requests at once ---------------------------------------------------- */

/* An engine owns a model (nothing else may use it while the engine runs) and a thread that
 * runs it: every step it admits waiting requests while KV blocks and the token budget allow,
 * runs one forward over all running sequences (decode tokens plus chunks of prefill), samples,
 * and retires finished requests at once. Prompts that share a prefix with earlier ones reuse
 * its KV blocks. Waiting requests are admitted by priority (lower first, improving with the
 * time waited: loom_engine_options.aging_ms), then arrival; at most max_queue wait, and a
 * request past that is refused at once, unless it has a better priority than a waiting one
 * that has not started: the worst of those (the newest among equals) is refused in its place
 * (an ERROR event with busy set). A full batch preempts its worst running request for
 * a waiting one of better priority. When blocks run out, the running request of the
 * worst priority (the newest among equals) is preempted: its blocks are freed and it is
 * recomputed later (its output is unchanged). A request past its deadline is ended: with an
 * error while it waits, with what it has while it generates. Worse prompts yield to better
 * arrivals: a step that admits a request runs no prefill of a worse priority beside it, and
 * while requests of a better priority have arrived in the last 2 s, worse prompts are prefilled
 * in chunks of half those requests' mean prompt (8 tokens at least) a step, so that a better
 * request arriving next waits for a short step. */
typedef struct loom_engine loom_engine;

typedef struct loom_engine_options {
    int32_t max_batch;           /* running sequences; 0: 16 */
    int32_t max_tokens_per_step; /* tokens per forward; 0: 256 */
    /* requests waiting to run at most (those past it are refused with LOOM_ENGINE_BUSY);
     * 0: 8 x max_batch */
    int32_t max_queue;
    /* the starvation bound: a waiting request's priority improves by one for every aging_ms
     * it has waited, so that any request runs in the end; 0: 10000 (10 s) */
    int32_t aging_ms;
    /* with nothing running, a prefill waits until max_batch requests are there or the first
     * has waited this long, so that requests arriving together start together; 0: never */
    double batch_wait_ms;
    /* a drafter model for speculative decoding (loom_request.draft): the same vocabulary,
     * used by the engine alone while it runs, its KV cache (kv_blocks) shared by the requests
     * it drafts for; it proposes its most likely tokens, stopping at one it gives less than
     * draft_p_min (its softmax). NULL: none */
    loom_model *draft;
    float draft_p_min;
    /* speculative proposals fill a step only up to this many decode tokens and proposals
     * together: the width below which a step streams weights rather than computes (0: 16, a
     * CPU's; a GPU's is wider) */
    int32_t spec_rows;
    /* the prefix cache kept across restarts: read back from this file at start when it holds
     * this model's (loom_engine_prefix_status says what became of it), written by
     * loom_engine_save_prefixes; NULL: none */
    const char *prefix_file;
} loom_engine_options;

/* loom_engine_submit's answer when the queue is full: try again later */
#define LOOM_ENGINE_BUSY (-2)

typedef enum loom_event_kind {
    LOOM_EVENT_TEXT, /* one per generated token (its id), with the text that became final,
                         possibly none (bytes of an unfinished character or of a possible stop
                         string wait); token -1: the held text flushed at the end */
    LOOM_EVENT_DONE, /* the last event: finish_reason and counts */
    LOOM_EVENT_ERROR /* the last event: error says why */
} loom_event_kind;

typedef struct loom_event {
    loom_event_kind kind;
    int32_t token;
    const char *text;
    size_t len;
    const char *finish_reason; /* "stop", "length", "cancelled" */
    const char *error;
    int32_t n_prompt, n_generated, n_cached; /* n_cached: prompt tokens found in the cache */
    double ttft_ms;
    /* the request's deadline ended it: an ERROR when it had not started (still waiting), a
     * DONE "length" with what it had generated when it had */
    int32_t deadline;
    /* with loom_request.logprobs, for a TEXT event's token: its log-probability under the
     * model's distribution (before any sampling transform), and the n_top likeliest tokens'
     * (most likely first); valid during the callback */
    float logprob;
    int32_t n_top;
    const int32_t *top_ids;
    const float *top_logprobs;
    /* an embedding request's DONE event: its embedding, n_embd floats, valid during the
     * callback */
    const float *embedding;
    int32_t n_embd;
    /* an ERROR because the queue was full and a request of better priority took this one's
     * place before it started (what a full queue answers at submission otherwise): try again
     * later */
    int32_t busy;
    /* the last event: how long the request waited, from submission to its admission (0 when
     * it never started) */
    double queue_ms;
    /* an ERROR the request's own grammar caused: too ambiguous to follow, or past a limit of
     * its automaton (the client's to change, as a 400 says) */
    int32_t invalid;
    /* a DONE "stop" that one of loom_request.stop ended: 1 + its index; 0 otherwise (the
     * model's end of text, or another finish) */
    int32_t stop_string;
    /* a DONE event of a request with loom_request.reasoning: the tokens the model spent in its
     * thought (the closing tokens a budget forced not counted) */
    int32_t reasoning_tokens;
    /* of n_cached, the prompt tokens found in blocks restored from the saved prefix cache */
    int32_t n_cached_restored;
} loom_event;

/* Called on the engine thread (or, when a rank of a distributed job dies, once with the error
 * on the thread that noticed), never twice at a time: copy what you keep, return quickly. */
typedef void (*loom_event_fn)(void *user, const loom_event *ev);

typedef struct loom_grammar loom_grammar; /* a grammar an answer must match (below) */

/* How an embedding request pools its prompt's final hidden states (after the model's final
 * norm, before its head): the last token's, what decoder embedding models (Qwen3-Embedding,
 * e5-mistral, gte-Qwen) are trained with; or their mean over the prompt. */
typedef enum loom_pooling {
    LOOM_POOL_NONE = 0, /* not an embedding request: generate */
    LOOM_POOL_LAST,
    LOOM_POOL_MEAN
} loom_pooling;

/* The embedding of one prompt, outside an engine: its final hidden states pooled (how: LAST or
 * MEAN), scaled to length one when normalize, into out (loom_model_n_embd floats). The same
 * numbers an engine's embedding request gets; like loom_eval_logits it overwrites the model's
 * cache (a loom_generate_from after it starts at 0). Not on a pipeline. 0, or -1 with err. */
int loom_embed(loom_model *m, const int32_t *ids, int32_t n, loom_pooling how, int normalize,
               float *out, char *err, size_t err_size);

typedef struct loom_request {
    const int32_t *prompt;
    int32_t n_prompt;
    int32_t max_tokens; /* < 0: up to the end of the context */
    loom_sampling sampling;
    const char *const *stop; /* stop strings (copied), none when n_stop is 0 */
    int n_stop;
    /* the prefix cache shares KV blocks only between requests of one partition (0: the
     * common one); a server gives each client its own so that cache hits (and their timing)
     * say nothing about other clients' prompts */
    uint64_t cache_partition;
    /* lower runs first (admission, and the last to be preempted); equal priorities in order
     * of arrival; 0 is the usual */
    int32_t priority;
    /* milliseconds from submission the request may take, waiting and generating; 0: none */
    double timeout_ms;
    /* who sent it (a server's API key), 1 to LOOM_MAX_TENANTS, 0: nobody in particular. At
     * equal priority the waiting request whose tenant runs fewer goes first (round robin
     * between tenants); a tenant's requests run at most tenant_max_running at a time and
     * wait at most tenant_max_queue (past it, LOOM_ENGINE_BUSY); 0: no limit of its own */
    int32_t tenant, tenant_max_running, tenant_max_queue;
    /* control tokens the model writes appear in the text as their own ("<|python_tag|>"),
     * not as nothing: a tool-call parser needs them */
    int control_text;
    /* the answer must match it (the engine holds a reference while it runs); NULL: free.
     * An answer the grammar completes ends there ("stop") */
    loom_grammar *grammar;
    /* each token's log-probability comes with its event, and the top_logprobs likeliest
     * alternatives' (0 to LOOM_MAX_TOP_LOGPROBS) */
    int logprobs;
    int32_t top_logprobs;
    /* an embedding instead of an answer (pooling not LOOM_POOL_NONE): nothing is generated
     * and the DONE event carries the pooled hidden state, scaled to length one unless
     * embed_unnormalized. It runs in the batch beside the others; with LOOM_POOL_MEAN every
     * prompt token is computed (the prefix cache cannot give hidden states) */
    loom_pooling pooling;
    int embed_unnormalized;
    /* speculative decoding: proposals from the request's own text (prompt lookup, n-grams up
     * to lookup; 0: off) or from the engine's drafter model (draft, loom_engine_options.draft),
     * checked in the batched step and kept only where sampling would have drawn them, so the
     * output is as without. At most draft_max a step (0: 8), fewer as the batch fills or the
     * request's proposals are rejected */
    int32_t lookup, draft_max;
    int draft;
    /* the answer's thought: 1, it may open with one (<think>...</think>, as reasoning models'
     * templates write them); 2, it opens inside one (the prompt opened it); 0, it is not read
     * for thoughts. The engine counts the thought's tokens (the DONE event's
     * reasoning_tokens), and with reasoning_budget > 0 ends a thought that has spent that many
     * by forcing "\n</think>\n\n" (the answer follows it); 0: no limit. A request with a
     * grammar is not held to a budget. */
    int reasoning;
    int32_t reasoning_budget;
} loom_request;

#define LOOM_MAX_TOP_LOGPROBS 20

#define LOOM_MAX_TENANTS 256

#define LOOM_STATS_PRIORITIES 8
typedef struct loom_engine_stats {
    int32_t running, waiting;
    int32_t kv_blocks, kv_used, kv_cached, kv_free, block_size;
    uint64_t prompt_tokens, cached_prompt_tokens, generated_tokens;
    uint64_t requests_done, preemptions, steps;
    double tokens_per_s;       /* generated, recent average */
    uint64_t refused_busy;     /* refused for a full queue: at submission (LOOM_ENGINE_BUSY),
                                * or displaced later by a better priority (an ERROR, busy) */
    uint64_t displaced;        /* of them, the displaced */
    uint64_t deadline_waiting; /* requests whose deadline came while they waited */
    uint64_t deadline_running; /* ... and while they generated (stopped with what they had) */
    int32_t max_queue;
    uint64_t drafted, accepted; /* speculative proposals checked, and kept */
    /* the waiting requests by their own priority, best first: waiting_count[i] of them wait at
     * waiting_priority[i] (i < n_waiting_priorities); when more priorities wait than there are
     * slots, the last slot counts its priority and every worse one */
    int32_t n_waiting_priorities;
    int32_t waiting_priority[LOOM_STATS_PRIORITIES], waiting_count[LOOM_STATS_PRIORITIES];
    /* the saved prefix cache (prefix_file): blocks restored at start, and prompt tokens found
     * in them since */
    int32_t prefix_blocks_restored;
    uint64_t restored_hit_tokens;
} loom_engine_stats;

loom_engine *loom_engine_start(loom_model *m, const loom_engine_options *o, char *err,
                               size_t err_size);
/* What became of loom_engine_options.prefix_file: restored (how much) or not used (why), or
 * saved; "" without one. */
const char *loom_engine_prefix_status(const loom_engine *e);
/* Writes the prefix cache to loom_engine_options.prefix_file (beside, then renamed over it),
 * after loom_engine_stop; a model with recurrent layers keeps none. 0, or -1 with err. */
int loom_engine_save_prefixes(loom_engine *e, char *err, size_t err_size);
/* Stops accepting, lets running and waiting requests finish for up to drain_ms, cancels the
 * rest (their callbacks get DONE "cancelled") and joins the thread. Submit and cancel stay safe
 * to call (submit refuses) until loom_engine_free. */
void loom_engine_stop(loom_engine *e, int drain_ms);
void loom_engine_free(loom_engine *e);
/* Queues a request; events arrive on fn. Returns its id (> 0), LOOM_ENGINE_BUSY with err when
 * max_queue requests are waiting already, or -1 with err (a prompt that does not fit the
 * context, an engine that is stopping). Thread-safe. */
int64_t loom_engine_submit(loom_engine *e, const loom_request *r, loom_event_fn fn, void *user,
                           char *err, size_t err_size);
/* Cancels a request (a client went away); its blocks are freed on the next step and it gets
 * DONE "cancelled". Unknown or finished ids are ignored. Thread-safe. */
void loom_engine_cancel(loom_engine *e, int64_t id);
loom_engine_stats loom_engine_get_stats(loom_engine *e);

/* ---- Text ------------------------------------------------------------------------------ */

/* How many leading bytes of text are well-formed UTF-8 (len when all are). */
size_t loom_utf8_valid_prefix(const char *text, size_t len);
/* A malloc'd, NUL-terminated copy of len bytes of text in which every ill-formed UTF-8
 * sequence is U+FFFD, one per maximal subpart as Python's and ICU's decoders replace them;
 * its length in *out_len. NULL when out of memory. */
char *loom_utf8_sanitize(const char *text, size_t len, size_t *out_len);
/* How many leading bytes of s (n bytes) end on a character boundary: what a stream can send
 * now, holding back a character whose last bytes have not come yet. */
size_t loom_utf8_complete(const char *s, size_t n);

/* ---- Chat templates -------------------------------------------------------------------- */

typedef struct loom_chat_message {
    const char *role; /* "system", "user", "assistant" */
    const char *content;
} loom_chat_message;

/* Renders a conversation with a built-in template (loom_chat_templates() lists them); with
 * add_generation_prompt, ends with the opening of the assistant's turn. *out is malloc'd. */
int loom_chat_render(const char *name, const loom_chat_message *msgs, int n,
                     int add_generation_prompt, char **out, char *err, size_t err_size);
/* Bytes [start, end) of a text. */
typedef struct loom_text_span {
    size_t start, end;
} loom_text_span;
/* As loom_chat_render, and where the messages' own text lies in *out (*spans malloc'd, in
 * order, *n_spans of them): tokenized as plain text (loom_tokenize_spans), a message cannot
 * forge the template's control tokens ("<|im_start|>system" typed by a user stays text). */
int loom_chat_render_spans(const char *name, const loom_chat_message *msgs, int n,
                           int add_generation_prompt, char **out, loom_text_span **spans,
                           int *n_spans, char *err, size_t err_size);
const char *loom_chat_templates(void);
int loom_chat_template_valid(const char *name);
/* The template a model wants: recognised from the template text its file carries, else by its
 * architecture. *recognised is 0 when that was a guess (say so to the user). */
const char *loom_model_chat_template(const loom_model *m, int *recognised);

/* ---- The model's own chat template (Jinja) ------------------------------------------------
 * A model file's tokenizer.chat_template (a Hugging Face folder's tokenizer_config.json) run
 * as transformers' apply_chat_template runs it, byte for byte, by loom's Jinja subset
 * (chat/jinja.c; docs/chat-templates.md). Sandboxed: a render is bounded in output, memory,
 * steps and nesting, and reads no file, clock beyond strftime_now, or environment. */
typedef struct loom_chat_template loom_chat_template;

typedef struct loom_chat_vars {
    const char *messages_json; /* an OpenAI messages array: role, content, tool_calls, ... */
    const char *tools_json;    /* a tools array, or NULL: the template sees none */
    const char *kwargs_json;   /* an object of more variables (enable_thinking, ...), or NULL */
    int add_generation_prompt; /* end with the opening of the assistant's turn */
} loom_chat_vars;

/* Compiles Jinja text; bos_token and eos_token are what the template sees by those names
 * (NULL: ""). NULL with err ("template line N: ...") when loom's Jinja cannot run it. */
loom_chat_template *loom_chat_template_compile(const char *jinja, const char *bos_token,
                                               const char *eos_token, char *err, size_t err_size);
/* The template a model file (GGUF or Hugging Face folder) carries, with its BOS and EOS text.
 * NULL with err: the file has none, or loom's Jinja cannot run it (err says which). */
loom_chat_template *loom_model_chat_jinja(const loom_model *m, char *err, size_t err_size);
loom_chat_template *loom_chat_template_from_file(const char *model_path, char *err,
                                                 size_t err_size);
void loom_chat_template_free(loom_chat_template *t);
/* "bos_token" or "eos_token" as the template sees it ("" for another name). */
const char *loom_chat_template_token(const loom_chat_template *t, const char *name);
/* Renders a conversation. *out is malloc'd; *spans (malloc'd, may be NULL) are where the
 * messages' and tools' own text landed: tokenize with loom_tokenize_spans so a message cannot
 * forge control tokens. -1 with err: bad JSON, or the template refused (raise_exception's
 * message) or passed a limit. */
int loom_chat_template_render(const loom_chat_template *t, const loom_chat_vars *vars, char **out,
                              loom_text_span **spans, int *n_spans, char *err, size_t err_size);

/* What a command renders conversations with: a Jinja template (the model's own, or a file's),
 * or a built-in format. */
typedef struct loom_chat_format {
    loom_chat_template *jinja; /* or NULL: */
    const char *builtin;       /* the built-in format's name */
    char about[512];           /* which one and why, in a line for the log */
} loom_chat_format;

/* Chooses: the built-in named by builtin_name (--chat-template) if given; else the Jinja file
 * jinja_file (--chat-template-file) if given; else the model's own template when loom's Jinja
 * runs it; else the built-in format the model's family uses (about says why). -1 with err only
 * for a bad name or file. */
int loom_chat_format_choose(const loom_model *m, const char *builtin_name, const char *jinja_file,
                            loom_chat_format *f, char *err, size_t err_size);
void loom_chat_format_free(loom_chat_format *f);
/* Renders a conversation of role/content messages with f (kwargs_json: the template's extra
 * variables, NULL for none; a built-in format takes none). *add_special says whether tokenizing
 * the prompt adds the family's BOS: a Jinja template writes its own, as transformers has it. */
int loom_chat_format_render(const loom_chat_format *f, const loom_chat_message *msgs, int n,
                            const char *kwargs_json, int add_generation_prompt, char **out,
                            loom_text_span **spans, int *n_spans, int *add_special, char *err,
                            size_t err_size);
/* The same from JSON (an OpenAI conversation with tool calls and results, tools, kwargs): a
 * built-in format takes role/content messages only and refuses tools and kwargs. */
int loom_chat_format_render_vars(const loom_chat_format *f, const loom_chat_vars *v, char **out,
                                 loom_text_span **spans, int *n_spans, int *add_special, char *err,
                                 size_t err_size);

/* ---- Tool calls ---------------------------------------------------------------------------
 * How a family writes a call to one of the request's tools in its answer. A chat format's
 * template says which (loom_chat_format_tool_syntax); loom_tool_calls_parse reads them back. */
typedef enum loom_tool_syntax {
    LOOM_TOOLS_NONE,    /* the template renders no tools */
    LOOM_TOOLS_UNKNOWN, /* it renders tools in a form loom cannot read back */
    LOOM_TOOLS_HERMES,  /* <tool_call>{"name": N, "arguments": {..}}</tool_call> (Qwen, Hermes) */
    LOOM_TOOLS_LLAMA3,  /* {"name": N, "parameters": {..}}, bare or after <|python_tag|> */
    LOOM_TOOLS_MISTRAL, /* [TOOL_CALLS][{"name", "arguments"}, ..] or [TOOL_CALLS]N[ARGS]{..} */
    LOOM_TOOLS_GLM4,    /* N\n{..} as the whole answer (GLM-4, GLM-4-0414) */
    LOOM_TOOLS_GLM45,   /* <tool_call>N<arg_key>K</arg_key><arg_value>V</arg_value></tool_call> */
} loom_tool_syntax;

const char *loom_tool_syntax_name(loom_tool_syntax s);
loom_tool_syntax loom_chat_format_tool_syntax(const loom_chat_format *f);

typedef struct loom_tool_call {
    char *name;
    char *arguments; /* a JSON object's text, compact */
    char *id;        /* the id the model wrote (Mistral's), or NULL */
} loom_tool_call;

typedef struct loom_tool_calls {
    size_t content_len; /* the answer's own text is its first content_len bytes */
    loom_tool_call *calls;
    int n_calls;
} loom_tool_calls;

/* Reads the calls of a finished answer. A call counts only when whole: its JSON parses, its
 * arguments are an object and, when names are given (n_names > 0), it names one of them;
 * otherwise the answer is all text (n_calls 0, content_len len). -1 only when out of memory. */
int loom_tool_calls_parse(loom_tool_syntax s, const char *text, size_t len,
                          const char *const *names, int n_names, loom_tool_calls *out);
void loom_tool_calls_free(loom_tool_calls *c);
/* While an answer streams: how many of its first len bytes are surely text, not (the start
 * of) a tool call, so they can be sent now. */
size_t loom_tool_calls_text_prefix(loom_tool_syntax s, const char *text, size_t len,
                                   const char *const *names, int n_names);
/* The GBNF of an answer that is nothing but calls, in syntax s, to the functions of tools_json
 * (an OpenAI tools array), or only to the one named only (NULL: any), with arguments that match
 * each function's parameters schema; up to 8 calls when parallel, else one. NULL with err. */
char *loom_tool_calls_gbnf(loom_tool_syntax s, const char *tools_json, const char *only,
                           int parallel, char *err, size_t err_size);

/* A reasoning model's thought, <think>...</think> before its answer (Qwen3, GLM-4.5,
 * DeepSeek-R1), in an answer's text: the thought is text[start, end) and the answer proper
 * starts at content. starts_inside: the prompt ended with <think> (the model writes only the
 * close). Unfinished (done 0), a thought not yet closed is open, and end stops short of what
 * may be the start of its close. Without a thought, start = end = content = 0. */
typedef struct loom_reasoning {
    size_t start, end, content;
    int open; /* the thought has not ended (or may not have begun): the answer is not yet */
} loom_reasoning;
void loom_reasoning_find(const char *text, size_t len, int starts_inside, int done,
                         loom_reasoning *r);
/* Whether a chat format's template writes thoughts (it knows <think>). */
int loom_chat_format_reasons(const loom_chat_format *f);

/* ---- Constrained decoding -----------------------------------------------------------------
 * A grammar an answer must match (loom_request.grammar): llama.cpp's GBNF, or the JSON texts
 * a JSON Schema allows (chat/grammar.c, chat/json_schema.c; docs/structured-output.md). */

/* Compiles GBNF text (its rule "root" is the answer). NULL with err ("grammar line N: ..."). */
loom_grammar *loom_grammar_compile(const char *gbnf, char *err, size_t err_size);
/* The GBNF for the JSON texts that satisfy a JSON Schema (malloc'd). NULL with err naming a
 * keyword loom does not support, or what is wrong with the schema. */
char *loom_json_schema_to_gbnf(const char *schema_json, char *err, size_t err_size);
loom_grammar *loom_grammar_from_json_schema(const char *schema_json, char *err, size_t err_size);
/* Grammars are shared by reference count: the engine holds one while a request runs. */
loom_grammar *loom_grammar_ref(loom_grammar *g);
void loom_grammar_free(loom_grammar *g);

/* What one answer of loom_generate_constrained must be. */
typedef struct loom_constraint {
    /* the answer must match it, and one it completes ends there; NULL: free */
    loom_grammar *grammar;
    /* control tokens the model writes appear in the text as their own ("<tool_call>"), not as
     * nothing: what loom_tool_calls_parse reads */
    int control_text;
} loom_constraint;
/* loom_generate_from under a constraint (c NULL: none), as an engine's request with the same
 * grammar and sampling draws it (the same tokens for the same seed). */
int loom_generate_constrained(loom_model *m, const loom_constraint *c, const int32_t *prompt,
                              int32_t n_prompt, int32_t pos0, int32_t n_predict,
                              const loom_sampling *s, loom_token_fn on_token, void *user,
                              loom_generation *stats, char *err, size_t err_size);

/* ---- Tokenizers alone ------------------------------------------------------------------ */

typedef struct loom_vocab loom_vocab;

/* The tokenizer of a GGUF file or Hugging Face folder, without loading the model for running. */
loom_vocab *loom_vocab_open(const char *path, char *err, size_t err_size);
void loom_vocab_close(loom_vocab *v);
int32_t loom_vocab_size(const loom_vocab *v);
/* As loom_tokenize. */
int64_t loom_vocab_encode(const loom_vocab *v, const char *text, int add_special, int parse_special,
                          int32_t *ids, int64_t cap);
/* The text of token id printed after prev (-1 at the start); bytes written (<= cap), or -1 for
 * an id outside the vocabulary. */
int loom_vocab_piece(const loom_vocab *v, int32_t prev, int32_t id, char *out, int cap);
/* The same with a loaded model's tokenizer. */
int loom_token_piece(const loom_model *m, int32_t prev, int32_t id, char *out, int cap);

/* ---- Converting ------------------------------------------------------------------------ */

/* Called after each tensor: done of total, and its GGUF name. */
typedef void (*loom_convert_progress_fn)(void *user, int done, int total, const char *what);
/* A progress callback for commands: on a terminal a bar on stderr labelled with `user` (a
 * string; NULL: "converting"), redrawn in place; otherwise (a log, CI) one line when done. */
void loom_progress_stderr(void *user, int done, int total, const char *what);

/* Converts a Hugging Face folder (config.json, *.safetensors, tokenizer files) to a GGUF file.
 * type: "auto" (keep f32/f16/bf16 as stored), f32, f16, bf16, q8_0, q4_0, q4_1. Returns 0,
 * or -1 with err. */
int loom_convert(const char *dir, const char *out, const char *type,
                 loom_convert_progress_fn progress, void *user, char *err, size_t err_size);

/* Writes a GGUF holding only the tokenizer of a folder (tokenizer.model, tokenizer.json, or
 * vocab.json + merges.txt, with tokenizer_config.json): for loom_vocab_open and tests. */
int loom_convert_tokenizer(const char *dir, const char *out, char *err, size_t err_size);

/* Requantises a GGUF file: every matrix stored as f32, f16 or bf16 becomes `type`, a type or
 * a mix (loom_quantize_types() lists them). A mix chooses per tensor as llama.cpp's quantizer
 * does (q4_k_m: q4_K, with q6_K for the output and some attn_v / ffn_down layers; a row that
 * its blocks do not divide gets a 32-element type). 1-D tensors and tensors already quantised
 * are copied unchanged; metadata is copied, general.file_type set to the mix's number. A line
 * on stderr says how many tensors got each type. */
int loom_quantize(const char *in, const char *out, const char *type,
                  loom_convert_progress_fn progress, void *user, char *err, size_t err_size);
/* "f32, f16, ..., q4_k_m, ...": what loom_quantize takes. */
const char *loom_quantize_types(void);
/* loom_quantize with flags: LOOM_QUANTIZE_PURE gives every float matrix the type's base type,
 * output included (llama-quantize's --pure). */
enum { LOOM_QUANTIZE_PURE = 1 };
int loom_quantize_opts(const char *in, const char *out, const char *type, int flags,
                       loom_convert_progress_fn progress, void *user, char *err, size_t err_size);

/* Writes a deterministic synthetic Llama-shaped model (random weights, a placeholder
 * vocabulary) to path. shape: one of loom_synthetic_shapes(); type: one of
 * loom_synthetic_types() (every weight type; rows must be whole blocks of it). Returns 0, or -1
 * with err. */
int loom_write_synthetic_model(const char *path, const char *shape, const char *type, char *err,
                               size_t err_size);
/* The same with the tokenizer of another model file (its vocabulary sizes the embeddings), for
 * measuring what a real vocabulary costs (NULL: the placeholder). */
int loom_write_synthetic_model_vocab(const char *path, const char *shape, const char *type,
                                     const char *vocab_from, char *err, size_t err_size);
const char *loom_synthetic_shapes(void);
/* The weight types it writes, space-separated. */
const char *loom_synthetic_types(void);

#ifdef __cplusplus
}
#endif

#endif
