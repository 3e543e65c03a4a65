// The agent loop against fakes: a scripted launcher (torchelastic's TestAgent
// idea) and a rendezvous over an in-memory store. No processes, no sockets.

#include "agent/agent.h"

#include <signal.h>

#include <catch2/catch.hpp>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <functional>
#include <thread>

#include "common/error.h"
#include "common/json_text.h"
#include "store/hash_store.h"
#include "store/prefix_store.h"
#include "tests/support/temp_dir.h"

using namespace ctorchrun;
using namespace std::chrono_literals;

namespace {

// Each attempt's workers exit as the script says: exit code per local rank,
// or -N for death by signal N; nullopt: the worker keeps running until stopped.
using Script = std::function<std::optional<int>(int attempt, int local_rank)>;

class FakeLauncher : public worker::Launcher {
 public:
  explicit FakeLauncher(Script script) : script_(std::move(script)) {}

  std::vector<pid_t> start(const std::vector<worker::WorkerSpec>& specs) override {
    std::lock_guard<std::mutex> lock(mutex_);
    starts.push_back(specs);
    int attempt = std::stoi(specs.at(0).env.at("TORCHELASTIC_RESTART_COUNT"));
    std::vector<pid_t> pids;
    running_.clear();
    for (const auto& s : specs) {
      pid_t pid = next_pid_++;
      pids.push_back(pid);
      auto code = script_(attempt, s.local_rank);
      if (code && *code != 0 && !error_file_content.empty()) {
        std::ofstream(s.env.at("TORCHELASTIC_ERROR_FILE")) << error_file_content;
      }
      if (code) {
        worker::WorkerExit e;
        e.local_rank = s.local_rank;
        e.pid = pid;
        e.signaled = *code < 0;
        e.signal = *code < 0 ? -*code : 0;
        e.exit_code = *code < 0 ? 0 : *code;
        e.time = std::chrono::system_clock::now();
        pending_.push_back(e);
      } else {
        running_.push_back(s.local_rank);
      }
    }
    return pids;
  }
  std::vector<worker::WorkerExit> wait(std::chrono::steady_clock::time_point deadline) override {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait_until(lock, deadline, [&] { return !pending_.empty() || woken_; });
    woken_ = false;
    std::vector<worker::WorkerExit> out(pending_.begin(), pending_.end());
    pending_.clear();
    return out;
  }
  void wake() override {
    std::lock_guard<std::mutex> lock(mutex_);
    woken_ = true;
    cv_.notify_all();
  }
  void signal_all(int) override {}
  std::vector<worker::WorkerExit> stop(int sig, std::chrono::milliseconds) override {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_signals.push_back(sig);
    std::vector<worker::WorkerExit> out;
    for (int lr : running_) {
      worker::WorkerExit e;
      e.local_rank = lr;
      e.signaled = true;
      e.signal = sig;
      out.push_back(e);
    }
    running_.clear();
    pending_.clear();
    return out;
  }
  size_t running() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return running_.size();
  }
  // Every running worker exits with `code` now.
  void finish_all(int code) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int lr : running_) {
      worker::WorkerExit e;
      e.local_rank = lr;
      e.exit_code = code;
      e.time = std::chrono::system_clock::now();
      pending_.push_back(e);
    }
    running_.clear();
    cv_.notify_all();
  }

  std::vector<std::vector<worker::WorkerSpec>> starts;
  std::vector<int> stop_signals;
  // Written to the error file of each worker that fails (when not empty).
  std::string error_file_content;

 private:
  Script script_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<worker::WorkerExit> pending_;
  std::vector<int> running_;
  bool woken_ = false;
  pid_t next_pid_ = 1000;
};

// One node that hosts an in-memory store.
class FakeRendezvous : public rendezvous::Handler {
 public:
  rendezvous::RendezvousInfo next_rendezvous() override {
    if (fail_with_bug) CTORCHRUN_CHECK(false, "a broken invariant in the rendezvous");
    rendezvous::RendezvousInfo info;
    auto ns = std::make_shared<store::PrefixStore>("ctorchrun/none", hash);
    info.store = ns;
    info.connect = [ns] { return ns; };
    info.namespace_prefix = "ctorchrun/";
    info.group_rank = rank;
    info.group_world_size = world;
    for (int n = 0; n < world; ++n) {
      info.nodes.push_back(rendezvous::NodeInfo{n, 2, "fakehost" + std::to_string(n), 1});
    }
    info.master_addr = "127.0.0.1";
    info.master_port = 1234;
    if (rank != 0) return info;  // only node 0 hosts the store
    info.clear_worker_keys = [this] {
      ++clears;
      hash->set("worker-key-seen-by-next-attempt", "");
      return hash->delete_key("worker-key-seen-by-next-attempt") ? 1 : 0;
    };
    return info;
  }
  const std::string& run_id() const override { return id_; }

  std::shared_ptr<store::HashStore> hash = std::make_shared<store::HashStore>();
  int clears = 0;
  bool fail_with_bug = false;
  int rank = 0;   // this node's group rank; 0 hosts the store
  int world = 1;  // nodes in the job; the test plays the others

 private:
  std::string id_ = "none";
};

agent::LaunchConfig config(int max_restarts) {
  // One log directory for the whole run, removed at exit.
  static testing::TempDir dir("agent_test");
  agent::LaunchConfig c;
  c.nproc_per_node = 2;
  c.max_restarts = max_restarts;
  c.entrypoint = {"/bin/true"};
  c.entrypoint_name = "/bin/true";
  c.log_dir = dir.path;
  c.shutdown_timeout = 100ms;
  return c;
}

agent::RunResult run_agent(FakeLauncher& launcher, FakeRendezvous& rdzv, int max_restarts) {
  auto c = config(max_restarts);
  agent::EventLog events("", "none", 0);
  agent::ElasticAgent a(c, rdzv, launcher, events);
  return a.run();
}

}  // namespace

TEST_CASE("agent: all workers succeed -> exit 0, one attempt", "[unit]") {
  FakeLauncher launcher([](int, int) { return 0; });
  FakeRendezvous rdzv;
  auto r = run_agent(launcher, rdzv, 3);
  CHECK(r.exit_code == 0);
  CHECK(launcher.starts.size() == 1);
  CHECK(rdzv.clears == 0);
}

TEST_CASE("agent: a failure restarts every worker with the next restart count", "[unit]") {
  // Rank 1 fails in attempts 0 and 1; attempt 2 succeeds.
  FakeLauncher launcher([](int attempt, int lr) -> std::optional<int> {
    if (lr == 1 && attempt < 2) return 3;
    if (attempt < 2) return std::nullopt;  // rank 0 runs until stopped
    return 0;
  });
  FakeRendezvous rdzv;
  auto r = run_agent(launcher, rdzv, 2);
  CHECK(r.exit_code == 0);
  REQUIRE(launcher.starts.size() == 3);
  for (int k = 0; k < 3; ++k) {
    for (const auto& spec : launcher.starts[static_cast<size_t>(k)]) {
      CHECK(spec.env.at("TORCHELASTIC_RESTART_COUNT") == std::to_string(k));
      CHECK(spec.env.at("TORCHELASTIC_MAX_RESTARTS") == "2");
    }
  }
  CHECK(rdzv.clears == 2);  // the store was cleared before each restart
  CHECK(std::count(launcher.stop_signals.begin(), launcher.stop_signals.end(), SIGTERM) >= 2);
}

TEST_CASE("agent: restarts exhausted -> exit 1 naming the rank and the cause", "[unit]") {
  FakeLauncher launcher([](int, int lr) -> std::optional<int> {
    if (lr == 0) return -SIGSEGV;
    return std::nullopt;
  });
  FakeRendezvous rdzv;
  auto r = run_agent(launcher, rdzv, 1);
  CHECK(r.exit_code == 1);
  CHECK(launcher.starts.size() == 2);
  CHECK(r.message.find("rank 0") != std::string::npos);
  CHECK(r.message.find("SIGSEGV") != std::string::npos);
  CHECK(r.message.find("1/1 restarts") != std::string::npos);
}

TEST_CASE("agent: a signal while workers run is forwarded, then the agent exits 128+N", "[unit]") {
  FakeLauncher launcher([](int, int) -> std::optional<int> { return std::nullopt; });
  FakeRendezvous rdzv;
  auto c = config(3);
  agent::EventLog events("", "none", 0);
  agent::ElasticAgent a(c, rdzv, launcher, events);
  std::thread t([&] {
    for (int i = 0; i < 500 && launcher.running() == 0; ++i) std::this_thread::sleep_for(2ms);
    a.on_signal(SIGTERM);
  });
  auto r = a.run();
  t.join();
  CHECK(r.exit_code == 128 + SIGTERM);
  REQUIRE_FALSE(launcher.stop_signals.empty());
  CHECK(launcher.stop_signals.front() == SIGTERM);
  CHECK(launcher.starts.size() == 1);
}

TEST_CASE("multi-node: a malformed failure record of another node is a protocol error, exit 3",
          "[unit]") {
  FakeLauncher launcher([](int, int) -> std::optional<int> { return std::nullopt; });
  FakeRendezvous rdzv;
  rdzv.world = 2;  // the test plays node 1, whose record this is
  auto c = config(3);
  agent::EventLog events("", "none", 0);
  agent::ElasticAgent a(c, rdzv, launcher, events);
  std::thread t([&] {
    for (int i = 0; i < 2000 && launcher.running() == 0; ++i) std::this_thread::sleep_for(1ms);
    rdzv.hash->set("ctorchrun/none/attempt/0/failure", R"({"rank":"x","node_rank":1})");
  });
  auto r = a.run();
  t.join();
  INFO(r.message);
  CHECK(r.exit_code == 3);
  CHECK(r.message.find("protocol error") != std::string::npos);
  CHECK(r.message.find("'rank'") != std::string::npos);
  CHECK(r.message.find("attempt/0/failure") != std::string::npos);
  CHECK(launcher.running() == 0);
}

TEST_CASE(
    "multi-node: an error file of unexpected types is named in the summary, the restart goes on",
    "[unit]") {
  FakeLauncher launcher([](int, int lr) -> std::optional<int> {
    if (lr == 1) return 5;
    return std::nullopt;
  });
  launcher.error_file_content = R"({"message":{"message":123}})";
  FakeRendezvous rdzv;
  auto r = run_agent(launcher, rdzv, 1);
  CHECK(r.exit_code == 1);
  CHECK(launcher.starts.size() == 2);  // the restart happened
  REQUIRE(r.failures.size() == 1);
  INFO(r.failures[0].message);
  CHECK(r.failures[0].message.find("error file unreadable: ") == 0);
  CHECK(r.failures[0].message.find("error.json") != std::string::npos);
  CHECK(r.failures[0].exit_code == 5);
}

TEST_CASE("multi-node: the signal relay never points at a destroyed agent, even when run() throws",
          "[unit]") {
  FakeLauncher launcher([](int, int) { return 0; });
  FakeRendezvous rdzv;
  rdzv.fail_with_bug = true;
  auto c = config(0);
  agent::EventLog events("", "none", 0);
  {
    agent::ElasticAgent a(c, rdzv, launcher, events);
    agent::set_signal_relay(&a);
    // A broken invariant is an internal error (exit 70 in main), never "lost
    // the job's store".
    CHECK_THROWS_AS(a.run(), InternalError);
    CHECK(agent::signal_relay() == &a);
  }
  CHECK(agent::signal_relay() == nullptr);
}

namespace {

// Node 1 of two, with node 0 played by the test through the store.
struct SecondNode {
  SecondNode() {
    rdzv.rank = 1;
    rdzv.world = 2;
    c.keep_alive_interval = std::chrono::milliseconds(10);
    c.node_timeout = c.keep_alive_interval * c.keep_alive_max_attempt;
  }
  void set(const std::string& key, const std::string& value) {
    rdzv.hash->set("ctorchrun/none/" + key, value);
  }
  FakeLauncher launcher{[](int, int) -> std::optional<int> { return std::nullopt; }};
  FakeRendezvous rdzv;
  agent::LaunchConfig c = config(0);
  agent::EventLog events{"", "none", 1};
};

}  // namespace

TEST_CASE("multi-node: a node that left after finishing does not end the workers of another",
          "[unit]") {
  SecondNode n;
  agent::ElasticAgent a(n.c, n.rdzv, n.launcher, n.events);
  agent::RunResult r;
  std::thread t([&] { r = a.run(); });
  for (int i = 0; i < 5000 && n.launcher.running() == 0; ++i) std::this_thread::sleep_for(1ms);
  // Node 0 finished attempt 0 and left; this node's workers still run.
  n.set("attempt/0/finished", "0,");
  n.set("liveness", R"({"seq":1,"dead":[],"gone":[0]})");
  std::this_thread::sleep_for(100ms);
  CHECK(n.launcher.running() == 2);
  n.launcher.finish_all(0);
  t.join();
  INFO(r.message);
  CHECK(r.exit_code == 0);
}

TEST_CASE("multi-node: a node that left without finishing ends a static job with exit 3 naming it",
          "[unit]") {
  SecondNode n;
  agent::ElasticAgent a(n.c, n.rdzv, n.launcher, n.events);
  agent::RunResult r;
  std::thread t([&] { r = a.run(); });
  for (int i = 0; i < 5000 && n.launcher.running() == 0; ++i) std::this_thread::sleep_for(1ms);
  n.set("liveness", R"({"seq":1,"dead":[],"gone":[0]})");
  t.join();
  INFO(r.message);
  CHECK(r.exit_code == 3);
  CHECK(r.message.find("node 0 (fakehost0) left the job") != std::string::npos);
  CHECK(n.launcher.running() == 0);
}

TEST_CASE("events: a run id and fields that are not UTF-8 are written and read back whole",
          "[unit]") {
  testing::TempDir dir("events_test");
  const std::string path = dir.file("events.json");
  {
    agent::EventLog events(path, "run\xff", 0);
    events.emit("restart", 1, {{"reason", "lost \xe4\xb8"}});
    events.emit("restart", 2, {{"reason", "ok"}});
  }
  std::ifstream in(path);
  std::vector<nlohmann::json> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(json_text::parse_record(l));
  REQUIRE(lines.size() == 2);
  CHECK(lines[0]["run_id"] == "run\xff");
  CHECK(lines[0]["reason"] == "lost \xe4\xb8");
  CHECK(lines[1]["attempt"] == 2);
}
