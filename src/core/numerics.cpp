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

}  // namespace di
