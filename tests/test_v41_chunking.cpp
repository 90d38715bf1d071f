// Chunking invariance and rollback: any split of a sequence into chunks (one-shot prefill, chunks
// of 1, 3, 7, window size, random sizes, token-by-token decode) gives the logits of one-shot
// prefill, and truncating the state back to position p then re-running reproduces the original.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "io/safetensors.h"
#include "model/v41/model.h"
#include "test_paths.h"

// Inside di::v41: Model, SequenceState, ... are the concrete V4.1 types, not the interface's.
namespace di::v41 {

namespace {

Model& model() { return test::golden_model(); }

// The golden p4 prompt (64 tokens of Python code) followed by its 16 greedy tokens: long enough to
// wrap the 8-slot window many times and to make the indexer drop entries.
std::vector<int32_t> long_sequence() {
  Checkpoint g = Checkpoint::open(test::golden_expected());
  const auto& p = g.get("prompts.p4.tokens");
  const auto& gr = g.get("fixed.p4.greedy");
  std::vector<int32_t> t(p.as<int32_t>(), p.as<int32_t>() + p.numel());
  t.insert(t.end(), gr.as<int32_t>(), gr.as<int32_t>() + 16);
  return t;
}

// Logits of every position when the sequence is fed in the given chunk sizes.
std::vector<float> run_chunks(const std::vector<int32_t>& toks, const std::vector<int>& chunks) {
  Model& m = model();
  SequenceState st = m.new_state();
  Workspace ws;
  ForwardOptions fo;
  fo.all_logits = true;
  std::vector<float> all, logits;
  size_t pos = 0;
  for (int n : chunks) {
    m.forward(st, std::span(toks).subspan(pos, size_t(n)), logits, fo, ws);
    all.insert(all.end(), logits.begin(), logits.end());
    pos += size_t(n);
  }
  EXPECT_EQ(pos, toks.size());
  EXPECT_EQ(st.pos(), int64_t(toks.size()));
  return all;
}

std::vector<int> split(size_t n, int chunk) {
  std::vector<int> c;
  for (size_t p = 0; p < n; p += size_t(chunk)) c.push_back(int(std::min<size_t>(size_t(chunk), n - p)));
  return c;
}

void expect_same_logits(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  const size_t V = size_t(model().config().vocab_size);
  size_t differing_rows = 0;
  for (size_t r = 0; r < a.size() / V; ++r) {
    bool same = std::equal(a.begin() + r * V, a.begin() + (r + 1) * V, b.begin() + r * V);
    differing_rows += !same;
    const auto am = std::max_element(a.begin() + r * V, a.begin() + (r + 1) * V) - (a.begin() + r * V);
    const auto bm = std::max_element(b.begin() + r * V, b.begin() + (r + 1) * V) - (b.begin() + r * V);
    EXPECT_EQ(am, bm) << what << ": greedy differs at position " << r;
  }
  // Every per-query quantity depends on the absolute position only, so this is bit-exact.
  EXPECT_EQ(differing_rows, 0u) << what;
}

TEST(Chunking, AnySplitMatchesOneShotPrefill) {
  const auto toks = long_sequence();
  const auto ref = run_chunks(toks, {int(toks.size())});
  const int W = model().config().window_size;
  for (int chunk : {1, 3, 7, W, W + 1, 2 * W + 3}) expect_same_logits(ref, run_chunks(toks, split(toks.size(), chunk)), ("chunk " + std::to_string(chunk)).c_str());
  std::mt19937 rng(7);
  for (int trial = 0; trial < 5; ++trial) {
    std::vector<int> chunks;
    size_t left = toks.size();
    while (left) {
      const int n = int(std::min<size_t>(left, size_t(1 + rng() % 20)));
      chunks.push_back(n);
      left -= size_t(n);
    }
    expect_same_logits(ref, run_chunks(toks, chunks), "random chunks");
  }
}

TEST(Chunking, PrefillThenTokenByTokenDecode) {
  // The usual serving pattern: prompt in one chunk, then single tokens.
  const auto toks = long_sequence();
  std::vector<int> chunks{64};
  for (size_t i = 64; i < toks.size(); ++i) chunks.push_back(1);
  expect_same_logits(run_chunks(toks, {int(toks.size())}), run_chunks(toks, chunks), "prefill + decode");
}

TEST(Rollback, TruncateAndRedecodeReproducesLogits) {
  Model& m = model();
  const auto toks = long_sequence();
  Workspace ws;
  ForwardOptions fo;
  fo.all_logits = true;
  for (int64_t p : {64, 65, 70, 77}) {  // odd and even positions: ratio-2 groups split differently
    SequenceState st = m.new_state();
    std::vector<float> first, again;
    m.forward(st, std::span(toks).first(size_t(p)), first, fo, ws);
    m.forward(st, std::span(toks).subspan(size_t(p)), first, fo, ws);  // logits of p..end
    st.truncate(p);
    EXPECT_EQ(st.pos(), p);
    // Re-decode token by token after the rollback.
    for (size_t i = size_t(p); i < toks.size(); ++i) {
      std::vector<float> l;
      m.forward(st, std::span(&toks[i], 1), l, fo, ws);
      again.insert(again.end(), l.begin(), l.end());
    }
    EXPECT_TRUE(first == again) << "rollback to " << p;
  }
}

TEST(Rollback, SpeculativeStyleRejectThenAccept) {
  // Feed wrong tokens, roll back, feed the right ones: identical to never having seen the wrong ones.
  Model& m = model();
  const auto toks = long_sequence();
  Workspace ws;
  ForwardOptions fo;
  fo.all_logits = true;
  std::vector<float> ref, l;
  SequenceState a = m.new_state();
  m.forward(a, toks, ref, fo, ws);

  SequenceState b = m.new_state();
  m.forward(b, std::span(toks).first(60), l, fo, ws);
  std::vector<float> got(l);
  const std::vector<int32_t> wrong{11, 22, 33, 44, 55};
  m.forward(b, wrong, l, fo, ws);
  b.truncate(60);
  m.forward(b, std::span(toks).subspan(60), l, fo, ws);
  got.insert(got.end(), l.begin(), l.end());
  EXPECT_TRUE(ref == got);
}

TEST(State, CopyIsIndependent) {
  Model& m = model();
  const auto toks = long_sequence();
  Workspace ws;
  ForwardOptions fo;
  std::vector<float> la, lb, lc;
  SequenceState a = m.new_state();
  m.forward(a, std::span(toks).first(50), la, fo, ws);
  SequenceState b = a;  // shares pages copy-on-write
  m.forward(a, std::span(toks).subspan(50, 10), la, fo, ws);
  m.forward(b, std::vector<int32_t>{5, 6, 7}, lb, fo, ws);  // diverge b
  SequenceState c = m.new_state();
  m.forward(c, std::span(toks).first(60), lc, fo, ws);
  EXPECT_TRUE(la == lc) << "writing to a copy must not change the original";
  EXPECT_EQ(b.pos(), 53);
}

TEST(State, RollbackLimitIsEnforced) {
  Model& m = model();
  const auto toks = long_sequence();
  Workspace ws;
  std::vector<float> l;
  SequenceState st = m.new_state(/*max_rollback=*/4);
  m.forward(st, std::span(toks).first(40), l, {}, ws);
  EXPECT_THROW(st.truncate(35), std::out_of_range);
  EXPECT_NO_THROW(st.truncate(36));
  EXPECT_THROW(st.truncate(37), std::out_of_range);  // beyond the current position
}

TEST(Forward, RejectsBadTokens) {
  Model& m = model();
  Workspace ws;
  std::vector<float> l;
  SequenceState st = m.new_state();
  EXPECT_THROW(m.forward(st, std::vector<int32_t>{1, -5}, l, {}, ws), std::out_of_range);
  EXPECT_THROW(m.forward(st, std::vector<int32_t>{int32_t(m.config().vocab_size)}, l, {}, ws), std::out_of_range);
  EXPECT_THROW(m.forward(st, std::vector<int32_t>{}, l, {}, ws), std::invalid_argument);
  EXPECT_EQ(st.pos(), 0) << "a rejected chunk must not change the state";
}

}  // namespace

}  // namespace di::v41
