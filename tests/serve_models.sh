#!/bin/sh
# tests/serve_models.sh - one `loom serve` for several models, chosen by the request's "model"
# (--models-dir, --add-model): each answers as `loom run` does on its own file; they load on
# first use (or an admin's /admin/models/load) and, past --models-max or --models-max-bytes, the
# least recently used idle one is unloaded (and loads
# again when asked); a model that is not loaded while every loaded one is busy is a 503; an
# unknown name is a 404 listing the names; every endpoint routes by name; bad flags are named.
# On loom's synthetic models.
. "$top_srcdir/tests/lib.sh"
command -v curl >/dev/null || { echo "SKIP: curl not installed"; exit 77; }
KEY=test-key
MODEL=$(suite_model tiny-chat)
mkdir -p "$tmpdir/models"
for shape in tiny moe-tiny mla-tiny; do
    "$LOOM" bench --synthetic $shape --type f32 --write "$tmpdir/models/$shape.gguf" >/dev/null 2>&1 ||
        fail "writing the synthetic $shape model"
done
"$LOOM" bench --synthetic wide --type q8_0 --write "$tmpdir/wide.gguf" >/dev/null 2>&1 ||
    fail "writing the synthetic wide model"
. "$top_srcdir/tests/serve_lib.sh"

start_server "$tmpdir/s.log" -c 4096 --models-dir "$tmpdir/models" --add-model "wide=$tmpdir/wide.gguf" \
    --models-max 1
models() { curl -s -H "Authorization: Bearer $KEY" "$URL/v1/models" | jq -c '[.data[] | [.id, .loaded]]'; }
first=$(curl -s -H "Authorization: Bearer $KEY" "$URL/v1/models" | jq -r '.data[0].id')
want="[[\"$first\",true],[\"mla-tiny\",false],[\"moe-tiny\",false],[\"tiny\",false],[\"wide\",false]]"
[ "$(models)" = "$want" ] && pass "/v1/models lists the first and the others, none of them loaded yet" ||
    fail "/v1/models: $(models), want $want"

# each answers as loom run does on its own file
for shape in moe-tiny tiny mla-tiny; do
    post /v1/completions "{\"model\": \"$shape\", \"prompt\": \"Once upon a time\", \"max_tokens\": 12,
        \"temperature\": 0}" | sed '$d' | jq -j '.model, "|", .choices[0].text' >"$tmpdir/got"
    printf '%s|' "$shape" >"$tmpdir/want"
    "$LOOM" run -m "$tmpdir/models/$shape.gguf" -p "Once upon a time" -n 12 --temp 0 --json 2>/dev/null |
        jq -j .text >>"$tmpdir/want"
    cmp -s "$tmpdir/got" "$tmpdir/want" && pass "$shape answers as loom run on its file: '$(cat "$tmpdir/got")'" ||
        fail "$shape: '$(cat "$tmpdir/got")', loom run: '$(cat "$tmpdir/want")'"
done
want="[[\"$first\",true],[\"mla-tiny\",true],[\"moe-tiny\",false],[\"tiny\",false],[\"wide\",false]]"
[ "$(models)" = "$want" ] && grep -q "unloaded tiny (least recently used" "$tmpdir/s.log" &&
    pass "--models-max 1: the last one asked is loaded, the others were unloaded" ||
    fail "after three models: $(models)"
# unloaded and asked again: it loads again, with the same answer
post /v1/completions "{\"model\": \"moe-tiny\", \"prompt\": \"Once upon a time\", \"max_tokens\": 12,
    \"temperature\": 0}" | sed '$d' | jq -j '.model, "|", .choices[0].text' >"$tmpdir/again"
"$LOOM" run -m "$tmpdir/models/moe-tiny.gguf" -p "Once upon a time" -n 12 --temp 0 --json 2>/dev/null |
    jq -j '"moe-tiny|" + .text' >"$tmpdir/want"
cmp -s "$tmpdir/again" "$tmpdir/want" && [ "$(grep -c 'loading moe-tiny' "$tmpdir/s.log")" = 2 ] &&
    pass "an unloaded model asked again loads again and answers the same" ||
    fail "moe-tiny again: '$(cat "$tmpdir/again")' ($(grep -c 'loading moe-tiny' "$tmpdir/s.log") loads)"

# every endpoint routes by name: chat, Anthropic's messages, embeddings (the wide model's width)
code=$(post /v1/chat/completions '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}' | tail -n1)
mcode=$(curl -s -o "$tmpdir/m.json" -w '%{http_code}' -H "x-api-key: $KEY" \
    -d '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}' "$URL/v1/messages")
width=$(post /v1/embeddings '{"model": "wide", "input": "hi"}' | sed '$d' | jq '.data[0].embedding | length')
[ "$code" = 200 ] && [ "$mcode" = 200 ] && [ "$width" = 4160 ] &&
    jq -e '.model == "tiny"' "$tmpdir/m.json" >/dev/null &&
    pass "chat, messages and embeddings by name (wide's embedding: $width numbers)" ||
    fail "by name: chat $code, messages $mcode $(head -c 200 "$tmpdir/m.json"), embedding width $width"

# not loaded while the loaded one is busy: 503; once it is free, the other loads
# (curl itself in the background, not a function's subshell: killing it must close the stream)
curl -s -N -H "Authorization: Bearer $KEY" -H 'Content-Type: application/json' "$URL/v1/completions" \
    --data-binary '{"model": "wide", "prompt": "Once", "max_tokens": 4000, "ignore_eos": true, "stream": true}' \
    >"$tmpdir/long.out" &
client=$!
for _ in $(seq 100); do grep -q '^data: {' "$tmpdir/long.out" 2>/dev/null && break; sleep 0.05; done
post /v1/completions '{"model": "tiny", "prompt": "Once", "max_tokens": 2}' >"$tmpdir/busy.out"
kill "$client" 2>/dev/null; wait "$client" 2>/dev/null
[ "$(tail -n1 "$tmpdir/busy.out")" = 503 ] &&
    sed '$d' "$tmpdir/busy.out" | jq -e '.error.message | test("all answering requests")' >/dev/null &&
    pass "a model not loaded while the one loaded is busy (--models-max 1): 503" ||
    fail "busy: $(cat "$tmpdir/busy.out")"
got=
for _ in $(seq 50); do
    got=$(post /v1/completions '{"model": "tiny", "prompt": "Once", "max_tokens": 2}' | tail -n1)
    [ "$got" = 200 ] && break
    sleep 0.1
done
[ "$got" = 200 ] && pass "once the busy one is free, the other loads in its place" || fail "after the long request: $got"
curl -s "$URL/metrics" -H "Authorization: Bearer $KEY" >"$tmpdir/metrics.txt"
grep -q "^loom_model_generated_tokens_total{model=\"$first\"} " "$tmpdir/metrics.txt" &&
    [ "$(awk '$1 == "loom_model_generated_tokens_total{model=\"tiny\"}" { print $2 }' "$tmpdir/metrics.txt")" -ge 2 ] &&
    pass "/metrics counts each loaded model's engine (tiny: $(awk '$1 == "loom_model_generated_tokens_total{model=\"tiny\"}" { print $2 }' "$tmpdir/metrics.txt") tokens)" ||
    fail "per-model metrics: $(grep loom_model_generated "$tmpdir/metrics.txt")"

# an admin loads and unloads by hand
[ "$(post /admin/models/load '{"model": "moe-tiny"}' | sed '$d' | jq -c '[.data[] | select(.id == "moe-tiny") | .loaded]')" = "[true]" ] &&
    [ "$(post /admin/models/unload '{"model": "moe-tiny"}' | sed '$d' | jq -c '[.data[] | select(.id == "moe-tiny") | .loaded]')" = "[false]" ] &&
    [ "$(post /admin/models/unload "{\"model\": \"$first\"}" | tail -n1)" = 404 ] &&
    [ "$(post /admin/models/load '{"model": "nope"}' | tail -n1)" = 404 ] &&
    pass "POST /admin/models/load and unload; the first model and an unknown one are 404s" ||
    fail "admin load/unload: $(models)"
got=$(post /v1/completions '{"model": "llama", "prompt": "x"}' | sed '$d' | jq -r '"\(.error.code): \(.error.message)"')
case $got in "model_not_found: "*"'tiny', 'wide'"*) pass "an unknown name: 404 naming the models ($got)" ;;
    *) fail "unknown name: $got" ;; esac
stop_server

# a byte budget: room for one of the small models (weights and KV pool) but not two
start_server "$tmpdir/b.log" -c 1024 --models-dir "$tmpdir/models" --models-max 8 --models-max-bytes 6000000
post /v1/completions '{"model": "tiny", "prompt": "Once", "max_tokens": 2}' >/dev/null
post /v1/completions '{"model": "moe-tiny", "prompt": "Once", "max_tokens": 2}' >/dev/null
[ "$(models | jq -c '[.[] | select(.[1]) | .[0]] | .[1:]')" = '["moe-tiny"]' ] &&
    grep -q "unloaded tiny" "$tmpdir/b.log" &&
    pass "--models-max-bytes: loading a second model unloaded the first idle one" ||
    fail "byte budget: $(models); $(grep -c unloaded "$tmpdir/b.log") unloads"
stop_server

# models.json: names, files and each one's options (a context of its own)
mkdir -p "$tmpdir/listed"
cat >"$tmpdir/listed/models.json" <<EOF
{"small": {"path": "$tmpdir/models/tiny.gguf", "context": 256},
 "moe": {"path": "$tmpdir/models/moe-tiny.gguf", "kv_type": "f32", "kv_blocks": 64}}
EOF
start_server "$tmpdir/l.log" -c 1024 --models-dir "$tmpdir/listed"
post /v1/completions '{"model": "small", "prompt": "Once", "max_tokens": 2}' >/dev/null
post /v1/completions '{"model": "moe", "prompt": "Once", "max_tokens": 2}' >/dev/null
ctxs=$(curl -s -H "Authorization: Bearer $KEY" "$URL/v1/models" | jq -c '[.data[1:][] | [.id, .max_model_len // null]]')
echo "$ctxs" | jq -e '.[0] == ["small", 256] and .[1][0] == "moe" and .[1][1] > 256' >/dev/null &&
    pass "models.json names the models and gives one its own context ($ctxs)" || fail "models.json: $ctxs"
stop_server
echo '{"small": {"path": "x.gguf", "ctx": 256}}' >"$tmpdir/listed/models.json"
"$LOOM" serve -m "$MODEL" --port 0 --models-dir "$tmpdir/listed" >"$tmpdir/bad.log" 2>&1 &&
    fail "an unknown models.json field accepted" ||
    expect_grep "models.json: small.ctx: unknown field" "$tmpdir/bad.log" "an unknown models.json field is named"

# flags a user gets wrong
refused() { # WHAT WANT ARGS...
    what=$1 want=$2; shift 2
    "$LOOM" serve -m "$MODEL" --port 0 "$@" >"$tmpdir/bad.log" 2>&1 && fail "$what: accepted" ||
        expect_grep "$want" "$tmpdir/bad.log" "$what is refused, naming it"
}
refused "--add-model without a name" "wants NAME=PATH" --add-model "$tmpdir/wide.gguf"
refused "two models of one name" "two models are named 'tiny'" --models-dir "$tmpdir/models" \
    --add-model "tiny=$tmpdir/wide.gguf"
mkdir -p "$tmpdir/empty"
refused "an empty --models-dir" "holds no model" --models-dir "$tmpdir/empty"
refused "a name the first model has" "names the first model already" --add-model "$first=$tmpdir/wide.gguf"
finish
