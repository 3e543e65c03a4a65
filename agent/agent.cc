#include "agent/agent.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <future>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "agent/failure_summary.h"
#include "agent/file_timer.h"
#include "agent/hang_detector.h"
#include "agent/hang_diagnosis.h"
#include "agent/health_server.h"
#include "agent/job_monitor.h"
#include "agent/job_status.h"
#include "agent/protocol.h"
#include "agent/restart_budget.h"
#include "agent/scheduler_stop.h"
#include "agent/worker_env.h"
#include "common/error.h"
#include "common/exit_codes.h"
#include "common/json_text.h"
#include "common/log.h"
#include "common/procfs.h"
#include "common/shm_segments.h"
#include "rendezvous/c10d_handler.h"
#include "rendezvous/static_handler.h"
#include "worker/console.h"
#include "worker/torch_probe.h"

namespace ctorchrun::agent {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;
using worker::signal_name;

namespace {

constexpr int kFailed = kExitWorkersFailed;
constexpr int kUsage = kExitUsage;
constexpr int kRendezvous = kExitRendezvous;
constexpr int kNetwork = kExitStoreNetwork;
// Up to this many nodes the info log lists every node's ranks (torchelastic
// prints its rank table); above, the table is at debug level, so that a
// large round does not make every agent read every member's record.
constexpr int kRankTableNodes = 64;

std::string random_suffix() {
  static const char kChars[] = "abcdefghijklmnopqrstuvwxyz0123456789_";
  std::random_device rd;
  std::string s;
  for (int i = 0; i < 8; ++i) s.push_back(kChars[rd() % (sizeof kChars - 1)]);
  return s;
}

// The folder of --cpu_backend ctorch's start-up hook next to the ctorch
// package in `package_dir`; empty for gloo, or (with one warning) when there
// is no ctorch next to the launcher.
std::string cpu_backend_site_dir(const std::string& cpu_backend, const std::string& package_dir,
                                 const std::shared_ptr<spdlog::logger>& log) {
  if (cpu_backend != "ctorch") return "";
  const std::string site = package_dir + "/ctorch_site";
  std::error_code ec;
  if (package_dir.empty() || !std::filesystem::is_regular_file(site + "/sitecustomize.py", ec)) {
    log->warn(
        "--cpu_backend ctorch: no ctorch package next to the launcher (build it with "
        "scripts/build.sh); the workers' gloo process groups stay on gloo");
    return "";
  }
  return site;
}

std::string hostname() {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0) return "localhost";
  return buf;
}

int64_t epoch_seconds(std::chrono::system_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::seconds>(t.time_since_epoch()).count();
}

// The relay signals go to; null: exit at once. The signal thread calls the
// relay with the mutex held, so that clearing it (set_signal_relay(nullptr),
// ~ElasticAgent) waits for a call in progress and no call reaches a
// destroyed agent.
std::mutex g_relay_mutex;
SignalRelay* g_relay = nullptr;

// Thrown inside the loop when the job cannot go on; carries the exit code.
struct JobEnd {
  int exit_code;
  std::string message;
};

// Thrown by a wait between attempts when the round gives way to the next.
struct RoundGivesWay {
  rendezvous::MembershipChange change;
  // The nodes that reported their workers stopped for the failure, read after
  // the change was seen (when it names lost members): RestartBudget's rule.
  std::vector<int> stopped;
};

// torchrun's keep-alive settings of --rdzv_conf: keep_alive_interval
// (seconds, default 5) and keep_alive_max_attempt (default 3); node_timeout
// (seconds) is their product, kept as an alias: it sets the interval when
// keep_alive_interval is not given.
// Liveness from the validated --rdzv_conf keys: node_timeout (by default
// keep_alive_interval * keep_alive_max_attempt) split into that many beats.
MonitorOptions monitor_options(const LaunchConfig& c) {
  MonitorOptions o;
  o.keep_alive_max_attempt = c.keep_alive_max_attempt;
  o.keep_alive_interval =
      std::max(std::chrono::milliseconds(1), c.node_timeout / c.keep_alive_max_attempt);
  return o;
}

}  // namespace

void block_signals(const std::vector<int>& signals) {
  sigset_t set;
  sigemptyset(&set);
  for (int s : signals) {
    struct sigaction old {};
    sigaction(s, nullptr, &old);
    bool nohup = s == SIGHUP && old.sa_handler == SIG_IGN;
    if (!nohup) {
      signal(s, SIG_DFL);
      sigaddset(&set, s);
    }
  }
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

void start_signal_thread(const std::vector<int>& signals) {
  sigset_t set;
  sigemptyset(&set);
  for (int s : signals) {
    if (sigismember(&set, s) == 0) sigaddset(&set, s);
  }
  std::thread([set] {
    for (;;) {
      int sig = 0;
      if (sigwait(&set, &sig) != 0) continue;
      std::unique_lock<std::mutex> lock(g_relay_mutex);
      if (g_relay) {
        try {
          g_relay->on_signal(sig);
        } catch (const std::exception& e) {
          // The thread's boundary: a signal still ends the launcher.
          get_logger("agent")->error("handling {} failed: {}; exiting with {}", signal_name(sig),
                                     e.what(), 128 + sig);
          spdlog::shutdown();
          std::_Exit(128 + sig);
        }
      } else {
        lock.unlock();
        get_logger("agent")->warn("received {}; exiting with {}", signal_name(sig), 128 + sig);
        worker::Console::flush(worker::Console::kExitStall);
        spdlog::shutdown();
        std::_Exit(128 + sig);
      }
    }
  }).detach();
}

void set_signal_relay(SignalRelay* relay) {
  std::lock_guard<std::mutex> lock(g_relay_mutex);
  g_relay = relay;
}

SignalRelay* signal_relay() {
  std::lock_guard<std::mutex> lock(g_relay_mutex);
  return g_relay;
}

// ---------------------------------------------------------------------------

class ElasticAgent::Impl {
 public:
  Impl(const LaunchConfig& config, rendezvous::Handler& rdzv, worker::Launcher& launcher,
       EventLog& events)
      : c_(config),
        rdzv_(rdzv),
        launcher_(launcher),
        events_(events),
        log_(get_logger("agent")),
        budget_(config.max_restarts, false) {}

  RunResult run();
  void on_signal(int sig);

 private:
  // What watching the local workers of one attempt ended with.
  enum class WatchResult {
    kSucceeded,
    kLocalFailure,
    kRemoteFailure,
    kSignal,
    kJobBroken,
    kReform
  };
  // What one attempt of the job ended with, job-wide.
  struct AttemptOutcome {
    enum Kind {
      kSucceeded,  // every node's workers succeeded (exit barrier passed)
      kFailed,     // a worker somewhere failed: `root` is the job's root cause
      kSignal,     // this agent received `signal`
      kJobBroken,  // the store was lost, or a node died or left
      kReform,     // the round gives way to the next (elastic): no failure
    } kind = kJobBroken;
    int signal = 0;
    FailureRecord root;
    std::vector<FailureRecord> local;  // this node's failed workers
  };

  // Rendezvous (the first round, or after `change` the next), ranks, log
  // directory, monitor.
  void form_round(const std::optional<rendezvous::MembershipChange>& change);
  // Stops the workers and forms the next round after `change`.
  void give_way(rendezvous::MembershipChange change);
  bool elastic() const { return static_cast<bool>(info_.reform); }
  // Elastic: the round gives way to the next when a member is lost, by its
  // heartbeat (dead) or by leaving while its workers ran. Returns the change
  // that won (another member's may be first), or nullopt.
  std::optional<rendezvous::MembershipChange> loss_change(int attempt);
  // Either the monitor's change or a loss; nullopt while the round stands.
  std::optional<rendezvous::MembershipChange> round_change(int attempt);
  // "attempt_<k>", or "attempt_<k>.r<round>" for a later round of attempt k.
  std::string attempt_dir(int attempt) const;
  void start_workers(int attempt);
  // Starts the workers of `attempt`, watches them and, on local success,
  // passes the exit barrier. Never decides what comes next.
  AttemptOutcome run_attempt(int attempt);
  // Acts on an attempt's outcome: the RunResult to end with, or nullopt to
  // run the next attempt.
  std::optional<RunResult> settle(int attempt, const AttemptOutcome& outcome);

  void make_run_dir();
  std::vector<worker::WorkerSpec> worker_specs(int attempt);
  WatchResult watch(int attempt, std::vector<FailureRecord>* local_failures);
  // kJobBroken, with broken_cause_ decided now.
  WatchResult job_broken();
  // A worker (not in `exited`) in D state for the uninterruptible-state
  // timeout, as a failure record; nullopt otherwise (or with the check off).
  std::optional<FailureRecord> uninterruptible_worker(int attempt, const std::set<pid_t>& exited);
  FailureRecord record_of(const worker::WorkerExit& e, int attempt) const;
  FailureRecord publish_failure(int attempt, const std::vector<FailureRecord>& local);
  // Returns the exits stop() returned (worker::Launcher::stop).
  // `finished`: the workers all succeeded and the node goes on to its exit
  // barrier, where the hang detection keeps judging the job (HangDetector::
  // finished()); otherwise it stops watching.
  std::vector<worker::WorkerExit> stop_workers(int sig, int attempt, bool finished = false);
  // Waits for `key` on the main store, bounded by the liveness of the job and
  // a deadline; the error names the nodes missing from `set_key` (if given).
  void await_nodes(const std::string& key, const std::string& set_key, const char* what);
  // The node ranks enrolled in the tally `key` (each once); ProtocolError
  // when an entry is no node of the round.
  std::vector<int> node_set(const std::string& key);
  // The round gives way for `change` while a failure of `attempt` is pending.
  RoundGivesWay gives_way_after_failure(const rendezvous::MembershipChange& change, int attempt);
  // Adds this node to the set at `key`; true when the set is then complete.
  bool join_set(const std::string& key);
  // The other nodes in neither `a` nor `b`.
  std::vector<int> others_except(const std::vector<int>& a, const std::vector<int>& b) const;
  void check_job_alive(const char* what);
  // What ends the job now (the store lost, a node dead or departed), as the
  // JobEnd check_job_alive throws; nullopt when nothing does.
  std::optional<JobEnd> job_end_cause(const char* what);
  // Ends the job when the monitor met a record it cannot read (exit 3) or a
  // bug of ours (InternalError, exit 70).
  void check_monitor() const;
  void sync_after_stop(int attempt, bool final);
  // Elastic, before a failure ends the job: waits up to the liveness bound for
  // a lost member to explain it (throws RoundGivesWay; RestartBudget::explains),
  // and returns at once when every member has stopped its workers (nobody is
  // lost).
  void await_loss(int attempt);
  enum class Barrier { kPassed, kFailed, kReform };
  // kFailed: a failure of this attempt appeared (restart); kReform: the round
  // gives way.
  Barrier exit_barrier(int attempt);
  Barrier await_exit_barrier(int attempt);
  // "the rendezvous store at the endpoint H:P" (elastic) or "the job's store
  // at H:P": the store the agents share, for messages.
  std::string agents_store() const;
  std::string node_list(const std::vector<int>& nodes);
  // The members' records (RendezvousInfo::nodes), read from the store the
  // first time they are needed when the backend left them out (c10d: O(N)
  // bytes, so only for events and messages naming other nodes); empty when
  // they cannot be read now.
  const std::vector<rendezvous::NodeInfo>& members();
  // Member n's host, for messages ("unknown host" when not readable).
  std::string host_of(int n);
  // On the store host: waits until every other live node has left.
  void leave_last();
  // This node leaves the job: withdraws its presence and tells the others.
  // `departing`: it leaves a running job on purpose (a signal), so that the
  // others re-form without it; otherwise the job ended here.
  void leave(bool departing = false);
  // False for a temporary log directory that holds no file with content.
  bool logs_worth_keeping() const;
  // Removes a temporary log directory that holds no file with content; the
  // directory's path when it is kept (empty otherwise).
  std::string tidy_log_dir();
  RunResult finish(int code, std::string message);
  // --hang_timeout: this node's part of a hang verdict (agent/hang_diagnosis.h)
  // before its workers are stopped; the summary line (every rank's frame on
  // the node of the rank that stalled first, this node's otherwise).
  std::string report_hang(int attempt, const FailureRecord& root);

  const LaunchConfig& c_;
  rendezvous::Handler& rdzv_;
  worker::Launcher& launcher_;
  EventLog& events_;
  std::shared_ptr<spdlog::logger> log_;

  rendezvous::RendezvousInfo info_;
  std::unique_ptr<JobMonitor> monitor_;
  std::unique_ptr<HangDetector> hang_;  // with --hang_timeout only
  std::vector<pid_t> pids_;             // of the workers started last, by local rank
  // TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT: since when each worker has
  // been seen in D state, without a break (by pid).
  std::map<pid_t, Clock::time_point> d_state_since_;
  // Why watch() found the job broken, decided then: settle() ends the job
  // with it even when the node that went silent answers again meanwhile.
  std::optional<JobEnd> broken_cause_;
  std::chrono::milliseconds monitor_window_{15'000};  // dead after this long silent
  int base_rank_ = 0;
  int world_size_ = 0;
  std::string host_;
  std::string log_base_;
  bool temp_log_base_ = false;
  std::string run_dir_;
  // The job's restart accounting (agent/restart_budget.h): built from the
  // max_restarts the nodes agreed on once the first round formed; until then
  // this node's own, with nothing spent.
  RestartBudget budget_;
  // The attempt that runs, or that a pending failure belongs to.
  int attempt() const { return budget_.spent(); }
  int started_attempt_ = -1;                            // the last attempt whose workers started
  int first_round_of_attempt_ = -1;                     // the round in which it started
  std::vector<rendezvous::NodeInfo> last_members_;      // of the round before
  std::optional<rendezvous::MembershipChange> change_;  // why the round gives way

  std::mutex phase_mutex_;
  bool workers_running_ = false;
  std::atomic<int> pending_signal_{0};
  // The agents' store failed after this node's workers succeeded: the
  // leaving steps that need it are skipped.
  bool store_failed_ = false;
  // The torch version of the workers' Python, learned while the rendezvous
  // runs (worker/torch_probe.h) and read once, before the first workers
  // start; unknown with --no_python or when the probe fails.
  std::future<std::optional<std::string>> torch_probe_;
  // --numa-binding: each local rank's CPUs, decided once.
  std::vector<std::vector<int>> numa_cpus_;
  // and the NUMA nodes whose memory it prefers (empty: memory policy unavailable).
  std::vector<std::vector<int>> numa_memory_;
  std::optional<std::pair<int, int>> torch_version_;
  // Where the ctorch package is, for the workers' PYTHONPATH; empty for none.
  std::string ctorch_dir_;
  // --cpu_backend ctorch's start-up hook folder; empty for gloo.
  std::string ctorch_site_dir_;
  // torch's agent features (agent/file_timer.h, agent/health_server.h):
  // started by start_torch_agent_features() from the launcher's environment.
  // health_ always exists, so that any part of the agent (the stall
  // detection's set_last_progress) may report to it.
  std::shared_ptr<HealthStatus> health_ = std::make_shared<HealthStatus>();
  std::shared_ptr<WorkerProcesses> timer_workers_ = std::make_shared<WorkerProcesses>();
  std::shared_ptr<FileTimerServer> file_timer_;
  std::unique_ptr<HealthServer> health_server_;
  void start_torch_agent_features();
  // --status_port (agent/job_status.h): the job as this agent knows it; null
  // when neither --status_port nor TORCHELASTIC_HEALTH_CHECK_PORT is set (no
  // sampling, nothing recorded). Its server and sampler go before it.
  std::shared_ptr<JobStatus> job_;
  std::unique_ptr<HealthServer> status_server_;
  std::unique_ptr<StatusSampler> status_sampler_;
  void start_status(std::optional<int> health_port);
  std::unique_ptr<HealthServer> serve(int port, const char* what);
  void set_phase(AgentPhase phase) {
    health_->set_phase(phase);
    if (job_) job_->set_phase(phase);
  }
  void status_attempt_failed(const FailureRecord& root, int k);
};

void ElasticAgent::Impl::on_signal(int sig) {
  std::lock_guard<std::mutex> lock(phase_mutex_);
  if (workers_running_) {
    if (is_scheduler_signal(c_, sig) && c_.scheduler_reaches_workers) {
      log_->warn("received {} from {}: the workers have it too; waiting up to {}ms for them",
                 signal_name(sig), c_.scheduler, c_.shutdown_timeout.count());
    } else if (is_scheduler_signal(c_, sig)) {
      log_->warn(
          "received {} from {}, whose process-group tracking (proctrack/pgid) does not reach "
          "the workers: forwarding it to them",
          signal_name(sig), c_.scheduler);
    } else {
      log_->warn("received {}: forwarding it to the workers", signal_name(sig));
    }
    pending_signal_ = sig;
    launcher_.wake();
    return;
  }
  // Nothing of ours runs: leave at once (the store, if we host it, goes with us).
  const int code = signal_exit_code(c_, sig);
  log_->warn("received {} while no workers run; exiting with {}", signal_name(sig), code);
  // Whatever holds this node's place (an etcd lease) goes now, so that a
  // round forming or running does not wait for it.
  rdzv_.abandon();
  if (job_) job_->finished(code);
  events_.emit("finished", attempt(), {{"exit_code", code}, {"signal", signal_name(sig)}});
  if (file_timer_) file_timer_->remove_pipe();  // _Exit skips the destructor
  if (std::string kept = tidy_log_dir(); !kept.empty()) log_->info("logs kept in {}", kept);
  worker::Console::flush(worker::Console::kExitStall);
  spdlog::shutdown();
  std::_Exit(code);
}

void ElasticAgent::Impl::make_run_dir() {
  if (c_.log_dir.empty()) {
    const char* tmpdir = std::getenv("TMPDIR");
    std::string tmpl =
        std::string(tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp") + "/ctorchrun_XXXXXX";
    if (!mkdtemp(tmpl.data())) {
      throw JobEnd{kUsage, "cannot create a temporary log directory " + tmpl + ": " +
                               std::strerror(errno) + "; set TMPDIR or --log_dir"};
    }
    log_base_ = tmpl;
    temp_log_base_ = true;
    bool to_files = false;
    for (int lr = 0; lr < c_.nproc_per_node; ++lr) {
      to_files = to_files || (c_.tee_for(lr) | c_.redirects_for(lr)) != 0;
    }
    if (to_files) {
      log_->info("worker logs in {} (removed at exit if no log has content)", log_base_);
    }
  } else {
    std::error_code ec;
    fs::create_directories(c_.log_dir, ec);
    if (ec) throw JobEnd{kUsage, "--log_dir: cannot create '" + c_.log_dir + "': " + ec.message()};
    log_base_ = c_.log_dir;
  }
  run_dir_ = log_base_ + "/" + c_.run_id + "_" + random_suffix();
  std::error_code ec;
  fs::create_directories(run_dir_, ec);
  if (ec) throw JobEnd{kUsage, "cannot create log directory '" + run_dir_ + "': " + ec.message()};
}

std::vector<worker::WorkerSpec> ElasticAgent::Impl::worker_specs(int attempt) {
  if (torch_probe_.valid()) {
    // Bounded by the probe's own timeout; usually done long before.
    const std::optional<std::string> version = torch_probe_.get();
    if (version) torch_version_ = worker::major_minor(*version);
    log_->debug("the workers' python ({}) has torch {}", c_.python, version.value_or("unknown"));
  }
  std::vector<worker::WorkerSpec> specs;
  const int nproc = c_.nproc_per_node;
  for (int lr = 0; lr < nproc; ++lr) {
    std::string dir = run_dir_ + "/" + attempt_dir(attempt) + "/" + std::to_string(lr);
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw JobEnd{kUsage, "cannot create log directory '" + dir + "': " + ec.message()};
    WorkerPlacement p;
    p.local_rank = lr;
    p.global_rank = base_rank_ + lr;
    p.local_world_size = nproc;
    p.world_size = world_size_;
    p.group_rank = info_.group_rank;
    p.group_world_size = info_.group_world_size;
    p.role = c_.role;
    p.master_addr = info_.master_addr;
    p.master_port = info_.master_port;
    // Re-formations restart the workers too: their count is the round.
    p.restart_count = attempt + info_.round;
    p.failed_restarts = attempt;
    p.round = info_.round;
    p.max_restarts = budget_.max();
    p.run_id = c_.run_id;
    p.error_file = dir + "/error.json";
    p.torch_version = torch_version_;
    p.ctorch_package_dir = ctorch_dir_;
    p.virtual_local_rank = c_.virtual_local_rank;
    p.ctorch_site_dir = ctorch_site_dir_;

    worker::WorkerSpec s;
    s.local_rank = lr;
    s.argv = substitute_local_rank(c_.entrypoint, lr);
    s.env = build_worker_env(c_.environment, p);
    if (file_timer_) s.env[kTimerFileEnv] = file_timer_->path();
    s.tee = c_.tee_for(lr);
    s.redirects = c_.redirects_for(lr) & ~s.tee;
    if (c_.hang_timeout.count() > 0) {
      // The stacks a hang verdict asks for (SIGABRT) are printed by
      // CPython's faulthandler to fd 2: it must reach a file of ours.
      s.env.emplace("PYTHONFAULTHANDLER", "1");
      if (((s.tee | s.redirects) & worker::kStderr) == 0) s.tee |= worker::kStderr;
    }
    s.stdout_path = dir + "/stdout.log";
    s.stderr_path = dir + "/stderr.log";
    s.prefix = log_line_prefix(c_.log_line_prefix_template, c_.role, p.global_rank, lr);
    if (static_cast<size_t>(lr) < numa_cpus_.size()) s.cpus = numa_cpus_[static_cast<size_t>(lr)];
    if (static_cast<size_t>(lr) < numa_memory_.size()) {
      s.memory_nodes = numa_memory_[static_cast<size_t>(lr)];
    }
    if (c_.local_ranks_filter) {
      const auto& f = *c_.local_ranks_filter;
      s.console = std::find(f.begin(), f.end(), lr) != f.end();
    }
    // torch main's filtered copies of teed lines, one file per attempt.
    const std::string attempt_path = run_dir_ + "/" + attempt_dir(attempt);
    if (!c_.duplicate_stdout_filters.empty()) {
      s.stdout_filters = c_.duplicate_stdout_filters;
      s.filtered_stdout_path = attempt_path + "/filtered_stdout.log";
    }
    if (!c_.duplicate_stderr_filters.empty()) {
      s.stderr_filters = c_.duplicate_stderr_filters;
      s.filtered_stderr_path = attempt_path + "/filtered_stderr.log";
    }
    specs.push_back(std::move(s));
  }
  return specs;
}

FailureRecord ElasticAgent::Impl::record_of(const worker::WorkerExit& e, int attempt) const {
  FailureRecord f;
  f.rank = base_rank_ + e.local_rank;
  f.local_rank = e.local_rank;
  f.node_rank = info_.group_rank;
  f.host = host_;
  f.pid = e.pid;
  f.signaled = e.signaled;
  f.exit_code = e.exit_code;
  f.signal = e.signal;
  f.timestamp = epoch_seconds(e.time);
  f.noticed_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(e.time.time_since_epoch()).count();
  f.attempt = attempt;
  read_error_file(
      run_dir_ + "/" + attempt_dir(attempt) + "/" + std::to_string(e.local_rank) + "/error.json",
      &f);
  return f;
}

std::optional<FailureRecord> ElasticAgent::Impl::uninterruptible_worker(
    int attempt, const std::set<pid_t>& exited) {
  const auto timeout = c_.uninterruptible_state_timeout;
  if (timeout.count() <= 0) return std::nullopt;
  const auto now = Clock::now();
  for (size_t lr = 0; lr < pids_.size(); ++lr) {
    const pid_t pid = pids_[lr];
    const auto stat = exited.count(pid) ? std::nullopt : procfs::read_stat(pid, c_.proc_root);
    if (!stat || stat->state != 'D') {
      d_state_since_.erase(pid);
      continue;
    }
    auto [since, first] = d_state_since_.emplace(pid, now);
    if (first) {
      log_->warn(
          "worker local_rank={} pid={} is in uninterruptible sleep (D state); the job fails "
          "if it stays there {} ms",
          lr, pid, timeout.count());
    }
    if (now - since->second < timeout) continue;
    const auto held = std::chrono::duration_cast<std::chrono::milliseconds>(now - since->second);
    worker::WorkerExit e;
    e.local_rank = static_cast<int>(lr);
    e.pid = pid;
    e.time = std::chrono::system_clock::now();
    FailureRecord f = record_of(e, attempt);
    f.uninterruptible = true;
    f.message = "worker pid " + std::to_string(pid) +
                " stayed in uninterruptible sleep (D state) " +
                std::to_string(held.count() / 1000.0).substr(0, 5) +
                " s (TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT=" +
                std::to_string(timeout.count() / 1000.0).substr(0, 5) +
                " s): it holds a kernel resource a fresh worker would contend for, so no "
                "restart follows";
    return f;
  }
  return std::nullopt;
}

ElasticAgent::Impl::WatchResult ElasticAgent::Impl::job_broken() {
  broken_cause_ = job_end_cause("running workers");
  if (!broken_cause_) {  // the monitor's view changed between the two reads
    broken_cause_ = JobEnd{kRendezvous, "the job lost a node while running workers"};
  }
  return WatchResult::kJobBroken;
}

ElasticAgent::Impl::WatchResult ElasticAgent::Impl::watch(
    int attempt, std::vector<FailureRecord>* local_failures) {
  size_t succeeded = 0;
  std::set<pid_t> exited;  // of this attempt's workers
  d_state_since_.clear();
  // The D-state check (when on) looks a few times per timeout, at least 10 Hz.
  const auto slice =
      c_.uninterruptible_state_timeout.count() > 0
          ? std::clamp(std::chrono::duration_cast<std::chrono::milliseconds>(
                           c_.uninterruptible_state_timeout / 10),
                       std::chrono::milliseconds(100), std::chrono::milliseconds(1000))
          : std::chrono::milliseconds(1000);
  // Set when a worker died by what may be the scheduler's signal: until then
  // the agent's own copy may still come (agent/scheduler_stop.h).
  std::optional<Clock::time_point> scheduler_grace;
  for (;;) {
    auto exits = launcher_.wait(scheduler_grace ? std::min(*scheduler_grace, Clock::now() + slice)
                                                : Clock::now() + slice);
    // /healthz's last_progress, from the stall detection when it runs.
    if (hang_) {
      if (auto t = hang_->last_progress()) health_->set_last_progress(*t);
    }
    for (const auto& e : exits) {
      nlohmann::json fields = {
          {"local_rank", e.local_rank}, {"rank", base_rank_ + e.local_rank}, {"pid", e.pid}};
      if (e.signaled) {
        fields["signal"] = signal_name(e.signal);
      } else {
        fields["exit_code"] = e.exit_code;
      }
      events_.emit("worker_exited", attempt, fields);
      if (job_) job_->worker_exited(e.local_rank, e.failed());
      exited.insert(e.pid);
      if (e.failed()) {
        if (!scheduler_grace && may_be_scheduler_stop(c_, e)) {
          scheduler_grace = Clock::now() + kSchedulerSignalGrace;
        }
        local_failures->push_back(record_of(e, attempt));
      } else {
        ++succeeded;
      }
    }
    if (!local_failures->empty()) {
      if (scheduler_grace) {
        if (pending_signal_) return WatchResult::kSignal;
        if (Clock::now() < *scheduler_grace) continue;
      }
      return WatchResult::kLocalFailure;
    }
    if (pending_signal_) return WatchResult::kSignal;
    if (auto stuck = uninterruptible_worker(attempt, exited)) {
      local_failures->push_back(*stuck);
      return WatchResult::kLocalFailure;
    }
    check_monitor();
    if (monitor_->failure(attempt)) return WatchResult::kRemoteFailure;
    if ((change_ = round_change(attempt))) return WatchResult::kReform;
    if (monitor_->store_lost()) return job_broken();
    // Elastic: a dead or departed node re-forms the round (round_change
    // above, tried again on every pass while the store does not answer); only
    // the store's own loss ends the job.
    if (!elastic() && !monitor_->dead_nodes().empty()) return job_broken();
    if (auto gone = monitor_->departed_nodes(); !elastic() && !gone.empty()) {
      // A node whose workers of this attempt succeeded may leave after its
      // exit barrier (liveness unknown too long): this node's workers go on.
      auto finished = node_set(keys::finished(attempt));
      if (std::any_of(gone.begin(), gone.end(), [&](int n) {
            return std::find(finished.begin(), finished.end(), n) == finished.end();
          })) {
        return job_broken();
      }
    }
    if (succeeded == static_cast<size_t>(c_.nproc_per_node)) return WatchResult::kSucceeded;
  }
}

FailureRecord ElasticAgent::Impl::publish_failure(int attempt,
                                                  const std::vector<FailureRecord>& local) {
  FailureRecord root = *std::min_element(
      local.begin(), local.end(),
      [](const FailureRecord& a, const FailureRecord& b) { return a.earlier_than(b); });
  std::string mine = root.to_json();
  std::string winner = info_.store->compare_set(keys::failure(attempt), "", mine);
  if (winner == mine) return root;
  try {
    return FailureRecord::from_json(winner);
  } catch (const ProtocolError& e) {
    throw ProtocolError("unreadable record at key '" + keys::failure(attempt) + "': " + e.what());
  }
}

std::vector<worker::WorkerExit> ElasticAgent::Impl::stop_workers(int sig, int attempt,
                                                                 bool finished) {
  set_phase(AgentPhase::kStopping);
  if (hang_) {
    if (finished) {
      hang_->finished();
    } else {
      hang_->unwatch();
    }
  }
  // Always: it also kills what exited workers left behind in their groups.
  // The scheduler signalled the workers itself: send nothing (0), wait, then
  // SIGKILL.
  if (sig != SIGKILL && is_scheduler_signal(c_, pending_signal_) && c_.scheduler_reaches_workers) {
    sig = 0;
  }
  auto t0 = Clock::now();
  auto stopped = launcher_.stop(sig, c_.shutdown_timeout);
  if (!stopped.empty()) {
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
    log_->debug("stopped {} workers in {}ms", stopped.size(), ms);
    events_.emit("workers_stopped", attempt,
                 {{"signal", signal_name(sig)}, {"count", stopped.size()}});
  }
  // libctorch_dist's segments that a worker created and did not live to
  // unlink (rank 0 killed between the two): its name carries its creator's
  // pid, so only this attempt's workers' go (common/shm_segments.h).
  auto dir_setting = c_.environment.find("CTORCHRUN_DIST_SHM_DIR");
  const std::string shm_dir = shm_segments::folder(
      dir_setting == c_.environment.end() ? std::string() : dir_setting->second);
  if (int n = shm_segments::remove_created_by(pids_, shm_dir); n > 0) {
    log_->info("removed {} shared-memory segment(s) the stopped workers left in {}", n, shm_dir);
  }
  std::lock_guard<std::mutex> lock(phase_mutex_);
  workers_running_ = false;
  return stopped;
}

void ElasticAgent::Impl::check_monitor() const {
  if (auto e = monitor_->internal_error()) throw InternalError(*e);
  if (auto e = monitor_->protocol_error()) {
    throw JobEnd{kRendezvous, "protocol error in the job's store at " + info_.master_addr + ":" +
                                  std::to_string(info_.master_port) + ": " + *e};
  }
}

void ElasticAgent::Impl::check_job_alive(const char* what) {
  check_monitor();
  if (auto cause = job_end_cause(what)) throw *cause;
}

std::optional<JobEnd> ElasticAgent::Impl::job_end_cause(const char* what) {
  if (monitor_->store_lost()) {
    const std::string where =
        agents_store() + (info_.store_endpoint.empty() ? "" : " (its host is gone or unreachable)");
    return JobEnd{kRendezvous, "lost " + where + " while " + what + ": " + monitor_->store_error()};
  }
  auto dead = monitor_->dead_nodes();
  if (!dead.empty()) {
    int n = dead.front();
    return JobEnd{kRendezvous, "node " + std::to_string(n) + " (" + host_of(n) +
                                   ") stopped responding while " + what +
                                   (elastic() ? "; the round could not be re-formed without it"
                                              : "; a static job cannot go on without it")};
  }
  auto gone = monitor_->departed_nodes();
  if (!gone.empty()) {
    int n = gone.front();
    return JobEnd{kRendezvous,
                  "node " + std::to_string(n) + " (" + host_of(n) + ") left the job while " + what};
  }
  return std::nullopt;
}

std::vector<int> ElasticAgent::Impl::node_set(const std::string& key) {
  std::vector<int> out;
  for (const std::string& item : info_.store->tally_entries(key)) {
    int n = -1;
    if (!item.empty() && item.size() < 10 &&
        std::all_of(item.begin(), item.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      n = std::stoi(item);
    }
    if (n < 0 || n >= info_.group_world_size) {
      throw ProtocolError("unreadable record at key '" + key + "': '" + item.substr(0, 200) + "'");
    }
    if (std::find(out.begin(), out.end(), n) == out.end()) out.push_back(n);
  }
  return out;
}

bool ElasticAgent::Impl::join_set(const std::string& key) {
  // A tally, so that an enrolment whose answer was lost is recovered, not
  // retried blindly (store/store.h); a node listed twice counts once.
  info_.store->tally_add(key, std::to_string(info_.group_rank));
  return node_set(key).size() == static_cast<size_t>(info_.group_world_size);
}

std::vector<int> ElasticAgent::Impl::others_except(const std::vector<int>& a,
                                                   const std::vector<int>& b) const {
  std::vector<int> out;
  for (int n = 0; n < info_.group_world_size; ++n) {
    if (n == info_.group_rank) continue;
    if (std::find(a.begin(), a.end(), n) != a.end()) continue;
    if (std::find(b.begin(), b.end(), n) != b.end()) continue;
    out.push_back(n);
  }
  return out;
}

void ElasticAgent::Impl::await_nodes(const std::string& key, const std::string& set_key,
                                     const char* what) {
  // Live nodes answer within the shutdown timeout; dead or departed ones end
  // the wait through check_job_alive. The deadline is the last resort.
  const auto bound = c_.shutdown_timeout + monitor_window_ + 30s;
  const auto deadline = Clock::now() + bound;
  for (;;) {
    try {
      info_.store->wait({key}, 200ms);
      return;
    } catch (const TimeoutError&) {
    }
    if (auto change = round_change(attempt())) throw gives_way_after_failure(*change, attempt());
    check_job_alive(what);
    if (Clock::now() >= deadline) {
      std::vector<int> reported = set_key.empty() ? std::vector<int>{} : node_set(set_key);
      auto missing = others_except(reported, {});
      throw JobEnd{
          kRendezvous,
          "timed out after " +
              std::to_string(std::chrono::duration_cast<std::chrono::seconds>(bound).count()) +
              "s " + what + " (key '" + key + "'); waiting for nodes " + node_list(missing)};
    }
  }
}

RoundGivesWay ElasticAgent::Impl::gives_way_after_failure(
    const rendezvous::MembershipChange& change, int attempt) {
  RoundGivesWay g{change, {}};
  if (change.lost.empty()) return g;  // an admission: nobody's report matters
  try {
    g.stopped = node_set(keys::stopped(attempt));
  } catch (const InternalError&) {
    throw;
  } catch (const ProtocolError&) {
    throw;
  } catch (const Error& e) {
    // Unknown: the loss explains the failure, as when no lost member reported.
    log_->debug("could not read who stopped the workers of attempt {}: {}", attempt, e.what());
  }
  return g;
}

void ElasticAgent::Impl::await_loss(int attempt) {
  if (join_set(keys::stopped(attempt))) info_.store->set(keys::all_stopped(attempt), "1");
  const auto deadline = Clock::now() + monitor_window_ + 2s;
  while (Clock::now() < deadline) {
    auto change = round_change(attempt);
    if (change) {
      RoundGivesWay g = gives_way_after_failure(*change, attempt);
      if (RestartBudget::explains(g.change, g.stopped)) throw g;
      // An admission, or members lost after they stopped their workers for
      // the failure: it stands.
      return;
    }
    try {
      info_.store->wait({keys::all_stopped(attempt)}, 100ms);
      return;
    } catch (const TimeoutError&) {
    }
    check_monitor();
    if (monitor_->store_lost()) return;
  }
}

void ElasticAgent::Impl::sync_after_stop(int attempt, bool final) {
  if (join_set(keys::stopped(attempt))) info_.store->set(keys::all_stopped(attempt), "1");
  if (final) {
    // The host keeps the store up until every node has read the failure.
    if (info_.store_host.value_or(static_cast<bool>(info_.clear_worker_keys))) {
      auto deadline = Clock::now() + 10s;
      while (Clock::now() < deadline) {
        try {
          info_.store->wait({keys::all_stopped(attempt)}, 200ms);
          break;
        } catch (const TimeoutError&) {
        }
        check_monitor();
        if (monitor_->store_lost() || !monitor_->dead_nodes().empty()) break;
      }
    }
    return;
  }
  await_nodes(keys::all_stopped(attempt), keys::stopped(attempt),
              "waiting for every node to stop its workers");
  if (info_.clear_worker_keys) {
    // No key written by this attempt's workers may be read by the next one's
    // (torch 2.6+ workers use no attempt prefix).
    size_t removed = info_.clear_worker_keys();
    log_->debug("removed {} keys of attempt {} from the store", removed, attempt);
    info_.store->set(keys::clean(attempt), "1");
  } else {
    await_nodes(keys::clean(attempt), "", "waiting for node 0 to clear the store");
  }
}

ElasticAgent::Impl::Barrier ElasticAgent::Impl::exit_barrier(int attempt) {
  try {
    return await_exit_barrier(attempt);
  } catch (const InternalError&) {
    throw;
  } catch (const Error& e) {
    // This node's workers succeeded; a store that fails now (its host died,
    // etcd refuses writes) cannot undo that, and no failure elsewhere can
    // reach this node any more: its exit follows its own outcome.
    store_failed_ = true;
    log_->warn("exit barrier: {} failed ({}); this node's workers succeeded", agents_store(),
               e.what());
    return Barrier::kPassed;
  }
}

std::string ElasticAgent::Impl::agents_store() const {
  return info_.store_endpoint.empty()
             ? "the job's store at " + info_.master_addr + ":" + std::to_string(info_.master_port)
             : "the rendezvous store at the endpoint " + info_.store_endpoint;
}

ElasticAgent::Impl::Barrier ElasticAgent::Impl::await_exit_barrier(int attempt) {
  // No admission re-forms a round whose workers finish (it would redo work),
  // and this node leaving from now on is no loss. When an admission took the
  // attempt first, the monitor reports the round giving way.
  if (info_.mark_finishing) info_.mark_finishing(attempt);
  // The node that completes the set of finished nodes releases everyone.
  if (join_set(keys::finished(attempt))) info_.store->set(keys::all_done(attempt), "1");
  // The timeout bounds only a wait for nodes whose liveness is unknown: a node
  // that is alive and still running workers may yet fail and restart the job,
  // so it is waited for without limit (and the store host must outlive it).
  auto deadline = Clock::now() + c_.exit_barrier_timeout;
  auto next_scan = Clock::now();
  for (;;) {
    try {
      info_.store->wait({keys::all_done(attempt)}, 200ms);
      return Barrier::kPassed;
    } catch (const TimeoutError&) {
    }
    if (monitor_->failure(attempt)) return Barrier::kFailed;
    if ((change_ = monitor_->membership_change())) return Barrier::kReform;
    check_monitor();
    if (monitor_->store_lost()) {
      store_failed_ = true;
      log_->warn("exit barrier: lost {} ({}); this node's workers succeeded", agents_store(),
                 monitor_->store_error());
      return Barrier::kPassed;
    }
    if (Clock::now() < next_scan) continue;
    next_scan = Clock::now() + 1s;
    // One store request: the others are known from the monitor's view.
    auto running = others_except(node_set(keys::finished(attempt)), monitor_->departed_nodes());
    if (running.empty()) return Barrier::kPassed;  // the others finished or left
    auto dead = monitor_->dead_nodes();
    const bool known = monitor_->liveness_known();
    bool any_alive = known && std::any_of(running.begin(), running.end(), [&](int node) {
                       return std::find(dead.begin(), dead.end(), node) == dead.end();
                     });
    if (any_alive) {
      deadline = Clock::now() + c_.exit_barrier_timeout;
      continue;
    }
    if (known) {
      log_->warn(
          "exit barrier: nodes {} stopped responding before finishing; this node's workers "
          "succeeded",
          node_list(running));
      return Barrier::kPassed;
    }
    if (Clock::now() >= deadline) {
      log_->warn(
          "exit barrier timed out after {}s waiting for nodes {} whose liveness is unknown; this "
          "node's workers succeeded",
          c_.exit_barrier_timeout.count() / 1000, node_list(running));
      return Barrier::kPassed;
    }
  }
}

std::string ElasticAgent::Impl::node_list(const std::vector<int>& nodes) {
  std::string s;
  for (int n : nodes) s += (s.empty() ? "" : ", ") + std::to_string(n) + " (" + host_of(n) + ")";
  return s;
}

const std::vector<rendezvous::NodeInfo>& ElasticAgent::Impl::members() {
  if (info_.nodes.empty() && info_.read_nodes) {
    try {
      info_.nodes = info_.read_nodes();
    } catch (const Error& e) {
      log_->debug("could not read the members of round {}: {}", info_.round, e.what());
    }
  }
  return info_.nodes;
}

std::string ElasticAgent::Impl::host_of(int n) {
  const auto& nodes = members();
  if (n < 0 || n >= static_cast<int>(nodes.size())) return "unknown host";
  return nodes[static_cast<size_t>(n)].host;
}

void ElasticAgent::Impl::leave_last() {
  // The store host leaves last: every other node reads its outcome from the
  // store. Live nodes leave within moments; dead ones are not waited for,
  // nodes of unknown liveness for at most the exit barrier timeout.
  if (!info_.store_host.value_or(static_cast<bool>(info_.clear_worker_keys)) ||
      info_.group_world_size == 1) {
    return;
  }
  auto deadline = Clock::now() + c_.exit_barrier_timeout;
  for (;;) {
    auto staying = others_except(monitor_->departed_nodes(), monitor_->dead_nodes());
    if (staying.empty() || monitor_->store_lost()) return;
    const bool known = monitor_->liveness_known();
    if (!known && Clock::now() >= deadline) {
      log_->warn("leaving while nodes {} may still read the store", node_list(staying));
      return;
    }
    if (known) deadline = Clock::now() + c_.exit_barrier_timeout;
    // The host's own store: one wait for every gone key it still misses.
    std::vector<std::string> gone;
    for (int node : staying) gone.push_back(keys::gone(node));
    try {
      info_.store->wait(gone, 200ms);
      return;
    } catch (const TimeoutError&) {
    }
  }
}

void ElasticAgent::Impl::leave(bool departing) {
  // A store that is lost cannot hear it; each call would only wait out its
  // timeout.
  if (monitor_ && monitor_->store_lost()) return;
  if (departing && info_.depart) {
    info_.depart();
  } else if (info_.withdraw) {
    info_.withdraw();
  }
  if (!info_.store) return;
  try {
    info_.store->set(keys::gone(info_.group_rank), "1");
  } catch (const Error&) {
    // The store is gone already: nobody is left to tell.
  }
}

bool ElasticAgent::Impl::logs_worth_keeping() const {
  if (!temp_log_base_) return true;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(log_base_, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (it->is_regular_file(ec) && it->file_size(ec) > 0) return true;
  }
  return false;
}

std::string ElasticAgent::Impl::tidy_log_dir() {
  if (log_base_.empty()) return "";
  if (temp_log_base_ && !logs_worth_keeping()) {
    std::error_code ec;
    fs::remove_all(log_base_, ec);
    return "";
  }
  return temp_log_base_ ? log_base_ : "";
}

std::string ElasticAgent::Impl::report_hang(int k, const FailureRecord& root) {
  auto env = [&](const char* name) {
    auto it = c_.environment.find(name);
    return it == c_.environment.end() ? std::string() : it->second;
  };
  DiagnosisOptions o =
      diagnosis_options(env("TORCH_NCCL_TRACE_BUFFER_SIZE"), env("TORCH_NCCL_DEBUG_INFO_PIPE_FILE"),
                        env("TORCH_NCCL_DEBUG_INFO_TEMP_FILE"), env("PATH"));
  std::vector<DiagnosisTarget> targets;
  for (size_t lr = 0; lr < pids_.size(); ++lr) {
    const std::string dir = run_dir_ + "/" + attempt_dir(k) + "/" + std::to_string(lr);
    targets.push_back({base_rank_ + static_cast<int>(lr), static_cast<int>(lr), pids_[lr], dir,
                       dir + "/stderr.log"});
  }
  log_->warn(
      "hang: no worker of the job progressed for {} ms; rank {} (node {}) stalled first; "
      "collecting the stacks of local ranks 0-{}",
      c_.hang_timeout.count(), root.rank, root.node_rank, pids_.empty() ? 0 : pids_.size() - 1);
  std::vector<int> ranks;
  for (int r = 0; r < world_size_; ++r) ranks.push_back(r);
  if (job_) job_->hang_detected(root.rank);
  events_.emit("hang_detected", k,
               {{"ranks", ranks},
                {"first_stalled_rank", root.rank},
                {"first_stalled_node", root.node_rank},
                {"timeout_s", c_.hang_timeout.count() / 1000.0}});
  const auto t0 = Clock::now();
  // 8 s for the stacks, and up to 10 s in all with the exchange below.
  o.budget = 8s;
  std::vector<RankFrame> frames = diagnose_hang(targets, o);
  // Every node's frames to the node of the rank that stalled first, which
  // names them all (bounded: a node that cannot answer is left out).
  std::vector<RankFrame> all = frames;
  try {
    nlohmann::json mine = nlohmann::json::array();
    for (const auto& f : frames) mine.push_back({{"rank", f.rank}, {"frame", f.frame}});
    info_.store->set(keys::stacks(k, info_.group_rank), json_text::dump_record(mine));
    if (root.node_rank == info_.group_rank) {
      // Nodes diagnose at once; one on a busy machine may take its whole
      // budget.
      const auto deadline = std::max(t0 + 10s, Clock::now() + 200ms);
      for (int n = 0; n < info_.group_world_size; ++n) {
        if (n == info_.group_rank) continue;
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            std::max(Clock::duration::zero(), deadline - Clock::now()));
        try {
          info_.store->wait({keys::stacks(k, n)}, std::max(left, std::chrono::milliseconds(1)));
        } catch (const TimeoutError&) {
          continue;
        }
        auto j = json_text::parse_record(info_.store->get(keys::stacks(k, n)));
        if (!j.is_array()) continue;
        for (const auto& f : j) {
          if (f.is_object() && f.contains("rank") && f["rank"].is_number_integer() &&
              f.contains("frame") && f["frame"].is_string()) {
            all.push_back({f["rank"].get<int>(), f["frame"].get<std::string>()});
          }
        }
      }
    }
  } catch (const InternalError&) {
    throw;
  } catch (const Error& e) {
    log_->warn("hang: could not exchange the ranks' frames through {}: {}", agents_store(),
               e.what());
  }
  const std::string grouped = group_frames(all);
  std::string summary = "hang: no worker progressed for " +
                        std::to_string(c_.hang_timeout.count()) + " ms; first stalled: rank " +
                        std::to_string(root.rank) + " (node " + std::to_string(root.node_rank) +
                        ", " + root.host + ", pid " + std::to_string(root.pid) + "); " + grouped +
                        "; stacks in " + run_dir_ + "/" + attempt_dir(k) + "/<local_rank>/hang.txt";
  log_->warn("{}", summary);
  events_.emit(
      "hang_diagnosed", k,
      {{"frames", grouped},
       {"first_stalled_rank", root.rank},
       {"diagnosis_ms",
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count()}});
  return summary;
}

RunResult ElasticAgent::Impl::finish(int code, std::string message) {
  set_phase(AgentPhase::kFinished);
  if (job_) job_->finished(code);
  events_.emit("finished", attempt(), {{"exit_code", code}});
  // A temporary log directory goes when it holds no file worth reading (no
  // output was redirected, no error file written); otherwise its path is in
  // the launcher's last log line.
  RunResult r{code, std::move(message), {}, tidy_log_dir(), {}};
  // Named by main after the failure summary.
  r.truncated_logs = launcher_.truncated_logs();
  return r;
}

std::string ElasticAgent::Impl::attempt_dir(int attempt) const {
  std::string dir = "attempt_" + std::to_string(attempt);
  if (attempt == started_attempt_ && info_.round != first_round_of_attempt_) {
    dir += ".r" + std::to_string(info_.round);
  }
  return dir;
}

void ElasticAgent::Impl::form_round(const std::optional<rendezvous::MembershipChange>& change) {
  hang_.reset();
  monitor_.reset();  // the last round's view ends with it
  set_phase(AgentPhase::kRendezvous);
  if (job_) job_->rendezvous_started();
  try {
    info_ = change ? rdzv_.next_round(*change, attempt()) : rdzv_.next_rendezvous();
  } catch (const rendezvous::JobClosedError& e) {
    if (e.while_waiting() && e.was_member() && e.outcome() != "succeeded") {
      // It ran in the job, whose restarts ran out while it came back.
      throw JobEnd{kFailed, "the job ended (" + e.outcome() +
                                ") while this node came back for its next round; the failure "
                                "summary is on the node whose workers failed"};
    }
    if (e.while_waiting()) {
      // A spare, or a node waiting to be admitted: the job ended without it.
      std::string msg = "the job ended (" + e.outcome() + ") while this node waited for a round";
      log_->info("{}; exiting 0", msg);
      throw JobEnd{0, msg};
    }
    throw JobEnd{kRendezvous, e.what()};
  } catch (const ConfigError& e) {
    throw JobEnd{kUsage, e.what()};
  } catch (const TimeoutError& e) {
    throw JobEnd{kRendezvous, e.what()};
  } catch (const IoError& e) {
    throw JobEnd{kNetwork, e.what()};
  } catch (const InternalError&) {
    throw;
  } catch (const Error& e) {
    throw JobEnd{kRendezvous, std::string("rendezvous failed: ") + e.what()};
  }
  // The budget is the one the nodes agreed on; a node joining a running job
  // takes its restart count.
  if (!change) budget_ = RestartBudget(info_.max_restarts.value_or(c_.max_restarts), elastic());
  budget_.on_round_formed(info_.attempt);
  if (info_.world_size > 0) {
    // The backend worked ranks out without every member's record.
    base_rank_ = info_.base_rank;
    world_size_ = info_.world_size;
  } else {
    std::vector<int> sizes;
    for (const auto& n : info_.nodes) sizes.push_back(n.local_world_size);
    base_rank_ = base_global_rank(sizes, info_.group_rank);
    world_size_ = 0;
    for (int s : sizes) world_size_ += s;
  }
  // Every member's record is read only where it is listed: the events, the
  // rank table of a small job, or a debug log.
  const bool rounds = elastic();
  if ((rounds && events_.enabled()) || info_.group_world_size <= kRankTableNodes ||
      log_->should_log(spdlog::level::debug)) {
    members();
  }
  if (info_.group_rank < static_cast<int>(info_.nodes.size())) {
    const auto& me = info_.nodes[static_cast<size_t>(info_.group_rank)];
    if (!me.host.empty()) host_ = me.host;  // as the other nodes know this one
  }
  std::string table;
  int r = 0;
  for (const auto& n : info_.nodes) {
    table += (table.empty() ? "" : ", ") + std::string("node ") + std::to_string(n.group_rank) +
             " (" + n.host + ") ranks " + std::to_string(r) + "-" +
             std::to_string(r + n.local_world_size - 1);
    r += n.local_world_size;
  }
  if (info_.nodes.empty()) {
    table = std::to_string(info_.group_world_size) + " nodes (their rank table at debug level)";
  }
  log_->info(
      "rendezvous complete{}: run_id={} group_rank={} group_world_size={} world_size={} "
      "master={}:{} restart_count={}; {}",
      rounds ? " (round " + std::to_string(info_.round) + ")" : std::string(), c_.run_id,
      info_.group_rank, info_.group_world_size, world_size_, info_.master_addr, info_.master_port,
      attempt(), table);
  if (job_) {
    std::vector<StatusNode> nodes;
    int first = 0;
    for (const auto& n : info_.nodes) {
      nodes.push_back({n.group_rank, n.host, "present", n.local_world_size, first, n.pid});
      first += n.local_world_size;
    }
    job_->round_formed(info_.round, attempt(), info_.group_rank, info_.group_world_size,
                       std::move(nodes), world_size_);
  }
  events_.emit("rendezvous", attempt(),
               {{"group_rank", info_.group_rank},
                {"group_world_size", info_.group_world_size},
                {"world_size", world_size_},
                {"master_addr", info_.master_addr},
                {"master_port", info_.master_port}});
  if (rounds) {
    nlohmann::json members = nlohmann::json::array();
    int endpoint_host = -1;
    for (const auto& n : info_.nodes) {
      members.push_back({{"group_rank", n.group_rank}, {"host", n.host}, {"pid", n.pid}});
      if (n.hosts_endpoint) endpoint_host = n.group_rank;
      const bool before =
          std::any_of(last_members_.begin(), last_members_.end(),
                      [&](const auto& m) { return m.host == n.host && m.pid == n.pid; });
      if (!before) {
        events_.emit("node_joined", attempt(),
                     {{"group_rank", n.group_rank},
                      {"host", n.host},
                      {"pid", n.pid},
                      {"round", info_.round}});
      }
    }
    events_.emit("round_complete", attempt(),
                 {{"round", info_.round},
                  {"members", members},
                  {"world_size", world_size_},
                  // -1: a standalone store at the endpoint, hosted by no member
                  {"endpoint_store_node", endpoint_host},
                  {"workers_store_node", 0},
                  {"workers_store", info_.master_addr + ":" + std::to_string(info_.master_port)}});
    last_members_ = info_.nodes;
  }
  if (run_dir_.empty()) make_run_dir();
  MonitorOptions mo = monitor_options(c_);
  mo.node = info_.group_rank;
  mo.nnodes = info_.group_world_size;
  mo.hosts_store = info_.store_host.value_or(static_cast<bool>(info_.clear_worker_keys));
  mo.membership = info_.check_membership;
  // Elastic: the store is lost when unreachable for as long as a node is
  // dead when silent, so a cut-off node and its survivors decide alike.
  if (info_.liveness_window && mo.keep_alive_interval.count() > 0) {
    // Heartbeats back the rendezvous's own loss detection up: dead only
    // after the window it asks for.
    const auto per = mo.keep_alive_interval.count();
    const auto attempts = (info_.liveness_window->count() + per - 1) / per;
    mo.keep_alive_max_attempt =
        std::max(mo.keep_alive_max_attempt, static_cast<int>(std::min<long long>(attempts, 1000)));
  }
  if (elastic()) mo.store_grace = info_.store_grace.value_or(mo.liveness_window());
  // A single-node job on its own store: nothing across nodes to watch, and
  // the hang detector (which writes the failure key) is off.
  mo.alone = !elastic() && info_.group_world_size == 1 && mo.hosts_store &&
             c_.hang_timeout.count() == 0 && !mo.membership;
  monitor_window_ = mo.liveness_window();
  monitor_ = std::make_unique<JobMonitor>(info_.connect, mo, [this] { launcher_.wake(); });
  if (c_.hang_timeout.count() > 0) {
    HangOptions ho;
    ho.timeout = c_.hang_timeout;
    ho.node = info_.group_rank;
    ho.nnodes = info_.group_world_size;
    ho.decides = mo.hosts_store;  // the liveness publisher decides
    ho.host = host_;
    hang_ = std::make_unique<HangDetector>(info_.connect, ho);
  }
}

std::optional<rendezvous::MembershipChange> ElasticAgent::Impl::loss_change(int attempt) {
  if (!elastic()) return std::nullopt;
  rendezvous::MembershipChange change;
  for (int n : monitor_->dead_nodes()) change.lost.push_back(n);
  if (!change.lost.empty()) {
    change.cause = "heartbeat timeout";
  } else {
    auto gone = monitor_->departed_nodes();
    if (gone.empty()) return std::nullopt;
    // A member that left after its workers succeeded is not lost.
    auto finished = node_set(keys::finished(attempt));
    for (int n : gone) {
      if (std::find(finished.begin(), finished.end(), n) == finished.end())
        change.lost.push_back(n);
    }
    if (change.lost.empty()) return std::nullopt;
    change.cause = "agent left";
  }
  std::string list;
  for (int n : change.lost) list += (list.empty() ? "" : ", ") + std::to_string(n);
  change.reason = "lost node" + std::string(change.lost.size() == 1 ? " " : "s ") + list + " (" +
                  change.cause + ")";
  try {
    return info_.reform(change);
  } catch (const ProtocolError&) {
    throw;
  } catch (const Error& e) {
    // The store did not answer: asked again on the next pass; a store that
    // stays away is the monitor's to declare lost.
    log_->debug("could not re-form the round yet: {}", e.what());
    return std::nullopt;
  }
}

std::optional<rendezvous::MembershipChange> ElasticAgent::Impl::round_change(int attempt) {
  if (auto change = monitor_->membership_change()) return change;
  return loss_change(attempt);
}

void ElasticAgent::Impl::give_way(rendezvous::MembershipChange change) {
  log_->warn("round {} gives way to the next: {}; stopping the workers (no restart charged)",
             info_.round, change.reason);
  for (int n : change.lost) {
    if (n < 0 || n >= static_cast<int>(members().size())) continue;
    const auto& node = info_.nodes[static_cast<size_t>(n)];
    events_.emit("node_lost", attempt(),
                 {{"group_rank", n},
                  {"host", node.host},
                  {"pid", node.pid},
                  {"round", info_.round},
                  {"cause", change.cause}});
  }
  if (job_) {
    for (int n : change.lost) job_->node_lost(n, change.cause, change.cause == "agent left");
    job_->restart(RestartReason::kMembership, attempt(), change.reason);
  }
  events_.emit("round_gives_way", attempt(),
               {{"round", info_.round}, {"reason", change.reason}, {"lost", change.lost}});
  // The next round waits for this node up to its grace, not only its last
  // call.
  if (info_.stopping) info_.stopping(c_.shutdown_timeout);
  stop_workers(SIGTERM, attempt());
  if (int sig = pending_signal_) {
    throw JobEnd{signal_exit_code(c_, sig), signal_stop_message(c_, sig)};
  }
  change_.reset();
  form_round(change);
}

void ElasticAgent::Impl::start_workers(int k) {
  auto specs = worker_specs(k);
  {
    std::lock_guard<std::mutex> lock(phase_mutex_);
    workers_running_ = true;
  }
  std::vector<pid_t> pids;
  timer_workers_->starting();
  try {
    pids = launcher_.start(specs);
  } catch (const IoError& e) {
    timer_workers_->set_workers({});
    // The others must not wait for workers that never start.
    FailureRecord f;
    f.rank = base_rank_;
    f.node_rank = info_.group_rank;
    f.host = host_;
    f.exit_code = 127;
    f.message = e.what();
    f.attempt = k;
    info_.store->compare_set(keys::failure(k), "", f.to_json());
    stop_workers(SIGKILL, k);
    throw JobEnd{kUsage, e.what()};
  }
  std::string list;
  for (size_t i = 0; i < pids.size(); ++i) list += (i ? " " : "") + std::to_string(pids[i]);
  pids_ = pids;
  if (hang_) {
    std::vector<WatchedWorker> watched;
    for (size_t i = 0; i < pids.size(); ++i) {
      const auto& s = specs[i];
      std::vector<std::string> files;
      if (s.tee & worker::kStdout || s.redirects & worker::kStdout) files.push_back(s.stdout_path);
      if (s.tee & worker::kStderr || s.redirects & worker::kStderr) files.push_back(s.stderr_path);
      watched.push_back({base_rank_ + s.local_rank, s.local_rank, pids[i], files});
    }
    std::vector<std::string> hosts;
    for (const auto& n : info_.nodes) hosts.push_back(n.host);
    hang_->watch(k, std::move(watched), std::move(hosts));
  }
  log_->info("attempt {}: started {} workers (ranks {}-{}), pids {}", k, pids.size(), base_rank_,
             base_rank_ + c_.nproc_per_node - 1, list);
  events_.emit("workers_started", k, {{"pids", pids}, {"first_rank", base_rank_}});
  timer_workers_->set_workers(pids);
  health_->set_attempt(k);
  set_phase(AgentPhase::kRunning);
  if (job_) job_->workers_started(k, base_rank_, pids);
}

ElasticAgent::Impl::AttemptOutcome ElasticAgent::Impl::run_attempt(int k) {
  if (k != started_attempt_) {
    started_attempt_ = k;
    first_round_of_attempt_ = info_.round;
  }
  monitor_->watch_attempt(k);
  start_workers(k);
  AttemptOutcome out;
  switch (watch(k, &out.local)) {
    case WatchResult::kSucceeded: {
      // No worker runs: clears leftovers, updates the phase; the hang
      // detection goes on judging the rest of the job from here.
      stop_workers(SIGTERM, k, /*finished=*/true);
      if (int sig = pending_signal_) {
        if (hang_) hang_->unwatch();
        out.kind = AttemptOutcome::kSignal;
        out.signal = sig;
        return out;
      }
      const Barrier barrier = exit_barrier(k);
      if (hang_) hang_->unwatch();
      switch (barrier) {
        case Barrier::kPassed:
          out.kind = AttemptOutcome::kSucceeded;
          return out;
        case Barrier::kReform:
          out.kind = AttemptOutcome::kReform;
          return out;
        case Barrier::kFailed:
          break;
      }
      // Another node failed while this one waited: the job's attempt failed.
      out.kind = AttemptOutcome::kFailed;
      out.root = *monitor_->failure(k);
      return out;
    }
    case WatchResult::kLocalFailure:
      out.kind = AttemptOutcome::kFailed;
      out.root = publish_failure(k, out.local);
      return out;
    case WatchResult::kRemoteFailure:
      out.kind = AttemptOutcome::kFailed;
      out.root = *monitor_->failure(k);
      return out;
    case WatchResult::kSignal:
      out.kind = AttemptOutcome::kSignal;
      out.signal = pending_signal_;
      return out;
    case WatchResult::kJobBroken:
      out.kind = AttemptOutcome::kJobBroken;
      return out;
    case WatchResult::kReform:
      out.kind = AttemptOutcome::kReform;
      return out;
  }
  CTORCHRUN_CHECK(false, "unhandled watch result");
}

std::optional<RunResult> ElasticAgent::Impl::settle(int k, const AttemptOutcome& out) {
  switch (out.kind) {
    case AttemptOutcome::kSucceeded:
      if (store_failed_) {
        log_->info("this node's workers succeeded; exiting 0");
        return finish(0, "");
      }
      log_->info("all workers of the job succeeded; exiting 0");
      try {
        if (info_.close) info_.close("succeeded");
        leave();
        leave_last();
      } catch (const InternalError&) {
        throw;
      } catch (const Error& e) {
        log_->warn("could not tell the other nodes that this one leaves ({}: {})", agents_store(),
                   e.what());
        return finish(0, "");
      }
      if (info_.tidy && info_.store_host.value_or(false)) info_.tidy();
      return finish(0, "");
    case AttemptOutcome::kSignal:
      stop_workers(out.signal, k);
      leave(true);
      return finish(signal_exit_code(c_, out.signal), signal_stop_message(c_, out.signal));
    case AttemptOutcome::kJobBroken:
      stop_workers(SIGTERM, k);
      // The cause as it stands after the workers' grace, else as watch()
      // decided it: a node declared dead that answers again meanwhile (a
      // frozen VM resumed) still ends the job, naming it, since every node
      // is stopping its workers by then. A static job cannot give a node's
      // ranks to another, so it ends (exit 3) rather than going on; an
      // elastic one re-forms instead (a membership change, not this path).
      check_job_alive("running workers");
      CTORCHRUN_CHECK(broken_cause_.has_value(), "the job ended with no cause");
      throw *broken_cause_;
    case AttemptOutcome::kReform:
      CTORCHRUN_CHECK(false, "settle() of a round that gives way");
    case AttemptOutcome::kFailed:
      break;
  }
  // A failure somewhere in the job: every node stops its workers.
  FailureRecord root = out.root;
  events_.emit("attempt_failed", k,
               {{"root_rank", root.rank}, {"root_node", root.node_rank}, {"cause", root.cause()}});
  status_attempt_failed(root, k);
  if (root.hang) root.message = report_hang(k, root);
  // This node's workers that failed on their own before the stop (with the
  // first, as torchrun's summary lists them all); those it ended are not.
  std::vector<FailureRecord> local = out.local;
  const bool here = root.node_rank == info_.group_rank;
  for (const auto& e : stop_workers(SIGTERM, k)) {
    if (e.before_stop && e.failed()) local.push_back(record_of(e, k));
    // A hang's (or a D-state verdict's) exit fields: how its worker then ended.
    if ((root.hang || root.uninterruptible) && here && e.pid == root.pid) {
      root.signaled = e.signaled;
      root.signal = e.signal;
      root.exit_code = e.exit_code;
    }
  }
  if (int sig = pending_signal_) {
    leave(true);
    return finish(signal_exit_code(c_, sig), signal_stop_message(c_, sig));
  }
  RestartBudget::Verdict verdict = budget_.on_failure();
  // As torch main's agent: a worker wedged in the kernel leaves no restart.
  if (root.uninterruptible) verdict.final = true;
  // Throws RoundGivesWay when a loss may explain the failure.
  if (verdict.await_loss) await_loss(k);
  sync_after_stop(k, verdict.final);
  if (!verdict.final) {
    const int next = budget_.on_restart();  // charged
    if (elastic()) {
      // The job's count in the store before the workers of attempt `next`
      // start: a round formed by newcomers after this one takes it, even if
      // none of this round's members is left (rendezvous/c10d_state.h).
      // Expects what this round's last restart wrote (none yet: missing).
      rendezvous::C10dState::raise_count(*info_.store, rendezvous::C10dState::kRestartsKey, next,
                                         next - 1 > info_.attempt ? next - 1 : 0);
    }
    log_->warn(
        "rank {} (local_rank {} on node {}) failed with {}; restarting the workers of every node "
        "(restart {}/{})",
        root.rank, root.local_rank, root.node_rank, root.cause(), next, budget_.max());
    events_.emit("restart", next, {{"restart", next}, {"max_restarts", budget_.max()}});
    health_->set_attempt(next);
    set_phase(AgentPhase::kRestarting);
    if (job_) {
      worker::WorkerExit as_exit;
      as_exit.signaled = root.signaled;
      as_exit.signal = root.signal;
      as_exit.exit_code = root.exit_code;
      const RestartReason reason = root.hang                            ? RestartReason::kHang
                                   : may_be_scheduler_stop(c_, as_exit) ? RestartReason::kScheduler
                                                                        : RestartReason::kFailure;
      job_->restart(reason, next,
                    "rank " + std::to_string(root.rank) + " failed with " + root.cause());
    }
    return std::nullopt;
  }
  std::string msg = "job failed after " + std::to_string(k) + "/" + std::to_string(budget_.max()) +
                    " restarts: rank " + std::to_string(root.rank) + " (local_rank " +
                    std::to_string(root.local_rank) + " on node " + std::to_string(root.node_rank) +
                    ", " + root.host + ", pid " + std::to_string(root.pid) + ") failed with " +
                    root.cause() + (here ? "" : " (summary on that node)") +
                    (logs_worth_keeping() ? "; logs in " + run_dir_ : "");
  try {
    if (info_.close) info_.close("failed");
    leave();
    // As after a success: the store host leaves last and then tidies what
    // the job kept in a store that outlives it (etcd), all but the closed
    // marker.
    leave_last();
    if (info_.tidy && info_.store_host.value_or(false)) info_.tidy();
  } catch (const InternalError&) {
    throw;
  } catch (const Error& e) {
    log_->warn("could not tell the other nodes that this one leaves ({}: {})", agents_store(),
               e.what());
  }
  RunResult r = finish(kFailed, msg);
  if (here) {
    r.failures = local.empty() || root.hang || root.uninterruptible
                     ? std::vector<FailureRecord>{root}
                     : local;
  }
  return r;
}

RunResult ElasticAgent::Impl::run() {
  host_ = c_.local_addr.empty() ? hostname() : c_.local_addr;
  if (c_.numa_binding) {
    worker::NumaPlan plan;
    try {
      worker::NumaHost host;
      host.sysfs_root = c_.sysfs_root;
      host.proc_root = c_.proc_root;
      auto value = [this](const char* name) -> std::optional<std::string> {
        auto it = c_.environment.find(name);
        if (it == c_.environment.end()) return std::nullopt;
        return it->second;
      };
      host.cuda_visible_devices = value("CUDA_VISIBLE_DEVICES");
      host.cuda_device_order = value("CUDA_DEVICE_ORDER");
      host.slurm_gpus = value("SLURM_STEP_GPUS");
      if (!host.slurm_gpus) host.slurm_gpus = value("SLURM_JOB_GPUS");
      plan = worker::plan_numa_binding(*c_.numa_binding, c_.nproc_per_node, host);
    } catch (const Error& e) {
      return finish(kUsage, e.what());
    }
    for (const auto& w : plan.warnings) log_->warn("{}", w);
    numa_cpus_ = std::move(plan.cpus);
    numa_memory_ = std::move(plan.memory);
    const std::string no_policy = worker::memory_policy_unavailable();
    if (!no_policy.empty()) {
      log_->warn("numa binding: CPUs only, no memory policy ({})", no_policy);
      numa_memory_.clear();
    }
    auto text = [](const std::vector<int>& v) {
      std::string list;
      for (int x : v) list += (list.empty() ? "" : ",") + std::to_string(x);
      return list;
    };
    for (size_t lr = 0; lr < numa_cpus_.size(); ++lr) {
      if (numa_cpus_[lr].empty()) {
        log_->info("numa binding: local rank {} unbound", lr);
        continue;
      }
      log_->info("numa binding: local rank {} on CPUs {}{}", lr, text(numa_cpus_[lr]),
                 lr < numa_memory_.size() && !numa_memory_[lr].empty()
                     ? ", memory of node " + text(numa_memory_[lr]) + " preferred"
                     : "");
    }
  }
  if (!c_.python.empty()) {
    ctorch_dir_ = worker::ctorch_package_dir("/proc/self/exe").value_or("");
    ctorch_site_dir_ = cpu_backend_site_dir(c_.cpu_backend, ctorch_dir_, log_);
    // Which NCCL variable the workers' torch reads: learned while the
    // rendezvous runs, so that it costs a job no time.
    torch_probe_ = std::async(std::launch::async, [python = c_.python, env = c_.environment] {
      return worker::installed_torch_version(python, env, std::chrono::seconds(5));
    });
  }
  if (c_.rdzv_backend == "c10d") {
    log_->info(
        "starting rdzv_backend=c10d rdzv_endpoint={} nnodes={}:{} nproc_per_node={} run_id={} "
        "max_restarts={} entrypoint={}",
        rendezvous::format_endpoint(c_.rdzv_endpoint_host, c_.rdzv_endpoint_port), c_.min_nodes,
        c_.max_nodes, c_.nproc_per_node, c_.run_id, c_.max_restarts, c_.entrypoint_name);
  } else if (c_.rdzv_backend == "etcd-v3") {
    std::string list;
    for (const auto& e : c_.etcd_endpoints)
      list += (list.empty() ? "" : ",") + std::string(c_.etcd_tls ? "https://" : "") + e;
    log_->info(
        "starting rdzv_backend=etcd-v3 etcd={} etcd_prefix={} nnodes={}:{} nproc_per_node={} "
        "run_id={} max_restarts={} entrypoint={}",
        list, c_.etcd_prefix, c_.min_nodes, c_.max_nodes, c_.nproc_per_node, c_.run_id,
        c_.max_restarts, c_.entrypoint_name);
  } else {
    log_->info(
        "starting node_rank={} nnodes={} nproc_per_node={} master={}:{} run_id={} max_restarts={} "
        "entrypoint={}",
        c_.node_rank, c_.nnodes(), c_.nproc_per_node, c_.master_addr,
        c_.master_port == 0 ? std::string("<free port>") : std::to_string(c_.master_port),
        c_.run_id, c_.max_restarts, c_.entrypoint_name);
  }
  try {
    start_torch_agent_features();
  } catch (const ConfigError& e) {
    return finish(kUsage, e.what());
  }
  // The boundary of the agent: failures of the world become a RunResult, a
  // bug of ours an InternalError for main (exit 70); no worker outlives either.
  try {
    form_round(std::nullopt);
    for (;;) {
      try {
        AttemptOutcome out = run_attempt(attempt());
        if (out.kind == AttemptOutcome::kReform) {
          CTORCHRUN_CHECK(change_.has_value(), "a round gives way without a change");
          // The workers ran: a re-formation charges nothing.
          const auto r = budget_.on_round_gives_way(*change_, {});
          CTORCHRUN_CHECK(r == RestartBudget::GiveWay::kReform, "a re-formation charged a failure");
          give_way(*change_);
          continue;
        }
        if (auto result = settle(attempt(), out)) return *result;
      } catch (const RoundGivesWay& g) {
        // Between the attempts of a failure: charged, or refunded when a loss
        // explains it (agent/restart_budget.h).
        if (budget_.on_round_gives_way(g.change, g.stopped) == RestartBudget::GiveWay::kRefunded) {
          log_->info("the failure of attempt {} is not charged: {}", attempt(), g.change.reason);
        }
        give_way(g.change);
      }
    }
  } catch (const JobEnd& end) {
    if (launcher_.running() > 0) stop_workers(SIGTERM, attempt());
    leave();
    return finish(end.exit_code, end.message);
  } catch (const InternalError&) {
    stop_workers(SIGKILL, attempt());
    throw;
  } catch (const ProtocolError& e) {
    if (launcher_.running() > 0) stop_workers(SIGTERM, attempt());
    leave();
    return finish(kRendezvous, "protocol error in " + agents_store() + ": " + e.what());
  } catch (const Error& e) {
    // The store failed under the main loop's feet.
    if (launcher_.running() > 0) stop_workers(SIGTERM, attempt());
    return finish(kRendezvous, "lost " + agents_store() + ": " + e.what());
  } catch (const std::exception& e) {
    stop_workers(SIGKILL, attempt());
    throw InternalError(std::string("agent: ") + e.what());
  }
}

void ElasticAgent::Impl::start_torch_agent_features() {
  health_->set_run_id(c_.run_id);
  if (auto path = file_timer_path(c_.environment)) {
    FileTimerOptions o;
    o.path = *path;
    o.on_expired = [&events = events_, health = health_, workers = timer_workers_](
                       const FileTimerTable::Expired& e, bool killed) {
      events.emit("file_timer_expired", health->attempt(),
                  {{"pid", e.pid},
                   {"local_rank", workers->local_rank_of(e.pid)},
                   {"scopes", e.scopes},
                   {"signal", e.signal > 0 ? signal_name(e.signal) : std::string()},
                   {"killed", killed}});
    };
    file_timer_ = std::make_shared<FileTimerServer>(std::move(o), timer_workers_);
    log_->info("file timer: serving torch's FileTimerClient on {} ({}=1)", file_timer_->path(),
               kEnableFileTimerEnv);
    health_->set_file_timer(file_timer_->path(),
                            [server = std::weak_ptr<FileTimerServer>(file_timer_)] {
                              auto s = server.lock();
                              return s ? s->stats() : FileTimerStats{};
                            });
  }
  std::string error;
  const std::optional<int> health_port = health_check_port(c_.environment, &error);
  if (!error.empty()) log_->warn("{}; the job runs without a health check", error);
  start_status(health_port);
}

// One server per port asked for (TORCHELASTIC_HEALTH_CHECK_PORT, --status_port;
// one when they are the same), each answering every endpoint.
void ElasticAgent::Impl::start_status(std::optional<int> health_port) {
  if (!health_port && !c_.status_port) return;
  JobStatusOptions o;
  o.run_id = c_.run_id;
  o.rdzv_backend = c_.rdzv_backend;
  o.host = host_;
  o.max_restarts = c_.max_restarts;
  o.hang_timeout_s = static_cast<double>(c_.hang_timeout.count()) / 1000.0;
  job_ = std::make_shared<JobStatus>(std::move(o));
  if (health_port) health_server_ = serve(*health_port, "health check");
  if (c_.status_port && (!health_port || *c_.status_port != *health_port || *health_port == 0)) {
    status_server_ = serve(*c_.status_port, "status endpoint");
  }
  status_sampler_ =
      std::make_unique<StatusSampler>(job_, [&rdzv = rdzv_] { return rdzv.hosted_stores(); });
}

std::unique_ptr<HealthServer> ElasticAgent::Impl::serve(int port, const char* what) {
  HealthServerOptions o;
  o.host = c_.status_host;
  o.port = port;
  try {
    auto server = std::make_unique<HealthServer>(o, health_, job_);
    const std::string where = o.host + ":" + std::to_string(server->port());
    log_->info("{} listening on {} (GET /, /status, /metrics, /healthz, /readyz)", what, where);
    return server;
  } catch (const Error& e) {
    // As torch's agent, whose health check never stops a job: the job runs
    // on, and whoever polls the port sees no answer.
    log_->warn("{}; the job runs without a {}", e.what(), what);
    return nullptr;
  }
}

void ElasticAgent::Impl::status_attempt_failed(const FailureRecord& root, int k) {
  if (!job_) return;
  StatusFailure f;
  f.time = static_cast<double>(root.timestamp);
  f.attempt = k;
  f.rank = root.rank;
  f.node = root.node_rank;
  f.host = root.host;
  f.cause = root.cause();
  // When the failure happened: its node noticed the exit then (a hang: when
  // the first rank stalled, which is no detection latency; now instead).
  auto at = std::chrono::system_clock::now();
  if (!root.hang && root.noticed_ns > 0) {
    at = std::chrono::system_clock::time_point(
        std::chrono::duration_cast<std::chrono::system_clock::duration>(
            std::chrono::nanoseconds(root.noticed_ns)));
  }
  job_->attempt_failed(f, at, root.hang);
}

// ---------------------------------------------------------------------------

ElasticAgent::ElasticAgent(const LaunchConfig& config, rendezvous::Handler& rendezvous,
                           worker::Launcher& launcher, EventLog& events)
    : impl_(std::make_unique<Impl>(config, rendezvous, launcher, events)) {}

ElasticAgent::~ElasticAgent() {
  std::lock_guard<std::mutex> lock(g_relay_mutex);
  if (g_relay == this) g_relay = nullptr;
}

RunResult ElasticAgent::run() { return impl_->run(); }

void ElasticAgent::on_signal(int sig) { impl_->on_signal(sig); }

RunResult run(const LaunchConfig& config) {
  std::unique_ptr<EventLog> events;
  try {
    events = std::make_unique<EventLog>(config.events_file, config.run_id, config.node_rank,
                                        config.events_to_console);
  } catch (const ConfigError& e) {
    return RunResult{kUsage, e.what(), {}, "", {}};
  }
  // The job's settings, the same for either rendezvous.
  rendezvous::JobSettings job;
  job.run_id = config.run_id;
  job.min_nodes = config.min_nodes;
  job.max_nodes = config.max_nodes;
  job.max_restarts = config.max_restarts;
  job.entrypoint = config.entrypoint_name;
  job.local_world_size = config.nproc_per_node;
  job.host = config.local_addr.empty() ? hostname() : config.local_addr;
  // The hosted stores' limits from --rdzv_conf store_*; unset keeps the store's defaults.
  auto& limits = job.server.limits;
  limits.max_key_bytes = config.store_max_key_bytes.value_or(limits.max_key_bytes);
  limits.max_value_bytes = config.store_max_value_bytes.value_or(limits.max_value_bytes);
  limits.max_keys_per_op = config.store_max_keys_per_op.value_or(limits.max_keys_per_op);
  limits.max_request_bytes = config.store_max_request_bytes.value_or(limits.max_request_bytes);
  job.server.max_connections = config.store_max_connections.value_or(job.server.max_connections);
  std::unique_ptr<rendezvous::Handler> rdzv;
  if (config.rdzv_backend == "c10d" || config.rdzv_backend == "etcd-v3") {
    rendezvous::C10dOptions co;
    co.job = job;
    co.endpoint_host = config.rdzv_endpoint_host;
    co.endpoint_port = config.rdzv_endpoint_port;
    co.advertise_addr = config.local_addr;
    co.is_host = config.is_host;
    co.join_timeout = config.join_timeout;
    co.last_call_timeout = config.last_call_timeout;
    co.read_timeout = config.read_timeout;
    co.close_timeout = config.close_timeout;
    co.etcd_endpoints = config.etcd_endpoints;
    co.etcd_prefix = config.etcd_prefix;
    co.etcd_tls.enabled = config.etcd_tls;
    co.etcd_tls.ca_file = config.etcd_cacert;
    co.etcd_tls.cert_file = config.etcd_cert;
    co.etcd_tls.key_file = config.etcd_key;
    co.presence_ttl = config.node_timeout;
    co.monitor_timeout =
        std::clamp(config.node_timeout / config.keep_alive_max_attempt,
                   std::chrono::milliseconds(500), std::chrono::milliseconds(3'000));
    rdzv = std::make_unique<rendezvous::C10dHandler>(co);
  } else {
    rendezvous::StaticOptions so;
    so.job = job;
    so.master_addr = config.master_addr;
    so.master_port = config.master_port;
    so.node_rank = config.node_rank;
    so.timeout = config.rdzv_timeout;
    rdzv = std::make_unique<rendezvous::StaticHandler>(so);
  }
  auto launcher = worker::make_process_launcher();
  ElasticAgent agent(config, *rdzv, *launcher, *events);
  set_signal_relay(&agent);  // cleared by ~ElasticAgent on every path
  return agent.run();
}

}  // namespace ctorchrun::agent
