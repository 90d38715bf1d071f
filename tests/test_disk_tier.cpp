// The KV cache's disk tier: entry format, round trips through both readers, bad files, temp files,
// TTL, capacity LRU, the write queue bound, and real processes: two sharing one directory, a
// writer killed with SIGKILL mid-write, and a full disk (a tmpfs in a private mount namespace).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include "kvcache/disk_format.h"
#include "kvcache/disk_tier.h"

using namespace di::kvcache;
namespace fs = std::filesystem;
using Reader = DiskTierOptions::Reader;
using namespace std::chrono_literals;

namespace {

const std::string kFormat = "test-format-v1:layers=4:page=64";

struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "di-disk-tier-XXXXXX").string();
    path = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string str() const { return path.string(); }
};

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

EntryKey key_of(uint64_t i, uint64_t salt = 0) {
  EntryKey k;
  uint64_t s = i * 1315423911ull + salt * 2654435761ull + 7;
  for (size_t j = 0; j < k.size(); j += 8) {
    const uint64_t v = splitmix(s);
    std::memcpy(k.data() + j, &v, 8);
  }
  return k;
}

// Content derived from the key, so any reader can check what it got.
std::vector<std::byte> payload_for(const EntryKey& key, size_t n) {
  uint64_t s;
  std::memcpy(&s, key.data() + 8, 8);
  std::vector<std::byte> out(n);
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t v = splitmix(s);
    std::memcpy(out.data() + i, &v, std::min<size_t>(8, n - i));
  }
  return out;
}
// A size derived from the key too (for the processes that verify what they find on disk).
size_t size_for(const EntryKey& key, size_t lo, size_t hi) {
  uint32_t v;
  std::memcpy(&v, key.data() + 16, 4);
  return lo + v % (hi - lo);
}

DiskTierOptions test_options(const std::string& dir, Reader reader = Reader::Pread) {
  DiskTierOptions o;
  o.dir = dir;
  o.format_id = kFormat;
  o.capacity_bytes = 1ull << 30;
  o.ttl = std::chrono::hours(1);
  o.reader = reader;
  o.sweep_interval = std::chrono::hours(1);  // tests sweep with sweep_now
  o.atime_refresh = 0s;
  o.full_backoff = 300ms;
  o.fsync = false;  // page-cache writes suffice here; the process tests fsync
  return o;
}

// Splits `data` into spans of the given sizes (the last takes the rest).
template <class B>
std::vector<std::span<B>> split(std::span<B> data, std::vector<size_t> sizes) {
  std::vector<std::span<B>> out;
  size_t off = 0;
  for (size_t s : sizes) {
    s = std::min(s, data.size() - off);
    out.push_back(data.subspan(off, s));
    off += s;
  }
  out.push_back(data.subspan(off));
  return out;
}

bool write_entry(DiskTier& t, const EntryKey& key, const std::vector<std::byte>& payload, std::vector<size_t> sizes = {}) {
  auto owner = std::make_shared<std::vector<std::byte>>(payload);
  auto parts = split(std::span<const std::byte>(*owner), sizes);
  return t.write_async(key, std::move(parts), owner);
}

std::optional<std::vector<std::byte>> read_blob(DiskTier& t, const EntryKey& key) { return t.read_blob_async(key).get(); }

// Scatter read of `n` bytes into pieces of the given sizes; nullopt on a miss.
std::optional<std::vector<std::byte>> read_scatter(DiskTier& t, const EntryKey& key, size_t n, std::vector<size_t> sizes = {}) {
  auto buf = std::make_shared<std::vector<std::byte>>(n, std::byte{0xAA});
  auto dest = split(std::span<std::byte>(*buf), sizes);
  if (!t.read_async(key, std::move(dest), buf).get()) return std::nullopt;
  return *buf;
}

bool exists(const std::string& p) {
  struct stat st;
  return lstat(p.c_str(), &st) == 0;
}

uint64_t file_size(const std::string& p) { return fs::file_size(p); }

void set_atime(const std::string& p, int64_t seconds_ago) {
  timespec t[2];
  clock_gettime(CLOCK_REALTIME, &t[0]);
  t[0].tv_sec -= seconds_ago;
  t[1].tv_nsec = UTIME_OMIT;
  ASSERT_EQ(utimensat(AT_FDCWD, p.c_str(), t, AT_SYMLINK_NOFOLLOW), 0) << p;
}
int64_t atime_of(const std::string& p) {
  struct stat st;
  EXPECT_EQ(stat(p.c_str(), &st), 0);
  return st.st_atim.tv_sec;
}

std::vector<std::string> names_in(const fs::path& dir, bool temps) {
  std::vector<std::string> out;
  std::error_code ec;
  for (auto& e : fs::recursive_directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (e.is_regular_file() && disk::is_temp_name(n) == temps && (temps || n.ends_with(".kv"))) out.push_back(e.path().string());
  }
  return out;
}

void wait_index_ready(DiskTier& t) {
  for (int i = 0; i < 500 && !t.stats().index_ready; ++i) std::this_thread::sleep_for(10ms);
  ASSERT_TRUE(t.stats().index_ready);
}

void write_file(const std::string& p, std::span<const std::byte> bytes) {
  fs::create_directories(fs::path(p).parent_path());
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}
std::vector<std::byte> read_file(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  std::vector<char> c((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(c.size());
  std::memcpy(out.data(), c.data(), c.size());
  return out;
}

// ---- the format ----

TEST(DiskTierFormat, HeaderChecksEveryField) {
  const EntryKey key = key_of(1);
  std::vector<std::byte> h(disk::header_bytes(kFormat));
  EXPECT_EQ(h.size() % 8, 0u);
  disk::encode_header(h, key, kFormat, 12345, 0xfeedbeef, 1);
  uint64_t hash = 0;
  ASSERT_EQ(disk::check_header(h, key, kFormat, 12345, &hash), disk::HeaderCheck::Ok);
  EXPECT_EQ(hash, 0xfeedbeefu);
  EXPECT_EQ(disk::check_header(h, key_of(2), kFormat, 12345, &hash), disk::HeaderCheck::WrongKey);
  EXPECT_EQ(disk::check_header(h, key, kFormat, 12346, &hash), disk::HeaderCheck::WrongSize);
  std::string other = kFormat;
  other.back() = 'X';
  EXPECT_EQ(disk::check_header(h, key, other, 12345, &hash), disk::HeaderCheck::Foreign);
  // Any flipped bit of the header is caught (by the header checksum or a field check).
  for (size_t i = 0; i < h.size(); ++i) {
    for (int bit : {0, 7}) {
      auto c = h;
      c[i] ^= std::byte(1 << bit);
      EXPECT_NE(disk::check_header(c, key, kFormat, 12345, &hash), disk::HeaderCheck::Ok) << "byte " << i;
    }
  }
}

TEST(DiskTierFormat, PathsAreTheKeysHexOnly) {
  EntryKey key{};
  key[0] = 0xab;
  key[31] = 0x01;
  const std::string rel = disk::entry_relpath(key);
  EXPECT_EQ(rel, "ab/ab" + std::string(60, '0') + "01.kv");
  EntryKey back{};
  EXPECT_TRUE(disk::parse_entry_name(rel.substr(3), &back));
  EXPECT_EQ(back, key);
  EXPECT_FALSE(disk::parse_entry_name("AB" + rel.substr(5), &back)) << "upper case is not a name the tier writes";
  EXPECT_FALSE(disk::parse_entry_name("../" + rel.substr(6), &back));
  EXPECT_FALSE(disk::parse_entry_name(rel.substr(3) + ".tmp", &back));
  EXPECT_TRUE(disk::is_temp_name(".tmp-abc"));
  EXPECT_FALSE(disk::is_temp_name(rel.substr(3)));
  TempDir d;
  DiskTier t(test_options(d.str()));
  EXPECT_EQ(t.entry_path(key), d.str() + "/" + rel);
}

TEST(DiskTierFormat, BadOptionsAreRejected) {
  TempDir d;
  auto o = test_options(d.str());
  o.format_id = "";
  EXPECT_THROW(DiskTier{o}, std::invalid_argument);
  o.format_id = std::string(2000, 'x');
  EXPECT_THROW(DiskTier{o}, std::invalid_argument);
  o = test_options(d.str());
  o.io_threads = 0;
  EXPECT_THROW(DiskTier{o}, std::invalid_argument);
  o = test_options((d.path / "file").string());
  write_file(o.dir, std::vector<std::byte>(3));
  EXPECT_THROW(DiskTier{o}, std::runtime_error) << "a directory that is a file";
}

// ---- both readers ----

class DiskTierReaders : public ::testing::TestWithParam<Reader> {
 protected:
  DiskTierOptions opts(const std::string& dir) { return test_options(dir, GetParam()); }
  void expect_reader(DiskTier& t) {
    ASSERT_EQ(t.stats().reader, GetParam()) << "the requested reader must be the one running (no silent fallback)";
  }
};

TEST_P(DiskTierReaders, RoundTripScatterAndBlob) {
  TempDir d;
  DiskTier t(opts(d.str()));
  expect_reader(t);
  const std::vector<size_t> sizes = {0, 1, 7, 4096, 57 * 1024, 300 * 1000 + 3};
  std::vector<EntryKey> keys;
  for (size_t i = 0; i < sizes.size(); ++i) {
    keys.push_back(key_of(i));
    ASSERT_TRUE(write_entry(t, keys[i], payload_for(keys[i], sizes[i]), {sizes[i] / 3, 5, sizes[i] / 2}));
  }
  t.flush();
  EXPECT_EQ(t.stats().writes, sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    const auto want = payload_for(keys[i], sizes[i]);
    EXPECT_TRUE(t.contains(keys[i]));
    EXPECT_EQ(file_size(t.entry_path(keys[i])), disk::header_bytes(kFormat) + sizes[i]);
    EXPECT_EQ(read_scatter(t, keys[i], sizes[i], {sizes[i] / 4, 3, sizes[i] / 5, 1000}), want) << "entry " << i;
    EXPECT_EQ(read_blob(t, keys[i]), want) << "entry " << i;
  }
  // Many reads in flight at once (more than a ring's depth), scatter and blob mixed.
  std::vector<std::future<bool>> fs;
  std::vector<std::future<std::optional<std::vector<std::byte>>>> bs;
  std::vector<std::shared_ptr<std::vector<std::byte>>> bufs;
  for (int r = 0; r < 20; ++r) {
    for (size_t i = 0; i < sizes.size(); ++i) {
      bufs.push_back(std::make_shared<std::vector<std::byte>>(sizes[i]));
      fs.push_back(t.read_async(keys[i], {std::span<std::byte>(*bufs.back())}, bufs.back()));
      bs.push_back(t.read_blob_async(keys[i]));
    }
  }
  for (size_t j = 0; j < fs.size(); ++j) {
    ASSERT_TRUE(fs[j].get());
    EXPECT_EQ(*bufs[j], payload_for(keys[j % sizes.size()], sizes[j % sizes.size()]));
    EXPECT_EQ(bs[j].get(), payload_for(keys[j % sizes.size()], sizes[j % sizes.size()]));
  }
  // More scatter pieces than one preadv/readv takes (IOV_MAX = 1024).
  const EntryKey many = key_of(100);
  const auto big = payload_for(many, 3000 * 16);
  ASSERT_TRUE(write_entry(t, many, big, std::vector<size_t>(2999, 16)));
  t.flush();
  EXPECT_EQ(read_scatter(t, many, big.size(), std::vector<size_t>(2999, 16)), big);
  // A key never written: a miss.
  const EntryKey none = key_of(999);
  EXPECT_FALSE(t.contains(none));
  EXPECT_FALSE(read_scatter(t, none, 10));
  EXPECT_FALSE(read_blob(t, none));
  const auto s = t.stats();
  EXPECT_EQ(s.misses, 2u);
  EXPECT_EQ(s.hits, 2 * sizes.size() + 2 * 20 * sizes.size() + 1);
  EXPECT_EQ(s.corrupt_removed, 0u);
  EXPECT_EQ(s.queued_reads, 0u);
  EXPECT_GT(s.read_seconds, 0);
  EXPECT_GT(s.write_seconds, 0);
}

TEST_P(DiskTierReaders, RestartServesHitsImmediately) {
  TempDir d;
  const int n = 30;
  uint64_t total = 0;
  {
    DiskTier t(opts(d.str()));
    for (int i = 0; i < n; ++i) {
      const auto k = key_of(i);
      ASSERT_TRUE(write_entry(t, k, payload_for(k, 1000 + i * 100)));
      total += disk::header_bytes(kFormat) + 1000 + i * 100;
    }
    t.flush();
  }
  DiskTier t(opts(d.str()));
  expect_reader(t);
  // Served at once, whether or not the background scan has finished.
  for (int i = 0; i < n; ++i) EXPECT_EQ(read_blob(t, key_of(i)), payload_for(key_of(i), 1000 + i * 100));
  wait_index_ready(t);
  EXPECT_EQ(t.stats().entries_on_disk, uint64_t(n));
  EXPECT_EQ(t.stats().bytes_on_disk, total);
}

TEST_P(DiskTierReaders, BadFilesAreMissesAndRemoved) {
  TempDir d;
  DiskTier t(opts(d.str()));
  expect_reader(t);
  const size_t n = 5000, hb = disk::header_bytes(kFormat);
  auto good_file = [&](const EntryKey& k) {
    ASSERT_TRUE(write_entry(t, k, payload_for(k, n)));
    t.flush();
  };
  // Each case turns a good entry file into a bad one.
  std::map<std::string, std::function<void(const std::string& path, const EntryKey&)>> cases = {
      {"truncated payload", [&](const std::string& p, const EntryKey&) { ASSERT_EQ(truncate(p.c_str(), off_t(hb + n - 10)), 0); }},
      {"truncated header", [&](const std::string& p, const EntryKey&) { ASSERT_EQ(truncate(p.c_str(), 50), 0); }},
      {"empty", [&](const std::string& p, const EntryKey&) { ASSERT_EQ(truncate(p.c_str(), 0), 0); }},
      {"longer", [&](const std::string& p, const EntryKey&) { ASSERT_EQ(truncate(p.c_str(), off_t(hb + n + 8)), 0); }},
      {"payload bit flip",
       [&](const std::string& p, const EntryKey&) {
         auto b = read_file(p);
         b[hb + n / 2] ^= std::byte{0x10};
         write_file(p, b);
       }},
      {"header bit flip",
       [&](const std::string& p, const EntryKey&) {
         auto b = read_file(p);
         b[20] ^= std::byte{0x01};  // inside the key
         write_file(p, b);
       }},
      {"garbage",
       [&](const std::string& p, const EntryKey& k) {
         auto g = payload_for(key_of(7777), hb + n);
         write_file(p, g);
       }},
      {"another entry's file",
       [&](const std::string& p, const EntryKey&) {
         const EntryKey other = key_of(4242);
         good_file(other);
         fs::copy_file(t.entry_path(other), p, fs::copy_options::overwrite_existing);
         fs::remove(t.entry_path(other));
       }},
      {"foreign format, same id length",
       [&](const std::string& p, const EntryKey& k) {
         TempDir d2;
         auto o = opts(d2.str());
         o.format_id = kFormat;
         o.format_id.back() = 'Z';
         DiskTier other(o);
         ASSERT_TRUE(write_entry(other, k, payload_for(k, n)));
         other.flush();
         fs::copy_file(other.entry_path(k), p, fs::copy_options::overwrite_existing);
       }},
      {"foreign format, other id length",
       [&](const std::string& p, const EntryKey& k) {
         TempDir d2;
         auto o = opts(d2.str());
         o.format_id = "another-model";
         DiskTier other(o);
         // Sized so that the file has the length this tier expects.
         const size_t m = hb + n - disk::header_bytes(o.format_id);
         ASSERT_TRUE(write_entry(other, k, payload_for(k, m)));
         other.flush();
         fs::copy_file(other.entry_path(k), p, fs::copy_options::overwrite_existing);
         ASSERT_EQ(file_size(p), hb + n);
       }},
  };
  uint64_t i = 0, removed = 0;
  for (auto& [name, spoil] : cases) {
    for (bool blob : {false, true}) {
      SCOPED_TRACE(name + (blob ? " (blob)" : " (scatter)"));
      const EntryKey k = key_of(++i);
      good_file(k);
      const std::string p = t.entry_path(k);
      spoil(p, k);
      ASSERT_TRUE(exists(p));
      EXPECT_EQ(blob ? read_blob(t, k).has_value() : read_scatter(t, k, n).has_value(), false);
      EXPECT_FALSE(exists(p)) << "a bad file is removed";
      EXPECT_EQ(t.stats().corrupt_removed, ++removed);
    }
  }
  EXPECT_EQ(t.stats().hits, 0u);
  EXPECT_EQ(t.stats().read_errors, 0u);
}

TEST_P(DiskTierReaders, SizeMismatchIsAMiss) {
  TempDir d;
  DiskTier t(opts(d.str()));
  expect_reader(t);
  const size_t n = 8192;
  for (int delta : {-1, +1}) {
    const EntryKey k = key_of(10 + delta);
    ASSERT_TRUE(write_entry(t, k, payload_for(k, n)));
    t.flush();
    EXPECT_FALSE(read_scatter(t, k, n + delta));
    EXPECT_FALSE(exists(t.entry_path(k)));
  }
  EXPECT_EQ(t.stats().misses, 2u);
}

TEST_P(DiskTierReaders, SymlinksAreNeverFollowed) {
  TempDir d, outside;
  DiskTier t(opts(d.str()));
  expect_reader(t);
  const size_t n = 4000;
  // A valid entry file outside the directory, linked in place of the entry.
  const EntryKey k = key_of(1);
  ASSERT_TRUE(write_entry(t, k, payload_for(k, n)));
  t.flush();
  const std::string target = (outside.path / "entry").string();
  fs::rename(t.entry_path(k), target);
  fs::create_symlink(target, t.entry_path(k));
  EXPECT_FALSE(read_blob(t, k));
  EXPECT_FALSE(exists(t.entry_path(k))) << "the link is removed";
  EXPECT_TRUE(exists(target)) << "not what it points to";
  // A subdirectory that is a link to another directory holding a valid entry.
  const EntryKey k2 = key_of(2);
  ASSERT_TRUE(write_entry(t, k2, payload_for(k2, n)));
  t.flush();
  const fs::path sub = fs::path(t.entry_path(k2)).parent_path();
  fs::rename(sub, outside.path / "sub");
  fs::create_directory_symlink(outside.path / "sub", sub);
  EXPECT_FALSE(read_scatter(t, k2, n));
  EXPECT_TRUE(exists((outside.path / "sub" / fs::path(t.entry_path(k2)).filename()).string()));
  // Writes into that subdirectory fail instead of landing outside.
  EntryKey k3 = key_of(3);
  k3[0] = k2[0];
  const auto outside_before = names_in(outside.path, false).size();
  ASSERT_TRUE(write_entry(t, k3, payload_for(k3, n)));
  t.flush();
  EXPECT_EQ(t.stats().writes, 2u);
  EXPECT_EQ(t.stats().write_errors, 1u);
  EXPECT_EQ(names_in(outside.path, false).size(), outside_before);
  EXPECT_TRUE(names_in(outside.path, true).empty());
}

TEST_P(DiskTierReaders, CapacityEvictsLeastRecentlyAccessed) {
  TempDir d;
  const size_t n = 10000;
  const uint64_t f = disk::header_bytes(kFormat) + n;
  {
    DiskTier t(opts(d.str()));
    expect_reader(t);
    for (int i = 0; i < 10; ++i) ASSERT_TRUE(write_entry(t, key_of(i), payload_for(key_of(i), n)));
    t.flush();
    for (int i = 0; i < 10; ++i) set_atime(t.entry_path(key_of(i)), 1000 - 10 * i);  // 0 oldest
    ASSERT_TRUE(read_blob(t, key_of(0))) << "a hit makes entry 0 the most recent";
    EXPECT_GE(atime_of(t.entry_path(key_of(0))), atime_of(t.entry_path(key_of(9))));
  }
  // 10 files over a capacity of 6.5: down to the low watermark of 0.9 * 6.5 = 5.85 files, so 5
  // stay. The first pass of a new tier evicts.
  auto o = opts(d.str());
  o.capacity_bytes = f * 13 / 2;
  o.low_watermark = 0.9;
  DiskTier t(o);
  wait_index_ready(t);
  t.sweep_now();  // nothing more to do
  for (int i = 0; i < 10; ++i) EXPECT_EQ(t.contains(key_of(i)), i == 0 || i >= 6) << "entry " << i;
  const auto s = t.stats();
  EXPECT_EQ(s.evictions, 5u);
  EXPECT_EQ(s.entries_on_disk, 5u);
  EXPECT_EQ(s.bytes_on_disk, 5 * f);
}

TEST_P(DiskTierReaders, HitsRefreshAccessTimeAtMostOncePerInterval) {
  TempDir d;
  auto o = opts(d.str());
  o.atime_refresh = std::chrono::hours(1);
  o.ttl = std::chrono::hours(24);
  DiskTier t(o);
  expect_reader(t);
  wait_index_ready(t);
  const EntryKey a = key_of(1), b = key_of(2);
  ASSERT_TRUE(write_entry(t, a, payload_for(a, 100)));
  ASSERT_TRUE(write_entry(t, b, payload_for(b, 100)));
  t.flush();
  set_atime(t.entry_path(a), 600);   // within the interval: left alone
  set_atime(t.entry_path(b), 7200);  // older: refreshed
  const int64_t before_a = atime_of(t.entry_path(a));
  ASSERT_TRUE(read_blob(t, a));
  ASSERT_TRUE(read_blob(t, b));
  EXPECT_EQ(atime_of(t.entry_path(a)), before_a);
  EXPECT_GE(atime_of(t.entry_path(b)), int64_t(time(nullptr)) - 60);
}

INSTANTIATE_TEST_SUITE_P(Readers, DiskTierReaders, ::testing::Values(Reader::Pread, Reader::IoUring),
                         [](const auto& info) { return std::string(info.param == Reader::Pread ? "Pread" : "IoUring"); });

// ---- one process ----

TEST(DiskTier, TempFilesAreNeverReadAndStaleOnesAreSwept) {
  TempDir d;
  auto o = test_options(d.str());
  o.temp_grace = std::chrono::hours(1);
  DiskTier t(o);
  wait_index_ready(t);
  const size_t n = 3000;
  const EntryKey k = key_of(1);
  ASSERT_TRUE(write_entry(t, k, payload_for(k, n)));
  t.flush();
  // A complete, valid entry under temp names only (a writer between write and rename).
  const fs::path sub = fs::path(t.entry_path(k)).parent_path();
  const std::string fresh = (sub / (".tmp-" + disk::key_hex(k) + "-1-1-aaaa")).string();
  const std::string stale = (sub / (".tmp-" + disk::key_hex(k) + "-2-2-bbbb")).string();
  fs::copy_file(t.entry_path(k), fresh);
  fs::copy_file(t.entry_path(k), stale);
  fs::remove(t.entry_path(k));
  const std::string other = (d.path / "README").string();
  write_file(other, std::vector<std::byte>(10));
  EXPECT_FALSE(t.contains(k));
  EXPECT_FALSE(read_blob(t, k));
  EXPECT_FALSE(read_scatter(t, k, n));
  timespec old[2];
  clock_gettime(CLOCK_REALTIME, &old[0]);
  old[0].tv_sec -= 7200;
  old[1] = old[0];
  ASSERT_EQ(utimensat(AT_FDCWD, stale.c_str(), old, 0), 0);
  t.sweep_now();
  EXPECT_TRUE(exists(fresh)) << "a temp within the grace period may be a live writer's";
  EXPECT_FALSE(exists(stale));
  EXPECT_TRUE(exists(other)) << "files the tier did not name are left alone";
  EXPECT_EQ(t.stats().temps_removed, 1u);
  EXPECT_EQ(t.stats().entries_on_disk, 0u);
}

TEST(DiskTier, TtlExpiresEntriesNotAccessedFor) {
  TempDir d;
  auto o = test_options(d.str());
  o.ttl = std::chrono::hours(1);
  DiskTier t(o);
  wait_index_ready(t);  // the sweeper's first pass is over: only sweep_now expires below
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(write_entry(t, key_of(i), payload_for(key_of(i), 500)));
  t.flush();
  for (int i = 0; i < 3; ++i) set_atime(t.entry_path(key_of(i)), 7200);
  ASSERT_TRUE(read_blob(t, key_of(2))) << "read: no longer expired";
  t.sweep_now();
  for (int i = 0; i < 6; ++i) EXPECT_EQ(t.contains(key_of(i)), i >= 2) << "entry " << i;
  EXPECT_EQ(t.stats().expirations, 2u);
  EXPECT_EQ(t.stats().entries_on_disk, 4u);
}

TEST(DiskTier, TheSweeperThreadRunsOnItsOwn) {
  TempDir d;
  auto o = test_options(d.str());
  o.ttl = std::chrono::hours(1);
  o.sweep_interval = 50ms;
  DiskTier t(o);
  ASSERT_TRUE(write_entry(t, key_of(1), payload_for(key_of(1), 500)));
  t.flush();
  set_atime(t.entry_path(key_of(1)), 7200);
  for (int i = 0; i < 500 && t.contains(key_of(1)); ++i) std::this_thread::sleep_for(10ms);
  EXPECT_FALSE(t.contains(key_of(1)));
  EXPECT_EQ(t.stats().expirations, 1u);
}

TEST(DiskTier, WritesOverCapacityWakeTheSweeper) {
  TempDir d;
  auto o = test_options(d.str());
  const size_t n = 10000;
  o.capacity_bytes = (disk::header_bytes(kFormat) + n) * 4;
  o.sweep_interval = std::chrono::hours(1);
  DiskTier t(o);
  wait_index_ready(t);
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(write_entry(t, key_of(i), payload_for(key_of(i), n)));
  t.flush();
  for (int i = 0; i < 500 && t.stats().bytes_on_disk > o.capacity_bytes; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_LE(t.stats().bytes_on_disk, o.capacity_bytes);
  EXPECT_LE(names_in(d.path, false).size(), 4u);
  EXPECT_GE(t.stats().evictions, 4u);
}

TEST(DiskTier, TheWriteQueueIsBoundedAndDropsInsteadOfBlocking) {
  TempDir d;
  auto o = test_options(d.str());
  o.max_queued_write_bytes = 1 << 20;
  o.write_threads = 1;
  o.fsync = true;  // slow writes: the queue fills
  DiskTier t(o);
  const size_t n = 100 * 1000;
  std::vector<std::shared_ptr<std::vector<std::byte>>> payloads;
  for (int i = 0; i < 100; ++i) payloads.push_back(std::make_shared<std::vector<std::byte>>(payload_for(key_of(i), n)));
  std::vector<bool> queued;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 100; ++i) {
    queued.push_back(t.write_async(key_of(i), {std::span<const std::byte>(*payloads[i])}, payloads[i]));
    ASSERT_LE(t.stats().queued_write_bytes, o.max_queued_write_bytes);
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_FALSE(write_entry(t, key_of(200), payload_for(key_of(200), 2 << 20))) << "larger than the whole queue";
  t.flush();
  const auto s = t.stats();
  EXPECT_GE(s.writes_dropped, 50u);
  EXPECT_EQ(s.writes + s.writes_dropped, 101u);
  EXPECT_LT(secs, 5.0) << "queueing does not wait for the disk";
  for (int i = 0; i < 100; ++i) EXPECT_EQ(t.contains(key_of(i)), bool(queued[i])) << "entry " << i;
  EXPECT_EQ(s.queued_writes, 0u);
  EXPECT_EQ(s.queued_write_bytes, 0u);
}

TEST(DiskTier, AnEntryIsQueuedOnceAndNotRewritten) {
  TempDir d;
  auto o = test_options(d.str());
  o.write_threads = 1;
  o.fsync = true;
  DiskTier t(o);
  const EntryKey k = key_of(1);
  ASSERT_TRUE(write_entry(t, key_of(2), payload_for(key_of(2), 1 << 20)));  // keeps the writer busy
  ASSERT_TRUE(write_entry(t, k, payload_for(k, 1000)));
  EXPECT_FALSE(write_entry(t, k, payload_for(k, 1000))) << "already queued";
  t.flush();
  struct stat before;
  ASSERT_EQ(stat(t.entry_path(k).c_str(), &before), 0);
  EXPECT_TRUE(write_entry(t, k, payload_for(k, 1000)));
  t.flush();
  struct stat after;
  ASSERT_EQ(stat(t.entry_path(k).c_str(), &after), 0);
  EXPECT_EQ(before.st_ino, after.st_ino);
  EXPECT_EQ(t.stats().writes_existing, 1u);
  EXPECT_EQ(t.stats().writes, 2u);
}

TEST(DiskTier, QueuedEntriesAreReadFromMemoryBeforeTheyArePublished) {
  TempDir d;
  auto o = test_options(d.str());
  o.write_threads = 1;
  o.fsync = true;
  DiskTier t(o);
  // Two big entries keep the single writer busy; the small one waits behind them.
  ASSERT_TRUE(write_entry(t, key_of(2), payload_for(key_of(2), 4 << 20)));
  ASSERT_TRUE(write_entry(t, key_of(3), payload_for(key_of(3), 4 << 20)));
  const EntryKey k = key_of(1);
  ASSERT_TRUE(write_entry(t, k, payload_for(k, 5000)));
  struct stat st;
  ASSERT_NE(stat(t.entry_path(k).c_str(), &st), 0) << "not published yet";
  EXPECT_TRUE(t.contains(k));
  auto blob = t.read_blob_async(k).get();
  ASSERT_TRUE(blob.has_value());
  EXPECT_EQ(*blob, payload_for(k, 5000));
  EXPECT_EQ(t.stats().pending_hits, 1u);
  t.flush();
  EXPECT_EQ(stat(t.entry_path(k).c_str(), &st), 0);
  auto again = t.read_blob_async(k).get();
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(*again, payload_for(k, 5000));
  EXPECT_EQ(t.stats().pending_hits, 1u) << "published entries come from the file";
}

TEST(DiskTier, ClearRemovesEveryEntry) {
  TempDir d;
  DiskTier t(test_options(d.str()));
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(write_entry(t, key_of(i), payload_for(key_of(i), 100)));
  t.flush();
  const std::string other = (d.path / "notes.txt").string();
  write_file(other, std::vector<std::byte>(10));
  EXPECT_EQ(t.clear(), 5u);
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(t.contains(key_of(i)));
  EXPECT_TRUE(exists(other));
  EXPECT_EQ(t.stats().entries_on_disk, 0u);
  EXPECT_EQ(t.stats().bytes_on_disk, 0u);
}

// ---- real processes ----

// Runs fn() in a child process; returns its exit status (fn's return value, or 128 + signal).
// The test process has no other threads when it forks (every tier of the test is gone).
template <class F>
pid_t spawn(F fn) {
  fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    int rc = 99;
    try {
      rc = fn();
    } catch (const std::exception& e) {
      fprintf(stderr, "child: exception: %s\n", e.what());
      rc = 98;
    }
    fflush(nullptr);
    _exit(rc);
  }
  return pid;
}
int wait_child(pid_t pid, std::chrono::seconds timeout = 60s) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > end) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(5ms);
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

#define CHILD_CHECK(cond)                                                         \
  do {                                                                            \
    if (!(cond)) {                                                                \
      fprintf(stderr, "child %d: check failed at line %d: %s\n", getpid(), __LINE__, #cond); \
      return 1;                                                                   \
    }                                                                             \
  } while (0)

// Two processes share one directory: each reads the other's entries, then both write, read and
// evict under a small capacity at the same time. Every hit must have the right content.
TEST(DiskTierProcesses, TwoProcessesShareOneDirectoryAndEvictConcurrently) {
  TempDir d, sync;
  const int n = 40;
  const size_t lo = 2000, hi = 40000;
  auto child = [&](int self, int other, Reader reader) {
    return [=, &d, &sync]() -> int {
      {
        auto o = test_options(d.str(), reader);
        DiskTier t(o);
        for (int i = 0; i < n; ++i) {
          const EntryKey k = key_of(i, self);
          CHILD_CHECK(write_entry(t, k, payload_for(k, size_for(k, lo, hi))));
        }
        t.flush();
        std::ofstream((sync.path / ("done" + std::to_string(self))).string()) << "1";
        const std::string theirs = (sync.path / ("done" + std::to_string(other))).string();
        for (int i = 0; i < 2000 && !exists(theirs); ++i) std::this_thread::sleep_for(5ms);
        CHILD_CHECK(exists(theirs));
        int seen = 0;
        for (int i = 0; i < n; ++i) {
          const EntryKey k = key_of(i, other);
          CHILD_CHECK(t.contains(k));
          const auto got = read_scatter(t, k, size_for(k, lo, hi), {100, 1000});
          CHILD_CHECK(got.has_value() && *got == payload_for(k, size_for(k, lo, hi)));
          ++seen;
        }
        std::ofstream((sync.path / ("phase2-" + std::to_string(self))).string()) << seen;
        // Phase 2 evicts: only once the other process has read everything.
        const std::string theirs2 = (sync.path / ("phase2-" + std::to_string(other))).string();
        for (int i = 0; i < 2000 && !exists(theirs2); ++i) std::this_thread::sleep_for(5ms);
        CHILD_CHECK(exists(theirs2));
      }
      // Phase 2: a capacity of about 25 entries; both sweepers run every 20 ms and on demand.
      auto o = test_options(d.str(), reader);
      o.capacity_bytes = 25 * (lo + hi) / 2;
      o.sweep_interval = 20ms;
      DiskTier t(o);
      std::mt19937 rng(self);
      uint64_t hits = 0;
      const auto end = std::chrono::steady_clock::now() + 1500ms;
      for (int i = n; std::chrono::steady_clock::now() < end; ++i) {
        const EntryKey k = key_of(i, self);
        write_entry(t, k, payload_for(k, size_for(k, lo, hi)));
        for (int r = 0; r < 4; ++r) {
          const EntryKey q = key_of(rng() % uint32_t(i + 1), rng() % 2 ? self : other);
          const size_t m = size_for(q, lo, hi);
          const auto got = r % 2 ? read_blob(t, q) : read_scatter(t, q, m, {m / 2});
          if (got) {
            CHILD_CHECK(*got == payload_for(q, m));
            ++hits;
          }
        }
        if (i % 10 == 0) t.sweep_now();
      }
      t.flush();
      t.sweep_now();
      const auto s = t.stats();
      std::ofstream((sync.path / ("stats" + std::to_string(self))).string())
          << s.evictions << " " << hits << " " << s.write_errors << " " << s.read_errors << " " << s.corrupt_removed;
      CHILD_CHECK(s.write_errors == 0 && s.read_errors == 0 && s.corrupt_removed == 0);
      return 0;
    };
  };
  const pid_t a = spawn(child(1, 2, Reader::Pread));
  const pid_t b = spawn(child(2, 1, Reader::IoUring));
  EXPECT_EQ(wait_child(a), 0);
  EXPECT_EQ(wait_child(b), 0);
  uint64_t evictions = 0, hits = 0;
  for (int self : {1, 2}) {
    std::ifstream p2((sync.path / ("phase2-" + std::to_string(self))).string());
    int seen = -1;
    p2 >> seen;
    EXPECT_EQ(seen, n) << "process " << self << " read every entry of the other";
    std::ifstream f((sync.path / ("stats" + std::to_string(self))).string());
    uint64_t e = 0, h = 0, we = 1, re = 1, cr = 1;
    f >> e >> h >> we >> re >> cr;
    evictions += e;
    hits += h;
  }
  EXPECT_GT(evictions, 0u) << "the capacity was exceeded, so someone evicted";
  EXPECT_GT(hits, 0u);
  auto o = test_options(d.str());
  o.capacity_bytes = 25 * (lo + hi) / 2;
  DiskTier t(o);
  t.sweep_now();
  EXPECT_LE(t.stats().bytes_on_disk, o.capacity_bytes);
}

// A writer killed with SIGKILL at random moments, several times, over the same keys: whatever it
// leaves, no file that a reader accepts has the wrong content, and the temps it left are swept.
TEST(DiskTierProcesses, KillDuringWritesLeavesNoEntryWithWrongContent) {
  TempDir d;
  const size_t lo = 1000, hi = 400000;
  std::mt19937 rng(12345);
  int killed = 0;
  size_t temps_seen = 0;
  for (int round = 0; round < 6; ++round) {
    const pid_t pid = spawn([&]() -> int {
      auto o = test_options(d.str());
      o.fsync = true;
      o.write_threads = 2;
      o.max_queued_write_bytes = 8 << 20;
      DiskTier t(o);
      for (uint64_t i = 0;; ++i) {  // until killed
        const EntryKey k = key_of(i, 77);
        while (!write_entry(t, k, payload_for(k, size_for(k, lo, hi)))) {
          if (t.stats().queued_writes == 0) break;  // dropped for another reason than a full queue
          std::this_thread::sleep_for(1ms);
        }
      }
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(20 + rng() % 150));
    kill(pid, SIGKILL);
    killed += wait_child(pid) == 128 + SIGKILL;
    temps_seen += names_in(d.path, true).size();
  }
  EXPECT_EQ(killed, 6);
  EXPECT_GT(temps_seen, 0u) << "no kill landed during a write: the test checked nothing";
  const auto entries = names_in(d.path, false);
  ASSERT_GT(entries.size(), 0u);
  for (Reader reader : {Reader::Pread, Reader::IoUring}) {
    auto o = test_options(d.str(), reader);
    o.temp_grace = 0s;
    DiskTier t(o);
    size_t hits = 0;
    for (const auto& path : entries) {
      EntryKey k;
      ASSERT_TRUE(disk::parse_entry_name(fs::path(path).filename().string(), &k));
      const auto got = read_blob(t, k);
      if (got) {
        ++hits;
        ASSERT_EQ(*got, payload_for(k, size_for(k, lo, hi))) << path;
      }
    }
    EXPECT_EQ(hits, entries.size()) << "every published entry is whole";
    EXPECT_EQ(t.stats().corrupt_removed, 0u);
    t.sweep_now();
    EXPECT_TRUE(names_in(d.path, true).empty()) << "stale temps are swept";
  }
}

// A disk that fills up: writes degrade with one log line and no error to the caller, reads go on,
// and writes come back after the backoff once there is room. The disk is a 4 MiB tmpfs mounted in
// a private mount namespace of a child process (the tests run as root; failing to mount fails).
TEST(DiskTierProcesses, FullDiskDegradesToNoWritesAndReadsGoOn) {
  TempDir mnt;
  const pid_t pid = spawn([&]() -> int {
    if (unshare(CLONE_NEWNS) != 0) {
      fprintf(stderr, "child: unshare(CLONE_NEWNS): %s\n", strerror(errno));
      return 90;
    }
    if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        mount("tmpfs", mnt.str().c_str(), "tmpfs", 0, "size=4m") != 0) {
      fprintf(stderr, "child: mount: %s\n", strerror(errno));
      return 91;
    }
    std::ostringstream log;
    auto logger = std::make_shared<spdlog::logger>("disk-full-test", std::make_shared<spdlog::sinks::ostream_sink_st>(log));
    spdlog::set_default_logger(logger);
    auto count = [&](const std::string& what) {
      const std::string s = log.str();
      int c = 0;
      for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++c;
      return c;
    };
    int rc = 0;
    {
      auto o = test_options(mnt.str() + "/cache");
      o.fsync = true;
      o.write_threads = 1;
      o.full_backoff = 1500ms;  // longer than the writes below take
      DiskTier t(o);
      const size_t n = 256 * 1024;
      int accepted = 0, refused = 0;
      for (int i = 0; i < 40; ++i) {
        const bool ok = write_entry(t, key_of(i), payload_for(key_of(i), n));
        t.flush();
        ok ? ++accepted : ++refused;
      }
      const auto s = t.stats();
      fprintf(stderr, "child: accepted %d refused %d writes %llu dropped %llu\n", accepted, refused,
              (unsigned long long)s.writes, (unsigned long long)s.writes_dropped);
      CHILD_CHECK(s.disk_full);
      CHILD_CHECK(s.writes >= 8 && s.writes <= 16);  // 4 MiB of 256 KiB entries
      CHILD_CHECK(refused > 0 && s.writes_dropped == uint64_t(40 - s.writes));
      CHILD_CHECK(s.write_errors == 0);
      CHILD_CHECK(count("no disk writes") == 1);
      CHILD_CHECK(names_in(mnt.path, true).empty());  // the failed write's temp is gone
      // Reads go on while writes are off.
      for (uint64_t i = 0; i < s.writes; ++i) CHILD_CHECK(read_blob(t, key_of(int(i))) == payload_for(key_of(int(i)), n));
      CHILD_CHECK(t.stats().hits == s.writes);
      // Room again, and the backoff over: writes resume.
      CHILD_CHECK(t.clear() == s.writes);
      std::this_thread::sleep_for(1600ms);
      CHILD_CHECK(!t.stats().disk_full);
      CHILD_CHECK(write_entry(t, key_of(100), payload_for(key_of(100), n)));
      t.flush();
      CHILD_CHECK(t.stats().writes == s.writes + 1);
      CHILD_CHECK(read_blob(t, key_of(100)) == payload_for(key_of(100), n));
      CHILD_CHECK(count("disk writes resumed") == 1);
    }
    fprintf(stderr, "%s", log.str().c_str());
    umount(mnt.str().c_str());
    return rc;
  });
  const int rc = wait_child(pid);
  ASSERT_NE(rc, 90) << "unshare(CLONE_NEWNS) failed: this test needs root (CI runs as root)";
  ASSERT_NE(rc, 91) << "mounting a tmpfs failed: this test needs root (CI runs as root)";
  EXPECT_EQ(rc, 0);
}

}  // namespace
