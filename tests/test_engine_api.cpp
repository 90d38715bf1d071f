// The threaded Engine: validation errors name the field, length and queue limits, concurrent
// submitters, cancellation from a sink, per-choice stop, deadlines, statistics, shutdown.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <functional>
#include <thread>

#include "test_engine_util.h"

using namespace di;
using namespace di::engine;
using di::test::Recorder;

namespace {

std::shared_ptr<const v41::Model> model() { return test::golden_model_ptr(); }

std::unique_ptr<Engine> make_engine(EngineOptions o = test::small_options()) { return Engine::create(model(), o); }

// Waits until the engine's published statistics satisfy `ok` (they lag the sinks by one step).
EngineStats wait_stats(Engine& e, const std::function<bool(const EngineStats&)>& ok) {
  for (int i = 0; i < 5000; ++i) {
    EngineStats s = e.stats();
    if (ok(s)) return s;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ADD_FAILURE() << "statistics never reached the expected state";
  return e.stats();
}

bool idle(const EngineStats& s) { return s.running == 0 && s.waiting == 0; }

TEST(EngineApi, InvalidParametersAreRejectedNamingTheField) {
  auto e = make_engine();
  const int32_t V = int32_t(model()->config().vocab_size);
  struct Case {
    std::function<void(RequestParams&)> mutate;
    std::string field;
  };
  const std::vector<Case> cases = {
      {[](RequestParams& p) { p.prompt.clear(); }, "prompt"},
      {[&](RequestParams& p) { p.prompt[1] = V; }, "prompt[1]"},
      {[](RequestParams& p) { p.prompt[0] = -3; }, "prompt[0]"},
      {[](RequestParams& p) { p.sampling.temperature = -0.1f; }, "temperature"},
      {[](RequestParams& p) { p.sampling.temperature = NAN; }, "temperature"},
      {[](RequestParams& p) { p.sampling.top_p = 0; }, "top_p"},
      {[](RequestParams& p) { p.sampling.top_p = 1.01f; }, "top_p"},
      {[](RequestParams& p) { p.sampling.top_k = -1; }, "top_k"},
      {[](RequestParams& p) { p.sampling.min_p = 1.5f; }, "min_p"},
      {[](RequestParams& p) { p.sampling.presence_penalty = 2.5f; }, "presence_penalty"},
      {[](RequestParams& p) { p.sampling.frequency_penalty = -3; }, "frequency_penalty"},
      {[](RequestParams& p) { p.sampling.repetition_penalty = 0; }, "repetition_penalty"},
      {[&](RequestParams& p) { p.sampling.logit_bias = {{V + 5, 1.0f}}; }, "logit_bias"},
      {[](RequestParams& p) { p.sampling.logit_bias = {{5, 101.0f}}; }, "logit_bias"},
      {[](RequestParams& p) { p.sampling.logprobs = -1; }, "logprobs"},
      {[](RequestParams& p) { p.sampling.logprobs = 1, p.sampling.top_logprobs = 21; }, "top_logprobs"},
      {[](RequestParams& p) { p.sampling.top_logprobs = 2; }, "top_logprobs"},
      {[](RequestParams& p) { p.n = 0; }, "n"},
      {[](RequestParams& p) { p.n = 17; }, "n"},
      {[](RequestParams& p) { p.max_tokens = 0; }, "max_tokens"},
      {[&](RequestParams& p) { p.stop_token_ids = {3, V}; }, "stop_token_ids"},
  };
  for (const auto& c : cases) {
    RequestParams p = test::greedy_request({5, 6, 7}, 4);
    c.mutate(p);
    const SubmitResult r = e->submit(p, std::make_shared<Recorder>());
    EXPECT_EQ(r.error, SubmitError::Invalid) << c.field;
    EXPECT_EQ(r.message.rfind(c.field + ":", 0), 0u) << "message '" << r.message << "' should start with " << c.field;
    EXPECT_EQ(r.id, 0u);
  }
  EXPECT_EQ(e->stats().requests_rejected, int64_t(cases.size()));
  EXPECT_EQ(e->stats().requests_submitted, 0);
  RequestParams ok = test::greedy_request({5, 6, 7}, 2);
  ok.sampling.logprobs = 1;
  ok.sampling.top_logprobs = 20;
  ok.n = 16;
  auto rec = std::make_shared<Recorder>(16);
  EXPECT_EQ(e->submit(ok, rec).error, SubmitError::None);
  EXPECT_TRUE(rec->wait());
}

TEST(EngineApi, TooLongNamesPromptOrMaxTokens) {
  EngineOptions o = test::small_options();
  o.max_context = 100;
  auto e = make_engine(o);
  std::vector<int32_t> prompt(100, 7);
  SubmitResult r = e->submit(test::greedy_request(prompt, 1), nullptr);
  EXPECT_EQ(r.error, SubmitError::TooLong);
  EXPECT_EQ(r.message.rfind("prompt:", 0), 0u) << r.message;
  EXPECT_NE(r.message.find("100"), std::string::npos) << r.message;
  prompt.resize(50);
  r = e->submit(test::greedy_request(prompt, 60), nullptr);
  EXPECT_EQ(r.error, SubmitError::TooLong);
  EXPECT_EQ(r.message.rfind("max_tokens:", 0), 0u) << r.message;
  EXPECT_NE(r.message.find("110"), std::string::npos) << r.message;
  auto rec = std::make_shared<Recorder>();
  EXPECT_EQ(e->submit(test::greedy_request(prompt, 50), rec).error, SubmitError::None) << "exactly the limit";
  EXPECT_TRUE(rec->wait());
  EXPECT_EQ(rec->tokens[0].size(), 50u);

  o = test::small_options();
  o.cache_budget_bytes = 256 << 10;  // a few pages
  auto small = make_engine(o);
  r = small->submit(test::greedy_request(std::vector<int32_t>(150, 9), 200), nullptr);
  EXPECT_EQ(r.error, SubmitError::TooLong);
  EXPECT_NE(r.message.find("cache budget"), std::string::npos) << r.message;
}

// A sink that parks the engine thread until released, so the queue state is deterministic.
class Gate : public Recorder {
 public:
  void on_token(const TokenEvent& e) override {
    Recorder::on_token(e);
    std::unique_lock lk(gm);
    gcv.wait(lk, [&] { return open; });
  }
  void release() {
    std::lock_guard lk(gm);
    open = true;
    gcv.notify_all();
  }
  std::mutex gm;
  std::condition_variable gcv;
  bool open = false;
};

TEST(EngineApi, FullQueueRejectsWithRetryAfter) {
  EngineOptions o = test::small_options();
  o.max_running = 1;
  o.max_waiting = 3;
  auto e = make_engine(o);
  auto gate = std::make_shared<Gate>();
  ASSERT_EQ(e->submit(test::greedy_request({5, 6, 7}, 3), gate).error, SubmitError::None);
  // Wait until the gated request runs (and blocks the engine in on_token): it no longer queues.
  for (int i = 0; i < 5000 && [&] { std::lock_guard lk(gate->mu); return gate->tokens[0].empty(); }(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  std::vector<std::shared_ptr<Recorder>> queued;
  for (int i = 0; i < 3; ++i) {
    queued.push_back(std::make_shared<Recorder>());
    EXPECT_EQ(e->submit(test::greedy_request({8, 9, 10, 11}, 2), queued.back()).error, SubmitError::None) << i;
  }
  const SubmitResult full = e->submit(test::greedy_request({8, 9}, 2), nullptr);
  EXPECT_EQ(full.error, SubmitError::QueueFull);
  EXPECT_GE(full.retry_after_s, 1);
  EXPECT_LE(full.retry_after_s, 600);
  EXPECT_NE(full.message.find("queue"), std::string::npos);
  gate->release();
  EXPECT_TRUE(gate->wait());
  for (auto& q : queued) EXPECT_TRUE(q->wait());
  auto later = std::make_shared<Recorder>();
  EXPECT_EQ(e->submit(test::greedy_request({8, 9}, 2), later).error, SubmitError::None) << "room again";
  EXPECT_TRUE(later->wait());
  const EngineStats s = wait_stats(*e, [](const EngineStats& s) { return s.requests_finished == 5; });
  EXPECT_EQ(s.requests_rejected, 1);
}

TEST(EngineApi, ConcurrentSubmittersGetExactlyTheirOwnResults) {
  auto e = make_engine();
  const auto c = test::corpus();
  constexpr int kThreads = 4, kPerThread = 3, kTokens = 6;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < kThreads * kPerThread; ++i) prompts.push_back(test::slice(c, size_t(i) * 13 % 120, size_t(5 + i * 7)));
  std::vector<std::shared_ptr<Recorder>> rec(prompts.size());
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int k = 0; k < kPerThread; ++k) {
        const size_t i = size_t(t * kPerThread + k);
        rec[i] = std::make_shared<Recorder>();
        const SubmitResult r = e->submit(test::greedy_request(prompts[i], kTokens), rec[i]);
        EXPECT_EQ(r.error, SubmitError::None);
        std::this_thread::sleep_for(std::chrono::milliseconds(5 * k));
      }
    });
  for (auto& th : threads) th.join();
  int64_t prompt_tokens = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_TRUE(rec[i]->wait());
    EXPECT_EQ(rec[i]->starts, 1);
    EXPECT_EQ(rec[i]->start.prompt_tokens, int(prompts[i].size()));
    EXPECT_EQ(rec[i]->tokens[0], test::greedy_alone(*model(), prompts[i], kTokens)) << i;
    prompt_tokens += int64_t(prompts[i].size());
  }
  const EngineStats s = wait_stats(*e, [&](const EngineStats& s) { return s.requests_finished == int64_t(prompts.size()); });
  EXPECT_EQ(s.requests_submitted, int64_t(prompts.size()));
  EXPECT_EQ(s.prompt_tokens, prompt_tokens);
  EXPECT_EQ(s.generated_tokens, int64_t(prompts.size()) * kTokens);
  EXPECT_TRUE(idle(s));
  EXPECT_EQ(s.cache_bytes_used, s.prefix_cache_bytes) << "no page outlives its request except in the prefix cache";
  EXPECT_EQ(s.cache_bytes_budget, test::small_options().cache_budget_bytes);
  EXPECT_GT(s.steps, 0);
  // Idle: the engine thread sleeps instead of stepping.
  const int64_t steps = e->stats().steps;
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(e->stats().steps, steps);
}

// Cancels its own request from inside on_token after a few tokens (like a client disconnecting).
class Disconnector : public Recorder {
 public:
  explicit Disconnector(Engine* e, int n = 1) : Recorder(n), engine(e) {}
  void on_token(const TokenEvent& ev) override {
    Recorder::on_token(ev);
    if (++seen == 3) {
      while (id.load() == 0) std::this_thread::yield();  // submit() may not have returned yet
      engine->cancel(id.load());
    }
  }
  Engine* engine;
  std::atomic<uint64_t> id{0};
  int seen = 0;
};

TEST(EngineApi, CancellationFromTheSinkFreesPages) {
  auto e = make_engine();
  const auto c = test::corpus();
  auto quitter = std::make_shared<Disconnector>(e.get(), 2);
  RequestParams p = test::greedy_request(test::slice(c, 0, 120), 20000);
  p.n = 2;
  p.sampling.temperature = 0.8f;
  const SubmitResult r = e->submit(p, quitter);
  ASSERT_EQ(r.error, SubmitError::None);
  quitter->id = r.id;
  auto bystander = std::make_shared<Recorder>();
  e->submit(test::greedy_request(test::slice(c, 60, 30), 8), bystander);
  ASSERT_TRUE(quitter->wait());
  EXPECT_EQ(quitter->reason(0), FinishReason::Cancelled);
  EXPECT_EQ(quitter->reason(1), FinishReason::Cancelled);
  EXPECT_LT(quitter->tokens[0].size(), 10u);
  ASSERT_TRUE(bystander->wait());
  EXPECT_EQ(bystander->reason(), FinishReason::Length);
  e->cancel(r.id);  // already gone: ignored
  const EngineStats s = wait_stats(*e, [](const EngineStats& s) { return s.requests_finished == 2; });
  EXPECT_TRUE(idle(s));
  EXPECT_EQ(s.cache_bytes_used, s.prefix_cache_bytes);
  EXPECT_GT(s.prefix_cache_entries, 0);
}

TEST(EngineApi, StopChoiceEndsOneChoiceOnly) {
  auto e = make_engine();
  RequestParams p = test::greedy_request(test::golden_tensor("prompts.p3.tokens"), 12);
  p.n = 3;
  p.sampling.temperature = 1.0f;
  p.sampling.seed = 3;
  auto rec = std::make_shared<Recorder>(3);
  const SubmitResult r = e->submit(p, rec);
  e->stop_choice(r.id, 1);  // most likely before the fork: remembered until then
  e->stop_choice(r.id, 7);  // no such choice: ignored
  ASSERT_TRUE(rec->wait());
  EXPECT_EQ(rec->reason(1), FinishReason::Stop);
  EXPECT_EQ(rec->finish[1]->stop_token, -1);
  EXPECT_LE(rec->tokens[1].size(), 1u);
  EXPECT_EQ(rec->reason(0), FinishReason::Length);
  EXPECT_EQ(rec->reason(2), FinishReason::Length);
  EXPECT_EQ(rec->tokens[2].size(), 12u);
}

TEST(EngineApi, DeadlineFinishesALongRequest) {
  auto e = make_engine();
  RequestParams p = test::greedy_request(test::golden_tensor("prompts.p2.tokens"), 20000);
  p.deadline = Clock::now() + std::chrono::milliseconds(300);
  auto rec = std::make_shared<Recorder>();
  ASSERT_EQ(e->submit(p, rec).error, SubmitError::None);
  ASSERT_TRUE(rec->wait(20));
  EXPECT_EQ(rec->reason(), FinishReason::Deadline);
  EXPECT_GT(rec->tokens[0].size(), 0u);
  EXPECT_GE(Clock::now(), *p.deadline);
}

TEST(EngineApi, ShutdownCancelsEverythingAndRefusesNewWork) {
  auto e = make_engine();
  std::vector<std::shared_ptr<Recorder>> rec;
  for (int i = 0; i < 3; ++i) {
    rec.push_back(std::make_shared<Recorder>(2));
    RequestParams p = test::greedy_request({5, 6, 7, int32_t(8 + i)}, 20000);
    p.n = 2;
    ASSERT_EQ(e->submit(p, rec.back()).error, SubmitError::None);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  e->shutdown();
  for (auto& r : rec) {
    ASSERT_TRUE(r->done()) << "shutdown returns after every choice has finished";
    EXPECT_EQ(r->reason(0), FinishReason::Cancelled);
    EXPECT_EQ(r->reason(1), FinishReason::Cancelled);
  }
  const SubmitResult after = e->submit(test::greedy_request({5}, 1), nullptr);
  EXPECT_EQ(after.error, SubmitError::ShuttingDown);
  e->shutdown();  // idempotent
  EXPECT_EQ(e->stats().requests_finished, 3);
}

}  // namespace
