#include "tokenizer/tokenizer.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "tokenizer/added_vocab.h"
#include "tokenizer/bpe.h"
#include "tokenizer/pretokenize.h"
#include "tokenizer/text_utf8.h"

namespace di {

using tok::AddedToken;

struct Tokenizer::Impl {
  Impl(const nlohmann::json& j)
      : normalizer(j.contains("normalizer") ? j["normalizer"] : nlohmann::json()),
        pre_tokenizer(j.contains("pre_tokenizer") ? j["pre_tokenizer"] : nlohmann::json()),
        bpe(j.contains("model") ? j["model"] : throw std::runtime_error("missing \"model\"")) {}

  tok::Normalizer normalizer;
  tok::PreTokenizer pre_tokenizer;
  tok::BpeModel bpe;
  std::vector<AddedToken> added;
  std::unordered_map<std::string, int32_t> added_by_content;
  tok::AddedTokenMatcher raw_matcher;         // tokens with normalized == false
  tok::AddedTokenMatcher normalized_matcher;  // tokens with normalized == true
  // Per id (index): the vocab string, its decoded bytes, and flags.
  std::vector<std::string> id_token;
  std::vector<std::string> id_bytes;
  std::vector<uint8_t> id_known;
  std::vector<uint8_t> id_special;
  std::vector<uint8_t> id_added;
  int32_t vocab_size = 0;

  // What id_to_token / decode show for an added token: HF shows a normalized token's normalized form.
  std::string display_content(const AddedToken& t) const {
    return t.normalized && !normalizer.is_identity() ? normalizer.apply(t.content) : t.content;
  }

  // HF ignores the ids written in added_tokens and assigns them as its AddedVocabulary does: a
  // repeated content updates the earlier token, content already in the model vocab takes that id,
  // anything else the next id after max(model vocab size - 1, largest added id).
  void add_token(AddedToken t) {
    if (t.content.empty()) return;
    if (auto it = added_by_content.find(t.content); it != added_by_content.end()) {
      for (AddedToken& existing : added) {
        if (existing.content == t.content) {
          t.id = existing.id;
          existing = std::move(t);
          return;
        }
      }
    }
    const auto model_size = static_cast<int32_t>(bpe.vocab().size());
    if (auto it = bpe.vocab().find(t.content); it != bpe.vocab().end()) {
      t.id = it->second;
    } else {
      t.id = largest_added_id >= model_size || model_size == 0 ? largest_added_id + 1 : model_size;
    }
    largest_added_id = std::max(largest_added_id, t.id);
    added_by_content.emplace(t.content, t.id);
    added.push_back(std::move(t));
  }
  int32_t largest_added_id = -1;
};

namespace {

bool get_bool(const nlohmann::json& obj, const char* key, bool fallback, const std::string& where) {
  if (!obj.contains(key) || obj[key].is_null()) return fallback;
  if (!obj[key].is_boolean()) throw std::runtime_error(where + "." + key + ": expected a boolean");
  return obj[key].get<bool>();
}

// ByteLevel decoding of one vocab string: each char maps back to its byte; a token with any char
// outside the map (e.g. "<｜User｜>") decodes to its own UTF-8, as HF's decoder does.
std::string decode_token_string(const std::string& token) {
  std::string bytes;
  bytes.reserve(token.size());
  size_t pos = 0;
  while (pos < token.size()) {
    size_t len = 0;
    const int b = tok::char_to_byte(utf8::decode_at(token, pos, len));
    if (b < 0) return token;
    bytes.push_back(static_cast<char>(b));
    pos += len;
  }
  return bytes;
}

void check_decoder(const nlohmann::json& j) {
  if (!j.contains("decoder") || j["decoder"].is_null()) {
    throw std::runtime_error("decoder: missing (byte-level BPE needs a ByteLevel decoder)");
  }
  const auto& d = j["decoder"];
  auto is_byte_level = [](const nlohmann::json& x) { return x.is_object() && x.value("type", "") == "ByteLevel"; };
  if (is_byte_level(d)) return;
  if (d.is_object() && d.value("type", "") == "Sequence" && d.contains("decoders") && d["decoders"].is_array() &&
      d["decoders"].size() == 1 && is_byte_level(d["decoders"][0])) {
    return;
  }
  throw std::runtime_error("decoder: unsupported (only ByteLevel): " + d.dump().substr(0, 200));
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

std::shared_ptr<const Tokenizer> Tokenizer::from_file(const std::string& path) {
  std::filesystem::path file(path);
  std::error_code ec;
  if (std::filesystem::is_directory(file, ec)) file /= "tokenizer.json";
  std::ifstream in(file, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open tokenizer file " + file.string());
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) throw std::runtime_error("cannot read tokenizer file " + file.string());
  return from_json_text(buffer.str(), file.string());
}

std::shared_ptr<const Tokenizer> Tokenizer::from_json_text(const std::string& json_text, const std::string& origin) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(origin + ": not valid JSON: " + e.what());
  }
  try {
    if (!j.is_object()) throw std::runtime_error("top level must be an object");
    check_decoder(j);
    auto impl = std::make_unique<Impl>(j);

    // Added tokens.
    if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
      if (!j["added_tokens"].is_array()) throw std::runtime_error("added_tokens: expected an array");
      const auto& list = j["added_tokens"];
      for (size_t i = 0; i < list.size(); ++i) {
        const std::string where = "added_tokens[" + std::to_string(i) + "]";
        const auto& a = list[i];
        if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() || !a.contains("content") ||
            !a["content"].is_string()) {
          throw std::runtime_error(where + ": needs integer \"id\" and string \"content\"");
        }
        AddedToken t;
        t.id = a["id"].get<int32_t>();
        if (t.id < 0) throw std::runtime_error(where + ": negative id");
        t.content = a["content"].get<std::string>();
        if (utf8::first_invalid_byte(t.content) != utf8::kValid) throw std::runtime_error(where + ": invalid UTF-8");
        t.special = get_bool(a, "special", false, where);
        // HF's default: special tokens are matched on raw text, others on normalized text.
        t.normalized = get_bool(a, "normalized", !t.special, where);
        t.lstrip = get_bool(a, "lstrip", false, where);
        t.rstrip = get_bool(a, "rstrip", false, where);
        t.single_word = get_bool(a, "single_word", false, where);
        impl->add_token(std::move(t));
      }
    }
    std::vector<const AddedToken*> raw_tokens, normalized_tokens;
    std::vector<std::string> raw_patterns, normalized_patterns;
    for (const AddedToken& t : impl->added) {
      if (t.normalized) {
        normalized_tokens.push_back(&t);
        normalized_patterns.push_back(impl->display_content(t));
      } else {
        raw_tokens.push_back(&t);
        raw_patterns.push_back(t.content);
      }
    }
    impl->raw_matcher.build(raw_tokens, raw_patterns);
    impl->normalized_matcher.build(normalized_tokens, normalized_patterns);

    // Id tables: the model vocab first, added tokens override (HF looks up added tokens first).
    int32_t max_id = -1;
    for (const auto& [token, id] : impl->bpe.vocab()) max_id = std::max(max_id, id);
    for (const AddedToken& t : impl->added) max_id = std::max(max_id, t.id);
    impl->vocab_size = max_id + 1;
    impl->id_token.assign(impl->vocab_size, {});
    impl->id_known.assign(impl->vocab_size, 0);
    impl->id_special.assign(impl->vocab_size, 0);
    impl->id_added.assign(impl->vocab_size, 0);
    for (const auto& [token, id] : impl->bpe.vocab()) {
      impl->id_token[id] = token;
      impl->id_known[id] = 1;
    }
    for (const AddedToken& t : impl->added) {
      impl->id_token[t.id] = impl->display_content(t);
      impl->id_known[t.id] = 1;
      impl->id_special[t.id] = t.special ? 1 : 0;
      impl->id_added[t.id] = 1;
    }
    impl->id_bytes.resize(impl->vocab_size);
    for (int32_t id = 0; id < impl->vocab_size; ++id) {
      if (impl->id_known[id]) impl->id_bytes[id] = decode_token_string(impl->id_token[id]);
    }
    return std::shared_ptr<const Tokenizer>(new Tokenizer(std::move(impl)));
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(origin + ": " + e.what());
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(origin + ": " + e.what());
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool allow_special) const {
  const size_t bad = utf8::first_invalid_byte(text);
  if (bad != utf8::kValid) {
    throw std::invalid_argument("tokenizer encode: invalid UTF-8 at byte offset " + std::to_string(bad));
  }
  const Impl& im = *impl_;
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  auto on_word = [&](std::string_view word) { im.bpe.encode_word(word, ids); };
  auto pre_tokenize = [&](std::string_view piece, int32_t id) {
    if (id >= 0) ids.push_back(id);
    else im.pre_tokenizer.split(piece, on_word);
  };
  // Normalizes a run of text that holds no raw-matched token, then finds normalized tokens in it.
  auto normalized_run = [&](std::string_view run, bool find_tokens) {
    std::string normalized;
    if (!im.normalizer.is_identity()) {
      normalized = im.normalizer.apply(run);
      run = normalized;
    }
    if (find_tokens && !im.normalized_matcher.empty()) im.normalized_matcher.split(run, pre_tokenize);
    else im.pre_tokenizer.split(run, on_word);
  };
  if (!allow_special || im.added.empty()) {
    normalized_run(text, false);
    return ids;
  }
  im.raw_matcher.split(text, [&](std::string_view piece, int32_t id) {
    if (id >= 0) ids.push_back(id);
    else normalized_run(piece, true);
  });
  return ids;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  const Impl& im = *impl_;
  std::string bytes;
  for (int32_t id : ids) {
    // Unknown ids decode to nothing, as in HF.
    if (id < 0 || id >= im.vocab_size || !im.id_known[id]) continue;
    if (skip_special && im.id_special[id]) continue;
    bytes += im.id_bytes[id];
  }
  return utf8::decode_lossy(bytes);
}

std::string Tokenizer::token_bytes(int32_t id) const { return std::string(token_bytes_view(id)); }

std::string_view Tokenizer::token_bytes_view(int32_t id) const {
  const Impl& im = *impl_;
  if (id < 0 || id >= im.vocab_size || !im.id_known[id]) return {};
  return im.id_bytes[id];
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  const Impl& im = *impl_;
  const std::string key(token);
  if (auto it = im.added_by_content.find(key); it != im.added_by_content.end()) return it->second;
  if (auto it = im.bpe.vocab().find(key); it != im.bpe.vocab().end()) return it->second;
  return std::nullopt;
}

std::optional<std::string> Tokenizer::id_to_token(int32_t id) const {
  const Impl& im = *impl_;
  if (id < 0 || id >= im.vocab_size || !im.id_known[id]) return std::nullopt;
  return im.id_token[id];
}

bool Tokenizer::is_special(int32_t id) const {
  const Impl& im = *impl_;
  return id >= 0 && id < im.vocab_size && im.id_special[id];
}

bool Tokenizer::is_added(int32_t id) const {
  const Impl& im = *impl_;
  return id >= 0 && id < im.vocab_size && im.id_added[id];
}

int32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

// ---------------------------------------------------------------------------------------------------
IncrementalDecoder::IncrementalDecoder(std::shared_ptr<const Tokenizer> tok, bool skip_special)
    : tok_(std::move(tok)), skip_special_(skip_special) {}

std::string IncrementalDecoder::push(int32_t id) {
  if (skip_special_ && tok_->is_special(id)) return {};
  pending_ += tok_->token_bytes_view(id);
  // Everything but a trailing, still-completable partial character is final: a later byte cannot
  // change how earlier bytes decode (U+FFFD replacement is decided by the bytes seen so far).
  std::string out;
  const size_t consumed = utf8::decode_lossy_prefix(pending_, out);
  pending_.erase(0, consumed);
  return out;
}

std::string IncrementalDecoder::flush() {
  std::string out = utf8::decode_lossy(pending_);
  pending_.clear();
  return out;
}

}  // namespace di
