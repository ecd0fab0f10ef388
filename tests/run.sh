# tests/run.sh - `loom run` and `loom bench` as a user runs them: greedy output equal to the
# fixture, --json and --dump-logits, seeded sampling reproducible, bad input named; and the
# synthetic-model benchmark on every CPU variant.
. "$top_srcdir/tests/lib.sh"
unset LOOM_BACKEND LOOM_CPU_VARIANT LOOM_CPU_MAX_ISA LOOM_EXPLAIN LOOM_BACKEND_PATH
gguf="$FIXTURES/stories260K/original/stories260K.gguf"
expected="$FIXTURES/stories260K/expected.json"
need_fixture "$gguf"
need_fixture "$FIXTURES/tiny-qwen35/model.gguf"

"$LOOM" run -m "$gguf" -p "Once upon a time" -n 16 --temp 0 --json --dump-logits "$tmpdir/l.f32" \
    > "$tmpdir/run.json" 2> "$tmpdir/run.err" || fail "run --json exit $?"
want_ids=$(jq -c '.cases[0].greedy.ids' "$expected")
got_ids=$(jq -c '.generated_ids' "$tmpdir/run.json")
[ "$want_ids" = "$got_ids" ] && pass "greedy ids equal the fixture" || fail "greedy ids: $got_ids, want $want_ids"
[ "$(jq -r '.cases[0].greedy.text' "$expected")" = "$(jq -r .text "$tmpdir/run.json")" ] &&
    pass "text equals the fixture" || fail "text: $(jq -r .text "$tmpdir/run.json")"
[ "$(jq -c .prompt_ids "$tmpdir/run.json")" = "$(jq -c '.cases[0].prompt_ids' "$expected")" ] &&
    pass "prompt ids" || fail "prompt ids"
jq -e '.timings.time_to_first_token_ms > 0 and .timings.decode_tokens_per_s > 0' "$tmpdir/run.json" \
    > /dev/null && pass "timings" || fail "timings missing"
[ "$(wc -c < "$tmpdir/l.f32")" -eq 2048 ] && pass "dump-logits: 512 floats" || fail "dump-logits size"

# plain text output streams the same text
"$LOOM" run -m "$gguf" -p "Once upon a time" -n 16 --temp 0 > "$tmpdir/plain.txt" 2> /dev/null
[ "$(cat "$tmpdir/plain.txt")" = "$(jq -r '.cases[0].greedy.text' "$expected")" ] &&
    pass "streamed text" || fail "streamed text: $(cat "$tmpdir/plain.txt")"

# sampling: one seed twice gives one answer; top-k 1 is greedy
"$LOOM" run -m "$gguf" -p "Once" -n 24 --temp 1 --seed 42 > "$tmpdir/s1.txt" 2> /dev/null
"$LOOM" run -m "$gguf" -p "Once" -n 24 --temp 1 --seed 42 > "$tmpdir/s2.txt" 2> /dev/null
cmp -s "$tmpdir/s1.txt" "$tmpdir/s2.txt" && pass "same seed, same text" || fail "seeded runs differ"
"$LOOM" run -m "$gguf" -p "Once" -n 24 --temp 0 > "$tmpdir/g.txt" 2> /dev/null
"$LOOM" run -m "$gguf" -p "Once" -n 24 --temp 1 --top-k 1 --seed 9 > "$tmpdir/k1.txt" 2> /dev/null
cmp -s "$tmpdir/g.txt" "$tmpdir/k1.txt" && pass "top-k 1 is greedy" || fail "top-k 1 differs from greedy"

# input a user gets wrong
"$LOOM" run -p hi > /dev/null 2> "$tmpdir/e1" && fail "no model accepted"
expect_grep "give -m MODEL" "$tmpdir/e1" "missing model named"
"$LOOM" run -m "$gguf" -p hi --temp hot > /dev/null 2> "$tmpdir/e2" && fail "bad temperature accepted"
expect_grep "wants a number from 0 to 100, not 'hot'" "$tmpdir/e2" "bad number named"
"$LOOM" run -m "$gguf" --prompt-ids 1,99999 > /dev/null 2> "$tmpdir/e3" && fail "bad id accepted"
expect_grep "ids below 512" "$tmpdir/e3" "bad prompt id named"
"$LOOM" run -m "$gguf" -p "Once upon a time, in a land far away" -c 4 > /dev/null 2> "$tmpdir/e4" && fail "overlong prompt accepted"
expect_grep "context holds 4" "$tmpdir/e4" "prompt longer than the context"
"$LOOM" run -m "$tmpdir/nothing.gguf" -p hi > /dev/null 2> "$tmpdir/e5" && fail "missing file accepted"
expect_grep "No such file" "$tmpdir/e5" "missing model file"

# tokenize / detokenize: the fixture's ids, and back to the text
got=$("$LOOM" tokenize -m "$gguf" --json "Once upon a time" | jq -c .)
[ "$got" = "$(jq -c '.cases[0].prompt_ids' "$expected")" ] && pass "tokenize" || fail "tokenize: $got"
text=$("$LOOM" detokenize -m "$gguf" $(jq -r '.cases[0].prompt_ids | map(tostring) | join(" ")' "$expected"))
[ "$text" = "Once upon a time" ] && pass "detokenize" || fail "detokenize: '$text'"
"$LOOM" detokenize -m "$gguf" 1,99999 > /dev/null 2> "$tmpdir/e7" && fail "bad id accepted"
expect_grep "not a token id below 512" "$tmpdir/e7" "detokenize names a bad id"
qwen="$FIXTURES/tiny-qwen2"
got=$("$LOOM" tokenize -m "$qwen" --json "$(jq -r '.cases[1].text' "$qwen/expected.json")" | jq -c .)
[ "$got" = "$(jq -c '.cases[1].prompt_ids' "$qwen/expected.json")" ] && pass "tokenize a Qwen2 folder (CJK)" ||
    fail "qwen2 tokenize: $got"
# ChatGLM3: the fixture's rendered chat with --all-special gives its ids; as a user's text only
# the role tokens are read ([gMASK] and sop stay characters, after the prefix loom adds)
glm3="$FIXTURES/tiny-chatglm3"
got=$("$LOOM" tokenize -m "$glm3" --json --all-special "$(jq -r '.cases[2].rendered_prompt' "$glm3/expected.json")" | jq -c .)
[ "$got" = "$(jq -c '.cases[2].prompt_ids' "$glm3/expected.json")" ] && pass "tokenize --all-special: a rendered ChatGLM3 chat" ||
    fail "chatglm3 tokenize --all-special: $got"
got=$("$LOOM" tokenize -m "$glm3" --json "[gMASK]sop<|user|>" | jq -c .)
[ "$(echo "$got" | jq -c '[.[] | select(. >= 64789)]')" = "[64790,64792,64795]" ] &&
    pass "ChatGLM3 user text: only the role token is read" || fail "chatglm3 user text: $got"

# chat: the second turn reuses the first's KV cache; /reset forgets it
printf 'What is the capital of France?\nAnd of Italy?\n/reset\nHi\n' |
    "$LOOM" chat -m "$qwen" --temp 0 -n 4 > "$tmpdir/chat.out" 2> "$tmpdir/chat.err" || fail "chat exit $?"
expect_grep "chat template: the model.s own (Jinja)" "$tmpdir/chat.err" "chat renders with the model's own template"
reused=$(grep -o 'reused [0-9]* of' "$tmpdir/chat.err" | awk '{print $2}' | tr '\n' ' ')
case "$reused" in "0 "[1-9]*" 0 ") pass "KV cache reused on the second turn, not after /reset ($reused)";;
    *) fail "reuse pattern: '$reused'"; cat "$tmpdir/chat.err" >&2;; esac
# a hybrid model (Qwen3.5): its state has seen exactly the cached tokens, so the second turn
# reuses all of them (a reuse the state has not seen is an error the runner reports)
q35="$FIXTURES/tiny-qwen35/model.gguf"
printf 'What is the capital of France?\nAnd of Italy?\n/quit\n' |
    "$LOOM" chat -m "$q35" --temp 0 -n 6 > "$tmpdir/chat35.out" 2> "$tmpdir/chat35.err" || fail "hybrid chat exit $?"
reused=$(grep -o 'reused [0-9]* of [0-9]*' "$tmpdir/chat35.err" | awk '{print $2 "/" $4}' | tr '\n' ' ')
case "$reused" in "0/"[0-9]*" "[1-9]*/[0-9]*" ") pass "hybrid chat: the second turn resumes from the state ($reused)";;
    *) fail "hybrid chat reuse: '$reused'"; cat "$tmpdir/chat35.err" >&2;; esac
# the same chat drafted by the model's own multi-token-prediction block (blk.4 of llama.cpp's
# file): the same answers, proposals checked every turn (its random weights agree by chance)
printf 'What is the capital of France?\nAnd of Italy?\n/quit\n' |
    "$LOOM" chat -m "$q35" --temp 0 -n 6 --draft-mtp --draft-fixed --draft-max 2 --draft-p-min 0 \
        > "$tmpdir/chat35-mtp.out" 2> "$tmpdir/chat35-mtp.err" || fail "chat --draft-mtp exit $?"
cmp -s "$tmpdir/chat35.out" "$tmpdir/chat35-mtp.out" && pass "chat --draft-mtp: the answers of plain decoding" ||
    { fail "chat --draft-mtp answers differ"; diff "$tmpdir/chat35.out" "$tmpdir/chat35-mtp.out" >&2; }
[ "$(grep -c ' of [1-9][0-9]* proposed tokens accepted' "$tmpdir/chat35-mtp.err")" = 2 ] &&
    pass "chat --draft-mtp: the block proposed every turn" ||
    { fail "chat --draft-mtp proposals"; cat "$tmpdir/chat35-mtp.err" >&2; }
"$LOOM" run -m "$gguf" -p hi --draft-mtp > /dev/null 2> "$tmpdir/e11" && fail "--draft-mtp without a block accepted"
expect_grep "has no multi-token-prediction block" "$tmpdir/e11" "--draft-mtp on a file without the block"
# drafters that cannot draft for the model are refused before anything runs
"$LOOM" bench --synthetic tiny --type q8_0 --write "$tmpdir/other-vocab.gguf" 2> /dev/null
"$LOOM" run -m "$gguf" -p hi --draft "$tmpdir/other-vocab.gguf" > /dev/null 2> "$tmpdir/e9" &&
    fail "a drafter of another vocabulary accepted"
expect_grep "draft model's token [0-9]* is not the model's" "$tmpdir/e9" "--draft of another vocabulary: the first differing id named"
"$LOOM" run -m "$gguf" -p hi --draft-layers 5 > /dev/null 2> "$tmpdir/e10" && fail "--draft-layers of every layer accepted"
expect_grep "must have fewer layers than the model" "$tmpdir/e10" "--draft-layers must leave layers out"
# chat with a drafter (the model itself, opened again: it agrees with every token): the same
# answers, turn after turn, with proposals accepted on the second turn too (its cache reused)
printf 'What is the capital of France?\nAnd of Italy?\n/reset\nHi\n' |
    "$LOOM" chat -m "$qwen" --temp 0 -n 4 --draft "$qwen" --draft-fixed --draft-max 2 --draft-p-min 0 \
        > "$tmpdir/chat-spec.out" 2> "$tmpdir/chat-spec.err" || fail "speculative chat exit $?"
cmp -s "$tmpdir/chat.out" "$tmpdir/chat-spec.out" && pass "chat --draft: the answers of plain decoding" ||
    { fail "chat --draft answers differ"; diff "$tmpdir/chat.out" "$tmpdir/chat-spec.out" >&2; }
[ "$(grep -c ' 2 of 2 proposed tokens accepted' "$tmpdir/chat-spec.err")" = 3 ] &&
    pass "chat --draft: proposals accepted every turn" ||
    { fail "chat --draft acceptance"; cat "$tmpdir/chat-spec.err" >&2; }
"$LOOM" chat -m "$qwen" --chat-template nosuch < /dev/null > /dev/null 2> "$tmpdir/e8" && fail "bad template accepted"
expect_grep "no chat template named 'nosuch'" "$tmpdir/e8" "unknown chat template named"

# the benchmark with a drafter: decode with and without it, and how the drafter did
"$LOOM" bench --synthetic tiny --type q8_0 -p 0 -n 16 -r 2 --backends ref --no-roofline --json \
    --draft-layers 1 --draft-fixed --draft-p-min 0 > "$tmpdir/bench-spec.json" 2> "$tmpdir/bench-spec.err" &&
    jq -e '[.results[] | select(.test == "spec tg16")] | length == 1 and
        all(.[]; .tokens_per_s > 0 and .speedup > 0 and .acceptance >= 0 and
            (.drafter | test("first 1 layers")))' "$tmpdir/bench-spec.json" > /dev/null &&
    pass "bench --draft-layers: decode measured with the drafter beside without" ||
    { fail "bench --draft-layers"; cat "$tmpdir/bench-spec.json" "$tmpdir/bench-spec.err" >&2; }
"$LOOM" bench -m "$q35" -p 0 -n 16 -r 1 --backends ref --no-roofline --json \
    --draft-mtp --draft-fixed --draft-p-min 0 > "$tmpdir/bench-mtp.json" 2> "$tmpdir/bench-mtp.err" &&
    jq -e '[.results[] | select(.test == "spec tg16")] | length == 1 and
        all(.[]; .tokens_per_s > 0 and (.drafter | test("multi-token-prediction")))' \
        "$tmpdir/bench-mtp.json" > /dev/null &&
    pass "bench --draft-mtp: decode measured with the block drafting" ||
    { fail "bench --draft-mtp"; cat "$tmpdir/bench-mtp.json" "$tmpdir/bench-mtp.err" >&2; }

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
LOOM_BACKEND=ref LOOM_REF_OPAQUE=1 LOOM_REF_DENY=matmul,kv_store,attention:f16 "$LOOM" run -m "$gguf" \
    -p "Once upon a time" -n 16 --temp 0 --json > "$tmpdir/fb.json" 2> "$tmpdir/fb.err" ||
    fail "run with denied ops: exit $?"
[ "$(jq -c '.generated_ids' "$tmpdir/fb.json")" = "$want_ids" ] &&
    pass "ops the backend lacks run on the CPU: greedy ids still equal the fixture" ||
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
# --json is valid UTF-8 JSON whatever the model emits: random sampling on a byte-level
# vocabulary ends inside multi-byte characters and emits lone continuation bytes
qwen=$FIXTURES/tiny-qwen2
if [ -e "$qwen" ]; then
    bad=0
    for seed in 1 2 3 4 5 6 7 8; do
        "$LOOM" run -m "$qwen" -p "Hello" -n 24 --temp 1.5 --top-k 200 --seed "$seed" --json \
            >"$tmpdir/q.json" 2>/dev/null || { bad=$((bad + 1)); continue; }
        iconv -f UTF-8 -t UTF-8 "$tmpdir/q.json" >/dev/null 2>&1 && jq -e .text "$tmpdir/q.json" >/dev/null ||
            bad=$((bad + 1))
    done
    [ "$bad" = 0 ] && pass "run --json: 8 random samples on a byte-level vocabulary, all valid UTF-8 JSON" ||
        fail "run --json: $bad of 8 outputs are not valid UTF-8 JSON"
fi
# ... and so is the terminal output, by the same rule (U+FFFD for what is no character)
if [ -e "$qwen" ]; then
    bad=0
    for seed in 1 2 3 4; do
        "$LOOM" run -m "$qwen" -p "Hello" -n 24 --temp 1.5 --top-k 200 --seed "$seed" \
            >"$tmpdir/q.txt" 2>/dev/null || bad=$((bad + 1))
        iconv -f UTF-8 -t UTF-8 "$tmpdir/q.txt" >/dev/null 2>&1 || bad=$((bad + 1))
    done
    [ "$bad" = 0 ] && pass "run: terminal output of random byte-level samples is valid UTF-8" ||
        fail "run: $bad of 4 terminal outputs are not valid UTF-8"
fi

# progress: a bar only on a terminal; in a log one line, and nothing with --quiet
tl=$FIXTURES/tiny-llama
if [ -e "$tl" ]; then
    "$LOOM" convert "$tl" -o "$tmpdir/tl.gguf" --type q8_0 2>"$tmpdir/conv.err" || fail "convert exit $?"
    if grep -q "$(printf '\r')" "$tmpdir/conv.err"; then fail "a progress bar was drawn into a log"
    else pass "convert into a log: no bar frames"; fi
    expect_grep "converting: 21 of 21 done" "$tmpdir/conv.err" "convert into a log: one line when done"
    "$LOOM" quantize "$tmpdir/tl.gguf" "$tmpdir/tl2.gguf" --type q4_k_m --quiet 2>"$tmpdir/q.err" ||
        fail "quantize exit $?"
    ! grep -q "quantizing" "$tmpdir/q.err" && pass "quantize --quiet: no progress" ||
        fail "quantize --quiet printed progress: $(cat "$tmpdir/q.err")"
    "$LOOM" inspect "$tmpdir/tl2.gguf" >"$tmpdir/insp.txt" 2>&1
    expect_grep "^types: .*q8_0" "$tmpdir/insp.txt" "inspect shows the mix"
fi

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
