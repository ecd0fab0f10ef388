/*
 * tools/args.h - what the commands share: reading a command-line value, with an error that
 * names the command, the flag and what was given ("loom run: -n wants a whole number from 0
 * to 1048576, not 'x'"), reading a text file a flag names, and a clock for timings.
 */
#ifndef LOOM_TOOLS_ARGS_H
#define LOOM_TOOLS_ARGS_H

#include <stddef.h>
#include <stdio.h>

/* 0 with *out set, or -1 after printing the error to stderr (v may be NULL: missing). */
int loom_arg_long(const char *cmd, const char *flag, const char *v, long lo, long hi, long *out);
int loom_arg_float(const char *cmd, const char *flag, const char *v, double lo, double hi,
                   float *out);

/* ---- Sampling flags: one table for every command that generates (run, chat, serve) ---- */
struct loom_sampling;
/* 1 when flag is a sampling flag (value v parsed into *s), 0 when it is not one, -1 after
 * printing why v is wrong for it. */
int loom_arg_sampling(const char *cmd, const char *flag, const char *v, struct loom_sampling *s);
/* Prints the sampling flags' usage lines, with the defaults in s. */
void loom_arg_sampling_usage(FILE *out, const struct loom_sampling *s);

/* The commands that take one FILE and an optional --json (`loom inspect`, `loom verify`):
 * 0 with *path and *json set; -1 after --help printed the usage (exit 0); or 2 after printing
 * the usage error ("which model?"). */
int loom_arg_file_json(const char *cmd, const char *what, int argc, char **argv,
                       const char **path, int *json);

/* The whole of a text file (path "-": standard input), NUL-terminated, its length in *len;
 * NULL after printing why (unreadable, too large, or holding a NUL byte, which no prompt may). */
char *loom_arg_text_file(const char *cmd, const char *flag, const char *path, size_t *len);

/* Writes model output to a terminal or file: ill-formed UTF-8 (a byte the model emitted that
 * is no character, a character cut off at the end) as U+FFFD, as the JSON outputs do. The
 * text streams hold back a character split over tokens, so chunks never cut one. */
void loom_print_text(FILE *out, const char *text, size_t len);

/* Milliseconds on a monotonic clock. */
double loom_now_ms(void);

#endif
