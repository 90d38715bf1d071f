// What machine a benchmark ran on: CPU model, core count, caches, memory, and the kernel ISA the
// forward pass is using.
#pragma once

#include <cstdint>
#include <string>

namespace di::bench {

struct MachineInfo {
  std::string cpu_model;     // /proc/cpuinfo "model name"
  int logical_cpus = 0;      // online
  int64_t l3_bytes = 0;      // last-level cache as the OS reports it (0 = unknown)
  int64_t mem_total_bytes = 0;
  std::string kernel_isa;    // di::kern::isa_name(active_isa())
  std::string kernel_isa_best;
  std::string cpu_flags;     // the SIMD flags relevant to the kernels (avx2 avx512f avx512_bf16 ...)
  std::string hostname;
};

MachineInfo machine_info();

}  // namespace di::bench
