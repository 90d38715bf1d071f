// Stop strings on decoded text for /v1/completions (chat uses the stream parser's stop sequences):
// text is released only once it cannot be the start of a stop string, so a partial stop string never
// reaches the client.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace di::server {

class StopMatcher {
 public:
  StopMatcher() = default;
  explicit StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}

  // Appends the text that is now final to `out`. After a match, later input is ignored.
  void feed(std::string_view text, std::string& out) {
    if (matched_) return;
    if (stops_.empty()) {
      out.append(text);
      return;
    }
    held_.append(text);
    size_t first = std::string::npos;
    for (const auto& s : stops_) {
      const size_t at = held_.find(s);
      if (at < first) first = at;
    }
    if (first != std::string::npos) {
      out.append(held_, 0, first);
      held_.clear();
      matched_ = true;
      return;
    }
    size_t hold = 0;
    for (const auto& s : stops_) {
      for (size_t k = std::min(s.size() - 1, held_.size()); k > hold; --k) {
        if (std::string_view(held_).substr(held_.size() - k) == std::string_view(s).substr(0, k)) {
          hold = k;
          break;
        }
      }
    }
    out.append(held_, 0, held_.size() - hold);
    held_.erase(0, held_.size() - hold);
  }
  // End of output without a match: what was held back is final.
  void finish(std::string& out) {
    if (!matched_) out.append(held_);
    held_.clear();
  }
  bool matched() const { return matched_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool matched_ = false;
};

}  // namespace di::server
