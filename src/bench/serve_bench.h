// `deepinfer bench serve` (like `vllm bench serve` / sglang.bench_serving): drives an
// OpenAI-compatible server with streaming completions or chat completions, from one thread with
// many concurrent HTTP streams (Boost.Beast), and reports throughput and latency with vLLM's
// metric definitions and JSON field names:
//   TTFT  = first streamed chunk with choices - request start
//   ITL   = gaps between later chunks (one per chunk)
//   TPOT  = (E2EL - TTFT) / (output tokens - 1), per request with > 1 output token
//   E2EL  = last chunk - request start
// Output tokens come from the server's usage (stream_options.include_usage), else the number of
// content chunks. Percentiles interpolate linearly (NumPy), std is the population std.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace di::engine {
class Engine;
}

namespace di::bench {

struct ServeRequest {
  nlohmann::json prompt;    // completions: string or array of token ids; chat: string (user message)
  nlohmann::json messages;  // chat only, when the dataset gives full messages (else built from prompt)
  int prompt_len = 0;       // tokens, when known from the dataset (token ids); else from usage
  int output_len = 128;     // max_tokens
};

struct ServeOptions {
  std::string base_url = "http://127.0.0.1:8000";
  std::string endpoint = "/v1/completions";  // or /v1/chat/completions
  std::string model;        // "model" field of the requests; empty = the first id of GET /v1/models
  std::string dataset = "random";  // "random" or "jsonl" (with dataset_path)
  std::string dataset_path;
  int input_len = 512, output_len = 128;
  // Random token ids are drawn from [0, vocab_size); 0 = the ids the target accepts: the "vocab_size"
  // of the server's GET /v1/models card, or the in-process engine's sampleable vocabulary.
  int64_t vocab_size = 0;
  int num_prompts = 100;
  double request_rate = std::numeric_limits<double>::infinity();  // requests/s; inf = all at once
  double burstiness = 1.0;       // 1 = Poisson arrivals; gamma-distributed gaps otherwise
  int max_concurrency = 0;       // 0 = unlimited
  // Untimed requests sent all at once before the run (first-touch page faults, workspace growth),
  // drawn like the run's with another seed; not in the results.
  int num_warmups = 0;
  std::map<std::string, double> goodput;  // SLOs in ms: ttft, tpot, e2el
  std::vector<double> percentiles{90, 99};
  bool ignore_eos = true;
  double temperature = 0.0;
  nlohmann::json extra_body = nlohmann::json::object();  // merged into every request body
  uint64_t seed = 0;
  double timeout_s = 6 * 3600.0;  // per request
  bool progress = true;           // progress bar on stderr
};

struct RequestOutput {
  bool success = false;
  std::string error;
  int prompt_len = 0;
  int output_tokens = 0;
  double start_time = 0;  // seconds since the benchmark started
  double ttft = 0, latency = 0;  // seconds
  std::vector<double> itl;       // seconds
  std::string generated_text;
};

struct ServeMetrics {
  int completed = 0, failed = 0;
  int64_t total_input = 0, total_output = 0;
  double duration = 0;
  double request_throughput = 0, request_goodput = 0, output_throughput = 0, total_token_throughput = 0;
  double max_output_tokens_per_s = 0;
  int max_concurrent_requests = 0;
  // mean, median, std and each percentile (ms) for ttft, tpot, itl, e2el
  std::map<std::string, double> latency_ms;
};

// The server's decode-step counters over the run, from its Prometheus /metrics before and after
// (deepinfer's deepinfer_engine_decode_{steps,rows,seconds}_total): the engine's own step time at
// the batch sizes the load produced. Absent for servers without them.
struct EngineDecodeStats {
  bool available = false;
  int64_t steps = 0, rows = 0;
  double seconds = 0;
  double mean_batch() const { return steps > 0 ? double(rows) / double(steps) : 0; }
  double mean_step_ms() const { return steps > 0 ? seconds / double(steps) * 1e3 : 0; }
};

// Reads the decode counters from a Prometheus text exposition; false when any is missing.
bool parse_engine_decode_counters(const std::string& metrics_text, EngineDecodeStats& out);

// vLLM's calculate_metrics over finished requests.
ServeMetrics calculate_serve_metrics(const std::vector<RequestOutput>& outputs, double duration_s,
                                     const std::map<std::string, double>& goodput,
                                     const std::vector<double>& percentiles);

// Parses "ttft:500" style SLOs (names ttft, tpot, e2el; values in ms >= 0). Throws on bad input.
std::map<std::string, double> parse_goodput(const std::vector<std::string>& items);

// The requests of a run: random token-id prompts, or the lines of a JSONL file
// ({"prompt": "text" | [ids], "output_len"|"max_tokens": n} or {"messages": [...], ...}).
std::vector<ServeRequest> load_serve_requests(const ServeOptions& o);

// Arrival offsets (seconds from the start) of n requests: 0 for an infinite rate, else gamma gaps
// (shape = burstiness) rescaled so that the last arrival is at n / rate, as vLLM does.
std::vector<double> arrival_times(int n, double rate, double burstiness, uint64_t seed);

struct ServeResult {
  ServeMetrics metrics;
  EngineDecodeStats engine;
  std::vector<RequestOutput> outputs;
  nlohmann::json json;  // vLLM's result fields plus the run's settings
  std::string text;     // the human-readable report
};

ServeResult run_serve_bench(const ServeOptions& o);

// The same requests submitted straight to an engine in this process (no HTTP, no JSON, no
// tokenizer), with the same arrivals and concurrency limit and the same metric definitions (TTFT at
// the first token event, ITL between token events, E2EL at the last). The server's overhead is
// run_serve_bench's output throughput over this one's. Token-id prompts only (the random dataset
// on /v1/completions, or JSONL id arrays); base_url and extra_body do not apply.
ServeResult run_engine_bench(engine::Engine& engine, const ServeOptions& o);

// Side by side: the HTTP run over the in-process run (output throughput ratio, TTFT/TPOT of both).
nlohmann::json compare_serve_engine(const ServeResult& server, const ServeResult& engine);
std::string compare_text(const nlohmann::json& comparison);

}  // namespace di::bench
