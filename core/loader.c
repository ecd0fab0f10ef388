/*
 * core/loader.c - finding, vetting, choosing and opening backend modules. See loader.h.
 */
#define _GNU_SOURCE
#include "loader.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stddef.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef LOOM_PKGLIBDIR
#define LOOM_PKGLIBDIR "/usr/local/lib/loom"
#endif
#ifndef LOOM_BUILD_DIR
#define LOOM_BUILD_DIR ""
#endif

/* CPU variants in increasing ISA order, for LOOM_CPU_MAX_ISA. */
static const char *const cpu_isa_order[] = {"baseline", "avx2", "avx512"};
#define N_CPU_ISAS ((int)(sizeof cpu_isa_order / sizeof cpu_isa_order[0]))

static void set_err(char *err, size_t n, const char *fmt, ...)
{
    if (!err || !n)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, n, fmt, ap);
    va_end(ap);
}

const char *loom_candidate_state_name(loom_candidate_state s)
{
    switch (s) {
    case LOOM_CAND_NOT_LOADABLE: return "not loadable";
    case LOOM_CAND_NO_ENTRY: return "no entry point";
    case LOOM_CAND_BAD_ABI: return "incompatible ABI";
    case LOOM_CAND_PROBE_FAILED: return "probe failed";
    case LOOM_CAND_UNUSABLE: return "unusable here";
    case LOOM_CAND_EXCLUDED: return "excluded";
    case LOOM_CAND_USABLE: return "usable";
    case LOOM_CAND_CHOSEN: return "chosen";
    }
    return "?";
}

/* ---- Vetting one file ------------------------------------------------------------------- */

/* Copies what the module declared into a zeroed host struct, never reading past its size. */
static void copy_declared(void *dst, size_t dst_size, const void *src, uint32_t src_size)
{
    memset(dst, 0, dst_size);
    memcpy(dst, src, src_size < dst_size ? src_size : dst_size);
}

/* dlopens path and checks its entry and ABI. On success returns the handle and the module
 * table copied into *mod; on failure sets state and reason and returns NULL. */
static void *load_module(const char *path, loom_backend_module *mod, loom_candidate_state *state,
                         char *reason, size_t reason_size)
{
    dlerror();
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        *state = LOOM_CAND_NOT_LOADABLE;
        set_err(reason, reason_size, "dlopen failed: %s", e ? e : "unknown error");
        return NULL;
    }
    loom_backend_entry_fn entry;
    *(void **)&entry = dlsym(h, LOOM_BACKEND_ENTRY_SYMBOL);
    const loom_backend_module *m = entry ? entry(LOOM_BACKEND_ABI_MAJOR, LOOM_BACKEND_ABI_MINOR)
                                         : NULL;
    if (!m) {
        *state = LOOM_CAND_NO_ENTRY;
        set_err(reason, reason_size,
                entry ? "%s() returned NULL" : "no %s symbol: not a loom backend",
                LOOM_BACKEND_ENTRY_SYMBOL);
        dlclose(h);
        return NULL;
    }
    /* abi_major/minor sit at fixed offsets in every version; check them before trusting
     * struct_size for anything else. */
    if (m->abi_major != LOOM_BACKEND_ABI_MAJOR || m->abi_minor > LOOM_BACKEND_ABI_MINOR) {
        *state = LOOM_CAND_BAD_ABI;
        set_err(reason, reason_size,
                "built for backend ABI %u.%u; this loom speaks %d.0 to %d.%d (%s)",
                m->abi_major, m->abi_minor, LOOM_BACKEND_ABI_MAJOR, LOOM_BACKEND_ABI_MAJOR,
                LOOM_BACKEND_ABI_MINOR,
                m->abi_major != LOOM_BACKEND_ABI_MAJOR ? "rebuild it against this loom"
                                                       : "upgrade loom");
        dlclose(h);
        return NULL;
    }
    if (m->struct_size < offsetof(loom_backend_module, open) + sizeof(m->open) || !m->name ||
        !m->probe || !m->open) {
        *state = LOOM_CAND_NO_ENTRY;
        set_err(reason, reason_size, "module table is incomplete (no name, probe or open)");
        dlclose(h);
        return NULL;
    }
    copy_declared(mod, sizeof *mod, m, m->struct_size);
    return h;
}

static void copy_str(char *dst, size_t n, const char *src)
{
    snprintf(dst, n, "%s", src ? src : "");
}

/* What vetting one file learns: everything a candidate keeps, copied out of the module. */
typedef struct vet_result {
    loom_candidate_state state;
    char reason[512];
    char name[64], variant[64], description[256];
    uint32_t abi_major, abi_minor;
    loom_probe_result probe;
} vet_result;

/* Loads path, checks it and runs its probe, in this process. */
static void vet_here(const char *path, vet_result *r)
{
    memset(r, 0, sizeof *r);
    loom_backend_module mod;
    void *h = load_module(path, &mod, &r->state, r->reason, sizeof r->reason);
    if (!h)
        return;
    copy_str(r->name, sizeof r->name, mod.name);
    copy_str(r->variant, sizeof r->variant, mod.variant);
    copy_str(r->description, sizeof r->description, mod.description);
    r->abi_major = mod.abi_major;
    r->abi_minor = mod.abi_minor;
    r->probe.struct_size = sizeof r->probe;
    mod.probe(&r->probe);
    r->state = LOOM_CAND_USABLE; /* judged by the caller from the probe result */
    dlclose(h);
}

static long env_long(const char *name, long fallback, long lo, long hi)
{
    const char *s = getenv(name);
    char *end;
    long v = s && *s ? strtol(s, &end, 10) : fallback;
    return s && *s && !*end && v >= lo && v <= hi ? v : fallback;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* vet_here in a child process, so that a module that crashes, aborts, exits or hangs while
 * loading or probing costs only the child: the result comes back over a pipe, and a child that
 * sends none is reported with what became of it. */
static void vet_isolated(const char *path, vet_result *r)
{
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) {
        vet_here(path, r); /* no pipe: probe here rather than not at all */
        return;
    }
    fflush(NULL); /* the child must not repeat buffered output */
    pid_t pid = fork();
    if (pid < 0) {
        close(fds[0]), close(fds[1]);
        vet_here(path, r);
        return;
    }
    if (pid == 0) {
        close(fds[0]);
        /* a crash must end the child by its signal, whatever handlers the host installed (a
         * sanitizer's would report it and exit 1, hiding which signal it was) */
        static const int fatal[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
        for (size_t i = 0; i < sizeof fatal / sizeof fatal[0]; i++)
            signal(fatal[i], SIG_DFL);
        vet_result mine;
        vet_here(path, &mine);
        const char *p = (const char *)&mine;
        for (size_t left = sizeof mine; left > 0;) {
            ssize_t n = write(fds[1], p, left);
            if (n <= 0)
                _exit(2);
            p += n, left -= (size_t)n;
        }
        _exit(0); /* not exit(): the parent's atexit handlers and buffers are not ours */
    }
    close(fds[1]);
    long timeout = env_long("LOOM_PROBE_TIMEOUT", 5, 1, 3600);
    double deadline = now_s() + (double)timeout;
    size_t got = 0;
    int timed_out = 0;
    while (got < sizeof *r) {
        int wait_ms = (int)((deadline - now_s()) * 1000);
        if (wait_ms <= 0) {
            timed_out = 1;
            break;
        }
        struct pollfd pf = {fds[0], POLLIN, 0};
        int ready = poll(&pf, 1, wait_ms);
        if (ready < 0 && errno == EINTR)
            continue;
        if (ready <= 0) {
            timed_out = ready == 0;
            break;
        }
        ssize_t n = read(fds[0], (char *)r + got, sizeof *r - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    close(fds[0]);
    if (timed_out)
        kill(pid, SIGKILL);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (got == sizeof *r)
        return;
    memset(r, 0, sizeof *r);
    r->state = LOOM_CAND_PROBE_FAILED;
    if (timed_out)
        set_err(r->reason, sizeof r->reason, "probe timed out after %ld s (LOOM_PROBE_TIMEOUT): "
                "loading or probing the module hangs", timeout);
    else if (WIFSIGNALED(status))
        set_err(r->reason, sizeof r->reason, "probe crashed (signal %d, %s) while loading or "
                "probing the module", WTERMSIG(status), strsignal(WTERMSIG(status)));
    else
        set_err(r->reason, sizeof r->reason, "probe exited (status %d) without an answer while "
                "loading or probing the module", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
}

int loom_registry_add_file(loom_registry *reg, const char *path, char *err, size_t err_size)
{
    loom_candidate *items = realloc(reg->items, (size_t)(reg->count + 1) * sizeof *items);
    if (!items) {
        set_err(err, err_size, "out of memory listing backends");
        return -1;
    }
    reg->items = items;
    loom_candidate *c = &items[reg->count++];
    memset(c, 0, sizeof *c);
    copy_str(c->path, sizeof c->path, path);

    vet_result r;
    if (env_long("LOOM_PROBE_ISOLATION", 1, 0, 1))
        vet_isolated(path, &r);
    else
        vet_here(path, &r);
    c->state = r.state;
    copy_str(c->reason, sizeof c->reason, r.reason);
    if (r.state != LOOM_CAND_USABLE)
        return 0;
    r.name[sizeof r.name - 1] = r.variant[sizeof r.variant - 1] = '\0';
    r.description[sizeof r.description - 1] = '\0';
    copy_str(c->name, sizeof c->name, r.name);
    copy_str(c->variant, sizeof c->variant, r.variant);
    copy_str(c->description, sizeof c->description, r.description);
    c->abi_major = r.abi_major;
    c->abi_minor = r.abi_minor;
    c->probe = r.probe;
    c->probe.reason[sizeof c->probe.reason - 1] = '\0';
    if (c->probe.n_devices > LOOM_MAX_DEVICES)
        c->probe.n_devices = LOOM_MAX_DEVICES;
    for (uint32_t i = 0; i < c->probe.n_devices; i++) {
        c->probe.devices[i].name[sizeof c->probe.devices[i].name - 1] = '\0';
        c->probe.devices[i].detail[sizeof c->probe.devices[i].detail - 1] = '\0';
    }
    if (c->probe.score <= 0 || c->probe.n_devices == 0) {
        c->state = LOOM_CAND_UNUSABLE;
        copy_str(c->reason, sizeof c->reason,
                 c->probe.reason[0] ? c->probe.reason : "probe found no usable device");
    } else {
        c->state = LOOM_CAND_USABLE;
    }
    return 0;
}

/* ---- Scanning --------------------------------------------------------------------------- */

static int has_suffix(const char *s, const char *suffix)
{
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

static int already_listed(const loom_registry *reg, const char *real)
{
    for (int i = 0; i < reg->count; i++) {
        char r[PATH_MAX];
        if (realpath(reg->items[i].path, r) && strcmp(r, real) == 0)
            return 1;
    }
    return 0;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Whether snprintf's return value says the whole path fitted. */
static int path_fits(int written, size_t size)
{
    return written >= 0 && (size_t)written < size;
}

/* Adds every *.so in dir, in name order so that reports are stable. */
static int scan_dir(loom_registry *reg, const char *dir, char *err, size_t err_size)
{
    size_t used = strlen(reg->search_path);
    snprintf(reg->search_path + used, sizeof reg->search_path - used, "%s%s", used ? ":" : "",
             dir);
    DIR *d = opendir(dir);
    if (!d)
        return 0; /* a missing directory is normal: not every install has every place */
    char **names = NULL;
    int n = 0, rc = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (!has_suffix(e->d_name, ".so"))
            continue;
        char **grown = realloc(names, (size_t)(n + 1) * sizeof *names);
        if (!grown || !(grown[n] = strdup(e->d_name))) {
            names = grown ? grown : names;
            rc = -1;
            break;
        }
        names = grown;
        n++;
    }
    closedir(d);
    qsort(names, (size_t)n, sizeof *names, cmp_str);
    for (int i = 0; i < n && rc == 0; i++) {
        char path[PATH_MAX], real[PATH_MAX];
        struct stat st;
        if (!path_fits(snprintf(path, sizeof path, "%s/%s", dir, names[i]), sizeof path) ||
            stat(path, &st) != 0 || !S_ISREG(st.st_mode) || !realpath(path, real) ||
            already_listed(reg, real))
            continue;
        rc = loom_registry_add_file(reg, path, err, err_size);
    }
    for (int i = 0; i < n; i++)
        free(names[i]);
    free(names);
    if (rc)
        set_err(err, err_size, "out of memory listing backends");
    return rc;
}

/* Directory holding the running executable, resolved. */
static int exe_dir(char *out, size_t n)
{
    char buf[PATH_MAX];
    ssize_t len = readlink("/proc/self/exe", buf, sizeof buf - 1);
    if (len <= 0)
        return -1;
    buf[len] = '\0';
    char *slash = strrchr(buf, '/');
    if (!slash)
        return -1;
    *slash = '\0';
    snprintf(out, n, "%s", buf);
    return 0;
}

/* In an uninstalled build, modules sit in backends/<name>/.libs/ under the build tree. */
static int scan_build_tree(loom_registry *reg, const char *exe, char *err, size_t err_size)
{
    char build[PATH_MAX];
    if (!LOOM_BUILD_DIR[0] || !realpath(LOOM_BUILD_DIR, build))
        return 0;
    size_t bl = strlen(build);
    if (strncmp(exe, build, bl) != 0 || (exe[bl] != '/' && exe[bl] != '\0'))
        return 0;
    char backends[PATH_MAX];
    DIR *d = path_fits(snprintf(backends, sizeof backends, "%s/backends", build), sizeof backends)
                 ? opendir(backends)
                 : NULL;
    if (!d)
        return 0;
    char **subs = NULL;
    int n = 0, rc = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.')
            continue;
        char **grown = realloc(subs, (size_t)(n + 1) * sizeof *subs);
        if (!grown || !(grown[n] = strdup(e->d_name))) {
            subs = grown ? grown : subs;
            rc = -1;
            break;
        }
        subs = grown;
        n++;
    }
    closedir(d);
    qsort(subs, (size_t)n, sizeof *subs, cmp_str);
    for (int i = 0; i < n && rc == 0; i++) {
        char dir[PATH_MAX];
        struct stat st;
        if (path_fits(snprintf(dir, sizeof dir, "%s/%s/.libs", backends, subs[i]), sizeof dir) &&
            stat(dir, &st) == 0 && S_ISDIR(st.st_mode))
            rc = scan_dir(reg, dir, err, err_size);
    }
    for (int i = 0; i < n; i++)
        free(subs[i]);
    free(subs);
    if (rc)
        set_err(err, err_size, "out of memory listing backends");
    return rc;
}

static void exclude_shadowed(loom_registry *reg);

int loom_registry_scan(loom_registry *reg, char *err, size_t err_size)
{
    memset(reg, 0, sizeof *reg);
    reg->chosen = -1;

    const char *env = getenv("LOOM_BACKEND_PATH");
    if (env && *env) {
        char *copy = strdup(env);
        if (!copy) {
            set_err(err, err_size, "out of memory");
            return -1;
        }
        int rc = 0;
        for (char *save = NULL, *dir = strtok_r(copy, ":", &save); dir && rc == 0;
             dir = strtok_r(NULL, ":", &save))
            rc = scan_dir(reg, dir, err, err_size);
        free(copy);
        if (rc)
            return rc;
    }
    char exe[PATH_MAX];
    if (exe_dir(exe, sizeof exe) == 0) {
        if (scan_build_tree(reg, exe, err, err_size))
            return -1;
        char rel[PATH_MAX], real[PATH_MAX];
        if (path_fits(snprintf(rel, sizeof rel, "%s/../lib/loom/backends", exe), sizeof rel) &&
            realpath(rel, real) && scan_dir(reg, real, err, err_size))
            return -1;
    }
    int rc = scan_dir(reg, LOOM_PKGLIBDIR "/backends", err, err_size);
    if (rc == 0)
        exclude_shadowed(reg);
    return rc;
}

void loom_registry_free(loom_registry *reg)
{
    free(reg->items);
    memset(reg, 0, sizeof *reg);
    reg->chosen = -1;
}

/* ---- Choosing --------------------------------------------------------------------------- */

static int isa_rank(const char *variant)
{
    for (int i = 0; i < N_CPU_ISAS; i++)
        if (strcmp(variant, cpu_isa_order[i]) == 0)
            return i;
    return -1;
}

/* "cpu" matches every cpu module; "cpu-avx2" matches the avx2 one. */
static int name_matches(const loom_candidate *c, const char *want)
{
    if (!c->name[0])
        return 0;
    if (strcmp(c->name, want) == 0)
        return 1;
    size_t n = strlen(c->name);
    return c->variant[0] && strncmp(want, c->name, n) == 0 && want[n] == '-' &&
           strcmp(want + n + 1, c->variant) == 0;
}

static void label(const loom_candidate *c, char *out, size_t n)
{
    if (!c->name[0]) {
        const char *base = strrchr(c->path, '/');
        snprintf(out, n, "%.100s", base ? base + 1 : c->path);
    }
    else if (c->variant[0])
        snprintf(out, n, "%s-%s", c->name, c->variant);
    else
        snprintf(out, n, "%s", c->name);
}

/* Appends "  name: state (reason)" lines for every candidate to buf. */
static void list_candidates(const loom_registry *reg, char *buf, size_t n)
{
    size_t used = strlen(buf);
    if (reg->count == 0) {
        snprintf(buf + used, n - used, "\n  no backend modules found in %s",
                 reg->search_path[0] ? reg->search_path : "(nowhere)");
        return;
    }
    for (int i = 0; i < reg->count && used < n; i++) {
        const loom_candidate *c = &reg->items[i];
        char l[160];
        label(c, l, sizeof l);
        used += (size_t)snprintf(buf + used, n - used, "\n  %s: %s%s%s%s", l,
                                 loom_candidate_state_name(c->state), c->reason[0] ? " (" : "",
                                 c->reason, c->reason[0] ? ")" : "");
    }
}

/* A module found again later in the search (the same name and variant: a second install, or
 * the build tree beside LOOM_BACKEND_PATH) is left out: the first one found is the one used,
 * so LOOM_BACKEND_PATH overrides the rest. */
static void exclude_shadowed(loom_registry *reg)
{
    for (int i = 0; i < reg->count; i++) {
        loom_candidate *c = &reg->items[i];
        if (c->state != LOOM_CAND_USABLE)
            continue;
        for (int j = 0; j < i; j++) {
            const loom_candidate *first = &reg->items[j];
            if (first->state >= LOOM_CAND_EXCLUDED && !strcmp(first->name, c->name) &&
                !strcmp(first->variant, c->variant)) {
                c->state = LOOM_CAND_EXCLUDED;
                set_err(c->reason, sizeof c->reason, "shadowed by %s, found first", first->path);
                break;
            }
        }
    }
}

static int apply_cpu_env(loom_registry *reg, char *err, size_t err_size)
{
    const char *force = getenv("LOOM_CPU_VARIANT");
    const char *cap = getenv("LOOM_CPU_MAX_ISA");
    int cap_rank = -1;
    if (cap && *cap) {
        cap_rank = isa_rank(cap);
        if (cap_rank < 0) {
            set_err(err, err_size, "LOOM_CPU_MAX_ISA=%s is not an ISA level; use baseline, avx2 "
                                   "or avx512", cap);
            return -1;
        }
    }
    /* LOOM_CPU_MASK and LOOM_NUMA are read by the CPU modules' probes; a value they could not
     * read makes every variant unusable with that reason, which must stop loom rather than let
     * it fall back quietly to another backend */
    for (int i = 0; i < reg->count; i++) {
        const loom_candidate *c = &reg->items[i];
        if (!strcmp(c->name, "cpu") && c->state == LOOM_CAND_UNUSABLE &&
            (!strncmp(c->reason, "LOOM_CPU_MASK=", 14) || !strncmp(c->reason, "LOOM_NUMA=", 10))) {
            set_err(err, err_size, "%s", c->reason);
            return -1;
        }
    }
    if (force && *force) {
        int found = 0;
        for (int i = 0; i < reg->count; i++)
            found |= strcmp(reg->items[i].name, "cpu") == 0 &&
                     strcmp(reg->items[i].variant, force) == 0;
        if (!found) {
            set_err(err, err_size, "LOOM_CPU_VARIANT=%s: no CPU module has that variant. "
                                   "Backends found:", force);
            list_candidates(reg, err, err_size);
            return -1;
        }
    }
    for (int i = 0; i < reg->count; i++) {
        loom_candidate *c = &reg->items[i];
        if (strcmp(c->name, "cpu") != 0 || c->state != LOOM_CAND_USABLE)
            continue;
        if (force && *force && strcmp(c->variant, force) != 0) {
            c->state = LOOM_CAND_EXCLUDED;
            set_err(c->reason, sizeof c->reason, "LOOM_CPU_VARIANT=%s", force);
        } else if (cap_rank >= 0 && isa_rank(c->variant) > cap_rank) {
            c->state = LOOM_CAND_EXCLUDED;
            set_err(c->reason, sizeof c->reason, "above LOOM_CPU_MAX_ISA=%s", cap);
        }
    }
    return 0;
}

/* The best usable candidate matching want (NULL: any), or -1. */
static int best_usable(const loom_registry *reg, const char *want)
{
    int best = -1;
    for (int i = 0; i < reg->count; i++) {
        const loom_candidate *c = &reg->items[i];
        if (c->state != LOOM_CAND_USABLE || (want && !name_matches(c, want)))
            continue;
        if (best < 0 || c->probe.score > reg->items[best].probe.score)
            best = i;
    }
    return best;
}

static int explain_wanted(void)
{
    const char *s = getenv("LOOM_EXPLAIN");
    return s && *s && strcmp(s, "0") != 0;
}

/* Parses "name[:device]" into name and device (-1 when absent). */
static int parse_entry(const char *entry, char *name, size_t n, int *device)
{
    const char *colon = strchr(entry, ':');
    size_t len = colon ? (size_t)(colon - entry) : strlen(entry);
    if (len == 0 || len >= n)
        return -1;
    memcpy(name, entry, len);
    name[len] = '\0';
    *device = -1;
    if (colon) {
        char *end;
        long d = strtol(colon + 1, &end, 10);
        if (!colon[1] || *end || d < 0 || d >= LOOM_MAX_DEVICES)
            return -1;
        *device = (int)d;
    }
    return 0;
}

static int select_by_preference(loom_registry *reg, const char *pref, char *err, size_t err_size)
{
    char *copy = strdup(pref);
    if (!copy) {
        set_err(err, err_size, "out of memory");
        return -1;
    }
    /* First pass: every entry must name something that exists, so a typo is never silently
     * skipped in favour of a later entry. */
    int rc = -1;
    char *save = NULL;
    for (char *e = strtok_r(copy, ",", &save); e; e = strtok_r(NULL, ",", &save)) {
        char name[64];
        int device, known = 0;
        if (parse_entry(e, name, sizeof name, &device)) {
            set_err(err, err_size, "LOOM_BACKEND: '%s' is not NAME or NAME:DEVICE (e.g. cuda:1,cpu)",
                    e);
            goto out;
        }
        for (int i = 0; i < reg->count; i++)
            known |= name_matches(&reg->items[i], name);
        if (!known) {
            set_err(err, err_size, "LOOM_BACKEND: no backend named '%s'. Backends found:", name);
            list_candidates(reg, err, err_size);
            goto out;
        }
    }
    strcpy(copy, pref);
    save = NULL;
    char why[1024] = "";
    for (char *e = strtok_r(copy, ",", &save); e; e = strtok_r(NULL, ",", &save)) {
        char name[64];
        int device;
        parse_entry(e, name, sizeof name, &device);
        int best = best_usable(reg, name);
        size_t used = strlen(why);
        if (best < 0) {
            snprintf(why + used, sizeof why - used, "%s'%s' is not usable here", used ? "; " : "",
                     name);
            continue;
        }
        if (device >= (int)reg->items[best].probe.n_devices) {
            snprintf(why + used, sizeof why - used, "%s'%s' has %u device(s), no device %d",
                     used ? "; " : "", name, reg->items[best].probe.n_devices, device);
            continue;
        }
        reg->chosen = best;
        reg->chosen_device = device < 0 ? 0 : device;
        set_err(reg->items[best].reason, sizeof reg->items[best].reason,
                "LOOM_BACKEND=%s picks it%s%s", pref, why[0] ? " (" : "", why);
        if (why[0])
            strncat(reg->items[best].reason, ")",
                    sizeof reg->items[best].reason - strlen(reg->items[best].reason) - 1);
        rc = 0;
        goto out;
    }
    set_err(err, err_size, "LOOM_BACKEND=%s: nothing usable (%s). Backends found:", pref, why);
    list_candidates(reg, err, err_size);
out:
    free(copy);
    return rc;
}

int loom_registry_select(loom_registry *reg, const char *preference, char *err, size_t err_size)
{
    const char *pref = preference ? preference : getenv("LOOM_BACKEND");
    exclude_shadowed(reg);
    int rc = apply_cpu_env(reg, err, err_size);
    if (rc == 0 && pref && *pref) {
        rc = select_by_preference(reg, pref, err, err_size);
    } else if (rc == 0) {
        int best = best_usable(reg, NULL);
        if (best < 0) {
            set_err(err, err_size, "no usable backend. Backends found:");
            list_candidates(reg, err, err_size);
            rc = -1;
        } else {
            reg->chosen = best;
            reg->chosen_device = 0;
            set_err(reg->items[best].reason, sizeof reg->items[best].reason,
                    "highest score among usable backends");
        }
    }
    if (rc == 0) {
        loom_candidate *ch = &reg->items[reg->chosen];
        ch->state = LOOM_CAND_CHOSEN;
        char l[160];
        label(ch, l, sizeof l);
        for (int i = 0; i < reg->count; i++) {
            loom_candidate *c = &reg->items[i];
            if (c->state != LOOM_CAND_USABLE)
                continue;
            if (pref && *pref)
                set_err(c->reason, sizeof c->reason, "LOOM_BACKEND=%s picked %s", pref, l);
            else
                set_err(c->reason, sizeof c->reason, "score %d is below %s's %d",
                        c->probe.score, l, ch->probe.score);
        }
    }
    if (explain_wanted()) {
        loom_registry_print(reg, stderr);
        if (rc)
            fprintf(stderr, "loom: %s\n", err);
    }
    return rc;
}

/* ---- Reporting -------------------------------------------------------------------------- */

static void format_bytes(uint64_t b, char *out, size_t n)
{
    if (b >= (1ull << 30))
        snprintf(out, n, "%.1f GiB", (double)b / (double)(1ull << 30));
    else
        snprintf(out, n, "%.1f MiB", (double)b / (double)(1ull << 20));
}

void loom_registry_print(const loom_registry *reg, FILE *out)
{
    fprintf(out, "loom backend modules (ABI %d.%d), searched: %s\n", LOOM_BACKEND_ABI_MAJOR,
            LOOM_BACKEND_ABI_MINOR, reg->search_path[0] ? reg->search_path : "(nothing)");
    if (reg->count == 0)
        fprintf(out, "  none found. Build loom's backends, or point LOOM_BACKEND_PATH at a "
                     "directory holding backend .so files.\n");
    for (int i = 0; i < reg->count; i++) {
        const loom_candidate *c = &reg->items[i];
        char l[160];
        label(c, l, sizeof l);
        fprintf(out, "\n%s %s\n", c->state == LOOM_CAND_CHOSEN ? "*" : "-", l);
        fprintf(out, "    path:    %s\n", c->path);
        if (c->name[0]) {
            fprintf(out, "    about:   %s\n", c->description);
            fprintf(out, "    abi:     %u.%u\n", c->abi_major, c->abi_minor);
            fprintf(out, "    score:   %d\n", c->probe.score);
        }
        fprintf(out, "    status:  %s%s%s\n", loom_candidate_state_name(c->state),
                c->reason[0] ? ": " : "", c->reason);
        for (uint32_t d = 0; d < c->probe.n_devices; d++) {
            char mem[32];
            format_bytes(c->probe.devices[d].memory_bytes, mem, sizeof mem);
            fprintf(out, "    device %u: %s, %s%s%s%s\n", d, c->probe.devices[d].name, mem,
                    c->probe.devices[d].detail[0] ? " (" : "", c->probe.devices[d].detail,
                    c->probe.devices[d].detail[0] ? ")" : "");
        }
    }
    if (reg->chosen >= 0) {
        char l[160];
        label(&reg->items[reg->chosen], l, sizeof l);
        fprintf(out, "\nchosen: %s, device %d\n", l, reg->chosen_device);
    }
}

char *loom_registry_json(const loom_registry *reg)
{
    cJSON *root = cJSON_CreateObject();
    cJSON *abi = cJSON_AddObjectToObject(root, "abi");
    cJSON_AddNumberToObject(abi, "major", LOOM_BACKEND_ABI_MAJOR);
    cJSON_AddNumberToObject(abi, "minor", LOOM_BACKEND_ABI_MINOR);
    cJSON_AddStringToObject(root, "search_path", reg->search_path);
    cJSON *list = cJSON_AddArrayToObject(root, "candidates");
    for (int i = 0; i < reg->count; i++) {
        const loom_candidate *c = &reg->items[i];
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "path", c->path);
        cJSON_AddStringToObject(o, "name", c->name);
        cJSON_AddStringToObject(o, "variant", c->variant);
        cJSON_AddStringToObject(o, "description", c->description);
        char v[32];
        snprintf(v, sizeof v, "%u.%u", c->abi_major, c->abi_minor);
        cJSON_AddStringToObject(o, "abi_version", c->name[0] ? v : "");
        cJSON_AddStringToObject(o, "status", loom_candidate_state_name(c->state));
        cJSON_AddBoolToObject(o, "usable",
                              c->state >= LOOM_CAND_EXCLUDED);
        cJSON_AddBoolToObject(o, "chosen", c->state == LOOM_CAND_CHOSEN);
        cJSON_AddNumberToObject(o, "score", c->probe.score);
        cJSON_AddStringToObject(o, "reason", c->reason);
        cJSON *devs = cJSON_AddArrayToObject(o, "devices");
        for (uint32_t d = 0; d < c->probe.n_devices; d++) {
            cJSON *dj = cJSON_CreateObject();
            cJSON_AddNumberToObject(dj, "index", d);
            cJSON_AddStringToObject(dj, "name", c->probe.devices[d].name);
            cJSON_AddNumberToObject(dj, "memory_bytes", (double)c->probe.devices[d].memory_bytes);
            cJSON_AddStringToObject(dj, "detail", c->probe.devices[d].detail);
            cJSON_AddItemToArray(devs, dj);
        }
        cJSON_AddItemToArray(list, o);
    }
    if (reg->chosen >= 0) {
        cJSON_AddStringToObject(root, "chosen", reg->items[reg->chosen].path);
        cJSON_AddNumberToObject(root, "chosen_device", reg->chosen_device);
    } else {
        cJSON_AddNullToObject(root, "chosen");
    }
    char *s = cJSON_Print(root);
    cJSON_Delete(root);
    return s;
}

/* ---- Opening ---------------------------------------------------------------------------- */

int loom_device_open(loom_device *dev, const char *path, int device, int n_threads, char *err,
                     size_t err_size)
{
    memset(dev, 0, sizeof *dev);
    loom_candidate_state state;
    char reason[512];
    dev->handle = load_module(path, &dev->module, &state, reason, sizeof reason);
    if (!dev->handle) {
        set_err(err, err_size, "%s: %s", path, reason);
        return -1;
    }
    copy_str(dev->name, sizeof dev->name, dev->module.name);
    copy_str(dev->variant, sizeof dev->variant, dev->module.variant);
    dev->device = device;
    loom_backend_options opts = {.struct_size = sizeof opts, .device = device,
                                 .n_threads = n_threads};
    char msg[512] = "";
    loom_status st = dev->module.open(&opts, &dev->be, msg, sizeof msg);
    if (st != LOOM_OK || !dev->be || !dev->be->ops) {
        set_err(err, err_size, "%s: cannot open device %d: %s", path, device,
                msg[0] ? msg : "open failed without a message");
        dlclose(dev->handle);
        memset(dev, 0, sizeof *dev);
        return -1;
    }
    const loom_backend_ops *ops = dev->be->ops;
    copy_declared(&dev->ops, sizeof dev->ops, ops, ops->struct_size);
    if (!dev->ops.close || !dev->ops.last_error || !dev->ops.supports || !dev->ops.buffer_alloc ||
        !dev->ops.buffer_free || !dev->ops.copy_from_host || !dev->ops.copy_to_host ||
        !dev->ops.synchronize) {
        set_err(err, err_size, "%s: its op table lacks a required member (close, last_error, "
                               "supports, buffers, copies or synchronize)", path);
        if (dev->ops.close)
            dev->ops.close(dev->be);
        dlclose(dev->handle);
        memset(dev, 0, sizeof *dev);
        return -1;
    }
    return 0;
}

int loom_device_open_chosen(loom_device *dev, const loom_registry *reg, int n_threads, char *err,
                            size_t err_size)
{
    if (reg->chosen < 0) {
        set_err(err, err_size, "no backend was chosen");
        return -1;
    }
    return loom_device_open(dev, reg->items[reg->chosen].path, reg->chosen_device, n_threads, err,
                            err_size);
}

void loom_device_close(loom_device *dev)
{
    if (dev->be)
        dev->ops.close(dev->be);
    if (dev->handle)
        dlclose(dev->handle);
    memset(dev, 0, sizeof *dev);
}

/* Whether the module's table (host copy, zero past its declared size) has the op. */
int loom_device_op_present(const loom_device *dev, loom_op op)
{
    const loom_backend_ops *o = &dev->ops;
    switch (op) {
    case LOOM_OP_MATMUL: return o->matmul != NULL;
    case LOOM_OP_GET_ROWS: return o->get_rows != NULL;
    case LOOM_OP_RMS_NORM: return o->rms_norm != NULL;
    case LOOM_OP_LAYER_NORM: return o->layer_norm != NULL;
    case LOOM_OP_ROPE: return o->rope != NULL;
    case LOOM_OP_ADD: return o->add != NULL;
    case LOOM_OP_MUL: return o->mul != NULL;
    case LOOM_OP_SCALE: return o->scale != NULL;
    case LOOM_OP_SILU_MUL: return o->silu_mul != NULL;
    case LOOM_OP_GELU: return o->gelu != NULL;
    case LOOM_OP_KV_STORE: return o->kv_store != NULL;
    case LOOM_OP_ATTENTION: return o->attention != NULL;
    case LOOM_OP_QUANTIZE: return o->quantize != NULL;
    case LOOM_OP_DEQUANTIZE: return o->dequantize != NULL;
    case LOOM_OP_CONVERT: return o->convert != NULL;
    case LOOM_OP_COUNT_V1_0: break;
    }
    return 0;
}

int loom_device_supports(const loom_device *dev, loom_op op, loom_dtype dtype)
{
    return loom_device_op_present(dev, op) && dev->ops.supports(dev->be, op, dtype);
}

loom_status loom_device_run(const loom_device *d, loom_op op, const void *p)
{
    const loom_backend_ops *o = &d->ops;
    switch (op) {
    case LOOM_OP_MATMUL: return o->matmul(d->be, p);
    case LOOM_OP_GET_ROWS: return o->get_rows(d->be, p);
    case LOOM_OP_RMS_NORM: return o->rms_norm(d->be, p);
    case LOOM_OP_LAYER_NORM: return o->layer_norm(d->be, p);
    case LOOM_OP_ROPE: return o->rope(d->be, p);
    case LOOM_OP_ADD: return o->add(d->be, p);
    case LOOM_OP_MUL: return o->mul(d->be, p);
    case LOOM_OP_SCALE: return o->scale(d->be, p);
    case LOOM_OP_SILU_MUL: return o->silu_mul(d->be, p);
    case LOOM_OP_GELU: return o->gelu(d->be, p);
    case LOOM_OP_KV_STORE: return o->kv_store(d->be, p);
    case LOOM_OP_ATTENTION: return o->attention(d->be, p);
    case LOOM_OP_QUANTIZE: return o->quantize(d->be, p);
    case LOOM_OP_DEQUANTIZE: return o->dequantize(d->be, p);
    case LOOM_OP_CONVERT: return o->convert(d->be, p);
    default: return LOOM_ERR_UNSUPPORTED;
    }
}
