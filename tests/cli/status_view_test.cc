// ctorch-status (cli/status_view.h): the table from any JSON, and the binary
// against a real agent endpoint, a closed port and bad arguments.

#include "cli/status_view.h"

#include <signal.h>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "agent/health_server.h"
#include "agent/job_status.h"
#include "tests/launcher/launcher_support.h"

using namespace ctorchrun;
using namespace ctorchrun::testing;
using namespace std::chrono_literals;
using nlohmann::json;

namespace {

json fixture() {
  return json::parse(R"({"run_id": "job7", "rdzv_backend": "c10d", "state": "running",
    "attempt": 1, "max_restarts": 3, "round": 2, "world_size": 4, "worker_failures": 1,
    "restarts": {"failure": 1, "hang": 0, "membership": 1, "scheduler": 0},
    "nodes": [{"group_rank": 0, "host": "node-a", "state": "present", "local_world_size": 2,
               "first_rank": 0},
              {"group_rank": 1, "host": "node-b", "state": "lost", "local_world_size": 2,
               "first_rank": 2}],
    "ranks": [{"local_rank": 0, "rank": 0, "pid": 123, "state": "running", "stalled_s": 0.3,
               "cpu_s": 1.2, "rss_bytes": 12373196}],
    "failures": [{"time": 1764032050.0, "attempt": 0, "rank": 1, "node": 0, "host": "node-a",
                  "cause": "exit code 3"}]})");
}

}  // namespace

TEST_CASE("ctorch-status: HOST:PORT and [V6]:PORT are read, anything else refused", "[unit]") {
  std::string host, error;
  int port = 0;
  CHECK(cli::parse_agent_address("node0:9400", &host, &port, &error));
  CHECK(host == "node0");
  CHECK(port == 9400);
  CHECK(cli::parse_agent_address("[::1]:9400", &host, &port, &error));
  CHECK(host == "::1");
  for (const char* bad :
       {"node0", "node0:", ":9400", "node0:0", "node0:70000", "node0:94a0", "node0:123456"}) {
    INFO(bad);
    CHECK_FALSE(cli::parse_agent_address(bad, &host, &port, &error));
    CHECK(error.find("is not HOST:PORT") != std::string::npos);
  }
}

TEST_CASE("ctorch-status: the table names the job, nodes, ranks and last failures", "[unit]") {
  const std::string t = cli::render_status(fixture());
  INFO(t);
  CHECK(t.find("job job7  backend c10d  state running  attempt 1/3  round 2  world 4") !=
        std::string::npos);
  CHECK(t.find("restarts: failure 1, hang 0, membership 1, scheduler 0") != std::string::npos);
  CHECK(t.find("node-b") != std::string::npos);
  CHECK(t.find("lost") != std::string::npos);
  CHECK(t.find("2-3") != std::string::npos);
  CHECK(t.find("11.8") != std::string::npos);  // RSS in MiB
  CHECK(t.find("exit code 3") != std::string::npos);
}

TEST_CASE("ctorch-status: fields missing or of another type show as ?", "[unit]") {
  for (const std::string& text :
       {std::string(R"({})"), std::string(R"([])"), std::string(R"("x")"),
        std::string(R"({"nodes": 5, "ranks": [1, "x", null], "restarts": [],
                       "failures": [{"time": "late"}], "run_id": {"a": 1},
                       "attempt": 1e308, "world_size": -1})"),
        std::string(R"({"nodes": [{"first_rank": 1e300, "local_world_size": 1e300,
                                   "host": "a\u0000b\nc"}]})")}) {
    INFO(text);
    std::string t;
    CHECK_NOTHROW(t = cli::render_status(json::parse(text)));
    CHECK(t.find("job ") == 0);
    CHECK(t.find('\0') == std::string::npos);
  }
}

TEST_CASE("ctorch-status: the binary shows a real agent's endpoint and exits 0", "[multiproc]") {
  agent::JobStatusOptions o;
  o.run_id = "job-42";
  o.rdzv_backend = "static";
  auto job = std::make_shared<agent::JobStatus>(o);
  job->round_formed(0, 0, 0, 1, {{0, "node-a", "present", 2, 0, 1}}, 2);
  job->workers_started(0, 0, {4242, 4243});
  agent::HealthServerOptions so;
  so.host = "127.0.0.1";
  agent::HealthServer server(so, std::make_shared<agent::HealthStatus>(), job);
  Process p({CTORCHRUN_STATUS_BIN, "127.0.0.1:" + std::to_string(server.port())}, {}, true);
  const std::string out = p.read_all(10s);
  INFO(out);
  CHECK(p.exit_code(10s) == 0);
  CHECK(out.find("job job-42  backend static  state running") == 0);
  CHECK(out.find("4243") != std::string::npos);
}

TEST_CASE("ctorch-status: no agent is exit 1 naming the address, bad arguments exit 2",
          "[multiproc]") {
  const int port = free_port();
  Process gone({CTORCHRUN_STATUS_BIN, "127.0.0.1:" + std::to_string(port)}, {}, true);
  std::string out = gone.read_all(10s);
  INFO(out);
  CHECK(gone.exit_code(10s) == 1);
  CHECK(out.find("no answer from 127.0.0.1:" + std::to_string(port)) != std::string::npos);
  for (std::vector<std::string> args : {std::vector<std::string>{},
                                        {"node0"},
                                        {"node0:1", "--timeout", "0"},
                                        {"node0:1", "--watch", "--interval", "-3"},
                                        {"node0:1", "--bogus"}}) {
    args.insert(args.begin(), CTORCHRUN_STATUS_BIN);
    Process bad(args, {}, true);
    out = bad.read_all(10s);
    INFO(out);
    CHECK(bad.exit_code(10s) == 2);
  }
  // --watch goes on while the agent is gone, saying since when, until stopped.
  Process watching(
      {CTORCHRUN_STATUS_BIN, "--watch", "--interval", "0.2", "127.0.0.1:" + std::to_string(port)},
      {}, true);
  auto line = watching.read_line(10s);
  REQUIRE(line.has_value());
  CHECK(line->find("agent unreachable since ") == 0);
  line = watching.read_line(10s);
  REQUIRE(line.has_value());
  CHECK(line->find("agent unreachable since ") == 0);
  watching.signal(SIGINT);
  CHECK(watching.exit_code(10s) == 0);
  Process version({CTORCHRUN_STATUS_BIN, "--version"}, {}, true);
  CHECK(version.read_all(10s).find("ctorch-status ") == 0);
  CHECK(version.exit_code(10s) == 0);
}
