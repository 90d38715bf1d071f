// The checkpoint loader (src/io/safetensors.cpp) on untrusted files. Modes: the bytes as a whole
// .safetensors file; the bytes as the JSON header of a file (length prefix and data section added,
// so the fuzzer works on the header's meaning); the bytes as model.safetensors.index.json next to
// two valid shards. Properties: every bad file is a LoadError (never a crash or another exception);
// an accepted checkpoint has tensors whose byte sizes match dtype x shape and lie inside the file
// (reading every byte is safe), and writing it back with SafetensorsWriter and reopening gives the
// same names, dtypes, shapes, bytes and metadata.
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "fuzz_util.h"
#include "io/safetensors.h"

using namespace di;
namespace fs = std::filesystem;

namespace {

const fs::path& scratch() {
  static const fs::path dir = [] {
    fs::path d = fs::temp_directory_path() / ("di-fuzz-safetensors-" + std::to_string(::getpid()));
    fs::create_directories(d / "sharded");
    // Two valid shards for the index mode.
    SafetensorsWriter a, b;
    a.add_typed<float>("x.weight", DType::F32, {2, 2}, {1, 2, 3, 4});
    a.set_metadata("format", "pt");
    b.add_typed<uint16_t>("y.weight", DType::BF16, {3}, {1, 2, 3});
    b.add_typed<int32_t>("z.bias", DType::I32, {1}, {7});
    a.write((d / "sharded" / "a.safetensors").string());
    b.write((d / "sharded" / "b.safetensors").string());
    return d;
  }();
  return dir;
}

void write_file(const fs::path& p, std::string_view bytes) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
}

void check_loaded(const Checkpoint& ck, uint64_t file_bytes) {
  uint64_t total = 0;
  for (const auto& [name, t] : ck.tensors()) {
    FUZZ_CHECK(name == t.name, name);
    int64_t numel = 1;
    for (int64_t d : t.shape) {
      FUZZ_CHECK(d >= 0, name + " has a negative dimension");
      numel *= d;
    }
    FUZZ_CHECK(t.numel() == numel, name);
    FUZZ_CHECK(t.nbytes == size_t(numel) * dtype_size(t.dtype), name + " byte size does not match dtype x shape");
    FUZZ_CHECK(t.nbytes == 0 || t.data != nullptr, name);
    total += t.nbytes;
    volatile uint8_t sink = 0;  // touches every byte: a view outside the mapping faults here
    for (size_t i = 0; i < t.nbytes; ++i) sink = sink ^ t.data[i];
    (void)sink;
  }
  FUZZ_CHECK(total <= file_bytes, "tensors cover " + std::to_string(total) + " bytes of a " + std::to_string(file_bytes) + "-byte checkpoint");
}

void round_trip(const Checkpoint& ck) {
  SafetensorsWriter w;
  for (const auto& [name, t] : ck.tensors()) w.add(name, t.dtype, t.shape, std::vector<uint8_t>(t.data, t.data + t.nbytes));
  for (const auto& [k, v] : ck.metadata()) w.set_metadata(k, v);
  const fs::path p = scratch() / "roundtrip.safetensors";
  w.write(p.string());
  const Checkpoint back = Checkpoint::open(p.string());
  FUZZ_CHECK(back.tensors().size() == ck.tensors().size(), "tensor count changed");
  FUZZ_CHECK(back.metadata() == ck.metadata(), "metadata changed");
  for (const auto& [name, t] : ck.tensors()) {
    const TensorView* u = back.find(name);
    FUZZ_CHECK(u != nullptr, name + " lost");
    FUZZ_CHECK(u->dtype == t.dtype && u->shape == t.shape && u->nbytes == t.nbytes, name + " changed");
    FUZZ_CHECK(t.nbytes == 0 || std::memcmp(u->data, t.data, t.nbytes) == 0, name + " bytes changed");
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)scratch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Bytes in(data, size);
  const uint8_t mode = in.byte();
  const uint8_t extra = in.byte();
  const std::string_view payload = in.rest();
  std::string path;
  uint64_t file_bytes = 0;
  switch (mode % 3) {
    case 0: {  // whole file
      path = (scratch() / "input.safetensors").string();
      write_file(path, payload);
      file_bytes = payload.size();
      break;
    }
    case 1: {  // header JSON: little-endian length, header, then `extra` * 4 data bytes
      std::string file(8, '\0');
      const uint64_t n = payload.size();
      for (int i = 0; i < 8; ++i) file[size_t(i)] = char((n >> (8 * i)) & 0xff);
      file += payload;
      for (int i = 0; i < int(extra) * 4; ++i) file += char(i * 37 + 11);
      path = (scratch() / "header.safetensors").string();
      write_file(path, file);
      file_bytes = file.size();
      break;
    }
    default: {  // sharded: the payload is the index
      path = (scratch() / "sharded").string();
      write_file(scratch() / "sharded" / "model.safetensors.index.json", payload);
      file_bytes = fs::file_size(scratch() / "sharded" / "a.safetensors") + fs::file_size(scratch() / "sharded" / "b.safetensors");
      break;
    }
  }
  try {
    const Checkpoint ck = Checkpoint::open(path);
    check_loaded(ck, file_bytes);
    round_trip(ck);
  } catch (const LoadError&) {
    // rejected with a message: the expected outcome for most inputs
  } catch (const std::exception& e) {
    FUZZ_CHECK(false, std::string("not a LoadError: ") + e.what() + "\n  input: " + fuzz::show(payload));
  }
  return 0;
}
