#pragma once

// Watch: a stream of etcd changes to one key or one prefix, made by
// EtcdClient::watch().
//
// Delivery. next() returns the changes one at a time in revision order, each
// exactly once, from the start revision on: a put (key, value, revisions,
// lease) or a delete (key and the deleting revision).
//
// Failover. The watch runs on one member over the gateway's streaming
// /v3/watch. When that stream ends (the member died: EOF or reset) or fails,
// next() re-creates the watch on the next member from (last delivered
// revision + 1), so no change is lost or repeated. etcd keeps history until
// compacted, so any member can replay it.
//
// Compaction. When the history the watch needs was compacted, etcd cancels
// the watch with the compaction revision; next() then throws
// WatchCompactedError (and every later call does too; compacted() is true).
// Start a new watch at compact_revision() after re-reading the state.
//
// Errors from next(): IoError when the stream was lost and no member took
// the watch back before the deadline (the watch stays valid; a later call
// tries again from the same revision); ProtocolError for a malformed message
// (endpoint named); EtcdError when etcd cancels the watch for another reason.
//
// Limits: a member that hangs without closing its stream (stopped, or cut
// off by the network) is not detected; progress notifications could, later.
//
// Lifetime and threads: a Watch shares the client's settings and may outlive
// the EtcdClient that made it. One thread owns a Watch. Destruction closes the
// stream.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "etcd/types.h"

namespace ctorchrun::etcd {

namespace detail {
struct ClientCore;
class WatchImpl;
}  // namespace detail

class Watch {
 public:
  ~Watch();
  Watch(const Watch&) = delete;
  Watch& operator=(const Watch&) = delete;

  // The next change, or nullopt when `deadline` passed first (the stream is
  // kept). Blocks at most until the deadline.
  std::optional<WatchEvent> next(std::chrono::steady_clock::time_point deadline);
  std::optional<WatchEvent> next(std::chrono::milliseconds timeout) {
    return next(std::chrono::steady_clock::now() + timeout);
  }

  // The revision the watch resumes from after a failover: last delivered + 1.
  std::int64_t next_revision() const;
  // The endpoint whose member carries the stream now ("" while none does).
  std::string endpoint() const;
  bool compacted() const;

 private:
  friend class EtcdClient;
  explicit Watch(std::unique_ptr<detail::WatchImpl> impl);
  std::unique_ptr<detail::WatchImpl> impl_;
};

}  // namespace ctorchrun::etcd
