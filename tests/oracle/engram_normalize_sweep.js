// Oracle for the Engram normalizer chain on every single code point: HF's Rust normalizers
// (npm `tokenizers`) run NFKC, NFD, StripAccents, Lowercase, Replace, Strip exactly as engram.py
// builds them. Prints one line per code point whose result differs from the input:
// "<hex code point>\t<hex code points of the result, space-separated, or '-' when empty>".
// Usage: node engram_normalize_sweep.js TOKENIZER_JSON [NODE_MODULES_DIR]
'use strict';
const path = require('path');
const fs = require('fs');
const [tokPath, modulesDir] = process.argv.slice(2);
if (!tokPath) { console.error('usage: node engram_normalize_sweep.js TOKENIZER_JSON [NODE_MODULES_DIR]'); process.exit(2); }
const { Tokenizer } = require(path.join(modulesDir || path.join(__dirname, '../../third_party/npm/node_modules'), 'tokenizers'));

const sentinel = '\ue000';
const shell = JSON.parse(fs.readFileSync(tokPath, 'utf8'));
shell.normalizer = {
  type: 'Sequence', normalizers: [
    { type: 'NFKC' }, { type: 'NFD' }, { type: 'StripAccents' }, { type: 'Lowercase' },
    { type: 'Replace', pattern: { Regex: '[ \t\r\n]+' }, content: ' ' },
    { type: 'Replace', pattern: { Regex: '^ $' }, content: sentinel },
    { type: 'Strip', strip_left: true, strip_right: true },
    { type: 'Replace', pattern: { String: sentinel }, content: ' ' },
  ],
};
const normalizer = Tokenizer.fromString(JSON.stringify(shell)).getNormalizer();
const out = [];
for (let cp = 0; cp <= 0x10ffff; cp++) {
  if (cp >= 0xd800 && cp <= 0xdfff) continue;
  const s = String.fromCodePoint(cp);
  const r = normalizer.normalizeString(s);
  if (r === s) continue;
  const cps = Array.from(r, (c) => c.codePointAt(0).toString(16));
  out.push(cp.toString(16) + '\t' + (cps.length ? cps.join(' ') : '-'));
}
process.stdout.write(out.join('\n') + '\n');
