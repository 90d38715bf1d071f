// v41_tensor_specs against the golden checkpoint (the authority on names, dtypes and shapes), and
// validate_v41_checkpoint on deliberately broken copies.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <set>

#include "io/config.h"
#include "io/safetensors.h"
#include "model/v41/tensor_specs.h"

namespace fs = std::filesystem;
using namespace di;

namespace {

const std::string kGolden = std::string(DI_SOURCE_DIR) + "/tests/data/golden/v41-tiny/model";

V41Config golden_config() { return V41Config::from_hf_file(kGolden + "/config.json"); }

std::string spec_str(const TensorSpec& s) {
  return s.name + " " + dtype_name(s.dtype) + " " + shape_str(s.shape);
}

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("di_specs_" + std::to_string(::getpid()) + "_" +
                                        std::to_string(reinterpret_cast<uintptr_t>(this)));
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

// Copies the golden checkpoint into a writer, letting `edit` drop / rename / retype tensors.
void rewrite_golden(const Checkpoint& src, const std::string& out,
                    const std::function<bool(const TensorView&, SafetensorsWriter&)>& edit) {
  SafetensorsWriter w;
  for (const auto& [name, v] : src.tensors()) {
    if (edit(v, w)) continue;
    w.add(name, v.dtype, v.shape, std::vector<uint8_t>(v.data, v.data + v.nbytes));
  }
  w.write(out);
}

std::string validate_message(const std::string& path, const V41Config& c) {
  Checkpoint ck = Checkpoint::open(path);
  try {
    validate_v41_checkpoint(ck, c);
  } catch (const LoadError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(TensorSpecs, EqualsGoldenCheckpointExactly) {
  const V41Config c = golden_config();
  const std::vector<TensorSpec> specs = v41_tensor_specs(c);
  Checkpoint ck = Checkpoint::open(kGolden);
  ASSERT_EQ(ck.tensors().size(), 870u);

  std::set<std::string> want, have;
  for (const auto& s : specs) {
    EXPECT_TRUE(s.check_dtype) << s.name;
    EXPECT_TRUE(want.insert(spec_str(s)).second) << "duplicate spec " << s.name;
  }
  for (const auto& [name, v] : ck.tensors()) have.insert(name + " " + dtype_name(v.dtype) + " " + shape_str(v.shape));
  std::vector<std::string> only_spec, only_ckpt;
  std::set_difference(want.begin(), want.end(), have.begin(), have.end(), std::back_inserter(only_spec));
  std::set_difference(have.begin(), have.end(), want.begin(), want.end(), std::back_inserter(only_ckpt));
  for (const auto& s : only_spec) ADD_FAILURE() << "in specs, not in golden: " << s;
  for (const auto& s : only_ckpt) ADD_FAILURE() << "in golden, not in specs: " << s;
  EXPECT_EQ(specs.size(), 870u);
  EXPECT_NO_THROW(validate_v41_checkpoint(ck, c));
}
