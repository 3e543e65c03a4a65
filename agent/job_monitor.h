#pragma once

// JobMonitor: the agent's background view of the rest of the job, on a store
// connection of its own. It
//  - beats this node's heartbeat ("alive/<node>") twice a second,
//  - watches the failure key of the current attempt ("attempt/<k>/failure")
//    and calls `notify` the moment another node (or this one) sets it,
//  - tracks which nodes stopped beating (dead after `node_timeout`),
//  - notices the loss of the store (errors for longer than `store_grace`),
//  - and ends on a record it cannot read (a protocol error naming the key) or
//    on a broken invariant of ours (an internal error), which the agent
//    reports as such, never as a lost store.
// `notify` is called from the monitor's thread; it must be quick (the agent
// passes Launcher::wake).

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
#include "store/store.h"

namespace ctorchrun::agent {

namespace keys {
std::string alive(int node);
std::string failure(int attempt);
std::string stopped(int attempt);      // ADD counter: nodes whose workers are stopped
std::string all_stopped(int attempt);  // set by the node that completes the count
std::string clean(int attempt);        // set by the host once worker keys are gone
std::string done(int attempt);         // ADD counter: nodes whose workers all succeeded
std::string all_done(int attempt);
std::string finished(int attempt, int node);  // node's workers all succeeded
std::string gone(int node);                   // set by a node that leaves for good
}  // namespace keys

class JobMonitor {
 public:
  JobMonitor(std::function<std::shared_ptr<store::Store>()> connect, int node, int nnodes,
             std::function<void()> notify, std::chrono::milliseconds node_timeout,
             std::chrono::milliseconds store_grace);
  ~JobMonitor();  // stops and joins the thread; notify is never called afterwards

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
  // True while the monitor reads the others' heartbeats (its last scan is
  // recent): dead_nodes() is then current, and every other node is alive.
  bool liveness_known() const;

 private:
  // Shared with the monitor's thread.
  struct State {
    std::function<std::shared_ptr<store::Store>()> connect;
    int node = 0;
    int nnodes = 0;
    std::function<void()> notify;  // called with `mutex` held, never after stop
    std::chrono::milliseconds node_timeout{};
    std::chrono::milliseconds store_grace{};

    std::atomic<int> attempt{0};
    std::atomic<bool> store_lost{false};
    mutable std::mutex mutex;
    bool stop = false;
    std::vector<std::pair<int, FailureRecord>> failures;
    std::string store_error;
    std::vector<int> dead;
    std::chrono::steady_clock::time_point last_scan{};
    std::optional<std::string> protocol_error;
    std::optional<std::string> internal_error;
    std::condition_variable stop_cv;
  };
  static void loop(const std::shared_ptr<State>& state);
  static void run_loop(const std::shared_ptr<State>& state);

  std::shared_ptr<State> state_;
  std::thread thread_;
};

}  // namespace ctorchrun::agent
