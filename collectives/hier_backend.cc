#include "collectives/hier_backend.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/call_signature.h"
#include "collectives/gloo_backend.h"
#include "collectives/op_queue.h"
#include "collectives/reduce_kernels.h"
#include "collectives/shm_backend.h"
#include "common/error.h"
#include "store/prefix_store.h"

namespace ctorchrun::dist {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

milliseconds remaining(Clock::time_point deadline) {
  return std::max(std::chrono::duration_cast<milliseconds>(deadline - Clock::now()),
                  milliseconds(1));
}

Buffer bytes_buffer(void* data, size_t bytes) {
  Buffer b;
  b.data = data;
  b.count = bytes;
  b.dtype = DataType::kUInt8;
  return b;
}

// Where the group's ranks are: hosts numbered by their lowest group rank.
struct Layout {
  std::vector<int> host_of;             // per group rank
  std::vector<std::vector<int>> ranks;  // per host, its group ranks in order
  size_t largest = 0;                   // ranks on the fullest host

  explicit Layout(const std::vector<std::string>& identities) {
    std::vector<std::string> seen;
    for (const auto& id : identities) {
      auto it = std::find(seen.begin(), seen.end(), id);
      if (it == seen.end()) {
        seen.push_back(id);
        ranks.emplace_back();
        it = seen.end() - 1;
      }
      const int h = static_cast<int>(it - seen.begin());
      host_of.push_back(h);
      ranks[static_cast<size_t>(h)].push_back(static_cast<int>(host_of.size()) - 1);
    }
    for (const auto& r : ranks) largest = std::max(largest, r.size());
  }
  int hosts() const { return static_cast<int>(ranks.size()); }
  int local_index(int rank) const {
    const auto& mine = ranks[static_cast<size_t>(host_of[static_cast<size_t>(rank)])];
    return static_cast<int>(std::find(mine.begin(), mine.end(), rank) - mine.begin());
  }
};

// The call check carries all_reduces up to this many bytes (check_call).
constexpr size_t kCarried = 4096;

class HierBackend : public Backend {
 public:
  HierBackend(const BackendContext& context, Layout layout, size_t piece,
              std::unique_ptr<Backend> local, std::unique_ptr<Backend> leaders,
              std::unique_ptr<Backend> gloo)
      : rank_(context.rank),
        size_(context.size),
        check_calls_(context.check_calls),
        layout_(std::move(layout)),
        host_(layout_.host_of[static_cast<size_t>(rank_)]),
        local_rank_(layout_.local_index(rank_)),
        local_(std::move(local)),
        leaders_(std::move(leaders)),
        gloo_(std::move(gloo)),
        piece_(piece) {}

  ~HierBackend() override { queue_.stop(); }

  std::string name() const override { return "gloo"; }
  std::string transport() const override { return "hier"; }

  WorkHandle run(const Op& op, bool async) override {
    if (op.type == OpType::kSend || op.type == OpType::kRecv) return gloo_->run(op, async);
    return queue_.run(op, async, describe(op, "hier", rank_, size_));
  }

 private:
  // What one op needs while it runs.
  struct Call {
    const Op& op;
    const std::string& what;
    Clock::time_point deadline;
  };

  bool leader() const { return local_rank_ == 0; }
  int local_size() const {
    return static_cast<int>(layout_.ranks[static_cast<size_t>(host_)].size());
  }

  void execute(const Op& op, uint32_t tag, const PromiseWork& work) {
    if (!broken_.empty()) {
      throw IoError(work.description() + " cannot run: " + broken_ + hint());
    }
    Call call{op, work.description(), deadline_of(op)};
    try {
      if (check_calls_ && check_call(call, detail::signature_of(op, tag))) return;
      switch (op.type) {
        case OpType::kAllReduce:
          all_reduce(call, op.output);
          return;
        case OpType::kReduce:
          reduce(call);
          return;
        case OpType::kReduceScatter:
          reduce_scatter(call);
          return;
        case OpType::kBroadcast:
          broadcast(call);
          return;
        case OpType::kAllGather:
          all_gather(call);
          return;
        case OpType::kBarrier:
          barrier(call);
          return;
        case OpType::kGather:
        case OpType::kScatter:
        case OpType::kAllToAll: {
          Op whole = op;
          whole.deadline = call.deadline;
          gloo_->run(whole, false);
          return;
        }
        case OpType::kSend:
        case OpType::kRecv:
          break;
      }
    } catch (const InvalidArgument&) {
      throw;  // every rank compared the same table: still in step, still usable
    } catch (const std::exception& e) {
      fail(e.what());
      throw;
    }
    CTORCHRUN_CHECK(false, "hier backend: operation routed to the wrong path");
  }

  // Makes the group unusable for `why`. The peers waiting for this rank in a
  // subgroup fail now, not at their deadline: a closed gloo group fails the
  // other leaders, a destroyed shared-memory group the ranks of this host.
  // Destroying the host group also waits for the step its thread is running,
  // so that none touches a buffer after the op has failed.
  void fail(const std::string& why) {
    if (broken_.empty()) broken_ = why;
    leaders_.reset();
    local_.reset();
  }

  static std::string hint() {
    return "; this group is unusable, exit so the launcher can restart the job";
  }

  // Runs `op` on a subgroup by the call's deadline (however long it waits
  // in the subgroup's queue); its errors name the call they belong to, and
  // its timeout.
  void on(std::unique_ptr<Backend>& group, const char* which, Call& call, Op op) {
    op.timeout = call.op.timeout;
    op.deadline = call.deadline;
    finish(which, call, [&] { group->run(op, false); });
  }
  // Starts `op` on the host group, to be finished with finish().
  WorkHandle start_local(Call& call, Op op) {
    op.timeout = call.op.timeout;
    op.deadline = call.deadline;
    return local_->run(op, true);
  }
  template <typename Fn>
  void finish(const char* which, Call& call, Fn fn) {
    try {
      fn();
    } catch (const TimeoutError& e) {
      throw TimeoutError(call.what + " failed in its " + which + " step: " + e.what());
    } catch (const InvalidArgument&) {
      throw;
    } catch (const IoError& e) {
      throw IoError(call.what + " failed in its " + which + " step: " + e.what());
    }
  }
  void finish(Call& call, const WorkHandle& work) {
    finish("host", call, [&] { work->wait(); });
  }

  static Op make(OpType type, Buffer output, int peer = 0, ReduceOp reduce = ReduceOp::kSum) {
    Op op;
    op.type = type;
    op.output = output;
    op.peer = peer;
    op.reduce = reduce;
    return op;
  }

  void local(Call& call, Op op) { on(local_, "host", call, std::move(op)); }
  void across(Call& call, Op op) { on(leaders_, "leaders'", call, std::move(op)); }

  // Every rank gets every rank's signature (host, leaders, host), then all
  // compare the same table. Each step's shape is fixed, whatever the calls.
  //
  // The steps carry a small all_reduce's data too (up to kCarried bytes):
  // each rank's record is its signature and its data; a leader whose host
  // agrees reduces the host's data, in rank order, into its record; the
  // leaders reduce the hosts' partial results, in host order, when every
  // signature agrees, and broadcast the result with the table. So a small
  // checked all_reduce is three steps, not six; true when it is done. No
  // caller's buffer changes before the table has been compared.
  bool check_call(Call& call, const detail::Signature& mine) {
    constexpr size_t kSig = sizeof(detail::Signature);
    const Op& op = call.op;
    const size_t bytes = op.output.bytes();
    const bool small = op.type == OpType::kAllReduce && bytes > 0 && bytes <= kCarried;
    const auto fn = small ? detail::reduce_function(op.output.dtype, op.reduce) : nullptr;
    const size_t count = op.output.count;
    // Host step: [signature | data] per rank.
    constexpr size_t kRecord = kSig + kCarried;
    std::vector<uint8_t> record(kRecord);
    std::memcpy(record.data(), &mine, kSig);
    if (small) std::memcpy(record.data() + kSig, op.output.data, bytes);
    const auto local_ranks = static_cast<size_t>(local_size());
    std::vector<uint8_t> host(local_ranks * kRecord);
    Op gather = make(OpType::kAllGather, bytes_buffer(host.data(), host.size()));
    gather.input = bytes_buffer(record.data(), record.size());
    local(call, gather);
    // Leaders' step and the last host step: [table | result].
    std::vector<detail::Signature> table(static_cast<size_t>(size_));
    const size_t table_bytes = table.size() * kSig;
    std::vector<uint8_t> out(table_bytes + kCarried);
    uint8_t* result = out.data() + table_bytes;
    if (leader()) {
      // Leaders' step: [this host's signatures, in local order, padded to
      // the fullest host | the host's partial result], so that what crosses
      // hosts grows with the hosts, not with hosts x ranks.
      const size_t sigs = layout_.largest * kSig;
      std::vector<uint8_t> block(sigs + kCarried);
      bool agree = small;
      for (size_t j = 0; j < local_ranks; ++j) {
        std::memcpy(block.data() + j * kSig, host.data() + j * kRecord, kSig);
        detail::Signature entry;
        std::memcpy(&entry, host.data() + j * kRecord, kSig);
        agree = agree && entry == mine;
      }
      if (agree) {
        uint8_t* partial = block.data() + sigs;
        std::memcpy(partial, host.data() + kSig, bytes);
        for (size_t j = 1; j < local_ranks; ++j) {
          fn(partial, partial, host.data() + j * kRecord + kSig, count);
        }
      }
      const auto hosts = static_cast<size_t>(layout_.hosts());
      std::vector<uint8_t> all(hosts * block.size());
      Op across_gather = make(OpType::kAllGather, bytes_buffer(all.data(), all.size()));
      across_gather.input = bytes_buffer(block.data(), block.size());
      across(call, across_gather);
      bool same = small;
      for (size_t h = 0; h < hosts; ++h) {
        const auto& ranks = layout_.ranks[h];
        for (size_t j = 0; j < ranks.size(); ++j) {
          auto& entry = table[static_cast<size_t>(ranks[j])];
          std::memcpy(&entry, all.data() + h * block.size() + j * kSig, kSig);
          same = same && entry == mine;
        }
      }
      if (same) {
        std::memcpy(result, all.data() + sigs, bytes);
        for (size_t h = 1; h < hosts; ++h) {
          fn(result, result, all.data() + h * block.size() + sigs, count);
        }
        if (op.reduce == ReduceOp::kAverage) {
          detail::divide_in_place(result, count, op.output.dtype, size_);
        }
      }
      std::memcpy(out.data(), table.data(), table_bytes);
    }
    local(call, make(OpType::kBroadcast, bytes_buffer(out.data(), out.size())));
    std::memcpy(table.data(), out.data(), table_bytes);
    detail::check_same_calls(table, rank_, call.what);
    if (!small) return false;
    std::memcpy(op.output.data, result, bytes);
    return true;
  }

  // The reduction of every rank's `data` on every rank (average: divided by
  // the group's size once, by the leaders). Above piece_ bytes it goes in
  // pieces, pipelined: the host group reduces piece i + 1 (on its own
  // thread) while the leaders all-reduce piece i, and broadcasts piece i
  // while they do the next. Every rank of a host starts the host steps in
  // one order (all the reduces, then the broadcasts); a leader starts the
  // broadcast of a piece once the leaders are done with it.
  void all_reduce(Call& call, const Buffer& data) {
    if (data.count == 0) return;
    const ReduceOp reduce = call.op.reduce;
    const ReduceOp sum = reduce == ReduceOp::kAverage ? ReduceOp::kSum : reduce;
    const size_t es = element_size(data.dtype);
    const size_t per = std::max<size_t>(1, piece_ / es);
    std::vector<Buffer> pieces;
    for (size_t at = 0; at < data.count; at += per) {
      Buffer piece = data;
      piece.data = static_cast<uint8_t*>(data.data) + at * es;
      piece.count = std::min(per, data.count - at);
      pieces.push_back(piece);
    }
    auto across_piece = [&](const Buffer& piece) {
      across(call, make(OpType::kAllReduce, piece, 0, sum));
      if (reduce == ReduceOp::kAverage) {
        detail::divide_in_place(piece.data, piece.count, piece.dtype, size_);
      }
    };
    if (pieces.size() == 1) {
      local(call, make(OpType::kReduce, data, 0, sum));
      if (leader()) across_piece(data);
      local(call, make(OpType::kBroadcast, data, 0));
      return;
    }
    // The host group's thread works on `data` while this one does: on
    // failure it is destroyed before this returns (it waits for the piece in
    // progress and fails the rest), since `data` may be the caller's scratch
    // (reduce_scatter's) and go with it.
    try {
      std::vector<WorkHandle> reduced;
      std::vector<WorkHandle> spread;
      for (const Buffer& piece : pieces) {
        reduced.push_back(start_local(call, make(OpType::kReduce, piece, 0, sum)));
      }
      for (size_t i = 0; i < pieces.size(); ++i) {
        if (leader()) {
          finish(call, reduced[i]);
          across_piece(pieces[i]);
        }
        spread.push_back(start_local(call, make(OpType::kBroadcast, pieces[i], 0)));
      }
      for (const auto& work : reduced) finish(call, work);
      for (const auto& work : spread) finish(call, work);
    } catch (const std::exception& e) {
      fail(e.what());
      throw;
    }
  }

  void reduce(Call& call) {
    const Op& op = call.op;
    if (op.output.count == 0) return;
    const ReduceOp sum = op.reduce == ReduceOp::kAverage ? ReduceOp::kSum : op.reduce;
    const int root_host = layout_.host_of[static_cast<size_t>(op.peer)];
    const int root_local = layout_.local_index(op.peer);
    local(call, make(OpType::kReduce, op.output, 0, sum));
    if (leader()) {
      across(call, make(OpType::kReduce, op.output, root_host, sum));
      if (host_ == root_host && op.reduce == ReduceOp::kAverage) {
        detail::divide_in_place(op.output.data, op.output.count, op.output.dtype, size_);
      }
    }
    // The hand-off from the leader to a root that is not the leader.
    if (host_ == root_host && root_local != 0) local(call, make(OpType::kBroadcast, op.output, 0));
  }

  // gloo's way: an all-reduce of a copy, of which each rank keeps its slice.
  void reduce_scatter(Call& call) {
    const Op& op = call.op;
    if (op.output.count == 0) return;
    std::vector<uint8_t> scratch(op.input.bytes());
    std::memcpy(scratch.data(), op.input.data, scratch.size());
    Buffer all = op.input;
    all.data = scratch.data();
    all_reduce(call, all);
    std::memcpy(op.output.data, scratch.data() + static_cast<size_t>(rank_) * op.output.bytes(),
                op.output.bytes());
  }

  void broadcast(Call& call) {
    const Op& op = call.op;
    if (op.output.count == 0) return;
    const int root_host = layout_.host_of[static_cast<size_t>(op.peer)];
    const int root_local = layout_.local_index(op.peer);
    if (host_ == root_host && root_local != 0) {
      local(call, make(OpType::kBroadcast, op.output, root_local));
    }
    if (leader()) across(call, make(OpType::kBroadcast, op.output, root_host));
    // Root's host has it already unless root is the leader.
    if (host_ != root_host || root_local == 0) {
      local(call, make(OpType::kBroadcast, op.output, 0));
    }
  }

  void all_gather(Call& call) {
    const Op& op = call.op;
    if (op.input.count == 0) return;
    const size_t bytes = op.input.bytes();  // per rank
    const size_t block = layout_.largest * bytes;
    const auto hosts = static_cast<size_t>(layout_.hosts());
    // This host's inputs, padded to the fullest host's block.
    std::vector<uint8_t> mine(block);
    Op host_gather = make(OpType::kAllGather,
                          bytes_buffer(mine.data(), static_cast<size_t>(local_size()) * bytes));
    host_gather.input = bytes_buffer(op.input.data, bytes);
    local(call, host_gather);
    auto* out = static_cast<uint8_t*>(op.output.data);
    if (leader()) {
      std::vector<uint8_t> all(hosts * block);
      Op leaders_gather = make(OpType::kAllGather, bytes_buffer(all.data(), all.size()));
      leaders_gather.input = bytes_buffer(mine.data(), block);
      across(call, leaders_gather);
      for (size_t h = 0; h < hosts; ++h) {
        const auto& ranks = layout_.ranks[h];
        for (size_t j = 0; j < ranks.size(); ++j) {
          std::memcpy(out + static_cast<size_t>(ranks[j]) * bytes,
                      all.data() + h * block + j * bytes, bytes);
        }
      }
    }
    local(call, make(OpType::kBroadcast, bytes_buffer(out, static_cast<size_t>(size_) * bytes), 0));
  }

  void barrier(Call& call) {
    local(call, make(OpType::kBarrier, Buffer{}));
    if (leader()) across(call, make(OpType::kBarrier, Buffer{}));
    local(call, make(OpType::kBarrier, Buffer{}));
  }

  const int rank_;
  const int size_;
  const bool check_calls_;
  const Layout layout_;
  const int host_;        // this rank's host
  const int local_rank_;  // its index among the host's ranks; 0: the leader
  // Touched only by the thread running the group's current op (reset when
  // it fails).
  std::unique_ptr<Backend> local_;    // this host's ranks
  std::unique_ptr<Backend> leaders_;  // one rank a host; null on the others
  std::unique_ptr<Backend> gloo_;     // every rank: gather, scatter, all_to_all, send, recv
  const size_t piece_;                // an all_reduce above it goes in pieces of it
  std::string broken_;                // why the group is unusable; empty while it is usable
  // Last: its thread runs execute(), which uses everything above.
  OpQueue queue_{
      [this](const Op& op, uint32_t tag, const PromiseWork& work) { execute(op, tag, work); }};
};

}  // namespace

std::unique_ptr<Backend> create_hier_backend(const BackendContext& context,
                                             const std::vector<std::string>& hosts, size_t piece,
                                             Clock::time_point deadline) {
  Layout layout(hosts);
  if (layout.hosts() < 2 || layout.largest < 2) return nullptr;
  const int host = layout.host_of[static_cast<size_t>(context.rank)];
  const int local_rank = layout.local_index(context.rank);
  const std::string host_key = "hier/host" + std::to_string(host);

  // The subgroups check nothing: the whole call was checked before any of
  // their steps, and each step's shape follows from it.
  BackendContext local = context;
  local.store = std::make_shared<store::PrefixStore>(host_key, context.store);
  local.rank = local_rank;
  local.size = static_cast<int>(layout.ranks[static_cast<size_t>(host)].size());
  local.group_key = context.group_key + "/" + host_key;
  local.check_calls = false;
  local.timeout = remaining(deadline);
  auto local_group = create_host_backend(local);

  std::unique_ptr<Backend> leaders;
  if (local_rank == 0) {
    BackendContext across = context;
    across.store = std::make_shared<store::PrefixStore>("hier/leaders", context.store);
    across.rank = host;
    across.size = layout.hosts();
    across.group_key = context.group_key + "/hier/leaders";
    across.check_calls = false;
    across.timeout = remaining(deadline);
    leaders = create_gloo_backend(across);
  }

  BackendContext whole = context;
  whole.check_calls = false;
  whole.timeout = remaining(deadline);
  auto gloo = create_gloo_backend(whole);
  return std::make_unique<HierBackend>(context, std::move(layout), piece, std::move(local_group),
                                       std::move(leaders), std::move(gloo));
}

}  // namespace ctorchrun::dist
