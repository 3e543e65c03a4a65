// etcd-v3: a node's presence lease revoked from outside between the renewal
// that found it alive and the next round's entry (the window where an
// operator's `etcdctl lease revoke` raced the agents in a loaded run): the
// node comes back under a new lease and forms the round, instead of ending
// with "requested lease not found".

#include <catch2/catch.hpp>
#include <cstdlib>
#include <future>
#include <string>

#include "common/error.h"
#include "rendezvous/c10d_handler.h"
#include "tests/support/etcd_server.h"

using namespace ctorchrun;
using namespace ctorchrun::testing;
using namespace std::chrono_literals;

namespace {

rendezvous::C10dOptions etcd_node(const EtcdCluster& etcd, const std::string& host) {
  rendezvous::C10dOptions o;
  o.etcd_endpoints = etcd.client_endpoints();
  o.job.run_id = "lease-race";
  o.job.min_nodes = 1;
  o.job.max_nodes = 2;
  o.job.entrypoint = "train.py";
  o.job.host = host;
  o.join_timeout = 30s;
  o.last_call_timeout = 500ms;
  o.read_timeout = 5s;
  o.presence_ttl = 10s;
  o.poll_interval = 100ms;
  return o;
}

// Revokes every lease the cluster holds, with etcd's own client.
int revoke_all_leases(const EtcdCluster& etcd) {
  const std::string ctl =
      "ETCDCTL_API=3 /usr/bin/etcdctl --endpoints=" + etcd.client_endpoint(0) + " ";
  const std::string cmd = ctl + "lease list | tail -n +2 | while read id; do " + ctl +
                          "lease revoke $id >/dev/null || exit 1; done";
  return std::system(cmd.c_str());
}

}  // namespace

TEST_CASE(
    "etcd-v3: a presence lease revoked between its renewal and the next round's entry: the node "
    "comes back under a new lease and forms the round",
    "[multiproc]") {
  EtcdCluster etcd(1);
  int revoked = -1;
  auto ob = etcd_node(etcd, "node-b");
  // Armed for b's next round only: the lease goes right after renewal found
  // it alive, before the entry's first write.
  bool armed = false;
  ob.before_entry = [&] {
    if (armed) revoked = revoke_all_leases(etcd);
    armed = false;
  };
  auto a = std::make_unique<rendezvous::C10dHandler>(etcd_node(etcd, "node-a"));
  rendezvous::C10dHandler b(ob);
  auto first_a = std::async(std::launch::async, [&] { return a->next_rendezvous(); });
  auto first_b = std::async(std::launch::async, [&] { return b.next_rendezvous(); });
  const auto ia = first_a.get();
  const auto ib = first_b.get();
  REQUIRE(ia.group_world_size == 2);
  REQUIRE(ib.group_world_size == 2);
  const int a_rank = ia.group_rank;
  // a leaves; b re-forms without it, its lease revoked in the window.
  if (ia.withdraw) ia.withdraw();
  a.reset();
  armed = true;
  rendezvous::RendezvousInfo next;
  REQUIRE_NOTHROW(next = b.next_round({"node a left", {a_rank}, "agent left"}, 0));
  CHECK(revoked == 0);  // the fault did happen
  CHECK(next.group_world_size == 1);
  CHECK(next.round == ib.round + 1);
}
