# tests/trace.sh - the trace plugin (plugins/trace) as a user meets it. LOOM_TRACE=FILE around
# `loom run` leaves the output the same, writes trace-event JSON that parses, with one event
# per op call (counted from the Llama graph, not from the plugin: a pass runs 7 matmuls a layer
# plus the output head, one attention a layer, ...), and prints a per-op table that agrees with
# the file; LOOM_PROFILE=1 prints the table alone; mistakes are named. That the decorator is
# transparent op by op is loom-conformance's part (tests/conformance.sh checks every module).
. "$top_srcdir/tests/lib.sh"
unset LOOM_BACKEND LOOM_CPU_VARIANT LOOM_CPU_MAX_ISA LOOM_EXPLAIN LOOM_BACKEND_PATH LOOM_TRACE \
    LOOM_PROFILE
# any model does: loom's synthetic one (deterministic weights, f32 so the matmuls' dtype is
# known), written here, so this runs without the shared fixtures
gguf="$tmpdir/tiny.gguf"
"$LOOM" bench --synthetic tiny --type f32 --write "$gguf" >"$tmpdir/write.log" 2>&1 ||
    { fail "writing the synthetic model: $(cat "$tmpdir/write.log")"; finish; }
n=8

"$LOOM" run -m "$gguf" -p "Once upon a time" -n $n --temp 0 --json > "$tmpdir/plain.json" \
    2> /dev/null || fail "untraced run: exit $?"
LOOM_TRACE="$tmpdir/t.json" "$LOOM" run -m "$gguf" -p "Once upon a time" -n $n --temp 0 --json \
    > "$tmpdir/traced.json" 2> "$tmpdir/traced.err" || fail "traced run: exit $?"
[ "$(jq -c '[.generated_ids, .text]' "$tmpdir/plain.json")" = \
  "$(jq -c '[.generated_ids, .text]' "$tmpdir/traced.json")" ] &&
    pass "traced output equals untraced" || fail "tracing changed the output"
[ "$(jq '.generated_ids | length' "$tmpdir/traced.json")" -eq $n ] || fail "did not generate $n tokens"

if jq -e '.traceEvents | type == "array"' "$tmpdir/t.json" > /dev/null 2>&1; then
    pass "the trace is JSON with a traceEvents array"
else
    fail "the trace is not valid trace JSON:"; head -c 2000 "$tmpdir/t.json" >&2
fi
jq -e '[.traceEvents[] | select(.ph == "X")] | length > 0 and
       all(.name != null and (.ts | type) == "number" and .dur >= 0 and .pid == 1 and .tid == 1)' \
    "$tmpdir/t.json" > /dev/null && pass "every event is complete (name, ts, dur >= 0)" ||
    fail "events lack fields"
jq -e '[.traceEvents[] | select(.ph == "X") | .ts] | . == sort' "$tmpdir/t.json" > /dev/null &&
    pass "events are in time order" || fail "events out of order"

# one event per op call: one prefill pass over the prompt, then one pass per token but the last
layers=$("$LOOM" inspect "$gguf" | awk '$1 == "llama.block_count" { print $2 }')
passes=$n
ops() { jq "[.traceEvents[] | select(.cat == \"op\" and .name == \"$1\")] | length" "$tmpdir/t.json"; }
for want in "matmul $((passes * (7 * layers + 1)))" "attention $((passes * layers))" \
            "rms_norm $((passes * (2 * layers + 1)))" "kv_store $((passes * 2 * layers))" \
            "rope $((passes * 2 * layers))" "silu_mul $((passes * layers))"; do
    set -- $want
    got=$(ops "$1")
    [ "$got" -eq "$2" ] && pass "$1: $2 events ($passes passes of $layers layers)" ||
        fail "$1: $got events, want $2"
done
jq -e '[.traceEvents[] | select(.name == "matmul")][0].args |
       .dtype == "f32" and (.tensors | test("^x f32\\[[0-9]+,[0-9]+\\] w f32\\[[0-9]+,[0-9]+\\] y f32")) and .bytes > 0' \
    "$tmpdir/t.json" > /dev/null && pass "a matmul event names its dtype, shapes and bytes" ||
    fail "matmul event args: $(jq -c '[.traceEvents[] | select(.name == "matmul")][0]' "$tmpdir/t.json")"

# the table on stderr counts what the file holds, call by call
expect_grep "^loom trace: .* backend calls, events in $tmpdir/t.json" "$tmpdir/traced.err" \
    "the table names the file"
for call in matmul attention rms_norm copy_to_host buffer_alloc; do
    table=$(awk -v c="$call" '$1 == c { n += $3 } END { print n + 0 }' "$tmpdir/traced.err")
    file=$(jq "[.traceEvents[] | select(.name == \"$call\")] | length" "$tmpdir/t.json")
    [ "$table" -eq "$file" ] && [ "$file" -gt 0 ] && pass "table and file agree on $call ($file)" ||
        fail "$call: the table says $table, the file holds $file"
done

# LOOM_PROFILE=1: the table alone
(cd "$tmpdir" && LOOM_PROFILE=1 "$LOOM" run -m "$gguf" -p "Once" -n 4 --temp 0 > /dev/null \
    2> "$tmpdir/profile.err") || fail "LOOM_PROFILE=1 run failed"
expect_grep "^loom trace: .* backend calls$" "$tmpdir/profile.err" "LOOM_PROFILE=1 prints the table"
expect_grep "^  matmul " "$tmpdir/profile.err" "the table has a matmul row"

# mistakes
LOOM_TRACE="$tmpdir/no/such/dir/t.json" "$LOOM" run -m "$gguf" -p hi -n 2 > /dev/null \
    2> "$tmpdir/e1" && fail "an uncreatable trace file was accepted"
expect_grep "cannot create the trace file $tmpdir/no/such/dir/t.json" "$tmpdir/e1" \
    "an uncreatable trace file is named"
LOOM_BACKEND=trace "$LOOM" run -m "$gguf" -p hi -n 2 > /dev/null 2> "$tmpdir/e2" &&
    fail "LOOM_BACKEND=trace was accepted"
expect_grep "'trace' is a decorator, not a backend" "$tmpdir/e2" "LOOM_BACKEND=trace explained"
finish
