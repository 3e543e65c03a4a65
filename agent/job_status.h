#pragma once

// JobStatus: the job as this agent knows it, for --status_port's endpoints
// (agent/health_server.h): GET /status (JSON) and GET /metrics (Prometheus'
// text exposition format, version 0.0.4).
//
// The agent tells it what happens (a round formed, workers started, a worker
// exited, an attempt failed, a restart, a node lost); a sampler thread of
// its own (StatusSampler) reads each local worker's CPU time, RSS and
// progress from /proc once a second, and the store this node hosts, if any.
// Every method is thread-safe, short, and never does I/O: a request renders
// a snapshot copied under the lock, outside it.
//
// GET /status:
//   {"version": "0.1.0", "time": 1764032105.2, "run_id": "job7",
//    "node_rank": 0, "host": "node-a", "rdzv_backend": "c10d",
//    "state": "running", "attempt": 1, "round": 2, "max_restarts": 3,
//    "world_size": 4, "started": 1764032000.0,
//    "restarts": {"failure": 1, "hang": 0, "membership": 1, "scheduler": 0},
//    "worker_failures": 1,
//    "nodes": [{"group_rank": 0, "host": "node-a", "state": "present",
//               "local_world_size": 2, "first_rank": 0, "pid": 4242}, ...],
//    "ranks": [{"local_rank": 0, "rank": 0, "pid": 123, "state": "running",
//               "last_progress": 1764032105.0, "stalled_s": 0.3,
//               "cpu_s": 1.2, "rss_bytes": 12345678}, ...],
//    "failures": [{"time": 1764032050.1, "attempt": 0, "rank": 1, "node": 0,
//                  "host": "node-a", "cause": "exit code 3"}, ...],
//    "history": [{"time": 1764032050.2, "event": "restart", "attempt": 1,
//                 "reason": "failure", "detail": "rank 1 failed with exit code 3"}, ...],
//    "hang": {"enabled": true, "timeout_s": 30.0, "stalled_s": 0.0},
//    "store": {"role": "rendezvous", "connections": 4, "keys": 17,
//              "requests": {"set": 10, "get": 20, ...}} or null,
//    "stores": [every store this node hosts, as "store"]}
//
//   time, started, last_progress: seconds since the epoch (agent's clock);
//   last_progress and stalled_s are null before the first sample.
//   node_rank: -1 before the first round. state: "starting", "rendezvous",
//   "running", "restarting", "stopping" or "finished". Node states:
//   "present", "lost" (gone without saying: its agent exited or fell
//   silent), "left" (it said it was leaving: finished or stopped). Rank
//   states: "running", "succeeded", "failed", "stopped". failures: the last
//   20, oldest first; history: the last 100 lifecycle events, oldest first
//   ("rendezvous", "workers_started", "attempt_failed", "restart",
//   "node_lost", "node_joined", "hang_detected", "finished").
//   store: the first of stores (null: this node hosts none). Roles: "job"
//   (static: node 0's, the agents' and the workers'), "rendezvous" (c10d:
//   the endpoint's), "workers" (c10d: the round's, on group rank 0).
//   Never the workers' environment or arguments.

#include <sys/types.h>

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "agent/health_server.h"
#include "rendezvous/handler.h"
#include "store/tcp_store_server.h"

namespace ctorchrun::agent {

// Why every worker was restarted: ctorchrun_restarts_total's reason label.
enum class RestartReason { kFailure, kHang, kMembership, kScheduler };
const char* reason_name(RestartReason reason);

struct StatusNode {
  int group_rank = 0;
  std::string host;
  std::string state = "present";
  int local_world_size = 0;
  int first_rank = 0;
  int pid = 0;  // its agent's, which tells apart two nodes of one host
};

struct StatusRank {
  int local_rank = 0;
  int rank = 0;
  pid_t pid = 0;
  std::string state = "running";
  std::optional<double> last_progress;  // epoch seconds
  std::optional<double> stalled_s;
  double cpu_s = 0;
  int64_t rss_bytes = 0;
};

struct StatusFailure {
  double time = 0;
  int attempt = 0;
  int rank = -1;
  int node = -1;
  std::string host;
  std::string cause;
};

// A store this node hosts, as its server counts.
using StoreFigures = rendezvous::HostedStore;

// A histogram with Prometheus' cumulative buckets (seconds).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double value);
  // "<name>_bucket{le=...} n" ... "<name>_sum" "<name>_count".
  std::string render(const std::string& name, const std::string& labels) const;
  uint64_t count() const { return count_; }

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> buckets_;  // per bound, not cumulative
  uint64_t count_ = 0;
  double sum_ = 0;
};

struct JobStatusOptions {
  std::string run_id;
  std::string rdzv_backend;
  std::string host;
  int max_restarts = 0;
  double hang_timeout_s = 0;  // 0: --hang_timeout off
  std::function<std::chrono::system_clock::time_point()> now = std::chrono::system_clock::now;
};

class JobStatus {
 public:
  using Clock = std::chrono::system_clock;
  explicit JobStatus(JobStatusOptions options);
  ~JobStatus();

  void set_phase(AgentPhase phase);
  void rendezvous_started();
  // A round formed: this node's group rank, the members (empty: the backend
  // did not read them; only the count is known), its first global rank.
  void round_formed(int round, int attempt, int group_rank, int group_world_size,
                    std::vector<StatusNode> nodes, int world_size);
  void workers_started(int attempt, int first_rank, const std::vector<pid_t>& pids);
  void worker_exited(int local_rank, bool failed);
  // The attempt failed (the root cause, wherever it is). `at`: when the
  // failure happened (its record's timestamp), for the detection latency.
  void attempt_failed(const StatusFailure& root, Clock::time_point at, bool hang);
  void restart(RestartReason reason, int next_attempt, const std::string& detail);
  // A member lost (`left`: it said so) in the round now giving way.
  void node_lost(int group_rank, const std::string& cause, bool left);
  void hang_detected(int first_stalled_rank);
  void finished(int exit_code);
  // The sampler's figures for each local rank (in local rank order).
  void set_samples(std::vector<StatusRank> ranks);
  void set_stores(std::vector<StoreFigures> stores);
  void set_stalled(std::optional<double> stalled_s);

  std::vector<pid_t> pids() const;
  std::string status_json() const;
  std::string metrics_text() const;

 private:
  struct State;
  void record(State& s, const std::string& event, const std::string& detail) const;
  const JobStatusOptions options_;
  mutable std::mutex mutex_;
  std::unique_ptr<State> state_;
};

// Samples every local worker (CPU time, RSS, progress) once an interval
// and the hosted store's figures, into a JobStatus. A thread of its own;
// the destructor stops it promptly.
class StatusSampler {
 public:
  StatusSampler(std::shared_ptr<JobStatus> status,
                std::function<std::vector<StoreFigures>()> store_figures,
                std::chrono::milliseconds interval = std::chrono::milliseconds(1000),
                std::string proc_root = "/proc");
  ~StatusSampler();
  StatusSampler(const StatusSampler&) = delete;
  StatusSampler& operator=(const StatusSampler&) = delete;

 private:
  void loop();
  std::shared_ptr<JobStatus> status_;
  std::function<std::vector<StoreFigures>()> store_figures_;
  std::chrono::milliseconds interval_;
  std::string proc_root_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace ctorchrun::agent
