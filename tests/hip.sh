# tests/hip.sh - the HIP module: built from the CUDA backend's own kernel source (one source,
# two compilers), it loads wherever ROCm's runtime is installed, and on a machine without an
# AMD GPU it says so and the CPU is chosen. On an AMD GPU it must conform.
. "$top_srcdir/tests/lib.sh"
unset LOOM_BACKEND LOOM_CPU_VARIANT LOOM_CPU_MAX_ISA LOOM_EXPLAIN LOOM_BACKEND_PATH

module="$top_builddir/backends/gpu/.libs/loom-hip.so"
if [ "$LOOM_BUILT_HIP" != yes ]; then
    echo "SKIP: the HIP backend was not configured (no hipcc/libamdhip64; see ./configure's summary)"
    exit 77
fi
[ -f "$module" ] || { fail "configure enabled HIP but $module was not built"; finish; }

# one kernel source: both modules' device code comes from backends/gpu/gpu_backend.cu
[ "$(grep -c -- '-c $(top_srcdir)/backends/gpu/gpu_backend.cu' "$top_builddir/Makefile")" -eq 2 ] &&
    [ "$(find "$top_srcdir/backends" -name '*.cu' -o -name '*.cuh' | wc -l)" -eq 2 ] &&
    pass "HIP and CUDA kernels are one source" || fail "the GPU modules have kernels of their own"
nm -D --defined-only "$module" | awk '{print $3}' > "$tmpdir/exports.txt"
[ "$(cat "$tmpdir/exports.txt")" = loom_backend_entry ] && pass "exports only loom_backend_entry" ||
    { fail "exports more than the entry point:"; head "$tmpdir/exports.txt" >&2; }

"$LOOM" backends --json > "$tmpdir/all.json" || fail "loom backends --json: exit $?"
jq -e '.candidates[] | select(.name == "hip")' "$tmpdir/all.json" > "$tmpdir/hip.json" ||
    { fail "hip is not among the candidates"; cat "$tmpdir/all.json" >&2; finish; }
if jq -e '.usable' "$tmpdir/hip.json" > /dev/null; then
    if "$CONFORMANCE" --quiet hip > "$tmpdir/conf.txt" 2>&1; then pass "hip conforms"
    else fail "hip conformance:"; cat "$tmpdir/conf.txt" >&2; fi
    finish
fi
reason=$(jq -r '.reason' "$tmpdir/hip.json")
case "$reason" in
    "no device"*|"no usable device"*) pass "probe reason: $reason" ;;
    *) fail "unexpected probe reason: '$reason'" ;;
esac
best=$(best_of "$tmpdir/all.json")
case "$best" in cpu*) pass "the CPU is chosen instead ($best)" ;; *) fail "chosen: $best" ;; esac
if LOOM_BACKEND=hip "$LOOM" backends > /dev/null 2> "$tmpdir/err.txt"; then
    fail "LOOM_BACKEND=hip should fail without an AMD GPU"
else
    expect_grep "'hip' is not usable here" "$tmpdir/err.txt" "LOOM_BACKEND=hip refused"
    expect_grep "hip: unusable here (no" "$tmpdir/err.txt" "with the probe's reason"
fi
finish
