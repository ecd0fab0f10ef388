/*
 * core/kvblocks.h - the KV cache's block manager: which cache block holds which tokens of which
 * sequence. Pure host-side bookkeeping; the runner owns the memory the block numbers index.
 *
 * The cache is a pool of fixed-size blocks. A sequence maps its positions to blocks through its
 * own block list, grown as it grows and released when it ends; nothing is reserved for a
 * maximum length.
 *
 * Prefix sharing: once a block is full, its content is identified by a hash chained over the
 * token ids of the whole prefix up to its end. A later sequence whose prompt starts with the same
 * tokens takes a reference to those blocks instead of recomputing them. A hash hit is confirmed
 * exactly: the candidate's own tokens must be equal and its parent must be the very block the
 * lookup matched one step earlier (blocks carry a generation number, bumped on reuse, so a stale
 * parent link can never match). By induction the whole prefix is then equal.
 *
 * Block states: used (referenced by at least one sequence), cached (unreferenced, full and
 * hashed: kept for later hits, evicted least recently used first when memory is needed), free.
 * Forked sequences share even a partly filled last block; the first one to append to a shared
 * block gets a private copy (copy on write, executed by the caller from the copy list).
 */
#ifndef LOOM_CORE_KVBLOCKS_H
#define LOOM_CORE_KVBLOCKS_H

#include <stdint.h>

typedef struct loom_kvblocks loom_kvblocks;

/* One sequence's view. Zero-initialise; the manager owns blocks[] (release frees it). */
typedef struct loom_kvseq {
    int32_t *blocks;
    int32_t n_blocks, cap;
    int32_t n_tokens;   /* positions whose K/V are stored (or about to be, after advance) */
    int32_t n_hashed;   /* leading full blocks that are registered in the prefix cache */
    int private_blocks; /* set by the caller: never share through the prefix cache (K/V that
                         * depend on later tokens, as in a bidirectional prefix) */
    uint64_t partition; /* set by the caller: blocks are shared only between sequences of the
                         * same partition (0: the common one), so that one client cannot learn
                         * from hits what another's prompts began with */
} loom_kvseq;

/* A block copy the caller must perform (all layers, K and V) before the next step writes. */
typedef struct loom_kvcopy {
    int32_t src, dst;
} loom_kvcopy;

typedef struct loom_kvstats {
    int32_t n_blocks, block_size;
    int32_t used, cached, free;
    uint64_t prompt_tokens; /* tokens offered to loom_kvblocks_match */
    uint64_t hit_tokens;    /* of those, found in the cache */
    uint64_t evictions, copies;
} loom_kvstats;

loom_kvblocks *loom_kvblocks_create(int32_t n_blocks, int32_t block_size);
void loom_kvblocks_free(loom_kvblocks *kv);

/* For an empty sequence about to run tokens[0..n): takes the longest cached prefix of whole
 * blocks, always leaving at least one token to compute (its logits are needed). Returns the
 * number of tokens matched (their K/V need not be computed). */
int32_t loom_kvblocks_match(loom_kvblocks *kv, loom_kvseq *seq, const int32_t *tokens, int32_t n);

/* After loom_kvblocks_match: keeps the first n of the tokens it matched (a whole number of
 * blocks), handing the rest back; for a caller that can resume only at some block boundaries
 * (a recurrent state it has at those alone). */
void loom_kvblocks_unmatch(loom_kvblocks *kv, loom_kvseq *seq, int32_t n);
/* Block i's generation, bumped whenever it is handed out anew: what a caller remembering a
 * block's content (a state snapshot at its end) compares to know it still holds that. */
uint32_t loom_kvblocks_generation(const loom_kvblocks *kv, int32_t i);

/* Blocks the sequence would need to grow by n_new tokens (including a copy on write). */
int32_t loom_kvblocks_needed(const loom_kvblocks *kv, const loom_kvseq *seq, int32_t n_new);
/* Blocks that can be handed out now: free plus cached (evictable). */
int32_t loom_kvblocks_available(const loom_kvblocks *kv);

/* Makes room for n_new more tokens: copies a shared partly filled last block (appending a
 * loom_kvcopy to copies, which must hold one), allocates blocks, evicting cached ones when no
 * free block is left. Returns the number of copies written (0 or 1), or -1 with nothing
 * changed when the pool cannot supply the blocks. */
int loom_kvblocks_reserve(loom_kvblocks *kv, loom_kvseq *seq, int32_t n_new, loom_kvcopy *copies);

/* Records that positions up to n_total are now stored; tokens holds the sequence's ids from
 * position 0. Newly full blocks enter the prefix cache (or, when the same prefix is already
 * cached in another block, the sequence switches to that block and frees its own). */
void loom_kvblocks_advance(loom_kvblocks *kv, loom_kvseq *seq, const int32_t *tokens,
                           int32_t n_total);

/* Forgets positions n and on of a sequence whose blocks are never shared (private_blocks): a
 * speculative drafter's proposals that were not kept. Its blocks stay, to be written again. */
void loom_kvblocks_truncate(loom_kvseq *seq, int32_t n);

/* dst (empty) shares all of src's blocks, including a partly filled last one. */
int loom_kvblocks_fork(loom_kvblocks *kv, const loom_kvseq *src, loom_kvseq *dst);

/* Drops the sequence's references; it becomes empty. */
void loom_kvblocks_release(loom_kvblocks *kv, loom_kvseq *seq);

/* The physical cache slot (block * block_size + offset) of position pos of seq. */
int32_t loom_kvblocks_slot(const loom_kvblocks *kv, const loom_kvseq *seq, int32_t pos);

loom_kvstats loom_kvblocks_stats(const loom_kvblocks *kv);

/* Keeping the prefix cache across restarts (the engine, with no sequence running): the cached
 * prefixes' blocks, each after its parent (n <= n_blocks of them: order[k] a block, its parent's
 * place k' < k in order or -1, its partition), or -1 when out of memory; a hashed block's
 * block_size token ids; and a block registered back as cached, its K/V the caller's to write:
 * the block, or -1 when no free block is left or that prefix is held already. */
int32_t loom_kvblocks_prefixes(const loom_kvblocks *kv, int32_t *order, int32_t *parent_index,
                               uint64_t *partition);
const int32_t *loom_kvblocks_tokens(const loom_kvblocks *kv, int32_t block);
int32_t loom_kvblocks_restore(loom_kvblocks *kv, int32_t parent, uint64_t partition,
                              const int32_t *ids);

/* Checks every invariant against the live sequences (reference counts, lists, hash table).
 * Returns NULL when consistent, else a description of the first problem. For tests. */
const char *loom_kvblocks_verify(const loom_kvblocks *kv, const loom_kvseq *const *seqs,
                                 int n_seqs);

#endif
