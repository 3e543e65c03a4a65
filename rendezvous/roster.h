#pragma once

// rendezvous::Roster: a round's members in compact form, what each member
// needs to take its place, in O(runs) bytes rather than O(N):
//   - the members' slots in group-rank order, as runs of consecutive slot
//     numbers of one kind ("n0".."n1023" is one run);
//   - their local world sizes in group-rank order, as runs of equal sizes
//     (1024 nodes of 8 workers is one run), whose prefix sums give each
//     member's first global rank and the world size.
// A member finds its group rank from its slot, and its first global rank
// from its group rank, by walking the runs: O(runs) time, no record of
// another node read. The c10d round's completer publishes it
// (rendezvous/c10d_state.h, key "complete"), next to the full list of the
// members' records (key "members/<slot>"), which only those who name hosts
// read (events, messages).
//
// Wire form (JSON, inside the round's "complete" object):
//   "slots": [[kind, first, count], ...]  kind "n" or "m", first >= 0,
//                                         count >= 1: slots kind<first> ..
//                                         kind<first+count-1>
//   "sizes": [[local_world_size, count], ...]  local_world_size 1..2^20,
//                                         count >= 1
// Both cover the same number of members; no slot twice. Written by a peer:
// from_json checks every field (ProtocolError naming the key otherwise).
//
// A value type; not thread-safe for concurrent mutation (it has none after
// construction). Internal to rendezvous/.

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

namespace ctorchrun::rendezvous {

class Roster {
 public:
  struct SlotRun {
    char kind = 'n';  // 'n': a newcomer's slot, 'm': a member of the round before
    int first = 0;
    int count = 0;
  };
  struct SizeRun {
    int local_world_size = 0;
    int count = 0;
  };

  Roster() = default;
  // From the members' slots and local world sizes, in group-rank order (same
  // length; each slot 'n' or 'm' and a number). InternalError otherwise.
  static Roster build(const std::vector<std::string>& slots, const std::vector<int>& sizes);
  // Reads the "slots" and "sizes" fields of `j` (written by a peer): at most
  // `max_members` members. ProtocolError naming `key` for anything else.
  static Roster from_json(const nlohmann::json& j, const std::string& key, int max_members);
  // Adds "slots" and "sizes" to `j`.
  void to_json(nlohmann::json& j) const;

  int size() const { return size_; }  // the group world size
  int64_t world_size() const { return world_; }
  // The group rank of the member holding `slot`; nullopt for no member.
  std::optional<int> group_rank_of(const std::string& slot) const;
  // Member g's slot and local world size (0 <= g < size()).
  std::string slot(int g) const;
  int local_world_size(int g) const;
  // The sum of the local world sizes of group ranks below g: g's first
  // global rank (torchrun's formula when every node runs the same number).
  int64_t first_rank(int g) const;
  // Every member's slot / local world size, by group rank: O(N), for tests
  // and for callers that list members.
  std::vector<std::string> slots() const;
  std::vector<int> local_world_sizes() const;

  const std::vector<SlotRun>& slot_runs() const { return slot_runs_; }
  const std::vector<SizeRun>& size_runs() const { return size_runs_; }

  bool operator==(const Roster& o) const;
  bool operator!=(const Roster& o) const { return !(*this == o); }

 private:
  std::vector<SlotRun> slot_runs_;
  std::vector<SizeRun> size_runs_;
  int size_ = 0;
  int64_t world_ = 0;
};

}  // namespace ctorchrun::rendezvous
