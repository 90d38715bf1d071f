#include "model/model.h"

#include <algorithm>
#include <filesystem>
#include <stdexcept>

#include "io/hf_config.h"
#include "io/safetensors.h"  // LoadError

namespace di {

// Each architecture's loader, defined in src/model/<arch>/.
namespace v41 {
std::unique_ptr<Model> load_as_model(const std::string& model_dir, const LoadOptions& opts);
}
namespace v3 {
std::unique_ptr<Model> load_as_model(const std::string& model_dir, const LoadOptions& opts);
}

namespace {

struct Registered {
  ArchitectureInfo info;
  std::unique_ptr<Model> (*load)(const std::string&, const LoadOptions&);
};

const std::vector<Registered>& registry() {
  static const std::vector<Registered> r = {
      {{"deepseek_v4.1", {"deepseek_v41"}, {"DeepseekV41ForCausalLM"}}, &v41::load_as_model},
      {{"deepseek_v3", {"deepseek_v3"}, {"DeepseekV3ForCausalLM"}}, &v3::load_as_model},
  };
  return r;
}

bool contains(const std::vector<std::string>& v, const std::string& s) { return std::find(v.begin(), v.end(), s) != v.end(); }

}  // namespace

std::vector<std::byte> SequenceState::snapshot() const {
  throw std::logic_error("this model keeps its whole sequence state in pages: it has no snapshots");
}

void SequenceState::restore_snapshot(const kvcache::PrefixPages&, std::span<const int32_t>, std::span<const std::byte>) {
  throw std::logic_error("this model keeps its whole sequence state in pages: it has no snapshots");
}

std::vector<ArchitectureInfo> known_architectures() {
  std::vector<ArchitectureInfo> out;
  for (const auto& r : registry()) out.push_back(r.info);
  return out;
}

std::unique_ptr<Model> load_model(const std::string& model_dir, const LoadOptions& opts) {
  const std::string path = (std::filesystem::path(model_dir) / "config.json").string();
  const HfArchitecture a = hf_architecture(read_json_file(path));
  // model_type decides when present; `architectures` only for configs without one.
  for (const auto& r : registry())
    if (!a.model_type.empty() ? contains(r.info.model_types, a.model_type)
                              : std::any_of(a.architectures.begin(), a.architectures.end(),
                                            [&](const std::string& x) { return contains(r.info.architectures, x); }))
      return r.load(model_dir, opts);
  std::string known;
  for (const auto& r : registry()) {
    for (const auto& t : r.info.model_types) known += (known.empty() ? "" : ", ") + t;
  }
  std::string named = a.model_type.empty() ? "no model_type" : "model_type \"" + a.model_type + "\"";
  if (a.model_type.empty()) {
    named += a.architectures.empty() ? " and no architectures" : " and architectures [";
    for (size_t i = 0; i < a.architectures.size(); ++i) named += (i ? ", \"" : "\"") + a.architectures[i] + "\"";
    if (!a.architectures.empty()) named += "]";
  }
  throw LoadError(path + ": unsupported model architecture (" + named + "); supported model_type: " + known);
}

}  // namespace di
