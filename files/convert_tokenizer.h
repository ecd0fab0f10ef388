/*
 * files/convert_tokenizer.h - a Hugging Face folder's tokenizer as GGUF keys.
 */
#ifndef LOOM_FILES_CONVERT_TOKENIZER_H
#define LOOM_FILES_CONVERT_TOKENIZER_H

#include "files/hf_folder.h"

/* The folder's tokenizer, whichever form it ships, into c->w, with the special tokens
 * c->family appends. */
int conv_tokenizer(conv *c);
/* generation_config.json's list of end tokens, as tokenizer.loom.stop_token_ids; -1 when
 * the file cannot be read or names an id outside the vocabulary. */
int conv_stop_tokens(conv *c);

#endif
