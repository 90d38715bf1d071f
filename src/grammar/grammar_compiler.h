// Compiles grammars against one vocabulary and caches them by source, so requests with the same
// schema, regex or grammar share one CompiledGrammar (immutable, used by any number of matchers on
// any threads). Thread-safe: a second request for a key being compiled waits for that compile.
// Failed compiles are not cached; every waiter gets the GrammarError.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "grammar/compiled_grammar.h"
#include "grammar/json_schema.h"

namespace di::grammar {

class GrammarCompiler {
 public:
  explicit GrammarCompiler(std::shared_ptr<const Vocabulary> vocab, CompileOptions opt = {}, size_t max_entries = 256);

  std::shared_ptr<const CompiledGrammar> ebnf(std::string_view text, std::string_view root = "root");
  std::shared_ptr<const CompiledGrammar> regex(std::string_view pattern);
  std::shared_ptr<const CompiledGrammar> json_schema(std::string_view schema_text, const JsonSchemaOptions& opt = {});
  std::shared_ptr<const CompiledGrammar> json_object(const JsonSchemaOptions& opt = {});
  // Any grammar under a caller-chosen key (e.g. a tool-call grammar keyed by its tools).
  std::shared_ptr<const CompiledGrammar> get(const std::string& key, const std::function<Grammar()>& make);

  const Vocabulary& vocab() const { return *vocab_; }
  size_t size() const;
  uint64_t compiles() const;  // cache misses that compiled

 private:
  struct Entry {
    std::shared_future<std::shared_ptr<const CompiledGrammar>> future;
    uint64_t id = 0;  // which compile made it
    uint64_t last_use = 0;
  };
  void evict_locked();

  std::shared_ptr<const Vocabulary> vocab_;
  CompileOptions opt_;
  size_t max_entries_;
  mutable std::mutex mu_;
  std::map<std::string, Entry> cache_;
  uint64_t clock_ = 0;
  uint64_t compiles_ = 0;
};

}  // namespace di::grammar
