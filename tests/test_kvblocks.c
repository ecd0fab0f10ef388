/*
 * tests/test_kvblocks.c - the KV block manager: allocation, prefix sharing, copy on write,
 * eviction, and a randomised run of thousands of operations against a shadow cache.
 *
 * The shadow cache is the independent expectation: every "computed" position writes
 * (token, position) into the slot the manager gave it, copies are executed on the shadow, and
 * after every operation each live sequence must read back exactly its own tokens through its
 * block list. A block shared when it should not be, a missed copy on write, or a prefix hit on
 * the wrong content shows up as a wrong value.
 */
#include "check.h"
#include "core/kvblocks.h"

#include <stdint.h>
#include <string.h>

#define BS 4

static int64_t *shadow;
static int32_t n_slots;

static int64_t content(int32_t token, int32_t pos)
{
    return (int64_t)pos * 1000003 + token;
}

static void run_copies(const loom_kvcopy *c, int n)
{
    for (int i = 0; i < n; i++)
        memcpy(shadow + (size_t)c[i].dst * BS, shadow + (size_t)c[i].src * BS, BS * sizeof *shadow);
}

/* Reserves, "computes" positions seq->n_tokens .. n_total - 1 and advances. */
static int compute(loom_kvblocks *kv, loom_kvseq *q, const int32_t *tokens, int32_t n_total)
{
    loom_kvcopy copies[1];
    int nc = loom_kvblocks_reserve(kv, q, n_total - q->n_tokens, copies);
    if (nc < 0)
        return -1;
    run_copies(copies, nc);
    for (int32_t p = q->n_tokens; p < n_total; p++)
        shadow[loom_kvblocks_slot(kv, q, p)] = content(tokens[p], p);
    loom_kvblocks_advance(kv, q, tokens, n_total);
    return 0;
}

static int reads_back(const loom_kvblocks *kv, const loom_kvseq *q, const int32_t *tokens)
{
    for (int32_t p = 0; p < q->n_tokens; p++)
        if (shadow[loom_kvblocks_slot(kv, q, p)] != content(tokens[p], p))
            return 0;
    return 1;
}

static void test_basics(void)
{
    loom_kvblocks *kv = loom_kvblocks_create(8, BS);
    n_slots = 8 * BS;
    shadow = calloc((size_t)n_slots, sizeof *shadow);
    int32_t t[32];
    for (int i = 0; i < 32; i++)
        t[i] = 100 + i;

    /* growth: 10 tokens take 3 blocks; nothing is preallocated */
    loom_kvseq a = {0};
    CHECK(loom_kvblocks_match(kv, &a, t, 10) == 0, "an empty cache matches nothing");
    CHECK(compute(kv, &a, t, 10) == 0, "10 tokens fit");
    loom_kvstats s = loom_kvblocks_stats(kv);
    CHECK(a.n_blocks == 3 && s.used == 3 && s.free == 5, "blocks %d used %d free %d", a.n_blocks,
          s.used, s.free);
    CHECK(a.n_hashed == 2, "two full blocks are hashed, got %d", a.n_hashed);

    /* a second sequence with the same first 9 tokens shares the two full blocks */
    loom_kvseq b = {0};
    CHECK(loom_kvblocks_match(kv, &b, t, 9) == 8, "prefix hit of 8 tokens");
    CHECK(b.blocks[0] == a.blocks[0] && b.blocks[1] == a.blocks[1], "same blocks");
    CHECK(compute(kv, &b, t, 9) == 0, "the rest fits");
    CHECK(reads_back(kv, &b, t) && reads_back(kv, &a, t), "both read their tokens");
    /* a prompt of exactly two blocks keeps its last token to compute */
    loom_kvseq c = {0};
    CHECK(loom_kvblocks_match(kv, &c, t, 8) == 4, "leave one token: got %d", c.n_tokens);
    loom_kvblocks_release(kv, &c);
    const loom_kvseq *live[] = {&a, &b};
    const char *why = loom_kvblocks_verify(kv, live, 2);
    CHECK(!why, "%s", why);

    /* copy on write: fork a (partial last block), append to the fork */
    loom_kvseq f = {0};
    CHECK(loom_kvblocks_fork(kv, &a, &f) == 0, "fork");
    int32_t tf[32];
    memcpy(tf, t, sizeof tf);
    tf[10] = 7;
    loom_kvcopy cp[1];
    int nc = loom_kvblocks_reserve(kv, &f, 1, cp);
    CHECK(nc == 1 && cp[0].src == a.blocks[2] && cp[0].dst != a.blocks[2],
          "one copy of the shared block");
    run_copies(cp, nc);
    shadow[loom_kvblocks_slot(kv, &f, 10)] = content(tf[10], 10);
    loom_kvblocks_advance(kv, &f, tf, 11);
    CHECK(compute(kv, &a, t, 11) == 0, "the original appends in place");
    CHECK(reads_back(kv, &a, t) && reads_back(kv, &f, tf), "fork and original diverge cleanly");
    CHECK(loom_kvblocks_stats(kv).copies == 1, "exactly one copy");

    /* release: full blocks stay cached, partial ones are freed */
    loom_kvblocks_release(kv, &f);
    loom_kvblocks_release(kv, &b);
    loom_kvblocks_release(kv, &a);
    s = loom_kvblocks_stats(kv);
    CHECK(s.used == 0 && s.cached == 2 && s.free == 6, "used %d cached %d free %d", s.used,
          s.cached, s.free);
    why = loom_kvblocks_verify(kv, NULL, 0);
    CHECK(!why, "%s", why);

    /* eviction: filling the pool reuses the cached blocks, and their prefix no longer hits */
    int32_t u[32];
    for (int i = 0; i < 32; i++)
        u[i] = 900 + i;
    loom_kvseq big = {0};
    loom_kvblocks_match(kv, &big, u, 32);
    CHECK(compute(kv, &big, u, 32) == 0, "the whole pool can be used");
    CHECK(loom_kvblocks_stats(kv).evictions == 2, "both cached blocks evicted");
    loom_kvseq none = {0};
    CHECK(loom_kvblocks_reserve(kv, &none, 1, cp) == -1, "a full pool refuses");
    CHECK(none.n_blocks == 0, "and changes nothing");
    loom_kvblocks_release(kv, &big);
    CHECK(loom_kvblocks_match(kv, &none, t, 9) == 0, "evicted prefix does not hit");
    loom_kvblocks_release(kv, &none);
    /* and the new content does */
    CHECK(loom_kvblocks_match(kv, &none, u, 20) == 16, "new prefix hits, got %d", none.n_tokens);
    CHECK(reads_back(kv, &none, u), "with the right content");
    loom_kvblocks_release(kv, &none);
    /* private sequences (a bidirectional prefix) neither hit nor feed the prefix cache */
    loom_kvseq p1 = {.private_blocks = 1}, p2 = {.private_blocks = 1}, p3 = {0};
    CHECK(loom_kvblocks_match(kv, &p1, u, 20) == 0, "a private sequence takes no cached prefix");
    CHECK(compute(kv, &p1, t, 20) == 0, "and computes its own");
    CHECK(p1.n_hashed == 0, "without hashing its blocks");
    CHECK(loom_kvblocks_match(kv, &p3, t, 20) == 0, "so nobody hits them");
    loom_kvblocks_release(kv, &p1);
    CHECK(p1.private_blocks == 1, "release keeps the flag");
    CHECK(loom_kvblocks_match(kv, &p2, t, 20) == 0, "nor does a later private one");
    loom_kvblocks_release(kv, &p2);
    loom_kvblocks_release(kv, &p3);
    CHECK(!loom_kvblocks_verify(kv, NULL, 0), "consistent at the end");
    loom_kvblocks_free(kv);
    free(shadow);
}

/* Eviction goes leaf first: when memory runs short, a released prefix loses its last block
 * before its first, so the shorter prefix keeps hitting. */
static void test_leaf_first(void)
{
    loom_kvblocks *kv = loom_kvblocks_create(3, BS);
    shadow = calloc(3 * BS, sizeof *shadow);
    int32_t t[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9}, v[9] = {50, 51, 52, 53, 54, 55, 56, 57, 58};
    loom_kvseq a = {0};
    compute(kv, &a, t, 9);
    loom_kvblocks_release(kv, &a); /* blocks 0 (root) and 1 cached, root most recent */
    /* evict the child first: a two-block sequence takes the free block and then the LRU head */
    loom_kvseq b = {0};
    compute(kv, &b, v, 5);
    loom_kvseq c = {0};
    CHECK(loom_kvblocks_match(kv, &c, t, 9) == 4, "the root still hits: %d", c.n_tokens);
    CHECK(reads_back(kv, &c, t), "root content intact");
    loom_kvblocks_release(kv, &c);
    loom_kvblocks_release(kv, &b);
    CHECK(!loom_kvblocks_verify(kv, NULL, 0), "consistent");
    loom_kvblocks_free(kv);
    free(shadow);
}

/* Partitions: the same prompt in another partition takes nothing from the cache (and adds
 * its own blocks); in its own partition it hits. */
static void test_partitions(void)
{
    loom_kvblocks *kv = loom_kvblocks_create(16, BS);
    shadow = calloc(16 * BS, sizeof *shadow);
    int32_t t[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    loom_kvseq alice = {.partition = 11};
    compute(kv, &alice, t, 9);
    loom_kvblocks_release(kv, &alice);
    loom_kvseq bob = {.partition = 22}, common = {0}, alice2 = {.partition = 11};
    CHECK(loom_kvblocks_match(kv, &bob, t, 9) == 0, "another partition does not hit: %d",
          bob.n_tokens);
    CHECK(loom_kvblocks_match(kv, &common, t, 9) == 0, "nor does the common one: %d",
          common.n_tokens);
    CHECK(loom_kvblocks_match(kv, &alice2, t, 9) == 8, "the same partition hits: %d",
          alice2.n_tokens);
    CHECK(reads_back(kv, &alice2, t), "and reads its own content");
    compute(kv, &bob, t, 9); /* bob's blocks are his own, cached beside alice's */
    CHECK(reads_back(kv, &bob, t) && bob.blocks[0] != alice2.blocks[0], "bob has his own blocks");
    int32_t bobs_first = bob.blocks[0];
    loom_kvblocks_release(kv, &bob);
    loom_kvseq bob2 = {.partition = 22};
    CHECK(loom_kvblocks_match(kv, &bob2, t, 9) == 8, "bob hits his own: %d", bob2.n_tokens);
    loom_kvblocks_release(kv, &bob2);
    /* a sequence released and run again (the engine's preemption) keeps its partition: bob's
     * second run hits bob's blocks, and a fork of his is his too */
    CHECK(bob2.partition == 22, "release keeps the partition (%llu)",
          (unsigned long long)bob2.partition);
    CHECK(loom_kvblocks_match(kv, &bob2, t, 9) == 8 && bob2.blocks[0] == bobs_first,
          "a preempted sequence hits its own partition again");
    loom_kvseq fork = {0};
    CHECK(loom_kvblocks_fork(kv, &bob2, &fork) == 0 && fork.partition == 22,
          "a fork keeps the partition (%llu)", (unsigned long long)fork.partition);
    loom_kvblocks_release(kv, &fork);
    loom_kvblocks_release(kv, &bob2);
    loom_kvblocks_release(kv, &alice2);
    loom_kvblocks_release(kv, &common);
    CHECK(!loom_kvblocks_verify(kv, NULL, 0), "consistent");
    loom_kvblocks_free(kv);
    free(shadow);
}

/* The prefix cache written out and read into another pool (a restart, engine/prefixes.c):
 * every prefix each after its parent, and the new pool hits the same prompts, partitions kept,
 * its content (copied block for block as the engine copies K/V) reading back. */
static void test_keep_across_restart(void)
{
    loom_kvblocks *kv = loom_kvblocks_create(16, BS);
    shadow = calloc(16 * BS, sizeof *shadow);
    int32_t a[13] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}, b[9] = {1, 2, 3, 4, 9, 9, 9, 9, 0};
    loom_kvseq sa = {0}, sb = {0}, sp = {.partition = 7};
    compute(kv, &sa, a, 13); /* 3 full blocks */
    compute(kv, &sb, b, 9);  /* its first block shared with a's, a second of its own */
    compute(kv, &sp, a, 9);  /* another partition's 2 blocks */
    loom_kvblocks_release(kv, &sa), loom_kvblocks_release(kv, &sb), loom_kvblocks_release(kv, &sp);
    int32_t order[16], parent[16];
    uint64_t part[16];
    int32_t n = loom_kvblocks_prefixes(kv, order, parent, part);
    int parents_first = n == 6;
    for (int32_t k = 0; k < n; k++)
        parents_first &= parent[k] < k && (parent[k] >= 0 || k < 3);
    CHECK(parents_first, "6 prefix blocks, each after its parent (%d)", n);
    loom_kvblocks *back = loom_kvblocks_create(16, BS);
    int64_t *old = shadow;
    shadow = calloc(16 * BS, sizeof *shadow);
    int32_t now[16];
    for (int32_t k = 0; k < n; k++) {
        now[k] = loom_kvblocks_restore(back, parent[k] >= 0 ? now[parent[k]] : -1, part[k],
                                       loom_kvblocks_tokens(kv, order[k]));
        CHECK(now[k] >= 0, "block %d restored", k);
        memcpy(shadow + (size_t)now[k] * BS, old + (size_t)order[k] * BS, BS * sizeof *shadow);
    }
    CHECK(loom_kvblocks_restore(back, -1, 0, loom_kvblocks_tokens(kv, order[0])) < 0,
          "a prefix held already is not restored twice");
    loom_kvseq ra = {0}, rb = {0}, rp = {.partition = 7}, rq = {.partition = 8};
    CHECK(loom_kvblocks_match(back, &ra, a, 13) == 12 && reads_back(back, &ra, a),
          "a's 12 tokens hit in the new pool and read back");
    CHECK(loom_kvblocks_match(back, &rb, b, 9) == 8 && reads_back(back, &rb, b),
          "b's 8 (its own second block after the shared first)");
    CHECK(loom_kvblocks_match(back, &rp, a, 9) == 8 && loom_kvblocks_match(back, &rq, a, 9) == 0,
          "the other partition's blocks hit for it alone");
    const loom_kvseq *live[] = {&ra, &rb, &rp, &rq};
    CHECK(!loom_kvblocks_verify(back, live, 4), "the restored pool is consistent: %s",
          loom_kvblocks_verify(back, live, 4));
    loom_kvblocks_release(back, &ra), loom_kvblocks_release(back, &rb);
    loom_kvblocks_release(back, &rp), loom_kvblocks_release(back, &rq);
    loom_kvblocks_free(back), loom_kvblocks_free(kv);
    free(shadow), free(old);
}

static uint64_t rng_state = 12345;
static uint32_t rnd(uint32_t n)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng_state >> 33) % n;
}

#define MAX_LIVE 24
#define MAX_LEN 96

static void test_random(void)
{
    const int32_t n_blocks = 64;
    loom_kvblocks *kv = loom_kvblocks_create(n_blocks, BS);
    n_slots = n_blocks * BS;
    shadow = calloc((size_t)n_slots, sizeof *shadow);
    static loom_kvseq seqs[MAX_LIVE];
    static int32_t toks[MAX_LIVE][MAX_LEN];
    int live[MAX_LIVE] = {0};
    int32_t prefixes[3][MAX_LEN];
    for (int p = 0; p < 3; p++)
        for (int i = 0; i < MAX_LEN; i++)
            prefixes[p][i] = (int32_t)rnd(5) + 10 * p;
    int ops = 0, creates = 0, forks = 0, appends = 0, frees = 0, refusals = 0;
    for (int step = 0; step < 20000 && !check_failures; step++) {
        int s = (int)rnd(MAX_LIVE), op = (int)rnd(10);
        loom_kvseq *q = &seqs[s];
        if (!live[s] && op < 6) { /* create, often from a shared prefix */
            int32_t n = 1 + (int32_t)rnd(40);
            int p = (int)rnd(4);
            int32_t shared = p < 3 ? (int32_t)rnd((uint32_t)n + 1) : 0;
            for (int32_t i = 0; i < n; i++)
                toks[s][i] = i < shared ? prefixes[p][i] : (int32_t)rnd(1000) + 100;
            int32_t m = loom_kvblocks_match(kv, q, toks[s], n);
            CHECK(m < n && m % BS == 0, "match %d of %d", m, n);
            CHECK(reads_back(kv, q, toks[s]), "a prefix hit returned other content");
            if (compute(kv, q, toks[s], n) != 0) {
                loom_kvblocks_release(kv, q);
                refusals++;
            } else {
                live[s] = 1, creates++;
            }
        } else if (live[s] && op < 6) { /* append */
            int32_t k = 1 + (int32_t)rnd(6);
            if (q->n_tokens + k > MAX_LEN)
                continue;
            for (int32_t i = 0; i < k; i++)
                toks[s][q->n_tokens + i] = (int32_t)rnd(8);
            if (compute(kv, q, toks[s], q->n_tokens + k) != 0)
                refusals++;
            else
                appends++;
        } else if (live[s] && op < 8) { /* fork into a free slot */
            int d = (int)rnd(MAX_LIVE);
            if (live[d])
                continue;
            CHECK(loom_kvblocks_fork(kv, q, &seqs[d]) == 0, "fork");
            memcpy(toks[d], toks[s], sizeof toks[s]);
            live[d] = 1, forks++;
        } else if (live[s]) {
            loom_kvblocks_release(kv, q);
            live[s] = 0, frees++;
        }
        ops++;
        const loom_kvseq *ptrs[MAX_LIVE];
        int n_live = 0;
        for (int i = 0; i < MAX_LIVE; i++)
            if (live[i]) {
                ptrs[n_live++] = &seqs[i];
                CHECK(reads_back(kv, &seqs[i], toks[i]), "step %d: sequence %d reads wrong K/V",
                      step, i);
            }
        const char *why = loom_kvblocks_verify(kv, ptrs, n_live);
        CHECK(!why, "step %d: %s", step, why);
    }
    for (int i = 0; i < MAX_LIVE; i++)
        if (live[i])
            loom_kvblocks_release(kv, &seqs[i]);
    loom_kvstats st = loom_kvblocks_stats(kv);
    CHECK(st.used == 0 && st.free + st.cached == n_blocks, "all blocks back: used %d", st.used);
    CHECK(!loom_kvblocks_verify(kv, NULL, 0), "consistent at the end");
    CHECK(st.hit_tokens > 0 && st.copies > 0 && st.evictions > 0 && refusals > 0,
          "the run exercised hits %llu, copies %llu, evictions %llu, refusals %d",
          (unsigned long long)st.hit_tokens, (unsigned long long)st.copies,
          (unsigned long long)st.evictions, refusals);
    printf("random: %d ops (%d creates, %d appends, %d forks, %d frees, %d refused), %llu of %llu "
           "prompt tokens hit, %llu copies, %llu evictions\n",
           ops, creates, appends, forks, frees, refusals, (unsigned long long)st.hit_tokens,
           (unsigned long long)st.prompt_tokens, (unsigned long long)st.copies,
           (unsigned long long)st.evictions);
    loom_kvblocks_free(kv);
    free(shadow);
}

/* unmatch keeps a shorter prefix of a match and gives the rest back (hybrid models resume only
 * where a state snapshot is); a block's generation changes when it is reused, which is how a
 * snapshot keyed by it learns that its prefix is gone */
static void test_unmatch(void)
{
    loom_kvblocks *kv = loom_kvblocks_create(6, BS);
    n_slots = 6 * BS;
    shadow = calloc((size_t)n_slots, sizeof *shadow);
    int32_t t[32], u[32];
    for (int i = 0; i < 32; i++)
        t[i] = 100 + i, u[i] = 500 + i;
    loom_kvseq a = {0}, b = {0};
    loom_kvblocks_match(kv, &a, t, 13);
    CHECK(compute(kv, &a, t, 13) == 0, "13 tokens fit");
    loom_kvblocks_release(kv, &a); /* its three full blocks stay cached */
    CHECK(loom_kvblocks_match(kv, &b, t, 13) == 12, "the cached prefix hits whole");
    uint32_t gen2 = loom_kvblocks_generation(kv, b.blocks[2]);
    int32_t third = b.blocks[2];
    loom_kvblocks_unmatch(kv, &b, 4);
    loom_kvstats s = loom_kvblocks_stats(kv);
    CHECK(b.n_tokens == 4 && b.n_blocks == 1 && b.n_hashed == 1 && s.used == 1 && s.cached == 2,
          "unmatch to 4: %d tokens in %d blocks, %d used, %d cached", b.n_tokens, b.n_blocks,
          s.used, s.cached);
    CHECK(s.hit_tokens == 4, "the hit counts what was kept: %llu",
          (unsigned long long)s.hit_tokens);
    CHECK(compute(kv, &b, t, 13) == 0 && reads_back(kv, &b, t), "the rest computes again");
    const loom_kvseq *live[] = {&b};
    const char *why = loom_kvblocks_verify(kv, live, 1);
    CHECK(!why, "%s", why);
    loom_kvblocks_release(kv, &b);
    /* other content evicts the cached blocks: the third's generation moves on */
    loom_kvseq c = {0};
    loom_kvblocks_match(kv, &c, u, 24);
    CHECK(compute(kv, &c, u, 24) == 0, "24 other tokens take every block");
    CHECK(loom_kvblocks_generation(kv, third) != gen2, "a reused block has a new generation");
    loom_kvblocks_release(kv, &c);
    loom_kvblocks_free(kv);
    free(shadow);
}

int main(void)
{
    test_basics();
    test_unmatch();
    test_leaf_first();
    test_partitions();
    test_keep_across_restart();
    test_random();
    return check_finish("test_kvblocks");
}
