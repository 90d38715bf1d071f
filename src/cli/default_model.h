// The built-in default model: a tiny V4.1 checkpoint generated on first use, so that a new user
// sees `deepinfer generate` work with no arguments.
#pragma once

#include <string>

namespace di::cli {
// $DEEPINFER_HOME/models/tiny-v41, else $XDG_CACHE_HOME/deepinfer/models/tiny-v41, else
// ~/.cache/deepinfer/models/tiny-v41.
std::string default_model_dir();
// Generates the default model there when it is missing (seed 0); returns the directory.
std::string ensure_default_model(bool verbose);
}  // namespace di::cli
