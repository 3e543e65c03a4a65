// fake_worker: a stand-in for a training process, driven by flags that run in
// the order given. Used by the worker and agent tests.
//
//   --exit N              exit code at the end (default 0)
//   --sleep-ms N          sleep N ms
//   --signal N            die by signal N (its default action, no core file)
//   --ignore-term         ignore SIGTERM from here on (inherited by --grandchild)
//   --info-json PATH      write {argv, env, cwd, pid, pgid, sid, ppid, fds,
//                         fd_targets, blocked, ignored} as JSON
//   --env-json PATH       write the environment alone as a JSON object
//   --pidfile PATH        write the pid (atomically: the file appears whole)
//   --time-file PATH      write the system clock now, in ns since the epoch
//   --stdout TEXT         print TEXT and '\n' to stdout (stdio, flushed at once)
//   --stderr TEXT         likewise to stderr
//   --stdout-partial TEXT print TEXT without '\n' to stdout
//   --line-bytes N        length of the lines of --stdout-lines/--stderr-lines (default 100)
//   --stdout-lines N      print N lines "out <rank> <i> xxx..." (rank: $LOCAL_RANK or 0)
//                         through stdio's buffering, so chunks split lines
//   --stderr-lines N      likewise "err <rank> <i> ..." to stderr (unbuffered)
//   --grandchild PATH     fork a child that stays in this process group,
//                         writes its pid to PATH and sleeps 120 s
//   --vfork-sleep-ms N    vfork a child that sleeps N ms and exits: meanwhile
//                         this process is in uninterruptible sleep (state D)
//   --                    the rest are plain arguments (for --info-json's argv)
//
// Every sleep is bounded, so a test that fails never leaves a process behind
// for long.

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace {

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "fake_worker: %s\n", why.c_str());
  std::exit(64);
}

void write_atomically(const std::string& path, const std::string& content) {
  std::string tmp = path + ".tmp" + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << content;
    if (!f) usage("cannot write " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) usage("cannot rename to " + path);
}

nlohmann::json environment() {
  nlohmann::json env = nlohmann::json::object();
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    env[kv.substr(0, eq)] = eq == std::string::npos ? "" : kv.substr(eq + 1);
  }
  return env;
}

std::vector<int> open_fds() {
  std::vector<int> fds;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return fds;
  int self = ::dirfd(dir);
  while (dirent* ent = ::readdir(dir)) {
    if (ent->d_name[0] == '.') continue;
    int fd = std::atoi(ent->d_name);
    if (fd != self) fds.push_back(fd);
  }
  ::closedir(dir);
  return fds;
}

nlohmann::json info(int argc, char** argv) {
  nlohmann::json j;
  j["argv"] = std::vector<std::string>(argv, argv + argc);
  j["env"] = environment();
  char cwd[4096];
  j["cwd"] = ::getcwd(cwd, sizeof cwd) ? cwd : "";
  j["pid"] = ::getpid();
  j["ppid"] = ::getppid();
  j["pgid"] = ::getpgrp();
  j["sid"] = ::getsid(0);
  j["fds"] = open_fds();
  nlohmann::json targets = nlohmann::json::object();
  for (int fd = 0; fd <= 2; ++fd) {
    char target[256] = {};
    std::string link = "/proc/self/fd/" + std::to_string(fd);
    if (::readlink(link.c_str(), target, sizeof target - 1) > 0)
      targets[std::to_string(fd)] = target;
  }
  j["fd_targets"] = targets;
  sigset_t mask;
  ::sigprocmask(SIG_BLOCK, nullptr, &mask);
  std::vector<int> blocked, ignored;
  for (int sig = 1; sig < NSIG; ++sig) {
    if (sigismember(&mask, sig) == 1) blocked.push_back(sig);
    struct sigaction sa;
    if (::sigaction(sig, nullptr, &sa) == 0 && sa.sa_handler == SIG_IGN) ignored.push_back(sig);
  }
  j["blocked"] = blocked;
  j["ignored"] = ignored;
  return j;
}

// Dies by `sig` with its default action. The disposition is set with the raw
// system call: a sanitizer runtime intercepts signal()/sigaction() for SIGSEGV
// and would turn the death into an exit code.
[[noreturn]] void die_by(int sig) {
  struct rlimit no_core = {0, 0};
  ::setrlimit(RLIMIT_CORE, &no_core);
  struct {
    void* handler;
    unsigned long flags;
    void* restorer;
    unsigned long mask;
  } kernel_action = {nullptr /* SIG_DFL */, 0, nullptr, 0};
  ::syscall(SYS_rt_sigaction, sig, &kernel_action, nullptr, sizeof(unsigned long));
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, sig);
  ::sigprocmask(SIG_UNBLOCK, &set, nullptr);
  ::syscall(SYS_tgkill, ::getpid(), ::syscall(SYS_gettid), sig);
  std::fprintf(stderr, "fake_worker: survived signal %d\n", sig);
  std::_Exit(99);
}

std::string line_of(const char* kind, const std::string& rank, long i, long bytes) {
  std::string line = std::string(kind) + " " + rank + " " + std::to_string(i) + " ";
  if (static_cast<long>(line.size()) < bytes) line.append(bytes - line.size(), 'x');
  return line;
}

void sleep_ms(long ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

}  // namespace

// Blocks in vfork() (state D) while the child sleeps `ms`; in a function of
// its own, so that nothing of main's lives across the vfork.
__attribute__((noinline)) void vfork_sleep(long ms) {
  std::fflush(nullptr);
  const timespec t{ms / 1000, (ms % 1000) * 1'000'000};
  // The vfork child only makes system calls, as a vfork child may.
  pid_t pid = ::vfork();
  if (pid == 0) {
    ::nanosleep(&t, nullptr);
    ::_exit(0);
  }
  if (pid < 0) usage("vfork failed");
  int status = 0;
  ::waitpid(pid, &status, 0);
}

int main(int argc, char** argv) {
  int exit_code = 0;
  long line_bytes = 100;
  const char* rank_env = std::getenv("LOCAL_RANK");
  std::string rank = rank_env ? rank_env : "0";
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "--") break;
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(flag + " needs a value");
      return argv[++i];
    };
    auto number = [&]() -> long { return std::stol(value()); };
    if (flag == "--exit") {
      exit_code = static_cast<int>(number());
    } else if (flag == "--sleep-ms") {
      sleep_ms(number());
    } else if (flag == "--signal") {
      std::fflush(nullptr);
      die_by(static_cast<int>(number()));
    } else if (flag == "--ignore-term") {
      ::signal(SIGTERM, SIG_IGN);
    } else if (flag == "--info-json") {
      std::string path = value();
      write_atomically(path, info(argc, argv).dump());
    } else if (flag == "--env-json") {
      std::string path = value();
      write_atomically(path, environment().dump());
    } else if (flag == "--pidfile") {
      write_atomically(value(), std::to_string(::getpid()));
    } else if (flag == "--time-file") {
      std::string path = value();
      auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
          std::chrono::system_clock::now().time_since_epoch());
      write_atomically(path, std::to_string(ns.count()));
    } else if (flag == "--stdout") {
      std::string text = value();
      std::fprintf(stdout, "%s\n", text.c_str());
      std::fflush(stdout);
    } else if (flag == "--stderr") {
      std::string text = value();
      std::fprintf(stderr, "%s\n", text.c_str());
    } else if (flag == "--stdout-partial") {
      std::string text = value();
      std::fputs(text.c_str(), stdout);
      std::fflush(stdout);
    } else if (flag == "--line-bytes") {
      line_bytes = number();
    } else if (flag == "--stdout-lines") {
      long n = number();
      for (long k = 0; k < n; ++k) std::printf("%s\n", line_of("out", rank, k, line_bytes).c_str());
      std::fflush(stdout);
    } else if (flag == "--stderr-lines") {
      long n = number();
      for (long k = 0; k < n; ++k) {
        std::fprintf(stderr, "%s\n", line_of("err", rank, k, line_bytes).c_str());
      }
    } else if (flag == "--vfork-sleep-ms") {
      vfork_sleep(number());
    } else if (flag == "--grandchild") {
      std::string path = value();
      std::fflush(nullptr);
      pid_t pid = ::fork();
      if (pid < 0) usage("fork failed");
      if (pid == 0) {
        write_atomically(path, std::to_string(::getpid()));
        sleep_ms(120'000);
        std::_Exit(0);
      }
    } else {
      usage("unknown flag " + flag);
    }
  }
  std::fflush(nullptr);
  return exit_code;
}
