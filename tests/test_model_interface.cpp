// The seam: kvcache pages and pools, the load_model registry, and V4.1 behind the interface
// (same logits as its concrete API, its own thread pool, its cache layout).
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>

#include "core/thread_pool.h"
#include "io/safetensors.h"
#include "kvcache/page_pool.h"
#include "kvcache/row_cache.h"
#include "model/model.h"
#include "model/v41/model.h"
#include "test_engine_util.h"
#include "test_paths.h"

using namespace di;

namespace {

namespace fs = std::filesystem;

TEST(KvCache, PagesAreAlignedZeroedAndCharged) {
  kvcache::PagePool pool(1000);
  auto a = pool.allocate(300);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data()) % kvcache::kPageAlign, 0u);
  for (size_t i = 0; i < a->size(); ++i) ASSERT_EQ(a->data()[i], std::byte{0});
  EXPECT_EQ(pool.used_bytes(), 300u);
  EXPECT_EQ(pool.pages_in_use(), 1);
  auto b = pool.allocate(700);
  EXPECT_THROW(pool.allocate(1), kvcache::CacheExhausted);
  EXPECT_THROW(pool.reserve(1), kvcache::CacheExhausted);
  a.reset();
  EXPECT_EQ(pool.free_bytes(), 300u);
  {
    kvcache::PoolReservation r(&pool, 150);
    kvcache::PoolReservation copy = r;  // copies are charged too
    EXPECT_EQ(pool.used_bytes(), 1000u);
    EXPECT_THROW({ kvcache::PoolReservation third(copy); }, kvcache::CacheExhausted);
  }
  EXPECT_EQ(pool.used_bytes(), 700u);
}

TEST(KvCache, RowCacheSharesPagesCopyOnWrite) {
  kvcache::PagePool pool(1 << 20);
  kvcache::RowCache a(sizeof(int64_t), 4, &pool);
  for (int64_t i = 0; i < 6; ++i) *a.append<int64_t>() = i;
  EXPECT_EQ(pool.pages_in_use(), 2);
  kvcache::RowCache b = a;  // shares both pages
  EXPECT_EQ(pool.pages_in_use(), 2);
  EXPECT_EQ(b.bytes_needed(1), 4 * sizeof(int64_t)) << "the shared partial page is copied first";
  *b.append<int64_t>() = 100;
  EXPECT_EQ(pool.pages_in_use(), 3);
  *a.append<int64_t>() = 200;
  EXPECT_EQ(*a.row<int64_t>(6), 200);
  EXPECT_EQ(*b.row<int64_t>(6), 100);
  EXPECT_EQ(*b.row<int64_t>(5), 5);
  const auto full = a.share_pages(1);
  kvcache::RowCache c(sizeof(int64_t), 4, &pool);
  c.adopt(full, 4);
  EXPECT_EQ(*c.row<int64_t>(3), 3);
  EXPECT_THROW(c.adopt(full, 5), std::invalid_argument);
  kvcache::RowCache wrong(sizeof(int32_t), 4, &pool);
  EXPECT_THROW(wrong.adopt(full, 4), std::invalid_argument) << "page size mismatch";
}

fs::path temp_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("di_model_iface_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

void expect_load_error(const fs::path& dir, const std::string& needle) {
  try {
    load_model(dir.string());
    ADD_FAILURE() << "no LoadError";
  } catch (const LoadError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// As test::golden_model() loads it.
LoadOptions golden_options() {
  LoadOptions lo;
  lo.tokenizer_path = test::v3_tokenizer_json();
  lo.numerics = numerics_from_env(Numerics::Fast);
  return lo;
}

TEST(ModelRegistry, UnknownOrMissingArchitecturesAreLoadErrors) {
  const fs::path d = temp_dir("unknown");
  expect_load_error(d, "config.json");
  std::ofstream(d / "config.json") << R"({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})";
  expect_load_error(d, "model_type \"llama\"");
  std::ofstream(d / "config.json") << R"({"architectures": ["GPT2LMHeadModel"]})";
  expect_load_error(d, "GPT2LMHeadModel");
  std::ofstream(d / "config.json") << "[1, 2]";
  expect_load_error(d, "JSON object");
  fs::remove_all(d);
  bool v41 = false;
  for (const auto& a : known_architectures()) v41 |= a.name == "deepseek_v4.1";
  EXPECT_TRUE(v41);
}

TEST(ModelRegistry, V41ThroughTheInterfaceMatchesTheConcreteModel) {
  LoadOptions lo = golden_options();
  lo.threads = 2;
  const auto m = load_model(test::golden_model_dir(), lo);
  const ModelInfo& info = m->info();
  EXPECT_EQ(info.arch, "deepseek_v4.1");
  const v41::Model& concrete = test::golden_model();
  const V41Config& c = concrete.config();
  EXPECT_EQ(info.vocab_size, c.vocab_size);
  EXPECT_EQ(info.sampleable_vocab, concrete.sampleable_vocab());
  EXPECT_EQ(info.max_context, c.max_position_embeddings);
  EXPECT_EQ(info.eos_id, c.eos_token_id);
  EXPECT_EQ(info.cache_format, concrete.info().cache_format);
  const auto* own = dynamic_cast<const v41::Model*>(m.get());
  ASSERT_NE(own, nullptr);
  ASSERT_NE(own->thread_pool(), nullptr) << "the model owns its kernel threads";
  EXPECT_EQ(own->thread_pool()->size(), 2);

  // The cache layout names every stream share_prefix returns, with its page size.
  constexpr int kPage = 16;
  const auto layout = m->cache_layout(kPage);
  int kv_sources = 0;
  for (int i = 0; i < c.n_layers; ++i) kv_sources += c.is_kv_source(i);
  ASSERT_EQ(layout.size(), size_t(2 * kv_sources));
  kvcache::PagePool pool(64 << 20);
  auto st = m->new_state({8, kPage, &pool, nullptr});
  auto ws = m->new_workspace();
  const auto prompt = test::slice(test::corpus(), 0, 40);
  std::vector<float> a;
  BatchItem item{st.get(), prompt, true, &a};
  m->forward_batch(std::span(&item, 1), *ws);
  const kvcache::PrefixPages pages = st->share_prefix(32);
  ASSERT_EQ(pages.streams.size(), layout.size());
  for (size_t s = 0; s < layout.size(); ++s) {
    ASSERT_EQ(pages.streams[s].size(), 2u);
    EXPECT_EQ(pages.streams[s][0]->size(), layout[s].page_bytes()) << layout[s].name;
  }

  // Bit-identical logits to the concrete API on the calling thread's (absent) pool.
  v41::SequenceState ref = concrete.new_state(8, kPage);
  v41::Workspace rws;
  std::vector<float> b;
  concrete.forward(ref, prompt, b, {true, nullptr}, rws);
  EXPECT_EQ(a, b);

  // Resume after adopting the prefix reproduces the uncached continuation.
  auto resumed = m->new_state({8, kPage, &pool, nullptr});
  resumed->adopt_prefix(pages, std::span(prompt).first(32));
  m->resume(*resumed, *ws);
  std::vector<float> tail;
  BatchItem rest{resumed.get(), std::span(prompt).subspan(32), true, &tail};
  m->forward_batch(std::span(&rest, 1), *ws);
  EXPECT_TRUE(std::equal(tail.begin(), tail.end(), a.end() - std::ptrdiff_t(tail.size())));

  // A state of another model is refused before anything runs.
  class Other final : public Workspace {};
  Other other;
  EXPECT_THROW(m->forward_batch(std::span(&item, 1), other), std::invalid_argument);
}

TEST(ModelRegistry, ArchitectureOptionsAreChecked) {
  LoadOptions lo = golden_options();
  lo.threads = 1;
  lo.arch_options["index_key_policy"] = "reference";
  const auto m = load_model(test::golden_model_dir(), lo);
  EXPECT_NE(m->info().cache_format, test::golden_model().info().cache_format)
      << "the reference policy computes other rows: another cache format";
  lo.arch_options["no_such_option"] = "1";
  EXPECT_THROW(load_model(test::golden_model_dir(), lo), LoadError);
}

}  // namespace
