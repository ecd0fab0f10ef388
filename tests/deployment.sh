# tests/deployment.sh - what production machines do to loom: a container's CPU quota caps the
# CPU backend's default thread count (fake cgroup v1 and v2 files stand in for a container,
# through the test-only LOOM_TEST_SYSROOT prefix); a fake two-node NUMA machine; `loom verify` finds a truncated file, a
# flipped byte (by the checksum loom stores), a NaN weight and a special id past the vocabulary,
# each named with its location.
. "$top_srcdir/tests/lib.sh"
unset LOOM_BACKEND LOOM_CPU_VARIANT LOOM_CPU_MAX_ISA LOOM_EXPLAIN LOOM_BACKEND_PATH LOOM_THREADS LOOM_CPU_MASK

# ---- the thread default follows the CPU quota
root="$tmpdir/sys"
# fake_cgroup PROC_SELF_CGROUP [FILE CONTENT]...: a fresh fake root with those files
fake_cgroup() {
    rm -rf "$root"; mkdir -p "$root/proc/self"
    printf '%s\n' "$1" > "$root/proc/self/cgroup"; shift
    while [ $# -ge 2 ]; do
        mkdir -p "$root/$(dirname "$1")"; printf '%s\n' "$2" > "$root/$1"; shift 2
    done
}
# the baseline variant's device line (every CPU variant says the same)
device_detail() {
    LOOM_TEST_SYSROOT=$root "$LOOM" backends --json |
        jq -r '.candidates[] | select(.name == "cpu" and .variant == "baseline") | .devices[0].detail'
}
threads_of() { sed -n 's/.*; \([0-9]*\) threads\{0,1\}:.*/\1/p'; }

fake_cgroup "0::/" sys/fs/cgroup/cpu.max "max 100000"
unlimited=$(device_detail)
cores=$(echo "$unlimited" | threads_of)
case "$unlimited" in
    *"threads: cores in the affinity mask"* | *"1 thread: cores in the affinity mask"*)
        pass "no quota (cpu.max 'max'): $cores threads, the cores in the affinity mask" ;;
    *) fail "no quota: '$unlimited'" ;;
esac
[ -n "$cores" ] || { fail "no thread count in '$unlimited'"; finish; }
# expect DESCRIPTION QUOTA_CPUS PATTERN: the default is min(cores, quota rounded up)
expect_threads() {
    got=$(device_detail)
    want=$(awk -v q="$2" -v c="$cores" 'BEGIN {t = int(q); if (t < q) t++; if (t < 1) t = 1; print (t < c ? t : c)}')
    n=$(echo "$got" | threads_of)
    if [ "$n" = "$want" ] && echo "$got" | grep -q -- "$3"; then pass "$1: $got"
    else fail "$1: want $want threads and '$3', got '$got'"; fi
}
fake_cgroup "0::/" sys/fs/cgroup/cpu.max "50000 100000"
expect_threads "cgroup v2 quota of half a CPU" 0.5 "cgroup cpu.max quota 0.50 CPUs"
# a parent's limit binds its children (Kubernetes: the pod's limit above the container's)
fake_cgroup "0::/kubepods/pod1/ctr" sys/fs/cgroup/kubepods/cpu.max "100000 100000" \
    sys/fs/cgroup/kubepods/pod1/cpu.max "max 100000" sys/fs/cgroup/kubepods/pod1/ctr/cpu.max "300000 100000"
expect_threads "nested cgroup v2 groups: the smallest quota on the path" 1 "quota 1.00 CPUs"
# cgroup v1 inside a container: /proc/self/cgroup names the host's path, absent from the mount
fake_cgroup "4:cpu,cpuacct:/docker/0123abcd
2:memory:/docker/0123abcd" sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us 150000 \
    sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us 100000
expect_threads "cgroup v1 quota of 1.5 CPUs, rounded up" 1.5 "quota 1.50 CPUs"
fake_cgroup "4:cpu,cpuacct:/" sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us -1 \
    sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us 100000
expect_threads "cgroup v1 without a quota (-1)" 100000 "cores in the affinity mask"
fake_cgroup "garbage without colons" sys/fs/cgroup/cpu.max "not a number"
expect_threads "unreadable cgroup files: no cap" 100000 "cores in the affinity mask"
# LOOM_THREADS wins, and says so
fake_cgroup "0::/" sys/fs/cgroup/cpu.max "50000 100000"
LOOM_THREADS=3 LOOM_TEST_SYSROOT=$root "$LOOM" backends | grep -q "LOOM_THREADS=3" &&
    pass "LOOM_THREADS is named on the device line when set" || fail "LOOM_THREADS not shown"

# ---- NUMA: a fake two-node machine (one CPU per node) is shown, and LOOM_NUMA=local binds the
# workers without changing a token (tests/test_numa checks the plan and the binding itself)
story=$(suite_model tiny)
if [ "$(nproc)" -ge 2 ]; then
    fake_cgroup "0::/"
    cpus=$(sed -n 's/^Cpus_allowed_list:[[:space:]]*//p' /proc/self/status)
    first=$(echo "$cpus" | sed 's/[-,].*//')
    mkdir -p "$root/sys/devices/system/node/node0" "$root/sys/devices/system/node/node1"
    echo "$first" > "$root/sys/devices/system/node/node0/cpulist"
    echo "$cpus" | sed "s/^$first,//; s/^$first-/$((first + 1))-/" > "$root/sys/devices/system/node/node1/cpulist"
    case "$(device_detail)" in
        *"2 NUMA nodes ("*"cpus), interleave (simulated)"*) pass "two fake NUMA nodes shown, interleave by default: $(device_detail | sed 's/.*; //')" ;;
        *) fail "fake NUMA nodes: '$(device_detail)'" ;;
    esac
    LOOM_NUMA=local device_detail | grep -q "local (simulated)" && pass "LOOM_NUMA=local is shown" ||
        fail "LOOM_NUMA=local not shown"
    "$LOOM" run -m "$story" -p "Once upon a time" -n 24 --temp 0 > "$tmpdir/plain.txt" 2>/dev/null
    LOOM_NUMA=local LOOM_TEST_SYSROOT=$root "$LOOM" run -m "$story" -p "Once upon a time" -n 24 --temp 0 \
        > "$tmpdir/local.txt" 2>/dev/null
    [ -s "$tmpdir/plain.txt" ] && cmp -s "$tmpdir/plain.txt" "$tmpdir/local.txt" &&
        pass "threads bound per node: the same text" || fail "LOOM_NUMA=local changed the text"
else
    echo "one CPU: the fake two-node checks need two (tests/test_numa still runs)"
fi
LOOM_NUMA=nearby "$LOOM" run -m "$story" -p "Once" -n 2 > /dev/null 2> "$tmpdir/numa.err"
[ $? -ne 0 ] && expect_grep "LOOM_NUMA=nearby is not one of off, interleave, local" "$tmpdir/numa.err" \
    "a bad LOOM_NUMA stops loom, naming the choices" || fail "LOOM_NUMA=nearby accepted"

# ---- loom verify: a damaged file is found and the damage located
good="$tmpdir/good.gguf"
"$LOOM" quantize "$story" "$good" --type f32 --quiet > /dev/null 2>&1 || fail "quantize to f32"
"$LOOM" verify "$good" > "$tmpdir/v0.txt" 2>&1 && pass "a file loom wrote verifies" ||
    { fail "a sound file: exit $?"; cat "$tmpdir/v0.txt" >&2; }
expect_grep "^ok *checksum *all 21 tensors match" "$tmpdir/v0.txt" "its checksums are checked"
src="$FIXTURES/stories260K/original/stories260K.gguf"
if have_fixture "$src" "verifying a file llama.cpp wrote"; then
    "$LOOM" verify "$src" > "$tmpdir/v1.txt" 2>&1 && grep -q "^skipped *checksum" "$tmpdir/v1.txt" &&
        pass "a file written elsewhere verifies, its missing checksums said" ||
        { fail "the fixture itself:"; cat "$tmpdir/v1.txt" >&2; }
fi
"$LOOM" inspect "$good" | grep -q "checksums: xxh3-64 per tensor, all 21 match" &&
    pass "loom inspect shows the checksums match" || fail "loom inspect: no checksum line"

# a tensor's offset in the file (from loom inspect --json)
offset_of() { "$LOOM" inspect "$1" --json | jq -r --arg n "$2" '.tensors[] | select(.name == $n) | .offset'; }
# poke FILE OFFSET HEXBYTES: overwrite bytes in place
# (octal escapes: POSIX printf, dash's included, has no \x)
poke() {
    bytes=$(echo "$3" | sed 's/../& /g') esc=""
    for b in $bytes; do esc="$esc$(printf '\\%03o' "0x$b")"; done
    printf "$esc" | dd of="$1" bs=1 seek="$2" conv=notrunc status=none
}

# a download cut short
size=$(wc -c < "$good")
head -c $((size - 5000)) "$good" > "$tmpdir/cut.gguf"
"$LOOM" verify "$tmpdir/cut.gguf" > "$tmpdir/v2.txt" 2>&1
[ $? -eq 1 ] && grep -q "^PROBLEM *file .*truncated" "$tmpdir/v2.txt" &&
    pass "a truncated file: $(grep PROBLEM "$tmpdir/v2.txt" | cut -c 21-140)" ||
    { fail "truncated file:"; cat "$tmpdir/v2.txt" >&2; }

# a flipped byte inside a weight: only the checksum can tell
cp "$good" "$tmpdir/flip.gguf"
off=$(offset_of "$good" blk.1.ffn_up.weight)
poke "$tmpdir/flip.gguf" $((off + 101)) 3f
"$LOOM" verify "$tmpdir/flip.gguf" > "$tmpdir/v3.txt" 2>&1
[ $? -eq 1 ] && grep -q "^PROBLEM *checksum *tensor 'blk.1.ffn_up.weight'" "$tmpdir/v3.txt" &&
    pass "a flipped byte: the checksum names blk.1.ffn_up.weight" ||
    { fail "flipped byte:"; cat "$tmpdir/v3.txt" >&2; }
"$LOOM" inspect "$tmpdir/flip.gguf" | grep -q "DIFFER.*blk.1.ffn_up.weight" &&
    pass "loom inspect says the checksum no longer matches" || fail "loom inspect missed the flip"

# a NaN weight (f32 quiet NaN, little-endian), element 5 of a norm
cp "$good" "$tmpdir/nan.gguf"
off=$(offset_of "$good" blk.1.attn_norm.weight)
poke "$tmpdir/nan.gguf" $((off + 20)) 0000c07f
"$LOOM" verify "$tmpdir/nan.gguf" > "$tmpdir/v4.txt" 2>&1
[ $? -eq 1 ] && grep -q "^PROBLEM *values *tensor 'blk.1.attn_norm.weight' holds NaN at element 5 " "$tmpdir/v4.txt" &&
    pass "a NaN weight: named with its tensor and element" ||
    { fail "NaN weight:"; cat "$tmpdir/v4.txt" >&2; }

# a special id past the vocabulary (the u32 after the key and its type)
cp "$good" "$tmpdir/bos.gguf"
key=tokenizer.ggml.bos_token_id
at=$(grep -obUa "$key" "$good" | head -1 | cut -d: -f1)
poke "$tmpdir/bos.gguf" $((at + ${#key} + 4)) 0f270000
"$LOOM" verify "$tmpdir/bos.gguf" > "$tmpdir/v5.txt" 2>&1
[ $? -eq 1 ] && grep -q "^PROBLEM *tokenizer *$key is 9999, but the vocabulary has 512 tokens" "$tmpdir/v5.txt" &&
    pass "a special id past the vocabulary is named" || { fail "bos id 9999:"; cat "$tmpdir/v5.txt" >&2; }

"$LOOM" verify "$tmpdir/nan.gguf" --json > "$tmpdir/v6.json"
jq -e '.ok == false and .problems >= 1 and ([.checks[] | select(.status == "problem") | .check] | index("values") != null)' \
    "$tmpdir/v6.json" > /dev/null && pass "--json: ok false, the problem checks listed" ||
    { fail "--json:"; cat "$tmpdir/v6.json" >&2; }
"$LOOM" verify "$tmpdir/nosuch.gguf" > "$tmpdir/v7.txt" 2>&1
[ $? -eq 1 ] && expect_grep "nosuch.gguf" "$tmpdir/v7.txt" "a missing file is named" || fail "missing file: exit not 1"
"$LOOM" verify > /dev/null 2>&1; [ $? -eq 2 ] && pass "no file: usage error" || fail "no file: exit not 2"
finish
