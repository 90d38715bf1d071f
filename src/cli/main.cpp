#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>

#include "cli/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"deepinfer: inference and serving engine for DeepSeek models"};
  app.require_subcommand(1);
  di::cli::add_generate(app);
  di::cli::add_make_tiny(app);
  di::cli::add_tokenize(app);
  di::cli::add_serve(app);
  di::cli::add_bench(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "deepinfer: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
