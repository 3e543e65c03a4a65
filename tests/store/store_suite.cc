#include "tests/store/store_suite.h"

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <exception>
#include <numeric>
#include <thread>
#include <vector>

#include "common/error.h"

namespace ctorchrun::testing {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

std::atomic<int> g_run{0};

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace

void run_store_suite(const StoreFactory& make_client) {
  const std::string p = "suite" + std::to_string(g_run++) + "/";
  auto s = make_client();
  s->set_timeout(5s);

  {
    INFO("set/get round trip, overwrite, empty and binary values");
    s->set(p + "a", "1");
    CHECK(s->get(p + "a") == "1");
    s->set(p + "a", "22");
    CHECK(s->get(p + "a") == "22");
    s->set(p + "empty", "");
    CHECK(s->get(p + "empty").empty());
    std::string bin;
    for (int i = 0; i < 256; ++i) bin.push_back(static_cast<char>(i));
    s->set(p + "bin", bin);
    CHECK(s->get(p + "bin") == bin);
    std::string big(1 << 20, 'x');
    big[12345] = '\0';
    s->set(p + "big", big);
    CHECK(s->get(p + "big") == big);
    std::string long_key = p + std::string(4000, 'k') + "\xc3\xa9";
    s->set(long_key, "v");
    CHECK(s->get(long_key) == "v");
  }

  {
    INFO("add: missing key counts as 0, sums, negative, add(0) reads, numeric text");
    CHECK(s->add(p + "ctr", 5) == 5);
    CHECK(s->add(p + "ctr", -7) == -2);
    CHECK(s->add(p + "ctr", 0) == -2);
    CHECK(s->get(p + "ctr") == "-2");
    s->set(p + "num", "12abc");
    CHECK(s->add(p + "num", 1) == 13);
  }

  {
    INFO("add on a non-numeric value fails, and the client keeps working");
    s->set(p + "text", "abc");
    CHECK_THROWS_AS(s->add(p + "text", 1), Error);
    s->set(p + "after", "ok");
    CHECK(s->get(p + "after") == "ok");
  }

  {
    INFO("compare_set follows torch's four rules");
    CHECK(s->compare_set(p + "cas", "", "first") == "first");
    CHECK(s->get(p + "cas") == "first");
    CHECK(s->compare_set(p + "cas", "wrong", "x") == "first");
    CHECK(s->compare_set(p + "cas", "first", "second") == "second");
    CHECK(s->get(p + "cas") == "second");
    CHECK(s->compare_set(p + "cas-missing", "expected", "x") == "expected");
    CHECK_FALSE(s->check({p + "cas-missing"}));
  }

  {
    INFO("check, delete_key and num_keys");
    CHECK(s->check({p + "a", p + "ctr"}));
    CHECK_FALSE(s->check({p + "a", p + "nope"}));
    CHECK(s->check({}));
    int64_t before = s->num_keys();
    s->set(p + "n1", "x");
    s->set(p + "n2", "y");
    CHECK(s->num_keys() == before + 2);
    CHECK(s->delete_key(p + "n1"));
    CHECK_FALSE(s->delete_key(p + "n1"));
    CHECK(s->num_keys() == before + 1);
  }

  {
    INFO("append creates, then appends");
    s->append(p + "log", "ab");
    s->append(p + "log", "cd");
    CHECK(s->get(p + "log") == "abcd");
  }

  {
    INFO("multi_set and multi_get keep order");
    s->multi_set({p + "m1", p + "m2", p + "m3"}, {"1", "", "3"});
    CHECK(s->multi_get({p + "m3", p + "m1", p + "m2"}) == std::vector<std::string>{"3", "1", ""});
    CHECK_THROWS_AS(s->multi_set({p + "x"}, {}), ConfigError);
  }

  {
    INFO("wait returns at once for present keys and times out naming a missing one");
    auto t0 = Clock::now();
    s->wait({p + "a"}, 2s);
    CHECK(seconds_since(t0) < 1.0);
    t0 = Clock::now();
    try {
      s->wait({p + "a", p + "late"}, 150ms);
      FAIL("wait did not time out");
    } catch (const TimeoutError& e) {
      CHECK(std::string(e.what()).find("late") != std::string::npos);
    }
    double took = seconds_since(t0);
    CHECK(took >= 0.14);
    CHECK(took < 3.0);
  }

  {
    INFO("after a timed-out wait, a late key does not corrupt the client's next replies");
    auto other = make_client();
    other->set(p + "late", "now");
    s->set(p + "after-late", "fine");
    CHECK(s->get(p + "after-late") == "fine");
    CHECK(s->add(p + "after-late-ctr", 3) == 3);
  }

  {
    INFO("get of a missing key times out");
    s->set_timeout(150ms);
    CHECK_THROWS_AS(s->get(p + "never"), TimeoutError);
    s->set_timeout(5s);
    CHECK(s->get(p + "a") == "22");
  }

  {
    INFO("a blocked wait is released by another client's set");
    std::exception_ptr error;
    double waited = -1;
    std::atomic<bool> connected{false};
    std::thread waiter([&] {
      try {
        auto w = make_client();
        connected = true;
        auto t0 = Clock::now();
        w->wait({p + "go1", p + "go2"}, 10s);
        waited = seconds_since(t0);
      } catch (...) {
        error = std::current_exception();
        connected = true;
      }
    });
    // Ready once the waiter's client exists; its wait follows at once (if the
    // keys come first, the wait returns at once: the outcome is the same).
    for (int i = 0; i < 10000 && !connected; ++i) std::this_thread::sleep_for(1ms);
    s->set(p + "go1", "x");
    s->add(p + "go2", 1);
    waiter.join();
    CHECK_FALSE(error);
    CHECK(waited >= 0.0);
    CHECK(waited < 5.0);
  }

  {
    INFO("concurrent adds from several clients all count");
    constexpr int kThreads = 6;
    constexpr int kAdds = 50;
    std::vector<std::thread> threads;
    std::atomic<int> failures{0};
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&] {
        try {
          auto c = make_client();
          for (int i = 0; i < kAdds; ++i) c->add(p + "shared-ctr", 1);
        } catch (...) {
          ++failures;
        }
      });
    }
    for (auto& t : threads) t.join();
    CHECK(failures == 0);
    CHECK(s->add(p + "shared-ctr", 0) == kThreads * kAdds);
  }

  {
    INFO("a tally gives each of many concurrent enrolments its own place");
    CHECK(s->tally_count(p + "tally") == 0);
    CHECK(s->tally_entries(p + "tally").empty());
    constexpr int kThreads = 6;
    constexpr int kEach = 20;
    std::vector<std::vector<int64_t>> places(kThreads);
    std::vector<std::thread> threads;
    std::atomic<int> failures{0};
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        try {
          auto c = make_client();
          for (int i = 0; i < kEach; ++i) {
            // Odd enrolments are counted and not listed.
            const std::string entry =
                i % 2 == 0 ? "t" + std::to_string(t) + "." + std::to_string(i) : "";
            places[static_cast<size_t>(t)].push_back(c->tally_add(p + "tally", entry));
          }
        } catch (...) {
          ++failures;
        }
      });
    }
    for (auto& t : threads) t.join();
    CHECK(failures == 0);
    std::vector<int64_t> all;
    for (const auto& v : places) {
      // One writer's places grow: a later enrolment never comes first.
      CHECK(std::is_sorted(v.begin(), v.end()));
      all.insert(all.end(), v.begin(), v.end());
    }
    std::sort(all.begin(), all.end());
    std::vector<int64_t> expected(kThreads * kEach);
    std::iota(expected.begin(), expected.end(), 1);
    CHECK(all == expected);
    CHECK(s->tally_count(p + "tally") == kThreads * kEach);
    auto entries = s->tally_entries(p + "tally");
    std::sort(entries.begin(), entries.end());
    std::vector<std::string> listed;
    for (int t = 0; t < kThreads; ++t) {
      for (int i = 0; i < kEach; i += 2)
        listed.push_back("t" + std::to_string(t) + "." + std::to_string(i));
    }
    std::sort(listed.begin(), listed.end());
    CHECK(entries == listed);
    // Tallies of other keys are apart.
    CHECK(s->tally_add(p + "tally2", "x") == 1);
    CHECK(s->tally_count(p + "tally") == kThreads * kEach);
  }
}

}  // namespace ctorchrun::testing
