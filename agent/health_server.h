#pragma once

// TORCHELASTIC_HEALTH_CHECK_PORT=P: an HTTP endpoint on port P (bound on
// --status_host) that answers
//
//   GET /healthz  ->  200 while the agent runs its job, in every phase
//                     (rendezvous, running, restarting, stopping, the exit
//                     barrier), 503 once it has finished: torch's meaning of
//                     the port ("the agent is alive"), so that a Kubernetes
//                     liveness probe never restarts a pod that waits normally
//   GET /readyz   ->  200 while the workers run, 503 otherwise (a readiness
//                     probe)
//
// both with
//   {"state": "running", "attempt": 0, "run_id": "job7", "time": 1764032105.2,
//    "last_progress": null,
//    "file_timer": {"last_request": 1764032101.7, "active_timers": 1}}
//
//   state          "starting", "rendezvous", "running", "restarting",
//                  "stopping" or "finished"
//   attempt        the restarts so far (TORCHELASTIC_RESTART_COUNT's failed part)
//   time           the agent's clock, seconds since the epoch
//   last_progress  seconds since the epoch when a worker last made progress,
//                  as the agent's stall detection (--hang_timeout > 0) last
//                  saw it, refreshed about once a second; null without it
//                  and before its first sample
//   file_timer     null when TORCHELASTIC_ENABLE_FILE_TIMER is off; else the
//                  last well-formed request's time (null before the first)
//                  and the timers held (never the pipe's path: whoever
//                  reaches the port could write to it)
//
// With a JobStatus (--status_port, agent/job_status.h) the same server also
// answers
//
//   GET /metrics  ->  Prometheus' text exposition format (version 0.0.4)
//   GET /status   ->  the job as this agent knows it (JSON)
//   GET /         ->  a live page that draws /status (self-contained HTML)
//
// and 404 to any other path, 405 to any other method. torch's open-source
// agent reads the same variable, but the server it starts answers no request;
// the endpoint and its JSON are ours, documented in the README.
//
// Every client is on its own: a request must arrive whole (at most
// max_request_bytes of head) within read_timeout of the connection, else the
// connection is closed (431 for a head too large); one answer per connection.
// At most max_connections are open at once: a new one past the bound closes
// the oldest (a well-behaved client is answered as soon as its request
// arrives, so the oldest is the slowest). The server runs on a thread of its
// own and never blocks the agent.

#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "agent/file_timer.h"

namespace ctorchrun::agent {

inline constexpr const char* kHealthCheckPortEnv = "TORCHELASTIC_HEALTH_CHECK_PORT";

enum class AgentPhase { kStarting, kRendezvous, kRunning, kRestarting, kStopping, kFinished };
const char* phase_name(AgentPhase phase);

// What /healthz reports: written by the agent (and its stall detection),
// read by the server. Thread-safe; every call is short and never blocks on I/O.
class HealthStatus {
 public:
  void set_run_id(std::string run_id);
  void set_phase(AgentPhase phase);
  void set_attempt(int attempt);
  int attempt() const;
  // The last time any worker made progress. The stall detection feeds this;
  // a time older than the one held is ignored.
  void set_last_progress(std::chrono::system_clock::time_point t);
  // Where the file timer's figures come from (empty: the file timer is off).
  void set_file_timer(std::string path, std::function<FileTimerStats()> stats);

  bool alive() const;  // /healthz: not finished
  bool ready() const;  // /readyz: running
  // The JSON body above, with `now` as "time".
  std::string to_json(std::chrono::system_clock::time_point now) const;

 private:
  mutable std::mutex mutex_;
  std::string run_id_;
  AgentPhase phase_ = AgentPhase::kStarting;
  int attempt_ = 0;
  std::optional<std::chrono::system_clock::time_point> last_progress_;
  std::string file_timer_path_;
  std::function<FileTimerStats()> file_timer_stats_;
};

struct HealthServerOptions {
  std::string host = "0.0.0.0";  // as torch's stores bind
  int port = 0;                  // 0: a free port (read it back with port())
  size_t max_request_bytes = 8192;
  std::chrono::milliseconds read_timeout{5'000};
  size_t max_connections = 64;
};

class JobStatus;

class HealthServer {
 public:
  // Binds and starts serving; throws IoError when the address cannot be bound.
  // `job` (may be null: /metrics, /status and / are then 404) is the model
  // behind --status_port's endpoints.
  HealthServer(HealthServerOptions options, std::shared_ptr<const HealthStatus> status,
               std::shared_ptr<const JobStatus> job = nullptr);
  // Stops: closes every connection and joins the thread (promptly: nothing
  // it runs blocks).
  ~HealthServer();
  HealthServer(const HealthServer&) = delete;
  HealthServer& operator=(const HealthServer&) = delete;

  int port() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// The port asked for by TORCHELASTIC_HEALTH_CHECK_PORT in `env` (the
// launcher's environment): nullopt when unset. A value that is no port
// (0-65535) is nullopt too, with `*error` saying so (torch logs it and starts
// no server; so does the agent).
std::optional<int> health_check_port(const std::map<std::string, std::string>& env,
                                     std::string* error);

}  // namespace ctorchrun::agent
