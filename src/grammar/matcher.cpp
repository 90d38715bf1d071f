#include "grammar/matcher.h"

#include <algorithm>
#include <climits>
#include <stdexcept>

namespace di::grammar {

GrammarMatcher::GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar)
    : grammar_(std::move(grammar)),
      stepper_(grammar_->automaton(), pool_),
      walker_(grammar_->automaton(), pool_) {
  reset();
}

void GrammarMatcher::reset() {
  pool_.truncate(0);
  history_.clear();
  saved_stacks_.clear();
  stacks_.clear();
  terminated_ = false;
  const Automaton& a = grammar_->automaton();
  stepper_.new_epoch();
  can_end_ = stepper_.expand({a.root_start(), detail::kBottom}, stacks_);
}

void GrammarMatcher::fill_mask(std::span<uint32_t> bits) {
  const Vocabulary& v = grammar_->vocab();
  if (bits.size() != static_cast<size_t>(v.mask_words())) throw std::invalid_argument("fill_mask: wrong mask size");
  std::fill(bits.begin(), bits.end(), 0u);
  auto set = [&](int32_t id) { bits[id >> 5] |= 1u << (id & 31); };
  if (!terminated_) {
    const size_t mark = pool_.size();
    for (const detail::StackTop& top : stacks_) {
      const StateTokens* t = grammar_->tokens(top.state);
      if (!t->accepted_bits.empty()) {
        for (size_t w = 0; w < bits.size(); ++w) bits[w] |= t->accepted_bits[w];
      } else {
        for (int32_t id : t->accepted_ids) set(id);
      }
      if (t->uncertain.empty()) continue;
      single_.assign(1, top);
      walker_.reset(single_, nullptr);
      int32_t shared = INT_MAX;  // common prefix with the last token walked
      for (size_t i = 0; i < t->uncertain.size(); ++i) {
        shared = std::min(shared, t->uncertain_lcp[i]);
        const int32_t k = t->uncertain[i];
        const int32_t id = v.sorted_id(k);
        if ((bits[id >> 5] >> (id & 31)) & 1) continue;
        const std::string_view tok = v.sorted_bytes(k);
        const size_t d = walker_.walk(tok, i == 0 ? 0 : static_cast<size_t>(shared));
        shared = INT_MAX;
        if (d == tok.size() && (walker_.alive(d) || walker_.ended(d))) set(id);
      }
    }
    pool_.truncate(mark);
  }
  if (terminated_ || can_end_) {
    for (int32_t id : v.stop_ids()) {
      if (id >= 0 && id < v.mask_size()) set(id);
    }
  }
}

bool GrammarMatcher::advance_bytes(std::string_view bytes, std::vector<detail::StackTop>& stacks, bool& can_end) {
  stacks = stacks_;
  can_end = can_end_;
  for (char c : bytes) {
    if (stacks.empty()) return false;  // the grammar ended with bytes left over
    can_end = stepper_.advance(stacks, static_cast<uint8_t>(c), scratch_b_);
    stacks.swap(scratch_b_);
  }
  return !stacks.empty() || can_end;
}

void GrammarMatcher::save_step() {
  history_.push_back({pool_.size(), saved_stacks_.size(), can_end_, terminated_});
  saved_stacks_.insert(saved_stacks_.end(), stacks_.begin(), stacks_.end());
}

bool GrammarMatcher::accept_bytes(std::string_view bytes) {
  if (terminated_) return false;
  const size_t mark = pool_.size();
  bool can_end = false;
  if (!advance_bytes(bytes, scratch_a_, can_end)) {
    pool_.truncate(mark);
    return false;
  }
  history_.push_back({mark, saved_stacks_.size(), can_end_, terminated_});
  saved_stacks_.insert(saved_stacks_.end(), stacks_.begin(), stacks_.end());
  stacks_.swap(scratch_a_);
  can_end_ = can_end;
  return true;
}

bool GrammarMatcher::accept_token(int32_t id) {
  if (terminated_) return false;
  const Vocabulary& v = grammar_->vocab();
  if (v.is_stop(id)) {
    if (!can_end_) return false;
    save_step();
    terminated_ = true;
    return true;
  }
  const std::string_view bytes = v.token_bytes(id);
  if (bytes.empty()) return false;
  return accept_bytes(bytes);
}

void GrammarMatcher::rollback(int n) {
  if (n < 0 || n > num_steps()) throw std::invalid_argument("rollback: more steps than accepted");
  for (; n > 0; --n) {
    const Step s = history_.back();
    history_.pop_back();
    stacks_.assign(saved_stacks_.begin() + static_cast<std::ptrdiff_t>(s.stacks_begin), saved_stacks_.end());
    saved_stacks_.resize(s.stacks_begin);
    can_end_ = s.can_end;
    terminated_ = s.terminated;
    pool_.truncate(s.pool_size);
  }
}

std::string GrammarMatcher::forced_bytes() {
  std::string out;
  if (terminated_) return out;
  const Automaton& a = grammar_->automaton();
  const size_t mark = pool_.size();
  scratch_a_ = stacks_;
  bool can_end = can_end_;
  constexpr size_t kMaxForced = 1 << 16;
  while (!can_end && !scratch_a_.empty() && out.size() < kMaxForced) {
    int only = -1;
    for (const detail::StackTop& top : scratch_a_) {
      const int32_t st = top.state;
      for (int b = 0; b < 256 && only != -2; ++b) {
        if (a.step(st, static_cast<uint8_t>(b)) < 0) continue;
        only = only == -1 || only == b ? b : -2;
      }
    }
    if (only < 0) break;
    out += static_cast<char>(only);
    can_end = stepper_.advance(scratch_a_, static_cast<uint8_t>(only), scratch_b_);
    scratch_a_.swap(scratch_b_);
  }
  pool_.truncate(mark);
  return out;
}

}  // namespace di::grammar
