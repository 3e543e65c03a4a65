// Whole jobs under a real Slurm (tests/slurm/slurm_support.h): sbatch and
// srun start ctorchrun with no rendezvous flag.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>

#include "cli/slurm.h"
#include "tests/slurm/slurm_support.h"

using namespace ctorchrun::testing;
using namespace std::chrono_literals;

TEST_CASE("slurm fixture: four nodes are idle and srun reaches each", "[slurm]") {
  SlurmCluster cluster;
  WARN("Slurm fixture started in " << cluster.start_ms() << " ms");
  CommandResult r =
      cluster.run({"srun", "-N4", "--ntasks-per-node=1", "printenv", "SLURMD_NODENAME"}, 30s);
  INFO(r.output << cluster.logs());
  REQUIRE(r.exit_code == 0);
  for (const char* n : {"n1", "n2", "n3", "n4"}) CHECK(r.output.find(n) != std::string::npos);
}

namespace {

const std::string kCtorchrun = CTORCHRUN_BIN;
const std::string kPython = CTORCHRUN_TEST_PYTHON;
const std::string kSignalWorker = CTORCHRUN_SOURCE_DIR "/tests/slurm/py/signal_worker.py";

// A --no_python worker that records what it was given in DIR/env.<tag>.<RANK>:
// SLURM_NODEID GROUP_RANK RANK LOCAL_RANK WORLD_SIZE MASTER_ADDR MASTER_PORT
// TORCHELASTIC_RESTART_COUNT, then sleeps `sleep_s` seconds.
std::string env_probe(const std::string& dir, const std::string& tag, int sleep_s) {
  return "--no_python sh -c 'echo $SLURM_NODEID $GROUP_RANK $RANK $LOCAL_RANK $WORLD_SIZE "
         "$MASTER_ADDR $MASTER_PORT $TORCHELASTIC_RESTART_COUNT > " +
         dir + "/env." + tag + ".$RANK; sleep " + std::to_string(sleep_s) + "'";
}

std::vector<std::string> words(const std::string& line) {
  std::vector<std::string> out;
  std::istringstream in(line);
  std::string w;
  while (in >> w) out.push_back(w);
  return out;
}

std::string script(const std::string& body) {
  return "#!/bin/bash\nexport CTORCHRUN_PYTHON=" + kPython + "\n" + body + "\n";
}

}  // namespace

TEST_CASE("slurm: srun ctorchrun with no rendezvous flag runs DDP as one node with 4 workers does",
          "[slurm]") {
  SlurmCluster cluster;
  const std::string d = cluster.dir();
  const std::string example = CTORCHRUN_SOURCE_DIR "/examples/ddp_train.py";
  // The reference: one node, four workers, off Slurm.
  CommandResult ref = run_command({kCtorchrun, "--standalone", "--nproc_per_node=4", example,
                                   "--workdir", d + "/ref", "--epochs", "2"},
                                  {{"CTORCHRUN_PYTHON", kPython}}, 150s);
  INFO(ref.output);
  REQUIRE(ref.exit_code == 0);
  const std::string job =
      cluster.sbatch({"-N2", "-o", d + "/ddp.out"},
                     script("srun " + kCtorchrun + " --nproc_per_node=2 " + example +
                            " --workdir " + d + "/slurm --epochs 2 && srun " + kCtorchrun +
                            " --nproc_per_node=2 " + env_probe(d, "s", 0)));
  const std::string state = cluster.wait_for_job_end(job, 180s);
  INFO(read_text(d + "/ddp.out") << cluster.logs());
  REQUIRE(state == "COMPLETED");
  auto digest = [](const std::string& json) {
    auto j = nlohmann::json::parse(json, nullptr, false);
    return j.is_object() && j.contains("digest") ? j["digest"].dump() : std::string();
  };
  const std::string ours = read_text(d + "/slurm/result.json");
  INFO("reference: " << read_text(d + "/ref/result.json") << "\nslurm: " << ours);
  REQUIRE_FALSE(digest(ours).empty());
  CHECK(digest(ours) == digest(read_text(d + "/ref/result.json")));
  CHECK(nlohmann::json::parse(ours)["world"] == 4);
  // Ranks follow SLURM_NODEID: node k runs ranks 2k and 2k+1, master is n1.
  for (int rank = 0; rank < 4; ++rank) {
    auto w = words(read_text(d + "/env.s." + std::to_string(rank)));
    INFO("rank " << rank << ": " << read_text(d + "/env.s." + std::to_string(rank)));
    REQUIRE(w.size() == 8);
    CHECK(w[0] == std::to_string(rank / 2));  // SLURM_NODEID
    CHECK(w[1] == std::to_string(rank / 2));  // GROUP_RANK
    CHECK(w[3] == std::to_string(rank % 2));  // LOCAL_RANK
    CHECK(w[4] == "4");
    CHECK(w[5] == "n1");
  }
}

TEST_CASE("slurm: two steps of one job at once each take their own first host and port",
          "[slurm]") {
  SlurmCluster cluster;
  const std::string d = cluster.dir();
  // Steps on n3,n4 (a 2-node step of a 4-node allocation) and on n1,n2.
  const std::string job = cluster.sbatch(
      {"-N4", "-o", d + "/steps.out"},
      script(kCtorchrun + " --no_python true > " + d + "/outside.log 2>&1\n" + "srun -N2 -r2 " +
             kCtorchrun + " " + env_probe(d, "a", 3) + " &\nsrun -N2 -r0 " + kCtorchrun + " " +
             env_probe(d, "b", 3) + " &\nwait %1 && wait %2"));
  const std::string state = cluster.wait_for_job_end(job, 90s);
  INFO(read_text(d + "/steps.out") << cluster.logs());
  REQUIRE(state == "COMPLETED");
  std::string port_a, port_b;
  for (int rank = 0; rank < 2; ++rank) {
    auto a = words(read_text(d + "/env.a." + std::to_string(rank)));
    auto b = words(read_text(d + "/env.b." + std::to_string(rank)));
    REQUIRE(a.size() == 8);
    REQUIRE(b.size() == 8);
    CHECK(a[0] == std::to_string(rank));  // step-relative node id
    CHECK(a[1] == std::to_string(rank));
    CHECK(a[5] == "n3");  // the step's first host, not the allocation's
    CHECK(b[5] == "n1");
    port_a = a[6];
    port_b = b[6];
  }
  CHECK(port_a != port_b);
  // ctorchrun in the batch script itself, outside any step: one node, one warning.
  const std::string outside = read_text(d + "/outside.log");
  INFO(outside);
  size_t warnings = 0;
  for (size_t at = outside.find("outside any job step"); at != std::string::npos;
       at = outside.find("outside any job step", at + 1)) {
    ++warnings;
  }
  CHECK(warnings == 1);
}

TEST_CASE("slurm: several tasks per node are refused on every task and no worker starts",
          "[slurm]") {
  SlurmCluster cluster;
  const std::string d = cluster.dir();
  CommandResult r = cluster.run({"srun", "-N1", "--ntasks-per-node=2", kCtorchrun, "--no_python",
                                 "touch", d + "/worker_started"},
                                60s);
  INFO(r.output);
  CHECK(r.exit_code == 2);
  size_t refusals = 0;
  for (size_t at = r.output.find("--ntasks-per-node=1"); at != std::string::npos;
       at = r.output.find("--ntasks-per-node=1", at + 1)) {
    ++refusals;
  }
  CHECK(refusals == 2);
  CHECK_FALSE(std::filesystem::exists(d + "/worker_started"));
}

namespace {

// srun -N2 of an agent with 2 signal-recording workers each, scancel'ed: each
// worker must get SIGTERM once (Slurm's copy, or the agent's where Slurm's
// tracking does not reach the workers), checkpoint, and every agent exit 75.
void scancel_reaches_each_worker_once(const std::string& proctrack) {
  SlurmCluster cluster(proctrack);
  const std::string d = cluster.dir();
  // srun as the job itself (no batch step), each agent behind a shell that
  // records its exit code; the shell's trap keeps it alive until then.
  std::map<std::string, std::string> env = cluster.env();
  env["CTORCHRUN_PYTHON"] = kPython;
  const std::string agent = kCtorchrun + " --nproc_per_node=2 --events_file " + d +
                            "/events.$SLURM_NODEID " + kSignalWorker + " " + d + " 100000";
  auto srun = std::async(std::launch::async, [&] {
    return run_command(
        {"srun", "-N2", "bash", "-c",
         "trap : TERM INT USR1; " + agent + "; echo $? > " + d + "/rc.$SLURM_NODEID"},
        env, 90s);
  });
  for (int rank = 0; rank < 4; ++rank) {
    REQUIRE(wait_for_lines(d + "/progress." + std::to_string(rank), 1, 60s));
  }
  CommandResult q = cluster.run({"squeue", "-h", "-o", "%i"});
  const std::string job = words(q.output).at(0);
  CHECK(cluster.run({"scancel", job}).exit_code == 0);
  CommandResult r = srun.get();
  INFO(r.output << cluster.logs());
  for (int node = 0; node < 2; ++node) {
    INFO("node " << node);
    REQUIRE(wait_for_lines(d + "/rc." + std::to_string(node), 1, 30s));
    CHECK(read_text(d + "/rc." + std::to_string(node)) == "75\n");
    CHECK(read_text(d + "/events." + std::to_string(node)).find("\"exit_code\":75") !=
          std::string::npos);
    CHECK(read_text(d + "/events." + std::to_string(node)).find("\"restart\"") ==
          std::string::npos);
  }
  for (int rank = 0; rank < 4; ++rank) {
    auto lines = lines_of(d + "/sig.0." + std::to_string(rank));
    INFO("rank " << rank);
    REQUIRE(lines.size() == 1);  // once: Slurm's copy or the agent's, never both
    CHECK(lines[0].rfind("SIGTERM", 0) == 0);
  }
  CHECK(std::filesystem::exists(d + "/ckpt.json"));
}

}  // namespace

TEST_CASE("slurm: scancel reaches each worker once and the agents exit as stopped by the scheduler",
          "[slurm]") {
  scancel_reaches_each_worker_once("proctrack/linuxproc");  // Slurm signals every process
}

TEST_CASE(
    "slurm: under proctrack/pgid, which signals the task's process group alone, the agent "
    "forwards scancel's signal and each worker gets it once",
    "[slurm]") {
  scancel_reaches_each_worker_once("proctrack/pgid");
}

TEST_CASE("slurm: a time-limit signal checkpoints and the README's sbatch script requeues the job",
          "[slurm]") {
  SlurmCluster cluster;
  const std::string d = cluster.dir();
  const std::string bin = kCtorchrun.substr(0, kCtorchrun.rfind('/'));
  std::map<std::string, std::string> env = cluster.env();
  env["CTORCHRUN_PYTHON"] = kPython;
  env["PATH"] = bin + ":" + std::string(std::getenv("PATH"));
  env["NPROC_PER_NODE"] = "2";
  env["TRAIN_SCRIPT"] = kSignalWorker;
  CommandResult sub = run_command({"sbatch", "--parsable", "-D", d, "-o", d + "/train.out",
                                   CTORCHRUN_SOURCE_DIR "/examples/slurm/train.sbatch", d, "100"},
                                  env);
  INFO(sub.output);
  REQUIRE(sub.exit_code == 0);
  const std::string job = words(sub.output).at(0);
  for (int rank = 0; rank < 4; ++rank) {
    REQUIRE(wait_for_lines(d + "/progress." + std::to_string(rank), 1, 60s));
  }
  // The warning Slurm sends before the time limit (--signal=USR1@T), now.
  CHECK(cluster.run({"scancel", "--signal=USR1", job}).exit_code == 0);
  // Requeued, the job is eligible again one credential lifetime later (the
  // fixture's cred_expire=10; 120 s by default). Bringing that forward with
  // `scontrol update StartTime=now` races the slurmd, which still holds the
  // first run's revoked credential and kills the new run.
  const auto t0 = std::chrono::steady_clock::now();
  std::string state;
  bool requeued = false;
  while (!std::filesystem::exists(d + "/done.json") &&
         std::chrono::steady_clock::now() - t0 < 200s) {
    requeued = requeued || cluster.job_state(job) == "PENDING";
    std::this_thread::sleep_for(200ms);
  }
  CHECK(requeued);
  state = cluster.wait_for_job_end(job, 60s);
  INFO(read_text(d + "/train.out") << cluster.logs());
  REQUIRE(std::filesystem::exists(d + "/done.json"));
  CHECK(state == "COMPLETED");
  auto done = nlohmann::json::parse(read_text(d + "/done.json"));
  CHECK(done["resumed_from"].get<int>() > 0);  // from the checkpoint of the first run
  CHECK(done["restart_count"] == "0");         // a new step starts at 0
  CHECK(done["slurm_restart_count"] == "1");   // requeued once
  for (int rank = 0; rank < 4; ++rank) {
    auto lines = lines_of(d + "/sig.0." + std::to_string(rank));
    INFO("rank " << rank);
    REQUIRE(lines.size() == 1);
    CHECK(lines[0].rfind("SIGUSR1", 0) == 0);
    CHECK_FALSE(std::filesystem::exists(d + "/sig.1." + std::to_string(rank)));
  }
}

TEST_CASE("slurm: a step whose port is taken exits 4 naming --master_port", "[slurm]") {
  SlurmCluster cluster;
  const std::string d = cluster.dir();
  const std::string job = cluster.sbatch({"-N1", "--hold", "-o", d + "/taken.out"},
                                         script("srun " + kCtorchrun + " --no_python touch " + d +
                                                "/worker_started; echo $? > " + d + "/rc"));
  // The port the step will derive, taken before the job is released.
  const int port = ctorchrun::cli::slurm_port(job, "0");
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  // An earlier job of an earlier cluster (job ids start at 1 in each) may
  // have left the port in TIME_WAIT.
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(fd, 1) == 0);
  REQUIRE(cluster.run({"scontrol", "release", job}).exit_code == 0);
  const std::string state = cluster.wait_for_job_end(job, 60s);
  ::close(fd);
  const std::string out = read_text(d + "/taken.out");
  INFO(out);
  CHECK(state == "COMPLETED");
  CHECK(read_text(d + "/rc") == "4\n");
  CHECK(out.find("--master_port") != std::string::npos);
  CHECK(out.find(std::to_string(port)) != std::string::npos);
  CHECK_FALSE(std::filesystem::exists(d + "/worker_started"));
}

namespace {

// Pids of the processes whose environment says they run on Slurm node `node`
// for job `job` (a task, its agent, its workers).
std::vector<pid_t> processes_on(const std::string& node, const std::string& job) {
  std::vector<pid_t> out;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string environ = read_text(entry.path().string() + "/environ");
    std::vector<std::string> vars;
    size_t start = 0;
    for (size_t z = environ.find('\0'); z != std::string::npos; z = environ.find('\0', start)) {
      vars.push_back(environ.substr(start, z - start));
      start = z + 1;
    }
    auto has = [&](const std::string& kv) {
      return std::find(vars.begin(), vars.end(), kv) != vars.end();
    };
    if (has("SLURMD_NODENAME=" + node) && has("SLURM_JOB_ID=" + job)) {
      out.push_back(static_cast<pid_t>(std::stoi(name)));
    }
  }
  return out;
}

}  // namespace

TEST_CASE("slurm: under c10d a node lost with its slurmd is re-formed around and the job finishes",
          "[slurm]") {
  SlurmCluster cluster;
  const std::string d = cluster.dir();
  // Each worker records its world; in a world of 2 it waits (at most 60 s),
  // alone it finishes. Each agent's exit code goes to rc.<node id>.
  write_text(d + "/worker.sh",
             "#!/bin/sh\necho $WORLD_SIZE >> " + d +
                 "/world.$SLURM_NODEID\nif [ \"$WORLD_SIZE\" = 1 ]; then exit 0; fi\nsleep 60\n",
             0755);
  write_text(d + "/agent.sh",
             "#!/bin/bash\n" + kCtorchrun +
                 " --nnodes=1:2 --rdzv_backend=c10d --rdzv_conf=keep_alive_interval=1 "
                 "--no_python " +
                 d + "/worker.sh\necho $? > " + d + "/rc.$SLURM_NODEID\n",
             0755);
  const std::string job = cluster.sbatch({"-N2", "--no-kill", "-o", d + "/c10d.out"},
                                         script("srun " + d + "/agent.sh"));
  const bool started =
      wait_for_lines(d + "/world.0", 1, 60s) && wait_for_lines(d + "/world.1", 1, 60s);
  INFO(read_text(d + "/c10d.out"));
  REQUIRE(started);
  CHECK(lines_of(d + "/world.0") == std::vector<std::string>{"2"});
  // n2 goes down as a machine does: its slurmd and everything of the job on it.
  cluster.kill_slurmd(2);
  const std::vector<pid_t> on_n2 = processes_on("n2", job);
  CHECK_FALSE(on_n2.empty());
  for (pid_t p : on_n2) ::kill(p, SIGKILL);
  REQUIRE(wait_for_lines(d + "/rc.0", 1, 90s));
  CHECK(read_text(d + "/rc.0") == "0\n");
  CHECK(lines_of(d + "/world.0") == std::vector<std::string>{"2", "1"});
  CHECK_FALSE(std::filesystem::exists(d + "/rc.1"));
}

TEST_CASE("slurm: every node's agent serves its view of the job on --status_port", "[slurm]") {
  SlurmCluster cluster;
  const std::string d = cluster.dir();
  // One port for the job, as on a real cluster; each agent binds it on its
  // own node's address (the nodes here are 127.0.0.X of one host).
  const std::string port = std::to_string(daemon_port());
  write_text(d + "/agent.sh",
             "#!/bin/sh\naddr=$(getent hosts \"$SLURMD_NODENAME\" | cut -d' ' -f1)\nexec " +
                 kCtorchrun + " --status_port=" + port + " --status_host=\"$addr\" --no_python " +
                 d + "/worker.sh \"$addr\"\n",
             0755);
  // Each node's first worker reads its own agent's /status while it runs.
  write_text(d + "/worker.sh",
             "#!/bin/sh\n[ \"$LOCAL_RANK\" = 0 ] || exit 0\nexec /usr/bin/python3 -c '\n"
             "import sys, time, urllib.request\n"
             "for _ in range(100):\n"
             "    try:\n"
             "        b = urllib.request.urlopen(\"http://%s:" +
                 port +
                 "/status\" % sys.argv[1], timeout=5).read()\n"
                 "        open(sys.argv[2], \"wb\").write(b)\n"
                 "        break\n"
                 "    except Exception:\n"
                 "        time.sleep(0.1)\n' \"$1\" " +
                 d + "/status.$GROUP_RANK\n",
             0755);
  const std::string job =
      cluster.sbatch({"-N2", "-o", d + "/status.out"}, script("srun " + d + "/agent.sh"));
  const std::string state = cluster.wait_for_job_end(job, 90s);
  INFO(read_text(d + "/status.out") << cluster.logs());
  REQUIRE(state == "COMPLETED");
  for (int node = 0; node < 2; ++node) {
    const std::string text = read_text(d + "/status." + std::to_string(node));
    INFO("node " << node << ": " << text);
    auto j = nlohmann::json::parse(text, nullptr, false);
    REQUIRE(j.is_object());
    CHECK(j["node_rank"] == node);
    CHECK(j["world_size"] == 2);
    CHECK(j["state"] == "running");
    CHECK(j["nodes"].size() == 2);
    CHECK(j["run_id"].get<std::string>().rfind(job + ".", 0) == 0);  // the step: job.step
  }
}
