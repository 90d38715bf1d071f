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

void Stepper::visit(StackTop t) {
  // Sets are small (one stack per live parse); a linear scan beats hashing here.
  for (const StackTop& v : visited_) {
    if (v == t) return;
  }
  visited_.push_back(t);
  work_.push_back(t);
}

bool Stepper::expand(StackTop top, std::vector<StackTop>& out) {
  bool ended = false;
  visit(top);
  while (!work_.empty()) {
    const StackTop t = work_.back();
    work_.pop_back();
    const Automaton::State& st = a_.states[t.state];
    if (st.has_bytes) out.push_back(t);
    for (uint32_t c = st.call_begin; c < st.call_end; ++c) {
      const Automaton::Call& call = a_.calls[c];
      visit({call.callee_start, pool_.intern(call.ret, t.parent)});
    }
    if (st.final) {
      if (t.parent < 0) {
        ended = true;
      } else {
        visit(pool_[t.parent]);
      }
    }
  }
  return ended;
}

bool Stepper::advance(const std::vector<StackTop>& in, uint8_t byte, std::vector<StackTop>& out) {
  out.clear();
  new_epoch();
  bool ended = false;
  for (const StackTop& t : in) {
    const int32_t next = a_.step(t.state, byte);
    if (next >= 0) ended |= expand({next, t.parent}, out);
  }
  return ended;
}

void PrefixWalker::reset(const std::vector<StackTop>& start, const ByteSet* follow) {
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
    ++d;
    const std::vector<StackTop>& in = sets_[d - 1];
    if (in.size() == 1) {
      // Fast path: one stack stepping inside its rule (no call, cannot end) needs no closure.
      const int32_t next = a_.step(in[0].state, b);
      const Automaton::State& st = a_.states[next < 0 ? 0 : next];
      if (next < 0 || (st.call_begin == st.call_end && !st.final)) {
        ended_[d] = 0;
        sets_[d].clear();
        if (next >= 0) sets_[d].push_back({next, in[0].parent});
        continue;
      }
    }
    ended_[d] = stepper_.advance(in, b, sets_[d]);
  }
  valid_ = d;
  return d;
}

}  // namespace di::grammar::detail
