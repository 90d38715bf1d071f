// The engine's side of the disk tier: prefix-cache entries written through to a kvcache::DiskTier
// (a local or shared directory) and read back into the RAM tier (PrefixCache) ahead of admission.
//
// On disk, a token page's entry is named by its prefix-cache key and holds its page of every stream
// of the model's cache layout, back to back; a snapshot's entry is named by SHA-256(page key ||
// "snapshot") and holds the snapshot's bytes. The keys hash the model's cache format, the page
// size, the cache salt and every token before, so several processes and models share one
// directory without mixing; the tier checks each file's format id and checksum besides.
#pragma once

#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "engine/prefix_cache.h"
#include "kvcache/disk_tier.h"
#include "kvcache/page_pool.h"

namespace di::engine {

class DiskCache {
 public:
  using Clock = std::chrono::steady_clock;
  using Blob = std::optional<std::vector<std::byte>>;

  // Reads of the entries a request can use beyond what the RAM tier has.
  struct Fetch {
    size_t first_page = 0;                 // keys[first_page] is the first page read
    std::vector<std::future<Blob>> pages;  // keys[first_page + i]
    std::future<Blob> snapshot;            // of the state at the end of page snapshot_pages - 1
    size_t snapshot_pages = 0;             // 0 = none read
    Clock::time_point deadline;
    bool ready() const;  // every read has completed
    void wait_until(Clock::time_point t) const;  // for one read that has not
  };

  DiskCache(kvcache::DiskTierOptions opts, std::vector<kvcache::StreamLayout> layout, int write_min_hits);

  static CacheKey snapshot_key(const CacheKey& page_key);

  // Queues writes of the entries along `keys` (and their snapshots) that the disk does not have
  // from this process yet. Never blocks: the tier drops writes under pressure.
  void write_through(PrefixCache& ram, std::span<const CacheKey> keys);

  // Looks up the pages along `keys` past the ones the RAM tier has, and the furthest snapshot at
  // or before the end of the pages found in either tier, and starts reading what RAM lacks. Null
  // when the disk has nothing to add. The caller pins keys[0, first_page) meanwhile.
  std::unique_ptr<Fetch> start_fetch(const PrefixCache& ram, std::span<const CacheKey> keys, bool snapshots,
                                     Clock::duration timeout);
  // Moves what the reads returned into the RAM tier, as pool pages (stops at the first page that
  // is missing, damaged or does not fit), pinning the chain as it goes (PrefixCache::pin into
  // `pinned`, which holds the RAM part already): the RAM tier's capacity must not evict one page
  // while the next goes in. Returns the number of pages added.
  size_t install(Fetch& f, std::span<const CacheKey> keys, PrefixCache& ram, kvcache::PagePool& pool,
                 std::vector<PrefixCache::Entry*>& pinned);

  kvcache::DiskTier& tier() { return tier_; }
  const kvcache::DiskTier& tier() const { return tier_; }
  int64_t pages_read() const { return pages_read_; }
  int64_t snapshots_read() const { return snapshots_read_; }

 private:
  kvcache::DiskTier tier_;
  std::vector<kvcache::StreamLayout> layout_;
  size_t entry_bytes_ = 0;  // one token page in every stream
  int write_min_hits_;
  int64_t pages_read_ = 0, snapshots_read_ = 0;
};

}  // namespace di::engine
