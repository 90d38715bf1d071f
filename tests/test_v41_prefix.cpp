// Prefix sharing: a state built from another sequence's cached pages plus a bounded replay of the
// prefix's last tokens continues exactly like the uncached sequence; pages are shared and counted
// once against the pool budget.
#include <gtest/gtest.h>

#include <cmath>
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

TEST(Prefix, SnapshotsRestoreTheStateWithoutReplay) {
  Model& m = model();
  const auto toks = sequence();
  constexpr int kPage = 16;
  Workspace ws;
  ForwardOptions all;
  all.all_logits = true;
  PagePool pool(64 << 20);
  SequenceState full = m.new_state(64, kPage, &pool);
  std::vector<float> ref;
  m.forward(full, toks, ref, all, ws);
  const size_t V = size_t(m.config().vocab_size);
  const int W = m.config().window_size;
  for (int64_t P : {16, 32, 128, 160, 192}) {
    // The snapshot comes from a state that got there in other chunks than `full`.
    SequenceState a = m.new_state(64, kPage, &pool);
    std::vector<float> l;
    for (int64_t p = 0; p < P; p += 48) m.forward(a, std::span(toks).subspan(size_t(p), size_t(std::min<int64_t>(48, P - p))), l, {}, ws);
    const std::vector<std::byte> snap = a.snapshot();
    const size_t rows = size_t(std::min<int64_t>(P, W - 1)) * size_t(m.config().n_layers) * size_t(m.config().head_dim);
    EXPECT_TRUE(snap.size() < 64 + rows * 4) << "no more than the window rows (" << snap.size() << " bytes)";
    SequenceState b = m.new_state(8, kPage, &pool);  // another rollback capacity: other ring slots
    b.restore_snapshot(full.share_prefix(P), std::span(toks).first(size_t(P)), snap);
    EXPECT_EQ(b.pos(), P);
    EXPECT_THROW(b.truncate(P - 1), std::out_of_range) << "no rollback into the restored prefix";
    std::vector<float> got;
    m.forward(b, std::span(toks).subspan(size_t(P)), got, all, ws);
    ASSERT_EQ(got.size(), ref.size() - size_t(P) * V);
    EXPECT_TRUE(std::equal(got.begin(), got.end(), ref.begin() + std::ptrdiff_t(size_t(P) * V))) << "snapshot at " << P;
  }
}

TEST(Prefix, SnapshotsKeepRowsThatAreNotBf16AndRejectForeignBytes) {
  Model& m = model();
  const auto toks = sequence();
  Workspace ws;
  std::vector<float> l;
  SequenceState a = m.new_state(64, 16);
  m.forward(a, std::span(toks).first(32), l, {}, ws);
  const std::vector<std::byte> compact = a.snapshot();
  // A window value that is not a bf16 makes the snapshot keep fp32 rows, bit for bit.
  float& v = a.layers()[0].window[size_t(31 % a.window_cap()) * size_t(m.config().head_dim)];
  v = std::nextafter(v, 1.0f);
  const std::vector<std::byte> wide = a.snapshot();
  EXPECT_GT(wide.size(), compact.size());
  SequenceState b = m.new_state(64, 16);
  b.restore_snapshot(a.share_prefix(32), std::span(toks).first(32), wide);
  for (size_t i = 0; i < a.layers().size(); ++i)
    for (int64_t p = 32 - (m.config().window_size - 1); p < 32; ++p) {
      if (p < 0) continue;
      const size_t o = size_t(p % a.window_cap()) * size_t(m.config().head_dim);
      EXPECT_TRUE(std::equal(a.layers()[i].window.begin() + std::ptrdiff_t(o),
                             a.layers()[i].window.begin() + std::ptrdiff_t(o + size_t(m.config().head_dim)),
                             b.layers()[i].window.begin() + std::ptrdiff_t(o)))
          << "layer " << i << " position " << p;
    }
  // Bytes that do not fit these tokens, these pages or this model are refused before any change.
  auto refuses = [&](std::span<const std::byte> snap, int64_t n_tokens) {
    SequenceState c = m.new_state(64, 16);
    EXPECT_THROW(c.restore_snapshot(a.share_prefix(n_tokens), std::span(toks).first(size_t(n_tokens)), snap),
                 std::invalid_argument);
    EXPECT_EQ(c.pos(), 0);
  };
  refuses(compact, 16);
  refuses(std::span(compact).first(compact.size() - 1), 32);
  std::vector<std::byte> bad = compact;
  bad[0] ^= std::byte{1};
  refuses(bad, 32);
  SequenceState odd = m.new_state(64, 16);
  m.forward(odd, std::span(toks).first(20), l, {}, ws);
  EXPECT_THROW(odd.snapshot(), std::invalid_argument) << "only at page boundaries";
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
