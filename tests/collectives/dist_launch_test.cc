// libctorch_dist under the real launcher and in real processes: the op
// matrix at world sizes 1-4, a peer killed or stopped mid-collective, the C++
// trainer's restarts and resumes, and an out-of-tree find_package consumer.

#include <catch2/catch.hpp>
#include <chrono>
#include <csignal>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <vector>

#include "tests/launcher/launcher_support.h"
#include "tests/support/process.h"

using namespace ctorchrun::testing;
using std::chrono::milliseconds;
using std::chrono::seconds;

namespace {

LaunchResult launch(int nproc, const std::vector<std::string>& worker_argv,
                    const std::vector<std::string>& extra = {}) {
  std::vector<std::string> args = {"--nproc_per_node=" + std::to_string(nproc),
                                   "--master_port=" + std::to_string(free_port())};
  args.insert(args.end(), extra.begin(), extra.end());
  args.push_back("--no_python");
  args.insert(args.end(), worker_argv.begin(), worker_argv.end());
  return run_ctorchrun(args, {}, seconds(240));
}

nlohmann::json train(int nproc, const std::string& workdir, int epochs,
                     const std::vector<std::string>& extra_worker = {},
                     const std::vector<std::string>& extra_launcher = {}) {
  std::vector<std::string> argv = {CTORCHRUN_TRAIN_BIN, "--workdir", workdir, "--epochs",
                                   std::to_string(epochs)};
  argv.insert(argv.end(), extra_worker.begin(), extra_worker.end());
  auto r = launch(nproc, argv, extra_launcher);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  return nlohmann::json::parse(read_file(workdir + "/result.json"));
}

}  // namespace

namespace {

void matrix(int world) {
  auto r = launch(world, {CTORCHRUN_DIST_WORKER, "matrix"});
  INFO("world " << world << "\n" << r.output);
  CHECK(r.exit_code == 0);
  CHECK(count_lines_with(r.output, " checks passed") == world);
}

}  // namespace

// One ctorchrun launch per world size runs every op x data type x reduce op.
TEST_CASE("dist matrix: every op, data type and reduce op at world size 1", "[multiproc]") {
  matrix(1);
}
TEST_CASE("dist matrix: every op, data type and reduce op at world size 2", "[multiproc]") {
  matrix(2);
}
TEST_CASE("dist matrix: every op, data type and reduce op at world size 3", "[multiproc]") {
  matrix(3);
}
TEST_CASE("dist matrix: every op, data type and reduce op at world size 4", "[multiproc]") {
  matrix(4);
}

namespace {

// Three ranks in processes of their own against a ctorch-store; rank 1 dies
// (or freezes) in the middle of an all-reduce.
void peer_failure(const std::string& how, int timeout_ms, long bound_ms) {
  Process store({CTORCHRUN_STORE_BIN, "--host", "127.0.0.1", "--port", "0"});
  const int port = wait_for_listening_port(store, seconds(10));
  REQUIRE(port > 0);
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 3; ++r) {
    ranks.push_back(std::make_unique<Process>(
        std::vector<std::string>{CTORCHRUN_DIST_WORKER, "peer-death", "1", how,
                                 std::to_string(timeout_ms)},
        std::map<std::string, std::string>{{"RANK", std::to_string(r)},
                                           {"WORLD_SIZE", "3"},
                                           {"LOCAL_RANK", std::to_string(r)},
                                           {"MASTER_ADDR", "127.0.0.1"},
                                           {"MASTER_PORT", std::to_string(port)},
                                           {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                           {"TORCHELASTIC_RESTART_COUNT", "0"}}));
  }
  const std::regex failed("survivor (\\d) failed after (\\d+) ms: (.*)");
  int timed_out = 0;
  for (int r : {0, 2}) {
    std::string out = ranks[r]->read_all(seconds(60));
    INFO("rank " << r << ": " << out);
    std::smatch m;
    REQUIRE(std::regex_search(out, m, failed));
    CHECK(std::stol(m[2]) <= bound_ms);
    CHECK_THAT(m[3].str(), Catch::Contains("all_reduce of 1048576 float32"));
    // A frozen peer: the first survivor to time out exits, so the other may
    // see its connection close just before its own timer fires.
    if (m[3].str().find("timed out after") != std::string::npos) ++timed_out;
    CHECK(ranks[r]->exit_code(seconds(10)) == 7);
  }
  if (how == "stop") CHECK(timed_out >= 1);
  ranks[1]->signal(SIGKILL);
}

}  // namespace

namespace {

// Two ranks in processes of their own (gloo used to abort the process on
// some mismatches) call all_reduce with different arguments: both must get
// a ConfigError naming both calls, and the group must stay usable.
void mismatch(const std::string& kind, const std::string& call0, const std::string& call1) {
  INFO(kind);
  Process store({CTORCHRUN_STORE_BIN, "--host", "127.0.0.1", "--port", "0"});
  const int port = wait_for_listening_port(store, seconds(10));
  REQUIRE(port > 0);
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back(std::make_unique<Process>(
        std::vector<std::string>{CTORCHRUN_DIST_WORKER, "mismatch", kind, "5000"},
        std::map<std::string, std::string>{{"RANK", std::to_string(r)},
                                           {"WORLD_SIZE", "2"},
                                           {"LOCAL_RANK", std::to_string(r)},
                                           {"MASTER_ADDR", "127.0.0.1"},
                                           {"MASTER_PORT", std::to_string(port)},
                                           {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                           {"TORCHELASTIC_RESTART_COUNT", "0"}}));
  }
  for (int r = 0; r < 2; ++r) {
    std::string out = ranks[r]->read_all(seconds(60));
    INFO("rank " << r << ": " << out);
    const std::string rank = std::to_string(r);
    CHECK_THAT(out, Catch::Contains("mismatch " + rank + ": InvalidArgument: ") &&
                        Catch::Contains("rank 0: " + call0) && Catch::Contains("rank 1: " + call1));
    CHECK_THAT(out, Catch::Contains("after " + rank + ": ok"));
    CHECK(ranks[r]->exit_code(seconds(10)) == 0);
  }
}

}  // namespace

TEST_CASE("dist mismatch: all_reduces that differ across ranks fail on both, naming both calls",
          "[multiproc]") {
  mismatch("count", "all_reduce of 4 float32 (sum)", "all_reduce of 3 float32 (sum)");
  mismatch("dtype", "all_reduce of 4 float32 (sum)", "all_reduce of 4 int32 (sum)");
  mismatch("op", "all_reduce of 4 float32 (sum)", "all_reduce of 4 float32 (max)");
  mismatch("large", "all_reduce of 1000 float32 (sum)", "all_reduce of 500 float32 (sum)");
}

TEST_CASE("dist peers: a rank killed mid-collective makes the others fail at once", "[multiproc]") {
  // The group timeout is long; the survivors must not need it.
  peer_failure("kill", 60000, 20000);
}

TEST_CASE("dist peers: a rank frozen mid-collective makes the others time out", "[multiproc]") {
  peer_failure("stop", 1500, 15000);
}

TEST_CASE("dist trainer: a crash at epoch 3 and a restart end with the clean run's digest",
          "[multiproc]") {
  TempDir clean, crashed;
  auto a = train(2, clean.path, 5);
  auto b = train(2, crashed.path, 5, {"--fail-once-at-epoch", "3"}, {"--max_restarts=1"});
  CHECK(a["attempt"] == 0);
  CHECK(b["attempt"] == 1);
  CHECK(b["start_epoch"] == 3);
  CHECK(a["world"] == 2);
  CHECK(a["digest"] == b["digest"]);
  CHECK(a["digest"].get<std::string>().size() == 64);
}

TEST_CASE("dist trainer: without restarts the injected crash fails the job", "[multiproc]") {
  TempDir dir;
  auto r = launch(2, {CTORCHRUN_TRAIN_BIN, "--workdir", dir.path, "--epochs", "5",
                      "--fail-once-at-epoch", "1"});
  CHECK(r.exit_code == 1);
  CHECK_FALSE(file_exists(dir.file("result.json")));
}

TEST_CASE("dist trainer: world size 3 works and a world-size-2 checkpoint resumes at 3",
          "[multiproc]") {
  TempDir two, three, grown;
  auto at_two = train(2, two.path, 5);
  auto at_three = train(3, three.path, 5);
  CHECK(at_three["world"] == 3);
  train(2, grown.path, 3);
  auto resumed = train(3, grown.path, 5);
  CHECK(resumed["world"] == 3);
  CHECK(resumed["start_epoch"] == 3);
  // Gradients are summed as integers, so the world size changes nothing.
  CHECK(at_three["digest"] == at_two["digest"]);
  CHECK(resumed["digest"] == at_two["digest"]);
}

TEST_CASE("dist package: an out-of-tree project builds with find_package(ctorchrun)",
          "[multiproc]") {
  TempDir dir;
  auto run = [](const std::vector<std::string>& argv) {
    Process p(argv, {}, /*capture_stderr=*/true);
    std::string out = p.read_all(seconds(240));
    int code = p.exit_code(seconds(10));
    INFO(out);
    REQUIRE(code == 0);
    return out;
  };
  run({"/usr/bin/cmake", "--install", CTORCHRUN_BINARY_DIR, "--prefix", dir.file("prefix")});
  std::vector<std::string> configure = {
      "/usr/bin/cmake",
      "-S",
      std::string(CTORCHRUN_SOURCE_DIR) + "/tests/collectives/consumer",
      "-B",
      dir.file("build"),
      "-DCMAKE_PREFIX_PATH=" + dir.file("prefix"),
      "-DCMAKE_BUILD_TYPE=Release"};
  // A sanitized libctorch_dist needs its runtime first in the consumer too.
  const std::string sanitize = CTORCHRUN_SANITIZE;
  if (!sanitize.empty()) {
    configure.push_back("-DCMAKE_CXX_FLAGS=-fsanitize=" + sanitize);
    configure.push_back("-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=" + sanitize);
  }
  run(configure);
  run({"/usr/bin/cmake", "--build", dir.file("build")});
  auto out = run({dir.file("build/consumer"), dir.file("ckpt")});
  CHECK_THAT(out, Catch::Contains("consumer: ok"));
}

TEST_CASE("dist trainer: alone, --fail-rank 0 takes the injected crash and the restart resumes",
          "[multiproc]") {
  TempDir clean, crashed, untouched;
  auto a = train(1, clean.path, 4);
  auto b = train(1, crashed.path, 4, {"--fail-once-at-epoch", "2", "--fail-rank", "0"},
                 {"--max_restarts=1"});
  // The default failing rank is 1: alone, nothing fails.
  auto c = train(1, untouched.path, 4, {"--fail-once-at-epoch", "2"});
  CHECK(c["attempt"] == 0);
  CHECK(c["digest"] == a["digest"]);
  CHECK(b["attempt"] == 1);
  CHECK(b["start_epoch"] == 2);
  CHECK(a["digest"] == b["digest"]);
}
