// Asynchronous HTTP/1.1 server on Boost.Beast/Asio: a few io threads serve any number of
// keep-alive connections; each connection runs on its own strand. A response is either complete
// (status + body) or a chunked stream (SSE) written piece by piece from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace di::server {

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string target;  // path without the query string
  std::string body;
  std::string authorization;  // the Authorization header ("" if absent)
  std::string content_type;
  std::string origin;  // the Origin header ("" if absent), for CORS
  bool keep_alive = true;
};

// One request's reply channel. All methods are thread-safe (they post to the connection's strand).
// Exactly one of respond() / start_stream() is called; a stream ends with end_stream().
class HttpExchange {
 public:
  virtual ~HttpExchange() = default;
  virtual void respond(int status, std::string body, std::string content_type = "application/json",
                       std::vector<std::pair<std::string, std::string>> headers = {}) = 0;
  virtual void start_stream(std::string content_type, std::vector<std::pair<std::string, std::string>> headers = {}) = 0;
  // Queues `data` for the stream; writes are coalesced while one is in flight.
  virtual void write(std::string_view data) = 0;
  virtual void end_stream() = 0;
  // Called once, on the connection's strand, if the client closes the connection before the reply is
  // complete. Set it before submitting work.
  virtual void on_client_gone(std::function<void()> callback) = 0;
  // Runs `fn` on the connection's strand (serializes with the exchange's own callbacks).
  virtual void post(std::function<void()> fn) = 0;
  virtual bool client_gone() const = 0;
  // Bytes queued for the client and not yet accepted by the socket (back-pressure). Call on the
  // connection's strand.
  virtual size_t pending_bytes() const = 0;
  // Seconds since the last byte was queued for the stream (for keep-alive comments).
  virtual double idle_seconds() const = 0;
  // Runs `fn` on the strand every `seconds` until the exchange completes.
  virtual void every(double seconds, std::function<void()> fn) = 0;
};

using HttpHandler = std::function<void(HttpRequest&&, std::shared_ptr<HttpExchange>)>;

struct HttpOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 8000;  // 0 = any free port
  int io_threads = 2;
  size_t max_body_bytes = size_t(8) << 20;
  double idle_timeout_s = 120;  // keep-alive connection waiting for its next request
};

class HttpServer {
 public:
  HttpServer(HttpOptions options, HttpHandler handler);
  ~HttpServer();
  // Binds and listens (throws std::runtime_error naming host:port on failure), then starts the io threads.
  void start();
  uint16_t port() const;
  // Graceful drain, first half: closes the listener and idle keep-alive connections; connections
  // with a reply in progress close once it is written. Requests already being served go on.
  void stop_accepting();
  // Stops accepting, closes connections once their queued output is written (bounded wait), joins
  // the io threads.
  void stop();
  int open_connections() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// The standard reason phrase ("Not Found").
const char* http_status_text(int status);

}  // namespace di::server
