#pragma once

// C10dState: the c10d rendezvous state machine, on any store::Store (the
// endpoint's TCP store, or HashStore in tests). It decides one round: who is
// in it, in which order, and when it is complete. It never sleeps and never
// reads a clock other than the injected one; the caller (C10dHandler) drives
// it: join() once, then poll() until it returns a round, waiting on
// wait_key() between polls, each wait with a deadline.
//
// State, under the store the caller passes (the job's namespace,
// "ctorchrun/<run_id>/"), all keys written with single atomic requests:
//
//   rdzv/settings        compare_set by every joining node, first writer wins:
//                        {"nnodes": "MIN:MAX", "max_restarts", "entrypoint"}.
//                        A node whose settings differ refuses (ConfigError
//                        naming the setting and both values) and writes nothing
//                        else.
//   rdzv/round           ADD counter: the round now forming (absent: 0).
//   rdzv/<R>/joined      ADD counter: a joining node's result is its arrival
//                        index i (1-based); its group rank is i-1.
//   rdzv/<R>/node/<i-1>  the node's record {"local_world_size", "host", "pid",
//                        "hosts_endpoint"},
//                        set once by that node right after its ADD.
//   rdzv/<R>/complete    compare_set once, from "" to the member count C: the
//                        round is closed to newcomers. Nodes 0..C-1 are its
//                        members; a node whose index is above C arrived late.
//   rdzv/<R>/workers_store  {"addr", "port"} of the store group rank 0 hosts
//                        for the round's workers (set by C10dHandler).
//
// Transitions of round R (no wall-clock comparison across hosts: each node
// times the last call on its own steady clock):
//   joined reaches MAX            -> the node that got index MAX sets
//                                    complete = MAX at once;
//   a node sees joined >= MIN     -> it starts its own last-call timer; when
//                                    last_call_timeout has passed on it, it
//                                    sets complete = joined (compare_set: the
//                                    first node to do so decides C for all).
//   So the round completes at most last_call_timeout plus one poll interval
//   after the MIN-th node joined, even if that node died meanwhile.
//
// Store requests per node: join() makes 4 (settings, round, joined, record);
// each poll() 1 while the round forms (2 once MIN is reached and the timer
// fires); the completed round's records are read with one multi_get (bytes
// O(N), requests O(1)).
//
// Thread safety: one C10dState per node and thread. Errors: ConfigError
// (settings differ), RendezvousClosedError (the node arrived after the round
// completed or beyond MAX: this version admits no node into a formed round),
// ProtocolError (a record it cannot read), and whatever the store throws.

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "rendezvous/handler.h"
#include "store/store.h"

namespace ctorchrun::rendezvous {

struct C10dSettings {
  int min_nodes = 1;
  int max_nodes = 1;
  int max_restarts = 0;
  std::string entrypoint;  // the script or module as given
};

struct C10dRound {
  int round = 0;
  int group_rank = 0;
  std::vector<NodeInfo> nodes;  // indexed by group rank
};

class C10dState {
 public:
  using Clock = std::chrono::steady_clock;

  C10dState(store::Store& job, C10dSettings settings, NodeInfo me,
            std::chrono::milliseconds last_call_timeout,
            std::function<Clock::time_point()> now = Clock::now);

  // Checks the job's settings and takes an arrival index in the round now
  // forming. Call once.
  void join();

  // One step: returns the round once it is complete (and this node in it).
  std::optional<C10dRound> poll();

  // The key whose appearance completes the round: wait on it between polls.
  std::string wait_key() const;

  // "2 of min 3, max 4 nodes joined round 0": for messages.
  std::string progress();

  int round() const { return round_; }
  int arrival_index() const { return index_; }

 private:
  std::string key(const std::string& what) const;
  C10dRound read_round(int members);

  store::Store& job_;
  C10dSettings settings_;
  NodeInfo me_;
  std::chrono::milliseconds last_call_timeout_;
  std::function<Clock::time_point()> now_;
  int round_ = -1;
  int index_ = 0;  // 1-based arrival index in round_
  std::optional<Clock::time_point> last_call_since_;
};

}  // namespace ctorchrun::rendezvous
