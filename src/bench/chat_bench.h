// A multi-turn chat workload for `deepinfer bench serve --dataset multiturn --in-process`: many
// conversations that share a system prompt, each turn's prompt being the whole conversation so
// far (system prompt, every earlier user turn and reply, the new user turn), sent when the
// previous turn's reply is complete. Token ids throughout, so a turn's prompt holds the previous
// replies exactly as generated: what a prefix cache can serve is decided by the cache alone.
// Reports the prefix hit rate (cached / prompt tokens) and TTFT, overall and per turn.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace di::engine {
class Engine;
}

namespace di::bench {

struct ChatWorkload {
  int conversations = 50, turns = 8;
  int system_len = 1024;  // shared by every conversation
  int turn_len = 128;     // tokens of each user turn
  int output_len = 64;    // max_tokens of each reply (EOS ignored)
  int max_concurrency = 0;  // conversations in flight at once; 0 = all
  uint64_t seed = 0;
  bool progress = true;
};

struct ChatResult {
  nlohmann::json json;
  std::string text;
};

ChatResult run_chat_bench(engine::Engine& eng, const ChatWorkload& w);

}  // namespace di::bench
