/*
 * core/name_index.c - see name_index.h. Open addressing with linear probing, kept at most
 * half full.
 */
#include "name_index.h"

#include <stdlib.h>
#include <string.h>

struct loom_name_slot {
    const char *name; /* NULL: empty */
    int64_t id;
    uint64_t hash;
};

static uint64_t hash_name(const char *s)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a, 64 bits */
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

static struct loom_name_slot *probe(const loom_name_index *ix, const char *name, uint64_t h)
{
    for (uint64_t i = h & ix->mask;; i = (i + 1) & ix->mask) {
        struct loom_name_slot *s = &ix->slots[i];
        if (!s->name || (s->hash == h && strcmp(s->name, name) == 0))
            return s;
    }
}

static int grow(loom_name_index *ix)
{
    uint64_t cap = ix->slots ? (ix->mask + 1) * 2 : 64;
    loom_name_index bigger = {calloc(cap, sizeof *bigger.slots), cap - 1, ix->count};
    if (!bigger.slots)
        return -1;
    for (uint64_t i = 0; ix->slots && i <= ix->mask; i++)
        if (ix->slots[i].name)
            *probe(&bigger, ix->slots[i].name, ix->slots[i].hash) = ix->slots[i];
    free(ix->slots);
    *ix = bigger;
    return 0;
}

int loom_name_index_add(loom_name_index *ix, const char *name, int64_t id)
{
    if ((!ix->slots || 2 * (ix->count + 1) > ix->mask + 1) && grow(ix) != 0)
        return -1;
    uint64_t h = hash_name(name);
    struct loom_name_slot *s = probe(ix, name, h);
    if (s->name)
        return 1;
    *s = (struct loom_name_slot){name, id, h};
    ix->count++;
    return 0;
}

int64_t loom_name_index_find(const loom_name_index *ix, const char *name)
{
    if (!ix->slots)
        return -1;
    const struct loom_name_slot *s = probe(ix, name, hash_name(name));
    return s->name ? s->id : -1;
}

void loom_name_index_free(loom_name_index *ix)
{
    free(ix->slots);
    ix->slots = NULL;
    ix->mask = ix->count = 0;
}
