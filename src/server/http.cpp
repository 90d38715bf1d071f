#include "server/http.h"

#include <sys/socket.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <list>
#include <mutex>
#include <optional>
#include <stdexcept>

#include <spdlog/spdlog.h>

namespace di::server {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

const char* http_status_text(int status) {
  switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Payload Too Large";
    case 415: return "Unsupported Media Type";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    default: return "Unknown";
  }
}

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string error_json(const std::string& message, const char* code) {
  // Transport-level errors (before the API layer sees the request) in OpenAI's error shape.
  std::string escaped;
  for (char c : message) {
    if (c == '"' || c == '\\') escaped += '\\';
    escaped += c;
  }
  return std::string("{\"error\":{\"message\":\"") + escaped + "\",\"type\":\"invalid_request_error\",\"param\":null,\"code\":\"" +
         code + "\"}}";
}

// The path of a request target: the query string dropped, and for the absolute form
// ("http://host/path", RFC 9112 section 3.2.2) the scheme and authority dropped too.
std::string_view target_path(std::string_view target) {
  if (!target.empty() && target.front() != '/') {
    const size_t scheme_end = target.find("://");
    const bool scheme = scheme_end != std::string_view::npos && scheme_end > 0 &&
                        std::all_of(target.begin(), target.begin() + scheme_end, [](char c) {
                          return std::isalnum(static_cast<unsigned char>(c)) || c == '+' || c == '-' || c == '.';
                        });
    if (scheme) {
      const size_t slash = target.find_first_of("/?", scheme_end + 3);
      if (slash == std::string_view::npos || target[slash] == '?') return "/";
      target.remove_prefix(slash);
    }
  }
  return target.substr(0, target.find('?'));
}

// Lists the transfer codings of a Transfer-Encoding value ("gzip, chunked" -> {gzip, chunked}).
std::vector<std::string> transfer_codings(std::string_view v) {
  std::vector<std::string> out;
  for (auto part : http::token_list{v}) out.emplace_back(part);
  return out;
}

// Request bodies being received or held by handlers, over all connections. Freed body memory goes
// back to the allocator, which keeps it unless asked: after a burst the process is trimmed.
struct BodyBudget {
  size_t cap = 0;
  std::atomic<size_t> inflight{0};
  std::atomic<size_t> freed_since_trim{0};
  static constexpr size_t kTrimAfter = size_t(32) << 20;

  bool try_add(size_t n) {
    size_t cur = inflight.load();
    do {
      if (n > cap || cur > cap - n) return false;
    } while (!inflight.compare_exchange_weak(cur, cur + n));
    return true;
  }
  void release(size_t n) {
    if (n == 0) return;
    const size_t before = inflight.fetch_sub(n);
    const size_t freed = freed_since_trim.fetch_add(n) + n;
    // Trim when nothing is in flight any more (the end of a burst), once enough was freed to matter.
    if (before == n && freed >= kTrimAfter && freed_since_trim.exchange(0) >= kTrimAfter) {
#if defined(__GLIBC__)
      malloc_trim(0);
#endif
    }
  }
};

// One request's share of the budget: grows while its body is read, released on destruction.
class BodyCharge {
 public:
  explicit BodyCharge(std::shared_ptr<BodyBudget> b) : budget_(std::move(b)) {}
  ~BodyCharge() { budget_->release(bytes_); }
  BodyCharge(const BodyCharge&) = delete;
  BodyCharge& operator=(const BodyCharge&) = delete;
  bool grow_to(size_t n) {
    if (n <= bytes_) return true;
    if (!budget_->try_add(n - bytes_)) return false;
    bytes_ = n;
    return true;
  }

 private:
  std::shared_ptr<BodyBudget> budget_;
  size_t bytes_ = 0;
};

}  // namespace

bool is_loopback_address(const std::string& host) {
  beast::error_code ec;
  const auto addr = net::ip::make_address(host, ec);
  return !ec && addr.is_loopback();
}

class Session;

struct HttpServer::Impl {
  HttpOptions opt;
  HttpHandler handler;
  net::io_context ioc;
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work;
  tcp::acceptor acceptor{ioc};
  std::vector<std::thread> threads;
  std::shared_ptr<std::atomic<int>> connections = std::make_shared<std::atomic<int>>(0);
  std::shared_ptr<BodyBudget> body_budget = std::make_shared<BodyBudget>();
  std::atomic<int64_t> last_refusal_log_ns{0};
  std::atomic<int64_t> refused_connections{0};
  std::mutex sessions_mu;
  std::list<std::weak_ptr<Session>> sessions;
  bool stopped = false;
  std::shared_ptr<std::atomic<bool>> draining = std::make_shared<std::atomic<bool>>(false);

  void do_accept();
  void refuse(tcp::socket& socket);
};

// One connection. Everything runs on its strand; HttpExchange objects post into it.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, HttpServer::Impl& srv)
      : stream_(std::move(socket)),
        opt_(srv.opt),
        handler_(srv.handler),
        connections_(srv.connections),
        draining_(srv.draining),
        budget_(srv.body_budget) {
    ++*connections_;
  }
  ~Session() { --*connections_; }

  void run() {
    beast::error_code ec;
    stream_.socket().set_option(tcp::no_delay(true), ec);
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->do_read(); });
  }

  // Closes now if idle, else after the reply in progress (once its queued output is written).
  // `stopping`: nothing will be added to an unfinished reply any more, so only what is queued is
  // written before the close.
  void close_when_done(bool stopping) {
    net::post(stream_.get_executor(), [self = shared_from_this(), stopping] {
      if (self->closed_) return;
      self->keep_alive_ = false;
      const bool idle = self->completed_ && !self->write_in_flight_;
      const bool abandoned = stopping && !self->end_requested_;
      if (idle || (abandoned && !self->write_in_flight_)) return self->close();
      if (abandoned) self->end_requested_ = true;  // close after the write in flight
    });
  }

  auto executor() { return stream_.get_executor(); }
  bool on_strand() {
    // target() points into the executor object: keep it alive while the pointer is used.
    const auto ex = stream_.get_executor();
    auto* strand = ex.target<net::strand<net::io_context::executor_type>>();
    return strand && strand->running_in_this_thread();
  }

  // ---- exchange operations (on the strand) -------------------------------------------------

  bool current(uint64_t seq) const { return seq == seq_ && !completed_; }

  void respond(uint64_t seq, int status, std::string body, const std::string& content_type,
               const std::vector<std::pair<std::string, std::string>>& headers) {
    if (!current(seq) || responded_) return;
    responded_ = true;
    std::string head = "HTTP/1.1 " + std::to_string(status) + " " + http_status_text(status) + "\r\n";
    head += "Content-Type: " + content_type + "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
    for (const auto& [k, v] : headers) head += k + ": " + v + "\r\n";
    head += keep_alive_ ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n";
    out_pending_ += head;
    if (!head_) out_pending_ += body;  // a HEAD reply has the GET reply's headers, no body
    end_requested_ = true;
    flush();
  }

  void start_stream(uint64_t seq, const std::string& content_type,
                    const std::vector<std::pair<std::string, std::string>>& headers) {
    if (!current(seq) || responded_) return;
    responded_ = streaming_ = true;
    // A stream needs little kernel buffer; a small one makes a client that stops reading visible
    // to back-pressure (HttpExchange::pending_bytes) after kilobytes, not after the autotuned megabytes.
    beast::error_code ec;
    stream_.socket().set_option(net::socket_base::send_buffer_size(128 << 10), ec);
    out_pending_ += "HTTP/1.1 200 OK\r\nContent-Type: " + content_type + "\r\nCache-Control: no-cache\r\nX-Accel-Buffering: no\r\n";
    for (const auto& [k, v] : headers) out_pending_ += k + ": " + v + "\r\n";
    if (http10_) {
      // HTTP/1.0 has no chunked coding: the body ends when the connection closes.
      close_delimited_ = true;
      keep_alive_ = false;
    } else {
      out_pending_ += "Transfer-Encoding: chunked\r\n";
    }
    out_pending_ += keep_alive_ ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n";
    last_write_ns_ = now_ns();
    flush();
  }

  void write(uint64_t seq, std::string_view data) {
    if (!current(seq) || !streaming_ || end_requested_ || data.empty() || head_) return;
    if (!close_delimited_) {
      char len[24];
      const int n = std::snprintf(len, sizeof len, "%zx\r\n", data.size());
      out_pending_.append(len, size_t(n));
    }
    out_pending_.append(data);
    if (!close_delimited_) out_pending_ += "\r\n";
    last_write_ns_ = now_ns();
    flush();
  }

  void end_stream(uint64_t seq) {
    if (!current(seq) || !streaming_ || end_requested_) return;
    if (!close_delimited_ && !head_) out_pending_ += "0\r\n\r\n";
    end_requested_ = true;
    flush();
  }

  void set_gone_callback(uint64_t seq, std::function<void()> cb) {
    if (seq != seq_) return;
    if (gone_) {
      if (cb) cb();
      return;
    }
    gone_cb_ = std::move(cb);
  }

  void add_timer(uint64_t seq, double seconds, std::function<void()> fn) {
    if (!current(seq)) return;
    auto timer = std::make_shared<net::steady_timer>(stream_.get_executor());
    timers_.push_back(timer);
    arm_timer(seq, timer, std::chrono::nanoseconds(int64_t(seconds * 1e9)), std::make_shared<std::function<void()>>(std::move(fn)));
  }

  bool gone() const { return gone_; }
  double idle_seconds() const { return double(now_ns() - last_write_ns_.load()) * 1e-9; }
  size_t pending_bytes() const { return posted_bytes_.load() + buffered_bytes_.load(); }
  // Bytes handed to write() from another thread, on their way to the strand.
  std::atomic<size_t> posted_bytes_{0};

 private:
  void arm_timer(uint64_t seq, std::shared_ptr<net::steady_timer> timer, std::chrono::nanoseconds period,
                 std::shared_ptr<std::function<void()>> fn) {
    timer->expires_after(period);
    timer->async_wait([self = shared_from_this(), seq, timer, period, fn](beast::error_code ec) {
      if (ec || !self->current(seq)) return;
      (*fn)();
      if (self->current(seq)) self->arm_timer(seq, timer, period, fn);
    });
  }

  // ---- reading a request -------------------------------------------------------------------

  void do_read() {
    if (closed_) return;
    if (buf_.size() == 0) buf_.shrink_to_fit();  // an idle connection holds no buffer
    head_ = http10_ = close_delimited_ = linger_ = false;
    parser_.emplace();
    parser_->body_limit(opt_.max_body_bytes);
    parser_->header_limit(std::uint32_t(std::min<size_t>(opt_.max_header_bytes, UINT32_MAX)));
    stream_.expires_after(std::chrono::milliseconds(int64_t(opt_.idle_timeout_s * 1000)));
    reading_ = true;
    http::async_read_header(stream_, buf_, *parser_, beast::bind_front_handler(&Session::on_header, shared_from_this()));
  }

  // Everything that can refuse the request is decided here, before any of its body is read.
  void on_header(beast::error_code ec, size_t) {
    reading_ = false;
    if (ec) return on_read_error(ec);
    const auto& req = parser_->get();
    keep_alive_ = req.keep_alive();
    http10_ = req.version() < 11;
    head_ = req.method() == http::verb::head;

    const auto te = req.find(http::field::transfer_encoding);
    if (te != req.end()) {
      const auto codings = transfer_codings(te->value());
      // Without chunked as the last coding (once) the body length is undetermined (RFC 9112 section 6.3): 400.
      bool framed = !codings.empty() && beast::iequals(codings.back(), "chunked");
      for (size_t i = 0; i + 1 < codings.size(); ++i) framed = framed && !beast::iequals(codings[i], "chunked");
      if (!framed)
        return send_error_and_close(400, error_json("malformed Transfer-Encoding '" + std::string(te->value()) +
                                                         "' (chunked must be the last coding)",
                                                     "bad_request"));
      // Codings under the chunked framing (gzip, deflate, ...) are not decoded: refuse, not ignore.
      if (codings.size() != 1)
        return send_error_and_close(501, error_json("unsupported Transfer-Encoding '" + std::string(te->value()) +
                                                        "' (only chunked is accepted)",
                                                    "unsupported_transfer_encoding"));
    }

    HttpHeaderView view;
    view.method = head_ ? std::string_view("GET") : std::string_view(req.method_string());
    view.target = target_path(req.target());
    view.authorization = req[http::field::authorization];
    view.origin = req[http::field::origin];
    if (auto cl = parser_->content_length()) view.content_length = *cl;
    view.chunked = parser_->chunked();
    if (opt_.header_check) {
      std::optional<HttpRejection> rejection;
      try {
        rejection = opt_.header_check(view);
      } catch (const std::exception& e) {
        spdlog::error("http: header check threw: {}", e.what());
        rejection = HttpRejection{500, error_json("internal error", "internal_error"), "application/json", {}};
      }
      if (rejection) return send_error_and_close(rejection->status, std::move(rejection->body), rejection->content_type, rejection->headers);
    }

    if (view.has_body()) {
      // Without room the parser reads a body a few hundred bytes per call.
      buf_.reserve(std::min<size_t>(kBodyReadBytes, view.content_length ? size_t(*view.content_length) : kBodyReadBytes));
      charge_ = std::make_shared<BodyCharge>(budget_);
      // A declared length is reserved whole (the body string reserves it); chunked bodies are charged as they grow.
      if (view.content_length && !charge_->grow_to(size_t(*view.content_length))) return refuse_busy();
    }

    auto expect = req.find(http::field::expect);
    if (expect != req.end() && beast::iequals(expect->value(), "100-continue") && view.has_body()) {
      static const std::string kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
      net::async_write(stream_, net::buffer(kContinue), [self = shared_from_this()](beast::error_code ec, size_t) {
        if (ec) return self->close();
        self->read_body();
      });
      return;
    }
    read_body();
  }

  void read_body() {
    if (closed_) return;  // closed during the 100 Continue write
    if (parser_->is_done()) return on_read({}, 0);
    reading_ = true;
    http::async_read_some(stream_, buf_, *parser_, beast::bind_front_handler(&Session::on_body_part, shared_from_this()));
  }

  void on_body_part(beast::error_code ec, size_t) {
    reading_ = false;
    if (ec) return on_read_error(ec);
    if (charge_ && !charge_->grow_to(parser_->get().body().capacity())) return refuse_busy();
    read_body();
  }

  void refuse_busy() {
    send_error_and_close(503,
                         error_json("server busy: too many request bytes in flight (--max-inflight-body-mib); retry shortly",
                                    "server_busy"),
                         "application/json", {{"Retry-After", "1"}});
  }

  void on_read_error(beast::error_code ec) {
    if (ec == http::error::body_limit) {
      // The rest of the body stays unread: answer, then close.
      return send_error_and_close(413, error_json("request body exceeds " + std::to_string(opt_.max_body_bytes) +
                                                       " bytes (--max-body-bytes)",
                                                   "request_too_large"));
    }
    if (ec == http::error::header_limit)
      return send_error_and_close(431, error_json("request headers exceed " + std::to_string(opt_.max_header_bytes) +
                                                       " bytes (--max-header-bytes)",
                                                   "headers_too_large"));
    if (ec.category() == http::make_error_code(http::error::end_of_stream).category() && ec != http::error::end_of_stream &&
        ec != http::error::partial_message) {
      return send_error_and_close(400, error_json("malformed HTTP request: " + ec.message(), "bad_request"));
    }
    release_body();
    close();
  }

  // Frees a partly read body and its share of the in-flight budget (the memory first). While a read
  // is in flight Beast still uses the parser when the read completes (cancelled by close()): its
  // handler releases them then.
  void release_body() {
    if (reading_) return;
    parser_.reset();
    charge_.reset();
  }

  // Answers without reading the rest of the request, then closes (after draining what the client still sends).
  void send_error_and_close(int status, std::string body, const std::string& content_type = "application/json",
                            const std::vector<std::pair<std::string, std::string>>& headers = {}) {
    release_body();
    stream_.expires_never();
    ++seq_;
    completed_ = false;
    responded_ = streaming_ = end_requested_ = false;
    keep_alive_ = false;
    linger_ = true;
    respond(seq_, status, std::move(body), content_type, headers);
  }

  void on_read(beast::error_code ec, size_t) {
    if (ec) return on_read_error(ec);
    stream_.expires_never();
    auto& msg = parser_->get();
    HttpRequest req;
    req.method = head_ ? "GET" : std::string(msg.method_string());
    req.head = head_;
    req.target = std::string(target_path(msg.target()));
    req.body = std::move(msg.body());
    req.body_lease = std::move(charge_);
    req.authorization = std::string(msg[http::field::authorization]);
    req.content_type = std::string(msg[http::field::content_type]);
    req.origin = std::string(msg[http::field::origin]);
    req.keep_alive = keep_alive_ = msg.keep_alive() && !*draining_;
    parser_.reset();

    ++seq_;
    completed_ = responded_ = streaming_ = end_requested_ = gone_ = false;
    gone_cb_ = nullptr;
    last_write_ns_ = now_ns();
    auto exchange = make_exchange();
    try {
      handler_(std::move(req), exchange);
    } catch (const std::exception& e) {
      spdlog::error("http: handler threw: {}", e.what());
      respond(seq_, 500, error_json("internal error", "internal_error"), "application/json", {});
    }
    if (!completed_ && !end_requested_) watch_disconnect(seq_);
  }

 public:
  std::shared_ptr<HttpExchange> make_exchange();

 private:
  // While a reply is pending, a readable socket means EOF (client gone) or a pipelined request.
  void watch_disconnect(uint64_t seq) {
    watching_ = true;
    stream_.socket().async_wait(tcp::socket::wait_read, [self = shared_from_this(), seq](beast::error_code ec) {
      if (ec || !self->current(seq)) return;
      char c;
      const ssize_t n = ::recv(self->stream_.socket().native_handle(), &c, 1, MSG_PEEK | MSG_DONTWAIT);
      if (n > 0) {
        self->watching_ = false;  // pipelined data: read after this reply
        return;
      }
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return self->watch_disconnect(seq);
      self->mark_gone();
      self->close();
    });
  }

  // ---- writing -----------------------------------------------------------------------------

  void sync_buffered() { buffered_bytes_ = out_pending_.size() + out_writing_.size(); }

  void mark_gone() {
    if (gone_) return;
    gone_ = true;
    keep_alive_ = false;
    out_pending_.clear();
    sync_buffered();
    if (auto cb = std::move(gone_cb_)) cb();
    if (end_requested_ && !write_in_flight_) complete();
  }

  void flush() {
    sync_buffered();
    if (write_in_flight_ || closed_) return;
    if (gone_) {
      out_pending_.clear();
      sync_buffered();
      if (end_requested_) complete();
      return;
    }
    if (out_pending_.empty()) {
      if (end_requested_) complete();
      return;
    }
    out_writing_.clear();
    out_writing_.swap(out_pending_);
    write_in_flight_ = true;
    // A client that stops reading stalls the write: past the timeout it counts as gone.
    if (opt_.write_timeout_s > 0)
      stream_.expires_after(std::chrono::milliseconds(int64_t(opt_.write_timeout_s * 1000)));
    else
      stream_.expires_never();
    net::async_write(stream_, net::buffer(out_writing_), [self = shared_from_this()](beast::error_code ec, size_t) {
      self->write_in_flight_ = false;
      self->out_writing_.clear();
      if (ec) {
        if (ec == beast::error::timeout)
          spdlog::info("http: client did not read its reply for {} s (--write-timeout): closing", self->opt_.write_timeout_s);
        self->mark_gone();
        return self->close();
      }
      self->stream_.expires_never();
      self->flush();
    });
  }

  void complete() {
    if (completed_) return;
    completed_ = true;
    for (auto& t : timers_) t->cancel();
    timers_.clear();
    gone_cb_ = nullptr;
    if (watching_) {
      watching_ = false;
      beast::error_code ec;
      stream_.socket().cancel(ec);
    }
    if (keep_alive_ && !gone_) {
      do_read();
    } else if (linger_ && !gone_) {
      linger_close();
    } else {
      close();
    }
  }

  // After an early error reply the client may still be sending its body: closing with unread data
  // would reset the connection and could destroy the reply before the client reads it. Stop sending,
  // discard what arrives for a short while, then close.
  void linger_close() {
    if (closed_) return;
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
    if (ec) return close();
    discard_ = std::make_unique<char[]>(kDiscardBytes);
    stream_.expires_after(std::chrono::milliseconds(kLingerMs));
    drain();
  }

  void drain() {
    stream_.async_read_some(net::buffer(discard_.get(), kDiscardBytes), [self = shared_from_this()](beast::error_code ec, size_t) {
      if (ec || self->closed_) return self->close();
      self->drain();
    });
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    completed_ = true;
    for (auto& t : timers_) t->cancel();
    timers_.clear();
    release_body();
    discard_.reset();
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
    stream_.socket().close(ec);
    if (!gone_) {
      gone_ = true;
      if (auto cb = std::move(gone_cb_)) cb();
    }
  }

  static constexpr size_t kDiscardBytes = 16 * 1024;
  static constexpr size_t kBodyReadBytes = 64 * 1024;
  static constexpr int kLingerMs = 2000;

  beast::tcp_stream stream_;
  beast::flat_buffer buf_;
  std::shared_ptr<BodyCharge> charge_;  // before parser_: the body is freed before its charge is released
  std::optional<http::request_parser<http::string_body>> parser_;
  bool reading_ = false;  // a Beast read into parser_ is in flight
  HttpOptions opt_;
  HttpHandler handler_;
  std::shared_ptr<std::atomic<int>> connections_;
  std::shared_ptr<std::atomic<bool>> draining_;
  std::shared_ptr<BodyBudget> budget_;

  uint64_t seq_ = 0;
  bool keep_alive_ = true, completed_ = true, responded_ = false, streaming_ = false, end_requested_ = false;
  bool write_in_flight_ = false, closed_ = false, watching_ = false;
  std::atomic<bool> gone_{false};  // read by client_gone() from any thread
  bool head_ = false, http10_ = false, close_delimited_ = false, linger_ = false;
  std::string out_pending_, out_writing_;
  std::atomic<size_t> buffered_bytes_{0};
  std::unique_ptr<char[]> discard_;
  std::function<void()> gone_cb_;
  std::vector<std::shared_ptr<net::steady_timer>> timers_;
  std::atomic<int64_t> last_write_ns_{0};
};

namespace {

class Exchange : public HttpExchange {
 public:
  Exchange(std::shared_ptr<Session> s, uint64_t seq) : s_(std::move(s)), seq_(seq) {}

  void respond(int status, std::string body, std::string content_type,
               std::vector<std::pair<std::string, std::string>> headers) override {
    net::dispatch(s_->executor(), [s = s_, seq = seq_, status, body = std::move(body), ct = std::move(content_type),
                                   h = std::move(headers)]() mutable { s->respond(seq, status, std::move(body), ct, h); });
  }
  void start_stream(std::string content_type, std::vector<std::pair<std::string, std::string>> headers) override {
    net::dispatch(s_->executor(), [s = s_, seq = seq_, ct = std::move(content_type), h = std::move(headers)] {
      s->start_stream(seq, ct, h);
    });
  }
  void write(std::string_view data) override {
    if (s_->on_strand()) return s_->write(seq_, data);
    s_->posted_bytes_ += data.size();
    net::post(s_->executor(), [s = s_, seq = seq_, d = std::string(data)] {
      s->write(seq, d);
      s->posted_bytes_ -= d.size();
    });
  }
  void end_stream() override {
    net::dispatch(s_->executor(), [s = s_, seq = seq_] { s->end_stream(seq); });
  }
  void on_client_gone(std::function<void()> cb) override {
    net::dispatch(s_->executor(), [s = s_, seq = seq_, cb = std::move(cb)]() mutable { s->set_gone_callback(seq, std::move(cb)); });
  }
  void post(std::function<void()> fn) override { net::post(s_->executor(), std::move(fn)); }
  bool client_gone() const override { return s_->gone(); }
  double idle_seconds() const override { return s_->idle_seconds(); }
  void every(double seconds, std::function<void()> fn) override {
    net::dispatch(s_->executor(), [s = s_, seq = seq_, seconds, fn = std::move(fn)]() mutable { s->add_timer(seq, seconds, std::move(fn)); });
  }
  size_t pending_bytes() const override { return s_->pending_bytes(); }

 private:
  std::shared_ptr<Session> s_;
  uint64_t seq_;
};

}  // namespace

std::shared_ptr<HttpExchange> Session::make_exchange() { return std::make_shared<Exchange>(shared_from_this(), seq_); }

void HttpServer::Impl::do_accept() {
  acceptor.async_accept(net::make_strand(ioc), [this](beast::error_code ec, tcp::socket socket) {
    if (ec) {
      if (ec == net::error::operation_aborted || !acceptor.is_open()) return;
      spdlog::warn("http: accept failed: {}", ec.message());
      if (ec == net::error::no_descriptors) {
        // Out of file descriptors: back off instead of spinning.
        auto t = std::make_shared<net::steady_timer>(ioc, std::chrono::milliseconds(100));
        t->async_wait([this, t](beast::error_code) { do_accept(); });
        return;
      }
    } else if (connections->load() >= opt.max_connections) {
      refuse(socket);
    } else {
      auto s = std::make_shared<Session>(std::move(socket), *this);
      {
        std::lock_guard lk(sessions_mu);
        for (auto it = sessions.begin(); it != sessions.end();) it = it->expired() ? sessions.erase(it) : std::next(it);
        sessions.push_back(s);
      }
      s->run();
    }
    do_accept();
  });
}

// Over the connection cap: a canned 503 if the socket takes it at once, then close. No session,
// no buffer, no wait.
void HttpServer::Impl::refuse(tcp::socket& socket) {
  static const std::string k503 = [] {
    const std::string body = error_json("server busy: too many open connections (--max-connections); retry shortly", "server_busy");
    return "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
           "\r\nRetry-After: 1\r\nConnection: close\r\n\r\n" + body;
  }();
  (void)::send(socket.native_handle(), k503.data(), k503.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  beast::error_code ec;
  socket.shutdown(tcp::socket::shutdown_send, ec);
  socket.close(ec);
  const int64_t n = ++refused_connections;
  const int64_t now = now_ns();
  int64_t last = last_refusal_log_ns.load();
  if (now - last > int64_t(5e9) && last_refusal_log_ns.compare_exchange_strong(last, now))
    spdlog::warn("http: {} open connections (--max-connections): refusing new ones ({} refused so far)", opt.max_connections, n);
}

HttpServer::HttpServer(HttpOptions options, HttpHandler handler) : impl_(std::make_unique<Impl>()) {
  impl_->opt = std::move(options);
  impl_->handler = std::move(handler);
  impl_->body_budget->cap = impl_->opt.max_inflight_body_bytes;
}

HttpServer::~HttpServer() { stop(); }

void HttpServer::start() {
  Impl& m = *impl_;
  beast::error_code ec;
  const auto addr = net::ip::make_address(m.opt.host, ec);
  if (ec) throw std::runtime_error("--host '" + m.opt.host + "': not an IP address (" + ec.message() + ")");
  const tcp::endpoint ep(addr, m.opt.port);
  m.acceptor.open(ep.protocol(), ec);
  if (!ec) m.acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) m.acceptor.bind(ep, ec);
  if (!ec) m.acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) throw std::runtime_error("cannot listen on " + m.opt.host + ":" + std::to_string(m.opt.port) + ": " + ec.message());
  m.work.emplace(m.ioc.get_executor());
  m.do_accept();
  const int n = std::max(1, m.opt.io_threads);
  for (int i = 0; i < n; ++i) m.threads.emplace_back([&m] { m.ioc.run(); });
}

uint16_t HttpServer::port() const {
  beast::error_code ec;
  auto ep = impl_->acceptor.local_endpoint(ec);
  return ec ? 0 : ep.port();
}

int HttpServer::open_connections() const { return impl_->connections->load(); }

void HttpServer::stop_accepting() {
  Impl& m = *impl_;
  if (m.stopped || m.threads.empty() || m.draining->exchange(true)) return;
  net::post(m.acceptor.get_executor(), [&m] {
    beast::error_code ec;
    m.acceptor.close(ec);
  });
  std::lock_guard lk(m.sessions_mu);
  for (auto& w : m.sessions)
    if (auto s = w.lock()) s->close_when_done(false);
}

void HttpServer::stop() {
  Impl& m = *impl_;
  if (m.stopped || m.threads.empty()) return;
  m.stopped = true;
  *m.draining = true;
  net::post(m.acceptor.get_executor(), [&m] {
    beast::error_code ec;
    m.acceptor.close(ec);
  });
  {
    std::lock_guard lk(m.sessions_mu);
    for (auto& w : m.sessions)
      if (auto s = w.lock()) s->close_when_done(true);
  }
  m.work.reset();
  // Connections close quickly; a bounded wait keeps a wedged peer from blocking shutdown.
  std::mutex mu;
  std::condition_variable cv;
  bool joined = false;
  std::thread watchdog([&] {
    std::unique_lock lk(mu);
    if (!cv.wait_for(lk, std::chrono::seconds(3), [&] { return joined; })) m.ioc.stop();
  });
  for (auto& t : m.threads) t.join();
  {
    std::lock_guard lk(mu);
    joined = true;
  }
  cv.notify_all();
  watchdog.join();
  m.threads.clear();
}

}  // namespace di::server
