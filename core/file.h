/*
 * core/file.h - opening the files a user names (model files, a folder's JSON and tokenizer
 * files): regular files only. A FIFO, a device or a folder in a model's place is refused with
 * a message instead of blocking in open() or reading without end.
 */
#ifndef LOOM_CORE_FILE_H
#define LOOM_CORE_FILE_H

#include <stddef.h>
#include <stdio.h>
#include <sys/stat.h>

/* path opened read-only (close-on-exec): its descriptor, with st filled when not NULL; or -1
 * with err ("PATH: No such file or directory", "PATH: not a regular file (a FIFO)"). errno
 * stays that of the failure (EINVAL for a file that is not regular). */
int loom_file_open(const char *path, struct stat *st, char *err, size_t err_size);

/* The same as a stdio stream ("rb"); NULL with err. */
FILE *loom_file_fopen(const char *path, char *err, size_t err_size);

/* The whole file, NUL-terminated (its size in len, when not NULL), if it holds at most max
 * bytes; NULL with err. */
char *loom_file_read(const char *path, size_t max, size_t *len, char *err, size_t err_size);

#endif
