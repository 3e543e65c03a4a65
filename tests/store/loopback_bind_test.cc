// A store for an endpoint that people spell several ways: the loopback as
// 127.0.0.1, localhost or [::1] is one store on both address families
// (rendezvous/endpoint.h's bind_addresses_for, ServerOptions::also_hosts),
// bound all or nothing, and the IPv6 wildcard serves IPv4 clients too.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <memory>
#include <string>
#include <vector>

#include "common/error.h"
#include "rendezvous/endpoint.h"
#include "store/tcp_store.h"
#include "store/tcp_store_server.h"

using namespace ctorchrun;
using namespace ctorchrun::store;
using namespace std::chrono_literals;

namespace {

// The socket address of the numeric `host` at `port`; family 0 when `host` is
// not a numeric address.
struct SocketAddress {
  sockaddr_storage ss{};
  socklen_t len = 0;
  int family = 0;
  const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&ss); }
};

SocketAddress address_of(const std::string& host, uint16_t port) {
  SocketAddress a;
  auto* a4 = reinterpret_cast<sockaddr_in*>(&a.ss);
  auto* a6 = reinterpret_cast<sockaddr_in6*>(&a.ss);
  if (inet_pton(AF_INET, host.c_str(), &a4->sin_addr) == 1) {
    a.family = a4->sin_family = AF_INET;
    a4->sin_port = htons(port);
    a.len = sizeof *a4;
  } else if (inet_pton(AF_INET6, host.c_str(), &a6->sin6_addr) == 1) {
    a.family = a6->sin6_family = AF_INET6;
    a6->sin6_port = htons(port);
    a.len = sizeof *a6;
  }
  return a;
}

// A socket bound to the numeric `host` at `port` (0: any), or -1.
int bound_socket(const std::string& host, uint16_t port, bool listen = false) {
  const SocketAddress a = address_of(host, port);
  if (a.family == 0) return -1;
  int fd = ::socket(a.family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (::bind(fd, a.get(), a.len) != 0 || (listen && ::listen(fd, 4) != 0)) {
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
  const SocketAddress a = address_of(host, port);
  REQUIRE(a.family != 0);
  int fd = ::socket(a.family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  const bool ok = ::connect(fd, a.get(), a.len) == 0;
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

// The store a rendezvous endpoint spelled `spelling` gets on this host.
std::unique_ptr<TcpStoreServer> serve_endpoint(const std::string& spelling, uint16_t port) {
  return serve(rendezvous::bind_addresses_for(spelling), port);
}

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

const std::vector<std::string> kLoopbackSpellings = {"127.0.0.1", "localhost", "::1"};

}  // namespace

TEST_CASE(
    "bind_addresses_for: the loopback spelled any way binds 127.0.0.1, then ::1 where present",
    "[unit]") {
  const std::vector<std::string> both = has_v6_loopback()
                                            ? std::vector<std::string>{"127.0.0.1", "::1"}
                                            : std::vector<std::string>{"127.0.0.1"};
  CHECK(rendezvous::bind_addresses_for("127.0.0.1") == both);
  CHECK(rendezvous::bind_addresses_for("localhost") == both);
  if (has_v6_loopback()) CHECK(rendezvous::bind_addresses_for("::1") == both);
  // Another 127.x literal is an address of its own.
  CHECK(rendezvous::bind_addresses_for("127.0.1.1") == std::vector<std::string>{"127.0.1.1"});
  CHECK_THROWS_AS(rendezvous::bind_addresses_for("192.0.2.1"), IoError);  // TEST-NET-1
  CHECK_THROWS_AS(rendezvous::bind_addresses_for("no-such-host.invalid"), IoError);
}

TEST_CASE("bind_addresses_for: a wildcard is the dual-stack :: where this host has IPv6",
          "[unit]") {
  // A wildcard is what any local address that is not a loopback literal or
  // "localhost" gets; "::" and "0.0.0.0" themselves are such addresses.
  const bool v6 = has_v6_loopback();
  CHECK(rendezvous::bind_addresses_for("0.0.0.0") ==
        std::vector<std::string>{v6 ? "::" : "0.0.0.0"});
  if (v6) CHECK(rendezvous::bind_addresses_for("::") == std::vector<std::string>{"::"});
}

TEST_CASE("TcpStoreServer: a loopback endpoint's store serves 127.0.0.1 and ::1, one key space",
          "[net]") {
  if (!has_v6_loopback()) {
    WARN("this host has no ::1: nothing to share between families");
    return;
  }
  for (const auto& spelling : kLoopbackSpellings) {
    INFO("endpoint spelled " << spelling);
    auto server = serve_endpoint(spelling, 0);
    CHECK(server->hosts() == std::vector<std::string>{"127.0.0.1", "::1"});
    CHECK(server->host() == "127.0.0.1");
    const uint16_t port = server->port();
    REQUIRE(port != 0);
    auto v4 = client("127.0.0.1", port);
    auto v6 = client("::1", port);
    v4->set("spelling", spelling);
    CHECK(v6->get("spelling") == spelling);
    CHECK(v6->add("count", 1) == 1);
    CHECK(v4->add("count", 1) == 2);
    CHECK(server->stats().keys == 2);
  }
}

TEST_CASE("TcpStoreServer: no spelling of the loopback binds a second store on a port in use",
          "[net]") {
  if (!has_v6_loopback()) {
    WARN("this host has no ::1");
    return;
  }
  for (const auto& first : kLoopbackSpellings) {
    for (const auto& second : kLoopbackSpellings) {
      INFO("first " << first << ", then " << second);
      auto server = serve_endpoint(first, 0);
      const uint16_t port = server->port();
      try {
        serve_endpoint(second, port);
        FAIL("a second store bound port " << port);
      } catch (const IoError& e) {
        // The first address decides: the loser never held ::1.
        CHECK(contains(e.what(), "127.0.0.1:" + std::to_string(port)));
      }
      // The first store still serves both families.
      auto v6 = client("::1", port);
      v6->set("k", "v");
      CHECK(client("127.0.0.1", port)->get("k") == "v");
    }
  }
}

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
