#include "tests/support/dropping_proxy.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <stdexcept>

namespace ctorchrun::testing {

DroppingProxy::DroppingProxy(std::string upstream_host, std::uint16_t upstream_port)
    : host_(std::move(upstream_host)), upstream_port_(upstream_port) {
  listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (listener_ < 0 || ::bind(listener_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::listen(listener_, 64) != 0 ||
      ::getsockname(listener_, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    throw std::runtime_error("DroppingProxy: cannot listen");
  }
  port_ = ntohs(a.sin_port);
  acceptor_ = std::thread([this] { accept_loop(); });
}

DroppingProxy::~DroppingProxy() {
  stop_ = true;
  ::shutdown(listener_, SHUT_RDWR);
  acceptor_.join();
  ::close(listener_);
  for (auto& t : threads_) t.join();
}

void DroppingProxy::drop_answer_to(std::vector<std::string> needles) {
  std::lock_guard<std::mutex> lock(mutex_);
  needles_ = std::move(needles);
}

void DroppingProxy::on_drop(std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(mutex_);
  on_drop_ = std::move(fn);
}

void DroppingProxy::accept_loop() {
  while (!stop_) {
    pollfd p{listener_, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    const int c = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) continue;
    threads_.emplace_back([this, c] { pump(c); });
  }
}

void DroppingProxy::pump(int client) {
  const int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(upstream_port_);
  ::inet_pton(AF_INET, host_.c_str(), &a.sin_addr);
  if (server < 0 || ::connect(server, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(client);
    if (server >= 0) ::close(server);
    return;
  }
  std::string seen;       // the client's current request, to find the needles in
  bool dropping = false;  // the matched request went out: its answer is lost
  const auto limit = std::chrono::steady_clock::now() + std::chrono::minutes(5);
  while (!stop_ && std::chrono::steady_clock::now() < limit) {
    pollfd p[2] = {{client, POLLIN, 0}, {server, POLLIN, 0}};
    if (::poll(p, 2, 50) <= 0) continue;
    char buf[65536];
    if (p[0].revents & (POLLIN | POLLHUP | POLLERR)) {
      const ssize_t n = ::read(client, buf, sizeof buf);
      if (n <= 0) break;
      if (::write(server, buf, static_cast<size_t>(n)) != n) break;
      const std::string chunk(buf, static_cast<size_t>(n));
      if (chunk.rfind("POST ", 0) == 0 || chunk.rfind("GET ", 0) == 0) seen.clear();
      seen += chunk;
      if (seen.size() > (1u << 20)) seen.erase(0, seen.size() - (1u << 19));
      std::lock_guard<std::mutex> lock(mutex_);
      bool all = !needles_.empty();
      for (const auto& needle : needles_) all = all && seen.find(needle) != std::string::npos;
      if (all) {
        needles_.clear();
        dropping = true;
      }
    }
    if (p[1].revents & (POLLIN | POLLHUP | POLLERR)) {
      const ssize_t n = ::read(server, buf, sizeof buf);
      if (n <= 0) break;
      if (dropping) {
        // The server answered (so it applied the request): the client never
        // hears of it.
        std::function<void()> fn;
        {
          std::lock_guard<std::mutex> lock(mutex_);
          fn = std::move(on_drop_);
        }
        if (fn) fn();
        ++dropped_;
        break;
      }
      if (::write(client, buf, static_cast<size_t>(n)) != n) break;
    }
  }
  ::close(client);
  ::close(server);
}

}  // namespace ctorchrun::testing
