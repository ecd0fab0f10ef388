# tests/bench.sh - `loom bench` in each of its forms (a drafter, a depth, every CPU variant,
# serving, per op, a mixture of experts with its experts elsewhere), and how `loom run` chooses
# and uses a backend (ops a backend lacks run on the CPU, LOOM_STRICT, modules whose probes
# crash or whose device will not open), the help and --version: on models the suite writes.
. "$top_srcdir/tests/lib.sh"
unset LOOM_BACKEND LOOM_CPU_VARIANT LOOM_CPU_MAX_ISA LOOM_EXPLAIN LOOM_BACKEND_PATH
gguf=$(suite_model tiny)

# the benchmark with a drafter: decode with and without it, and how the drafter did
"$LOOM" bench --synthetic tiny --type q8_0 -p 0 -n 16 -r 2 --backends ref --no-roofline --json \
    --draft-layers 1 --draft-fixed --draft-p-min 0 > "$tmpdir/bench-spec.json" 2> "$tmpdir/bench-spec.err" &&
    jq -e '[.results[] | select(.test == "spec tg16")] | length == 1 and
        all(.[]; .tokens_per_s > 0 and .speedup > 0 and .acceptance >= 0 and
            (.drafter | test("first 1 layers")))' "$tmpdir/bench-spec.json" > /dev/null &&
    pass "bench --draft-layers: decode measured with the drafter beside without" ||
    { fail "bench --draft-layers"; cat "$tmpdir/bench-spec.json" "$tmpdir/bench-spec.err" >&2; }
# decode at a depth: the context's KV cache counted in the roofline (llama-bench's -d)
"$LOOM" bench --synthetic tiny --type q8_0 -p 0 -n 8 -d 64 -r 1 --backends ref --no-roofline --json \
    > "$tmpdir/bench-depth.json" 2> "$tmpdir/bench-depth.err" &&
    jq -e '[.results[] | select(.test == "tg8@d64")] | length == 1 and
        all(.[]; .tokens_per_s > 0 and .kv_bytes == 64 * 2 * 2 * 32 * 2)' \
        "$tmpdir/bench-depth.json" > /dev/null &&
    pass "bench -d: decode after 64 tokens of context, their KV bytes counted" ||
    { fail "bench -d"; cat "$tmpdir/bench-depth.json" "$tmpdir/bench-depth.err" >&2; }

# the benchmark on a synthetic model, every CPU variant
if "$LOOM" bench --synthetic tiny --type q8_0 -p 16 -n 8 -r 1 --backends cpu --no-roofline --json \
        > "$tmpdir/bench.json" 2> "$tmpdir/bench.err"; then
    n_cpu=$("$LOOM" backends --json | jq '[.candidates[] | select(.name == "cpu" and .usable)] | length')
    jq -e --argjson n "$n_cpu" '(.results | length) == 2 * $n and all(.results[]; .tokens_per_s > 0 and (has("error") | not))' \
        "$tmpdir/bench.json" > /dev/null && pass "bench: pp and tg on $n_cpu CPU variants" ||
        { fail "bench results:"; cat "$tmpdir/bench.json" >&2; }
else
    fail "bench exit:"; cat "$tmpdir/bench.err" >&2
fi
# the serving benchmark: both phases finish every request with exactly its tokens (ignore_eos)
if "$LOOM" bench serve --synthetic tiny --clients 4 --requests 6 --prompt-tokens 8 --gen-tokens 5 \
        --json > "$tmpdir/serve.json" 2> "$tmpdir/serve.err"; then
    jq -e '(.runs | length) == 2 and all(.runs[]; .failed == 0 and .requests == 6 and
            ((.generated_tokens_per_s * .seconds) - 30 | fabs) < 0.01) and .runs[1].clients == 4' \
        "$tmpdir/serve.json" > /dev/null && pass "bench serve: 6 requests x 5 tokens, alone and 4 at a time" ||
        { fail "bench serve results:"; cat "$tmpdir/serve.json" >&2; }
else
    fail "bench serve exit:"; cat "$tmpdir/serve.err" >&2
fi
# the per-op benchmark, attention only: every shape measured, none failed
if "$LOOM" bench ops --quick --op attention --backends cpu --json > "$tmpdir/ops.json" \
        2> "$tmpdir/ops.err"; then
    jq -e '([.results[] | select(.op == "attention" and .gbps > 0 and (.error | not))] | length >= 4)
           and ([.results[] | select(.op != "attention")] | length == 0)' "$tmpdir/ops.json" \
        > /dev/null && pass "bench ops --op attention: every attention shape, nothing else" ||
        { fail "bench ops results:"; cat "$tmpdir/ops.json" >&2; }
else
    fail "bench ops exit:"; cat "$tmpdir/ops.err" >&2
fi
# the experts' matmul_id at decode and at prefill, beside matmul of one expert's shape and of
# the dense twin's, and nothing else
if "$LOOM" bench ops --quick --op matmul_id --backends cpu-baseline --json > "$tmpdir/opsid.json" \
        2> "$tmpdir/opsid.err"; then
    jq -e '([.results[] | select(.op == "matmul_id" and .kind == "decode" and .gbps > 0 and (.error | not))] | length == 4)
           and ([.results[] | select(.op == "matmul_id" and .kind == "prefill" and .gflops > 0)] | length == 4)
           and ([.results[] | select(.op != "matmul_id" and .op != "matmul")] | length == 0)' \
        "$tmpdir/opsid.json" > /dev/null && pass "bench ops --op matmul_id: four dtypes measured, decode and prefill" ||
        { fail "bench ops matmul_id results:"; cat "$tmpdir/opsid.json" >&2; }
else
    fail "bench ops --op matmul_id exit:"; cat "$tmpdir/opsid.err" >&2
fi
"$LOOM" bench ops --op softmax > /dev/null 2> "$tmpdir/e7" && fail "bench ops --op softmax accepted"
expect_grep "^loom bench ops: --op is one of matmul|attention|matmul_id, not 'softmax'" "$tmpdir/e7" \
    "an op bench ops does not measure is named"
# a mixture-of-experts synthetic model: the decode roofline counts the bytes a token reads (of
# an expert stack, the share of the experts it is routed to: counted here from loom inspect's
# tensor list), and with --experts-on the experts run on another module (named in the result)
if "$LOOM" bench --synthetic moe-tiny --type q8_0 --write "$tmpdir/moe.gguf" 2> "$tmpdir/moe.err" &&
   "$LOOM" bench -m "$tmpdir/moe.gguf" -p 8 -n 4 -r 1 --backends cpu-baseline --experts-on ref \
       --no-roofline --json > "$tmpdir/moe.json" 2>> "$tmpdir/moe.err"; then
    active=$("$LOOM" inspect --json "$tmpdir/moe.gguf" | jq '.metadata as $m |
        [.tensors[] | select(.name != "token_embd.weight") |
         if (.name | test("_exps[.]")) then .bytes * $m["qwen2moe.expert_used_count"] /
             $m["qwen2moe.expert_count"] else .bytes end] | add')
    jq -e --argjson a "$active" '(.results | length) == 2 and all(.results[];
            .weight_bytes == $a and .tokens_per_s > 0 and (.backend | test("[+] experts on ref")))' \
        "$tmpdir/moe.json" > /dev/null &&
        pass "bench on a MoE model: the active bytes ($active), the experts on ref" ||
        { fail "MoE bench results (active bytes $active):"; cat "$tmpdir/moe.json" >&2; }
else
    fail "MoE bench:"; cat "$tmpdir/moe.err" >&2
fi
"$LOOM" run -m "$tmpdir/moe.gguf" -p "x" -n 1 --experts-on nosuch > /dev/null 2> "$tmpdir/e9" &&
    fail "--experts-on nosuch accepted"
expect_grep "experts on 'nosuch': no backend named 'nosuch'" "$tmpdir/e9" "an unknown experts backend named"
"$LOOM" run -m "$gguf" -p "x" -n 1 --experts-on cpu > /dev/null 2> "$tmpdir/e10" &&
    fail "--experts-on accepted for a dense model"
expect_grep "has none (placing them applies to mixture-of-experts models)" "$tmpdir/e10" \
    "--experts-on with a dense model refused"
"$LOOM" bench --synthetic huge > /dev/null 2> "$tmpdir/e6" && fail "unknown shape accepted"
expect_grep "no synthetic shape 'huge'" "$tmpdir/e6" "unknown synthetic shape named"
# a backend that lacks ops: loom runs those ops on the CPU (copies there and back), says so
# once per op, and the output is unchanged; LOOM_STRICT=1 refuses instead
LOOM_BACKEND=ref LOOM_REF_OPAQUE=1 "$LOOM" run -m "$gguf" -p "Once upon a time" -n 16 --temp 0 --json \
    > "$tmpdir/nofb.json" 2> /dev/null || fail "run on ref: exit $?"
want_ids=$(jq -c '.generated_ids' "$tmpdir/nofb.json")
LOOM_BACKEND=ref LOOM_REF_OPAQUE=1 LOOM_REF_DENY=matmul,kv_store,attention:f16 "$LOOM" run -m "$gguf" \
    -p "Once upon a time" -n 16 --temp 0 --json > "$tmpdir/fb.json" 2> "$tmpdir/fb.err" ||
    fail "run with denied ops: exit $?"
[ "$(jq -c '.generated_ids' "$tmpdir/fb.json")" = "$want_ids" ] &&
    pass "ops the backend lacks run on the CPU: greedy ids as ref's own" ||
    { fail "fallback ids: $(jq -c .generated_ids "$tmpdir/fb.json")"; cat "$tmpdir/fb.err" >&2; }
for op in matmul kv_store attention; do
    [ "$(grep -c "ref does not support $op with .*; running it on cpu" "$tmpdir/fb.err")" = 1 ] &&
        pass "the $op fallback is announced once" || { fail "$op warning not exactly once:"; cat "$tmpdir/fb.err" >&2; }
done
if LOOM_STRICT=1 LOOM_BACKEND=ref LOOM_REF_DENY=attention,rms_norm "$LOOM" run -m "$gguf" -p "Once" -n 2 \
    > /dev/null 2> "$tmpdir/strict.err"; then
    fail "LOOM_STRICT=1 should refuse a backend that lacks attention"
else
    expect_grep "strict mode (LOOM_STRICT=1): backend ref lacks 2 op(s) this model needs: rms_norm with f32, attention with f16" \
        "$tmpdir/strict.err" "LOOM_STRICT=1 refuses at load, naming every op it lacks"
fi
LOOM_STRICT=1 LOOM_BACKEND=ref "$LOOM" run -m "$gguf" -p "Once" -n 2 > /dev/null 2> "$tmpdir/strict-ok.err" &&
    pass "LOOM_STRICT=1 runs a backend that has every op" ||
    { fail "LOOM_STRICT=1 with everything supported: exit $?"; cat "$tmpdir/strict-ok.err" >&2; }
# modules that crash or hang in their probe, in the search path, do not stop a run
LOOM_PROBE_TIMEOUT=1 LOOM_BACKEND_PATH="$PROBEFAIL_DIR" "$LOOM" run -m "$gguf" -p "Once upon a time" \
    -n 8 --temp 0 > "$tmpdir/pf.txt" 2>&1 && pass "loom run works beside modules whose probes crash" ||
    { fail "loom run with crashing probes in the path: exit $?"; cat "$tmpdir/pf.txt" >&2; }

# the best score with a device that will not open: the next best runs, with a note
LOOM_BACKEND_PATH="$PROBEHOSTILE_DIR" FAKE_PIDFILE="$tmpdir/orphan.pid" "$LOOM" run -m "$gguf" \
    -p "Once upon a time" -n 8 --temp 0 --json > "$tmpdir/of.json" 2> "$tmpdir/of.err" &&
    jq -e '.backend | test("openfails") | not' "$tmpdir/of.json" > /dev/null &&
    pass "a module that cannot open its device gives way to the next ($(jq -r .backend "$tmpdir/of.json"))" ||
    { fail "loom run beside a module whose open fails: exit $?"; cat "$tmpdir/of.err" >&2; }
expect_grep "note: backend openfails could not open its device (.*would not open)" \
    "$tmpdir/of.err" "... and says so"
LOOM_BACKEND=openfails LOOM_BACKEND_PATH="$PROBEHOSTILE_DIR" "$LOOM" run -m "$gguf" -p "Once" -n 2 \
    > /dev/null 2> "$tmpdir/of1.err" && fail "LOOM_BACKEND=openfails alone ran"
expect_grep "opening its device failed: .*would not open" "$tmpdir/of1.err" \
    "asked for by name alone, its failure is the error"
# the help says what the commands accept; --version what was built
"$LOOM" help >"$tmpdir/help.txt"
expect_grep "ChatGLM" "$tmpdir/help.txt" "help: convert names every family, not only Llama"
"$LOOM" convert 2>"$tmpdir/chelp.txt"
expect_grep "q4_k_m" "$tmpdir/chelp.txt" "convert's usage lists the mixes"
"$LOOM" --version >"$tmpdir/ver.txt"
expect_grep "^git commit " "$tmpdir/ver.txt" "--version names the git commit"
expect_grep "^backend ABI 1\.[0-9]" "$tmpdir/ver.txt" "--version names the backend ABI"
expect_grep "^backend modules: .*backends" "$tmpdir/ver.txt" "--version names the module directories"

LOOM_BACKEND=ref LOOM_REF_DENY=matmool "$LOOM" run -m "$gguf" -p "Once" -n 2 > /dev/null 2> "$tmpdir/deny.err" &&
    fail "a misspelt LOOM_REF_DENY was accepted"
expect_grep "LOOM_REF_DENY: 'matmool' is not OP or OP:DTYPE" "$tmpdir/deny.err" "a bad LOOM_REF_DENY is named"
finish
