/*
 * tools/conformance_cases.c - see conformance_cases.h.
 */
#define _GNU_SOURCE
#include "conformance_cases.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

uint32_t rng_u32(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}

static float rng_uniform(void) /* [-1, 1) */
{
    return (float)rng_u32() / 2147483648.0f - 1.0f;
}

static uint64_t spec_row_stride(const spec *s)
{
    return (uint64_t)loom_row_bytes(s->dtype, s->ne[0]) + s->row_pad;
}

int64_t spec_rows(const spec *s)
{
    return s->ne[1] * s->ne[2] * s->ne[3];
}

/* Byte strides: rows, then planes, then volumes, each with its padding; or, head_major, a
 * plane's rows (dim 2) adjacent and dim 1 outside them. */
static void spec_nb(const spec *s, uint64_t nb[4])
{
    uint64_t rs = spec_row_stride(s);
    nb[0] = (uint64_t)loom_dtype_block_bytes(s->dtype);
    if (s->head_major) {
        nb[2] = rs;
        nb[1] = rs * (uint64_t)s->ne[2] + s->plane_pad;
        nb[3] = nb[1] * (uint64_t)s->ne[1] + s->volume_pad;
    } else {
        nb[1] = rs;
        nb[2] = rs * (uint64_t)s->ne[1] + s->plane_pad;
        nb[3] = nb[2] * (uint64_t)s->ne[2] + s->volume_pad;
    }
}

void spec_tensor(const spec *s, loom_buffer *buf, loom_tensor *t)
{
    memset(t, 0, sizeof *t);
    t->buf = buf;
    t->offset = s->offset;
    t->dtype = s->dtype;
    t->n_dims = 4;
    for (int i = 0; i < 4; i++)
        t->ne[i] = s->ne[i];
    spec_nb(s, t->nb);
}

/* Byte offset of row r (counting over dims 1..3, dim 1 fastest, as backends number rows). */
uint64_t spec_row_at(const spec *s, int64_t r)
{
    uint64_t nb[4];
    spec_nb(s, nb);
    int64_t i1 = r % s->ne[1], i2 = r / s->ne[1] % s->ne[2], i3 = r / s->ne[1] / s->ne[2];
    return s->offset + (uint64_t)i1 * nb[1] + (uint64_t)i2 * nb[2] + (uint64_t)i3 * nb[3];
}

static unsigned char *spec_row(const spec *s, int64_t r)
{
    return s->host + spec_row_at(s, r);
}

/* Sets the buffer size from the layout: the end of the furthest row, and 8 spare bytes. */
static void spec_size(spec *s)
{
    uint64_t end = s->offset;
    for (int64_t r = 0; r < spec_rows(s); r++) {
        uint64_t e = spec_row_at(s, r) + (uint64_t)loom_row_bytes(s->dtype, s->ne[0]);
        end = e > end ? e : end;
    }
    s->bytes = end + 8;
}

/* Allocates the host image: padding bytes are filled with a pattern so reads of them show. */
static spec *add_spec(test_case *tc, int idx, loom_dtype dt, int64_t n0, int64_t n1, int64_t n2,
                      int64_t n3, int padded)
{
    spec *s = &tc->t[idx];
    memset(s, 0, sizeof *s);
    s->used = 1;
    s->dtype = dt;
    s->ne[0] = n0, s->ne[1] = n1, s->ne[2] = n2, s->ne[3] = n3;
    s->offset = padded ? 48 : 0;
    s->row_pad = padded ? 16 : 0;
    s->plane_pad = padded ? 64 : 0;  /* outer strides are not dense either: a backend that */
    s->volume_pad = padded ? 96 : 0; /* numbers rows as r * nb[1] fails here */
    spec_size(s);
    s->host = malloc(s->bytes);
    if (!s->host) {
        fprintf(stderr, "loom-conformance: out of memory\n");
        exit(2);
    }
    memset(s->host, 0xA5, s->bytes);
    return s;
}

/* Lays s out as the runner lays out its KV cache (dims 1 and 2 swapped in memory); call it
 * right after add_spec, before filling. */
static spec *head_major(spec *s)
{
    s->head_major = 1;
    spec_size(s);
    free(s->host);
    s->host = malloc(s->bytes);
    if (!s->host) {
        fprintf(stderr, "loom-conformance: out of memory\n");
        exit(2);
    }
    memset(s->host, 0xA5, s->bytes);
    return s;
}

/* Writes float values into row r of s, converting to its dtype. */
static void put_row(spec *s, int64_t r, const float *v)
{
    loom_row_from_f32(s->dtype, v, spec_row(s, r), s->ne[0]);
}

void get_row(const spec *s, const unsigned char *image, int64_t r, float *out)
{
    loom_row_to_f32(s->dtype, image + spec_row_at(s, r), out, s->ne[0]);
}

/* A type loom reads but does not write (ABI 1.2's): blocks of random bytes, every bit pattern
 * of quants and packed sub-block scales, with the f16 super-scales set to sane values of
 * either sign (random bytes there would be infinities and NaNs). */
static void fill_random_blocks(spec *s, float amp)
{
    int64_t rb = loom_row_bytes(s->dtype, s->ne[0]), bb = loom_dtype_block_bytes(s->dtype);
    size_t d = 0, dmin = (size_t)-1; /* offsets of the f16 scale and second scale/min */
    switch (s->dtype) {
    case LOOM_Q5_1: dmin = offsetof(loom_block_q5_1, m); break;
    case LOOM_Q2_K: d = offsetof(loom_block_q2_k, d), dmin = offsetof(loom_block_q2_k, dmin); break;
    case LOOM_Q3_K: d = offsetof(loom_block_q3_k, d); break;
    case LOOM_Q4_K: dmin = offsetof(loom_block_q4_k, dmin); break;
    case LOOM_Q5_K: dmin = offsetof(loom_block_q5_k, dmin); break;
    case LOOM_Q6_K: d = offsetof(loom_block_q6_k, d); break;
    default: break; /* q5_0, iq4_nl, iq4_xs: d first */
    }
    /* per-element magnitude: the K types multiply a 6-bit scale by up to 63-ish quants */
    float unit = amp / (loom_dtype_block_elems(s->dtype) > 32 ? 2000.0f : 16.0f);
    for (int64_t r = 0; r < spec_rows(s); r++) {
        unsigned char *row = spec_row(s, r);
        for (int64_t i = 0; i < rb; i++)
            row[i] = (unsigned char)rng_u32();
        for (int64_t b = 0; b < rb / bb; b++) {
            uint16_t h = loom_f32_to_f16(unit * rng_uniform());
            memcpy(row + b * bb + d, &h, 2);
            if (dmin != (size_t)-1) {
                h = loom_f32_to_f16(unit * rng_uniform());
                memcpy(row + b * bb + dmin, &h, 2);
            }
        }
    }
}

/* Fills every row with uniform values in [-amp, amp) (+ bias), converted to the dtype. */
static void fill_random(spec *s, float amp, float bias)
{
    if (loom_dtype_is_quantized(s->dtype) && !loom_dtype_is_block(s->dtype)) {
        fill_random_blocks(s, amp);
        return;
    }
    float *v = malloc((size_t)s->ne[0] * sizeof *v);
    for (int64_t r = 0; r < spec_rows(s); r++) {
        for (int64_t i = 0; i < s->ne[0]; i++)
            v[i] = bias + amp * rng_uniform();
        put_row(s, r, v);
        /* any int8 is a valid Q8_0 quant, and -128 (which quantising never writes) is where
         * kernels that move w's sign onto x can go wrong: one in every row */
        if (s->dtype == LOOM_Q8_0) {
            loom_block_q8_0 *blocks = (loom_block_q8_0 *)(void *)spec_row(s, r);
            blocks[r % (s->ne[0] / LOOM_QK)].qs[r % LOOM_QK] = -128;
        }
    }
    free(v);
}

static void fill_i32(spec *s, const int32_t *vals)
{
    memcpy(spec_row(s, 0), vals, (size_t)s->ne[0] * 4);
}

void free_case(test_case *tc)
{
    for (int i = 0; i < MAX_TENSORS; i++)
        free(tc->t[i].host);
    free(tc->magnitude);
    memset(tc, 0, sizeof *tc);
}

/* ---- The case catalogue ----------------------------------------------------------------- */

static double weight_tolerance(loom_dtype t)
{
    switch (t) {
    case LOOM_F32: return 1e-5;
    case LOOM_F16: return 2e-3;  /* a backend may round activations to f16 */
    case LOOM_BF16: return 1e-2; /* or to bf16 */
    default: return 1e-2;        /* block types: activations may be quantised to int8 */
    }
}


/* X [M, K] f32, W [N, K] of dtype dt, optional bias, Y [M, N] */
void make_matmul_shape(test_case *tc, loom_dtype dt, int64_t M, int64_t K, int64_t N, int bias)
{
    snprintf(tc->label, sizeof tc->label, "M=%lld K=%lld N=%lld%s", (long long)M, (long long)K,
             (long long)N, bias ? " +bias" : "");
    fill_random(add_spec(tc, 0, LOOM_F32, K, M, 1, 1, 1), 1.0f, 0.0f);
    fill_random(add_spec(tc, 1, dt, K, N, 1, 1, 1), 0.5f, 0.0f);
    if (bias)
        fill_random(add_spec(tc, 2, LOOM_F32, N, 1, 1, 1, 1), 1.0f, 0.0f);
    add_spec(tc, 3, LOOM_F32, N, M, 1, 1, 1)->output = 1;
    tc->tol = weight_tolerance(dt);
    /* a single dot product may cancel to near zero: judge errors against sum |x||w| */
    tc->magnitude = calloc((size_t)(M * N) + 1, sizeof(double));
    float *xr = malloc((size_t)K * sizeof(float)), *wr = malloc((size_t)K * sizeof(float));
    for (int64_t n = 0; n < N; n++) {
        get_row(&tc->t[1], tc->t[1].host, n, wr);
        for (int64_t m = 0; m < M; m++) {
            get_row(&tc->t[0], tc->t[0].host, m, xr);
            double sum = 0;
            for (int64_t k = 0; k < K; k++)
                sum += fabs((double)xr[k] * wr[k]);
            tc->magnitude[m * N + n] = sum;
        }
    }
    free(xr), free(wr);
}

static void make_matmul(test_case *tc, loom_dtype dt, int v)
{
    /* M, K, N; K odd only where the dtype allows it; {19, 768, 5}: tiles of 4 activation rows
     * and one of 3; {1, 512, 40}: one token (a decode step)
     * against whole 256-element super-blocks */
    static const int64_t shapes[][3] = {{1, 64, 1},    {1, 96, 33},   {3, 128, 17}, {0, 64, 8},
                                        {64, 256, 48}, {1027, 64, 7}, {5, 33, 7},   {2, 512, 19},
                                        {19, 768, 5},  {1, 512, 40}};
    int64_t M = shapes[v][0], K = shapes[v][1], N = shapes[v][2];
    if (K % loom_dtype_block_elems(dt)) { /* check_partial_blocks tries those */
        tc->op = LOOM_OP_COUNT;           /* not applicable */
        return;
    }
    make_matmul_shape(tc, dt, M, K, N, v == 2);
}

static void make_get_rows(test_case *tc, loom_dtype dt, int v)
{
    int64_t K = v == 2 ? 512 : v ? 64 : 32, rows = 9, n = v ? 5 : 1;
    if (K % loom_dtype_block_elems(dt)) {
        tc->op = LOOM_OP_COUNT;
        return;
    }
    int32_t ids[5] = {8, 0, 3, 3, 7};
    snprintf(tc->label, sizeof tc->label, "%lld ids from [%lld, %lld]", (long long)n,
             (long long)rows, (long long)K);
    fill_random(add_spec(tc, 0, dt, K, rows, 1, 1, 1), 1.0f, 0.0f);
    fill_i32(add_spec(tc, 1, LOOM_I32, n, 1, 1, 1, 0), ids);
    add_spec(tc, 2, LOOM_F32, K, n, 1, 1, 1)->output = 1;
    tc->tol = 1e-6;
}

static void make_norm(test_case *tc, loom_dtype dt, int v)
{
    (void)dt;
    /* v0-5: rows of mean square near 1 (v3-5 without weight); v6-8: 4-D [n, 3, 2, 2] rows of
     * mean square 1e-8, 1e-2 and 1e6 against eps 1e-5, 1e-2 and 1e-6, where eps outside the
     * square root, or none, or the wrong one shows */
    static const int64_t shapes[][2] = {{1, 64}, {7, 33}, {3, 4096}};
    static const float amps[] = {1e-4f, 0.1f, 1000.0f}, epss[] = {1e-5f, 1e-2f, 1e-6f};
    int64_t rows = shapes[v % 3][0], n = shapes[v % 3][1];
    int with_params = v < 3 || v >= 6, four_d = v >= 6;
    float amp = four_d ? amps[v - 6] : 2.0f;
    tc->eps = four_d ? epss[v - 6] : 1e-5f;
    if (four_d)
        rows = 12, n = 96;
    snprintf(tc->label, sizeof tc->label, "%s%s, rms %g, eps %g", four_d ? "[96, 3, 2, 2]" : "",
             with_params ? " weight+bias" : " no weight", (double)amp, (double)tc->eps);
    if (!four_d)
        snprintf(tc->label, sizeof tc->label, "[%lld, %lld]%s", (long long)rows, (long long)n,
                 with_params ? " weight+bias" : " no weight");
    if (four_d)
        fill_random(add_spec(tc, 0, LOOM_F32, n, 3, 2, 2, 1), amp, 0.0f);
    else
        fill_random(add_spec(tc, 0, LOOM_F32, n, rows, 1, 1, 1), 2.0f, 0.5f);
    if (with_params) {
        fill_random(add_spec(tc, 1, LOOM_F32, n, 1, 1, 1, 0), 0.5f, 1.0f);
        if (tc->op == LOOM_OP_LAYER_NORM)
            fill_random(add_spec(tc, 2, LOOM_F32, n, 1, 1, 1, 0), 0.5f, 0.0f);
    }
    if (four_d)
        add_spec(tc, 3, LOOM_F32, n, 3, 2, 2, 1)->output = 1;
    else
        add_spec(tc, 3, LOOM_F32, n, rows, 1, 1, 1)->output = 1;
    tc->tol = 1e-5;
}

static void make_rope(test_case *tc, loom_dtype dt, int v)
{
    (void)dt;
    /* mode, head_dim, n_rot, heads, tokens, base, scale */
    static const struct {
        int mode, hd, n_rot, heads, tokens;
        float base, scale;
    } r[] = {
        {LOOM_ROPE_NEOX, 64, 64, 4, 5, 10000.0f, 1.0f},
        {LOOM_ROPE_ADJACENT, 64, 64, 2, 3, 10000.0f, 1.0f},
        {LOOM_ROPE_NEOX, 80, 32, 3, 2, 1000000.0f, 0.25f},   /* partial rotary, scaled */
        {LOOM_ROPE_ADJACENT, 128, 64, 2, 4, 10000.0f, 1.0f}, /* ChatGLM2: half of each head */
        {LOOM_ROPE_GLM_2D, 64, 64, 2, 6, 10000.0f, 1.0f},
        /* ABI 1.4: per-pair frequency divisors (Llama 3.1's rope_freqs) */
        {LOOM_ROPE_NEOX, 64, 64, 3, 5, 500000.0f, 1.0f},
        {LOOM_ROPE_ADJACENT, 64, 48, 2, 4, 500000.0f, 1.0f},
    };
    int factors = v >= 5;
    static const char *modes[] = {"neox", "adjacent", "glm_2d"};
    tc->rope_mode = r[v].mode;
    tc->n_rot = r[v].n_rot;
    tc->freq_base = r[v].base;
    tc->freq_scale = r[v].scale;
    snprintf(tc->label, sizeof tc->label, "%s hd=%d n_rot=%d base=%g scale=%g%s", modes[r[v].mode],
             r[v].hd, r[v].n_rot, r[v].base, r[v].scale, factors ? " freq_factors" : "");
    fill_random(add_spec(tc, 0, LOOM_F32, r[v].hd, r[v].heads, r[v].tokens, 1, 1), 1.0f, 0.0f);
    int32_t pos[8], pos2[8];
    for (int i = 0; i < r[v].tokens; i++)
        pos[i] = i * 37 + 3, pos2[i] = i % 3;
    fill_i32(add_spec(tc, 1, LOOM_I32, r[v].tokens, 1, 1, 1, 0), pos);
    if (r[v].mode == LOOM_ROPE_GLM_2D)
        fill_i32(add_spec(tc, 2, LOOM_I32, r[v].tokens, 1, 1, 1, 0), pos2);
    add_spec(tc, 3, LOOM_F32, r[v].hd, r[v].heads, r[v].tokens, 1, 1)->output = 1;
    if (factors) {
        /* 1 for high frequencies, up to 8 for low ones, smooth between: Llama 3.1's shape */
        float f[64];
        for (int i = 0; i < r[v].n_rot / 2; i++)
            f[i] = 1.0f + 7.0f * (float)i / (float)(r[v].n_rot / 2 - 1);
        memcpy(spec_row(add_spec(tc, 4, LOOM_F32, r[v].n_rot / 2, 1, 1, 1, 0), 0), f,
               (size_t)(r[v].n_rot / 2) * sizeof f[0]);
        tc->abi_minor = 4;
    }
    tc->tol = 1e-5;
}

static void make_elementwise(test_case *tc, loom_dtype dt, int v)
{
    (void)dt;
    static const int64_t shapes[][2] = {{1, 1}, {5, 37}, {16, 4096}};
    int64_t rows = shapes[v % 3][0], n = shapes[v % 3][1];
    int binary = tc->op == LOOM_OP_ADD || tc->op == LOOM_OP_MUL || tc->op == LOOM_OP_SILU_MUL ||
        tc->op == LOOM_OP_SIGMOID_MUL;
    int broadcast = v == 3 && (tc->op == LOOM_OP_ADD || tc->op == LOOM_OP_MUL);
    if (tc->op == LOOM_OP_SIGMOID_MUL)
        tc->abi_minor = 8;
    if (v == 3 && !broadcast) {
        tc->op = LOOM_OP_COUNT;
        return;
    }
    if (v == 4) { /* 4-D [40, 3, 2, 2] with padding in every dimension */
        snprintf(tc->label, sizeof tc->label, "[40, 3, 2, 2]");
        fill_random(add_spec(tc, 0, LOOM_F32, 40, 3, 2, 2, 1), 4.0f, 0.0f);
        if (binary)
            fill_random(add_spec(tc, 1, LOOM_F32, 40, 3, 2, 2, 1), 2.0f, 0.0f);
        add_spec(tc, 2, LOOM_F32, 40, 3, 2, 2, 1)->output = 1;
        tc->scale = 0.37f;
        tc->tol = 1e-5;
        return;
    }
    if (v == 3)
        rows = 6, n = 40;
    snprintf(tc->label, sizeof tc->label, "[%lld, %lld]%s", (long long)rows, (long long)n,
             broadcast ? " b broadcast" : "");
    /* the widest shape reaches where exp() over- and underflows in SiLU and GELU */
    fill_random(add_spec(tc, 0, LOOM_F32, n, rows, 1, 1, 1), v == 2 ? 120.0f : 4.0f, 0.0f);
    if (binary)
        fill_random(add_spec(tc, 1, LOOM_F32, n, broadcast ? 1 : rows, 1, 1, 1), 2.0f, 0.0f);
    add_spec(tc, 2, LOOM_F32, n, rows, 1, 1, 1)->output = 1;
    tc->scale = 0.37f;
    tc->tol = 1e-5;
}

static void make_kv_store(test_case *tc, loom_dtype dt, int v)
{
    int64_t hd = 64, kvh = 2, bs = v ? 16 : 4, blocks = 5, tokens = v ? 7 : 3;
    snprintf(tc->label, sizeof tc->label, "%lld tokens into %lld blocks of %lld", (long long)tokens,
             (long long)blocks, (long long)bs);
    fill_random(add_spec(tc, 0, LOOM_F32, hd, kvh, tokens, 1, 1), 1.0f, 0.0f);
    int32_t slots[7] = {0, 5, (int32_t)(blocks * bs - 1), -1, 17, 18, 3};
    fill_i32(add_spec(tc, 1, LOOM_I32, tokens, 1, 1, 1, 0), slots);
    spec *c = add_spec(tc, 2, dt, hd, kvh, bs, blocks, 0);
    if (v == 2) { /* the runner's layout: a block's slots of one head together */
        head_major(c);
        snprintf(tc->label + strlen(tc->label), sizeof tc->label - strlen(tc->label),
                 ", the runner's head-major cache");
    }
    fill_random(c, 1.0f, 0.0f);
    c->output = 1;
    tc->tol = dt == LOOM_Q8_0 ? 1e-2 : 1e-6;
}

static void make_attention(test_case *tc, loom_dtype dt, int v)
{
    /* v0: decode, 2 sequences, GQA 4/2; v1: prefill chunk of one sequence, MQA 4/1;
     * v2: ChatGLM-6B style prefix-bidirectional prefill; v3: mixed batch. Head sizes and
     * block sizes vary so that backends' specialised paths (and the general one) all run. */
    /* v4, v5 (ABI 1.4): v0 and v3 again with a sliding window of 5 keys, whose first key lies
     * inside a block (so a backend's per-block walk must mask within it) */
    int window = v >= 4 ? 5 : 0;
    if (window)
        v = v == 4 ? 0 : 3, tc->window = window, tc->abi_minor = 4;
    static const int64_t head_dims[] = {64, 128, 96, 256}, block_sizes[] = {4, 16, 4, 8};
    int64_t hd = head_dims[v], heads = 4, kvh = v == 1 ? 1 : 2, bs = block_sizes[v], blocks = 12,
            max_blocks = 5;
    static const char *what[] = {"decode, 2 seqs, GQA 4/2", "prefill 6 tokens, MQA 4/1",
                                 "prefix-bidirectional prefill", "mixed prefill+decode"};
    snprintf(tc->label, sizeof tc->label, "%s, head_dim %lld, block %lld%s", what[v], (long long)hd,
             (long long)bs, window ? ", window 5" : "");
    int32_t seq[8], pos[8], ntok;
    int32_t table[2][5] = {{3, 7, 1, 10, 0}, {11, 2, 5, 4, 9}};
    int32_t prefix[2] = {5, 0};
    switch (v) {
    case 0: ntok = 2, seq[0] = 0, pos[0] = 13, seq[1] = 1, pos[1] = 6; break;
    case 1:
    case 2:
        ntok = 6;
        for (int i = 0; i < 6; i++)
            seq[i] = 0, pos[i] = i;
        break;
    default:
        ntok = 4;
        seq[0] = 1, pos[0] = 17, seq[1] = 0, pos[1] = 2, seq[2] = 0, pos[2] = 3, seq[3] = 0,
        pos[3] = 4;
    }
    fill_random(add_spec(tc, 0, LOOM_F32, hd, heads, ntok, 1, 1), 1.0f, 0.0f);
    /* even variants read the caches in the runner's head-major layout */
    spec *kc = add_spec(tc, 1, dt, hd, kvh, bs, blocks, 0),
         *vc = add_spec(tc, 2, dt, hd, kvh, bs, blocks, 0);
    if (v % 2 == 0)
        head_major(kc), head_major(vc);
    fill_random(kc, 1.0f, 0.0f);
    fill_random(vc, 1.0f, 0.0f);
    memcpy(spec_row(add_spec(tc, 3, LOOM_I32, max_blocks, 2, 1, 1, 0), 0), table, sizeof table);
    fill_i32(add_spec(tc, 4, LOOM_I32, ntok, 1, 1, 1, 0), seq);
    fill_i32(add_spec(tc, 5, LOOM_I32, ntok, 1, 1, 1, 0), pos);
    if (v == 2)
        fill_i32(add_spec(tc, 6, LOOM_I32, 2, 1, 1, 1, 0), prefix);
    add_spec(tc, 7, LOOM_F32, hd, heads, ntok, 1, 1)->output = 1;
    tc->scale = 1.0f / sqrtf((float)hd);
    tc->tol = dt == LOOM_F32 ? 1e-5 : dt == LOOM_F16 ? 2e-3 : 2e-2;
}

static void make_quant(test_case *tc, loom_dtype dt, int v)
{
    static const int64_t shapes[][2] = {{1, 32}, {3, 96}, {17, 4096}, {2, 768}};
    int64_t rows = shapes[v][0], n = shapes[v][1];
    if (n % loom_dtype_block_elems(dt)) {
        tc->op = LOOM_OP_COUNT;
        return;
    }
    snprintf(tc->label, sizeof tc->label, "[%lld, %lld]", (long long)rows, (long long)n);
    if (tc->op == LOOM_OP_QUANTIZE) {
        spec *src = add_spec(tc, 0, LOOM_F32, n, rows, 1, 1, 1);
        fill_random(src, 3.0f, v == 1 ? 2.0f : 0.0f); /* v1: all positive (tests Q4_1's min) */
        add_spec(tc, 1, dt, n, rows, 1, 1, 1)->output = 1;
        tc->quality_vs_input = 1;
        tc->tol = 1.05; /* round-trip error at most 5% above ref's */
    } else {
        fill_random(add_spec(tc, 0, dt, n, rows, 1, 1, 1), 3.0f, 0.0f);
        add_spec(tc, 1, LOOM_F32, n, rows, 1, 1, 1)->output = 1;
        tc->tol = 1e-6;
    }
}

static void make_convert(test_case *tc, loom_dtype dt, int v)
{
    /* v selects the source dtype; dt is the target */
    static const loom_dtype srcs[] = {LOOM_F32, LOOM_F16, LOOM_BF16};
    loom_dtype src = srcs[v];
    snprintf(tc->label, sizeof tc->label, "%s -> %s [5, 77]", loom_dtype_name(src),
             loom_dtype_name(dt));
    fill_random(add_spec(tc, 0, src, 77, 5, 1, 1, 1), 100.0f, 0.0f);
    add_spec(tc, 1, dt, 77, 5, 1, 1, 1)->output = 1;
    tc->tol = 0; /* exact: round to nearest even is fully specified */
}

/* Router logits spaced apart (a shuffled ladder, so that no two choice scores are within
 * rounding of each other and every backend picks the same experts), in [tokens, experts]. */
static void fill_router_logits(spec *s, float step)
{
    int64_t E = s->ne[0];
    float row[256];
    for (int64_t t = 0; t < spec_rows(s); t++) {
        for (int64_t e = 0; e < E; e++)
            row[e] = ((float)e - (float)E / 2) * step;
        for (int64_t e = E - 1; e > 0; e--) {
            int64_t o = (int64_t)(rng_u32() % (uint32_t)(e + 1));
            float tmp = row[e];
            row[e] = row[o], row[o] = tmp;
        }
        put_row(s, t, row);
    }
}

static void make_moe_route(test_case *tc, loom_dtype dt, int v)
{
    (void)dt;
    /* tokens, experts, k, gating, normalize, scale, bias, groups, kept: Qwen2-MoE (softmax,
     * not normalised), Qwen3-MoE (128 experts, top 8, normalised), GLM-4.5 (sigmoid, a choice
     * bias, scaled), a gated shared expert (one sigmoid "expert"), Mixtral (top 2 of 8,
     * normalised), DeepSeek-V3's group limit (4 of 8 groups of 8: ABI 1.7) */
    static const struct {
        int tokens, experts, k, gating, normalize;
        float scale;
        int bias, groups, kept;
    } r[] = {
        {5, 8, 2, LOOM_MOE_SOFTMAX, 0, 1.0f, 0, 0, 0},
        {3, 128, 8, LOOM_MOE_SOFTMAX, 1, 1.0f, 0, 0, 0},
        {4, 16, 4, LOOM_MOE_SIGMOID, 1, 2.5f, 1, 0, 0},
        {6, 1, 1, LOOM_MOE_SIGMOID, 0, 1.0f, 0, 0, 0},
        {1, 8, 2, LOOM_MOE_SOFTMAX, 1, 1.0f, 0, 0, 0},
        {7, 64, 8, LOOM_MOE_SIGMOID, 1, 2.5f, 1, 8, 4},
    };
    static const char *gatings[] = {"softmax", "sigmoid"};
    tc->gating = r[v].gating;
    tc->normalize = r[v].normalize;
    tc->scale = r[v].scale;
    tc->n_group = r[v].groups;
    tc->topk_group = r[v].kept;
    char groups[48] = "";
    if (r[v].groups)
        snprintf(groups, sizeof groups, " in the best %d of %d groups", r[v].kept, r[v].groups);
    snprintf(tc->label, sizeof tc->label, "%d tokens, top %d of %d%s, %s%s%s scale %g", r[v].tokens,
             r[v].k, r[v].experts, groups, gatings[r[v].gating],
             r[v].normalize ? " normalised" : "", r[v].bias ? " +choice bias" : "",
             (double)r[v].scale);
    spec *logits = add_spec(tc, 0, LOOM_F32, r[v].experts, r[v].tokens, 1, 1, 1);
    if (r[v].experts > 1)
        fill_router_logits(logits, r[v].gating == LOOM_MOE_SIGMOID ? 0.3f : 0.05f);
    else
        fill_random(logits, 3.0f, 0.0f);
    if (r[v].bias) { /* a bias that reorders the choice: steps of 0.5 over scores within 1 */
        float b[64];
        for (int e = 0; e < r[v].experts; e++)
            b[e] = (float)((e * 7) % r[v].experts) * (r[v].groups ? 0.0625f : 0.5f);
        memcpy(spec_row(add_spec(tc, 1, LOOM_F32, r[v].experts, 1, 1, 1, 0), 0), b,
               (size_t)r[v].experts * sizeof b[0]);
    }
    add_spec(tc, 2, LOOM_I32, r[v].k, r[v].tokens, 1, 1, 1)->output = 1;
    add_spec(tc, 3, LOOM_F32, r[v].k, r[v].tokens, 1, 1, 1)->output = 1;
    tc->tol = 1e-5; /* an id that differs is an error of order 1 */
    tc->abi_minor = r[v].groups ? 7 : 5;
}

void make_matmul_id_shape(test_case *tc, loom_dtype dt, const matmul_id_shape *s)
{
    int64_t T = s->tokens, E = s->experts, k = s->k, K = s->K, N = s->N;
    if (K % loom_dtype_block_elems(dt)) {
        tc->op = LOOM_OP_COUNT;
        return;
    }
    snprintf(tc->label, sizeof tc->label, "%lld tokens, %lld of %lld experts [%lld, %lld]%s%s",
             (long long)T, (long long)k, (long long)E, (long long)N, (long long)K,
             s->per_slot ? ", x per slot" : "", s->padded ? ", padded stack" : "");
    spec *x = add_spec(tc, 0, LOOM_F32, K, s->per_slot ? k : 1, T, 1, 1);
    fill_random(x, 1.0f, 0.0f);
    spec *w = add_spec(tc, 1, dt, K, N, E, 1, s->padded);
    fill_random(w, 0.5f, 0.0f);
    int32_t ids[32];
    for (int64_t t = 0; t < T; t++) /* distinct experts per token, some shared across tokens */
        for (int64_t j = 0; j < k; j++)
            ids[t * k + j] = (int32_t)((t * 3 + j * (E / k > 1 ? E / k : 1) + (t % 2)) % E);
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 1; j < k; j++)
            if (ids[t * k + j] == ids[t * k])
                ids[t * k + j] = (ids[t * k + j] + 1) % (int32_t)E;
    spec *id = add_spec(tc, 2, LOOM_I32, k, T, 1, 1, 0);
    for (int64_t t = 0; t < T; t++)
        memcpy(spec_row(id, t), ids + t * k, (size_t)k * sizeof ids[0]);
    add_spec(tc, 3, LOOM_F32, N, k, T, 1, 1)->output = 1;
    tc->tol = weight_tolerance(dt);
    tc->abi_minor = 5;
}

static void make_matmul_id(test_case *tc, loom_dtype dt, int v)
{
    /* a decode step (every chosen expert one row), a prefill chunk whose tokens share experts
     * (gathered rows), the down projection (x per slot), and an expert stack padded between
     * matrices */
    static const matmul_id_shape r[] = {{1, 8, 2, 64, 24, 0, 0},
                                        {7, 4, 2, 256, 9, 0, 0},
                                        {5, 6, 3, 32, 40, 1, 0},
                                        {3, 5, 2, 512, 8, 0, 1}};
    make_matmul_id_shape(tc, dt, &r[v]);
}

static void make_moe_combine(test_case *tc, loom_dtype dt, int v)
{
    (void)dt;
    /* tokens, k, n, accumulate */
    static const int64_t r[][4] = {{1, 8, 64, 1}, {6, 2, 96, 0}, {3, 1, 4096, 1}};
    int64_t T = r[v][0], k = r[v][1], n = r[v][2];
    tc->accumulate = (int32_t)r[v][3];
    snprintf(tc->label, sizeof tc->label, "%lld tokens, %lld experts, rows of %lld%s", (long long)T,
             (long long)k, (long long)n, tc->accumulate ? ", accumulated" : "");
    fill_random(add_spec(tc, 0, LOOM_F32, n, k, T, 1, 1), 2.0f, 0.0f);
    fill_random(add_spec(tc, 1, LOOM_F32, k, T, 1, 1, 1), 0.5f, 0.5f);
    spec *dst = add_spec(tc, 2, LOOM_F32, n, T, 1, 1, 1);
    fill_random(dst, 1.0f, 0.0f); /* what accumulate adds to, and what overwriting ignores */
    dst->output = 1;
    tc->tol = 1e-5;
    tc->abi_minor = 5;
}

/* A [tokens] i32 tensor of state slots at index idx. */
static void add_slots(test_case *tc, int idx, const int32_t *slots, int64_t tokens)
{
    fill_i32(add_spec(tc, idx, LOOM_I32, tokens, 1, 1, 1, 0), slots);
}

static void make_ssm_conv(test_case *tc, loom_dtype dt, int v)
{
    /* a decode step of two sequences, a prefill chunk of one, and a mixed batch (a short
     * kernel, rows padded); the state is an output: what the next step continues from */
    static const int64_t r[][4] = {
        {2, 96, 4, 3}, {9, 40, 4, 2}, {6, 64, 3, 3}}; /* T, C, K, slots */
    static const int32_t seqs[][9] = {{2, 0}, {1, 1, 1, 1, 1, 1, 1, 1, 1}, {0, 0, 0, 2, 2, 1}};
    int64_t T = r[v][0], C = r[v][1], K = r[v][2], slots = r[v][3];
    int padded = v == 2;
    snprintf(tc->label, sizeof tc->label, "%lld tokens, %lld channels, kernel %lld, %s weight",
             (long long)T, (long long)C, (long long)K, loom_dtype_name(dt));
    fill_random(add_spec(tc, 0, LOOM_F32, C, T, 1, 1, padded), 2.0f, 0.0f);
    fill_random(add_spec(tc, 1, dt, K, C, 1, 1, padded), 0.5f, 0.0f);
    add_slots(tc, 2, seqs[v], T);
    spec *state = add_spec(tc, 3, LOOM_F32, C, K - 1, slots, 1, padded);
    fill_random(state, 1.0f, 0.0f);
    state->output = 1;
    add_spec(tc, 4, LOOM_F32, C, T, 1, 1, padded)->output = 1;
    tc->tol = 1e-5;
    tc->abi_minor = 8;
}

static void make_gated_delta(test_case *tc, loom_dtype dt, int v)
{
    (void)dt;
    /* tokens, k_heads, v_heads, d_k, d_v, slots: a decode step of two sequences, a prefill
     * chunk of one with two value heads per key head (a long run: a backend's chunked form),
     * and a mixed batch, with the value heads grouped by key head and (ABI 1.9) tiled */
    static const int64_t r[][6] = {
        {2, 2, 2, 16, 16, 3}, {70, 1, 2, 32, 8, 2}, {5, 2, 4, 64, 32, 2}, {5, 2, 4, 64, 32, 2}};
    int32_t seqs[70] = {2, 0};
    if (v == 1)
        for (int i = 0; i < 70; i++)
            seqs[i] = 1;
    if (v >= 2)
        memcpy(seqs, (int32_t[]){1, 1, 0, 0, 0}, 5 * sizeof seqs[0]);
    int64_t T = r[v][0], hk = r[v][1], hv = r[v][2], dk = r[v][3], dv = r[v][4], slots = r[v][5];
    int padded = v == 2;
    tc->v_heads_tiled = v == 3;
    snprintf(tc->label, sizeof tc->label, "%lld tokens, %lld/%lld heads%s, d_k %lld, d_v %lld",
             (long long)T, (long long)hk, (long long)hv, tc->v_heads_tiled ? " tiled" : "",
             (long long)dk, (long long)dv);
    fill_random(add_spec(tc, 0, LOOM_F32, dk, hk, T, 1, padded), 1.0f, 0.0f);
    fill_random(add_spec(tc, 1, LOOM_F32, dk, hk, T, 1, padded), 1.0f, 0.0f);
    fill_random(add_spec(tc, 2, LOOM_F32, dv, hv, T, 1, padded), 1.0f, 0.0f);
    fill_random(add_spec(tc, 3, LOOM_F32, hv, T, 1, 1, padded), 2.0f, 0.0f);
    fill_random(add_spec(tc, 4, LOOM_F32, hv, T, 1, 1, padded), 3.0f, 0.0f);
    fill_random(add_spec(tc, 5, LOOM_F32, hv, 1, 1, 1, 0), 0.25f, -0.35f); /* -exp(A_log) */
    fill_random(add_spec(tc, 6, LOOM_F32, hv, 1, 1, 1, 0), 1.0f, 0.0f);
    add_slots(tc, 7, seqs, T);
    spec *state = add_spec(tc, 8, LOOM_F32, dk, dv, hv, slots, padded);
    fill_random(state, 0.5f, 0.0f);
    state->output = 1;
    add_spec(tc, 9, LOOM_F32, dv, hv, T, 1, padded)->output = 1;
    tc->tol = 1e-4;
    tc->abi_minor = v == 3 ? 9 : 8;
}

const case_family conformance_families[] = {
    {LOOM_OP_MATMUL, 10, make_matmul},
    {LOOM_OP_GET_ROWS, 3, make_get_rows},
    {LOOM_OP_RMS_NORM, 9, make_norm},
    {LOOM_OP_LAYER_NORM, 9, make_norm},
    {LOOM_OP_ROPE, 7, make_rope},
    {LOOM_OP_ADD, 5, make_elementwise},
    {LOOM_OP_MUL, 5, make_elementwise},
    {LOOM_OP_SCALE, 5, make_elementwise},
    {LOOM_OP_SILU_MUL, 5, make_elementwise},
    {LOOM_OP_GELU, 5, make_elementwise},
    {LOOM_OP_KV_STORE, 3, make_kv_store},
    {LOOM_OP_ATTENTION, 6, make_attention},
    {LOOM_OP_QUANTIZE, 4, make_quant},
    {LOOM_OP_DEQUANTIZE, 4, make_quant},
    {LOOM_OP_CONVERT, 3, make_convert},
    {LOOM_OP_MOE_ROUTE, 6, make_moe_route},
    {LOOM_OP_MATMUL_ID, 4, make_matmul_id},
    {LOOM_OP_MOE_COMBINE, 3, make_moe_combine},
    {LOOM_OP_SIGMOID_MUL, 5, make_elementwise},
    {LOOM_OP_SSM_CONV, 3, make_ssm_conv},
    {LOOM_OP_GATED_DELTA, 4, make_gated_delta},
};
const int conformance_n_families = (int)(sizeof conformance_families /
                                         sizeof conformance_families[0]);


/* The dtypes each op is asked about (what `supports` takes for it). */
int conformance_op_dtype_applies(loom_op op, loom_dtype dt)
{
    int is_float = dt == LOOM_F32 || dt == LOOM_F16 || dt == LOOM_BF16;
    switch (op) {
    case LOOM_OP_MATMUL:
    case LOOM_OP_MATMUL_ID:
    case LOOM_OP_GET_ROWS: return is_float || loom_dtype_is_quantized(dt);
    case LOOM_OP_KV_STORE:
    case LOOM_OP_ATTENTION: return dt == LOOM_F32 || dt == LOOM_F16 || dt == LOOM_Q8_0;
    case LOOM_OP_QUANTIZE: return loom_dtype_is_block(dt); /* the types with quantisers */
    case LOOM_OP_DEQUANTIZE: return loom_dtype_is_quantized(dt);
    case LOOM_OP_CONVERT:
    case LOOM_OP_SSM_CONV: return is_float;
    default: return dt == LOOM_F32;
    }
}
