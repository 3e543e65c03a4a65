#pragma once

// torch's file-based expiration timers, served by the agent as torch's
// LocalElasticAgent serves them (torch/distributed/elastic/timer/
// file_based_local_timer.py, torch 1.13 and 2.x alike).
//
// With TORCHELASTIC_ENABLE_FILE_TIMER=1 the agent creates a named pipe at
// TORCHELASTIC_TIMER_FILE (by default a fresh /tmp/watchdog_timer_<uuid4>, as
// torch names it) and gives its path to every worker in that variable. A
// script's FileTimerClient opens the pipe, writes one request and closes it:
//
//   {"version": 1, "pid": 4242, "scope_id": "train.py#57",
//    "expiration_time": 1764032105.25, "signal": 9}\n
//
//   version          1 (other integers accepted: torch's server ignores it)
//   pid              the process to reap: the client's own (os.getpid())
//   scope_id         a string naming the timer; one timer per (pid, scope_id)
//   expiration_time  seconds since the epoch (time.time() + after); negative
//                    (the client sends -1): release the timer
//   signal           what to kill the pid with on expiry; <= 0: never kill
//
// One request per line, at most PIPE_BUF bytes (torch's client refuses larger
// ones, which also makes every write atomic). The server keeps the timers per
// (pid, scope_id); on expiry it sends the pid the signal of its earliest
// expired timer that names one and forgets every timer of that pid. The worker
// then dies by that signal, which fails the attempt like any other death: the
// job restarts (--max_restarts) or fails with exit 1, as under torchrun.
//
// Unlike torch's server, this one trusts no line: a line that is not such an
// object (bad JSON, missing or mistyped fields, too long, a fragment left
// without its newline) is logged and ignored, and a pid that is neither one of
// this agent's workers nor a descendant of one is never signalled, whatever a
// line asks.

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace ctorchrun::agent {

// The environment the agent reads (torch's names), and the prefix of the
// pipe's default path.
inline constexpr const char* kEnableFileTimerEnv = "TORCHELASTIC_ENABLE_FILE_TIMER";
inline constexpr const char* kTimerFileEnv = "TORCHELASTIC_TIMER_FILE";
inline constexpr const char* kDefaultTimerFilePrefix = "/tmp/watchdog_timer_";
// A line longer than this (newline excluded) is dropped: torch's client
// writes at most PIPE_BUF (4096) bytes, newline included.
inline constexpr size_t kMaxTimerLineBytes = 4096;

struct FileTimerRequest {
  int64_t version = 1;
  pid_t pid = 0;
  std::string scope_id;
  double expiration_time = 0;  // seconds since the epoch; negative: release
  int signal = 0;
  bool is_release() const { return expiration_time < 0; }
};

// Parses one line (its newline removed). Total: never throws; on anything but
// a well-formed request returns nullopt and says why in `*error` (bounded,
// printable, safe to log).
std::optional<FileTimerRequest> parse_timer_request(std::string_view line, std::string* error);

// Cuts the bytes read from the pipe into lines, holding at most
// `max_line_bytes` of a line at a time: the rest of a longer line is skipped
// up to its newline and reported once as dropped.
class TimerLineReader {
 public:
  struct Line {
    std::string text;   // without the newline; empty when dropped
    std::string error;  // non-empty: the line was dropped, and why
  };
  explicit TimerLineReader(size_t max_line_bytes = kMaxTimerLineBytes) : max_(max_line_bytes) {}
  // Appends `data` and returns the lines it completed, in order.
  std::vector<Line> feed(std::string_view data);
  // True while bytes of an unfinished line (or a skipped long one) are held.
  bool has_partial() const { return !partial_.empty() || skipping_; }
  // Forgets the unfinished line; returns how many of its bytes were seen.
  size_t drop_partial();

 private:
  size_t max_;
  std::string partial_;
  bool skipping_ = false;
  size_t skipped_ = 0;
};

// The timers of torch's FileTimerServer, per (pid, scope_id), without I/O or
// clock: the server drives it. Not thread-safe (the server locks).
class FileTimerTable {
 public:
  struct Expired {
    pid_t pid = 0;
    // The signal of the earliest expired timer that names one (> 0); 0: none
    // does, and the pid is not to be killed (torch's rule).
    int signal = 0;
    std::vector<std::string> scopes;  // the expired scopes, earliest first
  };
  explicit FileTimerTable(size_t max_timers = 65536) : max_(max_timers) {}
  // Sets or (negative expiration) releases the timer of (pid, scope_id).
  // False when a new timer would exceed the bound: it is not kept.
  bool apply(const FileTimerRequest& r);
  // Every pid with a timer expired at `now` (expiration <= now), each once.
  std::vector<Expired> expired(double now) const;
  // Removes every timer of `pid`, expired or not (torch's rule once a pid is
  // reaped).
  void remove_pid(pid_t pid);
  // Removes the timers of pids for which `gone` is true; returns how many.
  size_t drop_if(const std::function<bool(pid_t)>& gone);
  size_t size() const { return timers_.size(); }
  std::optional<double> next_expiration() const;

 private:
  size_t max_;
  std::map<std::pair<pid_t, std::string>, FileTimerRequest> timers_;
};

// Whether `pid` is one of `roots` or descends from one: in the session of a
// root (workers are session leaders, so their descendants stay in it unless
// they call setsid) or with a root among its ancestors (parent links in
// `proc_root`/<pid>/stat, followed at most 64 deep). False for pids <= 1 and
// for anything unreadable.
bool in_process_tree(pid_t pid, const std::vector<pid_t>& roots,
                     const std::string& proc_root = "/proc");

// What the server may do to processes; the real one below, fakes in tests.
// Called from the server's thread.
class ProcessAccess {
 public:
  enum class SignalResult {
    kSent,          // delivered
    kGone,          // no such process (nothing to do)
    kNotPermitted,  // not a worker of this agent nor a descendant: untouched
    kFailed,        // permitted, but the signal could not be sent (`*error`)
    kNotYet,        // not known yet while workers start: asked again later
  };
  virtual ~ProcessAccess() = default;
  // True when `pid` exists (ESRCH is the only "no").
  virtual bool alive(pid_t pid) = 0;
  // Sends `sig` to `pid` when it is allowed to, and only then.
  virtual SignalResult signal_if_permitted(pid_t pid, int sig, std::string* error) = 0;
};

// The agent's workers of the current attempt (set_workers after each start)
// and their descendants, by in_process_tree. Signals through a pidfd opened
// before the check, so that a pid reused between check and kill is never hit.
// Thread-safe.
class WorkerProcesses : public ProcessAccess {
 public:
  // Workers are being started: until set_workers, a pid that is not known
  // is kNotYet rather than kNotPermitted (a worker may write its request
  // before the agent learns its pid).
  void starting();
  void set_workers(std::vector<pid_t> pids);
  // The local rank of a worker pid (its index in the last set_workers), or -1.
  int local_rank_of(pid_t pid) const;
  bool alive(pid_t pid) override;
  SignalResult signal_if_permitted(pid_t pid, int sig, std::string* error) override;

 private:
  bool permitted(pid_t pid) const;
  mutable std::mutex mutex_;
  std::vector<pid_t> workers_;
  bool starting_ = false;
};

struct FileTimerStats {
  // Seconds since the epoch of the last well-formed request; none yet: empty.
  std::optional<double> last_request;
  size_t active_timers = 0;
  uint64_t requests = 0;        // well-formed requests
  uint64_t rejected_lines = 0;  // lines logged and ignored
  uint64_t kills = 0;           // signals sent for expired timers
};

struct FileTimerOptions {
  std::string path;
  // The longest the server waits between two expiry checks (torch's agent
  // runs its server with max_interval 0.1 s).
  std::chrono::milliseconds interval{100};
  // A fragment without its newline, with no byte after it for this long, is
  // dropped (a conforming client's line arrives whole).
  std::chrono::milliseconds partial_line_timeout{1000};
  size_t max_line_bytes = kMaxTimerLineBytes;
  size_t max_timers = 65536;
  // Wall clock, seconds since the epoch (the clients' time.time()); empty:
  // the system clock. Tests inject a manual one.
  std::function<double()> now;
  // Called on the server's thread for each pid whose timer expired, after
  // the signal: `killed` says whether it was sent. Must not throw (a throw is
  // logged and ignored).
  std::function<void(const FileTimerTable::Expired&, bool killed)> on_expired;
};

// The server: the named pipe, a thread that reads it and reaps, the table.
// The constructor creates the pipe (replacing a pipe already at the path, as
// torch does, but never a file of another kind) and starts the thread; the
// destructor stops the thread (within one wake-up) and removes the pipe.
class FileTimerServer {
 public:
  // Throws ConfigError when the pipe cannot be created or opened.
  FileTimerServer(FileTimerOptions options, std::shared_ptr<ProcessAccess> processes);
  ~FileTimerServer();
  FileTimerServer(const FileTimerServer&) = delete;
  FileTimerServer& operator=(const FileTimerServer&) = delete;

  const std::string& path() const { return options_.path; }
  FileTimerStats stats() const;
  // Removes the pipe at once (for an exit that skips destructors). Idempotent.
  void remove_pipe() noexcept;

 private:
  void loop();
  void pass();
  void read_pipe();
  void handle_line(const TimerLineReader::Line& line);
  void reject(const std::string& why);
  void reap();
  double now() const;

  FileTimerOptions options_;
  std::shared_ptr<ProcessAccess> processes_;
  int read_fd_ = -1;
  int keep_fd_ = -1;  // our own writer: the pipe never reads end-of-file
  int wake_fds_[2] = {-1, -1};
  std::atomic<bool> removed_{false};
  dev_t dev_ = 0;  // the pipe we made, so that we never remove another file
  ino_t ino_ = 0;
  std::vector<char> buffer_;
  std::chrono::steady_clock::time_point last_warning_;
  uint64_t quiet_rejections_ = 0;  // rejected lines not logged since the last warning
  TimerLineReader reader_;
  std::chrono::steady_clock::time_point last_byte_;
  std::chrono::steady_clock::time_point next_sweep_;
  mutable std::mutex mutex_;  // table_ and stats_
  FileTimerTable table_;
  FileTimerStats stats_;
  std::thread thread_;
};

// The pipe's path when TORCHELASTIC_ENABLE_FILE_TIMER is "1" in `env` (the
// launcher's environment): TORCHELASTIC_TIMER_FILE, or a fresh
// /tmp/watchdog_timer_<uuid4>. Empty optional: the file timer is off.
std::optional<std::string> file_timer_path(const std::map<std::string, std::string>& env);

}  // namespace ctorchrun::agent
