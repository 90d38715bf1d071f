// The engine's scheduler: owns the requests, the page pool and the prefix cache, and runs one
// continuous-batching step at a time. Single-threaded (the engine thread); Engine adds the thread,
// the submission queue and the statistics snapshot. Tests drive it step by step.
//
// A step: (1) requests past their deadline finish; (2) every decoding choice gets one token,
// highest priority / oldest first; when pages run out, unreferenced prefix-cache entries are
// evicted (LRU), then the lowest-priority / newest running choice is preempted (its state dropped,
// recomputed later from prompt + generated tokens); (3) choices in the middle of a prefill get
// chunks from what is left of the token budget; (4) waiting choices are admitted while token
// budget, running slots and cache pages allow (strict queue order, longest cached prefix reused);
// (5) one forward_batch; (6) choices whose tokens are all processed sample their next token.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <set>
#include <unordered_map>
#include <vector>

#include "engine/disk_cache.h"
#include "engine/engine.h"
#include "engine/prefix_cache.h"
#include "engine/request.h"
#include "engine/sampler.h"
#include "kvcache/page_pool.h"
#include "model/model.h"

namespace di::engine {

struct SchedulerCounters {
  int64_t requests_finished = 0;
  int64_t prompt_tokens = 0, cached_prompt_tokens = 0, generated_tokens = 0;
  int64_t prefix_lookups = 0, prefix_hit_tokens = 0, prefix_lookup_tokens = 0;
  int64_t preemptions = 0, steps = 0;
  int64_t preempted_with_output = 0;  // preemptions of choices that had generated tokens already
  int64_t nonfinite_logits = 0;  // logits rows with NaN/Inf (their requests failed)
  int64_t step_tokens = 0;  // tokens run by forward passes (prefill, recompute, decode)
  // Steps where every sequence ran one token (pure decode): how many, their rows, and the time
  // their forward passes took, so a client can read the engine's decode step time at a batch size.
  int64_t decode_steps = 0, decode_rows = 0;
  double decode_seconds = 0;
  int64_t snapshots_taken = 0, snapshot_hits = 0;
  int64_t replayed_tokens = 0;  // re-run by Model::resume on hits without a snapshot
};

class Scheduler {
 public:
  Scheduler(const Model& model, const EngineOptions& opts);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a validated request (see validate_request). `seed` is used when the request has none.
  void add(uint64_t id, RequestParams params, std::shared_ptr<RequestSink> sink, uint64_t seed,
           Clock::time_point submitted = Clock::now());
  // Finishes the request's unfinished choices with `reason` and frees their pages now.
  void cancel(uint64_t id, FinishReason reason = FinishReason::Cancelled);
  // Finishes one choice with Stop (e.g. the server matched a stop string).
  void stop_choice(uint64_t id, int choice);
  void cancel_all(FinishReason reason);
  void set_paused(uint64_t id, bool paused);

  // One step. Returns false when there was nothing to do.
  bool step();
  bool has_work() const { return !requests_.empty(); }

  // Requests not admitted yet and their prompt tokens; safe to call from any thread.
  int waiting_requests() const;
  int64_t waiting_prompt_tokens() const;
  int running_choices() const { return int(running_.size()); }
  int waiting_choices() const { return int(waiting_.size()); }
  const SchedulerCounters& counters() const { return counters_; }
  const kvcache::PagePool& pool() const { return pool_; }
  const kvcache::PagePool& state_pool() const { return state_pool_; }
  PrefixCache& prefix_cache() { return cache_; }
  DiskCache* disk() { return disk_.get(); }
  const DiskCache* disk() const { return disk_.get(); }
  // Empties the RAM tier (entries nobody uses) and the disk tier; returns the entries removed.
  uint64_t flush_cache();
  const PrefixCache& prefix_cache() const { return cache_; }
  const EngineOptions& options() const { return opts_; }
  // Cache bytes a fresh sequence of n_tokens tokens needs.
  size_t sequence_bytes(int64_t n_tokens) const { return blank_->bytes_needed(n_tokens); }

 private:
  struct Order {
    bool priority;
    bool operator()(const Seq* a, const Seq* b) const;  // true: a goes first
  };

  void expire_deadlines(Clock::time_point now);
  size_t available() const;  // pool free bytes not promised to this step's items
  bool ensure_room(size_t bytes);  // evicts prefix-cache entries; true if `bytes` are available
  Seq* pick_victim(const Seq* except);
  void preempt(Seq* s);
  int64_t fit_chunk(const Seq& s, int64_t want, size_t reserve);
  int64_t snapshot_stop(const Seq& s, int64_t want) const;  // want, cut at the next snapshot point
  bool snapshot_point(const Seq& s, int64_t pos) const;
  kvcache::PageRef take_snapshot(const Seq& s);
  void after_chunk(Seq* s, bool prefill);
  void poll_fetches();       // moves finished (or timed out) disk reads of waiting choices into RAM
  bool use_snapshots() const { return opts_.prefix_cache && opts_.snapshots && model_.has_snapshots(); }
  bool admit(Seq* s, int64_t& budget);
  void schedule(Seq* s, int64_t n);
  void run_batch();
  void after_forward(Seq* s, const std::vector<float>& logits);
  void fork(Seq* leader);
  void sample_and_emit(Seq* s, const float* logits);
  void finish(Seq* s, FinishReason reason, int32_t stop_token = -1, std::string error = {});
  void finish_request(Request* r, FinishReason reason, const std::string& error);
  void request_done(Request* r);
  void collect_done();
  void drop_state(Seq* s, bool cache_pages);
  void fail_batch(const std::string& error);

  const Model& model_;
  EngineOptions opts_;
  int64_t max_context_;
  kvcache::PagePool pool_;
  kvcache::PagePool state_pool_;  // fixed per-sequence state
  PrefixCache cache_;
  std::unique_ptr<DiskCache> disk_;
  std::unique_ptr<SequenceState> blank_;  // for sizing: bytes a fresh sequence needs
  size_t page_set_bytes_;     // one token page in every paged cache
  TokenSampler sampler_;
  std::vector<uint32_t> mask_;  // grammar mask of the choice being sampled (reused)
  std::unique_ptr<Workspace> ws_;

  std::unordered_map<uint64_t, std::unique_ptr<Request>> requests_;
  std::set<Seq*, Order> waiting_;
  std::vector<Seq*> running_;
  int64_t next_arrival_ = 0;

  // The step being built.
  std::vector<BatchItem> items_;
  std::vector<Seq*> item_seqs_;
  std::vector<std::vector<float>> logits_;
  size_t committed_ = 0;  // bytes the step's items will allocate
  std::vector<Request*> done_;  // finished in this call; erased at its end
  std::vector<Seq*> order_;
  std::vector<uint64_t> scratch_ids_;
  // Read by submitting threads (queue limit, Retry-After) while the engine thread steps.
  std::atomic<int> unstarted_{0};
  std::atomic<int64_t> unstarted_tokens_{0};

  SchedulerCounters counters_;
};

}  // namespace di::engine
