#include "model/v41/tensor_specs.h"

#include <map>

namespace di {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

class SpecList {
 public:
  explicit SpecList(const V41Config& c) : c_(c), block_(c.weight_block_size) {}

  void add(std::string name, DType t, std::vector<int64_t> shape, bool check_dtype = true) {
    out.push_back({std::move(name), t, std::move(shape), check_dtype});
  }
  void bf16(const std::string& name, std::vector<int64_t> shape) { add(name, DType::BF16, std::move(shape)); }
  void f32(const std::string& name, std::vector<int64_t> shape) { add(name, DType::F32, std::move(shape)); }
  // FP8 linear [out, in] with one E8M0 scale per block x block tile.
  void fp8(const std::string& base, int64_t out_f, int64_t in_f) {
    add(base + ".weight", DType::F8_E4M3, {out_f, in_f});
    add(base + ".scale", DType::F8_E8M0, {ceil_div(out_f, block_), ceil_div(in_f, block_)});
  }
  // FP4 E2M1 linear: two codes per I8 byte, one E8M0 scale per 32 inputs of a row.
  void fp4(const std::string& base, int64_t out_f, int64_t in_f) {
    add(base + ".weight", DType::I8, {out_f, in_f / 2});
    add(base + ".scale", DType::F8_E8M0, {out_f, in_f / 32});
  }

  // One block: backbone layer `layer` (< n_layers) or DSpark stage (>= n_layers) under `p`.
  void block(const std::string& p, int layer) {
    const V41Config& c = c_;
    const bool backbone = layer < c.n_layers;
    const int64_t dim = c.dim, hd = c.head_dim, mix = int64_t(2 + c.hc_mult) * c.hc_mult;
    bf16(p + "attn_norm.weight", {dim});
    bf16(p + "ffn_norm.weight", {dim});
    for (const char* s : {"attn", "ffn"}) {
      f32(p + "hc_" + s + "_fn", {mix, int64_t(c.hc_mult) * dim});
      f32(p + "hc_" + s + "_base", {mix});
      f32(p + "hc_" + s + "_scale", {3});
    }
    fp8(p + "attn.wq_a", c.q_lora_rank, dim);
    bf16(p + "attn.q_norm.weight", {c.q_lora_rank});
    fp8(p + "attn.wq_b", int64_t(c.n_heads) * hd, c.q_lora_rank);
    fp8(p + "attn.wkv", hd, dim);
    bf16(p + "attn.kv_norm.weight", {hd});
    fp8(p + "attn.wo_a", int64_t(c.o_groups) * c.o_lora_rank, int64_t(c.n_heads) * hd / c.o_groups);
    fp8(p + "attn.wo_b", dim, int64_t(c.o_groups) * c.o_lora_rank);
    f32(p + "attn.attn_sink", {c.n_heads});
    // DSpark stages are window-only: no compressor or indexer even if listed as sources.
    if (backbone && c.is_kv_source(layer)) {
      bf16(p + "attn.compressor.wkv.weight", {hd, dim});
      if (c.compress_ratio(layer) > 1) bf16(p + "attn.compressor.wgate.weight", {hd, dim});
      bf16(p + "attn.compressor.norm.weight", {hd});
    }
    if (backbone && c.is_index_source(layer)) {
      fp8(p + "attn.indexer.wq_b", int64_t(c.index_n_heads) * c.index_head_dim, c.q_lora_rank);
      bf16(p + "attn.indexer.weights_proj.weight", {c.index_n_heads, dim});
      if (c.is_kv_source(layer)) {  // index-key owner
        bf16(p + "attn.indexer.wk.weight", {c.index_head_dim, hd});
        bf16(p + "attn.indexer.k_norm.weight", {c.index_head_dim});
      }
    }
    const int64_t nr = c.n_routed_experts_of(layer), inter = c.moe_inter_dim;
    bf16(p + "ffn.gate.weight", {nr, dim});
    f32(p + "ffn.gate.bias", {nr});
    f32(p + "ffn.gate.bias_vl", {nr});  // in the release for every gate, vision or not
    fp8(p + "ffn.shared_experts.w1", inter, dim);
    fp8(p + "ffn.shared_experts.w2", dim, inter);
    fp8(p + "ffn.shared_experts.w3", inter, dim);
    for (int64_t e = 0; e < nr; ++e) {
      const std::string ep = p + "ffn.experts." + std::to_string(e) + ".";
      fp4(ep + "w1", inter, dim);
      fp4(ep + "w2", dim, inter);
      fp4(ep + "w3", inter, dim);
    }
    if (backbone && c.is_engram_layer(layer)) {
      size_t k = 0;
      while (c.engram_layer_ids[k] != layer) ++k;
      const int64_t rows = c.engram_num_embeddings.at(k), ehd = c.engram_head_dim;
      add(p + "engram.embed.weight", DType::F8_E4M3, {rows, ehd});
      add(p + "engram.embed.scale", DType::F8_E8M0, {rows, ehd / 32});
      fp8(p + "engram.wkv", dim * (c.hc_mult + 1), int64_t(c.engram_max_ngram_size - 1) * c.engram_n_heads * ehd);
      bf16(p + "engram.q_weight", {c.hc_mult, dim});
      bf16(p + "engram.k_weight", {c.hc_mult, dim});
    }
  }

  void vision() {
    const V41Config& c = c_;
    const int64_t vd = c.vision_dim, inter = c.vision_inter_dim, r = c.vision_downsample_ratio;
    auto v = [&](const std::string& n, std::vector<int64_t> s) { add(n, DType::BF16, std::move(s), false); };
    v("vision.patch_embed.proj.weight", {vd, 3 * int64_t(c.vision_patch_size) * c.vision_patch_size});
    v("vision.patch_embed.proj.bias", {vd});
    for (int i = 0; i < c.vision_n_layers; ++i) {
      const std::string p = "vision.blocks." + std::to_string(i) + ".";
      v(p + "norm1.weight", {vd});
      v(p + "attn.wqkv.weight", {3 * vd, vd});
      v(p + "attn.wqkv.bias", {3 * vd});
      v(p + "attn.wo.weight", {vd, vd});
      v(p + "attn.wo.bias", {vd});
      v(p + "norm2.weight", {vd});
      v(p + "mlp.w1.weight", {2 * inter, vd});
      v(p + "mlp.w2.weight", {vd, inter});
    }
    v("vision.norm.weight", {vd});
    v("aligner.w1.weight", {c.dim, vd * r * r});
    v("aligner.w1.bias", {c.dim});
    v("aligner.w2.weight", {c.dim, c.dim});
    v("aligner.w2.bias", {c.dim});
    for (const char* n : {"image_start", "image_end", "image_newline"}) v(n, {c.dim});
  }

  std::vector<TensorSpec> out;

 private:
  const V41Config& c_;
  int64_t block_;
};

}  // namespace

std::vector<TensorSpec> v41_tensor_specs(const V41Config& c) {
  SpecList s(c);
  s.bf16("embed.weight", {c.vocab_size, c.dim});
  s.bf16("head.weight", {c.vocab_size, c.dim});
  s.bf16("norm.weight", {c.dim});
  for (int i = 0; i < c.n_layers; ++i) s.block("layers." + std::to_string(i) + ".", i);
  // The reference builds the stages only when dspark_block_size != 0.
  if (c.dspark_block_size != 0) {
    for (int st = 0; st < c.n_mtp_layers; ++st) {
      const std::string p = "mtp." + std::to_string(st) + ".";
      s.block(p, c.n_layers + st);
      if (st == 0) {
        s.fp8(p + "main_proj", c.dim, int64_t(c.dim) * int64_t(c.dspark_target_layer_ids.size()));
        s.bf16(p + "main_norm.weight", {c.dim});
      }
      if (st == c.n_mtp_layers - 1) {
        s.bf16(p + "norm.weight", {c.dim});
        s.bf16(p + "markov_head.embed.weight", {c.vocab_size, c.dspark_markov_rank});
        s.bf16(p + "markov_head.head.weight", {c.vocab_size, c.dspark_markov_rank});
        s.bf16(p + "confidence_head.proj.weight", {1, int64_t(c.dim) + c.dspark_markov_rank});
      }
    }
  }
  if (c.vision_enabled()) s.vision();
  return std::move(s.out);
}

void validate_v41_checkpoint(const Checkpoint& ckpt, const V41Config& c) {
  constexpr size_t kMaxListed = 20;
  std::vector<std::string> problems;
  size_t total = 0;
  auto report = [&](std::string p) {
    ++total;
    if (problems.size() < kMaxListed) problems.push_back(std::move(p));
  };
  std::map<std::string, const TensorSpec*> expected;
  const std::vector<TensorSpec> specs = v41_tensor_specs(c);
  for (const TensorSpec& s : specs) expected[s.name] = &s;

  for (const TensorSpec& s : specs) {
    const TensorView* v = ckpt.find(s.name);
    if (!v) {
      report("missing tensor " + s.name + " (expected " + dtype_name(s.dtype) + " " + shape_str(s.shape) + ")");
      continue;
    }
    if (s.check_dtype && v->dtype != s.dtype)
      report(*v->file + ": tensor " + s.name + " has dtype " + dtype_name(v->dtype) + ", expected " + dtype_name(s.dtype));
    if (v->shape != s.shape)
      report(*v->file + ": tensor " + s.name + " has shape " + shape_str(v->shape) + ", expected " + shape_str(s.shape));
  }
  for (const auto& [name, v] : ckpt.tensors())
    if (!expected.count(name)) report(*v.file + ": unexpected tensor " + name + " (not in the V4.1 layout for this config)");

  if (total == 0) return;
  std::string msg = ckpt.path() + ": checkpoint does not match the config (" + std::to_string(total) + " problem" +
                    (total > 1 ? "s" : "") + "):";
  for (const auto& p : problems) msg += "\n  " + p;
  if (total > problems.size()) msg += "\n  ... and " + std::to_string(total - problems.size()) + " more";
  throw LoadError(msg);
}

}  // namespace di
