// The grammar as automata: one deterministic automaton per rule over two kinds of edges, bytes
// and calls of other rules. The matcher runs these as a pushdown automaton (a stack of return
// states), so recursion is real recursion while each rule's regular parts are plain DFA steps.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "grammar/grammar.h"

namespace di::grammar {

using ByteSet = std::array<uint64_t, 4>;
inline bool byteset_has(const ByteSet& s, uint8_t b) { return (s[b >> 6] >> (b & 63)) & 1; }
inline void byteset_add(ByteSet& s, uint8_t b) { s[b >> 6] |= uint64_t{1} << (b & 63); }

struct Automaton {
  struct State {
    int32_t rule = 0;
    bool final = false;      // the rule may end here
    bool has_bytes = false;  // some byte leads on
    uint32_t call_begin = 0, call_end = 0;  // into `calls`
  };
  struct Call {
    int32_t callee_start = 0;  // start state of the called rule
    int32_t ret = 0;           // where this rule goes on after the callee ends
  };

  std::vector<State> states;   // all rules' states, numbered globally
  std::vector<int32_t> next;   // states.size() x 256: byte successor, -1 if none
  std::vector<Call> calls;
  std::vector<std::string> rule_names;
  std::vector<int32_t> rule_start;
  std::vector<ByteSet> follow;  // per rule: bytes that may come right after the rule ends
  int32_t root_rule = 0;

  int32_t step(int32_t state, uint8_t byte) const { return next[static_cast<size_t>(state) * 256 + byte]; }
  int32_t root_start() const { return rule_start[root_rule]; }
};

struct AutomatonOptions {
  // Rules without references whose body has at most this many syntax nodes are copied into their
  // callers: fewer stack frames, and more tokens classified ahead of time. Rules used more than
  // once that loop over a wide character class (strings) stay shared: classifying each copy
  // would cost a pass over the whole vocabulary per state.
  int inline_max_nodes = 48;
  // Each state holds a 256-entry transition table (1 KiB): these bound a grammar's memory.
  int max_states_per_rule = 20000;
  int max_states = 50000;
};

// Throws GrammarError for undefined rules, left recursion (naming the cycle), an empty language
// and automata over the size limit.
Automaton build_automaton(const Grammar& g, const AutomatonOptions& opt = {});

}  // namespace di::grammar
