#include "io/json_limits.h"

#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

namespace di {
namespace {

using ojson = nlohmann::ordered_json;
// ordered_map hides the vector's operator[](size_t) behind its key lookup; index the vector itself.
using Entries = ojson::object_t::Container;

Entries& entries(ojson& obj) { return static_cast<Entries&>(obj.get_ref<ojson::object_t&>()); }

// Shown paths stop after this many steps: enough to name the field, short for a deep value.
constexpr size_t kPathSteps = 6;

class Builder {
 public:
  using number_integer_t = ojson::number_integer_t;
  using number_unsigned_t = ojson::number_unsigned_t;
  using number_float_t = ojson::number_float_t;
  using string_t = ojson::string_t;
  using binary_t = ojson::binary_t;

  Builder(const JsonLimits& limits, ojson& root) : limits_(limits), root_(root) {}

  bool null() { return add(ojson(nullptr)) != nullptr; }
  bool boolean(bool v) { return add(ojson(v)) != nullptr; }
  bool number_integer(number_integer_t v) { return add(ojson(v)) != nullptr; }
  bool number_unsigned(number_unsigned_t v) { return add(ojson(v)) != nullptr; }
  bool number_float(number_float_t v, const string_t&) { return add(ojson(v)) != nullptr; }
  bool string(string_t& v) { return add(ojson(std::move(v))) != nullptr; }
  bool binary(binary_t& v) { return add(ojson::binary(std::move(v))) != nullptr; }

  bool start_object(std::size_t) { return open(ojson::object()); }
  bool start_array(std::size_t) { return open(ojson::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool key(string_t& k) {
    Frame& f = frames_.back();
    if (entries(*f.value).size() >= limits_.max_keys && !find_key(f, k)) {
      f.key = k;
      return fail(JsonLimitError::Kind::Keys, "JSON object has more than " + std::to_string(limits_.max_keys) + " keys");
    }
    f.key = std::move(k);
    return true;
  }

  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& ex) {
    if (!error_) error_ = JsonLimitError{JsonLimitError::Kind::Syntax, ex.what(), ""};
    return false;
  }

  std::optional<JsonLimitError> error() const { return error_; }

 private:
  struct Frame {
    ojson* value;
    std::string key;  // objects: the key of the value that comes next
    size_t index = 0; // arrays: the index of the value that comes next
    std::unique_ptr<std::unordered_map<std::string, size_t>> index_of;  // big objects: key -> position
  };

  // The position of `k` in the frame's object, if present. Small objects are searched directly;
  // a big one gets a hash index so each key costs O(1).
  std::optional<size_t> find_key(Frame& f, const std::string& k) {
    Entries& obj = entries(*f.value);
    if (!f.index_of) {
      if (obj.size() < 16) {
        for (size_t i = 0; i < obj.size(); ++i)
          if (obj[i].first == k) return i;
        return std::nullopt;
      }
      f.index_of = std::make_unique<std::unordered_map<std::string, size_t>>();
      for (size_t i = 0; i < obj.size(); ++i) f.index_of->emplace(obj[i].first, i);
    }
    auto it = f.index_of->find(k);
    if (it == f.index_of->end()) return std::nullopt;
    return it->second;
  }

  // Places `v` where the parser is (the root, the next array slot, or under the current key) and
  // returns it.
  ojson* add(ojson&& v) {
    if (frames_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Frame& f = frames_.back();
    if (f.value->is_array()) {
      auto& arr = f.value->get_ref<ojson::array_t&>();
      arr.push_back(std::move(v));
      ++f.index;
      return &arr.back();
    }
    Entries& obj = entries(*f.value);
    if (auto pos = find_key(f, f.key)) {
      obj[*pos].second = std::move(v);
      return &obj[*pos].second;
    }
    // ordered_map::emplace would search again; the vector underneath appends in O(1).
    obj.emplace_back(f.key, std::move(v));
    if (f.index_of) f.index_of->emplace(f.key, obj.size() - 1);
    return &obj.back().second;
  }

  bool open(ojson&& container) {
    if (frames_.size() >= limits_.max_depth)
      return fail(JsonLimitError::Kind::Depth, "JSON nests deeper than " + std::to_string(limits_.max_depth) + " levels");
    ojson* slot = add(std::move(container));
    // A container's address stays put: its parent only grows after the container is closed.
    frames_.push_back(Frame{slot, {}, 0, nullptr});
    return true;
  }

  bool close() {
    frames_.pop_back();
    return true;
  }

  std::string path() const {
    std::string p;
    size_t steps = 0;
    for (size_t i = 0; i < frames_.size(); ++i) {
      if (steps == kPathSteps) {
        p += "...";
        break;
      }
      const Frame& f = frames_[i];
      if (f.value->is_array()) {
        // The value being read is the one before index (already added) for a container child.
        const size_t idx = i + 1 < frames_.size() ? f.index - 1 : f.index;
        p += "[" + std::to_string(idx) + "]";
      } else {
        if (!p.empty()) p += ".";
        p += f.key;
      }
      ++steps;
    }
    return p;
  }

  bool fail(JsonLimitError::Kind kind, std::string message) {
    error_ = JsonLimitError{kind, std::move(message), path()};
    return false;
  }

  const JsonLimits& limits_;
  ojson& root_;
  std::vector<Frame> frames_;
  std::optional<JsonLimitError> error_;
};

}  // namespace

std::optional<JsonLimitError> parse_json_limited(std::string_view text, const JsonLimits& limits, ojson& out) {
  out = ojson();
  Builder b(limits, out);
  const bool ok = ojson::sax_parse(text.begin(), text.end(), &b, nlohmann::json::input_format_t::json, /*strict=*/true);
  if (ok) return std::nullopt;
  out = ojson();  // a partial value is of no use (and may be large)
  if (auto e = b.error()) return e;
  return JsonLimitError{JsonLimitError::Kind::Syntax, "invalid JSON", ""};
}

}  // namespace di
