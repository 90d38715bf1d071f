// Summary statistics of benchmark samples. Percentiles use linear interpolation between closest
// ranks (NumPy's default), so `bench serve` numbers match vLLM's for the same latencies.
#pragma once

#include <span>
#include <vector>

namespace di::bench {

double mean(std::span<const double> x);             // 0 for no samples
double stddev(std::span<const double> x);           // population (NumPy np.std); 0 for < 2 samples
double percentile(std::span<const double> x, double p);  // p in [0, 100]; 0 for no samples
double median(std::span<const double> x);
double mad(std::span<const double> x);              // median absolute deviation from the median

struct Summary {
  std::vector<double> samples;
  double median = 0, min = 0, max = 0, mad = 0, mean = 0;
};
Summary summarize(std::vector<double> samples);

}  // namespace di::bench
