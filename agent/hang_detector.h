#pragma once

// HangDetector: --hang_timeout, a job-wide hang found from outside the
// workers (worker/progress_sampler.h says what counts as progress).
//
// Per node: a thread of its own samples every local worker's process tree
// every sample_interval and keeps one stall clock per worker. The node's
// local verdict is "stalled for D": every local worker has made no progress
// for at least D (a worker that exited counts as stalled since its last
// progress). The node publishes it through the agents' store under
// stall/<attempt>/<node> (agent/protocol.h) once a publish_interval, and at
// once when D first reaches the timeout: one set per node per interval.
//
// Per job: the node that publishes liveness (the store host, MonitorOptions::
// hosts_store) decides. While its own workers are all stalled for the
// timeout it reads every node's key (two requests: check, multi_get); the
// job is hung when every node reports D >= timeout. Each node measures D on
// its own steady clock, so no verdict depends on clocks agreeing across
// machines; the wall-clock stall starts only name the rank that stalled
// first. The verdict is written as the attempt's failure record
// (attempt/<k>/failure, first writer wins, hang = true), which every node's
// JobMonitor already watches: every node learns it at once, and it counts
// against --max_restarts like any failure. A real failure written first
// stands.
//
// Thread safety: every method may be called from any thread. The
// destructor stops and joins the thread at once (a store call it is blocked
// in is interrupted).

#include <sys/types.h>

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
#include "worker/progress_sampler.h"

namespace ctorchrun::agent {

struct HangOptions {
  std::chrono::milliseconds timeout{0};
  int node = 0;
  int nnodes = 1;
  bool decides = false;  // this node publishes liveness
  std::string host;      // this node's name, for the failure record
  std::chrono::milliseconds sample_interval{250};
  std::chrono::milliseconds publish_interval{1'000};
  std::function<std::chrono::steady_clock::time_point()> now = std::chrono::steady_clock::now;
  std::function<std::chrono::system_clock::time_point()> wall_now = std::chrono::system_clock::now;
  std::function<worker::ProgressSample(pid_t, const std::vector<std::string>&)> sample =
      [](pid_t pid, const std::vector<std::string>& files) {
        return worker::sample_progress(pid, files);
      };
};

// One local worker under watch.
struct WatchedWorker {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = 0;
  std::vector<std::string> output_files;  // teed or redirected streams
};

// One rank's stall in a node's verdict: when it last progressed (ms since
// the epoch, the node's wall clock).
struct RankStall {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = 0;
  int64_t since_ms = 0;
};

// A node's local verdict, the value at stall/<attempt>/<node>:
//   {"stalled_ms": int (how long every local worker has been stalled; 0
//    while one progresses), "ranks": [{"rank", "local_rank", "pid",
//    "since_ms"}]}
struct NodeStall {
  int node = 0;
  int64_t stalled_ms = 0;
  std::vector<RankStall> ranks;
  // The node's workers all finished (it waits in its exit barrier): stalled
  // for the verdict, never the rank a verdict names ("finished": true).
  bool finished = false;

  std::string to_json() const;
  // Throws ProtocolError naming `key` for anything but that shape.
  static NodeStall from_json(const std::string& json, int node, const std::string& key);
};

// The job's verdict from every node's (nullopt: not published yet): hung
// when every node is stalled for `timeout`. The record names the rank whose
// stall started first (ties: the lower rank) among the nodes still running
// workers, and says it is a hang.
std::optional<FailureRecord> decide_hang(const std::vector<std::optional<NodeStall>>& nodes,
                                         std::chrono::milliseconds timeout,
                                         const std::vector<std::string>& hosts, int attempt);

class HangDetector {
 public:
  HangDetector(std::function<std::shared_ptr<store::Store>()> connect, HangOptions options);
  ~HangDetector();

  // Watches the workers of `attempt` (replacing any before): their clocks
  // start now. `hosts` names every node of the round, for the record.
  void watch(int attempt, std::vector<WatchedWorker> workers, std::vector<std::string> hosts);
  // Stops watching (the workers are being stopped): nothing is published
  // or decided until the next watch().
  void unwatch();
  // This node's workers have all finished and it waits for the others (the
  // exit barrier): its workers count as stalled since their last progress,
  // no longer sampled (their pids may be reused), and the node goes on
  // publishing and, if it decides, deciding, so that the rest of the job is
  // still judged. Until unwatch() or the next watch().
  void finished();
  // The last time any watched worker of this node made progress (wall
  // clock); nullopt before the first sample. For the health endpoint.
  std::optional<std::chrono::system_clock::time_point> last_progress() const;
  // This node's last local verdict (for tests and logs).
  std::optional<NodeStall> local_verdict() const;

 private:
  struct State;
  static void loop(const std::shared_ptr<State>& st);
  std::shared_ptr<State> state_;
  std::thread thread_;
};

}  // namespace ctorchrun::agent
