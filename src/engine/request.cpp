#include "engine/request.h"

#include "grammar/compiled_grammar.h"

#include <cmath>

namespace di::engine {

int64_t effective_max_context(const EngineOptions& opts, const ModelInfo& model) {
  const int64_t model_limit = model.max_context;
  return opts.max_context > 0 ? std::min(opts.max_context, model_limit) : model_limit;
}

namespace {

SubmitResult invalid(std::string msg) {
  SubmitResult r;
  r.error = SubmitError::Invalid;
  r.message = std::move(msg);
  return r;
}

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", v);
  return b;
}

bool in_range(float v, float lo, float hi) { return std::isfinite(v) && v >= lo && v <= hi; }

}  // namespace

SubmitResult validate_params(const RequestParams& p, const ModelInfo& model) {
  const int64_t V = model.vocab_size;
  const auto& s = p.sampling;
  if (p.prompt.empty()) return invalid("prompt: must not be empty");
  for (size_t i = 0; i < p.prompt.size(); ++i)
    if (p.prompt[i] < 0 || p.prompt[i] >= V)
      return invalid("prompt[" + std::to_string(i) + "]: token id " + std::to_string(p.prompt[i]) + " is outside [0, " +
                     std::to_string(V) + ")");
  if (!std::isfinite(s.temperature) || s.temperature < 0) return invalid("temperature: " + num(s.temperature) + " must be >= 0");
  if (!(std::isfinite(s.top_p) && s.top_p > 0 && s.top_p <= 1)) return invalid("top_p: " + num(s.top_p) + " must be in (0, 1]");
  if (s.top_k < 0) return invalid("top_k: " + std::to_string(s.top_k) + " must be >= 0 (0 = off)");
  if (!in_range(s.min_p, 0, 1)) return invalid("min_p: " + num(s.min_p) + " must be in [0, 1]");
  if (!in_range(s.presence_penalty, -2, 2)) return invalid("presence_penalty: " + num(s.presence_penalty) + " must be in [-2, 2]");
  if (!in_range(s.frequency_penalty, -2, 2))
    return invalid("frequency_penalty: " + num(s.frequency_penalty) + " must be in [-2, 2]");
  if (!(std::isfinite(s.repetition_penalty) && s.repetition_penalty > 0))
    return invalid("repetition_penalty: " + num(s.repetition_penalty) + " must be > 0");
  for (const auto& [tok, bias] : s.logit_bias) {
    if (tok < 0 || tok >= V)
      return invalid("logit_bias: token id " + std::to_string(tok) + " is outside [0, " + std::to_string(V) + ")");
    if (!in_range(bias, -100, 100))
      return invalid("logit_bias: bias " + num(bias) + " for token " + std::to_string(tok) + " must be in [-100, 100]");
  }
  if (s.logprobs < 0 || s.logprobs > 20) return invalid("logprobs: " + std::to_string(s.logprobs) + " must be in [0, 20]");
  if (s.top_logprobs < 0 || s.top_logprobs > 20)
    return invalid("top_logprobs: " + std::to_string(s.top_logprobs) + " must be in [0, 20]");
  if (s.top_logprobs > 0 && s.logprobs == 0) return invalid("top_logprobs: requires logprobs");
  if (p.max_tokens < 1) return invalid("max_tokens: " + std::to_string(p.max_tokens) + " must be >= 1");
  for (int32_t t : p.stop_token_ids)
    if (t < 0 || t >= V)
      return invalid("stop_token_ids: token id " + std::to_string(t) + " is outside [0, " + std::to_string(V) + ")");
  if (p.n < 1 || p.n > 16) return invalid("n: " + std::to_string(p.n) + " must be in [1, 16]");
  if (p.grammar && p.grammar->vocab().mask_size() != V)
    return invalid("grammar: compiled for a vocabulary of " + std::to_string(p.grammar->vocab().mask_size()) +
                   " tokens; the model has " + std::to_string(V));
  return {};
}

}  // namespace di::engine
