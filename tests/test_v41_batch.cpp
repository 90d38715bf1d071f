// Batch invariance: a step that mixes prefill chunks and decode tokens of several sequences gives
// each sequence exactly what it gets when run alone.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "core/thread_pool.h"
#include "io/safetensors.h"
#include "kernel_test_util.h"
#include "kernels/cpu/kernels.h"
#include "model/v41/model.h"
#include "test_paths.h"

// Inside di::v41: Model, SequenceState, ... are the concrete V4.1 types, not the interface's.
namespace di::v41 {

namespace {

Model& model() { return test::golden_model(); }

std::vector<std::vector<int32_t>> golden_sequences() {
  Checkpoint g = Checkpoint::open(test::golden_expected());
  std::vector<std::vector<int32_t>> out;
  for (int p = 0; p < 5; ++p) {
    const auto& t = g.get("prompts.p" + std::to_string(p) + ".tokens");
    const auto& gr = g.get("fixed.p" + std::to_string(p) + ".greedy");
    std::vector<int32_t> s(t.as<int32_t>(), t.as<int32_t>() + t.numel());
    s.insert(s.end(), gr.as<int32_t>(), gr.as<int32_t>() + 16);
    out.push_back(s);
  }
  return out;
}

TEST(Batch, MixedStepsMatchRunningAlone) {
  Model& m = model();
  const auto seqs = golden_sequences();
  // Alone: each sequence in one call, logits of every position.
  std::vector<std::vector<float>> alone(seqs.size());
  Workspace ws;
  for (size_t i = 0; i < seqs.size(); ++i) {
    SequenceState st = m.new_state();
    ForwardOptions fo;
    fo.all_logits = true;
    m.forward(st, seqs[i], alone[i], fo, ws);
  }
  // Batched: every step takes a random chunk (1..12 tokens) of every unfinished sequence.
  std::mt19937 rng(3);
  std::vector<SequenceState> states;
  for (size_t i = 0; i < seqs.size(); ++i) states.push_back(m.new_state());
  std::vector<std::vector<float>> got(seqs.size());
  std::vector<std::vector<float>> out(seqs.size());
  std::vector<size_t> pos(seqs.size(), 0);
  int steps = 0;
  for (;;) {
    std::vector<BatchItem> batch;
    std::vector<size_t> which;
    for (size_t i = 0; i < seqs.size(); ++i) {
      if (pos[i] == seqs[i].size() || rng() % 4 == 0) continue;  // sometimes skip a sequence
      const size_t n = std::min<size_t>(seqs[i].size() - pos[i], 1 + rng() % 12);
      batch.push_back({&states[i], std::span(seqs[i]).subspan(pos[i], n), true, &out[i]});
      which.push_back(i);
      pos[i] += n;
    }
    if (batch.empty()) {
      bool done = true;
      for (size_t i = 0; i < seqs.size(); ++i) done &= pos[i] == seqs[i].size();
      if (done) break;
      continue;
    }
    m.forward_batch(batch, {}, ws);
    ++steps;
    for (size_t b = 0; b < batch.size(); ++b) got[which[b]].insert(got[which[b]].end(), out[which[b]].begin(), out[which[b]].end());
  }
  EXPECT_GT(steps, 5);
  for (size_t i = 0; i < seqs.size(); ++i) EXPECT_TRUE(alone[i] == got[i]) << "sequence " << i;
}

TEST(Batch, ThreadCountAndKernelPathDoNotChangeResults) {
  // Kernels split output columns and the model splits query rows; neither split may change a bit.
  Model& m = model();
  const auto seqs = golden_sequences();
  auto run = [&] {
    Workspace ws;
    SequenceState st = m.new_state();
    ForwardOptions fo;
    fo.all_logits = true;
    std::vector<float> l;
    m.forward(st, seqs[4], l, fo, ws);
    return l;
  };
  const auto single = run();
  for (int threads : {2, 3}) {
    ThreadPool pool(threads);
    kern::set_default_pool(&pool);
    const auto multi = run();
    kern::set_default_pool(nullptr);
    EXPECT_TRUE(single == multi) << threads << " threads";
  }
}

TEST(Batch, FastNumericsAreTheSameOnEveryKernelPath) {
  // Fast numerics define one fp32 order per output that every ISA implements: the same logits.
  Model& m = model();
  if (m.numerics() != Numerics::Fast) GTEST_SKIP() << "exact numerics: the paths may differ at near ties";
  const auto seqs = golden_sequences();
  test::IsaGuard guard;
  std::vector<std::vector<float>> per_isa;
  for (kern::Isa isa : test::isas()) {
    kern::set_isa(isa);
    Workspace ws;
    SequenceState st = m.new_state();
    ForwardOptions fo;
    fo.all_logits = true;
    std::vector<float> l;
    m.forward(st, seqs[4], l, fo, ws);
    per_isa.push_back(l);
    EXPECT_TRUE(per_isa.front() == l) << kern::isa_name(isa) << " vs " << kern::isa_name(kern::Isa::Scalar);
  }
  EXPECT_GE(per_isa.size(), 2u);
}

TEST(Batch, InvalidItemLeavesEveryStateUntouched) {
  Model& m = model();
  Workspace ws;
  SequenceState a = m.new_state(), b = m.new_state();
  std::vector<float> la, lb;
  const std::vector<int32_t> good{0, 5, 6}, bad{0, -1};
  std::vector<BatchItem> batch{{&a, good, false, &la}, {&b, bad, false, &lb}};
  EXPECT_THROW(m.forward_batch(batch, {}, ws), std::out_of_range);
  EXPECT_EQ(a.pos(), 0);
  EXPECT_EQ(b.pos(), 0);
  std::vector<BatchItem> twice{{&a, good, false, &la}, {&a, good, false, &lb}};
  EXPECT_THROW(m.forward_batch(twice, {}, ws), std::invalid_argument);
}

}  // namespace

}  // namespace di::v41
