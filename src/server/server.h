// The OpenAI-compatible server: routes, authentication, model loading in the background, metrics.
// `deepinfer serve` wires it to a loaded model; tests may hand it any engine::Engine.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "server/http.h"
#include "server/metrics.h"
#include "openai/api.h"
#include "server/worker_pool.h"

namespace di::server {

struct ServerOptions {
  HttpOptions http;
  std::string api_key;             // "" = no authentication
  std::string served_model_name;   // the `model` clients must name
  std::optional<chat::ChatFormat> chat_format;  // unset: the loaded model's own format
  bool default_thinking = false;
  int default_max_tokens = 1024;
  int max_n = 16;
  double sse_keepalive_s = 15;     // ": keep-alive" comment after this long without output; 0 = off
  bool test_hooks = false;         // accept the `test_forced_output` request field
  double shutdown_timeout_s = 20;  // drain: how long running requests may go on after SIGTERM
  JsonLimits json_limits;          // request bodies: nesting depth and keys per object (400 beyond)
  int parse_threads = 2;           // workers that parse requests and render prompts (off the io threads)
  size_t parse_queue = 1024;       // requests waiting for a parse worker (503 beyond); bursts of small requests need room
  std::vector<std::string> allowed_origins;  // CORS: origins answered with Access-Control-Allow-Origin ("*" = any); none = no CORS
};

// What the loader produces. model.served_name / chat_format / limits are filled from ServerOptions.
struct LoadedModel {
  std::shared_ptr<engine::Engine> engine;
  openai::ModelContext model;
};
// Runs on the loader thread. `cancel` turns true when the server stops before the load is done: a
// long load should check it and give up (throwing anything); a result returned anyway is dropped.
using ModelLoader = std::function<LoadedModel(const std::atomic<bool>& cancel)>;

class Server {
 public:
  Server(ServerOptions options, ModelLoader loader);
  ~Server();
  // Starts listening, then loads the model on a background thread (/health answers 503 meanwhile).
  void start();
  uint16_t port() const { return http_->port(); }
  bool ready() const { return state_.load() == State::Ready; }
  bool failed() const { return state_.load() == State::Failed; }
  std::string load_error() const;
  // Graceful shutdown, first half: stops accepting connections and requests (new ones get 503);
  // requests already accepted go on. drained() turns true when none is left.
  void begin_drain();
  bool drained() const;
  // Shuts the engine down: requests still running end with an OpenAI error (a 503 object, or an
  // error event that ends the stream); then closes connections once their replies are written.
  // While the model is still loading, asks the loader to stop and waits for it.
  void stop();

  void handle(HttpRequest&& req, std::shared_ptr<HttpExchange> ex);
  // The HTTP layer's header-stage check: authentication of requests with a body.
  std::optional<HttpRejection> check_headers(const HttpHeaderView& h);

 private:
  enum class State { Loading, Ready, Failed, Draining, Stopped };
  void respond_error(HttpExchange& ex, const std::string& endpoint, const openai::ApiError& e);
  std::vector<std::pair<std::string, std::string>> cors_headers(std::string_view origin) const;
  std::optional<openai::ApiError> check_key(std::string_view target, std::string_view authorization) const;
  // Runs `job` on a parse worker; answers 503 itself when the queue is full.
  void offload(HttpExchange& ex, const std::string& endpoint, std::function<void()> job);

  ServerOptions opt_;
  ModelLoader loader_;
  std::unique_ptr<HttpServer> http_;
  Metrics metrics_;
  std::atomic<State> state_{State::Loading};
  mutable std::mutex mu_;
  std::shared_ptr<const struct ServingContext> serving_;  // set once loaded
  std::string load_error_;
  std::atomic<bool> cancel_load_{false};
  std::thread loader_thread_;
  std::unique_ptr<WorkerPool> workers_;
};

// The deepinfer version this binary was built as (CMake's project version).
const char* version_string();

// Equal-length-independent comparison that does not stop at the first difference.
bool constant_time_equal(const std::string& a, const std::string& b);

}  // namespace di::server
