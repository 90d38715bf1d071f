#include "model/v41/state.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>

#include "core/dtypes.h"

namespace di::v41 {

SequenceState::SequenceState(const V41Config& cfg, int max_rollback, int page_tokens, PagePool* pool, PagePool* state_pool)
    : max_rollback_(max_rollback),
      window_(cfg.window_size),
      window_cap_(cfg.window_size + max_rollback),
      comp_cap_(0),
      page_tokens_(page_tokens),
      head_dim_(cfg.head_dim),
      pool_(pool) {
  int max_ratio = 1;
  for (int i = 0; i < cfg.n_layers; ++i) {
    max_ratio = std::max(max_ratio, cfg.compress_ratio(i));
    if (cfg.compress_ratio(i) > 0 && page_tokens % cfg.compress_ratio(i) != 0)
      throw std::invalid_argument("page size " + std::to_string(page_tokens) + " is not a multiple of compress ratio " +
                                  std::to_string(cfg.compress_ratio(i)));
  }
  comp_cap_ = max_ratio + max_rollback;
  layers_.resize(size_t(cfg.n_layers));
  for (int i = 0; i < cfg.n_layers; ++i) {
    auto& L = layers_[size_t(i)];
    L.window.assign(size_t(window_cap_) * size_t(cfg.head_dim), 0.f);
    ratios_.push_back(cfg.compress_ratio(i));
    if (cfg.is_kv_source(i)) {
      if (cfg.compress_ratio(i) > 1) L.comp_inputs.assign(size_t(comp_cap_) * 2 * size_t(cfg.head_dim), 0.f);
      const int rows_per_page = page_tokens / cfg.compress_ratio(i);
      L.compressed_kv = RowCache(size_t(cfg.head_dim) * sizeof(float), rows_per_page, pool);
      L.index_keys = RowCache(size_t(cfg.index_head_dim) * sizeof(float), rows_per_page, pool);
    }
  }
  fixed_ = PoolReservation(state_pool, fixed_bytes());
}

void SequenceState::truncate(int64_t p) {
  if (p > pos() || p < pos() - max_rollback_ || p < rollback_floor_)
    throw std::out_of_range("SequenceState::truncate to " + std::to_string(p) + ": position " + std::to_string(pos()) +
                            ", rollback limit " + std::to_string(max_rollback_));
  // The window ring and compressor inputs are indexed by absolute position with room for
  // max_rollback extra positions, so the rows for positions < p are still intact.
  for (size_t i = 0; i < layers_.size(); ++i) {
    auto& L = layers_[i];
    if (L.compressed_kv.empty_layout()) continue;
    const int64_t keep = p / ratios_[i];  // groups completed before p
    L.compressed_kv.truncate(keep);
    L.index_keys.truncate(keep);
  }
  tokens_.resize(size_t(p));
  index_k_publisher = -1;
}

size_t SequenceState::bytes_needed(int64_t n_tokens) const {
  size_t b = 0;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const auto& L = layers_[i];
    if (L.compressed_kv.empty_layout()) continue;
    const int64_t rows = (pos() + n_tokens) / ratios_[i] - pos() / ratios_[i];
    b += L.compressed_kv.bytes_needed(rows) + L.index_keys.bytes_needed(rows);
  }
  return b;
}

PrefixPages SequenceState::share_prefix(int64_t n_tokens) const {
  if (n_tokens % page_tokens_ != 0 || n_tokens > pos())
    throw std::invalid_argument("share_prefix: " + std::to_string(n_tokens) + " tokens is not a whole number of " +
                                std::to_string(page_tokens_) + "-token pages within " + std::to_string(pos()));
  PrefixPages p;
  p.n_tokens = n_tokens;
  const size_t n_pages = size_t(n_tokens / page_tokens_);
  for (const auto& L : layers_) {
    if (L.compressed_kv.empty_layout()) continue;
    p.streams.push_back(L.compressed_kv.share_pages(n_pages));
    p.streams.push_back(L.index_keys.share_pages(n_pages));
  }
  return p;
}

void SequenceState::adopt_prefix(const PrefixPages& pages, std::span<const int32_t> tokens) {
  if (pos() != 0) throw std::logic_error("adopt_prefix: the state is not empty");
  size_t streams = 0;
  for (const auto& L : layers_) streams += L.compressed_kv.empty_layout() ? 0 : 2;
  if (int64_t(tokens.size()) != pages.n_tokens || pages.streams.size() != streams)
    throw std::invalid_argument("adopt_prefix: pages do not match the tokens or the model");
  size_t s = 0;
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (layers_[i].compressed_kv.empty_layout()) continue;
    const int64_t rows = pages.n_tokens / ratios_[i];
    layers_[i].compressed_kv.adopt(pages.streams[s++], rows);
    layers_[i].index_keys.adopt(pages.streams[s++], rows);
  }
  tokens_.assign(tokens.begin(), tokens.end());
  rollback_floor_ = pages.n_tokens;  // the window rings only get the prefix's last window back
}

namespace {

constexpr uint32_t kSnapshotMagic = 0x53313456;  // "V41S"
constexpr uint32_t kSnapshotVersion = 1;

struct SnapshotHeader {
  uint32_t magic, version;
  int64_t pos;
  int32_t index_k_publisher;
  uint32_t n_layers, rows, head_dim;
  uint32_t bf16;  // 1: rows stored as bf16 (every value was one exactly), 0: fp32
  uint32_t reserved;
};
static_assert(sizeof(SnapshotHeader) == 40);

}  // namespace

std::vector<std::byte> SequenceState::snapshot() const {
  if (pos() % page_tokens_ != 0)
    throw std::invalid_argument("snapshot: position " + std::to_string(pos()) + " is not at a page boundary");
  SnapshotHeader h{kSnapshotMagic, kSnapshotVersion, pos(), index_k_publisher, uint32_t(layers_.size()),
                   uint32_t(std::min<int64_t>(pos(), window_ - 1)), uint32_t(head_dim_), 1, 0};
  const int64_t p0 = pos() - h.rows;
  auto row = [&](const LayerState& L, int64_t p) { return L.window.data() + size_t(p % window_cap_) * size_t(head_dim_); };
  for (const auto& L : layers_)
    for (int64_t p = p0; p < pos() && h.bf16; ++p)
      for (int d = 0; d < head_dim_; ++d)
        if (f32_bits(row(L, p)[d]) & 0xffffu) { h.bf16 = 0; break; }
  const size_t elem = h.bf16 ? sizeof(uint16_t) : sizeof(float);
  std::vector<std::byte> out(sizeof h + layers_.size() * h.rows * size_t(head_dim_) * elem);
  std::memcpy(out.data(), &h, sizeof h);
  std::byte* w = out.data() + sizeof h;
  for (const auto& L : layers_)
    for (int64_t p = p0; p < pos(); ++p) {
      const float* r = row(L, p);
      if (h.bf16) {
        for (int d = 0; d < head_dim_; ++d, w += 2) {
          const uint16_t b = uint16_t(f32_bits(r[d]) >> 16);
          std::memcpy(w, &b, 2);
        }
      } else {
        std::memcpy(w, r, size_t(head_dim_) * sizeof(float));
        w += size_t(head_dim_) * sizeof(float);
      }
    }
  return out;
}

void SequenceState::restore_snapshot(const PrefixPages& pages, std::span<const int32_t> tokens,
                                     std::span<const std::byte> snap) {
  SnapshotHeader h{};
  if (snap.size() >= sizeof h) std::memcpy(&h, snap.data(), sizeof h);
  const int64_t n = int64_t(tokens.size());
  const size_t elem = h.bf16 ? sizeof(uint16_t) : sizeof(float);
  if (snap.size() < sizeof h || h.magic != kSnapshotMagic || h.version != kSnapshotVersion || h.pos != n ||
      h.n_layers != layers_.size() || h.head_dim != uint32_t(head_dim_) || h.bf16 > 1 ||
      int64_t(h.rows) != std::min<int64_t>(n, window_ - 1) ||
      snap.size() != sizeof h + layers_.size() * h.rows * size_t(head_dim_) * elem)
    throw std::invalid_argument("restore_snapshot: the snapshot does not belong to this model or these tokens");
  if (n % page_tokens_ != 0 || pages.n_tokens != n)
    throw std::invalid_argument("restore_snapshot: the pages do not cover the snapshot's tokens");
  adopt_prefix(pages, tokens);
  const std::byte* r = snap.data() + sizeof h;
  for (auto& L : layers_)
    for (int64_t p = n - h.rows; p < n; ++p) {
      float* dst = L.window.data() + size_t(p % window_cap_) * size_t(head_dim_);
      if (h.bf16) {
        for (int d = 0; d < head_dim_; ++d, r += 2) {
          uint16_t b;
          std::memcpy(&b, r, 2);
          dst[d] = bf16_to_f32(b);
        }
      } else {
        std::memcpy(dst, r, size_t(head_dim_) * sizeof(float));
        r += size_t(head_dim_) * sizeof(float);
      }
    }
  index_k_publisher = h.index_k_publisher;
}

size_t SequenceState::fixed_bytes() const {
  size_t b = 0;
  for (const auto& L : layers_) b += (L.window.size() + L.comp_inputs.size()) * sizeof(float);
  return b;
}

size_t SequenceState::bytes() const {
  size_t b = tokens_.size() * sizeof(int32_t);
  for (const auto& L : layers_)
    b += (L.window.size() + L.comp_inputs.size()) * sizeof(float) + L.compressed_kv.bytes() + L.index_keys.bytes();
  return b;
}

}  // namespace di::v41
