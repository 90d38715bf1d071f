// Where the V3 tests find the golden v3-tiny folder (tests/data/golden/v3-tiny).
#pragma once

#include <string>

namespace di::test {
inline std::string v3_golden_dir() { return std::string(DI_SOURCE_DIR) + "/tests/data/golden/v3-tiny"; }
inline std::string v3_golden_model_dir() { return v3_golden_dir() + "/model"; }
}  // namespace di::test
