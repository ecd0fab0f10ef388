/*
 * backends/ref/ref.c - the reference backend: plain, obviously correct C for every op.
 *
 * It is the oracle the conformance tool and the model tests compare every other backend with,
 * so it trades all speed for clarity: every op converts rows to float, computes in double, and
 * converts back. Every tensor is bounds-checked against its buffer before use, which makes it
 * a good place to catch a caller's bad descriptor.
 *
 * LOOM_REF_OPAQUE=1 makes its buffers pretend not to be host-visible (no buffer_host_ptr, no
 * buffer_wrap_host), so the suite can prove that loom never reads backend memory directly.
 * LOOM_REF_DENY=OP[:DTYPE],... makes `supports` deny those ops (all dtypes, or one), so the
 * suite can prove that loom runs a model on a backend that lacks ops.
 * LOOM_REF_PREPARE=copy makes prepare_weight return a plain copy of the weight, and =oom makes
 * it fail for want of memory, so the suite can check the runner's use of prepared weights and
 * its retreat to the file's layout on any backend's terms; unset, ref keeps weights as they are.
 *
 * Like every backend it includes only the public ABI header.
 */
#include <loom/backend.h>

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- State ------------------------------------------------------------------------------ */

struct loom_buffer {
    unsigned char *data;
    uint64_t size;
    int wrapped; /* data belongs to the caller */
};

typedef struct ref_backend {
    loom_backend base;
    char error[512];
    unsigned char denied[LOOM_OP_COUNT][32];                  /* LOOM_REF_DENY, by op and dtype */
    enum { PREPARE_NONE, PREPARE_COPY, PREPARE_OOM } prepare; /* LOOM_REF_PREPARE */
} ref_backend;

static loom_status fail(loom_backend *be, loom_status st, const char *fmt, ...)
{
    ref_backend *rb = (ref_backend *)be;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(rb->error, sizeof rb->error, fmt, ap);
    va_end(ap);
    return st;
}

/* ---- Tensor access ---------------------------------------------------------------------- */

static int64_t n_rows(const loom_tensor *t)
{
    return t->ne[1] * t->ne[2] * t->ne[3];
}

/* Checks that t is well formed and lies inside its buffer; names it `what` in the error. */
static loom_status check_tensor(loom_backend *be, const loom_tensor *t, const char *what)
{
    if (!t || !t->buf)
        return fail(be, LOOM_ERR_INVALID, "%s: missing tensor or buffer", what);
    int64_t rb = loom_row_bytes(t->dtype, t->ne[0]);
    if (rb < 0)
        return fail(be, LOOM_ERR_INVALID, "%s: %s row of %lld elements is not whole blocks", what,
                    loom_dtype_name(t->dtype), (long long)t->ne[0]);
    uint64_t extent = (uint64_t)rb;
    for (int i = 0; i < 4; i++) {
        if (t->ne[i] < 0)
            return fail(be, LOOM_ERR_INVALID, "%s: negative dimension", what);
        if (t->ne[i] == 0)
            return LOOM_OK; /* empty: touches nothing */
        if (i > 0)
            extent += (uint64_t)(t->ne[i] - 1) * t->nb[i];
    }
    if (t->offset > t->buf->size || extent > t->buf->size - t->offset)
        return fail(be, LOOM_ERR_INVALID,
                    "%s: tensor spans bytes [%llu, %llu) but its buffer holds %llu", what,
                    (unsigned long long)t->offset, (unsigned long long)(t->offset + extent),
                    (unsigned long long)t->buf->size);
    return LOOM_OK;
}

static unsigned char *row_ptr(const loom_tensor *t, int64_t r)
{
    int64_t i1 = r % t->ne[1], i2 = r / t->ne[1] % t->ne[2], i3 = r / t->ne[1] / t->ne[2];
    return t->buf->data + t->offset + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
}

static void load_row(const loom_tensor *t, int64_t r, float *out)
{
    loom_row_to_f32(t->dtype, row_ptr(t, r), out, t->ne[0]);
}

static void store_row(const loom_tensor *t, int64_t r, const float *in)
{
    loom_row_from_f32(t->dtype, in, row_ptr(t, r), t->ne[0]);
}

static int32_t load_i32(const loom_tensor *t, int64_t i)
{
    int32_t v;
    memcpy(&v, t->buf->data + t->offset + i * t->nb[0], 4);
    return v;
}

static int is_float_dtype(loom_dtype t)
{
    return t == LOOM_F32 || t == LOOM_F16 || t == LOOM_BF16;
}

static int is_block_dtype(loom_dtype t)
{
    return t == LOOM_Q8_0 || t == LOOM_Q4_0 || t == LOOM_Q4_1;
}

static int same_shape(const loom_tensor *a, const loom_tensor *b)
{
    return a->ne[0] == b->ne[0] && n_rows(a) == n_rows(b);
}

static float *scratch(size_t n)
{
    return malloc((n ? n : 1) * sizeof(float));
}

#define CHECK(expr)                                                                                \
    do {                                                                                           \
        loom_status st_ = (expr);                                                                  \
        if (st_ != LOOM_OK)                                                                        \
            return st_;                                                                            \
    } while (0)

#define REQUIRE_DTYPE(be, t, dt, what)                                                             \
    do {                                                                                           \
        if ((t)->dtype != (dt))                                                                    \
            return fail(be, LOOM_ERR_INVALID, "%s must be %s, not %s", what, loom_dtype_name(dt),  \
                        loom_dtype_name((t)->dtype));                                              \
    } while (0)

#define NO_MEMORY(be) fail(be, LOOM_ERR_OUT_OF_MEMORY, "host out of memory for scratch rows")

/* ---- Ops -------------------------------------------------------------------------------- */

static loom_status ref_matmul(loom_backend *be, const loom_matmul_params *p)
{
    CHECK(check_tensor(be, p->x, "matmul x"));
    CHECK(check_tensor(be, p->w, "matmul w"));
    CHECK(check_tensor(be, p->y, "matmul y"));
    REQUIRE_DTYPE(be, p->x, LOOM_F32, "matmul x");
    REQUIRE_DTYPE(be, p->y, LOOM_F32, "matmul y");
    if (p->w->dtype == LOOM_I32)
        return fail(be, LOOM_ERR_UNSUPPORTED, "matmul: i32 weights");
    int64_t M = n_rows(p->x), K = p->x->ne[0], N = n_rows(p->w);
    if (p->w->ne[0] != K || p->y->ne[0] != N || n_rows(p->y) != M)
        return fail(be, LOOM_ERR_INVALID, "matmul: x is [%lld,%lld], w [%lld,%lld], y [%lld,%lld]",
                    (long long)M, (long long)K, (long long)N, (long long)p->w->ne[0],
                    (long long)n_rows(p->y), (long long)p->y->ne[0]);
    if (p->bias) {
        CHECK(check_tensor(be, p->bias, "matmul bias"));
        REQUIRE_DTYPE(be, p->bias, LOOM_F32, "matmul bias");
        if (p->bias->ne[0] != N)
            return fail(be, LOOM_ERR_INVALID, "matmul: bias has %lld elements, not N = %lld",
                        (long long)p->bias->ne[0], (long long)N);
    }
    if (M == 0 || N == 0)
        return LOOM_OK;
    float *x = scratch((size_t)(M * K)), *w = scratch((size_t)K), *y = scratch((size_t)(M * N));
    float *bias = scratch((size_t)N);
    if (!x || !w || !y || !bias) {
        free(x), free(w), free(y), free(bias);
        return NO_MEMORY(be);
    }
    for (int64_t m = 0; m < M; m++)
        load_row(p->x, m, x + m * K);
    if (p->bias)
        load_row(p->bias, 0, bias);
    for (int64_t n = 0; n < N; n++) {
        load_row(p->w, n, w);
        for (int64_t m = 0; m < M; m++) {
            double acc = p->bias ? bias[n] : 0.0;
            for (int64_t k = 0; k < K; k++)
                acc += (double)x[m * K + k] * w[k];
            y[m * N + n] = (float)acc;
        }
    }
    for (int64_t m = 0; m < M; m++)
        store_row(p->y, m, y + m * N);
    free(x), free(w), free(y), free(bias);
    return LOOM_OK;
}

static loom_status ref_get_rows(loom_backend *be, const loom_get_rows_params *p)
{
    CHECK(check_tensor(be, p->src, "get_rows src"));
    CHECK(check_tensor(be, p->ids, "get_rows ids"));
    CHECK(check_tensor(be, p->dst, "get_rows dst"));
    REQUIRE_DTYPE(be, p->ids, LOOM_I32, "get_rows ids");
    REQUIRE_DTYPE(be, p->dst, LOOM_F32, "get_rows dst");
    int64_t n = p->ids->ne[0], K = p->src->ne[0], rows = n_rows(p->src);
    if (p->dst->ne[0] != K || n_rows(p->dst) != n)
        return fail(be, LOOM_ERR_INVALID, "get_rows: dst must be [%lld, %lld]", (long long)n,
                    (long long)K);
    float *row = scratch((size_t)K);
    if (!row)
        return NO_MEMORY(be);
    for (int64_t i = 0; i < n; i++) {
        int32_t id = load_i32(p->ids, i);
        if (id < 0 || id >= rows) {
            free(row);
            return fail(be, LOOM_ERR_INVALID, "get_rows: id %d at %lld is outside [0, %lld)", id,
                        (long long)i, (long long)rows);
        }
        load_row(p->src, id, row);
        store_row(p->dst, i, row);
    }
    free(row);
    return LOOM_OK;
}

static loom_status norm(loom_backend *be, const loom_norm_params *p, int layer)
{
    const char *name = layer ? "layer_norm" : "rms_norm";
    CHECK(check_tensor(be, p->x, name));
    CHECK(check_tensor(be, p->dst, name));
    REQUIRE_DTYPE(be, p->x, LOOM_F32, "norm x");
    REQUIRE_DTYPE(be, p->dst, LOOM_F32, "norm dst");
    int64_t n = p->x->ne[0], rows = n_rows(p->x);
    if (!same_shape(p->x, p->dst))
        return fail(be, LOOM_ERR_INVALID, "%s: dst shape differs from x", name);
    const loom_tensor *params[2] = {p->weight, layer ? p->bias : NULL};
    for (int i = 0; i < 2; i++) {
        if (!params[i])
            continue;
        CHECK(check_tensor(be, params[i], name));
        REQUIRE_DTYPE(be, params[i], LOOM_F32, "norm weight/bias");
        if (params[i]->ne[0] != n)
            return fail(be, LOOM_ERR_INVALID, "%s: weight/bias length %lld, rows have %lld", name,
                        (long long)params[i]->ne[0], (long long)n);
    }
    float *x = scratch((size_t)n), *w = scratch((size_t)n), *b = scratch((size_t)n);
    if (!x || !w || !b) {
        free(x), free(w), free(b);
        return NO_MEMORY(be);
    }
    for (int64_t i = 0; i < n; i++)
        w[i] = 1.0f, b[i] = 0.0f;
    if (p->weight)
        load_row(p->weight, 0, w);
    if (layer && p->bias)
        load_row(p->bias, 0, b);
    for (int64_t r = 0; r < rows; r++) {
        load_row(p->x, r, x);
        double mean = 0.0, sq = 0.0;
        if (layer) {
            for (int64_t i = 0; i < n; i++)
                mean += x[i];
            mean /= (double)n;
        }
        for (int64_t i = 0; i < n; i++)
            sq += (x[i] - mean) * (x[i] - mean);
        double inv = 1.0 / sqrt(sq / (double)n + p->eps);
        for (int64_t i = 0; i < n; i++)
            x[i] = (float)((x[i] - mean) * inv * w[i] + b[i]);
        store_row(p->dst, r, x);
    }
    free(x), free(w), free(b);
    return LOOM_OK;
}

static loom_status ref_rms_norm(loom_backend *be, const loom_norm_params *p)
{
    return norm(be, p, 0);
}

static loom_status ref_layer_norm(loom_backend *be, const loom_norm_params *p)
{
    return norm(be, p, 1);
}

/* Rotates pairs (v[i], v[i + stride]) for i in [0, n/2) when stride > 1 ("rotate half", with
 * stride n/2), or (v[2i], v[2i+1]) when stride is 1 (adjacent pairs). */
/* factors: n / 2 divisors of the pairs' frequencies, or NULL */
static void rotate(float *v, int n, int adjacent, double pos, double base, const float *factors)
{
    for (int i = 0; i < n / 2; i++) {
        double theta = pos * pow(base, -2.0 * i / n) / (factors ? (double)factors[i] : 1.0);
        double c = cos(theta), s = sin(theta);
        int a = adjacent ? 2 * i : i, b = adjacent ? 2 * i + 1 : i + n / 2;
        double x0 = v[a], x1 = v[b];
        v[a] = (float)(x0 * c - x1 * s);
        v[b] = (float)(x0 * s + x1 * c);
    }
}

static loom_status ref_rope(loom_backend *be, const loom_rope_params *p)
{
    CHECK(check_tensor(be, p->x, "rope x"));
    CHECK(check_tensor(be, p->pos, "rope pos"));
    CHECK(check_tensor(be, p->dst, "rope dst"));
    REQUIRE_DTYPE(be, p->x, LOOM_F32, "rope x");
    REQUIRE_DTYPE(be, p->dst, LOOM_F32, "rope dst");
    REQUIRE_DTYPE(be, p->pos, LOOM_I32, "rope pos");
    int64_t hd = p->x->ne[0], heads = p->x->ne[1], tokens = p->x->ne[2] * p->x->ne[3];
    if (!same_shape(p->x, p->dst))
        return fail(be, LOOM_ERR_INVALID, "rope: dst shape differs from x");
    if (p->pos->ne[0] != tokens)
        return fail(be, LOOM_ERR_INVALID, "rope: %lld positions for %lld tokens",
                    (long long)p->pos->ne[0], (long long)tokens);
    if (p->n_rot <= 0 || p->n_rot % 2 || p->n_rot > hd)
        return fail(be, LOOM_ERR_INVALID, "rope: n_rot %d must be even and in (0, %lld]", p->n_rot,
                    (long long)hd);
    if (p->mode == LOOM_ROPE_GLM_2D) {
        if (!p->pos2 || p->n_rot != hd || hd % 4)
            return fail(be, LOOM_ERR_INVALID,
                        "rope glm_2d: needs pos2, n_rot == head_dim, head_dim a multiple of 4");
        CHECK(check_tensor(be, p->pos2, "rope pos2"));
        REQUIRE_DTYPE(be, p->pos2, LOOM_I32, "rope pos2");
        if (p->pos2->ne[0] != tokens)
            return fail(be, LOOM_ERR_INVALID, "rope: pos2 length differs from tokens");
    } else if (p->mode != LOOM_ROPE_NEOX && p->mode != LOOM_ROPE_ADJACENT) {
        return fail(be, LOOM_ERR_INVALID, "rope: unknown mode %d", p->mode);
    }
    float *factors = NULL;
    if (p->freq_factors) {
        if (p->freq_factors->dtype != LOOM_F32 || p->freq_factors->ne[0] != p->n_rot / 2 ||
            p->mode == LOOM_ROPE_GLM_2D)
            return fail(be, LOOM_ERR_INVALID,
                        "rope: freq_factors must be f32 [n_rot / 2], and glm_2d takes none");
        CHECK(check_tensor(be, p->freq_factors, "rope freq_factors"));
        if (!(factors = scratch((size_t)p->n_rot / 2)))
            return NO_MEMORY(be);
        load_row(p->freq_factors, 0, factors);
    }
    float *v = scratch((size_t)hd);
    if (!v) {
        free(factors);
        return NO_MEMORY(be);
    }
    for (int64_t t = 0; t < tokens; t++) {
        double pos = (double)load_i32(p->pos, t) * p->freq_scale;
        for (int64_t h = 0; h < heads; h++) {
            int64_t r = t * heads + h;
            load_row(p->x, r, v);
            if (p->mode == LOOM_ROPE_GLM_2D) {
                double pos2 = (double)load_i32(p->pos2, t) * p->freq_scale;
                rotate(v, (int)hd / 2, 0, pos, p->freq_base, NULL);
                rotate(v + hd / 2, (int)hd / 2, 0, pos2, p->freq_base, NULL);
            } else {
                rotate(v, p->n_rot, p->mode == LOOM_ROPE_ADJACENT, pos, p->freq_base, factors);
            }
            store_row(p->dst, r, v);
        }
    }
    free(v);
    free(factors);
    return LOOM_OK;
}

typedef enum { EW_ADD, EW_MUL, EW_SCALE, EW_SILU_MUL, EW_GELU, EW_SIGMOID_MUL } ew_kind;

static loom_status elementwise(loom_backend *be, const loom_elementwise_params *p, ew_kind kind)
{
    static const char *names[] = {"add", "mul", "scale", "silu_mul", "gelu", "sigmoid_mul"};
    int binary = kind == EW_ADD || kind == EW_MUL || kind == EW_SILU_MUL || kind == EW_SIGMOID_MUL;
    CHECK(check_tensor(be, p->a, names[kind]));
    CHECK(check_tensor(be, p->dst, names[kind]));
    REQUIRE_DTYPE(be, p->a, LOOM_F32, "elementwise a");
    REQUIRE_DTYPE(be, p->dst, LOOM_F32, "elementwise dst");
    if (!same_shape(p->a, p->dst))
        return fail(be, LOOM_ERR_INVALID, "%s: dst shape differs from a", names[kind]);
    int64_t n = p->a->ne[0], rows = n_rows(p->a);
    int broadcast = 0;
    if (binary) {
        CHECK(check_tensor(be, p->b, names[kind]));
        REQUIRE_DTYPE(be, p->b, LOOM_F32, "elementwise b");
        broadcast = (kind == EW_ADD || kind == EW_MUL) && n_rows(p->b) == 1 && rows != 1;
        if (p->b->ne[0] != n || (!broadcast && n_rows(p->b) != rows))
            return fail(be, LOOM_ERR_INVALID, "%s: b must match a or be one row of %lld",
                        names[kind], (long long)n);
    }
    float *a = scratch((size_t)n), *b = scratch((size_t)n);
    if (!a || !b) {
        free(a), free(b);
        return NO_MEMORY(be);
    }
    for (int64_t r = 0; r < rows; r++) {
        load_row(p->a, r, a);
        if (binary)
            load_row(p->b, broadcast ? 0 : r, b);
        for (int64_t i = 0; i < n; i++) {
            double x = a[i];
            switch (kind) {
            case EW_ADD: x = x + b[i]; break;
            case EW_MUL: x = x * b[i]; break;
            case EW_SCALE: x = x * p->scale; break;
            case EW_SILU_MUL: x = x / (1.0 + exp(-x)) * b[i]; break;
            case EW_SIGMOID_MUL: x = b[i] / (1.0 + exp(-x)); break;
            case EW_GELU:
                x = 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
                break;
            }
            a[i] = (float)x;
        }
        store_row(p->dst, r, a);
    }
    free(a), free(b);
    return LOOM_OK;
}

static loom_status ref_add(loom_backend *be, const loom_elementwise_params *p)
{
    return elementwise(be, p, EW_ADD);
}
static loom_status ref_mul(loom_backend *be, const loom_elementwise_params *p)
{
    return elementwise(be, p, EW_MUL);
}
static loom_status ref_scale(loom_backend *be, const loom_elementwise_params *p)
{
    return elementwise(be, p, EW_SCALE);
}
static loom_status ref_silu_mul(loom_backend *be, const loom_elementwise_params *p)
{
    return elementwise(be, p, EW_SILU_MUL);
}
static loom_status ref_gelu(loom_backend *be, const loom_elementwise_params *p)
{
    return elementwise(be, p, EW_GELU);
}
static loom_status ref_sigmoid_mul(loom_backend *be, const loom_elementwise_params *p)
{
    return elementwise(be, p, EW_SIGMOID_MUL);
}

static int is_cache_dtype(loom_dtype t)
{
    return t == LOOM_F32 || t == LOOM_F16 || t == LOOM_Q8_0;
}

static loom_status ref_kv_store(loom_backend *be, const loom_kv_store_params *p)
{
    CHECK(check_tensor(be, p->src, "kv_store src"));
    CHECK(check_tensor(be, p->slots, "kv_store slots"));
    CHECK(check_tensor(be, p->cache, "kv_store cache"));
    REQUIRE_DTYPE(be, p->src, LOOM_F32, "kv_store src");
    REQUIRE_DTYPE(be, p->slots, LOOM_I32, "kv_store slots");
    if (!is_cache_dtype(p->cache->dtype))
        return fail(be, LOOM_ERR_UNSUPPORTED, "kv_store: %s cache",
                    loom_dtype_name(p->cache->dtype));
    int64_t hd = p->src->ne[0], kvh = p->src->ne[1], tokens = p->src->ne[2] * p->src->ne[3];
    const loom_tensor *c = p->cache;
    int64_t n_slots = c->ne[2] * c->ne[3];
    if (c->ne[0] != hd || c->ne[1] != kvh || p->slots->ne[0] != tokens)
        return fail(be, LOOM_ERR_INVALID, "kv_store: src [%lld,%lld,%lld] does not fit the cache",
                    (long long)tokens, (long long)kvh, (long long)hd);
    float *row = scratch((size_t)hd);
    if (!row)
        return NO_MEMORY(be);
    for (int64_t t = 0; t < tokens; t++) {
        int32_t slot = load_i32(p->slots, t);
        if (slot < 0)
            continue;
        if (slot >= n_slots) {
            free(row);
            return fail(be, LOOM_ERR_INVALID, "kv_store: slot %d outside the cache's %lld", slot,
                        (long long)n_slots);
        }
        for (int64_t h = 0; h < kvh; h++) {
            load_row(p->src, t * kvh + h, row);
            store_row(c, (int64_t)slot * kvh + h, row);
        }
    }
    free(row);
    return LOOM_OK;
}

static loom_status ref_attention(loom_backend *be, const loom_attention_params *p)
{
    CHECK(check_tensor(be, p->q, "attention q"));
    CHECK(check_tensor(be, p->k_cache, "attention k_cache"));
    CHECK(check_tensor(be, p->v_cache, "attention v_cache"));
    CHECK(check_tensor(be, p->block_table, "attention block_table"));
    CHECK(check_tensor(be, p->seq, "attention seq"));
    CHECK(check_tensor(be, p->pos, "attention pos"));
    CHECK(check_tensor(be, p->dst, "attention dst"));
    REQUIRE_DTYPE(be, p->q, LOOM_F32, "attention q");
    REQUIRE_DTYPE(be, p->dst, LOOM_F32, "attention dst");
    REQUIRE_DTYPE(be, p->block_table, LOOM_I32, "attention block_table");
    REQUIRE_DTYPE(be, p->seq, LOOM_I32, "attention seq");
    REQUIRE_DTYPE(be, p->pos, LOOM_I32, "attention pos");
    const loom_tensor *kc = p->k_cache, *vc = p->v_cache;
    if (!is_cache_dtype(kc->dtype) || vc->dtype != kc->dtype)
        return fail(be, LOOM_ERR_UNSUPPORTED, "attention: %s/%s cache", loom_dtype_name(kc->dtype),
                    loom_dtype_name(vc->dtype));
    int64_t hd = p->q->ne[0], heads = p->q->ne[1], tokens = p->q->ne[2] * p->q->ne[3];
    int64_t kvh = kc->ne[1], bs = kc->ne[2], n_blocks = kc->ne[3];
    int64_t n_seqs = n_rows(p->block_table), max_blocks = p->block_table->ne[0];
    for (int i = 0; i < 4; i++)
        if (kc->ne[i] != vc->ne[i])
            return fail(be, LOOM_ERR_INVALID, "attention: k and v caches differ in shape");
    if (kc->ne[0] != hd || kvh <= 0 || heads % kvh || !same_shape(p->q, p->dst) ||
        p->seq->ne[0] != tokens || p->pos->ne[0] != tokens)
        return fail(be, LOOM_ERR_INVALID,
                    "attention: q [%lld,%lld,%lld] and cache [.., .., %lld, %lld] disagree",
                    (long long)tokens, (long long)heads, (long long)hd, (long long)kvh,
                    (long long)kc->ne[0]);
    if (p->prefix_len) {
        CHECK(check_tensor(be, p->prefix_len, "attention prefix_len"));
        REQUIRE_DTYPE(be, p->prefix_len, LOOM_I32, "attention prefix_len");
        if (p->prefix_len->ne[0] != n_seqs)
            return fail(be, LOOM_ERR_INVALID, "attention: prefix_len needs one entry per sequence");
    }
    int32_t window = p->struct_size >= offsetof(loom_attention_params, window) + sizeof p->window
        ? p->window
        : 0;
    if (window < 0 || (window > 0 && p->prefix_len))
        return fail(be, LOOM_ERR_INVALID,
                    "attention: window %d must be 0 or positive, and takes no prefix_len", window);
    int64_t group = heads / (kvh ? kvh : 1);
    float *q = scratch((size_t)hd), *k = scratch((size_t)hd), *v = scratch((size_t)hd);
    double *acc = malloc((size_t)(hd ? hd : 1) * sizeof(double));
    if (!q || !k || !v || !acc) {
        free(q), free(k), free(v), free(acc);
        return NO_MEMORY(be);
    }
    loom_status st = LOOM_OK;
    for (int64_t t = 0; t < tokens && st == LOOM_OK; t++) {
        int32_t s = load_i32(p->seq, t), pos = load_i32(p->pos, t);
        if (s < 0 || s >= n_seqs || pos < 0) {
            st = fail(be, LOOM_ERR_INVALID, "attention: token %lld has seq %d, pos %d",
                      (long long)t, s, pos);
            break;
        }
        int64_t last = pos; /* the last key this token sees */
        if (p->prefix_len) {
            int32_t pl = load_i32(p->prefix_len, s);
            if (pl - 1 > last)
                last = pl - 1;
        }
        if (last / bs >= max_blocks) {
            st = fail(be, LOOM_ERR_INVALID, "attention: position %lld beyond the block table",
                      (long long)last);
            break;
        }
        const unsigned char *bt_row = row_ptr(p->block_table, s);
        for (int64_t h = 0; h < heads; h++) {
            int64_t kh = h / group;
            load_row(p->q, t * heads + h, q);
            /* two passes: the running max first, so exp never overflows */
            double max = -INFINITY, sum = 0.0;
            for (int pass = 0; pass < 2; pass++) {
                for (int64_t i = 0; i < hd; i++)
                    acc[i] = 0.0;
                for (int64_t j = loom_attention_first_key(p, pos); j <= last; j++) {
                    int32_t blk;
                    memcpy(&blk, bt_row + (j / bs) * p->block_table->nb[0], 4);
                    if (blk < 0 || blk >= n_blocks) {
                        st = fail(be, LOOM_ERR_INVALID, "attention: block %d out of range", blk);
                        goto done;
                    }
                    int64_t r = ((int64_t)blk * bs + j % bs) * kvh + kh;
                    load_row(kc, r, k);
                    double score = 0.0;
                    for (int64_t i = 0; i < hd; i++)
                        score += (double)q[i] * k[i];
                    score *= p->scale;
                    if (pass == 0) {
                        max = score > max ? score : max;
                        continue;
                    }
                    double w = exp(score - max);
                    sum += w;
                    load_row(vc, r, v);
                    for (int64_t i = 0; i < hd; i++)
                        acc[i] += w * v[i];
                }
            }
            for (int64_t i = 0; i < hd; i++)
                q[i] = (float)(acc[i] / sum);
            store_row(p->dst, t * heads + h, q);
        }
    }
done:
    free(q), free(k), free(v), free(acc);
    return st;
}

/* quantize, dequantize and convert differ only in which dtype pairs they accept */
static loom_status convert_rows(loom_backend *be, const loom_convert_params *p, const char *name)
{
    CHECK(check_tensor(be, p->src, name));
    CHECK(check_tensor(be, p->dst, name));
    if (!same_shape(p->src, p->dst))
        return fail(be, LOOM_ERR_INVALID, "%s: src and dst shapes differ", name);
    int64_t n = p->src->ne[0], rows = n_rows(p->src);
    float *row = scratch((size_t)n);
    if (!row)
        return NO_MEMORY(be);
    for (int64_t r = 0; r < rows; r++) {
        load_row(p->src, r, row);
        store_row(p->dst, r, row);
    }
    free(row);
    return LOOM_OK;
}

static loom_status ref_quantize(loom_backend *be, const loom_convert_params *p)
{
    if (!p->src || !p->dst || p->src->dtype != LOOM_F32 || !is_block_dtype(p->dst->dtype))
        return fail(be, LOOM_ERR_INVALID, "quantize: needs f32 src and a block-type dst");
    return convert_rows(be, p, "quantize");
}

static loom_status ref_dequantize(loom_backend *be, const loom_convert_params *p)
{
    if (!p->src || !p->dst || !loom_dtype_is_quantized(p->src->dtype) || p->dst->dtype != LOOM_F32)
        return fail(be, LOOM_ERR_INVALID, "dequantize: needs a quantised src and f32 dst");
    return convert_rows(be, p, "dequantize");
}

static loom_status ref_convert(loom_backend *be, const loom_convert_params *p)
{
    if (!p->src || !p->dst || !is_float_dtype(p->src->dtype) || !is_float_dtype(p->dst->dtype))
        return fail(be, LOOM_ERR_INVALID, "convert: src and dst must be f32, f16 or bf16");
    return convert_rows(be, p, "convert");
}

/* ---- Mixture of experts ------------------------------------------------------------------ */

#define CHECK_ARGS(be, msg)                                                                        \
    do {                                                                                           \
        const char *m_ = (msg);                                                                    \
        if (m_)                                                                                    \
            return fail(be, LOOM_ERR_INVALID, "%s", m_);                                           \
    } while (0)

static int32_t load_i32_at(const loom_tensor *t, int64_t row, int64_t col)
{
    int32_t v;
    memcpy(&v, row_ptr(t, row) + col * (int64_t)t->nb[0], 4);
    return v;
}

static void store_i32_row(const loom_tensor *t, int64_t row, const int32_t *v, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        memcpy(row_ptr(t, row) + i * (int64_t)t->nb[0], &v[i], 4);
}

static loom_status ref_moe_route(loom_backend *be, const loom_moe_route_params *p)
{
    CHECK_ARGS(be, loom_check_moe_route(p));
    CHECK(check_tensor(be, p->logits, "moe_route logits"));
    CHECK(check_tensor(be, p->ids, "moe_route ids"));
    CHECK(check_tensor(be, p->weights, "moe_route weights"));
    if (p->bias)
        CHECK(check_tensor(be, p->bias, "moe_route bias"));
    int64_t E = p->logits->ne[0], k = p->ids->ne[0], T = n_rows(p->logits);
    int32_t groups, kept;
    loom_moe_route_groups(p, &groups, &kept);
    float *logit = scratch((size_t)E), *bias = scratch((size_t)E), *w = scratch((size_t)k);
    float *choice = scratch((size_t)E);
    double *score = malloc((size_t)E * sizeof *score);
    int32_t *ids = malloc((size_t)k * sizeof *ids);
    char *taken = malloc((size_t)E);
    unsigned char *keep = malloc((size_t)groups);
    if (!logit || !bias || !w || !choice || !score || !ids || !taken || !keep) {
        free(logit), free(bias), free(w), free(choice), free(score), free(ids), free(taken);
        free(keep);
        return NO_MEMORY(be);
    }
    if (p->bias)
        load_row(p->bias, 0, bias);
    for (int64_t t = 0; t < T; t++) {
        load_row(p->logits, t, logit);
        double max = logit[0], sum = 0;
        for (int64_t e = 1; e < E; e++)
            max = logit[e] > max ? logit[e] : max;
        for (int64_t e = 0; e < E; e++) {
            score[e] = p->gating == LOOM_MOE_SOFTMAX ? exp((double)logit[e] - max)
                                                     : 1.0 / (1.0 + exp(-(double)logit[e]));
            sum += score[e];
        }
        if (p->gating == LOOM_MOE_SOFTMAX)
            for (int64_t e = 0; e < E; e++)
                score[e] /= sum;
        if (groups > 1) { /* the experts outside the best groups count as taken */
            for (int64_t e = 0; e < E; e++)
                choice[e] = (float)(p->bias ? score[e] + bias[e] : logit[e]);
            loom_moe_groups_kept(choice, E, groups, kept, keep);
        }
        for (int64_t e = 0; e < E; e++)
            taken[e] = groups > 1 && !keep[e / (E / groups)];
        double chosen_sum = 0;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            double best_choice = 0;
            for (int64_t e = 0; e < E; e++) {
                double choice = p->bias ? score[e] + bias[e] : logit[e];
                if (!taken[e] && (best < 0 || choice > best_choice))
                    best = e, best_choice = choice;
            }
            taken[best] = 1;
            ids[j] = (int32_t)best;
            chosen_sum += score[best];
        }
        for (int64_t j = 0; j < k; j++)
            w[j] = (float)(score[ids[j]] / (p->normalize ? chosen_sum : 1.0) * p->scale);
        store_i32_row(p->ids, t, ids, k);
        store_row(p->weights, t, w);
    }
    free(logit), free(bias), free(w), free(choice), free(score), free(ids), free(taken);
    free(keep);
    return LOOM_OK;
}

static loom_status ref_matmul_id(loom_backend *be, const loom_matmul_id_params *p)
{
    CHECK_ARGS(be, loom_check_matmul_id(p));
    CHECK(check_tensor(be, p->x, "matmul_id x"));
    CHECK(check_tensor(be, p->w, "matmul_id w"));
    CHECK(check_tensor(be, p->ids, "matmul_id ids"));
    CHECK(check_tensor(be, p->y, "matmul_id y"));
    int64_t K = p->x->ne[0], N = p->w->ne[1], E = p->w->ne[2], k = p->ids->ne[0];
    int64_t T = n_rows(p->ids), x_slots = p->x->ne[1];
    float *x = scratch((size_t)K), *w = scratch((size_t)K), *y = scratch((size_t)N);
    if (!x || !w || !y) {
        free(x), free(w), free(y);
        return NO_MEMORY(be);
    }
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < k; j++) {
            int32_t e = load_i32_at(p->ids, t, j);
            if (e < 0 || e >= E) {
                free(x), free(w), free(y);
                return fail(be, LOOM_ERR_INVALID,
                            "matmul_id: expert id %d of token %lld is outside [0, %lld)", e,
                            (long long)t, (long long)E);
            }
            load_row(p->x, t * x_slots + (x_slots > 1 ? j : 0), x);
            for (int64_t n = 0; n < N; n++) {
                load_row(p->w, (int64_t)e * N + n, w);
                double acc = 0;
                for (int64_t i = 0; i < K; i++)
                    acc += (double)x[i] * w[i];
                y[n] = (float)acc;
            }
            store_row(p->y, t * k + j, y);
        }
    free(x), free(w), free(y);
    return LOOM_OK;
}

static loom_status ref_moe_combine(loom_backend *be, const loom_moe_combine_params *p)
{
    CHECK_ARGS(be, loom_check_moe_combine(p));
    CHECK(check_tensor(be, p->src, "moe_combine src"));
    CHECK(check_tensor(be, p->weights, "moe_combine weights"));
    CHECK(check_tensor(be, p->dst, "moe_combine dst"));
    int64_t n = p->src->ne[0], k = p->src->ne[1], T = n_rows(p->dst);
    float *src = scratch((size_t)n), *w = scratch((size_t)k), *dst = scratch((size_t)n);
    double *acc = malloc((size_t)(n ? n : 1) * sizeof *acc);
    if (!src || !w || !dst || !acc) {
        free(src), free(w), free(dst), free(acc);
        return NO_MEMORY(be);
    }
    for (int64_t t = 0; t < T; t++) {
        load_row(p->weights, t, w);
        if (p->accumulate)
            load_row(p->dst, t, dst);
        for (int64_t i = 0; i < n; i++)
            acc[i] = p->accumulate ? dst[i] : 0.0;
        for (int64_t j = 0; j < k; j++) {
            load_row(p->src, t * k + j, src);
            for (int64_t i = 0; i < n; i++)
                acc[i] += (double)w[j] * src[i];
        }
        for (int64_t i = 0; i < n; i++)
            dst[i] = (float)acc[i];
        store_row(p->dst, t, dst);
    }
    free(src), free(w), free(dst), free(acc);
    return LOOM_OK;
}

/* ---- Recurrent layers -------------------------------------------------------------------- */

/* Slot seq[t] of a [slots, ...] state, checked against its slots. */
static loom_status state_slot(loom_backend *be, const loom_tensor *seq, int64_t t, int64_t slots,
                              const char *what, int64_t *slot)
{
    int32_t s = load_i32(seq, t);
    if (s < 0 || s >= slots)
        return fail(be, LOOM_ERR_INVALID, "%s: token %lld's slot %d is outside the state's %lld",
                    what, (long long)t, s, (long long)slots);
    *slot = s;
    return LOOM_OK;
}

static loom_status ref_ssm_conv(loom_backend *be, const loom_ssm_conv_params *p)
{
    CHECK_ARGS(be, loom_check_ssm_conv(p));
    CHECK(check_tensor(be, p->x, "ssm_conv x"));
    CHECK(check_tensor(be, p->weight, "ssm_conv weight"));
    CHECK(check_tensor(be, p->seq, "ssm_conv seq"));
    CHECK(check_tensor(be, p->state, "ssm_conv state"));
    CHECK(check_tensor(be, p->dst, "ssm_conv dst"));
    const int64_t C = p->x->ne[0], K = p->weight->ne[0], T = n_rows(p->x);
    /* the window [kernel][channels]: the state's rows, then x[t] */
    float *win = scratch((size_t)(K * C)), *w = scratch((size_t)(K * C)), *y = scratch((size_t)C);
    if (!win || !w || !y) {
        free(win), free(w), free(y);
        return NO_MEMORY(be);
    }
    for (int64_t c = 0; c < C; c++)
        load_row(p->weight, c, w + c * K);
    for (int64_t t = 0; t < T; t++) {
        int64_t s = 0;
        loom_status st = state_slot(be, p->seq, t, p->state->ne[2], "ssm_conv", &s);
        if (st != LOOM_OK) {
            free(win), free(w), free(y);
            return st;
        }
        for (int64_t j = 0; j < K - 1; j++)
            load_row(p->state, s * (K - 1) + j, win + j * C);
        load_row(p->x, t, win + (K - 1) * C);
        for (int64_t c = 0; c < C; c++) {
            double acc = 0;
            for (int64_t j = 0; j < K; j++)
                acc += (double)w[c * K + j] * win[j * C + c];
            y[c] = (float)(acc / (1.0 + exp(-acc)));
        }
        store_row(p->dst, t, y);
        for (int64_t j = 0; j < K - 1; j++)
            store_row(p->state, s * (K - 1) + j, win + (j + 1) * C);
    }
    free(win), free(w), free(y);
    return LOOM_OK;
}

static double dot(const float *a, const float *b, int64_t n)
{
    double acc = 0;
    for (int64_t i = 0; i < n; i++)
        acc += (double)a[i] * b[i];
    return acc;
}

static loom_status ref_gated_delta(loom_backend *be, const loom_gated_delta_params *p)
{
    CHECK_ARGS(be, loom_check_gated_delta(p));
    const loom_tensor *all[] = {p->q, p->k,       p->v,   p->alpha, p->beta,
                                p->a, p->dt_bias, p->seq, p->state, p->dst};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        CHECK(check_tensor(be, all[i], "gated_delta"));
    const int64_t dk = p->q->ne[0], hk = p->q->ne[1], T = p->q->ne[2];
    const int64_t dv = p->v->ne[0], hv = p->v->ne[1];
    float *q = scratch((size_t)dk), *k = scratch((size_t)dk), *v = scratch((size_t)dv);
    float *S = scratch((size_t)(dv * dk)), *o = scratch((size_t)dv);
    float *alpha = scratch((size_t)hv), *beta = scratch((size_t)hv);
    float *a = scratch((size_t)hv), *dt = scratch((size_t)hv);
    loom_status st = LOOM_OK;
    if (!q || !k || !v || !S || !o || !alpha || !beta || !a || !dt) {
        st = NO_MEMORY(be);
        goto done;
    }
    load_row(p->a, 0, a);
    load_row(p->dt_bias, 0, dt);
    for (int64_t t = 0; t < T && st == LOOM_OK; t++) {
        int64_t s = 0;
        st = state_slot(be, p->seq, t, p->state->ne[3], "gated_delta", &s);
        if (st != LOOM_OK)
            break;
        load_row(p->alpha, t, alpha);
        load_row(p->beta, t, beta);
        for (int64_t h = 0; h < hv; h++) {
            const int64_t kh = loom_gated_delta_key_head(p, h, hk, hv);
            load_row(p->q, t * hk + kh, q);
            load_row(p->k, t * hk + kh, k);
            load_row(p->v, t * hv + h, v);
            double qn = 1.0 / sqrt(dot(q, q, dk) + 1e-6) / sqrt((double)dk);
            double kn = 1.0 / sqrt(dot(k, k, dk) + 1e-6);
            for (int64_t i = 0; i < dk; i++)
                q[i] = (float)(q[i] * qn), k[i] = (float)(k[i] * kn);
            double x = (double)alpha[h] + dt[h];
            double softplus = x > 20 ? x : log1p(exp(x));
            double decay = exp((double)a[h] * softplus), b = 1.0 / (1.0 + exp(-(double)beta[h]));
            /* S's column j is row j of the state */
            for (int64_t j = 0; j < dv; j++)
                load_row(p->state, (s * hv + h) * dv + j, S + j * dk);
            for (int64_t j = 0; j < dv; j++) {
                float *col = S + j * dk;
                for (int64_t i = 0; i < dk; i++)
                    col[i] = (float)(col[i] * decay);
                double delta = b * ((double)v[j] - dot(col, k, dk));
                for (int64_t i = 0; i < dk; i++)
                    col[i] = (float)(col[i] + k[i] * delta);
                o[j] = (float)dot(col, q, dk);
                store_row(p->state, (s * hv + h) * dv + j, col);
            }
            store_row(p->dst, t * hv + h, o);
        }
    }
done:
    free(q), free(k), free(v), free(S), free(o), free(alpha), free(beta), free(a), free(dt);
    return st;
}

/* ---- Buffers ---------------------------------------------------------------------------- */

/* Guards the uint64 -> size_t narrowing and keeps absurd requests from reaching malloc. */
static int size_ok(uint64_t size)
{
    return size <= (uint64_t)SIZE_MAX / 2;
}

static loom_status ref_buffer_alloc(loom_backend *be, uint64_t size, loom_buffer **out)
{
    loom_buffer *b = calloc(1, sizeof *b);
    if (b && size_ok(size))
        b->data = malloc(size ? (size_t)size : 1);
    if (!b || !b->data) {
        free(b);
        return fail(be, LOOM_ERR_OUT_OF_MEMORY, "cannot allocate %llu bytes of host memory",
                    (unsigned long long)size);
    }
    b->size = size;
    *out = b;
    return LOOM_OK;
}

static void ref_buffer_free(loom_backend *be, loom_buffer *b)
{
    (void)be;
    if (!b)
        return;
    if (!b->wrapped)
        free(b->data);
    free(b);
}

static void *ref_buffer_host_ptr(loom_backend *be, loom_buffer *b)
{
    (void)be;
    return b->data;
}

static loom_status ref_buffer_wrap_host(loom_backend *be, void *ptr, uint64_t size,
                                        loom_buffer **out)
{
    if (!ptr)
        return fail(be, LOOM_ERR_INVALID, "buffer_wrap_host: NULL pointer");
    loom_buffer *b = calloc(1, sizeof *b);
    if (!b)
        return NO_MEMORY(be);
    b->data = ptr;
    b->size = size;
    b->wrapped = 1;
    *out = b;
    return LOOM_OK;
}

static loom_status check_range(loom_backend *be, const loom_buffer *b, uint64_t off, uint64_t n,
                               const char *what)
{
    if (!b)
        return fail(be, LOOM_ERR_INVALID, "%s: NULL buffer", what);
    if (off > b->size || n > b->size - off)
        return fail(be, LOOM_ERR_INVALID, "%s: bytes [%llu, +%llu) outside a buffer of %llu", what,
                    (unsigned long long)off, (unsigned long long)n, (unsigned long long)b->size);
    return LOOM_OK;
}

static loom_status ref_buffer_memset(loom_backend *be, loom_buffer *b, uint64_t off, int value,
                                     uint64_t size)
{
    CHECK(check_range(be, b, off, size, "buffer_memset"));
    memset(b->data + off, value, (size_t)size);
    return LOOM_OK;
}

static loom_status ref_copy_from_host(loom_backend *be, loom_buffer *dst, uint64_t off,
                                      const void *src, uint64_t size)
{
    CHECK(check_range(be, dst, off, size, "copy_from_host"));
    if (size)
        memcpy(dst->data + off, src, (size_t)size);
    return LOOM_OK;
}

static loom_status ref_copy_to_host(loom_backend *be, void *dst, loom_buffer *src, uint64_t off,
                                    uint64_t size)
{
    CHECK(check_range(be, src, off, size, "copy_to_host"));
    if (size)
        memcpy(dst, src->data + off, (size_t)size);
    return LOOM_OK;
}

static loom_status ref_copy_buffer(loom_backend *be, loom_buffer *dst, uint64_t doff,
                                   loom_buffer *src, uint64_t soff, uint64_t size)
{
    CHECK(check_range(be, dst, doff, size, "copy_buffer dst"));
    CHECK(check_range(be, src, soff, size, "copy_buffer src"));
    if (size)
        memmove(dst->data + doff, src->data + soff, (size_t)size);
    return LOOM_OK;
}

static loom_status ref_synchronize(loom_backend *be)
{
    (void)be;
    return LOOM_OK;
}

/* ---- Capabilities and lifetime ---------------------------------------------------------- */

static int ref_supports(loom_backend *be, loom_op op, loom_dtype dt)
{
    if ((unsigned)op < LOOM_OP_COUNT && ((ref_backend *)be)->denied[op][dt & 31])
        return 0;
    switch (op) {
    case LOOM_OP_MATMUL:
    case LOOM_OP_GET_ROWS: return is_float_dtype(dt) || loom_dtype_is_quantized(dt);
    case LOOM_OP_KV_STORE:
    case LOOM_OP_ATTENTION: return is_cache_dtype(dt);
    case LOOM_OP_QUANTIZE: return loom_dtype_is_block(dt); /* the types with a quantiser */
    case LOOM_OP_DEQUANTIZE: return loom_dtype_is_quantized(dt);
    case LOOM_OP_CONVERT: return is_float_dtype(dt);
    case LOOM_OP_RMS_NORM:
    case LOOM_OP_LAYER_NORM:
    case LOOM_OP_ROPE:
    case LOOM_OP_ADD:
    case LOOM_OP_MUL:
    case LOOM_OP_SCALE:
    case LOOM_OP_SILU_MUL:
    case LOOM_OP_GELU:
    case LOOM_OP_MOE_ROUTE:
    case LOOM_OP_MOE_COMBINE: return dt == LOOM_F32;
    case LOOM_OP_MATMUL_ID: return is_float_dtype(dt) || loom_dtype_is_quantized(dt);
    case LOOM_OP_SIGMOID_MUL:
    case LOOM_OP_GATED_DELTA: return dt == LOOM_F32;
    case LOOM_OP_SSM_CONV: return is_float_dtype(dt);
    case LOOM_OP_COUNT: break;
    }
    return 0;
}

static const char *ref_last_error(loom_backend *be)
{
    return ((ref_backend *)be)->error;
}

/* A dense copy of w (LOOM_REF_PREPARE=copy): the same bytes, so the same results. */
static loom_status ref_prepare_weight(loom_backend *be, const loom_tensor *w, loom_tensor *out)
{
    ref_backend *rb = (ref_backend *)be;
    if (rb->prepare == PREPARE_NONE)
        return fail(be, LOOM_ERR_UNSUPPORTED, "prepare_weight: ref keeps weights as they are");
    if (rb->prepare == PREPARE_OOM)
        return fail(be, LOOM_ERR_OUT_OF_MEMORY,
                    "prepare_weight: out of memory "
                    "(LOOM_REF_PREPARE=oom)");
    CHECK(check_tensor(be, w, "prepare_weight w"));
    int64_t rows = n_rows(w);
    uint64_t row_bytes = (uint64_t)loom_row_bytes(w->dtype, w->ne[0]);
    loom_buffer *b;
    CHECK(ref_buffer_alloc(be, row_bytes * (uint64_t)rows, &b));
    for (int64_t r = 0; r < rows; r++)
        memcpy(b->data + (uint64_t)r * row_bytes, row_ptr(w, r), (size_t)row_bytes);
    *out = *w;
    out->buf = b;
    out->offset = 0;
    out->nb[1] = row_bytes;
    out->nb[2] = row_bytes * (uint64_t)w->ne[1];
    out->nb[3] = out->nb[2] * (uint64_t)w->ne[2];
    return LOOM_OK;
}

static void ref_close(loom_backend *be)
{
    free(be);
}

#define REF_OPS_COMMON                                                                             \
    .struct_size = sizeof(loom_backend_ops), .close = ref_close, .last_error = ref_last_error,     \
    .supports = ref_supports, .buffer_alloc = ref_buffer_alloc, .buffer_free = ref_buffer_free,    \
    .buffer_memset = ref_buffer_memset, .copy_from_host = ref_copy_from_host,                      \
    .copy_to_host = ref_copy_to_host, .copy_buffer = ref_copy_buffer,                              \
    .synchronize = ref_synchronize, .matmul = ref_matmul, .get_rows = ref_get_rows,                \
    .rms_norm = ref_rms_norm, .layer_norm = ref_layer_norm, .rope = ref_rope, .add = ref_add,      \
    .mul = ref_mul, .scale = ref_scale, .silu_mul = ref_silu_mul, .gelu = ref_gelu,                \
    .kv_store = ref_kv_store, .attention = ref_attention, .quantize = ref_quantize,                \
    .dequantize = ref_dequantize, .convert = ref_convert, .prepare_weight = ref_prepare_weight,    \
    .moe_route = ref_moe_route, .matmul_id = ref_matmul_id, .moe_combine = ref_moe_combine,        \
    .sigmoid_mul = ref_sigmoid_mul, .ssm_conv = ref_ssm_conv, .gated_delta = ref_gated_delta

static const loom_backend_ops ref_ops_host_visible = {
    REF_OPS_COMMON,
    .buffer_host_ptr = ref_buffer_host_ptr,
    .buffer_wrap_host = ref_buffer_wrap_host,
};

static const loom_backend_ops ref_ops_opaque = {REF_OPS_COMMON};

static int opaque_requested(void)
{
    const char *s = getenv("LOOM_REF_OPAQUE");
    return s && *s && strcmp(s, "0") != 0;
}

static void ref_probe(loom_probe_result *out)
{
    out->score = 1; /* always usable, always the last choice */
    out->n_devices = 1;
    loom_device_info *d = &out->devices[0];
    snprintf(d->name, sizeof d->name, "host (reference C)");
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    d->memory_bytes = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
    snprintf(d->detail, sizeof d->detail, "%s buffers",
             opaque_requested() ? "opaque (LOOM_REF_OPAQUE)" : "host-visible");
}

/* LOOM_REF_DENY: "matmul,attention:f16" denies matmul for every dtype and f16 attention. */
static int parse_deny(ref_backend *rb, const char *spec, char *err, size_t err_size)
{
    static const loom_dtype dtypes[] = {LOOM_F32,  LOOM_F16,  LOOM_BF16, LOOM_Q8_0,
                                        LOOM_Q4_0, LOOM_Q4_1, LOOM_I32};
    while (*spec) {
        size_t len = strcspn(spec, ","), name_len = strcspn(spec, ",:");
        int op = -1, dt = -1;
        for (int i = 0; i < LOOM_OP_COUNT; i++)
            if (strlen(loom_op_name((loom_op)i)) == name_len &&
                strncmp(spec, loom_op_name((loom_op)i), name_len) == 0)
                op = i;
        if (name_len < len) {
            const char *d = spec + name_len + 1;
            size_t dlen = len - name_len - 1;
            for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++)
                if (strlen(loom_dtype_name(dtypes[i])) == dlen &&
                    strncmp(d, loom_dtype_name(dtypes[i]), dlen) == 0)
                    dt = (int)dtypes[i];
        }
        if (op < 0 || (name_len < len && dt < 0)) {
            snprintf(err, err_size,
                     "LOOM_REF_DENY: '%.*s' is not OP or OP:DTYPE (ops: matmul, "
                     "get_rows, rms_norm, ..., convert; dtypes: f32, f16, bf16, q8_0, q4_0, q4_1)",
                     (int)len, spec);
            return -1;
        }
        for (int t = 0; t < 32; t++)
            if (dt < 0 || t == dt)
                rb->denied[op][t] = 1;
        spec += len;
        spec += *spec == ',';
    }
    return 0;
}

static loom_status ref_open(const loom_backend_options *opts, loom_backend **out, char *err,
                            size_t err_size)
{
    if (opts->device != 0) {
        snprintf(err, err_size, "ref has one device (0), not %d", opts->device);
        return LOOM_ERR_INVALID;
    }
    ref_backend *rb = calloc(1, sizeof *rb);
    if (!rb) {
        snprintf(err, err_size, "out of memory");
        return LOOM_ERR_OUT_OF_MEMORY;
    }
    const char *deny = getenv("LOOM_REF_DENY");
    if (deny && parse_deny(rb, deny, err, err_size) != 0) {
        free(rb);
        return LOOM_ERR_INVALID;
    }
    const char *prep = getenv("LOOM_REF_PREPARE");
    if (prep && *prep) {
        if (strcmp(prep, "copy") == 0)
            rb->prepare = PREPARE_COPY;
        else if (strcmp(prep, "oom") == 0)
            rb->prepare = PREPARE_OOM;
        else {
            snprintf(err, err_size, "LOOM_REF_PREPARE=%s is not 'copy' or 'oom'", prep);
            free(rb);
            return LOOM_ERR_INVALID;
        }
    }
    rb->base.ops = opaque_requested() ? &ref_ops_opaque : &ref_ops_host_visible;
    *out = &rb->base;
    return LOOM_OK;
}

static const loom_backend_module ref_module = {
    .struct_size = sizeof(loom_backend_module),
    .abi_major = LOOM_BACKEND_ABI_MAJOR,
    .abi_minor = LOOM_BACKEND_ABI_MINOR,
    .name = "ref",
    .variant = "",
    .description = "reference C, every op, slow; the oracle for the others",
    .probe = ref_probe,
    .open = ref_open,
};

LOOM_BACKEND_DEFINE_ENTRY(ref_module)
