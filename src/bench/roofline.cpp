#include "bench/roofline.h"

#include <algorithm>

namespace di::bench {

Roofline make_roofline(double weight_bytes, double kv_bytes, double flops, double bandwidth_gbs, double peak_gflops) {
  Roofline r;
  r.weight_bytes = weight_bytes;
  r.kv_bytes = kv_bytes;
  r.bytes = weight_bytes + kv_bytes;
  r.flops = flops;
  r.memory_s = bandwidth_gbs > 0 ? r.bytes / (bandwidth_gbs * 1e9) : 0;
  r.compute_s = peak_gflops > 0 ? flops / (peak_gflops * 1e9) : 0;
  r.time_s = std::max(r.memory_s, r.compute_s);
  return r;
}

}  // namespace di::bench
