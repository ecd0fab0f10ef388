# tests/structured.sh - constrained decoding through loom serve, on a random model (whose own
# answers are never JSON) at temperature 1: every answer to response_format json_schema
# validates against its schema by Debian's python3-jsonschema (formats checked), streamed or
# not, while the same requests without it do not; json_object answers are objects; a GBNF
# grammar bounds a completion; tool_choice "required" and a named function give calls whose
# arguments validate against the function's parameters, in one piece and as stream deltas;
# what loom cannot follow is a 400 naming it.
. "$top_srcdir/tests/lib.sh"
command -v curl >/dev/null || { echo "SKIP: curl not installed"; exit 77; }
command -v python3 >/dev/null && python3 -c 'import jsonschema' 2>/dev/null || {
    [ "${CI:-}" = true ] && { echo "FAIL: python3-jsonschema is missing (CI=true)" >&2; exit 1; }
    echo "SKIP: python3-jsonschema not installed (scripts/install-deps installs it)"; exit 77; }
# what is tested here is the server's and the grammar's, not a CPU variant's arithmetic: the
# suite's reruns under LOOM_CPU_MASK and LOOM_REF_OPAQUE skip it (CI's time)
if [ -n "${LOOM_CPU_MASK:-}${LOOM_REF_OPAQUE:-}" ]; then
    echo "SKIP: run once, not again under LOOM_CPU_MASK / LOOM_REF_OPAQUE"; exit 77; fi
MODEL=$(suite_model tiny-chat) KEY=test-key
. "$top_srcdir/tests/serve_lib.sh"
SCHEMAS=$top_srcdir/tests/structured_schemas/schemas.json

# validate SCHEMA-JSON FILE-OF-JSON-TEXTS (one per line): "ok N", or what failed
validate() {
    python3 - "$1" "$2" <<'PY'
import json, sys, jsonschema
schema = json.loads(sys.argv[1])
v = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
n = 0
for line in open(sys.argv[2]):
    n += 1
    try:
        doc = json.loads(json.loads(line))
    except Exception as e:
        print(f"answer {n} is no JSON ({e}): {line.strip()[:200]}"); sys.exit(1)
    errs = list(v.iter_errors(doc))
    if errs:
        print(f"answer {n} does not validate: {errs[0].message}: {json.dumps(doc)[:200]}"); sys.exit(1)
print(f"ok {n}")
PY
}
ask() { # BODY-MEMBERS: a chat request's response body (status on the last line)
    post /v1/chat/completions "{\"model\": \"synthetic-tiny-chat-f32\", \"messages\": [{\"role\": \"user\",
        \"content\": \"Answer in JSON.\"}], \"temperature\": 1, \"max_tokens\": 1200, $1}"
}

start_server "$tmpdir/s.log" -c 2048 --chat-template-file "$top_srcdir/tests/templates/toolchat.jinja"
n_schemas=$(jq length "$SCHEMAS")
for i in $(seq 0 $((n_schemas - 1))); do
    name=$(jq -r ".[$i].name" "$SCHEMAS") schema=$(jq -c ".[$i].schema" "$SCHEMAS")
    ask "\"n\": 2, \"seed\": $i, \"response_format\": {\"type\": \"json_schema\",
        \"json_schema\": {\"name\": \"$name\", \"strict\": true, \"schema\": $schema}}" >"$tmpdir/r.out"
    sed '$d' "$tmpdir/r.out" >"$tmpdir/r.json"
    jq -c '.choices[].message.content' "$tmpdir/r.json" >"$tmpdir/answers" 2>/dev/null
    finishes=$(jq -r '[.choices[].finish_reason] | unique | join(",")' "$tmpdir/r.json" 2>/dev/null)
    got=$(validate "$schema" "$tmpdir/answers")
    [ "$got" = "ok 2" ] && [ "$finishes" = stop ] &&
        pass "json_schema '$name': 2 answers at temperature 1, each validates" ||
        fail "json_schema '$name' ($finishes): $got $(head -c 300 "$tmpdir/r.out")"
    # streamed: the content deltas make a document that validates too
    ask "\"stream\": true, \"seed\": $((i + 100)), \"response_format\": {\"type\": \"json_schema\",
        \"json_schema\": {\"name\": \"$name\", \"schema\": $schema}}" >"$tmpdir/st.out"
    sed -n 's/^data: //p' "$tmpdir/st.out" | grep -v '^\[DONE\]$' |
        jq -rj '.choices[0].delta.content // empty' | jq -Rs . >"$tmpdir/answers"
    got=$(validate "$schema" "$tmpdir/answers")
    [ "$got" = "ok 1" ] && pass "json_schema '$name' streamed: the deltas validate" ||
        fail "json_schema '$name' streamed: $got"
done
# the same requests without response_format: the random model's answers are no such JSON
schema=$(jq -c ".[0].schema" "$SCHEMAS")
ask '"n": 4, "seed": 0' | sed '$d' | jq -c '.choices[].message.content' >"$tmpdir/answers"
got=$(validate "$schema" "$tmpdir/answers")
case "$got" in ok*) fail "unconstrained answers validated: the test would not see constraints off";;
    *) pass "without response_format the answers do not validate ($(echo "$got" | cut -c1-60)...)";; esac

ask '"n": 3, "seed": 7, "max_tokens": 60, "response_format": {"type": "json_object"}' | sed '$d' >"$tmpdir/o.json"
python3 - "$tmpdir/o.json" <<'PY' && pass "json_object: every answer is (the start of) a JSON object" || fail "json_object: $(head -c 300 "$tmpdir/o.json")"
import json, sys
r = json.load(open(sys.argv[1]))
for c in r["choices"]:
    text = c["message"]["content"]
    assert text.lstrip().startswith("{"), text
    if c["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict), text
PY

# a GBNF grammar on the completions endpoint
post /v1/completions '{"model": "synthetic-tiny-chat-f32", "prompt": "Is it?", "n": 6, "temperature": 1, "seed": 3,
    "max_tokens": 20, "grammar": "root ::= (\"yes\" | \"no\") (\", \" [0-9]{1,2} \"%\")?"}' | sed '$d' >"$tmpdir/g.json"
bad=$(jq -r '.choices[] | select(.finish_reason != "stop" or (.text | test("^(yes|no)(, [0-9]{1,2}%)?$") | not)) | .text' "$tmpdir/g.json")
[ -z "$bad" ] && [ "$(jq '.choices | length' "$tmpdir/g.json")" = 6 ] &&
    pass "grammar: 6 completions, each '$(jq -r '.choices[0].text' "$tmpdir/g.json")'-like and complete" ||
    fail "grammar: $(head -c 300 "$tmpdir/g.json")"

# calls the model must make
TOOLS='[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
    "properties": {"city": {"enum": ["Paris", "Tokyo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}},
  {"type": "function", "function": {"name": "search", "parameters": {"type": "object",
    "properties": {"query": {"type": "string", "maxLength": 12}}, "required": ["query"], "additionalProperties": false}}}]'
check_calls() { # FILE [EXPECTED-NAME]: each choice's calls name a tool and their arguments validate
    python3 - "$1" "$TOOLS" "${2:-}" <<'PY'
import json, sys, jsonschema
r = json.load(open(sys.argv[1])); tools = {t["function"]["name"]: t["function"]["parameters"] for t in json.loads(sys.argv[2])}
for c in r["choices"]:
    assert c["finish_reason"] == "tool_calls", c
    calls = c["message"]["tool_calls"]
    assert calls and c["message"]["content"] is None, c
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29, call
        name = call["function"]["name"]
        assert name in tools and (not sys.argv[3] or name == sys.argv[3]), name
        jsonschema.validate(json.loads(call["function"]["arguments"]), tools[name])
print(sum(len(c["message"]["tool_calls"]) for c in r["choices"]))
PY
}
ask "\"n\": 4, \"seed\": 11, \"tools\": $TOOLS, \"tool_choice\": \"required\"" | sed '$d' >"$tmpdir/t.json"
got=$(check_calls "$tmpdir/t.json") && pass "tool_choice required: 4 answers, $got calls, every one's arguments validate" ||
    fail "tool_choice required: $got $(head -c 400 "$tmpdir/t.json")"
ask "\"n\": 3, \"seed\": 12, \"tools\": $TOOLS, \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"search\"}},
    \"parallel_tool_calls\": false" | sed '$d' >"$tmpdir/t.json"
got=$(check_calls "$tmpdir/t.json" search) && [ "$got" = 3 ] &&
    pass "a named function, parallel_tool_calls false: one call to it per answer" ||
    fail "named tool_choice: $got $(head -c 400 "$tmpdir/t.json")"
# streamed: index, id, type and name first, then the arguments, as OpenAI's deltas
ask "\"stream\": true, \"seed\": 13, \"tools\": $TOOLS, \"tool_choice\": \"required\"" >"$tmpdir/ts.out"
sed -n 's/^data: //p' "$tmpdir/ts.out" | grep -v '^\[DONE\]$' >"$tmpdir/ts.jsonl"
python3 - "$tmpdir/ts.jsonl" "$TOOLS" <<'PY' && pass "tool calls stream as OpenAI deltas and add up to calls that validate" || fail "streamed tool calls: $(head -c 600 "$tmpdir/ts.jsonl")"
import json, sys, jsonschema
tools = {t["function"]["name"]: t["function"]["parameters"] for t in json.loads(sys.argv[2])}
calls, finish = {}, None
for line in open(sys.argv[1]):
    ch = json.loads(line)["choices"][0]
    for d in ch["delta"].get("tool_calls", []):
        if d["index"] not in calls:
            assert d["id"] and d["type"] == "function" and d["function"]["name"], d
            calls[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
        calls[d["index"]]["arguments"] += d["function"].get("arguments", "")
    assert not ch["delta"].get("content"), ch
    finish = ch["finish_reason"] or finish
assert finish == "tool_calls" and calls, (finish, calls)
for c in calls.values():
    jsonschema.validate(json.loads(c["arguments"]), tools[c["name"]])
PY

bad() { # WHAT MEMBERS EXPECTED-PARAM EXPECTED-TEXT
    ask "$2" >"$tmpdir/e.out"
    got=$(sed '$d' "$tmpdir/e.out" | jq -r '"\(.error.param): \(.error.message)"')
    [ "$(tail -n1 "$tmpdir/e.out")" = 400 ] && case "$got" in "$3: "*"$4"*) true;; *) false;; esac &&
        pass "$1: 400 '$got'" || fail "$1: $(cat "$tmpdir/e.out")"
}
bad "an unsupported keyword" '"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "number", "multipleOf": 2}}}' response_format "keyword 'multipleOf' is not supported"
bad "a pattern loom cannot follow" '"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}}' response_format "lookaround"
bad "an unknown keyword" '"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "propertyNames": {}}}}' response_format "'propertyNames' is not supported"
bad "json_schema without a name" '"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}' response_format "needs 'json_schema'"
bad "another format type" '"response_format": {"type": "yaml"}' response_format "'yaml' is not one of"
bad "a broken grammar" '"grammar": "root ::= (\"a\""' grammar "grammar line 1: expected ')'"
bad "a left-recursive grammar" '"grammar": "root ::= root \"a\" | \"b\""' grammar "left-recursive"
# a grammar that compiles but reads the answer 2^12 ways at its start: the client's to change
ambiguous=$(python3 -c 'import json; print(json.dumps("root ::= r0\n" + "".join("r%d ::= r%d | r%d \"x\"\n" % (i, i + 1, i + 1) for i in range(12)) + "r12 ::= \"a\"\n"))')
bad "a grammar too ambiguous to follow" "\"grammar\": $ambiguous" grammar "too ambiguous"
bad "... streamed too" "\"grammar\": $ambiguous, \"stream\": true" grammar "too ambiguous"
bad "grammar and response_format" '"grammar": "root ::= \"a\"", "response_format": {"type": "json_object"}' grammar "cannot go with"
stop_server

# a reasoning model's thought comes back as reasoning_content: a grammar makes the random model
# write one (thinking.jinja knows <think>), and the answer after it is the content
start_server "$tmpdir/s2.log" -c 2048 --chat-template-file "$top_srcdir/tests/templates/thinking.jinja"
think() { # MEMBERS
    post /v1/chat/completions "{\"model\": \"synthetic-tiny-chat-f32\", \"messages\": [{\"role\": \"user\",
        \"content\": \"Think first.\"}], \"temperature\": 1, \"seed\": 5, \"max_tokens\": 60, $1}" | sed '$d'
}
gram() { jq -cn --arg g "$1" '{grammar: $g}' | sed 's/^{//; s/}$//'; } # GBNF: a JSON member
G=$(gram 'root ::= "<think>\n" [a-z ]{3,12} "\n</think>\n\n" [a-z]{2,8}')
think "$G" >"$tmpdir/th.json"
jq -e '.choices[0].message | (.reasoning_content | test("^\\n[a-z ]{3,12}\\n$")) and (.content | test("^[a-z]{2,8}$"))' \
    "$tmpdir/th.json" >/dev/null && pass "a thought is reasoning_content, the rest content: $(jq -c '.choices[0].message' "$tmpdir/th.json")" ||
    fail "reasoning_content: $(head -c 400 "$tmpdir/th.json")"
think "$G, \"stream\": true" | sed -n 's/^data: //p' | grep -v '^\[DONE\]$' >"$tmpdir/th.jsonl"
streamed=$(jq -rj '.choices[0].delta.reasoning_content // empty' "$tmpdir/th.jsonl" | od -c | md5sum)
answer=$(jq -rj '.choices[0].delta.content // empty' "$tmpdir/th.jsonl")
[ "$streamed" = "$(jq -j '.choices[0].message.reasoning_content' "$tmpdir/th.json" | od -c | md5sum)" ] &&
    [ "$answer" = "$(jq -r '.choices[0].message.content' "$tmpdir/th.json")" ] &&
    pass "streamed, the thought comes as reasoning_content deltas and the answer as content" ||
    fail "streamed thought: answer '$answer'; $(head -c 600 "$tmpdir/th.jsonl")"
think '"grammar": "root ::= [a-z]{2,8}", "chat_template_kwargs": {"enable_thinking": false}' >"$tmpdir/nt.json"
jq -e '.choices[0].message | (has("reasoning_content") | not) and (.content | test("^[a-z]{2,8}$"))' \
    "$tmpdir/nt.json" >/dev/null && pass "without a thought there is no reasoning_content" ||
    fail "no thought: $(head -c 300 "$tmpdir/nt.json")"
stop_server
# a template whose prompt opens the thought (as DeepSeek-R1's): the model writes only its close
printf '{%% for m in messages %%}{{ m.content }}{%% endfor %%}<think>\n' >"$tmpdir/opens.jinja"
start_server "$tmpdir/s3.log" -c 2048 --chat-template-file "$tmpdir/opens.jinja"
think "$(gram 'root ::= [a-z ]{3,12} "</think>" [a-z]{2,8}')" >"$tmpdir/in.json"
jq -e '.choices[0].message | (.reasoning_content | test("^[a-z ]{3,12}$")) and (.content | test("^[a-z]{2,8}$"))' \
    "$tmpdir/in.json" >/dev/null && pass "a prompt that opens the thought: what comes before </think> is reasoning_content" ||
    fail "thought opened by the prompt: $(head -c 300 "$tmpdir/in.json")"
stop_server
finish
