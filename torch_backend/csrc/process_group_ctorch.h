#pragma once

// ProcessGroupCtorch: libctorch_dist as a torch.distributed backend, named
// "ctorch". A thin adapter: it turns torch's tensors, options and store into
// libctorch_dist's buffers, ops and store, and libctorch_dist's Work into
// torch's Work and Future. Which transport runs (shared memory on one host,
// shared memory within hosts and gloo between them, or gloo) is
// libctorch_dist's choice, as for a C++ worker, with the same switches
// (CTORCHRUN_DIST_SHM, CTORCHRUN_DIST_CHECK_CALLS).
//
// One source for every torch: on torch 1.x a backend is a
// c10d::ProcessGroup, on 2.x a c10d::Backend (registered for the CPU under
// a ProcessGroup that torch makes).
//
// Tensors: CPU, dense, one per call (torch's list arguments hold one tensor
// per process), of float32, float64, float16, bfloat16, int8, uint8, int32,
// int64 or bool (bool: data movement, MIN, MAX and PRODUCT). Non-contiguous
// tensors go through a contiguous copy and are written back. Anything else
// is a c10::Error naming the operation (a RuntimeError in Python) before
// any data moves.
//
// Work: every call is queued in the group's order and returns at once; its
// Work completes, and its Future gets the output tensors, on the group's
// queue thread (or a send's or recv's own thread); wait() and the Future
// carry the operation's error: a peer that died is an IoError's message
// naming it, within about a second on one host.

#include <torch/version.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "collectives/process_group.h"

namespace ctorchrun::torch_backend {

#if TORCH_VERSION_MAJOR >= 2
using BackendBase = c10d::Backend;
#else
using BackendBase = c10d::ProcessGroup;
#endif

// What torch's extended registration API hands a backend.
struct GroupOptions {
  c10::intrusive_ptr<c10d::Store> store;
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{30 * 60 * 1000};
  std::string group_id;
};

class StagingPool;

class ProcessGroupCtorch : public BackendBase {
 public:
  // Blocks until every rank of the group has arrived (at most the timeout);
  // throws c10::Error when set-up fails (a rank never came, the store
  // failed).
  explicit ProcessGroupCtorch(const GroupOptions& options);
  ~ProcessGroupCtorch() override;

  const std::string getBackendName() const override { return "ctorch"; }
  // "shm", "hier" or "gloo": what moves this group's data.
  std::string transport() const { return group_->transport(); }
  // torch sets the sequence number of a group it takes for gloo or nccl
  // (--cpu_backend ctorch records gloo groups as gloo): 0 on every rank.
  // It stays 0: libctorch_dist checks that the ranks' calls match itself
  // (CTORCHRUN_DIST_CHECK_CALLS), so torch's desync report has nothing to add.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return 0; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
#if TORCH_VERSION_MAJOR >= 2
  // torch 2.x's coalescing manager (FSDP) calls these two.
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
#endif
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;

 private:
  std::shared_ptr<dist::ProcessGroup> group_;
  // Staging buffers kept across calls (list forms: all_gather, scatter, ...).
  std::shared_ptr<StagingPool> pool_;
};

// torch's creator function for register_backend(extended_api=True).
c10::intrusive_ptr<BackendBase> create_process_group(const GroupOptions& options);

}  // namespace ctorchrun::torch_backend
