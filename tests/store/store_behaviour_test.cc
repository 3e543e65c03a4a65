// The behaviour suite against every Store implementation: in-memory, prefixed,
// our client against our server in each dialect, and our client against
// torch 1.13's own TCPStore server.

#include <catch2/catch.hpp>

#include "common/error.h"
#include "store/hash_store.h"
#include "store/prefix_store.h"
#include "store/tcp_store.h"
#include "store/tcp_store_server.h"
#include "tests/store/local_server.h"
#include "tests/store/store_suite.h"
#include "tests/support/process.h"
#include "tests/support/test_python.h"

using namespace ctorchrun;
using namespace ctorchrun::store;
using ctorchrun::testing::local_server;
using namespace std::chrono_literals;

namespace {

testing::StoreFactory tcp_clients(uint16_t port, ClientDialect dialect) {
  return [port, dialect] {
    TcpStoreOptions o;
    o.port = port;
    o.dialect = dialect;
    o.timeout = 5s;
    o.connect_timeout = 5s;
    return std::make_shared<TcpStore>(o);
  };
}

}  // namespace

TEST_CASE("HashStore: passes the store behaviour suite", "[unit]") {
  auto hs = std::make_shared<HashStore>();
  testing::run_store_suite([hs] { return hs; });
}

TEST_CASE("PrefixStore over HashStore: passes the suite and joins keys as torch does", "[unit]") {
  auto hs = std::make_shared<HashStore>();
  testing::run_store_suite([hs] { return std::make_shared<PrefixStore>("job", hs); });
  PrefixStore ps("a/", hs);
  ps.set("k", "v");
  CHECK(hs->check({"a//k"}));
  PrefixStore nested("inner", std::make_shared<PrefixStore>("/worker/attempt_0", hs));
  nested.set("x", "1");
  CHECK(hs->check({"/worker/attempt_0/inner/x"}));
}

TEST_CASE("TcpStore v2 against our server: passes the suite", "[net]") {
  auto server = local_server();
  testing::run_store_suite(tcp_clients(server->port(), ClientDialect::kV2));
}

TEST_CASE("TcpStore v113 against our server: passes the suite", "[net]") {
  auto server = local_server();
  testing::run_store_suite(tcp_clients(server->port(), ClientDialect::kV113));
}

TEST_CASE("TcpStore auto against our server: detects v2 and passes the suite", "[net]") {
  auto server = local_server();
  auto make = tcp_clients(server->port(), ClientDialect::kAuto);
  auto c = std::dynamic_pointer_cast<TcpStore>(make());
  CHECK(c->dialect() == protocol::Dialect::kV2);
  testing::run_store_suite(make);
}

TEST_CASE("TcpStore: v113 and v2 clients share one key space on our server", "[net]") {
  auto server = local_server();
  auto v113 = tcp_clients(server->port(), ClientDialect::kV113)();
  auto v2 = tcp_clients(server->port(), ClientDialect::kV2)();
  v113->set("shared", "from-113");
  CHECK(v2->get("shared") == "from-113");
  CHECK(v2->add("ctr", 2) == 2);
  CHECK(v113->add("ctr", 3) == 5);
  auto keys = std::dynamic_pointer_cast<TcpStore>(v2)->list_keys();
  CHECK(std::find(keys.begin(), keys.end(), "shared") != keys.end());
}

TEST_CASE("TcpStore: connecting to a closed port times out naming host and port", "[net]") {
  uint16_t port = 0;
  {
    auto server = local_server();
    port = server->port();
  }
  TcpStoreOptions o;
  o.port = port;
  o.connect_timeout = 300ms;
  try {
    TcpStore c(o);
    FAIL("connected to a closed port");
  } catch (const TimeoutError& e) {
    std::string msg = e.what();
    CHECK(msg.find("127.0.0.1:" + std::to_string(port)) != std::string::npos);
  }
}

TEST_CASE("TcpStore auto against torch's own server: detects its dialect and passes the suite",
          "[torch]") {
  testing::Process server({testing::test_python(),
                           CTORCHRUN_SOURCE_DIR "/tests/torch/torch_store_server.py", "--port", "0",
                           "--duration", "120"});
  int port = testing::wait_for_listening_port(server, 60s);
  REQUIRE(port > 0);
  auto make = tcp_clients(static_cast<uint16_t>(port), ClientDialect::kAuto);
  auto c = std::dynamic_pointer_cast<TcpStore>(make());
  // torch 1.13 (and 2.0) speak v113; 2.1 and later v2.
  CHECK(c->dialect() == (testing::test_torch_version() >= std::pair{2, 1}
                             ? protocol::Dialect::kV2
                             : protocol::Dialect::kV113));
  testing::run_store_suite(make);
  // The probe must not have stored anything on the server.
  auto keys_before = c->num_keys();
  auto probe = make();
  CHECK(c->num_keys() == keys_before);
}
