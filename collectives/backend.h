#pragma once

// Backend: what a transport (gloo, NCCL) implements for ProcessGroup.
//
// ProcessGroup validates every call (counts, roots, data types, devices)
// before it reaches a backend, so a backend sees only well-formed
// operations. An operation is one Op record, NCCL-style: a backend is a
// table with one entry point, run(), and adding an operation touches one
// switch per backend.
//
// Backends are registered by name (register_backend) from the library that
// implements them: "gloo" by libctorch_dist itself (with its shared-memory
// path between ranks of one host, collectives/shm_backend.h, and its
// hierarchical one across hosts, collectives/hier_backend.h), "nccl" by
// libctorch_dist_nccl when it is linked.

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "collectives/types.h"
#include "collectives/work.h"
#include "store/store.h"

namespace ctorchrun::dist {

enum class OpType {
  kAllReduce,
  kBroadcast,
  kReduce,
  kAllGather,
  kGather,
  kScatter,
  kReduceScatter,
  kAllToAll,
  kBarrier,
  kSend,
  kRecv,
};

const char* to_string(OpType type);

// One operation. Which fields are used depends on `type`:
//  kAllReduce, kBroadcast, kReduce: `output` in place (input and output);
//  kAllGather, kGather, kAllToAll: `input` -> `output` (size x input.count);
//  kScatter, kReduceScatter: `input` (size x output.count) -> `output`;
//  kSend: `input`; kRecv: `output`.
struct Op {
  OpType type = OpType::kBarrier;
  Buffer input;
  Buffer output;
  ReduceOp reduce = ReduceOp::kSum;
  int peer = 0;  // root, or the destination / source of send and recv
  int tag = 0;   // send and recv only
  std::chrono::milliseconds timeout{0};
  // Unset (the epoch), the op must finish within `timeout` of when it starts
  // to run. Set, it must finish by then, however late it starts, and
  // `timeout` is only what its errors report: a composite op (the
  // hierarchical path) queues its steps with its own deadline.
  std::chrono::steady_clock::time_point deadline{};
};

// When `op`, starting to run now, must be done.
std::chrono::steady_clock::time_point deadline_of(const Op& op);

// What a backend is built from. `store` is already prefixed for this group
// (and attempt), so the backend may use any key names.
struct BackendContext {
  std::shared_ptr<store::Store> store;
  int rank = 0;
  int size = 1;
  Device device{};
  std::chrono::milliseconds timeout{0};  // bounds set-up as well
  std::string master_addr;               // chooses the interface when not told
  // Peers compare each collective call's op, count, data type, reduction
  // and root before data moves (InitOptions::check_calls).
  bool check_calls = true;
  // Names this group among every group of every job on the host (the job's
  // TORCHELASTIC_RUN_ID is added by the shared-memory path): the group's store
  // prefix. The shared-memory segment's name carries a hash of it.
  std::string group_key;
  // "gloo" between ranks of one host moves collectives through shared memory
  // (collectives/shm_backend.h) unless this is false (CTORCHRUN_DIST_SHM=0).
  bool shm = true;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string name() const = 0;
  // How the collectives move: "gloo", "shm" (shared memory, one host),
  // "hier" (shared memory within hosts, gloo between them), "nccl". name()
  // is what new_group and users ask for; this is what runs.
  virtual std::string transport() const { return name(); }

  // Starts `op`. With `async` false the call returns once the operation has
  // completed (the returned Work is completed); with `async` true it may
  // return at once. Operations of one group complete in the order they were
  // started on every rank, as torch's process groups do; send and recv are
  // matched by (peer, tag) and do not wait behind queued collectives.
  virtual WorkHandle run(const Op& op, bool async) = 0;
};

// How errors and Work name `op`: "all_reduce of 1024 float32 on shm rank
// 1/4" (`transport` is "gloo", "shm", "hier", ...), with the peer for send
// and recv.
std::string describe(const Op& op, const std::string& transport, int rank, int size);

using BackendFactory = std::function<std::unique_ptr<Backend>(const BackendContext&)>;

// Makes `factory` the backend called `name` (replacing any earlier one).
void register_backend(const std::string& name, BackendFactory factory);
// The backend called `name`; ConfigError naming the known backends if none.
std::unique_ptr<Backend> create_backend(const std::string& name, const BackendContext& context);

}  // namespace ctorchrun::dist
