// Fast against exact numerics on a configuration unlike the golden one (make-tiny --size
// tiny-alt: other head/rope dims, window, experts, top-k, source layers, Engram layers). Exact
// plays the reference: block-local resync as in the golden test, with the golden README's bounds;
// and the fast mode's own chunking invariance on this shape.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <vector>

#include "model/v41/model.h"
#include "model/v41/tiny_generator.h"

// Inside di::v41: Model, SequenceState, ... are the concrete V4.1 types, not the interface's.
namespace di::v41 {
namespace fs = std::filesystem;

namespace {

struct AltModels {
  fs::path dir = fs::temp_directory_path() / ("di_numerics_tiny_alt_" + std::to_string(::getpid()));
  std::unique_ptr<Model> fast, exact;
  AltModels() {
    TinyOptions o;
    o.size = "tiny-alt";
    o.seed = 3;
    o.force = true;
    make_tiny_checkpoint(o, dir.string());
    for (Numerics nm : {Numerics::Fast, Numerics::Exact}) {
      LoadOptions lo;
      lo.numerics = nm;
      (nm == Numerics::Fast ? fast : exact) = Model::load(dir.string(), lo);
    }
  }
  ~AltModels() { fs::remove_all(dir); }
};
AltModels& alt() {
  static AltModels a;
  return a;
}

std::vector<int32_t> tokens(const Model& m, int n, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& v : t) v = int32_t(g() % uint32_t(m.sampleable_vocab()));
  return t;
}

using Key = std::pair<int64_t, int>;  // (position, layer)

// Records the exact run: every block's and Engram's input and output, pre_mix, and selections.
struct Recorder : ForwardObserver {
  int stream_n = 0, hc = 0;
  std::map<Key, std::vector<float>> block_in, block_out, engram_in, pre_in;
  std::map<Key, std::vector<int32_t>> index_sel, experts;
  void before_engram(int layer, int64_t start, int S, float* x) override { save(engram_in, layer, start, S, x, stream_n); }
  void before_block(int layer, int64_t start, int S, float* x, float* pre) override {
    save(block_in, layer, start, S, x, stream_n);
    save(pre_in, layer, start, S, pre, hc);
  }
  void after_block(int layer, int64_t start, int S, const float* x, const float*) override {
    save(block_out, layer, start, S, x, stream_n);
  }
  void on_index_topk(int layer, int64_t start, int S, int k, const int32_t* idx, const float*, int64_t) override {
    for (int s = 0; s < S; ++s) index_sel[{start + s, layer}].assign(idx + s * k, idx + (s + 1) * k);
  }
  void on_experts(int layer, int64_t start, int S, int k, const int32_t* ids, const float*) override {
    for (int s = 0; s < S; ++s) experts[{start + s, layer}].assign(ids + s * k, ids + (s + 1) * k);
  }
  template <class T>
  static void save(std::map<Key, std::vector<float>>& m, int layer, int64_t start, int S, const T* x, int n) {
    for (int s = 0; s < S; ++s) m[{start + s, layer}].assign(x + size_t(s) * n, x + size_t(s + 1) * n);
  }
};

// The fast run restarted from the exact run's inputs at every block and Engram.
struct Resync : ForwardObserver {
  const Recorder& ref;
  explicit Resync(const Recorder& r) : ref(r) {}
  std::vector<double> err;
  std::vector<Key> keys;
  std::set<Key> affected;  // blocks that attend to or route by a legitimately different selection
  int selections = 0, differing = 0;
  void before_engram(int layer, int64_t start, int S, float* x) override { load(ref.engram_in, layer, start, S, x, ref.stream_n); }
  void before_block(int layer, int64_t start, int S, float* x, float* pre) override {
    load(ref.block_in, layer, start, S, x, ref.stream_n);
    load(ref.pre_in, layer, start, S, pre, ref.hc);
  }
  void after_block(int layer, int64_t start, int S, const float* x) {
    for (int s = 0; s < S; ++s) {
      const auto& want = ref.block_out.at({start + s, layer});
      double num = 0, den = 0;
      for (int i = 0; i < ref.stream_n; ++i) {
        const double d = double(x[size_t(s) * ref.stream_n + i]) - want[size_t(i)];
        num += d * d;
        den += double(want[size_t(i)]) * want[size_t(i)];
      }
      err.push_back(std::sqrt(num / den));
      keys.push_back({start + s, layer});
    }
  }
  void after_block(int layer, int64_t start, int S, const float* x, const float*) override { after_block(layer, start, S, x); }
  void on_index_topk(int layer, int64_t start, int S, int k, const int32_t* idx, const float*, int64_t) override {
    for (int s = 0; s < S; ++s) compare(ref.index_sel.at({start + s, layer}), idx + s * k, k, start + s, layer, true);
  }
  void on_experts(int layer, int64_t start, int S, int k, const int32_t* ids, const float*) override {
    for (int s = 0; s < S; ++s) compare(ref.experts.at({start + s, layer}), ids + s * k, k, start + s, layer, false);
  }
  void compare(const std::vector<int32_t>& want, const int32_t* got, int k, int64_t pos, int layer, bool index) {
    ++selections;
    if (std::equal(want.begin(), want.end(), got, got + k)) return;
    ++differing;
    // An index selection feeds this layer and the ones reusing it; an expert choice this block.
    for (int l = layer; l < (index ? layer + 3 : layer + 1); ++l) affected.insert({pos, l});
  }
  static void load(const std::map<Key, std::vector<float>>& m, int layer, int64_t start, int S, float* x, int n) {
    for (int s = 0; s < S; ++s) {
      const auto& v = m.at({start + s, layer});
      std::copy(v.begin(), v.end(), x + size_t(s) * n);
    }
  }
};

}  // namespace

TEST(NumericsTinyAlt, FastStaysWithinTheGoldenBoundsOfExact) {
  AltModels& a = alt();
  const auto& cfg = a.exact->config();
  const auto toks = tokens(*a.exact, 48, 11);
  Recorder rec;
  rec.hc = cfg.hc_mult;
  rec.stream_n = cfg.hc_mult * cfg.dim;
  auto run = [&](const Model& m, ForwardObserver* ob) {
    SequenceState st = m.new_state();
    Workspace ws;
    ForwardOptions fo;
    fo.observer = ob;
    std::vector<float> logits;
    m.forward(st, std::span(toks).first(32), logits, fo, ws);  // a prefill chunk, then decode
    for (size_t i = 32; i < toks.size(); ++i) m.forward(st, std::span(toks).subspan(i, 1), logits, fo, ws);
  };
  run(*a.exact, &rec);
  Resync rs(rec);
  run(*a.fast, &rs);
  ASSERT_EQ(rs.err.size(), toks.size() * size_t(cfg.n_layers));
  int tight = 0, bit_exact = 0;
  double worst = 0;
  for (size_t i = 0; i < rs.err.size(); ++i) {
    tight += rs.err[i] <= 5e-3;
    bit_exact += rs.err[i] == 0;
    if (!rs.affected.count(rs.keys[i])) worst = std::max(worst, rs.err[i]);
  }
  std::printf("tiny-alt fast vs exact: %d/%zu blocks bit-exact, %d within 5e-3, max rel err %.3g (same selections); "
              "selections %d/%d equal\n",
              bit_exact, rs.err.size(), tight, worst, rs.selections - rs.differing, rs.selections);
  EXPECT_LE(worst, 5e-2);
  EXPECT_GE(tight, int(0.95 * double(rs.err.size())));
  EXPECT_LE(rs.differing, rs.selections / 50) << "selections should differ only at near ties";
}

TEST(NumericsTinyAlt, FastChunkingIsBitIdentical) {
  const Model& m = *alt().fast;
  const auto toks = tokens(m, 40, 12);
  auto run = [&](int chunk) {
    SequenceState st = m.new_state();
    Workspace ws;
    ForwardOptions fo;
    fo.all_logits = true;
    std::vector<float> all, logits;
    for (size_t p = 0; p < toks.size(); p += size_t(chunk)) {
      m.forward(st, std::span(toks).subspan(p, std::min(toks.size() - p, size_t(chunk))), logits, fo, ws);
      all.insert(all.end(), logits.begin(), logits.end());
    }
    return all;
  };
  const auto one_shot = run(int(toks.size()));
  for (int chunk : {1, 5, 13}) EXPECT_TRUE(run(chunk) == one_shot) << "chunks of " << chunk;
}

}  // namespace di::v41
