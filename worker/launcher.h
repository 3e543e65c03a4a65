#pragma once

// worker::Launcher: the agent's handle on the worker processes of one node.
//
// The layer knows nothing of stores, ranks or torch: the agent hands it fully
// built argv, environments and file paths, and gets back pids and exits.
//
// Lifecycle of one set of workers:
//
//   start(specs) ──► wait(deadline)* ──► stop(sig, grace) ──► start(specs) ...
//                    signal_all(sig)*
//
// Every worker runs in a session (and so a process group) of its own, so that
// a worker reading the terminal is never stopped as a background job, and so
// that a signal to the group reaches the children a worker starts. A worker's
// exit is reported as soon as it happens, but the worker itself is reaped only
// by stop(): until then its zombie keeps its pid, which is also its process
// group id, from being reused, so signalling the group can never hit an
// unrelated process. stop() is therefore due after every start(), also when
// every worker succeeded (the destructor does it too).
//
// No orphans: besides PR_SET_PDEATHSIG on each worker, the real launcher forks
// a small watcher process when it is created. It learns each worker's process
// group and SIGKILLs them all the moment the agent dies, however it dies
// (SIGKILL included): a worker's descendant that stays in the worker's
// process group never outlives the agent. Descendants that leave it (setsid,
// setpgid, a double-forked daemon) are handled by the agent itself: its
// process is a child subreaper (PR_SET_CHILD_SUBREAPER), so they become its
// children when their parents die; they are found in
// /proc/self/task/*/children, reaped as they die, get stop()'s signal and
// are SIGKILLed and reaped by stop(). So after stop() (and after the
// destructor) no descendant of a worker is left. After a SIGKILL of the agent
// only the watcher acts, and escaped descendants survive it. Where the kernel
// refuses the subreaper or lacks the children file, one warning is logged
// and escaped descendants survive the job.
//
// Output, per stream (stdout, stderr) and worker, as torchrun's
// --redirects/--tee: by default the worker writes to the agent's own stream
// (inherited: a terminal stays a terminal). A redirected or teed stream
// reaches the agent through a pipe; the agent writes it to its file
// unchanged, and a teed one also to the agent's corresponding stream with
// every line prefixed, through worker::Console (console.h: queued, never
// blocking the agent, whole lines dropped and counted when the console does
// not drain); a final line without '\n' reaches the console with one
// appended when the stream ends. Output written by a worker before it exited
// is in its file (and queued for the console) by the time its exit is
// reported. A log file that cannot be written is warned about once and listed
// by truncated_logs().
//
// Thread safety: start(), wait() and stop() must not run concurrently with
// one another (the agent calls them from its loop); signal_all(), wake() and
// running() may be called from any thread at any time. None of the calls is
// async-signal-safe.

#include <sys/types.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace ctorchrun::worker {

// Bit mask of standard streams, torchrun's --redirects/--tee values:
// 0 none, 1 stdout, 2 stderr, 3 both.
enum StdStreams : unsigned { kNone = 0, kStdout = 1, kStderr = 2, kBoth = 3 };

struct WorkerSpec {
  int local_rank = 0;
  // argv[0]: a path (relative paths are taken from `cwd` when set), or a name
  // looked up in the PATH of `env` (the agent's PATH when `env` has none).
  // The worker sees argv[0] as given, not the resolved path.
  std::vector<std::string> argv;
  // The complete environment of the worker: nothing is inherited implicitly.
  std::map<std::string, std::string> env;
  std::string cwd;  // empty: the agent's
  // Streams written to their file only (not the console).
  unsigned redirects = kNone;
  // Streams written to their file and, line by line with `prefix`, to the
  // console. A stream both redirected and teed is teed.
  unsigned tee = kNone;
  // Files of the redirected/teed streams: their directories must exist; the
  // files are created or truncated by start(). The same path for both streams
  // gives one file that both write to.
  std::string stdout_path;
  std::string stderr_path;
  // Console prefix of teed lines, torchrun's "[default0]:" form.
  std::string prefix;
  // false (--local_ranks_filter leaves this worker out): nothing of it
  // reaches the console; teed streams go to their file only, and a stream
  // neither redirected nor teed goes to /dev/null, as torch 2.x's
  // DefaultLogsSpecs does. Its files are unaffected.
  bool console = true;
  // torch main's --duplicate-stdout-filters/--duplicate-stderr-filters: a
  // teed line of the stream holding any of these substrings is also
  // appended, with its prefix, to the path (torchrun's filtered_stdout.log
  // and filtered_stderr.log, one per attempt, shared by its workers: each
  // line is one write to an O_APPEND file). Empty: no filtering. Applies
  // whether or not the line reaches the console (--local_ranks_filter).
  std::vector<std::string> stdout_filters;
  std::vector<std::string> stderr_filters;
  std::string filtered_stdout_path;
  std::string filtered_stderr_path;
  // The CPUs the worker may run on (sched_setaffinity before exec); empty:
  // the agent's. A CPU this process may not use fails the worker's start.
  std::vector<int> cpus;
  // NUMA node ids whose memory the worker prefers (set_mempolicy before
  // exec: MPOL_PREFERRED for one node, MPOL_PREFERRED_MANY for several,
  // falling back to the first alone where the kernel lacks it); empty: the
  // agent's policy. A refused policy fails the worker's start.
  std::vector<int> memory_nodes;
};

struct WorkerExit {
  int local_rank = 0;
  pid_t pid = 0;
  int exit_code = 0;  // valid when !signaled; -1 if the status was lost (see wait())
  int signal = 0;     // valid when signaled (the terminating signal); never folded into exit_code
  bool signaled = false;
  std::chrono::system_clock::time_point time;  // when the exit was noticed
  // Set by stop() on the exits it returns of workers that had exited before
  // it sent its signal: their own end, not the stop's doing.
  bool before_stop = false;
  bool failed() const { return signaled || exit_code != 0; }
};

// "SIGSEGV" for 11, "SIGTERM" for 15...; "signal N" for a number without a name.
std::string signal_name(int sig);

// One line for logs and failure summaries: "exit code 3", "signal SIGSEGV (11)".
std::string describe(const WorkerExit& exit);

// An interface, so that agent tests can substitute a fake with scripted exits.
class Launcher {
 public:
  // The real launcher's destructor stop()s remaining workers with SIGKILL (no
  // grace: the agent stops them gracefully itself), then lets the watcher go.
  virtual ~Launcher() = default;

  // Spawns one worker per spec, in order, and returns their pids in that
  // order. Requires that every worker of a previous start() has been stop()ped
  // (InternalError otherwise). Blocks until every worker has exec'd its
  // program (a few milliseconds each).
  // Throws IoError when a worker cannot be started: argv[0] not found, not
  // executable, exec failed, cwd or an output file unusable. The message names
  // the local rank, the path and the reason, e.g. "cannot start worker
  // local_rank=1: /nonexistent/x: No such file or directory". Workers of this
  // call already started are killed and reaped before it throws, so on return
  // or throw no worker of a failed start() is left.
  virtual std::vector<pid_t> start(const std::vector<WorkerSpec>& specs) = 0;

  // Blocks until at least one worker has exited, wake() was called, or
  // `deadline` passed, and returns the exits noticed since the last wait()
  // (empty on wake or deadline). Exits are noticed as they happen (SIGCHLD),
  // never by polling. Each exit is returned once, by wait() or by stop().
  // With no worker running it simply waits for `deadline` or wake().
  // exit_code is -1 in the one case where a worker's status was lost (some
  // other code in the process reaped it, which nothing should do).
  virtual std::vector<WorkerExit> wait(std::chrono::steady_clock::time_point deadline) = 0;

  // Makes a blocked wait() return soon (from any thread, e.g. the agent's
  // signal handling). A wake() while no wait() is blocked makes the next
  // wait() return at once: wakes are never lost.
  virtual void wake() = 0;

  // Sends `sig` to the process group of every worker of the current set:
  // signal forwarding. Groups whose leader has exited still get it (it
  // reaches what the worker left behind); after stop(), nothing is sent.
  virtual void signal_all(int sig) = 0;

  // Stops the current set of workers: `sig` (normally SIGTERM) to every
  // worker's process group, waits (event-driven) up to `grace` for the
  // workers to exit, then SIGKILLs every group (also those whose worker
  // exited in time: nothing of a stopped set survives), reaps the workers and
  // closes their output files. Returns the exits not yet returned by wait(),
  // in start() order: the workers running when stop() was called, and any
  // exit that happened while wait() was not looking (before_stop set on those
  // that had exited before `sig` went out). Bounded: returns within
  // grace + about 2 s even if a worker cannot die (a process stuck in the
  // kernel; it is then left out of the result and logged). Idempotent: with
  // nothing to stop it returns an empty vector at once. `sig` 0 sends nothing
  // first: for workers already signalled by someone else (a batch scheduler
  // signals every process of a job), it only waits up to `grace`, then SIGKILLs.
  virtual std::vector<WorkerExit> stop(int sig, std::chrono::milliseconds grace) = 0;

  // Workers of the current set that have not exited.
  virtual size_t running() const = 0;

  // Paths of the log files that could not be written in full (a full disk,
  // a file size limit), in the order noticed; each was warned about once.
  virtual std::vector<std::string> truncated_logs() const { return {}; }
};

// The real launcher (Boost.Process, one background thread for SIGCHLD and
// output). Creating it forks the watcher process, so create it before
// workers are needed, e.g. when the agent starts. Throws IoError if the
// watcher cannot be started. Any number of launchers may coexist in a
// process.
std::unique_ptr<Launcher> make_process_launcher();

// Ctrl-Z for a launcher whose workers run in sessions of their own (where the
// terminal's SIGTSTP never reaches them): call from main() before any thread
// starts. Blocks SIGTSTP and SIGCONT and starts a thread that, on SIGTSTP,
// sends SIGSTOP to every worker's process group of every real launcher, then
// stops the whole process with SIGSTOP; and on SIGCONT (the shell's fg or
// bg), sends SIGCONT to the workers before anything else. A SIGTSTP that
// is ignored when the process starts stays ignored.
void handle_job_control();

}  // namespace ctorchrun::worker
