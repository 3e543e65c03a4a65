// No orphans: the watcher process, directly and behind a SIGKILLed agent.

#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "tests/support/process.h"
#include "tests/worker/worker_test_util.h"
#include "worker/watcher.h"

using namespace ctorchrun::worker;
using namespace ctorchrun::worker::testing;
using ctorchrun::testing::Process;
using namespace std::chrono_literals;

namespace {

// A process in a process group of its own (the Process helper's doing), as a
// stand-in for a worker's group.
std::unique_ptr<Process> victim() {
  return std::make_unique<Process>(std::vector<std::string>{FAKE_WORKER, "--sleep-ms", "30000"});
}

bool killed_by_sigkill(Process& p) {
  auto status = p.wait(5s);
  return status && WIFSIGNALED(*status) && WTERMSIG(*status) == SIGKILL;
}

}  // namespace

TEST_CASE("Watcher: the end of the channel without bye SIGKILLs every group it was told of",
          "[multiproc]") {
  auto a = victim();
  auto b = victim();
  auto kept = victim();
  auto watcher = detail::Watcher::spawn();
  watcher->watch(a->pid());
  watcher->watch(b->pid());
  watcher->watch(kept->pid());
  watcher->forget(kept->pid());
  // Once set up (its own session is the last step before it reads), the
  // signals of a terminal, of a kill of the agent's group or of a scheduler
  // (Slurm's time-limit warning is SIGUSR1 to every process) leave it be.
  REQUIRE(eventually([&] { return ::getsid(watcher->pid()) == watcher->pid(); }, 5s));
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGUSR1, SIGUSR2}) {
    ::kill(watcher->pid(), sig);
  }
  watcher->close_without_bye_for_test();  // returns once the watcher has exited
  CHECK(killed_by_sigkill(*a));
  CHECK(killed_by_sigkill(*b));
  CHECK(process_alive(kept->pid()));
}

TEST_CASE("Watcher: bye makes it exit and kill nothing", "[multiproc]") {
  auto a = victim();
  auto watcher = detail::Watcher::spawn();
  pid_t watcher_pid = watcher->pid();
  watcher->watch(a->pid());
  CHECK(eventually([&] { return ::getsid(watcher_pid) == watcher_pid; }, 5s));  // own session
  watcher.reset();                                                              // bye, then reaped
  CHECK_FALSE(process_alive(watcher_pid));
  CHECK(process_alive(a->pid()));
}

TEST_CASE("Orphans: SIGKILL of the agent leaves no worker and no grandchild alive", "[multiproc]") {
  TempDir dir;
  const int workers = 3;
  Process host({LAUNCHER_HOST, "--mode", "block", "--workers", std::to_string(workers), "--",
                FAKE_WORKER, "--grandchild", dir.file("gc{rank}"), "--sleep-ms", "60000"});
  std::vector<pid_t> doomed;
  for (int r = 0; r < workers; ++r) {
    auto line = host.read_line(20s);
    REQUIRE(line);
    REQUIRE(line->rfind("pid ", 0) == 0);
    doomed.push_back(static_cast<pid_t>(std::stol(line->substr(4))));
  }
  REQUIRE(host.read_line(10s) == std::string("ready"));
  for (int r = 0; r < workers; ++r) {
    pid_t gc = wait_for_pid_file(dir.file("gc" + std::to_string(r)), 10s);
    REQUIRE(gc > 0);
    doomed.push_back(gc);
  }
  pid_t watcher = -1;
  for (auto& c : children_of(host.pid())) {
    if (c.comm == "ctorchrun-watch") watcher = c.pid;
  }
  REQUIRE(watcher > 0);
  for (pid_t pid : doomed) REQUIRE(process_alive(pid));

  host.signal(SIGKILL);
  auto status = host.wait(5s);
  REQUIRE(status);
  CHECK(WIFSIGNALED(*status));
  // PDEATHSIG takes the workers, the watcher their grandchildren; then the
  // watcher goes too.
  CHECK(eventually(
      [&] {
        for (pid_t pid : doomed) {
          if (process_alive(pid)) return false;
        }
        return true;
      },
      5s));
  for (pid_t pid : doomed) CHECK_FALSE(process_alive(pid));
  CHECK(eventually([&] { return !process_alive(watcher); }, 5s));
}

TEST_CASE("Orphans: SIGKILL of the agent's whole process group still leaves no grandchild",
          "[multiproc]") {
  TempDir dir;
  Process host({LAUNCHER_HOST, "--mode", "block", "--workers", "2", "--", FAKE_WORKER,
                "--grandchild", dir.file("gc{rank}"), "--sleep-ms", "60000"});
  std::vector<pid_t> doomed;
  for (int r = 0; r < 2; ++r) {
    auto line = host.read_line(20s);
    REQUIRE(line);
    doomed.push_back(static_cast<pid_t>(std::stol(line->substr(4))));
  }
  REQUIRE(host.read_line(10s) == std::string("ready"));
  for (int r = 0; r < 2; ++r) {
    pid_t gc = wait_for_pid_file(dir.file("gc" + std::to_string(r)), 10s);
    REQUIRE(gc > 0);
    doomed.push_back(gc);
  }
  // As a CI runner or a shell's job control would: the group, not the pid.
  host.signal_group(SIGKILL);
  REQUIRE(host.wait(5s));
  CHECK(eventually(
      [&] {
        for (pid_t pid : doomed) {
          if (process_alive(pid)) return false;
        }
        return true;
      },
      5s));
  for (pid_t pid : doomed) CHECK_FALSE(process_alive(pid));
}
