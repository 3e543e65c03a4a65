#include "worker/launcher.h"

#include <signal.h>
#include <string.h>

namespace ctorchrun::worker {

std::string signal_name(int sig) {
  // sigabbrev_np (glibc 2.32) is async-signal-safe and knows every name.
  if (const char* abbrev = ::sigabbrev_np(sig)) return std::string("SIG") + abbrev;
  return "signal " + std::to_string(sig);
}

std::string describe(const WorkerExit& exit) {
  if (exit.signaled)
    return "signal " + signal_name(exit.signal) + " (" + std::to_string(exit.signal) + ")";
  return "exit code " + std::to_string(exit.exit_code);
}

}  // namespace ctorchrun::worker
