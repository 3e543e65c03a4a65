#include "tests/slurm/slurm_support.h"

#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace ctorchrun::testing {

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

std::string hostname() {
  char buf[256] = {};
  ::gethostname(buf, sizeof buf - 1);
  return buf;
}

// A port that was free a moment ago, for a daemon: bind port 0 would give an
// ephemeral one, so pick at random in [10000, 20000), below the ports that
// ctorchrun derives for steps ([20000, 32000), cli/slurm.h), and check it.
int free_port() {
  static std::mt19937 rng(std::random_device{}());
  for (int tries = 0; tries < 1000; ++tries) {
    const int port = 10000 + static_cast<int>(rng() % 10000);
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    ::close(fd);
    if (ok) return port;
  }
  throw std::runtime_error("no free port found");
}

std::vector<std::string> env_with(const std::map<std::string, std::string>& extra) {
  std::map<std::string, std::string> all;
  for (char** e = environ; *e; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) all[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  for (const auto& [k, v] : extra) all[k] = v;
  std::vector<std::string> out;
  for (const auto& [k, v] : all) out.push_back(k + "=" + v);
  return out;
}

// fork + exec with output to `log` (or a pipe when out_fd is given), in a
// process group of its own, optionally as `user`.
pid_t spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
            const std::string& log, int out_fd = -1, const std::string& user = "") {
  std::vector<std::string> envs = env_with(env);
  std::vector<char*> cargv, cenv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  for (const auto& e : envs) cenv.push_back(const_cast<char*>(e.c_str()));
  cenv.push_back(nullptr);
  uid_t uid = 0;
  gid_t gid = 0;
  if (!user.empty()) {
    passwd* pw = ::getpwnam(user.c_str());
    if (pw == nullptr) throw std::runtime_error("no user " + user);
    uid = pw->pw_uid;
    gid = pw->pw_gid;
  }
  pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    ::setpgid(0, 0);
    int fd = out_fd >= 0 ? out_fd : ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    int null = ::open("/dev/null", O_RDONLY);
    ::dup2(null, 0);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    if (!user.empty()) {
      if (::setgroups(0, nullptr) != 0 || ::setgid(gid) != 0 || ::setuid(uid) != 0) _exit(126);
    }
    ::execvpe(cargv[0], cargv.data(), cenv.data());
    _exit(127);
  }
  return pid;
}

// Stops a process group: SIGTERM, up to `grace`, then SIGKILL; reaps it.
void stop_pid(pid_t pid, std::chrono::milliseconds grace) {
  if (pid <= 0) return;
  ::kill(-pid, SIGTERM);
  ::kill(pid, SIGTERM);
  const auto deadline = Clock::now() + grace;
  int status = 0;
  while (Clock::now() < deadline) {
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      ::kill(-pid, SIGKILL);
      return;
    }
    std::this_thread::sleep_for(20ms);
  }
  ::kill(-pid, SIGKILL);
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
}

bool alive(pid_t pid) {
  int status = 0;
  return pid > 0 && ::waitpid(pid, &status, WNOHANG) == 0;
}

// "127.0.0.X nX" for X in 1..4 in /etc/hosts, each once.
void ensure_hosts_entries() {
  std::string hosts = read_text("/etc/hosts");
  std::istringstream in(hosts);
  std::string line, add;
  std::vector<bool> have(5, false);
  while (std::getline(in, line)) {
    for (int i = 1; i <= 4; ++i) {
      std::istringstream words(line);
      std::string addr, name;
      words >> addr;
      while (words >> name) {
        if (name == "n" + std::to_string(i)) {
          if (addr != "127.0.0." + std::to_string(i)) {
            throw std::runtime_error("/etc/hosts maps n" + std::to_string(i) + " to " + addr +
                                     ", not 127.0.0." + std::to_string(i));
          }
          have[static_cast<size_t>(i)] = true;
        }
      }
    }
  }
  for (int i = 1; i <= 4; ++i) {
    if (!have[static_cast<size_t>(i)]) {
      add += "127.0.0." + std::to_string(i) + " n" + std::to_string(i) + "\n";
    }
  }
  if (add.empty()) return;
  std::ofstream out("/etc/hosts", std::ios::app);
  if (!hosts.empty() && hosts.back() != '\n') out << "\n";
  out << add;
  if (!out) throw std::runtime_error("cannot add the Slurm nodes' names to /etc/hosts");
}

}  // namespace

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_text(const std::string& path, const std::string& text, int mode) {
  {
    std::ofstream out(path, std::ios::trunc);
    out << text;
  }
  ::chmod(path.c_str(), static_cast<mode_t>(mode));
}

std::vector<std::string> lines_of(const std::string& path) {
  std::vector<std::string> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) out.push_back(line);
  return out;
}

bool wait_for_lines(const std::string& path, size_t n, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    if (lines_of(path).size() >= n) return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(50ms);
  }
}

CommandResult run_command(const std::vector<std::string>& argv,
                          const std::map<std::string, std::string>& env,
                          std::chrono::milliseconds timeout) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
  pid_t pid = spawn(argv, env, "", fds[1]);
  ::close(fds[1]);
  CommandResult r;
  const auto deadline = Clock::now() + timeout;
  char buf[4096];
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) break;
    pollfd p{fds[0], POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(std::min<long long>(left, 200))) <= 0) continue;
    ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n <= 0) break;
    r.output.append(buf, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  int status = 0;
  for (;;) {
    if (::waitpid(pid, &status, WNOHANG) == pid) break;
    if (Clock::now() >= deadline) {
      ::kill(-pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      r.exit_code = -1;
      return r;
    }
    std::this_thread::sleep_for(10ms);
  }
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

SlurmCluster::SlurmCluster(std::string proctrack)
    : dir_("slurm", TempDir::Access::kAllUsers), proctrack_(std::move(proctrack)) {
  const auto t0 = Clock::now();
  ensure_hosts_entries();
  const std::string d = dir_.path;
  passwd* munge = ::getpwnam("munge");
  if (munge == nullptr) throw std::runtime_error("Slurm cannot start: no 'munge' user (apt munge)");

  // munged: a key and a socket directory of its own, owned by the munge user.
  const std::string mdir = d + "/munge";
  ::mkdir(mdir.c_str(), 0755);  // munged wants its socket directory traversable by all
  std::string key;
  {
    std::random_device rd;
    for (int i = 0; i < 1024; ++i) key.push_back(static_cast<char>(rd() & 0xff));
  }
  write_text(mdir + "/munge.key", key, 0400);
  if (::chown(mdir.c_str(), munge->pw_uid, munge->pw_gid) != 0 ||
      ::chown((mdir + "/munge.key").c_str(), munge->pw_uid, munge->pw_gid) != 0) {
    throw std::runtime_error("Slurm cannot start: chown to munge failed");
  }
  const std::string socket = mdir + "/munge.socket";
  munged_ = spawn({"munged", "--foreground", "--force", "--socket=" + socket,
                   "--key-file=" + mdir + "/munge.key", "--pid-file=" + mdir + "/munged.pid",
                   "--log-file=" + mdir + "/munged.log", "--seed-file=" + mdir + "/munged.seed"},
                  {}, d + "/munged.out", -1, "munge");
  for (auto deadline = Clock::now() + 10s; !std::filesystem::exists(socket);) {
    if (!alive(munged_) || Clock::now() >= deadline) {
      std::string why = read_text(d + "/munged.out") + read_text(mdir + "/munged.log");
      stop();
      throw std::runtime_error("Slurm cannot start: munged did not open " + socket + ": " + why);
    }
    std::this_thread::sleep_for(10ms);
  }

  // slurm.conf: four nodes on this host, each slurmd on a free port.
  const std::string host = hostname();
  std::ostringstream conf;
  conf << "ClusterName=ctest\n"
       << "SlurmctldHost=" << host << "(127.0.0.1)\n"
       << "SlurmctldPort=" << free_port() << "\n"
       << "SlurmUser=root\nSlurmdUser=root\n"
       << "AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket="
       << socket
       // A requeued job waits one credential lifetime before it may start
       // again (120 s by default, 5 s the least Slurm takes): starting it
       // sooner, the slurmd still holds the old run's revoked credential and
       // kills the new one ("Job credential revoked").
       << ",cred_expire=10\n"
       << "StateSaveLocation=" << d << "/state\n"
       << "SlurmdSpoolDir=" << d << "/spool/%n\n"
       << "SlurmctldPidFile=" << d << "/slurmctld.pid\n"
       << "SlurmdPidFile=" << d << "/slurmd.%n.pid\n"
       << "SlurmctldLogFile=" << d << "/slurmctld.log\n"
       << "SlurmdLogFile=" << d << "/slurmd.%n.log\n"
       << "SlurmctldDebug=info\nSlurmdDebug=info\n"
       << "ProctrackType=" << proctrack_ << "\nTaskPlugin=task/none\n"
       << "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n"
       << "SchedulerType=sched/backfill\nMpiDefault=none\n"
       << "JobCompType=jobcomp/none\nAccountingStorageType=accounting_storage/none\n"
       << "JobAcctGatherType=jobacct_gather/none\n"
       << "SlurmdParameters=config_overrides\nReturnToService=2\n"
       << "KillWait=10\nMinJobAge=300\nSlurmdTimeout=30\nInactiveLimit=0\n"
       << "SchedulerParameters=sched_interval=1\n";
  for (int i = 1; i <= 4; ++i) {
    conf << "NodeName=n" << i << " NodeHostname=" << host << " NodeAddr=127.0.0." << i
         << " Port=" << free_port() << " CPUs=8 State=UNKNOWN\n";
  }
  conf << "PartitionName=debug Nodes=n[1-4] Default=YES MaxTime=INFINITE State=UP\n";
  write_text(d + "/slurm.conf", conf.str());
  std::filesystem::create_directories(d + "/state");
  for (int i = 1; i <= 4; ++i)
    std::filesystem::create_directories(d + "/spool/n" + std::to_string(i));

  slurmctld_ = spawn({"slurmctld", "-D", "-i", "-f", d + "/slurm.conf"}, {}, d + "/slurmctld.out");
  for (int i = 1; i <= 4; ++i) {
    slurmd_.push_back(
        spawn({"slurmd", "-D", "-N", "n" + std::to_string(i), "-f", d + "/slurm.conf"}, {},
              d + "/slurmd.n" + std::to_string(i) + ".out"));
  }
  // Idle: four lines "idle" from sinfo.
  std::string last;
  for (auto deadline = Clock::now() + 30s;;) {
    CommandResult r = run({"sinfo", "-h", "-N", "-o", "%N %T"}, 5s);
    last = r.output;
    int idle = 0;
    std::istringstream in(r.output);
    std::string node, state;
    while (in >> node >> state) idle += state == "idle";
    if (idle == 4) break;
    bool dead = !alive(slurmctld_);
    for (pid_t p : slurmd_) dead = dead || !alive(p);
    if (dead || Clock::now() >= deadline) {
      std::string why = logs();
      stop();
      throw std::runtime_error("Slurm cannot start: " +
                               std::string(dead ? "a daemon exited" : "nodes not idle in 30 s") +
                               "; sinfo: " + last + "\n" + why);
    }
    std::this_thread::sleep_for(50ms);
  }
  start_ms_ = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
}

SlurmCluster::~SlurmCluster() { stop(); }

void SlurmCluster::stop() {
  if (slurmctld_ > 0 && alive(slurmctld_)) {
    // Every job first, so that no slurmstepd (a daemon of slurmd's) outlives the test.
    run({"scancel", "--full", "-u", "root"}, 10s);
    // A job with a node whose slurmd was killed stays COMPLETING: no wait then.
    for (auto deadline = Clock::now() + (node_killed_ ? 1s : 20s); Clock::now() < deadline;) {
      CommandResult r = run({"squeue", "-h", "-o", "%i"}, 5s);
      if (r.exit_code == 0 && r.output.find_first_not_of(" \n") == std::string::npos) break;
      std::this_thread::sleep_for(100ms);
    }
  }
  for (pid_t p : slurmd_) stop_pid(p, 5s);
  slurmd_.clear();
  stop_pid(slurmctld_, 5s);
  slurmctld_ = -1;
  stop_pid(munged_, 5s);
  munged_ = -1;
}

std::map<std::string, std::string> SlurmCluster::env() const {
  return {{"SLURM_CONF", dir_.path + "/slurm.conf"}};
}

CommandResult SlurmCluster::run(const std::vector<std::string>& argv,
                                std::chrono::milliseconds timeout) const {
  return run_command(argv, env(), timeout);
}

std::string SlurmCluster::sbatch(const std::vector<std::string>& options,
                                 const std::string& script) const {
  static int n = 0;
  const std::string path = dir_.path + "/job" + std::to_string(n++) + ".sh";
  write_text(path, script, 0755);
  std::vector<std::string> argv = {"sbatch", "--parsable", "-D", dir_.path};
  argv.insert(argv.end(), options.begin(), options.end());
  argv.push_back(path);
  CommandResult r = run(argv);
  if (r.exit_code != 0) throw std::runtime_error("sbatch failed: " + r.output);
  std::string id = r.output.substr(0, r.output.find_first_of(";\n"));
  return id;
}

std::string SlurmCluster::job_state(const std::string& job) const {
  CommandResult r = run({"scontrol", "-o", "show", "job", job}, 5s);
  const auto at = r.output.find("JobState=");
  if (at == std::string::npos) return "";
  const auto end = r.output.find(' ', at);
  return r.output.substr(at + 9, end - at - 9);
}

std::string SlurmCluster::wait_for_job_end(const std::string& job,
                                           std::chrono::milliseconds timeout) const {
  std::string state;
  for (auto deadline = Clock::now() + timeout; Clock::now() < deadline;) {
    state = job_state(job);
    if (state == "COMPLETED" || state == "FAILED" || state == "CANCELLED" || state == "TIMEOUT" ||
        state == "NODE_FAIL" || state == "PREEMPTED" || state == "OUT_OF_MEMORY") {
      return state;
    }
    std::this_thread::sleep_for(100ms);
  }
  return state;
}

bool SlurmCluster::wait_for_job_running(const std::string& job,
                                        std::chrono::milliseconds timeout) const {
  for (auto deadline = Clock::now() + timeout; Clock::now() < deadline;) {
    if (job_state(job) == "RUNNING") return true;
    std::this_thread::sleep_for(50ms);
  }
  return false;
}

void SlurmCluster::kill_slurmd(int n) {
  pid_t& p = slurmd_.at(static_cast<size_t>(n - 1));
  node_killed_ = true;
  ::kill(-p, SIGKILL);
  int status = 0;
  ::waitpid(p, &status, 0);
  p = -1;
}

std::string SlurmCluster::logs() const {
  std::string out;
  for (const char* f :
       {"slurmctld.log", "slurmctld.out", "slurmd.n1.log", "slurmd.n1.out", "munged.out"}) {
    std::string text = read_text(dir_.path + "/" + f);
    if (text.size() > 3000) text = "..." + text.substr(text.size() - 3000);
    out += "--- " + std::string(f) + "\n" + text;
  }
  return out;
}

int daemon_port() { return free_port(); }

}  // namespace ctorchrun::testing
