#!/bin/sh
# tests/webui.sh - the chat page `loom serve` has at GET /: served with a nonce-pinned
# Content-Security-Policy, off with --no-webui, and used in headless Chromium (Debian's chromium and
# chromium-driver) by tests/webui_browser.py: key, streamed greedy turns equal to the API's answers,
# Stop, a model's markup shown as text. The last screenshot is kept as tests/webui.png.
. "$top_srcdir/tests/lib.sh"
MODEL=$(suite_model tiny-chat)
command -v curl >/dev/null || { echo "SKIP: curl not installed"; exit 77; }
KEY=test-key
. "$top_srcdir/tests/serve_lib.sh"

# ---- off: the API alone
start_server "$tmpdir/off.log" -c 2048 --model-name m --no-webui
code=$(curl -s -o "$tmpdir/off.json" -w '%{http_code}' "$URL/")
[ "$code" = 404 ] && jq -e '.error.message | test("no such endpoint")' "$tmpdir/off.json" >/dev/null &&
    pass "--no-webui: GET / is a 404" || fail "--no-webui: GET / gave $code: $(cat "$tmpdir/off.json")"
stop_server

start_server "$tmpdir/s.log" -c 2048 --model-name m
grep -q 'a chat page at /' "$tmpdir/s.log" && pass "the server says where its chat page is" ||
    fail "no chat page in the log: $(cat "$tmpdir/s.log")"
curl -s -D "$tmpdir/h1" -o "$tmpdir/page1.html" "$URL/"
curl -s -D "$tmpdir/h2" -o "$tmpdir/page2.html" "$URL/"
nonce() { sed -n "s/^Content-Security-Policy: .*script-src 'nonce-\([0-9a-f]*\)'.*/\1/p" "$1"; }
n1=$(nonce "$tmpdir/h1") n2=$(nonce "$tmpdir/h2")
grep -q '^HTTP/1.1 200' "$tmpdir/h1" && grep -qi '^Content-Type: text/html' "$tmpdir/h1" &&
    pass "GET / is the page, without a key" || fail "GET /: $(cat "$tmpdir/h1")"
[ ${#n1} = 32 ] && [ "$n1" != "$n2" ] && [ "$(grep -c "nonce=\"$n1\"" "$tmpdir/page1.html")" = 2 ] &&
    ! grep -q '@NONCE@' "$tmpdir/page1.html" &&
    pass "each response has its own nonce, in the policy and on the page's script and style" ||
    fail "nonces: '$n1' '$n2': $(grep -c nonce "$tmpdir/page1.html")"
grep -q "^Content-Security-Policy: default-src 'none';.* connect-src 'self'" "$tmpdir/h1" &&
    ! grep -q 'src="http\|href="http' "$tmpdir/page1.html" &&
    pass "the policy forbids everything else; the page loads nothing from elsewhere" ||
    fail "policy: $(grep -i '^content-security' "$tmpdir/h1")"
[ "$(curl -s -o /dev/null -w '%{http_code}' -X POST "$URL/")" = 405 ] && pass "POST / is a 405" ||
    fail "POST / is not refused"

python3 "$top_srcdir/tests/webui_browser.py" "$URL" "$KEY" "$top_builddir/tests/webui.png"
rc=$?
[ $rc = 77 ] && { stop_server; [ $fails = 0 ] && exit 77; finish; }
[ $rc = 0 ] || fail "in the browser (server log: $(tail -n 5 "$tmpdir/s.log"))"
stop_server
finish
