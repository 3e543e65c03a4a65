#pragma once

// The elastic agent: rendezvous -> assign ranks -> start workers -> watch ->
// on a failure anywhere in the job, stop every node's workers, count one
// job-wide restart and start again (or give up) -> on success, exit barrier.
//
// The loop is synchronous with explicit deadlines; worker exits, signals and
// news from other nodes wake it through Launcher::wake(), never by polling.

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "agent/events.h"
#include "agent/failure_summary.h"
#include "agent/launch_config.h"
#include "rendezvous/handler.h"
#include "worker/launcher.h"

namespace ctorchrun::agent {

struct RunResult {
  int exit_code = 0;    // the launcher's exit code (common/exit_codes.h)
  std::string message;  // why, when not 0 (not logged yet: the caller logs it once)
  // When the job failed for good and the root cause is on this node: this
  // node's failures of the last attempt, for torchrun's failure summary
  // (format_failure_summary). Empty otherwise: the summary is on another node.
  std::vector<FailureRecord> failures;
  // A temporary log directory kept because a log in it has content; empty
  // when there is none (removed, or --log_dir given).
  std::string kept_log_dir;
  // Worker log files that could not be written in full (each already warned
  // about); main names them after the failure summary.
  std::vector<std::string> truncated_logs;
};

// Signals arrive on a thread of their own (sigwait); the agent decides what a
// signal means in its current phase. Construct after blocking the signals.
class SignalRelay {
 public:
  virtual ~SignalRelay() = default;
  // Called once per signal from the signal thread.
  virtual void on_signal(int sig) = 0;
};

// Blocks `signals` in the calling thread (call before any thread starts, so
// every thread inherits the mask) and restores their default disposition so a
// blocked signal is not discarded: an inherited SIG_IGN would otherwise drop
// it (torchrun 1.13 ignores such a SIGINT). SIGHUP inherited as ignored (nohup)
// stays ignored.
void block_signals(const std::vector<int>& signals);

// Starts a thread that sigwait()s for `signals` and hands each to the relay
// currently registered (see set_signal_relay); with none registered, the
// process exits at once with 128+N. Returns immediately.
void start_signal_thread(const std::vector<int>& signals);
// Registers the relay (null: none). Waits for a call to the previous relay
// that is in progress, so after it returns the previous one is never called.
void set_signal_relay(SignalRelay* relay);
SignalRelay* signal_relay();

class ElasticAgent : public SignalRelay {
 public:
  ElasticAgent(const LaunchConfig& config, rendezvous::Handler& rendezvous,
               worker::Launcher& launcher, EventLog& events);
  ~ElasticAgent() override;  // unregisters itself if it is the signal relay

  RunResult run();
  void on_signal(int sig) override;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// Builds the real rendezvous, launcher and event log from `config` and runs
// the agent. Every failure of the world ends in a RunResult with its exit code.
RunResult run(const LaunchConfig& config);

}  // namespace ctorchrun::agent
