#include "agent/job_status.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/config.h"
#include "common/json_text.h"
#include "common/log.h"
#include "common/procfs.h"
#include "worker/progress_sampler.h"

namespace ctorchrun::agent {

namespace {

constexpr size_t kMaxFailures = 20;
constexpr size_t kMaxHistory = 100;
constexpr std::array<RestartReason, 4> kReasons = {RestartReason::kFailure, RestartReason::kHang,
                                                   RestartReason::kMembership,
                                                   RestartReason::kScheduler};
constexpr std::array<AgentPhase, 6> kPhases = {AgentPhase::kStarting, AgentPhase::kRendezvous,
                                               AgentPhase::kRunning,  AgentPhase::kRestarting,
                                               AgentPhase::kStopping, AgentPhase::kFinished};

double seconds_of(std::chrono::system_clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

// Latencies from milliseconds to minutes.
std::vector<double> latency_bounds() {
  return {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300};
}

// A label value in the exposition format: valid UTF-8, with \, " and the
// line feed escaped.
std::string label_value(std::string_view text) {
  std::string out;
  for (char c : json_text::to_valid_utf8(json_text::utf8_prefix(text, 256))) {
    if (c == '\\' || c == '"') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

// A sample value: Prometheus' float text (integers without a point).
std::string number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    return std::to_string(static_cast<int64_t>(v));
  }
  std::ostringstream o;
  o.precision(9);
  o << v;
  return o.str();
}

void family(std::string& out, const std::string& name, const char* type, const char* help) {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

void sample(std::string& out, const std::string& name, const std::string& labels, double v) {
  out += name + (labels.empty() ? "" : "{" + labels + "}") + " " + number(v) + "\n";
}

std::string op_label(store::protocol::Op op) {
  std::string name = store::protocol::to_string(op);
  std::transform(name.begin(), name.end(), name.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return name;
}

}  // namespace

const char* reason_name(RestartReason reason) {
  switch (reason) {
    case RestartReason::kFailure:
      return "failure";
    case RestartReason::kHang:
      return "hang";
    case RestartReason::kMembership:
      return "membership";
    case RestartReason::kScheduler:
      return "scheduler";
  }
  return "failure";
}

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), buckets_(bounds_.size(), 0) {}

void Histogram::observe(double value) {
  if (std::isnan(value)) return;
  value = std::max(0.0, value);
  for (size_t i = 0; i < bounds_.size(); ++i) {
    if (value <= bounds_[i]) {
      ++buckets_[i];
      break;
    }
  }
  ++count_;
  sum_ += value;
}

std::string Histogram::render(const std::string& name, const std::string& labels) const {
  std::string out;
  const std::string sep = labels.empty() ? "" : labels + ",";
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += buckets_[i];
    sample(out, name + "_bucket", sep + "le=\"" + number(bounds_[i]) + "\"",
           static_cast<double>(cumulative));
  }
  sample(out, name + "_bucket", sep + "le=\"+Inf\"", static_cast<double>(count_));
  sample(out, name + "_sum", labels, sum_);
  sample(out, name + "_count", labels, static_cast<double>(count_));
  return out;
}

// ---------------------------------------------------------------------------

struct JobStatus::State {
  AgentPhase phase = AgentPhase::kStarting;
  double started = 0;
  int attempt = 0;
  int round = 0;
  int node_rank = -1;
  int group_world_size = 0;
  int world_size = 0;
  int first_rank = 0;
  std::array<uint64_t, kReasons.size()> restarts{};
  uint64_t worker_failures = 0;
  std::vector<StatusNode> nodes;
  std::vector<StatusRank> ranks;
  std::deque<StatusFailure> failures;
  std::deque<nlohmann::json> history;
  std::optional<double> stalled_s;
  std::vector<StoreFigures> stores;
  Histogram rendezvous{latency_bounds()};
  Histogram detection{latency_bounds()};
  Histogram recovery{latency_bounds()};
  std::optional<Clock::time_point> rendezvous_since;
  // A fault whose recovery is pending: when it happened.
  std::optional<Clock::time_point> fault_at;
};

JobStatus::JobStatus(JobStatusOptions options)
    : options_(std::move(options)), state_(std::make_unique<State>()) {
  state_->started = seconds_of(options_.now());
}

JobStatus::~JobStatus() = default;

void JobStatus::record(State& s, const std::string& event, const std::string& detail) const {
  s.history.push_back({{"time", seconds_of(options_.now())},
                       {"event", event},
                       {"attempt", s.attempt},
                       {"detail", detail}});
  while (s.history.size() > kMaxHistory) s.history.pop_front();
}

void JobStatus::set_phase(AgentPhase phase) {
  std::lock_guard<std::mutex> lock(mutex_);
  state_->phase = phase;
}

void JobStatus::rendezvous_started() {
  std::lock_guard<std::mutex> lock(mutex_);
  state_->phase = AgentPhase::kRendezvous;
  state_->rendezvous_since = options_.now();
}

void JobStatus::round_formed(int round, int attempt, int group_rank, int group_world_size,
                             std::vector<StatusNode> nodes, int world_size) {
  std::lock_guard<std::mutex> lock(mutex_);
  State& s = *state_;
  if (s.rendezvous_since) {
    s.rendezvous.observe(
        std::chrono::duration<double>(options_.now() - *s.rendezvous_since).count());
    s.rendezvous_since.reset();
  }
  // Members of the last round not in this one stay listed as lost or left.
  std::vector<StatusNode> gone;
  for (const auto& old : s.nodes) {
    const bool kept = std::any_of(nodes.begin(), nodes.end(), [&](const StatusNode& n) {
      return n.host == old.host && n.pid == old.pid;
    });
    if (!kept && old.state != "present") gone.push_back(old);
  }
  s.round = round;
  s.attempt = attempt;
  s.node_rank = group_rank;
  s.group_world_size = group_world_size;
  s.world_size = world_size;
  s.nodes = std::move(nodes);
  for (auto& g : gone) {
    g.group_rank = -1;  // no rank in this round
    s.nodes.push_back(std::move(g));
  }
  record(s, "rendezvous",
         "round " + std::to_string(round) + ": " + std::to_string(group_world_size) +
             " nodes, world size " + std::to_string(world_size));
}

void JobStatus::workers_started(int attempt, int first_rank, const std::vector<pid_t>& pids) {
  std::lock_guard<std::mutex> lock(mutex_);
  State& s = *state_;
  s.phase = AgentPhase::kRunning;
  s.attempt = attempt;
  s.first_rank = first_rank;
  s.ranks.clear();
  for (size_t i = 0; i < pids.size(); ++i) {
    StatusRank r;
    r.local_rank = static_cast<int>(i);
    r.rank = first_rank + static_cast<int>(i);
    r.pid = pids[i];
    s.ranks.push_back(r);
  }
  if (s.fault_at) {
    s.recovery.observe(std::chrono::duration<double>(options_.now() - *s.fault_at).count());
    s.fault_at.reset();
  }
  record(s, "workers_started",
         std::to_string(pids.size()) + " workers, ranks " + std::to_string(first_rank) + "-" +
             std::to_string(first_rank + static_cast<int>(pids.size()) - 1));
}

void JobStatus::worker_exited(int local_rank, bool failed) {
  std::lock_guard<std::mutex> lock(mutex_);
  State& s = *state_;
  if (failed) ++s.worker_failures;
  for (auto& r : s.ranks) {
    if (r.local_rank == local_rank && r.state == "running")
      r.state = failed ? "failed" : "succeeded";
  }
}

void JobStatus::attempt_failed(const StatusFailure& root, Clock::time_point at, bool hang) {
  std::lock_guard<std::mutex> lock(mutex_);
  State& s = *state_;
  const auto now = options_.now();
  s.detection.observe(std::max(0.0, std::chrono::duration<double>(now - at).count()));
  if (!s.fault_at) s.fault_at = std::min(at, now);
  s.failures.push_back(root);
  while (s.failures.size() > kMaxFailures) s.failures.pop_front();
  for (auto& r : s.ranks) {
    if (r.state == "running") r.state = "stopped";
  }
  record(s, hang ? "hang_detected" : "attempt_failed",
         "rank " + std::to_string(root.rank) + " (node " + std::to_string(root.node) +
             ") failed with " + root.cause);
}

void JobStatus::restart(RestartReason reason, int next_attempt, const std::string& detail) {
  std::lock_guard<std::mutex> lock(mutex_);
  State& s = *state_;
  ++s.restarts[static_cast<size_t>(reason)];
  s.phase = AgentPhase::kRestarting;
  s.attempt = next_attempt;
  for (auto& r : s.ranks) {
    if (r.state == "running") r.state = "stopped";
  }
  record(s, "restart", std::string(reason_name(reason)) + ": " + detail);
  s.history.back()["reason"] = reason_name(reason);
}

void JobStatus::node_lost(int group_rank, const std::string& cause, bool left) {
  std::lock_guard<std::mutex> lock(mutex_);
  State& s = *state_;
  std::string host;
  for (auto& n : s.nodes) {
    if (n.group_rank == group_rank) {
      n.state = left ? "left" : "lost";
      host = n.host;
    }
  }
  if (!left && !s.fault_at) s.fault_at = options_.now();
  record(s, "node_lost",
         "node " + std::to_string(group_rank) + (host.empty() ? "" : " (" + host + ")") + " " +
             (left ? "left" : "lost") + (cause.empty() ? "" : ": " + cause));
}

void JobStatus::hang_detected(int first_stalled_rank) {
  std::lock_guard<std::mutex> lock(mutex_);
  record(*state_, "hang_detected", "rank " + std::to_string(first_stalled_rank) + " stalled first");
}

void JobStatus::finished(int exit_code) {
  std::lock_guard<std::mutex> lock(mutex_);
  State& s = *state_;
  s.phase = AgentPhase::kFinished;
  record(s, "finished", "exit code " + std::to_string(exit_code));
}

void JobStatus::set_samples(std::vector<StatusRank> ranks) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& r : state_->ranks) {
    for (const auto& sampled : ranks) {
      if (sampled.pid != r.pid) continue;
      r.cpu_s = sampled.cpu_s;
      r.rss_bytes = sampled.rss_bytes;
      r.last_progress = sampled.last_progress;
      r.stalled_s = sampled.stalled_s;
    }
  }
}

void JobStatus::set_stores(std::vector<StoreFigures> stores) {
  std::lock_guard<std::mutex> lock(mutex_);
  state_->stores = std::move(stores);
}

void JobStatus::set_stalled(std::optional<double> stalled_s) {
  std::lock_guard<std::mutex> lock(mutex_);
  state_->stalled_s = stalled_s;
}

std::vector<pid_t> JobStatus::pids() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<pid_t> out;
  for (const auto& r : state_->ranks) {
    if (r.state == "running") out.push_back(r.pid);
  }
  return out;
}

// ---------------------------------------------------------------------------
// GET /status

namespace {

nlohmann::json optional_number(const std::optional<double>& v) {
  return v ? nlohmann::json(*v) : nlohmann::json();
}

nlohmann::json nodes_json(const std::vector<StatusNode>& nodes) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& n : nodes) {
    out.push_back({{"group_rank", n.group_rank},
                   {"host", n.host},
                   {"state", n.state},
                   {"local_world_size", n.local_world_size},
                   {"first_rank", n.first_rank},
                   {"pid", n.pid}});
  }
  return out;
}

nlohmann::json ranks_json(const std::vector<StatusRank>& ranks) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& r : ranks) {
    out.push_back({{"local_rank", r.local_rank},
                   {"rank", r.rank},
                   {"pid", r.pid},
                   {"state", r.state},
                   {"last_progress", optional_number(r.last_progress)},
                   {"stalled_s", optional_number(r.stalled_s)},
                   {"cpu_s", r.cpu_s},
                   {"rss_bytes", r.rss_bytes}});
  }
  return out;
}

nlohmann::json store_json(const StoreFigures* store) {
  if (!store) return nullptr;
  nlohmann::json requests = nlohmann::json::object();
  for (size_t i = 0; i < store::protocol::kOpCount; ++i) {
    if (store->stats.requests_by_op[i] == 0) continue;
    requests[op_label(static_cast<store::protocol::Op>(i))] = store->stats.requests_by_op[i];
  }
  return {{"role", store->role},
          {"connections", store->stats.open_connections},
          {"keys", store->stats.keys},
          {"requests", requests}};
}

}  // namespace

std::string JobStatus::status_json() const {
  std::unique_lock<std::mutex> lock(mutex_);
  const State s = *state_;  // a copy: rendered outside the lock
  lock.unlock();
  nlohmann::json j = {{"version", CTORCHRUN_VERSION},
                      {"time", seconds_of(options_.now())},
                      {"run_id", options_.run_id},
                      {"node_rank", s.node_rank},
                      {"host", options_.host},
                      {"rdzv_backend", options_.rdzv_backend},
                      {"state", phase_name(s.phase)},
                      {"attempt", s.attempt},
                      {"round", s.round},
                      {"max_restarts", options_.max_restarts},
                      {"world_size", s.world_size},
                      {"started", s.started},
                      {"worker_failures", s.worker_failures}};
  for (RestartReason r : kReasons) {
    j["restarts"][reason_name(r)] = s.restarts[static_cast<size_t>(r)];
  }
  j["nodes"] = nodes_json(s.nodes);
  j["ranks"] = ranks_json(s.ranks);
  j["failures"] = nlohmann::json::array();
  for (const auto& f : s.failures) {
    j["failures"].push_back({{"time", f.time},
                             {"attempt", f.attempt},
                             {"rank", f.rank},
                             {"node", f.node},
                             {"host", f.host},
                             {"cause", f.cause}});
  }
  j["history"] = nlohmann::json(s.history);
  j["hang"] = {{"enabled", options_.hang_timeout_s > 0},
               {"timeout_s", options_.hang_timeout_s},
               {"stalled_s", optional_number(s.stalled_s)}};
  j["store"] = store_json(s.stores.empty() ? nullptr : &s.stores.front());
  j["stores"] = nlohmann::json::array();
  for (const auto& st : s.stores) j["stores"].push_back(store_json(&st));
  return json_text::dump_for_people(j);
}

// ---------------------------------------------------------------------------
// GET /metrics

namespace {

void agent_metrics(std::string& out, const JobStatusOptions& o, const JobStatus::Clock::time_point&,
                   int node_rank, AgentPhase phase, int attempt, int round) {
  family(out, "ctorchrun_info", "gauge", "The agent: its version and job, always 1.");
  sample(out, "ctorchrun_info",
         "version=\"" CTORCHRUN_VERSION "\",run_id=\"" + label_value(o.run_id) + "\",node_rank=\"" +
             std::to_string(node_rank) + "\",rdzv_backend=\"" + label_value(o.rdzv_backend) + "\"",
         1);
  family(out, "ctorchrun_agent_state", "gauge", "The agent's phase: 1 for the one it is in.");
  for (AgentPhase p : kPhases) {
    sample(out, "ctorchrun_agent_state", std::string("state=\"") + phase_name(p) + "\"",
           p == phase ? 1 : 0);
  }
  family(out, "ctorchrun_attempt", "gauge", "The job's restarts so far (the attempt running).");
  sample(out, "ctorchrun_attempt", "", attempt);
  family(out, "ctorchrun_round", "gauge",
         "The rendezvous round the node is in (elastic backends).");
  sample(out, "ctorchrun_round", "", round);
  family(out, "ctorchrun_max_restarts", "gauge", "The job's --max_restarts.");
  sample(out, "ctorchrun_max_restarts", "", o.max_restarts);
}

void count_metrics(std::string& out, const std::array<uint64_t, kReasons.size()>& restarts,
                   uint64_t failures, const std::vector<StatusRank>& ranks,
                   const std::vector<StatusNode>& nodes) {
  family(out, "ctorchrun_restarts_total", "counter",
         "Times every worker of the job was restarted, by reason.");
  for (RestartReason r : kReasons) {
    sample(out, "ctorchrun_restarts_total", std::string("reason=\"") + reason_name(r) + "\"",
           static_cast<double>(restarts[static_cast<size_t>(r)]));
  }
  family(out, "ctorchrun_worker_failures_total", "counter",
         "This node's workers that failed (exited non-zero or by a signal) on their own.");
  sample(out, "ctorchrun_worker_failures_total", "", static_cast<double>(failures));
  family(out, "ctorchrun_workers", "gauge", "This node's workers of the attempt, by state.");
  for (const char* st : {"running", "succeeded", "failed", "stopped"}) {
    sample(out, "ctorchrun_workers", std::string("state=\"") + st + "\"",
           static_cast<double>(std::count_if(ranks.begin(), ranks.end(),
                                             [&](const StatusRank& r) { return r.state == st; })));
  }
  family(out, "ctorchrun_nodes", "gauge", "The job's nodes as this agent sees them, by state.");
  for (const char* st : {"present", "lost", "left"}) {
    sample(out, "ctorchrun_nodes", std::string("state=\"") + st + "\"",
           static_cast<double>(std::count_if(nodes.begin(), nodes.end(),
                                             [&](const StatusNode& n) { return n.state == st; })));
  }
}

void rank_metrics(std::string& out, const std::vector<StatusRank>& ranks) {
  auto labels = [](const StatusRank& r) {
    return "local_rank=\"" + std::to_string(r.local_rank) + "\",rank=\"" + std::to_string(r.rank) +
           "\"";
  };
  family(out, "ctorchrun_worker_rank", "gauge", "Each local rank's global rank.");
  for (const auto& r : ranks) {
    sample(out, "ctorchrun_worker_rank", "local_rank=\"" + std::to_string(r.local_rank) + "\"",
           r.rank);
  }
  family(out, "ctorchrun_worker_cpu_seconds_total", "counter",
         "CPU time of each worker process (user and system).");
  for (const auto& r : ranks) sample(out, "ctorchrun_worker_cpu_seconds_total", labels(r), r.cpu_s);
  family(out, "ctorchrun_worker_resident_memory_bytes", "gauge",
         "Resident memory of each worker process.");
  for (const auto& r : ranks) {
    sample(out, "ctorchrun_worker_resident_memory_bytes", labels(r),
           static_cast<double>(r.rss_bytes));
  }
  family(out, "ctorchrun_worker_seconds_since_progress", "gauge",
         "Seconds since each worker last made progress, as the hang detector's sampler reads it.");
  for (const auto& r : ranks) {
    if (r.stalled_s)
      sample(out, "ctorchrun_worker_seconds_since_progress", labels(r), *r.stalled_s);
  }
}

void store_metrics(std::string& out, const std::vector<StoreFigures>& stores) {
  if (stores.empty()) return;
  auto role = [](const StoreFigures& s) { return "role=\"" + label_value(s.role) + "\""; };
  family(out, "ctorchrun_store_connections", "gauge",
         "Open connections to a store this node hosts.");
  for (const auto& s : stores) {
    sample(out, "ctorchrun_store_connections", role(s),
           static_cast<double>(s.stats.open_connections));
  }
  family(out, "ctorchrun_store_keys", "gauge", "Keys in a store this node hosts.");
  for (const auto& s : stores) {
    sample(out, "ctorchrun_store_keys", role(s), static_cast<double>(s.stats.keys));
  }
  family(out, "ctorchrun_store_requests_total", "counter",
         "Requests a store this node hosts served, by operation.");
  for (const auto& s : stores) {
    for (size_t i = 0; i < store::protocol::kOpCount; ++i) {
      sample(out, "ctorchrun_store_requests_total",
             role(s) + ",op=\"" + op_label(static_cast<store::protocol::Op>(i)) + "\"",
             static_cast<double>(s.stats.requests_by_op[i]));
    }
  }
}

}  // namespace

std::string JobStatus::metrics_text() const {
  std::unique_lock<std::mutex> lock(mutex_);
  const State s = *state_;
  lock.unlock();
  std::string out;
  agent_metrics(out, options_, options_.now(), s.node_rank, s.phase, s.attempt, s.round);
  count_metrics(out, s.restarts, s.worker_failures, s.ranks, s.nodes);
  family(out, "ctorchrun_rendezvous_duration_seconds", "histogram",
         "How long each rendezvous round took to form, from this node's joining.");
  out += s.rendezvous.render("ctorchrun_rendezvous_duration_seconds", "");
  family(out, "ctorchrun_fault_detection_latency_seconds", "histogram",
         "From a failure (a worker's exit, wherever it was) to this agent knowing of it.");
  out += s.detection.render("ctorchrun_fault_detection_latency_seconds", "");
  family(out, "ctorchrun_restart_latency_seconds", "histogram",
         "From a worker's exit or a node's loss to this node's replacement workers running.");
  out += s.recovery.render("ctorchrun_restart_latency_seconds", "");
  rank_metrics(out, s.ranks);
  store_metrics(out, s.stores);
  return out;
}

// ---------------------------------------------------------------------------
// StatusSampler

StatusSampler::StatusSampler(std::shared_ptr<JobStatus> status,
                             std::function<std::vector<StoreFigures>()> store_figures,
                             std::chrono::milliseconds interval, std::string proc_root)
    : status_(std::move(status)),
      store_figures_(std::move(store_figures)),
      interval_(interval),
      proc_root_(std::move(proc_root)) {
  thread_ = std::thread([this] { loop(); });
}

StatusSampler::~StatusSampler() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

namespace {

// Resident set of `pid` in bytes (statm's second field), 0 when unreadable.
int64_t rss_bytes(pid_t pid, const std::string& proc_root) {
  std::ifstream in(proc_root + "/" + std::to_string(pid) + "/statm");
  int64_t size = 0, resident = 0;
  if (!(in >> size >> resident)) return 0;
  return resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

struct Tracked {
  worker::StallTracker tracker;
  std::chrono::system_clock::time_point wall;  // wall clock of the last progress
};

}  // namespace

void StatusSampler::loop() {
  const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
  std::map<pid_t, Tracked> tracked;
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    lock.unlock();
    try {
      std::vector<StatusRank> ranks;
      std::map<pid_t, Tracked> next;
      const auto now = worker::StallTracker::Clock::now();
      const auto wall = std::chrono::system_clock::now();
      std::optional<double> all_stalled;
      for (pid_t pid : status_->pids()) {
        Tracked& t = next[pid] = tracked[pid];
        if (t.tracker.observe(worker::sample_progress(pid, {}, proc_root_), now)) t.wall = wall;
        StatusRank r;
        r.pid = pid;
        if (auto st = procfs::read_stat(pid, proc_root_)) {
          r.cpu_s = static_cast<double>(st->utime + st->stime) / tick;
        }
        r.rss_bytes = rss_bytes(pid, proc_root_);
        r.last_progress = seconds_of(t.wall);
        r.stalled_s = std::chrono::duration<double>(now - t.tracker.last_progress()).count();
        all_stalled = std::min(all_stalled.value_or(*r.stalled_s), *r.stalled_s);
        ranks.push_back(r);
      }
      tracked = std::move(next);
      status_->set_samples(std::move(ranks));
      status_->set_stalled(all_stalled);
      if (store_figures_) status_->set_stores(store_figures_());
    } catch (const std::exception& e) {
      // The thread's boundary: a sample lost, the next one tries again.
      get_logger("agent")->debug("status sampler: {}", e.what());
    }
    lock.lock();
    cv_.wait_for(lock, interval_, [this] { return stop_; });
  }
}

}  // namespace ctorchrun::agent
