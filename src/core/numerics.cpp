#include "core/numerics.h"

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace di {

const char* numerics_name(Numerics n) { return n == Numerics::Exact ? "exact" : "fast"; }

Numerics parse_numerics(std::string_view s, std::string_view what) {
  if (s == "fast") return Numerics::Fast;
  if (s == "exact") return Numerics::Exact;
  throw std::invalid_argument(std::string(what) + "=" + std::string(s) + ": expected fast or exact");
}

Numerics numerics_from_env(Numerics fallback) {
  const char* e = std::getenv("DEEPINFER_NUMERICS");
  return e && *e ? parse_numerics(e, "DEEPINFER_NUMERICS") : fallback;
}

bool all_finite(const float* x, int64_t n) {
  // x * 0 is 0 for finite x and NaN for NaN or ±inf; NaN survives the sums. Eight independent
  // accumulators keep the loop at several elements per cycle without auto-vectorization.
  float acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) acc[k] += x[i + k] * 0.0f;
  for (; i < n; ++i) acc[0] += x[i] * 0.0f;
  float total = 0;
  for (float a : acc) total += a;
  return total == 0.0f;
}

}  // namespace di
