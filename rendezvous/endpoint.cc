#include "rendezvous/endpoint.h"

#include <algorithm>
#include <thread>

#include "common/deadline.h"
#include "common/error.h"

namespace ctorchrun::rendezvous {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::string format_endpoint(const std::string& addr, int port) {
  return (addr.find(':') != std::string::npos ? "[" + addr + "]" : addr) + ":" +
         std::to_string(port);
}

std::shared_ptr<store::TcpStore> tcp_client(const std::string& addr, int port,
                                            milliseconds connect_timeout, milliseconds op_timeout) {
  store::TcpStoreOptions o;
  o.host = addr;
  o.port = static_cast<uint16_t>(port);
  o.connect_timeout = connect_timeout;
  o.timeout = op_timeout;
  return std::make_shared<store::TcpStore>(o);
}

std::shared_ptr<store::TcpStore> connect_until(const std::string& addr, int port,
                                               const ConnectRetry& retry) {
  auto next_log = Clock::now() + retry.wait_log_interval;
  for (;;) {
    auto slice = std::clamp(left_until(std::min(retry.deadline, next_log)), milliseconds(1),
                            retry.wait_log_interval);
    try {
      return tcp_client(addr, port, slice, retry.op_timeout);
    } catch (const TimeoutError& e) {
      if (Clock::now() >= retry.deadline) throw TimeoutError(retry.timeout_message(e.what()));
      if (Clock::now() >= next_log) {
        next_log = Clock::now() + retry.wait_log_interval;
        retry.on_wait(e.what());
      } else {
        // The client gives up early when its backoff outlasts the slice.
        std::this_thread::sleep_for(std::min(left_until(retry.deadline), milliseconds(20)));
      }
    }
  }
}

}  // namespace ctorchrun::rendezvous
