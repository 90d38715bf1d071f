// `deepinfer tokenize`: text <-> ids for scripts and external checks, JSONL on stdin/stdout.
#include <CLI/CLI.hpp>

#include <iostream>
#include <stdexcept>

#include "cli/commands.h"
#include "openai/chat_file.h"
#include "tokenizer/tokenize_jsonl.h"
#include "tokenizer/tokenizer.h"

namespace di::cli {

namespace {

struct TokenizeArgs {
  std::string tokenizer_path;
  bool decode = false;
  bool no_special = false;
  bool skip_special = false;
  std::string chat_file;                     // --chat: render an OpenAI-style request instead of JSONL
  std::string chat_format = "deepseek-v4.1";
  // Further modes add their flags here and a branch in run().
};

void run(const TokenizeArgs& args) {
  const auto tok = Tokenizer::from_file(args.tokenizer_path);
  if (!args.chat_file.empty()) {
    std::cout << openai::render_chat_request_file(*tok, args.chat_file, chat::parse_chat_format(args.chat_format)).dump()
              << "\n";
    return;
  }
  TokenizeJsonlOptions options;
  options.decode = args.decode;
  options.allow_special = !args.no_special;
  options.skip_special = args.skip_special;
  const TokenizeJsonlResult result = tokenize_jsonl(*tok, options, std::cin, std::cout);
  if (result.errors > 0) {
    throw std::runtime_error("tokenize: " + std::to_string(result.errors) + " of " + std::to_string(result.lines) +
                             " lines failed (see the \"error\" lines in the output)");
  }
}

}  // namespace

void add_tokenize(CLI::App& app) {
  auto args = std::make_shared<TokenizeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "tokenize", "Text <-> token ids: JSONL {\"text\": ...} lines on stdin, {\"text\", \"ids\"} lines on stdout");
  cmd->add_option("--tokenizer", args->tokenizer_path, "tokenizer.json, or a model directory containing one")
      ->required();
  cmd->add_flag("--decode", args->decode, "read {\"ids\": [...]} lines and add \"text\"");
  cmd->add_flag("--no-special", args->no_special, "encode everything as plain BPE (no added-token recognition)");
  cmd->add_flag("--skip-special", args->skip_special, "with --decode: leave special tokens out of the text");
  cmd->add_option("--chat", args->chat_file,
                  "render an OpenAI-style chat request JSON file; prints {\"prompt\", \"ids\", ...} (docs/chat.md)");
  cmd->add_option("--chat-format", args->chat_format,
                  "with --chat: deepseek-v4.1 (default), deepseek-v4, deepseek-v3, deepseek-v3.1 or deepseek-r1");
  cmd->callback([args] { run(*args); });
}

}  // namespace di::cli
