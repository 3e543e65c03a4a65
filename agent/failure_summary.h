#pragma once

// The failure summary torchrun prints (same template, so log scrapers keep
// working), and the records nodes exchange about a failure.

#include <chrono>
#include <string>
#include <vector>

namespace ctorchrun::agent {

struct FailureRecord {
  int rank = -1;
  int local_rank = -1;
  int node_rank = -1;
  std::string host;
  int pid = 0;
  bool signaled = false;
  int exit_code = 0;
  int signal = 0;
  int64_t timestamp = 0;   // seconds since the epoch: error.json's, else when noticed
  int64_t noticed_ns = 0;  // when the agent noticed the exit: orders ties of `timestamp`
  std::string error_file;  // empty when the worker wrote none
  // The summary's traceback field as torch shows it: error.json's traceback
  // (its lines after the first indented by two spaces) or message; else
  // torch's default for the exit.
  std::string message;
  int attempt = 0;
  // --hang_timeout's verdict (agent/hang_detector.h): no worker of the job
  // progressed for the timeout; `rank` stalled first. Its cause is "hang",
  // whatever signal then stopped the workers (the exit fields, once known).
  bool hang = false;
  // TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT's verdict (torch main): the
  // worker stayed in uninterruptible sleep (D state) that long, holding a
  // kernel resource a fresh worker would fight for: no restart follows.
  bool uninterruptible = false;

  // torchrun's "exitcode" column: the code, or minus the signal.
  int torch_exitcode() const { return signaled ? -signal : exit_code; }
  // "exit code 3", "signal 11 (SIGSEGV)", "hang" or "uninterruptible sleep".
  std::string cause() const;
  std::string to_json() const;
  // Parses a record another node wrote. Throws ProtocolError naming the key
  // when the JSON is unreadable or a field has the wrong type.
  static FailureRecord from_json(const std::string& json);
  // The root cause comes first: earliest timestamp, then earliest noticed.
  bool earlier_than(const FailureRecord& o) const {
    return timestamp != o.timestamp ? timestamp < o.timestamp : noticed_ns < o.noticed_ns;
  }
};

// Fills error_file/message/timestamp from the worker's error file if it wrote
// one in torch's @record format ({"message": {"message", "extraInfo":
// {"py_callstack", "timestamp"}}} or the flat {"message", "timestamp"}).
// A missing file leaves the defaults torchrun uses. A file of any other shape
// (not JSON, fields of unexpected types) is named in `message` as "error file
// unreadable: <path>: <why>". Never throws for what the file holds.
void read_error_file(const std::string& path, FailureRecord* record);

// Python's signal.Signals(sig).name, which torch's summary shows ("SIGSEGV");
// empty for a number Python has no name for (most real-time signals).
std::string torch_signal_name(int sig);

// torchrun's summary, byte for byte torch main's ChildFailedError text from
// its first rule to its last, then a newline: "<name> FAILED", the failures
// numbered in rank order, the others first, then the root cause (the
// earliest: timestamp, then when noticed). `failures` must not be empty.
std::string format_failure_summary(const std::string& entrypoint_name,
                                   std::vector<FailureRecord> failures);

}  // namespace ctorchrun::agent
