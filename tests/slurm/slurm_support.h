#pragma once

// A real Slurm cluster for tests: munged with a key and socket of its own,
// slurmctld and four slurmd (nodes n1..n4, `slurmd -N nX`, NodeAddr
// 127.0.0.X, each on a free port) on this host, in a temporary directory.
// The node names resolve through /etc/hosts entries "127.0.0.X nX", added
// once (idempotently). Everything is stopped by pid in the destructor, after
// every job is cancelled.

#include <sys/types.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "tests/support/temp_dir.h"

namespace ctorchrun::testing {

struct CommandResult {
  int exit_code = -1;  // 128+N for a death by signal N; -1: still running at the timeout (killed)
  std::string output;  // stdout and stderr, merged
};

// Runs argv (argv[0] looked up on PATH) with the test's environment plus
// `env`, bounded by `timeout` (then SIGKILLed).
CommandResult run_command(const std::vector<std::string>& argv,
                          const std::map<std::string, std::string>& env = {},
                          std::chrono::milliseconds timeout = std::chrono::seconds(30));

std::string read_text(const std::string& path);
void write_text(const std::string& path, const std::string& text, int mode = 0644);
// Waits (bounded) until the file at `path` has at least `n` lines.
bool wait_for_lines(const std::string& path, size_t n, std::chrono::milliseconds timeout);
std::vector<std::string> lines_of(const std::string& path);
// A port free a moment ago on every address, below the ports ctorchrun
// derives for steps (for a daemon or an agent's endpoint).
int daemon_port();

class SlurmCluster {
 public:
  // Starts everything and waits (bounded) until the four nodes are idle;
  // throws std::runtime_error saying what did not start (with its log).
  // `proctrack`: how slurmd tracks a task's processes (what scancel reaches).
  explicit SlurmCluster(std::string proctrack = "proctrack/linuxproc");
  ~SlurmCluster();
  SlurmCluster(const SlurmCluster&) = delete;
  SlurmCluster& operator=(const SlurmCluster&) = delete;

  // SLURM_CONF for clients (sbatch, srun, scontrol...).
  std::map<std::string, std::string> env() const;
  // Runs a Slurm client command against this cluster.
  CommandResult run(const std::vector<std::string>& argv,
                    std::chrono::milliseconds timeout = std::chrono::seconds(30)) const;
  // Submits a batch script (text) with sbatch `options`; returns the job id.
  std::string sbatch(const std::vector<std::string>& options, const std::string& script) const;
  // The job's state (squeue, else sacct-less `scontrol show job`): "RUNNING",
  // "COMPLETED"...; empty when unknown.
  std::string job_state(const std::string& job) const;
  // Waits (bounded) until the job is in one of the end states; returns the
  // last state seen.
  std::string wait_for_job_end(const std::string& job, std::chrono::milliseconds timeout) const;
  // Waits (bounded) until the job runs.
  bool wait_for_job_running(const std::string& job, std::chrono::milliseconds timeout) const;
  // Kills the slurmd of node `n` (1..4) with SIGKILL.
  void kill_slurmd(int n);
  const std::string& dir() const { return dir_.path; }
  // Milliseconds from the constructor's start to four idle nodes.
  long start_ms() const { return start_ms_; }
  // The logs of the daemons (for INFO on failure).
  std::string logs() const;

 private:
  void stop();
  // Mode 0755 under /tmp: munged runs as the munge user and traverses it to
  // its socket directory.
  TempDir dir_;
  pid_t munged_ = -1;
  pid_t slurmctld_ = -1;
  std::vector<pid_t> slurmd_;
  long start_ms_ = 0;
  std::string proctrack_;
  bool node_killed_ = false;
};

}  // namespace ctorchrun::testing
