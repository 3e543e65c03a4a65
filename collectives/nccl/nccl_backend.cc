#include "collectives/nccl/nccl_backend.h"

#include <cudaTypedefs.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "collectives/nccl/nccl_internal.h"
#include "common/error.h"

namespace ctorchrun::dist {
namespace nccl_detail {
namespace {

using std::chrono::milliseconds;

constexpr const char* kUniqueIdKey = "nccl_unique_id";

// cuDevicePrimaryCtxGetState through cudart's driver entry points: the
// library links no libcuda of its own.
class PrimaryContextState {
 public:
  PrimaryContextState() {
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    void* fn = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuDeviceGet", &fn, 12000, cudaEnableDefault, &found) ==
            cudaSuccess &&
        found == cudaDriverEntryPointSuccess) {
      device_get_ = reinterpret_cast<PFN_cuDeviceGet_v2000>(fn);
    }
    fn = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &fn, 12000,
                                         cudaEnableDefault, &found) == cudaSuccess &&
        found == cudaDriverEntryPointSuccess) {
      get_state_ = reinterpret_cast<PFN_cuDevicePrimaryCtxGetState_v7000>(fn);
    }
  }
  cudaError_t active(int ordinal, bool* active) const {
    if (device_get_ == nullptr || get_state_ == nullptr) return cudaErrorNotSupported;
    CUdevice device = 0;
    unsigned flags = 0;
    int state = 0;
    if (device_get_(&device, ordinal) != CUDA_SUCCESS ||
        get_state_(device, &flags, &state) != CUDA_SUCCESS) {
      return cudaErrorInvalidDevice;
    }
    *active = state != 0;
    return cudaSuccess;
  }

 private:
  PFN_cuDeviceGet_v2000 device_get_ = nullptr;
  PFN_cuDevicePrimaryCtxGetState_v7000 get_state_ = nullptr;
};

class RealApi : public Api {
 public:
  cudaError_t get_device_count(int* count) override { return cudaGetDeviceCount(count); }
  cudaError_t get_device(int* device) override { return cudaGetDevice(device); }
  cudaError_t set_device(int device) override { return cudaSetDevice(device); }
  cudaError_t primary_context_active(int device, bool* active) override {
    static const PrimaryContextState state;
    return state.active(device, active);
  }
  cudaError_t stream_create(cudaStream_t* stream) override {
    return cudaStreamCreateWithFlags(stream, cudaStreamNonBlocking);
  }
  cudaError_t stream_destroy(cudaStream_t stream) override { return cudaStreamDestroy(stream); }
  cudaError_t stream_wait_event(cudaStream_t stream, cudaEvent_t event) override {
    return cudaStreamWaitEvent(stream, event, 0);
  }
  cudaError_t device_malloc(void** data, size_t bytes) override { return cudaMalloc(data, bytes); }
  cudaError_t device_free(void* data) override { return cudaFree(data); }
  cudaError_t memcpy_async(void* dst, const void* src, size_t bytes, cudaStream_t stream) override {
    return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
  }
  cudaError_t event_create(cudaEvent_t* event) override {
    return cudaEventCreateWithFlags(event, cudaEventDisableTiming);
  }
  cudaError_t event_record(cudaEvent_t event, cudaStream_t stream) override {
    return cudaEventRecord(event, stream);
  }
  cudaError_t event_query(cudaEvent_t event) override { return cudaEventQuery(event); }
  cudaError_t event_destroy(cudaEvent_t event) override { return cudaEventDestroy(event); }

  ncclResult_t get_unique_id(ncclUniqueId* id) override { return ncclGetUniqueId(id); }
  ncclResult_t comm_init_rank(ncclComm_t* comm, int size, ncclUniqueId id, int rank,
                              ncclConfig_t* config) override {
    return ncclCommInitRankConfig(comm, size, id, rank, config);
  }
  ncclResult_t comm_get_async_error(ncclComm_t comm, ncclResult_t* error) override {
    return ncclCommGetAsyncError(comm, error);
  }
  ncclResult_t comm_finalize(ncclComm_t comm) override { return ncclCommFinalize(comm); }
  ncclResult_t comm_destroy(ncclComm_t comm) override { return ncclCommDestroy(comm); }
  ncclResult_t comm_abort(ncclComm_t comm) override { return ncclCommAbort(comm); }
  ncclResult_t group_start() override { return ncclGroupStart(); }
  ncclResult_t group_end() override { return ncclGroupEnd(); }
  ncclResult_t all_reduce(const void* in, void* out, size_t count, ncclDataType_t type,
                          ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) override {
    return ncclAllReduce(in, out, count, type, op, comm, stream);
  }
  ncclResult_t broadcast(const void* in, void* out, size_t count, ncclDataType_t type, int root,
                         ncclComm_t comm, cudaStream_t stream) override {
    return ncclBroadcast(in, out, count, type, root, comm, stream);
  }
  ncclResult_t reduce(const void* in, void* out, size_t count, ncclDataType_t type, ncclRedOp_t op,
                      int root, ncclComm_t comm, cudaStream_t stream) override {
    return ncclReduce(in, out, count, type, op, root, comm, stream);
  }
  ncclResult_t all_gather(const void* in, void* out, size_t count, ncclDataType_t type,
                          ncclComm_t comm, cudaStream_t stream) override {
    return ncclAllGather(in, out, count, type, comm, stream);
  }
  ncclResult_t reduce_scatter(const void* in, void* out, size_t count, ncclDataType_t type,
                              ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) override {
    return ncclReduceScatter(in, out, count, type, op, comm, stream);
  }
  ncclResult_t send(const void* in, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                    cudaStream_t stream) override {
    return ncclSend(in, count, type, peer, comm, stream);
  }
  ncclResult_t recv(void* out, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                    cudaStream_t stream) override {
    return ncclRecv(out, count, type, peer, comm, stream);
  }
};

std::atomic<Api*> replacement{nullptr};

}  // namespace

Api& api() {
  static RealApi real;
  Api* replaced = replacement.load();
  return replaced != nullptr ? *replaced : real;
}

Api* replace_api(Api* api) { return replacement.exchange(api); }

DeviceGuard::DeviceGuard(Api& calls, int device) : api_(calls) {
  int current = -1;
  const bool known = api_.get_device(&current) == cudaSuccess;
  if (known && current == device) return;
  result_ = api_.set_device(device);
  if (known && result_ == cudaSuccess) previous_ = current;
}

DeviceGuard::~DeviceGuard() {
  if (previous_ < 0) return;
  bool active = true;  // when the driver cannot tell: give it back
  if (api_.primary_context_active(previous_, &active) != cudaSuccess) active = true;
  if (active) api_.set_device(previous_);
}

std::exception_ptr nccl_error(ncclResult_t result, const std::string& what) {
  std::string message = "nccl: " + what + ": " + ncclGetErrorString(result);
  switch (result) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return std::make_exception_ptr(ConfigError(message));
    default:
      return std::make_exception_ptr(IoError(message));
  }
}

std::exception_ptr cuda_error(cudaError_t result, const std::string& what) {
  std::string message = "nccl: " + what + ": CUDA error " + std::to_string(int(result)) + " (" +
                        cudaGetErrorName(result) + ": " + cudaGetErrorString(result) + ")";
  switch (result) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
    case cudaErrorDevicesUnavailable:
      return std::make_exception_ptr(ConfigError(message));
    default:
      return std::make_exception_ptr(IoError(message));
  }
}

ncclUniqueId exchange_unique_id(Api& calls, store::Store& store, int rank, milliseconds timeout) {
  ncclUniqueId id{};
  if (rank == 0) {
    ncclResult_t result = calls.get_unique_id(&id);
    if (result != ncclSuccess) std::rethrow_exception(nccl_error(result, "ncclGetUniqueId"));
    store.set(kUniqueIdKey, std::string(id.internal, sizeof id.internal));
    return id;
  }
  try {
    store.wait({kUniqueIdKey}, timeout);
  } catch (const TimeoutError&) {
    throw TimeoutError("nccl: rank " + std::to_string(rank) + " waited " +
                       std::to_string(timeout.count()) + " ms for rank 0's unique id (store key " +
                       kUniqueIdKey + ")");
  }
  std::string value = store.get(kUniqueIdKey);
  if (value.size() != sizeof id.internal) {
    throw ProtocolError("nccl: the unique id in the store holds " + std::to_string(value.size()) +
                        " bytes, not " + std::to_string(sizeof id.internal));
  }
  std::memcpy(id.internal, value.data(), value.size());
  return id;
}

Communicator::~Communicator() {
  if (aborted_.load() || comm_ == nullptr) return;
  // Finalize flushes outstanding work; bounded, then destroy (or abort).
  if (api_.comm_finalize(comm_) == ncclInProgress) {
    const auto until = Clock::now() + std::chrono::seconds(10);
    ncclResult_t state = ncclInProgress;
    while (state == ncclInProgress && Clock::now() < until) {
      if (api_.comm_get_async_error(comm_, &state) != ncclSuccess) break;
      if (state == ncclInProgress) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (state != ncclSuccess) {
      abort();
      return;
    }
  }
  api_.comm_destroy(comm_);
}

void Communicator::abort() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_.exchange(true)) return;
  api_.comm_abort(comm_);  // the op's own error is what the caller sees
}

void Communicator::throw_aborted(const std::string& what) {
  throw IoError("nccl: " + what + ": the communicator was aborted by an earlier failure");
}

void await(Communicator& comm, cudaEvent_t event, Clock::time_point abort_at,
           Clock::time_point give_up_at, milliseconds timeout, const std::string& what) {
  auto pause = std::chrono::microseconds(20);
  for (;;) {
    if (comm.aborted()) Communicator::throw_aborted(what);
    if (event != nullptr) {
      cudaError_t state = comm.calls().event_query(event);
      if (state == cudaSuccess) return;
      if (state != cudaErrorNotReady) {
        comm.abort();
        std::rethrow_exception(cuda_error(state, what));
      }
    }
    ncclResult_t async = comm.use(what, [&](ncclComm_t raw) {
      ncclResult_t state = ncclSuccess;
      ncclResult_t queried = comm.calls().comm_get_async_error(raw, &state);
      return queried != ncclSuccess ? queried : state;
    });
    if (event == nullptr && async == ncclSuccess) return;
    if (async != ncclSuccess && async != ncclInProgress) {
      comm.abort();
      std::rethrow_exception(
          nccl_error(async, what + " (asynchronous error; communicator aborted)"));
    }
    const auto now = Clock::now();
    if (now >= abort_at) {
      comm.abort();
      throw TimeoutError("nccl: " + what + " did not complete within " +
                         std::to_string(timeout.count()) +
                         " ms; communicator aborted (a rank stalled, died or called a different "
                         "collective)");
    }
    if (now >= give_up_at) {
      throw TimeoutError("nccl: " + what + " is still running; gave up waiting for it");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

EventWork::EventWork(std::shared_ptr<Communicator> comm, cudaEvent_t event, int device,
                     cudaStream_t stream, milliseconds timeout, std::string what)
    : comm_(std::move(comm)),
      event_(event),
      device_(device),
      stream_(stream),
      timeout_(timeout),
      abort_at_(Clock::now() + timeout),
      what_(std::move(what)) {}

EventWork::~EventWork() {
  if (event_ != nullptr) comm_->calls().event_destroy(event_);
}

void EventWork::wait() { wait_until(Clock::time_point::max()); }
void EventWork::wait(milliseconds timeout) { wait_until(Clock::now() + timeout); }

bool EventWork::is_completed() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (done_) return true;
  if (comm_->calls().event_query(event_) == cudaSuccess) done_ = true;
  return done_;
}

void EventWork::wait_until(Clock::time_point give_up_at) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!done_) {
    try {
      order_callers_stream();
      await(*comm_, event_, abort_at_, give_up_at, timeout_, what_);
    } catch (const TimeoutError&) {
      if (!comm_->aborted()) throw;  // gave up early: the op goes on
      error_ = std::current_exception();
    } catch (...) {
      error_ = std::current_exception();
    }
    done_ = true;
  }
  if (error_) std::rethrow_exception(error_);
}

void EventWork::order_callers_stream() {
  if (comm_->aborted()) return;  // await throws; the op's stream may never finish
  cudaStream_t caller = current_stream_override();
  if (caller == nullptr) caller = cudaStreamLegacy;
  if (caller == stream_) return;  // the op is on the caller's stream already
  Api& calls = comm_->calls();
  DeviceGuard device(calls, device_);  // cudaStreamLegacy is the current device's
  if (device.result() != cudaSuccess) {
    std::rethrow_exception(cuda_error(device.result(), what_ + ": cudaSetDevice"));
  }
  const cudaError_t waited = calls.stream_wait_event(caller, event_);
  if (waited != cudaSuccess) {
    std::rethrow_exception(cuda_error(waited, what_ + ": cudaStreamWaitEvent"));
  }
}

namespace {

thread_local CUstream_st* stream_override = nullptr;

void check_cuda(cudaError_t result, const std::string& what) {
  if (result != cudaSuccess) std::rethrow_exception(cuda_error(result, what));
}

ncclDataType_t nccl_type(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
      return ncclFloat32;
    case DataType::kFloat64:
      return ncclFloat64;
    case DataType::kFloat16:
      return ncclFloat16;
    case DataType::kBFloat16:
      return ncclBfloat16;
    case DataType::kInt8:
      return ncclInt8;
    case DataType::kUInt8:
      return ncclUint8;
    case DataType::kInt32:
      return ncclInt32;
    case DataType::kInt64:
      return ncclInt64;
  }
  throw ConfigError("nccl: unknown data type");
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kProduct:
      return ncclProd;
    case ReduceOp::kMin:
      return ncclMin;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kAverage:
      return ncclAvg;
  }
  throw ConfigError("nccl: unknown reduction");
}

char* at(const Buffer& b, size_t slice, size_t slice_count) {
  return static_cast<char*>(b.data) + slice * slice_count * element_size(b.dtype);
}

class NcclBackend : public Backend {
 public:
  static constexpr std::chrono::seconds kDrainTimeout{30};

  NcclBackend(const BackendContext& context, std::shared_ptr<Communicator> comm,
              cudaStream_t stream, cudaEvent_t ready, void* scratch)
      : api_(comm->calls()),
        rank_(context.rank),
        size_(context.size),
        device_(context.device.index),
        comm_(std::move(comm)),
        stream_(stream),
        ready_(ready),
        scratch_(scratch) {}
  ~NcclBackend() override {
    DeviceGuard device(api_, device_);
    // Drain the group's stream, bounded: a stream stuck on a dead peer is
    // aborted instead of hanging the destructor.
    cudaEvent_t last = nullptr;
    if (!comm_->aborted() && api_.event_create(&last) == cudaSuccess) {
      if (api_.event_record(last, stream_) == cudaSuccess) {
        try {
          await(*comm_, last, Clock::now() + kDrainTimeout, Clock::time_point::max(),
                std::chrono::duration_cast<milliseconds>(kDrainTimeout), "draining the group");
        } catch (const std::exception&) {
          // await aborted the communicator; nothing is left to wait for.
        }
      }
      api_.event_destroy(last);
    }
    comm_.reset();
    api_.device_free(scratch_);
    api_.event_destroy(ready_);
    api_.stream_destroy(stream_);
  }

  std::string name() const override { return "nccl"; }

  WorkHandle run(const Op& op, bool async) override {
    const std::string what = std::string(to_string(op.type)) + " on rank " + std::to_string(rank_) +
                             "/" + std::to_string(size_);
    for (const Buffer* b : {&op.input, &op.output}) {
      if (b->count > 0 && b->device.index != device_) {
        throw ConfigError("nccl: " + what + ": a buffer is on " + to_string(b->device) +
                          " but the group works on cuda:" + std::to_string(device_));
      }
    }
    if (comm_->aborted()) Communicator::throw_aborted(what);
    std::unique_lock<std::mutex> lock(mutex_);  // one enqueue at a time: same order on every rank
    DeviceGuard device(api_, device_);
    check_cuda(device.result(), what + ": cudaSetDevice");
    const bool guarded = stream_override != nullptr;
    cudaStream_t stream = guarded ? stream_override : stream_;
    if (!guarded) {
      // The group's stream is non-blocking: it must wait for what the caller
      // enqueued before this op (producer kernels, a cudaMemcpyAsync, the DMA
      // of a pageable cudaMemcpy that may still be running after it returned).
      // An event recorded on the legacy default stream covers its work and,
      // since it waits for them, every blocking stream's (the per-thread
      // default streams included).
      check_cuda(api_.event_record(ready_, cudaStreamLegacy), what + ": cudaEventRecord");
      check_cuda(api_.stream_wait_event(stream_, ready_), what + ": cudaStreamWaitEvent");
    }
    const auto abort_at = deadline_of(op);
    // Under the communicator's lock: an abort waits until the op is enqueued
    // (ncclGroupEnd launches it), and an aborted communicator is not entered.
    const ncclResult_t result = comm_->use(what, [&](ncclComm_t comm) {
      ncclResult_t enqueued = api_.group_start();
      if (enqueued != ncclSuccess) return enqueued;
      try {
        enqueued = enqueue(op, comm, stream);
      } catch (...) {
        api_.group_end();  // the group is per thread: never leave it open
        throw;
      }
      ncclResult_t ended = api_.group_end();
      return enqueued == ncclSuccess ? ended : enqueued;
    });
    if (result != ncclSuccess && result != ncclInProgress) {
      std::rethrow_exception(nccl_error(result, what));
    }
    await(*comm_, nullptr, abort_at, Clock::time_point::max(), op.timeout, what + " (enqueue)");
    cudaEvent_t event = nullptr;
    check_cuda(api_.event_create(&event), what + ": event");
    cudaError_t recorded = api_.event_record(event, stream);
    if (recorded != cudaSuccess) {
      api_.event_destroy(event);
      std::rethrow_exception(cuda_error(recorded, what + ": cudaEventRecord"));
    }
    auto work = std::make_shared<EventWork>(comm_, event, device_, stream, op.timeout, what);
    lock.unlock();  // others may enqueue behind this op while it runs
    if (!async) work->wait();
    return work;
  }

 private:
  ncclResult_t enqueue(const Op& op, ncclComm_t comm, cudaStream_t stream) {
    const Buffer& in = op.input;
    const Buffer& out = op.output;
    switch (op.type) {
      case OpType::kAllReduce:
        return api_.all_reduce(out.data, out.data, out.count, nccl_type(out.dtype),
                               nccl_op(op.reduce), comm, stream);
      case OpType::kBroadcast:
        return api_.broadcast(out.data, out.data, out.count, nccl_type(out.dtype), op.peer, comm,
                              stream);
      case OpType::kReduce:
        return api_.reduce(out.data, out.data, out.count, nccl_type(out.dtype), nccl_op(op.reduce),
                           op.peer, comm, stream);
      case OpType::kAllGather:
        return api_.all_gather(in.data, out.data, in.count, nccl_type(in.dtype), comm, stream);
      case OpType::kReduceScatter:
        return api_.reduce_scatter(in.data, out.data, out.count, nccl_type(in.dtype),
                                   nccl_op(op.reduce), comm, stream);
      case OpType::kBarrier:
        return api_.all_reduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, comm, stream);
      case OpType::kSend:
        return api_.send(in.data, in.count, nccl_type(in.dtype), op.peer, comm, stream);
      case OpType::kRecv:
        return api_.recv(out.data, out.count, nccl_type(out.dtype), op.peer, comm, stream);
      case OpType::kGather:
        return gather_like(op, comm, stream, /*scatter=*/false);
      case OpType::kScatter:
        return gather_like(op, comm, stream, /*scatter=*/true);
      case OpType::kAllToAll: {
        const size_t slice = in.count / static_cast<size_t>(size_);
        const size_t bytes = slice * element_size(in.dtype);
        for (int r = 0; r < size_; ++r) {
          const auto s = static_cast<size_t>(r);
          if (r == rank_) {
            if (api_.memcpy_async(at(out, s, slice), at(in, s, slice), bytes, stream) !=
                cudaSuccess) {
              return ncclUnhandledCudaError;
            }
            continue;
          }
          ncclResult_t r1 =
              api_.send(at(in, s, slice), slice, nccl_type(in.dtype), r, comm, stream);
          if (r1 != ncclSuccess) return r1;
          ncclResult_t r2 =
              api_.recv(at(out, s, slice), slice, nccl_type(in.dtype), r, comm, stream);
          if (r2 != ncclSuccess) return r2;
        }
        return ncclSuccess;
      }
    }
    return ncclInvalidArgument;
  }

  // gather: every rank's input into slice r of root's output; scatter: slice
  // r of root's input to rank r's output.
  ncclResult_t gather_like(const Op& op, ncclComm_t comm, cudaStream_t stream, bool scatter) {
    const Buffer& mine = scatter ? op.output : op.input;  // this rank's slice
    const Buffer& whole = scatter ? op.input : op.output;
    const size_t slice = mine.count;
    const ncclDataType_t type = nccl_type(mine.dtype);
    if (rank_ != op.peer) {
      return scatter ? api_.recv(mine.data, slice, type, op.peer, comm, stream)
                     : api_.send(mine.data, slice, type, op.peer, comm, stream);
    }
    for (int r = 0; r < size_; ++r) {
      char* part = at(whole, static_cast<size_t>(r), slice);
      if (r == rank_) {
        void* dst = scatter ? mine.data : static_cast<void*>(part);
        const void* src = scatter ? static_cast<const void*>(part) : mine.data;
        if (slice > 0 &&
            api_.memcpy_async(dst, src, slice * element_size(mine.dtype), stream) != cudaSuccess) {
          return ncclUnhandledCudaError;
        }
        continue;
      }
      ncclResult_t result = scatter ? api_.send(part, slice, type, r, comm, stream)
                                    : api_.recv(part, slice, type, r, comm, stream);
      if (result != ncclSuccess) return result;
    }
    return ncclSuccess;
  }

  Api& api_;
  int rank_;
  int size_;
  int device_;
  std::shared_ptr<Communicator> comm_;
  cudaStream_t stream_;
  cudaEvent_t ready_;  // recorded on the legacy stream before each op, under mutex_
  void* scratch_;
  std::mutex mutex_;
};

}  // namespace
}  // namespace nccl_detail

using nccl_detail::check_cuda;
using nccl_detail::Clock;

StreamGuard::StreamGuard(CUstream_st* stream) : previous_(nccl_detail::stream_override) {
  nccl_detail::stream_override = stream;
}
StreamGuard::~StreamGuard() { nccl_detail::stream_override = previous_; }
CUstream_st* current_stream_override() { return nccl_detail::stream_override; }

std::unique_ptr<Backend> create_nccl_backend(const BackendContext& context) {
  using std::chrono::milliseconds;
  if (context.device.type != DeviceType::kCuda || context.device.index < 0) {
    throw ConfigError("the nccl backend works on CUDA devices; device " +
                      to_string(context.device) +
                      " cannot be used (InitOptions::device = {DeviceType::kCuda, index})");
  }
  if (context.size < 1 || context.rank < 0 || context.rank >= context.size) {
    throw ConfigError("nccl: rank " + std::to_string(context.rank) + " is not in [0, " +
                      std::to_string(context.size) + ")");
  }
  const auto deadline = Clock::now() + context.timeout;
  nccl_detail::Api& calls = nccl_detail::api();
  int devices = 0;
  check_cuda(calls.get_device_count(&devices), "cudaGetDeviceCount");
  if (context.device.index >= devices) {
    throw ConfigError("nccl: device " + to_string(context.device) + " does not exist (" +
                      std::to_string(devices) + " CUDA device(s) visible)");
  }
  ncclUniqueId id =
      nccl_detail::exchange_unique_id(calls, *context.store, context.rank, context.timeout);
  nccl_detail::DeviceGuard device(calls, context.device.index);
  check_cuda(device.result(), "cudaSetDevice");
  cudaStream_t stream = nullptr;
  check_cuda(calls.stream_create(&stream), "cudaStreamCreate");
  cudaEvent_t ready = nullptr;
  void* scratch = nullptr;
  auto release = [&] {
    if (scratch != nullptr) calls.device_free(scratch);
    if (ready != nullptr) calls.event_destroy(ready);
    calls.stream_destroy(stream);
  };
  cudaError_t made = calls.event_create(&ready);
  if (made != cudaSuccess) {
    ready = nullptr;
    release();
    std::rethrow_exception(nccl_detail::cuda_error(made, "cudaEventCreate"));
  }
  made = calls.device_malloc(&scratch, sizeof(float));
  if (made != cudaSuccess) {
    scratch = nullptr;
    release();
    std::rethrow_exception(nccl_detail::cuda_error(made, "cudaMalloc"));
  }
  // Non-blocking: set-up returns at once and is polled, so it is bounded.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t raw = nullptr;
  ncclResult_t result = calls.comm_init_rank(&raw, context.size, id, context.rank, &config);
  if (result != ncclSuccess && result != ncclInProgress) {
    if (raw != nullptr) calls.comm_abort(raw);
    release();
    std::rethrow_exception(nccl_detail::nccl_error(result, "ncclCommInitRankConfig"));
  }
  auto comm = std::make_shared<nccl_detail::Communicator>(calls, raw);
  try {
    nccl_detail::await(*comm, nullptr, deadline, Clock::time_point::max(), context.timeout,
                       "communicator set-up (rank " + std::to_string(context.rank) + " of " +
                           std::to_string(context.size) + ")");
  } catch (...) {
    comm.reset();
    release();
    throw;
  }
  return std::make_unique<nccl_detail::NcclBackend>(context, std::move(comm), stream, ready,
                                                    scratch);
}

void register_nccl_backend() { register_backend("nccl", create_nccl_backend); }

namespace {
// Loading the library registers the backend.
const bool registered = (register_nccl_backend(), true);
}  // namespace

}  // namespace ctorchrun::dist
