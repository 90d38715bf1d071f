// The scheduler driven step by step: continuous batching gives every request what it gets alone,
// preemption by recompute is invisible in the output, seeds do not depend on batch composition,
// n > 1 shares the prompt, and no page is leaked.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "test_engine_util.h"

using namespace di;
using namespace di::engine;
using di::test::Recorder;

namespace {

const v41::Model& model() { return test::golden_model(); }

// Prompts of many lengths (1 .. 150 tokens) cut from the corpus and the golden prompts.
std::vector<std::vector<int32_t>> mixed_prompts() {
  const auto c = test::corpus();
  std::vector<std::vector<int32_t>> ps;
  for (int p = 0; p < 5; ++p) ps.push_back(test::golden_tensor("prompts.p" + std::to_string(p) + ".tokens"));
  ps.push_back(test::slice(c, 7, 3));
  ps.push_back(test::slice(c, 20, 90));
  ps.push_back(test::slice(c, 50, 150));
  return ps;
}

void expect_no_leak(Scheduler& s) {
  EXPECT_EQ(s.pool().used_bytes(), s.prefix_cache().bytes()) << "only the prefix cache may hold pages when idle";
  s.prefix_cache().evict_all();
  EXPECT_EQ(s.prefix_cache().entries(), 0u);
  EXPECT_EQ(s.pool().used_bytes(), 0u);
  EXPECT_EQ(s.pool().pages_in_use(), 0);
}

TEST(EngineScheduler, ConcurrentGreedyRequestsMatchGoldenAndRunningAlone) {
  const auto prompts = mixed_prompts();
  constexpr int kTokens = 10;
  EngineOptions o = test::small_options();
  o.max_batch_tokens = 40;  // forces chunked prefill mixed with decodes
  Scheduler s(model(), o);
  std::vector<std::shared_ptr<Recorder>> rec;
  // Half arrive at once, the rest while the first are decoding.
  for (size_t i = 0; i < prompts.size(); ++i) {
    rec.push_back(std::make_shared<Recorder>());
    s.add(i + 1, test::greedy_request(prompts[i], kTokens), rec.back(), 1);
    if (i == prompts.size() / 2) for (int k = 0; k < 3; ++k) s.step();
  }
  test::run_all(s);
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_TRUE(rec[i]->done());
    EXPECT_EQ(rec[i]->reason(), FinishReason::Length);
    EXPECT_EQ(rec[i]->tokens[0], test::greedy_alone(model(), prompts[i], kTokens)) << "prompt " << i;
  }
  // The golden greedy ids are teacher-forced reference outputs; free-running greedy follows them
  // for as long as the logits stay bit-exact, which they do for the first steps of p0.
  EXPECT_EQ(rec[0]->tokens[0], test::slice(test::golden_tensor("fixed.p0.greedy"), 0, kTokens));
  EXPECT_LT(s.counters().steps, int64_t(prompts.size()) * kTokens) << "requests were batched";
  expect_no_leak(s);
}

// Seeded sampling with every sampling feature on: tokens and logprobs of each request are the same
// alone and in any batch.
TEST(EngineScheduler, SeededSamplingDoesNotDependOnTheBatch) {
  const auto prompts = mixed_prompts();
  auto params = [&](size_t i) {
    RequestParams p;
    p.prompt = prompts[i];
    p.max_tokens = 8;
    p.ignore_eos = true;
    p.sampling.temperature = 0.9f;
    p.sampling.top_p = 0.95f;
    p.sampling.top_k = 50;
    p.sampling.min_p = 0.01f;
    p.sampling.presence_penalty = 0.3f;
    p.sampling.frequency_penalty = 0.2f;
    p.sampling.repetition_penalty = 1.1f;
    p.sampling.seed = 1000 + i;
    p.sampling.logprobs = 1;
    p.sampling.top_logprobs = 3;
    return p;
  };
  std::vector<std::shared_ptr<Recorder>> alone;
  for (size_t i = 0; i < prompts.size(); ++i) {
    Scheduler s(model(), test::small_options());
    alone.push_back(std::make_shared<Recorder>());
    s.add(1, params(i), alone.back(), 0);
    test::run_all(s);
  }
  EngineOptions o = test::small_options();
  o.max_batch_tokens = 24;
  Scheduler s(model(), o);
  std::vector<std::shared_ptr<Recorder>> batched;
  for (size_t i = prompts.size(); i-- > 0;) {  // reverse order, other ids, other engine seeds
    batched.insert(batched.begin(), std::make_shared<Recorder>());
    s.add(100 + i, params(i), batched.front(), 777);
  }
  test::run_all(s);
  bool differs_from_greedy = false;
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(batched[i]->tokens[0], alone[i]->tokens[0]) << "prompt " << i;
    EXPECT_EQ(batched[i]->logprobs[0], alone[i]->logprobs[0]) << "prompt " << i;
    ASSERT_EQ(batched[i]->tokens[0].size(), 8u);
    for (size_t t = 0; t < 8; ++t) differs_from_greedy |= batched[i]->tokens[0][t] != batched[i]->tops[0][t][0].token;
  }
  EXPECT_TRUE(differs_from_greedy) << "sampling at T=0.9 should sometimes leave the argmax";
}

TEST(EngineScheduler, PreemptionByRecomputeIsInvisibleInTheOutput) {
  // Short prompts that grow a lot: admission sees little need, decoding then runs out of pages.
  const auto c = test::corpus();
  auto params = [&](size_t i) {
    RequestParams p = test::greedy_request(test::slice(c, i * 11, 2 + i * 3), 32);
    if (i % 2) {
      p.sampling.temperature = 1.0f;
      p.sampling.seed = 5 + i;
    }
    return p;
  };
  const size_t n_req = 8;
  std::vector<std::shared_ptr<Recorder>> ref;
  {
    Scheduler s(model(), test::small_options());
    for (size_t i = 0; i < n_req; ++i) {
      ref.push_back(std::make_shared<Recorder>());
      s.add(i + 1, params(i), ref.back(), 0);
    }
    test::run_all(s);
    EXPECT_EQ(s.counters().preemptions, 0);
  }
  EngineOptions o = test::small_options();
  Scheduler probe(model(), o);
  // Room for about a third of what the requests need at the end.
  o.cache_budget_bytes = 2 * probe.sequence_bytes(2 + 21 + 32);
  Scheduler s(model(), o);
  std::vector<std::shared_ptr<Recorder>> got;
  for (size_t i = 0; i < n_req; ++i) {
    got.push_back(std::make_shared<Recorder>());
    s.add(i + 1, params(i), got.back(), 0);
  }
  test::run_all(s, 20000);
  EXPECT_GE(s.counters().preemptions, 5) << "the budget should force repeated preemption";
  EXPECT_GE(s.counters().preempted_with_output, 2) << "recompute must cover generated tokens too";
  for (size_t i = 0; i < n_req; ++i) {
    ASSERT_TRUE(got[i]->done());
    EXPECT_EQ(got[i]->reason(), FinishReason::Length) << i;
    EXPECT_EQ(got[i]->tokens[0], ref[i]->tokens[0]) << "request " << i;
  }
  expect_no_leak(s);
}

TEST(EngineScheduler, ChoicesShareThePromptAndKeepTheirOwnStreams) {
  const auto prompt = test::slice(test::corpus(), 0, 150);
  auto params = [&](int n) {
    RequestParams p;
    p.prompt = prompt;
    p.n = n;
    p.max_tokens = 6;
    p.ignore_eos = true;
    p.sampling.temperature = 1.5f;
    p.sampling.seed = 99;
    return p;
  };
  EngineOptions o = test::small_options();
  o.prefix_cache = false;  // measure the sharing itself
  o.max_batch_tokens = 512;
  auto single = std::make_shared<Recorder>(1);
  size_t single_bytes = 0;
  {
    Scheduler s(model(), o);
    s.add(1, params(1), single, 0);
    s.step();  // the whole prompt and the first token
    single_bytes = s.pool().used_bytes();
    test::run_all(s);
  }
  Scheduler s(model(), o);
  auto multi = std::make_shared<Recorder>(4);
  s.add(1, params(4), multi, 0);
  s.step();
  EXPECT_EQ(s.pool().used_bytes(), single_bytes) << "the prompt ran once; its pages are shared by the choices";
  for (int c = 0; c < 4; ++c) EXPECT_EQ(multi->tokens[size_t(c)].size(), 1u);
  s.step();
  // Each choice copied at most the partial last page of each cache.
  EXPECT_LE(s.pool().used_bytes(), single_bytes + 4 * s.sequence_bytes(1));
  test::run_all(s);
  EXPECT_EQ(s.counters().steps, 6) << "one prefill step, then the choices decode together";
  EXPECT_EQ(multi->tokens[0], single->tokens[0]) << "choice 0 has the stream of an n = 1 request";
  std::set<std::vector<int32_t>> distinct(multi->tokens.begin(), multi->tokens.end());
  EXPECT_GT(distinct.size(), 2u) << "choices draw from different streams";
  for (int c = 0; c < 4; ++c) EXPECT_EQ(multi->reason(c), FinishReason::Length);
  expect_no_leak(s);
}

TEST(EngineScheduler, CancellationFreesPagesAndFinishesEveryChoice) {
  Scheduler s(model(), test::small_options());
  const auto c = test::corpus();
  auto running = std::make_shared<Recorder>(3), waiting = std::make_shared<Recorder>(2), other = std::make_shared<Recorder>();
  RequestParams p = test::greedy_request(test::slice(c, 0, 100), 50);
  p.n = 3;
  p.sampling.temperature = 1;
  s.add(1, p, running, 0);
  RequestParams q = test::greedy_request(test::slice(c, 30, 120), 50);
  q.n = 2;
  s.add(2, q, waiting, 0);  // still in its prefill (48-token budget) when cancelled
  s.add(3, test::greedy_request(test::slice(c, 100, 20), 4), other, 0);
  for (int i = 0; i < 4; ++i) s.step();
  ASSERT_FALSE(running->tokens[0].empty());
  ASSERT_TRUE(waiting->tokens[0].empty());
  s.cancel(1);
  s.cancel(2);
  s.cancel(12345);  // unknown: ignored
  for (int ch = 0; ch < 3; ++ch) EXPECT_EQ(running->reason(ch), FinishReason::Cancelled);
  for (int ch = 0; ch < 2; ++ch) EXPECT_EQ(waiting->reason(ch), FinishReason::Cancelled);
  test::run_all(s);
  EXPECT_EQ(other->reason(), FinishReason::Length);
  expect_no_leak(s);
}

TEST(EngineScheduler, DeadlinesFinishRequestsWhereverTheyAre) {
  Scheduler s(model(), test::small_options());
  const auto c = test::corpus();
  auto past = std::make_shared<Recorder>(), soon = std::make_shared<Recorder>(), free_run = std::make_shared<Recorder>();
  RequestParams p = test::greedy_request(test::slice(c, 0, 20), 10);
  p.deadline = Clock::now();
  s.add(1, p, past, 0);
  p = test::greedy_request(test::slice(c, 0, 20), 100000);
  p.deadline = Clock::now() + std::chrono::milliseconds(300);
  s.add(2, p, soon, 0);
  s.add(3, test::greedy_request(test::slice(c, 0, 20), 3), free_run, 0);
  test::run_all(s, 100000);
  EXPECT_EQ(past->reason(), FinishReason::Deadline);
  EXPECT_TRUE(past->tokens[0].empty());
  EXPECT_EQ(soon->reason(), FinishReason::Deadline);
  EXPECT_FALSE(soon->tokens[0].empty());
  EXPECT_EQ(free_run->reason(), FinishReason::Length);
  expect_no_leak(s);
}

TEST(EngineScheduler, StopTokensEosAndMaxTokens) {
  Scheduler s(model(), test::small_options());
  const auto prompt = test::golden_tensor("prompts.p3.tokens");
  const auto golden = test::golden_tensor("fixed.p3.greedy");
  auto stop = std::make_shared<Recorder>(), eos = std::make_shared<Recorder>(), len = std::make_shared<Recorder>();
  RequestParams p = test::greedy_request(prompt, 16);
  p.stop_token_ids = {golden[3]};
  s.add(1, p, stop, 0);
  // The golden model's EOS is token 1: bias it to the top so that the first token is EOS.
  p = test::greedy_request(prompt, 16);
  p.ignore_eos = false;
  p.sampling.logit_bias = {{int32_t(model().config().eos_token_id), 100.0f}};
  s.add(2, p, eos, 0);
  s.add(3, test::greedy_request(prompt, 5), len, 0);
  test::run_all(s);
  const size_t first_stop = size_t(std::find(golden.begin(), golden.end(), golden[3]) - golden.begin());
  EXPECT_EQ(stop->tokens[0], test::slice(golden, 0, first_stop));
  EXPECT_EQ(stop->reason(), FinishReason::Stop);
  EXPECT_EQ(stop->finish[0]->stop_token, golden[3]);
  EXPECT_TRUE(eos->tokens[0].empty());
  EXPECT_EQ(eos->reason(), FinishReason::Stop);
  EXPECT_EQ(eos->finish[0]->stop_token, int32_t(model().config().eos_token_id));
  EXPECT_EQ(len->tokens[0], test::slice(golden, 0, 5));
  EXPECT_EQ(len->reason(), FinishReason::Length);
  EXPECT_EQ(len->finish[0]->stop_token, -1);
}

TEST(EngineScheduler, LogprobsAndBiasThroughTheEngine) {
  Scheduler s(model(), test::small_options());
  const auto prompt = test::golden_tensor("prompts.p4.tokens");
  const auto golden = test::greedy_alone(model(), prompt, 12);
  auto lp = std::make_shared<Recorder>(), biased = std::make_shared<Recorder>(), penal = std::make_shared<Recorder>();
  RequestParams p = test::greedy_request(prompt, 6);
  p.sampling.logprobs = 1;
  p.sampling.top_logprobs = 5;
  s.add(1, p, lp, 0);
  p = test::greedy_request(prompt, 6);
  p.sampling.logit_bias = {{4242, 60.0f}};
  s.add(2, p, biased, 0);
  // A bias makes token 4242 the favourite; the frequency penalty wears it down after a few uses.
  // Oracle: the same greedy loop with bias and penalties applied to the raw logits by hand.
  std::vector<int32_t> want;
  float bias = 0;
  {
    v41::SequenceState st = model().new_state();
    v41::Workspace ws;
    std::vector<float> z;
    model().forward(st, prompt, z, {}, ws);
    bias = *std::max_element(z.begin(), z.end()) - z[4242] + 3.0f;
    ASSERT_LT(bias, 100.0f);
    std::map<int32_t, int> count;
    for (int i = 0; i < 12; ++i) {
      z[4242] += bias;
      for (auto [t, c] : count) z[size_t(t)] -= float(c) * 2.0f + 0.5f;
      const int32_t next = int32_t(std::max_element(z.begin(), z.end()) - z.begin());
      want.push_back(next);
      ++count[next];
      model().forward(st, std::span(&want.back(), 1), z, {}, ws);
    }
  }
  p = test::greedy_request(prompt, 12);
  p.sampling.logit_bias = {{4242, bias}};
  p.sampling.frequency_penalty = 2.0f;
  p.sampling.presence_penalty = 0.5f;
  s.add(3, p, penal, 0);
  test::run_all(s);
  EXPECT_EQ(lp->tokens[0], test::slice(golden, 0, 6));
  for (size_t t = 0; t < 6; ++t) {
    const auto& top = lp->tops[0][t];
    ASSERT_EQ(top.size(), 5u);
    EXPECT_EQ(top[0].token, lp->tokens[0][t]) << "greedy picks the most likely token";
    EXPECT_EQ(top[0].logprob, lp->logprobs[0][t]);
    double mass = 0;
    for (size_t k = 0; k < 5; ++k) {
      mass += std::exp(double(top[k].logprob));
      EXPECT_LE(top[k].logprob, 0.0f);
      if (k > 0) EXPECT_GE(top[k - 1].logprob, top[k].logprob);
    }
    EXPECT_LE(mass, 1.0 + 1e-6);
  }
  EXPECT_EQ(biased->tokens[0], std::vector<int32_t>(6, 4242));
  EXPECT_EQ(penal->tokens[0], want);
  const auto uses = std::count(want.begin(), want.end(), 4242);
  EXPECT_GE(uses, 1) << "the bias wins at first";
  EXPECT_LT(uses, 12) << "the penalties take over";
}

}  // namespace

namespace {

class StartLog : public Recorder {
 public:
  StartLog(std::vector<int>* log, int tag) : log_(log), tag_(tag) {}
  void on_start(const StartEvent& e) override {
    Recorder::on_start(e);
    log_->push_back(tag_);
  }

 private:
  std::vector<int>* log_;
  int tag_;
};

std::vector<int> start_order(bool priority) {
  EngineOptions o = test::small_options();
  o.max_running = 1;
  o.priority_scheduling = priority;
  Scheduler s(model(), o);
  std::vector<int> log;
  const int prio[] = {0, 0, 5, -1, 5};
  for (int i = 0; i < 5; ++i) {
    RequestParams p = test::greedy_request({5, 6, int32_t(7 + i)}, 2);
    p.priority = prio[i];
    s.add(uint64_t(i + 1), p, std::make_shared<StartLog>(&log, i), 0);
  }
  test::run_all(s);
  return log;
}

TEST(EngineScheduler, FcfsOrPriorityAdmission) {
  EXPECT_EQ(start_order(false), (std::vector<int>{0, 1, 2, 3, 4}));
  // All five wait before the first step: higher priority first, FCFS within a priority.
  EXPECT_EQ(start_order(true), (std::vector<int>{2, 4, 0, 1, 3}));
}

}  // namespace

namespace {
// The fixed per-sequence state (window rings, compressor inputs) comes from its own byte budget:
// with room for two sequences, at most two run at once, n > 1 requests wait until all their choices
// fit, every request still completes exactly, and the budget is fully returned.
TEST(EngineScheduler, FixedStatePoolBoundsConcurrencyAndIsReturned) {
  const auto prompts = mixed_prompts();
  constexpr int kTokens = 6;
  EngineOptions o = test::small_options();
  const size_t fixed = model().new_state(o.max_rollback, o.page_tokens).fixed_bytes();
  o.state_budget_bytes = 2 * fixed;
  Scheduler s(model(), o);
  std::vector<std::shared_ptr<Recorder>> rec;
  for (size_t i = 0; i < prompts.size(); ++i) {
    rec.push_back(std::make_shared<Recorder>());
    s.add(i + 1, test::greedy_request(prompts[i], kTokens), rec.back(), 1);
  }
  auto pair = test::greedy_request(prompts[0], kTokens);
  pair.n = 2;
  rec.push_back(std::make_shared<Recorder>(2));
  s.add(100, pair, rec.back(), 1);
  int peak = 0;
  while (s.has_work()) {
    s.step();
    peak = std::max(peak, s.running_choices());
    EXPECT_LE(s.state_pool().used_bytes(), 2 * fixed);
  }
  EXPECT_EQ(peak, 2);
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_TRUE(rec[i]->done());
    EXPECT_EQ(rec[i]->tokens[0], test::greedy_alone(model(), prompts[i], kTokens)) << "prompt " << i;
  }
  ASSERT_TRUE(rec.back()->done());
  EXPECT_EQ(rec.back()->tokens[0], rec.back()->tokens[1]) << "greedy choices agree";
  EXPECT_EQ(s.state_pool().used_bytes(), 0u);
  expect_no_leak(s);
}
}  // namespace

// The decode-step counters behind /metrics' deepinfer_engine_decode_*: three prompts prefilled in
// one step, then every later step decodes one token for each running choice.
TEST(EngineScheduler, DecodeStepCounters) {
  constexpr int kTokens = 10;
  EngineOptions o = test::small_options();
  Scheduler s(model(), o);
  const auto c = test::corpus();
  std::vector<std::shared_ptr<Recorder>> rec;
  for (int i = 0; i < 3; ++i) {
    rec.push_back(std::make_shared<Recorder>());
    s.add(uint64_t(i + 1), test::greedy_request(test::slice(c, 10 * i, 12), kTokens), rec.back(), 1);
  }
  test::run_all(s);
  const auto& k = s.counters();
  // The prefill step samples each choice's first token; the other kTokens - 1 come from steps of 3 rows.
  EXPECT_EQ(k.decode_steps, kTokens - 1);
  EXPECT_EQ(k.decode_rows, 3 * (kTokens - 1));
  EXPECT_EQ(k.steps, kTokens);
  EXPECT_GT(k.decode_seconds, 0.0);
  for (const auto& r : rec) EXPECT_EQ(r->tokens[0].size(), size_t(kTokens));
}

namespace {

// Back-pressure: a paused request gets no decode steps (the others go on), the scheduler reports
// idle when only paused requests are left, and resuming gives the same tokens as never pausing.
TEST(EngineScheduler, PausedRequestWaitsAndResumesUnchanged) {
  const auto prompts = mixed_prompts();
  constexpr int kTokens = 12;
  Scheduler s(model(), test::small_options());
  auto a = std::make_shared<Recorder>(), b = std::make_shared<Recorder>();
  s.add(1, test::greedy_request(prompts[5], kTokens), a, 1);
  s.add(2, test::greedy_request(prompts[6], kTokens), b, 1);
  while (a->tokens[0].size() < 3) ASSERT_TRUE(s.step());
  s.set_paused(1, true);
  const size_t held = a->tokens[0].size();
  while (!b->done()) ASSERT_TRUE(s.step());
  EXPECT_EQ(a->tokens[0].size(), held) << "a paused request must not decode";
  EXPECT_FALSE(s.step()) << "only a paused request is left: nothing to run";
  EXPECT_FALSE(a->done());
  s.set_paused(1, false);
  test::run_all(s);
  ASSERT_TRUE(a->done());
  EXPECT_EQ(a->tokens[0], test::greedy_alone(model(), prompts[5], kTokens));
  EXPECT_EQ(b->tokens[0], test::greedy_alone(model(), prompts[6], kTokens));
  expect_no_leak(s);
}

}  // namespace
