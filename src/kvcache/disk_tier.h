// The disk tier of the KV cache: one file per cache entry in a directory on a local disk or a
// shared mount (3FS FUSE, NFS) that several processes, on one machine or several, use at once.
//
// Consistency rules (docs/kv-cache.md, "Disk tier"):
//  - an entry is published whole or not at all: written to a unique temp name in its final
//    directory, fsynced, then renamed; readers only ever open final names;
//  - every read checks the header (format, key, length, header checksum) and the payload's XXH3;
//    any missing, short, corrupt, foreign or mis-sized file is a miss (and a bad file is removed),
//    never an error for the caller;
//  - eviction (TTL and capacity, least recently accessed first) is done by a background sweeper in
//    every process; concurrent sweepers only race on unlink (ENOENT is fine), and an open reader
//    of an unlinked file still reads it whole.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace di::kvcache {

// SHA-256 chain key made by the engine's prefix cache; it names the entry's file.
using EntryKey = std::array<uint8_t, 32>;

struct DiskTierOptions {
  std::string dir;  // local disk or shared mount; created if missing
  // Bytes of entry files; beyond it the sweeper evicts least recently accessed entries down to
  // low_watermark * capacity_bytes.
  uint64_t capacity_bytes = 64ull << 30;
  double low_watermark = 0.9;
  std::chrono::seconds ttl = std::chrono::hours(24 * 7);  // entries not accessed for this long are removed
  std::string format_id;  // model cache-format id, in every header; other formats are misses (1..1024 bytes)
  int io_threads = 2;     // reader threads (pread pool) or io_uring rings, one thread each
  int write_threads = 2;  // writer threads (fsync latencies overlap across threads)
  uint64_t max_queued_write_bytes = 256ull << 20;  // beyond it writes are dropped, never block
  enum class Reader { Pread, IoUring } reader = Reader::Pread;
  int uring_depth = 32;  // reads in flight per io_uring ring
  std::chrono::milliseconds sweep_interval = std::chrono::seconds(60);  // one full directory scan each
  std::chrono::seconds temp_grace = std::chrono::hours(1);  // older temp files are a dead writer's
  // A hit rewrites the file's access time only when it is older than this, so a hot entry does not
  // cost a metadata write per read (on a shared mount that is a round trip to the metadata server).
  std::chrono::seconds atime_refresh = std::chrono::seconds(60);
  std::chrono::milliseconds full_backoff = std::chrono::seconds(60);  // no disk writes after ENOSPC/EDQUOT
  bool fsync = true;       // fdatasync each entry before its rename
  bool fsync_dir = false;  // also fsync the directory after the rename (the name survives power loss)
  uint64_t max_entry_bytes = 1ull << 30;  // larger files are misses (bounds read_blob_async's allocation)
};

struct DiskTierStats {
  uint64_t hits = 0, hit_bytes = 0, misses = 0;
  uint64_t pending_hits = 0;     // of those, served from this process's queued (unpublished) writes
  uint64_t corrupt_removed = 0;  // bad files removed by readers: short, corrupt, foreign, mis-sized
  uint64_t read_errors = 0;      // reads that failed with an I/O error (counted as misses too)
  uint64_t writes = 0, write_bytes = 0;  // entries published (payload bytes)
  uint64_t writes_dropped = 0;   // queue full, disk full, entry too large, queued twice, cleared
  uint64_t writes_existing = 0;  // skipped by the writer: the entry was already on disk
  uint64_t write_errors = 0;     // failed writes other than a full disk
  uint64_t evictions = 0, expirations = 0, temps_removed = 0, sweeps = 0;
  uint64_t bytes_on_disk = 0, entries_on_disk = 0;  // last scan, updated by this process since
  uint64_t queued_writes = 0, queued_write_bytes = 0, queued_reads = 0;
  double read_seconds = 0;   // sum of read latencies (request to result)
  double write_seconds = 0;  // sum of write times of published entries (open to rename)
  bool disk_full = false;    // writes are off after ENOSPC/EDQUOT, for full_backoff
  bool index_ready = false;  // the first directory scan has finished
  DiskTierOptions::Reader reader = DiskTierOptions::Reader::Pread;  // the one in use
};

// All members may be called from any thread.
class DiskTier {
 public:
  // Creates the directory if needed (throws std::runtime_error when it cannot be opened or
  // std::invalid_argument for bad options); never waits for a scan of existing files: the index
  // used for eviction is rebuilt by the sweeper thread. A requested io_uring reader that the kernel
  // refuses falls back to the pread pool with a warning (stats().reader says which runs).
  explicit DiskTier(DiskTierOptions);
  // Stops the threads: queued writes are dropped, queued reads complete as misses, a write in
  // progress finishes or leaves only a temp file.
  ~DiskTier();
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  // Queues an entry whose payload is the concatenation of `parts`; `owner` keeps their memory
  // alive until it is written. Returns false when dropped: queue over max_queued_write_bytes, disk
  // full, already queued, larger than max_entry_bytes. An entry already on disk is detected by
  // the writer thread (stats().writes_existing), so the caller never waits for a stat.
  bool write_async(const EntryKey&, std::vector<std::span<const std::byte>> parts, std::shared_ptr<const void> owner);
  // A stat of the entry's file: sees other processes' entries at once; does not read or verify it.
  // This process's queued writes count as present (reads serve them from memory).
  bool contains(const EntryKey&) const;
  // Reads an entry whose payload is exactly the sum of the `dest` sizes into those spans (scatter
  // read). false = miss: missing, short, corrupt, foreign format or a different size (a bad file is
  // removed); dest then holds unspecified bytes. `owner` keeps dest alive until the future is ready.
  std::future<bool> read_async(const EntryKey&, std::vector<std::span<std::byte>> dest, std::shared_ptr<void> owner);
  // Whole-entry read for variable-size payloads (std::nullopt = miss, same rules).
  std::future<std::optional<std::vector<std::byte>>> read_blob_async(const EntryKey&);
  void flush();       // waits until no write is queued or in progress
  uint64_t clear();   // drops queued writes and removes every entry file; returns the number removed
  void sweep_now();   // one TTL/eviction/temp pass on the calling thread
  DiskTierStats stats() const;
  // DIR/ab/abcd…(64 hex digits).kv: the path depends only on the key's hex digits.
  std::string entry_path(const EntryKey&) const;
  const DiskTierOptions& options() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace di::kvcache
