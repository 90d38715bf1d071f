#include "model/v3/state.h"

#include <stdexcept>
#include <string>

namespace di::v3 {

SequenceState::SequenceState(const V3Config& cfg, int max_rollback, int page_tokens, PagePool* pool)
    : max_rollback_(max_rollback), page_tokens_(page_tokens), width_(cfg.kv_lora_rank + cfg.qk_rope_head_dim), pool_(pool) {
  if (page_tokens <= 0) throw std::invalid_argument("page_tokens must be positive");
  if (max_rollback < 0) throw std::invalid_argument("max_rollback must be >= 0");
  caches_.reserve(size_t(cfg.n_layers));
  for (int i = 0; i < cfg.n_layers; ++i) caches_.emplace_back(size_t(width_) * sizeof(float), page_tokens, pool);
}

void SequenceState::truncate(int64_t p) {
  if (p < 0 || p > pos() || p < pos() - max_rollback_)
    throw std::out_of_range("SequenceState::truncate to " + std::to_string(p) + ": position " + std::to_string(pos()) +
                            ", rollback limit " + std::to_string(max_rollback_));
  for (auto& c : caches_) c.truncate(p);
  tokens_.resize(size_t(p));
}

size_t SequenceState::bytes_needed(int64_t n_tokens) const {
  size_t b = 0;
  for (const auto& c : caches_) b += c.bytes_needed(n_tokens);
  return b;
}

PrefixPages SequenceState::share_prefix(int64_t n_tokens) const {
  if (n_tokens < 0 || n_tokens > pos() || n_tokens % page_tokens_)
    throw std::out_of_range("share_prefix: " + std::to_string(n_tokens) + " tokens (page size " +
                            std::to_string(page_tokens_) + ", " + std::to_string(pos()) + " processed)");
  PrefixPages p;
  p.n_tokens = n_tokens;
  for (const auto& c : caches_) p.streams.push_back(c.share_pages(size_t(n_tokens / page_tokens_)));
  return p;
}

void SequenceState::adopt_prefix(const PrefixPages& pages, std::span<const int32_t> tokens) {
  if (pos() != 0) throw std::logic_error("adopt_prefix: the state is not empty");
  if (int64_t(tokens.size()) != pages.n_tokens || pages.n_tokens % page_tokens_ ||
      pages.streams.size() != caches_.size())
    throw std::invalid_argument("adopt_prefix: pages do not match this model's cache layout or the tokens");
  for (size_t i = 0; i < caches_.size(); ++i) {
    if (int64_t(pages.streams[i].size()) * page_tokens_ != pages.n_tokens)
      throw std::invalid_argument("adopt_prefix: stream " + std::to_string(i) + " has the wrong page count");
    caches_[i].adopt(pages.streams[i], pages.n_tokens);
  }
  tokens_.assign(tokens.begin(), tokens.end());
}

size_t SequenceState::bytes() const {
  size_t b = tokens_.capacity() * sizeof(int32_t);
  for (const auto& c : caches_) b += c.bytes();
  return b;
}

}  // namespace di::v3
