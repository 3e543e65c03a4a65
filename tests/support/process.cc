#include "tests/support/process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <thread>

namespace ctorchrun::testing {

using Clock = std::chrono::steady_clock;

Process::Process(const std::vector<std::string>& argv,
                 const std::map<std::string, std::string>& env, bool capture_stderr) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_ = fork();
  if (pid_ < 0) throw std::runtime_error("fork failed");
  if (pid_ == 0) {
    setpgid(0, 0);
    dup2(fds[1], STDOUT_FILENO);
    if (capture_stderr) dup2(fds[1], STDERR_FILENO);
    for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    execv(args[0], args.data());
    std::fprintf(stderr, "exec %s failed: %s\n", args[0], std::strerror(errno));
    _exit(127);
  }
  setpgid(pid_, pid_);
  close(fds[1]);
  out_fd_ = fds[0];
}

Process::~Process() {
  if (!reaped_ && pid_ > 0) {
    ::kill(-pid_, SIGKILL);
    ::kill(pid_, SIGKILL);
    waitpid(pid_, &status_, 0);
  } else if (pid_ > 0) {
    ::kill(-pid_, SIGKILL);  // anything the child left in its group
  }
  if (out_fd_ >= 0) close(out_fd_);
}

std::optional<std::string> Process::read_line(std::chrono::milliseconds timeout) {
  auto deadline = Clock::now() + timeout;
  for (;;) {
    auto nl = buffer_.find('\n');
    if (nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      return line;
    }
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0 || out_fd_ < 0) return std::nullopt;
    pollfd p{out_fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    char buf[4096];
    ssize_t n = read(out_fd_, buf, sizeof buf);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      close(out_fd_);
      out_fd_ = -1;
      if (buffer_.empty()) return std::nullopt;
      std::string rest;
      rest.swap(buffer_);
      return rest;
    }
    buffer_.append(buf, static_cast<size_t>(n));
  }
}

std::string Process::read_all(std::chrono::milliseconds timeout) {
  auto deadline = Clock::now() + timeout;
  std::string out;
  while (Clock::now() < deadline) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    auto line = read_line(left);
    if (!line) break;
    out += *line + "\n";
  }
  return out;
}

std::optional<int> Process::wait(std::chrono::milliseconds timeout) {
  if (reaped_) return status_;
  auto deadline = Clock::now() + timeout;
  for (;;) {
    pid_t r = waitpid(pid_, &status_, WNOHANG);
    if (r == pid_) {
      reaped_ = true;
      return status_;
    }
    if (Clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

int Process::exit_code(std::chrono::milliseconds timeout) {
  auto st = wait(timeout);
  if (!st) return -1;
  if (WIFEXITED(*st)) return WEXITSTATUS(*st);
  if (WIFSIGNALED(*st)) return 128 + WTERMSIG(*st);
  return -1;
}

void Process::signal(int sig) {
  if (!reaped_) ::kill(pid_, sig);
}

void Process::signal_group(int sig) { ::kill(-pid_, sig); }

int wait_for_listening_port(Process& p, std::chrono::milliseconds timeout) {
  auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    auto line = p.read_line(left);
    if (!line) return 0;
    auto pos = line->rfind("listening on ");
    auto colon = line->rfind(':');
    if (pos != std::string::npos && colon != std::string::npos && colon > pos) {
      return std::atoi(line->c_str() + colon + 1);
    }
  }
  return 0;
}

long rss_kib(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atol(line.c_str() + 6);
  }
  return -1;
}

}  // namespace ctorchrun::testing
