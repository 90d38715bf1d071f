// Small I/O helpers shared by the checkpoint reader and writers.
#pragma once

#include <cstdio>
#include <functional>
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace di {

// "object", "array", "string", "integer", ... for error messages.
const char* json_type_name(const nlohmann::json& j);

// Writes `path` atomically: `body` writes into a temporary file next to it (returning false on a
// short write), which is flushed, fsync'ed and renamed into place. Throws LoadError naming the
// path and the system error; the temporary file never survives a failure.
void write_file_atomic(const std::string& path, const std::function<bool(std::FILE*)>& body);

}  // namespace di
