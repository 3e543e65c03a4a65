#pragma once

// What a hang verdict collects from this node's workers before they are
// stopped (--hang_timeout; the verdict is agent/hang_detector.h's), within a
// total bound (10 s by default), every worker at once:
//  1. the NCCL flight recorder's dump, when the workers enabled it
//     (TORCH_NCCL_TRACE_BUFFER_SIZE > 0 and TORCH_NCCL_DEBUG_INFO_PIPE_FILE
//     set): a byte written to "${TORCH_NCCL_DEBUG_INFO_PIPE_FILE}<rank>.pipe",
//     the FIFO torch's ProcessGroupNCCL reads, makes it dump its trace to
//     "${TORCH_NCCL_DEBUG_INFO_TEMP_FILE}<rank>"; the dump's appearance is
//     awaited up to flight_recorder_wait;
//  2. native stacks of every thread, with `eu-stack -p <pid>` where
//     elfutils is installed;
//  3. Python stacks of every thread: SIGABRT to the worker, whose
//     PYTHONFAULTHANDLER (set by the agent in hang mode) prints them to fd 2,
//     which in hang mode reaches the agent's log file of the worker's stderr.
//     The worker's RLIMIT_CORE is set to 0 first (prlimit(2)), so that the
//     abort dumps no core.
// Everything of a rank goes to <dir>/hang.txt (its attempt's log directory).
// From the Python stacks each rank's frame is named: the innermost frame of
// its main thread ("all_reduce at distributed_c10d.py:1536").
//
// Blocks up to `budget`. Never throws for what the workers or the tools do;
// a step that fails is written in hang.txt instead.

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

namespace ctorchrun::agent {

struct DiagnosisTarget {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = 0;
  std::string dir;          // hang.txt goes here
  std::string stderr_path;  // the worker's stderr as the agent writes it
};

struct DiagnosisOptions {
  std::chrono::milliseconds budget{10'000};
  // Flight recorder: empty pipe_prefix, off.
  std::string pipe_prefix;
  std::string dump_prefix = "/tmp/nccl_trace_rank_";  // torch's default temp file
  std::chrono::milliseconds flight_recorder_wait{2'000};
  std::string eu_stack;  // path of eu-stack; empty: no native stacks
  std::chrono::milliseconds native_wait{3'000};
  std::chrono::milliseconds abort_wait{3'000};
};

struct RankFrame {
  int rank = 0;
  std::string frame;  // "" when no stack could be read
};

// Runs the three steps for every target; returns each rank's frame, in the
// targets' order.
std::vector<RankFrame> diagnose_hang(const std::vector<DiagnosisTarget>& targets,
                                     const DiagnosisOptions& options);

// The options from the workers' environment: the flight recorder when
// TORCH_NCCL_TRACE_BUFFER_SIZE > 0 and TORCH_NCCL_DEBUG_INFO_PIPE_FILE is
// set, eu-stack when found in `path` (a PATH value).
DiagnosisOptions diagnosis_options(const std::string& trace_buffer_size,
                                   const std::string& pipe_file, const std::string& dump_file,
                                   const std::string& path);

// Asks one rank's flight recorder for its dump: opens the FIFO for writing
// without blocking (retrying while it has no reader) until `wait`, writes a
// byte. True when the request was delivered.
bool request_flight_recorder(const std::string& pipe, std::chrono::milliseconds wait);

// The innermost frame of the main thread in CPython's output: a
// faulthandler dump ("File "x.py", line 12 in f", most recent call first,
// the main thread's block last) or a traceback ("File "x.py", line 12, in
// f", most recent call last). "f at x.py:12", with the source line in
// parentheses when the file can be read (at most its first 80 bytes, cut
// between UTF-8 characters); "" when there is none.
std::string innermost_python_frame(const std::string& text);

// "ranks 0-2 in all_reduce at d.py:9; rank 3 in <module> at w.py:4": ranks
// grouped by frame, groups in the order of their lowest rank.
std::string group_frames(std::vector<RankFrame> frames);

}  // namespace ctorchrun::agent
