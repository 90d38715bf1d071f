#include "io/shard_writer.h"

#include "io/file_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include <nlohmann/json.hpp>

namespace di {

namespace {

using json = nlohmann::json;

[[noreturn]] void fail(const std::string& msg) { throw LoadError(msg); }
std::string errno_text() { return std::strerror(errno); }

bool pwrite_all(int fd, const uint8_t* p, uint64_t n, uint64_t off) {
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, n, off_t(off));
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += w;
    n -= uint64_t(w);
    off += uint64_t(w);
  }
  return true;
}

}  // namespace

uint64_t TensorEntry::nbytes() const {
  uint64_t n = dtype_size(dtype);
  for (int64_t d : shape) {
    if (d < 0 || (d != 0 && n > UINT64_MAX / uint64_t(d)))
      fail("tensor " + name + " has invalid shape " + shape_str(shape));
    n *= uint64_t(d);
  }
  return n;
}

std::vector<uint64_t> safetensors_data_offsets(const std::vector<TensorEntry>& entries) {
  // Wider elements first (stable within a width): with the 8-byte aligned buffer start, every
  // tensor lands at an offset that is a multiple of its element size, as loaders read them typed.
  std::vector<size_t> order(entries.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return dtype_size(entries[a].dtype) > dtype_size(entries[b].dtype);
  });
  std::vector<uint64_t> offsets(entries.size());
  uint64_t off = 0;
  for (size_t i : order) {
    offsets[i] = off;
    off += entries[i].nbytes();
  }
  return offsets;
}

std::string safetensors_header(const std::vector<TensorEntry>& entries,
                               const std::map<std::string, std::string>& metadata) {
  json h = json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  const std::vector<uint64_t> offsets = safetensors_data_offsets(entries);
  for (size_t i = 0; i < entries.size(); ++i) {
    const TensorEntry& e = entries[i];
    if (e.name.empty() || e.name == "__metadata__") fail("safetensors: invalid tensor name \"" + e.name + "\"");
    if (h.contains(e.name)) fail("safetensors: tensor " + e.name + " listed twice");
    h[e.name] = {{"dtype", dtype_name(e.dtype)}, {"shape", e.shape}, {"data_offsets", {offsets[i], offsets[i] + e.nbytes()}}};
  }
  std::string text = h.dump();
  // Trailing spaces are allowed; they keep the data buffer 8-byte aligned in the file.
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char(uint8_t(uint64_t(text.size()) >> (8 * i)));
  return out + text;
}

// ---------------------------------------------------------------------------------------------

StreamingSafetensorsFile::StreamingSafetensorsFile(std::string path, std::vector<TensorEntry> entries,
                                                   std::map<std::string, std::string> metadata)
    : path_(std::move(path)), entries_(std::move(entries)) {
  const std::string header = safetensors_header(entries_, metadata);
  data_start_ = header.size();
  offsets_ = safetensors_data_offsets(entries_);
  for (const auto& e : entries_) data_bytes_ += e.nbytes();
  written_ = std::make_unique<std::atomic<uint64_t>[]>(entries_.size());
  for (size_t i = 0; i < entries_.size(); ++i) written_[i] = 0;

  tmp_ = path_ + ".tmp." + std::to_string(::getpid());
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail(path_ + ": cannot create " + tmp_ + ": " + errno_text());
  if (!pwrite_all(fd_, reinterpret_cast<const uint8_t*>(header.data()), header.size(), 0) ||
      ::ftruncate(fd_, off_t(file_size())) != 0) {
    const std::string e = errno_text();
    ::close(fd_);
    fd_ = -1;
    std::remove(tmp_.c_str());
    fail(path_ + ": cannot write header to " + tmp_ + ": " + e);
  }
}

StreamingSafetensorsFile::~StreamingSafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!finished_) std::remove(tmp_.c_str());
}

void StreamingSafetensorsFile::write(size_t index, uint64_t offset, const void* data, uint64_t n) {
  if (finished_) fail(path_ + ": write after finish()");
  if (index >= entries_.size()) fail(path_ + ": tensor index " + std::to_string(index) + " out of range");
  const TensorEntry& e = entries_[index];
  const uint64_t size = e.nbytes();
  if (offset > size || n > size - offset)
    fail(path_ + ": tensor " + e.name + ": write of " + std::to_string(n) + " bytes at offset " + std::to_string(offset) +
         " exceeds its " + std::to_string(size) + " bytes");
  if (!pwrite_all(fd_, static_cast<const uint8_t*>(data), n, data_start_ + offsets_[index] + offset))
    fail(path_ + ": write of tensor " + e.name + " failed: " + errno_text());
  written_[index] += n;
}

void StreamingSafetensorsFile::finish() {
  if (finished_) return;
  for (size_t i = 0; i < entries_.size(); ++i)
    if (written_[i] != entries_[i].nbytes())
      fail(path_ + ": tensor " + entries_[i].name + " got " + std::to_string(written_[i].load()) + " of its " +
           std::to_string(entries_[i].nbytes()) + " bytes");
  const bool synced = ::fsync(fd_) == 0;
  const std::string serr = synced ? "" : errno_text();
  const bool closed = ::close(fd_) == 0;
  fd_ = -1;
  if (!synced || !closed) fail(path_ + ": write failed: " + (synced ? errno_text() : serr));
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0) fail(path_ + ": cannot rename " + tmp_ + " into place: " + errno_text());
  finished_ = true;
}

// ---------------------------------------------------------------------------------------------

ShardedCheckpointWriter::ShardedCheckpointWriter(const std::string& dir, const std::vector<TensorEntry>& entries,
                                                 uint64_t shard_bytes,
                                                 const std::map<std::string, std::string>& metadata)
    : dir_(dir) {
  namespace fs = std::filesystem;
  std::vector<std::vector<TensorEntry>> groups(1);
  uint64_t in_group = 0;
  for (const auto& e : entries) {
    const uint64_t n = e.nbytes();
    if (shard_bytes > 0 && !groups.back().empty() && in_group + n > shard_bytes) {
      groups.emplace_back();
      in_group = 0;
    }
    where_.push_back({groups.size() - 1, groups.back().size()});
    groups.back().push_back(e);
    in_group += n;
    total_tensor_bytes_ += n;
  }
  const size_t n_shards = groups.size();
  auto shard_name = [&](size_t k) {
    if (n_shards == 1) return std::string("model.safetensors");
    char buf[64];
    std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", k + 1, n_shards);
    return std::string(buf);
  };
  for (size_t k = 0; k < n_shards; ++k)
    shards_.push_back(std::make_unique<StreamingSafetensorsFile>((fs::path(dir) / shard_name(k)).string(),
                                                                 std::move(groups[k]), metadata));
  if (n_shards > 1) index_path_ = (fs::path(dir) / "model.safetensors.index.json").string();
}

void ShardedCheckpointWriter::write(size_t index, uint64_t offset, const void* data, uint64_t n) {
  if (index >= where_.size()) fail(dir_ + ": tensor index " + std::to_string(index) + " out of range");
  const auto [shard, local] = where_[index];
  shards_[shard]->write(local, offset, data, n);
}

void ShardedCheckpointWriter::finish() {
  for (auto& s : shards_) s->finish();
  if (index_path_.empty()) return;
  json wm = json::object();
  for (const auto& s : shards_) {
    const std::string file = std::filesystem::path(s->path()).filename().string();
    for (const auto& e : s->entries()) wm[e.name] = file;
  }
  const json idx = {{"metadata", {{"total_size", total_tensor_bytes_}}}, {"weight_map", wm}};
  const std::string text = idx.dump(2) + "\n";
  write_file_atomic(index_path_, [&](std::FILE* f) { return std::fwrite(text.data(), 1, text.size(), f) == text.size(); });
}

std::vector<std::string> ShardedCheckpointWriter::files() const {
  std::vector<std::string> out;
  for (const auto& s : shards_) out.push_back(s->path());
  if (!index_path_.empty()) out.push_back(index_path_);
  return out;
}

uint64_t ShardedCheckpointWriter::total_file_bytes() const {
  uint64_t n = 0;
  for (const auto& s : shards_) n += s->file_size();
  return n;
}

}  // namespace di
