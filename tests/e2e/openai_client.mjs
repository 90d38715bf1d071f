// End-to-end checks of `deepinfer serve` with the real `openai` npm client (third_party/npm).
// Usage: node tests/e2e/openai_client.mjs BASE_URL MODEL API_KEY
// The server must run with --enable-test-hooks (tool calls are forced through `test_forced_output`,
// since a random tiny model never emits DSML by itself). Prints one line per check; exits 1 on failure.
import { createRequire } from 'node:module';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import assert from 'node:assert/strict';

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..');
const require = createRequire(path.join(root, 'third_party/npm/package.json'));
const { OpenAI } = require('openai');

const [baseURL, model, apiKey] = process.argv.slice(2);
const client = new OpenAI({ baseURL: baseURL + '/v1', apiKey, maxRetries: 0, timeout: 120000 });

// A system prompt longer than one cache page, so the second identical request hits the prefix cache.
const longSystem = 'You are a careful assistant. '.repeat(40);
const msgs = (q) => [{ role: 'system', content: longSystem }, { role: 'user', content: q }];

async function metrics() {
  const r = await fetch(baseURL + '/metrics');
  const text = await r.text();
  const out = {};
  for (const line of text.split('\n')) {
    if (!line || line.startsWith('#')) continue;
    const i = line.lastIndexOf(' ');
    out[line.slice(0, i)] = Number(line.slice(i + 1));
  }
  return out;
}

const checks = [];
const check = (name, fn) => checks.push([name, fn]);

check('models', async () => {
  const list = await client.models.list();
  assert.ok(list.data.some((m) => m.id === model), JSON.stringify(list.data));
});

let greedyChat;
check('chat non-streaming, usage, prefix cache', async () => {
  const a = await client.chat.completions.create({ model, messages: msgs('Say hi.'), max_tokens: 12, temperature: 0 });
  assert.equal(a.object, 'chat.completion');
  assert.equal(a.choices.length, 1);
  assert.equal(a.choices[0].message.role, 'assistant');
  assert.equal(typeof a.choices[0].message.content, 'string');
  assert.ok(['stop', 'length'].includes(a.choices[0].finish_reason));
  assert.ok(a.usage.prompt_tokens > 64, JSON.stringify(a.usage));
  assert.ok(a.usage.completion_tokens >= 1 && a.usage.completion_tokens <= 12);
  assert.equal(a.usage.total_tokens, a.usage.prompt_tokens + a.usage.completion_tokens);
  assert.equal(typeof a.usage.prompt_tokens_details.cached_tokens, 'number');
  const b = await client.chat.completions.create({ model, messages: msgs('Say hi.'), max_tokens: 12, temperature: 0 });
  assert.equal(b.choices[0].message.content, a.choices[0].message.content, 'greedy output differs between identical requests');
  assert.ok(b.usage.prompt_tokens_details.cached_tokens >= 64, 'second identical request: ' + JSON.stringify(b.usage));
  greedyChat = a;
});

check('chat streaming with include_usage equals non-streaming', async () => {
  const stream = await client.chat.completions.create({
    model, messages: msgs('Say hi.'), max_tokens: 12, temperature: 0, stream: true, stream_options: { include_usage: true },
  });
  let content = '', finish = null, usage = null, chunks = 0, role = false;
  for await (const chunk of stream) {
    chunks++;
    assert.equal(chunk.object, 'chat.completion.chunk');
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      if (c.delta.role) role = true;
      if (c.delta.content) content += c.delta.content;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  assert.ok(role && chunks > 2);
  assert.equal(content, greedyChat.choices[0].message.content);
  assert.equal(finish, greedyChat.choices[0].finish_reason);
  assert.ok(usage, 'no usage chunk');
  assert.equal(usage.completion_tokens, greedyChat.usage.completion_tokens);
  assert.equal(typeof usage.prompt_tokens_details.cached_tokens, 'number');
});

let greedyText;
check('completions: string and token prompts, echo, logprobs', async () => {
  const a = await client.completions.create({ model, prompt: 'The quick brown fox', max_tokens: 24, temperature: 0, ignore_eos: true });
  assert.equal(a.object, 'text_completion');
  assert.equal(a.choices[0].finish_reason, 'length');
  assert.equal(a.usage.completion_tokens, 24);
  greedyText = a.choices[0].text;
  const e = await client.completions.create({ model, prompt: 'The quick brown fox', max_tokens: 24, temperature: 0, echo: true, ignore_eos: true });
  assert.equal(e.choices[0].text, 'The quick brown fox' + greedyText);
  const l = await client.completions.create({ model, prompt: 'The quick brown fox', max_tokens: 5, temperature: 0, logprobs: 3, ignore_eos: true });
  const lp = l.choices[0].logprobs;
  assert.equal(lp.tokens.length, 5);
  assert.equal(lp.token_logprobs.length, 5);
  assert.equal(lp.top_logprobs.length, 5);
  for (let i = 0; i < 5; i++) {
    assert.ok(lp.token_logprobs[i] <= 0);
    assert.equal(Object.keys(lp.top_logprobs[i]).length, 3);
    // Greedy: the chosen token is the most likely one.
    const best = Math.max(...Object.values(lp.top_logprobs[i]));
    assert.ok(Math.abs(best - lp.token_logprobs[i]) < 1e-4, `token ${i}: ${lp.token_logprobs[i]} vs best ${best}`);
  }
  assert.equal(lp.tokens.join(''), greedyText.slice(0, lp.tokens.join('').length));
  const ids = await client.completions.create({ model, prompt: [0, 100, 200, 300], max_tokens: 3, temperature: 0 });
  assert.equal(ids.usage.prompt_tokens, 4);
});

check('chat logprobs', async () => {
  const r = await client.chat.completions.create({ model, messages: msgs('x'), max_tokens: 4, temperature: 0, logprobs: true, top_logprobs: 2, ignore_eos: true });
  const c = r.choices[0].logprobs.content;
  assert.equal(c.length, r.usage.completion_tokens);
  for (const t of c) {
    assert.equal(typeof t.token, 'string');
    assert.ok(Array.isArray(t.bytes));
    assert.equal(t.top_logprobs.length, 2);
  }
});

check('n > 1 and seed reproducibility', async () => {
  // top_k keeps sampling away from the ids the tokenizer does not define (the random tiny model gives
  // them ordinary logits, and the Engram token map has no entry for them).
  const req = { model, prompt: 'Once upon a time', max_tokens: 16, temperature: 1, top_k: 40, seed: 42, n: 3, ignore_eos: true };
  const a = await client.completions.create(req);
  assert.equal(a.choices.length, 3);
  assert.deepEqual(a.choices.map((c) => c.index).sort(), [0, 1, 2]);
  assert.equal(a.usage.completion_tokens, 48);
  const b = await client.completions.create(req);
  assert.deepEqual(b.choices.map((c) => c.text), a.choices.map((c) => c.text), 'same seed, different output');
  const c = await client.completions.create({ ...req, seed: 43 });
  assert.notDeepEqual(c.choices.map((x) => x.text), a.choices.map((x) => x.text), 'different seeds gave identical output');
  const chat = await client.chat.completions.create({ model, messages: msgs('Tell a story'), max_tokens: 8, temperature: 1, top_k: 40, seed: 7, n: 2 });
  assert.equal(chat.choices.length, 2);
  const chat2 = await client.chat.completions.create({ model, messages: msgs('Tell a story'), max_tokens: 8, temperature: 1, top_k: 40, seed: 7, n: 2 });
  assert.deepEqual(chat2.choices.map((c) => c.message.content), chat.choices.map((c) => c.message.content));
});

check('stop strings (non-streaming and streaming)', async () => {
  const chars = Array.from(greedyText);
  assert.ok(chars.length >= 10, 'greedy text too short: ' + JSON.stringify(greedyText));
  const stop = chars.slice(6, 9).join('');
  const expected = greedyText.slice(0, greedyText.indexOf(stop));
  const r = await client.completions.create({ model, prompt: 'The quick brown fox', max_tokens: 24, temperature: 0, stop: [stop], ignore_eos: true });
  assert.equal(r.choices[0].text, expected);
  assert.equal(r.choices[0].finish_reason, 'stop');
  const s = await client.completions.create({ model, prompt: 'The quick brown fox', max_tokens: 24, temperature: 0, stop, stream: true, ignore_eos: true });
  let text = '', finish = null;
  for await (const chunk of s) {
    for (const c of chunk.choices) {
      text += c.text;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  assert.equal(text, expected);
  assert.equal(finish, 'stop');
});

const toolForced =
  '<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n' +
  '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>';
const tools = [{ type: 'function', function: { name: 'get_weather', description: 'Weather', parameters: { type: 'object', properties: { city: { type: 'string' }, days: { type: 'integer' } } } } }];

check('tool calls (forced output), non-streaming and streaming', async () => {
  const r = await client.chat.completions.create({ model, messages: msgs('Weather in Paris?'), tools, test_forced_output: toolForced });
  const m = r.choices[0].message;
  assert.equal(r.choices[0].finish_reason, 'tool_calls');
  assert.equal(m.tool_calls.length, 1);
  assert.equal(m.tool_calls[0].type, 'function');
  assert.match(m.tool_calls[0].id, /^call_[A-Za-z0-9]{24}$/);
  assert.equal(m.tool_calls[0].function.name, 'get_weather');
  assert.deepEqual(JSON.parse(m.tool_calls[0].function.arguments), { city: 'Paris', days: 3 });
  const s = await client.chat.completions.create({ model, messages: msgs('Weather in Paris?'), tools, stream: true, test_forced_output: toolForced });
  const calls = [];
  let finish = null;
  for await (const chunk of s) {
    for (const c of chunk.choices) {
      for (const tc of c.delta.tool_calls ?? []) {
        if (!calls[tc.index]) calls[tc.index] = { name: '', args: '' };
        if (tc.function?.name) calls[tc.index].name += tc.function.name;
        if (tc.function?.arguments) calls[tc.index].args += tc.function.arguments;
      }
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  assert.equal(finish, 'tool_calls');
  assert.equal(calls.length, 1);
  assert.equal(calls[0].name, 'get_weather');
  assert.deepEqual(JSON.parse(calls[0].args), { city: 'Paris', days: 3 });
  // Reasoning goes to reasoning_content (thinking on).
  const t = await client.chat.completions.create({
    model, messages: msgs('2+2?'), reasoning_effort: 'high', test_forced_output: 'Add them.</think>4',
  });
  assert.equal(t.choices[0].message.reasoning_content, 'Add them.');
  assert.equal(t.choices[0].message.content, '4');
});

check('JSON mode (forced output) and streamed n > 1', async () => {
  // JSON mode constrains decoding (tests/test_server_structured.cpp); the content is never rewritten.
  const j = await client.chat.completions.create({
    model, messages: msgs('Give JSON'), response_format: { type: 'json_object' }, test_forced_output: '{"a": [1, 2]}',
  });
  assert.equal(j.choices[0].message.content, '{"a": [1, 2]}');
  const s = await client.chat.completions.create({
    model, messages: msgs('Count'), max_tokens: 6, temperature: 1, top_k: 40, seed: 3, n: 2, ignore_eos: true, stream: true,
    stream_options: { include_usage: true },
  });
  const text = ['', ''], finish = [null, null];
  let usage = null;
  for await (const chunk of s) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      if (c.delta.content) text[c.index] += c.delta.content;
      if (c.finish_reason) finish[c.index] = c.finish_reason;
    }
  }
  assert.deepEqual(finish, ['length', 'length']);
  assert.equal(usage.completion_tokens, 12);
  const whole = await client.chat.completions.create({
    model, messages: msgs('Count'), max_tokens: 6, temperature: 1, top_k: 40, seed: 3, n: 2, ignore_eos: true,
  });
  assert.deepEqual(whole.choices.map((c) => c.message.content), text, 'streamed n=2 differs from non-streamed with the same seed');
});

check('errors surface as OpenAI errors', async () => {
  await assert.rejects(client.chat.completions.create({ model: 'no-such-model', messages: msgs('x') }), (e) => e.status === 404);
  await assert.rejects(client.chat.completions.create({ model, messages: msgs('x'), temperature: 9 }),
    (e) => e.status === 400 && e.error?.param === 'temperature');
  await assert.rejects(client.completions.create({ model, prompt: 'x', suffix: 'y' }), (e) => e.status === 400 && e.error?.param === 'suffix');
});

check('cancellation by closing the stream', async () => {
  const before = await metrics();
  const cancelledBefore = before['deepinfer_request_finished_total{finish_reason="cancelled"}'] ?? 0;
  const stream = await client.chat.completions.create({ model, messages: msgs('Go on forever'), max_tokens: 400, ignore_eos: true, stream: true });
  let n = 0;
  for await (const _ of stream) {
    if (++n === 3) break;  // leaving the loop aborts the request and closes the connection
  }
  let m;
  for (let i = 0; i < 200; i++) {
    m = await metrics();
    if ((m['deepinfer_request_finished_total{finish_reason="cancelled"}'] ?? 0) > cancelledBefore && m.deepinfer_num_requests_running === 0) break;
    await new Promise((r) => setTimeout(r, 50));
  }
  assert.equal(m['deepinfer_request_finished_total{finish_reason="cancelled"}'], cancelledBefore + 1, 'cancel not counted');
  assert.equal(m.deepinfer_num_requests_running, 0, 'still running after cancel');
  assert.equal(m.deepinfer_num_requests_waiting, 0);
  // Pages back to the prefix-cache level: nothing but the prefix cache holds cache memory.
  for (let i = 0; i < 100 && m.deepinfer_cache_bytes_used !== m.deepinfer_prefix_cache_bytes; i++) {
    await new Promise((r) => setTimeout(r, 50));
    m = await metrics();
  }
  assert.equal(m.deepinfer_cache_bytes_used, m.deepinfer_prefix_cache_bytes, 'cache bytes beyond the prefix cache after cancel');
});

let failed = 0;
for (const [name, fn] of checks) {
  const t0 = Date.now();
  try {
    await fn();
    console.log(`ok   ${name} (${Date.now() - t0} ms)`);
  } catch (e) {
    failed++;
    console.log(`FAIL ${name}: ${e.stack ?? e}`);
  }
}
console.log(failed ? `${failed} of ${checks.length} checks failed` : `all ${checks.length} checks passed`);
process.exit(failed ? 1 : 0);
