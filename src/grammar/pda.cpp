#include "grammar/pda.h"

namespace di::grammar::detail {

int32_t StackPool::intern(int32_t state, int32_t parent) {
  size_t mask = table_.size() - 1;
  size_t i = hash(state, parent) & mask;
  for (;; i = (i + 1) & mask) {
    const int32_t id = table_[i];
    if (id < 0) break;
    if (nodes_[id].state == state && nodes_[id].parent == parent) return id;
  }
  const int32_t id = static_cast<int32_t>(nodes_.size());
  nodes_.push_back({state, parent});
  table_[i] = id;
  slot_.push_back(static_cast<uint32_t>(i));
  if (nodes_.size() * 2 > table_.size()) grow();
  return id;
}

void StackPool::grow() {
  // Reinserting in id order keeps LIFO removal exact.
  table_.assign(table_.size() * 2, -1);
  const size_t mask = table_.size() - 1;
  for (size_t id = 0; id < nodes_.size(); ++id) {
    size_t i = hash(nodes_[id].state, nodes_[id].parent) & mask;
    while (table_[i] >= 0) i = (i + 1) & mask;
    table_[i] = static_cast<int32_t>(id);
    slot_[id] = static_cast<uint32_t>(i);
  }
}

void StackPool::truncate(size_t n) {
  while (nodes_.size() > n) {
    table_[slot_.back()] = -1;
    slot_.pop_back();
    nodes_.pop_back();
  }
}

void Stepper::new_epoch() {
  if (++epoch_ == 0) {
    stamp_.assign(stamp_.size(), 0);
    epoch_ = 1;
  }
}

void Stepper::visit(int32_t node) {
  if (stamp_.size() <= static_cast<size_t>(node)) stamp_.resize(pool_.size() + 1024, 0);
  if (stamp_[node] == epoch_) return;
  stamp_[node] = epoch_;
  work_.push_back(node);
}

bool Stepper::expand(int32_t node, std::vector<int32_t>& out) {
  bool ended = false;
  visit(node);
  while (!work_.empty()) {
    const int32_t n = work_.back();
    work_.pop_back();
    const StackNode sn = pool_[n];
    const Automaton::State& st = a_.states[sn.state];
    if (st.has_bytes) out.push_back(n);
    for (uint32_t c = st.call_begin; c < st.call_end; ++c) {
      const Automaton::Call& call = a_.calls[c];
      const int32_t ret = pool_.intern(call.ret, sn.parent);
      visit(pool_.intern(call.callee_start, ret));
    }
    if (st.final) {
      if (sn.parent < 0) {
        ended = true;
      } else {
        visit(sn.parent);
      }
    }
  }
  return ended;
}

bool Stepper::advance(const std::vector<int32_t>& in, uint8_t byte, std::vector<int32_t>& out) {
  out.clear();
  new_epoch();
  bool ended = false;
  for (int32_t n : in) {
    const StackNode sn = pool_[n];
    const int32_t t = a_.step(sn.state, byte);
    if (t >= 0) ended |= expand(pool_.intern(t, sn.parent), out);
  }
  return ended;
}

void PrefixWalker::reset(const std::vector<int32_t>& start, const ByteSet* follow) {
  follow_ = follow;
  if (sets_.empty()) {
    sets_.resize(1);
    ended_.assign(1, 0);
    exited_.assign(1, 0);
    pool_mark_.assign(1, 0);
  }
  sets_[0] = start;
  ended_[0] = 0;
  exited_[0] = 0;
  valid_ = 0;
}

size_t PrefixWalker::walk(std::string_view token, size_t shared) {
  if (shared < valid_) {
    valid_ = shared;
    // Stacks made for deeper bytes of earlier tokens are referenced by nothing below.
    pool_.truncate(pool_mark_[valid_]);
  }
  if (sets_.size() < token.size() + 1) {
    sets_.resize(token.size() + 1);
    ended_.resize(token.size() + 1);
    exited_.resize(token.size() + 1);
    pool_mark_.resize(token.size() + 1);
  }
  size_t d = valid_;
  while (d < token.size() && !sets_[d].empty()) {
    const uint8_t b = static_cast<uint8_t>(token[d]);
    exited_[d + 1] = exited_[d] || (ended_[d] && follow_ != nullptr && byteset_has(*follow_, b));
    pool_mark_[d] = pool_.size();
    ended_[d + 1] = stepper_.advance(sets_[d], b, sets_[d + 1]);
    ++d;
  }
  valid_ = d;
  return d;
}

}  // namespace di::grammar::detail
