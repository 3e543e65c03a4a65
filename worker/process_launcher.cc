// The real Launcher: Boost.Process spawns, one Asio io_context on a thread of
// the launcher's own reaps (SIGCHLD) and pumps teed output, a watcher process
// kills everything if the agent dies.
//
// Why a thread of its own rather than running the io_context inside wait():
// teed output must keep flowing while the agent is busy elsewhere (a store
// call, the exit barrier); a worker blocked on a full 64 KiB pipe would stall
// its whole job. The thread is also the one that forks the workers, so
// PR_SET_PDEATHSIG (which fires when the forking *thread* exits) lasts exactly
// as long as the launcher, whichever agent thread calls start().
//
// Exits are observed with waitid(WNOWAIT) on SIGCHLD, for the known pids only
// (never waitpid(-1): other code in the process has children of its own), and
// the zombie is reaped only by stop(), after its group has been SIGKILLed.
// The zombie keeps its pid, which is its process group id, from being reused,
// so kill(-pgid) never reaches a stranger (pid_max is 32768 on some hosts).
// Boost.Process's own on_exit machinery is not used: it reaps at once, and its
// exit_code() folds signals into exit codes.
//
// Escaped descendants (a worker's child that calls setsid, a double-forked
// daemon): the launcher's process is a child subreaper, so when such a
// process loses its parent it becomes our child instead of init's. Our
// children are listed in /proc/self/task/*/children; those in a session
// other than ours, and not a worker or watcher of any launcher, can only be
// descendants of workers (a worker's descendants live in its session or in
// one they created; sessions cannot be joined). The io thread reaps them as
// they die and stop() kills them, by pid: a child's pid cannot be reused
// before we reap it, and only the io thread reaps, so a kill never reaches a
// stranger. Console output never happens on the io thread: it queues lines
// on worker::Console, whose own threads write them.

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
// vfork for spawning workers: glibc has it, but Boost.Process enables its
// vfork path only for old POSIX levels. The child setup below allocates
// nothing and writes only its own locals and a ChildFailure the parent
// preallocated, as a vfork child must; it calls execve itself, so that none
// of Boost.Process's own error reporting (which assigns std::strings) runs in
// the child.
#ifndef BOOST_POSIX_HAS_VFORK
#define BOOST_POSIX_HAS_VFORK 1
#endif
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/process/child.hpp>
#include <boost/process/error.hpp>
#include <boost/process/extend.hpp>
#include <boost/process/posix.hpp>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <fstream>
#include <future>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "common/error.h"
#include "common/log.h"
#include "common/procfs.h"
#include "worker/console.h"
#include "worker/executable.h"
#include "worker/launcher.h"
#include "worker/proc_file.h"
#include "worker/tee_writer.h"
#include "worker/unique_fd.h"
#include "worker/watcher.h"

namespace ctorchrun::worker {

namespace {

// NUMA node masks given to set_mempolicy: nodes 0..1023.
constexpr size_t kNodeMaskWords = 1024 / (8 * sizeof(unsigned long));

namespace asio = boost::asio;
namespace bp = boost::process;
using detail::UniqueFd;
using std::chrono::milliseconds;
using SteadyClock = std::chrono::steady_clock;

// After SIGKILL, how long stop() waits for the kernel to finish a worker.
constexpr milliseconds kKillWait{2000};
constexpr size_t kReadChunk = 64 * 1024;
// Per readiness event: enough to keep up, little enough to be fair to others.
constexpr size_t kReadBudget = 16 * kReadChunk;
// Reading a pipe after its worker exited: what the worker wrote is there at
// once; a descendant still writing must not keep us here.
constexpr size_t kDrainBudget = 8 << 20;

// PATH for a worker whose environment and agent have none (execvp's default).
constexpr const char* kDefaultPath = "/usr/bin:/bin";

// Pids of every launcher's workers and watchers in this process: children of
// ours that are never taken for escaped descendants.
std::mutex g_owned_mutex;
std::set<pid_t> g_owned;
// Held from before a fork until its pid is owned, and while escapees are
// picked, so that no launcher takes another's newborn worker for one.
std::mutex g_spawn_mutex;

void own(pid_t pid, bool owned) {
  std::lock_guard<std::mutex> lock(g_owned_mutex);
  if (owned) {
    g_owned.insert(pid);
  } else {
    g_owned.erase(pid);
  }
}

// The children of this process, from /proc/self/task/*/children; false when
// the kernel does not provide that file.
bool own_children(std::vector<pid_t>* out) {
  DIR* dir = ::opendir("/proc/self/task");
  if (dir == nullptr) return false;
  bool any = false;
  while (dirent* ent = ::readdir(dir)) {
    if (ent->d_name[0] == '.') continue;
    const std::string path = std::string("/proc/self/task/") + ent->d_name + "/children";
    if (::access(path.c_str(), R_OK) != 0) continue;
    any = true;
    std::istringstream in(read_proc_file(path));
    long pid = 0;
    while (in >> pid) out->push_back(static_cast<pid_t>(pid));
  }
  ::closedir(dir);
  return any;
}

// Live launchers, for job control (handle_job_control()).
std::mutex g_launchers_mutex;
std::set<Launcher*> g_launchers;

void kill_group(pid_t pgid, int sig) {
  CTORCHRUN_CHECK(pgid > 1, "kill of process group " + std::to_string(pgid));
  if (::kill(-pgid, sig) != 0 && errno != ESRCH) {
    get_logger("worker")->debug("kill pgid={} signal={} failed: {}", pgid, signal_name(sig),
                                std::strerror(errno));
  }
}

// ---------------------------------------------------------------------------
// One worker stream on a pipe, read on the io thread and handed to a
// TeeWriter. Shared ownership keeps it alive for a completion handler that is
// already queued when the launcher lets go of it.
class OutputPump : public std::enable_shared_from_this<OutputPump> {
 public:
  // console_fd: 1 or 2 for a teed stream, -1 for one that goes to its file
  // only. on_file_error: called once if the file cannot be written.
  OutputPump(asio::io_context& io, UniqueFd pipe, std::shared_ptr<UniqueFd> file, int console_fd,
             std::string prefix, detail::TeeWriter::FileError on_file_error,
             std::shared_ptr<detail::LineFilter> duplicate = nullptr)
      : pipe_(io, pipe.release()),
        file_(std::move(file)),
        writer_(file_ ? file_->get() : -1,
                lines_to(console_fd, prefix.size(), std::move(duplicate)), std::move(prefix),
                std::move(on_file_error)) {}

  void start() { arm(); }

  // Where complete lines go: the console (console_fd 1 or 2; -1 for none)
  // and the lines `duplicate` matches to its file. Empty when neither.
  static detail::TeeWriter::ConsoleLine lines_to(int console_fd, size_t prefix_size,
                                                 std::shared_ptr<detail::LineFilter> duplicate) {
    if (console_fd < 0 && !duplicate) return {};
    return [console_fd, prefix_size, duplicate](std::string line) {
      if (duplicate) duplicate->offer(line, prefix_size);
      if (console_fd >= 0) Console::write(console_fd, std::move(line));
    };
  }

  // Reads what the pipe holds now, e.g. right after the worker exited.
  void drain() {
    if (open_) read_some(kDrainBudget);
  }

  // Drains, flushes a last partial line and closes, EOF or not (a stopped
  // worker's escaped descendant may hold the pipe open forever).
  void close() {
    drain();
    if (open_) finish();
  }

 private:
  void arm() {
    pipe_.async_wait(asio::posix::stream_descriptor::wait_read,
                     [self = shared_from_this()](const boost::system::error_code& ec) {
                       if (ec || !self->open_) return;
                       if (self->read_some(kReadBudget)) self->arm();
                     });
  }

  // False once the stream has ended (and been finished).
  bool read_some(size_t budget) {
    size_t got = 0;
    while (got < budget) {
      ssize_t n = ::read(pipe_.native_handle(), buffer_, sizeof buffer_);
      if (n > 0) {
        writer_.write(buffer_, static_cast<size_t>(n));
        got += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
      finish();  // EOF, or an error that ends the stream all the same
      return false;
    }
    return true;
  }

  void finish() {
    open_ = false;
    writer_.finish();
    boost::system::error_code ignored;
    pipe_.close(ignored);
    file_.reset();
  }

  asio::posix::stream_descriptor pipe_;
  std::shared_ptr<UniqueFd> file_;
  detail::TeeWriter writer_;
  bool open_ = true;
  char buffer_[kReadChunk];
};

// ---------------------------------------------------------------------------
// The step of a worker's set-up, between fork and exec, that failed.
enum class ChildStep : int {
  kNone = 0,
  kSetsid,
  kDeathSignal,
  kChdir,
  kAffinity,
  kMemoryPolicy,
  kStdout,
  kStderr,
  kExec,
};

// Written by the vfork child just before it exits, read by the parent once
// vfork returns (the child shares the parent's memory until then): plain
// ints, no allocation.
struct ChildFailure {
  ChildStep step = ChildStep::kNone;
  int error = 0;
};

// ---------------------------------------------------------------------------
// The Boost.Process extension that prepares a worker: argv, environment and
// the child-side set-up. Everything is built in the parent; the child side
// (on_exec_setup) runs between fork and exec of a multi-threaded process, so
// it calls async-signal-safe functions only.
struct SpawnSetup : bp::extend::handler {
  const char* exe = nullptr;
  char* const* argv = nullptr;
  char** envp = nullptr;
  const char* cwd = nullptr;
  int stdout_fd = -1;  // becomes the worker's fd 1; -1: inherit the agent's
  int stderr_fd = -1;
  pid_t agent_pid = 0;
  int watcher_fd = -1;              // the watcher channel: the child announces "+<pgid>" on it
  pid_t* failed_pid = nullptr;      // set when the child was forked but Boost.Process failed
  ChildFailure* failure = nullptr;  // set by the child when a step of its set-up fails
  const cpu_set_t* cpus = nullptr;  // the worker's CPU affinity (--numa-binding); null: the agent's
  // The worker's preferred memory nodes (--numa-binding): node masks for
  // set_mempolicy, every node and the first alone; null: the agent's policy.
  const unsigned long* mem_many = nullptr;
  const unsigned long* mem_first = nullptr;
  bool mem_several = false;

  template <class Executor>
  void on_setup(Executor& exec) const {
    exec.exe = exe;
    exec.cmd_line = argv;
    exec.env = envp;
  }

  template <class Executor>
  void on_error(Executor& exec, const std::error_code&) const {
    if (exec.pid > 0) *failed_pid = exec.pid;
  }

  template <class Executor>
  void on_exec_setup(Executor& exec) const {
    // No handler of the agent may run in here; block everything until exec.
    sigset_t all;
    sigfillset(&all);
    ::sigprocmask(SIG_SETMASK, &all, nullptr);
    // Handlers are reset by exec anyway, but a pending signal would run one
    // between unblocking and exec. SIGPIPE and SIGXFSZ ignored by the agent
    // go back to their defaults, as Python's subprocess does; other ignored
    // signals stay ignored (nohup keeps working).
    for (int sig = 1; sig < NSIG; ++sig) {
      struct sigaction sa;
      if (::sigaction(sig, nullptr, &sa) != 0) continue;
      bool reset = sa.sa_handler != SIG_DFL &&
                   (sa.sa_handler != SIG_IGN || sig == SIGPIPE || sig == SIGXFSZ);
      if (reset) {
        std::memset(&sa, 0, sizeof sa);
        sa.sa_handler = SIG_DFL;
        ::sigaction(sig, &sa, nullptr);
      }
    }
    if (::setsid() < 0) fail(ChildStep::kSetsid);
    if (::prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0) fail(ChildStep::kDeathSignal);
    // The agent may have died before PDEATHSIG was armed: then nobody would.
    if (::getppid() != agent_pid) ::_exit(127);
    announce_group();
    if (cwd != nullptr && ::chdir(cwd) != 0) fail(ChildStep::kChdir);
    if (cpus != nullptr && ::sched_setaffinity(0, sizeof(cpu_set_t), cpus) != 0) {
      fail(ChildStep::kAffinity);
    }
    if (mem_many != nullptr) {
      constexpr int kPreferred = 1, kPreferredMany = 5;  // MPOL_PREFERRED(_MANY)
      constexpr unsigned long kMaxNode = kNodeMaskWords * 8 * sizeof(unsigned long);
      long rc = -1;
      if (mem_several) rc = ::syscall(SYS_set_mempolicy, kPreferredMany, mem_many, kMaxNode);
      // Before Linux 5.15 there is no MPOL_PREFERRED_MANY: the rank's node alone.
      if (rc != 0) rc = ::syscall(SYS_set_mempolicy, kPreferred, mem_first, kMaxNode);
      if (rc != 0) fail(ChildStep::kMemoryPolicy);
    }
    if (stdout_fd >= 0) install(stdout_fd, STDOUT_FILENO, ChildStep::kStdout);
    if (stderr_fd >= 0) install(stderr_fd, STDERR_FILENO, ChildStep::kStderr);
    mark_fds_cloexec();
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    // Exec here rather than return to Boost.Process, whose failure path
    // assigns a std::string in the child.
    ::execve(exec.exe, exec.cmd_line, exec.env);
    fail(ChildStep::kExec);
  }

  // Tells the watcher about this new process group (pgid == pid after
  // setsid) before exec: the parent announces it too, but only after exec,
  // and a worker may fork children and the agent die in between. A small
  // write to a stream socket is not interleaved with other writers' writes.
  void announce_group() const {
    if (watcher_fd < 0) return;
    char line[24];
    char digits[16];
    int n = 0;
    for (pid_t v = ::getpid(); v > 0 && n < 16; v /= 10)
      digits[n++] = static_cast<char>('0' + v % 10);
    int len = 0;
    line[len++] = '+';
    while (n > 0) line[len++] = digits[--n];
    line[len++] = '\n';
    ssize_t ignored = ::send(watcher_fd, line, static_cast<size_t>(len), MSG_NOSIGNAL);
    (void)ignored;
  }

  // Records the failed step and errno for the parent and exits.
  [[noreturn]] void fail(ChildStep step) const {
    failure->error = errno;
    failure->step = step;
    ::_exit(127);
  }

  void install(int fd, int target, ChildStep step) const {
    if (fd == target) {  // dup2 would keep close-on-exec set
      if (::fcntl(fd, F_SETFD, 0) != 0) fail(step);
    } else if (::dup2(fd, target) < 0) {
      fail(step);
    }
  }

  // Only fds 0-2 reach the worker (as Python's close_fds=True): in
  // particular not the agent's end of the watcher channel, whose EOF is how
  // the watcher learns that the agent died. Marked rather than closed:
  // should exec fail, the set-up leaves no fd of the agent's closed.
  static void mark_fds_cloexec() {
    if (::close_range(3, ~0U, CLOSE_RANGE_CLOEXEC) == 0) return;
    // Kernels before 5.11: walk /proc/self/fd without allocating.
    int dir = ::open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0) return;
    alignas(8) char buf[4096];
    for (;;) {
      long n = ::syscall(SYS_getdents64, dir, buf, sizeof buf);
      if (n <= 0) break;
      for (long off = 0; off < n;) {
        struct Dirent64 {
          uint64_t ino;
          int64_t off;
          unsigned short reclen;
          unsigned char type;
          char name[1];
        };
        auto* d = reinterpret_cast<Dirent64*>(buf + off);
        int fd = 0;
        bool digits = d->name[0] != '\0';
        for (const char* c = d->name; *c != '\0'; ++c) {
          if (*c < '0' || *c > '9') digits = false;
          if (digits) fd = fd * 10 + (*c - '0');
        }
        if (digits && fd > 2 && fd != dir) ::fcntl(fd, F_SETFD, FD_CLOEXEC);
        off += d->reclen;
      }
    }
    ::close(dir);
  }
};

// ---------------------------------------------------------------------------
struct Worker {
  int local_rank = 0;
  pid_t pid = 0;
  std::string program;
  bool exited = false;       // exit observed; a zombie until stop() reaps it
  bool status_lost = false;  // someone else reaped it (ECHILD)
  bool reported = false;     // returned by wait() or stop()
  WorkerExit exit;
  std::vector<std::shared_ptr<OutputPump>> pumps;  // io thread only
};

struct Plumbing;

class ProcessLauncher final : public Launcher {
 public:
  ProcessLauncher();
  ~ProcessLauncher() override;

  std::vector<pid_t> start(const std::vector<WorkerSpec>& specs) override;
  std::vector<WorkerExit> wait(SteadyClock::time_point deadline) override;
  void wake() override;
  void signal_all(int sig) override;
  std::vector<WorkerExit> stop(int sig, milliseconds grace) override;
  size_t running() const override;
  std::vector<std::string> truncated_logs() const override;

 private:
  // Runs `f` on the io thread and returns its result (or rethrows).
  template <typename F>
  auto run_on_io(F f) -> decltype(f()) {
    CTORCHRUN_CHECK(std::this_thread::get_id() != thread_.get_id(),
                    "launcher call from its own io thread");
    std::packaged_task<decltype(f())()> task(std::move(f));
    auto result = task.get_future();
    asio::post(io_, [&task] { task(); });
    return result.get();
  }

  void run_io();
  void arm_sigchld();
  void on_sigchld();
  // Io thread only. Escaped descendants that are our children: zombies are
  // reaped, the others get `sig` (0: none). Returns how many are left alive.
  size_t handle_escapees(int sig);
  // Escaped descendants whose parent still lives (a tree walk from each
  // running worker) get `sig`: for a graceful stop before they are orphans.
  void signal_attached_escapees(int sig);
  void note_truncated(const std::string& path, int error);
  std::shared_ptr<Worker> spawn(const WorkerSpec& spec);  // io thread
  // spawn()'s parts: the vfork and exec (throws IoError naming the failed
  // step), and the pumps of the worker's piped streams.
  pid_t fork_exec(const WorkerSpec& spec, const std::string& exe, const Plumbing& plumbing);
  void attach_pumps(Worker& w, const WorkerSpec& spec, Plumbing& plumbing);
  bool all_exited_locked() const {
    return std::all_of(workers_.begin(), workers_.end(), [](const auto& w) { return w->exited; });
  }

  std::shared_ptr<spdlog::logger> log_;
  std::unique_ptr<detail::Watcher> watcher_;
  const pid_t agent_pid_;
  const pid_t agent_sid_;
  bool escapees_visible_ = true;  // subreaper set and the children file present
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  asio::signal_set sigchld_;

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<Worker>> workers_;    // the current set, start() order
  std::vector<std::shared_ptr<Worker>> abandoned_;  // survived SIGKILL + kKillWait
  std::deque<std::shared_ptr<Worker>> exits_;       // noticed, not yet returned
  bool woken_ = false;

  mutable std::mutex truncated_mutex_;
  std::vector<std::string> truncated_;

  std::thread thread_;  // last: starts once everything above exists
};

ProcessLauncher::ProcessLauncher()
    : log_(get_logger("worker")),
      watcher_(detail::Watcher::spawn()),  // first: before any thread or worker
      agent_pid_(::getpid()),
      agent_sid_(::getsid(0)),
      work_(io_.get_executor()),
      sigchld_(io_) {
  boost::system::error_code ec;
  sigchld_.add(SIGCHLD, ec);
  if (ec) throw IoError("cannot watch SIGCHLD for worker exits: " + ec.message());
  // Asio installs its handler with no flags: a worker exit would then fail
  // the agent's blocking calls on other threads with EINTR, and a worker
  // stopped by SIGSTOP would raise SIGCHLD for nothing.
  struct sigaction sa;
  if (::sigaction(SIGCHLD, nullptr, &sa) == 0 && sa.sa_handler != SIG_DFL &&
      sa.sa_handler != SIG_IGN) {
    sa.sa_flags |= SA_RESTART | SA_NOCLDSTOP;
    ::sigaction(SIGCHLD, &sa, nullptr);
  }
  arm_sigchld();
  own(watcher_->pid(), true);
  {
    std::lock_guard<std::mutex> lock(g_launchers_mutex);
    g_launchers.insert(this);
  }
  // Orphaned descendants of the workers become our children (see the top).
  std::vector<pid_t> ignored;
  if (::prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0) {
    escapees_visible_ = false;
    log_->warn(
        "cannot become a child subreaper ({}): processes that leave a worker's session will "
        "survive the job",
        std::strerror(errno));
  } else if (!own_children(&ignored)) {
    escapees_visible_ = false;
    log_->warn(
        "/proc/self/task/*/children is not available: processes that leave a worker's session "
        "will survive the job");
  }
  // A log file over a file size limit (RLIMIT_FSIZE) must fail the write
  // with EFBIG and be reported, not kill the launcher. Workers get the
  // default back (SpawnSetup).
  struct sigaction xfsz;
  if (::sigaction(SIGXFSZ, nullptr, &xfsz) == 0 && xfsz.sa_handler == SIG_DFL) {
    ::signal(SIGXFSZ, SIG_IGN);
  }
  // The io thread takes none of the signals the agent handles itself, and a
  // console pipe closed under it yields EPIPE (teed console output stops)
  // rather than a SIGPIPE that kills the agent.
  sigset_t block;
  sigset_t old;
  sigemptyset(&block);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGALRM, SIGPIPE}) {
    sigaddset(&block, sig);
  }
  ::pthread_sigmask(SIG_BLOCK, &block, &old);
  thread_ = std::thread([this] { run_io(); });
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
}

ProcessLauncher::~ProcessLauncher() {
  {
    std::lock_guard<std::mutex> lock(g_launchers_mutex);
    g_launchers.erase(this);
  }
  try {
    stop(SIGKILL, milliseconds(0));
  } catch (const std::exception& e) {
    log_->error("stopping workers on shutdown failed: {}", e.what());
  }
  work_.reset();
  io_.stop();
  thread_.join();
  own(watcher_->pid(), false);
  // watcher_'s destructor says bye once everything above is gone.
}

void ProcessLauncher::run_io() {
  sigset_t chld;
  sigemptyset(&chld);
  sigaddset(&chld, SIGCHLD);
  ::pthread_sigmask(SIG_UNBLOCK, &chld, nullptr);  // someone must take SIGCHLD
  for (;;) {
    try {
      io_.run();
      return;
    } catch (const std::exception& e) {
      log_->error("worker io thread: unexpected exception: {}", e.what());
    }
  }
}

void ProcessLauncher::arm_sigchld() {
  sigchld_.async_wait([this](const boost::system::error_code& ec, int) {
    if (ec == asio::error::operation_aborted) return;
    // Re-armed whatever happens: a handler that throws must not leave the
    // exits of the workers unseen.
    try {
      on_sigchld();
    } catch (const std::exception& e) {
      log_->error("handling SIGCHLD failed: {}", e.what());
    } catch (...) {
      log_->error("handling SIGCHLD failed: an exception of unknown type");
    }
    arm_sigchld();
  });
}

// One SIGCHLD may stand for several exits; look at every known pid.
void ProcessLauncher::on_sigchld() {
  std::vector<std::shared_ptr<Worker>> exited;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& w : workers_) {
      if (w->exited) continue;
      siginfo_t info;
      std::memset(&info, 0, sizeof info);
      int r = ::waitid(P_PID, static_cast<id_t>(w->pid), &info, WEXITED | WNOHANG | WNOWAIT);
      if (r == 0 && info.si_pid == 0) continue;  // still running
      w->exited = true;
      w->exit.time = std::chrono::system_clock::now();
      if (r != 0) {
        w->status_lost = true;
        w->exit.exit_code = -1;
      } else if (info.si_code == CLD_EXITED) {
        w->exit.exit_code = info.si_status;
      } else {  // CLD_KILLED, CLD_DUMPED
        w->exit.signaled = true;
        w->exit.signal = info.si_status;
      }
      exited.push_back(w);
    }
    for (auto it = abandoned_.begin(); it != abandoned_.end();) {
      siginfo_t info;
      std::memset(&info, 0, sizeof info);
      int r = ::waitid(P_PID, static_cast<id_t>((*it)->pid), &info, WEXITED | WNOHANG | WNOWAIT);
      if (r == 0 && info.si_pid == 0) {
        ++it;
        continue;
      }
      watcher_->forget((*it)->pid);
      int status = 0;
      ::waitpid((*it)->pid, &status, WNOHANG);
      own((*it)->pid, false);
      log_->debug("abandoned worker finally reaped local_rank={} pid={}", (*it)->local_rank,
                  (*it)->pid);
      it = abandoned_.erase(it);
    }
  }
  watcher_->reap_if_exited();
  if (exited.empty()) {
    handle_escapees(0);
    return;
  }
  // Output written before the exit is in the pipes now: pass it on before
  // anyone hears of the exit. These workers are marked exited already, so
  // whatever this throws, their exits are published below all the same.
  for (auto& w : exited) {
    try {
      for (auto& pump : w->pumps) pump->drain();
      if (w->status_lost) {
        log_->error("worker exit status lost local_rank={} pid={}: reaped by someone else",
                    w->local_rank, w->pid);
      } else if (w->exit.signaled) {
        log_->info("worker exited local_rank={} pid={} signal={}", w->local_rank, w->pid,
                   signal_name(w->exit.signal));
      } else {
        log_->info("worker exited local_rank={} pid={} exit_code={}", w->local_rank, w->pid,
                   w->exit.exit_code);
      }
    } catch (const std::exception& e) {
      log_->error("passing on the last output of local_rank={} pid={} failed: {}", w->local_rank,
                  w->pid, e.what());
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& w : exited) exits_.push_back(w);
  }
  cv_.notify_all();
  handle_escapees(0);  // after the exits are out: /proc reads must not delay them
}

std::vector<pid_t> ProcessLauncher::start(const std::vector<WorkerSpec>& specs) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    CTORCHRUN_CHECK(workers_.empty(),
                    "start() while " + std::to_string(workers_.size()) +
                        " workers of the previous start() have not been stop()ped");
  }
  std::exception_ptr error;
  std::vector<pid_t> pids = run_on_io([&] {
    std::vector<pid_t> started;
    for (const auto& spec : specs) {
      try {
        started.push_back(spawn(spec)->pid);
      } catch (...) {
        error = std::current_exception();
        break;
      }
    }
    return started;
  });
  if (error) {
    stop(SIGKILL, milliseconds(0));
    std::rethrow_exception(error);
  }
  return pids;
}

std::string int_list(const std::vector<int>& v) {
  std::string out;
  for (int x : v) out += (out.empty() ? "" : ",") + std::to_string(x);
  return out;
}

// What a failed set-up step was doing, for the error message; a failed exec
// names the program, as execvp's callers do.
std::string child_step_text(ChildStep step, const WorkerSpec& spec, const std::string& program) {
  switch (step) {
    case ChildStep::kSetsid:
      return "setsid() failed";
    case ChildStep::kDeathSignal:
      return "prctl(PR_SET_PDEATHSIG) failed";
    case ChildStep::kChdir:
      return "chdir(" + spec.cwd + ") failed";
    case ChildStep::kAffinity:
      return "sched_setaffinity() to CPUs " + int_list(spec.cpus) + " failed (--numa-binding)";
    case ChildStep::kMemoryPolicy:
      return "set_mempolicy() preferring NUMA nodes " + int_list(spec.memory_nodes) +
             " failed (--numa-binding)";
    case ChildStep::kStdout:
      return "dup2() of the worker's stdout failed";
    case ChildStep::kStderr:
      return "dup2() of the worker's stderr failed";
    case ChildStep::kExec:
    case ChildStep::kNone:
      break;
  }
  return program;
}

using SpawnError = std::function<IoError(const std::string& why)>;

// The executable `spec` runs, found as execvp would, and its working folder
// checked: both before anything is forked.
std::string resolve_program(const WorkerSpec& spec, const SpawnError& fail) {
  std::string search_path;
  if (auto it = spec.env.find("PATH"); it != spec.env.end()) {
    search_path = it->second;
  } else if (const char* agent_path = std::getenv("PATH")) {
    search_path = agent_path;  // as execvp would: the caller's PATH
  } else {
    search_path = kDefaultPath;
  }
  std::string exe;
  try {
    exe = detail::find_executable(spec.argv[0], search_path, spec.cwd);
  } catch (const IoError& e) {
    throw fail(e.what());
  }
  if (!spec.cwd.empty()) {
    struct stat st;
    if (::stat(spec.cwd.c_str(), &st) != 0) {
      throw fail("working directory " + spec.cwd + ": " + std::strerror(errno));
    }
    if (!S_ISDIR(st.st_mode)) throw fail("working directory " + spec.cwd + ": Not a directory");
  }
  return exe;
}

// A worker's output plumbing. Every stream that goes to a file comes through
// a pipe read by the launcher: teed ones also go to the console, and a file
// that cannot be written (a full disk, a file size limit) is noticed and
// reported, which a file held by the worker itself would hide. Teed with the
// console filtered out is just redirected, and a stream neither redirected
// nor teed goes to /dev/null instead of the console (torch 2.x's
// DefaultLogsSpecs.reify does the same for the ranks --local_ranks_filter
// leaves out).
struct Plumbing {
  unsigned teed = kNone;
  unsigned to_file = kNone;
  std::shared_ptr<UniqueFd> out_file, err_file;
  bool one_pipe = false;  // both streams to one file, neither teed: one pipe keeps their order
  UniqueFd out_read, out_write, err_read, err_write, null_out;
  int stdout_fd() const { return (to_file & kStdout) ? out_write.get() : null_out.get(); }
  int stderr_fd() const {
    return one_pipe ? out_write.get() : (to_file & kStderr) ? err_write.get() : null_out.get();
  }
};

void make_pipe(UniqueFd& read_end, UniqueFd& write_end, const SpawnError& fail) {
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) throw fail(std::string("pipe: ") + std::strerror(errno));
  read_end.reset(p[0]);
  write_end.reset(p[1]);
  ::fcntl(p[0], F_SETFL, ::fcntl(p[0], F_GETFL) | O_NONBLOCK);
}

Plumbing make_plumbing(const WorkerSpec& spec, const SpawnError& fail) {
  Plumbing p;
  p.teed = spec.console ? spec.tee & kBoth : kNone;
  p.to_file = (spec.redirects | spec.tee) & kBoth;
  auto open_file = [&](const std::string& path, const char* stream) {
    CTORCHRUN_CHECK(!path.empty(),
                    std::string("worker ") + stream + " redirected or teed without a file path");
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) throw fail("cannot open " + path + ": " + std::strerror(errno));
    return std::make_shared<UniqueFd>(fd);
  };
  if (p.to_file & kStdout) p.out_file = open_file(spec.stdout_path, "stdout");
  if (p.to_file & kStderr) {
    p.err_file = p.out_file && spec.stderr_path == spec.stdout_path
                     ? p.out_file
                     : open_file(spec.stderr_path, "stderr");
  }
  p.one_pipe = p.err_file && p.err_file == p.out_file && p.teed == kNone;
  if (p.to_file & kStdout) make_pipe(p.out_read, p.out_write, fail);
  if ((p.to_file & kStderr) && !p.one_pipe) make_pipe(p.err_read, p.err_write, fail);
  if (!spec.console && (p.to_file & kBoth) != kBoth) {
    p.null_out.reset(::open("/dev/null", O_WRONLY | O_CLOEXEC));
    if (p.null_out.get() < 0) throw fail(std::string("/dev/null: ") + std::strerror(errno));
  }
  return p;
}

// The CPU and memory-node masks of `spec`, for SpawnSetup: built before the
// vfork, so that its child allocates nothing.
struct Placement {
  cpu_set_t cpus;
  std::array<unsigned long, kNodeMaskWords> mem_many{}, mem_first{};
  explicit Placement(const WorkerSpec& spec) {
    CPU_ZERO(&cpus);
    for (int c : spec.cpus) {
      if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &cpus);
    }
    constexpr size_t kBits = 8 * sizeof(unsigned long);
    for (size_t i = 0; i < spec.memory_nodes.size(); ++i) {
      const int n = spec.memory_nodes[i];
      if (n < 0 || static_cast<size_t>(n) >= kNodeMaskWords * kBits) continue;
      const unsigned long bit = 1UL << (static_cast<size_t>(n) % kBits);
      mem_many[static_cast<size_t>(n) / kBits] |= bit;
      if (i == 0) mem_first[static_cast<size_t>(n) / kBits] |= bit;
    }
  }
  void apply(const WorkerSpec& spec, SpawnSetup* setup) {
    if (!spec.cpus.empty()) setup->cpus = &cpus;
    if (!spec.memory_nodes.empty()) {
      setup->mem_many = mem_many.data();
      setup->mem_first = mem_first.data();
      setup->mem_several = spec.memory_nodes.size() > 1;
    }
  }
};

pid_t ProcessLauncher::fork_exec(const WorkerSpec& spec, const std::string& exe,
                                 const Plumbing& plumbing) {
  auto fail = [&spec](const std::string& why) {
    return IoError("cannot start worker local_rank=" + std::to_string(spec.local_rank) + ": " +
                   why);
  };
  std::vector<std::string> env_strings;
  env_strings.reserve(spec.env.size());
  for (const auto& [key, value] : spec.env) env_strings.push_back(key + "=" + value);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = spec.argv;
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  pid_t failed_pid = -1;
  SpawnSetup setup;
  setup.exe = exe.c_str();
  setup.argv = argv.data();
  setup.envp = envp.data();
  setup.cwd = spec.cwd.empty() ? nullptr : spec.cwd.c_str();
  setup.stdout_fd = plumbing.stdout_fd();
  setup.stderr_fd = plumbing.stderr_fd();
  setup.agent_pid = agent_pid_;
  setup.watcher_fd = watcher_->channel_fd();
  setup.failed_pid = &failed_pid;
  ChildFailure failure;
  setup.failure = &failure;
  Placement placement(spec);
  placement.apply(spec, &setup);

  std::error_code ec;
  pid_t pid = -1;
  {
    std::lock_guard<std::mutex> spawning(g_spawn_mutex);
    bp::child child(setup, bp::error(ec), bp::posix::use_vfork);
    if (!ec) pid = child.id();
    if (pid > 0) own(pid, true);
    if (failed_pid > 0) own(failed_pid, true);
    // We reap and signal by pid ourselves; an attached child's destructor
    // would kill or waitpid it.
    child.detach();
  }
  // vfork returned: the child has exec'd or exited, and a failed set-up
  // step is in `failure`.
  if (ec || pid <= 0 || failure.step != ChildStep::kNone) {
    // Forked, then set-up or exec failed: reap the child.
    const pid_t forked = pid > 0 ? pid : failed_pid;
    if (forked > 0) {
      int status = 0;
      while (::waitpid(forked, &status, 0) < 0 && errno == EINTR) {
      }
      own(forked, false);
    }
    if (failure.step != ChildStep::kNone) {
      throw fail(child_step_text(failure.step, spec, spec.argv[0]) + ": " +
                 std::strerror(failure.error));
    }
    throw fail(spec.argv[0] + ": " + (ec ? ec.message() : std::string("spawn failed")));
  }
  return pid;
}

void ProcessLauncher::attach_pumps(Worker& w, const WorkerSpec& spec, Plumbing& p) {
  auto on_error = [this](const std::string& path) {
    return [this, path](int error) { note_truncated(path, error); };
  };
  // The filtered copies of teed streams (console or not).
  auto duplicate = [&](unsigned stream, const std::vector<std::string>& filters,
                       const std::string& path) -> std::shared_ptr<detail::LineFilter> {
    if (!(spec.tee & stream) || filters.empty() || path.empty()) return nullptr;
    return std::make_shared<detail::LineFilter>(filters, path, on_error(path));
  };
  if (p.to_file & kStdout) {
    w.pumps.push_back(std::make_shared<OutputPump>(
        io_, std::move(p.out_read), p.out_file, (p.teed & kStdout) ? STDOUT_FILENO : -1,
        spec.prefix, on_error(spec.stdout_path),
        duplicate(kStdout, spec.stdout_filters, spec.filtered_stdout_path)));
  }
  if ((p.to_file & kStderr) && !p.one_pipe) {
    const std::string& path = p.err_file == p.out_file ? spec.stdout_path : spec.stderr_path;
    w.pumps.push_back(std::make_shared<OutputPump>(
        io_, std::move(p.err_read), p.err_file, (p.teed & kStderr) ? STDERR_FILENO : -1,
        spec.prefix, on_error(path),
        duplicate(kStderr, spec.stderr_filters, spec.filtered_stderr_path)));
  }
  for (auto& pump : w.pumps) pump->start();
}

std::shared_ptr<Worker> ProcessLauncher::spawn(const WorkerSpec& spec) {
  auto fail = [&spec](const std::string& why) {
    return IoError("cannot start worker local_rank=" + std::to_string(spec.local_rank) + ": " +
                   why);
  };
  if (spec.argv.empty()) throw fail("empty argv");
  const std::string exe = resolve_program(spec, fail);
  Plumbing plumbing = make_plumbing(spec, fail);
  const pid_t pid = fork_exec(spec, exe, plumbing);
  watcher_->watch(pid);

  auto w = std::make_shared<Worker>();
  w->local_rank = spec.local_rank;
  w->pid = pid;
  w->program = spec.argv[0];
  w->exit.local_rank = spec.local_rank;
  w->exit.pid = pid;
  attach_pumps(*w, spec, plumbing);
  {
    // SIGCHLD is handled on this thread, after this task: an exit that
    // already happened is still seen.
    std::lock_guard<std::mutex> lock(mutex_);
    workers_.push_back(w);
  }
  log_->debug("worker started local_rank={} pid={} program={}", spec.local_rank, pid, spec.argv[0]);
  return w;
}

std::vector<WorkerExit> ProcessLauncher::wait(SteadyClock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait_until(lock, deadline, [this] { return !exits_.empty() || woken_; });
  woken_ = false;
  std::vector<WorkerExit> result;
  for (auto& w : exits_) {
    if (w->reported) continue;
    w->reported = true;
    result.push_back(w->exit);
  }
  exits_.clear();
  return result;
}

void ProcessLauncher::wake() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    woken_ = true;
  }
  cv_.notify_all();
}

void ProcessLauncher::signal_all(int sig) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& w : workers_) {
      if (w->status_lost) continue;  // no zombie holds its pgid any more
      log_->debug("signal local_rank={} pgid={} signal={}", w->local_rank, w->pid,
                  signal_name(sig));
      kill_group(w->pid, sig);
    }
  }
  run_on_io([&] { handle_escapees(sig); });
}

size_t ProcessLauncher::handle_escapees(int sig) {
  if (!escapees_visible_) return 0;
  std::lock_guard<std::mutex> spawning(g_spawn_mutex);
  std::vector<pid_t> children;
  own_children(&children);
  size_t alive = 0;
  for (pid_t pid : children) {
    {
      std::lock_guard<std::mutex> lock(g_owned_mutex);
      if (g_owned.count(pid) > 0) continue;
    }
    const auto stat = procfs::read_stat(pid);
    if (!stat || stat->session == agent_sid_) continue;
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      log_->debug("reaped an escaped descendant of the workers pid={}", pid);
      continue;
    }
    ++alive;
    if (sig != 0) {
      log_->debug("signal escaped descendant pid={} signal={}", pid, signal_name(sig));
      ::kill(pid, sig);
    }
  }
  return alive;
}

void ProcessLauncher::signal_attached_escapees(int sig) {
  if (!escapees_visible_) return;
  // Breadth-first from every running worker; bounded against a fork bomb.
  std::vector<std::pair<pid_t, pid_t>> queue;  // (pid, its worker's pgid)
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& w : workers_) {
      if (!w->exited) queue.emplace_back(w->pid, w->pid);
    }
  }
  for (size_t at = 0; at < queue.size() && queue.size() < 4096; ++at) {
    auto [pid, pgid] = queue[at];
    DIR* dir = ::opendir(("/proc/" + std::to_string(pid) + "/task").c_str());
    if (dir == nullptr) continue;
    while (dirent* ent = ::readdir(dir)) {
      if (ent->d_name[0] == '.') continue;
      std::istringstream in(
          read_proc_file("/proc/" + std::to_string(pid) + "/task/" + ent->d_name + "/children"));
      long child = 0;
      while (in >> child) {
        queue.emplace_back(static_cast<pid_t>(child), pgid);
        // Group members get the group's signal; the others are escapees.
        if (::getpgid(static_cast<pid_t>(child)) != pgid) ::kill(static_cast<pid_t>(child), sig);
      }
    }
    ::closedir(dir);
  }
}

void ProcessLauncher::note_truncated(const std::string& path, int error) {
  {
    std::lock_guard<std::mutex> lock(truncated_mutex_);
    if (std::find(truncated_.begin(), truncated_.end(), path) != truncated_.end()) return;
    truncated_.push_back(path);
  }
  log_->warn("cannot write worker log {}: {}; the rest of that output is not in it", path,
             std::strerror(error));
}

std::vector<std::string> ProcessLauncher::truncated_logs() const {
  std::lock_guard<std::mutex> lock(truncated_mutex_);
  return truncated_;
}

std::vector<WorkerExit> ProcessLauncher::stop(int sig, milliseconds grace) {
  const auto deadline = SteadyClock::now() + grace;
  std::unique_lock<std::mutex> lock(mutex_);
  if (workers_.empty()) return {};
  log_->debug("stopping workers count={} signal={} grace_ms={}", workers_.size(), signal_name(sig),
              grace.count());
  // The workers that ended before the signal below, noticed already or still
  // unnoticed zombies: those ends are their own.
  for (auto& w : workers_) {
    if (w->exited) {
      w->exit.before_stop = true;
    } else if (!w->status_lost) {
      siginfo_t info;
      std::memset(&info, 0, sizeof info);
      if (::waitid(P_PID, static_cast<id_t>(w->pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
          info.si_pid != 0) {
        w->exit.before_stop = true;
      }
    }
  }
  // Every group, also of workers that exited already: what they left behind
  // gets the signal too.
  for (auto& w : workers_) {
    if (!w->status_lost) kill_group(w->pid, sig);
  }
  if (sig != SIGKILL) {
    lock.unlock();
    signal_attached_escapees(sig);
    run_on_io([&] { handle_escapees(sig); });
    lock.lock();
    cv_.wait_until(lock, deadline, [this] { return all_exited_locked(); });
  }
  for (auto& w : workers_) {
    if (!w->exited && sig != SIGKILL) {
      log_->warn("worker local_rank={} pid={} still running {} ms after {}; sending SIGKILL",
                 w->local_rank, w->pid, grace.count(), signal_name(sig));
    }
    if (!w->status_lost) kill_group(w->pid, SIGKILL);
  }
  cv_.wait_until(lock, SteadyClock::now() + kKillWait, [this] { return all_exited_locked(); });
  std::vector<std::shared_ptr<Worker>> set;
  set.swap(workers_);
  for (auto& w : set) {
    if (w->exited) continue;
    log_->error("worker local_rank={} pid={} did not die {} ms after SIGKILL; giving up on it",
                w->local_rank, w->pid, kKillWait.count());
    abandoned_.push_back(w);
  }
  exits_.clear();
  lock.unlock();

  run_on_io([&] {
    for (auto& w : set) {
      for (auto& pump : w->pumps) pump->close();
      w->pumps.clear();
      if (!w->exited) continue;
      // Forget first: until the zombie is reaped, its pgid cannot be reused.
      watcher_->forget(w->pid);
      if (w->status_lost) continue;
      int status = 0;
      while (::waitpid(w->pid, &status, 0) < 0 && errno == EINTR) {
      }
      own(w->pid, false);
    }
  });

  // Every escaped descendant: once the workers are gone they are our
  // children (or become so as their parents die), and are killed and reaped.
  // Reparenting raises no event; a short bounded wait between rounds.
  const auto escape_deadline = SteadyClock::now() + kKillWait;
  for (;;) {
    size_t alive = run_on_io([&] { return handle_escapees(SIGKILL); });
    if (alive == 0) break;
    if (SteadyClock::now() >= escape_deadline) {
      log_->error("{} escaped descendants of the workers did not die {} ms after SIGKILL", alive,
                  kKillWait.count());
      break;
    }
    std::this_thread::sleep_for(milliseconds(5));
  }

  std::vector<WorkerExit> result;
  lock.lock();
  // An on_sigchld() that was under way when the set was taken may have queued
  // exits of it since; it has finished now (the io thread ran the step above
  // after it).
  exits_.clear();
  for (auto& w : set) {
    if (!w->exited || w->reported) continue;
    w->reported = true;
    result.push_back(w->exit);
  }
  return result;
}

size_t ProcessLauncher::running() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<size_t>(
      std::count_if(workers_.begin(), workers_.end(), [](const auto& w) { return !w->exited; }));
}

}  // namespace

std::unique_ptr<Launcher> make_process_launcher() { return std::make_unique<ProcessLauncher>(); }

void handle_job_control() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTSTP);
  sigaddset(&set, SIGCONT);
  ::pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([set] {
    sigset_t all;
    sigfillset(&all);
    ::pthread_sigmask(SIG_SETMASK, &all, nullptr);
    auto signal_workers = [](int sig) {
      std::lock_guard<std::mutex> lock(g_launchers_mutex);
      for (Launcher* l : g_launchers) l->signal_all(sig);
    };
    for (;;) {
      int sig = 0;
      if (::sigwait(&set, &sig) != 0) continue;
      if (sig == SIGTSTP) {
        get_logger("worker")->debug("SIGTSTP: stopping the workers, then the launcher");
        signal_workers(SIGSTOP);
        ::kill(::getpid(), SIGSTOP);
      } else {
        signal_workers(SIGCONT);
        get_logger("worker")->debug("SIGCONT: workers continued");
      }
    }
  }).detach();
}

}  // namespace ctorchrun::worker
