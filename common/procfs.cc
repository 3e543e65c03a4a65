#include "common/procfs.h"

#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <vector>

namespace ctorchrun::procfs {

namespace {

bool to_number(const std::string& field, unsigned long long* out) {
  auto [end, ec] = std::from_chars(field.data(), field.data() + field.size(), *out);
  return ec == std::errc() && end == field.data() + field.size();
}

// The whole of a small /proc file with read(2) (a file of a process that
// exits meanwhile answers ESRCH): "" on any failure.
std::string read_small(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  std::string text;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0 && text.size() < (1u << 16)) {
      text.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) text.clear();
    break;
  }
  ::close(fd);
  return text;
}

}  // namespace

std::optional<Stat> parse_stat(const std::string& text) {
  // "pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt
  // cmajflt utime stime cutime cstime ... starttime": comm ends at the last ')'.
  const size_t close = text.rfind(')');
  if (close == std::string::npos || close + 2 >= text.size()) return std::nullopt;
  std::vector<std::string> fields;
  size_t at = close + 2;
  while (at < text.size() && fields.size() < 20) {
    size_t space = text.find_first_of(" \n", at);
    if (space == std::string::npos) space = text.size();
    fields.push_back(text.substr(at, space - at));
    at = space + 1;
  }
  // From the state (index 0): ppid 1, pgrp 2, session 3, utime 11, stime 12,
  // cutime 13, cstime 14, starttime 19.
  if (fields.size() < 15 || fields[0].size() != 1) return std::nullopt;
  unsigned long long n[8] = {};
  const size_t index[8] = {1, 2, 3, 11, 12, 13, 14, 19};
  for (int i = 0; i < 8; ++i) {
    if (index[i] >= fields.size()) break;  // starttime: optional
    if (!to_number(fields[index[i]], &n[i])) return std::nullopt;
  }
  Stat s;
  s.state = fields[0][0];
  s.ppid = static_cast<pid_t>(n[0]);
  s.pgrp = static_cast<pid_t>(n[1]);
  s.session = static_cast<pid_t>(n[2]);
  s.utime = n[3];
  s.stime = n[4];
  s.cutime = n[5];
  s.cstime = n[6];
  s.starttime = n[7];
  return s;
}

std::optional<Stat> read_stat(pid_t pid, const std::string& proc_root) {
  const std::string text = read_small(proc_root + "/" + std::to_string(pid) + "/stat");
  if (text.empty()) return std::nullopt;
  return parse_stat(text);
}

bool running(pid_t pid, const std::string& proc_root) {
  const auto s = read_stat(pid, proc_root);
  return s && s->state != 'Z' && s->state != 'X';
}

int pidfd_open(pid_t pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
#else
  (void)pid;
  errno = ENOSYS;
  return -1;
#endif
}

int pidfd_send_signal(int pidfd, int sig) {
#ifdef SYS_pidfd_send_signal
  return static_cast<int>(::syscall(SYS_pidfd_send_signal, pidfd, sig, nullptr, 0));
#else
  (void)pidfd;
  (void)sig;
  errno = ENOSYS;
  return -1;
#endif
}

}  // namespace ctorchrun::procfs
