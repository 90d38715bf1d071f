// Golden tests against the official V4.1 reference outputs, as the golden README prescribes:
// block-local resync (test 2) and end-to-end teacher forcing (test 3), for both the `official`
// (reference index-key quirk) and `fixed` variants, in both numerics modes. The golden folder is
// DI_GOLDEN_DIR (default tests/data/golden/v41-tiny), its model DI_GOLDEN_MODEL (default
// DIR/model); every shape, layer list and selection width comes from the folder's
// expected/inference_config.json and tensor shapes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <memory>
#include <string>
#include <vector>

#include <fstream>

#include <nlohmann/json.hpp>

#include "core/dtypes.h"
#include "io/safetensors.h"
#include "model/v41/model.h"
#include "test_paths.h"

// Inside di::v41: Model, SequenceState, ... are the concrete V4.1 types, not the interface's.
namespace di::v41 {

namespace {

std::string golden_dir() {
  const char* e = std::getenv("DI_GOLDEN_DIR");
  return e && *e ? e : test::golden_dir();
}
std::string golden_model_dir() {
  const char* e = std::getenv("DI_GOLDEN_MODEL");
  return e && *e ? e : golden_dir() + "/model";
}

struct Golden {
  Checkpoint ck = Checkpoint::open(golden_dir() + "/expected/golden.safetensors");
  nlohmann::json cfg = [] {
    std::ifstream f(golden_dir() + "/expected/inference_config.json");
    return nlohmann::json::parse(f);
  }();
  int hc = cfg.at("hc_mult"), dim = cfg.at("dim"), n_layers = cfg.at("n_layers"), window = cfg.at("window_size");
  int index_topk = cfg.at("index_topk"), topk_experts = cfg.at("n_activated_experts");
  std::vector<int> index_layers = cfg.at("index_source_layers").get<std::vector<int>>();
  std::vector<int> engram_layers = cfg.at("engram_layer_ids").get<std::vector<int>>();
  int64_t vocab = cfg.at("vocab_size");
  int prompts = [this] {
    int n = 0;
    while (ck.find("prompts.p" + std::to_string(n) + ".tokens")) ++n;
    return n;
  }();

  const TensorView& t(const std::string& n) const { return ck.get(n); }
  std::vector<int32_t> i32(const std::string& n) const {
    const auto& v = t(n);
    return std::vector<int32_t>(v.as<int32_t>(), v.as<int32_t>() + v.numel());
  }
  std::vector<float> f32(const std::string& n) const {
    const auto& v = t(n);
    if (v.dtype == DType::BF16) {
      std::vector<float> out(size_t(v.numel()));
      for (int64_t i = 0; i < v.numel(); ++i) out[size_t(i)] = bf16_to_f32(v.as<uint16_t>()[i]);
      return out;
    }
    return std::vector<float>(v.as<float>(), v.as<float>() + v.numel());
  }
};

const Golden& golden() {
  static Golden g;
  return g;
}

// The golden model in each numerics mode, loaded once.
Model& model(Numerics nm) {
  static std::shared_ptr<Model> models[2];
  auto& m = models[nm == Numerics::Exact];
  if (!m) {
    LoadOptions o;
    o.tokenizer_path = test::v3_tokenizer_json();
    o.numerics = nm;
    m = Model::load(golden_model_dir(), o);
  }
  return *m;
}

struct Case {
  Numerics numerics;
  std::string variant;
  int prompt;
  std::string pre() const { return variant + ".p" + std::to_string(prompt) + "."; }
  std::string name() const { return std::string(numerics_name(numerics)) + "." + variant + ".p" + std::to_string(prompt); }
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name(); }

std::vector<Case> all_cases() {
  std::vector<Case> v;
  for (Numerics nm : {Numerics::Fast, Numerics::Exact})
    for (std::string var : {"official", "fixed"})
      for (int p = 0; p < golden().prompts; ++p) v.push_back({nm, var, p});
  return v;
}

double rel_l2(const float* a, const float* b, int n) {
  double num = 0, den = 0;
  for (int i = 0; i < n; ++i) {
    num += double(a[i] - b[i]) * (a[i] - b[i]);
    den += double(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Per-sequence golden views.
struct SeqGolden {
  const Golden& g = golden();
  Case c;
  std::vector<int32_t> prompt, greedy;
  std::vector<float> stream, engram_out, pre_mix, final_hidden, margin_gate, margin_index;
  std::vector<int32_t> experts, prefill_experts;
  std::map<int, std::vector<int32_t>> topk, prefill_topk;
  int L = 0, P = 0, steps = 0, hc = g.hc, dim = g.dim, cols = g.n_layers + 1;
  explicit SeqGolden(const Case& cs) : c(cs) {
    prompt = g.i32("prompts.p" + std::to_string(c.prompt) + ".tokens");
    greedy = g.i32(c.pre() + "greedy");
    stream = g.f32(c.pre() + "stream");
    engram_out = g.f32(c.pre() + "engram_out");
    pre_mix = g.f32(c.pre() + "pre_mix");
    final_hidden = g.f32(c.pre() + "final_hidden");
    margin_gate = g.f32(c.pre() + "margin.gate");
    margin_index = g.f32(c.pre() + "margin.index");
    experts = g.i32(c.pre() + "experts");
    prefill_experts = g.i32(c.pre() + "prefill_experts");
    for (int l : g.index_layers) {
      topk[l] = g.i32(c.pre() + "index_topk.L" + std::to_string(l));
      prefill_topk[l] = g.i32(c.pre() + "prefill_index_topk.L" + std::to_string(l));
    }
    L = int(prompt.size());
    steps = int(greedy.size()) - 1;  // decode steps after the prefill
    P = L + steps;
  }
  const float* stream_at(int64_t pos, int col) const { return stream.data() + (size_t(pos) * cols + col) * hc * dim; }
  const float* engram_at(int64_t pos, int which) const {
    return engram_out.data() + (size_t(pos) * g.engram_layers.size() + size_t(which)) * hc * dim;
  }
  const float* pre_mix_at(int64_t pos, int col) const { return pre_mix.data() + (size_t(pos) * cols + col) * hc; }
  // Teacher-forced input: prompt then greedy[0 .. steps - 1].
  std::vector<int32_t> decode_inputs() const { return std::vector<int32_t>(greedy.begin(), greedy.begin() + steps); }
};

int position_in(const std::vector<int>& v, int layer) {
  const auto it = std::find(v.begin(), v.end(), layer);
  return it == v.end() ? -1 : int(it - v.begin());
}
int engram_index(int layer) { return position_in(golden().engram_layers, layer); }
int index_col(int layer) { return position_in(golden().index_layers, layer); }

// Compares selections (index top-k and experts) with golden rows where the golden margin allows.
struct SelectionCheck {
  int compared = 0, equal = 0, low_margin_diffs = 0, our_near_ties = 0, consequences = 0, hard_diffs = 0;
  std::vector<std::string> failures;
};

// Test 2: every block and Engram restarted from the golden stream.
class ResyncObserver : public ForwardObserver {
 public:
  explicit ResyncObserver(const SeqGolden& sg) : g_(sg) {}
  std::vector<double> block_err;
  std::vector<int64_t> block_pos;
  std::vector<int> block_layer;
  // (position, layer) blocks that attend to a legitimately different index selection: from the
  // index source up to the next one (its reuse layers share the selection).
  std::set<std::pair<int64_t, int>> affected;
  int block_bit_exact = 0, engram_total = 0, engram_bit_exact = 0;
  double engram_max_err = 0;
  SelectionCheck sel;
  int step = 0;  // 0 = prefill, j = decode step j

  void before_engram(int layer, int64_t start, int S, float* stream) override {
    for (int s = 0; s < S; ++s) std::copy_n(g_.stream_at(start + s, layer), g_.hc * g_.dim, stream + size_t(s) * g_.hc * g_.dim);
  }
  void after_engram(int layer, int64_t start, int S, const float* stream) override {
    for (int s = 0; s < S; ++s) {
      const float* gold = g_.engram_at(start + s, engram_index(layer));
      const float* ours = stream + size_t(s) * g_.hc * g_.dim;
      const double e = rel_l2(ours, gold, g_.hc * g_.dim);
      engram_max_err = std::max(engram_max_err, e);
      ++engram_total;
      engram_bit_exact += e == 0;
    }
  }
  void before_block(int layer, int64_t start, int S, float* stream, float* pre_mix) override {
    for (int s = 0; s < S; ++s) {
      const int64_t pos = start + s;
      const float* src = engram_index(layer) >= 0 ? g_.engram_at(pos, engram_index(layer)) : g_.stream_at(pos, layer);
      std::copy_n(src, g_.hc * g_.dim, stream + size_t(s) * g_.hc * g_.dim);
      std::copy_n(g_.pre_mix_at(pos, layer), g_.hc, pre_mix + s * g_.hc);
    }
  }
  void after_block(int layer, int64_t start, int S, const float* stream, const float*) override {
    for (int s = 0; s < S; ++s) {
      const double e = rel_l2(stream + size_t(s) * g_.hc * g_.dim, g_.stream_at(start + s, layer + 1), g_.hc * g_.dim);
      block_err.push_back(e);
      block_pos.push_back(start + s);
      block_layer.push_back(layer);
      block_bit_exact += e == 0;
      if (e > 5e-3)
        std::printf("  [%s] block %d pos %lld rel err %.3g\n", g_.c.name().c_str(), layer, (long long)(start + s), e);
    }
  }
  void on_index_topk(int layer, int64_t start, int S, int k, const int32_t* idx, const float* scores,
                     int64_t width) override {
    const int offset = step == 0 ? g_.L : g_.g.window;
    const int gw = g_.g.index_topk, nidx = int(g_.g.index_layers.size());
    for (int s = 0; s < S; ++s) {
      const int32_t* gold = step == 0 ? g_.prefill_topk.at(layer).data() + size_t(s) * gw
                                      : g_.topk.at(layer).data() + size_t(step) * gw;
      const float margin = g_.margin_index[size_t(step) * nidx + index_col(layer)];
      std::vector<int32_t> a(idx + size_t(s) * k, idx + size_t(s + 1) * k), b;
      for (int j = 0; j < gw; ++j)
        if (gold[j] != -2) b.push_back(gold[j] >= 0 ? gold[j] - offset : -1);
      if (a != b && std::getenv("DI_GOLDEN_VERBOSE")) {
        std::printf("    index L%d pos %lld ours:", layer, (long long)(start + s));
        for (int32_t x : a) std::printf(" %d", x);
        std::printf(" golden:");
        for (int32_t x : b) std::printf(" %d", x);
        std::printf("\n");
      }
      if (a != b) {
        const auto& srcs = g_.g.index_layers;
        const auto next = std::upper_bound(srcs.begin(), srcs.end(), layer);
        const int end = next == srcs.end() ? g_.g.n_layers : *next;
        for (int l = layer; l < end; ++l) pending.insert({start + s, l});
      }
      record(a == b, margin, "index L" + std::to_string(layer), start + s, 1e-2,
             our_near_tie(scores + size_t(s) * width, width, k, a, b), layer);
    }
  }
  void on_experts(int layer, int64_t start, int S, int k, const int32_t* ids, const float*) override {
    const int nl = g_.g.n_layers, ke = g_.g.topk_experts;
    for (int s = 0; s < S; ++s) {
      const int32_t* gold = step == 0 ? g_.prefill_experts.data() + (size_t(s) * nl + layer) * ke
                                      : g_.experts.data() + (size_t(step) * nl + layer) * ke;
      const float margin = g_.margin_gate[size_t(step) * nl + layer];
      const bool eq = k == ke && std::equal(ids + s * k, ids + (s + 1) * k, gold);
      // An expert choice made on the output of a differently-selected attention is a consequence.
      if (!eq && affected.count({start + s, layer})) { ++sel.consequences; continue; }
      record(eq, margin, "experts L" + std::to_string(layer), start + s, 1e-2, false, layer);
    }
  }

 private:
  // A selection that differs although the golden margin is wide is still a rounding effect when our
  // own scores put exactly one swapped element within one bf16 ulp of the boundary: the index score
  // is a sum of bf16-rounded head terms with heavy cancellation, so one term's ulp moves it by more
  // than the golden margin.
  static bool our_near_tie(const float* sc, int64_t width, int k, const std::vector<int32_t>& ours,
                           const std::vector<int32_t>& gold) {
    int only_ours = 0;
    for (int32_t e : ours) only_ours += e >= 0 && std::find(gold.begin(), gold.end(), e) == gold.end();
    if (only_ours != 1 || k >= width) return false;
    std::vector<float> v(sc, sc + width);
    std::sort(v.begin(), v.end(), std::greater<float>());
    const float a = v[size_t(k - 1)], b = v[size_t(k)];
    return std::isfinite(a) && std::isfinite(b) && a - b <= std::max(std::fabs(a), std::fabs(b)) * 0x1p-7f;
  }
  void record(bool eq, float margin, const std::string& what, int64_t pos, float min_margin, bool near_tie, int layer) {
    ++sel.compared;
    if (eq) { ++sel.equal; pending.clear(); return; }
    const bool accepted = margin < min_margin || near_tie;
    if (accepted) affected.insert(pending.begin(), pending.end());
    pending.clear();
    if (margin < min_margin) { ++sel.low_margin_diffs; return; }
    if (near_tie) {
      ++sel.our_near_ties;
      std::printf("  [%s] %s pos %lld differs (golden margin %.3g): near tie in our scores\n", g_.c.name().c_str(),
                  what.c_str(), (long long)pos, margin);
      return;
    }
    ++sel.hard_diffs;
    sel.failures.push_back(what + " pos " + std::to_string(pos) + " margin " + std::to_string(margin));
  }
  const SeqGolden& g_;
  std::set<std::pair<int64_t, int>> pending;
};

// Test 3: no resync; find where our stream first leaves the golden one.
class DivergenceObserver : public ForwardObserver {
 public:
  explicit DivergenceObserver(const SeqGolden& sg) : g_(sg) {}
  int64_t first_pos = -1;
  int first_layer = -1;
  std::vector<float> hidden;
  void after_block(int layer, int64_t start, int S, const float* stream, const float*) override {
    if (first_pos >= 0) return;
    for (int s = 0; s < S; ++s)
      if (rel_l2(stream + size_t(s) * g_.hc * g_.dim, g_.stream_at(start + s, layer + 1), g_.hc * g_.dim) != 0) {
        first_pos = start + s;
        first_layer = layer;
        if (std::getenv("DI_GOLDEN_VERBOSE")) {
          const float* a = stream + size_t(s) * g_.hc * g_.dim;
          const float* b = g_.stream_at(start + s, layer + 1);
          for (int i = 0; i < g_.hc * g_.dim; ++i)
            if (a[i] != b[i]) std::printf("    copy %d d %d ours %.8g golden %.8g\n", i / g_.dim, i % g_.dim, a[i], b[i]);
        }
        return;
      }
  }
  void on_final_hidden(int64_t, int rows, const float* h) override {
    hidden.assign(h + size_t(rows - 1) * g_.dim, h + size_t(rows) * g_.dim);
  }

 private:
  const SeqGolden& g_;
};

class GoldenTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    model().set_index_key_policy(GetParam().variant == "official" ? IndexKeyPolicy::Reference : IndexKeyPolicy::PerSource);
  }
  Model& model() const { return v41::model(GetParam().numerics); }
};

TEST_P(GoldenTest, BlockLocalResync) {
  SeqGolden sg(GetParam());
  ResyncObserver ob(sg);
  Model& m = model();
  SequenceState st = m.new_state();
  Workspace ws;
  std::vector<float> logits;
  ForwardOptions fo;
  fo.observer = &ob;
  m.forward(st, sg.prompt, logits, fo, ws);
  const auto dec = sg.decode_inputs();
  for (int j = 1; j <= sg.steps; ++j) {
    ob.step = j;
    m.forward(st, std::span(&dec[size_t(j - 1)], 1), logits, fo, ws);
  }
  ASSERT_EQ(ob.block_err.size(), size_t(sg.P) * size_t(sg.g.n_layers));
  // After an accepted selection difference the block attends to other entries, so its output is
  // not bounded by the tolerance of a same-selection block; such blocks are reported, not bounded.
  int within_tight = 0;
  double worst = 0;
  for (size_t i = 0; i < ob.block_err.size(); ++i) {
    const double e = ob.block_err[i];
    within_tight += e <= 5e-3;
    if (!ob.affected.count({ob.block_pos[i], ob.block_layer[i]})) worst = std::max(worst, e);
  }
  std::printf("[%s] block-local: %d/%zu bit-exact, %d within 5e-3, max rel err %.3g; engram %d/%d bit-exact; "
              "selections %d/%d equal (%d below margin, %d near ties of ours, %d consequences)\n",
              sg.c.name().c_str(), ob.block_bit_exact, ob.block_err.size(), within_tight, worst,
              ob.engram_bit_exact, ob.engram_total, ob.sel.equal, ob.sel.compared, ob.sel.low_margin_diffs, ob.sel.our_near_ties, ob.sel.consequences);
  EXPECT_LE(worst, 5e-2);
  EXPECT_GE(within_tight, int(0.95 * double(ob.block_err.size())));
  EXPECT_LE(ob.engram_max_err, 5e-3);
  EXPECT_EQ(ob.sel.hard_diffs, 0) << (ob.sel.failures.empty() ? "" : ob.sel.failures.front());
  // Exact sums round where the reference rounds: bit-identical blocks are the common case
  // (the README's order-perturbation experiment: 98.8 %).
  if (GetParam().numerics == Numerics::Exact) EXPECT_GE(ob.block_bit_exact, int(0.95 * double(ob.block_err.size())));
}

TEST_P(GoldenTest, EndToEndTeacherForced) {
  SeqGolden sg(GetParam());
  const auto& g = golden();
  const auto gold_logits = g.f32(sg.c.pre() + "logits");  // steps 0 and 1
  const auto topk_ids = g.i32(sg.c.pre() + "topk_ids");
  const auto topk_vals = g.f32(sg.c.pre() + "topk_vals");
  Model& m = model();
  SequenceState st = m.new_state();
  Workspace ws;
  DivergenceObserver ob(sg);
  ForwardOptions fo;
  fo.observer = &ob;
  std::vector<float> logits;
  const auto dec = sg.decode_inputs();
  int bit_exact_steps = 0, checked_steps = 0, greedy_equal = 0;
  double max_diff_checked = 0, max_diff_all = 0;
  const int64_t V = g.vocab;
  const int topn = int(g.t(sg.c.pre() + "topk_ids").shape.back());
  const int logit_rows = int(g.t(sg.c.pre() + "logits").shape.front());
  for (int j = 0; j <= sg.steps; ++j) {
    if (j == 0) m.forward(st, sg.prompt, logits, fo, ws);
    else m.forward(st, std::span(&dec[size_t(j - 1)], 1), logits, fo, ws);
    // The step's own output counts as checked when the stream entering it was still exact.
    const float* gh = sg.final_hidden.data() + size_t(j) * size_t(sg.dim);
    bit_exact_steps += std::equal(ob.hidden.begin(), ob.hidden.end(), gh);
    double maxd = 0;
    for (int r = 0; r < topn; ++r) {
      const int32_t id = topk_ids[size_t(j) * topn + r];
      maxd = std::max(maxd, double(std::fabs(logits[size_t(id)] - topk_vals[size_t(j) * topn + r])));
    }
    if (j < logit_rows) {
      const float* gl = gold_logits.data() + size_t(j) * size_t(V);
      double dot = 0, na = 0, nb = 0;
      for (size_t v = 0; v < size_t(V); ++v) {
        maxd = std::max(maxd, double(std::fabs(logits[v] - gl[v])));
        dot += double(logits[v]) * gl[v];
        na += double(logits[v]) * logits[v];
        nb += double(gl[v]) * gl[v];
      }
      if (ob.first_pos < 0) EXPECT_GE(dot / std::sqrt(na * nb), 0.9999) << "step " << j;
    }
    const float margin = topk_vals[size_t(j) * topn] - topk_vals[size_t(j) * topn + 1];
    const int32_t ours = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    greedy_equal += ours == sg.greedy[size_t(j)];
    max_diff_all = std::max(max_diff_all, maxd);
    if (ob.first_pos >= 0) continue;  // this step's stream already left the golden one
    ++checked_steps;
    max_diff_checked = std::max(max_diff_checked, maxd);
    EXPECT_LE(maxd, 0.05) << "step " << j;
    if (margin > 0.05f) EXPECT_EQ(ours, sg.greedy[size_t(j)]) << "step " << j;
  }
  const int n = sg.steps + 1;
  std::printf("[%s] end-to-end: %d/%d steps before stream divergence (max |dlogit| %.3g); all steps: %d/%d "
              "bit-exact final hidden, %d/%d greedy equal, max |dlogit| %.3g; ",
              sg.c.name().c_str(), checked_steps, n, max_diff_checked, bit_exact_steps, n, greedy_equal, n, max_diff_all);
  if (ob.first_pos >= 0) std::printf("stream first differs at position %lld, layer %d\n", (long long)ob.first_pos, ob.first_layer);
  else std::printf("stream bit-exact everywhere\n");
}

INSTANTIATE_TEST_SUITE_P(V41, GoldenTest, ::testing::ValuesIn(all_cases()), [](const auto& info) {
  return std::string(numerics_name(info.param.numerics)) + "_" + info.param.variant + "_p" + std::to_string(info.param.prompt);
});

}  // namespace

}  // namespace di::v41
