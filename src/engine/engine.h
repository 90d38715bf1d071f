// The serving engine: continuous batching over one model, with a paged KV cache, a prefix cache,
// chunked prefill and per-request sampling. One engine thread runs steps; any thread may submit
// and cancel. Events reach the submitter through its RequestSink, called on the engine thread
// (sinks must not block: hand work to your own executor).
//
// API pinned by the lead; implementation in src/engine/*.cpp.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvcache/disk_tier.h"
#include "model/model.h"

namespace di::grammar {
class CompiledGrammar;
}

namespace di::engine {

struct SamplingParams {
  float temperature = 1.0f;   // 0 = greedy
  float top_p = 1.0f;         // (0, 1]
  int top_k = 0;              // 0 = off
  float min_p = 0.0f;         // [0, 1]
  float presence_penalty = 0.0f, frequency_penalty = 0.0f;  // [-2, 2], OpenAI semantics
  float repetition_penalty = 1.0f;                          // > 0, applied to prompt and output tokens
  std::vector<std::pair<int32_t, float>> logit_bias;        // added to the logits
  std::optional<uint64_t> seed;  // same seed -> same tokens, whatever else is in the batch
  int logprobs = 0;              // 0 = none; otherwise return the chosen token's logprob and the top N (N = top_logprobs)
  int top_logprobs = 0;          // 0..20
};

struct RequestParams {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  int max_tokens = 256;
  std::vector<int32_t> stop_token_ids;  // besides EOS (unless ignore_eos)
  bool ignore_eos = false;
  int n = 1;                            // choices; they share the prompt's cache pages
  int priority = 0;                     // higher first (when priority scheduling is on)
  std::optional<std::chrono::steady_clock::time_point> deadline;
  std::string cache_salt;               // separates prefix-cache namespaces (e.g. per tenant)
  bool return_logits = false;           // RequestSink::on_logits gets each row a token is sampled from
  // Constrained decoding: every choice's output is a prefix of a string of this grammar. Its
  // vocabulary's mask width must be the model's vocab_size. Tokens the grammar does not allow get
  // -inf before sampling (after logit_bias, penalties and temperature, before logprobs, top-k/p and
  // min_p); EOS is allowed only where the grammar may end; a choice whose grammar has ended (no
  // byte can follow) finishes with Stop without another forward pass.
  std::shared_ptr<const grammar::CompiledGrammar> grammar;
};

struct TokenLogprob {
  int32_t token;
  float logprob;
};

struct TokenEvent {
  int choice = 0;
  int32_t token = 0;
  float logprob = 0;                 // when requested
  std::vector<TokenLogprob> top;     // top_logprobs alternatives, when requested
};

enum class FinishReason { Stop, Length, Cancelled, Deadline, Error };
const char* finish_reason_name(FinishReason);

struct FinishEvent {
  int choice = 0;
  FinishReason reason = FinishReason::Stop;
  std::string error;  // for Error
  // The EOS / stop_token_ids token that ended the choice (reason Stop), else -1. Stop tokens are
  // not delivered as TokenEvents (they are not part of the completion text).
  int32_t stop_token = -1;
};

struct StartEvent {
  int prompt_tokens = 0;
  int cached_tokens = 0;  // served from the prefix cache
};

class RequestSink {
 public:
  virtual ~RequestSink() = default;
  virtual void on_start(const StartEvent&) {}
  // With RequestParams::return_logits: the raw logits row [vocab_size] choice `choice` samples its
  // next token from, before that token's on_token / on_finish (the span dies with the call).
  virtual void on_logits(int choice, std::span<const float> logits) { (void)choice, (void)logits; }
  virtual void on_token(const TokenEvent&) = 0;
  virtual void on_finish(const FinishEvent&) = 0;  // once per choice, last call for that choice
};

struct EngineOptions {
  size_t cache_budget_bytes = size_t(1) << 30;  // paged compressed KV + index keys (incl. prefix cache)
  // Per-sequence fixed state (window rings, compressor inputs), a pool of its own; admission waits
  // until a request's choices fit. 0 = no limit beyond max_running.
  size_t state_budget_bytes = 0;
  int page_tokens = 64;
  int max_batch_tokens = 512;    // token budget per step (decode tokens first, then prefill chunks)
  int max_running = 64;          // sequences decoding at once
  int max_waiting = 256;         // bounded queue: submit fails with QueueFull beyond this
  int64_t max_context = 0;       // prompt + max_tokens limit; 0 = model's max_position_embeddings
  bool prefix_cache = true;
  // Bytes the prefix cache may keep (pages and snapshots, the RAM tier); 0 = as much as the
  // cache budget leaves free (entries are evicted when running sequences need pages).
  size_t prefix_cache_bytes = 0;
  // Snapshots (models with state outside pages, e.g. V4.1's windows): taken where later requests
  // are likely to resume — the last page boundary of each prompt, every snapshot_interval tokens
  // (a multiple of page_tokens; 0 = none), and the last page boundary a finished choice reached —
  // so that a prefix hit resumes there instead of replaying the window.
  bool snapshots = true;
  int64_t snapshot_interval = 2048;
  // The disk tier (empty cache_dir = none): a directory on a local disk or a shared mount (3FS,
  // NFS) that several engines, in this process or others, use at once. Entries are written
  // through when a prompt finishes and when a choice ends (once hit disk_write_min_hits times);
  // a request's disk hits are read into RAM while it waits, for at most disk_prefetch_timeout.
  std::string cache_dir;
  uint64_t cache_disk_bytes = 64ull << 30;
  std::chrono::seconds cache_ttl = std::chrono::hours(24 * 7);
  int disk_io_threads = 2;
  bool disk_io_uring = false;  // else a pread thread pool
  int disk_write_min_hits = 0;
  std::chrono::milliseconds disk_prefetch_timeout{2000};
  bool priority_scheduling = false;  // else FCFS
  int max_rollback = 8;
};

enum class SubmitError { None, QueueFull, TooLong, Invalid, ShuttingDown };

struct SubmitResult {
  uint64_t id = 0;
  SubmitError error = SubmitError::None;
  std::string message;  // names the offending field for Invalid / TooLong
  int retry_after_s = 0; // for QueueFull
};

struct EngineStats {
  int64_t requests_submitted = 0, requests_finished = 0, requests_rejected = 0;
  int64_t prompt_tokens = 0, cached_prompt_tokens = 0, generated_tokens = 0;
  int waiting = 0, running = 0;
  int64_t cache_pages_used = 0;
  size_t cache_bytes_used = 0, cache_bytes_budget = 0;
  size_t state_bytes_used = 0, state_bytes_budget = 0;
  int64_t prefix_lookups = 0, prefix_hit_tokens = 0, prefix_lookup_tokens = 0;
  int64_t preemptions = 0, steps = 0;
  int64_t nonfinite_logits = 0;  // logits rows with NaN/Inf; their requests failed with Error
  int64_t decode_steps = 0, decode_rows = 0;  // steps where every sequence ran one token, their rows
  double decode_seconds = 0;                  // and their forward passes' time
  size_t prefix_cache_bytes = 0;  // pages and snapshots held by the prefix cache (part of cache_bytes_used)
  int64_t prefix_cache_entries = 0, prefix_cache_evictions = 0;
  int64_t snapshots = 0, snapshots_taken = 0, snapshot_hits = 0, snapshot_evictions = 0;
  size_t snapshot_bytes = 0;
  int64_t replayed_tokens = 0;  // tokens re-run to rebuild state on prefix hits without a snapshot
  bool disk = false;            // a disk tier is configured: the fields below are set
  kvcache::DiskTierStats disk_stats;
  int64_t disk_pages_read = 0, disk_snapshots_read = 0;  // moved from disk into RAM for requests
};

class Engine {
 public:
  // The model's own thread pool (LoadOptions::threads) runs the kernels of its forward passes.
  static std::unique_ptr<Engine> create(std::shared_ptr<const Model> model, const EngineOptions& opts);
  virtual ~Engine() = default;
  virtual SubmitResult submit(RequestParams params, std::shared_ptr<RequestSink> sink) = 0;
  // Frees the request's pages at the next step; its choices finish with Cancelled. Unknown ids are ignored.
  virtual void cancel(uint64_t id) = 0;
  // Finishes one choice with Stop at the next step (e.g. the server matched a stop string in it);
  // the request's other choices go on. Unknown ids / choices are ignored. The default
  // implementation (for test doubles) cancels the whole request.
  virtual void stop_choice(uint64_t id, int choice) { (void)choice; cancel(id); }
  // Back-pressure: a paused request keeps its cache state but gets no decode steps until resumed
  // (e.g. its client is not reading its stream). Unknown ids are ignored; test doubles may ignore it.
  virtual void set_paused(uint64_t id, bool paused) { (void)id, (void)paused; }
  virtual EngineStats stats() const = 0;
  // Empties the prefix cache's tiers (RAM entries nobody uses, every disk entry) and returns the
  // number of entries removed. Test doubles may have nothing to flush.
  virtual uint64_t flush_cache() { return 0; }
  // Finishes running work with Cancelled and stops the engine thread.
  virtual void shutdown() = 0;
  virtual const Model& model() const = 0;
};

}  // namespace di::engine
