#include "worker/tee_writer.h"

#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/log.h"

namespace ctorchrun::worker::detail {

bool write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        // Somebody made the descriptor non-blocking (a shared terminal or pipe).
        pollfd p{fd, POLLOUT, 0};
        ::poll(&p, 1, -1);
        continue;
      }
      return false;
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

TeeWriter::TeeWriter(int file_fd, int console_fd, std::string prefix)
    : file_fd_(file_fd), console_fd_(console_fd), prefix_(std::move(prefix)) {}

void TeeWriter::write(const char* data, size_t size) {
  if (file_fd_ >= 0 && !write_all(file_fd_, data, size)) {
    get_logger("worker")->debug("worker log file write failed fd={}: {}; file output dropped",
                                file_fd_, std::strerror(errno));
    file_fd_ = -1;
  }
  if (console_fd_ < 0) return;
  const char* end = data + size;
  while (data < end && console_fd_ >= 0) {
    const char* nl = static_cast<const char*>(std::memchr(data, '\n', end - data));
    if (nl == nullptr) {
      partial_.append(data, end);
      while (partial_.size() >= kMaxLine && console_fd_ >= 0) {
        console_line(partial_.data(), kMaxLine);
        partial_.erase(0, kMaxLine);
      }
      return;
    }
    if (partial_.empty()) {
      console_line(data, nl - data);
    } else {
      partial_.append(data, nl);
      console_line(partial_.data(), partial_.size());
      partial_.clear();
    }
    data = nl + 1;
  }
}

void TeeWriter::finish() {
  if (console_fd_ >= 0 && !partial_.empty()) console_line(partial_.data(), partial_.size());
  partial_.clear();
  partial_.shrink_to_fit();
}

void TeeWriter::console_line(const char* data, size_t size) {
  line_.clear();
  line_.reserve(prefix_.size() + size + 1);
  line_.append(prefix_).append(data, size).push_back('\n');
  if (!write_all(console_fd_, line_.data(), line_.size())) {
    get_logger("worker")->debug("console write failed fd={}: {}; teed console output dropped",
                                console_fd_, std::strerror(errno));
    console_fd_ = -1;
  }
  if (line_.capacity() > 64 * 1024) std::string().swap(line_);
}

}  // namespace ctorchrun::worker::detail
