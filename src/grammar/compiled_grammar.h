// A grammar compiled against a vocabulary: the automaton plus, for every state that reads bytes,
// the tokens classified ahead of time (the XGrammar idea of an adaptive token mask).
//
// For a state q of rule r, each token is walked from q with an unknown caller below r:
//  - accepted: some path consumes the whole token inside r (or r ends exactly at its last byte);
//  - rejected: no path does, and no path ends r with a next byte that may follow r anywhere;
//  - uncertain: otherwise; only these are walked at run time, against the real stack.
// Immutable after compile, so one CompiledGrammar serves any number of matchers and threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "grammar/automaton.h"
#include "grammar/grammar.h"
#include "grammar/vocabulary.h"

namespace di::grammar {

struct StateTokens {
  // Accepted tokens: a dense bitmask (mask_words words) when large, else a sorted id list.
  std::vector<uint32_t> accepted_bits;
  std::vector<int32_t> accepted_ids;
  // Uncertain tokens as indices into the vocabulary's sorted order (ascending), with the common
  // prefix length of each with the one before.
  std::vector<int32_t> uncertain;
  std::vector<int32_t> uncertain_lcp;
};

struct CompileOptions {
  AutomatonOptions automaton;
  int threads = 1;  // for the classification, which dominates compile time
};

class CompiledGrammar {
 public:
  static std::shared_ptr<const CompiledGrammar> compile(const Grammar& g, std::shared_ptr<const Vocabulary> vocab,
                                                         const CompileOptions& opt = {});

  const Automaton& automaton() const { return automaton_; }
  const Vocabulary& vocab() const { return *vocab_; }
  const std::shared_ptr<const Vocabulary>& vocab_ptr() const { return vocab_; }
  // Classification of a state that reads bytes (null for other states).
  const StateTokens* tokens(int32_t state) const {
    return state_tokens_[state] < 0 ? nullptr : &tokens_[state_tokens_[state]];
  }
  double compile_seconds() const { return compile_seconds_; }
  // Totals over all states, for benchmarks and docs.
  size_t num_classified_states() const { return tokens_.size(); }
  size_t num_uncertain_tokens() const;
  size_t memory_bytes() const;

 private:
  CompiledGrammar() = default;
  Automaton automaton_;
  std::shared_ptr<const Vocabulary> vocab_;
  std::vector<int32_t> state_tokens_;
  std::vector<StateTokens> tokens_;
  double compile_seconds_ = 0;
};

}  // namespace di::grammar
