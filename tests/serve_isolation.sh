#!/bin/sh
# tests/serve_isolation.sh - what one client of `loom serve` can do to another, and a web page
# to the server, on loopback: only an admin key reloads the model, and reloads do not pile up
# retired models behind a held request; tenants share no prefix cache; a key's priority is the
# best its requests get; a tenant refused by its own share displaces nobody, and a displaced
# request counts against its own key; requests held by --batch-wait-ms show as waiting;
# per-tenant metrics are for admin keys; a foreign Origin, a cross-site fetch and (on a
# loopback bind) a foreign Host are refused before anything runs; a hybrid model's prefix
# snapshots are a tenant's own. It needs a model, not a reference: loom's own synthetic ones
# (written here), so it runs without the shared fixtures.
. "$top_srcdir/tests/lib.sh"
command -v curl >/dev/null || { echo "SKIP: curl not installed (scripts/install-deps installs it)"; exit 77; }
command -v jq >/dev/null || { echo "SKIP: jq not installed (scripts/install-deps installs it)"; exit 77; }
KEY=
. "$top_srcdir/tests/serve_lib.sh"
MODEL=$tmpdir/tiny.gguf
"$LOOM" bench --synthetic tiny --type q8_0 --write "$MODEL" >"$tmpdir/write.log" 2>&1 ||
    { fail "writing the synthetic model: $(cat "$tmpdir/write.log")"; finish; }
as() { who=$1; shift; KEY=$who-key post "$@"; }
status_of() { tail -n1 "$1"; }
admin_metric() {
    curl -s -H "Authorization: Bearer ops-key" "$URL/metrics" | awk -v m="$1" '$1 == m { print $2 }'
}
wait_for_waiting() { # N: until the server says N requests wait (5 s at most)
    for _ in $(seq 250); do [ "$(metric loom_requests_waiting)" = "$1" ] && return 0; sleep 0.02; done
    return 1
}

printf 'alice alice-key priority=10\nbob bob-key max-queue=1\ncarol carol-key\nops ops-key admin\n' \
    >"$tmpdir/keys"

# ---- tenants and the queue. --batch-wait-ms holds the requests in the queue (nothing runs
# while fewer than --max-batch are there), which makes their order here exact
start_server "$tmpdir/queue.log" -c 512 --max-batch 4 --max-queue 2 --batch-wait-ms 4000 \
    --api-keys "$tmpdir/keys"
NAME=$(curl -s -H "Authorization: Bearer alice-key" "$URL/v1/models" | jq -r '.data[0].id')
req() { echo "{\"model\":\"$NAME\",\"prompt\":\"Once upon a time\",\"max_tokens\":4$1}"; }
# alice's key says priority 10: asking for -100 gets her 10 (a key's priority is a floor)
as alice /v1/completions "$(req ',"priority":-100')" >"$tmpdir/alice.out" & a=$!
wait_for_waiting 1 && [ "$(metric loom_requests_waiting)" = 1 ] &&
    pass "a request held by --batch-wait-ms shows in loom_requests_waiting" ||
    fail "loom_requests_waiting during the batch wait: $(metric loom_requests_waiting)"
curl -s -H "Authorization: Bearer ops-key" "$URL/metrics" >"$tmpdir/m1"
grep -q '^loom_requests_waiting_by_priority{priority="10"} 1$' "$tmpdir/m1" &&
    pass "a key with priority=10 asking for -100 waits at 10" ||
    fail "priority floor: $(grep waiting_by_priority "$tmpdir/m1" | grep -v '^#')"
as bob /v1/completions "$(req '')" >"$tmpdir/bob.out" & b=$!
wait_for_waiting 2
# the queue is full (2); bob's second request is better than alice's, but bob's own share
# (max-queue=1) is full: refused as "yours", and alice keeps her place
as bob /v1/completions "$(req '')" >"$tmpdir/bob2.out"
[ "$(status_of "$tmpdir/bob2.out")" = 429 ] &&
    sed '$d' "$tmpdir/bob2.out" | jq -e '.error.message | test("yours")' >/dev/null &&
    [ "$(metric loom_requests_waiting)" = 2 ] && [ "$(metric loom_requests_displaced_total)" = 0 ] &&
    pass "a request its tenant's share refuses displaces nobody" ||
    fail "share before displacement: $(cat "$tmpdir/bob2.out"); waiting $(metric loom_requests_waiting), displaced $(metric loom_requests_displaced_total)"
# carol's request (priority 0) takes the place of the worst waiting one: alice's
as carol /v1/completions "$(req '')" >"$tmpdir/carol.out" & c=$!
wait "$a" "$b" "$c"
[ "$(status_of "$tmpdir/alice.out")" = 429 ] && [ "$(status_of "$tmpdir/bob.out")" = 200 ] &&
    [ "$(status_of "$tmpdir/carol.out")" = 200 ] &&
    pass "a full queue gives the better request the worst one's place (alice's, at her key's 10)" ||
    fail "displacement: alice $(status_of "$tmpdir/alice.out"), bob $(status_of "$tmpdir/bob.out"), carol $(status_of "$tmpdir/carol.out")"
[ "$(admin_metric 'loom_key_refused_busy_total{key="alice"}')" = 1 ] &&
    [ "$(admin_metric 'loom_key_refused_busy_total{key="bob"}')" = 1 ] &&
    [ "$(admin_metric 'loom_key_refused_busy_total{key="carol"}')" = 0 ] &&
    pass "each 429 counts against its own key, the displaced one's too" ||
    fail "per-key 429s: $(curl -s -H 'Authorization: Bearer ops-key' "$URL/metrics" | grep '^loom_key_refused')"
# per-tenant series are for admin keys
curl -s "$URL/metrics" >"$tmpdir/m_anon"
curl -s -H "Authorization: Bearer alice-key" "$URL/metrics" >"$tmpdir/m_alice"
! grep -q 'key="' "$tmpdir/m_anon" && ! grep -q 'key="' "$tmpdir/m_alice" &&
    grep -q '^loom_requests_finished_total ' "$tmpdir/m_anon" &&
    [ "$(admin_metric 'loom_key_requests_total{key="carol"}')" = 1 ] &&
    pass "/metrics names tenants only to an admin key" ||
    fail "per-tenant metrics shown to: $(grep -l 'key="' "$tmpdir/m_anon" "$tmpdir/m_alice")"
stop_server

# ---- reload: admin keys only; not while the model before the last reload still finishes a
# request (held here in the new engine's batch wait)
start_server "$tmpdir/reload.log" -c 512 --max-batch 4 --batch-wait-ms 3000 --api-keys "$tmpdir/keys"
as alice /admin/reload "" -X POST >"$tmpdir/r_tenant.out"
[ "$(status_of "$tmpdir/r_tenant.out")" = 403 ] &&
    sed '$d' "$tmpdir/r_tenant.out" | jq -e '.error.message | test("admin key")' >/dev/null &&
    pass "a tenant's key cannot reload the model (403)" || fail "tenant reload: $(cat "$tmpdir/r_tenant.out")"
as alice /v1/completions "$(req '')" >"$tmpdir/held.out" & h=$!
wait_for_waiting 1
as ops /admin/reload "" -X POST >"$tmpdir/r1.out"
as ops /admin/reload "" -X POST >"$tmpdir/r2.out"
[ "$(status_of "$tmpdir/r1.out")" = 200 ] && [ "$(status_of "$tmpdir/r2.out")" = 409 ] &&
    sed '$d' "$tmpdir/r2.out" | jq -e '.error.message | test("still finishes 1 request")' >/dev/null &&
    pass "an admin key reloads; a second reload while the old model holds a request is a 409" ||
    fail "reload while held: $(cat "$tmpdir/r1.out") / $(cat "$tmpdir/r2.out")"
wait "$h"
as ops /admin/reload "" -X POST >"$tmpdir/r3.out"
[ "$(status_of "$tmpdir/held.out")" = 200 ] && [ "$(status_of "$tmpdir/r3.out")" = 200 ] &&
    [ "$(curl -s -H 'Authorization: Bearer ops-key' "$URL/health" | jq .reloads)" = 2 ] &&
    pass "the held request finished on the old model; then a reload goes through" ||
    fail "after the held request: $(status_of "$tmpdir/held.out") / $(cat "$tmpdir/r3.out")"
stop_server

# ---- the prefix cache: tenants never share one, even with the same "user"
start_server "$tmpdir/cache.log" -c 512 --prefix-cache per-user --api-keys "$tmpdir/keys"
long=$(for _ in $(seq 5); do printf 'Lily and Tom played in the park with a big red ball. '; done)
cached() { # WHO USER
    as "$1" /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"$long\",\"max_tokens\":1,\"user\":\"$2\"}" |
        sed '$d' | jq '.usage.prompt_tokens_details.cached_tokens'
}
a1=$(cached alice victim); b1=$(cached carol victim); a2=$(cached alice victim)
[ "$a1" = 0 ] && [ "$b1" = 0 ] && [ "$a2" -gt 0 ] &&
    pass "per-user cache: another tenant sending the same user gets no hit ($b1; the owner $a2)" ||
    fail "cache across tenants: alice $a1 then $a2, carol as the same user $b1"
stop_server
start_server "$tmpdir/shared.log" -c 512 --api-keys "$tmpdir/keys"
shared() { as "$1" /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"$long\",\"max_tokens\":1}" |
    sed '$d' | jq '.usage.prompt_tokens_details.cached_tokens'; }
a1=$(shared alice); b1=$(shared carol); a2=$(shared alice)
[ "$a1" = 0 ] && [ "$b1" = 0 ] && [ "$a2" -gt 0 ] &&
    pass "shared cache: each tenant's own (carol $b1 on alice's prompt; alice $a2)" ||
    fail "shared cache across tenants: alice $a1 then $a2, carol $b1"
stop_server

# ---- web pages: a keyless loopback server refuses what a browser would send for a foreign page
start_server "$tmpdir/web.log" -c 512 --allow-host proxy.internal
body="{\"model\":\"$NAME\",\"prompt\":\"Once\",\"max_tokens\":2}"
code() { curl -s -o "$tmpdir/web.out" -w '%{http_code}' "$@"; }
[ "$(code -H 'Origin: http://evil.example' -H 'Content-Type: text/plain' --data-binary "$body" "$URL/v1/completions")" = 403 ] &&
    jq -e '.error.code == "cross_origin_request"' "$tmpdir/web.out" >/dev/null &&
    [ "$(code -H 'Origin: http://evil.example' -X POST "$URL/admin/reload")" = 403 ] &&
    [ "$(code -H 'Origin: null' --data-binary "$body" "$URL/v1/completions")" = 403 ] &&
    [ "$(code -H 'Sec-Fetch-Site: cross-site' --data-binary "$body" "$URL/v1/completions")" = 403 ] &&
    pass "a foreign Origin (a form post, a reload, 'null') and a cross-site fetch are refused (403)" ||
    fail "foreign origin: $(cat "$tmpdir/web.out")"
[ "$(code -H 'Sec-Fetch-Site: cross-site' "$URL/")" = 200 ] &&
    pass "a link from another site still opens the chat page (a GET changes nothing)" ||
    fail "cross-site GET of the chat page: $(head -c 200 "$tmpdir/web.out")"
[ "$(code -H "Origin: http://127.0.0.1:$port" -H 'Sec-Fetch-Site: same-origin' --data-binary "$body" "$URL/v1/completions")" = 200 ] &&
    pass "the server's own origin (its chat page) is served" || fail "same origin: $(cat "$tmpdir/web.out")"
[ "$(code -H 'Host: attacker.example' "$URL/v1/models")" = 421 ] &&
    [ "$(code -H 'Host: attacker.example:'"$port" "$URL/health")" = 421 ] &&
    jq -e '.error.message | test("allow-host")' "$tmpdir/web.out" >/dev/null &&
    [ "$(code -H "Host: localhost:$port" "$URL/v1/models")" = 200 ] &&
    [ "$(code -H "Host: [::1]:$port" "$URL/v1/models")" = 200 ] &&
    [ "$(code -H "Host: proxy.internal" "$URL/v1/models")" = 200 ] &&
    pass "on loopback, a Host that is not a loopback name (DNS rebinding) is a 421; localhost, [::1] and --allow-host's are served" ||
    fail "Host check: $(cat "$tmpdir/web.out")"
stop_server
printf 'ops-key\n' >"$tmpdir/admin"
KEY=api-key
start_server "$tmpdir/admin.log" -c 512 --admin-key-file "$tmpdir/admin"
[ "$(as api /admin/reload '' -X POST | tail -n1)" = 403 ] &&
    [ "$(as ops /admin/reload '' -X POST | tail -n1)" = 200 ] &&
    [ "$(as ops /v1/models '' -X GET | tail -n1)" = 200 ] &&
    pass "with --admin-key-file the API key cannot reload, the admin key can" ||
    fail "--admin-key-file: $(as api /admin/reload '' -X POST)"
stop_server
KEY=
"$LOOM" serve -m "$MODEL" --api-keys "$tmpdir/keys" --admin-key-file "$tmpdir/admin" \
    >"$tmpdir/same.log" 2>&1
expect_grep "admin key (--admin-key-file) must differ" "$tmpdir/same.log" \
    "an admin key that is also an API key is refused"

# ---- a hybrid model (Qwen3.5's recurrent layers): a prefix is reused only from a snapshot of the
# state, which is as private to a tenant as the blocks it ends
MODEL=$tmpdir/hybrid.gguf
"$LOOM" bench --synthetic hybrid-tiny --type q8_0 --write "$MODEL" >"$tmpdir/write2.log" 2>&1 ||
    { fail "writing the synthetic hybrid: $(cat "$tmpdir/write2.log")"; finish; }
start_server "$tmpdir/hybrid.log" -c 512 --api-keys "$tmpdir/keys"
NAME=$(curl -s -H "Authorization: Bearer alice-key" "$URL/v1/models" | jq -r '.data[0].id')
expect_grep "recurrent layers: .* of state per running sequence" "$tmpdir/hybrid.log" \
    "the hybrid model's state per sequence is in the start line"
[ "$(admin_metric loom_recurrent_state_bytes_per_sequence)" -gt 0 ] &&
    pass "/metrics says what a sequence's state costs" ||
    fail "loom_recurrent_state_bytes_per_sequence: $(admin_metric loom_recurrent_state_bytes_per_sequence)"
answer() { as "$1" /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"$long\",\"max_tokens\":8,\"temperature\":0}" |
    sed '$d' | jq -c '[.usage.prompt_tokens_details.cached_tokens, .choices[0].text]'; }
a1=$(answer alice); b1=$(answer carol); a2=$(answer alice)
[ "$(echo "$a1" | jq '.[0]')" = 0 ] && [ "$(echo "$b1" | jq '.[0]')" = 0 ] &&
    [ "$(echo "$a2" | jq '.[0]')" -gt 0 ] && [ "$(echo "$a2" | jq '.[1]')" = "$(echo "$a1" | jq '.[1]')" ] &&
    pass "hybrid: alice resumes from her state snapshot with the same answer ($a2), carol does not ($b1)" ||
    fail "hybrid prefix snapshots across tenants: alice $a1 then $a2, carol $b1"
stop_server
finish
