#include "worker/tee_writer.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string_view>

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

TeeWriter::TeeWriter(int file_fd, ConsoleLine console, std::string prefix, FileError on_file_error)
    : file_fd_(file_fd),
      console_(std::move(console)),
      prefix_(std::move(prefix)),
      on_file_error_(std::move(on_file_error)) {}

void TeeWriter::write(const char* data, size_t size) {
  if (file_fd_ >= 0 && !write_all(file_fd_, data, size)) {
    int error = errno;
    file_fd_ = -1;
    if (on_file_error_) on_file_error_(error);
  }
  if (!console_) return;
  const char* end = data + size;
  while (data < end) {
    const char* nl = static_cast<const char*>(std::memchr(data, '\n', end - data));
    if (nl == nullptr) {
      partial_.append(data, end);
      while (partial_.size() >= kMaxLine) {
        console_line(partial_.data(), kMaxLine);
        partial_.erase(0, kMaxLine);
        after_piece_ = true;
      }
      if (!partial_.empty()) after_piece_ = false;
      return;
    }
    if (partial_.empty()) {
      // A line of exactly k * kMaxLine bytes was handed on in pieces already.
      if (!(after_piece_ && nl == data)) console_line(data, nl - data);
    } else {
      partial_.append(data, nl);
      console_line(partial_.data(), partial_.size());
      partial_.clear();
    }
    after_piece_ = false;
    data = nl + 1;
  }
}

void TeeWriter::finish() {
  if (console_ && !partial_.empty()) console_line(partial_.data(), partial_.size());
  partial_.clear();
  partial_.shrink_to_fit();
  after_piece_ = false;
}

void TeeWriter::console_line(const char* data, size_t size) {
  std::string line;
  line.reserve(prefix_.size() + size + 1);
  line.append(prefix_).append(data, size).push_back('\n');
  console_(std::move(line));
}

LineFilter::LineFilter(std::vector<std::string> filters, std::string path, FileError on_error)
    : filters_(std::move(filters)), path_(std::move(path)), on_error_(std::move(on_error)) {}

LineFilter::~LineFilter() {
  if (fd_ >= 0) ::close(fd_);
}

void LineFilter::offer(const std::string& line, size_t prefix_size) {
  if (failed_) return;
  const std::string_view text = std::string_view(line).substr(std::min(prefix_size, line.size()));
  bool match = false;
  for (const std::string& f : filters_) {
    if (text.find(f) != std::string_view::npos) {
      match = true;
      break;
    }
  }
  if (!match) return;
  if (fd_ < 0) fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd_ < 0 || !write_all(fd_, line.data(), line.size())) {
    const int error = errno;
    failed_ = true;
    if (on_error_) on_error_(error);
  }
}

}  // namespace ctorchrun::worker::detail
