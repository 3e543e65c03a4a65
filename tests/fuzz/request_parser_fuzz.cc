// libFuzzer target: the store's request parser, fed the way the server feeds
// it: a connection's bytes from its first byte on, requests consumed one after
// another, the dialect decided by the first request. Checks the parser's
// contract on every input: it never reads past the buffer (ASan), consumes at
// least one byte per complete request and never more than it was given, and
// asks for more than it has when it needs more. Each complete request is also
// parsed again fed in pieces (as packets arrive), in a buffer that moves between
// calls: the resumed parse must reach the same result as the whole one.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "store/protocol.h"

using namespace ctorchrun::store::protocol;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Limits limits;
  limits.max_key_bytes = 1024;
  limits.max_value_bytes = 4096;
  limits.max_keys_per_op = 64;
  Dialect dialect = Dialect::kUnknown;
  Request req;
  const char* p = reinterpret_cast<const char*>(data);
  size_t off = 0;
  while (off <= size) {
    ParseResult r = parse_request(&dialect, p + off, size - off, limits, &req);
    if (r.status == ParseStatus::kError) {
      if (r.error == nullptr) std::abort();
      break;
    }
    if (r.status == ParseStatus::kNeedMore) {
      if (r.size <= size - off) std::abort();  // claims to need what it has
      break;
    }
    if (r.size == 0 || r.size > size - off) std::abort();
    if (dialect == Dialect::kUnknown) std::abort();
    if (req.keys.size() > limits.max_keys_per_op) std::abort();
    for (auto k : req.keys) {
      if (k.size() > limits.max_key_bytes) std::abort();
    }
    if (req.key.size() > limits.max_key_bytes) std::abort();
    if (req.value.size() > limits.max_value_bytes) std::abort();

    Dialect d2 = dialect;
    Request pieces;
    std::string moving;
    size_t fed = 0;
    ParseResult r2;
    for (;;) {
      // Piece sizes from the request's own bytes: deterministic per input.
      size_t step = 1 + static_cast<uint8_t>(p[off + fed % r.size]) % 17;
      fed = fed + step > r.size ? r.size : fed + step;
      moving = std::string(p + off, fed);  // a new buffer each time
      r2 = parse_request(&d2, moving.data(), moving.size(), limits, &pieces);
      if (r2.status != ParseStatus::kNeedMore) break;
      if (fed == r.size) std::abort();  // the whole request is in
      if (r2.size <= fed) std::abort();
    }
    if (r2.status != ParseStatus::kComplete || r2.size != r.size) std::abort();
    if (pieces.op != req.op || pieces.keys.size() != req.keys.size()) std::abort();
    for (size_t i = 0; i < req.keys.size(); ++i) {
      if (pieces.keys[i] != req.keys[i]) std::abort();
    }
    for (size_t i = 0; i < req.values.size(); ++i) {
      if (pieces.values[i] != req.values[i]) std::abort();
    }
    off += r.size;
  }
  return 0;
}
