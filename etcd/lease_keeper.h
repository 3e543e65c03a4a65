#pragma once

// LeaseKeeper: keeps one etcd lease alive from a background thread.
//
// Every `interval` the thread refreshes the lease once (EtcdClient::
// lease_keepalive), giving each member at most `interval` to answer before
// the next is tried, so that one hung member cannot hold a refresh past the
// TTL (with interval = TTL/3, the usual choice). The lease is lost, and the thread stops, when etcd
// says it has expired or was revoked, or when no refresh succeeded for a whole TTL (by then etcd
// has expired it). lost() turns true and lost_reason() says why; the owner then re-registers under
// a new lease. Failed refreshes inside the TTL are retried at the next interval (logged as
// warnings).
//
// Lifetime: `client` must outlive the keeper. The destructor stops the thread
// and joins it; it blocks for at most one refresh (the client's read_timeout).
// The lease itself is left alone (revoke it if it should go now).
// Thread safety: lost() and lost_reason() may be called from any thread.
// The constructor throws ConfigError for an interval not below the TTL.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

#include "etcd/client.h"

namespace ctorchrun::etcd {

class LeaseKeeper {
 public:
  LeaseKeeper(const EtcdClient& client, Lease lease, std::chrono::milliseconds interval);
  ~LeaseKeeper();
  LeaseKeeper(const LeaseKeeper&) = delete;
  LeaseKeeper& operator=(const LeaseKeeper&) = delete;

  std::int64_t lease_id() const { return lease_.id; }
  bool lost() const { return lost_.load(); }
  std::string lost_reason() const;

 private:
  void run();

  const EtcdClient& client_;
  const Lease lease_;
  const std::chrono::milliseconds interval_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::atomic<bool> lost_{false};
  std::string reason_;
  std::thread thread_;
};

}  // namespace ctorchrun::etcd
