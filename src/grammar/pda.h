// The pushdown automaton's stacks and its byte step (internal to the grammar engine).
//
// A stack is its top (state, parent node) over a chain of nodes (state, parent). Nodes are
// hash-consed, so equal stacks have equal tops and a set of stacks deduplicates by top; this also
// stops the closure from looping on nullable calls. A byte step inside one rule changes only the
// top and allocates nothing. Nodes are freed last-in first-out (truncate), which is how a mask
// computation drops its scratch stacks and how rollback drops the stacks of undone tokens.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "grammar/automaton.h"

namespace di::grammar::detail {

// Parent values below zero: what lies under the bottom frame.
inline constexpr int32_t kBottom = -1;   // the root: ending here ends the grammar
inline constexpr int32_t kContext = -2;  // an unknown caller (classification ahead of time)

struct StackNode {
  int32_t state;
  int32_t parent;
  bool operator==(const StackNode&) const = default;
};
using StackTop = StackNode;  // a stack: its top state and the node below

class StackPool {
 public:
  StackPool() { table_.assign(1024, -1); }
  int32_t intern(int32_t state, int32_t parent);
  const StackNode& operator[](int32_t id) const { return nodes_[id]; }
  size_t size() const { return nodes_.size(); }
  // Frees the nodes created after size() was `n` (they must not be referenced any more).
  void truncate(size_t n);

 private:
  static uint64_t hash(int32_t state, int32_t parent) {
    uint64_t k = (static_cast<uint64_t>(static_cast<uint32_t>(state)) << 32) | static_cast<uint32_t>(parent);
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return k;
  }
  void grow();

  std::vector<StackNode> nodes_;
  std::vector<int32_t> table_;  // open addressing, linear probing; -1 empty
  std::vector<uint32_t> slot_;  // table slot of each node, for LIFO removal
};

// Byte steps over sets of stacks. A set holds only stacks whose top state reads a byte; the
// closure (calls pushed, ended rules popped) is taken right after each byte.
class Stepper {
 public:
  Stepper(const Automaton& a, StackPool& pool) : a_(a), pool_(pool) {}

  // Adds the closure of `top` to `out`. Returns whether some path popped below the bottom frame
  // (kBottom or kContext), i.e. the grammar (or the classified rule) may end here.
  bool expand(StackTop top, std::vector<StackTop>& out);
  // `out` = the stacks after reading `byte` from `in`; returns as expand().
  bool advance(const std::vector<StackTop>& in, uint8_t byte, std::vector<StackTop>& out);
  // Starts a new closure: stacks visited before no longer count as visited.
  void new_epoch() { visited_.clear(); }

 private:
  void visit(StackTop t);

  const Automaton& a_;
  StackPool& pool_;
  std::vector<StackTop> visited_, work_;
};

// Walks tokens that come in byte order from one start set, reusing the stacks of the prefix a
// token shares with the token before. depth d holds the stacks after the token's first d bytes.
class PrefixWalker {
 public:
  PrefixWalker(const Automaton& a, StackPool& pool) : a_(a), stepper_(a, pool), pool_(pool) {}
  // `follow` (may be null): bytes that may come after the walked rule ends (classification).
  void reset(const std::vector<StackTop>& start, const ByteSet* follow);
  // Walks `token`, whose first `shared` bytes equal the previous token's. Returns the depth
  // reached: token.size(), or the first depth with no stack left.
  size_t walk(std::string_view token, size_t shared);
  bool alive(size_t d) const { return !sets_[d].empty(); }
  bool ended(size_t d) const { return ended_[d]; }
  // Some path ended the rule before byte k < d with a byte in `follow` next.
  bool exited_before(size_t d) const { return exited_[d]; }

 private:
  const Automaton& a_;
  Stepper stepper_;
  StackPool& pool_;
  const ByteSet* follow_ = nullptr;
  std::vector<std::vector<StackTop>> sets_;
  std::vector<uint8_t> ended_, exited_;
  std::vector<size_t> pool_mark_;  // pool size before depth d + 1 was computed
  size_t valid_ = 0;
};

}  // namespace di::grammar::detail
