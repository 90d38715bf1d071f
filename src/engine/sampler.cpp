#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace di::engine {
namespace {

uint64_t mix64(uint64_t x) {  // splitmix64 finalizer: a bijection with full avalanche
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

uint64_t choice_stream_key(uint64_t seed, int choice) { return mix64(mix64(seed) ^ mix64(0x5eed0000ull + uint64_t(choice))); }

double stream_uniform(uint64_t key, int64_t step) {
  const uint64_t r = mix64(key ^ mix64(uint64_t(step) * 0xd1b54a32d192ed03ull));
  return double(r >> 11) * 0x1.0p-53;
}

TokenSampler::TokenSampler(int64_t vocab_size)
    : vocab_(vocab_size), z_(size_t(vocab_size)), e_(size_t(vocab_size)), order_(size_t(vocab_size)),
      counts_(size_t(vocab_size), 0), seen_(size_t(vocab_size), 0) {}

void TokenSampler::apply_penalties(const SampleInput& in) {
  const SamplingParams& p = *in.params;
  for (const auto& [tok, bias] : p.logit_bias) z_[size_t(tok)] += bias;
  if (p.repetition_penalty != 1.0f) {
    const float r = p.repetition_penalty;
    auto penalize = [&](std::span<const int32_t> toks) {
      for (int32_t t : toks) {
        if (seen_[size_t(t)]) continue;
        seen_[size_t(t)] = 1;
        float& z = z_[size_t(t)];
        z = z > 0 ? z / r : z * r;
      }
    };
    penalize(in.prompt);
    penalize(in.output);
    for (int32_t t : in.prompt) seen_[size_t(t)] = 0;
    for (int32_t t : in.output) seen_[size_t(t)] = 0;
  }
  if (p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f) {
    for (int32_t t : in.output) ++counts_[size_t(t)];
    for (int32_t t : in.output) {
      int32_t& c = counts_[size_t(t)];
      if (c == 0) continue;  // already applied
      z_[size_t(t)] -= float(c) * p.frequency_penalty + p.presence_penalty;
      c = 0;
    }
  }
}

void TokenSampler::apply_mask(std::span<const uint32_t> mask) {
  const size_t V = size_t(vocab_);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (size_t w = 0; w < mask.size() && w * 32 < V; ++w) {
    const uint32_t bits = mask[w];
    if (bits == 0xffffffffu) continue;
    const size_t end = std::min(V, w * 32 + 32);
    for (size_t i = w * 32; i < end; ++i)
      if (!(bits >> (i - w * 32) & 1u)) z_[i] = ninf;
  }
  for (size_t i = mask.size() * 32; i < V; ++i) z_[i] = ninf;
}

SampleResult TokenSampler::sample(const float* logits, const SampleInput& in, std::vector<TokenLogprob>* top) {
  const SamplingParams& p = *in.params;
  const size_t V = size_t(vocab_);
  std::copy(logits, logits + V, z_.begin());
  apply_penalties(in);
  const bool greedy = p.temperature <= 0.0f;
  if (!greedy && p.temperature != 1.0f)
    for (size_t i = 0; i < V; ++i) z_[i] /= p.temperature;
  const bool masked = !in.mask.empty();
  if (masked) apply_mask(in.mask);

  size_t best = 0;
  for (size_t i = 1; i < V; ++i)
    if (z_[i] > z_[best]) best = i;
  max_z_ = z_[best];
  const bool want_logprobs = in.top_logprobs > 0 || top != nullptr;
  SampleResult r;
  if (greedy && !want_logprobs) {
    r.token = int32_t(best);
    return r;
  }
  double sum = 0;
  const float m = float(max_z_);
  for (size_t i = 0; i < V; ++i) {
    const float e = std::exp(z_[i] - m);
    e_[i] = e;
    sum += e;
  }
  sum_e_ = sum;
  r.token = greedy ? int32_t(best) : draw(p, stream_uniform(in.stream_key, in.step));
  // A draw that rounding left on a zero-probability candidate must not pick a masked token.
  if (masked && std::isinf(z_[size_t(r.token)])) r.token = int32_t(best);
  const double log_sum = std::log(sum_e_);
  auto logprob = [&](size_t i) { return float(double(z_[i]) - max_z_ - log_sum); };
  r.logprob = logprob(size_t(r.token));
  if (top) {
    top->clear();
    const size_t n = std::min<size_t>(size_t(std::max(0, in.top_logprobs)), V);
    // Insertion into a short sorted list: the list is at most 20 long and rarely changes.
    auto better = [&](size_t a, size_t b) { return z_[a] > z_[b] || (z_[a] == z_[b] && a < b); };
    if (n > 0) {
      for (size_t i = 0; i < V; ++i) {
        if (masked && std::isinf(z_[i])) continue;  // not allowed: no alternative
        if (top->size() == n && !better(i, size_t(top->back().token))) continue;
        if (top->size() == n) top->pop_back();
        auto it = top->end();
        while (it != top->begin() && better(i, size_t((it - 1)->token))) --it;
        top->insert(it, TokenLogprob{int32_t(i), 0.0f});
      }
      for (auto& t : *top) t.logprob = logprob(size_t(t.token));
    }
  }
  return r;
}

int32_t TokenSampler::draw(const SamplingParams& p, double u) {
  const size_t V = size_t(vocab_);
  // e_ of the most likely token is exactly 1, so min_p's threshold is min_p itself.
  const float min_e = p.min_p;
  const size_t k = p.top_k > 0 ? std::min(size_t(p.top_k), V) : V;
  const bool sorted = k < V || p.top_p < 1.0f;
  if (!sorted) {
    double total = 0;
    for (size_t i = 0; i < V; ++i)
      if (e_[i] >= min_e) total += e_[i];
    const double target = u * total;
    double acc = 0;
    int32_t last = 0;
    for (size_t i = 0; i < V; ++i) {
      if (e_[i] < min_e || e_[i] == 0.0f) continue;
      acc += e_[i];
      last = int32_t(i);
      if (acc > target) return last;
    }
    return last;  // rounding left the target at the very end
  }
  std::iota(order_.begin(), order_.end(), 0);
  auto better = [&](int32_t a, int32_t b) { return z_[size_t(a)] > z_[size_t(b)] || (z_[size_t(a)] == z_[size_t(b)] && a < b); };
  double total_k = sum_e_;
  if (k < V) {
    std::nth_element(order_.begin(), order_.begin() + std::ptrdiff_t(k), order_.end(), better);
    total_k = 0;
    for (size_t i = 0; i < k; ++i) total_k += e_[size_t(order_[i])];
  }
  // Sort just enough of the top-k to cover the top_p mass: select the next block of best tokens
  // (linear time), sort only that block, and grow the block size if the mass is not reached.
  size_t keep = k;
  if (p.top_p < 1.0f) {
    const double mass = double(p.top_p) * total_k;
    double acc = 0;
    size_t done = 0, block = 64;
    for (;;) {
      const size_t end = std::min(k, done + block);
      auto first = order_.begin() + std::ptrdiff_t(done), last = order_.begin() + std::ptrdiff_t(end);
      if (end < k) std::nth_element(first, last, order_.begin() + std::ptrdiff_t(k), better);
      std::sort(first, last, better);
      size_t i = done;
      while (i < end && acc < mass) acc += e_[size_t(order_[i++])];
      if (acc >= mass || end == k) {
        keep = std::max<size_t>(i, 1);
        break;
      }
      done = end;
      block *= 8;
    }
  } else {
    std::sort(order_.begin(), order_.begin() + std::ptrdiff_t(k), better);
  }
  // min_p on the sorted candidates: everything after the first token below the threshold goes.
  size_t n = 1;
  while (n < keep && e_[size_t(order_[n])] >= min_e) ++n;
  double total = 0;
  for (size_t i = 0; i < n; ++i) total += e_[size_t(order_[i])];
  const double target = u * total;
  double acc = 0;
  for (size_t i = 0; i < n; ++i) {
    acc += e_[size_t(order_[i])];
    if (acc > target) return order_[i];
  }
  return order_[n - 1];
}

}  // namespace di::engine
