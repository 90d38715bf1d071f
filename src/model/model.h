// The architecture-neutral model interface: what the engine, server, CLI and bench see of a model.
//
// A Model is immutable after loading and may serve many sequences at once. Each sequence's state
// (its caches and token history) is a SequenceState the model creates; the growing part of it
// lives in pages of a kvcache::PagePool, laid out as the model's cache_layout() says, so that the
// engine can share whole token pages between sequences (prefix cache, n > 1 choices) without
// knowing what the rows mean. Architectures implement this in src/model/<arch>/ and register with
// load_model (model.cpp).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/numerics.h"
#include "kvcache/page_pool.h"
#include "model/cost.h"

namespace di {

class ThreadPool;

struct ModelInfo {
  std::string arch;          // registry name: "deepseek_v4.1", "deepseek_v3"
  // Names the page layout and the numerics that filled the pages: pages of models whose formats
  // differ never share prefix-cache keys. Independent of the page size (the cache keys hash it).
  std::string cache_format;
  int64_t vocab_size = 0;        // rows of the logits
  int64_t sampleable_vocab = 0;  // ids a sampler may produce (<= vocab_size)
  int64_t max_context = 0;       // position limit
  int32_t bos_id = 0, eos_id = 1;
  std::string chat_format;  // chat_template.h name of the model's chat format ("v4.1", "v3", ...)
  Numerics numerics = Numerics::Fast;
};

struct StateOptions {
  int max_rollback = 8;  // positions truncate() may go back
  int page_tokens = 64;  // tokens per page (must suit the model: e.g. a multiple of V4.1's ratios)
  kvcache::PagePool* pool = nullptr;        // cache pages; null = outside any budget
  kvcache::PagePool* state_pool = nullptr;  // fixed per-sequence state (charged per copy); null = none
};

// One sequence's state: everything a later chunk needs from earlier ones.
class SequenceState {
 public:
  virtual ~SequenceState() = default;
  virtual int64_t pos() const = 0;  // tokens processed
  virtual const std::vector<int32_t>& tokens() const = 0;
  // Back to position p (p tokens kept); max(pos() - max_rollback, rollback_floor()) <= p <= pos().
  // Throws otherwise.
  virtual void truncate(int64_t p) = 0;
  virtual int64_t rollback_floor() const = 0;
  // Cache bytes that processing n_tokens more tokens would allocate from the pool.
  virtual size_t bytes_needed(int64_t n_tokens) const = 0;
  // Prefix sharing: the pages covering the first n_tokens tokens (a multiple of the page size and
  // <= pos()), one list per stream of the model's cache layout; and an empty state that starts
  // from such pages plus the prefix's tokens (Model::resume then rebuilds what pages do not hold).
  virtual kvcache::PrefixPages share_prefix(int64_t n_tokens) const = 0;
  virtual void adopt_prefix(const kvcache::PrefixPages& pages, std::span<const int32_t> tokens) = 0;
  // Snapshots, for models with state outside their pages (Model::has_snapshots()): the
  // part of the state that pages do not hold (V4.1: the last window rows of every layer), taken
  // at a token-page boundary (pos() a multiple of the page size), as opaque bytes; and an empty
  // state restarted from the pages of that prefix, its tokens and those bytes, which then goes on
  // exactly as the original would have (no replay). Throws std::invalid_argument for bytes that
  // do not fit the pages, the tokens or the model; the base class has no snapshots.
  virtual std::vector<std::byte> snapshot() const;
  virtual void restore_snapshot(const kvcache::PrefixPages& pages, std::span<const int32_t> tokens,
                                std::span<const std::byte> snapshot);
  virtual size_t bytes() const = 0;        // all bytes held
  virtual size_t fixed_bytes() const = 0;  // the per-sequence part outside pages (what a state pool is charged)
  // A copy that shares every page (a partly filled page is copied on its first write); charges the
  // state pool again (throws kvcache::CacheExhausted when it cannot).
  virtual std::unique_ptr<SequenceState> clone() const = 0;
};

// Scratch memory a model reuses across forward calls (one per calling thread).
class Workspace {
 public:
  virtual ~Workspace() = default;
};

// The model's own type behind an interface object it is handed (its SequenceState or Workspace);
// one made by another model is a caller error.
template <class Own, class Base>
Own& own_object(Base& b) {
  auto* o = dynamic_cast<Own*>(&b);
  if (!o) throw std::invalid_argument("forward: a sequence state or workspace of another model");
  return *o;
}

// One sequence's part of a batched step: a prefill chunk, one decode token, or several tokens to
// verify.
struct BatchItem {
  SequenceState* state = nullptr;
  std::span<const int32_t> tokens;
  bool all_logits = false;               // logits of every position, else only the last
  std::vector<float>* logits = nullptr;  // out: [1 or n][vocab_size], fp32
};

class Model {
 public:
  virtual ~Model() = default;
  virtual const ModelInfo& info() const = 0;
  // The streams of a sequence's paged caches for pages of `page_tokens` tokens, in the order of
  // PrefixPages::streams.
  virtual std::vector<kvcache::StreamLayout> cache_layout(int page_tokens) const = 0;
  virtual std::unique_ptr<SequenceState> new_state(const StateOptions& opts) const = 0;
  virtual std::unique_ptr<Workspace> new_workspace() const = 0;
  // One step over many sequences (states from new_state of this model). Each item's results are
  // identical to running it alone. Throws before touching any state when an item is invalid or its
  // pages do not fit (kvcache::CacheExhausted).
  virtual void forward_batch(std::span<BatchItem> items, Workspace& ws) const = 0;
  // After adopt_prefix, the model rebuilds the state that pages do not hold (V4.1: the sliding
  // window rings) by re-running up to resume_tokens() tokens of the prefix; 0 = nothing to rebuild.
  // A prefix no longer than that is cheaper to recompute than to resume.
  virtual int64_t resume_tokens() const = 0;
  virtual void resume(SequenceState& state, Workspace& ws) const = 0;
  // Whether its states have SequenceState::snapshot/restore_snapshot (in place of resume()).
  virtual bool has_snapshots() const { return false; }
  // What steps move and compute (the bench's rooflines); null where the architecture declares none.
  virtual std::unique_ptr<StepCost> step_cost() const { return nullptr; }
  // The pool the model's forward passes run their kernels on (LoadOptions::threads), for a
  // benchmark's accounting of the threads' time; null when they use the calling thread's.
  virtual ThreadPool* thread_pool() const { return nullptr; }
};

struct LoadOptions {
  Numerics numerics = Numerics::Fast;
  int threads = 0;  // kernel threads of the model's own pool; 0 = all cores, 1 = the calling thread only
  std::string tokenizer_path;  // default MODEL_DIR/tokenizer.json (where the architecture needs it)
  // Set from another thread to stop a load early: LoadCancelled is thrown.
  const std::atomic<bool>* cancel = nullptr;
  // Switches only one architecture has (V4.1: index_key_policy = per_source | reference); the
  // loader rejects keys and values it does not know.
  std::map<std::string, std::string> arch_options;
};

// Loads MODEL_DIR with the architecture its config.json names (`model_type`, else
// `architectures`). Throws LoadError for an unknown or missing architecture and whatever the
// architecture's loader throws.
std::unique_ptr<Model> load_model(const std::string& model_dir, const LoadOptions& opts = {});

// Registry names of the known architectures, and the config.json model_type each accepts.
struct ArchitectureInfo {
  std::string name;
  std::vector<std::string> model_types, architectures;
};
std::vector<ArchitectureInfo> known_architectures();

}  // namespace di
