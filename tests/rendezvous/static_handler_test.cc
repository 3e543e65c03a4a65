// StaticHandler against a store server on loopback: who is admitted to a job,
// where node 0 binds, and what a waiting node says. Timeouts in milliseconds.

#include "rendezvous/static_handler.h"

#include <spdlog/sinks/ostream_sink.h>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/error.h"
#include "common/log.h"
#include "rendezvous/endpoint.h"
#include "store/prefix_store.h"
#include "store/tcp_store.h"
#include "store/tcp_store_server.h"

using namespace ctorchrun;
using namespace std::chrono_literals;

namespace {

// A store with what node 0 of job `run_id` publishes before nodes join.
struct JobStore {
  JobStore(const std::string& run_id, int nnodes, int max_restarts) {
    store::ServerOptions so;
    so.host = "127.0.0.1";
    so.port = 0;
    server = store::TcpStoreServer::start(so);
    store::TcpStoreOptions o;
    o.port = static_cast<uint16_t>(server->port());
    o.timeout = 2s;
    o.connect_timeout = 2s;
    client = std::make_shared<store::TcpStore>(o);
    nlohmann::json j = {{"run_id", run_id}, {"nnodes", nnodes}, {"max_restarts", max_restarts}};
    client->set("ctorchrun/job", j.dump());
  }
  rendezvous::StaticOptions node(int rank, int nnodes, int max_restarts = 0) const {
    rendezvous::StaticOptions o;
    o.master_port = server->port();
    o.job.min_nodes = o.job.max_nodes = nnodes;
    o.node_rank = rank;
    o.job.max_restarts = max_restarts;
    o.timeout = 300ms;
    o.job.host = "node" + std::to_string(rank);
    return o;
  }
  std::unique_ptr<store::TcpStoreServer> server;
  std::shared_ptr<store::TcpStore> client;
};

template <typename E>
std::string error_of(rendezvous::StaticOptions o) {
  rendezvous::StaticHandler h(std::move(o));
  try {
    h.next_rendezvous();
  } catch (const E& e) {
    return e.what();
  }
  return "no exception";
}

}  // namespace

TEST_CASE("static rendezvous: a store serving another run id is refused, nothing written",
          "[net]") {
  JobStore s("jobA", 2, 0);
  auto o = s.node(1, 2);
  o.job.run_id = "jobB";
  auto keys_before = s.client->num_keys();
  auto msg = error_of<RendezvousClosedError>(o);
  CHECK(msg.find("serves job 'jobA'") != std::string::npos);
  CHECK(s.client->num_keys() == keys_before);
}

TEST_CASE("static rendezvous: a job that has formed is refused before its settings are compared",
          "[net]") {
  JobStore s("none", 2, 0);
  s.client->set("ctorchrun/formed", "1");
  auto keys_before = s.client->num_keys();
  auto msg = error_of<RendezvousClosedError>(s.node(1, 3));  // nnodes differ too
  CHECK(msg.find("already formed") != std::string::npos);
  CHECK(s.client->num_keys() == keys_before);
}

TEST_CASE("static rendezvous: different --nnodes or --max_restarts is a config error naming both",
          "[net]") {
  JobStore s("none", 2, 1);
  auto msg = error_of<ConfigError>(s.node(1, 3, 1));
  CHECK(msg.find("--nnodes: node 0 has 2, node 1 (node1) has 3") != std::string::npos);
  // The refusal is left in the job so that node 0 stops too.
  CHECK(s.client->get("ctorchrun/none/refused") == msg);

  JobStore t("none", 2, 1);
  msg = error_of<ConfigError>(t.node(1, 2, 4));
  CHECK(msg.find("--max_restarts: node 0 has 1, node 1 (node1) has 4") != std::string::npos);
}

TEST_CASE("static rendezvous: a node rank already taken is a config error", "[net]") {
  JobStore s("none", 2, 0);
  s.client->set("ctorchrun/none/nodes/1",
                R"({"host":"other","pid":7,"local_world_size":1,"max_restarts":0})");
  auto msg = error_of<ConfigError>(s.node(1, 2));
  CHECK(msg.find("node rank 1 is already taken") != std::string::npos);
  CHECK(msg.find("other pid 7") != std::string::npos);
}

TEST_CASE("static rendezvous: a refusal left by another node ends the wait with a config error",
          "[net]") {
  JobStore s("none", 3, 0);
  s.client->set("ctorchrun/none/refused", "nodes disagree on --nnodes: node 0 has 3, node 2 has 2");
  auto o = s.node(1, 3);
  o.timeout = 5s;
  auto msg = error_of<ConfigError>(o);
  CHECK(msg == "nodes disagree on --nnodes: node 0 has 3, node 2 has 2");
}

TEST_CASE("static rendezvous: a node waiting for node 0 says so every interval, then times out",
          "[net]") {
  std::ostringstream lines;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(lines);
  auto log = get_logger("rdzv");
  log->sinks().push_back(sink);
  rendezvous::StaticOptions o;
  o.master_addr = "no-such-host.invalid";
  o.master_port = 29400;
  o.job.min_nodes = o.job.max_nodes = 2;
  o.node_rank = 1;
  o.timeout = 400ms;
  o.wait_log_interval = 100ms;
  auto msg = error_of<TimeoutError>(o);
  log->sinks().pop_back();
  CHECK(msg.find("no-such-host.invalid:29400") != std::string::npos);
  std::string text = lines.str();
  INFO(text);
  size_t n = 0;
  for (size_t at = 0; (at = text.find("waiting for node 0's store", at)) != std::string::npos;
       ++at) {
    ++n;
  }
  CHECK(n >= 2);
}

TEST_CASE("static rendezvous: node 0 binds where it is reachable at master_addr", "[unit]") {
  CHECK(rendezvous::strip_brackets("[::1]") == "::1");
  CHECK(rendezvous::strip_brackets("::1") == "::1");
  CHECK(rendezvous::strip_brackets("10.0.0.1") == "10.0.0.1");
  CHECK(rendezvous::bind_address_for("127.0.0.1") == "127.0.0.1");
  CHECK(rendezvous::bind_address_for("127.0.1.1") == "127.0.1.1");
  CHECK(rendezvous::bind_address_for("::1") == "::1");
  std::string localhost = rendezvous::bind_address_for("localhost");
  CHECK((localhost.rfind("127.", 0) == 0 || localhost == "::1"));
  CHECK_THROWS_AS(rendezvous::bind_address_for("192.0.2.1"), IoError);  // TEST-NET-1
  CHECK_THROWS_AS(rendezvous::bind_address_for("no-such-host.invalid"), IoError);
}

TEST_CASE("endpoint: one parser for every spelling of HOST[:PORT], bad ones refused by name",
          "[unit]") {
  auto e = rendezvous::parse_endpoint("node1:29401", 29400);
  CHECK(e.host == "node1");
  CHECK(e.port == 29401);
  e = rendezvous::parse_endpoint("node1", 29400);
  CHECK(e.host == "node1");
  CHECK(e.port == 29400);
  e = rendezvous::parse_endpoint("[::1]:23", 29400);
  CHECK(e.host == "::1");
  CHECK(e.port == 23);
  e = rendezvous::parse_endpoint("[fe80::1]", 2379);
  CHECK(e.host == "fe80::1");
  CHECK(e.port == 2379);
  CHECK(rendezvous::format_endpoint("::1", 23) == "[::1]:23");
  for (const char* bad : {"", ":29400", "[::1", "[::1]x", "[]:1", "h:", "h:0", "h:65536", "h:-1",
                          "h:12a", "h:123456"}) {
    INFO(bad);
    try {
      rendezvous::parse_endpoint(bad, 1);
      FAIL("accepted");
    } catch (const ConfigError& err) {
      CHECK(std::string(err.what()).find(std::string("'") + bad + "'") != std::string::npos);
    }
  }
}
