/*
 * tools/args.h - what the commands share: reading a command-line value, with an error that
 * names the command, the flag and what was given ("loom run: -n wants a whole number from 0
 * to 1048576, not 'x'"), reading a text file a flag names, and a clock for timings.
 */
#ifndef LOOM_TOOLS_ARGS_H
#define LOOM_TOOLS_ARGS_H

#include <stddef.h>
#include <stdio.h>

/* ---- One table-driven parser for the commands' flags -------------------------------------
 * A command lists its flags in a table; loom_args_parse reads argv against it (and against the
 * sampling table, for the commands that generate), and the usage is printed from the same
 * table, so a flag and its help cannot drift apart. */
typedef enum loom_flag_kind {
    LOOM_FLAG_SWITCH, /* no value: *(int *)dest = 1 */
    LOOM_FLAG_TEXT,   /* *(const char **)dest = the value */
    LOOM_FLAG_CHOICE, /* as TEXT, but the value must be one of metavar's "a|b|c" */
    LOOM_FLAG_LONG,   /* *(long *)dest = a whole number in [lo, hi] */
    LOOM_FLAG_FLOAT,  /* *(float *)dest = a number in [lo, hi] */
    LOOM_FLAG_REPEAT, /* each value appended to the loom_flag_list at dest */
} loom_flag_kind;

typedef struct loom_flag_list {
    const char **items;
    int n, max;
} loom_flag_list;

typedef struct loom_flag {
    const char *name;  /* "-n", "--kv-type" */
    const char *alias; /* another spelling ("--model" for "-m"), or NULL */
    loom_flag_kind kind;
    void *dest;
    double lo, hi;       /* LONG and FLOAT */
    const char *metavar; /* "N", "FILE", the choices; NULL for a switch */
    const char *help;    /* one line (or several, '\n'), with the default; NULL: not listed
                          * (an internal flag) */
} loom_flag;

struct loom_sampling;
typedef struct loom_command {
    const char *name;     /* "loom run": how errors and the usage start */
    const char *synopsis; /* what follows the name in the usage line */
    const loom_flag *flags;
    int n_flags;
    struct loom_sampling *sampling; /* the sampling flags too, into this, or NULL */
    const char *sampling_title;     /* a line above the sampling flags in the usage, or NULL */
    /* a second table of flags shared by several commands (loom_spec_flag_table), listed under
     * more_title; NULL: none */
    const struct loom_flag *more_flags;
    int n_more_flags;
    const char *more_title;
    const char *epilogue;    /* lines after the flags in the usage, or NULL */
    const char **positional; /* where positional arguments go, in order, or NULL: none */
    int max_positional;      /* room in positional; one more is an error */
    int *n_positional;       /* how many were given, or NULL */
} loom_command;

#define LOOM_N_FLAGS(table) ((int)(sizeof(table) / sizeof((table)[0])))

/* The flags every command that opens a model spells the same way. */
#define LOOM_FLAG_MODEL(dest)                                                                      \
    {                                                                                              \
        "-m", "--model", LOOM_FLAG_TEXT, (dest), 0, 0, "MODEL",                                    \
            "a GGUF file or a Hugging Face folder"                                                 \
    }
#define LOOM_FLAG_KV_TYPE(dest)                                                                    \
    {                                                                                              \
        "--kv-type", NULL, LOOM_FLAG_CHOICE, (dest), 0, 0, "f16|f32|q8_0",                         \
            "KV cache precision (default f16)"                                                     \
    }
/* A command that can run as a pipeline over an MPI job's ranks: with --distributed it must,
 * else it does when started by mpirun; --layers places the layers. */
#define LOOM_FLAG_DISTRIBUTED(dest)                                                                \
    {                                                                                              \
        "--distributed", NULL, LOOM_FLAG_SWITCH, (dest), 0, 0, NULL,                               \
            "run as a pipeline over an MPI job's ranks (the default\n"                             \
            "under mpirun; LOOM_DISTRIBUTED=0: each rank alone)"                                   \
    }
#define LOOM_FLAG_LAYERS(dest)                                                                     \
    {                                                                                              \
        "--layers", NULL, LOOM_FLAG_TEXT, (dest), 0, 0, "N0,N1,...",                               \
            "under mpirun: layers per rank (default: balanced by weight bytes)"                    \
    }
#define LOOM_FLAG_THREADS(dest)                                                                    \
    {                                                                                              \
        "--threads", NULL, LOOM_FLAG_LONG, (dest), 1, 1024, "N", "CPU backend threads"             \
    }
#define LOOM_FLAG_EXPERTS_ON(dest)                                                                 \
    {                                                                                              \
        "--experts-on", NULL, LOOM_FLAG_TEXT, (dest), 0, 0, "BACKEND",                             \
            "a mixture-of-experts model's experts on this backend\n"                               \
            "(e.g. cpu beside a GPU), the rest on the chosen one\n"                                \
            "(default: LOOM_EXPERTS_ON, else all on the chosen one)"                               \
    }

/* Speculative decoding (run, chat, bench): which drafter, and how much it proposes. */
typedef struct loom_spec_flags {
    const char *draft, *draft_backend;
    long draft_layers, lookup, draft_max, draft_min;
    float p_min;
    int fixed, mtp;
} loom_spec_flags;
#define LOOM_SPEC_FLAGS 9
/* Fills table (LOOM_SPEC_FLAGS rows) with the speculative flags writing into f, and sets f's
 * defaults; for loom_command.more_flags. */
void loom_spec_flag_table(loom_spec_flags *f, loom_flag *table);

/* 0: argv parsed; 1: --help printed the usage on stdout (exit 0); 2: an error was printed,
 * naming the flag and what was wrong, with the usage (exit 2). */
int loom_args_parse(const loom_command *cmd, int argc, char **argv);
void loom_args_usage(const loom_command *cmd, FILE *out);

/* The commands that take one FILE and an optional --json (`loom inspect`, `loom verify`):
 * 0 with *path and *json set; -1 after --help printed the usage (exit 0); or 2 after printing
 * the usage error ("which model?"). */
int loom_arg_file_json(const char *cmd, const char *what, int argc, char **argv, const char **path,
                       int *json);

/* The whole of a text file (path "-": standard input), NUL-terminated, its length in *len;
 * NULL after printing why (unreadable, too large, or holding a NUL byte, which no prompt may). */
char *loom_arg_text_file(const char *cmd, const char *flag, const char *path, size_t *len);

/* Writes model output to a terminal or file: ill-formed UTF-8 (a byte the model emitted that
 * is no character, a character cut off at the end) as U+FFFD, as the JSON outputs do. The
 * text streams hold back a character split over tokens, so chunks never cut one. */
void loom_print_text(FILE *out, const char *text, size_t len);

/* Milliseconds on a monotonic clock. */
double loom_now_ms(void);

/* How a command opens its model, as the shared flags (LOOM_FLAG_MODEL, -c, LOOM_FLAG_KV_TYPE,
 * LOOM_FLAG_THREADS, LOOM_FLAG_EXPERTS_ON, LOOM_FLAG_DISTRIBUTED, LOOM_FLAG_LAYERS) write it, and the one place that
 * turns it into loom_model_options (a command then sets what only it has: the KV pool of
 * serve, a backend by name). */
typedef struct loom_open_flags {
    const char *model, *kv_type, *layers, *experts_on;
    long n_ctx, threads;
    int distributed; /* --distributed: a pipeline or an error; else one under mpirun */
} loom_open_flags;
struct loom_model_options;
struct loom_model_options loom_open_options(const loom_open_flags *f);

/* After a command opened its model: on a distributed job's ranks but 0, serves the pipeline
 * stage until rank 0 is done, closes the model and returns the command's exit status; on rank
 * 0 and outside a job returns -1 (go on with the command). */
struct loom_model;
int loom_args_follow(const char *cmd, struct loom_model *m);

/* The drafter the flags ask for, opened beside target (its context, threads and KV type;
 * --draft-layers opens target's own file again, its first K layers): fills *spec and *drafter
 * (NULL for prompt lookup), and *what says which in a few words. Returns 0 (also with none
 * asked for: *spec_out NULL), or 2 after printing why it could not. */
struct loom_speculation;
int loom_spec_open(const char *cmd, const loom_spec_flags *f, const loom_open_flags *of,
                   struct loom_model *target, struct loom_speculation *spec,
                   const struct loom_speculation **spec_out, struct loom_model **drafter,
                   char *what, size_t what_size);

/* What run and chat do first: the model opened as of says (errors printed as cmd's), a
 * pipeline's other ranks served until rank 0 is done, and the drafter sf asks for
 * (loom_spec_open). Returns -1 with *m (and the drafter's) set: go on; else the command's exit
 * status, with nothing left open. */
int loom_open_generating(const char *cmd, const loom_open_flags *of, const loom_spec_flags *sf,
                         struct loom_model **m, struct loom_speculation *spec,
                         const struct loom_speculation **spec_out, struct loom_model **drafter,
                         char *what, size_t what_size);

#endif
