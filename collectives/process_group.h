#pragma once

// libctorch_dist: collectives for C++ workers started by ctorchrun (or any
// launcher that sets torch's environment variables).
//
//   auto pg = ctorchrun::dist::init_process_group();   // reads RANK, WORLD_SIZE, ...
//   pg->all_reduce(ctorchrun::dist::make_buffer(grad.data(), grad.size()));
//
// init_process_group() connects to the job's store (MASTER_ADDR:MASTER_PORT),
// keeps its keys under /ctorch_dist/attempt_<TORCHELASTIC_RESTART_COUNT>/
// (never the agents' /ctorchrun/, never torch's), so a restarted job never
// reads a dead attempt's keys and torch workers of the same job never collide
// with it. Under ctorchrun the agent hosts the store
// (TORCHELASTIC_USE_AGENT_STORE=True); otherwise rank 0 hosts it, as torch's
// env:// initialisation does.
//
// Every collective exists in a blocking form and an `_async` form returning a
// Work handle. Every call is bounded: by the group's timeout (default 30 min,
// as torch's gloo; 10 min for nccl, as torch's NCCL) or by the `timeout` argument when it is not
// zero. After a collective failed (TimeoutError, IoError: a peer died or hung) the group is
// unusable; the process should exit so that the launcher restarts the job.
//
// Semantics are torch.distributed's: every rank of a group calls the same
// collectives in the same order with matching counts; roots and peers are
// ranks of the group. With gloo the ranks check that: before a collective
// moves data they compare its op, count, data type, reduction and root, and
// when these differ every rank throws the same InvalidArgument (a
// ConfigError) naming each rank's call, and the group stays usable (InitOptions::check_calls turns
// it off).
//
// Threads: every method may be called from several threads at once,
// new_group included. A collective takes its place in the group's order when
// it is called, blocking or _async alike, and runs in that place on every
// rank: the n-th collective call of one rank meets the n-th of every other.
// Which of two calls made at the same moment by two threads comes first is
// undefined, as in torch, so threads that share a group must either make
// calls that may meet in any pairing (identical ones) or order their calls
// themselves; a group per thread (new_group) is the simple way. send and
// recv are not part of that order: they are matched by (peer, tag).
//
// Errors: ConfigError for a call that cannot be right (bad count, root,
// average of integers, device the backend cannot use, missing environment,
// calls that differ across ranks); TimeoutError and IoError from the
// network (see Work).

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "collectives/backend.h"
#include "collectives/types.h"
#include "collectives/work.h"
#include "store/store.h"

namespace ctorchrun::dist {

inline constexpr std::chrono::milliseconds kDefaultTimeout{30 * 60 * 1000};
// The default of the nccl backend (InitOptions::timeout left at kDefaultTimeout).
inline constexpr std::chrono::milliseconds kDefaultNcclTimeout{10 * 60 * 1000};
// Passed as a call's timeout: use the group's.
inline constexpr std::chrono::milliseconds kGroupTimeout{0};
// The store prefix of every key libctorch_dist writes.
inline constexpr const char* kStorePrefix = "ctorch_dist";

struct InitOptions {
  std::string backend = "gloo";
  // Each one overrides its environment variable when set.
  std::optional<int> rank;                              // RANK
  std::optional<int> world_size;                        // WORLD_SIZE
  std::optional<int> local_rank;                        // LOCAL_RANK
  std::optional<std::string> master_addr;               // MASTER_ADDR
  std::optional<int> master_port;                       // MASTER_PORT
  std::optional<int> restart_count;                     // TORCHELASTIC_RESTART_COUNT (0 if unset)
  std::chrono::milliseconds timeout = kDefaultTimeout;  // ops, and set-up (nccl: 10 min)
  // kCpu for gloo; for NCCL the CUDA device (index -1: LOCAL_RANK).
  Device device{};
  // A store to use instead of connecting to MASTER_ADDR:MASTER_PORT (tests,
  // embedders). It is used as is, then prefixed like the job's store.
  std::shared_ptr<store::Store> store;
  // gloo: before a collective moves data, the ranks compare their calls (op,
  // count, data type, reduction, root) and all throw ConfigError naming each
  // rank's call when they differ; one extra exchange of 32 bytes per call.
  // CTORCHRUN_DIST_CHECK_CALLS=0 turns it off (default on). Subgroups inherit it.
  std::optional<bool> check_calls;  // CTORCHRUN_DIST_CHECK_CALLS
  // gloo: when every rank of a group runs on this host, collectives move
  // through a shared-memory segment instead of loopback TCP (see
  // collectives/shm_backend.h); when they run on several hosts, through
  // shared memory within each and gloo between them (hier_backend.h).
  // CTORCHRUN_DIST_SHM=0 turns it off (default on). Subgroups inherit it.
  std::optional<bool> shm;  // CTORCHRUN_DIST_SHM
};

class ProcessGroup {
 public:
  ProcessGroup(std::unique_ptr<Backend> backend, BackendContext context, std::string store_prefix,
               std::shared_ptr<store::Store> root_store, std::vector<int> global_ranks,
               std::shared_ptr<void> keep_alive);
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return context_.rank; }
  int size() const { return context_.size; }
  std::string backend_name() const { return backend_->name(); }
  // What moves the data: "shm" for a gloo group on one host, "hier" for one
  // on several (collectives/hier_backend.h), else the backend's name.
  std::string transport() const { return backend_->transport(); }
  Device device() const { return context_.device; }
  std::chrono::milliseconds timeout() const { return context_.timeout; }
  // The global (init_process_group) rank of each rank of this group.
  const std::vector<int>& global_ranks() const { return global_ranks_; }

  // In place: every rank ends with the reduction of all ranks' buffers.
  void all_reduce(const Buffer& buffer, ReduceOp op = ReduceOp::kSum,
                  std::chrono::milliseconds timeout = kGroupTimeout);
  WorkHandle all_reduce_async(const Buffer& buffer, ReduceOp op = ReduceOp::kSum,
                              std::chrono::milliseconds timeout = kGroupTimeout);

  // In place: every rank ends with root's buffer.
  void broadcast(const Buffer& buffer, int root, std::chrono::milliseconds timeout = kGroupTimeout);
  WorkHandle broadcast_async(const Buffer& buffer, int root,
                             std::chrono::milliseconds timeout = kGroupTimeout);

  // In place: root ends with the reduction; other ranks' buffers are left as
  // the backend leaves them (torch: unspecified).
  void reduce(const Buffer& buffer, int root, ReduceOp op = ReduceOp::kSum,
              std::chrono::milliseconds timeout = kGroupTimeout);
  WorkHandle reduce_async(const Buffer& buffer, int root, ReduceOp op = ReduceOp::kSum,
                          std::chrono::milliseconds timeout = kGroupTimeout);

  // output (size x input.count) = every rank's input, in rank order.
  void all_gather(const Buffer& input, const Buffer& output,
                  std::chrono::milliseconds timeout = kGroupTimeout);
  WorkHandle all_gather_async(const Buffer& input, const Buffer& output,
                              std::chrono::milliseconds timeout = kGroupTimeout);

  // As all_gather, into root's output only (others may pass an empty Buffer).
  void gather(const Buffer& input, const Buffer& output, int root,
              std::chrono::milliseconds timeout = kGroupTimeout);
  WorkHandle gather_async(const Buffer& input, const Buffer& output, int root,
                          std::chrono::milliseconds timeout = kGroupTimeout);

  // Rank r's output = slice r of root's input (size x output.count); others
  // may pass an empty input.
  void scatter(const Buffer& input, const Buffer& output, int root,
               std::chrono::milliseconds timeout = kGroupTimeout);
  WorkHandle scatter_async(const Buffer& input, const Buffer& output, int root,
                           std::chrono::milliseconds timeout = kGroupTimeout);

  // Rank r's output = the reduction of slice r of every rank's input
  // (size x output.count).
  void reduce_scatter(const Buffer& input, const Buffer& output, ReduceOp op = ReduceOp::kSum,
                      std::chrono::milliseconds timeout = kGroupTimeout);
  WorkHandle reduce_scatter_async(const Buffer& input, const Buffer& output,
                                  ReduceOp op = ReduceOp::kSum,
                                  std::chrono::milliseconds timeout = kGroupTimeout);

  // Slice j of rank i's input becomes slice i of rank j's output; both hold
  // size equal slices.
  void all_to_all(const Buffer& input, const Buffer& output,
                  std::chrono::milliseconds timeout = kGroupTimeout);
  WorkHandle all_to_all_async(const Buffer& input, const Buffer& output,
                              std::chrono::milliseconds timeout = kGroupTimeout);

  void barrier(std::chrono::milliseconds timeout = kGroupTimeout);
  WorkHandle barrier_async(std::chrono::milliseconds timeout = kGroupTimeout);

  // Point to point, matched by (peer, tag). A send completes once the
  // matching recv has taken the data.
  void send(const Buffer& buffer, int dst, int tag = 0,
            std::chrono::milliseconds timeout = kGroupTimeout);
  WorkHandle send_async(const Buffer& buffer, int dst, int tag = 0,
                        std::chrono::milliseconds timeout = kGroupTimeout);
  void recv(const Buffer& buffer, int src, int tag = 0,
            std::chrono::milliseconds timeout = kGroupTimeout);
  WorkHandle recv_async(const Buffer& buffer, int src, int tag = 0,
                        std::chrono::milliseconds timeout = kGroupTimeout);

  // torch's new_group: every rank of this group calls it, with the same
  // `ranks` (ranks of this group, no duplicates) in the same order. Members
  // get the subgroup (ranked by their position in `ranks`), the others
  // nullptr. Same backend, device and timeout unless `timeout` is given.
  std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks,
                                          std::chrono::milliseconds timeout = kGroupTimeout);

 private:
  WorkHandle start(Op op, bool async);

  std::unique_ptr<Backend> backend_;
  BackendContext context_;
  std::string store_prefix_;  // this group's prefix in root_store_
  std::shared_ptr<store::Store> root_store_;
  std::vector<int> global_ranks_;
  std::shared_ptr<void> keep_alive_;  // a store server this process hosts
  std::atomic<int> next_group_{0};    // new_group may be called from several threads
};

// Builds the default group from the environment (see the top of this file).
// Every rank must call it the same number of times (each call makes a new
// group with keys of its own).
// Blocks until every rank has arrived, at most options.timeout; on timeout the
// TimeoutError names the ranks that never arrived. Throws ConfigError for a
// missing or malformed variable, IoError when the store cannot be reached.
// A process that still has SIGPIPE's default action gets it ignored, as
// Python (and so every torch worker) does: a write to a dead peer's socket
// must fail the op with an error, not kill the survivor silently.
std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options = {});

// A group over a store the caller has already made this group's own (torch
// hands its backends a store prefixed per process group): rank and size as
// given, no MASTER_*, RANK or WORLD_SIZE read; the switches of InitOptions
// (or their variables), MASTER_ADDR for gloo's interface, `group_key`
// naming the group among every group on the host (the shared-memory
// segment's name hashes it). new_group on the result keeps its keys under
// `store` too. Blocks and throws as init_process_group.
std::shared_ptr<ProcessGroup> join_process_group(std::shared_ptr<store::Store> store, int rank,
                                                 int size, const std::string& group_key,
                                                 const InitOptions& options = {});

}  // namespace ctorchrun::dist
