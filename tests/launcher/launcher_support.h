#pragma once

// Helpers for end-to-end tests of the ctorchrun binary.

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tests/support/process.h"
#include "tests/support/temp_dir.h"
#include "tests/support/test_python.h"

namespace ctorchrun::testing {

struct LaunchResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr, merged
};

// Runs build/bin/ctorchrun with `args`, the test's environment plus `env`
// (CTORCHRUN_PYTHON=test_python() unless given), and a bound on time.
LaunchResult run_ctorchrun(const std::vector<std::string>& args,
                           std::map<std::string, std::string> env = {},
                           std::chrono::seconds timeout = std::chrono::seconds(120));

// Starts ctorchrun without waiting (for signal and multi-node tests).
std::unique_ptr<Process> start_ctorchrun(const std::vector<std::string>& args,
                                         std::map<std::string, std::string> env = {});

// A port that was free a moment ago, outside the kernel's ephemeral range.
int free_port();

std::string read_file(const std::string& path);
bool file_exists(const std::string& path);
// Waits (bounded) until `path` exists with non-empty content.
bool wait_for_file(const std::string& path, std::chrono::milliseconds timeout);
// True if the process is gone (or a zombie) within the timeout.
bool process_gone_within(int pid, std::chrono::milliseconds timeout);
// Reads the integers in the files of `dir` whose names start with `prefix`.
std::vector<int> read_pids(const std::string& dir, const std::string& prefix);
// Readiness signals. Reads `p`'s output (bounded) until a line contains
// `needle`; true if one did.
bool wait_for_line(Process& p, const std::string& needle, std::chrono::milliseconds timeout);
// Waits (bounded) until something accepts connections on 127.0.0.1:`port`.
bool wait_for_port(int port, std::chrono::milliseconds timeout);
// Number of lines of `text` containing `needle`.
int count_lines_with(const std::string& text, const std::string& needle);

// The lines of the file at `path` (none when it is missing).
std::vector<std::string> lines_of(const std::string& path);
// Waits until the file at `path` has at least `n` lines.
bool wait_for_lines(const std::string& path, size_t n, std::chrono::milliseconds timeout);

// A shell worker for elastic tests: appends "<WORLD_SIZE> <restarts charged>"
// (CTORCHRUN_FAILED_RESTARTS: re-formations are not charged) to
// `record_file`, then runs until `stop_file` exists (at most 60 s).
std::vector<std::string> recording_worker(const std::string& record_file,
                                          const std::string& stop_file);

// A worker written in sh: `body` runs with the worker's environment.
std::vector<std::string> sh(const std::string& body);

// `a` followed by `b`.
std::vector<std::string> concat(std::vector<std::string> a, const std::vector<std::string>& b);

}  // namespace ctorchrun::testing
