#include "engine/sampler.h"

#include <cmath>

namespace di {

int32_t argmax(const float* logits, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (logits[i] > logits[best]) best = i;
  return int32_t(best);
}

int32_t Sampler::sample(const float* logits, int64_t n) {
  if (temperature_ <= 0.f) return argmax(logits, n);
  // argmax_i p_i / E_i with E_i ~ Exp(1) draws i with probability p_i (the Gumbel-max trick in the
  // exponential form the reference uses); in log space: argmax (l_i / T - log E_i).
  const float inv_t = 1.0f / std::max(temperature_, 1e-5f);
  std::exponential_distribution<double> exp1(1.0);
  double best = -INFINITY;
  int64_t arg = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = double(logits[i]) * inv_t - std::log(exp1(rng_));
    if (v > best) { best = v; arg = i; }
  }
  return int32_t(arg);
}

}  // namespace di
