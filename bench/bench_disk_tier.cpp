// Disk-tier restore throughput against a plain sequential read of the same files, in one run.
//
// For each entry size (a 64-token page set and a window snapshot by default): writes N entries
// through DiskTier (fsync on), then per run and per method drops the files' pages from the page
// cache (posix_fadvise DONTNEED on every file, checked with mincore) and reads every entry:
//   plain    one thread: open, read() the whole file into one buffer, close, file after file;
//   pread    DiskTier::read_async with the pread pool (header + XXH3 checked);
//   io_uring DiskTier::read_async with the io_uring reader.
// The methods' order rotates between runs. Reported: GB/s of file bytes per method and run,
// medians, the ratio of each tier reader to plain, and user+sys CPU seconds.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <map>
#include <thread>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "kvcache/disk_tier.h"

namespace fs = std::filesystem;
using di::kvcache::DiskTier;
using di::kvcache::DiskTierOptions;
using di::kvcache::EntryKey;
using Clock = std::chrono::steady_clock;

namespace {

EntryKey key_of(uint64_t i, uint64_t salt) {
  EntryKey k{};
  uint64_t s = i * 0x9e3779b97f4a7c15ull + salt;
  for (size_t j = 0; j < k.size(); j += 8) {
    s ^= s >> 31;
    s *= 0xbf58476d1ce4e5b9ull;
    s ^= s >> 29;
    std::memcpy(k.data() + j, &s, 8);
  }
  return k;
}

double cpu_seconds() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return double(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) + 1e-6 * double(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

// Drops the files' pages from the page cache; returns the fraction still resident afterwards.
double drop_cache(const std::vector<std::string>& files) {
  const long page = sysconf(_SC_PAGESIZE);
  uint64_t resident = 0, total = 0;
  std::vector<unsigned char> vec;
  for (const auto& f : files) {
    const int fd = open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    struct stat st{};
    fstat(fd, &st);
    if (st.st_size > 0) {
      void* m = mmap(nullptr, size_t(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
      if (m != MAP_FAILED) {
        const size_t pages = size_t((st.st_size + page - 1) / page);
        vec.resize(pages);
        if (mincore(m, size_t(st.st_size), vec.data()) == 0)
          for (unsigned char v : vec) resident += v & 1;
        total += pages;
        munmap(m, size_t(st.st_size));
      }
    }
    close(fd);
  }
  return total ? double(resident) / double(total) : 0.0;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string first_line_of(const std::string& path, const std::string& prefix) {
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(prefix, 0) == 0) {
      const size_t colon = line.find(':');
      return colon == std::string::npos ? line : line.substr(line.find_first_not_of(" \t", colon + 1));
    }
  return "";
}

struct Config {
  std::string name;
  size_t entries;
  size_t payload;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"deepinfer disk-tier restore throughput vs a plain sequential read"};
  std::string dir = "/var/tmp/di-disk-tier-bench", json_path;
  size_t small_n = 4096, small_size = 57 * 1024, large_n = 96, large_size = 2'600'000;
  int runs = 5, io_threads = 2, uring_depth = 32;
  app.add_option("--dir", dir, "directory on the disk to measure (created; its entries removed after)");
  app.add_option("--entries", small_n, "entries of the page-set size");
  app.add_option("--size", small_size, "page-set entry payload bytes");
  app.add_option("--large-entries", large_n, "entries of the snapshot size");
  app.add_option("--large-size", large_size, "snapshot entry payload bytes");
  app.add_option("-r,--runs", runs, "runs per method");
  app.add_option("--io-threads", io_threads, "DiskTier reader threads / io_uring rings");
  app.add_option("--uring-depth", uring_depth, "reads in flight per io_uring ring");
  app.add_option("--json", json_path, "write the results here");
  std::string note;
  app.add_option("--note", note, "free text recorded in the JSON (machine load, disk)");
  CLI11_PARSE(app, argc, argv);

  nlohmann::json out;
  std::string cmd;
  for (int i = 0; i < argc; ++i) cmd += (i ? " " : "") + std::string(argv[i]);
  out["command"] = cmd;
  if (!note.empty()) out["note"] = note;
  char date[64];
  const time_t now = time(nullptr);
  strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
  out["date"] = date;
  out["cpu"] = first_line_of("/proc/cpuinfo", "model name");
  utsname un{};
  uname(&un);
  out["kernel"] = un.release;
  fs::create_directories(dir);
  struct statfs sfs{};
  statfs(dir.c_str(), &sfs);
  char fstype[32];
  std::snprintf(fstype, sizeof fstype, "0x%lx", (unsigned long)sfs.f_type);
  out["filesystem_magic"] = fstype;
  out["dir"] = dir;
  out["cache_drop"] = "posix_fadvise(POSIX_FADV_DONTNEED) on every file before each method's read, checked with mincore";
  out["io_threads"] = io_threads;
  out["uring_depth"] = uring_depth;
  out["bytes_counted"] = "file bytes (header + payload) for every method";

  const std::vector<Config> configs = {{"page-set", small_n, small_size}, {"snapshot", large_n, large_size}};
  const char* methods[] = {"plain", "pread", "io_uring"};
  for (const Config& c : configs) {
    const std::string cdir = dir + "/" + c.name;
    fs::remove_all(cdir);
    DiskTierOptions o;
    o.dir = cdir;
    o.format_id = "bench-disk-tier";
    o.capacity_bytes = uint64_t(1) << 40;
    o.max_queued_write_bytes = uint64_t(1) << 40;
    o.io_threads = io_threads;
    o.uring_depth = uring_depth;
    o.sweep_interval = std::chrono::hours(1);

    // Payloads: distinct bytes per entry (the checksum sees real data).
    std::vector<std::byte> data(c.entries * c.payload);
    for (size_t i = 0; i < data.size(); i += 8) {
      const uint64_t v = i * 0x9e3779b97f4a7c15ull;
      std::memcpy(data.data() + i, &v, std::min<size_t>(8, data.size() - i));
    }
    std::vector<EntryKey> keys;
    std::vector<std::string> files;
    double write_s, write_cpu;
    {
      DiskTier w(o);
      std::shared_ptr<const void> none;
      const double cpu0 = cpu_seconds();
      const auto t0 = Clock::now();
      for (size_t i = 0; i < c.entries; ++i) {
        keys.push_back(key_of(i, c.payload));
        if (!w.write_async(keys.back(), {std::span<const std::byte>(data.data() + i * c.payload, c.payload)}, none)) {
          std::cerr << "write dropped\n";
          return 1;
        }
      }
      w.flush();
      write_s = std::chrono::duration<double>(Clock::now() - t0).count();
      write_cpu = cpu_seconds() - cpu0;
      if (w.stats().writes != c.entries) {
        std::cerr << "writes failed: " << w.stats().writes << " of " << c.entries << "\n";
        return 1;
      }
      for (auto& k : keys) files.push_back(w.entry_path(k));
    }
    uint64_t file_bytes = 0;
    std::vector<uint64_t> sizes;
    for (auto& f : files) file_bytes += sizes.emplace_back(fs::file_size(f));
    std::fill(data.begin(), data.end(), std::byte{0});  // the destination, touched before timing

    DiskTierOptions po = o, uo = o;
    po.reader = DiskTierOptions::Reader::Pread;
    uo.reader = DiskTierOptions::Reader::IoUring;
    DiskTier pread_tier(po), uring_tier(uo);
    if (uring_tier.stats().reader != DiskTierOptions::Reader::IoUring) {
      std::cerr << "io_uring reader unavailable\n";
      return 1;
    }
    while (!pread_tier.stats().index_ready || !uring_tier.stats().index_ready) std::this_thread::sleep_for(std::chrono::milliseconds(10));

    std::vector<std::byte> scratch(c.payload + 4096);
    std::map<std::string, std::vector<double>> gbps, cpu;
    double max_resident = 0;
    for (int run = 0; run < runs; ++run) {
      for (int m = 0; m < 3; ++m) {
        const std::string method = methods[(m + run) % 3];
        max_resident = std::max(max_resident, drop_cache(files));
        const double cpu0 = cpu_seconds();
        const auto t0 = Clock::now();
        if (method == "plain") {
          // Into one reused buffer (cache-warm: if anything, this favours the plain read).
          for (size_t i = 0; i < files.size(); ++i) {
            const int fd = open(files[i].c_str(), O_RDONLY | O_CLOEXEC);
            ssize_t n;
            uint64_t got = 0;
            while ((n = read(fd, scratch.data(), scratch.size())) > 0) got += uint64_t(n);
            close(fd);
            if (n < 0 || got != sizes[i]) {
              std::cerr << "plain read failed\n";
              return 1;
            }
          }
        } else {
          DiskTier& t = method == "pread" ? pread_tier : uring_tier;
          std::vector<std::future<bool>> fut;
          fut.reserve(keys.size());
          for (size_t i = 0; i < keys.size(); ++i)
            fut.push_back(t.read_async(keys[i], {std::span<std::byte>(data.data() + i * c.payload, c.payload)}, nullptr));
          for (auto& f : fut)
            if (!f.get()) {
              std::cerr << method << ": a miss\n";
              return 1;
            }
        }
        const double s = std::chrono::duration<double>(Clock::now() - t0).count();
        gbps[method].push_back(double(file_bytes) / s / 1e9);
        cpu[method].push_back(cpu_seconds() - cpu0);
      }
    }
    nlohmann::json jc;
    jc["entries"] = c.entries;
    jc["payload_bytes"] = c.payload;
    jc["file_bytes_total"] = file_bytes;
    jc["write_GBps"] = double(c.entries * c.payload) / write_s / 1e9;
    jc["write_seconds"] = write_s;
    jc["write_cpu_seconds"] = write_cpu;
    jc["max_resident_fraction_after_drop"] = max_resident;
    std::printf("%s: %zu entries of %zu bytes (%.1f MB), written at %.2f GB/s (fsync each)\n", c.name.c_str(), c.entries,
                c.payload, double(file_bytes) / 1e6, double(c.entries * c.payload) / write_s / 1e9);
    for (const char* m : methods) {
      jc["GBps"][m] = gbps[m];
      jc["cpu_seconds"][m] = cpu[m];
      jc["median_GBps"][m] = median(gbps[m]);
      jc["median_cpu_seconds"][m] = median(cpu[m]);
    }
    for (const char* m : {"pread", "io_uring"}) jc["ratio_to_plain"][m] = median(gbps[m]) / median(gbps["plain"]);
    for (const char* m : methods) {
      std::printf("  %-8s median %6.2f GB/s  cpu %.3f s  runs:", m, median(gbps[m]), median(cpu[m]));
      for (double g : gbps[m]) std::printf(" %.2f", g);
      if (std::string(m) != "plain") std::printf("  ratio to plain %.2f", median(gbps[m]) / median(gbps["plain"]));
      std::printf("\n");
    }
    out["configs"][c.name] = jc;
    fs::remove_all(cdir);
  }
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  return 0;
}
