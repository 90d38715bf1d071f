// Constrained decoding in the engine (RequestParams::grammar) against the fake model: every
// choice's output is in the grammar's language whatever the logits and the seed, n > 1 choices keep
// their own grammar state, preemption and recompute leave it intact, EOS comes only where the
// grammar may end, and logprobs are those of the constrained distribution.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "engine/request.h"
#include "engine/scheduler.h"
#include "fake_model.h"
#include "grammar/compiled_grammar.h"
#include "grammar/grammar.h"
#include "grammar/json_schema.h"
#include "grammar/regex.h"
#include "test_engine_util.h"

using namespace di;
using namespace di::engine;
using di::test::FakeModel;
using di::test::prompt_of;
using di::test::Recorder;

namespace {

// Token id i >= 2 is the printable ASCII character i + 30 (95 of them: ' ' .. '~'); 0 and 1 (BOS,
// EOS) are not text.
std::shared_ptr<const grammar::Vocabulary> fake_vocab() {
  std::vector<std::string> toks(FakeModel::kVocab);
  for (int i = 2; i < FakeModel::kVocab; ++i) toks[size_t(i)] = std::string(1, char(i + 30));
  return std::make_shared<grammar::Vocabulary>(toks, FakeModel::kVocab, std::vector<int32_t>{FakeModel::kEos});
}

std::string text_of(const std::vector<int32_t>& toks) {
  std::string s;
  for (int32_t t : toks) {
    EXPECT_GE(t, 2) << "a non-text token was emitted";
    s += char(t + 30);
  }
  return s;
}

std::shared_ptr<const grammar::CompiledGrammar> compile(const grammar::Grammar& g) {
  return grammar::CompiledGrammar::compile(g, fake_vocab());
}

EngineOptions options() { return test::fake_engine_options(); }

RequestParams sampled(std::vector<int32_t> prompt, std::shared_ptr<const grammar::CompiledGrammar> g, uint64_t seed,
                      int n = 1, int max_tokens = 200) {
  RequestParams p;
  p.prompt = std::move(prompt);
  p.sampling.temperature = 1.0f;
  p.sampling.seed = seed;
  p.max_tokens = max_tokens;
  p.n = n;
  p.grammar = std::move(g);
  return p;
}

const char* kRegex = "[a-z]{2,6}@(x|yz)\\.(com|org)";

TEST(EngineGrammar, RegexOutputsMatchForEverySeedAndChoice) {
  FakeModel m;
  Scheduler s(m, options());
  const auto g = compile(grammar::regex_grammar(kRegex));
  std::vector<std::shared_ptr<Recorder>> rec;
  for (int seed = 0; seed < 12; ++seed) {
    rec.push_back(std::make_shared<Recorder>(3));
    s.add(uint64_t(seed + 1), sampled(prompt_of(5, seed), g, uint64_t(seed), 3), rec.back(), 1);
  }
  test::run_all(s);
  const std::regex re(kRegex);
  std::set<std::string> distinct;
  for (auto& r : rec) {
    ASSERT_TRUE(r->done());
    for (int c = 0; c < 3; ++c) {
      const std::string out = text_of(r->tokens[size_t(c)]);
      EXPECT_TRUE(std::regex_match(out, re)) << out;
      // The regex ends after ".com"/".org": the choice stops without sampling EOS.
      EXPECT_EQ(r->reason(c), FinishReason::Stop) << out;
      EXPECT_EQ(r->finish[size_t(c)]->stop_token, -1);
      distinct.insert(out);
    }
  }
  EXPECT_GT(distinct.size(), 20u) << "choices and seeds should differ";
}

TEST(EngineGrammar, EosOnlyWhereTheGrammarMayEnd) {
  // EOS biased far above everything: still never before the grammar's first complete string, then
  // at once.
  FakeModel m;
  Scheduler s(m, options());
  const auto g = compile(grammar::regex_grammar("[a-z]+[0-9]*"));
  auto rec = std::make_shared<Recorder>(2);
  RequestParams p = sampled(prompt_of(4, 3), g, 7, 2);
  p.sampling.logit_bias = {{FakeModel::kEos, 100.0f}};
  s.add(1, p, rec, 1);
  test::run_all(s);
  for (int c = 0; c < 2; ++c) {
    const std::string out = text_of(rec->tokens[size_t(c)]);
    EXPECT_TRUE(std::regex_match(out, std::regex("[a-z]"))) << "EOS as soon as the grammar allows it: " << out;
    EXPECT_EQ(rec->reason(c), FinishReason::Stop);
    EXPECT_EQ(rec->finish[size_t(c)]->stop_token, FakeModel::kEos);
  }
  // Without the grammar the same bias ends at once.
  auto free_rec = std::make_shared<Recorder>();
  RequestParams q = sampled(prompt_of(4, 3), nullptr, 7);
  q.sampling.logit_bias = {{FakeModel::kEos, 100.0f}};
  s.add(2, q, free_rec, 1);
  test::run_all(s);
  EXPECT_TRUE(free_rec->tokens[0].empty());
}

// Checks a document against the schema of JsonSchemaCase by hand.
void check_doc(const std::string& text) {
  const nlohmann::json d = nlohmann::json::parse(text);  // throws: the test fails
  ASSERT_TRUE(d.is_object()) << text;
  ASSERT_TRUE(d.contains("id") && d["id"].is_number_integer()) << text;
  EXPECT_GE(d["id"].get<int64_t>(), 0);
  EXPECT_LE(d["id"].get<int64_t>(), 50);
  ASSERT_TRUE(d.contains("tag") && d["tag"].is_string()) << text;
  const std::string tag = d["tag"];
  EXPECT_LE(tag.size(), 4u) << text;
  for (char ch : tag) EXPECT_TRUE(ch >= 'a' && ch <= 'z') << text;
  for (auto& [k, v] : d.items()) {
    EXPECT_TRUE(k == "id" || k == "tag" || k == "flags" || k == "kind") << text;
    if (k == "flags") {
      ASSERT_TRUE(v.is_array());
      EXPECT_LE(v.size(), 3u);
      for (auto& b : v) EXPECT_TRUE(b.is_boolean());
    }
    if (k == "kind") {
      EXPECT_TRUE(v == "a" || v == "bc") << text;
    }
  }
}

TEST(EngineGrammar, JsonSchemaOutputsParseAndValidate) {
  FakeModel m;
  Scheduler s(m, options());
  const char* schema = R"({"type":"object","properties":{
      "id":{"type":"integer","minimum":0,"maximum":50},
      "tag":{"type":"string","pattern":"^[a-z]{0,4}$"},
      "flags":{"type":"array","items":{"type":"boolean"},"maxItems":3},
      "kind":{"enum":["a","bc"]}},"required":["id","tag"]})";
  grammar::JsonSchemaOptions jo;
  jo.any_whitespace = false;
  const auto g = compile(grammar::json_schema_grammar(std::string_view(schema), jo));
  std::vector<std::shared_ptr<Recorder>> rec;
  for (int seed = 0; seed < 10; ++seed) {
    rec.push_back(std::make_shared<Recorder>(2));
    s.add(uint64_t(seed + 1), sampled(prompt_of(6, seed), g, uint64_t(100 + seed), 2), rec.back(), 1);
  }
  test::run_all(s);
  for (auto& r : rec)
    for (int c = 0; c < 2; ++c) {
      ASSERT_EQ(r->reason(c), FinishReason::Stop);
      check_doc(text_of(r->tokens[size_t(c)]));
    }
}

TEST(EngineGrammar, PreemptionAndRecomputeKeepTheGrammarState) {
  // The same sampled requests under a budget that preempts choices mid-output and one that does
  // not: identical tokens (sampling is counter-based), all in the language.
  FakeModel m;
  const auto g = compile(grammar::parse_ebnf(R"(root ::= item ("," item)* "."
item ::= [a-z]+ "=" [0-9]{1,3})"));
  auto run = [&](size_t budget, int64_t* preempted) {
    EngineOptions o = options();
    if (budget) o.cache_budget_bytes = budget;
    Scheduler s(m, o);
    std::vector<std::shared_ptr<Recorder>> rec;
    for (int i = 0; i < 8; ++i) {
      rec.push_back(std::make_shared<Recorder>(2));
      s.add(uint64_t(i + 1), sampled(prompt_of(3 + i, 10 + i), g, uint64_t(i), 2, 60), rec.back(), 1);
    }
    test::run_all(s, 20000);
    *preempted = s.counters().preempted_with_output;
    std::vector<std::vector<int32_t>> out;
    for (auto& r : rec)
      for (int c = 0; c < 2; ++c) out.push_back(r->tokens[size_t(c)]);
    return out;
  };
  FakeModel probe_model;
  Scheduler probe(probe_model, options());
  int64_t pre_small = 0, pre_big = 0;
  const auto small = run(3 * probe.sequence_bytes(60), &pre_small);
  const auto big = run(0, &pre_big);
  EXPECT_GE(pre_small, 1) << "the small budget must preempt choices with output";
  EXPECT_EQ(pre_big, 0);
  ASSERT_EQ(small.size(), big.size());
  const std::regex re("[a-z]+=[0-9]{1,3}(,[a-z]+=[0-9]{1,3})*\\.?");
  for (size_t i = 0; i < small.size(); ++i) {
    EXPECT_EQ(small[i], big[i]) << i;
    const std::string out = text_of(small[i]);
    // Length-limited outputs are prefixes; complete ones match the whole grammar.
    bool ok = false;
    for (const char* rest : {"", "0", "=0", "a=0"}) ok = ok || std::regex_match(out + rest, re);
    EXPECT_TRUE(ok) << out;
  }
}

TEST(EngineGrammar, LogprobsAreOfTheConstrainedDistribution) {
  FakeModel m;
  Scheduler s(m, options());
  const auto g = compile(grammar::regex_grammar("[ab][cde]"));
  auto rec = std::make_shared<Recorder>();
  RequestParams p = sampled(prompt_of(5, 1), g, 3);
  p.sampling.logprobs = 1;
  p.sampling.top_logprobs = 5;
  s.add(1, p, rec, 1);
  test::run_all(s);
  ASSERT_EQ(rec->tokens[0].size(), 2u);
  const std::string allowed[2] = {"ab", "cde"};
  for (size_t step = 0; step < 2; ++step) {
    const auto& top = rec->tops[0][step];
    ASSERT_EQ(top.size(), allowed[step].size()) << "only allowed tokens are alternatives";
    double mass = 0;
    for (const auto& t : top) {
      EXPECT_NE(allowed[step].find(char(t.token + 30)), std::string::npos);
      EXPECT_TRUE(std::isfinite(t.logprob));
      mass += std::exp(double(t.logprob));
    }
    EXPECT_NEAR(mass, 1.0, 1e-4) << "the allowed tokens carry all the probability";
    EXPECT_LE(rec->logprobs[0][step], 0.0f);
  }
}

TEST(EngineGrammar, GreedyAndTopKStayInsideTheMask) {
  FakeModel m;
  Scheduler s(m, options());
  const auto g = compile(grammar::regex_grammar("(xy|z)+!"));
  std::vector<std::shared_ptr<Recorder>> rec;
  for (int i = 0; i < 6; ++i) {
    RequestParams p = sampled(prompt_of(4, i), g, uint64_t(i), 1, 30);
    if (i % 2 == 0) p.sampling.temperature = 0;
    else p.sampling.top_k = 40, p.sampling.top_p = 0.5f;
    rec.push_back(std::make_shared<Recorder>());
    s.add(uint64_t(i + 1), p, rec.back(), 1);
  }
  test::run_all(s);
  const std::regex full("(xy|z)+!"), prefix("(xy|z)*x?");
  for (auto& r : rec) {
    const std::string out = text_of(r->tokens[0]);
    if (r->reason() == FinishReason::Stop) EXPECT_TRUE(std::regex_match(out, full)) << out;
    else EXPECT_TRUE(std::regex_match(out, prefix)) << out;
  }
}

TEST(EngineGrammar, GrammarForAnotherVocabularyIsInvalid) {
  FakeModel m;
  std::vector<std::string> toks(10, "a");
  auto other = std::make_shared<grammar::Vocabulary>(toks, 10, std::vector<int32_t>{1});
  RequestParams p = sampled(prompt_of(3, 1), grammar::CompiledGrammar::compile(grammar::regex_grammar("a+"), other), 1);
  const SubmitResult r = validate_params(p, m.info());
  EXPECT_EQ(r.error, SubmitError::Invalid);
  EXPECT_NE(r.message.find("grammar"), std::string::npos) << r.message;
}

}  // namespace
