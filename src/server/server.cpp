#include "server/server.h"

#include <chrono>
#include <thread>
#include <variant>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "server/generation.h"

namespace di::server {

bool constant_time_equal(const std::string& a, const std::string& b) {
  const size_t n = std::max(a.size(), b.size());
  volatile unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff = diff | (x ^ y);
  }
  return diff == 0;
}

Server::Server(ServerOptions options, ModelLoader loader) : opt_(std::move(options)), loader_(std::move(loader)) {
  HttpOptions http = opt_.http;
  http.header_check = [this](const HttpHeaderView& h) { return check_headers(h); };
  http_ = std::make_unique<HttpServer>(http, [this](HttpRequest&& req, std::shared_ptr<HttpExchange> ex) {
    handle(std::move(req), std::move(ex));
  });
}

Server::~Server() { stop(); }

std::string Server::load_error() const {
  std::lock_guard lk(mu_);
  return load_error_;
}

void Server::start() {
  workers_ = std::make_unique<WorkerPool>(opt_.parse_threads, opt_.parse_queue);
  http_->start();
  spdlog::info("listening on http://{}:{} ({} io threads)", opt_.http.host, http_->port(), opt_.http.io_threads);
  loader_thread_ = std::thread([this] {
    try {
      LoadedModel lm = loader_(cancel_load_);
      if (cancel_load_) {
        spdlog::info("model loaded after shutdown was requested: not serving it");
        return;
      }
      auto ctx = std::make_shared<ServingContext>();
      ctx->engine = std::move(lm.engine);
      ctx->model = std::move(lm.model);
      ctx->model.served_name = opt_.served_model_name;
      if (opt_.chat_format) ctx->model.chat_format = *opt_.chat_format;
      ctx->model.default_thinking = opt_.default_thinking;
      ctx->model.default_max_tokens = opt_.default_max_tokens;
      ctx->model.max_n = opt_.max_n;
      ctx->model.test_hooks = opt_.test_hooks;
      ctx->model.json_limits = opt_.json_limits;
      // Masks span the model's logits (which may exceed the tokenizer's ids); test-double engines
      // have no model, and no grammar reaches them.
      int32_t logits = ctx->model.vocab_size;
      try {
        logits = int32_t(ctx->engine->model().info().vocab_size);
      } catch (const std::logic_error&) {
      }
      openai::attach_grammar_compilers(ctx->model, logits);
      ctx->metrics = &metrics_;
      ctx->sse_keepalive_s = opt_.sse_keepalive_s;
      ctx->shutdown_timeout_s = opt_.shutdown_timeout_s;
      {
        std::lock_guard lk(mu_);
        serving_ = std::move(ctx);
      }
      State expected = State::Loading;
      if (state_.compare_exchange_strong(expected, State::Ready)) spdlog::info("model ready: serving '{}'", opt_.served_model_name);
    } catch (const std::exception& e) {
      if (cancel_load_) {
        spdlog::info("model loading stopped: {}", e.what());
        return;
      }
      {
        std::lock_guard lk(mu_);
        load_error_ = e.what();
      }
      state_ = State::Failed;
      spdlog::error("model loading failed: {}", e.what());
    }
  });
}

void Server::begin_drain() {
  State expected = State::Ready;
  if (!state_.compare_exchange_strong(expected, State::Draining)) return;
  int active = 0;
  {
    std::lock_guard lk(mu_);
    if (serving_) active = serving_->active_generations.load();
  }
  spdlog::info("draining: no new connections or requests; {} in flight", active);
  http_->stop_accepting();
}

bool Server::drained() const {
  if (workers_ && workers_->pending() > 0) return false;  // accepted requests still being parsed
  std::lock_guard lk(mu_);
  return !serving_ || serving_->active_generations.load() == 0;
}

void Server::stop() {
  cancel_load_ = true;
  if (loader_thread_.joinable()) loader_thread_.join();
  std::shared_ptr<const ServingContext> ctx;
  {
    std::lock_guard lk(mu_);
    ctx = serving_;
  }
  state_ = State::Stopped;
  if (ctx && ctx->engine) {
    ctx->shutting_down = true;
    ctx->engine->shutdown();
  }
  if (workers_) workers_->stop();  // what is queued finishes (against the stopped engine: 503s)
  if (ctx) {
    // The engine's last events reach the requests on their connections' strands: let them write
    // their error replies before the connections close.
    for (int i = 0; i < 200 && ctx->active_generations.load() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (int left = ctx->active_generations.load(); left > 0) spdlog::warn("stop: {} requests had not finished their replies", left);
  }
  if (http_) http_->stop();
}

void Server::respond_error(HttpExchange& ex, const std::string& endpoint, const openai::ApiError& e) {
  metrics_.count_request(endpoint, e.status);
  ex.respond(e.status, openai::error_body(e), "application/json", e.headers);
}

void Server::offload(HttpExchange& ex, const std::string& endpoint, std::function<void()> job) {
  if (workers_ && workers_->try_submit(std::move(job))) return;
  openai::ApiError e;
  e.status = 503;
  e.type = "server_error";
  e.code = "server_overloaded";
  e.message = "the server is overloaded: " + std::to_string(opt_.parse_queue) +
              " requests are already waiting to be parsed (--parse-queue); retry shortly";
  e.headers.emplace_back("Retry-After", "1");
  respond_error(ex, endpoint, e);
}

namespace {

// Adds headers (CORS) to whichever response goes out. (HEAD is the HTTP layer's: it arrives as GET
// and the body is dropped there.)
class ResponseFilter : public HttpExchange {
 public:
  ResponseFilter(std::shared_ptr<HttpExchange> inner, std::vector<std::pair<std::string, std::string>> headers)
      : inner_(std::move(inner)), headers_(std::move(headers)) {}
  void respond(int status, std::string body, std::string content_type,
               std::vector<std::pair<std::string, std::string>> headers) override {
    headers.insert(headers.end(), headers_.begin(), headers_.end());
    inner_->respond(status, std::move(body), std::move(content_type), std::move(headers));
  }
  void start_stream(std::string content_type, std::vector<std::pair<std::string, std::string>> headers) override {
    headers.insert(headers.end(), headers_.begin(), headers_.end());
    inner_->start_stream(std::move(content_type), std::move(headers));
  }
  void write(std::string_view data) override { inner_->write(data); }
  void end_stream() override { inner_->end_stream(); }
  void on_client_gone(std::function<void()> callback) override { inner_->on_client_gone(std::move(callback)); }
  void post(std::function<void()> fn) override { inner_->post(std::move(fn)); }
  bool client_gone() const override { return inner_->client_gone(); }
  size_t pending_bytes() const override { return inner_->pending_bytes(); }
  double idle_seconds() const override { return inner_->idle_seconds(); }
  void every(double seconds, std::function<void()> fn) override { inner_->every(seconds, std::move(fn)); }

 private:
  std::shared_ptr<HttpExchange> inner_;
  std::vector<std::pair<std::string, std::string>> headers_;
};

struct Route {
  const char* path;
  const char* methods;  // ", "-separated, as in the Allow header
};
// GET routes answer HEAD too (same status and headers, no body).
constexpr Route kRoutes[] = {{"/health", "GET, HEAD"},
                             {"/metrics", "GET, HEAD"},
                             {"/version", "GET, HEAD"},
                             {"/v1/models", "GET, HEAD"},
                             {"/v1/completions", "POST"},
                             {"/v1/chat/completions", "POST"},
                             {"/tokenize", "POST"},
                             {"/detokenize", "POST"},
                             {"/cache/flush", "POST"}};

bool method_allowed(std::string_view methods, std::string_view method) {
  size_t pos = 0;
  while (pos <= methods.size()) {
    size_t end = methods.find(", ", pos);
    if (end == std::string_view::npos) end = methods.size();
    if (methods.substr(pos, end - pos) == method) return true;
    pos = end + 2;
  }
  return false;
}

}  // namespace

void Server::handle(HttpRequest&& req, std::shared_ptr<HttpExchange> ex) {
  const auto arrival = std::chrono::steady_clock::now();
  const std::string path = req.target;

  const char* allowed = nullptr;
  for (const auto& r : kRoutes)
    if (path == r.path) allowed = r.methods;
  const bool model_path = path.rfind("/v1/models/", 0) == 0 && path.size() > 11;
  if (model_path) allowed = "GET, HEAD";
  const bool known = allowed != nullptr;
  const std::string endpoint = known ? (model_path ? "/v1/models/{model}" : path) : "other";

  const std::vector<std::pair<std::string, std::string>> cors = cors_headers(req.origin);
  const bool origin_listed = !cors.empty();
  if (!cors.empty()) ex = std::make_shared<ResponseFilter>(std::move(ex), cors);

  if (!known) {
    openai::ApiError e;
    e.status = 404;
    e.code = "unknown_url";
    e.message = "Unknown request URL: " + req.method + " " + path;
    return respond_error(*ex, endpoint, e);
  }
  // A browser's preflight: answered without the API key (browsers never send one on it).
  if (req.method == "OPTIONS" && !opt_.allowed_origins.empty() && !req.origin.empty()) {
    if (!origin_listed) {
      openai::ApiError e;
      e.status = 403;
      e.code = "origin_not_allowed";
      e.message = "Origin " + req.origin + " is not allowed (--allowed-origins)";
      return respond_error(*ex, endpoint, e);
    }
    metrics_.count_request(endpoint, 204);
    // "*" does not cover Authorization, so it is named.
    return ex->respond(204, "", "text/plain",
                       {{"Access-Control-Allow-Methods", std::string(allowed) + ", OPTIONS"},
                        {"Access-Control-Allow-Headers", "Authorization, Content-Type, *"},
                        {"Access-Control-Max-Age", "600"}});
  }
  if (!method_allowed(allowed, req.method)) {
    openai::ApiError e;
    e.status = 405;
    e.code = "method_not_allowed";
    e.message = "Method " + req.method + " is not allowed for " + path + " (use " + allowed + ")";
    e.headers.emplace_back("Allow", allowed);
    return respond_error(*ex, endpoint, e);
  }
  if (auto e = check_key(path, req.authorization)) return respond_error(*ex, endpoint, *e);

  const State state = state_.load();
  std::shared_ptr<const ServingContext> ctx;
  {
    std::lock_guard lk(mu_);
    ctx = serving_;
  }

  if (path == "/health") {
    if (state == State::Ready) {
      metrics_.count_request(endpoint, 200);
      return ex->respond(200, R"({"status":"ok"})");
    }
    nlohmann::json j;
    j["status"] = state == State::Loading ? "loading" : state == State::Failed ? "failed" : state == State::Draining ? "draining" : "stopped";
    if (state == State::Failed) j["error"] = load_error();
    metrics_.count_request(endpoint, 503);
    return ex->respond(503, j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), "application/json",
                       {{"Retry-After", "5"}});
  }
  if (path == "/version") {
    metrics_.count_request(endpoint, 200);
    return ex->respond(200, nlohmann::json{{"version", version_string()}}.dump());
  }
  if (path == "/metrics") {
    metrics_.count_request(endpoint, 200);
    std::optional<engine::EngineStats> stats;
    if (ctx && ctx->engine) stats = ctx->engine->stats();
    return ex->respond(200, metrics_.render(stats, http_->open_connections(), state == State::Ready),
                       "text/plain; version=0.0.4; charset=utf-8");
  }
  if (path == "/v1/models" || model_path) {
    nlohmann::json card = {{"id", opt_.served_model_name}, {"object", "model"}, {"created", 0}, {"owned_by", "deepinfer"}};
    if (ctx) {
      card["max_model_len"] = ctx->model.max_context;
      card["vocab_size"] = ctx->model.vocab_size;  // prompts may use token ids in [0, vocab_size)
    }
    if (model_path) {
      if (path.substr(11) != opt_.served_model_name) {
        openai::ApiError e;
        e.status = 404;
        e.code = "model_not_found";
        e.param = "model";
        e.message = "The model `" + path.substr(11) + "` does not exist.";
        return respond_error(*ex, endpoint, e);
      }
      metrics_.count_request(endpoint, 200);
      return ex->respond(200, card.dump());
    }
    metrics_.count_request(endpoint, 200);
    return ex->respond(200, nlohmann::json{{"object", "list"}, {"data", nlohmann::json::array({card})}}.dump());
  }

  // Endpoints that need the model.
  if (state != State::Ready || !ctx) {
    openai::ApiError e;
    e.status = 503;
    e.type = "server_error";
    e.code = state == State::Loading ? "model_loading" : state == State::Draining || state == State::Stopped ? "server_shutdown" : "model_unavailable";
    e.message = state == State::Loading ? "the model is still loading; retry shortly"
                : e.code == "server_shutdown" ? "the server is shutting down; retry on another instance"
                                              : "the model is not available";
    e.headers.emplace_back("Retry-After", "5");
    return respond_error(*ex, endpoint, e);
  }

  // Parsing and prompt rendering cost time in the size of the body: never on an io thread.
  auto body = std::make_shared<std::string>(std::move(req.body));
  const std::string method = req.method;
  HttpExchange& exr = *ex;
  // The body's share of the in-flight budget is held until the parse has freed the body.
  offload(exr, endpoint, [this, ex, ctx, body, path, method, endpoint, arrival, lease = std::move(req.body_lease)]() mutable {
    if (ex->client_gone()) return;  // nobody to answer
    auto server_fault = [&](const std::exception& e) {
      // A fault of the server's own setup (e.g. a chat template token missing from the tokenizer).
      openai::ApiError err;
      err.status = 500;
      err.type = "server_error";
      err.code = "internal_error";
      err.message = e.what();
      spdlog::error("{} {}: {}", method, path, e.what());
      respond_error(*ex, endpoint, err);
    };
    if (path == "/cache/flush") {
      // Waits for the engine thread and unlinks files: a worker's job, not an io thread's.
      const uint64_t removed = ctx->engine->flush_cache();
      spdlog::info("cache flush: {} entries removed", removed);
      metrics_.count_request(endpoint, 200);
      return ex->respond(200, nlohmann::json{{"flushed", true}, {"entries_removed", removed}}.dump());
    }
    if (path == "/tokenize" || path == "/detokenize") {
      std::variant<std::string, openai::ApiError> r;
      try {
        r = path == "/tokenize" ? openai::tokenize_request(*body, ctx->model) : openai::detokenize_request(*body, ctx->model);
      } catch (const std::exception& e) {
        return server_fault(e);
      }
      if (auto* err = std::get_if<openai::ApiError>(&r)) return respond_error(*ex, endpoint, *err);
      metrics_.count_request(endpoint, 200);
      return ex->respond(200, std::move(std::get<std::string>(r)));
    }
    openai::ParseResult parsed;
    try {
      parsed = path == "/v1/chat/completions" ? openai::parse_chat_completion(*body, ctx->model) : openai::parse_completion(*body, ctx->model);
    } catch (const std::exception& e) {
      return server_fault(e);
    }
    body->clear();
    body->shrink_to_fit();
    lease.reset();
    if (auto* err = std::get_if<openai::ApiError>(&parsed)) {
      spdlog::info("{} {} status={} error=\"{}\"", method, path, err->status, err->message);
      return respond_error(*ex, endpoint, *err);
    }
    // run_generation belongs on the connection's strand.
    auto spec = std::make_shared<openai::GenerationSpec>(std::move(std::get<openai::GenerationSpec>(parsed)));
    ex->post([spec, ex, ctx, arrival] { run_generation(std::move(*spec), ex, ctx, arrival); });
  });
}

const char* version_string() { return DI_VERSION; }

// Header stage (before the body is read): a request that carries a body to an endpoint needing the
// key, without the right key, is refused here, so unauthenticated clients cannot make the server
// buffer bodies. Requests without a body go through handle(), which answers them the same way.
std::optional<HttpRejection> Server::check_headers(const HttpHeaderView& h) {
  if (!h.has_body()) return std::nullopt;
  std::optional<openai::ApiError> err = check_key(h.target, h.authorization);
  if (!err) return std::nullopt;
  openai::ApiError& e = *err;
  const bool counted = h.target == "/v1/chat/completions" || h.target == "/v1/completions";
  metrics_.count_request(counted ? std::string(h.target) : "other", 401);
  for (auto& hdr : cors_headers(h.origin)) e.headers.push_back(std::move(hdr));
  return HttpRejection{e.status, openai::error_body(e), "application/json", e.headers};
}

// The API key, where one is set, guards /v1/*, the tokenizer endpoints and /cache/flush (not
// /health, /metrics, /version).
std::optional<openai::ApiError> Server::check_key(std::string_view target, std::string_view authorization) const {
  const bool guarded =
      target.rfind("/v1/", 0) == 0 || target == "/tokenize" || target == "/detokenize" || target == "/cache/flush";
  if (opt_.api_key.empty() || !guarded) return std::nullopt;
  const std::string_view prefix = "Bearer ";
  if (authorization.size() > prefix.size() && authorization.substr(0, prefix.size()) == prefix &&
      constant_time_equal(std::string(authorization.substr(prefix.size())), opt_.api_key))
    return std::nullopt;
  openai::ApiError e;
  e.status = 401;
  e.code = "invalid_api_key";
  e.message = authorization.empty() ? "Missing API key: send 'Authorization: Bearer <key>'" : "Incorrect API key provided";
  return e;
}

// CORS, opt-in: only a listed origin is told it may read the response.
std::vector<std::pair<std::string, std::string>> Server::cors_headers(std::string_view origin) const {
  std::vector<std::pair<std::string, std::string>> h;
  if (opt_.allowed_origins.empty() || origin.empty()) return h;
  for (const auto& o : opt_.allowed_origins)
    if (o == "*" || o == origin) {
      h.emplace_back("Access-Control-Allow-Origin", std::string(origin));
      h.emplace_back("Vary", "Origin");
      break;
    }
  return h;
}

}  // namespace di::server
