#pragma once

// C10dHandler: torchrun's `--rdzv_backend=c10d`. Every node is started with
// the same --rdzv_endpoint=HOST[:PORT] and --rdzv_id; the rendezvous assigns
// group ranks by arrival (C10dState, rendezvous/c10d_state.h, documents the
// keys and transitions).
//
// The endpoint's store: with is_host unset, an agent whose host owns the
// endpoint address tries to bind it on every address family its spellings
// reach (rendezvous/endpoint.h's bind_addresses_for: 127.0.0.1 and ::1 for
// localhost, 127.0.0.1 or [::1]; the dual-stack "::" for another address of
// this host), all or none; when another agent on this host already bound
// the first of them (whatever its spelling), or the address is not this
// host's, it connects as a client, so every spelling meets one store.
// is_host=1 makes a failed bind an IoError; is_host=0 never binds. A
// standalone ctorch-store at the endpoint serves as well (every agent is
// then a client).
//
// The agents' keys of a job live under "ctorchrun/<run_id>/" (rendezvous
// state) and "ctorchrun/<run_id>/r<round>/" (agent/protocol.h's keys for the
// round's attempts), so several ids share one store.
//
// The workers' store: each round, the agent of group rank 0 hosts a fresh
// store on a free port and publishes its address (rdzv/<R>/workers_store);
// workers reach it as MASTER_ADDR/MASTER_PORT, so they never read another
// round's or another job's keys, and that agent erases their keys between
// attempts. The address is advertise_addr (--local_addr) when given, else the
// local address this host uses to reach the endpoint (never a name).
// The agent that hosts the endpoint's store is the job's store host (it
// publishes liveness and leaves last); with a standalone store at the
// endpoint, group rank 0 is.
//
// Rounds: next_rendezvous() joins the round now forming; while the job runs
// the agent's monitor calls RendezvousInfo::check_membership, and when the
// round gives way (nodes wait to be admitted; a member was lost) the agent
// calls next_round(), which brings this node back into the next round ahead
// of newcomers. A node that arrives while the job runs with MAX nodes waits
// as a spare until a round has room for it or the job ends.
//
// Waits: connecting to the endpoint and forming a round are bounded by
// join_timeout, except while this node waits for a running job (a spare, or
// a newcomer until the next admission): that lasts as long as the job. Each
// store request is bounded by read_timeout; the wait for the next event is
// sliced into waits of at most poll_interval on the key that marks it.
// Throws as Handler::next_rendezvous: TimeoutError (naming who joined and
// the endpoint), IoError, ConfigError (settings differ, or a torchrun agent
// uses this id on the endpoint), JobClosedError (the job ended: before this
// node arrived, within the closed window, or while it waited), Error (the
// endpoint's store was lost while the round formed).

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "etcd/client.h"
#include "etcd/etcd_store.h"
#include "rendezvous/c10d_state.h"
#include "rendezvous/handler.h"
#include "store/tcp_store.h"
#include "store/tcp_store_server.h"

namespace ctorchrun::rendezvous {

struct C10dOptions {
  std::string endpoint_host = "127.0.0.1";  // brackets of an IPv6 literal allowed
  int endpoint_port = 29400;
  std::string run_id = "none";
  int min_nodes = 1;
  int max_nodes = 1;
  int max_restarts = 0;
  std::string entrypoint;
  int local_world_size = 1;
  std::string host;            // this node's name as announced to others
  std::string advertise_addr;  // where workers reach the workers' store; empty: found
  std::optional<bool> is_host;
  std::chrono::milliseconds join_timeout{600'000};
  std::chrono::milliseconds last_call_timeout{30'000};
  std::chrono::milliseconds read_timeout{60'000};
  // Bounds closing the rendezvous at the job's end: the endpoint's host waits
  // at most this long (and at most 3 s) for waiting nodes to learn the end.
  std::chrono::milliseconds close_timeout{30'000};
  // Connect and request timeout of the agent's background connections (its
  // monitor): short, so that an unreachable endpoint shows within the
  // liveness bound.
  std::chrono::milliseconds monitor_timeout{3'000};
  // --rdzv_backend=etcd-v3: the agents' state lives in this etcd cluster
  // ("host:port" members; any that answers serves), under etcd_prefix/<id>;
  // empty: the TCP store at endpoint_host:endpoint_port.
  std::vector<std::string> etcd_endpoints;
  std::string etcd_prefix = "/ctorchrun";
  // etcd: TLS with the members (every client this handler makes).
  etcd::EtcdTls etcd_tls;
  // etcd: the TTL of the lease that holds this agent's presence
  // (keep_alive_interval x keep_alive_max_attempt, at least 2 s).
  std::chrono::milliseconds presence_ttl{15'000};
  // Longest wait between two looks at the rendezvous (the store wakes the
  // waits on the keys that matter; this bounds how soon an end is seen).
  std::chrono::milliseconds poll_interval{1'000};
  // How long after a job's end a node of the same id is refused.
  // Unset: join_timeout.
  std::optional<std::chrono::milliseconds> closed_window;
  std::chrono::milliseconds wait_log_interval{30'000};
  store::ServerOptions server;  // limits of the hosted store (host, port set here)
};

class C10dHandler : public Handler {
 public:
  explicit C10dHandler(C10dOptions options);
  ~C10dHandler() override;

  RendezvousInfo next_rendezvous() override;
  RendezvousInfo next_round(const MembershipChange& change, int attempt) override;
  const std::string& run_id() const override { return options_.run_id; }
  // etcd-v3: revokes this agent's presence lease (its keys go now).
  void abandon() noexcept override;

  // True when this agent hosts the endpoint's store (after next_rendezvous).
  bool hosts_endpoint() const { return server_ != nullptr; }

 private:
  void host_endpoint_if_ours();
  void open_tcp_store();
  void open_etcd_store();
  // Polls the state machine until this node is in a complete round, then
  // sets up that round's workers' store.
  RendezvousInfo form();
  C10dRound form_round();
  // A waiting node that hosts the endpoint's store, when the job ends: keeps
  // the store up until the members have left (bounded).
  void linger_for_members();
  // The session of one round, for the agent: round_info composes the
  // duties below into the RendezvousInfo it returns.
  RendezvousInfo round_info(const C10dRound& round);
  struct WorkersStore {
    std::string addr;
    int port = 0;
  };
  // Group rank 0 hosts this round's workers' store and publishes where;
  // the others wait for that (RankZeroLost when rank 0 dies first).
  WorkersStore publish_workers_store(const C10dRound& round);
  // This member's presence key, and how it withdraws, announces stopping its
  // workers and leaves on purpose (info.withdraw, stopping, depart).
  void hold_presence(const C10dRound& round, RendezvousInfo& info);
  // The monitor's view of the round on a connection of its own (polled on a
  // TCP store, from a watch on etcd) and re-forming it (info.check_membership,
  // reform).
  void watch_membership(const C10dRound& round, const WorkersStore& workers, RendezvousInfo& info);
  // The end of the job: marking an attempt finishing, closing the id and
  // tidying etcd (info.mark_finishing, close, tidy).
  void set_up_ending(const C10dRound& round, RendezvousInfo& info);

  C10dOptions options_;
  std::string endpoint_;  // "host:port", for messages
  std::string job_prefix_;
  // The agents' store (the endpoint's TCP store, or etcd under etcd_prefix)
  // and how to open another connection to it, under a prefix, for a thread
  // of its own.
  std::shared_ptr<store::Store> conn_;
  std::function<std::shared_ptr<store::Store>(const std::string& prefix,
                                              std::chrono::milliseconds timeout)>
      open_background_;
  std::shared_ptr<etcd::EtcdClient> etcd_client_;  // etcd-v3 only
  // etcd-v3: the store whose keys live on this agent's lease (presence_
  // wraps it), and the lease's TTL.
  std::shared_ptr<etcd::EtcdStore> etcd_presence_;
  std::chrono::milliseconds lease_ttl_{0};
  // etcd-v3: when the lease expired (this agent was silent for its TTL: a
  // pause, a cut), the others have dropped this node; binds a new lease so
  // that it can come back as a newcomer. No-op otherwise.
  void renew_lease();
  std::shared_ptr<store::Store> job_;
  std::unique_ptr<C10dState> state_;
  std::optional<C10dRound> round_;
  // This member's presence in the round (a connection whose keys vanish
  // with it) and the key it holds there.
  std::shared_ptr<store::Store> presence_;
  std::string presence_key_;
  std::unique_ptr<store::TcpStoreServer> server_;          // the endpoint's store
  std::unique_ptr<store::TcpStoreServer> workers_server_;  // this round's, on group rank 0
};

// How long one wait between two polls of a forming round may last: at most
// poll_interval, and no longer than until this node's last call ends (plus
// 1 ms) or the deadline; at least 1 ms. until_last_call is max() when no last
// call runs.
std::chrono::milliseconds wait_slice(std::chrono::milliseconds poll_interval,
                                     std::chrono::milliseconds until_last_call,
                                     std::chrono::milliseconds until_deadline);

// The local address this host's packets to `host`:`port` leave from (a
// routing decision, no packet is sent). Throws IoError when none.
std::string local_address_towards(const std::string& host, int port);

}  // namespace ctorchrun::rendezvous
