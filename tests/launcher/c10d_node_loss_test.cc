// Elastic c10d jobs that lose a node. Real
// agents on loopback, killed with SIGKILL of their process group; shell
// workers record what they see, and torch workers for the real thing.

#include <signal.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "tests/launcher/launcher_support.h"
#include "tests/support/process.h"

using namespace ctorchrun;
using namespace ctorchrun::testing;
using namespace std::chrono_literals;

namespace {

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

struct Job {
  TempDir d;
  std::string port = std::to_string(free_port());
  std::string nnodes = "1:3";
  std::string conf =
      "join_timeout=30,last_call_timeout=1,keep_alive_interval=1,"
      "keep_alive_max_attempt=2";

  std::unique_ptr<Process> agent(const std::string& name) {
    return start_ctorchrun(
        concat({"--nnodes=" + nnodes, "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:" + port,
                "--rdzv_id=loss", "--max_restarts=0", "--rdzv_conf=" + conf,
                "--events_file=" + d.file("events_" + name)},
               recording_worker(d.path + "/seen_" + name, d.path + "/stop")));
  }
  std::string seen(const std::string& name) const { return d.file("seen_" + name); }
  void stop() const { std::ofstream(d.file("stop")).close(); }
};

}  // namespace

TEST_CASE(
    "c10d node loss: a node whose agent is SIGKILLed at --max_restarts=0: the survivors re-form at "
    "once without it, spend no restart and finish",
    "[multiproc]") {
  Job job;
  auto a = job.agent("a");
  REQUIRE(wait_for_port(std::stoi(job.port), 30s));
  auto b = job.agent("b");
  auto c = job.agent("c");
  // Three nodes join at once: MAX, so round 0 has all three.
  REQUIRE(wait_for_lines(job.seen("a"), 1, 30s));
  REQUIRE(wait_for_lines(job.seen("c"), 1, 30s));
  REQUIRE(lines_of(job.seen("a")).back() == "3 0");
  c->signal_group(SIGKILL);
  CHECK(c->exit_code(10s) == 128 + SIGKILL);
  // The survivors run a world of 2, restart count still 0.
  REQUIRE(wait_for_lines(job.seen("a"), 2, 20s));
  REQUIRE(wait_for_lines(job.seen("b"), 2, 20s));
  CHECK(lines_of(job.seen("a"))[1] == "2 0");
  CHECK(lines_of(job.seen("b"))[1] == "2 0");
  job.stop();
  int rca = a->exit_code(30s), rcb = b->exit_code(30s);
  std::string out = a->read_all(1s) + "\n----\n" + b->read_all(1s);
  INFO(out);
  CHECK(rca == 0);
  CHECK(rcb == 0);
  // b and c arrive together: c is group rank 1 or 2.
  CHECK((contains(out, "gives way to the next: lost node 2 (agent exited)") ||
         contains(out, "gives way to the next: lost node 1 (agent exited)")));
  const std::string events = read_file(job.d.file("events_a"));
  INFO(events);
  CHECK(count_lines_with(events, "\"event\":\"node_lost\"") == 1);
  CHECK(count_lines_with(events, "\"cause\":\"agent exited\"") == 1);
  CHECK(count_lines_with(events, "\"event\":\"restart\"") == 0);
}

TEST_CASE(
    "c10d node loss: a loss below MIN waits for nodes until join_timeout, then exits 3 naming how "
    "many joined",
    "[multiproc]") {
  Job job;
  job.nnodes = "2:2";
  job.conf = "join_timeout=3,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2";
  auto a = job.agent("a");
  REQUIRE(wait_for_port(std::stoi(job.port), 30s));
  auto b = job.agent("b");
  REQUIRE(wait_for_lines(job.seen("a"), 1, 30s));
  b->signal_group(SIGKILL);
  const auto t0 = std::chrono::steady_clock::now();
  int rca = a->exit_code(30s);
  const auto took = std::chrono::steady_clock::now() - t0;
  std::string out = a->read_all(1s);
  INFO(out);
  CHECK(rca == 3);
  CHECK(contains(out, "1 of min 2, max 2 nodes joined round 1"));
  CHECK(took < 20s);  // bounded by join_timeout (3 s), not by a default
}

TEST_CASE("c10d node loss: a spare takes a lost node's place in the next round", "[multiproc]") {
  Job job;
  job.nnodes = "1:2";
  auto a = job.agent("a");
  REQUIRE(wait_for_port(std::stoi(job.port), 30s));
  auto b = job.agent("b");
  REQUIRE(wait_for_lines(job.seen("b"), 1, 30s));
  auto spare = job.agent("s");
  REQUIRE(wait_for_line(*spare, "waiting as a spare", 30s));
  b->signal_group(SIGKILL);
  REQUIRE(wait_for_lines(job.seen("s"), 1, 20s));
  CHECK(lines_of(job.seen("s"))[0] == "2 0");
  REQUIRE(wait_for_lines(job.seen("a"), 2, 20s));
  CHECK(lines_of(job.seen("a"))[1] == "2 0");
  job.stop();
  int rca = a->exit_code(30s), rcs = spare->exit_code(30s);
  INFO(a->read_all(1s) + "\n----\n" + spare->read_all(1s));
  CHECK(rca == 0);
  CHECK(rcs == 0);
}

TEST_CASE(
    "c10d node loss: the endpoint host's loss ends the other nodes with exit 3 within the liveness "
    "bound, naming the cause",
    "[multiproc]") {
  Job job;
  job.nnodes = "1:2";
  auto a = job.agent("a");
  REQUIRE(wait_for_port(std::stoi(job.port), 30s));
  auto b = job.agent("b");
  REQUIRE(wait_for_lines(job.seen("b"), 1, 30s));
  a->signal_group(SIGKILL);
  const auto t0 = std::chrono::steady_clock::now();
  int rcb = b->exit_code(30s);
  const auto took = std::chrono::steady_clock::now() - t0;
  std::string out = b->read_all(1s);
  INFO(out);
  CHECK(rcb == 3);
  CHECK(contains(out, "lost the rendezvous store at the endpoint 127.0.0.1:" + job.port));
  CHECK(took < 15s);  // liveness bound 2 s, plus the workers' stop
}

TEST_CASE(
    "c10d node loss: torch workers (gloo) that lose a peer node: the failure it causes is refunded "
    "and the survivor finishes at --max_restarts=0",
    "[torch]") {
  TempDir d;
  const std::string port = std::to_string(free_port());
  const std::string worker = CTORCHRUN_SOURCE_DIR "/tests/torch/elastic_worker.py";
  auto agent = [&] {
    return start_ctorchrun(
        {"--nnodes=1:2", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:" + port,
         "--rdzv_id=torchloss", "--max_restarts=0",
         "--rdzv_conf=join_timeout=120,last_call_timeout=1,keep_alive_interval=1,"
         "keep_alive_max_attempt=2",
         worker},
        {{"ELASTIC_TARGET_WORLD", "1"}});
  };
  auto a = agent();
  REQUIRE(wait_for_port(std::stoi(port), 30s));
  auto b = agent();
  REQUIRE(wait_for_line(*a, "JOINED rank=0 world=2", 120s));
  b->signal_group(SIGKILL);
  int rca = a->exit_code(120s);
  std::string out = a->read_all(1s);
  INFO(out);
  CHECK(rca == 0);
  CHECK(contains(out, "GROWN rank=0 world=1 sum=1 restart=0 count=1"));
  CHECK(contains(out, "lost node 1 (agent exited)"));
}
