// A small model behind the di::Model interface, for engine tests that need no checkpoint.
//
// Its logits are a deterministic function of the whole token history, and it computes them from
// what its state holds, not from the engine's token list: one paged stream ("history") stores per
// token its id and a hash chain over every earlier token, and a fixed-size ring (outside the pages,
// like V4.1's window rings) holds the last kRing tokens. A page adopted from the wrong prefix, a
// copy-on-write that copied nothing, a missing resume after adopt_prefix or a truncate that left
// stale rows changes the logits, so greedy output no longer matches fake_greedy().
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvcache/row_cache.h"
#include "engine/engine.h"
#include "model/model.h"

namespace di::test {

class FakeModel final : public Model {
 public:
  static constexpr int kVocab = 97;
  static constexpr int kRing = 3;  // tokens the ring holds, rebuilt by resume()
  static constexpr int32_t kEos = 1;
  static constexpr size_t kFixedBytes = 4096;  // charged to the state pool per sequence

  // With snapshots, a state's snapshot is its ring (restored from the bytes, not the tokens).
  explicit FakeModel(int64_t max_context = 4096, bool snapshots = false) : snapshots_(snapshots) {
    info_.arch = "fake";
    info_.cache_format = "fake;history-rows";
    info_.vocab_size = kVocab;
    info_.sampleable_vocab = kVocab;
    info_.max_context = max_context;
    info_.bos_id = 0;
    info_.eos_id = kEos;
    info_.chat_format = "deepseek-v3";
  }

  struct Row {
    int32_t token;
    uint32_t chain;  // hash of every token up to and including this one
  };

  static uint32_t mix(uint32_t h, int32_t t) {
    uint64_t x = (uint64_t(h) << 32 | uint32_t(t)) + 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return uint32_t(x ^ (x >> 31));
  }

  // Logits after a token whose chain is `chain`, with `ring` the last kRing tokens (oldest first,
  // -1 where the history is shorter). EOS is never the argmax.
  static void logits_for(uint32_t chain, const int32_t* ring, float* out) {
    uint32_t h = chain;
    for (int i = 0; i < kRing; ++i) h = mix(h, ring[i]);
    // Distinct values (the argmax never ties), exact in fp32 before the scaling.
    for (int v = 0; v < kVocab; ++v) out[v] = float((mix(h, v) % 1024) * kVocab + uint32_t(v)) / 12000.0f - 4.0f;
    out[kEos] = -30.0f;
  }

  class State final : public SequenceState {
   public:
    State(const StateOptions& o)
        : opts_(o),
          rows_(sizeof(Row), o.page_tokens, o.pool),
          fixed_(o.state_pool, kFixedBytes),
          ring_(kRing, -1) {}
    int64_t pos() const override { return int64_t(tokens_.size()); }
    const std::vector<int32_t>& tokens() const override { return tokens_; }
    void truncate(int64_t p) override {
      if (p > pos() || p < pos() - opts_.max_rollback || p < floor_) throw std::out_of_range("FakeModel: truncate");
      tokens_.resize(size_t(p));
      rows_.truncate(p);
      set_ring_from_tokens();
    }
    int64_t rollback_floor() const override { return floor_; }
    size_t bytes_needed(int64_t n) const override { return rows_.bytes_needed(n); }
    kvcache::PrefixPages share_prefix(int64_t n) const override {
      if (n % opts_.page_tokens != 0 || n > pos()) throw std::invalid_argument("FakeModel: share_prefix");
      kvcache::PrefixPages p;
      p.n_tokens = n;
      p.streams.push_back(rows_.share_pages(size_t(n / opts_.page_tokens)));
      return p;
    }
    void adopt_prefix(const kvcache::PrefixPages& pages, std::span<const int32_t> tokens) override {
      if (pos() != 0 || pages.streams.size() != 1 || int64_t(tokens.size()) != pages.n_tokens)
        throw std::invalid_argument("FakeModel: adopt_prefix");
      rows_.adopt(pages.streams[0], pages.n_tokens);
      tokens_.assign(tokens.begin(), tokens.end());
      floor_ = pages.n_tokens;
      ring_valid_ = false;  // resume() rebuilds it
    }
    std::vector<std::byte> snapshot() const override {
      if (pos() % opts_.page_tokens != 0) throw std::invalid_argument("FakeModel: snapshot off a page boundary");
      std::vector<std::byte> b(sizeof(int64_t) + ring_.size() * sizeof(int32_t));
      const int64_t p = pos();
      std::memcpy(b.data(), &p, sizeof p);
      std::memcpy(b.data() + sizeof p, ring_.data(), ring_.size() * sizeof(int32_t));
      return b;
    }
    void restore_snapshot(const kvcache::PrefixPages& pages, std::span<const int32_t> tokens,
                          std::span<const std::byte> snap) override {
      int64_t p = -1;
      if (snap.size() == sizeof p + ring_.size() * sizeof(int32_t)) std::memcpy(&p, snap.data(), sizeof p);
      if (p != int64_t(tokens.size())) throw std::invalid_argument("FakeModel: restore_snapshot");
      adopt_prefix(pages, tokens);
      std::memcpy(ring_.data(), snap.data() + sizeof p, ring_.size() * sizeof(int32_t));
      ring_valid_ = true;
      ++restores;
    }
    size_t bytes() const override { return rows_.bytes() + kFixedBytes + tokens_.size() * sizeof(int32_t); }
    size_t fixed_bytes() const override { return kFixedBytes; }
    std::unique_ptr<SequenceState> clone() const override { return std::make_unique<State>(*this); }

    kvcache::PagePool* pool() const { return opts_.pool; }

   private:
    friend class FakeModel;
    void set_ring_from_tokens() {
      for (int i = 0; i < kRing; ++i) {
        const int64_t p = pos() - kRing + i;
        ring_[size_t(i)] = p >= 0 ? tokens_[size_t(p)] : -1;
      }
      ring_valid_ = true;
    }
    void push(int32_t t) {
      const uint32_t prev = rows_.size() > 0 ? rows_.row<Row>(rows_.size() - 1)->chain : 0u;
      Row* r = rows_.append<Row>();
      r->token = t;
      r->chain = mix(prev, t);
      tokens_.push_back(t);
      std::rotate(ring_.begin(), ring_.begin() + 1, ring_.end());
      ring_.back() = t;
    }
    StateOptions opts_;
    kvcache::RowCache rows_;
    kvcache::PoolReservation fixed_;
    std::vector<int32_t> tokens_;
    std::vector<int32_t> ring_;
    bool ring_valid_ = true;
    int64_t floor_ = 0;

   public:
    static inline std::atomic<int64_t> restores{0};
  };

  const ModelInfo& info() const override { return info_; }
  void set_cache_format(std::string f) { info_.cache_format = std::move(f); }
  std::vector<kvcache::StreamLayout> cache_layout(int page_tokens) const override {
    return {{"history", page_tokens, sizeof(Row), kvcache::ElementType::Bytes}};
  }
  std::unique_ptr<SequenceState> new_state(const StateOptions& o) const override { return std::make_unique<State>(o); }
  std::unique_ptr<Workspace> new_workspace() const override { return std::make_unique<Workspace>(); }

  void forward_batch(std::span<BatchItem> items, Workspace&) const override {
    if (items.empty()) throw std::invalid_argument("FakeModel: empty batch");
    std::vector<std::pair<kvcache::PagePool*, size_t>> need;
    for (size_t b = 0; b < items.size(); ++b) {
      auto* st = dynamic_cast<State*>(items[b].state);
      if (!st || !items[b].logits || items[b].tokens.empty()) throw std::invalid_argument("FakeModel: bad batch item");
      if (!st->ring_valid_) throw std::logic_error("FakeModel: forward after adopt_prefix without resume");
      for (int32_t t : items[b].tokens)
        if (t < 0 || t >= kVocab) throw std::out_of_range("FakeModel: token " + std::to_string(t));
      for (size_t o = 0; o < b; ++o)
        if (items[o].state == items[b].state) throw std::invalid_argument("FakeModel: a sequence twice in a batch");
      if (st->pool()) {
        auto it = std::find_if(need.begin(), need.end(), [&](const auto& e) { return e.first == st->pool(); });
        if (it == need.end()) it = need.insert(need.end(), {st->pool(), 0});
        it->second += st->bytes_needed(int64_t(items[b].tokens.size()));
      }
    }
    for (const auto& [pool, bytes] : need)
      if (bytes > pool->free_bytes()) throw kvcache::CacheExhausted("FakeModel: pool exhausted");
    for (auto& it : items) {
      auto* st = static_cast<State*>(it.state);
      it.logits->clear();
      for (size_t i = 0; i < it.tokens.size(); ++i) {
        st->push(it.tokens[i]);
        if (it.all_logits || i + 1 == it.tokens.size()) {
          it.logits->resize(it.logits->size() + kVocab);
          logits_for(st->rows_.row<Row>(st->rows_.size() - 1)->chain, st->ring_.data(),
                     it.logits->data() + it.logits->size() - kVocab);
        }
      }
      rows_run += int64_t(it.tokens.size());
    }
    ++steps;
  }

  int64_t resume_tokens() const override { return kRing; }
  bool has_snapshots() const override { return snapshots_; }
  void resume(SequenceState& s, Workspace&) const override {
    auto& st = dynamic_cast<State&>(s);
    st.set_ring_from_tokens();
    ++resumes;
  }

  // Greedy continuation of `prompt` computed without states, pages or batching.
  static std::vector<int32_t> greedy(const std::vector<int32_t>& prompt, int n) {
    std::vector<int32_t> seq = prompt, out;
    std::vector<float> logits(kVocab);
    for (int i = 0; i < n; ++i) {
      uint32_t chain = 0;
      for (int32_t t : seq) chain = mix(chain, t);
      int32_t ring[kRing];
      for (int k = 0; k < kRing; ++k) {
        const int64_t p = int64_t(seq.size()) - kRing + k;
        ring[k] = p >= 0 ? seq[size_t(p)] : -1;
      }
      logits_for(chain, ring, logits.data());
      const int32_t best = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
      out.push_back(best);
      seq.push_back(best);
    }
    return out;
  }

  mutable std::atomic<int64_t> rows_run{0}, steps{0}, resumes{0};

 private:
  ModelInfo info_;
  bool snapshots_;
};

// A prompt of n ids in the fake vocabulary (never BOS/EOS), different for each seed.
inline std::vector<int32_t> prompt_of(int n, int seed) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(int32_t(2 + (i * 7 + seed * 13) % (FakeModel::kVocab - 2)));
  return p;
}

// Small pages and steps, so that a few dozen tokens exercise paging, chunking and batching.
inline engine::EngineOptions fake_engine_options() {
  engine::EngineOptions o;
  o.cache_budget_bytes = 1 << 20;
  o.page_tokens = 8;
  o.max_batch_tokens = 24;
  o.max_running = 16;
  return o;
}

}  // namespace di::test
