/*
 * core/loader.h - finding, vetting, choosing and opening backend modules.
 *
 * A scan looks at every candidate file in the search path, dlopens it, checks the ABI version
 * its entry point declares, runs its probe and unloads it again, keeping only what it learnt
 * (loom_candidate). All of that happens in a child process (fork), so a module that crashes,
 * aborts or hangs while loading or probing is listed as such and loom goes on
 * (LOOM_PROBE_TIMEOUT seconds, default 5; LOOM_PROBE_ISOLATION=0 probes in-process, for a
 * debugger). Selection then applies LOOM_BACKEND, LOOM_CPU_VARIANT and LOOM_CPU_MAX_ISA
 * and the scores, and records for every candidate why it was or was not chosen. Opening loads
 * the chosen file again and keeps it loaded until loom_device_close.
 *
 * Invariant: nothing from a module (pointers, strings) outlives the dlopen that produced it;
 * everything kept is copied into host-owned memory, zero-filled past what the module declared.
 *
 * One file per idea: module_scan.c (finding and vetting), module_policy.c (choosing),
 * module_report.c (the text and JSON report), device.c (opening a device, dispatching ops).
 */
#ifndef LOOM_CORE_LOADER_H
#define LOOM_CORE_LOADER_H

#include <loom/backend.h>
#include <stdio.h>

typedef enum loom_candidate_state {
    LOOM_CAND_NOT_LOADABLE, /* dlopen failed: not a shared object, missing dependency, ... */
    LOOM_CAND_NO_ENTRY,     /* loaded, but no LOOM_BACKEND_ENTRY_SYMBOL or it returned NULL */
    LOOM_CAND_BAD_ABI,      /* ABI major differs, or minor is newer than loom's */
    LOOM_CAND_PROBE_FAILED, /* loading or probing it crashed, aborted or hung (in a child) */
    LOOM_CAND_UNUSABLE,     /* the probe scored 0 */
    LOOM_CAND_EXCLUDED,     /* usable, but an env var or the preference rules it out */
    LOOM_CAND_USABLE,       /* usable and eligible, not chosen */
    LOOM_CAND_CHOSEN,
} loom_candidate_state;

typedef struct loom_candidate {
    char path[4096];
    char name[64];
    char variant[64];
    char description[256];
    uint32_t abi_major, abi_minor;
    uint32_t kind; /* loom_module_kind: decorators are never chosen, only wrapped around */
    loom_probe_result probe;
    loom_candidate_state state;
    char reason[512]; /* why this state */
} loom_candidate;

/* What the loader takes from its caller; core reads no environment. Tools and
 * loom_model_open fill it from LOOM_BACKEND_PATH, LOOM_CPU_VARIANT, LOOM_CPU_MAX_ISA,
 * LOOM_EXPLAIN, LOOM_PROBE_TIMEOUT and LOOM_PROBE_ISOLATION (api/loader_env.h); an embedding
 * program may set them per model. Zero (or NULL) everywhere: the defaults. The strings are
 * borrowed for the registry's life. */
typedef struct loom_loader_options {
    const char *search_path; /* directories searched first, ':' between */
    const char *cpu_variant; /* the one CPU variant to use ("avx2") */
    const char *cpu_max_isa; /* no CPU variant above this ISA level */
    int explain;             /* selection prints every candidate on stderr */
    long probe_timeout_s;    /* a probe that takes longer failed; 0: 5 s */
    int probe_in_process;    /* probe in this process, not in a child (debugging) */
} loom_loader_options;

typedef struct loom_registry {
    loom_loader_options opts; /* what scan was given; select and add_file use it too */
    loom_candidate *items;
    int count;
    int chosen;             /* index into items, or -1 */
    int chosen_device;      /* device index within the chosen module */
    char search_path[8192]; /* the directories searched, ':'-separated, for the report */
} loom_registry;

/* Where loom's modules lie besides LOOM_BACKEND_PATH: the directory of the running executable
 * (resolved; 0, or -1), and the build tree loom was configured in when the executable runs
 * from it (1 with its path in build; 0 otherwise), where libtool leaves uninstalled modules in
 * <dir>/<name>/.libs. The API layer finds its MPI module the same way. */
int loom_exe_dir(char *out, size_t n);
int loom_build_tree(const char *exe_dir, char *build, size_t n);

/* Scans opts->search_path, the build tree (when running from it), the install directory next
 * to the executable and the configured install directory (opts NULL: defaults). Returns 0, or
 * -1 with err set when memory runs out. Unloadable files are candidates too, with their
 * reason. */
int loom_registry_scan(loom_registry *reg, const loom_loader_options *opts, char *err,
                       size_t err_size);

/* Vets one file and adds it as a candidate (used by scan and by the conformance tool). */
int loom_registry_add_file(loom_registry *reg, const char *path, char *err, size_t err_size);

/* Chooses one candidate by `preference` (LOOM_BACKEND's syntax; NULL: none), the registry's
 * CPU variant options and the scores. Returns 0, or -1 with an error that lists what is
 * available. With opts.explain the report goes to stderr either way. */
int loom_registry_select(loom_registry *reg, const char *preference, char *err, size_t err_size);

/* The first usable decorator module called name (kind LOOM_MODULE_DECORATOR), or -1 with an
 * error saying why there is none. */
int loom_registry_find_decorator(const loom_registry *reg, const char *name, char *err,
                                 size_t err_size);

void loom_registry_print(const loom_registry *reg, FILE *out);
/* Returns a malloc'd JSON document, or NULL when out of memory. */
char *loom_registry_json(const loom_registry *reg);

void loom_registry_free(loom_registry *reg);

const char *loom_candidate_state_name(loom_candidate_state s);

/* An opened backend: the module kept loaded, and host copies of its tables. A decorated
 * device calls the decorator's table, which forwards to the backend's; name, variant and
 * module stay the backend's, since that is what runs the ops. */
typedef struct loom_device {
    void *handle; /* dlopen handle */
    loom_backend *be;
    loom_backend_ops ops;       /* zero past the module's struct_size: NULL = unsupported */
    loom_backend_module module; /* likewise */
    char name[64], variant[64];
    int device;
    void *decorator_handle; /* the decorator's dlopen handle, or NULL */
    char decorator[64];     /* its name ("trace"), or "" */
} loom_device;

/* Loads path, vets it as scan does, and opens device `device`. */
int loom_device_open(loom_device *dev, const char *path, int device, int n_threads, char *err,
                     size_t err_size);
/* Opens the candidate the registry chose. */
int loom_device_open_chosen(loom_device *dev, const loom_registry *reg, int n_threads, char *err,
                            size_t err_size);
/* Wraps an opened device in the decorator module at path (LOOM_MODULE_DECORATOR), passing it
 * config. On success dev's calls go through the decorator, which owns the backend from then
 * on; on failure dev is closed, with err saying why. */
int loom_device_decorate(loom_device *dev, const char *path, const char *config, char *err,
                         size_t err_size);
void loom_device_close(loom_device *dev);

/* Whether the module implements op at all (present in its table) and supports dtype with it. */
int loom_device_supports(const loom_device *dev, loom_op op, loom_dtype dtype);

/* Calls op's entry in dev's table with params, the op's ABI parameter struct. The caller has
 * checked loom_device_supports. */
loom_status loom_device_run(const loom_device *dev, loom_op op, const void *params);
/* Whether the module's table has a function for op (supports() may claim one it has not). */
int loom_device_op_present(const loom_device *dev, loom_op op);

#endif
