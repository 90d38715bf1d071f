// The engine against a fake model (tests/fake_model.h): the scheduler, prefix cache, preemption,
// n > 1 forks, budgets and the threaded engine need nothing of a real architecture. Fast: no
// checkpoint, no kernels.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <span>
#include <memory>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "engine/request.h"
#include "engine/scheduler.h"
#include "fake_model.h"
#include "test_engine_util.h"

using namespace di;
using namespace di::engine;
using di::test::FakeModel;
using di::test::prompt_of;
using di::test::Recorder;

namespace {

EngineOptions options() { return test::fake_engine_options(); }

void expect_no_leak(Scheduler& s) {
  EXPECT_EQ(s.pool().used_bytes(), s.prefix_cache().bytes()) << "only the prefix cache may hold pages when idle";
  s.prefix_cache().evict_all();
  EXPECT_EQ(s.pool().used_bytes(), 0u);
  EXPECT_EQ(s.pool().pages_in_use(), 0);
  EXPECT_EQ(s.state_pool().used_bytes(), 0u);
}

TEST(EngineFake, FakeModelStateFollowsTheInterface) {
  // The fake itself: chunking, clone (copy-on-write) and truncate do not change the logits.
  FakeModel m;
  kvcache::PagePool pool(1 << 20);
  auto ws = m.new_workspace();
  const auto p = prompt_of(21, 1);
  auto a = m.new_state({8, 8, &pool, nullptr});
  std::vector<float> la, lb;
  BatchItem ia{a.get(), p, false, &la};
  m.forward_batch(std::span(&ia, 1), *ws);
  auto b = a->clone();
  const int32_t t1 = 5, t2 = 6;
  BatchItem x{a.get(), std::span(&t1, 1), false, &la};
  m.forward_batch(std::span(&x, 1), *ws);
  BatchItem y{b.get(), std::span(&t2, 1), false, &lb};
  m.forward_batch(std::span(&y, 1), *ws);
  EXPECT_NE(la, lb) << "the clone's page is its own after the write";
  a->truncate(21);
  BatchItem z{a.get(), std::span(&t2, 1), false, &la};
  m.forward_batch(std::span(&z, 1), *ws);
  EXPECT_EQ(la, lb) << "truncate + the other token = the clone's path";
  EXPECT_THROW(a->truncate(0), std::out_of_range) << "beyond max_rollback";
}

TEST(EngineFake, BatchedChunkedGreedyMatchesTheOracle) {
  FakeModel m;
  Scheduler s(m, options());
  std::vector<std::shared_ptr<Recorder>> rec;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 8; ++i) {
    prompts.push_back(prompt_of(1 + i * 9, i));
    rec.push_back(std::make_shared<Recorder>());
    s.add(uint64_t(i + 1), test::greedy_request(prompts.back(), 12), rec.back(), 1);
    if (i == 3) s.step();
  }
  test::run_all(s);
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_TRUE(rec[i]->done());
    EXPECT_EQ(rec[i]->reason(), FinishReason::Length);
    EXPECT_EQ(rec[i]->tokens[0], FakeModel::greedy(prompts[i], 12)) << "prompt " << i;
  }
  EXPECT_LT(s.counters().steps, 8 * 12) << "requests were batched";
  expect_no_leak(s);
}

TEST(EngineFake, PrefixCacheHitResumesAndMatches) {
  FakeModel m;
  Scheduler s(m, options());
  const auto shared = prompt_of(40, 3);
  auto p1 = shared, p2 = shared;
  p1.push_back(7);
  p2.insert(p2.end(), {9, 10, 11});
  auto r1 = std::make_shared<Recorder>(), r2 = std::make_shared<Recorder>();
  s.add(1, test::greedy_request(p1, 6), r1, 1);
  test::run_all(s);
  EXPECT_EQ(r1->start.cached_tokens, 0);
  const int64_t resumes = m.resumes;
  s.add(2, test::greedy_request(p2, 6), r2, 1);
  test::run_all(s);
  EXPECT_EQ(r2->start.cached_tokens, 40) << "five whole 8-token pages of the shared prompt";
  EXPECT_EQ(m.resumes, resumes + 1) << "the adopted state was resumed";
  EXPECT_EQ(r1->tokens[0], FakeModel::greedy(p1, 6));
  EXPECT_EQ(r2->tokens[0], FakeModel::greedy(p2, 6));
  EXPECT_GT(s.prefix_cache().entries(), 0u);
  expect_no_leak(s);
}

TEST(EngineFake, CacheSaltSeparatesNamespaces) {
  FakeModel m;
  Scheduler s(m, options());
  const auto p = prompt_of(33, 4);
  auto a = std::make_shared<Recorder>(), b = std::make_shared<Recorder>();
  s.add(1, test::greedy_request(p, 2), a, 1);
  test::run_all(s);
  RequestParams q = test::greedy_request(p, 2);
  q.cache_salt = "tenant-b";
  s.add(2, std::move(q), b, 1);
  test::run_all(s);
  EXPECT_EQ(b->start.cached_tokens, 0);
  EXPECT_EQ(b->tokens[0], a->tokens[0]);
}

TEST(EngineFake, SnapshotHitsRestoreInsteadOfResuming) {
  FakeModel m(4096, /*snapshots=*/true);
  Scheduler s(m, options());
  const auto shared = prompt_of(40, 3);
  auto p1 = shared, p2 = shared;
  p1.push_back(7);
  p2.insert(p2.end(), {9, 10, 11});
  auto r1 = std::make_shared<Recorder>(), r2 = std::make_shared<Recorder>(), r3 = std::make_shared<Recorder>();
  s.add(1, test::greedy_request(p1, 12), r1, 1);
  test::run_all(s);
  const int64_t restores = FakeModel::State::restores, resumes = m.resumes;
  s.add(2, test::greedy_request(p2, 6), r2, 1);  // resumes at 40, the last page boundary of p1's prompt
  test::run_all(s);
  EXPECT_EQ(r2->start.cached_tokens, 40);
  // The next turn of the first conversation resumes where its completion's last page ended (48).
  auto turn = p1;
  turn.insert(turn.end(), r1->tokens[0].begin(), r1->tokens[0].end());
  turn.insert(turn.end(), {20, 21});
  s.add(3, test::greedy_request(turn, 6), r3, 1);
  test::run_all(s);
  EXPECT_EQ(r3->start.cached_tokens, 48) << "(41 + 11 processed tokens) / 8 whole pages";
  EXPECT_EQ(FakeModel::State::restores, restores + 2);
  EXPECT_EQ(m.resumes, resumes) << "nothing was replayed";
  EXPECT_EQ(s.counters().snapshot_hits, 2);
  EXPECT_EQ(s.counters().replayed_tokens, 0);
  EXPECT_EQ(r1->tokens[0], FakeModel::greedy(p1, 12));
  EXPECT_EQ(r2->tokens[0], FakeModel::greedy(p2, 6));
  EXPECT_EQ(r3->tokens[0], FakeModel::greedy(turn, 6));
  EXPECT_GT(s.prefix_cache().snapshots(), 0u);
  expect_no_leak(s);
}

void preemption_is_invisible(const FakeModel& m) {
  EngineOptions o = options();
  Scheduler probe(m, o);
  o.cache_budget_bytes = 3 * probe.sequence_bytes(60);  // far less than 8 requests of 60 tokens
  Scheduler s(m, o);
  std::vector<std::shared_ptr<Recorder>> rec;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 8; ++i) {
    prompts.push_back(prompt_of(3 + i, 10 + i));
    rec.push_back(std::make_shared<Recorder>());
    s.add(uint64_t(i + 1), test::greedy_request(prompts.back(), 50), rec.back(), 1);
  }
  test::run_all(s, 20000);
  EXPECT_GE(s.counters().preemptions, 3);
  EXPECT_GE(s.counters().preempted_with_output, 1);
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_TRUE(rec[i]->done());
    EXPECT_EQ(rec[i]->reason(), FinishReason::Length) << i;
    EXPECT_EQ(rec[i]->tokens[0], FakeModel::greedy(prompts[i], 50)) << "request " << i;
  }
  expect_no_leak(s);
}

TEST(EngineFake, PreemptionUnderASmallBudgetIsInvisible) { preemption_is_invisible(FakeModel()); }

TEST(EngineFake, PreemptionWithSnapshotsUnderASmallBudgetIsInvisible) {
  // Decoding choices keep a snapshot at their last page boundary, drawn from the same budget.
  preemption_is_invisible(FakeModel(4096, true));
}

TEST(EngineFake, ForkedChoicesSharePagesAndDecodeIndependently) {
  FakeModel m;
  Scheduler s(m, options());
  RequestParams p = test::greedy_request(prompt_of(20, 5), 10);
  p.n = 3;
  auto rec = std::make_shared<Recorder>(3);
  s.add(1, p, rec, 1);
  // Run until the prompt is done and the choices exist: every choice's pages but the partial last
  // one are shared with the leader.
  while (s.running_choices() < 3 && s.has_work()) s.step();
  ASSERT_EQ(s.running_choices(), 3);
  const int64_t pages_forked = s.pool().pages_in_use();
  EXPECT_LE(pages_forked, 3) << "20 tokens = 3 pages, shared by the choices";
  test::run_all(s);
  for (int c = 0; c < 3; ++c) EXPECT_EQ(rec->tokens[size_t(c)], FakeModel::greedy(p.prompt, 10)) << "choice " << c;
  expect_no_leak(s);

  // Seeded sampling: the choices draw from their own streams.
  RequestParams q = p;
  q.sampling.temperature = 1.5f;
  q.sampling.seed = 7;
  auto rq = std::make_shared<Recorder>(3);
  s.add(2, q, rq, 1);
  test::run_all(s);
  EXPECT_FALSE(rq->tokens[0] == rq->tokens[1] && rq->tokens[1] == rq->tokens[2]);
}

// With return_logits, each choice's sink sees the row each of its tokens is sampled from, before
// the token; without it, none.
TEST(EngineFake, ReturnedLogitsAreTheRowsTokensAreSampledFrom) {
  struct LogitsRecorder : Recorder {
    using Recorder::Recorder;
    void on_logits(int choice, std::span<const float> row) override {
      std::lock_guard lk(mu);
      EXPECT_EQ(rows.at(size_t(choice)).size(), tokens.at(size_t(choice)).size()) << "the row comes before its token";
      rows[size_t(choice)].emplace_back(row.begin(), row.end());
    }
    std::vector<std::vector<std::vector<float>>> rows = std::vector<std::vector<std::vector<float>>>(2);
  };
  FakeModel m;
  Scheduler s(m, options());
  RequestParams p = test::greedy_request(prompt_of(20, 9), 6);
  p.n = 2;
  p.return_logits = true;
  auto rec = std::make_shared<LogitsRecorder>(2);
  s.add(1, p, rec, 1);
  test::run_all(s);
  for (int c = 0; c < 2; ++c) {
    ASSERT_EQ(rec->tokens[size_t(c)].size(), 6u);
    ASSERT_EQ(rec->rows[size_t(c)].size(), 6u);
    for (size_t j = 0; j < 6; ++j) {
      const auto& row = rec->rows[size_t(c)][j];
      ASSERT_EQ(row.size(), size_t(FakeModel::kVocab));
      EXPECT_EQ(std::max_element(row.begin(), row.end()) - row.begin(), rec->tokens[size_t(c)][j]) << c << " " << j;
    }
  }
  EXPECT_EQ(rec->rows[0][0], rec->rows[1][0]) << "both choices sample their first token from the prompt's logits";

  p.return_logits = false;
  auto quiet = std::make_shared<LogitsRecorder>(2);
  s.add(2, p, quiet, 1);
  test::run_all(s);
  EXPECT_EQ(quiet->tokens[0], rec->tokens[0]);
  EXPECT_TRUE(quiet->rows[0].empty() && quiet->rows[1].empty());
}

TEST(EngineFake, StateBudgetLimitsRunningSequences) {
  FakeModel m;
  EngineOptions o = options();
  o.state_budget_bytes = 2 * FakeModel::kFixedBytes;  // fixed state of two sequences
  Scheduler s(m, o);
  std::vector<std::shared_ptr<Recorder>> rec;
  for (int i = 0; i < 5; ++i) {
    rec.push_back(std::make_shared<Recorder>());
    s.add(uint64_t(i + 1), test::greedy_request(prompt_of(5, 20 + i), 6), rec.back(), 1);
  }
  int most = 0;
  for (int k = 0; k < 5000 && s.has_work(); ++k) {
    s.step();
    most = std::max(most, s.running_choices());
  }
  EXPECT_EQ(most, 2);
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(rec[size_t(i)]->done());
    EXPECT_EQ(rec[size_t(i)]->tokens[0], FakeModel::greedy(prompt_of(5, 20 + i), 6));
  }
  expect_no_leak(s);
}

TEST(EngineFake, ValidationUsesTheModelInfo) {
  FakeModel m(/*max_context=*/64);
  EngineOptions o = options();
  Scheduler s(m, o);
  auto bytes = [&](int64_t n) { return s.sequence_bytes(n); };
  RequestParams p = test::greedy_request(prompt_of(10, 1), 8);
  EXPECT_EQ(validate_request(p, m.info(), o, bytes).error, SubmitError::None);
  p.prompt[3] = FakeModel::kVocab;  // outside the model's vocabulary
  EXPECT_EQ(validate_request(p, m.info(), o, bytes).error, SubmitError::Invalid);
  p = test::greedy_request(prompt_of(60, 1), 8);  // 68 > the model's 64 positions
  EXPECT_EQ(validate_request(p, m.info(), o, bytes).error, SubmitError::TooLong);
  o.cache_budget_bytes = s.sequence_bytes(10);  // one choice could never fit
  p = test::greedy_request(prompt_of(10, 1), 40);
  EXPECT_EQ(validate_request(p, m.info(), o, bytes).error, SubmitError::TooLong);
}

TEST(EngineFake, ThreadedEngineServesAndStops) {
  auto m = std::make_shared<FakeModel>();
  auto eng = Engine::create(m, options());
  std::vector<std::shared_ptr<Recorder>> rec;
  for (int i = 0; i < 4; ++i) {
    rec.push_back(std::make_shared<Recorder>());
    ASSERT_EQ(eng->submit(test::greedy_request(prompt_of(12 + i, 30 + i), 9), rec.back()).error, SubmitError::None);
  }
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(rec[size_t(i)]->wait());
    EXPECT_EQ(rec[size_t(i)]->tokens[0], FakeModel::greedy(prompt_of(12 + i, 30 + i), 9));
  }
  EXPECT_EQ(&eng->model(), m.get());
  // Statistics are published after the step that finished the requests.
  for (int k = 0; k < 500 && eng->stats().generated_tokens < 36; ++k) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(eng->stats().generated_tokens, 36);
  eng->shutdown();
}

}  // namespace
