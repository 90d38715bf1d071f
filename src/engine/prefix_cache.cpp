#include "engine/prefix_cache.h"

#include <cmath>
#include <cstring>
#include <stdexcept>

namespace di::engine {

// ---- SHA-256 -----------------------------------------------------------------------------------

namespace {

// The round constants and initial hash are the first 32 fractional bits of the cube / square roots
// of the first primes (FIPS 180-4 §4.2.2, §5.3.3); computing them avoids a transcribed table.
struct ShaConstants {
  uint32_t k[64], h0[8];
  ShaConstants() {
    int found = 0;
    for (int n = 2; found < 64; ++n) {
      bool prime = true;
      for (int d = 2; d * d <= n; ++d) prime &= n % d != 0;
      if (!prime) continue;
      auto frac32 = [](long double x) { return uint32_t((x - std::floor(x)) * 4294967296.0L); };
      if (found < 8) h0[found] = frac32(std::sqrt((long double)n));
      k[found++] = frac32(std::cbrt((long double)n));
    }
  }
};
const ShaConstants& sha_constants() {
  static const ShaConstants c;
  return c;
}
inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

}  // namespace

Sha256::Sha256() { std::memcpy(h_, sha_constants().h0, sizeof h_); }

void Sha256::block(const uint8_t* p) {
  const uint32_t* K = sha_constants().k;
  uint32_t w[64];
  for (int i = 0; i < 16; ++i) w[i] = uint32_t(p[4 * i]) << 24 | uint32_t(p[4 * i + 1]) << 16 | uint32_t(p[4 * i + 2]) << 8 | p[4 * i + 3];
  for (int i = 16; i < 64; ++i) {
    const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = h_[0], b = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6], h = h_[7];
  for (int i = 0; i < 64; ++i) {
    const uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + K[i] + w[i];
    const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    h = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
  }
  h_[0] += a; h_[1] += b; h_[2] += c; h_[3] += d; h_[4] += e; h_[5] += f; h_[6] += g; h_[7] += h;
}

void Sha256::update(const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  total_ += n;
  while (n > 0) {
    if (buf_n_ == 0 && n >= 64) {
      block(p);
      p += 64;
      n -= 64;
      continue;
    }
    const size_t take = std::min(n, 64 - buf_n_);
    std::memcpy(buf_ + buf_n_, p, take);
    buf_n_ += take;
    p += take;
    n -= take;
    if (buf_n_ == 64) {
      block(buf_);
      buf_n_ = 0;
    }
  }
}

CacheKey Sha256::finish() {
  const uint64_t bits = total_ * 8;
  const uint8_t pad = 0x80, zero = 0;
  update(&pad, 1);
  while (buf_n_ != 56) update(&zero, 1);
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = uint8_t(bits >> (56 - 8 * i));
  update(len, 8);
  CacheKey out;
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 4; ++j) out[size_t(4 * i + j)] = uint8_t(h_[i] >> (24 - 8 * j));
  return out;
}

// ---- PrefixCache -------------------------------------------------------------------------------

struct PrefixCache::Entry {
  CacheKey key;
  Entry* parent = nullptr;
  int children = 0;
  int refs = 0;
  std::vector<kvcache::PageRef> pages;  // one per stream
  size_t bytes = 0;
  std::list<Entry*>::iterator lru;
  uint64_t used = 0;
  kvcache::PageRef snapshot;  // of a state that ended at this page; null = none
  std::list<Entry*>::iterator snap_lru;
  uint64_t snap_used = 0;
  int hits = 0;
  int snapshot_pins = 0;  // waiting requests that need its snapshot (PrefixCache::pin)
  bool written = false, snapshot_written = false;  // handed to the tier below
  // A live sequence shares a page: evicting the entry would free nothing.
  bool shared() const {
    for (const auto& p : pages)
      if (p.use_count() > 1) return true;
    return false;
  }
};

size_t PrefixCache::KeyHash::operator()(const CacheKey& k) const {
  size_t h;
  std::memcpy(&h, k.data(), sizeof h);  // the key is already a uniform hash
  return h;
}

PrefixCache::PrefixCache(int page_tokens, std::string format_id)
    : page_tokens_(page_tokens), format_id_(std::move(format_id)) {
  if (page_tokens <= 0) throw std::invalid_argument("PrefixCache: page_tokens must be positive");
}

PrefixCache::~PrefixCache() = default;

CacheKey PrefixCache::root_key(const std::string& salt) const {
  Sha256 h;
  const char tag[] = "deepinfer-prefix-v1";
  h.update(tag, sizeof tag);
  const uint64_t lens[3] = {format_id_.size(), salt.size(), uint64_t(page_tokens_)};
  h.update(lens, sizeof lens);  // lengths first: (format, salt) pairs cannot alias
  h.update(format_id_.data(), format_id_.size());
  h.update(salt.data(), salt.size());
  return h.finish();
}

void PrefixCache::extend_keys(const CacheKey& root, std::span<const int32_t> tokens, size_t n_pages,
                              std::vector<CacheKey>& keys) const {
  n_pages = std::min(n_pages, tokens.size() / size_t(page_tokens_));
  uint8_t le[4];
  while (keys.size() < n_pages) {
    const size_t k = keys.size();
    Sha256 h;
    const CacheKey& parent = k == 0 ? root : keys[k - 1];
    h.update(parent.data(), parent.size());
    for (size_t i = k * size_t(page_tokens_); i < (k + 1) * size_t(page_tokens_); ++i) {
      const uint32_t t = uint32_t(tokens[i]);
      le[0] = uint8_t(t); le[1] = uint8_t(t >> 8); le[2] = uint8_t(t >> 16); le[3] = uint8_t(t >> 24);
      h.update(le, 4);
    }
    keys.push_back(h.finish());
  }
}

size_t PrefixCache::acquire(std::span<const CacheKey> keys, std::vector<Entry*>& held) { return hold(keys, held, false); }

size_t PrefixCache::pin(std::span<const CacheKey> keys, std::vector<Entry*>& pinned) { return hold(keys, pinned, true); }

size_t PrefixCache::hold(std::span<const CacheKey> keys, std::vector<Entry*>& out, bool pin) {
  size_t n = 0;
  for (const CacheKey& k : keys) {
    auto it = map_.find(k);
    if (it == map_.end()) break;
    Entry* e = it->second.get();
    ++e->refs;
    if (pin) ++e->snapshot_pins;
    else ++e->hits;  // a pin is not a hit
    touch(e);
    out.push_back(e);
    ++n;
  }
  return n;
}

void PrefixCache::unpin(std::vector<Entry*>& pinned) {
  for (Entry* e : pinned) --e->snapshot_pins;
  release(pinned);
}

void PrefixCache::release(std::vector<Entry*>& held, size_t keep) {
  for (size_t i = keep; i < held.size(); ++i) --held[i]->refs;
  held.resize(std::min(keep, held.size()));
}

kvcache::PrefixPages PrefixCache::pages(std::span<Entry* const> entries) const {
  kvcache::PrefixPages p;
  p.n_tokens = int64_t(entries.size()) * page_tokens_;
  if (entries.empty()) return p;
  p.streams.resize(entries[0]->pages.size());
  for (size_t s = 0; s < p.streams.size(); ++s) {
    p.streams[s].reserve(entries.size());
    for (Entry* e : entries) p.streams[s].push_back(e->pages[s]);
  }
  return p;
}

void PrefixCache::insert(const SequenceState& state, std::span<const CacheKey> keys) {
  const size_t n = std::min(keys.size(), size_t(state.pos() / page_tokens_));
  size_t k = 0;
  Entry* parent = nullptr;
  // Already cached pages need no copy of the state's page lists.
  for (; k < n; ++k) {
    auto it = map_.find(keys[k]);
    if (it == map_.end()) break;
    parent = it->second.get();
    touch(parent);
  }
  if (k == n) return trim();
  const kvcache::PrefixPages all = state.share_prefix(int64_t(n) * page_tokens_);
  for (; k < n; ++k) {
    auto e = std::make_unique<Entry>();
    e->key = keys[k];
    e->parent = parent;
    e->pages.reserve(all.streams.size());
    for (const auto& stream : all.streams) {
      e->pages.push_back(stream[k]);
      e->bytes += stream[k]->size();
    }
    if (parent) ++parent->children;
    bytes_ += e->bytes;
    Entry* raw = e.get();
    raw->lru = lru_.insert(lru_.end(), raw);
    raw->used = ++clock_;
    map_.emplace(keys[k], std::move(e));
    parent = raw;
  }
  trim();
}

void PrefixCache::touch(Entry* e) {
  lru_.splice(lru_.end(), lru_, e->lru);
  e->used = ++clock_;
}

void PrefixCache::insert_snapshot(const CacheKey& key, kvcache::PageRef snapshot, bool from_below) {
  auto it = map_.find(key);
  if (it == map_.end() || !snapshot) return;
  Entry* e = it->second.get();
  drop_snapshot(e);
  e->snapshot = std::move(snapshot);
  e->snapshot_written = from_below;
  snapshot_bytes_ += e->snapshot->size();
  e->snap_lru = snap_lru_.insert(snap_lru_.end(), e);
  e->snap_used = ++clock_;
  trim();
}

bool PrefixCache::has_snapshot(const CacheKey& key) const {
  auto it = map_.find(key);
  return it != map_.end() && it->second->snapshot;
}

size_t PrefixCache::find_snapshot(std::span<Entry* const> held, std::span<const std::byte>* snapshot) {
  for (size_t k = held.size(); k > 0; --k) {
    Entry* e = held[k - 1];
    if (!e->snapshot) continue;
    snap_lru_.splice(snap_lru_.end(), snap_lru_, e->snap_lru);
    e->snap_used = ++clock_;
    *snapshot = std::span<const std::byte>(e->snapshot->data(), e->snapshot->size());
    return k;
  }
  return 0;
}

bool PrefixCache::install(const CacheKey* parent_key, const CacheKey& key, std::vector<kvcache::PageRef> pages,
                          std::vector<Entry*>& pinned) {
  if (map_.count(key)) return pin(std::span(&key, 1), pinned) == 1;
  Entry* parent = nullptr;
  if (parent_key) {
    auto it = map_.find(*parent_key);
    if (it == map_.end()) return false;
    parent = it->second.get();
    ++parent->children;
  }
  auto e = std::make_unique<Entry>();
  e->key = key;
  e->parent = parent;
  e->pages = std::move(pages);
  for (const auto& p : e->pages) e->bytes += p->size();
  e->written = true;
  bytes_ += e->bytes;
  Entry* raw = e.get();
  raw->lru = lru_.insert(lru_.end(), raw);
  raw->used = ++clock_;
  map_.emplace(key, std::move(e));
  pin(std::span(&key, 1), pinned);
  trim();
  return true;
}

std::vector<PrefixCache::Unwritten> PrefixCache::take_unwritten(std::span<const CacheKey> keys, int min_hits) {
  std::vector<Unwritten> out;
  for (const CacheKey& k : keys) {
    auto it = map_.find(k);
    if (it == map_.end()) break;
    Entry* e = it->second.get();
    if (e->hits < min_hits) continue;
    Unwritten u{k, {}, nullptr};
    if (!e->written) u.pages = e->pages, e->written = true;
    if (e->snapshot && !e->snapshot_written) u.snapshot = e->snapshot, e->snapshot_written = true;
    if (!u.pages.empty() || u.snapshot) out.push_back(std::move(u));
  }
  return out;
}

void PrefixCache::drop_snapshot(Entry* e) {
  if (!e->snapshot) return;
  snapshot_bytes_ -= e->snapshot->size();
  snap_lru_.erase(e->snap_lru);
  e->snapshot.reset();
}

void PrefixCache::set_capacity(size_t bytes) {
  capacity_ = bytes;
  trim();
}

void PrefixCache::trim() {
  while (capacity_ && bytes() > capacity_)
    if (!evict_one()) return;
}

bool PrefixCache::evictable(const Entry& e) const { return e.refs == 0 && e.children == 0 && !e.shared(); }

size_t PrefixCache::reclaimable_bytes() const {
  // Entries held or shared by a live sequence form prefix-closed chains (a sequence holds or shares
  // every page before the ones it uses), so the rest can all be evicted, leaves first. Snapshots
  // are never held; pinned ones wait for their requests.
  size_t b = 0;
  for (const Entry* e : snap_lru_)
    if (e->snapshot_pins == 0) b += e->snapshot->size();
  for (const Entry* e : lru_)
    if (e->refs == 0 && !e->shared()) b += e->bytes;
  return b;
}

void PrefixCache::erase(Entry* e) {
  drop_snapshot(e);
  if (e->parent) --e->parent->children;
  bytes_ -= e->bytes;
  lru_.erase(e->lru);
  ++evictions_;
  map_.erase(e->key);  // destroys e; its pages go back to the pool
}

bool PrefixCache::evict_one() {
  Entry* page = nullptr;
  for (Entry* e : lru_)
    if (evictable(*e)) { page = e; break; }
  Entry* snap = nullptr;
  for (Entry* e : snap_lru_)
    if (e->snapshot_pins == 0) { snap = e; break; }
  if (snap && (!page || snap->snap_used < page->used)) {
    drop_snapshot(snap);
    ++snapshot_evictions_;
  } else if (page) {
    if (page->snapshot) ++snapshot_evictions_;
    erase(page);
  } else {
    return false;
  }
  return true;
}

bool PrefixCache::make_room(const kvcache::PagePool& pool, size_t bytes) {
  while (pool.free_bytes() < bytes)
    if (!evict_one()) return false;
  return true;
}

void PrefixCache::evict_all() {
  for (auto it = snap_lru_.begin(); it != snap_lru_.end();) {
    Entry* e = *it++;
    if (e->snapshot_pins > 0) continue;
    drop_snapshot(e);
    ++snapshot_evictions_;
  }
  for (bool progress = true; progress;) {
    progress = false;
    for (auto it = lru_.begin(); it != lru_.end();) {
      Entry* e = *it++;
      if (evictable(*e)) {
        // The iterator stays valid: erase removes only e's node, and e's parent is not removed here.
        erase(e);
        progress = true;
      }
    }
  }
}

}  // namespace di::engine
