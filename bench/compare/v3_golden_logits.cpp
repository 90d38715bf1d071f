// deepinfer's DeepSeek-V3 logits on the golden prompts, written in the golden's own layout so that
// the llama.cpp anchor's compare_golden.mjs (../shared/anchors/llamacpp) compares llama.cpp with
// deepinfer directly: `--golden OUT --set MODE`. For each prompt of the golden file: prefill, then
// 16 greedy decode steps feeding deepinfer's own argmax; per row the argmax (`greedy`), the top-256
// ids and logits, and the log-sum-exp. Also prints how these rows compare with the official golden
// (fp32 mode against its fp32 run, fast / exact against its bf16 run).
//
//   v3_golden_logits --model DIR --golden golden.safetensors --mode fp32|fast|exact --out FILE
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "model/v3/model.h"

namespace {

using di::Checkpoint;
using di::DType;

constexpr int kTop = 256, kSteps = 16;

struct Row {
  int32_t argmax = 0;
  std::vector<int32_t> ids;
  std::vector<float> vals;
  float lse = 0;
};

Row summarize(const std::vector<float>& lg) {
  Row r;
  std::vector<int32_t> idx(lg.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + kTop, idx.end(),
                    [&](int32_t a, int32_t b) { return lg[size_t(a)] > lg[size_t(b)] || (lg[size_t(a)] == lg[size_t(b)] && a < b); });
  r.argmax = idx[0];
  r.ids.assign(idx.begin(), idx.begin() + kTop);
  for (int32_t i : r.ids) r.vals.push_back(lg[size_t(i)]);
  double s = 0;
  for (float v : lg) s += std::exp(double(v) - double(r.vals[0]));
  r.lse = float(double(r.vals[0]) + std::log(s));
  return r;
}

template <class T>
std::vector<T> values(const Checkpoint& ck, const std::string& name) {
  const di::TensorView& t = ck.get(name);
  return {t.as<T>(), t.as<T>() + t.numel()};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"deepinfer V3 logits on the golden prompts, in the golden's layout"};
  std::string model_dir, golden_path, out_path, mode = "fp32";
  int threads = 1;
  app.add_option("--model", model_dir, "V3 checkpoint directory")->required();
  app.add_option("--golden", golden_path, "golden.safetensors (prompts, reference rows)")->required();
  app.add_option("--out", out_path, "output safetensors")->required();
  app.add_option("--mode", mode, "numerics")->check(CLI::IsMember({"fp32", "fast", "exact"}));
  app.add_option("--threads", threads, "kernel threads");
  CLI11_PARSE(app, argc, argv);

  di::v3::LoadOptions lo;
  lo.fp32 = mode == "fp32";
  lo.numerics = mode == "exact" ? di::Numerics::Exact : di::Numerics::Fast;
  lo.threads = threads;
  auto model = di::v3::Model::load(model_dir, lo);
  const Checkpoint golden = Checkpoint::open(golden_path);
  const std::string ref_set = mode == "fp32" ? "fp32" : "bf16";

  di::SafetensorsWriter w;
  w.set_metadata("source", "deepinfer v3_golden_logits, mode " + mode);
  int agree = 0, rows_total = 0;
  double max_diff = 0;
  for (int p = 0;; ++p) {
    const std::string P = "prompt" + std::to_string(p);
    if (!golden.find("fp32." + P + ".tokens")) break;
    const auto tokens = values<int32_t>(golden, "fp32." + P + ".tokens");
    const auto ref_greedy = values<int32_t>(golden, ref_set + "." + P + ".greedy");
    const auto ref_ids = values<int32_t>(golden, ref_set + "." + P + ".logits_topk_ids");
    const auto ref_vals = values<float>(golden, ref_set + "." + P + ".logits_topk");
    auto st = model->new_state();
    di::v3::Workspace ws;
    std::vector<float> lg;
    std::vector<int32_t> greedy, ids;
    std::vector<float> vals, lse;
    model->forward(*st, tokens, lg, {}, ws);
    double pmax = 0;
    int pagree = 0;
    for (int r = 0; r <= kSteps; ++r) {
      if (r > 0) {
        const int32_t t = greedy.back();
        model->forward(*st, std::span<const int32_t>(&t, 1), lg, {}, ws);
      }
      const Row row = summarize(lg);
      greedy.push_back(row.argmax);
      ids.insert(ids.end(), row.ids.begin(), row.ids.end());
      vals.insert(vals.end(), row.vals.begin(), row.vals.end());
      lse.push_back(row.lse);
      // Against the official run, while the tokens fed so far are the same as its own.
      if (std::equal(greedy.begin(), greedy.end() - 1, ref_greedy.begin())) {
        pagree += row.argmax == ref_greedy[size_t(r)];
        for (int j = 0; j < kTop; ++j) {
          const int32_t id = ref_ids[size_t(r * kTop + j)];
          pmax = std::max(pmax, std::fabs(double(lg[size_t(id)]) - double(ref_vals[size_t(r * kTop + j)])));
        }
      }
    }
    std::printf("%s: %zu prompt tokens; greedy vs official %s run %d/%d; max |logit diff| on its top-256 %.3g\n",
                P.c_str(), tokens.size(), ref_set.c_str(), pagree, kSteps + 1, pmax);
    agree += pagree, rows_total += kSteps + 1, max_diff = std::max(max_diff, pmax);
    const std::string k = mode + "." + P + ".";
    w.add_typed(k + "tokens", DType::I32, {int64_t(tokens.size())}, tokens);
    w.add_typed(k + "greedy", DType::I32, {kSteps + 1}, greedy);
    w.add_typed(k + "logits_topk_ids", DType::I32, {kSteps + 1, kTop}, ids);
    w.add_typed(k + "logits_topk", DType::F32, {kSteps + 1, kTop}, vals);
    w.add_typed(k + "logits_lse", DType::F32, {kSteps + 1}, lse);
  }
  if (rows_total == 0) {
    std::fprintf(stderr, "%s: no fp32.promptN.tokens\n", golden_path.c_str());
    return 1;
  }
  w.write(out_path);
  std::printf("mode %s: greedy vs official %s run %d/%d, max |logit diff| %.3g; wrote %s\n", mode.c_str(),
              ref_set.c_str(), agree, rows_total, max_diff, out_path.c_str());
  return 0;
}
