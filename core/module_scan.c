/*
 * core/module_scan.c - finding backend modules and vetting each (loading it, checking its ABI,
 * probing it in a child process). See loader.h.
 */
#define _GNU_SOURCE
#include "loader_internal.h"

#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
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

void loader_set_err(char *err, size_t n, const char *fmt, ...)
{
    if (!err || !n)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, n, fmt, ap);
    va_end(ap);
}

void loader_copy_str(char *dst, size_t n, const char *src)
{
    snprintf(dst, n, "%s", src ? src : "");
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

void loader_copy_declared(void *dst, size_t dst_size, const void *src, uint32_t src_size)
{
    memset(dst, 0, dst_size);
    memcpy(dst, src, src_size < dst_size ? src_size : dst_size);
}

void *loader_load_module(const char *path, loom_backend_module *mod, loom_candidate_state *state,
                         char *reason, size_t reason_size)
{
    dlerror();
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        *state = LOOM_CAND_NOT_LOADABLE;
        loader_set_err(reason, reason_size, "dlopen failed: %s", e ? e : "unknown error");
        return NULL;
    }
    loom_backend_entry_fn entry;
    *(void **)&entry = dlsym(h, LOOM_BACKEND_ENTRY_SYMBOL);
    const loom_backend_module *m = entry ? entry(LOOM_BACKEND_ABI_MAJOR, LOOM_BACKEND_ABI_MINOR)
                                         : NULL;
    if (!m) {
        *state = LOOM_CAND_NO_ENTRY;
        loader_set_err(reason, reason_size,
                       entry ? "%s() returned NULL" : "no %s symbol: not a loom backend",
                       LOOM_BACKEND_ENTRY_SYMBOL);
        dlclose(h);
        return NULL;
    }
    /* abi_major/minor sit at fixed offsets in every version; check them before trusting
     * struct_size for anything else. */
    if (m->abi_major != LOOM_BACKEND_ABI_MAJOR || m->abi_minor > LOOM_BACKEND_ABI_MINOR) {
        *state = LOOM_CAND_BAD_ABI;
        loader_set_err(reason, reason_size,
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
        loader_set_err(reason, reason_size, "module table is incomplete (no name, probe or open)");
        dlclose(h);
        return NULL;
    }
    loader_copy_declared(mod, sizeof *mod, m, m->struct_size);
    if (mod->kind > LOOM_MODULE_DECORATOR) {
        *state = LOOM_CAND_BAD_ABI;
        loader_set_err(reason, reason_size,
                       "module kind %u is none this loom knows (0 backend, "
                       "1 decorator)",
                       mod->kind);
        dlclose(h);
        return NULL;
    }
    return h;
}

/* What vetting one file learns: everything a candidate keeps, copied out of the module. */
typedef struct vet_result {
    loom_candidate_state state;
    char reason[512];
    char name[64], variant[64], description[256];
    uint32_t abi_major, abi_minor;
    uint32_t kind;
    loom_probe_result probe;
} vet_result;

/* Loads path, checks it and runs its probe, in this process. */
static void vet_here(const char *path, vet_result *r)
{
    memset(r, 0, sizeof *r);
    loom_backend_module mod;
    void *h = loader_load_module(path, &mod, &r->state, r->reason, sizeof r->reason);
    if (!h)
        return;
    loader_copy_str(r->name, sizeof r->name, mod.name);
    loader_copy_str(r->variant, sizeof r->variant, mod.variant);
    loader_copy_str(r->description, sizeof r->description, mod.description);
    r->abi_major = mod.abi_major;
    r->abi_minor = mod.abi_minor;
    r->kind = mod.kind;
    r->probe.struct_size = sizeof r->probe;
    mod.probe(&r->probe);
    r->state = LOOM_CAND_USABLE; /* judged by the caller from the probe result */
    dlclose(h);
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
static void vet_isolated(const char *path, long timeout, vet_result *r)
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
        /* its own process group: whatever a module's constructor forks is killed with it */
        setpgid(0, 0);
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
    setpgid(pid, pid); /* as the child does: whichever runs first */
    close(fds[1]);
    fcntl(fds[0], F_SETFL, fcntl(fds[0], F_GETFL) | O_NONBLOCK);
    double deadline = now_s() + (double)timeout;
    size_t got = 0;
    int timed_out = 0, status = 0, reaped = 0;
    while (got < sizeof *r) {
        ssize_t n = read(fds[0], (char *)r + got, sizeof *r - got);
        if (n > 0) {
            got += (size_t)n;
            continue;
        }
        if (n == 0 || (errno != EAGAIN && errno != EINTR))
            break; /* every writer closed the pipe */
        if (reaped)
            break; /* the child is gone and what it left is read: a process it forked may
                    * hold the pipe open, but will not answer for it */
        int wait_ms = (int)((deadline - now_s()) * 1000);
        if (wait_ms <= 0) {
            timed_out = 1;
            break;
        }
        struct pollfd pf = {fds[0], POLLIN, 0};
        if (poll(&pf, 1, wait_ms < 50 ? wait_ms : 50) == 0 && waitpid(pid, &status, WNOHANG) == pid)
            reaped = 1;
    }
    close(fds[0]);
    kill(-pid, SIGKILL); /* the child if it still runs, and anything it started */
    kill(pid, SIGKILL);
    while (!reaped && waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (got == sizeof *r && r->state >= LOOM_CAND_NOT_LOADABLE && r->state <= LOOM_CAND_CHOSEN) {
        /* the reply came through a pipe a module could also write to: its strings are
         * bounded here before anything reads them */
        r->reason[sizeof r->reason - 1] = '\0';
        r->name[sizeof r->name - 1] = r->variant[sizeof r->variant - 1] = '\0';
        r->description[sizeof r->description - 1] = '\0';
        return;
    }
    int garbled = got == sizeof *r;
    memset(r, 0, sizeof *r);
    r->state = LOOM_CAND_PROBE_FAILED;
    if (garbled)
        loader_set_err(r->reason, sizeof r->reason,
                       "the probe's answer is not one loom sent (something the module runs "
                       "wrote to the probe's pipe)");
    else if (timed_out)
        loader_set_err(r->reason, sizeof r->reason,
                       "probe timed out after %ld s "
                       "(LOOM_PROBE_TIMEOUT): loading or probing the module hangs",
                       timeout);
    else if (WIFSIGNALED(status))
        loader_set_err(r->reason, sizeof r->reason,
                       "probe crashed (signal %d, %s) while "
                       "loading or probing the module",
                       WTERMSIG(status), strsignal(WTERMSIG(status)));
    else
        loader_set_err(r->reason, sizeof r->reason,
                       "probe exited (status %d) without an answer "
                       "while loading or probing the module",
                       WIFEXITED(status) ? WEXITSTATUS(status) : -1);
}

int loom_registry_add_file(loom_registry *reg, const char *path, char *err, size_t err_size)
{
    loom_candidate *items = realloc(reg->items, (size_t)(reg->count + 1) * sizeof *items);
    if (!items) {
        loader_set_err(err, err_size, "out of memory listing backends");
        return -1;
    }
    reg->items = items;
    loom_candidate *c = &items[reg->count++];
    memset(c, 0, sizeof *c);
    loader_copy_str(c->path, sizeof c->path, path);

    vet_result r;
    if (!reg->opts.probe_in_process)
        vet_isolated(path, reg->opts.probe_timeout_s > 0 ? reg->opts.probe_timeout_s : 5, &r);
    else
        vet_here(path, &r);
    c->state = r.state;
    loader_copy_str(c->reason, sizeof c->reason, r.reason);
    if (r.state != LOOM_CAND_USABLE)
        return 0;
    r.name[sizeof r.name - 1] = r.variant[sizeof r.variant - 1] = '\0';
    r.description[sizeof r.description - 1] = '\0';
    loader_copy_str(c->name, sizeof c->name, r.name);
    loader_copy_str(c->variant, sizeof c->variant, r.variant);
    loader_copy_str(c->description, sizeof c->description, r.description);
    c->abi_major = r.abi_major;
    c->abi_minor = r.abi_minor;
    c->kind = r.kind;
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
        loader_copy_str(c->reason, sizeof c->reason,
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

static int is_module_name(const char *name)
{
    return has_suffix(name, ".so");
}

static int is_visible_name(const char *name)
{
    return name[0] != '.';
}

/* The names in dir that keep() accepts, sorted so that reports are stable: *names (free with
 * free_names) and their count; 0 for a directory that cannot be read, -1 out of memory. */
static int sorted_names(const char *dir, int (*keep)(const char *name), char ***names)
{
    *names = NULL;
    DIR *d = opendir(dir);
    if (!d)
        return 0; /* a missing directory is normal: not every install has every place */
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (!keep(e->d_name))
            continue;
        char **grown = realloc(*names, (size_t)(n + 1) * sizeof **names);
        if (!grown || !(grown[n] = strdup(e->d_name))) {
            *names = grown ? grown : *names;
            closedir(d);
            while (n > 0)
                free((*names)[--n]);
            free(*names);
            *names = NULL;
            return -1;
        }
        *names = grown;
        n++;
    }
    closedir(d);
    qsort(*names, (size_t)n, sizeof **names, cmp_str);
    return n;
}

static void free_names(char **names, int n)
{
    for (int i = 0; i < n; i++)
        free(names[i]);
    free(names);
}

/* Adds every *.so in dir, in name order. */
static int scan_dir(loom_registry *reg, const char *dir, char *err, size_t err_size)
{
    size_t used = strlen(reg->search_path);
    snprintf(reg->search_path + used, sizeof reg->search_path - used, "%s%s", used ? ":" : "", dir);
    char **names;
    int n = sorted_names(dir, is_module_name, &names), rc = n < 0 ? -1 : 0;
    for (int i = 0; i < n && rc == 0; i++) {
        char path[PATH_MAX], real[PATH_MAX];
        struct stat st;
        if (!path_fits(snprintf(path, sizeof path, "%s/%s", dir, names[i]), sizeof path) ||
            stat(path, &st) != 0 || !S_ISREG(st.st_mode) || !realpath(path, real) ||
            already_listed(reg, real))
            continue;
        rc = loom_registry_add_file(reg, path, err, err_size);
    }
    free_names(names, n);
    if (rc)
        loader_set_err(err, err_size, "out of memory listing backends");
    return rc;
}

int loom_exe_dir(char *out, size_t n)
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

/* Scans <top>/<each folder>/.libs: where libtool leaves an uninstalled build's modules. */
static int scan_libs_dirs(loom_registry *reg, const char *top, char *err, size_t err_size)
{
    char **subs;
    int n = sorted_names(top, is_visible_name, &subs), rc = n < 0 ? -1 : 0;
    for (int i = 0; i < n && rc == 0; i++) {
        char dir[PATH_MAX];
        struct stat st;
        if (path_fits(snprintf(dir, sizeof dir, "%s/%s/.libs", top, subs[i]), sizeof dir) &&
            stat(dir, &st) == 0 && S_ISDIR(st.st_mode))
            rc = scan_dir(reg, dir, err, err_size);
    }
    free_names(subs, n);
    if (rc)
        loader_set_err(err, err_size, "out of memory listing backends");
    return rc;
}

/* In an uninstalled build, modules sit in backends/<name>/.libs/ and plugins/<name>/.libs/
 * under the build tree. */
int loom_build_tree(const char *exe, char *build, size_t n)
{
    char real[PATH_MAX];
    if (!LOOM_BUILD_DIR[0] || !realpath(LOOM_BUILD_DIR, real))
        return 0;
    size_t bl = strlen(real);
    if (strncmp(exe, real, bl) != 0 || (exe[bl] != '/' && exe[bl] != '\0'))
        return 0;
    snprintf(build, n, "%s", real);
    return 1;
}

static int scan_build_tree(loom_registry *reg, const char *exe, char *err, size_t err_size)
{
    char build[PATH_MAX];
    if (!loom_build_tree(exe, build, sizeof build))
        return 0;
    static const char *const folders[] = {"backends", "plugins"};
    for (size_t i = 0; i < sizeof folders / sizeof folders[0]; i++) {
        char top[PATH_MAX];
        if (path_fits(snprintf(top, sizeof top, "%s/%s", build, folders[i]), sizeof top) &&
            scan_libs_dirs(reg, top, err, err_size))
            return -1;
    }
    return 0;
}

int loom_registry_scan(loom_registry *reg, const loom_loader_options *opts, char *err,
                       size_t err_size)
{
    memset(reg, 0, sizeof *reg);
    reg->chosen = -1;
    if (opts)
        reg->opts = *opts;

    const char *env = reg->opts.search_path;
    if (env && *env) {
        char *copy = strdup(env);
        if (!copy) {
            loader_set_err(err, err_size, "out of memory");
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
    if (loom_exe_dir(exe, sizeof exe) == 0) {
        if (scan_build_tree(reg, exe, err, err_size))
            return -1;
        char rel[PATH_MAX], real[PATH_MAX];
        if (path_fits(snprintf(rel, sizeof rel, "%s/../lib/loom/backends", exe), sizeof rel) &&
            realpath(rel, real) && scan_dir(reg, real, err, err_size))
            return -1;
    }
    int rc = scan_dir(reg, LOOM_PKGLIBDIR "/backends", err, err_size);
    if (rc == 0)
        loader_exclude_shadowed(reg);
    return rc;
}

void loom_registry_free(loom_registry *reg)
{
    free(reg->items);
    memset(reg, 0, sizeof *reg);
    reg->chosen = -1;
}
