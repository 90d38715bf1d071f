#include "grammar/compiled_grammar.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
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

// Tokens of at most this many bytes are classified once per class of states that behave alike
// for that many bytes; longer tokens (under 1 % of the DeepSeek vocabulary) are walked per state.
constexpr size_t kShortToken = 16;

struct RawTokens {
  std::vector<int32_t> accepted;   // ids
  std::vector<int32_t> uncertain;  // sorted-vocabulary indices
};

// Walks the sorted-vocabulary indices produced by `next_index` (ascending) from `state`.
template <class NextIndex>
RawTokens walk_tokens(const Automaton& a, const Vocabulary& v, int32_t state, detail::StackPool& pool, NextIndex next_index) {
  detail::PrefixWalker walker(a, pool);
  const size_t base = pool.size();
  const std::vector<detail::StackTop> start{{state, detail::kContext}};
  const ByteSet& follow = a.follow[a.states[state].rule];
  walker.reset(start, &follow);
  RawTokens out;
  std::string_view prev;
  for (int32_t k; (k = next_index()) >= 0;) {
    const std::string_view tok = v.sorted_bytes(k);
    size_t shared = 0;
    while (shared < prev.size() && shared < tok.size() && prev[shared] == tok[shared]) ++shared;
    prev = tok;
    const size_t d = walker.walk(tok, shared);
    if (d == tok.size() && (walker.alive(d) || walker.ended(d))) {
      out.accepted.push_back(v.sorted_id(k));
    } else if (walker.exited_before(d) ||
               (d < tok.size() && walker.ended(d) && byteset_has(follow, static_cast<uint8_t>(tok[d])))) {
      out.uncertain.push_back(k);
    }
  }
  pool.truncate(base);
  return out;
}

// All tokens whose first byte the state reads.
RawTokens classify_all(const Automaton& a, const Vocabulary& v, const std::array<int32_t, 257>& by_first, int32_t state,
                       detail::StackPool& pool) {
  int b = -1;
  int32_t k = 0, end = 0;
  return walk_tokens(a, v, state, pool, [&]() -> int32_t {
    while (k >= end) {
      do {
        if (++b >= 256) return -1;
      } while (a.step(state, static_cast<uint8_t>(b)) < 0);
      k = by_first[b];
      end = by_first[b + 1];
    }
    return k++;
  });
}

StateTokens finish(const Vocabulary& v, std::vector<int32_t> accepted, std::vector<int32_t> uncertain) {
  StateTokens out;
  std::sort(accepted.begin(), accepted.end());
  if (accepted.size() > static_cast<size_t>(v.mask_words())) {
    out.accepted_bits.assign(v.mask_words(), 0);
    for (int32_t id : accepted) out.accepted_bits[id >> 5] |= 1u << (id & 31);
  } else {
    out.accepted_ids = std::move(accepted);
  }
  std::sort(uncertain.begin(), uncertain.end());
  out.uncertain = std::move(uncertain);
  out.uncertain_lcp.resize(out.uncertain.size());
  for (size_t i = 1; i < out.uncertain.size(); ++i) {
    const std::string_view p = v.sorted_bytes(out.uncertain[i - 1]), c = v.sorted_bytes(out.uncertain[i]);
    size_t l = 0;
    while (l < p.size() && l < c.size() && p[l] == c[l]) ++l;
    out.uncertain_lcp[i] = static_cast<int32_t>(l);
  }
  return out;
}

// A member of a class: its representative's results for short tokens, its own for long ones.
// `long_ids`: ids of the long tokens.
StateTokens classify_member(const Automaton& a, const Vocabulary& v, const StateTokens& rep,
                            const std::vector<int32_t>& long_tokens, const std::vector<int32_t>& long_ids, int32_t state,
                            detail::StackPool& pool) {
  size_t i = 0;
  RawTokens own = walk_tokens(a, v, state, pool, [&]() -> int32_t { return i < long_tokens.size() ? long_tokens[i++] : -1; });
  auto is_short = [&](int32_t id) { return v.token_bytes(id).size() <= kShortToken; };
  StateTokens out;
  if (!rep.accepted_bits.empty()) {
    out.accepted_bits = rep.accepted_bits;
    for (int32_t id : long_ids) out.accepted_bits[id >> 5] &= ~(1u << (id & 31));
    for (int32_t id : own.accepted) out.accepted_bits[id >> 5] |= 1u << (id & 31);
  } else {
    for (int32_t id : rep.accepted_ids) {
      if (is_short(id)) own.accepted.push_back(id);
    }
    out = finish(v, std::move(own.accepted), {});
  }
  std::vector<int32_t> uncertain = std::move(own.uncertain);
  for (int32_t k : rep.uncertain) {
    if (v.sorted_bytes(k).size() <= kShortToken) uncertain.push_back(k);
  }
  StateTokens u = finish(v, {}, std::move(uncertain));
  out.uncertain = std::move(u.uncertain);
  out.uncertain_lcp = std::move(u.uncertain_lcp);
  return out;
}

// Classes of states that no byte string of up to `depth` bytes tells apart (Moore refinement over
// byte edges, calls with their return states, ends and follow sets). States of one class
// classify every token of up to `depth` bytes the same way.
std::vector<int32_t> behavior_classes(const Automaton& a, size_t depth) {
  const size_t n = a.states.size();
  std::vector<int32_t> cls(n);
  std::map<std::vector<uint64_t>, int32_t> ids;
  auto intern = [&](const std::vector<uint64_t>& key) {
    return ids.emplace(key, static_cast<int32_t>(ids.size())).first->second;
  };
  std::vector<uint64_t> key;
  for (size_t s = 0; s < n; ++s) {
    const auto& st = a.states[s];
    const ByteSet& f = a.follow[st.rule];
    key = {st.final ? 1u : 0u, f[0], f[1], f[2], f[3]};
    cls[s] = intern(key);
  }
  size_t count = ids.size();
  for (size_t round = 0; round < depth; ++round) {
    ids.clear();
    std::vector<int32_t> next_cls(n);
    for (size_t s = 0; s < n; ++s) {
      const auto& st = a.states[s];
      key.assign(1, static_cast<uint64_t>(cls[s]));
      for (int b = 0; b < 256; ++b) {
        const int32_t t = a.step(static_cast<int32_t>(s), static_cast<uint8_t>(b));
        key.push_back(t < 0 ? ~uint64_t{0} : static_cast<uint64_t>(cls[t]));
      }
      for (uint32_t c = st.call_begin; c < st.call_end; ++c) {
        key.push_back((static_cast<uint64_t>(a.calls[c].callee_start) << 32) | static_cast<uint32_t>(cls[a.calls[c].ret]));
      }
      next_cls[s] = intern(key);
    }
    cls.swap(next_cls);
    if (ids.size() == count) break;  // stable: no longer string tells more apart
    count = ids.size();
  }
  return cls;
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
  std::vector<int32_t> long_tokens, long_ids;
  for (int32_t k = 0; k < v.num_sorted(); ++k) {
    if (v.sorted_bytes(k).size() > kShortToken) {
      long_tokens.push_back(k);
      long_ids.push_back(v.sorted_id(k));
    }
  }
  // Representatives (the first byte state of each class) get a full pass over the vocabulary;
  // the other members reuse it and walk only the long tokens.
  const std::vector<int32_t> cls = behavior_classes(a, kShortToken);
  std::map<int32_t, size_t> rep_of_class;
  std::vector<size_t> reps, members, rep_index(byte_states.size());
  for (size_t i = 0; i < byte_states.size(); ++i) {
    auto [it, inserted] = rep_of_class.emplace(cls[byte_states[i]], i);
    rep_index[i] = it->second;
    (inserted ? reps : members).push_back(i);
  }
  auto run_parallel = [&](const std::vector<size_t>& items, auto&& job) {
    std::atomic<size_t> next{0};
    auto work = [&] {
      detail::StackPool pool;
      for (size_t i; (i = next.fetch_add(1)) < items.size();) job(items[i], pool);
    };
    const int threads = std::clamp<int>(opt.threads, 1, std::max<int>(1, static_cast<int>(items.size())));
    std::vector<std::thread> helpers;
    for (int t = 1; t < threads; ++t) helpers.emplace_back(work);
    work();
    for (auto& t : helpers) t.join();
  };
  run_parallel(reps, [&](size_t i, detail::StackPool& pool) {
    RawTokens raw = classify_all(a, v, by_first, byte_states[i], pool);
    cg->tokens_[i] = finish(v, std::move(raw.accepted), std::move(raw.uncertain));
  });
  run_parallel(members, [&](size_t i, detail::StackPool& pool) {
    cg->tokens_[i] = classify_member(a, v, cg->tokens_[rep_index[i]], long_tokens, long_ids, byte_states[i], pool);
  });
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
