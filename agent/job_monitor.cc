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

void JobMonitor::loop(const std::shared_ptr<State>& st) {
  const MonitorOptions& o = st->options;
  std::shared_ptr<store::Store> store;
  // Host: each node's last heartbeat value and when it last moved.
  std::map<int, std::pair<int64_t, Clock::time_point>> beats;
  int64_t seq = 0;        // host: publications so far
  int64_t seen_seq = -1;  // others: the last publication read
  Clock::time_point seen_seq_at{};
  auto next_beat = o.now();
  auto next_scan = o.now();
  // The last answer the store gave (a heartbeat or a liveness read): the
  // store is lost once it has not answered for store_grace, however the
  // calls in between failed or blocked.
  auto last_answer = o.now();
  bool store_was_out = false;  // host: a request failed since the last scan
  int seen_failure_of = -1;
  auto next_membership = o.now();
  auto stopped = [&] {
    std::lock_guard<std::mutex> lock(st->mutex);
    return st->stop;
  };
  auto pause = [&](std::chrono::milliseconds d) {
    std::unique_lock<std::mutex> lock(st->mutex);
    st->stop_cv.wait_for(lock, d, [&] { return st->stop; });
  };
  // Runs `update` and then notify, both under the mutex, unless stopped.
  auto publish = [&](const std::function<bool()>& update) {
    std::lock_guard<std::mutex> lock(st->mutex);
    if (st->stop) return;
    if (update()) st->notify();
  };
  auto take_view = [&](std::vector<int> dead, std::vector<int> gone, Clock::time_point at) {
    publish([&] {
      bool news = dead.size() > st->dead.size() || gone.size() > st->gone.size();
      st->dead = std::move(dead);
      st->gone = std::move(gone);
      st->known_at = at;
      return news;
    });
  };

  while (!stopped()) {
    try {
      if (!store) {
        store = st->connect();
        // A request that gets no answer within a heartbeat interval (2 s at
        // most) fails: an unreachable store shows within the liveness bound.
        store->set_timeout(std::clamp<std::chrono::milliseconds>(o.keep_alive_interval, 500ms, 2s));
        std::lock_guard<std::mutex> lock(st->mutex);
        if (st->stop) return;
        st->conn = store;
      }
      auto now = o.now();
      if (now >= next_beat) {
        store->add(keys::alive(o.node), 1);
        last_answer = o.now();
        next_beat = now + o.keep_alive_interval;
      }
      if (now >= next_scan) {
        if (o.hosts_store) {
          // O(N) requests, on the host alone, once per interval.
          if (store_was_out) {
            // The host itself could not reach the store (a store that fails
            // over): nobody could beat meanwhile, so silence is counted
            // afresh from now.
            for (auto& b : beats) b.second.second = now;
            store_was_out = false;
          }
          std::vector<int> dead, gone;
          for (int n = 0; n < o.nnodes; ++n) {
            if (n == o.node) continue;
            if (store->check({keys::gone(n)})) {
              gone.push_back(n);
              continue;
            }
            int64_t b = store->add(keys::alive(n), 0);
            auto it = beats.find(n);
            if (it == beats.end() || it->second.first != b) {
              beats[n] = {b, now};
            } else if (now - it->second.second >= o.liveness_window()) {
              dead.push_back(n);
            }
          }
          nlohmann::json view = {{"seq", ++seq}, {"dead", dead}, {"gone", gone}};
          store->set(keys::liveness(), json_text::dump_record(view));
          last_answer = o.now();
          take_view(std::move(dead), std::move(gone), now);
          next_scan = now + o.keep_alive_interval;
        } else {
          bool known = false;
          // One read that never waits: the view goes with the job's keys when
          // the last node tidies them (etcd), maybe between two calls of ours.
          if (auto view = store::read_if_present(*store, keys::liveness())) {
            const std::string& raw = *view;
            auto j = json_text::parse_record(raw);
            if (!j.is_object() || !j.contains("seq") || !j["seq"].is_number_integer()) {
              throw ProtocolError("unreadable record at key '" + keys::liveness() +
                                  "': " + json_text::utf8_prefix(raw, 200));
            }
            auto dead = node_list(j, "dead", o.nnodes);
            auto gone = node_list(j, "gone", o.nnodes);
            int64_t s = j["seq"].get<int64_t>();
            if (s != seen_seq) {
              seen_seq = s;
              seen_seq_at = now;
            }
            // The view is as current as the host's last publication.
            take_view(std::move(dead), std::move(gone), seen_seq_at);
            known = true;
            last_answer = o.now();
          }
          // Until the host's first view arrives, ask at every pass.
          next_scan = now + (known ? o.keep_alive_interval : o.failure_poll);
        }
      }
      if (o.membership && now >= next_membership) {
        next_membership = now + o.membership_poll;
        if (auto change = o.membership(st->attempt)) {
          publish([&] {
            st->membership_change = *change;
            return true;
          });
          // The round is over: nothing more to watch in it, and the agent
          // that forms the next one need not wait for a store call here.
          return;
        }
      }
      int k = st->attempt;
      if (k != seen_failure_of) {
        try {
          store->wait({keys::failure(k)}, o.failure_poll);
          // Not a waiting get: the record may be tidied away meanwhile, and
          // a record that went is no failure.
          auto record = store::read_if_present(*store, keys::failure(k));
          if (!record) continue;
          const std::string& raw = *record;
          FailureRecord f;
          try {
            f = FailureRecord::from_json(raw);
          } catch (const ProtocolError& e) {
            throw ProtocolError("unreadable record at key '" + keys::failure(k) + "': " + e.what());
          }
          seen_failure_of = k;
          publish([&] {
            st->failures.emplace_back(k, f);
            return true;
          });
        } catch (const TimeoutError&) {
          // Not failed (yet).
        }
      } else {
        pause(o.failure_poll);
      }
    } catch (const ProtocolError&) {
      throw;
    } catch (const InternalError&) {
      throw;
    } catch (const Error& e) {
      store.reset();
      {
        std::lock_guard<std::mutex> lock(st->mutex);
        st->conn.reset();
        if (st->stop) return;  // interrupted on purpose
      }
      store_was_out = true;
      auto now = o.now();
      if (now - last_answer >= o.store_grace && !st->store_lost) {
        publish([&] {
          st->store_error = e.what();
          st->store_lost = true;
          return true;
        });
      }
      pause(std::min<std::chrono::milliseconds>(100ms, o.failure_poll));
    }
  }
}

}  // namespace ctorchrun::agent
