#pragma once

// What a collective call is, as the ranks of a group compare it before any
// data moves (BackendContext::check_calls): 32 bytes per call, the same on
// every rank and every backend that checks (gloo over its TCP pairs, the
// shared-memory path through its segment). Internal to libctorch_dist.

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "collectives/backend.h"

namespace ctorchrun::dist::detail {

// Fields an op does not use are zero.
struct Signature {
  uint32_t magic = 0x31474953;  // "SIG1": layout version
  uint32_t sequence = 0;        // the call's place in the group's order (its tag)
  uint8_t type = 0;             // OpType
  uint8_t dtype = 0;            // DataType
  uint8_t reduce = 0;           // ReduceOp + 1 for reductions, else 0
  uint8_t has_root = 0;
  int32_t root = 0;
  uint64_t count = 0;
  uint64_t reserved = 0;

  bool operator==(const Signature& o) const {
    return std::memcmp(this, &o, sizeof(Signature)) == 0;
  }
};
static_assert(sizeof(Signature) == 32, "the signature is 32 bytes on every rank");

// The signature of `op`, the `sequence`-th collective of its group.
Signature signature_of(const Op& op, uint32_t sequence);

// "all_reduce of 4 float32 (sum)", "broadcast of 3 int64 with root 1".
std::string describe(const Signature& s);

// Returns when every entry of `all` (one per rank, in rank order) equals
// all[rank]; otherwise throws InvalidArgument naming each rank's call, the
// same text on every rank that holds the same table. `what` is the failing
// call's description.
void check_same_calls(const std::vector<Signature>& all, int rank, const std::string& what);

}  // namespace ctorchrun::dist::detail
