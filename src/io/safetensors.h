// Safetensors checkpoints: one file or a sharded set with model.safetensors.index.json.
//
// Files are memory-mapped read-only and tensors are views into the mapping (zero copy): the
// packed FP8/FP4 weights are used in place by the kernels. Every header is validated on open
// (JSON, dtypes, shapes vs byte sizes, offsets inside the file, overlaps), and every error names
// the file and, where there is one, the tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace di {

enum class DType : uint8_t { BF16, F16, F32, F64, I8, U8, I16, I32, I64, BOOL, F8_E4M3, F8_E8M0 };

const char* dtype_name(DType t);        // safetensors spelling, e.g. "F8_E4M3"
size_t dtype_size(DType t);             // bytes per element
bool dtype_from_name(const std::string& s, DType* out);
// "[2, 3]" for messages.
std::string shape_str(const std::vector<int64_t>& shape);

// Any checkpoint / config problem. The message names the file and the tensor or key.
struct LoadError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A load stopped on request (shutdown while loading), not because of a bad checkpoint.
struct LoadCancelled : LoadError {
  using LoadError::LoadError;
};

struct TensorView {
  std::string name;
  DType dtype{};
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // into the mapping, or a copy where the file misaligns it for its dtype
  size_t nbytes = 0;
  const std::string* file = nullptr;  // file it lives in (for messages)

  int64_t numel() const;
  int64_t dim(int i) const { return shape.at(size_t(i)); }
  template <class T> const T* as() const { return reinterpret_cast<const T*>(data); }
};

class MappedFile;  // RAII mmap

class Checkpoint {
 public:
  // `path` is a .safetensors file, or a directory holding model.safetensors.index.json or exactly
  // one *.safetensors file. Throws LoadError.
  static Checkpoint open(const std::string& path);

  const TensorView* find(const std::string& name) const;
  // Throws LoadError naming the tensor and the checkpoint path when absent.
  const TensorView& get(const std::string& name) const;
  // get() plus checks; throws LoadError "file: tensor NAME has dtype X, expected Y" / shape.
  const TensorView& expect(const std::string& name, DType dtype, const std::vector<int64_t>& shape) const;

  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::string& path() const { return path_; }
  size_t total_bytes() const;  // sum of mapped file sizes
  // The mapped files (one, or every shard the index names), in load order.
  std::vector<std::string> files() const;
  // Metadata ("__metadata__") of the first file / the single file; empty if none.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  Checkpoint(Checkpoint&&) noexcept;
  Checkpoint& operator=(Checkpoint&&) noexcept;
  ~Checkpoint();

 private:
  Checkpoint() = default;
  std::string path_;
  std::vector<std::unique_ptr<MappedFile>> files_;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Writer for generated checkpoints and logit dumps. Tensors are written widest element first
// (insertion order within a width, so each is aligned to its element size) with
// the header sorted as safetensors expects; metadata goes to "__metadata__".
class SafetensorsWriter {
 public:
  void add(const std::string& name, DType dtype, std::vector<int64_t> shape, std::vector<uint8_t> bytes);
  template <class T>
  void add_typed(const std::string& name, DType dtype, std::vector<int64_t> shape, const std::vector<T>& v) {
    std::vector<uint8_t> b(v.size() * sizeof(T));
    if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
    add(name, dtype, std::move(shape), std::move(b));
  }
  void set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }
  size_t pending_bytes() const;
  // Writes atomically (temp file + rename). Throws LoadError on I/O failure.
  void write(const std::string& path) const;
  std::vector<std::string> names() const;

 private:
  struct Entry { std::string name; DType dtype; std::vector<int64_t> shape; std::vector<uint8_t> bytes; };
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace di
