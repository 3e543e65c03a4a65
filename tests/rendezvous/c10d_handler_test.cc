// C10dHandler on loopback: who hosts the endpoint's store, the workers' store
// of the round, a torchrun rendezvous on the same id, and the endpoint lost
// while a round forms. Threads as nodes; the test thread asserts.

#include "rendezvous/c10d_handler.h"

#include <catch2/catch.hpp>
#include <optional>
#include <thread>

#include "common/error.h"
#include "store/tcp_store.h"
#include "store/tcp_store_server.h"

using namespace ctorchrun;
using namespace std::chrono_literals;

namespace {

std::unique_ptr<store::TcpStoreServer> loopback_server(uint16_t port = 0) {
  store::ServerOptions so;
  so.host = "127.0.0.1";
  so.port = port;
  return store::TcpStoreServer::start(so);
}

// A port that was free a moment ago.
int free_port() { return loopback_server()->port(); }

rendezvous::C10dOptions node_options(int port, int min_nodes, int max_nodes) {
  rendezvous::C10dOptions o;
  o.endpoint_host = "127.0.0.1";
  o.endpoint_port = port;
  o.job.run_id = "job";
  o.job.min_nodes = min_nodes;
  o.job.max_nodes = max_nodes;
  o.job.entrypoint = "train.py";
  o.job.host = "localhost";
  o.join_timeout = 20s;
  o.last_call_timeout = 100ms;
  o.read_timeout = 5s;
  return o;
}

std::unique_ptr<store::TcpStore> client(int port) {
  store::TcpStoreOptions o;
  o.port = static_cast<uint16_t>(port);
  o.timeout = 5s;
  o.connect_timeout = 5s;
  return std::make_unique<store::TcpStore>(o);
}

}  // namespace

TEST_CASE(
    "C10dHandler: of two agents on the endpoint's host exactly one hosts it, group rank 0 "
    "hosts the workers' store",
    "[net]") {
  const int port = free_port();
  rendezvous::C10dHandler a(node_options(port, 2, 2));
  rendezvous::C10dHandler b(node_options(port, 2, 2));
  rendezvous::RendezvousInfo ia, ib;
  std::string error_b;
  std::thread tb([&] {
    try {
      ib = b.next_rendezvous();
    } catch (const std::exception& e) {
      error_b = e.what();
    }
  });
  std::string error_a;
  try {
    ia = a.next_rendezvous();
  } catch (const std::exception& e) {
    error_a = e.what();
  }
  tb.join();
  REQUIRE(error_a.empty());
  REQUIRE(error_b.empty());
  CHECK(a.hosts_endpoint() != b.hosts_endpoint());
  CHECK(ia.group_rank + ib.group_rank == 1);
  CHECK(ia.group_world_size == 2);
  // The members' records are not read with the round: on demand only.
  CHECK(ia.nodes.empty());
  CHECK(ia.world_size == 2);
  CHECK(ia.base_rank + ib.base_rank == 1);
  REQUIRE(ia.read_nodes);
  const auto nodes = ia.read_nodes();
  REQUIRE(nodes.size() == 2);
  CHECK(nodes[0].hosts_endpoint != nodes[1].hosts_endpoint);
  // One workers' store for the round, not the endpoint's, cleared by rank 0.
  CHECK(ia.master_addr == "127.0.0.1");
  CHECK(ia.master_port == ib.master_port);
  CHECK(ia.master_port != port);
  auto& rank0 = ia.group_rank == 0 ? ia : ib;
  auto& rank1 = ia.group_rank == 0 ? ib : ia;
  CHECK(static_cast<bool>(rank0.clear_worker_keys));
  CHECK_FALSE(static_cast<bool>(rank1.clear_worker_keys));
  // The endpoint's host is the store host.
  CHECK(ia.store_host == a.hosts_endpoint());
  CHECK(ib.store_host == b.hosts_endpoint());
  // The agents' keys of the round are reachable through the info's store.
  ia.store->set("probe", "1");
  CHECK(ib.store->get("probe") == "1");
}

TEST_CASE("C10dHandler: with a standalone store at the endpoint group rank 0 is the store host",
          "[net]") {
  auto server = loopback_server();
  auto o = node_options(server->port(), 1, 1);
  o.is_host = false;
  rendezvous::C10dHandler h(o);
  auto info = h.next_rendezvous();
  CHECK_FALSE(h.hosts_endpoint());
  CHECK(info.group_rank == 0);
  CHECK(info.store_host == true);
  CHECK(static_cast<bool>(info.clear_worker_keys));
}

TEST_CASE("C10dHandler: an id that a torchrun agent uses on the endpoint is refused", "[net]") {
  auto server = loopback_server();
  client(server->port())->set("torch.rendezvous.job", "pickled state");
  auto o = node_options(server->port(), 1, 1);
  o.is_host = false;
  rendezvous::C10dHandler h(o);
  try {
    h.next_rendezvous();
    FAIL("joined a torchrun rendezvous");
  } catch (const ConfigError& e) {
    CHECK_THAT(e.what(), Catch::Contains("torchrun's rendezvous for id 'job'"));
  }
}

TEST_CASE("C10dHandler: MIN never reached is a TimeoutError after join_timeout naming the count",
          "[net]") {
  auto server = loopback_server();
  auto o = node_options(server->port(), 2, 3);
  o.is_host = false;
  o.join_timeout = 300ms;
  rendezvous::C10dHandler h(o);
  try {
    h.next_rendezvous();
    FAIL("a round formed with one node of min 2");
  } catch (const TimeoutError& e) {
    CHECK_THAT(e.what(), Catch::Contains("1 of min 2, max 3 nodes joined round 0"));
  }
}

TEST_CASE("C10dHandler: the endpoint's store lost while the round forms ends the rendezvous",
          "[net]") {
  auto server = loopback_server();
  const int port = server->port();
  auto o = node_options(port, 2, 2);
  o.is_host = false;
  rendezvous::C10dHandler h(o);
  std::optional<std::string> error;
  bool io_error = false;
  std::thread t([&] {
    try {
      h.next_rendezvous();
      error = "";
    } catch (const IoError& e) {
      io_error = true;
      error = e.what();
    } catch (const Error& e) {
      error = e.what();
    }
  });
  // Readiness: the node has joined round 0.
  auto c = client(port);
  c->wait({"ctorchrun/job/g0/rdzv/0/node/n1"}, 10s);
  server.reset();
  t.join();
  REQUIRE(error.has_value());
  CHECK_FALSE(io_error);
  CHECK_THAT(*error,
             Catch::Contains("lost the rendezvous store at 127.0.0.1:" + std::to_string(port)));
}

TEST_CASE(
    "C10dHandler: a waiting node waits a whole poll interval when no last call runs, never a "
    "busy loop",
    "[unit]") {
  using std::chrono::milliseconds;
  const auto none = milliseconds::max();
  CHECK(rendezvous::wait_slice(milliseconds(1000), none, milliseconds(600'000)) ==
        milliseconds(1000));
  CHECK(rendezvous::wait_slice(milliseconds(1000), milliseconds(300), milliseconds(600'000)) ==
        milliseconds(301));
  CHECK(rendezvous::wait_slice(milliseconds(1000), milliseconds(0), milliseconds(600'000)) ==
        milliseconds(1));
  CHECK(rendezvous::wait_slice(milliseconds(1000), none, milliseconds(40)) == milliseconds(40));
  CHECK(rendezvous::wait_slice(milliseconds(1000), none, milliseconds(-5)) == milliseconds(1));
}
