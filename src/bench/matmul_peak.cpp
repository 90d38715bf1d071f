#include "bench/matmul_peak.h"

#include <omp.h>

#include <chrono>
#include <oneapi/dnnl/dnnl.hpp>
#include <stdexcept>

namespace di::bench {

namespace {

const char* isa_str(dnnl::cpu_isa isa) {
  switch (isa) {
    case dnnl::cpu_isa::sse41: return "sse41";
    case dnnl::cpu_isa::avx: return "avx";
    case dnnl::cpu_isa::avx2: return "avx2";
    case dnnl::cpu_isa::avx2_vnni: return "avx2_vnni";
    case dnnl::cpu_isa::avx512_core: return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni: return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16: return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx: return "avx512_core_amx";
    default: return "other";
  }
}

Summary time_shape(dnnl::engine& eng, dnnl::stream& strm, const MatmulShape& s, dnnl::memory::data_type dt, int reps,
                   double min_seconds) {
  using dnnl::memory;
  using tag = memory::format_tag;
  const memory::desc src_md({s.m, s.k}, dt, tag::ab), dst_md({s.m, s.n}, memory::data_type::f32, tag::ab);
  const memory::desc wplain_md({s.k, s.n}, dt, tag::ab), wany_md({s.k, s.n}, dt, tag::any);
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src_md, wany_md, dst_md), eng);
  memory src(src_md, eng), dst(dst_md, eng), wplain(wplain_md, eng), w(pd.weights_desc(), eng);
  // Small non-zero inputs (denormal-free); bf16 data is filled through an f32 reorder.
  auto fill = [&](memory& m, const memory::desc& md) {
    const memory::desc f32_md(md.dims(), memory::data_type::f32, tag::ab);
    memory tmp(f32_md, eng);
    float* p = static_cast<float*>(tmp.get_data_handle());
    const size_t n = f32_md.get_size() / sizeof(float);
    for (size_t i = 0; i < n; ++i) p[i] = float(int(i % 17) - 8) * 0.0625f;
    dnnl::reorder(tmp, m).execute(strm, tmp, m);
  };
  fill(src, src_md);
  fill(wplain, wplain_md);
  dnnl::reorder(wplain, w).execute(strm, wplain, w);
  strm.wait();
  const dnnl::matmul mm(pd);
  auto run = [&] { mm.execute(strm, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_DST, dst}}); };
  for (int i = 0; i < 3; ++i) run();
  strm.wait();
  const double flop = 2.0 * double(s.m) * double(s.k) * double(s.n);
  std::vector<double> g;
  for (int r = 0; r < reps; ++r) {
    int iters = 0;
    const auto t0 = std::chrono::steady_clock::now();
    double el = 0;
    do {
      run();
      strm.wait();
      ++iters;
      el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    } while (el < min_seconds);
    g.push_back(flop * iters / el / 1e9);
  }
  return summarize(std::move(g));
}

// A primitive descriptor for a small bf16 matmul exists exactly when oneDNN implements bf16 here.
bool bf16_matmul_supported(dnnl::engine& eng, std::string& why) {
  using dnnl::memory;
  try {
    const memory::desc a({16, 32}, memory::data_type::bf16, memory::format_tag::ab);
    const memory::desc b({32, 16}, memory::data_type::bf16, memory::format_tag::any);
    const memory::desc c({16, 16}, memory::data_type::f32, memory::format_tag::ab);
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), eng);
    return true;
  } catch (const dnnl::error& e) {
    why = std::string("oneDNN has no bf16 matmul on this CPU (") + e.what() + ")";
    return false;
  }
}

}  // namespace

MatmulPeak measure_matmul_peak(const std::vector<MatmulShape>& shapes, int threads, int reps, double min_seconds) {
  if (threads < 1) throw std::invalid_argument("matmul peak: threads must be >= 1");
  for (const auto& s : shapes)
    if (s.m < 1 || s.k < 1 || s.n < 1)
      throw std::invalid_argument("matmul peak: bad shape " + s.name + " (" + std::to_string(s.m) + "x" +
                                  std::to_string(s.k) + "x" + std::to_string(s.n) + ")");
  omp_set_num_threads(threads);
  MatmulPeak out;
  out.threads = threads;
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream strm(eng);
  const dnnl_version_t* v = dnnl_version();
  out.dnnl_version = std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch);
  out.bf16_supported = bf16_matmul_supported(eng, out.bf16_unsupported);
  for (const auto& s : shapes)
    for (const auto dt : {dnnl::memory::data_type::bf16, dnnl::memory::data_type::f32}) {
      if (dt == dnnl::memory::data_type::bf16 && !out.bf16_supported) continue;
      MatmulResult r{s, dt == dnnl::memory::data_type::bf16 ? "bf16" : "f32", time_shape(eng, strm, s, dt, reps, min_seconds)};
      double& best = dt == dnnl::memory::data_type::bf16 ? out.bf16_gflops : out.f32_gflops;
      best = std::max(best, r.gflops.median);
      out.results.push_back(std::move(r));
    }
  out.dnnl_isa = isa_str(dnnl::get_effective_cpu_isa());
  return out;
}

}  // namespace di::bench
