// V3 forward-pass invariances on the golden tiny model, in the numerics DEEPINFER_NUMERICS names
// (default fast; CTest reruns this with exact): chunked prefill == one-shot, batched == alone,
// rollback (truncate) == never having run the dropped tokens, prefix pages shared copy-on-write,
// pool accounting. Every comparison is bit for bit.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "model/v3/model.h"
#include "test_v3_paths.h"

using namespace di::v3;
using di::all_finite;
using di::Numerics;
using di::numerics_from_env;
// The concrete V3 types, over the interface's names in di.
using di::v3::BatchItem;
using di::v3::LoadOptions;
using di::v3::Model;
using di::v3::SequenceState;
using di::v3::Workspace;

namespace {

const Model& model() {
  static std::unique_ptr<Model> m = [] {
    LoadOptions o;
    o.numerics = numerics_from_env(Numerics::Fast);
    return Model::load(di::test::v3_golden_model_dir(), o);
  }();
  return *m;
}

std::vector<int32_t> tokens(int n, int32_t seed) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  uint32_t s = uint32_t(seed) * 2654435761u + 1;
  for (auto& x : t) {
    s = s * 1664525u + 1013904223u;
    x = int32_t(s % 128000u);
  }
  return t;
}

// Logits of every position of `toks` run in chunks of `chunk`.
std::vector<float> run_chunked(SequenceState& st, const std::vector<int32_t>& toks, int chunk, Workspace& ws) {
  std::vector<float> all, lg;
  ForwardOptions o;
  o.all_logits = true;
  for (size_t i = 0; i < toks.size(); i += size_t(chunk)) {
    const size_t n = std::min(toks.size() - i, size_t(chunk));
    model().forward(st, std::span<const int32_t>(toks.data() + i, n), lg, o, ws);
    all.insert(all.end(), lg.begin(), lg.end());
  }
  return all;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void expect_same_cache(const SequenceState& a, const SequenceState& b) {
  ASSERT_EQ(a.pos(), b.pos());
  for (size_t l = 0; l < a.caches().size(); ++l)
    for (int64_t t = 0; t < a.pos(); ++t)
      ASSERT_EQ(std::memcmp(a.caches()[l].row(t), b.caches()[l].row(t), size_t(a.row_width()) * 4), 0)
          << "layer " << l << " row " << t;
}

}  // namespace

TEST(V3Batch, ChunkedPrefillEqualsOneShot) {
  const auto toks = tokens(70, 1);
  Workspace ws;
  auto ref = model().new_state();
  const auto one = run_chunked(*ref, toks, 70, ws);
  for (int chunk : {1, 7, 32}) {
    auto st = model().new_state(64, 16);
    EXPECT_TRUE(same_bits(run_chunked(*st, toks, chunk, ws), one)) << "chunk " << chunk;
    expect_same_cache(*st, *ref);
  }
}

TEST(V3Batch, BatchedEqualsAlone) {
  const std::vector<std::vector<int32_t>> prompts = {tokens(5, 2), tokens(33, 3), tokens(1, 4), tokens(17, 5)};
  Workspace ws;
  // Alone: prefill then two decode tokens each.
  std::vector<std::vector<std::vector<float>>> alone(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto st = model().new_state();
    std::vector<float> lg;
    ForwardOptions o;
    o.all_logits = i % 2 == 1;
    model().forward(*st, prompts[i], lg, o, ws);
    alone[i].push_back(lg);
    for (int32_t t : {int32_t(100 + i), int32_t(200 + i)}) {
      model().forward(*st, std::span<const int32_t>(&t, 1), lg, {}, ws);
      alone[i].push_back(lg);
    }
  }
  // Together: one batched prefill, then two batched decode steps.
  std::vector<std::unique_ptr<SequenceState>> states;
  std::vector<std::vector<float>> out(prompts.size());
  std::vector<BatchItem> items;
  for (size_t i = 0; i < prompts.size(); ++i) {
    states.push_back(model().new_state());
    items.push_back({states.back().get(), prompts[i], i % 2 == 1, &out[i]});
  }
  model().forward_batch(items, {}, ws);
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_TRUE(same_bits(out[i], alone[i][0])) << "prefill " << i;
  std::vector<int32_t> step(prompts.size());
  for (int k = 0; k < 2; ++k) {
    items.clear();
    for (size_t i = 0; i < prompts.size(); ++i) {
      step[i] = int32_t((k + 1) * 100 + int(i));
      items.push_back({states[i].get(), std::span<const int32_t>(&step[i], 1), false, &out[i]});
    }
    model().forward_batch(items, {}, ws);
    for (size_t i = 0; i < prompts.size(); ++i) EXPECT_TRUE(same_bits(out[i], alone[i][size_t(k + 1)])) << "decode " << k << " seq " << i;
  }
}

TEST(V3Batch, InvalidItemsThrowBeforeTouchingState) {
  Workspace ws;
  auto st = model().new_state();
  std::vector<float> lg;
  const std::vector<int32_t> bad = {1, int32_t(model().config().vocab_size)};
  EXPECT_THROW(model().forward(*st, bad, lg, {}, ws), std::invalid_argument);
  EXPECT_EQ(st->pos(), 0);
  const std::vector<int32_t> ok = {1, 2};
  std::vector<BatchItem> twice = {{st.get(), ok, false, &lg}, {st.get(), ok, false, &lg}};
  EXPECT_THROW(model().forward_batch(twice, {}, ws), std::invalid_argument);
  EXPECT_EQ(st->pos(), 0);
  const auto too_long = tokens(int(model().config().max_position_embeddings) + 1, 9);
  EXPECT_THROW(model().forward(*st, too_long, lg, {}, ws), std::invalid_argument);
  EXPECT_EQ(st->caches()[0].size(), 0);
}

TEST(V3Batch, RollbackEqualsNeverRun) {
  const auto a = tokens(60, 6), b = tokens(20, 7);
  Workspace ws;
  auto st = model().new_state(64, 16);
  run_chunked(*st, a, 60, ws);
  std::vector<float> lg;
  model().forward(*st, b, lg, {}, ws);  // to be dropped
  st->truncate(40);
  EXPECT_EQ(st->pos(), 40);
  const std::vector<int32_t> tail(a.begin() + 40, a.end());
  const auto again = run_chunked(*st, tail, 20, ws);
  auto fresh = model().new_state(64, 16);
  const auto full = run_chunked(*fresh, a, 60, ws);
  const std::vector<float> want(full.begin() + 40 * model().config().vocab_size, full.end());
  EXPECT_TRUE(same_bits(again, want));
  expect_same_cache(*st, *fresh);
  EXPECT_THROW(st->truncate(61), std::out_of_range);
  EXPECT_THROW(st->truncate(-1), std::out_of_range);
  auto small = model().new_state(4, 16);
  run_chunked(*small, a, 60, ws);
  EXPECT_THROW(small->truncate(55), std::out_of_range) << "beyond max_rollback";
  small->truncate(56);
}

TEST(V3Batch, SharedPrefixPagesAndClone) {
  const auto a = tokens(70, 8);
  Workspace ws;
  PagePool pool(size_t(64) << 20);
  auto st = model().new_state(64, 16, &pool);
  const auto full = run_chunked(*st, a, 70, ws);
  const size_t used = pool.used_bytes();
  EXPECT_EQ(used, size_t(5) * model().page_bytes(16));  // 70 tokens -> 5 pages per layer
  PrefixPages pages = st->share_prefix(64);
  auto b = model().new_state(64, 16, &pool);
  b->adopt_prefix(pages, std::span<const int32_t>(a.data(), 64));
  EXPECT_EQ(pool.used_bytes(), used) << "adopting shares pages";
  EXPECT_EQ(b->bytes_needed(6), model().page_bytes(16));
  const std::vector<int32_t> tail(a.begin() + 64, a.end());
  const auto rest = run_chunked(*b, tail, 6, ws);
  const std::vector<float> want(full.begin() + 64 * model().config().vocab_size, full.end());
  EXPECT_TRUE(same_bits(rest, want));
  // Writing into a shared page copies it: the original state's rows stay as they were.
  std::unique_ptr<SequenceState> c(static_cast<SequenceState*>(st->clone().release()));
  c->truncate(50);
  const auto other = tokens(5, 9);
  const size_t before = pool.used_bytes();
  EXPECT_EQ(c->bytes_needed(5), model().page_bytes(16));  // the shared partial page is copied
  std::vector<float> lg;
  model().forward(*c, other, lg, {}, ws);
  EXPECT_EQ(pool.used_bytes(), before + model().page_bytes(16));
  auto fresh = model().new_state(64, 16);
  run_chunked(*fresh, a, 70, ws);
  expect_same_cache(*st, *fresh);
  EXPECT_THROW(st->share_prefix(65), std::out_of_range);
}

TEST(V3Batch, PoolExhaustionRestoresState) {
  Workspace ws;
  PagePool pool(model().page_bytes(16));  // one page per layer
  auto st = model().new_state(64, 16, &pool);
  const auto a = tokens(20, 10);
  std::vector<float> lg;
  model().forward(*st, std::span<const int32_t>(a.data(), 10), lg, {}, ws);
  EXPECT_GT(st->bytes_needed(10), pool.free_bytes());
  EXPECT_THROW(model().forward(*st, std::span<const int32_t>(a.data() + 10, 10), lg, {}, ws), CacheExhausted);
  EXPECT_EQ(st->pos(), 10);
  for (const auto& cache : st->caches()) EXPECT_EQ(cache.size(), 10);
  // And it goes on as if nothing happened.
  model().forward(*st, std::span<const int32_t>(a.data() + 10, 6), lg, {}, ws);
  auto fresh = model().new_state(64, 16);
  std::vector<float> lg2;
  model().forward(*fresh, std::span<const int32_t>(a.data(), 16), lg2, {}, ws);
  EXPECT_TRUE(same_bits(lg, lg2));
}

// Through the architecture-neutral interface: load_model dispatches on config.json, and the
// interface's batch gives the concrete model's bits.
TEST(V3Batch, ModelInterface) {
  LoadOptions lo;
  lo.numerics = numerics_from_env(Numerics::Fast);
  di::LoadOptions o;
  o.numerics = lo.numerics;
  o.threads = 2;
  std::unique_ptr<di::Model> m = di::load_model(di::test::v3_golden_model_dir(), o);
  EXPECT_EQ(m->info().arch, "deepseek_v3");
  EXPECT_EQ(m->info().vocab_size, 129280);
  EXPECT_EQ(m->info().chat_format, "deepseek-v3");
  EXPECT_EQ(m->info().cache_format, model().info().cache_format);
  EXPECT_EQ(m->resume_tokens(), 0);
  const auto layout = m->cache_layout(16);
  ASSERT_EQ(layout.size(), 4u);
  EXPECT_EQ(layout[0].name, "layer0.latent_rope");
  EXPECT_EQ(layout[0].page_bytes(), size_t(16) * (32 + 16) * 4);
  PagePool pool(size_t(16) << 20);
  di::StateOptions so;
  so.page_tokens = 16;
  so.pool = &pool;
  auto a = m->new_state(so), b = m->new_state(so);
  auto ws = m->new_workspace();
  const auto ta = tokens(20, 11), tb = tokens(3, 12);
  std::vector<float> la, lb;
  std::vector<di::BatchItem> items = {{a.get(), ta, false, &la}, {b.get(), tb, true, &lb}};
  m->forward_batch(items, *ws);
  EXPECT_EQ(a->pos(), 20);
  EXPECT_EQ(pool.used_bytes(), size_t(2 + 1) * 4 * layout[0].page_bytes());
  Workspace w;
  auto ra = model().new_state(), rb = model().new_state();
  std::vector<float> wa, wb;
  model().forward(*ra, ta, wa, {}, w);
  ForwardOptions all;
  all.all_logits = true;
  model().forward(*rb, tb, wb, all, w);
  EXPECT_TRUE(same_bits(la, wa));
  EXPECT_TRUE(same_bits(lb, wb));
  // A prefix adopted from pages resumes with nothing to rebuild.
  auto c = m->new_state(so);
  c->adopt_prefix(a->share_prefix(16), std::span<const int32_t>(ta.data(), 16));
  m->resume(*c, *ws);
  std::vector<float> lc;
  std::vector<di::BatchItem> one = {{c.get(), std::span<const int32_t>(ta.data() + 16, 4), false, &lc}};
  m->forward_batch(one, *ws);
  EXPECT_TRUE(same_bits(lc, la));
}
