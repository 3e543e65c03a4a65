#pragma once

// Coordination: where the agents of an elastic job keep the rendezvous state
// (rendezvous/c10d_state.h's keys) and how they learn that one of them is
// gone. C10dHandler drives the same state machine over either implementation:
//
//  - TcpCoordination (--rdzv_backend=c10d): the store at --rdzv_endpoint,
//    speaking torch's TCPStore protocol. An agent whose host owns the
//    endpoint's address may host it (C10dOptions::is_host). Presence: keys
//    bound to a connection of the agent's own (store/protocol.h's BIND_KEYS),
//    which the store deletes, leaving a gone marker, when that connection
//    closes. Membership is polled (a few reads a monitor tick).
//  - EtcdCoordination (--rdzv_backend=etcd-v3): an etcd cluster, any member
//    of which serves, under <etcd_prefix>/. Presence: keys on a lease this
//    agent keeps alive; they go when it expires or is revoked. Membership is
//    learned from a watch on the generation's keys; members other than group
//    rank 0 also probe rank 0's workers' store, whose closing shows rank 0's
//    death before its lease expires.
//
// Both give: the agents' store and a factory of further connections for
// threads of their own; the presence store; how the workers' store's address
// is chosen (the route towards the coordination service); how long the
// store may stay silent before the job ends; the end-of-job tidy; and giving
// up presence at once when the agent leaves.
//
// Threads: open() and renew() run on the agent's thread; abandon() also
// runs on the signal thread (a signal while no workers run), at any time,
// even while open() runs; the functions returned (background,
// membership_check's result, tidy) may be called from any thread and own
// what they need.

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "rendezvous/c10d_options.h"
#include "rendezvous/c10d_state.h"
#include "rendezvous/endpoint.h"
#include "rendezvous/handler.h"
#include "store/store.h"

namespace ctorchrun::rendezvous {

// A new connection to the agents' store whose keys are under `prefix`, with
// its own timeout.
using OpenStore = std::function<std::shared_ptr<store::Store>(const std::string& prefix,
                                                              std::chrono::milliseconds timeout)>;
// The monitor's membership check (RendezvousInfo::check_membership).
using MembershipCheck = std::function<std::optional<MembershipChange>(int attempt)>;

class Coordination {
 public:
  virtual ~Coordination() = default;

  // Reaches the coordination service (bounded by join_timeout), hosts the
  // endpoint's store when it is this agent's to host, and binds this agent's
  // presence. Throws as Handler::next_rendezvous (TimeoutError, IoError,
  // ConfigError, Error).
  virtual void open() = 0;

  // The service, for messages: "host:port" or "etcd host:port,...".
  virtual const std::string& describe() const = 0;
  // The agents' store; the job's keys are under job_prefix() there.
  virtual std::shared_ptr<store::Store> store() const = 0;
  virtual const std::string& job_prefix() const = 0;
  // Further connections (the monitor's, a leaving agent's).
  virtual OpenStore background() const = 0;
  // This agent's presence: a store whose keys vanish with this agent (under
  // job_prefix()), or null when the store cannot bind keys (the heartbeats
  // then tell a lost agent).
  virtual std::shared_ptr<store::Store> presence() const = 0;
  // Whether this agent hosts the endpoint's store (it then leaves last).
  virtual bool hosts_endpoint() const = 0;
  // The endpoint's store's counts when this agent hosts it (any thread).
  virtual std::optional<store::TcpStoreServer::Stats> endpoint_stats() { return std::nullopt; }

  // Where the workers' store's address is routed towards when --local_addr
  // is not given: the endpoint, or the first etcd member.
  virtual Endpoint route_target() const = 0;
  // The store's silence that a member tolerates (RendezvousInfo::store_grace,
  // liveness_window); zero: the defaults.
  virtual void set_tolerance(RendezvousInfo& info) const = 0;

  // The monitor's membership check of `round`, built on `full_check` (a
  // C10dRoundWatch::check on a connection of the monitor's): called as is,
  // or only when a watch reports a change (etcd).
  virtual MembershipCheck membership_check(const C10dRound& round, MembershipCheck full_check,
                                           std::function<bool()> rank0_gone) = 0;
  // Whether members other than group rank 0 probe rank 0's workers' store.
  virtual bool probes_rank0() const = 0;

  // Before this node enters a round again: presence it lost (an etcd lease
  // that expired or was revoked) is bound anew. Returns true when it was, so
  // that the presence key is written again.
  virtual bool renew() = 0;
  // At the job's end, on the store host: removes what the job kept in a
  // store that outlives it (etcd), but the closed marker. Null: nothing to do.
  virtual std::function<void()> tidy(const C10dRound& round) const = 0;
  // The agent leaves: its presence goes now, not at an expiry.
  virtual void abandon() noexcept = 0;
};

// rendezvous/tcp_coordination.cc and rendezvous/etcd_coordination.cc.
std::unique_ptr<Coordination> make_tcp_coordination(const C10dOptions& options);
std::unique_ptr<Coordination> make_etcd_coordination(const C10dOptions& options);

// TcpCoordination for an empty options.etcd_endpoints, else EtcdCoordination.
inline std::unique_ptr<Coordination> make_coordination(const C10dOptions& options) {
  return options.etcd_endpoints.empty() ? make_tcp_coordination(options)
                                        : make_etcd_coordination(options);
}

}  // namespace ctorchrun::rendezvous
