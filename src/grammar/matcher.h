// Per-sequence grammar state: which tokens may come next, advancing by accepted tokens, rollback.
//
// Typical decode loop (the engine keeps one matcher per sequence, all sharing one CompiledGrammar):
//   matcher.fill_mask(bits);           // before sampling: bit id of bits[id / 32] = token allowed
//   ... mask logits, sample id ...
//   matcher.accept_token(id);          // after sampling
//   if (matcher.is_terminated()) stop; // a stop token was accepted
// Speculative decoding: accept the draft tokens one by one (accept_token returns false at the first
// the grammar rejects), then rollback(n) the ones the target model did not verify.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "grammar/compiled_grammar.h"
#include "grammar/pda.h"

namespace di::grammar {

class GrammarMatcher {
 public:
  explicit GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar);

  // Writes the allowed-token bitmask: bits.size() must be vocab().mask_words(). Stop tokens are
  // allowed exactly when the grammar may end; added (control) tokens never, unless the vocabulary
  // counts them as text. After termination only the stop tokens are allowed.
  void fill_mask(std::span<uint32_t> bits);
  // Advances by one token. Returns false, leaving the state unchanged, if the token is not allowed.
  bool accept_token(int32_t id);
  // Advances by raw bytes (e.g. forced text inserted without sampling). False, unchanged, if the
  // grammar rejects them. Counts as one step for rollback.
  bool accept_bytes(std::string_view bytes);
  // Undoes the last n accepted tokens / accept_bytes calls (n <= num_steps()).
  void rollback(int n);
  void reset();

  bool can_end() const { return !terminated_ && can_end_; }  // a stop token is allowed now
  bool is_terminated() const { return terminated_; }         // a stop token was accepted
  // The grammar has ended and no byte can follow: only a stop token remains.
  bool must_end() const { return !terminated_ && can_end_ && stacks_.empty(); }
  // The bytes every continuation starts with (up to the first choice): jump-forward decoding.
  std::string forced_bytes();
  int num_steps() const { return static_cast<int>(history_.size()); }

  const CompiledGrammar& grammar() const { return *grammar_; }

 private:
  struct Step {
    size_t pool_size;
    size_t stacks_begin;  // into saved_stacks_
    bool can_end, terminated;
  };
  void save_step();
  // Stacks after `bytes` from the current ones; false if none survives and the grammar cannot
  // have ended exactly there.
  bool advance_bytes(std::string_view bytes, std::vector<detail::StackTop>& stacks, bool& can_end);

  std::shared_ptr<const CompiledGrammar> grammar_;
  detail::StackPool pool_;
  detail::Stepper stepper_;
  detail::PrefixWalker walker_;
  std::vector<detail::StackTop> stacks_;  // current stacks (each top reads a byte)
  bool can_end_ = false;
  bool terminated_ = false;
  std::vector<Step> history_;
  std::vector<detail::StackTop> saved_stacks_;
  std::vector<detail::StackTop> scratch_a_, scratch_b_, single_;
};

}  // namespace di::grammar
