// Prefix sharing: a state built from another sequence's cached pages plus a bounded replay of the
// prefix's last tokens continues exactly like the uncached sequence; pages are shared and counted
// once against the pool budget.
#include <gtest/gtest.h>

#include <vector>

#include "io/safetensors.h"
#include "model/v41/model.h"
#include "test_paths.h"

// Inside di::v41: Model, SequenceState, ... are the concrete V4.1 types, not the interface's.
namespace di::v41 {

namespace {

Model& model() { return test::golden_model(); }

// 208 tokens: the golden prompts back to back (natural text, code, chat markup).
std::vector<int32_t> sequence() {
  Checkpoint g = Checkpoint::open(test::golden_expected());
  std::vector<int32_t> t;
  for (int rep = 0; rep < 2; ++rep)
    for (int p : {4, 3, 2}) {
      const auto& v = g.get("prompts.p" + std::to_string(p) + ".tokens");
      t.insert(t.end(), v.as<int32_t>(), v.as<int32_t>() + v.numel());
    }
  t.resize(208);
  return t;
}

TEST(Prefix, AdoptedPagesPlusReplayContinueExactly) {
  Model& m = model();
  const auto toks = sequence();
  constexpr int kPage = 16;
  ASSERT_LT(m.replay_tokens(), 128) << "the test needs prefixes longer than the replay";
  Workspace ws;
  ForwardOptions all;
  all.all_logits = true;
  PagePool pool(64 << 20);
  SequenceState full = m.new_state(64, kPage, &pool);
  std::vector<float> ref;
  m.forward(full, toks, ref, all, ws);
  const size_t V = size_t(m.config().vocab_size);
  for (int64_t P : {32, 128, 160, 192}) {
    const size_t used_before = pool.used_bytes();
    PrefixPages pages = full.share_prefix(P);
    SequenceState b = m.new_state(64, kPage, &pool);
    b.adopt_prefix(pages, std::span(toks).first(size_t(P)));
    m.rebuild_windows(b, ws);
    EXPECT_EQ(pool.used_bytes(), used_before) << "adopting shares pages, it does not copy them";
    std::vector<float> got;
    m.forward(b, std::span(toks).subspan(size_t(P)), got, all, ws);
    ASSERT_EQ(got.size(), ref.size() - size_t(P) * V);
    EXPECT_TRUE(std::equal(got.begin(), got.end(), ref.begin() + std::ptrdiff_t(size_t(P) * V)))
        << "prefix of " << P << " tokens";
    EXPECT_THROW(b.truncate(P - 1), std::out_of_range) << "no rollback into the adopted prefix";
  }
}

TEST(Prefix, WritingAfterASharedPartialPageCopiesIt) {
  Model& m = model();
  const auto toks = sequence();
  Workspace ws;
  std::vector<float> l;
  PagePool pool(64 << 20);
  SequenceState a = m.new_state(64, 16, &pool);
  m.forward(a, std::span(toks).first(40), l, {}, ws);  // 2.5 pages
  SequenceState b = a;                                  // shares all pages, incl. the partial one
  const size_t shared = pool.used_bytes();
  EXPECT_GT(b.bytes_needed(1), 0u) << "the shared partial page must be copied before writing";
  m.forward(b, std::span(toks).subspan(40, 1), l, {}, ws);
  EXPECT_GT(pool.used_bytes(), shared);
  SequenceState c = m.new_state(64, 16, &pool);
  std::vector<float> lc, la;
  m.forward(c, std::span(toks).first(41), lc, {}, ws);
  EXPECT_TRUE(l == lc);
  m.forward(a, std::span(toks).subspan(40, 1), la, {}, ws);
  EXPECT_TRUE(la == lc) << "the original is unaffected by the copy's writes";
}

TEST(Prefix, PoolBudgetIsEnforcedBeforeAnyStateChange) {
  Model& m = model();
  const auto toks = sequence();
  Workspace ws;
  std::vector<float> l;
  PagePool pool(16 << 10);  // one page per cache, far too small for 208 tokens
  SequenceState a = m.new_state(64, 16, &pool);
  EXPECT_THROW(m.forward(a, toks, l, {}, ws), CacheExhausted);
  EXPECT_EQ(a.pos(), 0);
  EXPECT_EQ(pool.used_bytes(), 0u);
  {
    SequenceState b = m.new_state(64, 16, &pool);
    m.forward(b, std::span(toks).first(4), l, {}, ws);
    EXPECT_GT(pool.used_bytes(), 0u);
  }
  EXPECT_EQ(pool.used_bytes(), 0u) << "pages return to the pool with their last owner";
}

}  // namespace

}  // namespace di::v41
