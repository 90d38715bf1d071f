// Streaming safetensors writers for checkpoints too large to hold in memory.
//
// Every tensor's name, dtype and shape is given up front, so the header and each tensor's byte
// offset are known before any data exists. Tensor bytes are then written at their offsets
// (pwrite) in any order and from any number of threads, and each file is renamed into place
// only when every byte of it has been written.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "io/safetensors.h"

namespace di {

struct TensorEntry {
  std::string name;
  DType dtype{};
  std::vector<int64_t> shape;
  uint64_t nbytes() const;  // numel * dtype_size; throws LoadError on a negative/overflowing shape
};

// Each tensor's offset in the data buffer: widest element first, `entries` order within a width,
// so that every tensor is aligned to its element size.
std::vector<uint64_t> safetensors_data_offsets(const std::vector<TensorEntry>& entries);
// The exact bytes a safetensors header for `entries` takes, including the 8-byte length prefix;
// the same text StreamingSafetensorsFile writes.
std::string safetensors_header(const std::vector<TensorEntry>& entries,
                               const std::map<std::string, std::string>& metadata);

// One safetensors file. Data goes to PATH.tmp.PID until finish() renames it to PATH; a file
// destroyed before finish() is removed.
class StreamingSafetensorsFile {
 public:
  StreamingSafetensorsFile(std::string path, std::vector<TensorEntry> entries,
                           std::map<std::string, std::string> metadata = {});
  ~StreamingSafetensorsFile();
  StreamingSafetensorsFile(const StreamingSafetensorsFile&) = delete;
  StreamingSafetensorsFile& operator=(const StreamingSafetensorsFile&) = delete;

  // Writes bytes [offset, offset+n) of tensor `index`. Thread-safe; ranges must not overlap.
  void write(size_t index, uint64_t offset, const void* data, uint64_t n);
  // Checks every tensor was written in full, fsyncs and renames into place. Throws LoadError.
  void finish();

  const std::string& path() const { return path_; }
  uint64_t file_size() const { return data_start_ + data_bytes_; }
  const std::vector<TensorEntry>& entries() const { return entries_; }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  bool finished_ = false;
  std::vector<TensorEntry> entries_;
  std::vector<uint64_t> offsets_;  // data offset of each tensor, relative to the data buffer
  std::unique_ptr<std::atomic<uint64_t>[]> written_;
  uint64_t data_start_ = 0, data_bytes_ = 0;
};

// A checkpoint directory: model.safetensors alone, or, when the data exceeds `shard_bytes`
// (0 = never split), model-0000K-of-0000N.safetensors shards plus model.safetensors.index.json.
// Tensors keep their order; a shard is closed before the tensor that would push it past
// `shard_bytes` (a tensor larger than that gets a shard of its own).
class ShardedCheckpointWriter {
 public:
  ShardedCheckpointWriter(const std::string& dir, const std::vector<TensorEntry>& entries, uint64_t shard_bytes,
                          const std::map<std::string, std::string>& metadata = {});
  // Writes bytes of tensor `index` (index into the constructor's `entries`). Thread-safe.
  void write(size_t index, uint64_t offset, const void* data, uint64_t n);
  // Finishes every shard and writes the index (when sharded). Throws LoadError.
  void finish();

  std::vector<std::string> files() const;  // shard paths (+ the index when sharded)
  uint64_t total_file_bytes() const;        // sum of the safetensors file sizes
  uint64_t total_tensor_bytes() const { return total_tensor_bytes_; }
  size_t n_shards() const { return shards_.size(); }

 private:
  std::string dir_;
  std::vector<std::unique_ptr<StreamingSafetensorsFile>> shards_;
  std::vector<std::pair<size_t, size_t>> where_;  // tensor -> (shard, index in shard)
  uint64_t total_tensor_bytes_ = 0;
  std::string index_path_;
};

}  // namespace di
