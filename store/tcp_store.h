#pragma once

// TcpStore: a synchronous client of a TCPStore server (ours, torch 1.13's or
// torch 2.x's), implementing store::Store.
//
// Keys are sent as torch's clients send them: "/" + key, so a key this client
// sets is the key a torch client of the same name reads. (PrefixStore on top
// joins as torch's does, so agent and worker key layouts match torch's.)
//
// Dialect: kV2 speaks torch 2.1+'s protocol (VALIDATE, PING); kV113 torch
// 1.13/2.0's; kAuto probes once per connection: VALIDATE + PING(0xFFFFFFFF)
// is echoed by a v2 server and makes a 1.13 server reset the connection at
// once (the bytes read as a SET with an impossible key length, so nothing is
// stored), after which the client reconnects speaking v113.
//
// Timeouts: the constructor retries connecting, with backoff, until
// connect_timeout; every call is bounded by timeout() (wait() by its own
// argument). A call that fails with IoError or TimeoutError leaves the
// connection closed; the next call reconnects. A wait() that times out on a
// v2 server is cancelled on the wire (CANCEL_WAIT); on a 1.13 server, which has
// no cancel, the connection is dropped so that a late reply cannot be mistaken
// for the answer to a later request.
//
// Thread safety: calls are serialised by a mutex; one TcpStore may be shared.
// Throws: IoError (connect, reset, EOF; the message names host:port and the
// operation), TimeoutError (names keys and timeout), ProtocolError (a reply
// that makes no sense, an operation the server's dialect lacks).

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/error.h"
#include "store/protocol.h"
#include "store/store.h"

namespace ctorchrun::store {

enum class ClientDialect { kAuto, kV113, kV2 };

// The server lacks an extension of ctorchrun's own (torch's servers lack them
// all); the message says "not supported". The store stays usable.
class NotSupportedError : public ProtocolError {
 public:
  using ProtocolError::ProtocolError;
};

struct TcpStoreOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 29500;
  ClientDialect dialect = ClientDialect::kAuto;
  std::chrono::milliseconds timeout = kDefaultTimeout;          // each call
  std::chrono::milliseconds connect_timeout = kDefaultTimeout;  // constructor's retries
};

class TcpStore : public Store {
 public:
  // Connects (retrying until options.connect_timeout) and settles the dialect.
  // Throws TimeoutError if no connection could be made in time.
  explicit TcpStore(TcpStoreOptions options);
  ~TcpStore() override;
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired) override;
  using Store::wait;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t num_keys() override;
  bool delete_key(const std::string& key) override;
  // On a 1.13 server (no APPEND) emulated under a lock taken with add() on
  // key + kAppendLockSuffix and released with delete_key(): appenders through
  // TcpStore never lose each other's bytes. A plain set() of the key by
  // anyone still overwrites. If a client dies holding the lock, the others'
  // appends to that key time out (TimeoutError naming the lock key) until it
  // is deleted.
  void append(const std::string& key, const std::string& value) override;
  static constexpr const char* kAppendLockSuffix = "#append_lock";
  // On a 1.13 server (no MULTI_GET/MULTI_SET) done key by key.
  std::vector<std::string> multi_get(const std::vector<std::string>& keys) override;
  void multi_set(const std::vector<std::string>& keys,
                 const std::vector<std::string>& values) override;
  int64_t tally_add(const std::string& key, const std::string& entry) override {
    return portable_tally::add(*this, key, entry);
  }
  int64_t tally_count(const std::string& key) override { return portable_tally::count(*this, key); }
  std::vector<std::string> tally_entries(const std::string& key) override {
    return portable_tally::entries(*this, key);
  }

  // Shuts the connection down: a call blocked on it fails at once with
  // IoError, and so does every later call (no reconnection).
  void interrupt() noexcept override;

  // Keys that start with '/', without it (torch's list_keys). v2 servers only.
  std::vector<std::string> list_keys();

  // Binds to this client's connection every key it creates from now on (the
  // BIND_KEYS extension, store/protocol.h): when the connection closes (this
  // object is destroyed, the process dies, the network drops it) the server
  // deletes those keys and sets each one's gone marker, gone_marker(key), so a
  // peer can wait() for it. A connection lost and remade by a later call
  // loses its keys the same way; the new connection binds again.
  // Throws NotSupportedError ("not supported") when the server is one of
  // torch's (a 1.13 server, or a 2.x server, which closes the connection on
  // the request); callers then fall back to heartbeats. IoError/TimeoutError
  // as any call.
  void bind_keys_to_connection();
  // The key the server sets when bound `key`'s connection closes.
  static std::string gone_marker(const std::string& key) { return key + protocol::kGoneSuffix; }

  protocol::Dialect dialect() const { return dialect_; }
  const std::string& host() const { return options_.host; }
  uint16_t port() const { return options_.port; }

 private:
  class Conn;
  using Clock = std::chrono::steady_clock;

  void ensure_connected(Clock::time_point deadline);
  void send_bind_keys(Clock::time_point deadline);  // on conn_; throws NotSupportedError
  void connect_and_settle(Clock::time_point deadline);
  void drop_connection();
  // Sends `request` and returns the reply read by `read`, dropping the
  // connection on any error. Caller holds mutex_.
  void send_request(const std::string& request, Clock::time_point deadline, const char* what,
                    const std::string& key);
  void begin(std::string* out, protocol::Op op) const;
  void wait_locked(const std::vector<std::string>& wire_keys, std::chrono::milliseconds timeout);
  std::string get_locked(const std::string& wire_key);
  std::string where() const;

  TcpStoreOptions options_;
  protocol::Dialect dialect_ = protocol::Dialect::kUnknown;
  std::unique_ptr<Conn> conn_;
  bool bind_keys_ = false;  // re-bind on every new connection
  std::mutex mutex_;
  // interrupt() from another thread: the live connection's socket, swapped
  // and closed only under fd_mutex_ (never the mutex_ a blocked call holds).
  std::mutex fd_mutex_;
  int live_fd_ = -1;
  bool interrupted_ = false;
};

}  // namespace ctorchrun::store
