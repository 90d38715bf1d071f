// make-tiny --arch v3: the generated checkpoint has the HF release layout, loads, and runs; the
// same seed gives the same bytes.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "core/dtypes.h"
#include "core/numerics.h"
#include "io/safetensors.h"
#include "model/v3/model.h"
#include "model/v3/tiny_generator.h"

using namespace di::v3;
using di::all_finite;
using di::Checkpoint;
using di::DType;
using di::Numerics;
using di::TensorView;
// The concrete V3 types, over the interface's names in di.
using di::v3::BatchItem;
using di::v3::LoadOptions;
using di::v3::Model;
using di::v3::SequenceState;
using di::v3::Workspace;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("di_v3_tiny_" + std::to_string(::getpid()));
  TempDir() { fs::create_directories(path); }
  ~TempDir() { fs::remove_all(path); }
  std::string str(const std::string& sub) const { return (path / sub).string(); }
};

std::string slurp(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

TEST(V3MakeTiny, GeneratesALoadableRunnableCheckpoint) {
  TempDir tmp;
  TinyOptions o;
  o.seed = 7;
  o.threads = 2;
  const TinyResult r = make_tiny_checkpoint(o, tmp.str("a"));
  EXPECT_EQ(r.n_shards, 1u);
  const Checkpoint ck = Checkpoint::open(tmp.str("a"));
  // Release names and dtypes.
  EXPECT_EQ(ck.get("model.layers.1.self_attn.kv_b_proj.weight").dtype, DType::F8_E4M3);
  EXPECT_EQ(ck.get("model.layers.1.self_attn.kv_b_proj.weight_scale_inv").dtype, DType::F32);
  EXPECT_EQ(ck.get("model.layers.1.mlp.gate.e_score_correction_bias").dtype, DType::F32);
  EXPECT_EQ(ck.get("model.layers.4.eh_proj.weight").dtype, DType::BF16);  // the MTP module
  EXPECT_EQ(ck.get("lm_head.weight").dtype, DType::BF16);
  auto m = Model::load(tmp.str("a"));
  EXPECT_EQ(m->weights().mtp.size(), 1u);
  EXPECT_EQ(m->config().dim, 64);
  Workspace ws;
  auto st = m->new_state();
  std::vector<int32_t> toks = {0, 128803, 1000, 2000, 3000, 128804};
  std::vector<float> lg;
  m->forward(*st, toks, lg, {}, ws);
  ASSERT_EQ(int64_t(lg.size()), m->config().vocab_size);
  EXPECT_TRUE(all_finite(lg.data(), int64_t(lg.size())));
  float mx = 0, mean2 = 0;
  for (float v : lg) mx = std::max(mx, std::fabs(v)), mean2 += v * v;
  mean2 /= float(lg.size());
  EXPECT_GT(std::sqrt(mean2), 0.1f) << "logits should not collapse";
  EXPECT_LT(mx, 1000.0f);
  // Same seed, other thread count: the same bytes; another seed: different weights.
  o.threads = 1;
  make_tiny_checkpoint(o, tmp.str("b"));
  EXPECT_EQ(slurp(tmp.str("a/model.safetensors")), slurp(tmp.str("b/model.safetensors")));
  EXPECT_EQ(slurp(tmp.str("a/config.json")), slurp(tmp.str("b/config.json")));
  o.seed = 8;
  make_tiny_checkpoint(o, tmp.str("c"));
  EXPECT_NE(slurp(tmp.str("a/model.safetensors")), slurp(tmp.str("c/model.safetensors")));
  // A non-empty directory needs force.
  EXPECT_THROW(make_tiny_checkpoint(o, tmp.str("c")), std::invalid_argument);
}

TEST(V3MakeTiny, SizesAndShards) {
  EXPECT_EQ(tiny_config("small").dim, 1024);
  EXPECT_EQ(tiny_config("small").n_routed_experts, 64);
  EXPECT_EQ(tiny_config("small").kv_lora_rank, 512);
  EXPECT_THROW(tiny_config("tiny-alt"), std::invalid_argument);
  TempDir tmp;
  TinyOptions o;
  o.shard_bytes = 8'000'000;
  const TinyResult r = make_tiny_checkpoint(o, tmp.str("s"));
  EXPECT_GT(r.n_shards, 1u);
  EXPECT_TRUE(fs::exists(tmp.str("s/model.safetensors.index.json")));
  auto m = Model::load(tmp.str("s"));
  EXPECT_EQ(m->config().n_layers, 4);
}

TEST(V3MakeTiny, Cli) {
  TempDir tmp;
  const std::string cmd = std::string(DI_BINARY_DIR) + "/deepinfer make-tiny --arch v3 --size tiny --seed 3 --quiet --out " +
                          tmp.str("cli") + " > /dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  auto m = Model::load(tmp.str("cli"));
  EXPECT_EQ(m->config().n_routed_experts, 16);
  const std::string bad = std::string(DI_BINARY_DIR) + "/deepinfer make-tiny --arch v3 --size tiny-alt --out " +
                          tmp.str("bad") + " > /dev/null 2>&1";
  EXPECT_NE(std::system(bad.c_str()), 0);
}

// The release variants: no q low-rank (q_proj), V3.1's ue8m0 scales, and the MTP module's own
// embedding / head copies; each loads and runs, and any chunking gives the same bits.
TEST(V3MakeTiny, VariantsLoadAndRun) {
  TempDir tmp;
  TinyOptions o;
  o.seed = 11;
  o.no_q_lora = o.ue8m0 = o.mtp_copies = true;
  make_tiny_checkpoint(o, tmp.str("v"));
  const Checkpoint ck = Checkpoint::open(tmp.str("v"));
  EXPECT_TRUE(ck.find("model.layers.0.self_attn.q_proj.weight"));
  EXPECT_FALSE(ck.find("model.layers.0.self_attn.q_a_proj.weight"));
  for (const auto& [name, t] : ck.tensors())
    if (name.find("weight_scale_inv") != std::string::npos)
      for (int64_t i = 0; i < t.numel(); ++i) {
        int e;
        ASSERT_EQ(std::frexp(t.as<float>()[i], &e), 0.5f) << name;
      }
  const TensorView& e0 = ck.get("model.embed_tokens.weight");
  const TensorView& e4 = ck.get("model.layers.4.embed_tokens.weight");
  ASSERT_EQ(e0.nbytes, e4.nbytes);
  EXPECT_EQ(std::memcmp(e0.data, e4.data, e0.nbytes), 0) << "the MTP embedding is a copy of the main one";
  EXPECT_TRUE(ck.find("model.layers.4.shared_head.head.weight"));
  auto m = Model::load(tmp.str("v"));
  EXPECT_EQ(m->config().q_lora_rank, 0);
  EXPECT_EQ(m->info().chat_format, "deepseek-v3.1");
  EXPECT_NE(m->weights().mtp[0].embed.p, m->weights().embed.p) << "the MTP module binds its own copy";
  EXPECT_NE(m->weights().mtp[0].head.bf16, m->weights().head.bf16);
  Workspace ws;
  std::vector<int32_t> toks = {0, 5, 77, 900, 12345, 128803, 3, 4, 5};
  ForwardOptions all;
  all.all_logits = true;
  auto a = m->new_state(), b = m->new_state();
  std::vector<float> la, lb, part;
  m->forward(*a, toks, la, all, ws);
  for (size_t i = 0; i < toks.size(); i += 4) {
    m->forward(*b, std::span<const int32_t>(toks.data() + i, std::min<size_t>(4, toks.size() - i)), part, all, ws);
    lb.insert(lb.end(), part.begin(), part.end());
  }
  ASSERT_EQ(la.size(), lb.size());
  EXPECT_EQ(std::memcmp(la.data(), lb.data(), la.size() * 4), 0);
  EXPECT_TRUE(all_finite(la.data(), int64_t(la.size())));
}

// V3.1's scale format promises powers of two: arbitrary fp32 scales (the golden's) are refused.
TEST(V3MakeTiny, Ue8m0ConfigRejectsOtherScales) {
  TempDir tmp;
  const std::string src = std::string(DI_SOURCE_DIR) + "/tests/data/golden/v3-tiny/model";
  fs::create_directories(tmp.str("g"));
  fs::create_symlink(src + "/model.safetensors", tmp.str("g/model.safetensors"));
  std::string cfg = slurp(src + "/config.json");
  const std::string key = "\"quant_method\": \"fp8\",";
  ASSERT_NE(cfg.find(key), std::string::npos);
  cfg.replace(cfg.find(key), key.size(), key + " \"scale_fmt\": \"ue8m0\",");
  std::ofstream(tmp.str("g/config.json")) << cfg;
  try {
    Model::load(tmp.str("g"));
    FAIL() << "loaded";
  } catch (const di::LoadError& e) {
    EXPECT_NE(std::string(e.what()).find("power of two"), std::string::npos) << e.what();
  }
}
