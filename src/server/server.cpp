#include "server/server.h"

#include <chrono>
#include <thread>

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
  http_ = std::make_unique<HttpServer>(opt_.http, [this](HttpRequest&& req, std::shared_ptr<HttpExchange> ex) {
    handle(std::move(req), std::move(ex));
  });
}

Server::~Server() { stop(); }

std::string Server::load_error() const {
  std::lock_guard lk(mu_);
  return load_error_;
}

void Server::start() {
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
      ctx->model.chat_format = opt_.chat_format;
      ctx->model.default_thinking = opt_.default_thinking;
      ctx->model.default_max_tokens = opt_.default_max_tokens;
      ctx->model.max_n = opt_.max_n;
      ctx->model.test_hooks = opt_.test_hooks;
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
    // The engine's last events reach the requests on their connections' strands: let them write
    // their error replies before the connections close.
    for (int i = 0; i < 200 && ctx->active_generations.load() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (int left = ctx->active_generations.load(); left > 0) spdlog::warn("stop: {} requests had not finished their replies", left);
  }
  if (http_) http_->stop();
}

void Server::respond_error(HttpExchange& ex, const std::string& endpoint, const ApiError& e) {
  metrics_.count_request(endpoint, e.status);
  ex.respond(e.status, error_body(e), "application/json", e.headers);
}

void Server::handle(HttpRequest&& req, std::shared_ptr<HttpExchange> ex) {
  const auto arrival = std::chrono::steady_clock::now();
  const std::string& path = req.target;
  const bool is_v1 = path.rfind("/v1/", 0) == 0;

  struct Route {
    const char* path;
    const char* method;
  };
  static constexpr Route kRoutes[] = {{"/health", "GET"},       {"/metrics", "GET"},          {"/v1/models", "GET"},
                                      {"/v1/completions", "POST"}, {"/v1/chat/completions", "POST"}};
  const char* allowed = nullptr;
  bool known = false;
  for (const auto& r : kRoutes) {
    if (path == r.path) {
      known = true;
      allowed = r.method;
    }
  }
  const bool model_path = path.rfind("/v1/models/", 0) == 0 && path.size() > 11;
  if (model_path) {
    known = true;
    allowed = "GET";
  }
  const std::string endpoint = known ? (model_path ? "/v1/models/{model}" : path) : "other";

  if (!known) {
    ApiError e;
    e.status = 404;
    e.code = "unknown_url";
    e.message = "Unknown request URL: " + req.method + " " + path;
    return respond_error(*ex, endpoint, e);
  }
  if (req.method != allowed) {
    ApiError e;
    e.status = 405;
    e.code = "method_not_allowed";
    e.message = "Method " + req.method + " is not allowed for " + path + " (use " + allowed + ")";
    e.headers.emplace_back("Allow", allowed);
    return respond_error(*ex, endpoint, e);
  }
  if (is_v1 && !opt_.api_key.empty()) {
    const std::string prefix = "Bearer ";
    const bool ok = req.authorization.size() > prefix.size() && req.authorization.compare(0, prefix.size(), prefix) == 0 &&
                    constant_time_equal(req.authorization.substr(prefix.size()), opt_.api_key);
    if (!ok) {
      ApiError e;
      e.status = 401;
      e.code = "invalid_api_key";
      e.message = req.authorization.empty() ? "Missing API key: send 'Authorization: Bearer <key>'" : "Incorrect API key provided";
      return respond_error(*ex, endpoint, e);
    }
  }

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
        ApiError e;
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

  // Completion endpoints.
  if (state != State::Ready || !ctx) {
    ApiError e;
    e.status = 503;
    e.type = "server_error";
    e.code = state == State::Loading ? "model_loading" : state == State::Draining || state == State::Stopped ? "server_shutdown" : "model_unavailable";
    e.message = state == State::Loading ? "the model is still loading; retry shortly"
                : e.code == "server_shutdown" ? "the server is shutting down; retry on another instance"
                                              : "the model is not available";
    e.headers.emplace_back("Retry-After", "5");
    return respond_error(*ex, endpoint, e);
  }
  ParseResult parsed;
  try {
    parsed = path == "/v1/chat/completions" ? parse_chat_completion(req.body, ctx->model) : parse_completion(req.body, ctx->model);
  } catch (const std::exception& e) {
    // A fault of the server's own setup (e.g. a chat template token missing from the tokenizer).
    ApiError err;
    err.status = 500;
    err.type = "server_error";
    err.code = "internal_error";
    err.message = e.what();
    spdlog::error("{} {}: {}", req.method, path, e.what());
    return respond_error(*ex, endpoint, err);
  }
  if (auto* err = std::get_if<ApiError>(&parsed)) {
    spdlog::info("{} {} status={} error=\"{}\"", req.method, path, err->status, err->message);
    return respond_error(*ex, endpoint, *err);
  }
  run_generation(std::move(std::get<GenerationSpec>(parsed)), std::move(ex), std::move(ctx), arrival);
}

}  // namespace di::server
