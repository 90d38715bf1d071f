#include "io/safetensors.h"

#include "io/file_util.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <new>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

namespace di {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

struct DTypeInfo { DType t; const char* name; size_t size; };
constexpr DTypeInfo kDTypes[] = {
    {DType::BF16, "BF16", 2},   {DType::F16, "F16", 2},        {DType::F32, "F32", 4},
    {DType::F64, "F64", 8},     {DType::I8, "I8", 1},          {DType::U8, "U8", 1},
    {DType::I16, "I16", 2},     {DType::I32, "I32", 4},        {DType::I64, "I64", 8},
    {DType::BOOL, "BOOL", 1},   {DType::F8_E4M3, "F8_E4M3", 1}, {DType::F8_E8M0, "F8_E8M0", 1},
};

// A header larger than this is not a real checkpoint (the 96k-tensor release shards are ~100 KB
// each); refusing it keeps a corrupt length field from triggering a huge allocation.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

[[noreturn]] void fail(const std::string& msg) { throw LoadError(msg); }

std::string errno_text() { return std::strerror(errno); }

// Parses JSON, rejecting duplicate keys at any depth (nlohmann would silently keep the last one,
// so a header listing a tensor twice would load whichever came last).
json parse_json_strict(const std::string& text, const std::string& what) {
  std::vector<std::set<std::string>> keys_by_depth;
  std::string dup;
  auto cb = [&](int depth, json::parse_event_t ev, json& parsed) {
    if (ev == json::parse_event_t::object_start) {
      if (keys_by_depth.size() <= size_t(depth) + 1) keys_by_depth.resize(size_t(depth) + 2);
      keys_by_depth[size_t(depth) + 1].clear();
    } else if (ev == json::parse_event_t::key) {
      auto& set = keys_by_depth.at(size_t(depth));
      std::string k = parsed.get<std::string>();
      if (!set.insert(k).second && dup.empty()) dup = k;
    }
    return true;
  };
  json j;
  try {
    keys_by_depth.resize(2);
    j = json::parse(text, cb);
  } catch (const json::exception& e) {
    fail(what + ": invalid JSON: " + e.what());
  }
  if (!dup.empty()) fail(what + ": invalid JSON: duplicate key \"" + dup + "\"");
  return j;
}

bool checked_mul(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }

}  // namespace

const char* dtype_name(DType t) {
  for (const auto& d : kDTypes) if (d.t == t) return d.name;
  return "?";
}
size_t dtype_size(DType t) {
  for (const auto& d : kDTypes) if (d.t == t) return d.size;
  return 0;
}
bool dtype_from_name(const std::string& s, DType* out) {
  for (const auto& d : kDTypes)
    if (s == d.name) { *out = d.t; return true; }
  return false;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// ---------------------------------------------------------------------------------------------
// MappedFile: one read-only private mapping, parsed and validated header.

class MappedFile {
 public:
  std::string path;
  const uint8_t* base = nullptr;
  size_t size = 0;
  std::map<std::string, TensorView> tensors;
  std::map<std::string, std::string> metadata;

  explicit MappedFile(std::string p) : path(std::move(p)) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail(path + ": cannot open: " + errno_text());
    struct stat st{};
    if (::fstat(fd, &st) != 0) {
      std::string e = errno_text();
      ::close(fd);
      fail(path + ": cannot stat: " + e);
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      fail(path + ": not a regular file");
    }
    size = size_t(st.st_size);
    if (size < 8) {
      ::close(fd);
      fail(path + ": file is " + std::to_string(size) +
           " bytes, shorter than the 8-byte safetensors header length");
    }
    void* m = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    const std::string map_err = m == MAP_FAILED ? errno_text() : "";
    ::close(fd);  // the mapping keeps the file alive
    if (m == MAP_FAILED) fail(path + ": mmap failed: " + map_err);
    base = static_cast<const uint8_t*>(m);
    try {
      parse_header();
    } catch (...) {
      ::munmap(const_cast<uint8_t*>(base), size);
      base = nullptr;
      throw;
    }
  }
  ~MappedFile() {
    if (base) ::munmap(const_cast<uint8_t*>(base), size);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

 private:
  void parse_header() {
    uint64_t n = 0;
    for (int i = 0; i < 8; ++i) n |= uint64_t(base[i]) << (8 * i);  // little-endian on any host
    if (n > kMaxHeaderBytes)
      fail(path + ": header length " + std::to_string(n) + " is implausible (limit " +
           std::to_string(kMaxHeaderBytes) + " bytes); not a safetensors file or corrupt");
    if (n > size - 8)
      fail(path + ": header length " + std::to_string(n) + " runs past the end of the file (" +
           std::to_string(size) + " bytes; truncated?)");
    const std::string text(reinterpret_cast<const char*>(base + 8), size_t(n));
    const json h = parse_json_strict(text, path + ": header");
    if (!h.is_object()) fail(path + ": header is a JSON " + json_type_name(h) + ", expected an object");

    const size_t data_start = 8 + size_t(n);
    const uint64_t buffer_size = size - data_start;
    struct Span { uint64_t begin, end; const std::string* name; };
    std::vector<Span> spans;

    for (auto it = h.begin(); it != h.end(); ++it) {
      const std::string& name = it.key();
      const json& e = it.value();
      if (name == "__metadata__") {
        if (!e.is_object()) fail(path + ": __metadata__ is a " + json_type_name(e) + ", expected an object");
        for (auto m = e.begin(); m != e.end(); ++m) {
          if (!m->is_string())
            fail(path + ": __metadata__." + m.key() + " is a " + json_type_name(*m) + ", expected a string");
          metadata[m.key()] = m->get<std::string>();
        }
        continue;
      }
      const std::string where = path + ": tensor " + name;
      if (name.empty()) fail(path + ": header has a tensor with an empty name");
      if (!e.is_object()) fail(where + ": entry is a " + json_type_name(e) + ", expected an object");
      for (auto f = e.begin(); f != e.end(); ++f)
        if (f.key() != "dtype" && f.key() != "shape" && f.key() != "data_offsets")
          fail(where + ": unknown field \"" + f.key() + "\"");

      TensorView v;
      v.name = name;
      auto dt = e.find("dtype");
      if (dt == e.end()) fail(where + ": missing \"dtype\"");
      if (!dt->is_string()) fail(where + ": dtype is a " + std::string(json_type_name(*dt)) + ", expected a string");
      if (!dtype_from_name(dt->get<std::string>(), &v.dtype))
        fail(where + ": unknown dtype \"" + dt->get<std::string>() + "\"");

      auto sh = e.find("shape");
      if (sh == e.end()) fail(where + ": missing \"shape\"");
      if (!sh->is_array()) fail(where + ": shape is a " + std::string(json_type_name(*sh)) + ", expected an array");
      int64_t numel = 1;
      for (const json& d : *sh) {
        if (!d.is_number_integer())
          fail(where + ": shape entry is a " + std::string(json_type_name(d)) + ", expected an integer");
        if (d.is_number_unsigned() && d.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
          fail(where + ": shape dimension " + d.dump() + " is too large");
        const int64_t dim = d.get<int64_t>();
        if (dim < 0) fail(where + ": shape " + sh->dump() + " has a negative dimension");
        v.shape.push_back(dim);
        if (!checked_mul(numel, dim, &numel)) fail(where + ": shape " + sh->dump() + " overflows int64");
      }
      int64_t expect_bytes = 0;
      if (!checked_mul(numel, int64_t(dtype_size(v.dtype)), &expect_bytes))
        fail(where + ": shape " + sh->dump() + " overflows int64 bytes");

      auto off = e.find("data_offsets");
      if (off == e.end()) fail(where + ": missing \"data_offsets\"");
      if (!off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() || !(*off)[1].is_number_unsigned())
        fail(where + ": data_offsets " + off->dump() + " is not a pair of non-negative integers");
      const uint64_t b = (*off)[0].get<uint64_t>(), en = (*off)[1].get<uint64_t>();
      if (en < b)
        fail(where + ": data_offsets [" + std::to_string(b) + ", " + std::to_string(en) + "] end before begin");
      if (en > buffer_size)
        fail(where + ": data_offsets [" + std::to_string(b) + ", " + std::to_string(en) +
             "] past the end of the data buffer (" + std::to_string(buffer_size) + " bytes; truncated?)");
      if (en - b != uint64_t(expect_bytes))
        fail(where + ": " + dtype_name(v.dtype) + " " + shape_str(v.shape) + " needs " + std::to_string(expect_bytes) +
             " bytes but data_offsets [" + std::to_string(b) + ", " + std::to_string(en) + "] span " +
             std::to_string(en - b));
      v.data = base + data_start + b;
      v.nbytes = size_t(en - b);
      v.file = &path;
      auto [pos, inserted] = tensors.emplace(name, std::move(v));
      spans.push_back({b, en, &pos->first});
    }
    // Overlapping tensors would alias each other's bytes; holes are harmless and allowed.
    std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    for (size_t i = 1; i < spans.size(); ++i) {
      const Span& p = spans[i - 1];
      const Span& c = spans[i];
      if (c.begin < p.end && c.end > c.begin && p.end > p.begin)
        fail(path + ": tensor " + *c.name + " data_offsets [" + std::to_string(c.begin) + ", " +
             std::to_string(c.end) + "] overlap tensor " + *p.name + " [" + std::to_string(p.begin) + ", " +
             std::to_string(p.end) + "]");
    }
    copy_misaligned();
  }

  // Kernels read tensors as typed arrays; the format only aligns the data buffer (and not even
  // that when a writer skips the header padding), so a 2-byte tensor of odd length shifts every
  // later one. Such tensors are copied once into aligned memory instead of being read unaligned.
  void copy_misaligned() {
    for (auto& [name, v] : tensors) {
      const size_t align = std::min<size_t>(dtype_size(v.dtype), 8);
      if (v.nbytes == 0 || reinterpret_cast<uintptr_t>(v.data) % align == 0) continue;
      auto* copy = static_cast<uint8_t*>(::operator new(v.nbytes, std::align_val_t{64}));
      std::memcpy(copy, v.data, v.nbytes);
      aligned_copies.emplace_back(copy);
      v.data = copy;
    }
  }

 public:
  struct AlignedDelete {
    void operator()(uint8_t* p) const { ::operator delete(p, std::align_val_t{64}); }
  };
  std::vector<std::unique_ptr<uint8_t, AlignedDelete>> aligned_copies;  // tensors copied by copy_misaligned
};

// ---------------------------------------------------------------------------------------------
// Checkpoint

Checkpoint::Checkpoint(Checkpoint&&) noexcept = default;
Checkpoint& Checkpoint::operator=(Checkpoint&&) noexcept = default;
Checkpoint::~Checkpoint() = default;

namespace {

std::string read_text_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail(path + ": cannot open: " + errno_text());
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) fail(path + ": read error");
  return ss.str();
}

// A weight_map entry must name a file inside the checkpoint directory. Checked lexically, not by
// resolving symlinks: Hugging Face caches link every shard into a blobs/ folder outside it.
void check_shard_name(const std::string& index_path, const std::string& tensor, const std::string& file) {
  const std::string where = index_path + ": weight_map[\"" + tensor + "\"] = \"" + file + "\"";
  if (file.empty()) fail(where + ": empty file name");
  const fs::path p(file);
  if (p.is_absolute() || p.has_root_name() || p.has_root_directory())
    fail(where + ": absolute path escapes the checkpoint directory");
  for (const auto& part : p)
    if (part == "..") fail(where + ": path escapes the checkpoint directory");
  if (file.find('\0') != std::string::npos) fail(where + ": NUL in file name");
}

}  // namespace

Checkpoint Checkpoint::open(const std::string& path) {
  Checkpoint ck;
  ck.path_ = path;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st)) fail(path + ": no such file or directory");

  if (!fs::is_directory(st)) {
    auto mf = std::make_unique<MappedFile>(path);
    ck.tensors_ = std::move(mf->tensors);
    for (auto& [name, v] : ck.tensors_) v.file = &mf->path;
    ck.metadata_ = mf->metadata;
    ck.files_.push_back(std::move(mf));
    return ck;
  }

  const fs::path dir(path);
  const fs::path index_path = dir / "model.safetensors.index.json";
  if (!fs::exists(index_path)) {
    std::vector<std::string> found;
    for (const auto& de : fs::directory_iterator(dir, ec))
      if (de.path().extension() == ".safetensors" && de.is_regular_file()) found.push_back(de.path().string());
    if (ec) fail(path + ": cannot list directory: " + ec.message());
    if (found.empty())
      fail(path + ": directory has neither model.safetensors.index.json nor a *.safetensors file");
    if (found.size() > 1) {
      std::sort(found.begin(), found.end());
      std::string list;
      for (const auto& f : found) list += " " + fs::path(f).filename().string();
      fail(path + ": directory has " + std::to_string(found.size()) +
           " *.safetensors files but no model.safetensors.index.json to say how they combine:" + list);
    }
    Checkpoint one = open(found[0]);
    one.path_ = path;
    return one;
  }

  // Sharded: the index maps every tensor to its shard; shards must agree with it exactly.
  const std::string ipath = index_path.string();
  const json idx = parse_json_strict(read_text_file(ipath), ipath);
  if (!idx.is_object()) fail(ipath + ": is a JSON " + std::string(json_type_name(idx)) + ", expected an object");
  auto wm = idx.find("weight_map");
  if (wm == idx.end()) fail(ipath + ": missing \"weight_map\"");
  if (!wm->is_object()) fail(ipath + ": weight_map is a " + std::string(json_type_name(*wm)) + ", expected an object");
  if (auto md = idx.find("metadata"); md != idx.end() && !md->is_object())
    fail(ipath + ": metadata is a " + std::string(json_type_name(*md)) + ", expected an object");

  std::map<std::string, std::string> tensor_to_shard;  // tensor -> file name as in the index
  std::vector<std::string> shard_order;                 // first-seen order
  std::set<std::string> shard_set;
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    if (!it->is_string())
      fail(ipath + ": weight_map[\"" + it.key() + "\"] is a " + json_type_name(*it) + ", expected a file name string");
    check_shard_name(ipath, it.key(), it->get<std::string>());
    // "./a" and "a" are one shard.
    const std::string file = fs::path(it->get<std::string>()).lexically_normal().string();
    tensor_to_shard[it.key()] = file;
    if (shard_set.insert(file).second) shard_order.push_back(file);
  }
  if (tensor_to_shard.empty()) fail(ipath + ": weight_map is empty");

  std::map<std::string, const std::string*> owner;  // tensor -> shard path it was found in
  for (const std::string& shard : shard_order) {
    const fs::path sp = dir / shard;
    if (!fs::exists(sp))
      fail(ipath + ": weight_map names shard \"" + shard + "\", which does not exist (" + sp.string() + ")");
    auto mf = std::make_unique<MappedFile>(sp.string());
    for (auto& [name, v] : mf->tensors) {
      if (auto prev = owner.find(name); prev != owner.end())
        fail(mf->path + ": tensor " + name + " is also in " + *prev->second + " (duplicate across shards)");
      owner[name] = &mf->path;
      auto m = tensor_to_shard.find(name);
      if (m == tensor_to_shard.end())
        fail(mf->path + ": tensor " + name + " is not listed in " + ipath + " (extra tensor in shard)");
      if (m->second != shard)
        fail(mf->path + ": tensor " + name + " is in this shard but " + ipath + " maps it to \"" + m->second + "\"");
    }
    if (ck.metadata_.empty()) ck.metadata_ = mf->metadata;
    for (auto& [name, v] : mf->tensors) {
      TensorView tv = v;
      tv.file = &mf->path;
      ck.tensors_.emplace(name, std::move(tv));
    }
    ck.files_.push_back(std::move(mf));
  }
  for (const auto& [name, shard] : tensor_to_shard)
    if (!ck.tensors_.count(name))
      fail(ipath + ": tensor " + name + " is mapped to \"" + shard + "\", but " + (dir / shard).string() +
           " does not hold it");
  return ck;
}

const TensorView* Checkpoint::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

const TensorView& Checkpoint::get(const std::string& name) const {
  if (const TensorView* v = find(name)) return *v;
  fail(path_ + ": tensor " + name + " not found");
}

const TensorView& Checkpoint::expect(const std::string& name, DType dtype, const std::vector<int64_t>& shape) const {
  const TensorView& v = get(name);
  if (v.dtype != dtype)
    fail(*v.file + ": tensor " + name + " has dtype " + dtype_name(v.dtype) + ", expected " + dtype_name(dtype));
  if (v.shape != shape)
    fail(*v.file + ": tensor " + name + " has shape " + shape_str(v.shape) + ", expected " + shape_str(shape));
  return v;
}

size_t Checkpoint::total_bytes() const {
  size_t n = 0;
  for (const auto& f : files_) n += f->size;
  return n;
}

std::vector<std::string> Checkpoint::files() const {
  std::vector<std::string> out;
  for (const auto& f : files_) out.push_back(f->path);
  return out;
}

// ---------------------------------------------------------------------------------------------
// SafetensorsWriter

void SafetensorsWriter::add(const std::string& name, DType dtype, std::vector<int64_t> shape,
                            std::vector<uint8_t> bytes) {
  if (name.empty() || name == "__metadata__") fail("SafetensorsWriter: invalid tensor name \"" + name + "\"");
  for (const auto& e : entries_)
    if (e.name == name) fail("SafetensorsWriter: tensor " + name + " added twice");
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0 || !checked_mul(numel, d, &numel))
      fail("SafetensorsWriter: tensor " + name + " has invalid shape " + shape_str(shape));
  }
  if (uint64_t(numel) * dtype_size(dtype) != bytes.size())
    fail("SafetensorsWriter: tensor " + name + " " + dtype_name(dtype) + " " + shape_str(shape) + " needs " +
         std::to_string(uint64_t(numel) * dtype_size(dtype)) + " bytes, got " + std::to_string(bytes.size()));
  entries_.push_back({name, dtype, std::move(shape), std::move(bytes)});
}

size_t SafetensorsWriter::pending_bytes() const {
  size_t n = 0;
  for (const auto& e : entries_) n += e.bytes.size();
  return n;
}

std::vector<std::string> SafetensorsWriter::names() const {
  std::vector<std::string> out;
  for (const auto& e : entries_) out.push_back(e.name);
  return out;
}

void SafetensorsWriter::write(const std::string& path) const {
  json h = json::object();
  if (!metadata_.empty()) h["__metadata__"] = metadata_;
  // Wider elements first (stable within a width): with the 8-byte aligned buffer start, every
  // tensor lands at an offset that is a multiple of its element size, as loaders read them typed.
  std::vector<const Entry*> order;
  for (const auto& e : entries_) order.push_back(&e);
  std::stable_sort(order.begin(), order.end(),
                   [](const Entry* a, const Entry* b) { return dtype_size(a->dtype) > dtype_size(b->dtype); });
  uint64_t off = 0;
  for (const Entry* e : order) {
    h[e->name] = {{"dtype", dtype_name(e->dtype)}, {"shape", e->shape}, {"data_offsets", {off, off + e->bytes.size()}}};
    off += e->bytes.size();
  }
  std::string header = h.dump();
  // The format allows trailing spaces; padding keeps the data buffer 8-byte aligned in the file.
  header.append((8 - header.size() % 8) % 8, ' ');

  write_file_atomic(path, [&](std::FILE* f) {
    uint8_t len[8];
    for (int i = 0; i < 8; ++i) len[i] = uint8_t(uint64_t(header.size()) >> (8 * i));
    bool ok = std::fwrite(len, 1, 8, f) == 8;
    ok = ok && std::fwrite(header.data(), 1, header.size(), f) == header.size();
    for (const Entry* e : order)
      if (ok && !e->bytes.empty()) ok = std::fwrite(e->bytes.data(), 1, e->bytes.size(), f) == e->bytes.size();
    return ok;
  });
}

}  // namespace di
