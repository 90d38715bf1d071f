#include "grammar/grammar_compiler.h"

#include <optional>

#include "grammar/regex.h"

namespace di::grammar {

namespace {
std::string options_key(const JsonSchemaOptions& o) {
  std::string key = std::string(o.any_whitespace ? "ws1" : "ws0") + (o.additional_properties_default ? "ap1" : "ap0");
  for (uint32_t c : o.escaped_code_points) key += "e" + std::to_string(c);
  return key;
}
}  // namespace

GrammarCompiler::GrammarCompiler(std::shared_ptr<const Vocabulary> vocab, CompileOptions opt, size_t max_entries)
    : vocab_(std::move(vocab)), opt_(opt), max_entries_(std::max<size_t>(max_entries, 1)) {}

std::shared_ptr<const CompiledGrammar> GrammarCompiler::get(const std::string& key, const std::function<Grammar()>& make) {
  std::shared_future<std::shared_ptr<const CompiledGrammar>> future;
  std::optional<std::promise<std::shared_ptr<const CompiledGrammar>>> promise;
  uint64_t id = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.find(key);
    if (it != cache_.end()) {
      it->second.last_use = ++clock_;
      future = it->second.future;
    } else {
      promise.emplace();
      future = promise->get_future().share();
      id = ++clock_;
      cache_[key] = Entry{future, id, id};
      ++compiles_;
      evict_locked();
    }
  }
  if (promise) {
    // Compiled outside the lock: other keys proceed meanwhile, this key's requests wait on the future.
    try {
      promise->set_value(CompiledGrammar::compile(make(), vocab_, opt_));
    } catch (...) {
      promise->set_exception(std::current_exception());
      std::lock_guard<std::mutex> lock(mu_);
      auto it = cache_.find(key);
      if (it != cache_.end() && it->second.id == id) cache_.erase(it);
    }
  }
  return future.get();
}

void GrammarCompiler::evict_locked() {
  while (cache_.size() > max_entries_) {
    auto victim = cache_.begin();
    for (auto it = cache_.begin(); it != cache_.end(); ++it) {
      if (it->second.last_use < victim->second.last_use) victim = it;
    }
    cache_.erase(victim);
  }
}

std::shared_ptr<const CompiledGrammar> GrammarCompiler::ebnf(std::string_view text, std::string_view root) {
  return get("ebnf:" + std::string(root) + ":" + std::string(text), [&] { return parse_ebnf(text, root); });
}

std::shared_ptr<const CompiledGrammar> GrammarCompiler::regex(std::string_view pattern) {
  return get("regex:" + std::string(pattern), [&] { return regex_grammar(pattern); });
}

std::shared_ptr<const CompiledGrammar> GrammarCompiler::json_schema(std::string_view schema_text, const JsonSchemaOptions& opt) {
  return get("schema:" + options_key(opt) + ":" + std::string(schema_text), [&] { return json_schema_grammar(schema_text, opt); });
}

std::shared_ptr<const CompiledGrammar> GrammarCompiler::json_object(const JsonSchemaOptions& opt) {
  return get("json_object:" + options_key(opt), [&] { return json_object_grammar(opt); });
}

size_t GrammarCompiler::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cache_.size();
}

uint64_t GrammarCompiler::compiles() const {
  std::lock_guard<std::mutex> lock(mu_);
  return compiles_;
}

}  // namespace di::grammar
