// C10dState and C10dRoundWatch against HashStore with manual clocks: joins,
// last call, completion at MAX, late joiners and batching, spares, closing
// and reuse, racing writers, disagreeing settings, and the number of store
// requests per node. No sleeps: time moves only when a test moves it.

#include "rendezvous/c10d_state.h"

#include <catch2/catch.hpp>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <vector>

#include "common/error.h"
#include "rendezvous/node_record.h"
#include "store/hash_store.h"
#include "store/prefix_store.h"
#include "tests/support/fault_store.h"

using namespace ctorchrun;
using namespace std::chrono_literals;
using rendezvous::C10dRound;
using rendezvous::C10dRoundWatch;
using rendezvous::C10dSettings;
using rendezvous::C10dState;
using rendezvous::JobClosedError;

namespace {

// Every member's record, as an agent reads them on demand.
std::vector<rendezvous::NodeInfo> members(store::Store& s, const C10dRound& r) {
  return C10dState::read_members(s, r);
}

struct ManualClock {
  C10dState::Clock::time_point t{};
  C10dState::WallClock::time_point wall{std::chrono::hours(24 * 365 * 50)};
  std::function<C10dState::Clock::time_point()> fn() {
    return [this] { return t; };
  }
  std::function<C10dState::WallClock::time_point()> wall_fn() {
    return [this] { return wall; };
  }
  void advance(std::chrono::milliseconds d) {
    t += d;
    wall += d;
  }
};

rendezvous::C10dTiming timing(std::chrono::milliseconds last_call,
                              std::chrono::milliseconds window = 600s) {
  rendezvous::C10dTiming t;
  t.last_call_timeout = last_call;
  t.closed_window = window;
  return t;
}

// Forwards to a HashStore and counts the requests a TCP store would get
// (a tally in its portable form: append and add).
class CountingStore : public store::Store {
 public:
  explicit CountingStore(store::Store& inner) : inner_(inner) {}
  int requests = 0;
  size_t read_bytes = 0;  // values received
  void set(const std::string& k, const std::string& v) override { ++requests, inner_.set(k, v); }
  std::string get(const std::string& k) override {
    auto v = inner_.get(k);
    read_bytes += v.size();
    return ++requests, v;
  }
  int64_t add(const std::string& k, int64_t d) override { return ++requests, inner_.add(k, d); }
  std::string compare_set(const std::string& k, const std::string& e,
                          const std::string& d) override {
    auto v = inner_.compare_set(k, e, d);
    read_bytes += v.size();
    return ++requests, v;
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
    auto v = inner_.multi_get(k);
    for (const auto& x : v) read_bytes += x.size();
    return ++requests, v;
  }
  void multi_set(const std::vector<std::string>& k, const std::vector<std::string>& v) override {
    ++requests, inner_.multi_set(k, v);
  }
  int64_t tally_add(const std::string& k, const std::string& e) override {
    return store::portable_tally::add(*this, k, e);
  }
  int64_t tally_count(const std::string& k) override {
    return store::portable_tally::count(*this, k);
  }
  std::vector<std::string> tally_entries(const std::string& k) override {
    return store::portable_tally::entries(*this, k);
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

// A node of a test: its state machine on the shared store and the manual clock.
struct Node {
  Node(store::Store& s, ManualClock& clock, C10dSettings set, const std::string& host,
       std::chrono::milliseconds last_call = 1s, int lws = 1, int pid = 100)
      : state(s, set, node(host, lws, pid), timing(last_call), clock.fn(), clock.wall_fn()) {}
  C10dState state;
};

}  // namespace

TEST_CASE(
    "C10dState: a fixed --nnodes=2 round completes when the second node joins, ranks "
    "follow arrival",
    "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  C10dState a(hs, settings(2, 2), node("a", 2, 11), timing(30s), clock.fn(), clock.wall_fn());
  C10dState b(hs, settings(2, 2), node("b", 3, 22), timing(30s), clock.fn(), clock.wall_fn());
  a.join();
  CHECK_FALSE(a.poll().has_value());
  b.join();
  auto ra = a.poll();
  auto rb = b.poll();
  REQUIRE(ra.has_value());
  REQUIRE(rb.has_value());
  CHECK(ra->group_rank == 0);
  CHECK(rb->group_rank == 1);
  CHECK(ra->round == 0);
  CHECK(ra->attempt == 0);
  REQUIRE(ra->roster.size() == 2);
  CHECK(members(hs, *ra)[0].host == "a");
  CHECK(members(hs, *ra)[0].local_world_size == 2);
  CHECK(members(hs, *ra)[0].pid == 11);
  CHECK(members(hs, *ra)[1].host == "b");
  CHECK(members(hs, *ra)[1].local_world_size == 3);
  CHECK(members(hs, *rb)[1].pid == 22);
  CHECK(hs.check({"g0/rdzv/0/complete"}));
}

TEST_CASE("C10dState: MIN:MAX completes after last_call_timeout on the waiting node's clock",
          "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  Node a(hs, clock, settings(2, 4), "a", 30s);
  Node b(hs, clock, settings(2, 4), "b", 30s);
  a.state.join();
  CHECK_FALSE(a.state.poll().has_value());
  clock.advance(60s);  // alone: no last call runs
  CHECK_FALSE(a.state.poll().has_value());
  b.state.join();
  CHECK_FALSE(a.state.poll().has_value());  // last call starts now
  clock.advance(29s);
  CHECK_FALSE(a.state.poll().has_value());
  CHECK(a.state.until_last_call() == 1s);
  clock.advance(1s);
  auto r = a.state.poll();
  REQUIRE(r.has_value());
  CHECK(r->roster.size() == 2);
  REQUIRE(b.state.poll().has_value());
}

TEST_CASE("C10dState: a node joining during last call is in the round", "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  Node a(hs, clock, settings(1, 3), "a", 10s);
  Node b(hs, clock, settings(1, 3), "b", 10s);
  a.state.join();
  CHECK_FALSE(a.state.poll().has_value());
  clock.advance(5s);
  b.state.join();
  clock.advance(5s);
  auto r = a.state.poll();
  REQUIRE(r.has_value());
  CHECK(r->roster.size() == 2);
  auto rb = b.state.poll();
  REQUIRE(rb.has_value());
  CHECK(rb->group_rank == 1);
}

TEST_CASE("C10dState: the round completes at MAX without waiting for last call", "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  std::vector<std::unique_ptr<Node>> nodes;
  for (int i = 0; i < 3; ++i) {
    nodes.push_back(
        std::make_unique<Node>(hs, clock, settings(1, 3), "h" + std::to_string(i), 3600s));
    nodes.back()->state.join();
  }
  for (auto& n : nodes) REQUIRE(n->state.poll().has_value());
}

TEST_CASE(
    "C10dState: a late joiner waits, the members re-form after last call and it comes after "
    "them, with the job's restart count",
    "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  Node a(hs, clock, settings(1, 3), "a", 5s);
  Node b(hs, clock, settings(1, 3), "b", 5s);
  a.state.join();
  a.state.poll();
  clock.advance(5s);
  auto r0 = a.state.poll();
  REQUIRE(r0.has_value());
  CHECK(r0->roster.size() == 1);
  C10dRoundWatch watch(hs, settings(1, 3), *r0, 5s, clock.fn());
  CHECK_FALSE(watch.check(0).has_value());  // nobody waits

  b.state.join();
  CHECK_FALSE(b.state.poll().has_value());
  CHECK(b.state.waiting());
  CHECK_FALSE(b.state.spare());
  CHECK(b.state.wait_key() == "g0/rdzv/0/reform");
  clock.advance(5s);
  auto change = watch.check(0);
  REQUIRE(change.has_value());
  CHECK(change->reason == "admitting 1 waiting node");
  CHECK(change->lost.empty());

  // The member comes back carrying restart count 2: no last call now.
  a.state.rejoin(*r0, 2, change->lost);
  auto r1a = a.state.poll();
  auto r1b = b.state.poll();
  REQUIRE(r1a.has_value());
  REQUIRE(r1b.has_value());
  CHECK(r1a->round == 1);
  CHECK(r1a->group_rank == 0);
  CHECK(r1b->group_rank == 1);
  CHECK(members(hs, *r1b)[0].host == "a");
  CHECK(r1b->attempt == 2);  // the newcomer takes the job's count
  CHECK(r1a->attempt == 2);
}

TEST_CASE("C10dState: admissions are batched, at most one re-formation per last call", "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  Node a(hs, clock, settings(1, 4), "a", 10s);
  a.state.join();
  a.state.poll();
  clock.advance(10s);
  auto r0 = a.state.poll();
  REQUIRE(r0);
  clock.advance(60s);
  C10dRoundWatch watch0(hs, settings(1, 4), *r0, 10s, clock.fn());
  clock.advance(10s);
  Node b(hs, clock, settings(1, 4), "b", 10s);
  b.state.join();
  auto change = watch0.check(0);
  REQUIRE(change);
  a.state.rejoin(*r0, 0, {});
  auto r1 = a.state.poll();
  REQUIRE(r1);
  REQUIRE(b.state.poll());
  // A third node right after: it waits until last call has passed since
  // round 1 formed, then both rounds' newcomers so far come in at once.
  C10dRoundWatch watch1(hs, settings(1, 4), *r1, 10s, clock.fn());
  Node c(hs, clock, settings(1, 4), "c", 10s);
  Node d(hs, clock, settings(1, 4), "d", 10s);
  c.state.join();
  CHECK_FALSE(watch1.check(0).has_value());
  clock.advance(5s);
  d.state.join();
  CHECK_FALSE(watch1.check(0).has_value());
  clock.advance(5s);
  auto change1 = watch1.check(0);
  REQUIRE(change1);
  CHECK(change1->reason == "admitting 2 waiting nodes");
}

TEST_CASE(
    "C10dState: a node beyond MAX is a spare until the job ends, then learns it while waiting",
    "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  Node a(hs, clock, settings(1, 2), "a", 1s);
  Node b(hs, clock, settings(1, 2), "b", 1s);
  a.state.join();
  b.state.join();
  auto r0 = a.state.poll();
  REQUIRE(r0);
  REQUIRE(b.state.poll());
  Node c(hs, clock, settings(1, 2), "c", 1s);
  c.state.join();
  CHECK_FALSE(c.state.poll().has_value());
  CHECK(c.state.spare());
  C10dRoundWatch watch(hs, settings(1, 2), *r0, 1s, clock.fn());
  clock.advance(1h);
  CHECK_FALSE(watch.check(0).has_value());  // no room: no re-formation
  CHECK_FALSE(c.state.poll().has_value());

  CHECK(a.state.close("succeeded") == 1);  // one node waits
  try {
    c.state.poll();
    FAIL("the spare did not see the end");
  } catch (const JobClosedError& e) {
    CHECK(e.while_waiting());
    CHECK(e.outcome() == "succeeded");
  }
  CHECK(a.state.closed_seen() == 1);
}

TEST_CASE("C10dState: a lost member's place goes to a spare, the survivors keep their order",
          "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  std::vector<std::unique_ptr<Node>> n;
  for (const char* h : {"a", "b", "c"}) {
    n.push_back(std::make_unique<Node>(hs, clock, settings(2, 3), h, 30s));
    n.back()->state.join();
  }
  std::vector<C10dRound> r0;
  for (auto& x : n) r0.push_back(*x->state.poll());
  Node spare(hs, clock, settings(2, 3), "s", 30s);
  spare.state.join();
  CHECK_FALSE(spare.state.poll().has_value());
  CHECK(spare.state.spare());

  // Member 1 ("b") is lost; two racing survivors re-form, one change wins.
  C10dRoundWatch w0(hs, settings(2, 3), r0[0], 30s, clock.fn());
  C10dRoundWatch w2(hs, settings(2, 3), r0[2], 30s, clock.fn());
  auto first = w2.reform({"node 1 lost", {1}, "heartbeat timeout"});
  auto second = w0.reform({"another reason", {0}, "agent exited"});
  CHECK(second.reason == "node 1 lost");
  CHECK(second.lost == std::vector<int>{1});
  CHECK(second.cause == "heartbeat timeout");
  REQUIRE(w0.check(0));

  n[2]->state.rejoin(r0[2], 0, first.lost);
  CHECK_FALSE(n[2]->state.poll().has_value());  // "a" is expected back
  n[0]->state.rejoin(r0[0], 0, first.lost);     // the last survivor: complete at once
  auto ra = n[0]->state.poll();
  REQUIRE(ra);
  REQUIRE(ra->roster.size() == 3);
  CHECK(members(hs, *ra)[0].host == "a");
  CHECK(members(hs, *ra)[1].host == "c");
  CHECK(members(hs, *ra)[2].host == "s");
  auto rs = spare.state.poll();
  REQUIRE(rs);
  CHECK(rs->group_rank == 2);
}

TEST_CASE(
    "C10dState: a member that does not come back within last call is left out and waits as a "
    "newcomer",
    "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  Node a(hs, clock, settings(1, 3), "a", 2s);
  Node b(hs, clock, settings(1, 3), "b", 2s);
  a.state.join();
  b.state.join();
  a.state.poll();
  clock.advance(2s);
  auto r0a = a.state.poll();
  auto r0b = b.state.poll();
  REQUIRE(r0a);
  REQUIRE(r0b);
  C10dRoundWatch w(hs, settings(1, 3), *r0a, 2s, clock.fn());
  w.reform({"test", {}, ""});
  a.state.rejoin(*r0a, 0, {});
  CHECK_FALSE(a.state.poll().has_value());  // b is expected back
  clock.advance(2s);
  auto r1 = a.state.poll();  // last call over: without b
  REQUIRE(r1);
  CHECK(r1->roster.size() == 1);
  b.state.rejoin(*r0b, 0, {});
  CHECK_FALSE(b.state.poll().has_value());
  CHECK(b.state.round() == 2);  // a newcomer of the next round
  CHECK(b.state.waiting());
}

TEST_CASE("C10dState: a round whose workers finish admits nobody", "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  Node a(hs, clock, settings(1, 2), "a", 1s);
  a.state.join();
  a.state.poll();
  clock.advance(1s);
  auto r0 = a.state.poll();
  REQUIRE(r0);
  C10dRoundWatch w(hs, settings(1, 2), *r0, 1s, clock.fn());
  CHECK(a.state.mark_finishing(0));
  Node b(hs, clock, settings(1, 2), "b", 1s);
  b.state.join();
  clock.advance(10s);
  CHECK_FALSE(w.check(0).has_value());
}

TEST_CASE(
    "C10dState: an id closed within the window is refused at once, after it the id is a new "
    "job",
    "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  C10dState a(hs, settings(1, 1), node("a"), timing(1s, 600s), clock.fn(), clock.wall_fn());
  a.join();
  REQUIRE(a.poll());
  a.close("failed");
  clock.advance(599s);
  C10dState early(hs, settings(1, 1), node("b"), timing(1s, 600s), clock.fn(), clock.wall_fn());
  try {
    early.join();
    FAIL("joined a closed job");
  } catch (const JobClosedError& e) {
    CHECK_FALSE(e.while_waiting());
    CHECK(e.outcome() == "failed");
    CHECK_THAT(e.what(), Catch::Contains("ended (failed) 599s ago"));
    CHECK_THAT(e.what(), Catch::Contains("another --rdzv_id"));
  }
  CHECK_FALSE(hs.check({"g0/rdzv/0/node/n2"}));  // the refused node wrote nothing
  clock.advance(1s);
  // Other settings are fine: it is another job.
  C10dState later(hs, settings(1, 2, 4, "new.py"), node("c"), timing(1s, 600s), clock.fn(),
                  clock.wall_fn());
  later.join();
  CHECK(later.generation() == 1);
  later.poll();
  clock.advance(1s);
  auto r = later.poll();
  REQUIRE(r);
  CHECK(r->round == 0);
  CHECK(r->group_rank == 0);
  CHECK(hs.get("generation") == "1");
}

TEST_CASE(
    "C10dState: nodes that disagree on --nnodes, --max_restarts or the entrypoint are "
    "refused, naming both values",
    "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  Node first(hs, clock, settings(2, 2, 3, "train.py"), "a");
  first.state.join();
  auto refuse = [&](C10dSettings s, const std::string& what) {
    Node other(hs, clock, s, "b");
    try {
      other.state.join();
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
  CHECK(hs.tally_count("g0/rdzv/0/joined") == 1);
}

TEST_CASE(
    "C10dState: store requests per node are bounded by a constant whatever the size and a "
    "member that does not build the roster reads the same bytes at 4 and 64 nodes",
    "[unit]") {
  size_t member_bytes_at_4 = 0;
  for (int n : {4, 64}) {
    store::HashStore hs;
    ManualClock clock;
    std::vector<std::unique_ptr<CountingStore>> stores;
    std::vector<std::unique_ptr<C10dState>> nodes;
    for (int i = 0; i < n; ++i) {
      stores.push_back(std::make_unique<CountingStore>(hs));
      nodes.push_back(std::make_unique<C10dState>(*stores.back(), settings(n, n), node("h"),
                                                  timing(1s), clock.fn(), clock.wall_fn()));
    }
    for (auto& s : nodes) s->join();
    size_t member_bytes = 0;
    for (size_t i = 0; i < nodes.size(); ++i) {
      auto r = nodes[i]->poll();
      REQUIRE(r.has_value());
      // The builder writes the full list too.
      CHECK(stores[i]->requests <= (r->builder == nodes[i]->slot() ? 21 : 20));
      if (r->builder != nodes[i]->slot()) {
        member_bytes = std::max(member_bytes, stores[i]->read_bytes);
      }
    }
    // O(runs), not O(N): one run of slots and one of sizes at either size;
    // only the numbers' digits grow.
    if (n == 4) member_bytes_at_4 = member_bytes;
    CHECK(member_bytes > 0);
    CHECK(member_bytes <= member_bytes_at_4 + 16);
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
        C10dState s(hs, settings(kNodes, kNodes), node("h" + std::to_string(i)), timing(1s));
        s.join();
        for (int step = 0; step < 1000; ++step) {
          if (auto r = s.poll()) {
            ranks[static_cast<size_t>(i)] = r->group_rank;
            sizes[static_cast<size_t>(i)] = r->roster.size();
            return;
          }
          try {
            hs.wait({s.wait_key()}, 1000ms);
          } catch (const TimeoutError&) {
          }
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
  Node a(one, clock, settings(1, 1), "a");
  Node b(two, clock, settings(2, 2, 5, "x.py"), "b");
  a.state.join();
  b.state.join();  // different settings, different job: no refusal
  auto r = a.state.poll();
  REQUIRE(r.has_value());
  CHECK(r->roster.size() == 1);
  CHECK_FALSE(b.state.poll().has_value());
}

TEST_CASE("C10dState: an unreadable roster or reform record is a protocol error naming the key",
          "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  Node a(hs, clock, settings(2, 2), "a");
  a.state.join();
  hs.set("g0/rdzv/0/complete", "{\"members\": [{\"slot\": \"n1\", \"host\": 7}]}");
  try {
    a.state.poll();
    FAIL("read a bad roster");
  } catch (const ProtocolError& e) {
    CHECK_THAT(e.what(), Catch::Contains("g0/rdzv/0/complete"));
  }
  store::HashStore hs2;
  Node b(hs2, clock, settings(1, 1), "b");
  b.state.join();
  auto r = b.state.poll();
  REQUIRE(r);
  hs2.set("g0/rdzv/0/reform", "{\"reason\": \"x\", \"lost\": [5]}");
  C10dRoundWatch w(hs2, settings(1, 1), *r, 1s, clock.fn());
  CHECK_THROWS_AS(w.check(0), ProtocolError);
}

TEST_CASE(
    "C10dRoundWatch: a member whose presence key vanished is seen by the next member, which "
    "re-forms without every vanished one",
    "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  std::vector<std::unique_ptr<Node>> n;
  for (const char* h : {"a", "b", "c", "d"}) {
    n.push_back(std::make_unique<Node>(hs, clock, settings(1, 4), h, 3600s));
    n.back()->state.join();
  }
  std::vector<C10dRound> r;
  for (auto& x : n) r.push_back(*x->state.poll());
  std::vector<std::unique_ptr<C10dRoundWatch>> w;
  for (auto& round : r) {
    w.push_back(std::make_unique<C10dRoundWatch>(hs, settings(1, 4), round, 3600s, clock.fn()));
  }
  for (auto& x : w) CHECK_FALSE(x->check(0).has_value());
  // Members 1 and 3 die: the store sets their presence keys' gone markers.
  hs.set(C10dRoundWatch::present_key(0, 0, 1) + "#gone", "1");
  hs.set(C10dRoundWatch::present_key(0, 0, 3) + "#gone", "1");
  // Member 2 watches member 3, member 0 watches member 1: either finds both.
  auto change = w[2]->check(0);
  REQUIRE(change);
  CHECK(change->lost == std::vector<int>{1, 3});
  CHECK(change->cause == "agent exited");
  CHECK(change->reason == "lost nodes 1, 3 (agent exited)");
  auto seen = w[0]->check(0);
  REQUIRE(seen);
  CHECK(seen->lost == change->lost);
  // The survivors come back with no last call.
  n[0]->state.rejoin(r[0], 0, change->lost);
  n[2]->state.rejoin(r[2], 0, change->lost);
  auto r1 = n[0]->state.poll();
  REQUIRE(r1);
  REQUIRE(r1->roster.size() == 2);
  CHECK(members(hs, *r1)[1].host == "c");
}

TEST_CASE(
    "C10dRoundWatch: a member that died after entering, before holding its presence, is seen "
    "by its record's gone marker",
    "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  Node a(hs, clock, settings(2, 2), "a", 3600s);
  Node b(hs, clock, settings(2, 2), "b", 3600s);
  a.state.join();
  b.state.join();
  auto ra = a.state.poll();
  REQUIRE(ra);
  REQUIRE(ra->roster.size() == 2);
  C10dRoundWatch w(hs, settings(2, 2), *ra, 3600s, clock.fn());
  CHECK_FALSE(w.check(0).has_value());
  hs.set("g0/rdzv/0/node/" + ra->roster.slot(1) + "#gone", "1");
  auto change = w.check(0);
  REQUIRE(change);
  CHECK(change->lost == std::vector<int>{1});
  CHECK(change->cause == "agent exited");
}

TEST_CASE(
    "C10dRoundWatch: rank 0's workers' store closing counts node 0 lost while its presence "
    "stands, and not once it was withdrawn",
    "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  Node a(hs, clock, settings(1, 3), "a", 3600s);
  Node b(hs, clock, settings(1, 3), "b", 3600s);
  Node c(hs, clock, settings(1, 3), "c", 3600s);
  a.state.join();
  b.state.join();
  c.state.join();
  auto ra = a.state.poll();
  REQUIRE(ra);
  auto rb = b.state.poll();
  REQUIRE(rb);
  REQUIRE(rb->group_rank == 1);
  const std::string present0 = C10dRoundWatch::present_key(ra->generation, ra->round, 0);
  hs.set(present0, "pid");
  bool closed = false;
  C10dRoundWatch w(hs, settings(1, 3), *rb, 3600s, clock.fn());
  w.set_rank0_probe([&] { return closed; });
  CHECK_FALSE(w.check(0).has_value());

  SECTION("its presence withdrawn first (it left on purpose): nothing") {
    hs.delete_key(present0);
    closed = true;
    CHECK_FALSE(w.check(0).has_value());
  }
  SECTION("its presence still there: node 0 is lost") {
    closed = true;
    auto change = w.check(0);
    REQUIRE(change);
    CHECK(change->lost == std::vector<int>{0});
    CHECK(change->cause == "agent exited");
    CHECK_THAT(change->reason, Catch::Contains("workers' store"));
  }
  SECTION("rank 0's own watch never looks") {
    C10dRoundWatch w0(hs, settings(1, 3), *ra, 3600s, clock.fn());
    w0.set_rank0_probe([] { return true; });
    CHECK_FALSE(w0.check(0).has_value());
  }
}

TEST_CASE(
    "C10dState: an entrant that died or left before its round completed is left out of the "
    "roster, and nothing waits for its record",
    "[unit]") {
  store::HashStore hs;
  // A wait on a record that never comes would end the test (and a real
  // round) with TimeoutError.
  hs.set_timeout(100ms);
  ManualClock clock;
  Node a(hs, clock, settings(2, 5), "a", 5s);
  Node b(hs, clock, settings(2, 5), "b", 5s);
  Node c(hs, clock, settings(2, 5), "c", 5s);
  Node d(hs, clock, settings(2, 5), "d", 5s);
  a.state.join();
  b.state.join();
  c.state.join();
  d.state.join();
  // c dies (its record vanishes with its connection, leaving the gone
  // marker) and d leaves on purpose (its record withdrawn, no marker).
  hs.delete_key("g0/rdzv/0/node/" + c.state.slot());
  hs.set("g0/rdzv/0/node/" + c.state.slot() + "#gone", "1");
  hs.delete_key("g0/rdzv/0/node/" + d.state.slot());
  CHECK_FALSE(a.state.poll().has_value());
  clock.advance(5s);
  auto ra = a.state.poll();
  REQUIRE(ra.has_value());
  REQUIRE(ra->roster.size() == 2);
  CHECK(members(hs, *ra)[0].host == "a");
  CHECK(members(hs, *ra)[1].host == "b");
  auto rb = b.state.poll();
  REQUIRE(rb.has_value());
  CHECK(rb->group_rank == 1);
}

TEST_CASE(
    "C10dState: when the entrants that died leave fewer than MIN, the round waits for more "
    "and then forms",
    "[unit]") {
  store::HashStore hs;
  hs.set_timeout(100ms);
  ManualClock clock;
  Node a(hs, clock, settings(2, 3), "a", 5s);
  Node b(hs, clock, settings(2, 3), "b", 5s);
  a.state.join();
  b.state.join();
  hs.delete_key("g0/rdzv/0/node/" + b.state.slot());
  clock.advance(5s);
  CHECK_FALSE(a.state.poll().has_value());
  CHECK_FALSE(hs.check({"g0/rdzv/0/claim"}));  // the next try is not blocked
  Node c(hs, clock, settings(2, 3), "c", 5s);
  c.state.join();
  clock.advance(5s);
  auto ra = a.state.poll();
  REQUIRE(ra.has_value());
  REQUIRE(ra->roster.size() == 2);
  CHECK(members(hs, *ra)[1].host == "c");
}

TEST_CASE("C10dRoundWatch: a node that died or left while waiting to be admitted re-forms nothing",
          "[unit]") {
  store::HashStore hs;
  hs.set_timeout(100ms);
  ManualClock clock;
  Node a(hs, clock, settings(1, 3), "a", 5s);
  a.state.join();
  a.state.poll();
  clock.advance(5s);
  auto r0 = a.state.poll();
  REQUIRE(r0.has_value());
  C10dRoundWatch watch(hs, settings(1, 3), *r0, 5s, clock.fn());
  Node w(hs, clock, settings(1, 3), "w", 5s);
  w.state.join();
  CHECK(w.state.waiting());
  hs.delete_key("g0/rdzv/1/node/" + w.state.slot());
  clock.advance(5s);
  CHECK_FALSE(watch.check(0).has_value());
  // A live one is admitted.
  Node x(hs, clock, settings(1, 3), "x", 5s);
  x.state.join();
  auto change = watch.check(0);
  REQUIRE(change.has_value());
  CHECK(change->reason == "admitting 1 waiting node");
  a.state.rejoin(*r0, 0, change->lost);
  auto r1 = a.state.poll();
  REQUIRE(r1.has_value());
  REQUIRE(r1->roster.size() == 2);
  CHECK(members(hs, *r1)[1].host == "x");
}

TEST_CASE(
    "C10dRoundWatch: a member that left on purpose is seen by every member, whichever it "
    "watches, and re-formed around",
    "[unit]") {
  store::HashStore hs;
  hs.set_timeout(100ms);
  ManualClock clock;
  std::vector<std::unique_ptr<Node>> n;
  for (const char* h : {"a", "b", "c"}) {
    n.push_back(std::make_unique<Node>(hs, clock, settings(1, 3), h, 3600s));
    n.back()->state.join();
  }
  std::vector<C10dRound> r;
  for (auto& x : n) r.push_back(*x->state.poll());
  std::vector<std::unique_ptr<C10dRoundWatch>> w;
  for (auto& round : r) {
    w.push_back(std::make_unique<C10dRoundWatch>(hs, settings(1, 3), round, 3600s, clock.fn()));
  }
  for (auto& x : w) CHECK_FALSE(x->check(0).has_value());
  // Group rank 0 leaves on purpose: it says so, then withdraws its presence
  // (deleted: no gone marker appears).
  C10dRoundWatch::leave(hs, 0, 0, 0);
  hs.delete_key(C10dRoundWatch::present_key(0, 0, 0));
  // Member 1 watches member 2, not 0: it sees the leave all the same.
  auto change = w[1]->check(0);
  REQUIRE(change.has_value());
  CHECK(change->lost == std::vector<int>{0});
  CHECK(change->cause == "agent left");
  CHECK(change->reason == "node 0 left");
  auto seen = w[2]->check(0);
  REQUIRE(seen.has_value());
  CHECK(seen->lost == std::vector<int>{0});
  n[1]->state.rejoin(r[1], 0, change->lost);
  n[2]->state.rejoin(r[2], 0, change->lost);
  auto r1 = n[2]->state.poll();
  REQUIRE(r1.has_value());
  REQUIRE(r1->roster.size() == 2);
  CHECK(members(hs, *r1)[0].host == "b");
  CHECK(r1->group_rank == 1);
}

TEST_CASE(
    "C10dRoundWatch: entries of the left tally that are no group rank of the round are ignored",
    "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  Node a(hs, clock, settings(2, 2), "a", 3600s);
  Node b(hs, clock, settings(2, 2), "b", 3600s);
  a.state.join();
  b.state.join();
  auto ra = a.state.poll();
  REQUIRE(ra.has_value());
  const std::string left = C10dRoundWatch::left_key(0, 0);
  for (const char* junk : {"2", "-1", "x", "99999999999", ""}) hs.tally_add(left, junk);
  CHECK(C10dRoundWatch::left_members(hs, 0, 0, 2).empty());
  C10dRoundWatch w(hs, settings(2, 2), *ra, 3600s, clock.fn());
  CHECK_FALSE(w.check(0).has_value());
  hs.tally_add(left, "1");
  CHECK(C10dRoundWatch::left_members(hs, 0, 0, 2) == std::vector<int>{1});
}

TEST_CASE(
    "C10dState: a node waiting for a running round whose members all left re-forms it and "
    "forms the next round (a job stopped and started again with the same id)",
    "[unit]") {
  store::HashStore hs;
  hs.set_timeout(100ms);
  ManualClock clock;
  Node a(hs, clock, settings(1, 2), "a", 5s);
  Node b(hs, clock, settings(1, 2), "b", 5s);
  a.state.join();
  b.state.join();
  auto r0 = a.state.poll();
  REQUIRE(r0.has_value());
  REQUIRE(r0->roster.size() == 2);
  // Both members are stopped by a signal: they leave on purpose.
  C10dRoundWatch::leave(hs, 0, 0, 0);
  C10dRoundWatch::leave(hs, 0, 0, 1);
  // The job is started again: a new agent finds the round running at MAX.
  Node c(hs, clock, settings(1, 2), "c", 5s);
  c.state.join();
  std::optional<C10dRound> rc;
  for (int i = 0; i < 6 && !rc; ++i) {
    rc = c.state.poll();
    clock.advance(5s);
  }
  REQUIRE(rc.has_value());
  CHECK(rc->round == 1);
  CHECK(rc->group_rank == 0);
  CHECK(rc->roster.size() == 1);
  const std::string reform = hs.get("g0/rdzv/0/reform");
  CHECK_THAT(reform, Catch::Contains("agent left"));
}

TEST_CASE(
    "C10dState: after a re-formation the round waits for a member that announced it is "
    "stopping its workers, up to its grace plus a margin, instead of last_call_timeout",
    "[unit]") {
  store::HashStore hs;
  hs.set_timeout(100ms);
  ManualClock clock;
  std::vector<std::unique_ptr<Node>> n;
  for (const char* h : {"a", "b", "c"}) {
    n.push_back(std::make_unique<Node>(hs, clock, settings(1, 3), h, 5s));
    n.back()->state.join();
  }
  std::vector<C10dRound> r;
  for (auto& x : n) r.push_back(*x->state.poll());
  REQUIRE(r[0].roster.size() == 3);
  C10dRoundWatch w0(hs, settings(1, 3), r[0], 5s, clock.fn());
  auto change = w0.reform({"node 2 lost", {2}, "heartbeat timeout"});
  n[0]->state.rejoin(r[0], 0, change.lost);
  CHECK_FALSE(n[0]->state.poll().has_value());

  SECTION("it announced 60 s and comes back after 40 s: it is in the round") {
    C10dRoundWatch::announce_stopping(hs, r[1], 60s);
    clock.advance(5s);
    CHECK_FALSE(n[0]->state.poll().has_value());
    CHECK(n[0]->state.until_last_call() > 50s);
    clock.advance(35s);
    CHECK_FALSE(n[0]->state.poll().has_value());
    n[1]->state.rejoin(r[1], 0, change.lost);
    auto ra = n[0]->state.poll();
    REQUIRE(ra.has_value());
    REQUIRE(ra->roster.size() == 2);
    CHECK(members(hs, *ra)[1].host == "b");
  }
  SECTION("it announced 10 s and never comes: the round forms after 10 s plus the margin") {
    C10dRoundWatch::announce_stopping(hs, r[1], 10s);
    clock.advance(5s);
    CHECK_FALSE(n[0]->state.poll().has_value());
    clock.advance(10s + rendezvous::kStoppingMargin - 5s - 1ms);
    CHECK_FALSE(n[0]->state.poll().has_value());
    clock.advance(1ms);
    auto ra = n[0]->state.poll();
    REQUIRE(ra.has_value());
    CHECK(ra->roster.size() == 1);
  }
  SECTION("it announced nothing (or its key vanished with it): last_call_timeout as before") {
    clock.advance(5s);
    auto ra = n[0]->state.poll();
    REQUIRE(ra.has_value());
    CHECK(ra->roster.size() == 1);
  }
}

TEST_CASE("node record: one shape on every backend, read back whole, a peer's bad field refused",
          "[unit]") {
  rendezvous::NodeInfo n;
  n.host = "host7";
  n.pid = 4242;
  n.local_world_size = 8;
  n.hosts_endpoint = true;
  auto back = rendezvous::parse_node_record(rendezvous::node_record(n), "nodes/1");
  CHECK(back.host == "host7");
  CHECK(back.pid == 4242);
  CHECK(back.local_world_size == 8);
  CHECK(back.hosts_endpoint);
  auto refused = [](const std::string& raw) {
    try {
      rendezvous::parse_node_record(nlohmann::json::parse(raw, nullptr, false), "nodes/1");
    } catch (const ProtocolError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  for (const char* raw : {R"(not json)", R"([])", R"({"pid":1,"local_world_size":1})",
                          R"({"host":"h","pid":1,"local_world_size":0})",
                          R"({"host":"h","pid":1,"local_world_size":2000000})",
                          R"({"host":"h","pid":-1,"local_world_size":1})",
                          R"({"host":"h","pid":"1","local_world_size":1})",
                          R"({"host":"h","pid":1,"local_world_size":1,"hosts_endpoint":1})"}) {
    INFO(raw);
    CHECK(refused(raw).find("key 'nodes/1'") != std::string::npos);
  }
  CHECK(refused(R"({"host":")" + std::string(300, 'x') + R"(","pid":1,"local_world_size":1})")
            .find("255") != std::string::npos);
}

TEST_CASE(
    "C10dState: raise_count keeps a register that only grows, in one request when the belief "
    "holds and idempotent when replayed",
    "[unit]") {
  store::HashStore hs;
  CountingStore s(hs);
  const std::string k = C10dState::count_key(0);
  CHECK(k == "g0/rdzv/attempt");
  CHECK(C10dState::read_count(s, k) == 0);  // missing reads 0
  // Missing, believed missing: one compare_set creates it.
  s.requests = 0;
  CHECK(C10dState::raise_count(s, k, 2, 0) == 2);
  CHECK(s.requests == 1);
  CHECK(hs.get(k) == "2");
  // The belief right: one request.
  s.requests = 0;
  CHECK(C10dState::raise_count(s, k, 3, 2) == 3);
  CHECK(s.requests == 1);
  // A replay of the same raise (its answer lost) finds it done, and so does
  // a lower one: nothing moves back.
  s.requests = 0;
  CHECK(C10dState::raise_count(s, k, 3, 2) == 3);
  CHECK(s.requests == 1);
  CHECK(C10dState::raise_count(s, k, 1, 0) == 3);
  CHECK(hs.get(k) == "3");
  // The belief wrong: from the value found.
  s.requests = 0;
  CHECK(C10dState::raise_count(s, k, 5, 1) == 5);
  CHECK(s.requests == 2);
  CHECK(hs.get(k) == "5");
  // Believed there, but missing: created.
  const std::string r = C10dState::restarts_key(0, 4);
  CHECK(r == "g0/r4/restarts");
  CHECK(C10dState::raise_count(s, r, 1, 7) == 1);
  CHECK(C10dState::read_count(s, r) == 1);
  // The round's agents' namespace ("<job>/g<G>/r<R>", RendezvousInfo::store)
  // and the job's name one key.
  auto shared = std::make_shared<store::HashStore>();
  store::PrefixStore job("ctorchrun/x", shared);
  store::PrefixStore round("ctorchrun/x/g0/r4", shared);
  C10dState::raise_count(round, C10dState::kRestartsKey, 2, 0);
  CHECK(C10dState::read_count(job, r) == 2);
  // A peer's garbage is a protocol error naming the key.
  hs.set(k, "many");
  try {
    C10dState::raise_count(s, k, 6, 5);
    FAIL("raised an unreadable count");
  } catch (const ProtocolError& e) {
    CHECK_THAT(e.what(), Catch::Contains(k));
  }
}

TEST_CASE(
    "C10dState: a round formed by newcomers alone takes the job's restart count from the store",
    "[unit]") {
  store::HashStore hs;
  hs.set_timeout(100ms);
  ManualClock clock;
  Node a(hs, clock, settings(2, 3, 3), "a");
  Node c(hs, clock, settings(2, 3, 3), "c");
  a.state.join();
  c.state.join();
  a.state.poll();
  clock.advance(1s);
  auto r0 = a.state.poll();
  REQUIRE(r0);
  REQUIRE(c.state.poll());
  CHECK(r0->attempt == 0);
  // The members' agents exit: their presence keys' gone markers.
  auto lose_members = [&] {
    for (int g = 0; g < 2; ++g) hs.set(C10dRoundWatch::present_key(0, 0, g) + "#gone", "1");
  };
  SECTION("restarts within the round (agent.cc writes them in the round's namespace)") {
    C10dState::raise_count(hs, C10dState::restarts_key(0, 0), 1, 0);
    C10dState::raise_count(hs, C10dState::restarts_key(0, 0), 2, 1);
    lose_members();
  }
  SECTION(
      "a failure charged as the round gave way (a member raises the register as it comes "
      "back)") {
    C10dRoundWatch(hs, settings(2, 3, 3), *r0, 1s, clock.fn()).reform({"test", {}, ""});
    a.state.rejoin(*r0, 2, {});
    CHECK(hs.get(C10dState::count_key(0)) == "2");
    // It dies before the next round forms (its record goes), and c never
    // comes back.
    hs.delete_key(C10dState::round_key(0, 1, "node/m0"));
    lose_members();
  }
  // Newcomers form the next round (MIN 2) without them.
  C10dState b(hs, settings(2, 3, 3), node("b"), timing(1s), clock.fn(), clock.wall_fn(), &hs);
  C10dState d(hs, settings(2, 3, 3), node("d"), timing(1s), clock.fn(), clock.wall_fn(), &hs);
  b.join();
  d.join();
  std::optional<C10dRound> r;
  for (int i = 0; i < 10 && !r; ++i, clock.advance(1s)) r = b.poll();
  REQUIRE(r);
  CHECK(r->roster.size() == 2);
  CHECK(members(hs, *r)[0].host == "b");
  CHECK(r->attempt == 2);
  CHECK(hs.get(C10dState::count_key(0)) == "2");
  // The roster carries it: every reader agrees.
  auto roster = nlohmann::json::parse(hs.get(C10dState::round_key(0, r->round, "complete")));
  CHECK(roster.at("attempt") == 2);
  auto rd = d.poll();
  REQUIRE(rd);
  CHECK(rd->attempt == 2);
}

TEST_CASE(
    "C10dRoundWatch: an admission made while a member it does not watch is lost names that "
    "member and the failure the loss caused is not charged",
    "[unit]") {
  // Found by the rendezvous simulation (seed 9054 of 20000): member 0
  // watches member 1's presence; member 2 died and its peers' workers
  // failed, and member 0 took the admission gate first: the round gave way
  // naming nobody lost and the failure was charged.
  store::HashStore hs;
  ManualClock clock;
  std::vector<std::unique_ptr<Node>> n;
  for (const char* h : {"a", "b", "c"}) {
    n.push_back(std::make_unique<Node>(hs, clock, settings(3, 4), h, 5s));
    n.back()->state.join();
  }
  n[0]->state.poll();
  clock.advance(5s);
  std::vector<C10dRound> r;
  for (auto& x : n) {
    auto got = x->state.poll();
    REQUIRE(got);
    r.push_back(*got);
  }
  for (auto& round : r) {
    hs.set(C10dRoundWatch::present_key(0, 0, round.group_rank), "1");
  }
  C10dRoundWatch w0(hs, settings(3, 4), r[0], 5s, clock.fn());
  Node late(hs, clock, settings(3, 4), "late", 5s);
  late.state.join();
  CHECK(late.state.waiting());
  clock.advance(5s);
  // Member 2's agent exits: its presence goes, the gone marker appears.
  hs.delete_key(C10dRoundWatch::present_key(0, 0, 2));
  hs.set(C10dRoundWatch::present_key(0, 0, 2) + "#gone", "1");
  auto change = w0.check(0);
  REQUIRE(change);
  CHECK(change->lost == std::vector<int>{2});
  CHECK(change->cause == "agent exited");
  CHECK(change->reason == "lost node 2 (agent exited); admitting 1 waiting node");
  // The admission still happens: the waiting node enters the next round
  // with the members that come back.
  n[0]->state.rejoin(r[0], 0, change->lost);
  n[1]->state.rejoin(r[1], 0, change->lost);
  std::optional<C10dRound> r1;
  for (int i = 0; i < 10 && !r1; ++i, clock.advance(1s)) r1 = late.state.poll();
  REQUIRE(r1);
  CHECK(r1->roster.size() == 3);
  CHECK(members(hs, *r1)[2].host == "late");
}

TEST_CASE(
    "C10dState: a member lost between the roster's publication and another's read still has "
    "its place and its record in the member list",
    "[unit]") {
  auto hs = std::make_shared<store::HashStore>();
  ManualClock clock;
  std::vector<std::shared_ptr<testing::BoundKeyStore>> presence;
  std::vector<std::unique_ptr<C10dState>> nodes;
  const std::vector<int> sizes{4, 2, 4};
  for (int i = 0; i < 3; ++i) {
    presence.push_back(std::make_shared<testing::BoundKeyStore>(hs));
    nodes.push_back(std::make_unique<C10dState>(
        *hs, settings(3, 3),
        node(std::string(1, static_cast<char>('a' + i)), sizes[size_t(i)], 100 + i), timing(1s),
        clock.fn(), clock.wall_fn(), presence.back().get()));
  }
  for (auto& n : nodes) n->join();
  // The third entrant completed the round; b dies before a reads it.
  auto rc = nodes[2]->poll();
  REQUIRE(rc.has_value());
  presence[1]->kill();
  CHECK_FALSE(hs->check({"g0/rdzv/0/node/" + nodes[1]->slot()}));
  auto ra = nodes[0]->poll();
  REQUIRE(ra.has_value());
  CHECK(ra->group_rank == 0);
  CHECK(ra->roster.size() == 3);
  CHECK(ra->roster.world_size() == 10);
  CHECK(ra->roster.first_rank(2) == 6);
  CHECK(rc->group_rank == 2);
  CHECK(ra->node0.host == "a");
  CHECK(ra->node0.pid == 100);
  // The list names b still (events of its loss need its host and pid).
  const auto list = members(*hs, *ra);
  REQUIRE(list.size() == 3);
  CHECK(list[1].host == "b");
  CHECK(list[1].pid == 101);
  CHECK(list[1].local_world_size == 2);
  // The watch sees b lost through its record's gone marker and re-forms.
  C10dRoundWatch watch(*hs, settings(3, 3), *ra, 1s, clock.fn());
  auto change = watch.check(0);
  REQUIRE(change.has_value());
  CHECK(change->lost == std::vector<int>{1});
  // A member list that does not match the roster is refused.
  hs->set(C10dState::round_key(0, 0, "members/" + ra->builder), "[]");
  CHECK_THROWS_AS(members(*hs, *ra), ProtocolError);
}

TEST_CASE(
    "C10dState: a stale roster claim is taken over by one node at a time and a fresh "
    "takeover gets its own claim_timeout",
    "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  // A claimant that went silent before the round completed.
  hs.set("g0/rdzv/0/claim", "n9");
  Node a(hs, clock, settings(3, 3), "a");
  Node b(hs, clock, settings(3, 3), "b");
  Node c(hs, clock, settings(3, 3), "c");
  a.state.join();
  b.state.join();
  c.state.join();
  CHECK_FALSE(a.state.poll().has_value());
  CHECK_FALSE(b.state.poll().has_value());
  clock.advance(11s);  // past claim_timeout (10 s)
  // Another node took the stale claim over meanwhile: a waits for it rather
  // than building the roster as well.
  hs.set("g0/rdzv/0/claim", "n8");
  CHECK_FALSE(a.state.poll().has_value());
  CHECK_FALSE(hs.check({"g0/rdzv/0/complete"}));
  CHECK(hs.get("g0/rdzv/0/claim") == "n8");
  // That one went silent too: a takes it over and builds the roster.
  clock.advance(11s);
  auto ra = a.state.poll();
  REQUIRE(ra.has_value());
  CHECK(ra->builder == a.state.slot());
  CHECK(hs.get("g0/rdzv/0/claim") == a.state.slot());
  auto rb = b.state.poll();
  REQUIRE(rb.has_value());
  CHECK(rb->roster == ra->roster);
}

TEST_CASE("C10dState: a member list removed from the store is an error at once, not a wait",
          "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  Node a(hs, clock, settings(1, 1), "a");
  a.state.join();
  auto r = a.state.poll();
  REQUIRE(r.has_value());
  REQUIRE(members(hs, *r).size() == 1);
  hs.delete_key(C10dState::round_key(0, 0, "members/" + r->builder));
  // HashStore's get would wait for the key: read_members must not.
  CHECK_THROWS_AS(members(hs, *r), ProtocolError);
}

TEST_CASE(
    "C10dState and C10dRoundWatch: a record tidied away between two of their calls never leaves "
    "a read waiting for it",
    "[unit]") {
  // The last node of an etcd job deletes the job's keys as it leaves, while
  // the others still watch the round or wait as spares: a read that waited
  // for a key that went would hold them for the store's timeout (minutes).
  auto hs = std::make_shared<store::HashStore>();
  testing::FaultStore fs(hs);
  fs.refuse_waiting_reads(true);
  ManualClock clock;
  Node a(*hs, clock, settings(1, 2), "a", 1s);
  Node b(fs, clock, settings(1, 2), "b", 1s);
  a.state.join();
  b.state.join();
  auto ra = a.state.poll();
  auto rb = b.state.poll();
  REQUIRE(ra);
  REQUIRE(rb);
  // A member's watch: the reform record goes right after the call that saw it.
  C10dRoundWatch wa(*hs, settings(1, 2), *ra, 1s, clock.fn());
  C10dRoundWatch wb(fs, settings(1, 2), *rb, 1s, clock.fn());
  rendezvous::MembershipChange change;
  change.reason = "lost node 0 (agent exited)";
  change.lost = {0};
  change.cause = "agent exited";
  wa.reform(change);
  fs.vanish_after(testing::FaultStore::Op::kCheck, "reform");
  fs.vanish_after(testing::FaultStore::Op::kCompareSet, "reform");
  std::optional<rendezvous::MembershipChange> seen;
  REQUIRE_NOTHROW(seen = wb.check(0));
  REQUIRE(seen);
  CHECK(seen->reason == change.reason);
  CHECK(seen->lost == std::vector<int>{0});
  // A spare: the closed marker goes right after the call that saw it.
  auto hs2 = std::make_shared<store::HashStore>();
  testing::FaultStore fs2(hs2);
  fs2.refuse_waiting_reads(true);
  Node m(*hs2, clock, settings(1, 1), "m", 1s);
  Node spare(fs2, clock, settings(1, 1), "s", 1s);
  m.state.join();
  REQUIRE(m.state.poll());
  spare.state.join();
  CHECK_FALSE(spare.state.poll().has_value());
  CHECK(m.state.close("succeeded") == 1);
  fs2.vanish_after(testing::FaultStore::Op::kCheck, "closed");
  fs2.vanish_after(testing::FaultStore::Op::kCompareSet, "closed");
  try {
    spare.state.poll();
    FAIL("the spare did not see the end");
  } catch (const JobClosedError& e) {
    CHECK(e.outcome() == "succeeded");
  }
  std::string list;
  for (const auto& k : fs.refused_reads()) list += k + " ";
  for (const auto& k : fs2.refused_reads()) list += k + " ";
  INFO("waiting reads of missing keys: " << list);
  CHECK(fs.refused_reads().empty());
  CHECK(fs2.refused_reads().empty());
}

TEST_CASE(
    "C10dState: an entrypoint and host names that are not UTF-8 are kept byte for byte in the "
    "records",
    "[unit]") {
  store::HashStore hs;
  ManualClock clock;
  // Same bytes join; bytes that differ only where they are not UTF-8 are a
  // different entrypoint, refused.
  Node first(hs, clock, settings(2, 3, 0, "tr\xff.py"), "a\xff");
  REQUIRE_NOTHROW(first.state.join());
  Node same(hs, clock, settings(2, 3, 0, "tr\xff.py"), "b\xfe");
  REQUIRE_NOTHROW(same.state.join());
  Node other(hs, clock, settings(2, 3, 0, "tr\xfe.py"), "c");
  try {
    other.state.join();
    FAIL("joined with a different entrypoint");
  } catch (const ConfigError& e) {
    CHECK_THAT(e.what(), Catch::Contains("--entrypoint"));
  }
  CHECK(hs.tally_count("g0/rdzv/0/joined") == 2);
}
