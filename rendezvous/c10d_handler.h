#pragma once

// C10dHandler: torchrun's `--rdzv_backend=c10d`, and ours, etcd-v3. Every
// node is started with the same --rdzv_endpoint=HOST[:PORT] (etcd-v3: the
// cluster's members) and --rdzv_id; the rendezvous assigns group ranks by
// arrival (C10dState, rendezvous/c10d_state.h, documents the keys and
// transitions). Where the state lives and how presence is held is the
// Coordination's (rendezvous/coordination.h): the handler runs the same
// rounds over either.
//
// The endpoint's store (TcpCoordination): with is_host unset, an agent
// whose host owns the endpoint address tries to bind it on every address
// family its spellings reach (rendezvous/endpoint.h's bind_addresses_for:
// 127.0.0.1 and ::1 for localhost, 127.0.0.1 or [::1]; the dual-stack "::"
// for another address of this host), all or none; when another agent on
// this host already bound the first of them (whatever its spelling), or the
// address is not this host's, it connects as a client, so every spelling
// meets one store. is_host=1 makes a failed bind an IoError; is_host=0 never
// binds. A standalone ctorch-store at the endpoint serves as well (every
// agent is then a client).
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

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "rendezvous/c10d_options.h"
#include "rendezvous/c10d_state.h"
#include "rendezvous/coordination.h"
#include "rendezvous/handler.h"
#include "store/tcp_store.h"
#include "store/tcp_store_server.h"

namespace ctorchrun::rendezvous {

class C10dHandler : public Handler {
 public:
  explicit C10dHandler(C10dOptions options);
  ~C10dHandler() override;

  RendezvousInfo next_rendezvous() override;
  RendezvousInfo next_round(const MembershipChange& change, int attempt) override;
  const std::string& run_id() const override { return options_.job.run_id; }
  // This agent's presence goes now (etcd-v3: its lease is revoked).
  void abandon() noexcept override;
  // Enters the round after `previous` (renew_presence, then C10dState's
  // rejoin), coming back under a new lease when this node's presence lease
  // went between the renewal's check and the entry's first write.
  void rejoin(const C10dRound& previous, int attempt, const std::vector<int>& lost);
  // The endpoint's store ("rendezvous") when this agent hosts it, and the
  // round's workers' store ("workers") on group rank 0.
  std::vector<HostedStore> hosted_stores() override;

  // True when this agent hosts the endpoint's store (after next_rendezvous).
  bool hosts_endpoint() const { return coord_ && coord_->hosts_endpoint(); }

 private:
  // Presence this node lost (an etcd lease that expired or was revoked) is
  // bound anew before it enters a round again.
  void renew_presence();
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
  // Where the agents coordinate (the endpoint's TCP store, or etcd), and
  // what it gives: the agents' store and further connections to it under a
  // prefix, for threads of their own.
  std::unique_ptr<Coordination> coord_;
  // coord_, for abandon() and hosted_stores() on any thread
  std::atomic<Coordination*> coord_live_{nullptr};
  std::string endpoint_;  // coord_->describe(), for messages
  std::string job_prefix_;
  std::shared_ptr<store::Store> conn_;
  OpenStore open_background_;
  std::shared_ptr<store::Store> job_;
  std::unique_ptr<C10dState> state_;
  std::optional<C10dRound> round_;
  // This member's presence in the round (a connection whose keys vanish
  // with it) and the key it holds there.
  std::shared_ptr<store::Store> presence_;
  std::string presence_key_;
  std::unique_ptr<store::TcpStoreServer> workers_server_;  // this round's, on group rank 0
  std::mutex servers_mutex_;  // workers_server_'s changes against hosted_stores()
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
