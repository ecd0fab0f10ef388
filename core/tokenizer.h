/*
 * core/tokenizer.h - text to token ids and back, driven by a GGUF file's tokenizer.* keys.
 *
 * Models: "llama" (SentencePiece BPE: scores, byte fallback, a dummy-prefix space, U+2581 for
 * spaces), the one Llama-2, TinyLlama and stories260K use. Special tokens (control and
 * user-defined types) are matched in the text before BPE when asked to.
 */
#ifndef LOOM_CORE_TOKENIZER_H
#define LOOM_CORE_TOKENIZER_H

#include "gguf.h"

#include <stddef.h>
#include <stdint.h>

typedef struct loom_tokenizer loom_tokenizer;

/* Builds the tokenizer a GGUF file describes. Returns NULL with err set when the file has none
 * or one loom cannot run (naming the model and the ones it can). */
loom_tokenizer *loom_tokenizer_from_gguf(const loom_gguf *g, char *err, size_t err_size);
void loom_tokenizer_free(loom_tokenizer *t);

/* Encodes text. add_special: prepend what the family adds (BOS when the file says so);
 * parse_special: text like "<s>" becomes the special token instead of characters: 1 the
 * specials the file lets a user's text name (tokenizer.loom.text_specials; absent: all),
 * 2 every control and user-defined token (a chat template's output). Writes up to
 * cap ids and returns how many the text needs (call again with a bigger buffer when larger),
 * or -1 on an error. */
int64_t loom_tokenizer_encode(const loom_tokenizer *t, const char *text, size_t len,
                              int add_special, int parse_special, int32_t *ids, int64_t cap);
/* The same for text that continues a sequence (an answer's next words, nothing special
 * added): without the space a SentencePiece vocabulary puts before a text's start. */
int64_t loom_tokenizer_encode_continuation(const loom_tokenizer *t, const char *text, size_t len,
                                           int parse_special, int32_t *ids, int64_t cap);
/* The same, with special tokens parsed only outside n_plain byte spans: plain[2k] and
 * plain[2k + 1] are span k's start and end, in order, not overlapping. -1 also for spans
 * that break those rules. */
int64_t loom_tokenizer_encode_spans(const loom_tokenizer *t, const char *text, size_t len,
                                    int add_special, int parse_special, const size_t *plain,
                                    int n_plain, int32_t *ids, int64_t cap);
/* The longest text one token stands for, in bytes. */
size_t loom_tokenizer_max_token_bytes(const loom_tokenizer *t);

/* The bytes token `id` stands for when printed after token `prev` (-1 at the start): spaces
 * restored, byte tokens as their byte, control tokens as nothing. Returns the byte count
 * (at most cap written), or -1 for an id outside the vocabulary. */
int loom_tokenizer_piece(const loom_tokenizer *t, int32_t prev, int32_t id, char *out, int cap);
/* The same, with control tokens as their own text ("<|python_tag|>", "[TOOL_CALLS]"): what a
 * tool-call parser reads. */
int loom_tokenizer_piece_control(const loom_tokenizer *t, int32_t prev, int32_t id, char *out,
                                 int cap);

/* The most ids a vocabulary loom converts may have (today's largest have 262,144). */
#define LOOM_MAX_VOCAB (1 << 20)

int32_t loom_tokenizer_vocab_size(const loom_tokenizer *t);
int32_t loom_tokenizer_bos(const loom_tokenizer *t); /* -1 when none */
/* Whether encoding with add_special puts BOS first (the file's add_bos_token, or the family's
 * default where the key is absent). */
int loom_tokenizer_adds_bos(const loom_tokenizer *t);
/* 1 when id stands for no text a model should produce: outside the vocabulary, or a
 * placeholder (token type UNUSED: the padding that gives every embedding row a token). */
int loom_tokenizer_is_unused(const loom_tokenizer *t, int32_t id);
int32_t loom_tokenizer_eos(const loom_tokenizer *t);
/* Whether id ends a generation: EOS, or one of the file's tokenizer.loom.stop_token_ids. */
int loom_tokenizer_is_stop(const loom_tokenizer *t, int32_t id);
const char *loom_tokenizer_model(const loom_tokenizer *t);

/* GPT-2's byte-level spelling of raw bytes (what byte-level BPE vocabularies store): printable
 * bytes stand for themselves, the others for U+0100, U+0101, ... Writes at most 2 n bytes to
 * out and returns how many. */
size_t loom_byte_level_spell(const unsigned char *bytes, size_t n, char *out);

/* How many leading bytes of text are valid UTF-8 (len when all are). */
size_t loom_utf8_valid_prefix(const char *text, size_t len);

/* A malloc'd, NUL-terminated copy of text in which every ill-formed UTF-8 sequence (its
 * maximal subpart, as Unicode defines it) is U+FFFD; its length in *out_len. NULL when out
 * of memory. */
char *loom_utf8_sanitize(const char *text, size_t len, size_t *out_len);

/* Makes s (NUL-terminated) safe to print in place: control bytes other than newline and tab
 * (ESC sequences a file or a client wrote into a name or a message) and the bytes of
 * ill-formed UTF-8 become '?'. For text loom prints that came from outside. */
void loom_text_printable(char *s);

/* How many leading bytes of s (n bytes) form complete UTF-8 characters: what a streaming
 * printer can emit now without splitting a character. */
size_t loom_utf8_complete(const char *s, size_t n);

#endif
