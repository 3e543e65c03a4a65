// --hang_timeout end to end, with real torch gloo workers (hang_worker.py)
// under ctorchrun agents on loopback: a true hang is found, named and
// restarted; slow work of many shapes is never taken for one.

#include <time.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <regex>
#include <thread>

#include "tests/launcher/launcher_support.h"
#include "tests/support/etcd_server.h"

using namespace ctorchrun::testing;
using namespace std::chrono_literals;

namespace {

const std::string kWorker = std::string(CTORCHRUN_SOURCE_DIR) + "/tests/torch/hang_worker.py";

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

// The events named `name` in an --events_file.
std::vector<nlohmann::json> events(const std::string& path, const std::string& name) {
  std::vector<nlohmann::json> out;
  for (const auto& line : lines_of(path)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.value("event", "") == name) out.push_back(j);
  }
  return out;
}

// Seconds since the epoch of an event's RFC 3339 "time" (UTC, milliseconds).
double event_time(const nlohmann::json& e) {
  const std::string t = e.at("time").get<std::string>();
  std::tm tm{};
  REQUIRE(strptime(t.c_str(), "%Y-%m-%dT%H:%M:%S", &tm) != nullptr);
  const double ms = std::stod(t.substr(20, 3));
  return static_cast<double>(timegm(&tm)) + ms / 1000.0;
}

// One node of a single-node job in `mode`, past a timeout of 2 s: the slow
// phase lasts 5 s. Returns the launcher's result.
LaunchResult run_false_positive(const std::string& mode, const TempDir& d) {
  return run_ctorchrun({"--standalone", "--nproc_per_node=2", "--hang_timeout=2",
                        "--events_file=" + d.file("events.json"), "--log_dir=" + d.file("logs"),
                        kWorker, mode, "--long-s", "5", "--steps", "4", "--done-dir", d.path},
                       {}, 120s);
}

void require_no_hang(const std::string& mode) {
  TempDir d;
  auto r = run_false_positive(mode, d);
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(events(d.file("events.json"), "hang_detected").empty());
  CHECK_FALSE(contains(r.output, "hang detected"));
  CHECK_FALSE(contains(r.output, "hang: "));
  CHECK(file_exists(d.file("rank0")));
  CHECK(file_exists(d.file("rank1")));
}

// Two agents of a 2 x 2 gloo job in which rank 3 sleeps forever before its
// step-5 work in attempt 0; `rendezvous(n)` gives node n's rendezvous flags.
void check_hang_found_and_restarted(
    const std::function<std::vector<std::string>(int node)>& rendezvous) {
  TempDir d;
  auto node = [&](int n) {
    return start_ctorchrun(
        concat(rendezvous(n), {"--nproc_per_node=2", "--hang_timeout=5", "--max_restarts=1",
                               "--log_dir=" + d.file("logs" + std::to_string(n)),
                               "--events_file=" + d.file("events" + std::to_string(n) + ".json"),
                               kWorker, "hang", "--done-dir", d.path}));
  };
  auto n0 = node(0);
  auto n1 = node(1);
  std::string out0;
  std::thread reader([&] { out0 = n0->read_all(150s); });
  const std::string out1 = n1->read_all(150s);
  reader.join();
  INFO("node 0:\n" << out0 << "\nnode 1:\n" << out1);
  CHECK(n0->exit_code(10s) == 0);
  CHECK(n1->exit_code(10s) == 0);
  // The agent that holds ranks 2-3 (group rank 1: under c10d the rendezvous
  // decides which).
  const int g1 = contains(out0, "group_rank=1 ") ? 0 : 1;
  REQUIRE(contains(g1 == 0 ? out0 : out1, "group_rank=1 "));
  const std::string& out_g1 = g1 == 0 ? out0 : out1;
  const std::string g1_name = std::to_string(g1);
  const std::string g0_name = std::to_string(1 - g1);
  // Found within the timeout + 2 s of rank 3 falling asleep.
  auto hung = events(d.file("events" + g1_name + ".json"), "hang_detected");
  REQUIRE(hung.size() == 1);
  CHECK(hung[0]["first_stalled_rank"] == 3);
  CHECK(hung[0]["ranks"] == nlohmann::json({0, 1, 2, 3}));
  CHECK(hung[0]["timeout_s"] == 5.0);
  REQUIRE(events(d.file("events" + g0_name + ".json"), "hang_detected").size() == 1);
  const double slept_at = std::stod(read_file(d.file("sleep_at")));
  const double found_after = event_time(hung[0]) - slept_at;
  CHECK(found_after >= 5.0);
  CHECK(found_after <= 7.0);
  // The node of rank 3 names every rank's frame, grouped.
  CHECK(contains(out_g1, "first stalled: rank 3 (node 1"));
  CHECK(contains(out_g1, "ranks 0-2 in all_reduce at distributed_c10d.py"));
  CHECK(contains(out_g1, "rank 3 in main at hang_worker.py"));
  CHECK(contains(out_g1, "time.sleep(3600)"));
  CHECK(contains(out_g1, "failed with hang; restarting"));
  CHECK_FALSE(contains(out_g1, "failed with signal"));
  // Stacks on disk, native ones too where eu-stack is installed.
  auto restarts = events(d.file("events0.json"), "restart");
  CHECK(restarts.size() == 1);
  const std::string logs1 = d.file("logs" + g1_name);
  std::string hang_txt;
  for (const auto& e : std::filesystem::recursive_directory_iterator(logs1)) {
    if (e.path().filename() == "hang.txt" && e.path().parent_path().filename() == "1" &&
        e.path().parent_path().parent_path().filename() == "attempt_0") {
      hang_txt = read_file(e.path().string());
    }
  }
  CHECK(contains(hang_txt, "hang report: rank 3"));
  CHECK(contains(hang_txt, "most recent call first"));
  CHECK(contains(hang_txt, "time.sleep"));
  if (file_exists("/usr/bin/eu-stack")) CHECK(contains(hang_txt, "native stacks (eu-stack)"));
  // Attempt 1 (no sleep) finished on every rank.
  for (int r = 0; r < 4; ++r) {
    CHECK(read_file(d.file("rank" + std::to_string(r))) == "attempt 1\n");
  }
}

}  // namespace

TEST_CASE("hang: a rank asleep before all_reduce on a 2-node gloo job is named and restarted",
          "[torch]") {
  const std::string port = std::to_string(free_port());
  check_hang_found_and_restarted([&](int n) {
    return std::vector<std::string>{"--nnodes=2", "--node_rank=" + std::to_string(n),
                                    "--master_port=" + port};
  });
}

TEST_CASE("hang: the same hang under the c10d rendezvous is named and restarted", "[torch]") {
  const std::string port = std::to_string(free_port());
  check_hang_found_and_restarted([&](int) {
    return std::vector<std::string>{"--nnodes=2", "--rdzv_backend=c10d",
                                    "--rdzv_endpoint=127.0.0.1:" + port, "--rdzv_id=hang"};
  });
}

TEST_CASE("hang: the same hang under the etcd-v3 rendezvous is named and restarted", "[torch]") {
  EtcdCluster etcd(1);
  std::string endpoints;
  for (const auto& e : etcd.client_endpoints()) endpoints += (endpoints.empty() ? "" : ",") + e;
  check_hang_found_and_restarted([&](int) {
    return std::vector<std::string>{"--nnodes=2", "--rdzv_backend=etcd-v3",
                                    "--rdzv_endpoint=" + endpoints, "--rdzv_id=hang"};
  });
}

TEST_CASE("hang: workers blocked on a stdout pipe nobody reads are found with their stacks",
          "[torch]") {
  TempDir d;
  // The launcher's stdout, which its workers write to, is a pipe this test
  // never reads; its stderr goes to a file.
  Process p({"/bin/sh", "-c",
             "exec " + std::string(CTORCHRUN_BIN) +
                 " --standalone --nproc_per_node=2 --hang_timeout=2 --log_dir=" + d.file("logs") +
                 " --events_file=" + d.file("events.json") + " " + kWorker + " flood --done-dir " +
                 d.path + " 2>" + d.file("stderr.log")},
            {{"CTORCHRUN_PYTHON", test_python()}});
  CHECK(p.exit_code(90s) == 1);
  const std::string err = read_file(d.file("stderr.log"));
  INFO(err);
  CHECK(contains(err, "in flood at hang_worker.py"));
  // A hang keeps torch's exitcode field (how the stalled worker then ended)
  // and says so in its traceback.
  CHECK(std::regex_search(err, std::regex("\n  exitcode  : -?[0-9]+ \\(pid: [0-9]+\\) ")));
  CHECK(contains(err, "\n  traceback : hang: no worker progressed"));
  CHECK_FALSE(contains(err, "exitcode  : hang"));
  REQUIRE(events(d.file("events.json"), "hang_detected").size() == 1);
  auto diagnosed = events(d.file("events.json"), "hang_diagnosed");
  REQUIRE(diagnosed.size() == 1);
  CHECK(diagnosed[0]["frames"].get<std::string>().find("ranks 0-1 in flood") != std::string::npos);
  // The whole diagnosis within its bound.
  CHECK(diagnosed[0]["diagnosis_ms"].get<int>() <= 10'000);
}

TEST_CASE("hang: one slow rank while the others wait in all_reduce is no hang", "[torch]") {
  require_no_hang("slow");
}

TEST_CASE("hang: a long checkpoint save on rank 0 while the others wait is no hang", "[torch]") {
  require_no_hang("checkpoint");
}

TEST_CASE("hang: ranks waiting on data-loader children doing CPU or I/O work is no hang",
          "[torch]") {
  require_no_hang("loader");
}

TEST_CASE("hang: a long compile-like CPU phase before the first collective is no hang", "[torch]") {
  require_no_hang("compile");
}

TEST_CASE(
    "hang: --hang_timeout still judges the job after a node's workers all finished, the "
    "finished node counting as stalled",
    "[multiproc]") {
  const std::string port = std::to_string(free_port());
  auto node = [&](int rank) {
    // Node 0's worker is done at once; node 1's sleeps (no CPU, no output).
    return start_ctorchrun(
        concat({"--nnodes=2", "--node_rank=" + std::to_string(rank), "--master_port=" + port,
                "--hang_timeout=3", "--shutdown_timeout=2"},
               sh("if [ $GROUP_RANK = 0 ]; then exit 0; fi; exec sleep 40")));
  };
  const auto t0 = std::chrono::steady_clock::now();
  auto n0 = node(0);
  auto n1 = node(1);
  const int rc0 = n0->exit_code(60s), rc1 = n1->exit_code(60s);
  const std::string out0 = n0->read_all(1s), out1 = n1->read_all(1s);
  INFO("node 0:\n" << out0 << "\nnode 1:\n" << out1);
  CHECK(rc0 == 1);
  CHECK(rc1 == 1);
  CHECK(std::chrono::steady_clock::now() - t0 < 35s);  // not the 40 s sleep
  CHECK((out0 + out1).find("hang") != std::string::npos);
  CHECK(out1.find("rank      : 1") != std::string::npos);
}
