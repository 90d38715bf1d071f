// Views of a DeepSeek-V3 checkpoint's tensors in the HF release layout (names and dtypes as
// shipped): FP8 E4M3 projections with fp32 weight_scale_inv per 128x128 block, BF16 embedding,
// norms, router and head, fp32 e_score_correction_bias. The views point into the memory-mapped
// files; nothing is dequantized at load time.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "model/v3/config.h"
#include "model/v3/ops.h"

namespace di::v3 {

struct Bf16Vec { const uint16_t* p = nullptr; int64_t n = 0; };

struct MlpWeights { Linear gate, up, down; };  // w2(silu(w1 x) * w3 x) = down(silu(gate x) * up x)

struct AttentionWeights {
  Linear wq;            // no q low-rank: [heads * qk_head_dim, dim]
  Linear wq_a, wq_b;    // q low-rank: [q_lora, dim], [heads * qk_head_dim, q_lora]
  Bf16Vec q_norm;       // [q_lora]
  Linear wkv_a;         // [kv_lora + rope, dim]
  Bf16Vec kv_norm;      // [kv_lora]
  Linear wkv_b;         // [heads * (nope + v), kv_lora]: per head nope rows, then v rows
  Linear wo;            // [dim, heads * v]
};

struct MoeWeights {
  Linear gate;                 // router [n_routed, dim] (BF16)
  const float* bias = nullptr;  // e_score_correction_bias [n_routed] (noaux_tc), for selection only
  std::vector<MlpWeights> experts;
  bool has_shared = false;
  MlpWeights shared;           // [n_shared * moe_inter]
};

struct LayerWeights {
  Bf16Vec attn_norm, ffn_norm;  // input_layernorm, post_attention_layernorm
  AttentionWeights attn;
  bool moe = false;
  MlpWeights mlp;  // dense layers
  MoeWeights experts;
};

// The multi-token-prediction module (model.layers.{n_layers + i}): loaded and kept for speculative
// decoding, not run by the forward pass.
struct MtpWeights {
  Bf16Vec enorm, hnorm, head_norm;
  Linear eh_proj;              // [dim, 2 * dim]
  LayerWeights block;
  Bf16Vec embed;               // its own copy when the checkpoint has one, else the main embedding
  Linear head;                 // likewise for the head
};

struct ModelWeights {
  Bf16Vec embed;  // [vocab, dim]
  Bf16Vec norm;
  Linear head;    // [vocab, dim] BF16
  std::vector<LayerWeights> layers;
  std::vector<MtpWeights> mtp;
  std::vector<std::unique_ptr<std::vector<float>>> owned;  // scales converted from E8M0 / BF16 biases
};

// Binds every tensor, checking dtypes and shapes (and that ue8m0 scales are powers of two); a
// tensor the architecture does not name is an error too. Throws LoadError naming the tensor.
ModelWeights bind_weights(const Checkpoint& ckpt, const V3Config& cfg);

}  // namespace di::v3
