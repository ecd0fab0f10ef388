# tests/run.sh - `loom run`, chat and tokenize as a user runs them on the fixtures: greedy output
# equal to the fixture, --json and --dump-logits, seeded sampling reproducible, bad input named,
# chat turns reusing the cache (a hybrid's state too), drafters, output that stays UTF-8.
# `loom bench` and the backend choice: tests/bench.sh.
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

"$LOOM" bench -m "$q35" -p 0 -n 16 -r 1 --backends ref --no-roofline --json \
    --draft-mtp --draft-fixed --draft-p-min 0 > "$tmpdir/bench-mtp.json" 2> "$tmpdir/bench-mtp.err" &&
    jq -e '[.results[] | select(.test == "spec tg16")] | length == 1 and
        all(.[]; .tokens_per_s > 0 and (.drafter | test("multi-token-prediction")))' \
        "$tmpdir/bench-mtp.json" > /dev/null &&
    pass "bench --draft-mtp: decode measured with the block drafting" ||
    { fail "bench --draft-mtp"; cat "$tmpdir/bench-mtp.json" "$tmpdir/bench-mtp.err" >&2; }

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

finish
