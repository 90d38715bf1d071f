// Oracle for the Engram compressed token map: HF's Rust tokenizer (npm `tokenizers`) decodes every id
// alone and its normalizers run the chain the official engram.py uses. Prints the map as JSON:
// {"size": S, "map": [...]}.  Usage: node engram_token_map.js TOKENIZER_JSON [NODE_MODULES_DIR]
'use strict';
const path = require('path');
const fs = require('fs');
const [tokPath, modulesDir] = process.argv.slice(2);
if (!tokPath) { console.error('usage: node engram_token_map.js TOKENIZER_JSON [NODE_MODULES_DIR]'); process.exit(2); }
const { Tokenizer } = require(path.join(modulesDir || path.join(__dirname, '../../third_party/npm/node_modules'), 'tokenizers'));

const tokenizer = Tokenizer.fromFile(tokPath);
// The normalizer chain can only be built with a regex Replace from JSON, so load it into a throwaway tokenizer.
const sentinel = '\ue000';
const chain = {
  type: 'Sequence', normalizers: [
    { type: 'NFKC' }, { type: 'NFD' }, { type: 'StripAccents' }, { type: 'Lowercase' },
    { type: 'Replace', pattern: { Regex: '[ \t\r\n]+' }, content: ' ' },
    { type: 'Replace', pattern: { Regex: '^ $' }, content: sentinel },
    { type: 'Strip', strip_left: true, strip_right: true },
    { type: 'Replace', pattern: { String: sentinel }, content: ' ' },
  ],
};
const shell = JSON.parse(fs.readFileSync(tokPath, 'utf8'));
shell.normalizer = chain;
const normalizer = Tokenizer.fromString(JSON.stringify(shell)).getNormalizer();

(async () => {
  const n = tokenizer.getVocabSize(true);
  const ids = [];
  for (let i = 0; i < n; i++) ids.push([i]);
  const texts = await tokenizer.decodeBatch(ids, false);
  const keyToNew = new Map();
  const map = new Array(n);
  for (let i = 0; i < n; i++) {
    const text = texts[i];
    let key;
    if (text.includes('\ufffd')) {
      key = tokenizer.idToToken(i);
    } else {
      const normalized = normalizer.normalizeString(text);
      key = normalized ? normalized : text;
    }
    let id = keyToNew.get(key);
    if (id === undefined) { id = keyToNew.size; keyToNew.set(key, id); }
    map[i] = id;
  }
  process.stdout.write(JSON.stringify({ size: keyToNew.size, map }) + '\n');
})().catch((e) => { console.error(e); process.exit(1); });
