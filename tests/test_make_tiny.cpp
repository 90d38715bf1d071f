// make-tiny: generated checkpoints follow the release layout and the golden quantization rules,
// load and run, and are deterministic; plus the streaming safetensors writer underneath.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <span>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/dtypes.h"
#include "io/safetensors.h"
#include "io/shard_writer.h"
#include "model/v41/engram_hash.h"
#include "model/v41/model.h"
#include "model/v41/tensor_specs.h"
#include "model/v41/tiny_generator.h"
#include "test_paths.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/v41_vocab.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
// Inside di::v41: Model, SequenceState, ... are the concrete V4.1 types, not the interface's.
namespace di::v41 {

namespace {

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    path = fs::temp_directory_path() / ("di_make_tiny_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string str(const std::string& sub = "") const { return sub.empty() ? path.string() : (path / sub).string(); }
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TinyResult make(const std::string& size, const std::string& dir, uint64_t seed = 1, int threads = 2,
                int64_t shard = -1) {
  TinyOptions o;
  o.size = size;
  o.seed = seed;
  o.threads = threads;
  o.shard_bytes = shard;
  return make_tiny_checkpoint(o, dir);
}

// Prefill + decode on a generated model; checks the logits look like a usable model's.
void check_runs(const std::string& dir) {
  auto m = Model::load(dir);
  const V41Config& c = m->config();
  SequenceState st = m->new_state();
  Workspace ws;
  std::vector<float> logits;
  ForwardOptions fo;
  fo.all_logits = true;
  // BOS + a few ordinary ids, then greedy decode.
  const std::vector<int32_t> prompt = {0, 671, 6102, 2495, 14, 4735, 27, 303};
  m->forward(st, prompt, logits, fo, ws);
  ASSERT_EQ(logits.size(), prompt.size() * size_t(c.vocab_size));
  std::set<int32_t> argmaxes;
  auto check_row = [&](const float* row, const std::string& where) {
    double sum = 0, sq = 0;
    for (int64_t i = 0; i < c.vocab_size; ++i) {
      if (!std::isfinite(row[i])) {
        ADD_FAILURE() << where << ": non-finite logit at id " << i;
        return int32_t(-1);
      }
      sum += row[i];
      sq += double(row[i]) * row[i];
    }
    const double mean = sum / double(c.vocab_size);
    const double sd = std::sqrt(sq / double(c.vocab_size) - mean * mean);
    EXPECT_GT(sd, 0.3) << where;
    EXPECT_LT(sd, 10.0) << where;
    const int32_t am = int32_t(std::max_element(row, row + c.vocab_size) - row);
    // Head rows of ids the tokenizer lacks are damped, so greedy picks real tokens.
    EXPECT_LT(am, int32_t(m->engram_token_map().compressed.size())) << where;
    argmaxes.insert(am);
    return am;
  };
  for (size_t p = 0; p < prompt.size(); ++p) check_row(logits.data() + p * size_t(c.vocab_size), "prefill pos " + std::to_string(p));
  fo.all_logits = false;
  int32_t next = int32_t(std::max_element(logits.end() - c.vocab_size, logits.end()) - (logits.end() - c.vocab_size));
  for (int s = 0; s < 6; ++s) {
    m->forward(st, std::span(&next, 1), logits, fo, ws);
    ASSERT_EQ(logits.size(), size_t(c.vocab_size));
    next = check_row(logits.data(), "decode step " + std::to_string(s));
  }
  EXPECT_GE(argmaxes.size(), 3u) << "argmax barely changes across 14 positions";
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Configurations

TEST(MakeTiny, TinyConfigIsTheGoldenConfig) {
  const V41Config c = tiny_config("tiny", 98627);  // the golden compressed vocab (V3 tokenizer)
  const json mine = json::parse(c.to_hf_json());
  const json golden = json::parse(slurp(test::golden_model_dir() + "/config.json"));
  EXPECT_EQ(mine, golden) << mine.dump(1);
}

TEST(MakeTiny, SizesAreValidAndDistinct) {
  std::map<std::string, V41Config> cs;
  for (const auto& s : tiny_size_names()) cs[s] = tiny_config(s, 99000);  // validate() runs inside
  const V41Config &a = cs["tiny"], &b = cs["tiny-alt"];
  EXPECT_NE(a.head_dim, b.head_dim);
  EXPECT_NE(a.rope_head_dim, b.rope_head_dim);
  EXPECT_NE(a.window_size, b.window_size);
  EXPECT_NE(a.n_routed_experts, b.n_routed_experts);
  EXPECT_NE(a.n_activated_experts, b.n_activated_experts);
  EXPECT_NE(a.index_n_heads, b.index_n_heads);
  EXPECT_NE(a.index_topk, b.index_topk);
  EXPECT_NE(a.o_groups, b.o_groups);
  EXPECT_NE(a.compress_ratios, b.compress_ratios);
  EXPECT_NE(a.engram_layer_ids, b.engram_layer_ids);
  EXPECT_NE(a.n_layers, b.n_layers);
  // Engram table rows are the prime sums, never hard-coded.
  for (const auto& [name, c] : cs) {
    const EngramConstants k = make_engram_constants(c, 99000, 0);
    EXPECT_EQ(c.engram_num_embeddings, k.num_embeddings) << name;
  }
  EXPECT_EQ(a.engram_num_embeddings, (std::vector<int64_t>{660, 864}));
  // Release-like sizes for the benchmark models.
  const uint64_t small = checkpoint_tensor_bytes(cs["small"]), medium = checkpoint_tensor_bytes(cs["medium"]);
  EXPECT_GT(small, 1'000'000'000u);
  EXPECT_LT(small, 2'000'000'000u);
  EXPECT_GT(medium, 6'000'000'000u);
  EXPECT_LT(medium, 8'000'000'000u);
  EXPECT_EQ(cs["small"].head_dim, 512);
  EXPECT_EQ(cs["small"].window_size, 128);
  EXPECT_THROW(tiny_config("huge", 99000), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// Generated checkpoints

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

class MakeTinySize : public ::testing::TestWithParam<std::string> {};

TEST_P(MakeTinySize, GeneratesValidatesLoadsAndRuns) {
  TempDir tmp("run_" + GetParam());
  const auto t0 = std::chrono::steady_clock::now();
  const TinyResult r = make(GetParam(), tmp.str("m"));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // About 1 s on an idle machine. Only a gross regression fails here: CI machines are shared,
  // so a tight wall-clock bound would fail for reasons that are not ours. A speed bound means
  // nothing under ASan (several times slower by design), so only the other checks run there.
  if (GetParam() == "tiny" && !kSanitized) {
    EXPECT_LT(secs, 60.0) << "tiny generation must stay fast (tests use it)";
  }
  std::printf("make-tiny %s: %.2f s\n", GetParam().c_str(), secs);
  EXPECT_EQ(r.n_shards, 1u);
  for (const char* f : {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"})
    EXPECT_TRUE(fs::exists(tmp.path / "m" / f)) << f;
  EXPECT_EQ(fs::path(r.files.back()).filename(), "config.json");
  uint64_t on_disk = 0;
  for (const auto& f : r.files) on_disk += fs::file_size(f);
  EXPECT_EQ(on_disk, r.file_bytes);

  const V41Config c = V41Config::from_hf_file(tmp.str("m/config.json"));
  EXPECT_EQ(json::parse(c.to_hf_json()), json::parse(r.config.to_hf_json()));
  const Checkpoint ck = Checkpoint::open(tmp.str("m"));
  validate_v41_checkpoint(ck, c);
  EXPECT_EQ(ck.tensors().size(), r.n_tensors);
  // The shipped tokenizer defines the Engram vocabulary the config declares.
  const EngramTokenMap map = build_engram_token_map_from_file(tmp.str("m/tokenizer.json"));
  EXPECT_EQ(c.engram_compressed_vocab_size, map.size);
  EXPECT_EQ(c.engram_num_embeddings, make_engram_constants(c, map).num_embeddings);
  // It is the V4.1 tokenizer derived from V3 (control tokens at their V4.1 ids).
  const json v3 = json::parse(slurp(test::v3_tokenizer_json()));
  EXPECT_EQ(json::parse(slurp(tmp.path / "m" / "tokenizer.json")), derive_v41_tokenizer_json(v3));
  EXPECT_EQ(build_engram_token_map(derive_v41_tokenizer_json(v3)).size, map.size);
  auto tok = Tokenizer::from_file(tmp.str("m"));
  EXPECT_EQ(tok->encode("<think>"), std::vector<int32_t>{128821});
  EXPECT_EQ(tok->encode("<｜System｜>"), std::vector<int32_t>{128799});
  const json tcfg = json::parse(slurp(tmp.path / "m" / "tokenizer_config.json"));
  EXPECT_FALSE(tcfg.contains("chat_template")) << "V3's template does not render the V4.1 format";
  EXPECT_EQ(tcfg["bos_token"]["content"], "<｜begin▁of▁sentence｜>");
  check_runs(tmp.str("m"));
}

INSTANTIATE_TEST_SUITE_P(Sizes, MakeTinySize, ::testing::Values("tiny", "tiny-alt"));

TEST(MakeTiny, DeterministicAcrossThreadCountsAndSeedSensitive) {
  TempDir tmp("det");
  make("tiny", tmp.str("a"), 42, 1);
  make("tiny", tmp.str("b"), 42, 5);
  make("tiny", tmp.str("c"), 43, 2);
  for (const char* f : {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"})
    EXPECT_TRUE(slurp(tmp.path / "a" / f) == slurp(tmp.path / "b" / f)) << f << " differs between 1 and 5 threads";
  const Checkpoint a = Checkpoint::open(tmp.str("a")), c = Checkpoint::open(tmp.str("c"));
  // Another seed changes every drawn tensor (E8M0 scales often coincide: they only hold exponents).
  size_t same = 0, drawn = 0;
  for (const auto& [name, v] : a.tensors()) {
    const TensorView& w = c.get(name);
    ASSERT_EQ(v.nbytes, w.nbytes);
    if (v.dtype == DType::F8_E8M0) continue;
    ++drawn;
    if (std::memcmp(v.data, w.data, v.nbytes) == 0) {
      ADD_FAILURE() << name << " is identical for seeds 42 and 43";
      ++same;
    }
  }
  EXPECT_GT(drawn, 400u);
  EXPECT_EQ(same, 0u);
}

TEST(MakeTiny, ShardedOutputLoadsAndEqualsSingleFile) {
  TempDir tmp("shard");
  make("tiny", tmp.str("one"), 5, 2, 0);
  const TinyResult r = make("tiny", tmp.str("many"), 5, 2, 4'000'000);
  EXPECT_GT(r.n_shards, 3u);
  EXPECT_TRUE(fs::exists(tmp.path / "many" / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(tmp.path / "many" / "model.safetensors"));
  const json idx = json::parse(slurp(tmp.path / "many" / "model.safetensors.index.json"));
  EXPECT_EQ(idx["metadata"]["total_size"].get<uint64_t>(), r.tensor_bytes);
  const Checkpoint one = Checkpoint::open(tmp.str("one")), many = Checkpoint::open(tmp.str("many"));
  EXPECT_EQ(many.files().size(), r.n_shards);
  ASSERT_EQ(one.tensors().size(), many.tensors().size());
  for (const auto& [name, v] : one.tensors()) {
    const TensorView& w = many.get(name);
    ASSERT_EQ(v.nbytes, w.nbytes) << name;
    EXPECT_EQ(std::memcmp(v.data, w.data, v.nbytes), 0) << name;
  }
  // Single-file and sharded models give the same logits.
  auto m1 = Model::load(tmp.str("one")), m2 = Model::load(tmp.str("many"));
  const std::vector<int32_t> prompt = {0, 100, 200, 300};
  std::vector<float> l1, l2;
  Workspace w1, w2;
  SequenceState s1 = m1->new_state(), s2 = m2->new_state();
  m1->forward(s1, prompt, l1, {}, w1);
  m2->forward(s2, prompt, l2, {}, w2);
  EXPECT_EQ(l1, l2);
}

// A set cancel flag stops a load with LoadCancelled (not a checkpoint error), at its first stage
// and, for a load already past binding, between the repacked weights.
TEST(MakeTiny, LoadStopsWhenCancelled) {
  TempDir tmp("cancel");
  make("tiny", tmp.str("m"));
  std::atomic<bool> cancel{true};
  LoadOptions lo;
  lo.cancel = &cancel;
  EXPECT_THROW(Model::load(tmp.str("m"), lo), LoadCancelled);
  const Checkpoint ck = Checkpoint::open(tmp.str("m"));
  const V41Config cfg = V41Config::from_hf_file((tmp.path / "m" / "config.json").string());
  ModelWeights w = bind_weights(ck, cfg);
  EXPECT_THROW(repack_weights(w, nullptr, &cancel), LoadCancelled);
  cancel = false;
  EXPECT_NO_THROW(Model::load(tmp.str("m"), lo));
}

// The stored codes obey the scale rules of the golden README, and values have the intended spread.
TEST(MakeTiny, QuantizationFollowsTheScaleRules) {
  TempDir tmp("quant");
  make("tiny-alt", tmp.str("m"), 9);
  const Checkpoint ck = Checkpoint::open(tmp.str("m"));
  const V41Config c = V41Config::from_hf_file(tmp.str("m/config.json"));
  size_t fp8_blocks = 0, fp4_groups = 0, row_groups = 0;
  for (const auto& [name, v] : ck.tensors()) {
    if (v.dtype == DType::F8_E4M3 && name.find("engram.embed") == std::string::npos) {
      const TensorView& s = ck.get(name.substr(0, name.size() - 7) + ".scale");
      const int64_t rows = v.dim(0), cols = v.dim(1), bc = s.dim(1);
      ASSERT_EQ(s.dim(0), (rows + 31) / 32);
      std::vector<float> amax(size_t(s.numel()), 0.f);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < cols; ++j) {
          const float x = e4m3_to_f32(v.data[r * cols + j]);
          ASSERT_TRUE(std::isfinite(x)) << name;
          float& a = amax[size_t(r / 32 * bc + j / 32)];
          a = std::max(a, std::fabs(x));
        }
      // amax / scale in (224, 448] rounds to a largest code in [224, 448].
      for (float a : amax) {
        EXPECT_GE(a, 224.f) << name;
        EXPECT_LE(a, 448.f) << name;
      }
      for (int64_t i = 0; i < s.numel(); ++i) EXPECT_LT(s.data[i], 255) << name;
      fp8_blocks += amax.size();
    } else if (v.dtype == DType::I8 || (v.dtype == DType::F8_E4M3)) {
      // Per (row, 32) groups: FP4 experts (largest |code| in [3, 6]) and Engram tables (e4m3).
      const bool fp4 = v.dtype == DType::I8;
      const TensorView& s = ck.get(name.substr(0, name.size() - 7) + ".scale");
      const int64_t rows = v.dim(0), cols = fp4 ? v.dim(1) * 2 : v.dim(1);
      ASSERT_EQ(s.dim(0), rows);
      ASSERT_EQ(s.dim(1), cols / 32);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < cols / 32; ++g) {
          float a = 0;
          for (int64_t j = g * 32; j < g * 32 + 32; ++j)
            a = std::max(a, std::fabs(fp4 ? e2m1_to_f32(fp4_get(v.data + r * cols / 2, j)) : e4m3_to_f32(v.data[r * cols + j])));
          EXPECT_GE(a, fp4 ? 3.f : 224.f) << name << " row " << r;
          EXPECT_LE(a, fp4 ? 6.f : 448.f) << name << " row " << r;
          (fp4 ? fp4_groups : row_groups)++;
        }
    }
  }
  EXPECT_GT(fp8_blocks, 1000u);
  EXPECT_GT(fp4_groups, 10000u);
  EXPECT_GT(row_groups, 1000u);

  // Spreads of a few tensors match their initialisation rules.
  auto stats = [&](const std::string& name, int64_t row0, int64_t row1) {
    const TensorView& v = ck.get(name);
    const int64_t cols = v.dim(v.shape.size() - 1);
    double sum = 0, sq = 0;
    int64_t n = 0;
    for (int64_t r = row0; r < row1; ++r)
      for (int64_t j = 0; j < cols; ++j) {
        float x;
        if (v.dtype == DType::BF16) x = bf16_to_f32(v.as<uint16_t>()[r * cols + j]);
        else if (v.dtype == DType::F32) x = v.as<float>()[r * cols + j];
        else {
          const TensorView& s = ck.get(name.substr(0, name.size() - 7) + ".scale");
          x = e4m3_to_f32(v.data[r * cols + j]) * e8m0_to_f32(s.data[r / 32 * s.dim(1) + j / 32]);
        }
        sum += x;
        sq += double(x) * x;
        ++n;
      }
    const double mean = sum / double(n);
    return std::pair{mean, std::sqrt(sq / double(n) - mean * mean)};
  };
  auto [em, es] = stats("embed.weight", 0, 2000);
  EXPECT_NEAR(em, 0, 0.02);
  EXPECT_NEAR(es, 1.0, 0.02);
  const double head_sd = 2.0 / std::sqrt(double(c.dim));
  EXPECT_NEAR(stats("head.weight", 0, 2000).second, head_sd, 0.02 * head_sd * 5);
  // Ids beyond the tokenizer's are damped x0.01.
  const int64_t n_defined = int64_t(build_engram_token_map_from_file(tmp.str("m/tokenizer.json")).compressed.size());
  ASSERT_LT(n_defined, c.vocab_size);
  EXPECT_NEAR(stats("head.weight", n_defined, c.vocab_size).second, 0.01 * head_sd, 0.002 * head_sd);
  auto [nm, ns] = stats("layers.3.attn_norm.weight", 0, 1);
  EXPECT_NEAR(nm, 1.0, 0.05);
  EXPECT_NEAR(ns, 0.1, 0.03);
  const double fan_in = double(c.q_lora_rank);
  EXPECT_NEAR(stats("layers.0.attn.wq_b.weight", 0, c.n_heads * c.head_dim).second, 1.5 / std::sqrt(fan_in),
              0.05 * 1.5 / std::sqrt(fan_in));
  // hc_base: +2 on the comb diagonal.
  const float* base = ck.get("layers.2.hc_attn_base").as<float>();
  const int hc = c.hc_mult;
  double diag = 0, off = 0;
  for (int i = 0; i < hc; ++i)
    for (int j = 0; j < hc; ++j) (i == j ? diag : off) += base[2 * hc + i * hc + j];
  EXPECT_GT(diag / hc - off / (hc * hc - hc), 1.0);
  // bias_vl is drawn independently of bias.
  EXPECT_NE(std::memcmp(ck.get("layers.0.ffn.gate.bias").data, ck.get("layers.0.ffn.gate.bias_vl").data,
                        ck.get("layers.0.ffn.gate.bias").nbytes), 0);
}

TEST(MakeTiny, RefusesNonEmptyDirWithoutForce) {
  TempDir tmp("force");
  fs::create_directories(tmp.path / "m");
  { std::ofstream(tmp.path / "m" / "notes.txt") << "keep me"; }
  EXPECT_THROW(make("tiny", tmp.str("m")), std::invalid_argument);
  EXPECT_FALSE(fs::exists(tmp.path / "m" / "config.json"));
  // A stale sharded checkpoint must not survive a forced single-file generation.
  make("tiny", tmp.str("m2"), 1, 2, 8'000'000);
  TinyOptions o;
  o.force = true;
  o.shard_bytes = 0;
  make_tiny_checkpoint(o, tmp.str("m2"));
  EXPECT_FALSE(fs::exists(tmp.path / "m2" / "model.safetensors.index.json"));
  EXPECT_NO_THROW(Checkpoint::open(tmp.str("m2")));
  o.force = true;
  make_tiny_checkpoint(o, tmp.str("m"));
  EXPECT_EQ(slurp(tmp.path / "m" / "notes.txt"), "keep me");
  EXPECT_NO_THROW(Model::load(tmp.str("m")));

  // Clear errors for bad options.
  { std::ofstream(tmp.path / "file") << "x"; }
  try {
    make("tiny", tmp.str("file"));
    FAIL() << "expected an error for a file as output directory";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("not a directory"), std::string::npos) << e.what();
  }
  TinyOptions bad;
  bad.size = "huge";
  EXPECT_THROW(make_tiny_checkpoint(bad, tmp.str("x")), std::invalid_argument);
  bad.size = "tiny";
  bad.tokenizer_path = tmp.str("missing/tokenizer.json");
  try {
    make_tiny_checkpoint(bad, tmp.str("x"));
    FAIL() << "expected an error for a missing tokenizer";
  } catch (const LoadError& e) {
    EXPECT_NE(std::string(e.what()).find("missing/tokenizer.json"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// Streaming writer

TEST(ShardWriter, StreamingFileMatchesInMemoryWriter) {
  TempDir tmp("stream");
  fs::create_directories(tmp.path);
  std::vector<uint8_t> a(6 * 4), b(3 * 2);
  for (size_t i = 0; i < a.size(); ++i) a[i] = uint8_t(i * 7);
  for (size_t i = 0; i < b.size(); ++i) b[i] = uint8_t(200 - i);
  SafetensorsWriter mem;
  mem.add("x.weight", DType::F32, {2, 3}, a);
  mem.add("y", DType::BF16, {3}, b);
  mem.set_metadata("k", "v");
  mem.write(tmp.str("mem.safetensors"));
  {
    StreamingSafetensorsFile f(tmp.str("st.safetensors"), {{"x.weight", DType::F32, {2, 3}}, {"y", DType::BF16, {3}}},
                               {{"k", "v"}});
    f.write(1, 0, b.data(), b.size());  // any order, any split
    f.write(0, 12, a.data() + 12, 12);
    f.write(0, 0, a.data(), 12);
    EXPECT_FALSE(fs::exists(tmp.path / "st.safetensors"));  // not in place before finish()
    f.finish();
  }
  EXPECT_EQ(slurp(tmp.path / "mem.safetensors"), slurp(tmp.path / "st.safetensors"));
}

TEST(ShardWriter, RejectsBadWritesAndIncompleteFiles) {
  TempDir tmp("streambad");
  fs::create_directories(tmp.path);
  {
    StreamingSafetensorsFile f(tmp.str("a.safetensors"), {{"t", DType::I8, {4}}});
    const uint8_t d[8] = {};
    EXPECT_THROW(f.write(0, 2, d, 3), LoadError);  // past the tensor's end
    EXPECT_THROW(f.write(1, 0, d, 1), LoadError);  // no such tensor
    f.write(0, 0, d, 3);
    try {
      f.finish();
      FAIL() << "finish() accepted a tensor with a missing byte";
    } catch (const LoadError& e) {
      EXPECT_NE(std::string(e.what()).find("tensor t got 3 of its 4 bytes"), std::string::npos) << e.what();
    }
  }
  // Abandoned files leave nothing behind.
  size_t left = 0;
  for ([[maybe_unused]] const auto& de : fs::directory_iterator(tmp.path)) ++left;
  EXPECT_EQ(left, 0u);
  EXPECT_THROW(StreamingSafetensorsFile(tmp.str("b.safetensors"), {{"t", DType::I8, {4}}, {"t", DType::I8, {2}}}),
               LoadError);
  EXPECT_THROW(StreamingSafetensorsFile(tmp.str("nodir/c.safetensors"), {{"t", DType::I8, {4}}}), LoadError);
}

TEST(ShardWriter, SplitsAtShardSize) {
  TempDir tmp("shards");
  fs::create_directories(tmp.path);
  std::vector<TensorEntry> es = {{"a", DType::I8, {10}}, {"b", DType::I8, {10}}, {"c", DType::I8, {25}}, {"d", DType::I8, {1}}};
  ShardedCheckpointWriter w(tmp.str(), es, 20);
  EXPECT_EQ(w.n_shards(), 3u);  // [a b] [c] [d]
  std::vector<uint8_t> d(25);
  for (size_t i = 0; i < es.size(); ++i) {
    for (size_t j = 0; j < d.size(); ++j) d[j] = uint8_t(i * 40 + j);
    w.write(i, 0, d.data(), es[i].nbytes());
  }
  w.finish();
  const Checkpoint ck = Checkpoint::open(tmp.str());
  EXPECT_EQ(ck.files().size(), 3u);
  EXPECT_EQ(ck.get("c").data[24], uint8_t(80 + 24));
  EXPECT_EQ(ck.get("d").data[0], uint8_t(120));
  const json idx = json::parse(slurp(tmp.path / "model.safetensors.index.json"));
  EXPECT_EQ(idx["weight_map"]["c"], "model-00002-of-00003.safetensors");
  EXPECT_EQ(idx["metadata"]["total_size"], 46);
}

// The generator's fast quantizers agree with the reference conversions on every finite fp32 in
// their range (every bit pattern up to the saturation point, both signs, stride 61).
TEST(MakeTiny, FastQuantizersMatchReferenceConversions) {
  size_t checked = 0;
  for (uint64_t u = 0; u <= 0x43e00000u; u += 61) {
    for (uint32_t sign : {0u, 0x80000000u}) {
      const float x = bits_f32(uint32_t(u) | sign);
      ASSERT_EQ(tiny_detail::e4m3_code(x), f32_to_e4m3(x)) << x;
      if (std::fabs(x) <= 6.f) {
        ASSERT_EQ(tiny_detail::e2m1_code(x), f32_to_e2m1(x)) << x;
      }
      ++checked;
    }
  }
  // Every e2m1 midpoint, where ties go to the even code.
  for (float m : {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.f})
    for (float x : {m, -m, std::nextafter(m, 0.f), std::nextafter(m, 10.f)})
      EXPECT_EQ(tiny_detail::e2m1_code(x), f32_to_e2m1(x)) << x;
  EXPECT_GT(checked, 30'000'000u);
}

}  // namespace di::v41
