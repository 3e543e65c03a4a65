#pragma once

// Test helper: a child process in a process group of its own, with its stdout
// on a pipe. The destructor SIGKILLs the whole group and reaps the child, so a
// failing test leaves nothing behind.

#include <sys/types.h>

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace ctorchrun::testing {

class Process {
 public:
  // Starts argv[0] (a path) with the current environment plus `env`.
  // stdout is captured; stderr goes to the test's stderr unless
  // `capture_stderr`, which merges it into the captured stream.
  Process(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {},
          bool capture_stderr = false);
  ~Process();
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }

  // Next line of output (without '\n'), or nullopt on timeout or EOF.
  std::optional<std::string> read_line(std::chrono::milliseconds timeout);
  // Everything until EOF or timeout, appended after what read_line left over.
  std::string read_all(std::chrono::milliseconds timeout);

  // Waits for the exit; returns the raw wait status, or nullopt on timeout.
  std::optional<int> wait(std::chrono::milliseconds timeout);
  // Exit code, or 128+signal for a death by signal; -1 if still running at timeout.
  int exit_code(std::chrono::milliseconds timeout);

  void signal(int sig);        // to the process
  void signal_group(int sig);  // to its process group

 private:
  pid_t pid_ = -1;
  int out_fd_ = -1;
  bool reaped_ = false;
  int status_ = 0;
  std::string buffer_;
};

// Reads lines until one matches "listening on HOST:PORT" and returns PORT, or
// 0 if none arrived within the timeout.
int wait_for_listening_port(Process& p, std::chrono::milliseconds timeout);

// Resident set size of a process in KiB (from /proc/PID/status).
long rss_kib(pid_t pid);

}  // namespace ctorchrun::testing
