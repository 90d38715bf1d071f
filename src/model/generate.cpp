#include "model/generate.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

#include "model/v3/tiny_generator.h"
#include "model/v41/tiny_generator.h"

namespace di {

namespace {

// Every architecture's generator takes the same options and reports the same figures.
template <class TinyOptions>
TinyOptions tiny_options(const GenerateOptions& o) {
  TinyOptions t;
  t.size = o.size;
  t.seed = o.seed;
  t.tokenizer_path = o.tokenizer_path;
  t.threads = o.threads;
  t.shard_bytes = o.shard_bytes;
  t.force = o.force;
  t.progress = o.progress;
  return t;
}

template <class TinyResult>
GeneratedModel generated(const TinyResult& r, std::string summary) {
  GeneratedModel g;
  g.summary = std::move(summary);
  g.n_params = r.n_params;
  g.tensor_bytes = r.tensor_bytes;
  g.file_bytes = r.file_bytes;
  g.n_tensors = r.n_tensors;
  g.n_shards = r.n_shards;
  g.seconds = r.seconds;
  return g;
}

GeneratedModel generate_v41(const GenerateOptions& o, const std::string& out_dir) {
  const v41::TinyResult r = v41::make_tiny_checkpoint(tiny_options<v41::TinyOptions>(o), out_dir);
  const auto& c = r.config;
  return generated(r, "DeepSeek-V4.1: dim " + std::to_string(c.dim) + ", " + std::to_string(c.n_layers) + " layers + " +
              std::to_string(c.n_mtp_layers) + " DSpark stages, " + std::to_string(c.n_routed_experts) +
              " routed experts (" + std::to_string(c.n_activated_experts) + " active), head_dim " +
              std::to_string(c.head_dim) + ", window " + std::to_string(c.window_size));
}

GeneratedModel generate_v3(const GenerateOptions& o, const std::string& out_dir) {
  const v3::TinyResult r = v3::make_tiny_checkpoint(tiny_options<v3::TinyOptions>(o), out_dir);
  const auto& c = r.config;
  return generated(r, "DeepSeek-V3: dim " + std::to_string(c.dim) + ", " + std::to_string(c.n_layers) + " layers (" +
              std::to_string(c.n_dense_layers) + " dense) + " + std::to_string(c.n_mtp_layers) + " MTP, " +
              std::to_string(c.n_routed_experts) + " routed experts (" + std::to_string(c.n_activated_experts) +
              " active), " + std::to_string(c.n_heads) + " heads, kv_lora " + std::to_string(c.kv_lora_rank));
}

struct Generator {
  std::string arch;
  const std::vector<std::string>& (*sizes)();
  GeneratedModel (*generate)(const GenerateOptions&, const std::string&);
};

const std::vector<Generator>& generators() {
  static const std::vector<Generator> g = {{"v41", &v41::tiny_size_names, &generate_v41},
                                                {"v3", &v3::tiny_size_names, &generate_v3}};
  return g;
}

const Generator& find(const std::string& arch) {
  for (const auto& g : generators())
    if (g.arch == arch) return g;
  std::string known;
  for (const auto& g : generators()) known += (known.empty() ? "" : ", ") + g.arch;
  throw std::invalid_argument("unknown architecture '" + arch + "' (known: " + known + ")");
}

}  // namespace

std::vector<std::string> generator_archs() {
  std::vector<std::string> out;
  for (const auto& g : generators()) out.push_back(g.arch);
  return out;
}

std::vector<std::string> generator_sizes(const std::string& arch) { return find(arch).sizes(); }

std::vector<std::string> all_generator_sizes() {
  std::vector<std::string> out;
  for (const auto& g : generators())
    for (const auto& s : g.sizes())
      if (std::find(out.begin(), out.end(), s) == out.end()) out.push_back(s);
  return out;
}

GeneratedModel generate_model(const GenerateOptions& opts, const std::string& out_dir) {
  const Generator& g = find(opts.arch);
  const auto sizes = g.sizes();
  if (std::find(sizes.begin(), sizes.end(), opts.size) == sizes.end())
    throw std::invalid_argument("unknown size '" + opts.size + "' for architecture " + opts.arch);
  return g.generate(opts, out_dir);
}

}  // namespace di
