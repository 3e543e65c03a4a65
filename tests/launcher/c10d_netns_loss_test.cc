// A c10d job on three "machines" (network namespaces) whose veths meet on a
// bridge in a fourth namespace, so that a test can cut one machine's link
// while every process keeps running: the survivors re-form without it after
// the liveness bound (keep_alive_interval x keep_alive_max_attempt), the
// cut-off node counts the endpoint's store lost after the same bound, and a
// node started again once the link is back joins the running job. Needs
// root (CI runs as root); without it the set-up fails the test rather than
// skipping it.

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "tests/launcher/launcher_support.h"

using namespace ctorchrun::testing;
using namespace std::chrono_literals;

namespace {

using Clock = std::chrono::steady_clock;

int sh(const std::string& cmd) { return std::system(cmd.c_str()); }

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

// Hosts "a", "b", "c": namespaces "<tag>a"... with 10.252.N.1, .2, .3 on
// their "eth0", each the peer of a port "p<host>" of the bridge "br0" in the
// namespace "<tag>br". Nothing is created in the test's own namespace; all is
// removed on destruction.
struct Fabric {
  Fabric() {
    std::random_device rd;
    subnet = static_cast<int>(rd() % 200) + 20;
    tag = "c11n" + std::to_string(::getpid() % 100000);
    bridge_ns = tag + "br";
    ok = sh("ip netns add " + bridge_ns) == 0 &&
         sh("ip -n " + bridge_ns + " link add br0 type bridge") == 0 &&
         sh("ip -n " + bridge_ns + " link set br0 up") == 0;
    int n = 0;
    for (const std::string h : {"a", "b", "c"}) {
      if (!ok) break;
      const std::string ns = tag + h, port = "p" + h, addr = addr_prefix() + std::to_string(++n);
      made.push_back(ns);
      ok = sh("ip netns add " + ns) == 0 &&
           sh("ip -n " + bridge_ns + " link add " + port + " type veth peer name eth0 netns " +
              ns) == 0 &&
           sh("ip -n " + bridge_ns + " link set " + port + " master br0") == 0 &&
           sh("ip -n " + bridge_ns + " link set " + port + " up") == 0 &&
           sh("ip -n " + ns + " addr add " + addr + "/24 dev eth0") == 0 &&
           sh("ip -n " + ns + " link set eth0 up") == 0 &&
           sh("ip -n " + ns + " link set lo up") == 0;
      addr_of[h] = addr;
    }
  }
  ~Fabric() {
    for (const auto& ns : made) sh("ip netns del " + ns + " 2>/dev/null");
    sh("ip netns del " + bridge_ns + " 2>/dev/null");
  }
  std::string addr_prefix() const { return "10.252." + std::to_string(subnet) + "."; }
  // Cuts (or restores) host h's link at the bridge: its own interface stays
  // up, so its processes see no error, only silence.
  bool link(const std::string& h, bool up) const {
    return sh("ip -n " + bridge_ns + " link set p" + h + (up ? " up" : " down")) == 0;
  }
  std::vector<std::string> in(const std::string& h, const std::vector<std::string>& args) const {
    std::vector<std::string> argv = {"/usr/sbin/ip", "netns", "exec", tag + h};
    argv.insert(argv.end(), args.begin(), args.end());
    return argv;
  }
  bool ok = false;
  int subnet = 0;
  std::string tag, bridge_ns;
  std::vector<std::string> made;
  std::map<std::string, std::string> addr_of;
};

// An agent in a host's namespace, keeping all it printed.
struct Agent {
  std::unique_ptr<Process> p;
  std::string out;
  // Reads its output (bounded) until a line contains `needle`.
  bool wait_line(const std::string& needle, std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      auto line = p->read_line(left);
      if (!line) return false;
      out += *line + "\n";
      if (contains(*line, needle)) return true;
    }
    return false;
  }
  // Its exit code, or -1 when it still runs after `timeout`: then its
  // process group is killed.
  int finish(std::chrono::milliseconds timeout) {
    int rc = p->exit_code(timeout);
    if (rc == -1) {
      p->signal_group(SIGKILL);
      p->exit_code(5s);
    }
    out += p->read_all(1s);
    return rc;
  }
  // Takes in what it printed so far.
  void drain() { out += p->read_all(100ms); }
};

// The job's workers: one per node, each appending "WORLD_SIZE GROUP_RANK
// CTORCHRUN_FAILED_RESTARTS" to seen_<NODE_NAME> when it starts and its pid to
// pid_<NODE_NAME>, then running until the stop file exists or the directory
// is gone (at most 60 s).
struct Job {
  explicit Job(const Fabric& fabric) : net(fabric) {}
  const Fabric& net;
  TempDir d;
  std::string port = std::to_string(free_port());

  std::string body() const {
    return "echo \"$WORLD_SIZE $GROUP_RANK $CTORCHRUN_FAILED_RESTARTS\" >> " + d.path +
           "/seen_$NODE_NAME; echo $$ > " + d.path + "/pid_$NODE_NAME; i=0; while [ -d " + d.path +
           " ] && [ ! -e " + d.path + "/stop ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done";
  }
  // `name` names the agent (its files); `host` the namespace it runs in.
  Agent start(const std::string& host, const std::string& name) const {
    std::vector<std::string> argv = {
        CTORCHRUN_BIN,
        "--nnodes=1:3",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=" + net.addr_of.at("a") + ":" + port,
        "--rdzv_id=cut",
        "--max_restarts=0",
        "--local_addr=" + net.addr_of.at(host),
        "--rdzv_conf=keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=30,"
        "last_call_timeout=1",
        "--events_file=" + d.file("events_" + name)};
    argv = concat(net.in(host, argv), ::ctorchrun::testing::sh(body()));
    std::map<std::string, std::string> env = {{"NODE_NAME", name},
                                              {"CTORCHRUN_PYTHON", test_python()}};
    return Agent{std::make_unique<Process>(argv, env, /*capture_stderr=*/true), ""};
  }
  // The lines of seen_<name>.
  std::vector<std::string> seen(const std::string& name) const {
    std::vector<std::string> lines;
    std::istringstream in(read_file(d.file("seen_" + name)));
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    return lines;
  }
  // The world sizes and charged restarts of seen_<name>: "3/0 2/0 ...".
  std::string worlds(const std::string& name) const {
    std::string s;
    for (const auto& line : seen(name)) {
      std::istringstream in(line);
      std::string world, group_rank, restarts;
      in >> world >> group_rank >> restarts;
      s += (s.empty() ? "" : " ") + world + "/" + restarts;
    }
    return s;
  }
  // Waits (bounded) until every name's worlds() equals `want`.
  bool wait_worlds(const std::vector<std::string>& names, const std::string& want,
                   std::chrono::milliseconds timeout) const {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      bool all = true;
      for (const auto& n : names) all = all && worlds(n) == want;
      if (all) return true;
      if (Clock::now() >= deadline) return false;
      std::this_thread::sleep_for(50ms);
    }
  }
  std::string events(const std::string& name) const { return read_file(d.file("events_" + name)); }
  void stop() const { std::ofstream(d.file("stop")).close(); }
  int worker_pid(const std::string& name) const {
    const std::string s = read_file(d.file("pid_" + name));
    return s.empty() ? -1 : std::stoi(s);
  }
};

// The liveness bound of the job (keep_alive_interval=1 x keep_alive_max_attempt=2)
// and the margin allowed on top of it on a shared, noisy machine.
constexpr auto kLiveness = 2s;
constexpr auto kMargin = 5s;
constexpr double kBoundS = std::chrono::duration<double>(kLiveness + kMargin).count();

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Seconds from `t0` until process `pid` is gone (bounded by `timeout`; a
// negative value when it is not).
double seconds_until_gone(int pid, Clock::time_point t0, std::chrono::milliseconds timeout) {
  return pid > 0 && process_gone_within(pid, timeout) ? seconds_since(t0) : -1;
}

// The keep-alive keys set the liveness bound under c10d too: no line may say
// they are ignored.
bool says_keep_alive_ignored(const std::string& out) {
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    if (contains(line, "keep_alive") && contains(line, "ignored")) return true;
  }
  return false;
}

// Everything the agents printed and recorded, for a failure's message.
std::string report(const Job& job, const std::vector<std::pair<std::string, Agent*>>& agents) {
  std::string s;
  for (const auto& [name, agent] : agents) {
    if (agent) agent->drain();
    s += "---- agent " + name + " (seen: " + job.worlds(name) + "):\n" +
         (agent ? agent->out : std::string()) + "events:\n" + job.events(name);
  }
  return s;
}

}  // namespace

TEST_CASE(
    "c10d across three network namespaces: a node cut off from the endpoint is dropped, exits 3, "
    "and joins again once its link is back",
    "[netns]") {
  Fabric net;
  REQUIRE(net.ok);
  Job job{net};
  Agent a = job.start("a", "a");
  Agent b = job.start("b", "b");
  Agent c = job.start("c", "c");
  std::unique_ptr<Agent> c2;
  auto dump = [&] { return report(job, {{"a", &a}, {"b", &b}, {"c", &c}, {"c2", c2.get()}}); };
  auto need = [&](bool ok, const std::string& what) {
    if (!ok) FAIL(what << "\n" << dump());
  };
  need(job.wait_worlds({"a", "b", "c"}, "3/0", 60s), "the three nodes never ran at world 3");
  const int c_worker = job.worker_pid("c");
  REQUIRE(c_worker > 0);

  // C's link goes down: A and B re-form at world 2, with no restart charged.
  const auto cut = Clock::now();
  REQUIRE(net.link("c", false));
  const bool reformed = job.wait_worlds({"a", "b"}, "3/0 2/0", 30s);
  const double reform_s = seconds_since(cut);
  need(reformed, "A and B did not re-form at world 2");
  // C stops its worker and exits 3 naming the endpoint's store, after about
  // the same bound. (Its exit is awaited 20 s more, then it is killed: a
  // longer wait would outlast the survivors' bounded workers.)
  const double c_worker_s = seconds_until_gone(c_worker, cut, 30s);
  const int rc_c = c.finish(20s);
  const double c_exit_s = seconds_since(cut);
  // The figures of bench/RESULTS.md's network-cut line.
  std::printf(
      "network cut: survivors re-formed after %.2f s, the cut node's worker stopped after "
      "%.2f s, its agent exited %d after %.2f s\n",
      reform_s, c_worker_s, rc_c, c_exit_s);
  {
    INFO(dump());
    INFO("re-formed at world 2 after " << reform_s << " s; c's worker stopped after " << c_worker_s
                                       << " s; agent c exited " << rc_c << " after " << c_exit_s
                                       << " s (bound " << kBoundS << " s)");
    CHECK(reform_s < kBoundS);
    CHECK(c_worker_s >= 0);
    CHECK(c_worker_s < kBoundS);
    CHECK(rc_c == 3);
    CHECK(c_exit_s < kBoundS);
    CHECK(contains(c.out, "lost the rendezvous store at the endpoint " + net.addr_of.at("a") + ":" +
                              job.port + " (its host is gone or unreachable)"));
    CHECK_FALSE(says_keep_alive_ignored(c.out));
    CHECK(job.worlds("c") == "3/0");
    for (const std::string n : {"a", "b"}) {
      const std::string events = job.events(n);
      CHECK(count_lines_with(events, "\"event\":\"node_lost\"") == 1);
      CHECK(count_lines_with(events, "\"cause\":\"heartbeat timeout\"") == 1);
      CHECK(count_lines_with(events, "\"event\":\"restart\"") == 0);
    }
  }

  // The link comes back; a new agent on C joins the running job as a late
  // node: the world grows back to 3, still without a restart.
  REQUIRE(net.link("c", true));
  c2 = std::make_unique<Agent>(job.start("c", "c2"));
  need(job.wait_worlds({"a", "b"}, "3/0 2/0 3/0", 30s) && job.wait_worlds({"c2"}, "3/0", 10s),
       "the new node on C was not admitted at world 3");

  job.stop();
  const int rc_a = a.finish(30s), rc_b = b.finish(30s), rc_c2 = c2->finish(30s);
  INFO(dump());
  CHECK(rc_a == 0);
  CHECK(rc_b == 0);
  CHECK(rc_c2 == 0);
  for (const std::string n : {"a", "b", "c2"}) {
    CHECK(count_lines_with(job.events(n), "\"event\":\"restart\"") == 0);
  }
  CHECK_FALSE(says_keep_alive_ignored(a.out + b.out + c2->out));
}

TEST_CASE(
    "c10d across three network namespaces: cutting the endpoint's host ends the other nodes "
    "with exit 3 naming the lost store",
    "[netns]") {
  Fabric net;
  REQUIRE(net.ok);
  Job job{net};
  Agent a = job.start("a", "a");
  Agent b = job.start("b", "b");
  Agent c = job.start("c", "c");
  auto dump = [&] { return report(job, {{"a", &a}, {"b", &b}, {"c", &c}}); };
  auto need = [&](bool ok, const std::string& what) {
    if (!ok) FAIL(what << "\n" << dump());
  };
  need(job.wait_worlds({"a", "b", "c"}, "3/0", 60s), "the three nodes never ran at world 3");

  const int b_worker = job.worker_pid("b"), c_worker = job.worker_pid("c");
  const auto cut = Clock::now();
  REQUIRE(net.link("a", false));
  std::map<std::string, double> worker_s;
  worker_s["b"] = seconds_until_gone(b_worker, cut, 30s);
  worker_s["c"] = seconds_until_gone(c_worker, cut, 30s);
  std::map<std::string, int> rc;
  std::map<std::string, double> exit_s;
  for (const auto& [name, agent] : {std::pair{"b", &b}, std::pair{"c", &c}}) {
    // Both awaited up to 20 s after the cut, then killed.
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(cut + 20s - Clock::now());
    rc[name] = agent->finish(std::max(left, std::chrono::milliseconds(0)));
    exit_s[name] = seconds_since(cut);
  }
  // A, which hosts the store, lost both others by their heartbeats and goes
  // on alone (MIN is 1) until told to stop.
  const bool alone = job.wait_worlds({"a"}, "3/0 1/0", 30s);
  job.stop();
  const int rc_a = a.finish(30s);

  INFO(dump());
  const std::string lost = "lost the rendezvous store at the endpoint " + net.addr_of.at("a") +
                           ":" + job.port + " (its host is gone or unreachable)";
  for (const auto& [name, agent] : {std::pair{"b", &b}, std::pair{"c", &c}}) {
    INFO("agent " << name << ": its worker stopped after " << worker_s[name] << " s; it exited "
                  << rc[name] << " after " << exit_s[name] << " s (bound " << kBoundS << " s)");
    CHECK(worker_s[name] >= 0);
    CHECK(worker_s[name] < kBoundS);
    CHECK(rc[name] == 3);
    CHECK(exit_s[name] < kBoundS);
    CHECK(contains(agent->out, lost));
  }
  CHECK(alone);
  CHECK(rc_a == 0);
}
