// `deepinfer bench` (model throughput against the roofline) and `deepinfer bench serve` (an
// OpenAI-compatible serving client, or the same load on an in-process engine to measure the server's
// overhead). docs/performance.md explains the numbers.
#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <chrono>
#include <memory>
#include <optional>
#include <thread>

#include "bench/chat_bench.h"
#include "bench/model_bench.h"
#include "bench/prefix_bench.h"
#include "bench/serve_bench.h"
#include "cli/commands.h"
#include "engine/engine.h"
#include "kernels/cpu/kernels.h"
#include "model/generate.h"
#include "model/model.h"
#include "server/server.h"
#include "tokenizer/tokenizer.h"

namespace di::cli {

namespace {

namespace fs = std::filesystem;

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

// The command line as typed, for the record.
std::string command_line() {
  std::ifstream f("/proc/self/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>()), out;
  for (char c : all) out += c == '\0' ? ' ' : c;
  while (!out.empty() && out.back() == ' ') out.pop_back();
  return out;
}

std::string cache_root() {
  if (const char* h = std::getenv("DEEPINFER_HOME"); h && *h) return h;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return (fs::path(x) / "deepinfer").string();
  const char* home = std::getenv("HOME");
  return (fs::path(home && *home ? home : "/tmp") / ".cache" / "deepinfer").string();
}

// A generated model of `size` in the cache, made on first use.
std::string ensure_generated(const std::string& size, uint64_t seed) {
  const fs::path dir = fs::path(cache_root()) / "models" / ("v41-" + size + "-seed" + std::to_string(seed));
  if (fs::exists(dir / "config.json")) return dir.string();
  std::fprintf(stderr, "bench: generating the %s model into %s\n", size.c_str(), dir.c_str());
  GenerateOptions o;
  o.arch = "v41";
  o.size = size;
  o.seed = seed;
  o.force = true;  // a directory without config.json is an interrupted generation
  o.progress = [last = -1](double f) mutable {
    if (int(f * 20) != last) {
      last = int(f * 20);
      std::fprintf(stderr, "\rbench: make-tiny %3d%%", int(f * 100));
      std::fflush(stderr);
    }
  };
  fs::create_directories(dir);
  generate_model(o, dir.string());
  std::fprintf(stderr, "\n");
  return dir.string();
}

struct ModelArgs {
  std::string model_dir, size;
  uint64_t gen_seed = 0;
  std::string isa, numerics;
  std::vector<std::string> load_options;
  std::string output;
  bool json = false, quiet = false;
  bench::ModelBenchOptions opts;
};

void run_model(const ModelArgs& a) {
  if (!a.model_dir.empty() && !a.size.empty()) throw std::invalid_argument("bench: give --model or --size, not both");
  if (!a.isa.empty()) {
    const kern::Isa isa = a.isa == "scalar" ? kern::Isa::Scalar : a.isa == "avx2" ? kern::Isa::Avx2 : kern::Isa::Avx512;
    kern::set_isa(isa);
  }
  const std::string size = a.model_dir.empty() && a.size.empty() ? "tiny" : a.size;
  const std::string dir = a.model_dir.empty() ? ensure_generated(size, a.gen_seed) : a.model_dir;
  LoadOptions lo;
  lo.numerics = resolve_numerics(a.numerics);
  lo.arch_options = parse_load_options(a.load_options);
  lo.threads = a.opts.threads;  // the model's own pool: the bench accounts its threads' time
  auto model = load_model(dir, lo);
  bench::BenchedModel info;
  info.path = dir;
  info.size = a.model_dir.empty() ? size : "";
  info.file_bytes = bench::checkpoint_file_bytes(dir);
  bench::ModelBenchOptions opts = a.opts;
  if (!a.quiet)
    opts.log = [](const std::string& s) {
      std::fprintf(stderr, "bench: %s\n", s.c_str());
      std::fflush(stderr);
    };
  bench::BenchReport r = bench::run_model_bench(*model, info, opts);
  r.date = utc_now();
  r.command = command_line();
  nlohmann::json j = bench::report_json(r);
  j["numerics"] = numerics_name(model->info().numerics);
  if (!lo.arch_options.empty()) j["load_options"] = lo.arch_options;
  if (!a.output.empty()) {
    std::ofstream f(a.output);
    if (!f) throw std::runtime_error(a.output + ": cannot write");
    f << j.dump(2) << "\n";
  }
  if (a.json)
    std::printf("%s\n", j.dump(2).c_str());
  else
    std::printf("%s", bench::report_table(r).c_str());
}

struct ServeArgs {
  bench::ServeOptions o;
  std::vector<std::string> goodput;
  std::string json_file, percentiles = "90,99", extra_body;
  double request_rate = 0;
  bool no_ignore_eos = false, no_progress = false;
  // In-process runs: the model, and the engine settings `deepinfer serve` takes (same defaults).
  std::string in_process, numerics;
  int num_warmups = -1;  // -1: with --in-process as many as --max-concurrency (at least 1), else 0
  bool compare = false;
  engine::EngineOptions engine;
  double cache_mib = 1024, cache_ram_gib = 0;
  int threads = 0;  // the model's kernel threads
  bench::ChatWorkload chat;
};

std::string dir_name(const std::string& dir) {
  auto p = fs::path(dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  return p.filename().string();
}

// The same requests through an HTTP server in this process, on a fresh engine over `model`, the way
// `deepinfer serve` wires one (127.0.0.1, a free port).
bench::ServeResult serve_in_process(std::shared_ptr<const Model> model, const std::string& dir,
                                    const engine::EngineOptions& eo, bench::ServeOptions o) {
  server::ServerOptions so;
  so.http.host = "127.0.0.1";
  so.http.port = 0;
  so.served_model_name = o.model;
  server::Server srv(so, [&](const std::atomic<bool>&) {
    server::LoadedModel lm;
    lm.model.tokenizer = Tokenizer::from_file((fs::path(dir) / "tokenizer.json").string());
    const ModelInfo& info = model->info();
    lm.model.vocab_size = int32_t(info.sampleable_vocab);
    lm.model.bos_id = info.bos_id;
    lm.model.eos_id = info.eos_id;
    lm.model.max_context = eo.max_context > 0 ? std::min(eo.max_context, info.max_context) : info.max_context;
    lm.engine = engine::Engine::create(model, eo);
    return lm;
  });
  srv.start();
  while (!srv.ready()) {
    if (srv.failed()) throw std::runtime_error("in-process server: " + srv.load_error());
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  o.base_url = "http://127.0.0.1:" + std::to_string(srv.port());
  bench::ServeResult r = bench::run_serve_bench(o);
  srv.stop();
  return r;
}

struct PrefixArgs {
  std::string model_dir, size, numerics, output;
  bench::PrefixBenchOptions o;
  double cache_mib = 4096;
  int threads = 0;
  PrefixArgs() {
    o.engine.max_batch_tokens = 2048;
    o.engine.cache_budget_bytes = 0;
  }
};

void run_prefix(PrefixArgs& a) {
  if (!a.model_dir.empty() && !a.size.empty()) throw std::invalid_argument("bench prefix: give --model or --size, not both");
  const std::string dir = a.model_dir.empty() ? ensure_generated(a.size.empty() ? "small" : a.size, 0) : a.model_dir;
  LoadOptions lo;
  lo.numerics = resolve_numerics(a.numerics);
  lo.threads = a.threads;
  std::shared_ptr<const Model> model = load_model(dir, lo);
  a.o.engine.cache_budget_bytes = size_t(a.cache_mib * 1024 * 1024);
  if (a.o.cache_dir.empty()) a.o.cache_dir = (fs::path(cache_root()) / "bench-prefix-kv").string();
  bench::PrefixBenchResult r = bench::run_prefix_bench(model, a.o);
  r.json["model"] = a.model_dir.empty() ? "v41-" + (a.size.empty() ? std::string("small") : a.size) : dir;
  r.json["numerics"] = numerics_name(model->info().numerics);
  r.json["threads"] = a.threads;
  r.json["date"] = utc_now();
  r.json["command"] = command_line();
  std::printf("%s", r.text.c_str());
  if (!a.output.empty()) {
    std::ofstream f(a.output);
    if (!f) throw std::runtime_error(a.output + ": cannot write");
    f << r.json.dump(2) << "\n";
  }
}

void run_serve(ServeArgs& a) {
  bench::ServeOptions o = a.o;
  if (a.request_rate > 0) o.request_rate = a.request_rate;
  o.goodput = bench::parse_goodput(a.goodput);
  o.ignore_eos = !a.no_ignore_eos;
  o.progress = !a.no_progress;
  o.num_warmups = a.num_warmups >= 0 ? a.num_warmups : a.in_process.empty() ? 0 : std::max(1, o.max_concurrency);
  if (!o.dataset_path.empty()) o.dataset = "jsonl";
  o.percentiles.clear();
  std::stringstream ss(a.percentiles);
  for (std::string p; std::getline(ss, p, ',');) {
    try {
      o.percentiles.push_back(std::stod(p));
    } catch (const std::exception&) {
      throw std::invalid_argument("--metric-percentiles: '" + p + "' is not a number");
    }
  }
  if (!a.extra_body.empty()) {
    try {
      o.extra_body = nlohmann::json::parse(a.extra_body);
    } catch (const std::exception& e) {
      throw std::invalid_argument(std::string("--extra-body: not JSON: ") + e.what());
    }
    if (!o.extra_body.is_object()) throw std::invalid_argument("--extra-body: must be a JSON object");
  }
  nlohmann::json out;
  if (a.in_process.empty()) {
    if (a.compare) throw std::invalid_argument("--compare needs --in-process MODEL_DIR");
    if (o.dataset == "multiturn") throw std::invalid_argument("--dataset multiturn needs --in-process MODEL_DIR");
    bench::ServeResult r = bench::run_serve_bench(o);
    std::printf("%s", r.text.c_str());
    out = r.json;
  } else {
    if (o.model.empty()) o.model = dir_name(a.in_process);
    LoadOptions lo;
    lo.numerics = resolve_numerics(a.numerics);
    lo.threads = a.threads;
    std::shared_ptr<const Model> model = load_model(a.in_process, lo);
    engine::EngineOptions eo = a.engine;
    eo.cache_budget_bytes = size_t(a.cache_mib * 1024 * 1024);
    eo.prefix_cache_bytes = size_t(a.cache_ram_gib * double(1 << 30));
    if (!eo.cache_dir.empty()) fs::remove_all(eo.cache_dir);
    if (o.dataset == "multiturn") {
      if (a.compare) throw std::invalid_argument("--dataset multiturn runs in-process only (no --compare)");
      bench::ChatWorkload w = a.chat;
      w.output_len = o.output_len;
      w.max_concurrency = o.max_concurrency;
      w.seed = o.seed;
      w.progress = o.progress;
      auto eng = engine::Engine::create(model, eo);
      bench::ChatResult r = bench::run_chat_bench(*eng, w);
      eng->shutdown();
      std::printf("%s", r.text.c_str());
      out = r.json;
      out["numerics"] = numerics_name(model->info().numerics);
      out["prefix_cache"] = eo.prefix_cache;
      out["cache_ram_bytes"] = eo.prefix_cache_bytes;
      out["cache_dir"] = eo.cache_dir;
      out["disk_reader"] = eo.disk_io_uring ? "io_uring" : "pread";
    } else {
      // With --compare the server runs first: whatever the first run leaves warm (mapped weights,
      // allocations) then favours the engine, so the ratio errs low rather than high.
      std::optional<bench::ServeResult> sr;
      if (a.compare) {
        sr = serve_in_process(model, a.in_process, eo, o);
        sr->json["numerics"] = numerics_name(model->info().numerics);
        std::printf("%s", sr->text.c_str());
        std::fflush(stdout);
      }
      bench::ServeResult er;
      {
        auto eng = engine::Engine::create(model, eo);
        er = bench::run_engine_bench(*eng, o);
        eng->shutdown();
      }
      er.json["numerics"] = numerics_name(model->info().numerics);
      std::printf("%s", er.text.c_str());
      out = er.json;
      if (sr) {
        out = bench::compare_serve_engine(*sr, er);
        std::printf("%s", bench::compare_text(out).c_str());
      }
    }
  }
  out["date"] = utc_now();
  out["command"] = command_line();
  if (!a.json_file.empty()) {
    std::ofstream f(a.json_file);
    if (!f) throw std::runtime_error(a.json_file + ": cannot write");
    f << out.dump(2) << "\n";
  }
}

}  // namespace

void add_bench(CLI::App& app) {
  auto m = std::make_shared<ModelArgs>();
  m->opts.threads = int(std::max(1u, std::thread::hardware_concurrency()));
  CLI::App* cmd = app.add_subcommand("bench", "Throughput vs the roofline (like llama-bench); `bench serve` drives a server");
  cmd->add_option("--model", m->model_dir, "model directory");
  cmd->add_option("--size", m->size, "generated model (made on first use in the cache): tiny | tiny-alt | small | medium")
      ->check(CLI::IsMember(generator_sizes("v41")));
  cmd->add_option("--gen-seed", m->gen_seed, "seed of the generated --size model")->capture_default_str();
  cmd->add_option("-p,--n-prompt", m->opts.prompt_sizes, "prompt processing tests: tokens per chunk (comma list)")
      ->delimiter(',')->capture_default_str();
  cmd->add_option("-n,--n-gen", m->opts.gen_sizes, "generation tests: tokens decoded (comma list)")
      ->delimiter(',')->capture_default_str();
  cmd->add_option("-d,--depth", m->opts.depths, "context depths the tests start at (comma list)")
      ->delimiter(',')->capture_default_str();
  cmd->add_option("-b,--batch", m->opts.batches, "batched decode: sequences per step (comma list; 1 = the tg test)")
      ->delimiter(',')->capture_default_str();
  cmd->add_option("--batch-steps", m->opts.batch_steps, "decode steps per batched sample (default: the first -n)");
  cmd->add_option("-r,--reps", m->opts.reps, "samples per test")->capture_default_str();
  cmd->add_option("-t,--threads", m->opts.threads, "threads")->capture_default_str();
  cmd->add_option("--seed", m->opts.seed, "seed of the random token ids")->capture_default_str();
  cmd->add_option("--fill-chunk", m->opts.fill_chunk, "chunk size of the untimed depth fill")->capture_default_str();
  cmd->add_option("--bw-bytes", m->opts.bandwidth_bytes, "bandwidth buffer bytes (default max(4 x L3, 1 GiB))");
  cmd->add_option("--bw-passes", m->opts.bandwidth_passes, "bandwidth passes (median)")->capture_default_str();
  cmd->add_option("--isa", m->isa, "force the kernel ISA")->check(CLI::IsMember({"scalar", "avx2", "avx512"}));
  cmd->add_option("--numerics", m->numerics, kNumericsHelp)->check(CLI::IsMember({"fast", "exact"}));
  cmd->add_option("--load-option", m->load_options, kLoadOptionHelp);
  cmd->add_flag("--json", m->json, "print the JSON report instead of the table");
  cmd->add_option("-o,--output", m->output, "also write the JSON report to this file");
  cmd->add_flag("-q,--quiet", m->quiet, "no progress lines");

  auto s = std::make_shared<ServeArgs>();
  CLI::App* serve = cmd->add_subcommand("serve", "Benchmark an OpenAI-compatible server (like `vllm bench serve`)");
  serve->add_option("--base-url", s->o.base_url, "server URL")->capture_default_str();
  serve->add_option("--endpoint", s->o.endpoint, "/v1/completions or /v1/chat/completions")
      ->check(CLI::IsMember({"/v1/completions", "/v1/chat/completions"}))->capture_default_str();
  serve->add_option("--model", s->o.model, "model name sent in requests (default: first of GET /v1/models)");
  serve->add_option("--dataset", s->o.dataset,
                    "random (token-id prompts), jsonl, or multiturn (conversations sharing a system prompt; --in-process)")
      ->check(CLI::IsMember({"random", "jsonl", "multiturn"}))->capture_default_str();
  serve->add_option("--conversations", s->chat.conversations, "multiturn: conversations")->capture_default_str();
  serve->add_option("--turns", s->chat.turns, "multiturn: turns per conversation")->capture_default_str();
  serve->add_option("--system-len", s->chat.system_len, "multiturn: tokens of the shared system prompt")->capture_default_str();
  serve->add_option("--turn-len", s->chat.turn_len, "multiturn: tokens of each user turn (replies: --output-len)")
      ->capture_default_str();
  serve->add_option("--dataset-path", s->o.dataset_path, "JSONL prompts file (implies --dataset jsonl)");
  serve->add_option("--input-len", s->o.input_len, "random dataset: prompt tokens")->capture_default_str();
  serve->add_option("--output-len", s->o.output_len, "max_tokens (random dataset, and JSONL lines without one)")
      ->capture_default_str();
  serve->add_option("--vocab-size", s->o.vocab_size,
                    "random token ids are drawn below this (0 = the ids the target accepts: /v1/models vocab_size)")
      ->capture_default_str();
  serve->add_option("--num-prompts", s->o.num_prompts, "requests")->capture_default_str();
  serve->add_option("--request-rate", s->request_rate, "requests per second, Poisson arrivals (default: all at once)");
  serve->add_option("--burstiness", s->o.burstiness, "gamma shape of the arrival gaps (1 = Poisson)")->capture_default_str();
  serve->add_option("--max-concurrency", s->o.max_concurrency, "requests in flight at most (0 = no limit)")
      ->capture_default_str();
  serve->add_option("--goodput", s->goodput, "SLOs in ms: ttft:500 tpot:50 e2el:10000");
  serve->add_option("--metric-percentiles", s->percentiles, "percentiles to report")->capture_default_str();
  serve->add_option("--temperature", s->o.temperature, "sampling temperature")->capture_default_str();
  serve->add_option("--extra-body", s->extra_body, "JSON object merged into every request body");
  serve->add_flag("--no-ignore-eos", s->no_ignore_eos, "do not send ignore_eos (outputs may end early)");
  serve->add_option("--json", s->json_file, "write the result JSON (vLLM's field names) to this file");
  serve->add_option("--seed", s->o.seed, "seed of the dataset and the arrivals")->capture_default_str();
  serve->add_option("--num-warmups", s->num_warmups,
                    "untimed requests, all at once, before the run (default: --max-concurrency of them, at least 1, "
                    "with --in-process; else 0)");
  serve->add_option("--timeout", s->o.timeout_s, "per-request timeout, seconds")->capture_default_str();
  serve->add_flag("--no-progress", s->no_progress, "no progress bar");
  serve->add_option("--in-process", s->in_process,
                    "MODEL_DIR: submit the requests straight to an engine in this process instead of a server "
                    "(token-id prompts; the engine options below are `deepinfer serve`'s)");
  serve->add_flag("--compare", s->compare,
                  "with --in-process: then run the same requests through an HTTP server in this process on the same "
                  "model, and print server tok/s / engine tok/s");
  serve->add_option("--threads", s->threads, "in-process: kernel threads (0 = all cores)")->capture_default_str();
  serve->add_option("--max-batch-tokens", s->engine.max_batch_tokens, "in-process: token budget per engine step")
      ->capture_default_str();
  serve->add_option("--max-running", s->engine.max_running, "in-process: sequences decoding at once")->capture_default_str();
  serve->add_option("--cache-mib", s->cache_mib, "in-process: KV cache pool budget in MiB")->capture_default_str();
  serve->add_flag("!--no-prefix-cache", s->engine.prefix_cache, "in-process: no prefix cache");
  serve->add_option("--cache-ram-gib", s->cache_ram_gib, "in-process: RAM tier capacity in GiB (0 = what --cache-mib leaves)")
      ->capture_default_str();
  serve->add_option("--cache-dir", s->engine.cache_dir, "in-process: disk tier directory (emptied first)");
  serve->add_flag("--cache-io-uring", s->engine.disk_io_uring, "in-process: disk reads through io_uring");
  serve->add_option("--numerics", s->numerics, kNumericsHelp)->check(CLI::IsMember({"fast", "exact"}));
  serve->callback([s] { run_serve(*s); });
  auto px = std::make_shared<PrefixArgs>();
  CLI::App* prefix = cmd->add_subcommand(
      "prefix", "Time to first token of a returning conversation: cold, from the RAM tier, from the disk tier after a restart");
  prefix->add_option("--model", px->model_dir, "model directory");
  prefix->add_option("--size", px->size, "generated model (default small)")->check(CLI::IsMember(generator_sizes("v41")));
  prefix->add_option("--prompt-len", px->o.prompt_len, "tokens of the first prompt")->capture_default_str();
  prefix->add_option("--extend", px->o.extend, "the follow-up adds this fraction of the prompt")->capture_default_str();
  prefix->add_option("--partial", px->o.partial, "the partial hit shares this fraction of the prompt")->capture_default_str();
  prefix->add_option("--cache-dir", px->o.cache_dir, "disk tier directory (emptied first; default: under the bench cache)");
  prefix->add_option("--page-tokens", px->o.engine.page_tokens, "tokens per cache page")->capture_default_str();
  prefix->add_option("--snapshot-interval", px->o.engine.snapshot_interval, "tokens between snapshots")->capture_default_str();
  prefix->add_option("--max-batch-tokens", px->o.engine.max_batch_tokens, "token budget per step")->capture_default_str();
  prefix->add_flag("--cache-io-uring", px->o.engine.disk_io_uring, "disk reads through io_uring (else pread threads)");
  prefix->add_option("--cache-mib", px->cache_mib, "KV cache pool budget in MiB")->capture_default_str();
  prefix->add_option("-t,--threads", px->threads, "kernel threads (0 = all cores)")->capture_default_str();
  prefix->add_option("--numerics", px->numerics, kNumericsHelp)->check(CLI::IsMember({"fast", "exact"}));
  prefix->add_option("-o,--output", px->output, "also write the JSON report to this file");
  prefix->add_flag("-q,--quiet", px->o.quiet, "no progress lines");
  prefix->callback([px] { run_prefix(*px); });
  cmd->callback([m, serve, prefix] {
    if (serve->parsed() || prefix->parsed()) return;
    run_model(*m);
  });
}

}  // namespace di::cli
