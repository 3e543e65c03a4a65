// Multi-node jobs that never hurt healthy work.
// Several ctorchrun agents on this host, shell workers, readiness by files.

#include <signal.h>

#include <catch2/catch.hpp>
#include <thread>

#include "tests/launcher/launcher_support.h"

using namespace ctorchrun::testing;
using namespace std::chrono_literals;

namespace {

// A shell loop that waits (bounded, 60 s) for `file` to exist.
std::string await_file(const std::string& file) {
  return "i=0; while [ ! -e " + file + " ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; ";
}

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

}  // namespace

TEST_CASE("multi-node: nodes of another job are refused and the running job is untouched",
          "[multiproc]") {
  TempDir d;
  std::string port = std::to_string(free_port());
  // Job A: one node whose worker runs until the test releases it.
  auto a = start_ctorchrun(concat({"--master_port=" + port},
                                  sh("echo 1 > " + d.file("a_started") + "; " +
                                     await_file(d.file("release")) + "touch " + d.file("a_done"))));
  REQUIRE(wait_for_file(d.file("a_started"), 30s));

  const std::vector<std::string> worker = sh("touch " + d.file("b_started_$RANK"));
  // Job B's node 0 cannot bind the port.
  auto r = run_ctorchrun(concat({"--nnodes=2", "--node_rank=0", "--master_port=" + port}, worker));
  INFO(r.output);
  CHECK(r.exit_code == 4);
  // Job B's node 1, same (default) run id: job A has formed.
  r = run_ctorchrun(concat(
      {"--nnodes=2", "--node_rank=1", "--master_port=" + port, "--rdzv_conf=timeout=20"}, worker));
  INFO(r.output);
  CHECK(r.exit_code == 3);
  CHECK(contains(r.output, "already formed"));
  // Job B's node 1 with a run id of its own: the store serves another job.
  r = run_ctorchrun(concat({"--nnodes=2", "--node_rank=1", "--master_port=" + port,
                            "--rdzv_id=jobB", "--rdzv_conf=timeout=20"},
                           worker));
  INFO(r.output);
  CHECK(r.exit_code == 3);
  CHECK(contains(r.output, "serves job 'none'"));
  CHECK_FALSE(file_exists(d.file("b_started_1")));
  CHECK_FALSE(file_exists(d.file("b_started_2")));

  // Job A goes on and succeeds.
  std::string release = d.file("release");
  if (std::FILE* f = std::fopen(release.c_str(), "w")) std::fclose(f);
  CHECK(a->exit_code(60s) == 0);
  std::string out = a->read_all(1s);
  INFO(out);
  CHECK(file_exists(d.file("a_done")));
  CHECK_FALSE(contains(out, "failed"));
}

TEST_CASE("multi-node: nodes that disagree on --nnodes both exit 2 naming both values",
          "[multiproc]") {
  TempDir d;
  std::string port = std::to_string(free_port());
  auto node = [&](int rank, int nnodes) {
    return start_ctorchrun(
        concat({"--nnodes=" + std::to_string(nnodes), "--node_rank=" + std::to_string(rank),
                "--master_port=" + port, "--rdzv_conf=timeout=30"},
               sh("touch " + d.file("started_$RANK"))));
  };
  auto n0 = node(0, 2);
  auto n1 = node(1, 3);
  int rc0 = n0->exit_code(40s), rc1 = n1->exit_code(40s);
  std::string out0 = n0->read_all(1s), out1 = n1->read_all(1s);
  INFO("node0:\n" << out0 << "\nnode1:\n" << out1);
  CHECK(rc0 == 2);
  CHECK(rc1 == 2);
  for (const auto& out : {out0, out1}) {
    CHECK(contains(out, "disagree on --nnodes: node 0 has 2, node 1"));
    CHECK(contains(out, "has 3"));
  }
  CHECK_FALSE(file_exists(d.file("started_0")));
  CHECK_FALSE(file_exists(d.file("started_1")));
}

TEST_CASE("multi-node: node 0 hosts the store at any address of this host, refuses others at once",
          "[multiproc]") {
  TempDir d;
  for (std::string addr : {"127.0.1.1", "127.0.0.2", "::1", "[::1]"}) {
    auto r = run_ctorchrun(
        concat({"--master_addr=" + addr, "--master_port=" + std::to_string(free_port()),
                "--rdzv_conf=timeout=20"},
               sh("echo \"$MASTER_ADDR\" > " + d.file("addr"))),
        {}, 60s);
    INFO(addr << "\n" << r.output);
    CHECK(r.exit_code == 0);
    std::string want = addr == "[::1]" ? "::1" : addr;
    CHECK(read_file(d.file("addr")) == want + "\n");
  }
  // Node 0 refuses at once an address that is not this host's, or none at all.
  for (std::string addr : {"192.0.2.1", "no-such-host.invalid"}) {
    auto t0 = std::chrono::steady_clock::now();
    auto r = run_ctorchrun(concat(
        {"--master_addr=" + addr, "--master_port=" + std::to_string(free_port())}, sh("true")));
    INFO(addr << "\n" << r.output);
    CHECK(r.exit_code == 4);
    CHECK(contains(r.output, "'" + addr + "'"));
    CHECK(std::chrono::steady_clock::now() - t0 < 20s);
  }
  // Another node retries a master that does not resolve until the timeout.
  auto r = run_ctorchrun(
      concat({"--nnodes=2", "--node_rank=1", "--master_addr=no-such-host.invalid",
              "--master_port=" + std::to_string(free_port()), "--rdzv_conf=timeout=1"},
             sh("true")));
  INFO(r.output);
  CHECK(r.exit_code == 3);
  CHECK(contains(r.output, "no-such-host.invalid"));
}

TEST_CASE(
    "multi-node: a node whose workers finished waits for a node still running, store host too",
    "[multiproc]") {
  for (int short_node : {0, 1}) {
    TempDir d;
    std::string port = std::to_string(free_port());
    // The short node's worker ends at once; the long one starts its 3 s only
    // then, so that both barriers outlast --exit_barrier_timeout many times.
    auto node = [&](int rank) {
      std::string body = rank == short_node ? "echo 1 > " + d.file("short_done")
                                            : await_file(d.file("short_done")) +
                                                  "sleep 3; echo 1 > " + d.file("long_done");
      return start_ctorchrun(
          concat({"--nnodes=2", "--node_rank=" + std::to_string(rank), "--master_port=" + port,
                  "--exit_barrier_timeout=0.5", "--rdzv_conf=timeout=30"},
                 sh(body)));
    };
    auto n0 = node(0);
    auto n1 = node(1);
    int rc0 = n0->exit_code(60s), rc1 = n1->exit_code(60s);
    std::string out0 = n0->read_all(1s), out1 = n1->read_all(1s);
    INFO("short node " << short_node << "\nnode0:\n" << out0 << "\nnode1:\n" << out1);
    CHECK(rc0 == 0);
    CHECK(rc1 == 0);
    CHECK(file_exists(d.file("long_done")));
  }
}

TEST_CASE("multi-node: a failure after the other node finished still restarts the whole job",
          "[multiproc]") {
  TempDir d;
  std::string port = std::to_string(free_port());
  auto node = [&](int rank) {
    // Node 0 finishes at once each attempt. Node 1 fails in attempt 0 once
    // node 0's worker has finished, and succeeds in attempt 1.
    std::string body = rank == 0 ? "echo $TORCHELASTIC_RESTART_COUNT > " + d.file("n0_attempt_") +
                                       "$TORCHELASTIC_RESTART_COUNT"
                                 : await_file(d.file("n0_attempt_0")) +
                                       "sleep 1; [ $TORCHELASTIC_RESTART_COUNT -ge 1 ] || exit 7";
    return start_ctorchrun(
        concat({"--nnodes=2", "--node_rank=" + std::to_string(rank), "--master_port=" + port,
                "--max_restarts=1", "--exit_barrier_timeout=0.5", "--rdzv_conf=timeout=30"},
               sh(body)));
  };
  auto n0 = node(0);
  auto n1 = node(1);
  int rc0 = n0->exit_code(60s), rc1 = n1->exit_code(60s);
  std::string out0 = n0->read_all(1s), out1 = n1->read_all(1s);
  INFO("node0:\n" << out0 << "\nnode1:\n" << out1);
  CHECK(rc0 == 0);
  CHECK(rc1 == 0);
  CHECK(file_exists(d.file("n0_attempt_1")));
}

TEST_CASE("multi-node: the store host declares a frozen node dead after the keep-alive window",
          "[multiproc]") {
  TempDir d;
  std::string port = std::to_string(free_port());
  auto node = [&](int rank) {
    return start_ctorchrun(
        concat({"--nnodes=2", "--node_rank=" + std::to_string(rank), "--master_port=" + port,
                "--rdzv_conf=timeout=30,keep_alive_interval=0.2,keep_alive_max_attempt=3"},
               sh("echo $$ > " + d.file("pid_$RANK") + "; exec sleep 60")));
  };
  auto n0 = node(0);
  auto n1 = node(1);
  REQUIRE(wait_for_file(d.file("pid_0"), 30s));
  REQUIRE(wait_for_file(d.file("pid_1"), 30s));
  n1->signal(SIGSTOP);
  int rc0 = n0->exit_code(60s);
  n1->signal(SIGKILL);
  std::string out0 = n0->read_all(1s);
  INFO(out0);
  CHECK(rc0 == 3);
  CHECK(out0.find("node 1 (") != std::string::npos);
  CHECK(out0.find("stopped responding") != std::string::npos);
  CHECK(process_gone_within(std::stoi(read_file(d.file("pid_0"))), 5s));
}

TEST_CASE(
    "multi-node: a node frozen past the keep-alive window that resumes while the others stop "
    "their workers ends the job with exit 3 naming it, never an internal error",
    "[multiproc]") {
  TempDir d;
  std::string port = std::to_string(free_port());
  // The workers take their SIGTERM grace (as scripts that checkpoint on it).
  auto node = [&](int rank) {
    return start_ctorchrun(
        concat({"--nnodes=2", "--node_rank=" + std::to_string(rank), "--master_port=" + port,
                "--shutdown_timeout=20",
                "--rdzv_conf=timeout=30,keep_alive_interval=0.2,keep_alive_max_attempt=3"},
               sh("trap 'echo x > " + d.file("term_$RANK") + "; sleep 3; exit 0' TERM; echo $$ > " +
                  d.file("pid_$RANK") + "; sleep 60 & wait")));
  };
  auto n0 = node(0);
  auto n1 = node(1);
  REQUIRE(wait_for_file(d.file("pid_0"), 30s));
  REQUIRE(wait_for_file(d.file("pid_1"), 30s));
  n1->signal(SIGSTOP);
  // Node 0 declares node 1 dead (0.6 s) and stops its workers (3 s of grace);
  // node 1 answers again before that grace is over.
  REQUIRE(wait_for_file(d.file("term_0"), 30s));
  n1->signal(SIGCONT);
  const int rc0 = n0->exit_code(60s), rc1 = n1->exit_code(60s);
  const std::string out0 = n0->read_all(1s), out1 = n1->read_all(1s);
  INFO("node 0:\n" << out0 << "\nnode 1:\n" << out1);
  CHECK(rc0 == 3);
  CHECK(out0.find("node 1 (") != std::string::npos);
  CHECK(rc1 != 70);
  CHECK(out0.find("internal error") == std::string::npos);
  CHECK(out1.find("internal error") == std::string::npos);
}
