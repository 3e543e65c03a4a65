// The command line: torchrun's options in both spellings, PET_ fallbacks,
// the script passed through untouched, and one clear line for bad input.

#include "cli/command_line.h"

#include <catch2/catch.hpp>

#include "tests/cli/parse_support.h"

using namespace ctorchrun;
using namespace ctorchrun::testing;
using cli::ParseOutcome;

namespace {

void require_usage_error(const std::vector<std::string>& args, const std::string& fragment) {
  auto r = parse(args);
  INFO("args: " << Catch::Detail::stringify(args) << " message: " << r.message);
  REQUIRE(r.kind == ParseOutcome::Kind::kExit);
  CHECK(r.exit_code == 2);
  CHECK(r.message.find(fragment) != std::string::npos);
  CHECK(r.message.find('\n') == std::string::npos);  // one line
}

}  // namespace

TEST_CASE("command line: torchrun's options in both spellings, script args untouched", "[unit]") {
  for (const char* spelling : {"--nproc_per_node=4", "--nproc-per-node=4"}) {
    auto r = parse({spelling, "--max_restarts", "2", "--master-port=1234", "train.py", "--epochs",
                    "10", "--nproc_per_node=9"});
    REQUIRE(r.kind == ParseOutcome::Kind::kRun);
    CHECK(r.config.nproc_per_node == 4);
    CHECK(r.config.max_restarts == 2);
    CHECK(r.config.master_port == 1234);
    CHECK(r.config.entrypoint == std::vector<std::string>{"/usr/bin/python3", "-u", "train.py",
                                                          "--epochs", "10", "--nproc_per_node=9"});
    CHECK(r.config.entrypoint_name == "train.py");
  }
}

TEST_CASE("command line: --no_python, -m and the interpreter choice", "[unit]") {
  auto r = parse({"--no_python", "./trainer", "-x"});
  REQUIRE(r.kind == ParseOutcome::Kind::kRun);
  CHECK(r.config.entrypoint == std::vector<std::string>{"./trainer", "-x"});
  r = parse({"-m", "pkg.mod", "a"});
  CHECK(r.config.entrypoint ==
        std::vector<std::string>{"/usr/bin/python3", "-u", "-m", "pkg.mod", "a"});
  r = parse({"s.py"}, {{"PYTHON_EXEC", "/opt/py"}, {"CTORCHRUN_PYTHON", ""}});
  CHECK(r.config.entrypoint.front() == "/opt/py");
  r = parse({"s.py"}, {{"PYTHON_EXEC", "/opt/py"}, {"CTORCHRUN_PYTHON", "/my/py"}});
  CHECK(r.config.entrypoint.front() == "/my/py");
  r = parse({"s.py"}, {{"CTORCHRUN_PYTHON", ""}});
  CHECK(r.config.entrypoint.front() == "python3");
}

TEST_CASE("command line: PET_ variables are fallbacks, the command line wins", "[unit]") {
  auto r = parse({"s.py"}, {{"PET_NPROC_PER_NODE", "3"}, {"PET_MASTER_PORT", "4321"}});
  REQUIRE(r.kind == ParseOutcome::Kind::kRun);
  CHECK(r.config.nproc_per_node == 3);
  CHECK(r.config.master_port == 4321);
  r = parse({"--nproc_per_node=2", "s.py"}, {{"PET_NPROC_PER_NODE", "3"}});
  CHECK(r.config.nproc_per_node == 2);
}

TEST_CASE("command line: nodes, endpoint, rdzv_conf, redirects, tee, filter", "[unit]") {
  auto r = parse({"--nnodes=2", "--node_rank=1", "--rdzv_endpoint=10.0.0.5:29400", "--rdzv_id=job7",
                  "--rdzv_conf=timeout=5,read_timeout=60", "--redirects=0:1,1:2", "-t", "3",
                  "--local_ranks_filter=0,2", "s.py"});
  REQUIRE(r.kind == ParseOutcome::Kind::kRun);
  const auto& c = r.config;
  CHECK(c.nnodes() == 2);
  CHECK(c.node_rank == 1);
  CHECK(c.master_addr == "10.0.0.5");
  CHECK(c.master_port == 29400);
  CHECK(c.run_id == "job7");
  CHECK(c.rdzv_timeout == std::chrono::milliseconds(5000));
  CHECK(c.redirects_for(0) == 1);
  CHECK(c.redirects_for(1) == 2);
  CHECK(c.redirects_for(5) == 0);
  CHECK(c.tee_for(7) == 3);
  REQUIRE(c.local_ranks_filter);
  CHECK(*c.local_ranks_filter == std::vector<int>{0, 2});
}

TEST_CASE("command line: OMP_NUM_THREADS=1 with torchrun's notice when nproc > 1 and unset",
          "[unit]") {
  auto r = parse({"--nproc_per_node=2", "s.py"});
  CHECK(r.config.environment.at("OMP_NUM_THREADS") == "1");
  CHECK(r.notices.size() == 1);
  r = parse({"--nproc_per_node=2", "s.py"}, {{"OMP_NUM_THREADS", "4"}});
  CHECK(r.config.environment.at("OMP_NUM_THREADS") == "4");
  CHECK(r.notices.empty());
  r = parse({"s.py"});
  CHECK(r.config.environment.count("OMP_NUM_THREADS") == 0);
}

TEST_CASE("command line: --standalone is one node on a free local port", "[unit]") {
  auto r = parse({"--standalone", "--nproc_per_node=2", "s.py"});
  REQUIRE(r.kind == ParseOutcome::Kind::kRun);
  CHECK(r.config.master_port == 0);
  CHECK(r.config.master_addr == "127.0.0.1");
  CHECK(r.config.nnodes() == 1);
  CHECK(r.config.run_id.rfind("standalone_", 0) == 0);
}

TEST_CASE("command line: bad input is one clear line and exit code 2", "[unit]") {
  require_usage_error({"--nproc_per_node=abc", "s.py"}, "'abc' is not a number of workers");
  require_usage_error({"--nproc_per_node=0", "s.py"}, "'0' is not a number of workers");
  require_usage_error({"--nnodes=x", "s.py"}, "not an integer");
  // The option is named as written.
  require_usage_error({"--node_rank=x", "s.py"}, "--node_rank: ");
  require_usage_error({"--node-rank=x", "s.py"}, "--node-rank: ");
  require_usage_error({"--rdzv_id"}, "--rdzv_id: a value is required");
  require_usage_error({"--nnodes=3:2", "s.py"}, "MIN is greater than MAX");
  require_usage_error({"--nnodes=2", "--node_rank=2", "s.py"}, "must be below --nnodes=2");
  require_usage_error({"--master_port=70000", "s.py"}, "--master_port: Value 70000 not in range");
  require_usage_error({"--bogus", "s.py"}, "--bogus");
  require_usage_error({"--nproc", "2", "s.py"}, "--nproc");  // no abbreviations
  require_usage_error({"--nproc_per_node=2"}, "no training script");
  require_usage_error({"-m", "--no_python", "x"}, "cannot be used together");
  require_usage_error({"--redirects=4", "s.py"}, "--redirects");
  require_usage_error({"--rdzv_backend=c10d", "--nnodes=1:2", "s.py"}, "needs --rdzv_endpoint");
  require_usage_error({"--nnodes=1:2", "s.py"}, "dynamic rendezvous");
  require_usage_error({"--rdzv_conf=oops", "s.py"}, "KEY=VALUE");
  require_usage_error({"--signals_to_handle=SIGNOPE", "s.py"}, "SIGNOPE");
  require_usage_error({"--max_restarts=-1", "s.py"}, "--max_restarts: Value -1 not in range");
}

TEST_CASE("command line: --help documents every option, the variables and the exit codes",
          "[unit]") {
  auto r = parse({"--help"});
  REQUIRE(r.kind == ParseOutcome::Kind::kExit);
  CHECK(r.exit_code == 0);
  for (const char* s : {"--nnodes",
                        "--nproc-per-node",
                        "--node-rank",
                        "--master-addr",
                        "--master-port",
                        "--max-restarts",
                        "--rdzv-backend",
                        "--rdzv-endpoint",
                        "--rdzv-id",
                        "--rdzv-conf",
                        "--standalone",
                        "--no-python",
                        "--module",
                        "--log-dir",
                        "--redirects",
                        "--tee",
                        "--local-ranks-filter",
                        "--shutdown-timeout",
                        "--exit-barrier-timeout",
                        "--events-file",
                        "PET_",
                        "CTORCHRUN_PYTHON",
                        "LOGLEVEL",
                        "128+N",
                        "Exit codes"}) {
    INFO(s);
    CHECK(r.message.find(s) != std::string::npos);
  }
}

TEST_CASE("command line: --logs_specs default is accepted, a plugin name is exit 2 in one line",
          "[unit]") {
  for (const char* spelling : {"--logs_specs=default", "--logs-specs=default"}) {
    auto r = parse({spelling, "s.py"});
    INFO(spelling << ": " << r.message);
    CHECK(r.kind == ParseOutcome::Kind::kRun);
  }
  auto r = parse({"s.py"}, {{"PET_LOGS_SPECS", "default"}});
  CHECK(r.kind == ParseOutcome::Kind::kRun);

  require_usage_error({"--logs_specs=my_layout", "s.py"},
                      "--logs_specs=my_layout: log-spec plugins are Python entry points");
  require_usage_error({"--logs-specs", "my_layout", "s.py"}, "--logs-specs=my_layout: ");
  r = parse({"s.py"}, {{"PET_LOGS_SPECS", "my_layout"}});
  REQUIRE(r.kind == ParseOutcome::Kind::kExit);
  CHECK(r.exit_code == 2);
  CHECK(r.message.find("PET_LOGS_SPECS=my_layout: ") != std::string::npos);
  CHECK(r.message.find("cannot load") != std::string::npos);
  CHECK(r.message.find('\n') == std::string::npos);
}
