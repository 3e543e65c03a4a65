#include "agent/hang_detector.h"

#include <algorithm>
#include <climits>
#include <nlohmann/json.hpp>

#include "agent/protocol.h"
#include "common/error.h"
#include "common/json_text.h"
#include "common/log.h"

namespace ctorchrun::agent {

using namespace std::chrono_literals;
using SteadyClock = std::chrono::steady_clock;

std::string NodeStall::to_json() const {
  nlohmann::json ranks_json = nlohmann::json::array();
  for (const auto& r : ranks) {
    ranks_json.push_back(
        {{"rank", r.rank}, {"local_rank", r.local_rank}, {"pid", r.pid}, {"since_ms", r.since_ms}});
  }
  return json_text::dump_record(
      nlohmann::json{{"stalled_ms", stalled_ms}, {"ranks", ranks_json}, {"finished", finished}});
}

NodeStall NodeStall::from_json(const std::string& text, int node, const std::string& key) {
  auto bad = [&](const std::string& why) {
    return ProtocolError("unreadable record at key '" + key + "': " + why + ": " +
                         json_text::utf8_prefix(text, 200));
  };
  auto j = json_text::parse_record(text);
  if (!j.is_object()) throw bad("not an object");
  auto integer = [&](const nlohmann::json& o, const char* name, int64_t lo, int64_t hi) {
    auto it = o.find(name);
    if (it == o.end() || !it->is_number_integer()) throw bad(std::string("no integer ") + name);
    const auto v = it->get<int64_t>();
    if (v < lo || v > hi) throw bad(std::string(name) + " out of range");
    return v;
  };
  NodeStall s;
  s.node = node;
  s.stalled_ms = integer(j, "stalled_ms", 0, INT64_MAX);
  if (auto f = j.find("finished"); f != j.end()) {
    if (!f->is_boolean()) throw bad("'finished' is not a boolean");
    s.finished = f->get<bool>();
  }
  auto it = j.find("ranks");
  if (it == j.end() || !it->is_array()) throw bad("'ranks' is not a list");
  for (const auto& r : *it) {
    if (!r.is_object()) throw bad("a rank is not an object");
    RankStall rs;
    rs.rank = static_cast<int>(integer(r, "rank", 0, INT32_MAX));
    rs.local_rank = static_cast<int>(integer(r, "local_rank", 0, INT32_MAX));
    rs.pid = static_cast<pid_t>(integer(r, "pid", 0, INT32_MAX));
    rs.since_ms = integer(r, "since_ms", 0, INT64_MAX);
    s.ranks.push_back(rs);
  }
  return s;
}

std::optional<FailureRecord> decide_hang(const std::vector<std::optional<NodeStall>>& nodes,
                                         std::chrono::milliseconds timeout,
                                         const std::vector<std::string>& hosts, int attempt) {
  if (nodes.empty() || timeout.count() <= 0) return std::nullopt;
  const RankStall* first = nullptr;
  int first_node = -1;
  // The ranks named are those still running, unless every node has finished.
  const bool any_running =
      std::any_of(nodes.begin(), nodes.end(), [](const auto& n) { return n && !n->finished; });
  for (size_t n = 0; n < nodes.size(); ++n) {
    // A node not heard from yet, or whose workers moved within the timeout,
    // keeps the job alive.
    if (!nodes[n] || nodes[n]->stalled_ms < timeout.count()) return std::nullopt;
    if (any_running && nodes[n]->finished) continue;
    for (const auto& r : nodes[n]->ranks) {
      if (!first || r.since_ms < first->since_ms ||
          (r.since_ms == first->since_ms && r.rank < first->rank)) {
        first = &r;
        first_node = static_cast<int>(n);
      }
    }
  }
  if (!first) return std::nullopt;  // no worker anywhere: nothing hangs
  FailureRecord f;
  f.hang = true;
  f.rank = first->rank;
  f.local_rank = first->local_rank;
  f.node_rank = first_node;
  f.host = static_cast<size_t>(first_node) < hosts.size() ? hosts[first_node] : "";
  f.pid = first->pid;
  f.timestamp = first->since_ms / 1000;
  f.noticed_ns = first->since_ms * 1'000'000;
  f.attempt = attempt;
  f.message = "hang: no worker of the job made progress for " +
              std::to_string(timeout.count() / 1000.0).substr(0, 5) + "s (--hang_timeout); rank " +
              std::to_string(f.rank) + " stalled first";
  return f;
}

struct HangDetector::State {
  std::function<std::shared_ptr<store::Store>()> connect;
  HangOptions o;
  mutable std::mutex mutex;
  std::condition_variable cv;
  bool stop = false;
  std::shared_ptr<store::Store> conn;  // interrupted by the destructor

  // Bumped by watch()/unwatch(): the thread starts its clocks afresh.
  uint64_t generation = 0;
  int attempt = -1;
  std::vector<WatchedWorker> workers;
  std::vector<std::string> hosts;
  std::optional<std::chrono::system_clock::time_point> last_progress;
  std::optional<NodeStall> verdict;
  bool finished = false;  // the watched workers all ended: no more sampling
};

HangDetector::HangDetector(std::function<std::shared_ptr<store::Store>()> connect,
                           HangOptions options)
    : state_(std::make_shared<State>()) {
  CTORCHRUN_CHECK(options.timeout.count() > 0, "a hang detector needs a timeout");
  state_->connect = std::move(connect);
  state_->o = std::move(options);
  thread_ = std::thread(loop, state_);
}

HangDetector::~HangDetector() {
  std::shared_ptr<store::Store> conn;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stop = true;
    conn = state_->conn;
  }
  state_->cv.notify_all();
  if (conn) conn->interrupt();
  thread_.join();
}

void HangDetector::watch(int attempt, std::vector<WatchedWorker> workers,
                         std::vector<std::string> hosts) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  ++state_->generation;
  state_->attempt = attempt;
  state_->workers = std::move(workers);
  state_->hosts = std::move(hosts);
  state_->verdict.reset();
  state_->finished = false;  // new workers: sampled again
  state_->cv.notify_all();
}

void HangDetector::unwatch() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  ++state_->generation;
  state_->workers.clear();
  state_->verdict.reset();
  state_->finished = false;
}

void HangDetector::finished() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->finished = true;
}

std::optional<std::chrono::system_clock::time_point> HangDetector::last_progress() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->last_progress;
}

std::optional<NodeStall> HangDetector::local_verdict() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->verdict;
}

void HangDetector::loop(const std::shared_ptr<State>& st) {
  const HangOptions& o = st->o;
  auto log = get_logger("agent");
  std::shared_ptr<store::Store> store;
  uint64_t seen_generation = 0;
  std::vector<worker::StallTracker> trackers;
  int attempt = -1;
  std::vector<WatchedWorker> workers;
  std::vector<std::string> hosts;
  SteadyClock::time_point next_publish{};
  bool published_crossing = false;
  bool decided = false;
  bool warned = false;
  bool finished = false;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(st->mutex);
      st->cv.wait_for(lock, o.sample_interval, [&] { return st->stop; });
      if (st->stop) return;
      finished = st->finished;
      if (st->generation != seen_generation) {
        seen_generation = st->generation;
        attempt = st->attempt;
        workers = st->workers;
        hosts = st->hosts;
        trackers.assign(workers.size(), worker::StallTracker{});
        // Sampled once at least, so that each stall clock has a start, even
        // when the workers finished before this thread saw them.
        finished = false;
        next_publish = o.now();
        published_crossing = false;
        decided = false;
        warned = false;
      }
    }
    if (workers.empty() || decided) continue;
    // Sampling reads /proc only: no lock held, nothing that blocks.
    const auto now = o.now();
    const auto wall = o.wall_now();
    NodeStall mine;
    mine.node = o.node;
    mine.finished = finished;
    mine.stalled_ms = INT64_MAX;
    std::optional<std::chrono::system_clock::time_point> newest;
    for (size_t i = 0; i < workers.size(); ++i) {
      const auto& w = workers[i];
      if (!finished) trackers[i].observe(o.sample(w.pid, w.output_files), now);
      const auto stalled = trackers[i].stalled_for(now);
      mine.stalled_ms = std::min<int64_t>(mine.stalled_ms, stalled.count());
      const auto since = wall - stalled;
      if (!newest || since > *newest) newest = since;
      mine.ranks.push_back(
          {w.rank, w.local_rank, w.pid,
           std::chrono::duration_cast<std::chrono::milliseconds>(since.time_since_epoch())
               .count()});
    }
    const bool crossed = mine.stalled_ms >= o.timeout.count();
    {
      std::lock_guard<std::mutex> lock(st->mutex);
      if (st->generation != seen_generation) continue;  // workers changed meanwhile
      st->last_progress = newest;
      st->verdict = mine;
    }
    try {
      if (!store) {
        store = st->connect();
        store->set_timeout(2s);
        std::lock_guard<std::mutex> lock(st->mutex);
        if (st->stop) return;
        st->conn = store;
      }
      // Once an interval, and at once when the node's verdict first reaches
      // the timeout, so that the job's verdict waits for no interval.
      if (now >= next_publish || (crossed && !published_crossing)) {
        store->set(keys::stall(attempt, o.node), mine.to_json());
        next_publish = now + o.publish_interval;
        published_crossing = published_crossing || crossed;
      }
      if (!o.decides || !crossed) continue;
      // Every node's verdict: two requests, only while this node's own
      // workers are all stalled for the timeout.
      std::vector<std::string> node_keys;
      for (int n = 0; n < o.nnodes; ++n) node_keys.push_back(keys::stall(attempt, n));
      std::vector<std::optional<NodeStall>> all(static_cast<size_t>(o.nnodes));
      all[static_cast<size_t>(o.node)] = mine;
      bool everyone = o.nnodes == 1 || store->check(node_keys);
      if (!everyone) continue;
      if (o.nnodes > 1) {
        auto values = store->multi_get(node_keys);
        for (int n = 0; n < o.nnodes; ++n) {
          if (n == o.node) continue;
          all[static_cast<size_t>(n)] = NodeStall::from_json(values[static_cast<size_t>(n)], n,
                                                             node_keys[static_cast<size_t>(n)]);
        }
      }
      if (auto verdict = decide_hang(all, o.timeout, hosts, attempt)) {
        const std::string mine_json = verdict->to_json();
        const std::string winner = store->compare_set(keys::failure(attempt), "", mine_json);
        decided = true;
        if (winner == mine_json) {
          log->warn("hang detected in attempt {}: {}", attempt, verdict->message);
        }
      }
    } catch (const ProtocolError& e) {
      // A peer's record we cannot read: no verdict from it (never a false
      // one). Said once per attempt, not at every sample.
      if (!warned) log->warn("hang detection: {}", e.what());
      warned = true;
    } catch (const Error& e) {
      // The store is the monitor's to declare lost; try again next tick.
      log->debug("hang detection: store request failed: {}", e.what());
      store.reset();
      std::lock_guard<std::mutex> lock(st->mutex);
      st->conn.reset();
      if (st->stop) return;
    }
  }
}

}  // namespace ctorchrun::agent
