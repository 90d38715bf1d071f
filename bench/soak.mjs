// Soak test for `deepinfer serve`: normal chat traffic (streaming and not) mixed with the abuses of
// a hostile client for N minutes, then a report: requests, errors by kind, max /health latency,
// server RSS start / peak / end, and KV pages still in use once the load is gone (must be 0).
//
//   node bench/soak.mjs [--minutes 10] [--bin build/deepinfer] [--model DIR] [--api-key KEY]
//        [--url http://127.0.0.1:8000 --pid PID] [--skip deep_nesting,many_keys,...] [--json out.json]
//        [--server-args "--no-prefix-cache ..."] [--clients 4] [--flood-connections 32] [--slowloris 64]
//
// Without --url it starts `BIN serve [DIR] --port 0 --api-key KEY` (default: the built-in tiny model,
// key "soak-key") and stops it with SIGTERM at the end. With --url it uses a running server; RSS
// needs its --pid. Node >= 18, built-ins only (fetch, net). Exit status 1 when a normal request
// failed, the server died, a page leaked or /health stopped answering.
//
// Abuses (names for --skip): deep_nesting (21,700-level tool schema), many_keys (300k keys in an ignored
// field), auth_flood (8 MiB bodies with a wrong key; only with a key), slowloris (headers one byte at
// a time), aborted_stream (disconnect after the first chunk), non_reading (streams never read),
// http10_stream (HTTP/1.0 streaming: no chunked encoding allowed), chunked_split (an empty chunked body
// whose final chunk arrives in pieces), malformed (bad JSON / UTF-8 / types).

import { spawn } from 'node:child_process';
import { readFileSync } from 'node:fs';
import net from 'node:net';

function arg(name, def) {
  const i = process.argv.indexOf('--' + name);
  return i > 0 && i + 1 < process.argv.length ? process.argv[i + 1] : def;
}
const minutes = Number(arg('minutes', 10));
const bin = arg('bin', 'build/deepinfer');
const modelDir = arg('model', '');
let url = arg('url', '');
let pid = Number(arg('pid', 0));
const apiKey = arg('api-key', url ? '' : 'soak-key');
const skip = new Set(arg('skip', '').split(',').filter(Boolean));
const jsonOut = arg('json', '');
const normalClients = Number(arg('clients', 4));
const floodConns = Number(arg('flood-connections', 32));
const floodMiB = Number(arg('flood-mib', 8));
const manyKeys = Number(arg('many-keys', 300000));
const nestDepth = Number(arg('nest-depth', 21700));
const slowlorisConns = Number(arg('slowloris', 64));
const serverArgs = arg('server-args', '').split(' ').filter(Boolean);

// ---- bookkeeping -----------------------------------------------------------------------------------
const stats = { requests: {}, ok: {}, errors: {} };
function count(kind) { stats.requests[kind] = (stats.requests[kind] || 0) + 1; }
function ok(kind) { stats.ok[kind] = (stats.ok[kind] || 0) + 1; }
function err(kind, what) {
  const key = `${kind}: ${String(what).slice(0, 120)}`;
  stats.errors[key] = (stats.errors[key] || 0) + 1;
}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
let stopping = false;
let serverDied = '';

// ---- the server --------------------------------------------------------------------------------------
let child = null;
let serverLog = '';
async function startServer() {
  const args = ['serve'];
  if (modelDir) args.push(modelDir);
  args.push('--port', '0');
  if (apiKey) args.push('--api-key', apiKey);
  args.push(...serverArgs);
  child = spawn(bin, args, { stdio: ['ignore', 'pipe', 'pipe'] });
  pid = child.pid;
  const onData = (d) => { serverLog = (serverLog + d.toString()).slice(-20000); };
  child.stdout.on('data', onData);
  child.stderr.on('data', onData);
  child.on('exit', (code, sig) => {
    if (!stopping) serverDied = `server exited during the soak (code ${code}, signal ${sig})`;
  });
  for (let i = 0; i < 6000 && !url; i++) {
    const m = serverLog.match(/listening on (http:\/\/127\.0\.0\.1:\d+)/);
    if (m) url = m[1];
    else await sleep(50);
    if (serverDied) break;
  }
  if (!url) throw new Error('server did not start listening:\n' + serverLog);
}

async function waitHealthy(seconds) {
  for (let i = 0; i < seconds * 10; i++) {
    try {
      const r = await fetch(url + '/health');
      if (r.status === 200) return;
    } catch {}
    await sleep(100);
  }
  throw new Error('server not healthy after ' + seconds + ' s:\n' + serverLog);
}

function rssKiB() {
  if (!pid) return 0;
  try {
    const m = readFileSync(`/proc/${pid}/status`, 'utf8').match(/VmRSS:\s+(\d+)/);
    return m ? Number(m[1]) : 0;
  } catch { return 0; }
}

async function metrics() {
  const r = await fetch(url + '/metrics', { headers: apiKey ? { Authorization: 'Bearer ' + apiKey } : {} });
  const text = await r.text();
  const out = {};
  for (const line of text.split('\n')) {
    const m = line.match(/^(deepinfer_[a-z_]+)(?:\{[^}]*\})?\s+([-0-9.eE+]+)$/);
    if (m && !line.includes('{')) out[m[1]] = Number(m[2]);
  }
  return out;
}

// ---- clients -----------------------------------------------------------------------------------------
const auth = apiKey ? { Authorization: 'Bearer ' + apiKey } : {};
const jsonHeaders = { 'Content-Type': 'application/json', ...auth };
const words = ['alpha', 'bravo', 'charlie', 'delta', 'echo', 'foxtrot', 'golf', 'hotel', 'india', 'juliet'];
function prompt(i) {
  const out = [`Soak ${i}:`];
  for (let k = 0; k < 12 + (i % 20); k++) out.push(words[(i * 7 + k * 3) % words.length]);
  return out.join(' ');
}
let seq = 0;

async function chatOnce(stream) {
  const kind = stream ? 'chat_stream' : 'chat';
  const i = seq++;
  count(kind);
  const body = { messages: [{ role: 'user', content: prompt(i) }], max_tokens: 8 + (i % 24), temperature: i % 2 ? 0 : 0.8, seed: i, stream };
  if (stream) body.stream_options = { include_usage: true };
  try {
    const res = await fetch(url + '/v1/chat/completions', { method: 'POST', headers: jsonHeaders, body: JSON.stringify(body), signal: AbortSignal.timeout(120000) });
    if (res.status !== 200) return err(kind, `HTTP ${res.status} ${(await res.text()).slice(0, 80)}`);
    if (!stream) {
      const j = await res.json();
      if (!j.choices?.[0]?.finish_reason) return err(kind, 'no finish_reason');
      if (!['stop', 'length', 'tool_calls'].includes(j.choices[0].finish_reason)) return err(kind, 'finish_reason ' + j.choices[0].finish_reason);
      return ok(kind);
    }
    const text = await res.text();
    const events = text.split('\n\n').filter((e) => e.startsWith('data: ')).map((e) => e.slice(6));
    if (events[events.length - 1] !== '[DONE]') return err(kind, 'no [DONE]');
    let finish = '';
    for (const e of events.slice(0, -1)) {
      const j = JSON.parse(e);
      if (j.error) return err(kind, 'stream error ' + j.error.message);
      finish = j.choices?.[0]?.finish_reason || finish;
    }
    if (!['stop', 'length'].includes(finish)) return err(kind, 'finish_reason ' + (finish || 'missing'));
    ok(kind);
  } catch (e) {
    err(kind, e.cause?.code || e.name || e.message);
    await sleep(200);  // a dead or refusing server must not turn this into a busy loop
  }
}

async function expectStatus(kind, body, statuses, { headers = jsonHeaders, slowMs = 5000 } = {}) {
  count(kind);
  const t0 = performance.now();
  try {
    const res = await fetch(url + '/v1/chat/completions', { method: 'POST', headers, body, signal: AbortSignal.timeout(60000) });
    await res.arrayBuffer();
    const ms = performance.now() - t0;
    if (!statuses.includes(res.status)) return err(kind, `HTTP ${res.status}`);
    if (ms > slowMs) return err(kind, `answered after ${(ms / 1000).toFixed(1)} s`);
    ok(kind);
  } catch (e) {
    err(kind, e.cause?.code || e.name || e.message);
  }
}

function deepNestingBody() {
  // tools[0].function.parameters nested `nestDepth` objects deep (~130 KB at 21,700): issue 28's crash.
  const params = '{"a":'.repeat(nestDepth) + '1' + '}'.repeat(nestDepth);
  return `{"messages":[{"role":"user","content":"hi"}],"max_tokens":4,"tools":[{"type":"function","function":{"name":"f","parameters":${params}}}]}`;
}
function manyKeysBody() {
  const parts = [];
  for (let k = 0; k < manyKeys; k++) parts.push(`"k${k}":${k & 7}`);
  return `{"messages":[{"role":"user","content":"hi"}],"max_tokens":4,"metadata_ignored":{${parts.join(',')}}}`;
}
const malformedBodies = [
  '{"messages": [', '[]', '{"messages": "x"}', '{"messages": [{"role": "wizard", "content": "x"}]}',
  Buffer.from([0x7b, 0x22, 0xff, 0x22, 0x3a, 0x31, 0x7d]), '{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
  '{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', '{"messages":[{"role":"user","content":"x"}]} trailing',
];

// Raw socket: writes `head` then `body` (in pieces), resolves with the bytes received (until close or
// `untilMs`). The server may answer and close before the body is all sent: that is fine.
function rawExchange(head, { body = null, bodyBytes = 0, untilMs = 60000, stopAt = null, read = true } = {}) {
  return new Promise((resolve) => {
    const u = new URL(url);
    const sock = net.connect(Number(u.port), u.hostname);
    let got = Buffer.alloc(0);
    let finished = false;
    const done = (why) => {
      if (finished) return;
      finished = true;
      clearTimeout(timer);
      sock.destroy();
      resolve({ data: got.toString('latin1'), why });
    };
    const timer = setTimeout(() => done('timeout'), untilMs);
    sock.on('error', (e) => done(e.code || 'error'));
    sock.on('close', () => done('closed'));
    sock.on('data', (d) => {
      got = Buffer.concat([got, d]);
      if (stopAt && got.toString('latin1').includes(stopAt)) done('stopAt');
    });
    if (!read) sock.pause();
    sock.on('connect', async () => {
      sock.write(head);
      if (body) sock.write(body);
      if (bodyBytes) {
        const piece = Buffer.alloc(1 << 16, 0x61);
        for (let sent = 0; sent < bodyBytes && !finished; sent += piece.length) {
          if (!sock.write(piece)) await new Promise((r) => { sock.once('drain', r); setTimeout(r, 2000); });
        }
      }
    });
  });
}

function request(method, path, body, extra = '', version = '1.1') {
  const b = body ? Buffer.from(body) : Buffer.alloc(0);
  const authLine = apiKey ? `Authorization: Bearer ${apiKey}\r\n` : '';
  return `${method} ${path} HTTP/${version}\r\nHost: soak\r\n${authLine}Content-Type: application/json\r\nContent-Length: ${b.length}\r\n${extra}\r\n` + b.toString('latin1');
}

const abuses = {
  async deep_nesting() {
    await expectStatus('deep_nesting', deepNestingBody(), [400]);
    await sleep(2000);
  },
  async many_keys() {
    await expectStatus('many_keys', manyKeysBody(), [200, 400, 413]);
    await sleep(2000);
  },
  async auth_flood() {
    if (!apiKey) return sleep(60000);
    const kind = 'auth_flood';
    const bytes = floodMiB << 20;
    const head = `POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nAuthorization: Bearer wrong-key\r\nContent-Type: application/json\r\nContent-Length: ${bytes}\r\n\r\n`;
    await Promise.all(Array.from({ length: floodConns }, async () => {
      count(kind);
      const r = await rawExchange(head, { bodyBytes: bytes, untilMs: 60000, stopAt: '\r\n\r\n' });
      if (/^HTTP\/1\.[01] 401/.test(r.data)) ok(kind);
      else err(kind, r.data ? r.data.split('\r\n')[0] : 'no answer (' + r.why + ')');
    }));
    await sleep(5000);
  },
  async slowloris() {
    // Many connections dribbling a header; the server must not let them starve /health (polled
    // separately). Counted as ok when the server closes them or they survive their time.
    const kind = 'slowloris';
    await Promise.all(Array.from({ length: slowlorisConns }, () => new Promise((resolve) => {
      count(kind);
      const u = new URL(url);
      const sock = net.connect(Number(u.port), u.hostname);
      const text = 'GET /health HTTP/1.1\r\nHost: soak\r\nX-Slow: ' + 'a'.repeat(200);
      let i = 0;
      const tick = setInterval(() => {
        if (stopping || i >= text.length) { clearInterval(tick); sock.destroy(); ok(kind); return resolve(); }
        sock.write(text[i++]);
      }, 1000);
      sock.on('error', () => {});
      sock.on('close', () => { clearInterval(tick); if (i < text.length && !stopping) ok(kind); resolve(); });
      setTimeout(() => { clearInterval(tick); sock.destroy(); }, 60000);
    })));
  },
  async aborted_stream() {
    const kind = 'aborted_stream';
    count(kind);
    const body = JSON.stringify({ messages: [{ role: 'user', content: prompt(seq++) }], max_tokens: 200, stream: true, ignore_eos: true });
    const r = await rawExchange(request('POST', '/v1/chat/completions', body), { stopAt: 'data: ', untilMs: 60000 });
    if (/^HTTP\/1\.1 200/.test(r.data)) ok(kind);
    else err(kind, r.data ? r.data.split('\r\n')[0] : 'no answer (' + r.why + ')');
    await sleep(300);
  },
  async non_reading() {
    const kind = 'non_reading';
    await Promise.all(Array.from({ length: 4 }, async () => {
      count(kind);
      const body = JSON.stringify({ messages: [{ role: 'user', content: prompt(seq++) }], max_tokens: 2000, stream: true, ignore_eos: true });
      await rawExchange(request('POST', '/v1/chat/completions', body), { read: false, untilMs: 20000 });
      ok(kind);  // judged by the server's health, RSS and pages, not by this client
    }));
  },
  async http10_stream() {
    const kind = 'http10_stream';
    count(kind);
    const body = JSON.stringify({ messages: [{ role: 'user', content: prompt(seq++) }], max_tokens: 12, stream: true });
    const r = await rawExchange(request('POST', '/v1/chat/completions', body, '', '1.0'), { untilMs: 60000 });
    const [head, ...rest] = r.data.split('\r\n\r\n');
    if (!/^HTTP\/1\.[01] 200/.test(head)) return err(kind, head.split('\r\n')[0] || 'no answer (' + r.why + ')');
    if (/transfer-encoding:\s*chunked/i.test(head)) return err(kind, 'chunked encoding sent to an HTTP/1.0 client');
    if (!rest.join('\r\n\r\n').includes('data: [DONE]')) return err(kind, 'no [DONE] before close');
    ok(kind);
    await sleep(500);
  },
  async chunked_split() {
    // An empty chunked body whose final chunk comes in pieces: once aborted the server inside Beast.
    const kind = 'chunked_split';
    count(kind);
    const u = new URL(url);
    const r = await new Promise((resolve) => {
      const sock = net.connect(Number(u.port), u.hostname);
      sock.setNoDelay(true);
      let got = '';
      const pieces = [`POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\n${apiKey ? `Authorization: Bearer ${apiKey}\r\n` : ''}` +
                      'Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n0', '\r\n', '\r', '\n'];
      const timer = setTimeout(() => { sock.destroy(); resolve(got || 'no answer (timeout)'); }, 30000);
      sock.on('data', (d) => { got += d.toString('latin1'); if (got.includes('\r\n\r\n')) { clearTimeout(timer); sock.destroy(); resolve(got); } });
      sock.on('error', (e) => { clearTimeout(timer); resolve(got || 'no answer (' + e.code + ')'); });
      sock.on('connect', async () => {
        for (const p of pieces) { sock.write(p); await sleep(100); }
      });
    });
    if (/^HTTP\/1\.1 400/.test(r)) ok(kind);
    else err(kind, r.split('\r\n')[0]);
    await sleep(1000);
  },
  async malformed() {
    for (const b of malformedBodies) await expectStatus('malformed', b, [400]);
    await sleep(1000);
  },
};

async function loop(fn) {
  while (!stopping && !serverDied) await fn();
}

// ---- health poller and RSS sampler ------------------------------------------------------------------
const health = { polls: 0, failures: 0, maxMs: 0 };
async function healthLoop() {
  while (!stopping) {
    const t0 = performance.now();
    try {
      const r = await fetch(url + '/health', { signal: AbortSignal.timeout(120000) });
      await r.arrayBuffer();
      if (r.status !== 200) health.failures++;
    } catch { health.failures++; }
    health.polls++;
    health.maxMs = Math.max(health.maxMs, performance.now() - t0);
    await sleep(250);
  }
}
const rss = { start: 0, peak: 0, end: 0 };
async function rssLoop() {
  while (!stopping) {
    rss.peak = Math.max(rss.peak, rssKiB());
    await sleep(500);
  }
}

// ---- main --------------------------------------------------------------------------------------------
if (!url) await startServer();
await waitHealthy(600);
// Warm up (first requests allocate caches) before the RSS baseline.
for (let i = 0; i < 4; i++) await chatOnce(i % 2 === 0);
stats.requests = {}; stats.ok = {}; stats.errors = {};
rss.start = rssKiB();
rss.peak = rss.start;
const t0 = Date.now();
console.error(`soak: ${url} pid ${pid || '?'} for ${minutes} min; skipping: ${[...skip].join(',') || 'none'}`);

const tasks = [healthLoop(), rssLoop()];
const endAt = Date.now() + minutes * 60000;
const timer = setInterval(() => {
  if (Date.now() >= endAt || serverDied) stopping = true;
}, 200);
for (let c = 0; c < normalClients; c++) tasks.push(loop(() => chatOnce(c % 2 === 0)));
for (const [name, fn] of Object.entries(abuses)) if (!skip.has(name)) tasks.push(loop(fn));
const progress = setInterval(() => {
  const total = Object.values(stats.requests).reduce((a, b) => a + b, 0);
  console.error(`soak: ${((Date.now() - t0) / 1000).toFixed(0)} s, ${total} requests, RSS ${rssKiB()} KiB, max /health ${health.maxMs.toFixed(0)} ms`);
}, 30000);
await Promise.all(tasks);
clearInterval(timer);
clearInterval(progress);

// After the load: the engine must drain and give back every page it held for requests.
let m = {};
let leaked = null;
if (!serverDied) {
  for (let i = 0; i < 600; i++) {
    try {
      m = await metrics();
      if ((m.deepinfer_num_requests_running || 0) === 0 && (m.deepinfer_num_requests_waiting || 0) === 0) break;
    } catch {}
    await sleep(100);
  }
  await sleep(3000);  // let freed memory go back before the end RSS
  try { m = await metrics(); } catch {}
  // The prefix cache keeps pages on purpose (an entry holds one page per layer: compare bytes); any
  // other in-use page belongs to a request and must be gone. Pages are sized alike within the pool.
  if ('deepinfer_cache_pages_used' in m) {
    const used = m.deepinfer_cache_bytes_used || 0, held = m.deepinfer_prefix_cache_bytes || 0;
    const pageBytes = m.deepinfer_cache_pages_used > 0 ? used / m.deepinfer_cache_pages_used : 1;
    leaked = Math.round((used - held) / pageBytes);
  }
  rss.end = rssKiB();
}
stopping = true;

const total = Object.values(stats.requests).reduce((a, b) => a + b, 0);
const report = {
  url, minutes, skipped: [...skip],
  requests: total, requests_by_kind: stats.requests, ok_by_kind: stats.ok, errors_by_kind: stats.errors,
  health_polls: health.polls, health_failures: health.failures, max_health_latency_ms: Math.round(health.maxMs),
  rss_kib: rss, leaked_pages: leaked,
  engine_after: { running: m.deepinfer_num_requests_running, waiting: m.deepinfer_num_requests_waiting,
                  pages_used: m.deepinfer_cache_pages_used, cache_bytes_used: m.deepinfer_cache_bytes_used,
                  prefix_cache_bytes: m.deepinfer_prefix_cache_bytes, state_bytes_used: m.deepinfer_state_bytes_used },
  server_died: serverDied || null,
};

let exitStatus = 0;
if (child) {
  child.kill('SIGTERM');
  const code = await new Promise((r) => {
    if (child.exitCode !== null) return r(child.exitCode);
    const t = setTimeout(() => { child.kill('SIGKILL'); r('killed after 30 s'); }, 30000);
    child.on('exit', (c, s) => { clearTimeout(t); r(c ?? s); });
  });
  report.server_exit = code;
}
const normalErrors = Object.keys(stats.errors).filter((k) => k.startsWith('chat')).length;
if (serverDied || leaked !== 0 || (m.deepinfer_state_bytes_used || 0) !== 0 || normalErrors > 0 || health.failures > 0) exitStatus = 1;

console.log(`requests            ${total}  (${Object.entries(stats.requests).map(([k, v]) => `${k} ${v}`).join(', ')})`);
console.log(`errors by kind      ${Object.keys(stats.errors).length ? '' : 'none'}`);
for (const [k, v] of Object.entries(stats.errors).sort((a, b) => b[1] - a[1])) console.log(`  ${String(v).padStart(6)}  ${k}`);
console.log(`/health             ${health.polls} polls, ${health.failures} failed, max latency ${Math.round(health.maxMs)} ms`);
console.log(`server RSS          start ${(rss.start / 1024).toFixed(0)} MiB, peak ${(rss.peak / 1024).toFixed(0)} MiB, end ${(rss.end / 1024).toFixed(0)} MiB`);
console.log(`leaked pages        ${leaked === null ? 'unknown' : leaked}  (pages in use ${m.deepinfer_cache_pages_used ?? '?'}: ` +
            `${m.deepinfer_cache_bytes_used ?? '?'} B, of which the prefix cache holds ${m.deepinfer_prefix_cache_bytes ?? '?'} B; ` +
            `sequence state ${m.deepinfer_state_bytes_used ?? '?'} B)`);
if (serverDied) console.log(`SERVER DIED         ${serverDied}\n${serverLog.slice(-3000)}`);
if (jsonOut) (await import('node:fs')).writeFileSync(jsonOut, JSON.stringify(report, null, 2) + '\n');
process.exit(exitStatus);
