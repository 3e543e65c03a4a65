// HostProbe against a real TCP store server on loopback.

#include "rendezvous/host_probe.h"

#include <catch2/catch.hpp>
#include <chrono>
#include <thread>

#include "store/tcp_store_server.h"

using namespace ctorchrun;
using namespace std::chrono_literals;
using rendezvous::HostProbe;

namespace {

bool gone_within(HostProbe& p, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  for (;;) {
    if (p.gone()) return true;
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(5ms);
  }
}

std::unique_ptr<store::TcpStoreServer> server() {
  store::ServerOptions so;
  so.host = "127.0.0.1";
  so.port = 0;
  return store::TcpStoreServer::start(so);
}

}  // namespace

TEST_CASE("HostProbe: a live server is not gone, and its closing is seen at once", "[net]") {
  auto s = server();
  const auto port = s->port();
  HostProbe p("127.0.0.1", port, 1s);
  for (int i = 0; i < 10; ++i) CHECK_FALSE(p.gone());
  s.reset();  // as when its process dies: the kernel closes the connection
  CHECK(gone_within(p, 5s));
  CHECK_THAT(p.why(), Catch::Contains("nothing listens any more"));
  CHECK(p.gone());  // stays gone
}

TEST_CASE("HostProbe: nothing listening is gone, while a name or no answer proves nothing",
          "[net]") {
  auto s = server();
  const auto port = s->port();
  s.reset();
  HostProbe refused("127.0.0.1", port, 1s);
  CHECK(refused.gone());
  CHECK(refused.why() == "connection refused");
  // Host names are not looked up (a lookup could block the monitor).
  HostProbe named("localhost", port, 1s);
  CHECK_FALSE(named.gone());
}

TEST_CASE(
    "HostProbe: a server that closes the probe's connection at its connection limit, while it "
    "still listens, is not gone",
    "[net]") {
  store::ServerOptions so;
  so.host = "127.0.0.1";
  so.port = 0;
  so.max_connections = 1;
  auto s = store::TcpStoreServer::start(so);
  const auto port = s->port();
  // A worker's connection takes the only place.
  HostProbe holder("127.0.0.1", port, 1s);
  REQUIRE_FALSE(holder.gone());
  std::this_thread::sleep_for(50ms);
  HostProbe p("127.0.0.1", port, 1s);
  for (int i = 0; i < 20; ++i) {
    CHECK_FALSE(p.gone());
    std::this_thread::sleep_for(10ms);
  }
  s.reset();
  CHECK(gone_within(p, 5s));
}
