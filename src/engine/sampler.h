// Token sampling for offline generation: greedy argmax, or the reference's Gumbel-max sampling
// (argmax of softmax(logits / T) / Exp(1)) from a seeded generator, so a seed reproduces a run.
#pragma once

#include <cstdint>
#include <random>

namespace di {

// Lowest index among equal maxima.
int32_t argmax(const float* logits, int64_t n);

class Sampler {
 public:
  Sampler(float temperature, uint64_t seed) : temperature_(temperature), rng_(seed) {}
  int32_t sample(const float* logits, int64_t n);

 private:
  float temperature_;
  std::mt19937_64 rng_;
};

}  // namespace di
