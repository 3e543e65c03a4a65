// The step's topology (cli/slurm.h) and how the command line uses it: the
// environment in, the LaunchConfig out. No cluster needed.

#include <signal.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <map>
#include <string>

#include "cli/slurm.h"
#include "common/error.h"
#include "tests/cli/parse_support.h"

using ctorchrun::ConfigError;
using ctorchrun::cli::resolve_slurm;
using ctorchrun::cli::slurm_port;
using ctorchrun::cli::SlurmGiven;
using ctorchrun::cli::SlurmMode;
using Env = std::map<std::string, std::string>;

namespace {

// Task 1 of a 2-node step 3 of job 42 in a 4-node allocation, as srun sets it.
Env step_env() {
  return {{"SLURM_JOB_ID", "42"},
          {"SLURM_STEP_ID", "3"},
          {"SLURM_PROCID", "1"},
          {"SLURM_NODEID", "1"},
          {"SLURM_STEP_NUM_NODES", "2"},
          {"SLURM_STEP_NUM_TASKS", "2"},
          {"SLURM_NTASKS", "2"},
          {"SLURM_STEP_TASKS_PER_NODE", "1(x2)"},
          {"SLURM_TASKS_PER_NODE", "1(x2)"},
          {"SLURM_JOB_NUM_NODES", "4"},
          {"SLURM_JOB_NODELIST", "n[1-4]"},
          {"SLURM_STEP_NODELIST", "n[03-04]"},
          {"SLURMD_NODENAME", "n04"}};
}

}  // namespace

TEST_CASE("slurm: a task of a step takes nodes rank master port and id from the step", "[unit]") {
  auto t = resolve_slurm(SlurmMode::kAuto, SlurmGiven{}, step_env());
  REQUIRE(t.active);
  CHECK(t.nnodes == 2);
  CHECK(t.node_rank == 1);
  CHECK(t.master_addr == std::string("n03"));  // the step's first host, not the allocation's
  CHECK(t.port == slurm_port("42", "3"));
  CHECK(t.rdzv_id == std::string("42.3"));
  CHECK(t.nproc_per_node == 1);
  CHECK(t.summary.find("SLURM_STEP_NODELIST=n[03-04]") != std::string::npos);
  CHECK(t.summary.find("node_rank=1 (SLURM_NODEID)") != std::string::npos);
}

TEST_CASE("slurm: each value given on the command line wins on its own", "[unit]") {
  SlurmGiven given;
  given.node_rank = true;
  given.master_port = true;
  auto t = resolve_slurm(SlurmMode::kAuto, given, step_env());
  REQUIRE(t.active);
  CHECK_FALSE(t.node_rank);
  CHECK_FALSE(t.port);
  CHECK(t.nnodes == 2);
  CHECK(t.master_addr == std::string("n03"));
  CHECK(t.summary.find("SLURM_NODEID") == std::string::npos);
  given.rdzv_endpoint = true;  // an endpoint names the host and the port
  t = resolve_slurm(SlurmMode::kAuto, given, step_env());
  CHECK_FALSE(t.master_addr);
}

TEST_CASE("slurm: workers per node default to the step's GPUs then CUDA_VISIBLE_DEVICES then 1",
          "[unit]") {
  Env env = step_env();
  env["CUDA_VISIBLE_DEVICES"] = "0,1,2";
  CHECK(resolve_slurm(SlurmMode::kAuto, {}, env).nproc_per_node == 3);
  env["SLURM_GPUS_ON_NODE"] = "4";
  CHECK(resolve_slurm(SlurmMode::kAuto, {}, env).nproc_per_node == 4);
  SlurmGiven given;
  given.nproc_per_node = true;
  CHECK_FALSE(resolve_slurm(SlurmMode::kAuto, given, env).nproc_per_node);
}

TEST_CASE("slurm: several tasks on a node are refused saying to use --ntasks-per-node=1",
          "[unit]") {
  for (auto [key, value] :
       std::vector<std::pair<std::string, std::string>>{{"SLURM_STEP_TASKS_PER_NODE", "2(x2)"},
                                                        {"SLURM_STEP_TASKS_PER_NODE", "1,2"},
                                                        {"SLURM_STEP_NUM_TASKS", "4"}}) {
    INFO(key << "=" << value);
    Env env = step_env();
    env[key] = value;
    try {
      resolve_slurm(SlurmMode::kAuto, {}, env);
      FAIL("accepted");
    } catch (const ConfigError& e) {
      CHECK(std::string(e.what()).find("--ntasks-per-node=1") != std::string::npos);
    }
  }
  // Without the step's own counts, the job's.
  Env env = step_env();
  env.erase("SLURM_STEP_TASKS_PER_NODE");
  env.erase("SLURM_STEP_NUM_TASKS");
  env["SLURM_TASKS_PER_NODE"] = "8(x2)";
  CHECK_THROWS_AS(resolve_slurm(SlurmMode::kAuto, {}, env), ConfigError);
}

TEST_CASE("slurm: --slurm=on outside a step is an error and off ignores the step", "[unit]") {
  Env batch = step_env();
  batch.erase("SLURM_STEP_ID");
  CHECK_THROWS_AS(resolve_slurm(SlurmMode::kOn, {}, batch), ConfigError);
  CHECK_FALSE(resolve_slurm(SlurmMode::kOff, {}, step_env()).active);
  CHECK(resolve_slurm(SlurmMode::kOn, {}, step_env()).active);
  CHECK_FALSE(resolve_slurm(SlurmMode::kAuto, {}, {}).active);
  // The batch step is no srun step.
  batch["SLURM_STEP_ID"] = "4294967294";
  CHECK_FALSE(resolve_slurm(SlurmMode::kAuto, {}, batch).active);
}

TEST_CASE("slurm: a multi-node job outside any step warns in one line", "[unit]") {
  Env batch = step_env();
  batch.erase("SLURM_STEP_ID");
  auto t = resolve_slurm(SlurmMode::kAuto, {}, batch);
  CHECK_FALSE(t.active);
  CHECK(t.warning.find("outside any job step") != std::string::npos);
  CHECK(t.warning.find('\n') == std::string::npos);
  batch["SLURM_JOB_NUM_NODES"] = "1";
  CHECK(resolve_slurm(SlurmMode::kAuto, {}, batch).warning.empty());
}

TEST_CASE("slurm: a malformed step variable is an error naming it", "[unit]") {
  Env env = step_env();
  env["SLURM_NODEID"] = "x";
  CHECK_THROWS_WITH(resolve_slurm(SlurmMode::kAuto, {}, env), Catch::Contains("SLURM_NODEID"));
  env = step_env();
  env["SLURM_NODEID"] = "2";  // not below the step's 2 nodes
  CHECK_THROWS_AS(resolve_slurm(SlurmMode::kAuto, {}, env), ConfigError);
  env = step_env();
  env["SLURM_STEP_NODELIST"] = "n[4-3]";
  CHECK_THROWS_WITH(resolve_slurm(SlurmMode::kAuto, {}, env), Catch::Contains("n[4-3]"));
}

TEST_CASE("slurm: the port is unprivileged outside the ephemeral range and differs per step",
          "[unit]") {
  for (const char* job : {"1", "42", "123456789", "7_3"}) {
    int last = -1;
    for (int step = 0; step < 64; ++step) {
      const int p = slurm_port(job, std::to_string(step));
      CHECK(p >= 20000);
      CHECK(p < 32000);
      CHECK(p != last);
      last = p;
    }
  }
  CHECK(slurm_port("42", "0") == slurm_port("42", "0"));
}

TEST_CASE("slurm: the command line fills what the step gives and keeps what it was given",
          "[unit]") {
  auto out = ctorchrun::testing::parse({"--nproc_per_node=2", "train.py"}, step_env());
  REQUIRE(out.kind == ctorchrun::cli::ParseOutcome::Kind::kRun);
  const auto& c = out.config;
  CHECK(c.min_nodes == 2);
  CHECK(c.max_nodes == 2);
  CHECK(c.node_rank == 1);
  CHECK(c.nproc_per_node == 2);
  CHECK(c.master_addr == "n03");
  CHECK(c.master_port == slurm_port("42", "3"));
  CHECK(c.run_id == "42.3");
  CHECK(c.rdzv_backend == "static");
  CHECK(c.scheduler == "slurm");
  CHECK(std::count(c.scheduler_signals.begin(), c.scheduler_signals.end(), SIGTERM) == 1);
  CHECK(std::count(c.signals_to_handle.begin(), c.signals_to_handle.end(), SIGUSR1) == 1);
  REQUIRE(out.infos.size() == 1);

  Env env = step_env();
  env["PET_MASTER_PORT"] = "23456";
  out = ctorchrun::testing::parse({"--node_rank=0", "train.py"}, env);
  REQUIRE(out.kind == ctorchrun::cli::ParseOutcome::Kind::kRun);
  CHECK(out.config.node_rank == 0);
  CHECK(out.config.master_port == 23456);
  CHECK(out.config.master_addr == "n03");

  out = ctorchrun::testing::parse({"--slurm=off", "train.py"}, step_env());
  REQUIRE(out.kind == ctorchrun::cli::ParseOutcome::Kind::kRun);
  CHECK(out.config.scheduler.empty());
  CHECK(out.config.master_addr == "127.0.0.1");
  CHECK(out.config.min_nodes == 1);
}

TEST_CASE("slurm: under c10d the endpoint defaults to the step's first host", "[unit]") {
  auto out =
      ctorchrun::testing::parse({"--nnodes=1:2", "--rdzv_backend=c10d", "train.py"}, step_env());
  REQUIRE(out.kind == ctorchrun::cli::ParseOutcome::Kind::kRun);
  CHECK(out.config.rdzv_endpoint_host == "n03");
  CHECK(out.config.rdzv_endpoint_port == slurm_port("42", "3"));
  CHECK(out.config.min_nodes == 1);
  CHECK(out.config.max_nodes == 2);
  CHECK(out.config.run_id == "42.3");
  // The store at the endpoint is hosted by the agent of the step's first host.
  CHECK(out.config.is_host == false);
  Env first = step_env();
  first["SLURM_NODEID"] = "0";
  out = ctorchrun::testing::parse({"--nnodes=1:2", "--rdzv_backend=c10d", "train.py"}, first);
  CHECK(out.config.is_host == true);
  out = ctorchrun::testing::parse(
      {"--nnodes=1:2", "--rdzv_backend=c10d", "--rdzv_conf=is_host=1", "train.py"}, step_env());
  CHECK(out.config.is_host == true);
  out = ctorchrun::testing::parse(
      {"--nnodes=1:2", "--rdzv_backend=c10d", "--rdzv_endpoint=h:1", "train.py"}, step_env());
  CHECK_FALSE(out.config.is_host.has_value());
}

TEST_CASE("slurm: refusals on the command line are usage errors (exit 2)", "[unit]") {
  Env env = step_env();
  env["SLURM_STEP_TASKS_PER_NODE"] = "2(x2)";
  auto out = ctorchrun::testing::parse({"train.py"}, env);
  REQUIRE(out.kind == ctorchrun::cli::ParseOutcome::Kind::kExit);
  CHECK(out.exit_code == 2);
  CHECK(out.message.find("--ntasks-per-node=1") != std::string::npos);
  out = ctorchrun::testing::parse({"--slurm=on", "train.py"}, {});
  REQUIRE(out.kind == ctorchrun::cli::ParseOutcome::Kind::kExit);
  CHECK(out.exit_code == 2);
  out = ctorchrun::testing::parse({"--slurm=maybe", "train.py"}, {});
  CHECK(out.exit_code == 2);
}

TEST_CASE("slurm: the agent forwards the scheduler's signals only under proctrack/pgid", "[unit]") {
  using ctorchrun::cli::slurm_signals_reach_workers;
  CHECK(slurm_signals_reach_workers(""));  // no slurm.conf readable: Slurm's default, cgroup
  CHECK(slurm_signals_reach_workers("ProctrackType=proctrack/cgroup\n"));
  CHECK(slurm_signals_reach_workers("ProctrackType=proctrack/linuxproc\n"));
  CHECK_FALSE(slurm_signals_reach_workers("ProctrackType=proctrack/pgid\n"));
  // Keys are case-insensitive, spaces and comments ignored, the last wins.
  CHECK_FALSE(
      slurm_signals_reach_workers("# ProctrackType=proctrack/cgroup\n"
                                  "  proctracktype = Proctrack/PGID  # tracked by pgid\n"));
  CHECK(slurm_signals_reach_workers(
      "ProctrackType=proctrack/pgid\nProctrackType=proctrack/cgroup\n"));
  CHECK(slurm_signals_reach_workers("#ProctrackType=proctrack/pgid\n"));
}
