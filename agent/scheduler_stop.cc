#include "agent/scheduler_stop.h"

#include <algorithm>

#include "common/exit_codes.h"

namespace ctorchrun::agent {

bool is_scheduler_signal(const LaunchConfig& config, int sig) {
  if (config.scheduler.empty() || sig <= 0) return false;
  const auto& s = config.scheduler_signals;
  return std::find(s.begin(), s.end(), sig) != s.end();
}

bool may_be_scheduler_stop(const LaunchConfig& config, const worker::WorkerExit& exit) {
  if (exit.signaled) return is_scheduler_signal(config, exit.signal);
  return exit.exit_code > 128 && is_scheduler_signal(config, exit.exit_code - 128);
}

int signal_exit_code(const LaunchConfig& config, int sig) {
  return is_scheduler_signal(config, sig) ? kExitSchedulerStop : kExitSignalBase + sig;
}

std::string signal_stop_message(const LaunchConfig& config, int sig) {
  if (is_scheduler_signal(config, sig)) {
    return "stopped by the scheduler (" + worker::signal_name(sig) + " from " + config.scheduler +
           "); not a failure: the job may be requeued";
  }
  return "stopped by " + worker::signal_name(sig);
}

}  // namespace ctorchrun::agent
