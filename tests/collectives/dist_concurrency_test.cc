// libctorch_dist used from several threads of one rank; ranks are threads
// (tests/collectives/dist_thread_ranks.h). A binary of its own that needs
// only ctorchrun::dist, so that a sanitizer build can build just this one.

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

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
