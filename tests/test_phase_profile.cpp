#include "core/phase_profile.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

namespace {

using di::phase::Total;

void busy(double ms) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double, std::milli>(ms);
  while (std::chrono::steady_clock::now() < end) {
  }
}

const Total* find(const std::vector<Total>& t, const std::string& name) {
  for (const auto& x : t)
    if (x.name == name) return &x;
  return nullptr;
}

TEST(PhaseProfile, SameNameSameId) {
  EXPECT_EQ(di::phase::id("test.same"), di::phase::id("test.same"));
  EXPECT_NE(di::phase::id("test.same"), di::phase::id("test.other"));
}

TEST(PhaseProfile, OffRecordsNothing) {
  di::phase::record(true);
  di::phase::record(false);
  { DI_PHASE("test.off"); busy(1); }
  EXPECT_EQ(find(di::phase::totals(), "test.off"), nullptr);
}

TEST(PhaseProfile, NestedScopesCountSelfTime) {
  di::phase::record(true);
  const auto t0 = std::chrono::steady_clock::now();
  {
    DI_PHASE("test.outer");
    busy(4);
    for (int i = 0; i < 2; ++i) {
      DI_PHASE("test.inner");
      busy(3);
    }
  }
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  di::phase::record(false);
  const auto t = di::phase::totals();
  const Total* outer = find(t, "test.outer");
  const Total* inner = find(t, "test.inner");
  ASSERT_NE(outer, nullptr);
  ASSERT_NE(inner, nullptr);
  EXPECT_EQ(outer->calls, 1);
  EXPECT_EQ(inner->calls, 2);
  EXPECT_GE(inner->seconds, 0.006);
  EXPECT_GE(outer->seconds, 0.004);
  // Self times partition the wall time: the inner time is not counted again in the outer.
  EXPECT_LE(outer->seconds + inner->seconds, wall + 1e-6);
  EXPECT_LT(outer->seconds, 0.004 + (wall - 0.010) + 1e-6);
}

TEST(PhaseProfile, NextSplitsStraightLineCode) {
  di::phase::record(true);
  double scoped = 0;  // wall time from before the scope to its end(): bounds the recorded time
  {
    const auto t0 = std::chrono::steady_clock::now();
    di::phase::Scope s(DI_PHASE_ID("test.first"));
    busy(2);
    s.next(DI_PHASE_ID("test.second"));
    busy(3);
    s.next(DI_PHASE_ID("test.first"));  // a phase may recur
    busy(2);
    s.end();
    scoped = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    busy(1);  // outside any phase
  }
  di::phase::record(false);
  const auto t = di::phase::totals();
  const Total* first = find(t, "test.first");
  const Total* second = find(t, "test.second");
  ASSERT_NE(first, nullptr);
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(first->calls, 2);
  EXPECT_EQ(second->calls, 1);
  EXPECT_GE(first->seconds, 0.004);
  EXPECT_GE(second->seconds, 0.003);
  // The second phase is not counted again in the first, nor the untimed 1 ms in either: compared
  // with the measured wall time, not a fixed figure, so a preempted busy loop cannot fail it.
  EXPECT_LE(first->seconds + second->seconds, scoped + 1e-6);
}

TEST(PhaseProfile, OnlyTheRecordingThreadCounts) {
  di::phase::record(true);
  std::thread other([] {
    DI_PHASE("test.other thread");
    busy(2);
  });
  other.join();
  { DI_PHASE("test.this thread"); busy(1); }
  di::phase::record(false);
  const auto t = di::phase::totals();
  EXPECT_EQ(find(t, "test.other thread"), nullptr);
  ASSERT_NE(find(t, "test.this thread"), nullptr);
}

TEST(PhaseProfile, RecordClearsTheTotals) {
  di::phase::record(true);
  { DI_PHASE("test.cleared"); busy(1); }
  di::phase::record(false);
  ASSERT_NE(find(di::phase::totals(), "test.cleared"), nullptr);
  di::phase::record(true);
  di::phase::record(false);
  EXPECT_EQ(find(di::phase::totals(), "test.cleared"), nullptr);
}

}  // namespace
