#include "bench/stats.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace di::bench {

double mean(std::span<const double> x) {
  if (x.empty()) return 0;
  double s = 0;
  for (double v : x) s += v;
  return s / double(x.size());
}

double stddev(std::span<const double> x) {
  if (x.size() < 2) return 0;
  const double m = mean(x);
  double s = 0;
  for (double v : x) s += (v - m) * (v - m);
  return std::sqrt(s / double(x.size()));
}

double percentile(std::span<const double> x, double p) {
  if (x.empty()) return 0;
  if (!(p >= 0 && p <= 100)) throw std::invalid_argument("percentile must be in [0, 100]");
  std::vector<double> v(x.begin(), x.end());
  std::sort(v.begin(), v.end());
  const double rank = p / 100.0 * double(v.size() - 1);
  const size_t lo = size_t(std::floor(rank)), hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (rank - double(lo));
}

double median(std::span<const double> x) { return percentile(x, 50); }

double mad(std::span<const double> x) {
  if (x.empty()) return 0;
  const double m = median(x);
  std::vector<double> d;
  d.reserve(x.size());
  for (double v : x) d.push_back(std::fabs(v - m));
  return median(d);
}

Summary summarize(std::vector<double> samples) {
  Summary s;
  s.samples = std::move(samples);
  if (s.samples.empty()) return s;
  s.median = median(s.samples);
  s.mad = mad(s.samples);
  s.mean = mean(s.samples);
  const auto [lo, hi] = std::minmax_element(s.samples.begin(), s.samples.end());
  s.min = *lo;
  s.max = *hi;
  return s;
}

}  // namespace di::bench
