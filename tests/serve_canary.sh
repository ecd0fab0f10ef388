#!/bin/sh
# tests/serve_canary.sh - a new version of a served model beside its current one (POST
# /admin/models/canary): it takes its share of the requests (within 5% over 1,000, by their
# seeds), a seed goes the same way each time, each answer says its version
# (X-Loom-Model-Version) and is that version's file's answer, /metrics counts each version;
# promoted it is the model, rolled back it is gone, and one that fails more than
# --canary-max-failures of its requests is rolled back by itself. On loom's synthetic models.
. "$top_srcdir/tests/lib.sh"
command -v curl >/dev/null || { echo "SKIP: curl not installed"; exit 77; }
command -v python3 >/dev/null || { echo "SKIP: python3 not installed"; exit 77; }
KEY=test-key
MODEL=$(suite_model tiny-chat)
NEW=$(suite_model moe-tiny)
"$LOOM" bench --synthetic wide --type q8_0 --write "$tmpdir/wide.gguf" >/dev/null 2>&1 ||
    fail "writing the synthetic wide model"
. "$top_srcdir/tests/serve_lib.sh"

# no -c: each model its own context (the wide one's is 256, the chat model's 512)
start_server "$tmpdir/s.log" --model-name m
admin() { # PATH JSON: the body, then the status
    post "/admin/models/$1" "$2"
}
[ "$(admin canary "{\"model\": \"m\", \"path\": \"$NEW\", \"share\": 0.3}" | tail -n1)" = 200 ] &&
    pass "a canary of m starts, taking 30%" || fail "canary: $(admin canary '{}')"

# the split over 1,000 seeds, and each answer its version's file's
python3 - "$URL" "$KEY" >"$tmpdir/split.txt" <<'PY'
import http.client, json, sys, urllib.parse
u = urllib.parse.urlparse(sys.argv[1]); c = http.client.HTTPConnection(u.hostname, u.port)
counts = {"stable": 0, "canary": 0}; text = {}; again = []
for seed in range(1, 1001):
    c.request("POST", "/v1/completions", json.dumps({"model": "m", "prompt": "Once upon a time",
              "max_tokens": 4, "temperature": 0, "seed": seed}),
              {"Authorization": "Bearer " + sys.argv[2], "Content-Type": "application/json"})
    r = c.getresponse(); body = json.loads(r.read()); v = r.getheader("X-Loom-Model-Version")
    assert r.status == 200, body
    counts[v] += 1; text.setdefault(v, body["choices"][0]["text"])
    if seed <= 20:
        again.append(v)
for seed in range(1, 21):  # the same seeds again: the same versions
    c.request("POST", "/v1/completions", json.dumps({"model": "m", "prompt": "x", "max_tokens": 1,
              "seed": seed}), {"Authorization": "Bearer " + sys.argv[2]})
    r = c.getresponse(); r.read()
    again[seed - 1] = again[seed - 1] == r.getheader("X-Loom-Model-Version")
print(counts["canary"], all(again))
print(json.dumps(text["stable"], ensure_ascii=False))
print(json.dumps(text["canary"], ensure_ascii=False))
PY
read -r n_canary same <"$tmpdir/split.txt" || true
stable_text=$(sed -n 2p "$tmpdir/split.txt" | jq -c .) canary_text=$(sed -n 3p "$tmpdir/split.txt" | jq -c .)
[ -n "$n_canary" ] && [ "$n_canary" -ge 250 ] && [ "$n_canary" -le 350 ] &&
    pass "the canary took $n_canary of 1,000 requests (share 0.3, within 5%)" ||
    fail "split: $(cat "$tmpdir/split.txt")"
[ "$same" = True ] && pass "a seed goes to the same version each time" || fail "seeds moved: $same"
want_stable=$("$LOOM" run -m "$MODEL" -p "Once upon a time" -n 4 --temp 0 --json 2>/dev/null | jq -c .text)
want_canary=$("$LOOM" run -m "$NEW" -p "Once upon a time" -n 4 --temp 0 --json 2>/dev/null | jq -c .text)
[ "$stable_text" = "$want_stable" ] && [ "$canary_text" = "$want_canary" ] &&
    pass "each version answers as loom run on its file ($stable_text, $canary_text)" ||
    fail "answers: stable $stable_text (want $want_stable), canary $canary_text (want $want_canary)"
# /metrics: each version's requests (the 1,000 and the 20 again: 1,020 in all)
curl -s "$URL/metrics" -H "Authorization: Bearer $KEY" >"$tmpdir/metrics.txt"
mc=$(awk '$1 == "loom_model_version_requests_total{model=\"m\",version=\"canary\"}" { print $2 }' "$tmpdir/metrics.txt")
ms=$(awk '$1 == "loom_model_version_requests_total{model=\"m\",version=\"stable\"}" { print $2 }' "$tmpdir/metrics.txt")
[ -n "$mc" ] && [ -n "$ms" ] && [ $((mc + ms)) = 1020 ] && [ "$mc" -ge "$n_canary" ] &&
    pass "/metrics counts each version's requests (canary $mc, stable $ms)" ||
    fail "metrics: canary '$mc', stable '$ms'"
gc=$(awk '$1 == "loom_model_version_generated_tokens_total{model=\"m\",version=\"canary\"}" { print $2 }' "$tmpdir/metrics.txt")
tc=$(awk '$1 == "loom_model_version_time_to_first_token_seconds_count{model=\"m\",version=\"canary\"}" { print $2 }' "$tmpdir/metrics.txt")
[ -n "$gc" ] && [ "$gc" -ge $((4 * n_canary)) ] && [ "$tc" = "$mc" ] &&
    pass "... and its tokens ($gc) and times to the first token ($tc requests)" ||
    fail "version speed metrics: tokens '$gc', ttft count '$tc' (requests $mc)"

# promoted: the canary is the model (every request its file's answer, version stable)
[ "$(admin promote '{"model": "m"}' | tail -n1)" = 200 ] && pass "promote" || fail "promote"
post /v1/completions '{"model": "m", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "seed": 5}' \
    -D "$tmpdir/h" | sed '$d' | jq -c '.choices[0].text' >"$tmpdir/p.txt"
[ "$(cat "$tmpdir/p.txt")" = "$want_canary" ] && grep -qi '^X-Loom-Model-Version: stable' "$tmpdir/h" &&
    pass "after promote the new file is the stable model" || fail "after promote: $(cat "$tmpdir/p.txt") $(cat "$tmpdir/h")"

# rolled back: gone
admin canary "{\"model\": \"m\", \"path\": \"$MODEL\", \"share\": 1}" >/dev/null
[ "$(admin rollback '{"model": "m"}' | sed '$d' | jq -c .canaries)" = "[]" ] &&
    [ "$(post /v1/completions '{"model": "m", "prompt": "x", "max_tokens": 1}' -D "$tmpdir/h2" | tail -n1)" = 200 ] &&
    grep -qi '^X-Loom-Model-Version: stable' "$tmpdir/h2" && pass "rolled back, every request goes to the model" ||
    fail "rollback: $(cat "$tmpdir/h2")"

# a canary that refuses what the model takes (a 256-token context, prompts of 300) fails: past
# --canary-max-failures (0.05) of 20 requests it is rolled back by itself
admin canary "{\"model\": \"m\", \"path\": \"$tmpdir/wide.gguf\", \"share\": 0.5}" >/dev/null
long=$(python3 -c 'print(list(range(3, 303)))' | tr -d ' ')
codes=
for seed in $(seq 1 80); do
    codes="$codes $(post /v1/completions "{\"model\": \"m\", \"prompt\": $long, \"max_tokens\": 4, \"seed\": $seed}" | tail -n1)"
done
later=$(echo "$codes" | tr ' ' '\n' | tail -n 20 | sort -u | tr '\n' ' ')
grep -q "rolled back" "$tmpdir/s.log" && [ "$later" = "200 " ] &&
    [ "$(admin rollback '{"model": "m"}' | tail -n1)" = 404 ] &&
    pass "a failing canary is rolled back by itself; the last 20 requests all 200" ||
    fail "automatic rollback: codes$codes; log: $(grep canary "$tmpdir/s.log")"

# what an admin gets wrong
[ "$(admin canary '{"model": "nope", "path": "x", "share": 0.1}' | tail -n1)" = 404 ] &&
    [ "$(admin canary '{"model": "m", "path": "/nonexistent.gguf", "share": 0.1}' | tail -n1)" = 422 ] &&
    [ "$(admin canary '{"model": "m", "path": "x"}' | tail -n1)" = 400 ] &&
    [ "$(admin canary '{"model": "m", "path": "x", "share": 2}' | tail -n1)" = 400 ] &&
    pass "an unknown model 404, a file that does not load 422, a share missing or past 1 400" ||
    fail "admin mistakes"
stop_server
finish
