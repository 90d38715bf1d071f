// v41_tensor_specs against the golden checkpoint (the authority on names, dtypes and shapes), and
// validate_v41_checkpoint on deliberately broken copies.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <set>

#include "model/v41/config.h"
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

namespace {

// The release configuration (v41-architecture.md §2.1/§2.2), built from the golden file.
V41Config release_config() {
  V41Config c = golden_config();
  c.dim = 5120;
  c.moe_inter_dim = 2304;
  c.n_layers = 40;
  c.n_heads = 64;
  c.head_dim = 512;
  c.rope_head_dim = 64;
  c.q_lora_rank = 1280;
  c.o_groups = 8;
  c.o_lora_rank = 1024;
  c.n_routed_experts = 384;
  c.n_activated_experts = 6;
  c.window_size = 128;
  c.compress_ratios = {0, 0};
  for (int i = 0; i < 18; ++i) c.compress_ratios.push_back(2);
  for (int i = 0; i < 20; ++i) c.compress_ratios.push_back(1);
  c.compress_ratios.insert(c.compress_ratios.end(), {0, 0, 0});
  c.kv_source_layers = {2, 8, 14, 20};
  c.index_source_layers = {2, 8, 14, 20, 24, 28, 32, 36};
  c.index_n_heads = 32;
  c.index_head_dim = 128;
  c.index_topk = 512;
  c.candidate_source_layer = 20;
  c.candidate_topk_blocks = 2048;
  c.candidate_block_size = 8;
  c.engram_layer_ids = {1, 14};
  c.engram_num_embeddings = {384006168, 384016682};
  c.engram_vocab_size = 16000000;
  c.engram_n_heads = 8;
  c.engram_head_dim = 256;
  c.engram_compressed_vocab_size = 99092;
  c.dspark_target_layer_ids = {37, 38, 39};
  c.dspark_markov_rank = 256;
  c.dspark_n_routed_experts = 128;
  c.dspark_n_activated_experts = 3;
  c.vision_n_layers = 32;
  c.validate("release");
  return c;
}

std::map<std::string, TensorSpec> by_name(const std::vector<TensorSpec>& v) {
  std::map<std::string, TensorSpec> m;
  for (const auto& s : v) EXPECT_TRUE(m.emplace(s.name, s).second) << "duplicate " << s.name;
  return m;
}

}  // namespace

// §2.17's count check: 96,085 tensors in the release, with its breakdown.
TEST(TensorSpecs, ReleaseConfigCounts) {
  const V41Config c = release_config();
  const auto specs = v41_tensor_specs(c);
  EXPECT_EQ(specs.size(), 96085u);
  size_t layer0 = 0, mtp = 0, vision = 0, engram = 0;
  for (const auto& s : specs) {
    layer0 += s.name.rfind("layers.0.", 0) == 0;
    mtp += s.name.rfind("mtp.", 0) == 0;
    vision += !s.check_dtype;
    engram += s.name.find(".engram.") != std::string::npos;
  }
  EXPECT_EQ(layer0, 2334u);
  EXPECT_EQ(mtp, 2401u);
  EXPECT_EQ(vision, 266u);
  EXPECT_EQ(engram, 12u);
  const auto m = by_name(specs);
  // Shapes quoted in §2.17 / §2.12 / §2.13.
  EXPECT_EQ(m.at("layers.0.attn.wo_a.weight").shape, (std::vector<int64_t>{8192, 4096}));
  EXPECT_EQ(m.at("layers.0.attn.wo_a.scale").shape, (std::vector<int64_t>{256, 128}));
  EXPECT_EQ(m.at("layers.0.ffn.gate.weight").shape, (std::vector<int64_t>{384, 5120}));
  EXPECT_EQ(m.at("layers.14.engram.embed.scale").shape, (std::vector<int64_t>{384016682, 8}));
  EXPECT_EQ(m.at("layers.14.engram.wkv.weight").shape, (std::vector<int64_t>{25600, 6144}));
  EXPECT_EQ(m.at("layers.1.engram.q_weight").shape, (std::vector<int64_t>{4, 5120}));
  EXPECT_EQ(m.at("layers.0.hc_attn_fn").shape, (std::vector<int64_t>{24, 20480}));
  EXPECT_EQ(m.at("mtp.0.main_proj.weight").shape, (std::vector<int64_t>{5120, 15360}));
  EXPECT_EQ(m.at("mtp.2.markov_head.embed.weight").shape, (std::vector<int64_t>{129280, 256}));
  EXPECT_EQ(m.at("mtp.2.confidence_head.proj.weight").shape, (std::vector<int64_t>{1, 5376}));
  EXPECT_EQ(m.at("mtp.1.ffn.gate.bias_vl").shape, (std::vector<int64_t>{128}));
  EXPECT_EQ(m.at("layers.39.ffn.experts.383.w2.weight").shape, (std::vector<int64_t>{5120, 1152}));
  EXPECT_EQ(m.at("layers.39.ffn.experts.383.w2.scale").shape, (std::vector<int64_t>{5120, 72}));
  EXPECT_EQ(m.at("vision.blocks.31.mlp.w1.weight").shape, (std::vector<int64_t>{5632, 1024}));
  EXPECT_EQ(m.at("aligner.w1.weight").shape, (std::vector<int64_t>{5120, 9216}));
  // Roles: compressor wgate only for ratio 2, wk only on owners, nothing of the kind in DSpark.
  EXPECT_TRUE(m.count("layers.14.attn.compressor.wgate.weight"));
  EXPECT_FALSE(m.count("layers.20.attn.compressor.wgate.weight"));
  EXPECT_TRUE(m.count("layers.20.attn.compressor.wkv.weight"));
  EXPECT_TRUE(m.count("layers.24.attn.indexer.wq_b.weight"));
  EXPECT_FALSE(m.count("layers.24.attn.indexer.wk.weight"));
  EXPECT_FALSE(m.count("layers.21.attn.indexer.wq_b.weight"));
  EXPECT_FALSE(m.count("mtp.0.attn.compressor.wkv.weight"));
  EXPECT_FALSE(m.count("mtp.1.main_proj.weight"));
  EXPECT_FALSE(m.count("mtp.0.norm.weight"));
  // Routed experts: 18,800,640 bytes each (§2.18).
  int64_t expert_bytes = 0;
  for (const char* w : {"w1", "w2", "w3"})
    for (const char* k : {"weight", "scale"}) {
      const auto& s = m.at(std::string("layers.5.ffn.experts.7.") + w + "." + k);
      int64_t n = 1;
      for (auto d : s.shape) n *= d;
      expert_bytes += n * int64_t(dtype_size(s.dtype));
    }
  EXPECT_EQ(expert_bytes, 18800640);
}

TEST(TensorSpecs, FollowsAnotherConfig) {
  V41Config c = golden_config();
  c.dim = 96;
  c.n_heads = 6;
  c.o_groups = 3;
  c.head_dim = 96;
  c.rope_head_dim = 32;
  c.q_lora_rank = 64;
  c.o_lora_rank = 16;
  c.hc_mult = 2;
  c.n_routed_experts = 5;
  c.dspark_n_routed_experts = 0;  // falls back to n_routed_experts
  c.n_mtp_layers = 1;
  c.compress_ratios.resize(9);
  c.dspark_target_layer_ids = {6, 7};
  c.engram_max_ngram_size = 3;
  c.validate("variant");
  const auto m = by_name(v41_tensor_specs(c));
  EXPECT_EQ(m.at("layers.0.attn.wo_a.weight").shape, (std::vector<int64_t>{48, 192}));
  EXPECT_EQ(m.at("layers.0.attn.wo_a.scale").shape, (std::vector<int64_t>{2, 6}));
  EXPECT_EQ(m.at("layers.0.attn.wq_b.scale").shape, (std::vector<int64_t>{18, 2}));
  EXPECT_EQ(m.at("layers.0.hc_ffn_fn").shape, (std::vector<int64_t>{8, 192}));
  EXPECT_EQ(m.at("layers.4.engram.wkv.weight").shape, (std::vector<int64_t>{288, 256}));
  EXPECT_EQ(m.at("layers.2.attn.indexer.wk.weight").shape, (std::vector<int64_t>{32, 96}));
  EXPECT_EQ(m.at("mtp.0.ffn.gate.weight").shape, (std::vector<int64_t>{5, 96}));
  EXPECT_TRUE(m.count("mtp.0.ffn.experts.4.w3.scale"));
  EXPECT_FALSE(m.count("mtp.1.attn_norm.weight"));
  // One stage is both the first and the last.
  EXPECT_EQ(m.at("mtp.0.main_proj.weight").shape, (std::vector<int64_t>{96, 192}));
  EXPECT_EQ(m.at("mtp.0.confidence_head.proj.weight").shape, (std::vector<int64_t>{1, 104}));
}

TEST(TensorSpecs, ValidateReportsEveryKindOfProblem) {
  TempDir d;
  Checkpoint golden = Checkpoint::open(kGolden);
  const V41Config c = golden_config();
  const std::string out = (d.path / "broken.safetensors").string();
  rewrite_golden(golden, out, [](const TensorView& v, SafetensorsWriter& w) {
    if (v.name == "layers.3.attn.wq_a.scale") return true;  // missing
    if (v.name == "layers.2.ffn.gate.bias") {                // F32 [8] -> BF16 [8]
      w.add(v.name, DType::BF16, v.shape, std::vector<uint8_t>(v.data, v.data + 16));
      return true;
    }
    if (v.name == "layers.0.attn_norm.weight") {  // [64] -> [32]
      w.add(v.name, v.dtype, {32}, std::vector<uint8_t>(v.data, v.data + 64));
      return true;
    }
    if (v.name == "norm.weight") w.add("layers.3.attn.bogus", DType::U8, {3}, {1, 2, 3});  // extra
    return false;
  });
  const std::string msg = validate_message(out, c);
  ASSERT_FALSE(msg.empty());
  EXPECT_EQ(msg.rfind(out + ": checkpoint does not match the config (4 problems):", 0), 0u) << msg;
  EXPECT_NE(msg.find("missing tensor layers.3.attn.wq_a.scale (expected F8_E8M0 [1, 2])"), std::string::npos) << msg;
  EXPECT_NE(msg.find(out + ": unexpected tensor layers.3.attn.bogus"), std::string::npos) << msg;
  EXPECT_NE(msg.find(out + ": tensor layers.2.ffn.gate.bias has dtype BF16, expected F32"), std::string::npos) << msg;
  EXPECT_NE(msg.find(out + ": tensor layers.0.attn_norm.weight has shape [32], expected [64]"), std::string::npos) << msg;
}

TEST(TensorSpecs, ValidateSingleProblems) {
  TempDir d;
  Checkpoint golden = Checkpoint::open(kGolden);
  const V41Config c = golden_config();
  const std::string out = (d.path / "one.safetensors").string();
  struct Case { std::function<bool(const TensorView&, SafetensorsWriter&)> edit; std::string want; };
  const std::vector<Case> cases = {
      {[](const TensorView& v, SafetensorsWriter&) { return v.name == "mtp.2.markov_head.head.weight"; },
       "missing tensor mtp.2.markov_head.head.weight"},
      {[](const TensorView& v, SafetensorsWriter& w) {
         if (v.name == "embed.weight") w.add("layers.0.attn.compressor.wkv.weight", DType::BF16, {64, 64},
                                             std::vector<uint8_t>(64 * 64 * 2));
         return false;
       },
       "unexpected tensor layers.0.attn.compressor.wkv.weight"},
      {[](const TensorView& v, SafetensorsWriter& w) {
         if (v.name != "layers.0.ffn.experts.0.w1.weight") return false;
         w.add(v.name, DType::U8, v.shape, std::vector<uint8_t>(v.data, v.data + v.nbytes));
         return true;
       },
       "tensor layers.0.ffn.experts.0.w1.weight has dtype U8, expected I8"},
      {[](const TensorView& v, SafetensorsWriter& w) {
         if (v.name != "layers.1.engram.embed.weight") return false;
         w.add(v.name, v.dtype, {64, 660}, std::vector<uint8_t>(v.data, v.data + v.nbytes));
         return true;
       },
       "tensor layers.1.engram.embed.weight has shape [64, 660], expected [660, 64]"},
  };
  for (const Case& k : cases) {
    rewrite_golden(golden, out, k.edit);
    const std::string msg = validate_message(out, c);
    EXPECT_NE(msg.find("(1 problem):"), std::string::npos) << msg;
    EXPECT_NE(msg.find(k.want), std::string::npos) << "'" << k.want << "' not in: " << msg;
  }
}

TEST(TensorSpecs, ValidateCapsTheList) {
  Checkpoint golden = Checkpoint::open(kGolden);
  V41Config c = golden_config();
  c.n_routed_experts = 9;  // every backbone gate wrong + 8 layers x 6 missing expert tensors
  const std::string msg = [&] {
    try {
      validate_v41_checkpoint(golden, c);
    } catch (const LoadError& e) {
      return std::string(e.what());
    }
    return std::string();
  }();
  EXPECT_NE(msg.find("(72 problems):"), std::string::npos) << msg;
  EXPECT_NE(msg.find("... and 52 more"), std::string::npos) << msg;
  EXPECT_EQ(std::count(msg.begin(), msg.end(), '\n'), 21) << msg;
}
