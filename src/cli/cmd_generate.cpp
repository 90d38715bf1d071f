// `deepinfer generate`: offline inference from the command line.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <stdexcept>

#include "cli/commands.h"
#include "cli/default_model.h"
#include "core/numerics.h"
#include "engine/sampler.h"
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
  float temperature = 0.f;
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

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void run(const GenerateArgs& a) {
  namespace fs = std::filesystem;
  const std::string dir = a.model_dir.empty() ? ensure_default_model(!a.json) : a.model_dir;
  LoadOptions lo;
  lo.tokenizer_path = a.tokenizer;
  lo.threads = a.threads;
  lo.arch_options = parse_load_options(a.load_options);
  if (a.reference_quirk) lo.arch_options["index_key_policy"] = "reference";
  lo.numerics = resolve_numerics(a.numerics);
  const auto t_load = std::chrono::steady_clock::now();
  auto model = load_model(dir, lo);
  const double load_s = seconds_since(t_load);
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
  if (a.max_tokens < 0) throw std::invalid_argument("--max-tokens must be >= 0");

  const std::unique_ptr<SequenceState> st = model->new_state({});
  const std::unique_ptr<Workspace> ws = model->new_workspace();
  auto forward = [&](std::span<const int32_t> tokens, std::vector<float>& logits) {
    BatchItem item{st.get(), tokens, false, &logits};
    model->forward_batch(std::span(&item, 1), *ws);
  };
  Sampler sampler(a.temperature, a.seed);
  std::vector<float> logits, dumped;
  std::vector<int32_t> out;
  std::unique_ptr<IncrementalDecoder> detok;
  if (tok && !a.json) {
    detok = std::make_unique<IncrementalDecoder>(tok);
    if (!a.prompt.empty() && a.prompt_ids.empty()) std::printf("%s", a.prompt.c_str());
  }
  const int64_t V = info.vocab_size, V_sample = info.sampleable_vocab;
  const auto t0 = std::chrono::steady_clock::now();
  forward(prompt, logits);
  const double prefill_s = seconds_since(t0);
  std::string finish = "length";
  const auto t1 = std::chrono::steady_clock::now();
  for (int i = 0; i < a.max_tokens; ++i) {
    if (!all_finite(logits.data(), V))
      throw std::runtime_error("the model produced non-finite logits (NaN or Inf) at generated token " + std::to_string(i) +
                               "; the checkpoint may be corrupt");
    if (!a.dump_logits.empty()) dumped.insert(dumped.end(), logits.begin(), logits.begin() + V);
    const int32_t next = sampler.sample(logits.data(), V_sample);
    out.push_back(next);
    if (detok) {
      std::fputs(detok->push(next).c_str(), stdout);
      std::fflush(stdout);
    }
    if (!a.ignore_eos && next == info.eos_id) { finish = "stop"; break; }
    if (i + 1 < a.max_tokens) forward(std::span(&out.back(), 1), logits);
  }
  const double decode_s = seconds_since(t1);
  if (detok) std::printf("%s\n", detok->flush().c_str());
  const int steps = int(out.size()) - 1;  // decode forwards after the prefill
  const double prefill_tps = double(prompt.size()) / prefill_s, decode_tps = steps > 0 ? steps / decode_s : 0.0;

  if (!a.dump_logits.empty()) {
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
  c->add_option("--seed", args->seed, "Sampling seed")->capture_default_str();
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
