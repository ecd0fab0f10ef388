/*
 * loom/sampling_fields.h - every sampling parameter, a row each: the one list that makes
 * loom_sampling (loom.h) and the core sampler's parameters (core/sampler.h), their defaults,
 * the command line's flags (tools/args.c), an OpenAI request's fields and their checks
 * (tools/openai_request.c) and the layout the Python package reads (loom_sampling_fields). A
 * new parameter is a row here and its meaning in core/sampler.c.
 *
 * X(kind, name, default, api_default, flag, alias, flag_lo, flag_hi, json, json_lo, json_hi,
 *   role, help)
 *   kind         FLOAT (a float), INT (int32_t), SEED (uint64_t), BOOL (int)
 *   default      loom's: the library's and the command line's
 *   api_default  an OpenAI-compatible server's, as OpenAI's API has it
 *   flag, alias  the command line's flag and another spelling (NULL: none); flag_lo..flag_hi
 *                its range (a SEED: up to LONG_MAX)
 *   json         the request field (NULL: none); json_lo..json_hi its range; an INT below 0
 *                there means off (0), as vLLM's top_k -1 does
 *   role         PENALTY: a penalty, which OpenAI applies over everything generated; else PLAIN
 *   help         the command line's help
 * Only macros: the core includes it as well as the API, and nothing else comes with it.
 */
#ifndef LOOM_SAMPLING_FIELDS_H
#define LOOM_SAMPLING_FIELDS_H

/* clang-format off */
#define LOOM_SAMPLING_FIELDS(X)                                                                    \
    X(FLOAT, temperature, 0.8, 1, "--temp", "--temperature", 0, 100,                              \
      "temperature", 0, 2, PLAIN, "temperature; 0 = greedy")                                       \
    X(INT, top_k, 40, 0, "--top-k", NULL, 0, 1 << 24, "top_k", -1, 1 << 24, PLAIN, "0 = off")      \
    X(FLOAT, top_p, 0.95, 1, "--top-p", NULL, 0, 1, "top_p", 0, 1, PLAIN, "1 = off")               \
    X(FLOAT, min_p, 0.05, 0, "--min-p", NULL, 0, 1, "min_p", 0, 1, PLAIN, "0 = off")               \
    X(FLOAT, repeat_penalty, 1, 1, "--repeat-penalty", NULL, 0.01, 100,                           \
      "repetition_penalty", 0.01, 100, PENALTY, "1 = off")                                         \
    X(INT, repeat_last_n, 64, 64, "--repeat-last-n", NULL, 0, 1 << 20, NULL, 0, 0, PLAIN,          \
      "tokens the repeat penalty looks back over")                                                 \
    X(FLOAT, presence_penalty, 0, 0, "--presence-penalty", NULL, -100, 100,                       \
      "presence_penalty", -2, 2, PENALTY, "0 = off")                                               \
    X(FLOAT, frequency_penalty, 0, 0, "--frequency-penalty", NULL, -100, 100,                     \
      "frequency_penalty", -2, 2, PENALTY, "0 = off")                                              \
    X(SEED, seed, 0, 0, "--seed", NULL, 0, 0, "seed", -9.2e18, 9.2e18, PLAIN,                      \
      "reproducible sampling")                                                                     \
    X(BOOL, ignore_eos, 0, 0, NULL, NULL, 0, 1, "ignore_eos", 0, 1, PLAIN,                         \
      "keep generating past EOS (benchmarks)")
/* clang-format on */

/* each kind's C type */
#define LOOM_SAMPLING_CTYPE_FLOAT float
#define LOOM_SAMPLING_CTYPE_INT int32_t
#define LOOM_SAMPLING_CTYPE_SEED uint64_t
#define LOOM_SAMPLING_CTYPE_BOOL int

/* A struct member per row: X's use in a struct's braces. */
#define LOOM_SAMPLING_MEMBER(kind, name, ...) LOOM_SAMPLING_CTYPE_##kind name;

#endif
