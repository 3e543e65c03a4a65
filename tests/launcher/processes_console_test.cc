// Processes, signals, the console and the logs, end to end with
// the ctorchrun binary: a console that does not drain, Ctrl-Z, escaped
// descendants, the temporary log directory and log files that cannot be
// written.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <thread>

#include "tests/launcher/launcher_support.h"

using namespace ctorchrun::testing;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// ctorchrun with `args`, started through /bin/sh so that `redirections`
// (shell syntax, e.g. "> fifo 2> err") and `prelude` (e.g. "ulimit -f 8")
// apply to it. The Process is the shell, which execs ctorchrun.
std::unique_ptr<Process> start_via_shell(const std::vector<std::string>& args,
                                         const std::string& redirections,
                                         const std::string& prelude = "",
                                         const std::map<std::string, std::string>& env = {}) {
  std::string cmd = prelude.empty() ? "" : prelude + "; ";
  cmd += "exec " + quote(CTORCHRUN_BIN);
  for (const auto& a : args) cmd += " " + quote(a);
  cmd += " " + redirections;
  return std::make_unique<Process>(std::vector<std::string>{"/bin/sh", "-c", cmd}, env,
                                   /*capture_stderr=*/true);
}

// The one file named `name` under `dir`, searched recursively; "" if none.
std::string find_file(const std::string& dir, const std::string& name) {
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (it->path().filename() == name) return it->path().string();
  }
  return "";
}

std::vector<std::string> temp_log_dirs(const std::string& dir) {
  std::vector<std::string> found;
  std::error_code ec;
  for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator();
       it.increment(ec)) {
    if (it->path().filename().string().rfind("ctorchrun_", 0) == 0) {
      found.push_back(it->path().string());
    }
  }
  return found;
}

char proc_state(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto close = text.rfind(')');
  return close == std::string::npos || close + 2 >= text.size() ? '?' : text[close + 2];
}

bool state_within(int pid, char state, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (proc_state(pid) == state) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(10ms);
  }
}

long count_newlines(const std::string& path) {
  std::string text = read_file(path);
  return static_cast<long>(std::count(text.begin(), text.end(), '\n'));
}

}  // namespace

TEST_CASE("processes: a stdout nobody reads never stalls the launcher: SIGTERM exits 143 in time",
          "[multiproc]") {
  TempDir d;
  const std::string fifo = d.file("console.fifo");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  // The reader that never reads: the FIFO has a reader, so the writer's
  // open does not block, and its 64 KiB fill up at once.
  int reader = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
  REQUIRE(reader >= 0);
  const long lines = 60000;  // 100 bytes each: ~6 MB per worker, far beyond the pipe
  auto p = start_via_shell({"--standalone", "--nproc_per_node=2", "--tee=3", "--shutdown_timeout=2",
                            "--log_dir=" + d.file("logs"), "--no_python", FAKE_WORKER,
                            "--stdout-lines", std::to_string(lines), "--sleep-ms", "60000"},
                           "> " + quote(fifo) + " 2> " + quote(d.file("err")));
  // Ready when both workers' lines are all in their log files.
  std::string out0, out1;
  auto complete = [&] {
    out0 = find_file(d.file("logs"), "stdout.log");
    if (out0.empty()) return false;
    out1 = fs::path(out0).parent_path().parent_path().string() + "/1/stdout.log";
    return count_newlines(out0) == lines && count_newlines(out1) == lines;
  };
  auto deadline = std::chrono::steady_clock::now() + 60s;
  while (!complete() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(50ms);
  }
  REQUIRE(complete());  // the log files keep every byte, whatever the console does
  p->signal(SIGTERM);
  // Within --shutdown_timeout plus a second.
  int rc = p->exit_code(3s);
  std::string err = read_file(d.file("err"));
  INFO(err);
  CHECK(rc == 143);
  CHECK(err.find("lines for the console (stdout) were not written") != std::string::npos);
  CHECK(err.find("did not die") == std::string::npos);
  ::close(reader);
}

TEST_CASE("processes: descendants that leave the workers' sessions do not outlive the job",
          "[multiproc]") {
  TempDir d;
  // A setsid grandchild and a double-forked daemon, then a successful exit.
  // setsid(1) forks when it must; the escaped shell writes its own pid.
  std::string body = "setsid sh -c 'echo $$ > " + d.path + "/escaped_'$RANK'; exec sleep 60' & " +
                     "(setsid sh -c 'echo $$ > " + d.path + "/daemon_'$RANK'; exec sleep 60' &); " +
                     "while [ ! -s " + d.path + "/daemon_$RANK ] || [ ! -s " + d.path +
                     "/escaped_$RANK ]; do sleep 0.01; done; exit 0";
  auto r =
      run_ctorchrun({"--standalone", "--nproc_per_node=2", "--no_python", "/bin/sh", "-c", body});
  INFO(r.output);
  CHECK(r.exit_code == 0);
  auto escaped = read_pids(d.path, "escaped_");
  auto daemons = read_pids(d.path, "daemon_");
  REQUIRE(escaped.size() == 2);
  REQUIRE(daemons.size() == 2);
  // Gone by the time the launcher has exited: no grace to wait for.
  for (int pid : escaped) CHECK(process_gone_within(pid, 0ms));
  for (int pid : daemons) CHECK(process_gone_within(pid, 0ms));
}

TEST_CASE("processes: SIGTERM also ends descendants that left the workers' sessions",
          "[multiproc]") {
  TempDir d;
  auto p =
      start_ctorchrun({"--standalone", "--nproc_per_node=1", "--no_python", "/bin/sh", "-c",
                       "setsid sh -c 'echo $$ > " + d.path + "/escaped; exec sleep 60' & wait"});
  REQUIRE(wait_for_file(d.file("escaped"), 20s));
  p->signal(SIGTERM);
  CHECK(p->exit_code(20s) == 143);
  CHECK(process_gone_within(std::stoi(read_file(d.file("escaped"))), 0ms));
}

TEST_CASE("processes: Ctrl-Z (SIGTSTP) stops the workers and the launcher, SIGCONT resumes both",
          "[multiproc]") {
  TempDir d;
  auto p = start_ctorchrun({"--standalone", "--nproc_per_node=2", "--no_python", "/bin/sh", "-c",
                            "echo $$ > " + d.path + "/pid_$RANK; exec sleep 60"});
  REQUIRE(wait_for_file(d.file("pid_0"), 20s));
  REQUIRE(wait_for_file(d.file("pid_1"), 20s));
  auto pids = read_pids(d.path, "pid_");
  REQUIRE(pids.size() == 2);
  p->signal(SIGTSTP);
  for (int pid : pids) CHECK(state_within(pid, 'T', 10s));
  CHECK(state_within(p->pid(), 'T', 10s));
  p->signal(SIGCONT);
  for (int pid : pids) CHECK(state_within(pid, 'S', 10s));
  CHECK(proc_state(p->pid()) != 'T');
  p->signal(SIGTERM);
  CHECK(p->exit_code(20s) == 143);
}

TEST_CASE("processes: the temporary log directory honours TMPDIR and goes when it stays empty",
          "[multiproc]") {
  TempDir d;
  std::map<std::string, std::string> env = {{"TMPDIR", d.path}};
  SECTION("a successful job without output to files") {
    auto r = run_ctorchrun({"--standalone", "--nproc_per_node=2", "--no_python", "/bin/true"}, env);
    INFO(r.output);
    CHECK(r.exit_code == 0);
    CHECK(temp_log_dirs(d.path).empty());
  }
  SECTION("a failed job whose workers wrote nothing") {
    auto r =
        run_ctorchrun({"--standalone", "--nproc_per_node=1", "--no_python", "/bin/false"}, env);
    INFO(r.output);
    CHECK(r.exit_code == 1);
    CHECK(temp_log_dirs(d.path).empty());
  }
  SECTION("--tee with output: the path is printed at start and in the last line, and kept") {
    auto r = run_ctorchrun(
        {"--standalone", "--nproc_per_node=1", "--tee=3", "--no_python", "/bin/echo", "hello"},
        env);
    INFO(r.output);
    CHECK(r.exit_code == 0);
    auto dirs = temp_log_dirs(d.path);
    REQUIRE(dirs.size() == 1);
    CHECK(r.output.find("worker logs in " + dirs[0]) != std::string::npos);
    std::string last = r.output.substr(r.output.rfind('\n', r.output.size() - 2) + 1);
    CHECK(last.find("logs kept in " + dirs[0]) != std::string::npos);
  }
  SECTION("--redirects with empty output: printed at start, removed at exit") {
    auto r = run_ctorchrun(
        {"--standalone", "--nproc_per_node=1", "--redirects=3", "--no_python", "/bin/true"}, env);
    INFO(r.output);
    CHECK(r.exit_code == 0);
    CHECK(r.output.find("worker logs in " + d.path + "/ctorchrun_") != std::string::npos);
    CHECK(temp_log_dirs(d.path).empty());
  }
  SECTION("a signal while no workers run (the exit barrier of a two-node job)") {
    std::string port = std::to_string(free_port());
    auto node = [&](int rank, const std::string& body) {
      return start_ctorchrun(
          {"--nnodes=2", "--node_rank=" + std::to_string(rank), "--nproc_per_node=1",
           "--master_port=" + port, "--events_file=" + d.file("events_" + std::to_string(rank)),
           "--no_python", "/bin/sh", "-c", body},
          env);
    };
    auto n0 = node(0, "exit 0");
    auto n1 = node(1, "echo $$ > " + d.path + "/pid_1; exec sleep 60");
    REQUIRE(wait_for_file(d.file("pid_1"), 20s));
    // Node 0's worker has exited; once node 0 says so it is in (or entering)
    // the exit barrier.
    auto deadline = std::chrono::steady_clock::now() + 20s;
    while (read_file(d.file("events_0")).find("worker_exited") == std::string::npos &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(10ms);
    }
    std::this_thread::sleep_for(200ms);  // let it reach the barrier; either phase must clean up
    n0->signal(SIGTERM);
    CHECK(n0->exit_code(20s) == 143);
    n1->signal(SIGTERM);
    n1->exit_code(20s);
    CHECK(temp_log_dirs(d.path).empty());
  }
}

TEST_CASE(
    "processes: a log file that cannot be written is warned about and named after the summary",
    "[multiproc]") {
  TempDir d;
  // RLIMIT_FSIZE of 1 MiB (ulimit -f counts 512-byte blocks) for the
  // launcher: its writes beyond that fail with EFBIG. The worker writes 3 MB
  // to a redirected stdout, then fails.
  auto p = start_via_shell(
      {"--standalone", "--nproc_per_node=1", "--redirects=3", "--log_dir=" + d.file("logs"),
       "--no_python", FAKE_WORKER, "--stdout-lines", "30000", "--exit", "3"},
      "2> " + quote(d.file("err")), "ulimit -f 2048");
  int rc = p->exit_code(60s);
  std::string err = read_file(d.file("err"));
  INFO(err);
  CHECK(rc == 1);
  std::string log = find_file(d.file("logs"), "stdout.log");
  REQUIRE(!log.empty());
  CHECK(fs::file_size(log) == 1 << 20);
  auto warning = err.find("cannot write worker log " + log);
  CHECK(warning != std::string::npos);
  auto summary = err.find("Root Cause");
  auto named = err.find("worker logs not written in full (see the warnings above): " + log);
  CHECK(summary != std::string::npos);
  CHECK(named != std::string::npos);
  CHECK(named > summary);
}

TEST_CASE("processes: a busy master port is named by the flag ctorchrun users type",
          "[multiproc]") {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  REQUIRE(::listen(fd, 1) == 0);
  socklen_t len = sizeof addr;
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  std::string port = std::to_string(ntohs(addr.sin_port));
  auto r = run_ctorchrun({"--master_port=" + port, "--no_python", "/bin/true"});
  ::close(fd);
  INFO(r.output);
  CHECK(r.exit_code == 4);
  CHECK(r.output.find("--master_port for ctorchrun") != std::string::npos);
  CHECK(r.output.find("another --port)") == std::string::npos);
}
