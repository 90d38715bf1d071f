// Prefix cache: full token pages of sequences' paged caches, keyed by a SHA-256 hash chain.
//
// The key of token page k of a sequence is SHA-256(key of page k-1 || its page_tokens token ids as
// u32 LE); page 0's parent is a root key that hashes the model/format id and the request's
// cache_salt, so one key names one whole prefix in one namespace. A lookup walks the chain from
// page 0 and stops at the first missing key.
//
// Entries hold one token page: its page in every stream of the model's cache layout. Sequences that adopted entries
// hold a reference on each; eviction takes least recently used entries that nobody references,
// that have no cached children (a middle entry would strand its descendants), and whose pages no
// live sequence shares (evicting those would free nothing).
//
// An entry may also hold a snapshot (SequenceState::snapshot) of a state that ended at its page:
// a hit resumes from the furthest snapshot along the matched chain instead of replaying the
// model's window. Snapshots are copied out when used (never referenced), so they are evicted on
// their own, least recently used first, alongside pages (the older of the two goes first).
#pragma once

#include <array>
#include <cstdint>
#include <list>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvcache/page_pool.h"
#include "model/model.h"

namespace di::engine {

using CacheKey = std::array<uint8_t, 32>;

// SHA-256 (FIPS 180-4), incremental.
class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  CacheKey finish();

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buf_n_ = 0;
  uint64_t total_ = 0;
};

class PrefixCache {
 public:
  struct Entry;

  // `format_id` names the model and cache layout (pages of different models never mix).
  PrefixCache(int page_tokens, std::string format_id);
  ~PrefixCache();
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  int page_tokens() const { return page_tokens_; }
  CacheKey root_key(const std::string& salt) const;
  // Appends to `keys` (which holds the first keys.size() keys of this chain, rooted at `root`) the
  // keys of the full pages of `tokens` up to `n_pages` in all.
  void extend_keys(const CacheKey& root, std::span<const int32_t> tokens, size_t n_pages,
                   std::vector<CacheKey>& keys) const;

  // The longest run of cached pages along `keys`: marks them most recently used and appends them
  // to `held` with a reference taken on each. Returns the number of pages.
  size_t acquire(std::span<const CacheKey> keys, std::vector<Entry*>& held);
  void release(std::vector<Entry*>& held, size_t keep = 0);  // drops the references past the first `keep`
  // Like acquire, and the snapshots of those entries cannot be evicted either until unpin: what a
  // waiting request read from the tier below stays until it is admitted.
  size_t pin(std::span<const CacheKey> keys, std::vector<Entry*>& pinned);
  void unpin(std::vector<Entry*>& pinned);  // and clears `pinned`
  // The pages of held entries, as SequenceState::adopt_prefix takes them.
  kvcache::PrefixPages pages(std::span<Entry* const> entries) const;

  // Caches the full pages of `state` covered by `keys` that are not cached yet (keys[k] is the
  // key of token page k of the state's tokens); already cached ones are marked recently used.
  void insert(const SequenceState& state, std::span<const CacheKey> keys);

  // Attaches the snapshot of a state that ended at the page `key` names (inserted already; else
  // nothing happens). Replaces an older one. Its bytes come from the pool the caller drew it from.
  // `from_below`: read from the tier below, so take_unwritten does not hand it out.
  void insert_snapshot(const CacheKey& key, kvcache::PageRef snapshot, bool from_below = false);
  bool has_snapshot(const CacheKey& key) const;
  // Among the first n of `held`, the furthest entry with a snapshot: the number of pages up to and
  // including it (0 = none), marked recently used; its bytes stay valid until the next call that
  // may evict.
  size_t find_snapshot(std::span<Entry* const> held, std::span<const std::byte>* snapshot);

  // Evicts entries (LRU first) until `pool.free_bytes() >= bytes`. False if it cannot get there.
  bool make_room(const kvcache::PagePool& pool, size_t bytes);
  // Evicts every entry it may (tests, shutdown).
  void evict_all();

  // Bytes make_room could free now (entries nobody references or shares).
  size_t reclaimable_bytes() const;

  // Tiers below (the disk): whether a key is cached here, and adding an entry read back from
  // there (its parent, the previous page's key, must be cached already unless `parent` is null).
  bool contains(const CacheKey& key) const { return map_.count(key) != 0; }
  // The new entry is pinned into `pinned` (see pin) before the capacity is enforced.
  bool install(const CacheKey* parent, const CacheKey& key, std::vector<kvcache::PageRef> pages,
               std::vector<Entry*>& pinned);
  // Entries along `keys` (and their snapshots) not handed out yet whose hits reached `min_hits`,
  // handed out once (for a write to the disk tier); they stop at the first key not cached.
  struct Unwritten {
    CacheKey key;
    std::vector<kvcache::PageRef> pages;  // empty when only the snapshot is new
    kvcache::PageRef snapshot;
  };
  std::vector<Unwritten> take_unwritten(std::span<const CacheKey> keys, int min_hits);

  // Caps the bytes of entries and snapshots (the RAM tier's budget); 0 = only the pool's budget.
  // Inserts evict down to it, least recently used first, as far as entries are evictable.
  void set_capacity(size_t bytes);

  size_t entries() const { return map_.size(); }
  size_t bytes() const { return bytes_ + snapshot_bytes_; }  // pages (shared ones included) and snapshots
  size_t snapshots() const { return snap_lru_.size(); }
  size_t snapshot_bytes() const { return snapshot_bytes_; }
  int64_t evictions() const { return evictions_; }
  int64_t snapshot_evictions() const { return snapshot_evictions_; }

 private:
  struct KeyHash {
    size_t operator()(const CacheKey& k) const;
  };
  // acquire and pin: a reference on each entry of the cached run along `keys`, appended to `out`.
  size_t hold(std::span<const CacheKey> keys, std::vector<Entry*>& out, bool pin);
  bool evictable(const Entry& e) const;
  void erase(Entry* e);
  void drop_snapshot(Entry* e);
  void touch(Entry* e);
  // Evicts the least recently used evictable page or snapshot; false when there is none.
  bool evict_one();
  void trim();  // down to capacity_

  int page_tokens_;
  std::string format_id_;
  std::unordered_map<CacheKey, std::unique_ptr<Entry>, KeyHash> map_;
  std::list<Entry*> lru_;       // front = least recently used
  std::list<Entry*> snap_lru_;  // entries with a snapshot, front = least recently used snapshot
  uint64_t clock_ = 0;          // use stamps, to compare the fronts of the two lists
  size_t bytes_ = 0, snapshot_bytes_ = 0, capacity_ = 0;
  int64_t evictions_ = 0, snapshot_evictions_ = 0;
};

}  // namespace di::engine
