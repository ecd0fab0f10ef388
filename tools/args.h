/*
 * tools/args.h - reading a command-line value, with an error that names the command, the flag
 * and what was given: "loom run: -n wants a whole number from 0 to 1048576, not 'x'".
 */
#ifndef LOOM_TOOLS_ARGS_H
#define LOOM_TOOLS_ARGS_H

/* 0 with *out set, or -1 after printing the error to stderr (v may be NULL: missing). */
int loom_arg_long(const char *cmd, const char *flag, const char *v, long lo, long hi, long *out);
int loom_arg_float(const char *cmd, const char *flag, const char *v, double lo, double hi,
                   float *out);

#endif
