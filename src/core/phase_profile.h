// Where a forward pass's wall time goes, by phase, on one thread: `deepinfer bench` turns it on
// around its timed samples. A scope adds its self time (nested scopes subtract theirs) to its
// phase. Off, or on another thread (pool workers, tasks), a scope costs one atomic load.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace di::phase {

// The id of a phase name, registered on first use (DI_PHASE keeps it in a call-site static).
int id(const char* name);

// on: clears the totals and records scopes run by the calling thread; off: stops recording.
void record(bool on);

struct Total {
  std::string name;
  int64_t calls = 0;
  double seconds = 0;  // self time
};
// Phases that ran since record(true), in order of registration.
std::vector<Total> totals();

class Scope {
 public:
  explicit Scope(int phase) { enter(phase); }
  ~Scope() { leave(); }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;
  // Ends the current phase (if any) and starts `phase`: consecutive phases of straight-line code.
  void next(int phase) {
    leave();
    enter(phase);
  }
  void end() { leave(); }

 private:
  void enter(int phase);
  void leave();
  int phase_ = -1;  // -1: not recording
};

}  // namespace di::phase

#define DI_PHASE_CAT2(a, b) a##b
#define DI_PHASE_CAT(a, b) DI_PHASE_CAT2(a, b)
// The id of phase `name` (a string literal), looked up once per call site.
#define DI_PHASE_ID(name) ([] { static const int id = ::di::phase::id(name); return id; }())
// Times the rest of the enclosing block as phase `name`.
#define DI_PHASE(name) const ::di::phase::Scope DI_PHASE_CAT(di_phase_scope_, __LINE__)(DI_PHASE_ID(name))
