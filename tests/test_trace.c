/*
 * tests/test_trace.c - the trace plugin at the ABI level: found among the scanned modules as a
 * decorator, wrapped around ref, it gives ref's results and writes one trace event per call, in
 * call order, with the shapes and byte counts of the tensors the test passed (worked out here
 * from the shapes, not read back from the plugin). Also: a backend is refused as a decorator,
 * and an uncreatable trace file is named.
 */
#define _GNU_SOURCE
#include "core/loader.h"

#include "check.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char err[8192];

static int find(const loom_registry *reg, const char *name)
{
    for (int i = 0; i < reg->count; i++)
        if (!strcmp(reg->items[i].name, name) && reg->items[i].state >= LOOM_CAND_EXCLUDED)
            return i;
    return -1;
}

static loom_tensor matrix(loom_buffer *b, loom_dtype t, int64_t rows, int64_t cols)
{
    loom_tensor x = {.buf = b, .dtype = t, .n_dims = 2, .ne = {cols, rows, 1, 1}};
    x.nb[0] = 4, x.nb[1] = (uint64_t)cols * 4, x.nb[2] = x.nb[3] = x.nb[1] * (uint64_t)rows;
    return x;
}

enum { M = 3, K = 64, N = 16 };

/* Runs y = x w^T on dev; returns 0 when every call succeeded. */
static int run_matmul(loom_device *d, const float *x, const float *w, float *y)
{
    loom_buffer *bx = NULL, *bw = NULL, *by = NULL;
    int ok = d->ops.buffer_alloc(d->be, sizeof(float) * M * K, &bx) == LOOM_OK &&
        d->ops.buffer_alloc(d->be, sizeof(float) * N * K, &bw) == LOOM_OK &&
        d->ops.buffer_alloc(d->be, sizeof(float) * M * N, &by) == LOOM_OK &&
        d->ops.copy_from_host(d->be, bx, 0, x, sizeof(float) * M * K) == LOOM_OK &&
        d->ops.copy_from_host(d->be, bw, 0, w, sizeof(float) * N * K) == LOOM_OK;
    loom_tensor tx = matrix(bx, LOOM_F32, M, K), tw = matrix(bw, LOOM_F32, N, K),
                ty = matrix(by, LOOM_F32, M, N);
    loom_matmul_params p = {sizeof p, &tx, &tw, NULL, &ty};
    ok = ok && d->ops.matmul(d->be, &p) == LOOM_OK &&
        d->ops.copy_to_host(d->be, y, by, 0, sizeof(float) * M * N) == LOOM_OK;
    loom_buffer *bufs[] = {bx, bw, by};
    for (int i = 0; i < 3; i++)
        if (bufs[i])
            d->ops.buffer_free(d->be, bufs[i]);
    return ok ? 0 : -1;
}

int main(void)
{
    loom_registry reg;
    if (loom_registry_scan(&reg, NULL, err, sizeof err) != 0) {
        fprintf(stderr, "scan: %s\n", err);
        return 1;
    }
    int ref = find(&reg, "ref"),
        trace = loom_registry_find_decorator(&reg, "trace", err, sizeof err);
    CHECK(ref >= 0, "no usable ref module");
    CHECK(trace >= 0, "the trace plugin: %s", err);
    if (ref < 0 || trace < 0)
        return check_finish("test_trace");
    CHECK(reg.items[trace].kind == LOOM_MODULE_DECORATOR, "trace's kind is %u",
          reg.items[trace].kind);
    CHECK(loom_registry_find_decorator(&reg, "ref", err, sizeof err) < 0 &&
              strstr(err, "no ref plugin"),
          "ref found as a decorator: %s", err);

    float x[M * K], w[N * K], want[M * N], got[M * N];
    for (int i = 0; i < M * K; i++)
        x[i] = (float)((i * 7) % 13) / 13.0f - 0.5f;
    for (int i = 0; i < N * K; i++)
        w[i] = (float)((i * 5) % 11) / 11.0f - 0.5f;

    loom_device plain, traced;
    CHECK(loom_device_open(&plain, reg.items[ref].path, 0, 0, err, sizeof err) == 0, "%s", err);
    CHECK(run_matmul(&plain, x, w, want) == 0, "matmul on ref");
    loom_device_close(&plain);

    char path[] = "/tmp/loom-trace-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0, "mkstemp");
    close(fd);
    int opened = loom_device_open(&traced, reg.items[ref].path, 0, 0, err, sizeof err) == 0 &&
        loom_device_decorate(&traced, reg.items[trace].path, path, err, sizeof err) == 0;
    CHECK(opened, "ref wrapped in trace: %s", err);
    if (opened) {
        CHECK(!strcmp(traced.name, "ref") && !strcmp(traced.decorator, "trace"),
              "a decorated device keeps the backend's name: %s, %s", traced.name, traced.decorator);
        CHECK(run_matmul(&traced, x, w, got) == 0, "matmul through trace: %s",
              traced.ops.last_error(traced.be));
        CHECK(memcmp(got, want, sizeof got) == 0, "traced results differ from ref's");
        loom_device_close(&traced);
    }

    /* the file: exactly the calls made, in order */
    static const char *const calls[] = {
        "buffer_alloc", "buffer_alloc", "buffer_alloc", "copy_from_host", "copy_from_host",
        "matmul",       "copy_to_host", "buffer_free",  "buffer_free",    "buffer_free"};
    const int n_calls = (int)(sizeof calls / sizeof calls[0]);
    char *text = slurp(path, NULL);
    cJSON *doc = text ? cJSON_Parse(text) : NULL;
    cJSON *events = cJSON_GetObjectItem(doc, "traceEvents");
    CHECK(cJSON_IsArray(events), "the trace is not JSON with traceEvents:\n%s", text ? text : "");
    int n = 0;
    double last_ts = -1;
    cJSON *e;
    cJSON_ArrayForEach (e, events) {
        const char *ph = cJSON_GetStringValue(cJSON_GetObjectItem(e, "ph"));
        if (!ph || strcmp(ph, "X") != 0)
            continue; /* metadata */
        const char *name = cJSON_GetStringValue(cJSON_GetObjectItem(e, "name"));
        CHECK(n < n_calls && name && !strcmp(name, calls[n]), "event %d is %s, want %s", n,
              name ? name : "(none)", n < n_calls ? calls[n] : "no more");
        double ts = cJSON_GetNumberValue(cJSON_GetObjectItem(e, "ts"));
        double dur = cJSON_GetNumberValue(cJSON_GetObjectItem(e, "dur"));
        CHECK(ts >= last_ts && dur >= 0, "event %d: ts %g after %g, dur %g", n, ts, last_ts, dur);
        last_ts = ts;
        cJSON *args = cJSON_GetObjectItem(e, "args");
        double bytes = cJSON_GetNumberValue(cJSON_GetObjectItem(args, "bytes"));
        if (name && !strcmp(name, "matmul")) {
            const char *tensors = cJSON_GetStringValue(cJSON_GetObjectItem(args, "tensors"));
            CHECK(tensors && !strcmp(tensors, "x f32[3,64] w f32[16,64] y f32[3,16]"),
                  "matmul tensors: %s", tensors ? tensors : "(none)");
            CHECK(bytes == 4.0 * (M * K + N * K + M * N), "matmul bytes %g", bytes);
            const char *dtype = cJSON_GetStringValue(cJSON_GetObjectItem(args, "dtype"));
            CHECK(dtype && !strcmp(dtype, "f32"), "matmul dtype %s", dtype ? dtype : "(none)");
        }
        if (name && !strcmp(name, "copy_to_host"))
            CHECK(bytes == 4.0 * M * N, "copy_to_host bytes %g", bytes);
        n++;
    }
    CHECK(n == n_calls, "%d events, want %d", n, n_calls);
    cJSON_Delete(doc);
    free(text);
    unlink(path);

    /* mistakes: a backend offered as a decorator; a trace file that cannot be created. Both
     * close the device they were to wrap. */
    loom_device d;
    CHECK(loom_device_open(&d, reg.items[ref].path, 0, 0, err, sizeof err) == 0, "%s", err);
    CHECK(loom_device_decorate(&d, reg.items[ref].path, path, err, sizeof err) != 0 &&
              strstr(err, "is a backend, not a decorator") && d.be == NULL,
          "ref as a decorator: %s", err);
    CHECK(loom_device_open(&d, reg.items[ref].path, 0, 0, err, sizeof err) == 0, "%s", err);
    CHECK(loom_device_decorate(&d, reg.items[trace].path, "/nonexistent/dir/t.json", err,
                               sizeof err) != 0 &&
              strstr(err, "cannot create the trace file /nonexistent/dir/t.json") && d.be == NULL,
          "uncreatable file: %s", err);
    loom_registry_free(&reg);
    return check_finish("test_trace");
}
