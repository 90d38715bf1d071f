#include "cli/default_model.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "model/generate.h"

namespace di::cli {

std::string default_model_dir() {
  namespace fs = std::filesystem;
  if (const char* h = std::getenv("DEEPINFER_HOME"); h && *h) return (fs::path(h) / "models" / "tiny-v41").string();
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return (fs::path(x) / "deepinfer" / "models" / "tiny-v41").string();
  const char* home = std::getenv("HOME");
  return (fs::path(home && *home ? home : ".") / ".cache" / "deepinfer" / "models" / "tiny-v41").string();
}

std::string ensure_default_model(bool verbose) {
  namespace fs = std::filesystem;
  const std::string dir = default_model_dir();
  // config.json is written last, so its presence means a complete generation.
  if (fs::exists(fs::path(dir) / "config.json")) return dir;
  if (verbose) std::fprintf(stderr, "deepinfer: generating the built-in tiny model in %s (seed 0)...\n", dir.c_str());
  GenerateOptions o;
  o.arch = "v41";
  o.size = "tiny";
  o.seed = 0;
  o.force = true;  // a directory without config.json is an interrupted generation
  fs::create_directories(dir);
  generate_model(o, dir);
  return dir;
}

}  // namespace di::cli
