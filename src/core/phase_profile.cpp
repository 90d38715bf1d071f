#include "core/phase_profile.h"

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace di::phase {

namespace {
constexpr int kMaxPhases = 64, kMaxDepth = 16;

std::mutex g_names_mu;
std::array<const char*, kMaxPhases> g_names{};
std::atomic<int> g_n_names{0};

// Written by record() before g_on is set (release), read by scopes after they see it (acquire).
std::atomic<bool> g_on{false};
std::thread::id g_thread;
std::array<int64_t, kMaxPhases> g_calls{};
std::array<int64_t, kMaxPhases> g_ns{};

struct Frame {
  int64_t start_ns = 0, child_ns = 0;
};
thread_local Frame t_stack[kMaxDepth];
thread_local int t_depth = 0;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

int id(const char* name) {
  std::lock_guard<std::mutex> lk(g_names_mu);
  const int n = g_n_names.load(std::memory_order_relaxed);
  for (int i = 0; i < n; ++i)
    if (std::strcmp(g_names[size_t(i)], name) == 0) return i;
  if (n == kMaxPhases) throw std::logic_error("phase::id: more than 64 phase names");
  g_names[size_t(n)] = name;
  g_n_names.store(n + 1, std::memory_order_release);
  return n;
}

void record(bool on) {
  if (!on) {
    g_on.store(false, std::memory_order_release);
    return;
  }
  g_on.store(false, std::memory_order_release);  // scopes starting while the totals are reset stay off
  g_calls.fill(0);
  g_ns.fill(0);
  g_thread = std::this_thread::get_id();
  g_on.store(true, std::memory_order_release);
}

std::vector<Total> totals() {
  std::vector<Total> out;
  const int n = g_n_names.load(std::memory_order_acquire);
  for (int i = 0; i < n; ++i)
    if (g_calls[size_t(i)] > 0) out.push_back({g_names[size_t(i)], g_calls[size_t(i)], double(g_ns[size_t(i)]) * 1e-9});
  return out;
}

void Scope::enter(int phase) {
  if (!g_on.load(std::memory_order_acquire) || std::this_thread::get_id() != g_thread || t_depth == kMaxDepth) return;
  phase_ = phase;
  t_stack[t_depth++] = {now_ns(), 0};
}

void Scope::leave() {
  if (phase_ < 0) return;
  const Frame f = t_stack[--t_depth];
  const int64_t elapsed = now_ns() - f.start_ns;
  g_ns[size_t(phase_)] += elapsed - f.child_ns;
  ++g_calls[size_t(phase_)];
  if (t_depth > 0) t_stack[t_depth - 1].child_ns += elapsed;
  phase_ = -1;
}

}  // namespace di::phase
