#include "worker/proc_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

namespace ctorchrun::worker {

std::string read_fd_text(int fd) {
  std::string text;
  char buf[4096];
  for (int i = 0; i < 1024;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
    ++i;
  }
  return text;
}

std::string read_proc_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  std::string text = read_fd_text(fd);
  ::close(fd);
  return text;
}

}  // namespace ctorchrun::worker
