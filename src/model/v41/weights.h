// Views of a V4.1 checkpoint's tensors, grouped per layer, in the release's packed formats. They
// point into the memory-mapped safetensors files until repack_weights moves the streamed ones.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "core/huge_buffer.h"
#include "core/numerics.h"
#include "model/v41/config.h"
#include "io/safetensors.h"
#include "kernels/cpu/ref_ops.h"

namespace di {
class ThreadPool;
}

namespace di::v41 {

struct F32Vec { const float* p = nullptr; int64_t n = 0; };
struct Bf16Vec { const uint16_t* p = nullptr; int64_t n = 0; };

struct CompressorWeights {
  ref::Bf16Weight wkv, wgate;  // wgate only for ratio > 1
  Bf16Vec norm;
};

struct IndexerWeights {
  ref::Fp8Weight wq_b;           // [index_heads*index_head_dim, q_lora]
  ref::Bf16Weight weights_proj;  // [index_heads, dim]
  ref::Bf16Weight wk;            // key owners only: [index_head_dim, head_dim]
  Bf16Vec k_norm;
};

struct AttentionWeights {
  ref::Fp8Weight wq_a, wq_b, wkv, wo_a, wo_b;
  Bf16Vec q_norm, kv_norm;
  F32Vec attn_sink;
  bool has_compressor = false, has_indexer = false, owns_index_k = false;
  CompressorWeights compressor;
  IndexerWeights indexer;
};

struct ExpertWeights { ref::Fp4Weight w1, w2, w3; };
struct SharedExpertWeights { ref::Fp8Weight w1, w2, w3; };

struct MoEWeights {
  ref::Bf16Weight gate;  // [n_experts, dim]
  F32Vec gate_bias;
  std::vector<ExpertWeights> experts;
  SharedExpertWeights shared;
};

struct EngramWeights {
  const uint8_t* table = nullptr;        // E4M3 [rows, head_dim]
  const uint8_t* table_scale = nullptr;  // E8M0 [rows, head_dim/32]
  int64_t rows = 0;
  ref::Fp8Weight wkv;                    // [(hc+1)*dim, n_cols*head_dim]
  Bf16Vec q_weight, k_weight;            // [hc, dim]
};

struct HcWeights {
  ref::F32Weight fn;  // [(2+hc)*hc, hc*dim]
  F32Vec base, scale;
};

struct BlockWeights {
  Bf16Vec attn_norm, ffn_norm;
  HcWeights hc_attn, hc_ffn;
  AttentionWeights attn;
  MoEWeights moe;
  bool has_engram = false;
  EngramWeights engram;
};

struct ModelWeights {
  Bf16Vec embed;  // [vocab, dim]
  ref::Bf16Weight head;
  Bf16Vec norm;
  std::vector<BlockWeights> layers;  // backbone only; DSpark stages are bound by the speculative decoder
};

// Binds every backbone tensor, checking dtype and shape. Throws LoadError naming the tensor.
ModelWeights bind_weights(const Checkpoint& ckpt, const V41Config& cfg);

// Repacks every FP8/FP4 weight the quantized kernels read into the active ISA's layout
// (kern::pack_weight), sets the views' `packed`, copies the dense weights a step streams (head,
// wo_a codes, bf16/fp32 projections) unchanged, repoints their views, and drops the checkpoint
// pages all of them came from, so resident memory stays about one copy; wo_a alone is kept in
// both layouts where its certified kernel reads the repacked one (kern::packed_bytes_dequant): its
// exact recomputations read the checkpoint rows (exact numerics; fast numerics read wo_a like the
// other FP8 linears). Returns the buffer (huge pages where the kernel allows). A set `cancel` stops
// it between weights with LoadCancelled.
HugeBuffer repack_weights(ModelWeights& w, ThreadPool* pool, const std::atomic<bool>* cancel = nullptr,
                          Numerics numerics = Numerics::Exact);

// Throws LoadCancelled ("WHAT: model loading cancelled") when `cancel` is set (null: never).
void throw_if_cancelled(const std::atomic<bool>* cancel, const std::string& what);

}  // namespace di::v41
