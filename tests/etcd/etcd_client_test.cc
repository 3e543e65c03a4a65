// Contract tests of EtcdClient against real etcd processes ([multiproc]) and
// against local sockets that misbehave ([net]).

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "etcd/client.h"
#include "etcd/lease_keeper.h"
#include "tests/etcd/scripted_server.h"
#include "tests/support/etcd_server.h"

namespace ctorchrun::etcd {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::EtcdCluster;
using testing::ScriptedServer;

// Reads the next `n` events, each within `timeout`; fewer if they stop coming.
std::vector<WatchEvent> take(Watch& w, std::size_t n, std::chrono::milliseconds timeout = 5s) {
  std::vector<WatchEvent> out;
  while (out.size() < n) {
    auto e = w.next(timeout);
    if (!e) break;
    out.push_back(std::move(*e));
  }
  return out;
}

std::string dead_endpoint() {
  return "127.0.0.1:" + std::to_string(testing::free_loopback_ports(1)[0]);
}

TEST_CASE("EtcdClient: put, get and prefix range see the same keys and revisions", "[multiproc]") {
  EtcdCluster cluster(1);
  EtcdClient c(cluster.client_endpoints(), 3s);
  CHECK_FALSE(c.get("/t/a"));
  const auto r1 = c.put("/t/a", "1");
  const auto r2 = c.put("/t/b", std::string("\0\xff bin", 6));
  c.put("/t/c/d", "");
  c.put("/u/a", "other");
  CHECK(r2 > r1);

  const auto a = c.get("/t/a");
  REQUIRE(a);
  CHECK(a->value == "1");
  CHECK(a->mod_revision == r1);
  CHECK(a->create_revision == r1);
  CHECK(a->version == 1);
  CHECK(c.get("/t/b")->value == std::string("\0\xff bin", 6));

  const RangeResult r = c.range_prefix("/t/");
  REQUIRE(r.kvs.size() == 3);
  CHECK(r.kvs[0].key == "/t/a");
  CHECK(r.kvs[1].key == "/t/b");
  CHECK(r.kvs[2].key == "/t/c/d");
  CHECK(r.kvs[2].value.empty());
  CHECK(r.revision >= r2);
  CHECK(c.range_prefix("").kvs.size() >= 4);

  CHECK(c.delete_key("/t/a"));
  CHECK_FALSE(c.delete_key("/t/a"));
  CHECK(c.delete_prefix("/t/") == 2);
  CHECK(c.range_prefix("/t/").kvs.empty());
  CHECK(c.get("/u/a")->value == "other");
}

TEST_CASE("EtcdClient: compare_set succeeds on a match and otherwise returns the current value",
          "[multiproc]") {
  EtcdCluster cluster(1);
  EtcdClient c(cluster.client_endpoints(), 3s);

  // Create only if absent.
  auto r = c.compare_set("/cas/k", std::nullopt, "v1");
  CHECK(r.succeeded);
  CHECK_FALSE(r.has_current);
  const auto created = c.get("/cas/k");
  REQUIRE(created);
  CHECK(created->mod_revision == r.revision);

  r = c.compare_set("/cas/k", std::nullopt, "v2");
  CHECK_FALSE(r.succeeded);
  REQUIRE(r.has_current);
  REQUIRE(r.current);
  CHECK(r.current->value == "v1");
  CHECK(r.current->mod_revision == created->mod_revision);

  r = c.compare_set("/cas/k", std::string("wrong"), "v2");
  CHECK_FALSE(r.succeeded);
  REQUIRE(r.current);
  CHECK(r.current->value == "v1");

  r = c.compare_set("/cas/k", std::string("v1"), "v2");
  CHECK(r.succeeded);
  CHECK(c.get("/cas/k")->value == "v2");

  // By revision: a stale revision fails and shows the newer state.
  r = c.compare_set_revision("/cas/k", created->mod_revision, "v3");
  CHECK_FALSE(r.succeeded);
  REQUIRE(r.current);
  CHECK(r.current->value == "v2");
  r = c.compare_set_revision("/cas/k", r.current->mod_revision, "v3");
  CHECK(r.succeeded);
  CHECK(c.get("/cas/k")->value == "v3");

  // Expected value on an absent key fails; current says absent.
  r = c.compare_set("/cas/none", std::string("x"), "y");
  CHECK_FALSE(r.succeeded);
  CHECK(r.has_current);
  CHECK_FALSE(r.current);
  CHECK(c.compare_set_revision("/cas/none", 0, "y").succeeded);
}

TEST_CASE("EtcdClient: add from several threads gives every caller a distinct result",
          "[multiproc]") {
  EtcdCluster cluster(1);
  EtcdClient c(cluster.client_endpoints(), 5s);
  constexpr int kThreads = 4;
  constexpr int kAdds = 25;
  std::mutex mu;
  std::vector<std::int64_t> results;
  std::vector<std::string> errors;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      try {
        for (int i = 0; i < kAdds; ++i) {
          const auto v = c.add("/counter", 1, 1000);
          std::lock_guard<std::mutex> lock(mu);
          results.push_back(v);
        }
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu);
        errors.push_back(e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  REQUIRE(errors.empty());
  std::sort(results.begin(), results.end());
  std::vector<std::int64_t> expected(kThreads * kAdds);
  for (std::size_t i = 0; i < expected.size(); ++i) expected[i] = static_cast<std::int64_t>(i) + 1;
  CHECK(results == expected);
  CHECK(c.get("/counter")->value == std::to_string(kThreads * kAdds));
  CHECK(c.add("/counter", -100) == 0);

  c.put("/not-a-number", "abc");
  CHECK_THROWS_AS(c.add("/not-a-number", 1), ProtocolError);
}

TEST_CASE("EtcdClient: a lease keeps its key while kept alive and the key vanishes on expiry",
          "[multiproc]") {
  EtcdCluster cluster(1);
  EtcdClient c(cluster.client_endpoints(), 3s);
  const Lease lease = c.lease_grant(2s);
  CHECK(lease.id > 0);
  CHECK(lease.ttl_s >= 1);
  c.put("/lease/k", "v", lease.id);
  CHECK(c.get("/lease/k")->lease == lease.id);
  CHECK(c.lease_keepalive(lease.id) == lease.ttl_s);
  const auto rev = c.get("/lease/k")->mod_revision;

  {
    // Kept alive for well over a TTL, the key stays.
    LeaseKeeper keeper(c, lease, 300ms);
    auto w = c.watch("/lease/k", rev + 1);
    CHECK_FALSE(w->next(std::chrono::seconds(lease.ttl_s) + 1s));
    CHECK_FALSE(keeper.lost());
  }
  // Left alone, it expires: the watch sees the delete within TTL plus slack.
  auto w = c.watch("/lease/k", rev + 1);
  const auto e = w->next(std::chrono::seconds(lease.ttl_s) + 3s);
  REQUIRE(e);
  CHECK(e->type == WatchEvent::Type::kDelete);
  CHECK(e->kv.key == "/lease/k");
  CHECK_FALSE(c.get("/lease/k"));
  CHECK(c.lease_keepalive(lease.id) == 0);
  CHECK_FALSE(c.lease_revoke(lease.id));
  CHECK_THROWS_AS(c.put("/lease/k", "v", lease.id), EtcdError);
}

TEST_CASE("EtcdClient: revoking a lease deletes its keys and a keeper reports the lease lost",
          "[multiproc]") {
  EtcdCluster cluster(1);
  EtcdClient c(cluster.client_endpoints(), 3s);
  const Lease lease = c.lease_grant(10s);
  c.put("/rv/a", "1", lease.id);
  c.put("/rv/b", "2", lease.id);
  LeaseKeeper keeper(c, lease, 100ms);
  CHECK(c.lease_revoke(lease.id));
  CHECK(c.range_prefix("/rv/").kvs.empty());
  const auto deadline = Clock::now() + 5s;
  while (!keeper.lost() && Clock::now() < deadline) std::this_thread::sleep_for(20ms);
  CHECK(keeper.lost());
  CHECK(keeper.lost_reason().find("expired or was revoked") != std::string::npos);
  CHECK_THROWS_AS(LeaseKeeper(c, lease, 10s), ConfigError);
}

TEST_CASE("LeaseKeeper: with every member gone, the lease is reported lost after its TTL",
          "[multiproc]") {
  EtcdCluster cluster(1);
  EtcdClient c(cluster.client_endpoints(), 300ms);
  const Lease lease = c.lease_grant(2s);
  LeaseKeeper keeper(c, lease, 200ms);
  cluster.stop(0);
  const auto deadline = Clock::now() + std::chrono::seconds(lease.ttl_s) + 5s;
  while (!keeper.lost() && Clock::now() < deadline) std::this_thread::sleep_for(20ms);
  REQUIRE(keeper.lost());
  CHECK(keeper.lost_reason().find("no keepalive succeeded") != std::string::npos);
  CHECK(keeper.lost_reason().find(cluster.client_endpoint(0)) != std::string::npos);
}

TEST_CASE("EtcdClient: a watch delivers puts and deletes in order, from a past revision too",
          "[multiproc]") {
  EtcdCluster cluster(1);
  EtcdClient c(cluster.client_endpoints(), 3s);
  const auto r0 = c.put("/w/a", "1");
  c.put("/other", "x");
  c.put("/w/b", "2");

  // From the past: the history is replayed.
  auto past = c.watch("/w/", r0, true);
  // From now: only what follows.
  auto now = c.watch("/w/", 0, true);
  auto single = c.watch("/w/a", 0);
  c.put("/w/a", "3");
  c.delete_key("/w/b");
  const auto last = c.put("/w/c", "4");

  const auto p = take(*past, 5);
  REQUIRE(p.size() == 5);
  CHECK(p[0].kv.key == "/w/a");
  CHECK(p[0].kv.mod_revision == r0);
  CHECK(p[1].kv.key == "/w/b");
  CHECK(p[2].kv.value == "3");
  CHECK(p[2].kv.version == 2);
  CHECK(p[3].type == WatchEvent::Type::kDelete);
  CHECK(p[3].kv.key == "/w/b");
  CHECK(p[4].kv.key == "/w/c");
  CHECK(p[4].kv.mod_revision == last);
  CHECK(past->next_revision() == last + 1);

  const auto n = take(*now, 3);
  REQUIRE(n.size() == 3);
  CHECK(n[0].type == WatchEvent::Type::kPut);
  CHECK(n[0].kv.value == "3");
  CHECK(n[1].type == WatchEvent::Type::kDelete);
  CHECK(n[2].kv.key == "/w/c");

  const auto s = take(*single, 1);
  REQUIRE(s.size() == 1);
  CHECK(s[0].kv.value == "3");
  // Nothing else arrives; the wait ends at its deadline with the stream kept.
  CHECK_FALSE(single->next(100ms));
  c.put("/w/a", "5");
  const auto again = single->next(5s);
  REQUIRE(again);
  CHECK(again->kv.value == "5");
}

TEST_CASE("EtcdClient: a watch from a compacted revision reports the compaction", "[multiproc]") {
  EtcdCluster cluster(1);
  EtcdClient c(cluster.client_endpoints(), 3s);
  const auto r1 = c.put("/cmp/k", "1");
  c.put("/cmp/k", "2");
  const auto r3 = c.put("/cmp/k", "3");
  c.compact(r3);
  auto w = c.watch("/cmp/k", r1);
  try {
    w->next(5s);
    FAIL("no WatchCompactedError");
  } catch (const WatchCompactedError& e) {
    CHECK(e.compact_revision() == r3);
    CHECK(std::string(e.what()).find("compacted") != std::string::npos);
  }
  CHECK(w->compacted());
  CHECK_THROWS_AS(w->next(10ms), WatchCompactedError);
  // From the compaction revision on, a new watch works.
  auto fresh = c.watch("/cmp/k", r3);
  const auto e = fresh->next(5s);
  REQUIRE(e);
  CHECK(e->kv.value == "3");
}

TEST_CASE("EtcdClient: any member that answers serves and dead or silent ones are skipped",
          "[multiproc]") {
  EtcdCluster cluster(1);
  ScriptedServer silent("");  // accepts, never answers
  EtcdClient c({dead_endpoint(), silent.endpoint(), cluster.client_endpoint(0)}, 3s);
  c.put("/any/k", "v");
  CHECK(c.get("/any/k")->value == "v");
  auto w = c.watch("/any/k", 0);
  CHECK(w->endpoint() == cluster.client_endpoint(0));
  c.put("/any/k", "w");
  const auto e = w->next(5s);
  REQUIRE(e);
  CHECK(e->kv.value == "w");
}

TEST_CASE("EtcdClient: a watch resumes on another member when its member dies, losing nothing",
          "[multiproc]") {
  EtcdCluster cluster(3);
  // The leader first, so that the watch sits on it and its death also forces an election.
  const int leader = cluster.leader();
  std::vector<std::string> endpoints{cluster.client_endpoint(leader)};
  for (int i = 0; i < 3; ++i)
    if (i != leader) endpoints.push_back(cluster.client_endpoint(i));
  EtcdClient c(endpoints, 5s);

  const auto start = c.put("/rs/0", "0");
  auto w = c.watch("/rs/", start + 1, true);
  REQUIRE(w->endpoint() == cluster.client_endpoint(leader));
  for (int i = 1; i <= 5; ++i) c.put("/rs/" + std::to_string(i), std::to_string(i));
  auto first = take(*w, 3);
  REQUIRE(first.size() == 3);

  cluster.kill(leader);
  // Written while the watch is down: delivered after it resumes elsewhere.
  for (int i = 6; i <= 10; ++i) c.put("/rs/" + std::to_string(i), std::to_string(i));

  auto rest = take(*w, 7, 10s);
  REQUIRE(rest.size() == 7);
  CHECK_FALSE(w->endpoint().empty());
  CHECK(w->endpoint() != cluster.client_endpoint(leader));
  first.insert(first.end(), rest.begin(), rest.end());
  for (int i = 1; i <= 10; ++i) {
    INFO(i);
    CHECK(first[i - 1].kv.key == "/rs/" + std::to_string(i));
    if (i > 1) CHECK(first[i - 1].kv.mod_revision > first[i - 2].kv.mod_revision);
  }
  CHECK_FALSE(w->next(200ms));  // nothing twice
  CHECK(c.add("/rs/counter", 2) == 2);
  CHECK(cluster.leader() != leader);
}

TEST_CASE("EtcdClient: with every endpoint dead, a call throws IoError naming each in time",
          "[net]") {
  ScriptedServer silent("");
  const std::vector<std::string> endpoints{dead_endpoint(), silent.endpoint(), dead_endpoint()};
  EtcdClient c(endpoints, 600ms);
  const auto t0 = Clock::now();
  try {
    c.get("/k");
    FAIL("no IoError");
  } catch (const IoError& e) {
    const std::string msg = e.what();
    for (const auto& ep : endpoints) CHECK(msg.find(ep) != std::string::npos);
    CHECK(msg.find("600ms") != std::string::npos);
  }
  const auto elapsed = Clock::now() - t0;
  CHECK(elapsed >= 600ms);
  CHECK(elapsed < 600ms + 2s);  // a bound, not a speed: the deadline holds
  CHECK_THROWS_AS(c.watch("/k", 0), IoError);
  CHECK_THROWS_AS(c.add("/k", 1), IoError);
}

TEST_CASE("EtcdClient: a failed compare_set reads the current value in the same round trip",
          "[net]") {
  // etcd 3.4's answer to a txn whose compare failed: no "succeeded" field,
  // the failure branch's range in "responses".
  testing::ScriptedServer member(testing::http_ok(
      R"({"header":{"cluster_id":"1","member_id":"2","revision":"9","raft_term":"2"},)"
      R"("responses":[{"response_range":{"header":{"revision":"9"},"kvs":[{"key":"L2s=",)"
      R"("create_revision":"3","mod_revision":"8","version":"4","value":"bm93"}],"count":"1"}}]})"));
  EtcdClient c({member.endpoint()}, 2s);
  const auto r = c.compare_set("/k", std::string("before"), "after");
  CHECK(member.connections() == 1);
  CHECK_FALSE(r.succeeded);
  CHECK(r.revision == 9);
  REQUIRE(r.current);
  CHECK(r.current->key == "/k");
  CHECK(r.current->value == "now");
  CHECK(r.current->mod_revision == 8);
  CHECK(r.current->version == 4);
}

TEST_CASE("EtcdClient: a server that answers garbage gives ProtocolError naming it", "[net]") {
  const char* replies[] = {
      "SSH-2.0-OpenSSH\r\n",                                 // not HTTP
      "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",   // not JSON
      "HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\nshort",  // truncated body
      "HTTP/1.1 404 Not Found\r\nContent-Length: 10\r\n\r\nNot Found\n",
      "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",  // bad chunk
  };
  for (const char* reply : replies) {
    INFO(reply);
    ScriptedServer junk(reply);
    EtcdClient c({junk.endpoint()}, 1s);
    try {
      c.get("/k");
      FAIL("no throw");
    } catch (const ProtocolError& e) {
      CHECK(std::string(e.what()).find(junk.endpoint()) != std::string::npos);
    } catch (const IoError& e) {
      // A truncated body reads as a connection closed mid-answer.
      CHECK(std::string(reply).find("short") != std::string::npos);
    }
  }
  const char* bodies[] = {
      R"({"header":{"revision":"1"},"kvs":[{"key":"!!","mod_revision":"1"}],"count":"1"})",
      R"({"header":{"revision":"one"}})",
      R"({"header":{"revision":"1"},"kvs":"x"})",
      R"([1,2,3])",
  };
  for (const char* body : bodies) {
    INFO(body);
    ScriptedServer junk(testing::http_ok(body));
    EtcdClient c({junk.endpoint()}, 1s);
    CHECK_THROWS_AS(c.get("/k"), ProtocolError);
    CHECK_THROWS_AS(c.range_prefix("/"), ProtocolError);
    CHECK_THROWS_AS(c.compare_set("/k", std::nullopt, "v"), ProtocolError);
    CHECK_THROWS_AS(c.lease_grant(5s), ProtocolError);
  }
  {
    ScriptedServer junk(
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\n<html>\r\n0\r\n\r\n");
    EtcdClient c({junk.endpoint()}, 1s);
    CHECK_THROWS_AS(c.watch("/k", 0), ProtocolError);
    CHECK_THROWS_AS(c.lease_keepalive(1), ProtocolError);
  }
}

}  // namespace
}  // namespace ctorchrun::etcd
