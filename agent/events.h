#pragma once

// --events_file: one JSON object per line for every lifecycle event, appended
// (and with --event_log_handler=console the same lines on stderr).
//
//   {"time": "2026-11-22T14:35:48.123Z", "event": "workers_started", "run_id": "none",
//    "node_rank": 0, "attempt": 0, ...event fields}
//
// Events: rendezvous, workers_started, worker_exited, attempt_failed, restart,
// workers_stopped, finished (with exit_code), signal; with --hang_timeout,
// hang_detected (ranks, first_stalled_rank, first_stalled_node, timeout_s)
// at the verdict and hang_diagnosed (frames, first_stalled_rank,
// diagnosis_ms) once the stacks are collected. Thread-safe; a write
// failure is logged once and never stops the job.

#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>

namespace ctorchrun::agent {

class EventLog {
 public:
  // Empty path and no console: events are dropped. `console`: each line is
  // also queued on stderr (worker::Console). Throws ConfigError if the file
  // cannot be opened.
  EventLog(const std::string& path, std::string run_id, int node_rank, bool console = false);

  void emit(const std::string& event, int attempt,
            nlohmann::json fields = nlohmann::json::object());
  // Whether emitted events go anywhere (a caller may skip gathering them).
  bool enabled() const { return to_file_ || to_console_; }

 private:
  std::mutex mutex_;
  std::ofstream out_;
  std::string run_id_;
  int node_rank_;
  bool to_file_ = false;
  bool to_console_ = false;
  bool failed_ = false;
};

// RFC 3339 UTC with milliseconds.
std::string rfc3339_now();

}  // namespace ctorchrun::agent
