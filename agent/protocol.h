#pragma once

// The agents' cross-node protocol: the single contract between the agents of
// one job. Every key they keep in a store, its value's schema, who writes it,
// who waits on it, and the order of events in an attempt; with the headers it
// names (store/protocol.h for the TCP wire and BIND_KEYS, store/store.h for
// each operation's retry contract, rendezvous/c10d_state.h for the elastic
// rendezvous' transitions) a compatible agent can be written from here.
//
// ## Stores and namespaces
// Static (--rdzv_backend=static, --standalone): node 0 hosts one TCP store at
// master_addr:master_port; raw keys on the wire:
//   /ctorchrun/<key>            one job per store: its settings and admission
//   /ctorchrun/<run_id>/<key>   the job's agents (the keys below)
// Workers' keys (torch's "/worker/attempt_<k>/", "/default_pg/", ...) live
// outside "/ctorchrun/" and are erased by the store host between attempts.
// Elastic (c10d: the TCP store at --rdzv_endpoint, hosted by the agent whose
// host owns that address on every loopback family it names, or a standalone
// ctorch-store; etcd-v3: etcd under <etcd_prefix>/, default "/ctorchrun/"):
// per run id and generation G of that id
//   ctorchrun/<run_id>/generation             (etcd: <prefix><run_id>/generation)
//                                             decimal, the generation in use
//   ctorchrun/<run_id>/g<G>/rdzv/...          the rendezvous (below)
//   ctorchrun/<run_id>/g<G>/r<round>/<key>    the keys below, for that round
// and the workers use a store of their own that group rank 0 hosts each round
// (it erases their keys between attempts).
//
// ## The store host: who publishes liveness and leaves last
// Static: node 0. c10d: the agent that hosts the endpoint's store (the
// roster's "endpoint_node"); when no member does (a standalone store at the
// endpoint, or etcd-v3), group rank 0 of the round.
//
// ## Values, by key (all JSON unless said; a reader refuses anything else
// with a ProtocolError naming the key, and range-checks every index)
//   ctorchrun/job                 {"run_id": str, "nnodes": int,
//                                 "max_restarts": int}               (static)
//   nodes/<n>                     node record (static): {"host": str,
//                                 "pid": int, "local_world_size": 1..2^20,
//                                 "hosts_endpoint": bool}, the one shape of
//                                 every backend (rendezvous/node_record.h)
//   g<G>/rdzv/settings            {"nnodes": "MIN:MAX", "max_restarts": int,
//                                 "entrypoint": str}   first writer wins
//   g<G>/rdzv/attempt             decimal: the job's restart count, a
//                                 register that only grows (compare_set from
//                                 the value held: C10dState::raise_count)
//   g<G>/r<R>/restarts            decimal: the count after a failure charged
//                                 within round R, raised the same way by each
//                                 member that restarts its workers there
//   g<G>/rdzv/<R>/node/<slot>     node record + "attempt": int (the job's
//                                 restart count the node carries)
//   g<G>/rdzv/<R>/members/<slot>  [node record + "attempt" + "slot": str],
//                                 group-rank order, at most MAX: the full
//                                 list, written by the roster's builder
//                                 (<slot>) before "complete"; read only by
//                                 whoever names every member (events, the
//                                 rank table, messages naming a host)
//   g<G>/rdzv/<R>/complete        the compact roster (rendezvous/roster.h),
//                                 O(runs) bytes whatever N: {"slots":
//                                 [[kind "n"|"m", first, count]], "sizes":
//                                 [[local_world_size, count]], "attempt": int
//                                 (the round's count), "by": the builder's
//                                 slot, "node0": {"host", "pid"},
//                                 "endpoint_node": group rank or -1}; a
//                                 member takes its group rank from its slot,
//                                 its first global rank and WORLD_SIZE from
//                                 the sizes' prefix sums
//   g<G>/rdzv/<R>/reform          {"reason": str, "lost": [group ranks],
//                                 "cause": str}
//   g<G>/rdzv/<R>/workers_store   {"addr": numeric address, "port": 1..65535}
//                                 by group rank 0; the workers' MASTER_ADDR/PORT
//   g<G>/rdzv/<R>/gate/<k>        "admit" | "finishing", first writer wins
//   g<G>/rdzv/<R>/stopping/<g>    decimal ms: member g's stopping grace (bound)
//   g<G>/rdzv/<R>/present/<g>     decimal pid: member g's presence (bound)
//   g<G>/rdzv/<R>/done/<g>        "1": member g's workers succeeded (bound)
//   g<G>/rdzv/closed              {"outcome": str, "round": int,
//                                 "closed_at_ms": int, the closer's wall clock}
//   liveness                      {"seq": int, "dead": [node], "gone": [node]}
//   alive/<n>                     ADD counter
//   attempt/<k>/failure           FailureRecord (agent/failure_summary.h):
//                                 {"rank", "local_rank", "node_rank", "host",
//                                 "pid", "signaled", "exit_code", "signal",
//                                 "timestamp", "noticed_ns", "error_file",
//                                 "message", "attempt"}; first writer wins
//   gone/<n>, attempt/<k>/{all_done,all_stopped,clean}   "1"
//   attempt/<k>/stall/<n>         --hang_timeout: node n's local verdict
//                                 (agent/hang_detector.h NodeStall):
//                                 {"stalled_ms": int, "ranks": [{"rank",
//                                 "local_rank", "pid", "since_ms"}]}
//   attempt/<k>/stacks/<n>        after a hang verdict: node n's ranks and
//                                 the frame each was in (hang_diagnosis.h):
//                                 [{"rank": int, "frame": str}]
//
// ## Tallies (store/store.h), the wire form of every set and counter that
// many nodes enrol in at once (joined, entered, rejoined, left, closed_seen,
// attempt/<k>/finished, attempt/<k>/stopped): on a TCP store, APPEND of
// "<entry>," to the key, then ADD 1 to key + "#count" (the count is the place);
// on etcd, one key per enrolment under key + "#tally/", counted in the same
// transaction. Entries are decimal node or group ranks, or slot names.
//
// ## Bound keys: presence on each store
// A bound key vanishes with its writer. TCP store: written on a connection
// that sent BIND_KEYS (store/protocol.h); when it closes the server deletes
// the key and sets key + "#gone" to "1" (waits wake on it). etcd: the key is
// put on the writer's lease, with key + "#held" beside it; when the lease
// expires or is revoked the key goes and "#held" without the key reads as
// lost (etcd/etcd_store.h). Deleting a bound key on purpose leaves no gone
// marker (a leave, not a loss). Bound: present/<g>, node/<slot> (so a dead
// entrant's record vanishes), stopping/<g>, done/<g>.
//
// ## Timeouts both sides assume
// last_call_timeout (30 s), claim_timeout (10 s: a roster claim not followed
// by the roster within it is overridden), kStoppingMargin (5 s), the closed
// window (join_timeout, 600 s) and keep_alive_interval x
// keep_alive_max_attempt (dead without a heartbeat) are --rdzv_conf settings
// or constants of rendezvous/c10d_state.h; nodes of one job must share them.
//
// Admission (rendezvous/static_handler.cc), before any worker starts:
//   ctorchrun/job          set by node 0 before any node may announce itself:
//                          {"run_id", "nnodes", "max_restarts"}; a joining
//                          node reads it first (bounded by the rendezvous
//                          timeout) and refuses another run id or a formed job
//   ctorchrun/formed       set by node 0 once every node announced itself
//   nodes/<n>              node n's record (compare_set: a rank is taken once)
//   refused                why a node of this job refused it (nnodes or
//                          max_restarts differ); every waiting node stops
//   nodes_read, nodes_all_read
//                          ADD counter of nodes that read the records; node 0
//                          keeps the store up until all did (at most 10 s)
//
// Liveness (agent/job_monitor.h), from the rendezvous until a node leaves:
//   alive/<n>              ADD counter: node n's heartbeat, written by node n
//                          alone every keep_alive_interval
//   liveness               written by the store host alone, every
//                          keep_alive_interval: {"seq", "dead", "gone"}. A node
//                          is dead when its heartbeat did not move for
//                          keep_alive_interval x keep_alive_max_attempt; gone
//                          lists the nodes that said they left. The others read
//                          this one key: O(1) store requests per node and
//                          interval, O(N) on the host alone.
//   gone/<n>               set by node n when it leaves for good (any outcome).
//                          Elastic jobs: a node that leaves on purpose (a
//                          signal while its workers run) first enrols in its
//                          round's left tally, which every member reads, so
//                          that the round re-forms whoever publishes liveness
//
// Hangs (agent/hang_detector.h), with --hang_timeout > 0, while workers run:
//   attempt/<k>/stall/<n>  set by node n once a second (and at once when all
//                          its workers have been stalled for the timeout):
//                          one request per node and interval
//   attempt/<k>/failure    the host, while its own workers are all stalled,
//                          reads every stall key (check + multi_get); when
//                          every node reports stalled_ms >= timeout it
//                          compare_sets the failure record with "hang": true
//                          and the rank whose stall began first. Every node
//                          then collects its workers' stacks (at most 8 s)
//                          and sets attempt/<k>/stacks/<n>; the node of that
//                          rank waits for them until 10 s after the verdict
//                          and prints the summary. Then as any failure (3b).
//
// One attempt k (k = 0 .. max_restarts), on every node:
//   1. start the local workers (TORCHELASTIC_RESTART_COUNT=k);
//   2. watch: a local worker fails -> compare_set attempt/<k>/failure with
//      this node's root-cause record (the first writer wins: the job's root
//      cause); every node's monitor waits on that key and wakes its agent;
//      a dead or departed node, or the store lost, ends a static job (exit 3);
//   3a. all local workers succeeded -> the exit barrier:
//        attempt/<k>/finished  tally (store/store.h) of "<n>", by each node whose workers
//                              succeeded; the node whose read-back lists all N
//                              sets attempt/<k>/all_done (one request a second
//                              tells a waiting node who still runs workers)
//       A node waits on all_done without limit while another node is alive
//       and has neither finished nor left (a failure there still restarts the
//       job: attempt/<k>/failure ends the barrier); exit_barrier_timeout bounds
//       only a wait for nodes whose liveness is unknown. The store host then
//       waits for gone/<n> of every live node: it leaves last.
//   3b. a failure anywhere -> every node stops its workers, then:
//        attempt/<k>/stopped   tally of "<n>" once node n's workers are stopped;
//                              the node that completes the list sets
//                              attempt/<k>/all_stopped
//        attempt/<k>/clean     set by the store host once it erased the
//                              workers' keys (not on the last attempt)
//       Each wait is bounded by the liveness of the nodes waited for and by a
//       deadline (shutdown_timeout plus the liveness window plus a margin);
//       its error names the nodes that did not report. Then attempt k+1, or,
//       after the last, exit 1 (the store host waits up to 10 s for
//       all_stopped so that every node reads the failure first). The last
//       is max_restarts as the nodes agreed on it (ctorchrun/job, the c10d
//       settings: RendezvousInfo::max_restarts).
//       Elastic: the round giving way ends these waits. The failure is then
//       refunded when the change names a member that is not in
//       attempt/<k>/stopped (read after the change was seen), and the next
//       round runs attempt k again; otherwise it is charged (k+1). An
//       admission names the members lost or left by then (the member that
//       admits looks at every one), so a loss that failed the workers is not
//       charged to it. Before the last attempt's failure ends the job, a node
//       waits up to the liveness bound for such a loss.
//       agent/restart_budget.h holds the rule.
//       The job's count in the store, so that a round formed when none of
//       the nodes that carried it is left goes on from it: each node that
//       restarts after a charged failure raises restarts (its round's) to
//       k+1 before the next attempt's workers start, one compare_set
//       expecting what the round's last restart wrote (none: missing), more
//       only when it finds another value; a node coming back from a round
//       whose failure was charged as it gave way raises rdzv/attempt as it
//       rejoins (C10dState); a round's builder folds both into the roster's
//       "attempt" and rdzv/attempt. A raise is idempotent (a replay finds the
//       value there, store/store.h); the register is read without waiting.

#include <string>

namespace ctorchrun::agent::keys {

inline std::string attempt_key(int attempt, const char* what) {
  return "attempt/" + std::to_string(attempt) + "/" + what;
}

inline std::string alive(int node) { return "alive/" + std::to_string(node); }
inline std::string gone(int node) { return "gone/" + std::to_string(node); }
inline std::string liveness() { return "liveness"; }

inline std::string failure(int attempt) { return attempt_key(attempt, "failure"); }
inline std::string stopped(int attempt) { return attempt_key(attempt, "stopped"); }
inline std::string all_stopped(int attempt) { return attempt_key(attempt, "all_stopped"); }
inline std::string clean(int attempt) { return attempt_key(attempt, "clean"); }
inline std::string finished(int attempt) { return attempt_key(attempt, "finished"); }
inline std::string all_done(int attempt) { return attempt_key(attempt, "all_done"); }
inline std::string stall(int attempt, int node) {
  return attempt_key(attempt, "stall/") + std::to_string(node);
}
inline std::string stacks(int attempt, int node) {
  return attempt_key(attempt, "stacks/") + std::to_string(node);
}

}  // namespace ctorchrun::agent::keys
