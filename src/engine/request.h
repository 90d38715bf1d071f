// A request inside the engine: its choices (Seq), each with its own tokens, cache state and random
// stream; and the validation that decides whether a request is accepted at all.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/disk_cache.h"
#include "engine/engine.h"
#include "engine/prefix_cache.h"
#include "grammar/matcher.h"
#include "model/model.h"

namespace di::engine {

using Clock = std::chrono::steady_clock;

struct Request;

// One choice. Its tokens are prompt + generated; its state (when it has one) has processed a prefix
// of them. Prefill, decode and recompute after preemption are the same thing: feed the tokens the
// state has not seen, then sample from the last position's logits.
struct Seq {
  Request* req = nullptr;
  int choice = 0;
  std::vector<int32_t> tokens;
  std::unique_ptr<SequenceState> state;
  std::vector<PrefixCache::Entry*> held;  // prefix-cache entries the state adopted
  std::vector<CacheKey> keys;             // hash chain of the full pages of `tokens` (lazily extended)
  uint64_t stream_key = 0;
  enum class Where { Waiting, Running, Done } where = Where::Waiting;
  bool scheduled = false;  // in the current step's batch
  TokenEvent event;        // reused so that top_logprobs does not allocate per token
  // The snapshot at the last page boundary decoding passed (kept for the prefix cache when the
  // choice ends), and its position.
  kvcache::PageRef snapshot;
  int64_t snapshot_pos = 0;
  std::unique_ptr<DiskCache::Fetch> fetch;  // disk reads for this choice's prefix, until admitted
  std::vector<PrefixCache::Entry*> pinned;   // what they brought into RAM, kept until admission
  // The grammar's state after this choice's generated tokens (RequestParams::grammar). It lives
  // with the tokens, not the cache state, so preemption and recompute leave it as it is.
  std::unique_ptr<grammar::GrammarMatcher> matcher;

  int64_t prompt_len() const;
  int64_t generated() const { return int64_t(tokens.size()) - prompt_len(); }
  int64_t remaining() const { return int64_t(tokens.size()) - (state ? state->pos() : 0); }
};

struct Request {
  uint64_t id = 0;
  RequestParams params;
  std::shared_ptr<RequestSink> sink;
  uint64_t seed = 0;
  CacheKey cache_root{};  // prefix-cache chain root of the request's cache_salt
  int64_t arrival = 0;  // submission order
  Clock::time_point submitted, first_token, finished;
  bool started = false, forked = false, any_token = false;
  bool paused = false;  // back-pressure: no decode steps until resumed
  int cached_tokens = 0;
  int64_t completion_tokens = 0;
  int unfinished = 0;                         // choices without a finish event yet
  std::vector<std::unique_ptr<Seq>> seqs;     // created choices (choice 0 alone until the prompt is done)
  std::vector<uint8_t> stop_requested;        // per choice (Engine::stop_choice before the fork)
  std::vector<FinishReason> reasons;          // per choice, once finished
  std::vector<uint8_t> finished_choice;       // per choice
};

inline int64_t Seq::prompt_len() const { return int64_t(req->params.prompt.size()); }

// The context limit in force: the option, capped by the model's position limit.
int64_t effective_max_context(const EngineOptions& opts, const ModelInfo& model);

// Checks a request before it is queued: parameters (Invalid, naming the field) and length (TooLong:
// prompt + max_tokens against the context limit, and one choice's cache pages against the whole
// budget, which could never be satisfied). `seq_bytes(n_tokens)` gives the cache bytes a sequence
// of n_tokens tokens needs. Returns error None when the request is acceptable.
template <class SeqBytes>
SubmitResult validate_request(const RequestParams& p, const ModelInfo& model, const EngineOptions& opts,
                              SeqBytes&& seq_bytes);
SubmitResult validate_params(const RequestParams& p, const ModelInfo& model);

template <class SeqBytes>
SubmitResult validate_request(const RequestParams& p, const ModelInfo& model, const EngineOptions& opts,
                              SeqBytes&& seq_bytes) {
  SubmitResult r = validate_params(p, model);
  if (r.error != SubmitError::None) return r;
  const int64_t limit = effective_max_context(opts, model);
  const int64_t prompt = int64_t(p.prompt.size());
  r.error = SubmitError::TooLong;
  if (prompt >= limit) {
    r.message = "prompt: " + std::to_string(prompt) + " tokens; the maximum context is " + std::to_string(limit) +
                " tokens (prompt + max_tokens)";
    return r;
  }
  if (prompt + p.max_tokens > limit) {
    r.message = "max_tokens: prompt (" + std::to_string(prompt) + " tokens) + max_tokens (" +
                std::to_string(p.max_tokens) + ") = " + std::to_string(prompt + p.max_tokens) +
                " exceeds the maximum context of " + std::to_string(limit) + " tokens";
    return r;
  }
  const size_t need = seq_bytes(prompt + p.max_tokens);
  if (need > opts.cache_budget_bytes) {
    r.message = "max_tokens: prompt (" + std::to_string(prompt) + " tokens) + max_tokens (" +
                std::to_string(p.max_tokens) + ") needs " + std::to_string(need) + " bytes of KV cache, more than the " +
                std::to_string(opts.cache_budget_bytes) + "-byte cache budget";
    return r;
  }
  r.error = SubmitError::None;
  return r;
}

}  // namespace di::engine
