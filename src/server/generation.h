// One completion request in flight: submits to the engine, turns engine events (engine thread) into
// text on the connection's strand (IncrementalDecoder -> StreamParser / StopMatcher), and writes the
// OpenAI response, streamed (SSE) or whole. Cancels the engine request when the client goes away or
// every choice has stopped on a stop string.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>

#include "engine/engine.h"
#include "server/http.h"
#include "server/metrics.h"
#include "openai/api.h"

namespace di::server {

struct ServingContext {
  std::shared_ptr<engine::Engine> engine;
  openai::ModelContext model;
  Metrics* metrics = nullptr;
  double sse_keepalive_s = 15;
  double shutdown_timeout_s = 0;  // named in the error requests get when a shutdown ends them
  // Requests whose reply is not finished yet, and whether the server is shutting down (an engine
  // cancellation the client did not ask for is then a shutdown, answered with an error).
  mutable std::atomic<int> active_generations{0};
  mutable std::atomic<bool> shutting_down{false};
};

// Must be called on the exchange's strand (the HTTP handler runs there). Replies with 429/400/503
// itself when the engine refuses the request.
void run_generation(openai::GenerationSpec spec, std::shared_ptr<HttpExchange> exchange, std::shared_ptr<const ServingContext> ctx,
                    std::chrono::steady_clock::time_point arrival);

}  // namespace di::server
