// A store on several addresses of one port (ServerOptions::also_hosts), such
// as both loopback addresses, bound all or nothing, and the IPv6 wildcard
// serving IPv4 clients too.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <memory>
#include <string>
#include <vector>

#include "common/error.h"
#include "store/tcp_store.h"
#include "store/tcp_store_server.h"

using namespace ctorchrun;
using namespace ctorchrun::store;
using namespace std::chrono_literals;

namespace {

// A socket of `family` bound to the numeric `host` at `port` (0: any), or -1.
int bound_socket(const std::string& host, uint16_t port, bool listen = false) {
  sockaddr_storage ss{};
  socklen_t len = 0;
  int family = AF_INET;
  auto* a4 = reinterpret_cast<sockaddr_in*>(&ss);
  auto* a6 = reinterpret_cast<sockaddr_in6*>(&ss);
  if (inet_pton(AF_INET, host.c_str(), &a4->sin_addr) == 1) {
    a4->sin_family = AF_INET;
    a4->sin_port = htons(port);
    len = sizeof *a4;
  } else if (inet_pton(AF_INET6, host.c_str(), &a6->sin6_addr) == 1) {
    family = AF_INET6;
    a6->sin6_family = AF_INET6;
    a6->sin6_port = htons(port);
    len = sizeof *a6;
  } else {
    return -1;
  }
  int fd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&ss), len) != 0 || (listen && ::listen(fd, 4) != 0)) {
    ::close(fd);
    return -1;
  }
  return fd;
}

bool has_v6_loopback() {
  int fd = bound_socket("::1", 0);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

// One connect to host:port, no retry: true if something accepts there.
bool accepts(const std::string& host, uint16_t port) {
  sockaddr_storage ss{};
  socklen_t len = 0;
  int family = AF_INET;
  auto* a4 = reinterpret_cast<sockaddr_in*>(&ss);
  auto* a6 = reinterpret_cast<sockaddr_in6*>(&ss);
  if (inet_pton(AF_INET, host.c_str(), &a4->sin_addr) == 1) {
    a4->sin_family = AF_INET;
    a4->sin_port = htons(port);
    len = sizeof *a4;
  } else {
    REQUIRE(inet_pton(AF_INET6, host.c_str(), &a6->sin6_addr) == 1);
    family = AF_INET6;
    a6->sin6_family = AF_INET6;
    a6->sin6_port = htons(port);
    len = sizeof *a6;
  }
  int fd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&ss), len) == 0;
  ::close(fd);
  return ok;
}

std::unique_ptr<TcpStore> client(const std::string& host, uint16_t port) {
  TcpStoreOptions o;
  o.host = host;
  o.port = port;
  o.timeout = 5s;
  o.connect_timeout = 5s;
  return std::make_unique<TcpStore>(o);
}

std::unique_ptr<TcpStoreServer> serve(const std::vector<std::string>& hosts, uint16_t port) {
  ServerOptions o;
  o.host = hosts.front();
  o.also_hosts.assign(hosts.begin() + 1, hosts.end());
  o.port = port;
  return TcpStoreServer::start(o);
}

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

}  // namespace

TEST_CASE("TcpStoreServer: binding is all or nothing: an address taken releases the others",
          "[net]") {
  if (!has_v6_loopback()) {
    WARN("this host has no ::1");
    return;
  }
  // Something else listens on ::1 only (an old ctorchrun's store for [::1]).
  auto v6_only = serve({"::1"}, 0);
  const uint16_t port = v6_only->port();
  try {
    serve({"127.0.0.1", "::1"}, port);
    FAIL("bound although ::1 is taken");
  } catch (const IoError& e) {
    CHECK(contains(e.what(), "[::1]:" + std::to_string(port)));
  }
  CHECK_FALSE(accepts("127.0.0.1", port));  // closed again
  auto v4_only = serve({"127.0.0.1"}, port);
  CHECK(accepts("127.0.0.1", port));

  // And the other way round: 127.0.0.1 taken, ::1 is never bound.
  v6_only.reset();
  CHECK_THROWS_AS(serve({"127.0.0.1", "::1"}, port), IoError);
  CHECK_FALSE(accepts("::1", port));
}

TEST_CASE("TcpStoreServer: with port 0 every address binds the port the first one picked",
          "[net]") {
  if (has_v6_loopback()) {
    for (int i = 0; i < 20; ++i) {
      auto server = serve({"127.0.0.1", "::1"}, 0);
      REQUIRE(server->port() != 0);
      CHECK(accepts("127.0.0.1", server->port()));
      CHECK(accepts("::1", server->port()));
    }
  }
  // A further address whose every picked port is taken (0.0.0.0 holds each
  // for 127.0.0.1): a bounded number of fresh ports, then IoError naming it.
  try {
    serve({"0.0.0.0", "127.0.0.1"}, 0);
    FAIL("127.0.0.1 bound beside 0.0.0.0 on one port");
  } catch (const IoError& e) {
    CHECK(contains(e.what(), "cannot bind the store server to 127.0.0.1:"));
    CHECK(contains(e.what(), "16 ports tried"));
  }
}

TEST_CASE("TcpStoreServer: the IPv6 wildcard is dual-stack: IPv4 clients reach it", "[net]") {
  if (!has_v6_loopback()) {
    WARN("this host has no IPv6");
    return;
  }
  ServerOptions o;
  o.host = "::";
  o.port = 0;
  auto server = TcpStoreServer::start(o);
  CHECK(server->host() == "::");
  const uint16_t port = server->port();
  client("127.0.0.1", port)->set("k", "from v4");
  CHECK(client("::1", port)->get("k") == "from v4");
  // It holds the port for IPv4 too: no store binds 127.0.0.1 there.
  CHECK_THROWS_AS(serve({"127.0.0.1"}, port), IoError);
}
