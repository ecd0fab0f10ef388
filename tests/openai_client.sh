#!/bin/sh
# tests/openai_client.sh - `loom serve` driven by the official OpenAI client (the npm `openai`
# package, the same request and response shapes as the Python one): completions, chat, both
# streamed, n > 1, embeddings (base64, as the client asks), an error surfacing as the client's typed exception; then tools (a required
# call read by the client, its result sent back, the client's own stream helper assembling
# streamed calls) and structured output (chat.completions.parse with a zod schema); and the
# Vercel AI SDK (npm `ai` with `@ai-sdk/openai-compatible`): generateObject, and streamText
# with a required tool that the SDK executes; LangChain.js' ChatOpenAI (invoke, bindTools); and
# the Responses API with the openai client
# (plain, streamed, a forced function and its output sent back, text.format, kept responses
# continued, read back and deleted, refusals), each
# answer as the chat endpoint's for the same conversation. Skipped when node/npm
# are missing or the npm registry cannot be reached (it is the only registry CI can use).
. "$top_srcdir/tests/lib.sh"
# the model: loom's synthetic chat model (random weights, ChatML), which the suite writes
MODEL=$(suite_model tiny-chat)
command -v node >/dev/null && command -v npm >/dev/null ||
    { echo "SKIP: node and npm are not installed (apt-get install nodejs npm)"; exit 77; }
cd "$tmpdir" || exit 1
if ! timeout 240 npm install --silent --no-audit --no-fund openai@4 zod@3 ai@5 \
    @ai-sdk/openai-compatible@1 @langchain/openai@0 @langchain/core@0 >npm.log 2>&1; then
    echo "SKIP: cannot install the openai npm package (no registry?):"; tail -n 3 npm.log; exit 77
fi
"$LOOM" serve -m "$MODEL" --port 0 --api-key k3y -c 512 >server.log 2>&1 &
PID=$!
"$LOOM" serve -m "$MODEL" --port 0 --api-key k3y -c 8192 \
    --chat-template-file "$top_srcdir/tests/templates/toolchat.jinja" >server2.log 2>&1 &
PID2=$!
trap 'kill -TERM $PID $PID2 2>/dev/null; rm -rf "$tmpdir"' EXIT
listening_port() { # LOG: the port the server writing LOG listens on, once it says so
    for _ in $(seq 100); do
        sed -n 's/.*listening on http:\/\/[0-9.]*:\([0-9][0-9]*\).*/\1/p' "$1" | grep . && return
        sleep 0.1
    done
}
port=$(listening_port server.log)
[ -n "$port" ] || { fail "server did not start: $(cat server.log)"; finish; }
port2=$(listening_port server2.log)
[ -n "$port2" ] || { fail "the second server did not start: $(cat server2.log)"; finish; }

cat >client.mjs <<'EOF'
import OpenAI from 'openai';
const client = new OpenAI({ baseURL: `http://127.0.0.1:${process.env.PORT}/v1`, apiKey: 'k3y' });
const out = [];
const ok = (what, cond) => out.push(`${cond ? 'ok' : 'FAIL'}: ${what}`);
const models = await client.models.list();
const name = models.data[0].id;
ok(`models.list -> ${name}`, models.data.length === 1);

const c = await client.completions.create({ model: name, prompt: 'Once upon a time', max_tokens: 24,
                                            temperature: 0 });
ok(`completions.create: '${c.choices[0].text}'`, c.choices[0].text.length > 0 &&
   c.usage.completion_tokens === 24 && c.choices[0].finish_reason === 'length');

let streamed = '';
let usage = null;
const s = await client.completions.create({ model: name, prompt: 'Once upon a time', max_tokens: 24,
                                            temperature: 0, stream: true,
                                            stream_options: { include_usage: true } });
for await (const chunk of s) {
  if (chunk.choices.length) streamed += chunk.choices[0].text;
  if (chunk.usage) usage = chunk.usage;
}
ok('streamed completion equals the plain one', streamed === c.choices[0].text);
ok('stream usage', usage && usage.completion_tokens === 24);

const chat = await client.chat.completions.create({ model: name, max_tokens: 16, seed: 3,
  messages: [{ role: 'system', content: 'Tell stories.' }, { role: 'user', content: 'A dog' }] });
ok(`chat.completions.create: '${chat.choices[0].message.content}'`,
   chat.choices[0].message.role === 'assistant' && chat.usage.total_tokens > 0);

let text = '';
const cs = await client.chat.completions.create({ model: name, max_tokens: 16, seed: 3, stream: true,
  messages: [{ role: 'system', content: 'Tell stories.' }, { role: 'user', content: 'A dog' }] });
for await (const chunk of cs) text += chunk.choices[0]?.delta?.content ?? '';
ok('streamed chat equals the plain one', text === chat.choices[0].message.content);

const many = await client.completions.create({ model: name, prompt: 'The cat', max_tokens: 8, n: 3, seed: 9 });
ok('n=3', many.choices.length === 3);

// the client asks for base64 unless told otherwise, and decodes it
const e1 = await client.embeddings.create({ model: name, input: ['Once upon a time', 'The cat'] });
const e2 = await client.embeddings.create({ model: name, input: 'The cat', encoding_format: 'float' });
const v = e1.data[1].embedding, w = e2.data[0].embedding;
ok(`embeddings.create: ${e1.data.length} of ${v.length} dimensions, length ${Math.hypot(...v).toFixed(6)}`,
   e1.data.length === 2 && v.length === w.length && v.every((x, i) => Math.abs(x - w[i]) < 1e-6) &&
   Math.abs(Math.hypot(...v) - 1) < 1e-5 && e1.usage.prompt_tokens > 0);

try {
  await client.completions.create({ model: 'nope', prompt: 'x' });
  ok('unknown model raises', false);
} catch (e) {
  ok(`unknown model raises ${e.constructor.name} ${e.status}: ${e.message}`, e.status === 404);
}
try {
  await new OpenAI({ baseURL: client.baseURL, apiKey: 'wrong', maxRetries: 0 }).models.list();
  ok('wrong key raises', false);
} catch (e) {
  ok(`wrong key raises ${e.constructor.name}`, e.status === 401);
}
console.log(out.join('\n'));
EOF
PORT=$port node client.mjs >client.out 2>&1 || true
cat client.out
grep -q '^FAIL' client.out && fail "the OpenAI client disagreed (above)"
[ "$(grep -c "^ok" client.out)" -ge 10 ] || fail "the client script did not finish: $(tail -n 5 client.out)"

# tools and structured output, on a model whose template shows tools (its weights are random:
# the calls and the JSON are made by loom's constrained decoding; a random model spends many
# tokens on the whitespace JSON allows, hence max_tokens 1200)
cat >tools.mjs <<'EOF'
import OpenAI from 'openai';
import { zodResponseFormat } from 'openai/helpers/zod';
import { z } from 'zod';
const client = new OpenAI({ baseURL: `http://127.0.0.1:${process.env.PORT}/v1`, apiKey: 'k3y' });
const out = [];
const ok = (what, cond) => out.push(`${cond ? 'ok' : 'FAIL'}: ${what}`);
const name = (await client.models.list()).data[0].id;
const tools = [{ type: 'function', function: { name: 'get_weather', description: 'The weather',
  parameters: { type: 'object', properties: { city: { type: 'string', enum: ['Paris', 'Oslo'] },
    days: { type: 'integer', minimum: 1, maximum: 7 } }, required: ['city', 'days'],
    additionalProperties: false } } }];
const messages = [{ role: 'user', content: 'Weather in Paris for 3 days?' }];
const r = await client.chat.completions.create({ model: name, messages, tools, seed: 1,
  tool_choice: 'required', parallel_tool_calls: false, max_tokens: 1200 });
const msg = r.choices[0].message, call = msg.tool_calls?.[0];
const args = call ? JSON.parse(call.function.arguments) : null;
ok(`a required call: ${call?.function.name}(${call?.function.arguments})`,
   r.choices[0].finish_reason === 'tool_calls' && msg.tool_calls.length === 1 &&
   call.function.name === 'get_weather' && ['Paris', 'Oslo'].includes(args.city) &&
   Number.isInteger(args.days) && args.days >= 1 && args.days <= 7);
messages.push(msg, { role: 'tool', tool_call_id: call.id, content: '{"sky": "clear"}' });
const back = await client.chat.completions.create({ model: name, messages, tools, max_tokens: 8 });
ok(`the call and its result sent back: ${back.usage.prompt_tokens} prompt tokens`,
   back.choices[0].message.role === 'assistant' && back.usage.prompt_tokens > r.usage.prompt_tokens);
const stream = client.beta.chat.completions.stream({ model: name, seed: 2, tools,
  tool_choice: { type: 'function', function: { name: 'get_weather' } }, max_tokens: 1200,
  messages: [{ role: 'user', content: 'And Oslo?' }] });
const done = await stream.finalChatCompletion();
const sc = done.choices[0].message.tool_calls ?? [];
ok(`the client's stream helper assembles ${sc.length} streamed call(s)`, sc.length >= 1 &&
   sc.every((c) => c.function.name === 'get_weather' && c.id &&
                   ['Paris', 'Oslo'].includes(JSON.parse(c.function.arguments).city)));
const Person = z.object({ name: z.string().max(10), age: z.number().int().min(0).max(99),
                          pets: z.array(z.enum(['cat', 'dog'])).max(2) });
const parsed = await client.beta.chat.completions.parse({ model: name, seed: 3, max_tokens: 1200,
  messages: [{ role: 'user', content: 'A person' }], response_format: zodResponseFormat(Person, 'person') });
const p = parsed.choices[0].message.parsed;
ok(`chat.completions.parse with a zod schema: ${JSON.stringify(p)}`, p && Person.safeParse(p).success);
console.log(out.join('\n'));
EOF
PORT=$port2 node tools.mjs >tools.out 2>&1 || true
cat tools.out
grep -q '^FAIL' tools.out && fail "the OpenAI client disagreed on tools or structured output (above)"
[ "$(grep -c "^ok" tools.out)" -ge 4 ] || fail "the tools script did not finish: $(tail -n 8 tools.out)"

# the Vercel AI SDK against the same server
cat >sdk.mjs <<'EOF'
import { createOpenAICompatible } from '@ai-sdk/openai-compatible';
import { generateObject, streamText, tool, stepCountIs } from 'ai';
import { z } from 'zod';
const loom = createOpenAICompatible({ name: 'loom', baseURL: `http://127.0.0.1:${process.env.PORT}/v1`,
  apiKey: 'k3y', supportsStructuredOutputs: true });
const models = await (await fetch(`http://127.0.0.1:${process.env.PORT}/v1/models`,
  { headers: { Authorization: 'Bearer k3y' } })).json();
const model = loom.chatModel(models.data[0].id);
const out = [];
const ok = (what, cond) => out.push(`${cond ? 'ok' : 'FAIL'}: ${what}`);
const Person = z.object({ name: z.string().max(10), age: z.number().int().min(0).max(99) });
const { object } = await generateObject({ model, schema: Person, prompt: 'A person', seed: 4,
  maxOutputTokens: 1200 });
ok(`AI SDK generateObject: ${JSON.stringify(object)}`, Person.safeParse(object).success);
const ran = [];
const weather = tool({ description: 'The weather in a city',
  inputSchema: z.object({ city: z.enum(['Paris', 'Oslo']), days: z.number().int().min(1).max(7) }),
  execute: async ({ city, days }) => { ran.push(city); return { city, days, sky: 'clear' }; } });
const result = streamText({ model, tools: { weather }, toolChoice: 'required', seed: 5,
  maxOutputTokens: 1200, prompt: 'Weather in Oslo?', stopWhen: stepCountIs(1) });
const parts = new Set();
for await (const p of result.fullStream) parts.add(p.type);
const calls = await result.toolCalls, results = await result.toolResults;
ok(`AI SDK streamText, a required tool: ${JSON.stringify(calls.map((c) => [c.toolName, c.input]))}; ` +
   `parts ${[...parts].join(' ')}`,
   calls.length >= 1 && calls.every((c) => c.toolName === 'weather') &&
   results.length === calls.length && ran.length === calls.length && parts.has('tool-input-delta'));
console.log(out.join('\n'));
EOF
PORT=$port2 node sdk.mjs >sdk.out 2>&1 || true
cat sdk.out
grep -q '^FAIL' sdk.out && fail "the Vercel AI SDK disagreed (above)"
[ "$(grep -c "^ok" sdk.out)" -ge 2 ] || fail "the AI SDK script did not finish: $(tail -n 8 sdk.out)"

# LangChain.js' ChatOpenAI against the same server: a greedy answer as the chat endpoint's, and
# bindTools with a named tool giving a call whose arguments fit the tool's zod schema
cat >langchain.mjs <<'EOF'
import { ChatOpenAI } from '@langchain/openai';
import { tool } from '@langchain/core/tools';
import { z } from 'zod';
const base = `http://127.0.0.1:${process.env.PORT}/v1`;
const models = await (await fetch(`${base}/models`, { headers: { Authorization: 'Bearer k3y' } })).json();
const model = models.data[0].id;
const out = [];
const ok = (what, cond) => out.push(`${cond ? 'ok' : 'FAIL'}: ${what}`);
const llm = (maxTokens) => new ChatOpenAI({ model, apiKey: 'k3y', temperature: 0, maxTokens, maxRetries: 0,
  configuration: { baseURL: base } });
const r = await llm(24).invoke([['system', 'Tell stories.'], ['human', 'A dog']]);
const c = await (await fetch(`${base}/chat/completions`, { method: 'POST',
  headers: { Authorization: 'Bearer k3y', 'Content-Type': 'application/json' },
  body: JSON.stringify({ model, max_tokens: 24, temperature: 0, messages: [{ role: 'system', content: 'Tell stories.' },
    { role: 'user', content: 'A dog' }] }) })).json();
ok(`ChatOpenAI.invoke: '${r.content}'`, r.content === c.choices[0].message.content);
const Weather = z.object({ city: z.enum(['Paris', 'Oslo']), days: z.number().int().min(1).max(7) });
const weather = tool(async ({ city }) => `sunny in ${city}`, { name: 'get_weather', description: 'The weather',
  schema: Weather });
const t = await llm(1200).bindTools([weather], { tool_choice: 'get_weather', parallel_tool_calls: false })
  .invoke('Weather in Paris?');
ok(`bindTools, a named tool: ${JSON.stringify(t.tool_calls)}`, t.tool_calls.length === 1 &&
   t.tool_calls[0].name === 'get_weather' && Weather.safeParse(t.tool_calls[0].args).success);
console.log(out.join('\n'));
EOF
PORT=$port2 node langchain.mjs >langchain.out 2>&1 || true
cat langchain.out
grep -q '^FAIL' langchain.out && fail "LangChain.js disagreed (above)"
[ "$(grep -c "^ok" langchain.out)" -ge 2 ] || fail "the LangChain script did not finish: $(tail -n 8 langchain.out)"

# the Responses API (POST /v1/responses, as Codex and the Agents SDK send it), judged against the
# same server's chat completions for the same conversation
cat >responses.mjs <<'EOF'
import OpenAI from 'openai';
const client = new OpenAI({ baseURL: `http://127.0.0.1:${process.env.PORT}/v1`, apiKey: 'k3y', maxRetries: 0 });
const out = [];
const ok = (what, cond) => out.push(`${cond ? 'ok' : 'FAIL'}: ${what}`);
const name = (await client.models.list()).data[0].id;
const r = await client.responses.create({ model: name, instructions: 'Tell stories.', input: 'A dog',
  max_output_tokens: 24, temperature: 0 });
const c = await client.chat.completions.create({ model: name, max_tokens: 24, temperature: 0,
  messages: [{ role: 'system', content: 'Tell stories.' }, { role: 'user', content: 'A dog' }] });
ok(`responses.create: '${r.output_text}', ${r.status}, ${r.usage.input_tokens} in ${r.usage.output_tokens} out`,
   r.object === 'response' && r.id.startsWith('resp_') && r.output_text === c.choices[0].message.content &&
   r.usage.input_tokens === c.usage.prompt_tokens && r.usage.output_tokens === c.usage.completion_tokens &&
   r.status === (c.choices[0].finish_reason === 'length' ? 'incomplete' : 'completed'));
const events = [];
const s = client.responses.stream({ model: name, instructions: 'Tell stories.', input: 'A dog',
  max_output_tokens: 24, temperature: 0 });
s.on('event', (e) => events.push(e.type));
const f = await s.finalResponse();
// (the client finalises on response.completed only; cut at max_output_tokens the stream ends with
// response.incomplete, as OpenAI's does, and what the client assembled is its snapshot)
const streamed = f.output.filter((i) => i.type === 'message').flatMap((i) => i.content).map((p) => p.text).join('');
ok(`responses.stream: ${[...new Set(events)].join(', ')}`, streamed === r.output_text &&
   events[0] === 'response.created' && events.includes('response.output_text.delta') &&
   ['response.completed', 'response.incomplete'].includes(events.at(-1)));
// a forced function tool, its output sent back as the chat form of the same conversation
const tools = [{ type: 'function', name: 'get_weather', description: 'The weather', strict: true,
  parameters: { type: 'object', properties: { city: { type: 'string', enum: ['Paris', 'Oslo'] },
    days: { type: 'integer', minimum: 1, maximum: 7 } }, required: ['city', 'days'], additionalProperties: false } }];
const t = await client.responses.create({ model: name, input: 'Weather in Paris for 3 days?', tools,
  tool_choice: { type: 'function', name: 'get_weather' }, parallel_tool_calls: false, max_output_tokens: 1200 });
const call = t.output.find((i) => i.type === 'function_call');
const args = call ? JSON.parse(call.arguments) : {};
ok(`a forced function: ${call?.name}(${call?.arguments})`, call && call.name === 'get_weather' &&
   call.call_id && ['Paris', 'Oslo'].includes(args.city) && Number.isInteger(args.days) &&
   t.output.filter((i) => i.type === 'function_call').length === 1);
const back = await client.responses.create({ model: name, tools, max_output_tokens: 1, input: [
  { role: 'user', content: 'Weather in Paris for 3 days?' }, call,
  { type: 'function_call_output', call_id: call.call_id, output: '{"sky": "clear"}' }] });
const cb = await client.chat.completions.create({ model: name, max_tokens: 1,
  tools: tools.map(({ name, description, parameters }) => ({ type: 'function', function: { name, description, parameters } })),
  messages: [{ role: 'user', content: 'Weather in Paris for 3 days?' }, { role: 'assistant', content: null,
    tool_calls: [{ id: call.call_id, type: 'function', function: { name: call.name, arguments: call.arguments } }] },
    { role: 'tool', tool_call_id: call.call_id, content: '{"sky": "clear"}' }] });
ok(`the call and its output sent back: ${back.usage.input_tokens} input tokens, as the chat's`,
   back.usage.input_tokens === cb.usage.prompt_tokens);
const ts = client.responses.stream({ model: name, input: 'And Oslo?', tools, tool_choice: 'required',
  max_output_tokens: 1200 });
const tf = await ts.finalResponse();
const sc = tf.output.filter((i) => i.type === 'function_call');
ok(`streamed: ${sc.length} function call(s)`, sc.length >= 1 &&
   sc.every((i) => i.name === 'get_weather' && ['Paris', 'Oslo'].includes(JSON.parse(i.arguments).city)));
const j = await client.responses.create({ model: name, input: 'A person', max_output_tokens: 1200,
  text: { format: { type: 'json_schema', name: 'person', strict: true, schema: { type: 'object',
    properties: { name: { type: 'string', maxLength: 10 } }, required: ['name'], additionalProperties: false } } } });
ok(`text.format json_schema: ${j.output_text}`, typeof JSON.parse(j.output_text).name === 'string');
// kept responses: continued by previous_response_id (the chat form of the whole conversation's
// prompt), read back, deleted; store false keeps nothing
const first = await client.responses.create({ model: name, instructions: 'Be brief.', input: 'My name is Ada.',
  max_output_tokens: 4, temperature: 0 });
const next = await client.responses.create({ model: name, instructions: 'Be brief.', input: 'What is my name?',
  previous_response_id: first.id, max_output_tokens: 4, temperature: 0 });
const whole = await client.chat.completions.create({ model: name, max_tokens: 4, temperature: 0, messages: [
  { role: 'system', content: 'Be brief.' }, { role: 'user', content: 'My name is Ada.' },
  { role: 'assistant', content: first.output_text }, { role: 'user', content: 'What is my name?' }] });
ok(`previous_response_id: ${next.usage.input_tokens} input tokens, as the whole conversation's chat prompt`,
   next.previous_response_id === first.id && next.usage.input_tokens === whole.usage.prompt_tokens &&
   next.output_text === whole.choices[0].message.content);
const kept = await client.responses.retrieve(first.id);
await (client.responses.delete ?? client.responses.del).call(client.responses, first.id); // (v4 names it del)
let gone = 0;
try { await client.responses.retrieve(first.id); } catch (e) { gone = e.status; }
const unkept = await client.responses.create({ model: name, input: 'hi', store: false, max_output_tokens: 2 });
let unkeptStatus = 0;
try { await client.responses.retrieve(unkept.id); } catch (e) { unkeptStatus = e.status; }
ok(`retrieve, delete (then ${gone}), store false (${unkeptStatus})`, kept.id === first.id &&
   kept.output.find((i) => i.type === 'message').content[0].text === first.output_text && gone === 404 && unkeptStatus === 404 && unkept.store === false);
for (const [what, body, status] of [
  ['an unknown previous_response_id', { previous_response_id: 'resp_x', input: 'hi' }, 404],
  ['a hosted tool', { input: 'hi', tools: [{ type: 'web_search' }] }, 400],
  ['an image input', { input: [{ role: 'user', content: [{ type: 'input_image', image_url: 'x' }] }] }, 400]]) {
  try {
    await client.responses.create({ model: name, ...body });
    ok(`${what} refused`, false);
  } catch (e) {
    ok(`${what} refused: ${e.status} ${e.error?.param}: ${e.error?.message}`, e.status === status);
  }
}
console.log(out.join('\n'));
EOF
PORT=$port2 node responses.mjs >responses.out 2>&1 || true
cat responses.out
grep -q '^FAIL' responses.out && fail "the OpenAI client disagreed on the Responses API (above)"
[ "$(grep -c "^ok" responses.out)" -ge 11 ] || fail "the Responses script did not finish: $(tail -n 8 responses.out)"
finish
