#include "tokenizer/chat_template.h"

#include "tokenizer/text_utf8.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <vector>

#include "tokenizer/chat_internal.h"
#include "tokenizer/tokenizer.h"

namespace di::chat {

ChatFormat parse_chat_format(std::string_view name) {
  std::string lower(name);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower.rfind("deepseek-", 0) == 0) lower = lower.substr(9);
  if (lower == "v4.1" || lower == "v41") return ChatFormat::DeepSeekV41;
  if (lower == "v4") return ChatFormat::DeepSeekV4;
  if (lower == "v3") return ChatFormat::DeepSeekV3;
  if (lower == "v3.1" || lower == "v31") return ChatFormat::DeepSeekV31;
  if (lower == "r1") return ChatFormat::DeepSeekR1;
  throw std::invalid_argument("unknown chat format '" + std::string(name) +
                              "' (expected deepseek-v4.1, deepseek-v4, deepseek-v3, deepseek-v3.1 or deepseek-r1)");
}

std::string_view chat_format_name(ChatFormat format) {
  switch (format) {
    case ChatFormat::DeepSeekV41: return "deepseek-v4.1";
    case ChatFormat::DeepSeekV4: return "deepseek-v4";
    case ChatFormat::DeepSeekV3: return "deepseek-v3";
    case ChatFormat::DeepSeekV31: return "deepseek-v3.1";
    case ChatFormat::DeepSeekR1: return "deepseek-r1";
  }
  return "?";
}

RenderedPrompt render_chat(ChatFormat format, const ChatRequest& request) {
  SegmentList out;
  switch (format) {
    case ChatFormat::DeepSeekV41:
    case ChatFormat::DeepSeekV4: render_v4(format == ChatFormat::DeepSeekV41, request, out); break;
    case ChatFormat::DeepSeekV3: render_v3(request, out); break;
    case ChatFormat::DeepSeekV31: render_v31(request, out); break;
    case ChatFormat::DeepSeekR1: render_r1(request, out); break;
  }
  RenderedPrompt prompt;
  prompt.segments = std::move(out.segments);
  for (const Segment& s : prompt.segments) prompt.text += s.text;
  return prompt;
}

void SegmentList::push(Segment::Kind kind, std::string_view text) {
  if (text.empty()) return;  // empty segments encode to nothing; dropping them keeps lists comparable
  segments.push_back(Segment{kind, std::string(text)});
}

namespace {

int32_t special_id(const Tokenizer& tok, ChatFormat format, const std::string& token) {
  auto id = tok.token_to_id(token);
  if (!id) {
    throw std::runtime_error("chat format " + std::string(chat_format_name(format)) + " needs the control token '" +
                             token + "', which the loaded tokenizer does not have");
  }
  return *id;
}

void append(std::vector<int32_t>& ids, const std::vector<int32_t>& more) { ids.insert(ids.end(), more.begin(), more.end()); }

}  // namespace

std::vector<int32_t> tokenize_prompt(const Tokenizer& tok, ChatFormat format, const RenderedPrompt& prompt) {
  std::vector<int32_t> ids;
  const bool v4 = format == ChatFormat::DeepSeekV41 || format == ChatFormat::DeepSeekV4;
  // Check every control token first so the error names the token rather than a tokenization detail.
  for (const Segment& s : prompt.segments) {
    if (s.kind == Segment::Kind::Special) special_id(tok, format, s.text);
  }
  if (v4) {
    for (const Segment& s : prompt.segments) {
      switch (s.kind) {
        case Segment::Kind::Special: ids.push_back(special_id(tok, format, s.text)); break;
        case Segment::Kind::Template: append(ids, tok.encode(s.text, /*allow_special=*/true)); break;
        case Segment::Kind::Content: append(ids, tok.encode(s.text, /*allow_special=*/false)); break;
      }
    }
    return ids;
  }
  std::string run;
  for (const Segment& s : prompt.segments) {
    if (s.kind == Segment::Kind::Special) {
      if (!run.empty()) append(ids, tok.encode(run, false));
      run.clear();
      ids.push_back(special_id(tok, format, s.text));
    } else {
      run += s.text;
    }
  }
  if (!run.empty()) append(ids, tok.encode(run, false));
  return ids;
}

EncodedPrompt encode_chat(const Tokenizer& tok, ChatFormat format, const ChatRequest& request) {
  EncodedPrompt out;
  out.prompt = render_chat(format, request);
  out.ids = tokenize_prompt(tok, format, out.prompt);
  return out;
}

// ---- stringify_python_style -------------------------------------------------------------------

namespace {

void write_json_string(std::string& out, const std::string& s) {
  out += '"';
  utf8::append_json_string_body(out, s);
  out += '"';
}

// serde_json (ryu) float text: shortest round-trip digits laid out as ryu's "pretty" format does.
std::string serde_float(double v) {
  if (!std::isfinite(v)) return "null";  // serde_json writes null for non-finite floats
  std::string sign = std::signbit(v) ? "-" : "";
  if (v == 0) return sign + "0.0";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, std::fabs(v), std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  size_t e = sci.find('e');
  std::string digits;
  for (size_t i = 0; i < e; ++i)
    if (sci[i] != '.') digits += sci[i];
  int exp10 = std::stoi(sci.substr(e + 1));
  int n = static_cast<int>(digits.size());
  int kk = exp10 + 1;  // value = 0.DIGITS * 10^kk
  int k = kk - n;      // exponent of the last digit
  std::string body;
  if (k >= 0 && kk <= 16) {
    body = digits + std::string(k, '0') + ".0";
  } else if (kk > 0 && kk <= 16) {
    body = digits.substr(0, kk) + "." + digits.substr(kk);
  } else if (kk > -5 && kk <= 0) {
    body = "0." + std::string(-kk, '0') + digits;
  } else if (n == 1) {
    body = digits + "e" + std::to_string(kk - 1);
  } else {
    body = digits.substr(0, 1) + "." + digits.substr(1) + "e" + std::to_string(kk - 1);
  }
  // Python-style tweaks the recipe applies: 0.00001 -> 1e-05 and 1e-7 -> 1e-07.
  if (body.find('e') == std::string::npos) {
    if (body.rfind("0.", 0) == 0) {
      size_t zeros = 0;
      while (2 + zeros < body.size() && body[2 + zeros] == '0') ++zeros;
      if (zeros >= 4 && 2 + zeros < body.size()) {
        std::string rest = body.substr(2 + zeros + 1);
        char tail[32];
        std::snprintf(tail, sizeof tail, "e-%02zu", zeros + 1);
        body = std::string(1, body[2 + zeros]) + (rest.empty() ? "" : "." + rest) + tail;
      }
    }
  } else if (body.size() >= 3 && body[body.size() - 3] == 'e' && body[body.size() - 2] == '-') {
    body.insert(body.size() - 1, "0");
  }
  return sign + body;
}

void write_scalar(std::string& out, const nlohmann::ordered_json& v) {
  using T = nlohmann::ordered_json::value_t;
  switch (v.type()) {
    case T::null: out += "null"; break;
    case T::boolean: out += v.get<bool>() ? "true" : "false"; break;
    case T::number_integer: out += std::to_string(v.get<int64_t>()); break;
    case T::number_unsigned: out += std::to_string(v.get<uint64_t>()); break;
    case T::number_float: out += serde_float(v.get<double>()); break;
    case T::string: write_json_string(out, v.get_ref<const std::string&>()); break;
    case T::array:
    case T::object:
    case T::binary:
    case T::discarded: out += "null"; break;
  }
}

// Iterative, so a value nested arbitrarily deep (tool schemas and arguments come from clients)
// cannot overflow the stack.
void write_value(std::string& out, const nlohmann::ordered_json& root) {
  using J = nlohmann::ordered_json;
  using Entries = J::object_t::Container;  // index the vector under ordered_map
  struct Frame {
    const J* v;
    size_t next;
  };
  std::vector<Frame> stack;
  auto enter = [&](const J& v) {
    if (v.is_array()) {
      out += '[';
      stack.push_back({&v, 0});
    } else if (v.is_object()) {
      out += '{';
      stack.push_back({&v, 0});
    } else {
      write_scalar(out, v);
    }
  };
  enter(root);
  while (!stack.empty()) {
    Frame& f = stack.back();
    const size_t i = f.next++;
    if (f.v->is_array()) {
      const auto& arr = f.v->get_ref<const J::array_t&>();
      if (i == arr.size()) {
        out += ']';
        stack.pop_back();
        continue;
      }
      if (i) out += ", ";
      enter(arr[i]);  // may grow `stack`: `f` is not used after this
    } else {
      const auto& obj = static_cast<const Entries&>(f.v->get_ref<const J::object_t&>());
      if (i == obj.size()) {
        out += '}';
        stack.pop_back();
        continue;
      }
      if (i) out += ", ";
      write_json_string(out, obj[i].first);
      out += ": ";
      enter(obj[i].second);
    }
  }
}

}  // namespace

std::string stringify_python_style(const nlohmann::ordered_json& value) {
  std::string out;
  write_value(out, value);
  return out;
}

std::string json_escape_string(const std::string& s) {
  std::string out;
  write_json_string(out, s);
  return out;
}

}  // namespace di::chat
