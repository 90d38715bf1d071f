#include "model/v41/weights.h"

#include <cstring>
#include <functional>
#include <string>
#include <type_traits>

#include "kernels/cpu/kernels.h"

namespace di::v41 {
namespace {

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

class Binder {
 public:
  Binder(const Checkpoint& ckpt) : ckpt_(ckpt) {}

  ref::Fp8Weight fp8(const std::string& name, int64_t out, int64_t in) const {
    const auto& w = ckpt_.expect(name + ".weight", DType::F8_E4M3, {out, in});
    const auto& s = ckpt_.expect(name + ".scale", DType::F8_E8M0, {cdiv(out, 32), cdiv(in, 32)});
    return {w.data, s.data, out, in};
  }
  ref::Fp4Weight fp4(const std::string& name, int64_t out, int64_t in) const {
    const auto& w = ckpt_.expect(name + ".weight", DType::I8, {out, in / 2});
    const auto& s = ckpt_.expect(name + ".scale", DType::F8_E8M0, {out, in / 32});
    return {w.data, s.data, out, in};
  }
  ref::Bf16Weight bf16(const std::string& name, int64_t out, int64_t in) const {
    return {ckpt_.expect(name, DType::BF16, {out, in}).as<uint16_t>(), out, in};
  }
  ref::F32Weight f32(const std::string& name, int64_t out, int64_t in) const {
    return {ckpt_.expect(name, DType::F32, {out, in}).as<float>(), out, in};
  }
  Bf16Vec bf16_vec(const std::string& name, int64_t n) const {
    return {ckpt_.expect(name, DType::BF16, {n}).as<uint16_t>(), n};
  }
  F32Vec f32_vec(const std::string& name, int64_t n) const {
    return {ckpt_.expect(name, DType::F32, {n}).as<float>(), n};
  }

 private:
  const Checkpoint& ckpt_;
};

}  // namespace

ModelWeights bind_weights(const Checkpoint& ckpt, const V41Config& c) {
  Binder b(ckpt);
  ModelWeights m;
  m.embed = {ckpt.expect("embed.weight", DType::BF16, {c.vocab_size, c.dim}).as<uint16_t>(), c.vocab_size * c.dim};
  m.head = b.bf16("head.weight", c.vocab_size, c.dim);
  m.norm = b.bf16_vec("norm.weight", c.dim);
  const int hc = c.hc_mult, mix = (2 + hc) * hc;
  for (int i = 0; i < c.n_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    BlockWeights L;
    L.attn_norm = b.bf16_vec(p + "attn_norm.weight", c.dim);
    L.ffn_norm = b.bf16_vec(p + "ffn_norm.weight", c.dim);
    for (auto [hw, nm] : {std::pair{&L.hc_attn, "hc_attn"}, std::pair{&L.hc_ffn, "hc_ffn"}}) {
      hw->fn = b.f32(p + nm + "_fn", mix, int64_t(hc) * c.dim);
      hw->base = b.f32_vec(p + nm + "_base", mix);
      hw->scale = b.f32_vec(p + nm + "_scale", 3);
    }
    auto& A = L.attn;
    const std::string a = p + "attn.";
    A.wq_a = b.fp8(a + "wq_a", c.q_lora_rank, c.dim);
    A.q_norm = b.bf16_vec(a + "q_norm.weight", c.q_lora_rank);
    A.wq_b = b.fp8(a + "wq_b", int64_t(c.n_heads) * c.head_dim, c.q_lora_rank);
    A.wkv = b.fp8(a + "wkv", c.head_dim, c.dim);
    A.kv_norm = b.bf16_vec(a + "kv_norm.weight", c.head_dim);
    A.wo_a = b.fp8(a + "wo_a", int64_t(c.o_groups) * c.o_lora_rank, int64_t(c.n_heads) * c.head_dim / c.o_groups);
    A.wo_b = b.fp8(a + "wo_b", c.dim, int64_t(c.o_groups) * c.o_lora_rank);
    A.attn_sink = b.f32_vec(a + "attn_sink", c.n_heads);
    A.has_compressor = c.is_kv_source(i);
    A.owns_index_k = A.has_compressor;
    A.has_indexer = c.is_index_source(i);
    if (A.has_compressor) {
      A.compressor.wkv = b.bf16(a + "compressor.wkv.weight", c.head_dim, c.dim);
      if (c.compress_ratio(i) > 1) A.compressor.wgate = b.bf16(a + "compressor.wgate.weight", c.head_dim, c.dim);
      A.compressor.norm = b.bf16_vec(a + "compressor.norm.weight", c.head_dim);
    }
    if (A.has_indexer) {
      A.indexer.wq_b = b.fp8(a + "indexer.wq_b", int64_t(c.index_n_heads) * c.index_head_dim, c.q_lora_rank);
      A.indexer.weights_proj = b.bf16(a + "indexer.weights_proj.weight", c.index_n_heads, c.dim);
      if (A.owns_index_k) {
        A.indexer.wk = b.bf16(a + "indexer.wk.weight", c.index_head_dim, c.head_dim);
        A.indexer.k_norm = b.bf16_vec(a + "indexer.k_norm.weight", c.index_head_dim);
      }
    }
    auto& F = L.moe;
    const std::string f = p + "ffn.";
    F.gate = b.bf16(f + "gate.weight", c.n_routed_experts, c.dim);
    F.gate_bias = b.f32_vec(f + "gate.bias", c.n_routed_experts);
    F.experts.resize(size_t(c.n_routed_experts));
    for (int e = 0; e < c.n_routed_experts; ++e) {
      const std::string x = f + "experts." + std::to_string(e) + ".";
      F.experts[size_t(e)] = {b.fp4(x + "w1", c.moe_inter_dim, c.dim), b.fp4(x + "w2", c.dim, c.moe_inter_dim),
                              b.fp4(x + "w3", c.moe_inter_dim, c.dim)};
    }
    F.shared = {b.fp8(f + "shared_experts.w1", c.moe_inter_dim, c.dim), b.fp8(f + "shared_experts.w2", c.dim, c.moe_inter_dim),
                b.fp8(f + "shared_experts.w3", c.moe_inter_dim, c.dim)};
    if (c.is_engram_layer(i)) {
      L.has_engram = true;
      auto& E = L.engram;
      const std::string e = p + "engram.";
      size_t idx = 0;
      while (c.engram_layer_ids[idx] != i) ++idx;
      E.rows = c.engram_num_embeddings.at(idx);
      E.table = ckpt.expect(e + "embed.weight", DType::F8_E4M3, {E.rows, c.engram_head_dim}).data;
      E.table_scale = ckpt.expect(e + "embed.scale", DType::F8_E8M0, {E.rows, c.engram_head_dim / 32}).data;
      const int64_t cols = int64_t(c.engram_max_ngram_size - 1) * c.engram_n_heads;
      E.wkv = b.fp8(e + "wkv", int64_t(hc + 1) * c.dim, cols * c.engram_head_dim);
      E.q_weight = {ckpt.expect(e + "q_weight", DType::BF16, {hc, c.dim}).as<uint16_t>(), int64_t(hc) * c.dim};
      E.k_weight = {ckpt.expect(e + "k_weight", DType::BF16, {hc, c.dim}).as<uint16_t>(), int64_t(hc) * c.dim};
    }
    m.layers.push_back(std::move(L));
  }
  return m;
}

size_t code_bytes(const ref::Fp8Weight& w) { return size_t(w.out * w.in); }
size_t code_bytes(const ref::Fp4Weight& w) { return size_t(w.out * w.in / 2); }

void throw_if_cancelled(const std::atomic<bool>* cancel, const std::string& what) {
  if (cancel && cancel->load(std::memory_order_relaxed)) throw LoadCancelled(what + ": model loading cancelled");
}

HugeBuffer repack_weights(ModelWeights& m, ThreadPool* pool, const std::atomic<bool>* cancel, Numerics numerics) {
  auto check_cancel = [cancel] { throw_if_cancelled(cancel, "repacking weights"); };
  std::vector<ref::Fp8Weight*> fp8, fp8_kept;  // kept: repacked and still read in the checkpoint layout
  std::vector<ref::Fp4Weight*> fp4;
  // Dense weights a decode step streams in full, copied as they are onto huge pages: from the
  // file mapping's 4 KiB pages every page costs a TLB miss and a hardware-prefetch restart.
  struct Dense {
    const void* src;
    size_t bytes;
    std::function<void(const uint8_t*)> rebind;
  };
  std::vector<Dense> dense;
  auto add_dense = [&](auto& ptr, size_t bytes) {
    using T = std::remove_reference_t<decltype(*ptr)>;
    if (ptr && bytes) dense.push_back({ptr, bytes, [&ptr](const uint8_t* p) { ptr = reinterpret_cast<T*>(p); }});
  };
  auto add_bf16 = [&](ref::Bf16Weight& w) { add_dense(w.w, size_t(w.out * w.in) * 2); };
  add_bf16(m.head);
  for (auto& L : m.layers) {
    auto& A = L.attn;
    for (auto* w : {&A.wq_a, &A.wq_b, &A.wkv, &A.wo_b}) fp8.push_back(w);
    if (A.has_indexer) fp8.push_back(&A.indexer.wq_b);
    for (auto* w : {&L.moe.shared.w1, &L.moe.shared.w2, &L.moe.shared.w3}) fp8.push_back(w);
    if (L.has_engram) fp8.push_back(&L.engram.wkv);
    for (auto& e : L.moe.experts)
      for (auto* w : {&e.w1, &e.w2, &e.w3}) fp4.push_back(w);
    if (numerics == Numerics::Fast) {
      fp8.push_back(&A.wo_a);
    } else {
      add_dense(A.wo_a.w, code_bytes(A.wo_a));  // its exact recomputations read the checkpoint layout
      fp8_kept.push_back(&A.wo_a);
    }
    add_bf16(A.compressor.wkv);
    add_bf16(A.compressor.wgate);
    add_bf16(A.indexer.weights_proj);
    add_bf16(A.indexer.wk);
    add_bf16(L.moe.gate);
    for (auto* hc : {&L.hc_attn, &L.hc_ffn}) add_dense(hc->fn.w, size_t(hc->fn.out * hc->fn.in) * 4);
  }
  auto round_up = [](size_t n) { return (n + 63) / 64 * 64; };
  // Sizes once: packed_bytes scans an FP8 tensor's codes on some ISAs.
  std::vector<size_t> fp8_bytes, fp4_bytes, kept_bytes;
  for (auto* w : fp8) fp8_bytes.push_back(kern::packed_bytes(*w));
  for (auto* w : fp4) fp4_bytes.push_back(kern::packed_bytes(*w));
  for (auto* w : fp8_kept) kept_bytes.push_back(kern::packed_bytes_dequant(*w));
  size_t total = 0;
  for (size_t n : fp8_bytes) total += round_up(n);
  for (size_t n : kept_bytes) total += round_up(n);
  for (size_t n : fp4_bytes) total += round_up(n);
  for (const auto& d : dense) total += round_up(d.bytes);
  HugeBuffer buf(total);
  uint8_t* at = buf.data();
  auto place = [&](auto* w, size_t n) {
    check_cancel();
    if (!n) return;
    kern::pack_weight(*w, at, pool);
    at += round_up(n);
    release_mapped_pages(w->w, code_bytes(*w));
  };
  for (size_t i = 0; i < fp8.size(); ++i) place(fp8[i], fp8_bytes[i]);
  for (size_t i = 0; i < fp4.size(); ++i) place(fp4[i], fp4_bytes[i]);
  for (size_t i = 0; i < fp8_kept.size(); ++i)
    if (kept_bytes[i]) {
      check_cancel();
      kern::pack_weight_dequant(*fp8_kept[i], at, pool);
      at += round_up(kept_bytes[i]);
    }
  for (const auto& d : dense) {
    std::memcpy(at, d.src, d.bytes);
    release_mapped_pages(d.src, d.bytes);
    d.rebind(at);
    at += round_up(d.bytes);
  }
  return buf;
}

}  // namespace di::v41
