#include "tokenizer/pretokenize.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <cstdlib>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "tokenizer/text_utf8.h"

namespace di::tok {
namespace {

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof(buf));
  return reinterpret_cast<const char*>(buf);
}

// Per-thread match state: PCRE2 match data and JIT stacks must not be shared between threads.
struct ThreadMatchState {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;
  ThreadMatchState() {
    data = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    // Long whitespace or letter runs backtrack deeply; the default 32 KiB JIT stack is too small.
    jit_stack = pcre2_jit_stack_create(64 * 1024, 16 * 1024 * 1024, nullptr);
    if (!data || !context || !jit_stack) throw std::bad_alloc();
    pcre2_jit_stack_assign(context, nullptr, jit_stack);
  }
  ~ThreadMatchState() {
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

ThreadMatchState& thread_match_state() {
  thread_local ThreadMatchState state;
  return state;
}

}  // namespace

std::string translate_oniguruma_pattern(const std::string& pattern, const std::string& where) {
  std::string out;
  out.reserve(pattern.size() + 16);
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\') {
      if (i + 1 >= pattern.size()) throw std::runtime_error(where + ": pattern ends with a backslash");
      const char next = pattern[++i];
      if (next == 's') {
        out += in_class ? "\\s\\x{85}" : "[\\s\\x{85}]";
      } else if (next == 'S') {
        if (in_class) throw std::runtime_error(where + ": \\S inside a character class is not supported");
        out += "[^\\s\\x{85}]";
      } else if (next == 'h' || next == 'H') {
        // Oniguruma: hex digit; PCRE2: horizontal space.
        throw std::runtime_error(where + ": \\h / \\H differ between Oniguruma and PCRE2; not supported");
      } else {
        out += c;
        out += next;
      }
      continue;
    }
    if (c == '[') {
      if (in_class) {
        if (i + 1 < pattern.size() && pattern[i + 1] == ':') {  // POSIX class like [:alpha:]
          const size_t close = pattern.find(":]", i + 2);
          if (close == std::string::npos) throw std::runtime_error(where + ": unterminated POSIX class");
          out.append(pattern, i, close + 2 - i);
          i = close + 1;
          continue;
        }
        throw std::runtime_error(where + ": nested character classes are not supported");
      }
      in_class = true;
      out += c;
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];  // literal ']' first
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

Regex::Regex(const std::string& pattern, bool literal, const std::string& where) : source_(pattern) {
  const std::string compiled = literal ? pattern : translate_oniguruma_pattern(pattern, where);
  uint32_t options = PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK;
  if (literal) options = PCRE2_UTF | PCRE2_LITERAL | PCRE2_NO_UTF_CHECK;
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(compiled.data()), compiled.size(), options,
                                   &error, &offset, nullptr);
  if (!code) {
    throw std::runtime_error(where + ": cannot compile regex /" + pattern + "/ at offset " +
                             std::to_string(offset) + ": " + pcre2_message(error));
  }
  code_ = code;
  jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

void Regex::for_each_match(std::string_view subject, FunctionRef<void(size_t, size_t)> on_match) const {
  auto* code = static_cast<pcre2_code*>(code_);
  ThreadMatchState& state = thread_match_state();
  const auto* text = reinterpret_cast<PCRE2_SPTR>(subject.data());
  const size_t len = subject.size();
  size_t pos = 0;
  while (pos <= len) {
    int rc = jit_ ? pcre2_jit_match(code, text, len, pos, 0, state.data, state.context)
                  : PCRE2_ERROR_JIT_BADOPTION;
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT || rc == PCRE2_ERROR_JIT_BADOPTION) {
      // The interpreter keeps its backtracking state on the heap.
      rc = pcre2_match(code, text, len, pos, PCRE2_NO_UTF_CHECK, state.data, state.context);
    }
    if (rc == PCRE2_ERROR_NOMATCH) return;
    if (rc < 0) {
      throw std::runtime_error("regex /" + source_ + "/ failed at byte " + std::to_string(pos) + " of a " +
                               std::to_string(len) + "-byte piece: " + pcre2_message(rc));
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.data);
    const size_t begin = ovector[0], end = ovector[1];
    on_match(begin, end);
    if (end > begin) {
      pos = end;
    } else {
      if (end >= len) return;
      // Empty match: step over one character, as Oniguruma's iterator does.
      pos = end + 1;
      while (pos < len && (static_cast<uint8_t>(subject[pos]) & 0xC0) == 0x80) ++pos;
    }
  }
}

// ---------------------------------------------------------------------------------------------------
Normalizer::Normalizer(const nlohmann::json& spec) {
  if (spec.is_null()) return;
  if (!spec.is_object() || !spec.contains("type") || !spec["type"].is_string()) {
    throw std::runtime_error("normalizer: expected an object with a string \"type\"");
  }
  const std::string type = spec["type"].get<std::string>();
  if (type == "Sequence") {
    if (!spec.contains("normalizers") || !spec["normalizers"].is_array()) {
      throw std::runtime_error("normalizer Sequence: missing array \"normalizers\"");
    }
    for (const auto& child : spec["normalizers"]) {
      Normalizer inner(child);
      steps_.insert(steps_.end(), inner.steps_.begin(), inner.steps_.end());
    }
  } else if (type == "NFC") {
    steps_.push_back(Step::kNfc);
  } else if (type == "NFD") {
    steps_.push_back(Step::kNfd);
  } else if (type == "NFKC") {
    steps_.push_back(Step::kNfkc);
  } else if (type == "NFKD") {
    steps_.push_back(Step::kNfkd);
  } else {
    throw std::runtime_error("normalizer: unsupported type \"" + type +
                             "\" (supported: Sequence, NFC, NFD, NFKC, NFKD)");
  }
}

std::string Normalizer::apply(std::string_view text) const {
  std::string current(text);
  for (Step step : steps_) {
    int options = UTF8PROC_STABLE;
    switch (step) {
      case Step::kNfc: options |= UTF8PROC_COMPOSE; break;
      case Step::kNfd: options |= UTF8PROC_DECOMPOSE; break;
      case Step::kNfkc: options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
      case Step::kNfkd: options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
    }
    utf8proc_uint8_t* result = nullptr;
    const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(current.data()),
                                            static_cast<utf8proc_ssize_t>(current.size()), &result,
                                            static_cast<utf8proc_option_t>(options));
    if (n < 0) throw std::runtime_error(std::string("normalizer: ") + utf8proc_errmsg(n));
    current.assign(reinterpret_cast<const char*>(result), static_cast<size_t>(n));
    std::free(result);
  }
  return current;
}

// ---------------------------------------------------------------------------------------------------
namespace {
struct Segment {
  uint32_t begin, end;
  bool is_match;
};
// One scratch vector per pipeline depth, reused across calls so words cost no heap allocation.
std::vector<std::vector<Segment>>& thread_scratch(size_t depth) {
  thread_local std::vector<std::vector<Segment>> scratch;
  if (scratch.size() < depth) scratch.resize(depth);
  return scratch;
}
}  // namespace

PreTokenizer::PreTokenizer(const nlohmann::json& spec) {
  if (spec.is_null()) throw std::runtime_error("pre_tokenizer: missing (byte-level BPE needs ByteLevel)");
  if (!spec.is_object() || !spec.contains("type") || !spec["type"].is_string()) {
    throw std::runtime_error("pre_tokenizer: expected an object with a string \"type\"");
  }
  if (spec["type"] == "Sequence") {
    if (!spec.contains("pretokenizers") || !spec["pretokenizers"].is_array()) {
      throw std::runtime_error("pre_tokenizer Sequence: missing array \"pretokenizers\"");
    }
    const auto& list = spec["pretokenizers"];
    for (size_t i = 0; i < list.size(); ++i) {
      add_step(list[i], i + 1 == list.size(), "pre_tokenizer.pretokenizers[" + std::to_string(i) + "]");
    }
  } else {
    add_step(spec, true, "pre_tokenizer");
  }
  if (!has_byte_level_) {
    throw std::runtime_error("pre_tokenizer: no ByteLevel step; only byte-level BPE tokenizers are supported");
  }
}

PreTokenizer::~PreTokenizer() = default;

void PreTokenizer::add_step(const nlohmann::json& step, bool last, const std::string& where) {
  if (!step.is_object() || !step.contains("type") || !step["type"].is_string()) {
    throw std::runtime_error(where + ": expected an object with a string \"type\"");
  }
  const std::string type = step["type"].get<std::string>();
  if (has_byte_level_) throw std::runtime_error(where + ": steps after ByteLevel are not supported");
  if (type == "ByteLevel") {
    has_byte_level_ = true;
    add_prefix_space_ = step.value("add_prefix_space", false);
    if (step.value("use_regex", true)) {
      // GPT-2's word pattern, which HF's ByteLevel applies when use_regex is set.
      byte_level_regex_ = std::make_unique<Regex>(
          R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)", false, where);
    }
    return;
  }
  if (type != "Split") {
    throw std::runtime_error(where + ": unsupported pre-tokenizer type \"" + type +
                             "\" (supported: Sequence, Split, ByteLevel)");
  }
  if (!step.contains("pattern") || !step["pattern"].is_object()) {
    throw std::runtime_error(where + ": Split needs an object \"pattern\"");
  }
  const auto& pattern = step["pattern"];
  SplitStep split;
  if (pattern.contains("Regex") && pattern["Regex"].is_string()) {
    split.regex = std::make_unique<Regex>(pattern["Regex"].get<std::string>(), false, where);
  } else if (pattern.contains("String") && pattern["String"].is_string()) {
    split.regex = std::make_unique<Regex>(pattern["String"].get<std::string>(), true, where);
  } else {
    throw std::runtime_error(where + ": Split pattern must be {\"Regex\": ...} or {\"String\": ...}");
  }
  const std::string behavior = step.value("behavior", std::string("Isolated"));
  if (behavior == "Removed") split.behavior = Behavior::kRemoved;
  else if (behavior == "Isolated") split.behavior = Behavior::kIsolated;
  else if (behavior == "MergedWithPrevious") split.behavior = Behavior::kMergedWithPrevious;
  else if (behavior == "MergedWithNext") split.behavior = Behavior::kMergedWithNext;
  else if (behavior == "Contiguous") split.behavior = Behavior::kContiguous;
  else throw std::runtime_error(where + ": unknown Split behavior \"" + behavior + "\"");
  split.invert = step.value("invert", false);
  steps_.push_back(std::move(split));
  (void)last;
}

void PreTokenizer::split(std::string_view text, FunctionRef<void(std::string_view)> on_word) const {
  if (text.empty()) return;
  thread_scratch(steps_.size() + 1);  // size it before recursion holds references into it
  run_from(0, text, on_word);
}

void PreTokenizer::run_from(size_t step_index, std::string_view piece,
                            FunctionRef<void(std::string_view)> on_word) const {
  if (step_index == steps_.size()) {
    byte_level(piece, on_word);
    return;
  }
  const SplitStep& step = steps_[step_index];
  std::vector<Segment>& segments = thread_scratch(steps_.size() + 1)[step_index];
  segments.clear();
  // Alternating (gap, match) segments covering the piece, like HF's Pattern::find_matches.
  uint32_t prev = 0;
  step.regex->for_each_match(piece, [&](size_t begin, size_t end) {
    if (prev != begin) segments.push_back({prev, static_cast<uint32_t>(begin), false});
    segments.push_back({static_cast<uint32_t>(begin), static_cast<uint32_t>(end), true});
    prev = static_cast<uint32_t>(end);
  });
  if (prev != piece.size()) segments.push_back({prev, static_cast<uint32_t>(piece.size()), false});
  if (step.invert) {
    for (auto& s : segments) s.is_match = !s.is_match;
  }

  // Apply the delimiter behaviour in place; is_match is reused as "drop this segment".
  size_t out = 0;
  switch (step.behavior) {
    case Behavior::kIsolated:
      for (auto& s : segments) s.is_match = false;
      out = segments.size();
      break;
    case Behavior::kRemoved:
      for (const auto& s : segments) {
        if (!s.is_match) segments[out++] = s;
      }
      break;
    case Behavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (size_t i = 0; i < segments.size(); ++i) {
        const Segment s = segments[i];
        if (s.is_match && !previous_match && out > 0) {
          segments[out - 1].end = s.end;
        } else {
          segments[out++] = {s.begin, s.end, false};
        }
        previous_match = s.is_match;
      }
      break;
    }
    case Behavior::kMergedWithNext: {
      // Walk backwards, merging a delimiter into the segment after it.
      bool previous_match = false;
      std::vector<Segment> reversed;
      reversed.reserve(segments.size());
      for (size_t i = segments.size(); i-- > 0;) {
        const Segment s = segments[i];
        if (s.is_match && !previous_match && !reversed.empty()) {
          reversed.back().begin = s.begin;
        } else {
          reversed.push_back({s.begin, s.end, false});
        }
        previous_match = s.is_match;
      }
      out = 0;
      for (size_t i = reversed.size(); i-- > 0;) segments[out++] = reversed[i];
      break;
    }
    case Behavior::kContiguous: {
      bool previous_match = false;
      for (size_t i = 0; i < segments.size(); ++i) {
        const Segment s = segments[i];
        if (s.is_match == previous_match && out > 0) {
          segments[out - 1].end = s.end;
        } else {
          segments[out++] = {s.begin, s.end, false};
        }
        previous_match = s.is_match;
      }
      break;
    }
  }
  segments.resize(out);
  // Deeper steps reuse other scratch slots, so iterating `segments` here stays valid.
  for (size_t i = 0; i < out; ++i) {
    const Segment s = segments[i];
    if (s.end > s.begin) run_from(step_index + 1, piece.substr(s.begin, s.end - s.begin), on_word);
  }
}

void PreTokenizer::byte_level(std::string_view piece, FunctionRef<void(std::string_view)> on_word) const {
  std::string_view text = piece;
  thread_local std::string prefixed;
  if (add_prefix_space_ && piece.front() != ' ') {
    prefixed.assign(1, ' ');
    prefixed.append(piece);
    text = prefixed;
  }
  if (!byte_level_regex_) {
    on_word(text);
    return;
  }
  // Isolated split: matches and the gaps between them are all words.
  size_t prev = 0;
  byte_level_regex_->for_each_match(text, [&](size_t begin, size_t end) {
    if (begin > prev) on_word(text.substr(prev, begin - prev));
    if (end > begin) on_word(text.substr(begin, end - begin));
    prev = end;
  });
  if (prev < text.size()) on_word(text.substr(prev));
}

}  // namespace di::tok
