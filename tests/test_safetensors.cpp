// Safetensors loader and writer: round trips, single and sharded checkpoints, the golden
// checkpoint, and every corrupt-file case giving a LoadError that names the file and tensor.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "io/safetensors.h"

namespace fs = std::filesystem;
using namespace di;

namespace {

const std::string kGoldenDir = std::string(DI_SOURCE_DIR) + "/tests/data/golden/v41-tiny/model";

struct TempDir {
  fs::path path;
  TempDir() {
    static int counter = 0;
    path = fs::temp_directory_path() /
           ("di_st_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), std::streamsize(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[size_t(i)] = char(uint8_t(n >> (8 * i)));
  return s;
}

// A raw safetensors file: length prefix (the header's own size unless overridden), header, data.
void write_raw(const std::string& path, const std::string& header, size_t data_bytes,
               std::optional<uint64_t> length_override = std::nullopt) {
  const uint64_t n = length_override.value_or(header.size());
  write_bytes(path, le64(n) + header + std::string(data_bytes, '\x5a'));
}

std::string load_error(const std::string& path) {
  try {
    Checkpoint ck = Checkpoint::open(path);
  } catch (const LoadError& e) {
    return e.what();
  }
  return "<no error>";
}

// The error must name every given fragment (file name, tensor, what is wrong).
void expect_error(const std::string& path, std::initializer_list<std::string> fragments) {
  const std::string msg = load_error(path);
  ASSERT_NE(msg, "<no error>") << "loading " << path << " should fail";
  for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "'" << f << "' not in: " << msg;
}

std::vector<uint8_t> iota_bytes(size_t n, uint8_t start) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = uint8_t(start + i * 7);
  return v;
}

void write_two_tensor_file(const std::string& path, const std::string& a, const std::string& b) {
  SafetensorsWriter w;
  w.add(a, DType::F32, {2, 2}, iota_bytes(16, 1));
  w.add(b, DType::BF16, {3}, iota_bytes(6, 2));
  w.write(path);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Dtypes

TEST(Safetensors, DtypeNamesAndSizes) {
  const std::pair<const char*, size_t> all[] = {{"BF16", 2}, {"F16", 2},  {"F32", 4},     {"F64", 8},
                                                {"I8", 1},   {"U8", 1},   {"I16", 2},     {"I32", 4},
                                                {"I64", 8},  {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E8M0", 1}};
  for (const auto& [name, size] : all) {
    DType t{};
    ASSERT_TRUE(dtype_from_name(name, &t)) << name;
    EXPECT_STREQ(dtype_name(t), name);
    EXPECT_EQ(dtype_size(t), size) << name;
  }
  DType t{};
  EXPECT_FALSE(dtype_from_name("F8_E5M2", &t));
  EXPECT_FALSE(dtype_from_name("bf16", &t));
  EXPECT_EQ(shape_str({2, 3}), "[2, 3]");
  EXPECT_EQ(shape_str({}), "[]");
}

// ---------------------------------------------------------------------------------------------
// Writer round trip

TEST(Safetensors, WriterRoundTrip) {
  TempDir d;
  const std::string path = d.file("rt.safetensors");
  SafetensorsWriter w;
  const std::vector<float> f32 = {1.5f, -2.f, 3.25f, 0.f, 1e-20f, -7.f};
  w.add_typed("b.f32", DType::F32, {2, 3}, f32);
  w.add("a.e4m3", DType::F8_E4M3, {5}, iota_bytes(5, 3));  // odd size: next tensor unaligned
  w.add("c.bf16", DType::BF16, {1, 3}, iota_bytes(6, 9));
  w.add("d.empty", DType::I64, {0, 4}, {});
  w.add("e.scalar", DType::I32, {}, iota_bytes(4, 11));
  const std::vector<int64_t> i64 = {-1, 1ll << 40};
  w.add_typed("f.i64", DType::I64, {2}, i64);
  w.set_metadata("format", "pt");
  w.set_metadata("note", "round trip");
  EXPECT_EQ(w.pending_bytes(), 24u + 5 + 6 + 0 + 4 + 16);
  EXPECT_EQ(w.names(), (std::vector<std::string>{"b.f32", "a.e4m3", "c.bf16", "d.empty", "e.scalar", "f.i64"}));
  w.write(path);

  // No temp file is left behind, and the data buffer starts 8-byte aligned (header padded).
  for (const auto& e : fs::directory_iterator(d.path))
    EXPECT_EQ(e.path().filename(), "rt.safetensors");
  std::ifstream f(path, std::ios::binary);
  std::string raw((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(raw[size_t(i)])) << (8 * i);
  EXPECT_EQ((8 + n) % 8, 0u);
  EXPECT_EQ(raw.size(), 8 + n + w.pending_bytes());
  const std::string header = raw.substr(8, n);
  EXPECT_EQ(header.front(), '{');
  EXPECT_EQ(header.find_last_not_of(' '), header.rfind('}'));  // only spaces after the JSON

  Checkpoint ck = Checkpoint::open(path);
  ASSERT_EQ(ck.tensors().size(), 6u);
  EXPECT_EQ(ck.metadata().at("format"), "pt");
  EXPECT_EQ(ck.metadata().at("note"), "round trip");
  EXPECT_EQ(ck.total_bytes(), raw.size());
  EXPECT_EQ(ck.files(), std::vector<std::string>{path});

  const TensorView& b = ck.expect("b.f32", DType::F32, {2, 3});
  EXPECT_EQ(b.numel(), 6);
  EXPECT_EQ(b.nbytes, 24u);
  EXPECT_EQ(*b.file, path);
  for (size_t i = 0; i < f32.size(); ++i) {
    float x;
    std::memcpy(&x, b.data + 4 * i, 4);
    EXPECT_EQ(x, f32[i]);
  }
  const TensorView& a = ck.expect("a.e4m3", DType::F8_E4M3, {5});
  EXPECT_EQ(std::vector<uint8_t>(a.data, a.data + a.nbytes), iota_bytes(5, 3));
  const TensorView& c = ck.expect("c.bf16", DType::BF16, {1, 3});
  EXPECT_EQ(std::vector<uint8_t>(c.data, c.data + c.nbytes), iota_bytes(6, 9));
  const TensorView& e = ck.expect("d.empty", DType::I64, {0, 4});
  EXPECT_EQ(e.nbytes, 0u);
  EXPECT_EQ(e.numel(), 0);
  EXPECT_EQ(ck.expect("e.scalar", DType::I32, {}).numel(), 1);
  const TensorView& g = ck.expect("f.i64", DType::I64, {2});
  int64_t v1;
  std::memcpy(&v1, g.data + 8, 8);
  EXPECT_EQ(v1, 1ll << 40);

  // Zero copy: views point into one mapping, widest elements first (insertion order within a
  // width), so every tensor is aligned to its element size although a.e4m3 has an odd size.
  const TensorView& sc = ck.get("e.scalar");
  EXPECT_EQ(b.data - g.data, 16);
  EXPECT_EQ(sc.data - b.data, 24);
  EXPECT_EQ(c.data - sc.data, 4);
  EXPECT_EQ(a.data - c.data, 6);
  for (const auto& [name, t] : ck.tensors())
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data) % dtype_size(t.dtype), 0u) << name;
}

// A third-party file may place a tensor at an offset its element size does not divide; the
// loader hands out an aligned copy with the same bytes, and leaves aligned tensors in place.
TEST(Safetensors, MisalignedTensorsAreCopiedAligned) {
  TempDir d;
  const std::string path = d.file("odd.safetensors");
  std::string header = R"({"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},)"
                       R"("b":{"dtype":"BF16","shape":[2],"data_offsets":[3,7]},)"
                       R"("c":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string data;
  for (int i = 0; i < 12; ++i) data.push_back(char(i + 1));
  write_bytes(path, le64(header.size()) + header + data);
  Checkpoint ck = Checkpoint::open(path);
  const TensorView& a = ck.get("a");
  const TensorView& b = ck.get("b");
  const TensorView& c = ck.get("c");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data) % 2, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(c.data) % 4, 0u);
  EXPECT_EQ(std::vector<uint8_t>(b.data, b.data + 4), (std::vector<uint8_t>{4, 5, 6, 7}));
  EXPECT_EQ(std::vector<uint8_t>(c.data, c.data + 4), (std::vector<uint8_t>{9, 10, 11, 12}));
  EXPECT_NE(b.data - a.data, 3);  // b was copied out of the mapping
  EXPECT_EQ(c.data - a.data, 8);  // c was aligned in the file and stays a view
}

TEST(Safetensors, WriterOverwritesAtomicallyAndRejectsBadInput) {
  TempDir d;
  const std::string path = d.file("x.safetensors");
  write_two_tensor_file(path, "old.a", "old.b");
  write_two_tensor_file(path, "new.a", "new.b");
  Checkpoint ck = Checkpoint::open(path);
  EXPECT_TRUE(ck.find("new.a"));
  EXPECT_FALSE(ck.find("old.a"));

  SafetensorsWriter w;
  EXPECT_THROW(w.add("t", DType::F32, {3}, iota_bytes(8, 0)), LoadError);  // 12 bytes needed
  EXPECT_THROW(w.add("t", DType::F32, {-1}, {}), LoadError);
  EXPECT_THROW(w.add("", DType::U8, {1}, {1}), LoadError);
  EXPECT_THROW(w.add("__metadata__", DType::U8, {1}, {1}), LoadError);
  w.add("t", DType::U8, {1}, {1});
  EXPECT_THROW(w.add("t", DType::U8, {1}, {1}), LoadError);
  try {
    w.write(d.file("no_such_dir/y.safetensors"));
    ADD_FAILURE() << "write into a missing directory should fail";
  } catch (const LoadError& e) {
    EXPECT_NE(std::string(e.what()).find("y.safetensors"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, LookupErrorsNameTensorAndFile) {
  TempDir d;
  const std::string path = d.file("one.safetensors");
  write_two_tensor_file(path, "w.a", "w.b");
  Checkpoint ck = Checkpoint::open(path);
  EXPECT_EQ(ck.find("nope"), nullptr);
  try {
    ck.get("nope");
    ADD_FAILURE();
  } catch (const LoadError& e) {
    EXPECT_NE(std::string(e.what()).find("nope"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos);
  }
  try {
    ck.expect("w.a", DType::BF16, {2, 2});
    ADD_FAILURE();
  } catch (const LoadError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("w.a"), std::string::npos) << m;
    EXPECT_NE(m.find("dtype F32, expected BF16"), std::string::npos) << m;
    EXPECT_NE(m.find("one.safetensors"), std::string::npos) << m;
  }
  try {
    ck.expect("w.a", DType::F32, {4});
    ADD_FAILURE();
  } catch (const LoadError& e) {
    EXPECT_NE(std::string(e.what()).find("shape [2, 2], expected [4]"), std::string::npos) << e.what();
  }
  // A move keeps views valid (they point into the mapping, not into the Checkpoint object).
  Checkpoint moved = std::move(ck);
  EXPECT_EQ(*moved.get("w.b").file, path);
  EXPECT_EQ(moved.get("w.b").data[0], iota_bytes(6, 2)[0]);
}

// ---------------------------------------------------------------------------------------------
// Directories and shards

TEST(Safetensors, DirectoryWithOneFile) {
  TempDir d;
  write_two_tensor_file(d.file("weights.safetensors"), "x", "y");
  write_bytes(d.file("README.txt"), "not a checkpoint");
  Checkpoint ck = Checkpoint::open(d.path.string());
  EXPECT_EQ(ck.path(), d.path.string());
  EXPECT_EQ(ck.tensors().size(), 2u);
  EXPECT_EQ(*ck.get("x").file, d.file("weights.safetensors"));
}

TEST(Safetensors, DirectoryWithoutCheckpoint) {
  TempDir d;
  expect_error(d.path.string(), {d.path.string(), "neither model.safetensors.index.json nor"});
  write_two_tensor_file(d.file("a.safetensors"), "x", "y");
  write_two_tensor_file(d.file("b.safetensors"), "z", "w");
  expect_error(d.path.string(), {d.path.string(), "2 *.safetensors files", "a.safetensors", "b.safetensors"});
  expect_error(d.file("missing.safetensors"), {"missing.safetensors", "no such file"});
}

namespace {
// Two shards plus an index listing all four tensors; `extra` entries are added to weight_map.
void make_sharded(const TempDir& d, const std::string& weight_map_json) {
  write_two_tensor_file(d.file("model-00001-of-00002.safetensors"), "layers.0.a", "layers.0.b");
  write_two_tensor_file(d.file("model-00002-of-00002.safetensors"), "layers.1.a", "layers.1.b");
  write_bytes(d.file("model.safetensors.index.json"),
              R"({"metadata": {"total_size": 44}, "weight_map": )" + weight_map_json + "}");
}
const std::string kGoodMap = R"({"layers.0.a": "model-00001-of-00002.safetensors",
  "layers.0.b": "model-00001-of-00002.safetensors", "layers.1.a": "model-00002-of-00002.safetensors",
  "layers.1.b": "model-00002-of-00002.safetensors"})";
}  // namespace

TEST(Safetensors, ShardedLoads) {
  TempDir d;
  make_sharded(d, kGoodMap);
  // A stray shard the index does not name is ignored.
  write_two_tensor_file(d.file("unrelated.safetensors"), "junk.a", "junk.b");
  Checkpoint ck = Checkpoint::open(d.path.string());
  ASSERT_EQ(ck.tensors().size(), 4u);
  EXPECT_EQ(*ck.get("layers.0.b").file, d.file("model-00001-of-00002.safetensors"));
  EXPECT_EQ(*ck.get("layers.1.a").file, d.file("model-00002-of-00002.safetensors"));
  EXPECT_EQ(ck.files().size(), 2u);
  EXPECT_EQ(std::vector<uint8_t>(ck.get("layers.1.b").data, ck.get("layers.1.b").data + 6), iota_bytes(6, 2));
  EXPECT_EQ(ck.total_bytes(), fs::file_size(d.file("model-00001-of-00002.safetensors")) +
                                  fs::file_size(d.file("model-00002-of-00002.safetensors")));
}

TEST(Safetensors, ShardSubdirectoryAllowed) {
  TempDir d;
  fs::create_directories(d.path / "shards");
  write_two_tensor_file(d.file("shards/s.safetensors"), "p", "q");
  write_bytes(d.file("model.safetensors.index.json"),
              R"({"weight_map": {"p": "shards/s.safetensors", "q": "./shards/s.safetensors"}})");
  // Two spellings of one file are the same shard.
  EXPECT_EQ(Checkpoint::open(d.path.string()).tensors().size(), 2u);
  write_bytes(d.file("model.safetensors.index.json"),
              R"({"weight_map": {"p": "shards/s.safetensors", "q": "shards/s.safetensors"}})");
  EXPECT_EQ(Checkpoint::open(d.path.string()).tensors().size(), 2u);
}

TEST(Safetensors, IndexErrors) {
  TempDir d;
  const std::string idx = "model.safetensors.index.json";
  make_sharded(d, "[1, 2]");
  expect_error(d.path.string(), {idx, "weight_map is a array"});
  write_bytes(d.file(idx), "{\"weight_map\": {\"a\": ");
  expect_error(d.path.string(), {idx, "invalid JSON"});
  write_bytes(d.file(idx), "[]");
  expect_error(d.path.string(), {idx, "expected an object"});
  write_bytes(d.file(idx), R"({"metadata": {}})");
  expect_error(d.path.string(), {idx, "missing \"weight_map\""});
  write_bytes(d.file(idx), R"({"weight_map": {}})");
  expect_error(d.path.string(), {idx, "weight_map is empty"});
  write_bytes(d.file(idx), R"({"weight_map": {"layers.0.a": 7}})");
  expect_error(d.path.string(), {idx, "layers.0.a", "expected a file name string"});
  write_bytes(d.file(idx), R"({"metadata": "x", "weight_map": {"layers.0.a": "m.safetensors"}})");
  expect_error(d.path.string(), {idx, "metadata is a string"});
  // Duplicate key in the index (a JSON parser would silently keep the last).
  write_bytes(d.file(idx), R"({"weight_map": {"layers.0.a": "a", "layers.0.a": "b"}})");
  expect_error(d.path.string(), {idx, "duplicate key \"layers.0.a\""});
}

TEST(Safetensors, IndexNamesMissingShard) {
  TempDir d;
  make_sharded(d, R"({"layers.0.a": "model-00001-of-00002.safetensors",
    "layers.0.b": "model-00001-of-00002.safetensors", "layers.1.a": "model-00003-of-00002.safetensors"})");
  expect_error(d.path.string(), {"model.safetensors.index.json", "model-00003-of-00002.safetensors", "does not exist"});
}

TEST(Safetensors, IndexNamesTensorTheShardLacks) {
  TempDir d;
  std::string map = kGoodMap;
  map.insert(map.size() - 1, R"(, "layers.1.c": "model-00002-of-00002.safetensors")");
  make_sharded(d, map);
  expect_error(d.path.string(), {"layers.1.c", "model-00002-of-00002.safetensors", "does not hold it"});
}

TEST(Safetensors, ShardHoldsTensorMissingFromIndex) {
  TempDir d;
  make_sharded(d, R"({"layers.0.a": "model-00001-of-00002.safetensors",
    "layers.1.a": "model-00002-of-00002.safetensors", "layers.1.b": "model-00002-of-00002.safetensors"})");
  expect_error(d.path.string(), {"model-00001-of-00002.safetensors", "layers.0.b", "not listed", "extra"});
}

TEST(Safetensors, TensorInWrongShard) {
  TempDir d;
  make_sharded(d, R"({"layers.0.a": "model-00001-of-00002.safetensors",
    "layers.0.b": "model-00002-of-00002.safetensors", "layers.1.a": "model-00002-of-00002.safetensors",
    "layers.1.b": "model-00002-of-00002.safetensors"})");
  expect_error(d.path.string(), {"model-00001-of-00002.safetensors", "layers.0.b", "maps it to"});
}

TEST(Safetensors, DuplicateTensorAcrossShards) {
  TempDir d;
  make_sharded(d, kGoodMap);
  // Shard 2 also holds layers.0.a.
  write_two_tensor_file(d.file("model-00002-of-00002.safetensors"), "layers.0.a", "layers.1.b");
  expect_error(d.path.string(), {"layers.0.a", "model-00001-of-00002.safetensors",
                                 "model-00002-of-00002.safetensors", "duplicate"});
}

TEST(Safetensors, ShardPathsMayNotEscapeTheDirectory) {
  TempDir d;
  fs::create_directories(d.path / "ckpt");
  write_two_tensor_file(d.file("outside.safetensors"), "t.a", "t.b");
  const std::string dir = (d.path / "ckpt").string();
  const std::string idx = dir + "/model.safetensors.index.json";
  const std::vector<std::string> bads = {"../outside.safetensors", "sub/../../outside.safetensors",
                                         d.file("outside.safetensors"), ""};
  for (const std::string& bad : bads) {
    write_bytes(idx, R"({"weight_map": {"t.a": ")" + bad + R"(", "t.b": ")" + bad + R"("}})");
    const std::string msg = load_error(dir);
    EXPECT_NE(msg.find("model.safetensors.index.json"), std::string::npos) << bad << ": " << msg;
    EXPECT_NE(msg.find("t.a"), std::string::npos) << bad << ": " << msg;
    EXPECT_TRUE(msg.find("escapes the checkpoint directory") != std::string::npos ||
                msg.find("empty file name") != std::string::npos)
        << bad << ": " << msg;
  }
}

// ---------------------------------------------------------------------------------------------
// Corrupt single files

TEST(SafetensorsCorrupt, ShorterThanLengthPrefix) {
  TempDir d;
  for (size_t n : {0, 1, 7}) {
    const std::string p = d.file("short" + std::to_string(n) + ".safetensors");
    write_bytes(p, std::string(n, '\0'));
    expect_error(p, {"short" + std::to_string(n) + ".safetensors", std::to_string(n) + " bytes, shorter than"});
  }
}

TEST(SafetensorsCorrupt, HeaderLengthPastEnd) {
  TempDir d;
  const std::string p = d.file("trunc.safetensors");
  write_raw(p, R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1, 1000);
  expect_error(p, {"trunc.safetensors", "header length 1000 runs past the end"});
  // Truncated exactly inside the header.
  write_bytes(p, le64(50) + "{\"a\":");
  expect_error(p, {"trunc.safetensors", "runs past the end"});
}

TEST(SafetensorsCorrupt, HeaderLengthAbsurd) {
  TempDir d;
  const std::string p = d.file("huge.safetensors");
  write_raw(p, "{}", 0, uint64_t(1) << 40);
  expect_error(p, {"huge.safetensors", "implausible"});
  write_raw(p, "{}", 0, ~uint64_t(1));  // 0xffff...fe: would overflow 8 + n
  expect_error(p, {"huge.safetensors", "implausible"});
}

TEST(SafetensorsCorrupt, InvalidJsonAndNonObject) {
  TempDir d;
  const std::string p = d.file("bad.safetensors");
  write_raw(p, R"({"a": {"dtype": "U8", )", 0);
  expect_error(p, {"bad.safetensors", "invalid JSON"});
  write_raw(p, std::string("\xff\xfe", 2), 0);
  expect_error(p, {"bad.safetensors", "invalid JSON"});
  write_raw(p, "[1, 2, 3]", 0);
  expect_error(p, {"bad.safetensors", "header is a JSON array, expected an object"});
  write_raw(p, "42", 0);
  expect_error(p, {"bad.safetensors", "expected an object"});
  write_raw(p, R"({"t": {"dtype":"U8","shape":[1],"data_offsets":[0,1]},
                   "t": {"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
            2);
  expect_error(p, {"bad.safetensors", "duplicate key \"t\""});
}

TEST(SafetensorsCorrupt, BadEntries) {
  TempDir d;
  const std::string p = d.file("entries.safetensors");
  struct Case { std::string header; size_t data; std::vector<std::string> want; };
  const std::vector<Case> cases = {
      {R"({"w.q": {"dtype":"F8_E5M2","shape":[1],"data_offsets":[0,1]}})", 1, {"tensor w.q", "unknown dtype \"F8_E5M2\""}},
      {R"({"w.q": {"dtype":5,"shape":[1],"data_offsets":[0,1]}})", 1, {"tensor w.q", "dtype is a integer"}},
      {R"({"w.q": {"shape":[1],"data_offsets":[0,1]}})", 1, {"tensor w.q", "missing \"dtype\""}},
      {R"({"w.q": {"dtype":"U8","data_offsets":[0,1]}})", 1, {"tensor w.q", "missing \"shape\""}},
      {R"({"w.q": {"dtype":"U8","shape":[1]}})", 1, {"tensor w.q", "missing \"data_offsets\""}},
      {R"({"w.q": {"dtype":"U8","shape":[2,-3],"data_offsets":[0,1]}})", 1, {"tensor w.q", "negative dimension"}},
      {R"({"w.q": {"dtype":"U8","shape":[1.5],"data_offsets":[0,1]}})", 1, {"tensor w.q", "expected an integer"}},
      {R"({"w.q": {"dtype":"U8","shape":"[1]","data_offsets":[0,1]}})", 1, {"tensor w.q", "expected an array"}},
      {R"({"w.q": {"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,1]}})", 1, {"tensor w.q", "overflows"}},
      {R"({"w.q": {"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", 20, {"tensor w.q", "needs 24 bytes", "span 20"}},
      {R"({"w.q": {"dtype":"BF16","shape":[4],"data_offsets":[0,9]}})", 9, {"tensor w.q", "needs 8 bytes"}},
      {R"({"w.q": {"dtype":"U8","shape":[4],"data_offsets":[4,8]}})", 6, {"tensor w.q", "past the end of the data buffer"}},
      {R"({"w.q": {"dtype":"U8","shape":[4],"data_offsets":[6,2]}})", 8, {"tensor w.q", "end before begin"}},
      {R"({"w.q": {"dtype":"U8","shape":[4],"data_offsets":[-1,3]}})", 8, {"tensor w.q", "not a pair of non-negative"}},
      {R"({"w.q": {"dtype":"U8","shape":[4],"data_offsets":[0,4,8]}})", 8, {"tensor w.q", "not a pair"}},
      {R"({"w.q": {"dtype":"U8","shape":[4],"data_offsets":[0,4]},
           "w.k": {"dtype":"U8","shape":[4],"data_offsets":[2,6]}})", 8, {"w.q", "w.k", "overlap"}},
      {R"({"w.q": {"dtype":"U8","shape":[4],"data_offsets":[0,4]},
           "w.k": {"dtype":"I32","shape":[1],"data_offsets":[0,4]}})", 8, {"w.q", "w.k", "overlap"}},
      {R"({"w.q": [0, 1]})", 0, {"tensor w.q", "entry is a array"}},
      {R"({"w.q": {"dtype":"U8","shape":[1],"data_offsets":[0,1],"crc":1}})", 1, {"tensor w.q", "unknown field \"crc\""}},
      {R"({"": {"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1, {"empty name"}},
      {R"({"__metadata__": {"format": 1}})", 0, {"__metadata__.format", "expected a string"}},
      {R"({"__metadata__": [1]})", 0, {"__metadata__ is a array"}},
  };
  for (const Case& c : cases) {
    write_raw(p, c.header, c.data);
    SCOPED_TRACE(c.header);
    const std::string msg = load_error(p);
    ASSERT_NE(msg, "<no error>");
    EXPECT_NE(msg.find("entries.safetensors"), std::string::npos) << msg;
    for (const auto& w : c.want) EXPECT_NE(msg.find(w), std::string::npos) << "'" << w << "' not in: " << msg;
  }
}

TEST(SafetensorsCorrupt, ValidEdgeCasesLoad) {
  TempDir d;
  const std::string p = d.file("edge.safetensors");
  // Holes between tensors, trailing bytes, zero-size tensors sharing an offset, header padded
  // with spaces: all legal.
  write_raw(p, R"({"a": {"dtype":"U8","shape":[2],"data_offsets":[4,6]},
                   "z1": {"dtype":"F32","shape":[0],"data_offsets":[5,5]},
                   "z2": {"dtype":"F32","shape":[3,0],"data_offsets":[5,5]}}   )",
            16);
  Checkpoint ck = Checkpoint::open(p);
  EXPECT_EQ(ck.tensors().size(), 3u);
  EXPECT_EQ(ck.get("a").nbytes, 2u);
  // Empty header object: a valid file with no tensors.
  write_raw(p, "{}", 0);
  EXPECT_EQ(Checkpoint::open(p).tensors().size(), 0u);
}

TEST(SafetensorsCorrupt, CorruptShardNamedInError) {
  TempDir d;
  make_sharded(d, kGoodMap);
  write_raw(d.file("model-00002-of-00002.safetensors"),
            R"({"layers.1.a": {"dtype":"F32","shape":[2,2],"data_offsets":[0,15]}})", 15);
  expect_error(d.path.string(), {"model-00002-of-00002.safetensors", "layers.1.a", "needs 16 bytes"});
}

// ---------------------------------------------------------------------------------------------
// The golden checkpoint

TEST(Safetensors, GoldenCheckpointLoads) {
  Checkpoint ck = Checkpoint::open(kGoldenDir);
  EXPECT_EQ(ck.tensors().size(), 870u);
  ASSERT_EQ(ck.files().size(), 1u);
  EXPECT_EQ(ck.total_bytes(), fs::file_size(kGoldenDir + "/model.safetensors"));
  EXPECT_EQ(ck.metadata().at("format"), "pt");
  // Sum of tensor bytes = index metadata total_size (39,090,044).
  size_t sum = 0;
  for (const auto& [n, v] : ck.tensors()) sum += v.nbytes;
  EXPECT_EQ(sum, 39090044u);
  const TensorView& e = ck.expect("embed.weight", DType::BF16, {129280, 64});
  EXPECT_EQ(e.nbytes, 129280u * 64 * 2);
  ck.expect("layers.0.ffn.experts.0.w1.weight", DType::I8, {32, 32});
  ck.expect("layers.0.ffn.experts.0.w1.scale", DType::F8_E8M0, {32, 2});

  // The file opened directly gives the same tensors and the same bytes.
  Checkpoint single = Checkpoint::open(kGoldenDir + "/model.safetensors");
  ASSERT_EQ(single.tensors().size(), 870u);
  for (const auto& [n, v] : ck.tensors()) {
    const TensorView& s = single.get(n);
    ASSERT_EQ(s.nbytes, v.nbytes) << n;
    EXPECT_EQ(std::memcmp(s.data, v.data, v.nbytes), 0) << n;
  }
}

TEST(Safetensors, GoldenRewriteIsIdentical) {
  // Copying every golden tensor through the writer reproduces the same tensors and bytes.
  TempDir d;
  Checkpoint ck = Checkpoint::open(kGoldenDir);
  SafetensorsWriter w;
  for (const auto& [n, v] : ck.tensors()) w.add(n, v.dtype, v.shape, std::vector<uint8_t>(v.data, v.data + v.nbytes));
  for (const auto& [k, v] : ck.metadata()) w.set_metadata(k, v);
  w.write(d.file("copy.safetensors"));
  Checkpoint copy = Checkpoint::open(d.file("copy.safetensors"));
  ASSERT_EQ(copy.tensors().size(), 870u);
  EXPECT_EQ(copy.metadata(), ck.metadata());
  for (const auto& [n, v] : ck.tensors()) {
    const TensorView& c = copy.get(n);
    EXPECT_EQ(c.dtype, v.dtype) << n;
    EXPECT_EQ(c.shape, v.shape) << n;
    ASSERT_EQ(c.nbytes, v.nbytes) << n;
    EXPECT_EQ(std::memcmp(c.data, v.data, v.nbytes), 0) << n;
  }
}
