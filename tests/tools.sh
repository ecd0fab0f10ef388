# tests/tools.sh - tool calling in /v1/chat/completions: a conversation in OpenAI's form (tools,
# an assistant's tool_calls with arguments as JSON text, tool results) reaches the template as
# transformers' templates expect it (arguments as objects): the prompt is exactly the tokens of
# python3-jinja2's rendering of the same conversation (tests/jinja_ref.py); tool_choice "none"
# hides the tools; every malformed tool, call or choice is a 400 naming it; a template that
# shows no tools refuses them. Reading calls back from answers: tests/test_tool_calls.c.
. "$top_srcdir/tests/lib.sh"
command -v curl >/dev/null || { echo "SKIP: curl not installed"; exit 77; }
command -v python3 >/dev/null && python3 -c 'import jinja2' 2>/dev/null || {
    [ "${CI:-}" = true ] && { echo "FAIL: python3-jinja2 is missing (CI=true)" >&2; exit 1; }
    echo "SKIP: python3-jinja2 not installed (scripts/install-deps installs it)"; exit 77; }
REF="python3 $top_srcdir/tests/jinja_ref.py"
CONV=$top_srcdir/tests/templates/conversations
TEMPLATE=$top_srcdir/tests/templates/toolchat.jinja
MODEL=$(suite_model tiny-chat) KEY=test-key
. "$top_srcdir/tests/serve_lib.sh"

# the conversation as an OpenAI client sends it: each call's arguments as JSON text
jq '[.[] | if .tool_calls then .tool_calls |= map(.function.arguments |= tojson) else . end]' \
    "$CONV/tool_calls.json" >"$tmpdir/openai.json"
TOOLS=$(cat "$CONV/tools.json")
chat() { # MORE-JSON-MEMBERS [MESSAGES]: the response body, then the status on its own line
    post /v1/chat/completions "{\"model\": \"synthetic-tiny-chat-f32\", \"messages\": ${2:-$(cat "$tmpdir/openai.json")},
        \"max_tokens\": 8, \"temperature\": 0${1:+, $1}}"
}
tokens_or_error() { # MORE-JSON-MEMBERS [MESSAGES]
    chat "$@" >"$tmpdir/c.out"
    [ "$(tail -n1 "$tmpdir/c.out")" = 200 ] && sed '$d' "$tmpdir/c.out" | jq .usage.prompt_tokens ||
        sed '$d' "$tmpdir/c.out" | jq -r '"\(.error.param): \(.error.message)"'
}
ref_tokens() { # REF-FLAGS...: the reference rendering of tool_calls.json, in tokens
    $REF "$TEMPLATE" "$CONV/tool_calls.json" "$@" >"$tmpdir/r.txt" &&
        "$LOOM" tokenize -m "$MODEL" --all-special --json -f "$tmpdir/r.txt" 2>/dev/null | jq length
}

start_server "$tmpdir/s.log" -c 4096 --chat-template-file "$TEMPLATE"
expect_grep "tool calls: hermes" "$tmpdir/s.log" "serve says how it reads the template's tool calls"
got=$(tokens_or_error "\"tools\": $TOOLS") want=$(ref_tokens --tools "$CONV/tools.json")
[ -n "$want" ] && [ "$got" = "$want" ] &&
    pass "tools, calls and results reach the template as the reference renders them ($want tokens)" ||
    fail "a conversation with tools: $got prompt tokens, the reference's rendering $want"
got=$(tokens_or_error "\"tools\": $TOOLS, \"tool_choice\": \"none\"") want=$(ref_tokens)
[ -n "$want" ] && [ "$got" = "$want" ] &&
    pass "tool_choice none: the model is not shown the tools ($want tokens, as without them)" ||
    fail "tool_choice none: $got prompt tokens, without tools $want"
got=$(tokens_or_error "\"tools\": $TOOLS, \"tool_choice\": \"auto\", \"parallel_tool_calls\": false")
[ "$got" = "$(ref_tokens --tools "$CONV/tools.json")" ] && pass "tool_choice auto is the default" ||
    fail "tool_choice auto: $got"

# an answer without calls is text, in one piece or streamed; the stream's text is the same
chat "\"tools\": $TOOLS" >"$tmpdir/a.out"
sed '$d' "$tmpdir/a.out" >"$tmpdir/a.json"
jq -e '.choices[0].message.role == "assistant" and (.choices[0].message.content | type) == "string"
    and (.choices[0].message | has("tool_calls") | not) and .choices[0].finish_reason != "tool_calls"' \
    "$tmpdir/a.json" >/dev/null && pass "an answer without a call is the message's content" ||
    fail "answer with tools: $(head -c 400 "$tmpdir/a.out")"
chat "\"tools\": $TOOLS, \"stream\": true" >"$tmpdir/st.out"
sed -n 's/^data: //p' "$tmpdir/st.out" | grep -v '^\[DONE\]$' >"$tmpdir/st.jsonl"
streamed=$(jq -rj '.choices[0].delta.content // empty' "$tmpdir/st.jsonl")
[ "$streamed" = "$(jq -rj '.choices[0].message.content' "$tmpdir/a.json")" ] &&
    grep -q '^data: \[DONE\]' "$tmpdir/st.out" &&
    pass "streamed with tools, the text is the same ($(wc -l <"$tmpdir/st.jsonl") events)" ||
    fail "stream with tools: '$streamed' vs '$(jq -r '.choices[0].message.content' "$tmpdir/a.json")'"

bad() { # WHAT MORE-JSON-MEMBERS MESSAGES EXPECTED-PARAM EXPECTED-TEXT
    got=$(tokens_or_error "$2" "$3")
    case "$got" in "$4: "*"$5"*) pass "$1: 400 '$got'";; *) fail "$1: $got";; esac
}
USER='[{"role": "user", "content": "hi"}]'
bad "a named tool_choice not in tools" "\"tools\": $TOOLS, \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"nope\"}}" "$USER" tool_choice "'nope', which is not in 'tools'"
bad "tool_choice without tools" '"tool_choice": "auto"' "$USER" tool_choice "only allowed when 'tools'"
bad "a tool without a name" '"tools": [{"type": "function", "function": {"description": "x"}}]' "$USER" tools "tools[0].function.name"
bad "a name with a space" '"tools": [{"type": "function", "function": {"name": "get weather"}}]' "$USER" tools "tools[0].function.name"
bad "a tool of another type" '"tools": [{"type": "retrieval"}]' "$USER" tools "tools[0].type"
bad "parameters that are no schema" '"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]' "$USER" tools "tools[0].function.parameters"
bad "two functions of one name" '"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]' "$USER" tools "second function named 'f'"
bad "a tool message without its call's id" "" '[{"role": "user", "content": "hi"}, {"role": "tool", "content": "18"}]' messages "messages[1]: a tool message needs 'tool_call_id'"
bad "arguments that are no JSON object" "" '[{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{city: Paris"}}]}]' messages "messages[1].tool_calls[0].function.arguments must be a JSON object"
bad "tool_calls on a user message" "" '[{"role": "user", "content": "hi", "tool_calls": []}]' messages "only an assistant message has tool_calls"
bad "the deprecated functions field" '"functions": [{"name": "f"}]' "$USER" functions "send 'tools'"
stop_server

# the fixture's own template shows no tools: a request with tools is refused, not half-run
start_server "$tmpdir/s2.log" -c 512
expect_grep "tool calls: none" "$tmpdir/s2.log" "serve says the model's template shows no tools"
bad "tools with a template that shows none" "\"tools\": $TOOLS" "$USER" tools "does not show tools to the model"
stop_server
start_server "$tmpdir/s3.log" -c 512 --chat-template chatml
bad "tools with a built-in format" "\"tools\": $TOOLS" "$USER" tools "does not show tools to the model"
bad "tool results with a built-in format" "" "$(cat "$tmpdir/openai.json")" messages "need a Jinja chat template"
stop_server
finish
