/*
 * tests/test_loader.c - the loader against modules that misbehave in every way the issue names
 * (tests/plugins/fake.c), the selection rules and env vars, the host reading no table member
 * past a module's declared size, and load/use/unload of the real ref backend 100 times (leaks
 * show up under AddressSanitizer's leak checker).
 */
#define _GNU_SOURCE
#include "core/loader.h"

#include "check.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *plugin_dir;
static char err[8192];

static const loom_candidate *vet(loom_registry *reg, const char *file)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", plugin_dir, file);
    int rc = loom_registry_add_file(reg, path, err, sizeof err);
    CHECK(rc == 0, "add_file %s: %s", file, err);
    return &reg->items[reg->count - 1];
}

static void expect_state(const char *file, loom_candidate_state want, const char *needle)
{
    loom_registry reg = {.chosen = -1};
    const loom_candidate *c = vet(&reg, file);
    CHECK(c->state == want, "%s: state %s, want %s (%s)", file, loom_candidate_state_name(c->state),
          loom_candidate_state_name(want), c->reason);
    CHECK(strstr(c->reason, needle) != NULL, "%s: reason '%s' lacks '%s'", file, c->reason, needle);
    loom_registry_free(&reg);
}

static void test_rejections(void)
{
    /* a file that is not a shared object at all */
    char tmpl[] = "/tmp/loom-test-XXXXXX";
    char *dir = mkdtemp(tmpl);
    CHECK(dir != NULL, "mkdtemp");
    char path[256];
    snprintf(path, sizeof path, "%s/not-a-library.so", dir);
    FILE *f = fopen(path, "w");
    fputs("this is text, not ELF\n", f);
    fclose(f);
    loom_registry reg = {.chosen = -1};
    loom_registry_add_file(&reg, path, err, sizeof err);
    CHECK(reg.items[0].state == LOOM_CAND_NOT_LOADABLE && strstr(reg.items[0].reason, "dlopen"),
          "text file: %s", reg.items[0].reason);
    loom_registry_free(&reg);
    unlink(path);
    rmdir(dir);

    expect_state("fake-noentry.so", LOOM_CAND_NO_ENTRY, "loom_backend_entry");
    expect_state("fake-newminor.so", LOOM_CAND_BAD_ABI, "upgrade loom");
    expect_state("fake-major2.so", LOOM_CAND_BAD_ABI, "rebuild it");
    expect_state("fake-missingdep.so", LOOM_CAND_NOT_LOADABLE, "libloom-test-gone.so");
    expect_state("fake-nodevice.so", LOOM_CAND_UNUSABLE, "no device");
    expect_state("fake-cpu-avx2.so", LOOM_CAND_USABLE, "");
}

/* A module whose op table predates matmul: the host must see no matmul (the fake's table has a
 * trap there, past its declared size, which aborts if called). */
static void test_old_table(void)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/fake-oldops.so", plugin_dir);
    loom_device dev;
    int rc = loom_device_open(&dev, path, 0, 0, err, sizeof err);
    CHECK(rc == 0, "open oldops: %s", err);
    if (rc)
        return;
    CHECK(dev.ops.matmul == NULL, "a member past struct_size was copied");
    CHECK(!loom_device_supports(&dev, LOOM_OP_MATMUL, LOOM_F32),
          "an op past struct_size counts as supported");
    loom_buffer *b = NULL;
    CHECK(dev.ops.buffer_alloc(dev.be, 64, &b) == LOOM_OK, "alloc on oldops");
    dev.ops.buffer_free(dev.be, b);
    loom_device_close(&dev);
}

/* A module built against ABI 1.0 (minor 0, its table ending at convert) is accepted by this
 * loom, and its table reads as having no prepare_weight (the slot past its size is a trap). */
static void test_abi_1_0_module(void)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/fake-abi10.so", plugin_dir);
    loom_device dev;
    int rc = loom_device_open(&dev, path, 0, 0, err, sizeof err);
    CHECK(rc == 0, "open a 1.0 module: %s", err);
    if (rc)
        return;
    CHECK(dev.module.abi_minor == 0, "the module declares minor %u", dev.module.abi_minor);
    CHECK(dev.ops.prepare_weight == NULL, "prepare_weight past a 1.0 table's size was copied");
    loom_device_close(&dev);
}

/* Builds a registry of the three fake cpu variants and the device-less module, then selects
 * with the given CPU variant options (LOOM_CPU_VARIANT, LOOM_CPU_MAX_ISA as the API reads them;
 * NULL: none) and preference. Returns the chosen label or "error". */
static const char *select_with(const char *variant_env, const char *cap_env, const char *pref,
                               int *device, loom_registry *reg)
{
    memset(reg, 0, sizeof *reg);
    reg->chosen = -1;
    vet(reg, "fake-cpu-baseline.so");
    vet(reg, "fake-cpu-avx2.so");
    vet(reg, "fake-cpu-avx512.so");
    vet(reg, "fake-nodevice.so");
    reg->opts.cpu_variant = variant_env;
    reg->opts.cpu_max_isa = cap_env;
    err[0] = '\0';
    if (loom_registry_select(reg, pref, err, sizeof err) != 0)
        return "error";
    *device = reg->chosen_device;
    return reg->items[reg->chosen].variant;
}

static void test_selection(void)
{
    loom_registry reg;
    int dev = -1;
    const char *got;

    got = select_with(NULL, NULL, NULL, &dev, &reg);
    CHECK(strcmp(got, "avx512") == 0 && dev == 0, "default: got %s", got);
    CHECK(strstr(reg.items[0].reason, "score 100 is below cpu-avx512's 300"), "loser's reason: %s",
          reg.items[0].reason);
    loom_registry_free(&reg);

    got = select_with(NULL, "avx2", NULL, &dev, &reg);
    CHECK(strcmp(got, "avx2") == 0, "cap avx2: got %s", got);
    CHECK(reg.items[2].state == LOOM_CAND_EXCLUDED &&
              strstr(reg.items[2].reason, "LOOM_CPU_MAX_ISA"),
          "avx512 under a cap: %s", reg.items[2].reason);
    loom_registry_free(&reg);

    got = select_with("baseline", NULL, NULL, &dev, &reg);
    CHECK(strcmp(got, "baseline") == 0, "force baseline: got %s", got);
    loom_registry_free(&reg);

    got = select_with("sse9", NULL, NULL, &dev, &reg);
    CHECK(strcmp(got, "error") == 0 && strstr(err, "LOOM_CPU_VARIANT=sse9") &&
              strstr(err, "cpu-avx2"),
          "unknown variant: %s", err);
    loom_registry_free(&reg);

    got = select_with(NULL, "avx1024", NULL, &dev, &reg);
    CHECK(strcmp(got, "error") == 0 && strstr(err, "baseline, avx2 or avx512"), "bad cap: %s", err);
    loom_registry_free(&reg);

    got = select_with(NULL, NULL, "nodevice", &dev, &reg);
    CHECK(strcmp(got, "error") == 0 && strstr(err, "not usable") && strstr(err, "no device") &&
              strstr(err, "cpu-avx512: usable"),
          "unusable preference: %s", err);
    loom_registry_free(&reg);

    got = select_with(NULL, NULL, "nodevice,cpu", &dev, &reg);
    CHECK(strcmp(got, "avx512") == 0, "fallback through the list: got %s (%s)", got, err);
    loom_registry_free(&reg);

    got = select_with(NULL, NULL, "cuda,cpu", &dev, &reg);
    CHECK(strcmp(got, "error") == 0 && strstr(err, "no backend named 'cuda'"), "unknown name: %s",
          err);
    loom_registry_free(&reg);

    got = select_with(NULL, NULL, "cpu:1", &dev, &reg);
    CHECK(strcmp(got, "avx512") == 0 && dev == 1, "cpu:1: got %s device %d", got, dev);
    loom_registry_free(&reg);

    got = select_with(NULL, NULL, "cpu:5", &dev, &reg);
    CHECK(strcmp(got, "error") == 0 && strstr(err, "no device 5"), "cpu:5: %s", err);
    loom_registry_free(&reg);

    got = select_with(NULL, NULL, "cpu-avx2", &dev, &reg);
    CHECK(strcmp(got, "avx2") == 0, "cpu-avx2: got %s", got);
    loom_registry_free(&reg);

    got = select_with(NULL, NULL, "cpu:", &dev, &reg);
    CHECK(strcmp(got, "error") == 0 && strstr(err, "NAME:DEVICE"), "malformed: %s", err);
    loom_registry_free(&reg);

    got = select_with(NULL, "baseline", "cpu-avx512", &dev, &reg);
    CHECK(strcmp(got, "error") == 0, "preference of an excluded variant must fail, got %s", got);
    loom_registry_free(&reg);

    /* nothing at all */
    loom_registry empty = {.chosen = -1};
    CHECK(loom_registry_select(&empty, NULL, err, sizeof err) != 0 &&
              strstr(err, "no backend modules found"),
          "empty registry: %s", err);
    loom_registry_free(&empty);
}

static void test_reload_ref(void)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/backends/ref/.libs/loom-ref.so", env_or("top_builddir", "."));
    for (int i = 0; i < 100; i++) {
        loom_device dev;
        if (loom_device_open(&dev, path, 0, 0, err, sizeof err) != 0) {
            CHECK(0, "round %d: %s", i, err);
            return;
        }
        loom_buffer *b = NULL;
        float x[32] = {1}, y[32];
        int ok = dev.ops.buffer_alloc(dev.be, sizeof x, &b) == LOOM_OK &&
            dev.ops.copy_from_host(dev.be, b, 0, x, sizeof x) == LOOM_OK &&
            dev.ops.copy_to_host(dev.be, y, b, 0, sizeof y) == LOOM_OK && y[0] == 1.0f;
        dev.ops.buffer_free(dev.be, b);
        loom_device_close(&dev);
        if (!ok) {
            CHECK(0, "round %d: buffer round trip failed", i);
            return;
        }
    }
    CHECK(1, "100 rounds");
}

int main(void)
{
    plugin_dir = env_or("PLUGIN_DIR", "tests/plugins/.libs");
    unsetenv("LOOM_BACKEND");
    unsetenv("LOOM_EXPLAIN");
    test_rejections();
    test_old_table();
    test_abi_1_0_module();
    test_selection();
    test_reload_ref();
    return check_finish("test_loader");
}
