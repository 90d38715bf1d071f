#include "engine/scheduler.h"

#include "core/numerics.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace di::engine {
namespace {

class NullSink final : public RequestSink {
 public:
  void on_token(const TokenEvent&) override {}
  void on_finish(const FinishEvent&) override {}
};

template <class F>
void notify(const char* what, uint64_t id, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    spdlog::warn("request {}: sink {} threw: {}", id, what, e.what());
  } catch (...) {
    spdlog::warn("request {}: sink {} threw", id, what);
  }
}

}  // namespace

bool Scheduler::Order::operator()(const Seq* a, const Seq* b) const {
  if (priority && a->req->params.priority != b->req->params.priority)
    return a->req->params.priority > b->req->params.priority;
  if (a->req->arrival != b->req->arrival) return a->req->arrival < b->req->arrival;
  return a->choice < b->choice;
}

Scheduler::Scheduler(const Model& model, const EngineOptions& opts)
    : model_(model),
      opts_(opts),
      max_context_(effective_max_context(opts, model.info())),
      pool_(opts.cache_budget_bytes),
      state_pool_(opts.state_budget_bytes ? opts.state_budget_bytes : SIZE_MAX),
      // The model's cache format keys the prefix cache: pages of different models never mix.
      cache_(opts.page_tokens, model.info().cache_format),
      blank_(model.new_state({opts.max_rollback, opts.page_tokens, nullptr, nullptr})),
      page_set_bytes_(blank_->bytes_needed(1)),
      sampler_(model.info().sampleable_vocab),
      ws_(model.new_workspace()),
      waiting_(Order{opts.priority_scheduling}) {
  if (opts_.snapshot_interval < 0 || opts_.snapshot_interval % opts_.page_tokens != 0)
    throw std::invalid_argument("snapshot_interval must be a multiple of page_tokens (0 = none)");
  cache_.set_capacity(opts_.prefix_cache_bytes);
  if (opts_.prefix_cache && !opts_.cache_dir.empty()) {
    kvcache::DiskTierOptions d;
    d.dir = opts_.cache_dir;
    d.capacity_bytes = opts_.cache_disk_bytes;
    d.ttl = opts_.cache_ttl;
    d.format_id = model.info().cache_format;
    d.io_threads = opts_.disk_io_threads;
    d.reader = opts_.disk_io_uring ? kvcache::DiskTierOptions::Reader::IoUring : kvcache::DiskTierOptions::Reader::Pread;
    disk_ = std::make_unique<DiskCache>(std::move(d), model.cache_layout(opts_.page_tokens), opts_.disk_write_min_hits);
  }
}

Scheduler::~Scheduler() {
  // Seqs point into requests_; drop them before the pool and the cache go.
  waiting_.clear();
  running_.clear();
  requests_.clear();
}

void Scheduler::add(uint64_t id, RequestParams params, std::shared_ptr<RequestSink> sink, uint64_t seed,
                    Clock::time_point submitted) {
  auto r = std::make_unique<Request>();
  r->id = id;
  r->params = std::move(params);
  r->sink = sink ? std::move(sink) : std::make_shared<NullSink>();
  r->seed = r->params.sampling.seed ? *r->params.sampling.seed : seed;
  r->cache_root = cache_.root_key(r->params.cache_salt);
  r->arrival = next_arrival_++;
  r->submitted = submitted;
  const int n = r->params.n;
  r->unfinished = n;
  r->stop_requested.assign(size_t(n), 0);
  r->reasons.assign(size_t(n), FinishReason::Stop);
  r->finished_choice.assign(size_t(n), 0);
  auto s = std::make_unique<Seq>();
  s->req = r.get();
  s->choice = 0;
  s->tokens.reserve(r->params.prompt.size() + size_t(r->params.max_tokens) + 1);
  s->tokens = r->params.prompt;
  s->stream_key = choice_stream_key(r->seed, 0);
  if (r->params.grammar) s->matcher = std::make_unique<grammar::GrammarMatcher>(r->params.grammar);
  if (disk_) {
    // Disk hits are read into RAM while the request waits for admission.
    const int pt = opts_.page_tokens;
    cache_.extend_keys(r->cache_root, s->tokens, size_t((int64_t(s->tokens.size()) - 1) / pt), s->keys);
    s->fetch = disk_->start_fetch(cache_, s->keys, use_snapshots(), opts_.disk_prefetch_timeout);
    // The part in RAM must still be there when the rest arrives.
    if (s->fetch) cache_.pin(std::span(s->keys).first(s->fetch->first_page), s->pinned);
  }
  waiting_.insert(s.get());
  r->seqs.push_back(std::move(s));
  ++unstarted_;
  unstarted_tokens_ += int64_t(r->params.prompt.size());
  requests_.emplace(id, std::move(r));
}

int Scheduler::waiting_requests() const { return unstarted_; }
int64_t Scheduler::waiting_prompt_tokens() const { return unstarted_tokens_; }

size_t Scheduler::available() const {
  const size_t f = pool_.free_bytes();
  return f > committed_ ? f - committed_ : 0;
}

bool Scheduler::ensure_room(size_t bytes) { return cache_.make_room(pool_, committed_ + bytes); }

Seq* Scheduler::pick_victim(const Seq* except) {
  Seq* v = nullptr;
  const Order less{opts_.priority_scheduling};
  for (Seq* s : running_)
    if (s != except && !s->scheduled && (!v || less(v, s))) v = s;
  return v;
}

void Scheduler::drop_state(Seq* s, bool cache_pages) {
  s->fetch.reset();
  cache_.unpin(s->pinned);
  if (!s->state) return;
  if (cache_pages && opts_.prefix_cache) {
    cache_.extend_keys(s->req->cache_root, s->tokens, size_t(s->state->pos() / opts_.page_tokens), s->keys);
    cache_.insert(*s->state, s->keys);
    // Where the next turn of a chat resumes: the last page boundary the choice reached.
    if (s->snapshot && s->snapshot_pos <= s->state->pos())
      cache_.insert_snapshot(s->keys[size_t(s->snapshot_pos / opts_.page_tokens) - 1], std::move(s->snapshot));
    if (disk_) disk_->write_through(cache_, s->keys);
  }
  s->snapshot.reset();
  cache_.release(s->held);
  s->state.reset();
}

void Scheduler::poll_fetches() {
  if (!disk_) return;
  const auto now = Clock::now();
  for (Seq* s : waiting_)
    if (s->fetch && (s->fetch->ready() || now >= s->fetch->deadline)) {
      // Pinned until admission: under a small RAM tier other requests' reads would evict them.
      disk_->install(*s->fetch, s->keys, cache_, pool_, s->pinned);
      s->fetch.reset();
    }
}

uint64_t Scheduler::flush_cache() {
  const size_t before = cache_.entries();
  cache_.evict_all();
  uint64_t n = before - cache_.entries();
  if (disk_) n += disk_->tier().clear();
  return n;
}

bool Scheduler::snapshot_point(const Seq& s, int64_t pos) const {
  const int pt = opts_.page_tokens;
  if (pos <= 0 || pos % pt != 0) return false;
  // The last page boundary before the last token a prefill must run (a hit on the same tokens
  // still has one token to run), the end of the tokens when that is a page boundary, and every
  // snapshot_interval tokens.
  const int64_t L = int64_t(s.tokens.size());
  return pos == (L - 1) / pt * pt || pos == L || (opts_.snapshot_interval && pos % opts_.snapshot_interval == 0);
}

int64_t Scheduler::snapshot_stop(const Seq& s, int64_t want) const {
  if (!use_snapshots() || want <= 1) return want;
  const int64_t pos = s.state->pos();
  const int pt = opts_.page_tokens;
  for (int64_t p = (pos / pt + 1) * pt; p < pos + want; p += pt)
    if (snapshot_point(s, p)) return p - pos;
  return want;
}

kvcache::PageRef Scheduler::take_snapshot(const Seq& s) {
  const std::vector<std::byte> bytes = s.state->snapshot();
  // Snapshots only save later work: they never take the page each running choice may need next.
  const size_t reserve = page_set_bytes_ * running_.size();
  if (pool_.free_bytes() + cache_.reclaimable_bytes() < bytes.size() + reserve) return nullptr;
  if (!cache_.make_room(pool_, bytes.size() + reserve)) return nullptr;  // a hit will replay instead
  kvcache::PageRef page;
  try {
    page = pool_.allocate(bytes.size());
  } catch (const kvcache::CacheExhausted&) {
    return nullptr;
  }
  std::memcpy(page->data(), bytes.data(), bytes.size());
  ++counters_.snapshots_taken;
  return page;
}

void Scheduler::after_chunk(Seq* s, bool prefill) {
  const int64_t pos = s->state->pos();
  const int pt = opts_.page_tokens;
  if (!use_snapshots() || pos % pt != 0 || pos == 0) return;
  if (prefill && snapshot_point(*s, pos)) {
    // Cached now, so that requests arriving while this one runs can resume from it.
    cache_.extend_keys(s->req->cache_root, s->tokens, size_t(pos / pt), s->keys);
    const CacheKey& key = s->keys[size_t(pos / pt) - 1];
    cache_.insert(*s->state, std::span(s->keys).first(size_t(pos / pt)));
    if (!cache_.has_snapshot(key)) cache_.insert_snapshot(key, take_snapshot(*s));
    if (disk_) disk_->write_through(cache_, std::span(s->keys).first(size_t(pos / pt)));
  } else if (!prefill) {
    s->snapshot.reset();  // its bytes go back before the new one is drawn
    s->snapshot = take_snapshot(*s);
    s->snapshot_pos = pos;
  }
}

void Scheduler::preempt(Seq* s) {
  if (s->generated() > 0) ++counters_.preempted_with_output;
  drop_state(s, false);
  std::erase(running_, s);
  s->scheduled = false;
  s->where = Seq::Where::Waiting;
  waiting_.insert(s);
  ++counters_.preemptions;
}

int64_t Scheduler::fit_chunk(const Seq& s, int64_t want, size_t reserve) {
  auto largest = [&](size_t avail) -> int64_t {
    auto fits = [&](int64_t c) { return s.state->bytes_needed(c) + reserve <= avail; };
    if (fits(want)) return want;
    if (!fits(0)) return 0;
    int64_t lo = 0, hi = want;  // fits(lo), !fits(hi)
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      (fits(mid) ? lo : hi) = mid;
    }
    return lo;
  };
  // Unreferenced prefix-cache pages count as free (evicted only as far as the chunk needs them).
  int64_t c = largest(available() + cache_.reclaimable_bytes());
  if (c > 0 && !ensure_room(s.state->bytes_needed(c) + reserve)) c = largest(available());
  return c;
}

void Scheduler::schedule(Seq* s, int64_t n) {
  const size_t i = items_.size();
  if (logits_.size() <= i) logits_.resize(i + 1);
  const int64_t pos = s->state->pos();
  committed_ += s->state->bytes_needed(n);
  // The logits pointer is set in run_batch: logits_ may still grow (and move) in this step.
  items_.push_back({&*s->state, std::span<const int32_t>(s->tokens).subspan(size_t(pos), size_t(n)), false, nullptr});
  item_seqs_.push_back(s);
  s->scheduled = true;
}

bool Scheduler::admit(Seq* s, int64_t& budget) {
  Request* r = s->req;
  const int64_t L = int64_t(s->tokens.size());
  const int pt = opts_.page_tokens;
  // Every choice of the request needs its own fixed state: admit only when all of them fit, with
  // the choices that running requests will fork after their prompts still counted as taken.
  const size_t fixed = blank_->fixed_bytes();
  auto pending_forks = [&](const Request* q) { return q->forked ? 0 : fixed * size_t(std::max(0, q->params.n - 1)); };
  size_t promised = 0;
  for (const Seq* o : running_)
    if (o->choice == 0 && o->state) promised += pending_forks(o->req);
  if (state_pool_.free_bytes() < fixed + pending_forks(r) + promised) return false;
  s->state = model_.new_state({opts_.max_rollback, pt, &pool_, &state_pool_});
  int64_t cached = 0, replay = 0;
  bool from_snapshot = false;
  if (opts_.prefix_cache) {
    // At least one token must run to produce the next token's logits.
    const size_t max_pages = size_t((L - 1) / pt);
    cache_.extend_keys(r->cache_root, s->tokens, max_pages, s->keys);
    const size_t m = cache_.acquire(std::span(s->keys).first(std::min(max_pages, s->keys.size())), s->held);
    std::span<const std::byte> snap;
    const size_t k = use_snapshots() ? cache_.find_snapshot(std::span(s->held).first(m), &snap) : 0;
    // Tokens to run before the rest of the prompt: none from a snapshot, the model's replay from
    // the pages alone. A prefix no longer than the replay costs more to rebuild than to recompute.
    const int64_t replay_all = std::min<int64_t>(model_.resume_tokens(), int64_t(m) * pt);
    const int64_t cost_pages = int64_t(m) * pt > model_.resume_tokens() ? L - int64_t(m) * pt + replay_all : L;
    if (k > 0 && L - int64_t(k) * pt <= cost_pages) {
      cached = int64_t(k) * pt;
      cache_.release(s->held, k);
      s->state->restore_snapshot(cache_.pages(s->held), std::span(s->tokens).first(size_t(cached)), snap);
      from_snapshot = true;
    } else if (cost_pages < L) {
      cached = int64_t(m) * pt;
      replay = replay_all;
      s->state->adopt_prefix(cache_.pages(s->held), std::span(s->tokens).first(size_t(cached)));
    } else {
      cache_.release(s->held);
    }
    cache_.unpin(s->pinned);  // held now where used
  }
  // Keep a page per running choice free, so that admitting does not force preemption right away.
  const size_t reserve = page_set_bytes_ * running_.size();
  const int64_t c = fit_chunk(*s, snapshot_stop(*s, std::min(L - cached, budget)), reserve);
  if (c == 0) {
    cache_.release(s->held);
    s->state.reset();
    return false;
  }
  if (opts_.prefix_cache) {
    ++counters_.prefix_lookups;
    counters_.prefix_lookup_tokens += L;
    counters_.prefix_hit_tokens += cached;
  }
  waiting_.erase(s);
  running_.push_back(s);
  s->where = Seq::Where::Running;
  if (!r->started) {
    r->started = true;
    r->cached_tokens = int(cached);
    --unstarted_;
    unstarted_tokens_ -= int64_t(r->params.prompt.size());
    counters_.prompt_tokens += int64_t(r->params.prompt.size());
    counters_.cached_prompt_tokens += cached;
    const StartEvent ev{int(r->params.prompt.size()), int(cached)};
    notify("on_start", r->id, [&] { r->sink->on_start(ev); });
  }
  if (from_snapshot) ++counters_.snapshot_hits;
  if (replay > 0) {
    model_.resume(*s->state, *ws_);
    counters_.replayed_tokens += replay;
  }
  schedule(s, c);
  budget -= c;
  return true;
}

void Scheduler::expire_deadlines(Clock::time_point now) {
  scratch_ids_.clear();
  for (const auto& [id, r] : requests_)
    if (r->params.deadline && now >= *r->params.deadline && r->unfinished > 0) scratch_ids_.push_back(id);
  for (uint64_t id : scratch_ids_) finish_request(requests_.at(id).get(), FinishReason::Deadline, {});
}

bool Scheduler::step() {
  expire_deadlines(Clock::now());
  if (requests_.empty()) {
    collect_done();
    return false;
  }
  items_.clear();
  item_seqs_.clear();
  committed_ = 0;
  int64_t budget = opts_.max_batch_tokens;
  order_ = running_;
  std::sort(order_.begin(), order_.end(), Order{opts_.priority_scheduling});

  // 1. One token for every decoding choice; make room by evicting cached pages, then by preempting
  //    the lowest-ranked choices (possibly this one).
  for (Seq* s : order_) {
    if (budget == 0) break;
    if (s->where != Seq::Where::Running || s->remaining() != 1 || s->req->paused) continue;
    bool room = true;
    while (!ensure_room(s->state->bytes_needed(1))) {
      Seq* v = pick_victim(s);
      if (!v || Order{opts_.priority_scheduling}(v, s)) { room = false; break; }  // s itself ranks lowest
      preempt(v);
    }
    if (!room) { preempt(s); continue; }
    schedule(s, 1);
    budget -= 1;
  }
  // 2. Chunks for prefills already under way.
  for (Seq* s : order_) {
    if (budget == 0) break;
    if (s->where != Seq::Where::Running || s->scheduled || s->remaining() <= 1) continue;
    const int64_t c = fit_chunk(*s, snapshot_stop(*s, std::min(s->remaining(), budget)), 0);
    if (c == 0) continue;
    schedule(s, c);
    budget -= c;
  }
  // 3. Admissions, in queue order; the head waits rather than being overtaken, except by requests
  //    behind it while it waits for its disk reads.
  poll_fetches();
  for (auto it = waiting_.begin(); budget > 0 && it != waiting_.end() && int(running_.size()) < opts_.max_running;) {
    Seq* s = *it++;  // admit erases s
    if (s->fetch) continue;
    if (!admit(s, budget)) break;
  }

  if (items_.empty()) {
    auto fetching = std::find_if(waiting_.begin(), waiting_.end(), [](const Seq* s) { return s->fetch != nullptr; });
    if (fetching != waiting_.end()) {
      // Nothing to run until a disk read completes: wait a little for one instead of spinning.
      const DiskCache::Fetch& f = *(*fetching)->fetch;
      f.wait_until(std::min(f.deadline, Clock::now() + std::chrono::milliseconds(2)));
      collect_done();
      return true;
    }
  }
  if (items_.empty()) {
    // Paused choices wait for their clients; nothing else can run until one resumes.
    if (std::all_of(running_.begin(), running_.end(), [](const Seq* s) { return s->req->paused; }) && !running_.empty()) {
      collect_done();
      return false;
    }
    if (!running_.empty()) {
      // Every running choice lacks pages for even one token: free the lowest-ranked one.
      if (running_.size() == 1) {
        finish(running_.front(), FinishReason::Error, -1, "does not fit in the KV cache budget");
      } else {
        preempt(pick_victim(nullptr));
      }
    } else if (!waiting_.empty()) {
      // Nothing runs and the head still does not fit: it never will.
      finish_request((*waiting_.begin())->req, FinishReason::Error, "does not fit in the KV cache budget");
    }
    collect_done();
    return has_work();
  }
  run_batch();
  collect_done();
  return true;
}

void Scheduler::run_batch() {
  for (size_t i = 0; i < items_.size(); ++i) items_[i].logits = &logits_[i];
  const auto t0 = Clock::now();
  try {
    model_.forward_batch(items_, *ws_);
  } catch (const kvcache::CacheExhausted& e) {
    // Nothing ran (the model checks before touching state). Our estimate missed: back off by
    // preempting the lowest-ranked choice of the batch, and plan again next step.
    spdlog::warn("engine: {}; preempting to recover", e.what());
    for (Seq* s : item_seqs_) s->scheduled = false;
    Seq* v = *std::max_element(item_seqs_.begin(), item_seqs_.end(), Order{opts_.priority_scheduling});
    preempt(v);
    return;
  } catch (const std::exception& e) {
    for (Seq* s : item_seqs_) s->scheduled = false;
    fail_batch(e.what());
    return;
  }
  const double forward_s = std::chrono::duration<double>(Clock::now() - t0).count();
  ++counters_.steps;
  bool decode_only = true;
  for (const auto& it : items_) counters_.step_tokens += int64_t(it.tokens.size()), decode_only &= it.tokens.size() == 1;
  if (decode_only) {
    ++counters_.decode_steps;
    counters_.decode_rows += int64_t(items_.size());
    counters_.decode_seconds += forward_s;
  }
  for (size_t i = 0; i < item_seqs_.size(); ++i) {
    Seq* s = item_seqs_[i];
    s->scheduled = false;
    // A decode step runs one token and leaves none; a prefill chunk runs more or leaves some.
    if (s->state) after_chunk(s, items_[i].tokens.size() > 1 || s->remaining() > 0);
    if (s->where == Seq::Where::Running && s->remaining() == 0) after_forward(s, logits_[i]);
  }
}

void Scheduler::fail_batch(const std::string& error) {
  spdlog::error("engine: forward pass failed: {}", error);
  for (Seq* s : item_seqs_)
    if (s->req->unfinished > 0) finish_request(s->req, FinishReason::Error, error);
}

void Scheduler::after_forward(Seq* s, const std::vector<float>& logits) {
  Request* r = s->req;
  if (!all_finite(logits.data(), int64_t(logits.size()))) {
    // Corrupt weights or an overflow: sampling would return arbitrary tokens that look valid.
    ++counters_.nonfinite_logits;
    spdlog::error("engine: request {}: the model produced non-finite logits (NaN/Inf)", r->id);
    finish_request(r, FinishReason::Error, "the model produced non-finite logits (NaN or Inf); the checkpoint may be corrupt");
    return;
  }
  if (r->forked) {
    sample_and_emit(s, logits.data());
    return;
  }
  fork(s);
  // Every choice samples its first token from the prompt's logits, each with its own stream.
  for (size_t c = 0; c < r->seqs.size(); ++c) {
    Seq* q = r->seqs[c].get();
    if (r->stop_requested[c]) finish(q, FinishReason::Stop);
    else sample_and_emit(q, logits.data());
  }
}

void Scheduler::fork(Seq* leader) {
  Request* r = leader->req;
  r->forked = true;
  if (opts_.prefix_cache) {
    // The prompt's full pages become reusable now, not only when the request ends.
    cache_.extend_keys(r->cache_root, leader->tokens, size_t(leader->state->pos() / opts_.page_tokens), leader->keys);
    cache_.insert(*leader->state, leader->keys);
    if (disk_) disk_->write_through(cache_, leader->keys);
  }
  for (int c = 1; c < r->params.n; ++c) {
    auto f = std::make_unique<Seq>();
    f->req = r;
    f->choice = c;
    f->tokens.reserve(leader->tokens.capacity());
    f->tokens = leader->tokens;
    f->state = leader->state->clone();  // shares every page; a partial page is copied on first write
    f->keys = leader->keys;
    f->stream_key = choice_stream_key(r->seed, c);
    // Nothing is generated before the fork: every choice starts the grammar afresh.
    if (r->params.grammar) f->matcher = std::make_unique<grammar::GrammarMatcher>(r->params.grammar);
    f->where = Seq::Where::Running;
    running_.push_back(f.get());
    r->seqs.push_back(std::move(f));
  }
}

void Scheduler::sample_and_emit(Seq* s, const float* logits) {
  Request* r = s->req;
  const RequestParams& p = r->params;
  const bool want_logprobs = p.sampling.logprobs > 0;
  SampleInput in;
  in.params = &p.sampling;
  in.prompt = p.prompt;
  in.output = std::span<const int32_t>(s->tokens).subspan(p.prompt.size());
  in.stream_key = s->stream_key;
  in.step = s->generated();
  in.top_logprobs = want_logprobs ? p.sampling.top_logprobs : 0;
  grammar::GrammarMatcher* const m = s->matcher.get();
  if (m) {
    mask_.resize(size_t(m->grammar().vocab().mask_words()));
    m->fill_mask(mask_);
    in.mask = mask_;
  }
  if (p.return_logits) {
    const std::span<const float> row(logits, size_t(model_.info().vocab_size));
    notify("on_logits", r->id, [&] { r->sink->on_logits(s->choice, row); });
  }
  const SampleResult res = sampler_.sample(logits, in, want_logprobs ? &s->event.top : nullptr);
  const int32_t t = res.token;
  ++counters_.generated_tokens;
  ++r->completion_tokens;
  const Clock::time_point now = Clock::now();
  if (!r->any_token) {
    r->any_token = true;
    r->first_token = now;
  }
  if (m) {
    if (!m->accept_token(t)) {
      // Cannot happen with a correct mask; fail loudly rather than emit text outside the grammar.
      finish(s, FinishReason::Error, -1, "grammar: sampled token " + std::to_string(t) + " was not allowed");
      return;
    }
    if (m->is_terminated()) {  // a stop token the grammar allowed where it may end
      finish(s, FinishReason::Stop, t);
      return;
    }
  }
  const bool eos = !p.ignore_eos && t == model_.info().eos_id;
  if (eos || std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), t) != p.stop_token_ids.end()) {
    finish(s, FinishReason::Stop, t);
    return;
  }
  s->tokens.push_back(t);
  s->event.choice = s->choice;
  s->event.token = t;
  s->event.logprob = want_logprobs ? res.logprob : 0.0f;
  notify("on_token", r->id, [&] { r->sink->on_token(s->event); });
  if (m && m->must_end()) {  // the grammar has ended: only a stop token could follow
    finish(s, FinishReason::Stop);
    return;
  }
  if (s->generated() >= p.max_tokens || int64_t(s->tokens.size()) >= max_context_) finish(s, FinishReason::Length);
}

void Scheduler::finish(Seq* s, FinishReason reason, int32_t stop_token, std::string error) {
  if (s->where == Seq::Where::Done) return;
  Request* r = s->req;
  drop_state(s, reason != FinishReason::Error);
  if (s->where == Seq::Where::Waiting) waiting_.erase(s);
  if (s->where == Seq::Where::Running) std::erase(running_, s);
  s->where = Seq::Where::Done;
  s->scheduled = false;
  FinishEvent ev;
  ev.reason = reason;
  ev.error = std::move(error);
  ev.stop_token = stop_token;
  // Before the fork, choice 0 stands for all of them.
  const int last = (s->choice == 0 && !r->forked) ? r->params.n - 1 : s->choice;
  for (int c = s->choice; c <= last; ++c) {
    if (r->finished_choice[size_t(c)]) continue;
    r->finished_choice[size_t(c)] = 1;
    r->reasons[size_t(c)] = reason;
    --r->unfinished;
    ev.choice = c;
    notify("on_finish", r->id, [&] { r->sink->on_finish(ev); });
  }
  if (r->unfinished == 0) request_done(r);
}

void Scheduler::finish_request(Request* r, FinishReason reason, const std::string& error) {
  for (size_t i = 0; i < r->seqs.size(); ++i) finish(r->seqs[i].get(), reason, -1, error);
}

void Scheduler::request_done(Request* r) {
  r->finished = Clock::now();
  if (!r->started) {
    --unstarted_;
    unstarted_tokens_ -= int64_t(r->params.prompt.size());
  }
  ++counters_.requests_finished;
  const double total_s = std::chrono::duration<double>(r->finished - r->submitted).count();
  const double ttft_s = r->any_token ? std::chrono::duration<double>(r->first_token - r->submitted).count() : total_s;
  const double decode_s = r->any_token ? std::chrono::duration<double>(r->finished - r->first_token).count() : 0.0;
  const double tps = decode_s > 0 ? double(r->completion_tokens - 1) / decode_s : 0.0;
  std::string reasons;
  for (size_t c = 0; c < r->reasons.size(); ++c) {
    if (c > 0 && r->reasons[c] == r->reasons[0]) continue;
    if (!reasons.empty()) reasons += ",";
    reasons += finish_reason_name(r->reasons[c]);
  }
  spdlog::info("request {} n={} prompt={} cached={} completion={} ttft={:.3f}s total={:.3f}s decode={:.1f} tok/s finish={}",
               r->id, r->params.n, r->params.prompt.size(), r->cached_tokens, r->completion_tokens, ttft_s, total_s, tps,
               reasons);
  done_.push_back(r);
}

void Scheduler::collect_done() {
  for (Request* r : done_) requests_.erase(r->id);
  done_.clear();
}

void Scheduler::cancel(uint64_t id, FinishReason reason) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  finish_request(it->second.get(), reason, {});
  collect_done();
}

void Scheduler::stop_choice(uint64_t id, int choice) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  Request* r = it->second.get();
  if (choice < 0 || choice >= r->params.n || r->finished_choice[size_t(choice)]) return;
  if (!r->forked) {
    r->stop_requested[size_t(choice)] = 1;  // choice 0 carries the others until the prompt is done
  } else {
    finish(r->seqs[size_t(choice)].get(), FinishReason::Stop);
  }
  collect_done();
}

void Scheduler::set_paused(uint64_t id, bool paused) {
  if (auto it = requests_.find(id); it != requests_.end()) it->second->paused = paused;
}

void Scheduler::cancel_all(FinishReason reason) {
  scratch_ids_.clear();
  for (const auto& [id, r] : requests_) scratch_ids_.push_back(id);
  for (uint64_t id : scratch_ids_) {
    auto it = requests_.find(id);
    if (it != requests_.end()) finish_request(it->second.get(), reason, {});
  }
  collect_done();
}

}  // namespace di::engine
