// deepinfer bench: statistics, bandwidth and matmul-peak sanity, the bytes/FLOPs accounting against
// a hand count on the golden tiny config, and the report's JSON fields.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "bench/matmul_peak.h"
#include "bench/membw.h"
#include "bench/model_bench.h"
#include "bench/roofline.h"
#include "bench/stats.h"
#include "io/safetensors.h"
#include "model/v41/cost.h"
#include "test_paths.h"

using namespace di;
using namespace di::bench;
// V4.1's step costs (model/v41/cost.h), which the bench reads through Model::step_cost().
using di::v41::LayerCost;
using di::v41::ModelCost;
using di::v41::model_cost;
using di::v41::query_cost;
using di::v41::step_weight_bytes;

TEST(BenchStats, PercentilesInterpolateLikeNumpy) {
  const std::vector<double> x{4, 1, 3, 2};
  EXPECT_DOUBLE_EQ(percentile(x, 50), 2.5);
  EXPECT_DOUBLE_EQ(percentile(x, 0), 1);
  EXPECT_DOUBLE_EQ(percentile(x, 100), 4);
  std::vector<double> ten;
  for (int i = 1; i <= 10; ++i) ten.push_back(i);
  EXPECT_NEAR(percentile(ten, 90), 9.1, 1e-12);   // rank 8.1
  EXPECT_NEAR(percentile(ten, 99), 9.91, 1e-12);  // rank 8.91
  EXPECT_DOUBLE_EQ(median(ten), 5.5);
  EXPECT_DOUBLE_EQ(percentile(std::vector<double>{7}, 99), 7);
  EXPECT_DOUBLE_EQ(percentile(std::vector<double>{}, 50), 0);
  EXPECT_THROW(percentile(ten, 101), std::invalid_argument);
}

TEST(BenchStats, MeanStdMad) {
  const std::vector<double> x{2, 4, 4, 4, 5, 5, 7, 9};
  EXPECT_DOUBLE_EQ(mean(x), 5);
  EXPECT_DOUBLE_EQ(stddev(x), 2);  // population std, as np.std
  EXPECT_DOUBLE_EQ(mad(x), 0.5);   // |x - 4.5| sorted: .5 .5 .5 .5 .5 2.5 2.5 4.5
  const Summary s = summarize({3, 1, 2, 10, 4});
  EXPECT_DOUBLE_EQ(s.median, 3);
  EXPECT_DOUBLE_EQ(s.min, 1);
  EXPECT_DOUBLE_EQ(s.max, 10);
  EXPECT_DOUBLE_EQ(s.mad, 1);
  EXPECT_EQ(s.samples.size(), 5u);
}

TEST(BenchBandwidth, PlausibleAndRepeatable) {
  for (int threads : {1, 2}) {
    const BandwidthResult r = measure_bandwidth({threads, int64_t(96) << 20, 3});
    EXPECT_EQ(r.read_gbs.samples.size(), 3u);
    EXPECT_EQ(r.triad_gbs.samples.size(), 3u);
    EXPECT_GE(r.bytes, int64_t(95) << 20);
    // Any machine this runs on streams between 1 GB/s and 10 TB/s per pass.
    for (double g : r.read_gbs.samples) EXPECT_TRUE(g > 1 && g < 10000) << g;
    for (double g : r.triad_gbs.samples) EXPECT_TRUE(g > 0.5 && g < 10000) << g;
  }
  EXPECT_GE(default_bandwidth_bytes(), int64_t(256) << 20);
  EXPECT_THROW(measure_bandwidth({0, 1 << 20, 1}), std::invalid_argument);
}

TEST(BenchMatmul, OneDnnPeakPlausible) {
  const MatmulPeak p = measure_matmul_peak({{64, 256, 512, "a"}, {64, 512, 256, "b"}}, 2, 2, 0.02);
  // 2 shapes x {bf16, f32}; without oneDNN bf16 support (AVX2-only CPUs) 2 shapes x f32.
  ASSERT_EQ(p.results.size(), p.bf16_supported ? 4u : 2u);
  EXPECT_EQ(p.bf16_supported, p.bf16_unsupported.empty());
  EXPECT_FALSE(p.dnnl_isa.empty());
  EXPECT_FALSE(p.dnnl_version.empty());
  for (const auto& r : p.results) {
    EXPECT_EQ(r.gflops.samples.size(), 2u);
    EXPECT_TRUE(r.gflops.median > 0.5 && r.gflops.median < 1e6) << r.shape.name << " " << r.dtype << " " << r.gflops.median;
  }
  if (p.bf16_supported) EXPECT_GT(p.bf16_gflops, 0.5);
  else EXPECT_EQ(p.bf16_gflops, 0.0);
  EXPECT_GT(p.f32_gflops, 0.5);
  EXPECT_EQ(p.peak_gflops(), p.bf16_supported ? p.bf16_gflops : p.f32_gflops);
  EXPECT_THROW(measure_matmul_peak({{0, 1, 1, "bad"}}, 1), std::invalid_argument);
}

namespace {
V41Config golden_config() { return V41Config::from_hf_file(test::golden_model_dir() + "/config.json"); }
double fp8(double out, double in) { return out * in + std::ceil(out / 32) * std::ceil(in / 32); }
double fp4(double out, double in) { return out * in / 2 + out * in / 32; }
}  // namespace

TEST(BenchRoofline, WeightBytesMatchHandCountOnGoldenTiny) {
  const V41Config c = golden_config();
  ASSERT_EQ(c.dim, 64);
  ASSERT_EQ(c.n_layers, 8);
  const ModelCost m = model_cost(c);
  ASSERT_EQ(m.layers.size(), 8u);
  const double dim = 64, I = 32, H = 8, D = 64, QL = 32, G = 2, R = 32, E = 8, IH = 16, ID = 32, hc = 4, mix = 24;
  const double ehd = 64, cols = 3 * 2, vocab = 129280;
  double dense_total = 0, wk_share = 0;
  for (int i = 0; i < 8; ++i) {
    const int r = c.compress_ratios[size_t(i)];
    const bool kv_src = i == 2 || i == 4 || i == 5, idx_src = i == 2 || i == 4 || i == 5 || i == 7, engram = i == 1 || i == 4;
    double d = 2 * dim * 2                                   // attn_norm, ffn_norm
               + 2 * (mix * hc * dim * 4 + mix * 4 + 3 * 4)  // hc_{attn,ffn}_{fn,base,scale}
               + fp8(QL, dim) + QL * 2 + fp8(H * D, QL) + fp8(D, dim) + D * 2 + fp8(G * R, H * D / G) + fp8(dim, G * R) +
               H * 4                                          // attn_sink
               + E * dim * 2 + E * 4                          // gate + bias (bias_vl unused)
               + 2 * fp8(I, dim) + fp8(dim, I);               // shared expert
    if (kv_src) d += D * dim * 2 * (r > 1 ? 2 : 1) + D * 2;  // compressor wkv (+wgate), norm
    if (idx_src) d += fp8(IH * ID, QL) + IH * dim * 2 + (kv_src ? ID * 2 : 0);  // wq_b, weights_proj, k_norm
    if (engram) d += fp8((hc + 1) * dim, cols * ehd) + 2 * hc * dim * 2;       // wkv, q/k weights
    const LayerCost& L = m.layers[size_t(i)];
    EXPECT_DOUBLE_EQ(L.dense_bytes, d) << "layer " << i;
    EXPECT_DOUBLE_EQ(L.wk_bytes, kv_src && idx_src ? ID * D * 2 : 0) << "layer " << i;
    EXPECT_DOUBLE_EQ(L.expert_bytes, 3 * fp4(I, dim)) << "layer " << i;
    EXPECT_EQ(L.engram_rows, engram ? 6 : 0);
    EXPECT_DOUBLE_EQ(L.engram_row_bytes, engram ? ehd + ehd / 32 : 0);
    dense_total += d;
    if (kv_src && idx_src) wk_share += ID * D * 2 / r;
  }
  EXPECT_DOUBLE_EQ(m.head_bytes, vocab * dim * 2);
  // One decode token that ran 2 distinct experts in every layer.
  const std::vector<int> distinct(8, 2);
  const double expect = dense_total + wk_share + 8 * 2 * 3 * fp4(I, dim) + 2 * 6 * (ehd + ehd / 32) + dim * 2 /* embed row */ +
                        dim * 2 /* final norm */ + vocab * dim * 2 /* head */;
  EXPECT_DOUBLE_EQ(step_weight_bytes(m, distinct, 1, 1, 1), expect);
  // Every byte of the checkpoint is a tensor of the spec list.
  const Checkpoint ck = Checkpoint::open(test::golden_model_dir());
  double file_tensor_bytes = 0;
  for (const auto& [name, v] : ck.tensors()) file_tensor_bytes += double(v.nbytes);
  EXPECT_DOUBLE_EQ(m.total_bytes, file_tensor_bytes);
}

TEST(BenchRoofline, QueryCostMatchesHandCount) {
  const V41Config c = golden_config();
  // t = 9: window 8 rows everywhere; ratio-2 sources see 5 entries (select 5), ratio-1 sources see
  // 10 (select index_topk = 6). Rows: 8+8+13+13+13+14+14+14 = 97; index keys scanned: 5+5+10+10.
  const QueryCost q = query_cost(c, 9);
  EXPECT_DOUBLE_EQ(q.kv_bytes, 97 * 64 * 4 + 30 * 32 * 4);
  EXPECT_DOUBLE_EQ(q.attn_flops, 4.0 * 97 * 8 * 64 + 2.0 * 30 * 16 * 32);
  // t = 0: one window row per layer; ratio-1 sources see one entry.
  const QueryCost q0 = query_cost(c, 0);
  EXPECT_DOUBLE_EQ(q0.kv_bytes, (8 + 3) * 64 * 4 + 2 * 32 * 4);
  const Roofline r = make_roofline(1e9, 1e8, 1e9, 10, 100);
  EXPECT_DOUBLE_EQ(r.memory_s, 1.1e9 / 10e9);
  EXPECT_DOUBLE_EQ(r.compute_s, 0.01);
  EXPECT_DOUBLE_EQ(r.time_s, 0.11);
  EXPECT_FALSE(r.compute_bound());
}

TEST(BenchRoofline, ExpertCounterCountsDistinctExperts) {
  v41::Model& model = test::golden_model();
  const V41Config& c = model.config();
  ExpertCounter<v41::ForwardObserver> counter(v41::routed_experts_per_layer(c));
  v41::ForwardOptions o;
  o.observer = &counter;
  v41::Workspace ws;
  std::vector<float> logits;
  v41::SequenceState s = model.new_state();
  const std::vector<int32_t> one{1000};
  counter.begin_step();
  model.forward(s, one, logits, o, ws);
  for (int d : counter.distinct()) EXPECT_EQ(d, c.n_activated_experts);  // one token: exactly top_k
  const std::vector<int32_t> chunk{5, 900, 4000, 70000, 12, 33};
  counter.begin_step();
  model.forward(s, chunk, logits, o, ws);
  for (int d : counter.distinct()) {
    EXPECT_GE(d, c.n_activated_experts);
    EXPECT_LE(d, c.n_routed_experts);
  }
}

// The shared counter itself: repeats within a step count once, ids outside a layer's experts and
// layers outside the model are ignored, begin_step() starts over.
TEST(BenchRoofline, ExpertCounterIgnoresRepeatsAndForeignIds) {
  struct Observer {
    virtual ~Observer() = default;
    virtual void on_experts(int, int64_t, int, int, const int32_t*, const float*) {}
  };
  ExpertCounter<Observer> counter({4, 0, 8});
  Observer& ob = counter;
  const int32_t a[] = {0, 3, 3, 1, -1, 4};  // 2 tokens x top-3
  const int32_t b[] = {7, 7, 2, 9};
  counter.begin_step();
  ob.on_experts(0, 0, 2, 3, a, nullptr);
  ob.on_experts(1, 0, 1, 2, a, nullptr);
  ob.on_experts(2, 0, 2, 2, b, nullptr);
  ob.on_experts(3, 0, 2, 2, b, nullptr);
  ob.on_experts(0, 2, 1, 2, b + 2, nullptr);  // a later chunk of the same step: 2 is new
  EXPECT_EQ(counter.distinct(), (std::vector<int>{4, 0, 2}));
  counter.begin_step();
  ob.on_experts(2, 0, 1, 1, b, nullptr);
  EXPECT_EQ(counter.distinct(), (std::vector<int>{0, 0, 1}));
}

TEST(BenchModel, ReportHasEveryField) {
  v41::Model& model = test::golden_model();
  BenchedModel info;
  info.path = test::golden_model_dir();
  info.file_bytes = checkpoint_file_bytes(info.path);
  ModelBenchOptions o;
  o.prompt_sizes = {8};
  o.gen_sizes = {4};
  o.depths = {0, 12};
  o.batches = {1, 3};
  o.reps = 2;
  o.threads = 2;
  o.bandwidth_bytes = int64_t(32) << 20;
  o.bandwidth_passes = 2;
  o.matmul_m = 32;
  o.fill_chunk = 5;
  BenchReport r = run_model_bench(model, info, o);
  r.date = "2000-01-01T00:00:00Z";
  r.command = "test";
  ASSERT_EQ(r.tests.size(), 6u);  // per depth: pp8, tg4, tg4 B3
  const nlohmann::json j = report_json(r);
  for (const char* k : {"date", "command", "machine", "threads", "model", "bandwidth", "matmul", "tests"})
    EXPECT_TRUE(j.contains(k)) << k;
  for (const char* k : {"cpu_model", "logical_cpus", "kernel_isa", "l3_bytes", "cpu_flags"}) EXPECT_TRUE(j["machine"].contains(k)) << k;
  EXPECT_FALSE(j["machine"]["kernel_isa"].get<std::string>().empty());
  EXPECT_GT(j["model"]["params"].get<int64_t>(), 0);
  EXPECT_EQ(j["model"]["arch"], "deepseek_v4.1");
  EXPECT_EQ(j["model"]["config"]["n_layers"].get<int>(), model.config().n_layers);
  EXPECT_GT(j["model"]["file_bytes"].get<int64_t>(), 0);
  EXPECT_GT(j["bandwidth"]["read_gbs"]["median"].get<double>(), 0);
  const bool bf16 = j["matmul"]["bf16_supported"].get<bool>();
  const std::string peak_key = bf16 ? "bf16_gflops" : "f32_gflops";
  EXPECT_GT(j["matmul"][peak_key].get<double>(), 0);
  EXPECT_EQ(j["matmul"]["peak_dtype"], bf16 ? "bf16" : "f32");
  EXPECT_EQ(j["roofline_inputs"]["matmul_dtype"], j["matmul"]["peak_dtype"]);
  EXPECT_EQ(j["matmul"]["shapes"].size(), bf16 ? 10u : 5u);
  // The rooflines use the higher of the before/after measurements.
  const double bw_used = j["roofline_inputs"]["read_gbs"].get<double>(), peak_used = j["roofline_inputs"]["matmul_gflops"].get<double>();
  EXPECT_GT(j["bandwidth_after"]["read_gbs"]["median"].get<double>(), 0);
  EXPECT_DOUBLE_EQ(bw_used, std::max(j["bandwidth"]["read_gbs"]["median"].get<double>(), j["bandwidth_after"]["read_gbs"]["median"].get<double>()));
  EXPECT_DOUBLE_EQ(peak_used, std::max(j["matmul"][peak_key].get<double>(), j["matmul"]["peak_gflops_after"].get<double>()));
  std::set<std::string> names;
  for (const auto& t : j["tests"]) {
    names.insert(t["name"].get<std::string>() + "@" + std::to_string(t["depth"].get<int64_t>()));
    EXPECT_EQ(t["tokens_per_s"]["samples"].size(), 2u);
    EXPECT_GT(t["tokens_per_s"]["median"].get<double>(), 0);
    EXPECT_LE(t["tokens_per_s"]["min"].get<double>(), t["tokens_per_s"]["median"].get<double>());
    for (const char* k : {"weight_bytes", "kv_bytes", "flops", "time_s", "measured_s", "ratio", "bound"})
      EXPECT_TRUE(t["roofline"].contains(k)) << k;
    EXPECT_GT(t["roofline"]["ratio"].get<double>(), 0);
    const auto& rf = t["roofline"];
    EXPECT_NEAR(rf["memory_s"].get<double>(), rf["bytes"].get<double>() / (bw_used * 1e9), 1e-9 * rf["memory_s"].get<double>());
    EXPECT_NEAR(rf["compute_s"].get<double>(), rf["flops"].get<double>() / (peak_used * 1e9), 1e-9 * rf["compute_s"].get<double>());
    EXPECT_NEAR(rf["ratio"].get<double>(), rf["time_s"].get<double>() / rf["measured_s"].get<double>(), 1e-12);
    // Two threads: every test has the pool's time accounting, shares within [0, 1], and jobs.
    ASSERT_TRUE(t.contains("pool")) << t["name"];
    const auto& pj = t["pool"];
    EXPECT_GT(pj[t["kind"] == "pp" ? "jobs_per_chunk" : "jobs_per_step"].get<double>(), 0);
    for (const char* k : {"caller_serial_share", "caller_wait_share", "worker_busy_share"}) {
      EXPECT_GE(pj[k].get<double>(), 0) << k;
      EXPECT_LE(pj[k].get<double>(), 1.0 + 1e-9) << k;
    }
    EXPECT_GT(pj["worker_busy_share"].get<double>(), 0);
    // Phases: the model's timed scopes plus "other"; the shares partition the timed time.
    ASSERT_TRUE(t.contains("phases")) << t["name"];
    std::set<std::string> phases;
    double share_sum = 0;
    for (const auto& p : t["phases"]) {
      phases.insert(p["name"].get<std::string>());
      EXPECT_GE(p["share"].get<double>(), 0);
      EXPECT_GE(p[t["kind"] == "pp" ? "ms_per_chunk" : "ms_per_step"].get<double>(), 0);
      share_sum += p["share"].get<double>();
    }
    for (const char* k : {"attn.projections", "attn.core", "attn.wo_a", "moe.router", "moe.experts", "mhc.coefficients", "head", "other"})
      EXPECT_TRUE(phases.count(k)) << t["name"] << ": " << k;
    EXPECT_NEAR(share_sum, 1.0, 1e-6) << t["name"];
    if (t["kind"] == "tg") {
      EXPECT_DOUBLE_EQ(t["distinct_experts_per_layer"].get<double>(), model.config().n_activated_experts);
    }
    if (t["kind"] == "batch") {
      EXPECT_EQ(t["batch"].get<int>(), 3);
      EXPECT_GE(t["distinct_experts_per_layer"].get<double>(), model.config().n_activated_experts);
    }
  }
  EXPECT_EQ(names, (std::set<std::string>{"pp8@0", "tg4@0", "tg4 B3@0", "pp8@12", "tg4@12", "tg4 B3@12"}));
  const std::string table = report_table(r);
  EXPECT_NE(table.find("tg4 B3"), std::string::npos);
  EXPECT_NE(table.find("roofline"), std::string::npos);
  EXPECT_NE(table.find("| attn.core"), std::string::npos);

  o.reps = 0;
  EXPECT_THROW(run_model_bench(model, info, o), std::invalid_argument);
}
