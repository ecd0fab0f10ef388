#!/bin/sh
# tests/anthropic_client.sh - `loom serve`'s Anthropic Messages API (POST /v1/messages and
# /v1/messages/count_tokens) driven by Anthropic's official client (the npm `@anthropic-ai/sdk`
# package, as Claude Code and the Agent SDK use it), judged against the same server's OpenAI chat
# endpoint: the same conversation gives the same prompt tokens and, greedy, the same answer;
# streamed events add up to the message; a stop sequence is reported as Anthropic reports it;
# a tool conversation (tool_use, tool_result) reaches the template as the OpenAI form of it
# does; a forced tool's call comes back as a tool_use block, whole and streamed; a thought as a
# thinking block; errors in Anthropic's shape. On loom's synthetic chat model. Skipped when
# node/npm are missing or the npm registry cannot be reached.
. "$top_srcdir/tests/lib.sh"
command -v curl >/dev/null || { echo "SKIP: curl not installed"; exit 77; }
command -v node >/dev/null && command -v npm >/dev/null ||
    { echo "SKIP: node and npm are not installed (apt-get install nodejs npm)"; exit 77; }
KEY=k3y
MODEL=$(suite_model tiny-chat)
. "$top_srcdir/tests/serve_lib.sh"
(cd "$tmpdir" && timeout 240 npm install --silent --no-audit --no-fund @anthropic-ai/sdk@0 \
    >npm.log 2>&1) || { echo "SKIP: cannot install @anthropic-ai/sdk (no registry?):"; tail -n 3 "$tmpdir/npm.log"; exit 77; }

# ---- the wire, with curl: shapes and errors
start_server "$tmpdir/s.log" -c 8192 --chat-template-file "$top_srcdir/tests/templates/toolchat.jinja"
NAME=$(curl -s -H "x-api-key: $KEY" "$URL/v1/models" | jq -r '.data[0].id')
msgs() { # BODY [curl args]: POST /v1/messages with x-api-key; the body, then the status
    b=$1; shift
    curl -s -w '\n%{http_code}' -H "x-api-key: $KEY" -H 'anthropic-version: 2023-06-01' \
        -H 'Content-Type: application/json' "$@" --data-binary "$b" "$URL/v1/messages"
}
refused() { # WHAT BODY STATUS ERROR-TYPE TEXT
    msgs "$2" >"$tmpdir/e.out"
    got=$(sed '$d' "$tmpdir/e.out" | jq -r '"\(.type) \(.error.type): \(.error.message)"')
    [ "$(tail -n1 "$tmpdir/e.out")" = "$3" ] && case "$got" in "error $4: "*"$5"*) true ;; *) false ;; esac &&
        pass "$1: $3 '$got'" || fail "$1: $(cat "$tmpdir/e.out")"
}
refused "no max_tokens" "{\"model\": \"$NAME\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}" \
    400 invalid_request_error "max_tokens: Field required"
refused "an image block" "{\"model\": \"$NAME\", \"max_tokens\": 4, \"messages\": [{\"role\": \"user\",
    \"content\": [{\"type\": \"image\", \"source\": {\"type\": \"base64\", \"media_type\": \"image/png\", \"data\": \"AA==\"}}]}]}" \
    400 invalid_request_error "messages.0.content.0: 'image' blocks are not supported"
refused "a system role in messages" "{\"model\": \"$NAME\", \"max_tokens\": 4, \"messages\": [{\"role\": \"system\", \"content\": \"x\"}]}" \
    400 invalid_request_error "top-level 'system' field"
refused "temperature 1.5 (Anthropic's range is 0 to 1)" "{\"model\": \"$NAME\", \"max_tokens\": 4, \"temperature\": 1.5,
    \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}" 400 invalid_request_error "temperature"
refused "an unknown field" "{\"model\": \"$NAME\", \"max_tokens\": 4, \"mcp_servers\": [],
    \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}" 400 invalid_request_error "mcp_servers: unknown field"
refused "one of Anthropic's server tools" "{\"model\": \"$NAME\", \"max_tokens\": 4, \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}],
    \"tools\": [{\"type\": \"web_search_20250305\", \"name\": \"web_search\"}]}" 400 invalid_request_error "not a custom tool"
refused "another model" "{\"model\": \"claude-sonnet-4-5\", \"max_tokens\": 4, \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}" \
    404 not_found_error "does not exist"
code=$(curl -s -o "$tmpdir/k.out" -w '%{http_code}' -H 'x-api-key: nope' -d '{}' "$URL/v1/messages")
[ "$code" = 401 ] && jq -e '.type == "error" and .error.type == "authentication_error"' "$tmpdir/k.out" >/dev/null &&
    pass "a wrong x-api-key: 401 in Anthropic's shape" || fail "wrong x-api-key: $code $(cat "$tmpdir/k.out")"
code=$(curl -s -o /dev/null -w '%{http_code}' -H "x-api-key: $KEY" -H "Authorization: Bearer nope" \
    -d '{}' "$URL/v1/messages")
[ "$code" = 401 ] && pass "Authorization, when sent, is the key that counts (a wrong one beside a right x-api-key: 401)" ||
    fail "Authorization beside x-api-key: $code"
code=$(curl -s -o "$tmpdir/o.out" -w '%{http_code}' -H "Authorization: Bearer $KEY" -d '{}' "$URL/v1/chat/completions")
[ "$code" = 400 ] && jq -e '.error.param != null or .error.code == null' "$tmpdir/o.out" >/dev/null &&
    ! jq -e '.type == "error"' "$tmpdir/o.out" >/dev/null &&
    pass "the OpenAI routes keep OpenAI's error shape" || fail "OpenAI route error: $code $(cat "$tmpdir/o.out")"

# ---- the official client
cat >"$tmpdir/client.mjs" <<'EOF'
import Anthropic from '@anthropic-ai/sdk';
const url = `http://127.0.0.1:${process.env.PORT}`;
const client = new Anthropic({ baseURL: url, apiKey: 'k3y', maxRetries: 0 });
const out = [];
const ok = (what, cond) => out.push(`${cond ? 'ok' : 'FAIL'}: ${what}`);
const openai = async (body) => (await fetch(`${url}/v1/chat/completions`, { method: 'POST',
  headers: { Authorization: 'Bearer k3y', 'Content-Type': 'application/json' },
  body: JSON.stringify(body) })).json();
const name = process.env.NAME;
const text = (m) => m.content.filter((b) => b.type === 'text').map((b) => b.text).join('');

// greedy: the same answer and prompt as the OpenAI chat of the same conversation
const m = await client.messages.create({ model: name, max_tokens: 24, temperature: 0,
  system: 'Tell stories.', messages: [{ role: 'user', content: 'A dog' }] });
const c = await openai({ model: name, max_tokens: 24, temperature: 0,
  messages: [{ role: 'system', content: 'Tell stories.' }, { role: 'user', content: 'A dog' }] });
ok(`messages.create: '${text(m)}', ${m.usage.input_tokens}+${m.usage.cache_read_input_tokens} in, ` +
   `${m.usage.output_tokens} out, ${m.stop_reason}`,
   m.type === 'message' && m.role === 'assistant' && m.id.startsWith('msg_') &&
   text(m) === c.choices[0].message.content &&
   m.usage.input_tokens + m.usage.cache_read_input_tokens === c.usage.prompt_tokens &&
   m.usage.output_tokens === c.usage.completion_tokens &&
   m.stop_reason === (c.choices[0].finish_reason === 'length' ? 'max_tokens' : 'end_turn'));

// system as text blocks, content as text blocks: the same prompt
const n = await client.messages.countTokens({ model: name, system: [{ type: 'text', text: 'Tell ' },
  { type: 'text', text: 'stories.', cache_control: { type: 'ephemeral' } }],
  messages: [{ role: 'user', content: [{ type: 'text', text: 'A dog' }] }] });
ok(`messages.countTokens: ${n.input_tokens}, as the chat's prompt`, n.input_tokens === c.usage.prompt_tokens);

// streamed: the events add up to the message
const events = [];
const s = client.messages.stream({ model: name, max_tokens: 24, temperature: 0,
  system: 'Tell stories.', messages: [{ role: 'user', content: 'A dog' }] });
s.on('streamEvent', (e) => events.push(e.type));
const f = await s.finalMessage();
ok(`messages.stream: ${[...new Set(events)].join(', ')}`, text(f) === text(m) &&
   f.stop_reason === m.stop_reason && f.usage.output_tokens === m.usage.output_tokens &&
   events[0] === 'message_start' && events.at(-1) === 'message_stop' &&
   events.includes('content_block_delta') && events.includes('message_delta'));

// a stop sequence from the answer itself: the text ends before it, and it is named
const answer = text(m), at = answer.indexOf(' ', 4);
const stop = answer.slice(at, at + 3);
const st = await client.messages.create({ model: name, max_tokens: 24, temperature: 0,
  stop_sequences: ['no such text', stop], system: 'Tell stories.', messages: [{ role: 'user', content: 'A dog' }] });
ok(`stop_sequences: stopped at '${st.stop_sequence}' with '${text(st)}'`, at > 0 &&
   st.stop_reason === 'stop_sequence' && st.stop_sequence === stop && text(st) === answer.slice(0, answer.indexOf(stop)));

// tools: a forced call comes back as a tool_use block, its input valid for the schema
const tools = [{ name: 'get_weather', description: 'The weather', input_schema: { type: 'object',
  properties: { city: { type: 'string', enum: ['Paris', 'Oslo'] }, days: { type: 'integer', minimum: 1, maximum: 7 } },
  required: ['city', 'days'], additionalProperties: false } }];
const ask = [{ role: 'user', content: 'Weather in Paris for 3 days?' }];
const r = await client.messages.create({ model: name, max_tokens: 1200, tools, messages: ask,
  tool_choice: { type: 'tool', name: 'get_weather', disable_parallel_tool_use: true } });
const use = r.content.find((b) => b.type === 'tool_use');
ok(`a forced tool: ${use?.name}(${JSON.stringify(use?.input)}), ${r.stop_reason}`,
   use && use.name === 'get_weather' && use.id.startsWith('toolu_') && ['Paris', 'Oslo'].includes(use.input.city) &&
   Number.isInteger(use.input.days) && use.input.days >= 1 && use.input.days <= 7 && r.stop_reason === 'tool_use');
// its result sent back: the template sees what the OpenAI form of the conversation gives it
const back = [...ask, { role: 'assistant', content: [use] },
  { role: 'user', content: [{ type: 'tool_result', tool_use_id: use.id, content: '{"sky": "clear"}' }] }];
const nb = await client.messages.countTokens({ model: name, tools, messages: back });
const ob = await openai({ model: name, max_tokens: 1, tools: tools.map((t) => ({ type: 'function',
  function: { name: t.name, description: t.description, parameters: t.input_schema } })),
  messages: [...ask, { role: 'assistant', content: null, tool_calls: [{ id: use.id, type: 'function',
    function: { name: use.name, arguments: JSON.stringify(use.input) } }] },
    { role: 'tool', tool_call_id: use.id, content: '{"sky": "clear"}' }] });
ok(`tool_use and tool_result reach the template as OpenAI's form does (${nb.input_tokens} tokens)`,
   nb.input_tokens === ob.usage.prompt_tokens && nb.input_tokens > 0);
// streamed: the client's helper assembles the input from input_json_delta
const ts = client.messages.stream({ model: name, max_tokens: 1200, tools, tool_choice: { type: 'any' },
  messages: [{ role: 'user', content: 'And Oslo?' }] });
const tf = await ts.finalMessage();
const tu = tf.content.filter((b) => b.type === 'tool_use');
ok(`streamed: ${tu.length} tool_use block(s) assembled by the client`, tu.length >= 1 &&
   tu.every((b) => b.name === 'get_weather' && ['Paris', 'Oslo'].includes(b.input.city)) && tf.stop_reason === 'tool_use');

for (const [what, call, status] of [
  ['another model', () => client.messages.create({ model: 'claude-x', max_tokens: 4, messages: ask }), 404],
  ['a wrong key', () => new Anthropic({ baseURL: url, apiKey: 'nope', maxRetries: 0 })
    .messages.create({ model: name, max_tokens: 4, messages: ask }), 401],
  ['max_tokens 0', () => client.messages.create({ model: name, max_tokens: 0, messages: ask }), 400]]) {
  try {
    await call();
    ok(`${what} raises`, false);
  } catch (e) {
    ok(`${what} raises ${e.constructor.name} ${e.status}: ${e.error?.error?.type}`,
       e.status === status && e.error?.type === 'error' && typeof e.error?.error?.message === 'string');
  }
}
console.log(out.join('\n'));
EOF
(cd "$tmpdir" && PORT=$port NAME=$NAME node client.mjs >client.out 2>&1) || true
cat "$tmpdir/client.out"
grep -q '^FAIL' "$tmpdir/client.out" && fail "the Anthropic client disagreed (above)"
[ "$(grep -c "^ok" "$tmpdir/client.out")" -ge 10 ] || fail "the client script did not finish: $(tail -n 5 "$tmpdir/client.out")"
stop_server

# ---- a thought comes back as a thinking block: a template that opens it in the prompt (as
# reasoning models' do), closed at once with enable_thinking false
printf '%s' "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{ '\n</think>\n\n' }}{% endif %}{% endif %}" \
    >"$tmpdir/think.jinja"
start_server "$tmpdir/t.log" -c 4096 --chat-template-file "$tmpdir/think.jinja"
think() { # THINKING-JSON [MORE-MEMBERS]: the answer's body
    msgs "{\"model\": \"$NAME\", \"max_tokens\": 1100, \"thinking\": $1, \"temperature\": 0,
        \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]${2:+, $2}}" | sed '$d'
}
think '{"type": "enabled", "budget_tokens": 1024}' >"$tmpdir/think.json"
think '{"type": "enabled", "budget_tokens": 1024}' '"stream": true' >"$tmpdir/think.sse"
streamed=$(sed -n 's/^data: //p' "$tmpdir/think.sse" | jq -rj 'select(.type == "content_block_delta") | .delta.thinking // empty')
jq -e '.content[0].type == "thinking" and (.content[0].thinking | length > 0) and
    .content[1].type == "text" and .usage.output_tokens > 1024' "$tmpdir/think.json" >/dev/null &&
    [ "$streamed" = "$(jq -rj '.content[0].thinking' "$tmpdir/think.json")" ] &&
    pass "a thought is a thinking block, whole and as thinking_delta events; budget_tokens ends it, the text follows" ||
    fail "thinking: $(head -c 400 "$tmpdir/think.json") / $(head -c 300 "$tmpdir/think.sse")"
# the budget exactly: 20 tokens of thought (a random model never ends its own), then the
# forced "\n</think>\n\n", token by token in the chat's logprobs; without it, no end
budget() { # REASONING-MEMBERS: the chat answer
    post_chat="{\"model\": \"$NAME\", \"max_tokens\": 40, \"temperature\": 0, \"logprobs\": true,
        \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]${1:+, $1}}"
    curl -s -H "Authorization: Bearer $KEY" -d "$post_chat" "$URL/v1/chat/completions"
}
budget '"reasoning_budget": 20' >"$tmpdir/b20.json"
budget '' >"$tmpdir/b0.json"
jq -e '[.choices[0].logprobs.content[].token] as $t | ($t[20:] | join("") | startswith("\n</think>\n\n"))
    and ($t[:20] | join("") | contains("</think>") | not) and .usage.completion_tokens_details.reasoning_tokens == 20
    and (.choices[0].message.content | length > 0)' "$tmpdir/b20.json" >/dev/null &&
    jq -e '.usage.completion_tokens_details.reasoning_tokens == 40 and .choices[0].message.content == ""' \
        "$tmpdir/b0.json" >/dev/null &&
    pass "reasoning_budget 20: the thought ends after exactly 20 tokens (forced </think>), the answer follows; without it the thought runs on" ||
    fail "reasoning budget: $(jq -c '[.usage, [.choices[0].logprobs.content[].token]]' "$tmpdir/b20.json" | head -c 600) / $(jq -c .usage "$tmpdir/b0.json")"
curl -s -H "Authorization: Bearer $KEY" -d "{\"model\": \"$NAME\", \"max_output_tokens\": 1100, \"temperature\": 0,
    \"reasoning\": {\"effort\": \"low\"}, \"input\": \"hi\"}" "$URL/v1/responses" >"$tmpdir/low.json"
jq -e '.output[0].type == "reasoning" and .output[1].type == "message" and .usage.output_tokens_details.reasoning_tokens == 1024' \
    "$tmpdir/low.json" >/dev/null && pass "the Responses API's reasoning.effort low: a 1024-token thought, then the message" ||
    fail "reasoning effort low: $(jq -c '[.usage, [.output[].type]]' "$tmpdir/low.json")"
think '{"type": "disabled"}' >"$tmpdir/nothink.json"
jq -e '[.content[].type] | index("thinking") == null' "$tmpdir/nothink.json" >/dev/null &&
    pass "thinking disabled: the template closes the thought, no thinking block" ||
    fail "thinking disabled: $(head -c 400 "$tmpdir/nothink.json")"
refused "a thinking budget not below max_tokens" "{\"model\": \"$NAME\", \"max_tokens\": 1024,
    \"thinking\": {\"type\": \"enabled\", \"budget_tokens\": 1024}, \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}" \
    400 invalid_request_error "less than max_tokens"
stop_server
finish
