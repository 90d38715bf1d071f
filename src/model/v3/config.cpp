#include "model/v3/config.h"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "io/hf_config.h"
#include "io/safetensors.h"  // LoadError

namespace di::v3 {

using json = nlohmann::json;

namespace {

bool names_v3(const json& j) {
  const HfArchitecture a = hf_architecture(j);
  return a.model_type == "deepseek_v3" ||
         std::find(a.architectures.begin(), a.architectures.end(), "DeepseekV3ForCausalLM") != a.architectures.end();
}

V3Config config_from_json(const json& j, const std::string& origin);

}  // namespace

bool is_v3_config_text(const std::string& text) {
  const json j = json::parse(text, nullptr, false);
  return j.is_object() && names_v3(j);
}

double V3Config::softmax_scale() const {
  double s = std::pow(double(qk_head_dim()), -0.5);
  if (yarn_active()) {
    const double m = 0.1 * mscale_all_dim * std::log(rope_factor) + 1.0;
    s = s * m * m;
  }
  return s;
}

void V3Config::rope_freqs(float* out) const {
  const int d = qk_rope_head_dim, half = d / 2;
  for (int i = 0; i < half; ++i) out[i] = 1.0f / std::pow(float(rope_theta), float(2 * i) / float(d));
  if (!yarn_active()) return;
  auto corr_dim = [&](double rot) {
    return d * std::log(double(original_seq_len) / (rot * 2 * M_PI)) / (2 * std::log(rope_theta));
  };
  const double low = std::max(std::floor(corr_dim(beta_fast)), 0.0);
  double high = std::min(std::ceil(corr_dim(beta_slow)), double(d - 1));
  if (low == high) high += 0.001;
  const float lo = float(low), span = float(high) - float(low), factor = float(rope_factor);
  for (int i = 0; i < half; ++i) {
    const float ramp = std::clamp((float(i) - lo) / span, 0.0f, 1.0f);
    const float smooth = 1.0f - ramp;
    out[i] = out[i] / factor * (1.0f - smooth) + out[i] * smooth;
  }
}

V3Config V3Config::from_hf_json_text(const std::string& text, const std::string& origin) {
  return config_from_json(parse_json_object(text, origin), origin);
}

V3Config V3Config::from_hf_file(const std::string& path) { return config_from_json(read_json_file(path), path); }

namespace {

V3Config config_from_json(const json& j, const std::string& origin) {
  // Every integer of a V3 config is a size, a count or an id: negative ones are out of range.
  const HfConfigSection r(j, "", origin);
  V3Config c;
  if (!names_v3(j) || (r.has_value("model_type") && r.str("model_type") != "deepseek_v3"))
    r.fail("model_type", "not deepseek_v3 / DeepseekV3ForCausalLM");
  c.vocab_size = r.i64("vocab_size");
  c.dim = r.i32("hidden_size", 0);
  c.inter_dim = r.i32("intermediate_size", 0);
  c.moe_inter_dim = r.i32("moe_intermediate_size", 0);
  c.n_layers = r.i32("num_hidden_layers", 0);
  c.n_dense_layers = r.i32("first_k_dense_replace", 0);
  c.n_mtp_layers = r.has_value("num_nextn_predict_layers") ? r.i32("num_nextn_predict_layers", 0) : 0;
  c.n_heads = r.i32("num_attention_heads", 0);
  if (r.has_value("num_key_value_heads") && r.i32("num_key_value_heads", 0) != c.n_heads)
    r.fail("num_key_value_heads", "must equal num_attention_heads (MLA)");
  c.q_lora_rank = r.has_value("q_lora_rank") ? r.i32("q_lora_rank", 0) : 0;  // null: no q low-rank
  c.kv_lora_rank = r.i32("kv_lora_rank", 0);
  c.qk_nope_head_dim = r.i32("qk_nope_head_dim", 0);
  c.qk_rope_head_dim = r.i32("qk_rope_head_dim", 0);
  c.v_head_dim = r.i32("v_head_dim", 0);
  c.n_routed_experts = r.i32("n_routed_experts", 0);
  c.n_shared_experts = r.has_value("n_shared_experts") ? r.i32("n_shared_experts", 0) : 0;
  c.n_activated_experts = r.i32("num_experts_per_tok", 0);
  c.n_group = r.has_value("n_group") ? r.i32("n_group", 0) : 1;
  c.topk_group = r.has_value("topk_group") ? r.i32("topk_group", 0) : 1;
  c.scoring_func = r.has_value("scoring_func") ? r.str("scoring_func") : "softmax";
  c.topk_method = r.has_value("topk_method") ? r.str("topk_method") : "greedy";
  c.norm_topk_prob = r.has_value("norm_topk_prob") ? r.boolean("norm_topk_prob") : false;
  c.routed_scaling_factor = float(r.has_value("routed_scaling_factor") ? r.num("routed_scaling_factor") : 1.0);
  c.rms_norm_eps = float(r.num("rms_norm_eps"));
  c.rope_theta = r.has_value("rope_theta") ? r.num("rope_theta") : 10000.0;
  c.max_position_embeddings = r.i64("max_position_embeddings");
  c.bos_token_id = r.has_value("bos_token_id") ? r.i64("bos_token_id") : 0;
  c.eos_token_id = r.has_value("eos_token_id") ? r.i64("eos_token_id") : 1;
  c.tie_word_embeddings = r.has_value("tie_word_embeddings") ? r.boolean("tie_word_embeddings") : false;
  if (r.has_value("hidden_act") && r.str("hidden_act") != "silu") r.fail("hidden_act", "only silu is supported");
  if (r.has_value("moe_layer_freq") && r.i32("moe_layer_freq", 0) != 1) r.fail("moe_layer_freq", "only 1 is supported");
  if (r.has_value("attention_bias") && r.boolean("attention_bias")) r.fail("attention_bias", "only false is supported");

  c.yarn = false;
  c.rope_factor = 1;
  if (r.has_value("rope_scaling")) {
    if (!r.at("rope_scaling").is_object()) r.fail("rope_scaling", "expected object or null");
    const HfConfigSection s = r.sub("rope_scaling");
    const std::string type = s.has_value("type") ? s.str("type") : s.has_value("rope_type") ? s.str("rope_type") : "";
    if (type != "yarn") s.fail("type", "'" + type + "' is not supported (only yarn)");
    c.yarn = true;
    c.rope_factor = s.num("factor");
    c.original_seq_len = s.i64("original_max_position_embeddings");
    c.beta_fast = s.has_value("beta_fast") ? s.num("beta_fast") : 32;
    c.beta_slow = s.has_value("beta_slow") ? s.num("beta_slow") : 1;
    c.mscale = s.has_value("mscale") ? s.num("mscale") : 1;
    c.mscale_all_dim = s.has_value("mscale_all_dim") ? s.num("mscale_all_dim") : 0;
  }

  c.fp8 = false;
  c.scale_fmt.clear();
  if (r.has_value("quantization_config")) {
    const HfConfigSection s = r.sub("quantization_config");
    if (s.str("quant_method") != "fp8") s.fail("quant_method", "only fp8 is supported");
    if (s.has_value("fmt") && s.str("fmt") != "e4m3") s.fail("fmt", "only e4m3 is supported");
    if (s.has_value("activation_scheme") && s.str("activation_scheme") != "dynamic")
      s.fail("activation_scheme", "only dynamic is supported");
    const json& b = s.at("weight_block_size");
    if (!b.is_array() || b.size() != 2 || !b[0].is_number_integer() || !b[1].is_number_integer() ||
        b[0].get<int64_t>() <= 0 || b[1].get<int64_t>() <= 0 || b[0].get<int64_t>() > 65536 ||
        b[1].get<int64_t>() > 65536)
      s.fail("weight_block_size", "expected two positive integers");
    c.fp8 = true;
    c.block_out = b[0].get<int>();
    c.block_in = b[1].get<int>();
    if (s.has_value("scale_fmt")) {
      c.scale_fmt = s.str("scale_fmt");
      if (c.scale_fmt != "ue8m0") s.fail("scale_fmt", "'" + c.scale_fmt + "' is not supported (only ue8m0)");
    }
  }
  c.validate(origin);
  return c;
}

}  // namespace

void V3Config::validate(const std::string& origin) const {
  auto fail = [&](const std::string& m) { throw LoadError(origin + ": " + m); };
  if (vocab_size <= 0 || vocab_size > (int64_t(1) << 31)) fail("vocab_size out of range");
  if (dim <= 0 || inter_dim <= 0 || moe_inter_dim <= 0 || n_layers <= 0 || n_heads <= 0 || kv_lora_rank <= 0 ||
      qk_nope_head_dim <= 0 || qk_rope_head_dim <= 0 || v_head_dim <= 0)
    fail("dimensions must be positive");
  if (qk_rope_head_dim % 2) fail("qk_rope_head_dim must be even (interleaved RoPE pairs)");
  if (n_dense_layers > n_layers) fail("first_k_dense_replace > num_hidden_layers");
  if (n_dense_layers < n_layers) {
    if (n_routed_experts <= 0 || n_activated_experts <= 0 || n_activated_experts > n_routed_experts)
      fail("num_experts_per_tok must be in 1..n_routed_experts");
    if (n_group <= 0 || n_routed_experts % n_group) fail("n_routed_experts must be a multiple of n_group");
    if (topk_group <= 0 || topk_group > n_group) fail("topk_group must be in 1..n_group");
    if (n_activated_experts > topk_group * (n_routed_experts / n_group))
      fail("num_experts_per_tok exceeds the experts of topk_group groups");
    if (scoring_func != "sigmoid" && scoring_func != "softmax") fail("scoring_func must be sigmoid or softmax");
    if (topk_method != "noaux_tc" && topk_method != "greedy" && topk_method != "group_limited_greedy")
      fail("topk_method must be noaux_tc, greedy or group_limited_greedy");
    if (topk_method == "noaux_tc" && n_group > 1 && n_routed_experts / n_group < 2)
      fail("noaux_tc group scores need at least 2 experts per group");
    if (scoring_func == "sigmoid" && !norm_topk_prob)
      fail("scoring_func sigmoid needs norm_topk_prob true (the official code always normalizes)");
  }
  if (rms_norm_eps < 0) fail("rms_norm_eps must be >= 0");
  if (max_position_embeddings <= 0) fail("max_position_embeddings must be positive");
  if (yarn) {
    if (!(rope_factor >= 1)) fail("rope_scaling.factor must be >= 1");
    if (original_seq_len <= 0) fail("rope_scaling.original_max_position_embeddings must be positive");
    // HF's YaRN scales cos/sin by yarn_mscale(mscale)/yarn_mscale(mscale_all_dim); the official code
    // does not. Equal values (every release) make the two agree.
    if (mscale != mscale_all_dim) fail("rope_scaling.mscale != mscale_all_dim is not supported");
  }
  if (tie_word_embeddings) fail("tie_word_embeddings true is not supported");
  if (bos_token_id < 0 || bos_token_id >= vocab_size || eos_token_id < 0 || eos_token_id >= vocab_size)
    fail("bos/eos token id outside the vocabulary");
}

std::string V3Config::to_hf_json() const {
  json j;
  j["architectures"] = {"DeepseekV3ForCausalLM"};
  j["model_type"] = "deepseek_v3";
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["bos_token_id"] = bos_token_id;
  j["eos_token_id"] = eos_token_id;
  j["ep_size"] = 1;
  j["first_k_dense_replace"] = n_dense_layers;
  j["hidden_act"] = "silu";
  j["hidden_size"] = dim;
  j["intermediate_size"] = inter_dim;
  j["kv_lora_rank"] = kv_lora_rank;
  j["max_position_embeddings"] = max_position_embeddings;
  j["moe_intermediate_size"] = moe_inter_dim;
  j["moe_layer_freq"] = 1;
  j["n_group"] = n_group;
  j["n_routed_experts"] = n_routed_experts;
  j["n_shared_experts"] = n_shared_experts;
  j["norm_topk_prob"] = norm_topk_prob;
  j["num_attention_heads"] = n_heads;
  j["num_experts_per_tok"] = n_activated_experts;
  j["num_hidden_layers"] = n_layers;
  j["num_key_value_heads"] = n_heads;
  j["num_nextn_predict_layers"] = n_mtp_layers;
  j["q_lora_rank"] = q_lora_rank > 0 ? json(q_lora_rank) : json(nullptr);
  j["qk_nope_head_dim"] = qk_nope_head_dim;
  j["qk_rope_head_dim"] = qk_rope_head_dim;
  j["v_head_dim"] = v_head_dim;
  j["rms_norm_eps"] = double(rms_norm_eps);
  j["rope_theta"] = rope_theta;
  if (yarn)
    j["rope_scaling"] = {{"type", "yarn"},
                         {"factor", rope_factor},
                         {"original_max_position_embeddings", original_seq_len},
                         {"beta_fast", beta_fast},
                         {"beta_slow", beta_slow},
                         {"mscale", mscale},
                         {"mscale_all_dim", mscale_all_dim}};
  else
    j["rope_scaling"] = nullptr;
  j["routed_scaling_factor"] = double(routed_scaling_factor);
  j["scoring_func"] = scoring_func;
  j["topk_group"] = topk_group;
  j["topk_method"] = topk_method;
  j["tie_word_embeddings"] = false;
  j["torch_dtype"] = "bfloat16";
  j["vocab_size"] = vocab_size;
  if (fp8) {
    json q = {{"activation_scheme", "dynamic"}, {"fmt", "e4m3"}, {"quant_method", "fp8"},
              {"weight_block_size", {block_out, block_in}}};
    if (!scale_fmt.empty()) q["scale_fmt"] = scale_fmt;
    j["quantization_config"] = q;
  }
  return j.dump(2) + "\n";
}

}  // namespace di::v3
