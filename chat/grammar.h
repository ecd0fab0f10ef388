/*
 * chat/grammar.h - constrained decoding: a grammar (llama.cpp's GBNF, or made from a JSON
 * Schema by chat/json_schema.c) run over bytes as a pushdown automaton, and the tokens of a
 * vocabulary it allows next, found through a trie of the tokens' bytes (chat/grammar.c).
 */
#ifndef LOOM_CHAT_GRAMMAR_H
#define LOOM_CHAT_GRAMMAR_H

#include <loom/loom.h>

#include <stddef.h>
#include <stdint.h>

struct loom_tokenizer;

/* A vocabulary as bytes: each token's text (control tokens have none and are never allowed,
 * unless control_text gives them theirs; the stop tokens are allowed where the grammar may
 * end). Built once per engine. */
typedef struct grammar_vocab grammar_vocab;
grammar_vocab *grammar_vocab_new(const struct loom_tokenizer *tok, int control_text, char *err,
                                 size_t err_size);
void grammar_vocab_free(grammar_vocab *v);

/* Where one answer stands in its grammar. Its caches (states met, the moves between them,
 * the masks of allowed tokens) live as long as it does: one per request. */
typedef struct grammar_matcher grammar_matcher;
grammar_matcher *grammar_matcher_new(const loom_grammar *g, const grammar_vocab *v, char *err,
                                     size_t err_size);
void grammar_matcher_free(grammar_matcher *m);

/* Whether token id may come next (a stop token: whether the answer may end here). */
int grammar_allows(grammar_matcher *m, int32_t id);
/* The tokens that may come next, as a bitset over the vocabulary (bit id), owned by m and
 * valid until the next call. NULL when out of memory or past a limit (err says which). */
const uint32_t *grammar_mask(grammar_matcher *m, char *err, size_t err_size);
/* Takes token id (allowed, not a stop token). -1 if the grammar does not allow it. */
int grammar_accept(grammar_matcher *m, int32_t id);
/* Whether the answer so far is complete (may end), and whether nothing may follow it. */
int grammar_may_end(const grammar_matcher *m);
int grammar_must_end(const grammar_matcher *m);

struct loom_sampler_params;
/* The next token under m: a draw from the model's distribution (logits, n_vocab of them, the
 * sampler's transforms p, penalties over toks[0..n_toks)) restricted to the tokens m allows;
 * -1 when the grammar has ended the answer, -2 with err on a failure. Where the sampler
 * truncates nothing (greedy, or plain temperature), a draw from the whole distribution that m
 * allows is already such a sample (rejection sampling); only when it is refused is the mask of
 * allowed tokens needed, which is the slow part, and then the draw is made again from the
 * masked logits. With top-k, top-p or min-p the mask comes first, as those act on what the
 * grammar leaves. logits may be changed; scratch holds n_vocab floats. Does not take the token
 * (grammar_accept). */
int32_t grammar_sample(grammar_matcher *m, float *logits, float *scratch, int32_t n_vocab,
                       const struct loom_sampler_params *p, const int32_t *toks, int32_t n_toks,
                       uint64_t *rng, char *err, size_t err_size);

/* A JSON Schema "pattern" (a regular expression; the subset chat/regex_gbnf.c lists) as a GBNF
 * expression over the text of a JSON string between its quotes, as JSON escapes it; any_char
 * names the rule of one such character, which an end without an anchor repeats. 0 with *gbnf
 * malloc'd, or -1 with err naming what is not supported. */
int loom_regex_to_gbnf(const char *pattern, const char *any_char, char **gbnf, char *err,
                       size_t err_size);
/* Whether bytes (a whole answer) match the grammar: for tests. */
int grammar_matches(const loom_grammar *g, const char *bytes, size_t n);

#endif
