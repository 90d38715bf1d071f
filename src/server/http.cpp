#include "server/http.h"

#include <sys/socket.h>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
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

}  // namespace

class Session;

struct HttpServer::Impl {
  HttpOptions opt;
  HttpHandler handler;
  net::io_context ioc;
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work;
  tcp::acceptor acceptor{ioc};
  std::vector<std::thread> threads;
  std::shared_ptr<std::atomic<int>> connections = std::make_shared<std::atomic<int>>(0);
  std::mutex sessions_mu;
  std::list<std::weak_ptr<Session>> sessions;
  bool stopped = false;
  std::shared_ptr<std::atomic<bool>> draining = std::make_shared<std::atomic<bool>>(false);

  void do_accept();
};

// One connection. Everything runs on its strand; HttpExchange objects post into it.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, HttpServer::Impl& srv)
      : stream_(std::move(socket)), opt_(srv.opt), handler_(srv.handler), connections_(srv.connections), draining_(srv.draining) {
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
    auto* strand = stream_.get_executor().target<net::strand<net::io_context::executor_type>>();
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
    out_pending_ += body;
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
    out_pending_ += "HTTP/1.1 200 OK\r\nContent-Type: " + content_type +
                    "\r\nCache-Control: no-cache\r\nX-Accel-Buffering: no\r\nTransfer-Encoding: chunked\r\n";
    for (const auto& [k, v] : headers) out_pending_ += k + ": " + v + "\r\n";
    out_pending_ += keep_alive_ ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n";
    last_write_ns_ = now_ns();
    flush();
  }

  void write(uint64_t seq, std::string_view data) {
    if (!current(seq) || !streaming_ || end_requested_ || data.empty()) return;
    char len[24];
    const int n = std::snprintf(len, sizeof len, "%zx\r\n", data.size());
    out_pending_.append(len, size_t(n));
    out_pending_.append(data);
    out_pending_ += "\r\n";
    last_write_ns_ = now_ns();
    flush();
  }

  void end_stream(uint64_t seq) {
    if (!current(seq) || !streaming_ || end_requested_) return;
    out_pending_ += "0\r\n\r\n";
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
  size_t pending_bytes() const { return out_pending_.size() + (write_in_flight_ ? out_writing_.size() : 0); }
  double idle_seconds() const { return double(now_ns() - last_write_ns_.load()) * 1e-9; }

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

  void do_read() {
    if (closed_) return;
    parser_.emplace();
    parser_->body_limit(opt_.max_body_bytes);
    parser_->header_limit(64 * 1024);
    stream_.expires_after(std::chrono::milliseconds(int64_t(opt_.idle_timeout_s * 1000)));
    http::async_read_header(stream_, buf_, *parser_, beast::bind_front_handler(&Session::on_header, shared_from_this()));
  }

  void on_header(beast::error_code ec, size_t) {
    if (ec) return on_read_error(ec);
    const auto& req = parser_->get();
    keep_alive_ = req.keep_alive();
    auto expect = req.find(http::field::expect);
    if (expect != req.end() && beast::iequals(expect->value(), "100-continue")) {
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
    http::async_read(stream_, buf_, *parser_, beast::bind_front_handler(&Session::on_read, shared_from_this()));
  }

  void on_read_error(beast::error_code ec) {
    if (ec == http::error::body_limit) {
      // The rest of the body stays unread: answer, then close.
      return send_transport_error(413, "request body exceeds " + std::to_string(opt_.max_body_bytes) + " bytes (--max-body-bytes)",
                                  "request_too_large");
    }
    if (ec == http::error::header_limit) return send_transport_error(431, "request headers too large", "headers_too_large");
    if (ec.category() == http::make_error_code(http::error::end_of_stream).category() && ec != http::error::end_of_stream &&
        ec != http::error::partial_message) {
      return send_transport_error(400, "malformed HTTP request: " + ec.message(), "bad_request");
    }
    close();
  }

  void send_transport_error(int status, const std::string& message, const char* code) {
    ++seq_;
    completed_ = false;
    responded_ = streaming_ = end_requested_ = false;
    keep_alive_ = false;
    respond(seq_, status, error_json(message, code), "application/json", {});
  }

  void on_read(beast::error_code ec, size_t) {
    if (ec) return on_read_error(ec);
    stream_.expires_never();
    auto& msg = parser_->get();
    HttpRequest req;
    req.method = std::string(msg.method_string());
    const std::string_view target = msg.target();
    req.target = std::string(target.substr(0, target.find('?')));
    req.body = std::move(msg.body());
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

  std::shared_ptr<HttpExchange> make_exchange();

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

  void mark_gone() {
    if (gone_) return;
    gone_ = true;
    keep_alive_ = false;
    out_pending_.clear();
    if (auto cb = std::move(gone_cb_)) cb();
    if (end_requested_ && !write_in_flight_) complete();
  }

  void flush() {
    if (write_in_flight_ || closed_) return;
    if (gone_) {
      out_pending_.clear();
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
    net::async_write(stream_, net::buffer(out_writing_), [self = shared_from_this()](beast::error_code ec, size_t) {
      self->write_in_flight_ = false;
      if (ec) {
        self->mark_gone();
        return self->close();
      }
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
    } else {
      close();
    }
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    completed_ = true;
    for (auto& t : timers_) t->cancel();
    timers_.clear();
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
    stream_.socket().close(ec);
    if (!gone_) {
      gone_ = true;
      if (auto cb = std::move(gone_cb_)) cb();
    }
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buf_;
  std::optional<http::request_parser<http::string_body>> parser_;
  HttpOptions opt_;
  HttpHandler handler_;
  std::shared_ptr<std::atomic<int>> connections_;
  std::shared_ptr<std::atomic<bool>> draining_;

  uint64_t seq_ = 0;
  bool keep_alive_ = true, completed_ = true, responded_ = false, streaming_ = false, end_requested_ = false;
  bool write_in_flight_ = false, gone_ = false, closed_ = false, watching_ = false;
  std::string out_pending_, out_writing_;
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
    net::post(s_->executor(), [s = s_, seq = seq_, d = std::string(data)] { s->write(seq, d); });
  }
  void end_stream() override {
    net::dispatch(s_->executor(), [s = s_, seq = seq_] { s->end_stream(seq); });
  }
  void on_client_gone(std::function<void()> cb) override {
    net::dispatch(s_->executor(), [s = s_, seq = seq_, cb = std::move(cb)]() mutable { s->set_gone_callback(seq, std::move(cb)); });
  }
  void post(std::function<void()> fn) override { net::post(s_->executor(), std::move(fn)); }
  bool client_gone() const override { return s_->gone(); }
  size_t pending_bytes() const override { return s_->pending_bytes(); }
  double idle_seconds() const override { return s_->idle_seconds(); }
  void every(double seconds, std::function<void()> fn) override {
    net::dispatch(s_->executor(), [s = s_, seq = seq_, seconds, fn = std::move(fn)]() mutable { s->add_timer(seq, seconds, std::move(fn)); });
  }

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

HttpServer::HttpServer(HttpOptions options, HttpHandler handler) : impl_(std::make_unique<Impl>()) {
  impl_->opt = std::move(options);
  impl_->handler = std::move(handler);
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
