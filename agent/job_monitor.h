#pragma once

// JobMonitor: the agent's background view of the rest of the job, on a store
// connection of its own (the keys are in agent/protocol.h). It
//  - beats this node's heartbeat ("alive/<node>") every keep_alive_interval,
//  - on the store host only: reads every node's heartbeat and the "gone/<n>"
//    markers each interval and publishes the dead and departed nodes as one
//    key ("liveness"); on the other nodes: reads that one key,
//  - watches the failure key of the current attempt ("attempt/<k>/failure")
//    and calls `notify` the moment another node (or this one) sets it,
//  - on elastic rounds, asks whether the round must give way (nodes wait to
//    be admitted) and calls `notify` once it must; its view then ends with
//    the round (the thread stops),
//  - notices the loss of the store (a request fails when the store has not
//    answered one for `store_grace`),
//  - and ends on a record it cannot read (a protocol error naming the key) or
//    on a broken invariant of ours (an internal error), which the agent
//    reports as such, never as a lost store.
// `notify` is called from the monitor's thread with the monitor's mutex held;
// it must be quick (the agent passes Launcher::wake). Every accessor is
// thread-safe and does not block on the store.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "agent/failure_summary.h"
#include "rendezvous/handler.h"
#include "store/store.h"

namespace ctorchrun::agent {

struct MonitorOptions {
  int node = 0;
  int nnodes = 1;
  bool hosts_store = false;  // evaluates liveness and publishes it
  // torchrun's keep-alive settings: dead after interval x max_attempt.
  std::chrono::milliseconds keep_alive_interval{5'000};
  int keep_alive_max_attempt = 3;
  std::chrono::milliseconds store_grace{5'000};
  std::chrono::milliseconds failure_poll{250};  // each wait on the failure key
  std::function<std::chrono::steady_clock::time_point()> now = std::chrono::steady_clock::now;
  // Elastic rounds: asked every membership_poll whether the round must give
  // way (rendezvous::RendezvousInfo::check_membership); empty: never.
  std::function<std::optional<rendezvous::MembershipChange>(int attempt)> membership;
  std::chrono::milliseconds membership_poll{250};
  // A job of this node alone, which hosts the store, on fixed membership
  // with nothing else writing its failure key (no hang detector): there is
  // nothing to watch, so the monitor runs no thread and opens no connection
  // (every launch and exit would otherwise pay for both). Its accessors then
  // report nothing: no failure, no loss, no dead or departed node.
  bool alone = false;

  std::chrono::milliseconds liveness_window() const {
    return keep_alive_interval * keep_alive_max_attempt;
  }
};

class JobMonitor {
 public:
  JobMonitor(std::function<std::shared_ptr<store::Store>()> connect, MonitorOptions options,
             std::function<void()> notify);
  // Stops and joins the thread at once (a store call it is blocked in is
  // interrupted); notify is never called afterwards.
  ~JobMonitor();

  void watch_attempt(int attempt);
  // The failure record of `attempt`, once its key has been seen.
  std::optional<FailureRecord> failure(int attempt) const;
  bool store_lost() const { return state_->store_lost; }
  std::string store_error() const;
  // Set when a record in the store could not be read (ProtocolError's text).
  std::optional<std::string> protocol_error() const;
  // Set when the monitor's thread hit a bug of ours (InternalError's text).
  std::optional<std::string> internal_error() const;
  // Nodes whose heartbeat stopped (and that did not say they left).
  std::vector<int> dead_nodes() const;
  // Nodes that said they left (gone/<n>).
  std::vector<int> departed_nodes() const;
  // True while the view is current: the host published it within the
  // liveness window. Every other node not dead nor departed is then alive.
  bool liveness_known() const;
  // Set once the round must give way to the next (MonitorOptions::membership).
  std::optional<rendezvous::MembershipChange> membership_change() const;

 private:
  struct State {
    std::function<std::shared_ptr<store::Store>()> connect;
    MonitorOptions options;
    std::function<void()> notify;  // called with `mutex` held, never after stop

    std::atomic<int> attempt{0};
    std::atomic<bool> store_lost{false};
    mutable std::mutex mutex;
    std::condition_variable stop_cv;
    bool stop = false;
    // The thread's store connection: the destructor interrupts a call
    // blocked on it, so that stopping never waits out a poll slice.
    std::shared_ptr<store::Store> conn;
    std::vector<std::pair<int, FailureRecord>> failures;
    std::string store_error;
    std::vector<int> dead;
    std::vector<int> gone;
    std::optional<std::chrono::steady_clock::time_point> known_at;  // view last current
    std::optional<std::string> protocol_error;
    std::optional<std::string> internal_error;
    std::optional<rendezvous::MembershipChange> membership_change;
  };
  class Pass;  // the thread's work, one method per duty (job_monitor.cc)
  static void loop(const std::shared_ptr<State>& state);
  static void run_loop(const std::shared_ptr<State>& state);

  std::shared_ptr<State> state_;
  std::thread thread_;
};

}  // namespace ctorchrun::agent
