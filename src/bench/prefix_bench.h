// `deepinfer bench prefix`: what the KV-cache tiers buy a returning conversation, in one process.
//
// A base prompt (random token ids) runs once; then a follow-up that extends it (a chat turn), and a
// request that shares only part of it (a hit that ends between snapshots). The follow-up's time to
// first token is measured cold (prefix cache off), from the RAM tier, and from the disk tier after
// a restart: a new engine on the same directory, with the entry files dropped from the page cache
// (posix_fadvise DONTNEED) so that they come from the disk.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "model/model.h"

namespace di::bench {

struct PrefixBenchOptions {
  int64_t prompt_len = 8192;
  double extend = 0.05;   // the follow-up adds this fraction of prompt_len
  double partial = 0.95;  // the partial hit shares this fraction of the base prompt
  std::string cache_dir;  // disk tier directory (emptied first)
  engine::EngineOptions engine;
  uint64_t seed = 1;
  bool quiet = false;
};

struct PrefixBenchResult {
  nlohmann::json json;
  std::string text;
};

PrefixBenchResult run_prefix_bench(std::shared_ptr<const Model> model, const PrefixBenchOptions& o);

}  // namespace di::bench
