#include "rendezvous/endpoint.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "common/deadline.h"
#include "common/error.h"

namespace ctorchrun::rendezvous {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

bool is_loopback(const sockaddr* sa) {
  if (sa->sa_family == AF_INET) {
    auto a = ntohl(reinterpret_cast<const sockaddr_in*>(sa)->sin_addr.s_addr);
    return (a >> 24) == 127;
  }
  if (sa->sa_family == AF_INET6) {
    return IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr);
  }
  return false;
}

std::string numeric(const sockaddr* sa, socklen_t len) {
  char host[NI_MAXHOST] = {};
  if (getnameinfo(sa, len, host, sizeof host, nullptr, 0, NI_NUMERICHOST) != 0) return "?";
  return host;
}

// True when this host can bind `sa` (port 0): the address is one of its own.
bool is_local(const sockaddr* sa, socklen_t len) {
  int fd = ::socket(sa->sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_storage copy{};
  std::memcpy(&copy, sa, len);
  if (sa->sa_family == AF_INET) reinterpret_cast<sockaddr_in*>(&copy)->sin_port = 0;
  if (sa->sa_family == AF_INET6) reinterpret_cast<sockaddr_in6*>(&copy)->sin6_port = 0;
  bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&copy), len) == 0;
  ::close(fd);
  return ok;
}

// True when this host can bind the numeric address `literal`.
bool bindable(const std::string& literal) {
  sockaddr_in a4{};
  a4.sin_family = AF_INET;
  if (inet_pton(AF_INET, literal.c_str(), &a4.sin_addr) == 1) {
    return is_local(reinterpret_cast<const sockaddr*>(&a4), sizeof a4);
  }
  sockaddr_in6 a6{};
  a6.sin6_family = AF_INET6;
  if (inet_pton(AF_INET6, literal.c_str(), &a6.sin6_addr) == 1) {
    return is_local(reinterpret_cast<const sockaddr*>(&a6), sizeof a6);
  }
  return false;
}

// True when this host can bind the IPv6 wildcard with IPV6_V6ONLY off, so
// that one socket serves both families.
bool dual_stack_wildcard() {
  int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  int off = 0;
  sockaddr_in6 a6{};
  a6.sin6_family = AF_INET6;
  a6.sin6_addr = in6addr_any;
  bool ok = ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof off) == 0 &&
            ::bind(fd, reinterpret_cast<sockaddr*>(&a6), sizeof a6) == 0;
  ::close(fd);
  return ok;
}

int port_of(const std::string& text, const std::string& digits) {
  if (digits.empty() || digits.size() > 5 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    throw ConfigError("endpoint '" + text + "': '" + digits + "' is not a port (1-65535)");
  }
  const int port = std::stoi(digits);
  if (port < 1 || port > 65535) {
    throw ConfigError("endpoint '" + text + "': '" + digits + "' is not a port (1-65535)");
  }
  return port;
}

}  // namespace

Endpoint parse_endpoint(const std::string& text, int default_port) {
  Endpoint e;
  e.port = default_port;
  if (!text.empty() && text[0] == '[') {
    const auto close = text.find(']');
    if (close == std::string::npos) throw ConfigError("endpoint '" + text + "' lacks a ']'");
    e.host = text.substr(1, close - 1);
    if (close + 1 < text.size()) {
      if (text[close + 1] != ':') throw ConfigError("endpoint '" + text + "' is not [HOST]:PORT");
      e.port = port_of(text, text.substr(close + 2));
    }
  } else {
    const auto colon = text.rfind(':');
    if (colon == std::string::npos) {
      e.host = text;
    } else {
      e.host = text.substr(0, colon);
      e.port = port_of(text, text.substr(colon + 1));
    }
  }
  if (e.host.empty()) throw ConfigError("endpoint '" + text + "' has no host");
  return e;
}

std::string strip_brackets(const std::string& addr) {
  if (addr.size() >= 2 && addr.front() == '[' && addr.back() == ']') {
    return addr.substr(1, addr.size() - 2);
  }
  return addr;
}

std::string bind_address_for(const std::string& master_addr) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(master_addr.c_str(), nullptr, &hints, &res);
  if (rc != 0) {
    throw IoError("--master_addr '" + master_addr + "' does not resolve (" + gai_strerror(rc) +
                  "); node 0 hosts the store there, so give an address or name of this host");
  }
  bool numeric_literal = false;
  {
    in6_addr a6{};
    in_addr a4{};
    numeric_literal = inet_pton(AF_INET, master_addr.c_str(), &a4) == 1 ||
                      inet_pton(AF_INET6, master_addr.c_str(), &a6) == 1;
  }
  std::string found;
  std::string tried;
  for (addrinfo* ai = res; ai && found.empty(); ai = ai->ai_next) {
    std::string text = numeric(ai->ai_addr, ai->ai_addrlen);
    if (tried.find(text) == std::string::npos) tried += (tried.empty() ? "" : ", ") + text;
    if (!is_local(ai->ai_addr, ai->ai_addrlen)) continue;
    // A loopback literal, or "localhost", keeps the store on that loopback
    // address. Anything else gets the wildcard of its family, as torch binds:
    // a name of this host may resolve here to 127.0.1.1 (Debian) and
    // elsewhere to the address the other nodes must reach.
    if (is_loopback(ai->ai_addr) && (numeric_literal || master_addr == "localhost")) {
      found = text;
    } else {
      found = ai->ai_family == AF_INET6 ? "::" : "0.0.0.0";
    }
  }
  freeaddrinfo(res);
  if (found.empty()) {
    throw IoError("--master_addr '" + master_addr + "' (" + tried +
                  ") is not an address of this host; node 0 hosts the store at master_addr, so "
                  "start node 0 on the machine that has it");
  }
  return found;
}

std::vector<std::string> bind_addresses_for(const std::string& addr) {
  const std::string one = bind_address_for(addr);  // IoError: not resolvable, not this host
  in_addr a4{};
  in6_addr a6{};
  const bool v4 = inet_pton(AF_INET, one.c_str(), &a4) == 1;
  const bool v6 = !v4 && inet_pton(AF_INET6, one.c_str(), &a6) == 1;
  if ((v4 && ntohl(a4.s_addr) == INADDR_LOOPBACK) || (v6 && IN6_IS_ADDR_LOOPBACK(&a6))) {
    // IPv4 first, for every spelling: the first address decides which of
    // several agents of this host hosts, so none can hold one family each.
    std::vector<std::string> out;
    for (const char* loop : {"127.0.0.1", "::1"}) {
      if (bindable(loop)) out.push_back(loop);
    }
    if (out.empty()) out.push_back(one);  // it was bindable a moment ago
    return out;
  }
  // Another 127.x literal is an address of its own, as before.
  if (v4 && (ntohl(a4.s_addr) >> 24) == 127) return {one};
  // A wildcard: the IPv6 one serves both families where the host has IPv6.
  if (dual_stack_wildcard()) return {"::"};
  return {one};
}

bool resolves(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (res != nullptr) freeaddrinfo(res);
  return rc == 0;
}

bool await_resolvable(const std::string& host, Clock::time_point deadline,
                      milliseconds log_interval, const std::function<void()>& on_wait) {
  auto next_log = Clock::now() + log_interval;
  for (;;) {
    if (resolves(host)) return true;
    if (Clock::now() >= deadline) return false;
    if (Clock::now() >= next_log) {
      next_log = Clock::now() + log_interval;
      if (on_wait) on_wait();
    }
    std::this_thread::sleep_for(std::min(left_until(deadline), milliseconds(250)));
  }
}

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
