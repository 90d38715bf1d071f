// SIGTERM drain seen through the real `openai` npm client.
// Usage: node tests/e2e/shutdown_drain.mjs BASE_URL MODEL SERVER_PID GRACE_S
// The server runs with --shutdown-timeout GRACE_S. While requests are in flight this script sends
// the server SIGTERM and checks: a request that fits in the grace period finishes normally; an
// endless stream ends with an OpenAI error event (the client throws an APIError); an endless
// non-streaming request gets a 503 error object; the listener refuses new connections.
// Prints one line per check; exits 1 on failure.
import { createRequire } from 'node:module';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import assert from 'node:assert/strict';

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..');
const require = createRequire(path.join(root, 'third_party/npm/package.json'));
const { OpenAI, APIError, APIConnectionError } = require('openai');

const [baseURL, model, pidArg, graceArg] = process.argv.slice(2);
const pid = Number(pidArg), grace = Number(graceArg);
const client = new OpenAI({ baseURL: baseURL + '/v1', apiKey: 'unused', maxRetries: 0, timeout: 60000 });
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const endless = { model, max_tokens: 100000, ignore_eos: true };

// 1. An endless stream.
const stream = await client.chat.completions.create({ ...endless, messages: [{ role: 'user', content: 'count' }], stream: true });
let chunks = 0, streamError = null, sawFinish = false;
const streamDone = (async () => {
  try {
    for await (const c of stream) {
      ++chunks;
      if (c.choices?.[0]?.finish_reason) sawFinish = true;
    }
  } catch (e) {
    streamError = e;
  }
})();
while (chunks < 5) await sleep(10);

// 2. An endless non-streaming request.
const blocking = client.completions.create({ ...endless, prompt: 'one two' }).then(
  (r) => ({ ok: r }), (e) => ({ err: e }));
// 3. A request far shorter than the grace period, even on a loaded machine.
const shortTokens = 8;
const short = client.completions.create({ model, prompt: 'three four', max_tokens: shortTokens, ignore_eos: true }).then(
  (r) => ({ ok: r }), (e) => ({ err: e }));
await sleep(50);

const tKill = Date.now();
process.kill(pid, 'SIGTERM');
await sleep(200);

let failures = 0;
const check = async (name, fn) => {
  try {
    await fn();
    console.log('ok   ' + name);
  } catch (e) {
    ++failures;
    console.log('FAIL ' + name + ': ' + (e.stack || e));
  }
};

await check('new connections are refused while draining', async () => {
  await assert.rejects(client.models.list(), (e) => e instanceof APIConnectionError);
});
await check(`a request that fits in the grace period finishes normally (${shortTokens} tokens)`, async () => {
  const r = await short;
  assert.ok(r.ok, String(r.err));
  assert.equal(r.ok.choices[0].finish_reason, 'length');
  assert.equal(r.ok.usage.completion_tokens, shortTokens);
});
await check('an endless stream ends with an OpenAI error event after the grace period', async () => {
  await streamDone;
  const waited = (Date.now() - tKill) / 1000;
  assert.ok(streamError instanceof APIError, 'expected APIError, got ' + streamError);
  assert.match(String(streamError.message), /shut down/);
  assert.ok(!sawFinish, 'no chunk may carry a finish_reason');
  assert.ok(waited >= grace * 0.9, `ended after ${waited} s, before the ${grace} s grace period`);
});
await check('an endless non-streaming request gets a 503 error object', async () => {
  const r = await blocking;
  assert.ok(r.err instanceof APIError, 'expected APIError, got ' + JSON.stringify(r.ok ?? r.err));
  assert.equal(r.err.status, 503);
  assert.equal(r.err.code, 'server_shutdown');
});
console.log(failures ? `${failures} checks failed` : 'all checks passed');
process.exit(failures ? 1 : 0);
