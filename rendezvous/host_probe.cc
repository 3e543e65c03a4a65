#include "rendezvous/host_probe.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace ctorchrun::rendezvous {

HostProbe::HostProbe(std::string host, std::uint16_t port,
                     std::chrono::milliseconds connect_timeout)
    : host_(std::move(host)), port_(port), connect_timeout_(connect_timeout) {
  connect_now();
}

HostProbe::~HostProbe() {
  if (fd_ >= 0) ::close(fd_);
}

void HostProbe::connect_now() {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  // Numeric only: a name lookup could block the monitor for seconds.
  hints.ai_flags = AI_NUMERICSERV | AI_NUMERICHOST;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(port_);
  if (::getaddrinfo(host_.c_str(), port.c_str(), &hints, &res) != 0 || res == nullptr) return;
  const int fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    ::freeaddrinfo(res);
    return;
  }
  int rc = ::connect(fd, res->ai_addr, res->ai_addrlen);
  ::freeaddrinfo(res);
  if (rc != 0 && errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    const int timeout_ms = static_cast<int>(connect_timeout_.count());
    int n = -1;
    for (int i = 0; i < 8; ++i) {  // EINTR, bounded
      n = ::poll(&p, 1, timeout_ms);
      if (n >= 0 || errno != EINTR) break;
    }
    if (n == 1) {
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      rc = err == 0 ? 0 : -1;
      errno = err;
    } else {
      errno = ETIMEDOUT;
    }
  }
  if (rc == 0) {
    fd_ = fd;
    return;
  }
  const int err = errno;
  ::close(fd);
  // Refused: the host answers and nothing listens: the server is gone.
  // Anything else (timeout, unreachable) proves nothing.
  if (err == ECONNREFUSED) {
    gone_ = true;
    why_ = "connection refused";
  }
}

bool HostProbe::gone() {
  if (gone_) return true;
  if (fd_ < 0) {
    connect_now();
    return gone_;
  }
  pollfd p{fd_, POLLIN | POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if ((p.revents & (POLLRDHUP | POLLHUP | POLLERR)) == 0 && (p.revents & POLLIN) == 0) return false;
  char c;
  const ssize_t n = ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n > 0) return false;  // the server said something unasked: not a close
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
  std::string closed;
  if (n == 0) {
    closed = "closed by the peer";
  } else if (errno == ECONNRESET) {
    closed = "reset by the peer";
  } else {
    closed = std::string("failed: ") + std::strerror(errno);
  }
  // A server also closes connections it will not keep (at its connection
  // limit, say) while it lives: only a listener that is gone too means its
  // process is. A new connection tells: accepted, the process lives (the
  // probe keeps it); refused, it is gone; no answer proves nothing.
  ::close(fd_);
  fd_ = -1;
  connect_now();
  if (gone_) why_ = closed + ", and nothing listens any more";
  return gone_;
}

}  // namespace ctorchrun::rendezvous
