// Subcommands of the `deepinfer` binary. Each lives in its own file and registers itself on the
// CLI11 app; main() only wires them together.
#pragma once

#include <map>
#include <stdexcept>
#include <string>
#include <vector>

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
// --load-option KEY=VALUE (repeatable): architecture-specific load switches (LoadOptions::arch_options).
inline std::map<std::string, std::string> parse_load_options(const std::vector<std::string>& opts) {
  std::map<std::string, std::string> out;
  for (const std::string& o : opts) {
    const size_t eq = o.find('=');
    if (eq == 0 || eq == std::string::npos || eq + 1 == o.size())
      throw std::invalid_argument("--load-option: expected KEY=VALUE, got '" + o + "'");
    out[o.substr(0, eq)] = o.substr(eq + 1);
  }
  return out;
}
inline constexpr const char* kLoadOptionHelp =
    "architecture load switch KEY=VALUE, repeatable (DeepSeek-V3: head=bf16|fp8; V4.1: index_key_policy=per_source|reference)";
}  // namespace di::cli
