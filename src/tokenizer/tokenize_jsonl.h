// The JSONL loop behind `deepinfer tokenize`: one JSON object per input line, one per output line.
#pragma once

#include <iosfwd>
#include <string>

namespace di {

class Tokenizer;

struct TokenizeJsonlOptions {
  bool decode = false;        // {"ids": [...]} -> adds "text"; else {"text": ...} -> adds "ids"
  bool allow_special = true;  // encode: recognise added tokens (false: plain BPE)
  bool skip_special = false;  // decode: drop special tokens
};

struct TokenizeJsonlResult {
  size_t lines = 0;   // non-blank input lines
  size_t errors = 0;  // lines answered with an error object
};

// Reads `in` line by line. Each good line is echoed as its object plus "ids" (or "text"); a bad line
// yields {"line": N, "error": "..."} in its place, and processing goes on. Blank lines are skipped.
TokenizeJsonlResult tokenize_jsonl(const Tokenizer& tok, const TokenizeJsonlOptions& options, std::istream& in,
                                   std::ostream& out);

}  // namespace di
