#pragma once

// The nccl backend of libctorch_dist: NCCL on CUDA device buffers.
//
// Built as a library of its own, ctorchrun::dist_nccl (libctorch_dist_nccl),
// so that ctorchrun::dist and its consumers never need CUDA. Linking it makes
// "nccl" a backend name of init_process_group; call register_nccl_backend()
// once before (loading the library also registers it).
//
//   ctorchrun::dist::register_nccl_backend();
//   ctorchrun::dist::InitOptions options;
//   options.backend = "nccl";
//   options.device = {ctorchrun::dist::DeviceType::kCuda, -1};  // -1: LOCAL_RANK
//   auto pg = ctorchrun::dist::init_process_group(options);
//
// Set-up: rank 0 makes NCCL's unique id and publishes it under the group's
// store key "nccl_unique_id"; every rank reads it and joins one communicator
// per group (new_group makes a communicator of its own, keyed under the
// subgroup's prefix). Work is enqueued on the stream of a StreamGuard on the
// calling thread, else on the group's own (non-blocking) stream after it has
// waited for an event recorded on the legacy default stream: the op comes
// after the caller's earlier work on stream 0 and on every blocking stream
// (not on streams created cudaStreamNonBlocking: use a StreamGuard). A
// blocking call returns once the work has completed on the device; an async
// call returns at once and its Work polls the stream. Every wait first makes
// the waiting thread's stream (its StreamGuard's, else stream 0) wait for the
// op. Every call gives the calling thread's current device back (unless that
// device has no context yet: setting it would make one).
//
// Errors: every wait polls cudaEventQuery and ncclCommGetAsyncError; an
// asynchronous NCCL error or a passed timeout (default 10 min, as torch's
// NCCL) aborts the communicator (ncclCommAbort) and surfaces as the op's
// IoError or TimeoutError: the group is then unusable and the process should
// exit. Argument errors NCCL reports (invalid argument, invalid usage) are
// ConfigError.
//
// NCCL has no tags: send and recv between two ranks match in call order, and
// the tag is not checked. Gather, scatter and all_to_all are grouped
// send/recv.

#include <chrono>
#include <memory>
#include <string>

#include "collectives/backend.h"
#include "collectives/process_group.h"

struct CUstream_st;

namespace ctorchrun::dist {

// torch's default timeout for NCCL process groups.
inline constexpr std::chrono::milliseconds kNcclDefaultTimeout = kDefaultNcclTimeout;

// Makes "nccl" a name create_backend and init_process_group know.
void register_nccl_backend();

// Throws ConfigError when context.device is not a CUDA device this process
// can use; TimeoutError when the communicator is not up within
// context.timeout (the communicator is aborted); IoError for NCCL or CUDA
// failures.
std::unique_ptr<Backend> create_nccl_backend(const BackendContext& context);

// While alive, nccl operations started on this thread are enqueued on
// `stream` (a cudaStream_t) instead of the group's own stream. Nests.
class StreamGuard {
 public:
  explicit StreamGuard(CUstream_st* stream);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  CUstream_st* previous_;
};

// The stream of the innermost StreamGuard of this thread, or nullptr.
CUstream_st* current_stream_override();

}  // namespace ctorchrun::dist
