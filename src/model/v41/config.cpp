#include "model/v41/config.h"

#include "io/file_util.h"
#include "io/hf_config.h"

#include <algorithm>
#include <charconv>
#include <cmath>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"  // LoadError

namespace di {

using json = nlohmann::json;

bool V41Config::is_kv_source(int layer) const {
  return std::find(kv_source_layers.begin(), kv_source_layers.end(), layer) != kv_source_layers.end();
}
bool V41Config::is_index_source(int layer) const {
  return std::find(index_source_layers.begin(), index_source_layers.end(), layer) != index_source_layers.end();
}
bool V41Config::is_engram_layer(int layer) const {
  return std::find(engram_layer_ids.begin(), engram_layer_ids.end(), layer) != engram_layer_ids.end();
}

namespace {

using Section = HfConfigSection;

// Shortest decimal that reads back as the same float, so 1e-20f is written "1e-20", not
// "9.99999968e-21".
json float_json(float f) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, f);
  return json(std::strtod(std::string(buf, r.ptr).c_str(), nullptr));
}

std::string list_str(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "]";
}

V41Config config_from_json(const json& j, const std::string& origin) {
  V41Config c;
  const Section top(j, "", origin);
  std::string model_type;
  top.get("model_type", &model_type);
  if (model_type != "deepseek_v41")
    top.fail("model_type", "is \"" + model_type + "\", expected \"deepseek_v41\" (DeepSeek-V4.1 config)");
  top.get("bos_token_id", &c.bos_token_id);
  top.get("eos_token_id", &c.eos_token_id);
  top.get("pad_token_id", &c.pad_token_id);
  top.get("image_token_id", &c.image_token_id);

  const Section q = top.sub("quantization_config");
  q.get("quant_method", &c.dtype);
  q.get("scale_fmt", &c.scale_fmt);
  q.get("expert_dtype", &c.expert_dtype);
  if (q.has("activation_scheme")) q.get("activation_scheme", &c.activation_scheme);
  std::vector<int> wbs;
  q.get_list("weight_block_size", &wbs);
  if (wbs.size() != 2 || wbs[0] != wbs[1])
    q.fail("weight_block_size", "expected two equal block sizes, got " + list_str(wbs));
  c.weight_block_size = wbs[0];

  const Section t = top.sub("text_config");
  t.expect_if_present("model_type", std::string("deepseek_v41_text"));
  t.expect_if_present("num_key_value_heads", 1);
  t.expect_if_present("hidden_act", std::string("silu"));
  t.expect_if_present("attention_bias", false);
  t.expect_if_present("topk_method", std::string("noaux_tc"));
  t.get("vocab_size", &c.vocab_size);
  t.get("hidden_size", &c.dim);
  t.get("moe_intermediate_size", &c.moe_inter_dim);
  t.get("num_hidden_layers", &c.n_layers);
  t.get("num_nextn_predict_layers", &c.n_mtp_layers);
  t.get("num_attention_heads", &c.n_heads);
  t.get("head_dim", &c.head_dim);
  t.get("qk_rope_head_dim", &c.rope_head_dim);
  t.get("q_lora_rank", &c.q_lora_rank);
  t.get("o_groups", &c.o_groups);
  t.get("o_lora_rank", &c.o_lora_rank);
  t.get("n_routed_experts", &c.n_routed_experts);
  t.get("n_shared_experts", &c.n_shared_experts);
  t.get("num_experts_per_tok", &c.n_activated_experts);
  t.get("scoring_func", &c.score_func);
  t.get("routed_scaling_factor", &c.route_scale);
  t.get("swiglu_limit", &c.swiglu_limit);
  t.get("norm_topk_prob", &c.norm_topk_prob);
  t.get("rms_norm_eps", &c.norm_eps);
  t.get("sliding_window", &c.window_size);
  t.get_list("compress_ratios", &c.compress_ratios);
  t.get_list("kv_source_layer_ids", &c.kv_source_layers);
  t.get_list("index_source_layer_ids", &c.index_source_layers);
  t.get("rope_theta", &c.rope_theta);
  t.get("compress_rope_theta", &c.compress_rope_theta);
  t.get("max_position_embeddings", &c.max_position_embeddings);
  const Section rs = t.sub("rope_scaling");
  rs.expect_if_present("rope_type", std::string("yarn"));
  rs.get("factor", &c.rope_factor);
  rs.get("beta_fast", &c.beta_fast);
  rs.get("beta_slow", &c.beta_slow);
  rs.get("original_max_position_embeddings", &c.original_seq_len);
  t.get("index_n_heads", &c.index_n_heads);
  t.get("index_head_dim", &c.index_head_dim);
  t.get("index_topk", &c.index_topk);
  t.get("candidate_source_layer_id", &c.candidate_source_layer);
  t.get("candidate_topk_blocks", &c.candidate_topk_blocks);
  t.get("candidate_block_size", &c.candidate_block_size);
  t.get("hc_mult", &c.hc_mult);
  t.get("hc_sinkhorn_iters", &c.hc_sinkhorn_iters);
  t.get("hc_eps", &c.hc_eps);
  t.get_list("engram_layer_ids", &c.engram_layer_ids);
  t.get_list("engram_num_embeddings", &c.engram_num_embeddings);
  t.get("engram_max_ngram_size", &c.engram_max_ngram_size);
  t.get("engram_vocab_size", &c.engram_vocab_size);
  t.get("engram_n_heads", &c.engram_n_heads);
  t.get("engram_head_dim", &c.engram_head_dim);
  t.get("engram_pad_token_id", &c.engram_pad_id);
  t.get("engram_compressed_vocab_size", &c.engram_compressed_vocab_size);
  t.get("dspark_block_size", &c.dspark_block_size);
  t.get("dspark_noise_token_id", &c.dspark_noise_token_id);
  t.get_list("dspark_target_layer_ids", &c.dspark_target_layer_ids);
  t.get("dspark_markov_rank", &c.dspark_markov_rank);
  t.get("dspark_n_routed_experts", &c.dspark_n_routed_experts);
  t.get("dspark_num_experts_per_tok", &c.dspark_n_activated_experts);

  // A text-only config may omit vision_config entirely; when present it is read in full.
  c.vision_n_layers = 0;
  if (top.has("vision_config")) {
    const Section v = top.sub("vision_config");
    v.expect_if_present("model_type", std::string("deepseek_v41_vision"));
    v.get("num_hidden_layers", &c.vision_n_layers);
    v.get("hidden_size", &c.vision_dim);
    v.get("num_attention_heads", &c.vision_n_heads);
    v.get("intermediate_size", &c.vision_inter_dim);
    v.get("patch_size", &c.vision_patch_size);
    v.get("rope_theta", &c.vision_rope_theta);
    v.get("downsample_ratio", &c.vision_downsample_ratio);
    v.get("max_image_tokens", &c.vision_max_n_token);
    v.get("min_pixels", &c.vision_min_pixels);
    if (v.at("max_wh_ratio").is_null()) c.vision_max_wh_ratio = 0;
    else v.get("max_wh_ratio", &c.vision_max_wh_ratio);
  }
  c.validate(origin);
  return c;
}

}  // namespace

V41Config V41Config::from_hf_file(const std::string& path) { return config_from_json(read_json_file(path), path); }

V41Config V41Config::from_hf_json_text(const std::string& text, const std::string& origin) {
  return config_from_json(parse_json_object(text, origin), origin);
}

std::string V41Config::to_hf_json() const {
  json q = {{"quant_method", dtype},
            {"activation_scheme", activation_scheme},
            {"weight_block_size", {weight_block_size, weight_block_size}},
            {"scale_fmt", scale_fmt},
            {"expert_dtype", expert_dtype}};
  json t;
  t["model_type"] = "deepseek_v41_text";
  t["vocab_size"] = vocab_size;
  t["hidden_size"] = dim;
  t["moe_intermediate_size"] = moe_inter_dim;
  t["num_hidden_layers"] = n_layers;
  t["num_attention_heads"] = n_heads;
  t["num_key_value_heads"] = 1;
  t["head_dim"] = head_dim;
  t["qk_rope_head_dim"] = rope_head_dim;
  t["q_lora_rank"] = q_lora_rank;
  t["o_lora_rank"] = o_lora_rank;
  t["o_groups"] = o_groups;
  t["hidden_act"] = "silu";
  t["swiglu_limit"] = float_json(swiglu_limit);
  t["rms_norm_eps"] = float_json(norm_eps);
  t["attention_bias"] = false;
  t["max_position_embeddings"] = max_position_embeddings;
  t["rope_theta"] = rope_theta;
  t["rope_scaling"] = {{"rope_type", "yarn"},
                       {"factor", rope_factor},
                       {"beta_fast", beta_fast},
                       {"beta_slow", beta_slow},
                       {"original_max_position_embeddings", original_seq_len}};
  t["n_routed_experts"] = n_routed_experts;
  t["n_shared_experts"] = n_shared_experts;
  t["num_experts_per_tok"] = n_activated_experts;
  t["scoring_func"] = score_func;
  t["topk_method"] = "noaux_tc";
  t["norm_topk_prob"] = norm_topk_prob;
  t["routed_scaling_factor"] = float_json(route_scale);
  t["sliding_window"] = window_size;
  t["compress_ratios"] = compress_ratios;
  t["compress_rope_theta"] = compress_rope_theta;
  t["kv_source_layer_ids"] = kv_source_layers;
  t["index_source_layer_ids"] = index_source_layers;
  t["index_n_heads"] = index_n_heads;
  t["index_head_dim"] = index_head_dim;
  t["index_topk"] = index_topk;
  t["candidate_source_layer_id"] = candidate_source_layer;
  t["candidate_topk_blocks"] = candidate_topk_blocks;
  t["candidate_block_size"] = candidate_block_size;
  t["hc_mult"] = hc_mult;
  t["hc_sinkhorn_iters"] = hc_sinkhorn_iters;
  t["hc_eps"] = float_json(hc_eps);
  t["engram_layer_ids"] = engram_layer_ids;
  t["engram_num_embeddings"] = engram_num_embeddings;
  t["engram_max_ngram_size"] = engram_max_ngram_size;
  t["engram_vocab_size"] = engram_vocab_size;
  t["engram_n_heads"] = engram_n_heads;
  t["engram_head_dim"] = engram_head_dim;
  t["engram_pad_token_id"] = engram_pad_id;
  t["engram_compressed_vocab_size"] = engram_compressed_vocab_size;
  t["num_nextn_predict_layers"] = n_mtp_layers;
  t["dspark_block_size"] = dspark_block_size;
  t["dspark_noise_token_id"] = dspark_noise_token_id;
  t["dspark_target_layer_ids"] = dspark_target_layer_ids;
  t["dspark_markov_rank"] = dspark_markov_rank;
  t["dspark_n_routed_experts"] = dspark_n_routed_experts;
  t["dspark_num_experts_per_tok"] = dspark_n_activated_experts;

  json v = {{"model_type", "deepseek_v41_vision"},
            {"num_hidden_layers", vision_n_layers},
            {"hidden_size", vision_dim},
            {"num_attention_heads", vision_n_heads},
            {"intermediate_size", vision_inter_dim},
            {"patch_size", vision_patch_size},
            {"rope_theta", vision_rope_theta},
            {"downsample_ratio", vision_downsample_ratio},
            {"max_image_tokens", vision_max_n_token},
            {"min_pixels", vision_min_pixels},
            {"max_wh_ratio", vision_max_wh_ratio > 0 ? json(vision_max_wh_ratio) : json(nullptr)}};

  json top;
  top["architectures"] = {"DeepseekV41ForCausalLM"};
  top["model_type"] = "deepseek_v41";
  top["dtype"] = "bfloat16";
  top["bos_token_id"] = bos_token_id;
  top["eos_token_id"] = eos_token_id;
  top["pad_token_id"] = pad_token_id;
  top["image_token_id"] = image_token_id;
  top["quantization_config"] = q;
  top["text_config"] = t;
  top["vision_config"] = v;
  return top.dump(2) + "\n";
}

void V41Config::validate(const std::string& origin) const {
  std::vector<std::string> errs;
  auto need = [&](bool ok, const std::string& msg) {
    if (!ok) errs.push_back(msg);
  };
  const int L = n_layers, T = n_layers + n_mtp_layers;

  // sizes
  need(vocab_size > 0, "vocab_size must be > 0");
  need(n_layers >= 1, "n_layers must be >= 1");
  need(n_mtp_layers >= 0, "n_mtp_layers must be >= 0");
  need(dim > 0 && dim % 32 == 0, "dim (" + std::to_string(dim) + ") must be a positive multiple of 32");
  need(n_heads > 0, "n_heads must be > 0");
  need(head_dim > 0 && head_dim % 32 == 0, "head_dim (" + std::to_string(head_dim) + ") must be a positive multiple of 32");
  need(rope_head_dim > 0 && rope_head_dim % 2 == 0 && rope_head_dim <= head_dim,
       "rope_head_dim (" + std::to_string(rope_head_dim) + ") must be even, > 0 and <= head_dim");
  need(q_lora_rank > 0 && q_lora_rank % 32 == 0,
       "q_lora_rank (" + std::to_string(q_lora_rank) + ") must be a positive multiple of 32");
  need(o_groups > 0 && n_heads % std::max(o_groups, 1) == 0,
       "n_heads (" + std::to_string(n_heads) + ") must be divisible by o_groups (" + std::to_string(o_groups) + ")");
  need(o_lora_rank > 0, "o_lora_rank must be > 0");
  need(moe_inter_dim > 0 && moe_inter_dim % 32 == 0,
       "moe_inter_dim (" + std::to_string(moe_inter_dim) + ") must be a positive multiple of 32");
  need(window_size >= 1, "window_size must be >= 1");
  need(hc_mult >= 1, "hc_mult must be >= 1");
  need(hc_sinkhorn_iters >= 1, "hc_sinkhorn_iters must be >= 1");
  need(hc_eps >= 0, "hc_eps must be >= 0");
  need(norm_eps >= 0, "norm_eps must be >= 0");
  need(max_position_embeddings > 0, "max_position_embeddings must be > 0");
  need(rope_theta > 0 && compress_rope_theta > 0, "rope_theta and compress_rope_theta must be > 0");
  need(rope_factor >= 1, "rope_factor must be >= 1");
  need(original_seq_len >= 0, "original_seq_len must be >= 0");
  need(beta_fast > beta_slow && beta_slow > 0, "beta_fast must exceed beta_slow, both > 0");

  // MoE
  need(n_routed_experts >= 1, "n_routed_experts must be >= 1");
  need(n_activated_experts >= 1 && n_activated_experts <= n_routed_experts,
       "n_activated_experts (" + std::to_string(n_activated_experts) + ") must be in [1, n_routed_experts = " +
           std::to_string(n_routed_experts) + "]");
  need(n_shared_experts == 1, "n_shared_experts must be 1 (got " + std::to_string(n_shared_experts) + ")");
  need(score_func == "sqrtsoftplus", "score_func \"" + score_func + "\" unsupported (only sqrtsoftplus)");
  need(route_scale > 0, "route_scale must be > 0");
  need(swiglu_limit >= 0, "swiglu_limit must be >= 0");

  // quantization
  need(dtype == "fp8", "quantization dtype (quant_method) \"" + dtype + "\" unsupported (only fp8)");
  need(weight_block_size == 32, "weight_block_size " + std::to_string(weight_block_size) + " unsupported (only 32)");
  need(scale_fmt == "ue8m0", "scale_fmt \"" + scale_fmt + "\" unsupported (only ue8m0)");
  need(expert_dtype == "fp4", "expert_dtype \"" + expert_dtype + "\" unsupported (only fp4)");

  // token ids
  auto in_vocab = [&](int64_t id, const char* what) {
    need(id >= 0 && id < vocab_size, std::string(what) + " (" + std::to_string(id) + ") outside the vocabulary");
  };
  in_vocab(bos_token_id, "bos_token_id");
  in_vocab(eos_token_id, "eos_token_id");
  in_vocab(pad_token_id, "pad_token_id");
  in_vocab(image_token_id, "image_token_id");

  // layer roles
  const bool ratios_ok = int(compress_ratios.size()) == T;
  need(ratios_ok, "compress_ratios has " + std::to_string(compress_ratios.size()) + " entries, expected n_layers + n_mtp_layers = " +
                      std::to_string(L) + " + " + std::to_string(n_mtp_layers) + " = " + std::to_string(T));
  if (ratios_ok) {
    for (int i = 0; i < T; ++i) {
      const int r = compress_ratios[size_t(i)];
      need(r >= 0, "compress_ratios[" + std::to_string(i) + "] = " + std::to_string(r) + " is negative");
      if (i >= L) need(r == 0, "compress_ratios[" + std::to_string(i) + "] = " + std::to_string(r) +
                                    ": DSpark stages are window-only, expected 0");
    }
  }
  auto check_layer_list = [&](const std::vector<int>& ids, const std::string& what, int limit) {
    for (size_t i = 0; i < ids.size(); ++i) {
      need(ids[i] >= 0 && ids[i] < limit, what + " entry " + std::to_string(ids[i]) + " outside [0, " +
                                              std::to_string(limit) + ")");
      if (i) need(ids[i] > ids[i - 1], what + " " + list_str(ids) + " must be strictly increasing");
    }
  };
  check_layer_list(kv_source_layers, "kv_source_layers", L);
  check_layer_list(index_source_layers, "index_source_layers", L);
  for (int k : kv_source_layers)
    need(is_index_source(k), "kv source layer " + std::to_string(k) + " is not an index source (its indexer owns the index keys)");
  if (ratios_ok) {
    auto ratio = [&](int l) { return (l >= 0 && l < T) ? compress_ratios[size_t(l)] : -1; };
    for (int k : kv_source_layers)
      need(ratio(k) > 0, "kv source layer " + std::to_string(k) + " has compress ratio 0");
    for (int k : index_source_layers)
      need(ratio(k) > 0, "index source layer " + std::to_string(k) + " has compress ratio 0");
    // A compressed layer reads the most recent source's cache, which must have its own ratio.
    for (int i = 0; i < L; ++i) {
      const int r = ratio(i);
      if (r <= 0) continue;
      int kv = -1, ix = -1;
      for (int k : kv_source_layers) if (k <= i) kv = std::max(kv, k);
      for (int k : index_source_layers) if (k <= i) ix = std::max(ix, k);
      if (kv < 0) errs.push_back("layer " + std::to_string(i) + " has compress ratio " + std::to_string(r) + " but no kv source at or before it");
      else need(ratio(kv) == r, "layer " + std::to_string(i) + " (ratio " + std::to_string(r) + ") would read kv source " +
                                    std::to_string(kv) + " of ratio " + std::to_string(ratio(kv)));
      if (ix < 0) errs.push_back("layer " + std::to_string(i) + " has compress ratio " + std::to_string(r) + " but no index source at or before it");
      else need(ratio(ix) == r, "layer " + std::to_string(i) + " (ratio " + std::to_string(r) + ") would read index source " +
                                    std::to_string(ix) + " of ratio " + std::to_string(ratio(ix)));
    }
    bool any_ratio1 = false;
    for (int i = 0; i < L; ++i) any_ratio1 |= ratio(i) == 1;
    if (candidate_source_layer >= 0) {
      const int cs = candidate_source_layer;
      need(cs < L && is_kv_source(cs) && is_index_source(cs) && ratio(cs) == 1,
           "candidate_source_layer " + std::to_string(cs) + " must be a ratio-1 kv and index source");
      need(candidate_topk_blocks >= 1 && candidate_block_size >= 1,
           "candidate_topk_blocks and candidate_block_size must be >= 1");
      for (int k : index_source_layers)
        if (k > cs) need(ratio(k) == ratio(cs), "index source " + std::to_string(k) + " uses the candidates of layer " +
                                                    std::to_string(cs) + " but has another compress ratio");
    } else {
      need(!any_ratio1, "candidate_source_layer is off (" + std::to_string(candidate_source_layer) +
                            ") but ratio-1 layers exist");
    }
  }
  need(index_n_heads >= 1, "index_n_heads must be >= 1");
  need(index_head_dim > 0 && index_head_dim % 32 == 0,
       "index_head_dim (" + std::to_string(index_head_dim) + ") must be a positive multiple of 32");
  need(index_head_dim >= rope_head_dim, "index_head_dim must be >= rope_head_dim");
  need(index_topk >= 1, "index_topk must be >= 1");

  // Engram
  check_layer_list(engram_layer_ids, "engram_layer_ids", L);
  need(engram_num_embeddings.size() == engram_layer_ids.size(),
       "engram_num_embeddings has " + std::to_string(engram_num_embeddings.size()) + " entries, expected one per engram layer (" +
           std::to_string(engram_layer_ids.size()) + ")");
  for (int64_t n : engram_num_embeddings) need(n > 0, "engram_num_embeddings entries must be > 0");
  if (!engram_layer_ids.empty()) {
    need(engram_max_ngram_size >= 2, "engram_max_ngram_size must be >= 2");
    need(engram_n_heads >= 1, "engram_n_heads must be >= 1");
    need(engram_head_dim > 0 && engram_head_dim % 32 == 0,
         "engram_head_dim (" + std::to_string(engram_head_dim) + ") must be a positive multiple of 32");
    need(engram_vocab_size > 0, "engram_vocab_size must be > 0");
    need(engram_compressed_vocab_size > 0, "engram_compressed_vocab_size must be > 0");
    need(engram_pad_id >= 0 && engram_pad_id < vocab_size, "engram_pad_id outside the vocabulary");
  }

  // DSpark
  if (n_mtp_layers > 0) {
    need(dspark_block_size >= 1, "dspark_block_size must be >= 1 when n_mtp_layers > 0");
    need(!dspark_target_layer_ids.empty(), "dspark_target_layer_ids must not be empty when n_mtp_layers > 0");
    need(dspark_markov_rank >= 1, "dspark_markov_rank must be >= 1");
    need(dspark_noise_token_id >= 0 && dspark_noise_token_id < vocab_size, "dspark_noise_token_id outside the vocabulary");
    const int nr = n_routed_experts_of(L), na = n_activated_experts_of(L);
    need(nr >= 1 && na >= 1 && na <= nr, "dspark_n_activated_experts (" + std::to_string(na) +
                                             ") must be in [1, dspark_n_routed_experts = " + std::to_string(nr) + "]");
  }
  check_layer_list(dspark_target_layer_ids, "dspark_target_layer_ids", L);

  // Vision
  if (vision_n_layers < 0) errs.push_back("vision_n_layers must be >= 0");
  if (vision_n_layers > 0) {
    need(vision_dim > 0 && vision_n_heads > 0 && vision_dim % vision_n_heads == 0,
         "vision hidden_size must be a positive multiple of vision num_attention_heads");
    need(vision_inter_dim > 0 && vision_patch_size > 0 && vision_downsample_ratio > 0,
         "vision intermediate_size, patch_size and downsample_ratio must be > 0");
  }

  if (errs.empty()) return;
  std::string msg = origin + ": invalid config: " + errs[0];
  for (size_t i = 1; i < errs.size(); ++i) msg += "; " + errs[i];
  throw LoadError(msg);
}

}  // namespace di
