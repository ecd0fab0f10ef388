# tests/cli.sh - `loom backends` as a user sees it: the report, --json, LOOM_EXPLAIN, the env
# vars' errors, and broken modules listed with their reasons instead of taking loom down.
. "$top_srcdir/tests/lib.sh"
unset LOOM_BACKEND LOOM_CPU_VARIANT LOOM_CPU_MAX_ISA LOOM_EXPLAIN LOOM_BACKEND_PATH

# the build tree's own modules are found with no env var set, and the best usable one chosen
"$LOOM" backends > "$tmpdir/plain.txt" 2>&1 || fail "loom backends exited $?"
"$LOOM" backends --json > "$tmpdir/plain.json" || fail "loom backends --json exited $?"
best=$(best_of "$tmpdir/plain.json")
echo "best usable backend here: $best"
expect_grep "^\* $best\$" "$tmpdir/plain.txt" "the highest-scoring usable backend is chosen"
expect_grep "backends/ref/.libs/loom-ref.so" "$tmpdir/plain.txt" "report shows ref's path"
# every module this build made must load and vet (a module that fails to dlopen would
# otherwise just be skipped by the conformance run)
broken=$(jq -r '.candidates[] | select(.status == "not loadable" or .status == "no entry point"
                 or .status == "incompatible ABI") | .path + ": " + .reason' "$tmpdir/plain.json")
[ -z "$broken" ] && pass "every built module loads" || fail "modules that do not load: $broken"
[ "$(jq -r '.chosen' "$tmpdir/plain.json")" = "$(jq -r '[.candidates[] | select(.chosen)][0].path' "$tmpdir/plain.json")" ] ||
    fail "json: chosen path disagrees with the chosen candidate"

# every broken test module is listed, with its reason, and loom still works
LOOM_BACKEND_PATH="$PLUGIN_DIR" "$LOOM" backends > "$tmpdir/all.txt" 2>&1 || fail "exit $?"
expect_grep "libloom-test-gone.so: cannot open shared object file" "$tmpdir/all.txt" "missing dependency reason"
expect_grep "no loom_backend_entry symbol" "$tmpdir/all.txt" "missing entry reason"
expect_grep "built for backend ABI 2.0" "$tmpdir/all.txt" "major mismatch reason"
expect_grep "no device: the fake probe found none" "$tmpdir/all.txt" "no-device reason"
expect_grep "^\* cpu-avx512" "$tmpdir/all.txt" "highest score wins"
expect_grep "score 1 is below cpu-avx512's 300" "$tmpdir/all.txt" "why ref lost"
LOOM_BACKEND=ref "$LOOM" backends > "$tmpdir/ref.txt" 2>&1 || fail "LOOM_BACKEND=ref exit $?"
expect_grep "^\* ref" "$tmpdir/ref.txt" "LOOM_BACKEND picks a lower-scoring backend"

# a module found again later in the search is shadowed by the first: LOOM_BACKEND_PATH wins
ref_path=$(jq -r '.candidates[] | select(.name == "ref") | .path' "$tmpdir/plain.json")
mkdir -p "$tmpdir/shadow" && cp "$ref_path" "$tmpdir/shadow/" || fail "copy $ref_path"
LOOM_BACKEND_PATH="$tmpdir/shadow" LOOM_BACKEND=ref "$LOOM" backends --json > "$tmpdir/shadow.json" ||
    fail "backends with a shadowing module: exit $?"
jq -e --arg first "$tmpdir/shadow/$(basename "$ref_path")" --arg later "$ref_path" \
    '.chosen == $first and any(.candidates[]; .path == $later and .status == "excluded" and
                                             (.reason | startswith("shadowed by " + $first)))' \
    "$tmpdir/shadow.json" > /dev/null && pass "the first module of a name is used, later copies shadowed" ||
    { fail "shadowing:"; cat "$tmpdir/shadow.json" >&2; }

# --json is valid JSON with the fields the issue lists
LOOM_BACKEND_PATH="$PLUGIN_DIR" "$LOOM" backends --json > "$tmpdir/all.json" || fail "--json exit $?"
if jq -e '.candidates | length > 5' "$tmpdir/all.json" > /dev/null &&
   jq -e '[.candidates[] | select(.chosen)] | length == 1' "$tmpdir/all.json" > /dev/null &&
   jq -e '. as $r | .candidates[] | select(.name == "ref") | .abi_version == "\($r.abi.major).\($r.abi.minor)" and .score == 1 and (.devices[0].memory_bytes > 0)' "$tmpdir/all.json" > /dev/null &&
   jq -e '.candidates[] | select(.name == "nodevice") | .usable == false and (.reason | test("no device"))' "$tmpdir/all.json" > /dev/null
then pass "json report"; else fail "json report:"; cat "$tmpdir/all.json" >&2; fi

# LOOM_EXPLAIN sends the report to stderr for any command
LOOM_EXPLAIN=1 "$LOOM" version > "$tmpdir/out.txt" 2> "$tmpdir/err.txt" || true
LOOM_EXPLAIN=1 "$LOOM" backends --json > /dev/null 2> "$tmpdir/err.txt"
expect_grep "chosen: $best, device 0" "$tmpdir/err.txt" "LOOM_EXPLAIN report on stderr"

# a wrong LOOM_BACKEND is an error that lists what there is
if LOOM_BACKEND=metal "$LOOM" backends > /dev/null 2> "$tmpdir/err.txt"; then
    fail "LOOM_BACKEND=metal should fail here"
fi
expect_grep "no backend named 'metal'" "$tmpdir/err.txt" "unknown backend named"
expect_grep "ref: usable" "$tmpdir/err.txt" "available backends listed"
if LOOM_BACKEND_PATH="$PLUGIN_DIR" LOOM_BACKEND=nodevice "$LOOM" backends > /dev/null 2> "$tmpdir/err.txt"; then
    fail "LOOM_BACKEND=nodevice should fail"
fi
expect_grep "'nodevice' is not usable here" "$tmpdir/err.txt" "unusable backend named"
LOOM_BACKEND_PATH="$PLUGIN_DIR" LOOM_CPU_MAX_ISA=avx2 "$LOOM" backends > "$tmpdir/cap.txt" 2>&1 || fail "cap exit $?"
expect_grep "^\* cpu-avx2" "$tmpdir/cap.txt" "LOOM_CPU_MAX_ISA caps the variant"
expect_grep "above LOOM_CPU_MAX_ISA=avx2" "$tmpdir/cap.txt" "the cap is explained"
LOOM_BACKEND_PATH="$PLUGIN_DIR" LOOM_CPU_VARIANT=baseline "$LOOM" backends > "$tmpdir/force.txt" 2>&1 || fail "force exit $?"
expect_grep "^\* cpu-baseline" "$tmpdir/force.txt" "LOOM_CPU_VARIANT forces the variant"

# LOOM_CPU_MASK: the real CPU modules' probes act as on a machine without those features
LOOM_CPU_MASK=avx512,avx2 "$LOOM" backends --json > "$tmpdir/mask.json" || fail "mask exit $?"
jq -e '(.candidates[] | select(.name == "cpu" and .variant == "baseline") | .chosen) and
       (.candidates[] | select(.name == "cpu" and .variant == "avx2") | .usable == false and
        (.reason | test("lacks AVX2.*hidden by LOOM_CPU_MASK=avx512,avx2")))' "$tmpdir/mask.json" > /dev/null &&
    pass "masked to a machine without AVX, baseline is chosen and avx2 says why not" ||
    { fail "LOOM_CPU_MASK=avx512,avx2:"; cat "$tmpdir/mask.json" >&2; }
LOOM_CPU_MASK=avx512 "$LOOM" backends --json > "$tmpdir/mask.json" || fail "mask exit $?"
jq -e '.candidates[] | select(.name == "cpu" and .variant == "avx512") | .usable == false and .score == 0
       and (.reason | test("lacks AVX-512"))' "$tmpdir/mask.json" > /dev/null &&
    pass "masked to a machine without AVX-512, the avx512 variant is unusable" ||
    { fail "LOOM_CPU_MASK=avx512:"; cat "$tmpdir/mask.json" >&2; }
LOOM_CPU_MASK=avx2,sse9 "$LOOM" backends > /dev/null 2> "$tmpdir/err.txt" && fail "LOOM_CPU_MASK=avx2,sse9 accepted"
expect_grep "LOOM_CPU_MASK=avx2,sse9: 'sse9' is not a CPU feature" "$tmpdir/err.txt" "a bad LOOM_CPU_MASK is an error naming the word"

# modules whose probe aborts, segfaults, hangs or exits are listed with what happened; loom goes on
LOOM_PROBE_TIMEOUT=1 LOOM_BACKEND_PATH="$PROBEFAIL_DIR" "$LOOM" backends > "$tmpdir/pf.txt" 2>&1 ||
    fail "loom backends with crashing probes: exit $?"
expect_grep "probe crashed (signal 6, Aborted)" "$tmpdir/pf.txt" "an aborting probe is named"
expect_grep "probe crashed (signal 11, Segmentation fault)" "$tmpdir/pf.txt" "a crashing probe is named"
expect_grep "probe timed out after 1 s" "$tmpdir/pf.txt" "a hanging probe is named"
expect_grep "probe exited (status 3)" "$tmpdir/pf.txt" "an exiting probe is named"
expect_grep "^\* $best\$" "$tmpdir/pf.txt" "and the best real backend is still chosen"
# modules that attack the loader: 8 KiB written into the probe's pipe (read past a buffer once),
# a probe that exits leaving a process holding the pipe (the full timeout once, and that
# process left running)
start=$(date +%s)
FAKE_PIDFILE="$tmpdir/orphan.pid" LOOM_PROBE_TIMEOUT=60 LOOM_BACKEND_PATH="$PROBEHOSTILE_DIR" \
    "$LOOM" backends --json > "$tmpdir/ph.json" 2> "$tmpdir/ph.err" || fail "loom backends beside hostile modules: exit $?"
took=$(( $(date +%s) - start ))
[ "$took" -lt 20 ] && pass "a probe that leaves a process holding its pipe costs no timeout ($took s of 60)" ||
    fail "hostile probes took $took s"
jq -e '.candidates[] | select(.name == "" or .name == null) | select(.reason | test("not one loom sent"))' \
    "$tmpdir/ph.json" > /dev/null && pass "a probe whose pipe a module wrote into is refused, its bytes unread" ||
    { fail "the flooded probe:"; jq -c '.candidates[]' "$tmpdir/ph.json" >&2; }
jq -e '.candidates[] | select(.reason | test("probe exited \\(status 4\\)"))' "$tmpdir/ph.json" > /dev/null &&
    pass "the probe that left a process behind is reported as exiting" ||
    { fail "the orphaning probe:"; jq -c '.candidates[]' "$tmpdir/ph.json" >&2; }
if [ -s "$tmpdir/orphan.pid" ]; then
    orphan=$(cat "$tmpdir/orphan.pid")
    for i in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do # SIGKILL takes a moment
        { [ -e "/proc/$orphan" ] && [ "$(cut -d' ' -f3 "/proc/$orphan/stat" 2>/dev/null)" != Z ]; } || break
        sleep 0.1
    done
    if [ -e "/proc/$orphan" ] && [ "$(cut -d' ' -f3 "/proc/$orphan/stat" 2>/dev/null)" != Z ]; then
        fail "the process the probe left ($orphan) still runs"; kill -9 "$orphan"
    else
        pass "the process the probe left is killed with the probe"
    fi
else
    fail "the orphaning probe wrote no pid file"
fi
LOOM_PROBE_TIMEOUT=1 "$CONFORMANCE" "$PROBEFAIL_DIR/fake-probe-segv.so" > "$tmpdir/pfc.txt" 2>&1
[ $? -eq 1 ] && pass "conformance fails a crashing probe (exit 1)" || fail "conformance on a crashing probe: exit $?"
expect_grep "FAIL loads, declares a compatible ABI and probes usable: probe failed: probe crashed" \
    "$tmpdir/pfc.txt" "conformance names the crash"

# every command has --help: its usage on stdout, exit 0
for c in backends run chat serve tokenize detokenize quantize convert inspect verify bench perplexity \
         "bench ops" "bench serve"; do
    # shellcheck disable=SC2086
    "$LOOM" $c --help > "$tmpdir/help.txt" 2> "$tmpdir/help.err"; rc=$?
    [ "$rc" = 0 ] && grep -q "^usage: loom $c" "$tmpdir/help.txt" ||
        fail "loom $c --help: exit $rc, $(head -c 200 "$tmpdir/help.txt" "$tmpdir/help.err")"
done
pass "every command's --help prints its usage"
# run, chat and serve take the sampling flags from one table: the same flags, the same errors
for c in run chat serve; do
    "$LOOM" $c --help | grep -q -- "--frequency-penalty X" || fail "loom $c --help lacks the sampling flags"
    "$LOOM" $c -m /nonexistent --top-k many > /dev/null 2> "$tmpdir/err.txt" && fail "$c: bad --top-k accepted"
    expect_grep "loom $c: --top-k wants a whole number from 0 to 16777216, not 'many'" "$tmpdir/err.txt" \
        "loom $c names a bad sampling value"
done

# one parser for every command's flags (tools/args.c): an unknown flag, a flag without its
# value and a value outside a flag's choices are each named with the command, exit 2
for c in backends run chat serve tokenize detokenize quantize convert bench perplexity "bench ops" \
         "bench serve"; do
    # shellcheck disable=SC2086
    "$LOOM" $c --frobnicate > /dev/null 2> "$tmpdir/err.txt"; rc=$?
    [ "$rc" = 2 ] && grep -q "^loom $c: unknown option '--frobnicate'" "$tmpdir/err.txt" &&
        grep -q "^usage: loom $c" "$tmpdir/err.txt" ||
        fail "loom $c --frobnicate: exit $rc, $(head -c 300 "$tmpdir/err.txt")"
done
pass "every command names an unknown option and shows its usage"
"$CONFORMANCE" --frobnicate > /dev/null 2> "$tmpdir/err.txt"; rc=$?
[ "$rc" = 2 ] && expect_grep "^loom-conformance: unknown option '--frobnicate'" "$tmpdir/err.txt" \
    "loom-conformance names an unknown option" || fail "loom-conformance --frobnicate: exit $rc"
for c in "run -m" "chat -m" "serve --port" "convert -o" "bench -p" "perplexity -f"; do
    # shellcheck disable=SC2086
    "$LOOM" $c > /dev/null 2> "$tmpdir/err.txt" && fail "loom $c without a value accepted"
    expect_grep "^loom ${c% *}: ${c#* } needs a value" "$tmpdir/err.txt" "loom $c: the missing value named"
done
for c in run chat serve perplexity; do
    "$LOOM" $c -m /nonexistent --kv-type f8 > /dev/null 2> "$tmpdir/err.txt" &&
        fail "$c: --kv-type f8 accepted"
    expect_grep "^loom $c: --kv-type is one of f16|f32|q8_0, not 'f8'" "$tmpdir/err.txt" \
        "loom $c names a --kv-type outside its choices"
done

# bad usage
"$LOOM" frobnicate > /dev/null 2> "$tmpdir/err.txt" && fail "bad command accepted"
expect_grep "unknown command 'frobnicate'" "$tmpdir/err.txt" "bad command named"
finish
