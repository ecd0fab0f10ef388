/*
 * core/module_policy.c - choosing one vetted module: LOOM_BACKEND (or the caller's preference),
 * the CPU variant env vars, then the probes' scores; every candidate keeps why it was or was
 * not chosen. See loader.h.
 */
#define _GNU_SOURCE
#include "loader_internal.h"

#include <stdlib.h>
#include <string.h>

/* CPU variants in increasing ISA order, for LOOM_CPU_MAX_ISA. */
static const char *const cpu_isa_order[] = {"baseline", "avx2", "avx512"};
#define N_CPU_ISAS ((int)(sizeof cpu_isa_order / sizeof cpu_isa_order[0]))

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

void loader_list_candidates(const loom_registry *reg, char *buf, size_t n)
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
        loader_label(c, l, sizeof l);
        used += (size_t)snprintf(buf + used, n - used, "\n  %s: %s%s%s%s", l,
                                 loom_candidate_state_name(c->state), c->reason[0] ? " (" : "",
                                 c->reason, c->reason[0] ? ")" : "");
    }
}

/* A module found again later in the search (the same name and variant: a second install, or
 * the build tree beside LOOM_BACKEND_PATH) is left out: the first one found is the one used,
 * so LOOM_BACKEND_PATH overrides the rest. */
void loader_exclude_shadowed(loom_registry *reg)
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
                loader_set_err(c->reason, sizeof c->reason, "shadowed by %s, found first",
                               first->path);
                break;
            }
        }
    }
}

static int apply_cpu_env(loom_registry *reg, char *err, size_t err_size)
{
    const char *force = reg->opts.cpu_variant;
    const char *cap = reg->opts.cpu_max_isa;
    int cap_rank = -1;
    if (cap && *cap) {
        cap_rank = isa_rank(cap);
        if (cap_rank < 0) {
            loader_set_err(err, err_size,
                           "LOOM_CPU_MAX_ISA=%s is not an ISA level; use "
                           "baseline, avx2 or avx512",
                           cap);
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
            loader_set_err(err, err_size, "%s", c->reason);
            return -1;
        }
    }
    if (force && *force) {
        int found = 0;
        for (int i = 0; i < reg->count; i++)
            found |= strcmp(reg->items[i].name, "cpu") == 0 &&
                strcmp(reg->items[i].variant, force) == 0;
        if (!found) {
            loader_set_err(err, err_size,
                           "LOOM_CPU_VARIANT=%s: no CPU module has that "
                           "variant. Backends found:",
                           force);
            loader_list_candidates(reg, err, err_size);
            return -1;
        }
    }
    for (int i = 0; i < reg->count; i++) {
        loom_candidate *c = &reg->items[i];
        if (strcmp(c->name, "cpu") != 0 || c->state != LOOM_CAND_USABLE)
            continue;
        if (force && *force && strcmp(c->variant, force) != 0) {
            c->state = LOOM_CAND_EXCLUDED;
            loader_set_err(c->reason, sizeof c->reason, "LOOM_CPU_VARIANT=%s", force);
        } else if (cap_rank >= 0 && isa_rank(c->variant) > cap_rank) {
            c->state = LOOM_CAND_EXCLUDED;
            loader_set_err(c->reason, sizeof c->reason, "above LOOM_CPU_MAX_ISA=%s", cap);
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
        if (c->state != LOOM_CAND_USABLE || c->kind != LOOM_MODULE_BACKEND ||
            (want && !name_matches(c, want)))
            continue;
        if (best < 0 || c->probe.score > reg->items[best].probe.score)
            best = i;
    }
    return best;
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
        loader_set_err(err, err_size, "out of memory");
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
            loader_set_err(err, err_size,
                           "LOOM_BACKEND: '%s' is not NAME or NAME:DEVICE (e.g. cuda:1,cpu)", e);
            goto out;
        }
        for (int i = 0; i < reg->count; i++)
            known |= name_matches(&reg->items[i], name) ? 1 + (int)reg->items[i].kind : 0;
        if (known == 1 + LOOM_MODULE_DECORATOR) {
            loader_set_err(err, err_size,
                           "LOOM_BACKEND: '%s' is a decorator, not a backend: it "
                           "wraps the chosen one when asked (LOOM_TRACE=FILE for the trace "
                           "plugin); name a backend here",
                           name);
            goto out;
        }
        if (!known) {
            loader_set_err(err, err_size,
                           "LOOM_BACKEND: no backend named '%s'. Backends found:", name);
            loader_list_candidates(reg, err, err_size);
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
        loader_set_err(reg->items[best].reason, sizeof reg->items[best].reason,
                       "LOOM_BACKEND=%s picks it%s%s", pref, why[0] ? " (" : "", why);
        if (why[0])
            strncat(reg->items[best].reason, ")",
                    sizeof reg->items[best].reason - strlen(reg->items[best].reason) - 1);
        rc = 0;
        goto out;
    }
    loader_set_err(err, err_size, "LOOM_BACKEND=%s: nothing usable (%s). Backends found:", pref,
                   why);
    loader_list_candidates(reg, err, err_size);
out:
    free(copy);
    return rc;
}

int loom_registry_select(loom_registry *reg, const char *preference, char *err, size_t err_size)
{
    const char *pref = preference;
    loader_exclude_shadowed(reg);
    int rc = apply_cpu_env(reg, err, err_size);
    if (rc == 0 && pref && *pref) {
        rc = select_by_preference(reg, pref, err, err_size);
    } else if (rc == 0) {
        int best = best_usable(reg, NULL);
        if (best < 0) {
            loader_set_err(err, err_size, "no usable backend. Backends found:");
            loader_list_candidates(reg, err, err_size);
            rc = -1;
        } else {
            reg->chosen = best;
            reg->chosen_device = 0;
            loader_set_err(reg->items[best].reason, sizeof reg->items[best].reason,
                           "highest score among usable backends");
        }
    }
    if (rc == 0) {
        loom_candidate *ch = &reg->items[reg->chosen];
        ch->state = LOOM_CAND_CHOSEN;
        char l[160];
        loader_label(ch, l, sizeof l);
        for (int i = 0; i < reg->count; i++) {
            loom_candidate *c = &reg->items[i];
            if (c->state != LOOM_CAND_USABLE)
                continue;
            if (c->kind == LOOM_MODULE_DECORATOR)
                loader_set_err(c->reason, sizeof c->reason,
                               "a decorator: wraps the chosen "
                               "backend when asked, never runs alone");
            else if (pref && *pref)
                loader_set_err(c->reason, sizeof c->reason, "LOOM_BACKEND=%s picked %s", pref, l);
            else
                loader_set_err(c->reason, sizeof c->reason, "score %d is below %s's %d",
                               c->probe.score, l, ch->probe.score);
        }
    }
    if (reg->opts.explain) {
        loom_registry_print(reg, stderr);
        if (rc)
            fprintf(stderr, "loom: %s\n", err);
    }
    return rc;
}

int loom_registry_find_decorator(const loom_registry *reg, const char *name, char *err,
                                 size_t err_size)
{
    const loom_candidate *seen = NULL;
    for (int i = 0; i < reg->count; i++) {
        const loom_candidate *c = &reg->items[i];
        if (c->kind != LOOM_MODULE_DECORATOR || strcmp(c->name, name) != 0)
            continue;
        if (c->state == LOOM_CAND_USABLE || c->state == LOOM_CAND_CHOSEN)
            return i;
        if (!seen)
            seen = c;
    }
    if (seen)
        loader_set_err(err, err_size, "the %s plugin (%s) cannot be used: %s: %s", name, seen->path,
                       loom_candidate_state_name(seen->state), seen->reason);
    else
        loader_set_err(err, err_size,
                       "no %s plugin was found (loom-%s.so in LOOM_BACKEND_PATH "
                       "or loom's backend directory, %s)",
                       name, name, reg->search_path[0] ? reg->search_path : "nothing searched");
    return -1;
}
