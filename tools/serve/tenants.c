/*
 * tools/serve/tenants.c - API keys and tenants: the key files, and a request's place in the
 * engine (its tenant, priority floor, cache partition and deadline).
 */
#define _GNU_SOURCE
#include "tools/serve/server.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The prefix-cache partition of a request. Tenants (who: 1, 2, ... of --api-keys) never share
 * one: a cache hit, and the time it saves, would tell one what another's prompts began with.
 * Within a tenant (or without keys) requests share, or with --prefix-cache per-user only those
 * with the same "user" field do (a request without one shares with nobody). */
static uint64_t cache_partition(const server *srv, int who, const char *user)
{
    static uint64_t anonymous;
    if (!srv->partition_by_user)
        return (uint64_t)who << 1; /* 0: the common one */
    if (!user)
        return __atomic_add_fetch(&anonymous, 1, __ATOMIC_RELAXED) << 1 | 1; /* odd: no user */
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < 4; i++) /* the tenant's bytes, then the user's */
        h = (h ^ ((unsigned)who >> (8 * i) & 0xff)) * 1099511628211ull;
    for (const char *c = user; *c; c++)
        h = (h ^ (unsigned char)*c) * 1099511628211ull;
    return h << 1; /* even, and 0 only for the common partition's sake by chance (2^-63) */
}

/* A request's place in the engine: its cache partition, priority (its own, else its key's; a
 * key's priority is the best its requests get: they may ask for worse, not better), deadline
 * (its own, else --request-timeout) and tenant (who: its key, 0 none) with the key's limits. */
void tenants_admit(loom_request *r, const server *srv, int who, const char *user, int32_t priority,
                   int priority_given, double timeout_s)
{
    const tenant *tn = who > 0 ? &srv->tenants[who - 1] : NULL;
    r->cache_partition = cache_partition(srv, who, user);
    r->priority = !tn                               ? priority
        : priority_given && priority > tn->priority ? priority
                                                    : tn->priority;
    r->timeout_ms = 1e3 * (timeout_s > 0 ? timeout_s : srv->timeout_s);
    r->tenant = who;
    r->tenant_max_running = tn ? tn->max_running : 0;
    r->tenant_max_queue = tn ? tn->max_queue : 0;
}

/* The key is the file's first line (a trailing newline, and CR, dropped); flag: the option
 * that named the file. */
int keys_read_file(const char *flag, const char *path, char *key, size_t cap)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "loom serve: %s %s: %s\n", flag, path, strerror(errno));
        return -1;
    }
    int ok = fgets(key, (int)cap, f) != NULL;
    fclose(f);
    key[ok ? strcspn(key, "\r\n") : 0] = '\0';
    if (!key[0]) {
        fprintf(stderr, "loom serve: %s %s: the first line is empty\n", flag, path);
        return -1;
    }
    return 0;
}

int keys_valid(const char *key)
{
    size_t n = strlen(key);
    for (size_t i = 0; i < n; i++)
        if (key[i] <= ' ' || key[i] > '~')
            return 0;
    return n >= 1 && n <= 1024;
}

/* --api-keys FILE: one tenant per line, "NAME KEY [priority=N] [max-running=N] [max-queue=N]
 * [admin]" (blank lines and lines starting with '#' skipped). Every problem is named with its
 * line. */
int keys_read_tenants(const char *path, server *srv)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "loom serve: --api-keys %s: %s\n", path, strerror(errno));
        return -1;
    }
    char line[2048];
    int n_line = 0, rc = 0;
    srv->tenants = calloc(LOOM_MAX_TENANTS, sizeof *srv->tenants);
    if (!srv->tenants) {
        fclose(f);
        return -1;
    }
    while (rc == 0 && fgets(line, sizeof line, f)) {
        n_line++;
        if (!strchr(line, '\n') && !feof(f)) {
            fprintf(stderr, "loom serve: --api-keys %s:%d: the line is too long\n", path, n_line);
            rc = -1;
            break;
        }
        char *save = NULL, *name = strtok_r(line, " \t\r\n", &save);
        if (!name || name[0] == '#')
            continue;
        char *key = strtok_r(NULL, " \t\r\n", &save);
        int name_ok = strlen(name) < sizeof srv->tenants[0].name;
        for (const char *c = name; name_ok && *c; c++)
            name_ok = isalnum((unsigned char)*c) || *c == '_' || *c == '-' || *c == '.';
        if (!name_ok || !key || !keys_valid(key)) {
            fprintf(stderr,
                    "loom serve: --api-keys %s:%d: want 'NAME KEY [priority=N] [max-running=N] "
                    "[max-queue=N]': NAME of letters, digits, '_', '-' or '.' (up to 63), KEY of "
                    "1 to 1024 visible ASCII characters\n",
                    path, n_line);
            rc = -1;
            break;
        }
        if (srv->n_tenants == LOOM_MAX_TENANTS) {
            fprintf(stderr, "loom serve: --api-keys %s:%d: more than %d keys\n", path, n_line,
                    LOOM_MAX_TENANTS);
            rc = -1;
            break;
        }
        tenant *t = &srv->tenants[srv->n_tenants];
        snprintf(t->name, sizeof t->name, "%s", name);
        for (char *opt; rc == 0 && (opt = strtok_r(NULL, " \t\r\n", &save));) {
            if (!strcmp(opt, "admin")) {
                t->admin = 1;
                continue;
            }
            char *end;
            const char *eq = strchr(opt, '=');
            long v = eq ? strtol(eq + 1, &end, 10) : 0;
            int32_t *dest = !eq                     ? NULL
                : !strncmp(opt, "priority=", 9)     ? &t->priority
                : !strncmp(opt, "max-running=", 12) ? &t->max_running
                : !strncmp(opt, "max-queue=", 10)   ? &t->max_queue
                                                    : NULL;
            long lo = dest == &t->priority ? -1000000 : 1;
            if (!dest || eq[1] == '\0' || *end || v < lo || v > 1000000) {
                fprintf(stderr,
                        "loom serve: --api-keys %s:%d: '%s' is not priority=N (-1000000 to "
                        "1000000), max-running=N, max-queue=N (1 to 1000000) or admin\n",
                        path, n_line, opt);
                rc = -1;
            } else {
                *dest = (int32_t)v;
            }
        }
        for (int i = 0; rc == 0 && i < srv->n_tenants; i++)
            if (!strcmp(srv->tenants[i].name, name) || !strcmp(srv->tenants[i].key, key)) {
                fprintf(stderr, "loom serve: --api-keys %s:%d: %s '%s' is given twice\n", path,
                        n_line, strcmp(srv->tenants[i].name, name) ? "the key of" : "the name",
                        name);
                rc = -1;
            }
        if (rc == 0 && !(t->key = strdup(key)))
            rc = -1;
        if (rc == 0)
            t->key_len = strlen(key), srv->n_tenants++;
    }
    fclose(f);
    if (rc == 0 && !srv->n_tenants) {
        fprintf(stderr, "loom serve: --api-keys %s: no keys in it\n", path);
        rc = -1;
    }
    if (rc != 0) {
        for (int i = 0; i < srv->n_tenants; i++)
            free(srv->tenants[i].key);
        free(srv->tenants);
        srv->tenants = NULL, srv->n_tenants = 0;
    }
    return rc;
}

/* the keys of --api-keys, for the server's life (freed at exit, on any path out) */
server keyring;

void keys_free(void)
{
    for (int i = 0; i < keyring.n_tenants; i++)
        free(keyring.tenants[i].key);
    free(keyring.tenants);
    keyring.tenants = NULL, keyring.n_tenants = 0;
}
