#pragma once

// TcpStoreServer: a key-value store server that speaks PyTorch's TCPStore
// protocol (both dialects, chosen per connection; see store/protocol.h), so
// torch 1.13 and 2.x clients, our TcpStore client and any mix of them share one
// key space.
//
// The server runs one Asio io_context on a thread of its own. Each connection
// buffers its bytes and executes a request only once the whole request is in,
// so a slow or half-sent request stalls nobody else. Every byte from the
// network is treated as hostile: a length over the limits, an unknown opcode
// or an ADD on a non-integer closes that one connection; the server and every
// other client carry on. Memory grows with the bytes actually received, never
// with a length a client announces.
//
// Semantics follow torch's servers, with the choices the 2.x libuv server made
// where they differ: GET of a missing key returns an empty value; WAIT/CHECK
// count a non-empty queue as a present key; ADD wraps past int64's ends.
//
// No request freezes the server: a WAIT completes in work proportional to the
// keys it names (each key once, however often named), and a request that
// arrives in pieces is parsed where it stopped. Every slow reader is bounded:
// a connection whose unsent replies pass 8 MiB is paused until it reads, and a
// WATCH_KEY client whose unread events pass 8 MiB is closed. Every refusal
// (a limit, a protocol violation, a slow reader) is counted in stats() and
// logged: the first per client address at once, then at most one line per
// second per client. Keys bound to a connection (BIND_KEYS, protocol.h) are
// deleted when it closes. Waiters are woken when a value is
// stored (SET, ADD, APPEND, MULTI_SET, a compare_set that stores) and one per
// QUEUE_PUSH. On a v113 (torch 1.13) connection a request that arrives while
// that connection's WAIT is pending means the client gave up waiting (a 1.13
// client never writes while blocked in WAIT and has no CANCEL_WAIT), so the
// WAIT is dropped instead of being answered later with a byte that client no
// longer expects.
//
// Thread safety: every public method may be called from any thread except the
// server's own. Methods that touch the key space run on the server thread and
// block until done.

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "store/protocol.h"

namespace ctorchrun::store {

struct ServerOptions {
  // The address to bind: a numeric address or a name (its first address).
  // "::" is dual-stack (IPV6_V6ONLY is cleared): it serves IPv4 clients too.
  std::string host = "0.0.0.0";  // as torch binds
  // Further addresses served on the same port as `host`, e.g. "::1" beside
  // "127.0.0.1" so that both loopback spellings of one host reach this store
  // (rendezvous/endpoint.h's bind_addresses_for). Bound in order after host.
  std::vector<std::string> also_hosts;
  uint16_t port = 29500;  // 0 picks a free port; port() tells which
  // Key, value, keys-per-request and whole-request limits (limits.max_request_bytes;
  // 0 picks the default, see protocol::request_limit). A request over one is
  // refused: the connection is closed, and the refusal counted and logged with
  // the client's address and the key.
  protocol::Limits limits;
  size_t max_connections = 16384;
  int listen_backlog = 4096;
};

class TcpStoreServer {
 public:
  // Binds host and every one of also_hosts on one port, listens and starts
  // serving. All or nothing: when any address cannot be bound (in use, not
  // local, bad host) what was bound is closed and IoError names that
  // address:port. With port 0 host's bind picks the port and the others bind
  // the same one; when a further address has that port taken, a fresh port
  // is tried (16 in all) before the IoError.
  // Throws ConfigError when options.limits.max_request_bytes is set below
  // max_key_bytes + max_value_bytes (a SET of the largest key and value must fit).
  static std::unique_ptr<TcpStoreServer> start(const ServerOptions& options);

  ~TcpStoreServer();  // stop()s
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  const std::string& host() const;                // options.host
  const std::vector<std::string>& hosts() const;  // host, then also_hosts
  uint16_t port() const;                          // the one port of every address

  // Closes the listener and every connection and joins the server thread.
  // Idempotent.
  void stop();

  // Removes every key and queue whose raw key starts with none of
  // `keep_prefixes`; returns how many were removed. Pending waits stay
  // registered. The launcher calls this between attempts so that workers of a
  // new attempt never read keys written by earlier workers.
  // This and stats() run on the server thread (any thread may call them,
  // but not a callback of the server's own). After stop() this removes
  // nothing and stats() returns the final counts.
  size_t erase_keys_except(const std::vector<std::string>& keep_prefixes);

  struct Stats {
    uint64_t open_connections = 0;
    uint64_t accepted = 0;
    uint64_t refused = 0;  // over max_connections
    uint64_t requests = 0;
    uint64_t dropped = 0;              // closed for a protocol violation, a limit or a slow read
    uint64_t limit_refusals = 0;       // of those: a request or reply over a size limit
    uint64_t slow_readers_closed = 0;  // of those: WATCH_KEY events left unread
    // (key, waiting connection) pairs examined to complete WAITs: grows with
    // the keys satisfied, whatever the number of keys each WAIT names.
    uint64_t waiter_entries_examined = 0;
    uint64_t keys = 0;
    // requests by operation, indexed by protocol::Op
    std::array<uint64_t, protocol::kOpCount> requests_by_op{};
  };
  Stats stats();

  class Impl;  // opaque: keeps Asio out of this header

 private:
  explicit TcpStoreServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ctorchrun::store
