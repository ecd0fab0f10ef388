/*
 * tools/conformance.c - `loom-conformance`: checks a backend module against the ABI contract
 * and against the reference backend, without loom's source tree.
 *
 *   loom-conformance [--json FILE] [--ref PATH] [--model MODEL ...] [--quiet] [--require-usable]
 *                    [BACKEND.so | NAME ...]
 *
 * With no backend given it checks every usable module the loader finds. A module whose probe
 * finds nothing to run on here (the AVX-512 variant on an AVX2 machine, CUDA without a GPU) is
 * skipped with the probe's reason, unless --require-usable makes that a failure; a run that
 * checked no module at all fails. For each it checks
 * ABI negotiation, copies, allocation failure, every op x dtype x awkward shape against `ref`
 * (the same inputs on both, outputs compared by normalised error with a threshold per dtype),
 * and repeated load/unload; with --model, a model's logits step by step against ref's (what
 * op cases cannot foresee shows there). It prints a markdown support matrix, optionally a JSON report, and
 * exits 1 when any check fails (2 on a usage error).
 *
 * Inputs are placed at odd offsets inside their buffers and, for matrices, with padded row
 * strides, so a backend that assumes dense or aligned tensors fails here, not in a model.
 */
#define _GNU_SOURCE
#include "args.h"
#include "conformance.h"
#include "conformance_cases.h"
#include "api/loader_env.h"
#include "loom/loom.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- Reporting -------------------------------------------------------------------------- */

const loom_dtype all_dtypes[N_DTYPES] = {LOOM_WEIGHT_DTYPES(LOOM_DTYPE_ITEM)
                                             LOOM_INDEX_DTYPES(LOOM_DTYPE_ITEM)};

void record(report *r, const char *check, int ok, const char *fmt, ...)
{
    char detail[1024] = "";
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(detail, sizeof detail, fmt, ap);
        va_end(ap);
    }
    if (!ok)
        r->failures++;
    if (!ok || !r->quiet)
        printf("  %s %s%s%s\n", ok ? "ok  " : "FAIL", check, detail[0] ? ": " : "", detail);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "check", check);
    cJSON_AddStringToObject(o, "status", ok ? "pass" : "fail");
    cJSON_AddStringToObject(o, "detail", detail);
    cJSON_AddItemToArray(r->checks, o);
}

/* ---- Running a case on one device -------------------------------------------------------- */

static loom_status call_op(loom_device *d, const test_case *tc, loom_tensor *t)
{
    const spec *s = tc->t;
#define T(i) (s[i].used ? &t[i] : NULL)
    switch (tc->op) {
    case LOOM_OP_MATMUL: {
        loom_matmul_params p = {sizeof p, T(0), T(1), T(2), T(3)};
        return loom_device_run(d, tc->op, &p);
    }
    case LOOM_OP_GET_ROWS: {
        loom_get_rows_params p = {sizeof p, T(0), T(1), T(2)};
        return loom_device_run(d, tc->op, &p);
    }
    case LOOM_OP_RMS_NORM:
    case LOOM_OP_LAYER_NORM: {
        loom_norm_params p = {sizeof p, T(0), T(1), T(2), T(3), tc->eps};
        return loom_device_run(d, tc->op, &p);
    }
    case LOOM_OP_ROPE: {
        loom_rope_params p = {.struct_size = sizeof p,
                              .x = T(0),
                              .pos = T(1),
                              .pos2 = T(2),
                              .dst = T(3),
                              .mode = tc->rope_mode,
                              .n_rot = tc->n_rot,
                              .freq_base = tc->freq_base,
                              .freq_scale = tc->freq_scale,
                              .freq_factors = T(4)};
        return loom_device_run(d, tc->op, &p);
    }
    case LOOM_OP_ADD:
    case LOOM_OP_MUL:
    case LOOM_OP_SCALE:
    case LOOM_OP_SILU_MUL:
    case LOOM_OP_SIGMOID_MUL:
    case LOOM_OP_GELU: {
        loom_elementwise_params p = {sizeof p, T(0), T(1), T(2), tc->scale};
        return loom_device_run(d, tc->op, &p);
    }
    case LOOM_OP_KV_STORE: {
        loom_kv_store_params p = {sizeof p, T(0), T(1), T(2)};
        return loom_device_run(d, tc->op, &p);
    }
    case LOOM_OP_ATTENTION: {
        loom_attention_params p = {.struct_size = sizeof p,
                                   .q = T(0),
                                   .k_cache = T(1),
                                   .v_cache = T(2),
                                   .block_table = T(3),
                                   .seq = T(4),
                                   .pos = T(5),
                                   .prefix_len = T(6),
                                   .dst = T(7),
                                   .scale = tc->scale,
                                   .window = tc->window};
        return loom_device_run(d, tc->op, &p);
    }
    case LOOM_OP_QUANTIZE:
    case LOOM_OP_DEQUANTIZE:
    case LOOM_OP_CONVERT: {
        loom_convert_params p = {sizeof p, T(0), T(1)};
        return loom_device_run(d, tc->op, &p);
    }
    case LOOM_OP_MOE_ROUTE: {
        loom_moe_route_params p = {.struct_size = sizeof p,
                                   .logits = T(0),
                                   .bias = T(1),
                                   .ids = T(2),
                                   .weights = T(3),
                                   .gating = tc->gating,
                                   .normalize = tc->normalize,
                                   .scale = tc->scale,
                                   .n_group = tc->n_group,
                                   .topk_group = tc->topk_group};
        return loom_device_run(d, tc->op, &p);
    }
    case LOOM_OP_MATMUL_ID: {
        loom_matmul_id_params p = {sizeof p, T(0), T(1), T(2), T(3)};
        return loom_device_run(d, tc->op, &p);
    }
    case LOOM_OP_MOE_COMBINE: {
        loom_moe_combine_params p = {sizeof p, T(0), T(1), T(2), tc->accumulate};
        return loom_device_run(d, tc->op, &p);
    }
    case LOOM_OP_SSM_CONV: {
        loom_ssm_conv_params p = {sizeof p, T(0), T(1), T(2), T(3), T(4)};
        return loom_device_run(d, tc->op, &p);
    }
    case LOOM_OP_GATED_DELTA: {
        loom_gated_delta_params p = {sizeof p, T(0), T(1), T(2), T(3), T(4),
                                     T(5),     T(6), T(7), T(8), T(9), tc->v_heads_tiled};
        return loom_device_run(d, tc->op, &p);
    }
    case LOOM_OP_COUNT: break;
    }
#undef T
    return LOOM_ERR_UNSUPPORTED;
}

/* Offers matmul's W (t[1]) to prepare_weight; on success *t[1] becomes the prepared tensor,
 * which must keep W's dtype and shape. */
static loom_status prepare_w(loom_device *d, test_case *tc, loom_tensor *t, loom_tensor *prepared,
                             char *msg, size_t msg_size)
{
    loom_status st = d->ops.prepare_weight(d->be, &t[1], prepared);
    if (st == LOOM_ERR_UNSUPPORTED)
        return LOOM_OK;
    if (st != LOOM_OK) {
        snprintf(msg, msg_size, "prepare_weight: status %d: %s", st, d->ops.last_error(d->be));
        return st;
    }
    tc->prepared = 1;
    if (!prepared->buf || prepared->dtype != t[1].dtype ||
        memcmp(prepared->ne, t[1].ne, sizeof t[1].ne) != 0) {
        snprintf(msg, msg_size,
                 "prepare_weight returned a %s [%lld, %lld] tensor%s for a %s "
                 "[%lld, %lld] weight",
                 loom_dtype_name(prepared->dtype), (long long)prepared->ne[0],
                 (long long)prepared->ne[1], prepared->buf ? "" : " without a buffer",
                 loom_dtype_name(t[1].dtype), (long long)t[1].ne[0], (long long)t[1].ne[1]);
        return LOOM_ERR_INVALID;
    }
    loom_tensor w = t[1];
    t[1] = *prepared;
    *prepared = w; /* keeps the original for the check that it is untouched */
    return LOOM_OK;
}

/* Uploads the case, runs it, downloads every output into out[i] (malloc'd). On failure returns
 * non-OK with msg set. */
static loom_status run_case(loom_device *d, test_case *tc, unsigned char **out, char *msg,
                            size_t msg_size)
{
    loom_buffer *bufs[MAX_TENSORS] = {0};
    loom_tensor t[MAX_TENSORS], original_w;
    loom_status st = LOOM_OK;
    msg[0] = 0;
    tc->prepared = 0;
    for (int i = 0; i < MAX_TENSORS && st == LOOM_OK; i++) {
        if (!tc->t[i].used)
            continue;
        st = d->ops.buffer_alloc(d->be, tc->t[i].bytes, &bufs[i]);
        if (st == LOOM_OK)
            st = d->ops.copy_from_host(d->be, bufs[i], 0, tc->t[i].host, tc->t[i].bytes);
        spec_tensor(&tc->t[i], bufs[i], &t[i]);
    }
    if (st == LOOM_OK && tc->prepare_w && d->ops.prepare_weight)
        st = prepare_w(d, tc, t, &original_w, msg, msg_size);
    if (st == LOOM_OK)
        st = call_op(d, tc, t);
    if (st == LOOM_OK)
        st = d->ops.synchronize(d->be);
    for (int i = 0; i < MAX_TENSORS && st == LOOM_OK; i++) {
        if (!tc->t[i].used || !tc->t[i].output)
            continue;
        out[i] = malloc(tc->t[i].bytes);
        st = out[i] ? d->ops.copy_to_host(d->be, out[i], bufs[i], 0, tc->t[i].bytes)
                    : LOOM_ERR_OUT_OF_MEMORY;
    }
    if (st == LOOM_OK && tc->prepared) { /* W itself must be as uploaded */
        const spec *w = &tc->t[1];
        unsigned char *now = malloc(w->bytes);
        st = now ? d->ops.copy_to_host(d->be, now, bufs[1], 0, w->bytes) : LOOM_ERR_OUT_OF_MEMORY;
        if (st == LOOM_OK && memcmp(now, w->host, w->bytes) != 0) {
            snprintf(msg, msg_size, "prepare_weight changed the original weight's bytes");
            st = LOOM_ERR_INVALID;
        }
        free(now);
    }
    if (st != LOOM_OK && !msg[0])
        snprintf(msg, msg_size, "status %d: %s", st, d->ops.last_error(d->be));
    if (tc->prepared)
        d->ops.buffer_free(d->be, t[1].buf);
    for (int i = 0; i < MAX_TENSORS; i++)
        if (bufs[i])
            d->ops.buffer_free(d->be, bufs[i]);
    return st;
}

/* Normalised error sqrt(sum (a-b)^2 / sum b^2) of output tensor s, over its rows only (the
 * padding between rows is checked separately: a backend must not write it). */
typedef struct cmp {
    double nerr;
    int nonfinite;
    int pad_written;
} cmp;

static cmp compare(const spec *s, const unsigned char *a, const unsigned char *b,
                   const unsigned char *input_image, const double *magnitude)
{
    cmp c = {0, 0, 0};
    int64_t n = s->ne[0];
    float *ra = malloc((size_t)n * sizeof *ra), *rb = malloc((size_t)n * sizeof *rb);
    double num = 0, den = 0;
    for (int64_t r = 0; r < spec_rows(s); r++) {
        get_row(s, a, r, ra);
        get_row(s, b, r, rb);
        for (int64_t i = 0; i < n; i++) {
            if (!isfinite(ra[i]) && isfinite(rb[i]))
                c.nonfinite = 1;
            num += ((double)ra[i] - rb[i]) * ((double)ra[i] - rb[i]);
            double scale = magnitude ? magnitude[r * n + i] : rb[i];
            den += scale * scale;
        }
    }
    c.nerr = den > 0 ? sqrt(num / den) : sqrt(num);
    /* bytes outside the rows must be as uploaded */
    uint64_t rb_bytes = (uint64_t)loom_row_bytes(s->dtype, s->ne[0]);
    unsigned char *in_row = calloc(s->bytes, 1);
    for (int64_t r = 0; in_row && r < spec_rows(s); r++)
        memset(in_row + spec_row_at(s, r), 1, rb_bytes);
    for (uint64_t i = 0; in_row && i < s->bytes && !c.pad_written; i++)
        if (!in_row[i] && a[i] != input_image[i])
            c.pad_written = 1;
    free(in_row);
    free(ra), free(rb);
    return c;
}

/* Runs one case on both devices and judges it; returns 1 when it passes. */
static int judge_case(loom_device *target, loom_device *ref, test_case *tc, char *why,
                      size_t why_size)
{
    unsigned char *out_t[MAX_TENSORS] = {0}, *out_r[MAX_TENSORS] = {0};
    char msg[1024];
    int ok = 1;
    if (run_case(ref, tc, out_r, msg, sizeof msg) != LOOM_OK) {
        snprintf(why, why_size, "the reference failed (%.900s): a bug in ref or this tool", msg);
        ok = 0;
    } else if (run_case(target, tc, out_t, msg, sizeof msg) != LOOM_OK) {
        snprintf(why, why_size, "%s", msg);
        ok = 0;
    }
    for (int i = 0; i < MAX_TENSORS && ok; i++) {
        const spec *s = &tc->t[i];
        if (!s->used || !s->output)
            continue;
        cmp c;
        if (tc->quality_vs_input) {
            /* both quantisations judged by how well they reproduce the input */
            const spec in = tc->t[0];
            double e_t = 0, e_r = 0, den = 0;
            float *x = malloc((size_t)s->ne[0] * 4), *a = malloc((size_t)s->ne[0] * 4),
                  *b = malloc((size_t)s->ne[0] * 4);
            for (int64_t r = 0; r < spec_rows(s); r++) {
                get_row(&in, in.host, r, x);
                get_row(s, out_t[i], r, a);
                get_row(s, out_r[i], r, b);
                for (int64_t k = 0; k < s->ne[0]; k++) {
                    e_t += ((double)a[k] - x[k]) * ((double)a[k] - x[k]);
                    e_r += ((double)b[k] - x[k]) * ((double)b[k] - x[k]);
                    den += (double)x[k] * x[k];
                }
            }
            free(x), free(a), free(b);
            c = compare(s, out_t[i], out_r[i], s->host, NULL);
            double nt = sqrt(e_t / den), nr = sqrt(e_r / den);
            if (nt > nr * tc->tol + 1e-7) {
                snprintf(why, why_size, "round-trip error %.3g, reference %.3g", nt, nr);
                ok = 0;
            }
        } else {
            c = compare(s, out_t[i], out_r[i], s->host, tc->magnitude);
            if (!(c.nerr <= tc->tol)) {
                snprintf(why, why_size, "normalised error %.3g > %.3g", c.nerr, tc->tol);
                ok = 0;
            }
        }
        if (ok && c.nonfinite) {
            snprintf(why, why_size, "inf/nan where the reference is finite");
            ok = 0;
        }
        if (ok && c.pad_written) {
            snprintf(why, why_size, "wrote outside the output's rows (padding or offset bytes)");
            ok = 0;
        }
    }
    for (int i = 0; i < MAX_TENSORS; i++)
        free(out_t[i]), free(out_r[i]);
    return ok;
}

static void check_ops(loom_device *target, loom_device *ref, report *r)
{
    for (size_t f = 0; f < (size_t)conformance_n_families; f++) {
        const case_family *fam = &conformance_families[f];
        for (int di = 0; di < N_DTYPES; di++) {
            loom_dtype dt = all_dtypes[di];
            const char *op = loom_op_name(fam->op), *dtn = loom_dtype_name(dt);
            int applies = conformance_op_dtype_applies(fam->op, dt);
            /* a claim the contract does not define, or without a function, is one the host
             * would route work to and then see refused (or run on the CPU) */
            char why[256] = "";
            if (!applies)
                snprintf(why, sizeof why,
                         "but the ABI defines no %s of %s (backend.h's loom_check_* refuses "
                         "it): say no",
                         op, dtn);
            else if (!loom_device_op_present(target, fam->op))
                snprintf(why, sizeof why,
                         "but the ops table has no %s function (NULL): loom runs it on the CPU "
                         "instead; say no, or fill the pointer",
                         op);
            if (why[0] && target->ops.supports(target->be, fam->op, dt)) {
                char name[160];
                snprintf(name, sizeof name, "%s %s: supports() says yes", op, dtn);
                record(r, name, 0, "%s", why);
                r->matrix[fam->op][di] = RES_FAIL;
                continue;
            }
            if (!applies)
                continue;
            if (!loom_device_supports(target, fam->op, dt)) {
                r->matrix[fam->op][di] = RES_UNSUPPORTED;
                continue;
            }
            result res = RES_PASS;
            for (int v = 0; v < fam->n_variants; v++) {
                test_case tc;
                memset(&tc, 0, sizeof tc);
                tc.op = fam->op;
                tc.dtype = dt;
                fam->make(&tc, dt, v);
                if (tc.op == LOOM_OP_COUNT || tc.abi_minor > target->module.abi_minor) {
                    /* the variant does not apply to this dtype, or is newer than the module */
                    free_case(&tc);
                    continue;
                }
                char name[256], why[1024] = "";
                snprintf(name, sizeof name, "%s %s %s", loom_op_name(fam->op), loom_dtype_name(dt),
                         tc.label);
                int ok = judge_case(target, ref, &tc, why, sizeof why);
                record(r, name, ok, ok ? NULL : "%s", why);
                if (!ok)
                    res = RES_FAIL;
                free_case(&tc);
            }
            r->matrix[fam->op][di] = res;
        }
    }
}

/* A row of a quantised type must be whole blocks: a W (or get_rows source) whose rows are 128
 * elements of a 256-element type is malformed, and the module must refuse it with an error,
 * not read past its rows or crash. */
static void check_partial_blocks(loom_device *target, report *r)
{
    for (int di = 0; di < N_DTYPES; di++) {
        loom_dtype dt = all_dtypes[di];
        if (loom_dtype_block_elems(dt) <= LOOM_QK)
            continue;
        for (int get_rows = 0; get_rows < 2; get_rows++) {
            loom_op op = get_rows ? LOOM_OP_GET_ROWS : LOOM_OP_MATMUL;
            if (!loom_device_supports(target, op, dt))
                continue;
            enum { K = 128, N = 4 };
            loom_buffer *bx = NULL, *bw = NULL, *by = NULL;
            loom_status st = target->ops.buffer_alloc(target->be, 4096, &bx);
            if (st == LOOM_OK)
                st = target->ops.buffer_alloc(target->be, 4096, &bw);
            if (st == LOOM_OK)
                st = target->ops.buffer_alloc(target->be, 4096, &by);
            int32_t ids[1] = {1};
            if (st == LOOM_OK && get_rows)
                st = target->ops.copy_from_host(target->be, bx, 0, ids, sizeof ids);
            loom_tensor x = {bx,
                             0,
                             get_rows ? LOOM_I32 : LOOM_F32,
                             2,
                             {get_rows ? 1 : K, 1, 1, 1},
                             {4, get_rows ? 4 : 4 * K, 4 * K, 4 * K}};
            loom_tensor w = {
                bw,           0,
                dt,           2,
                {K, N, 1, 1}, {(uint64_t)loom_dtype_block_bytes(dt), 256, 256 * N, 256 * N}};
            loom_tensor y = {
                by, 0, LOOM_F32, 2, {get_rows ? K : N, 1, 1, 1}, {4, 4 * K, 4 * K, 4 * K}};
            if (st == LOOM_OK) {
                if (get_rows) {
                    loom_get_rows_params p = {sizeof p, &w, &x, &y};
                    st = loom_device_run(target, op, &p);
                } else {
                    loom_matmul_params p = {sizeof p, &x, &w, &y, NULL};
                    st = loom_device_run(target, op, &p);
                }
                if (st == LOOM_OK)
                    st = target->ops.synchronize(target->be);
            }
            char name[160];
            snprintf(name, sizeof name,
                     "%s %s with rows of %d elements (not whole %lld-element "
                     "blocks) is refused",
                     loom_op_name((loom_op)op), loom_dtype_name(dt), K,
                     (long long)loom_dtype_block_elems(dt));
            record(r, name, st != LOOM_OK, st != LOOM_OK ? NULL : "%s",
                   "the module ran it (status 0)");
            loom_buffer *bufs[3] = {bx, bw, by};
            for (int i = 0; i < 3; i++)
                if (bufs[i])
                    target->ops.buffer_free(target->be, bufs[i]);
        }
    }
}

/* Matmuls whose W first went through the module's prepare_weight, against the reference with
 * W as it is: shapes whose rows come in multiples of 8 and 16 (what interleaving layouts want),
 * odd block counts, and some that a module may decline. */
static void check_prepared(loom_device *target, loom_device *ref, report *r)
{
    if (!target->ops.prepare_weight) {
        if (!r->quiet)
            printf("prepare_weight: not offered (matmuls use weights as they are)\n");
        return;
    }
    /* {13, 96, 80}: a prefill whose rows, columns and groups (5 of 16 rows, 10 of 8) all leave
     * a remainder in the tiles and blocks of an F16/BF16 W widened for prefill; {14, 75, 32}:
     * the same with an odd K, whose last BF16 pair is half padding */
    static const int64_t shapes[][3] = {{1, 64, 16},   {1, 96, 32},    {3, 256, 48}, {4, 128, 64},
                                        {17, 160, 32}, {64, 512, 128}, {2, 64, 8},   {1, 64, 7},
                                        {3, 37, 16},   {13, 96, 80},   {14, 75, 32}};
    for (int di = 0; di < N_DTYPES; di++) {
        loom_dtype dt = all_dtypes[di];
        if (!conformance_op_dtype_applies(LOOM_OP_MATMUL, dt) ||
            !loom_device_supports(target, LOOM_OP_MATMUL, dt))
            continue;
        int n_prepared = 0, n_tried = 0;
        for (size_t v = 0; v < sizeof shapes / sizeof shapes[0]; v++) {
            if (shapes[v][1] % loom_dtype_block_elems(dt))
                continue; /* K must be whole blocks */
            n_tried++;
            test_case tc;
            memset(&tc, 0, sizeof tc);
            tc.op = LOOM_OP_MATMUL;
            tc.dtype = dt;
            make_matmul_shape(&tc, dt, shapes[v][0], shapes[v][1], shapes[v][2], v == 4);
            tc.prepare_w = 1;
            char name[256], why[1024] = "";
            snprintf(name, sizeof name, "matmul %s %s, W offered to prepare_weight",
                     loom_dtype_name(dt), tc.label);
            int ok = judge_case(target, ref, &tc, why, sizeof why);
            n_prepared += tc.prepared;
            record(r, name, ok, ok ? NULL : "%s", why);
            free_case(&tc);
        }
        if (!r->quiet)
            printf("prepare_weight %s: a layout of its own for %d of %d shapes\n",
                   loom_dtype_name(dt), n_prepared, n_tried);
    }
    if (target->module.abi_minor < 6)
        return; /* expert stacks are offered to ABI 1.6 modules only */
    /* matmul_id over a stack that went through prepare_weight whole (ABI 1.6): rows per expert
     * in multiples of 16 and 8, and one (9) that a layout of groups may decline; then calls
     * that busy many experts at once (a module may share those out by whole experts): a decode
     * step's 8 of 16, a prefill chunk's gathered rows, and the down projection's x per slot */
    static const matmul_id_shape stacks[] = {{1, 8, 2, 64, 32, 0, 0},  {7, 4, 2, 256, 16, 0, 0},
                                             {5, 6, 3, 32, 48, 1, 0},  {3, 5, 2, 512, 16, 0, 1},
                                             {2, 4, 2, 64, 9, 0, 0},   {1, 16, 8, 64, 32, 0, 0},
                                             {16, 8, 2, 64, 32, 0, 0}, {10, 6, 3, 64, 32, 1, 0}};
    for (int di = 0; di < N_DTYPES; di++) {
        loom_dtype dt = all_dtypes[di];
        if (!conformance_op_dtype_applies(LOOM_OP_MATMUL_ID, dt) ||
            !loom_device_supports(target, LOOM_OP_MATMUL_ID, dt))
            continue;
        int n_prepared = 0, n_tried = 0;
        for (size_t v = 0; v < sizeof stacks / sizeof stacks[0]; v++) {
            test_case tc;
            memset(&tc, 0, sizeof tc);
            tc.op = LOOM_OP_MATMUL_ID;
            tc.dtype = dt;
            make_matmul_id_shape(&tc, dt, &stacks[v]);
            if (tc.op == LOOM_OP_COUNT) {
                free_case(&tc);
                continue; /* K is not whole blocks of dt */
            }
            n_tried++;
            tc.prepare_w = 1;
            char name[256], why[1024] = "";
            snprintf(name, sizeof name, "matmul_id %s %s, the stack offered to prepare_weight",
                     loom_dtype_name(dt), tc.label);
            int ok = judge_case(target, ref, &tc, why, sizeof why);
            n_prepared += tc.prepared;
            record(r, name, ok, ok ? NULL : "%s", why);
            free_case(&tc);
        }
        if (!r->quiet)
            printf("prepare_weight %s expert stacks: a layout of its own for %d of %d shapes\n",
                   loom_dtype_name(dt), n_prepared, n_tried);
    }
}

static void print_matrix(const report *r, const char *label)
{
    printf("\n| %s |", label);
    for (int di = 0; di < N_DTYPES - 1; di++)
        printf(" %s |", loom_dtype_name(all_dtypes[di]));
    printf("\n|---|");
    for (int di = 0; di < N_DTYPES - 1; di++)
        printf("---|");
    printf("\n");
    for (int op = 0; op < LOOM_OP_COUNT; op++) {
        printf("| %s |", loom_op_name((loom_op)op));
        for (int di = 0; di < N_DTYPES - 1; di++) {
            static const char *cell[] = {"", "pass", "**FAIL**", "-"};
            printf(" %s |", cell[r->matrix[op][di]]);
        }
        printf("\n");
    }
    printf("\n(pass: all cases within tolerance; -: the backend says it does not support it; "
           "blank: not applicable)\n");
}

static cJSON *matrix_json(const report *r)
{
    cJSON *m = cJSON_CreateObject();
    for (int op = 0; op < LOOM_OP_COUNT; op++) {
        cJSON *row = cJSON_AddObjectToObject(m, loom_op_name((loom_op)op));
        for (int di = 0; di < N_DTYPES; di++) {
            static const char *cell[] = {NULL, "pass", "fail", "unsupported"};
            if (r->matrix[op][di] != RES_NONE)
                cJSON_AddStringToObject(row, loom_dtype_name(all_dtypes[di]),
                                        cell[r->matrix[op][di]]);
        }
    }
    return m;
}

/* ---- Main ------------------------------------------------------------------------------- */

typedef enum { MODULE_PASSED, MODULE_FAILED, MODULE_SKIPPED } module_outcome;

/* Writes a skipped module's entry: the probe found nothing for it to run on here. */
static module_outcome skip_module(const char *path, const loom_candidate *c, cJSON *json_out)
{
    char label[160];
    snprintf(label, sizeof label, "%s%s%s (ABI %u.%u)", c->name, c->variant[0] ? "-" : "",
             c->variant, c->abi_major, c->abi_minor);
    printf("  skipped: %s is unusable here: %s\n", label, c->reason);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "path", path);
    cJSON_AddStringToObject(o, "backend", label);
    cJSON_AddBoolToObject(o, "skipped", 1);
    cJSON_AddStringToObject(o, "reason", c->reason);
    cJSON_AddItemToArray(json_out, o);
    return MODULE_SKIPPED;
}

/* Checks one module file. A module that is unusable on this machine is skipped unless
 * require_usable; one that does not load or declares another ABI always fails. */
static module_outcome check_module(const char *path, const char *ref_path, int quiet,
                                   int require_usable, const char *const *models, int n_models,
                                   cJSON *json_out)
{
    report r;
    memset(&r, 0, sizeof r);
    r.quiet = quiet;
    r.checks = cJSON_CreateArray();
    printf("\n## %s\n\n", path);

    /* ABI negotiation, as the loader does it */
    loom_registry one = {.opts = loom_loader_options_from_env(), .chosen = -1};
    char err[4096] = "";
    const loom_candidate *c = NULL;
    if (loom_registry_add_file(&one, path, err, sizeof err) == 0)
        c = &one.items[0];
    if (c && c->state == LOOM_CAND_UNUSABLE && !require_usable) {
        module_outcome skipped = skip_module(path, c, json_out);
        cJSON_Delete(r.checks);
        loom_registry_free(&one);
        return skipped;
    }
    int usable = c && c->state == LOOM_CAND_USABLE;
    uint32_t kind = c ? c->kind : LOOM_MODULE_BACKEND; /* kept past the registry's free */
    record(&r, "loads, declares a compatible ABI and probes usable", usable, "%s%s%s",
           c ? loom_candidate_state_name(c->state) : err, c && c->reason[0] ? ": " : "",
           c ? c->reason : "");
    char label[160] = "?";
    if (c && c->name[0])
        snprintf(label, sizeof label, "%s%s%s (ABI %u.%u)", c->name, c->variant[0] ? "-" : "",
                 c->variant, c->abi_major, c->abi_minor);

    loom_device target, ref;
    int have_target = 0, have_ref = 0;
    if (usable) {
        have_target = open_target(&target, path, kind, ref_path, err, sizeof err) == 0;
        record(&r,
               kind == LOOM_MODULE_DECORATOR ? "opens around ref (a decorator)" : "opens device 0",
               have_target, have_target ? NULL : "%s", err);
    }
    if (have_target) {
        have_ref = loom_device_open(&ref, ref_path, 0, 0, err, sizeof err) == 0;
        if (!have_ref)
            record(&r, "open the reference backend", 0, "%s", err);
    }
    if (have_target) {
        /* a module that cannot keep its own error string is unusable for diagnosis */
        const char *e = target.ops.last_error(target.be);
        record(&r, "last_error returns a string", e != NULL, e ? NULL : "it returned NULL");
        check_copies(&target, &r);
        check_oom(&target, &r);
        if (have_ref) {
            check_ops(&target, &ref, &r);
            check_partial_blocks(&target, &r);
            check_prepared(&target, &ref, &r);
        }
        /* models run with a cache the module stores itself, so its kv_store and attention
         * are the ones tested */
        const char *kv_type = loom_device_supports(&target, LOOM_OP_KV_STORE, LOOM_F16) ? "f16"
            : loom_device_supports(&target, LOOM_OP_KV_STORE, LOOM_F32)                 ? "f32"
                                                                                        : "f16";
        loom_device_close(&target);
        check_reload(path, kind, ref_path, &r);
        /* a model runs on a backend module; a decorator wraps one only when loom opens it */
        for (int i = 0; have_ref && kind == LOOM_MODULE_BACKEND && i < n_models; i++)
            check_model(path, ref_path, models[i], kv_type, &r);
    }
    if (have_ref)
        loom_device_close(&ref);
    loom_registry_free(&one);

    print_matrix(&r, label);
    printf("\n%s: %d check(s) failed\n", label, r.failures);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "path", path);
    cJSON_AddStringToObject(o, "backend", label);
    cJSON_AddStringToObject(o, "kind", kind == LOOM_MODULE_DECORATOR ? "decorator" : "backend");
    cJSON_AddBoolToObject(o, "pass", r.failures == 0);
    cJSON_AddNumberToObject(o, "failures", r.failures);
    cJSON_AddItemToObject(o, "matrix", matrix_json(&r));
    cJSON_AddItemToObject(o, "checks", r.checks);
    cJSON_AddItemToArray(json_out, o);
    return r.failures ? MODULE_FAILED : MODULE_PASSED;
}

int main(int argc, char **argv)
{
    const char *json_path = NULL, *ref_path = NULL, *models[8];
    int quiet = 0, require_usable = 0, version = 0, n_named = 0;
    loom_flag_list model_list = {models, 0, 8};
    const char **named = calloc((size_t)argc + 1, sizeof *named);
    char model_help[256];
    snprintf(model_help, sizeof model_help,
             "also run a model (GGUF file or Hugging Face folder; repeatable)\n"
             "on each module and on ref: a short prefill and %d greedy steps,\n"
             "logits compared at each (ops the module lacks run on the CPU)",
             MODEL_STEPS);
    const loom_flag flags[] = {
        {"--json", NULL, LOOM_FLAG_TEXT, &json_path, 0, 0, "FILE",
         "also write a JSON report to FILE ('-' for stdout)"},
        {"--ref", NULL, LOOM_FLAG_TEXT, &ref_path, 0, 0, "PATH",
         "the reference module to compare with (default: the one found)"},
        {"--model", NULL, LOOM_FLAG_REPEAT, &model_list, 0, 0, "MODEL", model_help},
        {"--quiet", NULL, LOOM_FLAG_SWITCH, &quiet, 0, 0, NULL,
         "print only failures, the matrix and the summary"},
        {"--require-usable", NULL, LOOM_FLAG_SWITCH, &require_usable, 0, 0, NULL,
         "a module unusable on this machine fails (default: skipped, with\n"
         "its probe's reason)"},
        {"--version", NULL, LOOM_FLAG_SWITCH, &version, 0, 0, NULL,
         "loom's version and backend ABI"},
    };
    const loom_command cmd = {
        .name = "loom-conformance",
        .synopsis = "[--json FILE] [--ref PATH] [--model MODEL ...] [--quiet]\n"
                    "                        [--require-usable] [BACKEND.so|NAME ...]\n"
                    "Checks backend modules against loom's backend ABI and the reference "
                    "backend.\nWith no BACKEND, checks every usable module found (see `loom "
                    "backends`). NAME is\na backend name (every variant: `cpu`) or NAME-VARIANT "
                    "(`cpu-avx2`).",
        .flags = flags,
        .n_flags = LOOM_N_FLAGS(flags),
        .positional = named,
        .max_positional = argc,
        .n_positional = &n_named,
        .epilogue = "Exit status: 0 when every module checked passes (and at least one was "
                    "checked),\n1 when a check fails or nothing could be checked, 2 on a usage "
                    "error."};
    int parsed = named ? loom_args_parse(&cmd, argc - 1, argv + 1) : 2;
    if (parsed || version) {
        if (version)
            printf("loom-conformance (loom) %s\nbackend ABI %d.%d\n", loom_version(),
                   LOOM_BACKEND_ABI_MAJOR, LOOM_BACKEND_ABI_MINOR);
        free(named);
        return parsed == 1 ? 0 : parsed;
    }
    int n_models = model_list.n;

    loom_registry reg;
    char err[4096];
    loom_loader_options lo = loom_loader_options_from_env();
    if (loom_registry_scan(&reg, &lo, err, sizeof err) != 0) {
        fprintf(stderr, "loom-conformance: %s\n", err);
        free(named);
        return 2;
    }
    if (!ref_path) {
        for (int i = 0; i < reg.count && !ref_path; i++)
            if (strcmp(reg.items[i].name, "ref") == 0 && reg.items[i].state == LOOM_CAND_USABLE)
                ref_path = reg.items[i].path;
        if (!ref_path) {
            fprintf(stderr,
                    "loom-conformance: the reference backend (ref) was not found in %s; "
                    "install loom's backends or pass --ref PATH/loom-ref.so\n",
                    reg.search_path);
            loom_registry_free(&reg);
            free(named);
            return 2;
        }
    }

    /* the modules to check: paths as given, names resolved through the registry */
    const char **targets = calloc((size_t)(argc + reg.count + 1), sizeof *targets);
    int n_targets = 0;
    if (n_named > 0) {
        for (int i = 0; i < n_named; i++) {
            if (strchr(named[i], '/') || strstr(named[i], ".so")) {
                targets[n_targets++] = named[i];
                continue;
            }
            int found = 0;
            for (int k = 0; k < reg.count; k++) {
                const loom_candidate *c = &reg.items[k];
                char full[160];
                snprintf(full, sizeof full, "%s-%s", c->name, c->variant);
                if (strcmp(c->name, named[i]) == 0 || strcmp(full, named[i]) == 0) {
                    targets[n_targets++] = c->path;
                    found = 1;
                }
            }
            if (!found) {
                fprintf(stderr, "loom-conformance: no backend named '%s' (see `loom backends`)\n",
                        named[i]);
                free(targets);
                free(named);
                loom_registry_free(&reg);
                return 2;
            }
        }
    } else {
        for (int k = 0; k < reg.count; k++)
            if (reg.items[k].state == LOOM_CAND_USABLE)
                targets[n_targets++] = reg.items[k].path;
    }

    printf("# loom-conformance (backend ABI %d.%d), reference: %s\n", LOOM_BACKEND_ABI_MAJOR,
           LOOM_BACKEND_ABI_MINOR, ref_path);
    cJSON *json = cJSON_CreateArray();
    int outcomes[3] = {0};
    for (int i = 0; i < n_targets; i++)
        outcomes[check_module(targets[i], ref_path, quiet, require_usable, models, n_models,
                              json)]++;
    int checked = outcomes[MODULE_PASSED] + outcomes[MODULE_FAILED];
    printf("\n%d module(s) checked, %d failed, %d skipped (unusable here)\n", checked,
           outcomes[MODULE_FAILED], outcomes[MODULE_SKIPPED]);

    int rc = outcomes[MODULE_FAILED] || checked == 0 ? 1 : 0;
    if (json_path) {
        cJSON *root = cJSON_CreateObject();
        cJSON_AddNumberToObject(root, "abi_major", LOOM_BACKEND_ABI_MAJOR);
        cJSON_AddNumberToObject(root, "abi_minor", LOOM_BACKEND_ABI_MINOR);
        cJSON_AddStringToObject(root, "reference", ref_path);
        cJSON_AddBoolToObject(root, "pass", rc == 0);
        cJSON_AddItemToObject(root, "modules", json);
        char *s = cJSON_Print(root);
        FILE *f = strcmp(json_path, "-") == 0 ? stdout : fopen(json_path, "w");
        if (!f || !s || fprintf(f, "%s\n", s) < 0) {
            fprintf(stderr, "loom-conformance: cannot write %s\n", json_path);
            rc = 2;
        }
        if (f && f != stdout)
            fclose(f);
        free(s);
        cJSON_Delete(root);
    } else {
        cJSON_Delete(json);
    }
    if (checked == 0)
        fprintf(stderr, "loom-conformance: no module could be checked on this machine%s\n",
                outcomes[MODULE_SKIPPED] ? " (every one named is unusable here; see above)" : "");
    free(targets);
    free(named);
    loom_registry_free(&reg);
    return rc;
}
