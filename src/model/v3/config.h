// DeepSeek-V3 / R1 / V3.1 configuration: the HF config.json of `DeepseekV3ForCausalLM`
// (model_type deepseek_v3), with the derived quantities of the official inference code.
#pragma once

#include <cstdint>
#include <string>

namespace di::v3 {

struct V3Config {
  int64_t vocab_size = 129280;
  int dim = 7168;                 // hidden_size
  int inter_dim = 18432;          // intermediate_size (dense layers)
  int moe_inter_dim = 2048;       // moe_intermediate_size
  int n_layers = 61;              // num_hidden_layers
  int n_dense_layers = 3;         // first_k_dense_replace
  int n_mtp_layers = 1;           // num_nextn_predict_layers (loaded, not run)
  int n_heads = 128;              // num_attention_heads
  int q_lora_rank = 1536;         // 0 = no q low-rank (HF null): q = wq(x)
  int kv_lora_rank = 512;
  int qk_nope_head_dim = 128, qk_rope_head_dim = 64, v_head_dim = 128;
  int n_routed_experts = 256, n_shared_experts = 1, n_activated_experts = 8;
  int n_group = 8, topk_group = 4;
  std::string scoring_func = "sigmoid";  // sigmoid | softmax
  std::string topk_method = "noaux_tc";  // noaux_tc (e_score_correction_bias) | greedy | group_limited_greedy
  bool norm_topk_prob = true;
  float routed_scaling_factor = 2.5f;
  float rms_norm_eps = 1e-6f;
  double rope_theta = 10000;
  int64_t max_position_embeddings = 163840;
  // rope_scaling (type yarn); rope_factor 1 / no yarn when absent.
  bool yarn = false;
  int64_t original_seq_len = 4096;
  double rope_factor = 40, beta_fast = 32, beta_slow = 1, mscale = 1, mscale_all_dim = 1;
  int64_t bos_token_id = 0, eos_token_id = 1;
  bool tie_word_embeddings = false;
  // quantization_config: fp8 e4m3 128x128 (absent = unquantized BF16 checkpoint).
  bool fp8 = true;
  int block_out = 128, block_in = 128;
  std::string scale_fmt;  // "" (fp32 scales) | "ue8m0" (V3.1: every scale a power of two)

  int qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  bool is_moe(int layer) const { return layer >= n_dense_layers; }
  // YaRN applies only when the context exceeds the original one (official precompute_freqs_cis).
  bool yarn_active() const { return yarn && max_position_embeddings > original_seq_len; }
  // (qk_head_dim)^-0.5, times mscale^2 when YaRN is active (mscale = 0.1 mscale_all_dim ln(factor) + 1).
  double softmax_scale() const;
  // The rope_head_dim/2 frequencies (float32 arithmetic as torch computes them), YaRN-corrected.
  void rope_freqs(float* out) const;

  static V3Config from_hf_file(const std::string& path);
  static V3Config from_hf_json_text(const std::string& text, const std::string& origin);
  std::string to_hf_json() const;
  void validate(const std::string& origin) const;
};

// True when config.json text names this architecture (model_type deepseek_v3 or
// architectures DeepseekV3ForCausalLM).
bool is_v3_config_text(const std::string& text);

}  // namespace di::v3
