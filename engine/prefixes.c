/*
 * engine/prefixes.c - the prefix cache kept across restarts (loom_engine_options.prefix_file):
 * read back when the engine starts, written by loom_engine_save_prefixes once it has stopped, so
 * that a restarted server answers a long system prompt it has seen from its cache.
 *
 * The file: a header (magic, version, the model's fingerprint: an xxh3 of its whole GGUF, the
 * block size, the bytes of one block's K/V over every layer, the KV type), then a record per
 * block, each after its parent: the parent's record (-1 for a first block), the partition, the
 * block's token ids, its K/V bytes, and an xxh3 of the record. A file of another model (or the
 * same file changed), another block or KV layout, or one that does not read back whole is not
 * used: the engine starts with an empty cache and loom_engine_prefix_status says why. A model
 * with recurrent layers keeps none (its state at a prefix's end is not in the blocks), nor does
 * a pipeline's stage (the other layers' blocks are in other processes).
 */
#define _GNU_SOURCE
#include "engine/engine_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

static const char magic[8] = "LOOMKV1";

typedef struct prefix_header {
    char magic[8];
    uint64_t model, block_bytes;
    int32_t block_size, kv_type, n_records, reserved;
} prefix_header;

typedef struct prefix_record {
    int32_t parent;
    int32_t reserved;
    uint64_t partition;
} prefix_record;

static void header_of(const loom_engine *e, prefix_header *h, int32_t n_records)
{
    memset(h, 0, sizeof *h);
    memcpy(h->magic, magic, sizeof magic);
    h->model = loom_model_fingerprint(e->model);
    h->block_bytes = loom_runner_block_bytes(e->runner);
    h->block_size = e->bs;
    h->kv_type = (int32_t)loom_runner_kv_type(e->runner);
    h->n_records = n_records;
}

/* the record's bytes: its head, its tokens, its K/V (tokens and kv inside buf) */
static size_t record_bytes(const loom_engine *e)
{
    return sizeof(prefix_record) + (size_t)e->bs * sizeof(int32_t) +
        (size_t)loom_runner_block_bytes(e->runner);
}

int engine_restore_prefixes(loom_engine *e, const char *path)
{
    e->prefix_file = path ? strdup(path) : NULL;
    if (!path)
        return 0;
    if (e->n_state_slots || loom_runner_is_stage(e->runner)) {
        snprintf(e->prefix_status, sizeof e->prefix_status, "%s: not used: %s", path,
                 e->n_state_slots ? "a model with recurrent layers keeps no prefix cache"
                                  : "a pipeline's stages keep no prefix cache");
        return 0;
    }
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(e->prefix_status, sizeof e->prefix_status, "%s: none yet (%s)", path,
                 strerror(errno));
        return 0;
    }
    prefix_header h, want;
    size_t rb = record_bytes(e);
    unsigned char *buf = malloc(rb + sizeof(uint64_t));
    int32_t *block_of = NULL;
    const char *why = NULL;
    int32_t restored = 0;
    if (fread(&h, sizeof h, 1, f) != 1 || memcmp(h.magic, magic, sizeof magic))
        why = "not a prefix cache file";
    header_of(e, &want, h.n_records);
    if (!why && h.model != want.model)
        why = "written for another model (or this file before it changed)";
    else if (!why &&
             (h.block_bytes != want.block_bytes || h.block_size != want.block_size ||
              h.kv_type != want.kv_type))
        why = "written for another block size or KV cache type";
    else if (!why &&
             (h.n_records < 0 || !buf ||
              !(block_of = malloc(((size_t)h.n_records + 1) * sizeof *block_of))))
        why = h.n_records < 0 ? "damaged" : "out of memory";
    for (int32_t k = 0; !why && k < h.n_records; k++) {
        prefix_record rec;
        if (fread(buf, rb + sizeof(uint64_t), 1, f) != 1) {
            why = "cut short";
            break;
        }
        uint64_t sum;
        memcpy(&sum, buf + rb, sizeof sum);
        memcpy(&rec, buf, sizeof rec);
        if (sum != XXH3_64bits(buf, rb) || rec.parent >= k || rec.parent < -1) {
            why = "damaged (a record's checksum or its parent is wrong)";
            break;
        }
        int32_t parent = rec.parent >= 0 ? block_of[rec.parent] : -1;
        const int32_t *ids = (const int32_t *)(buf + sizeof rec);
        block_of[k] = rec.parent >= 0 && parent < 0
            ? -1 /* its parent did not fit: nor does it */
            : loom_kvblocks_restore(e->kv, parent, rec.partition, ids);
        if (block_of[k] < 0)
            continue;
        char err[256];
        if (loom_runner_block_io(e->runner, block_of[k], buf + sizeof rec + (size_t)e->bs * 4, 0,
                                 err, sizeof err) != 0) {
            why = "could not be written to the cache";
            break;
        }
        e->restored_gen[block_of[k]] = loom_kvblocks_generation(e->kv, block_of[k]);
        restored++;
    }
    fclose(f);
    free(buf), free(block_of);
    if (why) { /* nothing half-restored stays: the cache starts empty */
        loom_kvblocks_free(e->kv);
        e->kv = loom_kvblocks_create(e->n_blocks, e->bs);
        memset(e->restored_gen, 0xff, (size_t)e->n_blocks * sizeof *e->restored_gen);
        snprintf(e->prefix_status, sizeof e->prefix_status, "%s: not used: %s", path, why);
        return e->kv ? 0 : -1;
    }
    e->prefix_blocks_restored = restored;
    snprintf(e->prefix_status, sizeof e->prefix_status,
             "%s: %d cached blocks (%d tokens) restored of %d", path, restored, restored * e->bs,
             h.n_records);
    return 0;
}

int32_t engine_restored_tokens(const loom_engine *e, const ereq *q, int32_t hit)
{
    int32_t n = 0;
    for (int32_t b = 0; b < hit / e->bs; b++) {
        int32_t i = q->kv.blocks[b];
        n += e->restored_gen[i] == loom_kvblocks_generation(e->kv, i) ? e->bs : 0;
    }
    return n;
}

const char *loom_engine_prefix_status(const loom_engine *e)
{
    return e->prefix_status;
}

int loom_engine_save_prefixes(loom_engine *e, char *err, size_t err_size)
{
    if (!e->prefix_file || e->n_state_slots || loom_runner_is_stage(e->runner))
        return 0;
    int32_t *order = malloc((size_t)e->n_blocks * sizeof *order);
    int32_t *parent = malloc((size_t)e->n_blocks * sizeof *parent);
    uint64_t *partition = malloc((size_t)e->n_blocks * sizeof *partition);
    size_t rb = record_bytes(e);
    unsigned char *buf = malloc(rb + sizeof(uint64_t));
    int32_t n = order && parent && partition && buf
        ? loom_kvblocks_prefixes(e->kv, order, parent, partition)
        : -1;
    /* written beside and renamed: a crash mid-write leaves the last good file */
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", e->prefix_file);
    FILE *f = n >= 0 ? fopen(tmp, "wb") : NULL;
    int rc = -1;
    if (n < 0)
        snprintf(err, err_size, "out of memory");
    else if (!f)
        snprintf(err, err_size, "%s: %s", tmp, strerror(errno));
    else {
        prefix_header h;
        header_of(e, &h, n);
        rc = fwrite(&h, sizeof h, 1, f) == 1 ? 0 : -1;
        for (int32_t k = 0; rc == 0 && k < n; k++) {
            prefix_record rec = {.parent = parent[k], .partition = partition[k]};
            memcpy(buf, &rec, sizeof rec);
            memcpy(buf + sizeof rec, loom_kvblocks_tokens(e->kv, order[k]),
                   (size_t)e->bs * sizeof(int32_t));
            rc = loom_runner_block_io(e->runner, order[k], buf + sizeof rec + (size_t)e->bs * 4, 1,
                                      err, err_size);
            uint64_t sum = XXH3_64bits(buf, rb);
            memcpy(buf + rb, &sum, sizeof sum);
            if (rc == 0 && fwrite(buf, rb + sizeof sum, 1, f) != 1) {
                snprintf(err, err_size, "%s: %s", tmp, strerror(errno));
                rc = -1;
            }
        }
        if (fclose(f) != 0 && rc == 0) {
            snprintf(err, err_size, "%s: %s", tmp, strerror(errno));
            rc = -1;
        }
        if (rc == 0 && rename(tmp, e->prefix_file) != 0) {
            snprintf(err, err_size, "%s: %s", e->prefix_file, strerror(errno));
            rc = -1;
        }
        if (rc != 0)
            remove(tmp);
        else
            snprintf(e->prefix_status, sizeof e->prefix_status, "%s: %d cached blocks saved",
                     e->prefix_file, n);
    }
    free(order), free(parent), free(partition), free(buf);
    return rc;
}
