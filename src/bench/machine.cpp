#include "bench/machine.h"

#include <unistd.h>

#include <fstream>
#include <sstream>
#include <thread>

#include "kernels/cpu/kernels.h"

namespace di::bench {

namespace {

std::string trim(std::string s) {
  const auto b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t\r\n");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

// "260 MiB"/"266240K" style sizes from sysfs.
int64_t parse_size(const std::string& s) {
  int64_t v = 0;
  size_t i = 0;
  while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) v = v * 10 + (s[i++] - '0');
  const std::string unit = trim(s.substr(i));
  if (unit.empty()) return v;
  switch (unit[0]) {
    case 'K': case 'k': return v << 10;
    case 'M': case 'm': return v << 20;
    case 'G': case 'g': return v << 30;
    default: return v;
  }
}

int64_t l3_size() {
  // The largest cache level sysfs lists for cpu0.
  int64_t best = 0;
  for (int idx = 0; idx < 8; ++idx) {
    std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(idx) + "/size");
    if (!f) continue;
    std::string s;
    std::getline(f, s);
    best = std::max(best, parse_size(s));
  }
  if (best == 0) {
    const long s = sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (s > 0) best = s;
  }
  return best;
}

}  // namespace

MachineInfo machine_info() {
  MachineInfo m;
  std::ifstream cpu("/proc/cpuinfo");
  std::string line, flags;
  while (std::getline(cpu, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string key = trim(line.substr(0, colon)), val = trim(line.substr(colon + 1));
    if (key == "model name" && m.cpu_model.empty()) m.cpu_model = val;
    if (key == "flags" && flags.empty()) flags = " " + val + " ";
  }
  for (const char* f : {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512vbmi",
                        "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"})
    if (flags.find(std::string(" ") + f + " ") != std::string::npos) m.cpu_flags += (m.cpu_flags.empty() ? "" : " ") + std::string(f);
  m.logical_cpus = int(std::thread::hardware_concurrency());
  m.l3_bytes = l3_size();
  std::ifstream mem("/proc/meminfo");
  while (std::getline(mem, line))
    if (line.rfind("MemTotal:", 0) == 0) {
      std::istringstream is(line.substr(9));
      int64_t kb = 0;
      is >> kb;
      m.mem_total_bytes = kb * 1024;
    }
  m.kernel_isa = kern::isa_name(kern::active_isa());
  m.kernel_isa_best = kern::isa_name(kern::best_isa());
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) == 0) m.hostname = host;
  return m;
}

}  // namespace di::bench
