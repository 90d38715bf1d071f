#include "io/file_util.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"

namespace di {

const char* json_type_name(const nlohmann::json& j) {
  using v = nlohmann::json::value_t;
  switch (j.type()) {
    case v::null: return "null";
    case v::object: return "object";
    case v::array: return "array";
    case v::string: return "string";
    case v::boolean: return "boolean";
    case v::number_integer:
    case v::number_unsigned: return "integer";
    case v::number_float: return "float";
    default: return "binary";
  }
}

void write_file_atomic(const std::string& path, const std::function<bool(std::FILE*)>& body) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw LoadError(path + ": cannot create " + tmp + ": " + std::strerror(errno));
  bool ok = body(f);
  ok = (std::fflush(f) == 0) && ok;
  ok = ok && ::fsync(fileno(f)) == 0;
  const std::string werr = ok ? "" : std::strerror(errno);
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) {
    std::remove(tmp.c_str());
    throw LoadError(path + ": write failed: " + (werr.empty() ? std::strerror(errno) : werr));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string e = std::strerror(errno);
    std::remove(tmp.c_str());
    throw LoadError(path + ": cannot rename " + tmp + " into place: " + e);
  }
}

}  // namespace di
