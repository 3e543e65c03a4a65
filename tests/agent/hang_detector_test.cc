// --hang_timeout's pure parts and HangDetector against an in-memory store,
// with a manual clock and scripted progress samples: a job is hung only when
// every worker of every node stalled for the timeout.

#include "agent/hang_detector.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "agent/hang_diagnosis.h"
#include "agent/protocol.h"
#include "common/error.h"
#include "store/hash_store.h"

using namespace ctorchrun;
using namespace ctorchrun::agent;
using namespace std::chrono_literals;

namespace {

NodeStall stall(int node, int64_t stalled_ms, std::vector<RankStall> ranks) {
  NodeStall s;
  s.node = node;
  s.stalled_ms = stalled_ms;
  s.ranks = std::move(ranks);
  return s;
}

bool eventually(const std::function<bool()>& cond, std::chrono::milliseconds limit = 5s) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (cond()) return true;
    std::this_thread::sleep_for(2ms);
  }
  return cond();
}

// A manual clock and scripted per-pid progress shared by the detectors of a test.
struct World {
  std::atomic<int64_t> ms{1'000'000};
  std::mutex mutex;
  std::map<pid_t, uint64_t> ticks;
  std::map<pid_t, int64_t> sampled_at;  // the clock when each pid was last sampled
  std::shared_ptr<store::HashStore> store = std::make_shared<store::HashStore>();

  void progress(pid_t pid) {
    std::lock_guard<std::mutex> lock(mutex);
    ++ticks[pid];
  }
  HangOptions options(int node, int nnodes) {
    HangOptions o;
    o.timeout = 5s;
    o.node = node;
    o.nnodes = nnodes;
    o.decides = node == 0;
    o.sample_interval = 2ms;
    o.publish_interval = 10ms;
    o.now = [this] { return std::chrono::steady_clock::time_point(std::chrono::milliseconds(ms)); };
    o.wall_now = [this] {
      return std::chrono::system_clock::time_point(std::chrono::milliseconds(ms));
    };
    o.sample = [this](pid_t pid, const std::vector<std::string>&) {
      std::lock_guard<std::mutex> lock(mutex);
      sampled_at[pid] = ms;
      worker::ProgressSample s;
      s.alive = true;
      s.main_thread_ticks = ticks[pid];
      return s;
    };
    return o;
  }
  std::function<std::shared_ptr<store::Store>()> connect() {
    return [s = store] { return s; };
  }
  // Waits until every watched pid was sampled at the current time, then a
  // little more, so that the detectors acted on those samples.
  void settle() {
    const int64_t now = ms;
    REQUIRE(eventually([&] {
      std::lock_guard<std::mutex> lock(mutex);
      for (pid_t p : {100, 101, 200, 201}) {
        if (sampled_at[p] != now) return false;
      }
      return true;
    }));
    std::this_thread::sleep_for(20ms);
  }
};

}  // namespace

TEST_CASE("hang: a node's stall record survives the store and hostile ones are refused", "[unit]") {
  NodeStall s = stall(1, 5200, {{2, 0, 100, 1000}, {3, 1, 101, 900}});
  NodeStall back = NodeStall::from_json(s.to_json(), 1, "k");
  CHECK(back.stalled_ms == 5200);
  REQUIRE(back.ranks.size() == 2);
  CHECK(back.ranks[1].rank == 3);
  CHECK(back.ranks[1].since_ms == 900);
  CHECK_THROWS_AS(NodeStall::from_json("[]", 1, "k"), ProtocolError);
  CHECK_THROWS_AS(NodeStall::from_json(R"({"stalled_ms": -1, "ranks": []})", 1, "k"),
                  ProtocolError);
  CHECK_THROWS_AS(NodeStall::from_json(R"({"stalled_ms": 1, "ranks": [{"rank": "x"}]})", 1, "k"),
                  ProtocolError);
  CHECK_THROWS_WITH(NodeStall::from_json("nope", 1, "attempt/0/stall/1"),
                    Catch::Contains("attempt/0/stall/1"));
}

TEST_CASE("hang: the verdict needs every node stalled for the timeout and names the first stall",
          "[unit]") {
  const std::vector<std::string> hosts = {"a", "b"};
  std::vector<std::optional<NodeStall>> nodes = {
      stall(0, 5000, {{0, 0, 10, 2000}, {1, 1, 11, 2100}}),
      stall(1, 6000, {{2, 0, 12, 2050}, {3, 1, 13, 1500}})};
  auto v = decide_hang(nodes, 5s, hosts, 4);
  REQUIRE(v);
  CHECK(v->hang);
  CHECK(v->cause() == "hang");
  CHECK(v->rank == 3);
  CHECK(v->node_rank == 1);
  CHECK(v->host == "b");
  CHECK(v->pid == 13);
  CHECK(v->attempt == 4);
  CHECK(FailureRecord::from_json(v->to_json()).hang);

  SECTION("one node short of the timeout keeps the job alive") {
    nodes[0]->stalled_ms = 4999;
    CHECK_FALSE(decide_hang(nodes, 5s, hosts, 4));
  }
  SECTION("a node not heard from keeps the job alive") {
    nodes[1].reset();
    CHECK_FALSE(decide_hang(nodes, 5s, hosts, 4));
  }
  SECTION("equal stall starts name the lower rank") {
    nodes[1]->ranks[1].since_ms = 2000;
    CHECK(decide_hang(nodes, 5s, hosts, 4)->rank == 0);
  }
  SECTION("a node whose workers finished counts as stalled but is never the one named") {
    nodes[1]->finished = true;  // its rank 3 stalled first, by finishing
    auto named = decide_hang(nodes, 5s, hosts, 4);
    REQUIRE(named);
    CHECK(named->node_rank == 0);
    auto again = NodeStall::from_json(nodes[1]->to_json(), 1, "k");
    CHECK(again.finished);
    CHECK_FALSE(NodeStall::from_json(nodes[0]->to_json(), 0, "k").finished);
  }
}

TEST_CASE("hang: two nodes' detectors declare a hang only once every worker stalled", "[unit]") {
  World w;
  const std::vector<std::string> hosts = {"h0", "h1"};
  HangDetector d0(w.connect(), w.options(0, 2));
  HangDetector d1(w.connect(), w.options(1, 2));
  d0.watch(0, {{0, 0, 100, {}}, {1, 1, 101, {}}}, hosts);
  d1.watch(0, {{2, 0, 200, {}}, {3, 1, 201, {}}}, hosts);
  w.settle();
  // Rank 3 stalls first; the others move for 2 s more, then stall too.
  for (int i = 0; i < 4; ++i) {
    w.ms += 500;
    for (pid_t p : {100, 101, 200}) w.progress(p);
    w.settle();
  }
  const int64_t last_move = w.ms;
  REQUIRE(eventually([&] { return w.store->check({keys::stall(0, 1)}); }));
  w.ms = last_move + 4'900;
  w.settle();
  CHECK_FALSE(w.store->check({keys::failure(0)}));
  REQUIRE(d1.local_verdict());
  CHECK(d1.local_verdict()->stalled_ms < 5000);

  SECTION("one rank moving on one node is no hang") {
    w.progress(201);
    w.ms = last_move + 8'000;
    w.settle();
    w.ms = last_move + 9'000;
    w.settle();
    CHECK_FALSE(w.store->check({keys::failure(0)}));
  }
  SECTION("every worker still at the timeout is a hang naming rank 3") {
    w.ms = last_move + 5'000;
    REQUIRE(eventually([&] { return w.store->check({keys::failure(0)}); }));
    auto f = FailureRecord::from_json(w.store->get(keys::failure(0)));
    CHECK(f.hang);
    CHECK(f.rank == 3);
    CHECK(f.node_rank == 1);
    CHECK(f.host == "h1");
    REQUIRE(d0.last_progress());
    CHECK(std::chrono::duration_cast<std::chrono::milliseconds>(
              d0.last_progress()->time_since_epoch())
              .count() == last_move);
  }
  SECTION("a failure written first stands") {
    FailureRecord crash;
    crash.rank = 1;
    crash.exit_code = 3;
    w.store->set(keys::failure(0), crash.to_json());
    w.ms = last_move + 6'000;
    w.settle();
    CHECK_FALSE(FailureRecord::from_json(w.store->get(keys::failure(0))).hang);
  }
  SECTION("the next attempt's workers are sampled again after a finished one") {
    d0.finished();  // as before an exit barrier that then gives way to a new round
    d0.watch(1, {{0, 0, 100, {}}, {1, 1, 101, {}}}, hosts);
    d1.watch(1, {{2, 0, 200, {}}, {3, 1, 201, {}}}, hosts);
    w.settle();
    const int64_t start = w.ms;
    for (int i = 0; i < 12; ++i) {  // rank 0 keeps moving for 6 s
      w.ms += 500;
      w.progress(100);
      w.settle();
    }
    REQUIRE(d0.local_verdict());
    CHECK(d0.local_verdict()->stalled_ms < 1000);
    CHECK_FALSE(d0.local_verdict()->finished);
    CHECK(w.ms - start >= 6000);
    CHECK_FALSE(w.store->check({keys::failure(1)}));
  }
  SECTION("workers being stopped are not watched: no verdict") {
    d0.unwatch();
    d1.unwatch();
    // Nothing is sampled any more: real time passes instead.
    std::this_thread::sleep_for(50ms);
    w.ms = last_move + 60'000;
    std::this_thread::sleep_for(100ms);
    CHECK_FALSE(w.store->check({keys::failure(0)}));
  }
}

TEST_CASE("hang: the innermost frame of the main thread is read from CPython's output", "[unit]") {
  const std::string faulthandler =
      "Fatal Python error: Aborted\n\n"
      "Thread 0x00007f (most recent call first):\n"
      "  File \"/usr/lib/python3.11/threading.py\", line 324 in wait\n"
      "  File \"/usr/lib/python3.11/threading.py\", line 995 in _bootstrap\n\n"
      "Current thread 0x00007e (most recent call first):\n"
      "  File \"/x/distributed_c10d.py\", line 1541 in all_reduce\n"
      "  File \"/nonexistent/train.py\", line 57 in <module>\n\n"
      "Extension modules: torch (total: 1)\n";
  CHECK(innermost_python_frame(faulthandler) == "all_reduce at distributed_c10d.py:1541");
  const std::string traceback =
      "Traceback (most recent call last):\n"
      "  File \"/nonexistent/train.py\", line 57, in <module>\n"
      "    main()\n"
      "  File \"/nonexistent/train.py\", line 12, in main\n"
      "    dist.all_reduce(t)\n"
      "RuntimeError: Connection closed by peer\n";
  CHECK(innermost_python_frame(traceback) == "main at train.py:12");
  CHECK(innermost_python_frame("nothing here\n") == "");
  CHECK(group_frames({{3, "sleep at w.py:9"},
                      {0, "a at d.py:1"},
                      {2, "a at d.py:1"},
                      {1, "a at d.py:1"},
                      {5, ""}}) ==
        "ranks 0-2 in a at d.py:1; rank 3 in sleep at w.py:9; rank 5 in an unknown frame");
  CHECK(group_frames({{0, "f"}, {2, "f"}, {3, "f"}}) == "ranks 0,2-3 in f");
}

TEST_CASE("hang: a peer's unreadable stall record never makes a verdict", "[unit]") {
  World w;
  HangDetector d0(w.connect(), w.options(0, 2));
  d0.watch(0, {{0, 0, 100, {}}, {1, 1, 101, {}}, {2, 2, 200, {}}, {3, 3, 201, {}}}, {"h0", "h1"});
  w.settle();
  w.store->set(keys::stall(0, 1), R"({"stalled_ms": "forever", "ranks": []})");
  w.ms += 10'000;
  w.settle();
  w.ms += 1'000;
  w.settle();
  CHECK_FALSE(w.store->check({keys::failure(0)}));
  // A readable record that says node 1 stalled too: the verdict follows.
  w.store->set(keys::stall(0, 1), stall(1, 9'000, {{4, 0, 300, 1}}).to_json());
  REQUIRE(eventually([&] { return w.store->check({keys::failure(0)}); }));
  CHECK(FailureRecord::from_json(w.store->get(keys::failure(0))).rank == 4);
}
