#pragma once

// Test helper: a raw TCP client on 127.0.0.1 that sends arbitrary bytes and
// reads replies with a timeout, to speak the store protocol (or garbage) by hand.

#include <chrono>
#include <optional>
#include <string>

namespace ctorchrun::testing {

class RawClient {
 public:
  explicit RawClient(int port);  // throws std::runtime_error if it cannot connect
  ~RawClient();
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;

  // Sends all bytes; false if the connection is broken.
  bool send(const std::string& bytes);
  // Exactly n bytes, or nullopt on timeout or close.
  std::optional<std::string> recv(size_t n, std::chrono::milliseconds timeout);
  // True if the server closed (EOF or reset) within the timeout; bytes that
  // arrive before the close are discarded.
  bool closed_within(std::chrono::milliseconds timeout);
  // True if nothing at all arrives within the timeout (and no close).
  bool silent_for(std::chrono::milliseconds timeout);

 private:
  int fd_ = -1;
};

}  // namespace ctorchrun::testing
