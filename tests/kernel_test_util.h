// Shared by the kernel tests, which run each check on every ISA path this CPU supports.
#pragma once

#include <vector>

#include "kernels/cpu/kernels.h"

namespace di::test {

// The kernel paths this CPU can run, scalar first.
inline std::vector<kern::Isa> isas() {
  std::vector<kern::Isa> v;
  for (kern::Isa i : {kern::Isa::Scalar, kern::Isa::Avx2, kern::Isa::Avx512})
    if (kern::isa_supported(i)) v.push_back(i);
  return v;
}

// Restores the active ISA at scope exit, also when a failed ASSERT returns early.
struct IsaGuard {
  kern::Isa saved = kern::active_isa();
  ~IsaGuard() { kern::set_isa(saved); }
};

}  // namespace di::test
