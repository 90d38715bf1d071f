// Token sampling: di::engine::TokenSampler, the one sampler (the engine's, so `serve`, `generate`
// and `bench` alike). One call turns a row of logits into the next token of one choice, applying
// in this order:
//   1. logit_bias (added);
//   2. repetition_penalty over the distinct tokens of prompt + output (HF/CTRL rule: positive logits
//      divided by the penalty, negative ones multiplied);
//   3. frequency and presence penalties over the output tokens (OpenAI: z -= count*f + p);
//   4. temperature (z / T; greedy when T == 0, where z is left unscaled);
//   5. the grammar mask, when given: disallowed tokens get -inf (whatever their bias).
// Logprobs are the log-softmax of that processed distribution over the FULL vocabulary, before the
// top_k / top_p / min_p truncation (so alternatives outside the truncated set still get finite
// logprobs and exp(logprobs) sums to 1). Then top_k, top_p (of the top-k renormalised
// distribution) and min_p (relative to the most likely token) restrict the candidates, and one
// uniform draw picks a token by inverse CDF.
//
// Randomness is counter-based: the draw for output token `step` of a choice is a pure function of
// (stream key, step), the key derived from the request seed and the choice index. Batch
// composition, preemption and recompute therefore cannot change a choice's tokens.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "engine/engine.h"

namespace di::engine {

// Random stream of choice `choice` of a request seeded with `seed`.
uint64_t choice_stream_key(uint64_t seed, int choice);
// Uniform in [0, 1) for draw number `step` of a stream.
double stream_uniform(uint64_t key, int64_t step);

struct SampleInput {
  const SamplingParams* params = nullptr;
  std::span<const int32_t> prompt;  // for repetition_penalty
  std::span<const int32_t> output;  // tokens generated so far by this choice
  uint64_t stream_key = 0;
  int64_t step = 0;                 // = output.size() for the engine
  int top_logprobs = 0;             // alternatives to return (0..20)
  // Allowed tokens (bit id % 32 of mask[id / 32]); empty: all. Must allow at least one token.
  std::span<const uint32_t> mask;
};

struct SampleResult {
  int32_t token = 0;
  float logprob = 0;  // of `token` under the processed full distribution
};

// Scratch buffers sized to the vocabulary, reused across calls (no allocation per token once
// warm). Not thread-safe: one per engine thread.
class TokenSampler {
 public:
  explicit TokenSampler(int64_t vocab_size);
  // `top` (may be null) receives the top_logprobs most likely tokens, sorted by logprob descending
  // (ties: lower id first); its capacity is reused.
  SampleResult sample(const float* logits, const SampleInput& in, std::vector<TokenLogprob>* top);
  int64_t vocab_size() const { return vocab_; }

 private:
  void apply_penalties(const SampleInput& in);
  void apply_mask(std::span<const uint32_t> mask);
  int32_t draw(const SamplingParams& p, double u);

  int64_t vocab_;
  std::vector<float> z_;       // processed logits
  std::vector<float> e_;       // exp(z - max), when needed
  std::vector<int32_t> order_; // candidate ids, partially sorted
  std::vector<int32_t> counts_;
  std::vector<uint8_t> seen_;
  double max_z_ = 0, sum_e_ = 0;
};

}  // namespace di::engine
