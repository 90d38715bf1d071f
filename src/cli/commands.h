// Subcommands of the `deepinfer` binary. Each lives in its own file and registers itself on the
// CLI11 app; main() only wires them together.
#pragma once

#include <string>

#include "core/numerics.h"

namespace CLI { class App; }

namespace di::cli {
void add_generate(CLI::App& app);
void add_make_tiny(CLI::App& app);
void add_tokenize(CLI::App& app);
void add_serve(CLI::App& app);
void add_bench(CLI::App& app);

// --numerics: the flag's value, else DEEPINFER_NUMERICS, else fast.
inline Numerics resolve_numerics(const std::string& flag) {
  return flag.empty() ? numerics_from_env(Numerics::Fast) : parse_numerics(flag, "--numerics");
}
inline constexpr const char* kNumericsHelp = "fast (fp32 sums, default) or exact (exact sums); default $DEEPINFER_NUMERICS, else fast";
}  // namespace di::cli
