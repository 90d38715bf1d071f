// Byte-level BPE tokenizer loaded from a Hugging Face tokenizer.json (DeepSeek-V3 family).
// API pinned here so that chat encoding, Engram and the CLI can be written against it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace di {

class Tokenizer {
 public:
  // `path` is a tokenizer.json or a directory containing one. Throws std::runtime_error naming
  // the file on malformed input.
  static std::shared_ptr<const Tokenizer> from_file(const std::string& path);
  static std::shared_ptr<const Tokenizer> from_json_text(const std::string& json_text, const std::string& origin);

  // Text -> ids. With allow_special, added tokens in the text are recognized (template text);
  // without, the whole string is plain BPE (message content). Never adds BOS.
  // Invalid UTF-8 throws std::invalid_argument naming the byte offset.
  std::vector<int32_t> encode(std::string_view text, bool allow_special = true) const;
  // Ids -> text (byte-level decoded; invalid UTF-8 sequences become U+FFFD, as HF does).
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const;
  // Raw bytes of one token (no U+FFFD replacement): what the incremental detokenizer assembles.
  std::string token_bytes(int32_t id) const;
  // Same, without a copy; empty for ids that have no token. Valid as long as the tokenizer.
  std::string_view token_bytes_view(int32_t id) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  std::optional<std::string> id_to_token(int32_t id) const;  // the vocab string, e.g. "Ġthe"
  bool is_special(int32_t id) const;
  // An entry of added_tokens (control tokens such as <｜User｜>), special or not.
  bool is_added(int32_t id) const;
  int32_t vocab_size() const;  // 1 + the largest id (base vocab + added tokens)

  ~Tokenizer();
  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Streaming detokenizer: feed ids one by one, get text that is final. Never emits a partial
// UTF-8 character.
class IncrementalDecoder {
 public:
  explicit IncrementalDecoder(std::shared_ptr<const Tokenizer> tok, bool skip_special = false);
  std::string push(int32_t id);  // newly final text (possibly empty)
  std::string flush();           // whatever is held back, with invalid bytes as U+FFFD
 private:
  std::shared_ptr<const Tokenizer> tok_;
  bool skip_special_;
  std::string pending_;
};

}  // namespace di
