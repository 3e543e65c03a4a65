#include "agent/job_monitor.h"

#include <thread>

#include "common/error.h"
#include "common/log.h"

namespace ctorchrun::agent {

namespace keys {
std::string alive(int node) { return "alive/" + std::to_string(node); }
std::string failure(int attempt) { return "attempt/" + std::to_string(attempt) + "/failure"; }
std::string stopped(int attempt) { return "attempt/" + std::to_string(attempt) + "/stopped"; }
std::string all_stopped(int attempt) {
  return "attempt/" + std::to_string(attempt) + "/all_stopped";
}
std::string clean(int attempt) { return "attempt/" + std::to_string(attempt) + "/clean"; }
std::string done(int attempt) { return "attempt/" + std::to_string(attempt) + "/done"; }
std::string all_done(int attempt) { return "attempt/" + std::to_string(attempt) + "/all_done"; }
std::string finished(int attempt, int node) {
  return "attempt/" + std::to_string(attempt) + "/finished/" + std::to_string(node);
}
std::string gone(int node) { return "gone/" + std::to_string(node); }
}  // namespace keys

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

JobMonitor::JobMonitor(std::function<std::shared_ptr<store::Store>()> connect, int node, int nnodes,
                       std::function<void()> notify, std::chrono::milliseconds node_timeout,
                       std::chrono::milliseconds store_grace)
    : state_(std::make_shared<State>()) {
  state_->connect = std::move(connect);
  state_->node = node;
  state_->nnodes = nnodes;
  state_->notify = std::move(notify);
  state_->node_timeout = node_timeout;
  state_->store_grace = store_grace;
  thread_ = std::thread(run_loop, state_);
}

JobMonitor::~JobMonitor() {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stop = true;
  }
  state_->stop_cv.notify_all();
  // Bounded: each store call of the thread has a timeout of a few seconds.
  thread_.join();
}

std::optional<std::string> JobMonitor::protocol_error() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->protocol_error;
}

std::optional<std::string> JobMonitor::internal_error() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->internal_error;
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

bool JobMonitor::liveness_known() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return std::chrono::steady_clock::now() - state_->last_scan < 3s;
}

std::vector<int> JobMonitor::dead_nodes() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->dead;
}

void JobMonitor::loop(const std::shared_ptr<State>& st) {
  std::shared_ptr<store::Store> store;
  std::vector<int64_t> beats(static_cast<size_t>(st->nnodes), -1);
  std::vector<Clock::time_point> changed(static_cast<size_t>(st->nnodes), Clock::now());
  auto last_beat = Clock::now() - 1h;
  auto last_scan = Clock::now() - 1h;  // the first scan at once
  bool failing = false;                // store calls keep failing since failing_since
  Clock::time_point failing_since;
  int seen_failure_of = -1;
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

  while (!stopped()) {
    try {
      if (!store) {
        store = st->connect();
        store->set_timeout(2s);
      }
      auto now = Clock::now();
      if (now - last_beat >= 500ms) {
        store->add(keys::alive(st->node), 1);
        last_beat = now;
      }
      if (now - last_scan >= 1s) {
        last_scan = now;
        std::vector<int> dead;
        for (int n = 0; n < st->nnodes; ++n) {
          if (n == st->node) continue;
          int64_t b = store->add(keys::alive(n), 0);
          auto i = static_cast<size_t>(n);
          if (b != beats[i]) {
            beats[i] = b;
            changed[i] = now;
          } else if (now - changed[i] > st->node_timeout && !store->check({keys::gone(n)})) {
            dead.push_back(n);
          }
        }
        publish([&] {
          bool newly_dead = dead.size() > st->dead.size();
          st->dead = dead;
          st->last_scan = now;
          return newly_dead;
        });
      }
      int k = st->attempt;
      if (k != seen_failure_of) {
        try {
          store->wait({keys::failure(k)}, 250ms);
          std::string raw = store->get(keys::failure(k));
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
        pause(250ms);
      }
      failing = false;
    } catch (const ProtocolError&) {
      throw;
    } catch (const InternalError&) {
      throw;
    } catch (const Error& e) {
      store.reset();
      auto now = Clock::now();
      if (!failing) {
        failing = true;
        failing_since = now;
      }
      if (now - failing_since >= st->store_grace && !st->store_lost) {
        publish([&] {
          st->store_error = e.what();
          st->store_lost = true;
          return true;
        });
      }
      pause(100ms);
    }
  }
}

}  // namespace ctorchrun::agent
