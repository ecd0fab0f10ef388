# tests/spm_diff.sh - runs tests/test_spm_diff (loom's SentencePiece tokenizers against the
# sentencepiece library), which configure builds only where libsentencepiece-dev is installed.
. "$top_srcdir/tests/lib.sh"
if [ "$LOOM_BUILT_SPM_DIFF" != yes ]; then
    if [ "${CI:-}" = true ]; then
        fail "CI=true but the sentencepiece reference test was not built: apt-get install libsentencepiece-dev and re-run configure"
        finish
    fi
    echo "SKIP: libsentencepiece-dev was not found by configure; the tokenizer reference test needs it"
    exit 77
fi
need_fixture "$FIXTURES/stories260K/tokenizer.model"
LOOM_FIXTURES=$FIXTURES "$top_builddir/tests/test_spm_diff" && pass "SentencePiece tokenizers match the library" ||
    fail "SentencePiece tokenizers differ from the library (above)"
finish
