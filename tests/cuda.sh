# tests/cuda.sh - the CUDA module as the same package sees it everywhere: it loads without the
# driver or cuBLAS installed, says why it cannot run on a machine without an NVIDIA GPU, and
# asking for it by name fails with that reason. On a machine with a GPU it must conform.
. "$top_srcdir/tests/lib.sh"
unset LOOM_BACKEND LOOM_CPU_VARIANT LOOM_CPU_MAX_ISA LOOM_EXPLAIN LOOM_BACKEND_PATH

module="$top_builddir/backends/gpu/.libs/loom-cuda.so"
if [ "$LOOM_BUILT_CUDA" != yes ]; then
    echo "SKIP: the CUDA backend was not configured (no nvcc/cuBLAS; see ./configure's summary)"
    exit 77
fi
[ -f "$module" ] || { fail "configure enabled CUDA but $module was not built"; finish; }

# nothing from CUDA is a load-time dependency: the runtime is static, the rest is dlopened
objdump -p "$module" | awk '/NEEDED/ {print $2}' > "$tmpdir/needed.txt"
if grep -Eq 'libcuda|libcudart|libcublas' "$tmpdir/needed.txt"; then
    fail "the module links CUDA libraries dynamically:"; cat "$tmpdir/needed.txt" >&2
else
    pass "no CUDA library among the module's load-time dependencies"
fi
nm -D --defined-only "$module" | awk '{print $3}' > "$tmpdir/exports.txt"
[ "$(cat "$tmpdir/exports.txt")" = loom_backend_entry ] && pass "exports only loom_backend_entry" ||
    { fail "exports more than the entry point:"; head "$tmpdir/exports.txt" >&2; }

"$LOOM" backends --json > "$tmpdir/all.json" || fail "loom backends --json: exit $?"
jq -e '.candidates[] | select(.name == "cuda")' "$tmpdir/all.json" > "$tmpdir/cuda.json" ||
    { fail "cuda is not among the candidates"; cat "$tmpdir/all.json" >&2; finish; }

if jq -e '.usable' "$tmpdir/cuda.json" > /dev/null; then
    # a GPU machine: the module must win the choice and pass the conformance tool
    jq -e '.chosen' "$tmpdir/cuda.json" > /dev/null && pass "a usable GPU is chosen over the CPU" ||
        fail "cuda is usable but not chosen"
    if "$CONFORMANCE" --quiet cuda > "$tmpdir/conf.txt" 2>&1; then
        pass "cuda conforms"
    else
        fail "cuda conformance:"; cat "$tmpdir/conf.txt" >&2
    fi
    finish
fi

# no GPU here: the reason is one a user can act on, and nothing else changes
reason=$(jq -r '.reason' "$tmpdir/cuda.json")
case "$reason" in
    "no driver"*|"no device"*|"no usable device"*|"driver too old"*|"no cuBLAS"*)
        pass "probe reason: $reason" ;;
    *) fail "unexpected probe reason: '$reason'" ;;
esac
jq -e '.score == 0 and (.devices | length) == 0' "$tmpdir/cuda.json" > /dev/null &&
    pass "unusable: score 0, no devices" || { fail "cuda candidate:"; cat "$tmpdir/cuda.json" >&2; }
best=$(best_of "$tmpdir/all.json")
case "$best" in cpu*) pass "the CPU is chosen instead ($best)" ;; *) fail "chosen: $best" ;; esac

for want in cuda cuda:1; do
    if LOOM_BACKEND=$want "$LOOM" backends > /dev/null 2> "$tmpdir/err.txt"; then
        fail "LOOM_BACKEND=$want should fail without a GPU"
    else
        expect_grep "'cuda' is not usable here" "$tmpdir/err.txt" "LOOM_BACKEND=$want: refused"
        expect_grep "cuda: unusable here ($reason" "$tmpdir/err.txt" "LOOM_BACKEND=$want: the probe's reason is shown"
    fi
done
# a preference list falls through to the next usable entry
LOOM_BACKEND=cuda,cpu "$LOOM" backends > "$tmpdir/list.txt" 2>&1 || fail "LOOM_BACKEND=cuda,cpu: exit $?"
expect_grep "^\* cpu" "$tmpdir/list.txt" "LOOM_BACKEND=cuda,cpu falls back to the CPU"

# each way a machine with a driver can still not run the module, through a fake libcuda.so.1
fake="$top_builddir/tests/fakedriver/.libs/libfakecuda.so"
if [ -f "$fake" ]; then
    mkdir -p "$tmpdir/driver" && ln -s "$fake" "$tmpdir/driver/libcuda.so.1"
    for m in "nodevice:no device: the NVIDIA driver sees no GPU" \
             "olddriver:driver too old: it supports CUDA 11.8" \
             "oldgpu:no usable device: Fake Tesla T4 is sm_75; this module was built for sm_"; do
        FAKE_CUDA=${m%%:*} LD_LIBRARY_PATH="$tmpdir/driver" "$LOOM" backends > "$tmpdir/fake.txt" 2>&1 ||
            fail "loom backends with FAKE_CUDA=${m%%:*}: exit $?"
        expect_grep "unusable here: ${m#*:}" "$tmpdir/fake.txt" "probe with a driver that reports ${m%%:*}"
    done
    FAKE_CUDA=oldgpu LD_LIBRARY_PATH="$tmpdir/driver" "$LOOM" backends --json > "$tmpdir/fake.json"
    jq -e '.candidates[] | select(.name == "cuda") | .devices[0].name == "Fake Tesla T4" and
           (.devices[0].detail | test("sm_75"))' "$tmpdir/fake.json" > /dev/null &&
        pass "an unusable GPU is still listed with its compute capability" ||
        { fail "fake GPU listing:"; cat "$tmpdir/fake.json" >&2; }
else
    fail "the fake driver $fake was not built"
fi

# the conformance tool reports the module as unusable rather than crashing
"$CONFORMANCE" "$module" > "$tmpdir/conf.txt" 2>&1
rc=$?
[ "$rc" -eq 1 ] && pass "conformance on an unusable module exits 1" || fail "conformance exit $rc, want 1"
expect_grep "unusable here: $reason" "$tmpdir/conf.txt" "conformance names the reason"
finish
