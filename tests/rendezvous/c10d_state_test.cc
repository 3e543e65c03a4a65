// C10dState against HashStore with a manual clock: joins, last call,
// completion at MAX, late arrivals, disagreeing settings, and the number of
// store requests per node. No sleeps: time moves only when a test moves it.

#include "rendezvous/c10d_state.h"

#include <catch2/catch.hpp>
#include <memory>
#include <thread>
#include <vector>

#include "common/error.h"
#include "store/hash_store.h"
#include "store/prefix_store.h"

using namespace ctorchrun;
using namespace std::chrono_literals;
using rendezvous::C10dSettings;
using rendezvous::C10dState;

namespace {

struct ManualClock {
  C10dState::Clock::time_point t{};
  std::function<C10dState::Clock::time_point()> fn() {
    return [this] { return t; };
  }
};

// Forwards to a HashStore and counts the requests.
class CountingStore : public store::Store {
 public:
  explicit CountingStore(store::Store& inner) : inner_(inner) {}
  int requests = 0;
  void set(const std::string& k, const std::string& v) override { ++requests, inner_.set(k, v); }
  std::string get(const std::string& k) override { return ++requests, inner_.get(k); }
  int64_t add(const std::string& k, int64_t d) override { return ++requests, inner_.add(k, d); }
  std::string compare_set(const std::string& k, const std::string& e,
                          const std::string& d) override {
    return ++requests, inner_.compare_set(k, e, d);
  }
  using Store::wait;
  void wait(const std::vector<std::string>& k, std::chrono::milliseconds t) override {
    ++requests, inner_.wait(k, t);
  }
  bool check(const std::vector<std::string>& k) override { return ++requests, inner_.check(k); }
  int64_t num_keys() override { return ++requests, inner_.num_keys(); }
  bool delete_key(const std::string& k) override { return ++requests, inner_.delete_key(k); }
  void append(const std::string& k, const std::string& v) override {
    ++requests, inner_.append(k, v);
  }
  std::vector<std::string> multi_get(const std::vector<std::string>& k) override {
    return ++requests, inner_.multi_get(k);
  }
  void multi_set(const std::vector<std::string>& k, const std::vector<std::string>& v) override {
    ++requests, inner_.multi_set(k, v);
  }

 private:
  store::Store& inner_;
};

C10dSettings settings(int min, int max, int max_restarts = 0, std::string entry = "train.py") {
  return C10dSettings{min, max, max_restarts, std::move(entry)};
}

rendezvous::NodeInfo node(const std::string& host, int lws = 1, int pid = 100) {
  rendezvous::NodeInfo n;
  n.host = host;
  n.local_world_size = lws;
  n.pid = pid;
  return n;
}

}  // namespace

TEST_CASE(
    "C10dState: a fixed --nnodes=2 round completes when the second node joins, ranks "
    "follow arrival",
    "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  C10dState a(hs, settings(2, 2), node("a", 2, 11), 30s, clock.fn());
  C10dState b(hs, settings(2, 2), node("b", 3, 22), 30s, clock.fn());
  a.join();
  CHECK_FALSE(a.poll().has_value());
  b.join();
  auto ra = a.poll();
  auto rb = b.poll();
  REQUIRE(ra.has_value());
  REQUIRE(rb.has_value());
  CHECK(ra->group_rank == 0);
  CHECK(rb->group_rank == 1);
  REQUIRE(ra->nodes.size() == 2);
  CHECK(ra->nodes[0].host == "a");
  CHECK(ra->nodes[0].local_world_size == 2);
  CHECK(ra->nodes[0].pid == 11);
  CHECK(ra->nodes[1].host == "b");
  CHECK(ra->nodes[1].local_world_size == 3);
  CHECK(rb->nodes[1].pid == 22);
  CHECK(hs.check({"rdzv/0/complete"}));
}

TEST_CASE("C10dState: MIN:MAX completes after last_call_timeout on the waiting node's clock",
          "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  C10dState a(hs, settings(2, 4), node("a"), 30s, clock.fn());
  C10dState b(hs, settings(2, 4), node("b"), 30s, clock.fn());
  a.join();
  CHECK_FALSE(a.poll().has_value());  // below MIN: no timer yet
  clock.t += 100s;                    // time below MIN does not count
  CHECK_FALSE(a.poll().has_value());
  b.join();
  CHECK_FALSE(a.poll().has_value());  // MIN reached: last call starts now
  CHECK_FALSE(b.poll().has_value());
  clock.t += 29s;
  CHECK_FALSE(a.poll().has_value());
  clock.t += 1s;
  auto ra = a.poll();
  REQUIRE(ra.has_value());
  CHECK(ra->nodes.size() == 2);
  auto rb = b.poll();  // reads the count a decided
  REQUIRE(rb.has_value());
  CHECK(rb->group_rank == 1);
  CHECK(rb->nodes.size() == 2);
}

TEST_CASE("C10dState: a node joining during last call is in the round", "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  C10dState a(hs, settings(1, 3), node("a"), 10s, clock.fn());
  C10dState b(hs, settings(1, 3), node("b"), 10s, clock.fn());
  a.join();
  CHECK_FALSE(a.poll().has_value());
  clock.t += 5s;
  b.join();
  CHECK_FALSE(b.poll().has_value());
  clock.t += 5s;
  auto ra = a.poll();
  REQUIRE(ra.has_value());
  CHECK(ra->nodes.size() == 2);
  REQUIRE(b.poll().has_value());
}

TEST_CASE("C10dState: the round completes at MAX without waiting for last call", "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  std::vector<std::unique_ptr<C10dState>> nodes;
  for (int i = 0; i < 3; ++i) {
    nodes.push_back(std::make_unique<C10dState>(hs, settings(1, 3), node("h" + std::to_string(i)),
                                                600s, clock.fn()));
    nodes.back()->join();
  }
  for (int i = 0; i < 3; ++i) {
    auto r = nodes[static_cast<size_t>(i)]->poll();
    REQUIRE(r.has_value());
    CHECK(r->group_rank == i);
    CHECK(r->nodes.size() == 3);
  }
  CHECK(hs.get("rdzv/0/complete") == "3");
}

TEST_CASE("C10dState: a node arriving after the round completed, or beyond MAX, is refused",
          "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  C10dState a(hs, settings(1, 2), node("a"), 1s, clock.fn());
  a.join();
  a.poll();
  clock.t += 1s;
  REQUIRE(a.poll().has_value());  // complete with one node
  C10dState late(hs, settings(1, 2), node("late"), 1s, clock.fn());
  late.join();
  CHECK_THROWS_AS(late.poll(), RendezvousClosedError);

  store::HashStore full;
  C10dState x(full, settings(1, 1), node("x"), 1s, clock.fn());
  x.join();
  C10dState y(full, settings(1, 1), node("y"), 1s, clock.fn());
  CHECK_THROWS_AS(y.join(), RendezvousClosedError);
}

TEST_CASE(
    "C10dState: nodes that disagree on --nnodes, --max_restarts or the entrypoint are "
    "refused, naming both values",
    "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  C10dState first(hs, settings(2, 2, 3, "train.py"), node("a"), 1s, clock.fn());
  first.join();
  auto refuse = [&](C10dSettings s, const std::string& what) {
    C10dState other(hs, s, node("b"), 1s, clock.fn());
    try {
      other.join();
      FAIL("joined despite different settings");
    } catch (const ConfigError& e) {
      CHECK_THAT(e.what(), Catch::Contains(what));
    }
  };
  refuse(settings(1, 2, 3, "train.py"),
         "--nnodes: the job's first node has 2:2, this node (b) "
         "has 1:2");
  refuse(settings(2, 2, 1, "train.py"),
         "--max_restarts: the job's first node has 3, this node "
         "(b) has 1");
  refuse(settings(2, 2, 3, "other.py"), "--entrypoint: the job's first node has train.py");
  // The refused nodes took no arrival index.
  CHECK(hs.add("rdzv/0/joined", 0) == 1);
}

TEST_CASE("C10dState: store requests per node are bounded by a constant, whatever the size",
          "[unit]") {
  for (int n : {4, 64}) {
    store::HashStore hs;
    ManualClock clock;
    std::vector<std::unique_ptr<CountingStore>> stores;
    std::vector<std::unique_ptr<C10dState>> nodes;
    for (int i = 0; i < n; ++i) {
      stores.push_back(std::make_unique<CountingStore>(hs));
      nodes.push_back(
          std::make_unique<C10dState>(*stores.back(), settings(n, n), node("h"), 1s, clock.fn()));
    }
    for (auto& s : nodes) s->join();
    for (size_t i = 0; i < nodes.size(); ++i) {
      REQUIRE(nodes[i]->poll().has_value());
      CHECK(stores[i]->requests <= 8);
    }
  }
}

TEST_CASE("C10dState: racing joiners on threads get distinct ranks and one member list", "[unit]") {
  store::HashStore hs;
  constexpr int kNodes = 16;
  std::vector<int> ranks(kNodes, -1);
  std::vector<size_t> sizes(kNodes, 0);
  std::vector<std::string> errors(kNodes);
  std::vector<std::thread> threads;
  for (int i = 0; i < kNodes; ++i) {
    threads.emplace_back([&, i] {
      try {
        C10dState s(hs, settings(kNodes, kNodes), node("h" + std::to_string(i)), 1s);
        s.join();
        for (int step = 0; step < 1000; ++step) {
          if (auto r = s.poll()) {
            ranks[static_cast<size_t>(i)] = r->group_rank;
            sizes[static_cast<size_t>(i)] = r->nodes.size();
            return;
          }
          hs.wait({s.wait_key()}, 1000ms);
        }
        errors[static_cast<size_t>(i)] = "no round after 1000 polls";
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(i)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  for (int i = 0; i < kNodes; ++i) {
    CHECK(errors[static_cast<size_t>(i)].empty());
    CHECK(sorted[static_cast<size_t>(i)] == i);
    CHECK(sizes[static_cast<size_t>(i)] == kNodes);
  }
}

TEST_CASE("C10dState: two run ids on one store do not see each other", "[unit]") {
  auto hs = std::make_shared<store::HashStore>();
  store::PrefixStore one("ctorchrun/one", hs);
  store::PrefixStore two("ctorchrun/two", hs);
  ManualClock clock;
  C10dState a(one, settings(1, 1), node("a"), 1s, clock.fn());
  C10dState b(two, settings(2, 2, 5, "x.py"), node("b"), 1s, clock.fn());
  a.join();
  b.join();  // different settings, different job: no refusal
  auto r = a.poll();
  REQUIRE(r.has_value());
  CHECK(r->nodes.size() == 1);
  CHECK_FALSE(b.poll().has_value());
}
