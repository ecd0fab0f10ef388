#!/bin/sh
# tests/serve_prompt_cache.sh - `loom serve --prompt-cache-dir`: the prefix cache is saved when
# the server stops and read back when it starts, so a long prompt seen before a restart is
# answered from it (cached_tokens, cached_tokens_restored, /metrics) with the same answer as
# `loom run`; a damaged file, or one another model wrote, is not used (the log says why) and
# the answers stay right. On loom's synthetic chat model; the times are printed, not checked.
. "$top_srcdir/tests/lib.sh"
command -v curl >/dev/null || { echo "SKIP: curl not installed"; exit 77; }
command -v python3 >/dev/null || { echo "SKIP: python3 not installed"; exit 77; }
KEY=test-key
MODEL=$(suite_model tiny-chat)
OTHER=$(suite_model tiny)
. "$top_srcdir/tests/serve_lib.sh"
CACHE=$tmpdir/cache
mkdir -p "$CACHE"
prompt=$(python3 -c "print('Once upon a time there was a little girl who lived near the forest. ' * 12)")
want=$("$LOOM" run -m "$MODEL" -c 2048 -p "$prompt" -n 8 --temp 0 --json 2>/dev/null | jq -c .text)
ask() { # sets cached, restored, answer (JSON text) and took (seconds)
    took=$(post /v1/completions "{\"model\": \"m\", \"prompt\": \"$prompt\", \"max_tokens\": 8, \"temperature\": 0}" \
        -o "$tmpdir/a.json" -w '%{time_total}' | tail -n1)
    cached=$(jq '.usage.prompt_tokens_details.cached_tokens' "$tmpdir/a.json")
    restored=$(jq '.usage.prompt_tokens_details.cached_tokens_restored' "$tmpdir/a.json")
    answer=$(jq -c '.choices[0].text' "$tmpdir/a.json")
}
serve() { # LOG [ARGS]: a server keeping its cache in CACHE
    log=$1; shift
    start_server "$log" -c 2048 --model-name m --prompt-cache-dir "$CACHE" "$@"
}

serve "$tmpdir/s1.log"
ask
t_cold=$took
[ "$cached" = 0 ] && [ "$answer" = "$want" ] && pass "first run: nothing cached, loom run's answer $answer (${t_cold}s)" ||
    fail "first run: cached $cached, answer $answer (want $want)"
stop_server
expect_grep "blocks saved" "$tmpdir/s1.log" "the cache is saved at shutdown"

serve "$tmpdir/s2.log"
expect_grep "restored of" "$tmpdir/s2.log" "... and read back at start"
ask
t_warm=$took
n=$(jq '.usage.prompt_tokens' "$tmpdir/a.json")
[ "$cached" -ge $((n - 16)) ] && [ "$restored" = "$cached" ] && [ "$answer" = "$want" ] &&
    pass "after the restart: $cached of $n prompt tokens from the restored cache, the same answer (${t_warm}s, cold ${t_cold}s)" ||
    fail "after restart: cached $cached restored $restored of $n, answer $answer (want $want)"
m=$(metric loom_prefix_cache_restored_hit_tokens_total)
[ "$m" = "$restored" ] && pass "/metrics counts the restored hits ($m)" || fail "metrics: '$m' vs $restored"
stop_server

# a damaged record: not used, said so, answers still right
f=$CACHE/m.loomkv
size=$(wc -c <"$f")
printf 'X' | dd of="$f" bs=1 seek=$((size / 2)) conv=notrunc status=none
serve "$tmpdir/s3.log"
expect_grep "not used: damaged" "$tmpdir/s3.log" "a damaged file is not used, and the log says so"
ask
[ "$cached" = 0 ] && [ "$answer" = "$want" ] && pass "... and the prompt is computed anew: the same answer" ||
    fail "damaged: cached $cached, answer $answer"
stop_server

# the file another model wrote (the same name, another file): not used
start_server "$tmpdir/s4.log" -m "$OTHER" -c 2048 --model-name m --prompt-cache-dir "$CACHE"
expect_grep "not used: written for another model" "$tmpdir/s4.log" "a cache of another model file is not used"
stop_server
finish
