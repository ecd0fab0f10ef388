# tests/python.sh - the Python package (python/loom) against `loom run --json`, with Debian's
# python3-pytest, over the libloom.so and backend modules of this build tree.
. "$top_srcdir/tests/lib.sh"
# the model the package is compared with `loom run` on: stories260K, or without the fixtures
# loom's synthetic one (the tests that need a real tokenizer or a reference then skip; under
# CI=true a missing fixture fails)
if [ -e "$FIXTURES/stories260K/original/stories260K.gguf" ]; then
    LOOM_TEST_MODEL=$FIXTURES/stories260K/original/stories260K.gguf
elif [ "${CI:-}" = true ]; then
    echo "FAIL: fixture $FIXTURES/stories260K/original/stories260K.gguf is missing (CI=true)" >&2
    exit 1
else
    LOOM_TEST_MODEL=$tmpdir/tiny.gguf
    "$LOOM" bench --synthetic tiny --type f32 --write "$LOOM_TEST_MODEL" >/dev/null 2>&1 ||
        { echo "FAIL: writing the synthetic model" >&2; exit 1; }
fi
PY=python3
$PY -c 'import pytest' 2>/dev/null || PY=/usr/bin/python3
if ! $PY -c 'import pytest' 2>/dev/null; then
    [ "${CI:-}" = true ] && { echo "FAIL: python3-pytest is missing (CI=true)" >&2; exit 1; }
    echo "SKIP: python3-pytest not installed"; exit 77
fi
LOOM_LIBRARY=$top_builddir/.libs/libloom.so
# a sanitizer build's library cannot be loaded into an uninstrumented python3 (the ASan
# runtime must come first); the plain build's run covers the package
if ldd "$LOOM_LIBRARY" 2>/dev/null | grep -q 'libasan\|libubsan'; then
    echo "SKIP: libloom.so is built with sanitizers; python3 cannot load it"; exit 77
fi
LOOM_BACKEND_PATH=$(ls -d "$top_builddir"/backends/*/.libs | tr '\n' ':')
export LOOM_LIBRARY LOOM_BACKEND_PATH FIXTURES LOOM LOOM_TEST_MODEL
export PYTHONPATH=$top_srcdir/python${PYTHONPATH:+:$PYTHONPATH}
# `python3 -m loom` inside the tests: the same interpreter
mkdir -p "$tmpdir/bin" && ln -s "$(command -v $PY)" "$tmpdir/bin/python3" && PATH=$tmpdir/bin:$PATH
$PY -m pytest -q -p no:cacheprovider "$top_srcdir/python/tests" && pass "python3 -m pytest python/tests" ||
    fail "the Python package's tests"
finish
