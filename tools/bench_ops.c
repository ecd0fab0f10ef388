/*
 * tools/bench_ops.c - `loom bench ops`: per op, dtype and decode/prefill shape, how fast each
 * backend (and CPU variant) runs, side by side. Like loom-conformance it works at the level of
 * the backend ABI, so it uses core/loader.h directly.
 *
 * Each backend runs in its own process (`loom bench ops --child PATH`), so one variant's
 * threads, caches and allocations cannot colour another's figures; the child prints one JSON
 * object per measurement and the parent tabulates them. Decode-shaped matmuls are memory
 * bound, and their figures must come from DRAM: the child cycles through enough distinct weight
 * matrices to cover 4x the last-level cache, and the parent measures the machine's streaming
 * read bandwidth the same way, so each figure can be given as a share of it.
 */
#define _GNU_SOURCE
#include "args.h"
#include "bench_ops.h"

#include "api/loader_env.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---- Timing and sizes ------------------------------------------------------------------- */

static double now_s(void)
{
    return loom_now_ms() * 1e-3;
}

/* Bytes a decode-shaped working set must span so that it streams from DRAM. */
uint64_t loom_bench_working_set(void)
{
    long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (llc <= 0)
        llc = sysconf(_SC_LEVEL2_CACHE_SIZE);
    uint64_t want = 4 * (uint64_t)(llc > 0 ? llc : 32 << 20);
    return want < (256ull << 20) ? 256ull << 20 : want;
}

int loom_bench_threads(void)
{
    const char *env = getenv("LOOM_THREADS");
    long n = env && *env ? strtol(env, NULL, 10) : sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

/* ---- Streaming read bandwidth (parent) ---------------------------------------------------- */

typedef struct bw_arg {
    const uint64_t *data;
    size_t n;
    uint64_t sink;
} bw_arg;

static void *bw_read(void *p)
{
    bw_arg *a = p;
    uint64_t acc[8] = {0};
    for (size_t i = 0; i + 8 <= a->n; i += 8)
        for (int k = 0; k < 8; k++)
            acc[k] ^= a->data[i + k];
    for (int k = 0; k < 8; k++)
        a->sink ^= acc[k];
    return NULL;
}

#if defined(__x86_64__)
#include <immintrin.h>
/* The scalar loop above cannot issue loads fast enough to find the memory's limit on a wide
 * core; four independent 256-bit streams can. Used when the CPU has AVX2. */
__attribute__((target("avx2"))) static void *bw_read_avx2(void *p)
{
    bw_arg *a = p;
    const __m256i *d = (const __m256i *)a->data;
    __m256i x0 = _mm256_setzero_si256(), x1 = x0, x2 = x0, x3 = x0;
    for (size_t i = 0; i + 16 <= a->n; i += 16, d += 4) {
        x0 = _mm256_xor_si256(x0, _mm256_loadu_si256(d));
        x1 = _mm256_xor_si256(x1, _mm256_loadu_si256(d + 1));
        x2 = _mm256_xor_si256(x2, _mm256_loadu_si256(d + 2));
        x3 = _mm256_xor_si256(x3, _mm256_loadu_si256(d + 3));
    }
    x0 = _mm256_xor_si256(_mm256_xor_si256(x0, x1), _mm256_xor_si256(x2, x3));
    a->sink = (uint64_t)_mm256_extract_epi64(x0, 0) ^ (uint64_t)_mm256_extract_epi64(x0, 3);
    return NULL;
}
#endif

/* GB/s of reading words[0..n) with n_threads threads, each its own contiguous part; the best
 * of `passes` passes. */
static double read_bandwidth(const uint64_t *buf, size_t words, int n_threads, int passes)
{
    double best = 0.0;
    pthread_t th[256];
    bw_arg args[256];
    if (n_threads > 256)
        n_threads = 256;
    for (int pass = 0; pass < passes; pass++) {
        double t0 = now_s();
        for (int i = 0; i < n_threads; i++) {
            args[i].data = buf + words / (size_t)n_threads * (size_t)i;
            args[i].n = words / (size_t)n_threads;
            args[i].sink = 0;
            void *(*reader)(void *) = bw_read;
#if defined(__x86_64__)
            if (__builtin_cpu_supports("avx2"))
                reader = bw_read_avx2;
#endif
            pthread_create(&th[i], NULL, reader, &args[i]);
        }
        for (int i = 0; i < n_threads; i++)
            pthread_join(th[i], NULL);
        double gbps = (double)(words * 8) / (now_s() - t0) / 1e9;
        best = gbps > best ? gbps : best;
    }
    return best;
}

static uint64_t *bandwidth_buffer(uint64_t bytes)
{
    size_t words = (size_t)(bytes / 8);
    uint64_t *buf = malloc(words * 8);
    for (size_t i = 0; buf && i < words; i++)
        buf[i] = i * 0x9e3779b97f4a7c15ull;
    return buf;
}

double loom_bench_read_bandwidth(uint64_t bytes, int n_threads)
{
    uint64_t *buf = bandwidth_buffer(bytes);
    double bw = buf ? read_bandwidth(buf, (size_t)(bytes / 8), n_threads, 3) : 0.0;
    free(buf);
    return bw;
}

/* ---- Measurements (child) --------------------------------------------------------------- */

static uint64_t rng = 0x2545f4914f6cdd1dull;

static float rnd(void)
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)(rng >> 40) / 8388608.0f - 1.0f;
}

/* Host bytes of n_rows valid rows of K elements of dtype dt (random values in [-1, 1)). */
static void *make_rows(loom_dtype dt, int64_t K, int64_t n_rows)
{
    int64_t rb = loom_row_bytes(dt, K);
    unsigned char *out = malloc((size_t)(rb * n_rows));
    float *row = malloc((size_t)K * sizeof(float));
    if (!out || !row) {
        free(out), free(row);
        return NULL;
    }
    for (int64_t r = 0; r < n_rows; r++) {
        for (int64_t k = 0; k < K; k++)
            row[k] = rnd();
        loom_row_from_f32(dt, row, out + r * rb, K);
    }
    free(row);
    return out;
}

static loom_tensor dense(loom_buffer *b, loom_dtype dt, int64_t n0, int64_t n1, int64_t n2)
{
    loom_tensor t = {.buf = b, .dtype = dt, .n_dims = 3};
    t.ne[0] = n0, t.ne[1] = n1, t.ne[2] = n2, t.ne[3] = 1;
    t.nb[0] = (uint64_t)loom_dtype_block_bytes(dt);
    t.nb[1] = (uint64_t)loom_row_bytes(dt, n0);
    t.nb[2] = t.nb[1] * (uint64_t)n1;
    t.nb[3] = t.nb[2] * (uint64_t)n2;
    return t;
}

/* A device buffer holding host bytes. */
static loom_buffer *upload(loom_device *d, const void *host, uint64_t bytes)
{
    loom_buffer *b = NULL;
    if (d->ops.buffer_alloc(d->be, bytes, &b) != LOOM_OK)
        return NULL;
    if (host && d->ops.copy_from_host(d->be, b, 0, host, bytes) != LOOM_OK) {
        d->ops.buffer_free(d->be, b);
        return NULL;
    }
    return b;
}

/* The machine's read bandwidth drifts (a VM on a shared host: 37 to 65 GB/s within minutes
 * here), so each decode figure comes with the bandwidth read over a working set of the same
 * size just before and just after it (the larger of the two), and its share is of that. */
static struct {
    uint64_t *buf;
    size_t words;
    int threads;
} adjacent;

static double adjacent_bandwidth(void)
{
    if (!adjacent.buf)
        return 0.0;
    /* a backend's threads may still be spinning for their next job: let them go to sleep */
    struct timespec pause = {0, 50 * 1000 * 1000};
    nanosleep(&pause, NULL);
    return read_bandwidth(adjacent.buf, adjacent.words, adjacent.threads, 3);
}

/* bw: the adjacent read bandwidth of a decode figure, 0 for none */
static void emit(const char *op, const char *dtype, const char *shape, const char *kind,
                 double seconds, double bytes, double flops, double sd, double bw)
{
    printf("{\"op\":\"%s\",\"dtype\":\"%s\",\"shape\":\"%s\",\"kind\":\"%s\",\"ms\":%.4f,"
           "\"sd_ms\":%.4f,\"gbps\":%.3f,\"gflops\":%.3f,\"read_bandwidth_gbps\":%.3f}\n",
           op, dtype, shape, kind, seconds * 1e3, sd * 1e3, bytes / seconds / 1e9,
           flops / seconds / 1e9, bw);
    fflush(stdout);
}

static void emit_error(const char *op, const char *dtype, const char *shape, const char *msg)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "op", op);
    cJSON_AddStringToObject(o, "dtype", dtype);
    cJSON_AddStringToObject(o, "shape", shape);
    cJSON_AddStringToObject(o, "error", msg);
    char *s = cJSON_PrintUnformatted(o);
    printf("%s\n", s);
    fflush(stdout);
    free(s);
    cJSON_Delete(o);
}

/* W offered to the backend's prepare_weight, as the runner does on a weight's first matmul:
 * 1 with *out set when the backend made a layout of its own, 0 when it keeps W, -1 on error. */
static int prepare(loom_device *d, const loom_tensor *w, loom_tensor *out)
{
    if (!d->ops.prepare_weight)
        return 0;
    loom_status st = d->ops.prepare_weight(d->be, w, out);
    return st == LOOM_OK ? 1 : st == LOOM_ERR_UNSUPPORTED ? 0 : -1;
}

/* Decode: Y[1,N] = X[1,K] W^T over as many distinct W as fill the DRAM working set. The
 * working set is one buffer (`arena`, allocated once per run so its pages are faulted in once),
 * refilled for each dtype with copies of one random matrix; or, with arena NULL, that many
 * copies of W prepared by the backend (nothing is measured for a backend that keeps W as is). */
static void bench_matmul_decode(loom_device *d, loom_buffer *arena, uint64_t arena_bytes,
                                loom_dtype dt, int64_t K, int64_t N)
{
    char shape[64];
    snprintf(shape, sizeof shape, "M=1 K=%lld N=%lld%s", (long long)K, (long long)N,
             arena ? "" : " prepared");
    if (!loom_device_supports(d, LOOM_OP_MATMUL, dt)) {
        if (arena)
            emit_error("matmul", loom_dtype_name(dt), shape, "unsupported");
        return;
    }
    uint64_t wbytes = (uint64_t)loom_row_bytes(dt, K) * (uint64_t)N;
    int count = (int)(arena_bytes / wbytes), made = 0;
    void *host = make_rows(dt, K, N);
    float *xh = make_rows(LOOM_F32, K, 1);
    loom_buffer *xb = upload(d, xh, (uint64_t)K * 4), *yb = upload(d, NULL, (uint64_t)N * 4);
    loom_buffer *wb = arena ? NULL : upload(d, host, wbytes);
    loom_tensor *ws = calloc((size_t)count + 1, sizeof *ws);
    int ok = host && xh && xb && yb && ws && count > 0 && (arena || wb);
    const char *why = "out of memory for the working set";
    for (int i = 0; i < count && ok; i++) {
        if (arena) {
            ok = d->ops.copy_from_host(d->be, arena, (uint64_t)i * wbytes, host, wbytes) == LOOM_OK;
            ws[i] = dense(arena, dt, K, N, 1);
            ws[i].offset = (uint64_t)i * wbytes;
            made++;
        } else {
            loom_tensor w = dense(wb, dt, K, N, 1);
            int got = prepare(d, &w, &ws[i]);
            if (got == 0 && i == 0) /* this backend keeps this W as it is */
                goto out;
            ok = got == 1;
            made += ok;
            if (!ok)
                why = d->ops.last_error(d->be);
        }
    }
    if (!ok) {
        emit_error("matmul", loom_dtype_name(dt), shape, why);
    } else {
        loom_tensor x = dense(xb, LOOM_F32, K, 1, 1), y = dense(yb, LOOM_F32, N, 1, 1);
        double times[5], bw = adjacent_bandwidth();
        int passes = 5;
        for (int pass = -1; pass < passes; pass++) { /* pass -1 warms up */
            double t0 = now_s();
            for (int i = 0; i < count; i++) {
                loom_matmul_params p = {sizeof p, &x, &ws[i], NULL, &y};
                d->ops.matmul(d->be, &p);
            }
            d->ops.synchronize(d->be);
            if (pass >= 0)
                times[pass] = (now_s() - t0) / count;
        }
        double mean = 0, sd = 0;
        for (int i = 0; i < passes; i++)
            mean += times[i] / passes;
        for (int i = 0; i < passes; i++)
            sd += (times[i] - mean) * (times[i] - mean) / (passes - 1);
        double bw_after = adjacent_bandwidth();
        emit("matmul", loom_dtype_name(dt), shape, "decode", mean, (double)wbytes,
             2.0 * (double)K * (double)N, sqrt(sd), bw_after > bw ? bw_after : bw);
    }
out:
    for (int i = 0; !arena && i < made; i++)
        d->ops.buffer_free(d->be, ws[i].buf);
    if (wb)
        d->ops.buffer_free(d->be, wb);
    if (xb)
        d->ops.buffer_free(d->be, xb);
    if (yb)
        d->ops.buffer_free(d->be, yb);
    free(ws), free(host), free(xh);
}

/* k distinct experts of E at random, as a router picks a token's */
static void draw_experts(int32_t *ids, int k, int64_t E)
{
    for (int j = 0; j < k; j++) {
        int32_t e, dup;
        do {
            e = (int32_t)((uint32_t)(rnd() * 1e6f + 1e6f) % (uint32_t)E);
            dup = 0;
            for (int q = 0; q < j; q++)
                dup |= ids[q] == e;
        } while (dup);
        ids[j] = e;
    }
}

/* A mixture-of-experts decode step's expert matmul: Y[k, N] = X[1, K] W_e^T for k experts e
 * drawn at random from a stack [E, N, K] that fills the DRAM working set (E as many as fit),
 * as a token of Qwen1.5-MoE routes to 4 of its 60 experts (N 1408, K 2048). GB/s counts the k
 * experts' bytes, so it compares with matmul decode's. */
static void bench_matmul_id_decode(loom_device *d, loom_buffer *arena, uint64_t arena_bytes,
                                   loom_dtype dt, int64_t K, int64_t N, int k)
{
    char shape[64];
    uint64_t expert_bytes = (uint64_t)loom_row_bytes(dt, K) * (uint64_t)N;
    int64_t E = (int64_t)(arena_bytes / expert_bytes);
    E = E > 1024 ? 1024 : E;
    snprintf(shape, sizeof shape, "M=1 K=%lld N=%lld k=%d of %lld", (long long)K, (long long)N, k,
             (long long)E);
    if (!loom_device_supports(d, LOOM_OP_MATMUL_ID, dt) || !d->ops.matmul_id) {
        emit_error("matmul_id", loom_dtype_name(dt), shape, "unsupported");
        return;
    }
    void *host = make_rows(dt, K, N);
    float *xh = make_rows(LOOM_F32, K, 1);
    int32_t ids[64 * 16];
    loom_buffer *xb = upload(d, xh, (uint64_t)K * 4),
                *yb = upload(d, NULL, (uint64_t)N * (uint64_t)k * 4),
                *ib = upload(d, NULL, sizeof ids);
    int ok = host && xh && xb && yb && ib && E >= k && k <= 16;
    for (int64_t e = 0; e < E && ok; e++)
        ok = d->ops.copy_from_host(d->be, arena, (uint64_t)e * expert_bytes, host, expert_bytes) ==
            LOOM_OK;
    for (int i = 0; i < 64 && ok; i++) /* 64 tokens' distinct draws, taken in turn */
        draw_experts(ids + i * k, k, E);
    ok = ok && d->ops.copy_from_host(d->be, ib, 0, ids, (uint64_t)(64 * k) * 4) == LOOM_OK;
    if (!ok) {
        emit_error("matmul_id", loom_dtype_name(dt), shape, "out of memory for the working set");
    } else {
        loom_tensor w = dense(arena, dt, K, N, E), x = dense(xb, LOOM_F32, K, 1, 1),
                    y = dense(yb, LOOM_F32, N, k, 1), id = dense(ib, LOOM_I32, k, 1, 1);
        double times[5], bw = adjacent_bandwidth();
        const int passes = 5, calls = 64;
        for (int pass = -1; pass < passes; pass++) { /* pass -1 warms up */
            double t0 = now_s();
            for (int i = 0; i < calls; i++) {
                id.offset = (uint64_t)(i * k) * 4;
                loom_matmul_id_params p = {sizeof p, &x, &w, &id, &y};
                d->ops.matmul_id(d->be, &p);
            }
            d->ops.synchronize(d->be);
            if (pass >= 0)
                times[pass] = (now_s() - t0) / calls;
        }
        double mean = 0, sd = 0;
        for (int i = 0; i < passes; i++)
            mean += times[i] / passes;
        for (int i = 0; i < passes; i++)
            sd += (times[i] - mean) * (times[i] - mean) / (passes - 1);
        double bw_after = adjacent_bandwidth();
        emit("matmul_id", loom_dtype_name(dt), shape, "decode", mean, (double)(expert_bytes * k),
             2.0 * (double)K * (double)N * k, sqrt(sd), bw_after > bw ? bw_after : bw);
    }
    if (xb)
        d->ops.buffer_free(d->be, xb);
    if (yb)
        d->ops.buffer_free(d->be, yb);
    if (ib)
        d->ops.buffer_free(d->be, ib);
    free(host), free(xh);
}

/* Runs fn until at least min_s have passed (and at least 3 times); mean and sd per call. */
typedef void (*bench_fn)(loom_device *d, void *ctx);

static void repeat(loom_device *d, bench_fn fn, void *ctx, double min_s, double *mean, double *sd)
{
    fn(d, ctx); /* warm up */
    d->ops.synchronize(d->be);
    double t[64], total = 0;
    int n = 0;
    while (n < 64 && (n < 3 || total < min_s)) {
        double t0 = now_s();
        fn(d, ctx);
        d->ops.synchronize(d->be);
        t[n] = now_s() - t0;
        total += t[n++];
    }
    *mean = total / n;
    double v = 0;
    for (int i = 0; i < n; i++)
        v += (t[i] - *mean) * (t[i] - *mean) / (n > 1 ? n - 1 : 1);
    *sd = sqrt(v);
}

typedef struct mm_ctx {
    loom_matmul_params p;
} mm_ctx;

static void run_matmul(loom_device *d, void *ctx)
{
    d->ops.matmul(d->be, &((mm_ctx *)ctx)->p);
}

/* Prefill: Y[M,N] = X[M,K] W^T, compute-bound; one W is enough. With prepared, W goes through
 * prepare_weight first (nothing is measured when the backend keeps it as is). */
static void bench_matmul_prefill(loom_device *d, loom_dtype dt, int64_t M, int64_t K, int64_t N,
                                 int prepared)
{
    char shape[64];
    snprintf(shape, sizeof shape, "M=%lld K=%lld N=%lld%s", (long long)M, (long long)K,
             (long long)N, prepared ? " prepared" : "");
    if (!loom_device_supports(d, LOOM_OP_MATMUL, dt)) {
        if (!prepared)
            emit_error("matmul", loom_dtype_name(dt), shape, "unsupported");
        return;
    }
    uint64_t wbytes = (uint64_t)loom_row_bytes(dt, K) * (uint64_t)N;
    void *wh = make_rows(dt, K, N), *xh = make_rows(LOOM_F32, K, M);
    loom_buffer *wb = upload(d, wh, wbytes), *xb = upload(d, xh, (uint64_t)(M * K * 4));
    loom_buffer *yb = upload(d, NULL, (uint64_t)(M * N * 4));
    if (wb && xb && yb) {
        loom_tensor x = dense(xb, LOOM_F32, K, M, 1), w = dense(wb, dt, K, N, 1);
        loom_tensor y = dense(yb, LOOM_F32, N, M, 1), pw;
        int got = prepared ? prepare(d, &w, &pw) : 0;
        mm_ctx c = {{sizeof c.p, &x, got == 1 ? &pw : &w, NULL, &y}};
        double mean, sd;
        if (got < 0) {
            emit_error("matmul", loom_dtype_name(dt), shape, d->ops.last_error(d->be));
        } else if (got == 1 || !prepared) {
            repeat(d, run_matmul, &c, 0.5, &mean, &sd);
            emit("matmul", loom_dtype_name(dt), shape, "prefill", mean, (double)wbytes,
                 2.0 * (double)M * (double)K * (double)N, sd, 0.0);
        }
        if (got == 1)
            d->ops.buffer_free(d->be, pw.buf);
    } else {
        emit_error("matmul", loom_dtype_name(dt), shape, "out of memory");
    }
    if (wb)
        d->ops.buffer_free(d->be, wb);
    if (xb)
        d->ops.buffer_free(d->be, xb);
    if (yb)
        d->ops.buffer_free(d->be, yb);
    free(wh), free(xh);
}

typedef struct id_ctx {
    loom_matmul_id_params p;
} id_ctx;

static void run_matmul_id(loom_device *d, void *ctx)
{
    d->ops.matmul_id(d->be, &((id_ctx *)ctx)->p);
}

/* A mixture-of-experts prefill chunk's expert matmul: T tokens each routed to k distinct of E
 * experts at random (about T k / E rows an expert), Y[T, k, N] = X[T, K] W_e^T over a stack
 * [E, N, K] offered whole to prepare_weight as the runner does (ABI 1.6). GFLOP/s counts the
 * T k rows, so it compares with bench_matmul_prefill of M = T, N = k N (a dense MLP as wide as
 * the experts a token runs: the same FLOPs on one k-times-wider weight). */
static void bench_matmul_id_prefill(loom_device *d, loom_dtype dt, int64_t T, int64_t K, int64_t N,
                                    int64_t E, int k)
{
    char shape[80];
    snprintf(shape, sizeof shape, "T=%lld K=%lld N=%lld k=%d of %lld", (long long)T, (long long)K,
             (long long)N, k, (long long)E);
    if (!loom_device_supports(d, LOOM_OP_MATMUL_ID, dt) || !d->ops.matmul_id) {
        emit_error("matmul_id", loom_dtype_name(dt), shape, "unsupported");
        return;
    }
    uint64_t expert_bytes = (uint64_t)loom_row_bytes(dt, K) * (uint64_t)N;
    void *wh = make_rows(dt, K, N), *xh = make_rows(LOOM_F32, K, T);
    int32_t *ids = malloc((size_t)(T * k) * sizeof *ids);
    loom_buffer *wb = upload(d, NULL, expert_bytes * (uint64_t)E),
                *xb = upload(d, xh, (uint64_t)(T * K) * 4),
                *yb = upload(d, NULL, (uint64_t)(T * k * N) * 4), *ib = NULL;
    int ok = wh && xh && ids && wb && xb && yb && k <= E;
    for (int64_t e = 0; e < E && ok;
         e++) /* one random expert copied: the bytes matter, not the values */
        ok = d->ops.copy_from_host(d->be, wb, (uint64_t)e * expert_bytes, wh, expert_bytes) ==
            LOOM_OK;
    for (int64_t t = 0; t < T && ok; t++)
        draw_experts(ids + t * k, k, E);
    ok = ok && (ib = upload(d, ids, (uint64_t)(T * k) * 4)) != NULL;
    if (ok) {
        loom_tensor w = dense(wb, dt, K, N, E), x = dense(xb, LOOM_F32, K, 1, T),
                    y = dense(yb, LOOM_F32, N, k, T), id = dense(ib, LOOM_I32, k, T, 1), pw;
        int got = d->module.abi_minor >= 6 ? prepare(d, &w, &pw) : 0;
        id_ctx c = {{sizeof c.p, &x, got == 1 ? &pw : &w, &id, &y}};
        double mean, sd;
        if (got < 0) {
            emit_error("matmul_id", loom_dtype_name(dt), shape, d->ops.last_error(d->be));
        } else {
            repeat(d, run_matmul_id, &c, 0.5, &mean, &sd);
            emit("matmul_id", loom_dtype_name(dt), shape, "prefill", mean,
                 (double)(expert_bytes * (uint64_t)E),
                 2.0 * (double)(T * k) * (double)K * (double)N, sd, 0.0);
        }
        if (got == 1)
            d->ops.buffer_free(d->be, pw.buf);
    } else {
        emit_error("matmul_id", loom_dtype_name(dt), shape, "out of memory");
    }
    loom_buffer *all[] = {wb, xb, yb, ib};
    for (int i = 0; i < 4; i++)
        if (all[i])
            d->ops.buffer_free(d->be, all[i]);
    free(wh), free(xh), free(ids);
}

typedef struct attn_ctx {
    loom_attention_params p;
} attn_ctx;

static void run_attention(loom_device *d, void *ctx)
{
    d->ops.attention(d->be, &((attn_ctx *)ctx)->p);
}

/* Attention of `tokens` new tokens at the end of one sequence of `context` keys, with `heads`
 * query heads over `kvh` kv heads of `hd` (Llama-3-8B: 32/8, 128), block size 16. Bytes: the K
 * and V rows read. */
static void bench_attention(loom_device *d, loom_dtype cache_dt, int64_t tokens, int64_t context,
                            int64_t heads, int64_t kvh, int64_t hd)
{
    char shape[96];
    const int64_t bs = 16, blocks = (context + bs - 1) / bs;
    snprintf(shape, sizeof shape, "tokens=%lld ctx=%lld h=%lld/%lld hd=%lld", (long long)tokens,
             (long long)context, (long long)heads, (long long)kvh, (long long)hd);
    const char *kind = tokens == 1 ? "decode" : "prefill";
    if (!loom_device_supports(d, LOOM_OP_ATTENTION, cache_dt)) {
        emit_error("attention", loom_dtype_name(cache_dt), shape, "unsupported");
        return;
    }
    uint64_t cache_bytes = (uint64_t)loom_row_bytes(cache_dt, hd) * (uint64_t)(kvh * bs * blocks);
    void *ch = make_rows(cache_dt, hd, kvh * bs * blocks),
         *qh = make_rows(LOOM_F32, hd, heads * tokens);
    int32_t *ints = malloc((size_t)(blocks + 2 * tokens) * 4);
    for (int64_t i = 0; i < blocks; i++)
        ints[i] = (int32_t)i;
    for (int64_t t = 0; t < tokens; t++)
        ints[blocks + t] = 0, ints[blocks + tokens + t] = (int32_t)(context - tokens + t);
    loom_buffer *kb = upload(d, ch, cache_bytes), *vb = upload(d, ch, cache_bytes);
    loom_buffer *qb = upload(d, qh, (uint64_t)(heads * tokens * hd * 4));
    loom_buffer *ob = upload(d, NULL, (uint64_t)(heads * tokens * hd * 4));
    loom_buffer *ib = upload(d, ints, (uint64_t)(blocks + 2 * tokens) * 4);
    if (kb && vb && qb && ob && ib) {
        loom_tensor k = dense(kb, cache_dt, hd, kvh, bs), v = dense(vb, cache_dt, hd, kvh, bs);
        k.ne[3] = v.ne[3] = blocks;
        /* head-major inside each block, as the runner lays its cache out */
        k.nb[2] = v.nb[2] = k.nb[1];
        k.nb[1] = v.nb[1] = k.nb[2] * (uint64_t)bs;
        loom_tensor q = dense(qb, LOOM_F32, hd, heads, tokens),
                    o = dense(ob, LOOM_F32, hd, heads, tokens);
        loom_tensor bt = dense(ib, LOOM_I32, blocks, 1, 1);
        loom_tensor seq = dense(ib, LOOM_I32, tokens, 1, 1), pos = seq;
        seq.offset = (uint64_t)blocks * 4;
        pos.offset = (uint64_t)(blocks + tokens) * 4;
        attn_ctx c = {{.struct_size = sizeof c.p,
                       .q = &q,
                       .k_cache = &k,
                       .v_cache = &v,
                       .block_table = &bt,
                       .seq = &seq,
                       .pos = &pos,
                       .dst = &o,
                       .scale = 1.0f / sqrtf((float)hd)}};
        double mean, sd, bw = tokens == 1 ? adjacent_bandwidth() : 0.0;
        repeat(d, run_attention, &c, 0.3, &mean, &sd);
        double bw_after = tokens == 1 ? adjacent_bandwidth() : 0.0;
        double keys = (double)tokens * (double)context - (double)tokens * (double)(tokens - 1) / 2;
        emit("attention", loom_dtype_name(cache_dt), shape, kind, mean, 2.0 * (double)cache_bytes,
             4.0 * keys * (double)heads * (double)hd, sd, bw_after > bw ? bw_after : bw);
    } else {
        emit_error("attention", loom_dtype_name(cache_dt), shape, "out of memory");
    }
    loom_buffer *all[] = {kb, vb, qb, ob, ib};
    for (int i = 0; i < 5; i++)
        if (all[i])
            d->ops.buffer_free(d->be, all[i]);
    free(ch), free(qh), free(ints);
}

/* which ops a run measures: both, or the one named by --op */
typedef enum { OPS_ALL, OPS_MATMUL, OPS_ATTENTION, OPS_MATMUL_ID } ops_wanted;

static int child(const char *path, int quick, ops_wanted ops)
{
    loom_device d;
    char err[1024];
    if (loom_device_open(&d, path, 0, 0, err, sizeof err) != 0) {
        emit_error("open", "", "", err);
        return 1;
    }
    static const loom_dtype wtypes[] = {LOOM_WEIGHT_DTYPES(LOOM_DTYPE_ITEM)};
    int64_t dim = quick ? 1024 : 4096;
    /* --quick: a smoke test, whose decode figures come partly from cache */
    uint64_t arena_bytes = quick ? 64ull << 20 : loom_bench_working_set();
    adjacent.buf = bandwidth_buffer(arena_bytes);
    adjacent.words = (size_t)(arena_bytes / 8);
    adjacent.threads = loom_bench_threads();
    loom_buffer *arena = NULL;
    if (ops == OPS_ATTENTION) {
        /* no matmuls */
    } else if (d.ops.buffer_alloc(d.be, arena_bytes, &arena) != LOOM_OK) {
        emit_error("matmul", "", "", "cannot allocate the decode working set");
    } else if (ops == OPS_MATMUL_ID) {
        /* the experts of a MoE decode step, beside the same dtypes' plain matmul */
        static const loom_dtype id_types[] = {LOOM_Q8_0, LOOM_Q4_0, LOOM_Q4_K, LOOM_F16};
        for (size_t i = 0; i < sizeof id_types / sizeof id_types[0]; i++) {
            bench_matmul_id_decode(&d, arena, arena_bytes, id_types[i], quick ? 1024 : 2048,
                                   quick ? 512 : 1408, 4);
            bench_matmul_decode(&d, arena, arena_bytes, id_types[i], quick ? 1024 : 2048,
                                quick ? 512 : 1408);
        }
        d.ops.buffer_free(d.be, arena);
        arena = NULL;
        /* a prefill chunk of Qwen3-30B-A3B's experts (128 tokens, 8 of 128 experts of 768
         * from 2048) beside its dense twin, the one matmul of as many FLOPs */
        for (size_t i = 0; i < sizeof id_types / sizeof id_types[0]; i++) {
            int64_t T = quick ? 32 : 128, K = quick ? 512 : 2048, N = quick ? 256 : 768;
            bench_matmul_id_prefill(&d, id_types[i], T, K, N, quick ? 16 : 128, 8);
            for (int prepared = 0; prepared < 2; prepared++) /* as the runner gets it */
                bench_matmul_prefill(&d, id_types[i], T, K, 8 * N, prepared);
        }
    } else {
        for (size_t i = 0; i < sizeof wtypes / sizeof wtypes[0]; i++)
            bench_matmul_decode(&d, arena, arena_bytes, wtypes[i], dim, dim);
        d.ops.buffer_free(d.be, arena);
        /* the same with weights in the backend's own layout, as models run them */
        for (size_t i = 0; i < sizeof wtypes / sizeof wtypes[0]; i++)
            bench_matmul_decode(&d, NULL, arena_bytes, wtypes[i], dim, dim);
    }
    /* prefill, then a serving step: one decode token from each of 16 sequences */
    const int64_t prefill_m[] = {quick ? 16 : 64, 16};
    for (int pm = 0; pm < 2 && ops != OPS_ATTENTION && ops != OPS_MATMUL_ID; pm++)
        for (int prepared = 0; prepared < 2; prepared++)
            for (size_t i = 0; i < sizeof wtypes / sizeof wtypes[0]; i++)
                bench_matmul_prefill(&d, wtypes[i], prefill_m[pm], dim, dim, prepared);
    int64_t ctx = quick ? 256 : 2048;
    if (ops == OPS_ALL || ops == OPS_ATTENTION) {
        bench_attention(&d, LOOM_F16, 1, ctx, 32, 8, 128);
        bench_attention(&d, LOOM_Q8_0, 1, ctx, 32, 8, 128);
        bench_attention(&d, LOOM_F16, quick ? 16 : 128, ctx, 32, 8, 128);
        /* one kv head (Gemma-2B, Falcon): one decode token is one (token, kv head) pair, so
         * only cutting the keys into parts gives every thread work */
        bench_attention(&d, LOOM_F16, 1, 4 * ctx, 8, 1, 256);
    }
    free(adjacent.buf);
    loom_device_close(&d);
    return 0;
}

/* ---- The parent: run children, tabulate ------------------------------------------------- */

typedef struct result_row {
    char key[192]; /* op dtype shape */
    char kind[16];
    double gbps[16], gflops[16], bw[16]; /* bw: the figure's adjacent read bandwidth */
    char cell_err[16][64];
    int has[16];
} result_row;

/* The bandwidth a decode figure is a share of: the child's adjacent measurement, else the one
 * the parent made before the runs. */
static double share_base(const cJSON *o, double parent_bw)
{
    double adj = cJSON_GetNumberValue(cJSON_GetObjectItem(o, "read_bandwidth_gbps"));
    return adj > 0 ? adj : parent_bw;
}

int loom_bench_ops_main(int argc, char **argv, const char *self)
{
    const char *list = NULL, *child_path = NULL, *op = NULL;
    int json = 0, quick = 0;
    const loom_flag flags[] = {
        {"--backends", NULL, LOOM_FLAG_TEXT, &list, 0, 0, "LIST",
         "comma-separated backend names or name-variant (default: every\n"
         "usable backend but ref)"},
        {"--op", NULL, LOOM_FLAG_CHOICE, &op, 0, 0, "matmul|attention|matmul_id",
         "measure only matmul, only attention, or the experts' matmul_id\n"
         "beside matmul of one expert's shape (default: matmul and attention)"},
        {"--json", NULL, LOOM_FLAG_SWITCH, &json, 0, 0, NULL,
         "print the measurements as JSON instead of a table"},
        {"--quick", NULL, LOOM_FLAG_SWITCH, &quick, 0, 0, NULL, "small shapes, for a smoke test"},
        {"--child", NULL, LOOM_FLAG_TEXT, &child_path, 0, 0, "MODULE", NULL},
    };
    const loom_command cmd = {.name = "loom bench ops",
                              .synopsis = "[--backends LIST] [--op matmul|attention|matmul_id] "
                                          "[--json] [--quick]",
                              .flags = flags,
                              .n_flags = LOOM_N_FLAGS(flags)};
    int parsed = loom_args_parse(&cmd, argc, argv);
    if (parsed)
        return parsed == 1 ? 0 : parsed;
    ops_wanted ops = !op           ? OPS_ALL
        : !strcmp(op, "matmul")    ? OPS_MATMUL
        : !strcmp(op, "matmul_id") ? OPS_MATMUL_ID
                                   : OPS_ATTENTION;
    if (child_path)
        return child(child_path, quick, ops);

    loom_registry reg;
    char err[4096];
    loom_loader_options lo = loom_loader_options_from_env();
    if (loom_registry_scan(&reg, &lo, err, sizeof err) != 0) {
        fprintf(stderr, "loom bench ops: %s\n", err);
        return 1;
    }
    const char *paths[16], *labels[16];
    char label_buf[16][160];
    int n = 0;
    for (int i = 0; i < reg.count && n < 16; i++) {
        loom_candidate *c = &reg.items[i];
        if (c->kind != LOOM_MODULE_BACKEND)
            continue; /* a decorator runs only around a backend */
        snprintf(label_buf[n], sizeof label_buf[n], "%s%s%s", c->name, c->variant[0] ? "-" : "",
                 c->variant);
        int wanted;
        if (list) {
            char *copy = strdup(list), *save = NULL;
            wanted = 0;
            for (char *e = strtok_r(copy, ",", &save); e; e = strtok_r(NULL, ",", &save))
                wanted |= strcmp(e, c->name) == 0 || strcmp(e, label_buf[n]) == 0;
            free(copy);
        } else {
            wanted = strcmp(c->name, "ref") != 0;
        }
        if (!wanted)
            continue;
        if (c->state != LOOM_CAND_USABLE) {
            fprintf(stderr, "loom bench ops: skipping %s: %s\n", label_buf[n], c->reason);
            continue;
        }
        paths[n] = c->path;
        labels[n] = label_buf[n];
        n++;
    }
    if (n == 0) {
        fprintf(stderr, "loom bench ops: no usable backend matches%s%s (see `loom backends`)\n",
                list ? " " : "", list ? list : "");
        loom_registry_free(&reg);
        return 1;
    }

    int threads = loom_bench_threads();
    uint64_t ws = loom_bench_working_set();
    fprintf(stderr, "measuring streaming read bandwidth over %.0f MiB with %d threads...\n",
            (double)ws / (1 << 20), threads);
    double bw = loom_bench_read_bandwidth(ws, threads);

    result_row *rows = calloc(64, sizeof *rows);
    int n_rows = 0;
    cJSON *all = cJSON_CreateArray();
    for (int b = 0; b < n; b++) {
        fprintf(stderr, "running %s...\n", labels[b]);
        char cmd[8192];
        snprintf(cmd, sizeof cmd, "'%s' bench ops --child '%s'%s%s", self, paths[b],
                 quick ? " --quick" : "",
                 ops == OPS_MATMUL          ? " --op matmul"
                     : ops == OPS_ATTENTION ? " --op attention"
                     : ops == OPS_MATMUL_ID ? " --op matmul_id"
                                            : "");
        FILE *f = popen(cmd, "r");
        char line[2048];
        while (f && fgets(line, sizeof line, f)) {
            cJSON *o = cJSON_Parse(line);
            if (!o)
                continue;
            const char *op = cJSON_GetStringValue(cJSON_GetObjectItem(o, "op"));
            const char *dt = cJSON_GetStringValue(cJSON_GetObjectItem(o, "dtype"));
            const char *sh = cJSON_GetStringValue(cJSON_GetObjectItem(o, "shape"));
            const char *kind = cJSON_GetStringValue(cJSON_GetObjectItem(o, "kind"));
            const char *e = cJSON_GetStringValue(cJSON_GetObjectItem(o, "error"));
            cJSON_AddStringToObject(o, "backend", labels[b]);
            char key[192];
            snprintf(key, sizeof key, "%s %s %s", op ? op : "?", dt ? dt : "", sh ? sh : "");
            int r = 0;
            while (r < n_rows && strcmp(rows[r].key, key) != 0)
                r++;
            if (r == n_rows && n_rows < 64)
                snprintf(rows[n_rows++].key, sizeof rows[0].key, "%s", key);
            if (r < 64) {
                if (kind)
                    snprintf(rows[r].kind, sizeof rows[r].kind, "%s", kind);
                rows[r].has[b] = 1;
                if (e)
                    snprintf(rows[r].cell_err[b], sizeof rows[r].cell_err[b], "%s", e);
                rows[r].gbps[b] = cJSON_GetNumberValue(cJSON_GetObjectItem(o, "gbps"));
                rows[r].gflops[b] = cJSON_GetNumberValue(cJSON_GetObjectItem(o, "gflops"));
                rows[r].bw[b] = share_base(o, bw);
            }
            if (kind && strcmp(kind, "decode") == 0 && share_base(o, bw) > 0)
                cJSON_AddNumberToObject(o, "bandwidth_share",
                                        cJSON_GetNumberValue(cJSON_GetObjectItem(o, "gbps")) /
                                            share_base(o, bw));
            cJSON_AddItemToArray(all, o);
        }
        int rc = f ? pclose(f) : -1;
        if (rc != 0)
            fprintf(stderr, "loom bench ops: %s's run exited with status %d\n", labels[b], rc);
    }

    if (json) {
        cJSON *root = cJSON_CreateObject();
        cJSON_AddNumberToObject(root, "read_bandwidth_gbps", bw);
        cJSON_AddNumberToObject(root, "threads", threads);
        cJSON_AddNumberToObject(root, "working_set_bytes", (double)ws);
        cJSON_AddItemToObject(root, "results", all);
        char *s = cJSON_Print(root);
        printf("%s\n", s);
        free(s);
        cJSON_Delete(root);
    } else {
        printf("streaming read bandwidth: %.1f GB/s (%d threads, %.0f MiB)\n", bw, threads,
               (double)ws / (1 << 20));
        printf("decode: GB/s of weights or KV read (share of the read bandwidth measured just "
               "before and after it, in GB/s); prefill: GFLOP/s\n\n");
        printf("| op | dtype | shape | kind |");
        for (int b = 0; b < n; b++)
            printf(" %s |", labels[b]);
        printf("\n|---|---|---|---|");
        for (int b = 0; b < n; b++)
            printf("---|");
        printf("\n");
        for (int r = 0; r < n_rows; r++) {
            char op[64] = "", dt[32] = "", *sh;
            sscanf(rows[r].key, "%63s %31s", op, dt);
            sh = rows[r].key + strlen(op) + 1 + strlen(dt) + 1;
            printf("| %s | %s | %s | %s |", op, dt, sh, rows[r].kind);
            for (int b = 0; b < n; b++) {
                if (!rows[r].has[b])
                    printf(" |");
                else if (rows[r].cell_err[b][0])
                    printf(" %s |", rows[r].cell_err[b]);
                else if (strcmp(rows[r].kind, "decode") == 0)
                    printf(" %.1f GB/s (%.0f%% of %.0f) |", rows[r].gbps[b],
                           100 * rows[r].gbps[b] / rows[r].bw[b], rows[r].bw[b]);
                else
                    printf(" %.1f GFLOP/s |", rows[r].gflops[b]);
            }
            printf("\n");
        }
        cJSON_Delete(all);
    }
    free(rows);
    loom_registry_free(&reg);
    return 0;
}
