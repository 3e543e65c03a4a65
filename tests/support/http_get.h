#pragma once

// Test helper: one HTTP exchange on 127.0.0.1 by hand (the agent's /healthz).

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <optional>
#include <string>

namespace ctorchrun::testing {

struct HttpReply {
  int status = 0;    // from the status line
  std::string body;  // after the head
  std::string raw;
};

// Sends `request` to 127.0.0.1:`port` and reads until the server closes;
// nullopt when it cannot connect, or no complete reply came within `timeout`.
inline std::optional<HttpReply> http_exchange(int port, const std::string& request,
                                              std::chrono::milliseconds timeout) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return std::nullopt;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return std::nullopt;
  }
  size_t off = 0;
  while (off < request.size()) {
    const ssize_t n = ::send(fd, request.data() + off, request.size() - off, MSG_NOSIGNAL);
    if (n <= 0) break;  // the server may answer (431) before reading it all
    off += static_cast<size_t>(n);
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string raw;
  char buf[4096];
  bool eof = false;
  while (!eof) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) {
      eof = true;
    } else {
      raw.append(buf, static_cast<size_t>(n));
    }
  }
  ::close(fd);
  const size_t head_end = raw.find("\r\n\r\n");
  if (!eof || raw.compare(0, 9, "HTTP/1.1 ") != 0 || head_end == std::string::npos) {
    return std::nullopt;
  }
  HttpReply r;
  r.status = std::stoi(raw.substr(9, 3));
  r.body = raw.substr(head_end + 4);
  r.raw = raw;
  return r;
}

inline std::optional<HttpReply> http_get(int port, const std::string& path,
                                         std::chrono::milliseconds timeout) {
  return http_exchange(
      port, "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n", timeout);
}

}  // namespace ctorchrun::testing
