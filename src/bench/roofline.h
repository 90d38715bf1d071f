// The roofline time of a step from the bytes it moves and the FLOPs it computes (the model's
// StepCost says how many), at measured bandwidth and matmul throughput.
#pragma once

namespace di::bench {

struct Roofline {
  double weight_bytes = 0, kv_bytes = 0, bytes = 0, flops = 0;
  double memory_s = 0, compute_s = 0, time_s = 0;  // bytes / bandwidth, flops / peak, their max
  bool compute_bound() const { return compute_s > memory_s; }
};
Roofline make_roofline(double weight_bytes, double kv_bytes, double flops, double bandwidth_gbs, double peak_gflops);

}  // namespace di::bench
