// libctorch_dist used from several threads of one rank, Work handles of send
// and recv that fail, time out or are dropped, and calls that differ across
// ranks; ranks are threads (tests/collectives/dist_thread_ranks.h). A binary of its own that needs
// only ctorchrun::dist, so that a sanitizer build can build just this one.

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collectives/op_queue.h"
#include "collectives/process_group.h"
#include "common/error.h"
#include "store/hash_store.h"
#include "tests/collectives/dist_thread_ranks.h"

namespace dist = ctorchrun::dist;
using dist::testing::ms_since;
using dist::testing::options_for;
using dist::testing::RankResult;
using dist::testing::run_ranks;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

namespace {

// Both ranks keep their groups until each has reached `name`.
void rendezvous(ctorchrun::store::Store& store, int rank, const std::string& name) {
  store.set(name + "/" + std::to_string(rank), "1");
  store.wait({name + "/0", name + "/1"}, milliseconds(20000));
}

// Runs body on `n` threads and joins them; the first exception (by what()) or "".
std::string on_threads(int n, const std::function<void(int)>& body) {
  std::mutex mutex;
  std::string first;
  std::vector<std::thread> threads;
  for (int t = 0; t < n; ++t) {
    threads.emplace_back([&, t] {
      try {
        body(t);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mutex);
        if (first.empty()) first = e.what();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  return first;
}

}  // namespace

// Each blocking call takes its place in the group's order on entry; the
// calls must then run in that order on every rank, whichever thread wakes
// first, or the ranks wait for each other's next tag until the timeout.
TEST_CASE("dist threads: blocking all_reduces from two threads of each rank run in call order",
          "[net]") {
  auto store = std::make_shared<ctorchrun::store::HashStore>();
  constexpr int kIterations = 200;
  auto results = run_ranks({0, 1}, [&](int rank, RankResult& out) {
    auto pg = dist::init_process_group(options_for(rank, 2, store, milliseconds(5000)));
    std::mutex mutex;
    int wrong = 0, done = 0;
    const std::string error = on_threads(2, [&](int) {
      for (int i = 0; i < kIterations; ++i) {
        // Identical on both threads: the pairing of calls across ranks is
        // undefined, only their order per rank is fixed.
        std::vector<float> v(16, static_cast<float>(rank + 1));
        pg->all_reduce(dist::make_buffer(v.data(), v.size()));
        std::lock_guard<std::mutex> lock(mutex);
        ++done;
        if (v.front() != 3.0f || v.back() != 3.0f) ++wrong;
      }
    });
    if (!error.empty()) throw ctorchrun::IoError(error);
    if (wrong > 0) throw ctorchrun::IoError(std::to_string(wrong) + " sums were wrong");
    out.value = done;
  });
  for (const auto& r : results) {
    INFO(r.error);
    CHECK(r.error.empty());
    CHECK(r.value == 2 * kIterations);
  }
}

// A blocking call from a second thread waits for the async ones queued
// before it, and async calls queued after it wait for it.
TEST_CASE("dist threads: blocking and async calls of two threads interleave in call order",
          "[net]") {
  auto store = std::make_shared<ctorchrun::store::HashStore>();
  auto results = run_ranks({0, 1}, [&](int rank, RankResult& out) {
    auto pg = dist::init_process_group(options_for(rank, 2, store, milliseconds(5000)));
    std::mutex mutex;
    int right = 0;
    const std::string error = on_threads(2, [&](int t) {
      for (int i = 0; i < 50; ++i) {
        std::vector<int64_t> a(8, rank + 1), b(8, rank + 1);
        if (t == 0) {
          auto w1 = pg->all_reduce_async(dist::make_buffer(a.data(), a.size()));
          auto w2 = pg->all_reduce_async(dist::make_buffer(b.data(), b.size()));
          w2->wait();
          w1->wait();
        } else {
          pg->all_reduce(dist::make_buffer(a.data(), a.size()));
          pg->all_reduce(dist::make_buffer(b.data(), b.size()));
        }
        std::lock_guard<std::mutex> lock(mutex);
        if (a.back() == 3 && b.back() == 3) ++right;
      }
    });
    if (!error.empty()) throw ctorchrun::IoError(error);
    out.value = right;
  });
  for (const auto& r : results) {
    INFO(r.error);
    CHECK(r.error.empty());
    CHECK(r.value == 100);
  }
}

TEST_CASE("dist p2p: wait with a timeout reports a peer that failed as such", "[net]") {
  auto store = std::make_shared<ctorchrun::store::HashStore>();
  std::string error;
  bool is_timeout = true, is_io = false;
  long wait_ms = -1;
  auto results = run_ranks({0, 1}, [&](int rank, RankResult&) {
    auto pg = dist::init_process_group(options_for(rank, 2, store, milliseconds(20000)));
    pg->barrier();
    if (rank == 0) {
      int64_t token = 0;
      auto work = pg->recv_async(dist::make_buffer(&token, 1), 1, 4);
      store->set("posted", "1");
      const auto start = Clock::now();
      try {
        work->wait(milliseconds(15000));
      } catch (const ctorchrun::TimeoutError& e) {
        error = e.what();
      } catch (const ctorchrun::IoError& e) {
        error = e.what();
        is_timeout = false;
        is_io = true;
      }
      wait_ms = ms_since(start);
    } else {
      // Rank 1 goes away without sending: its connections close.
      store->wait({"posted"}, milliseconds(20000));
      pg.reset();
    }
  });
  REQUIRE(results[0].error.empty());
  REQUIRE(results[1].error.empty());
  INFO(error);
  CHECK_FALSE(is_timeout);
  CHECK(is_io);
  CHECK_THAT(error, Catch::Contains("recv of 1 int64") && Catch::Contains("from rank 1"));
  CHECK(wait_ms < 10000);
}

// Another thread already in wait() does not hold up a wait(timeout) either.
TEST_CASE("dist p2p: a wait that times out leaves the recv running, it completes later", "[net]") {
  const bool other_waiter = GENERATE(false, true);
  INFO("another thread in wait(): " << other_waiter);
  auto store = std::make_shared<ctorchrun::store::HashStore>();
  std::string early, other_error = "not run";
  bool early_is_timeout = false;
  long early_ms = -1;
  int64_t received = 0;
  auto results = run_ranks({0, 1}, [&](int rank, RankResult&) {
    auto pg = dist::init_process_group(options_for(rank, 2, store, milliseconds(10000)));
    pg->barrier();
    if (rank == 0) {
      auto work = pg->recv_async(dist::make_buffer(&received, 1), 1, 6);
      std::thread other;
      if (other_waiter) {
        other = std::thread([&] {
          try {
            work->wait();
            other_error.clear();
          } catch (const std::exception& e) {
            other_error = e.what();
          }
        });
      }
      const auto start = Clock::now();
      try {
        work->wait(milliseconds(50));
      } catch (const ctorchrun::TimeoutError& e) {
        early = e.what();
        early_is_timeout = true;
      }
      early_ms = ms_since(start);
      store->set("waited", "1");
      work->wait();
      if (other.joinable()) other.join();
    } else {
      store->wait({"waited"}, milliseconds(20000));
      int64_t token = 77;
      pg->send(dist::make_buffer(&token, 1), 0, 6);
    }
    // The group is still whole.
    float x = 1;
    pg->all_reduce(dist::make_buffer(&x, 1));
    if (x != 2.0f) throw ctorchrun::IoError("all_reduce after the p2p gave " + std::to_string(x));
  });
  INFO(results[0].error);
  INFO(results[1].error);
  REQUIRE(results[0].error.empty());
  REQUIRE(results[1].error.empty());
  CHECK(early_is_timeout);
  CHECK_THAT(early, Catch::Contains("recv of 1 int64") && Catch::Contains("still running"));
  CHECK(early_ms < 5000);
  CHECK(received == 77);
  if (other_waiter) CHECK(other_error.empty());
}

// gloo cannot take back one posted send or recv: dropping its Work closes
// the group's connections, at once, instead of waiting up to the op's
// timeout for a match; later calls on either rank fail.
TEST_CASE("dist p2p: dropping the Work of an unmatched send or recv returns at once", "[net]") {
  const bool send = GENERATE(true, false);
  INFO((send ? "send" : "recv"));
  auto store = std::make_shared<ctorchrun::store::HashStore>();
  long drop_ms = -1;
  std::string after[2];
  auto results = run_ranks({0, 1}, [&](int rank, RankResult& out) {
    // gloo alone: on the shared-memory path the barrier below does not go
    // through the closed connections and succeeds (work.h).
    auto options = options_for(rank, 2, store, milliseconds(8000));
    options.shm = false;
    auto pg = dist::init_process_group(options);
    pg->barrier();
    if (rank == 0) {
      std::vector<float> data(4, 1.0f);
      const auto start = Clock::now();
      {
        auto buffer = dist::make_buffer(data.data(), data.size());
        auto work = send ? pg->send_async(buffer, 1, 2) : pg->recv_async(buffer, 1, 2);
      }
      drop_ms = ms_since(start);
    }
    rendezvous(*store, rank, "dropped");
    const auto start = Clock::now();
    try {
      pg->barrier(milliseconds(8000));
    } catch (const ctorchrun::Error& e) {
      after[rank] = e.what();
    }
    out.value = static_cast<double>(ms_since(start));
    rendezvous(*store, rank, "done");
  });
  REQUIRE(results[0].error.empty());
  REQUIRE(results[1].error.empty());
  CHECK(drop_ms >= 0);
  CHECK(drop_ms < 2000);
  INFO(after[0]);
  INFO(after[1]);
  CHECK_THAT(after[0], Catch::Contains("barrier") &&
                           Catch::Contains(send ? "send of 4 float32" : "recv of 4 float32") &&
                           Catch::Contains("dropped"));
  CHECK_FALSE(after[1].empty());
  CHECK(results[0].value < 5000);
  CHECK(results[1].value < 5000);
}

// The counter behind subgroup ids (and so their store keys) is shared by
// every thread that calls new_group.
TEST_CASE("dist groups: new_group from several threads at once gives distinct groups", "[net]") {
  auto store = std::make_shared<ctorchrun::store::HashStore>();
  constexpr int kThreads = 4, kGroups = 10;
  auto results = run_ranks({0, 1}, [&](int rank, RankResult& out) {
    auto pg = dist::init_process_group(options_for(rank, 2, store, milliseconds(10000)));
    std::mutex mutex;
    int right = 0;
    const std::string error = on_threads(kThreads, [&](int) {
      for (int i = 0; i < kGroups; ++i) {
        auto sub = pg->new_group({0, 1});
        int64_t v = rank + 1;
        sub->all_reduce(dist::make_buffer(&v, 1));
        std::lock_guard<std::mutex> lock(mutex);
        if (v == 3) ++right;
      }
    });
    if (!error.empty()) throw ctorchrun::IoError(error);
    out.value = right;
  });
  for (const auto& r : results) {
    INFO(r.error);
    CHECK(r.error.empty());
    CHECK(r.value == kThreads * kGroups);
  }
  // Ids 0 .. N-1, each taken once per rank (a repeated id would leave a gap).
  const std::string prefix = "ctorch_dist/attempt_0/pg_1/group_";
  for (int id = 0; id < kThreads * kGroups; ++id) {
    INFO("group " << id);
    CHECK(store->check({prefix + std::to_string(id) + "/arrived/0"}));
    CHECK(store->check({prefix + std::to_string(id) + "/arrived/1"}));
  }
  CHECK_FALSE(store->check({prefix + std::to_string(kThreads * kGroups) + "/ranks"}));
}

// The per-call check of the gloo backend: every rank sees every rank's call,
// so all throw the same error, name each distinct call once, and stay in step.
TEST_CASE("dist mismatch: three ranks with different broadcast roots all fail, naming each call",
          "[net]") {
  auto store = std::make_shared<ctorchrun::store::HashStore>();
  std::string errors[3];
  auto results = run_ranks({0, 1, 2}, [&](int rank, RankResult& out) {
    auto pg = dist::init_process_group(options_for(rank, 3, store, milliseconds(5000)));
    std::vector<float> v(4, static_cast<float>(rank));
    try {
      pg->broadcast(dist::make_buffer(v.data(), v.size()), rank == 1 ? 1 : 0);
    } catch (const ctorchrun::ConfigError& e) {
      errors[rank] = e.what();
    }
    // Nothing moved, and the group is still in step.
    float x = 1;
    pg->all_reduce(dist::make_buffer(&x, 1));
    out.value = x + (v.back() == static_cast<float>(rank) ? 0 : 100);
  });
  for (int r = 0; r < 3; ++r) {
    INFO("rank " << r << ": " << results[r].error);
    CHECK(results[r].error.empty());
    CHECK(results[r].value == 3);
    CHECK_THAT(errors[r], Catch::Contains("ranks 0,2: broadcast of 4 float32 with root 0; rank 1: "
                                          "broadcast of 4 float32 with root 1"));
  }
}

TEST_CASE("dist mismatch: with check_calls off the ranks do not compare their calls", "[net]") {
  const bool check = GENERATE(true, false);
  INFO("check_calls " << check);
  auto store = std::make_shared<ctorchrun::store::HashStore>();
  bool config_error[2] = {false, false};
  auto results = run_ranks({0, 1}, [&](int rank, RankResult&) {
    auto options = options_for(rank, 2, store, milliseconds(5000));
    options.check_calls = check;
    auto pg = dist::init_process_group(options);
    // Same count and type, different reductions: gloo alone runs it.
    std::vector<int64_t> v(4, rank + 1);
    try {
      pg->all_reduce(dist::make_buffer(v.data(), v.size()),
                     rank == 0 ? dist::ReduceOp::kSum : dist::ReduceOp::kMax);
    } catch (const ctorchrun::ConfigError&) {
      config_error[rank] = true;
    }
  });
  REQUIRE(results[0].error.empty());
  REQUIRE(results[1].error.empty());
  CHECK(config_error[0] == check);
  CHECK(config_error[1] == check);
}

// OpQueue (collectives/op_queue.h): the order every backend's collectives
// keep, tested on its own with an execute that records what ran where.
TEST_CASE("op queue: calls run one at a time in tag order with blocking ones on their caller",
          "[unit]") {
  std::mutex mutex;
  std::vector<uint32_t> tags;
  std::vector<std::thread::id> threads;
  std::atomic<int> running{0};
  std::atomic<int> overlap{0};
  dist::OpQueue queue([&](const dist::Op&, uint32_t tag, const dist::PromiseWork&) {
    if (running.fetch_add(1) != 0) overlap.fetch_add(1);
    std::this_thread::sleep_for(milliseconds(2));
    {
      std::lock_guard<std::mutex> lock(mutex);
      tags.push_back(tag);
      threads.push_back(std::this_thread::get_id());
    }
    running.fetch_sub(1);
  });
  dist::Op op;
  op.type = dist::OpType::kBarrier;
  std::vector<dist::WorkHandle> works;
  for (int i = 0; i < 5; ++i) works.push_back(queue.run(op, true, "async " + std::to_string(i)));
  auto blocking = queue.run(op, false, "blocking");
  CHECK(blocking->is_completed());
  for (auto& w : works) w->wait(milliseconds(5000));
  REQUIRE(tags == std::vector<uint32_t>{0, 1, 2, 3, 4, 5});
  CHECK(overlap.load() == 0);
  CHECK(threads[5] == std::this_thread::get_id());
  for (int i = 0; i < 5; ++i) CHECK(threads[static_cast<size_t>(i)] != std::this_thread::get_id());
}

TEST_CASE("op queue: an error reaches its own Work only and stop fails what never ran", "[unit]") {
  std::mutex mutex;
  std::condition_variable cv;
  bool release = false;
  bool first_started = false;
  dist::OpQueue queue([&](const dist::Op&, uint32_t tag, const dist::PromiseWork& work) {
    if (tag == 1) throw ctorchrun::IoError(work.description() + " broke");
    if (tag == 2) {
      std::unique_lock<std::mutex> lock(mutex);
      first_started = true;
      cv.notify_all();
      cv.wait(lock, [&] { return release; });
    }
  });
  dist::Op op;
  op.type = dist::OpType::kBarrier;
  CHECK_NOTHROW(queue.run(op, false, "zero"));
  CHECK_THROWS_WITH(queue.run(op, false, "one"), "one broke");
  auto held = queue.run(op, true, "two");
  auto queued = queue.run(op, true, "three");
  std::exception_ptr blocked_error;
  std::thread blocked([&] {
    try {
      queue.run(op, false, "four");
    } catch (...) {
      blocked_error = std::current_exception();
    }
  });
  {
    std::unique_lock<std::mutex> lock(mutex);
    REQUIRE(cv.wait_for(lock, std::chrono::seconds(5), [&] { return first_started; }));
  }
  std::thread stopper([&] { queue.stop(); });
  std::this_thread::sleep_for(milliseconds(20));
  CHECK_FALSE(held->is_completed());  // stop waits for the running one
  {
    std::lock_guard<std::mutex> lock(mutex);
    release = true;
  }
  cv.notify_all();
  stopper.join();
  blocked.join();
  CHECK_NOTHROW(held->wait(milliseconds(5000)));
  CHECK_THROWS_WITH(queued->wait(milliseconds(5000)),
                    "three never ran: its process group was destroyed");
  REQUIRE(blocked_error);
  CHECK_THROWS_WITH(std::rethrow_exception(blocked_error),
                    "four never ran: its process group was destroyed");
  CHECK_THROWS_WITH(queue.run(op, false, "five"),
                    "five never ran: its process group was destroyed");
}
