#pragma once

// PyTorch's TCPStore wire protocol, both dialects, in one place.
//
// Every integer is little-endian; strings and byte vectors are a u64 length
// followed by the raw bytes. A request is a u8 opcode followed by its fields;
// replies carry no header (the client knows their shape). The full table is in
// the project's protocol notes (torch's TCPStore.cpp / TCPStoreBackend.cpp):
//
//   op            v113  v2    request fields after the opcode     reply
//   VALIDATE       -    0x00  u32 magic 0x3C85F7CE                 none
//   SET           0x00  0x01  key, bytes                           none
//   COMPARE_SET   0x01  0x02  key, bytes expected, bytes desired   bytes
//   GET           0x02  0x03  key                                  bytes
//   ADD           0x03  0x04  key, i64 delta                       i64
//   CHECK         0x04  0x05  u64 n, n x key                       u8 (0 ready, 1 not)
//   WAIT          0x05  0x06  u64 n, n x key                       u8 0, when all exist
//   GETNUMKEYS    0x06  0x07  -                                    i64
//   WATCH_KEY     0x07   -    key                                  u8 3, then events
//   DELETE_KEY    0x08  0x08  key                                  i64 (0 or 1)
//   APPEND         -    0x09  key, bytes                           none
//   MULTI_GET      -    0x0A  u64 n, n x key                       n x bytes
//   MULTI_SET      -    0x0B  i64 n, n x (key, bytes)              none
//   CANCEL_WAIT    -    0x0C  -                                    u8 1
//   PING           -    0x0D  u32 nonce                            u32 nonce
//   QUEUE_PUSH     -    0x0E  key, bytes                           none
//   QUEUE_POP      -    0x0F  key                                  i64 len, [bytes]
//   QUEUE_LEN      -    0x10  key                                  i64
//   LIST           -    0x11  -                                    i64 n, n x str
//   BIND_KEYS      -    0x40  u32 magic 0x6B0B1D5E                 u32 magic (extension)
//
// v113 is torch 1.13/2.0 (no handshake); v2 is torch 2.1+ (VALIDATE first).
// A server tells them apart from a connection's first bytes: a first byte
// other than 0 is v113; 0 followed by the magic is v2; 0 followed by anything
// else is a v113 SET.
//
// BIND_KEYS is ctorchrun's own extension, spoken only by our client to our
// server (ctorch-store and the store ctorchrun hosts), never by torch's
// clients. It binds the keys a connection creates to that connection:
//  - from BIND_KEYS on, every key this connection creates (SET, ADD,
//    COMPARE_SET, APPEND or MULTI_SET on a missing key) is bound to it;
//  - when the connection closes, for any reason (the client exits, is killed,
//    its host vanishes and TCP gives up), the server deletes each bound key
//    that still exists, which WATCH_KEY watchers see as a deletion, and sets
//    the key's gone marker, key + kGoneSuffix, to "1", which wakes WAITs on it
//    like any other SET; a CHECK or WAIT on the marker thus tells a peer that
//    the holder is gone without polling;
//  - creating a bound key deletes its gone marker, so the marker always speaks
//    of the key's current holder; DELETE_KEY of a bound key unbinds it.
// A torch server does not know the opcode and closes the connection (2.x's
// libuv server does so for any unknown command), so a client that sends
// BIND_KEYS and loses the connection knows the server lacks the extension.
// The request carries a magic number and the reply echoes it, so a reply can
// never be confused with another command's.
//
// This header and protocol.cc depend on the standard library only, so the
// request parser can be fuzzed on its own.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ctorchrun::store::protocol {

inline constexpr uint32_t kValidationMagic = 0x3C85F7CE;
inline constexpr uint8_t kBindKeysOpcode = 0x40;  // v2 dialect only; see above
inline constexpr uint32_t kBindKeysMagic = 0x6B0B1D5E;
inline constexpr const char* kGoneSuffix = "#gone";

enum class Dialect : uint8_t {
  kUnknown,  // nothing decided yet (server side, before the first request)
  kV113,     // torch 1.13 / 2.0 numbering, no handshake
  kV2,       // torch 2.1+ numbering, VALIDATE first
};

const char* to_string(Dialect d);

// Operations, independent of either dialect's numbering.
enum class Op : uint8_t {
  kValidate,
  kSet,
  kCompareSet,
  kGet,
  kAdd,
  kCheck,
  kWait,
  kGetNumKeys,
  kWatchKey,
  kDeleteKey,
  kAppend,
  kMultiGet,
  kMultiSet,
  kCancelWait,
  kPing,
  kQueuePush,
  kQueuePop,
  kQueueLen,
  kList,
  kBindKeys,  // ctorchrun's extension
};
inline constexpr size_t kOpCount = static_cast<size_t>(Op::kBindKeys) + 1;

const char* to_string(Op op);

// The operation an opcode byte means in `dialect`, or nullopt if none.
std::optional<Op> decode_opcode(Dialect dialect, uint8_t code);
// The opcode byte of `op` in `dialect`, or nullopt if the dialect lacks it.
std::optional<uint8_t> encode_opcode(Dialect dialect, Op op);

enum class CheckResponse : uint8_t { kReady = 0, kNotReady = 1 };
enum class WaitResponse : uint8_t { kStopWaiting = 0, kWaitCanceled = 1 };
enum class WatchResponse : uint8_t {
  kKeyUpdated = 0,
  kKeyCreated = 1,
  kKeyDeleted = 2,
  kCallbackRegistered = 3,
};

// Size limits a server checks as soon as a length prefix arrives, before it
// buffers the bytes that follow. torch's libuv server allows keys of 8 KiB,
// values of 8 MiB and 131072 keys per multi-key request; ours default higher.
// max_request_bytes caps a whole request (and a MULTI_GET's whole reply): without
// it one MULTI_SET could legally carry 131072 values of the value limit each.
struct Limits {
  size_t max_key_bytes = 64 * 1024;
  size_t max_value_bytes = 64 * 1024 * 1024;
  size_t max_keys_per_op = 131072;
  size_t max_request_bytes = 0;  // 0: request_limit()'s default
};

// The request cap in force: max_request_bytes, or when it is 0 the larger of
// twice the value limit and 64 MiB + 1 MiB.
size_t request_limit(const Limits& limits);

// One parsed request. Views point into the caller's buffer and stay valid
// until that buffer changes. A Request is meant to be reused: parse_request
// clears it and keeps the vectors' capacity.
//
// A multi-key request (CHECK, WAIT, MULTI_GET, MULTI_SET) that is not complete
// yet keeps its progress here, as offsets from the request's first byte, so
// that the next call resumes after the last complete key instead of starting
// over: each arriving packet costs work in proportion to its own bytes, not
// to the keys before it (131072 keys sent one per packet would otherwise cost
// 131072²/2 key parses).
struct Request {
  Op op = Op::kGetNumKeys;
  std::string_view key;                  // single-key ops
  std::string_view value;                // SET/APPEND/QUEUE_PUSH value, COMPARE_SET expected
  std::string_view value2;               // COMPARE_SET desired
  int64_t delta = 0;                     // ADD
  uint32_t u32 = 0;                      // VALIDATE magic, PING nonce
  std::vector<std::string_view> keys;    // CHECK, WAIT, MULTI_GET, MULTI_SET
  std::vector<std::string_view> values;  // MULTI_SET

  // Resumption state; parse_request owns it.
  size_t resume_pos = 0;  // bytes of a partial multi-key request parsed; 0: none
  uint64_t resume_count = 0;
  std::vector<std::pair<size_t, size_t>> key_spans;    // offset, length
  std::vector<std::pair<size_t, size_t>> value_spans;  // MULTI_SET
};

enum class ParseStatus : uint8_t { kComplete, kNeedMore, kError };

struct ParseResult {
  ParseStatus status = ParseStatus::kNeedMore;
  // kComplete: bytes the request took. kNeedMore: total bytes the buffer must
  // hold before parsing again can make progress (a lower bound).
  size_t size = 0;
  const char* error = nullptr;  // kError: a static description
  // kError over a limit: the limit, the length announced (for a whole
  // request, the size it would reach), and the key concerned, possibly cut
  // (a view into the buffer; empty when none was read).
  size_t limit = 0;
  uint64_t length = 0;
  std::string_view key;
};

// Parses one request from data[0, size). When *dialect is kUnknown, decides it
// from the first bytes (see above) and stores the decision in *dialect, even if
// the request itself is not complete yet. Never allocates more than the
// request's field count, never reads past `size`; a length or count over
// `limits` is an error as soon as its prefix is in the buffer.
//
// After kNeedMore, the next call on the same `out` must pass the same request
// again from its first byte (the buffer may have moved), with more bytes; any
// other use must first call reset_progress(out).
ParseResult parse_request(Dialect* dialect, const char* data, size_t size, const Limits& limits,
                          Request* out);

// parse_request's fast path, which a server may call first: true, with
// *used set to the request's size, when data[0, size) starts with a whole GET,
// SET, ADD, another single-key request, or a CHECK, WAIT, MULTI_GET or
// MULTI_SET of a few keys, within every limit; `out` then holds it as
// parse_request would. False for anything else (a partial request, a limit
// passed, many keys, an unknown opcode): call parse_request, which parses or
// reports it. `dialect` must be known and `out` hold no progress.
bool parse_common_request(Dialect dialect, const char* data, size_t size, const Limits& limits,
                          Request* out, size_t* used);

inline void reset_progress(Request* r) {
  r->resume_pos = 0;
  r->key_spans.clear();
  r->value_spans.clear();
}

// C's std::stoll on a stored value, as torch's ADD applies it: leading
// whitespace, optional sign, decimal digits up to the first non-digit.
// nullopt when there are no digits or the number does not fit in int64.
std::optional<int64_t> parse_int64_like_stoll(std::string_view s);

// Appending encoders, used for requests (client) and replies (server);
// little-endian, as torch's stores write them. Inline: a reply is built of
// these on the server's per-request path.
inline void put_u8(std::string* out, uint8_t v) { out->push_back(static_cast<char>(v)); }
inline void put_u32(std::string* out, uint32_t v) {
  char b[4];
  for (int i = 0; i < 4; ++i) b[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  out->append(b, 4);
}
inline void put_u64(std::string* out, uint64_t v) {
  char b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  out->append(b, 8);
}
inline void put_i64(std::string* out, int64_t v) { put_u64(out, static_cast<uint64_t>(v)); }
inline void put_bytes(std::string* out, std::string_view bytes) {
  put_u64(out, bytes.size());
  out->append(bytes.data(), bytes.size());
}

inline uint32_t read_u32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap32(v);
#endif
  return v;
}
inline uint64_t read_u64(const char* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap64(v);
#endif
  return v;
}
inline int64_t read_i64(const char* p) { return static_cast<int64_t>(read_u64(p)); }

}  // namespace ctorchrun::store::protocol
