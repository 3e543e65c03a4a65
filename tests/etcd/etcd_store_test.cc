// EtcdStore against a real single-member etcd ([multiproc]): the behaviour
// suite every Store passes, waits woken by watches, keys bound to a lease.

#include "etcd/etcd_store.h"

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <exception>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "tests/store/store_suite.h"
#include "tests/support/dropping_proxy.h"
#include "tests/support/etcd_server.h"

namespace ctorchrun::etcd {

// Catch2 prints a failed status check by name.
std::ostream& operator<<(std::ostream& os, EtcdStore::KeyStatus s) {
  return os << EtcdStore::to_string(s);
}

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::EtcdCluster;
using Status = EtcdStore::KeyStatus;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::shared_ptr<EtcdClient> client_of(const EtcdCluster& cluster,
                                      std::chrono::milliseconds read_timeout = 3s) {
  return std::make_shared<EtcdClient>(cluster.client_endpoints(), read_timeout);
}

std::shared_ptr<EtcdStore> store_of(const EtcdCluster& cluster, const std::string& prefix) {
  auto s = std::make_shared<EtcdStore>(client_of(cluster), prefix);
  s->set_timeout(10s);
  return s;
}

TEST_CASE("EtcdStore: the store behaviour suite passes on clients of one etcd", "[multiproc]") {
  EtcdCluster cluster(1);
  // Each client its own EtcdClient, as separate agents would have.
  testing::run_store_suite([&] { return store_of(cluster, "/ctorchrun/suite/"); });
  // Clients sharing one EtcdClient, as the threads of one agent would.
  auto shared = client_of(cluster);
  testing::run_store_suite(
      [&] { return std::make_shared<EtcdStore>(shared, "/ctorchrun/suite-shared/"); });
}

TEST_CASE("EtcdStore: keys live under the prefix and num_keys counts the prefix alone",
          "[multiproc]") {
  EtcdCluster cluster(1);
  auto a = store_of(cluster, "/ctorchrun/a/");
  auto b = store_of(cluster, "/ctorchrun/b/");
  a->set("k", "1");
  a->add("n", 2);
  b->set("k", "other");
  CHECK(a->num_keys() == 2);
  CHECK(b->num_keys() == 1);
  CHECK(a->get("k") == "1");
  CHECK(a->client()->get("/ctorchrun/a/n")->value == "2");
  CHECK(b->delete_key("k"));
  CHECK(b->num_keys() == 0);
  CHECK(a->num_keys() == 2);
}

TEST_CASE("EtcdStore: compare_set replaces an empty value when expected is empty, in one request",
          "[multiproc]") {
  EtcdCluster cluster(1);
  auto s = store_of(cluster, "/p/");
  s->set("e", "");
  CHECK(s->compare_set("e", "", "filled") == "filled");
  CHECK(s->get("e") == "filled");
  CHECK(s->compare_set("e", "", "again") == "filled");
  CHECK(s->compare_set("absent", "x", "y") == "x");
  CHECK_FALSE(s->check({"absent"}));
  CHECK(s->compare_set("e", "filled", "") == "");
  CHECK(s->get("e").empty());
}

TEST_CASE("EtcdStore: multi ops beyond one transaction and with repeated keys", "[multiproc]") {
  EtcdCluster cluster(1);
  auto s = store_of(cluster, "/p/");
  std::vector<std::string> keys, values;
  for (int i = 0; i < 300; ++i) {
    keys.push_back("m/" + std::to_string(i));
    values.push_back(std::to_string(i * 7));
  }
  s->multi_set(keys, values);
  CHECK(s->multi_get(keys) == values);
  CHECK(s->check(keys));
  s->wait(keys, 2s);
  CHECK(s->num_keys() == 300);
  s->multi_set({"d", "d"}, {"first", "last"});
  CHECK(s->get("d") == "last");
  s->multi_set({}, {});
}

TEST_CASE("EtcdStore: values too large to send twice in one request keep the same semantics",
          "[multiproc]") {
  EtcdCluster cluster(1);
  auto observer = store_of(cluster, "/p/");
  auto holder = store_of(cluster, "/p/");
  holder->bind_keys_to_lease(5s);
  const std::string big(EtcdStore::kInlineValueBytes + 1000, 'b');
  const std::string big2(EtcdStore::kInlineValueBytes * 3, 'c');

  holder->set("s", big);
  CHECK(observer->key_status("s") == Status::kHeld);
  observer->set("s", big2);
  CHECK(observer->get("s") == big2);
  CHECK(observer->key_status("s") == Status::kHeld);

  CHECK(holder->compare_set("c", "", big) == big);
  CHECK(observer->key_status("c") == Status::kHeld);
  CHECK(holder->compare_set("c", "", big2) == big);
  observer->set("e", "");
  CHECK(holder->compare_set("e", "", big2) == big2);
  CHECK(observer->get("e") == big2);
  CHECK(observer->key_status("e") == Status::kPresent);
  CHECK(holder->compare_set("c", big, "small") == "small");

  holder->multi_set({"m1", "m2"}, {big, big2});
  CHECK(observer->multi_get({"m2", "m1"}) == std::vector<std::string>{big2, big});
  CHECK(observer->key_status("m2") == Status::kHeld);
}

TEST_CASE("EtcdStore: get blocks until another client sets the key", "[multiproc]") {
  EtcdCluster cluster(1);
  auto reader = store_of(cluster, "/p/");
  auto writer = store_of(cluster, "/p/");
  std::string got;
  std::exception_ptr error;
  Clock::time_point returned{};
  std::thread t([&] {
    try {
      got = reader->get("late");
      returned = Clock::now();
    } catch (...) {
      error = std::current_exception();
    }
  });
  // Give the reader time to block (if it has not, the set comes first and
  // get returns at once: the checks below hold either way).
  std::this_thread::sleep_for(300ms);
  const auto set_at = Clock::now();
  writer->set("late", "value");
  t.join();
  REQUIRE_FALSE(error);
  CHECK(got == "value");
  CHECK(returned >= set_at);
}

TEST_CASE("EtcdStore: a blocked wait wakes at once on another client's set", "[multiproc]") {
  EtcdCluster cluster(1);
  auto waiter = store_of(cluster, "/p/");
  auto writer = store_of(cluster, "/p/");
  writer->set("a", "1");
  std::exception_ptr error;
  Clock::time_point woke{};
  std::atomic<bool> started{false};
  std::thread t([&] {
    try {
      started = true;
      waiter->wait({"a", "b", "c"}, 20s);
      woke = Clock::now();
    } catch (...) {
      error = std::current_exception();
    }
  });
  for (int i = 0; i < 5000 && !started; ++i) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(300ms);
  writer->set("b", "2");
  const auto set_at = Clock::now();
  writer->add("c", 1);
  t.join();
  REQUIRE_FALSE(error);
  const double latency = std::chrono::duration<double>(woke - set_at).count();
  WARN("wait woke " << latency * 1000 << " ms after the last set returned");
  CHECK(latency < 5.0);  // a watch, not a poll: typically a few ms
}

TEST_CASE("EtcdStore: wait times out naming the missing keys and the timeout", "[multiproc]") {
  EtcdCluster cluster(1);
  auto s = store_of(cluster, "/p/");
  s->set("here", "1");
  try {
    s->wait({"here", "gone1", "gone2"}, 200ms);
    FAIL("wait returned");
  } catch (const TimeoutError& e) {
    const std::string m = e.what();
    CHECK(m.find("gone1") != std::string::npos);
    CHECK(m.find("gone2") != std::string::npos);
    CHECK(m.find("'here'") == std::string::npos);
    CHECK(m.find("200ms") != std::string::npos);
  }
  s->set_timeout(150ms);
  CHECK_THROWS_AS(s->get("never"), TimeoutError);
  CHECK_THROWS_AS(s->multi_get({"here", "never"}), TimeoutError);
}

TEST_CASE("EtcdStore: concurrent adds from threads give distinct results", "[multiproc]") {
  EtcdCluster cluster(1);
  auto s = store_of(cluster, "/p/");
  constexpr int kThreads = 8;
  constexpr int kAdds = 20;
  std::vector<std::vector<int64_t>> results(kThreads);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      try {
        for (int i = 0; i < kAdds; ++i) results[t].push_back(s->add("ctr", 1));
      } catch (...) {
        ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(failures == 0);
  std::vector<int64_t> all;
  for (const auto& r : results) all.insert(all.end(), r.begin(), r.end());
  std::sort(all.begin(), all.end());
  std::vector<int64_t> expected(kThreads * kAdds);
  for (int i = 0; i < kThreads * kAdds; ++i) expected[i] = i + 1;
  CHECK(all == expected);
  CHECK(s->get("ctr") == std::to_string(kThreads * kAdds));
}

TEST_CASE(
    "EtcdStore: a tally costs one request per enrolment however many enrol at once, and add of 0 "
    "is one read",
    "[multiproc]") {
  EtcdCluster cluster(1);
  auto client = client_of(cluster, 10s);
  auto s = std::make_shared<EtcdStore>(client, "/p/");
  // A bound store: its tally keys are still unbound (a tally never shrinks).
  s->bind_keys_to_lease(5s);
  constexpr int kThreads = 32;
  std::vector<int64_t> places(kThreads);
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::atomic<int> failures{0};
  const std::uint64_t before = client->exchanges();
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      ++ready;
      for (int i = 0; i < 100000 && !go; ++i) std::this_thread::sleep_for(100us);
      try {
        places[static_cast<size_t>(t)] = s->tally_add("round/entered", "n" + std::to_string(t));
      } catch (...) {
        ++failures;
      }
    });
  }
  for (int i = 0; i < 100000 && ready < kThreads; ++i) std::this_thread::sleep_for(100us);
  go = true;
  for (auto& t : threads) t.join();
  CHECK(failures == 0);
  // All at once, and no retry: one transaction each (a compare-and-set
  // counter retries each loser of every race).
  CHECK(client->exchanges() - before == kThreads);
  std::sort(places.begin(), places.end());
  std::vector<int64_t> expected(kThreads);
  for (int i = 0; i < kThreads; ++i) expected[static_cast<size_t>(i)] = i + 1;
  CHECK(places == expected);
  const auto kvs = client->range_prefix("/p/round/entered" + std::string(EtcdStore::kTallySuffix));
  CHECK(kvs.kvs.size() == kThreads);
  for (const auto& kv : kvs.kvs) CHECK(kv.lease == 0);
  CHECK(s->tally_entries("round/entered").size() == kThreads);

  s->add("gen", 3);
  const std::uint64_t reads = client->exchanges();
  CHECK(s->add("gen", 0) == 3);
  CHECK(client->exchanges() - reads == 1);
  CHECK(s->tally_count("round/entered") == kThreads);
  CHECK(client->exchanges() - reads == 2);
}

TEST_CASE(
    "EtcdStore: waits on one key in slices go on with one watch: no read after the first, and a "
    "set between two slices ends the next at once",
    "[multiproc]") {
  EtcdCluster cluster(1);
  auto client = client_of(cluster);
  auto s = std::make_shared<EtcdStore>(client, "/p/");
  auto other = store_of(cluster, "/p/");
  auto slice = [&](const std::string& key) {
    try {
      s->wait({key}, 100ms);
      return true;
    } catch (const TimeoutError& e) {
      CHECK_THAT(e.what(), Catch::Contains(key));
      return false;
    }
  };
  const std::uint64_t before = client->exchanges();
  CHECK_FALSE(slice("failure"));
  CHECK(client->exchanges() - before == 1);  // the read; the watch stays
  for (int i = 0; i < 5; ++i) CHECK_FALSE(slice("failure"));
  CHECK(client->exchanges() - before == 1);
  other->set("failure", "x");
  const auto t0 = Clock::now();
  CHECK(slice("failure"));
  CHECK(seconds_since(t0) < 5.0);
  // Another key reads and watches anew; the first key's watch went with its
  // success, so the key (now there) is read again.
  CHECK_FALSE(slice("other"));
  CHECK(client->exchanges() - before == 2);
  CHECK(slice("failure"));
  CHECK(client->exchanges() - before == 3);
}

TEST_CASE("EtcdStore: bound keys vanish when the holder dies, deleted ones leave a left marker",
          "[multiproc]") {
  EtcdCluster cluster(1);
  auto observer = store_of(cluster, "/job/");
  auto holder = store_of(cluster, "/job/");
  holder->bind_keys_to_lease(1s);
  REQUIRE(holder->lease_id() != 0);

  holder->set("present/0", "pid");
  holder->add("count", 1);
  CHECK(holder->compare_set("cas", "", "mine") == "mine");
  holder->append("log", "x");
  holder->multi_set({"m1", "m2"}, {"1", "2"});
  holder->set("present/1", "pid");
  // Overwrites keep the binding, whoever writes.
  observer->set("present/0", "rewritten");
  observer->add("count", 1);
  // A key the observer created stays unbound.
  observer->set("free", "1");

  for (const char* k : {"present/0", "count", "cas", "log", "m1", "m2", "present/1"}) {
    INFO(k);
    CHECK(observer->key_status(k) == Status::kHeld);
  }
  CHECK(observer->key_status("free") == Status::kPresent);
  CHECK(observer->key_status("nothing") == Status::kAbsent);

  // Leaving on purpose: the key goes, the left marker stays, nothing reads lost.
  CHECK(holder->delete_key("present/1"));
  CHECK(observer->key_status("present/1") == Status::kLeft);
  CHECK(observer->check({EtcdStore::left_marker("present/1")}));
  CHECK_FALSE(observer->check({EtcdStore::held_marker("present/1")}));
  CHECK(observer->wait_vacated("present/1", 1s) == Status::kLeft);

  // Death: the keeper stops, nothing is deleted, the lease runs out.
  const auto died = Clock::now();
  holder.reset();
  CHECK(observer->wait_vacated("present/0", 10s) == Status::kLost);
  const double took = seconds_since(died);
  WARN("bound key vanished " << took << " s after its holder died (TTL 1 s)");
  CHECK(took < 1.0 + 5.0);  // TTL + margin (etcd checks expiry every 500 ms)
  for (const char* k : {"count", "cas", "log", "m1", "m2"}) {
    INFO(k);
    CHECK(observer->key_status(k) == Status::kLost);
  }
  CHECK(observer->get("free") == "1");
  CHECK(observer->key_status("present/1") == Status::kLeft);

  // Re-creating unbound clears the markers of the lost incarnation.
  observer->set("present/0", "again");
  CHECK(observer->key_status("present/0") == Status::kPresent);
  CHECK(observer->delete_key("present/0"));
  CHECK(observer->key_status("present/0") == Status::kAbsent);
}

TEST_CASE("EtcdStore: wait_vacated wakes on a deliberate delete from another client",
          "[multiproc]") {
  EtcdCluster cluster(1);
  auto observer = store_of(cluster, "/job/");
  auto holder = store_of(cluster, "/job/");
  holder->bind_keys_to_lease(5s);
  holder->set("k", "v");
  Status status = Status::kAbsent;
  std::exception_ptr error;
  std::thread t([&] {
    try {
      status = observer->wait_vacated("k", 10s);
    } catch (...) {
      error = std::current_exception();
    }
  });
  std::this_thread::sleep_for(200ms);
  CHECK(holder->delete_key("k"));
  t.join();
  REQUIRE_FALSE(error);
  CHECK(status == Status::kLeft);
  // Absent already: returns at once, whatever the timeout.
  CHECK(observer->wait_vacated("never-created", 0ms) == Status::kAbsent);
}

TEST_CASE("EtcdStore: after its lease is lost a store refuses to create keys until bound again",
          "[multiproc]") {
  EtcdCluster cluster(1);
  auto observer = store_of(cluster, "/job/");
  auto holder = store_of(cluster, "/job/");
  holder->bind_keys_to_lease(3s);
  holder->set("k", "v");
  const auto first = holder->lease_id();
  REQUIRE(observer->client()->lease_revoke(first));
  CHECK(observer->key_status("k") == Status::kLost);
  // The keeper learns it at its next refresh (every second here).
  const auto deadline = Clock::now() + 10s;
  while (!holder->lease_lost() && Clock::now() < deadline) std::this_thread::sleep_for(20ms);
  REQUIRE(holder->lease_lost());
  CHECK_FALSE(holder->lease_lost_reason().empty());
  try {
    holder->set("k2", "v");
    FAIL("set created a key on a lost lease");
  } catch (const IoError& e) {
    CHECK(std::string(e.what()).find(std::to_string(first)) != std::string::npos);
  }
  CHECK_FALSE(observer->check({"k2"}));
  holder->bind_keys_to_lease(3s);
  CHECK(holder->lease_id() != first);
  holder->set("k", "back");
  CHECK(observer->key_status("k") == Status::kHeld);
}

TEST_CASE("EtcdStore: a store whose etcd is stopped throws IoError within the read timeout",
          "[multiproc]") {
  EtcdCluster cluster(1);
  auto s = std::make_shared<EtcdStore>(client_of(cluster, 1s), "/p/");
  s->set("k", "v");
  cluster.stop(0);
  for (int op = 0; op < 4; ++op) {
    INFO("op " << op);
    const auto t0 = Clock::now();
    try {
      switch (op) {
        case 0:
          s->get("k");
          break;
        case 1:
          s->set("k", "w");
          break;
        case 2:
          s->add("n", 1);
          break;
        case 3:
          s->wait({"k"}, 10s);
          break;
      }
      FAIL("no error");
    } catch (const IoError&) {
    }
    CHECK(seconds_since(t0) < 1.0 + 2.0);
  }
}

TEST_CASE("EtcdStore: a wait blocked when etcd stops throws IoError, not at its own timeout",
          "[multiproc]") {
  EtcdCluster cluster(1);
  auto s = std::make_shared<EtcdStore>(client_of(cluster, 1s), "/p/");
  s->set("present", "1");
  std::exception_ptr error;
  std::atomic<bool> started{false};
  std::thread t([&] {
    try {
      started = true;
      s->wait({"present", "never"}, 30s);
    } catch (...) {
      error = std::current_exception();
    }
  });
  for (int i = 0; i < 5000 && !started; ++i) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(300ms);
  const auto stopped = Clock::now();
  cluster.stop(0);
  t.join();
  REQUIRE(error);
  CHECK_THROWS_AS(std::rethrow_exception(error), IoError);
  const double after_stop = seconds_since(stopped);
  WARN("the wait failed " << after_stop << " s after etcd was stopped (read timeout 1 s)");
  CHECK(after_stop < 2 * 1.0 + 3.0);  // about twice the read timeout, far below 30 s
}

TEST_CASE("EtcdStore: with three members, calls and a blocked wait survive a member's death",
          "[multiproc]") {
  EtcdCluster cluster(3);
  auto waiter = store_of(cluster, "/p/");
  auto writer = store_of(cluster, "/p/");
  writer->set("before", "1");
  std::exception_ptr error;
  std::atomic<bool> started{false};
  std::thread t([&] {
    try {
      started = true;
      waiter->wait({"before", "after"}, 20s);
    } catch (...) {
      error = std::current_exception();
    }
  });
  for (int i = 0; i < 5000 && !started; ++i) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(300ms);
  // Member 0 answered first, so it carries the watch and is every store's
  // preferred member.
  cluster.kill(0);
  writer->set("after", "2");
  t.join();
  REQUIRE_FALSE(error);
  CHECK(waiter->get("after") == "2");
  CHECK(writer->add("n", 5) == 5);
  CHECK(writer->compare_set("n", "5", "6") == "6");
  CHECK(waiter->num_keys() == 3);
}

TEST_CASE(
    "EtcdStore: a tally enrolment whose answer was lost after etcd applied it is recovered, "
    "counted once at its own place even when others enrolled meanwhile",
    "[multiproc]") {
  EtcdCluster cluster(1);
  const std::string member = cluster.client_endpoint(0);
  testing::DroppingProxy proxy(
      "127.0.0.1", static_cast<std::uint16_t>(std::stoi(member.substr(member.rfind(':') + 1))));
  auto direct = store_of(cluster, "/ctorchrun/lost/");
  EtcdStore through(std::make_shared<EtcdClient>(std::vector<std::string>{proxy.endpoint()}, 3s),
                    "/ctorchrun/lost/");
  CHECK(direct->tally_add("t", "a") == 1);
  proxy.drop_answer_to({"POST /v3/kv/txn", "request_put", "count_only"});
  CHECK(through.tally_add("t", "b") == 2);
  CHECK(proxy.dropped() == 1);
  CHECK(direct->tally_count("t") == 2);
  auto entries = direct->tally_entries("t");
  std::sort(entries.begin(), entries.end());
  CHECK(entries == std::vector<std::string>{"a", "b"});
  CHECK(direct->tally_add("t", "c") == 3);
  CHECK(through.tally_add("t", "d") == 4);
  // Another node enrols after the lost one was applied and before it reads
  // its place back: the lost one keeps its own place (5), the other has 6.
  int64_t other = 0;
  proxy.on_drop([&] { other = direct->tally_add("t", "f"); });
  proxy.drop_answer_to({"POST /v3/kv/txn", "request_put", "count_only"});
  CHECK(through.tally_add("t", "e") == 5);
  CHECK(other == 6);
  CHECK(direct->tally_count("t") == 6);
}

TEST_CASE("EtcdStore: add(key, 0) on a missing key returns 0 and writes nothing", "[multiproc]") {
  EtcdCluster cluster(1);
  auto s = store_of(cluster, "/ctorchrun/add0/");
  CHECK(s->add("counter", 0) == 0);
  CHECK_FALSE(s->check({"counter"}));
  CHECK(s->num_keys() == 0);
  CHECK(s->add("counter", 2) == 2);
  CHECK(s->add("counter", 0) == 2);
}

}  // namespace
}  // namespace ctorchrun::etcd
