// Test oracle for the JSON-schema grammar tests: validates texts against schemas with Ajv
// (JSON Schema 2020-12, ajv-formats in full mode), independently of deepinfer.
// stdin: JSON lines {"schema": {...}, "text": "..."}; stdout: one line per input,
// {"valid": true} or {"valid": false, "error": "..."}.
const path = require("path");
const readline = require("readline");
const npm = path.join(__dirname, "../../third_party/npm/node_modules");
const Ajv2020 = require(path.join(npm, "ajv/dist/2020")).default;
const addFormats = require(path.join(npm, "ajv-formats")).default;

const ajv = new Ajv2020({ strict: false, allErrors: false, validateFormats: true });
addFormats(ajv, { mode: "full" });
const cache = new Map();

const rl = readline.createInterface({ input: process.stdin, crlfDelay: Infinity });
const out = [];
rl.on("line", (line) => {
  if (!line.trim()) return;
  const { schema, text } = JSON.parse(line);
  const key = JSON.stringify(schema);
  let validate = cache.get(key);
  if (!validate) {
    validate = ajv.compile(schema);
    cache.set(key, validate);
  }
  let value;
  try {
    value = JSON.parse(text);
  } catch (e) {
    out.push(JSON.stringify({ valid: false, error: "JSON.parse: " + e.message }));
    return;
  }
  const valid = validate(value);
  out.push(JSON.stringify(valid ? { valid: true } : { valid: false, error: ajv.errorsText(validate.errors) }));
});
rl.on("close", () => process.stdout.write(out.join("\n") + "\n"));
