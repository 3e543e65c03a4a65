// Torchrun's multi-node command with
// --rdzv_backend=c10d. The command line, then real agents on loopback with
// shell workers (and torch workers for the growing world).

#include <catch2/catch.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>

#include "cli/command_line.h"
#include "tests/cli/parse_support.h"
#include "tests/launcher/launcher_support.h"
#include "tests/support/process.h"

using namespace ctorchrun;
using namespace ctorchrun::testing;
using namespace std::chrono_literals;
using cli::ParseOutcome;

namespace {

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

}  // namespace

TEST_CASE("c10d: --rdzv_backend=c10d takes the endpoint, torchrun's default port and MIN:MAX",
          "[unit]") {
  auto r = parse({"--nnodes=1:4", "--rdzv_backend=c10d", "--rdzv_endpoint=host0", "--rdzv_id=job7",
                  "train.py"});
  REQUIRE(r.kind == ParseOutcome::Kind::kRun);
  CHECK(r.config.rdzv_backend == "c10d");
  CHECK(r.config.rdzv_endpoint_host == "host0");
  CHECK(r.config.rdzv_endpoint_port == 29400);
  CHECK(r.config.master_addr.empty());  // the rendezvous chooses the workers' store
  CHECK(r.config.min_nodes == 1);
  CHECK(r.config.max_nodes == 4);
  CHECK(r.config.run_id == "job7");
  CHECK(r.notices.empty());

  r = parse({"--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=[::1]:1234", "train.py"});
  REQUIRE(r.kind == ParseOutcome::Kind::kRun);
  CHECK(r.config.rdzv_endpoint_host == "::1");
  CHECK(r.config.rdzv_endpoint_port == 1234);
  CHECK(r.config.min_nodes == 2);
  CHECK(r.config.max_nodes == 2);

  // c10d's --rdzv_conf keys are read without a warning.
  r = parse({"--rdzv_backend=c10d", "--rdzv_endpoint=h:1",
             "--rdzv_conf=join_timeout=5,last_call_timeout=0.5,is_host=1", "s.py"});
  REQUIRE(r.kind == ParseOutcome::Kind::kRun);
  CHECK(r.warnings.empty());
  CHECK(r.config.join_timeout == 5s);
  CHECK(r.config.last_call_timeout == 500ms);
  CHECK(r.config.is_host == true);

  // torchrun's `timeout` is accepted, pointing to join_timeout.
  r = parse({"--rdzv_backend=c10d", "--rdzv_endpoint=h:1", "--rdzv_conf=timeout=5", "s.py"});
  REQUIRE(r.kind == ParseOutcome::Kind::kRun);
  REQUIRE(r.warnings.size() == 1);
  CHECK(contains(r.warnings[0], "join_timeout"));
  CHECK(r.config.join_timeout == 600s);
}

TEST_CASE(
    "c10d: under c10d --node_rank, --master_addr and --master_port are ignored with a "
    "one-line notice each",
    "[unit]") {
  auto r = parse({"--rdzv_backend=c10d", "--rdzv_endpoint=h:5", "--node_rank=1", "--master_addr=x",
                  "--master_port=9", "s.py"});
  REQUIRE(r.kind == ParseOutcome::Kind::kRun);
  CHECK(r.config.node_rank == 0);
  CHECK(r.config.rdzv_endpoint_host == "h");
  CHECK(r.config.rdzv_endpoint_port == 5);
  CHECK(r.config.master_addr.empty());
  REQUIRE(r.notices.size() == 3);
  CHECK(r.notices[0].rfind("--node_rank is ignored", 0) == 0);  // as the user spelled it
  for (const auto& n : r.notices) {
    CHECK(contains(n, "is ignored under --rdzv_backend=c10d"));
    CHECK_FALSE(contains(n, "\n"));
  }
}

TEST_CASE("c10d: c10d without an endpoint is a usage error (exit 2), --standalone needs none",
          "[unit]") {
  auto r = parse({"--rdzv_backend=c10d", "--nnodes=2", "s.py"});
  REQUIRE(r.kind == ParseOutcome::Kind::kExit);
  CHECK(r.exit_code == 2);
  CHECK(contains(r.message, "--rdzv_backend=c10d needs --rdzv_endpoint"));

  r = parse({"--standalone", "--rdzv_backend=c10d", "s.py"});
  REQUIRE(r.kind == ParseOutcome::Kind::kRun);
  CHECK(r.config.nnodes() == 1);
}

TEST_CASE("c10d: two agents with --nnodes=2 under c10d form one job and finish it", "[multiproc]") {
  TempDir d;
  const std::string port = std::to_string(free_port());
  // Each worker leaves its ranks in a file named after its global rank.
  const std::string body =
      "echo \"$GROUP_RANK $LOCAL_RANK $WORLD_SIZE $GROUP_WORLD_SIZE $MASTER_ADDR $MASTER_PORT\" "
      "> " +
      d.path + "/rank_$RANK";
  auto agent = [&](const std::string& name) {
    return start_ctorchrun(
        concat({"--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d",
                "--rdzv_endpoint=127.0.0.1:" + port, "--rdzv_id=job10",
                "--rdzv_conf=join_timeout=60", "--events_file=" + d.file("events_" + name)},
               sh(body)));
  };
  auto a = agent("a");
  auto b = agent("b");
  int rca = a->exit_code(60s), rcb = b->exit_code(60s);
  std::string outa = a->read_all(1s), outb = b->read_all(1s);
  INFO("agent a:\n" << outa << "\nagent b:\n" << outb);
  CHECK(rca == 0);
  CHECK(rcb == 0);
  std::set<std::string> group_ranks, master_ports;
  for (int rank = 0; rank < 4; ++rank) {
    const std::string f = d.file("rank_" + std::to_string(rank));
    REQUIRE(file_exists(f));
    std::istringstream in(read_file(f));
    std::string group_rank, local_rank, world, group_world, master_addr, master_port;
    in >> group_rank >> local_rank >> world >> group_world >> master_addr >> master_port;
    CHECK(group_rank == std::to_string(rank / 2));
    CHECK(local_rank == std::to_string(rank % 2));
    CHECK(world == "4");
    CHECK(group_world == "2");
    // The workers' store of the round, on group rank 0: not the endpoint's.
    CHECK(master_addr == "127.0.0.1");
    CHECK(master_port != port);
    CHECK_FALSE(master_port.empty());
    group_ranks.insert(group_rank);
    master_ports.insert(master_port);
  }
  CHECK(group_ranks.size() == 2);
  CHECK(master_ports.size() == 1);
  // Exactly one of the two agents hosts the endpoint's store.
  CHECK(count_lines_with(outa + outb, "hosting the rendezvous store") == 1);
  // Each agent's events: a node_joined for each node new in the round (both,
  // in round 0), and one round_complete naming both members and the node
  // that hosts the endpoint's store.
  for (const std::string name : {"a", "b"}) {
    const std::string events = read_file(d.file("events_" + name));
    INFO(events);
    CHECK(count_lines_with(events, "\"event\":\"node_joined\"") == 2);
    CHECK(count_lines_with(events, "\"event\":\"round_complete\"") == 1);
    std::istringstream in(events);
    for (std::string line; std::getline(in, line);) {
      if (!contains(line, "round_complete")) continue;
      auto j = nlohmann::json::parse(line);
      CHECK(j["round"] == 0);
      CHECK(j["members"].size() == 2);
      CHECK(j["world_size"] == 4);
      CHECK((j["endpoint_store_node"] == 0 || j["endpoint_store_node"] == 1));
    }
  }
}

TEST_CASE(
    "c10d: MIN never reached ends the agent with exit 3 after join_timeout, naming the "
    "count",
    "[multiproc]") {
  const std::string port = std::to_string(free_port());
  auto r = run_ctorchrun(
      concat({"--nnodes=2:3", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:" + port,
              "--rdzv_id=lonely", "--rdzv_conf=join_timeout=1"},
             sh("true")),
      {}, 30s);
  INFO(r.output);
  CHECK(r.exit_code == 3);
  CHECK(contains(r.output, "1 of min 2, max 3 nodes joined round 0"));
  CHECK(contains(r.output, "timed out after 1s"));
}

TEST_CASE(
    "c10d: an agent whose --max_restarts differs from the job's exits 2 naming both "
    "values",
    "[multiproc]") {
  const std::string port = std::to_string(free_port());
  auto agent = [&](int max_restarts, const std::string& join_timeout) {
    return start_ctorchrun(
        concat({"--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:" + port,
                "--rdzv_id=differ", "--max_restarts=" + std::to_string(max_restarts),
                "--rdzv_conf=join_timeout=" + join_timeout},
               sh("true")));
  };
  auto first = agent(1, "5");
  REQUIRE(wait_for_port(std::stoi(port), 30s));
  auto second = agent(2, "30");
  int rc2 = second->exit_code(30s);
  std::string out2 = second->read_all(1s);
  INFO(out2);
  CHECK(rc2 == 2);
  CHECK(contains(out2, "--max_restarts: the job's first node has 1, this node"));
  CHECK(contains(out2, "has 2"));
  CHECK(first->exit_code(30s) == 3);  // never completes: bounded by its join_timeout
}

TEST_CASE(
    "c10d: two ids share one standalone ctorch-store at the endpoint, each with its "
    "own workers' store",
    "[multiproc]") {
  Process store({CTORCHRUN_STORE_BIN, "--host", "127.0.0.1", "--port", "0"});
  const int port = wait_for_listening_port(store, 20s);
  REQUIRE(port > 0);
  TempDir d;
  auto agent = [&](const std::string& id) {
    const std::string body = "echo \"$WORLD_SIZE $MASTER_PORT\" > " + d.path + "/" + id + "_$RANK";
    return start_ctorchrun(concat(
        {"--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:" + std::to_string(port),
         "--rdzv_id=" + id, "--rdzv_conf=join_timeout=60"},
        sh(body)));
  };
  auto a0 = agent("jobA");
  auto b0 = agent("jobB");
  auto a1 = agent("jobA");
  auto b1 = agent("jobB");
  std::string out;
  std::vector<int> codes;
  for (auto* p : {a0.get(), b0.get(), a1.get(), b1.get()}) {
    codes.push_back(p->exit_code(60s));
    out += p->read_all(1s) + "\n----\n";
  }
  INFO(out);
  for (int rc : codes) CHECK(rc == 0);
  std::map<std::string, std::set<std::string>> ports;
  for (const std::string id : {"jobA", "jobB"}) {
    for (int rank = 0; rank < 2; ++rank) {
      const std::string f = d.file(id + "_" + std::to_string(rank));
      REQUIRE(file_exists(f));
      std::istringstream in(read_file(f));
      std::string world, master_port;
      in >> world >> master_port;
      CHECK(world == "2");
      ports[id].insert(master_port);
    }
  }
  CHECK(ports["jobA"].size() == 1);
  CHECK(ports["jobB"].size() == 1);
  CHECK(ports["jobA"] != ports["jobB"]);
  CHECK(count_lines_with(out, "hosting the rendezvous store") == 0);
}

TEST_CASE("c10d: three agents with --nnodes=1:3 and different --nproc_per_node complete at MAX",
          "[multiproc]") {
  TempDir d;
  const std::string port = std::to_string(free_port());
  const std::string body =
      "echo \"$WORLD_SIZE $GROUP_RANK $LOCAL_WORLD_SIZE\" > " + d.path + "/rank_$RANK";
  // last_call_timeout is long: only reaching MAX completes the round early.
  auto agent = [&](int nproc) {
    return start_ctorchrun(
        concat({"--nnodes=1:3", "--nproc_per_node=" + std::to_string(nproc), "--rdzv_backend=c10d",
                "--rdzv_endpoint=127.0.0.1:" + port, "--rdzv_id=three",
                "--rdzv_conf=join_timeout=60,last_call_timeout=60"},
               sh(body)));
  };
  auto a = agent(1);
  auto b = agent(2);
  auto c = agent(3);
  std::string out;
  std::vector<int> codes;
  for (auto* p : {a.get(), b.get(), c.get()}) {
    codes.push_back(p->exit_code(50s));
    out += p->read_all(1s) + "\n----\n";
  }
  INFO(out);
  for (int rc : codes) CHECK(rc == 0);
  // Global ranks follow the nodes' sizes in group-rank order: 6 workers.
  std::map<int, int> workers_per_node, local_world_of;
  for (int rank = 0; rank < 6; ++rank) {
    const std::string f = d.file("rank_" + std::to_string(rank));
    REQUIRE(file_exists(f));
    std::istringstream in(read_file(f));
    int world = 0, group_rank = -1, local_world = 0;
    in >> world >> group_rank >> local_world;
    CHECK(world == 6);
    ++workers_per_node[group_rank];
    local_world_of[group_rank] = local_world;
  }
  REQUIRE(workers_per_node.size() == 3);
  for (auto [node, n] : workers_per_node) CHECK(n == local_world_of[node]);
  CHECK_FALSE(file_exists(d.file("rank_6")));
}

TEST_CASE("c10d: the DDP example on two c10d agents ends with the static backend's digest",
          "[torch]") {
  const std::string example = CTORCHRUN_SOURCE_DIR "/examples/ddp_train.py";
  TempDir d;
  auto run_pair = [&](const std::vector<std::string>& first, const std::vector<std::string>& second,
                      const std::string& workdir) {
    auto tail = std::vector<std::string>{example, "--workdir", workdir, "--epochs", "2"};
    auto a = start_ctorchrun(concat(first, tail));
    auto b = start_ctorchrun(concat(second, tail));
    int rca = a->exit_code(150s), rcb = b->exit_code(150s);
    std::string out = a->read_all(1s) + "\n----\n" + b->read_all(1s);
    INFO(out);
    CHECK(rca == 0);
    CHECK(rcb == 0);
    return read_file(workdir + "/result.json");
  };
  const std::string sp = std::to_string(free_port());
  const std::string static_result =
      run_pair({"--nnodes=2", "--node_rank=0", "--master_port=" + sp},
               {"--nnodes=2", "--node_rank=1", "--master_port=" + sp}, d.file("static"));
  const std::vector<std::string> c10d = {"--nnodes=2", "--rdzv_backend=c10d",
                                         "--rdzv_endpoint=127.0.0.1:" + std::to_string(free_port()),
                                         "--rdzv_id=ddp"};
  const std::string c10d_result = run_pair(c10d, c10d, d.file("c10d"));
  auto digest = [](const std::string& json) {
    auto j = nlohmann::json::parse(json, nullptr, false);
    return j.is_object() && j.contains("digest") ? j["digest"].dump() : std::string();
  };
  INFO("static: " << static_result << "\nc10d: " << c10d_result);
  REQUIRE_FALSE(digest(static_result).empty());
  CHECK(digest(static_result) == digest(c10d_result));
}

namespace {

// The subdirectories of the only run directory under `log_dir`.
std::set<std::string> attempt_dirs(const std::string& log_dir) {
  std::set<std::string> out;
  for (const auto& run : std::filesystem::directory_iterator(log_dir)) {
    for (const auto& a : std::filesystem::directory_iterator(run.path())) {
      out.insert(a.path().filename().string());
    }
  }
  return out;
}

}  // namespace

TEST_CASE(
    "c10d: a node joining a running job is admitted without a restart: the world grows, "
    "it takes the job's restart count, the round logs under attempt_<k>.r<round>",
    "[multiproc]") {
  TempDir d;
  const std::string port = std::to_string(free_port());
  // Attempt 0 at world 1 fails once (restart 1 of 1 used); after that a
  // world of 1 waits for the newcomer, and a world of 2 finishes.
  const std::string body =
      "echo \"$WORLD_SIZE $RANK $CTORCHRUN_FAILED_RESTARTS $TORCHELASTIC_RESTART_COUNT\" >> " +
      d.path +
      "/seen_$GROUP_RANK; "
      "if [ \"$WORLD_SIZE\" = 2 ]; then exit 0; fi; "
      "if [ \"$CTORCHRUN_FAILED_RESTARTS\" = 0 ]; then exit 1; fi; "
      "echo x > " +
      d.path +
      "/waiting; "
      "i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; exit 9";
  auto agent = [&](const std::string& name) {
    return start_ctorchrun(
        concat({"--nnodes=1:2", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:" + port,
                "--rdzv_id=grow", "--max_restarts=1", "--log_dir=" + d.file("logs_" + name),
                "--events_file=" + d.file("events_" + name),
                "--rdzv_conf=join_timeout=60,last_call_timeout=1"},
               sh(body)));
  };
  auto a = agent("a");
  REQUIRE(wait_for_file(d.file("waiting"), 60s));
  auto b = agent("b");
  int rca = a->exit_code(60s), rcb = b->exit_code(60s);
  std::string outa = a->read_all(1s), outb = b->read_all(1s);
  INFO(outa + "\n----\n" + outb);
  CHECK(rca == 0);
  CHECK(rcb == 0);
  // Both ranks of the grown world ran with the job's charged restarts, 1;
  // TORCHELASTIC_RESTART_COUNT counts the admission's re-formation too.
  CHECK(read_file(d.file("seen_0")) == "1 0 0 0\n1 0 1 1\n2 0 1 2\n");
  CHECK(read_file(d.file("seen_1")) == "2 1 1 2\n");
  CHECK(contains(outb, "waiting to be admitted"));
  CHECK(contains(outa, "round 0 gives way to the next: admitting 1 waiting node"));
  const std::string events = read_file(d.file("events_a"));
  CHECK(count_lines_with(events, "\"event\":\"round_gives_way\"") == 1);
  CHECK(count_lines_with(events, "\"event\":\"restart\"") == 1);      // the failure only
  CHECK(count_lines_with(events, "\"event\":\"node_joined\"") == 2);  // a, then b
  CHECK(attempt_dirs(d.file("logs_a")) ==
        std::set<std::string>{"attempt_0", "attempt_1", "attempt_1.r1"});
  CHECK(attempt_dirs(d.file("logs_b")) == std::set<std::string>{"attempt_1"});
}

TEST_CASE("c10d: a node beyond MAX waits as a spare, says so, and exits 0 when the job ends",
          "[multiproc]") {
  TempDir d;
  const std::string port = std::to_string(free_port());
  const std::string body = "echo x > " + d.path + "/running; i=0; while [ ! -e " + d.path +
                           "/stop ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done";
  auto agent = [&] {
    return start_ctorchrun(
        concat({"--nnodes=1:1", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:" + port,
                "--rdzv_id=spare", "--rdzv_conf=join_timeout=2,last_call_timeout=1"},
               sh(body)));
  };
  auto a = agent();
  REQUIRE(wait_for_file(d.file("running"), 60s));
  std::remove(d.file("running").c_str());
  auto spare = agent();
  // It waits beyond join_timeout (2 s): the job runs.
  REQUIRE(wait_for_line(*spare, "waiting as a spare", 30s));
  CHECK_FALSE(spare->exit_code(3s) == 0);
  CHECK_FALSE(file_exists(d.file("running")));  // it started no worker
  std::ofstream(d.file("stop")).close();
  int rca = a->exit_code(30s), rcs = spare->exit_code(30s);
  std::string out = a->read_all(1s) + "\n----\n" + spare->read_all(1s);
  INFO(out);
  CHECK(rca == 0);
  CHECK(rcs == 0);
  CHECK(contains(out, "the job ended (succeeded) while this node waited for a round"));
}

TEST_CASE(
    "c10d: on a standalone store a finished id refuses a node at once (exit 3) within "
    "join_timeout, then serves a new job",
    "[multiproc]") {
  Process store({CTORCHRUN_STORE_BIN, "--host", "127.0.0.1", "--port", "0"});
  const int port = wait_for_listening_port(store, 20s);
  REQUIRE(port > 0);
  auto run = [&] {
    return run_ctorchrun(concat({"--nnodes=1", "--rdzv_backend=c10d",
                                 "--rdzv_endpoint=127.0.0.1:" + std::to_string(port),
                                 "--rdzv_id=once", "--rdzv_conf=join_timeout=3"},
                                sh("true")),
                         {}, 30s);
  };
  auto first = run();
  INFO(first.output);
  REQUIRE(first.exit_code == 0);
  const auto t0 = std::chrono::steady_clock::now();
  auto again = run();
  INFO(again.output);
  CHECK(again.exit_code == 3);
  CHECK(contains(again.output, "the job of this --rdzv_id ended (succeeded)"));
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);  // at once, not after join_timeout
  // After the window the id is free: a new job forms and succeeds.
  std::this_thread::sleep_for(3s);
  auto later = run();
  INFO(later.output);
  CHECK(later.exit_code == 0);
}

TEST_CASE(
    "c10d: torch workers (gloo) of a running c10d job grow from one node to two when a "
    "node joins",
    "[torch]") {
  TempDir d;
  const std::string port = std::to_string(free_port());
  const std::string worker = CTORCHRUN_SOURCE_DIR "/tests/torch/elastic_worker.py";
  auto agent = [&] {
    return start_ctorchrun(
        {"--nnodes=1:2", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:" + port,
         "--rdzv_id=torchgrow", "--max_restarts=0",
         "--rdzv_conf=join_timeout=120,last_call_timeout=1", worker},
        {{"ELASTIC_TARGET_WORLD", "2"}});
  };
  auto a = agent();
  REQUIRE(wait_for_line(*a, "JOINED rank=0 world=1", 120s));
  auto b = agent();
  int rca = a->exit_code(150s), rcb = b->exit_code(150s);
  std::string out = a->read_all(1s) + "\n----\n" + b->read_all(1s);
  INFO(out);
  CHECK(rca == 0);
  CHECK(rcb == 0);
  CHECK(contains(out, "GROWN rank=0 world=2 sum=2 restart=0 count=1"));
  CHECK(contains(out, "GROWN rank=1 world=2 sum=2 restart=0 count=1"));
}
