// Asynchronous HTTP/1.1 server on Boost.Beast/Asio: a few io threads serve many keep-alive
// connections; each connection runs on its own strand. A response is either complete (status + body)
// or a stream (SSE) written piece by piece from any thread: chunked for HTTP/1.1 clients,
// close-delimited for HTTP/1.0 ones.
//
// Resource limits for untrusted clients: open connections, header size, body size per request and
// in flight over all connections, and a header-stage check (e.g. authentication) that can refuse a
// request before any of its body is read. HEAD is served as GET without the body.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace di::server {

struct HttpRequest {
  // Holds this request's share of the in-flight body budget; declared first so that it is released
  // after `body` is freed.
  std::shared_ptr<const void> body_lease;
  std::string method;  // "GET", "POST", ... (a HEAD request arrives as "GET" with head = true)
  std::string target;  // path without the query string (also for absolute-form targets)
  std::string body;
  std::string authorization;  // the Authorization header ("" if absent)
  std::string content_type;
  std::string origin;  // the Origin header ("" if absent), for CORS
  bool keep_alive = true;
  bool head = false;  // the reply's body is not sent (its headers, Content-Length included, are)
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
  // Seconds since the last byte was queued for the stream (for keep-alive comments).
  virtual double idle_seconds() const = 0;
  // Runs `fn` on the strand every `seconds` until the exchange completes.
  virtual void every(double seconds, std::function<void()> fn) = 0;
  // Bytes of the reply accepted by write()/respond() but not yet handed to the socket (for
  // back-pressure: a client that does not read makes this grow). Callable from any thread.
  virtual size_t pending_bytes() const = 0;
};

using HttpHandler = std::function<void(HttpRequest&&, std::shared_ptr<HttpExchange>)>;

// What the header-stage check sees: the request line and the fields it may decide on, before the body.
struct HttpHeaderView {
  std::string_view method;  // as HttpRequest::method (HEAD shows as GET)
  std::string_view target;  // path without the query string
  std::string_view authorization;
  std::string_view origin;  // for CORS headers on a rejection
  std::optional<uint64_t> content_length;
  bool chunked = false;
  bool has_body() const { return chunked || (content_length && *content_length > 0); }
};

// A reply that ends the request at the header stage; the connection is closed without reading the body.
struct HttpRejection {
  int status = 400;
  std::string body;
  std::string content_type = "application/json";
  std::vector<std::pair<std::string, std::string>> headers;
};

using HttpHeaderCheck = std::function<std::optional<HttpRejection>(const HttpHeaderView&)>;

struct HttpOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 8000;  // 0 = any free port
  int io_threads = 2;
  size_t max_body_bytes = size_t(8) << 20;         // per request (413 beyond)
  size_t max_header_bytes = 16 * 1024;             // request line + fields (431 beyond)
  size_t max_inflight_body_bytes = size_t(256) << 20;  // bodies being received or held, all connections (503 beyond)
  int max_connections = 1024;                      // open connections; more are answered 503 and closed
  double idle_timeout_s = 120;  // keep-alive connection waiting for its next request
  double write_timeout_s = 30;  // queued reply bytes not drained for this long: the client is gone (0 = never)
  // Runs on the io thread once a request's header is read; a rejection is sent instead of reading the body.
  HttpHeaderCheck header_check;
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

// True for an address that only this host can reach (127.0.0.0/8, ::1). False for wildcard binds
// (0.0.0.0, ::), other addresses, and strings that are not addresses.
bool is_loopback_address(const std::string& host);

}  // namespace di::server
