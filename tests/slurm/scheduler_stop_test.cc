// What a signal means under a scheduler (agent/scheduler_stop.h), and what the
// README and --help say about it.

#include "agent/scheduler_stop.h"

#include <signal.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <sstream>
#include <string>

#include "common/exit_codes.h"
#include "tests/cli/parse_support.h"

using namespace ctorchrun;

namespace {

agent::LaunchConfig under_slurm() {
  agent::LaunchConfig c;
  c.scheduler = "slurm";
  c.scheduler_signals = {SIGTERM, SIGINT, SIGUSR1, SIGUSR2};
  return c;
}

std::string file_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

TEST_CASE("scheduler stop: the scheduler's signals exit 75 and the others 128+N", "[unit]") {
  const agent::LaunchConfig slurm = under_slurm();
  CHECK(agent::signal_exit_code(slurm, SIGTERM) == kExitSchedulerStop);
  CHECK(agent::signal_exit_code(slurm, SIGUSR1) == 75);
  CHECK(agent::signal_exit_code(slurm, SIGHUP) == 128 + SIGHUP);
  CHECK(agent::signal_stop_message(slurm, SIGTERM).find("scheduler") != std::string::npos);
  const agent::LaunchConfig plain;
  CHECK(agent::signal_exit_code(plain, SIGTERM) == 143);
  CHECK_FALSE(agent::is_scheduler_signal(plain, SIGTERM));
  CHECK_FALSE(agent::is_scheduler_signal(slurm, 0));
}

TEST_CASE("scheduler stop: a worker's death by the scheduler's signal may be the scheduler's",
          "[unit]") {
  const agent::LaunchConfig slurm = under_slurm();
  worker::WorkerExit e;
  e.signaled = true;
  e.signal = SIGTERM;
  CHECK(agent::may_be_scheduler_stop(slurm, e));
  e.signal = SIGSEGV;
  CHECK_FALSE(agent::may_be_scheduler_stop(slurm, e));
  e.signaled = false;
  e.exit_code = 128 + SIGUSR1;  // a shell's way of saying it
  CHECK(agent::may_be_scheduler_stop(slurm, e));
  e.exit_code = 1;
  CHECK_FALSE(agent::may_be_scheduler_stop(slurm, e));
  e.signaled = true;
  e.signal = SIGTERM;
  CHECK_FALSE(agent::may_be_scheduler_stop(agent::LaunchConfig{}, e));
}

TEST_CASE("scheduler stop: the README shows the sbatch example verbatim and lists exit code 75",
          "[unit]") {
  const std::string readme = file_text(CTORCHRUN_SOURCE_DIR "/README.md");
  const std::string example = file_text(CTORCHRUN_SOURCE_DIR "/examples/slurm/train.sbatch");
  REQUIRE_FALSE(example.empty());
  CHECK(readme.find("```sh\n" + example + "```") != std::string::npos);
  CHECK(readme.find("| 75 | stopped by the scheduler") != std::string::npos);
  CHECK(example.find("scontrol requeue") != std::string::npos);
  auto help = testing::parse({"--help"});
  CHECK(help.message.find("75       stopped by the scheduler") != std::string::npos);
}
