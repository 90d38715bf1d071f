// The V4.1 model configuration: the HF config.json of a V4.1 release (top level + text_config +
// quantization_config) mapped onto the official inference ModelArgs names.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace di {

struct V41Config {
  // top level
  int64_t bos_token_id = 0, eos_token_id = 1, pad_token_id = 2, image_token_id = 129264;
  // quantization_config
  std::string dtype = "fp8", expert_dtype = "fp4", scale_fmt = "ue8m0";
  int weight_block_size = 32;
  // text_config, under the official ModelArgs names
  int64_t vocab_size = 129280;
  int dim = 5120;
  int moe_inter_dim = 2304;
  int n_layers = 40;
  int n_mtp_layers = 3;
  int n_heads = 64;
  int head_dim = 512;
  int rope_head_dim = 64;
  int q_lora_rank = 1280;
  int o_groups = 8;
  int o_lora_rank = 1024;
  int n_routed_experts = 384;
  int n_shared_experts = 1;
  int n_activated_experts = 6;
  std::string score_func = "sqrtsoftplus";
  float route_scale = 1.5f;
  float swiglu_limit = 10.0f;
  bool norm_topk_prob = true;
  float norm_eps = 1e-20f;
  int window_size = 128;
  std::vector<int> compress_ratios;  // n_layers + n_mtp_layers entries
  std::vector<int> kv_source_layers;
  std::vector<int> index_source_layers;
  int64_t original_seq_len = 65536;
  double rope_theta = 10000, compress_rope_theta = 160000, rope_factor = 16;
  double beta_fast = 32, beta_slow = 1;
  int64_t max_position_embeddings = 1048576;
  int index_n_heads = 32, index_head_dim = 128, index_topk = 512;
  int candidate_source_layer = 20, candidate_topk_blocks = 2048, candidate_block_size = 8;
  int hc_mult = 4, hc_sinkhorn_iters = 20;
  float hc_eps = 1e-6f;
  std::vector<int> engram_layer_ids;
  std::vector<int64_t> engram_num_embeddings;
  int engram_max_ngram_size = 4;
  int64_t engram_vocab_size = 16000000;
  int engram_n_heads = 8, engram_head_dim = 256;
  int64_t engram_pad_id = 2;
  int64_t engram_compressed_vocab_size = 99092;
  int dspark_block_size = 5;
  int64_t dspark_noise_token_id = 128799;
  std::vector<int> dspark_target_layer_ids;
  int dspark_markov_rank = 256;
  int dspark_n_routed_experts = 128, dspark_n_activated_experts = 3;
  int vision_n_layers = 0;
  // vision_config (shapes of the vision tower; only used when vision_n_layers > 0)
  int vision_dim = 1024, vision_n_heads = 16, vision_inter_dim = 2816, vision_patch_size = 14;
  int vision_downsample_ratio = 3, vision_max_n_token = 1024;
  int64_t vision_min_pixels = 295936;
  double vision_rope_theta = 10000;
  double vision_max_wh_ratio = 0;  // 0 = null (no limit)

  // HF keys that are not ModelArgs fields but are kept so to_hf_json() writes a release-shaped file.
  // (quantization_config.quant_method is `dtype` above.)
  std::string activation_scheme = "dynamic";

  // Derived helpers.
  bool is_kv_source(int layer) const;
  bool is_index_source(int layer) const;
  bool is_engram_layer(int layer) const;
  bool vision_enabled() const { return vision_n_layers > 0; }
  int n_total_layers() const { return n_layers + n_mtp_layers; }
  // Routed / activated experts of a layer (DSpark stages, ids >= n_layers, have their own).
  // A DSpark count of 0 falls back to the backbone's, as in the reference's get_moe_config.
  int n_routed_experts_of(int layer) const {
    return layer < n_layers || dspark_n_routed_experts == 0 ? n_routed_experts : dspark_n_routed_experts;
  }
  int n_activated_experts_of(int layer) const {
    return layer < n_layers || dspark_n_activated_experts == 0 ? n_activated_experts : dspark_n_activated_experts;
  }
  int compress_ratio(int layer) const { return compress_ratios.at(size_t(layer)); }

  // Parses an HF config.json (file path). Throws LoadError naming the file and key on a missing
  // key, wrong type, or inconsistency (e.g. compress_ratios length != n_layers + n_mtp_layers).
  static V41Config from_hf_file(const std::string& path);
  static V41Config from_hf_json_text(const std::string& text, const std::string& origin);
  // Writes the HF layout back (used by make-tiny).
  std::string to_hf_json() const;
  // Consistency checks; throws LoadError with `origin` in the message.
  void validate(const std::string& origin) const;
};

}  // namespace di
