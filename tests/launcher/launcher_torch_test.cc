// End-to-end with real torch workers, side by side with torch's own torchrun
// (`python -m torch.distributed.run`, the module of /usr/bin/torchrun; 1.13
// needs --redirects 9:1 --tee 9:1 on Python 3.11). The python is test_python():
// Debian 12's torch 1.13, or Debian 13's torch 2.6 for the torch2 tests.

#include <catch2/catch.hpp>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include "tests/launcher/launcher_support.h"

using namespace ctorchrun::testing;
using namespace std::chrono_literals;

namespace {

const std::string kExample = CTORCHRUN_SOURCE_DIR "/examples/ddp_train.py";

LaunchResult run_torchrun(const std::vector<std::string>& args,
                          const std::map<std::string, std::string>& env = {},
                          std::chrono::seconds timeout = 180s) {
  std::vector<std::string> argv = {
      test_python(), "-m",  "torch.distributed.run", "--redirects", "9:1",
      "--tee",       "9:1", "--monitor_interval",    "0.1"};
  argv.insert(argv.end(), args.begin(), args.end());
  Process p(argv, env, /*capture_stderr=*/true);
  LaunchResult r;
  r.output = p.read_all(timeout);
  r.exit_code = p.exit_code(10s);
  return r;
}

std::string json_field(const std::string& json, const std::string& key) {
  std::smatch m;
  std::regex re("\"" + key + "\": *(\"[^\"]*\"|[^,}]+)");
  if (!std::regex_search(json, m, re)) return "";
  std::string v = m[1];
  if (!v.empty() && v.front() == '"') v = v.substr(1, v.size() - 2);
  return v;
}

// `env -0` output as a map.
std::map<std::string, std::string> parse_env0(const std::string& text) {
  std::map<std::string, std::string> env;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\0', start);
    if (end == std::string::npos) end = text.size();
    std::string kv = text.substr(start, end - start);
    auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
    start = end + 1;
  }
  return env;
}

}  // namespace

TEST_CASE("ctorchrun: a torch DDP job ends bit-identical to the same job under torchrun",
          "[torch]") {
  TempDir d;
  auto ours = run_ctorchrun({"--nproc_per_node=2", "--master_port=" + std::to_string(free_port()),
                             kExample, "--workdir", d.file("ours"), "--epochs", "3"});
  INFO(ours.output);
  REQUIRE(ours.exit_code == 0);
  auto theirs = run_torchrun({"--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                              "--master_port", std::to_string(free_port()), kExample, "--workdir",
                              d.file("theirs"), "--epochs", "3"});
  INFO(theirs.output);
  REQUIRE(theirs.exit_code == 0);
  std::string a = read_file(d.file("ours/result.json")),
              b = read_file(d.file("theirs/result.json"));
  REQUIRE_FALSE(json_field(a, "digest").empty());
  CHECK(json_field(a, "digest") == json_field(b, "digest"));
  CHECK(json_field(a, "world") == "2");
}

TEST_CASE("ctorchrun: a torch worker failing in epoch 1 resumes from its checkpoint, bit-identical",
          "[torch]") {
  TempDir d;
  auto clean = run_ctorchrun({"--standalone", "--nproc_per_node=2", kExample, "--workdir",
                              d.file("clean"), "--epochs", "3"});
  REQUIRE(clean.exit_code == 0);
  auto resumed =
      run_ctorchrun({"--standalone", "--nproc_per_node=2", "--max_restarts=1", kExample,
                     "--workdir", d.file("resumed"), "--epochs", "3", "--fail-once-at-epoch", "1"});
  INFO(resumed.output);
  REQUIRE(resumed.exit_code == 0);
  std::string a = read_file(d.file("clean/result.json")),
              b = read_file(d.file("resumed/result.json"));
  CHECK(json_field(a, "digest") == json_field(b, "digest"));
  CHECK(json_field(b, "attempt") == "1");
  CHECK(json_field(b, "resumed_from") == "1");
  CHECK(resumed.output.find("restart 1/1") != std::string::npos);

  // Without a restart left, the same failure ends the job: exit 1, rank 1 named.
  auto failed = run_ctorchrun({"--standalone", "--nproc_per_node=2", kExample, "--workdir",
                               d.file("failed"), "--epochs", "3", "--fail-once-at-epoch", "1"});
  INFO(failed.output);
  CHECK(failed.exit_code == 1);
  CHECK(failed.output.find("rank      : 1 (local_rank: 1)") != std::string::npos);
  CHECK(failed.output.find("exitcode  : 3") != std::string::npos);
}

TEST_CASE("ctorchrun: workers get exactly torchrun's environment", "[torch]") {
  TempDir d;
  auto worker = std::vector<std::string>{"--no_python", "/bin/sh", "-c",
                                         "env -0 > " + d.path + "/$LAUNCHER.$RANK"};
  auto ours = run_ctorchrun(
      [&] {
        std::vector<std::string> a = {"--nproc_per_node=2",
                                      "--master_port=" + std::to_string(free_port())};
        a.insert(a.end(), worker.begin(), worker.end());
        return a;
      }(),
      {{"LAUNCHER", "ours"}});
  REQUIRE(ours.exit_code == 0);
  std::vector<std::string> targs = {"--nproc_per_node", "2",
                                    "--master_addr",    "127.0.0.1",
                                    "--master_port",    std::to_string(free_port())};
  targs.insert(targs.end(), worker.begin(), worker.end());
  auto theirs = run_torchrun(targs, {{"LAUNCHER", "theirs"}});
  INFO(theirs.output);
  REQUIRE(theirs.exit_code == 0);
  for (int rank = 0; rank < 2; ++rank) {
    auto a = parse_env0(read_file(d.path + "/ours." + std::to_string(rank)));
    auto b = parse_env0(read_file(d.path + "/theirs." + std::to_string(rank)));
    REQUIRE(a.size() > 10);
    // Set by the test for each launcher, not by the launchers (USE_LIBUV: by
    // scripts/torch2's sitecustomize in torchrun's python, for torch 2.6).
    for (const char* k : {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "LAUNCHER", "CTORCHRUN_PYTHON",
                          "_", "USE_LIBUV"}) {
      a.erase(k);
      b.erase(k);
    }
    // A --no_python worker's torch is unknown: ctorchrun sets both names of
    // this variable (README); torchrun 1.13 sets only NCCL_..., 2.x only
    // TORCH_NCCL_... (a Python script's case is the next test's).
    CHECK(a.at("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "1");
    CHECK(a.at("NCCL_ASYNC_ERROR_HANDLING") == "1");
    a.erase(test_torch_version() < std::pair{2, 0} ? "TORCH_NCCL_ASYNC_ERROR_HANDLING"
                                                   : "NCCL_ASYNC_ERROR_HANDLING");
    // Ours, documented in the README: which restarts were failures.
    CHECK(a.at("CTORCHRUN_FAILED_RESTARTS") == "0");
    CHECK(a.at("CTORCHRUN_ROUND") == "0");
    a.erase("CTORCHRUN_FAILED_RESTARTS");
    a.erase("CTORCHRUN_ROUND");
    for (const auto& [k, v] : b) {
      INFO("variable " << k);
      REQUIRE(a.count(k));
      CHECK(a.at(k) == v);
    }
    for (const auto& [k, v] : a) {
      INFO("variable only under ctorchrun: " << k << "=" << v);
      CHECK(b.count(k));
    }
  }
}

TEST_CASE(
    "ctorchrun: a Python script's workers get NCCL_ASYNC_ERROR_HANDLING only when their torch "
    "is older than 2.2, as torchrun of that torch sets it",
    "[torch]") {
  TempDir d;
  const std::string script = d.file("env.py");
  std::ofstream(script)
      << "import os\n"
         "names = ['NCCL_ASYNC_ERROR_HANDLING', 'TORCH_NCCL_ASYNC_ERROR_HANDLING']\n"
         "print(' '.join(n + '=' + os.environ.get(n, '-') for n in names))\n";
  auto r = run_ctorchrun({"--standalone", "--nproc_per_node=1", script},
                         {{"CTORCHRUN_PYTHON", test_python()}});
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  if (test_torch_version() < std::pair{2, 2}) {
    CHECK(r.output.find("NCCL_ASYNC_ERROR_HANDLING=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1") !=
          std::string::npos);
  } else {
    CHECK(r.output.find("NCCL_ASYNC_ERROR_HANDLING=- TORCH_NCCL_ASYNC_ERROR_HANDLING=1") !=
          std::string::npos);
  }
  // The user's value passes untouched.
  auto mine =
      run_ctorchrun({"--standalone", "--nproc_per_node=1", script},
                    {{"CTORCHRUN_PYTHON", test_python()}, {"NCCL_ASYNC_ERROR_HANDLING", "0"}});
  CHECK(mine.output.find("NCCL_ASYNC_ERROR_HANDLING=0 ") != std::string::npos);
}

TEST_CASE("ctorchrun: restarted torch workers read none of the previous attempt's keys",
          "[torch]") {
  TempDir d;
  // Like a torch 2.6+ worker, it writes keys without an attempt prefix.
  std::ofstream(d.file("keys.py")) << R"PY(
import datetime, os, sys, time
import torch.distributed as dist
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                      datetime.timedelta(seconds=20))
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt == 0:
    store.set(f"leftover/{rank}", "stale")
    store.add("arrived", 1)
    store.wait(["arrived"])
    while store.add("arrived", 0) < 2:
        time.sleep(0.01)
    if rank == 1:
        sys.exit(1)
    time.sleep(60)
try:
    store.wait([f"leftover/{rank}"], datetime.timedelta(milliseconds=300))
    print(f"rank {rank} attempt {attempt}: STALE key from the previous attempt", flush=True)
    sys.exit(2)
except RuntimeError:
    print(f"rank {rank} attempt {attempt}: clean", flush=True)
)PY";
  auto r =
      run_ctorchrun({"--standalone", "--nproc_per_node=2", "--max_restarts=1", d.file("keys.py")});
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(r.output.find("rank 0 attempt 1: clean") != std::string::npos);
  CHECK(r.output.find("rank 1 attempt 1: clean") != std::string::npos);
}

TEST_CASE("ctorchrun: a torch worker's @record error file puts its traceback in the summary",
          "[torch]") {
  TempDir d;
  auto r = run_ctorchrun({"--standalone", "--nproc_per_node=2", "--log_dir=" + d.path,
                          CTORCHRUN_SOURCE_DIR "/tests/launcher/py/fail_worker.py", "--rank", "1",
                          "--raise", "--sleep", "30"});
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK(r.output.find("rank      : 1 (local_rank: 1)") != std::string::npos);
  CHECK(r.output.find("ValueError: boom from rank 1") != std::string::npos);
  CHECK(r.output.find("Traceback (most recent call last)") != std::string::npos);
  CHECK(std::regex_search(
      r.output, std::regex("error_file: " + d.path + "/standalone_[^/]+/attempt_0/1/error.json")));
}

TEST_CASE(
    "ctorchrun: --run-path runs the script with runpy and ends the worker as torchrun's does: "
    "threads joined, atexit run, no interpreter finalization",
    "[torch]") {
  TempDir d;
  const std::string script = d.file("run_path_script.py");
  std::ofstream(script) << R"(import atexit, os, sys, threading, time
class Finalized:
    def __del__(self):
        print("FINALIZED", flush=True)
keep = Finalized()
atexit.register(lambda: print("ATEXIT", flush=True))
threading.Thread(target=lambda: (time.sleep(0.2), print("THREAD", flush=True))).start()
print("MAIN", __name__, sys.argv[1:], flush=True)
if sys.argv[1] == "exit3":
    sys.exit(3)
if sys.argv[1] == "raise":
    raise ValueError("boom from the script")
)";
  auto r = run_ctorchrun({"--nproc_per_node=1", "--master_port=" + std::to_string(free_port()),
                          "--run-path", script, "ok"});
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(r.output.find("MAIN __main__ ['ok']") != std::string::npos);
  CHECK(r.output.find("THREAD") != std::string::npos);
  CHECK(r.output.find("ATEXIT") != std::string::npos);
  CHECK(r.output.find("FINALIZED") == std::string::npos);  // os._exit: no finalization
  // Without --run-path the interpreter finalizes as usual.
  r = run_ctorchrun(
      {"--nproc_per_node=1", "--master_port=" + std::to_string(free_port()), script, "ok"});
  CHECK(r.output.find("FINALIZED") != std::string::npos);
  r = run_ctorchrun({"--nproc_per_node=1", "--master_port=" + std::to_string(free_port()),
                     "--run_path", script, "exit3"});
  CHECK(r.exit_code == 1);
  CHECK(r.output.find("exitcode  : 3") != std::string::npos);
  // An uncaught exception: torch's @record puts its traceback in the summary.
  r = run_ctorchrun({"--nproc_per_node=1", "--master_port=" + std::to_string(free_port()),
                     "--run-path", script, "raise"});
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK(r.output.find("ValueError: boom from the script") != std::string::npos);
  CHECK(r.output.find("error_file: <N/A>") == std::string::npos);
}
