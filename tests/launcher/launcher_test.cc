// End-to-end: the ctorchrun binary with real worker processes (shell
// workers), one or several agents on 127.0.0.1.

#include <sched.h>
#include <signal.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <thread>

#include "agent/worker_env.h"
#include "common/shm_segments.h"
#include "tests/launcher/launcher_support.h"
#include "worker/numa_binding.h"

using namespace ctorchrun::testing;
using namespace std::chrono_literals;

namespace {

// Two nodes, one sleeping worker each; node 0 (which hosts the store) gets
// `sig`. Node 1 must notice within `bound`, stop its worker and exit 3; node 0's
// worker must go too once node 0 is killed.
void check_node1_ends_when_node0_gets(int sig, std::chrono::seconds bound) {
  TempDir d;
  std::string port = std::to_string(free_port());
  auto node = [&](int rank) {
    return start_ctorchrun(concat({"--nnodes=2", "--node_rank=" + std::to_string(rank),
                                   "--nproc_per_node=1", "--master_port=" + port},
                                  sh("echo $$ > " + d.path + "/pid_$RANK; exec sleep 60")));
  };
  auto n0 = node(0);
  auto n1 = node(1);
  REQUIRE(wait_for_file(d.file("pid_0"), 20s));
  REQUIRE(wait_for_file(d.file("pid_1"), 20s));
  auto t0 = std::chrono::steady_clock::now();
  n0->signal(sig);
  int rc1 = n1->exit_code(60s);
  auto took = std::chrono::steady_clock::now() - t0;
  n0->signal(SIGKILL);
  std::string out1 = n1->read_all(1s);
  INFO(out1);
  CHECK(rc1 == 3);
  CHECK(out1.find("lost the job's store") != std::string::npos);
  CHECK(took < bound);
  CHECK(process_gone_within(std::stoi(read_file(d.file("pid_1"))), 2s));
  CHECK(process_gone_within(std::stoi(read_file(d.file("pid_0"))), 5s));
}

}  // namespace

TEST_CASE("ctorchrun: workers get torchrun's environment and the job exits 0", "[multiproc]") {
  TempDir d;
  int port = free_port();
  auto r = run_ctorchrun(concat({"--nproc_per_node=3", "--master_port=" + std::to_string(port),
                                 "--max_restarts=2", "--rdzv_id=envjob"},
                                sh("env > " + d.path + "/env_$RANK")));
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  for (int rank = 0; rank < 3; ++rank) {
    std::string env = read_file(d.file("env_" + std::to_string(rank)));
    INFO(env);
    CHECK(env.find("\nRANK=" + std::to_string(rank) + "\n") != std::string::npos);
    CHECK(env.find("\nLOCAL_RANK=" + std::to_string(rank) + "\n") != std::string::npos);
    CHECK(env.find("\nWORLD_SIZE=3\n") != std::string::npos);
    CHECK(env.find("\nLOCAL_WORLD_SIZE=3\n") != std::string::npos);
    CHECK(env.find("\nGROUP_RANK=0\n") != std::string::npos);
    CHECK(env.find("\nGROUP_WORLD_SIZE=1\n") != std::string::npos);
    CHECK(env.find("\nROLE_NAME=default\n") != std::string::npos);
    CHECK(env.find("\nROLE_WORLD_SIZE=3\n") != std::string::npos);
    CHECK(env.find("\nMASTER_ADDR=127.0.0.1\n") != std::string::npos);
    CHECK(env.find("\nMASTER_PORT=" + std::to_string(port) + "\n") != std::string::npos);
    CHECK(env.find("\nTORCHELASTIC_RESTART_COUNT=0\n") != std::string::npos);
    CHECK(env.find("\nTORCHELASTIC_MAX_RESTARTS=2\n") != std::string::npos);
    CHECK(env.find("\nTORCHELASTIC_RUN_ID=envjob\n") != std::string::npos);
    CHECK(env.find("\nTORCHELASTIC_USE_AGENT_STORE=True\n") != std::string::npos);
    CHECK(env.find("\nNCCL_ASYNC_ERROR_HANDLING=1\n") != std::string::npos);
    CHECK(env.find("\nTORCH_NCCL_ASYNC_ERROR_HANDLING=1\n") != std::string::npos);
    CHECK(env.find("\nOMP_NUM_THREADS=1\n") != std::string::npos);
    CHECK(std::regex_search(
        env, std::regex("\nTORCHELASTIC_ERROR_FILE=/tmp/ctorchrun_[^/]+/envjob_[^/]{8}/attempt_0/" +
                        std::to_string(rank) + "/error.json\n")));
  }
  CHECK(r.output.find("Setting OMP_NUM_THREADS environment variable") != std::string::npos);
}

TEST_CASE(
    "ctorchrun: a failing worker restarts every worker, exhausted restarts exit 1 with a summary",
    "[multiproc]") {
  TempDir d;
  // Rank 1 fails only once rank 0 has started (at most 5 s): a restart takes
  // a few milliseconds, so rank 0 could otherwise be stopped before its first
  // line ran.
  auto r = run_ctorchrun(
      concat({"--standalone", "--nproc_per_node=2", "--max_restarts=2"},
             sh("echo $$ > " + d.path + "/start_${TORCHELASTIC_RESTART_COUNT}_$RANK; " +
                "if [ $RANK = 1 ]; then i=0; while [ ! -e " + d.path +
                "/start_${TORCHELASTIC_RESTART_COUNT}_0 ] && [ $i -lt 500 ]; do sleep 0.01; "
                "i=$((i + 1)); done; exit 3; fi; sleep 30")));
  INFO(r.output);
  CHECK(r.exit_code == 1);
  for (int attempt = 0; attempt <= 2; ++attempt) {
    for (int rank = 0; rank < 2; ++rank) {
      CHECK(file_exists(d.file("start_" + std::to_string(attempt) + "_" + std::to_string(rank))));
    }
  }
  CHECK_FALSE(file_exists(d.file("start_3_0")));
  CHECK(r.output.find("/bin/sh FAILED") != std::string::npos);
  CHECK(r.output.find("rank      : 1 (local_rank: 1)") != std::string::npos);
  CHECK(r.output.find("exitcode  : 3") != std::string::npos);
  CHECK(r.output.find("restart 2/2") != std::string::npos);
  // The stopped rank 0 is not a failure.
  CHECK(count_lines_with(r.output, "exitcode  :") == 1);
}

namespace {

// Whether `pid` is a zombie (exited, not reaped) or gone, within `timeout`.
bool exited_within(int pid, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
    std::string pid_field, comm, state;
    if (!(in >> pid_field >> comm >> state) || state == "Z") return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(10ms);
  }
}

bool file_has_within(const std::string& path, const std::string& needle,
                     std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (file_exists(path) && read_file(path).find(needle) != std::string::npos) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(10ms);
  }
}

}  // namespace

TEST_CASE(
    "ctorchrun: workers that fail on their own before the stop are all in the summary and the "
    "stopped one is not",
    "[multiproc]") {
  // The job's store is a ctorch-store this test pauses: once the agent has
  // noticed local rank 1's exit it waits on the store to publish the failure,
  // and local rank 2 exits meanwhile, before the agent stops the workers.
  // Local rank 0 sleeps until the stop ends it.
  Process store({CTORCHRUN_STORE_BIN, "--host", "127.0.0.1", "--port", "0"});
  const int port = wait_for_listening_port(store, 20s);
  REQUIRE(port > 0);
  TempDir d;
  const std::string wait_for = "i=0; while [ ! -e " + d.path +
                               "/$1 ] && [ $i -lt 3000 ]; do "
                               "sleep 0.01; i=$((i + 1)); done";
  auto agent = start_ctorchrun(concat(
      {"--nnodes=1", "--nproc_per_node=3", "--max_restarts=0", "--rdzv_backend=c10d",
       "--rdzv_endpoint=127.0.0.1:" + std::to_string(port), "--rdzv_id=together",
       "--events_file=" + d.file("events.json")},
      sh("wait_for() { " + wait_for + "; }; echo $$ > " + d.path + "/pid_$LOCAL_RANK.tmp; mv " +
         d.path + "/pid_$LOCAL_RANK.tmp " + d.path +
         "/pid_$LOCAL_RANK; case $LOCAL_RANK in 0) exec sleep 30;; 1) wait_for go1; exit 5;; "
         "*) wait_for go2; exit 3;; esac")));
  for (int lr = 0; lr < 3; ++lr) REQUIRE(wait_for_file(d.file("pid_" + std::to_string(lr)), 20s));
  const int pid1 = std::stoi(read_file(d.file("pid_1")));
  const int pid2 = std::stoi(read_file(d.file("pid_2")));
  store.signal(SIGSTOP);
  std::ofstream(d.file("go1")).close();
  CHECK(exited_within(pid1, 10s));
  // The agent noticed it (and now waits on the store), then rank 2 fails.
  CHECK(file_has_within(d.file("events.json"), "worker_exited", 10s));
  std::ofstream(d.file("go2")).close();
  CHECK(exited_within(pid2, 10s));
  store.signal(SIGCONT);
  const int rc = agent->exit_code(60s);
  const std::string out = agent->read_all(1s);
  INFO(out);
  CHECK(rc == 1);
  CHECK(count_lines_with(out, "exitcode  :") == 2);
  const auto root = out.find("Root Cause (first observed failure):");
  REQUIRE(root != std::string::npos);
  // Numbered in rank order; the first to fail is the root cause.
  CHECK(out.find("[1]:\n", out.find("Failures:")) < root);
  CHECK(out.find("rank      : 2 (local_rank: 2)\n  exitcode  : 3 (pid: " + std::to_string(pid2) +
                 ") \n") < root);
  CHECK(out.find("[0]:\n", root) != std::string::npos);
  CHECK(out.find(
            "rank      : 1 (local_rank: 1)\n  exitcode  : 5 (pid: " + std::to_string(pid1) + ") \n",
            root) != std::string::npos);
  CHECK(out.find("local_rank: 0)") == std::string::npos);
}

TEST_CASE("ctorchrun: a worker that fails once is restarted and the job succeeds", "[multiproc]") {
  TempDir d;
  auto r = run_ctorchrun(concat({"--standalone", "--nproc_per_node=2", "--max_restarts=1"},
                                sh("touch " + d.path +
                                   "/ran_${TORCHELASTIC_RESTART_COUNT}_$RANK; "
                                   "if [ $RANK = 0 ] && [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then "
                                   "kill -SEGV $$; fi; exit 0")));
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(file_exists(d.file("ran_1_0")));
  CHECK(file_exists(d.file("ran_1_1")));
  CHECK(r.output.find("SIGSEGV") != std::string::npos);
}

TEST_CASE(
    "ctorchrun: TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE sets the teed lines' prefix, as torchrun "
    "2.x's agent does",
    "[multiproc]") {
  auto r = run_ctorchrun(
      concat({"--standalone", "--nproc_per_node=2", "--tee=3", "--role=w"}, sh("echo out-$RANK")),
      {{"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "<${role_name}|${rank}|${local_rank}>"}});
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("<w|0|0>out-0") != std::string::npos);
  CHECK(r.output.find("<w|1|1>out-1") != std::string::npos);
  CHECK(r.output.find("[w0]:") == std::string::npos);
  // torch main's --log-line-prefix-template, with its ${hostname}.
  r = run_ctorchrun(concat({"--standalone", "--nproc_per_node=2", "--tee=3",
                            "--log-line-prefix-template=${hostname}:${rank}: "},
                           sh("echo out-$RANK")));
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find(ctorchrun::agent::short_hostname() + ":1: out-1") != std::string::npos);
}

TEST_CASE(
    "ctorchrun: --event_log_handler=console prints every event record on stderr, one JSON line "
    "each",
    "[multiproc]") {
  auto r = run_ctorchrun({"--standalone", "--nproc_per_node=2", "--event_log_handler=console",
                          "--no_python", "/bin/true"});
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  int events = 0;
  std::istringstream in(r.output);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("{\"", 0) != 0) continue;
    auto j = nlohmann::json::parse(line);
    CHECK(j.contains("time"));
    CHECK(j.contains("event"));
    ++events;
  }
  CHECK(count_lines_with(r.output, "\"event\":\"workers_started\"") == 1);
  CHECK(count_lines_with(r.output, "\"event\":\"worker_exited\"") == 2);
  CHECK(count_lines_with(r.output, "\"event\":\"finished\"") == 1);
  CHECK(events >= 4);
  auto quiet = run_ctorchrun({"--standalone", "--no_python", "/bin/true"});
  CHECK(count_lines_with(quiet.output, "\"event\":") == 0);
}

// Prints the calling process's memory policy: "mode M mask N" (get_mempolicy).
const char* const kPrintMemoryPolicy =
    "import ctypes, platform\n"
    "nr = {\"x86_64\": 239, \"aarch64\": 236}[platform.machine()]\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "mode, mask = ctypes.c_int(-1), (ctypes.c_ulong * 16)()\n"
    "assert libc.syscall(nr, ctypes.byref(mode), mask, 1024, None, 0) == 0\n"
    "print(\"mode\", mode.value, \"mask\", mask[0])\n";

TEST_CASE(
    "ctorchrun: --numa-binding=exclusive runs each local rank on its own CPUs of this "
    "machine's NUMA node and prefers its memory, and an unknown mode is exit 2",
    "[multiproc]") {
  TempDir d;
  auto r = run_ctorchrun({"--standalone", "--nproc_per_node=2", "--numa-binding=exclusive",
                          "--no_python", "/bin/sh", "-c",
                          "grep Cpus_allowed_list /proc/self/status > " + d.path +
                              "/cpus_$LOCAL_RANK && exec /usr/bin/python3 -c '" +
                              kPrintMemoryPolicy + "' > " + d.path + "/mem_$LOCAL_RANK"});
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  const std::string c0 = read_file(d.file("cpus_0")), c1 = read_file(d.file("cpus_1"));
  INFO(c0 << c1);
  // The memory policy prefers the rank's node (MPOL_PREFERRED=1, node 0 here).
  const auto node0 = ctorchrun::worker::read_cpu_topology("/sys").nodes.front().id;
  const std::string preferred = "mode 1 mask " + std::to_string(1UL << node0) + "\n";
  CHECK(read_file(d.file("mem_0")) == preferred);
  CHECK(read_file(d.file("mem_1")) == preferred);
  // Disjoint CPUs when the machine's first node has two or more.
  if (ctorchrun::worker::read_cpu_topology("/sys").nodes.front().cpus.size() >= 2) CHECK(c0 != c1);
  CHECK(c0.find("Cpus_allowed_list:") == 0);
  CHECK(count_lines_with(r.output, "numa binding: local rank") == 2);
  auto bad = run_ctorchrun({"--numa-binding=numa", "--no_python", "/bin/true"});
  CHECK(bad.exit_code == 2);
  CHECK(bad.output.find("expected node, socket, exclusive or core-complex") != std::string::npos);
}

TEST_CASE(
    "ctorchrun: --numa-binding keeps each worker inside the launcher's own CPU affinity "
    "(taskset), and takes CUDA_VISIBLE_DEVICES of GPU UUIDs and MIG instances",
    "[multiproc]") {
  cpu_set_t before;
  REQUIRE(::sched_getaffinity(0, sizeof before, &before) == 0);
  int last = -1;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &before)) last = c;
  }
  REQUIRE(last >= 0);
  // As `taskset -c <last>`: ctorchrun inherits this thread's affinity.
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(last, &one);
  REQUIRE(::sched_setaffinity(0, sizeof one, &one) == 0);
  TempDir d;
  auto r = run_ctorchrun(
      {"--standalone", "--nproc_per_node=2", "--numa-binding=node", "--no_python", "/bin/sh", "-c",
       "grep Cpus_allowed_list /proc/self/status > " + d.path + "/cpus_$LOCAL_RANK"});
  ::sched_setaffinity(0, sizeof before, &before);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  for (const char* rank : {"cpus_0", "cpus_1"}) {
    CHECK(read_file(d.file(rank)) == "Cpus_allowed_list:\t" + std::to_string(last) + "\n");
  }
  // GPU UUIDs and MIG instances are CUDA_VISIBLE_DEVICES entries like any
  // other, on a machine with GPUs or without.
  auto uuids = run_ctorchrun(
      {"--standalone", "--nproc_per_node=2", "--numa-binding=node", "--no_python", "/bin/true"},
      {{"CUDA_VISIBLE_DEVICES",
        "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6,MIG-1b2c3d4e-0000-5111-8222-333344445555"}});
  INFO(uuids.output);
  CHECK(uuids.exit_code == 0);
}

TEST_CASE("ctorchrun: --log_dir keeps torchrun's layout, --redirects and --tee route output",
          "[multiproc]") {
  TempDir d;
  auto r = run_ctorchrun(concat({"--standalone", "--nproc_per_node=2", "--log_dir=" + d.path,
                                 "--redirects=1:3", "--tee=0:1", "--role=trainer"},
                                sh("echo out-$RANK; echo err-$RANK >&2")));
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  std::string run_dir;
  for (const auto& e : std::filesystem::directory_iterator(d.path)) run_dir = e.path().string();
  REQUIRE(std::regex_search(run_dir, std::regex("/standalone_[a-z0-9]+_[a-z0-9_]{8}$")));
  CHECK(read_file(run_dir + "/attempt_0/0/stdout.log") == "out-0\n");
  CHECK(read_file(run_dir + "/attempt_0/1/stdout.log") == "out-1\n");
  CHECK(read_file(run_dir + "/attempt_0/1/stderr.log") == "err-1\n");
  CHECK(r.output.find("[trainer0]:out-0") != std::string::npos);  // teed, prefixed
  CHECK(r.output.find("err-0") != std::string::npos);             // not redirected: console
  CHECK(r.output.find("out-1") == std::string::npos);             // redirected: file only
  CHECK(r.output.find("err-1") == std::string::npos);
}

TEST_CASE("ctorchrun: the events file records the lifecycle as JSON lines", "[multiproc]") {
  TempDir d;
  auto r = run_ctorchrun(
      concat({"--standalone", "--nproc_per_node=2", "--max_restarts=1",
              "--events_file=" + d.file("events.jsonl")},
             sh("if [ $RANK = 1 ] && [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then exit 7; fi")));
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  std::string ev = read_file(d.file("events.jsonl"));
  INFO(ev);
  for (const char* e : {"\"rendezvous\"", "\"workers_started\"", "\"worker_exited\"",
                        "\"attempt_failed\"", "\"restart\"", "\"finished\""}) {
    CHECK(ev.find(std::string("\"event\":") + e) != std::string::npos);
  }
  CHECK(ev.find("\"exit_code\":7") != std::string::npos);
  CHECK(std::regex_search(
      ev, std::regex("\"time\":\"\\d{4}-\\d\\d-\\d\\dT\\d\\d:\\d\\d:\\d\\d\\.\\d{3}Z\"")));
  CHECK(count_lines_with(ev, "\"event\":\"workers_started\"") == 2);
}

TEST_CASE("ctorchrun: SIGTERM stops every worker and exits 143", "[multiproc]") {
  TempDir d;
  auto p = start_ctorchrun(concat({"--standalone", "--nproc_per_node=2"},
                                  sh("echo $$ > " + d.path + "/pid_$RANK; exec sleep 60")));
  REQUIRE(wait_for_file(d.file("pid_0"), 20s));
  REQUIRE(wait_for_file(d.file("pid_1"), 20s));
  p->signal(SIGTERM);
  CHECK(p->exit_code(20s) == 143);
  for (int pid : read_pids(d.path, "pid_")) CHECK(process_gone_within(pid, 2s));
}

TEST_CASE("ctorchrun: SIGKILL of the agent leaves no worker and no grandchild", "[multiproc]") {
  TempDir d;
  auto p = start_ctorchrun(concat({"--standalone", "--nproc_per_node=2"},
                                  sh("echo $$ > " + d.path + "/pid_$RANK; sleep 60 & echo $! > " +
                                     d.path + "/grandchild_$RANK; wait")));
  for (const char* f : {"pid_0", "pid_1", "grandchild_0", "grandchild_1"}) {
    REQUIRE(wait_for_file(d.file(f), 20s));
  }
  p->signal(SIGKILL);
  CHECK(p->exit_code(10s) == 128 + SIGKILL);
  auto pids = read_pids(d.path, "pid_");
  auto grandchildren = read_pids(d.path, "grandchild_");
  REQUIRE(pids.size() == 2);
  REQUIRE(grandchildren.size() == 2);
  for (int pid : pids) CHECK(process_gone_within(pid, 5s));
  for (int pid : grandchildren) CHECK(process_gone_within(pid, 5s));
}

TEST_CASE("ctorchrun: a worker ignoring SIGTERM is killed after --shutdown_timeout",
          "[multiproc]") {
  TempDir d;
  auto t0 = std::chrono::steady_clock::now();
  auto r = run_ctorchrun(concat({"--standalone", "--nproc_per_node=2", "--shutdown_timeout=0.5"},
                                sh("if [ $RANK = 1 ]; then sleep 0.3; exit 9; fi; trap '' TERM; "
                                   "echo $$ > " +
                                   d.path + "/stubborn; while :; do sleep 0.05; done")));
  auto took = std::chrono::steady_clock::now() - t0;
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK(took < 20s);
  REQUIRE(file_exists(d.file("stubborn")));
  CHECK(process_gone_within(std::stoi(read_file(d.file("stubborn"))), 2s));
}

TEST_CASE("ctorchrun: two nodes, the second started first: a failure on node 1 restarts node 0 too",
          "[multiproc]") {
  TempDir d;
  std::string port = std::to_string(free_port());
  auto worker =
      sh("echo x > " + d.path +
         "/start_${GROUP_RANK}_${TORCHELASTIC_RESTART_COUNT}_$RANK; "
         "if [ $RANK = 3 ] && [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then sleep 0.5; exit 5; fi; "
         "if [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then sleep 30; fi");
  auto node = [&](int rank) {
    return start_ctorchrun(
        concat({"--nnodes=2", "--node_rank=" + std::to_string(rank), "--nproc_per_node=2",
                "--master_addr=127.0.0.1", "--master_port=" + port, "--max_restarts=1",
                "--rdzv_conf=timeout=60"},
               worker));
  };
  auto n1 = node(1);
  REQUIRE(wait_for_line(*n1, "starting node_rank=1", 30s));
  auto n0 = node(0);
  int rc0 = n0->exit_code(60s);
  int rc1 = n1->exit_code(60s);
  std::string out0 = n0->read_all(1s), out1 = n1->read_all(1s);
  INFO("node0:\n" << out0 << "\nnode1:\n" << out1);
  CHECK(rc0 == 0);
  CHECK(rc1 == 0);
  for (int g = 0; g < 2; ++g) {
    for (int k = 0; k < 2; ++k) {
      for (int lr = 0; lr < 2; ++lr) {
        int rank = g * 2 + lr;
        CHECK(file_exists(d.file("start_" + std::to_string(g) + "_" + std::to_string(k) + "_" +
                                 std::to_string(rank))));
      }
    }
  }
}

TEST_CASE("ctorchrun: final failure on node 1: both nodes exit 1, node 0 names node 1's rank",
          "[multiproc]") {
  std::string port = std::to_string(free_port());
  auto worker = sh("if [ $RANK = 2 ]; then sleep 0.3; exit 4; fi; sleep 30");
  auto node = [&](int rank) {
    return start_ctorchrun(concat({"--nnodes=2", "--node_rank=" + std::to_string(rank),
                                   "--nproc_per_node=2", "--master_port=" + port},
                                  worker));
  };
  auto n0 = node(0);
  auto n1 = node(1);
  int rc0 = n0->exit_code(60s);
  int rc1 = n1->exit_code(60s);
  std::string out0 = n0->read_all(1s), out1 = n1->read_all(1s);
  INFO("node0:\n" << out0 << "\nnode1:\n" << out1);
  CHECK(rc0 == 1);
  CHECK(rc1 == 1);
  CHECK(out1.find("/bin/sh FAILED") != std::string::npos);
  CHECK(out1.find("exitcode  : 4") != std::string::npos);
  CHECK(out0.find("FAILED\n") == std::string::npos);
  CHECK(out0.find("rank 2 (local_rank 0 on node 1") != std::string::npos);
  CHECK(out0.find("exit code 4") != std::string::npos);
}

TEST_CASE("ctorchrun: usage errors exit 2, a busy port exits 4, an unreachable master exits 3",
          "[multiproc]") {
  auto r = run_ctorchrun({"--nproc_per_node=zero", "x"});
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("--nproc_per_node") != std::string::npos);
  r = run_ctorchrun({"--nnodes=3:2", "x"});
  CHECK(r.exit_code == 2);
  r = run_ctorchrun({"--help"});
  CHECK(r.exit_code == 0);

  // Port busy: hold it with a ctorchrun node 0 waiting for a second node.
  std::string port = std::to_string(free_port());
  auto holder = start_ctorchrun({"--nnodes=2", "--node_rank=0", "--master_port=" + port,
                                 "--rdzv_conf=timeout=30", "--no_python", "/bin/true"});
  REQUIRE(wait_for_port(std::stoi(port), 30s));
  auto t0 = std::chrono::steady_clock::now();
  r = run_ctorchrun({"--master_port=" + port, "--no_python", "/bin/true"});
  INFO(r.output);
  CHECK(r.exit_code == 4);
  CHECK(r.output.find(port) != std::string::npos);
  CHECK(std::chrono::steady_clock::now() - t0 < 10s);
  holder->signal(SIGTERM);
  CHECK(holder->exit_code(10s) == 143);

  // Nobody at the master: node 1 gives up after the rendezvous timeout.
  std::string closed = std::to_string(free_port());
  t0 = std::chrono::steady_clock::now();
  r = run_ctorchrun({"--nnodes=2", "--node_rank=1", "--master_port=" + closed,
                     "--rdzv_conf=timeout=1", "--no_python", "/bin/true"});
  INFO(r.output);
  CHECK(r.exit_code == 3);
  CHECK(r.output.find("127.0.0.1:" + closed) != std::string::npos);
  CHECK(std::chrono::steady_clock::now() - t0 < 15s);
}

TEST_CASE("ctorchrun: a missing executable is a clear error, not a hang", "[multiproc]") {
  auto r =
      run_ctorchrun({"--standalone", "--nproc_per_node=2", "--no_python", "/nonexistent/trainer"});
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("/nonexistent/trainer") != std::string::npos);
}

TEST_CASE("ctorchrun: nodes that disagree on --max_restarts fail the rendezvous with exit 2",
          "[multiproc]") {
  std::string port = std::to_string(free_port());
  auto node = [&](int rank, int restarts) {
    return start_ctorchrun({"--nnodes=2", "--node_rank=" + std::to_string(rank),
                            "--master_port=" + port, "--max_restarts=" + std::to_string(restarts),
                            "--rdzv_conf=timeout=30", "--no_python", "/bin/true"});
  };
  auto n0 = node(0, 1);
  auto n1 = node(1, 2);
  int rc0 = n0->exit_code(30s), rc1 = n1->exit_code(30s);
  std::string out0 = n0->read_all(1s), out1 = n1->read_all(1s);
  INFO("node0:\n" << out0 << "\nnode1:\n" << out1);
  CHECK(rc0 == 2);
  CHECK(rc1 == 2);
  CHECK(out0.find("disagree on --max_restarts") != std::string::npos);
}

TEST_CASE("ctorchrun: when node 0 (the store) dies, node 1 stops its workers and exits 3",
          "[multiproc]") {
  check_node1_ends_when_node0_gets(SIGKILL, 20s);
}

TEST_CASE("ctorchrun: --local_ranks_filter keeps other ranks' teed lines off the console only",
          "[multiproc]") {
  TempDir d;
  auto r = run_ctorchrun(concat({"--standalone", "--nproc_per_node=2", "--log_dir=" + d.path,
                                 "--tee=3", "--local_ranks_filter=1"},
                                sh("echo line-from-$RANK")));
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("[default1]:line-from-1") != std::string::npos);
  CHECK(r.output.find("line-from-0") == std::string::npos);
  std::string run_dir;
  for (const auto& e : std::filesystem::directory_iterator(d.path)) run_dir = e.path().string();
  CHECK(read_file(run_dir + "/attempt_0/0/stdout.log") == "line-from-0\n");
}

TEST_CASE("ctorchrun: a frozen node 0 (SIGSTOP) ends node 1 with exit 3 within seconds, not hours",
          "[multiproc]") {
  check_node1_ends_when_node0_gets(SIGSTOP, 30s);
}

TEST_CASE(
    "ctorchrun: two single-node jobs without a port run at once on one machine, as under torch "
    "main's torchrun",
    "[multiproc]") {
  TempDir d;
  // Each worker records the port it was given, then waits (bounded) until
  // every worker of both jobs has, so that the two jobs surely overlap.
  const std::string body = "echo $MASTER_PORT > " + d.path + "/port_$1_$RANK; i=0; while [ $(ls " +
                           d.path +
                           " | grep -c port_) -lt 4 ] && [ $i -lt 600 ]; do sleep 0.05; "
                           "i=$((i+1)); done; [ $i -lt 600 ]";
  auto job = [&](const std::string& name) {
    return start_ctorchrun(
        {"--nproc_per_node=2", "--no_python", "/bin/sh", "-c", body, "sh", name});
  };
  auto a = job("a");
  auto b = job("b");
  CHECK(a->exit_code(60s) == 0);
  CHECK(b->exit_code(60s) == 0);
  const std::string pa = read_file(d.file("port_a_0")), pb = read_file(d.file("port_b_0"));
  CHECK(pa == read_file(d.file("port_a_1")));
  CHECK(pb == read_file(d.file("port_b_1")));
  CHECK(pa != pb);
  CHECK(pa != "29500\n");
}

TEST_CASE("ctorchrun: --virtual-local-rank gives each worker LOCAL_RANK=0 and its own device",
          "[multiproc]") {
  TempDir d;
  auto r = run_ctorchrun(
      concat({"--nproc_per_node=2", "--virtual-local-rank"},
             sh("echo \"$LOCAL_RANK $CUDA_VISIBLE_DEVICES\" > " + d.path + "/w$RANK")),
      {{"CUDA_VISIBLE_DEVICES", "GPU-5e1f,MIG-77aa"}});
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(read_file(d.file("w0")) == "0 GPU-5e1f\n");
  CHECK(read_file(d.file("w1")) == "0 MIG-77aa\n");
  r = run_ctorchrun(concat({"--nproc_per_node=3", "--virtual_local_rank"}, sh("true")),
                    {{"CUDA_VISIBLE_DEVICES", "0,1"}});
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("exceeds available GPUs") != std::string::npos);
}

TEST_CASE(
    "ctorchrun: --duplicate-stdout-filters copies matching teed lines of every worker to the "
    "attempt's filtered_stdout.log, as torch main's torchrun",
    "[multiproc]") {
  TempDir d;
  auto r = run_ctorchrun(
      concat({"--nproc_per_node=2", "--tee=3", "--log_dir=" + d.path, "--rdzv_id=dup",
              "--local_ranks_filter=0", "--duplicate-stdout-filters=apple,orange,,pie",
              "--duplicate_stderr_filters=boom"},
             sh("echo apple $RANK; echo pear $RANK; echo orange,pie $RANK; "
                "echo boom $RANK >&2; echo apple-on-stderr >&2")));
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  std::string attempt;
  for (const auto& e : std::filesystem::directory_iterator(d.path)) {
    if (e.path().filename().string().rfind("dup_", 0) == 0)
      attempt = e.path().string() + "/attempt_0";
  }
  REQUIRE(!attempt.empty());
  auto lines = lines_of(attempt + "/filtered_stdout.log");
  std::sort(lines.begin(), lines.end());
  // Rank 1 is kept off the console, not out of the filtered file.
  CHECK(lines == std::vector<std::string>{"[default0]:apple 0", "[default0]:orange,pie 0",
                                          "[default1]:apple 1", "[default1]:orange,pie 1"});
  auto errors = lines_of(attempt + "/filtered_stderr.log");
  std::sort(errors.begin(), errors.end());
  CHECK(errors == std::vector<std::string>{"[default0]:boom 0", "[default1]:boom 1"});
}

TEST_CASE(
    "ctorchrun: a worker in uninterruptible sleep past TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT "
    "fails the job with no restart, as torch main's agent does",
    "[multiproc]") {
  TempDir d;
  // Local rank 0 blocks in vfork (state D) for 20 s; the others sleep.
  const std::string body = std::string("if [ $LOCAL_RANK = 0 ]; then exec ") + FAKE_WORKER +
                           " --vfork-sleep-ms 20000; fi; sleep 20";
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run_ctorchrun(concat({"--nproc_per_node=2", "--max_restarts=3", "--shutdown_timeout=1",
                                 "--events_file=" + d.file("events")},
                                sh(body)),
                         {{"TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT", "1"}});
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK(r.output.find("uninterruptible sleep (D state)") != std::string::npos);
  CHECK(r.output.find("rank      : 0 (local_rank: 0)") != std::string::npos);
  CHECK(read_file(d.file("events")).find("\"event\":\"restart\"") == std::string::npos);
  CHECK(std::chrono::steady_clock::now() - t0 < 18s);  // bounded: not the 20 s sleep
  // Unset, zero or negative: off, and the job waits for the worker.
  for (const std::string off : {"0", "-5"}) {
    r = run_ctorchrun(
        concat({"--nproc_per_node=1"}, {"--no_python", FAKE_WORKER, "--vfork-sleep-ms", "1500"}),
        {{"TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT", off}});
    INFO(r.output);
    CHECK(r.exit_code == 0);
  }
}

TEST_CASE(
    "ctorchrun: a shared-memory segment a failed worker created and never unlinked is removed, "
    "and no other process's",
    "[multiproc]") {
  TempDir shm;
  // The worker leaves a segment named as libctorch_dist names its own
  // (ctdist.<pid namespace>.<pid>.<...>), then fails; another process's
  // (this test's pid) must stay.
  const std::string ns = ctorchrun::shm_segments::pid_namespace();
  const std::string other = shm.file(ctorchrun::shm_segments::prefix_of(::getpid()) + "job.x");
  std::ofstream(other) << "x";
  auto r = run_ctorchrun(concat({"--nproc_per_node=1"}, sh("echo x > " + shm.path + "/ctdist." +
                                                           ns + ".$$.job.group.0001; exit 3")),
                         {{"CTORCHRUN_DIST_SHM_DIR", shm.path}});
  INFO(r.output);
  CHECK(r.exit_code == 1);
  int left = 0;
  for (const auto& e : std::filesystem::directory_iterator(shm.path)) {
    INFO(e.path());
    CHECK(e.path().string() == other);
    ++left;
  }
  CHECK(left == 1);
  CHECK(r.output.find("removed 1 shared-memory segment(s)") != std::string::npos);
}
