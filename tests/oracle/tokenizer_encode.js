#!/usr/bin/env node
// Encodes texts with Hugging Face's Rust tokenizer (npm tokenizers@0.23.2) for live checks.
//
//   node tests/oracle/tokenizer_encode.js TOKENIZER_JSON < texts.jsonl > out.jsonl
//
// Input lines {"text": ...}; output lines {"ids": [...], "tokens": {content: id}} where "tokens"
// (first line only) maps each added-token content to the id HF gave it.
'use strict';
const fs = require('fs');
const path = require('path');
const repo = path.resolve(__dirname, '..', '..');
const { Tokenizer } = require(path.join(repo, 'third_party/npm/node_modules/tokenizers'));

(async () => {
  const json = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));
  const tok = Tokenizer.fromString(JSON.stringify(json));
  const tokens = {};
  for (const t of json.added_tokens) tokens[t.content] = tok.tokenToId(t.content);
  const lines = fs.readFileSync(0, 'utf8').split('\n').filter((l) => l.length > 0);
  const out = [];
  for (let i = 0; i < lines.length; i++) {
    const ids = (await tok.encode(JSON.parse(lines[i]).text, null, { addSpecialTokens: false })).getIds();
    out.push(JSON.stringify(i === 0 ? { ids, tokens } : { ids }));
  }
  process.stdout.write(out.join('\n') + '\n');
})().catch((e) => { console.error(e); process.exit(1); });
