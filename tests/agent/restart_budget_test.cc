// The restart budget's rule (agent/restart_budget.h): what a failure costs.

#include "agent/restart_budget.h"

#include <catch2/catch.hpp>

#include "common/error.h"

using ctorchrun::InternalError;
using ctorchrun::agent::RestartBudget;
using ctorchrun::rendezvous::MembershipChange;
using GiveWay = RestartBudget::GiveWay;

namespace {

MembershipChange loss(std::vector<int> lost) {
  return MembershipChange{"lost node 1 (agent exited)", std::move(lost), "agent exited"};
}

MembershipChange admission() { return MembershipChange{"admitting 1 waiting node", {}, ""}; }

}  // namespace

TEST_CASE("restart budget: a failure is charged when every node restarts", "[unit]") {
  RestartBudget b(3, false);
  CHECK(b.spent() == 0);
  CHECK(b.max() == 3);
  auto v = b.on_failure();
  CHECK_FALSE(v.final);
  CHECK_FALSE(v.await_loss);
  CHECK(b.failure_pending());
  CHECK(b.spent() == 0);  // the attempt the failure belongs to
  CHECK(b.on_restart() == 1);
  CHECK_FALSE(b.failure_pending());
  CHECK(b.spent() == 1);
}

TEST_CASE("restart budget: the failure of the last attempt is final", "[unit]") {
  RestartBudget b(2, false);
  b.on_failure();
  b.on_restart();
  b.on_failure();
  b.on_restart();
  CHECK(b.exhausted());
  auto v = b.on_failure();
  CHECK(v.final);
  CHECK_FALSE(v.await_loss);  // static: no loss can explain it
  CHECK_THROWS_AS(b.on_restart(), InternalError);
  CHECK(b.spent() == 2);
}

TEST_CASE("restart budget: no restarts at all - the first failure is final", "[unit]") {
  RestartBudget b(0, false);
  CHECK(b.on_failure().final);
}

TEST_CASE("restart budget: elastic, a final failure first awaits a loss that may explain it",
          "[unit]") {
  RestartBudget b(1, true);
  auto v = b.on_failure();
  CHECK_FALSE(v.final);
  CHECK_FALSE(v.await_loss);  // a restart is left: no waiting
  b.on_restart();
  v = b.on_failure();
  CHECK(v.final);
  CHECK(v.await_loss);
  // The loss came: refunded, the job goes on with attempt 1 again.
  CHECK(b.on_round_gives_way(loss({2}), {}) == GiveWay::kRefunded);
  CHECK(b.spent() == 1);
  CHECK_FALSE(b.failure_pending());
  b.on_round_formed(1);
  CHECK(b.on_failure().final);
}

TEST_CASE("restart budget: a loss between the attempts of a failure refunds it", "[unit]") {
  RestartBudget b(5, true);
  b.on_failure();
  CHECK(b.on_round_gives_way(loss({1}), {}) == GiveWay::kRefunded);
  CHECK(b.spent() == 0);
  CHECK_FALSE(b.failure_pending());
  // The next round runs the same attempt again.
  b.on_round_formed(0);
  CHECK(b.spent() == 0);
}

TEST_CASE(
    "restart budget: a member lost after it reported its workers stopped for the failure does not "
    "explain it",
    "[unit]") {
  // Node 1 stopped its workers for the failure, then was lost, while node 2's
  // workers were still stopping: node 2 completes the tally and restarts,
  // charged, and node 0, seeing the round give way, must charge it too.
  RestartBudget node0(5, true), node2(5, true);
  node0.on_failure();
  node2.on_failure();
  CHECK_FALSE(RestartBudget::explains(loss({1}), {0, 1}));
  CHECK(node0.on_round_gives_way(loss({1}), {0, 1}) == GiveWay::kCharged);
  CHECK(node2.on_restart() == 1);
  CHECK(node0.spent() == node2.spent());
  // One lost member that had not reported is enough to explain it.
  RestartBudget b(5, true);
  b.on_failure();
  CHECK(RestartBudget::explains(loss({1, 2}), {0, 1}));
  CHECK(b.on_round_gives_way(loss({1, 2}), {0, 1}) == GiveWay::kRefunded);
  CHECK(b.spent() == 0);
  CHECK_FALSE(RestartBudget::explains(admission(), {}));
}

TEST_CASE("restart budget: an admission between the attempts of a failure charges it", "[unit]") {
  RestartBudget b(5, true);
  b.on_failure();
  CHECK(b.on_round_gives_way(admission(), {}) == GiveWay::kCharged);
  CHECK(b.spent() == 1);
  b.on_round_formed(1);
  CHECK(b.spent() == 1);
}

TEST_CASE("restart budget: an admission after the last attempt's failure is a misuse", "[unit]") {
  // The agent waits only for a loss then: the failure ends the job.
  RestartBudget b(0, true);
  b.on_failure();
  CHECK_THROWS_AS(b.on_round_gives_way(admission(), {}), InternalError);
}

TEST_CASE("restart budget: a re-formation while the workers run charges nothing", "[unit]") {
  RestartBudget b(5, true);
  CHECK(b.on_round_gives_way(loss({0, 2}), {}) == GiveWay::kReform);
  CHECK(b.on_round_gives_way(admission(), {}) == GiveWay::kReform);
  CHECK(b.spent() == 0);
  b.on_failure();
  b.on_restart();
  CHECK(b.on_round_gives_way(admission(), {}) == GiveWay::kReform);
  CHECK(b.spent() == 1);
}

TEST_CASE("restart budget: a round formed adopts the job's count when higher", "[unit]") {
  RestartBudget b(5, true);
  b.on_round_formed(3);  // a node joining a running job
  CHECK(b.spent() == 3);
  b.on_round_formed(1);  // never lower
  CHECK(b.spent() == 3);
  b.on_failure();
  CHECK_THROWS_AS(b.on_round_formed(3), InternalError);  // a failure must be settled first
  b.on_restart();
  CHECK(b.spent() == 4);
  CHECK(b.on_failure().final == false);
  CHECK(b.on_round_gives_way(loss({0}), {}) == GiveWay::kRefunded);
  b.on_round_formed(5);  // another member charged it: the job's count wins
  CHECK(b.exhausted());
}

TEST_CASE("restart budget: a failure while one is pending, or a restart with none, is a misuse",
          "[unit]") {
  RestartBudget b(5, false);
  CHECK_THROWS_AS(b.on_restart(), InternalError);
  b.on_failure();
  CHECK_THROWS_AS(b.on_failure(), InternalError);
  CHECK_THROWS_AS(RestartBudget(-1, false), InternalError);
}
