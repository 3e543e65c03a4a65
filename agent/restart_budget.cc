#include "agent/restart_budget.h"

#include <algorithm>
#include <string>

#include "common/error.h"

namespace ctorchrun::agent {

RestartBudget::RestartBudget(int max_restarts, bool elastic)
    : max_(max_restarts), elastic_(elastic) {
  CTORCHRUN_CHECK(max_restarts >= 0, "a negative --max_restarts");
}

RestartBudget::Verdict RestartBudget::on_failure() {
  CTORCHRUN_CHECK(!pending_, "a failure of attempt " + std::to_string(spent_) +
                                 " while its previous failure is pending");
  pending_ = true;
  Verdict v;
  v.final = exhausted();
  v.await_loss = v.final && elastic_;
  return v;
}

int RestartBudget::on_restart() {
  CTORCHRUN_CHECK(pending_, "a restart with no failure pending");
  CTORCHRUN_CHECK(!exhausted(), "a restart after the last one");
  pending_ = false;
  return ++spent_;
}

bool RestartBudget::explains(const rendezvous::MembershipChange& change,
                             const std::vector<int>& stopped) {
  return std::any_of(change.lost.begin(), change.lost.end(), [&](int g) {
    return std::find(stopped.begin(), stopped.end(), g) == stopped.end();
  });
}

RestartBudget::GiveWay RestartBudget::on_round_gives_way(const rendezvous::MembershipChange& change,
                                                         const std::vector<int>& stopped) {
  if (!pending_) return GiveWay::kReform;
  if (explains(change, stopped)) {
    pending_ = false;
    return GiveWay::kRefunded;
  }
  // The failure stands. After the last restart the job fails instead (the
  // agent waits only for a loss that explains it then).
  CTORCHRUN_CHECK(!exhausted(), "the round gave way without explaining the last attempt's failure");
  pending_ = false;
  ++spent_;
  return GiveWay::kCharged;
}

void RestartBudget::on_round_formed(int attempt) {
  CTORCHRUN_CHECK(!pending_, "a round formed while a failure of attempt " + std::to_string(spent_) +
                                 " is pending");
  spent_ = std::max(spent_, attempt);
}

}  // namespace ctorchrun::agent
