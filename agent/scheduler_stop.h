#pragma once

// Stops that come from the batch scheduler (LaunchConfig::scheduler): under
// Slurm, scancel, preemption, a time limit's --signal warning and srun's
// Ctrl-C signal every process of the job step, the workers included. The
// agent then must not forward its own copy (a worker would get the signal
// twice), must not count the workers' deaths by that signal as a failure
// worth a restart, and ends with kExitSchedulerStop so that a job script can
// requeue. Pure functions of the config; the agent's loop applies them.

#include <chrono>
#include <string>

#include "agent/launch_config.h"
#include "worker/launcher.h"

namespace ctorchrun::agent {

// True when `sig` is one the scheduler delivers to every process of the job
// itself (LaunchConfig::scheduler_signals).
bool is_scheduler_signal(const LaunchConfig& config, int sig);

// True when a worker's exit may be the scheduler's doing: under a scheduler,
// death by one of its signals, or exit code 128+N for one (a shell or a
// handler that re-raises as an exit code).
bool may_be_scheduler_stop(const LaunchConfig& config, const worker::WorkerExit& exit);

// How long the agent waits, after such an exit, for its own copy of the
// scheduler's signal before it takes the exit for a failure. Slurm signals
// the step's processes one after the other within milliseconds.
constexpr std::chrono::milliseconds kSchedulerSignalGrace{2000};

// The launcher's exit code after `sig`: kExitSchedulerStop for a scheduler
// signal, 128+sig otherwise.
int signal_exit_code(const LaunchConfig& config, int sig);

// "stopped by the scheduler (SIGTERM from slurm)" or "stopped by SIGHUP".
std::string signal_stop_message(const LaunchConfig& config, int sig);

}  // namespace ctorchrun::agent
