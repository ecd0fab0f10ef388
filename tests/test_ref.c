/*
 * tests/test_ref.c - the reference backend against expectations worked out by hand (the
 * numbers in the comments), since ref is the oracle every other backend is judged by. Each op
 * gets a case small enough to check on paper, for each of its forms.
 */
#define _GNU_SOURCE
#include "core/loader.h"

#include "check.h"

#include <string.h>

static loom_device dev;
static loom_buffer *bufs[64];
static int n_bufs;

/* A dense tensor of ne (innermost first) holding data (dt bytes), in a fresh buffer. */
static loom_tensor make(loom_dtype dt, const void *data, int64_t n0, int64_t n1, int64_t n2,
                        int64_t n3)
{
    loom_tensor t = {0};
    t.dtype = dt;
    t.n_dims = 4;
    t.ne[0] = n0, t.ne[1] = n1, t.ne[2] = n2, t.ne[3] = n3;
    t.nb[0] = (uint64_t)loom_dtype_block_bytes(dt);
    t.nb[1] = (uint64_t)loom_row_bytes(dt, n0);
    t.nb[2] = t.nb[1] * (uint64_t)n1;
    t.nb[3] = t.nb[2] * (uint64_t)n2;
    uint64_t bytes = t.nb[3] * (uint64_t)n3;
    if (dev.ops.buffer_alloc(dev.be, bytes, &t.buf) != LOOM_OK) {
        fprintf(stderr, "alloc failed\n");
        exit(1);
    }
    bufs[n_bufs++] = t.buf;
    if (data)
        dev.ops.copy_from_host(dev.be, t.buf, 0, data, bytes);
    else
        dev.ops.buffer_memset(dev.be, t.buf, 0, 0, bytes);
    return t;
}

static loom_tensor f32(const float *data, int64_t n0, int64_t n1)
{
    return make(LOOM_F32, data, n0, n1, 1, 1);
}

static loom_tensor i32(const int32_t *data, int64_t n)
{
    return make(LOOM_I32, data, n, 1, 1, 1);
}

static void read_back(const loom_tensor *t, void *out, uint64_t bytes)
{
    dev.ops.synchronize(dev.be);
    dev.ops.copy_to_host(dev.be, out, t->buf, t->offset, bytes);
}

static void release_all(void)
{
    for (int i = 0; i < n_bufs; i++)
        dev.ops.buffer_free(dev.be, bufs[i]);
    n_bufs = 0;
}

#define STATUS_OK(call) CHECK((call) == LOOM_OK, "%s: %s", #call, dev.ops.last_error(dev.be))

static void test_matmul(void)
{
    /* X = [[1,2,3],[4,5,6]], W = [[1,0,-1],[2,1,0]], bias = [10, 20]
     * Y = [[1-3+10, 2+2+20], [4-6+10, 8+5+20]] = [[8, 24], [8, 33]] */
    float x[] = {1, 2, 3, 4, 5, 6}, w[] = {1, 0, -1, 2, 1, 0}, bias[] = {10, 20}, y[4];
    loom_tensor X = f32(x, 3, 2), W = f32(w, 3, 2), B = f32(bias, 2, 1), Y = f32(NULL, 2, 2);
    loom_matmul_params p = {sizeof p, &X, &W, &B, &Y};
    STATUS_OK(dev.ops.matmul(dev.be, &p));
    read_back(&Y, y, sizeof y);
    CHECK(y[0] == 8 && y[1] == 24 && y[2] == 8 && y[3] == 33, "f32 matmul: %g %g %g %g", y[0], y[1],
          y[2], y[3]);

    /* block weights against all-ones activations: y = sum of the decoded row */
    float ones[LOOM_QK];
    for (int i = 0; i < LOOM_QK; i++)
        ones[i] = 1;
    loom_block_q8_0 q8 = {.d = 0x3800}; /* d = 0.5, q = 1..32: sum = 0.5 * 528 = 264 */
    for (int i = 0; i < LOOM_QK; i++)
        q8.qs[i] = (int8_t)(i + 1);
    loom_block_q4_0 q40 = {.d = 0x3c00}; /* d = 1; low nibble 8 -> 0, high 9 -> 1: sum 16 */
    memset(q40.qs, 0x98, sizeof q40.qs);
    loom_block_q4_1 q41 = {.d = 0x4000, .m = 0xbc00}; /* d = 2, m = -1; low 3 -> 5, high 0 -> -1:
                                                         sum 16 * 5 - 16 = 64 */
    memset(q41.qs, 0x03, sizeof q41.qs);
    struct {
        loom_dtype dt;
        const void *blk;
        float want;
    } cases[] = {{LOOM_Q8_0, &q8, 264}, {LOOM_Q4_0, &q40, 16}, {LOOM_Q4_1, &q41, 64}};
    for (int c = 0; c < 3; c++) {
        loom_tensor Xo = f32(ones, LOOM_QK, 1), Yo = f32(NULL, 1, 1);
        loom_tensor Wq = make(cases[c].dt, cases[c].blk, LOOM_QK, 1, 1, 1);
        loom_matmul_params pq = {sizeof pq, &Xo, &Wq, NULL, &Yo};
        STATUS_OK(dev.ops.matmul(dev.be, &pq));
        float got;
        read_back(&Yo, &got, sizeof got);
        CHECK(got == cases[c].want, "%s matmul: %g, want %g", loom_dtype_name(cases[c].dt), got,
              cases[c].want);
    }

    /* f16 and bf16 weights: 1.5 is 0x3e00 in f16 and 0x3fc0 in bf16; X = [2, 2] -> 6 */
    uint16_t wf16[] = {0x3e00, 0x3e00}, wbf16[] = {0x3fc0, 0x3fc0};
    float two[] = {2, 2}, got;
    loom_tensor X2 = f32(two, 2, 1), Y2 = f32(NULL, 1, 1);
    loom_tensor Wh = make(LOOM_F16, wf16, 2, 1, 1, 1), Wb = make(LOOM_BF16, wbf16, 2, 1, 1, 1);
    loom_matmul_params ph = {sizeof ph, &X2, &Wh, NULL, &Y2};
    STATUS_OK(dev.ops.matmul(dev.be, &ph));
    read_back(&Y2, &got, 4);
    CHECK(got == 6, "f16 matmul: %g", got);
    ph.w = &Wb;
    STATUS_OK(dev.ops.matmul(dev.be, &ph));
    read_back(&Y2, &got, 4);
    CHECK(got == 6, "bf16 matmul: %g", got);

    /* shape mismatch is an error, not a crash */
    loom_matmul_params bad = {sizeof bad, &X, &Wh, NULL, &Y};
    CHECK(dev.ops.matmul(dev.be, &bad) == LOOM_ERR_INVALID, "K mismatch accepted");
    CHECK(strstr(dev.ops.last_error(dev.be), "matmul"), "error names the op: %s",
          dev.ops.last_error(dev.be));
    release_all();
}

static void test_get_rows(void)
{
    float table[] = {0, 1, 10, 11, 20, 21}, out[4];
    int32_t ids[] = {2, 0}, bad_ids[] = {3, 0};
    loom_tensor T = f32(table, 2, 3), I = i32(ids, 2), D = f32(NULL, 2, 2);
    loom_get_rows_params p = {sizeof p, &T, &I, &D};
    STATUS_OK(dev.ops.get_rows(dev.be, &p));
    read_back(&D, out, sizeof out);
    CHECK(out[0] == 20 && out[1] == 21 && out[2] == 0 && out[3] == 1, "get_rows: %g %g %g %g",
          out[0], out[1], out[2], out[3]);
    loom_tensor Ib = i32(bad_ids, 2);
    p.ids = &Ib;
    CHECK(dev.ops.get_rows(dev.be, &p) == LOOM_ERR_INVALID, "out-of-range id accepted");
    release_all();
}

static void test_norms(void)
{
    /* rms_norm([3, 4]) = [3, 4] / sqrt(12.5) = [0.848528, 1.131371]; weight [1, 2] */
    float x[] = {3, 4}, w[] = {1, 2}, y[4];
    loom_tensor X = f32(x, 2, 1), W = f32(w, 2, 1), Y = f32(NULL, 2, 1);
    loom_norm_params p = {sizeof p, &X, &W, NULL, &Y, 0.0f};
    STATUS_OK(dev.ops.rms_norm(dev.be, &p));
    read_back(&Y, y, 8);
    CHECK_NEAR(y[0], 0.8485281, 1e-6, "rms_norm[0]");
    CHECK_NEAR(y[1], 2.2627417, 1e-6, "rms_norm[1]");

    /* layer_norm([1,2,3,4]): mean 2.5, var 1.25, eps 0.75 -> sd sqrt(2) -> z = [-1.5,-.5,.5,1.5]
     * / 1.414214; times 2 plus 1 */
    float l[] = {1, 2, 3, 4}, lw[] = {2, 2, 2, 2}, lb[] = {1, 1, 1, 1};
    loom_tensor L = f32(l, 4, 1), LW = f32(lw, 4, 1), LB = f32(lb, 4, 1), LY = f32(NULL, 4, 1);
    loom_norm_params q = {sizeof q, &L, &LW, &LB, &LY, 0.75f};
    STATUS_OK(dev.ops.layer_norm(dev.be, &q));
    read_back(&LY, y, 16);
    const float want[] = {-1.1213203f, 0.2928932f, 1.7071068f, 3.1213203f};
    for (int i = 0; i < 4; i++)
        CHECK_NEAR(y[i], want[i], 1e-6, "layer_norm");
    release_all();
}

static void test_rope(void)
{
    /* head_dim 4, base 10000: pair 0 turns by pos, pair 1 by pos / 100 */
    float x[] = {1, 0, 0, 0, 1, 0, 1, 0}, y[8];
    int32_t pos[] = {1, 2};
    loom_tensor X = make(LOOM_F32, x, 4, 1, 2, 1), P = i32(pos, 2),
                Y = make(LOOM_F32, NULL, 4, 1, 2, 1);
    /* neox pairs (0,2), (1,3): token 0 [1,0,0,0] -> [cos 1, 0, sin 1, 0] */
    loom_rope_params p = {sizeof p, &X, &P, NULL, &Y, LOOM_ROPE_NEOX, 4, 10000.0f, 1.0f};
    STATUS_OK(dev.ops.rope(dev.be, &p));
    read_back(&Y, y, sizeof y);
    CHECK_NEAR(y[0], cos(1.0), 1e-6, "neox x0");
    CHECK_NEAR(y[2], sin(1.0), 1e-6, "neox x2");
    /* token 1 [1,0,1,0] at pos 2: pair (0,2) = (1,1) turned by 2; pair (1,3) = (0,0) */
    CHECK_NEAR(y[4], cos(2.0) - sin(2.0), 1e-6, "neox t1 x0");
    CHECK_NEAR(y[6], sin(2.0) + cos(2.0), 1e-6, "neox t1 x2");

    /* adjacent pairs (0,1), (2,3): token 1 [1,0,1,0] at pos 2 -> [cos 2, sin 2, cos .02, sin .02] */
    p.mode = LOOM_ROPE_ADJACENT;
    STATUS_OK(dev.ops.rope(dev.be, &p));
    read_back(&Y, y, sizeof y);
    CHECK_NEAR(y[4], cos(2.0), 1e-6, "adjacent x0");
    CHECK_NEAR(y[5], sin(2.0), 1e-6, "adjacent x1");
    CHECK_NEAR(y[6], cos(0.02), 1e-6, "adjacent x2");
    CHECK_NEAR(y[7], sin(0.02), 1e-6, "adjacent x3");

    /* partial: n_rot 2 turns only (0,1) by pos * base^0 = pos; dims 2, 3 untouched; with
     * freq_scale 0.5 position 2 acts as 1 */
    p.n_rot = 2;
    p.freq_scale = 0.5f;
    STATUS_OK(dev.ops.rope(dev.be, &p));
    read_back(&Y, y, sizeof y);
    CHECK_NEAR(y[4], cos(1.0), 1e-6, "partial x0");
    CHECK_NEAR(y[5], sin(1.0), 1e-6, "partial x1");
    CHECK(y[6] == 1 && y[7] == 0, "partial rotary touched dims past n_rot: %g %g", y[6], y[7]);

    /* glm_2d, head_dim 8: dims 0..3 neox over 4 dims by pos (pairs (0,2),(1,3), angles pos and
     * pos/100), dims 4..7 likewise by pos2 */
    float g[] = {1, 0, 0, 0, 1, 0, 0, 0}, gy[8];
    int32_t gp[] = {3}, gp2[] = {1};
    loom_tensor G = make(LOOM_F32, g, 8, 1, 1, 1), GP = i32(gp, 1), GP2 = i32(gp2, 1);
    loom_tensor GY = make(LOOM_F32, NULL, 8, 1, 1, 1);
    loom_rope_params pg = {sizeof pg, &G, &GP, &GP2, &GY, LOOM_ROPE_GLM_2D, 8, 10000.0f, 1.0f};
    STATUS_OK(dev.ops.rope(dev.be, &pg));
    read_back(&GY, gy, sizeof gy);
    CHECK_NEAR(gy[0], cos(3.0), 1e-6, "glm_2d x0");
    CHECK_NEAR(gy[2], sin(3.0), 1e-6, "glm_2d x2");
    CHECK_NEAR(gy[4], cos(1.0), 1e-6, "glm_2d x4");
    CHECK_NEAR(gy[6], sin(1.0), 1e-6, "glm_2d x6");
    release_all();
}

static void test_elementwise(void)
{
    float a[] = {1, -2, 3, 4}, b[] = {10, 20}, y[4];
    loom_tensor A = f32(a, 2, 2), B = f32(b, 2, 1), Y = f32(NULL, 2, 2);
    loom_elementwise_params p = {sizeof p, &A, &B, &Y, 0.5f};
    STATUS_OK(dev.ops.add(dev.be, &p)); /* b broadcast over both rows */
    read_back(&Y, y, sizeof y);
    CHECK(y[0] == 11 && y[1] == 18 && y[2] == 13 && y[3] == 24, "add: %g %g %g %g", y[0], y[1],
          y[2], y[3]);
    STATUS_OK(dev.ops.mul(dev.be, &p));
    read_back(&Y, y, sizeof y);
    CHECK(y[0] == 10 && y[1] == -40 && y[2] == 30 && y[3] == 80, "mul");
    STATUS_OK(dev.ops.scale(dev.be, &p));
    read_back(&Y, y, sizeof y);
    CHECK(y[0] == 0.5f && y[1] == -1 && y[3] == 2, "scale");

    /* silu(1) * 2 = 2 / (1 + e^-1) = 1.4621172; gelu_tanh(1) = 0.8411920 */
    float one[] = {1}, twov[] = {2}, r;
    loom_tensor O = f32(one, 1, 1), T = f32(twov, 1, 1), R = f32(NULL, 1, 1);
    loom_elementwise_params s = {sizeof s, &O, &T, &R, 0};
    STATUS_OK(dev.ops.silu_mul(dev.be, &s));
    read_back(&R, &r, 4);
    CHECK_NEAR(r, 1.4621172, 1e-6, "silu_mul");
    STATUS_OK(dev.ops.gelu(dev.be, &s));
    read_back(&R, &r, 4);
    CHECK_NEAR(r, 0.8411920, 1e-6, "gelu");
    release_all();
}

/* One sequence, head_dim 2, block size 1 with the two keys in scrambled blocks 3 and 1.
 * q = [1, 0], k0 = [1, 0], k1 = [0, 1], v0 = [1, 2], v1 = [3, 4], scale 1:
 * at pos 1 the weights are softmax([1, 0]) = [0.7310586, 0.2689414],
 * out = [0.7310586 + 3 * 0.2689414, 2 * 0.7310586 + 4 * 0.2689414] = [1.5378828, 2.5378828];
 * at pos 0 (causal) only k0 counts: out = v0. */
static void test_attention(loom_dtype cache_dt)
{
    /* the cache is written through kv_store (k0 into block 3, k1 into block 1), so its dtype
     * conversion is exercised too */
    float knew[] = {1, 0, 0, 1}, vnew[] = {1, 2, 3, 4};
    int32_t slots[] = {3, 1}, table[] = {3, 1}, seq[] = {0, 0, 0}, pos[] = {1, 0, 0};
    int32_t prefix[] = {2};
    int64_t hd = cache_dt == LOOM_Q8_0 ? 32 : 2; /* Q8_0 rows need whole blocks */
    float kn[2 * 32] = {0}, vn[2 * 32] = {0};
    for (int t = 0; t < 2; t++)
        for (int i = 0; i < 2; i++)
            kn[t * hd + i] = knew[t * 2 + i], vn[t * hd + i] = vnew[t * 2 + i];
    loom_tensor Kn = make(LOOM_F32, kn, hd, 1, 2, 1), Vn = make(LOOM_F32, vn, hd, 1, 2, 1);
    loom_tensor S = i32(slots, 2);
    loom_tensor K = make(cache_dt, NULL, hd, 1, 1, 4), V = make(cache_dt, NULL, hd, 1, 1, 4);
    loom_kv_store_params ks = {sizeof ks, &Kn, &S, &K}, vs = {sizeof vs, &Vn, &S, &V};
    STATUS_OK(dev.ops.kv_store(dev.be, &ks));
    STATUS_OK(dev.ops.kv_store(dev.be, &vs));

    /* three query tokens, two heads sharing the one kv head (GQA 2/1) */
    float q[3 * 2 * 32] = {0}, out[3 * 2 * 32];
    for (int t = 0; t < 3; t++)
        for (int h = 0; h < 2; h++)
            q[(t * 2 + h) * hd] = 1;
    loom_tensor Q = make(LOOM_F32, q, hd, 2, 3, 1), D = make(LOOM_F32, NULL, hd, 2, 3, 1);
    loom_tensor BT = make(LOOM_I32, table, 2, 1, 1, 1), SQ = i32(seq, 3), PS = i32(pos, 3);
    loom_tensor PL = i32(prefix, 1);
    /* token 2 is the same as token 1 but run with the bidirectional prefix below */
    loom_attention_params p = {sizeof p, &Q, &K, &V, &BT, &SQ, &PS, NULL, &D, 1.0f};
    STATUS_OK(dev.ops.attention(dev.be, &p));
    read_back(&D, out, (uint64_t)(3 * 2 * hd) * 4);
    double tol = cache_dt == LOOM_Q8_0 ? 2e-2 : 1e-3; /* F16 holds 1..4 exactly; Q8_0 rounds */
    const char *dn = loom_dtype_name(cache_dt);
    for (int h = 0; h < 2; h++) {
        CHECK_NEAR(out[(0 * 2 + h) * hd + 0], 1.5378828, tol, dn);
        CHECK_NEAR(out[(0 * 2 + h) * hd + 1], 2.5378828, tol, dn);
        CHECK_NEAR(out[(1 * 2 + h) * hd + 0], 1.0, tol, dn);
        CHECK_NEAR(out[(1 * 2 + h) * hd + 1], 2.0, tol, dn);
    }
    p.prefix_len = &PL; /* prefix of 2: pos 0 now sees k1 as well */
    STATUS_OK(dev.ops.attention(dev.be, &p));
    read_back(&D, out, (uint64_t)(3 * 2 * hd) * 4);
    CHECK_NEAR(out[(2 * 2) * hd + 0], 1.5378828, tol, "prefix-bidirectional");
    CHECK_NEAR(out[(2 * 2) * hd + 1], 2.5378828, tol, "prefix-bidirectional");
    release_all();
}

static void test_conversions(void)
{
    /* 1/3 -> f16 0x3555, bf16 0x3eab; 65520 overflows f16 to inf; 3e-8 rounds to the smallest
     * f16 subnormal (2^-24 = 5.96e-8, and 3e-8 is just past half of it) */
    float src[] = {1.0f / 3.0f, 65520.0f, 3e-8f, -2.0f};
    uint16_t h[4], b[4];
    loom_tensor S = f32(src, 4, 1), H = make(LOOM_F16, NULL, 4, 1, 1, 1);
    loom_tensor B = make(LOOM_BF16, NULL, 4, 1, 1, 1);
    loom_convert_params p = {sizeof p, &S, &H};
    STATUS_OK(dev.ops.convert(dev.be, &p));
    read_back(&H, h, sizeof h);
    CHECK(h[0] == 0x3555 && h[1] == 0x7c00 && h[2] == 0x0001 && h[3] == 0xc000,
          "f16: %04x %04x %04x %04x", h[0], h[1], h[2], h[3]);
    p.dst = &B;
    STATUS_OK(dev.ops.convert(dev.be, &p));
    read_back(&B, b, sizeof b);
    CHECK(b[0] == 0x3eab && b[3] == 0xc000, "bf16: %04x %04x", b[0], b[3]);

    /* quantize then dequantize: every element within half a step of where it started */
    float x[64], y[64];
    for (int i = 0; i < 64; i++)
        x[i] = (float)(i % 7) - 3.0f + 0.1f * (float)i;
    loom_dtype types[] = {LOOM_Q8_0, LOOM_Q4_0, LOOM_Q4_1};
    float steps[] = {9.4f / 127.0f, 9.4f / 8.0f, 12.3f / 15.0f}; /* max|x| ~ 9.3, range ~ 12.3 */
    for (int t = 0; t < 3; t++) {
        loom_tensor X = f32(x, 64, 1), Q = make(types[t], NULL, 64, 1, 1, 1), Y = f32(NULL, 64, 1);
        loom_convert_params qp = {sizeof qp, &X, &Q}, dp = {sizeof dp, &Q, &Y};
        STATUS_OK(dev.ops.quantize(dev.be, &qp));
        STATUS_OK(dev.ops.dequantize(dev.be, &dp));
        read_back(&Y, y, sizeof y);
        double worst = 0;
        for (int i = 0; i < 64; i++)
            worst = fmax(worst, fabs(y[i] - x[i]));
        CHECK(worst <= steps[t] * 0.5 * 1.01, "%s round trip: worst error %g, half step %g",
              loom_dtype_name(types[t]), worst, steps[t] * 0.5);
    }
    release_all();
}

int main(void)
{
    char path[4096], err[1024];
    snprintf(path, sizeof path, "%s/backends/ref/.libs/loom-ref.so", env_or("top_builddir", "."));
    if (loom_device_open(&dev, path, 0, 0, err, sizeof err) != 0) {
        fprintf(stderr, "cannot open ref: %s\n", err);
        return 1;
    }
    test_matmul();
    test_get_rows();
    test_norms();
    test_rope();
    test_elementwise();
    test_attention(LOOM_F32);
    test_attention(LOOM_F16);
    test_attention(LOOM_Q8_0);
    test_conversions();
    loom_device_close(&dev);
    return check_finish("test_ref");
}
