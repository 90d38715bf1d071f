// The canonical tensor list of a V4.1 checkpoint for a given config: release names, dtypes and
// shapes (v41-architecture.md §2.17; the golden v41-tiny checkpoint is the authority).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/v41/config.h"
#include "io/safetensors.h"

namespace di {

struct TensorSpec {
  std::string name;
  DType dtype{};
  std::vector<int64_t> shape;
  // False only for vision-tower tensors, whose release dtypes are not documented; their
  // names and shapes are still checked.
  bool check_dtype = true;
  bool operator==(const TensorSpec& o) const {
    return name == o.name && dtype == o.dtype && shape == o.shape && check_dtype == o.check_dtype;
  }
};

// Every tensor a checkpoint for `c` holds, in a fixed order: globals, backbone layers, DSpark
// stages (`mtp.S.*`), then vision (only when c.vision_n_layers > 0).
std::vector<TensorSpec> v41_tensor_specs(const V41Config& c);

// Compares the checkpoint with v41_tensor_specs(c). Throws one LoadError listing the problems
// (missing, unexpected, wrong dtype, wrong shape; the first 20 and a count), each naming the
// tensor and the file; the message starts with the checkpoint path.
void validate_v41_checkpoint(const Checkpoint& ckpt, const V41Config& c);

}  // namespace di
