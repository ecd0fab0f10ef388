/*
 * core/name_index.h - names (NUL-terminated strings owned elsewhere) to ids in a hash table,
 * so that readers of files with many entries find a name, and refuse one given twice, in
 * constant time instead of scanning everything read so far.
 */
#ifndef LOOM_CORE_NAME_INDEX_H
#define LOOM_CORE_NAME_INDEX_H

#include <stdint.h>

typedef struct loom_name_index {
    struct loom_name_slot *slots;
    uint64_t mask, count;
} loom_name_index;

/* Adds name -> id (name is not copied: it must outlive the index). Returns 0 when added, 1
 * when the name is there already (its id unchanged), -1 without memory. A zeroed index is
 * an empty one. */
int loom_name_index_add(loom_name_index *ix, const char *name, int64_t id);
/* The id of name, or -1. */
int64_t loom_name_index_find(const loom_name_index *ix, const char *name);
void loom_name_index_free(loom_name_index *ix);

#endif
