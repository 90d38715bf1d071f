// One completion request in flight: submits to the engine, turns engine events (engine thread) into
// text on the connection's strand (IncrementalDecoder -> StreamParser / StopMatcher), and writes the
// OpenAI response, streamed (SSE) or whole. Cancels the engine request when the client goes away or
// every choice has stopped on a stop string.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "engine/engine.h"
#include "server/http.h"
#include "server/metrics.h"
#include "server/openai_api.h"

namespace di::server {

struct ServingContext {
  std::shared_ptr<engine::Engine> engine;
  ModelContext model;
  Metrics* metrics = nullptr;
  double sse_keepalive_s = 15;
};

// Must be called on the exchange's strand (the HTTP handler runs there). Replies with 429/400/503
// itself when the engine refuses the request.
void run_generation(GenerationSpec spec, std::shared_ptr<HttpExchange> exchange, std::shared_ptr<const ServingContext> ctx,
                    std::chrono::steady_clock::time_point arrival);

}  // namespace di::server
