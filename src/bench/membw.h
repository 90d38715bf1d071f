// Memory bandwidth as the forward pass can use it: a STREAM-like triad (a = b + s*c, counted as
// STREAM does: 3 arrays x 4 bytes per element, write-allocate traffic not counted) and a read-only
// pass (a sum, the access pattern of streaming weights), over a buffer much larger than the
// last-level cache, split across `threads` threads. Each figure is the median of `passes` timed
// passes after one untimed warm-up pass.
#pragma once

#include <cstdint>

#include "bench/stats.h"

namespace di::bench {

struct BandwidthOptions {
  int threads = 1;
  int64_t bytes = 0;  // working set; 0 = max(4 x L3, 1 GiB), at most a quarter of physical memory
  int passes = 5;
};

struct BandwidthResult {
  int threads = 0;
  int64_t bytes = 0;  // working set of each test
  Summary read_gbs, triad_gbs;  // GB/s (1e9 bytes/s)
};

BandwidthResult measure_bandwidth(const BandwidthOptions& opts);
int64_t default_bandwidth_bytes();

}  // namespace di::bench
