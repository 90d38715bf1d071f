#include "grammar/compiled_grammar.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#include "grammar/pda.h"

namespace di::grammar {

namespace {

// Sorted-vocabulary ranges by first byte: tokens starting with byte b are [begin[b], begin[b+1]).
std::array<int32_t, 257> first_byte_ranges(const Vocabulary& v) {
  std::array<int32_t, 257> begin{};
  int32_t k = 0;
  for (int b = 0; b < 256; ++b) {
    begin[b] = k;
    while (k < v.num_sorted() && static_cast<uint8_t>(v.sorted_bytes(k)[0]) == b) ++k;
  }
  begin[256] = k;
  return begin;
}

StateTokens classify(const Automaton& a, const Vocabulary& v, const std::array<int32_t, 257>& by_first,
                     int32_t state, detail::StackPool& pool) {
  detail::PrefixWalker walker(a, pool);
  const size_t base = pool.size();
  const std::vector<detail::StackTop> start{{state, detail::kContext}};
  walker.reset(start, &a.follow[a.states[state].rule]);
  std::vector<int32_t> accepted, uncertain;
  for (int b = 0; b < 256; ++b) {
    // The start is not closed: only the state's own byte edges lead anywhere.
    if (a.step(state, static_cast<uint8_t>(b)) < 0) continue;
    size_t shared = 0;
    for (int32_t k = by_first[b]; k < by_first[b + 1]; ++k) {
      const std::string_view tok = v.sorted_bytes(k);
      if (k > by_first[b]) shared = static_cast<size_t>(v.lcp(k));
      const size_t d = walker.walk(tok, shared);
      if (d == tok.size() && (walker.alive(d) || walker.ended(d))) {
        accepted.push_back(v.sorted_id(k));
      } else if (walker.exited_before(d) ||
                 (d < tok.size() && walker.ended(d) && byteset_has(a.follow[a.states[state].rule], static_cast<uint8_t>(tok[d])))) {
        uncertain.push_back(k);
      }
    }
  }
  pool.truncate(base);

  StateTokens out;
  std::sort(accepted.begin(), accepted.end());
  if (accepted.size() > static_cast<size_t>(v.mask_words())) {
    out.accepted_bits.assign(v.mask_words(), 0);
    for (int32_t id : accepted) out.accepted_bits[id >> 5] |= 1u << (id & 31);
  } else {
    out.accepted_ids = std::move(accepted);
  }
  out.uncertain = std::move(uncertain);
  out.uncertain_lcp.resize(out.uncertain.size());
  for (size_t i = 0; i < out.uncertain.size(); ++i) {
    if (i == 0) continue;
    const std::string_view p = v.sorted_bytes(out.uncertain[i - 1]), c = v.sorted_bytes(out.uncertain[i]);
    size_t l = 0;
    while (l < p.size() && l < c.size() && p[l] == c[l]) ++l;
    out.uncertain_lcp[i] = static_cast<int32_t>(l);
  }
  return out;
}

}  // namespace

std::shared_ptr<const CompiledGrammar> CompiledGrammar::compile(const Grammar& g, std::shared_ptr<const Vocabulary> vocab,
                                                                const CompileOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  std::shared_ptr<CompiledGrammar> cg(new CompiledGrammar());
  cg->automaton_ = build_automaton(g, opt.automaton);
  cg->vocab_ = std::move(vocab);
  const Automaton& a = cg->automaton_;
  const Vocabulary& v = *cg->vocab_;

  std::vector<int32_t> byte_states;
  cg->state_tokens_.assign(a.states.size(), -1);
  for (size_t s = 0; s < a.states.size(); ++s) {
    if (a.states[s].has_bytes) {
      cg->state_tokens_[s] = static_cast<int32_t>(byte_states.size());
      byte_states.push_back(static_cast<int32_t>(s));
    }
  }
  cg->tokens_.resize(byte_states.size());
  const auto by_first = first_byte_ranges(v);
  std::atomic<size_t> next{0};
  auto work = [&] {
    detail::StackPool pool;
    for (size_t i; (i = next.fetch_add(1)) < byte_states.size();) {
      cg->tokens_[i] = classify(a, v, by_first, byte_states[i], pool);
    }
  };
  const int threads = std::clamp<int>(opt.threads, 1, std::max<int>(1, static_cast<int>(byte_states.size())));
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  cg->compile_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return cg;
}

size_t CompiledGrammar::num_uncertain_tokens() const {
  size_t n = 0;
  for (const StateTokens& t : tokens_) n += t.uncertain.size();
  return n;
}

size_t CompiledGrammar::memory_bytes() const {
  size_t n = automaton_.next.size() * 4 + automaton_.states.size() * sizeof(Automaton::State);
  for (const StateTokens& t : tokens_) {
    n += (t.accepted_bits.size() + t.accepted_ids.size() + t.uncertain.size() + t.uncertain_lcp.size()) * 4;
  }
  return n;
}

}  // namespace di::grammar
