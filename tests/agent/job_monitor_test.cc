// JobMonitor against an in-memory store, with intervals of milliseconds and
// a fault-injecting store in between: liveness, the published view, failure
// records, a lost store. No sleeping through real timeouts; one case stops a
// monitor blocked on a real TCP store's wait.

#include "agent/job_monitor.h"

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <functional>
#include <thread>

#include "agent/protocol.h"
#include "store/hash_store.h"
#include "store/tcp_store.h"
#include "store/tcp_store_server.h"
#include "tests/support/fault_store.h"

using namespace ctorchrun;
using namespace std::chrono_literals;
using testing::FaultStore;

namespace {

agent::MonitorOptions options(int node, int nnodes) {
  agent::MonitorOptions o;
  o.node = node;
  o.nnodes = nnodes;
  o.hosts_store = node == 0;
  o.keep_alive_interval = 10ms;
  o.keep_alive_max_attempt = 3;
  o.store_grace = 50ms;
  o.failure_poll = 2ms;
  return o;
}

// Polls `cond` every millisecond for at most 5 s.
bool eventually(const std::function<bool()>& cond) {
  for (int i = 0; i < 5000; ++i) {
    if (cond()) return true;
    std::this_thread::sleep_for(1ms);
  }
  return cond();
}

struct Node {
  Node(std::shared_ptr<store::Store> s, int node, int nnodes)
      : fault(std::make_shared<FaultStore>(std::move(s))) {
    auto f = fault;
    monitor = std::make_unique<agent::JobMonitor>([f] { return f; }, options(node, nnodes),
                                                  [this] { ++notified; });
  }
  std::shared_ptr<FaultStore> fault;
  std::atomic<int> notified{0};
  std::unique_ptr<agent::JobMonitor> monitor;
};

}  // namespace

TEST_CASE("job monitor: the host declares a silent node dead and every node reads it", "[unit]") {
  auto hash = std::make_shared<store::HashStore>();
  Node host(hash, 0, 3);
  auto n1 = std::make_unique<Node>(hash, 1, 3);
  // Node 2 never beats.
  CHECK(eventually([&] { return host.monitor->dead_nodes() == std::vector<int>{2}; }));
  CHECK(eventually([&] { return n1->monitor->dead_nodes() == std::vector<int>{2}; }));
  CHECK(n1->monitor->liveness_known());
  CHECK(host.notified > 0);
  // Node 1 stops beating: dead too.
  n1.reset();
  CHECK(eventually([&] { return host.monitor->dead_nodes() == std::vector<int>{1, 2}; }));
  // A node that says it left is departed, not dead.
  hash->set(agent::keys::gone(2), "1");
  CHECK(eventually([&] {
    return host.monitor->departed_nodes() == std::vector<int>{2} &&
           host.monitor->dead_nodes() == std::vector<int>{1};
  }));
}

TEST_CASE("job monitor: a node other than the host reads one key per interval, whatever N",
          "[unit]") {
  auto hash = std::make_shared<store::HashStore>();
  const int nnodes = 200;
  Node host(hash, 0, nnodes);
  Node n1(hash, 1, nnodes);
  REQUIRE(eventually([&] { return n1.monitor->liveness_known(); }));
  n1.fault->clear_keys_seen();
  std::this_thread::sleep_for(100ms);  // about 10 intervals
  auto seen = n1.fault->keys_seen();
  REQUIRE_FALSE(seen.empty());
  for (const auto& k : seen) {
    INFO(k);
    CHECK((k == agent::keys::alive(1) || k == agent::keys::liveness() ||
           k == agent::keys::failure(0)));
  }
  // Per interval: one beat and one read of the view.
  auto beats = std::count(seen.begin(), seen.end(), agent::keys::alive(1));
  auto liveness_reads = std::count(seen.begin(), seen.end(), agent::keys::liveness());
  CHECK(beats >= 1);
  CHECK(liveness_reads <= 2 * (beats + 2));
}

TEST_CASE("job monitor: a failure record wakes the agent, a malformed one is a protocol error",
          "[unit]") {
  auto hash = std::make_shared<store::HashStore>();
  Node host(hash, 0, 1);
  hash->set(agent::keys::failure(0), R"({"rank":3,"node_rank":0,"exit_code":7})");
  REQUIRE(eventually([&] { return host.monitor->failure(0).has_value(); }));
  CHECK(host.monitor->failure(0)->rank == 3);
  CHECK(host.notified > 0);
  host.monitor->watch_attempt(1);
  hash->set(agent::keys::failure(1), R"({"rank":"x"})");
  REQUIRE(eventually([&] { return host.monitor->protocol_error().has_value(); }));
  CHECK(host.monitor->protocol_error()->find("attempt/1/failure") != std::string::npos);
  CHECK(host.monitor->protocol_error()->find("'rank'") != std::string::npos);
  CHECK_FALSE(host.monitor->store_lost());
}

TEST_CASE(
    "job monitor: a view or failure record tidied away between two of its calls never leaves it "
    "waiting for the key",
    "[unit]") {
  // The last node of an etcd job deletes the job's keys as it leaves; the
  // others' monitors run until their agents exit. A read that waits for a key
  // that went would hold the agent's exit for the store's timeout (minutes).
  auto hash = std::make_shared<store::HashStore>();
  Node n1(hash, 1, 2);
  n1.fault->refuse_waiting_reads(true);
  // The view: published, then tidied away after each call that names it.
  n1.fault->vanish_after(FaultStore::Op::kCheck, agent::keys::liveness(), 5);
  n1.fault->vanish_after(FaultStore::Op::kCompareSet, agent::keys::liveness(), 5);
  for (int i = 0; i < 5; ++i) {
    hash->set(agent::keys::liveness(), R"({"seq":1,"dead":[],"gone":[]})");
    REQUIRE(eventually([&] { return !hash->check({agent::keys::liveness()}); }));
  }
  // The failure record: gone after the wait that saw it, before it is read.
  n1.fault->vanish_after(FaultStore::Op::kWait, agent::keys::failure(0), 1);
  hash->set(agent::keys::failure(0), R"({"rank":3,"node_rank":0,"exit_code":7})");
  REQUIRE(eventually([&] { return !hash->check({agent::keys::failure(0)}); }));
  // Read whole when it stays.
  hash->set(agent::keys::failure(0), R"({"rank":4,"node_rank":0,"exit_code":7})");
  REQUIRE(eventually([&] { return n1.monitor->failure(0).has_value(); }));
  CHECK(n1.monitor->failure(0)->rank == 4);
  auto refused = n1.fault->refused_reads();
  std::string list;
  for (const auto& k : refused) list += k + " ";
  INFO("waiting reads of missing keys: " << list);
  CHECK(refused.empty());
  CHECK_FALSE(n1.monitor->store_lost());
  CHECK_FALSE(n1.monitor->protocol_error());
}

TEST_CASE("job monitor: a single-node job alone opens no connection and runs no thread", "[unit]") {
  auto hash = std::make_shared<store::HashStore>();
  hash->set(agent::keys::failure(0), R"({"rank":3,"node_rank":0,"exit_code":7})");
  std::atomic<int> connects{0};
  auto o = options(0, 1);
  o.alone = true;
  std::atomic<int> notified{0};
  {
    agent::JobMonitor monitor(
        [&] {
          ++connects;
          return std::static_pointer_cast<store::Store>(hash);
        },
        o, [&] { ++notified; });
    monitor.watch_attempt(0);
    std::this_thread::sleep_for(30ms);  // three keep-alive intervals
    CHECK_FALSE(monitor.failure(0).has_value());
    CHECK_FALSE(monitor.store_lost());
    CHECK(monitor.dead_nodes().empty());
    CHECK(monitor.departed_nodes().empty());
  }
  CHECK(connects == 0);
  CHECK(notified == 0);
  CHECK_FALSE(hash->check({agent::keys::alive(0)}));  // no heartbeat either
}

TEST_CASE("job monitor: a malformed liveness view is a protocol error naming the key", "[unit]") {
  auto hash = std::make_shared<store::HashStore>();
  hash->set(agent::keys::liveness(), R"({"seq":1,"dead":"all","gone":[]})");
  Node n1(hash, 1, 2);
  REQUIRE(eventually([&] { return n1.monitor->protocol_error().has_value(); }));
  CHECK(n1.monitor->protocol_error()->find("'liveness'") != std::string::npos);
}

TEST_CASE(
    "job monitor: a liveness view naming a node outside the job is a protocol error, never an "
    "index used as it came",
    "[unit]") {
  for (const char* view :
       {R"({"seq":1,"dead":[2],"gone":[]})", R"({"seq":1,"dead":[],"gone":[-1]})",
        R"({"seq":1,"dead":[4294967296],"gone":[]})"}) {
    INFO(view);
    auto hash = std::make_shared<store::HashStore>();
    hash->set(agent::keys::liveness(), view);
    Node n1(hash, 1, 2);
    REQUIRE(eventually([&] { return n1.monitor->protocol_error().has_value(); }));
    CHECK(n1.monitor->protocol_error()->find("of a job of 2") != std::string::npos);
    CHECK(n1.monitor->dead_nodes().empty());
    CHECK(n1.monitor->departed_nodes().empty());
  }
}

TEST_CASE("job monitor: failing store calls mean a lost store only after the grace period",
          "[unit]") {
  auto hash = std::make_shared<store::HashStore>();
  Node host(hash, 0, 1);
  // A few failed calls are ridden out.
  host.fault->fail(FaultStore::Op::kAdd, 2);
  std::this_thread::sleep_for(30ms);
  CHECK_FALSE(host.monitor->store_lost());
  // Every call failing for longer than store_grace: lost, and the agent is woken.
  host.fault->fail_all(true);
  REQUIRE(eventually([&] { return host.monitor->store_lost(); }));
  CHECK(host.monitor->store_error().find("injected failure") != std::string::npos);
  CHECK(host.notified > 0);
  CHECK_FALSE(host.monitor->protocol_error());
}

TEST_CASE("job monitor: the view goes stale when the host stops publishing", "[unit]") {
  auto hash = std::make_shared<store::HashStore>();
  auto host = std::make_unique<Node>(hash, 0, 2);
  Node n1(hash, 1, 2);
  REQUIRE(eventually([&] { return n1.monitor->liveness_known(); }));
  host.reset();
  CHECK(eventually([&] { return !n1.monitor->liveness_known(); }));
}

TEST_CASE(
    "job monitor: stopping it interrupts the store wait its thread is blocked in instead of "
    "waiting out the slice",
    "[multiproc]") {
  // Every job's exit destroys the monitor: its thread waits on the failure
  // key in slices (failure_poll), and the exit must not wait one out.
  store::ServerOptions so;
  so.host = "127.0.0.1";
  so.port = 0;
  auto server = store::TcpStoreServer::start(so);
  store::TcpStoreOptions co;
  co.host = "127.0.0.1";
  co.port = server->port();
  auto o = options(1, 2);
  o.keep_alive_interval = 60s;
  o.failure_poll = 60s;  // one wait would outlast the test's bound
  std::atomic<int> connects{0};
  auto monitor = std::make_unique<agent::JobMonitor>(
      [&] {
        ++connects;
        return std::make_shared<store::TcpStore>(co);
      },
      o, [] {});
  // The thread beats, looks for the liveness view, then waits on the failure key.
  REQUIRE(eventually([&] { return store::TcpStore(co).check({agent::keys::alive(1)}); }));
  std::this_thread::sleep_for(100ms);
  const auto t0 = std::chrono::steady_clock::now();
  monitor.reset();
  CHECK(std::chrono::steady_clock::now() - t0 < 30s);
  CHECK(connects == 1);
}
