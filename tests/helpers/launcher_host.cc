// launcher_host: runs the real worker launcher in a process of its own, so a
// test can capture the console it writes to, or SIGKILL it.
//
//   launcher_host [options] -- PROGRAM ARGS...
//     --workers N        workers to start (default 1); each gets the current
//                        environment plus LOCAL_RANK=<rank>, and "{rank}" in
//                        PROGRAM and ARGS replaced by its rank
//     --mode block|wait  block: print "pid <pid>" per worker and "ready" on
//                        stdout, then sleep until killed. wait (default):
//                        wait for every exit, stop(), print "exit <rank>
//                        <code|SIGNAME>" per worker on stderr, exit 0
//     --tee M            --redirects M   torchrun's stream masks (0-3)
//     --log-dir DIR      files DIR/<rank>/stdout.log and stderr.log
//     --console-ranks L  comma-separated ranks whose teed lines reach the
//                        console (default: all)
//     --stderr-file PATH this process's stderr (its logs, teed stderr) goes there
//     --grace-ms N       stop() grace (default 1000)
// Teed lines carry torchrun's prefix "[default<rank>]:".

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "common/log.h"
#include "worker/console.h"
#include "worker/launcher.h"

extern char** environ;

namespace {

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "launcher_host: %s\n", why.c_str());
  std::exit(64);
}

std::string replace_rank(std::string s, int rank) {
  const std::string token = "{rank}";
  for (auto at = s.find(token); at != std::string::npos; at = s.find(token, at)) {
    s.replace(at, token.size(), std::to_string(rank));
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace ctorchrun::worker;
  int workers = 1;
  std::string mode = "wait";
  unsigned tee = kNone;
  unsigned redirects = kNone;
  std::string log_dir;
  std::string stderr_file;
  bool console_filter = false;
  std::set<int> console_ranks;
  long grace_ms = 1000;
  std::vector<std::string> program;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "--") {
      program.assign(argv + i + 1, argv + argc);
      break;
    }
    if (i + 1 >= argc) usage(flag + " needs a value");
    std::string value = argv[++i];
    if (flag == "--workers") {
      workers = std::atoi(value.c_str());
    } else if (flag == "--mode") {
      mode = value;
    } else if (flag == "--tee") {
      tee = static_cast<unsigned>(std::atoi(value.c_str()));
    } else if (flag == "--redirects") {
      redirects = static_cast<unsigned>(std::atoi(value.c_str()));
    } else if (flag == "--log-dir") {
      log_dir = value;
    } else if (flag == "--console-ranks") {
      console_filter = true;
      for (size_t at = 0; at < value.size();) {
        size_t comma = value.find(',', at);
        if (comma == std::string::npos) comma = value.size();
        console_ranks.insert(std::atoi(value.substr(at, comma - at).c_str()));
        at = comma + 1;
      }
    } else if (flag == "--stderr-file") {
      stderr_file = value;
    } else if (flag == "--grace-ms") {
      grace_ms = std::atol(value.c_str());
    } else {
      usage("unknown flag " + flag);
    }
  }
  if (program.empty()) usage("no program after --");
  if (!stderr_file.empty()) {
    int fd = ::open(stderr_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND, 0644);
    if (fd < 0 || ::dup2(fd, STDERR_FILENO) < 0) usage("cannot open " + stderr_file);
    ::close(fd);
  }
  ctorchrun::set_log_sink(Console::log_sink());
  ctorchrun::setup_logging(spdlog::level::info);

  std::map<std::string, std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  std::vector<WorkerSpec> specs;
  for (int rank = 0; rank < workers; ++rank) {
    WorkerSpec spec;
    spec.local_rank = rank;
    for (const auto& a : program) spec.argv.push_back(replace_rank(a, rank));
    spec.env = env;
    spec.env["LOCAL_RANK"] = std::to_string(rank);
    spec.tee = tee;
    spec.redirects = redirects;
    spec.prefix = "[default" + std::to_string(rank) + "]:";
    spec.console = !console_filter || console_ranks.count(rank) > 0;
    if (!log_dir.empty()) {
      std::string dir = log_dir + "/" + std::to_string(rank);
      ::mkdir(dir.c_str(), 0755);
      spec.stdout_path = dir + "/stdout.log";
      spec.stderr_path = dir + "/stderr.log";
    }
    specs.push_back(std::move(spec));
  }

  auto launcher = make_process_launcher();
  std::vector<pid_t> pids;
  try {
    pids = launcher->start(specs);
  } catch (const std::exception& e) {
    usage(e.what());
  }
  if (mode == "block") {
    for (pid_t pid : pids) std::printf("pid %d\n", static_cast<int>(pid));
    std::printf("ready\n");
    std::fflush(stdout);
    for (;;) ::pause();
  }
  std::vector<WorkerExit> exits;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (exits.size() < pids.size() && std::chrono::steady_clock::now() < deadline) {
    for (auto& e : launcher->wait(deadline)) exits.push_back(e);
  }
  for (auto& e : launcher->stop(SIGTERM, std::chrono::milliseconds(grace_ms))) exits.push_back(e);
  Console::flush(Console::kExitStall);
  for (auto& e : exits) {
    std::fprintf(stderr, "exit %d %s\n", e.local_rank,
                 e.signaled ? signal_name(e.signal).c_str() : std::to_string(e.exit_code).c_str());
  }
  return 0;
}
