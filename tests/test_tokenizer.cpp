// Exactness against Hugging Face's tokenizer (frozen vectors + live npm oracle), round trips,
// incremental decoding, robustness on arbitrary bytes, error reporting.
#include <gtest/gtest.h>

#include <chrono>
#include <random>
#include <thread>

#include "test_tokenizer_util.h"
#include "tokenizer/text_utf8.h"
#include "tokenizer/tokenize_jsonl.h"

namespace di {
namespace {

using nlohmann::json;
using test::read_jsonl;
using test::v3_tokenizer;
using test::kCorpus;
using test::kVariants;
using test::expect_rows_match;
using test::check_variants;


TEST(TokenizerExactness, SharedVectors) {
  auto tok = v3_tokenizer();
  const auto rows = read_jsonl(DI_SOURCE_DIR "/tests/data/tokenizer/deepseek_v3_vectors.jsonl");
  ASSERT_GE(rows.size(), 1500u);
  size_t failures = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const std::string text = rows[i]["text"];
    const auto expected = rows[i]["ids"].get<std::vector<int32_t>>();
    const auto got = tok->encode(text);
    if (got != expected && failures++ < 8) {
      ADD_FAILURE() << "line " << i + 1 << ": " << json(text).dump() << "\n  expected " << json(expected).dump()
                    << "\n  got      " << json(got).dump();
    }
  }
  EXPECT_EQ(failures, 0u);
}

TEST(TokenizerExactness, FrozenCorpus) {
  ASSERT_TRUE(std::filesystem::exists(kCorpus)) << kCorpus << " is missing: run node tests/oracle/gen_tokenizer_corpus.js";
  const auto rows = read_jsonl(kCorpus);
  ASSERT_GE(rows.size(), 3000u);
  size_t with_special_text = 0;
  for (const auto& r : rows) with_special_text += r.contains("ids_plain");
  EXPECT_GE(with_special_text, 100u) << "the corpus should hold many strings with added-token text";
  expect_rows_match(*v3_tokenizer(), rows, "corpus");
}

TEST(TokenizerExactness, FrozenFeatureVariants) {
  ASSERT_TRUE(std::filesystem::exists(kVariants)) << kVariants << " is missing: run node tests/oracle/tokenizer_variants.js";
  check_variants(json::parse(test::read_file(kVariants)), "frozen");
}

TEST(TokenizerRoundTrip, CorpusBothModes) {
  auto tok = v3_tokenizer();
  for (const auto& row : read_jsonl(kCorpus)) {
    const std::string text = row["text"];
    ASSERT_EQ(tok->decode(tok->encode(text, true)), text);
    ASSERT_EQ(tok->decode(tok->encode(text, false)), text);
  }
}

std::string random_valid_utf8(std::mt19937& rng, size_t max_chars) {
  std::string s;
  const size_t n = rng() % (max_chars + 1);
  for (size_t i = 0; i < n; ++i) {
    char32_t cp;
    switch (rng() % 4) {
      case 0: cp = rng() % 0x80; break;
      case 1: cp = 0x80 + rng() % (0x800 - 0x80); break;
      case 2: cp = 0x800 + rng() % (0x10000 - 0x800); break;
      default: cp = 0x10000 + rng() % (0x110000 - 0x10000); break;
    }
    if (cp >= 0xD800 && cp <= 0xDFFF) cp = 0xFFFD;
    utf8::append_code_point(s, cp);
  }
  return s;
}

TEST(TokenizerRoundTrip, RandomCodePoints) {
  auto tok = v3_tokenizer();
  std::mt19937 rng(1234);
  for (int i = 0; i < 3000; ++i) {
    const std::string text = random_valid_utf8(rng, 40);
    ASSERT_EQ(tok->decode(tok->encode(text, true)), text);
    ASSERT_EQ(tok->decode(tok->encode(text, false)), text);
  }
}

TEST(TokenizerRobustness, ArbitraryBytesGiveIdsOrInvalidArgument) {
  auto tok = v3_tokenizer();
  std::mt19937 rng(99);
  size_t valid = 0, invalid = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 20000; ++i) {
    std::string bytes(rng() % 64, '\0');
    for (auto& b : bytes) {
      // Bias towards bytes that form (or almost form) multi-byte sequences and special-token text.
      const uint32_t r = rng() % 10;
      b = static_cast<char>(r < 4 ? rng() % 256 : r < 7 ? 0x80 + rng() % 64 : r < 8 ? "<｜>|"[rng() % 5] : 'a' + rng() % 26);
    }
    const size_t bad = utf8::first_invalid_byte(bytes);
    try {
      const auto ids = tok->encode(bytes, (i & 1) != 0);
      ASSERT_EQ(bad, utf8::kValid);
      ASSERT_EQ(tok->decode(ids), bytes);
      ++valid;
    } catch (const std::invalid_argument& e) {
      ASSERT_NE(bad, utf8::kValid);
      EXPECT_NE(std::string(e.what()).find("byte offset " + std::to_string(bad)), std::string::npos) << e.what();
      ++invalid;
    }
  }
  EXPECT_GT(valid, 100u);
  EXPECT_GT(invalid, 100u);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
}

TEST(TokenizerRobustness, PathologicalInputsFinishQuickly) {
  auto tok = v3_tokenizer();
  const std::vector<std::string> inputs = {
      std::string(1 << 20, ' '), std::string(1 << 20, 'a'), std::string(1 << 20, '\n'),
      std::string(1 << 20, '7'), [] { std::string s; for (int i = 0; i < 200000; ++i) s += " \t"; return s + "x"; }(),
      [] { std::string s = "e"; for (int i = 0; i < 100000; ++i) s += "\xCC\x81"; return s; }(),
      [] { std::string s; for (int i = 0; i < 100000; ++i) s += "<｜"; return s; }(),
      [] { std::string s; for (int i = 0; i < 300000; ++i) s += "!?"; return s; }(),
  };
  for (const auto& text : inputs) {
    const auto start = std::chrono::steady_clock::now();
    const auto ids = tok->encode(text);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(seconds, 5.0) << "input of " << text.size() << " bytes starting " << json(text.substr(0, 8)).dump();
    EXPECT_EQ(tok->decode(ids), text);
  }
}

TEST(TokenizerRobustness, ConcurrentEncodesAgree) {
  auto tok = v3_tokenizer();
  const auto rows = read_jsonl(kCorpus);
  std::vector<std::thread> threads;
  std::atomic<size_t> mismatches{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = t; i < rows.size(); i += 2) {
        if (tok->encode(rows[i]["text"].get<std::string>()) != rows[i]["ids"].get<std::vector<int32_t>>()) ++mismatches;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0u);
}

TEST(TokenizerEncode, InvalidUtf8NamesByteOffset) {
  auto tok = v3_tokenizer();
  try {
    tok->encode(std::string("abc\xC3(def"));
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("byte offset 3"), std::string::npos) << e.what();
  }
  EXPECT_THROW(tok->encode(std::string("\xED\xA0\x80"), false), std::invalid_argument);  // surrogate
  EXPECT_THROW(tok->encode(std::string("ok\xF4\x90\x80\x80")), std::invalid_argument);    // > U+10FFFF
  EXPECT_THROW(tok->encode(std::string("\xC0\xAF")), std::invalid_argument);              // overlong
}

TEST(TokenizerEncode, SpecialTextIsPlainWithoutAllowSpecial) {
  auto tok = v3_tokenizer();
  EXPECT_EQ(tok->encode("<｜User｜>hi<｜Assistant｜>"), (std::vector<int32_t>{128803, 6366, 128804}));
  const auto plain = tok->encode("<｜User｜>", false);
  EXPECT_GT(plain.size(), 1u);
  for (int32_t id : plain) EXPECT_LT(id, 128000);
  EXPECT_EQ(tok->decode(plain), "<｜User｜>");
  EXPECT_TRUE(tok->encode("").empty());
}

TEST(TokenizerApi, LookupsAndFlags) {
  auto tok = v3_tokenizer();
  EXPECT_EQ(tok->vocab_size(), 128815);
  EXPECT_EQ(tok->token_to_id("<｜end▁of▁sentence｜>"), 1);
  EXPECT_EQ(tok->token_to_id("<｜User｜>"), 128803);
  EXPECT_EQ(tok->token_to_id("Ġthe"), tok->encode(" the")[0]);
  EXPECT_FALSE(tok->token_to_id("no such token").has_value());
  EXPECT_EQ(tok->id_to_token(128804), "<｜Assistant｜>");
  EXPECT_FALSE(tok->id_to_token(129000).has_value());
  EXPECT_FALSE(tok->id_to_token(-1).has_value());
  EXPECT_TRUE(tok->is_special(0));
  EXPECT_TRUE(tok->is_special(1));
  EXPECT_FALSE(tok->is_special(128803));  // <｜User｜> is a non-special added token in V3
  EXPECT_EQ(tok->token_bytes(*tok->token_to_id("Ġthe")), " the");
  EXPECT_EQ(tok->token_bytes(1), "<｜end▁of▁sentence｜>");
}

TEST(TokenizerDecode, LossyAndSkipSpecial) {
  auto tok = v3_tokenizer();
  const auto smile = tok->encode("😀");
  ASSERT_GE(smile.size(), 2u);  // split across tokens that hold partial UTF-8
  std::vector<int32_t> partial(smile.begin(), smile.end() - 1);
  EXPECT_EQ(tok->decode(partial), "\xEF\xBF\xBD");
  EXPECT_EQ(tok->decode({0, 19923, 1}), "<｜begin▁of▁sentence｜>Hello<｜end▁of▁sentence｜>");
  EXPECT_EQ(tok->decode({0, 19923, 1}, true), "Hello");
  EXPECT_EQ(tok->decode({128803, 19923}, true), "<｜User｜>Hello");  // not special
  EXPECT_EQ(tok->decode({19923, -5, 999999, 128900}), "Hello");    // unknown ids decode to nothing, as HF
}

TEST(IncrementalDecoder, ConcatenationEqualsDecodeOnCorpus) {
  auto tok = v3_tokenizer();
  for (const auto& row : read_jsonl(kCorpus)) {
    const auto ids = row["ids"].get<std::vector<int32_t>>();
    for (bool skip : {false, true}) {
      IncrementalDecoder dec(tok, skip);
      std::string streamed;
      for (int32_t id : ids) {
        const std::string piece = dec.push(id);
        ASSERT_EQ(utf8::first_invalid_byte(piece), utf8::kValid);
        streamed += piece;
      }
      streamed += dec.flush();
      ASSERT_EQ(streamed, tok->decode(ids, skip));
    }
  }
}

// Whatever ids follow, text already emitted stays a prefix of the full decode.
TEST(IncrementalDecoder, EmittedTextIsFinalForAnyContinuation) {
  auto tok = v3_tokenizer();
  std::mt19937 rng(7);
  // Tokens holding a partial UTF-8 character are the ones that test holding back.
  std::vector<int32_t> pool;
  for (int32_t id = 0; id < 128000; id += 97) pool.push_back(id);
  for (int32_t id = 0; id < 128000; ++id) {
    const std::string_view bytes = tok->token_bytes_view(id);
    if (bytes.size() <= 2 && !bytes.empty() && static_cast<uint8_t>(bytes[0]) >= 0x80) pool.push_back(id);
  }
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<int32_t> ids;
    const size_t n = 1 + rng() % 12;
    for (size_t i = 0; i < n; ++i) ids.push_back(pool[rng() % pool.size()]);
    IncrementalDecoder dec(tok);
    std::string emitted;
    for (size_t k = 0; k < ids.size(); ++k) {
      emitted += dec.push(ids[k]);
      std::vector<int32_t> continued(ids.begin(), ids.begin() + k + 1);
      for (int c = 0; c < 3; ++c) continued.push_back(pool[rng() % pool.size()]);
      const std::string full = tok->decode(continued);
      ASSERT_EQ(full.compare(0, emitted.size(), emitted), 0) << "emitted text changed by later tokens";
    }
    emitted += dec.flush();
    ASSERT_EQ(emitted, tok->decode(ids));
  }
}

TEST(IncrementalDecoder, HoldsBackPartialCharacter) {
  auto tok = v3_tokenizer();
  const auto ids = tok->encode("😀");
  ASSERT_GE(ids.size(), 2u);
  IncrementalDecoder dec(tok);
  for (size_t i = 0; i + 1 < ids.size(); ++i) EXPECT_EQ(dec.push(ids[i]), "");
  EXPECT_EQ(dec.push(ids.back()), "😀");
  EXPECT_EQ(dec.flush(), "");
  IncrementalDecoder cut(tok);
  EXPECT_EQ(cut.push(ids[0]), "");
  EXPECT_EQ(cut.flush(), "\xEF\xBF\xBD");
}

TEST(TokenizerLoad, ClearErrors) {
  const json base = json::parse(test::read_file(test::v3_tokenizer_path()));
  auto expect_error = [&](const json& patch, const std::string& needle) {
    json j = base;
    for (const auto& [key, value] : patch.items()) {
      if (value.is_null()) j.erase(key);
      else j[key] = value;
    }
    try {
      Tokenizer::from_json_text(j.dump(), "test.json");
      ADD_FAILURE() << "expected an error containing " << needle;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("test.json"), std::string::npos) << e.what();
    }
  };
  expect_error({{"normalizer", {{"type", "Lowercase"}}}}, "unsupported type \"Lowercase\"");
  expect_error({{"pre_tokenizer", {{"type", "Whitespace"}}}}, "unsupported pre-tokenizer type \"Whitespace\"");
  expect_error({{"pre_tokenizer", {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}}}},
               "cannot compile regex");
  expect_error({{"model", nullptr}}, "missing \"model\"");
  expect_error({{"decoder", {{"type", "WordPiece"}}}}, "decoder: unsupported");
  json bad_merges = base["model"];
  bad_merges["merges"] = json::array({"Ġ t", "nosuch token"});
  expect_error({{"model", bad_merges}}, "model.merges[1]");
  EXPECT_THROW(Tokenizer::from_json_text("{not json", "x.json"), std::runtime_error);
  try {
    Tokenizer::from_file("/nonexistent/dir/tokenizer.json");
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/dir/tokenizer.json"), std::string::npos);
  }
}

TEST(TokenizerLoad, DirectoryPathFindsTokenizerJson) {
  auto tok = Tokenizer::from_file(std::filesystem::path(test::v3_tokenizer_path()).parent_path().string());
  EXPECT_EQ(tok->encode("Hello world"), (std::vector<int32_t>{19923, 2058}));
}


// The function behind `deepinfer tokenize`.
TEST(TokenizeJsonl, EncodesDecodesAndReportsBadLines) {
  auto tok = v3_tokenizer();
  std::istringstream in(
      "{\"text\": \"Hello world\", \"id\": 7}\n"
      "\n"
      "{\"text\": \"<｜User｜>hi\"}\n"
      "not json\n"
      "{\"ids\": [1]}\n"
      "[1, 2]\n");
  std::ostringstream out;
  const TokenizeJsonlResult result = tokenize_jsonl(*tok, {}, in, out);
  EXPECT_EQ(result.lines, 5u);
  EXPECT_EQ(result.errors, 3u);
  std::vector<json> rows;
  std::istringstream lines(out.str());
  for (std::string line; std::getline(lines, line);) rows.push_back(json::parse(line));
  ASSERT_EQ(rows.size(), 5u);
  EXPECT_EQ(rows[0], json::parse(R"({"text": "Hello world", "id": 7, "ids": [19923, 2058]})"));
  EXPECT_EQ(rows[1]["ids"], json::parse("[128803, 6366]"));
  EXPECT_EQ(rows[2]["line"], 4);
  EXPECT_NE(rows[2]["error"].get<std::string>().find("line 4: not valid JSON"), std::string::npos);
  EXPECT_NE(rows[3]["error"].get<std::string>().find("line 5: missing string \"text\""), std::string::npos);
  EXPECT_NE(rows[4]["error"].get<std::string>().find("line 6: expected a JSON object"), std::string::npos);

  std::istringstream plain_in("{\"text\": \"<｜User｜>\"}\n");
  std::ostringstream plain_out;
  TokenizeJsonlOptions plain;
  plain.allow_special = false;
  tokenize_jsonl(*tok, plain, plain_in, plain_out);
  EXPECT_EQ(json::parse(plain_out.str())["ids"], json(tok->encode("<｜User｜>", false)));

  std::istringstream dec_in("{\"ids\": [0, 19923, 1]}\n{\"ids\": [19923, -1]}\n{\"ids\": \"x\"}\n");
  std::ostringstream dec_out;
  TokenizeJsonlOptions decode;
  decode.decode = true;
  decode.skip_special = true;
  const auto dec = tokenize_jsonl(*tok, decode, dec_in, dec_out);
  EXPECT_EQ(dec.errors, 2u);
  std::istringstream dec_lines(dec_out.str());
  std::string first;
  std::getline(dec_lines, first);
  EXPECT_EQ(json::parse(first)["text"], "Hello");
  EXPECT_NE(dec_out.str().find("ids[1]: not a token id"), std::string::npos);
}

}  // namespace
}  // namespace di
