// The HTTP request parser as the server configures it (src/server/http.cpp, Session::do_read):
// Beast's request_parser<string_body> with the body and header limits, header read first, then the
// body, keep-alive requests parsed from the same buffer one after another (pipelining).
// Properties: how the bytes are cut into reads (TCP segments) never changes the parsed requests or
// the error; a parsed body never exceeds the body limit; the server's view of the request (method,
// path without the query string, headers it reads) is well formed.
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <algorithm>
#include <string>
#include <vector>

#include "fuzz_util.h"

namespace http = boost::beast::http;
namespace net = boost::asio;

namespace {

struct Limits {
  size_t body = size_t(8) << 20;  // HttpOptions::max_body_bytes default
  uint32_t header = 64 * 1024;    // Session::do_read
};

// One parsed request, or the error that ended the connection.
struct Outcome {
  std::string error;  // "" when parsed
  std::string method, target, body, authorization, content_type, fields;
  unsigned version = 0;
  bool keep_alive = false;
  bool operator==(const Outcome&) const = default;
};

std::string describe(const std::vector<Outcome>& v) {
  std::string s;
  for (const auto& o : v) {
    s += o.error.empty() ? "[" + o.method + " " + o.target + " v" + std::to_string(o.version) + " ka=" +
                               std::to_string(o.keep_alive) + " body=" + std::to_string(o.body.size()) + "B]"
                         : "[error " + o.error + "]";
  }
  return s;
}

// Feeds `segments` (the reads the socket returns) through the parser as Beast's read algorithms do:
// put() whatever is buffered; on need_more wait for the next read; at the end of input put_eof().
std::vector<Outcome> parse_stream(const std::vector<std::string_view>& segments, const Limits& lim) {
  std::vector<Outcome> out;
  std::string buf;  // received, not yet consumed
  size_t next = 0;
  for (int msg = 0; msg < 8; ++msg) {
    http::request_parser<http::string_body> p;
    p.body_limit(lim.body);
    p.header_limit(lim.header);
    boost::system::error_code ec;
    if (buf.empty() && next == segments.size()) break;  // connection ends cleanly between requests
    while (!p.is_done()) {
      if (p.is_header_done()) p.eager(true);  // http::async_read reads the body eagerly
      if (!buf.empty()) {
        const size_t used = p.put(net::buffer(buf.data(), buf.size()), ec);
        FUZZ_CHECK(used <= buf.size(), "parser consumed more than it was given");
        buf.erase(0, used);
        if (!ec) continue;
        if (ec != http::error::need_more) break;
        ec = {};
      }
      if (next == segments.size()) {
        p.put_eof(ec);
        if (ec) break;
        continue;
      }
      buf.append(segments[next++]);
    }
    Outcome o;
    if (ec) {
      o.error = ec == http::error::header_limit ? "header_limit" : ec.message();
      out.push_back(std::move(o));
      break;
    }
    const auto& m = p.get();
    o.method = std::string(m.method_string());
    const std::string_view target = m.target();
    o.target = std::string(target.substr(0, target.find('?')));
    o.version = m.version();
    o.body = m.body();
    o.authorization = std::string(m[http::field::authorization]);
    o.content_type = std::string(m[http::field::content_type]);
    for (const auto& f : m) o.fields += std::string(f.name_string()) + ": " + std::string(f.value()) + "\n";
    o.keep_alive = m.keep_alive();
    FUZZ_CHECK(o.body.size() <= lim.body, "body of " + std::to_string(o.body.size()) + " bytes passed the limit");
    FUZZ_CHECK(!o.method.empty(), "empty method accepted");
    FUZZ_CHECK(o.target.find('?') == std::string::npos, o.target);
    out.push_back(std::move(o));
    if (!out.back().keep_alive) break;  // the server closes after this reply
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  di::fuzz::Bytes in(data, size);
  Limits lim;
  const uint8_t mode = in.byte();
  // Small limits reach the 413 / 431 paths with small inputs; the first is the server's default.
  static const size_t kBody[] = {size_t(8) << 20, 0, 7, 100};
  static const uint32_t kHeader[] = {64 * 1024, 64 * 1024, 200, 1024};
  lim.body = kBody[mode & 3];
  lim.header = kHeader[(mode >> 2) & 3];
  const uint8_t cut_seed = in.byte();
  const std::string_view text = in.rest();

  std::vector<std::string_view> one;
  if (!text.empty()) one.push_back(text);
  auto whole = parse_stream(one, lim);

  // Cut into reads of pseudo-random sizes (1..16 bytes or larger pieces) chosen by the input.
  std::vector<std::string_view> pieces;
  uint32_t state = cut_seed * 2654435761u + 1;
  for (size_t pos = 0; pos < text.size();) {
    state = state * 1103515245u + 12345u;
    const size_t len = (mode & 0x80) ? 1 + (state >> 16) % 16 : 1 + (state >> 16) % 512;
    pieces.push_back(text.substr(pos, len));
    pos += len;
  }
  auto split = parse_stream(pieces, lim);
  // Which error ends the connection may depend on the cuts (Beast reports a malformed start line
  // at once when it has the whole header, as an incomplete message at EOF when it never got the
  // blank line): the requests parsed before it must not.
  // Beast counts a header against header_limit a few bytes differently when it arrives in pieces:
  // a header right at the limit may be a 431 in one run and accepted in the other. Requests before
  // that one must still agree.
  size_t cut = std::max(whole.size(), split.size());
  for (auto* v : {&whole, &split})
    if (!v->empty() && v->back().error == "header_limit") cut = std::min(cut, v->size() - 1);
  for (auto* v : {&whole, &split}) {
    if (v->size() > cut) v->resize(cut);
    if (!v->empty() && !v->back().error.empty()) v->back().error = "error";
  }
  FUZZ_CHECK(whole == split, "whole " + describe(whole) + " vs split " + describe(split) + " for " + di::fuzz::show(text));
  return 0;
}
