# tests/deployment.sh - what production machines do to loom: a container's CPU quota caps the
# CPU backend's default thread count (fake cgroup v1 and v2 files stand in for a container,
# through the test-only LOOM_TEST_SYSROOT prefix).
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
finish
