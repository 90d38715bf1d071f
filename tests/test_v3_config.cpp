// DeepSeek-V3 config.json parsing and validation, and the derived RoPE / softmax-scale constants.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "model/v3/config.h"
#include "test_v3_paths.h"

using namespace di;
using namespace di::v3;
using json = nlohmann::json;

namespace {

json golden_json() {
  std::ifstream f(test::v3_golden_model_dir() + "/config.json");
  return json::parse(f);
}
V3Config parse(const json& j) { return V3Config::from_hf_json_text(j.dump(), "config.json"); }
std::string error_of(const json& j) {
  try {
    parse(j);
  } catch (const LoadError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(V3Config, ParsesTheGoldenConfig) {
  const V3Config c = V3Config::from_hf_file(test::v3_golden_model_dir() + "/config.json");
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.n_layers, 4);
  EXPECT_EQ(c.n_dense_layers, 1);
  EXPECT_EQ(c.n_mtp_layers, 1);
  EXPECT_EQ(c.q_lora_rank, 32);
  EXPECT_EQ(c.kv_lora_rank, 32);
  EXPECT_EQ(c.n_group, 4);
  EXPECT_EQ(c.topk_group, 2);
  EXPECT_EQ(c.topk_method, "noaux_tc");
  EXPECT_FLOAT_EQ(c.routed_scaling_factor, 2.5f);
  EXPECT_TRUE(c.fp8);
  EXPECT_EQ(c.block_out, 128);
  EXPECT_EQ(c.block_in, 128);
  EXPECT_EQ(c.scale_fmt, "");
  EXPECT_TRUE(c.yarn_active());
  // README: (16 + 16)^-0.5 * (0.1 ln 4 + 1)^2.
  EXPECT_NEAR(c.softmax_scale(), 0.2291869183, 1e-10);
}

TEST(V3Config, YarnFrequenciesFollowTheOfficialRamp) {
  const V3Config c = parse(golden_json());
  float f[8];
  c.rope_freqs(f);
  // smooth = [1, 0.5, 0, ...]: kept, half interpolated, divided by the factor 4.
  for (int i = 0; i < 8; ++i) {
    const double base = std::pow(10000.0, -2.0 * i / 16);
    const double smooth = i == 0 ? 1 : i == 1 ? 0.5 : 0;
    EXPECT_NEAR(f[i], base / 4 * (1 - smooth) + base * smooth, 1e-6 * base) << i;
  }
  // Not active when the context does not exceed the original one: plain frequencies, plain scale.
  json j = golden_json();
  j["max_position_embeddings"] = 32;
  const V3Config d = parse(j);
  EXPECT_FALSE(d.yarn_active());
  d.rope_freqs(f);
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(f[i], std::pow(10000.0, -2.0 * i / 16), 1e-6) << i;
  EXPECT_NEAR(d.softmax_scale(), 1 / std::sqrt(32.0), 1e-12);
}

TEST(V3Config, VariantsNoQLoraUe8m0Unquantized) {
  json j = golden_json();
  j["q_lora_rank"] = nullptr;
  j["quantization_config"]["scale_fmt"] = "ue8m0";
  const V3Config c = parse(j);
  EXPECT_EQ(c.q_lora_rank, 0);
  EXPECT_EQ(c.scale_fmt, "ue8m0");
  j.erase("quantization_config");
  j["rope_scaling"] = nullptr;
  const V3Config d = parse(j);
  EXPECT_FALSE(d.fp8);
  EXPECT_FALSE(d.yarn_active());
  // Round trip through the writer.
  const V3Config e = V3Config::from_hf_json_text(c.to_hf_json(), "rt");
  EXPECT_EQ(e.q_lora_rank, 0);
  EXPECT_EQ(e.scale_fmt, "ue8m0");
  EXPECT_EQ(e.to_hf_json(), c.to_hf_json());
  EXPECT_TRUE(is_v3_config_text(c.to_hf_json()));
  EXPECT_FALSE(is_v3_config_text(R"({"model_type": "deepseek_v4"})"));
  EXPECT_TRUE(is_v3_config_text(R"({"architectures": ["X", "DeepseekV3ForCausalLM"]})"));
  EXPECT_FALSE(is_v3_config_text(R"([{"model_type": "deepseek_v3"}])"));
}

TEST(V3Config, RejectsWhatItDoesNotImplement) {
  auto with = [](const char* key, json v) {
    json j = golden_json();
    j[key] = v;
    return error_of(j);
  };
  EXPECT_NE(with("hidden_size", "64").find("hidden_size: expected integer"), std::string::npos);
  EXPECT_NE(with("topk_group", 5).find("topk_group"), std::string::npos);
  EXPECT_NE(with("n_routed_experts", 15).find("n_group"), std::string::npos);
  EXPECT_NE(with("scoring_func", "relu").find("scoring_func"), std::string::npos);
  EXPECT_NE(with("model_type", "llama").find("model_type"), std::string::npos);
  EXPECT_NE(with("qk_rope_head_dim", 15).find("even"), std::string::npos);
  EXPECT_NE(with("q_lora_rank", -1).find("q_lora_rank: integer -1 out of range"), std::string::npos);
  EXPECT_NE(with("vocab_size", json(uint64_t(1) << 63)).find("vocab_size: integer 9223372036854775808 out of range"),
            std::string::npos);
  EXPECT_NE(with("rope_scaling", 3).find("rope_scaling: expected object or null"), std::string::npos);
  EXPECT_NE(with("quantization_config", "fp8").find("quantization_config: expected object"), std::string::npos);
  json j = golden_json();
  j["rope_scaling"]["mscale"] = 0.707;
  EXPECT_NE(error_of(j).find("mscale"), std::string::npos);
  j = golden_json();
  j["quantization_config"]["weight_block_size"] = {128};
  EXPECT_NE(error_of(j).find("weight_block_size"), std::string::npos);
  j = golden_json();
  j["quantization_config"]["scale_fmt"] = "e5m2";
  EXPECT_NE(error_of(j).find("scale_fmt"), std::string::npos);
  j = golden_json();
  j.erase("kv_lora_rank");
  EXPECT_NE(error_of(j).find("kv_lora_rank: missing key"), std::string::npos);
}
