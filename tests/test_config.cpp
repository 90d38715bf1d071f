// HF config.json of a V4.1 release -> V41Config: the golden config against the official
// inference config, every missing key / wrong type / inconsistency, and to_hf_json round trips.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "model/v41/config.h"
#include "io/safetensors.h"

using namespace di;
using json = nlohmann::json;

namespace {

const std::string kGoldenDir = std::string(DI_SOURCE_DIR) + "/tests/data/golden/v41-tiny";

std::string read_file(const std::string& p) {
  std::ifstream f(p);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

json golden_hf() { return json::parse(read_file(kGoldenDir + "/model/config.json")); }

// Parses a mutated golden config; returns the LoadError message, or "" when it parses.
std::string error_of(const std::function<void(json&)>& mutate) {
  json j = golden_hf();
  mutate(j);
  try {
    V41Config::from_hf_json_text(j.dump(), "config.json");
  } catch (const LoadError& e) {
    return e.what();
  }
  return "";
}

void expect_error(const std::function<void(json&)>& mutate, std::initializer_list<std::string> fragments) {
  const std::string msg = error_of(mutate);
  ASSERT_FALSE(msg.empty()) << "config should be rejected";
  EXPECT_EQ(msg.rfind("config.json: ", 0), 0u) << msg;
  for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "'" << f << "' not in: " << msg;
}

// The config under the official inference/config.json (ModelArgs) names.
json model_args_json(const V41Config& c) {
  json j;
  j["vocab_size"] = c.vocab_size;
  j["dim"] = c.dim;
  j["moe_inter_dim"] = c.moe_inter_dim;
  j["n_layers"] = c.n_layers;
  j["n_mtp_layers"] = c.n_mtp_layers;
  j["dspark_block_size"] = c.dspark_block_size;
  j["dspark_noise_token_id"] = c.dspark_noise_token_id;
  j["dspark_target_layer_ids"] = c.dspark_target_layer_ids;
  j["dspark_markov_rank"] = c.dspark_markov_rank;
  j["dspark_n_routed_experts"] = c.dspark_n_routed_experts;
  j["dspark_n_activated_experts"] = c.dspark_n_activated_experts;
  j["n_heads"] = c.n_heads;
  j["n_routed_experts"] = c.n_routed_experts;
  j["n_shared_experts"] = c.n_shared_experts;
  j["n_activated_experts"] = c.n_activated_experts;
  j["score_func"] = c.score_func;
  j["route_scale"] = c.route_scale;
  j["swiglu_limit"] = c.swiglu_limit;
  j["q_lora_rank"] = c.q_lora_rank;
  j["head_dim"] = c.head_dim;
  j["rope_head_dim"] = c.rope_head_dim;
  j["norm_eps"] = c.norm_eps;
  j["o_groups"] = c.o_groups;
  j["o_lora_rank"] = c.o_lora_rank;
  j["window_size"] = c.window_size;
  j["kv_source_layers"] = c.kv_source_layers;
  j["index_source_layers"] = c.index_source_layers;
  j["original_seq_len"] = c.original_seq_len;
  j["rope_theta"] = c.rope_theta;
  j["rope_factor"] = c.rope_factor;
  j["beta_fast"] = c.beta_fast;
  j["beta_slow"] = c.beta_slow;
  j["index_n_heads"] = c.index_n_heads;
  j["index_head_dim"] = c.index_head_dim;
  j["index_topk"] = c.index_topk;
  j["candidate_source_layer"] = c.candidate_source_layer;
  j["candidate_topk_blocks"] = c.candidate_topk_blocks;
  j["candidate_block_size"] = c.candidate_block_size;
  j["hc_mult"] = c.hc_mult;
  j["hc_sinkhorn_iters"] = c.hc_sinkhorn_iters;
  j["hc_eps"] = c.hc_eps;
  j["engram_layer_ids"] = c.engram_layer_ids;
  j["engram_vocab_size"] = c.engram_vocab_size;
  j["engram_max_ngram_size"] = c.engram_max_ngram_size;
  j["engram_pad_id"] = c.engram_pad_id;
  j["engram_compressed_vocab_size"] = c.engram_compressed_vocab_size;
  j["dtype"] = c.dtype;
  j["expert_dtype"] = c.expert_dtype;
  j["compress_rope_theta"] = c.compress_rope_theta;
  j["compress_ratios"] = c.compress_ratios;
  j["engram_n_heads"] = c.engram_n_heads;
  j["engram_head_dim"] = c.engram_head_dim;
  j["vision_n_layers"] = c.vision_n_layers;
  j["vision_dim"] = c.vision_dim;
  j["vision_n_heads"] = c.vision_n_heads;
  j["vision_inter_dim"] = c.vision_inter_dim;
  j["vision_patch_size"] = c.vision_patch_size;
  j["vision_downsample_ratio"] = c.vision_downsample_ratio;
  j["vision_max_n_token"] = c.vision_max_n_token;
  j["vision_min_pixels"] = c.vision_min_pixels;
  j["vision_max_wh_ratio"] = c.vision_max_wh_ratio > 0 ? json(c.vision_max_wh_ratio) : json(nullptr);
  j["image_token_id"] = c.image_token_id;
  j["vision_rope_theta"] = c.vision_rope_theta;
  j["engram_num_embeddings"] = c.engram_num_embeddings;
  return j;
}

// Values equal; floats compared after rounding the expected value to the field's float type.
bool same_value(const json& want, const json& got) {
  if (want.is_number_float() || got.is_number_float()) {
    if (!want.is_number() || !got.is_number()) return false;
    return float(want.get<double>()) == float(got.get<double>());
  }
  if (want.is_array()) {
    if (!got.is_array() || got.size() != want.size()) return false;
    for (size_t i = 0; i < want.size(); ++i)
      if (!same_value(want[i], got[i])) return false;
    return true;
  }
  return want == got;
}

}  // namespace

TEST(Config, GoldenMatchesOfficialInferenceConfig) {
  const V41Config c = V41Config::from_hf_file(kGoldenDir + "/model/config.json");
  const json want = json::parse(read_file(kGoldenDir + "/expected/inference_config.json"));
  const json got = model_args_json(c);
  ASSERT_GT(want.size(), 60u);
  for (auto it = want.begin(); it != want.end(); ++it) {
    ASSERT_TRUE(got.contains(it.key())) << "no field for ModelArgs key " << it.key();
    EXPECT_TRUE(same_value(it.value(), got[it.key()]))
        << it.key() << ": expected " << it.value().dump() << ", got " << got[it.key()].dump();
  }
  // Fields that are not ModelArgs keys.
  EXPECT_EQ(c.bos_token_id, 0);
  EXPECT_EQ(c.eos_token_id, 1);
  EXPECT_EQ(c.pad_token_id, 2);
  EXPECT_EQ(c.scale_fmt, "ue8m0");
  EXPECT_EQ(c.weight_block_size, 32);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.max_position_embeddings, 1048576);
  EXPECT_EQ(c.norm_eps, 1e-20f);
  // Derived helpers.
  EXPECT_TRUE(c.is_kv_source(4));
  EXPECT_FALSE(c.is_kv_source(3));
  EXPECT_TRUE(c.is_index_source(7));
  EXPECT_TRUE(c.is_engram_layer(1));
  EXPECT_FALSE(c.is_engram_layer(2));
  EXPECT_EQ(c.compress_ratio(5), 1);
  EXPECT_EQ(c.n_total_layers(), 11);
  EXPECT_EQ(c.n_routed_experts_of(7), 8);
  EXPECT_EQ(c.n_routed_experts_of(8), 6);
  EXPECT_EQ(c.n_activated_experts_of(9), 3);
  EXPECT_FALSE(c.vision_enabled());
}

TEST(Config, FileErrors) {
  try {
    V41Config::from_hf_file("/nonexistent/dir/config.json");
    ADD_FAILURE();
  } catch (const LoadError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/dir/config.json"), std::string::npos);
  }
  EXPECT_THROW(V41Config::from_hf_json_text("{\"model_type\": ", "c.json"), LoadError);
  try {
    V41Config::from_hf_json_text("{\"model_type\": ", "c.json");
  } catch (const LoadError& e) {
    EXPECT_NE(std::string(e.what()).find("c.json: invalid JSON"), std::string::npos) << e.what();
  }
  try {
    V41Config::from_hf_json_text("[1]", "c.json");
  } catch (const LoadError& e) {
    EXPECT_NE(std::string(e.what()).find("c.json: expected a JSON object at top level, got array"), std::string::npos)
        << e.what();
  }
}

TEST(Config, ExactErrorMessageStyle) {
  EXPECT_EQ(error_of([](json& j) { j["text_config"]["hidden_size"] = "64"; }),
            "config.json: text_config.hidden_size: expected integer, got string");
  EXPECT_EQ(error_of([](json& j) { j["text_config"].erase("hidden_size"); }),
            "config.json: text_config.hidden_size: missing key");
  EXPECT_EQ(error_of([](json& j) { j["text_config"]["hidden_size"] = 64.5; }),
            "config.json: text_config.hidden_size: expected integer, got float");
  EXPECT_EQ(error_of([](json& j) { j["text_config"]["rope_scaling"]["factor"] = "16"; }),
            "config.json: text_config.rope_scaling.factor: expected number, got string");
  EXPECT_EQ(error_of([](json& j) { j["text_config"]["compress_ratios"][3] = true; }),
            "config.json: text_config.compress_ratios[3]: expected integer, got boolean");
  EXPECT_EQ(error_of([](json& j) { j["text_config"]["hidden_size"] = 1ll << 40; }),
            "config.json: text_config.hidden_size: integer 1099511627776 out of range");
}

// Every key the parser reads must be reported by its full path when missing.
TEST(Config, EveryRequiredKeyMissing) {
  const json g = golden_hf();
  // Descriptive keys that are optional (checked only when present) and informational top-level keys.
  const std::set<std::string> optional = {"text_config.model_type", "text_config.num_key_value_heads",
                                          "text_config.hidden_act", "text_config.attention_bias",
                                          "text_config.topk_method", "text_config.rope_scaling.rope_type",
                                          "quantization_config.activation_scheme", "vision_config.model_type",
                                          "architectures", "dtype", "vision_config"};
  int checked = 0;
  std::function<void(const json&, const std::string&, std::vector<std::string>)> walk =
      [&](const json& obj, const std::string& prefix, std::vector<std::string> path) {
        for (auto it = obj.begin(); it != obj.end(); ++it) {
          const std::string key = prefix + it.key();
          auto p = path;
          p.push_back(it.key());
          if (!optional.count(key)) {
            const std::string msg = error_of([&](json& j) {
              json* o = &j;
              for (size_t i = 0; i + 1 < p.size(); ++i) o = &(*o)[p[i]];
              o->erase(p.back());
            });
            EXPECT_EQ(msg, "config.json: " + key + ": missing key") << key;
            ++checked;
          }
          if (it->is_object()) walk(*it, key + ".", p);
        }
      };
  walk(g, "", {});
  EXPECT_EQ(checked, 75);  // every required key of the golden file
  // Optional parts really are optional: without them the golden config still parses.
  for (const std::string& k : optional) {
    const std::string msg = error_of([&](json& j) {
      const auto dot = k.find('.');
      if (dot == std::string::npos) j.erase(k);
      else if (k.rfind("text_config.rope_scaling.", 0) == 0) j["text_config"]["rope_scaling"].erase(k.substr(25));
      else j[k.substr(0, dot)].erase(k.substr(dot + 1));
    });
    EXPECT_EQ(msg, "") << k;
  }
}

// Every leaf of the wrong JSON type is reported with its path and the expected type.
TEST(Config, EveryKeyWrongType) {
  const json g = golden_hf();
  int checked = 0;
  std::function<void(const json&, const std::string&, std::vector<std::string>)> walk =
      [&](const json& obj, const std::string& prefix, std::vector<std::string> path) {
        for (auto it = obj.begin(); it != obj.end(); ++it) {
          const std::string key = prefix + it.key();
          auto p = path;
          p.push_back(it.key());
          if (key == "architectures" || key == "dtype") continue;  // informational, not read
          // A value of another type: strings become numbers, everything else a string.
          const json bad = it->is_string() ? json(7) : json("oops");
          const std::string msg = error_of([&](json& j) {
            json* o = &j;
            for (size_t i = 0; i + 1 < p.size(); ++i) o = &(*o)[p[i]];
            (*o)[p.back()] = bad;
          });
          EXPECT_EQ(msg.rfind("config.json: " + key + ": expected ", 0), 0u) << key << " -> " << msg;
          ++checked;
          if (it->is_object()) walk(*it, key + ".", p);
        }
      };
  walk(g, "", {});
  EXPECT_EQ(checked, 84);  // every key of the golden file but the 2 informational ones
}

TEST(Config, UnsupportedDescriptiveValues) {
  expect_error([](json& j) { j["model_type"] = "deepseek_v3"; }, {"model_type", "deepseek_v3", "deepseek_v41"});
  expect_error([](json& j) { j["text_config"]["num_key_value_heads"] = 8; }, {"text_config.num_key_value_heads", "only 1"});
  expect_error([](json& j) { j["text_config"]["hidden_act"] = "gelu"; }, {"text_config.hidden_act"});
  expect_error([](json& j) { j["text_config"]["attention_bias"] = true; }, {"text_config.attention_bias"});
  expect_error([](json& j) { j["text_config"]["rope_scaling"]["rope_type"] = "linear"; },
               {"text_config.rope_scaling.rope_type"});
  expect_error([](json& j) { j["quantization_config"]["weight_block_size"] = {32, 64}; },
               {"quantization_config.weight_block_size", "two equal"});
  expect_error([](json& j) { j["quantization_config"]["weight_block_size"] = {128, 128}; },
               {"weight_block_size 128 unsupported"});
}

TEST(Config, Inconsistencies) {
  auto t = [](std::function<void(json&)> f) { return [f](json& j) { f(j["text_config"]); }; };
  struct Case { std::function<void(json&)> mutate; std::vector<std::string> want; };
  const std::vector<Case> cases = {
      {t([](json& c) { c["compress_ratios"].erase(10); }), {"compress_ratios has 10 entries", "8 + 3 = 11"}},
      {t([](json& c) { c["num_nextn_predict_layers"] = 2; }), {"compress_ratios has 11 entries", "8 + 2 = 10"}},
      {t([](json& c) { c["compress_ratios"][9] = 1; }), {"compress_ratios[9] = 1", "DSpark stages are window-only"}},
      {t([](json& c) { c["compress_ratios"][1] = -1; }), {"compress_ratios[1] = -1 is negative"}},
      {t([](json& c) { c["kv_source_layer_ids"] = {2, 4, 9}; }), {"kv_source_layers entry 9 outside [0, 8)"}},
      {t([](json& c) { c["kv_source_layer_ids"] = {4, 2, 5}; }), {"kv_source_layers [4,2,5] must be strictly increasing"}},
      {t([](json& c) { c["index_source_layer_ids"] = {2, 5, 4, 7}; }), {"index_source_layers [2,5,4,7] must be strictly increasing"}},
      {t([](json& c) { c["index_source_layer_ids"] = {2, 5, 7}; }), {"kv source layer 4 is not an index source"}},
      {t([](json& c) { c["kv_source_layer_ids"] = {4, 5}; c["index_source_layer_ids"] = {4, 5, 7}; }),
       {"layer 2 has compress ratio 2 but no kv source at or before it",
        "layer 2 has compress ratio 2 but no index source at or before it"}},
      {t([](json& c) { c["kv_source_layer_ids"] = {2, 4}; c["index_source_layer_ids"] = {2, 4, 7}; }),
       {"layer 5 (ratio 1) would read kv source 4 of ratio 2", "candidate_source_layer 5 must be a ratio-1 kv and index source"}},
      {t([](json& c) { c["compress_ratios"][1] = 2; }), {"layer 1 has compress ratio 2 but no kv source"}},
      {t([](json& c) { c["kv_source_layer_ids"] = {1, 2, 4, 5}; c["index_source_layer_ids"] = {1, 2, 4, 5, 7}; }),
       {"kv source layer 1 has compress ratio 0", "index source layer 1 has compress ratio 0"}},
      {t([](json& c) { c["candidate_source_layer_id"] = 4; }), {"candidate_source_layer 4 must be a ratio-1 kv and index source"}},
      {t([](json& c) { c["candidate_source_layer_id"] = 7; }), {"candidate_source_layer 7 must be a ratio-1 kv and index source"}},
      {t([](json& c) { c["candidate_source_layer_id"] = -1; }), {"candidate_source_layer is off (-1) but ratio-1 layers exist"}},
      {t([](json& c) { c["candidate_topk_blocks"] = 0; }), {"candidate_topk_blocks and candidate_block_size must be >= 1"}},
      {t([](json& c) { c["hidden_size"] = 48; }), {"dim (48) must be a positive multiple of 32"}},
      {t([](json& c) { c["head_dim"] = 40; }), {"head_dim (40) must be a positive multiple of 32"}},
      {t([](json& c) { c["qk_rope_head_dim"] = 15; }), {"rope_head_dim (15) must be even"}},
      {t([](json& c) { c["qk_rope_head_dim"] = 128; }), {"rope_head_dim (128) must be even, > 0 and <= head_dim"}},
      {t([](json& c) { c["o_groups"] = 3; }), {"n_heads (8) must be divisible by o_groups (3)"}},
      {t([](json& c) { c["index_head_dim"] = 48; }), {"index_head_dim (48) must be a positive multiple of 32"}},
      {t([](json& c) { c["moe_intermediate_size"] = 40; }), {"moe_inter_dim (40) must be a positive multiple of 32"}},
      {t([](json& c) { c["q_lora_rank"] = 20; }), {"q_lora_rank (20) must be a positive multiple of 32"}},
      {t([](json& c) { c["num_experts_per_tok"] = 9; }), {"n_activated_experts (9) must be in [1, n_routed_experts = 8]"}},
      {t([](json& c) { c["num_experts_per_tok"] = 0; }), {"n_activated_experts (0)"}},
      {t([](json& c) { c["dspark_num_experts_per_tok"] = 7; }), {"dspark_n_activated_experts (7) must be in [1, dspark_n_routed_experts = 6]"}},
      {t([](json& c) { c["n_shared_experts"] = 2; }), {"n_shared_experts must be 1 (got 2)"}},
      {t([](json& c) { c["scoring_func"] = "softmax"; }), {"score_func \"softmax\" unsupported"}},
      {[](json& j) { j["quantization_config"]["quant_method"] = "bf16"; }, {"quant_method) \"bf16\" unsupported"}},
      {[](json& j) { j["quantization_config"]["scale_fmt"] = "fp32"; }, {"scale_fmt \"fp32\" unsupported"}},
      {[](json& j) { j["quantization_config"]["expert_dtype"] = "fp8"; }, {"expert_dtype \"fp8\" unsupported"}},
      {t([](json& c) { c["engram_layer_ids"] = {1, 8}; }), {"engram_layer_ids entry 8 outside [0, 8)"}},
      {t([](json& c) { c["engram_layer_ids"] = {4, 1}; }), {"engram_layer_ids [4,1] must be strictly increasing"}},
      {t([](json& c) { c["engram_num_embeddings"] = {660}; }), {"engram_num_embeddings has 1 entries, expected one per engram layer (2)"}},
      {t([](json& c) { c["engram_num_embeddings"] = {660, 0}; }), {"engram_num_embeddings entries must be > 0"}},
      {t([](json& c) { c["engram_head_dim"] = 48; }), {"engram_head_dim (48) must be a positive multiple of 32"}},
      {t([](json& c) { c["engram_max_ngram_size"] = 1; }), {"engram_max_ngram_size must be >= 2"}},
      {t([](json& c) { c["dspark_target_layer_ids"] = {5, 6, 8}; }), {"dspark_target_layer_ids entry 8 outside [0, 8)"}},
      {t([](json& c) { c["dspark_target_layer_ids"] = json::array(); }), {"dspark_target_layer_ids must not be empty"}},
      {t([](json& c) { c["dspark_block_size"] = 0; }), {"dspark_block_size must be >= 1"}},
      {t([](json& c) { c["dspark_noise_token_id"] = 129280; }), {"dspark_noise_token_id outside the vocabulary"}},
      {t([](json& c) { c["hc_mult"] = 0; }), {"hc_mult must be >= 1"}},
      {t([](json& c) { c["sliding_window"] = 0; }), {"window_size must be >= 1"}},
      {t([](json& c) { c["index_topk"] = 0; }), {"index_topk must be >= 1"}},
      {t([](json& c) { c["num_hidden_layers"] = 0; c["compress_ratios"] = {0, 0, 0}; }), {"n_layers must be >= 1"}},
      {[](json& j) { j["eos_token_id"] = 200000; }, {"eos_token_id (200000) outside the vocabulary"}},
      {[](json& j) { j["vision_config"]["num_hidden_layers"] = 2; j["vision_config"]["num_attention_heads"] = 7; },
       {"vision hidden_size must be a positive multiple of vision num_attention_heads"}},
  };
  for (const Case& c : cases) {
    const std::string msg = error_of(c.mutate);
    ASSERT_FALSE(msg.empty()) << "should be rejected: " << c.want[0];
    EXPECT_EQ(msg.rfind("config.json: invalid config: ", 0), 0u) << msg;
    for (const auto& w : c.want) EXPECT_NE(msg.find(w), std::string::npos) << "'" << w << "' not in: " << msg;
  }
  // Several problems are all reported.
  const std::string many = error_of(t([](json& c) { c["hidden_size"] = 48; c["hc_mult"] = 0; }));
  EXPECT_NE(many.find("dim (48)"), std::string::npos) << many;
  EXPECT_NE(many.find("hc_mult must be >= 1"), std::string::npos) << many;
}

TEST(Config, ValidVariantsAccepted) {
  // No ratio-1 layers and no candidate source; no engram; no DSpark; vision on.
  const std::string msg = error_of([](json& j) {
    json& c = j["text_config"];
    c["compress_ratios"] = {0, 2, 2, 0, 0};
    c["num_hidden_layers"] = 4;
    c["num_nextn_predict_layers"] = 1;
    c["kv_source_layer_ids"] = {1};
    c["index_source_layer_ids"] = {1, 2};
    c["candidate_source_layer_id"] = -1;
    c["engram_layer_ids"] = json::array();
    c["engram_num_embeddings"] = json::array();
    c["dspark_target_layer_ids"] = {3};
    j["vision_config"]["num_hidden_layers"] = 2;
  });
  EXPECT_EQ(msg, "");
  // A text-only config may omit vision_config.
  EXPECT_EQ(error_of([](json& j) { j.erase("vision_config"); }), "");
}

TEST(Config, ToHfJsonReproducesGoldenFile) {
  const V41Config c = V41Config::from_hf_file(kGoldenDir + "/model/config.json");
  const json written = json::parse(c.to_hf_json());
  // Same document (numbers compare by value: 10000 == 10000.0).
  EXPECT_EQ(written, golden_hf()) << written.dump(1);
  // And it parses back to the same config.
  const V41Config back = V41Config::from_hf_json_text(c.to_hf_json(), "written");
  EXPECT_EQ(model_args_json(back), model_args_json(c));
  EXPECT_EQ(back.to_hf_json(), c.to_hf_json());
  // Floats are written in their shortest form.
  EXPECT_NE(c.to_hf_json().find("\"rms_norm_eps\": 1e-20"), std::string::npos);
}

TEST(Config, RoundTripOfAnotherConfig) {
  V41Config c = V41Config::from_hf_file(kGoldenDir + "/model/config.json");
  c.dim = 96;
  c.n_heads = 6;
  c.o_groups = 3;
  c.head_dim = 96;
  c.rope_head_dim = 32;
  c.window_size = 5;
  c.n_routed_experts = 5;
  c.n_activated_experts = 3;
  c.dspark_n_routed_experts = 4;
  c.dspark_n_activated_experts = 2;
  c.route_scale = 2.25f;
  c.swiglu_limit = 7.5f;
  c.norm_eps = 1e-6f;
  c.hc_eps = 3e-7f;
  c.rope_theta = 12345.5;
  c.vision_n_layers = 3;
  c.vision_max_wh_ratio = 2.5;
  c.engram_num_embeddings = {123456789012ll, 5};
  c.validate("modified");
  const V41Config back = V41Config::from_hf_json_text(c.to_hf_json(), "modified");
  EXPECT_EQ(model_args_json(back), model_args_json(c));
  EXPECT_EQ(back.route_scale, 2.25f);
  EXPECT_EQ(back.norm_eps, 1e-6f);
  EXPECT_EQ(back.hc_eps, 3e-7f);
  EXPECT_EQ(back.vision_max_wh_ratio, 2.5);
  EXPECT_EQ(back.engram_num_embeddings[0], 123456789012ll);
}
