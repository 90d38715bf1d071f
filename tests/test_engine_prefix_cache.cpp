// Prefix cache: SHA-256, the key chain, references and LRU eviction, and requests served from the
// cache producing exactly what they produce without it.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "engine/prefix_cache.h"
#include "test_engine_util.h"

using namespace di;
using namespace di::engine;
using di::test::Recorder;

namespace {

const v41::Model& model() { return test::golden_model(); }

std::string hex(const CacheKey& k) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (uint8_t b : k) s += d[b >> 4], s += d[b & 15];
  return s;
}

CacheKey sha(const std::string& s) {
  Sha256 h;
  h.update(s.data(), s.size());
  return h.finish();
}

TEST(EnginePrefixCache, Sha256KnownAnswers) {
  EXPECT_EQ(hex(sha("")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(hex(sha("abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(hex(sha("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  const std::string million(1000000, 'a');
  EXPECT_EQ(hex(sha(million)), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  Sha256 pieces;  // odd piece sizes cross block boundaries everywhere
  for (size_t at = 0, n = 1; at < million.size(); at += n, n = n % 97 + 1)
    pieces.update(million.data() + at, std::min(n, million.size() - at));
  EXPECT_EQ(hex(pieces.finish()), hex(sha(million)));
}

TEST(EnginePrefixCache, KeyChainNamesWholePrefixesPerNamespace) {
  PrefixCache cache(4, "model-a");
  std::vector<int32_t> t(17);
  for (int i = 0; i < 17; ++i) t[size_t(i)] = 1000 + i;
  std::vector<CacheKey> a, b, salted, other_model;
  cache.extend_keys(cache.root_key(""), t, 100, a);
  EXPECT_EQ(a.size(), 4u) << "full pages only";
  cache.extend_keys(cache.root_key(""), std::span(t).first(8), 100, b);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[0], a[0]);
  EXPECT_EQ(b[1], a[1]);
  cache.extend_keys(cache.root_key(""), t, 100, b);  // extends the same chain
  EXPECT_EQ(b, a);
  cache.extend_keys(cache.root_key("tenant-2"), t, 100, salted);
  for (size_t k = 0; k < 4; ++k) EXPECT_NE(salted[k], a[k]);
  PrefixCache other(4, "model-b");
  other.extend_keys(other.root_key(""), t, 100, other_model);
  for (size_t k = 0; k < 4; ++k) EXPECT_NE(other_model[k], a[k]);
  auto changed = t;
  changed[9] = 7;  // page 2
  std::vector<CacheKey> c;
  cache.extend_keys(cache.root_key(""), changed, 100, c);
  EXPECT_EQ(c[0], a[0]);
  EXPECT_EQ(c[1], a[1]);
  EXPECT_NE(c[2], a[2]);
  EXPECT_NE(c[3], a[3]) << "a key names its whole prefix";
}

TEST(EnginePrefixCache, ReferencesProtectAndEvictionTakesLruLeaves) {
  const int pt = 16;
  v41::PagePool pool(64 << 20);
  PrefixCache cache(pt, "golden");
  const auto c = test::corpus();
  v41::Workspace ws;
  std::vector<float> l;
  auto run = [&](const std::vector<int32_t>& toks) {
    v41::SequenceState st = model().new_state(8, pt, &pool);
    model().forward(st, toks, l, {}, ws);
    return st;
  };
  const auto ta = test::slice(c, 0, 80), tb = test::slice(c, 100, 80);
  std::vector<CacheKey> ka, kb;
  cache.extend_keys(cache.root_key(""), ta, 5, ka);
  cache.extend_keys(cache.root_key(""), tb, 5, kb);
  {
    v41::SequenceState a = run(ta), b = run(tb);
    cache.insert(a, ka);
    cache.insert(b, kb);
    EXPECT_EQ(cache.entries(), 10u);
    EXPECT_EQ(pool.used_bytes(), cache.bytes()) << "the cache shares the sequences' pages";
    EXPECT_EQ(cache.reclaimable_bytes(), 0u) << "pages shared with live sequences free nothing";
    EXPECT_FALSE(cache.make_room(pool, pool.budget_bytes()));
    EXPECT_EQ(cache.entries(), 10u);
  }
  const size_t entry_bytes = cache.bytes() / 10;
  EXPECT_EQ(cache.reclaimable_bytes(), cache.bytes());
  std::vector<PrefixCache::Entry*> held;
  std::vector<CacheKey> probe = ka;
  probe[3][0] ^= 1;  // diverges at page 3
  EXPECT_EQ(cache.acquire(probe, held), 3u);
  cache.release(held);
  EXPECT_EQ(cache.acquire(ka, held), 5u);  // a is now the most recently used chain, and held
  // Room for one more entry: b's last page goes (least recently used leaf).
  ASSERT_TRUE(cache.make_room(pool, pool.free_bytes() + entry_bytes));
  EXPECT_EQ(cache.entries(), 9u);
  std::vector<PrefixCache::Entry*> tmp;
  EXPECT_EQ(cache.acquire(kb, tmp), 4u);
  cache.release(tmp);
  // Everything not held goes, leaves first; the held chain stays whole.
  EXPECT_FALSE(cache.make_room(pool, pool.budget_bytes()));
  EXPECT_EQ(cache.entries(), 5u);
  EXPECT_EQ(cache.acquire(ka, tmp), 5u);
  cache.release(tmp);
  // Adopting held pages reproduces the uncached run (the model's own guarantee, through the cache).
  {
    v41::SequenceState adopted = model().new_state(8, pt, &pool);
    adopted.adopt_prefix(cache.pages(held), std::span(ta).first(80));
    model().rebuild_windows(adopted, ws);
    std::vector<float> got, want;
    model().forward(adopted, std::span(c).subspan(80, 5), got, {}, ws);
    v41::SequenceState full = model().new_state(8, pt, &pool);
    model().forward(full, test::slice(c, 0, 85), want, {}, ws);
    EXPECT_TRUE(got == want);
    cache.release(held);
    cache.evict_all();
    EXPECT_EQ(cache.entries(), 5u) << "pages a live sequence shares stay";
  }
  cache.evict_all();
  EXPECT_EQ(cache.entries(), 0u);
  EXPECT_EQ(cache.bytes(), 0u);
  EXPECT_EQ(pool.used_bytes(), 0u);
}

// Runs the requests one after the other (each to completion) on one scheduler.
std::vector<std::shared_ptr<Recorder>> run_in_turn(Scheduler& s, const std::vector<RequestParams>& reqs) {
  std::vector<std::shared_ptr<Recorder>> out;
  for (size_t i = 0; i < reqs.size(); ++i) {
    out.push_back(std::make_shared<Recorder>(reqs[i].n));
    s.add(i + 1, reqs[i], out.back(), 0);
    test::run_all(s);
  }
  return out;
}

TEST(EnginePrefixCache, CachedRequestsProduceExactlyTheUncachedOutput) {
  const auto c = test::corpus();
  const auto prefix = test::slice(c, 0, 160);
  auto with_suffix = [&](size_t from, size_t n) {
    auto p = prefix;
    p.insert(p.end(), c.begin() + std::ptrdiff_t(from), c.begin() + std::ptrdiff_t(from + n));
    return p;
  };
  std::vector<RequestParams> reqs;
  reqs.push_back(test::greedy_request(with_suffix(160, 10), 6));  // fills the cache
  RequestParams greedy = test::greedy_request(with_suffix(190, 12), 8);
  greedy.sampling.logprobs = 1;
  greedy.sampling.top_logprobs = 5;
  reqs.push_back(greedy);
  RequestParams sampled = greedy;
  sampled.prompt = with_suffix(175, 3);
  sampled.sampling.temperature = 1.0f;
  sampled.sampling.top_p = 0.9f;
  sampled.sampling.seed = 4;
  sampled.n = 2;
  reqs.push_back(sampled);
  RequestParams other_tenant = greedy;
  other_tenant.cache_salt = "tenant-b";
  reqs.push_back(other_tenant);
  RequestParams short_prefix = test::greedy_request(test::slice(c, 0, 70), 4);  // 64 shared < replay + 1 page
  reqs.push_back(short_prefix);

  EngineOptions on = test::small_options(), off = on;
  off.prefix_cache = false;
  Scheduler cached(model(), on), plain(model(), off);
  const auto a = run_in_turn(cached, reqs), b = run_in_turn(plain, reqs);
  ASSERT_GT(model().replay_tokens(), 48);
  ASSERT_LT(model().replay_tokens(), 160);
  EXPECT_EQ(a[0]->start.cached_tokens, 0);
  EXPECT_EQ(a[1]->start.cached_tokens, 160);
  EXPECT_EQ(a[2]->start.cached_tokens, 160);
  EXPECT_EQ(a[3]->start.cached_tokens, 0) << "another cache_salt is another namespace";
  EXPECT_EQ(a[4]->start.cached_tokens, 0) << "a prefix within the replay length is recomputed";
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(b[i]->start.cached_tokens, 0);
    for (int ch = 0; ch < reqs[i].n; ++ch) {
      EXPECT_EQ(a[i]->tokens[size_t(ch)], b[i]->tokens[size_t(ch)]) << "request " << i << " choice " << ch;
      EXPECT_EQ(a[i]->logprobs[size_t(ch)], b[i]->logprobs[size_t(ch)]) << "request " << i << " choice " << ch;
      ASSERT_EQ(a[i]->tops[size_t(ch)].size(), b[i]->tops[size_t(ch)].size());
      for (size_t t = 0; t < a[i]->tops[size_t(ch)].size(); ++t)
        for (size_t k = 0; k < a[i]->tops[size_t(ch)][t].size(); ++k) {
          EXPECT_EQ(a[i]->tops[size_t(ch)][t][k].token, b[i]->tops[size_t(ch)][t][k].token);
          EXPECT_EQ(a[i]->tops[size_t(ch)][t][k].logprob, b[i]->tops[size_t(ch)][t][k].logprob);
        }
    }
  }
  EXPECT_EQ(cached.counters().prefix_hit_tokens, 320);
  EXPECT_EQ(cached.counters().cached_prompt_tokens, 320);
  EXPECT_EQ(cached.pool().used_bytes(), cached.prefix_cache().bytes());
  EXPECT_EQ(plain.pool().used_bytes(), 0u);
}

TEST(EnginePrefixCache, FinishedOutputIsReusedByTheNextTurn) {
  const auto c = test::corpus();
  Scheduler s(model(), test::small_options());
  auto first = std::make_shared<Recorder>();
  s.add(1, test::greedy_request(test::slice(c, 0, 100), 30), first, 0);
  test::run_all(s);
  // Next turn: the whole first exchange plus new tokens. The generated tokens' pages were cached
  // when the first request finished (its state covers prompt + all but the last token).
  auto turn = test::slice(c, 0, 100);
  turn.insert(turn.end(), first->tokens[0].begin(), first->tokens[0].end());
  turn.insert(turn.end(), c.begin() + 150, c.begin() + 160);
  auto second = std::make_shared<Recorder>();
  s.add(2, test::greedy_request(turn, 5), second, 0);
  test::run_all(s);
  EXPECT_EQ(second->start.cached_tokens, 128) << "(100 + 29) / 16 full pages";
  EXPECT_EQ(second->tokens[0], test::greedy_alone(model(), turn, 5));
  // The first request's last page boundary (128) had a snapshot: the turn resumed there.
  EXPECT_EQ(s.counters().snapshot_hits, 1);
  EXPECT_EQ(s.counters().replayed_tokens, 0);
}

TEST(EnginePrefixCache, SnapshotHitsReplayNothingAndMatchReplayAndMiss) {
  const auto c = test::corpus();
  std::vector<RequestParams> reqs;
  reqs.push_back(test::greedy_request(test::slice(c, 0, 200), 3));  // snapshots at 64, 128, 192
  auto branch = test::slice(c, 0, 100);                              // shares 100 tokens: resumes at 64
  branch.insert(branch.end(), c.begin() + 150, c.begin() + 170);
  reqs.push_back(test::greedy_request(branch, 4));
  auto extend = test::slice(c, 0, 200);                             // resumes at 192
  extend.insert(extend.end(), c.begin() + 10, c.begin() + 15);
  reqs.push_back(test::greedy_request(extend, 4));
  reqs.push_back(test::greedy_request(test::slice(c, 0, 200), 3));  // the same prompt: resumes at 192
  RequestParams two = test::greedy_request(test::slice(c, 0, 180), 5);
  two.sampling.temperature = 1.0f;
  two.sampling.seed = 9;
  two.n = 2;
  reqs.push_back(two);  // resumes at 128, forks after the prompt

  EngineOptions snap = test::small_options(), replay = snap, off = snap;
  snap.snapshot_interval = 64;
  replay.snapshots = false;
  off.prefix_cache = false;
  Scheduler a(model(), snap), b(model(), replay), n(model(), off);
  const auto ra = run_in_turn(a, reqs), rb = run_in_turn(b, reqs), rn = run_in_turn(n, reqs);
  EXPECT_EQ(ra[1]->start.cached_tokens, 64);
  EXPECT_EQ(ra[2]->start.cached_tokens, 192);
  EXPECT_EQ(ra[3]->start.cached_tokens, 192);
  EXPECT_EQ(ra[4]->start.cached_tokens, 128);
  EXPECT_EQ(a.counters().snapshot_hits, 4);
  EXPECT_EQ(a.counters().replayed_tokens, 0);
  EXPECT_GE(a.counters().snapshots_taken, 3);
  EXPECT_GT(b.counters().replayed_tokens, 0) << "without snapshots a hit replays the window";
  EXPECT_EQ(b.counters().snapshot_hits, 0);
  EXPECT_EQ(b.prefix_cache().snapshots(), 0u);
  EXPECT_LT(a.counters().step_tokens + 0, b.counters().step_tokens + b.counters().replayed_tokens);
  for (size_t i = 0; i < reqs.size(); ++i)
    for (int ch = 0; ch < reqs[i].n; ++ch) {
      EXPECT_EQ(ra[i]->tokens[size_t(ch)], rn[i]->tokens[size_t(ch)]) << "request " << i << " choice " << ch;
      EXPECT_EQ(rb[i]->tokens[size_t(ch)], rn[i]->tokens[size_t(ch)]) << "request " << i << " choice " << ch;
    }
  EXPECT_EQ(a.pool().used_bytes(), a.prefix_cache().bytes()) << "snapshots are drawn from the cache budget";
  EXPECT_GT(a.prefix_cache().snapshot_bytes(), 0u);
}

TEST(EnginePrefixCache, DiskTierRestoresPagesAndSnapshotsForANewEngine) {
  // The model's declared cache layout is what its pages hold: entries written by one engine and
  // read by the next one (a restart) continue exactly like a cold run.
  const auto c = test::corpus();
  const std::string dir = (std::filesystem::temp_directory_path() / ("di-v41-disk-" + std::to_string(::getpid()))).string();
  std::filesystem::remove_all(dir);
  EngineOptions o = test::small_options();
  o.snapshot_interval = 64;
  o.cache_dir = dir;
  {
    Scheduler a(model(), o);
    run_in_turn(a, {test::greedy_request(test::slice(c, 0, 150), 2)});
    a.disk()->tier().flush();
  }
  Scheduler b(model(), o);
  auto extend = test::slice(c, 0, 150);
  extend.insert(extend.end(), c.begin() + 160, c.begin() + 180);
  const auto r = run_in_turn(b, {test::greedy_request(extend, 5)});
  EXPECT_EQ(r[0]->start.cached_tokens, 144);
  EXPECT_EQ(b.disk()->snapshots_read(), 1);
  EXPECT_EQ(b.counters().snapshot_hits, 1);
  EXPECT_EQ(r[0]->tokens[0], test::greedy_alone(model(), extend, 5));
  std::filesystem::remove_all(dir);
}

TEST(EnginePrefixCache, RamTierCapacityEvictsSnapshotsAndPagesLruFirst) {
  const auto c = test::corpus();
  EngineOptions o = test::small_options();
  o.snapshot_interval = 64;
  Scheduler probe(model(), o);
  probe.add(1, test::greedy_request(test::slice(c, 0, 130), 1), nullptr, 0);
  test::run_all(probe);
  const size_t one = probe.prefix_cache().bytes();  // 8 pages and snapshots at 64 and 128
  ASSERT_GT(probe.prefix_cache().snapshots(), 0u);
  o.prefix_cache_bytes = one + one / 2;
  Scheduler s(model(), o);
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < 4; ++i) {
    prompts.push_back(test::slice(c, i * 20, 130));
    auto r = std::make_shared<Recorder>();
    s.add(i + 1, test::greedy_request(prompts.back(), 3), r, 0);
    test::run_all(s);
    EXPECT_LE(s.prefix_cache().bytes(), o.prefix_cache_bytes) << i;
    EXPECT_EQ(r->tokens[0], test::greedy_alone(model(), prompts.back(), 3)) << i;
  }
  EXPECT_GT(s.prefix_cache().snapshot_evictions() + s.prefix_cache().evictions(), 0);
  // The newest prompt is served from the cache; older ones were evicted first.
  auto again = std::make_shared<Recorder>();
  s.add(9, test::greedy_request(prompts.back(), 3), again, 0);
  test::run_all(s);
  EXPECT_GT(again->start.cached_tokens, 0);
  EXPECT_EQ(again->tokens[0], test::greedy_alone(model(), prompts.back(), 3));
}

TEST(EnginePrefixCache, EvictsUnderPressureAndStillServesCorrectly) {
  const auto c = test::corpus();
  EngineOptions o = test::small_options();
  Scheduler probe(model(), o);
  o.cache_budget_bytes = 3 * probe.sequence_bytes(120);  // about three prompts' pages
  Scheduler s(model(), o);
  std::vector<std::shared_ptr<Recorder>> rec;
  std::vector<std::vector<int32_t>> prompts;
  // Four prefixes: the fourth pushes the first out; repeats of recent ones hit.
  for (size_t p : {0, 1, 2, 2, 3, 0, 3}) {
    prompts.push_back(test::slice(c, p * 20, 100));
    rec.push_back(std::make_shared<Recorder>());
    s.add(rec.size(), test::greedy_request(prompts.back(), 4), rec.back(), 0);
    test::run_all(s);
  }
  EXPECT_GT(s.prefix_cache().evictions(), 0);
  for (size_t i = 0; i < rec.size(); ++i)
    EXPECT_EQ(rec[i]->tokens[0], test::greedy_alone(model(), prompts[i], 4)) << i;
  EXPECT_GT(rec[3]->start.cached_tokens, 0);
  EXPECT_GT(rec[6]->start.cached_tokens, 0);
  EXPECT_LE(s.pool().used_bytes(), o.cache_budget_bytes);
  EXPECT_EQ(s.pool().used_bytes(), s.prefix_cache().bytes());
}

}  // namespace
