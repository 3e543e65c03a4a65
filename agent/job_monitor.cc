#include "agent/job_monitor.h"

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>

#include "agent/protocol.h"
#include "common/error.h"
#include "common/json_text.h"
#include "common/log.h"
#include "store/store.h"

namespace ctorchrun::agent {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

JobMonitor::JobMonitor(std::function<std::shared_ptr<store::Store>()> connect,
                       MonitorOptions options, std::function<void()> notify)
    : state_(std::make_shared<State>()) {
  CTORCHRUN_CHECK(options.keep_alive_interval.count() > 0 && options.keep_alive_max_attempt > 0,
                  "keep-alive settings must be positive");
  state_->connect = std::move(connect);
  state_->options = std::move(options);
  state_->notify = std::move(notify);
  if (!state_->options.alone) thread_ = std::thread(run_loop, state_);
}

JobMonitor::~JobMonitor() {
  std::shared_ptr<store::Store> conn;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stop = true;
    conn = state_->conn;
  }
  state_->stop_cv.notify_all();
  // Every job's exit passes here: the thread's wait on the failure key ends
  // now, not at its slice's end. Bounded anyway: each store call of the
  // thread has a timeout of a few seconds.
  if (conn) conn->interrupt();
  if (thread_.joinable()) thread_.join();
}

void JobMonitor::watch_attempt(int attempt) { state_->attempt = attempt; }

std::optional<FailureRecord> JobMonitor::failure(int attempt) const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  for (const auto& [k, f] : state_->failures) {
    if (k == attempt) return f;
  }
  return std::nullopt;
}

std::string JobMonitor::store_error() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->store_error;
}

std::optional<std::string> JobMonitor::protocol_error() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->protocol_error;
}

std::optional<std::string> JobMonitor::internal_error() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->internal_error;
}

std::vector<int> JobMonitor::dead_nodes() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->dead;
}

std::vector<int> JobMonitor::departed_nodes() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->gone;
}

bool JobMonitor::liveness_known() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->known_at &&
         state_->options.now() - *state_->known_at < state_->options.liveness_window();
}

std::optional<rendezvous::MembershipChange> JobMonitor::membership_change() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->membership_change;
}

// The thread's boundary: nothing escapes it. What it cannot handle ends the
// monitor and is reported to the agent.
void JobMonitor::run_loop(const std::shared_ptr<State>& st) {
  auto fail = [&](std::optional<std::string> State::*slot, const std::string& what) {
    std::lock_guard<std::mutex> lock(st->mutex);
    if (st->stop) return;
    (*st).*slot = what;
    st->notify();
  };
  try {
    loop(st);
  } catch (const ProtocolError& e) {
    fail(&State::protocol_error, e.what());
  } catch (const std::exception& e) {
    fail(&State::internal_error, std::string("job monitor: ") + e.what());
  } catch (...) {
    fail(&State::internal_error, "job monitor: unknown exception");
  }
}

namespace {

// A list of node ranks of a job of `nnodes`, written by a peer: anything else
// is a protocol error, never an index used as it came.
std::vector<int> node_list(const nlohmann::json& j, const char* key, int nnodes) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_array()) {
    throw ProtocolError("unreadable record at key '" + keys::liveness() + "': '" + key +
                        "' is not a list");
  }
  std::vector<int> out;
  for (const auto& v : *it) {
    if (!v.is_number_integer()) {
      throw ProtocolError("unreadable record at key '" + keys::liveness() + "': '" + key +
                          "' holds a non-integer");
    }
    const auto n = v.get<int64_t>();
    if (n < 0 || n >= nnodes) {
      throw ProtocolError("unreadable record at key '" + keys::liveness() + "': '" + key +
                          "' names node " + std::to_string(n) + " of a job of " +
                          std::to_string(nnodes));
    }
    out.push_back(static_cast<int>(n));
  }
  return out;
}

}  // namespace

// One monitor thread's work between its passes: what it remembers, and one
// method per duty of a pass (heartbeat, the liveness scan or read, the
// membership check, the failure wait, a store that failed).
class JobMonitor::Pass {
 public:
  explicit Pass(const std::shared_ptr<State>& st) : st_(st), o_(st->options) {
    next_beat_ = next_scan_ = last_answer_ = next_membership_ = o_.now();
  }

  void run() {
    while (!stopped()) {
      try {
        if (!store_ && !connect()) return;
        const auto now = o_.now();
        if (now >= next_beat_) beat(now);
        if (now >= next_scan_) o_.hosts_store ? scan_as_host(now) : read_view(now);
        if (o_.membership && now >= next_membership_ && round_over(now)) return;
        if (const int k = st_->attempt; k != seen_failure_of_) {
          await_failure(k);
        } else {
          pause(o_.failure_poll);
        }
      } catch (const ProtocolError&) {
        throw;
      } catch (const InternalError&) {
        throw;
      } catch (const Error& e) {
        if (!store_failed(e)) return;
      }
    }
  }

 private:
  bool stopped() const {
    std::lock_guard<std::mutex> lock(st_->mutex);
    return st_->stop;
  }
  void pause(std::chrono::milliseconds d) const {
    std::unique_lock<std::mutex> lock(st_->mutex);
    st_->stop_cv.wait_for(lock, d, [&] { return st_->stop; });
  }
  // Runs `update` and then notify, both under the mutex, unless stopped.
  void publish(const std::function<bool()>& update) const {
    std::lock_guard<std::mutex> lock(st_->mutex);
    if (st_->stop) return;
    if (update()) st_->notify();
  }
  void take_view(std::vector<int> dead, std::vector<int> gone, Clock::time_point at) const {
    publish([&] {
      bool news = dead.size() > st_->dead.size() || gone.size() > st_->gone.size();
      st_->dead = std::move(dead);
      st_->gone = std::move(gone);
      st_->known_at = at;
      return news;
    });
  }

  // False when the monitor was stopped meanwhile.
  bool connect() {
    store_ = st_->connect();
    // A request that gets no answer within a heartbeat interval (2 s at
    // most) fails: an unreachable store shows within the liveness bound.
    store_->set_timeout(std::clamp<std::chrono::milliseconds>(o_.keep_alive_interval, 500ms, 2s));
    std::lock_guard<std::mutex> lock(st_->mutex);
    if (st_->stop) return false;
    st_->conn = store_;
    return true;
  }

  void beat(Clock::time_point now) {
    store_->add(keys::alive(o_.node), 1);
    last_answer_ = o_.now();
    next_beat_ = now + o_.keep_alive_interval;
  }

  // The host: O(N) requests, on the host alone, once per interval.
  void scan_as_host(Clock::time_point now) {
    if (store_was_out_) {
      // The host itself could not reach the store (a store that fails
      // over): nobody could beat meanwhile, so silence is counted afresh
      // from now.
      for (auto& b : beats_) b.second.second = now;
      store_was_out_ = false;
    }
    std::vector<int> dead, gone;
    for (int n = 0; n < o_.nnodes; ++n) {
      if (n == o_.node) continue;
      if (store_->check({keys::gone(n)})) {
        gone.push_back(n);
        continue;
      }
      int64_t b = store_->add(keys::alive(n), 0);
      auto it = beats_.find(n);
      if (it == beats_.end() || it->second.first != b) {
        beats_[n] = {b, now};
      } else if (now - it->second.second >= o_.liveness_window()) {
        dead.push_back(n);
      }
    }
    nlohmann::json view = {{"seq", ++seq_}, {"dead", dead}, {"gone", gone}};
    store_->set(keys::liveness(), json_text::dump_record(view));
    last_answer_ = o_.now();
    take_view(std::move(dead), std::move(gone), now);
    next_scan_ = now + o_.keep_alive_interval;
  }

  // The others: one read that never waits (the view goes with the job's keys
  // when the last node tidies them (etcd), maybe between two calls of ours).
  void read_view(Clock::time_point now) {
    bool known = false;
    if (auto view = store::read_if_present(*store_, keys::liveness())) {
      const std::string& raw = *view;
      auto j = json_text::parse_record(raw);
      if (!j.is_object() || !j.contains("seq") || !j["seq"].is_number_integer()) {
        throw ProtocolError("unreadable record at key '" + keys::liveness() +
                            "': " + json_text::utf8_prefix(raw, 200));
      }
      auto dead = node_list(j, "dead", o_.nnodes);
      auto gone = node_list(j, "gone", o_.nnodes);
      int64_t s = j["seq"].get<int64_t>();
      if (s != seen_seq_) {
        seen_seq_ = s;
        seen_seq_at_ = now;
      }
      // The view is as current as the host's last publication.
      take_view(std::move(dead), std::move(gone), seen_seq_at_);
      known = true;
      last_answer_ = o_.now();
    }
    // Until the host's first view arrives, ask at every pass.
    next_scan_ = now + (known ? o_.keep_alive_interval : o_.failure_poll);
  }

  // True when the round must give way: nothing more to watch in it, and the
  // agent that forms the next one need not wait for a store call here.
  bool round_over(Clock::time_point now) {
    next_membership_ = now + o_.membership_poll;
    auto change = o_.membership(st_->attempt);
    if (!change) return false;
    publish([&] {
      st_->membership_change = *change;
      return true;
    });
    return true;
  }

  void await_failure(int k) {
    try {
      store_->wait({keys::failure(k)}, o_.failure_poll);
      // Not a waiting get: the record may be tidied away meanwhile, and a
      // record that went is no failure.
      auto record = store::read_if_present(*store_, keys::failure(k));
      if (!record) return;
      FailureRecord f;
      try {
        f = FailureRecord::from_json(*record);
      } catch (const ProtocolError& e) {
        throw ProtocolError("unreadable record at key '" + keys::failure(k) + "': " + e.what());
      }
      seen_failure_of_ = k;
      publish([&] {
        st_->failures.emplace_back(k, f);
        return true;
      });
    } catch (const TimeoutError&) {
      // Not failed (yet).
    }
  }

  // The store failed a call: reconnect at the next pass; lost once it has
  // not answered for store_grace. False when the monitor was stopped.
  bool store_failed(const Error& e) {
    store_.reset();
    {
      std::lock_guard<std::mutex> lock(st_->mutex);
      st_->conn.reset();
      if (st_->stop) return false;  // interrupted on purpose
    }
    store_was_out_ = true;
    if (o_.now() - last_answer_ >= o_.store_grace && !st_->store_lost) {
      publish([&] {
        st_->store_error = e.what();
        st_->store_lost = true;
        return true;
      });
    }
    pause(std::min<std::chrono::milliseconds>(100ms, o_.failure_poll));
    return true;
  }

  const std::shared_ptr<State>& st_;
  const MonitorOptions& o_;
  std::shared_ptr<store::Store> store_;
  // Host: each node's last heartbeat value and when it last moved.
  std::map<int, std::pair<int64_t, Clock::time_point>> beats_;
  int64_t seq_ = 0;        // host: publications so far
  int64_t seen_seq_ = -1;  // others: the last publication read
  Clock::time_point seen_seq_at_{};
  Clock::time_point next_beat_, next_scan_, next_membership_;
  // The last answer the store gave (a heartbeat or a liveness read): the
  // store is lost once it has not answered for store_grace, however the
  // calls in between failed or blocked.
  Clock::time_point last_answer_;
  bool store_was_out_ = false;  // host: a request failed since the last scan
  int seen_failure_of_ = -1;
};

void JobMonitor::loop(const std::shared_ptr<State>& st) { Pass(st).run(); }

}  // namespace ctorchrun::agent
