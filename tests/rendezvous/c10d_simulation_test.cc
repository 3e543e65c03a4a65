// A deterministic simulation of the c10d elastic rendezvous: 2 to 6 agents,
// each driving the real C10dState and C10dRoundWatch as C10dHandler and the
// agent do, against one shared HashStore, stepped one at a time by a
// scheduler seeded from a number, on a virtual clock (no sleeps, no threads).
//
// Each agent is a small state machine:
//
//   absent --arrive: join()--> forming --poll() returns a round--> running
//      ^                        |   ^                                  |
//      |                        |   +--- rejoin() (the round gives way)+
//      +--- killed, exits (an IoError on its main path), leaves -------+
//
// forming: poll(), then wait on wait_key() for one slice (wait_slice), as
// C10dHandler::form_round does: runnable when the key exists or the slice
// has passed. running: C10dRoundWatch::check(attempt) once a monitor tick.
//
// Each agent owns the agent's restart accounting, agent::RestartBudget, and
// calls it where ElasticAgent does: built from the round's agreed
// max_restarts when its first round forms, on_round_formed() with the
// round's count, on_failure() when its workers fail, on_restart() when every
// member reported its workers stopped for the failure, on_round_gives_way()
// when its round gives way (a re-formation, or between the attempts of a
// failure), and the count it then carries into rejoin(). A running member
// whose workers failed (Agent::failed) reports them stopped at its next step
// (the tally attempt/<k>/stopped, kept by the sim) and, as sync_after_stop
// does, restarts once every member of the round reported, or gives way when
// its watch sees the round give way first. As it restarts it records the
// job's count in the store as ElasticAgent::settle does
// (C10dState::raise_count of its round's restarts key; an answer lost there
// ends it, the write applied).
//
// Random events: a node arrives; a running round's workers fail (every
// member whose workers run stops them; one that reads the roster later finds
// its attempt failed); a node is killed (its bound keys vanish and their
// gone markers appear: testing::BoundKeyStore); a node stalls for a while
// and resumes (a transient freeze: SIGSTOP, a VM pause, a swap storm, in any
// phase: forming, running, stopping its workers); a member leaves on purpose (withdraws its
// presence and record; the others notice, as the agent does, and re-form); a member killed or
// leaving fails the other members' workers too, half the times (their peer
// vanished): either at once, before any watch noticed the loss, or each
// member's as its watch notices it (the agent then handles the failure
// first, as ElasticAgent::watch does, and gives way with it pending); an
// answer is lost after its call applied (testing::FaultStore: on the main
// path the node exits as the real handler does, on the monitor's path the
// watch is opened anew); time passes. Half the seeds end with the running
// round's workers succeeding: mark_finishing, close, and the members leave.
//
// After every step the invariants are checked (Sim::check_roster when a
// node reads a roster, Sim::check after each step); a violation fails the
// test with the seed, the step and the last 30 events:
//  - every reader of round R's roster reads the same one; its size is within
//    MIN:MAX, no slot twice, each slot's record the node that entered it, a
//    reader's group rank the slot it holds;
//  - no two live nodes run round R as the same group rank; two rounds run at
//    once only while the older has given way (its reform is set);
//  - once nothing disturbs the job (a kill, an exit, a stall, a lost answer,
//    a leave) for bound_ms_, a willing node waits no longer: not when the
//    job does not run and MIN nodes wait, not when it runs below MAX;
//  - no call waits for a key that nobody will write (a waiting read of a
//    missing key: it would wait for the store's timeout);
//  - no call ends in an InternalError, whatever the faults (the agent would
//    exit 70, "a bug of ours", with no restart and no summary);
//  - after the job ends, no round forms and each waiting node learns the end
//    within a poll;
//  - the restart budget: every agent with no failure pending, running a
//    round that stands or coming back for the next, has spent exactly what
//    it owes: the job's failures not explained by a loss. The sim keeps that
//    ground truth itself (Sim::settle_failures), from the store and its own
//    events, never from a budget: the failure of attempt k of round R is
//    charged once every member reported its workers stopped for it, or when
//    R gives way naming no lost member that had not reported (an admission
//    names none); it is explained by a loss when R gives way naming a member
//    lost before it reported. A failure a loss caused that is charged is a
//    violation (an admission that re-forms R names the members lost by
//    then). A member owes the charged failures it took part in; the job has
//    spent the most any round's members owed as they entered it, with the
//    failures charged since; a round's members owe what the job has spent
//    as it forms (a failure in a round that had given way already is known
//    to its own members alone: the job spends it as one of them gives way).
//    Every round forms at that count (C10dRound::attempt), even one formed
//    by none of the members that carried it: the count is in the store
//    (C10dState: rdzv/attempt, the round's restarts). The sim counts the
//    rounds that took it from the store.
//
// Environment:
//   CTORCHRUN_SIM_SEEDS=N       how many seeds (default 2000)
//   CTORCHRUN_SIM_SEED=S        run seed S alone, printing every event
//   CTORCHRUN_SIM_KEEP_GOING=1  run every seed; count the violations by kind
//   CTORCHRUN_SIM_FAULTS=a,b    which faults beyond the base ones (default: all;
//                               "base" for none of them):
//     entrants  kill (or lose an answer of) a node that entered a forming
//               round, not only a running member
//     leave     the last live member of a round may leave on purpose too
//               (by default a member leaves only while another stays)

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "agent/restart_budget.h"
#include "common/error.h"
#include "rendezvous/c10d_handler.h"
#include "rendezvous/c10d_state.h"
#include "store/hash_store.h"
#include "store/protocol.h"
#include "tests/support/fault_store.h"

using namespace ctorchrun;
using agent::RestartBudget;
using rendezvous::C10dRound;
using rendezvous::C10dRoundWatch;
using rendezvous::C10dSettings;
using rendezvous::C10dState;
using rendezvous::MembershipChange;
using rendezvous::NodeInfo;
using std::chrono::milliseconds;
using testing::BoundKeyStore;
using testing::FaultStore;

namespace {

struct SimOptions {
  bool kill_entrants = false;  // faults may hit nodes that entered a forming round
  bool leave = false;          // running members may leave on purpose
  bool verbose = false;        // print every event as it happens
};

// An invariant broke (thrown by Sim::violate, caught in Sim::run).
struct Violation {
  std::string what;
};

enum class Phase { kAbsent, kForming, kRunning };

struct Agent {
  int id = 0;
  int incarnation = 0;
  Phase phase = Phase::kAbsent;
  std::shared_ptr<BoundKeyStore> presence;  // this agent's presence connection
  std::shared_ptr<FaultStore> job;          // its main connection
  std::shared_ptr<FaultStore> monitor;      // the monitor's connection
  std::unique_ptr<C10dState> state;
  std::optional<C10dRound> round;  // the last round it ran
  std::unique_ptr<C10dRoundWatch> watch;
  // The agent's restart accounting, built from the agreed max_restarts of
  // its first round (ElasticAgent::form_round); unset before it.
  std::optional<RestartBudget> budget;
  // Its workers failed (the budget's failure is pending): it stopped them and
  // waits for every member to report theirs stopped, or for the round to
  // give way (ElasticAgent::sync_after_stop).
  bool failed = false;
  // The ground truth of the count this agent carries: the job's failures
  // not explained by a loss that it took part in or adopted from a round's
  // members (the sim's, never read from the budget). 0 on arrival.
  int owed = 0;
  int64_t wake_at = 0;          // forming: the slice's end; running: the next tick
  std::string wait_key;         // forming: the key that ends the wait early
  int64_t stalled_until = -1;   // >= now: stalled
  int64_t arrive_at = -1;       // absent: when it arrives (-1: never)
  int64_t eligible_since = -1;  // forming: since when it should be admitted (-1: not due)
  std::string presence_key;     // running: present/<g> of its round

  bool live() const { return phase != Phase::kAbsent; }
  int attempt() const { return budget ? budget->spent() : 0; }
  std::string name() const { return "a" + std::to_string(id) + "." + std::to_string(incarnation); }
  int pid() const { return 1000 * (id + 1) + incarnation; }
};

std::string slots_text(const std::vector<std::string>& slots) {
  std::string s;
  for (const auto& x : slots) s += (s.empty() ? "" : " ") + x;
  return "[" + s + "]";
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : " ") + std::to_string(r);
  return "[" + s + "]";
}

class Sim {
 public:
  Sim(uint64_t seed, SimOptions options) : seed_(seed), opt_(options), rng_(seed) {
    settings_.max_nodes = 1 + pick(4);
    settings_.min_nodes = 1 + pick(settings_.max_nodes);
    settings_.max_restarts = 1000;
    settings_.entrypoint = "train.py";
    agents_.resize(static_cast<size_t>(2 + pick(5)));
    for (size_t i = 0; i < agents_.size(); ++i) agents_[i].id = static_cast<int>(i);
    timing_.last_call_timeout = milliseconds(pick(2) == 0 ? 1'000 : 3'000);
    timing_.claim_timeout = milliseconds(pick(2) == 0 ? 1'000 : 2'000);
    timing_.closed_window = milliseconds(600'000);
    poll_ms_ = 1'000;
    monitor_ms_ = 500;
    // The longest a willing node may legitimately wait, once nothing
    // disturbs the job: an admission (last call since the round formed, a
    // monitor tick), the members' return, a last call and a silent claim.
    bound_ms_ = 2 * timing_.last_call_timeout.count() + timing_.claim_timeout.count() +
                4 * poll_ms_ + 4 * monitor_ms_;
    faults_until_ = 40 * timing_.last_call_timeout.count() + 40'000;
    end_at_ = faults_until_ + 3 * bound_ms_;
    for (auto& a : agents_) a.arrive_at = pick(static_cast<int>(faults_until_ / 2));
    next_fault_at_ = 1'000 + pick(static_cast<int>(faults_until_ / 4));
    // Half the seeds end with the job's success, the others run on.
    if (pick(2) == 0) end_job_at_ = faults_until_ / 2 + pick(static_cast<int>(faults_until_ / 2));
    store_ = std::make_shared<store::HashStore>();
  }

  // Runs the seed; the violation found, if any.
  std::optional<std::string> run() {
    try {
      while (now_ <= end_at_) {
        ++step_;
        CTORCHRUN_CHECK(step_ < 200'000, "runaway simulation");
        one_step();
        check();
      }
      return std::nullopt;
    } catch (const Violation& v) {
      return report(v.what);
    } catch (const std::exception& e) {
      return report(std::string("unexpected exception: ") + e.what());
    }
  }

  // The violation's text: seed, step, the last events and how to replay.
  std::string report(const std::string& what) {
    std::ostringstream out;
    out << "seed " << seed_ << ": " << what << "\n  at step " << step_ << ", t=" << now_
        << " ms; nnodes " << settings_.min_nodes << ":" << settings_.max_nodes << ", "
        << agents_.size() << " agents, last_call " << timing_.last_call_timeout.count()
        << " ms, claim " << timing_.claim_timeout.count() << " ms\n  last events:\n";
    for (const auto& e : trace_) out << "    " << e << "\n";
    out << "  replay: CTORCHRUN_SIM_SEED=" << seed_ << faults_text()
        << " bin/rendezvous_tests '[sim]'";
    return out.str();
  }

  int kills = 0, exits = 0, stalls = 0, failures = 0, leaves = 0, rounds = 0;
  int ended = 0;  // seeds whose job ended
  // Failures a loss caused: at once, or as the survivors' watches noticed it.
  int loss_failures_before = 0, loss_failures_after = 0;
  int refunds = 0;                 // failures an agent's budget refunded
  int charged = 0, explained = 0;  // the job's failures, as settled
  // Caused by a loss, yet charged (a violation): the round gave way naming no
  // member lost before it reported.
  int loss_charged = 0;
  int count_drops = 0;  // rounds formed by no carrier of the job's count: from the store

 private:
  // ---- randomness and bookkeeping ----------------------------------------

  int pick(int n) { return static_cast<int>(rng_() % static_cast<uint64_t>(n)); }
  bool chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }

  std::string faults_text() const {
    std::string s;
    if (opt_.kill_entrants) s += "entrants";
    if (opt_.leave) s += std::string(s.empty() ? "" : ",") + "leave";
    return " CTORCHRUN_SIM_FAULTS=" + (s.empty() ? std::string("base") : s);
  }

  void event(const std::string& what) {
    std::string line = "step " + std::to_string(step_) + " t=" + std::to_string(now_) + " " + what;
    if (opt_.verbose) std::cout << line << "\n";
    trace_.push_back(std::move(line));
    if (trace_.size() > 30) trace_.pop_front();
  }

  [[noreturn]] void violate(const std::string& what) { throw Violation{what}; }

  C10dState::Clock::time_point clock() const {
    return C10dState::Clock::time_point(milliseconds(now_));
  }
  C10dState::WallClock::time_point wall() const {
    return C10dState::WallClock::time_point(std::chrono::hours(24 * 365 * 50)) + milliseconds(now_);
  }
  std::function<C10dState::Clock::time_point()> now_fn() {
    return [this] { return clock(); };
  }

  bool exists(const std::string& key) { return store_->check({key}); }

  bool stalled(const Agent& a) const { return a.stalled_until >= now_; }

  bool runnable(Agent& a) {
    if (!a.live() || stalled(a)) return false;
    if (now_ >= a.wake_at) return true;
    return a.phase == Phase::kForming && !a.wait_key.empty() && exists(a.wait_key);
  }

  // Something that delays the job legitimately: the liveness bounds count
  // from the last one.
  void disturbed() { last_disturbance_ = now_; }

  // ---- the scheduler -------------------------------------------------------

  // Stalled nodes whose time has come resume: a disturbance, as the stall.
  void resume_due() {
    for (auto& a : agents_) {
      if (a.live() && a.stalled_until >= 0 && a.stalled_until < now_) {
        a.stalled_until = -1;
        disturbed();
        event(a.name() + " resumes");
      }
    }
  }

  void one_step() {
    resume_due();
    for (auto& a : agents_) {
      if (!a.live() && a.arrive_at >= 0 && a.arrive_at <= now_) {
        a.arrive_at = -1;
        arrive(a, now_ < faults_until_);
        return;
      }
    }
    if (next_fault_at_ <= now_) {
      next_fault_at_ = now_ + 500 + pick(static_cast<int>(4 * timing_.last_call_timeout.count()));
      if (now_ < faults_until_) fault();
      return;
    }
    if (end_job_at_ >= 0 && end_job_at_ <= now_) {
      end_job_at_ = -1;
      finish();
      return;
    }
    std::vector<Agent*> ready;
    for (auto& a : agents_) {
      if (runnable(a)) ready.push_back(&a);
    }
    if (!ready.empty() && !chance(0.05)) {
      step(*ready[static_cast<size_t>(pick(static_cast<int>(ready.size())))]);
      return;
    }
    // Time passes: to the next event, or a little.
    int64_t next = std::min(now_ + poll_ms_, next_fault_at_);
    if (end_job_at_ >= 0) next = std::min(next, end_job_at_);
    for (auto& a : agents_) {
      if (a.live()) next = std::min(next, stalled(a) ? a.stalled_until + 1 : a.wake_at);
      if (!a.live() && a.arrive_at >= 0) next = std::min(next, a.arrive_at);
    }
    now_ = std::max(now_ + 1, next) + (chance(0.3) ? pick(50) : 0);
  }

  void fault() {
    std::vector<Agent*> live, running;
    for (auto& a : agents_) {
      if (a.live() && !stalled(a)) live.push_back(&a);
      if (a.phase == Phase::kRunning && !stalled(a)) running.push_back(&a);
    }
    auto any = [&](std::vector<Agent*>& v) -> Agent& {
      return *v[static_cast<size_t>(pick(static_cast<int>(v.size())))];
    };
    switch (pick(6)) {
      case 0: {
        std::vector<Agent*> victims;
        for (Agent* a : live) {
          if (a->phase == Phase::kRunning || opt_.kill_entrants) victims.push_back(a);
        }
        if (victims.empty()) return;
        ++kills;
        Agent& v = any(victims);
        if (v.phase == Phase::kRunning) loss_failure(v);
        end_agent(v, "is killed");
        return;
      }
      case 1: {
        if (live.empty()) return;
        Agent& a = any(live);
        a.stalled_until =
            now_ + 200 + pick(static_cast<int>(3 * timing_.last_call_timeout.count()));
        ++stalls;
        disturbed();
        event(a.name() + " stalls until t=" + std::to_string(a.stalled_until));
        return;
      }
      case 2:
        if (!running.empty()) worker_failure(any(running));
        return;
      case 3:
      case 4:
        if (!live.empty()) arm_lost_answer(any(live));
        return;
      default: {
        // Its round's other members notice (ElasticAgent::loss_change), so
        // by default one of them stays: nobody notices the last one leave.
        std::vector<Agent*> leavers;
        for (Agent* a : running) {
          // A signal between the attempts of a failure ends the agent at
          // once (on_signal: no workers run): a kill, not a leave.
          if (a->failed) continue;
          const bool other = std::any_of(running.begin(), running.end(), [&](Agent* b) {
            return b != a && b->round->round == a->round->round &&
                   b->round->generation == a->round->generation;
          });
          if (other || opt_.leave) leavers.push_back(a);
        }
        if (!leavers.empty()) leave(any(leavers));
        return;
      }
    }
  }

  void step(Agent& a) {
    const int lost = a.job->answers_lost() + a.monitor->answers_lost();
    if (a.phase == Phase::kForming) {
      step_forming(a);
    } else {
      step_running(a);
    }
    if (a.live() && lost != a.job->answers_lost() + a.monitor->answers_lost()) disturbed();
  }

  // ---- agents --------------------------------------------------------------

  void arrive(Agent& a, bool faults) {
    a.presence = std::make_shared<BoundKeyStore>(store_);
    a.job = std::make_shared<FaultStore>(store_);
    a.monitor = std::make_shared<FaultStore>(store_);
    a.job->refuse_waiting_reads(true);
    a.monitor->refuse_waiting_reads(true);
    NodeInfo me;
    me.local_world_size = 1 + a.id % 2;
    me.host = "node" + std::to_string(a.id);
    me.pid = a.pid();
    a.state = std::make_unique<C10dState>(
        *a.job, settings_, me, timing_, now_fn(), [this] { return wall(); }, a.presence.get());
    a.phase = Phase::kForming;
    a.budget.reset();
    a.failed = false;
    a.owed = 0;
    a.round.reset();
    a.watch.reset();
    a.presence_key.clear();
    a.stalled_until = -1;
    a.eligible_since = -1;
    if (faults && chance(0.05)) {
      // A connection that drops while joining, before this node's record is
      // anywhere a roster builder reads it.
      static const std::pair<FaultStore::Op, const char*> kJoinOps[] = {
          {FaultStore::Op::kAdd, "generation"},
          {FaultStore::Op::kCompareSet, "rdzv/settings"},
          {FaultStore::Op::kTallyAdd, "/joined"}};
      const auto& op = kJoinOps[pick(3)];
      a.job->lose_answer(op.first, 1, op.second);
    }
    try {
      a.state->join();
    } catch (const rendezvous::JobClosedError& e) {
      if (!closed_) violate(a.name() + " refused by a job that did not end: " + e.what());
      end_agent(a, "is refused: the job ended");
      return;
    } catch (const IoError& e) {
      ++exits;
      disturbed();
      end_agent(a, std::string("exits: join lost the store (") + e.what() + ")");
      return;
    } catch (const testing::WouldWaitError& e) {
      violate(a.name() + " join(): " + e.what());
    }
    entered(a, "arrives");
    a.wake_at = now_;
  }

  // After join, rejoin or a poll: which slot of which round this agent holds.
  void entered(Agent& a, const std::string& how) {
    const auto k = std::make_tuple(a.state->generation(), a.state->round(), a.state->slot());
    auto it = slot_holder_.find(k);
    if (it != slot_holder_.end() && it->second != a.pid()) {
      violate("slot " + a.state->slot() + " of round " + std::to_string(a.state->round()) +
              " given twice: pid " + std::to_string(it->second) + " and " + a.name());
    }
    if (it == slot_holder_.end()) {
      slot_holder_[k] = a.pid();
      entry_owed_[k] = a.owed;
      event(a.name() + " " + how + ": enters round " + std::to_string(a.state->round()) + " as " +
            a.state->slot() + (a.state->waiting() ? " (waiting)" : ""));
    }
  }

  void schedule_poll(Agent& a) {
    const auto slice = rendezvous::wait_slice(milliseconds(poll_ms_), a.state->until_last_call(),
                                              milliseconds(600'000));
    a.wake_at = now_ + slice.count();
    a.wait_key = a.state->wait_key();
  }

  void step_forming(Agent& a) {
    std::optional<C10dRound> r;
    try {
      r = a.state->poll();
    } catch (const rendezvous::JobClosedError& e) {
      if (!closed_) violate(a.name() + " told of an end that did not happen: " + e.what());
      end_agent(a, "exits: the job ended while it waited");
      return;
    } catch (const testing::WouldWaitError& e) {
      violate(a.name() + " poll() in round " + std::to_string(a.state->round()) + " (slot " +
              a.state->slot() + ") would wait for the store's timeout: " + e.what());
    } catch (const IoError& e) {
      ++exits;
      disturbed();
      end_agent(a, std::string("exits: poll lost the store (") + e.what() + ")");
      return;
    } catch (const InternalError& e) {
      violate(std::string("internal error (a bug of ours, exit 70 in the agent): ") + e.what());
    } catch (const Error& e) {
      violate(a.name() + " poll() threw: " + e.what());
    }
    if (!r) {
      entered(a, "left out");
      schedule_poll(a);
      return;
    }
    start_round(a, *r);
  }

  void start_round(Agent& a, const C10dRound& r) {
    if (closed_)
      violate(a.name() + " runs round " + std::to_string(r.round) + " after the job ended");
    check_roster(a, r);
    // C10dHandler::round_info: this member's presence, bound to its agent.
    try {
      if (!a.presence_key.empty()) a.presence->delete_key(a.presence_key);
      a.presence_key = C10dRoundWatch::present_key(r.generation, r.round, r.group_rank);
      a.presence->set(a.presence_key, std::to_string(a.pid()));
    } catch (const IoError& e) {
      violate(a.name() + " presence: " + e.what());
    }
    a.round = r;
    // ElasticAgent::form_round: the budget the nodes agreed on, and the job's
    // count.
    if (!a.budget) a.budget.emplace(r.max_restarts, true);
    a.budget->on_round_formed(r.attempt);
    a.owed = round_owed_.at({r.generation, r.round});
    a.watch.reset();
    a.phase = Phase::kRunning;
    a.wake_at = now_ + monitor_ms_;
    a.wait_key.clear();
    a.eligible_since = -1;
    event(a.name() + " runs round " + std::to_string(r.round) + " as group rank " +
          std::to_string(r.group_rank) + " of " + slots_text(r.roster.slots()) + ", attempt " +
          std::to_string(a.attempt()));
    // A member that reads the roster late finds its attempt failed already
    // (attempt/<k>/failure): it stops its workers at once.
    auto failed = failures_.find(std::make_tuple(r.generation, r.round, a.attempt()));
    if (failed != failures_.end()) {
      fail_workers(a, failed->second.loss, "its attempt failed before it started");
    }
  }

  void step_running(Agent& a) {
    a.wake_at = now_ + monitor_ms_;
    // Between the attempts of a failure (ElasticAgent::sync_after_stop): this
    // node reports its workers stopped, and every member's report restarts
    // the attempt in the same round; the round giving way first ends the
    // wait (await_nodes asks round_change).
    if (a.failed && report_stopped(a)) {
      const int next = a.budget->on_restart();
      a.failed = false;
      event(a.name() + " restarts its workers: attempt " + std::to_string(next) + " of round " +
            std::to_string(a.round->round));
      // ElasticAgent::settle: the job's count in the round's namespace before
      // the workers start. An answer lost there ends the agent (its main
      // path), the write applied.
      try {
        const auto& r = *a.round;
        C10dState::raise_count(*a.job, C10dState::restarts_key(r.generation, r.round), next,
                               next - 1 > r.attempt ? next - 1 : 0);
      } catch (const IoError& e) {
        ++exits;
        end_agent(a, std::string("exits: recording its restart lost the store (") + e.what() + ")");
      } catch (const testing::WouldWaitError& e) {
        violate(a.name() + " recording its restart: " + e.what());
      }
      return;
    }
    std::optional<MembershipChange> change;
    try {
      // The monitor's connection is opened anew after an error, and with it
      // the watch (whose admission timer restarts).
      if (!a.watch) {
        a.watch = std::make_unique<C10dRoundWatch>(*a.monitor, settings_, *a.round,
                                                   timing_.last_call_timeout, now_fn());
      }
      change = departed_change(a);
      if (!change) change = a.watch->check(a.attempt());
    } catch (const testing::WouldWaitError& e) {
      violate(a.name() + " watch of round " + std::to_string(a.round->round) + ": " + e.what());
    } catch (const ProtocolError& e) {
      violate(a.name() + " watch threw: " + e.what());
    } catch (const InternalError& e) {
      violate(std::string("internal error (a bug of ours, exit 70 in the agent): ") + e.what());
    } catch (const Error& e) {
      event(a.name() + " watch error, opened anew: " + e.what());
      a.watch.reset();
      return;
    }
    if (!change) return;
    // A loss the sim caused may fail this member's workers after its watch
    // noticed it: the agent handles the failure first (ElasticAgent::watch
    // looks at local exits before the round), then the round gives way while
    // the failure is pending.
    auto after = loss_after_.find({a.round->generation, a.round->round});
    if (after != loss_after_.end() && !a.failed &&
        std::find(change->lost.begin(), change->lost.end(), after->second) != change->lost.end()) {
      ++loss_failures_after;
      fail_workers(a, true, "after its watch noticed the loss");
      report_stopped(a);
    }
    // The agent gives way: stops its workers and comes back for the next round.
    const bool pending = a.failed;
    std::vector<int> stopped;
    if (pending) {
      const auto& reported =
          stopped_[std::make_tuple(a.round->generation, a.round->round, a.attempt())];
      stopped.assign(reported.begin(), reported.end());
    }
    const auto outcome = a.budget->on_round_gives_way(*change, stopped);
    a.failed = false;
    if (outcome == RestartBudget::GiveWay::kRefunded) ++refunds;
    // Charged as it gives way: the count goes to the store as it comes back
    // (C10dState::rejoin, its first write: a lost answer leaves it there).
    if (pending && outcome == RestartBudget::GiveWay::kCharged) {
      job_count_ = std::max(job_count_, a.attempt());
    }
    event(a.name() + " gives way in round " + std::to_string(a.round->round) + ": " +
          change->reason + " lost " + ranks_text(change->lost) +
          (!pending                                       ? ""
           : outcome == RestartBudget::GiveWay::kRefunded ? "; the failure is not charged"
                                                          : "; the failure is charged") +
          ", attempt " + std::to_string(a.attempt()));
    a.watch.reset();
    settle_failures();  // the reform is there: what this member carries is settled
    try {
      a.state->rejoin(*a.round, a.attempt(), change->lost);
    } catch (const testing::WouldWaitError& e) {
      violate(a.name() + " rejoin(): " + e.what());
    } catch (const IoError& e) {
      ++exits;
      disturbed();
      end_agent(a, std::string("exits: rejoin lost the store (") + e.what() + ")");
      return;
    }
    a.phase = Phase::kForming;
    a.wake_at = now_;
    a.eligible_since = -1;
    entered(a, "comes back");
  }

  // The agent's own view of members that left on purpose (their workers'
  // store gone key): it re-forms the round without them, as
  // ElasticAgent::loss_change does.
  std::optional<MembershipChange> departed_change(Agent& a) {
    auto it = left_.find({a.round->generation, a.round->round});
    if (it == left_.end()) return std::nullopt;
    MembershipChange change;
    change.lost = it->second;
    change.cause = "agent left";
    change.reason = "lost nodes " + ranks_text(change.lost) + " (agent left)";
    return a.watch->reform(change);
  }

  // The workers of the running round succeed (ElasticAgent::exit_barrier,
  // then settle): each member marks the attempt finishing and withdraws its
  // presence; unless an admission took the attempt first, the first of them
  // closes the job and all leave. Only when every member runs, unstalled.
  void finish() {
    std::vector<Agent*> members;
    for (auto& a : agents_) {
      if (!a.live()) continue;
      if (stalled(a)) break;
      if (a.phase == Phase::kRunning) members.push_back(&a);
    }
    const bool whole =
        !members.empty() &&
        std::all_of(members.begin(), members.end(),
                    [&](Agent* a) {
                      return !stalled(*a) && !a->failed &&
                             a->round->round == members[0]->round->round &&
                             a->round->generation == members[0]->round->generation;
                    }) &&
        members.size() == static_cast<size_t>(members[0]->round->roster.size()) &&
        std::none_of(agents_.begin(), agents_.end(), [&](const Agent& a) { return stalled(a); });
    if (!whole) {
      end_job_at_ = now_ + 2'000;  // later, when the round runs whole
      return;
    }
    const auto& r = *members[0]->round;
    bool finishing = true;
    for (Agent* a : members) {
      try {
        finishing = a->state->mark_finishing(a->attempt()) && finishing;
        // As C10dHandler's mark_finishing: presence and record withdrawn,
        // the done key held.
        C10dRoundWatch::finish(*a->presence, *a->round);
      } catch (const InternalError& e) {
        violate(std::string("internal error (a bug of ours, exit 70 in the agent): ") + e.what());
      } catch (const Error& e) {
        event(a->name() + " could not mark the attempt finishing: " + e.what());
        end_job_at_ = now_ + 2'000;
        return;
      }
    }
    if (!finishing) {
      event("the workers of round " + std::to_string(r.round) +
            " succeed, but an admission took the attempt first: the round re-forms");
      return;
    }
    int waiting = -1;
    try {
      waiting = members[0]->state->close("succeeded");
    } catch (const InternalError& e) {
      violate(std::string("internal error (a bug of ours, exit 70 in the agent): ") + e.what());
    } catch (const Error& e) {
      // Lost after the marker was written: the job ended all the same.
      event(members[0]->name() + " close: " + e.what());
    }
    closed_ = true;
    closed_at_ = now_;
    ++ended;
    event("the workers of round " + std::to_string(r.round) + " succeed: the job ends (" +
          std::to_string(waiting) + " nodes waiting)");
    for (Agent* a : members) {
      C10dRoundWatch::withdraw(*a->presence, *a->round);  // the agent leaves on purpose
      end_agent(*a, "finishes");
    }
  }

  // An independent failure: a worker of `a`'s round fails, and every member
  // whose workers run learns it (attempt/<k>/failure) and stops them.
  void worker_failure(Agent& a) {
    const auto r = *a.round;
    int hit = 0;
    for (auto& b : agents_) {
      if (b.phase == Phase::kRunning && !b.failed && b.round->generation == r.generation &&
          b.round->round == r.round) {
        fail_workers(b, false, "a worker failed");
        ++hit;
      }
    }
    if (hit > 0) ++failures;
  }

  // A member of a running round is killed or leaves: with some chance the
  // other members' workers fail too (their peer vanished), either at once,
  // before any watch noticed the loss, or each as its watch notices it.
  void loss_failure(const Agent& v) {
    if (!chance(0.5)) return;
    const auto r = *v.round;
    if (chance(0.5)) {
      loss_after_[{r.generation, r.round}] = r.group_rank;
      return;
    }
    int hit = 0;
    for (auto& b : agents_) {
      if (&b != &v && b.phase == Phase::kRunning && !b.failed &&
          b.round->generation == r.generation && b.round->round == r.round) {
        fail_workers(b, true, "its peer " + v.name() + " vanished");
        ++hit;
      }
    }
    if (hit > 0) ++loss_failures_before;
  }

  // `a`'s workers of attempt k fail (ElasticAgent::settle): the budget's
  // failure is pending until every member reports its workers stopped or
  // the round gives way. The job's record of the failure is kept per round
  // and attempt: every member's share of it is one failure.
  void fail_workers(Agent& a, bool loss, const std::string& why) {
    disturbed();
    const auto& r = *a.round;
    const int k = a.attempt();
    auto [it, fresh] = failures_.try_emplace(std::make_tuple(r.generation, r.round, k));
    if (fresh) {
      it->second.members = r.roster.size();
      it->second.loss = loss;
      it->second.after_reform = exists(C10dState::round_key(r.generation, r.round, "reform"));
    }
    it->second.participants.emplace_back(a.id, a.incarnation);
    // A member that learns of it late, once the job charged it, owes it too.
    if (it->second.settled && it->second.charged) a.owed = std::max(a.owed, k + 1);
    const auto verdict = a.budget->on_failure();
    if (verdict.final) violate(a.name() + ": the restarts ran out (the sim has no end by failure)");
    a.failed = true;
    a.wake_at = now_;
    event(a.name() + "'s workers fail at attempt " + std::to_string(k) + " of round " +
          std::to_string(r.round) + " (" + why + ")");
  }

  // This member reports its workers stopped for the pending failure (the
  // tally attempt/<k>/stopped); true once every member of the round has.
  bool report_stopped(Agent& a) {
    const auto& r = *a.round;
    auto& reported = stopped_[std::make_tuple(r.generation, r.round, a.attempt())];
    reported.insert(r.group_rank);
    return reported.size() == static_cast<size_t>(r.roster.size());
  }

  void arm_lost_answer(Agent& a) {
    if (a.phase == Phase::kRunning) {
      static const FaultStore::Op kOps[] = {FaultStore::Op::kCheck, FaultStore::Op::kCompareSet,
                                            FaultStore::Op::kTallyRead, FaultStore::Op::kGet};
      const auto op = kOps[pick(4)];
      a.monitor->lose_answer(op);
      event(a.name() + " monitor: the answer of the next " + op_name(op) + " will be lost");
    } else if (opt_.kill_entrants) {
      static const FaultStore::Op kOps[] = {FaultStore::Op::kCheck,     FaultStore::Op::kCompareSet,
                                            FaultStore::Op::kTallyAdd,  FaultStore::Op::kSet,
                                            FaultStore::Op::kTallyRead, FaultStore::Op::kGet};
      const auto op = kOps[pick(6)];
      a.job->lose_answer(op);
      event(a.name() + ": the answer of its next " + op_name(op) + " will be lost");
    }
  }

  static std::string op_name(FaultStore::Op op) {
    switch (op) {
      case FaultStore::Op::kCheck:
        return "check";
      case FaultStore::Op::kCompareSet:
        return "compare_set";
      case FaultStore::Op::kTallyRead:
        return "tally read";
      case FaultStore::Op::kTallyAdd:
        return "tally_add";
      case FaultStore::Op::kGet:
        return "get";
      case FaultStore::Op::kSet:
        return "set";
      default:
        return "call";
    }
  }

  void leave(Agent& a) {
    ++leaves;
    disturbed();
    // C10dHandler's depart: the group rank in the round's left tally, then
    // presence and record deleted on purpose (no gone marker); the agent
    // then exits.
    const auto& r = *a.round;
    C10dRoundWatch::leave(*store_, r.generation, r.round, r.group_rank);
    C10dRoundWatch::withdraw(*a.presence, r);
    left_[{r.generation, r.round}].push_back(r.group_rank);
    loss_failure(a);
    end_agent(a, "leaves on purpose (group rank " + std::to_string(r.group_rank) + " of round " +
                     std::to_string(r.round) + ")");
  }

  // The agent's process ends: its connections close.
  void end_agent(Agent& a, const std::string& why) {
    disturbed();
    event(a.name() + " " + why);
    // A slot it took before the call that failed may be in a roster: its
    // record there names this node.
    if (a.state && a.state->round() >= 0 && !a.state->slot().empty()) {
      const std::string record =
          C10dState::round_key(a.state->generation(), a.state->round(), "node/" + a.state->slot());
      if (exists(record) &&
          store_->get(record).find("\"pid\":" + std::to_string(a.pid())) != std::string::npos) {
        const auto k = std::make_tuple(a.state->generation(), a.state->round(), a.state->slot());
        slot_holder_.emplace(k, a.pid());
        entry_owed_.emplace(k, a.owed);  // the count its record carries
      }
    }
    a.presence->kill();
    a.phase = Phase::kAbsent;
    a.failed = false;
    a.state.reset();
    a.watch.reset();
    a.round.reset();
    a.presence_key.clear();
    a.wait_key.clear();
    a.stalled_until = -1;
    a.eligible_since = -1;
    ++a.incarnation;
    // Most come back (restarted by hand or by a scheduler), some do not.
    a.arrive_at = chance(0.7) ? now_ + 200 + pick(static_cast<int>(faults_until_ / 4)) : -1;
  }

  // ---- invariants ----------------------------------------------------------

  // A roster as a member reads it: the same for every reader, sized within
  // MIN and MAX, no slot twice, each slot's record the node that entered it.
  void check_roster(Agent& a, const C10dRound& r) {
    const auto key = std::make_pair(r.generation, r.round);
    const int n = r.roster.size();
    const std::vector<std::string> slots = r.roster.slots();
    if (n < settings_.min_nodes || n > settings_.max_nodes) {
      violate("round " + std::to_string(r.round) + " formed with " + std::to_string(n) +
              " members, outside " + std::to_string(settings_.min_nodes) + ":" +
              std::to_string(settings_.max_nodes));
    }
    std::set<std::string> distinct(slots.begin(), slots.end());
    if (distinct.size() != slots.size() || static_cast<int>(slots.size()) != n) {
      violate("round " + std::to_string(r.round) +
              " roster names a slot twice: " + slots_text(slots));
    }
    // The full list, read as an agent reads it for its events: it matches
    // the compact roster (read_members checks slot and size per member),
    // whose prefix sums are the ranks the list gives.
    std::vector<NodeInfo> nodes;
    try {
      nodes = C10dState::read_members(*store_, r);
    } catch (const InternalError& e) {
      violate(std::string("internal error (a bug of ours, exit 70 in the agent): ") + e.what());
    } catch (const Error& e) {
      violate("round " + std::to_string(r.round) + "'s member list: " + e.what());
      return;
    }
    int64_t first = 0;
    for (int g = 0; g < n; ++g) {
      const auto& node = nodes[static_cast<size_t>(g)];
      if (node.group_rank != g) violate("roster group ranks are not 0..n-1");
      if (r.roster.first_rank(g) != first) {
        violate("round " + std::to_string(r.round) + ": group rank " + std::to_string(g) +
                "'s first rank from the compact roster is " +
                std::to_string(r.roster.first_rank(g)) + ", the members' sizes say " +
                std::to_string(first));
      }
      first += node.local_world_size;
      auto it =
          slot_holder_.find(std::make_tuple(r.generation, r.round, slots[static_cast<size_t>(g)]));
      if (it == slot_holder_.end() || it->second != node.pid) {
        violate("round " + std::to_string(r.round) + " slot " + slots[static_cast<size_t>(g)] +
                " holds pid " + std::to_string(node.pid) + ", not the node that entered it");
      }
    }
    if (r.roster.world_size() != first || r.node0.pid != nodes.at(0).pid ||
        r.node0.host != nodes.at(0).host) {
      violate("round " + std::to_string(r.round) +
              ": the compact roster's world size or node 0 differ from the member list");
    }
    if (r.group_rank < 0 || slots.at(static_cast<size_t>(r.group_rank)) != a.state->slot()) {
      violate(a.name() + " got round " + std::to_string(r.round) + " as a slot it does not hold");
    }
    auto seen = rosters_.find(key);
    if (seen == rosters_.end()) {
      rosters_[key] = slots;
      roster_size_[key] = n;
      ++rounds;
      // The count the round should carry: the job's, which is at least the
      // highest its members owed as they entered it. Members that carry less
      // (none of them carried the job's count: newcomers) take it from the
      // store.
      int carried = 0;
      for (const auto& slot : slots) {
        auto e = entry_owed_.find(std::make_tuple(r.generation, r.round, slot));
        if (e != entry_owed_.end()) carried = std::max(carried, e->second);
      }
      const int owed = std::max(carried, job_count_);
      round_owed_[key] = owed;
      if (carried < job_count_) {
        ++count_drops;
        event("round " + std::to_string(r.round) + " forms with members that carry " +
              std::to_string(carried) + " restarts, the job had spent " +
              std::to_string(job_count_) + ": the count comes from the store");
      }
      if (r.attempt != owed) {
        violate("round " + std::to_string(r.round) + " forms at restart count " +
                std::to_string(r.attempt) + ", but the job had spent " + std::to_string(owed));
      }
      job_count_ = owed;
    } else if (seen->second != slots) {
      violate("round " + std::to_string(r.round) +
              " read as two rosters: " + slots_text(seen->second) + " and " + slots_text(slots));
    }
  }

  // The ground truth of the job's failures (failures_), from what the store
  // and the sim saw, not from any agent's budget: the failure of attempt k of
  // round R is charged once every member reported its workers stopped for
  // it (attempt k+1 forms), or when R gives way naming no member lost before
  // it reported (an admission names none); it is explained by a loss when R
  // gives way naming one. Lost members never report later: the reports the
  // reform is read with are the ones that count.
  void settle_failures() {
    for (auto& [key, f] : failures_) {
      if (f.settled) continue;
      const auto& [g, r, k] = key;
      const auto& reported = stopped_[key];
      const std::string reform = C10dState::round_key(g, r, "reform");
      if (static_cast<int>(reported.size()) == f.members) {
        f.charged = true;
      } else if (exists(reform)) {
        const auto j = nlohmann::json::parse(store_->get(reform));
        const auto lost = j.at("lost").get<std::vector<int>>();
        // A member lost after it reported its workers stopped for the failure
        // did not cause it.
        f.charged =
            std::all_of(lost.begin(), lost.end(), [&](int m) { return reported.count(m) > 0; });
      } else {
        continue;
      }
      f.settled = true;
      if (f.charged) {
        ++charged;
        if (f.loss) {
          ++loss_charged;
          violate("the failure of attempt " + std::to_string(k) + " of round " + std::to_string(r) +
                  ", caused by a loss, is charged: the round gave way naming no member lost "
                  "before it reported");
        }
        for (const auto& [id, incarnation] : f.participants) {
          auto& b = agents_[static_cast<size_t>(id)];
          if (b.live() && b.incarnation == incarnation) b.owed = std::max(b.owed, k + 1);
        }
        // A failure after its round gave way is known to its own members
        // alone (the others gave way without it): it becomes the job's as
        // one of them gives way, charged (step_running).
        if (!f.after_reform) job_count_ = std::max(job_count_, k + 1);
      } else {
        ++explained;
      }
      event("the failure of attempt " + std::to_string(k) + " of round " + std::to_string(r) +
            (f.charged ? " is charged" : " is explained by a loss") + ": the job has spent " +
            std::to_string(job_count_));
    }
  }

  void check() {
    resume_due();  // time may have passed in this step
    settle_failures();
    // Every agent with no failure pending, running a standing round or
    // coming back for the next, has spent what it owes: the job's failures
    // not explained by a loss, no more, no less.
    for (auto& a : agents_) {
      if (!a.live() || !a.budget || a.failed) continue;
      if (a.phase == Phase::kRunning &&
          exists(C10dState::round_key(a.round->generation, a.round->round, "reform"))) {
        continue;  // it has yet to notice that its round gave way
      }
      if (a.attempt() != a.owed) {
        violate(a.name() + (a.phase == Phase::kRunning ? " runs round " : " waits for round ") +
                std::to_string(a.state->round()) + " having spent " + std::to_string(a.attempt()) +
                " restarts, but the job's failures not explained by a loss are " +
                std::to_string(a.owed));
      }
    }
    // A node is in one running round; two running at once: the older one
    // has given way (its reform is set), its members just have not noticed.
    std::map<std::pair<int, int>, std::set<int>> ranks;
    std::optional<std::pair<int, int>> newest;
    bool any_stalled = false;
    for (auto& a : agents_) {
      if (!a.live()) continue;
      any_stalled = any_stalled || stalled(a);
      if (a.phase != Phase::kRunning) continue;
      const auto key = std::make_pair(a.round->generation, a.round->round);
      if (!ranks[key].insert(a.round->group_rank).second) {
        violate("two live nodes run round " + std::to_string(key.second) + " as group rank " +
                std::to_string(a.round->group_rank));
      }
      if (!newest || key > *newest) newest = key;
    }
    for (const auto& [key, members] : ranks) {
      if (key == *newest) continue;
      if (!exists(C10dState::round_key(key.first, key.second, "reform"))) {
        violate("rounds " + std::to_string(key.second) + " and " + std::to_string(newest->second) +
                " run at once, and round " + std::to_string(key.second) + " never gave way");
      }
    }
    if (closed_) {
      // Every node waiting when the job ended learns it within a poll.
      for (auto& a : agents_) {
        if (!a.live() || stalled(a)) continue;
        const int64_t since = std::max(closed_at_, last_disturbance_);
        if (a.phase == Phase::kRunning || now_ - since > poll_ms_ + monitor_ms_) {
          violate(a.name() + " still waits in round " + std::to_string(a.state->round()) + " " +
                  std::to_string(now_ - since) + " ms after the job ended");
        }
      }
      return;
    }
    // Liveness: a willing node is admitted within bound_ms_ once nothing
    // disturbs the job, when the job does not run and enough nodes wait to
    // form a round, or when it runs with room for more.
    int forming = 0;
    for (auto& a : agents_) forming += a.phase == Phase::kForming ? 1 : 0;
    bool due = false;
    std::string why;
    if (!newest) {
      due = forming >= settings_.min_nodes;
      why = "the job does not run and " + std::to_string(forming) + " nodes wait (min " +
            std::to_string(settings_.min_nodes) + ")";
    } else {
      due = roster_size_[*newest] < settings_.max_nodes;
      why = "round " + std::to_string(newest->second) + " runs with " +
            std::to_string(roster_size_[*newest]) + " of max " +
            std::to_string(settings_.max_nodes) + " nodes";
    }
    for (auto& a : agents_) {
      if (a.phase != Phase::kForming) continue;
      if (!due) {
        a.eligible_since = -1;
        continue;
      }
      if (a.eligible_since < 0) a.eligible_since = now_;
      if (any_stalled) continue;
      const int64_t since = std::max(a.eligible_since, last_disturbance_);
      if (now_ - since > bound_ms_) {
        violate(a.name() + " waits in round " + std::to_string(a.state->round()) + " (slot " +
                a.state->slot() + ", " +
                std::to_string(store_->tally_count(
                    C10dState::round_key(a.state->generation(), a.state->round(), "entered"))) +
                " entered) for " + std::to_string(now_ - since) + " ms, over the bound of " +
                std::to_string(bound_ms_) + " ms, although " + why);
      }
    }
  }

  uint64_t seed_;
  SimOptions opt_;
  std::mt19937_64 rng_;
  C10dSettings settings_;
  rendezvous::C10dTiming timing_;
  int64_t poll_ms_ = 0, monitor_ms_ = 0, bound_ms_ = 0, faults_until_ = 0, end_at_ = 0;
  int64_t next_fault_at_ = 0;
  int64_t end_job_at_ = -1;  // when the workers of the running round succeed
  bool closed_ = false;      // the job ended
  int64_t closed_at_ = -1;
  std::shared_ptr<store::HashStore> store_;
  std::vector<Agent> agents_;
  int64_t now_ = 0;
  int64_t step_ = 0;
  int64_t last_disturbance_ = 0;
  std::deque<std::string> trace_;
  std::map<std::tuple<int, int, std::string>, int> slot_holder_;  // (gen, round, slot) -> pid
  std::map<std::pair<int, int>, std::vector<std::string>> rosters_;
  std::map<std::pair<int, int>, int> roster_size_;
  std::map<std::pair<int, int>, std::vector<int>> left_;  // group ranks that left on purpose
  // The job's failures by (generation, round, attempt).
  struct FailureTruth {
    int members = 0;    // the round's size: the reports that restart it
    bool loss = false;  // caused by a member's loss
    // It happened in a round that had given way already (its reform set):
    // members that gave way before it never had it.
    bool after_reform = false;
    bool settled = false;
    bool charged = false;
    std::vector<std::pair<int, int>> participants;  // (agent id, incarnation) that had it
  };
  std::map<std::tuple<int, int, int>, FailureTruth> failures_;
  // The group ranks that reported their workers stopped for each failure.
  std::map<std::tuple<int, int, int>, std::set<int>> stopped_;
  // Rounds whose lost member (its group rank) fails the others' workers as
  // each of their watches notices the loss.
  std::map<std::pair<int, int>, int> loss_after_;
  // What each entrant owed as it entered a round: (gen, round, slot) -> count.
  std::map<std::tuple<int, int, std::string>, int> entry_owed_;
  std::map<std::pair<int, int>, int> round_owed_;  // what each round's members owe
  int job_count_ = 0;  // the newest round's count, with the charges since it formed
};

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::stoll(v);
}

SimOptions env_options() {
  SimOptions o;
  // Every fault by default; the variable picks some ("base": none of these).
  const char* v = std::getenv("CTORCHRUN_SIM_FAULTS");
  const std::string faults = v != nullptr && *v != '\0' ? v : "entrants,leave";
  o.kill_entrants = faults.find("entrants") != std::string::npos;
  o.leave = faults.find("leave") != std::string::npos;
  return o;
}

}  // namespace

TEST_CASE("c10d simulation: seeded runs of 2 to 6 agents keep every rendezvous invariant",
          "[sim]") {
  SimOptions options = env_options();
  const int64_t one = env_int("CTORCHRUN_SIM_SEED", -1);
  const int64_t count = one >= 0 ? 1 : env_int("CTORCHRUN_SIM_SEEDS", 2000);
  const uint64_t first = one >= 0 ? static_cast<uint64_t>(one) : 1;
  options.verbose = one >= 0;
  const bool keep_going = env_int("CTORCHRUN_SIM_KEEP_GOING", 0) != 0;
  const auto started = std::chrono::steady_clock::now();
  int64_t kills = 0, exits = 0, stalls = 0, failures = 0, leaves = 0, rounds = 0, ended = 0;
  int64_t loss_before = 0, loss_after = 0, refunds = 0, charged = 0, explained = 0,
          loss_charged = 0, count_drops = 0;
  // keep going: violations by kind (the message without its numbers), with
  // how many seeds showed each and the first of them.
  std::map<std::string, std::pair<int, std::string>> kinds;
  for (int64_t i = 0; i < count; ++i) {
    Sim sim(first + static_cast<uint64_t>(i), options);
    auto violation = sim.run();
    if (violation && !keep_going) FAIL(*violation);
    if (violation) {
      std::string kind = violation->substr(violation->find(": ") + 2);
      kind = kind.substr(0, kind.find('\n'));
      kind.erase(
          std::remove_if(kind.begin(), kind.end(), [](char c) { return c >= '0' && c <= '9'; }),
          kind.end());
      auto& k = kinds[kind.substr(0, 100)];
      if (k.first++ == 0) k.second = *violation;
    }
    kills += sim.kills;
    exits += sim.exits;
    stalls += sim.stalls;
    failures += sim.failures;
    leaves += sim.leaves;
    rounds += sim.rounds;
    ended += sim.ended;
    loss_before += sim.loss_failures_before;
    loss_after += sim.loss_failures_after;
    refunds += sim.refunds;
    charged += sim.charged;
    explained += sim.explained;
    loss_charged += sim.loss_charged;
    count_drops += sim.count_drops;
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::cout << "simulated " << count << " seeds in " << secs << " s (" << rounds << " rounds, "
            << ended << " jobs ended, " << kills << " kills, " << exits
            << " exits on a lost answer, " << stalls << " stalls, " << failures
            << " worker failures, " << leaves
            << " leaves)\n  failures a loss caused: " << loss_before
            << " at once, before any watch noticed the loss, and " << loss_after
            << " members' as their watch noticed it; the job's failures settled: " << charged
            << " charged, " << explained << " explained by a loss (" << loss_charged
            << " caused by a loss but charged); " << refunds << " refunds by the agents' budgets; "
            << count_drops
            << " rounds formed with none of the members that carried the job's count took it "
               "from the store"
            << std::endl;
  for (const auto& [kind, k] : kinds) {
    std::cout << k.first << " seeds: " << kind << "\n  first: " << k.second << "\n";
  }
  if (!kinds.empty()) FAIL(kinds.size() << " kinds of violation");
}

// ---------------------------------------------------------------------------
// Scenarios the simulation found, kept small and scripted: each failed
// before C10dState (or the restart budget, agent/restart_budget.h) was fixed
// for it.

namespace {

struct ManualClock {
  int64_t ms = 0;
  std::function<C10dState::Clock::time_point()> fn() {
    return [this] { return C10dState::Clock::time_point(milliseconds(ms)); };
  }
  std::function<C10dState::WallClock::time_point()> wall_fn() {
    return [this] {
      return C10dState::WallClock::time_point(std::chrono::hours(24 * 365 * 50)) + milliseconds(ms);
    };
  }
};

// One agent's connections and state, driven by hand as C10dHandler drives it.
struct ScriptedNode {
  std::shared_ptr<BoundKeyStore> presence;
  std::shared_ptr<FaultStore> job;
  std::unique_ptr<C10dState> state;
  std::optional<C10dRound> round;

  ScriptedNode(const std::shared_ptr<store::HashStore>& s, int id, const C10dSettings& settings,
               ManualClock& clock)
      : presence(std::make_shared<BoundKeyStore>(s)), job(std::make_shared<FaultStore>(s)) {
    job->refuse_waiting_reads(true);
    NodeInfo me;
    me.local_world_size = 1;
    me.host = "node" + std::to_string(id);
    me.pid = 100 + id;
    rendezvous::C10dTiming timing;
    timing.last_call_timeout = milliseconds(1'000);
    timing.claim_timeout = milliseconds(1'000);
    state = std::make_unique<C10dState>(*job, settings, me, timing, clock.fn(), clock.wall_fn(),
                                        presence.get());
  }
  // round_info: the member's presence key.
  void hold_presence() {
    presence->set(C10dRoundWatch::present_key(round->generation, round->round, round->group_rank),
                  "1");
  }
};

// Polls `n` once a second of virtual time, for at most `limit`.
std::optional<C10dRound> poll_for(ScriptedNode& n, ManualClock& clock, milliseconds limit) {
  for (int64_t until = clock.ms + limit.count(); clock.ms <= until; clock.ms += 1'000) {
    if (auto r = n.state->poll()) return r;
  }
  return std::nullopt;
}

C10dSettings nnodes(int min, int max) {
  C10dSettings s;
  s.min_nodes = min;
  s.max_nodes = max;
  s.entrypoint = "train.py";
  return s;
}

}  // namespace

TEST_CASE("c10d simulation: a round whose only member was killed gives way to a waiting node",
          "[sim]") {
  auto store = std::make_shared<store::HashStore>();
  ManualClock clock;
  ScriptedNode a(store, 0, nnodes(1, 1), clock), b(store, 1, nnodes(1, 1), clock);
  a.state->join();
  a.round = a.state->poll();
  REQUIRE(a.round);
  a.hold_presence();
  b.state->join();
  REQUIRE(b.state->waiting());
  a.presence->kill();
  auto r = poll_for(b, clock, milliseconds(10'000));
  REQUIRE(r);
  CHECK(r->round == 1);
  CHECK(r->roster.slots() == std::vector<std::string>{b.state->slot()});
}

TEST_CASE(
    "c10d simulation: an entrant that dies before its round completes does not hold up the "
    "roster",
    "[sim]") {
  // Found as CTORCHRUN_SIM_FAULTS=entrants seed 2: the roster builder reads
  // every entrant's record with a waiting multi_get, and a dead entrant's
  // record is gone: the builder waits for the store's timeout.
  auto store = std::make_shared<store::HashStore>();
  ManualClock clock;
  ScriptedNode a(store, 0, nnodes(1, 3), clock), b(store, 1, nnodes(1, 3), clock);
  a.state->join();
  b.state->join();
  b.presence->kill();
  clock.ms += 1'100;
  // a forms a round; should b be in it, a's watch re-forms it without b.
  for (int i = 0; i < 3; ++i) {
    a.round = poll_for(a, clock, milliseconds(10'000));
    REQUIRE(a.round);
    if (a.round->roster.slots() == std::vector<std::string>{a.state->slot()}) return;
    C10dRoundWatch watch(*a.job, nnodes(1, 3), *a.round, milliseconds(1'000), clock.fn());
    auto change = watch.check(0);
    REQUIRE(change);
    a.state->rejoin(*a.round, 0, change->lost);
  }
  FAIL("a never ran a round without the dead entrant");
}

TEST_CASE(
    "c10d simulation: a round whose only member died before holding its presence gives way to "
    "a waiting node",
    "[sim]") {
  // Found as CTORCHRUN_SIM_FAULTS=entrants seed 157: the member completed the
  // roster and its connection dropped before it set its presence key. Its
  // record's gone marker is there, but a waiting node looks only at presence
  // keys' markers (watch_running_round), and no member is left to re-form.
  auto store = std::make_shared<store::HashStore>();
  ManualClock clock;
  ScriptedNode a(store, 0, nnodes(1, 1), clock), b(store, 1, nnodes(1, 1), clock);
  a.state->join();
  a.round = a.state->poll();
  REQUIRE(a.round);
  a.presence->kill();
  b.state->join();
  REQUIRE(b.state->waiting());
  auto r = poll_for(b, clock, milliseconds(30'000));
  REQUIRE(r);
  CHECK(r->round == 1);
}

TEST_CASE("c10d simulation: a round whose every member left on purpose gives way to a waiting node",
          "[sim]") {
  // Found as CTORCHRUN_SIM_FAULTS=leave seed 1: a member that leaves withdraws
  // its presence and record (no gone marker), and with no member left nobody
  // re-forms the round. The leave is written as the planned leave() records
  // it: the member's group rank enrolled in the round's "left" tally.
  auto store = std::make_shared<store::HashStore>();
  ManualClock clock;
  ScriptedNode a(store, 0, nnodes(1, 1), clock), b(store, 1, nnodes(1, 1), clock);
  a.state->join();
  a.round = a.state->poll();
  REQUIRE(a.round);
  a.hold_presence();
  b.state->join();
  REQUIRE(b.state->waiting());
  a.presence->delete_key(C10dRoundWatch::present_key(0, a.round->round, 0));
  a.presence->delete_key(C10dState::round_key(0, a.round->round, "node/" + a.state->slot()));
  a.job->tally_add(C10dState::round_key(0, a.round->round, "left"), "0");
  a.presence->kill();
  auto r = poll_for(b, clock, milliseconds(30'000));
  REQUIRE(r);
  CHECK(r->round == 1);
}

TEST_CASE(
    "c10d simulation: a member killed after its workers finished, whose partner left, gives way "
    "to a waiting node",
    "[sim]") {
  // Found at 20000 seeds (seed 9894): a member that marks its attempt
  // finishing withdraws its presence, so that its exit is no loss; killed
  // before the job closed, it left no gone marker, the other member left on
  // purpose, and the waiting nodes waited for a job nobody would close. Its
  // done key now goes with it.
  auto store = std::make_shared<store::HashStore>();
  ManualClock clock;
  ScriptedNode a(store, 0, nnodes(1, 2), clock), b(store, 1, nnodes(1, 2), clock),
      w(store, 2, nnodes(1, 2), clock);
  a.state->join();
  b.state->join();
  a.round = a.state->poll();
  b.round = b.state->poll();
  REQUIRE(a.round);
  REQUIRE(b.round);
  a.hold_presence();
  b.hold_presence();
  w.state->join();
  REQUIRE(w.state->waiting());
  REQUIRE(a.state->mark_finishing(0));
  C10dRoundWatch::finish(*a.presence, *a.round);
  a.presence->kill();
  C10dRoundWatch::leave(*b.job, 0, b.round->round, b.round->group_rank);
  C10dRoundWatch::withdraw(*b.presence, *b.round);
  b.presence->kill();
  auto r = poll_for(w, clock, milliseconds(10'000));
  REQUIRE(r);
  CHECK(r->round == 1);
  CHECK(r->roster.slots() == std::vector<std::string>{w.state->slot()});
}

TEST_CASE(
    "c10d simulation: a member whose workers finished leaves without a gone marker when it "
    "exits on purpose",
    "[sim]") {
  auto store = std::make_shared<store::HashStore>();
  ManualClock clock;
  ScriptedNode a(store, 0, nnodes(1, 1), clock);
  a.state->join();
  a.round = a.state->poll();
  REQUIRE(a.round);
  a.hold_presence();
  C10dRoundWatch::finish(*a.presence, *a.round);
  const std::string done = C10dRoundWatch::done_key(0, a.round->round, 0);
  CHECK(store->check({done}));
  CHECK_FALSE(store->check({C10dRoundWatch::present_key(0, a.round->round, 0)}));
  C10dRoundWatch::withdraw(*a.presence, *a.round);
  a.presence->kill();
  CHECK_FALSE(store->check({done}));
  CHECK_FALSE(store->check({done + "#gone"}));
}

TEST_CASE(
    "c10d simulation: a member lost after it stopped its workers for a failure does not refund "
    "it while another member's workers still stop",
    "[sim]") {
  // Found as seed 787 when the restart budget refunded a failure for any
  // loss: b reported its workers stopped for the failure and died; a saw the
  // round give way and refunded the failure, while c, whose workers took
  // longer to stop, completed the tally and restarted, charged. Their counts
  // differed, and the job's depended on who carried it on.
  auto store = std::make_shared<store::HashStore>();
  ManualClock clock;
  C10dSettings settings = nnodes(1, 3);
  settings.max_restarts = 3;
  ScriptedNode a(store, 0, settings, clock), b(store, 1, settings, clock),
      c(store, 2, settings, clock);
  a.state->join();
  b.state->join();
  c.state->join();
  a.round = a.state->poll();
  b.round = b.state->poll();
  c.round = c.state->poll();
  REQUIRE(a.round);
  REQUIRE(b.round);
  REQUIRE(c.round);
  REQUIRE(b.round->group_rank == 1);
  a.hold_presence();
  b.hold_presence();
  c.hold_presence();
  // ElasticAgent::form_round: the budget the nodes agreed on.
  RestartBudget budget_a(a.round->max_restarts, true), budget_c(c.round->max_restarts, true);
  CHECK(budget_a.max() == 3);
  // Attempt 0 fails; a and b report their workers stopped, c's still stop.
  budget_a.on_failure();
  budget_c.on_failure();
  std::vector<int> stopped{0, 1};
  b.presence->kill();
  C10dRoundWatch watch_a(*a.job, settings, *a.round, milliseconds(1'000), clock.fn());
  auto change = watch_a.check(0);
  REQUIRE(change);
  CHECK(change->lost == std::vector<int>{1});
  CHECK(budget_a.on_round_gives_way(*change, stopped) == RestartBudget::GiveWay::kCharged);
  // c's report completes the tally: it restarts, and then sees the round
  // give way while attempt 1 runs.
  stopped.push_back(2);
  CHECK(budget_c.on_restart() == 1);
  C10dRoundWatch watch_c(*c.job, settings, *c.round, milliseconds(1'000), clock.fn());
  auto seen = watch_c.check(1);
  REQUIRE(seen);
  CHECK(budget_c.on_round_gives_way(*seen, {}) == RestartBudget::GiveWay::kReform);
  CHECK(budget_a.spent() == 1);
  CHECK(budget_c.spent() == 1);
  a.state->rejoin(*a.round, budget_a.spent(), change->lost);
  c.state->rejoin(*c.round, budget_c.spent(), seen->lost);
  auto next = poll_for(a, clock, milliseconds(10'000));
  REQUIRE(next);
  CHECK(next->round == 1);
  CHECK(next->attempt == 1);
}
