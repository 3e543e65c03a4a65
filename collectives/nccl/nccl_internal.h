#pragma once

// Inside the nccl backend: every CUDA and NCCL call it makes, behind an
// interface tests replace on machines without a GPU (a stalled stream, an
// asynchronous NCCL error, the order of the calls); the error mapping; the
// unique id exchange. Not installed.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <memory>
#include <mutex>
#include <string>

#include "collectives/work.h"
#include "store/store.h"

namespace ctorchrun::dist::nccl_detail {

using Clock = std::chrono::steady_clock;

// Every CUDA runtime and NCCL call the backend makes goes through this table,
// so that tests can drive set-up, enqueue, completion and abort on a machine
// without a GPU and observe the order of the calls.
class Api {
 public:
  virtual ~Api() = default;

  // CUDA runtime.
  virtual cudaError_t get_device_count(int* count) = 0;
  virtual cudaError_t get_device(int* device) = 0;
  virtual cudaError_t set_device(int device) = 0;
  // Whether `device`'s primary context is active (cuDevicePrimaryCtxGetState).
  virtual cudaError_t primary_context_active(int device, bool* active) = 0;
  // A stream created cudaStreamNonBlocking.
  virtual cudaError_t stream_create(cudaStream_t* stream) = 0;
  virtual cudaError_t stream_destroy(cudaStream_t stream) = 0;
  virtual cudaError_t stream_wait_event(cudaStream_t stream, cudaEvent_t event) = 0;
  virtual cudaError_t device_malloc(void** data, size_t bytes) = 0;
  virtual cudaError_t device_free(void* data) = 0;
  // cudaMemcpyDeviceToDevice on `stream`.
  virtual cudaError_t memcpy_async(void* dst, const void* src, size_t bytes,
                                   cudaStream_t stream) = 0;
  // An event created cudaEventDisableTiming.
  virtual cudaError_t event_create(cudaEvent_t* event) = 0;
  virtual cudaError_t event_record(cudaEvent_t event, cudaStream_t stream) = 0;
  virtual cudaError_t event_query(cudaEvent_t event) = 0;
  virtual cudaError_t event_destroy(cudaEvent_t event) = 0;

  // NCCL.
  virtual ncclResult_t get_unique_id(ncclUniqueId* id) = 0;
  virtual ncclResult_t comm_init_rank(ncclComm_t* comm, int size, ncclUniqueId id, int rank,
                                      ncclConfig_t* config) = 0;
  virtual ncclResult_t comm_get_async_error(ncclComm_t comm, ncclResult_t* error) = 0;
  virtual ncclResult_t comm_finalize(ncclComm_t comm) = 0;
  virtual ncclResult_t comm_destroy(ncclComm_t comm) = 0;
  virtual ncclResult_t comm_abort(ncclComm_t comm) = 0;
  virtual ncclResult_t group_start() = 0;
  virtual ncclResult_t group_end() = 0;
  virtual ncclResult_t all_reduce(const void* in, void* out, size_t count, ncclDataType_t type,
                                  ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) = 0;
  virtual ncclResult_t broadcast(const void* in, void* out, size_t count, ncclDataType_t type,
                                 int root, ncclComm_t comm, cudaStream_t stream) = 0;
  virtual ncclResult_t reduce(const void* in, void* out, size_t count, ncclDataType_t type,
                              ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) = 0;
  virtual ncclResult_t all_gather(const void* in, void* out, size_t count, ncclDataType_t type,
                                  ncclComm_t comm, cudaStream_t stream) = 0;
  virtual ncclResult_t reduce_scatter(const void* in, void* out, size_t count, ncclDataType_t type,
                                      ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) = 0;
  virtual ncclResult_t send(const void* in, size_t count, ncclDataType_t type, int peer,
                            ncclComm_t comm, cudaStream_t stream) = 0;
  virtual ncclResult_t recv(void* out, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                            cudaStream_t stream) = 0;
};

// The Api every backend of this process uses: NCCL and CUDA unless replaced.
Api& api();
// Replaces the Api (nullptr: back to NCCL and CUDA); returns the previous
// replacement. For tests; not safe while groups exist.
Api* replace_api(Api* replacement);

// Makes `device` the calling thread's current device while alive and gives
// the caller's back after (cudaSetDevice is per thread: a collective must
// not move the caller's work to the group's device). A caller's device
// without an active primary context (a thread that never chose one: CUDA
// says 0) is left alone, as torch's device guards do: setting it back would
// make a context there (hundreds of MiB on cuda:0 in every rank's process);
// the thread stays on `device`.
class DeviceGuard {
 public:
  DeviceGuard(Api& api, int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  // The result of making `device` current (cudaSuccess when it already was).
  cudaError_t result() const { return result_; }

 private:
  Api& api_;
  int previous_ = -1;  // -1: nothing to give back
  cudaError_t result_ = cudaSuccess;
};

// The error an NCCL result stands for: ConfigError for invalid arguments and
// usage, IoError for the rest (system, remote, CUDA, internal).
std::exception_ptr nccl_error(ncclResult_t result, const std::string& what);
// The error a CUDA result stands for: ConfigError when no usable device is
// there (no device, no or old driver, bad ordinal), IoError for the rest.
std::exception_ptr cuda_error(cudaError_t result, const std::string& what);

// Rank 0 makes the unique id and sets it under "nccl_unique_id"; the others
// wait for it (TimeoutError naming the key after `timeout`).
ncclUniqueId exchange_unique_id(Api& api, store::Store& store, int rank,
                                std::chrono::milliseconds timeout);

// A communicator with its abort state. Every use of it, and its abort, hold
// one lock: ncclCommAbort frees the communicator, so it must never run while
// another thread is inside an NCCL call on it (enqueueing an op, polling its
// asynchronous error), and nothing may use it afterwards.
class Communicator {
 public:
  Communicator(Api& api, ncclComm_t comm) : api_(api), comm_(comm) {}
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  Api& calls() const { return api_; }
  bool aborted() const { return aborted_.load(); }
  // Calls use(comm) under the lock; IoError naming `what`, without calling
  // it, once the communicator has been aborted. `use` must not call abort().
  template <typename Use>
  auto use(const std::string& what, Use&& use) -> decltype(use(ncclComm_t{})) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (aborted_.load()) throw_aborted(what);
    return use(comm_);
  }
  // Calls ncclCommAbort once, after any use in progress has left.
  void abort();

  [[noreturn]] static void throw_aborted(const std::string& what);

 private:
  Api& api_;
  ncclComm_t comm_;
  std::atomic<bool> aborted_{false};
  std::mutex mutex_;
};

// Polls until `event` has completed (with a null event: until the
// communicator has no call in progress). An asynchronous NCCL error or a
// failed event query aborts the communicator and throws the mapped error;
// passing `abort_at` aborts it and throws TimeoutError (`timeout` is named in
// the message); passing `give_up_at` (earlier) throws TimeoutError and leaves
// the communicator running.
void await(Communicator& comm, cudaEvent_t event, Clock::time_point abort_at,
           Clock::time_point give_up_at, std::chrono::milliseconds timeout,
           const std::string& what);

// The Work of one enqueued op: an event recorded after it on its stream.
// wait() ends at the op's timeout by aborting the communicator (TimeoutError,
// and every later wait throws it too); wait(timeout) gives up earlier with a
// TimeoutError of its own and leaves the op running. Every wait first makes
// the waiting thread's stream (its StreamGuard's, else the legacy default
// stream of `device`) wait for the event, unless that is the op's `stream`:
// work it enqueues afterwards sees the op's results, even after giving up.
class EventWork : public Work {
 public:
  EventWork(std::shared_ptr<Communicator> comm, cudaEvent_t event, int device, cudaStream_t stream,
            std::chrono::milliseconds timeout, std::string what);
  ~EventWork() override;

  void wait() override;
  void wait(std::chrono::milliseconds timeout) override;
  bool is_completed() override;

 private:
  void wait_until(Clock::time_point give_up_at);

  void order_callers_stream();

  std::shared_ptr<Communicator> comm_;
  cudaEvent_t event_;
  int device_;
  cudaStream_t stream_;
  std::chrono::milliseconds timeout_;
  Clock::time_point abort_at_;
  std::string what_;
  std::mutex mutex_;
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace ctorchrun::dist::nccl_detail
