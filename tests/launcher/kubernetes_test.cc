// ctorchrun in place of torchrun in Kubernetes manifests: the environment
// Kubeflow's operators write (training-operator v1's PyTorchJob with an
// elasticPolicy, Trainer v2), nothing on the command line but the script.
// Pods are network namespaces (or loopback agents); a namespace's own
// /etc/netns/<name>/hosts, edited while the test runs, plays the cluster DNS.

#include <signal.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <thread>

#include "tests/launcher/launcher_support.h"
#include "tests/support/netns_pair.h"

using namespace ctorchrun::testing;
using namespace std::chrono_literals;

namespace {

// /etc/netns/<ns>/hosts, which `ip netns exec` puts over /etc/hosts; removed
// on destruction. Appending keeps the file (the bind mount) the same.
struct NetnsHosts {
  explicit NetnsHosts(std::vector<std::string> namespaces) : names(std::move(namespaces)) {
    for (const std::string& ns : names) {
      std::filesystem::create_directories("/etc/netns/" + ns);
      std::ofstream("/etc/netns/" + ns + "/hosts") << "127.0.0.1 localhost\n";
    }
  }
  ~NetnsHosts() {
    std::error_code ec;
    for (const std::string& ns : names) std::filesystem::remove_all("/etc/netns/" + ns, ec);
  }
  void add(const std::string& addr, const std::string& name) const {
    for (const std::string& ns : names) {
      std::ofstream("/etc/netns/" + ns + "/hosts", std::ios::app) << addr << " " << name << "\n";
    }
  }
  std::vector<std::string> names;
};

}  // namespace

TEST_CASE(
    "kubernetes: a PyTorchJob's elastic environment runs unchanged, its endpoint's name "
    "resolving only after the pods start",
    "[netns]") {
  NetnsPair net;
  REQUIRE(net.ok);
  NetnsHosts hosts({net.a, net.b});
  TempDir d;
  // As training-operator v1 writes it for an elasticPolicy of 2 to 3 pods.
  const std::map<std::string, std::string> env = {
      {"PET_RDZV_ENDPOINT", "pytorchjob-master-0.pytorchjob:29400"},
      {"PET_RDZV_BACKEND", "c10d"},
      {"PET_NNODES", "2:3"},
      {"PET_MAX_RESTARTS", "1"},
      {"PET_NPROC_PER_NODE", "1"},
      {"PET_RDZV_ID", "6f1c2d3e-job-uid"},
      {"PET_RDZV_CONF", "join_timeout=60,last_call_timeout=1"},
      {"PET_STANDALONE", ""},
      {"CTORCHRUN_PYTHON", test_python()},
  };
  auto pod = [&](const std::string& ns, const std::string& name) {
    std::vector<std::string> argv = {CTORCHRUN_BIN, "--no_python", "/bin/sh", "-c",
                                     "echo $WORLD_SIZE $GROUP_RANK > " + d.path + "/" + name};
    return std::make_unique<Process>(net.in(ns, argv), env, /*capture_stderr=*/true);
  };
  auto master = pod(net.a, "master");  // the endpoint's own pod
  auto worker = pod(net.b, "worker");
  std::this_thread::sleep_for(2s);  // the headless service is not ready yet
  hosts.add(net.addr_a, "pytorchjob-master-0.pytorchjob");
  const int rc_master = master->exit_code(90s), rc_worker = worker->exit_code(90s);
  const std::string out_master = master->read_all(1s), out_worker = worker->read_all(1s);
  INFO("master:\n" << out_master << "\nworker:\n" << out_worker);
  CHECK(rc_master == 0);
  CHECK(rc_worker == 0);
  CHECK(read_file(d.file("master")).rfind("2 ", 0) == 0);
  CHECK(read_file(d.file("worker")).rfind("2 ", 0) == 0);
  CHECK(out_master.find("hosting the rendezvous store") != std::string::npos);
  CHECK(out_worker.find("hosting the rendezvous store") == std::string::npos);
}

TEST_CASE("kubernetes: Trainer v2's environment (static, nproc auto) runs unchanged",
          "[multiproc]") {
  TempDir d;
  const std::string port = std::to_string(free_port());
  auto node = [&](int rank) {
    return start_ctorchrun({"--no_python", "/bin/sh", "-c",
                            "echo $WORLD_SIZE $LOCAL_WORLD_SIZE > " + d.path + "/r$RANK"},
                           {{"PET_NNODES", "2"},
                            {"PET_NPROC_PER_NODE", "auto"},
                            {"PET_NODE_RANK", std::to_string(rank)},
                            {"PET_MASTER_ADDR", "127.0.0.1"},
                            {"PET_MASTER_PORT", port}});
  };
  auto n1 = node(1);
  auto n0 = node(0);
  CHECK(n0->exit_code(60s) == 0);
  CHECK(n1->exit_code(60s) == 0);
  const int cpus = static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
  const std::string expected = std::to_string(2 * cpus) + " " + std::to_string(cpus) + "\n";
  for (int r = 0; r < 2 * cpus; ++r) CHECK(read_file(d.file("r" + std::to_string(r))) == expected);
}

TEST_CASE(
    "kubernetes: a PyTorchJob pod lost under the elastic policy is replaced by a new one and "
    "the job re-forms without spending a restart",
    "[multiproc]") {
  TempDir d;
  const std::string port = std::to_string(free_port());
  // training-operator v1's environment for an elasticPolicy of 1 to 2 pods.
  const std::map<std::string, std::string> env = {
      {"PET_RDZV_ENDPOINT", "127.0.0.1:" + port},
      {"PET_RDZV_BACKEND", "c10d"},
      {"PET_NNODES", "1:2"},
      {"PET_MAX_RESTARTS", "0"},
      {"PET_NPROC_PER_NODE", "1"},
      {"PET_RDZV_ID", "job-uid"},
      {"PET_RDZV_CONF", "join_timeout=60,last_call_timeout=1"},
      {"PET_STANDALONE", ""},
  };
  auto pod = [&](const std::string& name, const std::string& addr) {
    std::map<std::string, std::string> e = env;
    e["PET_LOCAL_ADDR"] = addr;  // each pod its own address
    return start_ctorchrun(recording_worker(d.file(name), d.file("stop")), e);
  };
  auto a = pod("a", "127.0.0.2");
  // Every pod may host the endpoint's store on loopback; the first to bind
  // does. It must be a, the pod that lives: b's loss is the scenario.
  REQUIRE(wait_for_port(std::stoi(port), 30s));
  auto b = pod("b", "127.0.0.3");
  REQUIRE(wait_for_lines(d.file("a"), 1, 60s));
  REQUIRE(wait_for_lines(d.file("b"), 1, 60s));
  b->signal(SIGKILL);                            // the node is lost with its pod
  REQUIRE(wait_for_lines(d.file("a"), 2, 60s));  // a re-formed alone
  auto c = pod("c", "127.0.0.4");                // the replacement, under another address
  REQUIRE(wait_for_lines(d.file("c"), 1, 60s));
  REQUIRE(wait_for_lines(d.file("a"), 3, 60s));
  std::ofstream(d.file("stop")) << "x";
  CHECK(a->exit_code(60s) == 0);
  CHECK(c->exit_code(60s) == 0);
  const auto rounds = lines_of(d.file("a"));
  REQUIRE(rounds.size() >= 3);
  CHECK(rounds[0] == "2 0");
  CHECK(rounds[1] == "1 0");  // re-formations spend no restart (max_restarts=0)
  CHECK(rounds.back() == "2 0");
  CHECK(lines_of(d.file("c")).back() == "2 0");
}
