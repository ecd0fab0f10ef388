#!/bin/sh
# tests/openai_client.sh - `loom serve` driven by the official OpenAI client (the npm `openai`
# package, the same request and response shapes as the Python one): completions, chat, both
# streamed, n > 1, an error surfacing as the client's typed exception. Skipped when node/npm
# are missing or the npm registry cannot be reached (it is the only registry CI can use).
. "$top_srcdir/tests/lib.sh"
MODEL=$FIXTURES/stories260K/original/stories260K.gguf
need_fixture "$MODEL"
command -v node >/dev/null && command -v npm >/dev/null ||
    { echo "SKIP: node and npm are not installed (apt-get install nodejs npm)"; exit 77; }
cd "$tmpdir" || exit 1
if ! timeout 180 npm install --silent --no-audit --no-fund openai@4 >npm.log 2>&1; then
    echo "SKIP: cannot install the openai npm package (no registry?):"; tail -n 3 npm.log; exit 77
fi
"$LOOM" serve -m "$MODEL" --port 0 --api-key k3y -c 512 >server.log 2>&1 &
PID=$!
trap 'kill -TERM $PID 2>/dev/null; rm -rf "$tmpdir"' EXIT
for _ in $(seq 100); do
    port=$(sed -n 's/.*listening on http:\/\/[0-9.]*:\([0-9][0-9]*\).*/\1/p' server.log)
    [ -n "$port" ] && break
    sleep 0.1
done
[ -n "$port" ] || { fail "server did not start: $(cat server.log)"; finish; }

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
[ "$(grep -c "^ok" client.out)" -ge 9 ] || fail "the client script did not finish: $(tail -n 5 client.out)"
finish
