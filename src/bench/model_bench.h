// `deepinfer bench` (like llama-bench): prompt processing (pp N) and generation (tg N) throughput
// at given context depths, batched decode through Model::forward_batch, each compared with the
// roofline from bandwidth and matmul throughput measured in the same process.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/machine.h"
#include "bench/matmul_peak.h"
#include "bench/membw.h"
#include "bench/roofline.h"
#include "bench/stats.h"
#include "model/model.h"

namespace di::bench {

struct ModelBenchOptions {
  std::vector<int> prompt_sizes{512};  // pp N tests (0 entries = none)
  std::vector<int> gen_sizes{128};     // tg N tests
  std::vector<int64_t> depths{0};
  std::vector<int> batches{1};         // B > 1: batched decode of B sequences, each at the depth
  int batch_steps = 0;                 // decode steps per batched sample (0 = the first tg size)
  int reps = 5;
  int threads = 1;
  int fill_chunk = 512;                // chunk size when filling the context to `depth` (untimed)
  uint64_t seed = 1;
  int64_t bandwidth_bytes = 0;         // 0 = default_bandwidth_bytes()
  int bandwidth_passes = 5;
  int matmul_m = 512;                  // rows of the matmul-peak shapes
  std::function<void(const std::string&)> log;  // progress lines (stderr); may be empty
};

struct TestResult {
  std::string name;   // "pp512", "tg128", "tg128 B8"
  std::string kind;   // "pp", "tg", "batch"
  int n_tokens = 0;   // per sequence: chunk size (pp) or decode steps (tg, batch)
  int64_t depth = 0;
  int batch = 1;
  Summary seconds;         // wall time of each sample (the whole chunk or all steps)
  Summary tokens_per_s;    // tokens (all sequences) / seconds, per sample
  Summary step_ms;         // tg and batch: mean step time of each sample
  double distinct_experts = 0;  // mean distinct routed experts per layer per step (tg, batch)
  Roofline roofline;       // per step (tg, batch) or per chunk (pp)
  double measured_s = 0;   // median time of the same unit as the roofline
  double efficiency = 0;   // roofline.time_s / measured_s
  double achieved_gflops = 0;
  // Where the threads' time went during the timed samples (ThreadPool::Timing; threads > 1), as
  // shares of the timed wall time: the caller outside pool jobs (serial per-token code and work
  // run inline), the caller waiting at the end of jobs for the workers, and the workers running.
  bool pool_measured = false;
  double pool_jobs_per_unit = 0;  // per step (tg, batch) or chunk (pp)
  double caller_serial_share = 0, caller_wait_share = 0, worker_busy_share = 0;
  // The forward pass's phases (phase::Scope, the calling thread's wall time, self time): seconds
  // per unit and share of the timed wall time, in the model's order; "other" is the rest (the
  // bench loop, sampling, code outside any phase).
  struct Phase {
    std::string name;
    double seconds_per_unit = 0, share = 0;
  };
  std::vector<Phase> phases;
};

struct BenchedModel {
  std::string path, size;
  int64_t params = 0;
  double active_params = 0;
  int64_t file_bytes = 0;
  std::string arch;                                        // filled by run_model_bench
  std::vector<std::pair<std::string, int64_t>> config;  // StepCost::shape(), filled by run_model_bench
};

struct BenchReport {
  std::string date, command;
  MachineInfo machine;
  int threads = 1;
  BenchedModel model;
  BandwidthResult bandwidth;        // measured before the tests
  MatmulPeak matmul;
  BandwidthResult bandwidth_after;  // and again after them (a shared machine drifts)
  double matmul_peak_after = 0;     // matmul.peak_dtype() peak, after the tests
  // What the rooflines use: the higher of the two measurements, so that contention during one
  // of them cannot inflate an efficiency. The compute peak is bf16 where oneDNN has it, else f32.
  double roofline_read_gbs = 0, roofline_matmul_gflops = 0;
  std::vector<TestResult> tests;
};

// Shapes for the matmul peak: the model's big linears at M = m rows.
std::vector<MatmulShape> model_matmul_shapes(const StepCost& cost, int m);

// Measures bandwidth and matmul peak, then runs every test on `model`.
BenchReport run_model_bench(const Model& model, const BenchedModel& info, const ModelBenchOptions& opts);

nlohmann::json report_json(const BenchReport& r);
std::string report_table(const BenchReport& r);

// Sum of the sizes of the *.safetensors files in a model directory.
int64_t checkpoint_file_bytes(const std::string& model_dir);

}  // namespace di::bench
