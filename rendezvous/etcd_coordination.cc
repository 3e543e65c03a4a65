// EtcdCoordination (rendezvous/coordination.h): the agents of an etcd-v3 job
// coordinate through an etcd cluster under <etcd_prefix>/, any member of
// which serves; presence lives on a lease each agent keeps alive.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/deadline.h"
#include "common/error.h"
#include "common/log.h"
#include "etcd/client.h"
#include "etcd/etcd_store.h"
#include "etcd/watch.h"
#include "rendezvous/coordination.h"
#include "rendezvous/endpoint.h"
#include "store/prefix_store.h"

namespace ctorchrun::rendezvous {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

class EtcdCoordination : public Coordination {
 public:
  explicit EtcdCoordination(const C10dOptions& options) : options_(options) {
    for (const auto& e : options_.etcd_endpoints) list_ += (list_.empty() ? "" : ",") + e;
    endpoint_ = "etcd " + list_;
    root_ = options_.etcd_prefix + "/";
    job_prefix_ = options_.job.run_id;
  }

  void open() override {
    client_ = std::make_shared<etcd::EtcdClient>(options_.etcd_endpoints, options_.read_timeout,
                                                 options_.etcd_tls);
    conn_ = std::make_shared<etcd::EtcdStore>(client_, root_);
    // Presence: keys on a lease that this agent keeps alive; they expire with
    // it (EtcdStore's held/lost markers answer the gone-marker checks).
    auto presence = std::make_shared<etcd::EtcdStore>(client_, root_);
    lease_ttl_ = std::max(options_.presence_ttl, milliseconds(2'000));
    try {
      presence->bind_keys_to_lease(lease_ttl_);
    } catch (const IoError& e) {
      throw Error("cannot reach the etcd cluster (" + list_ + "): " + e.what());
    }
    {
      std::lock_guard<std::mutex> lock(lease_mutex_);
      lease_store_ = presence;
    }
    presence_ = std::make_shared<store::PrefixStore>(job_prefix_, presence);
  }

  const std::string& describe() const override { return endpoint_; }
  std::shared_ptr<store::Store> store() const override { return conn_; }
  const std::string& job_prefix() const override { return job_prefix_; }
  OpenStore background() const override {
    return [endpoints = options_.etcd_endpoints, tls = options_.etcd_tls, root = root_](
               const std::string& prefix, milliseconds timeout) -> std::shared_ptr<store::Store> {
      // `timeout` bounds each request and each waiting read (get, wait),
      // as on the TCP store: a key that never comes costs a background
      // thread that much, not the store's default of minutes.
      auto c = std::make_shared<etcd::EtcdClient>(endpoints, timeout, tls);
      auto etcd = std::make_shared<etcd::EtcdStore>(c, root);
      etcd->set_timeout(timeout);
      auto s = std::make_shared<store::PrefixStore>(prefix, etcd);
      s->set_timeout(timeout);
      return s;
    };
  }
  std::shared_ptr<store::Store> presence() const override { return presence_; }
  bool hosts_endpoint() const override { return false; }

  Endpoint route_target() const override {
    return parse_endpoint(options_.etcd_endpoints.front(), 2379);
  }
  // etcd fails over between its members: only read_timeout without an answer
  // ends the job, and a node's lease tells its loss before its heartbeats do.
  void set_tolerance(RendezvousInfo& info) const override {
    info.store_grace = options_.read_timeout;
    info.liveness_window = lease_ttl_ + options_.read_timeout;
  }

  // Membership is learned from a watch on the generation's keys, not by
  // polling. A full check (a few reads) runs when a change arrives, when rank
  // 0's store closed, once more when an admission becomes due
  // (last_call_timeout after the round formed, if a change came before), and
  // every kSafetyCheck (a member that hangs without closing the watch's
  // stream shows nothing).
  MembershipCheck membership_check(const C10dRound& round, MembershipCheck full_check,
                                   std::function<bool()> rank0_gone) override {
    struct Events {
      std::unique_ptr<etcd::Watch> watch;
      bool dirty = true;
      std::optional<Clock::time_point> recheck_at;
      Clock::time_point last_full{};
    };
    auto events = std::make_shared<Events>();
    const std::string watched =
        root_ + job_prefix_ + "/g" + std::to_string(round.generation) + "/rdzv/";
    const auto admission_due = Clock::now() + options_.last_call_timeout;
    return [full_check, events, rank0_gone, client = client_, watched,
            admission_due](int attempt) -> std::optional<MembershipChange> {
      constexpr auto kSafetyCheck = milliseconds(5'000);
      constexpr int kMaxDrained = 10'000;
      auto& ev = *events;
      if (ev.watch) {
        try {
          for (int i = 0; i < kMaxDrained; ++i) {
            if (!ev.watch->next(Clock::now() + milliseconds(5))) break;
            ev.dirty = true;
          }
        } catch (const Error& e) {
          // Compacted, or no member took the stream back: read everything
          // again and watch anew.
          get_logger("rdzv")->debug("membership watch on {} ended: {}", watched, e.what());
          ev.watch.reset();
          ev.dirty = true;
        }
      }
      const auto now = Clock::now();
      const bool rank0_closed = rank0_gone && rank0_gone();
      const bool due = ev.recheck_at && now >= *ev.recheck_at;
      if (ev.watch && !ev.dirty && !due && !rank0_closed && now - ev.last_full < kSafetyCheck) {
        return std::nullopt;
      }
      // Watch from before the reads, so that no change after them is missed.
      std::int64_t revision = 0;
      if (!ev.watch) revision = client->range_prefix(watched + "watch-start").revision;
      auto change = full_check(attempt);
      if (ev.dirty && now < admission_due) {
        ev.recheck_at = admission_due;
      } else if (due) {
        ev.recheck_at.reset();
      }
      ev.dirty = false;
      ev.last_full = now;
      if (!change && !ev.watch) ev.watch = client->watch(watched, revision + 1, true);
      return change;
    };
  }
  // A lost agent's presence goes when its lease expires, seconds later;
  // rank 0's death shows at once as its workers' store closing.
  bool probes_rank0() const override { return true; }

  bool renew() override {
    if (!lease_store_) return false;
    std::string why;
    if (lease_store_->lease_lost()) {
      why = lease_store_->lease_lost_reason();
    } else {
      // The keeper learns of a revoked lease only at its next refresh (TTL/3
      // away): ask now, so that this node never enters a round on a lease
      // that is gone (its writes would fail with "lease not found").
      try {
        if (client_->lease_keepalive(lease_store_->lease_id()) == 0) {
          why = "etcd says it was revoked or has expired";
        }
      } catch (const Error& e) {
        get_logger("rdzv")->debug("could not check this node's etcd lease: {}", e.what());
      }
    }
    if (why.empty()) return false;
    get_logger("rdzv")->warn(
        "rendezvous '{}': this node's lease is gone ({}); the others count this node lost. "
        "Coming back under a new lease",
        options_.job.run_id, why);
    // Keys of the old lease went with it.
    lease_store_->bind_keys_to_lease(lease_ttl_);
    return true;
  }

  // Everything under <etcd_prefix>/<id>/ goes but the closed marker, which
  // moves to generation 0 on a lease of join_timeout: within it a node of
  // this id is refused, after it the prefix is empty.
  std::function<void()> tidy(const C10dRound& round) const override {
    return [client = client_, root = root_ + options_.job.run_id + "/",
            closed = C10dState::closed_key(round.generation),
            window = options_.closed_window.value_or(options_.join_timeout)] {
      auto rlog = get_logger("rdzv");
      try {
        auto marker = client->get(root + closed);
        client->delete_prefix(root);
        if (!marker) return;
        auto ttl =
            std::chrono::duration_cast<std::chrono::seconds>(window) + std::chrono::seconds(1);
        auto lease = client->lease_grant(ttl);
        client->put(root + C10dState::closed_key(0), marker->value, lease.id);
        rlog->debug("rendezvous keys under {} removed; the closed marker stays for {}", root,
                    format_duration(window));
      } catch (const Error& e) {
        rlog->warn("could not remove the rendezvous keys under {} from etcd: {}", root, e.what());
      }
    };
  }

  // Revokes the presence lease, so that this agent's keys go now.
  void abandon() noexcept override {
    std::shared_ptr<etcd::EtcdStore> lease_store;
    {
      // The signal thread may call this while the agent's thread opens.
      std::lock_guard<std::mutex> lock(lease_mutex_);
      lease_store = lease_store_;
    }
    if (!lease_store) return;
    try {
      const std::int64_t lease = lease_store->lease_id();
      if (lease == 0) return;
      // A client of its own with a short timeout: the agent's may be busy or
      // waiting on a member that does not answer.
      etcd::EtcdClient quick(options_.etcd_endpoints, milliseconds(2'000), options_.etcd_tls);
      quick.lease_revoke(lease);
    } catch (const std::exception& e) {
      get_logger("rdzv")->debug("could not revoke this node's etcd lease: {}", e.what());
    }
  }

 private:
  const C10dOptions options_;
  std::string list_;      // the members, comma-separated
  std::string endpoint_;  // "etcd <list>"
  std::string root_;      // <etcd_prefix>/
  std::string job_prefix_;
  std::shared_ptr<etcd::EtcdClient> client_;
  std::shared_ptr<etcd::EtcdStore> conn_;
  // The store whose keys live on this agent's lease (presence_ wraps it).
  std::shared_ptr<etcd::EtcdStore> lease_store_;
  std::mutex lease_mutex_;  // lease_store_'s assignment against abandon()
  std::shared_ptr<store::Store> presence_;
  std::chrono::milliseconds lease_ttl_{0};
};

}  // namespace

std::unique_ptr<Coordination> make_etcd_coordination(const C10dOptions& options) {
  return std::make_unique<EtcdCoordination>(options);
}

}  // namespace ctorchrun::rendezvous
