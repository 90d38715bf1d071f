#include "engine/disk_cache.h"

#include <spdlog/spdlog.h>

#include <cstring>

namespace di::engine {

bool DiskCache::Fetch::ready() const {
  auto done = [](const std::future<Blob>& f) {
    return !f.valid() || f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  };
  for (const auto& p : pages)
    if (!done(p)) return false;
  return done(snapshot);
}

void DiskCache::Fetch::wait_until(Clock::time_point t) const {
  for (const auto& p : pages)
    if (p.valid() && p.wait_until(t) != std::future_status::ready) return;
  if (snapshot.valid()) snapshot.wait_until(t);
}

DiskCache::DiskCache(kvcache::DiskTierOptions opts, std::vector<kvcache::StreamLayout> layout, int write_min_hits)
    : tier_(std::move(opts)), layout_(std::move(layout)), write_min_hits_(write_min_hits) {
  for (const auto& s : layout_) entry_bytes_ += s.page_bytes();
}

CacheKey DiskCache::snapshot_key(const CacheKey& page_key) {
  Sha256 h;
  h.update(page_key.data(), page_key.size());
  const char tag[] = "snapshot";
  h.update(tag, sizeof tag - 1);
  return h.finish();
}

void DiskCache::write_through(PrefixCache& ram, std::span<const CacheKey> keys) {
  for (auto& u : ram.take_unwritten(keys, write_min_hits_)) {
    if (!u.pages.empty()) {
      std::vector<std::span<const std::byte>> parts;
      for (const auto& p : u.pages) parts.emplace_back(p->data(), p->size());
      auto owner = std::make_shared<std::vector<kvcache::PageRef>>(std::move(u.pages));
      tier_.write_async(u.key, std::move(parts), std::move(owner));
    }
    if (u.snapshot) {
      std::vector<std::span<const std::byte>> parts{{u.snapshot->data(), u.snapshot->size()}};
      tier_.write_async(snapshot_key(u.key), std::move(parts), u.snapshot);
    }
  }
}

std::unique_ptr<DiskCache::Fetch> DiskCache::start_fetch(const PrefixCache& ram, std::span<const CacheKey> keys,
                                                         bool snapshots, Clock::duration timeout) {
  size_t in_ram = 0;
  while (in_ram < keys.size() && ram.contains(keys[in_ram])) ++in_ram;
  size_t on_disk = in_ram;
  while (on_disk < keys.size() && tier_.contains(keys[on_disk])) ++on_disk;
  // The furthest snapshot either tier has; a RAM one needs no read.
  size_t snap = 0;
  if (snapshots)
    for (size_t k = on_disk; k > 0 && snap == 0; --k) {
      if (k <= in_ram && ram.has_snapshot(keys[k - 1])) break;
      if (tier_.contains(snapshot_key(keys[k - 1]))) snap = k;
    }
  if (on_disk == in_ram && snap == 0) return nullptr;
  auto f = std::make_unique<Fetch>();
  f->first_page = in_ram;
  f->deadline = Clock::now() + timeout;
  // With a snapshot the pages after it are recomputed anyway: read only up to it.
  const size_t last = snap > 0 ? std::max(snap, in_ram) : on_disk;
  for (size_t k = in_ram; k < last; ++k) f->pages.push_back(tier_.read_blob_async(keys[k]));
  if (snap > 0) {
    f->snapshot = tier_.read_blob_async(snapshot_key(keys[snap - 1]));
    f->snapshot_pages = snap;
  }
  return f;
}

size_t DiskCache::install(Fetch& f, std::span<const CacheKey> keys, PrefixCache& ram, kvcache::PagePool& pool,
                          std::vector<PrefixCache::Entry*>& pinned) {
  size_t added = 0;
  // The pages read continue the part that was in RAM, pinned since the fetch started.
  if (pinned.size() < f.first_page) return 0;
  auto take = [](std::future<Blob>& fut) -> Blob {
    if (!fut.valid() || fut.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return std::nullopt;
    return fut.get();
  };
  auto alloc = [&](size_t bytes) -> kvcache::PageRef {
    if (!ram.make_room(pool, bytes)) return nullptr;
    try {
      return pool.allocate(bytes);
    } catch (const kvcache::CacheExhausted&) {
      return nullptr;
    }
  };
  size_t k = f.first_page;
  for (auto& fut : f.pages) {
    Blob b = take(fut);
    if (!b || b->size() != entry_bytes_) break;
    std::vector<kvcache::PageRef> pages;
    const std::byte* src = b->data();
    for (const auto& s : layout_) {
      kvcache::PageRef p = alloc(s.page_bytes());
      if (!p) break;
      std::memcpy(p->data(), src, s.page_bytes());
      src += s.page_bytes();
      pages.push_back(std::move(p));
    }
    if (pages.size() != layout_.size() || !ram.install(k > 0 ? &keys[k - 1] : nullptr, keys[k], std::move(pages), pinned))
      break;
    ++k;
    ++added;
  }
  pages_read_ += int64_t(added);
  if (f.snapshot_pages > 0 && f.snapshot_pages <= k) {
    if (Blob b = take(f.snapshot); b && !b->empty()) {
      if (kvcache::PageRef p = alloc(b->size())) {
        std::memcpy(p->data(), b->data(), b->size());
        ram.insert_snapshot(keys[f.snapshot_pages - 1], std::move(p), /*from_below=*/true);
        ++snapshots_read_;
      }
    }
  }
  return added;
}

}  // namespace di::engine
