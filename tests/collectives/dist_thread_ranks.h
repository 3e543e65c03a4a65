#pragma once

// Ranks as threads of one process over loopback gloo and one in-process store
// (gloo's BaseTest pattern), for the dist_*_test.cc files. Worker threads
// record what they saw in a RankResult; the test thread asserts.

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "collectives/process_group.h"
#include "common/error.h"
#include "store/store.h"

namespace ctorchrun::dist::testing {

struct RankResult {
  std::string error;  // empty: no exception
  bool timeout_error = false;
  double value = 0;
  long elapsed_ms = 0;
};

inline InitOptions options_for(int rank, int world, std::shared_ptr<store::Store> store,
                               std::chrono::milliseconds timeout) {
  InitOptions options;
  options.rank = rank;
  options.world_size = world;
  options.restart_count = 0;
  options.master_addr = "127.0.0.1";
  options.store = std::move(store);
  options.timeout = timeout;
  return options;
}

inline long ms_since(std::chrono::steady_clock::time_point start) {
  return static_cast<long>(std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::steady_clock::now() - start)
                               .count());
}

// Runs body(rank) on one thread per listed rank; returns what each recorded.
inline std::vector<RankResult> run_ranks(const std::vector<int>& ranks,
                                         const std::function<void(int, RankResult&)>& body) {
  std::vector<RankResult> results(ranks.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < ranks.size(); ++i) {
    threads.emplace_back([&, i] {
      const auto start = std::chrono::steady_clock::now();
      try {
        body(ranks[i], results[i]);
      } catch (const TimeoutError& e) {
        results[i].error = e.what();
        results[i].timeout_error = true;
      } catch (const std::exception& e) {
        results[i].error = e.what();
      }
      results[i].elapsed_ms = ms_since(start);
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

}  // namespace ctorchrun::dist::testing
