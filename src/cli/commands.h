// Subcommands of the `deepinfer` binary. Each lives in its own file and registers itself on the
// CLI11 app; main() only wires them together.
#pragma once

namespace CLI { class App; }

namespace di::cli {
void add_generate(CLI::App& app);
void add_make_tiny(CLI::App& app);
void add_tokenize(CLI::App& app);
void add_serve(CLI::App& app);
void add_bench(CLI::App& app);
}  // namespace di::cli
