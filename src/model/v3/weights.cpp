#include "model/v3/weights.h"

#include <cmath>
#include <set>

#include "core/dtypes.h"

namespace di::v3 {

namespace {

class Binder {
 public:
  Binder(const Checkpoint& c, const V3Config& cfg, ModelWeights& w) : ckpt_(c), cfg_(cfg), w_(w) {}

  [[noreturn]] void fail(const std::string& name, const std::string& msg) const {
    throw LoadError(ckpt_.path() + ": tensor " + name + ": " + msg);
  }
  const TensorView& get(const std::string& name, const std::vector<int64_t>& shape) {
    const TensorView& t = ckpt_.get(name);
    if (t.shape != shape) fail(name, "has shape " + shape_str(t.shape) + ", expected " + shape_str(shape));
    used_.insert(name);
    return t;
  }
  Bf16Vec bf16_vec(const std::string& name, int64_t n) {
    const TensorView& t = get(name, {n});
    if (t.dtype != DType::BF16) fail(name, std::string("has dtype ") + dtype_name(t.dtype) + ", expected BF16");
    return {t.as<uint16_t>(), n};
  }
  // A BF16 weight that is never quantized (embedding, router, head).
  Linear bf16_linear(const std::string& name, int64_t out, int64_t in) {
    const TensorView& t = get(name, {out, in});
    if (t.dtype != DType::BF16) fail(name, std::string("has dtype ") + dtype_name(t.dtype) + ", expected BF16");
    Linear l;
    l.bf16 = t.as<uint16_t>();
    l.out = out, l.in = in;
    return l;
  }
  // A projection: FP8 + weight_scale_inv in quantized checkpoints, else BF16.
  Linear proj(const std::string& prefix, int64_t out, int64_t in) {
    const std::string wn = prefix + ".weight";
    if (!cfg_.fp8) return bf16_linear(wn, out, in);
    const TensorView& t = get(wn, {out, in});
    if (t.dtype != DType::F8_E4M3) fail(wn, std::string("has dtype ") + dtype_name(t.dtype) + ", expected F8_E4M3");
    Linear l;
    l.fp8 = t.as<uint8_t>();
    l.out = out, l.in = in, l.bo = cfg_.block_out, l.bi = cfg_.block_in;
    const std::string sn = prefix + ".weight_scale_inv";
    const int64_t so = (out + l.bo - 1) / l.bo, si = (in + l.bi - 1) / l.bi;
    const TensorView& s = get(sn, {so, si});
    if (s.dtype == DType::F32) {
      l.scale = s.as<float>();
    } else if (s.dtype == DType::F8_E8M0) {
      auto v = std::make_unique<std::vector<float>>(size_t(so * si));
      for (int64_t i = 0; i < so * si; ++i) (*v)[size_t(i)] = e8m0_to_f32(s.as<uint8_t>()[i]);
      l.scale = v->data();
      w_.owned.push_back(std::move(v));
    } else {
      fail(sn, std::string("has dtype ") + dtype_name(s.dtype) + ", expected F32 or F8_E8M0");
    }
    for (int64_t i = 0; i < so * si; ++i) {
      const float x = l.scale[i];
      if (!(x > 0) || !std::isfinite(x)) fail(sn, "scale " + std::to_string(x) + " is not a positive finite number");
      if (cfg_.scale_fmt == "ue8m0") {
        int e;
        if (std::frexp(x, &e) != 0.5f) fail(sn, "scale " + std::to_string(x) + " is not a power of two (ue8m0)");
      }
    }
    return l;
  }
  MlpWeights mlp(const std::string& p, int64_t inter) {
    const int64_t dim = cfg_.dim;
    return {proj(p + ".gate_proj", inter, dim), proj(p + ".up_proj", inter, dim), proj(p + ".down_proj", dim, inter)};
  }
  LayerWeights layer(int i, bool moe) {
    const V3Config& c = cfg_;
    const std::string p = "model.layers." + std::to_string(i) + ".";
    LayerWeights L;
    L.attn_norm = bf16_vec(p + "input_layernorm.weight", c.dim);
    L.ffn_norm = bf16_vec(p + "post_attention_layernorm.weight", c.dim);
    AttentionWeights& a = L.attn;
    const int64_t qdim = int64_t(c.n_heads) * c.qk_head_dim();
    if (c.q_lora_rank > 0) {
      a.wq_a = proj(p + "self_attn.q_a_proj", c.q_lora_rank, c.dim);
      a.q_norm = bf16_vec(p + "self_attn.q_a_layernorm.weight", c.q_lora_rank);
      a.wq_b = proj(p + "self_attn.q_b_proj", qdim, c.q_lora_rank);
    } else {
      a.wq = proj(p + "self_attn.q_proj", qdim, c.dim);
    }
    a.wkv_a = proj(p + "self_attn.kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, c.dim);
    a.kv_norm = bf16_vec(p + "self_attn.kv_a_layernorm.weight", c.kv_lora_rank);
    a.wkv_b = proj(p + "self_attn.kv_b_proj", int64_t(c.n_heads) * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank);
    a.wo = proj(p + "self_attn.o_proj", c.dim, int64_t(c.n_heads) * c.v_head_dim);
    L.moe = moe;
    if (!moe) {
      L.mlp = mlp(p + "mlp", c.inter_dim);
      return L;
    }
    MoeWeights& m = L.experts;
    m.gate = bf16_linear(p + "mlp.gate.weight", c.n_routed_experts, c.dim);
    const std::string bn = p + "mlp.gate.e_score_correction_bias";
    if (c.topk_method == "noaux_tc") {
      const TensorView& b = get(bn, {c.n_routed_experts});
      if (b.dtype == DType::F32) {
        m.bias = b.as<float>();
      } else if (b.dtype == DType::BF16) {
        auto v = std::make_unique<std::vector<float>>(size_t(c.n_routed_experts));
        for (int e = 0; e < c.n_routed_experts; ++e) (*v)[size_t(e)] = bf16_to_f32(b.as<uint16_t>()[e]);
        m.bias = v->data();
        w_.owned.push_back(std::move(v));
      } else {
        fail(bn, std::string("has dtype ") + dtype_name(b.dtype) + ", expected F32 or BF16");
      }
    }
    for (int e = 0; e < c.n_routed_experts; ++e)
      m.experts.push_back(mlp(p + "mlp.experts." + std::to_string(e), c.moe_inter_dim));
    m.has_shared = c.n_shared_experts > 0;
    if (m.has_shared) m.shared = mlp(p + "mlp.shared_experts", int64_t(c.moe_inter_dim) * c.n_shared_experts);
    return L;
  }

  void bind() {
    const V3Config& c = cfg_;
    const TensorView& e = get("model.embed_tokens.weight", {c.vocab_size, c.dim});
    if (e.dtype != DType::BF16) fail(e.name, "expected BF16");
    w_.embed = {e.as<uint16_t>(), c.vocab_size * c.dim};
    w_.norm = bf16_vec("model.norm.weight", c.dim);
    w_.head = bf16_linear("lm_head.weight", c.vocab_size, c.dim);
    for (int i = 0; i < c.n_layers; ++i) w_.layers.push_back(layer(i, c.is_moe(i)));
    for (int k = 0; k < c.n_mtp_layers; ++k) {
      const int i = c.n_layers + k;
      const std::string p = "model.layers." + std::to_string(i) + ".";
      MtpWeights m;
      m.enorm = bf16_vec(p + "enorm.weight", c.dim);
      m.hnorm = bf16_vec(p + "hnorm.weight", c.dim);
      m.eh_proj = ckpt_.find(p + "eh_proj.weight_scale_inv") ? proj(p + "eh_proj", c.dim, 2 * int64_t(c.dim))
                                                             : bf16_linear(p + "eh_proj.weight", c.dim, 2 * int64_t(c.dim));
      m.head_norm = bf16_vec(p + "shared_head.norm.weight", c.dim);
      m.block = layer(i, c.is_moe(i));
      m.embed = w_.embed;
      if (ckpt_.find(p + "embed_tokens.weight")) {
        const TensorView& t = get(p + "embed_tokens.weight", {c.vocab_size, c.dim});
        if (t.dtype != DType::BF16) fail(t.name, "expected BF16");
        m.embed = {t.as<uint16_t>(), c.vocab_size * c.dim};
      }
      m.head = ckpt_.find(p + "shared_head.head.weight") ? bf16_linear(p + "shared_head.head.weight", c.vocab_size, c.dim)
                                                          : w_.head;
      w_.mtp.push_back(m);
    }
    for (const auto& [name, t] : ckpt_.tensors())
      if (!used_.count(name)) fail(name, "is not a tensor of this DeepSeek-V3 configuration");
  }

 private:
  const Checkpoint& ckpt_;
  const V3Config& cfg_;
  ModelWeights& w_;
  std::set<std::string> used_;
};

}  // namespace

ModelWeights bind_weights(const Checkpoint& ckpt, const V3Config& cfg) {
  ModelWeights w;
  Binder(ckpt, cfg, w).bind();
  return w;
}

}  // namespace di::v3
