#pragma once

// DroppingProxy: a TCP proxy on 127.0.0.1 that forwards every connection to
// one upstream address and, when armed, loses one answer: the first request
// whose bytes contain a given text reaches the server (which applies it),
// the server's answer arrives, and the proxy closes the client's connection
// instead of passing it on. What a client sees when a member dies or a
// leader change cuts a request after it was applied. Threads of its own;
// stopped by its destructor.

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace ctorchrun::testing {

class DroppingProxy {
 public:
  DroppingProxy(std::string upstream_host, std::uint16_t upstream_port);
  ~DroppingProxy();
  DroppingProxy(const DroppingProxy&) = delete;
  DroppingProxy& operator=(const DroppingProxy&) = delete;

  std::uint16_t port() const { return port_; }
  // "127.0.0.1:<port>".
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(port_); }
  // The next request holding every one of `needles` (a request begins with
  // "POST " or "GET ") loses its answer (once).
  void drop_answer_to(std::vector<std::string> needles);
  // Runs `fn` on the proxy's thread when an answer is dropped, before the
  // client's connection closes: what other clients do while this one has
  // not yet learned that its request was applied.
  void on_drop(std::function<void()> fn);
  // How many answers were dropped so far.
  int dropped() const { return dropped_; }

 private:
  void accept_loop();
  void pump(int client);

  std::string host_;
  std::uint16_t upstream_port_;
  int listener_ = -1;
  std::uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> dropped_{0};
  std::mutex mutex_;
  std::vector<std::string> needles_;  // empty: not armed
  std::function<void()> on_drop_;
  std::vector<std::thread> threads_;
  std::thread acceptor_;
};

}  // namespace ctorchrun::testing
