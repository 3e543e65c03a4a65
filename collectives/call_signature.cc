#include "collectives/call_signature.h"

#include <algorithm>
#include <utility>

#include "common/error.h"

namespace ctorchrun::dist::detail {
namespace {

// The buffer whose count and type every rank must agree on: the per-rank
// side of the op (input of gathers, output of scatters, the buffer of
// in-place ops), the one every rank passes.
const Buffer* agreed_buffer(const Op& op) {
  switch (op.type) {
    case OpType::kAllGather:
    case OpType::kGather:
    case OpType::kAllToAll:
    case OpType::kSend:
      return &op.input;
    case OpType::kBarrier:
      return nullptr;
    default:
      return &op.output;
  }
}

}  // namespace

Signature signature_of(const Op& op, uint32_t sequence) {
  Signature s;
  s.sequence = sequence;
  s.type = static_cast<uint8_t>(op.type);
  if (const Buffer* b = agreed_buffer(op)) {
    s.dtype = static_cast<uint8_t>(b->dtype);
    s.count = b->count;
  }
  if (op.type == OpType::kAllReduce || op.type == OpType::kReduce ||
      op.type == OpType::kReduceScatter) {
    s.reduce = static_cast<uint8_t>(static_cast<int>(op.reduce) + 1);
  }
  if (op.type == OpType::kBroadcast || op.type == OpType::kReduce || op.type == OpType::kGather ||
      op.type == OpType::kScatter) {
    s.has_root = 1;
    s.root = op.peer;
  }
  return s;
}

std::string describe(const Signature& s) {
  if (s.magic != Signature{}.magic || s.type > static_cast<uint8_t>(OpType::kRecv) ||
      s.dtype > static_cast<uint8_t>(DataType::kInt64) ||
      s.reduce > static_cast<uint8_t>(ReduceOp::kAverage) + 1) {
    return "a call this library version does not know";
  }
  const auto type = static_cast<OpType>(s.type);
  std::string text = to_string(type);
  if (type != OpType::kBarrier) {
    text += std::string(" of ") + std::to_string(s.count) + " " +
            to_string(static_cast<DataType>(s.dtype));
  }
  if (s.reduce != 0)
    text += std::string(" (") + to_string(static_cast<ReduceOp>(s.reduce - 1)) + ")";
  if (s.has_root) text += " with root " + std::to_string(s.root);
  return text;
}

void check_same_calls(const std::vector<Signature>& all, int rank, const std::string& what) {
  const Signature& mine = all[static_cast<size_t>(rank)];
  if (std::all_of(all.begin(), all.end(), [&](const Signature& s) { return s == mine; })) {
    return;
  }
  // Ranks grouped by the call they made, in rank order.
  std::vector<std::pair<std::string, std::vector<int>>> calls;
  for (size_t r = 0; r < all.size(); ++r) {
    const std::string call = describe(all[r]);
    auto it =
        std::find_if(calls.begin(), calls.end(), [&](const auto& c) { return c.first == call; });
    if (it == calls.end()) {
      calls.push_back({call, {static_cast<int>(r)}});
    } else {
      it->second.push_back(static_cast<int>(r));
    }
  }
  std::string listed;
  for (const auto& [call, ranks] : calls) {
    std::string who;
    for (int r : ranks) who += (who.empty() ? "" : ",") + std::to_string(r);
    listed += std::string(listed.empty() ? "" : "; ") + (ranks.size() > 1 ? "ranks " : "rank ") +
              who + ": " + call;
  }
  throw InvalidArgument(what + ": the ranks' calls differ (collective " +
                        std::to_string(mine.sequence) +
                        " of this group, counted from 0): " + listed +
                        ". Every rank must make the same collective calls in the same order, with "
                        "the same count, data type, reduction and root; no data moved and the "
                        "group is still usable");
}

}  // namespace ctorchrun::dist::detail
