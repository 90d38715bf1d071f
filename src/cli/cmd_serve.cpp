// `deepinfer serve MODEL_DIR`: the OpenAI-compatible HTTP server (docs/serving.md).
#include <CLI/CLI.hpp>

#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <filesystem>
#include <mutex>
#include <thread>

#include <spdlog/spdlog.h>

#include "cli/commands.h"
#include "cli/default_model.h"
#include "engine/engine.h"
#include "model/model.h"
#include "server/server.h"
#include "tokenizer/tokenizer.h"

namespace di::cli {
namespace {

// "90", "90s", "15m", "12h", "7d".
std::chrono::seconds parse_duration(const std::string& text) {
  size_t used = 0;
  long long n = -1;
  try {
    n = std::stoll(text, &used);
  } catch (const std::exception&) {
  }
  const std::string unit = text.substr(used);
  const long long scale = unit.empty() || unit == "s" ? 1 : unit == "m" ? 60 : unit == "h" ? 3600 : unit == "d" ? 86400 : 0;
  if (n <= 0 || scale == 0) throw CLI::ValidationError("--cache-ttl", "expected a positive duration like 3600, 90m, 12h or 7d, got \"" + text + "\"");
  return std::chrono::seconds(n * scale);
}

struct ServeArgs {
  std::string model_dir, tokenizer, chat_format, log_level = "info", numerics;
  server::ServerOptions server;
  engine::EngineOptions engine;
  double cache_mib = 1024;
  double cache_ram_gib = 0;
  double cache_disk_gib = 64;
  std::string cache_ttl = "7d";
  int64_t cache_prefetch_ms = 2000;
  double state_mib = 0;
  double inflight_body_mib = 256;
  int threads = 0;  // the model's kernel threads
};

// Anyone who can reach a non-loopback address can use the server; without a key that is everyone.
void warn_if_exposed(const server::ServerOptions& o) {
  if (!o.api_key.empty() || server::is_loopback_address(o.http.host)) return;
  spdlog::warn("**************************************************************************");
  spdlog::warn("SECURITY WARNING: listening on {} (not loopback) WITHOUT an API key.", o.http.host);
  spdlog::warn("Anyone who can reach this address can run generations on this server.");
  spdlog::warn("Set --api-key KEY (or $DEEPINFER_API_KEY), or bind --host 127.0.0.1.");
  spdlog::warn("**************************************************************************");
}

void raise_fd_limit() {
  // Each connection is a descriptor; the default soft limit (often 1024) is too low for many streams.
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
}

server::LoadedModel load_serving_model(const ServeArgs& a, const std::string& dir, const std::atomic<bool>& cancel) {
  namespace fs = std::filesystem;
  uint64_t bytes = 0;
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() == ".safetensors") {
      bytes += e.file_size();
      ++files;
    }
  }
  spdlog::info("loading model {} ({} safetensors files, {:.2f} GB)", dir, files, double(bytes) / 1e9);
  // Model::load reports no progress of its own: log the elapsed time while it runs.
  std::mutex mu;
  std::condition_variable cv;
  bool loaded = false;
  const auto t0 = std::chrono::steady_clock::now();
  std::thread heartbeat([&] {
    std::unique_lock lk(mu);
    while (!cv.wait_for(lk, std::chrono::seconds(2), [&] { return loaded; }))
      spdlog::info("loading model: {:.0f} s elapsed", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  });
  std::shared_ptr<const Model> model;
  try {
    LoadOptions lo;
    lo.tokenizer_path = a.tokenizer;
    lo.cancel = &cancel;  // a signal while loading stops the load instead of waiting it out
    lo.numerics = resolve_numerics(a.numerics);
    lo.threads = a.threads;
    model = di::load_model(dir, lo);
  } catch (...) {
    {
      std::lock_guard lk(mu);
      loaded = true;
    }
    cv.notify_all();
    heartbeat.join();
    throw;
  }
  {
    std::lock_guard lk(mu);
    loaded = true;
  }
  cv.notify_all();
  heartbeat.join();
  spdlog::info("model loaded in {:.1f} s", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());

  const std::string tok_path = a.tokenizer.empty() ? (fs::path(dir) / "tokenizer.json").string() : a.tokenizer;
  server::LoadedModel lm;
  lm.model.tokenizer = Tokenizer::from_file(tok_path);
  const ModelInfo& info = model->info();
  lm.model.vocab_size = int32_t(info.sampleable_vocab);  // ids the tokenizer defines; the engine rejects the rest
  lm.model.bos_id = info.bos_id;
  lm.model.eos_id = info.eos_id;
  lm.model.max_context = a.engine.max_context > 0 ? std::min(a.engine.max_context, info.max_context) : info.max_context;
  lm.model.chat_format = chat::parse_chat_format(info.chat_format);
  engine::EngineOptions eo = a.engine;
  eo.cache_budget_bytes = size_t(a.cache_mib * 1024 * 1024);
  eo.state_budget_bytes = size_t(a.state_mib * 1024 * 1024);
  eo.prefix_cache_bytes = size_t(a.cache_ram_gib * double(1 << 30));
  eo.cache_disk_bytes = uint64_t(a.cache_disk_gib * double(1 << 30));
  eo.cache_ttl = parse_duration(a.cache_ttl);
  eo.disk_prefetch_timeout = std::chrono::milliseconds(a.cache_prefetch_ms);
  lm.engine = engine::Engine::create(std::move(model), eo);
  spdlog::info("engine started: cache {:.0f} MiB, {}-token pages, batch {} tokens, {} running, queue {}", a.cache_mib,
               eo.page_tokens, eo.max_batch_tokens, eo.max_running, eo.max_waiting);
  return lm;
}

void run(ServeArgs& a) {
  spdlog::set_level(spdlog::level::from_str(a.log_level));
  spdlog::set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%^%l%$] %v");
  const std::string dir = a.model_dir.empty() ? ensure_default_model(true) : a.model_dir;
  if (!std::filesystem::is_directory(dir)) throw std::runtime_error(dir + ": not a directory");
  if (a.server.served_model_name.empty()) {
    auto p = std::filesystem::path(dir).lexically_normal();
    if (p.filename().empty()) p = p.parent_path();
    a.server.served_model_name = p.filename().string();
  }
  if (!a.chat_format.empty()) a.server.chat_format = chat::parse_chat_format(a.chat_format);
  if (a.server.api_key.empty())
    if (const char* k = std::getenv("DEEPINFER_API_KEY")) a.server.api_key = k;
  a.server.http.max_inflight_body_bytes = size_t(a.inflight_body_mib * 1024 * 1024);
  warn_if_exposed(a.server);
  raise_fd_limit();

  // Signals go to the waiting main thread only: block them before any thread starts.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  std::signal(SIGPIPE, SIG_IGN);

  server::Server srv(a.server, [&a, dir](const std::atomic<bool>& cancel) { return load_serving_model(a, dir, cancel); });
  srv.start();
  timespec tick{0, 100 * 1000 * 1000};
  for (;;) {
    const int sig = sigtimedwait(&sigs, nullptr, &tick);
    if (sig == SIGINT || sig == SIGTERM) {
      spdlog::info("signal {}: draining for up to {} s (a second signal stops at once)", sig, a.server.shutdown_timeout_s);
      break;
    }
    if (srv.failed()) {
      srv.stop();
      throw std::runtime_error("model loading failed: " + srv.load_error());
    }
  }
  srv.begin_drain();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(a.server.shutdown_timeout_s);
  while (!srv.drained() && std::chrono::steady_clock::now() < deadline) {
    const int sig = sigtimedwait(&sigs, nullptr, &tick);
    if (sig == SIGINT || sig == SIGTERM) {
      spdlog::warn("signal {}: stopping without waiting for running requests", sig);
      break;
    }
  }
  srv.stop();
}

}  // namespace

void add_serve(CLI::App& app) {
  auto a = std::make_shared<ServeArgs>();
  auto* c = app.add_subcommand("serve", "OpenAI-compatible HTTP server (chat/completions, completions, models, health, metrics)");
  c->add_option("model_dir", a->model_dir, "Model directory (default: the built-in tiny model)");
  c->add_option("--host", a->server.http.host, "Address to bind")->capture_default_str();
  c->add_option("--port", a->server.http.port, "Port (0 = any free port)")->capture_default_str();
  c->add_option("--api-key", a->server.api_key, "Require 'Authorization: Bearer KEY' on /v1/* (or $DEEPINFER_API_KEY)");
  c->add_option("--max-body-bytes", a->server.http.max_body_bytes, "Largest request body (413 beyond)")->capture_default_str();
  c->add_option("--max-header-bytes", a->server.http.max_header_bytes, "Largest request line + header fields (431 beyond)")
      ->capture_default_str()
      ->check(CLI::Range(size_t(1024), size_t(1) << 24));
  c->add_option("--max-inflight-body-mib", a->inflight_body_mib,
                "Request bodies being received or parsed, all connections together, in MiB (503 beyond)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  c->add_option("--max-connections", a->server.http.max_connections, "Open connections (503 and close beyond)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  c->add_option("--write-timeout", a->server.http.write_timeout_s,
                "Seconds a reply may wait for the client to read it before the connection is closed (0 = never)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  c->add_option("--io-threads", a->server.http.io_threads, "HTTP io threads")->capture_default_str();
  c->add_option("--idle-timeout", a->server.http.idle_timeout_s, "Seconds a keep-alive connection may wait for its next request")
      ->capture_default_str();
  c->add_option("--served-model-name", a->server.served_model_name, "Model id clients use (default: the directory name)");
  c->add_option("--tokenizer", a->tokenizer, "tokenizer.json (default: MODEL_DIR/tokenizer.json)");
  c->add_option("--chat-format", a->chat_format,
                 "deepseek-v4.1, deepseek-v4, deepseek-v3, deepseek-v3.1, deepseek-r1 (default: the model's own)");
  c->add_flag("--thinking", a->server.default_thinking, "Thinking mode when a request does not say");
  c->add_option("--default-max-tokens", a->server.default_max_tokens, "Chat max_tokens when the request gives none")
      ->capture_default_str();
  c->add_option("--max-n", a->server.max_n, "Largest n (choices per request)")->capture_default_str();
  c->add_option("--shutdown-timeout", a->server.shutdown_timeout_s,
                "Seconds running requests may finish after SIGTERM/SIGINT; then they end with a 503 error")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  c->add_option("--sse-keepalive", a->server.sse_keepalive_s, "Seconds without output before a ': keep-alive' SSE comment (0 = off)")
      ->capture_default_str();
  c->add_option("--max-json-depth", a->server.json_limits.max_depth, "Deepest nesting of arrays/objects in a request body (400 beyond)")
      ->capture_default_str()
      ->check(CLI::Range(size_t(1), size_t(1000)));  // deeper values would strain the recursive copies
  c->add_option("--max-json-keys", a->server.json_limits.max_keys, "Most keys in one JSON object of a request body (400 beyond)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  c->add_option("--parse-threads", a->server.parse_threads, "Threads that parse requests and render prompts (off the io threads)")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  c->add_option("--parse-queue", a->server.parse_queue, "Requests waiting for a parse thread (503 beyond)")->capture_default_str();
  c->add_option("--allowed-origins", a->server.allowed_origins,
                "CORS: comma-separated origins allowed to read responses ('*' = any); default none (no CORS headers)")
      ->delimiter(',');
  c->add_flag("--enable-test-hooks", a->server.test_hooks, "Accept the 'test_forced_output' request field (tests only)");
  c->add_option("--cache-mib", a->cache_mib, "KV cache pool budget in MiB (incl. the prefix cache)")->capture_default_str();
  c->add_option("--state-mib", a->state_mib,
                "Pool for per-sequence fixed state (window rings, compressor inputs) in MiB; 0 = bounded by --max-running only")
      ->capture_default_str();
  c->add_option("--page-tokens", a->engine.page_tokens, "Tokens per cache page")->capture_default_str();
  c->add_option("--max-batch-tokens", a->engine.max_batch_tokens, "Token budget per engine step")->capture_default_str();
  c->add_option("--max-running", a->engine.max_running, "Sequences decoding at once")->capture_default_str();
  c->add_option("--max-waiting", a->engine.max_waiting, "Waiting queue length (429 beyond)")->capture_default_str();
  c->add_option("--max-context", a->engine.max_context, "Prompt + completion limit (0 = the model's)")->capture_default_str();
  c->add_flag("!--no-prefix-cache", a->engine.prefix_cache, "Disable the prefix cache");
  c->add_option("--cache-ram-gib", a->cache_ram_gib,
                "RAM tier: bytes the prefix cache may keep (pages and snapshots) in GiB, within --cache-mib; 0 = what --cache-mib leaves free")
      ->capture_default_str();
  c->add_option("--snapshot-interval", a->engine.snapshot_interval,
                "Tokens between state snapshots in a prefill (a multiple of --page-tokens; 0 = only at prompt and completion ends)")
      ->capture_default_str();
  c->add_flag("!--no-snapshots", a->engine.snapshots, "Prefix hits replay the window instead of resuming from snapshots");
  c->add_option("--cache-dir", a->engine.cache_dir,
                "Disk tier of the prefix cache: a directory on a local disk or a shared mount (3FS, NFS) that several servers may use")
      ->capture_default_str();
  c->add_option("--cache-disk-gib", a->cache_disk_gib, "Disk tier capacity in GiB (least recently used entries go first)")
      ->capture_default_str();
  c->add_option("--cache-ttl", a->cache_ttl, "Disk entries not used for this long are removed: N[s|m|h|d]")
      ->capture_default_str();
  c->add_option("--cache-io-threads", a->engine.disk_io_threads, "Disk tier reader threads")->capture_default_str();
  c->add_flag("--cache-io-uring", a->engine.disk_io_uring, "Disk tier reads through io_uring (else pread threads)");
  c->add_option("--cache-write-min-hits", a->engine.disk_write_min_hits,
                "Write an entry to disk once it was hit this often (0 = write-through)")
      ->capture_default_str();
  c->add_option("--cache-prefetch-timeout-ms", a->cache_prefetch_ms,
                "A request waits at most this long for its disk hits before it runs without them")
      ->capture_default_str();
  c->add_flag("--priority-scheduling", a->engine.priority_scheduling, "Schedule by request 'priority' instead of FCFS");
  c->add_option("--threads", a->threads, "Kernel threads of the model (0 = all cores)")->capture_default_str();
  c->add_option("--log-level", a->log_level, "trace, debug, info, warn, error")->capture_default_str();
  c->add_option("--numerics", a->numerics, kNumericsHelp)->check(CLI::IsMember({"fast", "exact"}));
  c->callback([a] { run(*a); });
}

}  // namespace di::cli
