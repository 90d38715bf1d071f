#include "grammar/vocabulary.h"

#include <algorithm>
#include <stdexcept>

#include "tokenizer/tokenizer.h"

namespace di::grammar {

std::shared_ptr<const Vocabulary> Vocabulary::from_tokenizer(const Tokenizer& tok, const VocabularyOptions& opt) {
  std::shared_ptr<Vocabulary> v(new Vocabulary());
  const int32_t n = tok.vocab_size();
  v->mask_size_ = opt.mask_size > 0 ? opt.mask_size : n;
  if (v->mask_size_ < n) throw std::invalid_argument("grammar vocabulary: mask_size below the tokenizer's vocab_size");
  v->stop_ids_ = opt.stop_ids;
  if (v->stop_ids_.empty()) {
    if (auto eos = tok.token_to_id("<｜end▁of▁sentence｜>")) v->stop_ids_.push_back(*eos);
  }
  std::vector<bool> text_added(n, false);
  for (int32_t id : opt.text_added_ids) {
    if (id >= 0 && id < n) text_added[id] = true;
  }
  std::vector<std::pair<std::string, int32_t>> tokens;
  tokens.reserve(n);
  for (int32_t id = 0; id < n; ++id) {
    if (tok.is_added(id) && !text_added[id]) continue;
    std::string_view b = tok.token_bytes_view(id);
    if (!b.empty()) tokens.push_back({std::string(b), id});
  }
  v->build(tokens);
  return v;
}

Vocabulary::Vocabulary(const std::vector<std::string>& tokens, int32_t mask_size, std::vector<int32_t> stop_ids) {
  mask_size_ = std::max<int32_t>(mask_size, static_cast<int32_t>(tokens.size()));
  stop_ids_ = std::move(stop_ids);
  std::vector<std::pair<std::string, int32_t>> list;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (!tokens[i].empty()) list.push_back({tokens[i], static_cast<int32_t>(i)});
  }
  build(list);
}

void Vocabulary::build(const std::vector<std::pair<std::string, int32_t>>& tokens) {
  std::vector<int32_t> order(tokens.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return tokens[a].first != tokens[b].first ? tokens[a].first < tokens[b].first : tokens[a].second < tokens[b].second;
  });
  sorted_index_of_id_.assign(mask_size_, -1);
  offsets_.push_back(0);
  for (int32_t i : order) {
    const auto& [bytes, id] = tokens[i];
    if (id < 0 || id >= mask_size_) throw std::invalid_argument("grammar vocabulary: token id outside the mask");
    if (is_stop(id)) continue;  // stop tokens follow the end of the grammar, never its text
    sorted_index_of_id_[id] = static_cast<int32_t>(sorted_ids_.size());
    sorted_ids_.push_back(id);
    bytes_ += bytes;
    offsets_.push_back(static_cast<uint32_t>(bytes_.size()));
  }
}

std::string_view Vocabulary::token_bytes(int32_t id) const {
  if (id < 0 || id >= mask_size_ || sorted_index_of_id_[id] < 0) return {};
  return sorted_bytes(sorted_index_of_id_[id]);
}

bool Vocabulary::is_stop(int32_t id) const {
  return std::find(stop_ids_.begin(), stop_ids_.end(), id) != stop_ids_.end();
}

}  // namespace di::grammar
