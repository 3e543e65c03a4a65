// Elastic membership with real agents: nodes that leave on purpose (SIGTERM,
// SIGINT), nodes that die while waiting to be admitted, a job stopped by
// signals and started again with the same id, and the endpoint's host lost
// while a node waits in the exit barrier. Under c10d with the endpoint's
// agent, c10d on a standalone ctorch-store (no agent hosts the store: group
// rank 0 publishes liveness), and etcd-v3 on a three-member cluster. Shell
// workers append "<WORLD_SIZE> <restarts charged> <GROUP_RANK>" to a file per
// agent and run until the test's stop file exists.

#include <signal.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <map>
#include <thread>

#include "tests/launcher/launcher_support.h"
#include "tests/support/dropping_proxy.h"
#include "tests/support/etcd_server.h"
#include "tests/support/process.h"

using namespace ctorchrun;
using namespace ctorchrun::testing;
using namespace std::chrono_literals;

namespace {

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

enum class Backend { kEndpointAgent, kStandaloneStore, kEtcd };

std::string backend_name(Backend b) {
  switch (b) {
    case Backend::kEndpointAgent:
      return "c10d, the endpoint's agent";
    case Backend::kStandaloneStore:
      return "c10d, a standalone store";
    case Backend::kEtcd:
      return "etcd-v3";
  }
  return "";
}

struct Job {
  explicit Job(Backend b) : backend(b) {
    if (backend == Backend::kStandaloneStore) {
      store = std::make_unique<Process>(
          std::vector<std::string>{CTORCHRUN_STORE_BIN, "--host", "127.0.0.1", "--port", "0"});
      port = std::to_string(wait_for_listening_port(*store, 10s));
      REQUIRE(port != "0");
    } else if (backend == Backend::kEtcd) {
      etcd = std::make_unique<EtcdCluster>(3);
    }
  }
  Backend backend;
  TempDir d;
  std::unique_ptr<Process> store;
  std::unique_ptr<EtcdCluster> etcd;
  std::string port = std::to_string(free_port());
  std::string id = "membership";
  std::string nnodes = "1:3";
  std::string max_restarts = "0";
  std::string conf =
      "join_timeout=30,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2,"
      "read_timeout=5";

  std::vector<std::string> rdzv_args() const {
    if (backend == Backend::kEtcd) {
      std::string list;
      for (const auto& e : etcd->client_endpoints()) list += (list.empty() ? "" : ",") + e;
      return {"--rdzv_backend=etcd-v3", "--rdzv_endpoint=" + list};
    }
    return {"--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:" + port};
  }
  // `body` runs after the worker recorded what it sees (default: until the
  // stop file exists, at most 60 s).
  std::unique_ptr<Process> agent(const std::string& name, std::string body = "") {
    if (body.empty()) {
      body = "i=0; while [ ! -e " + d.path +
             "/stop ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done";
    }
    std::vector<std::string> args = rdzv_args();
    for (std::string a : {"--nnodes=" + nnodes, "--rdzv_id=" + id, "--max_restarts=" + max_restarts,
                          "--rdzv_conf=" + conf, "--events_file=" + d.file("events_" + name)}) {
      args.push_back(a);
    }
    return start_ctorchrun(
        concat(args, sh("echo \"$WORLD_SIZE $CTORCHRUN_FAILED_RESTARTS $GROUP_RANK\" >> " + d.path +
                        "/seen_" + name + "; " + body)));
  }
  std::string seen(const std::string& name) const { return d.file("seen_" + name); }
  void stop() const { std::ofstream(d.file("stop")).close(); }
  std::string last(const std::string& name) const {
    auto lines = lines_of(seen(name));
    return lines.empty() ? std::string() : lines.back();
  }
  // The group rank in `name`'s last line.
  int group_rank(const std::string& name) const {
    const std::string l = last(name);
    return l.empty() ? -1 : std::stoi(l.substr(l.rfind(' ') + 1));
  }
  // The endpoint's agent must be up before the others connect.
  void first_agent_up() const {
    if (backend == Backend::kEndpointAgent) REQUIRE(wait_for_port(std::stoi(port), 30s));
  }
};

// Every agent's exit code (within `limit`) and all their output.
std::pair<std::vector<int>, std::string> ended(const std::vector<Process*>& agents,
                                               std::chrono::seconds limit = 30s) {
  std::vector<int> codes;
  std::string out;
  for (auto* p : agents) codes.push_back(p->exit_code(limit));
  for (auto* p : agents) out += p->read_all(1s) + "\n----\n";
  return {codes, out};
}

}  // namespace

TEST_CASE(
    "membership: a node killed or Ctrl-C'd while waiting to be admitted costs the running job "
    "nothing, no re-formation and no exit",
    "[multiproc]") {
  for (int sig : {SIGKILL, SIGINT}) {
    for (Backend b : {Backend::kEndpointAgent, Backend::kStandaloneStore}) {
      INFO(backend_name(b) << ", the waiter gets signal " << sig);
      Job job(b);
      job.conf =
          "join_timeout=30,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=2,"
          "read_timeout=5";
      auto a = job.agent("a");
      job.first_agent_up();
      REQUIRE(wait_for_lines(job.seen("a"), 1, 30s));
      auto w = job.agent("w");
      REQUIRE(wait_for_line(*w, "waiting to be admitted", 30s));
      w->signal(sig);
      CHECK(w->exit_code(10s) == 128 + sig);
      // Past the admission's last call: the members would have re-formed for it.
      std::this_thread::sleep_for(4s);
      CHECK(lines_of(job.seen("a")).size() == 1);
      job.stop();
      auto [codes, out] = ended({a.get()});
      INFO(out);
      CHECK(codes[0] == 0);
      CHECK_FALSE(contains(out, "gives way"));
    }
  }
}

TEST_CASE(
    "membership: a member stopped by SIGTERM or SIGINT leaves on purpose and the others re-form "
    "without it at once, whether it was group rank 0 or not, spending no restart",
    "[multiproc]") {
  for (Backend b : {Backend::kEndpointAgent, Backend::kStandaloneStore, Backend::kEtcd}) {
    for (int rank : {0, 2}) {
      // The endpoint's agent hosts the store: it is not the one stopped.
      if (b == Backend::kEndpointAgent && rank == 0) continue;
      int leaving_rank = rank;
      const int sig = rank == 0 ? SIGTERM : SIGINT;
      INFO(backend_name(b) << ", group rank " << leaving_rank << " gets signal " << sig);
      Job job(b);
      // Three at once: MAX, so round 0 has all of them.
      job.conf =
          "join_timeout=30,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2,"
          "read_timeout=5";
      std::map<std::string, std::unique_ptr<Process>> agents;
      agents["a"] = job.agent("a");
      job.first_agent_up();
      agents["b"] = job.agent("b");
      agents["c"] = job.agent("c");
      for (const char* n : {"a", "b", "c"}) REQUIRE(wait_for_lines(job.seen(n), 1, 30s));
      for (const char* n : {"a", "b", "c"}) REQUIRE(job.last(n).substr(0, 4) == "3 0 ");
      std::string leaver;
      for (const char* n : {"a", "b", "c"}) {
        if (job.group_rank(n) == leaving_rank) leaver = n;
      }
      // The endpoint's agent hosts the store: another one leaves.
      if (leaver == "a" && b == Backend::kEndpointAgent)
        leaver = job.group_rank("b") != 0 ? "b" : "c";
      REQUIRE_FALSE(leaver.empty());
      leaving_rank = job.group_rank(leaver);
      agents[leaver]->signal(sig);
      CHECK(agents[leaver]->exit_code(30s) == 128 + sig);
      std::vector<Process*> staying;
      for (auto& [n, p] : agents) {
        if (n == leaver) continue;
        staying.push_back(p.get());
        // A survivor slow to stop its workers (a sanitised build on a busy
        // machine) may come back after the other's last call and be admitted
        // a round later: what counts is that both run a world of 2 at restart
        // count 0.
        const auto until = std::chrono::steady_clock::now() + 30s;
        while (job.last(n).substr(0, 4) != "2 0 " && std::chrono::steady_clock::now() < until) {
          std::this_thread::sleep_for(100ms);
        }
        CHECK(lines_of(job.seen(n)).size() >= 2);
        CHECK(job.last(n).substr(0, 4) == "2 0 ");
      }
      job.stop();
      auto [codes, out] = ended(staying);
      INFO(out);
      for (int c : codes) CHECK(c == 0);
      CHECK(contains(out, "node " + std::to_string(leaving_rank) + " left"));
      CHECK_FALSE(contains(out, "restarting the workers"));
    }
  }
}

TEST_CASE(
    "membership: a job whose every node was stopped by signals starts again with the same id, "
    "the new agent forming a round instead of waiting as a spare",
    "[multiproc]") {
  for (Backend b : {Backend::kStandaloneStore, Backend::kEtcd}) {
    INFO(backend_name(b));
    Job job(b);
    job.nnodes = "1:2";
    job.conf =
        "join_timeout=30,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2,"
        "read_timeout=5";
    auto a = job.agent("a");
    auto b1 = job.agent("b");
    REQUIRE(wait_for_lines(job.seen("a"), 1, 30s));
    REQUIRE(wait_for_lines(job.seen("b"), 1, 30s));
    a->signal(SIGTERM);
    b1->signal(SIGTERM);
    CHECK(a->exit_code(30s) == 128 + SIGTERM);
    CHECK(b1->exit_code(30s) == 128 + SIGTERM);
    // The pod is recreated: the same command, the same id.
    auto again = job.agent("again");
    REQUIRE(wait_for_lines(job.seen("again"), 1, 20s));
    CHECK(job.last("again").substr(0, 2) == "1 ");
    job.stop();
    auto [codes, out] = ended({again.get()});
    INFO(out);
    CHECK(codes[0] == 0);
  }
}

TEST_CASE(
    "membership: a one-node job whose agent is killed after a restart comes back with the job's "
    "restart count rather than 0",
    "[multiproc]") {
  // The count the job spent lived only in the agent: the new agent's round,
  // formed by a newcomer alone, started from 0 and its workers had the
  // restarts already spent once more.
  for (Backend b : {Backend::kStandaloneStore, Backend::kEtcd}) {
    INFO(backend_name(b));
    Job job(b);
    job.nnodes = "1:2";
    job.max_restarts = "2";
    // Attempt 0's worker fails: restart 1. The new agent's workers must not
    // see 0, which would fail them again.
    const std::string body =
        "[ \"$CTORCHRUN_FAILED_RESTARTS\" = 0 ] && exit 1; i=0; while [ ! -e " + job.d.path +
        "/stop ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done";
    auto a = job.agent("a", body);
    REQUIRE(wait_for_lines(job.seen("a"), 2, 30s));
    CHECK(lines_of(job.seen("a")) == std::vector<std::string>{"1 0 0", "1 1 0"});
    // Killed (no leave, no close): the id stays the job's.
    a->signal_group(SIGKILL);
    CHECK(a->exit_code(10s) == 128 + SIGKILL);
    auto again = job.agent("again", body);
    REQUIRE(wait_for_lines(job.seen("again"), 1, 40s));
    CHECK(lines_of(job.seen("again")).front() == "1 1 0");
    job.stop();
    auto [codes, out] = ended({again.get()});
    INFO(out);
    CHECK(codes[0] == 0);
    CHECK(lines_of(job.seen("again")).size() == 1);
  }
}

TEST_CASE(
    "membership: a node whose workers succeeded exits 0 when the endpoint's host dies while it "
    "waits in the exit barrier, naming the endpoint",
    "[multiproc]") {
  Job job(Backend::kEndpointAgent);
  job.nnodes = "2:2";
  auto a = job.agent("a");  // runs until the stop file exists
  job.first_agent_up();
  auto b = job.agent("b", "exit 0");
  REQUIRE(wait_for_lines(job.seen("a"), 1, 30s));
  REQUIRE(wait_for_lines(job.seen("b"), 1, 30s));
  // b's worker is done: b waits for a in the exit barrier.
  for (int i = 0; i < 100 && !contains(read_file(job.d.file("events_b")), "worker_exited"); ++i) {
    std::this_thread::sleep_for(100ms);
  }
  REQUIRE(contains(read_file(job.d.file("events_b")), "worker_exited"));
  std::this_thread::sleep_for(500ms);
  a->signal_group(SIGKILL);
  const int rcb = b->exit_code(30s);
  const std::string out = b->read_all(1s);
  INFO(out);
  CHECK(rcb == 0);
  CHECK(contains(out, "127.0.0.1:" + job.port));
}

TEST_CASE(
    "membership: etcd leases revoked from outside (etcdctl lease revoke) bring the agents back "
    "under new leases, and the job goes on",
    "[multiproc]") {
  Job job(Backend::kEtcd);
  job.nnodes = "2:2";
  auto a = job.agent("a");
  auto b = job.agent("b");
  REQUIRE(wait_for_lines(job.seen("a"), 1, 30s));
  REQUIRE(wait_for_lines(job.seen("b"), 1, 30s));
  const std::string etcdctl =
      "ETCDCTL_API=3 /usr/bin/etcdctl --endpoints=" + job.etcd->client_endpoint(0) + " ";
  const std::string revoke = etcdctl + "lease list | tail -n +2 | while read id; do " + etcdctl +
                             "lease revoke $id >/dev/null; done";
  REQUIRE(std::system(revoke.c_str()) == 0);
  const bool back = wait_for_lines(job.seen("a"), 2, 30s) && wait_for_lines(job.seen("b"), 2, 30s);
  if (!back) {
    // What each agent did meanwhile.
    job.stop();
    auto [codes, out] = ended({a.get(), b.get()});
    INFO(out);
    FAIL("no new workers on both nodes within 30 s of the revocation");
  }
  CHECK(job.last("a").substr(0, 4) == "2 0 ");
  job.stop();
  auto [codes, out] = ended({a.get(), b.get()});
  INFO(out);
  CHECK(codes[0] == 0);
  CHECK(codes[1] == 0);
  CHECK(contains(out, "Coming back under a new lease"));
}

TEST_CASE(
    "membership: TORCHELASTIC_RESTART_COUNT counts a re-formation as torchrun 2.x does, while "
    "CTORCHRUN_FAILED_RESTARTS counts only the restarts charged",
    "[multiproc]") {
  Job job(Backend::kEndpointAgent);
  job.nnodes = "1:2";
  job.conf =
      "join_timeout=30,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2,"
      "read_timeout=5";
  const std::string counts =
      "echo \"$TORCHELASTIC_RESTART_COUNT $CTORCHRUN_FAILED_RESTARTS $CTORCHRUN_ROUND\" >> " +
      job.d.path + "/counts_$GROUP_RANK; i=0; while [ ! -e " + job.d.path +
      "/stop ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done";
  auto a = job.agent("a", counts);
  job.first_agent_up();
  auto b = job.agent("b", counts);
  REQUIRE(wait_for_lines(job.seen("a"), 1, 30s));
  REQUIRE(wait_for_lines(job.seen("b"), 1, 30s));
  REQUIRE(job.group_rank("a") == 0);
  b->signal_group(SIGKILL);
  REQUIRE(wait_for_lines(job.seen("a"), 2, 20s));
  job.stop();
  auto [codes, out] = ended({a.get()});
  INFO(out);
  CHECK(codes[0] == 0);
  // Round 0 at count 0; round 1 after the loss: one restart of the workers,
  // none charged.
  CHECK(read_file(job.d.file("counts_0")) == "0 0 0\n1 0 1\n");
}

TEST_CASE(
    "membership: an etcd answer lost after the write applied costs a node nothing, its "
    "enrolment recovered",
    "[multiproc]") {
  Job job(Backend::kEtcd);
  job.nnodes = "2:2";
  const std::string member = job.etcd->client_endpoint(0);
  DroppingProxy proxy("127.0.0.1",
                      static_cast<std::uint16_t>(std::stoi(member.substr(member.rfind(':') + 1))));
  // Node a reaches etcd through the proxy alone; its first tally enrolment
  // (entering round 0) reaches etcd, and the answer is lost.
  proxy.drop_answer_to({"POST /v3/kv/txn", "request_put", "count_only"});
  auto a = start_ctorchrun(
      concat({"--nnodes=2:2", "--rdzv_backend=etcd-v3", "--rdzv_endpoint=" + proxy.endpoint(),
              "--rdzv_id=" + job.id, "--max_restarts=0", "--rdzv_conf=" + job.conf},
             sh("echo \"$WORLD_SIZE $CTORCHRUN_FAILED_RESTARTS $GROUP_RANK\" >> " + job.seen("a") +
                "; i=0; while [ ! -e " + job.d.path + "/stop ] && [ $i -lt 600 ]; do sleep 0.1; " +
                "i=$((i+1)); done")));
  auto b = job.agent("b");
  const bool both = wait_for_lines(job.seen("a"), 1, 60s) && wait_for_lines(job.seen("b"), 1, 5s);
  if (!both) {
    job.stop();
    a->signal_group(SIGTERM);
    b->signal_group(SIGTERM);
    auto [codes, out] = ended({a.get(), b.get()});
    FAIL("the job did not run at world 2 (dropped " << proxy.dropped() << "):\n" << out);
  }
  CHECK(proxy.dropped() == 1);
  CHECK(job.last("a").substr(0, 4) == "2 0 ");
  job.stop();
  auto [codes, out] = ended({a.get(), b.get()});
  INFO(out);
  CHECK(codes[0] == 0);
  CHECK(codes[1] == 0);
}
