#include <gtest/gtest.h>
#include "io/safetensors.h"
using namespace di;
TEST(Safetensors, GoldenLoads) {
  Checkpoint ck = Checkpoint::open(std::string(DI_SOURCE_DIR) + "/tests/data/golden/v41-tiny/model");
  EXPECT_EQ(ck.tensors().size(), 870u);
}
