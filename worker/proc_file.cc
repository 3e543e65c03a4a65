#include "worker/proc_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

namespace ctorchrun::worker {

std::optional<std::string> read_fd_text(int fd) {
  std::string text;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return std::nullopt;
    if (n == 0) return text;
    if (text.size() + static_cast<size_t>(n) > kProcTextLimit) return std::nullopt;
    text.append(buf, static_cast<size_t>(n));
  }
}

std::string read_proc_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  std::optional<std::string> text = read_fd_text(fd);
  ::close(fd);
  return text ? std::move(*text) : std::string();
}

}  // namespace ctorchrun::worker
