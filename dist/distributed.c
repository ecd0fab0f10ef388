/*
 * dist/distributed.c - see distributed.h; the design and its measurements: docs/DISTRIBUTED.md.
 *
 * What crosses the wire, per step: rank 0 broadcasts a command (a step's inputs or a block
 * copy; or the end), stage r sends stage r + 1 one message, and the last stage sends rank 0 one
 * message: the logits wanted, maybe none. A message is a stage_msg header, then its floats. A
 * stage whose step failed sends an error header in place of its message, and one that has not
 * yet taken its own message from upstream takes it first, so that every link carries exactly
 * one message a step whatever fails, and the error reaches rank 0 naming the rank it began on.
 */
#define _GNU_SOURCE
#include "dist/distributed.h"

#include "dist/transport.h"

#include "core/loader.h"

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* LOOM_PKGLIBDIR comes from the build (Makefile.am's AM_CPPFLAGS) */

enum { CMD_STEP = 1, CMD_COPY, CMD_QUIT };

typedef struct command {
    int32_t kind;
    int32_t n_tokens, n_seqs, max_blocks, n_logits, has_prefix; /* CMD_STEP */
    int32_t n_copies;                                           /* CMD_COPY */
} command;

typedef struct stage_msg {
    int32_t failed;
    int32_t pad;
    uint64_t count; /* floats that follow (none when failed) */
    char text[480]; /* failed: the message, naming the rank it began on */
} stage_msg;

struct loom_dist {
    const loom_transport *t;
    int rank, size;
    char host[64];
    int32_t first, end; /* this rank's layers */
    /* this step's messages: taken from upstream, sent downstream */
    int got_upstream, sent_down;
    char upstream_err[480]; /* the error an upstream stage sent this step */
    int32_t *payload;
    size_t payload_cap; /* int32s */
    uint64_t sent_bytes, recv_bytes;
};

static loom_dist job;
static enum { JOB_NONE, JOB_JOINED, JOB_LEAVING, JOB_OVER } job_state;

/* ---- Joining ------------------------------------------------------------------------------ */

/* The job's size as the launcher tells it (Open MPI; MPICH and other PMI launchers). */
static int launcher_size(void)
{
    const char *keys[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        const char *v = getenv(keys[i]);
        if (v && *v)
            return atoi(v);
    }
    return 0;
}

/* LOOM_MPI_MODULE; the build tree's when running from it; beside the executable's install;
 * the configured install directory. */
static void *open_module(char *err, size_t err_size)
{
    char exe[PATH_MAX], build[PATH_MAX], path[3][PATH_MAX + 64];
    int n = 0;
    const char *env = getenv("LOOM_MPI_MODULE");
    if (env && *env) {
        snprintf(path[n++], sizeof path[0], "%s", env);
    } else {
        if (loom_exe_dir(exe, sizeof exe) == 0) {
            if (loom_build_tree(exe, build, sizeof build))
                snprintf(path[n++], sizeof path[0], "%s/dist/mpi/.libs/loom-mpi.so", build);
            snprintf(path[n++], sizeof path[0], "%s/../lib/loom/mpi/loom-mpi.so", exe);
        }
        snprintf(path[n++], sizeof path[0], "%s/mpi/loom-mpi.so", LOOM_PKGLIBDIR);
    }
    if (env && *env && access(env, F_OK) != 0) {
        snprintf(err, err_size, "LOOM_MPI_MODULE=%s: %s", env, strerror(errno));
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        if (access(path[i], F_OK) != 0)
            continue;
        /* global: MPI libraries load their own components, which look for its symbols */
        void *so = dlopen(path[i], RTLD_NOW | RTLD_GLOBAL);
        if (!so) {
            snprintf(err, err_size, "loading %s: %s", path[i], dlerror());
            return NULL;
        }
        return so;
    }
    snprintf(err, err_size,
             "this is an MPI job, but loom's MPI module (loom-mpi.so) is not installed: build "
             "loom with MPI (apt-get install libopenmpi-dev; configure says \"MPI: yes\"), or set "
             "LOOM_MPI_MODULE to its path; LOOM_DISTRIBUTED=0 runs each process alone");
    return NULL;
}

/* whether `wanted` (loom_model_options.distributed) asks for a job here at all */
static int job_wanted(int wanted)
{
    const char *env = getenv("LOOM_DISTRIBUTED");
    return wanted > 1 || (wanted == 1 && !(env && strcmp(env, "0") == 0));
}

int loom_distributed_job(int32_t distributed)
{
    return job_wanted(distributed) && launcher_size() > 1;
}

int loom_dist_join(int wanted, loom_dist **out, char *err, size_t err_size)
{
    *out = NULL;
    if (!job_wanted(wanted))
        return 0;
    int size = launcher_size();
    if (size <= 1) {
        if (wanted > 1 && size == 0) {
            snprintf(err, err_size,
                     "--distributed: this process was not started by mpirun (no "
                     "OMPI_COMM_WORLD_SIZE or PMI_SIZE in its environment)");
            return -1;
        }
        return 0; /* a job of one process runs as no job */
    }
    if (job_state != JOB_NONE) {
        snprintf(err, err_size, "a distributed job runs one model: this process already %s one",
                 job_state == JOB_JOINED ? "runs" : "ran");
        return -1;
    }
    void *so = open_module(err, err_size);
    if (!so)
        return -1;
    loom_transport_entry_fn entry = (loom_transport_entry_fn)dlsym(so, LOOM_TRANSPORT_ENTRY);
    const loom_transport *t = entry ? entry() : NULL;
    if (!t || t->abi != LOOM_TRANSPORT_ABI) {
        snprintf(err, err_size, "loom's MPI module is not of this loom (transport ABI %d, want %d)",
                 t ? t->abi : -1, LOOM_TRANSPORT_ABI);
        return -1;
    }
    memset(&job, 0, sizeof job);
    job.t = t;
    if (t->join(&job.rank, &job.size, job.host, sizeof job.host, err, err_size) != 0)
        return -1;
    job_state = JOB_JOINED;
    *out = &job;
    return 0;
}

int loom_dist_rank(const loom_dist *d)
{
    return d ? d->rank : 0;
}

int loom_dist_size(const loom_dist *d)
{
    return d ? d->size : 1;
}

void loom_dist_watch(loom_dist *d, void (*on_stop)(void *ctx, const char *why), void *ctx)
{
    if (d && d->rank == 0 && job_state == JOB_JOINED)
        d->t->watch(on_stop, ctx);
}

void loom_dist_traffic(const loom_dist *d, uint64_t *sent, uint64_t *received)
{
    *sent = d ? d->sent_bytes : 0;
    *received = d ? d->recv_bytes : 0;
}

/* ---- Counted transfers --------------------------------------------------------------------- */

static int bcast(loom_dist *d, void *buf, uint64_t bytes, char *err, size_t err_size)
{
    if (d->rank == 0)
        d->sent_bytes += bytes * (uint64_t)(d->size - 1);
    else
        d->recv_bytes += bytes;
    return d->t->bcast(buf, bytes, err, err_size);
}

static int send_msg(loom_dist *d, int to, const stage_msg *m, const float *x, char *err,
                    size_t err_size)
{
    d->sent_bytes += sizeof *m + m->count * sizeof(float);
    if (d->t->send(to, m, sizeof *m, err, err_size) != 0)
        return -1;
    return m->count ? d->t->send(to, x, m->count * sizeof(float), err, err_size) : 0;
}

/* A message of `count` floats from `from` into x (NULL: thrown away); a failed stage's message
 * is the error. */
static int recv_msg(loom_dist *d, int from, float *x, uint64_t count, char *err, size_t err_size)
{
    stage_msg m;
    if (d->t->recv(from, &m, sizeof m, err, err_size) != 0)
        return -1;
    d->recv_bytes += sizeof m + m.count * sizeof(float);
    m.text[sizeof m.text - 1] = 0;
    if (m.failed) {
        snprintf(d->upstream_err, sizeof d->upstream_err, "%s", m.text);
        snprintf(err, err_size, "%s", m.text);
        return -1;
    }
    int rc = 0;
    if (x && m.count != count) {
        snprintf(err, err_size, "rank %d sent %llu values where %llu were due", from,
                 (unsigned long long)m.count, (unsigned long long)count);
        rc = -1;
    }
    if (!m.count)
        return rc;
    /* the floats are on their way whatever happens: take them */
    float *sink = rc == 0 && x ? NULL : malloc((size_t)m.count * sizeof *sink);
    if (rc == 0 && !x && !sink) {
        snprintf(err, err_size, "out of memory");
        rc = -1;
    }
    if ((x || sink) &&
        d->t->recv(from, sink ? sink : x, m.count * sizeof(float), err, err_size) != 0)
        rc = -1;
    if (!x && !sink) /* nowhere to put them: the link cannot stay in step */
        d->t->abort(1);
    free(sink);
    return rc;
}

/* ---- The stage link ------------------------------------------------------------------------ */

static int link_recv(void *ctx, float *x, uint64_t count, char *err, size_t err_size)
{
    loom_dist *d = ctx;
    d->got_upstream = 1;
    return recv_msg(d, d->rank - 1, x, count, err, err_size);
}

static int link_send(void *ctx, const float *x, uint64_t count, char *err, size_t err_size)
{
    loom_dist *d = ctx;
    stage_msg m = {.count = count};
    d->sent_down = 1;
    return send_msg(d, d->rank + 1, &m, x, err, err_size);
}

static int link_send_logits(void *ctx, const float *x, uint64_t count, char *err, size_t err_size)
{
    loom_dist *d = ctx;
    stage_msg m = {.count = count};
    d->sent_down = 1;
    return send_msg(d, 0, &m, x, err, err_size);
}

static int link_recv_logits(void *ctx, float *x, uint64_t count, char *err, size_t err_size)
{
    loom_dist *d = ctx;
    return recv_msg(d, d->size - 1, x, count, err, err_size);
}

/* "layers 3-5", or for a stage of none "no layers" */
static const char *layers_text(int32_t first, int32_t end, char *buf, size_t size)
{
    if (end > first)
        snprintf(buf, size, "layers %d-%d", first, end - 1);
    else
        snprintf(buf, size, "no layers");
    return buf;
}

static void new_step(loom_dist *d)
{
    d->got_upstream = d->sent_down = 0;
    d->upstream_err[0] = 0;
}

static int ensure_payload(loom_dist *d, uint64_t n, char *err, size_t err_size)
{
    if (n <= d->payload_cap)
        return 0;
    int32_t *p = realloc(d->payload, (size_t)n * sizeof *p);
    if (!p) {
        snprintf(err, err_size, "out of memory");
        return -1;
    }
    d->payload = p, d->payload_cap = (size_t)n;
    return 0;
}

static uint64_t step_payload(const command *c)
{
    return 4 * (uint64_t)c->n_tokens + (uint64_t)c->n_seqs * (uint64_t)c->max_blocks +
        (uint64_t)c->n_logits + (c->has_prefix ? (uint64_t)c->n_seqs : 0);
}

static int link_announce_step(void *ctx, const loom_step *s, char *err, size_t err_size)
{
    loom_dist *d = ctx;
    command c = {.kind = CMD_STEP,
                 .n_tokens = s->n_tokens,
                 .n_seqs = s->n_seqs,
                 .max_blocks = s->max_blocks,
                 .n_logits = s->n_logits,
                 .has_prefix = s->prefix_len != NULL};
    uint64_t n = step_payload(&c), table = (uint64_t)s->n_seqs * (uint64_t)s->max_blocks;
    new_step(d);
    if (ensure_payload(d, n, err, err_size) != 0)
        return -1;
    int32_t *p = d->payload;
    size_t t = (size_t)s->n_tokens * sizeof *p;
    memcpy(p, s->ids, t), memcpy(p + s->n_tokens, s->pos, t);
    memcpy(p + 2 * s->n_tokens, s->seq, t), memcpy(p + 3 * s->n_tokens, s->slots, t);
    memcpy(p + 4 * s->n_tokens, s->block_table, (size_t)table * sizeof *p);
    memcpy(p + 4 * s->n_tokens + table, s->logit_rows, (size_t)s->n_logits * sizeof *p);
    if (s->prefix_len)
        memcpy(p + 4 * s->n_tokens + table + s->n_logits, s->prefix_len,
               (size_t)s->n_seqs * sizeof *p);
    if (bcast(d, &c, sizeof c, err, err_size) != 0 ||
        bcast(d, p, n * sizeof *p, err, err_size) != 0)
        return -1;
    return 0;
}

static int link_announce_copy(void *ctx, const loom_kvcopy *copies, int n, char *err,
                              size_t err_size)
{
    loom_dist *d = ctx;
    command c = {.kind = CMD_COPY, .n_copies = n};
    if (ensure_payload(d, 2 * (uint64_t)n, err, err_size) != 0)
        return -1;
    for (int i = 0; i < n; i++)
        d->payload[2 * i] = copies[i].src, d->payload[2 * i + 1] = copies[i].dst;
    if (bcast(d, &c, sizeof c, err, err_size) != 0 ||
        bcast(d, d->payload, 2 * (uint64_t)n * sizeof *d->payload, err, err_size) != 0)
        return -1;
    return 0;
}

/* This stage's step failed: keep every link at one message a step, and pass the error on (rank
 * 0's runner still takes the step's result, which is then this error come round). */
static void link_fail(void *ctx, const char *message)
{
    loom_dist *d = ctx;
    char err[256];
    if (d->rank > 0 && !d->got_upstream) {
        d->got_upstream = 1;
        recv_msg(d, d->rank - 1, NULL, 0, err, sizeof err);
    }
    if (!d->sent_down) {
        stage_msg m = {.failed = 1};
        if (d->upstream_err[0])
            snprintf(m.text, sizeof m.text, "%s", d->upstream_err);
        else
            snprintf(m.text, sizeof m.text, "rank %d on %s (%s): %s", d->rank, d->host,
                     layers_text(d->first, d->end, err, sizeof err), message);
        d->sent_down = 1;
        send_msg(d, d->rank + 1 < d->size ? d->rank + 1 : 0, &m, NULL, err, sizeof err);
    }
}

/* ---- Planning and agreeing ------------------------------------------------------------------ */

typedef struct plan_msg {
    int32_t ok;
    int32_t n_layer;
    uint64_t n_tensors, tensor_bytes; /* the file's fingerprint */
    char err[448];
} plan_msg;

static void fingerprint(const loom_gguf *g, uint64_t *n, uint64_t *bytes)
{
    *n = g->n_tensors, *bytes = 0;
    for (uint64_t i = 0; i < g->n_tensors; i++)
        *bytes += g->tensors[i].size;
}

/* "N0,N1,...": layers per rank, all of them, one number a rank. */
static int parse_layers(const char *spec, int size, int32_t n_layer, int32_t *cut, char *err,
                        size_t err_size)
{
    const char *p = spec;
    cut[0] = 0;
    for (int r = 0; r < size; r++) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 0 || (*end != ',' && *end != 0) || (r + 1 < size && *end != ',') ||
            (r + 1 == size && *end)) {
            snprintf(err, err_size,
                     "--layers '%s' must give each of the %d ranks its number of layers, "
                     "comma-separated",
                     spec, size);
            return -1;
        }
        cut[r + 1] = cut[r] + (int32_t)v;
        p = end + 1;
    }
    if (cut[size] != n_layer) {
        snprintf(err, err_size, "--layers '%s' gives %d layers; the model has %d", spec, cut[size],
                 n_layer);
        return -1;
    }
    return 0;
}

int loom_dist_plan(loom_dist *d, const loom_gguf *g, int32_t n_layer, const char *stage_layers,
                   loom_stage_link *link, int32_t *first, int32_t *end, char *err, size_t err_size)
{
    plan_msg pm = {0};
    int32_t *cut = calloc((size_t)d->size + 1, sizeof *cut);
    char e[512];
    if (!cut) {
        snprintf(err, err_size, "out of memory");
        return -1;
    }
    if (d->rank == 0) {
        if (!g) {
            snprintf(pm.err, sizeof pm.err, "%s", err);
        } else if (stage_layers && *stage_layers) {
            pm.ok = parse_layers(stage_layers, d->size, n_layer, cut, pm.err, sizeof pm.err) == 0;
        } else {
            pm.ok = loom_runner_plan_stages(g, n_layer, d->size, cut) == 0;
            if (!pm.ok)
                snprintf(pm.err, sizeof pm.err, "out of memory");
        }
        pm.n_layer = n_layer;
        if (g)
            fingerprint(g, &pm.n_tensors, &pm.tensor_bytes);
    }
    if (bcast(d, &pm, sizeof pm, e, sizeof e) != 0 ||
        bcast(d, cut, ((uint64_t)d->size + 1) * sizeof *cut, e, sizeof e) != 0) {
        snprintf(err, err_size, "rank %d: %s", d->rank, e);
        free(cut);
        return -1;
    }
    pm.err[sizeof pm.err - 1] = 0;
    if (!pm.ok) {
        if (d->rank > 0)
            snprintf(err, err_size, "rank 0: %s", pm.err);
        else if (g)
            snprintf(err, err_size, "%s", pm.err);
        free(cut);
        return -1;
    }
    d->first = *first = cut[d->rank];
    d->end = *end = cut[d->rank + 1];
    free(cut);
    if (!g)
        return 1; /* this rank's own failure stays in err, for loom_dist_agree */
    uint64_t n, bytes;
    fingerprint(g, &n, &bytes);
    if (d->rank > 0 && (n != pm.n_tensors || bytes != pm.tensor_bytes || n_layer != pm.n_layer)) {
        snprintf(err, err_size,
                 "its model file differs from rank 0's (%llu tensors, %llu bytes, %d layers; "
                 "rank 0 has %llu, %llu, %d): every rank needs the same file",
                 (unsigned long long)n, (unsigned long long)bytes, n_layer,
                 (unsigned long long)pm.n_tensors, (unsigned long long)pm.tensor_bytes, pm.n_layer);
        return 1;
    }
    *link = (loom_stage_link){.ctx = d,
                              .recv = d->rank > 0 ? link_recv : NULL,
                              .send = d->rank + 1 < d->size ? link_send : NULL,
                              .announce_step = d->rank == 0 ? link_announce_step : NULL,
                              .announce_copy = d->rank == 0 ? link_announce_copy : NULL,
                              .recv_logits = d->rank == 0 ? link_recv_logits : NULL,
                              .send_logits = d->rank + 1 == d->size ? link_send_logits : NULL,
                              .fail = link_fail};
    return 0;
}

typedef struct rank_report {
    int32_t ok, first, end, pad;
    char host[64];
    char what[160];
    char err[448];
} rank_report;

int loom_dist_agree(loom_dist *d, int ok, const char *what, char *err, size_t err_size,
                    char *summary, size_t summary_size)
{
    rank_report mine = {ok, d->first, d->end, 0, "", "", ""};
    snprintf(mine.host, sizeof mine.host, "%s", d->host);
    snprintf(mine.what, sizeof mine.what, "%s", what ? what : "");
    if (!ok)
        snprintf(mine.err, sizeof mine.err, "%s", err);
    rank_report *all = d->rank == 0 ? calloc((size_t)d->size, sizeof *all) : NULL;
    plan_msg verdict = {.ok = 1};
    char e[512];
    if (d->rank == 0 && !all) {
        snprintf(err, err_size, "out of memory");
        d->t->abort(1);
    }
    if (d->t->gather(&mine, sizeof mine, all, e, sizeof e) != 0) {
        snprintf(err, err_size, "rank %d: %s", d->rank, e);
        free(all);
        return -1;
    }
    if (d->rank == 0) {
        size_t used = 0;
        if (summary_size)
            summary[0] = 0;
        for (int r = 0; r < d->size; r++) {
            rank_report *x = &all[r];
            x->host[sizeof x->host - 1] = x->what[sizeof x->what - 1] = x->err[sizeof x->err - 1] =
                0;
            if (!x->ok && verdict.ok) {
                verdict.ok = 0;
                snprintf(verdict.err, sizeof verdict.err, "rank %d on %s: %s", r, x->host, x->err);
            }
            char lt[48];
            if (used < summary_size)
                used += (size_t)snprintf(summary + used, summary_size - used,
                                         "%srank %d on %s: %s on %s", r ? "; " : "", r, x->host,
                                         layers_text(x->first, x->end, lt, sizeof lt), x->what);
        }
        free(all);
    }
    if (bcast(d, &verdict, sizeof verdict, e, sizeof e) != 0) {
        snprintf(err, err_size, "rank %d: %s", d->rank, e);
        return -1;
    }
    verdict.err[sizeof verdict.err - 1] = 0;
    if (!verdict.ok) {
        if (d->rank == 0 || ok)
            snprintf(err, err_size, "%s", verdict.err);
        return -1;
    }
    return 0;
}

/* ---- Following ------------------------------------------------------------------------------ */

int loom_dist_follow(loom_dist *d, loom_runner *r, char *err, size_t err_size)
{
    char e[1024];
    for (;;) {
        command c;
        if (bcast(d, &c, sizeof c, err, err_size) != 0)
            return -1;
        if (c.kind == CMD_QUIT)
            return 0;
        uint64_t n = c.kind == CMD_STEP ? step_payload(&c) : 2 * (uint64_t)c.n_copies;
        if (ensure_payload(d, n ? n : 1, err, err_size) != 0 ||
            bcast(d, d->payload, n * sizeof *d->payload, err, err_size) != 0)
            return -1;
        const int32_t *p = d->payload;
        if (c.kind == CMD_STEP) {
            uint64_t table = (uint64_t)c.n_seqs * (uint64_t)c.max_blocks;
            loom_step st = {c.n_tokens,
                            p,
                            p + c.n_tokens,
                            p + 2 * c.n_tokens,
                            p + 3 * c.n_tokens,
                            c.n_seqs,
                            c.max_blocks,
                            p + 4 * c.n_tokens,
                            c.n_logits,
                            p + 4 * c.n_tokens + table,
                            c.has_prefix ? p + 4 * c.n_tokens + table + c.n_logits : NULL,
                            0,
                            NULL,
                            NULL,
                            NULL};
            new_step(d);
            /* a failure goes down the pipeline to rank 0, which decides; the runner passes
             * on those of a step it ran, this one a step it refused outright */
            if (loom_runner_step(r, &st, e, sizeof e) != 0)
                link_fail(d, e);
        } else if (c.kind == CMD_COPY) {
            loom_kvcopy *copies = malloc((size_t)(c.n_copies ? c.n_copies : 1) * sizeof *copies);
            int ok = copies != NULL;
            for (int i = 0; ok && i < c.n_copies; i++)
                copies[i] = (loom_kvcopy){p[2 * i], p[2 * i + 1]};
            /* the stages' caches would disagree from now on: nothing can go on */
            if (!ok || loom_runner_copy_blocks(r, copies, c.n_copies, e, sizeof e) != 0) {
                fprintf(stderr, "loom: rank %d on %s: copying KV blocks: %s\n", d->rank, d->host,
                        ok ? e : "out of memory");
                d->t->abort(1);
            }
            free(copies);
        } else {
            snprintf(err, err_size, "rank 0 sent an unknown command %d", c.kind);
            return -1;
        }
    }
}

static void leave_now(void)
{
    job.t->leave();
    free(job.payload);
    job.payload = NULL;
    job_state = JOB_OVER;
}

void loom_dist_leave(loom_dist *d, int tell_others)
{
    if (!d || job_state != JOB_JOINED)
        return;
    if (tell_others) {
        if (d->rank == 0) {
            d->t->watch(NULL, NULL); /* the others' exits are no news now */
            command c = {.kind = CMD_QUIT};
            char e[256];
            bcast(d, &c, sizeof c, e, sizeof e);
        }
        leave_now();
        return;
    }
    /* A failed open: every rank has its error to print, and MPI_Finalize waits for all of
     * them. Finalizing at exit, after the print, keeps a failed follower from exiting (which
     * makes mpirun kill the job) before rank 0 has named it. */
    job_state = JOB_LEAVING;
    atexit(leave_now);
}
