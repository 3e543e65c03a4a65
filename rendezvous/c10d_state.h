#pragma once

// The c10d rendezvous state machine, on any store::Store (the endpoint's TCP
// store; HashStore in tests; any store with compare_set, add, append and
// wait). It never sleeps and reads no clock but the injected ones; the caller
// (C10dHandler) drives it: join() once, then poll() until it returns a round,
// waiting on wait_key() between polls, each wait with a deadline. While the
// round runs, a C10dRoundWatch (on a connection of its own) tells whether it
// must make way for the next; after that, rejoin() and poll() again.
//
// ## Keys
// Under the store the caller passes (the job's namespace, "ctorchrun/<id>/"):
//
//   generation           the generation of the id now in use (decimal, moved
//                        forward by compare_set); its keys are under g<G>/.
//   g<G>/rdzv/settings   compare_set by every joining node, first writer wins:
//                        {"nnodes": "MIN:MAX", "max_restarts", "entrypoint"}.
//                        A node whose settings differ refuses (ConfigError
//                        naming the setting and both values), writing nothing.
//   g<G>/rdzv/round      a hint: the newest round that completed (set by the
//                        node that completed it).
//   g<G>/rdzv/attempt    the job's restart count (decimal; missing: 0), a
//                        register that only grows (raise_count: compare_set
//                        from the value it holds). Raised by a roster's
//                        builder to the roster's count before it publishes
//                        the roster, and by a member that comes back carrying
//                        more than its round started with (a failure charged
//                        in that round) before it enters the next. A new
//                        generation starts from 0.
//   g<G>/r<R>/restarts   not a rendezvous key: in round R's agents'
//                        namespace (agent/protocol.h), the count after a
//                        failure charged within round R, raised (raise_count)
//                        by each member that restarts its workers there,
//                        before they start. The builder of round R+1 reads it.
//   g<G>/rdzv/<R>/...    round R:
//     joined             tally (store.h): a newcomer's place i (its slot "n<i>")
//     node/<slot>        a node's record (rendezvous/node_record.h: "host",
//                        "pid", "local_world_size", "hosts_endpoint") and
//                        "attempt" (the job's restart count it carries; 0
//                        for a node new to the job). Slots: "n<i>" for the
//                        i-th newcomer, "m<g>" for the member of round R-1
//                        with group rank g, coming back.
//     entered            tally of slots, once the node's record is written
//                        and visible (a round trip on the presence
//                        connection after its SET); its count says who made
//                        MIN/MAX
//     rejoined           tally: members of R-1 that came back
//     min                set by the node whose count reached MIN: the start of
//                        every node's last call
//     claim              compare_set: the node that builds the roster
//     members/<slot>     set by the node holding <slot> as it builds the
//                        roster, before "complete": the full list
//                        [record + "slot"] in group-rank order. Read only by
//                        those who name every member (events, messages):
//                        C10dState::read_members; it outlives the records.
//     complete           compare_set once: the compact roster, O(runs)
//                        bytes whatever N (rendezvous/roster.h): {"slots",
//                        "sizes" (runs), "attempt", "by" (the builder's
//                        slot: its members/<slot> is the full list),
//                        "node0": {"host", "pid"} (group rank 0's record),
//                        "endpoint_node" (the group rank hosting the
//                        endpoint's store, -1: none)}. A member finds its
//                        group rank from its slot and its first global rank
//                        from the sizes' prefix sums, reading no other
//                        record. "attempt" is the round's restart count: the
//                        highest of its members' records, rdzv/attempt and
//                        r<R-1>/restarts. Members of R-1 come
//                        first in their old order, then newcomers by arrival,
//                        at most MAX. A node left out enters round R+1 as a
//                        newcomer (a spare while the job runs at MAX).
//     reform             compare_set once, by a member of R: round R makes way
//                        for R+1: {"reason", "lost": [group ranks in R]}. This
//                        opens R+1; no round R+1 completes before it.
//     gate/<k>           compare_set once per attempt k: "admit" (an
//                        admission re-forms the round) or "finishing" (a
//                        member's workers succeeded: no admission in attempt k,
//                        re-forming would redo work); whichever comes first
//     stopping/<g>       member g of R, giving way, stops its workers within
//                        this many ms (its --shutdown_timeout; bound to its
//                        agent): round R+1 waits for it that long plus
//                        kStoppingMargin instead of only last_call_timeout
//     done/<g>           member g's workers succeeded (bound to its agent,
//                        set as it withdraws its presence/<g>)
//     left               tally of the group ranks of R's members that left
//                        on purpose (C10dRoundWatch::leave); entries that are
//                        no group rank of R are ignored
//   g<G>/rdzv/closed     {"outcome", "round", "closed_at_ms"}: the job ended
//                        (succeeded, or its restarts ran out). A node arriving
//                        within `closed_window` of closed_at_ms is refused
//                        (JobClosedError); after that it moves the id to
//                        generation G+1, a fresh job.
//   g<G>/rdzv/closed_seen  tally: each waiting node that saw `closed`
//
// ## Transitions of round R
//   open:      R = 0, or rdzv/<R-1>/reform is set.
//   complete:  when open and one of
//     - count reached MAX (the node whose tally_add returned MAX completes it),
//     - every member of R-1 not listed as lost has come back and count >= MIN
//       (the last of them completes it: no last call after a re-formation),
//     - count >= MIN and last_call_timeout has passed on a node's own steady
//       clock since it saw rdzv/<R>/min; after a re-formation, while a member
//       of R-1 expected back has not entered and announced it is stopping
//       its workers (stopping/<g> of R-1), its grace plus kStoppingMargin
//       instead when that is longer, so that a member that needs its whole
//       --shutdown_timeout is not left out.
//     Completing = compare_set(claim) then compare_set(complete); a claim
//     not followed by a roster within claim_timeout is taken over by one
//     node (compare_set from the stale claimant's slot), whose own claim
//     then gets claim_timeout in turn. The
//     roster holds only the entrants whose records exist at that moment (one
//     check and one multi_get, or a non-waiting read per record,
//     store::read_if_present): one that died (its record, on its presence
//     connection, vanished) or left on purpose (withdrew it) is left out,
//     and nothing waits for a record that can vanish. Fewer than MIN left:
//     the claim goes and the round waits for more.
//   reform (C10dRoundWatch, any member):
//     - admission: live nodes (their records there) wait in round R+1,
//       round R has fewer than MAX
//       members, last_call_timeout has passed since this member saw R complete
//       (so at most one admission per last call), and it takes the attempt's
//       gate before any member's workers finish. It then looks at every
//       member, not only the one it watches: a member lost or left is named
//       in the reform (a re-formation that admits too), so that a failure
//       the loss caused is refunded (agent/restart_budget.h), not charged to
//       an admission;
//     - every member gone: a node waiting in R+1 finds every member lost
//       (its presence's, its record's or its done key's gone marker) or left
//       (the left tally); it looks at one per poll and re-forms R itself;
//     - leave: a member is in R's left tally (every member reads it each
//       check, so a leave is seen whoever watches whom);
//     - loss: a member's presence key vanished with its agent (the next member
//       sees its gone marker and lists every member whose marker is there),
//       or the caller names the lost members (C10dRoundWatch::reform; the
//       agent does for a heartbeat timeout).
//   present/<g> (per round): member g's presence (C10dRoundWatch::present_key)
//   Wall clocks of different hosts are never compared, with one exception
//   that decides nothing about a running job: closed_at_ms, the closing
//   node's wall clock, against an arriving node's, to end the closed window.
//
// ## Cost
// A newcomer's entry is 5 requests plus the settings' compare_set; a
// member's return 6, plus 1 (rarely 2) when it carries a failure charged in
// its round; each poll() at most 4; building the roster 7 (it reads the
// entrants' records and writes the full list: bytes O(N), on one node), plus
// one when the count grew and one per entrant when some entrant's record is
// gone; reading it 1, O(runs) bytes: the same few bytes at any N when the
// slots and local world sizes run alike. The full list (read_members) is 1
// request of O(N) bytes, for whoever names every member. A member's check() is 3 requests, plus 2
// to 3 when nodes wait, plus at the admission (once per attempt) 1, or 1 to 2 per member when some
// member's presence is not there. A restart within a round costs each member 1 request
// (raise_count). Waiting is on keys the store wakes, so a poll runs once a slice of the caller, not
// in a busy loop.
//
// Thread safety: one C10dState per node, used by one thread at a time.
// Errors: ConfigError (settings differ), JobClosedError (the job ended),
// ProtocolError (a record it cannot read), InternalError (misuse), and
// whatever the store throws.

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/error.h"
#include "rendezvous/handler.h"
#include "rendezvous/roster.h"
#include "store/store.h"

namespace ctorchrun::rendezvous {

struct C10dSettings {
  int min_nodes = 1;
  int max_nodes = 1;
  int max_restarts = 0;
  std::string entrypoint;  // the script or module as given
};

struct C10dRound {
  int generation = 0;
  int round = 0;
  int group_rank = 0;
  // The members in compact form (rendezvous/roster.h): each one's slot and
  // local world size by group rank, the prefix sums of the local world
  // sizes. Their records (hosts, pids) are read only on demand:
  // C10dState::read_members.
  Roster roster;
  // Group rank 0's record (it hosts the workers' store; messages name it).
  NodeInfo node0;
  // The member whose agent hosts the endpoint's store; -1: none does.
  int endpoint_node = -1;
  // The slot of the node that built the roster: the full list is at
  // members/<builder>.
  std::string builder;
  // The job's restart count when this round starts: the highest any member
  // carries (a node carries the count it last ran with; a fresh one 0) or
  // the store keeps (rdzv/attempt, the previous round's restarts).
  int attempt = 0;
  // The job's --max_restarts, as its nodes agreed on it (rdzv/settings).
  int max_restarts = 0;
};

// The job this node tried to join has ended.
class JobClosedError : public RendezvousClosedError {
 public:
  JobClosedError(const std::string& what, std::string outcome, bool while_waiting, bool was_member)
      : RendezvousClosedError(what),
        outcome_(std::move(outcome)),
        while_waiting_(while_waiting),
        was_member_(was_member) {}
  const std::string& outcome() const { return outcome_; }
  // True: this node waited (a spare, or to be admitted) when the job ended.
  // False: it arrived after the end, within the closed window.
  bool while_waiting() const { return while_waiting_; }
  // True: this node had run in a round of the job (its end is this node's).
  bool was_member() const { return was_member_; }

 private:
  std::string outcome_;
  bool while_waiting_;
  bool was_member_;
};

// Added to a member's announced grace: the time from its workers' stop to
// its entry in the next round.
inline constexpr std::chrono::milliseconds kStoppingMargin{5'000};

struct C10dTiming {
  std::chrono::milliseconds last_call_timeout{30'000};
  // How long after closing an arriving node is refused (join_timeout).
  std::chrono::milliseconds closed_window{600'000};
  // How long a claim may go without a roster before another node builds it.
  std::chrono::milliseconds claim_timeout{10'000};
};

class C10dState {
 public:
  using Clock = std::chrono::steady_clock;
  using WallClock = std::chrono::system_clock;

  // `presence`, when given, is a connection whose keys vanish with this agent
  // (store/protocol.h's BIND_KEYS, on the same store and namespace as `job`):
  // the node's records go there, so that a node that dies before its round
  // completes is left out of it.
  C10dState(store::Store& job, C10dSettings settings, NodeInfo me, C10dTiming timing,
            std::function<Clock::time_point()> now = Clock::now,
            std::function<WallClock::time_point()> wall_now = WallClock::now,
            store::Store* presence = nullptr);

  // Finds the id's generation (refusing a job closed within the window),
  // checks the settings and enters the round now forming as a newcomer.
  // Call once.
  void join();

  // After `previous` (this node's round) was re-formed: enters the next round
  // as that round's member, carrying `attempt` (the job's restart count);
  // one above previous.attempt is raised in rdzv/attempt first.
  // `lost` are the members of `previous` not expected back; a node listed
  // there itself enters as a newcomer.
  void rejoin(const C10dRound& previous, int attempt, const std::vector<int>& lost);
  // Writes this node's entry of the round it entered again, after the entry
  // failed at its first write (the record on the presence connection, whose
  // lease was revoked meanwhile) and the presence is held anew: nothing of
  // the entry had been written.
  void reenter() { enter(slot_, attempt_); }

  // One step: the round once it is complete with this node in it. A node left
  // out moves to the next round (spare() tells whether it waits for a running
  // job). Throws JobClosedError when the job ends meanwhile.
  std::optional<C10dRound> poll();

  // The key whose appearance is the next event: wait on it between polls.
  std::string wait_key() const;

  // True while this node waits for a round that is not open: the job runs
  // with MAX nodes, or re-forms only at its next admission.
  bool waiting() const { return !open_; }
  // True while it waits and the running round has MAX nodes.
  bool spare() const { return !open_ && running_members() >= settings_.max_nodes; }
  // How long until this node's last call ends (max() when none runs).
  // After a re-formation it may last longer than last_call_timeout: see
  // stopping/<g> above.
  std::chrono::milliseconds until_last_call() const;

  // Marks the job ended (first caller's outcome wins); later arrivals are
  // refused for closed_window. Returns how many nodes wait for a round
  // (spares) at that moment.
  int close(const std::string& outcome);
  // How many waiting nodes have seen the job's end.
  int closed_seen();

  // Marks attempt `attempt` of the running round (after poll returned it)
  // finishing: no admission re-forms it. One compare_set on the attempt's
  // gate, which an admission takes too: false when an admission came first
  // (the round re-forms).
  bool mark_finishing(int attempt);

  // Every member's record of `round` in group-rank order (group_rank set):
  // the full list its builder wrote (members/<builder>). One request, O(N)
  // bytes, never waiting; it stays after a member is lost. ProtocolError
  // when it is missing (a store tidied since) or does not match the roster.
  static std::vector<NodeInfo> read_members(store::Store& job, const C10dRound& round);

  // "2 of min 3, max 4 nodes joined round 0": for messages.
  std::string progress();

  int generation() const { return generation_; }
  int round() const { return round_; }
  const std::string& slot() const { return slot_; }

  // "g<G>/rdzv/<R>/<what>".
  static std::string round_key(int generation, int round, const std::string& what);
  static std::string closed_key(int generation);

  // The job's restart count in the store (see the keys above).
  // "g<G>/rdzv/attempt": the register every roster folds in.
  static std::string count_key(int generation);
  // Round R's agents' namespace holds kRestartsKey ("g<G>/r<R>/restarts"
  // here; "restarts" in RendezvousInfo::store): raised by each member that
  // restarts its workers in round R after a charged failure, before they
  // start; the builder of round R+1 folds it in.
  static constexpr const char* kRestartsKey = "restarts";
  static std::string restarts_key(int generation, int round);
  // Raises the register at `key` (decimal; missing reads 0) to `count` (> 0)
  // and returns what it holds then (`count` or more): compare_set expecting
  // `believed` (what the caller believes it holds; 0: missing), then from
  // each value found until it holds `count` or more. One request when the
  // belief is right or another writer raised it as far, at most count + 2.
  // The first request is the write: an answer lost after it applied leaves
  // the count there. Idempotent: a replay of a swap that applied finds
  // `count` there (store.h's retry contract), a later raise finds it done.
  // ProtocolError when the key holds no number.
  static int raise_count(store::Store& store, const std::string& key, int count, int believed);
  // The register at `key`, 0 when missing; 1 request, never waits.
  static int read_count(store::Store& store, const std::string& key);

 private:
  std::string key(const std::string& what) const { return round_key(generation_, round_, what); }
  void check_settings();
  void enter_as_newcomer(int round, int attempt, bool open);
  // Members of a round of `size` that are not in `lost`.
  static int expected_members(int size, const std::vector<int>& lost);
  static std::vector<int> expected_ranks(int size, const std::vector<int>& lost);
  // A waiting node: re-forms the running round when all its members are gone.
  void watch_running_round();
  void enter(const std::string& slot, int attempt);
  std::string record_json(int attempt) const;
  // Claims and builds round_'s roster, unless another node holds a fresh claim.
  void try_complete();
  C10dRound read_roster(const std::string& raw);
  // The longest announced grace (plus kStoppingMargin) of the members of
  // round_-1 expected back that have not entered yet; 0 when none.
  std::chrono::milliseconds stopping_wait();
  // The value of each key that exists now (nullopt for one that does not),
  // without waiting on any: the records of entrants that may have died.
  std::vector<std::optional<std::string>> present_records(const std::vector<std::string>& keys);
  void check_closed(bool while_waiting);

  store::Store& job_;
  store::Store* presence_;
  C10dSettings settings_;
  NodeInfo me_;
  C10dTiming timing_;
  std::function<Clock::time_point()> now_;
  std::function<WallClock::time_point()> wall_now_;

  int generation_ = 0;
  int round_ = -1;
  std::string slot_;
  int expected_back_ = 0;           // members of round_-1 expected to come back (0: a newcomer)
  std::vector<int> expected_list_;  // their group ranks in round_-1
  // The last call's length now: last_call_timeout, or more while expected
  // members stop their workers.
  std::chrono::milliseconds last_call_wait_{0};
  bool open_ = false;
  // The running round round_-1's members, when known.
  Roster running_;
  int running_members() const { return running_.size(); }
  bool min_seen_ = false;
  std::optional<Clock::time_point> last_call_since_;
  std::optional<Clock::time_point> claim_seen_at_;
  std::string claim_seen_;  // the claim (a builder's slot) claim_seen_at_ is for
  bool settings_checked_ = false;
  bool was_member_ = false;
  int attempt_ = 0;       // the restart count this node carries
  int next_watched_ = 0;  // waiting: the running round's member to look at next
};

// Watches a running round for the need to re-form, from the agent's monitor
// thread, on a store connection of its own. check() costs 3 requests, more
// when nodes wait (see Cost above).
class C10dRoundWatch {
 public:
  using Clock = C10dState::Clock;
  C10dRoundWatch(store::Store& job, C10dSettings settings, const C10dRound& round,
                 std::chrono::milliseconds last_call_timeout,
                 std::function<Clock::time_point()> now = Clock::now);

  // The reform of the round once set (by this node or another), after
  // setting it for an admission that is due or for members whose agents
  // exited (their presence keys' gone markers, see present_key). An
  // admission names every member lost or left by then.
  std::optional<MembershipChange> check(int attempt);
  // Re-forms the round without change.lost (first writer wins; returns the
  // winner).
  MembershipChange reform(const MembershipChange& change);

  // Evidence that group rank 0's agent died faster than its presence can
  // show it (etcd: a lease expires seconds later): `closed` returns true once
  // the workers' store that rank 0 hosts closed its connections (HostProbe).
  // check() then counts node 0 lost if its presence is still there: an agent
  // that leaves on purpose withdraws its presence before its store closes,
  // and a re-formation publishes the reform first. Members but rank 0 only.
  void set_rank0_probe(std::function<bool()> closed) { rank0_closed_ = std::move(closed); }

  // "g<G>/rdzv/<R>/present/<g>": member g's presence, a key bound to its
  // agent's connection (store/protocol.h's BIND_KEYS), so that its gone
  // marker appears when the agent dies. Withdrawn (deleted) on purpose when
  // the agent leaves. Each member watches the next one's (g+1 mod N): one
  // request per check, whatever N.
  static std::string present_key(int generation, int round, int group_rank);

  // "g<G>/rdzv/<R>/done/<g>": member g's workers of the running attempt
  // succeeded. Set on its presence connection (bound, like its presence) as
  // it withdraws its presence, so that its exit is no loss to the members,
  // while its death before the job closes still leaves a gone marker for the
  // nodes waiting for the round (C10dState counts that member gone).
  static std::string done_key(int generation, int round, int group_rank);
  // "g<G>/rdzv/<R>/stopping/<g>": see the keys above.
  static std::string stopping_key(int generation, int round, int group_rank);
  // This member of `round`, which gives way, stops its workers within
  // `grace`: one set on its presence connection (so that the key goes with
  // it if it dies meanwhile).
  static void announce_stopping(store::Store& presence, const C10dRound& round,
                                std::chrono::milliseconds grace);
  // This member's keys in `round` deleted on purpose (no gone marker):
  // presence, record and done key, on its presence connection.
  static void withdraw(store::Store& presence, const C10dRound& round);
  // This member's workers succeeded: withdraw, then the done key.
  static void finish(store::Store& presence, const C10dRound& round);

  // "g<G>/rdzv/<R>/left": a tally of the group ranks of round R's members
  // that left it on purpose (a signal, Ctrl-C, a scheduler's preemption).
  // Every member's check() reads it (one request) and re-forms without them;
  // a node waiting for the running round counts them gone.
  static std::string left_key(int generation, int round);
  // Member `group_rank` leaves round `round` on purpose: one write that every
  // member sees. The caller then withdraws its presence and record.
  static void leave(store::Store& job, int generation, int round, int group_rank);
  // The members of a round of `members` that left it, ascending (entries
  // that are no group rank of the round are ignored). 1 request, 2 when any.
  static std::vector<int> left_members(store::Store& job, int generation, int round, int members);

 private:
  std::string key(int round, const std::string& what) const;
  MembershipChange parse(const std::string& raw) const;
  // Member g's agent exited: its presence's or its record's gone marker.
  bool lost(int g);
  // The members but this one that left (in `left`, the round's left tally)
  // or were lost: the change naming them, or one naming none.
  MembershipChange gone_members(const std::vector<int>& left);
  // Nodes waiting in the next round whose records are there now.
  int64_t live_waiters();

  store::Store& job_;
  C10dSettings settings_;
  int generation_;
  int round_;
  int members_;
  Roster roster_;  // each member's slot, by group rank
  int me_;
  std::chrono::milliseconds last_call_timeout_;
  std::function<Clock::time_point()> now_;
  Clock::time_point formed_at_;
  std::function<bool()> rank0_closed_;
};

}  // namespace ctorchrun::rendezvous
