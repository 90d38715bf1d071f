#include "server/metrics.h"

#include <cinttypes>
#include <cstdio>

namespace di::server {
namespace {

void line(std::string& out, const char* fmt, auto... args) {
  char buf[512];
  const int n = std::snprintf(buf, sizeof buf, fmt, args...);
  out.append(buf, size_t(n < 0 ? 0 : std::min<int>(n, sizeof buf - 1)));
}

void header(std::string& out, const char* name, const char* type, const char* help) {
  line(out, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

// A metric with one unlabelled sample: the name is written once, for both lines.
void sample(std::string& out, const char* name, const char* type, const char* help, double value) {
  header(out, name, type, help);
  line(out, "%s %.17g\n", name, value);
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double v) {
  std::lock_guard lk(mu_);
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += v;
  ++n_;
}

uint64_t Histogram::count() const {
  std::lock_guard lk(mu_);
  return n_;
}

void Histogram::render(const std::string& name, std::string& out) const {
  std::lock_guard lk(mu_);
  uint64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    line(out, "%s_bucket{le=\"%g\"} %" PRIu64 "\n", name.c_str(), bounds_[i], cum);
  }
  cum += counts_.back();
  line(out, "%s_bucket{le=\"+Inf\"} %" PRIu64 "\n", name.c_str(), cum);
  line(out, "%s_sum %.9g\n", name.c_str(), sum_);
  line(out, "%s_count %" PRIu64 "\n", name.c_str(), n_);
}

Metrics::Metrics()
    : ttft_({0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80}),
      tpot_({0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5}),
      e2e_({0.01, 0.05, 0.1, 0.3, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300, 600}) {}

void Metrics::count_request(const std::string& endpoint, int status) {
  std::lock_guard lk(mu_);
  ++requests_[{endpoint, status}];
}

void Metrics::count_finish(const std::string& reason) {
  std::lock_guard lk(mu_);
  ++finishes_[reason];
}

void Metrics::add_tokens(int64_t prompt, int64_t cached, int64_t generated) {
  std::lock_guard lk(mu_);
  prompt_tokens_ += prompt;
  cached_tokens_ += cached;
  generated_tokens_ += generated;
}

void Metrics::add_gauge(int64_t& g, int64_t d) {
  std::lock_guard lk(mu_);
  g += d;
}

std::string Metrics::render(const std::optional<engine::EngineStats>& es, int open_connections, bool ready) const {
  std::string out;
  out.reserve(8192);
  {
    std::lock_guard lk(mu_);
    header(out, "deepinfer_http_requests_total", "counter", "HTTP requests by endpoint and status code.");
    for (const auto& [key, n] : requests_)
      line(out, "deepinfer_http_requests_total{endpoint=\"%s\",status=\"%d\"} %" PRId64 "\n", key.first.c_str(), key.second, n);
    header(out, "deepinfer_request_finished_total", "counter",
           "Generation requests by finish reason (per choice: stop, length, tool_calls, cancelled, error).");
    for (const char* r : {"stop", "length", "tool_calls", "cancelled", "error"}) {
      auto it = finishes_.find(r);
      line(out, "deepinfer_request_finished_total{finish_reason=\"%s\"} %" PRId64 "\n", r, it == finishes_.end() ? 0 : it->second);
    }
    sample(out, "deepinfer_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", double(prompt_tokens_));
    sample(out, "deepinfer_cached_prompt_tokens_total", "counter", "Prompt tokens served from the prefix cache.", double(cached_tokens_));
    sample(out, "deepinfer_generation_tokens_total", "counter", "Generated tokens of finished requests.", double(generated_tokens_));
    sample(out, "deepinfer_open_streams", "gauge", "SSE responses in progress.", double(streams_));
    sample(out, "deepinfer_paused_streams", "gauge", "Streams whose generation waits for a slow client to read.", double(paused_streams_));
    sample(out, "deepinfer_stream_pauses_total", "counter", "Times a stream's generation was paused by back-pressure.", double(pauses_));
  }
  header(out, "deepinfer_http_connections", "gauge", "Open HTTP connections.");
  line(out, "deepinfer_http_connections %d\n", open_connections);
  header(out, "deepinfer_model_ready", "gauge", "1 once the model is loaded and the engine runs.");
  line(out, "deepinfer_model_ready %d\n", ready ? 1 : 0);

  header(out, "deepinfer_time_to_first_token_seconds", "histogram", "Time from request arrival to the first generated token.");
  ttft_.render("deepinfer_time_to_first_token_seconds", out);
  header(out, "deepinfer_time_per_output_token_seconds", "histogram", "Mean time per output token after the first, per request.");
  tpot_.render("deepinfer_time_per_output_token_seconds", out);
  header(out, "deepinfer_e2e_request_latency_seconds", "histogram", "Time from request arrival to the last byte of the reply.");
  e2e_.render("deepinfer_e2e_request_latency_seconds", out);

  if (es) {
    sample(out, "deepinfer_num_requests_waiting", "gauge", "Requests in the engine's waiting queue.", double(es->waiting));
    sample(out, "deepinfer_num_requests_running", "gauge", "Sequences the engine is running.", double(es->running));
    sample(out, "deepinfer_engine_requests_submitted_total", "counter", "Requests accepted by the engine.", double(es->requests_submitted));
    sample(out, "deepinfer_engine_requests_finished_total", "counter", "Requests the engine finished (any reason).", double(es->requests_finished));
    sample(out, "deepinfer_engine_requests_rejected_total", "counter", "Submissions the engine rejected (queue full, too long).", double(es->requests_rejected));
    sample(out, "deepinfer_engine_prompt_tokens_total", "counter", "Prompt tokens the engine accepted.", double(es->prompt_tokens));
    sample(out, "deepinfer_engine_cached_prompt_tokens_total", "counter", "Prompt tokens the engine took from the prefix cache.", double(es->cached_prompt_tokens));
    sample(out, "deepinfer_engine_generation_tokens_total", "counter", "Tokens the engine generated.", double(es->generated_tokens));
    sample(out, "deepinfer_cache_pages_used", "gauge", "KV cache pages in use (running sequences and the prefix cache).", double(es->cache_pages_used));
    sample(out, "deepinfer_cache_bytes_used", "gauge", "Bytes of the KV cache pool in use.", double(es->cache_bytes_used));
    sample(out, "deepinfer_state_bytes_used", "gauge", "Bytes of per-sequence fixed state (window rings) in use.", double(es->state_bytes_used));
    sample(out, "deepinfer_cache_bytes_budget", "gauge", "Bytes of the KV cache pool budget.", double(es->cache_bytes_budget));
    sample(out, "deepinfer_prefix_cache_bytes", "gauge", "Bytes of cache pages held by the prefix cache (part of cache_bytes_used).", double(es->prefix_cache_bytes));
    sample(out, "deepinfer_prefix_cache_entries", "gauge", "Pages the prefix cache holds.", double(es->prefix_cache_entries));
    sample(out, "deepinfer_prefix_cache_evictions_total", "counter", "Prefix-cache pages evicted (LRU).", double(es->prefix_cache_evictions));
    sample(out, "deepinfer_prefix_cache_lookups_total", "counter", "Prefix-cache lookups.", double(es->prefix_lookups));
    sample(out, "deepinfer_prefix_cache_queried_tokens_total", "counter", "Prompt tokens looked up in the prefix cache.", double(es->prefix_lookup_tokens));
    sample(out, "deepinfer_prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the prefix cache.", double(es->prefix_hit_tokens));
    sample(out, "deepinfer_prefix_cache_hit_rate", "gauge", "hit tokens / queried tokens since start (0 before any lookup).",
           es->prefix_lookup_tokens > 0 ? double(es->prefix_hit_tokens) / double(es->prefix_lookup_tokens) : 0.0);
    sample(out, "deepinfer_snapshots", "gauge", "State snapshots the prefix cache holds.", double(es->snapshots));
    sample(out, "deepinfer_snapshot_bytes", "gauge", "Bytes of those snapshots (part of prefix_cache_bytes).", double(es->snapshot_bytes));
    sample(out, "deepinfer_snapshots_taken_total", "counter", "State snapshots taken.", double(es->snapshots_taken));
    sample(out, "deepinfer_snapshot_hits_total", "counter", "Prefix hits that resumed from a snapshot.", double(es->snapshot_hits));
    sample(out, "deepinfer_snapshot_evictions_total", "counter", "Snapshots evicted (LRU).", double(es->snapshot_evictions));
    sample(out, "deepinfer_replayed_tokens_total", "counter", "Tokens re-run to rebuild state on prefix hits without a snapshot.", double(es->replayed_tokens));
    if (es->disk) {
      const auto& d = es->disk_stats;
      sample(out, "deepinfer_disk_cache_hits_total", "counter", "Disk-tier entries read back whole and verified.", double(d.hits));
      sample(out, "deepinfer_disk_cache_hit_bytes_total", "counter", "Bytes of those entries.", double(d.hit_bytes));
      sample(out, "deepinfer_disk_cache_misses_total", "counter", "Disk-tier reads that found no usable entry.", double(d.misses));
      sample(out, "deepinfer_disk_cache_corrupt_removed_total", "counter", "Damaged, short or foreign disk entries removed.", double(d.corrupt_removed));
      sample(out, "deepinfer_disk_cache_pages_read_total", "counter", "Token pages moved from disk into RAM for requests.", double(es->disk_pages_read));
      sample(out, "deepinfer_disk_cache_snapshots_read_total", "counter", "Snapshots moved from disk into RAM for requests.", double(es->disk_snapshots_read));
      sample(out, "deepinfer_disk_cache_writes_total", "counter", "Disk-tier entries published.", double(d.writes));
      sample(out, "deepinfer_disk_cache_write_bytes_total", "counter", "Payload bytes of those entries.", double(d.write_bytes));
      sample(out, "deepinfer_disk_cache_writes_dropped_total", "counter", "Writes dropped (queue full, disk full, duplicates).", double(d.writes_dropped));
      sample(out, "deepinfer_disk_cache_write_errors_total", "counter", "Writes that failed (other than a full disk).", double(d.write_errors));
      sample(out, "deepinfer_disk_cache_evictions_total", "counter", "Disk entries evicted for capacity (least recently used).", double(d.evictions));
      sample(out, "deepinfer_disk_cache_expirations_total", "counter", "Disk entries removed after the TTL.", double(d.expirations));
      sample(out, "deepinfer_disk_cache_bytes", "gauge", "Bytes of entry files in the directory (last scan and own changes).", double(d.bytes_on_disk));
      sample(out, "deepinfer_disk_cache_entries", "gauge", "Entry files in the directory (last scan and own changes).", double(d.entries_on_disk));
      sample(out, "deepinfer_disk_cache_queued_writes", "gauge", "Writes waiting for the writer threads.", double(d.queued_writes));
      sample(out, "deepinfer_disk_cache_queued_write_bytes", "gauge", "Bytes of those writes.", double(d.queued_write_bytes));
      sample(out, "deepinfer_disk_cache_queued_reads", "gauge", "Reads waiting for the reader threads.", double(d.queued_reads));
      sample(out, "deepinfer_disk_cache_read_seconds_total", "counter", "Time of disk-tier reads (request to result); hit_bytes over it is the read throughput.", d.read_seconds);
      sample(out, "deepinfer_disk_cache_write_seconds_total", "counter", "Time of disk-tier writes (open to rename); write_bytes over it is the write throughput.", d.write_seconds);
      sample(out, "deepinfer_disk_cache_full", "gauge", "1 while writes are off after the disk filled up.", d.disk_full ? 1.0 : 0.0);
    }
    sample(out, "deepinfer_preemptions_total", "counter", "Sequences preempted (recomputed) for lack of cache pages.", double(es->preemptions));
    sample(out, "deepinfer_nonfinite_logits_total", "counter", "Logits rows with NaN/Inf; their requests failed.", double(es->nonfinite_logits));
    sample(out, "deepinfer_engine_steps_total", "counter", "Engine steps run.", double(es->steps));
    sample(out, "deepinfer_engine_decode_steps_total", "counter", "Engine steps where every sequence ran one token.", double(es->decode_steps));
    sample(out, "deepinfer_engine_decode_rows_total", "counter", "Sequences run by those decode steps (their batch sizes summed).", double(es->decode_rows));
    sample(out, "deepinfer_engine_decode_seconds_total", "counter", "Time in the forward passes of those decode steps.", es->decode_seconds);
  }
  return out;
}

}  // namespace di::server
