#include "tokenizer/text_utf8.h"

#include <cstdio>

#include <utf8proc.h>

namespace di::utf8 {
namespace {

// Result of looking at one sequence starting at `pos`: its length if well formed, otherwise how many
// bytes form the maximal invalid subpart, and whether that subpart ran into the end of the input.
struct SequenceScan {
  size_t length;
  bool valid;
  bool truncated;  // a valid prefix that the end of input cut short
};

SequenceScan scan_sequence(std::string_view s, size_t pos) {
  const auto b0 = static_cast<uint8_t>(s[pos]);
  if (b0 < 0x80) return {1, true, false};
  size_t need;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return {1, false, false};
  }
  size_t have = 1;
  while (have < need) {
    if (pos + have >= s.size()) return {have, false, true};
    const auto b = static_cast<uint8_t>(s[pos + have]);
    const bool ok = have == 1 ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xBF);
    if (!ok) return {have, false, false};
    ++have;
  }
  return {need, true, false};
}

constexpr char kReplacement[] = "\xEF\xBF\xBD";

}  // namespace

size_t first_invalid_byte(std::string_view bytes) {
  size_t pos = 0;
  const size_t n = bytes.size();
  while (pos < n) {
    // ASCII fast path, 8 bytes at a time.
    while (pos + 8 <= n) {
      uint64_t word;
      __builtin_memcpy(&word, bytes.data() + pos, 8);
      if (word & 0x8080808080808080ULL) break;
      pos += 8;
    }
    if (pos >= n) break;
    if (static_cast<uint8_t>(bytes[pos]) < 0x80) { ++pos; continue; }
    const SequenceScan scan = scan_sequence(bytes, pos);
    if (!scan.valid) return pos;
    pos += scan.length;
  }
  return kValid;
}

size_t decode_lossy_prefix(std::string_view bytes, std::string& out) {
  size_t pos = 0, run_start = 0;
  while (pos < bytes.size()) {
    if (static_cast<uint8_t>(bytes[pos]) < 0x80) { ++pos; continue; }
    const SequenceScan scan = scan_sequence(bytes, pos);
    if (scan.valid) { pos += scan.length; continue; }
    out.append(bytes.data() + run_start, pos - run_start);
    if (scan.truncated) return pos;  // may still complete: hold it back
    out.append(kReplacement);
    pos += scan.length;
    run_start = pos;
  }
  out.append(bytes.data() + run_start, pos - run_start);
  return pos;
}

std::string decode_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  const size_t consumed = decode_lossy_prefix(bytes, out);
  if (consumed < bytes.size()) out.append(kReplacement);
  return out;
}

void append_code_point(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool is_white_space(char32_t cp) {
  switch (cp) {
    case 0x09: case 0x0A: case 0x0B: case 0x0C: case 0x0D: case 0x20: case 0x85: case 0xA0:
    case 0x1680: case 0x2028: case 0x2029: case 0x202F: case 0x205F: case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

bool is_word_char(char32_t cp) {
  if (cp == 0x200C || cp == 0x200D) return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME: case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

void append_json_string_body(std::string& out, std::string_view s) {
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
}

}  // namespace di::utf8
