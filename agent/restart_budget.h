#pragma once

// RestartBudget: what a worker failure costs the job, against --max_restarts.
// One per agent, single-threaded: no threads, clocks or I/O. The agent's main
// loop (agent/agent.cc) calls it at the points below, and the rendezvous
// simulation (tests/rendezvous/c10d_simulation_test.cc) calls it at the same
// points, so that the rule the simulation checks is the one the agents run.
//
// ## The rule (a contract: the agent's log lines "restart k/N", "job failed
// after K/N restarts" and "the failure of attempt N is not charged", its exit
// codes and CTORCHRUN_FAILED_RESTARTS follow it)
//
// max() is --max_restarts as the job's nodes agreed on it in the rendezvous
// (RendezvousInfo::max_restarts), not the node's own flag. spent() counts the
// failures charged to it, and is the number of the attempt that runs: attempt
// k runs after k charged failures.
//
//  - on_failure(): a worker of attempt k failed somewhere in the job, and
//    every node stops its workers. The failure is pending. It is final when
//    k == max() (no restart left); an elastic job then first waits briefly for
//    a loss that explains it (Verdict::await_loss) before the job fails.
//  - on_restart(): every node stopped its workers and attempt k+1 starts in
//    the same round: the failure is charged.
//  - on_round_gives_way(change, stopped) while a failure is pending (between
//    attempts): the round gives way before the next attempt forms. When it
//    names a lost member (change.lost) that had not reported its workers
//    stopped for the failure (not in `stopped`, the tally
//    attempt/<k>/stopped), the loss explains the failure: refunded, the next
//    round runs attempt k again (peers vanishing make surviving workers
//    fail). Otherwise it is charged and the next round runs attempt k+1: an
//    admission names no one, and a member lost after it stopped its workers
//    for the failure did not cause it.
//  - on_round_gives_way(change, {}) while no failure is pending: the round
//    re-forms while the workers run. Nothing is charged (the workers'
//    TORCHELASTIC_RESTART_COUNT still moves: it is spent() plus the round).
//  - on_round_formed(attempt): a round formed, carrying the job's count
//    (C10dRound::attempt: the highest any member carries or the rendezvous
//    store keeps, so that a round of newcomers alone goes on from it; 0 for
//    the static rendezvous). The budget adopts it when higher: a node that
//    joins a running job takes the job's count. The budget does no I/O: the
//    agent records each charge in the store (agent/protocol.h).
//
// Why "had not reported": members do not see the change and the tally at the
// same moment. While one member's workers are slow to stop, another may be
// lost after reporting its own; counting every loss, the slow member would
// complete the tally and restart, charged, while the others gave way,
// refunded, and the job's count would depend on which of them carries it
// into the next round. A lost member's report is in the tally before its
// loss, so every member decides alike. (Found by the rendezvous simulation;
// a member declared lost by its heartbeat while only stalled may still
// report late, and is the one case left to the count the next round takes:
// the highest of its members' and the store's.)
//
// Misuse (a failure while one is pending, a restart with none pending or none
// left, an admission charging the last attempt's failure, a round formed
// while a failure is pending) is an InternalError.

#include <vector>

#include "rendezvous/handler.h"

namespace ctorchrun::agent {

class RestartBudget {
 public:
  // `max_restarts`: the job's agreed --max_restarts; `elastic`: the rounds of
  // the job can re-form (c10d, etcd-v3), so a loss can explain a failure.
  RestartBudget(int max_restarts, bool elastic);

  int max() const { return max_; }
  // The failures charged: the attempt that runs, or that a pending failure
  // belongs to.
  int spent() const { return spent_; }
  // No restart is left: a failure now is final.
  bool exhausted() const { return spent_ >= max_; }
  bool elastic() const { return elastic_; }
  // A failure of attempt spent() is neither charged nor refunded yet.
  bool failure_pending() const { return pending_; }

  struct Verdict {
    bool final = false;       // no restart left: the job fails unless a loss explains it
    bool await_loss = false;  // final and elastic: wait briefly for a loss first
  };
  // A worker of the running attempt failed somewhere in the job.
  Verdict on_failure();

  // Every node stopped its workers: the pending failure is charged and the
  // next attempt runs in the same round. Returns it (spent()).
  int on_restart();

  // What a round giving way did to the budget.
  enum class GiveWay {
    kReform,    // no failure pending: a re-formation, nothing charged
    kCharged,   // charged: an admission, or members lost after they reported
    kRefunded,  // a loss explains the pending failure: not charged
  };
  // The round gives way for `change` (the change that won: its lost members).
  // `stopped`: the group ranks of the round that reported their workers
  // stopped for the pending failure, read after the change was seen (empty
  // when none is pending).
  GiveWay on_round_gives_way(const rendezvous::MembershipChange& change,
                             const std::vector<int>& stopped);
  // Whether the round giving way for `change` explains a pending failure: a
  // member it names lost is not in `stopped`. A final failure awaits that
  // alone (Verdict::await_loss); any other change leaves it standing.
  static bool explains(const rendezvous::MembershipChange& change, const std::vector<int>& stopped);

  // A round formed, carrying the job's count `attempt`: adopted when higher.
  void on_round_formed(int attempt);

 private:
  int max_;
  bool elastic_;
  int spent_ = 0;
  bool pending_ = false;
};

}  // namespace ctorchrun::agent
