// The shared-memory path of libctorch_dist (collectives/shm_backend.h) in
// real processes: its results against gloo's, a peer killed or frozen in the
// middle of a collective, jobs and groups side by side on one host, a full
// /dev/shm, and the sweep of dead processes' segments.

#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "collectives/process_group.h"
#include "collectives/shm_backend.h"
#include "common/error.h"
#include "store/hash_store.h"
#include "tests/launcher/launcher_support.h"
#include "tests/support/process.h"
#include "tests/support/temp_dir.h"

using namespace ctorchrun::testing;
using std::chrono::milliseconds;
using std::chrono::seconds;

namespace {

std::string pid_namespace() {
  char link[64] = {};
  const ssize_t n = ::readlink("/proc/self/ns/pid", link, sizeof link - 1);
  std::string digits;
  for (ssize_t i = 0; i < n; ++i) {
    if (link[i] >= '0' && link[i] <= '9') digits += link[i];
  }
  return digits;
}

std::vector<std::string> launch_args(int nproc, const std::vector<std::string>& worker) {
  std::vector<std::string> args = {"--nproc_per_node=" + std::to_string(nproc),
                                   "--master_port=" + std::to_string(free_port()), "--no_python",
                                   CTORCHRUN_DIST_WORKER};
  args.insert(args.end(), worker.begin(), worker.end());
  return args;
}

void versus(int world) {
  // 64 KiB buffers: the larger sizes of the worker take several chunks.
  auto r = run_ctorchrun(launch_args(world, {"versus"}), {{"CTORCHRUN_DIST_SHM_CHUNK", "65536"}},
                         seconds(240));
  INFO("world " << world << "\n" << r.output);
  CHECK(r.exit_code == 0);
  const std::regex line(
      "versus: rank \\d of \\d \\((\\w+)\\): (\\d+) checks, (\\d+) bit-identical");
  int ranks = 0;
  for (std::sregex_iterator it(r.output.begin(), r.output.end(), line), end; it != end; ++it) {
    ++ranks;
    CHECK((*it)[1].str() == (world == 1 ? "gloo" : "shm"));
    CHECK(std::stoi((*it)[2].str()) > 300);
    // At two ranks every result is bit-identical to gloo's.
    if (world <= 2) CHECK((*it)[2].str() == (*it)[3].str());
  }
  CHECK(ranks == world);
}

// The single-copy all_reduce (cross-memory attach) against the segment path
// and gloo, and proof that it ran: the worker counts its calls.
void cma_versus(int world) {
  auto r = run_ctorchrun(launch_args(world, {"cma"}), {}, seconds(300));
  INFO("world " << world << "\n" << r.output);
  CHECK(r.exit_code == 0);
  const std::regex line("cma: rank \\d of \\d: (\\d+) checks, (\\d+) single-copy calls");
  int ranks = 0;
  for (std::sregex_iterator it(r.output.begin(), r.output.end(), line), end; it != end; ++it) {
    ++ranks;
    CHECK(std::stoi((*it)[1].str()) > 300);
    CHECK(std::stoi((*it)[2].str()) > 300);
  }
  CHECK(ranks == world);
  CHECK_THAT(r.output, !Catch::Contains("cross-memory attach) unavailable"));
}

// Three ranks in processes of their own against a ctorch-store, segments in
// a directory of the test's own; rank 1 dies (or freezes) in an all-reduce.
struct PeerFailure {
  std::vector<std::string> survivors;  // each survivor's output
  std::vector<std::string> leftovers;  // the segment directory afterwards
};

PeerFailure peer_failure(const std::string& how, int timeout_ms, size_t count = size_t{1} << 20,
                         const std::map<std::string, std::string>& extra_env = {}) {
  TempDir dir("shm");
  Process store({CTORCHRUN_STORE_BIN, "--host", "127.0.0.1", "--port", "0"});
  const int port = wait_for_listening_port(store, seconds(10));
  REQUIRE(port > 0);
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 3; ++r) {
    std::map<std::string, std::string> env = {
        {"RANK", std::to_string(r)},           {"WORLD_SIZE", "3"},
        {"LOCAL_RANK", std::to_string(r)},     {"MASTER_ADDR", "127.0.0.1"},
        {"MASTER_PORT", std::to_string(port)}, {"TORCHELASTIC_USE_AGENT_STORE", "True"},
        {"TORCHELASTIC_RESTART_COUNT", "0"},   {"CTORCHRUN_DIST_SHM_DIR", dir.path}};
    env.insert(extra_env.begin(), extra_env.end());
    ranks.push_back(std::make_unique<Process>(
        std::vector<std::string>{CTORCHRUN_DIST_WORKER, "peer-death", "1", how,
                                 std::to_string(timeout_ms), std::to_string(count)},
        env));
  }
  PeerFailure result;
  for (int r : {0, 2}) {
    result.survivors.push_back(ranks[r]->read_all(seconds(60)));
    INFO("rank " << r << ": " << result.survivors.back());
    CHECK(ranks[r]->exit_code(seconds(10)) == 7);
  }
  ranks[1]->signal(SIGKILL);
  CHECK(ranks[1]->exit_code(seconds(10)) == 128 + SIGKILL);
  result.leftovers = dir.entries();
  return result;
}

const std::regex kFailed("survivor (\\d) failed after (\\d+) ms: (\\w+): (.*)");

}  // namespace

TEST_CASE("shm versus gloo: every op data type and reduce op agree at world size 1",
          "[multiproc]") {
  versus(1);
}
TEST_CASE("shm versus gloo: every op data type and reduce op agree at world size 2",
          "[multiproc]") {
  versus(2);
}
TEST_CASE("shm versus gloo: every op data type and reduce op agree at world size 3",
          "[multiproc]") {
  versus(3);
}
TEST_CASE("shm versus gloo: every op data type and reduce op agree at world size 4",
          "[multiproc]") {
  versus(4);
}

TEST_CASE(
    "shm peers: a rank SIGKILLed mid-collective fails the others with IoError within a "
    "second and leaves no segment",
    "[multiproc]") {
  // The group timeout is long: the survivors must not need it.
  auto result = peer_failure("kill", 60000);
  for (const auto& out : result.survivors) {
    INFO(out);
    CHECK_THAT(out, Catch::Contains("transport shm"));
    std::smatch m;
    REQUIRE(std::regex_search(out, m, kFailed));
    CHECK(m[3].str() == "IoError");
    CHECK(std::stol(m[2]) <= 1000);
    CHECK_THAT(m[4].str(), Catch::Contains("all_reduce of 1048576 float32"));
  }
  CHECK(result.leftovers.empty());
}

TEST_CASE(
    "shm peers: a rank SIGKILLed mid single-copy all_reduce of 32 MiB fails the others with "
    "IoError within a second",
    "[multiproc]") {
  // The victim dies 10 ms into it: the others are reading its buffer or
  // waiting for it.
  // The single copy is off unless switched on, and three ranks take it only
  // when told to.
  auto result = peer_failure(
      "kill-late", 60000, ctorchrun::dist::kShmCmaMaxBytes / 4,
      {{"CTORCHRUN_DIST_SHM_CMA", "1"},
       {"CTORCHRUN_DIST_SHM_CMA_MAX", std::to_string(ctorchrun::dist::kShmCmaMaxBytes)}});
  for (const auto& out : result.survivors) {
    INFO(out);
    // Rounds 0 and 1 went by cross-memory attach.
    std::smatch calls;
    REQUIRE(std::regex_search(out, calls, std::regex("single-copy calls (\\d+)")));
    CHECK(std::stol(calls[1]) == 2);
    std::smatch m;
    REQUIRE(std::regex_search(out, m, kFailed));
    CHECK(m[3].str() == "IoError");
    CHECK(std::stol(m[2]) <= 1000);
    CHECK_THAT(m[4].str(), Catch::Contains("all_reduce of 8388608 float32"));
  }
  CHECK(result.leftovers.empty());
}

TEST_CASE("shm peers: a rank frozen mid-collective makes the others time out at the deadline",
          "[multiproc]") {
  auto result = peer_failure("stop", 1500);
  int timed_out = 0;
  for (const auto& out : result.survivors) {
    INFO(out);
    CHECK_THAT(out, Catch::Contains("transport shm"));
    std::smatch m;
    REQUIRE(std::regex_search(out, m, kFailed));
    // The first survivor to reach the deadline times out and raises the
    // group's failure flag; the other may see that first (IoError).
    if (m[3].str() == "TimeoutError") {
      ++timed_out;
      CHECK(std::stol(m[2]) >= 1500);
      CHECK_THAT(m[4].str(), Catch::Contains("waiting for rank(s) 1"));
    } else {
      CHECK(m[3].str() == "IoError");
    }
    CHECK(std::stol(m[2]) <= 1500 + 2000);
  }
  CHECK(timed_out >= 1);
  CHECK(result.leftovers.empty());
}

TEST_CASE("shm single copy: all_reduce and reduce agree with the segment path and gloo at 2 ranks",
          "[multiproc]") {
  cma_versus(2);
}
TEST_CASE("shm single copy: all_reduce and reduce agree with the segment path and gloo at 3 ranks",
          "[multiproc]") {
  cma_versus(3);
}
TEST_CASE("shm single copy: all_reduce and reduce agree with the segment path and gloo at 4 ranks",
          "[multiproc]") {
  cma_versus(4);
}

TEST_CASE("shm single copy: CTORCHRUN_DIST_SHM_CMA must be 0 or 1", "[unit]") {
  ctorchrun::dist::InitOptions options;
  options.rank = 0;
  options.world_size = 1;
  options.store = std::make_shared<ctorchrun::store::HashStore>();
  ::setenv("CTORCHRUN_DIST_SHM_CMA", "bogus", 1);
  CHECK_THROWS_AS(ctorchrun::dist::init_process_group(options), ctorchrun::ConfigError);
  CHECK_THROWS_WITH(ctorchrun::dist::init_process_group(options),
                    Catch::Contains("CTORCHRUN_DIST_SHM_CMA='bogus' must be 0 (off) or 1 (on)"));
  for (const char* good : {"0", "1"}) {
    ::setenv("CTORCHRUN_DIST_SHM_CMA", good, 1);
    CHECK_NOTHROW(ctorchrun::dist::init_process_group(options));
  }
  ::unsetenv("CTORCHRUN_DIST_SHM_CMA");
}

TEST_CASE("shm sizes: the chunk and single-copy sizes must be plain byte counts", "[unit]") {
  ctorchrun::dist::InitOptions options;
  options.rank = 0;
  options.world_size = 1;
  options.store = std::make_shared<ctorchrun::store::HashStore>();
  struct Case {
    const char* name;
    const char* value;
    bool good;
  };
  const Case cases[] = {
      {"CTORCHRUN_DIST_SHM_CHUNK", "65536", true},
      {"CTORCHRUN_DIST_SHM_CHUNK", "67108864", true},
      {"CTORCHRUN_DIST_SHM_CHUNK", "65535", false},     // below 64 KiB
      {"CTORCHRUN_DIST_SHM_CHUNK", "67108865", false},  // above 64 MiB
      {"CTORCHRUN_DIST_SHM_CHUNK", "-1", false},        // std::stoull would wrap it
      {"CTORCHRUN_DIST_SHM_CHUNK", " 65536", false},
      {"CTORCHRUN_DIST_SHM_CHUNK", "65536k", false},
      {"CTORCHRUN_DIST_SHM_CHUNK", "99999999999999999999999", false},
      // The hierarchical all_reduce's piece is a setting of its own.
      {"CTORCHRUN_DIST_HIER_PIECE", "65536", true},
      {"CTORCHRUN_DIST_HIER_PIECE", "67108864", true},
      {"CTORCHRUN_DIST_HIER_PIECE", "4096", false},
      {"CTORCHRUN_DIST_HIER_PIECE", "8M", false},
      {"CTORCHRUN_DIST_SHM_CMA_MIN", "0", true},
      {"CTORCHRUN_DIST_SHM_CMA_MIN", "-1", false},
      {"CTORCHRUN_DIST_SHM_CMA_MAX", "1e6", false},
      {"CTORCHRUN_DIST_SHM_CMA_MAX", "+5", false},
  };
  for (const auto& c : cases) {
    CAPTURE(c.name, c.value);
    ::setenv(c.name, c.value, 1);
    if (c.good) {
      CHECK_NOTHROW(ctorchrun::dist::init_process_group(options));
    } else {
      CHECK_THROWS_AS(ctorchrun::dist::init_process_group(options), ctorchrun::ConfigError);
      CHECK_THROWS_WITH(ctorchrun::dist::init_process_group(options),
                        Catch::Contains(std::string(c.name) + "='" + c.value + "'"));
    }
    ::unsetenv(c.name);
  }
}

TEST_CASE("shm isolation: two jobs with one run id and two groups of one job share no segment",
          "[multiproc]") {
  TempDir dir("shm");
  std::vector<std::unique_ptr<Process>> jobs;
  for (int j = 0; j < 2; ++j) {
    auto args = launch_args(2, {"loop", "3000"});
    args.insert(args.begin(), "--rdzv_id=samejob");
    jobs.push_back(start_ctorchrun(args, {{"CTORCHRUN_DIST_SHM_DIR", dir.path}}));
  }
  for (auto& job : jobs) {
    const std::string out = job->read_all(seconds(120));
    INFO(out);
    CHECK(job->exit_code(seconds(10)) == 0);
    CHECK(count_lines_with(out, "transport shm shm") == 2);
    CHECK(count_lines_with(out, " ok") == 2);
  }
  CHECK(dir.entries().empty());
}

namespace {

// A job of two ranks (`loop 50`) in a mount namespace of its own, over a
// private tmpfs of `size` on /dev/shm (needs root, as CI runs).
std::pair<int, std::string> job_with_small_dev_shm(const std::string& size) {
  std::vector<std::string> argv = {
      "/usr/bin/unshare",
      "--mount",
      "/bin/sh",
      "-c",
      "mount -t tmpfs -o size=" + size + " tmpfs /dev/shm && exec \"$@\"",
      "sh",
      CTORCHRUN_BIN};
  for (const auto& a : launch_args(2, {"loop", "50"})) argv.push_back(a);
  Process job(argv, {}, true);
  std::string out = job.read_all(seconds(120));
  return {job.exit_code(seconds(10)), out};
}

}  // namespace

TEST_CASE("shm fallback: a full /dev/shm makes the groups use gloo with one warning per process",
          "[multiproc]") {
  REQUIRE(::geteuid() == 0);
  auto [code, out] = job_with_small_dev_shm("16k");
  INFO(out);
  CHECK(code == 0);
  CHECK(count_lines_with(out, "transport gloo gloo") == 2);
  CHECK(count_lines_with(out, " ok") == 2);
  // Two groups in each of two processes: one warning per process.
  CHECK(count_lines_with(out, "shared-memory collectives unavailable") == 2);
  CHECK_THAT(out, Catch::Contains("No space left on device"));
}

TEST_CASE("shm fallback: a small /dev/shm takes smaller chunks and stays on shared memory",
          "[multiproc]") {
  REQUIRE(::geteuid() == 0);
  // 1 MiB holds two ranks' buffers of 128 KiB, not of the default 1 MiB.
  auto [code, out] = job_with_small_dev_shm("1m");
  INFO(out);
  CHECK(code == 0);
  CHECK(count_lines_with(out, "transport shm shm") == 2);
  CHECK(count_lines_with(out, " ok") == 2);
  CHECK(count_lines_with(out, "shared-memory collectives unavailable") == 0);
}

TEST_CASE("shm sweep: segments of dead creators are removed and live ones kept", "[unit]") {
  TempDir dir("shm");
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  REQUIRE(child > 0);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  const std::string ns = pid_namespace();
  const std::string dead = "ctdist." + ns + "." + std::to_string(child) + ".job.0.0";
  const std::string live = "ctdist." + ns + "." + std::to_string(::getpid()) + ".job.0.0";
  const std::string other_ns = "ctdist.1." + std::to_string(child) + ".job.0.0";
  const std::string foreign = "someone-else." + std::to_string(child);
  for (const auto& n : {dead, live, other_ns, foreign}) std::ofstream(dir.path + "/" + n) << "x";
  CHECK(ctorchrun::dist::sweep_stale_segments(dir.path) == 1);
  auto left = dir.entries();
  std::sort(left.begin(), left.end());
  std::vector<std::string> want = {live, other_ns, foreign};
  std::sort(want.begin(), want.end());
  CHECK(left == want);
}
