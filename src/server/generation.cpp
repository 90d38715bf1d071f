#include "server/generation.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <ctime>
#include <mutex>
#include <optional>
#include <random>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "server/stop_matcher.h"
#include "openai/protocol.h"

namespace di::server {
namespace {

using ojson = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;
constexpr auto kReplace = nlohmann::json::error_handler_t::replace;

std::string dump(const ojson& j) { return j.dump(-1, ' ', false, kReplace); }

std::string new_request_id(openai::Endpoint ep) {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = std::random_device{}() * 0x9E3779B97F4A7C15ull;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s-%012llx%08llx", ep == openai::Endpoint::ChatCompletions ? "chatcmpl" : "cmpl",
                (unsigned long long)(salt >> 16), (unsigned long long)counter.fetch_add(1));
  return buf;
}

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

struct LogprobEntry {
  int32_t token;
  float logprob;
  std::vector<engine::TokenLogprob> top;
};

struct Event {
  enum Kind { Start, Token, Finish } kind = Start;
  int sub = 0, choice = 0;
  int32_t token = 0;
  float logprob = 0;
  std::vector<engine::TokenLogprob> top;
  engine::FinishReason reason = engine::FinishReason::Stop;
  std::string error;
  int prompt_tokens = 0, cached_tokens = 0;
};

class Generation : public std::enable_shared_from_this<Generation> {
 public:
  Generation(openai::GenerationSpec spec, std::shared_ptr<HttpExchange> ex, std::shared_ptr<const ServingContext> ctx, Clock::time_point arrival)
      : spec_(std::move(spec)), ex_(std::move(ex)), ctx_(std::move(ctx)), tok_(*ctx_->model.tokenizer), arrival_(arrival),
        id_(new_request_id(spec_.endpoint)), created_(std::time(nullptr)) {
    ++ctx_->active_generations;
  }
  ~Generation() { release(); }

  void start();
  void enqueue(Event&& ev);

 private:
  struct Choice {
    std::optional<IncrementalDecoder> decoder;
    std::optional<stream::StreamParser> parser;
    std::optional<openai::ChatDeltaConverter> deltas;
    std::optional<openai::ChatMessageBuilder> message;
    StopMatcher stop;
    std::string text;        // completions, non-streaming
    std::vector<LogprobEntry> logprobs;  // non-streaming: all; streaming: not yet sent
    int tokens = 0;          // generated tokens (engine events) for this choice
    bool done = false;       // no more output (finished, or stopped on a stop string)
    bool sent_any = false;   // streaming: a chunk with content went out
    std::string finish_reason;
  };
  struct Submission {
    uint64_t engine_id = 0;
    int first_choice = 0;
    int prompt_tokens = 0, cached_tokens = 0;
    int finished = 0;  // engine finish events received
    bool cancelled = false;
  };

  bool is_chat() const { return spec_.endpoint == openai::Endpoint::ChatCompletions; }
  void drain();
  void on_token(const Event& ev);
  void on_finish(const Event& ev);
  void feed_text(int index, std::string_view text);
  void chat_events(int index, bool final);
  void finish_choice(int index, const std::string& reason_hint, bool length);
  void cancel_all();
  void maybe_complete();
  void complete();
  void emit_chunk(int index, const ojson* delta, const std::string& text, const char* finish_reason);
  ojson logprobs_json(const std::vector<LogprobEntry>& entries, size_t text_offset) const;
  ojson usage_json() const;
  void reply_error(const openai::ApiError& e);
  // The reply is final: this request no longer holds up a graceful shutdown.
  void release() {
    if (counted_) --ctx_->active_generations;
    counted_ = false;
  }
  openai::ApiError shutdown_error() const;
  void check_backpressure();
  void set_paused(bool paused);

  openai::GenerationSpec spec_;
  std::shared_ptr<HttpExchange> ex_;
  std::shared_ptr<const ServingContext> ctx_;
  const Tokenizer& tok_;
  Clock::time_point arrival_, first_token_{}, last_token_{};
  std::string id_;
  int64_t created_;
  std::string chunk_prefix_;

  std::vector<Choice> choices_;
  std::vector<Submission> subs_;
  std::vector<stream::StreamEvent> events_;  // scratch, reused
  std::vector<ojson> deltas_;                // scratch, reused
  std::string scratch_, line_;               // scratch, reused
  int total_tokens_ = 0;
  bool completed_ = false, client_gone_ = false, stream_started_ = false;
  bool shutdown_ = false;  // the server's shutdown ended the request
  bool paused_ = false, resume_timer_ = false;  // back-pressure
  bool counted_ = true;    // in ctx_->active_generations
  std::string error_;  // an engine error ends the request with 500 (or an SSE error event)

  std::mutex inbox_mu_;
  std::vector<Event> inbox_, work_;
  bool drain_posted_ = false;
};

class Sink : public engine::RequestSink {
 public:
  Sink(std::shared_ptr<Generation> g, int sub) : g_(std::move(g)), sub_(sub) {}
  void on_start(const engine::StartEvent& s) override {
    Event ev;
    ev.kind = Event::Start;
    ev.sub = sub_;
    ev.prompt_tokens = s.prompt_tokens;
    ev.cached_tokens = s.cached_tokens;
    g_->enqueue(std::move(ev));
  }
  void on_token(const engine::TokenEvent& t) override {
    Event ev;
    ev.kind = Event::Token;
    ev.sub = sub_;
    ev.choice = t.choice;
    ev.token = t.token;
    ev.logprob = t.logprob;
    ev.top = t.top;
    g_->enqueue(std::move(ev));
  }
  void on_finish(const engine::FinishEvent& f) override {
    Event ev;
    ev.kind = Event::Finish;
    ev.sub = sub_;
    ev.choice = f.choice;
    ev.reason = f.reason;
    ev.error = f.error;
    g_->enqueue(std::move(ev));
  }

 private:
  std::shared_ptr<Generation> g_;
  int sub_;
};

void Generation::enqueue(Event&& ev) {
  bool post = false;
  {
    std::lock_guard lk(inbox_mu_);
    inbox_.push_back(std::move(ev));
    if (!drain_posted_) post = drain_posted_ = true;
  }
  if (post) ex_->post([self = shared_from_this()] { self->drain(); });
}

void Generation::drain() {
  {
    std::lock_guard lk(inbox_mu_);
    work_.clear();
    work_.swap(inbox_);
    drain_posted_ = false;
  }
  for (const Event& ev : work_) {
    switch (ev.kind) {
      case Event::Start: {
        auto& s = subs_[size_t(ev.sub)];
        s.prompt_tokens = ev.prompt_tokens;
        s.cached_tokens = ev.cached_tokens;
        break;
      }
      case Event::Token: on_token(ev); break;
      case Event::Finish: on_finish(ev); break;
    }
  }
}

void Generation::start() {
  const int n = spec_.n;
  choices_.resize(spec_.prompts.size() * size_t(n));
  for (auto& c : choices_) {
    c.decoder.emplace(ctx_->model.tokenizer, /*skip_special=*/!is_chat());
    if (is_chat()) {
      c.parser.emplace(*spec_.parser);
      if (spec_.stream) c.deltas.emplace();
      else c.message.emplace();
    } else {
      c.stop = StopMatcher(spec_.stop);
    }
  }
  subs_.resize(spec_.prompts.size());
  for (size_t i = 0; i < spec_.prompts.size(); ++i) {
    subs_[i].first_choice = int(i) * n;
    subs_[i].prompt_tokens = int(spec_.prompts[i].size());
  }

  auto self = shared_from_this();
  for (size_t i = 0; i < spec_.prompts.size(); ++i) {
    engine::RequestParams rp;
    rp.prompt = spec_.prompts[i];
    rp.sampling = spec_.sampling;
    rp.max_tokens = spec_.max_tokens;
    rp.stop_token_ids = spec_.stop_token_ids;
    rp.ignore_eos = spec_.ignore_eos || !spec_.forced_output.empty();
    rp.n = n;
    rp.priority = spec_.priority;
    // The test hook's forced tokens replace the engine's anyway.
    if (spec_.forced_output.empty()) rp.grammar = spec_.grammar;
    const engine::SubmitResult r = ctx_->engine->submit(std::move(rp), std::make_shared<Sink>(self, int(i)));
    if (r.error != engine::SubmitError::None) {
      for (size_t j = 0; j < i; ++j) ctx_->engine->cancel(subs_[j].engine_id);
      openai::ApiError e;
      switch (r.error) {
        case engine::SubmitError::QueueFull:
          e.status = 429;
          e.type = "rate_limit_error";
          e.code = "engine_queue_full";
          e.message = "the engine's waiting queue is full; retry later" + (r.message.empty() ? "" : " (" + r.message + ")");
          e.headers.emplace_back("Retry-After", std::to_string(std::max(1, r.retry_after_s)));
          break;
        case engine::SubmitError::TooLong:
          e = openai::invalid_param(is_chat() ? "messages" : "prompt", r.message, "context_length_exceeded");
          break;
        case engine::SubmitError::Invalid:
          e = openai::invalid_param("", r.message, "invalid_value");
          break;
        default:
          e.status = 503;
          e.type = "server_error";
          e.code = "server_shutdown";
          e.message = "the server is shutting down";
          break;
      }
      completed_ = true;
      reply_error(e);
      return release();
    }
    subs_[i].engine_id = r.id;
  }
  // Registered after the submissions so a client already gone cancels them at once.
  ex_->on_client_gone([self] {
    self->client_gone_ = true;
    self->cancel_all();
  });

  if (spec_.stream) {
    chunk_prefix_ = is_chat() ? R"({"id":")" + id_ + R"(","object":"chat.completion.chunk","created":)" + std::to_string(created_) +
                                    R"(,"model":)" + dump(ojson(ctx_->model.served_name)) + R"(,"choices":[)"
                              : R"({"id":")" + id_ + R"(","object":"text_completion","created":)" + std::to_string(created_) +
                                    R"(,"model":)" + dump(ojson(ctx_->model.served_name)) + R"(,"choices":[)";
    ex_->start_stream("text/event-stream");
    stream_started_ = true;
    ctx_->metrics->stream_opened();
    if (spec_.echo)
      for (size_t i = 0; i < choices_.size(); ++i) emit_chunk(int(i), nullptr, spec_.prompt_texts[i / size_t(n)], nullptr);
  }
  // Comments keep proxies and clients from timing out during a long prefill.
  if (ctx_->sse_keepalive_s > 0 && spec_.stream) {
    std::weak_ptr<Generation> weak = self;
    const double period = ctx_->sse_keepalive_s;
    ex_->every(period / 2, [weak, period] {
      auto g = weak.lock();
      if (!g || g->completed_) return;
      if (g->ex_->idle_seconds() >= period) g->ex_->write(": keep-alive\n\n");
    });
  }
}

void Generation::reply_error(const openai::ApiError& e) {
  ctx_->metrics->count_request(is_chat() ? "/v1/chat/completions" : "/v1/completions", e.status);
  spdlog::info("{} {} status={} error=\"{}\"", id_, is_chat() ? "chat" : "completions", e.status, e.message);
  ex_->respond(e.status, openai::error_body(e), "application/json", e.headers);
}

openai::ApiError Generation::shutdown_error() const {
  openai::ApiError e;
  e.status = 503;
  e.type = "server_error";
  e.code = "server_shutdown";
  char grace[32];
  std::snprintf(grace, sizeof grace, "%g", ctx_->shutdown_timeout_s);
  e.message = std::string("the server shut down before the request finished (it drains for ") + grace +
              " s, --shutdown-timeout); retry the request";
  e.headers.emplace_back("Retry-After", "1");
  return e;
}

void Generation::cancel_all() {
  for (auto& s : subs_) {
    if (s.cancelled || s.finished >= spec_.n) continue;
    s.cancelled = true;
    ctx_->engine->cancel(s.engine_id);
  }
}

void Generation::on_token(const Event& ev) {
  if (completed_) return;
  const Submission& sub = subs_[size_t(ev.sub)];
  if (ev.choice < 0 || ev.choice >= spec_.n) return;
  const int index = sub.first_choice + ev.choice;
  Choice& c = choices_[size_t(index)];
  if (c.done) return;
  const auto now = Clock::now();
  if (total_tokens_ == 0) first_token_ = now;
  last_token_ = now;
  ++total_tokens_;
  const int32_t token = spec_.forced_output.empty() ? ev.token
                                                    : spec_.forced_output[std::min<size_t>(size_t(c.tokens), spec_.forced_output.size() - 1)];
  ++c.tokens;
  if (spec_.logprobs) c.logprobs.push_back({token, ev.logprob, ev.top});
  if (client_gone_) return;
  const bool stop_token = (!spec_.ignore_eos && token == ctx_->model.eos_id) ||
                          std::find(spec_.stop_token_ids.begin(), spec_.stop_token_ids.end(), token) != spec_.stop_token_ids.end();
  if (stop_token) {
    if (spec_.stream && spec_.logprobs) emit_chunk(index, nullptr, "", nullptr);
    return;
  }
  feed_text(index, c.decoder->push(token));
  if (c.done) return;
  if (is_chat() ? c.parser->done() : c.stop.matched()) {
    finish_choice(index, "stop", false);
    // Stopped on a stop string (or the end of the tool calls): the engine drops this choice at its
    // next step; the others go on.
    ctx_->engine->stop_choice(subs_[size_t(ev.sub)].engine_id, ev.choice);
  }
}

void Generation::feed_text(int index, std::string_view text) {
  Choice& c = choices_[size_t(index)];
  if (is_chat()) {
    events_.clear();
    c.parser->feed(text, events_);
    chat_events(index, false);
  } else {
    scratch_.clear();
    c.stop.feed(text, scratch_);
    if (spec_.stream) {
      if (!scratch_.empty() || !c.logprobs.empty()) emit_chunk(index, nullptr, scratch_, nullptr);
    } else {
      c.text += scratch_;
    }
  }
}

// Hands the parser events in events_ to the delta converter (stream) or message builder.
void Generation::chat_events(int index, bool final) {
  Choice& c = choices_[size_t(index)];
  if (!spec_.stream) {
    c.message->add(events_);
    return;
  }
  deltas_.clear();
  c.deltas->convert(events_, deltas_);
  if (deltas_.empty()) {
    if (!c.logprobs.empty() && !final) emit_chunk(index, nullptr, "", nullptr);
    return;
  }
  for (const auto& d : deltas_) emit_chunk(index, &d, "", nullptr);
}

void Generation::emit_chunk(int index, const ojson* delta, const std::string& text, const char* finish_reason) {
  if (client_gone_) return;
  Choice& c = choices_[size_t(index)];
  line_ = "data: ";
  line_ += chunk_prefix_;
  line_ += R"({"index":)";
  line_ += std::to_string(index);
  if (is_chat()) {
    line_ += R"(,"delta":)";
    if (delta) {
      line_ += dump(*delta);
    } else if (!c.sent_any) {
      line_ += R"({"role":"assistant","content":""})";
    } else {
      line_ += "{}";
    }
  } else {
    line_ += R"(,"text":)";
    line_ += dump(ojson(text));
  }
  c.sent_any = true;
  line_ += R"(,"logprobs":)";
  if (spec_.logprobs && !c.logprobs.empty()) {
    line_ += dump(logprobs_json(c.logprobs, 0));
    c.logprobs.clear();
  } else {
    line_ += "null";
  }
  line_ += R"(,"finish_reason":)";
  line_ += finish_reason ? "\"" + std::string(finish_reason) + "\"" : "null";
  line_ += "}]}\n\n";
  ex_->write(line_);
  check_backpressure();
}

// A client that does not read its stream must not make the server buffer its whole output:
// generation pauses while too much is queued and resumes once the client catches up (a client that
// never does is dropped by the HTTP layer's write timeout).
void Generation::check_backpressure() {
  constexpr size_t kPauseBytes = 256 << 10, kResumeBytes = 64 << 10;
  if (paused_ || completed_ || ex_->pending_bytes() < kPauseBytes) return;
  set_paused(true);
  if (resume_timer_) return;
  resume_timer_ = true;
  std::weak_ptr<Generation> weak = shared_from_this();
  ex_->every(0.02, [weak] {
    auto g = weak.lock();
    if (g && g->paused_ && !g->completed_ && g->ex_->pending_bytes() < kResumeBytes) g->set_paused(false);
  });
}

void Generation::set_paused(bool paused) {
  if (paused_ == paused) return;
  paused_ = paused;
  ctx_->metrics->stream_paused(paused);
  for (const auto& s : subs_) ctx_->engine->set_paused(s.engine_id, paused);
}

ojson Generation::logprobs_json(const std::vector<LogprobEntry>& entries, size_t text_offset) const {
  if (is_chat()) {
    ojson content = ojson::array();
    auto item = [&](int32_t id, float lp) {
      const std::string_view raw = tok_.token_bytes_view(id);
      ojson bytes = ojson::array();
      for (unsigned char b : raw) bytes.push_back(int(b));
      return ojson{{"token", openai::token_text(tok_, id)}, {"logprob", lp}, {"bytes", std::move(bytes)}};
    };
    for (const auto& e : entries) {
      ojson j = item(e.token, e.logprob);
      ojson top = ojson::array();
      for (const auto& t : e.top) top.push_back(item(t.token, t.logprob));
      j["top_logprobs"] = std::move(top);
      content.push_back(std::move(j));
    }
    return ojson{{"content", std::move(content)}};
  }
  ojson tokens = ojson::array(), lps = ojson::array(), tops = ojson::array(), offsets = ojson::array();
  for (const auto& e : entries) {
    std::string t = openai::token_text(tok_, e.token);
    offsets.push_back(text_offset);
    text_offset += t.size();
    tokens.push_back(std::move(t));
    lps.push_back(e.logprob);
    ojson top = ojson::object();
    for (const auto& alt : e.top) top[openai::token_text(tok_, alt.token)] = alt.logprob;
    tops.push_back(std::move(top));
  }
  return ojson{{"tokens", std::move(tokens)}, {"token_logprobs", std::move(lps)}, {"top_logprobs", std::move(tops)},
               {"text_offset", std::move(offsets)}};
}

void Generation::on_finish(const Event& ev) {
  Submission& sub = subs_[size_t(ev.sub)];
  ++sub.finished;
  if (ev.choice >= 0 && ev.choice < spec_.n) {
    const int index = sub.first_choice + ev.choice;
    Choice& c = choices_[size_t(index)];
    if (!c.done) {
      using R = engine::FinishReason;
      switch (ev.reason) {
        case R::Stop: finish_choice(index, "stop", false); break;
        // Forced output ends by length by construction: report it as a natural end.
        case R::Length:
          if (spec_.forced_output.empty()) finish_choice(index, "length", true);
          else finish_choice(index, "stop", false);
          break;
        case R::Deadline: finish_choice(index, "length", true); break;
        case R::Cancelled:
          c.done = true;
          c.finish_reason = "cancelled";
          if (!client_gone_ && ctx_->shutting_down) {
            shutdown_ = true;
            c.finish_reason = "shutdown";
          }
          break;
        case R::Error:
          c.done = true;
          c.finish_reason = "error";
          if (error_.empty()) error_ = ev.error.empty() ? "engine error" : ev.error;
          break;
      }
    }
  }
  maybe_complete();
}

void Generation::finish_choice(int index, const std::string& reason_hint, bool length) {
  Choice& c = choices_[size_t(index)];
  if (c.done) return;
  if (client_gone_) {
    c.done = true;
    c.finish_reason = "cancelled";
    return;
  }
  const bool stopped_early = is_chat() ? c.parser->done() : c.stop.matched();
  if (!stopped_early) feed_text(index, c.decoder->flush());
  if (is_chat()) {
    events_.clear();
    c.parser->finish(length ? stream::StopCause::Length : stream::StopCause::EndOfText, events_);
    chat_events(index, true);
    c.finish_reason = spec_.stream ? c.deltas->finish_reason().value_or(length ? "length" : "stop") : c.message->finish_reason();
  } else {
    scratch_.clear();
    c.stop.finish(scratch_);
    if (spec_.stream) {
      if (!scratch_.empty()) emit_chunk(index, nullptr, scratch_, nullptr);
    } else {
      c.text += scratch_;
    }
    c.finish_reason = c.stop.matched() ? "stop" : length ? "length" : reason_hint;
  }
  c.done = true;
  if (spec_.stream) emit_chunk(index, nullptr, "", c.finish_reason.c_str());
}

void Generation::maybe_complete() {
  if (completed_) return;
  for (const auto& s : subs_)
    if (s.finished < spec_.n) return;
  complete();
}

ojson Generation::usage_json() const {
  int prompt = 0, cached = 0, completion = 0;
  for (const auto& s : subs_) {
    prompt += s.prompt_tokens;
    cached += s.cached_tokens;
  }
  for (const auto& c : choices_) completion += c.tokens;
  return ojson{{"prompt_tokens", prompt},
               {"completion_tokens", completion},
               {"total_tokens", prompt + completion},
               {"prompt_tokens_details", {{"cached_tokens", cached}}}};
}

void Generation::complete() {
  completed_ = true;
  if (paused_) {
    paused_ = false;
    ctx_->metrics->stream_paused(false);
  }
  const auto end = Clock::now();
  Metrics& m = *ctx_->metrics;
  const char* endpoint = is_chat() ? "/v1/chat/completions" : "/v1/completions";
  int prompt = 0, cached = 0;
  for (const auto& s : subs_) {
    prompt += s.prompt_tokens;
    cached += s.cached_tokens;
  }
  m.add_tokens(prompt, cached, total_tokens_);
  std::string reasons;
  for (auto& c : choices_) {
    if (client_gone_) c.finish_reason = "cancelled";
    m.count_finish(c.finish_reason);
    if (reasons.find(c.finish_reason) == std::string::npos) reasons += (reasons.empty() ? "" : ",") + c.finish_reason;
  }
  double ttft = -1;
  if (total_tokens_ > 0) {
    ttft = seconds(first_token_ - arrival_);
    m.observe_ttft(ttft);
    const int per_choice = total_tokens_ / std::max<int>(1, int(choices_.size()));
    if (per_choice > 1) m.observe_tpot(seconds(last_token_ - first_token_) / double(per_choice - 1));
  }
  const double dur = seconds(end - arrival_);
  m.observe_e2e(dur);
  int status = 200;
  if (client_gone_) {
    status = 499;  // nginx's "client closed request"
  } else if (shutdown_ && !spec_.stream) {
    status = 503;
  } else if (!error_.empty() && !spec_.stream) {
    status = 500;
  }
  m.count_request(endpoint, status);
  const double decode_s = total_tokens_ > 1 ? seconds(last_token_ - first_token_) : 0;
  spdlog::info("{} {} status={} prompt={} cached={} completion={} ttft={:.3f}s tok/s={:.1f} finish={} time={:.3f}s", id_,
               is_chat() ? "chat" : "completions", status, prompt, cached, total_tokens_, ttft,
               decode_s > 0 ? double(total_tokens_ - 1) / decode_s : 0.0, reasons, dur);

  if (stream_started_) ctx_->metrics->stream_closed();
  release();
  if (client_gone_) {
    ex_->end_stream();
    return;
  }
  if (shutdown_) {
    // Not an OpenAI finish reason: clients see an error they can retry elsewhere.
    const openai::ApiError e = shutdown_error();
    if (!spec_.stream) return ex_->respond(e.status, openai::error_body(e), "application/json", e.headers);
    ex_->write("data: " + openai::error_body(e) + "\n\n");
    ex_->end_stream();
    return;
  }
  if (spec_.stream) {
    if (!error_.empty()) {
      openai::ApiError e;
      e.status = 500;
      e.type = "server_error";
      e.code = "engine_error";
      e.message = error_;
      ex_->write("data: " + openai::error_body(e) + "\n\n");
    }
    if (spec_.include_usage) {
      ojson u;
      u["id"] = id_;
      u["object"] = is_chat() ? "chat.completion.chunk" : "text_completion";
      u["created"] = created_;
      u["model"] = ctx_->model.served_name;
      u["choices"] = ojson::array();
      u["usage"] = usage_json();
      ex_->write("data: " + dump(u) + "\n\n");
    }
    ex_->write("data: [DONE]\n\n");
    ex_->end_stream();
    return;
  }
  if (!error_.empty()) {
    openai::ApiError e;
    e.status = 500;
    e.type = "server_error";
    e.code = "engine_error";
    e.message = error_;
    ex_->respond(500, openai::error_body(e));
    return;
  }
  ojson j;
  j["id"] = id_;
  j["object"] = is_chat() ? "chat.completion" : "text_completion";
  j["created"] = created_;
  j["model"] = ctx_->model.served_name;
  ojson arr = ojson::array();
  for (size_t i = 0; i < choices_.size(); ++i) {
    Choice& c = choices_[i];
    ojson ch;
    ch["index"] = i;
    if (is_chat()) {
      ch["message"] = c.message->message();
      ch["logprobs"] = spec_.logprobs ? logprobs_json(c.logprobs, 0) : ojson(nullptr);
    } else {
      const std::string& prompt_text = spec_.prompt_texts[i / size_t(spec_.n)];
      ch["text"] = spec_.echo ? prompt_text + c.text : c.text;
      ch["logprobs"] = spec_.logprobs ? logprobs_json(c.logprobs, spec_.echo ? prompt_text.size() : 0) : ojson(nullptr);
    }
    ch["finish_reason"] = c.finish_reason;
    arr.push_back(std::move(ch));
  }
  j["choices"] = std::move(arr);
  j["usage"] = usage_json();
  ex_->respond(200, dump(j));
}

}  // namespace

void run_generation(openai::GenerationSpec spec, std::shared_ptr<HttpExchange> exchange, std::shared_ptr<const ServingContext> ctx,
                    Clock::time_point arrival) {
  auto g = std::make_shared<Generation>(std::move(spec), std::move(exchange), std::move(ctx), arrival);
  g->start();
}

}  // namespace di::server
