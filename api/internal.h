/*
 * api/internal.h - what the API layer's files share and the public header does not show.
 */
#ifndef LOOM_API_INTERNAL_H
#define LOOM_API_INTERNAL_H

#include <loom/loom.h>

/* A Hugging Face folder converted (keeping its weights' precision) into an anonymous in-memory
 * file; writes that file's path to out and returns its descriptor (close it once the file is
 * open: the mapping keeps it alive), or -1 with err. */
int loom_convert_in_memory(const char *dir, char *out, size_t out_size,
                           loom_convert_progress_fn progress, void *user, char *err,
                           size_t err_size);
/* Whether path is a folder (then it is taken as a Hugging Face model). */
int loom_is_model_dir(const char *path);
/* A progress bar on stderr, for conversions started on the user's behalf. */
void loom_progress_bar(void *user, int done, int total, const char *what);

/* The template for a stored template text and architecture (either may be NULL). */
const char *loom_chat_template_guess(const char *stored, const char *arch, int *recognised);

#endif
