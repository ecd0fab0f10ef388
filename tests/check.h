/*
 * tests/check.h - the few assertion helpers the C tests share. A failed CHECK prints where and
 * why and lets the test go on, so one run shows every failure; the test then exits 1.
 */
#ifndef LOOM_TESTS_CHECK_H
#define LOOM_TESTS_CHECK_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static int check_failures;
static int check_count;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        check_count++;                                                                             \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: FAIL: %s: ", __FILE__, __LINE__, #cond);                       \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            check_failures++;                                                                      \
        }                                                                                          \
    } while (0)

#define CHECK_NEAR(got, want, tol, what)                                                           \
    CHECK(fabs((double)(got) - (double)(want)) <= (tol), "%s: got %.9g, want %.9g", what,          \
          (double)(got), (double)(want))

static inline int check_finish(const char *name)
{
    printf("%s: %d checks, %d failed\n", name, check_count, check_failures);
    return check_failures ? 1 : 0;
}

/* Environment value or fallback. */
static inline const char *env_or(const char *name, const char *fallback)
{
    const char *v = getenv(name);
    return v && *v ? v : fallback;
}

/* A whole file, NUL-terminated (len: its size, when not NULL); NULL when unreadable. */
static inline char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) {
        free(s);
        s = NULL;
    }
    if (s)
        s[n] = '\0';
    fclose(f);
    if (len && s)
        *len = (size_t)n;
    return s;
}

/* ../shared/fixtures, or LOOM_FIXTURES when set (CI sets it for distcheck's copy). */
static inline const char *fixtures_dir(void)
{
    static char buf[4096];
    const char *d = getenv("LOOM_FIXTURES");
    if (d && *d)
        return d;
    snprintf(buf, sizeof buf, "%s/../shared/fixtures", env_or("top_srcdir", "."));
    return buf;
}

/* Exits the test as skipped (77) when a fixture file is missing, or as failed under CI=true,
 * where every fixture must be present. */
static inline void need_fixture(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (f) {
        fclose(f);
        return;
    }
    const char *ci = getenv("CI");
    if (ci && ci[0] == 't') {
        fprintf(stderr, "fixture %s missing (CI=true)\n", path);
        exit(1);
    }
    printf("SKIP: %s not found\n", path);
    exit(77);
}

/* Whether every one of n paths relative to the fixtures folder dir is there; when one is not,
 * says so (a test's fixture parts are then skipped), and under CI=true, where every fixture
 * must be present, that is a failed check. */
static inline int have_fixtures(const char *dir, const char *const *paths, size_t n)
{
    char probe[4608];
    for (size_t i = 0; i < n; i++) {
        snprintf(probe, sizeof probe, "%s/%s", dir, paths[i]);
        FILE *f = fopen(probe, "rb");
        if (f) {
            fclose(f);
            continue;
        }
        const char *ci = getenv("CI");
        CHECK(!(ci && ci[0] == 't'), "fixture %s missing (CI=true)", probe);
        printf("the fixture parts skipped: %s not found\n", probe);
        return 0;
    }
    return 1;
}

/* need_fixture for each of n paths relative to the fixtures folder dir. */
static inline void need_fixtures(const char *dir, const char *const *paths, size_t n)
{
    char probe[4608];
    for (size_t i = 0; i < n; i++) {
        snprintf(probe, sizeof probe, "%s/%s", dir, paths[i]);
        need_fixture(probe);
    }
}

#endif
