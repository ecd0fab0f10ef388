/*
 * tests/fuzz/fuzz_tokenizer.c - libFuzzer harness for the tokenizers: the input is text (any
 * bytes, valid UTF-8 or not), encoded with and without special tokens by each vocabulary named
 * in LOOM_FUZZ_VOCABS (GGUF files, colon-separated), then decoded piece by piece.
 */
#define _GNU_SOURCE
#include "core/gguf.h"
#include "core/tokenizer.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_VOCABS 8
static loom_gguf files[MAX_VOCABS];
static loom_tokenizer *toks[MAX_VOCABS];
static int n_toks;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc, (void)argv;
    const char *env = getenv("LOOM_FUZZ_VOCABS");
    char *list = env ? strdup(env) : NULL, *save = NULL, err[512];
    for (char *p = list ? strtok_r(list, ":", &save) : NULL; p && n_toks < MAX_VOCABS;
         p = strtok_r(NULL, ":", &save)) {
        if (loom_gguf_open(&files[n_toks], p, err, sizeof err) != 0) {
            fprintf(stderr, "fuzz_tokenizer: %s\n", err);
            exit(1);
        }
        if (!(toks[n_toks] = loom_tokenizer_from_gguf(&files[n_toks], err, sizeof err))) {
            fprintf(stderr, "fuzz_tokenizer: %s: %s\n", p, err);
            exit(1);
        }
        n_toks++;
    }
    free(list);
    if (!n_toks) {
        fprintf(stderr, "fuzz_tokenizer: set LOOM_FUZZ_VOCABS to GGUF files with tokenizers\n");
        exit(1);
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int32_t ids[8192];
    for (int k = 0; k < n_toks; k++)
        for (int special = 0; special < 2; special++) {
            int64_t n = loom_tokenizer_encode(toks[k], (const char *)data, size, special, special,
                                              ids, 8192);
            char piece[512];
            for (int64_t i = 0; i < n && i < 8192; i++) {
                int len = loom_tokenizer_piece(toks[k], i ? ids[i - 1] : -1, ids[i], piece,
                                               sizeof piece);
                if (len < 0)
                    __builtin_trap(); /* an id the encoder produced must decode */
            }
        }
    return 0;
}
