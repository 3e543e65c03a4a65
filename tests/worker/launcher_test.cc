// The real launcher against real processes (fake_worker): exits, waiting,
// environment, executable lookup, stopping, signals, process groups.

#include "worker/launcher.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/error.h"
#include "tests/worker/worker_test_util.h"
#include "worker/numa_binding.h"

using namespace ctorchrun;
using namespace ctorchrun::worker;
using namespace ctorchrun::worker::testing;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

long elapsed_ms(Clock::time_point since) {
  return static_cast<long>(
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - since).count());
}

WorkerExit only(const std::vector<WorkerExit>& exits) {
  REQUIRE(exits.size() == 1);
  return exits.front();
}

// True once this test process has no child but launchers' watchers: after a
// launcher is done with its workers there must be none, zombies included. A
// freshly forked watcher carries our name until it renames itself, hence the
// wait; a left-over worker or an unreaped zombie stays and fails it.
bool no_stray_children() {
  std::vector<ChildProcess> strays;
  bool none = eventually(
      [&] {
        strays = children_of(::getpid());
        strays.erase(
            std::remove_if(strays.begin(), strays.end(),
                           [](const ChildProcess& c) { return c.comm == "ctorchrun-watch"; }),
            strays.end());
        return strays.empty();
      },
      5s);
  for (auto& c : strays)
    UNSCOPED_INFO("stray child pid=" << c.pid << " " << c.comm << " " << c.state);
  return none;
}

}  // namespace

TEST_CASE("ProcessLauncher: reports exit codes, and a death by signal as a signal, never a code",
          "[multiproc]") {
  auto launcher = make_process_launcher();
  auto pids = launcher->start({fake_spec(0, {"--exit", "3"}), fake_spec(1, {"--exit", "0"}),
                               fake_spec(2, {"--signal", std::to_string(SIGSEGV)}),
                               fake_spec(3, {"--signal", std::to_string(SIGKILL)})});
  REQUIRE(pids.size() == 4);
  auto exits = wait_for_exits(*launcher, 4, 10s);
  REQUIRE(exits.size() == 4);
  std::sort(exits.begin(), exits.end(),
            [](const WorkerExit& a, const WorkerExit& b) { return a.local_rank < b.local_rank; });
  for (int i = 0; i < 4; ++i) CHECK(exits[i].pid == pids[i]);

  CHECK_FALSE(exits[0].signaled);
  CHECK(exits[0].exit_code == 3);
  CHECK(exits[0].failed());

  CHECK_FALSE(exits[1].signaled);
  CHECK(exits[1].exit_code == 0);
  CHECK_FALSE(exits[1].failed());

  CHECK(exits[2].signaled);
  CHECK(exits[2].signal == SIGSEGV);
  CHECK(exits[2].exit_code == 0);
  CHECK(exits[2].failed());
  CHECK(describe(exits[2]) == "signal SIGSEGV (11)");

  CHECK(exits[3].signaled);
  CHECK(exits[3].signal == SIGKILL);
  CHECK(launcher->running() == 0);
  CHECK(launcher->stop(SIGTERM, 1s).empty());  // every exit was returned by wait()
}

TEST_CASE("ProcessLauncher: wait() returns as each worker exits, with no polling delay",
          "[multiproc]") {
  TempDir dir;
  auto launcher = make_process_launcher();
  const std::vector<long> sleeps = {100, 700, 1300};
  std::vector<WorkerSpec> specs;
  for (int r = 0; r < 3; ++r) {
    specs.push_back(
        fake_spec(r, {"--sleep-ms", std::to_string(sleeps[r]), "--time-file",
                      dir.file("t" + std::to_string(r)), "--exit", std::to_string(10 + r)}));
    // A sanitized worker would otherwise run LeakSanitizer between its last
    // act and its exit: time of the worker's, not the launcher's.
    specs.back().env["ASAN_OPTIONS"] = "detect_leaks=0";
  }
  launcher->start(specs);
  auto deadline = Clock::now() + 20s;
  for (int r = 0; r < 3; ++r) {
    auto exit = only(launcher->wait(deadline));
    auto returned = std::chrono::system_clock::now();
    CHECK(exit.local_rank == r);
    CHECK(exit.exit_code == 10 + r);
    // From the worker's last act to the exit being noticed, and from there to
    // wait() returning: both far below any polling interval worth the name.
    std::chrono::system_clock::time_point last_act(
        std::chrono::nanoseconds(std::stoll(read_file(dir.file("t" + std::to_string(r))))));
    CHECK(exit.time - last_act < 150ms);
    CHECK(exit.time <= returned);
    CHECK(returned - exit.time < 100ms);
  }
  CHECK(launcher->running() == 0);
}

TEST_CASE("ProcessLauncher: wake() from another thread makes a blocked wait() return early",
          "[multiproc]") {
  auto launcher = make_process_launcher();
  launcher->start({fake_spec(0, {"--sleep-ms", "30000"})});
  auto t0 = Clock::now();
  std::thread waker([&] {
    std::this_thread::sleep_for(150ms);
    launcher->wake();
  });
  auto exits = launcher->wait(Clock::now() + 20s);
  auto took = elapsed_ms(t0);
  waker.join();
  CHECK(exits.empty());
  CHECK(took >= 140);
  CHECK(took < 2000);
  CHECK(launcher->running() == 1);
  CHECK(only(launcher->stop(SIGTERM, 2s)).signal == SIGTERM);
}

TEST_CASE("ProcessLauncher: a wake() while nobody waits makes the next wait() return at once",
          "[multiproc]") {
  auto launcher = make_process_launcher();
  launcher->start({fake_spec(0, {"--sleep-ms", "30000"})});
  launcher->wake();
  auto t0 = Clock::now();
  CHECK(launcher->wait(Clock::now() + 20s).empty());
  CHECK(elapsed_ms(t0) < 1000);
  // Consumed: the next wait() blocks until its deadline.
  t0 = Clock::now();
  CHECK(launcher->wait(Clock::now() + 200ms).empty());
  CHECK(elapsed_ms(t0) >= 190);
}

TEST_CASE("ProcessLauncher: wait() returns empty at its deadline while workers run",
          "[multiproc]") {
  auto launcher = make_process_launcher();
  launcher->start({fake_spec(0, {"--sleep-ms", "30000"})});
  auto t0 = Clock::now();
  CHECK(launcher->wait(t0 + 250ms).empty());
  auto took = elapsed_ms(t0);
  CHECK(took >= 240);
  CHECK(took < 1500);
  // A deadline already past returns at once.
  t0 = Clock::now();
  CHECK(launcher->wait(t0 - 1s).empty());
  CHECK(elapsed_ms(t0) < 500);
}

TEST_CASE(
    "ProcessLauncher: a worker gets exactly spec.env, argv as given, spec.cwd, a session of its "
    "own, no blocked signals and only fds 0-2",
    "[multiproc]") {
  TempDir dir;
  TempDir work;
  auto launcher = make_process_launcher();
  WorkerSpec spec = fake_spec(0, {"--info-json", dir.file("info.json"), "--", "two words", ""});
  spec.env = {{"A", "1"}, {"WITH_SPACE", "x y=z"}, {"EMPTY", ""}, {"UNICODE", "\xc3\xa9t\xc3\xa9"}};
  spec.cwd = work.path;
  auto pids = launcher->start({spec});
  auto exit = only(wait_for_exits(*launcher, 1, 10s));
  CHECK(exit.exit_code == 0);
  auto info = nlohmann::json::parse(read_file(dir.file("info.json")));

  std::map<std::string, std::string> env = info["env"];
  CHECK(env == spec.env);
  std::vector<std::string> argv = info["argv"];
  CHECK(argv == spec.argv);
  CHECK(info["cwd"] == work.path);
  CHECK(info["pid"] == pids[0]);
  CHECK(info["ppid"] == ::getpid());
  CHECK(info["pgid"] == pids[0]);  // a process group of its own...
  CHECK(info["sid"] == pids[0]);   // ...in a session of its own
  CHECK(info["blocked"].empty());
  std::vector<int> ignored = info["ignored"];
  CHECK(std::find(ignored.begin(), ignored.end(), SIGTERM) == ignored.end());
  CHECK(std::find(ignored.begin(), ignored.end(), SIGPIPE) == ignored.end());
  for (int fd : info["fds"]) CHECK(fd <= 2);
}

TEST_CASE("ProcessLauncher: a program name without '/' is found in the PATH of spec.env",
          "[multiproc]") {
  TempDir dir;
  std::string helper_dir = FAKE_WORKER;
  helper_dir.erase(helper_dir.rfind('/'));
  auto launcher = make_process_launcher();
  WorkerSpec spec = fake_spec(0, {"--info-json", dir.file("info.json"), "--exit", "4"});
  spec.argv[0] = "fake_worker";
  spec.env["PATH"] = "/nonexistent:" + dir.path + ":" + helper_dir;  // not the agent's PATH
  launcher->start({spec});
  CHECK(only(wait_for_exits(*launcher, 1, 10s)).exit_code == 4);
  auto info = nlohmann::json::parse(read_file(dir.file("info.json")));
  CHECK(info["argv"][0] == "fake_worker");  // as given, not the resolved path
}

TEST_CASE("ProcessLauncher: without PATH in spec.env, a program name is found in the agent's PATH",
          "[multiproc]") {
  auto launcher = make_process_launcher();
  WorkerSpec spec;
  spec.argv = {"true"};
  spec.env = {{"A", "1"}};
  launcher->start({spec});
  auto exit = only(wait_for_exits(*launcher, 1, 10s));
  CHECK_FALSE(exit.failed());
}

TEST_CASE(
    "ProcessLauncher: a missing executable throws IoError naming rank, path and reason, and "
    "leaves nothing running",
    "[multiproc]") {
  auto launcher = make_process_launcher();
  WorkerSpec missing = fake_spec(1, {});
  missing.argv = {"/nonexistent/x", "--flag"};
  try {
    launcher->start(
        {fake_spec(0, {"--sleep-ms", "30000"}), missing, fake_spec(2, {"--sleep-ms", "30000"})});
    FAIL("start() did not throw");
  } catch (const IoError& e) {
    CHECK(std::string(e.what()) ==
          "cannot start worker local_rank=1: /nonexistent/x: No such file or directory");
  }
  CHECK(launcher->running() == 0);
  // The worker of rank 0 was started, then killed and reaped: no child left.
  CHECK(no_stray_children());
  // The launcher is usable again.
  launcher->start({fake_spec(0, {"--exit", "0"})});
  CHECK_FALSE(only(wait_for_exits(*launcher, 1, 10s)).failed());
}

TEST_CASE(
    "ProcessLauncher: a non-executable file, a name not in PATH, a missing cwd or an unwritable "
    "log file throw IoError saying why",
    "[multiproc]") {
  TempDir dir;
  auto launcher = make_process_launcher();
  auto message = [&](const WorkerSpec& spec) -> std::string {
    try {
      launcher->start({spec});
    } catch (const IoError& e) {
      return e.what();
    }
    launcher->stop(SIGKILL, 0ms);
    return "no error";
  };
  std::string plain = dir.file("plain.txt");
  { std::ofstream(plain) << "not a program\n"; }

  WorkerSpec spec = fake_spec(0, {});
  spec.argv = {plain};
  CHECK(message(spec) == "cannot start worker local_rank=0: " + plain + ": Permission denied");

  spec.argv = {"no_such_program_anywhere"};
  spec.env["PATH"] = dir.path;
  CHECK(message(spec) ==
        "cannot start worker local_rank=0: no_such_program_anywhere: not found "
        "in PATH=" +
            dir.path);

  spec = fake_spec(3, {});
  spec.cwd = dir.file("missing-dir");
  CHECK(message(spec) == "cannot start worker local_rank=3: working directory " + spec.cwd +
                             ": No such file or directory");

  spec = fake_spec(2, {});
  spec.redirects = kStdout;
  spec.stdout_path = dir.file("missing-dir/stdout.log");
  CHECK(message(spec) == "cannot start worker local_rank=2: cannot open " + spec.stdout_path +
                             ": No such file or directory");

  // A script the kernel cannot execute: the failure comes from exec itself.
  std::string script = dir.file("bad-script");
  { std::ofstream(script) << "#!/nonexistent/interpreter\n"; }
  ::chmod(script.c_str(), 0755);
  spec = fake_spec(0, {});
  spec.argv = {script};
  CHECK(message(spec) ==
        "cannot start worker local_rank=0: " + script + ": No such file or directory");
  CHECK(no_stray_children());
}

TEST_CASE(
    "ProcessLauncher: a set-up step that fails between fork and exec is named with its errno, "
    "and a failed exec names the program",
    "[multiproc]") {
  TempDir dir;
  auto launcher = make_process_launcher();
  auto message = [&](const WorkerSpec& spec) -> std::string {
    try {
      launcher->start({spec});
    } catch (const IoError& e) {
      return e.what();
    }
    launcher->stop(SIGKILL, 0ms);
    return "no error";
  };
  // A CPU this machine does not have: sched_setaffinity fails in the child.
  WorkerSpec spec = fake_spec(1, {"--exit", "0"});
  spec.cpus = {1000};
  CHECK(message(spec) ==
        "cannot start worker local_rank=1: sched_setaffinity() to CPUs 1000 failed "
        "(--numa-binding): Invalid argument");
  // A NUMA node it does not have: set_mempolicy fails (where it is allowed at all).
  if (memory_policy_unavailable().empty()) {
    spec = fake_spec(2, {"--exit", "0"});
    spec.memory_nodes = {1000};
    CHECK(message(spec) ==
          "cannot start worker local_rank=2: set_mempolicy() preferring NUMA nodes 1000 failed "
          "(--numa-binding): Invalid argument");
  }
  // An executable file the kernel cannot run: exec's failure blames the program.
  std::string junk = dir.file("junk");
  { std::ofstream(junk) << "not a program\n"; }
  ::chmod(junk.c_str(), 0755);
  spec = fake_spec(0, {});
  spec.argv = {junk};
  CHECK(message(spec) == "cannot start worker local_rank=0: " + junk + ": Exec format error");
  CHECK(no_stray_children());
  // The launcher is usable again.
  launcher->start({fake_spec(0, {"--exit", "0"})});
  CHECK_FALSE(only(wait_for_exits(*launcher, 1, 10s)).failed());
}

TEST_CASE("ProcessLauncher: stop() SIGKILLs a worker ignoring SIGTERM once the grace is over",
          "[multiproc]") {
  TempDir dir;
  auto launcher = make_process_launcher();
  auto pids = launcher->start(
      {fake_spec(0, {"--ignore-term", "--pidfile", dir.file("ready"), "--sleep-ms", "30000"})});
  REQUIRE(wait_for_pid_file(dir.file("ready"), 10s) == pids[0]);
  auto t0 = Clock::now();
  auto exit = only(launcher->stop(SIGTERM, 200ms));
  auto took = elapsed_ms(t0);
  CHECK(took >= 195);
  CHECK(took < 1500);
  CHECK(exit.signaled);
  CHECK(exit.signal == SIGKILL);
  CHECK_FALSE(process_alive(pids[0]));
  CHECK(launcher->running() == 0);
  CHECK(no_stray_children());  // reaped
}

TEST_CASE("ProcessLauncher: stop() returns as soon as the workers exit, not after the grace",
          "[multiproc]") {
  auto launcher = make_process_launcher();
  launcher->start({fake_spec(0, {"--sleep-ms", "30000"}), fake_spec(1, {"--sleep-ms", "30000"})});
  auto t0 = Clock::now();
  auto exits = launcher->stop(SIGTERM, 20s);
  CHECK(elapsed_ms(t0) < 2000);
  REQUIRE(exits.size() == 2);
  for (int r = 0; r < 2; ++r) {
    CHECK(exits[r].local_rank == r);  // start() order
    CHECK(exits[r].signal == SIGTERM);
  }
  CHECK(launcher->stop(SIGTERM, 20s).empty());  // idempotent
}

TEST_CASE(
    "ProcessLauncher: stop() kills grandchildren in the worker's process group, also those "
    "ignoring SIGTERM",
    "[multiproc]") {
  TempDir dir;
  auto launcher = make_process_launcher();
  launcher->start(
      {fake_spec(0, {"--grandchild", dir.file("gc0"), "--sleep-ms", "30000"}),
       fake_spec(1, {"--ignore-term", "--grandchild", dir.file("gc1"), "--sleep-ms", "30000"})});
  pid_t gc0 = wait_for_pid_file(dir.file("gc0"), 10s);
  pid_t gc1 = wait_for_pid_file(dir.file("gc1"), 10s);
  REQUIRE(process_alive(gc0));
  REQUIRE(process_alive(gc1));
  auto t0 = Clock::now();
  auto exits = launcher->stop(SIGTERM, 300ms);
  CHECK(elapsed_ms(t0) < 2000);
  REQUIRE(exits.size() == 2);
  CHECK(exits[0].signal == SIGTERM);
  CHECK(exits[1].signal == SIGKILL);
  CHECK(eventually([&] { return !process_alive(gc0) && !process_alive(gc1); }, 3s));
}

TEST_CASE("ProcessLauncher: stop() kills what an exited worker left in its process group",
          "[multiproc]") {
  TempDir dir;
  auto launcher = make_process_launcher();
  launcher->start({fake_spec(0, {"--grandchild", dir.file("gc"), "--exit", "0"})});
  auto exit = only(wait_for_exits(*launcher, 1, 10s));
  CHECK_FALSE(exit.failed());
  pid_t gc = wait_for_pid_file(dir.file("gc"), 10s);
  REQUIRE(gc > 0);
  CHECK(process_alive(gc));  // a successful worker's leftovers live on until stop()
  CHECK(launcher->running() == 0);
  CHECK(launcher->stop(SIGTERM, 1s).empty());  // the exit was returned by wait() already
  CHECK(eventually([&] { return !process_alive(gc); }, 3s));
}

TEST_CASE("ProcessLauncher: signal_all() forwards a signal to every worker's process group",
          "[multiproc]") {
  TempDir dir;
  auto launcher = make_process_launcher();
  launcher->start({fake_spec(0, {"--grandchild", dir.file("gc0"), "--sleep-ms", "30000"}),
                   fake_spec(1, {"--grandchild", dir.file("gc1"), "--sleep-ms", "30000"})});
  pid_t gc0 = wait_for_pid_file(dir.file("gc0"), 10s);
  pid_t gc1 = wait_for_pid_file(dir.file("gc1"), 10s);
  REQUIRE(gc0 > 0);
  REQUIRE(gc1 > 0);
  launcher->signal_all(SIGUSR1);
  auto exits = wait_for_exits(*launcher, 2, 10s);
  REQUIRE(exits.size() == 2);
  for (auto& e : exits) {
    CHECK(e.signaled);
    CHECK(e.signal == SIGUSR1);
  }
  CHECK(eventually([&] { return !process_alive(gc0) && !process_alive(gc1); }, 3s));
  CHECK(launcher->stop(SIGTERM, 1s).empty());
}

TEST_CASE("ProcessLauncher: every exit is returned exactly once, by wait() or by stop()",
          "[multiproc]") {
  auto launcher = make_process_launcher();
  launcher->start({fake_spec(0, {"--exit", "5"}), fake_spec(1, {"--sleep-ms", "30000"})});
  // Rank 0 exits while nobody waits.
  REQUIRE(eventually([&] { return launcher->running() == 1; }, 10s));
  SECTION("stop() returns the exit wait() did not") {
    auto exits = launcher->stop(SIGTERM, 5s);
    REQUIRE(exits.size() == 2);
    CHECK(exits[0].local_rank == 0);
    CHECK(exits[0].exit_code == 5);
    CHECK(exits[1].local_rank == 1);
    CHECK(exits[1].signal == SIGTERM);
  }
  SECTION("an exit returned by wait() is not returned again by stop()") {
    auto first = only(launcher->wait(Clock::now() + 5s));
    CHECK(first.local_rank == 0);
    auto exits = launcher->stop(SIGTERM, 5s);
    CHECK(only(exits).local_rank == 1);
  }
  CHECK(launcher->wait(Clock::now() + 50ms).empty());
}

TEST_CASE("ProcessLauncher: start() needs the previous workers stopped, then starts a new set",
          "[multiproc]") {
  auto launcher = make_process_launcher();
  auto first = launcher->start({fake_spec(0, {"--exit", "0"})});
  CHECK_FALSE(only(wait_for_exits(*launcher, 1, 10s)).failed());
  CHECK_THROWS_AS(launcher->start({fake_spec(0, {"--exit", "0"})}), InternalError);
  launcher->stop(SIGTERM, 1s);
  auto second = launcher->start({fake_spec(0, {"--exit", "7"}), fake_spec(1, {"--exit", "8"})});
  REQUIRE(second.size() == 2);
  auto exits = wait_for_exits(*launcher, 2, 10s);
  REQUIRE(exits.size() == 2);
  for (auto& e : exits) CHECK(e.exit_code == 7 + e.local_rank);
  CHECK(launcher->stop(SIGTERM, 1s).empty());
  CHECK(launcher->start({}).empty());
}

TEST_CASE("ProcessLauncher: destroying the launcher kills and reaps the workers and the watcher",
          "[multiproc]") {
  TempDir dir;
  auto launcher = make_process_launcher();
  auto pids = launcher->start(
      {fake_spec(0, {"--ignore-term", "--grandchild", dir.file("gc"), "--sleep-ms", "30000"})});
  pid_t gc = wait_for_pid_file(dir.file("gc"), 10s);
  REQUIRE(gc > 0);
  auto t0 = Clock::now();
  launcher.reset();
  CHECK(elapsed_ms(t0) < 2000);
  CHECK_FALSE(process_alive(pids[0]));
  CHECK(eventually([&] { return !process_alive(gc); }, 3s));
  CHECK(children_of(::getpid()).empty());  // workers and watcher reaped
}

TEST_CASE("ProcessLauncher: redirected streams go to their files, byte for byte", "[multiproc]") {
  TempDir dir;
  auto launcher = make_process_launcher();
  WorkerSpec separate = fake_spec(0, {"--stdout", "one", "--stderr", "two", "--stdout-partial",
                                      "three", "--stdout-lines", "3"});
  separate.redirects = kBoth;
  separate.stdout_path = dir.file("0.out");
  separate.stderr_path = dir.file("0.err");
  WorkerSpec shared = fake_spec(1, {"--stdout", "one", "--stderr", "two", "--stdout", "three"});
  shared.redirects = kBoth;
  shared.stdout_path = shared.stderr_path = dir.file("1.log");
  { std::ofstream(dir.file("0.out")) << "old content, truncated by start()\n"; }
  launcher->start({separate, shared});
  auto exits = wait_for_exits(*launcher, 2, 10s);
  REQUIRE(exits.size() == 2);
  std::string x(100 - 8, 'x');
  CHECK(read_file(dir.file("0.out")) ==
        "one\nthreeout 0 0 " + x + "\nout 0 1 " + x + "\nout 0 2 " + x + "\n");
  CHECK(read_file(dir.file("0.err")) == "two\n");
  CHECK(read_file(dir.file("1.log")) == "one\ntwo\nthree\n");
}
