/*
 * core/kvblocks.c - see kvblocks.h.
 *
 * Data: per block a reference count, a generation, its chain hash and parent link when hashed,
 * and its block_size token ids. Free blocks sit on a stack; cached ones on a doubly linked LRU
 * list (head: evicted first); hashed ones also in a chained hash table.
 */
#include "kvblocks.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

typedef struct kv_block {
    int32_t ref;
    uint32_t gen;
    int hashed;
    uint64_t hash;
    uint64_t partition; /* a first block's (later ones are tied to it through parent) */
    int32_t parent;     /* previous block of the chain, -1 for the first */
    uint32_t parent_gen;
    int32_t hnext;      /* hash bucket chain */
    int32_t prev, next; /* LRU list, while cached */
} kv_block;

struct loom_kvblocks {
    int32_t n, bs;
    kv_block *b;
    int32_t *tokens; /* [n][bs]: a hashed block's ids */
    int32_t *free_stack, n_free;
    int32_t lru_head, lru_tail, n_cached;
    int32_t *bucket;
    uint32_t n_buckets; /* a power of two */
    uint64_t prompt_tokens, hit_tokens, evictions, copies;
};

#define CHAIN_SEED 0x9e3779b97f4a7c15ull

static uint64_t chain_hash(uint64_t parent, const int32_t *ids, int32_t n)
{
    uint64_t h = parent;
    for (int32_t i = 0; i < n; i++) {
        h ^= (uint32_t)ids[i];
        h *= 0x100000001b3ull;
        h ^= h >> 29;
    }
    h ^= h >> 31, h *= 0xbf58476d1ce4e5b9ull, h ^= h >> 27; /* splitmix-style finish */
    return h;
}

loom_kvblocks *loom_kvblocks_create(int32_t n_blocks, int32_t block_size)
{
    if (n_blocks <= 0 || block_size <= 0)
        return NULL;
    loom_kvblocks *kv = calloc(1, sizeof *kv);
    if (!kv)
        return NULL;
    kv->n = n_blocks, kv->bs = block_size;
    kv->n_buckets = 16;
    while (kv->n_buckets < 2u * (uint32_t)n_blocks)
        kv->n_buckets *= 2;
    kv->b = calloc((size_t)n_blocks, sizeof *kv->b);
    kv->tokens = malloc((size_t)n_blocks * (size_t)block_size * sizeof *kv->tokens);
    kv->free_stack = malloc((size_t)n_blocks * sizeof *kv->free_stack);
    kv->bucket = malloc(kv->n_buckets * sizeof *kv->bucket);
    if (!kv->b || !kv->tokens || !kv->free_stack || !kv->bucket) {
        loom_kvblocks_free(kv);
        return NULL;
    }
    for (uint32_t i = 0; i < kv->n_buckets; i++)
        kv->bucket[i] = -1;
    /* lowest block numbers handed out first */
    for (int32_t i = 0; i < n_blocks; i++)
        kv->free_stack[i] = n_blocks - 1 - i;
    kv->n_free = n_blocks;
    kv->lru_head = kv->lru_tail = -1;
    return kv;
}

void loom_kvblocks_free(loom_kvblocks *kv)
{
    if (!kv)
        return;
    free(kv->b), free(kv->tokens), free(kv->free_stack), free(kv->bucket);
    free(kv);
}

/* ---- lists and table ---------------------------------------------------------------------- */

static void lru_unlink(loom_kvblocks *kv, int32_t i)
{
    kv_block *x = &kv->b[i];
    if (x->prev >= 0)
        kv->b[x->prev].next = x->next;
    else
        kv->lru_head = x->next;
    if (x->next >= 0)
        kv->b[x->next].prev = x->prev;
    else
        kv->lru_tail = x->prev;
    kv->n_cached--;
}

static void lru_push_tail(loom_kvblocks *kv, int32_t i)
{
    kv_block *x = &kv->b[i];
    x->next = -1;
    x->prev = kv->lru_tail;
    if (kv->lru_tail >= 0)
        kv->b[kv->lru_tail].next = i;
    else
        kv->lru_head = i;
    kv->lru_tail = i;
    kv->n_cached++;
}

static void table_insert(loom_kvblocks *kv, int32_t i)
{
    uint32_t k = (uint32_t)kv->b[i].hash & (kv->n_buckets - 1);
    kv->b[i].hnext = kv->bucket[k];
    kv->bucket[k] = i;
}

static void table_remove(loom_kvblocks *kv, int32_t i)
{
    int32_t *p = &kv->bucket[(uint32_t)kv->b[i].hash & (kv->n_buckets - 1)];
    while (*p != i)
        p = &kv->b[*p].hnext;
    *p = kv->b[i].hnext;
}

/* The cached block holding exactly these ids after parent (-1: at the start of a sequence of
 * that partition), or -1. */
static int32_t table_find(const loom_kvblocks *kv, uint64_t hash, int32_t parent,
                          uint64_t partition, const int32_t *ids)
{
    uint32_t parent_gen = parent >= 0 ? kv->b[parent].gen : 0;
    for (int32_t i = kv->bucket[(uint32_t)hash & (kv->n_buckets - 1)]; i >= 0; i = kv->b[i].hnext) {
        const kv_block *x = &kv->b[i];
        if (x->hash == hash && x->parent == parent && x->parent_gen == parent_gen &&
            (parent >= 0 || x->partition == partition) &&
            memcmp(kv->tokens + (size_t)i * (size_t)kv->bs, ids, (size_t)kv->bs * sizeof *ids) == 0)
            return i;
    }
    return -1;
}

static void take_ref(loom_kvblocks *kv, int32_t i)
{
    assert(i >= 0 && i < kv->n && kv->b[i].ref >= 0);
    assert(kv->b[i].ref > 0 || kv->b[i].hashed); /* unowned and shareable: a cached block */
    if (kv->b[i].ref++ == 0)
        lru_unlink(kv, i); /* only hashed blocks are shared by lookup, so it was cached */
}

static void drop_ref(loom_kvblocks *kv, int32_t i)
{
    assert(i >= 0 && i < kv->n && kv->b[i].ref > 0); /* a reference is dropped once */
    if (--kv->b[i].ref > 0)
        return;
    if (kv->b[i].hashed)
        lru_push_tail(kv, i);
    else
        kv->free_stack[kv->n_free++] = i;
}

/* A block with no owner and no content: a free one, or the least recently used cached one. */
static int32_t grab(loom_kvblocks *kv)
{
    int32_t i;
    if (kv->n_free > 0) {
        i = kv->free_stack[--kv->n_free];
    } else {
        i = kv->lru_head;
        lru_unlink(kv, i);
        table_remove(kv, i);
        kv->evictions++;
    }
    kv_block *x = &kv->b[i];
    assert(x->ref == 0); /* free or cached: nobody holds it */
    x->hashed = 0;
    x->gen++;
    x->ref = 1;
    return i;
}

static int push_block(loom_kvseq *seq, int32_t i)
{
    if (seq->n_blocks == seq->cap) {
        int32_t cap = seq->cap ? 2 * seq->cap : 8;
        int32_t *nb = realloc(seq->blocks, (size_t)cap * sizeof *nb);
        if (!nb)
            return -1;
        seq->blocks = nb, seq->cap = cap;
    }
    seq->blocks[seq->n_blocks++] = i;
    return 0;
}

/* ---- sequences ---------------------------------------------------------------------------- */

int32_t loom_kvblocks_match(loom_kvblocks *kv, loom_kvseq *seq, const int32_t *tokens, int32_t n)
{
    kv->prompt_tokens += n > 0 ? (uint64_t)n : 0;
    if (seq->n_blocks != 0 || seq->n_tokens != 0 || seq->private_blocks)
        return 0;
    uint64_t h = CHAIN_SEED ^ seq->partition;
    int32_t parent = -1;
    for (int32_t b = 0; (int64_t)(b + 1) * kv->bs <= (int64_t)n - 1; b++) {
        const int32_t *ids = tokens + (size_t)b * (size_t)kv->bs;
        uint64_t hb = chain_hash(h, ids, kv->bs);
        int32_t i = table_find(kv, hb, parent, seq->partition, ids);
        if (i < 0 || push_block(seq, i) != 0)
            break;
        take_ref(kv, i);
        h = hb, parent = i;
    }
    seq->n_hashed = seq->n_blocks;
    seq->n_tokens = seq->n_blocks * kv->bs;
    kv->hit_tokens += (uint64_t)seq->n_tokens;
    return seq->n_tokens;
}

void loom_kvblocks_unmatch(loom_kvblocks *kv, loom_kvseq *seq, int32_t n)
{
    /* only what match gave: whole, hashed, shared blocks and nothing of the sequence's own */
    assert(n >= 0 && n % kv->bs == 0 && n <= seq->n_tokens);
    assert(seq->n_tokens == seq->n_hashed * kv->bs);
    int32_t keep = n / kv->bs;
    for (int32_t b = seq->n_blocks - 1; b >= keep; b--)
        drop_ref(kv, seq->blocks[b]);
    kv->hit_tokens -= (uint64_t)(seq->n_tokens - n);
    seq->n_blocks = seq->n_hashed = keep;
    seq->n_tokens = n;
}

uint32_t loom_kvblocks_generation(const loom_kvblocks *kv, int32_t i)
{
    assert(i >= 0 && i < kv->n);
    return kv->b[i].gen;
}

static int last_block_shared(const loom_kvblocks *kv, const loom_kvseq *seq)
{
    return seq->n_tokens % kv->bs != 0 && kv->b[seq->blocks[seq->n_tokens / kv->bs]].ref > 1;
}

int32_t loom_kvblocks_needed(const loom_kvblocks *kv, const loom_kvseq *seq, int32_t n_new)
{
    int64_t want = ((int64_t)seq->n_tokens + n_new + kv->bs - 1) / kv->bs;
    int64_t more = want > seq->n_blocks ? want - seq->n_blocks : 0;
    if (n_new > 0 && last_block_shared(kv, seq))
        more++;
    return (int32_t)more;
}

int32_t loom_kvblocks_available(const loom_kvblocks *kv)
{
    return kv->n_free + kv->n_cached;
}

int loom_kvblocks_reserve(loom_kvblocks *kv, loom_kvseq *seq, int32_t n_new, loom_kvcopy *copies)
{
    int32_t need = loom_kvblocks_needed(kv, seq, n_new);
    if (need > loom_kvblocks_available(kv))
        return -1;
    int64_t want = ((int64_t)seq->n_tokens + n_new + kv->bs - 1) / kv->bs;
    if (seq->cap < want) {
        int32_t *nb = realloc(seq->blocks, (size_t)want * sizeof *nb);
        if (!nb)
            return -1;
        seq->blocks = nb, seq->cap = (int32_t)want;
    }
    int n_copies = 0;
    if (n_new > 0 && last_block_shared(kv, seq)) {
        int32_t at = seq->n_tokens / kv->bs, old = seq->blocks[at];
        int32_t fresh = grab(kv);
        drop_ref(kv, old);
        seq->blocks[at] = fresh;
        copies[n_copies++] = (loom_kvcopy){old, fresh};
        kv->copies++;
    }
    while (seq->n_blocks < want)
        seq->blocks[seq->n_blocks++] = grab(kv);
    /* the blocks cover what the sequence is about to hold, and none it must not write is
     * shared */
    assert((int64_t)seq->n_blocks * kv->bs >= (int64_t)seq->n_tokens + n_new);
    assert(n_new == 0 || !last_block_shared(kv, seq));
    return n_copies;
}

void loom_kvblocks_truncate(loom_kvseq *seq, int32_t n)
{
    if (seq->private_blocks && n >= 0 && n < seq->n_tokens)
        seq->n_tokens = n;
}

void loom_kvblocks_advance(loom_kvblocks *kv, loom_kvseq *seq, const int32_t *tokens,
                           int32_t n_total)
{
    assert(n_total >= 0 && (int64_t)n_total <= (int64_t)seq->n_blocks * kv->bs);
    seq->n_tokens = n_total;
    while (!seq->private_blocks && (int64_t)(seq->n_hashed + 1) * kv->bs <= n_total &&
           seq->n_hashed < seq->n_blocks) {
        int32_t b = seq->n_hashed, i = seq->blocks[b];
        int32_t parent = b > 0 ? seq->blocks[b - 1] : -1;
        uint64_t h0 = parent >= 0 ? kv->b[parent].hash : CHAIN_SEED ^ seq->partition;
        const int32_t *ids = tokens + (size_t)b * (size_t)kv->bs;
        uint64_t h = chain_hash(h0, ids, kv->bs);
        if (!kv->b[i].hashed) {
            int32_t same = table_find(kv, h, parent, seq->partition, ids);
            if (same >= 0) {
                /* this prefix is already cached elsewhere: use that block, free ours */
                take_ref(kv, same);
                seq->blocks[b] = same;
                drop_ref(kv, i);
            } else {
                kv_block *x = &kv->b[i];
                x->hashed = 1, x->hash = h, x->parent = parent, x->partition = seq->partition;
                x->parent_gen = parent >= 0 ? kv->b[parent].gen : 0;
                memcpy(kv->tokens + (size_t)i * (size_t)kv->bs, ids, (size_t)kv->bs * sizeof *ids);
                table_insert(kv, i);
            }
        }
        seq->n_hashed++;
    }
}

/* ---- keeping the prefix cache across restarts ------------------------------------------------ */

/* Whether block i's chain is whole: every link's parent is hashed and still the block it was
 * (its generation), back to a first block. */
static int chain_whole(const loom_kvblocks *kv, int32_t i, int32_t *depth)
{
    int32_t d = 0;
    for (; kv->b[i].parent >= 0; d++) {
        const kv_block *x = &kv->b[i];
        if (!kv->b[x->parent].hashed || kv->b[x->parent].gen != x->parent_gen || d > kv->n)
            return 0;
        i = x->parent;
    }
    *depth = d;
    return 1;
}

int32_t loom_kvblocks_prefixes(const loom_kvblocks *kv, int32_t *order, int32_t *parent_index,
                               uint64_t *partition)
{
    int32_t n = 0;
    int32_t *depth = malloc((size_t)kv->n * sizeof *depth),
            *at = malloc((size_t)kv->n * sizeof *at);
    if (!depth || !at) {
        free(depth), free(at);
        return -1;
    }
    int32_t max_depth = 0;
    for (int32_t i = 0; i < kv->n; i++) {
        depth[i] = -1;
        if (kv->b[i].hashed && chain_whole(kv, i, &depth[i]) && depth[i] > max_depth)
            max_depth = depth[i];
    }
    for (int32_t d = 0; d <= max_depth; d++) /* each after its parent */
        for (int32_t i = 0; i < kv->n; i++)
            if (depth[i] == d) {
                at[i] = n;
                order[n] = i;
                parent_index[n] = kv->b[i].parent >= 0 ? at[kv->b[i].parent] : -1;
                partition[n] = kv->b[i].partition;
                n++;
            }
    free(depth), free(at);
    return n;
}

const int32_t *loom_kvblocks_tokens(const loom_kvblocks *kv, int32_t block)
{
    assert(block >= 0 && block < kv->n && kv->b[block].hashed);
    return kv->tokens + (size_t)block * (size_t)kv->bs;
}

int32_t loom_kvblocks_restore(loom_kvblocks *kv, int32_t parent, uint64_t partition,
                              const int32_t *ids)
{
    if (kv->n_free == 0) /* restoring never evicts what it restored before */
        return -1;
    assert(parent < 0 || (parent < kv->n && kv->b[parent].hashed));
    uint64_t h = chain_hash(parent >= 0 ? kv->b[parent].hash : CHAIN_SEED ^ partition, ids, kv->bs);
    if (table_find(kv, h, parent, partition, ids) >= 0)
        return -1; /* held already */
    int32_t i = grab(kv);
    kv_block *x = &kv->b[i];
    x->hashed = 1, x->hash = h, x->parent = parent, x->partition = partition;
    x->parent_gen = parent >= 0 ? kv->b[parent].gen : 0;
    memcpy(kv->tokens + (size_t)i * (size_t)kv->bs, ids, (size_t)kv->bs * sizeof *ids);
    table_insert(kv, i);
    drop_ref(kv, i); /* unowned: cached, for the first prompt that starts so */
    return i;
}

int loom_kvblocks_fork(loom_kvblocks *kv, const loom_kvseq *src, loom_kvseq *dst)
{
    if (dst->n_blocks)
        return -1;
    /* only blocks holding tokens: one reserved for a step not yet run would be written twice */
    int32_t n = (src->n_tokens + kv->bs - 1) / kv->bs;
    int32_t *nb = malloc((size_t)(n ? n : 1) * sizeof *nb);
    if (!nb)
        return -1;
    free(dst->blocks);
    dst->blocks = nb, dst->cap = n ? n : 1;
    for (int32_t b = 0; b < n; b++) {
        nb[b] = src->blocks[b];
        kv->b[nb[b]].ref++;
    }
    dst->n_blocks = n;
    dst->n_tokens = src->n_tokens;
    dst->n_hashed = src->n_hashed;
    dst->private_blocks = src->private_blocks;
    dst->partition = src->partition; /* its next full block is hashed in the same partition */
    return 0;
}

void loom_kvblocks_release(loom_kvblocks *kv, loom_kvseq *seq)
{
    /* last block first, so a prefix's leaves are evicted before its root */
    for (int32_t b = seq->n_blocks - 1; b >= 0; b--)
        drop_ref(kv, seq->blocks[b]);
    free(seq->blocks);
    /* what the caller set stays: a sequence released to be run again (preemption) must hash
     * and match in its own partition, not the common one */
    *seq = (loom_kvseq){.private_blocks = seq->private_blocks, .partition = seq->partition};
}

int32_t loom_kvblocks_slot(const loom_kvblocks *kv, const loom_kvseq *seq, int32_t pos)
{
    assert(pos >= 0 && pos / kv->bs < seq->n_blocks && seq->blocks[pos / kv->bs] < kv->n);
    return seq->blocks[pos / kv->bs] * kv->bs + pos % kv->bs;
}

loom_kvstats loom_kvblocks_stats(const loom_kvblocks *kv)
{
    loom_kvstats s = {kv->n,          kv->bs,        kv->n - kv->n_free - kv->n_cached,
                      kv->n_cached,   kv->n_free,    kv->prompt_tokens,
                      kv->hit_tokens, kv->evictions, kv->copies};
    return s;
}

const char *loom_kvblocks_verify(const loom_kvblocks *kv, const loom_kvseq *const *seqs, int n_seqs)
{
    const char *problem = NULL;
    int32_t *refs = calloc((size_t)kv->n, sizeof *refs);
    char *where = calloc((size_t)kv->n, 1); /* 1 free, 2 cached */
    if (!refs || !where) {
        free(refs), free(where);
        return "out of memory";
    }
    for (int s = 0; s < n_seqs && !problem; s++) {
        const loom_kvseq *q = seqs[s];
        if ((int64_t)q->n_blocks * kv->bs < q->n_tokens)
            problem = "a sequence has fewer blocks than its tokens need";
        else if ((int64_t)q->n_hashed * kv->bs > q->n_tokens)
            problem = "a sequence has more hashed blocks than full ones";
        for (int32_t b = 0; b < q->n_blocks && !problem; b++) {
            if (q->blocks[b] < 0 || q->blocks[b] >= kv->n)
                problem = "a sequence holds a block number outside the pool";
            else if (b < q->n_hashed && !kv->b[q->blocks[b]].hashed)
                problem = "a sequence's full block is missing from the prefix cache";
            else
                refs[q->blocks[b]]++;
        }
    }
    for (int32_t i = 0; i < kv->n_free && !problem; i++) {
        int32_t x = kv->free_stack[i];
        if (where[x])
            problem = "a block is on the free list twice";
        where[x] = 1;
    }
    int32_t n_lru = 0;
    for (int32_t i = kv->lru_head, prev = -1; i >= 0 && !problem; prev = i, i = kv->b[i].next) {
        if (where[i] || kv->b[i].prev != prev)
            problem = "the cached-block list is corrupt";
        where[i] = 2;
        if (++n_lru > kv->n)
            problem = "the cached-block list loops";
    }
    if (!problem && n_lru != kv->n_cached)
        problem = "the cached-block count is wrong";
    for (int32_t i = 0; i < kv->n && !problem; i++) {
        const kv_block *x = &kv->b[i];
        if (x->ref != refs[i])
            problem = "a block's reference count disagrees with the sequences holding it";
        else if (x->ref > 0 && where[i])
            problem = "a referenced block is also free or cached";
        else if (x->ref == 0 && !where[i])
            problem = "an unreferenced block is neither free nor cached (leaked)";
        else if (where[i] == 1 && x->hashed)
            problem = "a free block is still hashed";
        else if (where[i] == 2 && !x->hashed)
            problem = "a cached block has no hash";
        if (!problem && x->hashed) {
            int32_t j = kv->bucket[(uint32_t)x->hash & (kv->n_buckets - 1)];
            while (j >= 0 && j != i)
                j = kv->b[j].hnext;
            if (j != i)
                problem = "a hashed block is missing from the hash table";
        }
    }
    free(refs), free(where);
    return problem;
}
