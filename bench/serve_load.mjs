// Load generator for `deepinfer serve`: N concurrent streaming clients for a bounded time (or a
// number of requests), each sending the next request as soon as its previous one finishes.
// Prints one JSON object: requests, errors, request/s, output tok/s, TTFT / TPOT medians and p99.
//
//   node bench/serve_load.mjs --url http://127.0.0.1:8000 [--model NAME] [--concurrency 8]
//        [--duration 20 | --requests N] [--max-tokens 64] [--prompt-words 32] [--endpoint chat|completions]
//
// Uses only Node's built-in fetch (Node >= 18). TTFT: request sent -> first SSE chunk with text;
// TPOT: (last chunk - first chunk) / (completion tokens - 1), completion tokens from include_usage.

function arg(name, def) {
  const i = process.argv.indexOf('--' + name);
  return i > 0 && i + 1 < process.argv.length ? process.argv[i + 1] : def;
}
const url = arg('url', 'http://127.0.0.1:8000');
const concurrency = Number(arg('concurrency', 8));
const duration = Number(arg('duration', 0));
const maxRequests = Number(arg('requests', duration > 0 ? 0 : concurrency * 4));
const maxTokens = Number(arg('max-tokens', 64));
const promptWords = Number(arg('prompt-words', 32));
const endpoint = arg('endpoint', 'completions');
const apiKey = arg('api-key', '');
let model = arg('model', '');

const headers = { 'Content-Type': 'application/json' };
if (apiKey) headers.Authorization = 'Bearer ' + apiKey;

const words = ['alpha', 'bravo', 'charlie', 'delta', 'echo', 'foxtrot', 'golf', 'hotel', 'india', 'juliet', 'kilo', 'lima'];
function prompt(i) {
  // Distinct prompts (a per-request prefix) so the prefix cache does not make later requests trivial.
  const out = [`Request ${i}:`];
  for (let k = 0; k < promptWords; k++) out.push(words[(i * 7 + k * 3) % words.length]);
  return out.join(' ');
}

async function one(i) {
  const body = { model, max_tokens: maxTokens, stream: true, stream_options: { include_usage: true }, temperature: 0, ignore_eos: true };
  if (endpoint === 'chat') body.messages = [{ role: 'user', content: prompt(i) }];
  else body.prompt = prompt(i);
  const t0 = performance.now();
  const res = await fetch(`${url}/v1/${endpoint === 'chat' ? 'chat/completions' : 'completions'}`, { method: 'POST', headers, body: JSON.stringify(body) });
  if (res.status !== 200) throw new Error(`HTTP ${res.status}: ${await res.text()}`);
  const decoder = new TextDecoder();
  let buf = '', first = 0, last = 0, tokens = 0, done = false;
  for await (const piece of res.body) {
    buf += decoder.decode(piece, { stream: true });
    let sep;
    while ((sep = buf.indexOf('\n\n')) >= 0) {
      const ev = buf.slice(0, sep);
      buf = buf.slice(sep + 2);
      if (!ev.startsWith('data: ')) continue;
      const data = ev.slice(6);
      if (data === '[DONE]') { done = true; continue; }
      const j = JSON.parse(data);
      if (j.error) throw new Error('stream error: ' + JSON.stringify(j.error));
      if (j.usage) tokens = j.usage.completion_tokens;
      if (j.choices?.length) {
        const now = performance.now();
        if (!first) first = now;
        last = now;
      }
    }
  }
  if (!done) throw new Error('stream ended without [DONE]');
  return { ttft: (first - t0) / 1000, tpot: tokens > 1 ? (last - first) / 1000 / (tokens - 1) : null, tokens, e2e: (performance.now() - t0) / 1000 };
}

function pct(xs, p) {
  if (!xs.length) return null;
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))];
}

async function main() {
  if (!model) {
    const r = await fetch(`${url}/v1/models`, { headers });
    model = (await r.json()).data[0].id;
  }
  const results = [];
  const errors = [];
  let started = 0;
  const t0 = performance.now();
  const deadline = duration > 0 ? t0 + duration * 1000 : Infinity;
  async function worker() {
    while (performance.now() < deadline && (maxRequests === 0 || started < maxRequests)) {
      const i = started++;
      try {
        results.push(await one(i));
      } catch (e) {
        errors.push(String(e.message ?? e));
      }
    }
  }
  await Promise.all(Array.from({ length: concurrency }, worker));
  const wall = (performance.now() - t0) / 1000;
  const tokens = results.reduce((a, r) => a + r.tokens, 0);
  const ttft = results.map((r) => r.ttft), tpot = results.map((r) => r.tpot).filter((x) => x !== null);
  console.log(JSON.stringify({
    endpoint, concurrency, max_tokens: maxTokens, requests: results.length, errors: errors.length, first_errors: errors.slice(0, 3),
    duration_s: +wall.toFixed(3), request_per_s: +(results.length / wall).toFixed(4), output_tok_per_s: +(tokens / wall).toFixed(2),
    ttft_median_s: pct(ttft, 50), ttft_p99_s: pct(ttft, 99), tpot_median_s: pct(tpot, 50), tpot_p99_s: pct(tpot, 99),
    e2e_median_s: pct(results.map((r) => r.e2e), 50),
  }));
  process.exit(errors.length ? 1 : 0);
}

main().catch((e) => { console.error(e); process.exit(2); });
