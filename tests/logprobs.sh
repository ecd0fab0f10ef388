# tests/logprobs.sh - logprobs in loom serve: a completion's first token's top log-probabilities
# equal the log-softmax of the logits `loom run --dump-logits` writes for the same prompt
# (computed here in Python), the chosen token's at temperature 0 is the top one; chat's
# logprobs have OpenAI's shape, streamed chunks carry one entry per token; bad values are 400s.
# The model: loom's synthetic chat model (random weights, ChatML), which the suite writes.
. "$top_srcdir/tests/lib.sh"
command -v curl >/dev/null || { echo "SKIP: curl not installed"; exit 77; }
MODEL=$(suite_model tiny-chat) KEY=test-key
. "$top_srcdir/tests/serve_lib.sh"

"$LOOM" run -m "$MODEL" -p "Hello there" -n 1 --temp 0 --dump-logits "$tmpdir/logits.f32" >/dev/null 2>&1 ||
    fail "loom run --dump-logits"
start_server "$tmpdir/s.log" -c 512
post /v1/completions '{"model": "synthetic-tiny-chat-f32", "prompt": "Hello there", "max_tokens": 3,
    "temperature": 0, "logprobs": 5}' | sed '$d' >"$tmpdir/c.json"
python3 - "$tmpdir/logits.f32" "$tmpdir/c.json" <<'PY' && pass "completion logprobs: the top 5 are the dumped logits' log-softmax, the greedy token the top one" || fail "completion logprobs: $(head -c 600 "$tmpdir/c.json")"
import json, math, struct, sys
raw = open(sys.argv[1], "rb").read()
logits = struct.unpack("<%df" % (len(raw) // 4), raw)
m = max(logits); z = m + math.log(sum(math.exp(x - m) for x in logits))
want = sorted((x - z for x in logits), reverse=True)[:5]
lp = json.load(open(sys.argv[2]))["choices"][0]["logprobs"]
got = sorted(lp["top_logprobs"][0].values(), reverse=True)
assert len(lp["tokens"]) == 3 and len(lp["token_logprobs"]) == 3 and lp["text_offset"][0] == 0, lp
# two ids that spell one text keep one key: compare what is there
assert all(any(abs(g - w) < 2e-3 for w in want) for g in got) and abs(got[0] - want[0]) < 2e-3, (got, want)
assert abs(lp["token_logprobs"][0] - want[0]) < 2e-3, (lp["token_logprobs"][0], want[0])
PY
post /v1/chat/completions '{"model": "synthetic-tiny-chat-f32", "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4, "logprobs": true, "top_logprobs": 3, "seed": 1}' | sed '$d' >"$tmpdir/chat.json"
jq -e '.choices[0].logprobs.content | length == 4 and all(.[]; (.token | type) == "string" and .logprob <= 0
    and (.bytes | type) == "array" and (.top_logprobs | length) == 3
    and .top_logprobs[0].logprob >= .top_logprobs[1].logprob and .top_logprobs[0].logprob >= .logprob)' \
    "$tmpdir/chat.json" >/dev/null && pass "chat logprobs: 4 tokens, each with its bytes and 3 alternatives, likeliest first" ||
    fail "chat logprobs: $(head -c 500 "$tmpdir/chat.json")"
post /v1/chat/completions '{"model": "synthetic-tiny-chat-f32", "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 6, "logprobs": true, "stream": true, "stream_options": {"include_usage": true}, "seed": 1}' >"$tmpdir/s.out"
n=$(sed -n 's/^data: //p' "$tmpdir/s.out" | grep -v '^\[DONE\]$' | jq -s '[.[].choices[0].logprobs.content // [] | length] | add')
[ "$n" = 6 ] && pass "streamed, the chunks carry one logprobs entry per token ($n)" || fail "streamed logprobs: $n entries"
# cut off inside a character (the schema's 4-byte one comes as byte tokens): the engine flushes the
# held bytes at the end, an event with no token, which must not become a logprobs entry
cut='{"model": "synthetic-tiny-chat-f32", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0,
    "logprobs": true, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"const": "\ud834\udd1e\ud834\udd1e"}}}'
post /v1/chat/completions "$cut, \"stream\": true, \"stream_options\": {\"include_usage\": true}}" >"$tmpdir/cut.out"
n=$(sed -n 's/^data: //p' "$tmpdir/cut.out" | grep -v '^\[DONE\]$' | jq -s '"\([.[].choices[0].logprobs.content // [] | length] | add) \(.[-1].usage.completion_tokens)"')
m=$(post /v1/chat/completions "$cut}" | sed '$d' | jq '"\(.choices[0].logprobs.content | length) \(.usage.completion_tokens)"')
[ "$n" = '"2 2"' ] && [ "$m" = '"2 2"' ] && pass "cut inside a character: one logprobs entry per token, streamed and not" ||
    fail "cut inside a character: entries and tokens $n streamed, $m not"
got=$(post /v1/chat/completions '{"model": "synthetic-tiny-chat-f32", "messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21}' | sed '$d' | jq -r .error.param)
[ "$got" = top_logprobs ] && pass "top_logprobs 21 is a 400 naming it" || fail "top_logprobs 21: $got"
got=$(post /v1/chat/completions '{"model": "synthetic-tiny-chat-f32", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}' | sed '$d' | jq -r .error.message)
case "$got" in *"needs 'logprobs': true"*) pass "top_logprobs alone: '$got'";; *) fail "top_logprobs alone: $got";; esac
stop_server
finish
