// UTF-8 validation and lossy decoding with Rust's `String::from_utf8_lossy` semantics (one U+FFFD per
// maximal invalid subpart), which is what Hugging Face's ByteLevel decoder produces.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace di::utf8 {

inline constexpr size_t kValid = static_cast<size_t>(-1);

// Byte offset of the first byte that is not part of a well-formed UTF-8 sequence, or kValid.
size_t first_invalid_byte(std::string_view bytes);

// Appends the lossy decoding of `bytes` to `out`, except for a trailing sequence that is incomplete but
// could still become valid with more bytes. Returns how many bytes were consumed.
size_t decode_lossy_prefix(std::string_view bytes, std::string& out);

// Lossy decoding of all of `bytes` (a truncated trailing sequence becomes one U+FFFD).
std::string decode_lossy(std::string_view bytes);

// Decodes the code point starting at `bytes[pos]` of valid UTF-8; sets `len` to its byte length.
inline char32_t decode_at(std::string_view bytes, size_t pos, size_t& len) {
  const auto b0 = static_cast<uint8_t>(bytes[pos]);
  if (b0 < 0x80) { len = 1; return b0; }
  auto cont = [&](size_t i) { return static_cast<char32_t>(static_cast<uint8_t>(bytes[pos + i]) & 0x3F); };
  if (b0 < 0xE0) { len = 2; return (static_cast<char32_t>(b0 & 0x1F) << 6) | cont(1); }
  if (b0 < 0xF0) { len = 3; return (static_cast<char32_t>(b0 & 0x0F) << 12) | (cont(1) << 6) | cont(2); }
  len = 4;
  return (static_cast<char32_t>(b0 & 0x07) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3);
}

// Length of the last code point of non-empty valid UTF-8 `bytes`.
inline size_t last_char_len(std::string_view bytes) {
  size_t n = 1;
  while (n < bytes.size() && n < 4 && (static_cast<uint8_t>(bytes[bytes.size() - n]) & 0xC0) == 0x80) ++n;
  return n;
}

void append_code_point(std::string& out, char32_t cp);

// The body of a JSON string literal for `s` (no quotes): ", \ and control characters escaped as
// Python's json.dumps(ensure_ascii=False) does; other bytes copied as they are.
void append_json_string_body(std::string& out, std::string_view s);

// Unicode White_Space property (what Rust's char::is_whitespace tests).
bool is_white_space(char32_t cp);
// A \w character of Rust's regex crate (HF's single_word test), approximated by general
// categories: letters, marks, Nd, Nl, Pc, and the joiners U+200C / U+200D.
bool is_word_char(char32_t cp);

}  // namespace di::utf8
