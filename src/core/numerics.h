// The forward pass's two numerics modes, chosen at load time (docs/forward-pass.md compares them).
#pragma once

#include <cstdint>
#include <string_view>

namespace di {

// Exact: the reference's rounding points with exactly summed dot products (verification).
// Fast: the same rounding points with fp32 accumulation in one fixed order per output (the default).
// Both are deterministic and batch-invariant.
enum class Numerics { Fast, Exact };

const char* numerics_name(Numerics);
// "fast" or "exact"; throws std::invalid_argument naming `what` otherwise.
Numerics parse_numerics(std::string_view s, std::string_view what = "numerics");
// DEEPINFER_NUMERICS if set (parsed as above), else `fallback`.
Numerics numerics_from_env(Numerics fallback = Numerics::Fast);

// True when none of the n values is NaN or infinite. Cheap enough to run on every logits row:
// corrupt weights would otherwise turn into plausible-looking garbage tokens.
bool all_finite(const float* x, int64_t n);

}  // namespace di
