// Two nodes on two "machines": network namespaces joined by a veth pair, each
// agent (and its workers) inside its own namespace, node 0's store reached
// through the veth address, never through loopback. Needs root (CI runs as
// root); without it the set-up fails the test rather than skipping it.

#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <random>
#include <regex>

#include "tests/launcher/launcher_support.h"
#include "tests/support/netns_pair.h"

using namespace ctorchrun::testing;
using namespace std::chrono_literals;

namespace {

std::unique_ptr<Process> agent_in(const NetnsPair& net, const std::string& ns,
                                  const std::vector<std::string>& args,
                                  std::map<std::string, std::string> env = {}) {
  std::vector<std::string> full = {CTORCHRUN_BIN};
  full.insert(full.end(), args.begin(), args.end());
  env.emplace("CTORCHRUN_PYTHON", test_python());
  return std::make_unique<Process>(net.in(ns, full), env, /*capture_stderr=*/true);
}

}  // namespace

TEST_CASE(
    "ctorchrun across network namespaces: two nodes rendezvous over a veth and restart together",
    "[netns]") {
  NetnsPair net;
  REQUIRE(net.ok);
  TempDir d;
  auto args = [&](int rank) {
    return std::vector<std::string>{
        "--nnodes=2",
        "--node_rank=" + std::to_string(rank),
        "--nproc_per_node=2",
        "--master_addr=" + net.addr_a,
        "--master_port=29500",
        "--max_restarts=1",
        "--rdzv_conf=timeout=60",
        "--no_python",
        "/bin/sh",
        "-c",
        "echo $MASTER_ADDR > " + d.path +
            "/master_${TORCHELASTIC_RESTART_COUNT}_$RANK; "
            "if [ $RANK = 3 ] && [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then exit 6; fi; "
            "if [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then sleep 30; fi"};
  };
  auto n1 = agent_in(net, net.b, args(1));  // the far node first
  auto n0 = agent_in(net, net.a, args(0));
  int rc0 = n0->exit_code(60s), rc1 = n1->exit_code(60s);
  std::string out0 = n0->read_all(1s), out1 = n1->read_all(1s);
  INFO("node0:\n" << out0 << "\nnode1:\n" << out1);
  CHECK(rc0 == 0);
  CHECK(rc1 == 0);
  for (int rank = 0; rank < 4; ++rank) {
    CHECK(read_file(d.file("master_1_" + std::to_string(rank))) == net.addr_a + "\n");
  }
  CHECK(out1.find("node 1 (") != std::string::npos);
}

TEST_CASE("ctorchrun across network namespaces: a torch DDP job over gloo matches the one-node run",
          "[netns]") {
  NetnsPair net;
  REQUIRE(net.ok);
  TempDir d;
  const std::string example = CTORCHRUN_SOURCE_DIR "/examples/ddp_train.py";
  // The same job on one node with two workers, for the reference digest.
  auto local = run_ctorchrun({"--standalone", "--nproc_per_node=2", example, "--workdir",
                              d.file("local"), "--epochs", "2"});
  REQUIRE(local.exit_code == 0);
  auto args = [&](int rank) {
    return std::vector<std::string>{"--nnodes=2",
                                    "--node_rank=" + std::to_string(rank),
                                    "--nproc_per_node=1",
                                    "--master_addr=" + net.addr_a,
                                    "--master_port=29500",
                                    "--rdzv_conf=timeout=60",
                                    example,
                                    "--workdir",
                                    d.file("two_nodes"),
                                    "--epochs",
                                    "2"};
  };
  auto n0 = agent_in(net, net.a, args(0), {{"GLOO_SOCKET_IFNAME", net.if_a}});
  auto n1 = agent_in(net, net.b, args(1), {{"GLOO_SOCKET_IFNAME", net.if_b}});
  int rc0 = n0->exit_code(120s), rc1 = n1->exit_code(120s);
  std::string out0 = n0->read_all(1s), out1 = n1->read_all(1s);
  INFO("node0:\n" << out0 << "\nnode1:\n" << out1);
  REQUIRE(rc0 == 0);
  REQUIRE(rc1 == 0);
  std::regex digest("\"digest\": *\"([0-9a-f]{64})\"");
  std::smatch m1, m2;
  std::string a = read_file(d.file("local/result.json")),
              b = read_file(d.file("two_nodes/result.json"));
  REQUIRE(std::regex_search(a, m1, digest));
  REQUIRE(std::regex_search(b, m2, digest));
  CHECK(m1[1] == m2[1]);
}
