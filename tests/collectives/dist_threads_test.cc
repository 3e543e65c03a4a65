// libctorch_dist with threads as ranks (tests/collectives/dist_thread_ranks.h):
// set-up timeouts, a first exchange, Work::wait bounds.

#include <catch2/catch.hpp>
#include <chrono>
#include <string>
#include <vector>

#include "collectives/process_group.h"
#include "common/error.h"
#include "store/hash_store.h"
#include "tests/collectives/dist_thread_ranks.h"

namespace dist = ctorchrun::dist;
using std::chrono::milliseconds;

using dist::testing::options_for;
using dist::testing::RankResult;
using dist::testing::run_ranks;

TEST_CASE("dist set-up: a timeout names the ranks that never arrived", "[net]") {
  auto store = std::make_shared<ctorchrun::store::HashStore>();
  auto results = run_ranks({0, 2}, [&](int rank, RankResult&) {
    dist::init_process_group(options_for(rank, 4, store, milliseconds(300)));
  });
  for (const auto& r : results) {
    CHECK(r.timeout_error);
    CHECK_THAT(r.error, Catch::Contains("rank(s) 1,3 of 4 never arrived"));
    CHECK(r.elapsed_ms < 5000);
  }
}

TEST_CASE("dist threads: two ranks average bfloat16 and exchange point to point", "[net]") {
  auto store = std::make_shared<ctorchrun::store::HashStore>();
  auto results = run_ranks({0, 1}, [&](int rank, RankResult& out) {
    auto pg = dist::init_process_group(options_for(rank, 2, store, milliseconds(20000)));
    std::vector<dist::BFloat16> v(3,
                                  dist::BFloat16{dist::float_to_bfloat16(rank == 0 ? 1.f : 2.f)});
    pg->all_reduce(dist::make_buffer(v.data(), v.size()), dist::ReduceOp::kAverage);
    out.value = dist::bfloat16_to_float(v[2].bits);
    int64_t token = rank == 0 ? 41 : 0;
    if (rank == 0) {
      pg->send(dist::make_buffer(&token, 1), 1, 9);
    } else {
      pg->recv(dist::make_buffer(&token, 1), 0, 9);
      out.value += static_cast<double>(token);
    }
    pg->barrier();
  });
  REQUIRE(results[0].error.empty());
  REQUIRE(results[1].error.empty());
  CHECK(results[0].value == 1.5);
  CHECK(results[1].value == 1.5 + 41);
}

TEST_CASE("dist work: wait(timeout) gives up early, the op's own timeout ends it", "[net]") {
  auto store = std::make_shared<ctorchrun::store::HashStore>();
  std::string early, own;
  bool early_is_timeout = false, own_is_timeout = false;
  long own_ms = -1;
  auto results = run_ranks({0, 1}, [&](int rank, RankResult&) {
    auto pg = dist::init_process_group(options_for(rank, 2, store, milliseconds(20000)));
    pg->barrier();
    if (rank == 0) {
      // Rank 1 never joins this all-reduce.
      float x = 1;
      auto work =
          pg->all_reduce_async(dist::make_buffer(&x, 1), dist::ReduceOp::kSum, milliseconds(600));
      try {
        work->wait(milliseconds(50));
      } catch (const ctorchrun::TimeoutError& e) {
        early = e.what();
        early_is_timeout = true;
      }
      const auto start = std::chrono::steady_clock::now();
      try {
        work->wait();
      } catch (const ctorchrun::TimeoutError& e) {
        own = e.what();
        own_is_timeout = true;
      }
      own_ms = static_cast<long>(
          std::chrono::duration_cast<milliseconds>(std::chrono::steady_clock::now() - start)
              .count());
    }
    // Both ranks keep their groups until rank 0 is done with its wait.
    store->set("done/" + std::to_string(rank), "1");
    store->wait({"done/0", "done/1"}, milliseconds(20000));
  });
  REQUIRE(results[0].error.empty());
  REQUIRE(results[1].error.empty());
  CHECK(early_is_timeout);
  CHECK_THAT(early, Catch::Contains("still running"));
  CHECK(own_is_timeout);
  CHECK_THAT(own, Catch::Contains("all_reduce of 1 float32") && Catch::Contains("timed out"));
  CHECK(own_ms < 10000);
}
