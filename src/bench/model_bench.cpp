#include "bench/model_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>

#include "core/phase_profile.h"
#include "core/thread_pool.h"
#include "kernels/cpu/kernels.h"

namespace di::bench {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string fmt(const char* f, double a, double b = 0, double c = 0) {
  char buf[128];
  std::snprintf(buf, sizeof buf, f, a, b, c);
  return buf;
}

void check_options(const ModelBenchOptions& o) {
  if (o.reps < 1) throw std::invalid_argument("bench: --reps must be >= 1");
  if (o.threads < 1) throw std::invalid_argument("bench: --threads must be >= 1");
  if (o.fill_chunk < 1) throw std::invalid_argument("bench: fill chunk must be >= 1");
  for (int p : o.prompt_sizes)
    if (p < 1) throw std::invalid_argument("bench: -p sizes must be >= 1 (got " + std::to_string(p) + ")");
  for (int n : o.gen_sizes)
    if (n < 1) throw std::invalid_argument("bench: -n sizes must be >= 1 (got " + std::to_string(n) + ")");
  for (int64_t d : o.depths)
    if (d < 0) throw std::invalid_argument("bench: --depth must be >= 0 (got " + std::to_string(d) + ")");
  for (int b : o.batches)
    if (b < 1) throw std::invalid_argument("bench: --batch sizes must be >= 1 (got " + std::to_string(b) + ")");
  if (o.batch_steps < 0) throw std::invalid_argument("bench: --batch-steps must be >= 0");
}

// Per-test token streams are drawn before timing: nothing is allocated in the timed loops.
std::vector<int32_t> random_tokens(std::mt19937_64& rng, int64_t vocab, size_t n) {
  std::uniform_int_distribution<int32_t> d(0, int32_t(vocab - 1));
  std::vector<int32_t> t(n);
  for (auto& x : t) x = d(rng);
  return t;
}

nlohmann::json summary_json(const Summary& s) {
  return {{"median", s.median}, {"min", s.min}, {"max", s.max}, {"mad", s.mad}, {"mean", s.mean}, {"samples", s.samples}};
}

}  // namespace

std::vector<MatmulShape> model_matmul_shapes(const StepCost& cost, int m) {
  std::vector<MatmulShape> out;
  for (const LinearShape& l : cost.linear_shapes(m)) out.push_back({l.m, l.k, l.n, l.name});
  return out;
}

int64_t checkpoint_file_bytes(const std::string& dir) {
  namespace fs = std::filesystem;
  int64_t b = 0;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file() && e.path().extension() == ".safetensors") b += int64_t(e.file_size());
  return b;
}

BenchReport run_model_bench(const Model& model, const BenchedModel& info, const ModelBenchOptions& opts) {
  check_options(opts);
  auto log = [&](const std::string& s) { if (opts.log) opts.log(s); };
  // Declared before the cost attached to one of them: a StepCost detaches from its workspace when
  // destroyed, so the workspaces must outlive it.
  std::unique_ptr<Workspace> plain, observed;
  const std::unique_ptr<StepCost> cost = model.step_cost();
  if (!cost) throw std::invalid_argument("bench: the " + model.info().arch + " model declares no step costs");
  const int n_layers = std::max(1, cost->n_layers());
  BenchReport rep;
  rep.machine = machine_info();
  rep.threads = opts.threads;
  rep.model = info;

  log("bandwidth: " + std::to_string(opts.threads) + " threads");
  rep.bandwidth = measure_bandwidth({opts.threads, opts.bandwidth_bytes, opts.bandwidth_passes});
  log(fmt("bandwidth: read %.1f GB/s, triad %.1f GB/s", rep.bandwidth.read_gbs.median, rep.bandwidth.triad_gbs.median));
  log("matmul peak (oneDNN)");
  rep.matmul = measure_matmul_peak(model_matmul_shapes(*cost, opts.matmul_m), opts.threads, 5, 0.15);
  log(fmt("matmul peak: bf16 %.1f GFLOP/s, f32 %.1f GFLOP/s", rep.matmul.bf16_gflops, rep.matmul.f32_gflops));
  if (!rep.matmul.bf16_supported) log(rep.matmul.bf16_unsupported + "; the compute roofline uses the f32 peak");
  // Streaming weights is a read-only pattern: the read pass is the decode roofline's bandwidth.
  const double bw = rep.bandwidth.read_gbs.median, peak = rep.matmul.peak_gflops();
  rep.model.active_params = cost->active_params();
  rep.model.arch = model.info().arch;
  rep.model.config = cost->shape();
  if (rep.model.params == 0) rep.model.params = cost->total_params();

  // The kernels split their output columns over the model's own pool, or, for a model without one,
  // over this pool (the forward pass itself runs on the calling thread); the previous default pool
  // is restored on return.
  struct PoolScope {
    std::unique_ptr<ThreadPool> pool;
    ThreadPool* previous = kern::default_pool();
    explicit PoolScope(int n) : pool(n > 1 ? std::make_unique<ThreadPool>(n) : nullptr) { kern::set_default_pool(pool.get()); }
    ~PoolScope() { kern::set_default_pool(previous); }
  } pool_scope(model.thread_pool() ? 1 : opts.threads);

  std::mt19937_64 rng(opts.seed);
  // Token ids a sampler may produce (the vocab may be padded beyond what the tokenizer defines).
  const int64_t n_ids = model.info().sampleable_vocab;
  // Two workspaces: forward passes with `observed` report what they ran to the cost model.
  plain = model.new_workspace();
  observed = model.new_workspace();
  cost->attach(*observed);
  std::vector<float> logits;
  const StateOptions fresh{64, 64, nullptr, nullptr};
  auto forward = [&](SequenceState& s, std::span<const int32_t> toks, Workspace& ws) {
    BatchItem item{&s, toks, false, &logits};
    model.forward_batch(std::span(&item, 1), ws);
  };

  // Warm-up: faults in the mapped weights (an 8-token chunk runs most experts) and grows the
  // workspace, so that samples pay for neither.
  {
    const auto s = model.new_state(fresh);
    const auto toks = random_tokens(rng, n_ids, 8);
    forward(*s, toks, *observed);
    forward(*s, std::span(toks).first(1), *observed);
  }

  // Time accounting of the model phases and the pool over each test's timed samples (off outside them).
  ThreadPool* pool = model.thread_pool() ? model.thread_pool() : pool_scope.pool.get();
  auto timing_begin = [&] {
    phase::record(true);
    if (!pool) return;
    pool->reset_timing();
    pool->set_timing(true);
  };
  auto timing_end = [&](TestResult& r, double timed_s, double units) {
    phase::record(false);
    double attributed = 0;
    for (const phase::Total& p : phase::totals()) {
      r.phases.push_back({p.name, p.seconds / units, p.seconds / timed_s});
      attributed += p.seconds;
    }
    r.phases.push_back({"other", std::max(0.0, timed_s - attributed) / units, std::max(0.0, 1 - attributed / timed_s)});
    if (!pool) return;
    pool->set_timing(false);
    const ThreadPool::Timing t = pool->timing();
    r.pool_measured = true;
    r.pool_jobs_per_unit = double(t.jobs) / units;
    r.caller_serial_share = std::max(0.0, 1 - (t.caller_run_s + t.caller_wait_s) / timed_s);
    r.caller_wait_share = t.caller_wait_s / timed_s;
    r.worker_busy_share = t.worker_run_s / (timed_s * (pool->size() - 1));
  };

  const int gen_default = opts.gen_sizes.empty() ? 16 : opts.gen_sizes.front();
  const int batch_steps = opts.batch_steps > 0 ? opts.batch_steps : gen_default;
  for (const int64_t depth : opts.depths) {
    const std::unique_ptr<SequenceState> base = model.new_state(fresh);
    if (depth > 0) {
      const auto fill = random_tokens(rng, n_ids, size_t(depth));
      const auto t0 = Clock::now();
      for (int64_t at = 0; at < depth; at += opts.fill_chunk) {
        const int64_t n = std::min<int64_t>(opts.fill_chunk, depth - at);
        forward(*base, std::span(fill).subspan(size_t(at), size_t(n)), *plain);
        log(fmt("depth fill: %.0f / %.0f tokens (%.1f s)", double(at + n), double(depth), since(t0)));
      }
    }
    // Mean KV bytes and attention FLOPs of the queries at positions depth .. depth+n-1.
    auto queries = [&](int64_t n) {
      QueryCost q;
      for (int64_t t = depth; t < depth + n; ++t) {
        const QueryCost c = cost->query(t);
        q.kv_bytes += c.kv_bytes;
        q.attn_flops += c.attn_flops;
      }
      return q;
    };

    for (const int p : opts.prompt_sizes) {
      TestResult r;
      r.kind = "pp";
      r.name = "pp" + std::to_string(p);
      r.n_tokens = p;
      r.depth = depth;
      std::vector<double> secs, tps;
      double distinct = 0;
      timing_begin();
      for (int k = 0; k < opts.reps; ++k) {
        const auto s = base->clone();
        const auto toks = random_tokens(rng, n_ids, size_t(p));
        cost->begin_step();
        const auto t0 = Clock::now();
        forward(*s, toks, *observed);
        const double dt = since(t0);
        secs.push_back(dt);
        tps.push_back(p / dt);
        distinct += cost->distinct_experts();
        log(r.name + " @ d" + std::to_string(depth) + fmt(": rep %.0f: %.2f t/s", k + 1, p / dt));
      }
      timing_end(r, std::accumulate(secs.begin(), secs.end(), 0.0), opts.reps);
      r.distinct_experts = distinct / opts.reps / n_layers;
      const QueryCost q = queries(p);
      // The chunk reads the weights once; its KV reads mostly hit cache, so the last query's
      // stands for them. FLOPs: every token's linears, attention, one head row.
      const double wbytes = cost->step_weight_bytes(p, p, 1);
      const double flops = p * cost->token_linear_flops() + q.attn_flops + 2 * cost->head_params();
      r.roofline = make_roofline(wbytes, cost->query(depth + p - 1).kv_bytes, flops, bw, peak);
      r.seconds = summarize(secs);
      r.tokens_per_s = summarize(tps);
      r.measured_s = r.seconds.median;
      r.achieved_gflops = flops / r.measured_s / 1e9;
      rep.tests.push_back(std::move(r));
    }

    for (const int n : opts.gen_sizes) {
      TestResult r;
      r.kind = "tg";
      r.name = "tg" + std::to_string(n);
      r.n_tokens = n;
      r.depth = depth;
      std::vector<double> secs, tps, step;
      double wbytes = 0, distinct = 0;
      timing_begin();
      for (int k = 0; k < opts.reps; ++k) {
        const auto s = base->clone();
        const auto toks = random_tokens(rng, n_ids, size_t(n));
        double t = 0;
        for (int i = 0; i < n; ++i) {
          cost->begin_step();
          const auto t0 = Clock::now();
          forward(*s, std::span(toks).subspan(size_t(i), 1), *observed);
          t += since(t0);
          wbytes += cost->step_weight_bytes(1, 1, 1);
          distinct += cost->distinct_experts();
        }
        secs.push_back(t);
        tps.push_back(n / t);
        step.push_back(t / n * 1e3);
        log(r.name + " @ d" + std::to_string(depth) + fmt(": rep %.0f: %.2f t/s", k + 1, n / t));
      }
      const double steps = double(n) * opts.reps;
      timing_end(r, std::accumulate(secs.begin(), secs.end(), 0.0), steps);
      r.distinct_experts = distinct / steps / n_layers;
      const QueryCost q = queries(n);
      r.roofline = make_roofline(wbytes / steps, q.kv_bytes / n,
                                 cost->token_linear_flops() + q.attn_flops / n + 2 * cost->head_params(), bw, peak);
      r.seconds = summarize(secs);
      r.tokens_per_s = summarize(tps);
      r.step_ms = summarize(step);
      r.measured_s = r.step_ms.median / 1e3;
      r.achieved_gflops = r.roofline.flops / r.measured_s / 1e9;
      rep.tests.push_back(std::move(r));
    }

    for (const int B : opts.batches) {
      if (B == 1) continue;  // batch 1 is the tg test
      TestResult r;
      r.kind = "batch";
      r.name = "tg" + std::to_string(batch_steps) + " B" + std::to_string(B);
      r.n_tokens = batch_steps;
      r.depth = depth;
      r.batch = B;
      std::vector<double> secs, tps, step;
      double wbytes = 0, distinct = 0;
      std::vector<std::vector<float>> outs(static_cast<size_t>(B));
      std::vector<BatchItem> items(static_cast<size_t>(B));
      timing_begin();
      for (int k = 0; k < opts.reps; ++k) {
        std::vector<std::unique_ptr<SequenceState>> states;
        for (int b = 0; b < B; ++b) states.push_back(base->clone());
        const auto toks = random_tokens(rng, n_ids, size_t(B) * batch_steps);
        double t = 0;
        for (int i = 0; i < batch_steps; ++i) {
          for (int b = 0; b < B; ++b)
            items[size_t(b)] = {states[size_t(b)].get(), std::span(toks).subspan(size_t(i) * B + b, 1), false, &outs[size_t(b)]};
          cost->begin_step();
          const auto t0 = Clock::now();
          model.forward_batch(items, *observed);
          t += since(t0);
          wbytes += cost->step_weight_bytes(B, 1, B);
          distinct += cost->distinct_experts();
        }
        secs.push_back(t);
        tps.push_back(double(B) * batch_steps / t);
        step.push_back(t / batch_steps * 1e3);
        log(r.name + " @ d" + std::to_string(depth) + fmt(": rep %.0f: %.2f t/s", k + 1, double(B) * batch_steps / t));
      }
      const double steps = double(batch_steps) * opts.reps;
      timing_end(r, std::accumulate(secs.begin(), secs.end(), 0.0), steps);
      r.distinct_experts = distinct / steps / n_layers;
      const QueryCost q = queries(batch_steps);
      r.roofline = make_roofline(wbytes / steps, B * q.kv_bytes / batch_steps,
                                 B * (cost->token_linear_flops() + q.attn_flops / batch_steps + 2 * cost->head_params()), bw, peak);
      r.seconds = summarize(secs);
      r.tokens_per_s = summarize(tps);
      r.step_ms = summarize(step);
      r.measured_s = r.step_ms.median / 1e3;
      r.achieved_gflops = r.roofline.flops / r.measured_s / 1e9;
      rep.tests.push_back(std::move(r));
    }
  }

  log("bandwidth and matmul peak again, after the tests");
  rep.bandwidth_after = measure_bandwidth({opts.threads, opts.bandwidth_bytes, opts.bandwidth_passes});
  rep.matmul_peak_after = measure_matmul_peak(model_matmul_shapes(*cost, opts.matmul_m), opts.threads, 5, 0.15).peak_gflops();
  log(fmt("after: read %.1f GB/s, matmul peak %.1f GFLOP/s", rep.bandwidth_after.read_gbs.median, rep.matmul_peak_after) +
      " (" + rep.matmul.peak_dtype() + ")");
  rep.roofline_read_gbs = std::max(bw, rep.bandwidth_after.read_gbs.median);
  rep.roofline_matmul_gflops = std::max(peak, rep.matmul_peak_after);
  for (TestResult& t : rep.tests) {
    t.roofline = make_roofline(t.roofline.weight_bytes, t.roofline.kv_bytes, t.roofline.flops, rep.roofline_read_gbs,
                               rep.roofline_matmul_gflops);
    t.efficiency = t.roofline.time_s / t.measured_s;
  }
  return rep;
}

nlohmann::json report_json(const BenchReport& r) {
  using nlohmann::json;
  const auto& m = r.machine;
  json config = json::object();
  for (const auto& [name, v] : r.model.config) config[name] = v;
  json j;
  j["date"] = r.date;
  j["command"] = r.command;
  j["machine"] = {{"cpu_model", m.cpu_model}, {"logical_cpus", m.logical_cpus}, {"l3_bytes", m.l3_bytes},
                  {"mem_total_bytes", m.mem_total_bytes}, {"cpu_flags", m.cpu_flags}, {"kernel_isa", m.kernel_isa},
                  {"kernel_isa_best", m.kernel_isa_best}, {"hostname", m.hostname}};
  j["threads"] = r.threads;
  j["model"] = {{"path", r.model.path}, {"size", r.model.size}, {"params", r.model.params},
                {"active_params_per_token", r.model.active_params}, {"file_bytes", r.model.file_bytes},
                {"arch", r.model.arch}, {"config", config}};
  j["bandwidth"] = {{"threads", r.bandwidth.threads}, {"bytes", r.bandwidth.bytes},
                    {"read_gbs", summary_json(r.bandwidth.read_gbs)}, {"triad_gbs", summary_json(r.bandwidth.triad_gbs)}};
  j["bandwidth_after"] = {{"read_gbs", summary_json(r.bandwidth_after.read_gbs)},
                          {"triad_gbs", summary_json(r.bandwidth_after.triad_gbs)}};
  j["roofline_inputs"] = {{"read_gbs", r.roofline_read_gbs}, {"matmul_gflops", r.roofline_matmul_gflops},
                          {"matmul_dtype", r.matmul.peak_dtype()},
                          {"rule", "max of the measurements before and after the tests"}};
  json shapes = json::array();
  for (const auto& s : r.matmul.results)
    shapes.push_back({{"name", s.shape.name}, {"m", s.shape.m}, {"k", s.shape.k}, {"n", s.shape.n}, {"dtype", s.dtype},
                      {"gflops", summary_json(s.gflops)}});
  j["matmul"] = {{"library", "oneDNN " + r.matmul.dnnl_version}, {"isa", r.matmul.dnnl_isa}, {"threads", r.matmul.threads},
                 {"bf16_supported", r.matmul.bf16_supported}, {"bf16_gflops", r.matmul.bf16_gflops},
                 {"f32_gflops", r.matmul.f32_gflops}, {"peak_dtype", r.matmul.peak_dtype()},
                 {"peak_gflops_after", r.matmul_peak_after}, {"shapes", shapes}};
  if (!r.matmul.bf16_supported) j["matmul"]["bf16_unsupported"] = r.matmul.bf16_unsupported;
  json tests = json::array();
  for (const auto& t : r.tests) {
    json tj = {{"name", t.name}, {"kind", t.kind}, {"n_tokens", t.n_tokens}, {"depth", t.depth}, {"batch", t.batch},
               {"reps", t.seconds.samples.size()}, {"seconds", summary_json(t.seconds)},
               {"tokens_per_s", summary_json(t.tokens_per_s)}};
    if (t.kind != "pp") tj["step_ms"] = summary_json(t.step_ms);
    tj["distinct_experts_per_layer"] = t.distinct_experts;
    tj["roofline"] = {{"unit", t.kind == "pp" ? "chunk" : "step"},
                      {"weight_bytes", t.roofline.weight_bytes}, {"kv_bytes", t.roofline.kv_bytes},
                      {"bytes", t.roofline.bytes}, {"flops", t.roofline.flops},
                      {"memory_s", t.roofline.memory_s}, {"compute_s", t.roofline.compute_s},
                      {"time_s", t.roofline.time_s}, {"bound", t.roofline.compute_bound() ? "compute" : "memory"},
                      {"measured_s", t.measured_s}, {"ratio", t.efficiency},
                      {"achieved_gflops", t.achieved_gflops},
                      {"achieved_gbs", t.roofline.bytes / t.measured_s / 1e9}};
    if (t.pool_measured)
      tj["pool"] = {{"jobs_per_" + std::string(t.kind == "pp" ? "chunk" : "step"), t.pool_jobs_per_unit},
                    {"caller_serial_share", t.caller_serial_share},
                    {"caller_wait_share", t.caller_wait_share},
                    {"worker_busy_share", t.worker_busy_share}};
    json phases = json::array();
    for (const auto& p : t.phases)
      phases.push_back({{"name", p.name}, {"ms_per_" + std::string(t.kind == "pp" ? "chunk" : "step"), 1e3 * p.seconds_per_unit},
                        {"share", p.share}});
    tj["phases"] = std::move(phases);
    tests.push_back(std::move(tj));
  }
  j["tests"] = tests;
  return j;
}

namespace {
// Phases as rows, tests as columns: ms per step (tg, batch) or per chunk (pp), and the share.
std::string phase_table(const BenchReport& r) {
  std::vector<std::string> names;  // first-seen order across the tests
  for (const auto& t : r.tests)
    for (const auto& p : t.phases)
      if (std::find(names.begin(), names.end(), p.name) == names.end()) names.push_back(p.name);
  if (names.empty()) return "";
  char buf[128];
  std::string out = "\nphases: wall time of the calling thread (self time), mean ms per step or chunk (% of the timed time)\n\n";
  std::snprintf(buf, sizeof buf, "| %-22s |", "phase");
  out += buf;
  for (const auto& t : r.tests) {
    std::snprintf(buf, sizeof buf, " %11s @%-5lld |", t.name.c_str(), static_cast<long long>(t.depth));
    out += buf;
  }
  out += "\n|------------------------|";
  for (size_t i = 0; i < r.tests.size(); ++i) out += "--------------------:|";
  out += "\n";
  for (const auto& name : names) {
    std::snprintf(buf, sizeof buf, "| %-22s |", name.c_str());
    out += buf;
    for (const auto& t : r.tests) {
      const auto it = std::find_if(t.phases.begin(), t.phases.end(), [&](const auto& p) { return p.name == name; });
      if (it == t.phases.end()) std::snprintf(buf, sizeof buf, " %19s |", "-");
      else std::snprintf(buf, sizeof buf, " %10.3f (%5.1f %%) |", 1e3 * it->seconds_per_unit, 100 * it->share);
      out += buf;
    }
    out += "\n";
  }
  return out;
}
}  // namespace

std::string report_table(const BenchReport& r) {
  std::string out;
  char buf[512];
  std::snprintf(buf, sizeof buf, "cpu: %s, %d threads, kernels: %s\n", r.machine.cpu_model.c_str(), r.threads,
                r.machine.kernel_isa.c_str());
  out += buf;
  std::snprintf(buf, sizeof buf, "model: %s (%.2f B params, %.1f M active/token, %.2f GB files)\n", r.model.path.c_str(),
                double(r.model.params) / 1e9, r.model.active_params / 1e6, double(r.model.file_bytes) / 1e9);
  out += buf;
  std::snprintf(buf, sizeof buf,
                "bandwidth (%.2f GB buffer): read %.1f GB/s [%.1f-%.1f], triad %.1f GB/s [%.1f-%.1f]\n",
                double(r.bandwidth.bytes) / 1e9, r.bandwidth.read_gbs.median, r.bandwidth.read_gbs.min,
                r.bandwidth.read_gbs.max, r.bandwidth.triad_gbs.median, r.bandwidth.triad_gbs.min, r.bandwidth.triad_gbs.max);
  out += buf;
  if (r.matmul.bf16_supported)
    std::snprintf(buf, sizeof buf, "matmul peak (oneDNN %s, %s): bf16 %.1f GFLOP/s, f32 %.1f GFLOP/s\n",
                  r.matmul.dnnl_version.c_str(), r.matmul.dnnl_isa.c_str(), r.matmul.bf16_gflops, r.matmul.f32_gflops);
  else
    std::snprintf(buf, sizeof buf, "matmul peak (oneDNN %s, %s): bf16 unsupported on this CPU, f32 %.1f GFLOP/s\n",
                  r.matmul.dnnl_version.c_str(), r.matmul.dnnl_isa.c_str(), r.matmul.f32_gflops);
  out += buf;
  std::snprintf(buf, sizeof buf,
                "after the tests: read %.1f GB/s, %s %.1f GFLOP/s; rooflines use the higher: %.1f GB/s, %.1f GFLOP/s\n\n",
                r.bandwidth_after.read_gbs.median, r.matmul.peak_dtype(), r.matmul_peak_after, r.roofline_read_gbs,
                r.roofline_matmul_gflops);
  out += buf;
  out += "| test        |  depth |   t/s (median ± MAD) |         min..max | step ms | roofline t/s | eff. % | bound   |\n";
  out += "|-------------|-------:|---------------------:|-----------------:|--------:|-------------:|-------:|---------|\n";
  for (const auto& t : r.tests) {
    const double tokens = t.kind == "pp" ? t.n_tokens : t.batch;  // per roofline unit
    std::snprintf(buf, sizeof buf, "| %-11s | %6lld | %11.2f ± %6.2f | %7.2f..%7.2f | %7s | %12.2f | %6.1f | %-7s |\n",
                  t.name.c_str(), static_cast<long long>(t.depth), t.tokens_per_s.median, t.tokens_per_s.mad,
                  t.tokens_per_s.min, t.tokens_per_s.max,
                  t.kind == "pp" ? "-" : fmt("%.1f", t.step_ms.median).c_str(), tokens / t.roofline.time_s,
                  100 * t.efficiency, t.roofline.compute_bound() ? "compute" : "memory");
    out += buf;
  }
  out += phase_table(r);
  bool any_pool = false;
  for (const auto& t : r.tests) any_pool |= t.pool_measured;
  if (!any_pool) return out;
  out += "\npool time (shares of the timed wall): caller serial = outside pool jobs, caller wait = waiting for\n"
         "the workers at the end of jobs, workers busy = running chunks\n\n";
  out += "| test        |  depth | jobs/unit | caller serial % | caller wait % | workers busy % |\n";
  out += "|-------------|-------:|----------:|----------------:|--------------:|---------------:|\n";
  for (const auto& t : r.tests) {
    if (!t.pool_measured) continue;
    std::snprintf(buf, sizeof buf, "| %-11s | %6lld | %9.1f | %15.1f | %13.1f | %14.1f |\n", t.name.c_str(),
                  static_cast<long long>(t.depth), t.pool_jobs_per_unit, 100 * t.caller_serial_share,
                  100 * t.caller_wait_share, 100 * t.worker_busy_share);
    out += buf;
  }
  return out;
}

}  // namespace di::bench
