#pragma once

// rendezvous::Handler: answers "who is in this job, what is my group rank,
// where is the store". The shape of torchelastic's RendezvousHandler.

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/error.h"
#include "store/store.h"
#include "store/tcp_store_server.h"

namespace ctorchrun::rendezvous {

// What one node announced when it joined (rendezvous/node_record.h: its
// record, one JSON shape on every backend).
struct NodeInfo {
  int group_rank = 0;
  int local_world_size = 0;
  std::string host;
  int pid = 0;
  bool hosts_endpoint = false;  // c10d: this node's agent hosts the endpoint's store
};

// The settings of a job that every node is started with, the rendezvous
// makes the nodes agree on (a node whose settings differ is refused, naming
// both values), and how this node announces itself. Shared by the options of
// both handlers (StaticOptions, C10dOptions).
struct JobSettings {
  std::string run_id = "none";
  int min_nodes = 1;  // static: min_nodes == max_nodes == --nnodes
  int max_nodes = 1;
  int max_restarts = 0;
  std::string entrypoint;       // the script (c10d compares it; static does not)
  int local_world_size = 1;     // this node's workers
  std::string host;             // this node's name or address as announced to others
  store::ServerOptions server;  // limits of a store this node hosts (address set by the handler)
};

// Why a running round gives way to the next (c10d).
struct MembershipChange {
  std::string reason;
  std::vector<int> lost;  // group ranks of the round not expected back
  // Why they are lost: "agent exited", "heartbeat timeout"; empty when none is.
  std::string cause;
};

struct RendezvousInfo {
  // The agents' own namespace of the job's store (keys there never collide
  // with torch's). Shared by the agent's threads only through `connect`.
  std::shared_ptr<store::Store> store;
  // Opens another connection to the same namespace, for a thread of its own
  // (a blocking wait on one connection must not stall another thread).
  std::function<std::shared_ptr<store::Store>()> connect;
  // The raw-key prefix of that namespace on the wire ("/ctorchrun/").
  std::string namespace_prefix;
  int round = 0;  // c10d: the round these members formed (static: 0)
  // The job's --max_restarts as its nodes agreed on it (the static job's
  // record, the c10d settings): the restart budget every node uses. Unset: a
  // backend that agrees on none; the node's own flag.
  std::optional<int> max_restarts;
  int group_rank = 0;
  int group_world_size = 0;
  // The job's world size and this node's first global rank (the sum of the
  // local world sizes of the lower group ranks). 0 with `nodes` given: the
  // caller sums them there.
  int world_size = 0;
  int base_rank = 0;
  // Every member's record, indexed by group rank. An elastic backend may
  // leave it empty (a round of N nodes would cost each O(N) bytes) and give
  // read_nodes instead: those who name every member (events, messages about
  // another node) read it then, once. Throws what the store throws.
  std::vector<NodeInfo> nodes;
  std::function<std::vector<NodeInfo>()> read_nodes;
  // Where workers reach the store (MASTER_ADDR, MASTER_PORT).
  std::string master_addr;
  int master_port = 0;
  // On the node that hosts the store: removes every key outside the agents'
  // namespace (what workers wrote) and returns how many. Empty elsewhere.
  std::function<size_t()> clear_worker_keys;
  // Whether this node publishes the job's liveness and leaves last (agent/
  // protocol.h's "store host"). Unset: the node with clear_worker_keys. c10d
  // sets it apart: the endpoint's host leaves last, while group rank 0 hosts
  // the workers' store.
  std::optional<bool> store_host;

  // Elastic backends (c10d); empty for the static one.
  // The job's restart count this round starts at (the next attempt).
  int attempt = 0;
  // From the agent's monitor thread, on a connection of its own: whether the
  // round must give way (set by this node for an admission that is due or a
  // member whose agent exited, or by another). Throws what the store throws.
  // `attempt`: the attempt now running (admissions take its gate).
  std::function<std::optional<MembershipChange>(int attempt)> check_membership;
  // Re-forms the round without change.lost (first writer wins: returns the
  // change that did). Thread-safe; a connection of its own.
  std::function<MembershipChange(const MembershipChange& change)> reform;
  // This node leaves the round on purpose (any outcome): its presence key is
  // withdrawn, so the others do not take it for lost.
  std::function<void()> withdraw;
  // This node leaves the running round on purpose (a signal stopped it while
  // its workers ran): one write that every member's check_membership sees
  // (they re-form without it, and a node waiting for the round counts it
  // gone), then withdraw. Bounded by a few seconds; a store that does not
  // answer is left alone. Empty for the static backend.
  std::function<void()> depart;
  // This member, whose round gives way, is about to stop its workers, which
  // takes up to `grace` (--shutdown_timeout): the next round waits for it
  // that long (plus a margin) rather than only last_call_timeout. Never
  // throws; empty for the static backend.
  std::function<void(std::chrono::milliseconds grace)> stopping;
  // Where the agents' store is ("host:port"), for messages; empty: master_addr.
  std::string store_endpoint;
  // How long the agents' store may not answer before the job ends; unset:
  // the liveness window (a store that fails over, etcd, sets more).
  std::optional<std::chrono::milliseconds> store_grace;
  // How long a node's heartbeats may stay silent before it counts dead;
  // unset: keep_alive_interval x keep_alive_max_attempt. Under etcd a lost
  // node's lease tells first, and heartbeats that a hung etcd member delays
  // must not tell otherwise: the handler sets more (the lease's TTL plus
  // read_timeout).
  std::optional<std::chrono::milliseconds> liveness_window;
  // This node's workers of `attempt` succeeded: no admission re-forms the
  // round in that attempt (false: one already does), and this node's
  // presence is withdrawn (it is done; its exit is no loss).
  std::function<bool(int attempt)> mark_finishing;
  // The job ended ("succeeded" or "failed"): closes the rendezvous id.
  std::function<void(const std::string& outcome)> close;
  // On the store host, last, after a successful job: removes what the job
  // kept in a store that outlives it (etcd), all but the closed marker.
  std::function<void()> tidy;
};

// A store this node hosts, as its server counts (--status_port's figures).
struct HostedStore {
  std::string role;  // "job" (static), "rendezvous" (c10d's endpoint), "workers"
  store::TcpStoreServer::Stats stats;
};

class Handler {
 public:
  virtual ~Handler() = default;
  // Joins the job and returns its membership. Throws TimeoutError (not every
  // node joined in time; the message names the endpoint and who is missing),
  // IoError (cannot host or reach the store), ConfigError (nodes disagree).
  virtual RendezvousInfo next_rendezvous() = 0;
  // After the round from the last call gave way (`change`): joins the next
  // round, carrying the job's restart count `attempt`. Elastic backends only.
  virtual RendezvousInfo next_round(const MembershipChange& change, int attempt) {
    (void)change;
    (void)attempt;
    throw InternalError("this rendezvous backend has no later rounds");
  }
  virtual const std::string& run_id() const = 0;
  // This agent exits at once (a signal while no workers run): releases what
  // holds its place so that the others see it gone now rather than when a
  // lease expires (etcd: revokes the presence lease; a TCP store sees the
  // connections close by itself). Bounded by a few seconds, never throws;
  // may be called from another thread than the agent's.
  virtual void abandon() noexcept {}
  // The stores this node hosts now, with their counts. Called from another
  // thread than the agent's (its status sampler) while rounds form; may
  // wait for a store's thread, never for the network.
  virtual std::vector<HostedStore> hosted_stores() { return {}; }
};

}  // namespace ctorchrun::rendezvous
