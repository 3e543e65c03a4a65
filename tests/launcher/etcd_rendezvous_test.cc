// --rdzv_backend=etcd-v3, real agents against
// real etcd processes (tests/support/etcd_server.h) on loopback. Shell
// workers record what they see and run until the test's stop file exists.

#include <signal.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <future>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "cli/command_line.h"
#include "etcd/client.h"
#include "rendezvous/coordination.h"
#include "tests/cli/parse_support.h"
#include "tests/launcher/launcher_support.h"
#include "tests/support/etcd_server.h"
#include "tests/support/process.h"

using namespace ctorchrun;
using namespace ctorchrun::testing;
using namespace std::chrono_literals;

namespace {

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ",") + s;
  return out;
}

struct EtcdJob {
  explicit EtcdJob(EtcdCluster& cluster) : etcd(cluster) {}
  EtcdCluster& etcd;
  TempDir d;
  std::string id = "etcdjob";
  std::string nnodes = "1:3";
  std::string conf =
      "join_timeout=30,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2,"
      "read_timeout=5";

  // Each worker appends "<WORLD_SIZE> <restart count> <GROUP_RANK>" to seen_<name>.
  std::unique_ptr<Process> agent(const std::string& name) {
    return start_ctorchrun(
        concat({"--nnodes=" + nnodes, "--rdzv_backend=etcd-v3",
                "--rdzv_endpoint=" + join(etcd.client_endpoints()), "--rdzv_id=" + id,
                "--max_restarts=0", "--rdzv_conf=" + conf},
               sh("echo \"$WORLD_SIZE $CTORCHRUN_FAILED_RESTARTS $GROUP_RANK\" >> " + d.path +
                  "/seen_" + name + "; i=0; while [ ! -e " + d.path +
                  "/stop ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done")));
  }
  std::string seen(const std::string& name) const { return d.file("seen_" + name); }
  void stop() const { std::ofstream(d.file("stop")).close(); }
  // The last line name's workers appended ("" before any).
  std::string last(const std::string& name) const {
    auto lines = lines_of(seen(name));
    return lines.empty() ? std::string() : lines.back();
  }
  // One agent per name, each with its first worker started.
  std::vector<std::unique_ptr<Process>> running(const std::vector<std::string>& names) {
    std::vector<std::unique_ptr<Process>> agents;
    for (const auto& n : names) agents.push_back(agent(n));
    for (const auto& n : names) REQUIRE(wait_for_lines(seen(n), 1, 30s));
    return agents;
  }
  // Each agent's exit code (within `limit`), and all their output.
  static std::pair<std::vector<int>, std::string> ended(
      const std::vector<std::unique_ptr<Process>>& agents, std::chrono::seconds limit = 30s) {
    std::vector<int> codes;
    std::string out;
    for (const auto& p : agents) codes.push_back(p->exit_code(limit));
    for (const auto& p : agents) out += p->read_all(1s) + "\n----\n";
    return {codes, out};
  }
};

// etcd's count of the ranges (reads) one member has served, from its metrics.
long long etcd_ranges(const std::string& endpoint) {
  const std::string cmd =
      "/usr/bin/python3 -c \"import urllib.request; print(next(l.split()[1] "
      "for l in urllib.request.urlopen('http://" +
      endpoint +
      "/metrics', timeout=5).read().decode().splitlines() if "
      "l.startswith('etcd_mvcc_range_total ')))\"";
  FILE* f = ::popen(cmd.c_str(), "r");
  if (f == nullptr) return -1;
  char buf[64] = {0};
  const bool got = std::fgets(buf, sizeof buf, f) != nullptr;
  ::pclose(f);
  return got ? std::atoll(buf) : -1;
}

// What a finished job leaves under its prefix: the closed marker alone, on a
// lease (it expires after join_timeout).
void expect_only_closed_marker(const EtcdCluster& etcd, const std::string& id) {
  etcd::EtcdClient client(etcd.client_endpoints(), 5s);
  auto left = client.range_prefix("/ctorchrun/" + id + "/");
  std::string keys;
  for (const auto& kv : left.kvs) keys += kv.key + " ";
  INFO(keys);
  REQUIRE(left.kvs.size() == 1);
  CHECK(left.kvs[0].key == "/ctorchrun/" + id + "/g0/rdzv/closed");
  CHECK(left.kvs[0].lease != 0);
}

}  // namespace

TEST_CASE(
    "etcd-v3: etcd-v3 takes a list of members, etcd and etcd-v2 with a notice, https with "
    "certificates, and the contradictions refused",
    "[unit]") {
  auto r = parse({"--nnodes=1:3", "--rdzv_backend=etcd", "--rdzv_endpoint=h1:2379,h2,[::1]:23",
                  "--rdzv_id=j", "s.py"});
  REQUIRE(r.kind == cli::ParseOutcome::Kind::kRun);
  CHECK(r.config.rdzv_backend == "etcd-v3");
  CHECK(r.config.etcd_endpoints == std::vector<std::string>{"h1:2379", "h2:2379", "[::1]:23"});
  CHECK_FALSE(r.config.etcd_tls);
  REQUIRE(r.notices.size() == 1);
  CHECK(contains(r.notices[0], "etcd's v3 API"));
  auto prefix = parse(
      {"--rdzv_backend=etcd-v3", "--rdzv_endpoint=h1", "--rdzv_conf=etcd_prefix=/jobs/", "s.py"});
  REQUIRE(prefix.kind == cli::ParseOutcome::Kind::kRun);
  CHECK(prefix.config.etcd_prefix == "/jobs");

  // https:// endpoints, torch's keys.
  auto https = parse({"--rdzv_backend=etcd-v3", "--rdzv_endpoint=https://h1:2379,https://h2",
                      "--rdzv_conf=cacert=/ca.pem,cert=/c.pem,key=/k.pem", "s.py"});
  INFO(https.message);
  REQUIRE(https.kind == cli::ParseOutcome::Kind::kRun);
  CHECK(https.config.etcd_tls);
  CHECK(https.config.etcd_endpoints == std::vector<std::string>{"h1:2379", "h2:2379"});
  CHECK(https.config.etcd_cacert == "/ca.pem");
  CHECK(https.config.etcd_cert == "/c.pem");
  CHECK(https.config.etcd_key == "/k.pem");
  // protocol=https with bare endpoints, the other spellings; no cacert: the
  // system's trust store.
  auto proto = parse({"--rdzv_backend=etcd-v3", "--rdzv_endpoint=h1",
                      "--rdzv_conf=protocol=HTTPS,ssl_cert=/c.pem,ssl_cert_key=/k.pem", "s.py"});
  REQUIRE(proto.kind == cli::ParseOutcome::Kind::kRun);
  CHECK(proto.config.etcd_tls);
  CHECK(proto.config.etcd_cacert.empty());
  CHECK(proto.config.etcd_cert == "/c.pem");
  CHECK(proto.config.etcd_key == "/k.pem");
  auto ca_only = parse({"--rdzv_backend=etcd-v3", "--rdzv_endpoint=https://h1",
                        "--rdzv_conf=ca_cert=/ca.pem,protocol=https", "s.py"});
  REQUIRE(ca_only.kind == cli::ParseOutcome::Kind::kRun);
  CHECK(ca_only.config.etcd_tls);
  CHECK(ca_only.config.etcd_cacert == "/ca.pem");
  auto plain = parse({"--rdzv_backend=etcd-v3", "--rdzv_endpoint=http://h1,http://h2",
                      "--rdzv_conf=protocol=http", "s.py"});
  REQUIRE(plain.kind == cli::ParseOutcome::Kind::kRun);
  CHECK_FALSE(plain.config.etcd_tls);

  for (const auto& [bad, says] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--rdzv_backend=etcd-v3", "s.py"}, "needs --rdzv_endpoint"},
           {{"--rdzv_backend=etcd-v3", "--rdzv_endpoint=https://h1,http://h2", "s.py"}, "mixes"},
           {{"--rdzv_backend=etcd-v3", "--rdzv_endpoint=https://h1,h2", "--rdzv_conf=protocol=http",
             "s.py"},
            "contradicts"},
           {{"--rdzv_backend=etcd-v3", "--rdzv_endpoint=http://h1", "--rdzv_conf=protocol=https",
             "s.py"},
            "contradicts"},
           {{"--rdzv_backend=etcd-v3", "--rdzv_endpoint=h1", "--rdzv_conf=protocol=tls", "s.py"},
            "expected http or https"},
           {{"--rdzv_backend=etcd-v3", "--rdzv_endpoint=h1", "--rdzv_conf=cacert=/ca.pem", "s.py"},
            "over http"},
           {{"--rdzv_backend=etcd-v3", "--rdzv_endpoint=https://h1", "--rdzv_conf=cert=/c.pem",
             "s.py"},
            "without key"},
           {{"--rdzv_backend=etcd-v3", "--rdzv_endpoint=https://h1", "--rdzv_conf=ssl_cert_key=/k",
             "s.py"},
            "without cert"},
           {{"--rdzv_backend=etcd-v3", "--rdzv_endpoint=https://h1", "--rdzv_conf=cacert=", "s.py"},
            "PEM file"},
           {{"--rdzv_backend=etcd-v3", "--rdzv_endpoint=grpc://h1", "s.py"}, "https://"},
           {{"--rdzv_backend=etcd-v3", "--rdzv_endpoint=h1", "--rdzv_conf=etcd_prefix=nope",
             "s.py"},
            "etcd_prefix"}}) {
    auto b = parse(bad);
    INFO(b.message);
    CHECK(b.kind == cli::ParseOutcome::Kind::kExit);
    CHECK(b.exit_code == 2);
    CHECK(contains(b.message, says));
  }
}

TEST_CASE(
    "etcd-v3: agents on etcd form a job, admit a late node, finish, and leave only the "
    "closed marker, which refuses the id at once and stays alone",
    "[multiproc]") {
  EtcdCluster etcd(1);
  EtcdJob job(etcd);
  auto a = job.agent("a");
  REQUIRE(wait_for_lines(job.seen("a"), 1, 30s));
  auto b = job.agent("b");
  REQUIRE(wait_for_lines(job.seen("b"), 1, 30s));
  REQUIRE(wait_for_lines(job.seen("a"), 2, 30s));
  CHECK(lines_of(job.seen("a")) == std::vector<std::string>{"1 0 0", "2 0 0"});
  CHECK(lines_of(job.seen("b")) == std::vector<std::string>{"2 0 1"});
  job.stop();
  int rca = a->exit_code(30s), rcb = b->exit_code(30s);
  INFO(a->read_all(1s) + "\n----\n" + b->read_all(1s));
  CHECK(rca == 0);
  CHECK(rcb == 0);
  expect_only_closed_marker(etcd, job.id);
  auto again = run_ctorchrun(concat({"--nnodes=1", "--rdzv_backend=etcd-v3",
                                     "--rdzv_endpoint=" + join(etcd.client_endpoints()),
                                     "--rdzv_id=" + job.id, "--rdzv_conf=join_timeout=30"},
                                    sh("true")),
                             {}, 30s);
  INFO(again.output);
  CHECK(again.exit_code == 3);
  CHECK(contains(again.output, "ended (succeeded)"));
  // The refused arrival wrote nothing (no generation key on no lease).
  expect_only_closed_marker(etcd, job.id);
}

TEST_CASE(
    "etcd-v3: a job whose restarts ran out leaves only the closed marker in etcd, which "
    "refuses the id at once",
    "[multiproc]") {
  EtcdCluster etcd(1);
  EtcdJob job(etcd);
  job.nnodes = "2:2";
  std::vector<std::unique_ptr<Process>> agents;
  for (int i = 0; i < 2; ++i) {
    agents.push_back(start_ctorchrun(
        concat({"--nnodes=2:2", "--rdzv_backend=etcd-v3",
                "--rdzv_endpoint=" + join(etcd.client_endpoints()), "--rdzv_id=" + job.id,
                "--max_restarts=0", "--rdzv_conf=" + job.conf},
               sh("if [ $GROUP_RANK = 1 ]; then exit 5; fi; sleep 30"))));
  }
  auto [codes, out] = EtcdJob::ended(agents, 60s);
  INFO(out);
  CHECK(codes == std::vector<int>{1, 1});
  expect_only_closed_marker(etcd, job.id);
}

TEST_CASE(
    "etcd-v3: the closed marker of a finished etcd job expires after join_timeout, "
    "leaving the prefix empty",
    "[multiproc]") {
  EtcdCluster etcd(1);
  EtcdJob job(etcd);
  job.nnodes = "1";
  job.conf = "join_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=2,read_timeout=5";
  job.stop();  // the worker ends at once
  auto a = job.agent("a");
  const int rc = a->exit_code(60s);
  INFO(a->read_all(1s));
  REQUIRE(rc == 0);
  etcd::EtcdClient client(etcd.client_endpoints(), 5s);
  CHECK(client.range_prefix("/ctorchrun/" + job.id + "/").kvs.size() == 1);
  // The lease of 3 s, and etcd's expiry pass: bounded by 20 s.
  size_t left = 1;
  for (int i = 0; i < 200 && left != 0; ++i) {
    std::this_thread::sleep_for(100ms);
    left = client.range_prefix("/ctorchrun/" + job.id + "/").kvs.size();
  }
  CHECK(left == 0);
  CHECK(client.range_prefix("/ctorchrun/").kvs.empty());
}

TEST_CASE(
    "etcd-v3: the etcd leader SIGKILLed while three agents run costs no worker restart and "
    "no agent, the job finishes",
    "[multiproc]") {
  EtcdCluster etcd(3);
  EtcdJob job(etcd);
  job.nnodes = "3:3";
  auto agents = job.running({"a", "b", "c"});
  const int leader = etcd.leader();
  REQUIRE(leader >= 0);
  etcd.kill(leader);
  // Longer than the liveness bound (2 s) and an election: nothing moves.
  std::this_thread::sleep_for(6s);
  for (const char* n : {"a", "b", "c"}) CHECK(lines_of(job.seen(n)).size() == 1);
  job.stop();
  auto [codes, out] = EtcdJob::ended(agents);
  INFO(out);
  CHECK(codes == std::vector<int>{0, 0, 0});
  CHECK_FALSE(contains(out, "gives way"));
}

TEST_CASE(
    "etcd-v3: the etcd member every agent talks to hangs (SIGSTOP): no lease lost, no worker "
    "restart, the job finishes",
    "[multiproc]") {
  EtcdCluster etcd(3);
  EtcdJob job(etcd);
  job.nnodes = "2:2";
  // Leases of 3 s, refreshed every 1 s, each member given at most that long:
  // a hung member costs one refresh 1 s, within the TTL with room for a
  // loaded (sanitised) run, while a client that waited read_timeout over
  // the members (10 s / 3) on it would lose the lease.
  job.conf =
      "join_timeout=30,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,"
      "read_timeout=10";
  auto agents = job.running({"a", "b"});
  // A hung member that is not the leader: a paused leader that wakes up was
  // seen expiring every lease at once (etcd's own lessor), and a leader's
  // loss is the test above.
  if (etcd.leader() == 0) {
    etcd::EtcdClient client(etcd.client_endpoints(), 5s);
    char id[32];
    std::snprintf(
        id, sizeof id, "%llx",
        static_cast<unsigned long long>(client.member_status(etcd.client_endpoint(1)).member_id));
    const std::string move =
        "ETCDCTL_API=3 /usr/bin/etcdctl --endpoints=" + etcd.client_endpoint(0) + " move-leader " +
        id + " >/dev/null";
    REQUIRE(std::system(move.c_str()) == 0);
    REQUIRE(etcd.leader() != 0);
  }
  // Every client starts with the first endpoint: it stops answering, with
  // its connections open (no reset, no EOF), as a hung machine would.
  REQUIRE(::kill(etcd.pid(0), SIGSTOP) == 0);
  // Several lease TTLs (3 s) and liveness bounds: nothing may move.
  std::this_thread::sleep_for(8s);
  ::kill(etcd.pid(0), SIGCONT);
  CHECK(lines_of(job.seen("a")).size() == 1);
  CHECK(lines_of(job.seen("b")).size() == 1);
  job.stop();
  auto [codes, out] = EtcdJob::ended(agents);
  INFO(out);
  CHECK(codes == std::vector<int>{0, 0});
  CHECK_FALSE(contains(out, "gives way"));
  CHECK_FALSE(contains(out, "lost node"));
}

TEST_CASE(
    "etcd-v3: an agent paused past its lease's TTL (SIGSTOP) is dropped, then comes back under "
    "a new lease and is admitted again",
    "[multiproc]") {
  EtcdCluster etcd(1);
  EtcdJob job(etcd);
  job.nnodes = "1:2";
  auto a = job.agent("a");
  REQUIRE(wait_for_lines(job.seen("a"), 1, 30s));
  auto b = job.agent("b");
  REQUIRE(wait_for_lines(job.seen("b"), 1, 30s));
  REQUIRE(wait_for_lines(job.seen("a"), 2, 30s));
  // Only the agent stops (its worker runs on): its lease (2 s) expires.
  REQUIRE(::kill(b->pid(), SIGSTOP) == 0);
  const bool dropped = wait_for_lines(job.seen("a"), 3, 20s);
  ::kill(b->pid(), SIGCONT);
  REQUIRE(dropped);
  CHECK(lines_of(job.seen("a")).back() == "1 0 0");
  // Back under a new lease, as a newcomer admitted at the next re-formation.
  const bool back = wait_for_lines(job.seen("a"), 4, 30s) && wait_for_lines(job.seen("b"), 2, 30s);
  job.stop();
  int rca = a->exit_code(30s), rcb = b->exit_code(30s);
  std::string out = a->read_all(1s) + "\n----\n" + b->read_all(1s);
  INFO(out);
  REQUIRE(back);
  CHECK(lines_of(job.seen("a")).back() == "2 0 0");
  CHECK(lines_of(job.seen("b")).back() == "2 0 1");
  CHECK(rca == 0);
  CHECK(rcb == 0);
  CHECK(contains(out, "new lease"));
}

TEST_CASE(
    "etcd-v3: the agent hosting the workers' store SIGKILLed: the other sees its store close and "
    "re-forms without waiting for the lease",
    "[multiproc]") {
  EtcdCluster etcd(1);
  EtcdJob job(etcd);
  job.nnodes = "1:2";
  // A long lease (10 s): a re-formation within it did not come from its expiry.
  job.conf =
      "join_timeout=30,last_call_timeout=1,keep_alive_interval=5,keep_alive_max_attempt=2,"
      "read_timeout=5";
  auto a = job.agent("a");
  auto b = job.agent("b");
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while ((job.last("a").rfind("2 0 ", 0) != 0 || job.last("b").rfind("2 0 ", 0) != 0) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(100ms);
  }
  REQUIRE(job.last("a").rfind("2 0 ", 0) == 0);
  REQUIRE(job.last("b").rfind("2 0 ", 0) == 0);
  const bool a_hosts = job.last("a") == "2 0 0";
  Process& host = a_hosts ? *a : *b;
  Process& survivor = a_hosts ? *b : *a;
  const std::string survivor_name = a_hosts ? "b" : "a";
  const size_t before = lines_of(job.seen(survivor_name)).size();
  host.signal_group(SIGKILL);
  const bool again = wait_for_lines(job.seen(survivor_name), before + 1, 30s);
  job.stop();
  const int rc = survivor.exit_code(30s);
  const std::string out = survivor.read_all(1s);
  INFO(out);
  REQUIRE(again);
  CHECK(job.last(survivor_name) == "1 0 0");
  CHECK(rc == 0);
  // Not the lease's expiry (10 s), which would say "lost node 0 (agent exited)".
  CHECK(contains(out, "lost node 0 (agent exited: the workers' store it hosted closed)"));
}

TEST_CASE(
    "etcd-v3: the whole etcd cluster stalls (SIGSTOP) past the leases' TTL but within "
    "read_timeout: the job goes on and finishes, no restart charged",
    "[multiproc]") {
  EtcdCluster etcd(3);
  EtcdJob job(etcd);
  job.nnodes = "2:2";
  auto agents = job.running({"a", "b"});
  for (int i = 0; i < etcd.size(); ++i) REQUIRE(::kill(etcd.pid(i), SIGSTOP) == 0);
  // 3 s: past the leases' TTL (2 s), short of read_timeout (5 s).
  std::this_thread::sleep_for(3s);
  for (int i = 0; i < etcd.size(); ++i) ::kill(etcd.pid(i), SIGCONT);
  // Whatever etcd did with the leases, the job runs again at world 2.
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  std::this_thread::sleep_for(4s);
  while ((job.last("a").rfind("2 0 ", 0) != 0 || job.last("b").rfind("2 0 ", 0) != 0) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(100ms);
  }
  job.stop();
  auto [codes, out] = EtcdJob::ended(agents);
  INFO(out);
  CHECK(job.last("a").rfind("2 0 ", 0) == 0);
  CHECK(job.last("b").rfind("2 0 ", 0) == 0);
  CHECK(codes == std::vector<int>{0, 0});
}

TEST_CASE(
    "etcd-v3: a running etcd job learns of membership changes from a watch, not by polling "
    "etcd",
    "[multiproc]") {
  EtcdCluster etcd(1);
  EtcdJob job(etcd);
  job.nnodes = "1:2";
  auto a = job.agent("a");
  auto b = job.agent("b");
  REQUIRE(wait_for_lines(job.seen("a"), 1, 30s));
  REQUIRE(wait_for_lines(job.seen("b"), 1, 30s));
  std::this_thread::sleep_for(1s);  // the round's first checks and watches
  const long long before = etcd_ranges(etcd.client_endpoint(0));
  std::this_thread::sleep_for(4s);
  const long long after = etcd_ranges(etcd.client_endpoint(0));
  REQUIRE(before >= 0);
  REQUIRE(after >= before);
  // Membership polled every 250 ms costs each agent about 40 reads a second
  // (about 330 here in 4 s, measured); learned from a watch, with the
  // failure key waited on by one watch too, the reads left are mostly the
  // monitor's heartbeats (about 64).
  INFO("ranges served in 4 s: " << after - before);
  CHECK(after - before <= 200);
  // And a change still arrives: b leaves, a finishes.
  b->signal_group(SIGKILL);
  const bool moved = wait_for_lines(job.seen("a"), 2, 20s);
  job.stop();
  const int rca = a->exit_code(30s);
  INFO(a->read_all(1s));
  CHECK(moved);
  CHECK(rca == 0);
}

TEST_CASE(
    "etcd-v3: a plain node of a three-node etcd job SIGKILLed: the other two re-form at once "
    "and finish",
    "[multiproc]") {
  EtcdCluster etcd(3);
  EtcdJob job(etcd);
  job.nnodes = "2:3";
  std::map<std::string, std::unique_ptr<Process>> agents;
  for (const char* n : {"a", "b", "c"}) agents[n] = job.agent(n);
  // All three in one round (a round of two admits the third, re-forming).
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  auto all_three = [&] {
    for (const char* n : {"a", "b", "c"}) {
      if (job.last(n).rfind("3 0 ", 0) != 0) return false;
    }
    return true;
  };
  while (!all_three() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(100ms);
  }
  REQUIRE(all_three());
  // A node that does not host the workers' store (group rank 0 does).
  std::string victim;
  for (const char* n : {"a", "b", "c"}) {
    if (job.last(n) != "3 0 0") victim = n;
  }
  REQUIRE_FALSE(victim.empty());
  std::map<std::string, size_t> before;
  for (const char* n : {"a", "b", "c"}) before[n] = lines_of(job.seen(n)).size();
  agents[victim]->signal_group(SIGKILL);
  std::string out;
  for (const char* n : {"a", "b", "c"}) {
    if (n == victim) continue;
    REQUIRE(wait_for_lines(job.seen(n), before[n] + 1, 20s));
    // World 2, no restart charged.
    CHECK(job.last(n).rfind("2 0 ", 0) == 0);
  }
  job.stop();
  std::map<std::string, int> rcs;
  for (const char* n : {"a", "b", "c"}) {
    if (n == victim) continue;
    rcs[n] = agents[n]->exit_code(30s);
    out += std::string(n) + ": " + agents[n]->read_all(1s) + "\n----\n";
  }
  INFO(out);
  for (const auto& [n, rc] : rcs) {
    INFO(n);
    CHECK(rc == 0);
  }
  CHECK(contains(out, "lost node"));
}

TEST_CASE(
    "etcd-v3: a background connection's waiting reads end at the timeout it was opened with, not "
    "the store's default of minutes",
    "[multiproc]") {
  // The monitor's connection: a read of a key that the job's last node tidied
  // away must not hold an agent's exit for five minutes.
  EtcdCluster etcd(1);
  rendezvous::C10dOptions o;
  o.job.run_id = "bg";
  o.etcd_endpoints = etcd.client_endpoints();
  o.etcd_prefix = "/ctorchrun";
  o.read_timeout = 5s;
  auto coord = rendezvous::make_etcd_coordination(o);
  std::shared_ptr<store::Store> s = coord->background()("bg/g0/r0", 300ms);
  CHECK(s->timeout() == 300ms);
  auto outcome = std::make_shared<std::promise<std::string>>();
  auto done = outcome->get_future();
  std::thread([s, outcome] {
    try {
      s->get("never-written");
      outcome->set_value("returned a value");
    } catch (const TimeoutError& e) {
      outcome->set_value(std::string("TimeoutError: ") + e.what());
    } catch (const std::exception& e) {
      outcome->set_value(std::string("other error: ") + e.what());
    }
  }).detach();  // joined by the future; left running only when this case fails
  REQUIRE(done.wait_for(60s) == std::future_status::ready);
  const std::string r = done.get();
  INFO(r);
  CHECK(r.rfind("TimeoutError: ", 0) == 0);
  CHECK(contains(r, "timed out after 300ms"));
}

TEST_CASE(
    "etcd-v3: every member of a three-member etcd cluster stopped ends the agents with "
    "exit 3 within read_timeout, naming the members",
    "[multiproc]") {
  EtcdCluster etcd(3);
  EtcdJob job(etcd);
  job.nnodes = "2:2";
  auto agents = job.running({"a", "b"});
  for (int i = 0; i < etcd.size(); ++i) etcd.kill(i);
  const auto t0 = std::chrono::steady_clock::now();
  auto [codes, out] = EtcdJob::ended(agents, 60s);
  const auto took = std::chrono::steady_clock::now() - t0;
  INFO(out);
  CHECK(codes == std::vector<int>{3, 3});
  for (int i = 0; i < etcd.size(); ++i) CHECK(contains(out, etcd.client_endpoint(i)));
  CHECK(took < 30s);  // read_timeout 5 s plus the workers' stop
}

TEST_CASE(
    "etcd-v3: torch workers (gloo) on etcd: the node hosting the workers' store SIGKILLed, "
    "the other re-forms (its own workers' store) and finishes from the checkpoint at "
    "--max_restarts=0",
    "[torch]") {
  EtcdCluster etcd(3);
  TempDir d;
  const std::string worker = CTORCHRUN_SOURCE_DIR "/tests/torch/checkpoint_worker.py";
  const std::string ckpt = d.file("ckpt.json");
  auto agent = [&] {
    return start_ctorchrun({"--nnodes=1:2", "--rdzv_backend=etcd-v3",
                            "--rdzv_endpoint=" + join(etcd.client_endpoints()),
                            "--rdzv_id=torchetcd", "--max_restarts=0",
                            "--rdzv_conf=join_timeout=120,last_call_timeout=2,"
                            "keep_alive_interval=1,keep_alive_max_attempt=2,read_timeout=5",
                            worker},
                           {{"CKPT", ckpt}, {"TOTAL_STEPS", "80"}});
  };
  auto a = agent();
  auto b = agent();
  // Both in round 0 (MAX), training; then rank 0, whose agent hosts the
  // workers' store, dies.
  std::string first;
  const auto deadline = std::chrono::steady_clock::now() + 120s;
  while (!contains(first, "RESUMED from=0 world=2") &&
         std::chrono::steady_clock::now() < deadline) {
    if (auto line = a->read_line(1s)) first += *line + "\n";
  }
  REQUIRE(contains(first, "RESUMED from=0 world=2"));
  auto step = [&] {
    auto j = nlohmann::json::parse(read_file(ckpt), nullptr, false);
    return j.is_object() && j.contains("step") && j["step"].is_number_integer()
               ? j["step"].get<int>()
               : 0;
  };
  while (step() < 5 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(50ms);
  }
  REQUIRE(step() >= 5);
  const bool a_is_rank0 = contains(first, "group_rank=0 ");
  Process& host = a_is_rank0 ? *a : *b;
  Process& survivor = a_is_rank0 ? *b : *a;
  host.signal_group(SIGKILL);
  const int at_loss = step();
  int rc = survivor.exit_code(120s);
  std::string out = survivor.read_all(1s);
  INFO(first + "\n----\n" + out);
  CHECK(rc == 0);
  CHECK(contains(out, "lost node 0"));
  // Resumed from the checkpoint, not from the start, without a restart.
  auto at = out.find("RESUMED from=", out.find("lost node 0"));
  REQUIRE(at != std::string::npos);
  const int resumed = std::stoi(out.substr(at + 13));
  CHECK(resumed >= at_loss - 1);
  CHECK(resumed >= 5);
  CHECK(contains(out.substr(at), "world=1 rank=0 restart=0 count=1"));
  CHECK(contains(out, "FINISHED steps=80 world=1 rank=0"));
}

TEST_CASE(
    "etcd-v3: agents on etcd over https with client certificates (--client-cert-auth) run a "
    "job and finish, and a wrong CA ends a node at once with exit 2",
    "[multiproc]") {
  EtcdCluster etcd(1, 30s, EtcdCluster::Tls::kOn);
  const auto& certs = etcd.certificates();
  EtcdJob job(etcd);
  job.nnodes = "2";
  std::string urls;
  for (int i = 0; i < etcd.size(); ++i) urls += (urls.empty() ? "" : ",") + etcd.client_url(i);
  auto agent = [&](const std::string& name, const std::string& ca) {
    return start_ctorchrun(
        concat({"--nnodes=2", "--rdzv_backend=etcd-v3", "--rdzv_endpoint=" + urls,
                "--rdzv_id=" + job.id, "--max_restarts=0",
                "--rdzv_conf=" + job.conf + ",cacert=" + ca + ",cert=" + certs.client_cert +
                    ",key=" + certs.client_key},
               sh("echo \"$WORLD_SIZE $GROUP_RANK\" >> " + job.seen(name))));
  };
  auto a = agent("a", certs.ca);
  auto b = agent("b", certs.ca);
  int rca = a->exit_code(60s), rcb = b->exit_code(60s);
  INFO(a->read_all(1s) + "\n----\n" + b->read_all(1s));
  CHECK(rca == 0);
  CHECK(rcb == 0);
  CHECK(lines_of(job.seen("a")).size() == 1);
  CHECK(lines_of(job.seen("b")).size() == 1);
  CHECK(lines_of(job.seen("a")).at(0).rfind("2 ", 0) == 0);
  // The job's keys went into the cluster over TLS, and were tidied.
  etcd::EtcdClient client(etcd.client_endpoints(), 5s, etcd.client_tls());
  auto left = client.range_prefix("/ctorchrun/" + job.id + "/");
  REQUIRE(left.kvs.size() == 1);
  CHECK(left.kvs[0].key == "/ctorchrun/" + job.id + "/g0/rdzv/closed");

  // A CA that did not sign the member's certificate: exit 2, naming why,
  // long before the join timeout.
  job.id = "etcdjob-wrong-ca";
  auto wrong = run_ctorchrun(concat({"--nnodes=1", "--rdzv_backend=etcd-v3",
                                     "--rdzv_endpoint=" + urls, "--rdzv_id=" + job.id,
                                     "--rdzv_conf=" + job.conf + ",cacert=" + certs.other_ca +
                                         ",cert=" + certs.client_cert + ",key=" + certs.client_key},
                                    sh("true")),
                             {}, 60s);
  INFO(wrong.output);
  CHECK(wrong.exit_code == 2);
  CHECK(contains(wrong.output, "certificate verify failed"));
  CHECK(contains(wrong.output, etcd.client_endpoint(0)));
}

TEST_CASE(
    "etcd-v3: etcd's quota filling up while the workers run costs nothing once they succeed: "
    "every agent exits 0 and its warning names etcd",
    "[multiproc]") {
  // A small backend quota: the test fills it while the job runs, so that
  // every write of the job's ending (the exit barrier's tallies, closing)
  // is refused with "database space exceeded" (etcd raises its NOSPACE alarm).
  EtcdCluster etcd(1, 30s, EtcdCluster::Tls::kOff, {"--quota-backend-bytes=2097152"});
  EtcdJob job(etcd);
  job.nnodes = "2:2";
  auto agents = job.running({"a", "b"});
  etcd::EtcdClient client(etcd.client_endpoints(), 5s);
  const std::string blob(256 * 1024, 'x');
  bool full = false;
  std::string why;
  for (int i = 0; i < 200 && !full; ++i) {
    try {
      client.put("/filler/" + std::to_string(i), blob);
    } catch (const Error& e) {
      why = e.what();
      full = why.find("space exceeded") != std::string::npos;
      if (!full) FAIL("etcd refused a write for another reason: " << why);
    }
  }
  REQUIRE(full);
  job.stop();
  auto [codes, out] = EtcdJob::ended(agents);
  INFO(out);
  CHECK(codes[0] == 0);
  CHECK(codes[1] == 0);
  CHECK(contains(out, "etcd 127.0.0.1:"));           // the warning names etcd's members
  CHECK_FALSE(contains(out, "the job's store at"));  // never the workers' store
}
