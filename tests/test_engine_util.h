// Shared helpers of the engine tests: the golden tiny model, token corpora, a recording sink and
// an engine-independent greedy oracle.
#pragma once

#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>
#include <optional>
#include <vector>

#include "engine/engine.h"
#include "engine/scheduler.h"
#include "io/safetensors.h"
#include "model/v41/model.h"
#include "test_paths.h"

namespace di::test {

inline std::shared_ptr<const v41::Model> golden_model() {
  static std::shared_ptr<const v41::Model> m = [] {
    v41::LoadOptions o;
    o.tokenizer_path = v3_tokenizer_json();
    return std::shared_ptr<const v41::Model>(v41::Model::load(golden_model_dir(), o));
  }();
  return m;
}

inline std::vector<int32_t> golden_tensor(const std::string& name) {
  static Checkpoint g = Checkpoint::open(golden_expected());
  const auto& v = g.get(name);
  return std::vector<int32_t>(v.as<int32_t>(), v.as<int32_t>() + v.numel());
}

// 208 tokens of natural text, code and chat markup (the golden prompts back to back).
inline std::vector<int32_t> corpus() {
  std::vector<int32_t> t;
  for (int rep = 0; rep < 2; ++rep)
    for (int p : {4, 3, 2}) {
      const auto v = golden_tensor("prompts.p" + std::to_string(p) + ".tokens");
      t.insert(t.end(), v.begin(), v.end());
    }
  t.resize(208);
  return t;
}

inline std::vector<int32_t> slice(const std::vector<int32_t>& v, size_t from, size_t n) {
  return std::vector<int32_t>(v.begin() + std::ptrdiff_t(from), v.begin() + std::ptrdiff_t(from + n));
}

// Greedy continuation computed with the model alone (no engine, no batching, no paging).
inline std::vector<int32_t> greedy_alone(const v41::Model& m, const std::vector<int32_t>& prompt, int n) {
  v41::SequenceState st = m.new_state();
  v41::Workspace ws;
  std::vector<float> logits;
  m.forward(st, prompt, logits, {}, ws);
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    int64_t best = 0;
    for (int64_t v = 1; v < m.config().vocab_size; ++v)
      if (logits[size_t(v)] > logits[size_t(best)]) best = v;
    out.push_back(int32_t(best));
    if (i + 1 < n) m.forward(st, std::span(&out.back(), 1), logits, {}, ws);
  }
  return out;
}

// Records every event; thread-safe, so the threaded engine can be observed too.
class Recorder : public engine::RequestSink {
 public:
  explicit Recorder(int n = 1) : tokens(size_t(n)), logprobs(size_t(n)), tops(size_t(n)), finish(size_t(n)) {}
  void on_start(const engine::StartEvent& e) override {
    std::lock_guard lk(mu);
    ++starts;
    start = e;
  }
  void on_token(const engine::TokenEvent& e) override {
    std::lock_guard lk(mu);
    EXPECT_FALSE(finish.at(size_t(e.choice))) << "token after finish";
    tokens.at(size_t(e.choice)).push_back(e.token);
    logprobs[size_t(e.choice)].push_back(e.logprob);
    tops[size_t(e.choice)].push_back(e.top);
  }
  void on_finish(const engine::FinishEvent& e) override {
    std::lock_guard lk(mu);
    EXPECT_FALSE(finish.at(size_t(e.choice))) << "finished twice";
    finish[size_t(e.choice)] = e;
    cv.notify_all();
  }
  bool done() {
    std::lock_guard lk(mu);
    for (auto& f : finish)
      if (!f) return false;
    return true;
  }
  bool wait(double seconds = 50) {
    std::unique_lock lk(mu);
    return cv.wait_for(lk, std::chrono::duration<double>(seconds), [&] {
      for (auto& f : finish)
        if (!f) return false;
      return true;
    });
  }
  engine::FinishReason reason(int c = 0) {
    std::lock_guard lk(mu);
    return finish.at(size_t(c)).value().reason;
  }

  std::mutex mu;
  std::condition_variable cv;
  int starts = 0;
  engine::StartEvent start;
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<float>> logprobs;
  std::vector<std::vector<std::vector<engine::TokenLogprob>>> tops;
  std::vector<std::optional<engine::FinishEvent>> finish;
};

inline engine::RequestParams greedy_request(std::vector<int32_t> prompt, int max_tokens) {
  engine::RequestParams p;
  p.prompt = std::move(prompt);
  p.sampling.temperature = 0;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  return p;
}

inline engine::EngineOptions small_options() {
  engine::EngineOptions o;
  o.cache_budget_bytes = 64 << 20;
  o.page_tokens = 16;
  o.max_batch_tokens = 48;
  o.max_running = 16;
  return o;
}

// Steps until every request has finished; fails the test if that takes more than max_steps.
inline int run_all(engine::Scheduler& s, int max_steps = 5000) {
  int steps = 0;
  while (s.has_work()) {
    s.step();
    if (++steps > max_steps) {
      ADD_FAILURE() << "no completion after " << max_steps << " steps";
      break;
    }
  }
  return steps;
}

}  // namespace di::test
