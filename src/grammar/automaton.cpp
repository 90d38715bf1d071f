#include "grammar/automaton.h"

#include <algorithm>
#include <functional>
#include <map>
#include <unordered_map>

namespace di::grammar {

namespace {

using K = Expr::Kind;

// UTF-8 encodings of a code point range as byte-range sequences: each sequence is a product of
// per-byte ranges, and together they cover exactly the range's encodings.
struct ByteRange {
  uint8_t lo, hi;
};
using ByteSeq = std::vector<ByteRange>;

int utf8_len(uint32_t cp) { return cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4; }

void utf8_sequences(uint32_t lo, uint32_t hi, std::vector<ByteSeq>& out) {
  static constexpr uint32_t kLenEnd[] = {0x7F, 0x7FF, 0xFFFF};
  for (uint32_t end : kLenEnd) {
    if (lo <= end && hi > end) {
      utf8_sequences(lo, end, out);
      utf8_sequences(end + 1, hi, out);
      return;
    }
  }
  const int n = utf8_len(lo);
  for (int i = 1; i < n; ++i) {
    const uint32_t m = (1u << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        utf8_sequences(lo, lo | m, out);
        utf8_sequences((lo | m) + 1, hi, out);
        return;
      }
      if ((hi & m) != m) {
        utf8_sequences(lo, (hi & ~m) - 1, out);
        utf8_sequences(hi & ~m, hi, out);
        return;
      }
    }
  }
  std::string a, b;
  append_utf8(a, lo);
  append_utf8(b, hi);
  ByteSeq seq;
  for (size_t i = 0; i < a.size(); ++i) seq.push_back({static_cast<uint8_t>(a[i]), static_cast<uint8_t>(b[i])});
  out.push_back(std::move(seq));
}

size_t expr_size(const Expr& e) {
  size_t n = 1;
  for (const Expr& c : e.items) n += expr_size(c);
  return n;
}

bool has_refs(const Expr& e) {
  if (e.kind == K::kRef) return true;
  for (const Expr& c : e.items) {
    if (has_refs(c)) return true;
  }
  return false;
}

// A repetition of a wide character class: its states accept most of the vocabulary, so each copy
// of such a rule costs a full classification. Shared as one rule, it is classified once.
bool has_wide_loop(const Expr& e) {
  if (e.kind == K::kRepeat && (e.max == Expr::kUnbounded || e.max > 4)) {
    std::vector<const Expr*> stack{&e.items[0]};
    while (!stack.empty()) {
      const Expr* x = stack.back();
      stack.pop_back();
      if (x->kind == K::kClass) {
        uint64_t n = 0;
        for (CodeRange r : x->ranges) n += r.hi - r.lo + 1;
        if (n > 32) return true;
      }
      for (const Expr& c : x->items) stack.push_back(&c);
    }
  }
  for (const Expr& c : e.items) {
    if (has_wide_loop(c)) return true;
  }
  return false;
}

void count_refs(const Expr& e, const std::unordered_map<std::string, int32_t>& index, std::vector<int>& counts) {
  if (e.kind == K::kRef) {
    if (auto it = index.find(e.text); it != index.end()) ++counts[it->second];
  }
  for (const Expr& c : e.items) count_refs(c, index, counts);
}

// Thompson NFA of one rule.
struct Nfa {
  struct State {
    std::vector<int32_t> eps;
    std::vector<std::pair<ByteRange, int32_t>> bytes;
    std::vector<std::pair<int32_t, int32_t>> calls;  // (rule, target)
  };
  std::vector<State> states;
  size_t limit = 0;

  int32_t add() {
    if (states.size() >= limit) throw GrammarError("grammar too large (automaton state limit reached)");
    states.emplace_back();
    return static_cast<int32_t>(states.size() - 1);
  }
};

class RuleBuilder {
 public:
  RuleBuilder(const Grammar& g, const std::unordered_map<std::string, int32_t>& index,
              const std::vector<bool>& inlined, Nfa& nfa)
      : g_(g), index_(index), inlined_(inlined), nfa_(nfa) {}

  // Adds the expression's NFA starting at `from`; returns its end state.
  int32_t build(const Expr& e, int32_t from) {
    switch (e.kind) {
      case K::kEmpty: return from;
      case K::kBytes: {
        int32_t cur = from;
        for (char c : e.text) {
          const int32_t nx = nfa_.add();
          const uint8_t b = static_cast<uint8_t>(c);
          nfa_.states[cur].bytes.push_back({{b, b}, nx});
          cur = nx;
        }
        return cur;
      }
      case K::kClass: {
        const int32_t end = nfa_.add();
        std::vector<ByteSeq> seqs;
        for (CodeRange r : e.ranges) utf8_sequences(r.lo, r.hi, seqs);
        if (seqs.empty()) return nfa_.add();  // matches nothing: a dead end
        for (const ByteSeq& s : seqs) {
          int32_t cur = from;
          for (size_t i = 0; i < s.size(); ++i) {
            const int32_t nx = i + 1 == s.size() ? end : nfa_.add();
            nfa_.states[cur].bytes.push_back({s[i], nx});
            cur = nx;
          }
        }
        return end;
      }
      case K::kRef: {
        const auto it = index_.find(e.text);
        if (it == index_.end()) throw GrammarError("undefined rule '" + e.text + "'");
        if (inlined_[it->second]) return build(g_.rules()[it->second].body, from);
        const int32_t end = nfa_.add();
        nfa_.states[from].calls.push_back({it->second, end});
        return end;
      }
      case K::kSeq: {
        int32_t cur = from;
        for (const Expr& c : e.items) cur = build(c, cur);
        return cur;
      }
      case K::kAlt: {
        const int32_t end = nfa_.add();
        for (const Expr& c : e.items) {
          const int32_t s = nfa_.add();
          nfa_.states[from].eps.push_back(s);
          nfa_.states[build(c, s)].eps.push_back(end);
        }
        return end;
      }
      case K::kRepeat: {
        const Expr& in = e.items[0];
        int32_t cur = from;
        for (int i = 0; i < e.min; ++i) cur = build(in, cur);
        if (e.max == Expr::kUnbounded) {
          const int32_t loop = nfa_.add();
          nfa_.states[cur].eps.push_back(loop);
          const int32_t body = nfa_.add();
          nfa_.states[loop].eps.push_back(body);
          nfa_.states[build(in, body)].eps.push_back(loop);
          return loop;
        }
        const int32_t end = nfa_.add();
        for (int i = e.min; i < e.max; ++i) {
          nfa_.states[cur].eps.push_back(end);
          cur = build(in, cur);
        }
        nfa_.states[cur].eps.push_back(end);
        return end;
      }
    }
    return from;
  }

 private:
  const Grammar& g_;
  const std::unordered_map<std::string, int32_t>& index_;
  const std::vector<bool>& inlined_;
  Nfa& nfa_;
};

// Subset construction. Output states are local to the rule.
struct RuleDfa {
  struct State {
    bool final = false;
    std::array<int32_t, 256> next;
    std::vector<std::pair<int32_t, int32_t>> calls;  // (callee rule, target)
  };
  std::vector<State> states;
};

RuleDfa determinize(const Nfa& nfa, int32_t start, int32_t accept, int max_states, const std::string& rule_name) {
  RuleDfa dfa;
  std::map<std::vector<int32_t>, int32_t> ids;
  std::vector<std::vector<int32_t>> sets;
  std::vector<uint8_t> mark(nfa.states.size(), 0);

  auto closure = [&](std::vector<int32_t> seed) {
    std::vector<int32_t> out;
    std::vector<int32_t> stack = std::move(seed);
    while (!stack.empty()) {
      const int32_t s = stack.back();
      stack.pop_back();
      if (mark[s]) continue;
      mark[s] = 1;
      out.push_back(s);
      for (int32_t t : nfa.states[s].eps) stack.push_back(t);
    }
    for (int32_t s : out) mark[s] = 0;
    std::sort(out.begin(), out.end());
    return out;
  };
  auto intern = [&](std::vector<int32_t> set) -> int32_t {
    if (set.empty()) return -1;
    auto [it, inserted] = ids.emplace(set, static_cast<int32_t>(sets.size()));
    if (inserted) {
      if (static_cast<int>(sets.size()) >= max_states) {
        throw GrammarError("rule '" + rule_name + "' is too large as an automaton (over " +
                           std::to_string(max_states) + " states)");
      }
      sets.push_back(std::move(set));
    }
    return it->second;
  };

  intern(closure({start}));
  std::vector<std::vector<int32_t>> per_byte(256);
  for (size_t i = 0; i < sets.size(); ++i) {
    const std::vector<int32_t> set = sets[i];
    RuleDfa::State st;
    st.next.fill(-1);
    for (auto& v : per_byte) v.clear();
    std::map<int32_t, std::vector<int32_t>> call_targets;
    for (int32_t s : set) {
      if (s == accept) st.final = true;
      for (const auto& [r, t] : nfa.states[s].bytes) {
        for (int b = r.lo; b <= r.hi; ++b) per_byte[b].push_back(t);
      }
      for (const auto& [rule, t] : nfa.states[s].calls) call_targets[rule].push_back(t);
    }
    std::map<std::vector<int32_t>, int32_t> seen;  // raw target list -> dfa state
    for (int b = 0; b < 256; ++b) {
      if (per_byte[b].empty()) continue;
      std::sort(per_byte[b].begin(), per_byte[b].end());
      per_byte[b].erase(std::unique(per_byte[b].begin(), per_byte[b].end()), per_byte[b].end());
      auto it = seen.find(per_byte[b]);
      if (it == seen.end()) it = seen.emplace(per_byte[b], intern(closure(per_byte[b]))).first;
      st.next[b] = it->second;
    }
    for (auto& [rule, targets] : call_targets) st.calls.push_back({rule, intern(closure(targets))});
    dfa.states.push_back(std::move(st));
  }
  return dfa;
}

}  // namespace

Automaton build_automaton(const Grammar& g, const AutomatonOptions& opt) {
  const auto& rules = g.rules();
  std::unordered_map<std::string, int32_t> index;
  for (size_t i = 0; i < rules.size(); ++i) index[rules[i].name] = static_cast<int32_t>(i);
  const auto root_it = index.find(g.root());
  if (root_it == index.end()) throw GrammarError("grammar has no rule '" + g.root() + "' (the root)");
  std::vector<int> ref_counts(rules.size(), 0);
  for (const Rule& r : rules) count_refs(r.body, index, ref_counts);
  std::vector<bool> inlined(rules.size(), false);
  for (size_t i = 0; i < rules.size(); ++i) {
    inlined[i] = static_cast<int32_t>(i) != root_it->second && !has_refs(rules[i].body) &&
                 expr_size(rules[i].body) <= static_cast<size_t>(opt.inline_max_nodes) &&
                 (ref_counts[i] <= 1 || !has_wide_loop(rules[i].body));
  }

  // Rules reachable from the root, in discovery order; only these are built.
  std::vector<int32_t> order{root_it->second};
  std::vector<int32_t> local(rules.size(), -1);
  local[root_it->second] = 0;
  std::vector<RuleDfa> dfas;
  size_t total_states = 0;
  for (size_t k = 0; k < order.size(); ++k) {
    const int32_t r = order[k];
    Nfa nfa;
    nfa.limit = static_cast<size_t>(opt.max_states_per_rule) * 4;
    const int32_t start = nfa.add();
    RuleBuilder builder(g, index, inlined, nfa);
    const int32_t accept = builder.build(rules[r].body, start);
    dfas.push_back(determinize(nfa, start, accept, opt.max_states_per_rule, rules[r].name));
    total_states += dfas.back().states.size();
    if (total_states > static_cast<size_t>(opt.max_states)) {
      throw GrammarError("grammar too large (over " + std::to_string(opt.max_states) + " automaton states)");
    }
    for (const auto& st : dfas.back().states) {
      for (const auto& [callee, t] : st.calls) {
        if (local[callee] < 0) {
          local[callee] = static_cast<int32_t>(order.size());
          order.push_back(callee);
        }
      }
    }
  }

  Automaton a;
  a.root_rule = 0;
  const size_t nrules = order.size();
  a.rule_start.resize(nrules);
  for (size_t k = 0; k < nrules; ++k) {
    a.rule_names.push_back(rules[order[k]].name);
    a.rule_start[k] = static_cast<int32_t>(a.states.size());
    a.states.resize(a.states.size() + dfas[k].states.size());
  }
  a.next.assign(a.states.size() * 256, -1);
  // Per-state call lists before trimming: (callee rule, global target).
  std::vector<std::vector<std::pair<int32_t, int32_t>>> calls(a.states.size());
  for (size_t k = 0; k < nrules; ++k) {
    const int32_t base = a.rule_start[k];
    for (size_t i = 0; i < dfas[k].states.size(); ++i) {
      const auto& ds = dfas[k].states[i];
      const int32_t s = base + static_cast<int32_t>(i);
      a.states[s].rule = static_cast<int32_t>(k);
      a.states[s].final = ds.final;
      for (int b = 0; b < 256; ++b) {
        if (ds.next[b] >= 0) a.next[static_cast<size_t>(s) * 256 + b] = base + ds.next[b];
      }
      for (const auto& [callee, t] : ds.calls) calls[s].push_back({local[callee], base + t});
    }
  }
  dfas.clear();
  const size_t n = a.states.size();

  // Productive rules: the start reaches an end through bytes and calls of productive rules.
  std::vector<bool> productive(nrules, false);
  auto reaches_end = [&](int32_t rule, const std::vector<bool>& callee_ok) {
    std::vector<int32_t> stack{a.rule_start[rule]};
    std::vector<bool> seen(n, false);
    seen[a.rule_start[rule]] = true;
    while (!stack.empty()) {
      const int32_t s = stack.back();
      stack.pop_back();
      if (a.states[s].final) return true;
      auto push = [&](int32_t t) {
        if (t >= 0 && !seen[t]) {
          seen[t] = true;
          stack.push_back(t);
        }
      };
      for (int b = 0; b < 256; ++b) push(a.step(s, static_cast<uint8_t>(b)));
      for (const auto& [callee, t] : calls[s]) {
        if (callee_ok[callee]) push(t);
      }
    }
    return false;
  };
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < nrules; ++r) {
      if (!productive[r] && reaches_end(static_cast<int32_t>(r), productive)) {
        productive[r] = changed = true;
      }
    }
  }
  if (!productive[0]) throw GrammarError("the grammar matches no string (rule '" + a.rule_names[0] + "' cannot end)");

  // Trim: drop calls of unproductive rules and states from which the rule cannot end.
  for (size_t s = 0; s < n; ++s) {
    std::erase_if(calls[s], [&](const auto& c) { return !productive[c.first]; });
  }
  std::vector<bool> live(n, false);
  {
    std::vector<std::vector<int32_t>> preds(n);
    for (size_t s = 0; s < n; ++s) {
      for (int b = 0; b < 256; ++b) {
        const int32_t t = a.step(static_cast<int32_t>(s), static_cast<uint8_t>(b));
        if (t >= 0 && (preds[t].empty() || preds[t].back() != static_cast<int32_t>(s))) preds[t].push_back(static_cast<int32_t>(s));
      }
      for (const auto& [callee, t] : calls[s]) preds[t].push_back(static_cast<int32_t>(s));
    }
    std::vector<int32_t> stack;
    for (size_t s = 0; s < n; ++s) {
      if (a.states[s].final) {
        live[s] = true;
        stack.push_back(static_cast<int32_t>(s));
      }
    }
    while (!stack.empty()) {
      const int32_t s = stack.back();
      stack.pop_back();
      for (int32_t p : preds[s]) {
        if (!live[p]) {
          live[p] = true;
          stack.push_back(p);
        }
      }
    }
  }
  for (size_t s = 0; s < n; ++s) {
    for (int b = 0; b < 256; ++b) {
      int32_t& t = a.next[s * 256 + b];
      if (t >= 0 && !live[t]) t = -1;
      if (t >= 0) a.states[s].has_bytes = true;
    }
    std::erase_if(calls[s], [&](const auto& c) { return !live[c.second]; });
    a.states[s].call_begin = static_cast<uint32_t>(a.calls.size());
    for (const auto& [callee, t] : calls[s]) a.calls.push_back({a.rule_start[callee], t});
    a.states[s].call_end = static_cast<uint32_t>(a.calls.size());
  }

  // Nullable rules (can end without bytes), then left recursion: a rule that reaches a call of
  // itself without consuming a byte.
  std::vector<bool> nullable(nrules, false);
  auto epsilon_states = [&](int32_t rule) {  // states reachable from the start without bytes
    std::vector<int32_t> out{a.rule_start[rule]};
    std::vector<bool> seen(n, false);
    seen[a.rule_start[rule]] = true;
    for (size_t i = 0; i < out.size(); ++i) {
      const auto& st = a.states[out[i]];
      for (uint32_t c = st.call_begin; c < st.call_end; ++c) {
        const auto& call = a.calls[c];
        if (nullable[a.states[call.callee_start].rule] && !seen[call.ret]) {
          seen[call.ret] = true;
          out.push_back(call.ret);
        }
      }
    }
    return out;
  };
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < nrules; ++r) {
      if (nullable[r]) continue;
      for (int32_t s : epsilon_states(static_cast<int32_t>(r))) {
        if (a.states[s].final) {
          nullable[r] = changed = true;
          break;
        }
      }
    }
  }
  std::vector<std::vector<int32_t>> left_calls(nrules);
  for (size_t r = 0; r < nrules; ++r) {
    for (int32_t s : epsilon_states(static_cast<int32_t>(r))) {
      const auto& st = a.states[s];
      for (uint32_t c = st.call_begin; c < st.call_end; ++c) left_calls[r].push_back(a.states[a.calls[c].callee_start].rule);
    }
  }
  std::vector<int> color(nrules, 0);
  std::vector<int32_t> path;
  std::function<void(int32_t)> dfs = [&](int32_t r) {
    color[r] = 1;
    path.push_back(r);
    for (int32_t c : left_calls[r]) {
      if (color[c] == 1) {
        std::string cycle;
        auto it = std::find(path.begin(), path.end(), c);
        for (; it != path.end(); ++it) cycle += a.rule_names[*it] + " -> ";
        throw GrammarError("left recursion: " + cycle + a.rule_names[c]);
      }
      if (color[c] == 0) dfs(c);
    }
    path.pop_back();
    color[r] = 2;
  };
  for (size_t r = 0; r < nrules; ++r) {
    if (color[r] == 0) dfs(static_cast<int32_t>(r));
  }

  // Follow sets (fixpoint): first(s) = bytes out of s, firsts of callees (and what follows a
  // nullable callee), and follow(rule) when s may end the rule; follow(r) = first of each return
  // state of a call of r.
  std::vector<ByteSet> first(n, ByteSet{});
  a.follow.assign(nrules, ByteSet{});
  auto merge = [](ByteSet& dst, const ByteSet& src) {
    bool changed = false;
    for (int i = 0; i < 4; ++i) {
      const uint64_t v = dst[i] | src[i];
      changed |= v != dst[i];
      dst[i] = v;
    }
    return changed;
  };
  for (size_t s = 0; s < n; ++s) {
    for (int b = 0; b < 256; ++b) {
      if (a.next[s * 256 + b] >= 0) byteset_add(first[s], static_cast<uint8_t>(b));
    }
  }
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t s = 0; s < n; ++s) {
      const auto& st = a.states[s];
      for (uint32_t c = st.call_begin; c < st.call_end; ++c) {
        const auto& call = a.calls[c];
        const int32_t callee = a.states[call.callee_start].rule;
        changed |= merge(first[s], first[call.callee_start]);
        if (nullable[callee]) changed |= merge(first[s], first[call.ret]);
        changed |= merge(a.follow[callee], first[call.ret]);
      }
      if (st.final) changed |= merge(first[s], a.follow[st.rule]);
    }
  }
  return a;
}

}  // namespace di::grammar
