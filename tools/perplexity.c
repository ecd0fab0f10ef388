/*
 * tools/perplexity.c - `loom perplexity`: how well a model predicts a text, computed the way
 * llama.cpp's llama-perplexity computes it, so figures compare with the ones published for its
 * quant types:
 *   the text is tokenised once (with the family's prefix: BOS, or ChatGLM's [gMASK] sop), split
 *   into non-overlapping chunks of CTX tokens, each chunk evaluated from a fresh context with
 *   its first token(s) replaced by that prefix, and only the second half of each chunk scored:
 *   positions j = CTX/2 .. CTX-2 predict token j+1. PPL = exp(mean NLL), its error by the delta
 *   method from the NLL's standard error.
 *
 * KL divergence against a base run: --save-logits keeps, for every scored position, the base
 * model's K largest logits (ids and values; K = --kl-top, 512 unless told, at most the
 * vocabulary), its log-sum-exp and the log-probability of the actual next token (a
 * full-vocabulary dump of a 150k vocabulary would be 600 KB a position); --kl-base reads it back
 * on the run under test and compares the distributions over those K tokens plus one bucket for
 * the rest of the vocabulary. Where K covers the vocabulary the figure is exact; otherwise the
 * bucket is a coarsening, so the figure is a lower bound of the full KL divergence (close when
 * the base's mass sits in its top K).
 *
 * --backends runs the same measurement on each backend in a child process of its own and
 * prints one table.
 */
#define _GNU_SOURCE
#include <loom/loom.h>

#include "args.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

#define DEFAULT_KL_TOP 512
#define KLD_MAGIC "LOOMKLD1"

typedef struct ppl_args {
    loom_open_flags open; /* the model, -c (the chunk length), --kv-type, --threads, ... */
    const char *text, *save, *base, *backends, *backend;
    long chunks, kl_top;
    int json, quiet;
} ppl_args;

/* ---- The base run's logits ---------------------------------------------------------------- */

typedef struct kld_header {
    char magic[8];
    uint32_t n_vocab, ctx, n_chunks, top_k, n_scored;
    uint32_t tokens_hash; /* of every evaluated token: the same text, tokenised the same way */
} kld_header;

/* One scored position of the base run; its top_k ids and logits follow it in the file. */
typedef struct kld_position {
    float lse;       /* log-sum-exp of the logits */
    float logp_next; /* log-probability of the token that came next */
} kld_position;

static size_t kld_position_bytes(uint32_t top_k)
{
    return sizeof(kld_position) + (size_t)top_k * (sizeof(int32_t) + sizeof(float));
}

/* the largest logits, largest first, and their token ids */
static int32_t *kld_ids(kld_position *p)
{
    return (int32_t *)(p + 1);
}
static float *kld_logits(kld_position *p, uint32_t top_k)
{
    return (float *)(kld_ids(p) + top_k);
}

static uint32_t hash_tokens(const int32_t *t, size_t n)
{
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++)
        for (int b = 0; b < 4; b++)
            h = (h ^ (uint8_t)((uint32_t)t[i] >> (8 * b))) * 16777619u;
    return h;
}

/* the top want of x (n floats), largest first */
static void top_k(const float *x, int32_t n, uint32_t want, int32_t *ids, float *vals)
{
    uint32_t k = 0;
    for (int32_t i = 0; i < n; i++) {
        if (k == want && x[i] <= vals[want - 1])
            continue;
        uint32_t at = k < want ? k++ : want - 1;
        while (at > 0 && vals[at - 1] < x[i]) {
            vals[at] = vals[at - 1], ids[at] = ids[at - 1];
            at--;
        }
        vals[at] = x[i], ids[at] = i;
    }
}

static double log_sum_exp(const float *x, int32_t n)
{
    float mx = x[0];
    for (int32_t i = 1; i < n; i++)
        mx = x[i] > mx ? x[i] : mx;
    double s = 0;
    for (int32_t i = 0; i < n; i++)
        s += exp((double)x[i] - mx);
    return mx + log(s);
}

/* ---- One run -------------------------------------------------------------------------------- */

typedef struct kld_stats {
    double sum, sum2;      /* KL divergence per position */
    double same_top;       /* positions whose top token is the base's */
    double dp_sum, dp_max; /* p(base's top token): target minus base */
    double base_nll;       /* the base's NLL over the same positions */
    long n;
} kld_stats;

static void compare_base(kld_position *b, uint32_t top_k, const float *logits, int32_t nv,
                         double lse, kld_stats *k)
{
    const int32_t *ids = kld_ids(b);
    const float *base_logits = kld_logits(b, top_k);
    double kl = 0, pb_rest = 1, pt_rest = 1;
    for (uint32_t i = 0; i < top_k; i++) {
        double pb = exp((double)base_logits[i] - b->lse), pt = exp((double)logits[ids[i]] - lse);
        if (pb > 0)
            kl += pb * (log(pb) - log(pt > 1e-30 ? pt : 1e-30));
        pb_rest -= pb, pt_rest -= pt;
    }
    /* the rest of the vocabulary as one bucket; none where every token was kept (the float
     * log-sum-exp would leave a phantom rest of its rounding error) */
    if (top_k < (uint32_t)nv && pb_rest > 1e-12)
        kl += pb_rest * (log(pb_rest) - log(pt_rest > 1e-30 ? pt_rest : 1e-30));
    int32_t top = 0;
    for (int32_t i = 1; i < nv; i++)
        top = logits[i] > logits[top] ? i : top;
    double dp = exp((double)logits[ids[0]] - lse) - exp((double)base_logits[0] - b->lse);
    k->sum += kl, k->sum2 += kl * kl;
    k->same_top += top == ids[0];
    k->dp_sum += dp;
    k->dp_max = fabs(dp) > fabs(k->dp_max) ? dp : k->dp_max;
    k->base_nll += -b->logp_next;
    k->n++;
}

static int fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "loom perplexity: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    return 2;
}

static int run_one(const ppl_args *a)
{
    char err[4096];
    size_t len;
    char *text = loom_arg_text_file("loom perplexity", "-f", a->text, &len);
    if (!text)
        return 2;
    loom_model_options mo = loom_open_options(&a->open);
    mo.backend = a->backend;
    loom_model *m = loom_model_open(a->open.model, &mo, err, sizeof err);
    if (!m) {
        free(text);
        return fail("%s", err);
    }
    int followed = loom_args_follow("loom perplexity", m); /* ranks 1.. of a pipeline */
    if (followed >= 0) {
        free(text);
        return followed;
    }
    int rc = 2;
    int32_t nv = loom_model_n_vocab(m), prefix[8], n_prefix = 0;
    int32_t *tokens = NULL, *chunk = NULL;
    float *logits = NULL;
    FILE *save = NULL, *base = NULL;
    unsigned char *pos = NULL; /* a chunk's scored positions, pos_bytes each */
    kld_stats ks = {0};
    if (loom_model_n_ctx(m) < a->open.n_ctx) {
        fail("%s's context is %d tokens, less than -c %ld", a->open.model, loom_model_n_ctx(m),
             a->open.n_ctx);
        goto done;
    }
    /* what the family puts first: BOS, or ChatGLM's [gMASK] sop */
    int64_t np = loom_tokenize(m, "", 1, LOOM_SPECIAL_NONE, prefix, 8, err, sizeof err);
    n_prefix = np > 0 && np <= 8 ? (int32_t)np : 0;
    int64_t n = loom_tokenize(m, text, 1, LOOM_SPECIAL_NONE, NULL, 0, err, sizeof err);
    if (n < 0 || !(tokens = malloc((size_t)(n > 0 ? n : 1) * sizeof *tokens)) ||
        loom_tokenize(m, text, 1, LOOM_SPECIAL_NONE, tokens, n, err, sizeof err) != n) {
        fail("tokenizing %s failed: %s", a->text, err);
        goto done;
    }
    if (n < 2 * a->open.n_ctx) {
        fail("%s holds %lld tokens; scoring chunks of %ld needs at least %ld (a longer text, or "
             "a smaller -c)",
             a->text, (long long)n, a->open.n_ctx, 2 * a->open.n_ctx);
        goto done;
    }
    long n_chunks = (long)(n / a->open.n_ctx);
    if (a->chunks > 0 && a->chunks < n_chunks)
        n_chunks = a->chunks;
    int32_t ctx = (int32_t)a->open.n_ctx, first = ctx / 2, per_chunk = ctx - 1 - first;
    uint32_t hash = hash_tokens(tokens, (size_t)n_chunks * (size_t)ctx);
    if (!(chunk = malloc((size_t)ctx * sizeof *chunk)) ||
        !(logits = malloc((size_t)ctx * (size_t)nv * sizeof *logits))) {
        fail("out of memory for %d x %d logits", ctx, nv);
        goto done;
    }
    uint32_t kl_top = (uint32_t)(a->kl_top < nv ? a->kl_top : nv);
    kld_header h = {KLD_MAGIC,     (uint32_t)nv,
                    (uint32_t)ctx, (uint32_t)n_chunks,
                    kl_top,        (uint32_t)(n_chunks * per_chunk),
                    hash};
    if (a->save && (!(save = fopen(a->save, "wb")) || fwrite(&h, sizeof h, 1, save) != 1)) {
        fail("cannot write %s: %s", a->save, strerror(errno));
        goto done;
    }
    if (a->base) {
        kld_header bh;
        if (!(base = fopen(a->base, "rb")) || fread(&bh, sizeof bh, 1, base) != 1 ||
            memcmp(bh.magic, KLD_MAGIC, 8) != 0) {
            fail("%s is not a file --save-logits wrote", a->base);
            goto done;
        }
        if (bh.n_vocab != h.n_vocab || bh.ctx != h.ctx || bh.top_k < 1 || bh.top_k > bh.n_vocab ||
            bh.n_chunks < h.n_chunks || bh.tokens_hash != hash) {
            fail("%s was saved from another run (a vocabulary of %u, -c %u, %u chunks; this "
                 "run: %u, %u, %u, and the same text)",
                 a->base, bh.n_vocab, bh.ctx, bh.n_chunks, h.n_vocab, h.ctx, h.n_chunks);
            goto done;
        }
        kl_top = bh.top_k; /* the base decides what was kept */
    }
    size_t pos_bytes = kld_position_bytes(kl_top);
    if ((save || base) && !(pos = malloc((size_t)per_chunk * pos_bytes))) {
        fail("out of memory for %d x %u saved logits", per_chunk, kl_top);
        goto done;
    }
    double nll = 0, nll2 = 0;
    long count = 0;
    double t0 = loom_now_ms();
    cJSON *per = cJSON_CreateArray();
    for (long c = 0; c < n_chunks; c++) {
        memcpy(chunk, tokens + c * ctx, (size_t)ctx * sizeof *chunk);
        for (int32_t i = 0; i < n_prefix && i < ctx; i++)
            chunk[i] = prefix[i]; /* a fresh context starts as a prompt does */
        if (loom_eval_logits(m, chunk, ctx, logits, err, sizeof err) != 0) {
            fail("evaluating chunk %ld: %s", c + 1, err);
            cJSON_Delete(per);
            goto done;
        }
        if (base && fread(pos, pos_bytes, (size_t)per_chunk, base) != (size_t)per_chunk) {
            fail("%s ends early", a->base);
            cJSON_Delete(per);
            goto done;
        }
        for (int32_t j = first; j < ctx - 1; j++) {
            const float *lg = logits + (size_t)j * (size_t)nv;
            double lse = log_sum_exp(lg, nv);
            int32_t next = tokens[c * ctx + j + 1];
            double lp = (double)lg[next] - lse;
            nll += -lp, nll2 += lp * lp;
            count++;
            kld_position *p = pos ? (kld_position *)(pos + (size_t)(j - first) * pos_bytes) : NULL;
            if (base)
                compare_base(p, kl_top, lg, nv, lse, &ks);
            if (save) {
                p->lse = (float)lse, p->logp_next = (float)lp;
                top_k(lg, nv, kl_top, kld_ids(p), kld_logits(p, kl_top));
            }
        }
        if (save && fwrite(pos, pos_bytes, (size_t)per_chunk, save) != (size_t)per_chunk) {
            fail("cannot write %s: %s", a->save, strerror(errno));
            cJSON_Delete(per);
            goto done;
        }
        cJSON_AddItemToArray(per, cJSON_CreateNumber(exp(nll / (double)count)));
        if (!a->quiet && !a->json) {
            if (c == 0)
                fprintf(stderr, "%.1f s per chunk of %d tokens, %ld chunks\n",
                        (loom_now_ms() - t0) / 1e3, ctx, n_chunks);
            fprintf(stderr, "[%ld]%.4f,", c + 1, exp(nll / (double)count));
            fflush(stderr);
        }
    }
    if (!a->quiet && !a->json)
        fprintf(stderr, "\n");
    double mean = nll / (double)count, var = nll2 / (double)count - mean * mean;
    double ppl = exp(mean),
           ppl_err = var > 0 && count > 1 ? sqrt(var / (double)(count - 1)) * ppl : 0;
    double kld = ks.n ? ks.sum / (double)ks.n : 0;
    double kld_var = ks.n > 1 ? ks.sum2 / (double)ks.n - kld * kld : 0;
    if (a->json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "backend", loom_model_backend(m));
        cJSON_AddStringToObject(o, "model", a->open.model);
        cJSON_AddNumberToObject(o, "ctx", ctx);
        cJSON_AddNumberToObject(o, "chunks", (double)n_chunks);
        cJSON_AddNumberToObject(o, "tokens", (double)n);
        cJSON_AddNumberToObject(o, "scored", (double)count);
        cJSON_AddNumberToObject(o, "ppl", ppl);
        cJSON_AddNumberToObject(o, "ppl_error", ppl_err);
        cJSON_AddNumberToObject(o, "seconds", (loom_now_ms() - t0) / 1e3);
        cJSON_AddItemToObject(o, "ppl_by_chunk", per);
        per = NULL;
        if (ks.n) {
            cJSON *k = cJSON_AddObjectToObject(o, "kl_base");
            cJSON_AddNumberToObject(k, "kld_mean", kld);
            cJSON_AddNumberToObject(k, "kld_top", kl_top);
            cJSON_AddBoolToObject(k, "kld_exact", kl_top == (uint32_t)nv);
            cJSON_AddNumberToObject(k, "kld_error",
                                    kld_var > 0 ? sqrt(kld_var / (double)(ks.n - 1)) : 0);
            cJSON_AddNumberToObject(k, "same_top", ks.same_top / (double)ks.n);
            cJSON_AddNumberToObject(k, "top_p_diff_mean", ks.dp_sum / (double)ks.n);
            cJSON_AddNumberToObject(k, "top_p_diff_max", ks.dp_max);
            cJSON_AddNumberToObject(k, "ppl_base", exp(ks.base_nll / (double)ks.n));
            cJSON_AddNumberToObject(k, "ppl_ratio", ppl / exp(ks.base_nll / (double)ks.n));
        }
        char *s = cJSON_PrintUnformatted(o);
        printf("%s\n", s);
        free(s);
        cJSON_Delete(o);
    } else {
        printf("%s on %s: %ld chunks of %d tokens, %ld positions scored\n", a->open.model,
               loom_model_backend(m), n_chunks, ctx, count);
        printf("Final estimate: PPL = %.4f +/- %.5f\n", ppl, ppl_err);
        if (ks.n) {
            double pb = exp(ks.base_nll / (double)ks.n);
            char over[64];
            if (kl_top == (uint32_t)nv)
                snprintf(over, sizeof over, "the whole vocabulary");
            else
                snprintf(over, sizeof over, "top %u + rest: a lower bound", kl_top);
            printf("against %s: PPL ratio %.4f (base %.4f), mean KLD %.6f +/- %.6f (%s), "
                   "same top token %.2f%%, p(base top) %+.4f mean, %+.4f at most\n",
                   a->base, ppl / pb, pb, kld, kld_var > 0 ? sqrt(kld_var / (double)(ks.n - 1)) : 0,
                   over, 100 * ks.same_top / (double)ks.n, ks.dp_sum / (double)ks.n, ks.dp_max);
        }
    }
    cJSON_Delete(per);
    rc = 0;
done:
    if (save && fclose(save) != 0 && rc == 0)
        rc = fail("cannot write %s: %s", a->save, strerror(errno));
    if (base)
        fclose(base);
    free(pos), free(logits), free(chunk), free(tokens), free(text);
    loom_model_close(m);
    return rc;
}

/* ---- Backends side by side ------------------------------------------------------------------ */

/* Runs `self perplexity ... --backend NAME --json` and returns its one line of JSON (NULL on
 * failure, with its stderr passed through). */
static cJSON *run_child(const char *self, const ppl_args *a, const char *backend)
{
    char ctx[32], chunks[32], threads[32];
    snprintf(ctx, sizeof ctx, "%ld", a->open.n_ctx);
    snprintf(chunks, sizeof chunks, "%ld", a->chunks);
    snprintf(threads, sizeof threads, "%ld", a->open.threads);
    const char *argv[24] = {self, "perplexity", "-m",   a->open.model, "-f",    a->text, "-c",
                            ctx,  "--chunks",   chunks, "--backend",   backend, "--json"};
    int n = 13;
    if (a->open.kv_type)
        argv[n++] = "--kv-type", argv[n++] = a->open.kv_type;
    if (a->open.threads)
        argv[n++] = "--threads", argv[n++] = threads;
    argv[n] = NULL;
    int out[2];
    if (pipe(out) != 0)
        return NULL;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    posix_spawn_file_actions_addclose(&fa, out[0]);
    pid_t pid;
    int spawned = posix_spawn(&pid, self, &fa, NULL, (char *const *)argv, environ) == 0;
    posix_spawn_file_actions_destroy(&fa);
    close(out[1]);
    char buf[1 << 16];
    size_t got = 0;
    ssize_t k;
    while (spawned && got < sizeof buf - 1 &&
           (k = read(out[0], buf + got, sizeof buf - 1 - got)) > 0)
        got += (size_t)k;
    buf[got] = '\0';
    close(out[0]);
    int status = 0;
    if (spawned)
        waitpid(pid, &status, 0);
    return spawned && WIFEXITED(status) && WEXITSTATUS(status) == 0 ? cJSON_Parse(buf) : NULL;
}

static int run_backends(const char *self, const ppl_args *a)
{
    char *names = NULL;
    if (!strcmp(a->backends, "all")) {
        /* every usable backend, as `loom backends --json` lists them */
        char err[1024], *report = NULL;
        size_t size = 0;
        FILE *mem = open_memstream(&report, &size);
        if (!mem)
            return fail("out of memory");
        loom_backends_report(mem, 1, err, sizeof err); /* written even when none is usable */
        fclose(mem);
        cJSON *r = cJSON_Parse(report), *c;
        free(report);
        size_t cap = 1024, used = 0;
        names = calloc(1, cap);
        cJSON_ArrayForEach (c, cJSON_GetObjectItem(r, "candidates")) {
            const char *name = cJSON_GetStringValue(cJSON_GetObjectItem(c, "name"));
            const char *variant = cJSON_GetStringValue(cJSON_GetObjectItem(c, "variant"));
            const char *kind = cJSON_GetStringValue(cJSON_GetObjectItem(c, "kind"));
            if (names && cJSON_IsTrue(cJSON_GetObjectItem(c, "usable")) && name && kind &&
                !strcmp(kind, "backend") && used + 160 < cap)
                used += (size_t)snprintf(names + used, cap - used, "%s%s%s%s", used ? "," : "",
                                         name, variant && *variant ? "-" : "",
                                         variant ? variant : "");
        }
        cJSON_Delete(r);
    } else {
        names = strdup(a->backends);
    }
    if (!names)
        return fail("out of memory");
    printf("| backend | PPL | +/- | vs the first | seconds |\n|---|---|---|---|---|\n");
    double first = 0;
    int failures = 0;
    char *save = NULL;
    for (char *b = strtok_r(names, ",", &save); b; b = strtok_r(NULL, ",", &save)) {
        cJSON *o = run_child(self, a, b);
        double ppl = o ? cJSON_GetNumberValue(cJSON_GetObjectItem(o, "ppl")) : NAN;
        if (!o || !isfinite(ppl)) {
            printf("| %s | failed (above) | | | |\n", b);
            failures++;
            cJSON_Delete(o);
            continue;
        }
        if (first == 0)
            first = ppl;
        printf("| %s | %.4f | %.5f | %+.3f%% | %.1f |\n",
               cJSON_GetStringValue(cJSON_GetObjectItem(o, "backend")), ppl,
               cJSON_GetNumberValue(cJSON_GetObjectItem(o, "ppl_error")), 100 * (ppl / first - 1),
               cJSON_GetNumberValue(cJSON_GetObjectItem(o, "seconds")));
        fflush(stdout);
        cJSON_Delete(o);
    }
    free(names);
    return failures ? 1 : 0;
}

int loom_perplexity_main(int argc, char **argv, const char *self);
int loom_perplexity_main(int argc, char **argv, const char *self)
{
    ppl_args a = {.open = {.n_ctx = 512}, .kl_top = DEFAULT_KL_TOP};
    char kl_top_help[256];
    snprintf(kl_top_help, sizeof kl_top_help,
             "K for --save-logits (default %d; a K as large as the\n"
             "vocabulary makes the KL divergence exact, at 8 x K bytes a position)",
             DEFAULT_KL_TOP);
    const loom_flag flags[] = {
        LOOM_FLAG_MODEL(&a.open.model),
        {"-f", NULL, LOOM_FLAG_TEXT, &a.text, 0, 0, "TEXT",
         "the text to score (a file; '-' reads standard input); it must\n"
         "hold at least 2 x CTX tokens"},
        {"-c", NULL, LOOM_FLAG_LONG, &a.open.n_ctx, 4, 1 << 20, "CTX",
         "tokens per chunk (default 512); each chunk's second half is scored"},
        {"--chunks", NULL, LOOM_FLAG_LONG, &a.chunks, 0, 1 << 30, "N",
         "score only the first N chunks (default: all the text holds)"},
        {"--save-logits", NULL, LOOM_FLAG_TEXT, &a.save, 0, 0, "FILE",
         "keep this run's top-K logits per scored position: the base"},
        {"--kl-top", NULL, LOOM_FLAG_LONG, &a.kl_top, 1, 1 << 24, "K", kl_top_help},
        {"--kl-base", NULL, LOOM_FLAG_TEXT, &a.base, 0, 0, "FILE",
         "compare with a base run saved so: KL divergence, same top token,\n"
         "probability of the base's top token, PPL ratio"},
        {"--backends", NULL, LOOM_FLAG_TEXT, &a.backends, 0, 0, "LIST",
         "all, or comma-separated names: each in its own process, one table"},
        {"--backend", NULL, LOOM_FLAG_TEXT, &a.backend, 0, 0, "NAME",
         "run on this backend (as LOOM_BACKEND)"},
        LOOM_FLAG_KV_TYPE(&a.open.kv_type),
        LOOM_FLAG_THREADS(&a.open.threads),
        LOOM_FLAG_EXPERTS_ON(&a.open.experts_on),
        LOOM_FLAG_DISTRIBUTED(&a.open.distributed),
        LOOM_FLAG_LAYERS(&a.open.layers),
        {"--json", NULL, LOOM_FLAG_SWITCH, &a.json, 0, 0, NULL, "one JSON object"},
        {"--quiet", NULL, LOOM_FLAG_SWITCH, &a.quiet, 0, 0, NULL, "no running estimate"},
    };
    const loom_command cmd = {
        .name = "loom perplexity",
        .synopsis = "-m MODEL -f TEXT [-c 512] [--chunks N] [--json]\n"
                    "                       [--save-logits FILE | --kl-base FILE] "
                    "[--backends LIST]",
        .flags = flags,
        .n_flags = LOOM_N_FLAGS(flags),
        .epilogue = "The method is llama.cpp's llama-perplexity's; the same file and text give "
                    "the same\nfigure within float noise."};
    int parsed = loom_args_parse(&cmd, argc, argv);
    if (parsed)
        return parsed == 1 ? 0 : parsed;
    if (!a.open.model || !a.text) {
        fprintf(stderr, "loom perplexity: give -m MODEL and -f TEXT\n");
        loom_args_usage(&cmd, stderr);
        return 2;
    }
    if (a.save && a.base)
        return fail("--save-logits and --kl-base are two runs: the base's, then the one "
                    "compared with it");
    if (a.backends) {
        if (a.save || a.base || a.backend)
            return fail("--backends runs a plain measurement per backend; --save-logits, "
                        "--kl-base and --backend go with a single run");
        if (loom_distributed_job(a.open.distributed ? 2 : 1))
            return fail("--backends runs each backend in a process of its own, which cannot "
                        "join this MPI job; under mpirun each rank picks its own backend "
                        "(LOOM_BACKEND per rank), so drop --backends");
        return run_backends(self, &a);
    }
    return run_one(&a);
}
