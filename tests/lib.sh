# tests/lib.sh - sourced by the shell tests: assertions that say what was expected.
set -u
fails=0
fail() { echo "FAIL: $*" >&2; fails=$((fails + 1)); }
pass() { echo "ok: $*"; }
# expect_grep PATTERN FILE DESCRIPTION
expect_grep() {
    if grep -q -- "$1" "$2"; then pass "$3"; else fail "$3: '$1' not in $2:"; sed 's/^/    /' "$2" >&2; fi
}
finish() { [ "$fails" -eq 0 ] && exit 0 || exit 1; }
tmpdir=$(mktemp -d "${TMPDIR:-/tmp}/loom-test.XXXXXX")
# LOOM_TEST_KEEP=1 keeps the test's files (server logs and the like) for a look afterwards
# on_exit: what runs when the test ends, however it ends (serve_lib.sh adds stopping its server)
on_exit=
[ -n "${LOOM_TEST_KEEP:-}" ] && echo "keeping $tmpdir" >&2 || on_exit='rm -rf "$tmpdir"'
trap 'eval "$on_exit"' EXIT
# best_of JSON_FILE: the label (name or name-variant) of the highest-scoring usable candidate
best_of() {
    jq -r '[.candidates[] | select(.usable and .kind == "backend")] | max_by(.score)
           | .name + (if .variant != "" then "-" + .variant else "" end)' "$1"
}
# need_fixture PATH: skip (exit 77) when a fixture is absent, except under CI=true, where a
# missing fixture is a failure
FIXTURES=${LOOM_FIXTURES:-$top_srcdir/../shared/fixtures}
need_fixture() {
    [ -e "$1" ] && return 0
    if [ "${CI:-}" = true ]; then echo "FAIL: fixture $1 is missing (CI=true)" >&2; exit 1; fi
    echo "SKIP: fixture $1 not found"; exit 77
}
# have_fixture PATH: whether a fixture is there, for a test whose other checks run without it;
# absent, it says which checks it skips (under CI=true a missing fixture is a failure)
have_fixture() {
    [ -e "$1" ] && return 0
    if [ "${CI:-}" = true ]; then echo "FAIL: fixture $1 is missing (CI=true)" >&2; exit 1; fi
    echo "skipped without the fixture $1: ${2:-its checks}"; return 1
}
# suite_model SHAPE: a model the suite writes itself, loom's synthetic SHAPE in f32 (tiny-chat:
# a chat model), for the tests that need a model but no reference data; prints its path
suite_model() {
    "$LOOM" bench --synthetic "$1" --type f32 --write "$tmpdir/$1.gguf" >/dev/null 2>&1 ||
        { echo "FAIL: writing loom's synthetic $1 model" >&2; exit 1; }
    echo "$tmpdir/$1.gguf"
}
