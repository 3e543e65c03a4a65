#include "worker/watcher.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "common/error.h"
#include "common/log.h"

namespace ctorchrun::worker::detail {

namespace {

// More process groups than one agent ever has at once; beyond it a "+" is
// dropped (PR_SET_PDEATHSIG still covers that worker itself).
constexpr size_t kMaxGroups = 8192;

constexpr int kChannelFd = 3;

// The watcher's whole life. It runs in a child forked from a possibly
// multi-threaded agent, so it calls nothing but async-signal-safe functions:
// no allocation, no locks, no stdio, no logging.
[[noreturn]] void watcher_main(int fd, int max_fd) {
  // Handlers installed by the agent would run here with the agent's state;
  // take them all back to the default, then ignore what a terminal, a
  // group-wide kill or a scheduler would send (Slurm signals every process of
  // a step, SIGUSR1/2 too for its time-limit warning). SIGKILL and SIGSTOP
  // fail harmlessly.
  struct sigaction dfl;
  std::memset(&dfl, 0, sizeof dfl);
  dfl.sa_handler = SIG_DFL;
  for (int sig = 1; sig < NSIG; ++sig) ::sigaction(sig, &dfl, nullptr);
  struct sigaction ign = dfl;
  ign.sa_handler = SIG_IGN;
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGUSR1, SIGUSR2}) {
    ::sigaction(sig, &ign, nullptr);
  }
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);

  ::setsid();
  ::prctl(PR_SET_NAME, "ctorchrun-watch", 0, 0, 0);
  if (::chdir("/") != 0) {
    // Harmless: the watcher only pins the directory it started in.
  }

  // Keep the channel as fd 3, /dev/null as 0-2, nothing else: a pipe end the
  // watcher kept open would hide an EOF from whoever reads the other end.
  if (fd != kChannelFd) {
    ::dup2(fd, kChannelFd);
    ::close(fd);
  }
  int null_fd = ::open("/dev/null", O_RDWR);
  for (int target = 0; target <= 2; ++target) {
    if (null_fd >= 0) {
      ::dup2(null_fd, target);
    } else {
      ::close(target);
    }
  }
  if (::close_range(kChannelFd + 1, ~0U, 0) != 0) {
    for (int i = kChannelFd + 1; i < max_fd; ++i) ::close(i);
  }

  pid_t groups[kMaxGroups];
  size_t count = 0;
  char line[32];
  size_t len = 0;
  bool overlong = false;
  char buf[512];
  for (;;) {
    ssize_t n = ::read(kChannelFd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // EOF or error: the agent is gone
    for (ssize_t i = 0; i < n; ++i) {
      char c = buf[i];
      if (c != '\n') {
        if (len < sizeof line - 1) {
          line[len++] = c;
        } else {
          overlong = true;
        }
        continue;
      }
      line[len] = '\0';
      if (!overlong) {
        if (len == 3 && line[0] == 'b' && line[1] == 'y' && line[2] == 'e') ::_exit(0);
        if (len >= 2 && (line[0] == '+' || line[0] == '-')) {
          long value = 0;
          bool ok = true;
          for (size_t k = 1; k < len && ok; ++k) {
            if (line[k] < '0' || line[k] > '9' || value > 100000000) {
              ok = false;
            } else {
              value = value * 10 + (line[k] - '0');
            }
          }
          pid_t pgid = static_cast<pid_t>(value);
          if (ok && pgid > 1) {
            size_t at = 0;
            while (at < count && groups[at] != pgid) ++at;
            if (line[0] == '+' && at == count && count < kMaxGroups) {
              groups[count++] = pgid;
            } else if (line[0] == '-' && at < count) {
              groups[at] = groups[--count];
            }
          }
        }
      }
      len = 0;
      overlong = false;
    }
  }
  for (size_t i = 0; i < count; ++i) {
    if (groups[i] > 1) ::kill(-groups[i], SIGKILL);
  }
  ::_exit(0);
}

}  // namespace

std::unique_ptr<Watcher> Watcher::spawn() {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    throw IoError(std::string("cannot start the worker watcher: socketpair: ") +
                  std::strerror(errno));
  }
  long open_max = ::sysconf(_SC_OPEN_MAX);
  int max_fd = open_max > 0 && open_max < 65536 ? static_cast<int>(open_max) : 65536;
  pid_t pid = ::fork();
  if (pid < 0) {
    int err = errno;
    ::close(sv[0]);
    ::close(sv[1]);
    throw IoError(std::string("cannot start the worker watcher: fork: ") + std::strerror(err));
  }
  if (pid == 0) {
    ::close(sv[0]);
    watcher_main(sv[1], max_fd);
  }
  ::close(sv[1]);
  get_logger("worker")->debug("watcher started pid={}", pid);
  return std::unique_ptr<Watcher>(new Watcher(UniqueFd(sv[0]), pid));
}

Watcher::~Watcher() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (fd_.valid()) {
    static const char kBye[] = "bye\n";
    ::send(fd_.get(), kBye, sizeof kBye - 1, MSG_NOSIGNAL);
    fd_.reset();
  }
  reap_blocking();
}

void Watcher::watch(pid_t pgid) {
  CTORCHRUN_CHECK(pgid > 1, "watch() of pgid " + std::to_string(pgid));
  char line[32];
  int n = std::snprintf(line, sizeof line, "+%d\n", static_cast<int>(pgid));
  send(line, static_cast<size_t>(n));
}

void Watcher::forget(pid_t pgid) {
  char line[32];
  int n = std::snprintf(line, sizeof line, "-%d\n", static_cast<int>(pgid));
  send(line, static_cast<size_t>(n));
}

void Watcher::send(const char* line, size_t len) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!fd_.valid()) return;
  size_t done = 0;
  while (done < len) {
    ssize_t n = ::send(fd_.get(), line + done, len - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (!broken_) {
        broken_ = true;
        get_logger("worker")->warn(
            "worker watcher pid={} unreachable ({}): workers will not be killed if this "
            "process dies abruptly",
            pid_, std::strerror(errno));
      }
      return;
    }
    done += static_cast<size_t>(n);
  }
}

bool Watcher::reap_if_exited() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (reaped_) return true;
  int status = 0;
  pid_t r = ::waitpid(pid_, &status, WNOHANG);
  if (r == 0) return false;
  reaped_ = true;
  get_logger("worker")->warn(
      "worker watcher pid={} exited unexpectedly: workers will not be killed if this process "
      "dies abruptly",
      pid_);
  return true;
}

void Watcher::close_without_bye_for_test() {
  std::lock_guard<std::mutex> lock(mutex_);
  fd_.reset();
  reap_blocking();
}

void Watcher::reap_blocking() {
  if (reaped_ || pid_ <= 0) return;
  int status = 0;
  while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  reaped_ = true;
}

}  // namespace ctorchrun::worker::detail
