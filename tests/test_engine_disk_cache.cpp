// The engine with a disk tier (engine/disk_cache.h over kvcache::DiskTier), against the fake
// model: entries written by one engine serve another one started later on the same directory
// (a restart), snapshots included; damaged or foreign entries are misses; flushing empties it.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <vector>

#include "engine/disk_cache.h"
#include "engine/scheduler.h"
#include "fake_model.h"
#include "test_engine_util.h"

using namespace di;
using namespace di::engine;
using di::test::FakeModel;
using di::test::prompt_of;
using di::test::Recorder;
namespace fs = std::filesystem;

namespace {

class EngineDiskCache : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("di-disk-cache-" + std::to_string(::getpid()) + "-" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  EngineOptions options() const {
    EngineOptions o = test::fake_engine_options();
    o.cache_dir = dir_.string();
    return o;
  }

  std::vector<fs::path> entry_files() const {
    std::vector<fs::path> out;
    for (const auto& e : fs::recursive_directory_iterator(dir_))
      if (e.is_regular_file() && e.path().extension() == ".kv") out.push_back(e.path());
    return out;
  }

  // Runs one request; returns its recorder.
  static std::shared_ptr<Recorder> run(Scheduler& s, uint64_t id, const std::vector<int32_t>& prompt, int n) {
    auto r = std::make_shared<Recorder>();
    s.add(id, test::greedy_request(prompt, n), r, 1);
    test::run_all(s);
    return r;
  }

  fs::path dir_;
};

TEST_F(EngineDiskCache, AnEngineStartedLaterOnTheDirectoryResumesFromItsEntries) {
  FakeModel m(4096, /*snapshots=*/true);
  const auto p1 = prompt_of(41, 3);
  std::vector<int32_t> first;
  {
    Scheduler a(m, options());
    first = run(a, 1, p1, 12)->tokens[0];
    a.disk()->tier().flush();
    EXPECT_GT(a.disk()->tier().stats().writes, 0u);
  }
  ASSERT_FALSE(entry_files().empty());
  // A new engine (empty RAM tier) on the same directory: the next turn of the conversation.
  Scheduler b(m, options());
  auto turn = p1;
  turn.insert(turn.end(), first.begin(), first.end());
  turn.insert(turn.end(), {20, 21});
  const int64_t restores = FakeModel::State::restores, resumes = m.resumes;
  auto r = run(b, 2, turn, 6);
  EXPECT_EQ(r->start.cached_tokens, 48) << "pages and the snapshot at the completion's last page boundary";
  EXPECT_EQ(b.disk()->pages_read(), 6);
  EXPECT_EQ(b.disk()->snapshots_read(), 1);
  EXPECT_EQ(FakeModel::State::restores, restores + 1);
  EXPECT_EQ(m.resumes, resumes);
  EXPECT_EQ(r->tokens[0], FakeModel::greedy(turn, 6));
  EXPECT_GT(b.disk()->tier().stats().hits, 0u);
}

TEST_F(EngineDiskCache, WithoutSnapshotsTheDiskPagesAreResumedByReplay) {
  FakeModel m;  // no snapshots
  const auto p = prompt_of(50, 4);
  {
    Scheduler a(m, options());
    run(a, 1, p, 3);
    a.disk()->tier().flush();
  }
  Scheduler b(m, options());
  auto q = p;
  q.push_back(5);
  const int64_t resumes = m.resumes;
  auto r = run(b, 2, q, 4);
  EXPECT_EQ(r->start.cached_tokens, 48);
  EXPECT_EQ(m.resumes, resumes + 1);
  EXPECT_EQ(r->tokens[0], FakeModel::greedy(q, 4));
}

TEST_F(EngineDiskCache, DamagedEntriesAreMissesAndAreRemoved) {
  FakeModel m(4096, true);
  const auto p = prompt_of(60, 5);
  {
    Scheduler a(m, options());
    run(a, 1, p, 2);
    a.disk()->tier().flush();
  }
  const auto files = entry_files();
  ASSERT_FALSE(files.empty());
  for (const auto& f : files) {
    // Flip the payload's last byte: the header still names the key, the checksum no longer fits.
    std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(-1, std::ios::end);
    char c;
    io.get(c);
    io.seekp(-1, std::ios::end);
    io.put(char(c ^ 0x40));
  }
  Scheduler b(m, options());
  auto r = run(b, 2, p, 4);
  EXPECT_EQ(r->start.cached_tokens, 0);
  EXPECT_EQ(r->tokens[0], FakeModel::greedy(p, 4));
  EXPECT_GT(b.disk()->tier().stats().corrupt_removed, 0u);
}

TEST_F(EngineDiskCache, AnotherModelsEntriesAreNeverUsed) {
  FakeModel m(4096, true), other(4096, true);
  other.set_cache_format("fake;history-rows;other-numerics");
  const auto p = prompt_of(60, 6);
  {
    Scheduler a(m, options());
    run(a, 1, p, 2);
    a.disk()->tier().flush();
  }
  Scheduler b(other, options());
  auto r = run(b, 2, p, 4);
  EXPECT_EQ(r->start.cached_tokens, 0);
  EXPECT_EQ(b.disk()->pages_read(), 0);
  EXPECT_EQ(r->tokens[0], FakeModel::greedy(p, 4));
}

TEST_F(EngineDiskCache, TwoEnginesShareOneDirectoryAtOnce) {
  FakeModel m(4096, true);
  Scheduler a(m, options()), b(m, options());
  const auto p = prompt_of(70, 7);
  run(a, 1, p, 2);
  a.disk()->tier().flush();
  auto q = p;
  q.insert(q.end(), {3, 4, 5});
  auto r = run(b, 1, q, 3);
  EXPECT_EQ(r->start.cached_tokens, 64);
  EXPECT_EQ(r->tokens[0], FakeModel::greedy(q, 3));
  // And back: b's entries (the longer prompt's) serve a.
  b.disk()->tier().flush();
  a.prefix_cache().evict_all();
  auto q2 = q;
  q2.insert(q2.end(), {6, 7, 8, 9, 10, 11, 12, 13});
  auto r2 = run(a, 2, q2, 3);
  EXPECT_EQ(r2->start.cached_tokens, 72);
  EXPECT_EQ(r2->tokens[0], FakeModel::greedy(q2, 3));
}

TEST_F(EngineDiskCache, ReadsForWaitingRequestsSurviveASmallRamTier) {
  // Four requests arrive at once, each with a prefix on disk; the RAM tier holds about one page.
  // What each one's reads brought in stays until it is admitted (the others' reads would evict it).
  FakeModel m(4096, true);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 4; ++i) prompts.push_back(prompt_of(48, 20 + i));
  {
    Scheduler a(m, options());
    for (size_t i = 0; i < prompts.size(); ++i) run(a, i + 1, prompts[i], 2);
    a.disk()->tier().flush();
  }
  EngineOptions o = options();
  o.prefix_cache_bytes = 80;  // one 8-token page of the fake model's 8-byte rows, and a snapshot
  Scheduler b(m, o);
  std::vector<std::shared_ptr<Recorder>> rec;
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto q = prompts[i];
    q.push_back(3);
    rec.push_back(std::make_shared<Recorder>());
    b.add(i + 1, test::greedy_request(q, 3), rec.back(), 1);
  }
  test::run_all(b);
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto q = prompts[i];
    q.push_back(3);
    EXPECT_EQ(rec[i]->start.cached_tokens, 48) << i;
    EXPECT_EQ(rec[i]->tokens[0], FakeModel::greedy(q, 3)) << i;
  }
  EXPECT_EQ(b.counters().snapshot_hits, 4);
  b.prefix_cache().evict_all();
  EXPECT_EQ(b.pool().used_bytes(), 0u) << "no pin outlives its request";
}

TEST_F(EngineDiskCache, APrefetchPastItsTimeoutProceedsWithWhatArrived) {
  FakeModel m(4096, true);
  const auto p = prompt_of(80, 8);
  {
    Scheduler a(m, options());
    run(a, 1, p, 2);
    a.disk()->tier().flush();
  }
  EngineOptions o = options();
  o.disk_prefetch_timeout = std::chrono::milliseconds(0);
  Scheduler b(m, o);
  auto r = run(b, 2, p, 5);
  EXPECT_LE(r->start.cached_tokens, 72);
  EXPECT_EQ(r->tokens[0], FakeModel::greedy(p, 5));
}

TEST_F(EngineDiskCache, FlushEmptiesBothTiers) {
  FakeModel m(4096, true);
  Scheduler a(m, options());
  const auto p = prompt_of(40, 9);
  run(a, 1, p, 2);
  a.disk()->tier().flush();
  ASSERT_FALSE(entry_files().empty());
  EXPECT_GT(a.flush_cache(), 0u);
  EXPECT_TRUE(entry_files().empty());
  EXPECT_EQ(a.prefix_cache().entries(), 0u);
  auto r = run(a, 2, p, 2);
  EXPECT_EQ(r->start.cached_tokens, 0);
}

TEST_F(EngineDiskCache, WritesWaitForTheHitThreshold) {
  FakeModel m(4096, true);
  EngineOptions o = options();
  o.disk_write_min_hits = 1;
  Scheduler a(m, o);
  const auto p = prompt_of(40, 10);
  run(a, 1, p, 2);
  a.disk()->tier().flush();
  EXPECT_TRUE(entry_files().empty()) << "entries nobody hit yet stay in RAM";
  run(a, 2, p, 2);  // a hit
  a.disk()->tier().flush();
  EXPECT_FALSE(entry_files().empty());
}

}  // namespace
