#pragma once

// Helpers of the checkpoint tests: temporary directories, files, valid
// steps, peak memory, and child processes (a save that dies, a second writer,
// a load measured alone).

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include "collectives/checkpoint.h"

namespace ckpt_test {

struct TempDir {
  TempDir() {
    char pattern[] = "/tmp/ctorch_ckpt_test.XXXXXX";
    path = ::mkdtemp(pattern);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string path;
};

inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

inline void spit(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << data;
}

// The names in `dir` that start with `prefix`, sorted.
inline std::vector<std::string> names_starting(const std::string& dir, const std::string& prefix) {
  std::vector<std::string> out;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) == 0) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The host name as checkpoint temporary file names carry it.
inline std::string temp_host() {
  char buffer[256] = {};
  ::gethostname(buffer, sizeof buffer - 1);
  std::string out = buffer;
  for (char& c : out) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '-' || c == '_';
    if (!ok) c = '_';
  }
  return out.empty() ? "unknown-host" : out;
}

// A forked child running `body(out, in)`: it writes to the parent through
// `out` and reads the parent's messages from `in`. Its exit code is 0 when
// `body` returns, 3 when it throws (the message goes to `out`). Every wait is
// bounded; a child that outlives one is killed.
class Child {
 public:
  explicit Child(const std::function<void(int out, int in)>& body) {
    int up[2];
    int down[2];
    if (::pipe2(up, O_CLOEXEC) != 0 || ::pipe2(down, O_CLOEXEC) != 0) std::abort();
    pid_ = ::fork();
    if (pid_ < 0) std::abort();
    if (pid_ == 0) {
      ::close(up[0]);
      ::close(down[1]);
      int code = 0;
      try {
        body(up[1], down[0]);
      } catch (const std::exception& e) {
        const std::string what = std::string("exception: ") + e.what() + "\n";
        (void)!::write(up[1], what.data(), what.size());
        code = 3;
      }
      ::_exit(code);
    }
    ::close(up[1]);
    ::close(down[0]);
    from_ = up[0];
    to_ = down[1];
  }
  ~Child() {
    if (pid_ > 0) wait(0);
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  pid_t pid() const { return pid_; }

  // Reads up to and including a newline; "" at end of file or timeout.
  std::string read_line(int timeout_ms) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    for (;;) {
      const size_t newline = output_.find('\n');
      if (newline != std::string::npos) {
        std::string line = output_.substr(0, newline + 1);
        output_.erase(0, newline + 1);
        return line;
      }
      if (!read_some(deadline)) return "";
    }
  }

  void send(const std::string& text) { (void)!::write(to_, text.data(), text.size()); }

  // Waits for the exit (killing the child past the timeout); the wait status.
  int wait(int timeout_ms) {
    if (pid_ <= 0) return status_;
    ::close(to_);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (read_some(deadline)) {
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      timed_out_ = true;
      ::kill(pid_, SIGKILL);
    }
    ::close(from_);
    while (::waitpid(pid_, &status_, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
    return status_;
  }

  // What the child wrote and no read_line took.
  const std::string& output() const { return output_; }
  bool timed_out() const { return timed_out_; }

 private:
  // Appends what the child wrote; false at end of file or past the deadline.
  bool read_some(std::chrono::steady_clock::time_point deadline) {
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                            deadline - std::chrono::steady_clock::now())
                            .count();
      if (left <= 0) return false;
      pollfd p{from_, POLLIN, 0};
      int n = ::poll(&p, 1, static_cast<int>(left));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) continue;
      char buffer[4096];
      ssize_t got = ::read(from_, buffer, sizeof buffer);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return false;
      output_.append(buffer, static_cast<size_t>(got));
      return true;
    }
  }

  pid_t pid_ = -1;
  int from_ = -1;
  int to_ = -1;
  int status_ = 0;
  bool timed_out_ = false;
  std::string output_;
};

// The steps whose files load and whose header names their step.
inline std::vector<int64_t> valid_steps(const std::string& dir) {
  std::vector<int64_t> out;
  for (int64_t step : ctorchrun::dist::list_checkpoints(dir)) {
    auto loaded = ctorchrun::dist::load_checkpoint(ctorchrun::dist::checkpoint_path(dir, step));
    if (loaded && loaded->step == step) out.push_back(step);
  }
  return out;
}

// VmHWM of this process, in KiB; -1 if unreadable.
inline long peak_kib() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stol(line.substr(6));
  }
  return -1;
}

// Resets VmHWM to the current resident size (Linux 4.0 and later).
inline bool reset_peak() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return static_cast<bool>(out);
}

inline void write_text(int fd, const std::string& text) {
  (void)!::write(fd, text.data(), text.size());
}

// Reads a line from `fd` within `timeout_ms`; "" otherwise.
inline std::string read_line_fd(int fd, int timeout_ms) {
  std::string line;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (line.empty() || line.back() != '\n') {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                          deadline - std::chrono::steady_clock::now())
                          .count();
    if (left <= 0) return "";
    pollfd p{fd, POLLIN, 0};
    int n = ::poll(&p, 1, static_cast<int>(left));
    if (n <= 0) continue;
    char c;
    ssize_t got = ::read(fd, &c, 1);
    if (got <= 0) return "";
    line.push_back(c);
  }
  return line;
}

// Saves a checkpoint of `size` bytes at step 1 under `dir` (one distinct
// byte per page, the rest zero) and returns its path; the payload is freed
// before it returns, so that a later measure of memory starts clean.
inline std::string save_large_checkpoint(const std::string& dir, size_t size) {
  std::string payload(size, '\0');
  for (size_t i = 0; i < size; i += 4096) payload[i] = static_cast<char>(i / 4096);
  return ctorchrun::dist::save_checkpoint(dir, 1, payload);
}

}  // namespace ckpt_test
