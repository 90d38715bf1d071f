// `deepinfer generate`: offline inference from the command line. The prompt runs as one request
// through engine::Engine, the path `serve` uses (scheduler, prefix cache, TokenSampler), and its
// tokens are printed as the engine emits them.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <limits>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "cli/commands.h"
#include "cli/default_model.h"
#include "engine/engine.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"

namespace di::cli {
namespace {

struct GenerateArgs {
  std::string model_dir, tokenizer, prompt, prompt_ids, dump_logits, numerics;
  std::vector<std::string> load_options;
  int max_tokens = 32;
  int threads = 0;
  float temperature = 0.f, top_p = 1.f;
  int top_k = 0;
  uint64_t seed = 0;
  bool json = false, reference_quirk = false, ignore_eos = false, no_bos = false;
};

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      throw std::invalid_argument("--prompt-ids: '" + item + "' is not an integer");
    }
    if (used != item.size() || v < 0 || v > INT32_MAX) throw std::invalid_argument("--prompt-ids: bad id '" + item + "'");
    ids.push_back(int32_t(v));
  }
  if (ids.empty()) throw std::invalid_argument("--prompt-ids: no ids given");
  return ids;
}

double seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The request's events, handed from the engine thread (where sinks must not block on stdout) to the
// main thread, each with the time the engine emitted it.
class EventQueue final : public engine::RequestSink {
 public:
  using Clock = std::chrono::steady_clock;
  struct Event {
    enum Kind { Start, Token, Finish } kind = Start;
    Clock::time_point at;
    int32_t token = 0;
    engine::FinishEvent finish;
  };

  void on_start(const engine::StartEvent&) override { push({Event::Start, Clock::now(), 0, {}}); }
  void on_logits(int, std::span<const float> logits) override {
    std::lock_guard lk(mu_);
    logits_.insert(logits_.end(), logits.begin(), logits.end());
  }
  void on_token(const engine::TokenEvent& t) override { push({Event::Token, Clock::now(), t.token, {}}); }
  void on_finish(const engine::FinishEvent& f) override { push({Event::Finish, Clock::now(), 0, f}); }

  Event pop() {
    std::unique_lock lk(mu_);
    cv_.wait(lk, [&] { return !events_.empty(); });
    Event e = std::move(events_.front());
    events_.pop_front();
    return e;
  }
  // The rows on_logits received; complete once the Finish event has been popped.
  std::vector<float> take_logits() {
    std::lock_guard lk(mu_);
    return std::move(logits_);
  }

 private:
  void push(Event e) {
    {
      std::lock_guard lk(mu_);
      events_.push_back(std::move(e));
    }
    cv_.notify_one();
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Event> events_;
  std::vector<float> logits_;
};

void run(const GenerateArgs& a) {
  namespace fs = std::filesystem;
  using Clock = std::chrono::steady_clock;
  // The engine logs through spdlog's default logger, which writes to stdout; generate's stdout is
  // the completion (or the JSON), so the log goes to stderr, warnings and errors only.
  auto log = spdlog::stderr_color_mt("generate");
  log->set_level(spdlog::level::warn);
  spdlog::set_default_logger(log);

  const std::string dir = a.model_dir.empty() ? ensure_default_model(!a.json) : a.model_dir;
  LoadOptions lo;
  lo.tokenizer_path = a.tokenizer;
  lo.threads = a.threads;
  lo.arch_options = parse_load_options(a.load_options);
  if (a.reference_quirk) lo.arch_options["index_key_policy"] = "reference";
  lo.numerics = resolve_numerics(a.numerics);
  const auto t_load = Clock::now();
  std::shared_ptr<const Model> model = load_model(dir, lo);
  const double load_s = seconds(Clock::now() - t_load);
  const ModelInfo& info = model->info();

  std::shared_ptr<const Tokenizer> tok;
  const std::string tok_path = a.tokenizer.empty() ? (fs::path(dir) / "tokenizer.json").string() : a.tokenizer;
  if (fs::exists(tok_path)) tok = Tokenizer::from_file(tok_path);

  std::vector<int32_t> prompt;
  if (!a.prompt_ids.empty()) {
    prompt = parse_ids(a.prompt_ids);
  } else {
    if (!tok) throw std::runtime_error(tok_path + ": no tokenizer.json to encode --prompt (use --prompt-ids)");
    if (!a.no_bos) prompt.push_back(info.bos_id);
    const auto ids = tok->encode(a.prompt.empty() ? "Hello" : a.prompt, true);
    prompt.insert(prompt.end(), ids.begin(), ids.end());
  }
  for (int32_t id : prompt)
    if (id >= info.sampleable_vocab)
      throw std::invalid_argument("prompt id " + std::to_string(id) + " is outside the vocabulary [0, " +
                                  std::to_string(info.sampleable_vocab) + ")");
  if (a.max_tokens < 1) throw std::invalid_argument("--max-tokens must be >= 1");

  engine::EngineOptions eo;
  // The only request: its own cache need is the limit (the budget is accounting, not a reservation),
  // and the whole prompt runs as one prefill step.
  eo.cache_budget_bytes = std::numeric_limits<size_t>::max() / 4;
  eo.max_batch_tokens = std::max(eo.max_batch_tokens, int(prompt.size()));
  eo.max_running = 1;
  eo.max_waiting = 1;
  const std::unique_ptr<engine::Engine> eng = engine::Engine::create(model, eo);

  engine::RequestParams rp;
  rp.prompt = prompt;
  rp.max_tokens = a.max_tokens;
  rp.ignore_eos = a.ignore_eos;
  rp.sampling.temperature = a.temperature;
  rp.sampling.top_p = a.top_p;
  rp.sampling.top_k = a.top_k;
  rp.sampling.seed = a.seed;
  rp.return_logits = !a.dump_logits.empty();
  auto events = std::make_shared<EventQueue>();
  const engine::SubmitResult sub = eng->submit(std::move(rp), events);
  if (sub.error != engine::SubmitError::None) throw std::invalid_argument(sub.message);

  std::unique_ptr<IncrementalDecoder> detok;
  if (tok && !a.json) {
    detok = std::make_unique<IncrementalDecoder>(tok);
    if (!a.prompt.empty() && a.prompt_ids.empty()) std::printf("%s", a.prompt.c_str());
    std::fflush(stdout);
  }
  std::vector<int32_t> out;
  auto emit = [&](int32_t token) {
    out.push_back(token);
    if (!detok) return;
    std::fputs(detok->push(token).c_str(), stdout);
    std::fflush(stdout);
  };
  // Prefill: admission (on_start) to the first sampled token; decode: from there to the finish.
  std::optional<Clock::time_point> t_start, t_first;
  Clock::time_point t_end;
  engine::FinishEvent fin;
  for (bool done = false; !done;) {
    EventQueue::Event e = events->pop();
    switch (e.kind) {
      case EventQueue::Event::Start: t_start = e.at; break;
      case EventQueue::Event::Token:
        if (!t_first) t_first = e.at;
        emit(e.token);
        break;
      case EventQueue::Event::Finish:
        fin = std::move(e.finish);
        t_end = e.at;
        // The EOS that ended the completion is part of generate's output (the engine does not
        // deliver stop tokens as tokens).
        if (fin.stop_token >= 0) {
          if (!t_first) t_first = e.at;
          emit(fin.stop_token);
        }
        done = true;
        break;
    }
  }
  eng->shutdown();
  if (fin.reason == engine::FinishReason::Error) throw std::runtime_error(fin.error);
  if (fin.reason != engine::FinishReason::Stop && fin.reason != engine::FinishReason::Length)
    throw std::runtime_error(std::string("the request ended: ") + engine::finish_reason_name(fin.reason));
  const std::string finish = engine::finish_reason_name(fin.reason);
  const Clock::time_point prefill_end = t_first.value_or(t_end);
  const double prefill_s = seconds(prefill_end - t_start.value_or(prefill_end));
  const double decode_s = seconds(t_end - prefill_end);
  if (detok) std::printf("%s\n", detok->flush().c_str());
  const int steps = int(out.size()) - 1;  // decode forwards after the prefill
  const double prefill_tps = prefill_s > 0 ? double(prompt.size()) / prefill_s : 0.0;
  const double decode_tps = steps > 0 && decode_s > 0 ? steps / decode_s : 0.0;

  if (!a.dump_logits.empty()) {
    const int64_t V = info.vocab_size;
    const std::vector<float> dumped = events->take_logits();
    SafetensorsWriter w;
    w.add_typed("logits", DType::F32, {int64_t(dumped.size() / size_t(V)), V}, dumped);
    w.set_metadata("rows", "row 0 = last prefill position; row j = decode step j");
    w.write(a.dump_logits);
  }
  if (a.json) {
    nlohmann::json j;
    j["model"] = dir;
    j["prompt_ids"] = prompt;
    j["generated_ids"] = out;
    if (tok) j["text"] = tok->decode(out);
    j["finish_reason"] = finish;
    j["timings"] = {{"load_s", load_s},
                    {"prefill_s", prefill_s},
                    {"prefill_tokens_per_s", prefill_tps},
                    {"decode_s", decode_s},
                    {"decode_steps", steps},
                    {"decode_tokens_per_s", decode_tps}};
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::fprintf(stderr, "\n[%zu prompt tokens: %.1f tok/s prefill | %zu generated: %.1f tok/s decode | finish: %s]\n",
                 prompt.size(), prefill_tps, out.size(), decode_tps, finish.c_str());
  }
}

}  // namespace

void add_generate(CLI::App& app) {
  auto args = std::make_shared<GenerateArgs>();
  auto* c = app.add_subcommand("generate", "Generate text offline (default: a generated tiny V4.1 model)");
  c->add_option("-m,--model", args->model_dir, "Model directory (config.json + safetensors); default: the built-in tiny model");
  c->add_option("-p,--prompt", args->prompt, "Prompt text (BOS is prepended)");
  c->add_option("--prompt-ids", args->prompt_ids, "Prompt as comma-separated token ids (used as given)");
  c->add_option("-n,--max-tokens", args->max_tokens, "Tokens to generate")->capture_default_str();
  c->add_option("-t,--temperature", args->temperature, "Sampling temperature; 0 = greedy")->capture_default_str();
  c->add_option("--top-p", args->top_p, "Nucleus sampling: smallest set of tokens reaching this mass, (0, 1]")
      ->capture_default_str();
  c->add_option("--top-k", args->top_k, "Sample among the k most likely tokens; 0 = off")->capture_default_str();
  c->add_option("--seed", args->seed, "Sampling seed (same seed, same tokens)")->capture_default_str();
  c->add_option("--tokenizer", args->tokenizer, "tokenizer.json (default: MODEL_DIR/tokenizer.json)");
  c->add_flag("--json", args->json, "Print prompt ids, generated ids and timings as one JSON object");
  c->add_option("--dump-logits", args->dump_logits, "Write fp32 logits [steps, vocab] as safetensors tensor 'logits'");
  c->add_flag("--reference-quirk", args->reference_quirk,
              "V4.1: reproduce the official code's stale index-key slot (for comparison with its outputs)");
  c->add_flag("--ignore-eos", args->ignore_eos, "Keep generating after EOS");
  c->add_option("--threads", args->threads, "Kernel threads (default: all cores)");
  c->add_flag("--no-bos", args->no_bos, "Do not prepend BOS to --prompt");
  c->add_option("--numerics", args->numerics, kNumericsHelp)->check(CLI::IsMember({"fast", "exact"}));
  c->add_option("--load-option", args->load_options, kLoadOptionHelp);
  c->callback([args] { run(*args); });
}

}  // namespace di::cli
