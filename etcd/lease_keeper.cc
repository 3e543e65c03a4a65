#include "etcd/lease_keeper.h"

#include "common/deadline.h"
#include "common/error.h"
#include "common/log.h"

namespace ctorchrun::etcd {

LeaseKeeper::LeaseKeeper(const EtcdClient& client, Lease lease, std::chrono::milliseconds interval)
    : client_(client), lease_(lease), interval_(interval) {
  if (interval <= std::chrono::milliseconds(0) || interval >= std::chrono::seconds(lease.ttl_s))
    throw ConfigError("lease keepalive interval " + format_duration(interval) +
                      " must be positive and below the lease TTL of " +
                      std::to_string(lease.ttl_s) + "s");
  thread_ = std::thread([this] { run(); });
}

LeaseKeeper::~LeaseKeeper() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::string LeaseKeeper::lost_reason() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reason_;
}

void LeaseKeeper::run() {
  using Clock = std::chrono::steady_clock;
  auto last_ok = Clock::now();
  std::chrono::milliseconds ttl = std::chrono::seconds(lease_.ttl_s);
  std::string reason;
  // The thread's boundary: nothing escapes it; whatever fails is reported
  // through lost()/lost_reason().
  try {
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        if (cv_.wait_for(lock, interval_, [this] { return stop_; })) return;
      }
      try {
        // One interval per member: a hung member (no answer, no reset) is
        // left in time for another to refresh the lease within its TTL.
        const std::int64_t granted = client_.lease_keepalive(lease_.id, interval_);
        if (granted <= 0) {
          reason = "lease " + std::to_string(lease_.id) + " expired or was revoked";
          break;
        }
        ttl = std::chrono::seconds(granted);
        last_ok = Clock::now();
      } catch (const Error& e) {
        if (Clock::now() - last_ok >= ttl) {
          reason = "lease " + std::to_string(lease_.id) + ": no keepalive succeeded for " +
                   format_duration(ttl) + ": " + e.what();
          break;
        }
        get_logger("etcd")->warn("lease={} keepalive failed, retrying: {}", lease_.id, e.what());
      }
    }
  } catch (const std::exception& e) {
    reason = std::string("lease keeper failed: ") + e.what();
  } catch (...) {
    reason = "lease keeper failed with an unknown exception";
  }
  std::lock_guard<std::mutex> lock(mutex_);
  reason_ = reason;
  lost_.store(true);
}

}  // namespace ctorchrun::etcd
