// The hierarchical path of libctorch_dist (collectives/hier_backend.h) in
// real processes on one machine posing as several hosts: a rank's host
// identity includes its shared-memory directory's device and inode, so
// ranks given different CTORCHRUN_DIST_SHM_DIR directories are on different
// "hosts". Its results against a flat gloo group's, a peer killed or frozen
// on the other host, calls that differ across hosts, async order, and when
// the path is (not) taken.

#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <csignal>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "tests/launcher/launcher_support.h"
#include "tests/support/process.h"
#include "tests/support/temp_dir.h"

using namespace ctorchrun::testing;
using std::chrono::seconds;

namespace {

// dist_test_worker processes against a ctorch-store, rank r on "host"
// host_of[r] (a segment directory per host).
struct Job {
  std::vector<std::unique_ptr<TempDir>> hosts;
  std::unique_ptr<Process> store;
  std::vector<std::unique_ptr<Process>> ranks;

  // `env` for every rank, then `rank_env[r]` for rank r where given.
  Job(const std::vector<int>& host_of, const std::vector<std::string>& args,
      const std::map<std::string, std::string>& env = {},
      const std::vector<std::map<std::string, std::string>>& rank_env = {}) {
    int count = 0;
    for (int h : host_of) count = std::max(count, h + 1);
    for (int h = 0; h < count; ++h) {
      hosts.push_back(std::make_unique<TempDir>("hier"));
    }
    store = std::make_unique<Process>(
        std::vector<std::string>{CTORCHRUN_STORE_BIN, "--host", "127.0.0.1", "--port", "0"});
    const int port = wait_for_listening_port(*store, seconds(10));
    REQUIRE(port > 0);
    const auto world = std::to_string(host_of.size());
    std::vector<std::string> argv = {CTORCHRUN_DIST_WORKER};
    argv.insert(argv.end(), args.begin(), args.end());
    for (size_t r = 0; r < host_of.size(); ++r) {
      std::map<std::string, std::string> e = {
          {"RANK", std::to_string(r)},
          {"WORLD_SIZE", world},
          {"LOCAL_RANK", std::to_string(r)},
          {"MASTER_ADDR", "127.0.0.1"},
          {"MASTER_PORT", std::to_string(port)},
          {"TORCHELASTIC_USE_AGENT_STORE", "True"},
          {"TORCHELASTIC_RESTART_COUNT", "0"},
          {"CTORCHRUN_DIST_SHM_DIR", hosts[static_cast<size_t>(host_of[r])]->path}};
      for (const auto& [k, v] : env) e[k] = v;
      if (r < rank_env.size()) {
        for (const auto& [k, v] : rank_env[r]) e[k] = v;
      }
      ranks.push_back(std::make_unique<Process>(argv, e, true));
    }
  }

  bool no_segments_left() const {
    for (const auto& h : hosts) {
      if (!h->entries().empty()) return false;
    }
    return true;
  }
};

// Every op x data type x reduce op on the hierarchical group against a flat
// gloo group of the same ranks (dist_test_worker versus hier).
void versus(const std::vector<int>& host_of) {
  Job job(host_of, {"versus", "hier"},
          {{"CTORCHRUN_DIST_SHM_CHUNK", "65536"}, {"CTORCHRUN_DIST_HIER_PIECE", "65536"}});
  const std::regex line(
      "versus: rank \\d of \\d \\((\\w+)\\): (\\d+) checks, (\\d+) bit-identical");
  for (size_t r = 0; r < host_of.size(); ++r) {
    const std::string out = job.ranks[r]->read_all(seconds(400));
    INFO("rank " << r << ":\n" << out);
    CHECK(job.ranks[r]->exit_code(seconds(10)) == 0);
    std::smatch m;
    REQUIRE(std::regex_search(out, m, line));
    CHECK(m[1].str() == "hier");
    CHECK(std::stoi(m[2].str()) > 300);
  }
  CHECK(job.no_segments_left());
}

// Rank `victim` kills or freezes itself in the third 4 MiB all-reduce (or
// reduce-scatter: `op`) of four ranks on two hosts ({0,1} and {2,3}), which
// goes in four pipelined pieces of 1 MiB; returns the others' outputs.
std::vector<std::string> peer_failure(int victim, const std::string& how, int timeout_ms,
                                      const std::string& op = "all_reduce") {
  Job job({0, 0, 1, 1},
          {"peer-death", std::to_string(victim), how, std::to_string(timeout_ms),
           std::to_string(1 << 20), op},
          {{"CTORCHRUN_DIST_SHM_CHUNK", "1048576"}});
  std::vector<std::string> survivors;
  for (int r = 0; r < 4; ++r) {
    if (r == victim) continue;
    survivors.push_back(job.ranks[static_cast<size_t>(r)]->read_all(seconds(60)));
    INFO("rank " << r << ": " << survivors.back());
    CHECK(job.ranks[static_cast<size_t>(r)]->exit_code(seconds(10)) == 7);
  }
  job.ranks[static_cast<size_t>(victim)]->signal(SIGKILL);
  CHECK(job.ranks[static_cast<size_t>(victim)]->exit_code(seconds(10)) == 128 + SIGKILL);
  CHECK(job.no_segments_left());
  return survivors;
}

const std::regex kFailed("survivor (\\d) failed after (\\d+) ms: (\\w+): (.*)");

void killed(int victim, const std::string& how, const std::string& op = "all_reduce") {
  // The group timeout is long: the survivors must not need it.
  for (const auto& out : peer_failure(victim, how, 60000, op)) {
    INFO(out);
    CHECK_THAT(out, Catch::Contains("transport hier"));
    std::smatch m;
    REQUIRE(std::regex_search(out, m, kFailed));
    CHECK(m[3].str() == "IoError");
    CHECK(std::stol(m[2]) <= 2000);
    CHECK_THAT(m[4].str(), Catch::Contains(op + " of 1048576 float32"));
  }
}

// The ranks' all_reduce calls differ (dist_test_worker mismatch KIND): each
// must throw InvalidArgument listing `calls`, then all-reduce again fine.
void mismatch(const std::vector<int>& host_of, const std::string& kind, const std::string& calls) {
  INFO(kind);
  Job job(host_of, {"mismatch", kind, "20000"});
  for (size_t r = 0; r < host_of.size(); ++r) {
    const std::string out = job.ranks[r]->read_all(seconds(60));
    INFO("rank " << r << ": " << out);
    const std::string rank = std::to_string(r);
    CHECK_THAT(out, Catch::Contains("transport hier"));
    CHECK_THAT(out, Catch::Contains("mismatch " + rank + ": InvalidArgument: ") &&
                        Catch::Contains(calls) && Catch::Contains("no data moved") &&
                        Catch::Contains("[buffer intact]"));
    CHECK_THAT(out, Catch::Contains("after " + rank + ": ok"));
    CHECK(job.ranks[r]->exit_code(seconds(10)) == 0);
  }
}

// The world group's and a second group's transport (dist_test_worker loop).
void transports(const std::vector<int>& host_of, const std::string& want,
                const std::map<std::string, std::string>& env = {},
                const std::vector<std::map<std::string, std::string>>& rank_env = {},
                const std::string& count = "3000") {
  Job job(host_of, {"loop", "6", count}, env, rank_env);
  for (size_t r = 0; r < host_of.size(); ++r) {
    const std::string out = job.ranks[r]->read_all(seconds(60));
    INFO("rank " << r << ": " << out);
    CHECK_THAT(out, Catch::Contains("transport " + want + " " + want));
    CHECK_THAT(out, Catch::Contains("loop: rank " + std::to_string(r) + " ok"));
    CHECK(job.ranks[r]->exit_code(seconds(10)) == 0);
  }
}

}  // namespace

TEST_CASE("hier versus gloo: every op data type and reduce op agree on 2 hosts of 2 ranks",
          "[multiproc]") {
  versus({0, 0, 1, 1});
}

TEST_CASE("hier versus gloo: every op data type and reduce op agree on hosts of 3 and 2 ranks",
          "[multiproc]") {
  // Interleaved: hosts {0 2 4} and {1 3}.
  versus({0, 1, 0, 1, 0});
}

TEST_CASE("hier versus gloo: every op data type and reduce op agree on hosts of 2 and 1 ranks",
          "[multiproc]") {
  // Hosts {0 2} and {1}: rank 1 is alone on its host.
  versus({0, 1, 0});
}

TEST_CASE("hier path: taken when a host has two ranks and not with one rank a host or shm off",
          "[multiproc]") {
  transports({0, 0, 1, 1}, "hier");
  transports({0, 1}, "gloo");
  transports({0, 0, 1, 1}, "gloo", {{"CTORCHRUN_DIST_SHM", "0"}});
}

// Each rank reads CTORCHRUN_DIST_SHM_CHUNK itself; were the piece each
// rank's own, the leaders' all_reduce of a piece would differ in count
// between hosts (19 pieces of 64 KiB against 2 of 1 MiB here).
TEST_CASE("hier pieces: hosts given different chunk sizes cut a large all_reduce alike",
          "[multiproc]") {
  const std::map<std::string, std::string> small = {{"CTORCHRUN_DIST_SHM_CHUNK", "65536"}};
  const std::map<std::string, std::string> large = {{"CTORCHRUN_DIST_SHM_CHUNK", "1048576"}};
  transports({0, 0, 1, 1}, "hier", {}, {small, small, large, large}, "300000");
  transports({0, 0, 1, 1}, "hier", {}, {large, large, small, small}, "300000");
}

TEST_CASE(
    "hier peers: a rank SIGKILLed mid-all_reduce on the other host fails every survivor "
    "with IoError within two seconds",
    "[multiproc]") {
  killed(3, "kill");       // not its host's leader
  killed(3, "kill-late");  // in the pipelined pieces rather than the call check
}

TEST_CASE(
    "hier peers: a host leader SIGKILLed mid-all_reduce fails every survivor with IoError "
    "within two seconds",
    "[multiproc]") {
  killed(2, "kill");
  killed(2, "kill-late");
}

// A reduce-scatter all-reduces a scratch copy in pipelined pieces, which the
// host group's thread works on while the leaders' step fails: the scratch
// must outlive that thread's last touch (under ASan a use after free here
// fails the survivor).
TEST_CASE(
    "hier peers: a rank SIGKILLed mid-reduce_scatter fails every survivor with IoError and no "
    "crash",
    "[multiproc]") {
  killed(3, "kill-late", "reduce_scatter");
  killed(2, "kill-late", "reduce_scatter");
}

TEST_CASE("hier peers: a rank frozen mid-all_reduce makes the others time out at the deadline",
          "[multiproc]") {
  int timed_out = 0;
  for (const auto& out : peer_failure(3, "stop", 1500)) {
    INFO(out);
    CHECK_THAT(out, Catch::Contains("transport hier"));
    std::smatch m;
    REQUIRE(std::regex_search(out, m, kFailed));
    // The first survivor to reach the deadline times out and leaves its
    // subgroups; the others may see that first (IoError).
    if (m[3].str() == "TimeoutError") {
      ++timed_out;
      CHECK(std::stol(m[2]) >= 1500);
    } else {
      CHECK(m[3].str() == "IoError");
    }
    CHECK(std::stol(m[2]) <= 1500 + 2500);
  }
  CHECK(timed_out >= 1);
}

TEST_CASE(
    "hier mismatch: calls that differ between hosts fail on every rank and the group "
    "stays usable",
    "[multiproc]") {
  // Each host agrees within itself: only the leaders' step can see it.
  mismatch({0, 0, 1, 1}, "upper",
           "ranks 0,1: all_reduce of 4 float32 (sum); ranks 2,3: all_reduce of 3 float32 (sum)");
  // Rank 1 alone on its host.
  mismatch({0, 1, 0}, "count",
           "ranks 0,2: all_reduce of 4 float32 (sum); rank 1: all_reduce of 3 float32 (sum)");
  // A call small enough to ride with the check against one that is not.
  mismatch({0, 0, 1, 1}, "straddle",
           "ranks 0,1: all_reduce of 4 float32 (sum); ranks 2,3: all_reduce of 2000 float32 (sum)");
  // Within one host of two.
  mismatch({0, 0, 1, 1}, "op",
           "ranks 0,2,3: all_reduce of 4 float32 (sum); rank 1: all_reduce of 4 float32 (max)");
}

TEST_CASE("hier order: async collectives of every kind complete in the order they started",
          "[multiproc]") {
  Job job({0, 1, 0, 1, 0}, {"async-order"});
  for (size_t r = 0; r < 5; ++r) {
    const std::string out = job.ranks[r]->read_all(seconds(60));
    INFO("rank " << r << ": " << out);
    CHECK_THAT(out, Catch::Contains("transport hier"));
    CHECK_THAT(out, Catch::Contains("async: rank " + std::to_string(r) + " ok"));
    CHECK(job.ranks[r]->exit_code(seconds(10)) == 0);
  }
}
