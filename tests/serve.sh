#!/bin/sh
# tests/serve.sh - `loom serve` end to end on loopback with stories260K (a real model): answers
# equal `loom run`'s for the same seed, streamed or not; 64 concurrent clients of mixed lengths
# each get their own answer; disconnecting clients leak no KV block; a repeated long prefix hits
# the prefix cache and is answered faster; bad requests get OpenAI-style errors with the right
# status; SIGTERM drains and exits 0.
. "$top_srcdir/tests/lib.sh"
MODEL=$FIXTURES/stories260K/original/stories260K.gguf
need_fixture "$MODEL"
command -v curl >/dev/null || { echo "SKIP: curl not installed (scripts/install-deps installs it)"; exit 77; }
KEY=test-key
. "$top_srcdir/tests/serve_lib.sh"

start_server "$tmpdir/server.log" -c 2048 --max-batch 16
NAME=$(curl -s -H "Authorization: Bearer $KEY" "$URL/v1/models" | jq -r '.data[0].id')
[ -n "$NAME" ] && [ "$NAME" != null ] && pass "GET /v1/models names the model ($NAME)" || fail "/v1/models: '$NAME'"
[ "$(curl -s "$URL/health" | jq -r .status)" = ok ] && pass "/health" || fail "/health"

# ---- the same answer as loom run, for the same seed (sampled, not greedy)
"$LOOM" run -m "$MODEL" -p "Once upon a time, there was a" -n 40 --temp 0.8 --top-k 0 --top-p 1 \
    --min-p 0 --seed 42 --json 2>/dev/null | jq -r .text >"$tmpdir/run.txt"
post /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"Once upon a time, there was a\",\"max_tokens\":40,
    \"temperature\":0.8,\"seed\":42}" >"$tmpdir/c.out"
[ "$(tail -n1 "$tmpdir/c.out")" = 200 ] || fail "completion status: $(cat "$tmpdir/c.out")"
sed '$d' "$tmpdir/c.out" | jq -j '.choices[0].text' >"$tmpdir/c.txt"; echo >>"$tmpdir/c.txt"
if cmp -s "$tmpdir/run.txt" "$tmpdir/c.txt"; then pass "completion equals loom run (seed 42)"
else fail "completion differs from loom run:"; diff "$tmpdir/run.txt" "$tmpdir/c.txt" >&2; fi
sed '$d' "$tmpdir/c.out" | jq -e '.object == "text_completion" and .usage.completion_tokens == 40
    and .usage.total_tokens == .usage.prompt_tokens + 40 and .choices[0].finish_reason == "length"' \
    >/dev/null && pass "completion shape and usage" || fail "completion shape: $(cat "$tmpdir/c.out")"

post /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"Once upon a time, there was a\",\"max_tokens\":40,
    \"temperature\":0.8,\"seed\":42,\"stream\":true,\"stream_options\":{\"include_usage\":true}}" -N \
    >"$tmpdir/s.out"
grep '^data: {' "$tmpdir/s.out" | sed 's/^data: //' | jq -j '.choices[0].text // empty' >"$tmpdir/s.txt"
echo >>"$tmpdir/s.txt"
if cmp -s "$tmpdir/run.txt" "$tmpdir/s.txt"; then pass "streamed completion equals loom run"
else fail "stream differs from loom run:"; diff "$tmpdir/run.txt" "$tmpdir/s.txt" >&2; fi
grep -q '^data: \[DONE\]' "$tmpdir/s.out" && pass "stream ends with data: [DONE]" || fail "no [DONE]"
grep '^data: {' "$tmpdir/s.out" | tail -n1 | sed 's/^data: //' | jq -e '.usage.completion_tokens == 40' \
    >/dev/null && pass "stream usage chunk" || fail "stream usage: $(tail -n3 "$tmpdir/s.out")"

# chat: the role first, then content deltas that add up to the non-streamed message
CHAT="{\"model\":\"$NAME\",\"messages\":[{\"role\":\"system\",\"content\":\"Tell a story.\"},
    {\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"A cat\"}]}],\"max_tokens\":24,\"seed\":7"
post /v1/chat/completions "$CHAT}" | sed '$d' >"$tmpdir/chat.json"
jq -e '.object == "chat.completion" and .choices[0].message.role == "assistant"' "$tmpdir/chat.json" \
    >/dev/null && pass "chat completion shape" || fail "chat: $(cat "$tmpdir/chat.json")"
post /v1/chat/completions "$CHAT,\"stream\":true}" -N >"$tmpdir/chat.sse"
grep '^data: {' "$tmpdir/chat.sse" | head -n1 | sed 's/^data: //' | jq -e '.choices[0].delta.role == "assistant"' \
    >/dev/null && pass "chat stream opens with the role" || fail "chat stream: $(head -n2 "$tmpdir/chat.sse")"
a=$(jq -j '.choices[0].message.content' "$tmpdir/chat.json")
b=$(grep '^data: {' "$tmpdir/chat.sse" | sed 's/^data: //' | jq -j '.choices[0].delta.content // empty')
[ "$a" = "$b" ] && pass "chat stream equals the chat message" || fail "chat stream '$b' vs '$a'"

# ---- 64 concurrent clients, mixed prompts and lengths, greedy: each equals loom run
i=0
for p in "Once upon a time" "The little dog" "Lily wanted to" "One day, Tom and his mom went to the store" \
         "The sun was hot" "Sam had a red ball. He" "Once upon a time, there was a big tree" "The bird sang"; do
    for n in 3 9 17 33 50 64 80 100; do
        i=$((i + 1))
        printf '%s\n%s\n' "$p" "$n" >"$tmpdir/job$i"
    done
done
for k in $(seq 64); do
    p=$(sed -n 1p "$tmpdir/job$k") n=$(sed -n 2p "$tmpdir/job$k")
    post /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"$p\",\"max_tokens\":$n,\"temperature\":0}" \
        >"$tmpdir/par$k.out" &
done
wait_clients() { for c in $(jobs -p); do [ "$c" = "$LAUNCHER" ] || wait "$c"; done; }
wait_clients
bad=0
for k in $(seq 64); do
    p=$(sed -n 1p "$tmpdir/job$k") n=$(sed -n 2p "$tmpdir/job$k")
    [ -f "$tmpdir/want-$n-$(echo "$p" | md5sum | cut -c1-8)" ] ||
        "$LOOM" run -m "$MODEL" -p "$p" -n "$n" --temp 0 --json 2>/dev/null | jq -j .text \
            >"$tmpdir/want-$n-$(echo "$p" | md5sum | cut -c1-8)"
    sed '$d' "$tmpdir/par$k.out" | jq -j '.choices[0].text' >"$tmpdir/got$k"
    cmp -s "$tmpdir/got$k" "$tmpdir/want-$n-$(echo "$p" | md5sum | cut -c1-8)" || {
        bad=$((bad + 1)); echo "  client $k ('$p', $n): got '$(cat "$tmpdir/got$k")'" >&2; }
done
[ "$bad" = 0 ] && pass "64 concurrent clients each got loom run's answer" || fail "$bad of 64 concurrent answers differ"
steps=$(metric loom_engine_steps_total)
echo "  (64 clients: $steps engine steps in all so far)"

# ---- disconnecting clients leak nothing
post /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"Once\",\"max_tokens\":2000,\"ignore_eos\":true,
    \"stream\":true}" -N --max-time 0.3 >/dev/null 2>&1
post /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"Once\",\"max_tokens\":2000,\"ignore_eos\":true}" \
    --max-time 0.3 >/dev/null 2>&1
for _ in $(seq 50); do
    [ "$(metric loom_requests_running)" = 0 ] && [ "$(metric loom_requests_waiting)" = 0 ] && break
    sleep 0.1
done
used=$(curl -s "$URL/metrics" | awk '/^loom_kv_blocks\{state="used"\}/ { print $2 }')
gone=$(metric loom_client_disconnects_total)
[ "$used" = 0 ] && pass "after disconnects no KV block is in use" || fail "KV blocks used while idle: $used"
window=$(metric loom_kv_sliding_window_tokens)
[ "$window" = 0 ] && pass "/metrics: no sliding window for this model" ||
    fail "loom_kv_sliding_window_tokens is '$window' for a model without a window"
[ "${gone:-0}" -ge 2 ] && pass "both disconnects noticed ($gone)" || fail "disconnects counted: $gone"

# ---- prefix cache: the same long prompt twice; the second hits and is answered sooner
long=$(for _ in $(seq 60); do printf 'Lily and Tom played in the park with a big red ball. '; done)
LONG="{\"model\":\"$NAME\",\"prompt\":\"$long\",\"max_tokens\":1,\"temperature\":0}"
t1=$(post /v1/completions "$LONG" -o "$tmpdir/p1.json" -w '%{time_total}' | tail -n1)
t2=$(post /v1/completions "$LONG" -o "$tmpdir/p2.json" -w '%{time_total}' | tail -n1)
hit=$(jq '.usage.prompt_tokens_details.cached_tokens' "$tmpdir/p2.json")
total=$(jq '.usage.prompt_tokens' "$tmpdir/p2.json")
[ "$hit" -gt 0 ] && [ "$hit" -ge $((total - 16)) ] && pass "repeated prefix: $hit of $total prompt tokens cached" ||
    fail "repeated prefix cached $hit of $total"
awk -v a="$t1" -v b="$t2" 'BEGIN { exit !(b < a) }' && pass "cached prefix answered sooner (${t2}s vs ${t1}s)" ||
    fail "cached prefix not faster: ${t2}s vs ${t1}s"
rate=$(metric loom_prefix_cache_hit_rate)
awk -v r="$rate" 'BEGIN { exit !(r > 0) }' && pass "/metrics reports the hit rate ($rate)" || fail "hit rate $rate"

# ---- bad input: OpenAI-style errors with the right status
expect_error() { # STATUS DESCRIPTION PATH BODY [curl args]
    st=$1 what=$2 p=$3 body=$4; shift 4
    post "$p" "$body" "$@" >"$tmpdir/err.out"
    code=$(tail -n1 "$tmpdir/err.out")
    if [ "$code" = "$st" ] && sed '$d' "$tmpdir/err.out" | jq -e '.error.message | length > 0' >/dev/null; then
        pass "$what: $st, $(sed '$d' "$tmpdir/err.out" | jq -r .error.message)"
    else fail "$what: want $st, got $code $(cat "$tmpdir/err.out")"; fi
}
expect_error 400 "malformed JSON" /v1/completions '{"model": "x", "prompt": '
expect_error 400 "wrong type" /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"a\",\"max_tokens\":\"ten\"}"
expect_error 400 "unknown field" /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"a\",\"frobnicate\":1}"
expect_error 400 "missing prompt" /v1/completions "{\"model\":\"$NAME\"}"
expect_error 400 "out-of-range temperature" /v1/chat/completions "{\"model\":\"$NAME\",\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"temperature\":5}"
expect_error 400 "bad role" /v1/chat/completions "{\"model\":\"$NAME\",\"messages\":[{\"role\":\"wizard\",\"content\":\"a\"}]}"
expect_error 400 "unsupported tools" /v1/chat/completions "{\"model\":\"$NAME\",\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"tools\":[{\"type\":\"function\"}]}"
expect_error 404 "unknown model" /v1/completions '{"model":"gpt-9","prompt":"a"}'
toolong=$(for _ in $(seq 700); do printf 'one two three '; done)
expect_error 400 "prompt longer than the context" /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"$toolong\"}"
sed '$d' "$tmpdir/err.out" | jq -e '.error.code == "context_length_exceeded"' >/dev/null &&
    pass "context error code" || fail "context error code: $(cat "$tmpdir/err.out")"
code=$(curl -s -o "$tmpdir/badkey" -w '%{http_code}' -H "Authorization: Bearer nope" -d '{}' "$URL/v1/completions")
[ "$code" = 401 ] && jq -e '.error.code == "invalid_api_key"' "$tmpdir/badkey" >/dev/null &&
    pass "wrong API key: 401" || fail "wrong key: $code $(cat "$tmpdir/badkey")"
code=$(curl -s -o "$tmpdir/nokey" -w '%{http_code}' -d '{}' "$URL/v1/completions")
[ "$code" = 401 ] && pass "missing API key: 401" || fail "missing key: $code"
expect_error 405 "GET on completions" /v1/completions "" -X GET
curl -s -o /dev/null -D "$tmpdir/405.h" -X DELETE -H "Authorization: Bearer $KEY" "$URL/v1/models"
grep -qi '^Allow: GET, HEAD' "$tmpdir/405.h" && grep -q '^HTTP/1.1 405' "$tmpdir/405.h" &&
    pass "a 405 says what is allowed (Allow: GET, HEAD)" || fail "405 headers: $(cat "$tmpdir/405.h")"
code=$(curl -s -o /dev/null -w '%{http_code}' "$URL/v2/nothing")
[ "$code" = 404 ] && pass "unknown path: 404" || fail "unknown path: $code"
big=$(head -c 1100000 /dev/zero | tr '\0' a)
printf '{"model":"%s","prompt":"%s"}' "$NAME" "$big" >"$tmpdir/big.json"
code=$(curl -s -o "$tmpdir/big.out" -w '%{http_code}' -H "Authorization: Bearer $KEY" --data-binary @"$tmpdir/big.json" "$URL/v1/completions")
[ "$code" = 413 ] && pass "body over the limit: 413" || fail "big body: $code $(head -c 300 "$tmpdir/big.out")"
# n > 1: n choices, each its own sample
post /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"The dog\",\"max_tokens\":12,\"n\":3,\"seed\":1}" |
    sed '$d' | jq -e '(.choices | length) == 3 and ([.choices[].index] == [0,1,2]) and .usage.completion_tokens > 0' \
    >/dev/null && pass "n=3 gives three choices" || fail "n=3"
# stop strings end the text before them
post /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"Once upon a time\",\"max_tokens\":60,\"temperature\":0,\"stop\":[\" she\",\"Lily\"]}" |
    sed '$d' >"$tmpdir/stop.json"
jq -e '(.choices[0].text | contains("Lily") or contains(" she") | not) and .choices[0].finish_reason == "stop"' \
    "$tmpdir/stop.json" >/dev/null && pass "stop strings: '$(jq -r '.choices[0].text' "$tmpdir/stop.json")'" ||
    fail "stop: $(cat "$tmpdir/stop.json")"

# ---- SIGTERM: a running stream is finished or cancelled cleanly, then exit 0
post /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"Once\",\"max_tokens\":2000,\"ignore_eos\":true,\"stream\":true}" \
    -N >"$tmpdir/term.out" &
client=$!
for _ in $(seq 100); do grep -q '^data: {' "$tmpdir/term.out" 2>/dev/null && break; sleep 0.1; done
kill -TERM "$PID"
wait "$LAUNCHER"; rc=$?
wait "$client"
[ "$rc" = 0 ] && pass "SIGTERM: exit 0" || fail "SIGTERM: exit $rc"
grep -q '^data: \[DONE\]' "$tmpdir/term.out" && pass "the running stream was closed properly" ||
    fail "stream after SIGTERM: $(tail -n 3 "$tmpdir/term.out")"
expect_grep "stopped" "$tmpdir/server.log" "server says it stopped"

# ---- a port in use is a clear error
"$LOOM" serve -m "$MODEL" --port "$port" >"$tmpdir/busy.log" 2>&1 &
bpid=$!
sleep 1
"$LOOM" serve -m "$MODEL" --port "$port" >"$tmpdir/busy2.log" 2>&1; rc=$?
kill -TERM "$bpid"; wait "$bpid"
[ "$rc" != 0 ] && grep -q "cannot listen" "$tmpdir/busy2.log" && pass "port in use: $(cat "$tmpdir/busy2.log" | tail -n1)" ||
    fail "port in use: rc $rc $(cat "$tmpdir/busy2.log")"
"$LOOM" serve -m "$MODEL" --max-batch 0 >"$tmpdir/flag.log" 2>&1
expect_grep "max-batch wants a whole number" "$tmpdir/flag.log" "bad flag value named"
"$LOOM" serve -m "$MODEL" --top-p 2 >"$tmpdir/topp.log" 2>&1
expect_grep "loom serve: --top-p wants a number from 0 to 1, not '2'" "$tmpdir/topp.log" \
    "a bad sampling flag is named as loom run names it"

# ---- sampling flags set what a request leaves out: loom run's defaults (temperature 0.8,
# top-k 40, top-p 0.95, min-p 0.05) given to the server answer as loom run does, seed for seed,
# with speculative decoding by prompt lookup on (it changes no answer, only the passes)
start_server "$tmpdir/server2.log" --temp 0.8 --top-k 40 --top-p 0.95 --min-p 0.05 --lookup 3
"$LOOM" run -m "$MODEL" -p "Once upon a time, there was a" -n 40 --seed 42 --json 2>/dev/null |
    jq -r .text >"$tmpdir/run2.txt"
post /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"Once upon a time, there was a\",
    \"max_tokens\":40,\"seed\":42}" | sed '$d' | jq -j '.choices[0].text' >"$tmpdir/c2.txt"
echo >>"$tmpdir/c2.txt"
if cmp -s "$tmpdir/run2.txt" "$tmpdir/c2.txt"; then
    pass "serve --temp/--top-k/--top-p/--min-p are a request's defaults: equal to loom run"
else
    fail "serve with sampling flags differs from loom run:"; diff "$tmpdir/run2.txt" "$tmpdir/c2.txt" >&2
fi
cmp -s "$tmpdir/run.txt" "$tmpdir/run2.txt" && fail "loom run's defaults gave the OpenAI-default text"
# a prompt whose answer copies an earlier stretch: proposals are kept, and the answer is the
# one without speculation ("speculative": false)
copy_prompt=$(jq -Rn --rawfile t "$tmpdir/run2.txt" '"Once upon a time, there was a" + ($t | rtrimstr("\n")) + " Once upon a time, there was a"')
for spec in on off; do
    extra='{}'; [ $spec = off ] && extra='{"speculative": false}'
    post /v1/completions "$(jq -n --arg n "$NAME" --argjson p "$copy_prompt" --argjson s "$extra" \
        '{model: $n, prompt: $p, max_tokens: 40, temperature: 0} + $s')" | sed '$d' |
        jq -j '.choices[0].text' >"$tmpdir/copy-$spec.txt"
    [ $spec = on ] && accepted=$(metric loom_speculative_accepted_total)
done
cmp -s "$tmpdir/copy-on.txt" "$tmpdir/copy-off.txt" && [ "${accepted:-0}" -gt 0 ] &&
    [ "$(metric loom_speculative_accepted_total)" = "$accepted" ] &&
    pass "serve --lookup: $accepted proposals kept, the answer as with \"speculative\": false" ||
    { fail "serve --lookup: accepted ${accepted:-none}"; diff "$tmpdir/copy-on.txt" "$tmpdir/copy-off.txt" >&2; }
got=$(post /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"x\",\"speculative\":{\"lookup\":99}}")
[ "$(echo "$got" | tail -1)" = 400 ] && echo "$got" | grep -q "'lookup' must be a whole number from 0 to 64" &&
    pass "a bad 'speculative' is a 400 naming the field" || fail "bad speculative: $got"
got=$(post /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"x\",\"speculative\":{\"draft\":true}}")
[ "$(echo "$got" | tail -1)" = 400 ] && echo "$got" | grep -q "this server has no draft model" &&
    pass "'speculative': {'draft': true} without a draft model is a 400" || fail "draft without drafter: $got"
stop_server

# ---- a drafter model (the model itself, opened again: it agrees with every greedy token):
# the answers of plain decoding, sampled ones seed for seed, proposals kept
start_server "$tmpdir/server-draft.log" --temp 0.8 --top-k 40 --top-p 0.95 --min-p 0.05 \
    --draft "$MODEL" --draft-p-min 0
for spec in on off; do
    extra='{}'; [ $spec = off ] && extra='{"speculative": false}'
    post /v1/completions "$(jq -n --arg n "$NAME" --argjson p "$copy_prompt" --argjson s "$extra" \
        '{model: $n, prompt: $p, max_tokens: 40, temperature: 0} + $s')" | sed '$d' |
        jq -j '.choices[0].text' >"$tmpdir/draft-$spec.txt"
done
post /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"Once upon a time, there was a\",
    \"max_tokens\":40,\"seed\":42}" | sed '$d' | jq -j '.choices[0].text' >"$tmpdir/draft-sampled.txt"
echo >>"$tmpdir/draft-sampled.txt"
accepted=$(metric loom_speculative_accepted_total)
cmp -s "$tmpdir/draft-on.txt" "$tmpdir/draft-off.txt" && cmp -s "$tmpdir/run2.txt" "$tmpdir/draft-sampled.txt" &&
    [ "${accepted:-0}" -gt 0 ] &&
    pass "serve --draft: $accepted proposals kept; greedy and seeded answers as without" ||
    { fail "serve --draft: accepted ${accepted:-none}"; diff "$tmpdir/draft-on.txt" "$tmpdir/draft-off.txt" >&2;
      diff "$tmpdir/run2.txt" "$tmpdir/draft-sampled.txt" >&2; }
stop_server
"$LOOM" bench --synthetic tiny --type q8_0 --write "$tmpdir/other-vocab.gguf" 2> /dev/null
"$LOOM" serve -m "$MODEL" --port 0 --draft "$tmpdir/other-vocab.gguf" > "$tmpdir/draft-bad.log" 2>&1 &&
    fail "a drafter of another vocabulary accepted"
expect_grep "draft model's token [0-9]* is not the model's" "$tmpdir/draft-bad.log" \
    "serve --draft of another vocabulary: refused at start, the id named"

# ---- a Qwen3.5 file's own multi-token-prediction block as the drafter: greedy answers as
# without, its proposals checked in the batched step (its random weights seldom agree)
q35=$FIXTURES/tiny-qwen35/model.gguf
if [ -z "${LOOM_SERVE_MPIRUN:-}" ] && [ -f "$q35" ]; then
    STORIES=$MODEL MODEL=$q35
    start_server "$tmpdir/server-mtp.log" --draft-mtp --draft-p-min 0 --model-name q35
    for spec in on off; do
        extra='{}'; [ $spec = off ] && extra='{"speculative": false}'
        post /v1/completions "$(jq -n --argjson s "$extra" \
            '{model: "q35", prompt: "What is the capital of France? The capital", max_tokens: 24,
              temperature: 0} + $s')" | sed '$d' | jq -j '.choices[0].text' >"$tmpdir/mtp-$spec.txt"
    done
    proposed=$(metric loom_speculative_proposed_total)
    cmp -s "$tmpdir/mtp-on.txt" "$tmpdir/mtp-off.txt" && [ "${proposed:-0}" -gt 0 ] &&
        pass "serve --draft-mtp: $proposed proposals checked; the greedy answer as without" ||
        { fail "serve --draft-mtp: proposed ${proposed:-none}"; cat "$tmpdir/server-mtp.log" >&2
          diff "$tmpdir/mtp-on.txt" "$tmpdir/mtp-off.txt" >&2; }
    stop_server
    MODEL=$STORIES
fi

# ---- under pressure: one sequence at a time and a queue of one. A long request runs; the next
# waits; one more is refused at once (429, Retry-After, OpenAI's error); a request whose
# deadline comes while it waits gets 504 (streamed or not: the status waits for the first
# event); a running one's deadline cuts it short, saying so. stories260K decodes 480 tokens in
# under 0.1 s, less than a few curl calls take on a busy machine, so the "long" request here runs
# a 160M-parameter synthetic model (some hundreds of tokens/s) and its own deadline bounds it
"$LOOM" bench --synthetic 160m --type q4_0 --write "$tmpdir/slow.gguf" >/dev/null 2>&1 ||
    { fail "could not write the synthetic 160m model"; finish; }
STORIES=$MODEL STORIES_NAME=$NAME MODEL=$tmpdir/slow.gguf
start_server "$tmpdir/server3.log" -c 2048 --max-batch 1 --max-queue 1
NAME=$(curl -s -H "Authorization: Bearer $KEY" "$URL/v1/models" | jq -r '.data[0].id')
long="{\"model\":\"$NAME\",\"prompt\":\"Once upon a time\",\"max_tokens\":1500,\"ignore_eos\":true,
    \"timeout\":2}"
busy_ok=0
for attempt in 1 2 3; do
    post /v1/completions "$long" >"$tmpdir/long.out" & lp=$!
    for _ in $(seq 200); do [ "$(metric loom_requests_running)" = 1 ] && break; sleep 0.01; done
    post /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"Once\",\"max_tokens\":2}" \
        >"$tmpdir/waiter.out" & tp=$!
    for _ in $(seq 200); do [ "$(metric loom_requests_waiting)" = 1 ] && break; sleep 0.01; done
    post /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"Once\",\"max_tokens\":2}" \
        -D "$tmpdir/busy.h" >"$tmpdir/busy.out"
    running=$(metric loom_requests_running)
    wait "$lp" "$tp"
    [ "$(tail -n1 "$tmpdir/busy.out")" = 429 ] && [ "$running" = 1 ] && { busy_ok=1; break; }
done
[ $busy_ok = 1 ] && grep -qi '^Retry-After: 1' "$tmpdir/busy.h" &&
    sed '$d' "$tmpdir/busy.out" | jq -e '.error.type == "rate_limit_error" and
        .error.code == "rate_limit_exceeded" and (.error.message | test("busy"))' >/dev/null &&
    pass "a full queue answers 429 at once, with Retry-After" ||
    fail "full queue: $(cat "$tmpdir/busy.out") $(cat "$tmpdir/busy.h")"
[ "$(tail -n1 "$tmpdir/long.out")" = 200 ] && [ "$(tail -n1 "$tmpdir/waiter.out")" = 200 ] &&
    pass "the running and the waiting request are answered in full" ||
    fail "long and waiting requests: $(tail -n1 "$tmpdir/long.out") $(tail -n1 "$tmpdir/waiter.out")"
# a full queue and a newcomer of better priority: the waiting one that has not started is
# refused (429, it was displaced) and the newcomer takes its place and is answered
displaced_ok=0
for attempt in 1 2 3; do
    post /v1/completions "$long" >"$tmpdir/long3.out" & lp=$!
    for _ in $(seq 200); do [ "$(metric loom_requests_running)" = 1 ] && break; sleep 0.01; done
    post /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"Once\",\"max_tokens\":2}" \
        >"$tmpdir/worse.out" & tp=$!
    for _ in $(seq 200); do [ "$(metric loom_requests_waiting)" = 1 ] && break; sleep 0.01; done
    curl -s "$URL/metrics" | grep '^loom_requests_waiting_by_priority' >"$tmpdir/by_priority"
    post /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"Once\",\"max_tokens\":2,\"priority\":-1}" \
        >"$tmpdir/better.out"
    wait "$lp" "$tp"
    [ "$(tail -n1 "$tmpdir/worse.out")" = 429 ] && [ "$(tail -n1 "$tmpdir/better.out")" = 200 ] &&
        { displaced_ok=1; break; }
done
[ $displaced_ok = 1 ] && sed '$d' "$tmpdir/worse.out" | jq -e '.error.type == "rate_limit_error" and
        (.error.message | test("better priority"))' >/dev/null &&
    [ "$(metric loom_requests_displaced_total)" -ge 1 ] &&
    pass "a full queue: a better-priority newcomer displaces the waiting request (429) and runs" ||
    fail "displacement: $(cat "$tmpdir/worse.out") / $(cat "$tmpdir/better.out")"
[ "$(cat "$tmpdir/by_priority")" = 'loom_requests_waiting_by_priority{priority="0"} 1' ] &&
    pass "/metrics shows the waiting request by its priority" ||
    fail "waiting by priority: '$(cat "$tmpdir/by_priority")'"
post /v1/completions "$long" >"$tmpdir/long1.out" & lp=$!
for _ in $(seq 200); do [ "$(metric loom_requests_running)" = 1 ] && break; sleep 0.01; done
post /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"Once\",\"max_tokens\":2,\"timeout\":0.01}" \
    >"$tmpdir/late.out"
wait "$lp"
[ "$(tail -n1 "$tmpdir/late.out")" = 504 ] &&
    sed '$d' "$tmpdir/late.out" | jq -e '.error.type == "timeout_error" and
        (.error.message | test("deadline"))' >/dev/null &&
    pass "a request whose deadline comes while it waits gets 504" ||
    fail "deadline while waiting: $(cat "$tmpdir/late.out")"
post /v1/completions "$long" >"$tmpdir/long2.out" & lp=$!
for _ in $(seq 200); do [ "$(metric loom_requests_running)" = 1 ] && break; sleep 0.01; done
post /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"Once\",\"max_tokens\":2,\"timeout\":0.01,
    \"stream\":true}" -N >"$tmpdir/late_s.out"
wait "$lp"
[ "$(tail -n1 "$tmpdir/late_s.out")" = 504 ] && pass "streamed, the deadline while waiting is a 504 too" ||
    fail "streamed deadline: $(cat "$tmpdir/late_s.out")"
post /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"Once upon a time\",\"max_tokens\":480,
    \"ignore_eos\":true,\"timeout\":0.3}" >"$tmpdir/cut.out"
sed '$d' "$tmpdir/cut.out" | jq -e '.stopped_at_deadline == true and .usage.completion_tokens < 480 and
    .choices[0].finish_reason == "length"' >/dev/null &&
    pass "a running request's deadline ends it with what it has ($(sed '$d' "$tmpdir/cut.out" |
        jq .usage.completion_tokens) tokens)" || fail "deadline while running: $(cat "$tmpdir/cut.out")"
[ "$(metric loom_requests_refused_busy_total)" -ge 1 ] &&
    curl -s "$URL/metrics" | grep -q 'loom_requests_deadline_total{while="waiting"} [1-9]' &&
    pass "/metrics counts the 429s and the deadlines" || fail "metrics: $(curl -s "$URL/metrics" | grep -i 'refused\|deadline')"
expect_error 400 "priority must be a whole number" /v1/completions \
    "{\"model\":\"$NAME\",\"prompt\":\"x\",\"priority\":0.5}"
stop_server

# ---- tenants (--api-keys): each key opens the door, a wrong one does not; alice may have one
# request waiting, so her second is a 429 ("yours") while bob's is still taken; /metrics counts
# by name (to an admin key: ops) and never shows a key
printf '# name key options\nalice alice-key max-queue=1 priority=1\n\nbob bob-key\nops ops-key admin\n' >"$tmpdir/keys"
KEY_SAVED=$KEY; KEY=
start_server "$tmpdir/server4.log" -c 2048 --max-batch 1 --api-keys "$tmpdir/keys"
as() { who=$1; shift; KEY=$who-key post "$@"; }
[ "$(as alice /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"Once\",\"max_tokens\":2}" | tail -n1)" = 200 ] &&
    [ "$(as bob /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"Once\",\"max_tokens\":2}" | tail -n1)" = 200 ] &&
    [ "$(as carol /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"Once\",\"max_tokens\":2}" | tail -n1)" = 401 ] &&
    pass "--api-keys: each tenant's key works, another is refused" || fail "--api-keys: keys"
tenant_ok=0
for attempt in 1 2 3; do
    as bob /v1/completions "$long" >"$tmpdir/t_long.out" & lp=$!
    for _ in $(seq 200); do [ "$(metric loom_requests_running)" = 1 ] && break; sleep 0.01; done
    as alice /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"Once\",\"max_tokens\":2}" \
        >"$tmpdir/t_wait.out" & wp=$!
    for _ in $(seq 200); do [ "$(metric loom_requests_waiting)" = 1 ] && break; sleep 0.01; done
    as alice /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"Once\",\"max_tokens\":2}" >"$tmpdir/t_busy.out"
    as bob /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"Once\",\"max_tokens\":2}" >"$tmpdir/t_bob.out" & bp=$!
    running=$(metric loom_requests_running)
    wait "$lp" "$wp" "$bp"
    [ "$(tail -n1 "$tmpdir/t_busy.out")" = 429 ] && [ "$running" = 1 ] && { tenant_ok=1; break; }
done
[ $tenant_ok = 1 ] && sed '$d' "$tmpdir/t_busy.out" | jq -e '.error.message | test("yours")' >/dev/null &&
    [ "$(tail -n1 "$tmpdir/t_bob.out")" = 200 ] && [ "$(tail -n1 "$tmpdir/t_wait.out")" = 200 ] &&
    pass "a tenant past its share of the queue gets 429 while another's request is taken" ||
    fail "tenant queue: $(cat "$tmpdir/t_busy.out") bob $(tail -n1 "$tmpdir/t_bob.out")"
curl -s -H "Authorization: Bearer ops-key" "$URL/metrics" >"$tmpdir/t_metrics"
grep -q 'loom_key_requests_total{key="alice"} [1-9]' "$tmpdir/t_metrics" &&
    grep -q 'loom_key_refused_busy_total{key="alice"} [1-9]' "$tmpdir/t_metrics" &&
    ! grep -q 'alice-key\|bob-key' "$tmpdir/t_metrics" &&
    pass "/metrics counts requests and 429s by key name, never the key" ||
    fail "per-key metrics: $(grep loom_key "$tmpdir/t_metrics")"
# the latency histograms: buckets that only grow, ending at _count; the keys' counts add up to
# the server's (every request here has a key); alice's request that waited behind bob's long one
# (seconds) shows in her queue histogram past 0.1 s
histogram_ok() { # METRIC [LABEL,]: cumulative buckets ending at +Inf = _count
    awk -v m="$1" -v l="${2:-}" '
        index($1, m "_bucket{" l "le=") == 1 { if ($2 < last) bad = 1; last = $2; n++;
                                              if ($1 ~ /le="\+Inf"/) inf = $2 }
        $1 == m "_count" || (l != "" && $1 == m "_count{" substr(l, 1, length(l) - 1) "}") { count = $2 }
        END { exit !(n == 12 && !bad && inf == count && count > 0) }' "$tmpdir/t_metrics"
}
key_count() { awk -v m="$1" '$1 ~ "^" m "_count\\{key=" { s += $2 } END { print s + 0 }' "$tmpdir/t_metrics"; }
alice_queue() { awk -v le="$1" '$1 == "loom_key_queue_seconds_" le { print $2 }' "$tmpdir/t_metrics"; }
histogram_ok loom_queue_seconds && histogram_ok loom_time_to_first_token_seconds &&
    histogram_ok loom_key_queue_seconds 'key="alice",' &&
    histogram_ok loom_key_time_to_first_token_seconds 'key="bob",' &&
    [ "$(key_count loom_key_queue_seconds)" = "$(metric loom_queue_seconds_count)" ] &&
    [ "$(key_count loom_key_time_to_first_token_seconds)" = "$(metric loom_time_to_first_token_seconds_count)" ] &&
    [ "$(alice_queue 'bucket{key="alice",le="0.1"}')" -lt "$(alice_queue 'count{key="alice"}')" ] &&
    pass "/metrics: queue and first-token histograms, per key name too, that add up" ||
    fail "latency histograms: $(grep 'seconds' "$tmpdir/t_metrics" | grep -v '^#' | tr '\n' ' ')"
stop_server
KEY=$KEY_SAVED

MODEL=$STORIES NAME=$STORIES_NAME
long="{\"model\":\"$NAME\",\"prompt\":\"Once upon a time\",\"max_tokens\":480,\"ignore_eos\":true}"

# ---- reload and rollback: SIGHUP (or POST /admin/reload) re-opens the model file, which a
# deployment replaces by rename. A broken file leaves the old model serving and /health says
# why; a good one (here the model quantised to q8_0) takes the new requests, while a request
# running during the reload finishes on the old
health() { curl -s -H "Authorization: Bearer $KEY" "$URL/health"; }
if [ -n "${LOOM_SERVE_MPIRUN:-}" ]; then
    start_server "$tmpdir/server5.log" -c 512
    post /admin/reload "" -X POST >"$tmpdir/r_admin.out"
    [ "$(tail -n1 "$tmpdir/r_admin.out")" = 500 ] && grep -q "pipeline" "$tmpdir/r_admin.out" &&
        pass "a pipeline refuses to reload, saying why" || fail "reload under MPI: $(cat "$tmpdir/r_admin.out")"
    stop_server
else
cp "$MODEL" "$tmpdir/live.gguf"
MODEL_SAVED=$MODEL; MODEL=$tmpdir/live.gguf
start_server "$tmpdir/server5.log" -c 512 --max-batch 4
MODEL=$MODEL_SAVED
post /v1/completions "$long" >"$tmpdir/r_long.out" & lp=$!
for _ in $(seq 200); do [ "$(metric loom_requests_running)" = 1 ] && break; sleep 0.01; done
head -c 1000 "$MODEL" >"$tmpdir/broken.gguf" && mv "$tmpdir/broken.gguf" "$tmpdir/live.gguf"
kill -HUP "$PID"
for _ in $(seq 100); do grep -q "reloading .* failed" "$tmpdir/server5.log" && break; sleep 0.05; done
health >"$tmpdir/r_health1"
jq -e '.status == "ok" and .reloads == 0 and (.reload_error | length > 0)' "$tmpdir/r_health1" >/dev/null &&
    [ "$(post /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"Once\",\"max_tokens\":2}" | tail -n1)" = 200 ] &&
    pass "a broken file on SIGHUP: the old model keeps serving, /health says why" ||
    fail "broken reload: $(cat "$tmpdir/r_health1")"
"$LOOM" quantize "$MODEL" "$tmpdir/q8.gguf" --type q8_0 --quiet >/dev/null 2>&1 &&
    mv "$tmpdir/q8.gguf" "$tmpdir/live.gguf"
kill -HUP "$PID"
for _ in $(seq 100); do grep -q "reloaded " "$tmpdir/server5.log" && break; sleep 0.05; done
wait "$lp"
health >"$tmpdir/r_health2"
jq -e '.reloads == 1 and (has("reload_error") | not)' "$tmpdir/r_health2" >/dev/null &&
    [ "$(tail -n1 "$tmpdir/r_long.out")" = 200 ] &&
    [ "$(sed '$d' "$tmpdir/r_long.out" | jq .usage.completion_tokens)" = 480 ] &&
    [ "$(post /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"Once\",\"max_tokens\":2}" | tail -n1)" = 200 ] &&
    pass "a good file on SIGHUP takes new requests; the running one finished on the old" ||
    fail "good reload: $(cat "$tmpdir/r_health2") long $(tail -n1 "$tmpdir/r_long.out")"
post /admin/reload "" -X POST >"$tmpdir/r_admin.out"
[ "$(tail -n1 "$tmpdir/r_admin.out")" = 200 ] && [ "$(health | jq .reloads)" = 2 ] &&
    pass "POST /admin/reload reloads too" || fail "admin reload: $(cat "$tmpdir/r_admin.out")"
code=$(curl -s -o /dev/null -w '%{http_code}' -X POST "$URL/admin/reload")
[ "$code" = 401 ] && pass "/admin/reload wants the key" || fail "/admin/reload without key: $code"
stop_server
grep -q "loom serve: stopped" "$tmpdir/server5.log" && pass "a reloaded server stops cleanly" ||
    fail "stop after reloads: $(tail -n3 "$tmpdir/server5.log")"
fi
printf 'alice alice-key max-queue=0\n' >"$tmpdir/badkeys"
"$LOOM" serve -m "$MODEL" --api-keys "$tmpdir/badkeys" >"$tmpdir/badkeys.log" 2>&1
expect_grep "badkeys:1: 'max-queue=0' is not" "$tmpdir/badkeys.log" "a bad --api-keys line is named"
printf 'alice k1\nalice k2\n' >"$tmpdir/dupkeys"
"$LOOM" serve -m "$MODEL" --api-keys "$tmpdir/dupkeys" >"$tmpdir/dupkeys.log" 2>&1
expect_grep "dupkeys:2: the name 'alice' is given twice" "$tmpdir/dupkeys.log" \
    "a name given twice in --api-keys is refused"
"$LOOM" serve -m "$MODEL" --kv-blocks 10 >"$tmpdir/kv.log" 2>&1
expect_grep "kv-blocks 10 holds 160 tokens, less than one 2048-token context" "$tmpdir/kv.log" \
    "a KV pool smaller than one context is refused with the numbers"
finish
